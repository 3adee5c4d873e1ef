//! Metadata through the slot groups: proposals (through the local replica of a group, or sent to a
//! node that has one), authoritative reads, channel creation, and what the slot layer's effects mean
//! for the rest of the node.

use super::{ApiId, ApiResult, NodeCore, NodeEffect};
use crate::frame::FrameBody;
use crate::node::controller::{ExportQuestion, MigrationProposal};
use crate::node::error::NodeError;
use crate::node::message::NodeMessage;
use crate::node::shard::ShardInput;
use std::sync::Arc;
use tidings_slot::command::{Command, RoutingKey};
use tidings_slot::fsm::{Outcome, Refusal};
use tidings_slot::model::ChannelInfo;
use tidings_slot::raft::{ProposalId, ProposeError, SlotEffect};
use tidings_store::Placement;
use tidings_types::{ChannelId, ChannelRuntimeMeta, GroupId, HashSlot, NodeId, Time};

/// What a metadata proposal of this node is for.
#[derive(Debug)]
pub(super) enum ProposalPurpose {
    Api(ApiId),
    /// Step one of channel creation; step two proposes the runtime meta.
    CreateChannel {
        api: ApiId,
        meta: ChannelRuntimeMeta,
    },
    /// A channel leader's meta change (ISR shrink or expand); nobody waits.
    Internal,
    /// One of several proposals an API call made (one per slot group); the call completes with the last.
    Fan(ApiId),
    /// A step of the controller's task on the channel, tagged by the controller.
    Task {
        channel: ChannelId,
        tag: u64,
    },
    /// A step of copy attempt `attempt` of the migration of `slot` out of `group`, which this node drives.
    SlotMigration {
        group: GroupId,
        slot: HashSlot,
        attempt: u64,
    },
}

/// What an authoritative read of a slot group (a ReadIndex) is for.
#[derive(Debug)]
pub(super) enum MetaRead {
    /// An API call's read barrier on `slot`, tried `tries` times (a migrated slot is followed).
    Api { api: ApiId, slot: HashSlot, tries: u8 },
    /// A channel's meta for the stray-log sweep (see `stray_logs`).
    Stray(super::stray_logs::StrayRead),
}

/// A proposal's command and how it went out.
#[derive(Debug)]
pub(super) struct Sent {
    command: Command,
    /// Times it was sent (a refusal that proposed nothing sends it on).
    sends: u8,
    /// The other node's replica of the group it was sent to (`None`: through the local replica).
    remote: Option<NodeId>,
}

/// A proposal for a group this node does not serve is sent at most this many times (following
/// `NotLeader` hints).
pub(super) const REMOTE_PROPOSAL_SENDS: u8 = 3;
/// A group nobody here knows the leader of is tried at another node this often.
pub(super) const CONTACT_ROTATION: std::time::Duration = std::time::Duration::from_millis(500);

impl NodeCore {
    /// Proposes a metadata command; [`NodeEffect::Done`](crate::node::NodeEffect::Done) with [`ApiResult::Meta`] follows.
    pub fn propose(&mut self, now: Time, id: ApiId, command: Command) {
        self.advance(now);
        if let Err(error) = self.propose_for(&command, ProposalPurpose::Api(id)) {
            self.done(id, ApiResult::Meta(Err(error.into())));
        }
    }

    /// Starts an authoritative metadata read of the slot group that owns `key` (raft ReadIndex, confirmed
    /// by the group's leader, never a lease). [`NodeEffect::Done`](crate::node::NodeEffect::Done) with `ApiResult::Meta(Ok(()))` says the
    /// local store ([`NodeCore::reader`]) now reflects every metadata write acknowledged before this call.
    /// Fails with [`NodeError::NotServed`] on a node that keeps no replica of the group, and with
    /// [`NodeError::SlotNotServed`] while the key's hash slot is fenced for a migration (retry) — a slot
    /// that migrated is followed to its new group.
    pub fn read_barrier(&mut self, now: Time, id: ApiId, key: RoutingKey<'_>) {
        self.advance(now);
        self.start_read(id, tidings_router::hash_slot(key.bytes()), 1);
    }

    pub(super) fn start_read(&mut self, id: ApiId, slot: HashSlot, tries: u8) {
        let group = self.slot.table().group_of(slot);
        if !self.slot.groups().any(|g| g == group) {
            self.done(id, ApiResult::Meta(Err(NodeError::NotServed(group))));
            return;
        }
        match self.slot.read_index(self.now, group) {
            Ok(read) => {
                self.meta_reads.insert(read, MetaRead::Api { api: id, slot, tries });
            }
            Err(error) => self.done(id, ApiResult::Meta(Err(error.into()))),
        }
    }

