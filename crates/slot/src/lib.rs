//! Slot metadata layer: metadata model, slot FSM and multi-raft driver (in progress).
#![forbid(unsafe_code)]
#![deny(missing_docs)]
