//! Raft logs of many slot groups in one [`Kv`], behind raft-rs's [`raft::Storage`].
//!
//! [`RaftLogStore`] keeps, per group, the entries, the hard state, the conf state and a truncation marker
//! `(index, term)` of the last compacted entry (TiKV's "truncated state"), so the term before the first
//! held entry stays answerable as raft-rs requires. Writes of many groups go in one [`RaftLogBatch`] and
//! one atomic backend write; one [`RaftLogStore::sync`] then makes all of them durable.
//!
//! ```
//! use std::sync::Arc;
//! use raft::{prelude::*, Storage};
//! use tidings_store::{MemoryKv, RaftLogBatch, RaftLogStore};
//! use tidings_types::GroupId;
//!
//! let store = Arc::new(RaftLogStore::open(Arc::new(MemoryKv::new())).unwrap());
//! let group = GroupId::new(1);
//! let mut conf = ConfState::default();
//! conf.voters = vec![1, 2, 3];
//! store.create_group(group, conf).unwrap();
//!
//! let mut batch = RaftLogBatch::new();
//! let entries: Vec<Entry> = (1..=3).map(|i| { let mut e = Entry::default(); e.index = i; e.term = 1; e }).collect();
//! batch.append(group, entries);
//! store.write(batch).unwrap();
//! store.sync().unwrap(); // durable: messages that depend on these entries may now be sent
//!
//! let storage = store.group(group).unwrap();
//! assert_eq!(storage.last_index().unwrap(), 3);
//! assert_eq!(storage.term(2).unwrap(), 1);
//! ```

use crate::error::{CorruptLocation, StoreError, StoreResult};
use crate::kv::{Direction, KeyRange, Keyspace, Kv, KvBatch};
use parking_lot::{Mutex, RwLock};
use protobuf::Message as _;
use raft::prelude::{ConfState, Entry, HardState, Snapshot, SnapshotMetadata};
use raft::{GetEntriesContext, RaftState, StorageError as RaftStorageError};
use std::collections::BTreeMap;
use std::sync::Arc;
use tidings_types::GroupId;

/// Builds the snapshot a follower needs when the log it asks for was compacted. The slot layer
/// implements it with an export of the group's hash slots.
pub trait SnapshotSource: Send + Sync {
    /// A snapshot of `group` with metadata index at least `request_index`, or `Ok(None)` while one is
    /// being prepared (raft-rs retries later).
    fn snapshot(&self, group: GroupId, request_index: u64) -> StoreResult<Option<Snapshot>>;
}

/// What is cached in memory of one group's log.
#[derive(Clone, Debug, Default, PartialEq)]
struct GroupLog {
    hard_state: HardState,
    conf_state: ConfState,
    /// Index and term of the last entry removed by compaction or covered by a snapshot.
    truncated: (u64, u64),
    /// Index and term of the last entry held (equal to `truncated` when the log is empty).
    last: (u64, u64),
}

impl GroupLog {
    fn first_index(&self) -> u64 {
        self.truncated.0 + 1
    }
}

/// One change of a [`RaftLogBatch`].
#[derive(Clone, Debug)]
enum LogOp {
    Append(Vec<Entry>),
    HardState(HardState),
    ConfState(ConfState),
    Snapshot(SnapshotMetadata),
    Compact(u64),
}

/// Changes to the raft logs of any number of groups, written atomically by [`RaftLogStore::write`].
#[derive(Clone, Debug, Default)]
pub struct RaftLogBatch {
    ops: Vec<(GroupId, LogOp)>,
}

impl RaftLogBatch {
    /// An empty batch.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends `entries` (consecutive indexes) to `group`'s log, replacing any held entries at or after
    /// the first of them, as raft-rs requires when a leader overwrites a conflicting suffix.
    pub fn append(&mut self, group: GroupId, entries: Vec<Entry>) -> &mut Self {
        if !entries.is_empty() {
            self.ops.push((group, LogOp::Append(entries)));
        }
        self
    }

    /// Sets `group`'s hard state (term, vote, commit).
    pub fn set_hard_state(&mut self, group: GroupId, hard_state: HardState) -> &mut Self {
        self.ops.push((group, LogOp::HardState(hard_state)));
        self
    }

    /// Sets `group`'s conf state.
    pub fn set_conf_state(&mut self, group: GroupId, conf_state: ConfState) -> &mut Self {
        self.ops.push((group, LogOp::ConfState(conf_state)));
        self
    }

