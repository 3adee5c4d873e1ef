//! The metadata the slot layer stores: users, devices, channels, subscribers, allow and deny lists,
//! memberships, CMD bindings, channel runtime meta, migration tasks, plugin bindings and a bounded
//! projection of message events. Message bodies never live here.

use serde::{Deserialize, Serialize};
use tidings_types::{ChannelId, LeaderEpoch, NodeId, Seq};

/// Longest user id accepted, in bytes.
pub const UID_BYTES_MAX: usize = 128;

/// A user id (a chat backend's UID). Non-empty, at most [`UID_BYTES_MAX`] bytes.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(transparent)]
pub struct Uid(String);

impl Uid {
    /// A uid, or `None` if empty or too long.
    pub fn new(uid: impl Into<String>) -> Option<Self> {
        let uid = uid.into();
        (!uid.is_empty() && uid.len() <= UID_BYTES_MAX).then_some(Self(uid))
    }

    /// The uid as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl<'de> Deserialize<'de> for Uid {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let raw = String::deserialize(d)?;
        Uid::new(raw).ok_or_else(|| serde::de::Error::custom("uid is empty or too long"))
    }
}

/// A user.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct User {
    /// The user's id.
    pub uid: Uid,
    /// Display name.
    pub name: String,
    /// Banned users cannot send.
    pub banned: bool,
}

/// One device of a user (a device flag such as app / web / pc, and its login token).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Device {
    /// Owner.
    pub uid: Uid,
    /// Device kind (host-defined).
    pub device_flag: u8,
    /// Login token.
    pub token: String,
    /// Device level (master or slave, host-defined).
    pub level: u8,
}

/// Business flags of a channel.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChannelFlags {
    /// The channel is banned: nobody can send.
    pub ban: bool,
    /// The channel is disbanded.
    pub disband: bool,
    /// Only allow-listed members can send.
    pub send_ban: bool,
    /// A large group: fanout pages through subscribers.
    pub large: bool,
}

/// A channel definition.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChannelInfo {
    /// The channel.
    pub channel: ChannelId,
    /// Its flags.
    pub flags: ChannelFlags,
}

/// Per-user state of a channel membership (UID-owned: stored in the user's slot).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Membership {
    /// Seq of the channel when the user joined.
    pub join_seq: Seq,
    /// Last seq the user read.
    pub read_seq: Seq,
    /// Messages at or below this seq are deleted for this user.
    pub deleted_to_seq: Seq,
    /// The conversation is hidden in the user's list.
    pub hidden: bool,
    /// The membership is active (not left).
    pub active: bool,
}

/// A CMD-channel binding of a user, separate from the normal membership, with its acknowledged seq.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CmdBinding {
    /// Last CMD message seq the user acknowledged.
    pub ack_seq: Seq,
}

/// Longest plugin name, in bytes: the name is a length-prefixed segment of the binding's key. Commands
/// naming a longer one are refused ([`Refusal::PluginNameTooLong`](crate::fsm::Refusal::PluginNameTooLong)).
pub const PLUGIN_NAME_BYTES_MAX: usize = 255;

/// A plugin bound to a user (e.g. a bot or an AI handler).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PluginBinding {
    /// The user.
    pub uid: Uid,
    /// Plugin number (host-defined), at most [`PLUGIN_NAME_BYTES_MAX`] bytes.
    pub plugin: String,
}

/// The phase a channel migration task is in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum MigrationPhase {
    /// Created, nothing done yet.
    Created,
    /// Write fence set.
    Fenced,
    /// Old leader drained / evidence gathered.
    Drained,
    /// The switch was committed.
    Switched,
    /// Done; fence cleared.
    Done,
    /// Failed; membership left as it was.
    Failed,
}

/// A channel migration task (leader transfer, replica replacement, failover).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigrationTask {
    /// Task id.
    pub id: u64,
    /// The channel.
    pub channel: ChannelId,
    /// Current phase.
    pub phase: MigrationPhase,
    /// Target leader, if the task moves leadership.
    pub target_leader: Option<NodeId>,
}

/// A bounded projection of one message event (for conversation lists), not the message.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MessageEvent {
    /// Seq of the message.
    pub seq: Seq,
    /// Sender.
    pub sender: Uid,
    /// A short summary (bounded by the command limits).
    pub summary: String,
}

/// Proof attached to a leader or ISR switch: the task, the epochs it expects, and the durable evidence
/// gathered from replicas.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SwitchProof {
    /// The migration task.
    pub task: u64,
    /// Leader epoch the switch is based on.
    pub expected_leader_epoch: LeaderEpoch,
    /// `(replica, last leader epoch, last seq)` evidence.
    pub evidence: Vec<(NodeId, LeaderEpoch, Seq)>,
}

