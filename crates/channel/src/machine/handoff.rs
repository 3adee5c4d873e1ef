//! Post-commit handoff: which committed messages this replica handed to fanout and has not seen finish,
//! which of them hold a handoff slot, and how far fanout is known to have finished.
//!
//! Fanout runs in memory on the leader's node, so a leader that crashes forgets the messages it had not
//! finished fanning out, and the records it admitted but did not see commit are committed by its
//! successor. For fanout to reach every message at least once, a leader reports with each pull answer
//! how far its fanout finished (`PullBody::Records::fanned_through`); a replica that becomes leader fans
//! out again every committed message of an earlier epoch past what it last heard — at most
//! `handoff_slots` of them, the most recent — before its own (see `ChannelMachine::leader_start`).
//! A message may so reach a member twice; a host drops the second by its seq.

use std::collections::VecDeque;
use tidings_types::Seq;

/// One replica's handoff bookkeeping. Survives role changes: fanout goes on after its leader stepped
/// down, and its completions free their slots whatever the role.
///
/// Fanout progress is a seq with 0 for "nothing known": every log starts with a barrier, so a leader
/// that committed anything reports at least 1.
#[derive(Debug, Default)]
pub(super) struct Handoff {
    /// Messages handed to fanout and not finished, ascending by seq; `true` for each holding a slot.
    unfinished: VecDeque<(Seq, bool)>,
    /// Slots held: admitted records not yet committed, and committed ones whose fanout did not finish.
    pub(super) held: usize,
    /// Every message at or below this seq finished fanning out, as far as this incarnation knows: the
    /// checkpoint it started from, what it saw finish itself while it led, or what a leader reported.
    known: Seq,
}

impl Handoff {
    /// Nothing handed off yet, knowing fanout finished through the checkpointed `fanned_through`.
    pub(super) fn knowing(fanned_through: Seq) -> Self {
        Self { known: fanned_through, ..Self::default() }
    }

    /// `seq` went to fanout; `holds_slot` if it was admitted by this replica (its slot is reserved).
    pub(super) fn handed(&mut self, seq: Seq, holds_slot: bool) {
        debug_assert!(self.unfinished.back().is_none_or(|(last, _)| *last < seq), "handed out of order");
        self.unfinished.push_back((seq, holds_slot));
    }

    /// Fanout of `seq` finished (however it ended). Returns `false` for a seq this incarnation did not
    /// hand off (one of an earlier incarnation, or a duplicate report): nothing changes.
    pub(super) fn finished(&mut self, seq: Seq) -> bool {
        let Ok(at) = self.unfinished.binary_search_by_key(&seq, |(s, _)| *s) else { return false };
        let (_, holds_slot) = self.unfinished.remove(at).expect("found above");
        if holds_slot {
            self.held = self.held.saturating_sub(1);
        }
        if self.unfinished.is_empty() {
            // Drained: the buffer goes too (most replicas fan out nothing most of the time).
            self.unfinished = VecDeque::new();
        }
        true
    }

    /// How far fanout finished, given that everything at or below `handed_through` that is due for
    /// fanout was handed off (the leader's reported HW; `None` off the leader).
    pub(super) fn fanned_through(&self, handed_through: Option<Seq>) -> Seq {
        let own = handed_through.map(|through| match self.unfinished.front() {
            Some((first, _)) => through.min(Seq::new(first.get() - 1)),
            None => through,
        });
        own.unwrap_or_default().max(self.known)
    }

    /// What this replica knows of fanout's progress without handing off anything itself: `None` for
    /// nothing.
    pub(super) fn known(&self) -> Option<Seq> {
        (self.known.get() > 0).then_some(self.known)
    }

    /// A leader reported `through`, or this replica stops leading with its own figure.
    pub(super) fn learn(&mut self, through: Seq) {
        self.known = self.known.max(through);
    }

    /// This replica stopped leading: its successor plans again every message it had not seen finish (all
    /// past what it ever reported), so they are no longer its own; their slots are free.
    pub(super) fn hand_over_unfinished(&mut self) {
        let owned = self.unfinished.iter().filter(|(_, holds_slot)| *holds_slot).count();
        self.held = self.held.saturating_sub(owned);
        self.unfinished = VecDeque::new();
    }

    /// Nothing handed off is unfinished.
    pub(super) fn is_idle(&self) -> bool {
        self.unfinished.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seq(n: u64) -> Seq {
        Seq::new(n)
    }

    #[test]
    fn fanout_finished_out_of_order_counts_only_the_unbroken_prefix() {
        let mut handoff = Handoff { held: 2, ..Handoff::default() };
        handoff.handed(seq(3), false);
        handoff.handed(seq(5), true);
        handoff.handed(seq(6), true);
        assert_eq!(handoff.fanned_through(Some(seq(6))), seq(2));
        assert!(handoff.finished(seq(5)));
        assert_eq!(handoff.held, 1, "a slot freed by an own message");
        assert_eq!(handoff.fanned_through(Some(seq(6))), seq(2), "3 still out");
        assert!(handoff.finished(seq(3)));
        assert_eq!(handoff.held, 1, "an inherited message held no slot");
        assert_eq!(handoff.fanned_through(Some(seq(6))), seq(5));
        assert!(!handoff.finished(seq(3)), "a second report changes nothing");
        assert!(handoff.finished(seq(6)));
        assert_eq!((handoff.held, handoff.is_idle()), (0, true));
        assert_eq!(handoff.fanned_through(Some(seq(6))), seq(6));
    }

    #[test]
    fn what_a_leader_reported_stands_until_this_replica_knows_more() {
        let mut handoff = Handoff::knowing(seq(0));
        assert_eq!(handoff.known(), None, "nothing known");
        handoff.learn(seq(10));
        handoff.learn(seq(7));
        assert_eq!(handoff.known(), Some(seq(10)), "never goes back");
        handoff.handed(seq(12), true);
        assert_eq!(handoff.fanned_through(Some(seq(12))), seq(11));
        assert_eq!(handoff.fanned_through(Some(seq(9))), seq(10));
    }

    #[test]
    fn messages_handed_over_to_a_successor_free_their_slots_and_their_late_ends_change_nothing() {
        let mut handoff = Handoff { held: 3, ..Handoff::default() };
        handoff.handed(seq(4), false);
        handoff.handed(seq(5), true);
        handoff.handed(seq(6), true);
        handoff.learn(handoff.fanned_through(Some(seq(6))));
        handoff.hand_over_unfinished();
        assert_eq!((handoff.held, handoff.is_idle()), (1, true), "the slot of a record not committed stays");
        assert!(!handoff.finished(seq(5)), "a plan already out ends later: nothing to change");
        assert_eq!(handoff.known(), Some(seq(3)), "what it reported stays known");
    }
}
