//! The slot metadata layer: users, channels, subscribers, memberships and channel runtime meta, sharded by
//! hash slot onto logical raft groups.
//!
//! * [`model`] and [`command::Command`]: what is stored and how it changes (versioned, serde-encoded).
//! * [`fsm::SlotFsm`]: applies committed commands of one group atomically, with its applied index.
//! * [`query::SlotReader`]: point reads and paged scans.
//! * [`raft::MultiRaft`]: many raft-rs groups per node, sans-IO: ticks, messages and storage syncs in,
//!   effects out.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub mod command;
pub mod fsm;
mod keys;
pub mod model;
pub mod query;
pub mod raft;
