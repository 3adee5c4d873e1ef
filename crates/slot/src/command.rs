//! Commands of the slot FSM: typed, serde-encoded in a versioned envelope so a node refuses a command
//! from a newer version clearly instead of misreading it.

use crate::model::{
    ChannelFlags, ChannelInfo, CmdBinding, Device, GroupIntent, Membership, MessageEvent, MigrationTask, PluginBinding,
    SlotMigrationStep, SwitchProof, Uid, User,
};
use serde::{Deserialize, Serialize};
use tidings_types::{ChannelId, ChannelRuntimeMeta, GroupId, HashSlot, NodeId};

/// Version of the command encoding this build writes and the newest it understands.
pub const COMMAND_VERSION: u16 = 3;

/// Which per-channel member list a command changes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
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
    /// Sets the controller's intent for a slot group (proposed to that group).
    PutGroupIntent(GroupIntent),
    /// Starts moving `group`'s replica from node `from` to node `to`: records the move's target voters in
    /// the group's intent (one move at a time). The group's leader then carries it out.
    MoveGroupReplica {
        /// The group.
        group: GroupId,
        /// The voter to move away.
        from: NodeId,
        /// The node to move it to.
        to: NodeId,
    },
    /// Sets (or clears) `group`'s preferred leader, leaving the rest of its intent as it is.
    SetPreferredLeader {
        /// The group.
        group: GroupId,
        /// The node that should lead it; `None` clears the preference.
        preferred: Option<NodeId>,
    },
    /// Starts (or, with `drain: false`, stops) draining `node` in `group`: its leader moves the group's
    /// replica off the node and replaces the node's channel replicas in the group's slots.
    DrainNode {
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
        /// The group.
        group: GroupId,
    },
    /// Commits `group`'s membership in force at this entry (voters and configuration epoch) as its assignment,
    /// when it equals the move's target.
    CommitGroupConfig {
        /// The group.
        group: GroupId,
    },
    /// One step of migrating hash slot `slot` between slot groups, proposed to `group` (the source or
    /// the target: see [`SlotMigrationStep`]).
    MigrateSlot {
        /// The group the step is for.
        group: GroupId,
        /// The hash slot.
        slot: HashSlot,
        /// The step.
        step: SlotMigrationStep,
    },
}

/// What a command's hash slot is computed from.
pub enum RoutingKey<'a> {
    /// A user id.
    Uid(&'a Uid),
    /// A channel.
    Channel(&'a ChannelId),
}

/// Where a command belongs: the group owning the hash slot of a routing key, or one named group (the
/// group-level commands: intent, membership moves, slot migrations).
pub enum CommandScope<'a> {
    /// The group owning this key's hash slot.
    Key(RoutingKey<'a>),
    /// This group.
    Group(GroupId),
}

impl RoutingKey<'_> {
    /// The bytes hashed to find the slot.
    pub fn bytes(&self) -> &[u8] {
        match self {
            RoutingKey::Uid(uid) => uid.as_str().as_bytes(),
            RoutingKey::Channel(channel) => channel.route_key(),
        }
    }
}

impl Command {
    /// Where the command belongs.
    pub fn scope(&self) -> CommandScope<'_> {
        use Command::*;
        let key = match self {
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
            PutGroupIntent(intent) => return CommandScope::Group(intent.group),
            MoveGroupReplica { group, .. }
            | SetPreferredLeader { group, .. }
            | DrainNode { group, .. }
            | AbortGroupMove { group, .. }
            | CommitGroupConfig { group, .. }
            | MigrateSlot { group, .. } => return CommandScope::Group(*group),
        };
        CommandScope::Key(key)
    }

    /// The group the command belongs to under `table`.
    pub fn group_under(&self, table: &tidings_router::HashToSlot) -> GroupId {
        match self.scope() {
            CommandScope::Key(key) => table.group_of_key(key.bytes()),
            CommandScope::Group(group) => group,
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
