//! Deterministic cluster simulator (in progress).
#![forbid(unsafe_code)]
#![deny(missing_docs)]
