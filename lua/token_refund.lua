-- The refund script that QAG.REFUND replaces, call for call, on token_bucket.lua's keys.
-- KEYS[1]: the bucket (a hash with fields `tokens` and `ts`).
-- ARGV[1]: count, the capacity and the tokens refilled per period.
-- ARGV[2]: period in seconds. ARGV[3]: n, the tokens to give back.
-- Reply: floor(tokens left) (0 when below), after refilling to now and adding n, never
-- above count.
-- A missing bucket is full: nothing is written. Uses only TIME, HMGET, HSET and EXPIRE.
--
-- With a request id (the module's `ID request-id [KEEP seconds]`): the id and its KEEP
-- ("" for none) after n, the script sent after request_ids.lua and bucket_ids.lua, as
-- one: the reply is remembered under the id (a missing bucket's too) and answered again
-- to a replay, and the call keeps the module's rules (see bucket_ids.lua).
local key = KEYS[1]
local count = tonumber(ARGV[1])
local period = tonumber(ARGV[2])
local n = tonumber(ARGV[3])
local request_id, keep = ARGV[4], ARGV[5]

local time = redis.call('TIME')
local now = tonumber(time[1]) + tonumber(time[2]) / 1e6

-- A field that is missing, not a number, or not finite reads as nothing.
local function finite(value)
  local v = tonumber(value)
  if v == nil or v ~= v or v == math.huge or v == -math.huge then
    return nil
  end
  return v
end

-- Refilled to now as token_bucket.lua refills it, so no credit is minted or lost, then
-- n added: the tokens and time to store.
local function refunded(tokens, ts)
  local rate = count / period
  local elapsed = math.max(0, now - ts)
  tokens = math.min(count, tokens + elapsed * rate)
  return math.min(count, tokens + n), math.max(ts, now)
end

if request_id == nil then
  local fields = redis.call('HMGET', key, 'tokens', 'ts')
  local tokens, ts = finite(fields[1]), finite(fields[2])
  if tokens == nil or ts == nil then
    return count
  end
  tokens, ts = refunded(tokens, ts)
  redis.call('HSET', key, 'tokens', tokens, 'ts', ts)
  -- Kept until full, as token_bucket.lua keeps it.
  redis.call('EXPIRE', key, math.ceil(period + math.min(math.max(0, -tokens) / (count / period), 60)))
  return math.max(0, math.floor(tokens))
end

-- With a request id: request_ids.lua's and bucket_ids.lua's parts are above this one.
local clock = bucket_clock(time, now)
local field = 'id:refund:' .. request_id
local fields = read_fields(key, 'tokens', 'ts', field)
if fields.err then
  return fields
end
local record = remembered(fields[3], clock.millis)
if record then
  return reply_of(record.answer)
end
local tokens, ts = trusted_bucket(count, period, finite(fields[1]), finite(fields[2]), now)
if tokens == nil then
  store_id_only(key, remember_in(key, field, answer_of(count), clock, keep))
  return count
end
tokens, ts = refunded(tokens, ts)
local left = math.max(0, math.floor(tokens))
store_bucket(key, clock, count, period, tokens, ts, remember_in(key, field, answer_of(left), clock, keep))
return left
