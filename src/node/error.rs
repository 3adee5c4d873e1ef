//! Errors of the node API: typed so a caller can retry, redirect or give up.

use super::controller::TaskError;
use super::message::RemoteAppendError;
use tidings_channel::machine::{AppendAborted, AppendError};
use tidings_slot::fsm::{Outcome, Refusal};
use tidings_slot::model::Uid;
use tidings_slot::raft::ProposeError;
use tidings_store::StoreError;
use tidings_types::{ChannelId, GroupId, NodeId};

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
    /// The channel does not exist: its slot group holds no runtime meta for it (as a member of the
    /// group that answered, or this node's own replica of it, knows).
    #[error("no meta known for {0}")]
    UnknownChannel(ChannelId),
    /// This node holds no usable runtime meta for the channel and could not get one in time: no member
    /// of the channel's slot group answered, or the meta is still on its way. The channel may exist;
    /// the node keeps fetching it: retry.
    #[error("the meta of {0} is not available on this node yet")]
    MetaUnavailable(ChannelId),
    /// Too many calls (appends, retention moves) wait for the channel's meta or replica: retry later.
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

/// What a caller can do about a [`NodeError`]: the decision each variant encodes, in one place, so a
/// host's retry loop need not know every variant ([`NodeError::remedy`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Remedy {
    /// Nothing was done, and the same call may succeed shortly (a full queue, an election, a fence, a
    /// leader moving, a replica loading): call again after a short pause.
    Retry,
    /// The call may or may not have taken effect: make it again the same way — an append with the
    /// same idempotency keys (a retry of one committed returns its original seqs), a metadata write
    /// after reading back what it wrote.
    RetryIdempotently,
    /// This node cannot serve the call: ask another (`Some`: the node that can, as far as this one knows).
    Redirect(Option<NodeId>),
    /// The call cannot succeed as made (too large, a refused sender, a boundary past HW, an outcome the
    /// slot group decided): change it or give up.
    GiveUp,
}

impl NodeError {
    /// What the caller can do about this error.
    ///
    /// ```
    /// use tidings::node::{NodeError, Remedy};
    /// assert_eq!(NodeError::Overloaded.remedy(), Remedy::Retry);
    /// assert_eq!(NodeError::TimedOut.remedy(), Remedy::RetryIdempotently);
    /// ```
    pub fn remedy(&self) -> Remedy {
        match self {
            NodeError::Propose(error) => propose_remedy(error),
            NodeError::NotApplied(outcome) => match outcome {
                // A stale route or a migration's last moments: the node learns the owner.
                Outcome::Refused(Refusal::SlotMoved { .. } | Refusal::SlotFenced { .. }) => Remedy::Retry,
                _ => Remedy::GiveUp,
            },
            NodeError::Append(error) => append_remedy(error),
            NodeError::Aborted(_) | NodeError::TimedOut => Remedy::RetryIdempotently,
            NodeError::Remote(error) => match error {
                RemoteAppendError::Refused(error) => append_remedy(error),
                RemoteAppendError::Aborted(_) => Remedy::RetryIdempotently,
                // The forwarding node's meta was behind, or the leader's memory full: both pass.
                _ => Remedy::Retry,
            },
            // The channel's slot group says it does not exist.
            NodeError::UnknownChannel(_) => Remedy::GiveUp,
            NodeError::NotReplica(_) | NodeError::NotServed(_) | NodeError::Stopped => Remedy::Redirect(None),
            NodeError::Storage(StoreError::Busy { .. } | StoreError::Dropped) => Remedy::Retry,
            NodeError::Storage(_) => Remedy::GiveUp,
            NodeError::SenderBanned(_) | NodeError::SenderDenied(_) => Remedy::GiveUp,
            NodeError::Task(error) => task_remedy(error),
            NodeError::Busy(_)
            | NodeError::MetaUnavailable(_)
            | NodeError::SlotNotServed(_)
            | NodeError::SenderUnverified(_)
            | NodeError::Overloaded => Remedy::Retry,
        }
    }
}

fn propose_remedy(error: &ProposeError) -> Remedy {
    match error {
        ProposeError::NotReady { .. } | ProposeError::Busy { .. } | ProposeError::Dropped => Remedy::Retry,
        ProposeError::Timeout => Remedy::RetryIdempotently,
        ProposeError::NotLeader { hint, .. } => Remedy::Redirect(*hint),
        ProposeError::UnknownGroup { .. } => Remedy::Redirect(None),
        // Too large, or an operator's change that must be made differently (move the leader first).
        _ => Remedy::GiveUp,
    }
}

