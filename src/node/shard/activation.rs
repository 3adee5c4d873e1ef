//! Activation on first use, with its storage reads off the shard's thread: an input for an inactive
//! replica starts an [`ActivationLoad`] (the channel's meta when the shard holds none, its log state,
//! and a leader's recent records) and waits, parked and bounded, while whoever runs the shard carries
//! the load out (the threaded runtime on its reader thread, never on a reactor). The answer
//! builds the machine — apply the full meta, then accept traffic — and the parked inputs follow, in
//! the order they came.

use super::calls::LeaderCall;
use super::room::Leaving;
use super::{CallOrigin, ChannelShard, KnownMeta, ShardOutput};
use crate::node::core::{ApiId, NodeEffect};
use crate::node::error::NodeError;
use crate::node::message::RemoteAppendError;
use std::sync::Arc;
use tidings_channel::machine::{AppendError, ChannelMachine, ChannelMessage, RoleKind};
use tidings_slot::query::SlotReader;
use tidings_store::message::{ChannelLogState, MessageLog, ReadLimits, Record};
use tidings_store::StoreError;
use tidings_types::{ChannelId, ChannelRuntimeMeta, NodeId, Seq, Time};

/// Most loads a shard has handed off at once (the reader thread's queue of 4,096 jobs also takes pull and
/// API reads, which must find room); more activations wait in the shard's own queue, as many as the
/// shard may keep replicas active (`active_channels_max`), and past that an input for another inactive
/// replica is refused as an activation at the cap is (peer messages dropped, appends `TooManyChannels`).
const LOADS_IN_FLIGHT_MAX: usize = 1024;
/// Most leaders a shard keeps active: all but an eighth of its room (at least one place), which only
/// followers take. Leaders waiting for their followers are not quiescent; were every place of two
/// nodes taken by such leaders, each waiting for a follower the other has no room to activate,
/// neither would ever commit. Followers can always make room among themselves (see
/// `ChannelMachine::can_leave_memory_as_follower`), so the followers those leaders wait for find it.
/// Leaders named in followers' places can still fill a shard (a failover or transfer names a replica
/// leader in place): a follower then takes the place of a leader stalled with no caller waiting on it
/// (`ChannelShard::evict_one_stalled_leader`).
pub(super) fn leaders_max(active_max: usize) -> usize {
    active_max.saturating_sub((active_max / 8).max(1)).max(1)
}

/// Room past the cap a shard keeps for followers (see `ChannelShard::followers_place_taken_by_leaders`):
/// the places [`leaders_max`] leaves them.
pub(super) fn followers_reserve(active_max: usize) -> usize {
    active_max - leaders_max(active_max)
}

/// A load not answered within this is given up (its parked inputs end; the next input tries again):
/// one lost on its way must not hold a channel's inputs for good.
const LOAD_PATIENCE: std::time::Duration = std::time::Duration::from_secs(30);

/// The storage reads one replica's activation needs, carried out off the shard's thread (as a
/// [`Lookup::Load`](super::Lookup::Load)).
#[derive(Clone, Debug)]
pub struct ActivationLoad {
    channel: ChannelId,
    id: u64,
    me: NodeId,
    /// The meta the shard holds; `None`: read it from this node's slot replica.
    meta: Option<ChannelRuntimeMeta>,
    /// How many of the last records a leader reads back (its idempotency window).
    window: u64,
}

/// What an [`ActivationLoad`] read.
#[derive(Debug)]
pub(crate) struct Loaded {
    channel: ChannelId,
    id: u64,
    /// The meta read from this node's slot replica (only when the load was asked to).
    meta_read: Option<ChannelRuntimeMeta>,
    outcome: Result<LoadedLog, LoadFailure>,
}

/// The log side of a load.
#[derive(Debug)]
struct LoadedLog {
    state: ChannelLogState,
    /// The last records, read only for a replica the meta names leader (a follower leaves them out).
    recent: Option<Vec<Record>>,
}

/// Why a load gave no log.
#[derive(Debug)]
enum LoadFailure {
    /// No meta: neither the shard nor this node's slot replica holds one.
    NoMeta,
    /// The meta names other nodes: nothing to activate here.
    NotReplica,
    /// The store could not be read (the next input tries again).
    Store(StoreError),
}

impl ActivationLoad {
    /// The channel to activate.
    pub fn channel(&self) -> &ChannelId {
        &self.channel
    }

