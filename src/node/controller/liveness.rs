//! Which peers this node has heard from recently. Every valid frame counts; idle peers ping.

use std::collections::BTreeMap;
use std::time::Duration;
use tidings_types::{NodeId, Time};

/// Last time each peer was heard from.
#[derive(Debug)]
pub(crate) struct Liveness {
    last_heard: BTreeMap<NodeId, Time>,
    down_after: Duration,
}

impl Liveness {
    /// Every peer counts as heard at `now`: a node that just started suspects nobody before
    /// `down_after` has passed.
    pub(crate) fn new(peers: impl IntoIterator<Item = NodeId>, down_after: Duration, now: Time) -> Self {
        Self { last_heard: peers.into_iter().map(|n| (n, now)).collect(), down_after }
    }

    /// A frame arrived from `peer`.
    pub(crate) fn heard(&mut self, peer: NodeId, now: Time) {
        if let Some(last) = self.last_heard.get_mut(&peer) {
            *last = (*last).max(now);
        }
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
}
