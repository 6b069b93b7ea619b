-- A bucket's key when a call gives a request id, as the module keeps it (src/bucket.rs):
-- sent after request_ids.lua and before token_bucket.lua or token_refund.lua, as one
-- script, by the clients for a call with an id; a call without one runs the bucket
-- script alone, the contract as it always was. With an id the call keeps the module's
-- rules exactly, so that a fleet mixing the two on one key stays exact: a stored time
-- more than a period ahead, or tokens below what waiters can owe, read as a full
-- bucket; the key's expiry moved as the module moves it (kept from the refill to a
-- slack later, and for the ids it remembers).

-- The longest a waiter of QAG.TAKE … WAIT waits (s): how far below zero its charge can
-- leave a bucket, and how much longer its key is kept for it (`wait::MAX_WAIT_SECONDS`).
local MAX_WAIT_SECONDS = 60

-- The clock of a call that read TIME as `time`, `now` its seconds: also in microseconds
-- and milliseconds, as the module's rules count them.
local function bucket_clock(time, now)
  local micros = tonumber(time[1]) * 1000000 + tonumber(time[2])
  return {seconds = now, micros = micros, millis = idiv(micros, 1000)}
end

-- The stored tokens and time a call at `now` (s) takes from (`bucket::trusted`); nil
-- for a full bucket.
local function trusted_bucket(count, period, tokens, ts, now)
  if tokens == nil or ts == nil or ts > now + period
      or tokens < -(count + count / period * MAX_WAIT_SECONDS) then
    return nil
  end
  return tokens, ts
end

-- The key's expiry after a call that left `tokens` at `ts`, given the one it has
-- (`bucket::expiry_after_call`): kept while it is from the refill to a slack later,
-- else moved to a slack after the refill.
local function bucket_expiry(current, clock, count, period, tokens, ts)
  local ttl = period + math.min(math.max(0, -tokens) / (count / period), MAX_WAIT_SECONDS)
  local from = clock.micros
  if ts > clock.seconds then
    from = math.ceil(ts * 1e6)
  end
  local full = idiv(from + math.ceil(ttl) * 1000000 + 999, 1000)
  local latest = full + math.max(idiv(math.ceil(period), 4), 1) * 1000
  if current >= full and current <= latest then
    return current
  end
  return latest
end

-- Writes a bucket's state, and `id` ({field, value, keep_until}: what the call
-- remembers, nil for none) in the same HSET; its expiry kept for the ids the key
-- remembers, its own the longest.
local function store_bucket(key, clock, count, period, tokens, ts, id)
  if id then
    redis.call('HSET', key, 'tokens', tokens, 'ts', ts, id[1], id[2])
  else
    redis.call('HSET', key, 'tokens', tokens, 'ts', ts)
  end
  local current = expiry_of(key)
  local full = bucket_expiry(current, clock, count, period, tokens, ts)
  local own = id and id[3] or 0
  local at = math.max(full, own)
  -- Only an expiry about to move earlier needs the look at the key's other fields.
  if full < current and (own > 0 or redis.call('HLEN', key) > 2) then
    at = math.max(full, math.min(current, keep_for(clock.millis, ID_MILLIS)), own)
  end
  expire_at(key, current, at)
end

-- Writes only what the call remembers, for a call that changes no bucket.
local function store_id_only(key, id)
  redis.call('HSET', key, id[1], id[2])
  local current = expiry_of(key)
  expire_at(key, current, math.max(current, id[3]))
end

-- What a call remembers under `field` in `key`: {field, value, keep_until}.
local function remember_in(key, field, answer, clock, keep_seconds)
  local value, keep_until = remember(key, field, answer, nil, clock.millis, -math.huge,
    keep_millis(keep_seconds))
  return {field, value, keep_until}
end

-- A take's (or a pair's) remembered answer, replied again. One that waited (its row
-- holds, fifth, when its tokens exist) is answered allowed with the wait it was to
-- have, at once: a script cannot hold a reply, so a replay that comes before the first
-- call's tokens exist is answered that much earlier than the module would (the charge
-- stands, made once, by the first call).
local function replayed_take(answer)
  local shape, values = answer[1], answer[2]
  local first = (shape == 'r' and values) or (shape == 'p' and values[2] and values[1])
  if not first or not first[5] then
    return reply_of(answer)
  end
  local waited = tonumber(first[4] or '0')
  local function row(texts)
    local function value(i)
      return tonumber(texts[i] or '0')
    end
    return {value(1) == 1 and 1 or 0, value(2), value(3), waited}
  end
  if shape == 'r' then
    return row(values)
  end
  return {row(values[1]), row(values[2])}
end
