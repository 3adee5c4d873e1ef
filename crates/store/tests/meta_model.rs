//! Model-based test of `MetaStore` against a `BTreeMap`, with restarts.
//!
//! Memory backend: a restart is `crash()`, after which exactly the state as of the last sync must remain.
//! sled backend: a restart drops and reopens the database from its directory; the state must be one the
//! model passed through at or after the last sync (batches are atomic and survive in order).

use proptest::prelude::*;
use std::collections::BTreeMap;
use std::sync::Arc;
use tidings_store::{Kv, MemoryKv, MetaSpace, MetaStore, MetaWriteBatch, SledKv};
use tidings_types::{GroupId, HashSlot};

const SLOTS: u16 = 3;
const GROUP: GroupId = GroupId::new(1);

#[derive(Clone, Debug)]
enum Change {
    Put(u16, u8, Vec<u8>),
    Delete(u16, u8),
    Clear(u16),
}

#[derive(Clone, Debug)]
enum Op {
    Write(Vec<Change>),
    Sync,
    Restart,
}

fn op() -> impl Strategy<Value = Op> {
    let change = prop_oneof![
        6 => (0..SLOTS, 0u8..6, proptest::collection::vec(any::<u8>(), 0..6)).prop_map(|(s, k, v)| Change::Put(s, k, v)),
        2 => (0..SLOTS, 0u8..6).prop_map(|(s, k)| Change::Delete(s, k)),
        1 => (0..SLOTS).prop_map(Change::Clear),
    ];
    prop_oneof![
        6 => proptest::collection::vec(change, 1..5).prop_map(Op::Write),
        2 => Just(Op::Sync),
        1 => Just(Op::Restart),
    ]
}

/// Model state: every (slot, key) → value, plus the applied index.
type State = (BTreeMap<(u16, u8), Vec<u8>>, u64);

fn slot(i: u16) -> MetaSpace {
    MetaSpace::slot(GROUP, HashSlot::new(i).unwrap())
}

fn apply_model(state: &State, changes: &[Change]) -> State {
    let (mut map, applied) = state.clone();
    for change in changes {
        match change {
            Change::Put(s, k, v) => {
                map.insert((*s, *k), v.clone());
            }
            Change::Delete(s, k) => {
                map.remove(&(*s, *k));
            }
            Change::Clear(s) => map.retain(|(slot, _), _| slot != s),
        }
    }
    (map, applied + 1)
}

fn read_state(store: &MetaStore) -> State {
    let mut map = BTreeMap::new();
    for s in 0..SLOTS {
        let page = store.scan(slot(s), b"", None, 100).unwrap();
        assert!(page.next_after.is_none());
        for (key, value) in page.entries {
            assert_eq!(key.len(), 1, "unexpected key {key:?}");
            // Point reads agree with scans.
            assert_eq!(store.get(slot(s), &key).unwrap().as_ref(), Some(&value));
            map.insert((s, key[0]), value);
        }
    }
    (map, store.applied_index(GROUP).unwrap())
}

fn to_batch(changes: &[Change], applied: u64) -> MetaWriteBatch {
    let mut batch = MetaWriteBatch::new();
    for change in changes {
        match change {
            Change::Put(s, k, v) => batch.put(slot(*s), vec![*k], v.clone()),
            Change::Delete(s, k) => batch.delete(slot(*s), vec![*k]),
            Change::Clear(s) => batch.clear(slot(*s)),
        };
    }
    batch.set_applied(GROUP, applied);
    batch
}

/// Runs `ops`; `restart` returns the store after a restart and must hand back one of `candidates`.
fn run(ops: &[Op], mut store: MetaStore, mut restart: impl FnMut(MetaStore) -> MetaStore) {
    // history[i] = state after i batches; states before `synced` are durable.
    let mut history: Vec<State> = vec![(BTreeMap::new(), 0)];
    let mut synced = 0usize;
    for op in ops {
        match op {
            Op::Write(changes) => {
                let next = apply_model(history.last().unwrap(), changes);
                store.write(&to_batch(changes, next.1)).unwrap();
                history.push(next);
            }
            Op::Sync => {
                store.sync().unwrap();
                synced = history.len() - 1;
            }
            Op::Restart => {
                store = restart(store);
                let actual = read_state(&store);
                let found = history[synced..].iter().position(|s| *s == actual);
                let Some(offset) = found else {
                    panic!(
                        "state after restart {actual:?} is none of the states since the last sync {:?}",
                        &history[synced..]
                    );
                };
                history.truncate(synced + offset + 1);
                synced = history.len() - 1;
            }
        }
        assert_eq!(&read_state(&store), history.last().unwrap());
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn memory_meta_store_matches_model(ops in proptest::collection::vec(op(), 1..40)) {
        let kv = Arc::new(MemoryKv::new());
        let store = MetaStore::new(kv.clone());
        run(&ops, store, |store| {
            kv.crash();
            store
        });
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 16, ..ProptestConfig::default() })]

    #[test]
    fn sled_meta_store_matches_model(ops in proptest::collection::vec(op(), 1..30)) {
        let dir = tempfile::tempdir().unwrap();
        let open = || -> MetaStore {
            let kv: Arc<dyn Kv> = Arc::new(SledKv::open(dir.path(), 4 << 20).unwrap());
            MetaStore::new(kv)
        };
        let store = open();
        run(&ops, store, |store| {
            drop(store);
            open()
        });
    }
}

/// Memory crash keeping a prefix of unsynced batches lands on an intermediate model state.
#[test]
fn crash_keeping_prefix_lands_on_an_intermediate_state() {
    let kv = Arc::new(MemoryKv::new());
    let store = MetaStore::new(kv.clone());
    let mut state: State = (BTreeMap::new(), 0);
    let mut states = vec![state.clone()];
    for i in 0..5u8 {
        let changes = [Change::Put(0, i, vec![i])];
        state = apply_model(&state, &changes);
        store.write(&to_batch(&changes, state.1)).unwrap();
        states.push(state.clone());
    }
    kv.crash_keeping(2);
    assert_eq!(read_state(&store), states[2]);
}
