//! Storage for tidings.
//!
//! Everything durable sits on one ordered key-value backend ([`Kv`]): [`SledKv`] in production,
//! [`MemoryKv`] (with a crash model and failpoints) in tests and the simulator. The typed stores are
//! written once against it:
//!
//! * [`MetaStore`] — slot metadata, keyed by hash slot; atomic write batches that also record a group's
//!   applied index; paged scans; export and import of whole hash slots.
//! * [`RaftLogStore`] — raft logs of many slot groups; [`GroupStorage`] is raft-rs's [`raft::Storage`].
//!
//! Writes are visible when applied and durable after `sync()`. A sync of [`SledKv`] is a real
//! `fdatasync` of sled's files (sled's own `flush()` is not durable on power loss). Values are checked
//! with a CRC when read back; corruption is a typed [`StoreError::Corrupt`] with its location.
//!
//! ```
//! use std::sync::Arc;
//! use tidings_store::{MemoryKv, MetaSpace, MetaStore, MetaWriteBatch};
//! use tidings_types::{GroupId, HashSlot};
//!
//! let kv = Arc::new(MemoryKv::new());
//! let meta = MetaStore::new(kv.clone());
//! // Group 1's copy of hash slot 9.
//! let slot = MetaSpace::slot(GroupId::new(1), HashSlot::new(9).unwrap());
//! let mut batch = MetaWriteBatch::new();
//! batch.put(slot, "user/42", "alice").set_applied(GroupId::new(1), 17);
//! meta.write(&batch).unwrap();
//! meta.sync().unwrap();
//!
//! kv.crash(); // only synced writes survive
//! assert_eq!(meta.get(slot, b"user/42").unwrap().as_deref(), Some(&b"alice"[..]));
//! assert_eq!(meta.applied_index(GroupId::new(1)).unwrap(), 17);
//! ```
#![forbid(unsafe_code)]
#![deny(missing_docs)]

/// Gives back most of a hash map's capacity once it holds far fewer entries than it has room for: hash
/// maps keep their capacity, so a burst of 100,000 channels would otherwise stay allocated after they
/// left memory.
pub fn shrink_if_sparse<K: std::hash::Hash + Eq, V>(map: &mut rustc_hash::FxHashMap<K, V>) {
    if map.capacity() > 4 * map.len() + 1024 {
        map.shrink_to(2 * map.len());
    }
}

mod error;
mod failpoint;
mod identity;
pub mod kv;
mod latency;
pub mod message;
mod meta;
mod raft_log;

pub use error::{CorruptLocation, StoreError, StoreResult};
pub use identity::IdentityStore;
pub use kv::{FailOp, Keyspace, Kv, KvBatch, MemoryKv, SledKv, SyncReport};
pub use latency::LatencyHistogram;
pub use meta::{
    ExportChunk, ExportCursor, MetaOp, MetaPage, MetaSpace, MetaStore, MetaWriteBatch, Placement, SpaceEntry,
};
pub use raft_log::{GroupStorage, RaftLogBatch, RaftLogStore, SnapshotSource, BOOTSTRAP_INDEX};
