//! The threaded runtime around [`NodeCore`]: the production shell. It only moves inputs to the core and
//! carries out its effects; every protocol decision is in the core.
//!
//! Threads: one core thread (owns the `NodeCore`, its timers and the API calls), one slot-sync worker
//! (one fsync of the metadata/raft store for every sync asked since the last), durable-append workers
//! (each stages the queued channel batches and makes them durable with one journal sync: group commit
//! across channels; two by default, so one stages while the other waits for its fdatasync), one reader
//! (store reads for pulls), one fanout worker (subscriber pages, and the host's presence and delivery
//! calls), and the message log's write-behind thread. Storage IO never runs on the
//! core thread except a channel's activation (loading its log state). Every queue is
//! bounded: a full inbox drops inbound frames (the protocols resend) and refuses API calls with
//! `Overloaded`.
//!
//! Simplified for now (see the issue notes): one core thread drives every channel of the node (reactors
//! that hash channels onto several threads come next).
#![allow(clippy::disallowed_methods)] // The runtime shell is where the clock is read.

use crate::node::{
    carry_out_fanout, ApiId, ApiResult, FanoutAnswer, FanoutHost, NoFanout, NodeConfig, NodeCore, NodeEffect,
    NodeError, NodeStatus, TaskReport,
};
use bytes::Bytes;
use crossbeam_channel::{bounded, Receiver, RecvTimeoutError, Sender, TrySendError};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use tidings_channel::fanout::FanoutEffect;
use tidings_channel::machine::{AppendRecord, PersistToken, ReadToken};
use tidings_router::Router;
use tidings_slot::command::{Command, RoutingKey};
use tidings_slot::model::{ChannelInfo, Uid};
use tidings_slot::query::SlotReader;
use tidings_store::message::{
    BatchFate, JournalConfig, JournalLog, JournalStats, LogBatch, MessageLog, ReadLimits, Record, WriteBehindThread,
};
use tidings_store::{Kv, MetaStore, RaftLogStore, SledKv, StoreError};
use tidings_types::{ChannelId, GroupId, HashSlot, NodeId, Seq, Time};

/// How a node sends frames to its peers. Implemented by the host (its network stack).
pub trait Transport: Send + Sync + 'static {
    /// Sends `frame` to `to` without blocking. Frames may be lost; the protocols resend what matters.
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
}

impl StorageOptions {
    /// Defaults in `data_dir`.
    pub fn new(data_dir: impl Into<PathBuf>) -> Self {
        Self {
            data_dir: data_dir.into(),
            sled_cache_bytes: 64 << 20,
            journal: JournalConfig::default(),
            durable_workers: 2,
        }
    }
}