    /// Installs snapshot metadata: drops the whole log, sets the truncation marker to the snapshot's index
    /// and term, takes its conf state, and raises the commit index to it.
    pub fn apply_snapshot(&mut self, group: GroupId, metadata: SnapshotMetadata) -> &mut Self {
        self.ops.push((group, LogOp::Snapshot(metadata)));
        self
    }

    /// Drops entries before `first_index`, keeping the term of `first_index - 1`.
    pub fn compact(&mut self, group: GroupId, first_index: u64) -> &mut Self {
        self.ops.push((group, LogOp::Compact(first_index)));
        self
    }

    /// `true` if the batch changes nothing.
    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    /// Moves every change of `other` after this batch's own, in order.
    pub fn extend(&mut self, other: RaftLogBatch) -> &mut Self {
        self.ops.extend(other.ops);
        self
    }
}

/// Raft logs of many groups over one [`Kv`].
pub struct RaftLogStore {
    kv: Arc<dyn Kv>,
    groups: RwLock<BTreeMap<GroupId, GroupLog>>,
    /// Groups this node held and left, with the configuration epoch that removed it: a bootstrap never
    /// brings them back (only a newer membership that includes the node again does, see
    /// [`RaftLogStore::create_group`]).
    tombstones: RwLock<BTreeMap<GroupId, u64>>,
    /// Serializes writers: a write computes deletions from the cached state it then replaces.
    writer: Mutex<()>,
    snapshots: RwLock<Option<Arc<dyn SnapshotSource>>>,
}

const STATE_HARD: u8 = b'h';
const STATE_CONF: u8 = b'c';
const STATE_TRUNCATED: u8 = b't';
const STATE_TOMBSTONE: u8 = b'x';

/// Index and term at which a bootstrapped group's log starts: its initial membership counts as a snapshot
/// at this index, so a replica added later (whose log is empty) is caught up by a snapshot that carries
/// the membership, never by replaying entries that assume a membership it does not know.
pub const BOOTSTRAP_INDEX: u64 = 5;

impl RaftLogStore {
    /// Opens the raft logs held in `kv`, loading every group's state.
    pub fn open(kv: Arc<dyn Kv>) -> StoreResult<Self> {
        let mut groups = BTreeMap::new();
        let mut tombstones = BTreeMap::new();
        let range = KeyRange::prefix(b"");
        let mut start = range.clone();
        loop {
            let page = kv.scan(Keyspace::RaftState, &start, Direction::Forward, 1024)?;
            let Some((last_key, _)) = page.last() else { break };
            start.start = [last_key.as_slice(), &[0]].concat();
            let done = page.len() < 1024;
            for (key, value) in page {
                load_state_record(&mut groups, &mut tombstones, &key, &value)?;
            }
            if done {
                break;
            }
        }
        for (group, log) in groups.iter_mut() {
            let tail = kv.scan(Keyspace::RaftEntry, &KeyRange::prefix(&group_prefix(*group)), Direction::Reverse, 1)?;
            log.last = match tail.into_iter().next() {
                Some((key, value)) => {
                    let entry = decode_entry(&key, &value)?;
                    (entry.index, entry.term)
                }
                None => log.truncated,
            };
        }
        Ok(Self {
            kv,
            groups: RwLock::new(groups),
            tombstones: RwLock::new(tombstones),
            writer: Mutex::new(()),
            snapshots: RwLock::new(None),
        })
    }

    /// Creates an empty log for `group` with `conf_state` (empty for a replica that learns its membership
    /// from a snapshot), durable after the next sync. A group that already exists is left as it is; a
    /// tombstone of the group is lifted (the node was added to it again).
    pub fn create_group(&self, group: GroupId, conf_state: ConfState) -> StoreResult<()> {
        if self.groups.read().contains_key(&group) {
            return Ok(());
        }
        let mut batch = RaftLogBatch::new();
        batch.set_conf_state(group, conf_state).set_hard_state(group, HardState::default());
        self.write_inner(batch, KvBatch::new(), true)?;
        if self.tombstones.write().remove(&group).is_some() {
            let mut lift = KvBatch::new();
            lift.delete(Keyspace::RaftState, state_key(group, STATE_TOMBSTONE));
            self.kv.apply(lift)?;
        }
        Ok(())
    }

