//! The slot FSM: applies committed commands of one slot group to the metadata store, a whole batch plus
//! the group's new applied index in ONE atomic write.
//!
//! Every command of a hash slot is checked against the group's own record of the slot first (the genesis
//! table for slots that never migrated, see [`migration`]): a command whose slot this group does not
//! serve is refused (typed, deterministic, with the owner to go to), so a write routed with a stale table
//! never lands in the wrong group, whatever table the node has learned. Expected races — a create of an existing key, a compare-and-set on an older version — are
//! deterministic [`Outcome`]s, identical on every replica, never failures of the group.

mod intent;
pub mod migration;

use crate::command::{Command, CommandScope, DecodeError, MemberList};
use crate::keys::{plugin_key, Key, Kind};
use crate::model::{GroupIntent, SlotMigrationStep, SlotRecord, SlotState, SwitchProof, Uid, PLUGIN_NAME_BYTES_MAX};
use intent::{change_intent, IntentChange};
use migration::SlotMigrationError;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use tidings_router::{hash_slot, HashToSlot};
use tidings_store::{MetaSpace, MetaStore, MetaWriteBatch, Placement, StoreResult};
use tidings_types::{ChannelId, ChannelRuntimeMeta, ConfigEpoch, GroupId, HashSlot, MetaError, NodeId};

/// Limits the FSM enforces on commands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FsmLimits {
    /// Most uids in one member-list command. Default 1,000.
    pub members_per_command_max: usize,
    /// Message events kept per channel (oldest dropped). Default 64.
    pub events_per_channel_max: usize,
    /// Longest event summary, in bytes. Default 256.
    pub event_summary_bytes_max: usize,
}

impl Default for FsmLimits {
    fn default() -> Self {
        Self { members_per_command_max: 1000, events_per_channel_max: 64, event_summary_bytes_max: 256 }
    }
}

/// The result of applying one command. The same on every replica.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum Outcome {
    /// The change was applied.
    Applied,
    /// A create found the key already there; nothing changed.
    AlreadyExists,
    /// An update found no such key; nothing changed.
    NotFound,
    /// A compare-and-set was based on another version; nothing changed.
    VersionMismatch {
        /// The version in force.
        current: u64,
    },
    /// The command was refused; nothing changed.
    Refused(Refusal),
}