/// Capacity of the core thread's inbox. Full: inbound frames are dropped, API calls get `Busy`.
const INBOX_CAPACITY: usize = 65_536;
/// How long a durable-append worker waits for room in the message log's memory table before it fails a
/// batch.
const ROOM_PATIENCE: Duration = Duration::from_secs(30);
/// Most channel batches one durable-append round stages before its sync.
const GROUP_COMMIT_MAX: usize = 4096;
/// How long an API call waits for its result.
const CALL_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a replica replacement call waits (the controller's catch-up timeout is 120 s by default).
const REPLACE_TIMEOUT: Duration = Duration::from_secs(180);

enum Input {
    Frame { from: NodeId, bytes: Bytes },
    Call { call: Call, reply: Reply },
    Read { channel: ChannelId, from: Seq, limit: usize, reply: Sender<Result<Vec<Record>, NodeError>> },
    Latest { channel: ChannelId, reply: Sender<Result<Seq, NodeError>> },
    Status { reply: Sender<NodeStatus> },
    SlotsSynced { token: u64 },
    Persisted(Vec<(ChannelId, PersistToken, Result<(), StoreError>)>),
    ReadDone { channel: ChannelId, token: ReadToken, result: Result<Vec<Record>, StoreError> },
    Fanout(FanoutAnswer),
    Stop,
}

/// Where an API call's result goes.
enum Reply {
    /// To a caller waiting on the other end.
    Wait(Sender<ApiResult>),
    /// To a callback, run on the core thread.
    Then(Box<dyn FnOnce(ApiResult) + Send>),
}

impl Reply {
    fn deliver(self, result: ApiResult) {
        match self {
            // The caller may have stopped waiting: nothing to do then.
            Reply::Wait(sender) => drop(sender.send(result)),
            Reply::Then(callback) => callback(result),
        }
    }
}

enum Call {
    Propose(Command),
    CreateChannel(ChannelInfo),
    Append { channel: ChannelId, sender: Option<Uid>, records: Vec<AppendRecord> },
    ReadBarrier(RouteKey),
    TransferLeader { channel: ChannelId, target: NodeId },
    ReplaceReplica { channel: ChannelId, from: NodeId, to: NodeId },
    SetGroupIntent(tidings_slot::model::GroupIntent),
    MoveSlotReplica { group: GroupId, from: NodeId, to: NodeId },
    AbortSlotMove(GroupId),
    MigrateSlot { slot: HashSlot, to: GroupId },
    AbortSlotMigration(HashSlot),
    SetPreferredLeader { group: GroupId, preferred: Option<NodeId> },
    DrainNode { node: NodeId, drain: bool },
}

/// A running node. Dropping it stops its threads (after a last write-behind).
pub struct Node {
    id: NodeId,
    inbox: Sender<Input>,
    threads: Vec<JoinHandle<()>>,
    _write_behind: WriteBehindThread,
    journal: Arc<JournalLog>,
    kv: Arc<dyn Kv>,
    router: Arc<Router>,
    dropped_frames: Arc<AtomicU64>,
}

/// A pending append: wait for its seqs.
pub struct AppendHandle {
    reply: Receiver<ApiResult>,
}

impl AppendHandle {
    /// Waits for the append to commit (or fail).
    pub fn wait(self) -> Result<Vec<Seq>, NodeError> {
        match self.reply.recv_timeout(CALL_TIMEOUT) {
            Ok(ApiResult::Appended(result)) => result,
            Ok(ApiResult::Meta(_) | ApiResult::Task(_)) | Err(_) => Err(NodeError::Stopped),
        }
    }
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
        config.validate().map_err(|what| NodeError::Storage(StoreError::BadConfig { what }))?;
        if storage.durable_workers == 0 {
            return Err(NodeError::Storage(StoreError::BadConfig { what: "durable_workers must be positive" }));
        }
        let boot_nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        let config = NodeConfig { boot_id: u64::from(boot_nanos.subsec_nanos()) ^ boot_nanos.as_secs(), ..config };
        std::fs::create_dir_all(&storage.data_dir).map_err(|e| StoreError::io("create data directory", e))?;
        let kv: Arc<dyn Kv> = Arc::new(SledKv::open(storage.data_dir.join("sled"), storage.sled_cache_bytes)?);
        let logs = Arc::new(RaftLogStore::open(kv.clone())?);
        let journal =
            Arc::new(JournalLog::open(storage.data_dir.join("journal"), kv.clone(), storage.journal.clone())?);
        let write_behind = journal.start_write_behind();
        let log: Arc<dyn MessageLog> = journal.clone();
        let router = Arc::new(Router::new(config.table()));
        let started = Instant::now();
        let id = config.node;
        let core =
            NodeCore::new(config, logs, MetaStore::new(kv.clone()), log.clone(), Arc::clone(&router), Time::ZERO)?;
        let (inbox, inputs) = bounded(INBOX_CAPACITY);
        let (sync_tx, sync_rx) = bounded::<u64>(1024);
        let (persist_tx, persist_rx) = bounded::<(PersistToken, LogBatch)>(GROUP_COMMIT_MAX * 4);
        let (read_tx, read_rx) = bounded::<(ChannelId, ReadToken, Seq, Seq, usize)>(4096);
        // The planner bounds its outstanding requests (plans in flight plus one page or locate per job).
        let (fanout_tx, fanout_rx) = bounded::<FanoutEffect>(4096);
        let mut threads = Vec::new();
        threads.push(spawn("tidings-slot-sync", {
            let (kv, inbox) = (kv.clone(), inbox.clone());
            move || slot_sync_worker(&kv, &sync_rx, &inbox)
        }));
        for _ in 0..storage.durable_workers {
            threads.push(spawn("tidings-durable", {
                let (log, inbox, persist_rx) = (log.clone(), inbox.clone(), persist_rx.clone());
                move || durable_worker(log.as_ref(), &persist_rx, &inbox)
            }));
        }
        threads.push(spawn("tidings-reader", {
            let (log, inbox) = (log.clone(), inbox.clone());
            move || reader_worker(log.as_ref(), &read_rx, &inbox)
        }));
        threads.push(spawn("tidings-fanout", {
            let (reader, inbox) = (SlotReader::new(MetaStore::new(kv.clone())), inbox.clone());
            move || fanout_worker(&reader, fanout.as_ref(), &fanout_rx, &inbox)
        }));
        threads.push(spawn("tidings-core", move || {
            let mut shell = Shell {
                core,
                started,
                transport,
                sync_tx,
                persist_tx,
                read_tx,
                fanout_tx,
                calls: BTreeMap::new(),
                next_call: 1,
            };
            shell.run(&inputs);
        }));
        let dropped_frames = Arc::new(AtomicU64::new(0));
        Ok(Node { id, inbox, threads, _write_behind: write_behind, journal, kv, router, dropped_frames })
    }

    /// This node's id.
    pub fn id(&self) -> NodeId {
        self.id
    }

    /// The routes this node uses now: the hash-slot table (with every slot migration it learned) and the
    /// slot groups' leaders as observed. Never blocks.
    pub fn routes(&self) -> Arc<tidings_router::RouteTable> {
        self.router.snapshot()
    }

    /// Hands an inbound frame from `from` to the node. Never blocks: when the inbox is full the frame is
    /// dropped and counted (the protocols resend).
    pub fn handle_frame(&self, from: NodeId, bytes: Bytes) {
        if self.inbox.try_send(Input::Frame { from, bytes }).is_err() {
            self.dropped_frames.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Frames dropped because the inbox was full.
    pub fn dropped_frames(&self) -> u64 {
        self.dropped_frames.load(Ordering::Relaxed)
    }

    /// The message log's counters and gauges: group commits, frames, write-behind rounds and the record
    /// bytes still waiting for write-behind (`mem_bytes`: a backlog near `JournalConfig::mem_bytes_max`
    /// means appends are about to wait), journal segments on disk. Does not go through the core thread.
    pub fn message_log_stats(&self) -> JournalStats {
        self.journal.stats()
    }

    /// Applies a metadata command through the slot layer (any node may be called).
    pub fn propose(&self, command: Command) -> Result<(), NodeError> {
        self.call(Call::Propose(command))
    }

    /// Creates a channel and its runtime meta (replicas, leader, ISR, MinISR).
    pub fn create_channel(&self, info: ChannelInfo) -> Result<(), NodeError> {
        self.call(Call::CreateChannel(info))
    }

    /// Starts an append (any node may be called: non-leaders forward); wait on the handle.
    pub fn append(&self, channel: ChannelId, records: Vec<AppendRecord>) -> Result<AppendHandle, NodeError> {
        let (reply, receiver) = bounded(1);
        self.send_input(Input::Call {
            call: Call::Append { channel, sender: None, records },
            reply: Reply::Wait(reply),
        })?;
        Ok(AppendHandle { reply: receiver })
    }

    /// Starts an append and calls `then` with its outcome (the seqs once committed, or why not) — for a
    /// host that completes its own futures or requests instead of blocking a thread per append.
    ///
    /// `then` runs on the node's core thread: it must be short and must not block (hand the result on,
    /// wake a task). It is called exactly once, with [`NodeError::Stopped`] if the node stops first;
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
        let reply = Reply::Then(Box::new(move |result| match result {
            ApiResult::Appended(result) => then(result),
            ApiResult::Meta(_) | ApiResult::Task(_) => then(Err(NodeError::Stopped)),
        }));
        self.send_input(Input::Call { call: Call::Append { channel, sender: None, records }, reply })
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
        let (reply, receiver) = bounded(1);
        let reply = Reply::Wait(reply);
        self.send_input(Input::Call { call: Call::Append { channel, sender: Some(sender), records }, reply })?;
        Ok(AppendHandle { reply: receiver })
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
    /// and drain timeouts; returns the task's report.
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
            Ok(_) | Err(_) => Err(NodeError::Stopped),
        }
    }

    /// The latest committed seq (high watermark) of a channel this node replicates.
    pub fn latest(&self, channel: &ChannelId) -> Result<Seq, NodeError> {
        let (reply, receiver) = bounded(1);
        self.send_input(Input::Latest { channel: channel.clone(), reply })?;
        receiver.recv_timeout(CALL_TIMEOUT).map_err(|_| NodeError::Stopped)?
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
        self.call(Call::ReadBarrier(key))?;
        Ok(self.local_reader())
    }

    /// Reads committed messages of a channel this node replicates, bounded by its high watermark.
    pub fn read(&self, channel: &ChannelId, from: Seq, limit: usize) -> Result<Vec<Record>, NodeError> {
        let (reply, receiver) = bounded(1);
        self.send_input(Input::Read { channel: channel.clone(), from, limit, reply })?;
        receiver.recv_timeout(CALL_TIMEOUT).map_err(|_| NodeError::Stopped)?
    }

    /// Operator status: slot groups (leader, term, commit, applied, members, peer progress) and channel
    /// replicas (role, epochs, ISR, HW, log end).
    pub fn status(&self) -> Result<NodeStatus, NodeError> {
        let (reply, receiver) = bounded(1);
        self.send_input(Input::Status { reply })?;
        receiver.recv_timeout(CALL_TIMEOUT).map_err(|_| NodeError::Stopped)
    }

    fn call(&self, call: Call) -> Result<(), NodeError> {
        let (reply, receiver) = bounded(1);
        self.send_input(Input::Call { call, reply: Reply::Wait(reply) })?;
        match receiver.recv_timeout(CALL_TIMEOUT) {
            Ok(ApiResult::Meta(result)) => result,
            Ok(ApiResult::Appended(result)) => result.map(drop),
            Ok(ApiResult::Task(result)) => result.map(drop),
            Err(_) => Err(NodeError::Stopped),
        }
    }

    fn send_input(&self, input: Input) -> Result<(), NodeError> {
        match self.inbox.try_send(input) {
            Ok(()) => Ok(()),
            Err(TrySendError::Full(_)) => Err(NodeError::Overloaded),
            Err(TrySendError::Disconnected(_)) => Err(NodeError::Stopped),
        }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.inbox.send(Input::Stop);
        // The core thread exits on Stop and drops its senders; the workers exit when their queues close.
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
        if let Err(error) = self.kv.sync() {
            tracing::warn!(%error, "final metadata sync failed");
        }
    }
}

