//! `RaftLogStore` against the behaviours raft-rs documents for `raft::Storage`, plus a model-based test
//! with restarts over both backends.

// raft-rs protobuf messages are built field by field, as their docs do.
#![allow(clippy::field_reassign_with_default)]

use proptest::prelude::*;
use raft::prelude::{ConfState, Entry, HardState, Snapshot, SnapshotMetadata};
use raft::{GetEntriesContext, Storage, StorageError};
use std::collections::BTreeMap;
use std::sync::Arc;
use tidings_store::{
    FailOp, Kv, MemoryKv, MetaSpace, MetaStore, MetaWriteBatch, RaftLogBatch, RaftLogStore, SnapshotSource, StoreError,
    StoreResult,
};
use tidings_types::{GroupId, HashSlot};

const G1: GroupId = GroupId::new(1);
const G2: GroupId = GroupId::new(2);

fn entry(index: u64, term: u64) -> Entry {
    let mut e = Entry::default();
    e.index = index;
    e.term = term;
    e.data = vec![u8::try_from(index % 251).unwrap(); 8].into();
    e
}

fn conf(voters: &[u64]) -> ConfState {
    let mut cs = ConfState::default();
    cs.voters = voters.to_vec();
    cs
}

fn ctx() -> GetEntriesContext {
    GetEntriesContext::empty(false)
}

fn store_with(entries: &[(u64, u64)]) -> Arc<RaftLogStore> {
    kv_and_store_with(entries).1
}

/// A store whose group `G1` holds `entries` (index, term), and its backend.
fn kv_and_store_with(entries: &[(u64, u64)]) -> (Arc<MemoryKv>, Arc<RaftLogStore>) {
    let kv = Arc::new(MemoryKv::new());
    let store = Arc::new(RaftLogStore::open(kv.clone()).unwrap());
    store.create_group(G1, conf(&[1, 2, 3])).unwrap();
    let mut batch = RaftLogBatch::new();
    batch.append(G1, entries.iter().map(|(i, t)| entry(*i, *t)).collect());
    store.write(batch).unwrap();
    (kv, store)
}

fn is_compacted<T: std::fmt::Debug>(r: raft::Result<T>) -> bool {
    matches!(r, Err(raft::Error::Store(StorageError::Compacted)))
}

fn is_unavailable<T: std::fmt::Debug>(r: raft::Result<T>) -> bool {
    matches!(r, Err(raft::Error::Store(StorageError::Unavailable)))
}

#[test]
fn empty_log_starts_at_one() {
    let store = store_with(&[]);
    let s = store.group(G1).unwrap();
    assert_eq!(s.first_index().unwrap(), 1);
    assert_eq!(s.last_index().unwrap(), 0);
    assert_eq!(s.term(0).unwrap(), 0);
    assert_eq!(s.initial_state().unwrap().conf_state.voters, vec![1, 2, 3]);
    assert!(matches!(store.group(G2), Err(StoreError::UnknownGroup { .. })));
}

#[test]
fn term_after_compaction() {
    let store = store_with(&[(1, 1), (2, 1), (3, 2), (4, 3), (5, 3)]);
    let mut batch = RaftLogBatch::new();
    batch.compact(G1, 3);
    store.write(batch).unwrap();
    let s = store.group(G1).unwrap();
    assert_eq!(s.first_index().unwrap(), 3);
    assert_eq!(s.last_index().unwrap(), 5);
    // The term before the first entry is retained for matching.
    assert_eq!(s.term(2).unwrap(), 1);
    assert!(is_compacted(s.term(1)));
    assert_eq!(s.term(3).unwrap(), 2);
    assert_eq!(s.term(5).unwrap(), 3);
    assert!(is_unavailable(s.term(6)));
    // Compacting to an earlier point changes nothing; past the end is refused.
    let mut batch = RaftLogBatch::new();
    batch.compact(G1, 2);
    store.write(batch).unwrap();
    assert_eq!(s.first_index().unwrap(), 3);
    let mut batch = RaftLogBatch::new();
    batch.compact(G1, 7);
    assert!(matches!(store.write(batch), Err(StoreError::CompactBeyondLog { .. })));
}

