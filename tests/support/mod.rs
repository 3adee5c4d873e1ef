//! A cluster of `NodeCore`s on virtual time in one thread, shared by the integration tests: memory
//! stores with their crash model, a FIFO network that can cut nodes off, and crash/restart.

#![allow(dead_code)] // Each test file uses part of it.

use bytes::Bytes;
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;
use tidings::channel::machine::AppendRecord;
use tidings::frame::FrameError;
use tidings::node::{
    carry_out_fanout, ApiId, ApiResult, FanoutHost, Lookup, NoFanout, NodeConfig, NodeCore, NodeEffect, NodeError,
    TaskReport,
};
use tidings::router::Router;
use tidings::slot::command::Command;
use tidings::slot::model::{ChannelFlags, ChannelInfo, SwitchProof};
use tidings::store::message::{LogLimits, MemoryLog, MessageLog, ReadLimits, Record};
use tidings::store::{Kv, MemoryKv, MetaStore, RaftLogStore};
use tidings::types::{ChannelId, ChannelRuntimeMeta, GroupId, NodeId, Seq, Time, WriteFence};

/// One node: its core while it runs, and its stores, which outlive crashes.
pub struct SimNode {
    pub core: Option<NodeCore>,
    pub kv: Arc<MemoryKv>,
    pub log: Arc<MemoryLog>,
    pub config: NodeConfig,
    boots: u64,
}

/// Which frames (sender, receiver, bytes) a [`Cluster`] loses.
pub type LoseIf = dyn FnMut(NodeId, NodeId, &Bytes) -> bool;

pub struct Cluster {
    pub now: Time,
    pub nodes: BTreeMap<NodeId, SimNode>,
    queue: VecDeque<(NodeId, NodeId, Bytes)>,
    /// Nodes cut off from everyone (frames to and from them are dropped).
    pub cut: BTreeSet<NodeId>,
    /// Results other than successful appends and tasks, as their debug text.
    pub results: BTreeMap<ApiId, String>,
    pub appended: BTreeMap<ApiId, Vec<Seq>>,
    pub tasks: BTreeMap<ApiId, Result<TaskReport, NodeError>>,
    /// The first `capture_max` frames sent (sender, receiver, bytes), for tests that replay or mutate them.
    pub captured: Vec<(NodeId, NodeId, Bytes)>,
    pub capture_max: usize,
    /// Presence and delivery for every node's fanout (default: nobody online).
    pub fanout_host: Arc<dyn FanoutHost>,
    /// The storage reads nodes hand off their shards (activations' loads, sender checks) are held in
    /// `held_reads` instead of carried out (see `release_reads`).
    pub hold_reads: bool,
    pub held_reads: Vec<(NodeId, Lookup)>,
    /// Frames (sender, receiver, bytes) for which it answers `true` are lost, as a lossy network would.
    pub lose_if: Option<Box<LoseIf>>,
    next_api: u64,
}

impl Cluster {
    pub fn new(n: u64) -> Self {
        Self::with(n, |_| {})
    }

    pub fn with(n: u64, tweak: impl Fn(&mut NodeConfig)) -> Self {
        let ids: Vec<NodeId> = (1..=n).map(NodeId::new).collect();
        let mut cluster = Cluster {
            now: Time::ZERO,
            nodes: BTreeMap::new(),
            queue: VecDeque::new(),
            cut: BTreeSet::new(),
            results: BTreeMap::new(),
            appended: BTreeMap::new(),
            tasks: BTreeMap::new(),
            captured: Vec::new(),
            capture_max: 0,
            fanout_host: Arc::new(NoFanout),
            hold_reads: false,
            held_reads: Vec::new(),
            lose_if: None,
            next_api: 1,
        };
        for id in &ids {
            let mut config = NodeConfig { slot_groups: 4, ..NodeConfig::new(*id, ids.clone()) };
            tweak(&mut config);
            cluster.add_node(config);
        }
        cluster
    }

