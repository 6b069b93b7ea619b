-- The refund script that QAG.REFUND replaces, call for call, on token_bucket.lua's keys.
-- KEYS[1]: the bucket (a hash with fields `tokens` and `ts`).
-- ARGV[1]: count, the capacity and the tokens refilled per period.
-- ARGV[2]: period in seconds. ARGV[3]: n, the tokens to give back.
-- Reply: floor(tokens left) (0 when below), after refilling to now and adding n, never
-- above count.
-- A missing bucket is full: nothing is written. Uses only TIME, HMGET, HSET and EXPIRE.
local key = KEYS[1]
local count = tonumber(ARGV[1])
local period = tonumber(ARGV[2])
local n = tonumber(ARGV[3])

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

local fields = redis.call('HMGET', key, 'tokens', 'ts')
local tokens, ts = finite(fields[1]), finite(fields[2])
if tokens == nil or ts == nil then
  return count
end

-- Refilled to now as token_bucket.lua refills it, so no credit is minted or lost.
local rate = count / period
local elapsed = math.max(0, now - ts)
tokens = math.min(count, tokens + elapsed * rate)
tokens = math.min(count, tokens + n)

redis.call('HSET', key, 'tokens', tokens, 'ts', math.max(ts, now))
-- Kept until full, as token_bucket.lua keeps it.
redis.call('EXPIRE', key, math.ceil(period + math.min(math.max(0, -tokens) / rate, 60)))
return math.max(0, math.floor(tokens))
