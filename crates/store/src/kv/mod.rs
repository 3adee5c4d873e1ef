//! The ordered key-value backend every typed store is built on, and its two implementations.
//!
//! A [`Kv`] holds keyspaces of ordered keys, applies a [`KvBatch`] atomically (all of it or none of it,
//! also across a crash), and makes everything applied so far durable on [`Kv::sync`]. Typed stores
//! ([`crate::MetaStore`], [`crate::RaftLogStore`]) are written once against this trait, so the sled
//! backend used in production and the in-memory backend used by the simulator run the same logic.
//!
//! Every value is sealed with a CRC-32 over its keyspace, key and bytes when written and checked when
//! read: a corrupt or misplaced value is a [`StoreError::Corrupt`] naming its location, never data.

mod memory;
mod sled_kv;

pub use memory::{FailOp, MemoryKv};
pub use sled_kv::{SledKv, SyncReport};

use crate::error::{CorruptLocation, StoreError, StoreResult};
use std::sync::atomic::AtomicU64;

/// A keyspace: one byte that prefixes every key of one kind of record.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(u8)]
#[non_exhaustive]
pub enum Keyspace {
    /// Slot metadata, keyed by slot group, then hash slot (or the group's own records), then the key.
    Meta = b'm',
    /// Which slot group holds each hash slot, as far as this node knows, with the slot's ownership epoch.
    Placement = b'o',
    /// Applied index of each slot group.
    Applied = b'a',
    /// Raft log entries, keyed by group then index.
    RaftEntry = b'e',
    /// Raft hard state, conf state and truncation marker per group.
    RaftState = b's',
    /// Where each message-log record pack written behind the journal lives, keyed by channel then the
    /// pack's first seq (the value is the pack's key in [`Keyspace::MessageBody`]).
    MessagePack = b'p',
    /// The record packs themselves, keyed by write-behind round, then channel, then first seq: a
    /// round's packs land at the end of the keyspace, next to each other.
    MessageBody = b'b',
    /// Per-channel message-log state (epoch history, checkpointed HW, retention).
    MessageState = b'c',
    /// The message journal's checkpoint: where replay starts after a restart.
    Journal = b'j',
    /// This node's storage identity and the identities it has seen of its peers (see
    /// [`crate::IdentityStore`]).
    Identity = b'i',
}

impl Keyspace {
    fn tag(self) -> u8 {
        self as u8
    }
}

/// One change in a batch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KvOp {
    /// Sets `key` to a sealed value.
    Put {
        /// Keyspace.
        keyspace: Keyspace,
        /// Key within the keyspace.
        key: Vec<u8>,
        /// Sealed value (checksum + bytes).
        sealed: Vec<u8>,
    },
    /// Removes `key`.
    Delete {
        /// Keyspace.
        keyspace: Keyspace,
        /// Key within the keyspace.
        key: Vec<u8>,
    },
}

/// Changes applied atomically by [`Kv::apply`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KvBatch {
    ops: Vec<KvOp>,
}

impl KvBatch {
    /// An empty batch.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets `key` to `value`; the value is sealed with its checksum here.
    pub fn put(&mut self, keyspace: Keyspace, key: Vec<u8>, value: &[u8]) {
        let sealed = seal(keyspace, &key, value);
        self.ops.push(KvOp::Put { keyspace, key, sealed });
    }

    /// Sets `key` to the bytes `encode` writes, sealed in place (no intermediate copy of the value).
    pub fn put_encoded(&mut self, keyspace: Keyspace, key: Vec<u8>, encode: impl FnOnce(&mut Vec<u8>)) {
        let mut sealed = vec![0u8; SEAL_BYTES];
        encode(&mut sealed);
        let crc = checksum(keyspace, &key, &sealed[SEAL_BYTES..]);
        sealed[..SEAL_BYTES].copy_from_slice(&crc.to_le_bytes());
        self.ops.push(KvOp::Put { keyspace, key, sealed });
    }

