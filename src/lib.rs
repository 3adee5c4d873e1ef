//! tidings: the replicated core of a chat backend, as a library.
//!
//! A host starts a [`Node`] per process with its [`Transport`] (or several nodes in one process over an
//! [`mesh::InProcessMesh`]), then creates channels, appends and reads through it; committed messages
//! fan out through its [`FanoutHost`]. The building blocks are re-exported: identifiers, hash-slot
//! routing, the stores (metadata, raft logs, message log), the channel replica machine and fanout
//! planner, and the slot metadata layer.
//!
//! A one-node cluster on a temp dir: a user, a group channel with the user subscribed, a message from
//! the user, and the channel read back (a real cluster lists every node in `NodeConfig::new` and carries
//! frames with its own [`Transport`]; every call below also has an `.await`able form).
//!
//! ```
//! use std::time::Duration;
//! use tidings::channel::machine::AppendRecord;
//! use tidings::mesh::InProcessMesh;
//! use tidings::node::NodeConfig;
//! use tidings::slot::command::{Command, MemberList};
//! use tidings::slot::model::{ChannelFlags, ChannelInfo, Uid, User};
//! use tidings::types::{ChannelId, ChannelType, NodeId, Seq};
//! use tidings::{Node, StorageOptions};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let dir = tempfile::tempdir()?;
//! let me = NodeId::new(1);
//! let mesh = InProcessMesh::new();
//! let node = std::sync::Arc::new(Node::start(NodeConfig::new(me, vec![me]), StorageOptions::new(dir.path()), mesh.transport(me))?);
//! mesh.attach(&node);
//! node.wait_ready(Duration::from_secs(10))?;
//!
//! let alice = Uid::new("alice").expect("a short uid");
//! node.propose(Command::PutUser(User { uid: alice.clone(), name: "Alice".into(), banned: false }))?;
//! let room = ChannelId::new(ChannelType::GROUP, "room-1").expect("a short id");
//! node.create_channel(ChannelInfo { channel: room.clone(), flags: ChannelFlags::default() })?;
//! node.propose(Command::AddMembers { channel: room.clone(), list: MemberList::Subscribers, uids: vec![alice.clone()] })?;
//!
//! let hello = AppendRecord { idempotency_key: None, payload: bytes::Bytes::from_static(b"hello") };
//! let seqs = node.append_from(room.clone(), alice, vec![hello])?.wait()?;
//! let page = node.read(&room, Seq::new(1), 100)?;
//! assert_eq!(page.iter().map(|r| r.seq).collect::<Vec<_>>(), seqs);
//! assert_eq!(&page[0].payload[..], b"hello");
//! # Ok(()) }
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
