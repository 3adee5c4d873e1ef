//! Reads of slot metadata: point reads and paged scans, decoded and checked. The caller decides whether
//! the store it reads is authoritative (after a ReadIndex on the group's leader) or local.

use crate::command::MemberList;
use crate::keys::{read_uid, Key, Kind};
use crate::model::{
    ChannelInfo, CmdBinding, Device, GroupIntent, Membership, MessageEvent, MigrationTask, PluginBinding, Uid, User,
};
use serde::de::DeserializeOwned;
use tidings_router::hash_slot;
use tidings_store::{CorruptLocation, Keyspace, MetaStore, StoreError, StoreResult};
use tidings_types::{ChannelId, ChannelRuntimeMeta, HashSlot};

/// A page of a scan and where to continue.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Page<T> {
    /// Items, in key order.
    pub items: Vec<T>,
    /// Pass back to get the next page; `None` when done.
    pub cursor: Option<Vec<u8>>,
}

/// Typed reads over a metadata store.
#[derive(Clone)]
pub struct SlotReader {
    store: MetaStore,
}

impl SlotReader {
    /// Reads `store`.
    pub fn new(store: MetaStore) -> Self {
        Self { store }
    }

    /// A user.
    pub fn user(&self, uid: &Uid) -> StoreResult<Option<User>> {
        self.get(uid_slot(uid), Key::new(Kind::User).uid(uid).build())
    }

    /// A user's device.
    pub fn device(&self, uid: &Uid, device_flag: u8) -> StoreResult<Option<Device>> {
        self.get(uid_slot(uid), Key::new(Kind::Device).uid(uid).u8(device_flag).build())
    }

    /// `true` if `uid` is a system uid.
    pub fn is_system_uid(&self, uid: &Uid) -> StoreResult<bool> {
        Ok(self.store.get(uid_slot(uid), &Key::new(Kind::SystemUid).uid(uid).build())?.is_some())
    }

    /// A channel definition.
    pub fn channel(&self, channel: &ChannelId) -> StoreResult<Option<ChannelInfo>> {
        self.get(channel_slot(channel), Key::new(Kind::Channel).channel(channel).build())
    }

    /// A channel's runtime meta.
    pub fn runtime_meta(&self, channel: &ChannelId) -> StoreResult<Option<ChannelRuntimeMeta>> {
        self.get(channel_slot(channel), Key::new(Kind::RuntimeMeta).channel(channel).build())
    }

    /// `true` if `uid` is on the channel's `list`.
    pub fn is_member(&self, channel: &ChannelId, list: MemberList, uid: &Uid) -> StoreResult<bool> {
        let key = Key::new(list_kind(list)).channel(channel).uid(uid).build();
        Ok(self.store.get(channel_slot(channel), &key)?.is_some())
    }

    /// A page of up to `limit` uids of the channel's `list`, after `cursor`.
    pub fn members(
        &self,
        channel: &ChannelId,
        list: MemberList,
        cursor: Option<&[u8]>,
        limit: usize,
    ) -> StoreResult<Page<Uid>> {
        let slot = channel_slot(channel);
        let prefix = Key::new(list_kind(list)).channel(channel).build();
        let page = self.store.scan(slot, &prefix, cursor, limit)?;
        let items = page
            .entries
            .iter()
            .map(|(key, _)| {
                read_uid(&key[prefix.len()..])
                    .map(|(uid, _)| uid)
                    .ok_or_else(|| corrupt(key, "member key does not decode"))
            })
            .collect::<StoreResult<Vec<_>>>()?;
        Ok(Page { items, cursor: page.next_after })
    }

    /// A user's membership state of a channel.
    pub fn membership(&self, uid: &Uid, channel: &ChannelId) -> StoreResult<Option<Membership>> {
        self.get(uid_slot(uid), Key::new(Kind::Membership).uid(uid).channel(channel).build())
    }

