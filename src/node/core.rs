//! `NodeCore`: the sans-IO core of one node — its slot groups (multi-raft), its channel replica machines,
//! the route table, and the plumbing between them (meta propagation, append forwarding). The runtime
//! feeds it time, frames, storage completions and API calls, and carries out its effects; the simulator
//! drives the same code.

use super::active::{shrink_if_sparse, ActiveChannels};
use super::config::NodeConfig;
use super::controller::{
    Action, ClusterView, Controller, DrainReport, EvidenceReport, ExportQuestion, MigrationProposal, NodeView,
    PreferredLeaders, Reconcile, SlotMigrationReport, SlotMigrations, TaskReport, TaskStatus,
};
use super::error::NodeError;
use super::fanout::FanoutAnswer;
use super::message::{NodeMessage, RemoteAppendError};
use super::outbox::ChannelOutbox;
use crate::frame::{decode_from, encode, Frame, FrameBody, FrameError, FrameLimits};
use bytes::Bytes;
use rustc_hash::FxHashMap;
use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use tidings_channel::fanout::{FanoutEffect, FanoutPlanner, JobId, MessageRef, Target};
use tidings_channel::machine::{
    AppendAborted, AppendRecord, AppendRequest, ChannelMachine, ChannelMessage, Effect, PersistToken, ReadToken,
    RequestId,
};
use tidings_router::Router;
use tidings_slot::command::{Command, MemberList, RoutingKey};
use tidings_slot::fsm::{Outcome, Refusal};
use tidings_slot::model::{ChannelInfo, SlotState, Uid};
use tidings_slot::query::SlotReader;
use tidings_slot::raft::{MultiRaft, ProposalId, ProposeError, ReadId, SlotEffect};
use tidings_store::message::{LogBatch, MessageLog, ReadLimits, Record};
use tidings_store::{MetaStore, Placement, RaftLogStore, StoreError};
use tidings_types::{ChannelId, ChannelRuntimeMeta, Epoch, GroupId, HashSlot, LeaderEpoch, NodeId, Seq, Time};

/// Identifies an API call; chosen by the runtime, echoed in [`NodeEffect::Done`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ApiId(pub u64);

/// The result of an API call.
#[derive(Debug)]
pub enum ApiResult {
    /// A metadata write: applied, or why not.
    Meta(Result<(), NodeError>),
    /// An append: one seq per record, or why not.
    Appended(Result<Vec<Seq>, NodeError>),
    /// A channel task (leader transfer): its report, or why it did not start.
    Task(Result<TaskReport, NodeError>),
}

/// An effect for the runtime.
#[derive(Debug)]
#[must_use]
pub enum NodeEffect {
    /// Send an encoded frame to `to` (non-blocking; a lost frame is retried by the protocols).
    Send {
        /// Destination.
        to: NodeId,
        /// The encoded frame.
        frame: Bytes,
    },
    /// Make every write to the metadata and raft-log stores durable (one fsync), then call
    /// [`NodeCore::handle_slots_synced`].
    SyncSlots {
        /// Echo it.
        token: u64,
    },
    /// Make `batch` durable in the message log (stage + group-committed sync), then call
    /// [`NodeCore::handle_persisted`].
    Persist {
        /// Echo it.
        token: PersistToken,
        /// The channel's operations.
        batch: LogBatch,
    },
    /// Read records for a pull, then call [`NodeCore::handle_read`].
    Read {
        /// The channel.
        channel: ChannelId,
        /// Echo it.
        token: ReadToken,
        /// First seq.
        from: Seq,
        /// Last seq.
        through: Seq,
        /// Byte budget.
        max_bytes: usize,
    },
    /// Post-commit fanout work (`FetchPage`, `Locate`, `Deliver`, `Failed`; never `Finished`, which the
    /// core handles): carry it out with [`carry_out_fanout`](crate::node::carry_out_fanout), off the core thread, and hand the answer to
    /// [`NodeCore::handle_fanout`].
    Fanout(FanoutEffect),
    /// An API call finished.
    Done {
        /// The call.
        id: ApiId,
        /// Its result.
        result: ApiResult,
    },
}

/// Operator view of one channel replica on this node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChannelStatus {
    /// The channel.
    pub channel: ChannelId,
    /// This replica's role.
    pub role: tidings_channel::machine::RoleKind,
    /// Meta version, leader, leader epoch and membership epoch in force here.
    pub meta_version: u64,
    /// The leader named by the meta.
    pub leader: NodeId,
    /// Leader epoch.
    pub leader_epoch: LeaderEpoch,
    /// Membership epoch.
    pub epoch: Epoch,
    /// ISR.
    pub isr: Vec<NodeId>,
    /// High watermark.
    pub hw: Seq,
    /// Last seq of the local log.
    pub log_end: Seq,
    /// Last durable seq.
    pub durable_last: Seq,
}

/// Operator view of a node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeStatus {
    /// The node.
    pub node: NodeId,
    /// Raft status of the slot groups it serves.
    pub groups: Vec<tidings_slot::raft::GroupStatus>,
    /// Its active channel replicas.
    pub channels: Vec<ChannelStatus>,
    /// Channel tasks (failovers, transfers) this node's controller runs.
    pub tasks: Vec<TaskStatus>,
    /// The last tasks it finished, oldest first.
    pub finished_tasks: Vec<TaskReport>,
    /// Slot-group reconciliation (replica moves, preferred leader): the last decision for each slot
    /// group this node leads.
    pub leadership: Vec<(GroupId, Reconcile)>,
    /// Drains in progress, as far as the slot groups this node leads show them (see [`DrainReport`]).
    pub drains: Vec<DrainReport>,
    /// Hash-slot migrations this node drives (it leads their source groups).
    pub slot_migrations: Vec<SlotMigrationReport>,
    /// Inbound frames refused since start, by reason ([`FrameError::kind`]); they changed nothing.
    pub refused_frames: BTreeMap<&'static str, u64>,
    /// Channel activations refused because `active_channels_max` replicas were active and none idle.
    pub refused_activations: u64,
    /// Raft messages in accepted frames that the slot layer refused (see `MultiRaft::refused_messages`).
    pub refused_raft_messages: u64,
    /// Channel answers and hints of an older leader epoch than the meta in force, refused, plus raft
    /// messages of an older term (raft-rs ignores or answers those; they change no state).
    pub stale_messages: u64,
    /// Channel replicas rebuilt from their store after a storage failure since start. A rebuilt replica
    /// keeps its HW as far as its log holds it durably; a record committed by the other ISR members but
    /// lost here in the failed write comes back from the leader.
    pub storage_failures: u64,
}

/// Who waits for an append the local machine admitted.
#[derive(Debug, Clone, Copy)]
enum AppendOrigin {
    Local(ApiId),
    Remote { node: NodeId, id: u64 },
}

/// What a metadata proposal of this node is for.
#[derive(Debug)]
enum ProposalPurpose {
    Api(ApiId),
    /// Step one of channel creation; step two proposes the runtime meta.
    CreateChannel {
        api: ApiId,
        meta: ChannelRuntimeMeta,
    },
    /// A channel leader's meta change (ISR shrink or expand); nobody waits.
    Internal,
    /// One of several proposals an API call made (one per slot group); the call completes with the last.
    Fan(ApiId),
    /// A step of the controller's task on the channel, tagged by the controller.
    Task {
        channel: ChannelId,
        tag: u64,
    },
    /// A step of the migration of `slot` out of `group`, which this node drives.
    SlotMigration {
        group: GroupId,
        slot: HashSlot,
    },
}

/// A proposal's command and how it went out.
#[derive(Debug)]
struct Sent {
    command: Command,
    /// Times it was sent (a refusal that proposed nothing sends it on).
    sends: u8,
    /// The other node's replica of the group it was sent to (`None`: through the local replica).
    remote: Option<NodeId>,
}

/// An append waiting for its channel's meta.
#[derive(Debug)]
struct Waiting {
    api: ApiId,
    sender: Option<String>,
    records: Vec<AppendRecord>,
    deadline: Time,
}

/// How long an append waits for its channel's meta before failing with `UnknownChannel`.
const META_WAIT: std::time::Duration = std::time::Duration::from_secs(5);
/// Extra wait for a forwarded append's reply beyond the leader's append timeout.
const FORWARD_SLACK: std::time::Duration = std::time::Duration::from_secs(2);
/// A replica that cannot lead repeats its failover request this often until the meta changes.
const FAILOVER_REQUEST_INTERVAL: std::time::Duration = std::time::Duration::from_secs(1);
/// A proposal for a group this node does not serve is sent at most this many times (following
/// `NotLeader` hints).
const REMOTE_PROPOSAL_SENDS: u8 = 3;
/// A group nobody here knows the leader of is tried at another node this often.
const CONTACT_ROTATION: std::time::Duration = std::time::Duration::from_millis(500);
/// Idle eviction looks at every active replica: at most this often.
const EVICT_SCAN_INTERVAL: std::time::Duration = std::time::Duration::from_secs(1);