    /// Removes `key`.
    pub fn delete(&mut self, keyspace: Keyspace, key: Vec<u8>) {
        self.ops.push(KvOp::Delete { keyspace, key });
    }

    /// Number of changes.
    pub fn len(&self) -> usize {
        self.ops.len()
    }

    /// `true` if the batch changes nothing.
    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    /// The changes, in order.
    pub fn ops(&self) -> &[KvOp] {
        &self.ops
    }

    /// The changes, by value.
    pub fn into_ops(self) -> Vec<KvOp> {
        self.ops
    }

    /// Appends every change of `other` after this batch's changes.
    pub fn extend(&mut self, other: KvBatch) {
        self.ops.extend(other.ops);
    }
}

/// Direction of a scan.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// Ascending keys.
    Forward,
    /// Descending keys.
    Reverse,
}

/// A key range within one keyspace: `start` inclusive, `end` exclusive (`None` = to the keyspace's end).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyRange {
    /// First key included.
    pub start: Vec<u8>,
    /// First key excluded, or `None` for the end of the keyspace.
    pub end: Option<Vec<u8>>,
}

impl KeyRange {
    /// Every key that starts with `prefix`.
    pub fn prefix(prefix: &[u8]) -> Self {
        Self { start: prefix.to_vec(), end: prefix_end(prefix) }
    }

    /// `true` if `key` is inside the range.
    pub fn contains(&self, key: &[u8]) -> bool {
        key >= self.start.as_slice() && self.end.as_deref().is_none_or(|end| key < end)
    }
}

/// The smallest key greater than every key starting with `prefix`, or `None` if there is none
/// (the prefix is empty or all `0xff`).
pub fn prefix_end(prefix: &[u8]) -> Option<Vec<u8>> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < u8::MAX {
            end.push(last + 1);
            return Some(end);
        }
    }
    None
}

/// A key and its checked value, as returned by scans.
pub type KvPair = (Vec<u8>, Vec<u8>);

/// An ordered, atomic-batch, explicitly synced key-value backend.
///
/// Contract: `apply` is atomic — after any crash a batch is either wholly present or wholly absent — and
/// batches survive a crash in order (a later batch never survives without an earlier one). Everything
/// applied before a successful `sync` survives any crash after it. Reads see every applied batch.
pub trait Kv: Send + Sync + 'static {
    /// The sealed value of `key`.
    fn get_sealed(&self, keyspace: Keyspace, key: &[u8]) -> StoreResult<Option<Vec<u8>>>;

    /// Up to `limit` sealed pairs of `range`, in `direction` order.
    fn scan_sealed(
        &self,
        keyspace: Keyspace,
        range: &KeyRange,
        direction: Direction,
        limit: usize,
    ) -> StoreResult<Vec<KvPair>>;

    /// Applies `batch` atomically. Not durable until [`Kv::sync`].
    fn apply(&self, batch: KvBatch) -> StoreResult<()>;

    /// Makes every applied batch durable.
    fn sync(&self) -> StoreResult<()>;

    /// A counter the layer above bumps after writes that invalidate what it caches of this store
    /// ([`crate::MetaStore::routes_version`]). It lives with the backend so that every store handle over
    /// it, however many were made, sees the same count.
    fn cache_epoch(&self) -> &AtomicU64;

    /// Hands applied batches to the operating system without waiting for the disk (no durability
    /// promise): a backend that buffers writes empties its buffers, so that a later `sync` (whoever calls
    /// it) has little left to write. Default: nothing to do.
    fn write_out(&self) -> StoreResult<()> {
        Ok(())
    }

    /// The checked value of `key`.
    fn get(&self, keyspace: Keyspace, key: &[u8]) -> StoreResult<Option<Vec<u8>>> {
        self.get_sealed(keyspace, key)?.map(|sealed| unseal(keyspace, key, sealed)).transpose()
    }

    /// Up to `limit` checked pairs of `range`, in `direction` order.
    fn scan(
        &self,
        keyspace: Keyspace,
        range: &KeyRange,
        direction: Direction,
        limit: usize,
    ) -> StoreResult<Vec<KvPair>> {
        self.scan_sealed(keyspace, range, direction, limit)?
            .into_iter()
            .map(|(key, sealed)| {
                let value = unseal(keyspace, &key, sealed)?;
                Ok((key, value))
            })
            .collect()
    }
}

