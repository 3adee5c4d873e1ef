//! Replicas coming and going: metas learned, fetched and let go, eviction of idle quiescent replicas,
//! failover requests and evidence for a controller. Activation is in `activation`.

use super::activation::{followers_reserve, Deferred};
use super::{ChannelShard, KnownMeta, ShardOutput, FAILOVER_REQUEST_INTERVAL};
use crate::node::controller::EvidenceReport;
use crate::node::error::NodeError;
use crate::node::message::NodeMessage;
use std::sync::Arc;
use std::time::Duration;
use tidings_channel::machine::{AppendAborted, ChannelMachine, ChannelMessage, PullBody, RoleKind};
use tidings_channel::reactor::shrink_if_sparse;
use tidings_store::message::ChannelLogState;
use tidings_types::{ChannelId, ChannelRuntimeMeta, NodeId, Time};

/// `machine`'s evidence for the controller's `task`, under `meta` (the one the machine holds, or the one
/// it would be built with).
fn evidence_reply(task: u64, machine: &ChannelMachine, meta: &ChannelRuntimeMeta) -> NodeMessage {
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
        fenced_by: meta.write_fence.map(|f| f.task),
    };
    NodeMessage::EvidenceReply { task, channel: meta.channel.clone(), version: meta.version, report }
}

/// Eviction scans (one a second) at which a replica named leader while inactive is activated again
/// until it is: its leadership has work no other input may prompt.
pub(super) const LEADER_START_TRIES: u8 = 60;
/// Eviction scans at which an activation refused for want of room is tried again.
pub(super) const REFUSED_ACTIVATION_TRIES: u8 = 5;
/// Activations a shard may file to try again whatever its room ([`ChannelShard::retries_max`]). Bounded
/// by the room alone, a shard of three places held three leaders' retries, and a follower's activation
/// refused meanwhile (its leader's hint came while as many loads as places were out) was not filed: the
/// hint came again only a pull timeout later, when its leader woke its silent followers, and the leader's
/// records waited those 5 s (sim seed 536000970, MinISR all three replicas). Sixteen was too few for a
/// node keeping the replicas of dozens of busy channels on a few places: the file filled with leaderships
/// to start and followers their leaders waited on, none of which another retry may displace, and a
/// follower whose hint came then was not filed, its leader's record waiting out the append timeout
/// (sim seed 608000435: 48 channels on five nodes, three places a shard). An entry is a channel id and
/// a count; the loads a scan's retries start are bounded by the room (`loading_full`), not by this.
const RETRIES_MIN: usize = 64;
/// How long a leader holds its place of the leaders' share before it may be asked to leave for a leader
/// refused room (`ChannelShard::ask_a_leader_to_leave`): busy leaders take the places in turns of at
/// least this.
const LEADER_TURN: Duration = Duration::from_secs(1);
/// How long a leader asked to leave refuses new appends: long enough for its followers to acknowledge
/// what it has (a pull timeout or two when one was silent); should it still not settle, it takes
/// appends again and another may be asked.
const LEAVING_PATIENCE: Duration = Duration::from_secs(3);
/// Fewest kept pulls of evicted followers a shard holds (`ChannelShard::keep_pull_in_flight`; the bound
/// is its room, at least this). Bounded by the room alone, a shard of a few places forgot a follower's
/// kept pull after a few more evictions: with more followers than places, each evicted while its pull
/// waited, every answer came to an incarnation that had sent a new pull, and was ignored — learners
/// of a draining node never caught up (sim seed 560000612: two places, seven learners). Each kept pull
/// goes a pull timeout after it was sent anyway (`expire_kept_pulls`), so this costs memory only while
/// followers churn: ~130 B an entry.
const KEPT_PULLS_MIN: usize = 1024;
/// How long a replica stays in memory before it may be evicted for another's room: past the instant it
/// came. Evicted as soon as it came, a replica did no work in memory: once the file of retries was
/// taken in turn, two followers whose leaders' hints came at once took one place in turn 15,000 times
/// within one millisecond (each activation evicting the other, each eviction answered by a hint;
/// `more_busy_channels_than_room_for_active_replicas_all_commit`). Longer (50 ms, tried) refused too
/// many activations at tight limits: channels took no append after healing in 4 of the first 150 sim
/// soaks of 24 busy channels. Idle eviction keeps to `channel_idle_evict`.
const RESIDENCE_MIN: Duration = Duration::from_millis(1);

/// A leader asked to leave its place of the leaders' share for a leader refused room: it takes no new
/// append until `until`, so that it settles and may be evicted, and the place it frees goes to `asker`
/// first.
#[derive(Debug)]
pub(super) struct LeaveForRoom {
    /// The leader asked to leave.
    pub(super) leaving: ChannelId,
    /// Until when it takes no new append.
    pub(super) until: Time,
    /// The refused leader it leaves for.
    pub(super) asker: ChannelId,
}

impl ChannelShard {
    /// Has the node learn `channel`'s meta (from its own slot replica when it keeps one at the log's
    /// floor or newer: read on the core's thread, not here) and answer with
    /// [`ShardInput::Meta`](super::ShardInput::Meta).
    pub(super) fn fetch_meta(&mut self, channel: &ChannelId) {
        let at_least = self.known_floor(channel);
        self.outputs.push_back(ShardOutput::FetchMeta { channel: channel.clone(), at_least });
    }

    /// Asks for a failover of every channel whose local replica is named leader but cannot lead, at
    /// most once per `FAILOVER_REQUEST_INTERVAL` each, until a new meta arrives.
    pub(super) fn request_failovers(&mut self) {
        let due: Vec<ChannelId> =
            self.cannot_lead.iter().filter(|(_, at)| **at <= self.now).map(|(c, _)| c.clone()).collect();
        for channel in due {
            self.cannot_lead.insert(channel.clone(), self.now + FAILOVER_REQUEST_INTERVAL);
            let Some(version) = self.metas.get(&channel).map(|m| m.meta.version) else { continue };
            // To every node: only the leader of the channel's slot group acts, and this node's idea of who
            // leads it, or even of who its members are (replica moves change them), may be stale.
            for to in self.config.nodes.clone() {
                self.send_node(to, NodeMessage::RequestFailover { channel: channel.clone(), version });
            }
        }
    }

    /// Sends the active replica's evidence to the controller on `from`.
    pub(super) fn send_evidence(&mut self, from: NodeId, task: u64, channel: &ChannelId) {
        let Some(machine) = self.channels.get(channel) else { return };
        let Some(meta) = machine.meta() else { return };
        let reply = evidence_reply(task, machine, meta);
        self.send_node(from, reply);
    }

    /// Answers the controllers' evidence requests among `parked` for a replica left inactive for want
    /// of room, and gives back the other inputs. Evidence needs no place among the active replicas: the
    /// answer is what a machine built from `state` under `meta` would give before any input, and an
    /// inactive replica runs nothing, so it is as frozen as the fence asks. Before, such a request waited
    /// for a place: a failover whose evidence needed the replica its named leader had no place to lead
    /// (every leader's place on its shard held by a busy leader) never gathered enough (sim seed
    /// 351004376, tight limits).
    pub(super) fn send_evidence_at_rest(
        &mut self,
        meta: &ChannelRuntimeMeta,
        state: ChannelLogState,
        parked: Vec<Deferred>,
    ) -> Vec<Deferred> {
        if !parked.iter().any(|input| matches!(input, Deferred::Evidence { .. })) {
            return parked;
        }
        let channel = &meta.channel;
        let (requests, rest): (Vec<_>, Vec<_>) =
            parked.into_iter().partition(|input| matches!(input, Deferred::Evidence { .. }));
        // Built as an activation builds it (see `build_machine`), never inserted: dropped with its effects.
        let mut machine = ChannelMachine::new(
            channel.clone(),
            self.config.node,
            Arc::clone(&self.machine_config),
            self.next_incarnation,
            self.now,
            state,
            Vec::new(),
        );
        if let Some((floor, _)) = self.carried_over.get(channel) {
            machine.raise_hw(*floor);
        }
        for input in requests {
            if let Deferred::Evidence { from, task } = input {
                let reply = evidence_reply(task, &machine, meta);
                self.send_node(from, reply);
            }
        }
        rest
    }

    /// A meta arrived: keep the newest, hand it to the local replica, release appends that waited for it.
    /// `stored_here`: this node's slot replica holds it. One below the log's floor (a slot replica here
    /// or elsewhere that lags) is stale for good and changes nothing (see `floors`).
    pub(super) fn learn_meta(&mut self, meta: ChannelRuntimeMeta, stored_here: bool) {
        if self.below_floor(&meta) {
            return;
        }
        let channel = meta.channel.clone();
        if meta.is_replica(self.config.node) {
            self.withdraw_stray(&channel);
        }
        let mut now_stored = false;
        let (newer, new_leadership) = match self.metas.get_mut(&channel) {
            None => (true, false),
            Some(known) if meta.version > known.meta.version => (true, known.meta.leader_epoch != meta.leader_epoch),
            Some(known) => {
                if known.meta.version == meta.version && stored_here && !known.stored_here {
                    // The version pushed by the slot leader, now applied by this node's slot replica too.
                    known.stored_here = true;
                    now_stored = true;
                }
                (false, false)
            }
        };
        let unused = !self.channels.contains(&channel) && !self.is_loading(&channel);
        if now_stored && unused && !self.waiting.contains_key(&channel) {
            // An evicted replica's meta can go now (see `forget_meta_if_stored`).
            self.forget_meta_if_stored(&channel);
        }
        if newer {
            if new_leadership {
                // A new leadership: whatever this replica asked for is settled, and appends forwarded
                // to another leader end now (outcome unknown: the caller retries with the same keys)
                // instead of at their timeout.
                self.cannot_lead.remove(&channel);
                self.abort_forwards(&channel, meta.leader);
            }
            self.metas.insert(channel.clone(), KnownMeta { meta: meta.clone(), stored_here });
            let now = self.now;
            let me = self.config.node;
            if let Some(machine) = self.machine_mut(&channel) {
                if meta.leader == me && machine.recent_left_out() {
                    // A follower activated without its recent records now leads: a new incarnation
                    // starts from the store with them, under this meta.
                    self.reincarnate(&channel);
                } else {
                    // A meta that is not a valid successor is refused by the machine; it keeps the one it
                    // has.
                    let _ = machine.handle_meta(now, meta);
                }
            } else if !meta.as_created() {
                if meta.leader == me {
                    // A new leadership: tried as long as a leader's start, whatever was filed before.
                    self.unfile(&channel);
                    self.activate_later(&channel, LEADER_START_TRIES);
                }
                // A changed meta may ask something of this replica (a learner to catch up, a new leader
                // to take over). A channel as created asks nothing until it is used: its replicas activate
                // on their first input (an append, a peer's message), not all at once at creation — three
                // activations, an epoch barrier to sync and the followers' long polls for every channel
                // created, most of which a bulk creation (a chat backend importing its groups) leaves idle.
                self.activate(&channel);
            }
        }
        for waiting in self.waiting.remove(&channel).unwrap_or_default() {
            self.route_call(waiting.api, channel.clone(), waiting.call);
        }
    }

