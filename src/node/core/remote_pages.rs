//! Subscriber pages across nodes, for fanout. A channel's leader need not keep a replica of the slot
//! group that holds the channel's subscribers (with more nodes than slot replicas, most do not): it asks
//! a node that does for each page, and serves its peers the same way.
//!
//! Asking: the group's known leader first, then the other nodes in turn; each attempt has a request id
//! of its own, so a late answer to an abandoned attempt is ignored. A node that keeps no replica of the
//! group says so and the next node is asked at once; a busy one is asked again after a pause; a silent
//! one is passed over after [`PAGE_REPLY_TIMEOUT`]. A page nobody served within [`PAGE_GIVE_UP`] ends
//! that message's fanout where it stands (counted in `NodeStatus::fanout_pages_abandoned`): the message
//! stays committed, and the channel's fanout handoff is not held forever by a slot group that is gone.
//!
//! Serving: a node reads at most [`PEER_PAGES_SERVING_MAX`] pages for its peers at a time (off the
//! core thread, on the fanout worker) and answers `Busy` beyond that, so peers cannot queue unbounded
//! reads on it.

use std::collections::BTreeMap;
use std::time::Duration;
use tidings_channel::fanout::JobId;
use tidings_types::{ChannelId, NodeId, Time};

/// How long an asked node may take to answer before the next one is asked.
pub(super) const PAGE_REPLY_TIMEOUT: Duration = Duration::from_secs(2);
/// The pause before asking a busy node again.
pub(super) const PAGE_BUSY_PAUSE: Duration = Duration::from_millis(200);
/// How long one page is asked for before its message's fanout is given up.
pub(super) const PAGE_GIVE_UP: Duration = Duration::from_secs(30);
/// Pages this node reads for its peers at once.
pub(super) const PEER_PAGES_SERVING_MAX: usize = 16;

/// One page asked of another node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct PageAsk {
    /// The fanout job the page is for.
    pub job: JobId,
    /// The channel.
    pub channel: ChannelId,
    /// Where the page starts.
    pub cursor: Option<Vec<u8>>,
    /// Subscribers wanted.
    pub limit: usize,
    /// Nodes asked so far (the next one is chosen by it).
    pub attempts: u32,
    /// When the first node was asked (for [`PAGE_GIVE_UP`]).
    pub since: Time,
}

/// The node asked, and when to act if it does not answer.
#[derive(Debug)]
struct Outstanding {
    ask: PageAsk,
    to: NodeId,
    /// Past it: a silent node is passed over, a busy one asked again.
    due: Time,
    /// The node said it was busy: at `due` it is asked again, not passed over.
    busy: bool,
}

/// What to do about a page whose request timed out or was refused.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum PageNext {
    /// Ask a node (the next, or the same busy one) again.
    Ask(PageAsk, Option<NodeId>),
    /// Nobody served it in time: end the job's fanout.
    GiveUp(PageAsk),
}

/// Pages this node asked of others, and how many it is serving its peers.
#[derive(Debug, Default)]
pub(super) struct RemotePages {
    next_request: u64,
    outstanding: BTreeMap<u64, Outstanding>,
    serving: usize,
    abandoned: u64,
}

impl RemotePages {
    /// Records that `ask` goes to `to` now: returns the request id to send.
    pub(super) fn asked(&mut self, ask: PageAsk, to: NodeId, now: Time) -> u64 {
        self.next_request += 1;
        self.outstanding.insert(self.next_request, Outstanding { ask, to, due: now + PAGE_REPLY_TIMEOUT, busy: false });
        self.next_request
    }

    /// An answer from `from` to `request`: the ask it settles, unless it is not the current attempt.
    pub(super) fn answered(&mut self, request: u64, from: NodeId) -> Option<PageAsk> {
        if self.outstanding.get(&request).is_none_or(|o| o.to != from) {
            return None;
        }
        self.outstanding.remove(&request).map(|o| o.ask)
    }

    /// `from` is busy: ask it again after [`PAGE_BUSY_PAUSE`].
    pub(super) fn busy(&mut self, request: u64, from: NodeId, now: Time) {
        if let Some(o) = self.outstanding.get_mut(&request).filter(|o| o.to == from) {
            o.due = now + PAGE_BUSY_PAUSE;
            o.busy = true;
        }
    }

    /// The ask following one that was refused or timed out: to the next node (`None`: the caller picks
    /// it), or given up once [`PAGE_GIVE_UP`] has passed since the first attempt.
    pub(super) fn next_attempt(&mut self, mut ask: PageAsk, again: Option<NodeId>, now: Time) -> PageNext {
        if now >= ask.since + PAGE_GIVE_UP {
            self.abandoned += 1;
            return PageNext::GiveUp(ask);
        }
        if again.is_none() {
            ask.attempts += 1;
        }
        PageNext::Ask(ask, again)
    }

