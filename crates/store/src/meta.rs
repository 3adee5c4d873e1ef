//! The metadata store: one key space per (slot group, hash slot) plus one per group for the group's own
//! records, atomic write batches that carry a group's applied index, paged scans, bounded exports, and the
//! node's placement of hash slots onto groups.
//!
//! Keys carry the group, not only the hash slot: while a hash slot migrates from group A to group B, a
//! node holding replicas of both keeps two copies of the slot — A's and B's — that never share a key, so
//! B's import and A's clean-up cannot touch each other's copy.

use crate::error::{CorruptLocation, StoreError, StoreResult};
use crate::kv::{Direction, KeyRange, Keyspace, Kv, KvBatch, KvPair};
use std::collections::BTreeSet;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use tidings_types::{GroupId, HashSlot};

/// Where metadata keys live: one slot group's copy of one hash slot, or the group's own records (its
/// intent, the ownership of its slots) which belong to no hash slot and never migrate.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct MetaSpace {
    group: GroupId,
    slot: Option<HashSlot>,
}

/// The space code of a group's own records: after every hash slot.
const GROUP_RECORDS: u16 = u16::MAX;
/// Bytes of the space prefix of every metadata key: group (4, big endian) and space code (2).
const SPACE_PREFIX: usize = 6;

impl MetaSpace {
    /// Group `group`'s copy of hash slot `slot`.
    pub fn slot(group: GroupId, slot: HashSlot) -> Self {
        Self { group, slot: Some(slot) }
    }

    /// Group `group`'s own records.
    pub fn group_records(group: GroupId) -> Self {
        Self { group, slot: None }
    }

    /// The group.
    pub fn group(&self) -> GroupId {
        self.group
    }

    /// The hash slot, `None` for the group's own records.
    pub fn hash_slot(&self) -> Option<HashSlot> {
        self.slot
    }

    /// The prefix of every key of this space in [`Keyspace::Meta`] (a failpoint of the in-memory store
    /// can target one space with it: [`crate::MemoryKv::fail_under`]).
    pub fn kv_prefix(&self) -> Vec<u8> {
        let mut prefix = group_prefix(self.group);
        prefix.extend_from_slice(&self.slot.map_or(GROUP_RECORDS, HashSlot::index).to_be_bytes());
        prefix
    }

    fn key(&self, key: &[u8]) -> Vec<u8> {
        let mut full = self.kv_prefix();
        full.extend_from_slice(key);
        full
    }

    /// Splits a full metadata key into its space and key, `None` if it is not one.
    fn split(full: &[u8]) -> Option<(MetaSpace, &[u8])> {
        if full.len() < SPACE_PREFIX {
            return None;
        }
        let group = GroupId::new(u32::from_be_bytes(full[..4].try_into().ok()?));
        let code = u16::from_be_bytes(full[4..SPACE_PREFIX].try_into().ok()?);
        let slot = if code == GROUP_RECORDS { None } else { Some(HashSlot::new(code)?) };
        Some((MetaSpace { group, slot }, &full[SPACE_PREFIX..]))
    }
}

fn group_prefix(group: GroupId) -> Vec<u8> {
    group.get().to_be_bytes().to_vec()
}

/// One change to slot metadata.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MetaOp {
    /// Sets `key` in `space`.
    Put {
        /// The key's space.
        space: MetaSpace,
        /// The key.
        key: Vec<u8>,
        /// The value.
        value: Vec<u8>,
    },
    /// Removes `key` from `space`.
    Delete {
        /// The key's space.
        space: MetaSpace,
        /// The key.
        key: Vec<u8>,
    },
    /// Removes every key of `space` that starts with `prefix` (all of them for an empty prefix: before an
    /// import, or when a migrated slot is cleaned from its source).
    Clear {
        /// The space.
        space: MetaSpace,
        /// The prefix of the keys removed.
        prefix: Vec<u8>,
    },
    /// Removes every key of every space of `group` (before a snapshot is installed, or when the node's
    /// replica of the group is destroyed).
    ClearGroup {
        /// The group.
        group: GroupId,
    },
}