/// A core-thread step taking this long is logged.
const CORE_STALL_WARNING: Duration = Duration::from_millis(500);

fn spawn(name: &str, body: impl FnOnce() + Send + 'static) -> JoinHandle<()> {
    std::thread::Builder::new().name(name.into()).spawn(body).expect("spawn runtime thread")
}

/// The core thread's state.
struct Shell {
    core: NodeCore,
    started: Instant,
    transport: Arc<dyn Transport>,
    sync_tx: Sender<u64>,
    persist_tx: Sender<(PersistToken, LogBatch)>,
    read_tx: Sender<(ChannelId, ReadToken, Seq, Seq, usize)>,
    fanout_tx: Sender<FanoutEffect>,
    calls: BTreeMap<ApiId, Reply>,
    next_call: u64,
}

impl Drop for Shell {
    fn drop(&mut self) {
        // Calls still open when the node stops: waiting callers see their channel close; callbacks are
        // told, so each is called exactly once.
        for (_, reply) in std::mem::take(&mut self.calls) {
            if let Reply::Then(callback) = reply {
                callback(ApiResult::Appended(Err(NodeError::Stopped)));
            }
        }
    }
}

impl Shell {
    fn now(&self) -> Time {
        Time::from_millis(u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX))
    }

    fn run(&mut self, inputs: &Receiver<Input>) {
        loop {
            let wait = self.core.poll_timeout().as_millis().saturating_sub(self.now().as_millis());
            match inputs.recv_timeout(Duration::from_millis(wait.min(100))) {
                Ok(Input::Stop) | Err(RecvTimeoutError::Disconnected) => return,
                Ok(input) => {
                    self.handle(input);
                    // Take whatever else is queued before carrying out effects: bigger batches.
                    for _ in 0..1024 {
                        match inputs.try_recv() {
                            Ok(Input::Stop) => return,
                            Ok(input) => self.handle(input),
                            Err(_) => break,
                        }
                    }
                }
                Err(RecvTimeoutError::Timeout) => {}
            }
            // Drained first: the timeout is then cheap to ask (no machine left to poll for it).
            let busy_since = Instant::now();
            self.carry_out();
            let now = self.now();
            if self.core.poll_timeout() <= now {
                self.core.handle_tick(now);
                self.carry_out();
            }
            let busy = busy_since.elapsed();
            if busy >= CORE_STALL_WARNING {
                // Peers count a node silent for `node_down_after` (1.5 s) as down: say why it went quiet.
                tracing::warn!(node = %self.core.node(), ?busy, "core thread busy in one step (storage waits?)");
            }
        }
    }

    fn handle(&mut self, input: Input) {
        let now = self.now();
        match input {
            Input::Frame { from, bytes } => {
                if let Err(error) = self.core.handle_frame(now, from, &bytes) {
                    tracing::debug!(%error, %from, "refused a frame");
                }
            }
            Input::Call { call, reply } => {
                let id = ApiId(self.next_call);
                self.next_call += 1;
                self.calls.insert(id, reply);
                match call {
                    Call::Propose(command) => self.core.propose(now, id, command),
                    Call::CreateChannel(info) => self.core.create_channel(now, id, info),
                    Call::ReadBarrier(RouteKey::Uid(uid)) => self.core.read_barrier(now, id, RoutingKey::Uid(&uid)),
                    Call::ReadBarrier(RouteKey::Channel(channel)) => {
                        self.core.read_barrier(now, id, RoutingKey::Channel(&channel))
                    }
                    Call::Append { channel, sender: None, records } => self.core.append(now, id, channel, records),
                    Call::Append { channel, sender: Some(sender), records } => {
                        self.core.append_from(now, id, channel, sender, records)
                    }
                    Call::TransferLeader { channel, target } => self.core.transfer_leader(now, id, channel, target),
                    Call::ReplaceReplica { channel, from, to } => self.core.replace_replica(now, id, channel, from, to),
                    Call::SetGroupIntent(intent) => self.core.set_group_intent(now, id, intent),
                    Call::MoveSlotReplica { group, from, to } => self.core.move_slot_replica(now, id, group, from, to),
                    Call::AbortSlotMove(group) => self.core.abort_slot_move(now, id, group),
                    Call::MigrateSlot { slot, to } => self.core.migrate_slot(now, id, slot, to),
                    Call::AbortSlotMigration(slot) => self.core.abort_slot_migration(now, id, slot),
                    Call::DrainNode { node, drain } => self.core.drain_node(now, id, node, drain),
                    Call::SetPreferredLeader { group, preferred } => {
                        self.core.set_preferred_leader(now, id, group, preferred)
                    }
                }
            }
            Input::Read { channel, from, limit, reply } => {
                let _ = reply.send(self.core.read(&channel, from, limit));
            }
            Input::Latest { channel, reply } => {
                let _ = reply.send(self.core.latest(&channel));
            }
            Input::Status { reply } => {
                let _ = reply.send(self.core.status());
            }
            Input::SlotsSynced { token } => self.core.handle_slots_synced(now, token),
            Input::Persisted(outcomes) => {
                for (channel, token, result) in outcomes {
                    self.core.handle_persisted(now, &channel, token, result);
                }
            }
            Input::ReadDone { channel, token, result } => self.core.handle_read(now, &channel, token, result),
            Input::Fanout(answer) => self.core.handle_fanout(now, answer),
            Input::Stop => {}
        }
    }

    fn carry_out(&mut self) {
        while let Some(effect) = self.core.poll_effect() {
            match effect {
                NodeEffect::Send { to, frame } => self.transport.send(to, frame),
                NodeEffect::SyncSlots { token } => {
                    // Bounded wait when the worker is behind: never an unbounded queue.
                    let _ = self.sync_tx.send(token);
                }
                NodeEffect::Persist { token, batch } => {
                    let _ = self.persist_tx.send((token, batch));
                }
                NodeEffect::Read { channel, token, from, through, max_bytes } => {
                    if self.read_tx.try_send((channel, token, from, through, max_bytes)).is_err() {
                        tracing::debug!("reader busy; the follower pulls again");
                    }
                }
                // Bounded wait when the fanout worker is behind (the planner bounds what it asks for).
                NodeEffect::Fanout(work) => {
                    let _ = self.fanout_tx.send(work);
                }
                NodeEffect::Done { id, result } => {
                    if let Some(reply) = self.calls.remove(&id) {
                        reply.deliver(result);
                    }
                }
            }
        }
    }
}