#[test]
fn entries_with_size_limit() {
    // The log starts at 3: it was seeded from a snapshot at 2.
    let store = store_with(&[]);
    let mut meta = SnapshotMetadata::default();
    meta.index = 2;
    meta.term = 2;
    let mut batch = RaftLogBatch::new();
    batch
        .apply_snapshot(G1, meta)
        .append(G1, [(3, 3), (4, 4), (5, 5), (6, 6)].iter().map(|(i, t)| entry(*i, *t)).collect());
    store.write(batch).unwrap();
    let s = store.group(G1).unwrap();
    let size = u64::from(protobuf::Message::compute_size(&entry(4, 4)));
    assert!(is_compacted(s.entries(2, 6, None, ctx())));
    assert_eq!(s.entries(3, 4, None, ctx()).unwrap(), vec![entry(3, 3)]);
    assert_eq!(s.entries(4, 7, None, ctx()).unwrap().len(), 3);
    // A limit below one entry still returns one entry.
    assert_eq!(s.entries(4, 7, 0, ctx()).unwrap(), vec![entry(4, 4)]);
    assert_eq!(s.entries(4, 7, size * 2, ctx()).unwrap().len(), 2);
    assert_eq!(s.entries(4, 7, size * 2 + size / 2, ctx()).unwrap().len(), 2);
    assert_eq!(s.entries(4, 7, u64::MAX, ctx()).unwrap().len(), 3);
    assert!(is_unavailable(s.entries(4, 8, None, ctx())));
}

#[test]
fn append_overwrites_conflicting_suffix_and_refuses_gaps() {
    let store = store_with(&[(1, 1), (2, 1), (3, 1), (4, 1)]);
    let mut batch = RaftLogBatch::new();
    batch.append(G1, vec![entry(3, 2)]);
    store.write(batch).unwrap();
    let s = store.group(G1).unwrap();
    assert_eq!(s.last_index().unwrap(), 3);
    assert_eq!(s.term(3).unwrap(), 2);
    assert!(is_unavailable(s.term(4)));
    let mut batch = RaftLogBatch::new();
    batch.append(G1, vec![entry(5, 2)]);
    assert!(matches!(store.write(batch), Err(StoreError::LogGap { first: 5, .. })));
    assert_eq!(s.last_index().unwrap(), 3, "a refused batch changes nothing");
}

#[test]
fn apply_snapshot_resets_the_log() {
    let store = store_with(&[(1, 1), (2, 1), (3, 2)]);
    let mut meta = SnapshotMetadata::default();
    meta.index = 10;
    meta.term = 4;
    meta.set_conf_state(conf(&[1, 2]));
    let mut batch = RaftLogBatch::new();
    batch.apply_snapshot(G1, meta);
    store.write(batch).unwrap();
    let s = store.group(G1).unwrap();
    assert_eq!(s.first_index().unwrap(), 11);
    assert_eq!(s.last_index().unwrap(), 10);
    assert_eq!(s.term(10).unwrap(), 4);
    let state = s.initial_state().unwrap();
    assert_eq!(state.hard_state.commit, 10);
    assert_eq!(state.hard_state.term, 4);
    assert_eq!(state.conf_state.voters, vec![1, 2]);
    let mut batch = RaftLogBatch::new();
    batch.append(G1, vec![entry(11, 4)]);
    store.write(batch).unwrap();
    assert_eq!(s.entries(11, 12, None, ctx()).unwrap(), vec![entry(11, 4)]);
}

struct FixedSnapshot(u64);

impl SnapshotSource for FixedSnapshot {
    fn snapshot(&self, _group: GroupId, _request_index: u64) -> StoreResult<Option<Snapshot>> {
        let mut snap = Snapshot::default();
        snap.mut_metadata().index = self.0;
        snap.data = b"exported slots".to_vec().into();
        Ok(Some(snap))
    }
}

#[test]
fn snapshot_comes_from_the_source_and_is_never_older_than_requested() {
    let store = store_with(&[(1, 1)]);
    let s = store.group(G1).unwrap();
    assert!(matches!(s.snapshot(1, 2), Err(raft::Error::Store(StorageError::SnapshotTemporarilyUnavailable))));
    store.set_snapshot_source(Arc::new(FixedSnapshot(5)));
    assert_eq!(s.snapshot(5, 2).unwrap().get_metadata().index, 5);
    assert!(matches!(s.snapshot(6, 2), Err(raft::Error::Store(StorageError::SnapshotTemporarilyUnavailable))));
}

