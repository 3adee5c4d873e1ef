//! The simulated cluster: every node's real `NodeCore` on in-memory stores, a seeded network and disk,
//! faults, a client workload, and the checks. One thread, virtual time in 1 ms steps.

use crate::oracle::Oracle;
use crate::params::SimParams;
use bytes::Bytes;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;
use tidings::channel::machine::AppendRecord;
use tidings::node::{carry_out_fanout, ApiId, ApiResult, NoFanout, NodeConfig, NodeCore, NodeEffect};
use tidings::router::Router;
use tidings::slot::command::{Command, MemberList, RoutingKey};
use tidings::slot::model::{ChannelFlags, ChannelInfo};
use tidings::slot::model::{SlotState, Uid, User};
use tidings::store::message::{
    IdempotencyKey, LogBatch, LogFailOp, LogLimits, MemoryLog, MessageLog, ReadLimits, Record,
};
use tidings::store::{Kv, MemoryKv, MetaStore, RaftLogStore};
use tidings::types::{ChannelId, ChannelType, DetRng, GroupId, HashSlot, NodeId, Seq, Time};

/// What a run did, and what it found.
#[derive(Clone, Debug)]
pub struct SimReport {
    /// The parameters (print them with the seed).
    pub params: SimParams,
    /// Virtual milliseconds simulated.
    pub steps: u64,
    /// Faults injected: frames lost, frames duplicated, crashes, partitions.
    pub faults: Faults,
    /// Appends acknowledged.
    pub acked: usize,
    /// Requests still unanswered at the end.
    pub unanswered: usize,
    /// Hash of every delivered frame and answer: the same seed gives the same hash.
    pub trace_hash: u64,
    /// Invariant violations (empty: the seed passed).
    pub violations: Vec<String>,
}

impl SimReport {
    /// No invariant was violated.
    pub fn passed(&self) -> bool {
        self.violations.is_empty()
    }

    /// The command that replays this seed.
    pub fn replay_command(&self) -> String {
        let metadata = if self.params.metadata_workload { "" } else { " --no-metadata" };
        format!("cargo run --release -p tidings-sim -- --seed {}{metadata}", self.params.seed)
    }
}

/// Fault counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Faults {
    /// Frames lost.
    pub lost: u64,
    /// Frames delivered twice.
    pub duplicated: u64,
    /// Node crashes.
    pub crashes: u64,
    /// One-way partitions.
    pub partitions: u64,
    /// Storage IO errors armed.
    pub io_errors: u64,
    /// Leader transfers asked for.
    pub transfers: u64,
    /// Leader transfers that switched the leader.
    pub transfers_done: u64,
    /// Slot-group replica moves (and aborts) asked for.
    pub slot_moves: u64,
    /// Slot-group replica moves (and aborts) the group accepted.
    pub slot_moves_accepted: u64,
    /// Slot groups whose membership changed during the run (configuration epoch above 0 at the end).
    pub slot_groups_reconfigured: u64,
    /// Node drains started or stopped.
    pub drains: u64,
    /// Hash-slot migrations (and aborts) asked for.
    pub slot_migrations: u64,
    /// Hash-slot migrations completed during the run (slots whose owner changed).
    pub slots_migrated: u64,
}

impl std::ops::AddAssign for Faults {
    fn add_assign(&mut self, other: Faults) {
        self.lost += other.lost;
        self.duplicated += other.duplicated;
        self.crashes += other.crashes;
        self.partitions += other.partitions;
        self.io_errors += other.io_errors;
        self.transfers += other.transfers;
        self.transfers_done += other.transfers_done;
        self.slot_moves += other.slot_moves;
        self.slot_moves_accepted += other.slot_moves_accepted;
        self.slot_groups_reconfigured += other.slot_groups_reconfigured;
        self.drains += other.drains;
        self.slot_migrations += other.slot_migrations;
        self.slots_migrated += other.slots_migrated;
    }
}

enum Event {
    Frame {
        from: NodeId,
        to: NodeId,
        bytes: Bytes,
    },
    SlotsSynced {
        node: NodeId,
        incarnation: u64,
        token: u64,
    },
    Persisted {
        node: NodeId,
        incarnation: u64,
        token: tidings::channel::machine::PersistToken,
        batch: LogBatch,
    },
    ReadDone {
        node: NodeId,
        incarnation: u64,
        channel: ChannelId,
        token: tidings::channel::machine::ReadToken,
        from: Seq,
        through: Seq,
        max_bytes: usize,
    },
    Restart {
        node: NodeId,
    },
}

struct SimNode {
    config: NodeConfig,
    kv: Arc<MemoryKv>,
    log: Arc<MemoryLog>,
    core: Option<NodeCore>,
    /// Bumped at every crash: completions of an older incarnation are dropped (the work died with it).
    incarnation: u64,
}

