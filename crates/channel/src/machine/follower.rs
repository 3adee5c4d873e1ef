//! The follower's (and learner's) side: pulling from the leader, acknowledging only what is durable,
//! truncating a divergent suffix, following the leader's high watermark.

use super::message::{ChannelMessage, PullBody, PullHint, PullRequest, PullResponse};
use super::{ChannelMachine, MachineConfig, PendingOp, Role};
use tidings_store::message::Record;
use tidings_types::{LeaderEpoch, NodeId, Seq, Time};

/// A pull sent and not yet answered.
#[derive(Debug, Clone, Copy)]
pub(super) struct Outstanding {
    pull_id: u64,
    next_seq: Seq,
    sent_at: Time,
}

/// A follower's pull still unanswered when its replica left memory, for the replica's next incarnation
/// to take the answer of ([`ChannelMachine::pull_in_flight`], [`ChannelMachine::inherit_pull`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PullInFlight {
    pull_id: u64,
    next_seq: Seq,
    last_epoch: LeaderEpoch,
    leader: NodeId,
    leader_epoch: LeaderEpoch,
    sent_at: Time,
}

impl PullInFlight {
    /// When the pull was sent: its follower sends it again a pull timeout later.
    pub fn sent_at(&self) -> Time {
        self.sent_at
    }

    /// The pull's id, which its answer echoes ([`PullResponse::pull_id`]).
    pub fn pull_id(&self) -> u64 {
        self.pull_id
    }
}

/// Follower-only state.
#[derive(Debug)]
pub(super) struct FollowerState {
    leader: NodeId,
    pub(super) outstanding: Option<Outstanding>,
    /// The pull a leader's hint replaced (see `follower_hint`): its answer is still taken while the pull
    /// out asks from the same seq. The hint may come from the very leader incarnation that the replaced
    /// pull woke: two learners whose pulls each activated a leader evicted for room between them, each
    /// activation hinting both, dropped every answer as one to a replaced pull (sim seed 279006691).
    pub(super) replaced: Option<Outstanding>,
    /// Do not pull before this time (idle back-off, or after an error); `None`: pull when settled.
    pub(super) next_pull_at: Option<Time>,
    /// The back-off waits for the meta this replica asked for (`Effect::RefreshMeta`): a newer one ends it.
    awaiting_meta: bool,
    empty_pulls: u32,
    leader_hw: Seq,
}

impl FollowerState {
    /// See [`ChannelMachine::warm`].
    pub(super) fn warm(&self) -> u64 {
        self.leader_hw.get() ^ u64::from(self.empty_pulls)
    }

    pub(super) fn new(leader: NodeId, _now: Time) -> Self {
        Self {
            leader,
            outstanding: None,
            replaced: None,
            next_pull_at: None,
            awaiting_meta: false,
            empty_pulls: 0,
            leader_hw: Seq::new(0),
        }
    }

    pub(super) fn next_timeout(&self, config: &MachineConfig, now: Time) -> Option<Time> {
        let resend = self.outstanding.map(|o| o.sent_at + config.pull_timeout);
        // A back-off that already ended waits for storage to settle, which triggers the pull itself.
        let next = self.next_pull_at.filter(|at| self.outstanding.is_none() && *at > now);
        [resend, next].into_iter().flatten().min()
    }
}

/// The first pull id of a machine incarnation. A leader's answer echoes the pull's id, and a late one
/// must match no pull of a later incarnation of the replica (evicted and loaded again, or its node
/// restarted), nor of a later term as follower of the same incarnation: there it could carry a
/// divergence answer about a log the replica no longer has, and cut records it acknowledged. So ids
/// run on across roles, from a point of their own per incarnation (incarnations differ across a
/// node's restarts, see `ChannelMachine::new`).
pub(super) fn first_pull_id(incarnation: u64) -> u64 {
    tidings_types::DetRng::new(incarnation).next_u64()
}

