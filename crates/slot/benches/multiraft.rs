//! Committed metadata commands per second through a 3-node multi-raft of 8 groups in one process, with the
//! in-memory backend and with sled (real fsync per sync round). Messages are delivered and syncs completed
//! in rounds; each iteration proposes a burst of commands spread over the groups and drives the cluster
//! until all of them are applied on their leaders. Propose-to-apply latency is printed in rounds (one round
//! = every node handles what it received and syncs once).

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use tidings_router::HashToSlot;
use tidings_slot::command::Command;
use tidings_slot::model::{Uid, User};
use tidings_slot::raft::{MultiRaft, MultiRaftConfig, ProposalId, SlotEffect, SlotMessage};
use tidings_store::{Kv, MemoryKv, MetaStore, RaftLogStore, SledKv};
use tidings_types::{GroupId, NodeId, Time};

// jemalloc, as a host running a busy node would: under glibc's allocator a third of the time went to
// malloc and free (perf), which says more about glibc than about this code.
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

const NODES: u64 = 3;
const GROUPS: u32 = 8;
const BURST: usize = 2_000;

struct Bench {
    nodes: Vec<(MultiRaft, Arc<dyn Kv>)>,
    now: Time,
    inbox: Vec<Vec<(NodeId, SlotMessage)>>,
    syncs: Vec<Vec<u64>>,
    done: BTreeMap<(usize, ProposalId), u64>,
    round: u64,
    next_user: u64,
    _dirs: Vec<tempfile::TempDir>,
}

impl Bench {
    fn new(sled: bool) -> Self {
        let table = HashToSlot::even_split(GROUPS).unwrap();
        let members: Vec<NodeId> = (1..=NODES).map(NodeId::new).collect();
        let groups: Vec<(GroupId, Vec<NodeId>)> = table.groups().map(|g| (g, members.clone())).collect();
        let mut nodes = Vec::new();
        let mut dirs = Vec::new();
        for id in &members {
            let kv: Arc<dyn Kv> = if sled {
                let dir = tempfile::tempdir().unwrap();
                let kv = Arc::new(SledKv::open(dir.path(), 64 << 20).unwrap());
                dirs.push(dir);
                kv
            } else {
                Arc::new(MemoryKv::new())
            };
            let logs = Arc::new(RaftLogStore::open(kv.clone()).unwrap());
            let mut config = MultiRaftConfig::new(*id);
            config.pending_proposals_max = BURST;
            config.compact_after_entries = 50_000;
            let driver =
                MultiRaft::open(config, logs, MetaStore::new(kv.clone()), table.clone(), &groups, Time::ZERO).unwrap();
            nodes.push((driver, kv));
        }
        let n = nodes.len();
        let mut bench = Bench {
            nodes,
            now: Time::ZERO,
            inbox: vec![Vec::new(); n],
            syncs: vec![Vec::new(); n],
            done: BTreeMap::new(),
            round: 0,
            next_user: 0,
            _dirs: dirs,
        };
        // Elect leaders.
        for _ in 0..400 {
            bench.now = bench.now + Duration::from_millis(100);
            for (driver, _) in bench.nodes.iter_mut() {
                driver.handle_tick(bench.now);
            }
            bench.round();
            let leaders =
                (1..=GROUPS).filter(|g| bench.nodes.iter().any(|(d, _)| d.is_leader(GroupId::new(*g)))).count();
            if leaders == GROUPS as usize {
                break;
            }
        }
        bench
    }

    /// One round: every node handles its inbox, syncs once, and emits.
    fn round(&mut self) {
        self.round += 1;
        for i in 0..self.nodes.len() {
            let inbox = std::mem::take(&mut self.inbox[i]);
            let (driver, kv) = &mut self.nodes[i];
            for (from, message) in inbox {
                driver.handle_message(self.now, from, message);
            }
            for token in std::mem::take(&mut self.syncs[i]) {
                kv.sync().unwrap();
                driver.handle_synced(self.now, token);
            }
            while let Some(effect) = driver.poll_effect() {
                match effect {
                    SlotEffect::Send { to, message } => {
                        let target = usize::try_from(to.get() - 1).unwrap();
                        self.inbox[target].push((NodeId::new(i as u64 + 1), message));
                    }
                    SlotEffect::Sync { token } => self.syncs[i].push(token),
                    SlotEffect::ProposalDone { id, result } => {
                        assert!(result.is_ok());
                        self.done.insert((i, id), self.round);
                    }
                    _ => {}
                }
            }
        }
    }

    /// Proposes a burst on the leaders and drives until every proposal is applied; returns latencies.
    fn burst(&mut self) -> Vec<u64> {
        self.done.clear();
        let mut proposed = Vec::new();
        for _ in 0..BURST {
            self.next_user += 1;
            let user =
                User { uid: Uid::new(format!("user-{}", self.next_user)).unwrap(), name: "n".into(), banned: false };
            let command = Command::PutUser(user);
            let group = command.group_under(&self.nodes[0].0.table());
            let leader = self.nodes.iter().position(|(d, _)| d.is_leader(group)).unwrap();
            let id = self.nodes[leader].0.propose(self.now, &command).unwrap();
            proposed.push(((leader, id), self.round));
        }
        while self.done.len() < proposed.len() {
            self.round();
        }
        proposed.iter().map(|(key, at)| self.done[key] - at).collect()
    }
}

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("multiraft_3_nodes_8_groups");
    group.throughput(Throughput::Elements(BURST as u64));
    group.sample_size(10);
    for (name, sled) in [("memory", false), ("sled", true)] {
        let mut bench = Bench::new(sled);
        let mut latencies = Vec::new();
        group.bench_function(format!("{name}: burst of {BURST} commands"), |b| {
            b.iter(|| latencies.extend(bench.burst()))
        });
        latencies.sort_unstable();
        if !latencies.is_empty() {
            let p = |q: usize| latencies[(latencies.len() - 1) * q / 100];
            eprintln!("{name}: propose-to-apply latency in rounds p50 {} p99 {}", p(50), p(99));
        }
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