/// The sans-IO core of one node. Drive it like a channel machine: `handle_*` with the current time, then
/// drain [`NodeCore::poll_effect`]; call [`NodeCore::handle_tick`] at [`NodeCore::poll_timeout`].
pub struct NodeCore {
    config: NodeConfig,
    now: Time,
    slot: MultiRaft,
    reader: SlotReader,
    router: Arc<Router>,
    log: Arc<dyn MessageLog>,
    /// Active replicas; only those that took an input since their effects were last drained are
    /// polled, so the cost of an input does not grow with the number of active channels.
    channels: ActiveChannels,
    /// Idle eviction scans every replica: at most once per `EVICT_SCAN_INTERVAL`.
    next_evict_scan: Time,
    /// Channels evicted while leading and quiescent: the leader epoch their next incarnation may resume.
    resumable: BTreeMap<ChannelId, LeaderEpoch>,
    metas: FxHashMap<ChannelId, ChannelRuntimeMeta>,
    waiting: FxHashMap<ChannelId, Vec<Waiting>>,
    proposals: BTreeMap<ProposalId, ProposalPurpose>,
    /// Every proposal's command and how it was sent: a refusal that proposed nothing — `NotLeader` with a
    /// hint for one sent to another node, a stale slot route for any — sends it on, a bounded number of
    /// times.
    sent: BTreeMap<ProposalId, Sent>,
    /// Hash-slot migrations this node drives (as leader of their source groups).
    migrations: SlotMigrations,
    /// API calls made of several proposals: how many are outstanding, and the first failure.
    fans: BTreeMap<ApiId, (usize, Option<NodeError>)>,
    appends: BTreeMap<u64, (AppendOrigin, Option<String>)>,
    /// Senders of appended messages not yet committed (for fanout: no unread badge for the sender).
    senders: BTreeMap<(ChannelId, Seq), String>,
    /// Appends forwarded to a channel's leader: the caller, the channel, the leader they went to.
    forwarded: BTreeMap<u64, (ApiId, ChannelId, NodeId)>,
    /// When each forwarded append stops waiting for its reply (deadlines are increasing: one timeout).
    forward_deadlines: VecDeque<(Time, u64)>,
    /// Leaders of slot groups this node does not serve, as `NotLeader` hints named them.
    remote_leaders: BTreeMap<GroupId, NodeId>,
    /// A node that answered a proposal for the group with `NotLeader` and no hint: it is not taken for
    /// the group's leader (a route observed before a replica move may still name it) until a hint names it.
    not_leaders: BTreeMap<GroupId, NodeId>,
    /// Authoritative metadata reads waiting for their ReadIndex: the caller, the key's hash slot, and how
    /// many groups were asked (a migrated slot is followed).
    meta_reads: BTreeMap<ReadId, (ApiId, HashSlot, u8)>,
    next_id: u64,
    next_incarnation: u64,
    effects: VecDeque<NodeEffect>,
    /// Channel messages packed per destination until the end of the drain.
    outbox: ChannelOutbox,
    frame_limits: FrameLimits,
    fanout: FanoutPlanner,
    /// Committed messages waiting for room in the fanout queue (each still holds its channel's handoff slot).
    fanout_waiting: VecDeque<(ChannelId, Seq, Option<String>)>,
    /// Which channel each fanout job belongs to (to release its handoff slot when done).
    fanout_jobs: BTreeMap<JobId, ChannelId>,
    controller: Controller,
    preferred: PreferredLeaders,
    /// Messages this node sends to itself (the controller asking its own replica), handled in `pump`.
    loopback: VecDeque<NodeMessage>,
    /// Channels whose local replica is named leader but cannot lead: when to ask for a failover next.
    cannot_lead: BTreeMap<ChannelId, Time>,
    /// HW of replicas taken out of memory after a storage failure: their next incarnation keeps it.
    hw_floor: BTreeMap<ChannelId, Seq>,
    storage_failures: u64,
    refused_frames: BTreeMap<&'static str, u64>,
    refused_activations: u64,
    stale_messages: u64,
}

impl NodeCore {
    /// The core of `config.node`, over its stores: `logs` and `meta` share one durable backend (one sync
    /// covers both), `log` is the message log.
    pub fn new(
        config: NodeConfig,
        logs: Arc<RaftLogStore>,
        meta: MetaStore,
        log: Arc<dyn MessageLog>,
        router: Arc<Router>,
        now: Time,
    ) -> Result<Self, StoreError> {
        let members: Vec<_> =
            config.slot_group_members().into_iter().filter(|(_, m)| m.contains(&config.node)).collect();
        let mut raft_config = config.raft.clone();
        raft_config.node = config.node;
        // Mixed with the node id: members of a group sharing a seed would otherwise draw the same pinned
        // election timeout and split their votes forever when their clocks tick in step.
        raft_config.seed = config.seed ^ config.node.get().wrapping_mul(0x9e37_79b9_7f4a_7c15);
        raft_config.boot_id = config.boot_id;
        let slot = MultiRaft::open(raft_config, logs, meta.clone(), config.table(), &members, now)?;
        // Routes start from what this node learned of slot migrations before it stopped.
        let learned = slot.table();
        for hash_slot in tidings_types::HashSlot::all().filter(|s| learned.epoch_of(*s) > 0) {
            router.learn_slot_owner(hash_slot, learned.group_of(hash_slot), learned.epoch_of(hash_slot));
        }
        let frame_limits = FrameLimits { frame_bytes_max: config.frame_bytes_max };
        // Task ids share the boot-id range of the node's other ids, in their own upper half.
        let first_task = ((config.boot_id & 0xffff_ffff) << 32) | (1 << 31);
        let controller = Controller::new(config.controller.clone(), config.node, &config.nodes, first_task, now);
        Ok(Self {
            now,
            slot,
            reader: SlotReader::new(meta),
            router,
            log,
            channels: ActiveChannels::default(),
            next_evict_scan: now,
            resumable: BTreeMap::new(),
            metas: FxHashMap::default(),
            waiting: FxHashMap::default(),
            proposals: BTreeMap::new(),
            sent: BTreeMap::new(),
            migrations: SlotMigrations::new(now),
            fans: BTreeMap::new(),
            appends: BTreeMap::new(),
            senders: BTreeMap::new(),
            forwarded: BTreeMap::new(),
            forward_deadlines: VecDeque::new(),
            remote_leaders: BTreeMap::new(),
            not_leaders: BTreeMap::new(),
            meta_reads: BTreeMap::new(),
            // Ids of this start live in their own range: see `NodeConfig::boot_id`.
            next_id: ((config.boot_id & 0xffff_ffff) << 32) | 1,
            next_incarnation: now.as_millis().wrapping_mul(1 << 20) + 1,
            effects: VecDeque::new(),
            // Batches stay well within what receivers accept (every node runs with the cluster's limit).
            outbox: ChannelOutbox::new((config.frame_bytes_max / 4).min(4 << 20)),
            frame_limits,
            fanout: FanoutPlanner::new(config.fanout),
            fanout_waiting: VecDeque::new(),
            fanout_jobs: BTreeMap::new(),
            controller,
            preferred: PreferredLeaders::default(),
            loopback: VecDeque::new(),
            cannot_lead: BTreeMap::new(),
            hw_floor: BTreeMap::new(),
            storage_failures: 0,
            refused_frames: BTreeMap::new(),
            refused_activations: 0,
            stale_messages: 0,
            config,
        })
    }

    /// This node.
    pub fn node(&self) -> NodeId {
        self.config.node
    }

    /// The slot driver (status, leadership).
    pub fn slot(&self) -> &MultiRaft {
        &self.slot
    }

    /// The channel machine of `channel`, if active here.
    pub fn channel(&self, channel: &ChannelId) -> Option<&ChannelMachine> {
        self.channels.get(channel)
    }

    /// Status of the node, its slot groups and its active channel replicas (role, epochs, HW, log end, ISR).
    pub fn status(&self) -> NodeStatus {
        let groups = self.slot.groups().filter_map(|g| self.slot.status(g)).collect();
        let mut channels: Vec<ChannelStatus> = self
            .channels
            .iter()
            .filter_map(|(channel, machine)| {
                let meta = machine.meta()?;
                Some(ChannelStatus {
                    channel: channel.clone(),
                    role: machine.role(),
                    meta_version: meta.version,
                    leader: meta.leader,
                    leader_epoch: meta.leader_epoch,
                    epoch: meta.epoch,
                    isr: meta.isr.clone(),
                    hw: machine.hw(),
                    log_end: machine.log_end(),
                    durable_last: machine.durable_last(),
                })
            })
            .collect();
        channels.sort_by(|a, b| a.channel.cmp(&b.channel));
        NodeStatus {
            node: self.config.node,
            groups,
            channels,
            tasks: self.controller.status(),
            finished_tasks: self.controller.reports(),
            leadership: self.preferred.decisions(),
            drains: self.controller.drain_reports(),
            slot_migrations: self.migrations.reports(),
            refused_frames: self.refused_frames.clone(),
            refused_activations: self.refused_activations,
            refused_raft_messages: self.slot.refused_messages(),
            stale_messages: self.stale_messages + self.slot.stale_messages(),
            storage_failures: self.storage_failures,
        }
    }

    /// Local metadata reads (applied state of the slot groups this node serves).
    pub fn reader(&self) -> &SlotReader {
        &self.reader
    }

    /// Next effect to carry out.
    pub fn poll_effect(&mut self) -> Option<NodeEffect> {
        if self.effects.is_empty() {
            self.pump();
        }
        self.effects.pop_front()
    }