    /// Creates `group` with its initial members as a log that starts after [`BOOTSTRAP_INDEX`] (see there),
    /// durable after the next sync. Returns `false`, changing nothing, if the group exists already or was
    /// left by this node (a tombstone): a restart must not resurrect a replica that was moved away.
    pub fn bootstrap_group(&self, group: GroupId, conf_state: ConfState) -> StoreResult<bool> {
        if self.groups.read().contains_key(&group) || self.tombstones.read().contains_key(&group) {
            return Ok(false);
        }
        let metadata = SnapshotMetadata {
            index: BOOTSTRAP_INDEX,
            term: BOOTSTRAP_INDEX,
            conf_state: Some(conf_state).into(),
            ..Default::default()
        };
        let mut batch = RaftLogBatch::new();
        batch.set_hard_state(group, HardState::default()).apply_snapshot(group, metadata);
        self.write_inner(batch, KvBatch::new(), true)?;
        Ok(true)
    }

    /// The configuration epoch at which this node left `group`, if it did (and was not added again).
    pub fn tombstone(&self, group: GroupId) -> Option<u64> {
        self.tombstones.read().get(&group).copied()
    }

    /// The groups held, ascending.
    pub fn groups(&self) -> Vec<GroupId> {
        self.groups.read().keys().copied().collect()
    }

    /// Sets the source of snapshots for followers behind the compacted log.
    pub fn set_snapshot_source(&self, source: Arc<dyn SnapshotSource>) {
        *self.snapshots.write() = Some(source);
    }

    /// A [`raft::Storage`] view of `group`.
    pub fn group(self: &Arc<Self>, group: GroupId) -> StoreResult<GroupStorage> {
        if !self.groups.read().contains_key(&group) {
            return Err(StoreError::UnknownGroup { group });
        }
        Ok(GroupStorage { group, store: Arc::clone(self) })
    }

    /// Writes `batch` atomically. Visible at once; durable after [`RaftLogStore::sync`].
    pub fn write(&self, batch: RaftLogBatch) -> StoreResult<()> {
        self.write_inner(batch, KvBatch::new(), false)
    }

    /// [`RaftLogStore::write`] with `also` — changes to other data on this store's own backend, such as
    /// a [`crate::MetaStore`]'s over the same [`Kv`] ([`crate::MetaStore::write_all_with`]) — in the same atomic
    /// batch: one backend write where there would be two.
    pub fn write_with(&self, batch: RaftLogBatch, also: KvBatch) -> StoreResult<()> {
        self.write_inner(batch, also, false)
    }

    /// Makes every write so far durable (one sync for all groups).
    pub fn sync(&self) -> StoreResult<()> {
        self.kv.sync()
    }

    /// Removes every trace of `group` and leaves a tombstone with the configuration epoch that removed
    /// this node (after the node left the group).
    pub fn remove_group(&self, group: GroupId, removed_at_epoch: u64) -> StoreResult<()> {
        self.remove_group_with(group, removed_at_epoch, KvBatch::new())
    }

    /// [`RaftLogStore::remove_group`], writing `also` in the same atomic batch (the rest of the
    /// replica's state: `MetaStore::forget_group_with`).
    pub fn remove_group_with(&self, group: GroupId, removed_at_epoch: u64, also: KvBatch) -> StoreResult<()> {
        let _writer = self.writer.lock();
        let mut batch = also;
        for keyspace in [Keyspace::RaftEntry, Keyspace::RaftState] {
            let range = KeyRange::prefix(&group_prefix(group));
            for (key, _) in self.kv.scan_sealed(keyspace, &range, Direction::Forward, usize::MAX)? {
                batch.delete(keyspace, key);
            }
        }
        batch.put(Keyspace::RaftState, state_key(group, STATE_TOMBSTONE), &removed_at_epoch.to_le_bytes());
        self.kv.apply(batch)?;
        self.groups.write().remove(&group);
        self.tombstones.write().insert(group, removed_at_epoch);
        Ok(())
    }

