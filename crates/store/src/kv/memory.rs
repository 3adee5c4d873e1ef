//! In-memory [`Kv`] with a crash model and failpoints, for deterministic simulation and tests.

use super::{Direction, KeyRange, Keyspace, Kv, KvBatch, KvOp, KvPair};
use crate::error::StoreResult;
use crate::failpoint::Failpoints;
use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};

/// An operation a failpoint can make fail.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum FailOp {
    /// [`Kv::get_sealed`].
    Get,
    /// [`Kv::scan_sealed`].
    Scan,
    /// [`Kv::apply`]: a failed apply changes nothing.
    Apply,
    /// [`Kv::sync`]: a failed sync makes nothing newly durable.
    Sync,
}

/// What a failpoint targets: every call of an operation, or only those that touch keys of one keyspace
/// under one prefix.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct FailTarget {
    op: FailOp,
    under: Option<(Keyspace, Vec<u8>)>,
}

impl FailTarget {
    /// `true` if a call of `op` that touches `touches` counts against this target.
    fn matches(&self, op: FailOp, touches: impl Fn(Keyspace, &[u8]) -> bool) -> bool {
        self.op == op && self.under.as_ref().is_none_or(|(keyspace, prefix)| touches(*keyspace, prefix))
    }
}

/// One ordered map per keyspace: lookups borrow the key (no allocation) and compare only key bytes.
type Map = BTreeMap<Keyspace, BTreeMap<Vec<u8>, Vec<u8>>>;

/// How to undo one applied batch: the previous value of every key it touched, in the order touched.
type Undo = Vec<(Keyspace, Vec<u8>, Option<Vec<u8>>)>;

#[derive(Default)]
struct State {
    /// What readers see: every applied batch.
    current: Map,
    /// One undo record per batch applied since the last successful sync, oldest first. Rolling them back
    /// yields exactly the durable image, so a sync costs nothing and a crash replays only what it loses.
    unsynced: Vec<Undo>,
    failpoints: Failpoints<FailTarget>,
    syncs: u64,
}

/// An in-memory [`Kv`].
///
/// Crash model: [`MemoryKv::crash`] forgets every batch applied since the last successful sync, as a
/// power loss would; [`MemoryKv::crash_keeping`] keeps a prefix of them, as a backend that wrote some
/// batches out before dying would. Batches are atomic in both. Failpoints make chosen operations return
/// an IO error; [`MemoryKv::corrupt`] damages a stored value to exercise checksum paths.
#[derive(Default)]
pub struct MemoryKv {
    state: Mutex<State>,
    cache_epoch: AtomicU64,
}

impl MemoryKv {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// Loses every batch applied since the last successful sync.
    pub fn crash(&self) {
        self.crash_keeping(0);
    }

    /// Loses every batch applied since the last successful sync except the first `kept` of them.
    pub fn crash_keeping(&self, kept: usize) {
        // What the layer above cached may be among what is lost.
        self.cache_epoch.fetch_add(1, Ordering::Release);
        let mut state = self.state.lock();
        while state.unsynced.len() > kept {
            let undo = state.unsynced.pop().expect("longer than kept");
            for (keyspace, key, previous) in undo.into_iter().rev() {
                let space = state.current.entry(keyspace).or_default();
                match previous {
                    Some(value) => space.insert(key, value),
                    None => space.remove(&key),
                };
            }
        }
        // What survived is now on "disk".
        state.unsynced.clear();
    }

    /// Number of batches that a crash now would lose.
    pub fn unsynced_batches(&self) -> usize {
        self.state.lock().unsynced.len()
    }

    /// Number of successful syncs so far.
    pub fn syncs(&self) -> u64 {
        self.state.lock().syncs
    }

    /// Lets the next `after` calls of `op` succeed, then fails the following `times` calls.
    pub fn fail(&self, op: FailOp, after: u64, times: u64) {
        self.state.lock().failpoints.arm(FailTarget { op, under: None }, after, times);
    }