/// One simulated cluster.
pub struct World {
    params: SimParams,
    rng: DetRng,
    now: Time,
    nodes: BTreeMap<NodeId, SimNode>,
    events: BTreeMap<(Time, u64), Event>,
    next_event: u64,
    /// One-way partitions: (from, to) → heals at.
    cut: BTreeMap<(NodeId, NodeId), Time>,
    faulty: bool,
    /// The client workload runs (off while the liveness phase drains).
    requests_on: bool,
    channels: Vec<ChannelId>,
    oracle: Oracle,
    faults: Faults,
    trace: u64,
    next_api: u64,
    /// Last HW seen per (node, channel) since the node's last crash.
    hw_seen: BTreeMap<(NodeId, ChannelId), Seq>,
    /// Storage failures each node reported when its HWs were last seen.
    storage_failures_seen: BTreeMap<NodeId, u64>,
    /// Liveness probes in flight: request → channel.
    probes: BTreeMap<ApiId, ChannelId>,
    /// Channels that acknowledged a probe after healing.
    probed: BTreeSet<ChannelId>,
    /// Metadata writes in flight: request → the user written.
    user_writes: BTreeMap<ApiId, Uid>,
    /// Users whose write was acknowledged, by slot group.
    /// Acknowledged user writes, by the hash slot of the uid.
    users_acked: BTreeMap<HashSlot, Vec<Uid>>,
    /// Authoritative reads in flight: request → the users acknowledged in its group before it was issued.
    barriers: BTreeMap<ApiId, Vec<Uid>>,
    /// Slot-group replica moves and aborts asked for, waiting for their answer.
    slot_moves: BTreeSet<ApiId>,
}

impl World {
    /// A cluster for `params`, not started.
    pub fn new(params: SimParams) -> World {
        let ids: Vec<NodeId> = (1..=params.nodes).map(NodeId::new).collect();
        let mut nodes = BTreeMap::new();
        for id in &ids {
            let mut config = NodeConfig::new(*id, ids.clone());
            config.slot_groups = params.slot_groups;
            config.channel_replicas = params.channel_replicas;
            config.channel_min_isr = params.min_isr;
            config.seed = params.seed;
            config.fanout_enabled = false;
            config.reactors = params.reactors;
            config.machine.hw_notify_delay = std::time::Duration::from_millis(params.hw_notify_delay_ms);
            if params.idle_evict_ms > 0 {
                config.channel_idle_evict = std::time::Duration::from_millis(params.idle_evict_ms);
            }
            let kv = Arc::new(MemoryKv::new());
            let log = Arc::new(MemoryLog::new(LogLimits::default()));
            nodes.insert(*id, SimNode { config, kv, log, core: None, incarnation: 0 });
        }
        let channels = (0..params.channels)
            .map(|i| ChannelId::new(ChannelType::GROUP, &format!("sim-{i}")).expect("valid channel id"))
            .collect();
        World {
            rng: DetRng::new(params.seed),
            params,
            now: Time::ZERO,
            nodes,
            events: BTreeMap::new(),
            next_event: 0,
            cut: BTreeMap::new(),
            faulty: false,
            requests_on: false,
            channels,
            oracle: Oracle::default(),
            faults: Faults::default(),
            trace: 0xcbf2_9ce4_8422_2325,
            next_api: 1,
            hw_seen: BTreeMap::new(),
            storage_failures_seen: BTreeMap::new(),
            probes: BTreeMap::new(),
            probed: BTreeSet::new(),
            user_writes: BTreeMap::new(),
            slot_moves: BTreeSet::new(),
            users_acked: BTreeMap::new(),
            barriers: BTreeMap::new(),
        }
    }

    /// Runs setup, the safety phase and the liveness phase, then the final checks.
    pub fn run(mut self) -> SimReport {
        let ids: Vec<NodeId> = self.nodes.keys().copied().collect();
        for id in &ids {
            self.boot(*id);
        }
        // Setup, fault-free: elections, then the channels.
        self.run_for(2_000);
        let mut created = BTreeSet::new();
        for _ in 0..20 {
            for channel in self.channels.clone() {
                if created.contains(&channel) {
                    continue;
                }
                let api = self.api();
                let info = ChannelInfo { channel: channel.clone(), flags: ChannelFlags::default() };
                let first = ids[0];
                let now = self.now;
                if let Some(core) = self.nodes.get_mut(&first).and_then(|n| n.core.as_mut()) {
                    core.create_channel(now, api, info);
                }
                self.oracle.expect_create(api, first, channel);
            }
            self.run_for(500);
            created.extend(self.oracle.created());
            if created.len() == self.channels.len() {
                break;
            }
        }
        if created.len() < self.channels.len() {
            self.oracle.violation(format!("setup: only {} of {} channels created", created.len(), self.channels.len()));
        }
        self.run_for(1_000);

        self.faulty = true;
        self.requests_on = true;
        self.run_for(self.params.safety_ms);
        self.faulty = false;
        // Liveness: everything healed, no new client requests; every request must be answered in time
        // (an append commits or times out within the leader's append timeout plus the forward slack),
        // and every channel must take a new append again (the controller fails over channels whose
        // leader crashed or cannot lead, and clears fences).
        self.requests_on = false;
        self.heal();
        let probe_every = 500;
        for _ in 0..self.params.liveness_ms / probe_every {
            self.probe();
            self.run_for(probe_every);
        }
        self.final_checks();
        let steps = self.now.as_millis();
        SimReport {
            acked: self.oracle.acked_count(),
            unanswered: self.oracle.unanswered(),
            params: self.params,
            steps,
            faults: self.faults,
            trace_hash: self.trace,
            violations: self.oracle.into_violations(),
        }
    }

