//! Writing results, one job per module: [`Out`] (a stdout that survives `| head`), [`table`](mod@table)
//! (aligned columns), [`escape`] (database text made terminal-safe), [`hex`] (hex strings and
//! dumps) and [`json`] (pretty JSON that keeps the stored text). Base64 is the `base64` crate.

use std::io::{self, Write};

use crate::error::CliError;

pub mod escape;
pub mod hex;
pub mod json;
pub mod table;

pub use escape::{display, tenant_label};
pub use table::table;

/// Buffered, locked stdout. Every write returns `io::Result`, so a closed pipe ends the command
/// quietly (exit 0) instead of panicking the way `println!` does.
pub struct Out {
    inner: io::BufWriter<io::StdoutLock<'static>>,
}

impl Out {
    pub fn new() -> Self {
        Self {
            inner: io::BufWriter::new(io::stdout().lock()),
        }
    }

    pub fn line(&mut self, text: impl AsRef<str>) -> Result<(), CliError> {
        self.inner.write_all(text.as_ref().as_bytes())?;
        self.inner.write_all(b"\n")?;
        Ok(())
    }

    /// One JSON value on one line.
    pub fn json(&mut self, value: &impl serde::Serialize) -> Result<(), CliError> {
        let text = serde_json::to_string(value)
            .map_err(|e| CliError::Other(format!("cannot encode JSON output: {e}")))?;
        self.line(text)
    }

    pub fn flush(&mut self) -> Result<(), CliError> {
        self.inner.flush()?;
        Ok(())
    }
}
