//! The unanswered pulls of evicted followers, kept for their next incarnations: bounded, each gone a
//! pull timeout after it was sent, and forgotten at once when its answer reaches no replica.

use super::ChannelShard;
use tidings_channel::machine::{ChannelMessage, PullBody, PullInFlight};
use tidings_types::ChannelId;

/// Fewest kept pulls of evicted followers a shard holds (`ChannelShard::keep_pull_in_flight`; the bound
/// is its room, at least this). Bounded by the room alone, a shard of a few places forgot a follower's
/// kept pull after a few more evictions: with more followers than places, each evicted while its pull
/// waited, every answer came to an incarnation that had sent a new pull, and was ignored — learners
/// of a draining node never caught up (sim seed 560000612: two places, seven learners). Each kept pull
/// goes a pull timeout after it was sent anyway (`expire_kept_pulls`), so this costs memory only while
/// followers churn: ~130 B an entry.
pub(super) const KEPT_PULLS_MIN: usize = 1024;

impl ChannelShard {
    /// Keeps an evicted follower's unanswered pull for its next incarnation (bounded: the oldest go).
    pub(super) fn keep_pull_in_flight(&mut self, channel: &ChannelId, pull: PullInFlight) {
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
}

#[cfg(test)]
mod tests {
    use super::super::activation::ROOM_QUEUE_MIN;
    use super::super::testing::*;
    use super::*;
    use crate::node::config::NodeConfig;
    use tidings_channel::machine::{ChannelMessage, PullBody, PullResponse};
    use tidings_store::message::MemoryLog;
    use tidings_types::{ChannelId, LeaderEpoch, NodeId, Seq, Time};

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
        // as many activations as the room queue holds wait for room.
        let queued = (0..ROOM_QUEUE_MIN).map(|i| format!("queued-{i}"));
        for name in ["holder-a".to_string(), "holder-b".to_string()].into_iter().chain(queued) {
            let other = known(&mut shard, &name, 2);
            shard.activate(&other);
            carry_out_loads_and_floors(&mut shard, &log);
        }
        assert_eq!((shard.channels.len(), shard.room_queue.len()), (2, ROOM_QUEUE_MIN));

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
}