    /// Files `channel` to be activated again at the next eviction scans, up to `tries` times (see
    /// `to_activate`). A channel filed already keeps the tries it has left: a retry refused again must
    /// not start its count over. When the file is full, a leadership to start takes the place of a
    /// plain follower's retry: a follower is prompted again by its leader's hints and its own pulls, but
    /// nothing else starts a leader, whose barrier, followers' wake-up and fanout of what its
    /// predecessor left wait for it (sim seed 320000242: a replica named leader while both places in
    /// the file held followers' retries was never started, and three committed messages its
    /// predecessor had handed over never reached a member). So does a follower its leader waits on
    /// (`file_awaited_follower`).
    pub(super) fn activate_later(&mut self, channel: &ChannelId, tries: u8) {
        self.file_retry(channel, tries, false);
    }

    /// Files (see [`ChannelShard::activate_later`]) a follower that news from its leader — a hint, or
    /// records — found out of memory and could not activate: that leader has records waiting for it,
    /// and, its MinISR every replica, commits nothing until it pulls. Its retry takes the place of a
    /// plain follower's in a full file, as a leadership to start does, and is taken by no other's. A
    /// leader hints a silent follower once a pull timeout; filed like any other, the retry of a follower
    /// whose hint was refused for want of a load was soon displaced by a leadership's, and the next
    /// hint, a pull timeout later, met the loads of the same round of calls: its leader committed
    /// nothing for 14 s (sim seed 590000525, 48 channels at tight limits).
    pub(super) fn file_awaited_follower(&mut self, channel: &ChannelId) {
        let replica = self.metas.get(channel).is_some_and(|known| known.meta.is_replica(self.config.node));
        if replica && !self.channels.contains(channel) {
            self.file_retry(channel, REFUSED_ACTIVATION_TRIES, true);
        }
    }

    /// Files `channel` to retry (`awaited`: for a follower its leader waits on), making room in a full
    /// file by unfiling a plain follower's retry when `channel`'s takes precedence.
    fn file_retry(&mut self, channel: &ChannelId, tries: u8, awaited: bool) {
        if self.to_activate.contains_key(channel) {
            if awaited {
                self.awaited_retries.insert(channel.clone());
            }
            return;
        }
        if self.to_activate.len() >= self.retries_max() {
            if !awaited && !self.named_leader(channel) {
                return;
            }
            let plain = self.to_activate.keys().find(|c| !self.named_leader(c) && !self.awaited_retries.contains(*c));
            let Some(plain) = plain.cloned() else { return };
            self.unfile(&plain);
        }
        self.to_activate.insert(channel.clone(), tries);
        if awaited {
            self.awaited_retries.insert(channel.clone());
        }
    }

    /// Takes `channel` out of the file of activations to try again.
    pub(super) fn unfile(&mut self, channel: &ChannelId) {
        self.to_activate.remove(channel);
        self.awaited_retries.remove(channel);
    }

    /// Most activations filed to be tried again (`to_activate`): as many as the shard may keep replicas
    /// active, and at least [`RETRIES_MIN`].
    pub(super) fn retries_max(&self) -> usize {
        self.active_max.max(RETRIES_MIN)
    }

    /// `true` if the meta this shard knows for `channel` names this node its leader.
    pub(super) fn named_leader(&self, channel: &ChannelId) -> bool {
        self.metas.get(channel).is_some_and(|known| known.meta.leader == self.config.node)
    }

    /// Tries the activations filed by `activate_later` again, one try each, while loads may be asked
    /// for; forgets those active now and those out of tries (one loading waits for its outcome). The
    /// file is taken in turn from past the entry tried last, and an entry not reached for want of a
    /// load keeps its tries: taken in name order every scan, with fewer loads to be had than entries
    /// filed, the first few took every load and one late in the file spent its tries refused (sim
    /// seeds 487000990 and 487000435: followers whose leaders waited on them, two places a shard).
    /// Followers their leaders wait on (`awaited_retries`) are taken first, in the same turn: each is
    /// what stands between a leader's records and their commit. Taken with the rest, in a file of
    /// dozens (a node keeping the replicas of 48 busy channels on three places), such a follower's turn
    /// came some fifteen scans apart, past its leader's append timeout (sim seed 569000321).
    pub(super) fn activate_again(&mut self) {
        let mut in_turn: Vec<(ChannelId, u8)> = self.to_activate.iter().map(|(c, left)| (c.clone(), *left)).collect();
        if let Some(after) = &self.retries_from {
            let past = in_turn.partition_point(|(c, _)| c <= after);
            in_turn.rotate_left(past);
        }
        // (A stable sort: each kind keeps the turn.)
        in_turn.sort_by_key(|(c, _)| !self.awaited_retries.contains(c));
        for (channel, left) in in_turn {
            if left == 0 || self.channels.contains(&channel) {
                self.unfile(&channel);
            } else if self.loading_full() {
                continue;
            } else if !self.is_loading(&channel) {
                self.to_activate.insert(channel.clone(), left - 1);
                self.retries_from = Some(channel.clone());
                self.activate(&channel);
            }
        }
    }

    /// Ends the forwarded calls of `channel` sent to a node other than `leader` with `LeaderChanged`.
    pub(super) fn abort_forwards(&mut self, channel: &ChannelId, leader: NodeId) {
        let stale: Vec<u64> = self
            .forwarded
            .iter()
            .filter(|(_, f)| &f.channel == channel && f.leader != leader)
            .map(|(id, _)| *id)
            .collect();
        for id in stale {
            if let Some(forwarded) = self.forwarded.remove(&id) {
                self.done(forwarded.api, forwarded.kind.failed(NodeError::Aborted(AppendAborted::LeaderChanged)));
            }
        }
    }

    /// Evicts channel replicas idle for the configured time and quiescent (nothing pending, everything
    /// durable and committed). Their logs stay; the next input activates them again.
    pub(super) fn evict_idle(&mut self) {
        let idle_since = self.now - self.config.channel_idle_evict;
        let evictable: Vec<ChannelId> = self
            .channels
            .iter()
            .filter(|(c, m)| m.is_quiescent() && self.channels.last_used(c).is_none_or(|t| t <= idle_since))
            .map(|(c, _)| c.clone())
            .collect();
        for channel in evictable {
            self.evict(&channel);
        }
    }

    /// Makes room for one activation: evicts the least recently used quiescent replica, else the least
    /// recently used follower that can leave memory (`ChannelMachine::can_leave_memory_as_follower`).
    /// O(active) but only at the cap, which idle eviction normally keeps the shard below.
    pub(super) fn evict_one(&mut self) -> bool {
        if self.evict_least_recent(RESIDENCE_MIN, |m| m.is_quiescent()).is_some() {
            return true;
        }
        let Some(follower) = self.evict_least_recent(RESIDENCE_MIN, |m| m.can_leave_memory_as_follower()) else {
            return false;
        };
        // Not quiescent: its leader may be waiting for it to acknowledge records, and nothing here
        // brings it back before the leader's next hint — a pull timeout or two away, and longer while
        // its leader's waiting appends time out and new ones come (sim seed 203000732: a channel whose
        // MinISR is all of its ISR took no append for the whole healed phase). It comes back when room
        // does, as a refused activation.
        self.activate_later(&follower, REFUSED_ACTIVATION_TRIES);
        true
    }

    /// Makes room for one more active leader when leaders fill their share of the cap
    /// ([`leaders_max`]): evicts the least recently used quiescent leader.
    pub(super) fn evict_one_leader(&mut self) -> bool {
        self.evict_least_recent(RESIDENCE_MIN, |m| m.role() == RoleKind::Leader && m.is_quiescent()).is_some()
    }

    /// Makes room for a follower no other replica makes room for: evicts the least recently used
    /// leader that has held its place for [`LEADER_TURN`] and may leave memory with records not
    /// committed yet, no caller waiting on it (`ChannelMachine::can_leave_memory_as_stalled_leader`).
    /// Such a leader usually waits for a follower on another node, and that node's places may all be
    /// held by leaders waiting for followers here; a follower let in breaks the wait. The leader comes
    /// back, resuming its leadership, with its followers' next pull or its next append. O(active), at
    /// the cap only.
    pub(super) fn evict_one_stalled_leader(&mut self) -> bool {
        self.evict_least_recent(LEADER_TURN, |m| m.can_leave_memory_as_stalled_leader()).is_some()
    }

    /// When an activation finds no room: has the least recently used replica that only a checkpoint not
    /// written yet keeps in memory write it now (`ChannelMachine::checkpoint_to_leave`), a leader only
    /// when a leader's place is what is missing; which one, if any. The activation then waits for it to
    /// land (`hurried_for`, `ChannelShard::room_made`). Left to fall due, the checkpoint came up to
    /// ~1.1 s later, and the activation, refused meanwhile, was tried again only at the next eviction
    /// scan or its sender's retry: at the cap each place changed hands about once a second (sim seeds
    /// 487000472 and 487000441, 24 busy channels on four or five places a node). One per activation
    /// short of room, each a durable write. O(active), at the cap only.
    pub(super) fn hurry_one_checkpoint(&mut self, leaders_only: bool) -> Option<ChannelId> {
        let hurried = self
            .channels
            .iter()
            .filter(|(c, m)| {
                (!leaders_only || m.role() == RoleKind::Leader) && m.kept_only_by_its_checkpoint() && self.resided(c)
            })
            .min_by_key(|(c, _)| (self.channels.last_used(c).unwrap_or(Time::ZERO), (*c).clone()))
            .map(|(c, _)| c.clone())?;
        let now = self.now;
        self.machine_mut(&hurried).is_some_and(|machine| machine.checkpoint_to_leave(now)).then_some(hurried)
    }