    /// A page of a user's memberships, after `cursor`.
    pub fn memberships(
        &self,
        uid: &Uid,
        cursor: Option<&[u8]>,
        limit: usize,
    ) -> StoreResult<Page<(ChannelId, Membership)>> {
        let slot = uid_slot(uid);
        let prefix = Key::new(Kind::Membership).uid(uid).build();
        let page = self.store.scan(slot, &prefix, cursor, limit)?;
        let items = page
            .entries
            .iter()
            .map(|(key, value)| {
                let (channel, _) = ChannelId::decode_key(&key[prefix.len()..])
                    .ok_or_else(|| corrupt(key, "membership key does not decode"))?;
                Ok((channel, decode(key, value)?))
            })
            .collect::<StoreResult<Vec<_>>>()?;
        Ok(Page { items, cursor: page.next_after })
    }

    /// A user's CMD binding of a channel.
    pub fn cmd_binding(&self, uid: &Uid, channel: &ChannelId) -> StoreResult<Option<CmdBinding>> {
        self.get(uid_slot(uid), Key::new(Kind::CmdBinding).uid(uid).channel(channel).build())
    }

    /// A migration task.
    pub fn task(&self, channel: &ChannelId, id: u64) -> StoreResult<Option<MigrationTask>> {
        self.get(channel_slot(channel), Key::new(Kind::Task).channel(channel).u64(id).build())
    }

    /// The controller's intent for `group`, stored in the slot its intent route hashes to under `table`.
    pub fn group_intent(
        &self,
        table: &tidings_router::HashToSlot,
        group: tidings_types::GroupId,
    ) -> StoreResult<Option<GroupIntent>> {
        let Some(route) = crate::command::group_intent_route(table, group) else { return Ok(None) };
        self.get(hash_slot(&route), Key::new(Kind::GroupIntent).u64(u64::from(group.get())).build())
    }

    /// A plugin binding.
    pub fn plugin(&self, uid: &Uid, plugin: &str) -> StoreResult<Option<PluginBinding>> {
        self.get(uid_slot(uid), Key::new(Kind::Plugin).uid(uid).text(plugin).build())
    }

    /// The channel's recent message events, oldest first (bounded by the FSM).
    pub fn events(&self, channel: &ChannelId, limit: usize) -> StoreResult<Vec<MessageEvent>> {
        let prefix = Key::new(Kind::Event).channel(channel).build();
        let page = self.store.scan(channel_slot(channel), &prefix, None, limit)?;
        page.entries.iter().map(|(key, value)| decode(key, value)).collect()
    }

    /// A page of up to `limit` runtime metas of the channels in hash slot `slot`, after `cursor` (the
    /// controller's repair loop walks its slots with it).
    pub fn runtime_metas(
        &self,
        slot: HashSlot,
        cursor: Option<&[u8]>,
        limit: usize,
    ) -> StoreResult<Page<ChannelRuntimeMeta>> {
        let prefix = Key::new(Kind::RuntimeMeta).build();
        let page = self.store.scan(slot, &prefix, cursor, limit)?;
        let items = page.entries.iter().map(|(key, value)| decode(key, value)).collect::<StoreResult<Vec<_>>>()?;
        Ok(Page { items, cursor: page.next_after })
    }

    fn get<T: DeserializeOwned>(&self, slot: HashSlot, key: Vec<u8>) -> StoreResult<Option<T>> {
        match self.store.get(slot, &key)? {
            None => Ok(None),
            Some(value) => decode(&key, &value).map(Some),
        }
    }
}

fn list_kind(list: MemberList) -> Kind {
    match list {
        MemberList::Subscribers => Kind::Subscriber,
        MemberList::Allow => Kind::Allow,
        MemberList::Deny => Kind::Deny,
    }
}

fn uid_slot(uid: &Uid) -> HashSlot {
    hash_slot(uid.as_str().as_bytes())
}

fn channel_slot(channel: &ChannelId) -> HashSlot {
    hash_slot(channel.route_key())
}

fn corrupt(key: &[u8], detail: &'static str) -> StoreError {
    StoreError::Corrupt { location: CorruptLocation::Kv { keyspace: Keyspace::Meta, key: key.to_vec() }, detail }
}

fn decode<T: DeserializeOwned>(key: &[u8], value: &[u8]) -> StoreResult<T> {
    postcard::from_bytes(value).map_err(|_| corrupt(key, "metadata value does not decode"))
}