fn fanout_worker(reader: &SlotReader, host: &dyn FanoutHost, work: &Receiver<FanoutEffect>, inbox: &Sender<Input>) {
    while let Ok(item) = work.recv() {
        if let Some(answer) = carry_out_fanout(reader, host, item) {
            if inbox.send(Input::Fanout(answer)).is_err() {
                return;
            }
        }
    }
}

fn slot_sync_worker(kv: &Arc<dyn Kv>, tokens: &Receiver<u64>, inbox: &Sender<Input>) {
    while let Ok(first) = tokens.recv() {
        // One fsync covers every sync asked for meanwhile.
        let token = tokens.try_iter().fold(first, u64::max);
        match kv.sync() {
            Ok(()) => {
                if inbox.send(Input::SlotsSynced { token }).is_err() {
                    return;
                }
            }
            Err(error) => tracing::error!(%error, "metadata sync failed; raft will not make progress past it"),
        }
    }
}

fn durable_worker(log: &dyn MessageLog, jobs: &Receiver<(PersistToken, LogBatch)>, inbox: &Sender<Input>) {
    while let Ok(first) = jobs.recv() {
        let mut round = vec![first];
        round.extend(jobs.try_iter().take(GROUP_COMMIT_MAX - 1));
        let mut staged = Vec::with_capacity(round.len());
        let mut outcomes = Vec::with_capacity(round.len());
        for (token, batch) in round {
            let channel = batch.channel.clone();
            // Backpressure, not failure: a full memory table delays the batch (the machine's pending
            // appends fill meanwhile and new appends get `Busy`); a failed persist would end the replica's
            // leadership. Failing after `ROOM_PATIENCE` means write-behind cannot write at all.
            if let Err(error) = log.wait_for_room(ROOM_PATIENCE) {
                outcomes.push((channel, token, Err(error)));
                continue;
            }
            match log.stage(batch) {
                Ok(receipt) => staged.push((channel, token, receipt)),
                Err(error) => outcomes.push((channel, token, Err(error))),
            }
        }
        let synced = log.sync();
        for (channel, token, receipt) in staged {
            // Per batch: another worker's failed write drops what this one staged, and a batch this one
            // staged may have been made durable by the other's sync before this one's failed.
            let result = match (log.fate(receipt), &synced) {
                (BatchFate::Durable, _) => Ok(()),
                (_, Err(error)) => Err(StoreError::io("group commit", std::io::Error::other(error.to_string()))),
                (_, Ok(_)) => Err(StoreError::Dropped),
            };
            outcomes.push((channel, token, result));
        }
        // One inbox message for the round: the core thread's inbox is shared with every peer's frames.
        if inbox.send(Input::Persisted(outcomes)).is_err() {
            return;
        }
    }
}

fn reader_worker(
    log: &dyn MessageLog,
    reads: &Receiver<(ChannelId, ReadToken, Seq, Seq, usize)>,
    inbox: &Sender<Input>,
) {
    while let Ok((channel, token, from, through, max_bytes)) = reads.recv() {
        let result = log.read(&channel, from, through, ReadLimits { records_max: usize::MAX, bytes_max: max_bytes });
        if inbox.send(Input::ReadDone { channel, token, result }).is_err() {
            return;
        }
    }
}