impl ChannelMachine {
    /// The pull this follower waits an answer for, to hand to its next incarnation when it leaves
    /// memory with everything on disk (what the pull acknowledged is then exactly what the next
    /// incarnation starts from). At the cap on active replicas, where each activation evicts the
    /// follower activated last, the leader's answer came after the eviction and brought the replica
    /// back, whose new incarnation ignored it as another's and pulled anew, to be evicted again: no
    /// follower ever took an answer (sim seed 208000252).
    pub fn pull_in_flight(&self) -> Option<PullInFlight> {
        let (Role::Follower(follower), Some(meta)) = (&self.role, &self.meta) else { return None };
        let pull = follower.outstanding?;
        let durable = &self.log.durable;
        (self.log.settled() && pull.next_seq == durable.last_seq.next()).then_some(PullInFlight {
            pull_id: pull.pull_id,
            next_seq: pull.next_seq,
            last_epoch: durable.last_epoch(),
            leader: follower.leader,
            leader_epoch: meta.leader_epoch,
            sent_at: pull.sent_at,
        })
    }

    /// Takes `pull`, from this replica's previous incarnation, as its own outstanding pull when it
    /// starts following, if it starts where that pull left off: under the same leader and leader
    /// epoch, with the same durable log end and last epoch. Call before the first meta.
    pub fn inherit_pull(&mut self, pull: PullInFlight) {
        self.inherited_pull = Some(pull);
    }

    /// The inherited pull, if it fits this replica as it starts following `leader` in `leader_epoch`.
    pub(super) fn take_inherited_pull(&mut self, leader: NodeId, leader_epoch: LeaderEpoch) -> Option<Outstanding> {
        let pull = self.inherited_pull.take()?;
        let durable = &self.log.durable;
        let fits = pull.leader == leader
            && pull.leader_epoch == leader_epoch
            && pull.next_seq == durable.last_seq.next()
            && pull.last_epoch == durable.last_epoch()
            && self.log.settled();
        fits.then_some(Outstanding { pull_id: pull.pull_id, next_seq: pull.next_seq, sent_at: pull.sent_at })
    }

    fn follower(&mut self) -> Option<&mut FollowerState> {
        match &mut self.role {
            Role::Follower(follower) => Some(follower),
            _ => None,
        }
    }

    /// Sends a pull if none is out, everything received is durable, and no back-off is running.
    pub(super) fn follower_maybe_pull(&mut self) {
        let ack_early = self.config.unsafe_test_switches.ack_before_durable;
        let settled = self.log.settled() || ack_early;
        let now = self.now;
        // The pull acknowledges everything before `next_seq`: only what is durable (unless a test switch
        // breaks that rule on purpose).
        let (next_seq, last_epoch) = if ack_early {
            (self.log.end.next(), self.log.last_epoch())
        } else {
            (self.log.durable.last_seq.next(), self.log.durable.last_epoch())
        };
        let max_bytes = u32::try_from(self.config.pull_bytes_max).unwrap_or(u32::MAX);
        let Some(meta) = &self.meta else { return };
        let (channel, leader_epoch, epoch) = (meta.channel.clone(), meta.leader_epoch, meta.epoch);
        let frozen = meta.replication_frozen();
        let pull_id = self.next_pull_id;
        let Some(follower) = self.follower() else { return };
        if frozen || follower.outstanding.is_some() || !settled || follower.next_pull_at.is_some_and(|at| at > now) {
            return;
        }
        follower.next_pull_at = None;
        follower.outstanding = Some(Outstanding { pull_id, next_seq, sent_at: now });
        let leader = follower.leader;
        self.next_pull_id = self.next_pull_id.wrapping_add(1);
        let request = PullRequest { channel, pull_id, leader_epoch, epoch, next_seq, last_epoch, max_bytes };
        self.send(leader, ChannelMessage::Pull(request));
    }

    pub(super) fn follower_timeout(&mut self) {
        let now = self.now;
        let timeout = self.config.pull_timeout;
        let mut unanswered = false;
        if let Some(follower) = self.follower() {
            if follower.outstanding.is_some_and(|o| o.sent_at + timeout <= now) {
                // Lost request or response: pull again (a late answer is ignored by its id).
                follower.outstanding = None;
                follower.replaced = None;
                unanswered = true;
            }
        }
        if unanswered {
            // A leader drops the pulls of a node its meta does not name, and nothing else tells a
            // replica that it was moved away: learn the meta in force, so that one moved away stops
            // pulling for good, and its log can be forgotten (sim seed 310000170: a replica removed
            // while it was active kept its stale meta and pulled for ever).
            self.effects.push_back(super::Effect::RefreshMeta);
        }
        self.follower_maybe_pull();
    }

