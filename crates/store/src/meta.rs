//! The metadata store: key spaces per hash slot, atomic write batches that carry a group's applied
//! index, paged scans, and export / import of whole hash slots.

use crate::error::{CorruptLocation, StoreError, StoreResult};
use crate::kv::{Direction, KeyRange, Keyspace, Kv, KvBatch, KvPair};
use std::collections::BTreeSet;
use std::sync::Arc;
use tidings_types::{GroupId, HashSlot};

/// One change to slot metadata.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MetaOp {
    /// Sets `key` in `slot`.
    Put {
        /// The key's hash slot.
        slot: HashSlot,
        /// The key.
        key: Vec<u8>,
        /// The value.
        value: Vec<u8>,
    },
    /// Removes `key` from `slot`.
    Delete {
        /// The key's hash slot.
        slot: HashSlot,
        /// The key.
        key: Vec<u8>,
    },
    /// Removes every key of `slot` (before an import, or when a migrated slot is cleaned from its source).
    ClearSlot {
        /// The slot.
        slot: HashSlot,
    },
}

/// Changes applied as one atomic write, optionally recording the applied index of a group in the same
/// write, so that a crash can never leave half a batch applied or a batch applied without its index.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MetaWriteBatch {
    ops: Vec<MetaOp>,
    applied: Option<(GroupId, u64)>,
    config_epoch: Option<(GroupId, u64)>,
}

impl MetaWriteBatch {
    /// An empty batch.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets `key` in `slot`.
    pub fn put(&mut self, slot: HashSlot, key: impl Into<Vec<u8>>, value: impl Into<Vec<u8>>) -> &mut Self {
        self.ops.push(MetaOp::Put { slot, key: key.into(), value: value.into() });
        self
    }

    /// Removes `key` from `slot`.
    pub fn delete(&mut self, slot: HashSlot, key: impl Into<Vec<u8>>) -> &mut Self {
        self.ops.push(MetaOp::Delete { slot, key: key.into() });
        self
    }

    /// Removes every key of `slot`; later puts in this batch are kept.
    pub fn clear_slot(&mut self, slot: HashSlot) -> &mut Self {
        self.ops.push(MetaOp::ClearSlot { slot });
        self
    }

    /// Records that `group` has applied everything up to `index`, in the same atomic write.
    pub fn set_applied(&mut self, group: GroupId, index: u64) -> &mut Self {
        self.applied = Some((group, index));
        self
    }

    /// Records `group`'s configuration epoch (the raft index of the membership change in force), in the
    /// same atomic write.
    pub fn set_config_epoch(&mut self, group: GroupId, epoch: u64) -> &mut Self {
        self.config_epoch = Some((group, epoch));
        self
    }

    /// The changes, in order.
    pub fn ops(&self) -> &[MetaOp] {
        &self.ops
    }

    /// `true` if the batch changes nothing and records no index.
    pub fn is_empty(&self) -> bool {
        self.ops.is_empty() && self.applied.is_none() && self.config_epoch.is_none()
    }
}

/// A page of a scan: up to the requested number of entries, and where to continue.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MetaPage {
    /// Keys (without the slot prefix) and values, ascending.
    pub entries: Vec<(Vec<u8>, Vec<u8>)>,
    /// Pass as `after` to read the next page; `None` when the scan is complete.
    pub next_after: Option<Vec<u8>>,
}

/// One exported key of a hash slot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlotEntry {
    /// The key's slot.
    pub slot: HashSlot,
    /// The key.
    pub key: Vec<u8>,
    /// The value.
    pub value: Vec<u8>,
}

/// A bounded chunk of an export of hash slots.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ExportChunk {
    /// Entries in (slot, key) order.
    pub entries: Vec<SlotEntry>,
    /// Where the next chunk starts; `None` when the export is complete.
    pub next: Option<ExportCursor>,
}

/// Position of an export in progress: the next chunk starts strictly after `(slot, key)`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExportCursor {
    /// Slot of the last exported entry.
    pub slot: HashSlot,
    /// Key of the last exported entry.
    pub key: Vec<u8>,
}

