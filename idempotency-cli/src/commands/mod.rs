//! One module per subcommand. Each `run` writes its result to stdout through [`crate::output::Out`]
//! and returns a [`crate::error::CliError`] on failure; `main` turns that into one stderr line and
//! an exit code.

pub mod list;
pub mod migrate;
pub mod purge;
pub mod release;
pub mod show;
pub mod stats;