/// Why a command was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
#[non_exhaustive]
pub enum Refusal {
    /// This group does not serve the command's hash slot (and never did, or is still receiving it).
    #[error("{slot} belongs to {owner}, not to this group")]
    WrongSlot {
        /// The command's slot.
        slot: HashSlot,
        /// The group to ask instead (as far as this group knows).
        owner: GroupId,
    },
    /// The command's hash slot migrated to `owner` at ownership epoch `epoch`: a stale route. Learn the
    /// owner and send the command there.
    #[error("{slot} moved to {owner} at epoch {epoch}")]
    SlotMoved {
        /// The command's slot.
        slot: HashSlot,
        /// The group that owns it now.
        owner: GroupId,
        /// The slot's ownership epoch at `owner`.
        epoch: u64,
    },
    /// The command's hash slot is fenced for the last moments of its migration to `to`: retry shortly.
    #[error("{slot} is fenced while it migrates to {to}: retry")]
    SlotFenced {
        /// The command's slot.
        slot: HashSlot,
        /// The group it is moving to.
        to: GroupId,
    },
    /// A step of a hash-slot migration that does not fit.
    #[error("slot migration step refused: {0}")]
    Migration(SlotMigrationError),
    /// The entry does not decode as a command.
    #[error(transparent)]
    Decode(#[from] DecodeError),
    /// Too many items in one command.
    #[error("{count} items in one command, at most {max}")]
    TooMany {
        /// Items given.
        count: usize,
        /// The limit.
        max: usize,
    },
    /// A message event's summary exceeds its size limit.
    #[error("event summary of {len} bytes exceeds {max}")]
    SummaryTooLarge {
        /// Its length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// The meta is invalid on its own or as a successor.
    #[error(transparent)]
    InvalidMeta(#[from] MetaError),
    /// A leader switch without a valid proof.
    #[error("leader switch refused: {0}")]
    BadProof(ProofError),
    /// A group-level command for another group.
    #[error("the command is for {group}, not this group")]
    WrongGroup {
        /// The group the command names.
        group: GroupId,
    },
    /// A change of the group's membership intent that does not fit the intent or membership in force.
    #[error("group membership change refused: {0}")]
    GroupChange(GroupChangeError),
    // New variants go last: refusals travel between nodes, whose versions differ during an upgrade.
    /// A plugin name longer than [`PLUGIN_NAME_BYTES_MAX`].
    #[error("plugin name of {len} bytes exceeds {max}")]
    PluginNameTooLong {
        /// Its length.
        len: usize,
        /// The limit.
        max: usize,
    },
}

/// Why a change of a slot group's membership intent was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
#[non_exhaustive]
pub enum GroupChangeError {
    /// Another replica move of the group is in progress (abort it or let it finish first).
    #[error("a replica move to {target:?} is in progress")]
    MoveInProgress {
        /// The voters that move is taking the group to.
        target: Vec<NodeId>,
    },
    /// No replica move is in progress.
    #[error("no replica move is in progress")]
    NoMoveInProgress,
    /// The node to move away is not a voter of the assignment.
    #[error("{0} is not a voter of the group")]
    NotAVoter(NodeId),
    /// The node to move to is a voter already.
    #[error("{0} is a voter of the group already")]
    AlreadyAVoter(NodeId),
    /// The node to move to is being drained.
    #[error("{0} is being drained")]
    TargetDraining(NodeId),
    /// The membership in force is not what the commit claims (not the target, or joint).
    #[error("the membership in force ({voters:?}, joint: {joint}) is not the intended {wanted:?}")]
    ConfigMismatch {
        /// Voters in force.
        voters: Vec<NodeId>,
        /// Whether the configuration is joint.
        joint: bool,
        /// The voters intended.
        wanted: Vec<NodeId>,
    },
    /// No move is in progress: the assignment is recorded already.
    #[error("no move to commit")]
    NothingToCommit,
}

/// The membership of the group in force at the entries being applied: the same on every replica at the
/// same index, so commands about the membership are checked against it deterministically.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GroupConf {
    /// Voters (the incoming ones while joint).
    pub voters: Vec<NodeId>,
    /// Learners.
    pub learners: Vec<NodeId>,
    /// The configuration is joint.
    pub joint: bool,
    /// The configuration epoch: raft index of the membership change that made this configuration.
    pub config_epoch: ConfigEpoch,
}

/// What is wrong with a leader switch's proof.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
#[non_exhaustive]
pub enum ProofError {
    /// No proof was given.
    #[error("a leader switch needs a proof")]
    Missing,
    /// The proof is based on another leader epoch.
    #[error("proof is based on another leader epoch")]
    WrongLeaderEpoch,
    /// Fewer than |ISR| − MinISR + 1 ISR members gave evidence.
    #[error("not enough evidence from the ISR")]
    NotEnoughEvidence,
    /// The new leader is not among the evidence.
    #[error("the new leader gave no evidence")]
    LeaderGaveNoEvidence,
    /// Another replica is more advanced than the new leader.
    #[error("the new leader is not the most advanced replica")]
    LeaderNotMostAdvanced,
}

/// Applies committed commands of one group.
pub struct SlotFsm {
    group: GroupId,
    store: MetaStore,
    limits: FsmLimits,
    /// The group's slot records as stored (`None`: no record), read once: every slot command checks its
    /// slot's. Updated after each write that changes one; [`SlotFsm::forget_records`] after the store
    /// changed under the FSM (a snapshot installed).
    records: parking_lot::Mutex<BTreeMap<HashSlot, Option<SlotRecord>>>,
}

/// Reads through the writes of the batch being built.
struct Overlay<'a> {
    store: &'a MetaStore,
    pending: BTreeMap<(MetaSpace, Vec<u8>), Option<Vec<u8>>>,
    /// Prefixes cleared by this batch: stored keys under them read as absent.
    cleared: Vec<(MetaSpace, Vec<u8>)>,
    batch: MetaWriteBatch,
    /// The slot exporting while the current command applies: keys it writes are marked.
    marking: Option<(GroupId, HashSlot)>,
    /// Slot records this batch writes (remembered by the FSM once the batch is stored).
    records_written: Vec<(HashSlot, SlotRecord)>,
    /// Slot placements this batch changes (recorded with it, and reported to the node).
    placements: Vec<(HashSlot, Placement)>,
}

impl<'a> Overlay<'a> {
    fn new(store: &'a MetaStore) -> Self {
        Overlay {
            store,
            pending: BTreeMap::new(),
            cleared: Vec::new(),
            batch: MetaWriteBatch::new(),
            marking: None,
            records_written: Vec::new(),
            placements: Vec::new(),
        }
    }