fn append_remedy(error: &AppendError) -> Remedy {
    match error {
        AppendError::NotLeader { leader: Some(leader) } => Remedy::Redirect(Some(*leader)),
        AppendError::Empty
        | AppendError::TooLarge { .. }
        | AppendError::RequestTooLarge { .. }
        | AppendError::IdempotencyConflict
        | AppendError::BeyondHw { .. } => Remedy::GiveUp,
        // No leader known yet, a fence, full queues, too few live ISR members, a failed leader log (a
        // failover follows): all pass.
        _ => Remedy::Retry,
    }
}

fn task_remedy(error: &TaskError) -> Remedy {
    match error {
        TaskError::AlreadyRunning(_)
        | TaskError::TooManyTasks
        | TaskError::Fenced(_)
        | TaskError::MetaChanged
        | TaskError::DrainTimedOut
        | TaskError::TargetDown(_)
        | TaskError::Preempted => Remedy::Retry,
        _ => Remedy::GiveUp,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tidings_channel::machine::AppendAborted;
    use tidings_types::Seq;

    #[test]
    fn each_error_says_whether_to_retry_redirect_or_give_up() {
        let channel = ChannelId::new(tidings_types::ChannelType::GROUP, "c").unwrap();
        let group = GroupId::new(1);
        let leader = NodeId::new(2);
        let cases: Vec<(NodeError, Remedy)> = vec![
            (NodeError::Overloaded, Remedy::Retry),
            (NodeError::Busy(channel.clone()), Remedy::Retry),
            (NodeError::Append(AppendError::Busy), Remedy::Retry),
            (NodeError::Append(AppendError::Fenced { task: 7 }), Remedy::Retry),
            (NodeError::Append(AppendError::NotEnoughReplicas { alive: 1, min_isr: 2 }), Remedy::Retry),
            (NodeError::Append(AppendError::NotLeader { leader: None }), Remedy::Retry),
            (NodeError::Append(AppendError::NotLeader { leader: Some(leader) }), Remedy::Redirect(Some(leader))),
            (NodeError::Propose(ProposeError::NotLeader { group, hint: Some(leader) }), Remedy::Redirect(Some(leader))),
            (NodeError::Propose(ProposeError::NotReady { group }), Remedy::Retry),
            (NodeError::Propose(ProposeError::Dropped), Remedy::Retry),
            (NodeError::NotReplica(channel.clone()), Remedy::Redirect(None)),
            (NodeError::Stopped, Remedy::Redirect(None)),
            // Outcome unknown: the same call again, with the same idempotency keys.
            (NodeError::TimedOut, Remedy::RetryIdempotently),
            (NodeError::Aborted(AppendAborted::LeaderChanged), Remedy::RetryIdempotently),
            (NodeError::Propose(ProposeError::Timeout), Remedy::RetryIdempotently),
            (NodeError::Remote(RemoteAppendError::Aborted(AppendAborted::Timeout)), Remedy::RetryIdempotently),
            (NodeError::Remote(RemoteAppendError::TooManyChannels), Remedy::Retry),
            (NodeError::Remote(RemoteAppendError::Refused(AppendError::Empty)), Remedy::GiveUp),
            // Cannot succeed as made.
            (NodeError::Append(AppendError::TooLarge { records: 300, max: 256 }), Remedy::GiveUp),
            (NodeError::Append(AppendError::IdempotencyConflict), Remedy::GiveUp),
            (NodeError::Append(AppendError::BeyondHw { through: Seq::new(9), hw: Seq::new(5) }), Remedy::GiveUp),
            (NodeError::SenderBanned(Uid::new("u").unwrap()), Remedy::GiveUp),
            (NodeError::NotApplied(Outcome::AlreadyExists), Remedy::GiveUp),
            (
                NodeError::NotApplied(Outcome::Refused(Refusal::SlotFenced {
                    slot: tidings_types::HashSlot::new(3).unwrap(),
                    to: group,
                })),
                Remedy::Retry,
            ),
            (NodeError::UnknownChannel(channel.clone()), Remedy::GiveUp),
            (NodeError::MetaUnavailable(channel), Remedy::Retry),
            (NodeError::Task(TaskError::NotInIsr(leader)), Remedy::GiveUp),
            (NodeError::Task(TaskError::MetaChanged), Remedy::Retry),
            (NodeError::Task(TaskError::TargetLeaving(leader)), Remedy::GiveUp),
            (NodeError::Propose(ProposeError::TooLarge { bytes: 2 << 20, max: 1 << 20 }), Remedy::GiveUp),
        ];
        for (error, remedy) in cases {
            assert_eq!(error.remedy(), remedy, "{error:?}");
        }
    }
}