const SEAL_BYTES: usize = 4;

fn checksum(keyspace: Keyspace, key: &[u8], value: &[u8]) -> u32 {
    let mut hasher = crc32fast::Hasher::new();
    hasher.update(&[keyspace.tag()]);
    // The key length keeps (key, value) pairs from aliasing when bytes move across the boundary.
    hasher.update(&u32::try_from(key.len()).unwrap_or(u32::MAX).to_le_bytes());
    hasher.update(key);
    hasher.update(value);
    hasher.finalize()
}

/// Prefixes `value` with a checksum over its keyspace, key and bytes.
pub(crate) fn seal(keyspace: Keyspace, key: &[u8], value: &[u8]) -> Vec<u8> {
    let mut sealed = Vec::with_capacity(SEAL_BYTES + value.len());
    sealed.extend_from_slice(&checksum(keyspace, key, value).to_le_bytes());
    sealed.extend_from_slice(value);
    sealed
}

/// Checks and strips the seal written by [`seal`].
pub(crate) fn unseal(keyspace: Keyspace, key: &[u8], mut sealed: Vec<u8>) -> StoreResult<Vec<u8>> {
    let corrupt =
        |detail| StoreError::Corrupt { location: CorruptLocation::Kv { keyspace, key: key.to_vec() }, detail };
    let Some(stored) = sealed.get(..SEAL_BYTES) else {
        return Err(corrupt("value shorter than its checksum"));
    };
    let stored = u32::from_le_bytes([stored[0], stored[1], stored[2], stored[3]]);
    if stored != checksum(keyspace, key, &sealed[SEAL_BYTES..]) {
        return Err(corrupt("checksum mismatch"));
    }
    sealed.drain(..SEAL_BYTES);
    Ok(sealed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_end_handles_carry() {
        assert_eq!(prefix_end(b"ab"), Some(b"ac".to_vec()));
        assert_eq!(prefix_end(&[1, 0xff]), Some(vec![2]));
        assert_eq!(prefix_end(&[0xff, 0xff]), None);
        assert_eq!(prefix_end(b""), None);
        let range = KeyRange::prefix(&[7, 0xff]);
        assert!(range.contains(&[7, 0xff, 0, 1]));
        assert!(!range.contains(&[8]));
    }

    #[test]
    fn put_encoded_seals_like_put() {
        let mut a = KvBatch::new();
        a.put(Keyspace::MessagePack, b"k".to_vec(), b"value");
        let mut b = KvBatch::new();
        b.put_encoded(Keyspace::MessagePack, b"k".to_vec(), |out| out.extend_from_slice(b"value"));
        assert_eq!(a, b);
    }

    #[test]
    fn seal_detects_flipped_bits_and_moved_values() {
        let sealed = seal(Keyspace::Meta, b"k", b"value");
        assert_eq!(unseal(Keyspace::Meta, b"k", sealed.clone()).unwrap(), b"value");
        for bit in 0..sealed.len() * 8 {
            let mut bad = sealed.clone();
            bad[bit / 8] ^= 1 << (bit % 8);
            assert!(matches!(unseal(Keyspace::Meta, b"k", bad), Err(StoreError::Corrupt { .. })));
        }
        // The same bytes under another key or keyspace are refused too.
        assert!(unseal(Keyspace::Meta, b"j", sealed.clone()).is_err());
        assert!(unseal(Keyspace::Applied, b"k", sealed).is_err());
        assert!(unseal(Keyspace::Meta, b"k", vec![1, 2]).is_err());
    }
}
