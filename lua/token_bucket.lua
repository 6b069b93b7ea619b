-- The token-bucket script that QAG.TAKE replaces, call for call, on the same keys.
-- KEYS[1]: the bucket (a hash with fields `tokens` and `ts`).
-- ARGV[1]: count, the capacity and the tokens refilled per period.
-- ARGV[2]: period in seconds. ARGV[3]: cost, default 1.
-- Reply: {allowed (1/0), floor(tokens left) (0 when below), retry after (whole seconds;
-- -1: never fits)}.
-- Uses only TIME, HMGET, HSET and EXPIRE.
--
-- QAG.TAKE2's twin with two keys: KEYS[1] the client bucket, KEYS[2] the key bucket;
-- ARGV: ccount cperiod kcount kperiod cost. Takes from the client bucket, then, only if
-- it allowed, from the key bucket (else only its type is checked, with TYPE). Reply:
-- both rows, the key bucket's nil when it was not counted.
--
-- With a request id (the module's `ID request-id [KEEP seconds]`): the id and its KEEP
-- ("" for none) after the cost, the script sent after request_ids.lua and
-- bucket_ids.lua, as one. The reply is remembered under the id in the (client) bucket's
-- key and answered again to a replay, and the call keeps the module's rules (see
-- bucket_ids.lua); it uses PEXPIRETIME, PEXPIREAT, HLEN, HSCAN and HDEL too.
local time = redis.call('TIME')
local now = tonumber(time[1]) + tonumber(time[2]) / 1e6

-- A bucket of `count` tokens a `period` that held `tokens` at `ts` (the stored fields, or
-- numbers), refilled to now and `cost` taken: the reply, and the tokens and time to
-- store (the time never moves backward, so a clock stepped back mints no credit).
local function take(count, period, cost, tokens, ts)
  tokens, ts = tonumber(tokens), tonumber(ts)
  -- A field that is missing, not a number, or not finite: a full bucket.
  if tokens == nil or ts == nil or tokens ~= tokens or ts ~= ts or tokens == math.huge
      or tokens == -math.huge or ts == math.huge or ts == -math.huge then
    tokens, ts = count, now
  end
  local rate = count / period
  local elapsed = math.max(0, now - ts)
  tokens = math.min(count, tokens + elapsed * rate)
  local allowed, retry = 0, 0
  if tokens >= cost then
    tokens = tokens - cost
    allowed = 1
  elseif cost > count then
    retry = -1
  else
    retry = math.ceil((cost - tokens) / rate)
  end
  return {allowed, math.max(0, math.floor(tokens)), retry}, tokens, math.max(ts, now)
end

-- The contract's call, first, its write inline: nothing made that it does not need.
if #KEYS == 1 and ARGV[4] == nil then
  local key, count, period = KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[2])
  local fields = redis.call('HMGET', key, 'tokens', 'ts')
  local reply, tokens, ts = take(count, period, tonumber(ARGV[3] or '1'), fields[1], fields[2])
  redis.call('HSET', key, 'tokens', tokens, 'ts', ts)
  -- Kept until full: a period, and for a bucket that QAG.TAKE's waiters charged ahead
  -- (below zero), the time to refill what they owe (at most a longest wait, 60 s).
  redis.call('EXPIRE', key, math.ceil(period + math.min(math.max(0, -tokens) / (count / period), 60)))
  return reply
end

-- The contract's write for each bucket of a pair, as the call above writes its one.
local function write(key, count, period, tokens, ts)
  redis.call('HSET', key, 'tokens', tokens, 'ts', ts)
  redis.call('EXPIRE', key, math.ceil(period + math.min(math.max(0, -tokens) / (count / period), 60)))
end

local pair = #KEYS == 2
local limits = {{tonumber(ARGV[1]), tonumber(ARGV[2])}}
local after = 3
if pair then
  limits[2] = {tonumber(ARGV[3]), tonumber(ARGV[4])}
  after = 5
end
local cost = tonumber(ARGV[after] or '1')
local request_id, keep = ARGV[after + 1], ARGV[after + 2]

-- A bucket's take (a limit {count, period}) from its stored tokens and time.
local function take_from(limit, tokens, ts)
  return take(limit[1], limit[2], cost, tokens, ts)
end

local function fields_of(key)
  local fields = redis.call('HMGET', key, 'tokens', 'ts')
  return fields[1], fields[2]
end

-- A field that is missing, not a number, or not finite reads as nothing.
local function finite(value)
  local n = tonumber(value)
  if n == nil or n ~= n or n == math.huge or n == -math.huge then
    return nil
  end
  return n
end

