//! The threaded runtime around [`NodeCore`]: the production shell. It only moves inputs to the core and
//! its channel shards and carries out their effects; every protocol decision is in the sans-IO code.
//!
//! Threads:
//! - one core thread (`core_thread`): the `NodeCore` with its slot groups, controller, routing and
//!   fanout planner, its timers and the metadata API calls;
//! - reactors (`reactor`, `NodeConfig::reactors`; by default one per two cores): each runs one channel
//!   shard — the channel replicas whose channels hash to it — with its own mailbox and timers; API
//!   appends, reads and `latest` go straight to the channel's reactor;
//! - IO workers (`workers`): a slot-sync worker (one fsync of the metadata/raft store for every sync
//!   asked since the last), durable-append workers (each stages the queued channel batches of every
//!   reactor and makes them durable with one journal sync: group commit across channels; two by
//!   default, so one stages while the other waits for its fdatasync), one reader (store reads for
//!   pulls), one fanout worker (subscriber pages, and the host's presence and delivery calls);
//! - and the message log's write-behind thread.
//!
//! Writes and syncs never run on the core or a reactor thread. Reads do, where the answer is needed at
//! once: a channel's activation (its log state and recent records), `Node::read`, a sender check against
//! the local slot replica, and a meta looked up there; they mostly hit sled's and the journal's caches.
//! Every queue is bounded: a full inbox or mailbox (`NodeConfig::inbox_max`, `mailbox_max`) drops
//! inbound frames (the protocols resend) and refuses API calls with `Overloaded`. No thread waits on
//! another that may wait on it: the core and the reactors offer each other what does not fit again
//! later, and the workers answer on queues the work they were given bounds (the reactors' completions,
//! the core's worker answers), so the core's bounded waits for room in the slot-sync and fanout
//! queues always end.
#![allow(clippy::disallowed_methods)] // The runtime shell is where the clock is read.

mod calls;
mod core_thread;
mod handle;
mod reactor;
mod workers;

use crate::frame::{decode_from, Frame, FrameBody, FrameLimits};
use crate::node::identity::KnownStorages;
use crate::node::shard::{shard_of, ShardStatus};
use crate::node::FanoutWork;
use crate::node::{
    fanout_work_max, ApiResult, ChannelStatus, FanoutHost, NoFanout, NodeConfig, NodeCore, NodeError, NodeStatus,
    TaskReport, QUEUE_CAPACITY_MAX,
};
use bytes::Bytes;
use calls::{Calls, Io, Reply};
use core_thread::{Call, Input, Shell};
use crossbeam_channel::{bounded, unbounded, RecvTimeoutError, Sender, TrySendError};
use handle::Completer;
pub use handle::{AppendHandle, Pending};
use reactor::{Reactor, ReactorInput};
use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use tidings_channel::machine::{AppendRecord, ChannelMessage, PersistToken};
use tidings_router::Router;
use tidings_slot::command::Command;
use tidings_slot::model::{ChannelInfo, Uid};
use tidings_slot::query::SlotReader;
use tidings_store::message::{
    JournalConfig, JournalLog, JournalStats, LogBatch, MessageLog, Record, WriteBehindThread,
};
use tidings_store::{Kv, MetaStore, RaftLogStore, SledKv, StoreError};
use tidings_types::{ChannelId, GroupId, HashSlot, NodeId, Seq, Time};
use workers::{Completions, ReadJob, WorkQueues, Workers};

/// How a node sends frames to its peers. Implemented by the host (its network stack).
pub trait Transport: Send + Sync + 'static {
    /// Sends `frame` to `to` without blocking. Frames may be lost, delayed, reordered or delivered
    /// twice (a transport may send again what it had in flight when a connection broke, even to the
    /// peer's next start): the protocols resend what matters, take a forwarded request once per start,
    /// and refuse a frame addressed to an earlier start of their node.
    fn send(&self, to: NodeId, frame: Bytes);
}

/// Names the slot group a metadata read is about: the one owning a user or a channel.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RouteKey {
    /// The group owning this user's records.
    Uid(Uid),
    /// The group owning this channel's records.
    Channel(ChannelId),
}

/// Where a node keeps its data, and storage limits.
#[derive(Clone, Debug)]
pub struct StorageOptions {
    /// Directory of the node's sled database and message journal.
    pub data_dir: PathBuf,
    /// sled page cache, bytes. Default 64 MiB.
    pub sled_cache_bytes: u64,
    /// Message journal configuration.
    pub journal: JournalConfig,
    /// Durable-append workers. Each takes a round of queued channel batches, stages them and makes them
    /// durable with one journal sync; while one waits for its `fdatasync`, the next stages the following
    /// round (the journal runs one sync at a time and lets staging go on meanwhile). A channel has at
    /// most one batch in flight, so its batches never overtake each other. Default 2.
    pub durable_workers: usize,
    /// Channel batches waiting for the durable-append workers. A reactor whose batch the full queue does
    /// not take keeps it and offers it again every millisecond (never blocking on the queue); the
    /// channel's own pending appends fill meanwhile, and new ones get `Busy`. Default 16,384.
    pub durable_queue_max: usize,
    /// Jobs waiting for the reader thread: follower pulls the leader cannot answer from memory, API reads
    /// of records not in memory, activations' loads and sender checks. Over it a pull is dropped (the
    /// follower pulls again), an API read answers `NodeError::Overloaded`, and a load or a check waits
    /// in its reactor, offered again every millisecond. Default 4,096.
    pub read_queue_max: usize,
    /// Zero-fill the journal's spare segments before the node starts serving
    /// ([`JournalLog::fill_spares`]): its first segments then sync as fast as recycled ones (a fresh,
    /// preallocated segment's first writes make each `fdatasync` also commit file-system metadata).
    /// Costs writing two or three `journal.segment_bytes` (64 MiB) of zeros at start; under steady load
    /// write-behind recycles segments as spares anyway. Default `false`.
    pub journal_spares_at_start: bool,
}