    /// A read index of `group` is ready: the read is answered if the group (still) serves the slot.
    pub(super) fn finish_read(&mut self, id: ApiId, group: GroupId, slot: HashSlot, tries: u8) {
        let record = match self.reader.slot_record(group, slot) {
            Ok(stored) => tidings_slot::fsm::migration::record_in_force(group, self.slot.genesis(), slot, stored),
            Err(error) => return self.done(id, ApiResult::Meta(Err(error.into()))),
        };
        match tidings_slot::fsm::migration::admits(self.slot.genesis(), slot, record.as_ref()) {
            Ok(()) => self.done(id, ApiResult::Meta(Ok(()))),
            Err(Refusal::SlotMoved { owner, epoch, .. }) if tries < REMOTE_PROPOSAL_SENDS => {
                self.learn_slot_owner(slot, owner, epoch);
                self.start_read(id, slot, tries + 1);
            }
            Err(refusal) => self.done(id, ApiResult::Meta(Err(NodeError::SlotNotServed(refusal)))),
        }
    }

    /// Creates a channel: its definition, then its runtime meta (replicas placed by
    /// [`NodeConfig::channel_placement`](crate::node::NodeConfig::channel_placement), except that nodes this
    /// node holds down, knows are being drained or hears are leaving go last; all in the ISR, the first
    /// leading).
    pub fn create_channel(&mut self, now: Time, id: ApiId, info: ChannelInfo) {
        self.advance(now);
        let avoided = self.controller.placement_avoided(self.now);
        let replicas = self.config.channel_placement_avoiding(&info.channel, &avoided);
        let meta = ChannelRuntimeMeta::created(info.channel.clone(), replicas, self.config.channel_min_isr);
        if let Err(error) =
            self.propose_for(&Command::CreateChannel(info), ProposalPurpose::CreateChannel { api: id, meta })
        {
            self.done(id, ApiResult::Meta(Err(error.into())));
        }
    }

    /// Proposes through this node's group replica, or through the leader the route table names.
    pub(super) fn propose_for(&mut self, command: &Command, purpose: ProposalPurpose) -> Result<(), ProposeError> {
        let (proposal, remote) = self.submit(command)?;
        self.sent.insert(proposal, Sent { command: command.clone(), sends: 1, remote });
        self.proposals.insert(proposal, purpose);
        Ok(())
    }

    /// Proposes `command` to its group: through the local replica, else through the group's leader as far
    /// as this node knows it (that node is returned with the id).
    pub(super) fn submit(&mut self, command: &Command) -> Result<(ProposalId, Option<NodeId>), ProposeError> {
        match self.slot.propose(self.now, command) {
            Err(ProposeError::UnknownGroup { group }) => {
                let leader = self.group_contact(group).ok_or(ProposeError::NotReady { group })?;
                Ok((self.slot.propose_remote(self.now, command, leader)?, Some(leader)))
            }
            other => Ok((other?, None)),
        }
    }

    /// Sends on a proposal whose refusal proposed nothing, at most `REMOTE_PROPOSAL_SENDS` times in all
    /// (so it cannot apply twice): a remote proposal refused with `NotLeader` goes to the hinted leader, or
    /// without a hint to another contact (the node that refused it is no longer taken for the leader); a
    /// command refused because its hash slot moved goes to the new owner, whose placement this node
    /// learns. `true` if it was sent on.
    pub(super) fn send_on(&mut self, id: ProposalId, result: &Result<Outcome, ProposeError>) -> bool {
        let Some(sent) = self.sent.remove(&id) else { return false };
        if let (Err(ProposeError::NotLeader { group, hint: None }), Some(refused_by)) = (result, sent.remote) {
            self.not_leaders.insert(*group, refused_by);
        }
        if sent.sends >= REMOTE_PROPOSAL_SENDS {
            return false;
        }
        let next = match result {
            Err(ProposeError::NotLeader { group, hint }) if sent.remote.is_some() => {
                let me = self.config.node;
                let Some(to) = hint.filter(|l| *l != me).or_else(|| self.group_contact(*group)) else { return false };
                self.slot.propose_remote(self.now, &sent.command, to).map(|id| (id, Some(to)))
            }
            Ok(Outcome::Refused(Refusal::SlotMoved { slot, owner, epoch })) => {
                self.learn_slot_owner(*slot, *owner, *epoch);
                self.submit(&sent.command)
            }
            _ => return false,
        };
        let Ok((next, remote)) = next else { return false };
        let Some(purpose) = self.proposals.remove(&id) else { return false };
        self.proposals.insert(next, purpose);
        self.sent.insert(next, Sent { command: sent.command, sends: sent.sends + 1, remote });
        true
    }

