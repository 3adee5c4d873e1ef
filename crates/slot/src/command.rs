//! Commands of the slot FSM: typed, serde-encoded in a versioned envelope so a node refuses a command
//! from a newer version clearly instead of misreading it.

use crate::model::{
    ChannelFlags, ChannelInfo, CmdBinding, Device, GroupIntent, Membership, MessageEvent, MigrationTask, PluginBinding,
    SwitchProof, Uid, User,
};
use serde::{Deserialize, Serialize};
use tidings_types::{ChannelId, ChannelRuntimeMeta, GroupId, NodeId};

/// Version of the command encoding this build writes and the newest it understands.
pub const COMMAND_VERSION: u16 = 2;

/// Which per-channel member list a command changes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum MemberList {
    /// Subscribers (who receives the channel's messages).
    Subscribers,
    /// Allow list (who may send when the channel is send-banned).
    Allow,
    /// Deny list (who may not send).
    Deny,
}

/// A change to slot metadata. Each command belongs to the hash slot of its routing key.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Command {
    /// Creates or replaces a user.
    PutUser(User),
    /// Creates or replaces a device of a user.
    PutDevice(Device),
    /// Removes a device.
    RemoveDevice {
        /// Owner.
        uid: Uid,
        /// Device kind.
        device_flag: u8,
    },
    /// Marks a uid as a system uid.
    AddSystemUid(Uid),
    /// Unmarks a system uid.
    RemoveSystemUid(Uid),
    /// Creates a channel; `AlreadyExists` if it exists.
    CreateChannel(ChannelInfo),
    /// Changes a channel's flags; `NotFound` if it does not exist.
    UpdateChannelFlags {
        /// The channel.
        channel: ChannelId,
        /// New flags.
        flags: ChannelFlags,
    },
    /// Adds uids to one of the channel's member lists (bounded count per command).
    AddMembers {
        /// The channel.
        channel: ChannelId,
        /// Which list.
        list: MemberList,
        /// The uids.
        uids: Vec<Uid>,
    },
    /// Removes uids from one of the channel's member lists (bounded count per command).
    RemoveMembers {
        /// The channel.
        channel: ChannelId,
        /// Which list.
        list: MemberList,
        /// The uids.
        uids: Vec<Uid>,
    },
    /// Creates or replaces a user's membership state of a channel (stored in the user's slot).
    PutMembership {
        /// The user.
        uid: Uid,
        /// The channel.
        channel: ChannelId,
        /// The state.
        membership: Membership,
    },
    /// Removes a user's membership of a channel.
    RemoveMembership {
        /// The user.
        uid: Uid,
        /// The channel.
        channel: ChannelId,
    },
    /// Creates or replaces a user's CMD-channel binding.
    PutCmdBinding {
        /// The user.
        uid: Uid,
        /// The CMD channel.
        channel: ChannelId,
        /// The binding.
        binding: CmdBinding,
    },
    /// Creates a channel's runtime meta; `AlreadyExists` if it exists.
    CreateRuntimeMeta(ChannelRuntimeMeta),
    /// Replaces a channel's runtime meta if its version is `expected_version`. A leader change must carry
    /// a proof (task, expected leader epoch, evidence).
    CasRuntimeMeta {
        /// The version the change is based on.
        expected_version: u64,
        /// The new meta (version must be `expected_version + 1`).
        meta: ChannelRuntimeMeta,
        /// Proof for a leader switch.
        proof: Option<SwitchProof>,
    },
    /// Creates or replaces a migration task.
    PutMigrationTask(MigrationTask),
    /// Removes a migration task.
    RemoveMigrationTask {
        /// The channel.
        channel: ChannelId,
        /// Task id.
        id: u64,
    },
    /// Binds a plugin to a user.
    PutPluginBinding(PluginBinding),
    /// Unbinds a plugin.
    RemovePluginBinding {
        /// The user.
        uid: Uid,
        /// The plugin.
        plugin: String,
    },
    /// Records a message event in the channel's bounded projection (oldest dropped beyond the bound).
    AppendMessageEvent {
        /// The channel.
        channel: ChannelId,
        /// The event.
        event: MessageEvent,
    },
    /// Sets the controller's intent for a slot group. `route` is the group's intent routing key under
    /// the current table ([`group_intent_route`]): the command lands in the group it is about.
    PutGroupIntent {
        /// Routing bytes that hash to a slot of the group.
        route: Vec<u8>,
        /// The intent.
        intent: GroupIntent,
    },
    /// Starts moving `group`'s replica from node `from` to node `to`: records the move's target voters in
    /// the group's intent (one move at a time). The group's leader then carries it out.
    MoveGroupReplica {
        /// Routing bytes that hash to a slot of the group ([`group_intent_route`]).
        route: Vec<u8>,
        /// The group.
        group: GroupId,
        /// The voter to move away.
        from: NodeId,
        /// The node to move it to.
        to: NodeId,
    },
    /// Sets (or clears) `group`'s preferred leader, leaving the rest of its intent as it is.
    SetPreferredLeader {
        /// Routing bytes that hash to a slot of the group ([`group_intent_route`]).
        route: Vec<u8>,
        /// The group.
        group: GroupId,
        /// The node that should lead it; `None` clears the preference.
        preferred: Option<NodeId>,
    },
    /// Starts (or, with `drain: false`, stops) draining `node` in `group`: its leader moves the group's
    /// replica off the node and replaces the node's channel replicas in the group's slots.
    DrainNode {
        /// Routing bytes that hash to a slot of the group ([`group_intent_route`]).
        route: Vec<u8>,
        /// The group.
        group: GroupId,
        /// The node.
        node: NodeId,
        /// `true` to drain, `false` to stop draining.
        drain: bool,
    },
    /// Abandons `group`'s replica move in progress: the move is retargeted to the committed assignment, so
    /// its leader takes the membership back and commits it.
    AbortGroupMove {
        /// Routing bytes that hash to a slot of the group.
        route: Vec<u8>,
        /// The group.
        group: GroupId,
    },
    /// Commits `group`'s membership in force at this entry (voters and configuration epoch) as its assignment,
    /// when it equals the move's target.
    CommitGroupConfig {
        /// Routing bytes that hash to a slot of the group.
        route: Vec<u8>,
        /// The group.
        group: GroupId,
    },
}

