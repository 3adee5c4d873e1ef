//! Operator calls: controller tasks (leader transfer, replica replacement), slot-group intents and
//! replica moves, preferred leaders, drains, peers' storage identities and hash-slot migrations; and the
//! controller's periodic run.

use super::metadata::ProposalPurpose;
use super::{ApiId, ApiResult, NodeCore};
use crate::node::controller::Action;
use crate::node::error::NodeError;
use crate::node::shard::{ShardInput, TaskStart};
use tidings_slot::command::Command;
use tidings_types::{ChannelId, ChannelRuntimeMeta, GroupId, HashSlot, NodeId, Time};

impl NodeCore {
    /// Moves the leadership of `channel` to `target` (an ISR member) as a controller task run by this
    /// node: fence, drain the old leader, switch with the drain proof, unfence.
    /// [`NodeEffect::Done`](crate::node::NodeEffect::Done) with [`ApiResult::Task`] follows with the task's report; a drain that does
    /// not finish in `controller.drain_timeout` unfences and fails with
    /// [`TaskError::DrainTimedOut`](crate::node::TaskError::DrainTimedOut), the leader unchanged.
    pub fn transfer_leader(&mut self, now: Time, id: ApiId, channel: ChannelId, target: NodeId) {
        self.start_task(now, id, channel, TaskStart::Transfer { target });
    }

    /// Replaces replica `from` of `channel` by `to` as a controller task run by this node: `to` joins as a
    /// learner and catches up while the channel keeps taking appends, then a short fence, one meta change
    /// that puts `to` in the ISR and takes `from` out (and hands over the leadership if `from` led),
    /// unfence. [`NodeEffect::Done`](crate::node::NodeEffect::Done) with [`ApiResult::Task`] follows.
    /// `to` may already be a learner of the channel (a replacement interrupted after adding it: this
    /// one finishes it) or, in a channel holding more replicas than `NodeConfig::channel_replicas`, any
    /// other replica (`from` then leaves, one replica fewer); otherwise `TaskError::CannotJoin`. A new
    /// replica that does not catch up within `ControllerConfig::catch_up_timeout` ends the task with
    /// `TaskError::DrainTimedOut` and, in a healthy channel, leaves the replicas again.
    pub fn replace_replica(&mut self, now: Time, id: ApiId, channel: ChannelId, from: NodeId, to: NodeId) {
        self.start_task(now, id, channel, TaskStart::Replace { from, to });
    }

    /// Starts a controller task on the meta this node knows for `channel`, which its shard looks up (a
    /// stale one fails the task's first compare-and-set, and the caller retries).
    pub(super) fn start_task(&mut self, now: Time, api: ApiId, channel: ChannelId, start: TaskStart) {
        self.advance(now);
        self.feed_shard(&channel.clone(), ShardInput::TaskMeta { api, channel, start });
    }

    /// The shard answered with the meta a task starts from (`Err`: the channel it does not know).
    pub(super) fn start_task_with(
        &mut self,
        api: ApiId,
        meta: Result<ChannelRuntimeMeta, ChannelId>,
        start: TaskStart,
    ) {
        // The shard lets go of an evicted replica's meta when this node's slot replica keeps it.
        let meta = match meta {
            Ok(meta) => meta,
            Err(channel) => match self.reader.runtime_meta(&channel) {
                Ok(Some(meta)) => meta,
                // This node's replica of the channel's slot group holds none: the channel does not
                // exist. Without a replica here, it cannot tell: the meta is fetched for a retry.
                Ok(None) if self.serves_group_of(&channel) => {
                    return self.done(api, ApiResult::Task(Err(NodeError::UnknownChannel(channel))));
                }
                _ => {
                    self.fetch_meta(&channel, 0);
                    return self.done(api, ApiResult::Task(Err(NodeError::MetaUnavailable(channel))));
                }
            },
        };
        let started = match start {
            TaskStart::Transfer { target } => self.controller.start_transfer(self.now, Some(api), meta, target),
            TaskStart::Replace { from, to } => self.controller.start_replace(self.now, Some(api), meta, from, to),
        };
        if let Err(error) = started {
            self.done(api, ApiResult::Task(Err(error.into())));
        }
    }

    /// Sets the controller's intent for a slot group (desired voters, configuration epoch, preferred
    /// leader), replicated through the group itself; the group's leader then reconciles towards it.
    /// [`NodeEffect::Done`](crate::node::NodeEffect::Done) with [`ApiResult::Meta`] follows.
    pub fn set_group_intent(&mut self, now: Time, id: ApiId, intent: tidings_slot::model::GroupIntent) {
        self.propose(now, id, Command::PutGroupIntent(intent));
    }