/// The controller's intent for one slot group, replicated through the group itself: who should be its
/// voters, under which configuration epoch, who should lead it, and the membership a replica move in
/// progress is taking it to.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupIntent {
    /// The group.
    pub group: tidings_types::GroupId,
    /// The voters the group should have (the assignment last committed).
    pub desired_peers: Vec<tidings_types::NodeId>,
    /// The configuration epoch the assignment was committed in: an intent for another epoch is stale.
    pub config_epoch: tidings_types::ConfigEpoch,
    /// The node that should lead the group, if any.
    pub preferred_leader: Option<tidings_types::NodeId>,
    /// A replica move in progress: the voters the group's leader is taking it to. Committed into
    /// `desired_peers` (with the new epoch) only once the observed voters equal it.
    pub target_peers: Option<Vec<tidings_types::NodeId>>,
    /// Nodes being drained: the group's leader moves its replica off them, one move at a time, and
    /// replaces their channel replicas in the group's slots.
    pub draining: Vec<tidings_types::NodeId>,
}

impl GroupIntent {
    /// The voters the group's leader drives the membership to: the move's target, else the assignment.
    pub fn wanted_voters(&self) -> &[tidings_types::NodeId] {
        self.target_peers.as_deref().unwrap_or(&self.desired_peers)
    }
}

/// One group's record of a hash slot it owns, owned, or is receiving. Stored with the group's own records
/// (which never migrate), replicated through the group's log, so every replica decides the same.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlotRecord {
    /// The slot's ownership epoch the state is about: the epoch owned (`Owned`), or the epoch of the
    /// migration in progress or done (the others). Every completed migration of a slot adds one.
    pub epoch: u64,
    /// Where the slot stands in this group.
    pub state: SlotState,
}

/// Where a hash slot stands in one group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum SlotState {
    /// The group serves the slot.
    Owned,
    /// The group serves the slot while copying it to `to`; every key written meanwhile is marked, to be
    /// copied again once the slot is fenced.
    Exporting {
        /// The target group.
        to: tidings_types::GroupId,
    },
    /// The copy is done except the marked keys: writes are refused (retryable) until `to` took over.
    Fenced {
        /// The target group.
        to: tidings_types::GroupId,
    },
    /// `to` owns the slot from this record's epoch on; this group's copy is gone.
    Gone {
        /// The group that owns the slot.
        to: tidings_types::GroupId,
    },
    /// The group is receiving the slot from `from`; its copy is invisible and writes are refused.
    Importing {
        /// The source group.
        from: tidings_types::GroupId,
        /// The copy attempt being received: chunks of any other attempt are refused.
        attempt: u64,
    },
}

/// One step of a hash-slot migration from a source group to a target group. The source's leader drives
/// it: `Export` (source) → `BeginImport`, `ImportChunk`s (target) → `Fence` (source) → the marked keys as
/// `ImportChunk`s → `CommitImport` (target) → `Finish` (source). See `ARCHITECTURE.md`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum SlotMigrationStep {
    /// Source: start exporting the slot to `to` (the operator's request).
    Export {
        /// The target group.
        to: tidings_types::GroupId,
    },
    /// Source: give up an export that is not fenced yet; the slot stays owned.
    AbortExport,
    /// Source: refuse writes to the slot from now on; the marked keys are copied next.
    Fence {
        /// The target group.
        to: tidings_types::GroupId,
        /// The migration's epoch.
        epoch: u64,
    },
    /// Source: the target owns the slot: drop this group's copy, answer its keys with the new owner.
    Finish {
        /// The target group.
        to: tidings_types::GroupId,
        /// The migration's epoch.
        epoch: u64,
    },
    /// Target: (re)start receiving the slot from `from` as copy `attempt`, dropping any earlier copy.
    BeginImport {
        /// The source group.
        from: tidings_types::GroupId,
        /// The migration's epoch.
        epoch: u64,
        /// The copy attempt (the source leader's raft term and a counter: later attempts are larger).
        attempt: u64,
    },
    /// Target: keys of the slot (a value to set, or `None` to remove the key) from copy `attempt`.
    ImportChunk {
        /// The source group.
        from: tidings_types::GroupId,
        /// The migration's epoch.
        epoch: u64,
        /// The copy attempt.
        attempt: u64,
        /// Metadata keys of the slot and their values.
        entries: Vec<(Vec<u8>, Option<Vec<u8>>)>,
    },
    /// Target: the copy `attempt` is complete: serve the slot at the migration's epoch.
    CommitImport {
        /// The source group.
        from: tidings_types::GroupId,
        /// The migration's epoch.
        epoch: u64,
        /// The copy attempt.
        attempt: u64,
    },
    /// Target: drop an import the source abandoned.
    AbortImport {
        /// The source group.
        from: tidings_types::GroupId,
        /// The migration's epoch.
        epoch: u64,
    },
}