impl StorageOptions {
    /// Defaults in `data_dir`.
    pub fn new(data_dir: impl Into<PathBuf>) -> Self {
        Self {
            data_dir: data_dir.into(),
            sled_cache_bytes: 64 << 20,
            journal: JournalConfig::default(),
            durable_workers: 2,
            durable_queue_max: GROUP_COMMIT_MAX * 4,
            read_queue_max: 4096,
            journal_spares_at_start: false,
        }
    }

    /// Checks the options the runtime reads (the journal checks its own at open).
    pub fn validate(&self) -> Result<(), &'static str> {
        if self.durable_workers == 0 || self.durable_queue_max == 0 || self.read_queue_max == 0 {
            return Err("durable_workers, durable_queue_max and read_queue_max must be positive");
        }
        Ok(())
    }
}

/// How long a durable-append worker waits for room in the message log's memory table before it fails a
/// batch.
const ROOM_PATIENCE: Duration = Duration::from_secs(30);
/// Most channel batches one durable-append round stages before its sync.
const GROUP_COMMIT_MAX: usize = 4096;
/// Slot-store syncs asked and not yet taken by the slot-sync worker (it takes them all at once, with
/// one fsync).
const SYNC_QUEUE_MAX: usize = 1024;
/// Fewest places of the fanout worker's queue (160 hold all the work the default fanout limits hand
/// out).
const FANOUT_QUEUE_MIN: usize = 4096;
/// How long an API call waits for its result.
const CALL_TIMEOUT: Duration = Duration::from_secs(30);
/// How often [`Node::wait_ready`] looks at the slot groups.
const READY_POLL: Duration = Duration::from_millis(10);
/// How often `Node::hand_off_leaderships` looks at the status (each look builds a page of channel
/// statuses).
const HAND_OFF_POLL: Duration = Duration::from_millis(50);
/// How long `Node::hand_off_leaderships` waits, once the node leads nothing, before it returns: the
/// other nodes learn the new leaders in the same raft rounds, or a heartbeat later, and a call they
/// still forward here meanwhile is answered with a redirect rather than lost with the stopped node.
const HAND_OFF_SETTLE: Duration = Duration::from_millis(250);
/// How long a replica replacement call waits (the controller's catch-up timeout is 120 s by default).
const REPLACE_TIMEOUT: Duration = Duration::from_secs(180);
/// A core or reactor step taking this long is logged.
const STEP_STALL_WARNING: Duration = Duration::from_millis(500);

/// The checks of an inbound frame: this cluster, a member sender, the size limit, the sender's storage
/// identity.
struct FrameGate {
    cluster: u64,
    nodes: Vec<NodeId>,
    limits: FrameLimits,
    /// Peers' storage identities as the core recorded them: a frame naming another (or a peer not
    /// recorded yet) goes to the core, which decides (see `node::identity`).
    storages: Arc<KnownStorages>,
}

/// The runtime's clock: milliseconds since the node started, the `now` every thread hands the cores
/// (the wall clock at that start is the machines' `clock_origin_unix_ms`).
#[derive(Clone, Copy)]
struct Clock {
    started: Instant,
}

impl Clock {
    fn now(&self) -> Time {
        Time::from_millis(u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX))
    }
}

/// A running node. Dropping it stops it cleanly: its active channel replicas write their checkpoints
/// (HW, fanout progress; waited for at most 2 s), its threads are joined after a last write-behind, and
/// its metadata store is synced. Before a planned stop (a
/// restart, an upgrade), [`Node::hand_off_leaderships`] moves what it leads to the other nodes, so its
/// channels need no failover.
pub struct Node {
    id: NodeId,
    /// What an inbound frame is checked against.
    gate: FrameGate,
    inbox: Sender<Input>,
    /// Each channel shard's reactor mailbox, by shard index.
    reactors: Vec<Sender<ReactorInput>>,
    threads: Vec<JoinHandle<()>>,
    _write_behind: WriteBehindThread,
    journal: Arc<JournalLog>,
    kv: Arc<dyn Kv>,
    router: Arc<Router>,
    dropped_frames: Arc<AtomicU64>,
    /// `NodeConfig::status_channels_max`.
    status_channels_max: usize,
}

impl Node {
    /// Starts a node without fanout (see [`Node::start_with_fanout`]).
    pub fn start(
        config: NodeConfig,
        storage: StorageOptions,
        transport: Arc<dyn Transport>,
    ) -> Result<Node, NodeError> {
        let config = NodeConfig { fanout_enabled: false, ..config };
        Self::start_with_fanout(config, storage, transport, Arc::new(NoFanout))
    }

