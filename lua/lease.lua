-- The lease family as a script, call for call the module's QAG.LEASE, QAG.RENEW,
-- QAG.RELEASE and QAG.LEASES on the same keys (src/lease.rs, docs/leases.md): for
-- clients on a server without the module.
-- KEYS[1]: the slots, a sorted set of lease ids scored by their expiry in Unix ms.
-- ARGV[1]: the operation, then its arguments, checked by the caller as the module checks
-- them:
--   acquire max ttl_ms id   reply {acquired (1/0), live leases, retry after (0, or 1)}
--   renew id ttl_ms         reply 1, or 0 when the lease is gone
--   release id              reply 1 if a live lease was released, else 0
--   count                   reply the live leases
-- Uses only TIME, TYPE, ZCARD, ZSCORE, ZRANGEBYSCORE, ZCOUNT, ZRANGE, ZADD, ZREM,
-- PEXPIRETIME and PEXPIREAT.
local key, op = KEYS[1], ARGV[1]

-- The longest lease: 7 days.
local MAX_TTL_MILLIS = 7 * 24 * 3600 * 1000

local kind = redis.call('TYPE', key)['ok']
if kind ~= 'none' and kind ~= 'zset' then
  return redis.error_reply('WRONGTYPE Operation against a key holding the wrong kind of value')
end

local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
-- A lease expiring later than the longest one given now could is no lease.
local latest = now + MAX_TTL_MILLIS
local now_text, latest_text = string.format('%d', now), string.format('(%d', latest)

local function is_live(expiry)
  return expiry ~= nil and expiry > now and expiry <= latest
end

local function score(id)
  return tonumber(redis.call('ZSCORE', key, id))
end

-- The members that hold no slot: expired, or scored beyond the longest lease.
local function expired()
  local members = redis.call('ZRANGEBYSCORE', key, '-inf', now_text)
  for _, member in ipairs(redis.call('ZRANGEBYSCORE', key, latest_text, '+inf')) do
    members[#members + 1] = member
  end
  return members
end

local function remove(members)
  for first = 1, #members, 500 do
    redis.call('ZREM', key, unpack(members, first, math.min(first + 499, #members)))
  end
end

-- Gives `id` a lease until now + ttl, unless it has that one already.
local function put(id, ttl)
  local expiry = now + ttl
  if score(id) ~= expiry then
    redis.call('ZADD', key, string.format('%d', expiry), id)
  end
end

-- The key expires with its latest lease (an emptied key is gone already).
local function expire_with_latest_lease()
  local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
  if #last == 0 then
    return
  end
  local at = math.min(math.ceil(tonumber(last[2])), latest)
  if math.max(redis.call('PEXPIRETIME', key), -1) ~= at then
    redis.call('PEXPIREAT', key, string.format('%d', at))
  end
end

if op == 'acquire' then
  local max, ttl, id = tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
  local gone = expired()
  local live = redis.call('ZCARD', key) - #gone
  local renews = is_live(score(id))
  if not renews and live >= max then
    return {0, live, 1}
  end
  remove(gone)
  put(id, ttl)
  expire_with_latest_lease()
  return {1, renews and live or live + 1, 0}
elseif op == 'renew' then
  local id, ttl = ARGV[2], tonumber(ARGV[3])
  if not is_live(score(id)) then
    return 0
  end
  remove(expired())
  put(id, ttl)
  expire_with_latest_lease()
  return 1
elseif op == 'release' then
  local id = ARGV[2]
  local expiry = score(id)
  if expiry == nil then
    return 0
  end
  local live = is_live(expiry)
  -- The expired leases, the caller's among them if it ran out, go too.
  local members = expired()
  if live then
    members[#members + 1] = id
  end
  remove(members)
  expire_with_latest_lease()
  return live and 1 or 0
elseif op == 'count' then
  local gone = redis.call('ZCOUNT', key, '-inf', now_text) + redis.call('ZCOUNT', key, latest_text, '+inf')
  return redis.call('ZCARD', key) - gone
end
return redis.error_reply('ERR unknown lease operation')