    /// Starts moving `group`'s replica from voter `from` to node `to`. The move is recorded in the group's
    /// intent (one at a time per group) and carried out by the group's leader: `to` joins as a learner and
    /// catches up (by snapshot when the log was compacted), a joint configuration promotes it and removes
    /// `from` (the leader hands its leadership over first if it is `from`), the joint state is left
    /// explicitly, and the new assignment is committed with its configuration epoch. `from`'s replica is
    /// then destroyed. A `to` silent for `ControllerConfig::replace_down_after` before its promotion gives
    /// the move up, as [`NodeCore::abort_slot_move`] would. [`NodeEffect::Done`](crate::node::NodeEffect::Done)
    /// with [`ApiResult::Meta`] says whether the move was accepted (a refusal names why: another move in
    /// progress, `from` not a voter, `to` one already).
    pub fn move_slot_replica(&mut self, now: Time, id: ApiId, group: GroupId, from: NodeId, to: NodeId) {
        self.propose(now, id, Command::MoveGroupReplica { group, from, to });
    }

    /// Sets (or clears, with `None`) `group`'s preferred leader, leaving the rest of its intent as it is;
    /// the group's leader hands leadership over when everything fits (see [`Reconcile`](crate::node::controller::Reconcile)).
    pub fn set_preferred_leader(&mut self, now: Time, id: ApiId, group: GroupId, preferred: Option<NodeId>) {
        self.propose(now, id, Command::SetPreferredLeader { group, preferred });
    }

    /// Forgets the storage identity this node knew for `node`, so that the next one `node` names is
    /// taken: the last step of the procedure for a node whose data directory is lost (see
    /// `docs/operations.md`), on every node, once `node` has been drained (while down) and nothing is
    /// left on it. Until then its peers refuse every frame of a node back on a new directory
    /// ([`NodeStatus::storage_refused_by`](crate::node::NodeStatus::storage_refused_by) on it). Nothing
    /// checks that the drain is done: forgetting earlier lets an empty node act as a replica the
    /// cluster counts on. [`NodeEffect::Done`](crate::node::NodeEffect::Done) with [`ApiResult::Meta`]
    /// follows at once (`Ok` also when no identity was known); the store is synced right after.
    pub fn forget_storage_identity(&mut self, now: Time, id: ApiId, node: NodeId) {
        self.advance(now);
        let result = match self.identities.forget(node) {
            Ok(_) => Ok(()),
            Err(error) => Err(NodeError::Storage(error)),
        };
        self.effects.push_back(super::NodeEffect::SyncSlots { token: 0 });
        self.done(id, ApiResult::Meta(result));
    }

    /// This node starts (`true`) or stops leaving: what a host calls before it stops the node for a
    /// restart or an upgrade (Kafka's controlled shutdown). While leaving, the node's pings tell its
    /// peers, and then
    /// - the leaders of the slot groups hand off the channels it leads, active or idle: transfers to
    ///   another live ISR member that keep the replicas' order (`TaskKind::HandOff`; each fences its
    ///   channel for tens of milliseconds, where a failover after a stop would leave it without a
    ///   leader for `ControllerConfig::node_down_after` and more);
    /// - it hands the leadership of each slot group it leads to a caught-up voter;
    /// - no leadership is moved back to it, and new channels are placed elsewhere first.
    ///
    /// [`NodeStatus::handed_off`](crate::node::NodeStatus::handed_off) says when it leads nothing any
    /// more, idle channels included (what `Node::hand_off_leaderships` waits for): the slot groups'
    /// leaders report what it still leads in their slots after each repair pass
    /// ([`NodeStatus::channels_left_to_hand_off`](crate::node::NodeStatus::channels_left_to_hand_off)
    /// here, [`NodeStatus::hand_offs`](crate::node::NodeStatus::hand_offs) on them). The mark is soft: it lapses
    /// `node_down_after` after the node stops saying so, so a restarted node leads again (its
    /// channels come back to it as their preferred replica, after `rebalance_leaders_after`) without
    /// anyone clearing it. [`NodeEffect::Done`](crate::node::NodeEffect::Done) with [`ApiResult::Meta`]
    /// follows at once.
    pub fn set_leaving(&mut self, now: Time, id: ApiId, leaving: bool) {
        self.advance(now);
        self.controller.set_leaving(self.now, leaving);
        self.preferred.wake(self.now);
        self.done(id, ApiResult::Meta(Ok(())));
    }

