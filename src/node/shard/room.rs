//! Room at the cap: which replica leaves memory for another's activation (a quiescent one, a follower
//! whose state is on disk, a leader stalled with no caller waiting, a leader only fanning out that
//! hands its fanout to its next incarnation), the leaders' share of the places, and checkpoints hurried
//! so that a replica may leave. The turns busy leaders take in that share are in `turns`; the room
//! queue an activation waits in is in `activation`.

use super::activation::followers_reserve;
use super::retries::{LEADER_START_TRIES, REFUSED_ACTIVATION_TRIES};
use super::{ChannelShard, ShardOutput};
use std::time::Duration;
use tidings_channel::machine::{ChannelMachine, RoleKind};
use tidings_types::{ChannelId, Time};

/// How long a leader holds its place of the leaders' share before it may be asked to leave for a leader
/// refused room (`ChannelShard::ask_a_leader_to_leave`): busy leaders take the places in turns of at
/// least this.
pub(super) const LEADER_TURN: Duration = Duration::from_secs(1);

/// How long a replica stays in memory before it may be evicted for another's room: past the instant it
/// came. Evicted as soon as it came, a replica did no work in memory: once the file of retries was
/// taken in turn, two followers whose leaders' hints came at once took one place in turn 15,000 times
/// within one millisecond (each activation evicting the other, each eviction answered by a hint;
/// `more_busy_channels_than_room_for_active_replicas_all_commit`). Longer (50 ms, tried) refused too
/// many activations at tight limits: channels took no append after healing in 4 of the first 150 sim
/// soaks of 24 busy channels. Idle eviction keeps to `channel_idle_evict`.
pub(super) const RESIDENCE_MIN: Duration = Duration::from_millis(1);

/// Whether a replica may leave memory for an activation waiting for room
/// ([`ChannelShard::may_leave_for_room`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Leaving {
    /// At once: its place may be given.
    Now,
    /// Once a checkpoint of its own, hurried, lands.
    AfterCheckpoint,
    /// Not for now.
    Stays,
}

impl ChannelShard {
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

    /// When no replica at rest may leave for an activation (`evict_one`): `true` if it may be placed all
    /// the same. A follower (`leads` false) is let in past the cap while leaders hold the followers'
    /// places, or takes a stalled leader's place; any activation takes the place of a leader whose
    /// only work left is fanout ([`ChannelShard::evict_one_fanning_out_leader`]), last since its
    /// next incarnation plans that fanout again.
    pub(super) fn room_of_last_resort(&mut self, leads: bool) -> bool {
        (!leads && (self.followers_place_taken_by_leaders() || self.evict_one_stalled_leader()))
            || self.evict_one_fanning_out_leader()
    }

    /// Evicts the least recently used leader that has held its place for [`LEADER_TURN`] and whose only
    /// work left is fanout it may hand over (`ChannelMachine::can_leave_memory_fanning_out`): the node
    /// stops that channel's fanout (`ShardOutput::FanoutHandedOver`) and the replica is filed to come back
    /// at the next eviction scans, as a leader's start is, since nothing else may prompt it; its next
    /// incarnation plans again what was not known to finish. Such a leader waits for no follower and
    /// holds no place of the leaders' share, but it held a place of the shard's room for as long as its
    /// fanout ran, and a third leader of a shard of two places was refused room for the whole healed
    /// phase (sim seed 660003161, tight limits). The turn keeps places from changing hands faster than
    /// a load. O(active), at the cap only.
    fn evict_one_fanning_out_leader(&mut self) -> bool {
        let Some(leader) = self.evict_least_recent(LEADER_TURN, ChannelMachine::can_leave_memory_fanning_out) else {
            return false;
        };
        self.counters.fanning_out_leaders_evicted += 1;
        self.outputs.push_back(ShardOutput::FanoutHandedOver(leader.clone()));
        self.activate_later(&leader, LEADER_START_TRIES);
        true
    }

    /// Whether `channel`'s replica (`machine`) may leave for an activation waiting for room: at once
    /// (quiescent, or a leader only fanning out that held its place a turn and may hand its fanout over:
    /// `evict_one`, `evict_one_fanning_out_leader`), or once only a checkpoint is written (when it
    /// has resided, or, fanning out, held its place a turn). Read for the replicas a drain went through
    /// (`give_freed_places`): their places go to the room queue without waiting for the next scan.
    pub(super) fn may_leave_for_room(&self, channel: &ChannelId, machine: &ChannelMachine) -> Leaving {
        let turn_held = self.in_memory_for(channel, LEADER_TURN);
        if machine.is_quiescent() || (turn_held && machine.can_leave_memory_fanning_out()) {
            Leaving::Now
        } else if machine.kept_only_by_its_checkpoint()
            || self.fanning_out_kept_only_by_its_checkpoint(channel, machine)
        {
            Leaving::AfterCheckpoint
        } else {
            Leaving::Stays
        }
    }

