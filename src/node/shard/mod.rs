//! `ChannelShard`: the channel side of a node — the channel replicas whose channels hash to one shard,
//! and everything kept per channel around them (metas, appends waiting for a meta, append origins,
//! forwarded appends, resumable leaderships, HW floors, failover requests, eviction). Sans-IO like
//! the rest of the core: it takes inputs with `now` and returns outputs.
//!
//! A node splits its channels over a fixed number of shards by the hash slot of the channel id
//! ([`shard_of`]); a channel always lives in one shard, and shards share nothing. [`NodeCore`] keeps
//! the slot groups, the controller, fanout and routing, and talks to its shards only through
//! [`ShardInput`] and [`ShardOutput`]: the simulator runs the shards inline, in index order (as
//! deterministic as one shard), and the threaded runtime runs each on its own reactor thread.
//!
//! [`NodeCore`]: super::NodeCore

mod activation;
mod calls;
mod floors;
mod kept_pulls;
mod lifecycle;
mod lookups;
mod reads;
mod retries;
mod room;
mod senders;
mod stray;
#[cfg(test)]
mod testing;
mod turns;

pub use activation::ActivationLoad;
use activation::Loaded;
use calls::CallKind;
pub(crate) use calls::{CallOutcome, LeaderCall};
pub use lookups::{Lookup, LookupAnswer};
pub use reads::ReadPlan;
pub use senders::SenderCheck;
use senders::SenderChecked;

use super::config::NodeConfig;
use super::core::{ApiId, ApiResult, ChannelStatus, NodeEffect};
use super::error::NodeError;
use super::identity::KnownStorages;
use super::message::{NodeMessage, RemoteAppendError};
use crate::frame::{encode, FrameBody};
use rustc_hash::FxHashMap;
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;
use tidings_channel::machine::{
    AppendAborted, AppendRecord, ChannelMachine, ChannelMessage, Effect, MachineConfig, PersistToken, ReadToken,
    RoleKind,
};
use tidings_channel::reactor::{feed_in_warm_runs, ActiveChannels, ChannelOutbox};
use tidings_router::HashToSlot;
use tidings_slot::command::Command;
use tidings_slot::model::Uid;
use tidings_slot::query::SlotReader;
use tidings_store::message::{LogBatch, LogOp, MessageLog, Record};
use tidings_store::StoreError;
use tidings_types::{ChannelId, ChannelRuntimeMeta, GroupId, LeaderEpoch, NodeId, Seq, TakenForwards, Time};

/// How long an append waits for its channel's meta before failing with `MetaUnavailable`.
const META_WAIT: std::time::Duration = std::time::Duration::from_secs(5);
/// Extra wait for a forwarded append's reply beyond the leader's append timeout.
const FORWARD_SLACK: std::time::Duration = std::time::Duration::from_secs(2);
/// A replica that cannot lead repeats its failover request this often until the meta changes.
const FAILOVER_REQUEST_INTERVAL: std::time::Duration = std::time::Duration::from_secs(1);
/// Idle eviction looks at every active replica of the shard (and at every load waiting, for one never
/// answered): at most this often.
const EVICT_SCAN_INTERVAL: std::time::Duration = std::time::Duration::from_secs(1);
/// Most shards a node runs: ids the shard hands out carry its index in one byte.
pub(crate) const SHARDS_MAX: usize = 256;
/// Ids a shard hands out (append requests, forwarded appends) count in the low 24 bits, above them the
/// shard's index, above that the node's boot id.
const ID_COUNTER_BITS: u32 = 24;

/// The shard of `channel` among `shards`: by its hash slot, which spreads channels evenly.
pub(crate) fn shard_of(channel: &ChannelId, shards: usize) -> usize {
    usize::from(tidings_router::hash_slot(channel.route_key()).index()) % shards.max(1)
}

/// The first id shard `index` hands out in the start `boot_id`: ids of one start live in their own range
/// (see `NodeConfig::boot_id`), and each shard in its own part of it.
fn id_base(boot_id: u64, index: usize) -> u64 {
    ((boot_id & 0xffff_ffff) << 32) | (u64::try_from(index).unwrap_or(0) << ID_COUNTER_BITS)
}

/// The shard that handed out `id` (a forwarded append's id, echoed in its reply).
pub(crate) fn shard_of_id(id: u64, shards: usize) -> usize {
    usize::try_from((id >> ID_COUNTER_BITS) & 0xff).unwrap_or(0) % shards.max(1)
}

/// Which slot groups this node serves, and the hash-slot table: what a shard needs to know whether
/// this node's metadata store holds a channel's meta (or a user's record). `NodeCore` hands a new one
/// to its shards whenever either changes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Served {
    table: Arc<HashToSlot>,
    groups: Vec<GroupId>,
    /// The groups whose replica here knows a leader: fit for `append_from`'s sender check (a replica
    /// that restarted, or is cut off from its leader, may lack a recent ban).
    fresh: Vec<GroupId>,
    /// The metadata store's `routes_version` when this was taken: a read of the store at another
    /// version may find a group's replica gone (destroyed here) or a hash slot served elsewhere.
    routes_version: u64,
}

impl Served {
    pub(crate) fn new(table: Arc<HashToSlot>, groups: Vec<GroupId>, fresh: Vec<GroupId>, routes_version: u64) -> Self {
        Self { table, groups, fresh, routes_version }
    }

    /// The metadata store's routes version this was taken at.
    pub(crate) fn routes_version(&self) -> u64 {
        self.routes_version
    }

    /// `true` if this node's replica of `group` knows its leader.
    pub(crate) fn is_fresh(&self, group: GroupId) -> bool {
        self.fresh.contains(&group)
    }

    pub(crate) fn fresh(&self) -> &[GroupId] {
        &self.fresh
    }

    /// `true` if this node keeps a replica of the slot group owning `key`.
    pub(crate) fn serves_key(&self, key: &[u8]) -> bool {
        self.groups.contains(&self.table.group_of_key(key))
    }

    fn serves(&self, channel: &ChannelId) -> bool {
        self.serves_key(channel.route_key())
    }

    pub(crate) fn table(&self) -> Arc<HashToSlot> {
        Arc::clone(&self.table)
    }

    pub(crate) fn groups(&self) -> &[GroupId] {
        &self.groups
    }
}

/// A controller task an API call starts once the channel's shard gave its meta.
#[derive(Clone, Copy, Debug)]
pub(crate) enum TaskStart {
    /// Move the leadership to `target`.
    Transfer { target: NodeId },
    /// Replace replica `from` by `to`.
    Replace { from: NodeId, to: NodeId },
}

