//! `NodeCore`: the sans-IO core of one node — its slot groups (multi-raft), its channel replica machines,
//! the route table, and the plumbing between them (meta propagation, append forwarding). The runtime
//! feeds it time, frames, storage completions and API calls, and carries out its effects; the simulator
//! drives the same code.

use super::config::NodeConfig;
use super::controller::{ClusterView, Controller, NodeView, PreferredLeaders, SlotMigrations, TaskReport};
use super::error::NodeError;
use super::fanout::{FanoutAnswer, FanoutWork};
use super::identity::{draw_storage_id, Identities, KnownStorages};
use super::message::{NodeMessage, SlotReadAnswer};
use super::shard::{
    shard_of, shard_of_id, CallOutcome, ChannelShard, LeaderCall, Lookup, LookupAnswer, Served, ShardInput,
};
use crate::frame::{decode_from, encode, FrameBody, FrameError, FrameLimits};
use bytes::Bytes;
use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use tidings_channel::fanout::{FanoutEffect, FanoutPlanner, MessageRef, Target};
use tidings_channel::machine::{AppendRecord, ChannelMachine, PersistToken, ReadToken};
use tidings_router::Router;
use tidings_slot::model::{SlotState, Uid};
use tidings_slot::query::SlotReader;
use tidings_slot::raft::{MultiRaft, ProposalId, ReadId};
use tidings_store::message::{LogBatch, MessageLog, Record};
use tidings_store::{MetaStore, RaftLogStore, StoreError};
use tidings_types::{ChannelId, GroupId, HashSlot, NodeId, Seq, StorageId, Time};

mod metadata;
mod operations;
mod remote_reads;
mod sender_checks;
mod shards;
mod slot_reads;
mod status;
mod stray_logs;

use metadata::{ProposalPurpose, Sent};
use remote_reads::RemoteReads;
use sender_checks::SenderChecks;
use shards::Shards;
pub(crate) use status::first_in_order;
pub use status::{ChannelStatus, NodeStatus};
pub use stray_logs::{LogPage, LogsListed, StrayLogConfig};

/// Most [`NodeEffect::Fanout`] work a core with `fanout` has handed out and not seen answered: its
/// planner's outstanding requests, the subscriber pages it serves its peers, and a failed plan's report
/// per place in flight (those have no answer). A runtime whose fanout queue holds this many never makes
/// the core wait for room in it.
pub(crate) fn fanout_work_max(fanout: &tidings_channel::fanout::FanoutConfig) -> usize {
    fanout
        .requests_max()
        .saturating_add(fanout.plans_in_flight_max)
        .saturating_add(remote_reads::PEER_PAGES_SERVING_MAX)
}

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
    /// A retention move: the channel's retention boundary in force, or why not.
    Retained(Result<Seq, NodeError>),
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
    /// [`NodeCore::handle_slots_synced`]. One sync may answer several: with the highest token asked.
    SyncSlots {
        /// Echo it. Zero when nothing waits on the sync but the writes before it (a peer's storage
        /// identity, recorded).
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
    /// A read a channel waits for (a replica's activation, an `append_from`'s sender check): carry it
    /// out with [`Lookup::carry_out`], off the thread that drives the core or the channel's shard, then
    /// call [`NodeCore::handle_lookup`]. The inputs that need it wait meanwhile (bounded).
    Lookup(Lookup),
    /// A page of the sweep for logs of replicas moved away: carry it out with [`LogPage::carry_out`], off
    /// the thread that drives the core, then call [`NodeCore::handle_logs_listed`]. A page lost is asked
    /// again after a while.
    ListLogs(LogPage),
    /// Post-commit fanout work (the planner's, or a subscriber page for a peer): carry it out with
    /// [`carry_out_fanout`](crate::node::carry_out_fanout), off the core thread, and hand the answer to
    /// [`NodeCore::handle_fanout`].
    Fanout(FanoutWork),
    /// An API call finished.
    Done {
        /// The call.
        id: ApiId,
        /// Its result.
        result: ApiResult,
    },
}

