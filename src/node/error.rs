//! Errors of the node API: typed so a caller can retry, redirect or give up.

use super::controller::TaskError;
use super::message::RemoteAppendError;
use tidings_channel::machine::{AppendAborted, AppendError};
use tidings_slot::fsm::Outcome;
use tidings_slot::model::Uid;
use tidings_slot::raft::ProposeError;
use tidings_store::StoreError;
use tidings_types::{ChannelId, GroupId};

/// Why a node API call failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NodeError {
    /// The metadata write was not applied (no leader, busy, timeout...).
    #[error(transparent)]
    Propose(#[from] ProposeError),
    /// The metadata command was applied with an outcome other than `Applied` (already exists, version
    /// mismatch, refused).
    #[error("metadata command not applied: {0:?}")]
    NotApplied(Outcome),
    /// The append was refused at admission; nothing was written.
    #[error(transparent)]
    Append(#[from] AppendError),
    /// The append was admitted but not committed (outcome unknown: retry with the same idempotency keys).
    #[error(transparent)]
    Aborted(#[from] AppendAborted),
    /// The leader that was forwarded the append could not take it.
    #[error(transparent)]
    Remote(#[from] RemoteAppendError),
    /// No runtime meta is known for the channel yet (it does not exist, or its meta is still travelling).
    #[error("no meta known for {0}")]
    UnknownChannel(ChannelId),
    /// Too many appends wait for the channel's meta: retry later.
    #[error("too many appends wait for the meta of {0}")]
    Busy(ChannelId),
    /// This node keeps no replica of the channel (reads are served by replicas).
    #[error("this node keeps no replica of {0}")]
    NotReplica(ChannelId),
    /// This node keeps no replica of the slot group (authoritative reads run on its members).
    #[error("this node keeps no replica of slot group {0}")]
    NotServed(GroupId),
    /// The slot group asked does not serve the key's hash slot now: it is fenced for the last moments of a
    /// migration (retry shortly), or the group is still receiving it. The refusal names the group.
    #[error("the slot group does not serve the key's hash slot: {0}")]
    SlotNotServed(tidings_slot::fsm::Refusal),
    /// Local storage failed.
    #[error(transparent)]
    Storage(#[from] StoreError),
    /// The sender is banned: the append was refused.
    #[error("user {} is banned from sending", .0.as_str())]
    SenderBanned(Uid),
    /// The sender is on the channel's deny list: the append was refused.
    #[error("user {} may not send to this channel", .0.as_str())]
    SenderDenied(Uid),
    /// The sender could not be checked: no node keeping the sender's or the channel's slot group
    /// answered in time. Nothing was written; retry.
    #[error("cannot check sender {}: no node keeping its slot group or the channel's answered", .0.as_str())]
    SenderUnverified(Uid),
    /// A channel task (leader transfer, failover) was not started or did not make its change.
    #[error(transparent)]
    Task(#[from] TaskError),
    /// The node's inbox is full: retry later.
    #[error("node is overloaded")]
    Overloaded,
    /// The node is shutting down.
    #[error("node stopped")]
    Stopped,
    /// No outcome came within the time the caller waited. The call may still take effect: an append
    /// is retried with the same idempotency keys, a metadata write is read back or made again.
    #[error("no outcome within the time waited")]
    TimedOut,
}