/// An input for a shard.
#[derive(Debug)]
pub(crate) enum ShardInput {
    /// A channel message from a peer.
    Message { from: NodeId, message: ChannelMessage },
    /// An API append (`sender`: checked before it is admitted or forwarded).
    Append { api: ApiId, channel: ChannelId, sender: Option<Uid>, records: Vec<AppendRecord> },
    /// An API append whose sender other nodes checked (this node's replicas could not:
    /// [`ShardOutput::VerifySender`]),
    /// with the verdict. It comes back here either way: the API call waits on this shard.
    SenderChecked {
        api: ApiId,
        channel: ChannelId,
        sender: String,
        records: Vec<AppendRecord>,
        verdict: Result<(), NodeError>,
    },
    /// An API retention move: give up the channel's records through `through`.
    Retain { api: ApiId, channel: ChannelId, through: Seq },
    /// A call another node forwarded here (an append's sender was checked there).
    Forwarded { from: NodeId, id: u64, channel: ChannelId, call: LeaderCall },
    /// The leader's answer to a call this shard forwarded.
    Reply { id: u64, outcome: CallOutcome },
    /// A channel's meta, as the node learned it (pushed, fetched or applied).
    Meta {
        /// The meta.
        meta: ChannelRuntimeMeta,
        /// This node's slot replica holds it (applied or read there): an evicted replica can let it go
        /// without reading it back first.
        stored_here: bool,
    },
    /// A snapshot replaced one of this node's slot replicas: the metas it holds, for the shard to
    /// refresh those it keeps (the same list goes to every shard).
    MetasInstalled(Arc<Vec<ChannelRuntimeMeta>>),
    /// The channel's slot group holds no meta for it.
    MetaMissing(ChannelId),
    /// A controller on `from` asks this replica for its evidence under the fenced `meta`.
    Evidence { from: NodeId, task: u64, meta: ChannelRuntimeMeta },
    /// A durable append finished.
    Persisted { channel: ChannelId, token: PersistToken, result: Result<(), StoreError> },
    /// A read for a pull finished.
    ReadDone { channel: ChannelId, token: ReadToken, result: Result<Vec<Record>, StoreError> },
    /// An activation's load finished.
    Loaded(Loaded),
    /// A sender check in this node's slot replicas finished.
    SenderLookedUp(SenderChecked),
    /// Fanout of `channel`'s committed message `seq` finished: its handoff slot (if it held one) is
    /// free, and its leader reports fanout past it.
    FanoutFinished { channel: ChannelId, seq: Seq },
    /// The node's served groups or hash-slot table changed.
    Served(Arc<Served>),
    /// An API call starts a controller task on the channel: the node needs the meta the shard knows.
    TaskMeta { api: ApiId, channel: ChannelId, start: TaskStart },
    /// The node's sweep of its logs found one of `channel`, and no local meta naming this node: it may
    /// belong to a replica moved away (see `stray`). `fanout_behind`: the log's stored state fanned
    /// out less than its HW (should the channel's meta name this node the leader, it resumes).
    MaybeStray { channel: ChannelId, fanout_behind: bool },
    /// The node's sweep of its logs found one of `channel` that this node leads, whose stored state
    /// fanned out less than its HW: the replica is activated, and its resumed leadership plans again
    /// what was not known to finish (a leader restarted in place would otherwise wait for the
    /// channel's next input).
    ResumeFanout(ChannelId),
    /// The authoritative meta a [`ShardOutput::ConfirmStray`] asked for (`None`: the read failed or
    /// found none).
    StrayConfirmed { channel: ChannelId, ask: u64, meta: Option<ChannelRuntimeMeta> },
}

/// An output of a shard.
#[derive(Debug)]
pub(crate) enum ShardOutput {
    /// IO (`Send`, `Persist`, `Read`) or an API call's end (`Done`): carried out by whoever runs the
    /// shard, exactly as the node's own effects.
    Effect(NodeEffect),
    /// The channel's replica stopped leading: its next leader plans again what this node's fanout of it
    /// has not finished, so this node stops (see `Effect::FanoutHandedOver`).
    FanoutHandedOver(ChannelId),
    /// A committed message for post-commit fanout (the machine holds it unfinished until
    /// [`ShardInput::FanoutFinished`]).
    Committed { channel: ChannelId, seq: Seq, sender: Option<String>, again: bool },
    /// A metadata proposal (a leader's ISR change); nobody waits for it.
    Propose(Command),
    /// The shard needs `channel`'s meta, at version `at_least` or a newer one (its log's floor: an older
    /// one is stale here): the node fetches it and answers with [`ShardInput::Meta`].
    FetchMeta { channel: ChannelId, at_least: u64 },
    /// A message for this node's own core (a controller here asked for evidence or a failover).
    Loopback(NodeMessage),
    /// The meta a task starts from (`Err`: the shard knows none for the channel, and fetches it).
    TaskMeta { api: ApiId, meta: Result<ChannelRuntimeMeta, ChannelId>, start: TaskStart },
    /// An API append whose sender this node's slot replicas cannot check: the node asks nodes that
    /// can, and answers with [`ShardInput::SenderChecked`].
    VerifySender { api: ApiId, channel: ChannelId, sender: Uid, records: Vec<AppendRecord> },
    /// The node reads `channel`'s meta authoritatively (begun after this is asked) and answers with
    /// [`ShardInput::StrayConfirmed`] and the same `ask`.
    ConfirmStray { channel: ChannelId, ask: u64 },
}

/// A shard's counters, for the node's status.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct ShardCounters {
    /// Replicas activated (incarnations built).
    pub(crate) activations: u64,
    pub(crate) refused_activations: u64,
    /// Activations that found no room and waited in the room queue for a freed place.
    pub(crate) activations_queued_for_room: u64,
    /// Busy leaders asked to take no new append and leave for a leader refused room.
    pub(crate) leaders_asked_to_leave: u64,
    /// Leaders stalled with no caller waiting that left memory for a follower refused room.
    pub(crate) stalled_leaders_evicted: u64,
    /// Leaders only fanning out that left memory for an activation refused room, handing their
    /// unfinished fanout to their next incarnation.
    pub(crate) fanning_out_leaders_evicted: u64,
    pub(crate) stale_messages: u64,
    pub(crate) storage_failures: u64,
    pub(crate) loads_given_up: u64,
    pub(crate) fanout_skipped: u64,
    /// Logs of replicas moved away that this shard forgot.
    pub(crate) stray_logs_forgotten: u64,
}