    /// When to call [`NodeCore::handle_tick`] next.
    pub fn poll_timeout(&self) -> Time {
        // Machines touched since the last drain may have moved their timer earlier than the index says.
        let channels = self.channels.next_timeout();
        let controller =
            self.controller.poll_timeout().min(self.preferred.poll_timeout()).min(self.migrations.poll_timeout());
        let cannot_lead = self.cannot_lead.values().min().copied();
        channels.into_iter().chain(cannot_lead).fold(self.slot.poll_timeout().min(controller), Time::min)
    }

    /// Advances time: raft ticks, channel timers, appends that waited too long for a meta.
    pub fn handle_tick(&mut self, now: Time) {
        self.advance(now);
        self.slot.handle_tick(self.now);
        let mut expired: Vec<ChannelId> = self
            .waiting
            .iter()
            .filter(|(_, queue)| queue.iter().any(|w| w.deadline <= now))
            .map(|(c, _)| c.clone())
            .collect();
        expired.sort();
        for channel in expired {
            self.fail_waiting(&channel, |w| w.deadline <= now);
        }
        self.channels.reschedule_dirty();
        while let Some(channel) = self.channels.pop_due(self.now) {
            let now = self.now;
            if let Some(machine) = self.channels.machine_mut(&channel) {
                machine.handle_timeout(now);
            }
        }
        while let Some((deadline, forward)) = self.forward_deadlines.front().copied() {
            if deadline > self.now {
                break;
            }
            self.forward_deadlines.pop_front();
            if let Some((api, channel, _)) = self.forwarded.remove(&forward) {
                self.done(api, ApiResult::Appended(Err(NodeError::Aborted(AppendAborted::Timeout))));
                // The leader may be gone: learn the meta in force (a failover may have named another).
                self.fetch_meta(&channel);
            }
        }
        self.controller.tick(self.now, &self.slot, &self.reader);
        self.drive_migrations();
        let down = self.controller.down_nodes(self.now);
        let cluster = ClusterView { nodes: &self.config.nodes, down: &down };
        let view = NodeView { me: self.config.node, reader: &self.reader, cluster };
        self.preferred.tick(self.now, &self.config.controller, &mut self.slot, &view);
        self.request_failovers();
        if self.now >= self.next_evict_scan {
            self.next_evict_scan = self.now + EVICT_SCAN_INTERVAL;
            self.evict_idle();
        }
    }

    /// An inbound frame from `from`. Bad frames are refused with a typed error and change nothing.
    pub fn handle_frame(&mut self, now: Time, from: NodeId, bytes: &[u8]) -> Result<(), FrameError> {
        self.advance(now);
        let nodes = &self.config.nodes;
        let frame = match decode_from(bytes, from, self.config.cluster, |n| nodes.contains(&n), &self.frame_limits) {
            Ok(frame) => frame,
            Err(error) => {
                *self.refused_frames.entry(error.kind()).or_default() += 1;
                return Err(error);
            }
        };
        self.controller.heard(from, self.now);
        match frame.body {
            FrameBody::Slot(message) => self.slot.handle_message(self.now, from, message),
            FrameBody::Channel(message) => self.channel_message(from, message),
            FrameBody::Channels(messages) => {
                for message in messages {
                    self.channel_message(from, message);
                }
            }
            FrameBody::Node(message) => self.node_message(from, message),
        }
        Ok(())
    }

    /// The runtime made the slot stores durable through the `SyncSlots` with `token`.
    pub fn handle_slots_synced(&mut self, now: Time, token: u64) {
        self.advance(now);
        self.slot.handle_synced(self.now, token);
    }

    /// A durable append of a channel finished.
    pub fn handle_persisted(
        &mut self,
        now: Time,
        channel: &ChannelId,
        token: PersistToken,
        result: Result<(), StoreError>,
    ) {
        self.advance(now);
        let now = self.now;
        if let Some(machine) = self.machine_mut(channel) {
            machine.handle_persisted(now, token, result);
        }
    }

    /// A read for a pull finished.
    pub fn handle_read(
        &mut self,
        now: Time,
        channel: &ChannelId,
        token: ReadToken,
        result: Result<Vec<Record>, StoreError>,
    ) {
        self.advance(now);
        let now = self.now;
        if let Some(machine) = self.machine_mut(channel) {
            machine.handle_read(now, token, result);
        }
    }

    /// The answer to a [`NodeEffect::Fanout`] (see [`carry_out_fanout`](crate::node::carry_out_fanout)).
    pub fn handle_fanout(&mut self, now: Time, answer: FanoutAnswer) {
        self.advance(now);
        match answer {
            FanoutAnswer::Page { job, members, next } => self.fanout.handle_page(job, members, next),
            FanoutAnswer::Located { job, targets } => {
                let targets = targets.into_iter().map(|t| t.map(|node| Target { node })).collect();
                self.fanout.handle_located(job, targets);
            }
            FanoutAnswer::Delivered { plan, delivered } => self.fanout.handle_delivered(plan, delivered),
        }
    }

    /// Proposes a metadata command; [`NodeEffect::Done`] with [`ApiResult::Meta`] follows.
    pub fn propose(&mut self, now: Time, id: ApiId, command: Command) {
        self.advance(now);
        if let Err(error) = self.propose_for(&command, ProposalPurpose::Api(id)) {
            self.done(id, ApiResult::Meta(Err(error.into())));
        }
    }

    /// Starts an authoritative metadata read of the slot group that owns `key` (raft ReadIndex, confirmed
    /// by the group's leader, never a lease). [`NodeEffect::Done`] with `ApiResult::Meta(Ok(()))` says the
    /// local store ([`NodeCore::reader`]) now reflects every metadata write acknowledged before this call.
    /// Fails with [`NodeError::NotServed`] on a node that keeps no replica of the group, and with
    /// [`NodeError::SlotNotServed`] while the key's hash slot is fenced for a migration (retry) — a slot
    /// that migrated is followed to its new group.
    pub fn read_barrier(&mut self, now: Time, id: ApiId, key: RoutingKey<'_>) {
        self.advance(now);
        self.start_read(id, tidings_router::hash_slot(key.bytes()), 1);
    }

    fn start_read(&mut self, id: ApiId, slot: HashSlot, tries: u8) {
        let group = self.slot.table().group_of(slot);
        if !self.slot.groups().any(|g| g == group) {
            self.done(id, ApiResult::Meta(Err(NodeError::NotServed(group))));
            return;
        }
        match self.slot.read_index(self.now, group) {
            Ok(read) => {
                self.meta_reads.insert(read, (id, slot, tries));
            }
            Err(error) => self.done(id, ApiResult::Meta(Err(error.into()))),
        }
    }

    /// A read index of `group` is ready: the read is answered if the group (still) serves the slot.
    fn finish_read(&mut self, id: ApiId, group: GroupId, slot: HashSlot, tries: u8) {
        let record = match self.reader.slot_record(group, slot) {
            Ok(stored) => tidings_slot::fsm::migration::record_in_force(group, self.slot.genesis(), slot, stored),
            Err(error) => return self.done(id, ApiResult::Meta(Err(error.into()))),
        };
        match tidings_slot::fsm::migration::admits(self.slot.genesis(), slot, record.as_ref()) {
            Ok(()) => self.done(id, ApiResult::Meta(Ok(()))),
            Err(Refusal::SlotMoved { owner, epoch, .. }) if tries < REMOTE_PROPOSAL_SENDS => {
                self.learn_slot_owner(slot, owner, epoch);
                self.start_read(id, slot, tries + 1);
            }
            Err(refusal) => self.done(id, ApiResult::Meta(Err(NodeError::SlotNotServed(refusal)))),
        }
    }

    /// The high watermark of a channel this node replicates: every seq up to it is committed and readable
    /// here.
    pub fn latest(&mut self, channel: &ChannelId) -> Result<Seq, NodeError> {
        self.activate(channel);
        self.touch(channel);
        match self.channels.get(channel) {
            Some(machine) => Ok(machine.hw()),
            None if self.metas.contains_key(channel) => Err(NodeError::NotReplica(channel.clone())),
            None => {
                self.fetch_meta(channel);
                Err(NodeError::UnknownChannel(channel.clone()))
            }
        }
    }

    /// Creates a channel: its definition, then its runtime meta (replicas placed by
    /// [`NodeConfig::channel_placement`], all in the ISR, the first leading).
    pub fn create_channel(&mut self, now: Time, id: ApiId, info: ChannelInfo) {
        self.advance(now);
        let replicas = self.config.channel_placement(&info.channel);
        let meta = ChannelRuntimeMeta {
            channel: info.channel.clone(),
            version: 1,
            leader: replicas[0],
            isr: replicas.clone(),
            replicas,
            min_isr: self.config.channel_min_isr,
            epoch: Epoch::new(1),
            leader_epoch: LeaderEpoch::new(1),
            write_fence: None,
            retention_through: Seq::new(0),
        };
        if let Err(error) =
            self.propose_for(&Command::CreateChannel(info), ProposalPurpose::CreateChannel { api: id, meta })
        {
            self.done(id, ApiResult::Meta(Err(error.into())));
        }
    }