/// A source whose store cannot read the snapshot now.
struct UnreadableSnapshot;

impl SnapshotSource for UnreadableSnapshot {
    fn snapshot(&self, _group: GroupId, _request_index: u64) -> StoreResult<Option<Snapshot>> {
        Err(StoreError::io("scan", std::io::Error::other("disk hiccup")))
    }
}

/// raft-rs panics on any snapshot error but "temporarily unavailable" (simulator seeds 818000259,
/// 818000796 and 818000971 with `--meta-read-errors`: a failed scan of the exported slots took the
/// node down).
#[test]
fn a_snapshot_the_store_cannot_read_now_is_temporarily_unavailable() {
    let store = store_with(&[(1, 1)]);
    let s = store.group(G1).unwrap();
    store.set_snapshot_source(Arc::new(UnreadableSnapshot));
    assert!(matches!(s.snapshot(1, 2), Err(raft::Error::Store(StorageError::SnapshotTemporarilyUnavailable))));
}

/// Entries a leader sends can come later (raft-rs asks again on the follower's next answer); entries
/// read for anything else cannot, and the store's error stands.
#[test]
fn entries_the_store_cannot_read_now_are_temporarily_unavailable_only_to_a_caller_that_can_wait() {
    let (kv, store) = kv_and_store_with(&[(1, 1), (2, 1)]);
    let s = store.group(G1).unwrap();
    kv.fail(FailOp::Scan, 0, 2);
    let unavailable = raft::Error::Store(StorageError::LogTemporarilyUnavailable);
    assert_eq!(s.entries(1, 3, None, GetEntriesContext::empty(true)), Err(unavailable));
    let fatal = s.entries(1, 3, None, GetEntriesContext::empty(false)).unwrap_err();
    assert!(matches!(fatal, raft::Error::Store(StorageError::Other(_))), "{fatal:?}");
    assert_eq!(s.entries(1, 3, None, GetEntriesContext::empty(false)).unwrap(), vec![entry(1, 1), entry(2, 1)]);
}

#[test]
fn one_batch_one_sync_for_many_groups() {
    let kv = Arc::new(MemoryKv::new());
    let store = Arc::new(RaftLogStore::open(kv.clone()).unwrap());
    store.create_group(G1, conf(&[1])).unwrap();
    store.create_group(G2, conf(&[1])).unwrap();
    store.sync().unwrap();
    let syncs = kv.syncs();
    let mut batch = RaftLogBatch::new();
    let mut hs = HardState::default();
    hs.term = 1;
    hs.commit = 2;
    batch.append(G1, vec![entry(1, 1), entry(2, 1)]).append(G2, vec![entry(1, 1)]).set_hard_state(G1, hs.clone());
    store.write(batch).unwrap();
    store.sync().unwrap();
    assert_eq!(kv.syncs(), syncs + 1);
    kv.crash();
    let reopened = Arc::new(RaftLogStore::open(kv).unwrap());
    assert_eq!(reopened.group(G1).unwrap().last_index().unwrap(), 2);
    assert_eq!(reopened.group(G2).unwrap().last_index().unwrap(), 1);
    assert_eq!(reopened.group(G1).unwrap().initial_state().unwrap().hard_state, hs);
}