/// What a shard shows of itself: its replicas and counters.
#[derive(Clone, Debug, Default)]
pub(crate) struct ShardStatus {
    /// A page of its active replicas, in channel order (see [`ChannelShard::status`]).
    pub(crate) channels: Vec<ChannelStatus>,
    /// Its active replicas that a status lists (those with a meta), on the page or not.
    pub(crate) active: usize,
    /// Its active replicas that lead their channel.
    pub(crate) leading: usize,
    pub(crate) counters: ShardCounters,
    /// Channel metas held in memory.
    pub(crate) metas_held: usize,
    /// Replicas waiting for their activation's load.
    pub(crate) loading: usize,
    /// Leaderships filed to start at the eviction scans (see `NodeStatus::leaderships_to_start`).
    pub(crate) leaderships_to_start: usize,
}

/// Who waits for a call (an append, a retention move) the local machine admitted.
#[derive(Debug, Clone, Copy)]
enum CallOrigin {
    Local(ApiId),
    Remote { node: NodeId, id: u64 },
}

/// A call waiting for its channel's meta.
#[derive(Debug)]
struct Waiting {
    api: ApiId,
    call: LeaderCall,
    deadline: Time,
}

/// A call forwarded to its channel's leader: the caller, what it waits for, the channel, the leader it
/// went to.
#[derive(Debug)]
struct Forwarded {
    api: ApiId,
    kind: CallKind,
    channel: ChannelId,
    leader: NodeId,
}

/// A channel's meta as a shard knows it.
struct KnownMeta {
    meta: ChannelRuntimeMeta,
    /// This node's slot replica holds this version or a newer one (the meta was applied or read there).
    stored_here: bool,
}

/// The channel side of a node for the channels hashing to one shard (see the module docs).
pub(crate) struct ChannelShard {
    index: usize,
    config: NodeConfig,
    /// This node's storage identity, named by every frame the shard sends, and the peers it refuses
    /// (sent nothing).
    storages: Arc<KnownStorages>,
    /// `config.machine`, shared by every machine of the shard.
    machine_config: Arc<MachineConfig>,
    /// This shard's part of `active_channels_max`.
    active_max: usize,
    now: Time,
    log: Arc<dyn MessageLog>,
    reader: SlotReader,
    served: Arc<Served>,
    /// Active replicas; only those that took an input since their effects were last drained are
    /// polled, so the cost of an input does not grow with the number of active channels.
    channels: ActiveChannels,
    /// Idle eviction scans every replica: at most once per `EVICT_SCAN_INTERVAL`.
    next_evict_scan: Time,
    /// Replicas waiting for their activation's load, with the inputs parked meanwhile.
    loading: FxHashMap<ChannelId, activation::Loading>,
    /// Loads handed off and not back yet (at most `LOADS_IN_FLIGHT_MAX`).
    loads_in_flight: usize,
    /// Loads waiting for one in flight to come back, oldest first.
    load_queue: VecDeque<ActivationLoad>,
    /// Channels evicted while leading and quiescent: the leader epoch their next incarnation may resume.
    resumable: BTreeMap<ChannelId, LeaderEpoch>,
    metas: FxHashMap<ChannelId, KnownMeta>,
    waiting: FxHashMap<ChannelId, Vec<Waiting>>,
    appends: FxHashMap<u64, (CallOrigin, Option<String>)>,
    /// Retention moves the local leaders admitted: who waits for each.
    retentions: FxHashMap<u64, CallOrigin>,
    /// Senders of appended messages not yet committed (for fanout: no unread badge for the sender).
    senders: BTreeMap<(ChannelId, Seq), String>,
    /// Calls forwarded to a channel's leader.
    forwarded: BTreeMap<u64, Forwarded>,
    /// Calls other nodes forwarded here lately: a copy delivered twice is taken once.
    taken_forwards: TakenForwards,
    /// When each forwarded call stops waiting for its reply (deadlines are increasing: one timeout).
    forward_deadlines: VecDeque<(Time, u64)>,
    /// Channels whose local replica is named leader but cannot lead: when to ask for a failover next.
    cannot_lead: BTreeMap<ChannelId, Time>,
    /// Activations to try again at the next eviction scans, with the tries left: those refused for want
    /// of room (the input that asked for it — a leader's hint, a pull — is gone, and its sender asks
    /// again only after a pull timeout), and a replica a new meta named leader while it was inactive
    /// (a new leader has work of its own to start — its barrier, waking its followers, fanning out
    /// again what its predecessor handed over — that no other input may come to prompt). At most
    /// `retries_max` entries.
    to_activate: BTreeMap<ChannelId, u8>,
    /// The entries of `to_activate` filed for a follower its leader waits on
    /// (`ChannelShard::file_awaited_follower`): no other retry takes their place.
    awaited_retries: BTreeSet<ChannelId>,
    /// The entry of `to_activate` tried last: the next scan starts past it.
    retries_from: Option<ChannelId>,
    /// Replicas asked to write the checkpoint that alone kept them in memory, each with the activation
    /// that waits for the room it makes, placed once it lands (`ChannelShard::hurry_one_checkpoint`).
    /// Keys are active replicas (an entry goes with its replica), so at most `active_max` entries.
    hurried_for: BTreeMap<ChannelId, ChannelId>,
    /// Activations that found no room and nothing to hurry, oldest first: each waits (up to
    /// `activation::ROOM_PATIENCE`) for the next place a replica frees (`ChannelShard::give_freed_places`).
    /// May name channels that wait no longer; at most about `active_max` entries.
    room_queue: VecDeque<ChannelId>,
    /// The leader asked to leave its place of the leaders' share for a leader refused room
    /// (`ChannelShard::ask_a_leader_to_leave`). One a shard; it goes with its replica.
    leaving_for_room: Option<turns::LeaveForRoom>,
    /// HW and fanout progress of replicas taken out of memory before they were quiescent (a storage
    /// failure, a follower rebuilt to lead): their next incarnation keeps both.
    carried_over: BTreeMap<ChannelId, (Seq, Seq)>,
    /// Pulls of followers evicted while waiting for their answer, for their next incarnation to take
    /// (`ChannelMachine::pull_in_flight`); at most `active_max` (at least `KEPT_PULLS_MIN`), the oldest
    /// forgotten first.
    pulls_in_flight: FxHashMap<ChannelId, (u64, tidings_channel::machine::PullInFlight)>,
    /// Kept pulls by their numbers, oldest first; may name pulls taken or replaced since.
    pulls_in_flight_order: VecDeque<(ChannelId, u64)>,
    /// Pulls kept so far: each kept pull's number.
    pulls_kept: u64,
    /// Channels whose log may belong to no replica here, waiting for their authoritative meta (at most
    /// `stray::STRAY_CANDIDATES_MAX`).
    stray: BTreeMap<ChannelId, stray::StrayCandidate>,
    /// Logs being forgotten: the token of each forget, and what its replica knew (see `stray`).
    forgetting: BTreeMap<ChannelId, stray::Forgetting>,
    /// Meta floors known to be in logs (see `floors`): no meta below one is kept in `metas`. Bounded
    /// (`floors_max`).
    floors: FxHashMap<ChannelId, u64>,
    /// Floors being written, one per channel at most, with the evidence requests each holds (at most
    /// `floors_max`).
    floor_writes: FxHashMap<ChannelId, floors::FloorWrite>,
    id_base: u64,
    id_counter: u64,
    next_incarnation: u64,
    /// Channel messages packed per destination until the end of the drain.
    outbox: ChannelOutbox,
    outputs: VecDeque<ShardOutput>,
    counters: ShardCounters,
}

