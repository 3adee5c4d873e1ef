//! The slot FSM: applies committed commands of one slot group to the metadata store, a whole batch plus
//! the group's new applied index in ONE atomic write.
//!
//! Every command is checked against the hash-slot table first: a command whose slot does not belong to
//! this group is refused (typed, deterministic), so a write routed with a stale table never lands in the
//! wrong group. Expected races — a create of an existing key, a compare-and-set on an older version — are
//! deterministic [`Outcome`]s, identical on every replica, never failures of the group.

use crate::command::{Command, DecodeError, MemberList};
use crate::keys::{Key, Kind};
use crate::model::{GroupIntent, SwitchProof};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use tidings_router::{hash_slot, HashToSlot};
use tidings_store::{MetaStore, MetaWriteBatch, StoreResult};
use tidings_types::{ChannelRuntimeMeta, ConfigEpoch, GroupId, HashSlot, MetaError, NodeId};

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
    /// The command's hash slot belongs to another group under the current table.
    #[error("{slot} belongs to {owner}, not to this group")]
    WrongSlot {
        /// The command's slot.
        slot: HashSlot,
        /// The group that owns it.
        owner: GroupId,
    },
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
    /// A change of the group's membership intent that does not fit the intent or membership in force.
    #[error("group membership change refused: {0}")]
    GroupChange(GroupChangeError),
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
}

/// Reads through the writes of the batch being built.
struct Overlay<'a> {
    store: &'a MetaStore,
    pending: BTreeMap<(HashSlot, Vec<u8>), Option<Vec<u8>>>,
    batch: MetaWriteBatch,
}

impl Overlay<'_> {
    fn get(&self, slot: HashSlot, key: &[u8]) -> StoreResult<Option<Vec<u8>>> {
        match self.pending.get(&(slot, key.to_vec())) {
            Some(value) => Ok(value.clone()),
            None => self.store.get(slot, key),
        }
    }

    /// The value of `key` decoded; a value that does not decode is a corrupt store.
    fn get_decoded<T: serde::de::DeserializeOwned>(&self, slot: HashSlot, key: &[u8]) -> StoreResult<Option<T>> {
        let Some(bytes) = self.get(slot, key)? else { return Ok(None) };
        postcard::from_bytes(&bytes).map(Some).map_err(|_| tidings_store::StoreError::Corrupt {
            location: tidings_store::CorruptLocation::Kv {
                keyspace: tidings_store::Keyspace::Meta,
                key: [&slot.index().to_be_bytes()[..], key].concat(),
            },
            detail: "stored model value does not decode",
        })
    }

    fn put(&mut self, slot: HashSlot, key: Vec<u8>, value: &impl Serialize) {
        // Cannot fail: model types serialize into memory.
        let bytes = postcard::to_allocvec(value).expect("model value encodes");
        self.batch.put(slot, key.clone(), bytes.clone());
        self.pending.insert((slot, key), Some(bytes));
    }

    fn delete(&mut self, slot: HashSlot, key: Vec<u8>) {
        self.batch.delete(slot, key.clone());
        self.pending.insert((slot, key), None);
    }
}

/// A command that changes a group's membership intent.
enum IntentChange {
    Move { from: NodeId, to: NodeId },
    Prefer(Option<NodeId>),
    Drain { node: NodeId, drain: bool },
    Abort,
    Commit,
}