    /// Routes `slot` to `group` from ownership epoch `epoch` on (unless this node knows a later epoch).
    pub(super) fn learn_slot_owner(&mut self, slot: HashSlot, group: GroupId, epoch: u64) {
        if self.slot.learn_slot_owner(slot, Placement { group, epoch }) {
            tracing::info!(node = %self.config.node, %slot, %group, epoch, "learned a slot's new owner");
        }
        self.router.learn_slot_owner(slot, group, epoch);
    }

    /// Proposes what the slot-migration driver asks for; an immediate failure is its outcome.
    pub(super) fn drive_migrations(&mut self) {
        let proposals = self.migrations.tick(self.now, &self.config.controller, &self.slot, &self.reader);
        for ExportQuestion { from, slot, to, epoch } in self.migrations.export_questions(self.now) {
            // Only the source's leader answers; which node that is may be stale here: ask every node.
            for node in self.config.nodes.clone() {
                self.send_node(node, NodeMessage::ExportQuery { from, slot, to, epoch });
            }
        }
        for MigrationProposal { group, slot, command, attempt } in proposals {
            let purpose = match attempt {
                Some(attempt) => ProposalPurpose::SlotMigration { group, slot, attempt },
                None => ProposalPurpose::Internal,
            };
            if let Err(error) = self.propose_for(&command, purpose) {
                if let Some(attempt) = attempt {
                    self.migrations.outcome(self.now, &self.config.controller, (group, slot, attempt), Err(error));
                }
            }
        }
    }

    /// The leader of slot group `group` as this node's replica, the last `NotLeader` hint or the route
    /// table knows it (a hint first: it is newer than what the table learned); one held down counts
    /// only as this node's own replica knows it.
    pub(super) fn known_group_leader(&self, group: GroupId) -> Option<NodeId> {
        let me = self.config.node;
        // A hint or route naming this node is stale unless its replica leads: a replica moved away
        // leaves its last observation in the route table.
        let refuted = self.not_leaders.get(&group).copied();
        // A leader the failure detector holds down may be gone for good (a node its peers refuse for its
        // storage identity never answers `NotLeader`): the rotating contact finds the group instead.
        let elsewhere = |leader: &NodeId| {
            (*leader != me || self.slot.is_leader(group))
                && Some(*leader) != refuted
                && !self.controller.is_down(*leader, self.now)
        };
        self.slot
            .leader(group)
            .or_else(|| self.remote_leaders.get(&group).copied().filter(elsewhere))
            .or_else(|| self.router.snapshot().group(group).and_then(|g| g.leader).filter(elsewhere))
    }

    /// Where to reach slot group `group`: its known leader, else some node, a different one every
    /// `CONTACT_ROTATION` (replica moves may have taken the group away from its configured members; a
    /// member reached forwards, and the leader's hint in its answer is remembered).
    /// The turn passes over this node when it keeps no replica of the group (it could only answer
    /// itself that it knows no leader), over nodes the failure detector holds down, and over the node
    /// that last refused a proposal of the group without naming a leader, while any other is left.
    /// Without that last, a proposal sent on after such a refusal went to the same node again within
    /// the turn: a node outside the group answers every time that it knows no leader (sim seed
    /// 358003879: a channel leader's ISR changes, each sent three times to a node that had left the
    /// group, at the same turn of the rotation a proposal timeout later, so its HW stayed held under the
    /// unanswered proposals for good).
    pub(super) fn group_contact(&self, group: GroupId) -> Option<NodeId> {
        self.known_group_leader(group).or_else(|| {
            let nodes = &self.config.nodes;
            let rotation = u64::try_from(CONTACT_ROTATION.as_millis()).unwrap_or(u64::MAX);
            let turn = self.now.as_millis() / rotation + u64::from(group.get());
            let start = usize::try_from(turn % u64::try_from(nodes.len()).unwrap_or(1).max(1)).unwrap_or(0);
            let me = self.config.node;
            let refused = self.not_leaders.get(&group).copied();
            let useful = |node: &NodeId| {
                (*node != me || self.slot.groups().any(|g| g == group))
                    && !self.controller.is_down(*node, self.now)
                    && Some(*node) != refused
            };
            let mut ring = (0..nodes.len()).map(|i| nodes[(start + i) % nodes.len()]);
            ring.find(useful).or_else(|| nodes.get(start).copied())
        })
    }