    fn write_inner(&self, batch: RaftLogBatch, also: KvBatch, allow_create: bool) -> StoreResult<()> {
        let _writer = self.writer.lock();
        let mut staged: BTreeMap<GroupId, GroupLog> = BTreeMap::new();
        let mut kv_batch = KvBatch::new();
        // Terms of entries appended earlier in this batch, which compaction may need before they are applied.
        let mut appended_terms: BTreeMap<(GroupId, u64), u64> = BTreeMap::new();
        for (group, op) in batch.ops {
            let log = match staged.get_mut(&group) {
                Some(log) => log,
                None => {
                    let current = match self.groups.read().get(&group) {
                        Some(log) => log.clone(),
                        None if allow_create => GroupLog::default(),
                        None => return Err(StoreError::UnknownGroup { group }),
                    };
                    staged.entry(group).or_insert(current)
                }
            };
            match op {
                LogOp::Append(entries) => {
                    stage_append(group, log, &entries, &mut kv_batch)?;
                    for e in &entries {
                        appended_terms.insert((group, e.index), e.term);
                    }
                }
                LogOp::HardState(hs) => {
                    kv_batch.put(Keyspace::RaftState, state_key(group, STATE_HARD), &encode(&hs));
                    log.hard_state = hs;
                }
                LogOp::ConfState(cs) => {
                    kv_batch.put(Keyspace::RaftState, state_key(group, STATE_CONF), &encode(&cs));
                    log.conf_state = cs;
                }
                LogOp::Snapshot(meta) => stage_snapshot(group, log, meta, &mut kv_batch),
                LogOp::Compact(first_index) => {
                    let term_before = |index: u64| -> StoreResult<u64> {
                        if let Some(term) = appended_terms.get(&(group, index)) {
                            return Ok(*term);
                        }
                        self.read_term(group, index)
                    };
                    stage_compact(group, log, first_index, term_before, &mut kv_batch)?;
                }
            }
        }
        kv_batch.extend(also);
        self.kv.apply(kv_batch)?;
        self.groups.write().extend(staged);
        Ok(())
    }

    fn read_term(&self, group: GroupId, index: u64) -> StoreResult<u64> {
        let key = entry_key(group, index);
        match self.kv.get(Keyspace::RaftEntry, &key)? {
            Some(value) => Ok(decode_entry(&key, &value)?.term),
            None => Err(corrupt(Keyspace::RaftEntry, &key, "entry missing inside the log's range")),
        }
    }

    fn read_entries(&self, group: GroupId, low: u64, high: u64, max_size: Option<u64>) -> StoreResult<Vec<Entry>> {
        let range = KeyRange { start: entry_key(group, low), end: Some(entry_key(group, high)) };
        let count = usize::try_from(high - low).unwrap_or(usize::MAX);
        let mut entries = Vec::with_capacity(count.min(1024));
        let mut bytes = 0u64;
        for (key, value) in self.kv.scan(Keyspace::RaftEntry, &range, Direction::Forward, count)? {
            let entry = decode_entry(&key, &value)?;
            let expected = low + entries.len() as u64;
            if entry.index != expected {
                return Err(corrupt(Keyspace::RaftEntry, &entry_key(group, expected), "hole in the raft log"));
            }
            bytes += u64::from(entry.compute_size());
            // raft-rs's rule: always at least one entry, then stop before exceeding the limit.
            if !entries.is_empty() && max_size.is_some_and(|max| bytes > max) {
                return Ok(entries);
            }
            entries.push(entry);
        }
        // Not cut by the size limit: every entry of the range is there, or the log lost one (a short
        // answer would read to raft as a size cut, and it would ask again for what never comes).
        let next = low + entries.len() as u64;
        if next < high {
            return Err(corrupt(Keyspace::RaftEntry, &entry_key(group, next), "entry missing inside the log's range"));
        }
        Ok(entries)
    }
}

fn stage_append(group: GroupId, log: &mut GroupLog, entries: &[Entry], batch: &mut KvBatch) -> StoreResult<()> {
    let first = entries[0].index;
    let gap = StoreError::LogGap { group, first, log_first: log.first_index(), log_last: log.last.0 };
    if first <= log.truncated.0 || first > log.last.0 + 1 {
        return Err(gap);
    }
    for (offset, entry) in entries.iter().enumerate() {
        if entry.index != first + offset as u64 {
            return Err(gap);
        }
        let key = entry_key(group, entry.index);
        batch.put(Keyspace::RaftEntry, key, &encode(entry));
    }
    let last = &entries[entries.len() - 1];
    // Held entries after the new tail were written by an older leader: remove them.
    for stale in last.index + 1..=log.last.0 {
        batch.delete(Keyspace::RaftEntry, entry_key(group, stale));
    }
    log.last = (last.index, last.term);
    Ok(())
}