impl ChannelShard {
    /// Shard `index` of `shards` on the node `config` describes.
    #[allow(clippy::too_many_arguments)] // Each is one thing a shard is made of; a struct would only name them again.
    pub(crate) fn new(
        index: usize,
        shards: usize,
        config: NodeConfig,
        storages: Arc<KnownStorages>,
        log: Arc<dyn MessageLog>,
        reader: SlotReader,
        served: Arc<Served>,
        now: Time,
    ) -> Self {
        let shards = shards.clamp(1, SHARDS_MAX);
        Self {
            index,
            storages,
            // Room for a leader and for a follower besides it (see `activation::leaders_max`).
            active_max: config.active_channels_max.div_ceil(shards).max(2),
            now,
            log,
            reader,
            served,
            channels: ActiveChannels::default(),
            next_evict_scan: now,
            loading: FxHashMap::default(),
            loads_in_flight: 0,
            load_queue: VecDeque::new(),
            resumable: BTreeMap::new(),
            metas: FxHashMap::default(),
            waiting: FxHashMap::default(),
            appends: FxHashMap::default(),
            retentions: FxHashMap::default(),
            senders: BTreeMap::new(),
            forwarded: BTreeMap::new(),
            taken_forwards: TakenForwards::default(),
            forward_deadlines: VecDeque::new(),
            cannot_lead: BTreeMap::new(),
            to_activate: BTreeMap::new(),
            awaited_retries: BTreeSet::new(),
            retries_from: None,
            hurried_for: BTreeMap::new(),
            room_queue: VecDeque::new(),
            leaving_for_room: None,
            carried_over: BTreeMap::new(),
            pulls_in_flight: FxHashMap::default(),
            pulls_in_flight_order: VecDeque::new(),
            pulls_kept: 0,
            stray: BTreeMap::new(),
            forgetting: BTreeMap::new(),
            floors: FxHashMap::default(),
            floor_writes: FxHashMap::default(),
            id_base: id_base(config.boot_id, index % shards),
            id_counter: 0,
            // Differs across the node's starts (its boot id), so a replica's machines never share an
            // incarnation, nor the pull ids that start from it, with those of an earlier start.
            next_incarnation: ((config.boot_id & 0xffff_ffff) << 32 | (now.as_millis() & 0xfff) << 20) + 1,
            // Batches stay well within what receivers accept (every node runs with the cluster's limit).
            outbox: ChannelOutbox::new((config.frame_bytes_max / 4).min(4 << 20)),
            outputs: VecDeque::new(),
            counters: ShardCounters::default(),
            machine_config: Arc::new(config.machine.clone()),
            config,
        }
    }

    /// This shard's index.
    pub(crate) fn index(&self) -> usize {
        self.index
    }

    /// The channel machine of `channel`, if active here.
    pub(crate) fn channel(&self, channel: &ChannelId) -> Option<&ChannelMachine> {
        self.channels.get(channel)
    }

    /// Number of channel replicas active in memory.
    pub(crate) fn active_channels(&self) -> usize {
        self.channels.len()
    }

    /// Feeds `inputs` in order, touching the replicas of `WARM_RUN` of them in one loop before feeding
    /// those (see `ChannelMachine::warm`): a frame of a peer or a round of storage completions names
    /// hundreds of replicas, and fed one by one each waited for its own cache misses (perf at 10,000
    /// channels: two thirds of the time `ChannelMachine::handle_persisted` spent in its own code went to
    /// its first load of the machine).
    pub(crate) fn handle_all<T>(
        &mut self,
        now: Time,
        inputs: Vec<T>,
        channel: impl Fn(&T) -> &ChannelId,
        input: impl Fn(T) -> ShardInput,
    ) {
        feed_in_warm_runs(
            self,
            inputs,
            |shard, run| run.iter().fold(0, |acc, next| acc ^ shard.channels.warm(channel(next))),
            |shard, next| shard.handle(now, input(next)),
        );
    }

    /// The shard's counters, and a page of its active replicas: the first `limit` in channel order past
    /// `after`. Only the page's replicas are built (each clones its ISR and its followers' progress),
    /// after a pass over the ids that picks them: O(active replicas) without a sort of them all.
    pub(crate) fn status(&self, after: Option<&ChannelId>, limit: usize) -> ShardStatus {
        let (mut active, mut leading) = (0, 0);
        let mut page: Vec<(&ChannelId, &ChannelMachine)> = Vec::new();
        for (channel, machine) in self.channels.iter().filter(|(_, machine)| machine.meta().is_some()) {
            active += 1;
            leading += usize::from(machine.role() == RoleKind::Leader);
            if after.is_none_or(|after| channel > after) {
                page.push((channel, machine));
            }
        }
        if page.len() > limit {
            page.select_nth_unstable_by(limit, |a, b| a.0.cmp(b.0));
            page.truncate(limit);
        }
        page.sort_unstable_by(|a, b| a.0.cmp(b.0));
        let channels = page.into_iter().filter_map(|(_, machine)| channel_status(machine, self.now)).collect();
        ShardStatus {
            channels,
            active,
            leading,
            counters: self.counters,
            metas_held: self.metas.len(),
            loading: self.loading.len(),
            leaderships_to_start: self.leaderships_to_start(),
        }
    }