    pub(super) fn slot_effect(&mut self, effect: SlotEffect) {
        match effect {
            SlotEffect::Send { to, message } => self.send(to, FrameBody::Slot(message)),
            SlotEffect::Sync { token } => self.effects.push_back(NodeEffect::SyncSlots { token }),
            SlotEffect::ProposalDone { id, result } => self.proposal_done(id, result),
            SlotEffect::ReadReady { id, group } => match self.meta_reads.remove(&id) {
                Some(MetaRead::Api { api, slot, tries }) => self.finish_read(api, group, slot, tries),
                Some(MetaRead::Stray(read)) => self.stray_read_done(Some(group), read),
                None => {}
            },
            SlotEffect::ReadFailed { id, error } => match self.meta_reads.remove(&id) {
                Some(MetaRead::Api { api, .. }) => self.done(api, ApiResult::Meta(Err(error.into()))),
                Some(MetaRead::Stray(read)) => self.stray_read_done(None, read),
                None => {}
            },
            SlotEffect::MetaChanged { meta, leader, .. } => {
                self.controller.meta_applied(self.now, &meta, leader);
                if leader {
                    let me = self.config.node;
                    for replica in meta.replicas.iter().copied().filter(|n| *n != me) {
                        self.send_node(replica, NodeMessage::MetaPush(meta.clone()));
                    }
                }
                self.learn_meta(meta, true);
            }
            SlotEffect::MetasInstalled { metas, .. } => {
                for meta in metas.iter() {
                    self.controller.meta_seen(self.now, meta);
                }
                for index in 0..self.shards.count() {
                    self.feed_shard_at(index, ShardInput::MetasInstalled(Arc::clone(&metas)));
                }
            }
            SlotEffect::Observed { group, observation } => {
                // A stale or conflicting observation is refused by the router; the newer one stands.
                let _ = self.router.observe(group, observation);
            }
            SlotEffect::DrainStarted { group, node } => self.controller.drain_started(self.now, group, node),
            SlotEffect::SlotPlaced { slot, placement } => {
                self.router.learn_slot_owner(slot, placement.group, placement.epoch);
            }
            SlotEffect::GroupRemoved { group } => {
                // The replica is gone; forwarding to the group now goes through the route table.
                tracing::info!(%group, node = %self.config.node, "left slot group");
            }
        }
    }

    pub(super) fn proposal_done(&mut self, id: ProposalId, result: Result<Outcome, ProposeError>) {
        if let Err(ProposeError::NotLeader { group, hint: Some(leader) }) = &result {
            if !self.slot.groups().any(|g| g == *group) {
                self.remote_leaders.insert(*group, *leader);
                self.not_leaders.remove(group);
            }
        }
        if self.send_on(id, &result) {
            return;
        }
        self.sent.remove(&id);
        let Some(purpose) = self.proposals.remove(&id) else { return };
        if let ProposalPurpose::Task { channel, tag } = &purpose {
            self.controller.proposal_done(self.now, channel, *tag, result);
            return;
        }
        if let ProposalPurpose::SlotMigration { group, slot, attempt } = purpose {
            self.migrations.outcome(self.now, &self.config.controller, (group, slot, attempt), result);
            return;
        }
        let applied = match result {
            Ok(Outcome::Applied) => Ok(()),
            Ok(other) => Err(NodeError::NotApplied(other)),
            Err(e) => Err(NodeError::Propose(e)),
        };
        match purpose {
            ProposalPurpose::Api(api) => self.done(api, ApiResult::Meta(applied)),
            ProposalPurpose::CreateChannel { api, meta } => match applied {
                Ok(()) => {
                    if let Err(error) = self.propose_for(&Command::CreateRuntimeMeta(meta), ProposalPurpose::Api(api)) {
                        self.done(api, ApiResult::Meta(Err(error.into())));
                    }
                }
                Err(error) => self.done(api, ApiResult::Meta(Err(error))),
            },
            ProposalPurpose::Fan(api) => self.fan_done(api, applied.err()),
            ProposalPurpose::Internal => {}
            ProposalPurpose::Task { .. } | ProposalPurpose::SlotMigration { .. } => {}
        }
    }
}