    /// Reads what the activation needs: the meta (unless the shard gave it), the log state and, for a
    /// leader, the records of its idempotency window.
    pub(super) fn carry_out(&self, log: &dyn MessageLog, reader: &SlotReader) -> Loaded {
        let (meta, meta_read) = match &self.meta {
            Some(meta) => (Some(meta.clone()), None),
            None => {
                let stored = reader.runtime_meta(&self.channel).ok().flatten();
                (stored.clone(), stored)
            }
        };
        let outcome = match meta {
            None => Err(LoadFailure::NoMeta),
            Some(meta) if !meta.is_replica(self.me) => Err(LoadFailure::NotReplica),
            Some(meta) => self.read_log(log, meta.leader == self.me).map_err(LoadFailure::Store),
        };
        Loaded { channel: self.channel.clone(), id: self.id, meta_read, outcome }
    }

    fn read_log(&self, log: &dyn MessageLog, leads: bool) -> Result<LoadedLog, StoreError> {
        let state = log.state(&self.channel)?;
        // Two of a channel's three replicas are followers: most activations (every message, when traffic
        // spreads over more channels than stay active) need not read the recent records back.
        let recent = if leads {
            let from = Seq::new(state.last_seq.get().saturating_sub(self.window).saturating_add(1));
            let limits = ReadLimits { records_max: usize::MAX, bytes_max: usize::MAX };
            Some(log.read(&self.channel, from, state.last_seq, limits)?)
        } else {
            None
        };
        Ok(LoadedLog { state, recent })
    }
}

/// An input that needs the replica, parked while it loads.
#[derive(Debug)]
pub(super) enum Deferred {
    /// A peer's channel message.
    Message { from: NodeId, message: ChannelMessage },
    /// A call (append or retention move) for the local leader.
    Call { origin: CallOrigin, call: LeaderCall },
    /// A controller's request for this replica's evidence.
    Evidence { from: NodeId, task: u64 },
    /// An API call not routed yet: its channel's meta comes with the load.
    Route { api: ApiId, call: LeaderCall },
}

/// An activation waiting for its load.
#[derive(Debug)]
pub(super) struct Loading {
    id: u64,
    parked: Vec<Deferred>,
    given_up_at: Time,
    /// Handed off (counted in `loads_in_flight`), not waiting in `load_queue`.
    in_flight: bool,
    /// What the load read, kept while the activation waits for room, and how it waits.
    waiting_for_room: Option<(Loaded, RoomWait)>,
    /// Until when the activation may wait in `room_queue` (set when it first finds no room and nothing
    /// to hurry; kept across its tries, so a wait is bounded however often it is tried again).
    room_patience: Option<Time>,
    /// `true` once `room_patience` was lengthened to the end of a leave asked for this leader
    /// (`ChannelShard::ask_a_leader_to_leave`): once a wait at most, so that it stays bounded.
    waited_for_a_leave: bool,
}

impl Loading {
    /// `true` while the activation, its load done, waits for room the way `how` says.
    fn waits_for_room(&self, how: RoomWait) -> bool {
        self.waiting_for_room.as_ref().is_some_and(|(_, wait)| *wait == how)
    }
}

/// Whether an activation whose load is done found its place among the active replicas
/// (`ChannelShard::room_for`).
enum Room {
    /// There is a place for it now (a replica may have been evicted for it).
    Made,
    /// None: it waits or is refused (`ChannelShard::wait_for_room_or_refuse`). `for_a_leader` when a
    /// place of the leaders' share is what is missing (only a leader is then hurried or asked to leave).
    Missing { for_a_leader: bool },
}

/// How an activation whose load is done waits for a place among the active replicas.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum RoomWait {
    /// For the checkpoint hurried for it to land (`ChannelShard::hurry_one_checkpoint`, `hurried_for`).
    Hurried,
    /// In `room_queue`, for the next place a replica frees (`ChannelShard::give_freed_places`).
    Queued,
}

/// `true` when `state`'s log holds a message (not a barrier: one starts each epoch) past `seq`, up to its
/// checkpointed HW.
fn messages_past(state: &ChannelLogState, seq: Seq) -> bool {
    let barriers = state.epochs.iter().filter(|(_, start)| *start > seq && *start <= state.hw).count() as u64;
    state.hw.get().saturating_sub(seq.get()) > barriers
}

/// Longest an activation waits in the room queue for a freed place before it is refused
/// `TooManyChannels` as it was before it waited (checked at the eviction scans: up to a scan later).
/// Refused at once, an activation at the cap was tried again only at the next scan or its sender's
/// retry, and places changed hands with the probes' rounds: 48 busy channels on a few places, one
/// placed a round of probes each half second, and nine channels took no append in a healed phase of
/// 15 s (sim seed 556000608).
pub(super) const ROOM_PATIENCE: std::time::Duration = std::time::Duration::from_secs(1);