    /// Starts a node: opens (or creates) its stores in `storage.data_dir`, then its threads. Committed
    /// messages fan out to their channels' online subscribers through `fanout`.
    pub fn start_with_fanout(
        config: NodeConfig,
        storage: StorageOptions,
        transport: Arc<dyn Transport>,
        fanout: Arc<dyn FanoutHost>,
    ) -> Result<Node, NodeError> {
        let refused = |what| NodeError::Storage(StoreError::BadConfig { what });
        config.validate().map_err(refused)?;
        storage.validate().map_err(refused)?;
        let clock = Clock { started: Instant::now() };
        let config = for_this_start(config);
        let Stores { kv, logs, journal } = open_stores(&storage)?;
        let write_behind = journal.start_write_behind();
        let log: Arc<dyn MessageLog> = journal.clone();
        let router = Arc::new(Router::new(config.table()));
        let id = config.node;
        let (cluster, nodes) = (config.cluster, config.nodes.clone());
        let limits = FrameLimits { frame_bytes_max: config.frame_bytes_max };
        let status_channels_max = config.status_channels_max;
        let (inbox_max, mailbox_max) = (config.inbox_max, config.mailbox_max);
        // Room for all the work the core may have handed out, so the core's wait for room in the fanout
        // queue (see `core_thread`) never comes but with fanout limits configured past 16 Mi. At least
        // `FANOUT_QUEUE_MIN` all the same: the count is a reasoned bound, and room is cheap.
        let fanout_queue_max = fanout_work_max(&config.fanout).clamp(FANOUT_QUEUE_MIN, QUEUE_CAPACITY_MAX);
        let mut core =
            NodeCore::new(config, logs, MetaStore::new(kv.clone()), log.clone(), Arc::clone(&router), clock.now())?;
        let gate = FrameGate { cluster, nodes, limits, storages: core.known_storages() };
        let shards = core.detach_shards();
        let (inbox, inputs) = bounded(inbox_max);
        let (answer_tx, answers) = unbounded();
        let (sync_tx, sync_rx) = bounded::<u64>(SYNC_QUEUE_MAX);
        let (persist_tx, persist_rx) = bounded::<(PersistToken, LogBatch)>(storage.durable_queue_max);
        let (read_tx, read_rx) = bounded::<ReadJob>(storage.read_queue_max);
        let (fanout_tx, fanout_rx) = bounded::<FanoutWork>(fanout_queue_max);
        let (mailboxes, mailbox_rx): (Vec<_>, Vec<_>) = shards.iter().map(|_| bounded(mailbox_max)).unzip();
        let (completion_tx, completion_rx): (Vec<_>, Vec<_>) = shards.iter().map(|_| unbounded()).unzip();
        let io = Io { transport, persist_tx, read_tx };
        let dropped_frames = Arc::new(AtomicU64::new(0));
        let queues = WorkQueues { syncs: sync_rx, persists: persist_rx, reads: read_rx, fanout: fanout_rx };
        let workers =
            Workers { kv: kv.clone(), log, fanout, completions: Completions::new(completion_tx), answers: answer_tx };
        let mut threads = workers.spawn(storage.durable_workers, queues);
        for ((shard, mailbox), completions) in shards.into_iter().zip(mailbox_rx).zip(completion_rx) {
            let mut reactor = Reactor {
                shard,
                clock,
                io: io.clone(),
                core: inbox.clone(),
                calls: Calls::default(),
                for_core: Vec::new(),
                not_taken: VecDeque::new(),
            };
            threads.push(spawn("tidings-reactor", move || reactor.run(&mailbox, &completions)));
        }
        threads.push(spawn("tidings-core", {
            let mut shell = Shell {
                core,
                clock,
                io,
                sync_tx,
                fanout_tx,
                calls: Calls::default(),
                parked: mailboxes.iter().map(|_| VecDeque::new()).collect(),
                reactors: mailboxes.clone(),
                dropped_frames: Arc::clone(&dropped_frames),
            };
            move || shell.run(&inputs, &answers)
        }));
        Ok(Node {
            id,
            gate,
            inbox,
            reactors: mailboxes,
            threads,
            _write_behind: write_behind,
            journal,
            kv,
            router,
            dropped_frames,
            status_channels_max,
        })
    }

    /// This node's id.
    pub fn id(&self) -> NodeId {
        self.id
    }

    /// How many reactor threads run this node's channels (`NodeConfig::reactors`, or the runtime's
    /// choice when it was left at 0).
    pub fn reactors(&self) -> usize {
        self.reactors.len()
    }

    /// The routes this node uses now: the hash-slot table (with every slot migration it learned) and the
    /// slot groups' leaders as observed. Never blocks.
    pub fn routes(&self) -> Arc<tidings_router::RouteTable> {
        self.router.snapshot()
    }