    fn api(&mut self) -> ApiId {
        self.next_api += 1;
        ApiId(self.next_api)
    }

    fn boot(&mut self, id: NodeId) {
        let boot_id = self.rng.next_u64();
        let node = self.nodes.get_mut(&id).expect("known node");
        node.config.boot_id = boot_id;
        let kv: Arc<dyn Kv> = node.kv.clone();
        let logs = Arc::new(RaftLogStore::open(kv.clone()).expect("memory raft log opens"));
        let router = Arc::new(Router::new(node.config.table()));
        let log: Arc<dyn MessageLog> = node.log.clone();
        let core = NodeCore::new(node.config.clone(), logs, MetaStore::new(kv), log, router, self.now)
            .expect("node core starts");
        node.core = Some(core);
    }

    fn crash(&mut self, id: NodeId) {
        let node = self.nodes.get_mut(&id).expect("known node");
        if node.core.take().is_none() {
            return;
        }
        node.incarnation += 1;
        if std::env::var("SIM_DEBUG").is_ok() {
            eprintln!("{:?} crash {id}", self.now);
        }
        node.kv.crash();
        node.log.crash();
        self.hw_seen.retain(|(n, _), _| *n != id);
        self.faults.crashes += 1;
        self.oracle.node_crashed(id);
        let at = self.now + Duration::from_millis(self.params.restart_ms);
        self.schedule(at, Event::Restart { node: id });
    }

    fn heal(&mut self) {
        self.cut.clear();
        for node in self.nodes.values() {
            node.log.clear_failpoints();
        }
        let down: Vec<NodeId> = self.nodes.iter().filter(|(_, n)| n.core.is_none()).map(|(id, _)| *id).collect();
        for id in down {
            self.boot(id);
        }
    }

    fn schedule(&mut self, at: Time, event: Event) {
        self.next_event += 1;
        self.events.insert((at, self.next_event), event);
    }

