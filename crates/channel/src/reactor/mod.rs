//! What a channel reactor keeps around the replica machines it drives, independent of the node that
//! hosts it: the active replicas with their drain list, timers and last use ([`ActiveChannels`]), and
//! the outbox that packs their messages per destination ([`ChannelOutbox`]).
//!
//! A node splits its channels over a fixed number of reactors by the hash of the channel id; each
//! reactor drives only its own channels, so reactors share nothing. The node facade (`tidings`'s
//! `ChannelShard`) wires a reactor to the slot layer's metadata and to the stores, and its runtime runs
//! each one on its own thread.
//!
//! ```
//! use tidings_channel::reactor::ActiveChannels;
//! use tidings_types::Time;
//!
//! let mut active = ActiveChannels::default();
//! assert!(active.is_empty());
//! // A drain: every replica touched since the last one gives its effects and files its timer again.
//! let mut effects = Vec::new();
//! while let Some(channel) = active.drain_next(&mut effects) {
//!     for effect in effects.drain(..) {
//!         let _ = (&channel, effect); // send, persist, complete appends...
//!     }
//! }
//! assert_eq!(active.pop_due(Time::from_millis(1_000)), None);
//! ```

mod active;
mod outbox;
mod warm;

pub use active::{shrink_if_sparse, ActiveChannels};
pub use outbox::ChannelOutbox;
pub use warm::{feed_in_warm_runs, WARM_RUN};