    /// As [`MemoryKv::fail`], counting only the calls of `op` that touch a key of `keyspace` starting with
    /// `prefix`: a get of such a key, a scan whose range holds such keys, an apply whose batch writes
    /// one. A sync touches every key, so a narrowed [`FailOp::Sync`] counts every sync.
    ///
    /// Tests use it to fail one reader's reads (a slot migration's export, say) while the rest of the
    /// store, the raft logs among it, keeps working.
    ///
    /// ```
    /// use tidings_store::{FailOp, Keyspace, Kv, MemoryKv};
    ///
    /// let kv = MemoryKv::new();
    /// kv.fail_under(FailOp::Get, Keyspace::Meta, b"users/", 0, 1);
    /// assert!(kv.get(Keyspace::Meta, b"channels/1").is_ok(), "another prefix reads");
    /// assert!(kv.get(Keyspace::Meta, b"users/1").is_err(), "the first read under the prefix fails");
    /// assert!(kv.get(Keyspace::Meta, b"users/1").is_ok(), "one failure was asked for");
    /// assert_eq!(kv.injected_failures(), 1);
    /// ```
    pub fn fail_under(&self, op: FailOp, keyspace: Keyspace, prefix: &[u8], after: u64, times: u64) {
        let target = FailTarget { op, under: Some((keyspace, prefix.to_vec())) };
        self.state.lock().failpoints.arm(target, after, times);
    }

    /// Runs `f` with every failpoint held off: the calls it makes neither fail nor count against a
    /// failpoint, which stand as they were afterwards (any armed inside `f` are dropped). For a test's
    /// or a simulator's own reads, which must not take the failures meant for the code under test.
    pub fn without_failpoints<T>(&self, f: impl FnOnce() -> T) -> T {
        let held = std::mem::take(&mut self.state.lock().failpoints);
        let result = f();
        self.state.lock().failpoints = held;
        result
    }

    /// How many calls a failpoint made fail so far.
    pub fn injected_failures(&self) -> u64 {
        self.state.lock().failpoints.injected()
    }

    /// Removes every failpoint.
    pub fn clear_failpoints(&self) {
        self.state.lock().failpoints.clear();
    }

    /// Flips a bit of the stored value of `key` (call it on synced data: the durable image is the value).
    /// Returns `false` if the key does not exist.
    pub fn corrupt(&self, keyspace: Keyspace, key: &[u8]) -> bool {
        let mut state = self.state.lock();
        match state.current.get_mut(&keyspace).and_then(|space| space.get_mut(key)) {
            Some(value) => {
                if let Some(byte) = value.last_mut() {
                    *byte ^= 0x01;
                }
                true
            }
            None => false,
        }
    }
}

/// Applies `batch` to `map`, returning how to undo it.
fn apply_to(map: &mut Map, batch: KvBatch) -> Undo {
    let mut undo = Vec::with_capacity(batch.len());
    for op in batch.into_ops() {
        match op {
            KvOp::Put { keyspace, key, sealed } => {
                let previous = map.entry(keyspace).or_default().insert(key.clone(), sealed);
                undo.push((keyspace, key, previous));
            }
            KvOp::Delete { keyspace, key } => {
                let previous = map.get_mut(&keyspace).and_then(|space| space.remove(&key));
                undo.push((keyspace, key, previous));
            }
        }
    }
    undo
}

impl Kv for MemoryKv {
    fn get_sealed(&self, keyspace: Keyspace, key: &[u8]) -> StoreResult<Option<Vec<u8>>> {
        let mut state = self.state.lock();
        let under = |space: Keyspace, prefix: &[u8]| space == keyspace && key.starts_with(prefix);
        state.failpoints.check_matching(|target| target.matches(FailOp::Get, under), "get")?;
        Ok(state.current.get(&keyspace).and_then(|space| space.get(key)).cloned())
    }

