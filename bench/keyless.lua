-- Keyless POSTs (no Idempotency-Key): transactional mode runs them in a plain transaction.
package.path = package.path .. ";bench/?.lua"
local common = require("common")
setup = common.setup_threads()
function init(args)
  common.init("keyless")
end
function request()
  return wrk.format()
end
done = common.done