/// Where this node believes a hash slot lives: the group and the slot's ownership epoch (0 for the
/// genesis table; every completed migration of the slot adds one).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placement {
    /// The group holding the slot.
    pub group: GroupId,
    /// The slot's ownership epoch.
    pub epoch: u64,
}

/// What [`MetaStore::write_all`] staged so far, across its batches.
#[derive(Default)]
struct Staged {
    kv_batch: KvBatch,
    /// Keys put earlier in the write: a later clear must remove them too, as stored keys do not include
    /// them yet.
    put_here: BTreeSet<Vec<u8>>,
    /// Placements staged earlier: a later one must be newer than those too.
    placed: Vec<(HashSlot, Placement)>,
    /// Whether the write touches placements or groups' own records (see [`MetaStore::routes_version`]).
    routes: bool,
}

/// Changes applied as one atomic write, optionally recording the applied index of a group in the same
/// write, so that a crash can never leave half a batch applied or a batch applied without its index.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MetaWriteBatch {
    ops: Vec<MetaOp>,
    applied: Option<(GroupId, u64)>,
    config_epoch: Option<(GroupId, u64)>,
    placements: Vec<(HashSlot, Placement)>,
}

impl MetaWriteBatch {
    /// An empty batch.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets `key` in `space`.
    pub fn put(&mut self, space: MetaSpace, key: impl Into<Vec<u8>>, value: impl Into<Vec<u8>>) -> &mut Self {
        self.ops.push(MetaOp::Put { space, key: key.into(), value: value.into() });
        self
    }

    /// Removes `key` from `space`.
    pub fn delete(&mut self, space: MetaSpace, key: impl Into<Vec<u8>>) -> &mut Self {
        self.ops.push(MetaOp::Delete { space, key: key.into() });
        self
    }

    /// Removes every key of `space`; later puts in this batch are kept.
    pub fn clear(&mut self, space: MetaSpace) -> &mut Self {
        self.clear_prefix(space, Vec::new())
    }

    /// Removes every key of `space` starting with `prefix`; later puts in this batch are kept.
    pub fn clear_prefix(&mut self, space: MetaSpace, prefix: impl Into<Vec<u8>>) -> &mut Self {
        self.ops.push(MetaOp::Clear { space, prefix: prefix.into() });
        self
    }

    /// Removes every key of every space of `group`; later puts in this batch are kept.
    pub fn clear_group(&mut self, group: GroupId) -> &mut Self {
        self.ops.push(MetaOp::ClearGroup { group });
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

    /// Records that `slot` lives in `placement.group` from `placement.epoch` on — kept only if newer than
    /// the placement stored (placements only move forward).
    pub fn place(&mut self, slot: HashSlot, placement: Placement) -> &mut Self {
        self.placements.push((slot, placement));
        self
    }

    /// The changes, in order.
    pub fn ops(&self) -> &[MetaOp] {
        &self.ops
    }

    /// `true` if the batch changes nothing and records nothing.
    pub fn is_empty(&self) -> bool {
        self.ops.is_empty() && self.applied.is_none() && self.config_epoch.is_none() && self.placements.is_empty()
    }
}

/// A page of a scan: up to the requested number of entries, and where to continue.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MetaPage {
    /// Keys (without the space prefix) and values, ascending.
    pub entries: Vec<(Vec<u8>, Vec<u8>)>,
    /// Pass as `after` to read the next page; `None` when the scan is complete.
    pub next_after: Option<Vec<u8>>,
}

/// One exported key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SpaceEntry {
    /// The key's space.
    pub space: MetaSpace,
    /// The key.
    pub key: Vec<u8>,
    /// The value.
    pub value: Vec<u8>,
}

/// A bounded chunk of an export.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ExportChunk {
    /// Entries in (space, key) order.
    pub entries: Vec<SpaceEntry>,
    /// Where the next chunk starts; `None` when the export is complete.
    pub next: Option<ExportCursor>,
}

/// Position of an export in progress: the next chunk starts strictly after `(space, key)`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExportCursor {
    /// Space of the last exported entry.
    pub space: MetaSpace,
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

/// Keys are read in pages of this many entries when a space is cleared or exported.
const CLEAR_PAGE: usize = 1024;