    /// Appends records to a channel; any node may be called (non-leaders forward). [`NodeEffect::Done`]
    /// with [`ApiResult::Appended`] follows once the records are committed.
    pub fn append(&mut self, now: Time, id: ApiId, channel: ChannelId, records: Vec<AppendRecord>) {
        self.advance(now);
        self.route_append(id, channel, None, records);
    }

    /// Appends records sent by user `sender`: like [`NodeCore::append`], after checking that the sender
    /// may send (not banned, not on the channel's deny list), and fanout marks the sender's own entry
    /// (`is_sender`: no unread increment). The check reads this node's slot replicas and fails closed
    /// with [`NodeError::SenderUnverified`] on a node that serves neither the user's nor the channel's
    /// slot group.
    pub fn append_from(&mut self, now: Time, id: ApiId, channel: ChannelId, sender: Uid, records: Vec<AppendRecord>) {
        self.advance(now);
        match self.check_sender(&channel, &sender) {
            Ok(()) => self.route_append(id, channel, Some(sender.as_str().to_owned()), records),
            Err(error) => self.done(id, ApiResult::Appended(Err(error))),
        }
    }

    fn check_sender(&self, channel: &ChannelId, sender: &Uid) -> Result<(), NodeError> {
        let user_group = self.slot.table().group_of_key(RoutingKey::Uid(sender).bytes());
        if !self.slot.groups().any(|g| g == user_group) || !self.serves_group_of(channel) {
            return Err(NodeError::SenderUnverified(sender.clone()));
        }
        if self.reader.user(sender)?.is_some_and(|user| user.banned) {
            return Err(NodeError::SenderBanned(sender.clone()));
        }
        if self.reader.is_member(channel, MemberList::Deny, sender)? {
            return Err(NodeError::SenderDenied(sender.clone()));
        }
        Ok(())
    }

    fn route_append(&mut self, id: ApiId, channel: ChannelId, sender: Option<String>, records: Vec<AppendRecord>) {
        let Some(meta) = self.metas.get(&channel).cloned() else {
            self.wait_for_meta(id, channel, sender, records);
            return;
        };
        if meta.leader == self.config.node {
            self.append_locally(AppendOrigin::Local(id), &channel, sender, records);
        } else {
            let forward = self.next_id();
            self.forwarded.insert(forward, (id, channel.clone(), meta.leader));
            // A lost forward or reply must not leave the caller waiting forever: after the leader's own
            // append timeout (plus slack for the round trip) the caller gets `Aborted(Timeout)`, outcome
            // unknown, and retries with the same idempotency keys.
            let deadline = self.now + self.config.machine.append_timeout + FORWARD_SLACK;
            self.forward_deadlines.push_back((deadline, forward));
            let records = records.into_iter().map(|r| (r.idempotency_key, r.payload)).collect();
            self.send_node(meta.leader, NodeMessage::AppendForward { id: forward, channel, sender, records });
        }
    }

    /// Reads committed messages of `channel` from `from` (at most `limit`), bounded by the high watermark
    /// this replica knows; barrier records are skipped.
    pub fn read(&mut self, channel: &ChannelId, from: Seq, limit: usize) -> Result<Vec<Record>, NodeError> {
        self.activate(channel);
        self.touch(channel);
        let Some(machine) = self.channels.get(channel) else {
            if !self.metas.contains_key(channel) {
                // Learn the meta for next time (a restarted replica activates this way too).
                self.fetch_meta(channel);
                return Err(NodeError::UnknownChannel(channel.clone()));
            }
            return Err(NodeError::NotReplica(channel.clone()));
        };
        let hw = machine.hw();
        let limits = ReadLimits { records_max: limit, bytes_max: usize::MAX };
        let records = self.log.read(channel, from, hw, limits)?;
        Ok(records.into_iter().filter(|r| r.kind == tidings_store::message::RecordKind::Message).collect())
    }

    fn advance(&mut self, now: Time) {
        self.now = self.now.max(now);
    }