/// The fewest activations a shard's room queue holds, however small its room. Bounded by the room
/// alone, a shard of two places held two waiting leaders, and the busy leaders that took the one
/// leader's place in turns came back into the queue as each left: three of them went round for the
/// whole healed phase while two others, finding the queue full, were refused `TooManyChannels` each
/// time they came (sim seed 719000555: 24 channels of MinISR 3, idle eviction at 300 ms). The file of
/// retries (`RETRIES_MIN`) and the kept pulls (`KEPT_PULLS_MIN`) have floors for the same reason. A
/// queued activation holds its load's log state and its parked inputs, each bounded.
pub(super) const ROOM_QUEUE_MIN: usize = 16;

impl ChannelShard {
    /// Starts activating the local replica of `channel` on first use: a load is asked for when the
    /// meta names this node a replica, or when this node's slot replica may hold a meta the shard does
    /// not (the load reads it). A channel whose meta nobody here holds has it fetched. Nothing happens
    /// for a replica already active or loading.
    pub(super) fn activate(&mut self, channel: &ChannelId) {
        // A log being forgotten is activated once the forget is durable (see `stray`).
        if self.channels.contains(channel) || self.loading.contains_key(channel) || self.is_forgetting(channel) {
            return;
        }
        let meta = self.metas.get(channel).map(|known| known.meta.clone());
        match &meta {
            Some(meta) if !meta.is_replica(self.config.node) => return,
            Some(_) => {}
            // A floor known without a meta: this node's slot replica held only an older one at the last
            // load (see `floors`); a newer one is fetched.
            None if self.served.serves(channel) && self.known_floor(channel) == 0 => {}
            None => return self.fetch_meta(channel),
        }
        if self.loading_full() {
            self.counters.refused_activations += 1;
            self.activate_later(channel, super::retries::REFUSED_ACTIVATION_TRIES);
            return;
        }
        self.load(channel, meta, Vec::new());
    }

    /// Asks for `channel`'s load: handed off at once while fewer than `LOADS_IN_FLIGHT_MAX` are, else
    /// queued until one comes back.
    fn load(&mut self, channel: &ChannelId, meta: Option<ChannelRuntimeMeta>, parked: Vec<Deferred>) {
        let id = self.next_id();
        let job = ActivationLoad {
            channel: channel.clone(),
            id,
            me: self.config.node,
            meta,
            window: self.config.machine.idempotency_window as u64,
        };
        let in_flight = self.loads_in_flight < LOADS_IN_FLIGHT_MAX;
        let given_up_at = self.now + LOAD_PATIENCE;
        self.loading.insert(
            channel.clone(),
            Loading {
                id,
                parked,
                given_up_at,
                in_flight,
                waiting_for_room: None,
                room_patience: None,
                waited_for_a_leave: false,
            },
        );
        if in_flight {
            self.hand_off(job);
        } else {
            self.load_queue.push_back(job);
        }
    }

    fn hand_off(&mut self, job: ActivationLoad) {
        self.loads_in_flight += 1;
        self.outputs.push_back(ShardOutput::Effect(NodeEffect::Lookup(super::Lookup::Load(job))));
    }

    /// A handed-off load came back (or was given up): the next queued one, if any, goes.
    fn load_ended(&mut self) {
        self.loads_in_flight = self.loads_in_flight.saturating_sub(1);
        while let Some(job) = self.load_queue.pop_front() {
            // One given up meanwhile is skipped.
            let Some(loading) = self.loading.get_mut(&job.channel).filter(|loading| loading.id == job.id) else {
                continue;
            };
            loading.in_flight = true;
            self.hand_off(job);
            break;
        }
    }

    /// Gives up the loads not answered in time: their parked appends get `Busy` (the caller retries).
    /// Called with idle eviction's scan (once a second).
    pub(super) fn expire_loads(&mut self) {
        let now = self.now;
        let expired: Vec<ChannelId> =
            self.loading.iter().filter(|(_, loading)| loading.given_up_at <= now).map(|(c, _)| c.clone()).collect();
        for channel in expired {
            let Some(Loading { parked, in_flight, .. }) = self.loading.remove(&channel) else { continue };
            tracing::warn!(%channel, node = %self.config.node, "channel replica's load not answered: given up");
            self.counters.loads_given_up += 1;
            if in_flight {
                // Its answer, should it come, is not counted again (its id matches nothing now).
                self.load_ended();
            }
            // Given up: nothing parked is tried again (a route would load once more and wait as long).
            for input in parked {
                match input {
                    Deferred::Call { origin, call } => {
                        self.fail_call(origin, call.kind(), RemoteAppendError::Refused(AppendError::Busy))
                    }
                    Deferred::Route { api, call } => {
                        self.done(api, call.kind().failed(NodeError::Busy(channel.clone())))
                    }
                    Deferred::Message { .. } | Deferred::Evidence { .. } => {}
                }
            }
        }
    }

