//! The channel message layer: one ordered, replicated log per channel.
//!
//! [`machine::ChannelMachine`] is the per-replica state machine — pure, deterministic, sans-IO. A runtime
//! drives it like this:
//!
//! ```no_run
//! use tidings_channel::machine::{ChannelMachine, Effect};
//! # fn deliver(_: Effect) {}
//! # fn next_input() -> Option<tidings_types::Time> { None }
//! # let mut machine: ChannelMachine = unimplemented!();
//! while let Some(now) = next_input() {
//!     // ... machine.handle_append / handle_message / handle_persisted / handle_meta (now, ..)
//!     if machine.poll_timeout().is_some_and(|at| at <= now) {
//!         machine.handle_timeout(now);
//!     }
//!     while let Some(effect) = machine.poll_effect() {
//!         deliver(effect); // persist, send, complete appends, propose meta
//!     }
//! }
//! ```
#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub mod fanout;
pub mod machine;
