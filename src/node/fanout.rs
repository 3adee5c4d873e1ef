//! The host side of post-commit fanout: the [`FanoutHost`] trait, and carrying out fanout work
//! ([`NodeEffect::Fanout`](super::NodeEffect::Fanout)) against the local slot store and the host: the
//! planner's own, and the subscriber pages this node reads for a peer whose channel leader keeps no
//! replica of the channel's slot group. One function serves the threaded runtime (on its fanout worker)
//! and anything driving `NodeCore` itself.

use tidings_channel::fanout::{DeliveryPlan, FanoutEffect, JobId, Member};
use tidings_slot::command::MemberList;
use tidings_slot::query::SlotReader;
use tidings_types::{ChannelId, NodeId};

/// The host's side of post-commit fanout: presence (where members are online) and delivery. Called on the
/// node's fanout worker thread, one call at a time; a slow call slows fanout only (never appends), and the
/// planner holds a bounded number of plans meanwhile.
///
/// Delivery is at least once: a channel leader that crashes (or loses its leadership to a crash) before
/// a message's plans were all taken leaves it to its successor, which plans the message again on its
/// own node. A member may so get a message twice; drop the second by `(plan.message.channel,
/// plan.message.seq)`.
pub trait FanoutHost: Send + Sync + 'static {
    /// Where each member is online (`None`: offline). One answer per uid, in order.
    fn locate(&self, uids: &[String]) -> Vec<Option<NodeId>>;
    /// Takes a delivery plan; `false` if it could not be taken now (it is retried, a bounded number of times).
    fn deliver(&self, plan: &DeliveryPlan) -> bool;
    /// A plan failed after every attempt. The message stays committed.
    fn delivery_failed(&self, plan: &DeliveryPlan) {
        let _ = plan;
    }
}

/// A host without online sessions: every member is offline, nothing is delivered.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoFanout;

impl FanoutHost for NoFanout {
    fn locate(&self, uids: &[String]) -> Vec<Option<NodeId>> {
        vec![None; uids.len()]
    }

    fn deliver(&self, _plan: &DeliveryPlan) -> bool {
        true
    }
}

/// Fanout work for the runtime, carried out off the core thread by [`carry_out_fanout`].
#[derive(Clone, Debug, PartialEq)]
pub enum FanoutWork {
    /// The planner's work for a message this node fans out (`FetchPage`, `Locate`, `Deliver`, `Failed`;
    /// never `Finished`, which the core handles).
    Planner(FanoutEffect),
    /// A page of `channel`'s subscribers for peer `to`, read from this node's slot replica.
    PeerPage {
        /// The asking node.
        to: NodeId,
        /// Its request id.
        request: u64,
        /// The channel.
        channel: ChannelId,
        /// Where the page starts.
        cursor: Option<Vec<u8>>,
        /// Subscribers at most.
        limit: usize,
    },
}

/// What carrying out fanout work produced, for [`NodeCore::handle_fanout`](super::NodeCore::handle_fanout).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FanoutAnswer {
    /// A page of subscribers (`next`: where the following page starts, `None` at the end).
    Page {
        /// The fanout job.
        job: JobId,
        /// The members of the page.
        members: Vec<Member>,
        /// Cursor of the next page.
        next: Option<Vec<u8>>,
    },
    /// Where each member asked about is online (`targets[i]` for the i-th uid).
    Located {
        /// The fanout job.
        job: JobId,
        /// One answer per uid.
        targets: Vec<Option<NodeId>>,
    },
    /// The host took a plan, or refused it for now.
    Delivered {
        /// The plan.
        plan: u64,
        /// Taken.
        delivered: bool,
    },
    /// A page read for a peer ([`FanoutWork::PeerPage`]), to send it.
    PeerPage {
        /// The asking node.
        to: NodeId,
        /// Its request id.
        request: u64,
        /// The members of the page.
        members: Vec<Member>,
        /// Cursor of the next page.
        next: Option<Vec<u8>>,
    },
}

/// Carries out one piece of fanout work: reads a subscriber page from `reader`, or calls `host`. Returns
/// the answer for the core, `None` for a report that needs none (a failed plan).
pub fn carry_out_fanout(reader: &SlotReader, host: &dyn FanoutHost, work: FanoutWork) -> Option<FanoutAnswer> {
    let work = match work {
        FanoutWork::Planner(work) => work,
        FanoutWork::PeerPage { to, request, channel, cursor, limit } => {
            let (members, next) = subscriber_page(reader, &channel, cursor.as_deref(), limit);
            return Some(FanoutAnswer::PeerPage { to, request, members, next });
        }
    };
    match work {
        FanoutEffect::FetchPage { job, channel, cursor, limit } => {
            let (members, next) = subscriber_page(reader, &channel, cursor.as_deref(), limit);
            Some(FanoutAnswer::Page { job, members, next })
        }
        FanoutEffect::Locate { job, uids } => Some(FanoutAnswer::Located { job, targets: host.locate(&uids) }),
        FanoutEffect::Deliver(plan) => Some(FanoutAnswer::Delivered { plan: plan.id, delivered: host.deliver(&plan) }),
        FanoutEffect::Failed(plan) => {
            host.delivery_failed(&plan);
            None
        }
        // The core handles job completion itself; it never hands it out.
        FanoutEffect::Finished { .. } => None,
    }
}

/// A page of `channel`'s subscribers with the state fanout needs (left, hidden, denied), read from the
/// local slot store.
pub fn subscriber_page(
    reader: &SlotReader,
    channel: &ChannelId,
    cursor: Option<&[u8]>,
    limit: usize,
) -> (Vec<Member>, Option<Vec<u8>>) {
    let Ok(page) = reader.members(channel, MemberList::Subscribers, cursor, limit) else { return (Vec::new(), None) };
    let members = page
        .items
        .into_iter()
        .map(|uid| {
            let denied = reader.is_member(channel, MemberList::Deny, &uid).unwrap_or(false);
            let membership = reader.membership(&uid, channel).ok().flatten();
            Member {
                uid: uid.as_str().to_owned(),
                left: membership.is_some_and(|m| !m.active),
                hidden: membership.is_some_and(|m| m.hidden),
                denied,
            }
        })
        .collect();
    (members, page.cursor)
}