    /// One active replica's status (`None`: the channel has no active replica on this shard).
    pub(crate) fn channel_status(&self, channel: &ChannelId) -> Option<ChannelStatus> {
        channel_status(self.channels.get(channel)?, self.now)
    }

    /// A clean stop: every active replica writes now the checkpoint it would write when due (its HW, a
    /// leader's own fanout progress), so that the next start reads up to what this one knew
    /// (`ChannelMachine::checkpoint_now`). The writes come out as outputs; [`ChannelShard::written_out`]
    /// says when they have all landed.
    pub(crate) fn checkpoint_for_stop(&mut self, now: Time) {
        self.advance(now);
        // Through `machine_mut`, which marks each replica for the drain that turns its writes into outputs.
        let active: Vec<ChannelId> = self.channels.iter().map(|(channel, _)| channel.clone()).collect();
        for channel in active {
            if let Some(machine) = self.machine_mut(&channel) {
                machine.checkpoint_now(now);
            }
        }
    }

    /// `true` when no active replica has anything waiting to be written (`ChannelMachine::written_out`).
    pub(crate) fn written_out(&self) -> bool {
        self.channels.iter().all(|(_, machine)| machine.written_out())
    }

    /// Next output (drains the machines touched since the last call first).
    pub(crate) fn poll_output(&mut self) -> Option<ShardOutput> {
        if self.outputs.is_empty() {
            self.drain_machines();
        }
        self.outputs.pop_front()
    }

    /// When to call [`ChannelShard::handle_tick`] next (`None`: nothing scheduled).
    pub(crate) fn poll_timeout(&self) -> Option<Time> {
        let deadlines = [
            self.channels.next_timeout(),
            self.cannot_lead.values().min().copied(),
            self.forward_deadlines.front().map(|(at, _)| *at),
            self.waiting.values().flat_map(|queue| queue.iter().map(|w| w.deadline)).min(),
            (!self.channels.is_empty() || !self.loading.is_empty() || !self.to_activate.is_empty())
                .then_some(self.next_evict_scan),
        ];
        deadlines.into_iter().flatten().min()
    }

    /// Advances time: channel timers, appends that waited too long for a meta or a forwarded reply,
    /// failover requests, idle eviction.
    pub(crate) fn handle_tick(&mut self, now: Time) {
        self.advance(now);
        let mut expired: Vec<ChannelId> = self
            .waiting
            .iter()
            .filter(|(_, queue)| queue.iter().any(|w| w.deadline <= now))
            .map(|(c, _)| c.clone())
            .collect();
        expired.sort();
        for channel in expired {
            self.fail_waiting(&channel, |w| w.deadline <= now, NodeError::MetaUnavailable);
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
            if let Some(Forwarded { api, kind, channel, .. }) = self.forwarded.remove(&forward) {
                self.done(api, kind.failed(NodeError::Aborted(AppendAborted::Timeout)));
                // The leader may be gone: learn the meta in force (a failover may have named another).
                self.fetch_meta(&channel);
            }
        }
        self.request_failovers();
        if self.now >= self.next_evict_scan {
            self.next_evict_scan = self.now + EVICT_SCAN_INTERVAL;
            self.evict_idle();
            self.expire_kept_pulls();
            self.expire_loads();
            self.place_orphaned_waits();
            self.retry_queued_for_room();
            self.expire_stray();
            self.activate_again();
        }
    }

    /// Takes one input.
    pub(crate) fn handle(&mut self, now: Time, input: ShardInput) {
        self.advance(now);
        match input {
            ShardInput::Message { from, message } => self.channel_message(from, message),
            ShardInput::Append { api, channel, sender, records } => match sender {
                None => self.route_call(api, channel, LeaderCall::Append { sender: None, records }),
                Some(sender) => self.check_sender(api, channel, sender, records),
            },
            ShardInput::SenderChecked { api, channel, sender, records, verdict } => match verdict {
                Ok(()) => self.route_call(api, channel, LeaderCall::Append { sender: Some(sender), records }),
                Err(error) => self.done(api, ApiResult::Appended(Err(error))),
            },
            ShardInput::Retain { api, channel, through } => {
                self.route_call(api, channel, LeaderCall::Retain { through })
            }
            ShardInput::Forwarded { from, id, channel, call } => {
                // A second copy is dropped: the first one's outcome answers the caller.
                if self.taken_forwards.first_time(from, id) {
                    self.doubt_meta_unless_replica(&channel);
                    self.call_locally(CallOrigin::Remote { node: from, id }, &channel, call)
                }
            }
            ShardInput::Reply { id, outcome } => {
                if let Some(Forwarded { api, channel, leader, .. }) = self.forwarded.remove(&id) {
                    if outcome.says_not_leading() {
                        self.forget_route(&channel, leader);
                    }
                    self.done(api, outcome.into_api_result());
                }
            }
            ShardInput::Meta { meta, stored_here } => self.learn_meta(meta, stored_here),
            ShardInput::MetasInstalled(metas) => self.learn_installed_metas(&metas),
            ShardInput::MetaMissing(channel) => self.fail_waiting(&channel, |_| true, NodeError::UnknownChannel),
            ShardInput::Evidence { from, task, meta } => self.answer_evidence(from, task, meta),
            ShardInput::Persisted { channel, token, result } => {
                let now = self.now;
                if self.forget_persisted(&channel, token, &result) || self.floor_persisted(&channel, token, &result) {
                    return;
                }
                if let Some(machine) = self.machine_mut(&channel) {
                    machine.handle_persisted(now, token, result);
                }
                // A hurried checkpoint landed: the activation waiting for its room is placed.
                if let Some(waiting) = self.hurried_for.remove(&channel) {
                    self.room_made(&waiting);
                }
            }
            ShardInput::ReadDone { channel, token, result } => {
                let now = self.now;
                if let Some(machine) = self.machine_mut(&channel) {
                    machine.handle_read(now, token, result);
                }
            }
            ShardInput::Loaded(loaded) => self.finish_activation(loaded),
            ShardInput::SenderLookedUp(checked) => self.sender_checked(checked),
            ShardInput::FanoutFinished { channel, seq } => {
                if let Some(machine) = self.machine_mut(&channel) {
                    machine.fanout_finished(seq);
                }
            }
            ShardInput::Served(served) => self.served = served,
            ShardInput::TaskMeta { api, channel, start } => {
                // One the shard let go the node reads back from its slot replica (on its own thread).
                let meta = self.metas.get(&channel).map(|known| known.meta.clone()).ok_or_else(|| channel.clone());
                self.outputs.push_back(ShardOutput::TaskMeta { api, meta, start });
            }
            ShardInput::MaybeStray { channel, fanout_behind } => self.consider_stray(channel, fanout_behind),
            ShardInput::ResumeFanout(channel) => self.activate(&channel),
            ShardInput::StrayConfirmed { channel, ask, meta } => self.stray_confirmed(channel, ask, meta),
        }
    }