    fn boot(&mut self, id: NodeId) {
        let now = self.now;
        let node = self.nodes.get_mut(&id).unwrap();
        node.boots += 1;
        node.config.boot_id = node.boots;
        let kv: Arc<dyn Kv> = node.kv.clone();
        let logs = Arc::new(RaftLogStore::open(kv.clone()).unwrap());
        let router = Arc::new(Router::new(node.config.table()));
        let log: Arc<dyn MessageLog> = node.log.clone();
        node.core = Some(NodeCore::new(node.config.clone(), logs, MetaStore::new(kv), log, router, now).unwrap());
    }

    /// Adds a node to the cluster, on empty stores, and starts it with `config` (its own id): at the
    /// cluster's creation, or later as a node joining it.
    pub fn add_node(&mut self, config: NodeConfig) {
        let id = config.node;
        let node = SimNode {
            core: None,
            kv: Arc::new(MemoryKv::new()),
            log: Arc::new(MemoryLog::new(LogLimits::default())),
            config,
            boots: 0,
        };
        assert!(self.nodes.insert(id, node).is_none(), "{id} is in the cluster already");
        self.boot(id);
    }

    /// Stops `id` and starts it again from its stores with its configuration changed by `change`, as an
    /// operator's rolling restart does.
    pub fn restart_with(&mut self, id: u64, change: impl FnOnce(&mut NodeConfig)) {
        self.crash(id);
        change(&mut self.nodes.get_mut(&NodeId::new(id)).unwrap().config);
        self.restart(id);
    }

    /// Stops `id` as a crash: what it had not made durable is lost; frames to it are dropped.
    pub fn crash(&mut self, id: u64) {
        let node = self.nodes.get_mut(&NodeId::new(id)).unwrap();
        node.core = None;
        node.kv.crash();
        node.log.crash();
    }

    /// Starts a crashed node again from its stores.
    pub fn restart(&mut self, id: u64) {
        self.boot(NodeId::new(id));
    }

    /// Starts a crashed node again on empty stores, as on a new disk.
    #[allow(dead_code)] // Not every test binary uses every helper.
    pub fn restart_empty(&mut self, id: u64) {
        let node = self.nodes.get_mut(&NodeId::new(id)).unwrap();
        node.kv = Arc::new(MemoryKv::new());
        node.log = Arc::new(MemoryLog::new(LogLimits::default()));
        self.boot(NodeId::new(id));
    }

    /// Carries out the reads held so far (the nodes that asked for them take the answers) and stops
    /// holding new ones.
    pub fn release_reads(&mut self) {
        self.hold_reads = false;
        let now = self.now;
        for (id, lookup) in std::mem::take(&mut self.held_reads) {
            let node = self.nodes.get_mut(&id).unwrap();
            if let Some(core) = node.core.as_mut() {
                let answer = lookup.carry_out(node.log.as_ref(), core.reader());
                core.handle_lookup(now, answer);
            }
        }
        self.settle();
    }

    pub fn api(&mut self) -> ApiId {
        self.next_api += 1;
        ApiId(self.next_api)
    }