/// Slot metadata over a [`Kv`]. Writes are visible at once and durable after [`MetaStore::sync`].
#[derive(Clone)]
pub struct MetaStore {
    kv: Arc<dyn Kv>,
}

/// Suffix of a group's configuration-epoch key in [`Keyspace::Applied`] (the applied index has none).
const CONFIG_EPOCH_TAG: u8 = b'e';

/// Key of a group-level record in [`Keyspace::Applied`].
fn group_key(group: GroupId, tag: Option<u8>) -> Vec<u8> {
    let mut key = group.get().to_be_bytes().to_vec();
    key.extend(tag);
    key
}

/// Keys are read in pages of this many entries when a slot is cleared.
const CLEAR_PAGE: usize = 1024;

impl MetaStore {
    /// A metadata store over `kv`.
    pub fn new(kv: Arc<dyn Kv>) -> Self {
        Self { kv }
    }

    /// The value of `key` in `slot`.
    pub fn get(&self, slot: HashSlot, key: &[u8]) -> StoreResult<Option<Vec<u8>>> {
        self.kv.get(Keyspace::Meta, &slot_key(slot, key))
    }

    /// Up to `limit` entries of `slot` whose keys start with `prefix` and sort after `after`.
    pub fn scan(&self, slot: HashSlot, prefix: &[u8], after: Option<&[u8]>, limit: usize) -> StoreResult<MetaPage> {
        let full_prefix = slot_key(slot, prefix);
        let mut range = KeyRange::prefix(&full_prefix);
        if let Some(after) = after {
            // Never start before the prefix, whatever `after` is.
            range.start = range.start.max(successor(&slot_key(slot, after)));
        }
        let pairs = self.kv.scan(Keyspace::Meta, &range, Direction::Forward, limit)?;
        let entries: Vec<(Vec<u8>, Vec<u8>)> = pairs.into_iter().map(|(k, v)| (k[SLOT_PREFIX..].to_vec(), v)).collect();
        let next_after = (entries.len() == limit && limit > 0).then(|| entries[entries.len() - 1].0.clone());
        Ok(MetaPage { entries, next_after })
    }

    /// The last index `group` recorded with [`MetaWriteBatch::set_applied`], 0 if none.
    pub fn applied_index(&self, group: GroupId) -> StoreResult<u64> {
        self.group_u64(group_key(group, None), "applied index is not 8 bytes")
    }

    /// The configuration epoch `group` recorded with [`MetaWriteBatch::set_config_epoch`], 0 if none.
    pub fn config_epoch(&self, group: GroupId) -> StoreResult<u64> {
        self.group_u64(group_key(group, Some(CONFIG_EPOCH_TAG)), "config epoch is not 8 bytes")
    }

    /// Forgets `group`'s applied index and configuration epoch (this node no longer holds the group).
    pub fn forget_group(&self, group: GroupId) -> StoreResult<()> {
        let mut batch = KvBatch::new();
        batch.delete(Keyspace::Applied, group_key(group, None));
        batch.delete(Keyspace::Applied, group_key(group, Some(CONFIG_EPOCH_TAG)));
        self.kv.apply(batch)
    }

    fn group_u64(&self, key: Vec<u8>, detail: &'static str) -> StoreResult<u64> {
        match self.kv.get(Keyspace::Applied, &key)? {
            None => Ok(0),
            Some(bytes) => decode_u64(&bytes).ok_or(StoreError::Corrupt {
                location: CorruptLocation::Kv { keyspace: Keyspace::Applied, key },
                detail,
            }),
        }
    }

