//! The usual alternative, for comparison: one raft-rs group per channel. Three nodes in one process,
//! each a `MultiRaft` (raft-rs `RawNode`s, persist before send, one fsync per node per round covering
//! every group) on its own sled with a real fsync — the same storage and in-process delivery tidings
//! runs on. Each message is one proposal of 128 payload bytes to its channel's group; it counts when its
//! leader reports it committed and applied. Driven in rounds on one thread (every node handles what it
//! received, syncs once, sends); no ticks run while measuring, so the baseline pays no heartbeats there.

use super::{figures, Figures, RECORD_BYTES};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tidings::router::HashToSlot;
use tidings::slot::command::Command;
use tidings::slot::model::{Uid, User};
use tidings::slot::raft::{MultiRaft, MultiRaftConfig, ProposalId, SlotEffect, SlotMessage};
use tidings::store::{Kv, MetaStore, RaftLogStore, SledKv};
use tidings::types::{GroupId, NodeId, Time};

pub struct RaftPerChannel {
    nodes: Vec<(MultiRaft, Arc<dyn Kv>)>,
    groups: u32,
    now: Time,
    inbox: Vec<Vec<(NodeId, SlotMessage)>>,
    syncs: Vec<Vec<u64>>,
    done: Vec<(usize, ProposalId)>,
    leaders: BTreeMap<GroupId, usize>,
}

impl RaftPerChannel {
    /// Three nodes with `groups` raft groups each (one per channel), leaders elected.
    pub fn start(root: &std::path::Path, groups: u32) -> RaftPerChannel {
        let members: Vec<NodeId> = (1..=3).map(NodeId::new).collect();
        let all: Vec<(GroupId, Vec<NodeId>)> = (1..=groups).map(|g| (GroupId::new(g), members.clone())).collect();
        // The hash-slot table is irrelevant here: proposals name their group.
        let table = HashToSlot::even_split(1).expect("one group");
        let nodes = members
            .iter()
            .map(|id| {
                let kv: Arc<dyn Kv> =
                    Arc::new(SledKv::open(root.join(format!("raft-{groups}-{id}")), 64 << 20).expect("sled"));
                let logs = Arc::new(RaftLogStore::open(kv.clone()).expect("raft log"));
                let mut config = MultiRaftConfig::new(*id);
                config.compact_after_entries = 100_000;
                let meta = MetaStore::new(kv.clone());
                let driver = MultiRaft::open(config, logs, meta, table.clone(), &all, Time::ZERO).expect("open");
                (driver, kv)
            })
            .collect();
        let mut baseline = RaftPerChannel {
            nodes,
            groups,
            now: Time::ZERO,
            inbox: vec![Vec::new(); 3],
            syncs: vec![Vec::new(); 3],
            done: Vec::new(),
            leaders: BTreeMap::new(),
        };
        for _ in 0..2_000 {
            baseline.now = baseline.now + Duration::from_millis(100);
            for (driver, _) in baseline.nodes.iter_mut() {
                driver.handle_tick(baseline.now);
            }
            baseline.round();
            baseline.round();
            baseline.leaders = (1..=groups)
                .filter_map(|g| {
                    let g = GroupId::new(g);
                    baseline.nodes.iter().position(|(d, _)| d.is_leader(g)).map(|i| (g, i))
                })
                .collect();
            if baseline.leaders.len() == groups as usize {
                break;
            }
        }
        assert_eq!(baseline.leaders.len(), groups as usize, "every group elected a leader");
        baseline
    }

    /// One round: every node handles its inbox, syncs once if asked, and emits.
    fn round(&mut self) {
        for i in 0..self.nodes.len() {
            let inbox = std::mem::take(&mut self.inbox[i]);
            let (driver, kv) = &mut self.nodes[i];
            for (from, message) in inbox {
                driver.handle_message(self.now, from, message);
            }
            let tokens = std::mem::take(&mut self.syncs[i]);
            if let Some(last) = tokens.last() {
                kv.sync().expect("sync");
                driver.handle_synced(self.now, *last);
            }
            while let Some(effect) = driver.poll_effect() {
                match effect {
                    SlotEffect::Send { to, message } => {
                        let target = usize::try_from(to.get() - 1).expect("small");
                        self.inbox[target].push((NodeId::new(i as u64 + 1), message));
                    }
                    SlotEffect::Sync { token } => self.syncs[i].push(token),
                    SlotEffect::ProposalDone { id, result } if result.is_ok() => self.done.push((i, id)),
                    _ => {}
                }
            }
        }
    }

    /// `messages` appends round-robin over the channels, at most `in_flight` outstanding; rate and
    /// propose-to-commit latency.
    pub fn run(&mut self, messages: usize, in_flight: usize) -> Figures {
        let name = "x".repeat(RECORD_BYTES);
        let uid = Uid::new("baseline").expect("uid");
        let mut pending: BTreeMap<(usize, ProposalId), Instant> = BTreeMap::new();
        let mut latencies = Vec::with_capacity(messages);
        let mut next = 0usize;
        let started = Instant::now();
        while latencies.len() < messages {
            while pending.len() < in_flight && next < messages {
                let group = GroupId::new(1 + u32::try_from(next % self.groups as usize).expect("fits"));
                let node = self.leaders[&group];
                let command = Command::PutUser(User { uid: uid.clone(), name: name.clone(), banned: false });
                match self.nodes[node].0.propose_in(self.now, group, &command) {
                    Ok(id) => {
                        pending.insert((node, id), Instant::now());
                        next += 1;
                    }
                    Err(_) => break, // the group's queue is full: drive a round first
                }
            }
            self.round();
            for key in self.done.drain(..) {
                if let Some(at) = pending.remove(&key) {
                    latencies.push(at.elapsed());
                }
            }
        }
        figures(latencies.len(), started.elapsed(), latencies)
    }
}