impl MetaStore {
    /// A metadata store over `kv`.
    pub fn new(kv: Arc<dyn Kv>) -> Self {
        Self { kv }
    }

    /// The value of `key` in `space`.
    pub fn get(&self, space: MetaSpace, key: &[u8]) -> StoreResult<Option<Vec<u8>>> {
        self.kv.get(Keyspace::Meta, &space.key(key))
    }

    /// Up to `limit` entries of `space` whose keys start with `prefix` and sort after `after`.
    pub fn scan(&self, space: MetaSpace, prefix: &[u8], after: Option<&[u8]>, limit: usize) -> StoreResult<MetaPage> {
        let mut range = KeyRange::prefix(&space.key(prefix));
        if let Some(after) = after {
            // Never start before the prefix, whatever `after` is.
            range.start = range.start.max(successor(&space.key(after)));
        }
        let pairs = self.kv.scan(Keyspace::Meta, &range, Direction::Forward, limit)?;
        let entries: Vec<(Vec<u8>, Vec<u8>)> =
            pairs.into_iter().map(|(k, v)| (k[SPACE_PREFIX..].to_vec(), v)).collect();
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

    /// Forgets this node's replica of `group` (it no longer holds the group): every key of the group's
    /// spaces, its applied index and its configuration epoch, in one batch that `apply` writes, with
    /// whatever it adds (the raft log's part: `RaftLogStore::remove_group_with`). A destruction that
    /// fails leaves the replica whole, never half gone (an applied index over cleared data).
    pub fn forget_group_with(&self, group: GroupId, apply: impl FnOnce(KvBatch) -> StoreResult<()>) -> StoreResult<()> {
        let mut batch = MetaWriteBatch::new();
        batch.clear_group(group);
        self.write_all_with([&batch], |mut kv_batch| {
            kv_batch.delete(Keyspace::Applied, group_key(group, None));
            kv_batch.delete(Keyspace::Applied, group_key(group, Some(CONFIG_EPOCH_TAG)));
            apply(kv_batch)
        })
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

    /// Where this node last learned `slot` lives, `None` if it never recorded one.
    pub fn placement(&self, slot: HashSlot) -> StoreResult<Option<Placement>> {
        let key = slot.index().to_be_bytes().to_vec();
        let Some(bytes) = self.kv.get(Keyspace::Placement, &key)? else { return Ok(None) };
        decode_placement(&bytes).map(Some).ok_or(StoreError::Corrupt {
            location: CorruptLocation::Kv { keyspace: Keyspace::Placement, key },
            detail: "placement is not 12 bytes",
        })
    }

    /// Every placement recorded, by slot.
    pub fn placements(&self) -> StoreResult<Vec<(HashSlot, Placement)>> {
        HashSlot::all().filter_map(|slot| self.placement(slot).map(|p| p.map(|p| (slot, p))).transpose()).collect()
    }

    /// Applies `batch` atomically. Visible at once; durable after [`MetaStore::sync`].
    pub fn write(&self, batch: &MetaWriteBatch) -> StoreResult<()> {
        self.write_all([batch])
    }

    /// Applies `batches` in order, as one atomic write: one backend batch for several groups' changes
    /// (each backend batch has a fixed cost: sled writes out a log buffer under a process-wide lock).
    pub fn write_all<'a>(&self, batches: impl IntoIterator<Item = &'a MetaWriteBatch>) -> StoreResult<()> {
        self.write_all_with(batches, |staged| self.kv.apply(staged))
    }

    /// Like [`MetaStore::write_all`], for a caller that writes the backend changes in one atomic batch
    /// with other changes to the same backend: `apply` gets them and applies them
    /// ([`crate::RaftLogStore::write_with`]). Staging reads the store (prefix clears, placements): nothing
    /// may write it before `apply` returns. A write that changes how hash slots are served (placements,
    /// groups' own records) moves [`MetaStore::routes_version`] on before it is applied and again once
    /// `apply` returned, whatever it returned.
    pub fn write_all_with<'a>(
        &self,
        batches: impl IntoIterator<Item = &'a MetaWriteBatch>,
        apply: impl FnOnce(KvBatch) -> StoreResult<()>,
    ) -> StoreResult<()> {
        let mut staged = Staged::default();
        for batch in batches {
            self.stage(batch, &mut staged)?;
        }
        if staged.routes {
            // Before, too: a reader that saw one version before and after its reads read nothing of a
            // write in progress.
            self.kv.cache_epoch().fetch_add(1, Ordering::AcqRel);
        }
        let result = apply(staged.kv_batch);
        if staged.routes {
            // Release: a reader that sees the new version sees the write.
            self.kv.cache_epoch().fetch_add(1, Ordering::Release);
        }
        result
    }