#[test]
fn a_log_write_with_other_changes_is_one_atomic_batch() {
    let kv = Arc::new(MemoryKv::new());
    let store = Arc::new(RaftLogStore::open(kv.clone()).unwrap());
    store.create_group(G1, conf(&[1])).unwrap();
    store.sync().unwrap();
    let meta = MetaStore::new(kv.clone());
    let space = MetaSpace::group_records(G1);
    let mut applied = MetaWriteBatch::new();
    applied.put(space, "k", "v").set_applied(G1, 2);
    let write = |store: &RaftLogStore| {
        let mut batch = RaftLogBatch::new();
        batch.append(G1, vec![entry(1, 1), entry(2, 1)]);
        meta.write_all_with([&applied], |also| store.write_with(batch, also))
    };
    // Refused whole: neither the log nor the other changes, and the log's view stays as it was.
    kv.fail(FailOp::Apply, 0, 1);
    assert!(write(&store).is_err());
    assert_eq!(store.group(G1).unwrap().last_index().unwrap(), 0);
    assert_eq!((meta.get(space, b"k").unwrap(), meta.applied_index(G1).unwrap()), (None, 0));
    let batches = kv.unsynced_batches();
    write(&store).unwrap();
    assert_eq!(kv.unsynced_batches(), batches + 1, "one backend batch");
    store.sync().unwrap();
    kv.crash();
    let reopened = Arc::new(RaftLogStore::open(kv.clone()).unwrap());
    assert_eq!(reopened.group(G1).unwrap().last_index().unwrap(), 2);
    assert_eq!((meta.get(space, b"k").unwrap(), meta.applied_index(G1).unwrap()), (Some(b"v".to_vec()), 2));
}

#[test]
fn corrupt_entry_is_a_typed_error_not_data() {
    let (kv, store) = kv_and_store_with(&[(1, 1), (2, 1), (3, 1)]);
    let key = [&G1.get().to_be_bytes()[..], &2u64.to_be_bytes()].concat();
    assert!(kv.corrupt(tidings_store::Keyspace::RaftEntry, &key));
    let s = store.group(G1).unwrap();
    let err = s.entries(1, 4, None, ctx()).unwrap_err();
    let raft::Error::Store(StorageError::Other(inner)) = err else { panic!("unexpected {err:?}") };
    assert!(matches!(inner.downcast_ref::<StoreError>(), Some(StoreError::Corrupt { .. })));
    assert!(s.term(2).is_err());
}

/// Entries gone from inside the log's range — a hole, its tail, an entry raft asks the term of — are
/// corruption, typed and naming the missing key; never a shorter answer raft would take for a size cut.
#[test]
fn entries_missing_inside_the_log_s_range_are_corruption_naming_the_first_missing() {
    for (missing, low, high) in [(3u64, 1u64, 6u64), (5, 1, 6), (5, 5, 6)] {
        let kv = Arc::new(MemoryKv::new());
        let store = Arc::new(RaftLogStore::open(kv.clone()).unwrap());
        store.create_group(G1, conf(&[1])).unwrap();
        let mut batch = RaftLogBatch::new();
        batch.append(G1, (1..=6).map(|i| entry(i, 1)).collect());
        store.write(batch).unwrap();
        let key = [&G1.get().to_be_bytes()[..], &missing.to_be_bytes()].concat();
        let mut delete = tidings_store::KvBatch::new();
        delete.delete(tidings_store::Keyspace::RaftEntry, key.clone());
        kv.apply(delete).unwrap();
        let s = store.group(G1).unwrap();
        let err = s.entries(low, high, None, ctx()).unwrap_err();
        let raft::Error::Store(StorageError::Other(inner)) = err else { panic!("{missing}: unexpected {err:?}") };
        match inner.downcast_ref::<StoreError>() {
            Some(StoreError::Corrupt { location: tidings_store::CorruptLocation::Kv { key: named, .. }, .. }) => {
                assert_eq!(named, &key, "entry {missing} of {low}..{high}");
            }
            other => panic!("entry {missing} of {low}..{high}: {other:?}"),
        }
        assert!(s.term(missing).is_err(), "the term of missing entry {missing}");
        // A range short of the missing entry reads whole.
        assert_eq!(s.entries(1, missing, None, ctx()).unwrap().len() as u64, missing - 1);
    }
}

/// Model of one group's log: entries by index, truncation marker, hard state.
#[derive(Clone, Debug, Default, PartialEq)]
struct Model {
    entries: BTreeMap<u64, u64>,
    truncated: (u64, u64),
    commit: u64,
}

impl Model {
    fn last(&self) -> u64 {
        self.entries.keys().next_back().copied().unwrap_or(self.truncated.0)
    }
}