    /// The room `channel`'s activation waited for was made (the checkpoint hurried for it landed, or the
    /// replica hurried left, or a replica freed a place): it is placed now with what its load read.
    pub(super) fn room_made(&mut self, channel: &ChannelId) {
        if let Some((loaded, _)) = self.loading.get_mut(channel).and_then(|loading| loading.waiting_for_room.take()) {
            self.finish_activation(loaded);
        }
    }

    /// Activations waiting for room whose hurried replica left before its checkpoint landed (a storage
    /// failure, a new incarnation): placed now. Called with idle eviction's scan (once a second).
    pub(super) fn place_orphaned_waits(&mut self) {
        let awaited: std::collections::BTreeSet<&ChannelId> = self.hurried_for.values().collect();
        let orphaned: Vec<ChannelId> = self
            .loading
            .iter()
            .filter(|(c, loading)| loading.waits_for_room(RoomWait::Hurried) && !awaited.contains(c))
            .map(|(c, _)| c.clone())
            .collect();
        for channel in orphaned {
            self.room_made(&channel);
        }
    }

    /// `true` while `channel`'s activation waits in the room queue.
    pub(super) fn is_queued_for_room(&self, channel: &ChannelId) -> bool {
        self.loading.get(channel).is_some_and(|loading| loading.waits_for_room(RoomWait::Queued))
    }

    /// Files `channel` in the room queue, unless as many activations wait there as the shard has room
    /// for active replicas, or [`ROOM_QUEUE_MIN`] if that is more (one more for the leader a leave runs
    /// for, `asked_for`): `false` then (the activation is refused). The queue may name channels that wait
    /// no longer (given up, placed another way): those are skipped where it is read, and dropped when it
    /// grows to its bound.
    fn queue_for_room(&mut self, channel: &ChannelId, asked_for: bool) -> bool {
        let bound = self.active_max.max(ROOM_QUEUE_MIN) + usize::from(asked_for);
        if self.room_queue.len() >= bound {
            self.drop_stale_queued();
        }
        if self.room_queue.contains(channel) {
            return true;
        }
        if self.room_queue.len() >= bound {
            return false;
        }
        self.room_queue.push_back(channel.clone());
        true
    }

    /// Hands the places of `touched` replicas (those a drain just went through) that can leave memory now
    /// to the activations in the room queue, oldest first: a quiescent one, or a leader only fanning out
    /// that may hand its fanout over, makes room at once (the activation placed evicts it, or whichever
    /// replica the same rules pick first: `ChannelShard::may_leave_for_room`), one that only its
    /// checkpoint keeps has the checkpoint hurried for the activation. A follower's place, or a leader's
    /// only fanning out (it holds none of the leaders' share), goes to a leader only while leaders do
    /// not fill their share. `true` if anything was placed or hurried (the shard has machines to drain
    /// again). While activations wait: O(1) a touched replica, and O(waiting) for one that can leave;
    /// nothing otherwise.
    pub(super) fn give_freed_places(&mut self, touched: Vec<ChannelId>) -> bool {
        let mut gave = false;
        for channel in touched {
            if self.room_queue.is_empty() {
                break;
            }
            let Some(machine) = self.channels.get(&channel) else { continue };
            if self.hurried_for.contains_key(&channel) || !self.resided(&channel) {
                continue;
            }
            let leaving = self.may_leave_for_room(&channel, machine);
            if leaving == Leaving::Stays {
                continue;
            }
            let leader_place = machine.role() == RoleKind::Leader && !machine.leads_only_fanning_out();
            let Some(waiting) = self.next_queued_for(&channel, leader_place) else { continue };
            if leaving == Leaving::Now {
                self.room_made(&waiting);
                gave = true;
                continue;
            }
            let now = self.now;
            if self.machine_mut(&channel).is_some_and(|machine| machine.checkpoint_to_leave(now)) {
                self.hurried_for.insert(channel, waiting.clone());
                if let Some((_, wait)) = self.loading.get_mut(&waiting).and_then(|l| l.waiting_for_room.as_mut()) {
                    *wait = RoomWait::Hurried;
                }
                gave = true;
            } else {
                self.room_queue.push_front(waiting);
            }
        }
        gave
    }

