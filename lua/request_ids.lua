-- Request ids in their keys, as the module keeps them (core/src/replay.rs, src/replay.rs):
-- the reply of a call given an id is remembered in a field of its first key,
-- `id:<command>:<request-id>`, valued `<forgotten at, Unix ms> <reply>[ h|c<tokens>,<until>,
-- <chain>,<charged>]`. Not a script of its own: the first part of quota.lua and
-- window.lua, which the clients load as this file followed by theirs.
--
-- A script cannot know the module's load arguments: it keeps ids the default ID-SECONDS
-- (300) and ID-MAX (1000). Numbers are Lua doubles: exact up to 2^53, as every count and
-- time a call makes; the 64-bit hashes (the chain of keys, which calls look through a key's
-- ids) are computed in 16-bit limbs, exactly.

local ID_MILLIS = 300 * 1000
local ID_MAX = 1000
-- The most fields a key holds besides its ids; a key looks through its ids at least once
-- in LOOK_EVERY_MIN calls that remember one, and once in its fields over LOOK_SHARE.
local OWN_FIELDS_MOST, LOOK_EVERY_MIN, LOOK_SHARE = 16, 32, 4

-- a / b rounded down, for whole numbers below 2^53 (b > 0), exactly.
local function idiv(a, b)
  local q = math.floor(a / b)
  if q * b > a then
    q = q - 1
  elseif (q + 1) * b <= a then
    q = q + 1
  end
  return q
end

-- An integer as the module reads one (an i64: an optional sign, then digits): its value
-- (a double) and its shortest text; nil for anything else.
local function integer(text)
  if text == nil or text == false then
    return nil
  end
  local sign, digits = string.match(text, '^([+-]?)(%d+)$')
  if digits == nil then
    return nil
  end
  digits = string.match(digits, '^0*(%d.*)$')
  local negative = sign == '-' and digits ~= '0'
  local most = negative and '9223372036854775808' or '9223372036854775807'
  if #digits > 19 or (#digits == 19 and digits > most) then
    return nil
  end
  local canonical = (negative and '-' or '') .. digits
  return tonumber(canonical), canonical
end

-- A count as the module reads one: a non-negative integer, else 0.
local function stored_count(text)
  local n = integer(text)
  if n == nil or n < 0 then
    return 0
  end
  return n
end

-- A whole number as decimal text (exact below 2^63).
local function decimal(n)
  return string.format('%d', n)
end