fn stage_snapshot(group: GroupId, log: &mut GroupLog, mut meta: SnapshotMetadata, batch: &mut KvBatch) {
    for index in log.first_index()..=log.last.0 {
        batch.delete(Keyspace::RaftEntry, entry_key(group, index));
    }
    log.truncated = (meta.index, meta.term);
    log.last = log.truncated;
    log.conf_state = meta.take_conf_state();
    log.hard_state.term = log.hard_state.term.max(meta.term);
    log.hard_state.commit = log.hard_state.commit.max(meta.index);
    batch.put(Keyspace::RaftState, state_key(group, STATE_TRUNCATED), &encode_pair(log.truncated));
    batch.put(Keyspace::RaftState, state_key(group, STATE_CONF), &encode(&log.conf_state));
    batch.put(Keyspace::RaftState, state_key(group, STATE_HARD), &encode(&log.hard_state));
}

fn stage_compact(
    group: GroupId,
    log: &mut GroupLog,
    first_index: u64,
    term_before: impl Fn(u64) -> StoreResult<u64>,
    batch: &mut KvBatch,
) -> StoreResult<()> {
    if first_index <= log.first_index() {
        return Ok(()); // Already compacted that far.
    }
    if first_index > log.last.0 + 1 {
        return Err(StoreError::CompactBeyondLog { group, index: first_index, last: log.last.0 });
    }
    let new_truncated = (first_index - 1, term_before(first_index - 1)?);
    for index in log.first_index()..first_index {
        batch.delete(Keyspace::RaftEntry, entry_key(group, index));
    }
    log.truncated = new_truncated;
    batch.put(Keyspace::RaftState, state_key(group, STATE_TRUNCATED), &encode_pair(new_truncated));
    Ok(())
}

fn load_state_record(
    groups: &mut BTreeMap<GroupId, GroupLog>,
    tombstones: &mut BTreeMap<GroupId, u64>,
    key: &[u8],
    value: &[u8],
) -> StoreResult<()> {
    let bad = |detail| corrupt(Keyspace::RaftState, key, detail);
    let (group, kind) = match key {
        [a, b, c, d, kind] => (GroupId::new(u32::from_be_bytes([*a, *b, *c, *d])), *kind),
        _ => return Err(bad("raft state key is not group + kind")),
    };
    if kind == STATE_TOMBSTONE {
        let epoch = value.try_into().map(u64::from_le_bytes).map_err(|_| bad("tombstone is not 8 bytes"))?;
        tombstones.insert(group, epoch);
        return Ok(());
    }
    let log = groups.entry(group).or_default();
    match kind {
        STATE_HARD => {
            log.hard_state = HardState::parse_from_bytes(value).map_err(|_| bad("hard state does not decode"))?
        }
        STATE_CONF => {
            log.conf_state = ConfState::parse_from_bytes(value).map_err(|_| bad("conf state does not decode"))?
        }
        STATE_TRUNCATED => {
            log.truncated = decode_pair(value).ok_or_else(|| bad("truncation marker is not 16 bytes"))?;
        }
        _ => return Err(bad("unknown raft state kind")),
    }
    Ok(())
}

fn corrupt(keyspace: Keyspace, key: &[u8], detail: &'static str) -> StoreError {
    StoreError::Corrupt { location: CorruptLocation::Kv { keyspace, key: key.to_vec() }, detail }
}

fn group_prefix(group: GroupId) -> [u8; 4] {
    group.get().to_be_bytes()
}

fn entry_key(group: GroupId, index: u64) -> Vec<u8> {
    [&group_prefix(group)[..], &index.to_be_bytes()].concat()
}

fn state_key(group: GroupId, kind: u8) -> Vec<u8> {
    [&group_prefix(group)[..], &[kind]].concat()
}

fn encode<M: protobuf::Message>(message: &M) -> Vec<u8> {
    // Cannot fail: writing a message whose fields are all set by this crate into a Vec.
    message.write_to_bytes().expect("protobuf encoding into memory")
}

fn decode_entry(key: &[u8], value: &[u8]) -> StoreResult<Entry> {
    let entry =
        Entry::parse_from_bytes(value).map_err(|_| corrupt(Keyspace::RaftEntry, key, "entry does not decode"))?;
    if key.get(4..) != Some(&entry.index.to_be_bytes()[..]) {
        return Err(corrupt(Keyspace::RaftEntry, key, "entry index differs from its key"));
    }
    Ok(entry)
}

