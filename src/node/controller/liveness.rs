//! Which peers this node has heard from recently, and which said they are about to stop. Every valid
//! frame counts; idle peers ping, and a node handing off its leaderships pings `Leaving` instead.

use std::collections::BTreeMap;
use std::time::Duration;
use tidings_types::{NodeId, Time};

/// Last time each peer was heard from, and since when it has been up without a gap.
#[derive(Debug)]
pub(crate) struct Liveness {
    last_heard: BTreeMap<NodeId, Time>,
    /// When each peer was last heard after a silence of `down_after` or more (or when this node started).
    up_since: BTreeMap<NodeId, Time>,
    /// When each peer last said it is leaving (see `NodeCore::set_leaving`).
    leaving_said: BTreeMap<NodeId, Time>,
    down_after: Duration,
}

impl Liveness {
    /// Every peer counts as heard at `now`: a node that just started suspects nobody before
    /// `down_after` has passed.
    pub(crate) fn new(peers: impl IntoIterator<Item = NodeId>, down_after: Duration, now: Time) -> Self {
        let last_heard: BTreeMap<NodeId, Time> = peers.into_iter().map(|n| (n, now)).collect();
        Self { up_since: last_heard.clone(), last_heard, leaving_said: BTreeMap::new(), down_after }
    }

    /// `peer` said it is leaving: it hands off its leaderships before it stops.
    /// `true` if it was not known to be leaving before.
    pub(crate) fn heard_leaving(&mut self, peer: NodeId, now: Time) -> bool {
        if !self.last_heard.contains_key(&peer) {
            return false;
        }
        let new = !self.is_leaving(peer, now);
        self.leaving_said.insert(peer, now);
        new
    }

    /// `true` while `peer` keeps saying it is leaving: the mark lapses `down_after` after the last time
    /// it said so. Soft state on purpose: a node that restarts (or changes its mind) clears it by
    /// saying nothing, and one that stops is down by then anyway.
    pub(crate) fn is_leaving(&self, peer: NodeId, now: Time) -> bool {
        self.leaving_said.get(&peer).is_some_and(|said| now.since(*said) < self.down_after)
    }

    /// The peers currently leaving.
    pub(crate) fn leaving(&self, now: Time) -> impl Iterator<Item = NodeId> + '_ {
        self.leaving_said.keys().copied().filter(move |peer| self.is_leaving(*peer, now))
    }

    /// A frame arrived from `peer`.
    pub(crate) fn heard(&mut self, peer: NodeId, now: Time) {
        if let Some(last) = self.last_heard.get_mut(&peer) {
            if now.since(*last) >= self.down_after {
                // Back after a silence long enough to count as down: its uptime starts again.
                self.up_since.insert(peer, now);
            }
            *last = (*last).max(now);
        }
    }

    /// How long `peer` has been up without a silence of `down_after`; `None` while it is down or for a
    /// node that is not a known peer.
    pub(crate) fn up_for(&self, peer: NodeId, now: Time) -> Option<Duration> {
        if self.is_down(peer, now) {
            return None;
        }
        self.up_since.get(&peer).map(|since| now.since(*since))
    }

    /// `true` if `peer` is a known peer not heard from for `down_after`. Never true for this node or
    /// for a node outside the configuration (nothing to fail over from).
    pub(crate) fn is_down(&self, peer: NodeId, now: Time) -> bool {
        self.last_heard.get(&peer).is_some_and(|last| now.since(*last) >= self.down_after)
    }

    /// How long `peer` has been silent, if it is a known peer.
    pub(crate) fn silent_for(&self, peer: NodeId, now: Time) -> Option<Duration> {
        self.last_heard.get(&peer).map(|last| now.since(*last))
    }

    /// The peers currently down.
    pub(crate) fn down(&self, now: Time) -> impl Iterator<Item = NodeId> + '_ {
        self.last_heard.keys().copied().filter(move |peer| self.is_down(*peer, now))
    }

    /// Every peer.
    pub(crate) fn peers(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.last_heard.keys().copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uptime_starts_again_when_a_peer_comes_back_from_being_down() {
        let (a, b) = (NodeId::new(2), NodeId::new(3));
        let mut liveness = Liveness::new([a, b], Duration::from_secs(2), Time::ZERO);
        liveness.heard(a, Time::from_millis(1_000));
        liveness.heard(a, Time::from_millis(2_500));
        assert_eq!(liveness.up_for(a, Time::from_millis(3_000)), Some(Duration::from_secs(3)), "up since the start");
        assert_eq!(liveness.up_for(b, Time::from_millis(2_000)), None, "silent for 2 s: down");
        // Back after 5 s of silence: up for what came since, not since the start.
        liveness.heard(b, Time::from_millis(5_000));
        assert_eq!(liveness.up_for(b, Time::from_millis(5_500)), Some(Duration::from_millis(500)));
        // Short gaps (under the limit) do not restart it.
        liveness.heard(b, Time::from_millis(6_900));
        assert_eq!(liveness.up_for(b, Time::from_millis(7_000)), Some(Duration::from_secs(2)));
        assert_eq!(liveness.up_for(NodeId::new(9), Time::from_millis(7_000)), None, "not a peer");
    }

    #[test]
    fn a_peer_is_down_only_after_the_silence_limit() {
        let (a, b) = (NodeId::new(2), NodeId::new(3));
        let mut liveness = Liveness::new([a, b], Duration::from_secs(2), Time::ZERO);
        assert_eq!(liveness.down(Time::from_millis(1_999)).count(), 0);
        liveness.heard(a, Time::from_millis(1_500));
        assert_eq!(liveness.down(Time::from_millis(2_000)).collect::<Vec<_>>(), vec![b]);
        assert!(!liveness.is_down(a, Time::from_millis(3_499)));
        assert!(liveness.is_down(a, Time::from_millis(3_500)));
        assert!(!liveness.is_down(NodeId::new(9), Time::from_millis(60_000)), "unknown nodes are never down");
    }

    #[test]
    fn a_leaving_mark_lasts_while_it_is_repeated_and_lapses_after_the_silence_limit() {
        let (a, b) = (NodeId::new(2), NodeId::new(3));
        let mut liveness = Liveness::new([a, b], Duration::from_secs(2), Time::ZERO);
        assert!(liveness.heard_leaving(a, Time::from_millis(1_000)), "newly leaving");
        assert!(!liveness.heard_leaving(a, Time::from_millis(2_500)), "said again");
        assert!(liveness.is_leaving(a, Time::from_millis(4_499)));
        assert_eq!(liveness.leaving(Time::from_millis(4_000)).collect::<Vec<_>>(), vec![a]);
        // Not said again (restarted, or changed its mind): the mark lapses.
        assert!(!liveness.is_leaving(a, Time::from_millis(4_500)));
        assert!(liveness.heard_leaving(a, Time::from_millis(9_000)), "leaving again is news");
        assert!(!liveness.is_leaving(b, Time::from_millis(9_000)));
        assert!(!liveness.heard_leaving(NodeId::new(9), Time::from_millis(9_000)), "not a peer");
        assert!(!liveness.is_leaving(NodeId::new(9), Time::from_millis(9_000)));
    }
}
