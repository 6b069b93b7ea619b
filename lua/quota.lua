-- The quota family as a script, call for call the module's QAG.QUOTA, QAG.QUOTA.ADD and
-- QAG.QUOTA.SEED on the same keys (src/quota.rs, docs/quotas.md): for clients on a server
-- without the module. Loaded after request_ids.lua (the clients send the two as one).
-- KEYS[1]: the usage, a hash with fields `period` (the period's label), `calls`, `rows`.
-- ARGV: the operation (check, add or seed); the calendar period the caller computed for
-- the server's clock in the quota's zone, as the module computes it (core/src/quota.rs):
-- its label, start and end (Unix seconds), and the next period's label and end (counted
-- into when the key holds it: a clock stepped back across a period's start); CALLS and
-- ROWS ("" for none: limits for check, counts for add and seed); for add, the request id
-- ("" for none) and its KEEP seconds ("" for none).
-- Reply: the module's; or {"period", seconds, microseconds}, the server's clock, when it
-- is not within the period given (nothing read or written): the caller computes the
-- period for that clock and sends the call again.
-- Uses TIME, HMGET, HGET, HLEN, HSCAN, HSET, HDEL, PEXPIRETIME and PEXPIREAT.
local key, op = KEYS[1], ARGV[1]
local label, start, finish = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local next_label, next_finish = ARGV[5], tonumber(ARGV[6])
local calls, rows = tonumber(ARGV[7]), tonumber(ARGV[8])

local now_micros, now_millis, time = server_clock()
if now_micros < start * 1000000 or now_micros >= finish * 1000000 then
  return {'period', time[1], time[2]}
end

local stored = read_fields(key, 'period', 'calls', 'rows')
if stored.err then
  return stored
end
-- The period counted into: the clock's, or the next one when the key holds it.
if stored[1] ~= label and stored[1] == next_label then
  label, finish = next_label, next_finish
end

local used_calls, used_rows = 0, 0
if stored[1] == label then
  used_calls, used_rows = stored_count(stored[2]), stored_count(stored[3])
end

if op == 'check' then
  local function remaining(used, limit)
    return limit and math.max(limit - used, 0) or false
  end
  local allowed = (calls == nil or used_calls < calls) and (rows == nil or used_rows < rows)
  return {allowed and 1 or 0, remaining(used_calls, calls), remaining(used_rows, rows), finish}
end

-- Writes the usage when it changes a count and the id the call remembers, in one HSET
-- (of the usage fields only those whose text is not already the one to write), the key
-- expiring a day after the period ends.
local function count(new_calls, new_rows, id_field, keep)
  local reply = {new_calls, new_rows, finish}
  local writes = {}
  if id_field then
    -- A quota's key holds no reservation: none is trusted (as the module looks).
    local value = remember(key, id_field, answer_of(reply), nil, now_millis, -math.huge, keep)
    writes = {id_field, value}
  end
  if new_calls ~= used_calls or new_rows ~= used_rows then
    local texts = {label, decimal(new_calls), decimal(new_rows)}
    for i, name in ipairs({'period', 'calls', 'rows'}) do
      if stored[i] ~= texts[i] then
        writes[#writes + 1] = name
        writes[#writes + 1] = texts[i]
      end
    end
  end
  if #writes > 0 then
    redis.call('HSET', key, unpack(writes))
    expire_at(key, expiry_of(key), (finish + 86400) * 1000)
  end
  return reply
end

local add_calls, add_rows = calls or 0, rows or 0
if op == 'seed' then
  return count(math.max(used_calls, add_calls), math.max(used_rows, add_rows))
end

if op ~= 'add' then
  return redis.error_reply('ERR unknown quota operation')
end
local id_field
if ARGV[9] ~= '' then
  id_field = 'id:quota.add:' .. ARGV[9]
  local record = remembered(redis.call('HGET', key, id_field), now_millis)
  if record then
    return reply_of(record.answer)
  end
end
local new_calls, new_rows = used_calls + add_calls, used_rows + add_rows
if new_calls >= 2 ^ 63 or new_rows >= 2 ^ 63 then
  return redis.error_reply('ERR the count would overflow; nothing was added')
end
return count(new_calls, new_rows, id_field, keep_millis(ARGV[10]))
