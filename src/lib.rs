//! tidings: the replicated core of a chat backend, as a library.
//!
//! A host starts a [`Node`] per process with its [`Transport`] (or several nodes in one process over an
//! [`mesh::InProcessMesh`]), then creates channels, appends and reads through it; committed messages
//! fan out through its [`FanoutHost`]. The building blocks are re-exported: identifiers, hash-slot
//! routing, the stores (metadata, raft logs, message log), the channel replica machine and fanout
//! planner, and the slot metadata layer.
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
pub mod mesh;
pub mod node;
mod runtime;

pub use node::{FanoutHost, NoFanout};
pub use runtime::{AppendHandle, Node, Pending, RouteKey, StorageOptions, Transport};

pub use tidings_channel as channel;
pub use tidings_router as router;
pub use tidings_slot as slot;
pub use tidings_store as store;
pub use tidings_types as types;
