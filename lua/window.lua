-- The sliding-window family as a script, call for call the module's QAG.ADMIT and
-- QAG.RECORD on the same keys (src/window.rs, core/src/window.rs, docs/windows.md,
-- docs/replays.md): reservations (RESERVE, HOLD, PARTIAL, commits) and request ids
-- included, for clients on a server without the module. Loaded after request_ids.lua (the
-- clients send the two as one).
-- KEYS: the chain of scopes, each a hash with fields `req:<n>` and `tok:<n>` for window
-- number n, `holds` (open reservations), and, in the first, the ids it remembers.
-- ARGV[1]: the operation, then its arguments, checked by the caller as the module checks
-- them ("" for an option not given):
--   admit  window_seconds rpm_1 tpm_1 ... rpm_n tpm_n reserve hold_ms id keep
--          (reserve 0 for none) reply {admitted, refusing scope, retry after,
--          requests remaining, tokens remaining}
--   record window_seconds tokens id keep partial ("1" for PARTIAL)
--          reply the number of scopes charged
-- Uses TIME, HMGET, HGET, HLEN, HKEYS, HSCAN, HSET, HDEL, PEXPIRETIME and PEXPIREAT.
local op, window_micros = ARGV[1], tonumber(ARGV[2]) * 1000000

local now_micros, now_millis = server_clock()
local window = idiv(now_micros, window_micros)
local elapsed = now_micros - window * window_micros
-- The previous window's weight: the share of it still inside the trailing window.
local weight = (window_micros - elapsed) / window_micros
-- The end of the next window (when this window's counts stop counting), and of the one
-- after (the latest a count or hold made by a clock a little ahead lasts).
local end_of_next = idiv((window + 2) * window_micros, 1000)
local trusted_until = idiv((window + 3) * window_micros, 1000)
local counters = {'req:' .. decimal(window), 'req:' .. decimal(window - 1),
                  'tok:' .. decimal(window), 'tok:' .. decimal(window - 1)}

-- A scope's open reservations: `{tokens, until}` groups, as field `holds` keeps them
-- (`<tokens> <until> ...`, earliest first); an unreadable field holds nothing.
local function parse_holds(text)
  if not text then
    return {}
  end
  local pieces, holds = split(text, ' '), {}
  for i = 1, #pieces, 2 do
    local tokens, ends = integer(pieces[i]), integer(pieces[i + 1])
    if tokens == nil or ends == nil then
      return {}
    end
    if tokens > 0 then
      holds[#holds + 1] = {tokens = tokens, ends = ends}
    end
  end
  return holds
end

local function holds_text(holds)
  local words = {}
  for _, hold in ipairs(holds) do
    words[#words + 1] = decimal(hold.tokens)
    words[#words + 1] = decimal(hold.ends)
  end
  return table.concat(words, ' ')
end

-- The group ending at `until`: found, and its place (or where it goes), by the module's
-- own binary search (Rust's slice::binary_search_by, the same on groups out of order).
local function find_group(holds, ends)
  local size, base = #holds, 0
  if size == 0 then
    return false, 1
  end
  while size > 1 do
    local half = math.floor(size / 2)
    if holds[base + half + 1].ends <= ends then
      base = base + half
    end
    size = size - half
  end
  local found = holds[base + 1].ends
  if found == ends then
    return true, base + 1
  end
  return false, base + 1 + (found < ends and 1 or 0)
end

-- Drops the groups that do not count now; whether any were dropped.
local function drop_not_counting(holds)
  local kept = 1
  local before = #holds
  for i = 1, before do
    local hold = holds[i]
    holds[i] = nil
    if hold.ends > now_millis and hold.ends <= trusted_until then
      holds[kept] = hold
      kept = kept + 1
    end
  end
  return kept - 1 ~= before
end

-- A scope as read: its counters, which counter fields it has, its open reservations;
-- and the value of `id_field` there (nil for none), or the read's error.
local function read_scope(key, id_field)
  local names = {counters[1], counters[2], counters[3], counters[4], 'holds', id_field}
  local values = read_fields(key, unpack(names))
  if values.err then
    return nil, values
  end
  local counted = 0
  for i = 1, 4 do
    if values[i] then
      counted = counted + 1
    end
  end
  local scope = {
    requests = stored_count(values[1]), previous_requests = stored_count(values[2]),
    tokens = stored_count(values[3]), previous_tokens = stored_count(values[4]),
    has_requests = values[1] ~= false, has_tokens = values[3] ~= false, counted = counted,
    holds = parse_holds(values[5]), holds_changed = false, held = 0,
  }
  scope.holds_stale = drop_not_counting(scope.holds)
  for _, hold in ipairs(scope.holds) do
    scope.held = scope.held + hold.tokens
  end
  return scope, values[6]
end

local function estimate(current, previous)
  return current + previous * weight
end

-- A counter of a window that no longer counts, or never will by this clock.
local function is_stale(field)
  local prefix = string.sub(field, 1, 4)
  if prefix ~= 'req:' and prefix ~= 'tok:' then
    return false
  end
  local n = integer(string.sub(field, 5))
  return n ~= nil and (n < window - 1 or n > window + 1)
end

-- Sets one current counter (`kind` 1: requests, 3: tokens) of a scope to `value`, and,
-- in the same HSET, its reservations when they changed and `extra` (what the call
-- remembers in the first key); removes the windows that no longer count, and moves the
-- expiry to the next window's end, later for the ids the hash remembers, and no
-- earlier than `keep_until` (`Scope::write`).
local function write_scope(key, scope, kind, value, extra, keep_until)
  local current, had = scope.tokens, scope.has_tokens
  if kind == 1 then
    current, had = scope.requests, scope.has_requests
  end
  local changes = value ~= current
  -- nil: not written; false: removed (nothing held any more).
  local holds
  if scope.holds_changed or (scope.holds_stale and (changes or #extra > 0)) then
    holds = #scope.holds > 0 and holds_text(scope.holds)
  end
  local writes = {}
  if changes then
    writes = {counters[kind], decimal(value)}
  end
  if holds then
    writes[#writes + 1] = 'holds'
    writes[#writes + 1] = holds
  end
  for _, word in ipairs(extra) do
    writes[#writes + 1] = word
  end
  if #writes == 0 and holds ~= false then
    return
  end
  if #writes > 0 then
    redis.call('HSET', key, unpack(writes))
  end
  if holds == false then
    redis.call('HDEL', key, 'holds')
  end
  local counted = scope.counted
  if changes and not had then
    counted = counted + 1
    if redis.call('HLEN', key) > counted then
      local stale = {}
      for _, field in ipairs(redis.call('HKEYS', key)) do
        if is_stale(field) then
          stale[#stale + 1] = field
        end
      end
      delete_fields(key, stale)
    end
  end
  -- A hash holding more than its counters may remember ids: kept for them.
  local keep = 0
  if redis.call('HLEN', key) > counted or keep_until > 0 then
    keep = keep_for(now_millis, ID_MILLIS)
  end
  local expiry = expiry_of(key)
  local at = math.max(end_of_next, math.min(expiry, math.max(trusted_until, keep)), keep_until)
  expire_at(key, expiry, at)
end

-- Every scope of the chain, read (all before any is written); the first's `id_field`.
local function read_chain(id_field)
  local scopes, id_value = {}, nil
  for i, key in ipairs(KEYS) do
    local scope, value = read_scope(key, i == 1 and id_field or nil)
    if scope == nil then
      return nil, value
    end
    scopes[i] = scope
    if i == 1 then
      id_value = value
    end
  end
  return scopes, id_value
end

-- Writes one counter of every scope, and `first` (name, value) in the first key, kept
-- until `keep_first`.
local function write_chain(scopes, kind, values, first, keep_first)
  for i, key in ipairs(KEYS) do
    if i == 1 then
      write_scope(key, scopes[i], kind, values[i], first, keep_first)
    else
      write_scope(key, scopes[i], kind, values[i], {}, 0)
    end
  end
end

local n = #KEYS

if op == 'admit' then
  local reserve, hold_millis = tonumber(ARGV[3 + 2 * n]), tonumber(ARGV[4 + 2 * n])
  local id, keep = ARGV[5 + 2 * n], ARGV[6 + 2 * n]
  local id_field = id ~= '' and 'id:admit:' .. id or nil
  local scopes, id_value = read_chain(id_field)
  if scopes == nil then
    return id_value
  end
  if id_field then
    local record = remembered(id_value, now_millis)
    if record then
      return reply_of(record.answer)
    end
  end
  -- Each scope in order (`window::admit`): the first refusal wins.
  local refused_by = 0
  for i, scope in ipairs(scopes) do
    local rpm, tpm = tonumber(ARGV[1 + 2 * i]), tonumber(ARGV[2 + 2 * i])
    local requests = estimate(scope.requests, scope.previous_requests)
    local tokens = estimate(scope.tokens, scope.previous_tokens) + scope.held
    local tokens_refused
    if reserve == 0 then
      tokens_refused = tokens >= tpm
    else
      tokens_refused = tokens + reserve > tpm
    end
    if (rpm > 0 and requests + 1 > rpm) or (tpm > 0 and tokens_refused) then
      refused_by = i
      break
    end
  end
  local admitted = refused_by == 0
  local charged, reserved = 0, 0
  if admitted then
    charged, reserved = 1, reserve
  end
  local requests_remaining, tokens_remaining = -1, -1
  local function least(sofar, remaining)
    local r = math.max(math.floor(remaining), 0)
    if sofar == -1 or r < sofar then
      return r
    end
    return sofar
  end
  for i, scope in ipairs(scopes) do
    local rpm, tpm = tonumber(ARGV[1 + 2 * i]), tonumber(ARGV[2 + 2 * i])
    if rpm > 0 then
      local left = rpm - estimate(scope.requests, scope.previous_requests) - charged
      requests_remaining = least(requests_remaining, left)
    end
    if tpm > 0 then
      local counted = estimate(scope.tokens, scope.previous_tokens) + scope.held
      tokens_remaining = least(tokens_remaining, tpm - counted - reserved)
    end
  end
  local retry = 0
  if not admitted then
    retry = math.max(idiv(window_micros - elapsed + 999999, 1000000), 1)
  end
  local reply = {admitted and 1 or 0, refused_by, retry, requests_remaining, tokens_remaining}
  -- What an admitted reservation holds on every scope, and until when: the end of the
  -- next window, or HOLD from now when sooner (rounded up to a sixteenth of the window).
  local hold
  if admitted and reserve > 0 then
    local ends = end_of_next
    if hold_millis then
      local step = math.max(idiv(window_micros, 16000), 1)
      local at = now_millis + hold_millis
      local rounded = idiv(at, step) * step
      if rounded < at then
        rounded = rounded + step
      end
      ends = math.min(end_of_next, rounded)
    end
    hold = {tokens = reserve, ends = ends, chain = chain_of(KEYS), charged = 0, committed = false}
  end
  -- A refused reservation holds nothing and is not remembered.
  local first, keep_first = {}, 0
  if id_field and (admitted or reserve == 0) then
    local value
    value, keep_first = remember(KEYS[1], id_field, answer_of(reply), hold, now_millis,
      trusted_until, keep_millis(keep))
    first = {id_field, value}
  end
  if admitted then
    local requests = {}
    for i, scope in ipairs(scopes) do
      if hold then
        local found, at = find_group(scope.holds, hold.ends)
        if found then
          scope.holds[at].tokens = scope.holds[at].tokens + hold.tokens
        else
          table.insert(scope.holds, at, {tokens = hold.tokens, ends = hold.ends})
        end
        scope.holds_changed = true
      end
      requests[i] = scope.requests + 1
    end
    write_chain(scopes, 1, requests, first, keep_first)
  elseif #first > 0 then
    -- A refusal writes no counter: only the id, kept its time.
    redis.call('HSET', KEYS[1], first[1], first[2])
    local expiry = expiry_of(KEYS[1])
    expire_at(KEYS[1], expiry, math.max(expiry, keep_first))
  end
  return reply
end

if op ~= 'record' then
  return redis.error_reply('ERR unknown window operation')
end
local tokens, id, keep, partial = tonumber(ARGV[3]), ARGV[4], ARGV[5], ARGV[6] == '1'
-- A partial charge is one of many under the reservation's id: never a replay.
local record_field = (id ~= '' and not partial) and 'id:record:' .. id or nil
local scopes, record_value = read_chain(record_field)
if scopes == nil then
  return record_value
end
-- The reservation this charges, remembered by its ADMIT in the first key, on this chain.
local reservation
if id ~= '' then
  local admit_field = 'id:admit:' .. id
  local record = remembered(redis.call('HGET', KEYS[1], admit_field), now_millis)
  if record and record.hold and record.hold.chain == chain_of(KEYS) then
    reservation = {field = admit_field, record = record, hold = record.hold,
                   open = holds_at(record.hold, now_millis, trusted_until)}
  end
end
if reservation and reservation.hold.committed then
  -- The commit's count covered it: the commit sent again, or a partial run late.
  return n
end
if reservation == nil and record_field then
  local record = remembered(record_value, now_millis)
  if record then
    return reply_of(record.answer)
  end
end
-- A commit charges its count less what the partials paid (down to nothing).
local charge = tokens
if reservation and not partial then
  charge = tokens - reservation.hold.charged
end
local totals = {}
for i, scope in ipairs(scopes) do
  local total = scope.tokens + charge
  if total >= 2 ^ 63 or total < -2 ^ 63 then
    return redis.error_reply('ERR the token count would overflow; nothing was charged')
  end
  totals[i] = math.max(total, 0)
end
local first, keep_first = {}, 0
if reservation then
  local held = reservation.hold
  local released = 0
  if reservation.open then
    released = partial and math.min(tokens, held.tokens) or held.tokens
  end
  if released > 0 then
    for _, scope in ipairs(scopes) do
      local found, at = find_group(scope.holds, held.ends)
      if found then
        local group = scope.holds[at]
        group.tokens = group.tokens - math.min(math.max(released, 0), group.tokens)
        if group.tokens == 0 then
          table.remove(scope.holds, at)
        end
      end
      scope.holds_changed = true
    end
  end
  -- The ADMIT's record, rewritten with what is left of the reservation, remembered
  -- ID-SECONDS more (a hold ending later than any real one keeps nothing).
  local kept = -math.huge
  if held.ends <= trusted_until then
    kept = reservation.record.forget_at
  end
  local forget_at = math.max(kept, now_millis + ID_MILLIS)
  local after = {tokens = 0, ends = held.ends, chain = held.chain, charged = held.charged,
                 committed = true}
  if partial then
    after = {tokens = held.tokens - released, ends = held.ends, chain = held.chain,
             charged = held.charged + tokens, committed = false}
  end
  first = {reservation.field, encode(forget_at, reservation.record.answer, after)}
  keep_first = keep_for(now_millis, ID_MILLIS)
elseif record_field then
  local value
  value, keep_first = remember(KEYS[1], record_field, answer_of(n), nil, now_millis,
    trusted_until, keep_millis(keep))
  first = {record_field, value}
end
write_chain(scopes, 3, totals, first, keep_first)
return n
