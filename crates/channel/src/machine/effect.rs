//! What a channel machine asks its runtime to do, and the requests it accepts.

use super::message::ChannelMessage;
use bytes::Bytes;
use tidings_store::message::{IdempotencyKey, LogBatch};
use tidings_types::{ChannelRuntimeMeta, NodeId, Seq};

/// Identifies an append request; chosen by the caller, echoed in [`Effect::AppendDone`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RequestId(pub u64);

/// One message to append.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AppendRecord {
    /// Makes the append idempotent: a retry with the same key and payload returns the original seq.
    pub idempotency_key: Option<IdempotencyKey>,
    /// The message body.
    pub payload: Bytes,
}

/// Messages of one channel to append, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AppendRequest {
    /// Echoed in the completion.
    pub id: RequestId,
    /// The messages.
    pub records: Vec<AppendRecord>,
}

/// A request to give up the channel's records through `through` (move its retention boundary; see
/// [`super::ChannelMachine::handle_retention`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RetentionRequest {
    /// Echoed in the completion.
    pub id: RequestId,
    /// The last seq to give up: at most the leader's HW.
    pub through: Seq,
}

/// Why an admitted append did not complete with its seqs. Its records may or may not be committed later:
/// retry with the same idempotency keys to find out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub enum AppendAborted {
    /// Leadership or meta generation changed before the records were committed.
    #[error("leadership changed before commit; the outcome is unknown")]
    LeaderChanged,
    /// Not committed within the configured append timeout.
    #[error("not committed in time; the outcome is unknown")]
    Timeout,
    /// The leader's storage failed.
    #[error("the leader's storage failed; the outcome is unknown")]
    StorageFailed,
}

/// Identifies one durable append: the machine incarnation, generation and sequence number it was issued
/// under. A completion whose token is not the one in flight is ignored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PersistToken {
    /// Incarnation of the machine (unique per activation, chosen by the runtime).
    pub incarnation: u64,
    /// Meta generation when issued.
    pub generation: u64,
    /// Sequence number of the persist within the incarnation.
    pub id: u64,
}

/// Identifies a store read the leader needs to answer a pull.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ReadToken {
    /// Incarnation of the machine.
    pub incarnation: u64,
    /// Meta generation when issued.
    pub generation: u64,
    /// The follower that pulled.
    pub follower: NodeId,
    /// The pull being answered.
    pub pull_id: u64,
}

/// Why the machine proposes a meta change.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MetaChangeReason {
    /// `node` has not been caught up for longer than the ISR lag bound.
    ShrinkIsr {
        /// The lagging follower.
        node: NodeId,
    },
    /// `node` proved its progress under the current leader and epoch.
    ExpandIsr {
        /// The caught-up replica.
        node: NodeId,
        /// Proof: its durable match...
        match_seq: Seq,
        /// ...at the leader's high watermark at that time.
        hw: Seq,
    },
    /// A caller asked to give up the records through `through` (all committed).
    Retention {
        /// The new retention boundary.
        through: Seq,
    },
}

/// An effect for the runtime to carry out. Drained with [`super::ChannelMachine::poll_effect`].
#[derive(Clone, Debug, PartialEq)]
#[must_use]
pub enum Effect {
    /// Make `batch` durable (stage + sync in a group commit), then call
    /// [`super::ChannelMachine::handle_persisted`] with `token`.
    Persist {
        /// Echo in the completion.
        token: PersistToken,
        /// Operations for the channel's log.
        batch: LogBatch,
    },
    /// Send `message` to `to`.
    Send {
        /// Destination node.
        to: NodeId,
        /// The message.
        message: ChannelMessage,
    },
    /// Read records `[from, through]` (at most `max_bytes`) from the log, then call
    /// [`super::ChannelMachine::handle_read`] with `token`.
    Read {
        /// Echo in the completion.
        token: ReadToken,
        /// First seq.
        from: Seq,
        /// Last seq.
        through: Seq,
        /// Byte budget.
        max_bytes: usize,
    },
    /// An admitted append finished.
    AppendDone {
        /// The request.
        id: RequestId,
        /// Its seqs (one per record, in order), or why it did not complete.
        result: Result<Vec<Seq>, AppendAborted>,
    },
    /// Records `first..=last` are committed (or, on a new leader, were committed under an earlier one
    /// and may not have fanned out). `messages` are the ones to fan out, ascending; report each one's end
    /// with [`super::ChannelMachine::fanout_finished`] (those this leader admitted hold a handoff slot
    /// until then).
    Committed {
        /// First seq handed off.
        first: Seq,
        /// Last seq handed off: HW.
        last: Seq,
        /// The message records among them this leader admitted, and earlier leaders' ones past what their
        /// fanout was last known to finish (barriers are not messages).
        messages: Vec<Seq>,
        /// How many of `messages`, the first ones, are earlier leaders': planned again (their fanout may
        /// have reached some members already).
        inherited: usize,
        /// Earlier leaders' messages past what their fanout was known to finish that are not planned
        /// again: more than `handoff_slots` were, and only the most recent are. Some members may have
        /// missed them.
        skipped: u64,
    },
    /// An admitted retention move finished: the boundary in force (at least the one asked for), or why
    /// it was not seen in force (it may still come into force: ask again to find out).
    RetentionDone {
        /// The request.
        id: RequestId,
        /// The channel's retention boundary in force.
        result: Result<Seq, AppendAborted>,
    },
    /// Propose `meta` to the slot layer as a compare-and-set on `expected_version`.
    ProposeMeta {
        /// The version the change is based on.
        expected_version: u64,
        /// The proposed meta (boxed: the effect is rare, and every other effect would otherwise be as
        /// large as a meta wherever effects are moved).
        meta: Box<ChannelRuntimeMeta>,
        /// Why.
        reason: MetaChangeReason,
    },
    /// A peer acts under a newer leader epoch than this replica's meta: fetch the authoritative meta.
    RefreshMeta,
    /// The local log failed to persist; this replica stopped serving as leader. Fail over.
    StorageFailed,
    /// This replica stopped leading: whichever replica leads next fans out again every message whose
    /// fanout this one had not finished (see [`super::ChannelMachine::fanout_finished`]). Stop planning
    /// them here (plans already with the host may end; their ends are ignored): each would otherwise
    /// reach its members twice. Safe to ignore, at the cost of those repeats.
    FanoutHandedOver,
    /// The meta names this replica leader under a leader epoch its log already holds: it restarted after
    /// leading in that epoch and may have lost records its followers have, so it must not lead again in
    /// it. The controller must fail over with evidence (which may pick this replica under a new epoch).
    NeedsFailover,
}
