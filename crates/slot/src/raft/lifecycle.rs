//! Groups coming and going on this node: raft messages stepped into their group, replicas created on
//! demand by a peer's message, removed when the peers say so, checked against the configuration and
//! destroyed once they left it.

use super::effect::{ProposeError, SlotEffect};
use super::message::SlotBody;
use super::{guard, removal, snapshot, MultiRaft};
use protobuf::Message as _;
use raft::prelude::{ConfState, Message, MessageType};
use raft::StateRole;
use tidings_types::{GroupId, NodeId};

impl MultiRaft {
    /// Steps a raft message from `from` whose sending replica knew configuration epochs up to
    /// `known_epoch` into `group`.
    pub(super) fn step_raft(&mut self, from: NodeId, group: GroupId, known_epoch: u64, bytes: &[u8]) {
        let Ok(message) = Message::parse_from_bytes(bytes) else {
            self.refused_messages += 1;
            return;
        };
        if message.get_msg_type() == MessageType::MsgSnapshot && !snapshot::decodes(&message.get_snapshot().data) {
            // Stepped, raft-rs would take the snapshot for the group's state whatever its data: refused
            // here, the leader sends it again.
            self.refused_messages += 1;
            return;
        }
        if !self.groups.contains_key(&group) && !self.create_on_demand(group, &message) {
            return;
        }
        if self.leaving.contains(&group) {
            return; // Destroyed at the end of this round: it must not take (and acknowledge) more entries.
        }
        let Some(g) = self.groups.get_mut(&group) else { return };
        if !guard::admissible(&g.raw, from.get(), self.config.node.get(), &message) {
            self.refused_messages += 1;
            return;
        }
        if guard::is_answer(message.get_msg_type()) && known_epoch < g.known_epoch {
            // Perhaps from a replica of `from` destroyed since: see `SlotBody::known_epoch`. A live
            // replica took this replica's epoch from the request it answers, so only an answer
            // overtaken by a membership change applied here meanwhile is lost with it.
            self.stale_messages += 1;
            return;
        }
        g.known_epoch = g.known_epoch.max(known_epoch);
        if message.term != 0 && message.term < g.raw.raft.term {
            self.stale_messages += 1;
        }
        let vote = matches!(message.get_msg_type(), MessageType::MsgRequestVote | MessageType::MsgRequestPreVote);
        if vote && g.raw.raft.prs().conf().voters().ids().is_empty() {
            // A replica created on demand that no snapshot initialized yet has an empty log and knows no
            // configuration: it would grant any candidate its vote, and a candidate whose log lacks
            // committed entries could win with it (sim seed 7009782: a replica destroyed on its removal,
            // recreated at once by an append still in flight, elected a stale leader). Its vote is never
            // needed: voters join as learners and catch up (a snapshot) first.
            return;
        }
        if g.raw.raft.state == StateRole::Leader && !g.has_member(from.get()) {
            // A replica this group removed (it may not have learnt it): tell it, so it destroys itself.
            if let Some(removed) = removal(g) {
                self.send(from, group, removed);
            }
            return;
        }
        // raft-rs refuses local-only message types from the wire; other errors are stale messages.
        let _ = g.raw.step(message);
        g.seed_election_timeout();
    }

    /// A leader reaches this node for a group it does not hold: this node was added to the group (as a
    /// learner). Creates an empty replica that a snapshot initializes — only for groups of the hash-slot
    /// table, on messages only a leader sends, and within `groups_max`.
    pub(super) fn create_on_demand(&mut self, group: GroupId, message: &Message) -> bool {
        let from_leader = matches!(
            message.get_msg_type(),
            MessageType::MsgAppend | MessageType::MsgHeartbeat | MessageType::MsgSnapshot
        );
        let known = self.genesis.groups().any(|g| g == group);
        let destroying = self.destroying.contains_key(&group);
        if !from_leader || !known || destroying || self.groups.len() >= self.config.groups_max || message.term == 0 {
            return false;
        }
        let created = self.logs.create_group(group, ConfState::default()).and_then(|()| self.open_group(group));
        match created {
            Ok(()) => {
                tracing::info!(%group, "slot replica created: a leader added this node");
                true
            }
            Err(error) => {
                tracing::error!(%error, %group, "cannot create a slot replica");
                false
            }
        }
    }

