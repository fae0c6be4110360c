//! Idempotency-Key support for actix-web (crate docs are being written).
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod fingerprint;
pub mod store;

pub use fingerprint::Fingerprint;