    /// `true` for a leader only fanning out that held its place a turn and that only a checkpoint keeps
    /// from leaving for another's room (`ChannelMachine::kept_fanning_out_only_by_its_checkpoint`).
    fn fanning_out_kept_only_by_its_checkpoint(&self, channel: &ChannelId, machine: &ChannelMachine) -> bool {
        machine.kept_fanning_out_only_by_its_checkpoint() && self.in_memory_for(channel, LEADER_TURN)
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
    /// back, resuming its leadership, with its followers' next pull or its next append. The pulls it
    /// had parked go unanswered, as an idle leader's do when it leaves: their senders pull again at
    /// their pull timeout. An answer now (`NotLeader`) would bring those pulls back at once, to take
    /// the place again before the follower let in could use it. O(active), at the cap only.
    pub(super) fn evict_one_stalled_leader(&mut self) -> bool {
        let evicted = self.evict_least_recent(LEADER_TURN, |m| m.can_leave_memory_as_stalled_leader()).is_some();
        self.counters.stalled_leaders_evicted += u64::from(evicted);
        evicted
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
        // A leader only fanning out holds no place of the leaders' share, and is hurried last, since its
        // fanout is planned again once it leaves (see `room_of_last_resort`).
        let hurried = self
            .channels
            .iter()
            .filter_map(|(c, m)| {
                let at_rest_after = (!leaders_only || m.role() == RoleKind::Leader)
                    && m.kept_only_by_its_checkpoint()
                    && self.resided(c);
                let fanning_out_after = !leaders_only && self.fanning_out_kept_only_by_its_checkpoint(c, m);
                (at_rest_after || fanning_out_after).then_some((fanning_out_after, c))
            })
            .min_by_key(|(fanning_out, c)| {
                (*fanning_out, self.channels.last_used(c).unwrap_or(Time::ZERO), (*c).clone())
            })
            .map(|(_, c)| c.clone())?;
        let now = self.now;
        self.machine_mut(&hurried).is_some_and(|machine| machine.checkpoint_to_leave(now)).then_some(hurried)
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
    pub(super) fn in_memory_for(&self, channel: &ChannelId, held: Duration) -> bool {
        self.channels.active_since(channel).is_some_and(|since| since + held <= self.now)
    }

    /// Evicts the least recently used replica `evictable` accepts among those that have been in memory
    /// for `held` at least; which one, if any.
    pub(super) fn evict_least_recent(
        &mut self,
        held: Duration,
        evictable: impl Fn(&ChannelMachine) -> bool,
    ) -> Option<ChannelId> {
        let victim = self
            .channels
            .iter()
            .filter(|(c, m)| evictable(m) && self.in_memory_for(c, held))
            .min_by_key(|(c, _)| (self.channels.last_used(c).unwrap_or(Time::ZERO), (*c).clone()))
            .map(|(c, _)| c.clone())?;
        self.evict(&victim);
        Some(victim)
    }
}

#[cfg(test)]
mod tests {
    use super::super::activation::{ROOM_PATIENCE, ROOM_QUEUE_MIN};
    use super::super::testing::*;
    use super::super::{ShardInput, ShardOutput};
    use super::*;
    use crate::node::config::NodeConfig;
    use crate::node::core::{ApiId, ApiResult, NodeEffect};
    use std::sync::Arc;
    use tidings_channel::machine::{AppendRecord, RoleKind};
    use tidings_store::message::{LogBatch, LogOp, MemoryLog};
    use tidings_types::{ChannelId, LeaderEpoch, NodeId, Seq, Time};

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

    /// The messages `outputs` hand to fanout for `channel`, each with whether it is planned again, by
    /// seq (`answer_persists` does not keep the outputs' order).
    fn handed_to_fanout(outputs: &[ShardOutput], channel: &ChannelId) -> Vec<(Seq, bool)> {
        let mut handed: Vec<(Seq, bool)> = outputs
            .iter()
            .filter_map(|o| match o {
                ShardOutput::Committed { channel: c, seq, again, .. } if c == channel => Some((*seq, *again)),
                _ => None,
            })
            .collect();
        handed.sort();
        handed
    }

    /// Two leaders whose only work left is their fanout fill a shard of two places, and a third leader
    /// comes: it takes the place of the one that has held its place a turn and checkpointed fanout
    /// progress of its own. That one's fanout stops (handed over), it is filed to come back, and its
    /// next incarnation plans again every message past the checkpointed progress. Kept in memory, such
    /// leaders refused the third its place for the whole healed phase (sim seed 660003161).
    #[test]
    fn a_leader_only_fanning_out_leaves_its_place_to_a_refused_leader_and_hands_its_fanout_on() {
        let (mut shard, log, fanning) = two_leaders_fanning_out();
        // `fan-a` sees message 2 through; `fan-b` nothing. A turn on, their checkpoints are written.
        finish_fanout_of(&mut shard, &log, &fanning[0], 2);
        write_checkpoints_a_turn_on(&mut shard, &log);
        let stored = |channel: &ChannelId| tidings_store::message::MessageLog::state(&*log, channel).unwrap();
        assert_eq!((stored(&fanning[0]).hw, stored(&fanning[0]).fanned_through), (Seq::new(5), Seq::new(2)));
        assert_eq!((stored(&fanning[1]).hw, stored(&fanning[1]).fanned_through), (Seq::new(5), Seq::new(1)));
        for channel in &fanning {
            assert!(shard.channels.get(channel).is_some_and(|m| m.leads_only_fanning_out()));
        }
        assert_eq!(shard.leaders_holding_share(), 0);

        let refused = returning_leader(&mut shard, &log, "refused");
        shard.activate(&refused);
        let outputs = carry_out_loads_and_floors(&mut shard, &log);
        assert!(shard.channels.contains(&refused), "placed");
        assert_handed_over(&shard, &outputs, &fanning);

        // Back, its next incarnation plans again the messages past its checkpointed progress.
        shard.evict(&refused);
        shard.activate(&fanning[0]);
        let outputs = carry_out_loads_and_floors(&mut shard, &log);
        let outputs = answer_persists(&mut shard, &log, outputs);
        assert!(shard.channels.contains(&fanning[0]));
        let again = [3, 4].map(|seq| (Seq::new(seq), true)).to_vec();
        assert_eq!(handed_to_fanout(&outputs, &fanning[0]), again);
    }

    /// An activation finding no room while a leader only fanning out has seen a message of its own
    /// through, not yet checkpointed, has that checkpoint written at once and takes the leader's place
    /// when it lands. Left to fall due, the checkpoint came up to ~1.1 s later.
    #[test]
    fn an_activation_short_of_room_hurries_a_fanning_out_leaders_progress_checkpoint() {
        let (mut shard, log, fanning) = two_leaders_fanning_out();
        write_checkpoints_a_turn_on(&mut shard, &log);
        finish_fanout_of(&mut shard, &log, &fanning[1], 2);

        let waiting = returning_leader(&mut shard, &log, "waiting");
        shard.activate(&waiting);
        let outputs = carry_out_loads_and_floors(&mut shard, &log);
        assert!(!shard.channels.contains(&waiting));
        assert_eq!(shard.hurried_for.get(&fanning[1]), Some(&waiting), "the one with progress is hurried");
        let outputs = answer_persists(&mut shard, &log, outputs);
        assert!(shard.channels.contains(&waiting), "placed once the checkpoint landed");
        assert_handed_over(&shard, &outputs, &[fanning[1].clone(), fanning[0].clone()]);
    }

    /// An activation waiting in the room queue takes the place of a leader only fanning out as soon as
    /// that leader may leave, not at the next eviction scan (up to a second later): whether its fanout
    /// progress comes once it held its place a turn (its checkpoint is hurried for the activation) or
    /// before (the checkpoint lands when due, and the place is handed on then).
    #[test]
    fn an_activation_waiting_for_room_takes_a_fanning_out_leaders_place_once_it_may_leave() {
        for progress_before_the_turn in [false, true] {
            let (mut shard, log, fanning) = two_leaders_fanning_out();
            // No scan places anything here: only the drains hand places on.
            shard.next_evict_scan = shard.now + Duration::from_secs(3_600);
            if progress_before_the_turn {
                finish_fanout_of(&mut shard, &log, &fanning[0], 2);
            } else {
                write_checkpoints_a_turn_on(&mut shard, &log);
            }
            let waiting = returning_leader(&mut shard, &log, "waiting");
            shard.activate(&waiting);
            carry_out_loads_and_floors(&mut shard, &log);
            assert!(shard.is_queued_for_room(&waiting), "neither leader may leave yet");

            let outputs = if progress_before_the_turn {
                write_checkpoints_a_turn_on(&mut shard, &log)
            } else {
                finish_fanout_of(&mut shard, &log, &fanning[0], 2)
            };
            assert!(shard.channels.contains(&waiting), "placed (progress before the turn: {progress_before_the_turn})");
            assert_handed_over(&shard, &outputs, &fanning);
        }
    }

    /// A leader coming back only to fan out (resuming its leadership with every record committed and
    /// fanout unfinished, no call waiting on it) takes a free place where busy leaders fill the
    /// leaders' share, and no busy leader is asked to leave for it: once active it holds no place of
    /// that share. Waiting for room, it takes the place another leader only fanning out leaves, which a
    /// leader of the share may not. One with an append waiting keeps to the share.
    #[test]
    fn a_leader_coming_back_only_to_fan_out_does_not_keep_to_the_leaders_share() {
        let (mut shard, log, _busy, _unanswered) = a_shard_whose_leaders_share_busy_leaders_hold();
        let [with_append, fanning, fanning_later] = ["with-append", "fanning", "fanning-later"].map(|name| {
            let channel = known(&mut shard, name, 1);
            let checkpoints = vec![LogOp::CheckpointHw(Seq::new(4)), LogOp::CheckpointFanned(Seq::new(1))];
            store_epoch(&log, &channel, 2, 4, checkpoints);
            shard.resumable.insert(channel.clone(), LeaderEpoch::new(2));
            channel
        });
        // The busy leaders have held their places a turn: one may be asked to leave.
        let turn_over = shard.now + LEADER_TURN;
        shard.advance(turn_over);
        shard.activate(&fanning);
        let outputs = carry_out_loads_and_floors(&mut shard, &log);
        let outputs = answer_persists(&mut shard, &log, outputs);
        assert!(shard.channels.contains(&fanning), "placed in the free place");
        assert_eq!(shard.counters.leaders_asked_to_leave, 0, "no busy leader asked to leave for it");
        let again = [2, 3, 4].map(|seq| (Seq::new(seq), true)).to_vec();
        assert_eq!(handed_to_fanout(&outputs, &fanning), again);
        assert!(shard.channels.get(&fanning).is_some_and(|m| m.leads_only_fanning_out()));

        let records = vec![AppendRecord { idempotency_key: None, payload: bytes::Bytes::from_static(b"m") }];
        let append = ShardInput::Append { api: ApiId(8), channel: with_append.clone(), sender: None, records };
        shard.handle(shard.now, append);
        carry_out_loads_and_floors(&mut shard, &log);
        assert!(!shard.channels.contains(&with_append) && shard.is_queued_for_room(&with_append));
        assert_eq!(shard.counters.leaders_asked_to_leave, 1, "a busy leader is asked to leave for this one");

        // With no place free it waits; a turn on, `fanning` sees message 2 through, and its place goes
        // to the one that waits (its progress checkpoint hurried), not to the leader with an append.
        shard.activate(&fanning_later);
        carry_out_loads_and_floors(&mut shard, &log);
        assert!(shard.is_queued_for_room(&fanning_later));
        let turn_over = shard.now + LEADER_TURN;
        shard.advance(turn_over);
        finish_fanout_of(&mut shard, &log, &fanning, 2);
        assert!(shard.channels.contains(&fanning_later) && !shard.channels.contains(&fanning));
        assert!(shard.is_queued_for_room(&with_append));
    }

    /// Two leaders (`fan-a`, `fan-b`) filling a shard of two places, each resuming a leadership whose
    /// three messages (2 to 4) are committed and known fanned out through the barrier only: their new
    /// incarnations plan the three again, and fanout answers none of them yet. Their HW checkpoints are
    /// not written yet.
    fn two_leaders_fanning_out() -> (ChannelShard, Arc<MemoryLog>, Vec<ChannelId>) {
        let mut config = NodeConfig { active_channels_max: 2, ..NodeConfig::new(ME, vec![ME, NodeId::new(2)]) };
        config.fanout_enabled = true;
        let (mut shard, log) = shard_over_memory_log(config);
        let fanning = ["fan-a", "fan-b"]
            .into_iter()
            .map(|name| {
                let channel = known(&mut shard, name, 1);
                let checkpoints = vec![LogOp::CheckpointHw(Seq::new(4)), LogOp::CheckpointFanned(Seq::new(1))];
                store_epoch(&log, &channel, 1, 4, checkpoints);
                shard.activate(&channel);
                let outputs = carry_out_loads_and_floors(&mut shard, &log);
                let outputs = answer_persists(&mut shard, &log, outputs);
                let again = [2, 3, 4].map(|seq| (Seq::new(seq), true)).to_vec();
                assert_eq!(handed_to_fanout(&outputs, &channel), again);
                channel
            })
            .collect();
        (shard, log, fanning)
    }

    /// Fanout tells the shard it finished `channel`'s messages through `seq`; the durable writes that
    /// brings land. Returns the other outputs.
    fn finish_fanout_of(shard: &mut ChannelShard, log: &MemoryLog, channel: &ChannelId, seq: u64) -> Vec<ShardOutput> {
        shard.handle(shard.now, ShardInput::FanoutFinished { channel: channel.clone(), seq: Seq::new(seq) });
        let outputs = carry_out_loads_and_floors(shard, log);
        answer_persists(shard, log, outputs)
    }

    /// Two leader turns on, the checkpoints due by then are written; returns the other outputs.
    fn write_checkpoints_a_turn_on(shard: &mut ChannelShard, log: &MemoryLog) -> Vec<ShardOutput> {
        shard.handle_tick(shard.now + LEADER_TURN * 2);
        let outputs = carry_out_loads_and_floors(shard, log);
        answer_persists(shard, log, outputs)
    }

    /// Asserts that `fanning[0]` left its place for another, its fanout handed over (among `outputs`)
    /// and filed to come back, while `fanning[1]` keeps its own.
    fn assert_handed_over(shard: &ChannelShard, outputs: &[ShardOutput], fanning: &[ChannelId]) {
        assert!(!shard.channels.contains(&fanning[0]), "in the place of the leader that made progress");
        assert!(shard.channels.contains(&fanning[1]), "one that saw no message through keeps its place");
        assert!(outputs.iter().any(|o| matches!(o, ShardOutput::FanoutHandedOver(c) if *c == fanning[0])));
        assert!(shard.to_activate.contains_key(&fanning[0]), "filed to come back");
        assert_eq!(shard.status(None, 0).leaderships_to_start, 1, "a leadership waiting to start");
        assert_eq!(shard.counters.fanning_out_leaders_evicted, 1);
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
        assert_eq!(shard.counters.stalled_leaders_evicted, 0);
        shard.unfile(&follower);
        shard.room_queue.clear();
        shard.loading.clear();
        // Past it, it takes the stalled leader's place (least recently used of those no caller waits on).
        let turn_over = shard.now + LEADER_TURN;
        shard.advance(turn_over);
        activate_and_settle(&mut shard, &log, &follower);
        assert!(shard.channels.contains(&follower));
        assert!(!shard.channels.contains(&stalled));
        assert_eq!(shard.counters.stalled_leaders_evicted, 1);
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
        assert_eq!(scan(&mut shard, asked_at + super::super::turns::LEAVING_PATIENCE), vec![(ApiId(6), false)]);
        assert!(shard.is_leaving_for_room(&busy[1]), "another is asked");
        // Filed, it is tried again by the same scan: it waits anew, with nothing of the caller's.
        assert!(shard.to_activate.contains_key(&returning));
        assert_eq!(shard.counters.refused_activations, 1);
    }

    /// The room queue holds as many activations as the shard has room for replicas, and never fewer than
    /// `ROOM_QUEUE_MIN`; one more finding no room is refused at once. This shard has three places, so
    /// the minimum is what bounds it. Waiting there, they do not count against the loads: the activation
    /// of another replica still loads (and may find a place a follower can take past the cap).
    #[test]
    fn the_room_queue_is_bounded_by_the_room_or_its_minimum() {
        let (mut shard, log, _busy, _unanswered) = a_shard_whose_leaders_share_busy_leaders_hold();
        assert!(shard.active_max < ROOM_QUEUE_MIN);
        let leaders: Vec<ChannelId> =
            (0..=ROOM_QUEUE_MIN).map(|i| returning_leader(&mut shard, &log, &format!("l{i}"))).collect();
        for leader in &leaders {
            shard.activate(leader);
            carry_out_loads_and_floors(&mut shard, &log);
        }
        let queued = leaders.iter().filter(|l| shard.is_queued_for_room(l)).count();
        assert_eq!(queued, ROOM_QUEUE_MIN);
        assert!(!shard.is_queued_for_room(&leaders[ROOM_QUEUE_MIN]), "the last one finds the queue full");
        let counted = ROOM_QUEUE_MIN as u64;
        assert_eq!((shard.counters.activations_queued_for_room, shard.counters.refused_activations), (counted, 1));
        assert!(shard.to_activate.contains_key(&leaders[ROOM_QUEUE_MIN]));

        let follower = known(&mut shard, "follower", 2);
        shard.activate(&follower);
        carry_out_loads_and_floors(&mut shard, &log);
        assert!(shard.channels.contains(&follower), "the followers' place is free");
    }
}