local function wrong_type(key)
  local kind = redis.call('TYPE', key)['ok']
  return kind ~= 'none' and kind ~= 'hash'
end

local WRONGTYPE = 'WRONGTYPE Operation against a key holding the wrong kind of value'

if request_id == nil then
  local client_limit, key_limit = limits[1], limits[2]
  if KEYS[1] == KEYS[2] then
    -- One key as both buckets: taken from twice, the second reading the first's write.
    local client, tokens, ts = take_from(client_limit, fields_of(KEYS[1]))
    write(KEYS[1], client_limit[1], client_limit[2], tokens, ts)
    if client[1] == 0 then
      return {client, false}
    end
    local key_reply, key_tokens, key_ts = take_from(key_limit, fields_of(KEYS[1]))
    write(KEYS[1], key_limit[1], key_limit[2], key_tokens, key_ts)
    return {client, key_reply}
  end
  -- Both keys read, or type-checked, before either is written.
  local client, tokens, ts = take_from(client_limit, fields_of(KEYS[1]))
  if client[1] == 0 then
    if wrong_type(KEYS[2]) then
      return redis.error_reply(WRONGTYPE)
    end
    write(KEYS[1], client_limit[1], client_limit[2], tokens, ts)
    return {client, false}
  end
  local key_reply, key_tokens, key_ts = take_from(key_limit, fields_of(KEYS[2]))
  write(KEYS[1], client_limit[1], client_limit[2], tokens, ts)
  write(KEYS[2], key_limit[1], key_limit[2], key_tokens, key_ts)
  return {client, key_reply}
end

-- With a request id: request_ids.lua's and bucket_ids.lua's parts are above this one.
local clock = bucket_clock(time, now)

-- A bucket's stored state as the module trusts it, read with `more` fields; or the
-- read's error.
local function read_bucket(key, limit, ...)
  local fields = read_fields(key, 'tokens', 'ts', ...)
  if fields.err then
    return nil, nil, fields
  end
  local tokens, ts = trusted_bucket(limit[1], limit[2], finite(fields[1]), finite(fields[2]), now)
  return tokens, ts, fields
end

local client_key = KEYS[1]
local field = (pair and 'id:take2:' or 'id:take:') .. request_id
local tokens, ts, fields = read_bucket(client_key, limits[1], field)
if fields.err then
  return fields
end
local record = remembered(fields[3], clock.millis)
if record then
  return replayed_take(record.answer)
end
local client, client_tokens, client_ts = take_from(limits[1], tokens, ts)

if not pair then
  local id = remember_in(client_key, field, answer_of(client), clock, keep)
  store_bucket(client_key, clock, limits[1][1], limits[1][2], client_tokens, client_ts, id)
  return client
end

-- A pair's reply as a record keeps it.
local function pair_answer(key_reply)
  return {'p', {answer_of(client)[2], key_reply and answer_of(key_reply)[2] or false}}
end

if client_key == KEYS[2] then
  -- One key as both buckets: taken from twice, the second reading the first's write,
  -- the id remembered with the second.
  store_bucket(client_key, clock, limits[1][1], limits[1][2], client_tokens, client_ts, nil)
  if client[1] == 0 then
    local id = remember_in(client_key, field, pair_answer(nil), clock, keep)
    store_id_only(client_key, id)
    return {client, false}
  end
  local again_tokens, again_ts = read_bucket(client_key, limits[2])
  local key_reply, key_tokens, key_ts = take_from(limits[2], again_tokens, again_ts)
  local id = remember_in(client_key, field, pair_answer(key_reply), clock, keep)
  store_bucket(client_key, clock, limits[2][1], limits[2][2], key_tokens, key_ts, id)
  return {client, key_reply}
end

-- Both keys read, or type-checked, before either is written.
if client[1] == 0 then
  if wrong_type(KEYS[2]) then
    return redis.error_reply(WRONGTYPE)
  end
  local id = remember_in(client_key, field, pair_answer(nil), clock, keep)
  store_bucket(client_key, clock, limits[1][1], limits[1][2], client_tokens, client_ts, id)
  return {client, false}
end
local key_stored_tokens, key_stored_ts, key_fields = read_bucket(KEYS[2], limits[2])
if key_fields.err then
  return key_fields
end
local key_reply, key_tokens, key_ts = take_from(limits[2], key_stored_tokens, key_stored_ts)
local id = remember_in(client_key, field, pair_answer(key_reply), clock, keep)
store_bucket(client_key, clock, limits[1][1], limits[1][2], client_tokens, client_ts, id)
store_bucket(KEYS[2], clock, limits[2][1], limits[2][2], key_tokens, key_ts, nil)
return {client, key_reply}
