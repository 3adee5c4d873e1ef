//! Metadata against what was acknowledged. Each metadata write the workload checks sets one or more
//! registers whole: a user on a channel's member list, a device, a membership, a plugin binding, a
//! system uid. Where the last change asked for a register was acknowledged, and every earlier change
//! to it was acknowledged before that last one was asked for, the order of their commits is known:
//! every replica of the group owning the register's hash slot must show what the last change left. A
//! change applied twice (a forwarded proposal delivered again after a later change), a removal lost in
//! a slot migration's marks, or a snapshot missing a key breaks it. A register with a change refused,
//! unanswered or racing another is not checked: its commit order is not known.

use super::World;
use std::collections::BTreeMap;
use tidings::node::{ApiId, ApiResult};
use tidings::slot::command::{Command, MemberList, RoutingKey};
use tidings::slot::model::{Device, Membership, Uid};
use tidings::slot::query::SlotReader;
use tidings::store::StoreResult;
use tidings::types::{ChannelId, Time};

/// One piece of metadata a command sets whole.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Register {
    /// `uid` on one of `channel`'s lists.
    Member { channel: ChannelId, list: MemberList, uid: Uid },
    /// A user's device of one kind.
    Device { uid: Uid, flag: u8 },
    /// A user's membership state of a channel.
    Membership { uid: Uid, channel: ChannelId },
    /// A user's binding of one plugin.
    Plugin { uid: Uid, plugin: String },
    /// A uid marked a system uid.
    SystemUid(Uid),
}

/// What a register holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Held {
    /// On the list, bound, marked (or not).
    Present(bool),
    /// The device record, if any.
    Device(Option<Device>),
    /// The membership record, if any.
    Membership(Option<Membership>),
}

/// One metadata write asked for, and the registers it sets.
pub(super) struct RegisterChange {
    sets: Vec<(Register, Held)>,
    asked: Time,
    /// When it was acknowledged applied (`None`: refused, failed or unanswered).
    acknowledged: Option<Time>,
}

/// The registers `command` sets, and what it leaves in each; empty for a command not checked.
fn sets_of(command: &Command) -> Vec<(Register, Held)> {
    let member =
        |channel: &ChannelId, list, uid: &Uid| Register::Member { channel: channel.clone(), list, uid: uid.clone() };
    match command {
        Command::AddMembers { channel, list, uids } => {
            uids.iter().map(|uid| (member(channel, *list, uid), Held::Present(true))).collect()
        }
        Command::RemoveMembers { channel, list, uids } => {
            uids.iter().map(|uid| (member(channel, *list, uid), Held::Present(false))).collect()
        }
        Command::PutDevice(device) => {
            let register = Register::Device { uid: device.uid.clone(), flag: device.device_flag };
            vec![(register, Held::Device(Some(device.clone())))]
        }
        Command::RemoveDevice { uid, device_flag } => {
            vec![(Register::Device { uid: uid.clone(), flag: *device_flag }, Held::Device(None))]
        }
        Command::PutMembership { uid, channel, membership } => {
            let register = Register::Membership { uid: uid.clone(), channel: channel.clone() };
            vec![(register, Held::Membership(Some(*membership)))]
        }
        Command::RemoveMembership { uid, channel } => {
            vec![(Register::Membership { uid: uid.clone(), channel: channel.clone() }, Held::Membership(None))]
        }
        Command::PutPluginBinding(binding) => {
            let register = Register::Plugin { uid: binding.uid.clone(), plugin: binding.plugin.clone() };
            vec![(register, Held::Present(true))]
        }
        Command::RemovePluginBinding { uid, plugin } => {
            vec![(Register::Plugin { uid: uid.clone(), plugin: plugin.clone() }, Held::Present(false))]
        }
        Command::AddSystemUid(uid) => vec![(Register::SystemUid(uid.clone()), Held::Present(true))],
        Command::RemoveSystemUid(uid) => vec![(Register::SystemUid(uid.clone()), Held::Present(false))],
        _ => Vec::new(),
    }
}

impl Register {
    /// The key that routes the register to its hash slot.
    fn routing_key(&self) -> RoutingKey<'_> {
        match self {
            Register::Member { channel, .. } => RoutingKey::Channel(channel),
            Register::Device { uid, .. }
            | Register::Membership { uid, .. }
            | Register::Plugin { uid, .. }
            | Register::SystemUid(uid) => RoutingKey::Uid(uid),
        }
    }

    /// What `reader` (one group's copy) shows of the register.
    fn read(&self, reader: &SlotReader) -> StoreResult<Held> {
        Ok(match self {
            Register::Member { channel, list, uid } => Held::Present(reader.is_member(channel, *list, uid)?),
            Register::Device { uid, flag } => Held::Device(reader.device(uid, *flag)?),
            Register::Membership { uid, channel } => Held::Membership(reader.membership(uid, channel)?),
            Register::Plugin { uid, plugin } => Held::Present(reader.plugin(uid, plugin)?.is_some()),
            Register::SystemUid(uid) => Held::Present(reader.is_system_uid(uid)?),
        })
    }
}

impl World {
    /// A metadata write the final check follows was asked for as request `api`.
    pub(super) fn register_change_asked(&mut self, api: ApiId, command: &Command) {
        let sets = sets_of(command);
        if !sets.is_empty() {
            self.register_changes.insert(api, RegisterChange { sets, asked: self.now, acknowledged: None });
        }
    }

    /// Request `api` was answered with `result`: a followed write's acknowledgement is noted.
    pub(super) fn register_change_answered(&mut self, api: ApiId, result: &ApiResult) {
        if let Some(change) = self.register_changes.get_mut(&api) {
            if matches!(result, ApiResult::Meta(Ok(()))) {
                change.acknowledged = Some(self.now);
            }
        }
    }

    /// Once healed: every register whose last change is known shows it on every replica of its group.
    pub(super) fn check_registers(&mut self) {
        let mut by_register: BTreeMap<&Register, Vec<(&RegisterChange, &Held)>> = BTreeMap::new();
        for change in self.register_changes.values() {
            for (register, held) in &change.sets {
                by_register.entry(register).or_default().push((change, held));
            }
        }
        let mut expected = Vec::new();
        for (register, changes) in by_register {
            let Some(&(last, held)) = changes.iter().max_by_key(|(c, _)| c.asked) else { continue };
            let ordered = last.acknowledged.is_some()
                && changes
                    .iter()
                    .filter(|(c, _)| !std::ptr::eq(*c, last))
                    .all(|(c, _)| c.acknowledged.is_some_and(|t| t < last.asked));
            if ordered {
                expected.push((register.clone(), held.clone()));
            }
        }
        self.faults.registers_checked += expected.len() as u64;
        for (register, held) in expected {
            let slot = tidings::router::hash_slot(register.routing_key().bytes());
            let group = self.owner_of(slot);
            let members = self.group_members(group);
            for (id, node) in self.nodes.iter().filter(|(id, _)| members.contains(id)) {
                let Some(core) = node.core.as_ref() else { continue };
                let found = register.read(&core.reader().in_copy(group));
                if !matches!(&found, Ok(shown) if *shown == held) {
                    self.oracle.violation(format!(
                        "{id}: {register:?} is {found:?} in {group}, but its last acknowledged change left {held:?}"
                    ));
                }
            }
        }
    }
}
