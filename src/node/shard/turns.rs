//! Busy leaders' turns at the leaders' share of a shard's room: a leader refused room has the one that
//! held its place longest asked to leave (it takes no new append, settles and is evicted), its place
//! going to the leader it left for. What may leave for room, and the leaders' share itself, are in
//! `room`.

use super::room::LEADER_TURN;
use super::ChannelShard;
use std::time::Duration;
use tidings_channel::machine::RoleKind;
use tidings_types::{ChannelId, Time};

/// How long a leader asked to leave refuses new appends: long enough for its followers to acknowledge
/// what it has (a pull timeout or two when one was silent); should it still not settle, it takes
/// appends again and another may be asked.
pub(super) const LEAVING_PATIENCE: Duration = Duration::from_secs(3);

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
    ///
    /// The leave is for whichever refused leader comes first once the last one is over, not for the
    /// one refused first: that order, tried in session 51, kept a file of the leaders refused and
    /// brought the first one's activation on, and at 48 channels of MinISR 3 on three places a node
    /// eleven channels took no append through a healed phase (sim seed 707000646) where arrival order
    /// left none out; over 7,000 soaks it failed as often as arrival order did.
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
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::super::{ShardInput, ShardOutput};
    use super::*;
    use crate::node::core::{ApiId, ApiResult, NodeEffect};
    use std::sync::Arc;
    use tidings_channel::machine::AppendRecord;
    use tidings_store::message::MemoryLog;

    /// A shard of two places, one of them its one leader's place (`leaders_max`), held by a busy leader:
    /// its barrier's durable write (among the outputs returned) is not answered yet.
    fn one_leader_place_a_busy_leader_holds() -> (ChannelShard, Arc<MemoryLog>, ChannelId, Vec<ShardOutput>) {
        let (mut shard, log) = shard_with_places(2);
        assert_eq!(super::super::activation::leaders_max(2), 1);
        let busy = known(&mut shard, "busy", 1);
        shard.activate(&busy);
        let unanswered = carry_out_loads_and_floors(&mut shard, &log);
        (shard, log, busy, unanswered)
    }

    /// A leader refused room because a busy leader holds the one leader's place has that leader asked
    /// to leave once it held the place for `LEADER_TURN`: it takes no new append meanwhile, settles, and
    /// is evicted at the refused leader's next try. Before, a busy leader kept its place for as long as
    /// appends came (sim seed 545000024).
    #[test]
    fn a_busy_leader_is_asked_to_leave_its_place_for_a_leader_refused_room() {
        let (mut shard, log, busy, unanswered) = one_leader_place_a_busy_leader_holds();
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

    /// The place a busy leader was asked to leave goes to the leader it was asked to leave for, not to
    /// one that waited longer: the one it left for found it taken a scan later, and a shard of one
    /// leader's place turned over three times in 13 s, never to it (sim seed 590000776).
    #[test]
    fn the_place_a_leader_leaves_goes_to_the_leader_it_left_for() {
        let (mut shard, log, busy, unanswered) = one_leader_place_a_busy_leader_holds();
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
}