-- Every piece of `text` between `separator`s, empty ones included.
local function split(text, separator)
  local pieces, start = {}, 1
  while true do
    local at = string.find(text, separator, start, true)
    if at == nil then
      pieces[#pieces + 1] = string.sub(text, start)
      return pieces
    end
    pieces[#pieces + 1] = string.sub(text, start, at - 1)
    start = at + 1
  end
end

-- Unsigned 64-bit numbers as four 16-bit limbs, lowest first, passed as four values (no
-- table: these run on every call with an id). Shifts, rotations and products are plain
-- arithmetic on doubles, exact below 2^53; only XOR needs the bit library.

local function xor(a0, a1, a2, a3, b0, b1, b2, b3)
  return bit.bxor(a0, b0), bit.bxor(a1, b1), bit.bxor(a2, b2), bit.bxor(a3, b3)
end

-- The number `n` (0 to 2^53) as limbs.
local function limbs_of(n)
  local a0 = n % 65536
  n = (n - a0) / 65536
  local a1 = n % 65536
  n = (n - a1) / 65536
  local a2 = n % 65536
  return a0, a1, a2, (n - a2) / 65536
end

-- The number rotated left by `k` bits (1 to 63): limbs 4 to 7 of the number written twice
-- over eight limbs and shifted left by k, each the sum of two disjoint parts.
local function rotate_left(a0, a1, a2, a3, k)
  local l = {[0] = a0, a1, a2, a3, a0, a1, a2, a3}
  local q, r = math.floor(k / 16), k % 16
  local function limb(i)
    local high, low = l[i - q], l[i - q - 1] or 0
    return (high * 2 ^ r) % 65536 + math.floor(low / 2 ^ (16 - r))
  end
  return limb(4), limb(5), limb(6), limb(7)
end

-- x XOR (x >> 33), the mixing step of `replay::pick` (x >> 33 fits limbs 0 and 1).
local function fold33(a0, a1, a2, a3)
  return bit.bxor(a0, math.floor(a2 / 2) + (a3 % 2) * 32768), bit.bxor(a1, math.floor(a3 / 2)),
    a2, a3
end

-- a × b modulo 2^64.
local function multiply(a0, a1, a2, a3, b0, b1, b2, b3)
  local t = a0 * b0
  local r0 = t % 65536
  t = (t - r0) / 65536 + a0 * b1 + a1 * b0
  local r1 = t % 65536
  t = (t - r1) / 65536 + a0 * b2 + a1 * b1 + a2 * b0
  local r2 = t % 65536
  t = (t - r2) / 65536 + a0 * b3 + a1 * b2 + a2 * b1 + a3 * b0
  return r0, r1, r2, t % 65536
end

-- The bytes of `text` (at most 8) as one big-endian number.
local function word(text)
  local l, n = {[0] = 0, 0, 0, 0}, #text
  for i = 1, n do
    local at = (n - i) * 8
    local limb = math.floor(at / 16)
    l[limb] = l[limb] + string.byte(text, i) * 2 ^ (at % 16)
  end
  return l[0], l[1], l[2], l[3]
end

-- The limbs read as a signed 64-bit number, in decimal.
local function signed_decimal(a0, a1, a2, a3)
  local l, sign = {a0, a1, a2, a3}, ''
  if a3 >= 0x8000 then
    sign = '-'
    local carry = 1
    for i = 1, 4 do
      local v = 0xffff - l[i] + carry
      l[i] = v % 65536
      carry = (v - l[i]) / 65536
    end
  end
  local groups = {}
  repeat
    local rest = 0
    for i = 4, 1, -1 do
      local v = rest * 65536 + l[i]
      l[i] = math.floor(v / 10000)
      rest = v % 10000
    end
    table.insert(groups, 1, rest)
  until l[1] == 0 and l[2] == 0 and l[3] == 0 and l[4] == 0
  local text = tostring(groups[1])
  for i = 2, #groups do
    text = text .. string.format('%04d', groups[i])
  end
  return sign .. text
end

-- Whether `replay::pick` picks this call to look through its key's ids (a hash of the
-- id's field name and the call's time, a multiple of `every`).
local function picked(field, now_millis, every)
  local len = #field
  local t0, t1, t2, t3 = word(string.sub(field, math.max(len - 8, 0) + 1))
  t0, t1, t2, t3 = rotate_left(t0, t1, t2, t3, 29)
  local n0, n1, n2, n3 = limbs_of(len)
  n0, n1, n2, n3 = rotate_left(n0, n1, n2, n3, 56)
  local h0, h1, h2, h3 = word(string.sub(field, 1, math.min(8, len)))
  local x0, x1, x2, x3 = xor(h0, h1, h2, h3, t0, t1, t2, t3)
  x0, x1, x2, x3 = xor(x0, x1, x2, x3, n0, n1, n2, n3)
  local w0, w1, w2, w3 = limbs_of(now_millis)
  x0, x1, x2, x3 = xor(x0, x1, x2, x3, w0, w1, w2, w3)
  x0, x1, x2, x3 = fold33(x0, x1, x2, x3)
  x0, x1, x2, x3 = multiply(x0, x1, x2, x3, 0x8ccd, 0xed55, 0xafd7, 0xff51)
  x0, x1, x2, x3 = fold33(x0, x1, x2, x3)
  x0, x1, x2, x3 = multiply(x0, x1, x2, x3, 0xec53, 0x1a85, 0xb9fe, 0xc4ce)
  x0, x1, x2, x3 = fold33(x0, x1, x2, x3)
  local r = ((x3 % every) * 65536 + x2) % every
  r = (r * 65536 + x1) % every
  return (r * 65536 + x0) % every == 0
end

-- `replay::chain_of`: the fingerprint of a chain of keys (64-bit FNV-1a over each key and
-- its length), as the signed decimal a record keeps.
local function chain_of(keys)
  local h0, h1, h2, h3 = 0x2325, 0x8422, 0x9ce4, 0xcbf2
  -- Each byte XORed in, then the product by the prime 2^40 + 0x1b3 (its limbs 0x1b3, 0,
  -- 0x100, 0), written out: a call per byte is most of the cost.
  local function eat(byte)
    local a0 = bit.bxor(h0, byte)
    local t = a0 * 0x1b3
    h0 = t % 65536
    t = (t - h0) / 65536 + h1 * 0x1b3
    local r1 = t % 65536
    t = (t - r1) / 65536 + h2 * 0x1b3 + a0 * 0x100
    local r2 = t % 65536
    t = (t - r2) / 65536 + h3 * 0x1b3 + h1 * 0x100
    h1, h2, h3 = r1, r2, t % 65536
  end
  for _, key in ipairs(keys) do
    for i = 1, #key do
      eat(string.byte(key, i))
    end
    local len = #key
    for _ = 1, 8 do
      local byte = len % 256
      eat(byte)
      len = (len - byte) / 256
    end
  end
  return signed_decimal(h0, h1, h2, h3)
end

-- Records: `{forget_at, answer, hold}`; an answer is `{shape, values}`, a value the
-- shortest text of an integer or false (a null): `i` one value, `r` a row, `p` two rows
-- (the second false when absent); a hold `{tokens, until, chain, charged, committed}`.

local function row_of(text)
  local values = {}
  for i, piece in ipairs(split(text, ',')) do
    if piece == '' then
      values[i] = false
    else
      local _, canonical = integer(piece)
      if canonical == nil then
        return nil
      end
      values[i] = canonical
    end
  end
  return values
end

-- The record a field holds, whatever its time; nil for anything else.
local function decode(value)
  local parts = split(value, ' ')
  if #parts < 2 or #parts > 3 then
    return nil
  end
  local forget_at = integer(parts[1])
  if forget_at == nil then
    return nil
  end
  local hold
  if parts[3] ~= nil then
    local state = string.sub(parts[3], 1, 1)
    if state ~= 'h' and state ~= 'c' then
      return nil
    end
    local numbers = split(string.sub(parts[3], 2), ',')
    if #numbers ~= 4 then
      return nil
    end
    local tokens, ends, charged = integer(numbers[1]), integer(numbers[2]), integer(numbers[4])
    local _, chain = integer(numbers[3])
    if tokens == nil or ends == nil or chain == nil or charged == nil then
      return nil
    end
    hold = {tokens = tokens, ends = ends, chain = chain, charged = charged,
            committed = state == 'c'}
  end
  local shape, body = string.sub(parts[2], 1, 1), string.sub(parts[2], 2)
  local answer
  if shape == 'i' then
    local _, canonical = integer(body)
    if canonical == nil then
      return nil
    end
    answer = {'i', {canonical}}
  elseif shape == 'r' then
    local values = row_of(body)
    if values == nil then
      return nil
    end
    answer = {'r', values}
  elseif shape == 'p' then
    local at = string.find(body, ';', 1, true)
    if at == nil then
      return nil
    end
    local first, second = row_of(string.sub(body, 1, at - 1)), string.sub(body, at + 1)
    if second == '' then
      second = false
    else
      second = row_of(second)
    end
    if first == nil or second == nil then
      return nil
    end
    answer = {'p', {first, second}}
  else
    return nil
  end
  return {forget_at = forget_at, answer = answer, hold = hold}
end

local function row_text(values)
  local texts = {}
  for i, v in ipairs(values) do
    texts[i] = v or ''
  end
  return table.concat(texts, ',')
end

local function encode(forget_at, answer, hold)
  local text = decimal(forget_at)
  local shape, values = answer[1], answer[2]
  if shape == 'i' then
    text = text .. ' i' .. values[1]
  elseif shape == 'r' then
    text = text .. ' r' .. row_text(values)
  else
    text = text .. ' p' .. row_text(values[1]) .. ';' .. (values[2] and row_text(values[2]) or '')
  end
  if hold ~= nil then
    text = text .. (hold.committed and ' c' or ' h') .. decimal(hold.tokens) .. ','
      .. decimal(hold.ends) .. ',' .. hold.chain .. ',' .. decimal(hold.charged)
  end
  return text
end

-- An answer of numbers (a reply the script makes) as a record keeps it.
local function answer_of(reply)
  if type(reply) == 'number' then
    return {'i', {decimal(reply)}}
  end
  local values = {}
  for i, v in ipairs(reply) do
    values[i] = decimal(v)
  end
  return {'r', values}
end

-- A remembered answer as the module replies it (rows of at most six values).
local function reply_of(answer)
  local function row(values)
    local out = {}
    for i = 1, math.min(#values, 6) do
      out[i] = values[i] and tonumber(values[i])
    end
    return out
  end
  local shape, values = answer[1], answer[2]
  if shape == 'i' then
    return tonumber(values[1])
  elseif shape == 'r' then
    return row(values)
  end
  return {row(values[1]), values[2] and row(values[2])}
end

-- The record `value` holds if it is still remembered at `now`.
local function remembered(value, now_millis)
  if not value then
    return nil
  end
  local record = decode(value)
  if record ~= nil and record.forget_at > now_millis then
    return record
  end
  return nil
end

-- A reservation still holding tokens at `now` (`Reserved::holds_at`).
local function holds_at(hold, now_millis, trusted_until)
  return not hold.committed and hold.tokens > 0 and hold.ends > now_millis
    and hold.ends <= trusted_until
end

-- When a key that remembers an id for `keep` ms from `now` may expire: in steps of a
-- quarter of `keep` (whole seconds).
local function keep_for(now_millis, keep)
  local step = math.max(idiv(keep, 4000), 1) * 1000
  return idiv(now_millis + keep, step) * step + step
end

-- How long a call's id is remembered: its KEEP (seconds), at most ID-SECONDS.
local function keep_millis(keep_seconds)
  if keep_seconds == nil or keep_seconds == '' then
    return ID_MILLIS
  end
  return math.min(tonumber(keep_seconds) * 1000, ID_MILLIS)
end

local function delete_fields(key, fields)
  for first = 1, #fields, 500 do
    redis.call('HDEL', key, unpack(fields, first, math.min(first + 499, #fields)))
  end
end

-- Forgets a key's ids as one more is remembered (`replay::prune`): those forgotten by
-- now or unreadable, and, at the cap, the oldest down to three quarters of it, the
-- reservations still needed last. The ids in the order the module's look sees them.
local function forget_ids(key, now_millis, trusted_until)
  local ids, cursor = {}, '0'
  local count = math.max(redis.call('HLEN', key), 1)
  repeat
    local page = redis.call('HSCAN', key, cursor, 'COUNT', count)
    cursor = page[1]
    for i = 1, #page[2], 2 do
      local name, value = page[2][i], page[2][i + 1]
      if string.sub(name, 1, 3) == 'id:' then
        local space = string.find(value, ' ', 1, true)
        local forget_at = space and integer(string.sub(value, 1, space - 1))
        local holding = false
        if string.find(value, ' h', 1, true) then
          local record = decode(value)
          local hold = record and record.hold
          holding = hold ~= nil and (holds_at(hold, now_millis, trusted_until)
            or (not hold.committed and hold.charged > 0))
        end
        ids[#ids + 1] = {name = name, forget_at = forget_at, holding = holding}
      end
    end
  until cursor == '0'
  local kept, forget = {}, {}
  for _, id in ipairs(ids) do
    if id.forget_at and id.forget_at > now_millis then
      kept[#kept + 1] = id
    else
      forget[#forget + 1] = id.name
    end
  end
  if #kept >= ID_MAX then
    for i, id in ipairs(kept) do
      id.order = i
    end
    table.sort(kept, function(a, b)
      if a.holding ~= b.holding then
        return b.holding
      elseif a.forget_at ~= b.forget_at then
        return a.forget_at < b.forget_at
      end
      return a.order < b.order
    end)
    for i = 1, #kept - idiv(ID_MAX * 3, 4) do
      forget[#forget + 1] = kept[i].name
    end
  end
  delete_fields(key, forget)
end

-- Remembers `answer` (and the reservation `hold`) under the id's `field` in `key` until
-- `keep` ms from now, or the hold's end when later (`RequestId::remember_holding`),
-- looking through the key's ids first about once in a quarter as many calls as it has
-- fields (`replay::looks_through`):
-- the field's value to write with the call's own, and how long the key must be kept.
local function remember(key, field, answer, hold, now_millis, trusted_until, keep)
  local fields = redis.call('HLEN', key)
  local every = math.max(LOOK_EVERY_MIN, idiv(fields, LOOK_SHARE))
  if fields > ID_MAX + OWN_FIELDS_MOST or picked(field, now_millis, every) then
    forget_ids(key, now_millis, trusted_until)
  end
  local forget_at = math.max(now_millis + keep, hold and hold.ends or 0)
  return encode(forget_at, answer, hold), math.max(keep_for(now_millis, keep), forget_at)
end

-- The key's expiry in Unix ms, -1 for none (a missing key has none).
local function expiry_of(key)
  return math.max(redis.call('PEXPIRETIME', key), -1)
end

-- Sets the key's expiry to `at` unless it has that one (nothing written then).
local function expire_at(key, current, at)
  if current ~= at then
    redis.call('PEXPIREAT', key, decimal(at))
  end
end

-- The server's clock in microseconds, and in milliseconds.
local function server_clock()
  local time = redis.call('TIME')
  local micros = tonumber(time[1]) * 1000000 + tonumber(time[2])
  return micros, idiv(micros, 1000), time
end

-- The fields of a hash, or the error the read met (WRONGTYPE for another type).
local function read_fields(key, ...)
  return redis.pcall('HMGET', key, ...)
end
