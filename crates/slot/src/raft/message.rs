//! Messages between the multi-raft drivers of different nodes.

use crate::fsm::Outcome;
use serde::{Deserialize, Serialize};
use tidings_types::{GroupId, NodeId};

/// A message for one group on another node.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlotMessage {
    /// The group.
    pub group: GroupId,
    /// What it carries.
    pub body: SlotBody,
}

/// Body of a [`SlotMessage`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum SlotBody {
    /// A raft-rs message (protobuf).
    Raft {
        /// The highest configuration epoch the sending replica knows of (see [`SlotBody::known_epoch`]).
        known_epoch: u64,
        /// The encoded message.
        #[serde(with = "serde_bytes_vec")]
        bytes: Vec<u8>,
    },
    /// One chunk of a raft message too large for one frame (a snapshot).
    Chunk {
        /// The highest configuration epoch the sending replica knows of (see [`SlotBody::known_epoch`]).
        known_epoch: u64,
        /// Identifies the chunked message among the sender's.
        transfer: u64,
        /// Index of this chunk.
        index: u32,
        /// Number of chunks.
        count: u32,
        /// Bytes of the chunk.
        #[serde(with = "serde_bytes_vec")]
        bytes: Vec<u8>,
    },
    /// A proposal forwarded by a follower (or a non-member) to the leader.
    Forward {
        /// The node that proposed it and waits for the outcome.
        origin: NodeId,
        /// The origin's proposal id.
        id: u64,
        /// The encoded command.
        #[serde(with = "serde_bytes_vec")]
        command: Vec<u8>,
    },
    /// The leader applied a forwarded proposal.
    ForwardDone {
        /// The origin's proposal id.
        id: u64,
        /// Its outcome.
        outcome: Outcome,
    },
    /// The receiver is not the leader; `hint` is the leader it knows.
    NotLeader {
        /// The origin's proposal id.
        id: u64,
        /// The leader the receiver knows, if any.
        hint: Option<NodeId>,
    },
    /// The sender leads the group, and its membership (at `config_epoch`) does not include the receiver:
    /// the receiver's replica was moved away and may be destroyed, unless it holds entries beyond
    /// `last_index` (they may add it back).
    Removed {
        /// The sender's configuration epoch.
        config_epoch: u64,
        /// The sender's last log index when it answered.
        last_index: u64,
    },
    /// The sender's replica is not in its own configuration, or hears from no leader: is it still a
    /// member? (The leader answers `Removed` if not; another member that does not count the sender in
    /// answers `MemberCheckHint`.)
    MemberCheck,
    /// The leader the sender knows, for a `MemberCheck` it could not answer: ask it.
    MemberCheckHint {
        /// The leader.
        leader: NodeId,
    },
}

impl SlotBody {
    /// For a raft message or one of its chunks: the highest configuration epoch (the raft index of a
    /// committed membership change) the sending replica knows of, from its own log or from its peers'
    /// messages.
    ///
    /// Raft ids are node ids, so a replica destroyed on its removal and the one created when the group
    /// adds the node back look alike to raft-rs. Any answer the destroyed one sent names an epoch from
    /// before the change that added the node back; its successor learns that change's epoch (or a later
    /// one) from the first message it gets. A replica drops answers naming an older epoch than it knows:
    /// a late copy of one would otherwise count for the new, empty replica (raft-rs took its match
    /// index and ignored the new replica's rejections as stale: the learner never caught up).
    pub fn known_epoch(&self) -> Option<u64> {
        match self {
            SlotBody::Raft { known_epoch, .. } | SlotBody::Chunk { known_epoch, .. } => Some(*known_epoch),
            _ => None,
        }
    }
}

/// Serializes `Vec<u8>` as bytes (compact in postcard).
mod serde_bytes_vec {
    use serde::{Deserialize, Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(bytes: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(bytes)
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let bytes: &[u8] = Deserialize::deserialize(d)?;
        Ok(bytes.to_vec())
    }
}
