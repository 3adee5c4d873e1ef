//! Typed refusals of a channel machine. Each leaves the machine unchanged.

use tidings_types::{MetaError, NodeId, Seq};

/// Why an append (or a retention move) was refused at admission. Nothing was written.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub enum AppendError {
    /// This replica is not the leader; `leader` is where to send it (if known).
    #[error("not the channel leader; leader is {leader:?}")]
    NotLeader {
        /// The leader named by this replica's meta.
        leader: Option<NodeId>,
    },
    /// A write fence is set (migration or failover in progress); retry after the meta changes.
    #[error("channel is fenced by task {task}")]
    Fenced {
        /// The task that set the fence.
        task: u64,
    },
    /// Too many records wait for commit: retry later.
    #[error("channel append queue is full")]
    Busy,
    /// No post-commit handoff capacity could be reserved: retry later.
    #[error("post-commit handoff is full")]
    ChannelBusy,
    /// Fewer than MinISR ISR members are alive: nothing could commit.
    #[error("{alive} ISR members alive, {min_isr} needed")]
    NotEnoughReplicas {
        /// ISR members heard from recently (leader included).
        alive: usize,
        /// MinISR.
        min_isr: u8,
    },
    /// The request has no records.
    #[error("empty append")]
    Empty,
    /// The request has more records than allowed.
    #[error("{records} records in one request, at most {max}")]
    TooLarge {
        /// Records in the request.
        records: usize,
        /// The limit.
        max: usize,
    },
    /// The request's payloads are larger than allowed.
    #[error("{bytes} payload bytes in one request, at most {max}")]
    RequestTooLarge {
        /// Payload bytes in the request.
        bytes: usize,
        /// The limit.
        max: usize,
    },
    /// An idempotency key was reused with a different payload.
    #[error("idempotency key reused with different content")]
    IdempotencyConflict,
    /// The local log failed; this replica no longer accepts appends.
    #[error("local log failed")]
    StorageFailed,
    /// The machine has no meta yet.
    #[error("channel meta not applied yet")]
    NotReady,
    /// A retention move past the high watermark: only committed records can be given up.
    #[error("retention through {through} is past the high watermark {hw}")]
    BeyondHw {
        /// The boundary asked for.
        through: Seq,
        /// The leader's high watermark.
        hw: Seq,
    },
}

/// Why a meta was refused. The machine keeps the meta it had.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ApplyMetaError {
    /// Invalid on its own or not a valid successor of the current meta.
    #[error(transparent)]
    Invalid(#[from] MetaError),
}