    /// Drains `node` (`drain: true`) or stops draining it: recorded in the intent of every slot group, whose
    /// leaders then move the group's replica off the node (one replica move at a time per group, to a
    /// live node outside the group, never to a drained one) and replace the node's channel replicas in the
    /// group's slots (controller replacement tasks). [`NodeEffect::Done`](crate::node::NodeEffect::Done) with [`ApiResult::Meta`]
    /// follows once every group recorded it (an error means some group may not have: the call is
    /// idempotent, call it again); [`NodeStatus::drains`](crate::node::NodeStatus::drains) on each node shows what is left in
    /// the groups it leads. A drained node holds nothing once no node reports anything left; it can then
    /// be stopped and taken out of the host's configuration.
    pub fn drain_node(&mut self, now: Time, id: ApiId, node: NodeId, drain: bool) {
        self.advance(now);
        let table = self.slot.table();
        let groups: Vec<GroupId> = table.groups().collect();
        self.fans.insert(id, (groups.len(), None));
        for group in groups {
            let command = Command::DrainNode { group, node, drain };
            if let Err(error) = self.propose_for(&command, ProposalPurpose::Fan(id)) {
                self.fan_done(id, Some(error.into()));
            }
        }
    }

    /// One proposal of a fanned-out API call finished; the call completes with the last one.
    pub(super) fn fan_done(&mut self, api: ApiId, error: Option<NodeError>) {
        let Some((left, failed)) = self.fans.get_mut(&api) else { return };
        *left = left.saturating_sub(1);
        if failed.is_none() {
            *failed = error;
        }
        if *left == 0 {
            let (_, failed) = self.fans.remove(&api).expect("present");
            self.done(api, ApiResult::Meta(failed.map_or(Ok(()), Err)));
        }
    }

    /// Starts migrating hash slot `slot` from the group that owns it to group `to`. The owner records the
    /// export and its leader carries it out (see [`SlotMigrationReport`](crate::node::controller::SlotMigrationReport) in [`NodeStatus::slot_migrations`](crate::node::NodeStatus::slot_migrations)
    /// on that leader): the slot's metadata is copied to `to` while writes go on, the slot is fenced
    /// (writes refused with the retryable [`Refusal::SlotFenced`](tidings_slot::fsm::Refusal::SlotFenced)), the keys written during the copy are
    /// copied, `to` takes the slot over and the source drops its copy. A write routed to the old owner
    /// afterwards is refused with [`Refusal::SlotMoved`](tidings_slot::fsm::Refusal::SlotMoved), which nodes follow on their own.
    /// [`NodeEffect::Done`](crate::node::NodeEffect::Done) with [`ApiResult::Meta`] says whether the export was accepted (a refusal names
    /// why: the slot is migrating already, `to` is its group or no group of the table...).
    pub fn migrate_slot(&mut self, now: Time, id: ApiId, slot: HashSlot, to: GroupId) {
        let group = self.slot.table().group_of(slot);
        let step = tidings_slot::model::SlotMigrationStep::Export { to };
        self.propose(now, id, Command::MigrateSlot { group, slot, step });
    }

    /// Abandons the migration of `slot` if it is not fenced yet: the slot stays with its group, and the
    /// target drops what it received. Refused once the slot is fenced (the target may own it already:
    /// the migration then completes).
    pub fn abort_slot_migration(&mut self, now: Time, id: ApiId, slot: HashSlot) {
        let group = self.slot.table().group_of(slot);
        let step = tidings_slot::model::SlotMigrationStep::AbortExport;
        self.propose(now, id, Command::MigrateSlot { group, slot, step });
    }

    /// Abandons `group`'s replica move: its leader takes the membership back to the committed assignment
    /// (a learner added is removed; a promotion already made is reverted the same way) and commits it.
    pub fn abort_slot_move(&mut self, now: Time, id: ApiId, group: GroupId) {
        self.propose(now, id, Command::AbortGroupMove { group });
    }

    /// Carries out the controller's actions and the messages this node sent itself.
    pub(super) fn run_controller(&mut self) {
        loop {
            if let Some(message) = self.loopback.pop_front() {
                self.node_message(self.config.node, message);
                continue;
            }
            let Some(action) = self.controller.poll_action() else { return };
            match action {
                Action::Propose { channel, tag, command } => {
                    let purpose = ProposalPurpose::Task { channel: channel.clone(), tag };
                    if let Err(error) = self.propose_for(&command, purpose) {
                        self.controller.proposal_done(self.now, &channel, tag, Err(error));
                    }
                }
                Action::Send { to, message } => self.send_node(to, message),
                Action::FetchMeta(channel) => self.fetch_meta(&channel, 0),
                Action::Finished { api, report } => {
                    if let Some(api) = api {
                        let result = match &report.outcome {
                            Ok(()) => Ok(report.clone()),
                            Err(error) => Err(NodeError::Task(error.clone())),
                        };
                        self.done(api, ApiResult::Task(result));
                    }
                }
            }
        }
    }
}