    /// `true` when `channel`'s leader, its log at `state` and `parked` inputs waiting on it, comes back
    /// only to fan out: it resumes a leadership its log holds (not a start), every record is committed
    /// and checkpointed, a message past its checkpointed fanout progress is left to fan out, and no
    /// call waits on it. Once active it leads only fanning out (`ChannelMachine::leads_only_fanning_out`)
    /// and holds no place of the leaders' share, so its activation does not keep to that share: kept to
    /// it, the comeback of a fanning-out leader evicted for another's room (`evict_one_fanning_out_leader`),
    /// or the resume after a restart, had a busy leader asked to leave for it when leaders filled their
    /// share. An append coming once it is active makes it a leader of the share like any other, past the
    /// share by one until one leaves (followers are let in past the cap meanwhile:
    /// `followers_place_taken_by_leaders`).
    fn comes_back_only_to_fan_out(
        &self,
        meta: &ChannelRuntimeMeta,
        state: &ChannelLogState,
        parked: &[Deferred],
    ) -> bool {
        self.config.fanout_enabled
            && meta.leader == self.config.node
            && state.last_epoch() == meta.leader_epoch
            && state.hw == state.last_seq
            && messages_past(state, state.fanned_through)
            && !parked.iter().any(|input| matches!(input, Deferred::Call { .. } | Deferred::Route { .. }))
    }

    /// `true` when the activation of `channel` needs a place of the leaders' share: its meta names this
    /// node leader, unless, its load done, it comes back only to fan out (`comes_back_only_to_fan_out`).
    fn needs_a_leaders_place(&self, channel: &ChannelId) -> bool {
        let Some(known) = self.metas.get(channel).filter(|known| known.meta.leader == self.config.node) else {
            return false;
        };
        let loaded = self.loading.get(channel).and_then(|loading| match &loading.waiting_for_room {
            Some((Loaded { outcome: Ok(log), .. }, _)) => Some((&log.state, &loading.parked)),
            _ => None,
        });
        loaded.is_none_or(|(state, parked)| !self.comes_back_only_to_fan_out(&known.meta, state, parked))
    }

    /// Drops the room queue's entries that wait there no longer.
    fn drop_stale_queued(&mut self) {
        let queue = std::mem::take(&mut self.room_queue);
        self.room_queue = queue.into_iter().filter(|c| self.is_queued_for_room(c)).collect();
    }

    /// Takes out of the room queue the activation to place in `freed`'s place: the leader `freed` was
    /// asked to leave for, if it waits there; else the oldest activation a place freed by a leader
    /// (`leader_place`) or by a follower can take, dropping the entries that wait no longer on the way.
    fn next_queued_for(&mut self, freed: &ChannelId, leader_place: bool) -> Option<ChannelId> {
        self.drop_stale_queued();
        let asker = self.leaving_for_room.as_ref().filter(|leave| &leave.leaving == freed).map(|leave| &leave.asker);
        if let Some(position) = asker.and_then(|asker| self.room_queue.iter().position(|c| c == asker)) {
            return self.room_queue.remove(position);
        }
        let leaders_max = leaders_max(self.active_max);
        let mut leaders_full = None;
        let position = self.room_queue.iter().position(|c| {
            leader_place
                || !self.needs_a_leaders_place(c)
                || !*leaders_full.get_or_insert_with(|| self.leaders_holding_share() >= leaders_max)
        })?;
        self.room_queue.remove(position)
    }

    /// Tries the activations of the room queue again, in order (called with idle eviction's scan, which
    /// may have freed places without a drain seeing them): each is placed if there is room now, or
    /// waits again, or is refused once its patience is over.
    pub(super) fn retry_queued_for_room(&mut self) {
        let queued: Vec<ChannelId> = std::mem::take(&mut self.room_queue).into_iter().collect();
        for channel in queued {
            if self.is_queued_for_room(&channel) {
                self.room_made(&channel);
            }
        }
    }

    /// `true` when as many activations are loading (handed off, queued, or waiting for a hurried
    /// checkpoint) as the shard may keep replicas active: another is refused for now. Those waiting in
    /// the room queue have a bound of their own (`queue_for_room`): counted here, they kept every other
    /// activation from even loading, and followers the shard would have let in past the cap for leaders
    /// elsewhere were refused (sim seed 556000003).
    pub(super) fn loading_full(&self) -> bool {
        self.loading.len() >= self.active_max + self.room_queue.len()
    }

