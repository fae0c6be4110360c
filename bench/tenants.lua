-- Many tenants with the same key set. Args: <tenants> <keys per tenant> <miss|replay> [run id].
-- replay: request i goes to tenant t-(i mod T) with key r-(floor(i / T) mod K), the same K keys
-- in every tenant; the first pass (the warm-up) stores them. miss: tenant t-(i mod T) with a
-- key used once.
package.path = package.path .. ";bench/?.lua"
local common = require("common")

setup = common.setup_threads()
local tenants, keys, mode, prefix = 10000, 5, "replay", ""
local counter = 0

function init(args)
  tenants = tonumber(args[1] or "") or 10000
  keys = tonumber(args[2] or "") or 5
  mode = args[3] or "replay"
  common.init(mode)
  prefix = "m-" .. (args[4] or tostring(os.time())) .. "-" .. tostring(tid) .. "-"
  counter = (tid or 1) * 7919
end

function request()
  counter = counter + 1
  wrk.headers["x-tenant"] = "t-" .. (counter % tenants)
  if mode == "miss" then
    wrk.headers["Idempotency-Key"] = prefix .. counter
  else
    wrk.headers["Idempotency-Key"] = "r-" .. (math.floor(counter / tenants) % keys)
  end
  return wrk.format()
end

done = common.done