    /// A number that moves on when a write that changes a placement or a group's own records (the
    /// slot records saying which group serves a hash slot) starts and when it ends, or when any is lost
    /// (a crash of the in-memory backend). What a reader derived from those after reading version `v`
    /// holds while the version is still `v`, and reads made while it stayed `v` saw no such write in
    /// progress; it is shared by every `MetaStore` over the same backend.
    pub fn routes_version(&self) -> u64 {
        self.kv.cache_epoch().load(Ordering::Acquire)
    }

    fn stage(&self, batch: &MetaWriteBatch, staged: &mut Staged) -> StoreResult<()> {
        let Staged { kv_batch, put_here, placed, routes } = staged;
        *routes |= !batch.placements.is_empty()
            || batch.ops.iter().any(|op| match op {
                MetaOp::Put { space, .. } | MetaOp::Delete { space, .. } | MetaOp::Clear { space, .. } => {
                    space.hash_slot().is_none()
                }
                MetaOp::ClearGroup { .. } => true,
            });
        for op in &batch.ops {
            let cleared = match op {
                MetaOp::Put { space, key, value } => {
                    let full = space.key(key);
                    kv_batch.put(Keyspace::Meta, full.clone(), value);
                    put_here.insert(full);
                    continue;
                }
                MetaOp::Delete { space, key } => {
                    let full = space.key(key);
                    put_here.remove(&full);
                    kv_batch.delete(Keyspace::Meta, full);
                    continue;
                }
                MetaOp::Clear { space, prefix } => space.key(prefix),
                MetaOp::ClearGroup { group } => group_prefix(*group),
            };
            self.delete_prefix_into(&cleared, kv_batch)?;
            let (gone, kept): (BTreeSet<_>, BTreeSet<_>) =
                std::mem::take(put_here).into_iter().partition(|k| k.starts_with(&cleared));
            for key in gone {
                kv_batch.delete(Keyspace::Meta, key);
            }
            *put_here = kept;
        }
        if let Some((group, index)) = batch.applied {
            kv_batch.put(Keyspace::Applied, group_key(group, None), &index.to_le_bytes());
        }
        if let Some((group, epoch)) = batch.config_epoch {
            kv_batch.put(Keyspace::Applied, group_key(group, Some(CONFIG_EPOCH_TAG)), &epoch.to_le_bytes());
        }
        for (slot, placement) in &batch.placements {
            let current = match placed.iter().rev().find(|(s, _)| s == slot) {
                Some((_, p)) => Some(*p),
                None => self.placement(*slot)?,
            };
            if current.is_none_or(|c| placement.epoch > c.epoch) {
                placed.push((*slot, *placement));
                kv_batch.put(Keyspace::Placement, slot.index().to_be_bytes().to_vec(), &encode_placement(placement));
            }
        }
        Ok(())
    }

    /// The node's storage identities, kept in the same backend (durable with [`MetaStore::sync`]).
    pub fn identity(&self) -> crate::IdentityStore {
        crate::IdentityStore::new(Arc::clone(&self.kv))
    }

    /// Makes every write so far durable.
    pub fn sync(&self) -> StoreResult<()> {
        self.kv.sync()
    }

    /// Exports every space of `group` in chunks of at most `max_bytes` of keys and values (at least one
    /// entry per chunk), starting after `cursor`.
    pub fn export_group(
        &self,
        group: GroupId,
        cursor: Option<&ExportCursor>,
        max_bytes: usize,
    ) -> StoreResult<ExportChunk> {
        self.export_prefix(&group_prefix(group), cursor, max_bytes)
    }