    pub(super) fn follower_hint(&mut self, from: NodeId, hint: PullHint) {
        let Some(meta) = &self.meta else { return };
        if hint.leader_epoch > meta.leader_epoch {
            // A leader of a newer epoch wakes us: our meta is stale (its push was lost).
            self.effects.push_back(super::Effect::RefreshMeta);
            return;
        }
        if hint.leader_epoch < meta.leader_epoch {
            // A leader of an older epoch: it missed its successor's meta (it may not even be a replica any
            // more, with no slot replica of its own to tell it). It wakes only ISR members that do not
            // pull from it, at most once per pull timeout, and such a leader may hold the node's place
            // for an active channel forever: tell it the newer epoch, which makes it refresh its meta
            // (sim seed 265002888: a node drained out of a channel stayed its leader at an old epoch and
            // its one place under tight limits kept the channel it did lead from activating). Only an
            // older epoch gets an answer, so two replicas never answer each other's hints.
            let epoch = PullHint { channel: hint.channel, leader_epoch: meta.leader_epoch };
            self.send(from, ChannelMessage::Hint(epoch));
            return;
        }
        let Some(follower) = self.follower() else { return };
        if from != follower.leader {
            return;
        }
        // The leader hints replicas it has no live pull from: a pull of ours still out was lost (sent
        // before the leader's replica was active, say — it drops pulls for a channel it does not run),
        // so send another now instead of at the pull timeout (a late answer is ignored by its id).
        // Seen: first appends after channel creation waiting the whole 2 s pull timeout. The pull out
        // may not be lost, though (it may be what woke the hinting leader): its answer stays welcome.
        follower.replaced = follower.outstanding.take().or(follower.replaced);
        follower.next_pull_at = None;
        follower.empty_pulls = 0;
        self.follower_maybe_pull();
    }

    pub(super) fn follower_response(&mut self, from: NodeId, response: PullResponse) {
        let Some(meta) = &self.meta else { return };
        let leader_epoch = meta.leader_epoch;
        if meta.replication_frozen() {
            // A failover froze replication: take nothing more from the current leader.
            if let Some(follower) = self.follower() {
                follower.outstanding = None;
                follower.replaced = None;
            }
            return;
        }
        if response.leader_epoch > leader_epoch {
            self.effects.push_back(super::Effect::RefreshMeta);
            return;
        }
        let Some(follower) = self.follower() else { return };
        // The answer to the pull out, or to the one a hint replaced while the pull out asks from where it
        // did: nothing was taken since (taking an answer forgets both), so it still fits the log.
        let asks_from = follower.outstanding.map(|o| o.next_seq);
        let expected = follower
            .outstanding
            .filter(|o| o.pull_id == response.pull_id)
            .or_else(|| follower.replaced.filter(|r| r.pull_id == response.pull_id && Some(r.next_seq) == asks_from));
        if from != follower.leader || response.leader_epoch < leader_epoch || expected.is_none() {
            return; // Stale, duplicated or misdirected.
        }
        follower.outstanding = None;
        follower.replaced = None;
        let next_seq = expected.map(|o| o.next_seq).expect("checked above");
        match response.body {
            PullBody::Records { records, hw, fanned_through } => {
                self.handoff.learn(fanned_through);
                self.follower_records(next_seq, records, hw, leader_epoch)
            }
            PullBody::Diverging { epoch, end_seq } => self.follower_diverging(epoch, end_seq),
            PullBody::StartAfter { seq, epoch, hw } => self.follower_start_after(seq, epoch, hw),
            PullBody::StaleEpoch | PullBody::NotLeader => self.follower_back_off(true),
        }
        self.follower_maybe_pull();
    }

