//! Real processes (the `payments` example, `idem-cli`, private PostgreSQL clusters and
//! redis-servers) in one test binary, so that CI links one binary for them: several instances
//! and the operator (`fleet`), stopping the app (`graceful_stop`), resources after faults
//! (`leaks`, mostly soak tests run by hand). Tests that mostly wait take `faults::shared()`
//! and run beside each other; a test with a load or an asserted stop time takes
//! `faults::serial()` and runs alone.

mod fleet;
mod graceful_stop;
mod leaks;