#[derive(Clone, Debug)]
enum Op {
    /// Append `count` entries of `term` starting `back` entries before the end.
    Append {
        back: u64,
        count: u64,
        term: u64,
    },
    /// Compact to `fraction` of the way through the log.
    Compact(u8),
    /// Install a snapshot `ahead` entries past the end.
    Snapshot {
        ahead: u64,
    },
    Commit,
    Sync,
    Restart,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0u64..3, 1u64..4, 1u64..4).prop_map(|(back, count, term)| Op::Append { back, count, term }),
        1 => (0u8..=100).prop_map(Op::Compact),
        1 => (0u64..5).prop_map(|ahead| Op::Snapshot { ahead }),
        1 => Just(Op::Commit),
        2 => Just(Op::Sync),
        1 => Just(Op::Restart),
    ]
}

fn step(model: &Model, op: &Op, batch: &mut RaftLogBatch) -> Option<Model> {
    let mut next = model.clone();
    match *op {
        Op::Append { back, count, term } => {
            let first = (model.last() + 1).saturating_sub(back).max(model.truncated.0 + 1);
            // Terms never decrease along a raft log.
            let floor = model.entries.range(..first).next_back().map_or(model.truncated.1, |(_, t)| *t);
            let term = floor + term;
            next.entries.retain(|i, _| *i < first);
            let entries: Vec<Entry> = (first..first + count).map(|i| entry(i, term)).collect();
            for e in &entries {
                next.entries.insert(e.index, e.term);
            }
            batch.append(G1, entries);
        }
        Op::Compact(fraction) => {
            let span = model.last() - model.truncated.0;
            let first = model.truncated.0 + 1 + span * u64::from(fraction) / 100;
            if first > model.truncated.0 + 1 {
                next.truncated = (first - 1, model.entries[&(first - 1)]);
                next.entries.retain(|i, _| *i >= first);
            }
            batch.compact(G1, first);
        }
        Op::Snapshot { ahead } => {
            let index = model.last() + ahead;
            let term = model.entries.values().next_back().copied().unwrap_or(model.truncated.1) + 1;
            next.entries.clear();
            next.truncated = (index, term);
            next.commit = next.commit.max(index);
            let mut meta = SnapshotMetadata::default();
            meta.index = index;
            meta.term = term;
            meta.set_conf_state(conf(&[1, 2, 3]));
            batch.apply_snapshot(G1, meta);
        }
        Op::Commit => {
            next.commit = model.last();
            let mut hs = HardState::default();
            hs.commit = next.commit;
            hs.term = model.entries.values().next_back().copied().unwrap_or(model.truncated.1);
            batch.set_hard_state(G1, hs);
        }
        Op::Sync | Op::Restart => return None,
    }
    Some(next)
}

/// Reads the whole state of G1 back as a model, checking the `Storage` answers agree with each other.
fn read_model(store: &Arc<RaftLogStore>) -> Model {
    let s = store.group(G1).unwrap();
    let first = s.first_index().unwrap();
    let last = s.last_index().unwrap();
    let truncated = (first - 1, s.term(first - 1).unwrap());
    let entries = s.entries(first, last + 1, None, ctx()).unwrap();
    let entries: BTreeMap<u64, u64> = entries.iter().map(|e| (e.index, e.term)).collect();
    for (index, term) in &entries {
        assert_eq!(s.term(*index).unwrap(), *term);
    }
    assert_eq!(entries.keys().next_back().copied().unwrap_or(truncated.0), last);
    Model { entries, truncated, commit: s.initial_state().unwrap().hard_state.commit }
}