    fn advance(&mut self, now: Time) {
        self.now = self.now.max(now);
    }

    fn next_id(&mut self) -> u64 {
        self.id_counter = (self.id_counter + 1) & ((1 << ID_COUNTER_BITS) - 1);
        self.id_base | self.id_counter
    }

    fn done(&mut self, id: ApiId, result: ApiResult) {
        self.outputs.push_back(ShardOutput::Effect(NodeEffect::Done { id, result }));
    }

    fn channel_message(&mut self, from: NodeId, message: ChannelMessage) {
        let channel = message.channel().clone();
        // Answers of an older leadership change nothing: refused here and counted. (A stale pull goes on:
        // the leader answers it with `StaleEpoch`, which sends the follower for the meta; a stale hint
        // too: the machine answers its sender with the newer epoch, which sends that leader for the meta.)
        let epoch = match &message {
            ChannelMessage::Hint(hint) => Some(hint.leader_epoch),
            ChannelMessage::PullResponse(response) => Some(response.leader_epoch),
            ChannelMessage::Pull(_) => None,
        };
        let refused_when_stale = matches!(message, ChannelMessage::PullResponse(_));
        // New data keeps a channel in memory; replication keep-alives (empty answers to long polls) do
        // not, and do not bring an evicted replica back either.
        let news = match &message {
            ChannelMessage::Hint(_) => true,
            ChannelMessage::PullResponse(response) => {
                !matches!(&response.body, tidings_channel::machine::PullBody::Records { records, .. } if records.is_empty())
            }
            ChannelMessage::Pull(_) => false,
        };
        let now = self.now;
        // An active replica takes it with one lookup (the hot path at many channels).
        let active = if news { self.channels.get_used(&channel, now) } else { self.channels.get_marked(&channel) };
        let machine = match active {
            Some(machine) => machine,
            // An empty answer brings no evicted replica back.
            None if matches!(&message, ChannelMessage::PullResponse(_)) && !news => return self.drop_message(&message),
            None => {
                // A leader of a newer epoch speaks to a replica not in memory: the meta held here is
                // stale (its pushes were lost while the replica was out), and activating under it may
                // be refused for good — a replica that meta names leader waits for a leader's room,
                // while the channel's real leader waits for it (sim seed 219001768).
                if epoch.is_some_and(|e| self.metas.get(&channel).is_some_and(|known| known.meta.leader_epoch < e)) {
                    self.fetch_meta(&channel);
                }
                self.activate(&channel);
                if self.is_loading(&channel) {
                    // Too many parked: dropped, the peer sends it again.
                    if let Err(activation::Deferred::Message { message, .. }) =
                        self.park(&channel, activation::Deferred::Message { from, message })
                    {
                        self.drop_message(&message);
                    }
                    return;
                }
                match self.machine_mut(&channel) {
                    Some(machine) => machine,
                    None => {
                        // Not activated (no room to load, or no meta yet): the peer sends it again.
                        self.drop_message(&message);
                        return self.fetch_meta(&channel);
                    }
                }
            }
        };
        // Checked against the replica's own meta: no extra lookup on the hot path.
        let stale = epoch.is_some_and(|e| machine.meta().is_some_and(|m| e < m.leader_epoch));
        if !stale || !refused_when_stale {
            machine.handle_message(now, from, message);
        }
        self.counters.stale_messages += u64::from(stale);
    }

    /// Sends a node message: to a peer as a frame, to this node's core through the loopback.
    /// Writes `op` to `channel`'s log through the durable path, under an incarnation of its own (no
    /// machine's completion can be taken for it), and returns the write's token: the shard's own writes
    /// (a forget, a meta floor), finished by `ShardInput::Persisted` with that token.
    fn persist_own(&mut self, channel: &ChannelId, op: LogOp) -> PersistToken {
        let token = PersistToken { incarnation: self.next_incarnation, generation: 0, id: 0 };
        self.next_incarnation += 1;
        let batch = LogBatch::new(channel.clone(), vec![op]);
        self.outputs.push_back(ShardOutput::Effect(NodeEffect::Persist { token, batch }));
        token
    }

