-- redis_exporter --script: the qag module's counters, for Prometheus.
-- redis_exporter runs this with EVAL and exports every returned pair as
-- redis_script_values{key="<name>"} <value>; values must be numbers.
-- Returns each integer field of INFO qag (qag_take_calls, qag_take_allowed, ...) and
-- qag_module_version (major * 10000 + minor * 100 + patch, as MODULE LIST shows it).
-- Returns nothing on a server without the module.
local info = redis.call('INFO', 'qag')
local result = {}
for line in string.gmatch(info, '[^\r\n]+') do
  local name, value = string.match(line, '^(qag_[%w_]+):(%d+)$')
  if name then
    table.insert(result, name)
    table.insert(result, value)
  end
  local major, minor, patch = string.match(line, '^qag_version:(%d+)%.(%d+)%.(%d+)')
  if major then
    table.insert(result, 'qag_module_version')
    table.insert(result, tostring(major * 10000 + minor * 100 + patch))
  end
end
return result