    /// Hands an inbound frame from `from` to the node. Never blocks: when the inbox (or a reactor's
    /// mailbox) is full the frame is dropped and counted (the protocols resend).
    ///
    /// The frame is decoded and checked on the calling thread; its channel messages go straight to
    /// their channels' reactors, the rest to the core thread. A frame that fails the checks goes to the
    /// core thread as it came, which refuses it and counts it in [`NodeStatus::refused_frames`].
    pub fn handle_frame(&self, from: NodeId, bytes: Bytes) {
        let gate = &self.gate;
        let is_member = |node: NodeId| gate.nodes.contains(&node);
        let input = match decode_from(&bytes, from, gate.cluster, is_member, &gate.limits) {
            Err(_) => Input::Frame { from, bytes },
            // A sender's other identity, this node held back, or a frame addressed to another start of
            // it: the core decides.
            Ok(frame)
                if !gate.storages.matches(frame.from, frame.storage)
                    || gate.storages.quarantined()
                    || gate.storages.accept_start(&frame).is_err() =>
            {
                Input::Frame { from, bytes }
            }
            Ok(Frame { body: FrameBody::Channel(message), .. }) => return self.to_reactors(from, vec![message]),
            Ok(Frame { body: FrameBody::Channels(messages), .. }) => return self.to_reactors(from, messages),
            Ok(Frame { body, .. }) => Input::Decoded { from, body },
        };
        if self.inbox.try_send(input).is_err() {
            self.dropped_frames.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Hands a peer's channel messages to their reactors, in order, one mailbox message per reactor.
    fn to_reactors(&self, from: NodeId, messages: Vec<ChannelMessage>) {
        if let [reactor] = self.reactors.as_slice() {
            // One reactor takes the frame's messages as they came: nothing to split.
            return self.offer(reactor, from, messages);
        }
        let mut per_reactor: Vec<Vec<ChannelMessage>> = self.reactors.iter().map(|_| Vec::new()).collect();
        for message in messages {
            per_reactor[shard_of(message.channel(), self.reactors.len())].push(message);
        }
        for (reactor, messages) in self.reactors.iter().zip(per_reactor).filter(|(_, m)| !m.is_empty()) {
            self.offer(reactor, from, messages);
        }
    }

    /// Puts one reactor's share of a peer frame in its mailbox; a full mailbox drops it (counted).
    fn offer(&self, reactor: &Sender<ReactorInput>, from: NodeId, messages: Vec<ChannelMessage>) {
        if reactor.try_send(ReactorInput::Messages { from, messages }).is_err() {
            self.dropped_frames.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Frames (or peer channel messages in them) dropped because the inbox or a reactor's mailbox was
    /// full.
    pub fn dropped_frames(&self) -> u64 {
        self.dropped_frames.load(Ordering::Relaxed)
    }

    /// The message log's counters and gauges: group commits and how long their syncs took
    /// (`sync_latency`; two snapshots give a period's percentiles), frames, write-behind rounds and the
    /// record bytes still waiting for write-behind (`mem_bytes`: a backlog near
    /// `JournalConfig::mem_bytes_max` means appends are about to wait), journal segments on disk. Does
    /// not go through the core thread.
    pub fn message_log_stats(&self) -> JournalStats {
        self.journal.stats()
    }

    /// Applies a metadata command through the slot layer (any node may be called).
    pub fn propose(&self, command: Command) -> Result<(), NodeError> {
        self.propose_async(command).wait()
    }

    /// [`Node::propose`] without blocking: `.await` the outcome (on any async runtime) or wait on it.
    ///
    /// ```no_run
    /// # async fn demo(node: &tidings::Node) -> Result<(), tidings::node::NodeError> {
    /// use tidings::slot::{command::Command, model::{Uid, User}};
    /// let uid = Uid::new("alice").expect("a short uid");
    /// node.propose_async(Command::PutUser(User { uid, name: "Alice".into(), banned: false })).await?;
    /// # Ok(()) }
    /// ```
    pub fn propose_async(&self, command: Command) -> Pending<()> {
        self.call_pending(Call::Propose(command))
    }

    /// Creates a channel and its runtime meta (replicas, leader, ISR, MinISR).
    pub fn create_channel(&self, info: ChannelInfo) -> Result<(), NodeError> {
        self.create_channel_async(info).wait()
    }

    /// [`Node::create_channel`] without blocking: `.await` the outcome or wait on it.
    pub fn create_channel_async(&self, info: ChannelInfo) -> Pending<()> {
        self.call_pending(Call::CreateChannel(info))
    }

    /// Starts an append (any node may be called: non-leaders forward): wait on the handle, or `.await` it.
    pub fn append(&self, channel: ChannelId, records: Vec<AppendRecord>) -> Result<AppendHandle, NodeError> {
        self.send_append_for_handle(channel, None, records)
    }

    /// Starts an append and calls `then` with its outcome (the seqs once committed, or why not) — for a
    /// host that completes its own futures or requests instead of blocking a thread per append.
    ///
    /// `then` runs on the channel's reactor thread: it must be short and must not block (hand the result
    /// on, wake a task). It is called exactly once, with [`NodeError::Stopped`] if the node stops first;
    /// when this returns an error (`Overloaded`, `Stopped`) it is never called.
    ///
    /// ```no_run
    /// # fn demo(node: &tidings::Node, channel: tidings::types::ChannelId) -> Result<(), tidings::node::NodeError> {
    /// use tidings::channel::machine::AppendRecord;
    /// let (done, outcome) = std::sync::mpsc::channel();
    /// let record = AppendRecord { idempotency_key: None, payload: bytes::Bytes::from_static(b"hi") };
    /// node.append_then(channel, vec![record], move |result| drop(done.send(result)))?;
    /// let seqs = outcome.recv().expect("called once")?;
    /// # let _ = seqs; Ok(()) }
    /// ```
    pub fn append_then(
        &self,
        channel: ChannelId,
        records: Vec<AppendRecord>,
        then: impl FnOnce(Result<Vec<Seq>, NodeError>) + Send + 'static,
    ) -> Result<(), NodeError> {
        self.send_append(channel, None, records, Reply::then(then))
    }

    /// [`Node::append_from`] with its outcome handed to `then`, as [`Node::append_then`] does: `then` runs
    /// on a reactor thread (short, never blocking), exactly once unless this returns an error. A sender
    /// refused by the channel's rules gets `then(Err(SenderBanned | SenderDenied))`; one no node could
    /// check in time, `Err(SenderUnverified)`.
    ///
    /// ```no_run
    /// # fn demo(node: &tidings::Node, channel: tidings::types::ChannelId) -> Result<(), tidings::node::NodeError> {
    /// use tidings::{channel::machine::AppendRecord, slot::model::Uid};
    /// let (done, outcome) = std::sync::mpsc::channel();
    /// let record = AppendRecord { idempotency_key: None, payload: bytes::Bytes::from_static(b"hi") };
    /// let sender = Uid::new("alice").expect("a short uid");
    /// node.append_from_then(channel, sender, vec![record], move |result| drop(done.send(result)))?;
    /// let seqs = outcome.recv().expect("called once")?;
    /// # let _ = seqs; Ok(()) }
    /// ```
    pub fn append_from_then(
        &self,
        channel: ChannelId,
        sender: Uid,
        records: Vec<AppendRecord>,
        then: impl FnOnce(Result<Vec<Seq>, NodeError>) + Send + 'static,
    ) -> Result<(), NodeError> {
        self.send_append(channel, Some(sender), records, Reply::then(then))
    }

    /// Appends records sent by user `sender`: refused with `SenderBanned` / `SenderDenied` when the user is
    /// banned or on the channel's deny list, and fanout marks the sender's own entry (no unread
    /// increment). See [`NodeCore::append_from`].
    pub fn append_from(
        &self,
        channel: ChannelId,
        sender: Uid,
        records: Vec<AppendRecord>,
    ) -> Result<AppendHandle, NodeError> {
        self.send_append_for_handle(channel, Some(sender), records)
    }

    /// Hands an append to its channel's reactor, its outcome to the handle returned.
    fn send_append_for_handle(
        &self,
        channel: ChannelId,
        sender: Option<Uid>,
        records: Vec<AppendRecord>,
    ) -> Result<AppendHandle, NodeError> {
        let (handle, completer) = AppendHandle::new();
        self.send_append(channel, sender, records, Reply::then(move |outcome| completer.complete(outcome)))?;
        Ok(handle)
    }

    /// Hands an append to its channel's reactor.
    fn send_append(
        &self,
        channel: ChannelId,
        sender: Option<Uid>,
        records: Vec<AppendRecord>,
        reply: Reply,
    ) -> Result<(), NodeError> {
        let reactor = self.reactor_of(&channel);
        send_to(reactor, ReactorInput::Append { channel, sender, records, reply })
    }

    fn reactor_of(&self, channel: &ChannelId) -> &Sender<ReactorInput> {
        &self.reactors[shard_of(channel, self.reactors.len())]
    }

    /// Moves the leadership of `channel` to `target`, an in-sync replica: fence, drain, switch with the
    /// drain proof, unfence (see [`NodeCore::transfer_leader`]). Appends during the move fail with
    /// `Fenced` and may be retried. Returns the task's report.
    ///
    /// ```no_run
    /// # fn demo(node: &tidings::Node, channel: tidings::types::ChannelId) -> Result<(), tidings::node::NodeError> {
    /// let report = node.transfer_leader(channel, tidings::types::NodeId::new(2))?;
    /// println!("{} now leads in epoch {:?}", 2, report.new_leader);
    /// # Ok(()) }
    /// ```
    pub fn transfer_leader(&self, channel: ChannelId, target: NodeId) -> Result<TaskReport, NodeError> {
        self.task(Call::TransferLeader { channel, target }, CALL_TIMEOUT)
    }

    /// Replaces replica `from` of `channel` by node `to`: `to` catches up as a learner while appends go
    /// on, then a short fence, one meta change (`to` into the ISR, `from` out, leadership handed over if
    /// `from` led), unfence (see [`NodeCore::replace_replica`]). Waits up to the controller's catch-up
    /// and drain timeouts; returns the task's report. A replacement whose new replica does not catch
    /// up in time fails with `TaskError::DrainTimedOut` and, in a healthy channel, takes that learner
    /// out again (`TaskKind::RemoveLearner`): the members stay as they were.
    pub fn replace_replica(&self, channel: ChannelId, from: NodeId, to: NodeId) -> Result<TaskReport, NodeError> {
        self.task(Call::ReplaceReplica { channel, from, to }, REPLACE_TIMEOUT)
    }

    /// Sets the controller's intent for a slot group: its desired voters, the configuration epoch the
    /// intent is for, and its preferred leader. The group's leader hands leadership to the preferred node
    /// when that is safe (see `NodeStatus::leadership` for each decision and why).
    pub fn set_group_intent(&self, intent: tidings_slot::model::GroupIntent) -> Result<(), NodeError> {
        self.call(Call::SetGroupIntent(intent))
    }

    /// Starts moving `group`'s replica from voter `from` to node `to` (see [`NodeCore::move_slot_replica`]).
    /// Returns once the move is recorded; the group's leader carries it out, and
    /// [`NodeStatus::leadership`] on that leader shows its step.
    pub fn move_slot_replica(&self, group: GroupId, from: NodeId, to: NodeId) -> Result<(), NodeError> {
        self.call(Call::MoveSlotReplica { group, from, to })
    }

    /// Sets (or clears) `group`'s preferred leader (see [`NodeCore::set_preferred_leader`]).
    pub fn set_preferred_leader(&self, group: GroupId, preferred: Option<NodeId>) -> Result<(), NodeError> {
        self.call(Call::SetPreferredLeader { group, preferred })
    }

    /// Drains `node` (`drain: true`) or stops draining it (see [`NodeCore::drain_node`]). Returns once
    /// every slot group recorded it; [`NodeStatus::drains`] shows the progress.
    pub fn drain_node(&self, node: NodeId, drain: bool) -> Result<(), NodeError> {
        self.call(Call::DrainNode { node, drain })
    }

    /// This node starts (`true`) or stops leaving (see [`NodeCore::set_leaving`]): it hands off its
    /// leaderships and takes no new ones. [`Node::hand_off_leaderships`] also waits for the hand-off.
    pub fn set_leaving(&self, leaving: bool) -> Result<(), NodeError> {
        self.call(Call::SetLeaving(leaving))
    }

    /// Before a planned stop (a restart, an upgrade): marks this node leaving and waits until it has led
    /// no channel, active or idle, and no slot group for a quarter of a second (the other nodes learn
    /// the new leaders meanwhile), so that its channels keep taking appends through the stop instead of
    /// waiting for a failover. The other nodes do the moves (see [`NodeCore::set_leaving`]), and the
    /// leader of each slot group tells it what is left in its slots after each repair pass
    /// ([`NodeStatus::channels_left_to_hand_off`]). [`NodeError::TimedOut`] if something is still led
    /// after `timeout` (no live member to take over, say — a one-node cluster never hands anything
    /// off): the node stays leaving, and may be dropped anyway; a channel still led then fails over
    /// after the stop. A restarted node is no longer leaving.
    ///
    /// ```no_run
    /// # fn demo(node: tidings::Node) -> Result<(), tidings::node::NodeError> {
    /// use std::time::Duration;
    /// if let Err(error) = node.hand_off_leaderships(Duration::from_secs(10)) {
    ///     eprintln!("stopping with leaderships left: {error}");
    /// }
    /// drop(node); // threads joined, stores synced
    /// # Ok(()) }
    /// ```
    pub fn hand_off_leaderships(&self, timeout: Duration) -> Result<(), NodeError> {
        let deadline = Instant::now() + timeout;
        self.set_leaving(true)?;
        let mut led_nothing_since = None;
        loop {
            let status = self.status()?;
            if !status.handed_off() {
                led_nothing_since = None;
            } else if led_nothing_since.get_or_insert_with(Instant::now).elapsed() >= HAND_OFF_SETTLE {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(NodeError::TimedOut);
            }
            std::thread::sleep(HAND_OFF_POLL);
        }
    }

    /// Forgets the storage identity this node knew for `node` (see
    /// [`NodeCore::forget_storage_identity`]): the last step of the procedure for a node whose data
    /// directory was lost, called on every node once that node's drain is done. Its next identity is
    /// then taken.
    pub fn forget_storage_identity(&self, node: NodeId) -> Result<(), NodeError> {
        self.call(Call::ForgetStorageIdentity(node))
    }

    /// Starts migrating hash slot `slot` to group `to` (see [`NodeCore::migrate_slot`]). Returns once the
    /// slot's group recorded the export; its leader carries it out, and [`NodeStatus::slot_migrations`]
    /// on that leader shows the step.
    ///
    /// ```no_run
    /// # fn demo(node: &tidings::Node) -> Result<(), tidings::node::NodeError> {
    /// use tidings::types::{GroupId, HashSlot};
    /// let slot = HashSlot::new(17).expect("below 256");
    /// node.migrate_slot(slot, GroupId::new(2))?;
    /// # Ok(()) }
    /// ```
    pub fn migrate_slot(&self, slot: HashSlot, to: GroupId) -> Result<(), NodeError> {
        self.call(Call::MigrateSlot { slot, to })
    }

    /// Abandons the migration of `slot` before it is fenced (see [`NodeCore::abort_slot_migration`]).
    pub fn abort_slot_migration(&self, slot: HashSlot) -> Result<(), NodeError> {
        self.call(Call::AbortSlotMigration(slot))
    }

    /// Abandons `group`'s replica move (see [`NodeCore::abort_slot_move`]).
    pub fn abort_slot_move(&self, group: GroupId) -> Result<(), NodeError> {
        self.call(Call::AbortSlotMove(group))
    }

    fn task(&self, call: Call, timeout: Duration) -> Result<TaskReport, NodeError> {
        let (reply, receiver) = bounded(1);
        self.send_input(Input::Call { call, reply: Reply::Wait(reply) })?;
        match receiver.recv_timeout(timeout) {
            Ok(ApiResult::Task(result)) => result,
            Ok(_) | Err(RecvTimeoutError::Disconnected) => Err(NodeError::Stopped),
            Err(RecvTimeoutError::Timeout) => Err(NodeError::TimedOut),
        }
    }

    /// Gives up `channel`'s records through `through` — a chat's history older than a retention period,
    /// or a conversation cleared — and returns the retention boundary in force (at least `through`).
    /// Any node may be called; the channel's leader checks the boundary against its high watermark
    /// (only committed records can be given up: past it, [`NodeError::Append`] with
    /// [`AppendError::BeyondHw`](crate::channel::machine::AppendError::BeyondHw)) and makes it the
    /// channel's next meta through its slot group. Reads then start after the boundary, and every replica
    /// trims its store (within its next write-behind round). A boundary never moves back: asking for one
    /// at or below the boundary in force returns that one. `Aborted` (timeout, leadership change): the
    /// move may still come into force; ask again. The idempotency keys of records given up are
    /// forgotten once the move is in force: a retry of one appends it again.
    ///
    /// ```no_run
    /// # fn demo(node: &tidings::Node, channel: tidings::types::ChannelId) -> Result<(), tidings::node::NodeError> {
    /// let hw = node.latest(&channel)?;
    /// let boundary = node.set_retention(channel.clone(), hw)?; // clear the conversation
    /// assert!(node.read(&channel, tidings::types::Seq::new(1), 100)?.iter().all(|r| r.seq > boundary));
    /// # Ok(()) }
    /// ```
    pub fn set_retention(&self, channel: ChannelId, through: Seq) -> Result<Seq, NodeError> {
        self.set_retention_async(channel, through).wait()
    }

    /// [`Node::set_retention`] without blocking: `.await` it or wait on it.
    pub fn set_retention_async(&self, channel: ChannelId, through: Seq) -> Pending<Seq> {
        offer(self.reactor_of(&channel), |completer| {
            let reply = Reply::Then(Box::new(move |result| completer.complete(reactor::retained(result))));
            ReactorInput::Retain { channel, through, reply }
        })
    }

    /// The latest committed seq (high watermark) of a channel this node replicates.
    pub fn latest(&self, channel: &ChannelId) -> Result<Seq, NodeError> {
        self.latest_async(channel).wait()
    }

    /// [`Node::latest`] without blocking: `.await` it or wait on it.
    pub fn latest_async(&self, channel: &ChannelId) -> Pending<Seq> {
        offer(self.reactor_of(channel), |reply| ReactorInput::Latest { channel: channel.clone(), reply })
    }

    /// Local metadata reads: this node's slot replicas as they are (possibly behind their group's
    /// leader). For a read that sees every acknowledged write, call [`Node::authoritative_reader`].
    ///
    /// ```no_run
    /// # fn demo(node: &tidings::Node) -> Result<(), Box<dyn std::error::Error>> {
    /// use tidings::slot::model::Uid;
    /// let uid = Uid::new("alice").ok_or("bad uid")?;
    /// let user = node.authoritative_reader(tidings::RouteKey::Uid(uid.clone()))?.user(&uid)?;
    /// # let _ = user; Ok(()) }
    /// ```
    pub fn local_reader(&self) -> SlotReader {
        SlotReader::new(MetaStore::new(self.kv.clone()))
    }

    /// An authoritative metadata reader for the slot group that owns `key`: waits for a raft ReadIndex
    /// through the group's leader, then reads the local replica, which by then reflects every write
    /// acknowledged before this call. Only on nodes that replicate the group (`NotServed` otherwise).
    pub fn authoritative_reader(&self, key: RouteKey) -> Result<SlotReader, NodeError> {
        self.read_barrier_async(key).wait()?;
        Ok(self.local_reader())
    }

    /// [`Node::authoritative_reader`] without blocking: once the barrier completes, [`Node::local_reader`]
    /// reflects every metadata write of `key`'s slot group acknowledged before this call.
    pub fn read_barrier_async(&self, key: RouteKey) -> Pending<()> {
        self.call_pending(Call::ReadBarrier(key))
    }

    /// Reads committed messages of a channel this node replicates, bounded by its high watermark.
    ///
    /// At most `limit` messages come back, and at most `NodeConfig::read_records_max` (1,000) and
    /// `read_bytes_max` (1 MiB) of them whatever `limit` says: page on from the last seq returned plus
    /// one; an empty page means nothing is committed from `from` on. The read runs on the node's reader
    /// thread (it may touch storage), never on a reactor.
    pub fn read(&self, channel: &ChannelId, from: Seq, limit: usize) -> Result<Vec<Record>, NodeError> {
        self.read_async(channel, from, limit).wait()
    }

    /// [`Node::read`] without blocking: `.await` the page or wait on it.
    pub fn read_async(&self, channel: &ChannelId, from: Seq, limit: usize) -> Pending<Vec<Record>> {
        offer(self.reactor_of(channel), |reply| ReactorInput::Read { channel: channel.clone(), from, limit, reply })
    }

    /// Operator status: slot groups (leader, term, commit, applied, members, peer progress), the node's
    /// counters, and its first `NodeConfig::status_channels_max` active channel replicas in channel order
    /// (role, epochs, ISR, HW, log end; [`Node::channel_statuses`] pages through the rest).
    pub fn status(&self) -> Result<NodeStatus, NodeError> {
        let (reply, receiver) = bounded(1);
        self.send_input(Input::Status { reply })?;
        let mut status = receiver.recv_timeout(CALL_TIMEOUT).map_err(waited)?;
        for shard in self.shard_statuses(None, self.status_channels_max)? {
            status.add_shard(shard, self.status_channels_max);
        }
        Ok(status)
    }

    /// A page of this node's active channel replicas: the first `limit` (at most
    /// `NodeConfig::status_channels_max`) in channel order past `after`. The next page starts after the
    /// last channel of this one; a short page is the last. Each page costs each reactor one pass over
    /// its active replicas' ids, and builds only the listed ones.
    ///
    /// ```no_run
    /// # fn demo(node: &tidings::Node) -> Result<(), tidings::node::NodeError> {
    /// let mut after = None;
    /// loop {
    ///     let page = node.channel_statuses(after.as_ref(), 500)?;
    ///     for channel in &page {
    ///         println!("{} {:?} hw {} log end {}", channel.channel, channel.role, channel.hw, channel.log_end);
    ///     }
    ///     match page.last() {
    ///         Some(last) if page.len() == 500 => after = Some(last.channel.clone()),
    ///         _ => break,
    ///     }
    /// }
    /// # Ok(()) }
    /// ```
    pub fn channel_statuses(&self, after: Option<&ChannelId>, limit: usize) -> Result<Vec<ChannelStatus>, NodeError> {
        let limit = limit.min(self.status_channels_max);
        let shards = self.shard_statuses(after, limit)?;
        Ok(crate::node::first_in_order(shards.into_iter().map(|s| s.channels), limit))
    }

    /// Every reactor's status, with its page of replicas past `after` (asked of all of them first, then
    /// waited for: the reactors build their pages at once).
    fn shard_statuses(&self, after: Option<&ChannelId>, limit: usize) -> Result<Vec<ShardStatus>, NodeError> {
        let mut receivers = Vec::with_capacity(self.reactors.len());
        for reactor in &self.reactors {
            let (reply, receiver) = bounded(1);
            send_to(reactor, ReactorInput::Status { after: after.cloned(), limit, reply })?;
            receivers.push(receiver);
        }
        receivers.into_iter().map(|receiver| receiver.recv_timeout(CALL_TIMEOUT).map_err(waited)).collect()
    }

    /// Status of this node's replica of `channel` (role, epochs, HW, log end and, on the leader, each
    /// other replica's lag and silence), from its reactor alone: cheaper than [`Node::status`] at
    /// thousands of channels. `Ok(None)`: the replica is not active here (evicted, or not a replica).
    ///
    /// ```no_run
    /// # fn demo(node: &tidings::Node, channel: &tidings::types::ChannelId) -> Result<(), tidings::node::NodeError> {
    /// if let Some(status) = node.channel_status(channel)? {
    ///     for replica in &status.replicas {
    ///         println!("{}: {} records behind, silent for {:?}", replica.node, replica.lag, replica.silent_for);
    ///     }
    /// }
    /// # Ok(())
    /// # }
    /// ```
    pub fn channel_status(&self, channel: &ChannelId) -> Result<Option<ChannelStatus>, NodeError> {
        let (reply, receiver) = bounded(1);
        send_to(self.reactor_of(channel), ReactorInput::ChannelStatus { channel: channel.clone(), reply })?;
        receiver.recv_timeout(CALL_TIMEOUT).map_err(waited)
    }

    /// Waits until every slot group this node keeps a replica of knows its leader and has applied what
    /// it knows committed: metadata calls through the node then go to work at once instead of failing
    /// `NotReady` while the groups elect (a freshly started cluster takes a few election timeouts).
    /// [`NodeError::TimedOut`] if that takes longer than `timeout` (the peers may be unreachable).
    pub fn wait_ready(&self, timeout: Duration) -> Result<(), NodeError> {
        let deadline = Instant::now() + timeout;
        loop {
            let status = self.status()?;
            if status.groups.iter().all(|g| g.leader.is_some() && g.applied >= g.commit) {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(NodeError::TimedOut);
            }
            std::thread::sleep(READY_POLL);
        }
    }

    fn call(&self, call: Call) -> Result<(), NodeError> {
        self.call_pending(call).wait()
    }

    /// Hands `call` to the core thread; its outcome comes to the returned [`Pending`].
    fn call_pending(&self, call: Call) -> Pending<()> {
        offer(&self.inbox, |completer| {
            let reply = Reply::Then(Box::new(move |result| {
                completer.complete(match result {
                    ApiResult::Meta(result) => result,
                    ApiResult::Appended(result) => result.map(drop),
                    ApiResult::Task(result) => result.map(drop),
                    ApiResult::Retained(result) => result.map(drop),
                })
            }));
            Input::Call { call, reply }
        })
    }

    fn send_input(&self, input: Input) -> Result<(), NodeError> {
        send_to(&self.inbox, input)
    }
}

/// Offers the input `make` builds around the completer of the returned outcome to a thread's inbox;
/// refused (`Overloaded`, `Stopped`), the outcome is that refusal, at once.
fn offer<T, I>(inbox: &Sender<I>, make: impl FnOnce(Completer<T>) -> I) -> Pending<T> {
    let (pending, completer) = Pending::new();
    match send_to(inbox, make(completer)) {
        Ok(()) => pending,
        Err(refused) => Pending::ready(Err(refused)),
    }
}

/// `config` as this start runs it: the default number of reactors for this machine (one per two
/// cores: the IO workers and the host need the rest) unless it names one, a boot id, and the wall clock
/// read now as the origin of the clock records are stamped with (the runtime's clock counts from now).
fn for_this_start(config: NodeConfig) -> NodeConfig {
    let cores = std::thread::available_parallelism().map_or(2, std::num::NonZeroUsize::get);
    let boot = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    let mut config = NodeConfig {
        reactors: config.reactors_or(cores / 2),
        boot_id: u64::from(boot.subsec_nanos()) ^ boot.as_secs(),
        ..config
    };
    config.machine.clock_origin_unix_ms = u64::try_from(boot.as_millis()).unwrap_or(u64::MAX);
    config
}

/// A node's stores: the sled metadata store, the raft logs of its slot groups in it, and the message
/// journal.
struct Stores {
    kv: Arc<dyn Kv>,
    logs: Arc<RaftLogStore>,
    journal: Arc<JournalLog>,
}

/// Opens (or creates) a node's stores under `storage.data_dir`, the journal's spare segments made first
/// if asked.
fn open_stores(storage: &StorageOptions) -> Result<Stores, NodeError> {
    std::fs::create_dir_all(&storage.data_dir).map_err(|e| StoreError::io("create data directory", e))?;
    let kv: Arc<dyn Kv> = Arc::new(SledKv::open(storage.data_dir.join("sled"), storage.sled_cache_bytes)?);
    let logs = Arc::new(RaftLogStore::open(kv.clone())?);
    let journal = Arc::new(JournalLog::open(storage.data_dir.join("journal"), kv.clone(), storage.journal.clone())?);
    if storage.journal_spares_at_start {
        journal.fill_spares()?;
    }
    Ok(Stores { kv, logs, journal })
}

/// Why a blocking call got no answer: the node stopped (the answering end is gone) or the wait ran out.
fn waited(error: RecvTimeoutError) -> NodeError {
    match error {
        RecvTimeoutError::Disconnected => NodeError::Stopped,
        RecvTimeoutError::Timeout => NodeError::TimedOut,
    }
}

/// Offers an API input to a thread's inbox: `Overloaded` when it is full, `Stopped` when it is gone.
fn send_to<T>(inbox: &Sender<T>, input: T) -> Result<(), NodeError> {
    match inbox.try_send(input) {
        Ok(()) => Ok(()),
        Err(TrySendError::Full(_)) => Err(NodeError::Overloaded),
        Err(TrySendError::Disconnected(_)) => Err(NodeError::Stopped),
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.inbox.send(Input::Stop);
        for reactor in &self.reactors {
            let _ = reactor.send(ReactorInput::Stop);
        }
        // The core and reactor threads exit on Stop and drop their senders; the workers exit when their
        // queues close.
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
        if let Err(error) = self.kv.sync() {
            tracing::warn!(%error, "final metadata sync failed");
        }
    }
}

fn spawn(name: &str, body: impl FnOnce() + Send + 'static) -> JoinHandle<()> {
    std::thread::Builder::new().name(name.into()).spawn(body).expect("spawn runtime thread")
}
