-- The token-bucket script that QAG.TAKE replaces, call for call, on the same keys.
-- KEYS[1]: the bucket (a hash with fields `tokens` and `ts`).
-- ARGV[1]: count, the capacity and the tokens refilled per period.
-- ARGV[2]: period in seconds. ARGV[3]: cost, default 1.
-- Reply: {allowed (1/0), floor(tokens left) (0 when below), retry after (whole seconds;
-- -1: never fits)}.
-- Uses only TIME, HMGET, HSET and EXPIRE.
local key = KEYS[1]
local count = tonumber(ARGV[1])
local period = tonumber(ARGV[2])
local cost = tonumber(ARGV[3] or '1')

local time = redis.call('TIME')
local now = tonumber(time[1]) + tonumber(time[2]) / 1e6

-- A field that is missing, not a number, or not finite reads as nothing.
local function finite(value)
  local n = tonumber(value)
  if n == nil or n ~= n or n == math.huge or n == -math.huge then
    return nil
  end
  return n
end

local fields = redis.call('HMGET', key, 'tokens', 'ts')
local tokens, ts = finite(fields[1]), finite(fields[2])
if tokens == nil or ts == nil then
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

-- The stored time never moves backward, so a clock stepped back mints no credit.
redis.call('HSET', key, 'tokens', tokens, 'ts', math.max(ts, now))
-- Kept until full: a period, and for a bucket that QAG.TAKE's waiters charged ahead
-- (below zero), the time to refill what they owe (at most a longest wait, 60 s).
redis.call('EXPIRE', key, math.ceil(period + math.min(math.max(0, -tokens) / rate, 60)))
return {allowed, math.max(0, math.floor(tokens)), retry}