    /// When a leader (`asker`) is refused room because busy leaders hold every place of the leaders'
    /// share and none may leave: asks the one that has held its place longest — for [`LEADER_TURN`] at
    /// least — to take no new append for up to [`LEAVING_PATIENCE`], so that it commits what it has,
    /// settles and leaves, its place going to `asker` first (`asker` waits for it in the room queue,
    /// `next_queued_for`). Busy leaders kept their places for as long as appends came, and a leader of
    /// the same shard was refused `TooManyChannels` all that time (sim seed 545000024: three places, two
    /// held by leaders under steady load; another channel led there took no append through the healed
    /// phase); and the place a leader left for another went to whichever leader came first, while the
    /// one it left for, not in the full room queue, came back a scan later to find it taken — a shard
    /// of one leader's place, turned over three times in 13 s, never to it (sim seed 590000776, 48
    /// channels at tight limits). One leader a shard at a time; its appends are refused
    /// `TooManyChannels` meanwhile, as the waiting leader's were. Until when `asker` may wait for the
    /// place, if a leave runs for it. O(active), at the cap only.
    pub(super) fn ask_a_leader_to_leave(&mut self, asker: &ChannelId) -> Option<Time> {
        let now = self.now;
        // (An ask goes with its replica: `deactivate` drops it.)
        if let Some(leave) = self.leaving_for_room.as_ref().filter(|leave| now < leave.until) {
            return (&leave.asker == asker).then_some(leave.until);
        }
        // One asked before that did not settle within its patience takes appends again: another is
        // asked first, if there is one.
        let asked_before = self.leaving_for_room.take().map(|leave| leave.leaving);
        let longest = self
            .channels
            .iter()
            .filter(|(c, m)| {
                m.role() == RoleKind::Leader && !m.leads_only_fanning_out() && self.in_memory_for(c, LEADER_TURN)
            })
            .min_by_key(|(c, _)| (asked_before.as_ref() == Some(*c), self.channels.active_since(c), (*c).clone()))
            .map(|(c, _)| c.clone())?;
        self.counters.leaders_asked_to_leave += 1;
        let until = now + LEAVING_PATIENCE;
        self.leaving_for_room = Some(LeaveForRoom { leaving: longest, until, asker: asker.clone() });
        Some(until)
    }

    /// `true` while `channel`'s leader is asked to leave for another's room: it takes no new append.
    pub(super) fn is_leaving_for_room(&self, channel: &ChannelId) -> bool {
        self.leaving_for_room.as_ref().is_some_and(|leave| &leave.leaving == channel && self.now < leave.until)
    }

    /// Active leaders (counted at the cap only: O(active)).
    pub(super) fn leaders_active(&self) -> usize {
        self.channels.iter().filter(|(_, m)| m.role() == RoleKind::Leader).count()
    }

    /// Active leaders that hold a place of the leaders' share ([`leaders_max`]): all but those whose
    /// only work left is their fanout (`ChannelMachine::leads_only_fanning_out`). The share is there so
    /// that leaders waiting for followers elsewhere cannot fill the room those followers need, and such
    /// a leader waits for none; counted, it kept its shard's other leaders out for as long as its
    /// fanout ran (sim seed 459001175, tight limits: 15 s of a fanout paging one member per round
    /// trip). It still holds a place of the shard's room: only a quiescent replica is evicted for
    /// another. O(active), at the cap only.
    pub(super) fn leaders_holding_share(&self) -> usize {
        self.channels.iter().filter(|(_, m)| m.role() == RoleKind::Leader && !m.leads_only_fanning_out()).count()
    }

    /// `true` when a follower may be activated past the cap (up to [`followers_reserve`] more): leaders
    /// hold places the followers' reserve was to keep. The leaders' share is checked when a replica is
    /// activated as leader, but an active follower named leader in place (a failover or transfer to
    /// this node) takes a leader's role in a follower's place. Two nodes whose every place held such
    /// leaders, each waiting for a follower the other had no room for, took no append again (sim seed
    /// 243002380, MinISR the whole ISR). O(active), at the cap only.
    pub(super) fn followers_place_taken_by_leaders(&self) -> bool {
        let reserve = followers_reserve(self.active_max);
        let followers = self.channels.len() - self.leaders_active();
        followers < reserve && self.channels.len() < self.active_max + reserve
    }

    /// `true` once `channel`'s replica has been in memory for [`RESIDENCE_MIN`]: it may leave for
    /// another's room.
    pub(super) fn resided(&self, channel: &ChannelId) -> bool {
        self.in_memory_for(channel, RESIDENCE_MIN)
    }

    /// `true` once `channel`'s replica has been in memory for `held` (false when it is not active).
    fn in_memory_for(&self, channel: &ChannelId, held: Duration) -> bool {
        self.channels.active_since(channel).is_some_and(|since| since + held <= self.now)
    }

    /// Evicts the least recently used replica `evictable` accepts among those that have been in memory
    /// for `held` at least; which one, if any.
    fn evict_least_recent(&mut self, held: Duration, evictable: impl Fn(&ChannelMachine) -> bool) -> Option<ChannelId> {
        let victim = self
            .channels
            .iter()
            .filter(|(c, m)| evictable(m) && self.in_memory_for(c, held))
            .min_by_key(|(c, _)| (self.channels.last_used(c).unwrap_or(Time::ZERO), (*c).clone()))
            .map(|(c, _)| c.clone())?;
        self.evict(&victim);
        Some(victim)
    }

    /// Takes a quiescent replica out of memory; a leader's epoch is kept for its next incarnation to
    /// resume, and its meta is let go when this node's slot replica keeps it.
    pub(super) fn evict(&mut self, channel: &ChannelId) {
        if let Some(machine) = self.deactivate(channel) {
            if machine.role() == RoleKind::Leader {
                if let Some(meta) = machine.meta() {
                    self.resumable.insert(channel.clone(), meta.leader_epoch);
                }
            }
        }
        self.forget_meta_if_stored(channel);
    }

    /// Lets go of an evicted replica's meta when this node's slot replica keeps it (read back on the next
    /// use), so an idle channel costs little more than its log.
    pub(super) fn forget_meta_if_stored(&mut self, channel: &ChannelId) {
        // Only a meta this node's slot replica applied (or was read from) is there, at that version or a
        // newer one; one pushed by the slot leader first stays until the local replica applies it (see
        // `learn_meta`): reading the stored one back to compare would be storage IO on this thread.
        // Should the store have let it go since (a hash slot migrated away before this shard heard), the
        // next use finds none here and fetches it from the slot group: slower, never a wrong meta.
        if !self.served.serves(channel) || !self.metas.get(channel).is_some_and(|known| known.stored_here) {
            return;
        }
        self.metas.remove(channel);
        shrink_if_sparse(&mut self.metas);
        // Read again with the meta at the next activation.
        self.forget_floor(channel);
    }

    /// Takes the channel's machine out of memory (its log stays); the next input activates a new
    /// incarnation from the store.
    pub(super) fn deactivate(&mut self, channel: &ChannelId) -> Option<ChannelMachine> {
        let mut machine = self.channels.remove(channel)?;
        self.hurried_for.remove(channel);
        if self.leaving_for_room.as_ref().is_some_and(|leave| &leave.leaving == channel) {
            self.leaving_for_room = None;
        }
        // What it asked for and was not drained yet goes out first: a replica is quiescent by its state,
        // and one taken out between an input and the next drain dropped that input's effects — a
        // retention move ended by the leadership's end was never answered (sim seed 222001593).
        let mut effects = Vec::new();
        machine.drain_effects(&mut effects);
        for effect in effects {
            self.channel_effect(channel, effect);
        }
        self.log.release_caches(channel);
        if let Some(pull) = machine.pull_in_flight() {
            self.keep_pull_in_flight(channel, pull);
        }
        Some(machine)
    }

    /// Keeps an evicted follower's unanswered pull for its next incarnation (bounded: the oldest go).
    fn keep_pull_in_flight(&mut self, channel: &ChannelId, pull: tidings_channel::machine::PullInFlight) {
        self.pulls_kept += 1;
        self.pulls_in_flight.insert(channel.clone(), (self.pulls_kept, pull));
        self.pulls_in_flight_order.push_back((channel.clone(), self.pulls_kept));
        // The order also names pulls taken or replaced since: popping one forgets nothing. Only the kept
        // pull the entry numbers goes, so a channel's newer pull outlives its older entries. (Forgetting
        // by name alone dropped the pull of a follower evicted again and again for room: two followers
        // sharing one place each came back to a new pull, ignored the answer to the one kept, and were
        // evicted before the next answer came — sim seed 245001988.)
        while self.pulls_in_flight_order.len() > self.active_max.max(KEPT_PULLS_MIN) {
            self.forget_oldest_kept_pull();
        }
    }

    /// Drops a peer message no replica takes (its channel is out of memory and not activated for it),
    /// forgetting the kept pull it answers, if any: kept, the pull held the next incarnation back from
    /// pulling until a pull timeout after it was sent, as if its answer might still come. A follower
    /// refused room when its leader's records came back on a retry and sent nothing for ~5 s, while its
    /// leader, whose MinISR was every replica, waited for it with an append and held its shard's one
    /// leader's place all that time (sim seed 575000392, 48 channels at tight limits).
    pub(super) fn drop_message(&mut self, message: &ChannelMessage) {
        let response = match message {
            ChannelMessage::Hint(hint) => return self.file_awaited_follower(&hint.channel),
            ChannelMessage::PullResponse(response) => response,
            ChannelMessage::Pull(_) => return,
        };
        if matches!(&response.body, PullBody::Records { records, .. } if !records.is_empty()) {
            self.file_awaited_follower(&response.channel);
        }
        if self.pulls_in_flight.get(&response.channel).is_some_and(|(_, pull)| pull.pull_id() == response.pull_id) {
            // (Its entry stays in the order, which is bounded; popping it then forgets nothing.)
            self.pulls_in_flight.remove(&response.channel);
        }
    }

    /// Forgets kept pulls sent a pull timeout ago or more, oldest kept first (at each eviction scan): the
    /// next incarnation would send such a pull again at once, so keeping it saves nothing. Kept until
    /// the cap instead, the pulls of followers evicted idle (each entry also keeps its channel's id
    /// alive) held memory that evicted replicas are to go without: `bench_report --quick` measured 327 B
    /// per evicted replica at 100,000 channels before, 228 B after (the target is 256 B).
    pub(super) fn expire_kept_pulls(&mut self) {
        let timeout = self.machine_config.pull_timeout;
        while let Some((oldest, number)) = self.pulls_in_flight_order.front() {
            let expired = match self.pulls_in_flight.get(oldest) {
                Some((kept, pull)) if kept == number => pull.sent_at() + timeout <= self.now,
                // Taken or replaced since: the entry names nothing.
                _ => true,
            };
            if !expired {
                break;
            }
            self.forget_oldest_kept_pull();
        }
        if self.pulls_in_flight.is_empty() {
            // Give the room of a burst back.
            self.pulls_in_flight.shrink_to_fit();
            self.pulls_in_flight_order.shrink_to_fit();
        }
    }

