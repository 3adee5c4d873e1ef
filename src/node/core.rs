//! `NodeCore`: the sans-IO core of one node — its slot groups (multi-raft), its channel replica machines,
//! the route table, and the plumbing between them (meta propagation, append forwarding). The runtime
//! feeds it time, frames, storage completions and API calls, and carries out its effects; the simulator
//! drives the same code.

use super::config::NodeConfig;
use super::controller::{
    Action, ClusterView, Controller, DrainReport, ExportQuestion, MigrationProposal, NodeView, PreferredLeaders,
    Reconcile, SlotMigrationReport, SlotMigrations, TaskReport, TaskStatus,
};
use super::error::NodeError;
use super::fanout::FanoutAnswer;
use super::message::NodeMessage;
use super::shard::{shard_of, shard_of_id, ChannelShard, Served, ShardInput, ShardOutput, ShardStatus, TaskStart};
use crate::frame::{decode_from, encode, Frame, FrameBody, FrameError, FrameLimits};
use bytes::Bytes;
use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use tidings_channel::fanout::{FanoutEffect, FanoutPlanner, JobId, MessageRef, Target};
use tidings_channel::machine::{AppendRecord, ChannelMachine, ChannelMessage, PersistToken, ReadToken};
use tidings_router::Router;
use tidings_slot::command::{Command, RoutingKey};
use tidings_slot::fsm::{Outcome, Refusal};
use tidings_slot::model::{ChannelInfo, SlotState, Uid};
use tidings_slot::query::SlotReader;
use tidings_slot::raft::{MultiRaft, ProposalId, ProposeError, ReadId, SlotEffect};
use tidings_store::message::{LogBatch, MessageLog, Record};
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
    /// Channel metas the channel shards hold in memory: those of active replicas, and of evicted ones
    /// whose meta this node's slot replicas do not keep (an evicted replica's meta kept there is let go
    /// and read back on its next use).
    pub channel_metas_held: usize,
}