    fn next_id(&mut self) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        id
    }

    fn done(&mut self, id: ApiId, result: ApiResult) {
        self.effects.push_back(NodeEffect::Done { id, result });
    }

    /// Proposes through this node's group replica, or through the leader the route table names.
    fn propose_for(&mut self, command: &Command, purpose: ProposalPurpose) -> Result<(), ProposeError> {
        let (proposal, remote) = self.submit(command)?;
        self.sent.insert(proposal, Sent { command: command.clone(), sends: 1, remote });
        self.proposals.insert(proposal, purpose);
        Ok(())
    }

    /// Proposes `command` to its group: through the local replica, else through the group's leader as far
    /// as this node knows it (that node is returned with the id).
    fn submit(&mut self, command: &Command) -> Result<(ProposalId, Option<NodeId>), ProposeError> {
        match self.slot.propose(self.now, command) {
            Err(ProposeError::UnknownGroup { group }) => {
                let leader = self.group_contact(group).ok_or(ProposeError::NotReady { group })?;
                Ok((self.slot.propose_remote(self.now, command, leader)?, Some(leader)))
            }
            other => Ok((other?, None)),
        }
    }

    /// Sends on a proposal whose refusal proposed nothing, at most `REMOTE_PROPOSAL_SENDS` times in all
    /// (so it cannot apply twice): a remote proposal refused with `NotLeader` goes to the hinted leader, or
    /// without a hint to another contact (the node that refused it is no longer taken for the leader); a
    /// command refused because its hash slot moved goes to the new owner, whose placement this node
    /// learns. `true` if it was sent on.
    fn send_on(&mut self, id: ProposalId, result: &Result<Outcome, ProposeError>) -> bool {
        let Some(sent) = self.sent.remove(&id) else { return false };
        if let (Err(ProposeError::NotLeader { group, hint: None }), Some(refused_by)) = (result, sent.remote) {
            self.not_leaders.insert(*group, refused_by);
        }
        if sent.sends >= REMOTE_PROPOSAL_SENDS {
            return false;
        }
        let next = match result {
            Err(ProposeError::NotLeader { group, hint }) if sent.remote.is_some() => {
                let me = self.config.node;
                let Some(to) = hint.filter(|l| *l != me).or_else(|| self.group_contact(*group)) else { return false };
                self.slot.propose_remote(self.now, &sent.command, to).map(|id| (id, Some(to)))
            }
            Ok(Outcome::Refused(Refusal::SlotMoved { slot, owner, epoch })) => {
                self.learn_slot_owner(*slot, *owner, *epoch);
                self.submit(&sent.command)
            }
            _ => return false,
        };
        let Ok((next, remote)) = next else { return false };
        let Some(purpose) = self.proposals.remove(&id) else { return false };
        self.proposals.insert(next, purpose);
        self.sent.insert(next, Sent { command: sent.command, sends: sent.sends + 1, remote });
        true
    }

    /// Routes `slot` to `group` from ownership epoch `epoch` on (unless this node knows a later epoch).
    fn learn_slot_owner(&mut self, slot: HashSlot, group: GroupId, epoch: u64) {
        if self.slot.learn_slot_owner(slot, Placement { group, epoch }) {
            tracing::info!(node = %self.config.node, %slot, %group, epoch, "learned a slot's new owner");
        }
        self.router.learn_slot_owner(slot, group, epoch);
    }

    /// Proposes what the slot-migration driver asks for; an immediate failure is its outcome.
    fn drive_migrations(&mut self) {
        let proposals = self.migrations.tick(self.now, &self.config.controller, &self.slot, &self.reader);
        for ExportQuestion { from, slot, to, epoch } in self.migrations.export_questions(self.now) {
            // Only the source's leader answers; which node that is may be stale here: ask every node.
            for node in self.config.nodes.clone() {
                self.send_node(node, NodeMessage::ExportQuery { from, slot, to, epoch });
            }
        }
        for MigrationProposal { group, slot, command, tracked } in proposals {
            let purpose =
                if tracked { ProposalPurpose::SlotMigration { group, slot } } else { ProposalPurpose::Internal };
            if let Err(error) = self.propose_for(&command, purpose) {
                if tracked {
                    self.migrations.outcome(self.now, &self.config.controller, group, slot, Err(error));
                }
            }
        }
    }

    fn wait_for_meta(&mut self, api: ApiId, channel: ChannelId, sender: Option<String>, records: Vec<AppendRecord>) {
        let queue = self.waiting.entry(channel.clone()).or_default();
        if queue.len() >= self.config.waiting_appends_max {
            self.done(api, ApiResult::Appended(Err(NodeError::Busy(channel))));
            return;
        }
        let first = queue.is_empty();
        queue.push(Waiting { api, sender, records, deadline: self.now + META_WAIT });
        if first {
            self.fetch_meta(&channel);
        }
    }

    /// Asks the channel's slot group for its meta (this node's replica if it serves the group).
    fn fetch_meta(&mut self, channel: &ChannelId) {
        let group = self.slot.table().group_of_key(channel.route_key());
        if self.serves_group_of(channel) {
            if let Ok(Some(meta)) = self.reader.runtime_meta(channel) {
                self.learn_meta(meta);
                return;
            }
        }
        // A member asks the leader its replica knows. A node outside the group (or a member that knows
        // no leader) asks every node: its hints may name nodes replica moves took the group away from,
        // and only a member holding the meta answers.
        let me = self.config.node;
        match self.slot.leader(group).filter(|leader| *leader != me) {
            Some(leader) => self.send_node(leader, NodeMessage::MetaFetch(channel.clone())),
            None => {
                for node in self.config.nodes.clone().into_iter().filter(|n| *n != me) {
                    self.send_node(node, NodeMessage::MetaFetch(channel.clone()));
                }
            }
        }
    }

    /// The leader of slot group `group` as this node's replica, the last `NotLeader` hint or the route
    /// table knows it (a hint first: it is newer than what the table learned).
    fn known_group_leader(&self, group: GroupId) -> Option<NodeId> {
        let me = self.config.node;
        // A hint or route naming this node is stale unless its replica leads: a replica moved away
        // leaves its last observation in the route table.
        let refuted = self.not_leaders.get(&group).copied();
        let elsewhere = |leader: &NodeId| (*leader != me || self.slot.is_leader(group)) && Some(*leader) != refuted;
        self.slot
            .leader(group)
            .or_else(|| self.remote_leaders.get(&group).copied().filter(elsewhere))
            .or_else(|| self.router.snapshot().group(group).and_then(|g| g.leader).filter(elsewhere))
    }

    /// Where to reach slot group `group`: its known leader, else some node, a different one every
    /// `CONTACT_ROTATION` (replica moves may have taken the group away from its configured members; a
    /// member reached forwards, and the leader's hint in its answer is remembered).
    fn group_contact(&self, group: GroupId) -> Option<NodeId> {
        self.known_group_leader(group).or_else(|| {
            let nodes = &self.config.nodes;
            let rotation = u64::try_from(CONTACT_ROTATION.as_millis()).unwrap_or(u64::MAX);
            let turn = self.now.as_millis() / rotation + u64::from(group.get());
            let index = usize::try_from(turn % u64::try_from(nodes.len()).unwrap_or(1).max(1)).unwrap_or(0);
            nodes.get(index).copied()
        })
    }

    /// Moves the leadership of `channel` to `target` (an ISR member) as a controller task run by this
    /// node: fence, drain the old leader, switch with the drain proof, unfence.
    /// [`NodeEffect::Done`] with [`ApiResult::Task`] follows with the task's report; a drain that does
    /// not finish in `controller.drain_timeout` unfences and fails with
    /// [`TaskError::DrainTimedOut`](crate::node::TaskError::DrainTimedOut), the leader unchanged.
    pub fn transfer_leader(&mut self, now: Time, id: ApiId, channel: ChannelId, target: NodeId) {
        self.start_task(now, id, channel, |controller, now, meta| controller.start_transfer(now, id, meta, target));
    }

    /// Replaces replica `from` of `channel` by `to` as a controller task run by this node: `to` joins as a
    /// learner and catches up while the channel keeps taking appends, then a short fence, one meta change
    /// that puts `to` in the ISR and takes `from` out (and hands over the leadership if `from` led),
    /// unfence. [`NodeEffect::Done`] with [`ApiResult::Task`] follows.
    pub fn replace_replica(&mut self, now: Time, id: ApiId, channel: ChannelId, from: NodeId, to: NodeId) {
        self.start_task(now, id, channel, |controller, now, meta| {
            controller.start_replace(now, Some(id), meta, from, to)
        });
    }

    /// Starts a controller task on the meta this node knows for `channel` (a stale one fails the task's
    /// first compare-and-set, and the caller retries).
    fn start_task(
        &mut self,
        now: Time,
        id: ApiId,
        channel: ChannelId,
        start: impl FnOnce(&mut Controller, Time, ChannelRuntimeMeta) -> Result<(), super::controller::TaskError>,
    ) {
        self.advance(now);
        let Some(meta) = self.known_meta(&channel) else {
            self.fetch_meta(&channel);
            self.done(id, ApiResult::Task(Err(NodeError::UnknownChannel(channel))));
            return;
        };
        if let Err(error) = start(&mut self.controller, self.now, meta) {
            self.done(id, ApiResult::Task(Err(error.into())));
        }
    }

    /// Sets the controller's intent for a slot group (desired voters, configuration epoch, preferred
    /// leader), replicated through the group itself; the group's leader then reconciles towards it.
    /// [`NodeEffect::Done`] with [`ApiResult::Meta`] follows.
    pub fn set_group_intent(&mut self, now: Time, id: ApiId, intent: tidings_slot::model::GroupIntent) {
        self.propose(now, id, Command::PutGroupIntent(intent));
    }

    /// Starts moving `group`'s replica from voter `from` to node `to`. The move is recorded in the group's
    /// intent (one at a time per group) and carried out by the group's leader: `to` joins as a learner and
    /// catches up (by snapshot when the log was compacted), a joint configuration promotes it and removes
    /// `from` (the leader hands its leadership over first if it is `from`), the joint state is left
    /// explicitly, and the new assignment is committed with its configuration epoch. `from`'s replica is
    /// then destroyed. [`NodeEffect::Done`] with [`ApiResult::Meta`] says whether the move was accepted
    /// (a refusal names why: another move in progress, `from` not a voter, `to` one already).
    pub fn move_slot_replica(&mut self, now: Time, id: ApiId, group: GroupId, from: NodeId, to: NodeId) {
        self.propose(now, id, Command::MoveGroupReplica { group, from, to });
    }

    /// Sets (or clears, with `None`) `group`'s preferred leader, leaving the rest of its intent as it is;
    /// the group's leader hands leadership over when everything fits (see [`Reconcile`]).
    pub fn set_preferred_leader(&mut self, now: Time, id: ApiId, group: GroupId, preferred: Option<NodeId>) {
        self.propose(now, id, Command::SetPreferredLeader { group, preferred });
    }

    /// Drains `node` (`drain: true`) or stops draining it: recorded in the intent of every slot group, whose
    /// leaders then move the group's replica off the node (one replica move at a time per group, to a
    /// live node outside the group, never to a drained one) and replace the node's channel replicas in the
    /// group's slots (controller replacement tasks). [`NodeEffect::Done`] with [`ApiResult::Meta`]
    /// follows once every group recorded it; [`NodeStatus::drains`] on each node shows what is left in
    /// the groups it leads. A drained node holds nothing once no node reports anything left; it can then
    /// be stopped and taken out of the host's configuration.
    pub fn drain_node(&mut self, now: Time, id: ApiId, node: NodeId, drain: bool) {
        self.advance(now);
        let table = self.slot.table();
        let groups: Vec<GroupId> = table.groups().collect();
        self.fans.insert(id, (groups.len(), None));
        for group in groups {
            let command = Command::DrainNode { group, node, drain };
            if let Err(error) = self.propose_for(&command, ProposalPurpose::Fan(id)) {
                self.fan_done(id, Some(error.into()));
            }
        }
    }

    /// One proposal of a fanned-out API call finished; the call completes with the last one.
    fn fan_done(&mut self, api: ApiId, error: Option<NodeError>) {
        let Some((left, failed)) = self.fans.get_mut(&api) else { return };
        *left = left.saturating_sub(1);
        if failed.is_none() {
            *failed = error;
        }
        if *left == 0 {
            let (_, failed) = self.fans.remove(&api).expect("present");
            self.done(api, ApiResult::Meta(failed.map_or(Ok(()), Err)));
        }
    }

    /// Starts migrating hash slot `slot` from the group that owns it to group `to`. The owner records the
    /// export and its leader carries it out (see [`SlotMigrationReport`] in [`NodeStatus::slot_migrations`]
    /// on that leader): the slot's metadata is copied to `to` while writes go on, the slot is fenced
    /// (writes refused with the retryable [`Refusal::SlotFenced`]), the keys written during the copy are
    /// copied, `to` takes the slot over and the source drops its copy. A write routed to the old owner
    /// afterwards is refused with [`Refusal::SlotMoved`], which nodes follow on their own.
    /// [`NodeEffect::Done`] with [`ApiResult::Meta`] says whether the export was accepted (a refusal names
    /// why: the slot is migrating already, `to` is its group or no group of the table...).
    pub fn migrate_slot(&mut self, now: Time, id: ApiId, slot: HashSlot, to: GroupId) {
        let group = self.slot.table().group_of(slot);
        let step = tidings_slot::model::SlotMigrationStep::Export { to };
        self.propose(now, id, Command::MigrateSlot { group, slot, step });
    }

    /// Abandons the migration of `slot` if it is not fenced yet: the slot stays with its group, and the
    /// target drops what it received. Refused once the slot is fenced (the target may own it already:
    /// the migration then completes).
    pub fn abort_slot_migration(&mut self, now: Time, id: ApiId, slot: HashSlot) {
        let group = self.slot.table().group_of(slot);
        let step = tidings_slot::model::SlotMigrationStep::AbortExport;
        self.propose(now, id, Command::MigrateSlot { group, slot, step });
    }

    /// Abandons `group`'s replica move: its leader takes the membership back to the committed assignment
    /// (a learner added is removed; a promotion already made is reverted the same way) and commits it.
    pub fn abort_slot_move(&mut self, now: Time, id: ApiId, group: GroupId) {
        self.propose(now, id, Command::AbortGroupMove { group });
    }

    /// Asks for a failover of every channel whose local replica is named leader but cannot lead, at
    /// most once per `FAILOVER_REQUEST_INTERVAL` each, until a new meta arrives.
    fn request_failovers(&mut self) {
        let due: Vec<ChannelId> =
            self.cannot_lead.iter().filter(|(_, at)| **at <= self.now).map(|(c, _)| c.clone()).collect();
        for channel in due {
            self.cannot_lead.insert(channel.clone(), self.now + FAILOVER_REQUEST_INTERVAL);
            let Some(version) = self.metas.get(&channel).map(|m| m.version) else { continue };
            // To every node: only the leader of the channel's slot group acts, and this node's idea of who
            // leads it, or even of who its members are (replica moves change them), may be stale.
            for to in self.config.nodes.clone() {
                self.send_node(to, NodeMessage::RequestFailover { channel: channel.clone(), version });
            }
        }
    }

    /// Carries out the controller's actions and the messages this node sent itself.
    fn run_controller(&mut self) {
        loop {
            if let Some(message) = self.loopback.pop_front() {
                self.node_message(self.config.node, message);
                continue;
            }
            let Some(action) = self.controller.poll_action() else { return };
            match action {
                Action::Propose { channel, tag, command } => {
                    let purpose = ProposalPurpose::Task { channel: channel.clone(), tag };
                    if let Err(error) = self.propose_for(&command, purpose) {
                        self.controller.proposal_done(self.now, &channel, tag, Err(error));
                    }
                }
                Action::Send { to, message } => self.send_node(to, message),
                Action::FetchMeta(channel) => self.fetch_meta(&channel),
                Action::Finished { api, report } => {
                    if let Some(api) = api {
                        let result = match &report.outcome {
                            Ok(()) => Ok(report.clone()),
                            Err(error) => Err(NodeError::Task(error.clone())),
                        };
                        self.done(api, ApiResult::Task(result));
                    }
                }
            }
        }
    }

    /// A controller asks this replica for evidence under a fenced meta.
    fn answer_evidence(&mut self, from: NodeId, task: u64, meta: ChannelRuntimeMeta) {
        let channel = meta.channel.clone();
        self.learn_meta(meta);
        // An evicted replica (or one whose activation failed) answers from a new incarnation.
        self.activate(&channel);
        let Some(machine) = self.channels.get(&channel) else { return };
        let Some(version) = machine.meta().map(|m| m.version) else { return };
        let evidence = machine.evidence();
        let drain = machine.drain_status();
        let report = EvidenceReport {
            last_epoch: evidence.last_epoch,
            last_seq: evidence.last_seq,
            // The HW in memory: the checkpointed one may trail it, and a replacement counts holders of HW.
            hw: drain.hw.max(evidence.hw),
            pending_appends: u32::try_from(drain.pending_appends).unwrap_or(u32::MAX),
            log_end: drain.log_end,
            drained: drain.drained,
            fenced_by: machine.meta().and_then(|m| m.write_fence).map(|f| f.task),
        };
        self.send_node(from, NodeMessage::EvidenceReply { task, channel, version, report });
    }

    /// A meta arrived (pushed, fetched or applied here): keep the newest, hand it to the local replica,
    /// release appends that waited for it.
    fn learn_meta(&mut self, meta: ChannelRuntimeMeta) {
        let channel = meta.channel.clone();
        self.controller.meta_seen(self.now, &meta);
        let newer = self.metas.get(&channel).is_none_or(|known| meta.version > known.version);
        if newer {
            if self.metas.get(&channel).is_some_and(|known| known.leader_epoch != meta.leader_epoch) {
                // A new leadership: whatever this replica asked for is settled, and appends forwarded
                // to another leader end now (outcome unknown: the caller retries with the same keys)
                // instead of at their timeout.
                self.cannot_lead.remove(&channel);
                self.abort_forwards(&channel, meta.leader);
            }
            self.metas.insert(channel.clone(), meta.clone());
            let now = self.now;
            if let Some(machine) = self.machine_mut(&channel) {
                // A meta that is not a valid successor is refused by the machine; it keeps the one it has.
                let _ = machine.handle_meta(now, meta);
            } else {
                self.activate(&channel);
            }
        }
        for waiting in self.waiting.remove(&channel).unwrap_or_default() {
            self.route_append(waiting.api, channel.clone(), waiting.sender, waiting.records);
        }
    }

    /// Ends the forwarded appends of `channel` sent to a node other than `leader` with `LeaderChanged`.
    fn abort_forwards(&mut self, channel: &ChannelId, leader: NodeId) {
        let stale: Vec<u64> =
            self.forwarded.iter().filter(|(_, (_, c, to))| c == channel && *to != leader).map(|(id, _)| *id).collect();
        for id in stale {
            if let Some((api, ..)) = self.forwarded.remove(&id) {
                self.done(api, ApiResult::Appended(Err(NodeError::Aborted(AppendAborted::LeaderChanged))));
            }
        }
    }

    /// Evicts channel replicas idle for the configured time and quiescent (nothing pending, everything
    /// durable and committed). Their logs stay; the next input activates them again.
    fn evict_idle(&mut self) {
        let idle_since = self.now - self.config.channel_idle_evict;
        let evictable: Vec<ChannelId> = self
            .channels
            .iter()
            .filter(|(c, m)| m.is_quiescent() && self.channels.last_used(c).is_none_or(|t| t <= idle_since))
            .map(|(c, _)| c.clone())
            .collect();
        for channel in evictable {
            let Some(machine) = self.deactivate(&channel) else { continue };
            if machine.role() == tidings_channel::machine::RoleKind::Leader {
                if let Some(meta) = machine.meta() {
                    self.resumable.insert(channel.clone(), meta.leader_epoch);
                }
            }
            self.forget_meta_if_stored(&channel);
        }
    }

    /// The meta this node knows for `channel`: in memory, or (for an evicted replica whose meta was let go)
    /// read back from this node's replica of the channel's slot group.
    fn known_meta(&mut self, channel: &ChannelId) -> Option<ChannelRuntimeMeta> {
        if let Some(meta) = self.metas.get(channel) {
            return Some(meta.clone());
        }
        if !self.serves_group_of(channel) {
            return None;
        }
        let meta = self.reader.runtime_meta(channel).ok().flatten()?;
        self.metas.insert(channel.clone(), meta.clone());
        Some(meta)
    }

    /// Lets go of an evicted replica's meta when this node's slot replica keeps it (read back on the next
    /// use), so an idle channel costs little more than its log.
    fn forget_meta_if_stored(&mut self, channel: &ChannelId) {
        if !self.serves_group_of(channel) {
            return;
        }
        // Only when the stored one is at least as new: reading back an older meta would be a step back.
        let known = self.metas.get(channel).map(|m| m.version);
        let stored = self.reader.runtime_meta(channel).ok().flatten().map(|m| m.version);
        if stored.is_some() && stored >= known {
            self.metas.remove(channel);
            shrink_if_sparse(&mut self.metas);
        }
    }

    /// Makes room for one activation: evicts the least recently used quiescent replica. O(active) but
    /// only at the cap, which idle eviction normally keeps the node below.
    fn evict_one(&mut self) -> bool {
        let victim = self
            .channels
            .iter()
            .filter(|(_, m)| m.is_quiescent())
            .min_by_key(|(c, _)| (self.channels.last_used(c).unwrap_or(Time::ZERO), (*c).clone()))
            .map(|(c, _)| c.clone());
        let Some(victim) = victim else { return false };
        if let Some(machine) = self.deactivate(&victim) {
            if machine.role() == tidings_channel::machine::RoleKind::Leader {
                if let Some(meta) = machine.meta() {
                    self.resumable.insert(victim.clone(), meta.leader_epoch);
                }
            }
        }
        self.forget_meta_if_stored(&victim);
        true
    }

    /// Takes the channel's machine out of memory (its log stays); the next input activates a new
    /// incarnation from the store.
    fn deactivate(&mut self, channel: &ChannelId) -> Option<ChannelMachine> {
        let machine = self.channels.remove(channel)?;
        self.log.release_caches(channel);
        Some(machine)
    }

    /// Number of channel replicas active in memory.
    pub fn active_channels(&self) -> usize {
        self.channels.len()
    }

    /// Creates the local replica of `channel` if this node is one and the meta is known: open the log
    /// state, load the recent records, apply the full meta, then accept traffic.
    fn activate(&mut self, channel: &ChannelId) {
        if self.channels.contains(channel) {
            return;
        }
        let Some(meta) = self.known_meta(channel) else { return };
        if !meta.is_replica(self.config.node) {
            return;
        }
        if self.channels.len() >= self.config.active_channels_max && !self.evict_one() {
            self.refused_activations += 1;
            return;
        }
        // A store that cannot be read leaves the replica inactive (the next input tries again): a machine
        // without its recent records would forget idempotency keys.
        let Ok(mut state) = self.log.state(channel) else { return };
        let window = self.config.machine.idempotency_window as u64;
        let from = Seq::new(state.last_seq.get().saturating_sub(window).saturating_add(1));
        let limits = ReadLimits { records_max: usize::MAX, bytes_max: usize::MAX };
        let Ok(recent) = self.log.read(channel, from, state.last_seq, limits) else { return };
        if let Some(floor) = self.hw_floor.remove(channel) {
            // Everything up to the last incarnation's HW was committed: the durable prefix below it is
            // committed too, so HW does not go back.
            state.hw = state.hw.max(floor.min(state.last_seq));
        }
        let incarnation = self.next_incarnation;
        self.next_incarnation += 1;
        let mut machine = ChannelMachine::new(
            channel.clone(),
            self.config.node,
            self.config.machine.clone(),
            incarnation,
            self.now,
            state,
            recent,
        );
        if let Some(epoch) = self.resumable.remove(channel) {
            machine.resume_leadership(epoch);
        }
        let _ = machine.handle_meta(self.now, meta);
        self.channels.insert(channel.clone(), machine, self.now);
    }

    /// Fails the appends waiting for `channel`'s meta that `expired` selects.
    fn fail_waiting(&mut self, channel: &ChannelId, expired: impl Fn(&Waiting) -> bool) {
        let Some(queue) = self.waiting.remove(channel) else { return };
        let (failed, kept): (Vec<Waiting>, Vec<Waiting>) = queue.into_iter().partition(|w| expired(w));
        if !kept.is_empty() {
            self.waiting.insert(channel.clone(), kept);
        }
        for waiting in failed {
            self.done(waiting.api, ApiResult::Appended(Err(NodeError::UnknownChannel(channel.clone()))));
        }
    }

    fn serves_group_of(&self, channel: &ChannelId) -> bool {
        let group = self.slot.table().group_of_key(channel.route_key());
        self.slot.groups().any(|g| g == group)
    }

    /// Marks `channel` as in use (eviction waits for it to be idle).
    fn touch(&mut self, channel: &ChannelId) {
        self.channels.touch(channel, self.now);
    }

    fn append_locally(
        &mut self,
        origin: AppendOrigin,
        channel: &ChannelId,
        sender: Option<String>,
        records: Vec<AppendRecord>,
    ) {
        self.activate(channel);
        self.touch(channel);
        let request = self.next_id();
        let now = self.now;
        let Some(machine) = self.machine_mut(channel) else {
            let full = self.channels.len() >= self.config.active_channels_max;
            let error = if full { RemoteAppendError::TooManyChannels } else { RemoteAppendError::NotReplica };
            self.fail_append(origin, error);
            return;
        };
        match machine.handle_append(now, AppendRequest { id: RequestId(request), records }) {
            Ok(()) => {
                self.appends.insert(request, (origin, sender));
            }
            Err(error) => self.fail_append(origin, RemoteAppendError::Refused(error)),
        }
    }

    fn fail_append(&mut self, origin: AppendOrigin, error: RemoteAppendError) {
        match origin {
            AppendOrigin::Local(api) => {
                let error = match error {
                    RemoteAppendError::Refused(e) => NodeError::Append(e),
                    RemoteAppendError::Aborted(e) => NodeError::Aborted(e),
                    other => NodeError::Remote(other),
                };
                self.done(api, ApiResult::Appended(Err(error)));
            }
            AppendOrigin::Remote { node, id } => {
                self.send_node(node, NodeMessage::AppendReply { id, result: Err(error) })
            }
        }
    }

    fn channel_message(&mut self, from: NodeId, message: ChannelMessage) {
        let channel = message.channel().clone();
        // Answers and hints of an older leadership change nothing: refused here and counted. (A stale
        // pull goes on: the leader answers it with `StaleEpoch`, which sends the follower for the meta.)
        let epoch = match &message {
            ChannelMessage::Hint(hint) => Some(hint.leader_epoch),
            ChannelMessage::PullResponse(response) => Some(response.leader_epoch),
            ChannelMessage::Pull(_) => None,
        };

        // New data keeps a channel in memory; replication keep-alives (empty answers to long polls) do
        // not, and do not bring an evicted replica back either.
        let news = match &message {
            ChannelMessage::Hint(_) => true,
            ChannelMessage::PullResponse(response) => {
                !matches!(&response.body, tidings_channel::machine::PullBody::Records { records, .. } if records.is_empty())
            }
            ChannelMessage::Pull(_) => false,
        };
        let evicted = !self.channels.contains(&channel);
        if evicted && matches!(&message, ChannelMessage::PullResponse(_)) && !news {
            return;
        }
        if news {
            self.touch(&channel);
        }
        self.activate(&channel);
        let now = self.now;
        match self.machine_mut(&channel) {
            Some(machine) => {
                // Checked against the replica's own meta: no extra lookup on the hot path.
                if epoch.is_some_and(|e| machine.meta().is_some_and(|m| e < m.leader_epoch)) {
                    self.stale_messages += 1;
                } else {
                    machine.handle_message(now, from, message);
                }
            }
            None => self.fetch_meta(&channel),
        }
    }

    fn node_message(&mut self, from: NodeId, message: NodeMessage) {
        match message {
            NodeMessage::MetaPush(meta) => self.learn_meta(meta),
            NodeMessage::MetaFetch(channel) => match self.reader.runtime_meta(&channel) {
                Ok(Some(meta)) => self.send_node(from, NodeMessage::MetaPush(meta)),
                // Only a member that applied its group's log can say the channel does not exist.
                Ok(None) if self.serves_group_of(&channel) => self.send_node(from, NodeMessage::MetaMissing(channel)),
                _ => {}
            },
            NodeMessage::MetaMissing(channel) => self.fail_waiting(&channel, |_| true),
            NodeMessage::AppendForward { id, channel, sender, records } => {
                let records =
                    records.into_iter().map(|(key, payload)| AppendRecord { idempotency_key: key, payload }).collect();
                self.append_locally(AppendOrigin::Remote { node: from, id }, &channel, sender, records);
            }
            NodeMessage::Ping => {}
            NodeMessage::EvidenceRequest { task, meta } => self.answer_evidence(from, task, meta),
            NodeMessage::EvidenceReply { task, channel, version, report } => {
                self.controller.evidence(self.now, from, task, &channel, version, report)
            }
            NodeMessage::ExportQuery { from: source, slot, to, epoch } => {
                if self.slot.is_leader(source) {
                    let record = self.reader.slot_record(source, slot);
                    // Anything but a record of this very export (or of its completion) means it was given up.
                    let exporting = match record {
                        Ok(Some(r)) => {
                            r.epoch == epoch
                                && matches!(r.state,
                                    SlotState::Exporting { to: t } | SlotState::Fenced { to: t } | SlotState::Gone { to: t }
                                    if t == to)
                        }
                        Ok(None) => false,
                        Err(_) => return, // cannot tell: say nothing
                    };
                    self.send_node(from, NodeMessage::ExportAnswer { from: source, slot, to, epoch, exporting });
                }
            }
            NodeMessage::ExportAnswer { from: source, slot, to, epoch, exporting } => {
                self.migrations.export_answer(source, slot, to, epoch, exporting);
            }
            NodeMessage::RequestFailover { channel, version } => {
                // Only the group's leader acts, on the meta its store holds.
                let group = self.slot.table().group_of_key(channel.route_key());
                if self.slot.is_leader(group) {
                    if let Ok(Some(meta)) = self.reader.runtime_meta(&channel) {
                        if meta.version > version {
                            // The replica asks under a meta that was replaced (the push was lost): teach it.
                            self.send_node(from, NodeMessage::MetaPush(meta));
                        } else if meta.version == version {
                            self.controller.failover_requested(self.now, from, meta);
                        }
                    }
                }
            }
            NodeMessage::AppendReply { id, result } => {
                if let Some((api, ..)) = self.forwarded.remove(&id) {
                    let result = result.map_err(|e| match e {
                        RemoteAppendError::Refused(e) => NodeError::Append(e),
                        RemoteAppendError::Aborted(e) => NodeError::Aborted(e),
                        other => NodeError::Remote(other),
                    });
                    self.done(api, ApiResult::Appended(result));
                }
            }
        }
    }

    fn send_node(&mut self, to: NodeId, message: NodeMessage) {
        if to == self.config.node {
            self.loopback.push_back(message);
        } else {
            self.send(to, FrameBody::Node(message));
        }
    }

    fn send_channel_batch(&mut self, to: NodeId, mut batch: Vec<ChannelMessage>) {
        let body = match batch.len() {
            1 => FrameBody::Channel(batch.pop().expect("one message")),
            _ => FrameBody::Channels(batch),
        };
        self.send(to, body);
    }

    fn send(&mut self, to: NodeId, body: FrameBody) {
        let frame = encode(&Frame { cluster: self.config.cluster, from: self.config.node, body });
        self.effects.push_back(NodeEffect::Send { to, frame });
    }

    /// Hands committed messages to the fanout planner while it has room.
    fn feed_fanout(&mut self) {
        while self.fanout.capacity() > 0 {
            let Some((channel, seq, sender)) = self.fanout_waiting.pop_front() else { return };
            let person = channel.kind().is_person().then(|| channel.id().split_once('@')).flatten();
            let members = person.map(|(a, b)| [a.to_owned(), b.to_owned()]);
            let message = MessageRef { channel: channel.clone(), seq, sender: sender.clone() };
            match self.fanout.submit(message, members) {
                Ok(job) => {
                    self.fanout_jobs.insert(job, channel);
                }
                Err(_) => {
                    // Submit refuses only when full (checked above); the message waits its turn.
                    self.fanout_waiting.push_front((channel, seq, sender));
                    return;
                }
            }
        }
    }

    fn fanout_effect(&mut self, effect: FanoutEffect) {
        match effect {
            FanoutEffect::FetchPage { job, channel, cursor, limit } => {
                if self.serves_group_of(&channel) {
                    let fetch = FanoutEffect::FetchPage { job, channel, cursor, limit };
                    self.effects.push_back(NodeEffect::Fanout(fetch));
                } else {
                    // No local copy of the channel's subscribers: nothing fans out from here (documented
                    // limitation; pages from a remote slot replica come with the controller work).
                    tracing::warn!(%channel, "fanout: subscribers live in a slot group this node does not serve");
                    self.fanout.handle_page(job, Vec::new(), None);
                }
            }
            host_work @ (FanoutEffect::Locate { .. } | FanoutEffect::Deliver(_) | FanoutEffect::Failed(_)) => {
                self.effects.push_back(NodeEffect::Fanout(host_work));
            }
            FanoutEffect::Finished { job, .. } => {
                if let Some(channel) = self.fanout_jobs.remove(&job) {
                    if let Some(machine) = self.machine_mut(&channel) {
                        machine.release_handoff(1);
                    }
                }
                self.feed_fanout();
            }
        }
    }

    /// Moves effects of the slot driver and the channel machines into node effects.
    fn pump(&mut self) {
        self.run_controller();
        while let Some(effect) = self.slot.poll_effect() {
            self.slot_effect(effect);
        }
        // Effects may touch further channels (or this one again): drain until nothing is dirty.
        while let Some(channel) = self.channels.pop_dirty() {
            while let Some(effect) = self.channels.machine_mut(&channel).and_then(ChannelMachine::poll_effect) {
                self.channel_effect(&channel, effect);
            }
            self.channels.reschedule(&channel);
        }
        // Channel effects may have produced slot proposals (meta changes): drain those too.
        while let Some(effect) = self.slot.poll_effect() {
            self.slot_effect(effect);
        }
        while let Some(effect) = self.fanout.poll_effect() {
            self.fanout_effect(effect);
        }
        // Slot outcomes and metas above may have moved controller tasks on: carry out their actions now
        // (their proposals and sends become effects on the next drain).
        self.run_controller();
        while let Some(effect) = self.slot.poll_effect() {
            self.slot_effect(effect);
        }
        let batches: Vec<_> = self.outbox.drain().collect();
        for (to, batch) in batches {
            self.send_channel_batch(to, batch);
        }
    }

    /// The channel machine `channel`, marked for draining.
    fn machine_mut(&mut self, channel: &ChannelId) -> Option<&mut ChannelMachine> {
        self.channels.get_marked(channel)
    }

    fn slot_effect(&mut self, effect: SlotEffect) {
        match effect {
            SlotEffect::Send { to, message } => self.send(to, FrameBody::Slot(message)),
            SlotEffect::Sync { token } => self.effects.push_back(NodeEffect::SyncSlots { token }),
            SlotEffect::ProposalDone { id, result } => self.proposal_done(id, result),
            SlotEffect::ReadReady { id, group } => {
                if let Some((api, slot, tries)) = self.meta_reads.remove(&id) {
                    self.finish_read(api, group, slot, tries);
                }
            }
            SlotEffect::ReadFailed { id, error } => {
                if let Some((api, _, _)) = self.meta_reads.remove(&id) {
                    self.done(api, ApiResult::Meta(Err(error.into())));
                }
            }
            SlotEffect::MetaChanged { meta, leader, .. } => {
                self.controller.meta_applied(self.now, &meta, leader);
                if leader {
                    let me = self.config.node;
                    for replica in meta.replicas.iter().copied().filter(|n| *n != me) {
                        self.send_node(replica, NodeMessage::MetaPush(meta.clone()));
                    }
                }
                self.learn_meta(meta);
            }
            SlotEffect::Observed { group, observation } => {
                // A stale or conflicting observation is refused by the router; the newer one stands.
                let _ = self.router.observe(group, observation);
            }
            SlotEffect::SlotPlaced { slot, placement } => {
                self.router.learn_slot_owner(slot, placement.group, placement.epoch);
            }
            SlotEffect::GroupRemoved { group } => {
                // The replica is gone; forwarding to the group now goes through the route table.
                tracing::info!(%group, node = %self.config.node, "left slot group");
            }
        }
    }

    fn proposal_done(&mut self, id: ProposalId, result: Result<Outcome, ProposeError>) {
        if let Err(ProposeError::NotLeader { group, hint: Some(leader) }) = &result {
            if !self.slot.groups().any(|g| g == *group) {
                self.remote_leaders.insert(*group, *leader);
                self.not_leaders.remove(group);
            }
        }
        if self.send_on(id, &result) {
            return;
        }
        self.sent.remove(&id);
        let Some(purpose) = self.proposals.remove(&id) else { return };
        if let ProposalPurpose::Task { channel, tag } = &purpose {
            self.controller.proposal_done(self.now, channel, *tag, result);
            return;
        }
        if let ProposalPurpose::SlotMigration { group, slot } = purpose {
            self.migrations.outcome(self.now, &self.config.controller, group, slot, result);
            return;
        }
        let applied = match result {
            Ok(Outcome::Applied) => Ok(()),
            Ok(other) => Err(NodeError::NotApplied(other)),
            Err(e) => Err(NodeError::Propose(e)),
        };
        match purpose {
            ProposalPurpose::Api(api) => self.done(api, ApiResult::Meta(applied)),
            ProposalPurpose::CreateChannel { api, meta } => match applied {
                Ok(()) => {
                    if let Err(error) = self.propose_for(&Command::CreateRuntimeMeta(meta), ProposalPurpose::Api(api)) {
                        self.done(api, ApiResult::Meta(Err(error.into())));
                    }
                }
                Err(error) => self.done(api, ApiResult::Meta(Err(error))),
            },
            ProposalPurpose::Fan(api) => self.fan_done(api, applied.err()),
            ProposalPurpose::Internal => {}
            ProposalPurpose::Task { .. } | ProposalPurpose::SlotMigration { .. } => {}
        }
    }

    fn channel_effect(&mut self, channel: &ChannelId, effect: Effect) {
        match effect {
            Effect::Persist { token, batch } => self.effects.push_back(NodeEffect::Persist { token, batch }),
            Effect::Send { to, message } => {
                if let Some(batch) = self.outbox.push(to, message) {
                    self.send_channel_batch(to, batch);
                }
            }
            Effect::Read { token, from, through, max_bytes } => {
                self.effects.push_back(NodeEffect::Read { channel: channel.clone(), token, from, through, max_bytes })
            }
            Effect::AppendDone { id, result } => {
                let Some((origin, sender)) = self.appends.remove(&id.0) else { return };
                if let (Some(sender), Ok(seqs), true) = (sender, &result, self.config.fanout_enabled) {
                    // AppendDone comes before the `Committed` that hands these seqs to fanout.
                    for seq in seqs {
                        self.senders.insert((channel.clone(), *seq), sender.clone());
                    }
                }
                match (origin, result) {
                    (AppendOrigin::Local(api), Ok(seqs)) => self.done(api, ApiResult::Appended(Ok(seqs))),
                    (AppendOrigin::Remote { node, id }, Ok(seqs)) => {
                        self.send_node(node, NodeMessage::AppendReply { id, result: Ok(seqs) })
                    }
                    (origin, Err(aborted)) => self.fail_append(origin, RemoteAppendError::Aborted(aborted)),
                }
            }
            Effect::Committed { last, messages, .. } => {
                if self.config.fanout_enabled {
                    for seq in messages {
                        let sender = self.senders.remove(&(channel.clone(), seq));
                        self.fanout_waiting.push_back((channel.clone(), seq, sender));
                    }
                    // Senders of retries answered from committed records have no `Committed` of their own.
                    let stale: Vec<_> = self
                        .senders
                        .range((channel.clone(), Seq::new(0))..=(channel.clone(), last))
                        .map(|(k, _)| k.clone())
                        .collect();
                    for key in stale {
                        self.senders.remove(&key);
                    }
                    self.feed_fanout();
                } else if let Some(machine) = self.machine_mut(channel) {
                    machine.release_handoff(messages.len());
                }
            }
            Effect::ProposeMeta { expected_version, meta, .. } => {
                let command = Command::CasRuntimeMeta { expected_version, meta, proof: None };
                // A refused proposal is retried by the machine after its proposal timeout.
                let _ = self.propose_for(&command, ProposalPurpose::Internal);
            }
            Effect::RefreshMeta => self.fetch_meta(channel),
            Effect::NeedsFailover => {
                tracing::warn!(%channel, node = %self.config.node, "channel replica cannot lead: asking for a failover");
                self.cannot_lead.insert(channel.clone(), self.now);
            }
            Effect::StorageFailed => {
                // The machine stops writing for good; a new incarnation starts from what the store holds
                // durably, under the new leader epoch the failover brings.
                tracing::warn!(%channel, node = %self.config.node, "channel log failed: asking for a failover");
                self.cannot_lead.insert(channel.clone(), self.now);
                self.storage_failures += 1;
                if let Some(machine) = self.deactivate(channel) {
                    self.hw_floor.insert(channel.clone(), machine.hw());
                }
            }
        }
    }
}