fn run(ops: &[Op], open: impl Fn() -> Arc<dyn Kv>, crash: impl Fn(&Arc<dyn Kv>)) {
    let mut kv = open();
    let mut store = Arc::new(RaftLogStore::open(kv.clone()).unwrap());
    store.create_group(G1, conf(&[1, 2, 3])).unwrap();
    store.sync().unwrap();
    let mut history = vec![Model::default()];
    let mut synced = 0;
    for op in ops {
        let mut batch = RaftLogBatch::new();
        match (op, step(history.last().unwrap(), op, &mut batch)) {
            (_, Some(next)) => {
                store.write(batch).unwrap();
                history.push(next);
            }
            (Op::Sync, None) => {
                store.sync().unwrap();
                synced = history.len() - 1;
            }
            (_, None) => {
                crash(&kv);
                drop(store);
                drop(kv);
                kv = open();
                store = Arc::new(RaftLogStore::open(kv.clone()).unwrap());
                // The recovered log is one of the states since the last sync.
                let recovered = read_model(&store);
                let pos = history[synced..]
                    .iter()
                    .position(|m| *m == recovered)
                    .expect("recovered log matches no state since the last sync");
                history.truncate(synced + pos + 1);
                synced = history.len() - 1;
            }
        }
        assert_eq!(&read_model(&store), history.last().unwrap());
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn memory_raft_log_matches_model(ops in proptest::collection::vec(op(), 1..40)) {
        let kv = Arc::new(MemoryKv::new());
        let shared: Arc<dyn Kv> = kv.clone();
        run(&ops, || shared.clone(), |_| kv.crash());
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]

    #[test]
    fn sled_raft_log_matches_model(ops in proptest::collection::vec(op(), 1..30)) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().to_path_buf();
        run(&ops, || Arc::new(tidings_store::SledKv::open(&path, 4 << 20).unwrap()), |_| {});
    }
}

/// A replica's destruction is one write: its metadata, its applied index and its raft log go together,
/// or, when the write fails, all stay (never an applied index over cleared data).
#[test]
fn a_replica_is_destroyed_whole_or_not_at_all() {
    let kv = Arc::new(MemoryKv::new());
    let logs = Arc::new(RaftLogStore::open(kv.clone()).unwrap());
    let meta = MetaStore::new(kv.clone());
    logs.create_group(G1, conf(&[1])).unwrap();
    let mut batch = RaftLogBatch::new();
    batch.append(G1, vec![entry(1, 1)]);
    logs.write(batch).unwrap();
    let space = MetaSpace::slot(G1, HashSlot::new(3).unwrap());
    let mut writes = MetaWriteBatch::new();
    writes.put(space, b"user".to_vec(), b"x".to_vec());
    writes.set_applied(G1, 1);
    meta.write(&writes).unwrap();
    let destroy = || meta.forget_group_with(G1, |batch| logs.remove_group_with(G1, 7, batch));
    kv.fail(FailOp::Apply, 0, 1);
    assert!(destroy().is_err());
    assert_eq!(meta.get(space, b"user").unwrap(), Some(b"x".to_vec()), "the metadata stays");
    assert_eq!(meta.applied_index(G1).unwrap(), 1, "the applied index stays");
    assert_eq!(logs.groups(), vec![G1], "the raft log stays");
    destroy().unwrap();
    assert_eq!(meta.get(space, b"user").unwrap(), None);
    assert_eq!(meta.applied_index(G1).unwrap(), 0);
    assert!(logs.groups().is_empty());
    assert_eq!(logs.tombstone(G1), Some(7));
}

#[test]
fn a_bootstrapped_group_starts_after_its_initial_snapshot_and_a_left_group_stays_left() {
    let kv: Arc<dyn Kv> = Arc::new(MemoryKv::new());
    let store = Arc::new(RaftLogStore::open(kv.clone()).unwrap());
    assert!(store.bootstrap_group(G1, conf(&[1, 2, 3])).unwrap());
    assert!(!store.bootstrap_group(G1, conf(&[1, 2, 3])).unwrap(), "an existing group is left as it is");
    let storage = store.group(G1).unwrap();
    let index = tidings_store::BOOTSTRAP_INDEX;
    assert_eq!((storage.first_index().unwrap(), storage.last_index().unwrap()), (index + 1, index));
    assert_eq!(storage.term(index).unwrap(), index);
    assert_eq!(storage.initial_state().unwrap().conf_state.voters, vec![1, 2, 3]);

    store.remove_group(G1, 42).unwrap();
    store.sync().unwrap();
    let reopened = Arc::new(RaftLogStore::open(kv).unwrap());
    assert_eq!(reopened.tombstone(G1), Some(42));
    assert!(!reopened.bootstrap_group(G1, conf(&[1, 2, 3])).unwrap(), "a restart does not bring it back");
    assert!(reopened.groups().is_empty());
    // Added again by a leader: the tombstone is lifted.
    reopened.create_group(G1, ConfState::default()).unwrap();
    assert_eq!(reopened.tombstone(G1), None);
    assert_eq!(reopened.groups(), vec![G1]);
}
