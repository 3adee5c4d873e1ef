//! A node's storage identity and what it remembers of its peers' (`Keyspace::Identity`).
//!
//! A raft voter is safe only with its votes and log, and a channel replica only with the records it
//! acknowledged: a node started again on a new or emptied data directory must not be taken for the
//! node it was. So a directory draws a [`StorageId`] when it is first initialized and keeps it; every
//! frame a node sends names it, and each node keeps the first identity it saw of every peer here,
//! in the same store as its raft state (durable with the next sync of the slot stores, which the node
//! asks for as soon as it records a peer's first identity).

use crate::error::{CorruptLocation, StoreError, StoreResult};
use crate::kv::{Direction, KeyRange, Keyspace, Kv, KvBatch};
use std::sync::Arc;
use tidings_types::{NodeId, StorageId};

/// Key of this directory's own identity.
const OWN_KEY: &[u8] = b"own";
/// Key of the mark that a majority of the cluster took this directory's identity.
const ACCEPTED_KEY: &[u8] = b"accepted";
/// Prefix of the keys of peers' identities (followed by the node id, big-endian).
const PEER_PREFIX: &[u8] = b"peer/";
/// Peers read at most: a cluster's nodes are configured, a few hundred at the very most.
const PEERS_MAX: usize = 4096;

/// Storage identities over a [`Kv`] (see the module docs).
#[derive(Clone)]
pub struct IdentityStore {
    kv: Arc<dyn Kv>,
}

impl IdentityStore {
    /// The identity store over `kv`.
    pub fn new(kv: Arc<dyn Kv>) -> Self {
        Self { kv }
    }

    /// This directory's identity, drawing it with `draw` (and making it durable before returning) when
    /// the directory has none yet — a new or emptied directory. `draw` returning zero is taken as one.
    pub fn own_or_create(&self, draw: impl FnOnce() -> u64) -> StoreResult<StorageId> {
        if let Some(bytes) = self.kv.get(Keyspace::Identity, OWN_KEY)? {
            return decode(&bytes).ok_or_else(|| corrupt(OWN_KEY.to_vec(), "storage identity is not 8 nonzero bytes"));
        }
        let id = StorageId::new(draw().max(1));
        self.put(OWN_KEY.to_vec(), &id.get().to_be_bytes())?;
        // Durable before any frame names it: peers that saw it would refuse a node that drew another.
        self.kv.sync()?;
        Ok(id)
    }

    /// `true` once [`IdentityStore::set_accepted`] was made durable: a majority of the cluster took this
    /// directory's identity, so the node is no longer held back as one on a directory its peers may
    /// refuse.
    pub fn accepted(&self) -> StoreResult<bool> {
        Ok(self.kv.get(Keyspace::Identity, ACCEPTED_KEY)?.is_some())
    }

    /// Marks this directory's identity accepted by a majority of the cluster, durably.
    pub fn set_accepted(&self) -> StoreResult<()> {
        self.put(ACCEPTED_KEY.to_vec(), &[1])?;
        self.kv.sync()
    }

    /// Every peer identity recorded, by node.
    pub fn peers(&self) -> StoreResult<Vec<(NodeId, StorageId)>> {
        let pairs = self.kv.scan(Keyspace::Identity, &KeyRange::prefix(PEER_PREFIX), Direction::Forward, PEERS_MAX)?;
        pairs
            .into_iter()
            .map(|(key, value)| {
                let node = key[PEER_PREFIX.len()..].try_into().ok().map(|b| NodeId::new(u64::from_be_bytes(b)));
                match (node, decode(&value)) {
                    (Some(node), Some(id)) => Ok((node, id)),
                    _ => Err(corrupt(key, "peer storage identity is not a node and 8 nonzero bytes")),
                }
            })
            .collect()
    }

    /// Records `id` as `node`'s identity (durable with the store's next sync).
    pub fn record_peer(&self, node: NodeId, id: StorageId) -> StoreResult<()> {
        self.put(peer_key(node), &id.get().to_be_bytes())
    }

