//! Real processes (the `payments` example, `idem-cli`, private PostgreSQL clusters and
//! redis-servers) in one test binary, so that CI links one binary for them: several instances
//! and the operator (`fleet`), stopping the app (`graceful_stop`), resources after faults
//! (`leaks`, mostly soak tests run by hand). The tests share `faults::serial()`, so they run
//! one at a time.

mod fleet;
mod graceful_stop;
mod leaks;