/// `true` for the messages that settle storage identities: all a node held back takes and sends.
fn is_identity_message(body: &FrameBody) -> bool {
    matches!(
        body,
        FrameBody::Node(
            NodeMessage::StorageHello | NodeMessage::StorageAccepted { .. } | NodeMessage::StorageRefused { .. }
        )
    )
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
    meta_reads: BTreeMap<ReadId, metadata::MetaRead>,
    effects: VecDeque<NodeEffect>,
    frame_limits: FrameLimits,
    fanout: FanoutPlanner,
    /// Committed messages waiting for room in the fanout queue (each still holds its channel's handoff slot).
    fanout_waiting: VecDeque<(ChannelId, Seq, Option<String>)>,
    /// Reads asked of nodes serving a slot group this one does not, and pages served to peers.
    remote_reads: RemoteReads,
    /// Fanout pages no node served in time (each ended a message's fanout early).
    fanout_pages_abandoned: u64,
    /// Subscriber pages this node's slot store failed to read (see `NodeStatus`).
    fanout_page_read_failures: u64,
    /// Committed messages of earlier leaders this node's channel leaders planned again.
    fanout_planned_again: u64,
    /// `append_from` calls waiting for answers from other nodes about their sender.
    sender_checks: SenderChecks,
    controller: Controller,
    preferred: PreferredLeaders,
    /// Messages this node sends to itself (the controller asking its own replica), handled in `pump`.
    loopback: VecDeque<NodeMessage>,
    refused_frames: BTreeMap<&'static str, u64>,
    /// The sweep for logs of replicas moved away.
    stray_logs: stray_logs::StrayLogSweep,
    /// This node's storage identity and its peers' (see `node::identity`).
    identities: Identities,
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
        // The first replicas, made only where the node holds none and never left one: none at all when it
        // joins a running cluster.
        let members: Vec<_> = config
            .slot_group_members()
            .into_iter()
            .filter(|(_, m)| !config.join_existing && m.contains(&config.node))
            .collect();
        let mut raft_config = config.raft.clone();
        raft_config.node = config.node;
        // Mixed with the node id: members of a group sharing a seed would otherwise draw the same pinned
        // election timeout and split their votes forever when their clocks tick in step.
        raft_config.seed = config.seed ^ config.node.get().wrapping_mul(0x9e37_79b9_7f4a_7c15);
        raft_config.boot_id = config.boot_id;
        raft_config.cluster = config.nodes.clone();
        let draw = || draw_storage_id(config.seed, config.node, config.boot_id);
        let identities = Identities::open(meta.identity(), config.nodes.len(), config.boot_id, now, draw)?;
        let slot = MultiRaft::open(raft_config, logs, meta.clone(), config.table(), &members, now)?;
        // Routes start from what this node learned of slot migrations before it stopped.
        let learned = slot.table();
        for hash_slot in tidings_types::HashSlot::all().filter(|s| learned.epoch_of(*s) > 0) {
            router.learn_slot_owner(hash_slot, learned.group_of(hash_slot), learned.epoch_of(hash_slot));
        }
        let frame_limits = FrameLimits { frame_bytes_max: config.frame_bytes_max };
        // Task ids share the boot-id range of the node's other ids, in their own upper half.
        let first_task = ((config.boot_id & 0xffff_ffff) << 32) | (1 << 31);
        let controller = Controller::new(
            config.controller.clone(),
            config.node,
            &config.nodes,
            config.channel_replicas,
            first_task,
            now,
        );
        let reader = SlotReader::new(meta);
        let served = Arc::new(Served::new(slot.table(), slot.groups().collect(), Vec::new(), reader.routes_version()));
        let count = config.reactors_or(1);
        let shards = (0..count)
            .map(|index| {
                let (log, reader, served) = (Arc::clone(&log), reader.clone(), Arc::clone(&served));
                ChannelShard::new(index, count, config.clone(), identities.shared(), log, reader, served, now)
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
            remote_reads: RemoteReads::default(),
            fanout_pages_abandoned: 0,
            fanout_page_read_failures: 0,
            fanout_planned_again: 0,
            sender_checks: SenderChecks::default(),
            controller,
            preferred: PreferredLeaders::default(),
            loopback: VecDeque::new(),
            refused_frames: BTreeMap::new(),
            stray_logs: stray_logs::StrayLogSweep::new(config.stray_logs.clone(), config.boot_id, now),
            identities,
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
        if let Some(hello) = self.identities.next_hello() {
            return hello;
        }
        let controller =
            self.controller.poll_timeout().min(self.preferred.poll_timeout()).min(self.migrations.poll_timeout());
        let mut next = self.slot.poll_timeout().min(controller);
        next = self.remote_reads.poll_timeout().map_or(next, |due| next.min(due));
        next = next.min(self.stray_logs.poll_timeout());
        if let Shards::Inline(shards) = &self.shards {
            next = shards.iter().filter_map(ChannelShard::poll_timeout).fold(next, Time::min);
        }
        next
    }

    /// Advances time: raft ticks, the controller, channel timers, appends that waited too long for a meta
    /// or a forwarded reply.
    pub fn handle_tick(&mut self, now: Time) {
        self.advance(now);
        if self.identities.quarantined() {
            // Held back: nothing runs but the hellos that may release it (see `node::identity`).
            match self.identities.try_release(self.now) {
                Ok(true) => {
                    self.tell_shards_what_is_served();
                    return;
                }
                Ok(false) => {}
                Err(error) => tracing::error!(%error, "could not record that the cluster took this node's identity"),
            }
            if self.identities.hello_due(self.now) {
                let peers: Vec<NodeId> = self.config.nodes.iter().copied().filter(|n| *n != self.config.node).collect();
                for peer in peers {
                    self.send_node(peer, NodeMessage::StorageHello);
                }
            }
            return;
        }
        self.slot.handle_tick(self.now);
        self.controller.tick(self.now, &self.slot, &self.reader);
        self.drive_migrations();
        let down = self.controller.down_nodes(self.now);
        let gone = self.controller.gone_nodes(self.now);
        let leaving = self.controller.leaving_nodes(self.now);
        let cluster = ClusterView { nodes: &self.config.nodes, down: &down, gone: &gone, leaving: &leaving };
        let view = NodeView { me: self.config.node, reader: &self.reader, cluster };
        self.preferred.tick(self.now, &self.config.controller, &mut self.slot, &view);
        self.retry_due_reads();
        self.sweep_stray_logs();
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
        let checked = decode_from(bytes, from, self.config.cluster, |n| nodes.contains(&n), &self.frame_limits)
            // The sender's start first: a peer refused for its identity is told so at the start it is in.
            .and_then(|frame| self.identities.peers().accept_start(&frame).map(|()| frame))
            .and_then(|frame| self.check_storage(from, frame.storage).map(|()| frame));
        let frame = match checked {
            Ok(frame) => frame,
            Err(error) => {
                *self.refused_frames.entry(error.kind()).or_default() += 1;
                return Err(error);
            }
        };
        self.handle_frame_body(from, frame.body);
        Ok(())
    }

    /// This node's storage identity: every frame it sends names it (see `node::identity`).
    pub fn storage_id(&self) -> StorageId {
        self.identities.own()
    }

    /// This start of the node as its frames name it (`Frame::start`: its `NodeConfig::boot_id`, 1 for 0);
    /// a frame addressed to another start of it is refused.
    pub fn start_id(&self) -> u64 {
        self.identities.peers().own_start()
    }

    /// The storage identities this node knows of its peers, for a runtime that checks frames on other
    /// threads: a frame whose sender is known with the identity it names may skip the core.
    pub(crate) fn known_storages(&self) -> Arc<KnownStorages> {
        self.identities.shared()
    }

    /// Takes a valid frame's storage identity: the first of a peer is recorded; another one than
    /// recorded is refused (its sender told, at most once a second).
    fn check_storage(&mut self, from: NodeId, storage: StorageId) -> Result<(), FrameError> {
        if from == self.config.node {
            // A frame this node sent itself names this directory's identity, and no other.
            let own = self.identities.own();
            return (storage == own).then_some(()).ok_or(FrameError::StorageChanged {
                node: from,
                known: own,
                got: storage,
            });
        }
        match self.identities.check(self.now, from, storage) {
            Ok(recorded) => {
                if recorded {
                    // Durable at once, not with the next raft round (an idle node may have none for
                    // long): a crash meanwhile would forget the identity and take the next one seen.
                    self.effects.push_back(NodeEffect::SyncSlots { token: 0 });
                }
                Ok(())
            }
            Err((error, tell)) => {
                if let (true, FrameError::StorageChanged { known, .. }) = (tell, &error) {
                    self.send_node(from, NodeMessage::StorageRefused { known: *known });
                }
                Err(error)
            }
        }
    }

    /// The body of a frame from `from` that the runtime decoded and checked already
    /// ([`crate::frame::decode_from`]) — a runtime that hands peer channel messages straight to the
    /// reactors gives the core the rest this way.
    pub(crate) fn handle_decoded(&mut self, now: Time, from: NodeId, body: FrameBody) {
        self.advance(now);
        self.handle_frame_body(from, body);
    }

    fn handle_frame_body(&mut self, from: NodeId, body: FrameBody) {
        if self.identities.quarantined() && !is_identity_message(&body) {
            // Held back until a majority took this node's identity (see `node::identity`).
            return;
        }
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

    /// A [`NodeEffect::SyncSlots`] failed: this node's slot replicas stop until it restarts
    /// ([`NodeStatus::slot_storage_failed`]); nothing the failed sync covered is ever acknowledged.
    pub fn handle_slots_sync_failed(&mut self, now: Time, error: &StoreError) {
        self.advance(now);
        self.slot.handle_sync_failed(self.now, error);
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

    /// A [`NodeEffect::Lookup`] finished: a loaded replica becomes active and takes the inputs that
    /// waited for it; a checked append goes on (admitted, refused, or checked through other nodes).
    pub fn handle_lookup(&mut self, now: Time, answer: LookupAnswer) {
        self.advance(now);
        let channel = answer.channel().clone();
        self.feed_shard(&channel, answer.into_input());
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
            FanoutAnswer::PageUnread(read) => self.page_unread(read),
            FanoutAnswer::PeerPage { to, request, page } => {
                self.remote_reads.served();
                let answer = match page {
                    Some((members, next)) => SlotReadAnswer::Page { members, next },
                    None => {
                        self.fanout_page_read_failures += 1;
                        SlotReadAnswer::NotServed
                    }
                };
                self.send_node(to, NodeMessage::SlotReadReply { request, answer });
            }
        }
    }

    /// Appends records to a channel; any node may be called (non-leaders forward). [`NodeEffect::Done`]
    /// with [`ApiResult::Appended`] follows once the records are committed.
    pub fn append(&mut self, now: Time, id: ApiId, channel: ChannelId, records: Vec<AppendRecord>) {
        self.advance(now);
        self.feed_shard(&channel.clone(), ShardInput::Append { api: id, channel, sender: None, records });
    }

    /// Gives up `channel`'s records through `through` (moves its retention boundary, like Kafka's
    /// `DeleteRecords`); any node may be called (non-leaders forward). The channel's leader refuses a
    /// boundary past its high watermark ([`AppendError::BeyondHw`](tidings_channel::machine::AppendError::BeyondHw)):
    /// only committed records can be given up. It proposes the boundary as the channel's next meta;
    /// [`NodeEffect::Done`] with [`ApiResult::Retained`] (the boundary in force) follows once that meta
    /// is in force on the leader. Reads then start after the boundary, and each replica trims its store
    /// when it applies the meta.
    pub fn set_retention(&mut self, now: Time, id: ApiId, channel: ChannelId, through: Seq) {
        self.advance(now);
        self.feed_shard(&channel.clone(), ShardInput::Retain { api: id, channel, through });
    }

    /// Appends records sent by user `sender`: like [`NodeCore::append`], after checking that the sender
    /// may send (not banned, not on the channel's deny list), and fanout marks the sender's own entry
    /// (`is_sender`: no unread increment). The check reads this node's slot replicas, and asks nodes
    /// that keep the user's or the channel's slot group where this one keeps none; it fails closed with
    /// [`NodeError::SenderUnverified`] when no node answers within `machine.append_timeout`.
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

    fn advance(&mut self, now: Time) {
        self.now = self.now.max(now);
    }

    fn done(&mut self, id: ApiId, result: ApiResult) {
        self.effects.push_back(NodeEffect::Done { id, result });
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
                let call = LeaderCall::Append { sender, records };
                self.feed_shard(&channel.clone(), ShardInput::Forwarded { from, id, channel, call });
            }
            NodeMessage::RetentionForward { id, channel, through } => {
                let call = LeaderCall::Retain { through };
                self.feed_shard(&channel.clone(), ShardInput::Forwarded { from, id, channel, call });
            }
            NodeMessage::Ping => {}
            NodeMessage::Leaving => self.controller.heard_leaving(from, self.now),
            NodeMessage::HandOffProgress { channels_led } => {
                // Only the cluster's slot groups: what a peer sends cannot grow the map past them.
                let groups: std::collections::BTreeSet<GroupId> = self.slot.genesis().groups().collect();
                let known = channels_led.into_iter().filter(|(group, _)| groups.contains(group));
                self.controller.hand_off_progress(known.map(|(group, led)| (group, led as usize)));
            }
            NodeMessage::StorageRefused { known } => self.identities.refused_by(self.now, from, known),
            NodeMessage::StorageHello => {
                // The frame passed the identity check: the identity recorded for `from` is the one it names.
                if let Some(storage) = self.identities.known(from) {
                    self.send_node(from, NodeMessage::StorageAccepted { storage });
                }
            }
            NodeMessage::StorageAccepted { storage } => match self.identities.accepted_by(self.now, from, storage) {
                Ok(true) => self.tell_shards_what_is_served(),
                Ok(false) => {}
                Err(error) => tracing::error!(%error, "could not record that the cluster took this node's identity"),
            },
            NodeMessage::EvidenceRequest { task, meta } => {
                self.controller.meta_seen(self.now, &meta);
                self.feed_shard(&meta.channel.clone(), ShardInput::Evidence { from, task, meta });
            }
            NodeMessage::EvidenceReply { task, channel, version, report } => {
                self.controller.evidence(self.now, from, task, &channel, version, report)
            }
            NodeMessage::ExportQuery { from: source, slot, to, epoch } => {
                self.answer_export_query(from, source, slot, to, epoch);
            }
            NodeMessage::ExportAnswer { from: source, slot, to, epoch, exporting } => {
                self.migrations.export_answer(source, slot, to, epoch, exporting);
            }
            NodeMessage::RequestFailover { channel, version } => self.failover_asked(from, channel, version),
            NodeMessage::AppendReply { id, result } => {
                let index = shard_of_id(id, self.shards.count());
                self.feed_shard_at(index, ShardInput::Reply { id, outcome: CallOutcome::Appended(result) });
            }
            NodeMessage::RetentionReply { id, result } => {
                let index = shard_of_id(id, self.shards.count());
                self.feed_shard_at(index, ShardInput::Reply { id, outcome: CallOutcome::Retained(result) });
            }
            NodeMessage::SlotReadRequest { request, query } => self.serve_read(from, request, query),
            NodeMessage::SlotReadReply { request, answer } => self.read_answered(from, request, answer),
            NodeMessage::MetaConfirm { request, channel } => self.serve_meta_confirm(from, request, channel),
            NodeMessage::MetaConfirmed { request, channel, meta } => self.meta_confirmed(from, request, channel, meta),
        }
    }

    /// A slot migration's target asks whether `source` still exports `slot` to it under `epoch`: only
    /// the source group's leader answers, from its store.
    fn answer_export_query(&mut self, from: NodeId, source: GroupId, slot: HashSlot, to: GroupId, epoch: u64) {
        if !self.slot.is_leader(source) {
            return;
        }
        // Anything but a record of this very export (or of its completion) means it was given up.
        let exporting = match self.reader.slot_record(source, slot) {
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

    /// A channel replica asks for a failover under meta `version`: only the group's leader acts, on the
    /// meta its store holds.
    fn failover_asked(&mut self, from: NodeId, channel: ChannelId, version: u64) {
        let group = self.slot.table().group_of_key(channel.route_key());
        if !self.slot.is_leader(group) {
            return;
        }
        if let Ok(Some(meta)) = self.reader.runtime_meta(&channel) {
            if meta.version > version {
                // The replica asks under a meta that was replaced (the push was lost): teach it.
                self.send_node(from, NodeMessage::MetaPush(meta));
            } else if meta.version == version {
                self.controller.failover_requested(self.now, from, meta);
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
        // A peer refused for its storage identity hears only that, and a node held back until a majority
        // took its identity says only hello (see `node::identity`).
        let identity = is_identity_message(&body);
        let refused = matches!(body, FrameBody::Node(NodeMessage::StorageRefused { .. }));
        if (!identity && self.identities.quarantined()) || (!refused && self.identities.shared().refuses(to)) {
            return;
        }
        let frame = encode(&self.identities.peers().frame(self.config.cluster, self.config.node, to, body));
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
                Ok(_) => {}
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
                self.fetch_fanout_page(job, channel, cursor, limit)
            }
            host_work @ (FanoutEffect::Locate { .. } | FanoutEffect::Deliver(_) | FanoutEffect::Failed(_)) => {
                self.effects.push_back(NodeEffect::Fanout(FanoutWork::Planner(host_work)));
            }
            FanoutEffect::Finished { message, .. } => {
                let MessageRef { channel, seq, .. } = message;
                self.feed_shard(&channel.clone(), ShardInput::FanoutFinished { channel, seq });
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
}