    fn get(&self, space: MetaSpace, key: &[u8]) -> StoreResult<Option<Vec<u8>>> {
        match self.pending.get(&(space, key.to_vec())) {
            Some(value) => Ok(value.clone()),
            None if self.cleared.iter().any(|(s, prefix)| *s == space && key.starts_with(prefix)) => Ok(None),
            None => self.store.get(space, key),
        }
    }

    /// The value of `key` decoded; a value that does not decode is a corrupt store.
    fn get_decoded<T: serde::de::DeserializeOwned>(&self, space: MetaSpace, key: &[u8]) -> StoreResult<Option<T>> {
        let Some(bytes) = self.get(space, key)? else { return Ok(None) };
        postcard::from_bytes(&bytes).map(Some).map_err(|_| tidings_store::StoreError::Corrupt {
            location: tidings_store::CorruptLocation::Kv { keyspace: tidings_store::Keyspace::Meta, key: key.to_vec() },
            detail: "stored model value does not decode",
        })
    }

    fn put(&mut self, space: MetaSpace, key: Vec<u8>, value: &impl Serialize) {
        // Cannot fail: model types serialize into memory.
        let bytes = postcard::to_allocvec(value).expect("model value encodes");
        self.put_raw(space, key, Some(bytes));
    }

    /// Puts `value` at `key` unless something is there already (`AlreadyExists`: a create is not an
    /// overwrite).
    fn put_if_absent(&mut self, space: MetaSpace, key: Vec<u8>, value: &impl Serialize) -> StoreResult<Outcome> {
        if self.get(space, &key)?.is_some() {
            return Ok(Outcome::AlreadyExists);
        }
        self.put(space, key, value);
        Ok(Outcome::Applied)
    }

    fn delete(&mut self, space: MetaSpace, key: Vec<u8>) {
        self.put_raw(space, key, None);
    }

    fn put_raw(&mut self, space: MetaSpace, key: Vec<u8>, value: Option<Vec<u8>>) {
        if let (Some((group, slot)), Some(written)) = (self.marking, space.hash_slot()) {
            if written == slot {
                let mark = [migration::marks_prefix(slot), key.clone()].concat();
                self.batch.put(MetaSpace::group_records(group), mark.clone(), Vec::new());
                self.pending.insert((MetaSpace::group_records(group), mark), Some(Vec::new()));
            }
        }
        match &value {
            Some(bytes) => self.batch.put(space, key.clone(), bytes.clone()),
            None => self.batch.delete(space, key.clone()),
        };
        self.pending.insert((space, key), value);
    }