fn encode_pair((a, b): (u64, u64)) -> Vec<u8> {
    [a.to_le_bytes(), b.to_le_bytes()].concat()
}

fn decode_pair(bytes: &[u8]) -> Option<(u64, u64)> {
    let a = u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?);
    let b = u64::from_le_bytes(bytes.get(8..16)?.try_into().ok()?);
    (bytes.len() == 16).then_some((a, b))
}

/// raft-rs's view of one group's log in a [`RaftLogStore`].
#[derive(Clone)]
pub struct GroupStorage {
    group: GroupId,
    store: Arc<RaftLogStore>,
}

impl GroupStorage {
    /// The group.
    pub fn group_id(&self) -> GroupId {
        self.group
    }

    /// Runs `f` on the cached state of the group, without copying it.
    fn with_log<T>(&self, f: impl FnOnce(&GroupLog) -> T) -> raft::Result<T> {
        let groups = self.store.groups.read();
        let log = groups.get(&self.group).ok_or_else(|| to_raft(StoreError::UnknownGroup { group: self.group }))?;
        Ok(f(log))
    }
}

fn to_raft(e: StoreError) -> raft::Error {
    raft::Error::Store(RaftStorageError::Other(Box::new(e)))
}

impl raft::Storage for GroupStorage {
    fn initial_state(&self) -> raft::Result<RaftState> {
        self.with_log(|log| RaftState::new(log.hard_state.clone(), log.conf_state.clone()))
    }

    fn entries(
        &self,
        low: u64,
        high: u64,
        max_size: impl Into<Option<u64>>,
        context: GetEntriesContext,
    ) -> raft::Result<Vec<Entry>> {
        let (first, last) = self.with_log(|log| (log.first_index(), log.last.0))?;
        if low < first {
            return Err(raft::Error::Store(RaftStorageError::Compacted));
        }
        if high > last + 1 || low > high {
            return Err(raft::Error::Store(RaftStorageError::Unavailable));
        }
        match self.store.read_entries(self.group, low, high, max_size.into()) {
            Ok(entries) => Ok(entries),
            // raft-rs panics on any other error. Entries a leader sends a follower may come later: the
            // follower's next answer (a heartbeat's, at the latest) makes the leader read them again.
            // A read for any other purpose (entries to apply, above all) has no later, and stays fatal.
            Err(error) if context.can_async() => {
                tracing::warn!(%error, group = %self.group, low, high, "raft log entries could not be read; sent later");
                Err(raft::Error::Store(RaftStorageError::LogTemporarilyUnavailable))
            }
            Err(error) => Err(to_raft(error)),
        }
    }

    fn term(&self, idx: u64) -> raft::Result<u64> {
        let (truncated, last) = self.with_log(|log| (log.truncated, log.last))?;
        if idx == truncated.0 {
            return Ok(truncated.1);
        }
        if idx < truncated.0 {
            return Err(raft::Error::Store(RaftStorageError::Compacted));
        }
        if idx > last.0 {
            return Err(raft::Error::Store(RaftStorageError::Unavailable));
        }
        if idx == last.0 {
            return Ok(last.1);
        }
        self.store.read_term(self.group, idx).map_err(to_raft)
    }

    fn first_index(&self) -> raft::Result<u64> {
        self.with_log(GroupLog::first_index)
    }

    fn last_index(&self) -> raft::Result<u64> {
        self.with_log(|log| log.last.0)
    }

    fn snapshot(&self, request_index: u64, _to: u64) -> raft::Result<Snapshot> {
        let source = self.store.snapshots.read().clone();
        let unavailable = raft::Error::Store(RaftStorageError::SnapshotTemporarilyUnavailable);
        let Some(source) = source else { return Err(unavailable) };
        match source.snapshot(self.group, request_index) {
            Ok(Some(snapshot)) if snapshot.get_metadata().index >= request_index => Ok(snapshot),
            Ok(_) => Err(unavailable),
            // raft-rs takes any other error for a fatal one and panics. A snapshot that could not be
            // read now is asked for again later (its follower waits meanwhile); the store's error is
            // logged here, where it is known.
            Err(error) => {
                tracing::warn!(%error, group = %self.group, "slot group snapshot could not be read; asked for again later");
                Err(unavailable)
            }
        }
    }
}