    fn scan_sealed(
        &self,
        keyspace: Keyspace,
        range: &KeyRange,
        direction: Direction,
        limit: usize,
    ) -> StoreResult<Vec<KvPair>> {
        let mut state = self.state.lock();
        // The range holds keys under the prefix if it starts among them or the prefix itself is in it.
        let under = |space: Keyspace, prefix: &[u8]| {
            space == keyspace && (range.start.starts_with(prefix) || range.contains(prefix))
        };
        state.failpoints.check_matching(|target| target.matches(FailOp::Scan, under), "scan")?;
        let Some(space) = state.current.get(&keyspace) else { return Ok(Vec::new()) };
        let in_range = space
            .range::<[u8], _>((std::ops::Bound::Included(range.start.as_slice()), std::ops::Bound::Unbounded))
            .take_while(|(key, _)| range.contains(key))
            .map(|(key, value)| (key.clone(), value.clone()));
        Ok(match direction {
            Direction::Forward => in_range.take(limit).collect(),
            Direction::Reverse => {
                let all: Vec<KvPair> = in_range.collect();
                all.into_iter().rev().take(limit).collect()
            }
        })
    }

    fn apply(&self, batch: KvBatch) -> StoreResult<()> {
        let mut state = self.state.lock();
        let under = |space: Keyspace, prefix: &[u8]| {
            batch.ops().iter().any(|op| {
                let (keyspace, key) = match op {
                    KvOp::Put { keyspace, key, .. } | KvOp::Delete { keyspace, key } => (*keyspace, key),
                };
                keyspace == space && key.starts_with(prefix)
            })
        };
        state.failpoints.check_matching(|target| target.matches(FailOp::Apply, under), "apply")?;
        let undo = apply_to(&mut state.current, batch);
        state.unsynced.push(undo);
        Ok(())
    }

    fn cache_epoch(&self) -> &AtomicU64 {
        &self.cache_epoch
    }

