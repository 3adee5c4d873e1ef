//! The host side of post-commit fanout: the [`FanoutHost`] trait, and carrying out fanout work
//! ([`NodeEffect::Fanout`](super::NodeEffect::Fanout)) against the local slot store and the host: the
//! planner's own, and the subscriber pages this node reads for a peer whose channel leader keeps no
//! replica of the channel's slot group. One function serves the threaded runtime (on its fanout worker)
//! and anything driving `NodeCore` itself.

use tidings_channel::fanout::{DeliveryPlan, FanoutEffect, JobId, Member};
use tidings_slot::command::MemberList;
use tidings_slot::query::SlotReader;
use tidings_store::StoreResult;
use tidings_types::{ChannelId, NodeId, Time};

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
    /// The planner's work with the host for a message this node fans out (`Locate`, `Deliver`, `Failed`;
    /// never `FetchPage`, which comes as [`FanoutWork::Page`], nor `Finished`, which the core handles).
    Planner(FanoutEffect),
    /// A page of subscribers for one of this node's fanout jobs, read from this node's slot replica.
    Page(PageRead),
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

/// A subscriber page one of this node's fanout jobs reads from this node's slot replica (see
/// [`FanoutWork::Page`]). Opaque: [`carry_out_fanout`] reads it, and a read that fails comes back
/// whole ([`FanoutAnswer::PageUnread`]) so the core asks it again, here or of another node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PageRead {
    pub(crate) job: JobId,
    pub(crate) channel: ChannelId,
    pub(crate) cursor: Option<Vec<u8>>,
    pub(crate) limit: usize,
    /// Nodes asked for the page so far, and when it was first asked: a read that fails here goes on
    /// from them, within the page's patience.
    pub(crate) attempts: u32,
    pub(crate) since: Time,
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
    /// This node's slot store could not read a page for one of its jobs ([`FanoutWork::Page`]): the
    /// core asks for it again.
    PageUnread(PageRead),
    /// A page read for a peer ([`FanoutWork::PeerPage`]), to send it (`None`: this node's store could
    /// not read it, and the peer asks another node).
    PeerPage {
        /// The asking node.
        to: NodeId,
        /// Its request id.
        request: u64,
        /// The members of the page and the cursor of the next one, if it could be read.
        page: Option<(Vec<Member>, Option<Vec<u8>>)>,
    },
}

/// Carries out one piece of fanout work: reads a subscriber page from `reader`, or calls `host`. Returns
/// the answer for the core, `None` for a report that needs none (a failed plan).
pub fn carry_out_fanout(reader: &SlotReader, host: &dyn FanoutHost, work: FanoutWork) -> Option<FanoutAnswer> {
    let work = match work {
        FanoutWork::Planner(work) => work,
        FanoutWork::Page(read) => {
            return Some(match subscriber_page(reader, &read.channel, read.cursor.as_deref(), read.limit) {
                Ok((members, next)) => FanoutAnswer::Page { job: read.job, members, next },
                Err(error) => {
                    tracing::warn!(%error, channel = %read.channel, "fanout: a subscriber page could not be read here");
                    FanoutAnswer::PageUnread(read)
                }
            });
        }
        FanoutWork::PeerPage { to, request, channel, cursor, limit } => {
            let page = subscriber_page(reader, &channel, cursor.as_deref(), limit)
                .map_err(
                    |error| tracing::warn!(%error, %channel, "fanout: a subscriber page for a peer could not be read"),
                )
                .ok();
            return Some(FanoutAnswer::PeerPage { to, request, page });
        }
    };
    match work {
        FanoutEffect::Locate { job, uids } => Some(FanoutAnswer::Located { job, targets: host.locate(&uids) }),
        FanoutEffect::Deliver(plan) => Some(FanoutAnswer::Delivered { plan: plan.id, delivered: host.deliver(&plan) }),
        FanoutEffect::Failed(plan) => {
            host.delivery_failed(&plan);
            None
        }
        // The core reads pages through `FanoutWork::Page` and handles job completion itself; it hands
        // out neither here.
        FanoutEffect::FetchPage { .. } | FanoutEffect::Finished { .. } => None,
    }
}

/// A page of `channel`'s subscribers with the state fanout needs (left, hidden, denied), read from the
/// local slot store, and the cursor of the next page (`None` after the last).
///
/// Any read that fails fails the whole page: a member whose deny entry or membership could not be read
/// is not delivered as though it had none, and a page that could not be listed does not end the
/// message's fanout as though the list ended there.
pub fn subscriber_page(
    reader: &SlotReader,
    channel: &ChannelId,
    cursor: Option<&[u8]>,
    limit: usize,
) -> StoreResult<(Vec<Member>, Option<Vec<u8>>)> {
    let page = reader.members(channel, MemberList::Subscribers, cursor, limit)?;
    let members = page
        .items
        .into_iter()
        .map(|uid| {
            let denied = reader.is_member(channel, MemberList::Deny, &uid)?;
            let membership = reader.membership(&uid, channel)?;
            Ok(Member {
                uid: uid.as_str().to_owned(),
                left: membership.as_ref().is_some_and(|m| !m.active),
                hidden: membership.is_some_and(|m| m.hidden),
                denied,
            })
        })
        .collect::<StoreResult<_>>()?;
    Ok((members, page.cursor))
}