    /// Exports `space` in chunks of at most `max_bytes` (at least one entry per chunk), after `cursor`.
    pub fn export_space(
        &self,
        space: MetaSpace,
        cursor: Option<&ExportCursor>,
        max_bytes: usize,
    ) -> StoreResult<ExportChunk> {
        self.export_prefix(&space.kv_prefix(), cursor, max_bytes)
    }

    fn export_prefix(
        &self,
        prefix: &[u8],
        cursor: Option<&ExportCursor>,
        max_bytes: usize,
    ) -> StoreResult<ExportChunk> {
        let mut range = KeyRange::prefix(prefix);
        if let Some(cursor) = cursor {
            range.start = range.start.max(successor(&cursor.space.key(&cursor.key)));
        }
        let mut chunk = ExportChunk::default();
        let mut bytes = 0usize;
        loop {
            let pairs = self.kv.scan(Keyspace::Meta, &range, Direction::Forward, CLEAR_PAGE)?;
            let done = pairs.len() < CLEAR_PAGE;
            for (full, value) in pairs {
                range.start = successor(&full);
                let Some((space, key)) = MetaSpace::split(&full) else {
                    return Err(StoreError::Corrupt {
                        location: CorruptLocation::Kv { keyspace: Keyspace::Meta, key: full },
                        detail: "metadata key without a space prefix",
                    });
                };
                if bytes >= max_bytes && !chunk.entries.is_empty() {
                    let last = chunk.entries.last().map(|e| ExportCursor { space: e.space, key: e.key.clone() });
                    chunk.next = last;
                    return Ok(chunk);
                }
                bytes += key.len() + value.len();
                chunk.entries.push(SpaceEntry { space, key: key.to_vec(), value });
            }
            if done {
                return Ok(chunk);
            }
        }
    }