/// The intent after a membership-intent change, checked against the stored intent and the membership in
/// force. A group without an intent starts from its voters in force.
fn change_intent(
    group: GroupId,
    stored: Option<GroupIntent>,
    conf: &GroupConf,
    change: IntentChange,
) -> Result<GroupIntent, GroupChangeError> {
    let mut intent = stored.unwrap_or_else(|| GroupIntent {
        group,
        desired_peers: sorted(conf.voters.clone()),
        config_epoch: conf.config_epoch,
        preferred_leader: None,
        target_peers: None,
        draining: Vec::new(),
    });
    match change {
        IntentChange::Move { from, to } => {
            if let Some(target) = &intent.target_peers {
                return Err(GroupChangeError::MoveInProgress { target: target.clone() });
            }
            if !intent.desired_peers.contains(&from) {
                return Err(GroupChangeError::NotAVoter(from));
            }
            if intent.desired_peers.contains(&to) {
                return Err(GroupChangeError::AlreadyAVoter(to));
            }
            if intent.draining.contains(&to) {
                return Err(GroupChangeError::TargetDraining(to));
            }
            let target = intent.desired_peers.iter().map(|n| if *n == from { to } else { *n }).collect();
            intent.target_peers = Some(sorted(target));
        }
        IntentChange::Prefer(preferred) => intent.preferred_leader = preferred,
        IntentChange::Drain { node, drain } => {
            intent.draining.retain(|n| *n != node);
            if drain {
                intent.draining.push(node);
                intent.draining.sort_unstable();
            }
        }
        IntentChange::Abort => {
            // Aborting retargets the move to the committed assignment: the leader takes the membership back
            // step by step, then commits it (with the epoch it ends in) like any move.
            if intent.target_peers.as_ref().is_none_or(|target| *target == intent.desired_peers) {
                return Err(GroupChangeError::NoMoveInProgress);
            }
            intent.target_peers = Some(intent.desired_peers.clone());
        }
        IntentChange::Commit => {
            let voters = sorted(conf.voters.clone());
            let wanted = sorted(intent.wanted_voters().to_vec());
            if conf.joint || voters != wanted {
                return Err(GroupChangeError::ConfigMismatch { voters, joint: conf.joint, wanted });
            }
            if intent.target_peers.is_none() {
                return Err(GroupChangeError::NothingToCommit);
            }
            intent.desired_peers = voters;
            intent.config_epoch = conf.config_epoch;
            intent.target_peers = None;
        }
    }
    Ok(intent)
}

fn sorted(mut nodes: Vec<NodeId>) -> Vec<NodeId> {
    nodes.sort_unstable();
    nodes.dedup();
    nodes
}