    fn send_node(&mut self, to: NodeId, message: NodeMessage) {
        if to == self.config.node {
            self.outputs.push_back(ShardOutput::Loopback(message));
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
        if self.storages.refuses(to) {
            return;
        }
        let frame = encode(&self.storages.frame(self.config.cluster, self.config.node, to, body));
        self.outputs.push_back(ShardOutput::Effect(NodeEffect::Send { to, frame }));
    }

    /// Drains the effects of every machine touched since the last drain, then sends what the outbox
    /// packed.
    fn drain_machines(&mut self) {
        // Effects may touch further channels (or this one again): drain until nothing is dirty. While
        // activations wait for room, the replicas drained are the ones whose places may have come free.
        let mut effects = Vec::new();
        loop {
            let mut touched = Vec::new();
            let room_wanted = !self.room_queue.is_empty();
            while let Some(channel) = self.channels.drain_next(&mut effects) {
                for effect in effects.drain(..) {
                    self.channel_effect(&channel, effect);
                }
                if room_wanted {
                    touched.push(channel);
                }
            }
            if touched.is_empty() || !self.give_freed_places(touched) {
                break;
            }
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

    fn channel_effect(&mut self, channel: &ChannelId, effect: Effect) {
        match effect {
            Effect::Persist { token, batch } => {
                self.outputs.push_back(ShardOutput::Effect(NodeEffect::Persist { token, batch }))
            }
            Effect::Send { to, message } => {
                if let Some(batch) = self.outbox.push(to, message) {
                    self.send_channel_batch(to, batch);
                }
            }
            Effect::Read { token, from, through, max_bytes } => {
                let read = NodeEffect::Read { channel: channel.clone(), token, from, through, max_bytes };
                self.outputs.push_back(ShardOutput::Effect(read))
            }
            Effect::AppendDone { id, result } => {
                let Some((origin, sender)) = self.appends.remove(&id.0) else { return };
                if let (Some(sender), Ok(seqs), true) = (sender, &result, self.config.fanout_enabled) {
                    // AppendDone comes before the `Committed` that hands these seqs to fanout.
                    for seq in seqs {
                        self.senders.insert((channel.clone(), *seq), sender.clone());
                    }
                }
                self.answer(origin, CallOutcome::Appended(result.map_err(RemoteAppendError::Aborted)));
            }
            Effect::RetentionDone { id, result } => {
                let Some(origin) = self.retentions.remove(&id.0) else { return };
                self.answer(origin, CallOutcome::Retained(result.map_err(RemoteAppendError::Aborted)));
            }
            Effect::Committed { last, messages, inherited, skipped, .. } => {
                self.committed(channel, last, messages, inherited, skipped);
            }
            Effect::ProposeMeta { expected_version, meta, .. } => {
                // A refused proposal is retried by the machine after its proposal timeout.
                let command = Command::CasRuntimeMeta { expected_version, meta: *meta, proof: None };
                self.outputs.push_back(ShardOutput::Propose(command));
            }
            Effect::RefreshMeta => self.fetch_meta(channel),
            Effect::FanoutHandedOver => {
                if self.config.fanout_enabled {
                    self.outputs.push_back(ShardOutput::FanoutHandedOver(channel.clone()));
                }
            }
            Effect::NeedsFailover => {
                tracing::warn!(%channel, node = %self.config.node, "channel replica cannot lead: asking for a failover");
                self.cannot_lead.insert(channel.clone(), self.now);
            }
            Effect::StorageFailed => {
                // The machine stops writing for good; a new incarnation starts from what the store holds
                // durably, under the new leader epoch the failover brings.
                tracing::warn!(%channel, node = %self.config.node, "channel log failed: asking for a failover");
                self.cannot_lead.insert(channel.clone(), self.now);
                self.counters.storage_failures += 1;
                self.retire(channel);
            }
        }
    }

    /// Messages committed through `last`: handed to fanout with their senders (the first `inherited`
    /// as planned again for a predecessor), or marked fanned out when fanout is off.
    fn committed(&mut self, channel: &ChannelId, last: Seq, messages: Vec<Seq>, inherited: usize, skipped: u64) {
        if self.config.fanout_enabled {
            if skipped > 0 {
                tracing::warn!(%channel, skipped, "a new leader plans again only the most recent of its predecessors' unfinished fanout");
                self.counters.fanout_skipped += skipped;
            }
            for (i, seq) in messages.into_iter().enumerate() {
                let sender = self.senders.remove(&(channel.clone(), seq));
                let again = i < inherited;
                self.outputs.push_back(ShardOutput::Committed { channel: channel.clone(), seq, sender, again });
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
        } else if let Some(machine) = self.machine_mut(channel) {
            for seq in messages {
                machine.fanout_finished(seq);
            }
        }
    }
}

/// A forwarded append's failure as the caller sees it.
fn remote_error(error: RemoteAppendError) -> NodeError {
    match error {
        RemoteAppendError::Refused(e) => NodeError::Append(e),
        RemoteAppendError::Aborted(e) => NodeError::Aborted(e),
        other => NodeError::Remote(other),
    }
}

/// An operator's view of `machine` at `now` (`None` before it has a meta).
fn channel_status(machine: &ChannelMachine, now: Time) -> Option<ChannelStatus> {
    let meta = machine.meta()?;
    Some(ChannelStatus {
        channel: machine.channel().clone(),
        role: machine.role(),
        meta_version: meta.version,
        leader: meta.leader,
        leader_epoch: meta.leader_epoch,
        epoch: meta.epoch,
        isr: meta.isr.clone(),
        hw: machine.hw(),
        hw_durable: machine.durable_state().hw,
        log_end: machine.log_end(),
        durable_last: machine.durable_last(),
        retention_through: meta.retention_through,
        pending_appends: machine.drain_status().pending_appends,
        replicas: machine.replica_progress(now),
    })
}

/// A shard (the only one) of a node serving no slot group, over `log` and an empty metadata store: for
/// the unit tests of the shard's modules.
#[cfg(test)]
pub(super) fn test_shard(config: NodeConfig, log: Arc<dyn MessageLog>) -> ChannelShard {
    let reader = SlotReader::new(tidings_store::MetaStore::new(Arc::new(tidings_store::MemoryKv::new())));
    let served = Arc::new(Served::new(Arc::new(config.table()), Vec::new(), Vec::new(), 0));
    ChannelShard::new(0, 1, config, KnownStorages::for_tests(), log, reader, served, Time::ZERO)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tidings_types::ChannelType;

    #[test]
    fn ids_name_the_shard_that_handed_them_out_for_every_count() {
        for shards in [1, 2, 3, 7, SHARDS_MAX] {
            for index in [0, 1, shards / 2, shards - 1] {
                let base = id_base(0xdead_beef_1234_5678, index);
                for counter in [1, 2, (1 << ID_COUNTER_BITS) - 1] {
                    assert_eq!(shard_of_id(base | counter, shards), index % shards, "{shards} shards, {index}");
                }
            }
        }
    }

    /// An append for a channel whose leader this node refuses for its storage identity (it came back on
    /// an emptied directory, and answers nothing) is not forwarded to wait out its timeout: it fails at
    /// once, retryable, and the shard asks for the meta in force (the channel fails over).
    #[test]
    fn an_append_to_a_leader_refused_for_its_storage_fails_at_once_and_the_meta_is_fetched() {
        let config = NodeConfig::new(NodeId::new(1), (1..=3).map(NodeId::new).collect());
        let mut shard = test_shard(config, Arc::new(tidings_store::message::MemoryLog::new(Default::default())));
        let channel = ChannelId::new(ChannelType::GROUP, "led-by-a-lost-node").unwrap();
        let replicas = vec![NodeId::new(2), NodeId::new(3)];
        let meta = ChannelRuntimeMeta {
            channel: channel.clone(),
            version: 1,
            leader: NodeId::new(2),
            isr: replicas.clone(),
            replicas,
            min_isr: 1,
            epoch: tidings_types::Epoch::new(1),
            leader_epoch: LeaderEpoch::new(1),
            write_fence: None,
            retention_through: Seq::new(0),
        };
        shard.handle(Time::ZERO, ShardInput::Meta { meta, stored_here: false });
        shard.storages.refuse_for_tests(NodeId::new(2));
        let append = ShardInput::Append { api: ApiId(7), channel: channel.clone(), sender: None, records: Vec::new() };
        shard.handle(Time::ZERO, append);
        let outputs: Vec<ShardOutput> = std::iter::from_fn(|| shard.poll_output()).collect();
        let done = outputs.iter().any(|o| {
            matches!(o, ShardOutput::Effect(NodeEffect::Done { id: ApiId(7), result: ApiResult::Appended(Err(error)) })
                if error.remedy() == crate::node::Remedy::Retry)
        });
        assert!(done, "answered at once, retryable: {outputs:?}");
        assert!(outputs.iter().any(|o| matches!(o, ShardOutput::FetchMeta { channel: c, .. } if *c == channel)));
        assert!(!outputs.iter().any(|o| matches!(o, ShardOutput::Effect(NodeEffect::Send { .. }))), "no forward");
    }

    /// Node 1's shard knowing `channel` led by `leader` at `version`: replicas 2 and 3 (none here).
    fn meta_led_by(channel: &ChannelId, leader: u64, version: u64) -> ChannelRuntimeMeta {
        let replicas = vec![NodeId::new(2), NodeId::new(3)];
        ChannelRuntimeMeta {
            version,
            leader: NodeId::new(leader),
            ..ChannelRuntimeMeta::created(channel.clone(), replicas, 1)
        }
    }

    /// The nodes `outputs` send a frame to (the forwards, in these tests), in order.
    fn forwards_to(outputs: &[ShardOutput]) -> Vec<NodeId> {
        outputs
            .iter()
            .filter_map(|o| match o {
                ShardOutput::Effect(NodeEffect::Send { to, .. }) => Some(*to),
                _ => None,
            })
            .collect()
    }

    /// A node that holds no replica of a channel and does not serve its slot group hears of no change
    /// of its leader: its meta, once fetched to route a call, named the old leader for good, and every
    /// call through it was forwarded there and refused. A refusal that says the leader does not lead
    /// now lets that meta go, and the next call waits for the one in force and goes to its leader.
    #[test]
    fn a_forward_refused_as_not_leading_sends_the_next_call_by_the_meta_in_force() {
        let config = NodeConfig::new(NodeId::new(1), (1..=3).map(NodeId::new).collect());
        let mut shard = test_shard(config, Arc::new(tidings_store::message::MemoryLog::new(Default::default())));
        let channel = ChannelId::new(ChannelType::GROUP, "led-elsewhere-now").unwrap();
        shard.handle(Time::ZERO, ShardInput::Meta { meta: meta_led_by(&channel, 2, 1), stored_here: false });
        let append =
            |api| ShardInput::Append { api: ApiId(api), channel: channel.clone(), sender: None, records: Vec::new() };
        shard.handle(Time::ZERO, append(7));
        let outputs: Vec<ShardOutput> = std::iter::from_fn(|| shard.poll_output()).collect();
        assert_eq!(forwards_to(&outputs), vec![NodeId::new(2)]);
        let id = *shard.forwarded.keys().next().expect("the forward");
        let refused = RemoteAppendError::Refused(tidings_channel::machine::AppendError::NotLeader {
            leader: Some(NodeId::new(3)),
        });
        shard.handle(Time::ZERO, ShardInput::Reply { id, outcome: CallOutcome::Appended(Err(refused)) });
        let outputs: Vec<ShardOutput> = std::iter::from_fn(|| shard.poll_output()).collect();
        assert!(outputs.iter().any(|o| matches!(o, ShardOutput::Effect(NodeEffect::Done { id: ApiId(7), .. }))));
        // The next call fetches the meta and waits for it instead of going to node 2 again.
        shard.handle(Time::ZERO, append(8));
        let outputs: Vec<ShardOutput> = std::iter::from_fn(|| shard.poll_output()).collect();
        assert!(forwards_to(&outputs).is_empty(), "not forwarded by the stale meta: {outputs:?}");
        assert!(outputs.iter().any(|o| matches!(o, ShardOutput::FetchMeta { channel: c, .. } if *c == channel)));
        shard.handle(Time::ZERO, ShardInput::Meta { meta: meta_led_by(&channel, 3, 2), stored_here: false });
        let outputs: Vec<ShardOutput> = std::iter::from_fn(|| shard.poll_output()).collect();
        assert_eq!(forwards_to(&outputs), vec![NodeId::new(3)], "the waiting call goes to the leader in force");
    }

    /// A call forwarded to a node whose meta does not name it a replica: one of the two metas is
    /// stale, and the receiver asks for the one in force as it refuses the call. A replica that does
    /// not lead asks for nothing (its channel's messages correct its meta).
    #[test]
    fn a_forward_to_a_node_that_holds_no_replica_by_its_meta_has_it_fetch_the_meta() {
        let forwarded_to = |node: u64| {
            let config = NodeConfig::new(NodeId::new(node), (1..=3).map(NodeId::new).collect());
            let mut shard = test_shard(config, Arc::new(tidings_store::message::MemoryLog::new(Default::default())));
            let channel = ChannelId::new(ChannelType::GROUP, "led-by-3").unwrap();
            shard.metas.insert(channel.clone(), KnownMeta { meta: meta_led_by(&channel, 3, 1), stored_here: false });
            let call = LeaderCall::Append { sender: None, records: Vec::new() };
            let from = NodeId::new(if node == 1 { 2 } else { 1 });
            shard.handle(Time::ZERO, ShardInput::Forwarded { from, id: 5, channel: channel.clone(), call });
            let outputs: Vec<ShardOutput> = std::iter::from_fn(|| shard.poll_output()).collect();
            outputs.iter().any(|o| matches!(o, ShardOutput::FetchMeta { channel: c, .. } if *c == channel))
        };
        assert!(forwarded_to(1), "node 1 holds no replica by its meta: it fetches");
        assert!(!forwarded_to(2), "node 2 is a follower by its meta: it does not");
    }

    #[test]
    fn channels_spread_evenly_over_the_shards() {
        let shards = 4;
        let mut counts = [0usize; 4];
        for i in 0..4_000 {
            let channel = ChannelId::new(ChannelType::GROUP, &format!("room-{i}")).unwrap();
            counts[shard_of(&channel, shards)] += 1;
        }
        assert!(counts.iter().all(|c| (800..=1_200).contains(c)), "{counts:?}");
    }
}