    /// Requests past their due time, taken out: each to be asked again (the same node if it was busy).
    pub(super) fn take_due(&mut self, now: Time) -> Vec<(PageAsk, Option<NodeId>)> {
        let due: Vec<u64> = self.outstanding.iter().filter(|(_, o)| o.due <= now).map(|(id, _)| *id).collect();
        due.into_iter()
            .filter_map(|id| self.outstanding.remove(&id))
            .map(|o| {
                let again = o.busy.then_some(o.to);
                (o.ask, again)
            })
            .collect()
    }

    /// When the earliest outstanding request is due.
    pub(super) fn poll_timeout(&self) -> Option<Time> {
        self.outstanding.values().map(|o| o.due).min()
    }

    /// Takes one serving place for a peer's page; `false` when all are taken.
    pub(super) fn start_serving(&mut self) -> bool {
        let free = self.serving < PEER_PAGES_SERVING_MAX;
        self.serving += usize::from(free);
        free
    }

    /// A page read for a peer is on its way: its place is free.
    pub(super) fn served(&mut self) {
        self.serving = self.serving.saturating_sub(1);
    }

    /// Pages given up after [`PAGE_GIVE_UP`] since this core started.
    pub(super) fn abandoned(&self) -> u64 {
        self.abandoned
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tidings_types::ChannelType;

    fn ask(since_ms: u64) -> PageAsk {
        let channel = ChannelId::new(ChannelType::GROUP, "g").unwrap();
        PageAsk { job: JobId(1), channel, cursor: None, limit: 10, attempts: 0, since: Time::from_millis(since_ms) }
    }

    #[test]
    fn only_the_asked_node_s_answer_to_the_current_attempt_settles_a_page() {
        let mut pages = RemotePages::default();
        let (a, b) = (NodeId::new(2), NodeId::new(3));
        let first = pages.asked(ask(0), a, Time::ZERO);
        assert_eq!(pages.answered(first, b), None, "an answer from a node not asked");
        // Timed out: taken out, then asked of b under a new id; a's late answer is ignored.
        let due = pages.take_due(Time::ZERO + PAGE_REPLY_TIMEOUT);
        assert_eq!(due.len(), 1);
        let second = pages.asked(due[0].0.clone(), b, Time::ZERO + PAGE_REPLY_TIMEOUT);
        assert_ne!(first, second);
        assert_eq!(pages.answered(first, a), None, "a late answer to an abandoned attempt");
        assert_eq!(pages.answered(second, b).map(|a| a.job), Some(JobId(1)));
        assert_eq!(pages.answered(second, b), None, "settled once");
        assert_eq!(pages.poll_timeout(), None);
    }

    #[test]
    fn a_busy_node_is_asked_again_after_a_pause_and_a_page_is_given_up_after_the_deadline() {
        let mut pages = RemotePages::default();
        let a = NodeId::new(2);
        let id = pages.asked(ask(0), a, Time::ZERO);
        pages.busy(id, a, Time::from_millis(10));
        assert_eq!(pages.poll_timeout(), Some(Time::from_millis(10) + PAGE_BUSY_PAUSE));
        assert!(pages.take_due(Time::from_millis(100)).is_empty());
        let due = pages.take_due(Time::from_millis(10) + PAGE_BUSY_PAUSE);
        assert_eq!(due.len(), 1);
        assert_eq!(due[0].1, Some(a), "the busy node, again");
        let (again, to) = due.into_iter().next().unwrap();
        assert!(
            matches!(pages.next_attempt(again.clone(), to, Time::from_millis(300)), PageNext::Ask(p, Some(n)) if p.attempts == 0 && n == a)
        );
        assert!(
            matches!(pages.next_attempt(again.clone(), None, Time::from_millis(300)), PageNext::Ask(p, None) if p.attempts == 1)
        );
        assert_eq!(pages.abandoned(), 0);
        assert!(matches!(pages.next_attempt(again, None, Time::ZERO + PAGE_GIVE_UP), PageNext::GiveUp(_)));
        assert_eq!(pages.abandoned(), 1);
    }

    #[test]
    fn serving_places_are_bounded_and_freed() {
        let mut pages = RemotePages::default();
        for _ in 0..PEER_PAGES_SERVING_MAX {
            assert!(pages.start_serving());
        }
        assert!(!pages.start_serving(), "one more than allowed");
        pages.served();
        assert!(pages.start_serving());
    }
}