    fn mix(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.trace ^= u64::from(*b);
            self.trace = self.trace.wrapping_mul(0x0100_0000_01b3);
        }
    }

    fn run_for(&mut self, ms: u64) {
        for _ in 0..ms {
            self.step();
        }
    }

    /// One virtual millisecond.
    fn step(&mut self) {
        self.now = self.now + Duration::from_millis(1);
        let now = self.now;
        if self.faulty {
            self.inject_faults();
        }
        self.cut.retain(|_, heals| *heals > now);
        while let Some(entry) = self.events.first_entry() {
            if entry.key().0 > now {
                break;
            }
            let event = entry.remove();
            self.deliver(event);
        }
        let ids: Vec<NodeId> = self.nodes.keys().copied().collect();
        for id in &ids {
            if let Some(core) = self.nodes.get_mut(id).and_then(|n| n.core.as_mut()) {
                if core.poll_timeout() <= now {
                    core.handle_tick(now);
                }
            }
        }
        if self.requests_on && self.rng.chance(self.params.request_ppm) {
            self.request();
        }
        for id in &ids {
            self.drain(*id);
        }
        if now.as_millis() % 100 == 0 {
            self.check_hw_monotonic();
        }
    }

    fn inject_faults(&mut self) {
        let ids: Vec<NodeId> = self.nodes.keys().copied().collect();
        if self.rng.chance(self.params.crash_ppm) {
            let id = *self.rng.pick(&ids).expect("nodes");
            self.crash(id);
        }
        if self.rng.chance(self.params.io_error_ppm) {
            let id = *self.rng.pick(&ids).expect("nodes");
            let op = if self.rng.chance(500_000) { LogFailOp::Sync } else { LogFailOp::Read };
            let after = self.rng.below(3);
            self.nodes[&id].log.fail(op, after, 1);
            self.faults.io_errors += 1;
        }
        if ids.len() > 1 && self.rng.chance(self.params.partition_ppm) {
            let from = *self.rng.pick(&ids).expect("nodes");
            let to = *self.rng.pick(&ids).expect("nodes");
            if from != to {
                self.cut.insert((from, to), self.now + Duration::from_millis(self.params.partition_ms));
                self.faults.partitions += 1;
            }
        }
    }

    fn deliver(&mut self, event: Event) {
        let now = self.now;
        match event {
            Event::Frame { from, to, bytes } => {
                if self.cut.contains_key(&(from, to)) {
                    return;
                }
                let Some(core) = self.nodes.get_mut(&to).and_then(|n| n.core.as_mut()) else { return };
                // Every frame a node sends is well formed: a refusal here is a bug.
                if let Err(error) = core.handle_frame(now, from, &bytes) {
                    self.oracle.violation(format!("{to} refused a frame from {from}: {error}"));
                }
                self.mix(&now.as_millis().to_le_bytes());
                self.mix(&bytes);
            }
            Event::SlotsSynced { node, incarnation, token } => {
                let n = self.nodes.get_mut(&node).expect("known node");
                if n.incarnation != incarnation {
                    return;
                }
                n.kv.sync().expect("memory kv syncs");
                if let Some(core) = n.core.as_mut() {
                    core.handle_slots_synced(now, token);
                }
            }
            Event::Persisted { node, incarnation, token, batch } => {
                let lying = self.params.unsafe_lying_disk;
                let n = self.nodes.get_mut(&node).expect("known node");
                if n.incarnation != incarnation {
                    return;
                }
                let channel = batch.channel.clone();
                let result = if lying { Ok(()) } else { n.log.commit(batch) };
                if let Some(core) = n.core.as_mut() {
                    core.handle_persisted(now, &channel, token, result);
                }
            }
            Event::ReadDone { node, incarnation, channel, token, from, through, max_bytes } => {
                let n = self.nodes.get_mut(&node).expect("known node");
                if n.incarnation != incarnation {
                    return;
                }
                let limits = ReadLimits { records_max: usize::MAX, bytes_max: max_bytes };
                let result = n.log.read(&channel, from, through, limits);
                if let Some(core) = n.core.as_mut() {
                    core.handle_read(now, &channel, token, result);
                }
            }
            Event::Restart { node } => {
                if self.nodes[&node].core.is_none() {
                    self.boot(node);
                }
            }
        }
    }

    /// Carries out every effect of node `id`.
    fn drain(&mut self, id: NodeId) {
        loop {
            let now = self.now;
            let Some(node) = self.nodes.get_mut(&id) else { return };
            let incarnation = node.incarnation;
            let Some(core) = node.core.as_mut() else { return };
            let Some(effect) = core.poll_effect() else { return };
            match effect {
                NodeEffect::Send { to, frame } => self.send(id, to, frame),
                NodeEffect::SyncSlots { token } => {
                    let at = now + self.disk_delay();
                    self.schedule(at, Event::SlotsSynced { node: id, incarnation, token });
                }
                NodeEffect::Persist { token, batch } => {
                    let at = now + self.disk_delay();
                    self.schedule(at, Event::Persisted { node: id, incarnation, token, batch });
                }
                NodeEffect::Read { channel, token, from, through, max_bytes } => {
                    let at = now + self.disk_delay();
                    self.schedule(
                        at,
                        Event::ReadDone { node: id, incarnation, channel, token, from, through, max_bytes },
                    );
                }
                // A host without sessions: every member offline.
                NodeEffect::Fanout(work) => {
                    if let Some(answer) = carry_out_fanout(core.reader(), &NoFanout, work) {
                        core.handle_fanout(now, answer);
                    }
                }
                NodeEffect::Done { id: api, result } => {
                    if let Some(uid) = self.user_writes.remove(&api) {
                        if matches!(result, ApiResult::Meta(Ok(()))) {
                            self.users_acked.entry(slot_of_user(&uid)).or_default().push(uid);
                        }
                    }
                    if let Some(expected) = self.barriers.remove(&api) {
                        // A read barrier covers the key's slot (refused while the slot is fenced).
                        if matches!(result, ApiResult::Meta(Ok(()))) {
                            let core = self.nodes[&id].core.as_ref().expect("answered by a live core");
                            for uid in expected {
                                if !matches!(core.reader().user(&uid), Ok(Some(_))) {
                                    let group = core.slot().table().group_of(slot_of_user(&uid));
                                    self.oracle.violation(format!(
                                        "{id}: authoritative read misses acknowledged user {} ({group} here: {:?})",
                                        uid.as_str(),
                                        core.slot().status(group)
                                    ));
                                }
                            }
                        }
                    }
                    if let ApiResult::Task(Ok(_)) = &result {
                        self.faults.transfers_done += 1;
                    }
                    if self.slot_moves.remove(&api) && matches!(result, ApiResult::Meta(Ok(()))) {
                        self.faults.slot_moves_accepted += 1;
                    }
                    if let Some(channel) = self.probes.remove(&api) {
                        if std::env::var("SIM_DEBUG").is_ok() {
                            eprintln!("{now:?} probe of {channel} via {id}: {result:?}");
                        }
                        if matches!(result, ApiResult::Appended(Ok(_))) {
                            self.probed.insert(channel);
                        }
                    }
                    if std::env::var("SIM_DEBUG").is_ok() {
                        if let ApiResult::Appended(Ok(seqs)) = &result {
                            eprintln!("{now:?} {id} acked {api:?} {seqs:?}");
                        }
                    }
                    self.mix(&api.0.to_le_bytes());
                    self.mix(format!("{result:?}").as_bytes());
                    self.oracle.answered(api, result);
                }
            }
        }
    }

    fn disk_delay(&mut self) -> Duration {
        Duration::from_millis(self.rng.range(0, self.params.disk_delay_max_ms))
    }

    fn send(&mut self, from: NodeId, to: NodeId, frame: Bytes) {
        let copies = if !self.faulty {
            1
        } else if self.rng.chance(self.params.loss_ppm) {
            self.faults.lost += 1;
            0
        } else if self.rng.chance(self.params.dup_ppm) {
            self.faults.duplicated += 1;
            2
        } else {
            1
        };
        for _ in 0..copies {
            let delay = if self.faulty { self.rng.range(0, self.params.delay_max_ms) } else { 0 };
            let at = self.now + Duration::from_millis(delay.max(1));
            self.schedule(at, Event::Frame { from, to, bytes: frame.clone() });
        }
    }

    /// One client request: an append (half with an idempotency key), a retry of an earlier keyed
    /// append with the same key and payload, or a read.
    fn request(&mut self) {
        let ids: Vec<NodeId> = self.nodes.keys().copied().collect();
        let node = *self.rng.pick(&ids).expect("nodes");
        let api = self.api();
        let now = self.now;
        let roll = self.rng.below(100);
        if roll < 15 {
            if let Some((channel, key, payload)) = self.oracle.pick_retry(&mut self.rng) {
                let record = AppendRecord { idempotency_key: Some(key.clone()), payload: payload.clone() };
                if let Some(core) = self.nodes.get_mut(&node).and_then(|n| n.core.as_mut()) {
                    core.append(now, api, channel.clone(), vec![record]);
                    self.oracle.expect_append(api, node, channel, payload, Some(key));
                }
                return;
            }
        }
        if roll >= 92 && self.params.metadata_workload {
            // Metadata: write a new user, change a channel's subscribers, or read authoritatively in the
            // group of a user written before.
            let acked: Vec<Uid> = self.users_acked.values().flatten().cloned().collect();
            let Some(core) = self.nodes.get_mut(&node).and_then(|n| n.core.as_mut()) else { return };
            if (94..96).contains(&roll) && !acked.is_empty() {
                // Subscriber changes: add or remove a few known users on a channel.
                let channel =
                    self.channels[usize::try_from(self.rng.below(self.channels.len() as u64)).unwrap_or(0)].clone();
                let count = 1 + self.rng.below(3);
                let uids: Vec<Uid> = (0..count)
                    .map(|_| acked[usize::try_from(self.rng.below(acked.len() as u64)).unwrap_or(0)].clone())
                    .collect();
                let list = MemberList::Subscribers;
                let command = if roll == 94 {
                    Command::AddMembers { channel, list, uids }
                } else {
                    Command::RemoveMembers { channel, list, uids }
                };
                core.propose(now, api, command);
            } else if roll >= 96 || acked.is_empty() {
                let uid = Uid::new(format!("u{}", api.0)).expect("valid uid");
                let user = User { uid: uid.clone(), name: format!("user {}", api.0), banned: false };
                core.propose(now, api, Command::PutUser(user));
                self.user_writes.insert(api, uid);
            } else {
                let uid = acked[usize::try_from(self.rng.below(acked.len() as u64)).unwrap_or(0)].clone();
                core.read_barrier(now, api, RoutingKey::Uid(&uid));
                self.barriers.insert(api, self.users_acked.get(&slot_of_user(&uid)).cloned().unwrap_or_default());
            }
            return;
        }
        let channel = self.channels[usize::try_from(self.rng.below(self.channels.len() as u64)).unwrap_or(0)].clone();
        if roll == 89 && self.params.leader_transfers {
            // A slot group's preferred leader: a random node (the group's leader hands over when it fits).
            let table = self.nodes[&node].config.table();
            let groups: Vec<GroupId> = table.groups().collect();
            let group = *self.rng.pick(&groups).expect("groups");
            let preferred = *self.rng.pick(&ids).expect("nodes");
            if let Some(core) = self.nodes.get_mut(&node).and_then(|n| n.core.as_mut()) {
                core.set_preferred_leader(now, api, group, Some(preferred));
                self.faults.transfers += 1;
            }
            return;
        }
        if roll == 87 && self.params.leader_transfers && self.rng.chance(200_000) {
            // A node is drained (or its drain is stopped): slot and channel replicas move off it.
            let target = *self.rng.pick(&ids).expect("nodes");
            let drain = self.rng.chance(500_000);
            if let Some(core) = self.nodes.get_mut(&node).and_then(|n| n.core.as_mut()) {
                core.drain_node(now, api, target, drain);
                self.faults.drains += 1;
            }
            return;
        }
        if roll == 86 && self.params.leader_transfers && self.rng.chance(300_000) {
            // A hash slot migrates to a random group (refused when it is that group, or migrating), or
            // the migration in progress is aborted.
            let table = self.nodes[&node].config.table();
            let groups: Vec<GroupId> = table.groups().collect();
            let to = *self.rng.pick(&groups).expect("groups");
            let slot = HashSlot::new(u16::try_from(self.rng.below(256)).unwrap_or(0)).expect("below 256");
            let abort = self.rng.chance(250_000);
            if let Some(core) = self.nodes.get_mut(&node).and_then(|n| n.core.as_mut()) {
                if abort {
                    core.abort_slot_migration(now, api, slot);
                } else {
                    core.migrate_slot(now, api, slot, to);
                }
                self.faults.slot_migrations += 1;
            }
            return;
        }
        if roll == 88 && self.params.leader_transfers {
            // A slot group's replica moves from a random node to a random node (the group refuses what
            // does not fit its membership), or the move in progress is aborted.
            let table = self.nodes[&node].config.table();
            let groups: Vec<GroupId> = table.groups().collect();
            let group = *self.rng.pick(&groups).expect("groups");
            let (from, to) = (*self.rng.pick(&ids).expect("nodes"), *self.rng.pick(&ids).expect("nodes"));
            let abort = self.rng.chance(250_000);
            if let Some(core) = self.nodes.get_mut(&node).and_then(|n| n.core.as_mut()) {
                if abort {
                    core.abort_slot_move(now, api, group);
                } else {
                    core.move_slot_replica(now, api, group, from, to);
                }
                self.slot_moves.insert(api);
                self.faults.slot_moves += 1;
            }
            return;
        }
        if (roll == 90 || roll == 91) && self.params.leader_transfers {
            let target = *self.rng.pick(&ids).expect("nodes");
            let from = *self.rng.pick(&ids).expect("nodes");
            if let Some(core) = self.nodes.get_mut(&node).and_then(|n| n.core.as_mut()) {
                if roll == 91 {
                    core.transfer_leader(now, api, channel, target);
                } else {
                    core.replace_replica(now, api, channel, from, target);
                }
                self.faults.transfers += 1;
            }
            return;
        }
        if roll < 30 {
            if let Some(core) = self.nodes.get_mut(&node).and_then(|n| n.core.as_mut()) {
                if let Ok(records) = core.read(&channel, Seq::new(1), 1_000) {
                    self.oracle.check_read(node, &channel, &records);
                }
            }
            return;
        }
        let payload = Bytes::from(format!("{}-{}", self.params.seed, api.0));
        let key = self.rng.chance(500_000).then(|| IdempotencyKey::new(format!("k{}", api.0)).expect("valid key"));
        let record = AppendRecord { idempotency_key: key.clone(), payload: payload.clone() };
        if let Some(core) = self.nodes.get_mut(&node).and_then(|n| n.core.as_mut()) {
            core.append(now, api, channel.clone(), vec![record]);
            self.oracle.expect_append(api, node, channel, payload, key);
        }
    }

    /// After healing, no slot-replica move is left half done: every group's leader shows no move target
    /// in its intent and no joint configuration.
    fn check_moves_settled(&mut self) {
        let table = self.nodes.values().next().expect("nodes").config.table();
        for group in table.groups().collect::<Vec<_>>() {
            let Some(core) = self.nodes.values().filter_map(|n| n.core.as_ref()).find(|c| c.slot().is_leader(group))
            else {
                continue;
            };
            let joint = core.slot().status(group).is_some_and(|s| s.joint);
            let intent = core.reader().group_intent(group).ok().flatten();
            let moving = intent.as_ref().and_then(|i| i.target_peers.clone());
            if joint || moving.is_some() {
                let decision = core.status().leadership.into_iter().find(|(g, _)| *g == group);
                self.oracle.violation(format!(
                    "liveness: {group} still moving after healing (joint {joint}, target {moving:?}, {decision:?})"
                ));
            }
        }
    }

    /// The voters of `group` in force, as its leader has them: replica moves change them, a replica moved
    /// away may linger until it hears it was removed, and a learner a move added late in the healing phase
    /// may still be catching up (neither is a replica the checks compare).
    fn group_members(&self, group: GroupId) -> Vec<NodeId> {
        self.nodes
            .values()
            .filter_map(|n| n.core.as_ref())
            .find(|c| c.slot().is_leader(group))
            .and_then(|c| c.slot().status(group))
            .map(|s| s.voters)
            .unwrap_or_else(|| {
                // No leader to ask: every replica held counts (the checks then stay strict).
                let holding = self
                    .nodes
                    .iter()
                    .filter(|(_, n)| n.core.as_ref().is_some_and(|c| c.slot().groups().any(|g| g == group)));
                holding.map(|(id, _)| *id).collect()
            })
    }

    /// Replicas of a slot group hold identical metadata at the same applied index, and after the
    /// liveness phase every running replica of a group has applied as far as the others.
    fn check_slot_replicas(&mut self) {
        let table = self.nodes.values().next().expect("nodes").config.table();
        for group in table.groups().collect::<Vec<_>>() {
            let reconfigured =
                self.nodes.values().filter_map(|n| n.core.as_ref()).any(|c| {
                    c.slot().is_leader(group) && c.slot().status(group).is_some_and(|s| s.config_epoch.get() > 0)
                });
            self.faults.slot_groups_reconfigured += u64::from(reconfigured);
            let members = self.group_members(group);
            let mut seen: Vec<(NodeId, u64, u64)> = Vec::new();
            for (id, node) in self.nodes.iter().filter(|(id, _)| members.contains(id)) {
                let Some(applied) = node.core.as_ref().and_then(|c| c.slot().applied_index(group)) else { continue };
                let kv: Arc<dyn Kv> = node.kv.clone();
                let store = MetaStore::new(kv);
                let mut digest = 0xcbf2_9ce4_8422_2325u64;
                // Everything the replica holds of the group: its copies of slots and its own records.
                let entries = store.export_group(group, None, usize::MAX).map(|c| c.entries).unwrap_or_default();
                for entry in entries {
                    let space = entry.space.hash_slot().map_or(u16::MAX, |s| s.index());
                    for byte in [&space.to_le_bytes()[..], &entry.key, &entry.value].concat() {
                        digest = (digest ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3);
                    }
                }
                seen.push((*id, applied, digest));
            }
            let Some(&(first, applied, digest)) = seen.first() else { continue };
            for &(id, other_applied, other_digest) in &seen[1..] {
                if other_applied != applied && std::env::var("SIM_DEBUG").is_ok() {
                    for (nid, n) in &self.nodes {
                        let st = n.core.as_ref().and_then(|c| c.slot().status(group));
                        eprintln!("{nid}: {st:?}");
                    }
                }
                if other_applied != applied {
                    self.oracle.violation(format!(
                        "{group}: {first} applied through {applied}, {id} through {other_applied} after healing"
                    ));
                } else if other_digest != digest {
                    self.oracle.violation(format!("{group}: {first} and {id} differ at applied index {applied}"));
                }
            }
        }
    }

    /// One append, through a random node, to every channel that has not acknowledged a probe yet.
    fn probe(&mut self) {
        let waiting: BTreeSet<ChannelId> = self.probes.values().cloned().collect();
        let ids: Vec<NodeId> = self.nodes.keys().copied().collect();
        for channel in self.channels.clone() {
            if self.probed.contains(&channel) || waiting.contains(&channel) {
                continue;
            }
            let node = *self.rng.pick(&ids).expect("nodes");
            let api = self.api();
            let now = self.now;
            let payload = Bytes::from(format!("probe-{}-{}", self.params.seed, api.0));
            let record = AppendRecord { idempotency_key: None, payload: payload.clone() };
            if let Some(core) = self.nodes.get_mut(&node).and_then(|n| n.core.as_mut()) {
                core.append(now, api, channel.clone(), vec![record]);
                self.oracle.expect_append(api, node, channel.clone(), payload, None);
                self.probes.insert(api, channel);
            }
        }
    }

    fn genesis(&self) -> tidings::router::HashToSlot {
        self.nodes.values().next().expect("nodes").config.table()
    }

    /// The group that owns `slot` now: from its genesis owner along the groups' records of where it went
    /// (as their leaders have them).
    fn owner_of(&self, slot: HashSlot) -> GroupId {
        let mut group = self.genesis().group_of(slot);
        for _ in 0..64 {
            let leader = self.nodes.values().filter_map(|n| n.core.as_ref()).find(|c| c.slot().is_leader(group));
            let record = leader.and_then(|c| c.reader().slot_record(group, slot).ok().flatten());
            match record.map(|r| r.state) {
                Some(SlotState::Gone { to }) => group = to,
                _ => return group,
            }
        }
        group
    }

    /// After healing, no hash-slot migration is left half done: no group's leader shows a slot exporting,
    /// fenced or importing (an import whose export was given up is dropped).
    fn check_migrations_settled(&mut self) {
        for group in self.genesis().groups().collect::<Vec<_>>() {
            let Some(core) = self.nodes.values().filter_map(|n| n.core.as_ref()).find(|c| c.slot().is_leader(group))
            else {
                continue;
            };
            let records = core.reader().slot_records(group).unwrap_or_default();
            for (slot, record) in records {
                if matches!(
                    record.state,
                    SlotState::Exporting { .. } | SlotState::Fenced { .. } | SlotState::Importing { .. }
                ) {
                    let driver = core.status().slot_migrations;
                    self.oracle.violation(format!(
                        "liveness: {slot} of {group} still migrating after healing ({record:?}, driver {driver:?})"
                    ));
                }
            }
        }
    }

    fn check_hw_monotonic(&mut self) {
        for (id, node) in &self.nodes {
            let Some(core) = node.core.as_ref() else { continue };
            let status = core.status();
            // A replica rebuilt after a storage failure lost what the failed write held, like a crash of
            // that replica: its HW may go back to what its log holds durably (the rest is on the others).
            if self
                .storage_failures_seen
                .insert(*id, status.storage_failures)
                .is_some_and(|s| s < status.storage_failures)
            {
                self.hw_seen.retain(|(n, _), _| n != id);
            }
            for channel in status.channels {
                let key = (*id, channel.channel.clone());
                if let Some(seen) = self.hw_seen.get(&key) {
                    if channel.hw < *seen {
                        self.oracle.violation(format!(
                            "{id}: HW of {} went back from {seen} to {}",
                            channel.channel, channel.hw
                        ));
                    }
                }
                self.hw_seen.insert(key, channel.hw);
            }
        }
    }

    /// No acknowledged append lost or changed; replicas agree at every seq at or below their HW; every
    /// request answered unless its channel waits for a failover.
    fn final_checks(&mut self) {
        for channel in self.channels.clone() {
            // The replicas the newest meta names (replacements move them).
            let Some(meta) = self
                .nodes
                .values()
                .filter_map(|n| n.core.as_ref()?.reader().runtime_meta(&channel).ok().flatten())
                .max_by_key(|m| m.version)
            else {
                self.oracle.violation(format!("{channel}: no node stores its meta"));
                continue;
            };
            let replicas = meta.replicas;
            let mut logs: Vec<(NodeId, Seq, Vec<Record>)> = Vec::new();
            for id in &replicas {
                let node = &self.nodes[id];
                let hw = node
                    .core
                    .as_ref()
                    .and_then(|c| c.status().channels.into_iter().find(|s| s.channel == channel))
                    .map_or(Seq::new(0), |s| s.hw);
                let limits = ReadLimits { records_max: usize::MAX, bytes_max: usize::MAX };
                let records = node.log.read(&channel, Seq::new(1), Seq::new(u64::MAX), limits).unwrap_or_default();
                logs.push((*id, hw, records));
            }
            self.oracle.check_durable(&channel, &logs);
        }
        // Every acknowledged metadata write is on every replica of the group owning its slot once healed.
        let owners: BTreeMap<HashSlot, GroupId> =
            self.users_acked.keys().map(|slot| (*slot, self.owner_of(*slot))).collect();
        self.faults.slots_migrated +=
            HashSlot::all().filter(|slot| self.owner_of(*slot) != self.genesis().group_of(*slot)).count() as u64;
        for (slot, uids) in &self.users_acked {
            let group = &owners[slot];
            let members = self.group_members(*group);
            for (id, node) in self.nodes.iter().filter(|(id, _)| members.contains(id)) {
                let Some(core) = node.core.as_ref() else { continue };
                for uid in uids {
                    if !matches!(core.reader().user(uid), Ok(Some(_))) {
                        if std::env::var("SIM_DEBUG").is_ok() {
                            eprintln!("{id} {group}: {:?}", core.slot().status(*group));
                        }
                        self.oracle.violation(format!("{id}: acknowledged user {} missing in {group}", uid.as_str()));
                    }
                }
            }
        }
        if std::env::var("SIM_DEBUG").is_ok() {
            for node in self.nodes.values() {
                for task in node.core.as_ref().map(|c| c.status().finished_tasks).unwrap_or_default() {
                    eprintln!("{}: {task:?}", node.config.node);
                }
            }
        }
        self.check_slot_replicas();
        self.check_moves_settled();
        self.check_migrations_settled();
        self.oracle.check_answered();
        for channel in &self.channels {
            if !self.probed.contains(channel) {
                let statuses: Vec<String> = self
                    .nodes
                    .values()
                    .filter_map(|n| n.core.as_ref())
                    .flat_map(|c| c.status().channels.into_iter().filter(|s| &s.channel == channel))
                    .map(|s| format!("{:?}", s))
                    .collect();
                if std::env::var("SIM_DEBUG").is_ok() {
                    for (id, node) in &self.nodes {
                        let Some(core) = node.core.as_ref() else { continue };
                        for group in core.slot().groups().collect::<Vec<_>>() {
                            eprintln!("{id} {group}: {:?}", core.slot().status(group));
                        }
                    }
                }
                let tasks: Vec<String> = self
                    .nodes
                    .values()
                    .filter_map(|n| n.core.as_ref())
                    .flat_map(|c| {
                        let status = c.status();
                        let running =
                            status.tasks.into_iter().filter(|t| &t.channel == channel).map(|t| format!("{t:?}"));
                        let done = status
                            .finished_tasks
                            .into_iter()
                            .filter(|t| &t.channel == channel)
                            .map(|t| format!("{t:?}"));
                        running.chain(done).map(move |t| format!("{}: {t}", c.node())).collect::<Vec<_>>()
                    })
                    .collect();
                self.oracle.violation(format!(
                    "liveness: {channel} takes no append after healing: {statuses:?}, tasks {tasks:?}"
                ));
            }
        }
    }
}

/// The hash slot of a user's records.
fn slot_of_user(uid: &Uid) -> HashSlot {
    tidings::router::hash_slot(RoutingKey::Uid(uid).bytes())
}