impl NodeStatus {
    /// Adds a channel shard's replicas and counters.
    pub(crate) fn add_shard(&mut self, shard: ShardStatus) {
        self.channels.extend(shard.channels);
        self.channels.sort_by(|a, b| a.channel.cmp(&b.channel));
        self.refused_activations += shard.counters.refused_activations;
        self.stale_messages += shard.counters.stale_messages;
        self.storage_failures += shard.counters.storage_failures;
        self.channel_metas_held += shard.metas_held;
    }
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

/// A proposal for a group this node does not serve is sent at most this many times (following
/// `NotLeader` hints).
const REMOTE_PROPOSAL_SENDS: u8 = 3;
/// A group nobody here knows the leader of is tried at another node this often.
const CONTACT_ROTATION: std::time::Duration = std::time::Duration::from_millis(500);

/// Where a node's channel shards run.
enum Shards {
    /// Driven by the core itself, in index order (the simulator, tests, hosts without threads).
    Inline(Vec<ChannelShard>),
    /// Taken out by a runtime that runs each on its own thread: their inputs wait in `inputs` for it.
    Detached { count: usize, inputs: VecDeque<(usize, ShardInput)> },
}

impl Shards {
    fn count(&self) -> usize {
        match self {
            Shards::Inline(shards) => shards.len(),
            Shards::Detached { count, .. } => *count,
        }
    }
}

/// The sans-IO core of one node. Drive it like a channel machine: `handle_*` with the current time, then
/// drain [`NodeCore::poll_effect`]; call [`NodeCore::handle_tick`] at [`NodeCore::poll_timeout`].
///
/// The channel replicas live in `NodeConfig::reactors` channel shards, each owning the channels whose
/// hash slot falls to it; the core keeps the slot groups, the controller, routing and fanout, and talks
/// to the shards only by messages. By default it drives them itself; the threaded runtime takes them out
/// and runs each on a reactor thread.
pub struct NodeCore {
    config: NodeConfig,
    now: Time,
    slot: MultiRaft,
    reader: SlotReader,
    router: Arc<Router>,
    shards: Shards,
    /// What the shards were last told of the groups this node serves.
    served: Arc<Served>,
    proposals: BTreeMap<ProposalId, ProposalPurpose>,
    /// Every proposal's command and how it was sent: a refusal that proposed nothing — `NotLeader` with a
    /// hint for one sent to another node, a stale slot route for any — sends it on, a bounded number of
    /// times.
    sent: BTreeMap<ProposalId, Sent>,
    /// Hash-slot migrations this node drives (as leader of their source groups).
    migrations: SlotMigrations,
    /// API calls made of several proposals: how many are outstanding, and the first failure.
    fans: BTreeMap<ApiId, (usize, Option<NodeError>)>,
    /// Leaders of slot groups this node does not serve, as `NotLeader` hints named them.
    remote_leaders: BTreeMap<GroupId, NodeId>,
    /// A node that answered a proposal for the group with `NotLeader` and no hint: it is not taken for
    /// the group's leader (a route observed before a replica move may still name it) until a hint names it.
    not_leaders: BTreeMap<GroupId, NodeId>,
    /// Authoritative metadata reads waiting for their ReadIndex: the caller, the key's hash slot, and how
    /// many groups were asked (a migrated slot is followed).
    meta_reads: BTreeMap<ReadId, (ApiId, HashSlot, u8)>,
    effects: VecDeque<NodeEffect>,
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
    refused_frames: BTreeMap<&'static str, u64>,
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
        let reader = SlotReader::new(meta);
        let served = Arc::new(Served::new(slot.table(), slot.groups().collect()));
        let count = config.reactors_or(1);
        let shards = (0..count)
            .map(|index| {
                let (log, reader, served) = (Arc::clone(&log), reader.clone(), Arc::clone(&served));
                ChannelShard::new(index, count, config.clone(), log, reader, served, now)
            })
            .collect();
        Ok(Self {
            now,
            slot,
            reader,
            router,
            shards: Shards::Inline(shards),
            served,
            proposals: BTreeMap::new(),
            sent: BTreeMap::new(),
            migrations: SlotMigrations::new(now),
            fans: BTreeMap::new(),
            remote_leaders: BTreeMap::new(),
            not_leaders: BTreeMap::new(),
            meta_reads: BTreeMap::new(),
            effects: VecDeque::new(),
            frame_limits,
            fanout: FanoutPlanner::new(config.fanout),
            fanout_waiting: VecDeque::new(),
            fanout_jobs: BTreeMap::new(),
            controller,
            preferred: PreferredLeaders::default(),
            loopback: VecDeque::new(),
            refused_frames: BTreeMap::new(),
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

    /// The channel machine of `channel`, if active here (`None` as well once a runtime took the channel
    /// shards out to run them on its reactor threads).
    pub fn channel(&self, channel: &ChannelId) -> Option<&ChannelMachine> {
        match &self.shards {
            Shards::Inline(shards) => shards[shard_of(channel, shards.len())].channel(channel),
            Shards::Detached { .. } => None,
        }
    }

    /// Status of the node, its slot groups and its active channel replicas (role, epochs, HW, log end, ISR).
    /// With the shards detached, their part is added by whoever runs them.
    pub fn status(&self) -> NodeStatus {
        let groups = self.slot.groups().filter_map(|g| self.slot.status(g)).collect();
        let mut status = NodeStatus {
            node: self.config.node,
            groups,
            channels: Vec::new(),
            tasks: self.controller.status(),
            finished_tasks: self.controller.reports(),
            leadership: self.preferred.decisions(),
            drains: self.controller.drain_reports(),
            slot_migrations: self.migrations.reports(),
            refused_frames: self.refused_frames.clone(),
            refused_activations: 0,
            refused_raft_messages: self.slot.refused_messages(),
            stale_messages: self.slot.stale_messages(),
            storage_failures: 0,
            channel_metas_held: 0,
        };
        if let Shards::Inline(shards) = &self.shards {
            for shard in shards {
                status.add_shard(shard.status());
            }
        }
        status
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
        let controller =
            self.controller.poll_timeout().min(self.preferred.poll_timeout()).min(self.migrations.poll_timeout());
        let mut next = self.slot.poll_timeout().min(controller);
        if let Shards::Inline(shards) = &self.shards {
            next = shards.iter().filter_map(ChannelShard::poll_timeout).fold(next, Time::min);
        }
        next
    }

    /// Advances time: raft ticks, the controller, channel timers, appends that waited too long for a meta
    /// or a forwarded reply.
    pub fn handle_tick(&mut self, now: Time) {
        self.advance(now);
        self.slot.handle_tick(self.now);
        self.controller.tick(self.now, &self.slot, &self.reader);
        self.drive_migrations();
        let down = self.controller.down_nodes(self.now);
        let cluster = ClusterView { nodes: &self.config.nodes, down: &down };
        let view = NodeView { me: self.config.node, reader: &self.reader, cluster };
        self.preferred.tick(self.now, &self.config.controller, &mut self.slot, &view);
        if let Shards::Inline(shards) = &mut self.shards {
            for shard in shards {
                shard.handle_tick(self.now);
            }
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
        self.handle_frame_body(from, frame.body);
        Ok(())
    }

    /// The body of a frame from `from` that the runtime decoded and checked already
    /// ([`crate::frame::decode_from`]) — a runtime that hands peer channel messages straight to the
    /// reactors gives the core the rest this way.
    pub(crate) fn handle_decoded(&mut self, now: Time, from: NodeId, body: FrameBody) {
        self.advance(now);
        self.handle_frame_body(from, body);
    }

    fn handle_frame_body(&mut self, from: NodeId, body: FrameBody) {
        self.controller.heard(from, self.now);
        match body {
            FrameBody::Slot(message) => self.slot.handle_message(self.now, from, message),
            FrameBody::Channel(message) => self.channel_message(from, message),
            FrameBody::Channels(messages) => {
                for message in messages {
                    self.channel_message(from, message);
                }
            }
            FrameBody::Node(message) => self.node_message(from, message),
        }
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
        self.feed_shard(channel, ShardInput::Persisted { channel: channel.clone(), token, result });
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
        self.feed_shard(channel, ShardInput::ReadDone { channel: channel.clone(), token, result });
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
        self.feed_shard(&channel.clone(), ShardInput::Append { api: id, channel, sender: None, records });
    }

    /// Appends records sent by user `sender`: like [`NodeCore::append`], after checking that the sender
    /// may send (not banned, not on the channel's deny list), and fanout marks the sender's own entry
    /// (`is_sender`: no unread increment). The check reads this node's slot replicas and fails closed
    /// with [`NodeError::SenderUnverified`] on a node that serves neither the user's nor the channel's
    /// slot group.
    pub fn append_from(&mut self, now: Time, id: ApiId, channel: ChannelId, sender: Uid, records: Vec<AppendRecord>) {
        self.advance(now);
        let input = ShardInput::Append { api: id, channel: channel.clone(), sender: Some(sender), records };
        self.feed_shard(&channel, input);
    }

    /// The high watermark of a channel this node replicates: every seq up to it is committed and readable
    /// here. Fails with [`NodeError::Stopped`] once the shards are detached (the runtime asks them).
    pub fn latest(&mut self, channel: &ChannelId) -> Result<Seq, NodeError> {
        let now = self.now;
        self.inline_shard(channel)?.latest(now, channel)
    }

    /// Reads committed messages of `channel` from `from` (at most `limit`), bounded by the high watermark
    /// this replica knows; barrier records are skipped. Fails with [`NodeError::Stopped`] once the shards
    /// are detached (the runtime asks them).
    pub fn read(&mut self, channel: &ChannelId, from: Seq, limit: usize) -> Result<Vec<Record>, NodeError> {
        let now = self.now;
        self.inline_shard(channel)?.read(now, channel, from, limit)
    }

    /// Number of channel replicas active in memory (0 once the shards are detached).
    pub fn active_channels(&self) -> usize {
        match &self.shards {
            Shards::Inline(shards) => shards.iter().map(ChannelShard::active_channels).sum(),
            Shards::Detached { .. } => 0,
        }
    }

    /// Takes the channel shards out, for a runtime that runs each on its own thread. From then on their
    /// inputs wait in [`NodeCore::poll_shard_input`], and their outputs for the core come back through
    /// [`NodeCore::handle_shard_output`].
    pub(crate) fn detach_shards(&mut self) -> Vec<ChannelShard> {
        let count = self.shards.count();
        match std::mem::replace(&mut self.shards, Shards::Detached { count, inputs: VecDeque::new() }) {
            Shards::Inline(shards) => shards,
            Shards::Detached { count, inputs } => {
                self.shards = Shards::Detached { count, inputs };
                Vec::new()
            }
        }
    }

    /// Next input for a detached shard: its index and the input.
    pub(crate) fn poll_shard_input(&mut self) -> Option<(usize, ShardInput)> {
        match &mut self.shards {
            Shards::Inline(_) => None,
            Shards::Detached { inputs, .. } => inputs.pop_front(),
        }
    }

    /// An output of a shard for the core (not its IO, which whoever runs the shard carries out).
    pub(crate) fn handle_shard_output(&mut self, now: Time, output: ShardOutput) {
        self.advance(now);
        self.shard_output(output);
    }

    /// The shard of `channel` when the core drives its shards.
    fn inline_shard(&mut self, channel: &ChannelId) -> Result<&mut ChannelShard, NodeError> {
        match &mut self.shards {
            Shards::Inline(shards) => {
                let index = shard_of(channel, shards.len());
                Ok(&mut shards[index])
            }
            Shards::Detached { .. } => Err(NodeError::Stopped),
        }
    }

    /// Hands `input` to the shard of `channel`.
    fn feed_shard(&mut self, channel: &ChannelId, input: ShardInput) {
        let index = shard_of(channel, self.shards.count());
        self.feed_shard_at(index, input);
    }

    fn feed_shard_at(&mut self, index: usize, input: ShardInput) {
        self.tell_shards_what_is_served();
        let now = self.now;
        match &mut self.shards {
            Shards::Inline(shards) => shards[index].handle(now, input),
            Shards::Detached { inputs, .. } => inputs.push_back((index, input)),
        }
    }

    /// Gives every shard the served groups and hash-slot table when they changed since they were told.
    fn tell_shards_what_is_served(&mut self) {
        let table = self.slot.table();
        let same_table = Arc::ptr_eq(&table, &self.served.table());
        if same_table && self.slot.groups().eq(self.served.groups().iter().copied()) {
            return;
        }
        self.served = Arc::new(Served::new(table, self.slot.groups().collect()));
        let now = self.now;
        match &mut self.shards {
            Shards::Inline(shards) => {
                for shard in shards {
                    shard.handle(now, ShardInput::Served(Arc::clone(&self.served)));
                }
            }
            Shards::Detached { count, inputs } => {
                for index in 0..*count {
                    inputs.push_back((index, ShardInput::Served(Arc::clone(&self.served))));
                }
            }
        }
    }

    /// A channel message from a peer: to its channel's shard.
    fn channel_message(&mut self, from: NodeId, message: ChannelMessage) {
        let channel = message.channel().clone();
        self.feed_shard(&channel, ShardInput::Message { from, message });
    }

    /// What a shard asks of the core.
    fn shard_output(&mut self, output: ShardOutput) {
        match output {
            ShardOutput::Effect(effect) => self.effects.push_back(effect),
            ShardOutput::Committed { channel, seq, sender } => {
                self.fanout_waiting.push_back((channel, seq, sender));
                self.feed_fanout();
            }
            ShardOutput::Propose(command) => {
                // A refused proposal is retried by the machine after its proposal timeout.
                let _ = self.propose_for(&command, ProposalPurpose::Internal);
            }
            ShardOutput::FetchMeta(channel) => self.fetch_meta(&channel),
            ShardOutput::Loopback(message) => self.loopback.push_back(message),
            ShardOutput::TaskMeta { api, meta, start } => self.start_task_with(api, meta, start),
        }
    }

    fn advance(&mut self, now: Time) {
        self.now = self.now.max(now);
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

    /// Asks the channel's slot group for its meta (this node's replica if it serves the group).
    fn fetch_meta(&mut self, channel: &ChannelId) {
        let group = self.slot.table().group_of_key(channel.route_key());
        if self.slot.groups().any(|g| g == group) {
            if let Ok(Some(meta)) = self.reader.runtime_meta(channel) {
                self.learn_meta(meta, true);
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
        self.start_task(now, id, channel, TaskStart::Transfer { target });
    }

    /// Replaces replica `from` of `channel` by `to` as a controller task run by this node: `to` joins as a
    /// learner and catches up while the channel keeps taking appends, then a short fence, one meta change
    /// that puts `to` in the ISR and takes `from` out (and hands over the leadership if `from` led),
    /// unfence. [`NodeEffect::Done`] with [`ApiResult::Task`] follows.
    pub fn replace_replica(&mut self, now: Time, id: ApiId, channel: ChannelId, from: NodeId, to: NodeId) {
        self.start_task(now, id, channel, TaskStart::Replace { from, to });
    }

    /// Starts a controller task on the meta this node knows for `channel`, which its shard looks up (a
    /// stale one fails the task's first compare-and-set, and the caller retries).
    fn start_task(&mut self, now: Time, api: ApiId, channel: ChannelId, start: TaskStart) {
        self.advance(now);
        self.feed_shard(&channel.clone(), ShardInput::TaskMeta { api, channel, start });
    }

    /// The shard answered with the meta a task starts from (`Err`: the channel it does not know).
    fn start_task_with(&mut self, api: ApiId, meta: Result<ChannelRuntimeMeta, ChannelId>, start: TaskStart) {
        let meta = match meta {
            Ok(meta) => meta,
            Err(channel) => return self.done(api, ApiResult::Task(Err(NodeError::UnknownChannel(channel)))),
        };
        let started = match start {
            TaskStart::Transfer { target } => self.controller.start_transfer(self.now, api, meta, target),
            TaskStart::Replace { from, to } => self.controller.start_replace(self.now, Some(api), meta, from, to),
        };
        if let Err(error) = started {
            self.done(api, ApiResult::Task(Err(error.into())));
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

    /// A meta arrived (pushed, fetched or applied here): the controller sees it, and the channel's
    /// shard keeps the newest for its replica and the appends that waited for it. `stored_here`: this
    /// node's slot replica holds it (applied or read there).
    fn learn_meta(&mut self, meta: ChannelRuntimeMeta, stored_here: bool) {
        self.controller.meta_seen(self.now, &meta);
        self.feed_shard(&meta.channel.clone(), ShardInput::Meta { meta, stored_here });
    }

    /// `true` if this node keeps a replica of the slot group owning `channel`.
    fn serves_group_of(&self, channel: &ChannelId) -> bool {
        let group = self.slot.table().group_of_key(channel.route_key());
        self.slot.groups().any(|g| g == group)
    }

    fn node_message(&mut self, from: NodeId, message: NodeMessage) {
        match message {
            NodeMessage::MetaPush(meta) => self.learn_meta(meta, false),
            NodeMessage::MetaFetch(channel) => match self.reader.runtime_meta(&channel) {
                Ok(Some(meta)) => self.send_node(from, NodeMessage::MetaPush(meta)),
                // Only a member that applied its group's log can say the channel does not exist.
                Ok(None) if self.serves_group_of(&channel) => self.send_node(from, NodeMessage::MetaMissing(channel)),
                _ => {}
            },
            NodeMessage::MetaMissing(channel) => self.feed_shard(&channel.clone(), ShardInput::MetaMissing(channel)),
            NodeMessage::AppendForward { id, channel, sender, records } => {
                let records =
                    records.into_iter().map(|(key, payload)| AppendRecord { idempotency_key: key, payload }).collect();
                self.feed_shard(&channel.clone(), ShardInput::Forwarded { from, id, channel, sender, records });
            }
            NodeMessage::Ping => {}
            NodeMessage::EvidenceRequest { task, meta } => {
                self.controller.meta_seen(self.now, &meta);
                self.feed_shard(&meta.channel.clone(), ShardInput::Evidence { from, task, meta });
            }
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
                let index = shard_of_id(id, self.shards.count());
                self.feed_shard_at(index, ShardInput::Reply { id, result });
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
                    self.feed_shard(&channel.clone(), ShardInput::ReleaseHandoff { channel, count: 1 });
                }
                self.feed_fanout();
            }
        }
    }

    /// Moves effects of the slot driver and the channel machines into node effects.
    fn pump(&mut self) {
        loop {
            self.run_controller();
            self.drain_slot();
            let moved = self.drain_shards();
            // Shard outputs may have produced slot proposals (meta changes): drain those too.
            self.drain_slot();
            while let Some(effect) = self.fanout.poll_effect() {
                self.fanout_effect(effect);
            }
            // Slot outcomes and metas above may have moved controller tasks on: carry out their actions
            // now (their proposals and sends become effects on the next drain).
            self.run_controller();
            self.drain_slot();
            // What the shards asked for may have handed inputs to shards drained before: go round
            // again, unless there are effects to carry out first (the next poll comes back here).
            if !moved || !self.effects.is_empty() {
                // Slot changes above (a group joined or left, a migration learned) reach the shards now,
                // not only with their next input.
                self.tell_shards_what_is_served();
                return;
            }
        }
    }

    fn drain_slot(&mut self) {
        while let Some(effect) = self.slot.poll_effect() {
            self.slot_effect(effect);
        }
    }

    /// Drains the outputs of the shards the core drives, in index order. `true` if there were any.
    fn drain_shards(&mut self) -> bool {
        let mut moved = false;
        for index in 0..self.shards.count() {
            loop {
                let output = match &mut self.shards {
                    Shards::Inline(shards) => shards[index].poll_output(),
                    Shards::Detached { .. } => None,
                };
                let Some(output) = output else { break };
                moved = true;
                self.shard_output(output);
            }
        }
        moved
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
                self.learn_meta(meta, true);
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
}
