//! What the controller tells operators and callers: task kinds, reports, errors, and the evidence a
//! replica gives.

use serde::{Deserialize, Serialize};
use tidings_slot::fsm::Refusal;
use tidings_types::{ChannelId, LeaderEpoch, NodeId, Seq, Time};

/// What a channel task does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TaskKind {
    /// The leader's node is gone (or its replica cannot lead): fence with frozen replication, gather
    /// durable evidence from enough ISR members, switch to the most advanced, unfence.
    Failover,
    /// Planned move of leadership to `target`: fence, drain the old leader, switch with the drain proof,
    /// unfence.
    Transfer {
        /// The new leader.
        target: NodeId,
    },
    /// A leadership handed off by a node that is leaving (`NodeCore::set_leaving`): a transfer to
    /// `target` that keeps the replicas' order, so the leaving node, still the channel's preferred
    /// replica, takes its leadership back once it is up again (`ControllerConfig::rebalance_leaders_after`).
    HandOff {
        /// The new leader.
        target: NodeId,
    },
    /// Replace replica `from` by `to`: add `to` as a learner, let it catch up, fence, put `to` in the
    /// ISR and take `from` out of the replicas (and of the leadership, if it led) in one change, unfence.
    Replace {
        /// The replica that leaves.
        from: NodeId,
        /// The replica that joins.
        to: NodeId,
    },
    /// A fence left by a task nobody runs any more (its controller stopped) and that froze nothing:
    /// cleared with a newer meta, the leader unchanged.
    ClearFence,
    /// Take `node`, a replica outside the ISR, out of a healthy channel that holds more replicas than it
    /// is created with: what a replacement that did not finish left behind (it added `node` as a
    /// learner, then timed out or lost its controller). One meta change, no fence: a learner never
    /// counts towards commit or leadership, so nothing the channel committed depends on it.
    RemoveLearner {
        /// The learner that leaves.
        node: NodeId,
    },
}

impl TaskKind {
    /// The new leader of a planned move of leadership (a transfer or a hand-off).
    pub fn leadership_target(self) -> Option<NodeId> {
        match self {
            TaskKind::Transfer { target } | TaskKind::HandOff { target } => Some(target),
            _ => None,
        }
    }

    /// `true` for the tasks that wait, fenced, for the leader to drain its appends (transfers,
    /// hand-offs, replacements); a failover's fence freezes replication and waits for nobody.
    pub fn waits_for_drain(self) -> bool {
        matches!(self, TaskKind::Transfer { .. } | TaskKind::HandOff { .. } | TaskKind::Replace { .. })
    }
}

/// One replica's durable state, as evidence for a leader switch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EvidenceReport {
    /// Leader epoch of its last durable record (of the prefix that agrees with its log).
    pub last_epoch: LeaderEpoch,
    /// Its last durable seq.
    pub last_seq: Seq,
    /// Its high watermark as it stands in memory (not the checkpoint, which may trail).
    pub hw: Seq,
    /// Appends admitted and not completed (a leader's; 0 elsewhere).
    pub pending_appends: u32,
    /// Last seq of its log, durable or not.
    pub log_end: Seq,
    /// Nothing pending, and HW, log end and durable end equal (a drained leader).
    pub drained: bool,
    /// The task whose fence the replica's meta carries, if any: evidence counts only under the
    /// requesting task's own fence (a meta of the same version but other content never passes).
    pub fenced_by: Option<u64>,
}

/// Evidence as a report shows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EvidenceEntry {
    /// The replica.
    pub node: NodeId,
    /// Leader epoch of its last durable record.
    pub last_epoch: LeaderEpoch,
    /// Its last durable seq.
    pub last_seq: Seq,
}