    /// Carries out every effect of every running node until quiet.
    pub fn settle(&mut self) {
        for _ in 0..10_000 {
            let mut progressed = false;
            let ids: Vec<NodeId> = self.nodes.keys().copied().collect();
            for id in ids {
                loop {
                    let node = self.nodes.get_mut(&id).unwrap();
                    let (kv, log) = (node.kv.clone(), node.log.clone());
                    let Some(core) = node.core.as_mut() else { break };
                    let Some(effect) = core.poll_effect() else { break };
                    progressed = true;
                    match effect {
                        NodeEffect::Send { to, frame } => {
                            if self.captured.len() < self.capture_max {
                                self.captured.push((id, to, frame.clone()));
                            }
                            self.queue.push_back((id, to, frame));
                        }
                        NodeEffect::SyncSlots { token } => {
                            kv.sync().unwrap();
                            core.handle_slots_synced(self.now, token);
                        }
                        NodeEffect::Persist { token, batch } => {
                            let channel = batch.channel.clone();
                            let result = log.commit(batch);
                            core.handle_persisted(self.now, &channel, token, result);
                        }
                        NodeEffect::Read { channel, token, from, through, max_bytes } => {
                            let limits = ReadLimits { records_max: usize::MAX, bytes_max: max_bytes };
                            let result = log.read(&channel, from, through, limits);
                            core.handle_read(self.now, &channel, token, result);
                        }
                        NodeEffect::Lookup(lookup) if self.hold_reads => self.held_reads.push((id, lookup)),
                        NodeEffect::Lookup(lookup) => {
                            let answer = lookup.carry_out(log.as_ref(), core.reader());
                            core.handle_lookup(self.now, answer);
                        }
                        NodeEffect::ListLogs(page) => {
                            let listed = page.carry_out(log.as_ref(), core.reader());
                            core.handle_logs_listed(self.now, listed);
                        }
                        NodeEffect::Fanout(work) => {
                            if let Some(answer) = carry_out_fanout(core.reader(), self.fanout_host.as_ref(), work) {
                                core.handle_fanout(self.now, answer);
                            }
                        }
                        NodeEffect::Done { id: api, result } => match result {
                            ApiResult::Appended(Ok(seqs)) => {
                                self.appended.insert(api, seqs);
                            }
                            ApiResult::Task(result) => {
                                self.tasks.insert(api, result);
                            }
                            other => {
                                self.results.insert(api, format!("{other:?}"));
                            }
                        },
                    }
                }
            }
            while let Some((from, to, frame)) = self.queue.pop_front() {
                progressed = true;
                if self.cut.contains(&from) || self.cut.contains(&to) {
                    continue;
                }
                if self.lose_if.as_mut().is_some_and(|lose| lose(from, to, &frame)) {
                    continue;
                }
                let now = self.now;
                // A frame to a node outside the cluster goes nowhere, as with a real transport.
                if let Some(core) = self.nodes.get_mut(&to).and_then(|n| n.core.as_mut()) {
                    // Every frame a node sends is valid; only a node back on a new disk is refused, and
                    // frames meant for an earlier start of their receiver (in flight across its restart),
                    // or forwards sent before their sender heard from its start.
                    match core.handle_frame(now, from, &frame) {
                        Ok(())
                        | Err(
                            FrameError::StorageChanged { .. }
                            | FrameError::EarlierStart { .. }
                            | FrameError::UnaddressedForward { .. },
                        ) => {}
                        Err(error) => panic!("{from} -> {to}: {error}"),
                    }
                }
            }
            if !progressed {
                return;
            }
        }
    }

    pub fn run_for(&mut self, ms: u64) {
        let end = self.now + Duration::from_millis(ms);
        while self.now < end {
            self.settle();
            let next = self.running().map(|c| c.poll_timeout()).min().unwrap_or(end).min(end);
            self.now = self.now.max(next);
            let now = self.now;
            for core in self.nodes.values_mut().filter_map(|n| n.core.as_mut()) {
                if core.poll_timeout() <= now {
                    core.handle_tick(now);
                }
            }
        }
        self.settle();
    }

    /// Runs until `done` holds, at most `ms` milliseconds; returns whether it held.
    pub fn run_until(&mut self, ms: u64, mut done: impl FnMut(&mut Cluster) -> bool) -> bool {
        let end = self.now + Duration::from_millis(ms);
        while self.now < end {
            if done(self) {
                return true;
            }
            self.run_for(10);
        }
        done(self)
    }

    fn running(&self) -> impl Iterator<Item = &NodeCore> {
        self.nodes.values().filter_map(|n| n.core.as_ref())
    }

    pub fn core(&mut self, id: u64) -> &mut NodeCore {
        self.nodes.get_mut(&NodeId::new(id)).unwrap().core.as_mut().expect("node runs")
    }

    /// The running node that leads slot group `group`, if any.
    pub fn slot_leader(&self, group: GroupId) -> Option<u64> {
        self.running().find(|c| c.slot().is_leader(group)).map(|c| c.status().node.get())
    }

    /// Runs an API call on node `via` and returns its result (it must answer within 10 s).
    pub fn call(&mut self, via: u64, op: impl FnOnce(&mut NodeCore, Time, ApiId)) -> String {
        let id = self.api();
        let now = self.now;
        op(self.core(via), now, id);
        assert!(self.run_until(10_000, |c| c.results.contains_key(&id)), "no answer");
        self.results[&id].clone()
    }