    fn clear_prefix(&mut self, space: MetaSpace, prefix: Vec<u8>) {
        self.batch.clear_prefix(space, prefix.clone());
        self.pending.retain(|(s, k), _| !(*s == space && k.starts_with(&prefix)));
        self.cleared.push((space, prefix));
    }
}

/// What one [`SlotFsm::apply_in`] batch did besides its outcomes.
#[derive(Debug, Default)]
pub struct AppliedBatch {
    /// One outcome per entry (`None` for entries without a command or applied before).
    pub outcomes: Vec<Option<Outcome>>,
    /// Channel runtime metas the batch created or replaced.
    pub metas: Vec<ChannelRuntimeMeta>,
    /// Hash slots whose placement the batch changed (a migration this group finished or committed).
    pub placements: Vec<(HashSlot, Placement)>,
    /// Nodes the batch recorded as being drained (`Command::DrainNode` with `drain: true`, applied).
    pub drains_started: Vec<NodeId>,
}

impl SlotFsm {
    /// The FSM of `group` over `store`.
    pub fn new(group: GroupId, store: MetaStore, limits: FsmLimits) -> Self {
        Self { group, store, limits, records: parking_lot::Mutex::new(BTreeMap::new()) }
    }

    /// Drops what the FSM remembers of the stored slot records (the store was written under it: a
    /// snapshot was installed).
    pub fn forget_records(&self) {
        self.records.lock().clear();
    }

    /// The group.
    pub fn group(&self) -> GroupId {
        self.group
    }

    /// The last index applied (durably recorded with the data it produced).
    pub fn applied_index(&self) -> StoreResult<u64> {
        self.store.applied_index(self.group)
    }

    /// Applies `entries` — `(raft index, entry data)`, empty data for entries that carry no command — as one
    /// atomic write that also records the last index as applied. Returns one outcome per entry (`None` for
    /// entries without a command). Entries at or below the applied index are skipped (replay after a crash
    /// applies each entry exactly once).
    ///
    /// `genesis` is the hash-slot table the cluster was built with: the same on every node, it says which
    /// slots a group owns until the group's own records say otherwise.
    pub fn apply(&self, genesis: &HashToSlot, entries: &[(u64, &[u8])]) -> StoreResult<Vec<Option<Outcome>>> {
        self.apply_in(genesis, &GroupConf::default(), false, entries).map(|applied| applied.outcomes)
    }

    /// [`SlotFsm::apply`] under the membership `conf` in force, also returning every channel runtime meta
    /// the batch created or replaced (so the node can hand it to the channel's replicas) and every slot
    /// placement it changed. With `record_config_epoch` the batch also records `conf`'s epoch (the batch
    /// ends with a membership change).
    pub fn apply_in(
        &self,
        genesis: &HashToSlot,
        conf: &GroupConf,
        record_config_epoch: bool,
        entries: &[(u64, &[u8])],
    ) -> StoreResult<AppliedBatch> {
        let (applied, write) = self.stage_in(genesis, conf, record_config_epoch, entries)?;
        if let Some(write) = write {
            self.store.write(&write)?;
        }
        Ok(applied)
    }