    fn delete_prefix_into(&self, prefix: &[u8], batch: &mut KvBatch) -> StoreResult<()> {
        let mut range = KeyRange::prefix(prefix);
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

/// The smallest key greater than `key`.
fn successor(key: &[u8]) -> Vec<u8> {
    let mut next = key.to_vec();
    next.push(0);
    next
}

fn decode_u64(bytes: &[u8]) -> Option<u64> {
    Some(u64::from_le_bytes(bytes.try_into().ok()?))
}

fn encode_placement(placement: &Placement) -> [u8; 12] {
    let mut bytes = [0u8; 12];
    bytes[..4].copy_from_slice(&placement.group.get().to_le_bytes());
    bytes[4..].copy_from_slice(&placement.epoch.to_le_bytes());
    bytes
}

fn decode_placement(bytes: &[u8]) -> Option<Placement> {
    if bytes.len() != 12 {
        return None;
    }
    let group = GroupId::new(u32::from_le_bytes(bytes[..4].try_into().ok()?));
    Some(Placement { group, epoch: decode_u64(&bytes[4..])? })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::{FailOp, MemoryKv};

    const G: GroupId = GroupId::new(1);

    fn slot(i: u16) -> MetaSpace {
        MetaSpace::slot(G, HashSlot::new(i).unwrap())
    }

    #[test]
    fn batch_and_applied_index_are_atomic_under_failpoint() {
        let kv = Arc::new(MemoryKv::new());
        let store = MetaStore::new(kv.clone());
        let mut batch = MetaWriteBatch::new();
        batch.put(slot(1), "a", "1").put(slot(2), "b", "2").set_applied(G, 5);
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
    fn clear_then_import_replaces_a_space() {
        let store = MetaStore::new(Arc::new(MemoryKv::new()));
        let mut batch = MetaWriteBatch::new();
        for i in 0..3000u32 {
            batch.put(slot(7), i.to_be_bytes().to_vec(), b"old".to_vec());
        }
        batch.put(slot(8), "keep", "x");
        store.write(&batch).unwrap();
        let mut import = MetaWriteBatch::new();
        import.clear(slot(7)).put(slot(7), "new", "y");
        store.write(&import).unwrap();
        let page = store.scan(slot(7), b"", None, 10).unwrap();
        assert_eq!(page.entries, vec![(b"new".to_vec(), b"y".to_vec())]);
        assert_eq!(store.get(slot(8), b"keep").unwrap(), Some(b"x".to_vec()));
    }

    #[test]
    fn export_in_bounded_chunks_round_trips() {
        let source = MetaStore::new(Arc::new(MemoryKv::new()));
        let other = GroupId::new(2);
        let mut batch = MetaWriteBatch::new();
        for s in [1u16, 5, 9] {
            for i in 0..50u8 {
                batch.put(slot(s), vec![i], vec![u8::try_from(s).unwrap(); 20]);
            }
        }
        batch.put(MetaSpace::group_records(G), "intent", "i");
        batch.put(MetaSpace::slot(other, HashSlot::new(5).unwrap()), "theirs", "t");
        source.write(&batch).unwrap();
        let target = MetaStore::new(Arc::new(MemoryKv::new()));
        let mut cursor = None;
        let mut chunks = 0;
        loop {
            let chunk = source.export_group(G, cursor.as_ref(), 300).unwrap();
            let bytes: usize = chunk.entries.iter().map(|e| e.key.len() + e.value.len()).sum();
            assert!(bytes <= 300 + 21, "chunk of {bytes} bytes");
            let mut import = MetaWriteBatch::new();
            for e in &chunk.entries {
                assert_eq!(e.space.group(), G, "another group's key exported");
                import.put(e.space, e.key.clone(), e.value.clone());
            }
            target.write(&import).unwrap();
            chunks += 1;
            match chunk.next {
                Some(next) => cursor = Some(next),
                None => break,
            }
        }
        assert!(chunks > 2);
        for s in [1u16, 5, 9] {
            assert_eq!(target.scan(slot(s), b"", None, 100).unwrap().entries.len(), 50);
        }
        assert_eq!(target.get(MetaSpace::group_records(G), b"intent").unwrap(), Some(b"i".to_vec()));
        let one = source.export_space(slot(5), None, usize::MAX).unwrap();
        assert_eq!(one.entries.len(), 50);
        assert!(one.next.is_none());
    }

    #[test]
    fn two_groups_copies_of_a_slot_never_touch() {
        let store = MetaStore::new(Arc::new(MemoryKv::new()));
        let s = HashSlot::new(3).unwrap();
        let (a, b) = (MetaSpace::slot(G, s), MetaSpace::slot(GroupId::new(2), s));
        let mut batch = MetaWriteBatch::new();
        batch.put(a, "k", "from a").put(b, "k", "from b");
        store.write(&batch).unwrap();
        let mut clear = MetaWriteBatch::new();
        clear.clear(a);
        store.write(&clear).unwrap();
        assert_eq!(store.get(a, b"k").unwrap(), None);
        assert_eq!(store.get(b, b"k").unwrap(), Some(b"from b".to_vec()));
        let mut clear = MetaWriteBatch::new();
        clear.clear_group(GroupId::new(2)).put(b, "again", "x");
        store.write(&clear).unwrap();
        assert_eq!(store.scan(b, b"", None, 10).unwrap().entries, vec![(b"again".to_vec(), b"x".to_vec())]);
    }

    #[test]
    fn placements_only_move_forward() {
        let store = MetaStore::new(Arc::new(MemoryKv::new()));
        let s = HashSlot::new(9).unwrap();
        let at = |group: u32, epoch: u64| Placement { group: GroupId::new(group), epoch };
        let mut batch = MetaWriteBatch::new();
        batch.place(s, at(1, 0)).place(s, at(2, 1));
        store.write(&batch).unwrap();
        assert_eq!(store.placement(s).unwrap(), Some(at(2, 1)));
        let mut stale = MetaWriteBatch::new();
        stale.place(s, at(1, 1)).place(s, at(3, 0));
        store.write(&stale).unwrap();
        assert_eq!(store.placement(s).unwrap(), Some(at(2, 1)));
        assert_eq!(store.placements().unwrap(), vec![(s, at(2, 1))]);
    }

    #[test]
    fn write_all_is_one_atomic_write_that_reads_as_the_batches_in_order() {
        let kv = Arc::new(MemoryKv::new());
        let store = MetaStore::new(kv.clone());
        let g2 = GroupId::new(2);
        let s = HashSlot::new(9).unwrap();
        let at = |group: u32, epoch: u64| Placement { group: GroupId::new(group), epoch };
        let mut first = MetaWriteBatch::new();
        first.put(slot(1), "a", "1").put(slot(1), "b", "1").set_applied(G, 3).place(s, at(1, 5));
        let mut second = MetaWriteBatch::new();
        // A clear removes what an earlier batch of the same write put; a placement older than an earlier
        // batch's is dropped.
        second.clear(slot(1)).put(slot(1), "c", "2").set_applied(g2, 7).place(s, at(2, 4));
        let batches = [first, second];
        kv.fail(FailOp::Apply, 0, 1);
        assert!(store.write_all(&batches).is_err());
        assert_eq!((store.applied_index(G).unwrap(), store.applied_index(g2).unwrap()), (0, 0));
        assert_eq!(store.placement(s).unwrap(), None);
        let before = kv.unsynced_batches();
        store.write_all(&batches).unwrap();
        assert_eq!(kv.unsynced_batches(), before + 1, "one backend batch");
        assert_eq!(store.scan(slot(1), b"", None, 10).unwrap().entries, vec![(b"c".to_vec(), b"2".to_vec())]);
        assert_eq!((store.applied_index(G).unwrap(), store.applied_index(g2).unwrap()), (3, 7));
        assert_eq!(store.placement(s).unwrap(), Some(at(1, 5)));
    }

    #[test]
    fn the_routes_version_moves_on_after_writes_that_change_how_slots_are_served_and_is_shared() {
        let kv = Arc::new(MemoryKv::new());
        let (writer, reader) = (MetaStore::new(kv.clone()), MetaStore::new(kv.clone()));
        let mut version = reader.routes_version();
        let mut moved = |batch: &MetaWriteBatch| {
            writer.write(batch).unwrap();
            let now = reader.routes_version();
            std::mem::replace(&mut version, now) != now
        };
        let mut keys = MetaWriteBatch::new();
        keys.put(slot(1), "a", "1").delete(slot(2), "b").clear(slot(3)).set_applied(G, 4);
        assert!(!moved(&keys), "keys in hash slots' copies and the applied index do not route anything");
        let mut record = MetaWriteBatch::new();
        record.put(MetaSpace::group_records(G), "record", "1");
        assert!(moved(&record), "a group's own records (its slot records)");
        let mut placement = MetaWriteBatch::new();
        placement.place(HashSlot::new(1).unwrap(), Placement { group: G, epoch: 1 });
        assert!(moved(&placement));
        let mut cleared = MetaWriteBatch::new();
        cleared.clear_group(G);
        assert!(moved(&cleared));
        kv.crash();
        assert_ne!(reader.routes_version(), version, "writes lost in a crash may have changed routes");
        // The version moves on after a failed write too: the backend may not say what it kept.
        let before = reader.routes_version();
        kv.fail(FailOp::Apply, 0, 1);
        assert!(writer.write(&record).is_err());
        assert_ne!(reader.routes_version(), before);
    }

    #[test]
    fn the_routes_version_moves_on_before_such_a_write_is_applied_and_again_after() {
        let kv = Arc::new(MemoryKv::new());
        let (writer, reader) = (MetaStore::new(kv.clone()), MetaStore::new(kv.clone()));
        let before = reader.routes_version();
        let mut cleared = MetaWriteBatch::new();
        cleared.clear_group(G);
        let mut during = None;
        writer
            .write_all_with([&cleared], |batch| {
                // A reader in the middle of the write sees a version other than the one before it...
                during = Some(reader.routes_version());
                kv.apply(batch)
            })
            .unwrap();
        let (during, after) = (during.expect("applied"), reader.routes_version());
        assert_ne!(during, before, "moved on before the write is applied");
        // ...and one that reads on past its end sees yet another.
        assert_ne!(after, during, "moved on again once applied");
        let mut keys = MetaWriteBatch::new();
        keys.put(slot(1), "a", "1");
        writer.write_all_with([&keys], |batch| kv.apply(batch)).unwrap();
        assert_eq!(reader.routes_version(), after, "a write to hash slots' copies routes nothing");
    }
}