    /// Forgets the oldest entry of the kept pulls' order, and the pull it names if it is still the one
    /// kept (a channel's newer pull outlives its older entries).
    fn forget_oldest_kept_pull(&mut self) {
        let Some((oldest, number)) = self.pulls_in_flight_order.pop_front() else { return };
        if self.pulls_in_flight.get(&oldest).is_some_and(|(kept, _)| *kept == number) {
            self.pulls_in_flight.remove(&oldest);
        }
    }

    /// Replaces `channel`'s machine with a new incarnation from the store (see
    /// [`ChannelShard::retire`]).
    pub(super) fn reincarnate(&mut self, channel: &ChannelId) {
        self.retire(channel);
        self.activate(channel);
    }

    /// Takes `channel`'s machine out of memory, not quiescent as an evicted one is: the next incarnation
    /// keeps its HW and how far it knew fanout finished (`carried_over`), and what it held and had not
    /// made durable (a follower's unacknowledged records) its leader sends again.
    pub(super) fn retire(&mut self, channel: &ChannelId) {
        if let Some(machine) = self.deactivate(channel) {
            self.carried_over.insert(channel.clone(), (machine.hw(), machine.fanned_through()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::activation::ROOM_PATIENCE;
    use super::super::testing::{carry_out_loads_and_floors, shard_over_memory_log};
    use super::super::{ShardInput, ShardOutput};
    use super::*;
    use crate::node::config::NodeConfig;
    use crate::node::core::{ApiId, ApiResult, NodeEffect};
    use std::collections::BTreeSet;
    use std::sync::Arc;
    use tidings_channel::machine::{AppendRecord, ChannelMessage, PullBody, PullHint, PullResponse};
    use tidings_store::message::{LogBatch, LogOp, MemoryLog, Record, RecordKind};
    use tidings_types::{ChannelType, Epoch, LeaderEpoch, Seq, Time, WriteFence};

    const ME: NodeId = NodeId::new(1);

    /// A shard over a memory log with room for `places` active replicas, on a node of a two-node cluster.
    fn shard_with_places(places: usize) -> (ChannelShard, Arc<MemoryLog>) {
        shard_over_memory_log(NodeConfig {
            active_channels_max: places,
            ..NodeConfig::new(ME, vec![ME, NodeId::new(2)])
        })
    }

    /// Channel `name`, its meta known to the shard with `leader` leading.
    fn known(shard: &mut ChannelShard, name: &str, leader: u64) -> ChannelId {
        let channel = ChannelId::new(ChannelType::GROUP, name).unwrap();
        let replicas = vec![ME, NodeId::new(2)];
        let meta = ChannelRuntimeMeta {
            channel: channel.clone(),
            version: 3,
            leader: NodeId::new(leader),
            isr: replicas.clone(),
            replicas,
            min_isr: 1,
            epoch: Epoch::new(1),
            leader_epoch: LeaderEpoch::new(2),
            write_fence: None,
            retention_through: Seq::new(0),
        };
        shard.metas.insert(channel.clone(), KnownMeta { meta, stored_here: true });
        channel
    }

    /// Stores in `channel`'s log one leader epoch's records, seqs 1 to `last` (its barrier, then
    /// messages), made durable with `checkpoints`.
    fn store_epoch(log: &MemoryLog, channel: &ChannelId, epoch: u64, last: u64, checkpoints: Vec<LogOp>) {
        let records = (1..=last)
            .map(|seq| Record {
                seq: Seq::new(seq),
                kind: if seq == 1 { RecordKind::Barrier } else { RecordKind::Message },
                leader_epoch: LeaderEpoch::new(epoch),
                idempotency_key: None,
                timestamp_ms: seq,
                payload: bytes::Bytes::from_static(b"m"),
            })
            .collect();
        let ops = [vec![LogOp::Append(records)], checkpoints].concat();
        tidings_store::message::MessageLog::commit(log, LogBatch::new(channel.clone(), ops)).unwrap();
    }

    /// A channel this node leads whose replica was evicted earlier (its epoch's barrier in its log): it
    /// comes back as a returning leader, which takes no place free past the leaders' share.
    fn returning_leader(shard: &mut ChannelShard, log: &MemoryLog, name: &str) -> ChannelId {
        let leader = known(shard, name, 1);
        store_epoch(log, &leader, 2, 1, vec![LogOp::CheckpointHw(Seq::new(1))]);
        shard.resumable.insert(leader.clone(), LeaderEpoch::new(2));
        leader
    }

    /// The barrier a leader of epoch 2 (the epoch `known` names) writes first, at seq 1.
    fn first_barrier_of_epoch_2() -> Record {
        Record {
            seq: Seq::new(1),
            kind: RecordKind::Barrier,
            leader_epoch: LeaderEpoch::new(2),
            idempotency_key: None,
            timestamp_ms: 1,
            payload: bytes::Bytes::new(),
        }
    }

    /// Moves the shard's time on by [`RESIDENCE_MIN`]: every replica active now may leave for another's
    /// room.
    fn let_residence_pass(shard: &mut ChannelShard) {
        let now = shard.now + RESIDENCE_MIN;
        shard.advance(now);
    }

    /// Tries `channel`'s activation and, when it waits in the room queue, lets its patience pass and tries
    /// it once more: a try that finds no room ends refused (filed to be tried again), as it did before
    /// activations waited for room.
    fn try_activation(shard: &mut ChannelShard, log: &MemoryLog, channel: &ChannelId) {
        shard.activate(channel);
        carry_out_loads_and_floors(shard, log);
        if shard.is_queued_for_room(channel) {
            let patience_over = shard.now + ROOM_PATIENCE;
            shard.advance(patience_over);
            shard.retry_queued_for_room();
            carry_out_loads_and_floors(shard, log);
        }
    }

    /// Answers every durable write among `outputs` and those the answers bring, until none is left;
    /// returns the other outputs.
    fn answer_persists(shard: &mut ChannelShard, log: &MemoryLog, mut outputs: Vec<ShardOutput>) -> Vec<ShardOutput> {
        let mut others = Vec::new();
        while let Some(output) = outputs.pop() {
            let ShardOutput::Effect(NodeEffect::Persist { token, batch }) = output else {
                others.push(output);
                continue;
            };
            let channel = batch.channel.clone();
            let result = tidings_store::message::MessageLog::commit(log, batch);
            shard.handle(Time::ZERO, ShardInput::Persisted { channel, token, result });
            outputs.extend(carry_out_loads_and_floors(shard, log));
        }
        others
    }

    /// A replica named leader on a shard whose one leader's place a busy leader holds is not
    /// activated, yet answers a controller's evidence request: from its stored state, as a machine
    /// built from it would.
    #[test]
    fn a_replica_with_no_room_to_be_activated_answers_evidence_from_its_stored_state() {
        let (mut shard, log) = shard_with_places(2);
        // A leader whose barrier's persist is never answered: not quiescent, never evicted.
        let busy = known(&mut shard, "busy", 1);
        shard.activate(&busy);
        carry_out_loads_and_floors(&mut shard, &log);
        assert_eq!(shard.leaders_active(), 1);

        let named = known(&mut shard, "named", 1);
        store_epoch(&log, &named, 2, 5, vec![LogOp::CheckpointHw(Seq::new(4))]);
        let mut fenced = shard.metas[&named].meta.clone();
        fenced.version = 4;
        fenced.write_fence = Some(WriteFence { task: 77, since_version: 4, freeze_replication: true });
        shard.handle(Time::ZERO, ShardInput::Evidence { from: ME, task: 77, meta: fenced });
        let outputs = carry_out_loads_and_floors(&mut shard, &log);

        assert!(!shard.channels.contains(&named), "no leader's place for it");
        assert!(shard.is_queued_for_room(&named), "it waits for a place, its evidence answered meanwhile");
        let replies: Vec<_> = outputs
            .iter()
            .filter_map(|output| match output {
                ShardOutput::Loopback(NodeMessage::EvidenceReply { task, channel, version, report }) => {
                    Some((*task, channel.clone(), *version, *report))
                }
                _ => None,
            })
            .collect();
        let report = EvidenceReport {
            last_epoch: LeaderEpoch::new(2),
            last_seq: Seq::new(5),
            hw: Seq::new(4),
            pending_appends: 0,
            log_end: Seq::new(5),
            drained: false,
            fenced_by: Some(77),
        };
        assert_eq!(replies, vec![(77, named, 4, report)]);
    }

    /// Where leaders fill their share of the places (two of three here, held by busy leaders), a leader
    /// coming back for an append waits for that share, but a leadership not started yet (no barrier of
    /// its epoch in its log: a failover's or transfer's choice) takes a place that stands free. Nothing
    /// else starts it, and its channel has no leader meanwhile.
    #[test]
    fn a_leadership_to_start_takes_a_free_place_past_the_leaders_share() {
        let (mut shard, log) = shard_with_places(3);
        assert_eq!(super::super::activation::leaders_max(3), 2);
        // Two leaders whose barriers' persists are never answered: not quiescent, never evicted.
        for name in ["busy-1", "busy-2"] {
            let busy = known(&mut shard, name, 1);
            shard.activate(&busy);
            carry_out_loads_and_floors(&mut shard, &log);
        }
        assert_eq!(shard.leaders_active(), 2);

        let returning = known(&mut shard, "returning", 1);
        let barrier = first_barrier_of_epoch_2();
        let ops = vec![LogOp::Append(vec![barrier]), LogOp::CheckpointHw(Seq::new(1))];
        tidings_store::message::MessageLog::commit(&*log, LogBatch::new(returning.clone(), ops)).unwrap();
        try_activation(&mut shard, &log, &returning);
        assert!(!shard.channels.contains(&returning), "its epoch started here: it keeps to the leaders' share");
        assert!(shard.is_queued_for_room(&returning), "it waits for the place a busy leader is asked to leave");
        let refused = shard.counters.refused_activations;

        let starting = known(&mut shard, "starting", 1);
        shard.activate(&starting);
        carry_out_loads_and_floors(&mut shard, &log);
        assert!(shard.channels.contains(&starting), "a leadership to start takes the free place");
        assert_eq!(shard.counters.refused_activations, refused);

        // With no place free, a leadership to start waits like any other leader.
        let next = known(&mut shard, "next", 1);
        try_activation(&mut shard, &log, &next);
        assert!(!shard.channels.contains(&next), "no place free");
        assert!(shard.to_activate.contains_key(&next), "tried again at the next scans");
    }

    /// A leader whose only work left is its fanout (committed messages a restart left unfanned, here)
    /// holds no place of its shard's leaders' share: another leader of the shard is activated, a
    /// quiescent follower evicted for it, and the fanout goes on. Counted, it refused every other leader
    /// of its shard until the fanout ended (sim seed 459001175).
    #[test]
    fn a_leader_only_fanning_out_leaves_the_leaders_share_to_another() {
        let mut config = NodeConfig { active_channels_max: 2, ..NodeConfig::new(ME, vec![ME, NodeId::new(2)]) };
        config.fanout_enabled = true;
        let (mut shard, log) = shard_over_memory_log(config);
        assert_eq!(super::super::activation::leaders_max(2), 1);
        let fanning = known(&mut shard, "fanning", 1);
        // Its earlier leadership's barrier and three messages, committed; fanout known finished through
        // the barrier only.
        let checkpoints = vec![LogOp::CheckpointHw(Seq::new(4)), LogOp::CheckpointFanned(Seq::new(1))];
        store_epoch(&log, &fanning, 1, 4, checkpoints);
        shard.activate(&fanning);
        // Its barrier is made durable (and commits: MinISR 1); the fanout of its messages is never
        // answered.
        let outputs = carry_out_loads_and_floors(&mut shard, &log);
        answer_persists(&mut shard, &log, outputs);
        let machine = shard.channels.get(&fanning).expect("active");
        assert_eq!((machine.hw(), machine.fanned_through()), (Seq::new(5), Seq::new(1)), "its barrier committed");
        assert!(machine.leads_only_fanning_out());
        assert!(!machine.is_quiescent());
        assert_eq!((shard.leaders_active(), shard.leaders_holding_share()), (1, 0));

        let following = known(&mut shard, "following", 2);
        shard.activate(&following);
        carry_out_loads_and_floors(&mut shard, &log);
        assert!(shard.channels.get(&following).is_some_and(|m| m.is_quiescent()));

        let_residence_pass(&mut shard);
        let next = known(&mut shard, "next", 1);
        shard.activate(&next);
        carry_out_loads_and_floors(&mut shard, &log);
        assert!(shard.channels.contains(&next), "the leaders' share is free");
        assert!(shard.channels.contains(&fanning), "the fanout goes on");
        assert!(!shard.channels.contains(&following), "the quiescent follower made room");
    }

    /// A replica is not evicted for another's room in the instant it came (`RESIDENCE_MIN`): the
    /// activation short of room is filed to be tried again, and takes the least recently used place
    /// once that time has passed. Evicted as soon as they came, two followers whose leaders' hints came
    /// at once took one place in turn thousands of times within one millisecond.
    #[test]
    fn a_replica_just_activated_is_not_evicted_for_anothers_room() {
        let (mut shard, log) = shard_with_places(2);
        let followers: Vec<ChannelId> = (0..3).map(|i| known(&mut shard, &format!("f{i}"), 2)).collect();
        for follower in &followers[..2] {
            shard.activate(follower);
            carry_out_loads_and_floors(&mut shard, &log);
            assert!(shard.channels.get(follower).is_some_and(|m| m.is_quiescent()), "evictable but for its residence");
        }
        shard.activate(&followers[2]);
        carry_out_loads_and_floors(&mut shard, &log);
        assert!(!shard.channels.contains(&followers[2]) && shard.is_queued_for_room(&followers[2]));

        let_residence_pass(&mut shard);
        shard.retry_queued_for_room();
        carry_out_loads_and_floors(&mut shard, &log);
        assert!(shard.channels.contains(&followers[2]), "placed once the residence passed");
        assert!(!shard.channels.contains(&followers[0]) && shard.channels.contains(&followers[1]), "the LRU left");
    }

    /// A leader refused room because a busy leader holds the one leader's place has that leader asked
    /// to leave once it held the place for `LEADER_TURN`: it takes no new append meanwhile, settles, and
    /// is evicted at the refused leader's next try. Before, a busy leader kept its place for as long as
    /// appends came (sim seed 545000024).
    #[test]
    fn a_busy_leader_is_asked_to_leave_its_place_for_a_leader_refused_room() {
        let (mut shard, log) = shard_with_places(2);
        assert_eq!(super::super::activation::leaders_max(2), 1);
        // Busy: its barrier's durable write is not answered yet.
        let busy = known(&mut shard, "busy", 1);
        shard.activate(&busy);
        let unanswered = carry_out_loads_and_floors(&mut shard, &log);
        assert!(shard.channels.get(&busy).is_some_and(|m| m.role() == RoleKind::Leader && !m.is_quiescent()));

        let waiting = returning_leader(&mut shard, &log, "waiting");
        shard.activate(&waiting);
        carry_out_loads_and_floors(&mut shard, &log);
        assert!(!shard.channels.contains(&waiting), "no leader's place");
        assert!(!shard.is_leaving_for_room(&busy), "not asked before its turn is over");

        let turn_over = shard.now + LEADER_TURN;
        shard.advance(turn_over);
        shard.retry_queued_for_room();
        carry_out_loads_and_floors(&mut shard, &log);
        assert!(!shard.channels.contains(&waiting) && shard.is_leaving_for_room(&busy));
        assert_eq!(shard.counters.leaders_asked_to_leave, 1);
        let records = vec![AppendRecord { idempotency_key: None, payload: bytes::Bytes::from_static(b"m") }];
        shard.handle(turn_over, ShardInput::Append { api: ApiId(9), channel: busy.clone(), sender: None, records });
        let outputs = carry_out_loads_and_floors(&mut shard, &log);
        let refused = outputs.iter().any(|o| {
            matches!(o, ShardOutput::Effect(NodeEffect::Done { id: ApiId(9), result: ApiResult::Appended(Err(e)) })
                if format!("{e:?}").contains("TooManyChannels"))
        });
        assert!(refused, "a leader asked to leave takes no new append: {outputs:?}");

        // The refused leader comes again and waits; the busy one settles, and its place goes to it.
        shard.activate(&waiting);
        carry_out_loads_and_floors(&mut shard, &log);
        assert!(shard.is_queued_for_room(&waiting));
        let outputs = answer_persists(&mut shard, &log, unanswered);
        answer_persists(&mut shard, &log, outputs);
        assert!(shard.channels.contains(&waiting) && !shard.channels.contains(&busy));
        assert!(shard.leaving_for_room.is_none(), "the ask goes with its replica");
    }

    /// A leader asked to leave that does not settle within `LEAVING_PATIENCE` (here its barrier's
    /// durable write never lands) takes appends again, and the next refusal asks another busy leader.
    #[test]
    fn a_leader_that_did_not_settle_in_its_patience_hands_the_ask_to_another() {
        let (mut shard, log) = shard_with_places(3);
        assert_eq!(super::super::activation::leaders_max(3), 2);
        let busy: Vec<ChannelId> = ["busy-a", "busy-b"]
            .into_iter()
            .map(|name| {
                let leader = known(&mut shard, name, 1);
                shard.activate(&leader);
                carry_out_loads_and_floors(&mut shard, &log);
                let_residence_pass(&mut shard);
                leader
            })
            .collect();
        let waiting = returning_leader(&mut shard, &log, "waiting");
        let try_waiting = |shard: &mut ChannelShard| {
            try_activation(shard, &log, &waiting);
            assert!(!shard.channels.contains(&waiting), "no leader's place");
        };

        shard.advance(shard.now + LEADER_TURN);
        try_waiting(&mut shard);
        assert!(shard.is_leaving_for_room(&busy[0]) && !shard.is_leaving_for_room(&busy[1]), "the longest first");
        try_waiting(&mut shard);
        assert_eq!(shard.counters.leaders_asked_to_leave, 1, "one at a time");

        shard.advance(shard.now + LEAVING_PATIENCE);
        assert!(!shard.is_leaving_for_room(&busy[0]), "out of patience, it takes appends again");
        try_waiting(&mut shard);
        assert!(shard.is_leaving_for_room(&busy[1]) && !shard.is_leaving_for_room(&busy[0]), "another is asked");
        assert_eq!(shard.counters.leaders_asked_to_leave, 2);
    }

    /// A shard with room for two replicas, holding two followers that know their records committed
    /// through 3, their store through 1 only: neither may leave memory before a checkpoint.
    fn a_shard_full_of_followers_kept_by_their_checkpoints() -> (ChannelShard, Arc<MemoryLog>, Vec<ChannelId>) {
        let (mut shard, log) = shard_with_places(2);
        let followers: Vec<ChannelId> = ["f0", "f1"]
            .into_iter()
            .map(|name| {
                let follower = known(&mut shard, name, 2);
                store_epoch(&log, &follower, 2, 3, vec![LogOp::CheckpointHw(Seq::new(1))]);
                shard.carried_over.insert(follower.clone(), (Seq::new(3), Seq::new(1)));
                shard.activate(&follower);
                carry_out_loads_and_floors(&mut shard, &log);
                follower
            })
            .collect();
        for follower in &followers {
            let machine = shard.channels.get(follower).expect("active");
            assert!(!machine.can_leave_memory_as_follower() && machine.kept_only_by_its_checkpoint());
        }
        let_residence_pass(&mut shard);
        (shard, log, followers)
    }

    /// An activation waiting for a hurried checkpoint whose replica leaves before it lands (here a new
    /// incarnation is asked for) is placed at the next eviction scan, not left to its load's patience.
    #[test]
    fn an_activation_whose_hurried_replica_left_is_placed_at_the_next_scan() {
        let (mut shard, log, followers) = a_shard_full_of_followers_kept_by_their_checkpoints();
        let third = known(&mut shard, "f2", 2);
        shard.activate(&third);
        carry_out_loads_and_floors(&mut shard, &log);
        assert!(shard.is_loading(&third) && shard.hurried_for.contains_key(&followers[0]));
        shard.retire(&followers[0]);
        assert!(shard.hurried_for.is_empty() && shard.is_loading(&third), "waits until the scan");
        shard.handle_tick(Time::ZERO + std::time::Duration::from_secs(1));
        carry_out_loads_and_floors(&mut shard, &log);
        assert!(shard.channels.contains(&third) && !shard.is_loading(&third));
    }

    /// At the cap, an activation short of room has the least recently used replica that only its HW
    /// checkpoint keeps in memory write it at once (one per activation), waits for it with its inputs
    /// parked, and takes its place once it lands. Left to fall due about a second later, with the
    /// activation refused meanwhile, each place changed hands about once a second (sim seed 487000472).
    #[test]
    fn an_activation_short_of_room_hurries_the_checkpoint_that_keeps_a_replica_in_memory() {
        let (mut shard, log, followers) = a_shard_full_of_followers_kept_by_their_checkpoints();

        let third = known(&mut shard, "f2", 2);
        shard.activate(&third);
        let outputs = carry_out_loads_and_floors(&mut shard, &log);
        assert!(!shard.channels.contains(&third) && shard.is_loading(&third), "waits for room");
        assert_eq!(shard.counters.refused_activations, 0, "not refused");
        let persists: Vec<_> = outputs
            .into_iter()
            .filter_map(|output| match output {
                ShardOutput::Effect(NodeEffect::Persist { token, batch }) => Some((token, batch)),
                _ => None,
            })
            .collect();
        assert_eq!(persists.len(), 1, "one checkpoint for one activation: {persists:?}");
        let (token, batch) = persists.into_iter().next().expect("one");
        assert_eq!(batch.channel, followers[0], "the least recently used");
        assert!(batch.ops.contains(&LogOp::CheckpointHw(Seq::new(3))), "{:?}", batch.ops);
        let result = tidings_store::message::MessageLog::commit(&*log, batch);
        shard.handle(Time::ZERO, ShardInput::Persisted { channel: followers[0].clone(), token, result });

        carry_out_loads_and_floors(&mut shard, &log);
        assert!(shard.channels.contains(&third), "the checkpointed follower made room");
        assert!(!shard.channels.contains(&followers[0]) && shard.channels.contains(&followers[1]));
        assert!(shard.hurried_for.is_empty() && !shard.is_loading(&third));
        assert_eq!(shard.counters.refused_activations, 0);
    }

    /// An append for a leader whose shard has no leader's place free waits while the least recently
    /// used leader that only its checkpoint keeps in memory writes it, then is taken: not refused
    /// `TooManyChannels`, as it was while that checkpoint waited to fall due.
    #[test]
    fn an_append_for_a_leader_short_of_room_waits_for_a_hurried_checkpoint() {
        let (mut shard, log) = shard_with_places(2);
        assert_eq!(super::super::activation::leaders_max(2), 1);
        // The one leader's place: a leader whose records committed through 3, its store through 1.
        let held = known(&mut shard, "held", 1);
        store_epoch(&log, &held, 2, 3, vec![LogOp::CheckpointHw(Seq::new(1))]);
        shard.carried_over.insert(held.clone(), (Seq::new(3), Seq::new(3)));
        shard.resumable.insert(held.clone(), LeaderEpoch::new(2));
        shard.activate(&held);
        let outputs = carry_out_loads_and_floors(&mut shard, &log);
        answer_persists(&mut shard, &log, outputs);
        let machine = shard.channels.get(&held).expect("active");
        assert_eq!(machine.role(), RoleKind::Leader);
        assert!(machine.kept_only_by_its_checkpoint() && !machine.is_quiescent());
        let_residence_pass(&mut shard);

        // A leader evicted earlier (its epoch's barrier in its log) coming back for an append.
        let returning = returning_leader(&mut shard, &log, "returning");
        let records = vec![AppendRecord { idempotency_key: None, payload: bytes::Bytes::from_static(b"m") }];
        shard.handle(
            Time::ZERO,
            ShardInput::Append { api: ApiId(7), channel: returning.clone(), sender: None, records },
        );
        let outputs = carry_out_loads_and_floors(&mut shard, &log);
        assert!(!outputs.iter().any(|o| matches!(o, ShardOutput::Effect(NodeEffect::Done { .. }))), "{outputs:?}");
        assert!(shard.is_loading(&returning), "waits for the room");
        let others = answer_persists(&mut shard, &log, outputs);

        assert!(shard.channels.contains(&returning) && !shard.channels.contains(&held));
        let done: Vec<_> = others
            .iter()
            .filter_map(|o| match o {
                ShardOutput::Effect(NodeEffect::Done { id, result }) => Some((*id, result)),
                _ => None,
            })
            .collect();
        assert!(matches!(&done[..], [(ApiId(7), ApiResult::Appended(Ok(_)))]), "{done:?}");
        assert_eq!(shard.counters.refused_activations, 0);
    }

    /// Channel `name` as [`known`] makes it, but with MinISR both replicas: nothing commits without node 2.
    fn known_min_isr_all(shard: &mut ChannelShard, name: &str, leader: u64) -> ChannelId {
        let channel = known(shard, name, leader);
        shard.metas.get_mut(&channel).expect("just known").meta.min_isr = 2;
        channel
    }

    /// Activates `channel` and makes every durable write it asks for land; returns the other outputs.
    fn activate_and_settle(shard: &mut ChannelShard, log: &MemoryLog, channel: &ChannelId) -> Vec<ShardOutput> {
        shard.activate(channel);
        let outputs = carry_out_loads_and_floors(shard, log);
        answer_persists(shard, log, outputs)
    }

    /// A follower finding every place and the followers' reserve held by leaders that wait for a
    /// follower elsewhere takes the place of the least recently used one that no caller waits on, once
    /// it has held it for a leader's turn; a leader with an append waiting keeps its place. The leader
    /// evicted keeps its uncommitted records in its log and its epoch to resume. Refused instead, the
    /// follower waited for good when the other node's places were held the same way (sim seed
    /// 621000689: two nodes, two places a shard, MinISR every replica).
    #[test]
    fn a_follower_takes_the_place_of_a_leader_stalled_waiting_for_followers_elsewhere() {
        let (mut shard, log) = shard_with_places(2);
        // Least recently used, but an append waits on it.
        let busy = known_min_isr_all(&mut shard, "busy", 1);
        activate_and_settle(&mut shard, &log, &busy);
        let records = vec![AppendRecord { idempotency_key: None, payload: bytes::Bytes::from_static(b"m") }];
        shard.handle(shard.now, ShardInput::Append { api: ApiId(1), channel: busy.clone(), sender: None, records });
        let outputs = carry_out_loads_and_floors(&mut shard, &log);
        assert_eq!(appends_done(&answer_persists(&mut shard, &log, outputs)), vec![], "waits for node 2");
        // A leadership started in the place past the leaders' share; its barrier waits for node 2.
        let_residence_pass(&mut shard);
        let stalled = known_min_isr_all(&mut shard, "stalled", 1);
        activate_and_settle(&mut shard, &log, &stalled);
        // A follower let in past the cap, then named leader in place.
        let_residence_pass(&mut shard);
        let named = known_min_isr_all(&mut shard, "named", 2);
        activate_and_settle(&mut shard, &log, &named);
        let mut leads_here = shard.metas[&named].meta.clone();
        (leads_here.version, leads_here.leader, leads_here.leader_epoch) = (4, ME, LeaderEpoch::new(3));
        shard.learn_meta(leads_here, true);
        let outputs = carry_out_loads_and_floors(&mut shard, &log);
        answer_persists(&mut shard, &log, outputs);
        assert_eq!((shard.channels.len(), shard.leaders_active()), (3, 3));
        let barrier_only = tidings_store::message::MessageLog::state(&*log, &stalled).unwrap();
        assert_eq!((barrier_only.last_seq, barrier_only.hw), (Seq::new(1), Seq::new(0)));

        // Within a leader's turn, the follower is refused.
        let follower = known_min_isr_all(&mut shard, "follower", 2);
        activate_and_settle(&mut shard, &log, &follower);
        assert!(!shard.channels.contains(&follower));
        shard.unfile(&follower);
        shard.room_queue.clear();
        shard.loading.clear();
        // Past it, it takes the stalled leader's place (least recently used of those no caller waits on).
        let turn_over = shard.now + LEADER_TURN;
        shard.advance(turn_over);
        activate_and_settle(&mut shard, &log, &follower);
        assert!(shard.channels.contains(&follower));
        assert!(!shard.channels.contains(&stalled));
        assert!(shard.channels.contains(&busy) && shard.channels.contains(&named));
        assert_eq!(shard.resumable.get(&stalled), Some(&LeaderEpoch::new(2)), "it resumes its leadership");
        assert_eq!(tidings_store::message::MessageLog::state(&*log, &stalled).unwrap(), barrier_only);
    }

    /// A shard with room for three replicas whose leaders' share (two places) is held by busy leaders,
    /// each with its barrier's durable write not answered yet (returned): not quiescent, and no
    /// checkpoint of theirs to hurry.
    fn a_shard_whose_leaders_share_busy_leaders_hold(
    ) -> (ChannelShard, Arc<MemoryLog>, Vec<ChannelId>, Vec<ShardOutput>) {
        let (mut shard, log) = shard_with_places(3);
        assert_eq!(super::super::activation::leaders_max(3), 2);
        let mut unanswered = Vec::new();
        let busy = ["busy-1", "busy-2"]
            .into_iter()
            .map(|name| {
                let busy = known(&mut shard, name, 1);
                shard.activate(&busy);
                unanswered.extend(carry_out_loads_and_floors(&mut shard, &log));
                busy
            })
            .collect();
        let_residence_pass(&mut shard);
        (shard, log, busy, unanswered)
    }

    /// An append (call `api`) for a returning leader (see `returning_leader`), the channel's.
    fn append_for_a_returning_leader(shard: &mut ChannelShard, log: &MemoryLog, api: ApiId) -> ChannelId {
        let returning = returning_leader(shard, log, "returning");
        let records = vec![AppendRecord { idempotency_key: None, payload: bytes::Bytes::from_static(b"m") }];
        shard.handle(shard.now, ShardInput::Append { api, channel: returning.clone(), sender: None, records });
        returning
    }

    /// The appends `outputs` answer, by call.
    fn appends_done(outputs: &[ShardOutput]) -> Vec<(ApiId, bool)> {
        outputs
            .iter()
            .filter_map(|o| match o {
                ShardOutput::Effect(NodeEffect::Done { id, result: ApiResult::Appended(result) }) => {
                    Some((*id, result.is_ok()))
                }
                _ => None,
            })
            .collect()
    }

    /// An append for a leader that finds no room, and no replica whose checkpoint alone keeps it, waits
    /// in the room queue with its activation; the first busy leader to settle hands its place over
    /// (its checkpoint hurried for the waiting one) and the append is taken, with no retry from anyone.
    /// Refused at once, such an activation was tried again only at the next eviction scan or its
    /// sender's retry, and at the cap a place changed hands about once a round of retries (sim seed
    /// 556000608: 48 busy channels on a few places, nine took no append through the healed phase).
    #[test]
    fn an_append_for_a_leader_with_no_room_waits_for_the_next_place_freed() {
        let (mut shard, log, busy, unanswered) = a_shard_whose_leaders_share_busy_leaders_hold();
        let returning = append_for_a_returning_leader(&mut shard, &log, ApiId(5));
        let outputs = carry_out_loads_and_floors(&mut shard, &log);
        assert_eq!(appends_done(&outputs), vec![], "neither taken nor refused");
        assert!(shard.is_queued_for_room(&returning) && !shard.channels.contains(&returning));
        assert_eq!((shard.counters.activations_queued_for_room, shard.counters.refused_activations), (1, 0));

        // The first busy leader's barrier lands: it commits, its checkpoint is hurried for the waiting
        // leader, and that one takes its place.
        let first: Vec<ShardOutput> = unanswered.into_iter().take(1).collect();
        let outputs = answer_persists(&mut shard, &log, first);
        assert!(shard.channels.contains(&returning) && !shard.channels.contains(&busy[0]));
        assert!(shard.channels.contains(&busy[1]));
        assert_eq!(appends_done(&outputs), vec![(ApiId(5), true)]);
        assert!(shard.room_queue.is_empty() && !shard.is_loading(&returning));
        assert_eq!(shard.counters.refused_activations, 0);
    }

    /// An activation waits in the room queue for `ROOM_PATIENCE` at most (to the eviction scan after
    /// it), a leader that has a busy leader asked to leave for it as long as that leave may take
    /// (`LEAVING_PATIENCE`), once: then it is refused as an activation with no room was, its append
    /// `TooManyChannels` (the caller's retry), and it is filed to be tried again.
    #[test]
    fn an_activation_waiting_for_room_past_its_patience_is_refused() {
        let (mut shard, log, busy, _unanswered) = a_shard_whose_leaders_share_busy_leaders_hold();
        let returning = append_for_a_returning_leader(&mut shard, &log, ApiId(6));
        carry_out_loads_and_floors(&mut shard, &log);
        assert!(shard.is_queued_for_room(&returning));
        let scan = |shard: &mut ChannelShard, at: Time| {
            shard.next_evict_scan = shard.now;
            shard.handle_tick(at);
            appends_done(&carry_out_loads_and_floors(shard, &log))
        };
        let started = shard.now;

        // A scan before the patience is over leaves it waiting.
        assert_eq!(scan(&mut shard, started + ROOM_PATIENCE / 2), vec![]);
        assert!(shard.is_queued_for_room(&returning));
        // The busy leaders' turn over, one is asked to leave for it: it waits for that place.
        assert_eq!(scan(&mut shard, started + LEADER_TURN), vec![]);
        assert!(shard.is_queued_for_room(&returning) && shard.is_leaving_for_room(&busy[0]));
        let asked_at = shard.now;
        assert_eq!(scan(&mut shard, started + ROOM_PATIENCE * 2), vec![]);
        assert!(shard.is_queued_for_room(&returning));

        // The busy leader does not settle: at the end of its leave the wait ends (another leader asked
        // for it then does not lengthen it again).
        assert_eq!(scan(&mut shard, asked_at + LEAVING_PATIENCE), vec![(ApiId(6), false)]);
        assert!(shard.is_leaving_for_room(&busy[1]), "another is asked");
        // Filed, it is tried again by the same scan: it waits anew, with nothing of the caller's.
        assert!(shard.to_activate.contains_key(&returning));
        assert_eq!(shard.counters.refused_activations, 1);
    }

    /// The place a busy leader was asked to leave goes to the leader it was asked to leave for, not to
    /// one that waited longer: the one it left for found it taken a scan later, and a shard of one
    /// leader's place turned over three times in 13 s, never to it (sim seed 590000776).
    #[test]
    fn the_place_a_leader_leaves_goes_to_the_leader_it_left_for() {
        let (mut shard, log) = shard_with_places(2);
        let busy = known(&mut shard, "busy", 1);
        shard.activate(&busy);
        let unanswered = carry_out_loads_and_floors(&mut shard, &log);
        // Refused before the busy leader's turn is over: it waits, and no leader is asked to leave.
        let earlier = returning_leader(&mut shard, &log, "earlier");
        shard.activate(&earlier);
        carry_out_loads_and_floors(&mut shard, &log);
        assert!(shard.is_queued_for_room(&earlier) && shard.leaving_for_room.is_none());

        let turn_over = shard.now + LEADER_TURN;
        shard.advance(turn_over);
        let asker = returning_leader(&mut shard, &log, "asker");
        shard.activate(&asker);
        carry_out_loads_and_floors(&mut shard, &log);
        assert!(shard.is_leaving_for_room(&busy) && shard.is_queued_for_room(&asker));

        let outputs = answer_persists(&mut shard, &log, unanswered);
        answer_persists(&mut shard, &log, outputs);
        assert!(!shard.channels.contains(&busy), "settled, it left");
        assert!(shard.channels.contains(&asker), "its place went to the leader it left for");
        assert!(!shard.channels.contains(&earlier));
    }

    /// The room queue holds as many activations as the shard has room for replicas; one more finding no
    /// room is refused at once. Waiting there, they do not count against the loads: the activation of
    /// another replica still loads (and may find a place a follower can take past the cap).
    #[test]
    fn the_room_queue_is_bounded_by_the_room() {
        let (mut shard, log, _busy, _unanswered) = a_shard_whose_leaders_share_busy_leaders_hold();
        let leaders: Vec<ChannelId> = (0..4).map(|i| returning_leader(&mut shard, &log, &format!("l{i}"))).collect();
        for leader in &leaders {
            shard.activate(leader);
            carry_out_loads_and_floors(&mut shard, &log);
        }
        let queued: Vec<bool> = leaders.iter().map(|l| shard.is_queued_for_room(l)).collect();
        assert_eq!(queued, vec![true, true, true, false]);
        assert_eq!((shard.counters.activations_queued_for_room, shard.counters.refused_activations), (3, 1));
        assert!(shard.to_activate.contains_key(&leaders[3]));

        let follower = known(&mut shard, "follower", 2);
        shard.activate(&follower);
        carry_out_loads_and_floors(&mut shard, &log);
        assert!(shard.channels.contains(&follower), "the followers' place is free");
    }

    /// The activations filed to be tried again take the loads in turn: a scan starts past the entry
    /// tried last, and an entry not reached for want of a load keeps its tries. Taken in name order,
    /// each tried every scan, the first few took every load and one late in the file spent its tries
    /// refused for want of a load (sim seed 487000990).
    #[test]
    fn activations_filed_to_retry_take_the_loads_in_turn() {
        let (mut shard, log) = shard_with_places(2);
        // Both places held by leaders whose barriers' persists are never answered: never evicted.
        for name in ["busy-1", "busy-2"] {
            let busy = known(&mut shard, name, 1);
            shard.activate(&busy);
            carry_out_loads_and_floors(&mut shard, &log);
        }
        assert_eq!(shard.leaders_active(), 2);
        let followers: Vec<ChannelId> = (0..6).map(|i| known(&mut shard, &format!("f{i}"), 2)).collect();
        for follower in &followers {
            shard.activate_later(follower, REFUSED_ACTIVATION_TRIES);
        }
        let tries =
            |shard: &ChannelShard| followers.iter().map(|f| shard.to_activate.get(f).copied()).collect::<Vec<_>>();
        let five = Some(REFUSED_ACTIVATION_TRIES);
        let four = Some(REFUSED_ACTIVATION_TRIES - 1);

        shard.activate_again();
        assert!(shard.is_loading(&followers[0]) && shard.is_loading(&followers[1]));
        assert_eq!(tries(&shard), vec![four, four, five, five, five, five], "the rest not reached");
        shard.activate_again();
        assert_eq!(tries(&shard), vec![four, four, five, five, five, five], "no load to be had meanwhile");
        // Loaded, the first is let in past the cap (the leaders hold the followers' place), the second
        // finds no room; the next scan starts past it.
        carry_out_loads_and_floors(&mut shard, &log);
        assert!(shard.channels.contains(&followers[0]) && !shard.channels.contains(&followers[1]));
        shard.activate_again();
        assert!(shard.is_loading(&followers[2]) && shard.is_loading(&followers[3]), "the next two in turn");
        assert_eq!(tries(&shard), vec![None, four, four, four, five, five]);

        let mut loaded: BTreeSet<ChannelId> = followers[..4].iter().cloned().collect();
        for _ in 0..followers.len() * usize::from(REFUSED_ACTIVATION_TRIES) {
            loaded.extend(followers.iter().filter(|f| shard.is_loading(f)).cloned());
            carry_out_loads_and_floors(&mut shard, &log);
            shard.activate_again();
        }
        assert_eq!(loaded.len(), followers.len(), "every filed activation got a load: {loaded:?}");
        assert!(followers
            .iter()
            .all(|f| !shard.to_activate.contains_key(f) || shard.channels.contains(f) || shard.is_queued_for_room(f)));
    }

    /// A follower evicted while its pull waits keeps the pull for its next incarnation, until a pull
    /// timeout after it was sent: then its next incarnation would send it again at once, and the entry
    /// (with the channel's id it keeps alive) goes.
    #[test]
    fn a_kept_pull_goes_a_pull_timeout_after_it_was_sent() {
        let config = NodeConfig::new(ME, vec![ME, NodeId::new(2)]);
        let timeout = config.machine.pull_timeout;
        let (mut shard, log) = shard_over_memory_log(config);
        let follower = known(&mut shard, "evicted-while-pulling", 2);
        shard.activate(&follower);
        carry_out_loads_and_floors(&mut shard, &log);
        assert!(shard.channels.get(&follower).is_some_and(|m| m.pull_in_flight().is_some()), "it pulls");
        shard.evict(&follower);
        assert!(shard.pulls_in_flight.contains_key(&follower), "kept for its next incarnation");
        let scans = |shard: &mut ChannelShard, at: Time| {
            shard.handle_tick(at);
            while shard.poll_output().is_some() {}
        };
        scans(&mut shard, Time::ZERO + timeout - std::time::Duration::from_millis(1));
        assert!(shard.pulls_in_flight.contains_key(&follower), "not yet a pull timeout old");
        scans(&mut shard, Time::ZERO + timeout + std::time::Duration::from_secs(1));
        assert!(shard.pulls_in_flight.is_empty() && shard.pulls_in_flight_order.is_empty(), "gone");
    }

    /// A follower of `shard` evicted while its pull waited (the pull kept), and its leader's answer to
    /// that pull: one record.
    fn evicted_follower_and_its_answer(shard: &mut ChannelShard, log: &MemoryLog) -> (ChannelId, ChannelMessage) {
        let follower = known(shard, "answered-while-out", 2);
        shard.activate(&follower);
        carry_out_loads_and_floors(shard, log);
        let kept = shard.channels.get(&follower).and_then(|m| m.pull_in_flight()).expect("it pulls");
        let_residence_pass(shard);
        shard.evict(&follower);
        assert!(shard.pulls_in_flight.contains_key(&follower), "kept");
        let record = first_barrier_of_epoch_2();
        let body = PullBody::Records { records: vec![record], hw: Seq::new(0), fanned_through: Seq::new(0) };
        let leader_epoch = LeaderEpoch::new(2);
        let answer = PullResponse { channel: follower.clone(), pull_id: kept.pull_id(), leader_epoch, body };
        (follower, ChannelMessage::PullResponse(answer))
    }

    /// An answer to an evicted follower's kept pull that reaches no replica (its activation refused room)
    /// lets the pull go: the follower's next incarnation pulls at once, rather than a pull timeout after
    /// the pull answered was sent (sim seed 575000392).
    #[test]
    fn an_answer_dropped_for_want_of_room_lets_its_kept_pull_go() {
        let (mut shard, log) = shard_with_places(2);
        let (follower, answer) = evicted_follower_and_its_answer(&mut shard, &log);
        // Two followers just activated hold both places (neither may leave for another's room yet), and
        // as many activations as places wait for room.
        for name in ["holder-a", "holder-b", "queued-a", "queued-b"] {
            let other = known(&mut shard, name, 2);
            shard.activate(&other);
            carry_out_loads_and_floors(&mut shard, &log);
        }
        assert_eq!((shard.channels.len(), shard.room_queue.len()), (2, 2));

        shard.channel_message(NodeId::new(2), answer);
        assert!(shard.pulls_in_flight.contains_key(&follower), "kept while the answer may still be taken");
        carry_out_loads_and_floors(&mut shard, &log);
        assert!(!shard.channels.contains(&follower) && !shard.is_loading(&follower), "refused room");
        assert!(shard.to_activate.contains_key(&follower), "to be tried again");
        assert!(!shard.pulls_in_flight.contains_key(&follower), "nothing answers the kept pull again");
    }

    /// So does an answer that finds every load taken: the follower is not even loaded for it.
    #[test]
    fn an_answer_dropped_for_want_of_a_load_lets_its_kept_pull_go() {
        let (mut shard, log) = shard_with_places(2);
        let (follower, answer) = evicted_follower_and_its_answer(&mut shard, &log);
        for name in ["loading-a", "loading-b"] {
            let other = known(&mut shard, name, 2);
            shard.activate(&other);
        }
        assert!(shard.loading_full());
        shard.channel_message(NodeId::new(2), answer);
        assert!(!shard.is_loading(&follower) && shard.to_activate.contains_key(&follower), "to be tried again");
        assert!(!shard.pulls_in_flight.contains_key(&follower), "nothing answers the kept pull again");
    }

    /// A follower whose leader's hint finds the loads taken and the file of retries full takes the place
    /// of a plain follower's retry there, and a leadership to start then takes another's, not its
    /// (sim seed 590000525).
    #[test]
    fn a_follower_its_leader_waits_on_takes_a_plain_retrys_place_in_a_full_file() {
        let (mut shard, _log) = shard_with_places(2);
        let max = shard.retries_max();
        let plain: Vec<ChannelId> = (0..max).map(|i| known(&mut shard, &format!("f{i:03}"), 2)).collect();
        for follower in &plain {
            shard.activate_later(follower, REFUSED_ACTIVATION_TRIES);
        }
        for name in ["loading-a", "loading-b"] {
            let other = known(&mut shard, name, 2);
            shard.activate(&other);
        }
        assert!(shard.loading_full() && shard.to_activate.len() == max);

        let awaited = known(&mut shard, "awaited", 2);
        let hint = PullHint { channel: awaited.clone(), leader_epoch: LeaderEpoch::new(2) };
        shard.channel_message(NodeId::new(2), ChannelMessage::Hint(hint));
        assert!(!shard.is_loading(&awaited), "no load to be had");
        assert!(shard.to_activate.contains_key(&awaited), "filed in a plain retry's place");
        assert_eq!(shard.to_activate.len(), max);

        let leader = known(&mut shard, "leader", 1);
        shard.activate_later(&leader, LEADER_START_TRIES);
        assert!(shard.to_activate.contains_key(&leader) && shard.to_activate.contains_key(&awaited));
        // Taken out of the file, it is a plain retry again should it come back.
        shard.unfile(&awaited);
        assert!(shard.awaited_retries.is_empty());
    }

    /// A shard of three places on a node keeping the replicas of dozens of busy channels files the
    /// retry of every one of them that is refused: leaderships to start and followers their leaders wait
    /// on alike. Filed to sixteen, a follower whose hint found the file full of such retries was not
    /// filed, and its leader's next hint came a pull timeout later (sim seed 608000435).
    #[test]
    fn a_shard_of_few_places_files_the_retries_of_dozens_of_awaited_replicas() {
        let (mut shard, _log) = shard_with_places(3);
        for name in ["loading-a", "loading-b", "loading-c"] {
            let other = known(&mut shard, name, 2);
            shard.activate(&other);
        }
        assert!(shard.loading_full());
        let leaders: Vec<ChannelId> = (0..20).map(|i| known(&mut shard, &format!("l{i:02}"), 1)).collect();
        for leader in &leaders {
            shard.activate_later(leader, LEADER_START_TRIES);
        }
        let followers: Vec<ChannelId> = (0..28).map(|i| known(&mut shard, &format!("f{i:02}"), 2)).collect();
        for follower in &followers {
            let hint = PullHint { channel: follower.clone(), leader_epoch: LeaderEpoch::new(2) };
            shard.channel_message(NodeId::new(2), ChannelMessage::Hint(hint));
        }
        let unfiled: Vec<&ChannelId> =
            leaders.iter().chain(&followers).filter(|c| !shard.to_activate.contains_key(*c)).collect();
        assert!(unfiled.is_empty(), "not filed: {unfiled:?}");
        assert_eq!(shard.awaited_retries.len(), followers.len());
    }

    /// With one load to be had, a filed follower its leader waits on is tried before the leaderships and
    /// the plain followers filed before it, whatever the turn.
    #[test]
    fn a_follower_its_leader_waits_on_is_retried_before_the_other_filed_activations() {
        let (mut shard, _log) = shard_with_places(2);
        let loading: Vec<ChannelId> = ["loading-a", "loading-b"].iter().map(|n| known(&mut shard, n, 2)).collect();
        for other in &loading {
            shard.activate(other);
        }
        assert!(shard.loading_full());
        let mut others: Vec<ChannelId> = (0..4).map(|i| known(&mut shard, &format!("a-leader-{i}"), 1)).collect();
        for leader in &others {
            shard.activate_later(leader, LEADER_START_TRIES);
        }
        others.push(known(&mut shard, "b-follower", 2));
        shard.activate_later(&others[4], REFUSED_ACTIVATION_TRIES);
        let awaited = known(&mut shard, "z-awaited", 2);
        let hint = PullHint { channel: awaited.clone(), leader_epoch: LeaderEpoch::new(2) };
        shard.channel_message(NodeId::new(2), ChannelMessage::Hint(hint));
        assert!(shard.awaited_retries.contains(&awaited), "filed as awaited");

        // One load comes back.
        shard.loading.remove(&loading[0]);
        shard.activate_again();
        assert!(shard.is_loading(&awaited), "the awaited follower takes the load");
        assert!(others.iter().all(|c| !shard.is_loading(c) && shard.to_activate.contains_key(c)));
    }

    /// A shard keeps the pulls of more evicted followers than it has places (up to `KEPT_PULLS_MIN`): kept
    /// to its room alone, a shard of two places forgot a follower's pull after two more evictions, and
    /// with seven learners taking two places in turn each answer came to an incarnation that had sent a
    /// new pull (sim seed 560000612).
    #[test]
    fn a_shard_keeps_the_pulls_of_more_evicted_followers_than_its_places() {
        let (mut shard, log) = shard_with_places(2);
        let followers: Vec<ChannelId> = (0..7).map(|i| known(&mut shard, &format!("f{i}"), 2)).collect();
        for follower in &followers {
            shard.activate(follower);
            carry_out_loads_and_floors(&mut shard, &log);
            assert!(shard.channels.get(follower).is_some_and(|m| m.pull_in_flight().is_some()), "it pulls");
            shard.evict(follower);
        }
        assert!(followers.iter().all(|f| shard.pulls_in_flight.contains_key(f)), "every pull kept");

        // Its next incarnation takes the pull kept, to take its answer.
        let kept = shard.pulls_in_flight[&followers[0]].1;
        shard.activate(&followers[0]);
        carry_out_loads_and_floors(&mut shard, &log);
        assert_eq!(shard.channels.get(&followers[0]).and_then(|m| m.pull_in_flight()), Some(kept));
        assert!(!shard.pulls_in_flight.contains_key(&followers[0]));
    }

    /// The file of activations to retry holds at most `retries_max` channels (the room, at least
    /// `RETRIES_MIN`); a leadership to start takes the place of a follower's retry when it is full,
    /// never of another leadership.
    #[test]
    fn a_leadership_to_start_takes_a_followers_place_in_a_full_file_of_retries() {
        let config = NodeConfig { active_channels_max: 2, ..NodeConfig::new(ME, vec![ME, NodeId::new(2)]) };
        let mut shard = super::super::test_shard(config, Arc::new(MemoryLog::new(Default::default())));
        let max = shard.retries_max();
        assert_eq!((shard.active_max, max), (2, RETRIES_MIN));
        let followers: Vec<ChannelId> = (0..=max).map(|i| known(&mut shard, &format!("f{i:03}"), 2)).collect();
        let leaders: Vec<ChannelId> = (0..=max).map(|i| known(&mut shard, &format!("l{i:03}"), 1)).collect();
        for follower in &followers {
            shard.activate_later(follower, REFUSED_ACTIVATION_TRIES);
        }
        assert_eq!(shard.to_activate.keys().collect::<Vec<_>>(), followers[..max].iter().collect::<Vec<_>>(), "full");
        shard.activate_later(&leaders[0], LEADER_START_TRIES);
        assert!(shard.to_activate.contains_key(&leaders[0]) && shard.to_activate.len() == max);
        // Filed again, it keeps its tries; a follower's retry does not take a leadership's place.
        shard.to_activate.insert(leaders[0].clone(), 7);
        shard.activate_later(&leaders[0], LEADER_START_TRIES);
        shard.activate_later(&followers[max], REFUSED_ACTIVATION_TRIES);
        assert_eq!(shard.to_activate.get(&leaders[0]), Some(&7));
        assert!(!shard.to_activate.contains_key(&followers[max]));
        for leader in &leaders[1..max] {
            shard.activate_later(leader, LEADER_START_TRIES);
        }
        assert_eq!(shard.to_activate.keys().collect::<Vec<_>>(), leaders[..max].iter().collect::<Vec<_>>());
        // Full of leaderships, the file takes no more: it stays bounded.
        shard.activate_later(&leaders[max], LEADER_START_TRIES);
        assert_eq!(shard.to_activate.len(), max);
        assert!(!shard.to_activate.contains_key(&leaders[max]));
    }
}