    /// [`SlotFsm::apply_in`] without the write: the batch that records the entries' effects and the
    /// applied index (`None` if they change nothing), for the caller to write — alone, or in one atomic
    /// write with other groups' batches ([`MetaStore::write_all`]). The FSM takes it as written: the caller
    /// must write it before this FSM stages or reads anything more, and must not go on if the write fails.
    pub fn stage_in(
        &self,
        genesis: &HashToSlot,
        conf: &GroupConf,
        record_config_epoch: bool,
        entries: &[(u64, &[u8])],
    ) -> StoreResult<(AppliedBatch, Option<MetaWriteBatch>)> {
        let mut metas = Vec::new();
        let mut drains_started = Vec::new();
        let applied = self.applied_index()?;
        let mut overlay = Overlay::new(&self.store);
        let mut outcomes = Vec::with_capacity(entries.len());
        let mut last = applied;
        for (index, data) in entries {
            if *index <= applied {
                outcomes.push(None);
                continue;
            }
            last = last.max(*index);
            if data.is_empty() {
                outcomes.push(None);
                continue;
            }
            let outcome = match Command::decode(data) {
                Ok(command) => {
                    let outcome = self.apply_one(genesis, conf, &mut overlay, &command)?;
                    if matches!(outcome, Outcome::Applied) {
                        match command {
                            Command::CreateRuntimeMeta(meta) | Command::CasRuntimeMeta { meta, .. } => metas.push(meta),
                            Command::DrainNode { node, drain: true, .. } => drains_started.push(node),
                            _ => {}
                        }
                    }
                    outcome
                }
                Err(e) => Outcome::Refused(Refusal::Decode(e)),
            };
            outcomes.push(Some(outcome));
        }
        if last > applied {
            if record_config_epoch {
                overlay.batch.set_config_epoch(self.group, conf.config_epoch.get());
            }
            overlay.batch.set_applied(self.group, last);
            for (slot, placement) in &overlay.placements {
                overlay.batch.place(*slot, *placement);
            }
            let mut records = self.records.lock();
            for (slot, record) in overlay.records_written {
                records.insert(slot, Some(record));
            }
            let applied = AppliedBatch { outcomes, metas, placements: overlay.placements, drains_started };
            return Ok((applied, Some(overlay.batch)));
        }
        Ok((AppliedBatch { outcomes, metas, placements: overlay.placements, drains_started }, None))
    }

    fn record(&self, genesis: &HashToSlot, overlay: &Overlay<'_>, slot: HashSlot) -> StoreResult<Option<SlotRecord>> {
        let space = MetaSpace::group_records(self.group);
        let key = migration::record_key(slot);
        if overlay.pending.contains_key(&(space, key.clone())) {
            let stored = overlay.get_decoded(space, &key)?;
            return Ok(migration::record_in_force(self.group, genesis, slot, stored));
        }
        let cached = self.records.lock().get(&slot).cloned();
        let stored = match cached {
            Some(stored) => stored,
            None => {
                let stored: Option<SlotRecord> = overlay.get_decoded(space, &key)?;
                self.records.lock().insert(slot, stored.clone());
                stored
            }
        };
        Ok(migration::record_in_force(self.group, genesis, slot, stored))
    }

    /// Applies a group-level command: intent changes and slot-migration steps.
    fn apply_group_command(
        &self,
        genesis: &HashToSlot,
        conf: &GroupConf,
        overlay: &mut Overlay<'_>,
        command: &Command,
    ) -> StoreResult<Outcome> {
        use Command::*;
        let records = MetaSpace::group_records(self.group);
        let intent_key = Key::new(Kind::GroupIntent).build();
        let change = match command {
            PutGroupIntent(intent) => {
                overlay.put(records, intent_key, intent);
                return Ok(Outcome::Applied);
            }
            MigrateSlot { slot, step, .. } => return self.migrate_slot(genesis, overlay, *slot, step),
            MoveGroupReplica { from, to, .. } => IntentChange::Move { from: *from, to: *to },
            SetPreferredLeader { preferred, .. } => IntentChange::Prefer(*preferred),
            DrainNode { node, drain, .. } => IntentChange::Drain { node: *node, drain: *drain },
            AbortGroupMove { .. } => IntentChange::Abort,
            CommitGroupConfig { .. } => IntentChange::Commit,
            _ => unreachable!("only group-level commands are scoped to a group"),
        };
        let stored: Option<GroupIntent> = overlay.get_decoded(records, &intent_key)?;
        Ok(match change_intent(self.group, stored, conf, change) {
            Ok(intent) => {
                overlay.put(records, intent_key, &intent);
                Outcome::Applied
            }
            Err(error) => Outcome::Refused(Refusal::GroupChange(error)),
        })
    }