/// A finished task.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TaskReport {
    /// The task id (the one its fence carried).
    pub task: u64,
    /// The channel.
    pub channel: ChannelId,
    /// What it did.
    pub kind: TaskKind,
    /// Leader before the task.
    pub old_leader: NodeId,
    /// Leader and leader epoch after the switch, if it switched.
    pub new_leader: Option<(NodeId, LeaderEpoch)>,
    /// The evidence the switch was committed with.
    pub evidence: Vec<EvidenceEntry>,
    /// How it ended.
    pub outcome: Result<(), TaskError>,
    /// When the controller started it (node time).
    pub started: Time,
    /// When it finished.
    pub finished: Time,
}

/// Why a running task cannot go on yet; the channel stays fenced (fail closed) until it can.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TaskBlocked {
    /// Fewer ISR members than |ISR| − MinISR + 1 gave evidence.
    NotEnoughEvidence {
        /// ISR members that answered.
        have: usize,
        /// Answers needed.
        need: usize,
    },
    /// A replica claims a record of a leader epoch the meta never granted.
    ConflictingEvidence {
        /// The replica.
        node: NodeId,
        /// The epoch it claims.
        last_epoch: LeaderEpoch,
        /// The meta's leader epoch.
        meta_leader_epoch: LeaderEpoch,
    },
    /// The slot group refused the switch's proof; evidence is gathered again.
    ProofRefused(Refusal),
    /// A transfer waits for the old leader to drain and the target to catch up.
    Draining,
    /// A replacement waits for the new replica to catch up.
    CatchingUp,
}

/// A task in progress, as status shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TaskStatus {
    /// Task id.
    pub task: u64,
    /// The channel.
    pub channel: ChannelId,
    /// What it does.
    pub kind: TaskKind,
    /// The step it is at.
    pub step: &'static str,
    /// Why it waits, if it does.
    pub blocked: Option<TaskBlocked>,
    /// Since when it runs.
    pub started: Time,
}

/// Why a task was not started, or ended without its change.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TaskError {
    /// A task for the channel already runs on this node.
    #[error("a task already runs for {0}")]
    AlreadyRunning(ChannelId),
    /// The controller runs its maximum of tasks: retry later.
    #[error("too many channel tasks running")]
    TooManyTasks,
    /// The transfer target is not an in-sync replica.
    #[error("{0} is not in the ISR")]
    NotInIsr(NodeId),
    /// The transfer target already leads.
    #[error("{0} already leads")]
    AlreadyLeader(NodeId),
    /// Another task's fence is set: wait for it.
    #[error("fenced by task {0}")]
    Fenced(u64),
    /// The meta changed under the task (another controller, or the leader's ISR change): nothing of
    /// this task stayed; retry with the new meta.
    #[error("the channel meta changed while the task ran")]
    MetaChanged,
    /// The old leader did not drain, or the target did not catch up, in time: the fence was cleared and
    /// the leader is unchanged.
    #[error("the old leader did not drain in time")]
    DrainTimedOut,
    /// The slot group refused a step.
    #[error("refused: {0}")]
    Refused(Refusal),
    /// The replica to replace is not a replica of the channel.
    #[error("{0} is not a replica")]
    NotReplica(NodeId),
    /// The new replica is already in the channel's ISR (or is the one leaving), or is not a node of the
    /// cluster.
    #[error("{0} cannot join: already in the ISR or not a cluster node")]
    CannotJoin(NodeId),
    /// A failover of the channel took precedence: the task had fenced nothing yet, or it waited for a
    /// leader to drain that asked for the failover (it cannot lead, so it never drains).
    #[error("a failover took precedence")]
    Preempted,
    /// The replacement's new replica went down before it caught up: the next repair pass starts over.
    #[error("the new replica {0} went down before it caught up")]
    TargetDown(NodeId),
    /// Taking the replica out would leave fewer ISR members than MinISR.
    #[error("replacing would leave the ISR below MinISR")]
    BelowMinIsr,
    /// The target is leaving (`NodeCore::set_leaving`: about to stop): it takes no new leadership or
    /// replica until it is back.
    #[error("{0} is leaving")]
    TargetLeaving(NodeId),
}
