//! Reads of slot metadata: point reads and paged scans, decoded and checked. The caller decides whether
//! the store it reads is authoritative (after a ReadIndex on the group's leader) or local.
//!
//! A key is read from the copy of its hash slot that this node's placement names (the group serving the
//! slot as far as this node knows: see `MetaStore::placement`); a node that holds no replica of that group
//! reads nothing.

use crate::command::{MemberList, RoutingKey};
use crate::keys::{plugin_key, read_uid, Key, Kind};
use crate::model::{
    ChannelInfo, CmdBinding, Device, GroupIntent, Membership, MessageEvent, MigrationTask, PluginBinding, SlotRecord,
    SlotState, Uid, User,
};
use parking_lot::Mutex;
use serde::de::DeserializeOwned;
use tidings_router::hash_slot;
use tidings_store::{CorruptLocation, Keyspace, MetaPage, MetaSpace, MetaStore, StoreError, StoreResult};
use tidings_types::{ChannelId, ChannelRuntimeMeta, GroupId, HashSlot};

/// A page of a scan and where to continue.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Page<T> {
    /// Items, in key order.
    pub items: Vec<T>,
    /// Pass back to get the next page; `None` when done.
    pub cursor: Option<Vec<u8>>,
}

/// Typed reads over a metadata store.
pub struct SlotReader {
    store: MetaStore,
    /// [`SlotRoutes`] by hash slot, with the [`MetaStore::routes_version`] they were read at: every read
    /// looks its slot's placement up, and a sender check the owner copy of two slots (two store reads
    /// each), where the key itself is one read.
    routes: Mutex<Vec<Option<(u64, SlotRoutes)>>>,
    /// Set by [`SlotReader::in_copy`]: every key is read from this group's copy of its hash slot.
    copy: Option<GroupId>,
}

/// Where one hash slot is read on this node.
#[derive(Clone, Copy, Debug, Default)]
struct SlotRoutes {
    /// The group this node's placement names.
    placed: Option<GroupId>,
    /// That group, if its copy here is the serving one ([`SlotReader::owner_copy`]).
    owner: Option<GroupId>,
}

impl Clone for SlotReader {
    /// A reader of the same store with a cache of its own (a clone usually goes to another thread).
    fn clone(&self) -> Self {
        Self { copy: self.copy, ..Self::new(self.store.clone()) }
    }
}

impl SlotReader {
    /// Reads `store`.
    pub fn new(store: MetaStore) -> Self {
        // Filled on first use: a reader made for one lookup allocates no cache.
        Self { store, routes: Mutex::new(Vec::new()), copy: None }
    }

    /// A reader of the same store that reads every key from `copy`'s copy of its hash slot, whatever
    /// this node's placement names: to compare the replicas of one group, or a group's copy of a slot
    /// it is importing or exported.
    ///
    /// ```
    /// # use tidings_slot::query::SlotReader;
    /// # use tidings_slot::model::Uid;
    /// # use tidings_store::{MemoryKv, MetaStore};
    /// # use tidings_types::GroupId;
    /// # use std::sync::Arc;
    /// let reader = SlotReader::new(MetaStore::new(Arc::new(MemoryKv::new())));
    /// let uid = Uid::new("alice").unwrap();
    /// // What group 2's copy of alice's hash slot holds on this node, placed there or not (the
    /// // simulator compares it across the group's replicas).
    /// let device = reader.in_copy(GroupId::new(2)).device(&uid, 1)?;
    /// println!("{device:?}");
    /// # Ok::<(), tidings_store::StoreError>(())
    /// ```
    pub fn in_copy(&self, copy: GroupId) -> SlotReader {
        Self { copy: Some(copy), ..Self::new(self.store.clone()) }
    }

    /// The store's [`MetaStore::routes_version`]: reads made while it stayed the same saw no change to
    /// placements or groups' own records (a replica destroyed here clears its group's).
    pub fn routes_version(&self) -> u64 {
        self.store.routes_version()
    }

    /// A user.
    pub fn user(&self, uid: &Uid) -> StoreResult<Option<User>> {
        self.get(uid_slot(uid), Key::new(Kind::User).uid(uid).build())
    }

    /// A user, read from `copy`'s copy of its hash slot (the group [`SlotReader::owner_copy`] named),
    /// whatever this node's placement says.
    pub fn user_in(&self, copy: GroupId, uid: &Uid) -> StoreResult<Option<User>> {
        self.get_in(MetaSpace::slot(copy, uid_slot(uid)), Key::new(Kind::User).uid(uid).build())
    }

    /// A user's device.
    pub fn device(&self, uid: &Uid, device_flag: u8) -> StoreResult<Option<Device>> {
        self.get(uid_slot(uid), Key::new(Kind::Device).uid(uid).u8(device_flag).build())
    }