    fn migrate_slot(
        &self,
        genesis: &HashToSlot,
        overlay: &mut Overlay<'_>,
        slot: HashSlot,
        step: &SlotMigrationStep,
    ) -> StoreResult<Outcome> {
        let current = self.record(genesis, overlay, slot)?;
        let transition = match migration::transition(self.group, genesis, current.as_ref(), step) {
            Ok(transition) => transition,
            Err(error) => return Ok(Outcome::Refused(Refusal::Migration(error))),
        };
        let copy = MetaSpace::slot(self.group, slot);
        let records = MetaSpace::group_records(self.group);
        if transition.clear_copy {
            overlay.clear_prefix(copy, Vec::new());
        }
        if transition.clear_marks {
            overlay.clear_prefix(records, migration::marks_prefix(slot));
        }
        if let SlotMigrationStep::ImportChunk { entries, .. } = step {
            for (key, value) in entries {
                overlay.put_raw(copy, key.clone(), value.clone());
            }
        }
        if let Some(record) = transition.record {
            overlay.put(records, migration::record_key(slot), &record);
            overlay.records_written.push((slot, record));
        }
        overlay.placements.extend(transition.placement.map(|p| (slot, p)));
        Ok(Outcome::Applied)
    }

    fn apply_one(
        &self,
        genesis: &HashToSlot,
        conf: &GroupConf,
        overlay: &mut Overlay<'_>,
        command: &Command,
    ) -> StoreResult<Outcome> {
        let key = match command.scope() {
            CommandScope::Group(group) if group == self.group => {
                return self.apply_group_command(genesis, conf, overlay, command);
            }
            CommandScope::Group(group) => return Ok(Outcome::Refused(Refusal::WrongGroup { group })),
            CommandScope::Key(key) => key,
        };
        let slot = hash_slot(key.bytes());
        let record = self.record(genesis, overlay, slot)?;
        if let Err(refusal) = migration::admits(genesis, slot, record.as_ref()) {
            return Ok(Outcome::Refused(refusal));
        }
        overlay.marking = match record {
            Some(SlotRecord { state: SlotState::Exporting { .. }, .. }) => Some((self.group, slot)),
            _ => None,
        };
        let outcome = self.apply_slot_command(overlay, slot, command);
        overlay.marking = None;
        outcome
    }