/// What a command's hash slot is computed from.
pub enum RoutingKey<'a> {
    /// A user id.
    Uid(&'a Uid),
    /// A channel.
    Channel(&'a ChannelId),
    /// Raw routing bytes (group-level records, see [`group_intent_route`]).
    Raw(&'a [u8]),
}

impl RoutingKey<'_> {
    /// The bytes hashed to find the slot.
    pub fn bytes(&self) -> &[u8] {
        match self {
            RoutingKey::Uid(uid) => uid.as_str().as_bytes(),
            RoutingKey::Channel(channel) => channel.route_key(),
            RoutingKey::Raw(bytes) => bytes,
        }
    }
}

impl Command {
    /// The key whose hash slot the command belongs to.
    pub fn routing_key(&self) -> RoutingKey<'_> {
        use Command::*;
        match self {
            PutUser(user) => RoutingKey::Uid(&user.uid),
            PutDevice(device) => RoutingKey::Uid(&device.uid),
            RemoveDevice { uid, .. }
            | AddSystemUid(uid)
            | RemoveSystemUid(uid)
            | PutMembership { uid, .. }
            | RemoveMembership { uid, .. }
            | PutCmdBinding { uid, .. }
            | RemovePluginBinding { uid, .. } => RoutingKey::Uid(uid),
            PutPluginBinding(binding) => RoutingKey::Uid(&binding.uid),
            CreateChannel(info) => RoutingKey::Channel(&info.channel),
            UpdateChannelFlags { channel, .. }
            | AddMembers { channel, .. }
            | RemoveMembers { channel, .. }
            | RemoveMigrationTask { channel, .. }
            | AppendMessageEvent { channel, .. } => RoutingKey::Channel(channel),
            CreateRuntimeMeta(meta) | CasRuntimeMeta { meta, .. } => RoutingKey::Channel(&meta.channel),
            PutMigrationTask(task) => RoutingKey::Channel(&task.channel),
            PutGroupIntent { route, .. }
            | MoveGroupReplica { route, .. }
            | SetPreferredLeader { route, .. }
            | DrainNode { route, .. }
            | AbortGroupMove { route, .. }
            | CommitGroupConfig { route, .. } => RoutingKey::Raw(route),
        }
    }

    /// Encodes the command in the versioned envelope.
    pub fn encode(&self) -> Vec<u8> {
        // Cannot fail: every field serializes, into memory.
        postcard::to_allocvec(&(COMMAND_VERSION, self)).expect("command encodes")
    }

    /// Decodes a command, refusing newer envelope versions and garbage with a typed error.
    pub fn decode(bytes: &[u8]) -> Result<Command, DecodeError> {
        let (version, rest): (u16, &[u8]) = postcard::take_from_bytes(bytes).map_err(|_| DecodeError::Malformed)?;
        if version > COMMAND_VERSION {
            return Err(DecodeError::UnsupportedVersion { got: version, max: COMMAND_VERSION });
        }
        let (command, rest): (Command, &[u8]) = postcard::take_from_bytes(rest).map_err(|_| DecodeError::Malformed)?;
        if !rest.is_empty() {
            return Err(DecodeError::Malformed);
        }
        Ok(command)
    }
}

/// Why bytes are not a command.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
#[non_exhaustive]
pub enum DecodeError {
    /// Not a command of any version.
    #[error("malformed command")]
    Malformed,
    /// A command from a newer version of tidings.
    #[error("command version {got} is newer than the supported {max}")]
    UnsupportedVersion {
        /// Version found.
        got: u16,
        /// Newest supported.
        max: u16,
    },
}

/// Routing bytes for `group`'s intent under `table`: the first of `group-intent/<group>/<n>` whose hash
/// slot the group owns, so the intent is stored in (and replicated by) the group it describes.
pub fn group_intent_route(table: &tidings_router::HashToSlot, group: tidings_types::GroupId) -> Option<Vec<u8>> {
    (0u32..100_000)
        .map(|n| format!("group-intent/{}/{n}", group.get()).into_bytes())
        .find(|route| table.group_of_key(route) == group)
}
