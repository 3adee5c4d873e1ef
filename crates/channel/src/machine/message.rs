//! Messages replicas of one channel exchange. Pull, not push: followers ask, the leader answers.

use serde::{Deserialize, Serialize};
use tidings_store::message::Record;
use tidings_types::{ChannelId, Epoch, LeaderEpoch, Seq};

/// A message between two replicas of `channel`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ChannelMessage {
    /// Follower → leader: send me records from `next_seq` (which acknowledges everything before it).
    Pull(PullRequest),
    /// Leader → follower: the answer to one pull.
    PullResponse(PullResponse),
    /// Leader → follower: records arrived; pull now. Also a replica's answer to a hint of an older leader
    /// epoch, naming the one in force (its sender then refreshes its meta). Only a hint: it carries no
    /// authority.
    Hint(PullHint),
}

impl ChannelMessage {
    /// The channel the message is about.
    pub fn channel(&self) -> &ChannelId {
        match self {
            ChannelMessage::Pull(m) => &m.channel,
            ChannelMessage::PullResponse(m) => &m.channel,
            ChannelMessage::Hint(m) => &m.channel,
        }
    }

    /// About how many bytes the message takes on the wire (its records' encoded sizes plus a fixed
    /// allowance for the rest): enough to keep a batch of messages within a frame limit.
    pub fn size_hint(&self) -> usize {
        const FIXED: usize = 64;
        let records = match self {
            ChannelMessage::PullResponse(PullResponse { body: PullBody::Records { records, .. }, .. }) => {
                records.iter().map(|r| r.encoded_len() + 8).sum()
            }
            _ => 0,
        };
        FIXED + self.channel().id().len() + records
    }
}

/// A follower's pull.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PullRequest {
    /// The channel.
    pub channel: ChannelId,
    /// Identifies this pull; the answer echoes it.
    pub pull_id: u64,
    /// The leader epoch of the meta the follower acts under.
    pub leader_epoch: LeaderEpoch,
    /// The membership epoch of that meta. A leader refuses a pull made under an older one than the
    /// meta that (re)added the follower to the replicas: it may come from the follower's replica of
    /// before it left (a late copy), whose log the node has since forgotten.
    pub epoch: Epoch,
    /// First seq wanted. Everything before it is durable on the follower: this is its acknowledgement.
    pub next_seq: Seq,
    /// Leader epoch of the follower's last record (0 if none).
    pub last_epoch: LeaderEpoch,
    /// Most record bytes wanted.
    pub max_bytes: u32,
}

/// The leader's answer to one pull.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PullResponse {
    /// The channel.
    pub channel: ChannelId,
    /// The pull this answers.
    pub pull_id: u64,
    /// The leader epoch the leader acts under.
    pub leader_epoch: LeaderEpoch,
    /// What the leader has to say.
    pub body: PullBody,
}

/// The substance of a [`PullResponse`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum PullBody {
    /// Records from the requested seq (possibly none), and the leader's high watermark.
    Records {
        /// Consecutive records starting at the pull's `next_seq`.
        records: Vec<Record>,
        /// The leader's high watermark.
        hw: Seq,
        /// Every message at or below this seq finished its post-commit fanout, as far as the leader
        /// knows: a successor fans out again the committed messages past it (see `machine::handoff`).
        fanned_through: Seq,
    },
    /// The follower's log diverges: the leader's log holds epoch `epoch` (the largest at or below the
    /// follower's last epoch) only through `end_seq`. The follower truncates and pulls again.
    Diverging {
        /// Epoch in the leader's history.
        epoch: LeaderEpoch,
        /// Last seq of that epoch in the leader's log.
        end_seq: Seq,
    },
    /// The leader's log starts after the follower's position (retention): restart the log after `seq`.
    StartAfter {
        /// Last seq no longer held by the leader.
        seq: Seq,
        /// Leader epoch in force at `seq`.
        epoch: LeaderEpoch,
        /// The leader's high watermark.
        hw: Seq,
    },
    /// The pull was made under another leader epoch, or under a membership epoch from before the
    /// follower (re)joined the replicas; the follower must refresh its meta.
    StaleEpoch,
    /// The answering node is not the leader (anymore).
    NotLeader,
}

/// A wake-up hint from the leader.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PullHint {
    /// The channel.
    pub channel: ChannelId,
    /// The leader epoch of the sender.
    pub leader_epoch: LeaderEpoch,
}
