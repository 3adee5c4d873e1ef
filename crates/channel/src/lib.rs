//! Channel message layer: replica machine, reactor runtime and fanout planner (in progress).
#![forbid(unsafe_code)]
#![deny(missing_docs)]