    /// Applies `batch` atomically. Visible at once; durable after [`MetaStore::sync`].
    pub fn write(&self, batch: &MetaWriteBatch) -> StoreResult<()> {
        let mut kv_batch = KvBatch::new();
        // Keys put earlier in this batch: a later ClearSlot must remove them too, as stored keys do not
        // include them yet.
        let mut put_here: BTreeSet<Vec<u8>> = BTreeSet::new();
        for op in &batch.ops {
            match op {
                MetaOp::Put { slot, key, value } => {
                    let full = slot_key(*slot, key);
                    kv_batch.put(Keyspace::Meta, full.clone(), value);
                    put_here.insert(full);
                }
                MetaOp::Delete { slot, key } => kv_batch.delete(Keyspace::Meta, slot_key(*slot, key)),
                MetaOp::ClearSlot { slot } => {
                    self.delete_slot_into(*slot, &mut kv_batch)?;
                    let prefix = slot.index().to_be_bytes();
                    let (cleared, kept): (BTreeSet<_>, BTreeSet<_>) =
                        put_here.into_iter().partition(|k| k.starts_with(&prefix));
                    for key in cleared {
                        kv_batch.delete(Keyspace::Meta, key);
                    }
                    put_here = kept;
                }
            }
        }
        if let Some((group, index)) = batch.applied {
            kv_batch.put(Keyspace::Applied, group_key(group, None), &index.to_le_bytes());
        }
        if let Some((group, epoch)) = batch.config_epoch {
            kv_batch.put(Keyspace::Applied, group_key(group, Some(CONFIG_EPOCH_TAG)), &epoch.to_le_bytes());
        }
        self.kv.apply(kv_batch)
    }

    /// Makes every write so far durable.
    pub fn sync(&self) -> StoreResult<()> {
        self.kv.sync()
    }

    /// Exports `slots` (ascending) in chunks of at most `max_bytes` of keys and values (at least one entry
    /// per chunk), starting after `cursor`.
    pub fn export_slots(
        &self,
        slots: &[HashSlot],
        cursor: Option<&ExportCursor>,
        max_bytes: usize,
    ) -> StoreResult<ExportChunk> {
        let mut slots = slots.to_vec();
        slots.sort_unstable();
        slots.dedup();
        let mut chunk = ExportChunk::default();
        let mut bytes = 0usize;
        for slot in slots.into_iter().filter(|s| cursor.is_none_or(|c| *s >= c.slot)) {
            let mut after = cursor.filter(|c| c.slot == slot).map(|c| c.key.clone());
            loop {
                let page = self.scan(slot, b"", after.as_deref(), CLEAR_PAGE)?;
                for (key, value) in page.entries {
                    if bytes >= max_bytes && !chunk.entries.is_empty() {
                        let last = chunk.entries.last().map(|e| ExportCursor { slot: e.slot, key: e.key.clone() });
                        chunk.next = last;
                        return Ok(chunk);
                    }
                    bytes += key.len() + value.len();
                    chunk.entries.push(SlotEntry { slot, key, value });
                }
                match page.next_after {
                    Some(next) => after = Some(next),
                    None => break,
                }
            }
        }
        Ok(chunk)
    }

    fn delete_slot_into(&self, slot: HashSlot, batch: &mut KvBatch) -> StoreResult<()> {
        let mut range = KeyRange::prefix(&slot_key(slot, b""));
        loop {
            let pairs: Vec<KvPair> = self.kv.scan_sealed(Keyspace::Meta, &range, Direction::Forward, CLEAR_PAGE)?;
            let Some((last, _)) = pairs.last() else { return Ok(()) };
            range.start = successor(last);
            let done = pairs.len() < CLEAR_PAGE;
            for (key, _) in pairs {
                batch.delete(Keyspace::Meta, key);
            }
            if done {
                return Ok(());
            }
        }
    }
}

const SLOT_PREFIX: usize = 2;

fn slot_key(slot: HashSlot, key: &[u8]) -> Vec<u8> {
    let mut full = Vec::with_capacity(SLOT_PREFIX + key.len());
    full.extend_from_slice(&slot.index().to_be_bytes());
    full.extend_from_slice(key);
    full
}

/// The smallest key greater than `key`.
fn successor(key: &[u8]) -> Vec<u8> {
    let mut next = key.to_vec();
    next.push(0);
    next
}

