//! A `Write` into a shared buffer, for tests that read back what `tracing` wrote.
//!
//! One file, included by path into two test binaries of two crates: the library's
//! `tests/logs.rs` and the end-to-end `tests/tests/redis_logs.rs`. The library's tests cannot
//! use the end-to-end crate, and a log-capturing helper does not belong in the library's public
//! `test-suite` feature. Each includer uses part of it (`#[allow(dead_code)]` on its `mod`).

use std::io::Write;
use std::sync::{Arc, Mutex};

/// The log lines written so far, shared by every clone (the subscriber's writer and the test).
#[derive(Clone, Default)]
pub struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.bytes().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    /// Everything written, as text.
    pub fn text(&self) -> String {
        self.text_from(0)
    }

    /// What was written after the first `from` bytes, as text.
    pub fn text_from(&self, from: usize) -> String {
        let bytes = self.bytes();
        String::from_utf8_lossy(&bytes[from.min(bytes.len())..]).into_owned()
    }

    /// How many bytes were written so far: a mark for [`Captured::text_from`].
    pub fn written(&self) -> usize {
        self.bytes().len()
    }

    fn bytes(&self) -> std::sync::MutexGuard<'_, Vec<u8>> {
        // A test that panicked while writing leaves whole lines behind; keep reading them.
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}
