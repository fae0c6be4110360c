//! Writing results, one job per module: [`Out`] (a stdout that survives `| head`), [`table`](mod@table)
//! (aligned columns), [`escape`] (database text made terminal-safe), [`hex`] (hex strings and
//! dumps) and [`json`] (pretty JSON that keeps the stored text). Base64 is the `base64` crate.

use std::io::{self, Write};

use crate::error::CliError;

pub mod escape;
pub mod hex;
pub mod json;
pub mod table;

pub use escape::{display, quoted, tenant_label};
pub use table::table;

/// Buffered, locked stdout. Every write returns `io::Result`, so a closed pipe ends the command
/// quietly (exit 0) instead of panicking the way `println!` does.
///
/// A command whose exit code says more than its output ([`Out::for_outcome`]: `migrate`,
/// `purge`, `release`) instead carries on when its reader has gone and drops the rest of its
/// output: a deploy gate's `migrate --check`, or a `release` with a key refused, must not exit 0
/// because nobody read what it printed.
pub struct Out {
    inner: io::BufWriter<io::StdoutLock<'static>>,
    /// Whether a closed pipe drops the output (the command goes on) rather than ending it.
    outcome_matters: bool,
    /// The reader has gone: what is written is dropped.
    closed: bool,
}

impl Out {
    /// For a command whose output is all it does (`list`, `show`, `stats`): a closed pipe ends
    /// it, exit 0.
    pub fn new() -> Self {
        Self::with(false)
    }

    /// For a command whose exit code is its outcome (`migrate`, `purge`, `release`): a closed
    /// pipe drops the output, and the command ends as it would have.
    pub fn for_outcome() -> Self {
        Self::with(true)
    }

    fn with(outcome_matters: bool) -> Self {
        Self {
            inner: io::BufWriter::new(io::stdout().lock()),
            outcome_matters,
            closed: false,
        }
    }

    pub fn line(&mut self, text: impl AsRef<str>) -> Result<(), CliError> {
        if self.closed {
            return Ok(());
        }
        let written = self
            .inner
            .write_all(text.as_ref().as_bytes())
            .and_then(|()| self.inner.write_all(b"\n"));
        self.settle(written)
    }

    /// One JSON value on one line.
    pub fn json(&mut self, value: &impl serde::Serialize) -> Result<(), CliError> {
        let text = serde_json::to_string(value)
            .map_err(|e| CliError::Other(format!("cannot encode JSON output: {e}")))?;
        self.line(text)
    }

    pub fn flush(&mut self) -> Result<(), CliError> {
        if self.closed {
            return Ok(());
        }
        let flushed = self.inner.flush();
        self.settle(flushed)
    }

    fn settle(&mut self, written: io::Result<()>) -> Result<(), CliError> {
        match written {
            Err(e) if e.kind() == io::ErrorKind::BrokenPipe && self.outcome_matters => {
                self.closed = true;
                Ok(())
            }
            other => Ok(other?),
        }
    }
}