    fn follower_records(&mut self, next_seq: Seq, records: Vec<Record>, hw: Seq, leader_epoch: LeaderEpoch) {
        let mut expected = next_seq;
        let mut epoch = self.log.last_epoch();
        for record in &records {
            // The leader never sends a gap, a decreasing epoch, or an epoch newer than its own.
            let next = record.seq.checked_next();
            if record.seq != expected
                || next.is_none()
                || record.leader_epoch < epoch
                || record.leader_epoch > leader_epoch
            {
                self.follower_back_off(false);
                return;
            }
            expected = next.expect("checked above");
            epoch = record.leader_epoch;
        }
        let empty = records.is_empty();
        for record in records {
            self.idempotency.insert(&record);
            self.log.push_record(record);
        }
        let idle_after = self.config.idle_after_empty_pulls;
        let idle_interval = self.config.idle_pull_interval;
        let now = self.now;
        if let Some(follower) = self.follower() {
            follower.leader_hw = follower.leader_hw.max(hw);
            if empty {
                follower.empty_pulls += 1;
                if follower.empty_pulls >= idle_after {
                    follower.next_pull_at = Some(now + idle_interval);
                }
            } else {
                follower.empty_pulls = 0;
            }
        }
        self.follower_update_hw();
    }

    fn follower_diverging(&mut self, epoch: LeaderEpoch, end_seq: Seq) {
        let (_, own_end) = self.log.end_of_epoch(epoch);
        let truncate_to = end_seq.min(own_end);
        if truncate_to < self.log.hw {
            // Committed records cannot diverge: the leader answering is not authoritative. Ask for meta.
            self.follower_back_off(true);
            return;
        }
        if truncate_to < self.log.end {
            self.log.truncate_after(truncate_to);
            self.idempotency.truncate_after(truncate_to);
        }
    }

    fn follower_start_after(&mut self, seq: Seq, epoch: LeaderEpoch, hw: Seq) {
        // A seq with no successor cannot start a log (only a corrupt or hostile answer carries one), and a
        // log holding records past what the leader gave up was not asking from before it: a stale answer.
        if self.log.end > seq || seq.checked_next().is_none() {
            self.follower_back_off(true);
            return;
        }
        // Every record this log still holds is at or below `seq`, which the leader gave up: committed
        // there, and given up on every replica by the retention move. The log gives them up too and
        // starts after `seq` (Kafka's follower does the same below the leader's log start offset): a
        // replica that was away while the retention passed its log end otherwise never caught up, and a
        // replacement waiting for it timed out again and again (sim seed 269000187).
        self.log.end = seq;
        // Everything through `seq` is given up: none of it is for a successor to fan out again, and no
        // retry of it can be recognised any more.
        self.handoff.learn(seq);
        self.idempotency.forget_through(seq);
        self.log.epochs = vec![(epoch, seq)];
        self.log.cache.clear();
        self.log.unpersisted.push_back(PendingOp::StartAfter { seq, epoch });
        if let Some(follower) = self.follower() {
            follower.leader_hw = follower.leader_hw.max(hw);
        }
    }

    fn follower_back_off(&mut self, refresh_meta: bool) {
        if refresh_meta {
            self.effects.push_back(super::Effect::RefreshMeta);
        }
        let at = self.now + self.config.idle_pull_interval;
        if let Some(follower) = self.follower() {
            follower.next_pull_at = Some(at);
            follower.awaiting_meta = refresh_meta;
        }
    }

    /// A newer meta under the same leader: a back-off that waited for it ends (a leader refuses pulls
    /// made under a meta older than the one that added the follower, and the refresh brings it), and the
    /// follower pulls if it may (a fence may have been lifted, or set).
    pub(super) fn follower_meta_changed(&mut self) {
        if let Some(follower) = self.follower() {
            if std::mem::take(&mut follower.awaiting_meta) {
                follower.next_pull_at = None;
            }
        }
        self.follower_maybe_pull();
    }

    /// Follower HW = min(own durable end, leader HW); it never goes back.
    fn follower_update_hw(&mut self) {
        let durable = self.log.consistent_durable_end();
        let Some(follower) = self.follower() else { return };
        let candidate = follower.leader_hw.min(durable);
        if candidate > self.log.hw {
            self.log.hw = candidate;
            self.evict_cache();
        }
    }

    pub(super) fn follower_persisted(&mut self) {
        self.follower_update_hw();
        self.follower_maybe_pull();
    }
}