    /// The leader of `group` says this node is not a member of its configuration at `config_epoch`, its
    /// log ending at `last_index`.
    pub(super) fn removed_by_peer(&mut self, group: GroupId, config_epoch: u64, last_index: u64) {
        let Some(g) = self.groups.get(&group) else { return };
        // Not older than the configuration this replica applied, and nothing in this log the leader did
        // not have when it answered: entries beyond it may add this node back, and the leader may count
        // on this replica's acknowledgement of them. (Raft ids are node ids: an emptied replica that was
        // counted would leave the leader waiting for entries it believes are held.)
        // Nor older than an epoch its peers named: a replica the group added back (a leader's probe named
        // that change's epoch) must not go on a late copy of an earlier `Removed`, or the answers it sent
        // meanwhile would count for its empty successor (see `SlotBody::known_epoch`).
        let stale = config_epoch < g.known_epoch || g.raw.raft.raft_log.last_index() > last_index;
        if !stale && !self.leaving.contains(&group) {
            self.leaving.push(group);
        }
    }

    /// Replicas whose configuration does not include this node (removed, or created for a membership
    /// change that never reached them), or that know no leader, ask whether they are still wanted; only
    /// the leader's `Removed` destroys them.
    pub(super) fn check_membership(&mut self) {
        let me = self.config.node.get();
        let mut checks = Vec::new();
        for (group, g) in &self.groups {
            let raft = &g.raw.raft;
            let leader = raft.leader_id;
            // A learner the group moved away from hears from nobody, and never campaigns to find out.
            let silent = raft.state != StateRole::Leader && raft.election_elapsed >= 2 * g.election_tick;
            let outside = !g.has_member(me) || !g.held_back.is_empty();
            if leader == me || (!outside && leader != 0 && !silent) {
                continue;
            }
            // Outside its own configuration (or holding back its removal: module `retiring`), leaderless
            // or silent: ask the leader it knows, every voter it knows and every node of the cluster (only
            // the leader answers). The voters it knows may all have left the group or lost their disks: a
            // voter removed while cut off, whose group then moved on to other nodes, asked only those and
            // kept its stale copy for good — its metadata named this node a channel's replica, so the
            // stray-log sweep never forgot that log (sim seed 398003608).
            let conf = g.conf();
            let mut ask: Vec<u64> = conf.voters.iter().chain(&self.config.cluster).map(|n| n.get()).collect();
            ask.push(leader);
            ask.sort_unstable();
            ask.dedup();
            checks.extend(ask.into_iter().filter(|n| *n != me && *n != 0).map(|to| (NodeId::new(to), *group)));
        }
        for (to, group) in checks {
            self.send(to, group, SlotBody::MemberCheck);
        }
    }

    /// Destroys the replicas of groups this node left: raft state, applied data and its hash slots' metadata
    /// go; a tombstone stops a restart from bringing the replica back.
    ///
    /// The replica leaves memory at once; its stored state goes in one atomic write. Should it fail,
    /// it is tried again next round, and every round until it lands: left on disk, the
    /// stale copy would answer this node's local reads for good (simulator seed 818000485 with
    /// `--meta-read-errors`: a node's stray-log sweep kept reading, in a copy whose destruction had
    /// failed, a meta naming it a replica, and never forgot two logs). Until then, a leader that adds
    /// this node back is refused a new replica (it asks again).
    pub(super) fn destroy_leaving(&mut self) {
        for group in std::mem::take(&mut self.leaving) {
            let Some(g) = self.groups.remove(&group) else { continue };
            let epoch = g.config_epoch;
            self.destroying.insert(group, epoch);
            // Reads of the group fail, also those found ready earlier in this round: the data they would
            // read is gone.
            let gone = ProposeError::UnknownGroup { group };
            for effect in self.effects.iter_mut() {
                if let SlotEffect::ReadReady { id, group: g } = effect {
                    if *g == group {
                        *effect = SlotEffect::ReadFailed { id: *id, error: gone.clone() };
                    }
                }
            }
            for read in g.reads {
                self.effects.push_back(SlotEffect::ReadFailed { id: read.id, error: gone.clone() });
            }
            self.awaiting.retain(|a| a.group != group);
            self.effects.push_back(SlotEffect::GroupRemoved { group });
        }
        for (group, epoch) in std::mem::take(&mut self.destroying) {
            match self.destroy_stored(group, epoch) {
                Ok(()) => {
                    tracing::info!(%group, epoch, "slot replica destroyed: this node left the group");
                    self.sync_requested = true;
                }
                Err(error) => {
                    tracing::warn!(%error, %group, "cannot destroy a removed slot replica yet; trying again");
                    self.destroying.insert(group, epoch);
                }
            }
        }
    }

    /// Destroys the stored state of `group`'s replica, removed at configuration `epoch`, in one write:
    /// its hash slots' metadata and its records, its applied index and epoch, and its raft log (a
    /// tombstone in its place).
    fn destroy_stored(&self, group: GroupId, epoch: u64) -> Result<(), tidings_store::StoreError> {
        self.meta.forget_group_with(group, |batch| self.logs.remove_group_with(group, epoch, batch))
    }
}
