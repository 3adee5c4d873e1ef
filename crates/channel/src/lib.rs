//! The channel message layer: one ordered, replicated log per channel.
//!
//! [`machine::ChannelMachine`] is the per-replica state machine — pure, deterministic, sans-IO. A runtime
//! drives it like this:
//!
//! ```
//! use tidings_channel::machine::{ChannelMachine, Effect};
//! use tidings_types::Time;
//!
//! fn drive(machine: &mut ChannelMachine, inputs: impl Iterator<Item = Time>, mut deliver: impl FnMut(Effect)) {
//!     for now in inputs {
//!         // ... machine.handle_append / handle_message / handle_persisted / handle_meta (now, ..)
//!         if machine.poll_timeout().is_some_and(|at| at <= now) {
//!             machine.handle_timeout(now);
//!         }
//!         while let Some(effect) = machine.poll_effect() {
//!             deliver(effect); // persist, send, complete appends, propose meta
//!         }
//!     }
//! }
//! ```
#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub mod fanout;
pub mod machine;
pub mod reactor;