    /// Applies a command of hash slot `slot`, which this group serves.
    fn apply_slot_command(&self, overlay: &mut Overlay<'_>, slot: HashSlot, command: &Command) -> StoreResult<Outcome> {
        let space = MetaSpace::slot(self.group, slot);
        use Command::*;
        let outcome = match command {
            PutUser(user) => {
                overlay.put(space, Key::new(Kind::User).uid(&user.uid).build(), user);
                Outcome::Applied
            }
            PutDevice(device) => {
                let key = Key::new(Kind::Device).uid(&device.uid).u8(device.device_flag).build();
                overlay.put(space, key, device);
                Outcome::Applied
            }
            RemoveDevice { uid, device_flag } => {
                overlay.delete(space, Key::new(Kind::Device).uid(uid).u8(*device_flag).build());
                Outcome::Applied
            }
            AddSystemUid(uid) => {
                overlay.put(space, Key::new(Kind::SystemUid).uid(uid).build(), &());
                Outcome::Applied
            }
            RemoveSystemUid(uid) => {
                overlay.delete(space, Key::new(Kind::SystemUid).uid(uid).build());
                Outcome::Applied
            }
            CreateChannel(info) => {
                overlay.put_if_absent(space, Key::new(Kind::Channel).channel(&info.channel).build(), info)?
            }
            UpdateChannelFlags { channel, flags } => {
                let key = Key::new(Kind::Channel).channel(channel).build();
                if overlay.get(space, &key)?.is_none() {
                    Outcome::NotFound
                } else {
                    let info = crate::model::ChannelInfo { channel: channel.clone(), flags: *flags };
                    overlay.put(space, key, &info);
                    Outcome::Applied
                }
            }
            AddMembers { channel, list, uids } | RemoveMembers { channel, list, uids } => {
                let add = matches!(command, AddMembers { .. });
                self.change_members(overlay, space, channel, *list, uids, add)
            }
            PutMembership { uid, channel, membership } => {
                overlay.put(space, Key::new(Kind::Membership).uid(uid).channel(channel).build(), membership);
                Outcome::Applied
            }
            RemoveMembership { uid, channel } => {
                overlay.delete(space, Key::new(Kind::Membership).uid(uid).channel(channel).build());
                Outcome::Applied
            }
            PutCmdBinding { uid, channel, binding } => {
                overlay.put(space, Key::new(Kind::CmdBinding).uid(uid).channel(channel).build(), binding);
                Outcome::Applied
            }
            CreateRuntimeMeta(meta) => match meta.validate() {
                Err(e) => Outcome::Refused(Refusal::InvalidMeta(e)),
                Ok(()) => {
                    overlay.put_if_absent(space, Key::new(Kind::RuntimeMeta).channel(&meta.channel).build(), meta)?
                }
            },
            CasRuntimeMeta { expected_version, meta, proof } => {
                self.cas_meta(space, overlay, *expected_version, meta, proof.as_ref())?
            }
            PutMigrationTask(task) => {
                overlay.put(space, Key::new(Kind::Task).channel(&task.channel).u64(task.id).build(), task);
                Outcome::Applied
            }
            PutGroupIntent(_)
            | MoveGroupReplica { .. }
            | SetPreferredLeader { .. }
            | DrainNode { .. }
            | AbortGroupMove { .. }
            | CommitGroupConfig { .. }
            | MigrateSlot { .. } => unreachable!("group-level commands are not scoped to a slot"),
            RemoveMigrationTask { channel, id } => {
                overlay.delete(space, Key::new(Kind::Task).channel(channel).u64(*id).build());
                Outcome::Applied
            }
            PutPluginBinding(binding) => match plugin_key(&binding.uid, &binding.plugin) {
                Some(key) => {
                    overlay.put(space, key, binding);
                    Outcome::Applied
                }
                None => plugin_name_too_long(&binding.plugin),
            },
            RemovePluginBinding { uid, plugin } => match plugin_key(uid, plugin) {
                Some(key) => {
                    overlay.delete(space, key);
                    Outcome::Applied
                }
                None => plugin_name_too_long(plugin),
            },
            AppendMessageEvent { channel, event } => {
                if event.summary.len() > self.limits.event_summary_bytes_max {
                    let (len, max) = (event.summary.len(), self.limits.event_summary_bytes_max);
                    return Ok(Outcome::Refused(Refusal::SummaryTooLarge { len, max }));
                }
                overlay.put(space, Key::new(Kind::Event).channel(channel).seq(event.seq).build(), event);
                self.trim_events(space, overlay, channel)?;
                Outcome::Applied
            }
        };
        Ok(outcome)
    }

    /// Adds `uids` to (or, unless `add`, removes them from) `channel`'s `list`, at most
    /// `members_per_command_max` of them in one command.
    fn change_members(
        &self,
        overlay: &mut Overlay<'_>,
        space: MetaSpace,
        channel: &ChannelId,
        list: MemberList,
        uids: &[Uid],
        add: bool,
    ) -> Outcome {
        let max = self.limits.members_per_command_max;
        if uids.len() > max {
            return Outcome::Refused(Refusal::TooMany { count: uids.len(), max });
        }
        let kind = match list {
            MemberList::Subscribers => Kind::Subscriber,
            MemberList::Allow => Kind::Allow,
            MemberList::Deny => Kind::Deny,
        };
        for uid in uids {
            let key = Key::new(kind).channel(channel).uid(uid).build();
            if add {
                overlay.put(space, key, &());
            } else {
                overlay.delete(space, key);
            }
        }
        Outcome::Applied
    }