impl SlotFsm {
    /// The FSM of `group` over `store`.
    pub fn new(group: GroupId, store: MetaStore, limits: FsmLimits) -> Self {
        Self { group, store, limits }
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
    pub fn apply(&self, table: &HashToSlot, entries: &[(u64, &[u8])]) -> StoreResult<Vec<Option<Outcome>>> {
        self.apply_in(table, &GroupConf::default(), false, entries).map(|(outcomes, _)| outcomes)
    }

    /// [`SlotFsm::apply`] under the membership `conf` in force, also returning every channel runtime meta
    /// the batch created or replaced (so the node can hand it to the channel's replicas). With
    /// `record_config_epoch` the batch also records `conf`'s epoch (the batch ends with a membership change).
    pub fn apply_in(
        &self,
        table: &HashToSlot,
        conf: &GroupConf,
        record_config_epoch: bool,
        entries: &[(u64, &[u8])],
    ) -> StoreResult<(Vec<Option<Outcome>>, Vec<ChannelRuntimeMeta>)> {
        let mut metas = Vec::new();
        let applied = self.applied_index()?;
        let mut overlay = Overlay { store: &self.store, pending: BTreeMap::new(), batch: MetaWriteBatch::new() };
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
                    let outcome = self.apply_one(table, conf, &mut overlay, &command)?;
                    if let (Outcome::Applied, Command::CreateRuntimeMeta(meta) | Command::CasRuntimeMeta { meta, .. }) =
                        (&outcome, command)
                    {
                        metas.push(meta);
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
            self.store.write(&overlay.batch)?;
        }
        Ok((outcomes, metas))
    }

    fn apply_one(
        &self,
        table: &HashToSlot,
        conf: &GroupConf,
        overlay: &mut Overlay<'_>,
        command: &Command,
    ) -> StoreResult<Outcome> {
        let slot = hash_slot(command.routing_key().bytes());
        let owner = table.group_of(slot);
        if owner != self.group {
            return Ok(Outcome::Refused(Refusal::WrongSlot { slot, owner }));
        }
        use Command::*;
        let outcome = match command {
            PutUser(user) => {
                overlay.put(slot, Key::new(Kind::User).uid(&user.uid).build(), user);
                Outcome::Applied
            }
            PutDevice(device) => {
                let key = Key::new(Kind::Device).uid(&device.uid).u8(device.device_flag).build();
                overlay.put(slot, key, device);
                Outcome::Applied
            }
            RemoveDevice { uid, device_flag } => {
                overlay.delete(slot, Key::new(Kind::Device).uid(uid).u8(*device_flag).build());
                Outcome::Applied
            }
            AddSystemUid(uid) => {
                overlay.put(slot, Key::new(Kind::SystemUid).uid(uid).build(), &());
                Outcome::Applied
            }
            RemoveSystemUid(uid) => {
                overlay.delete(slot, Key::new(Kind::SystemUid).uid(uid).build());
                Outcome::Applied
            }
            CreateChannel(info) => {
                let key = Key::new(Kind::Channel).channel(&info.channel).build();
                if overlay.get(slot, &key)?.is_some() {
                    Outcome::AlreadyExists
                } else {
                    overlay.put(slot, key, info);
                    Outcome::Applied
                }
            }
            UpdateChannelFlags { channel, flags } => {
                let key = Key::new(Kind::Channel).channel(channel).build();
                if overlay.get(slot, &key)?.is_none() {
                    Outcome::NotFound
                } else {
                    let info = crate::model::ChannelInfo { channel: channel.clone(), flags: *flags };
                    overlay.put(slot, key, &info);
                    Outcome::Applied
                }
            }
            AddMembers { channel, list, uids } | RemoveMembers { channel, list, uids } => {
                if uids.len() > self.limits.members_per_command_max {
                    return Ok(Outcome::Refused(Refusal::TooMany {
                        count: uids.len(),
                        max: self.limits.members_per_command_max,
                    }));
                }
                let kind = match list {
                    MemberList::Subscribers => Kind::Subscriber,
                    MemberList::Allow => Kind::Allow,
                    MemberList::Deny => Kind::Deny,
                };
                let add = matches!(command, AddMembers { .. });
                for uid in uids {
                    let key = Key::new(kind).channel(channel).uid(uid).build();
                    if add {
                        overlay.put(slot, key, &());
                    } else {
                        overlay.delete(slot, key);
                    }
                }
                Outcome::Applied
            }
            PutMembership { uid, channel, membership } => {
                overlay.put(slot, Key::new(Kind::Membership).uid(uid).channel(channel).build(), membership);
                Outcome::Applied
            }
            RemoveMembership { uid, channel } => {
                overlay.delete(slot, Key::new(Kind::Membership).uid(uid).channel(channel).build());
                Outcome::Applied
            }
            PutCmdBinding { uid, channel, binding } => {
                overlay.put(slot, Key::new(Kind::CmdBinding).uid(uid).channel(channel).build(), binding);
                Outcome::Applied
            }
            CreateRuntimeMeta(meta) => {
                let key = Key::new(Kind::RuntimeMeta).channel(&meta.channel).build();
                if let Err(e) = meta.validate() {
                    Outcome::Refused(Refusal::InvalidMeta(e))
                } else if overlay.get(slot, &key)?.is_some() {
                    Outcome::AlreadyExists
                } else {
                    overlay.put(slot, key, meta);
                    Outcome::Applied
                }
            }
            CasRuntimeMeta { expected_version, meta, proof } => {
                self.cas_meta(slot, overlay, *expected_version, meta, proof.as_ref())?
            }
            PutMigrationTask(task) => {
                overlay.put(slot, Key::new(Kind::Task).channel(&task.channel).u64(task.id).build(), task);
                Outcome::Applied
            }
            PutGroupIntent { intent, .. } => {
                if intent.group != self.group {
                    // Routed here by a table that gave the slot to this group, but about another one.
                    return Ok(Outcome::Refused(Refusal::WrongSlot { slot, owner: intent.group }));
                }
                overlay.put(slot, Key::new(Kind::GroupIntent).u64(u64::from(intent.group.get())).build(), intent);
                Outcome::Applied
            }
            MoveGroupReplica { group, .. }
            | SetPreferredLeader { group, .. }
            | DrainNode { group, .. }
            | AbortGroupMove { group, .. }
            | CommitGroupConfig { group, .. } => {
                if *group != self.group {
                    return Ok(Outcome::Refused(Refusal::WrongSlot { slot, owner: *group }));
                }
                let change = match command {
                    MoveGroupReplica { from, to, .. } => IntentChange::Move { from: *from, to: *to },
                    SetPreferredLeader { preferred, .. } => IntentChange::Prefer(*preferred),
                    DrainNode { node, drain, .. } => IntentChange::Drain { node: *node, drain: *drain },
                    AbortGroupMove { .. } => IntentChange::Abort,
                    _ => IntentChange::Commit,
                };
                let key = Key::new(Kind::GroupIntent).u64(u64::from(group.get())).build();
                let stored: Option<GroupIntent> = overlay.get_decoded(slot, &key)?;
                match change_intent(self.group, stored, conf, change) {
                    Ok(intent) => {
                        overlay.put(slot, key, &intent);
                        Outcome::Applied
                    }
                    Err(error) => Outcome::Refused(Refusal::GroupChange(error)),
                }
            }
            RemoveMigrationTask { channel, id } => {
                overlay.delete(slot, Key::new(Kind::Task).channel(channel).u64(*id).build());
                Outcome::Applied
            }
            PutPluginBinding(binding) => {
                let key = Key::new(Kind::Plugin).uid(&binding.uid).text(&binding.plugin).build();
                overlay.put(slot, key, binding);
                Outcome::Applied
            }
            RemovePluginBinding { uid, plugin } => {
                overlay.delete(slot, Key::new(Kind::Plugin).uid(uid).text(plugin).build());
                Outcome::Applied
            }
            AppendMessageEvent { channel, event } => {
                if event.summary.len() > self.limits.event_summary_bytes_max {
                    let (len, max) = (event.summary.len(), self.limits.event_summary_bytes_max);
                    return Ok(Outcome::Refused(Refusal::SummaryTooLarge { len, max }));
                }
                overlay.put(slot, Key::new(Kind::Event).channel(channel).seq(event.seq).build(), event);
                self.trim_events(slot, overlay, channel)?;
                Outcome::Applied
            }
        };
        Ok(outcome)
    }

    fn cas_meta(
        &self,
        slot: HashSlot,
        overlay: &mut Overlay<'_>,
        expected_version: u64,
        meta: &ChannelRuntimeMeta,
        proof: Option<&SwitchProof>,
    ) -> StoreResult<Outcome> {
        let key = Key::new(Kind::RuntimeMeta).channel(&meta.channel).build();
        let Some(current) = overlay.get_decoded::<ChannelRuntimeMeta>(slot, &key)? else {
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
        overlay.put(slot, key, meta);
        Ok(Outcome::Applied)
    }

    fn trim_events(
        &self,
        slot: HashSlot,
        overlay: &mut Overlay<'_>,
        channel: &tidings_types::ChannelId,
    ) -> StoreResult<()> {
        let prefix = Key::new(Kind::Event).channel(channel).build();
        // Stored events plus the ones this batch added, oldest first.
        let mut keys: Vec<Vec<u8>> = self
            .store
            .scan(slot, &prefix, None, self.limits.events_per_channel_max + 64)?
            .entries
            .into_iter()
            .map(|(k, _)| k)
            .collect();
        for ((s, k), v) in overlay.pending.range((slot, prefix.clone())..) {
            if *s != slot || !k.starts_with(&prefix) {
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
            overlay.delete(slot, key);
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