    /// Creates `channel` through node `via` and waits for it.
    pub fn create_channel(&mut self, via: u64, channel: &ChannelId) {
        let create = self.api();
        let now = self.now;
        self.core(via).create_channel(
            now,
            create,
            ChannelInfo { channel: channel.clone(), flags: ChannelFlags::default() },
        );
        self.run_for(2_000);
        assert_eq!(self.results.get(&create).map(String::as_str), Some("Meta(Ok(()))"));
    }

    /// Starts an append of `payloads` through node `via`; the result lands in `appended` or `results`.
    pub fn append(&mut self, via: u64, channel: &ChannelId, payloads: &[&str]) -> ApiId {
        let id = self.api();
        let now = self.now;
        self.core(via).append(now, id, channel.clone(), records(payloads));
        id
    }
}

/// Appends `count` messages one by one through `via`, each retried until acknowledged; returns their seqs.
pub fn append_acked(
    cluster: &mut Cluster,
    via: u64,
    channel: &ChannelId,
    tag: &str,
    count: usize,
) -> Vec<(Seq, String)> {
    let mut acked = Vec::new();
    for i in 0..count {
        let text = format!("{tag}-{i}");
        let seq = 'retry: {
            for _ in 0..50 {
                let id = cluster.append(via, channel, &[&text]);
                cluster.run_for(300);
                if let Some(seqs) = cluster.appended.get(&id) {
                    break 'retry seqs[0];
                }
                cluster.run_for(200);
            }
            panic!("{text} never acknowledged: {:?}", cluster.results);
        };
        acked.push((seq, text));
    }
    acked
}

/// Every committed message of `channel` on `core`, read page by page (a read returns at most
/// `read_records_max` records).
pub fn read_all(core: &mut NodeCore, channel: &ChannelId) -> Result<Vec<Record>, NodeError> {
    let (mut all, mut from) = (Vec::new(), Seq::new(1));
    loop {
        let page = core.read(channel, from, usize::MAX)?;
        let Some(last) = page.last() else { return Ok(all) };
        from = last.seq.next();
        all.extend(page);
    }
}

pub fn records(payloads: &[&str]) -> Vec<AppendRecord> {
    payloads.iter().map(|p| AppendRecord { idempotency_key: None, payload: Bytes::from(p.to_string()) }).collect()
}

/// Hands node `to` a `message` from node `from` as the transport would, whatever the network's cuts
/// (for tests that forge a message or deliver one to a node cut off from the rest).
pub fn deliver(cluster: &mut Cluster, from: u64, to: u64, message: tidings::node::NodeMessage) {
    let frame = tidings::frame::encode(&tidings::frame::Frame {
        cluster: 1,
        from: NodeId::new(from),
        storage: cluster.core(from).storage_id(),
        start: cluster.core(from).start_id(),
        to_start: cluster.core(to).start_id(),
        body: tidings::frame::FrameBody::Node(message),
    });
    let now = cluster.now;
    cluster.core(to).handle_frame(now, NodeId::new(from), &frame).unwrap();
}

/// Writes `next` over `current` through node `via` (a compare-and-set of the runtime meta), as a
/// controller would: for tests that leave the state a vanished controller leaves.
pub fn force_meta(
    cluster: &mut Cluster,
    via: u64,
    current: &ChannelRuntimeMeta,
    next: ChannelRuntimeMeta,
    proof: Option<SwitchProof>,
) {
    let id = cluster.api();
    let now = cluster.now;
    let command = Command::CasRuntimeMeta { expected_version: current.version, meta: next, proof };
    cluster.core(via).propose(now, id, command);
    cluster.run_for(500);
    assert_eq!(cluster.results.get(&id).map(String::as_str), Some("Meta(Ok(()))"));
}

/// `meta` fenced by channel task `task` (`freeze`: replication frozen, as a failover fences).
pub fn with_fence(meta: &ChannelRuntimeMeta, task: u64, freeze: bool) -> ChannelRuntimeMeta {
    let mut next = meta.clone();
    next.version += 1;
    next.write_fence = Some(WriteFence { task, since_version: next.version, freeze_replication: freeze });
    next
}