    /// `true` while `channel`'s replica waits for its load.
    pub(super) fn is_loading(&self, channel: &ChannelId) -> bool {
        self.loading.contains_key(channel)
    }

    /// Parks `input` until `channel`'s replica is loaded; gives it back when no load is waiting or the
    /// channel has as many inputs parked as appends may wait for a meta (`waiting_appends_max`).
    /// A controller's evidence request for a replica whose load is done and waits for room is answered at
    /// once from the log it read (see `send_evidence_at_rest`), not after the wait.
    pub(super) fn park(&mut self, channel: &ChannelId, input: Deferred) -> Result<(), Deferred> {
        if matches!(input, Deferred::Evidence { .. }) {
            let waiting = self.loading.get(channel).and_then(|loading| loading.waiting_for_room.as_ref());
            let state = waiting.and_then(|(loaded, _)| loaded.outcome.as_ref().ok()).map(|log| log.state.clone());
            let meta = self.metas.get(channel).map(|known| known.meta.clone());
            if let (Some(state), Some(meta)) = (state, meta) {
                self.send_evidence_at_rest(&meta, state, vec![input]);
                return Ok(());
            }
        }
        match self.loading.get_mut(channel) {
            Some(loading) if loading.parked.len() < self.config.waiting_appends_max => {
                loading.parked.push(input);
                Ok(())
            }
            _ => Err(input),
        }
    }

    /// A load finished: build the replica from what it read (meta, log state, recent records), then feed
    /// it the inputs parked meanwhile. A load that found nothing to activate (or could not read) ends
    /// them as an activation that failed does: peer messages dropped (the protocols resend), appends
    /// refused. At the cap the activation may wait for room, or be refused (see [`RoomWait`] and
    /// `ARCHITECTURE.md`, "Room at a node's cap").
    pub(super) fn finish_activation(&mut self, loaded: Loaded) {
        let channel = loaded.channel;
        if self.loading.get(&channel).is_none_or(|loading| loading.id != loaded.id) {
            return;
        }
        let Some(loading) = self.loading.remove(&channel) else {
            return;
        };
        if loading.in_flight {
            self.load_ended();
        }
        if let Some(meta) = loaded.meta_read {
            // Asked for because the shard held none; one pushed meanwhile is at least as new.
            self.metas.entry(channel.clone()).or_insert(KnownMeta { meta, stored_here: true });
        }
        let Some((meta, log, loading)) = self.log_to_activate(&channel, loaded.outcome, loading) else {
            return;
        };
        match self.room_for(&meta, &log, &loading.parked) {
            Room::Made => {
                self.build_machine(&channel, meta, log.state, log.recent);
                for input in loading.parked {
                    self.resume(&channel, input);
                }
            }
            Room::Missing { for_a_leader } => self.wait_for_room_or_refuse(channel, meta, log, loading, for_a_leader),
        }
    }

    /// What a finished load lets this replica be built from: the meta in force and the log it read. `None`
    /// when the activation ended here: the load failed, the meta names this node no replica or is older
    /// than the log's floor (the one in force is fetched), or a replica named leader while it loaded as a
    /// follower needs its recent records (loaded again). The parked inputs were ended or carried on.
    fn log_to_activate(
        &mut self,
        channel: &ChannelId,
        outcome: Result<LoadedLog, LoadFailure>,
        loading: Loading,
    ) -> Option<(ChannelRuntimeMeta, LoadedLog, Loading)> {
        let log = match outcome {
            Ok(log) => log,
            Err(failure) => {
                match failure {
                    LoadFailure::NoMeta => self.fetch_meta(channel),
                    LoadFailure::NotReplica => {}
                    // The replica stays inactive; the next input tries again.
                    LoadFailure::Store(error) => {
                        tracing::warn!(%channel, node = %self.config.node, %error, "channel replica could not load")
                    }
                }
                self.end_parked(channel, loading.parked, RemoteAppendError::NotReplica);
                return None;
            }
        };
        let Some(meta) = self.metas.get(channel).map(|known| known.meta.clone()) else {
            self.end_parked(channel, loading.parked, RemoteAppendError::NotReplica);
            return None;
        };
        if !meta.is_replica(self.config.node) {
            self.end_parked(channel, loading.parked, RemoteAppendError::NotReplica);
            return None;
        }
        self.floor_known(channel, log.state.meta_floor);
        if meta.version < log.state.meta_floor {
            // Stale for good here (see `floors`): this replica answered a controller under a newer meta,
            // or its log was forgotten past it (under it the empty log would act as the replica it was,
            // and a leader would lead again an epoch it led before). Acting under it could take records a
            // switch of leader left behind; the meta in force is fetched, and the calls wait for it.
            let (version, floor) = (meta.version, log.state.meta_floor);
            tracing::info!(%channel, node = %self.config.node, version, floor, "stale meta: fetching the one in force");
            self.metas.remove(channel);
            self.fetch_meta(channel);
            self.end_parked(channel, loading.parked, RemoteAppendError::Refused(AppendError::NotReady));
            return None;
        }
        if meta.leader == self.config.node && log.recent.is_none() {
            // Named leader while it loaded as a follower: a leader needs its idempotency window.
            self.load(channel, Some(meta), loading.parked);
            return None;
        }
        Some((meta, log, loading))
    }

