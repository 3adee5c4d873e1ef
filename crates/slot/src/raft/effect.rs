//! What the multi-raft driver asks its runtime to do, and its typed refusals.

use super::message::SlotMessage;
use crate::fsm::Outcome;
use tidings_router::GroupObservation;
use tidings_types::{GroupId, NodeId};

/// Identifies a proposal of this node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ProposalId(pub u64);

/// Identifies an authoritative read of this node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ReadId(pub u64);

/// Why a proposal or read was refused or failed. Nothing was proposed when refused synchronously.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProposeError {
    /// The group is not served by this node.
    #[error("{group} is not on this node")]
    UnknownGroup {
        /// The group.
        group: GroupId,
    },
    /// No leader is known for the group (election in progress): retry later.
    #[error("{group} has no known leader")]
    NotReady {
        /// The group.
        group: GroupId,
    },
    /// The node asked is not the leader; send to `hint` if known.
    #[error("not the leader of {group}; leader is {hint:?}")]
    NotLeader {
        /// The group.
        group: GroupId,
        /// The leader known to the refusing node.
        hint: Option<NodeId>,
    },
    /// The group's proposal (or read) queue is full: retry later.
    #[error("{group} is busy")]
    Busy {
        /// The group.
        group: GroupId,
    },
    /// The command exceeds the size limit.
    #[error("command of {bytes} bytes exceeds {max}")]
    TooLarge {
        /// Its size.
        bytes: usize,
        /// The limit.
        max: usize,
    },
    /// Not answered in time; the proposal may still be applied (its outcome is unknown).
    #[error("timed out; outcome unknown")]
    Timeout,
    /// Leadership changed and the proposal was dropped before commit; it was not applied.
    #[error("proposal dropped by a leadership change")]
    Dropped,
    /// The membership change would remove this node, the group's leader: hand the leadership over first.
    #[error("the change would remove the leader of {group}")]
    LeaderWouldLeave {
        /// The group.
        group: GroupId,
    },
}

/// An effect of the multi-raft driver, drained with [`super::MultiRaft::poll_effect`].
#[derive(Clone, Debug, PartialEq)]
#[must_use]
pub enum SlotEffect {
    /// Send `message` to `to`.
    Send {
        /// Destination node.
        to: NodeId,
        /// The message.
        message: SlotMessage,
    },
    /// Make every write to the raft log and metadata stores durable (one fsync for all groups), then call
    /// [`super::MultiRaft::handle_synced`] with `token`.
    Sync {
        /// Echo in the completion.
        token: u64,
    },
    /// A proposal of this node finished.
    ProposalDone {
        /// The proposal.
        id: ProposalId,
        /// The FSM's outcome, or why it did not apply.
        result: Result<Outcome, ProposeError>,
    },
    /// An authoritative read may now read the local store: it reflects every write committed before the
    /// read was requested.
    ReadReady {
        /// The read.
        id: ReadId,
        /// The group.
        group: GroupId,
    },
    /// An authoritative read failed.
    ReadFailed {
        /// The read.
        id: ReadId,
        /// Why.
        error: ProposeError,
    },
    /// A channel's runtime meta was created or replaced by a command this node applied.
    MetaChanged {
        /// The group that applied it.
        group: GroupId,
        /// The new meta.
        meta: tidings_types::ChannelRuntimeMeta,
        /// `true` if this node leads the group (it pushes the meta to the channel's replicas).
        leader: bool,
    },
    /// A snapshot replaced what this node held of `group`: the channel runtime metas it holds, every
    /// one (those changed since the replica's last applied entry among them), applied without the
    /// commands that made them and so without a [`SlotEffect::MetaChanged`] each. A node keeping
    /// copies of metas it read from its replica refreshes them from these.
    MetasInstalled {
        /// The group whose snapshot was installed.
        group: GroupId,
        /// Its channel runtime metas (shared: each of the node's shards reads the same list).
        metas: std::sync::Arc<Vec<tidings_types::ChannelRuntimeMeta>>,
    },
    /// What raft status shows of a group changed: publish it in the route table.
    Observed {
        /// The group.
        group: GroupId,
        /// Leader, term, members.
        observation: GroupObservation,
    },
    /// A hash slot's placement moved forward (a migration step applied or a snapshot installed here):
    /// route the slot to `placement.group` from now on.
    SlotPlaced {
        /// The slot.
        slot: tidings_types::HashSlot,
        /// Where it lives now, and its ownership epoch.
        placement: tidings_store::Placement,
    },
    /// `group` recorded `node` as being drained (a `DrainNode` command this node applied): the group's
    /// leader moves the node's replicas away.
    DrainStarted {
        /// The group.
        group: GroupId,
        /// The drained node.
        node: NodeId,
    },
    /// This node left `group` (a membership change removed it): its replica was destroyed.
    GroupRemoved {
        /// The group.
        group: GroupId,
    },
}
