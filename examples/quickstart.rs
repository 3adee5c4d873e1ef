//! The README's main command: `cargo run --release --example quickstart`.
//!
//! Today it runs the foundation of tidings end to end on a real sled directory: routes 10,000 user keys to
//! their slot groups through one route snapshot, writes their metadata in per-group atomic batches (each
//! recording the group's applied index) followed by a real fsync, writes raft logs for those groups in one
//! cross-group batch, closes and reopens the database, and checks everything came back. The multi-node
//! cluster (nodes, channels, failover) replaces this body as the node runtime lands.
#![allow(clippy::disallowed_methods)] // An example is a runtime shell: it reads the clock to report figures.

use raft::prelude::{ConfState, Entry};
use raft::Storage;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;
use tidings::router::{hash_slot, GroupObservation, HashToSlot, Router};
use tidings::store::{Kv, MetaStore, MetaWriteBatch, RaftLogBatch, RaftLogStore, SledKv};
use tidings::types::{ConfigEpoch, GroupId, NodeId, Term};

const USERS: usize = 10_000;
const GROUPS: u32 = 8;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    println!("tidings quickstart (foundation stage): data in {}", dir.path().display());

    let router = Router::new(HashToSlot::even_split(GROUPS)?);
    for group in router.snapshot().hash_to_slot().groups().collect::<Vec<_>>() {
        let leader = NodeId::new(u64::from(group.get()) % 3 + 1);
        let voters = vec![NodeId::new(1), NodeId::new(2), NodeId::new(3)];
        let observation = GroupObservation {
            leader: Some(leader),
            term: Term::new(1),
            voters,
            learners: vec![],
            config_epoch: ConfigEpoch::new(1),
        };
        router.observe(group, observation)?;
    }

    let keys: Vec<Vec<u8>> = (0..USERS).map(|i| format!("uid-{i}").into_bytes()).collect();
    let started = Instant::now();
    let snapshot = router.snapshot();
    let routes = snapshot.resolve_many(keys.iter().map(Vec::as_slice));
    let resolve_time = started.elapsed();
    let mut per_group: BTreeMap<GroupId, Vec<usize>> = BTreeMap::new();
    for (i, route) in routes.iter().enumerate() {
        per_group.entry(route.as_ref().map_err(|e| e.to_string())?.group).or_default().push(i);
    }
    println!(
        "routed {USERS} keys to {} groups at revision {} in {:?} ({:.1} M keys/s)",
        per_group.len(),
        snapshot.revision(),
        resolve_time,
        USERS as f64 / resolve_time.as_secs_f64() / 1e6
    );

    {
        let kv: Arc<dyn Kv> = Arc::new(SledKv::open(dir.path(), 64 << 20)?);
        let meta = MetaStore::new(kv.clone());
        let raft_logs = Arc::new(RaftLogStore::open(kv.clone())?);
        let started = Instant::now();
        let mut raft_batch = RaftLogBatch::new();
        for (group, users) in &per_group {
            let mut batch = MetaWriteBatch::new();
            for &i in users {
                batch.put(hash_slot(&keys[i]), keys[i].clone(), format!("{{\"name\":\"user {i}\"}}"));
            }
            batch.set_applied(*group, 1);
            meta.write(&batch)?;
            raft_logs.create_group(*group, ConfState { voters: vec![1, 2, 3], ..Default::default() })?;
            raft_batch.append(*group, vec![Entry { index: 1, term: 1, ..Default::default() }]);
        }
        raft_logs.write(raft_batch)?;
        kv.sync()?; // one real fsync covers every group's metadata and raft log
        println!(
            "wrote {USERS} users in {} atomic group batches + raft logs + fsync in {:?}",
            per_group.len(),
            started.elapsed()
        );
    }

    let kv: Arc<dyn Kv> = Arc::new(SledKv::open(dir.path(), 64 << 20)?);
    let meta = MetaStore::new(kv.clone());
    let raft_logs = Arc::new(RaftLogStore::open(kv)?);
    let mut found = 0;
    for key in &keys {
        found += usize::from(meta.get(hash_slot(key), key)?.is_some());
    }
    for group in per_group.keys() {
        assert_eq!(meta.applied_index(*group)?, 1);
        assert_eq!(raft_logs.group(*group)?.last_index()?, 1);
    }
    println!("reopened: {found}/{USERS} users and {} raft logs recovered", raft_logs.groups().len());
    if found != USERS {
        return Err("lost metadata across reopen".into());
    }
    println!("ok");
    Ok(())
}