fn decode_u64(bytes: &[u8]) -> Option<u64> {
    Some(u64::from_le_bytes(bytes.try_into().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::{FailOp, MemoryKv};

    fn slot(i: u16) -> HashSlot {
        HashSlot::new(i).unwrap()
    }

    #[test]
    fn batch_and_applied_index_are_atomic_under_failpoint() {
        let kv = Arc::new(MemoryKv::new());
        let store = MetaStore::new(kv.clone());
        let mut batch = MetaWriteBatch::new();
        batch.put(slot(1), "a", "1").put(slot(2), "b", "2").set_applied(GroupId::new(1), 5);
        kv.fail(FailOp::Apply, 0, 1);
        assert!(store.write(&batch).is_err());
        assert_eq!(store.get(slot(1), b"a").unwrap(), None);
        assert_eq!(store.applied_index(GroupId::new(1)).unwrap(), 0);
        store.write(&batch).unwrap();
        assert_eq!(store.get(slot(2), b"b").unwrap(), Some(b"2".to_vec()));
        assert_eq!(store.applied_index(GroupId::new(1)).unwrap(), 5);
    }

    #[test]
    fn scan_pages_through_a_prefix() {
        let store = MetaStore::new(Arc::new(MemoryKv::new()));
        let mut batch = MetaWriteBatch::new();
        for i in 0..25 {
            batch.put(slot(3), format!("sub/{i:03}"), vec![1]);
        }
        batch.put(slot(3), "user/1", vec![2]).put(slot(4), "sub/000", vec![3]);
        store.write(&batch).unwrap();
        let mut seen = Vec::new();
        let mut after = None;
        loop {
            let page = store.scan(slot(3), b"sub/", after.as_deref(), 10).unwrap();
            assert!(page.entries.len() <= 10);
            seen.extend(page.entries.into_iter().map(|(k, _)| k));
            match page.next_after {
                Some(next) => after = Some(next),
                None => break,
            }
        }
        assert_eq!(seen.len(), 25);
        assert!(seen.windows(2).all(|w| w[0] < w[1]));
    }

    #[test]
    fn clear_slot_then_import_replaces_a_slot() {
        let store = MetaStore::new(Arc::new(MemoryKv::new()));
        let mut batch = MetaWriteBatch::new();
        for i in 0..3000u32 {
            batch.put(slot(7), i.to_be_bytes().to_vec(), b"old".to_vec());
        }
        batch.put(slot(8), "keep", "x");
        store.write(&batch).unwrap();
        let mut import = MetaWriteBatch::new();
        import.clear_slot(slot(7)).put(slot(7), "new", "y");
        store.write(&import).unwrap();
        let page = store.scan(slot(7), b"", None, 10).unwrap();
        assert_eq!(page.entries, vec![(b"new".to_vec(), b"y".to_vec())]);
        assert_eq!(store.get(slot(8), b"keep").unwrap(), Some(b"x".to_vec()));
    }

    #[test]
    fn export_in_bounded_chunks_round_trips() {
        let source = MetaStore::new(Arc::new(MemoryKv::new()));
        let mut batch = MetaWriteBatch::new();
        for s in [1u16, 5, 9] {
            for i in 0..50u8 {
                batch.put(slot(s), vec![i], vec![u8::try_from(s).unwrap(); 20]);
            }
        }
        source.write(&batch).unwrap();
        let target = MetaStore::new(Arc::new(MemoryKv::new()));
        let mut cursor = None;
        let mut chunks = 0;
        loop {
            let chunk = source.export_slots(&[slot(9), slot(1)], cursor.as_ref(), 300).unwrap();
            let bytes: usize = chunk.entries.iter().map(|e| e.key.len() + e.value.len()).sum();
            assert!(bytes <= 300 + 21, "chunk of {bytes} bytes");
            let mut import = MetaWriteBatch::new();
            for e in &chunk.entries {
                import.put(e.slot, e.key.clone(), e.value.clone());
            }
            target.write(&import).unwrap();
            chunks += 1;
            match chunk.next {
                Some(next) => cursor = Some(next),
                None => break,
            }
        }
        assert!(chunks > 2);
        for s in [1u16, 9] {
            assert_eq!(target.scan(slot(s), b"", None, 100).unwrap().entries.len(), 50);
        }
        assert!(target.scan(slot(5), b"", None, 100).unwrap().entries.is_empty());
    }
}