    fn cas_meta(
        &self,
        space: MetaSpace,
        overlay: &mut Overlay<'_>,
        expected_version: u64,
        meta: &ChannelRuntimeMeta,
        proof: Option<&SwitchProof>,
    ) -> StoreResult<Outcome> {
        let key = Key::new(Kind::RuntimeMeta).channel(&meta.channel).build();
        let Some(current) = overlay.get_decoded::<ChannelRuntimeMeta>(space, &key)? else {
            return Ok(Outcome::NotFound);
        };
        if current.version != expected_version {
            return Ok(Outcome::VersionMismatch { current: current.version });
        }
        if let Err(e) = current.check_successor(meta) {
            return Ok(Outcome::Refused(Refusal::InvalidMeta(e)));
        }
        if meta.version != expected_version + 1 {
            return Ok(Outcome::Refused(Refusal::InvalidMeta(MetaError::StaleVersion {
                offered: meta.version,
                current: current.version,
            })));
        }
        if meta.leader != current.leader {
            if let Err(reason) = check_switch_proof(&current, meta, proof) {
                return Ok(Outcome::Refused(Refusal::BadProof(reason)));
            }
        }
        overlay.put(space, key, meta);
        Ok(Outcome::Applied)
    }

    fn trim_events(
        &self,
        space: MetaSpace,
        overlay: &mut Overlay<'_>,
        channel: &tidings_types::ChannelId,
    ) -> StoreResult<()> {
        let prefix = Key::new(Kind::Event).channel(channel).build();
        // Stored events plus the ones this batch added, oldest first.
        let mut keys: Vec<Vec<u8>> = self
            .store
            .scan(space, &prefix, None, self.limits.events_per_channel_max + 64)?
            .entries
            .into_iter()
            .map(|(k, _)| k)
            .collect();
        for ((s, k), v) in overlay.pending.range((space, prefix.clone())..) {
            if *s != space || !k.starts_with(&prefix) {
                break;
            }
            match v {
                Some(_) => keys.push(k.clone()),
                None => keys.retain(|existing| existing != k),
            }
        }
        keys.sort();
        keys.dedup();
        let excess = keys.len().saturating_sub(self.limits.events_per_channel_max);
        for key in keys.into_iter().take(excess) {
            overlay.delete(space, key);
        }
        Ok(())
    }
}

/// A leader switch must carry the task's proof: based on the current leader epoch, with evidence from at
/// least |ISR| − MinISR + 1 ISR members, none more advanced than the new leader.
fn check_switch_proof(
    current: &ChannelRuntimeMeta,
    next: &ChannelRuntimeMeta,
    proof: Option<&SwitchProof>,
) -> Result<(), ProofError> {
    let proof = proof.ok_or(ProofError::Missing)?;
    if proof.expected_leader_epoch != current.leader_epoch {
        return Err(ProofError::WrongLeaderEpoch);
    }
    let needed = current.isr.len() - usize::from(current.min_isr) + 1;
    let from_isr = proof.evidence.iter().filter(|(n, _, _)| current.isr.contains(n)).count();
    if from_isr < needed {
        return Err(ProofError::NotEnoughEvidence);
    }
    let leader = proof.evidence.iter().find(|(n, _, _)| *n == next.leader).ok_or(ProofError::LeaderGaveNoEvidence)?;
    if proof.evidence.iter().any(|(_, epoch, seq)| (*epoch, *seq) > (leader.1, leader.2)) {
        return Err(ProofError::LeaderNotMostAdvanced);
    }
    Ok(())
}

/// The refusal of a plugin binding command naming `plugin`, too long for a binding's key.
fn plugin_name_too_long(plugin: &str) -> Outcome {
    Outcome::Refused(Refusal::PluginNameTooLong { len: plugin.len(), max: PLUGIN_NAME_BYTES_MAX })
}