    /// Forgets `node`'s identity (durable with the store's next sync).
    pub fn forget_peer(&self, node: NodeId) -> StoreResult<()> {
        let mut batch = KvBatch::new();
        batch.delete(Keyspace::Identity, peer_key(node));
        self.kv.apply(batch)
    }

    /// Writes one key of the identity keyspace (durable with the store's next sync).
    fn put(&self, key: Vec<u8>, value: &[u8]) -> StoreResult<()> {
        let mut batch = KvBatch::new();
        batch.put(Keyspace::Identity, key, value);
        self.kv.apply(batch)
    }
}

fn peer_key(node: NodeId) -> Vec<u8> {
    let mut key = PEER_PREFIX.to_vec();
    key.extend_from_slice(&node.get().to_be_bytes());
    key
}

fn decode(bytes: &[u8]) -> Option<StorageId> {
    let raw = u64::from_be_bytes(bytes.try_into().ok()?);
    (raw != 0).then_some(StorageId::new(raw))
}

fn corrupt(key: Vec<u8>, detail: &'static str) -> StoreError {
    StoreError::Corrupt { location: CorruptLocation::Kv { keyspace: Keyspace::Identity, key }, detail }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::MemoryKv;

    #[test]
    fn a_directory_keeps_the_identity_it_drew_first_across_a_crash() {
        let kv = Arc::new(MemoryKv::new());
        let store = IdentityStore::new(kv.clone());
        let id = store.own_or_create(|| 42).unwrap();
        assert_eq!(id, StorageId::new(42));
        kv.crash();
        assert_eq!(IdentityStore::new(kv).own_or_create(|| 7).unwrap(), id, "drawn once, durable at once");
    }

    #[test]
    fn acceptance_is_durable_and_an_emptied_directory_has_none() {
        let kv = Arc::new(MemoryKv::new());
        let store = IdentityStore::new(kv.clone());
        store.own_or_create(|| 3).unwrap();
        assert!(!store.accepted().unwrap());
        store.set_accepted().unwrap();
        kv.crash();
        assert!(IdentityStore::new(kv).accepted().unwrap());
        assert!(!IdentityStore::new(Arc::new(MemoryKv::new())).accepted().unwrap());
    }

    #[test]
    fn an_empty_directory_draws_anew_and_never_zero() {
        let store = IdentityStore::new(Arc::new(MemoryKv::new()));
        assert_eq!(store.own_or_create(|| 0).unwrap(), StorageId::new(1));
    }

    #[test]
    fn peer_identities_are_durable_with_the_next_sync_only() {
        let kv = Arc::new(MemoryKv::new());
        let store = IdentityStore::new(kv.clone());
        store.record_peer(NodeId::new(2), StorageId::new(20)).unwrap();
        store.record_peer(NodeId::new(3), StorageId::new(30)).unwrap();
        kv.sync().unwrap();
        store.record_peer(NodeId::new(3), StorageId::new(31)).unwrap();
        assert_eq!(
            store.peers().unwrap(),
            vec![(NodeId::new(2), StorageId::new(20)), (NodeId::new(3), StorageId::new(31))]
        );
        kv.crash();
        assert_eq!(
            store.peers().unwrap(),
            vec![(NodeId::new(2), StorageId::new(20)), (NodeId::new(3), StorageId::new(30))]
        );
    }

    #[test]
    fn a_corrupt_identity_is_reported_not_replaced() {
        let kv = Arc::new(MemoryKv::new());
        let mut batch = KvBatch::new();
        batch.put(Keyspace::Identity, OWN_KEY.to_vec(), &[1, 2, 3]);
        kv.apply(batch).unwrap();
        let error = IdentityStore::new(kv).own_or_create(|| 5).unwrap_err();
        assert!(matches!(error, StoreError::Corrupt { .. }), "{error}");
    }
}