    /// `true` if `uid` is a system uid.
    pub fn is_system_uid(&self, uid: &Uid) -> StoreResult<bool> {
        Ok(self.get_raw(uid_slot(uid), &Key::new(Kind::SystemUid).uid(uid).build())?.is_some())
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
        Ok(self.get_raw(channel_slot(channel), &key)?.is_some())
    }

    /// `true` if `uid` is on the channel's `list` in `copy`'s copy of the channel's hash slot.
    pub fn is_member_in(&self, copy: GroupId, channel: &ChannelId, list: MemberList, uid: &Uid) -> StoreResult<bool> {
        let key = Key::new(list_kind(list)).channel(channel).uid(uid).build();
        Ok(self.store.get(MetaSpace::slot(copy, channel_slot(channel)), &key)?.is_some())
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
        let page = self.scan(slot, &prefix, cursor, limit)?;
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
        let page = self.scan(slot, &prefix, cursor, limit)?;
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

    /// The controller's intent for `group` (one of the group's own records), as this node's replica of the
    /// group has it.
    pub fn group_intent(&self, group: GroupId) -> StoreResult<Option<GroupIntent>> {
        self.get_in(MetaSpace::group_records(group), Key::new(Kind::GroupIntent).build())
    }

    /// `group`'s stored record of hash slot `slot`, as this node's replica of the group has it (`None`:
    /// the slot never migrated to or from the group; the genesis table says whether the group owns it).
    pub fn slot_record(&self, group: GroupId, slot: HashSlot) -> StoreResult<Option<SlotRecord>> {
        self.get_in(MetaSpace::group_records(group), crate::fsm::migration::record_key(slot))
    }

    /// The group whose copy of `slot` this node reads (the one its placement names), if that copy is the
    /// serving one as far as the group's replica here has applied: its record shows the group owning the
    /// slot at the placement's epoch or later (or, never migrated, no record at all). `None` while that
    /// replica has not yet applied the import its placement came from, or once the slot moved on: the
    /// copy may then lack recent writes, and a read that must not miss one asks elsewhere.
    pub fn owner_copy(&self, slot: HashSlot) -> StoreResult<Option<GroupId>> {
        Ok(self.routes(slot)?.owner)
    }

    /// Where `slot` is read on this node, from the cache while no write changed placements or groups'
    /// records since it was read.
    fn routes(&self, slot: HashSlot) -> StoreResult<SlotRoutes> {
        // The version is read before the store: a write after it moves it on, so an answer read from
        // before that write is never taken for a current one.
        let version = self.store.routes_version();
        let index = usize::from(slot.index());
        if let Some(&Some((read_at, routes))) = self.routes.lock().get(index) {
            if read_at == version {
                return Ok(routes);
            }
        }
        let routes = self.read_routes(slot)?;
        let mut cache = self.routes.lock();
        if cache.is_empty() {
            cache.resize(usize::from(tidings_types::HASH_SLOT_COUNT), None);
        }
        cache[index] = Some((version, routes));
        Ok(routes)
    }

    /// [`SlotReader::routes`] read from the store.
    fn read_routes(&self, slot: HashSlot) -> StoreResult<SlotRoutes> {
        let Some(placement) = self.store.placement(slot)? else { return Ok(SlotRoutes::default()) };
        let current = match (self.slot_record(placement.group, slot)?, placement.epoch) {
            (None, 0) => true,
            (None, _) => false,
            (Some(record), epoch) => {
                record.epoch >= epoch
                    && matches!(record.state, SlotState::Owned | SlotState::Exporting { .. } | SlotState::Fenced { .. })
            }
        };
        Ok(SlotRoutes { placed: Some(placement.group), owner: current.then_some(placement.group) })
    }

    /// [`SlotReader::owner_copy`] of the hash slot `key` routes to.
    pub fn owner_copy_of(&self, key: RoutingKey<'_>) -> StoreResult<Option<GroupId>> {
        self.owner_copy(hash_slot(key.bytes()))
    }

    /// Every hash slot `group`'s records name (slots it migrated away, is migrating, or received), as this
    /// node's replica of the group has them. At most one per hash slot.
    pub fn slot_records(&self, group: GroupId) -> StoreResult<Vec<(HashSlot, SlotRecord)>> {
        let prefix = Key::new(Kind::SlotRecord).build();
        let space = MetaSpace::group_records(group);
        let page = self.store.scan(space, &prefix, None, usize::from(tidings_types::HASH_SLOT_COUNT))?;
        page.entries
            .iter()
            .map(|(key, value)| {
                let slot = key
                    .get(1..3)
                    .and_then(|b| HashSlot::new(u16::from_be_bytes([b[0], b[1]])))
                    .ok_or_else(|| corrupt(key, "slot record key does not decode"))?;
                Ok((slot, decode(key, value)?))
            })
            .collect()
    }

    /// Up to `limit` keys of hash slot `slot` written while `group` exported it (to be copied once the slot
    /// is fenced), after `cursor`: a key of an earlier page (the page's own cursor is its last key).
    pub fn slot_marks(
        &self,
        group: GroupId,
        slot: HashSlot,
        cursor: Option<&[u8]>,
        limit: usize,
    ) -> StoreResult<Page<Vec<u8>>> {
        let prefix = crate::fsm::migration::marks_prefix(slot);
        // The store's cursors are whole keys; the pages list keys without the marks' prefix. A cursor
        // taken from the items once made the next page start over at the first mark, and a migration
        // with more marks than a page copied them round and round in its last phase for ever.
        let after = cursor.map(|key| [prefix.as_slice(), key].concat());
        let page = self.store.scan(MetaSpace::group_records(group), &prefix, after.as_deref(), limit)?;
        let items = page.entries.iter().map(|(key, _)| key[prefix.len()..].to_vec()).collect();
        let cursor = page.next_after.map(|key| key[prefix.len()..].to_vec());
        Ok(Page { items, cursor })
    }

    /// The raw value of `key` in `group`'s copy of hash slot `slot` (a migration copies these).
    pub fn raw_in(&self, group: GroupId, slot: HashSlot, key: &[u8]) -> StoreResult<Option<Vec<u8>>> {
        self.store.get(MetaSpace::slot(group, slot), key)
    }

    /// A bounded chunk of `group`'s copy of hash slot `slot` (raw keys and values), after `cursor`.
    pub fn export_slot(
        &self,
        group: GroupId,
        slot: HashSlot,
        cursor: Option<&[u8]>,
        max_bytes: usize,
    ) -> StoreResult<Page<(Vec<u8>, Vec<u8>)>> {
        let space = MetaSpace::slot(group, slot);
        let cursor = cursor.map(|key| tidings_store::ExportCursor { space, key: key.to_vec() });
        let chunk = self.store.export_space(space, cursor.as_ref(), max_bytes)?;
        Ok(Page {
            items: chunk.entries.into_iter().map(|e| (e.key, e.value)).collect(),
            cursor: chunk.next.map(|c| c.key),
        })
    }

    /// A plugin binding.
    pub fn plugin(&self, uid: &Uid, plugin: &str) -> StoreResult<Option<PluginBinding>> {
        match plugin_key(uid, plugin) {
            Some(key) => self.get(uid_slot(uid), key),
            None => Ok(None),
        }
    }

    /// The channel's recent message events, oldest first (bounded by the FSM).
    pub fn events(&self, channel: &ChannelId, limit: usize) -> StoreResult<Vec<MessageEvent>> {
        let prefix = Key::new(Kind::Event).channel(channel).build();
        let page = self.scan(channel_slot(channel), &prefix, None, limit)?;
        page.entries.iter().map(|(key, value)| decode(key, value)).collect()
    }

    /// A page of up to `limit` runtime metas of the channels in `group`'s copy of hash slot `slot`, after
    /// `cursor` (the controller's repair loop walks its groups' slots with it).
    pub fn runtime_metas(
        &self,
        group: GroupId,
        slot: HashSlot,
        cursor: Option<&[u8]>,
        limit: usize,
    ) -> StoreResult<Page<ChannelRuntimeMeta>> {
        let prefix = Key::new(Kind::RuntimeMeta).build();
        let page = self.store.scan(MetaSpace::slot(group, slot), &prefix, cursor, limit)?;
        let items = page.entries.iter().map(|(key, value)| decode(key, value)).collect::<StoreResult<Vec<_>>>()?;
        Ok(Page { items, cursor: page.next_after })
    }

    /// The group whose copy of `slot` this node reads: its placement, or the copy [`SlotReader::in_copy`]
    /// named.
    fn space(&self, slot: HashSlot) -> StoreResult<Option<MetaSpace>> {
        if let Some(copy) = self.copy {
            return Ok(Some(MetaSpace::slot(copy, slot)));
        }
        Ok(self.routes(slot)?.placed.map(|group| MetaSpace::slot(group, slot)))
    }

    fn get_raw(&self, slot: HashSlot, key: &[u8]) -> StoreResult<Option<Vec<u8>>> {
        match self.space(slot)? {
            Some(space) => self.store.get(space, key),
            None => Ok(None),
        }
    }

    fn scan(&self, slot: HashSlot, prefix: &[u8], cursor: Option<&[u8]>, limit: usize) -> StoreResult<MetaPage> {
        match self.space(slot)? {
            Some(space) => self.store.scan(space, prefix, cursor, limit),
            None => Ok(MetaPage::default()),
        }
    }

    fn get<T: DeserializeOwned>(&self, slot: HashSlot, key: Vec<u8>) -> StoreResult<Option<T>> {
        match self.get_raw(slot, &key)? {
            None => Ok(None),
            Some(value) => decode(&key, &value).map(Some),
        }
    }

    fn get_in<T: DeserializeOwned>(&self, space: MetaSpace, key: Vec<u8>) -> StoreResult<Option<T>> {
        match self.store.get(space, &key)? {
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