    /// Makes room for the replica about to be built, evicting for it if the cap asks (the order is
    /// `ARCHITECTURE.md`'s, "Room at a node's cap", steps 1–3), or says what is missing.
    fn room_for(&mut self, meta: &ChannelRuntimeMeta, log: &LoadedLog, parked: &[Deferred]) -> Room {
        let leads = meta.leader == self.config.node;
        let leaders_max = leaders_max(self.active_max);
        // Counted only when the shard holds that many replicas at all (O(active)).
        let leaders_full = || self.channels.len() >= leaders_max && self.leaders_holding_share() >= leaders_max;
        // A leadership not started yet (its log holds no barrier of the meta's epoch: a controller's
        // failover or transfer chose this replica, or the channel is new) takes a free place past the
        // leaders' share. Nothing else starts it, and while it waits its channel has no leader: a named
        // leader refused while a place stood free kept its channel down for ~28 s of the healed phase
        // (sim seed 370000852 as session 31 found it, tight limits). Only a start: a leader coming back
        // for an append keeps to its share, since letting every leader take a free place churned
        // activations at the cap (session 31). It holds the followers' place as a follower named leader
        // in place does, and followers are let in past the cap meanwhile
        // (`followers_place_taken_by_leaders`).
        let starts_in_free_place =
            leads && log.state.last_epoch() < meta.leader_epoch && self.channels.len() < self.active_max;
        let needs_share = leads && !starts_in_free_place && !self.comes_back_only_to_fan_out(meta, &log.state, parked);
        let no_room_to_lead = needs_share && leaders_full() && !self.evict_one_leader();
        // (Evicts for room only when a leader's place is not what is missing.) A follower finding none
        // takes the place of a leader stalled waiting for followers elsewhere, once leaders hold the
        // followers' reserve too: those followers may be waiting for room that such leaders hold there;
        // and any activation takes that of a leader only fanning out, once it held its place a turn.
        let refused = no_room_to_lead
            || (self.channels.len() >= self.active_max && !self.evict_one() && !self.room_of_last_resort(leads));
        if refused {
            Room::Missing { for_a_leader: no_room_to_lead }
        } else {
            Room::Made
        }
    }

    /// No room was made for `channel`'s replica: it waits for a checkpoint hurried for it, or in the room
    /// queue while its patience lasts (a leader short of a place of the share having a busy leader asked
    /// to leave for it); else it is refused `TooManyChannels` and filed to be tried again.
    /// `for_a_leader`: a place of the leaders' share is what is missing.
    fn wait_for_room_or_refuse(
        &mut self,
        channel: ChannelId,
        meta: ChannelRuntimeMeta,
        log: LoadedLog,
        loading: Loading,
        for_a_leader: bool,
    ) {
        let leads = meta.leader == self.config.node;
        let Loading { id, parked, given_up_at, room_patience, mut waited_for_a_leave, .. } = loading;
        let now = self.now;
        let mut patience = room_patience.unwrap_or(now + ROOM_PATIENCE);
        let wait = if let Some(hurried) = self.hurry_one_checkpoint(for_a_leader) {
            // The room is a durable write away: the activation waits for it, its inputs parked
            // (bounded: one waits per replica hurried, each an active one), rather than refusing
            // them and leaving a retry to the next eviction scan or its sender.
            self.hurried_for.insert(hurried, channel.clone());
            Some(RoomWait::Hurried)
        } else {
            // A leader short of its share's place has the longest-held one asked to leave for it,
            // and waits for that place as long as the leave may take (one such wait a shard).
            let asked = if for_a_leader { self.ask_a_leader_to_leave(&channel) } else { None };
            if let Some(leave_until) = asked.filter(|_| !waited_for_a_leave) {
                patience = patience.max(leave_until);
                waited_for_a_leave = true;
            }
            // Nothing to hurry: it waits, bounded and in order, for the next place a replica frees.
            (now < patience && self.queue_for_room(&channel, asked.is_some())).then_some(RoomWait::Queued)
        };
        if let Some(wait) = wait {
            let mut parked = parked;
            if wait == RoomWait::Queued {
                if room_patience.is_none() {
                    self.counters.activations_queued_for_room += 1;
                }
                // A controller's request is answered from the log at rest now rather than after the
                // wait (see `send_evidence_at_rest`).
                parked = self.send_evidence_at_rest(&meta, log.state.clone(), parked);
            }
            let loaded = Loaded { channel: channel.clone(), id, meta_read: None, outcome: Ok(log) };
            let loading = Loading {
                id,
                parked,
                given_up_at,
                in_flight: false,
                waiting_for_room: Some((loaded, wait)),
                room_patience: Some(patience),
                waited_for_a_leave,
            };
            self.loading.insert(channel, loading);
            return;
        }
        self.counters.refused_activations += 1;
        // A leader refused (its share of the places held by busy leaders) is tried as long as a
        // leader's start: nothing else starts it.
        let tries = if leads { super::retries::LEADER_START_TRIES } else { super::retries::REFUSED_ACTIVATION_TRIES };
        self.activate_later(&channel, tries);
        let parked = self.send_evidence_at_rest(&meta, log.state, parked);
        self.end_parked(&channel, parked, RemoteAppendError::TooManyChannels);
    }