    fn sync(&self) -> StoreResult<()> {
        let mut state = self.state.lock();
        state.failpoints.check_matching(|target| target.op == FailOp::Sync, "sync")?;
        state.unsynced.clear();
        state.syncs += 1;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::StoreError;

    fn put(kv: &MemoryKv, key: &[u8], value: &[u8]) {
        let mut batch = KvBatch::new();
        batch.put(Keyspace::Meta, key.to_vec(), value);
        kv.apply(batch).unwrap();
    }

    #[test]
    fn crash_keeps_only_synced_batches() {
        let kv = MemoryKv::new();
        put(&kv, b"a", b"1");
        kv.sync().unwrap();
        put(&kv, b"b", b"2");
        put(&kv, b"a", b"3");
        assert_eq!(kv.unsynced_batches(), 2);
        kv.crash();
        assert_eq!(kv.get(Keyspace::Meta, b"a").unwrap(), Some(b"1".to_vec()));
        assert_eq!(kv.get(Keyspace::Meta, b"b").unwrap(), None);
    }

    #[test]
    fn crash_keeping_a_prefix_is_ordered() {
        let kv = MemoryKv::new();
        put(&kv, b"a", b"1");
        put(&kv, b"b", b"2");
        kv.crash_keeping(1);
        assert_eq!(kv.get(Keyspace::Meta, b"a").unwrap(), Some(b"1".to_vec()));
        assert_eq!(kv.get(Keyspace::Meta, b"b").unwrap(), None);
    }

    #[test]
    fn failpoints_fail_then_recover_and_change_nothing() {
        let kv = MemoryKv::new();
        kv.fail(FailOp::Apply, 1, 1);
        put(&kv, b"a", b"1");
        let mut batch = KvBatch::new();
        batch.put(Keyspace::Meta, b"b".to_vec(), b"2");
        assert!(matches!(kv.apply(batch), Err(StoreError::Io { op: "apply", .. })));
        assert_eq!(kv.get(Keyspace::Meta, b"b").unwrap(), None);
        put(&kv, b"c", b"3");
        kv.fail(FailOp::Sync, 0, 1);
        assert!(kv.sync().is_err());
        kv.crash();
        assert_eq!(kv.get(Keyspace::Meta, b"a").unwrap(), None, "failed sync made nothing durable");
    }

    #[test]
    fn narrowed_failpoints_count_only_calls_that_touch_their_prefix() {
        let kv = MemoryKv::new();
        for key in [&b"a/1"[..], b"b/1", b"b/2", b"c/1"] {
            put(&kv, key, b"v");
        }
        let scan = |start: &[u8], end: Option<&[u8]>| {
            let range = KeyRange { start: start.to_vec(), end: end.map(<[u8]>::to_vec) };
            kv.scan(Keyspace::Meta, &range, Direction::Forward, 10)
        };
        // Scans: one that starts inside the prefix and one that spans it both count; others do not.
        kv.fail_under(FailOp::Scan, Keyspace::Meta, b"b/", 1, 1);
        assert!(scan(b"a/", Some(b"a0")).is_ok(), "before the prefix");
        assert!(scan(b"c/", None).is_ok(), "after the prefix");
        assert!(scan(b"b/2", None).is_ok(), "starts inside the prefix: the one let through");
        assert!(matches!(scan(b"a/", None), Err(StoreError::Io { op: "scan", .. })), "spans the prefix");
        assert_eq!(scan(b"a/", None).unwrap().len(), 4, "the one failure is spent");
        // Gets and applies, and another keyspace under the same prefix.
        kv.fail_under(FailOp::Get, Keyspace::Meta, b"b/", 0, u64::MAX);
        kv.fail_under(FailOp::Apply, Keyspace::Meta, b"c/", 0, 1);
        assert!(kv.get(Keyspace::Meta, b"a/1").is_ok());
        assert!(kv.get(Keyspace::Placement, b"b/1").is_ok(), "another keyspace");
        assert!(kv.get(Keyspace::Meta, b"b/1").is_err() && kv.get(Keyspace::Meta, b"b/2").is_err());
        put(&kv, b"a/2", b"v");
        let mut batch = KvBatch::new();
        batch.put(Keyspace::Meta, b"a/3".to_vec(), b"v");
        batch.delete(Keyspace::Meta, b"c/1".to_vec());
        assert!(kv.apply(batch).is_err(), "a batch with one key under the prefix");
        assert!(kv.get(Keyspace::Meta, b"a/3").unwrap().is_none(), "the failed batch changed nothing");
        assert_eq!(kv.injected_failures(), 4);
        // Held off for the caller's own reads, and standing again afterwards.
        assert!(kv.without_failpoints(|| kv.get(Keyspace::Meta, b"b/1")).is_ok());
        assert!(kv.get(Keyspace::Meta, b"b/1").is_err());
        assert_eq!(kv.injected_failures(), 5);
        kv.clear_failpoints();
        assert!(kv.get(Keyspace::Meta, b"b/1").is_ok());
    }

    #[test]
    fn corruption_is_reported_with_location() {
        let kv = MemoryKv::new();
        put(&kv, b"k", b"value");
        assert!(kv.corrupt(Keyspace::Meta, b"k"));
        match kv.get(Keyspace::Meta, b"k") {
            Err(StoreError::Corrupt { location, .. }) => {
                assert_eq!(location, crate::CorruptLocation::Kv { keyspace: Keyspace::Meta, key: b"k".to_vec() })
            }
            other => panic!("expected corruption, got {other:?}"),
        }
    }

    #[test]
    fn scans_respect_keyspace_range_direction_and_limit() {
        let kv = MemoryKv::new();
        for key in [b"a1", b"a2", b"a3", b"b1"] {
            put(&kv, key, key);
        }
        let mut other = KvBatch::new();
        other.put(Keyspace::Applied, b"a0".to_vec(), b"x");
        kv.apply(other).unwrap();
        let range = KeyRange::prefix(b"a");
        let fwd = kv.scan(Keyspace::Meta, &range, Direction::Forward, 2).unwrap();
        assert_eq!(fwd.iter().map(|(k, _)| k.as_slice()).collect::<Vec<_>>(), [b"a1", b"a2"]);
        let rev = kv.scan(Keyspace::Meta, &range, Direction::Reverse, 1).unwrap();
        assert_eq!(rev[0].0, b"a3");
    }
}
