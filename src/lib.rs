//! tidings: the replicated core of a chat backend, as a library.
//!
//! This facade re-exports the building blocks that exist today: identifiers, hash-slot routing, the
//! stores (metadata, raft logs, message log), the channel replica machine and the slot metadata layer.
//! The node runtime (`Node`, `Transport`) lands on top of them.
//!
//! ```
//! use tidings::router::{hash_slot, HashToSlot};
//! let table = HashToSlot::even_split(8).unwrap();
//! let group = table.group_of(hash_slot(b"uid-1"));
//! assert!(table.groups().any(|g| g == group));
//! ```
#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub mod frame;
pub mod node;
mod runtime;

pub use runtime::{AppendHandle, FanoutHost, NoFanout, Node, RouteKey, StorageOptions, Transport};

pub use tidings_channel as channel;
pub use tidings_router as router;
pub use tidings_slot as slot;
pub use tidings_store as store;
pub use tidings_types as types;