    fn build_machine(
        &mut self,
        channel: &ChannelId,
        meta: ChannelRuntimeMeta,
        state: ChannelLogState,
        recent: Option<Vec<Record>>,
    ) {
        // A replica active here: the log is in use, whatever a read begun earlier may answer.
        self.withdraw_stray(channel);
        let incarnation = self.next_incarnation;
        self.next_incarnation += 1;
        self.counters.activations += 1;
        let left_out = recent.is_none();
        let mut machine = ChannelMachine::new(
            channel.clone(),
            self.config.node,
            Arc::clone(&self.machine_config),
            incarnation,
            self.now,
            state,
            recent.unwrap_or_default(),
        );
        if left_out {
            machine = machine.without_recent();
        }
        if let Some((floor, fanned_through)) = self.carried_over.remove(channel) {
            // Everything up to the last incarnation's HW was committed: the durable prefix below it is
            // committed too, so HW does not go back. Raised in the machine, not in the state it starts
            // from: that state is what the store holds, and the machine is not quiescent (evictable)
            // until its HW is checkpointed there (seen in the simulator: a replica rebuilt after a
            // storage failure, evicted before its checkpoint, came back with the older HW).
            machine.raise_hw(floor);
            machine.learn_fanned_through(fanned_through);
        }
        if let Some(epoch) = self.resumable.remove(channel) {
            machine.resume_leadership(epoch);
        }
        // (Its entry stays in the order, which is bounded; popping an entry whose pull was taken forgets nothing.)
        if let Some((_, pull)) = self.pulls_in_flight.remove(channel) {
            machine.inherit_pull(pull);
        }
        let _ = machine.handle_meta(self.now, meta);
        self.channels.insert(channel.clone(), machine, self.now);
    }

    /// Feeds a parked input to the replica now active.
    fn resume(&mut self, channel: &ChannelId, input: Deferred) {
        match input {
            Deferred::Message { from, message } => self.channel_message(from, message),
            Deferred::Call { origin, call } => self.call_locally(origin, channel, call),
            Deferred::Evidence { from, task } => self.send_evidence(from, task, channel),
            Deferred::Route { api, call } => self.route_call(api, channel.clone(), call),
        }
    }

    /// Ends the inputs parked for a replica that did not activate: appends for it refused with `error`;
    /// an append not routed yet goes on to its leader when the meta is known now (this node keeps no
    /// replica, or its activation failed), else waits for the meta to be fetched.
    fn end_parked(&mut self, channel: &ChannelId, parked: Vec<Deferred>, error: RemoteAppendError) {
        for input in parked {
            match input {
                Deferred::Call { origin, call } => self.fail_call(origin, call.kind(), error.clone()),
                Deferred::Route { api, call } if self.metas.contains_key(channel) => {
                    self.route_call(api, channel.clone(), call)
                }
                Deferred::Route { api, call } => self.wait_for_meta(api, channel.clone(), call),
                Deferred::Message { message, .. } => self.drop_message(&message),
                Deferred::Evidence { .. } => {}
            }
        }
    }
}
