//! What an operator sees of a node: its channel replicas and counters (`NodeCore::status`).

use super::shards::Shards;
use super::NodeCore;
use crate::node::controller::{DrainReport, HandOffReport, Reconcile, SlotMigrationReport, TaskReport, TaskStatus};
use crate::node::shard::{shard_of, ShardStatus};
use std::collections::BTreeMap;
use tidings_channel::machine::ReplicaProgress;
use tidings_types::{ChannelId, Epoch, GroupId, LeaderEpoch, NodeId, Seq, StorageId};

/// Operator view of one channel replica on this node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChannelStatus {
    /// The channel.
    pub channel: ChannelId,
    /// This replica's role.
    pub role: tidings_channel::machine::RoleKind,
    /// Meta version, leader, leader epoch and membership epoch in force here.
    pub meta_version: u64,
    /// The leader named by the meta.
    pub leader: NodeId,
    /// Leader epoch.
    pub leader_epoch: LeaderEpoch,
    /// Membership epoch.
    pub epoch: Epoch,
    /// ISR.
    pub isr: Vec<NodeId>,
    /// High watermark.
    pub hw: Seq,
    /// The high watermark last checkpointed to storage: a restart starts from it. It trails `hw` while
    /// commits are frequent, and catches up within about a second once the channel is idle.
    pub hw_durable: Seq,
    /// Last seq of the local log.
    pub log_end: Seq,
    /// Last durable seq.
    pub durable_last: Seq,
    /// The retention boundary in force here: records at or below it are given up (reads start after it).
    pub retention_through: Seq,
    /// On the leader: appends admitted and waiting for HW to cover them.
    pub pending_appends: usize,
    /// On the leader: every other replica's progress (acknowledged seq, lag, silence), in node order.
    /// Empty on other replicas: only the leader hears from every replica.
    pub replicas: Vec<ReplicaProgress>,
}

/// Operator view of a node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeStatus {
    /// The node.
    pub node: NodeId,
    /// Raft status of the slot groups it serves.
    pub groups: Vec<tidings_slot::raft::GroupStatus>,
    /// Its first active channel replicas in channel order, at most `NodeConfig::status_channels_max`
    /// (`channels_active` counts them all; `Node::channel_statuses` pages through the rest).
    pub channels: Vec<ChannelStatus>,
    /// Its active channel replicas, listed in `channels` or not.
    pub channels_active: usize,
    /// Its active channel replicas that lead their channel (idle ones it leads are not counted: see
    /// [`NodeStatus::channels_left_to_hand_off`] and [`NodeStatus::hand_offs`]).
    pub channels_leading: usize,
    /// This node is leaving ([`NodeCore::set_leaving`]): it hands off its leaderships and takes no new
    /// ones.
    pub leaving: bool,
    /// Channel tasks (failovers, transfers) this node's controller runs.
    pub tasks: Vec<TaskStatus>,
    /// The last tasks it finished, oldest first.
    pub finished_tasks: Vec<TaskReport>,
    /// Slot-group reconciliation (replica moves, preferred leader): the last decision for each slot
    /// group this node leads.
    pub leadership: Vec<(GroupId, Reconcile)>,
    /// Drains in progress, as far as the slot groups this node leads show them (see [`DrainReport`]).
    pub drains: Vec<DrainReport>,
    /// Leaving nodes' channel leaderships still to hand off, as far as the slot groups this node leads
    /// show them (see [`HandOffReport`]).
    pub hand_offs: Vec<HandOffReport>,
    /// While this node is leaving: the channels it still leads, active or idle, once the leader of
    /// every slot group has reported on its slots since the leave began (each does after its repair
    /// passes, every `ControllerConfig::repair_interval` while a node leaves); `None` before that,
    /// and when not leaving. `Some(0)`: every leadership is handed off.
    pub channels_left_to_hand_off: Option<usize>,
    /// Healthy channels holding more replicas than `NodeConfig::channel_replicas` (left by replacements
    /// that did not finish) that the last repair passes over the slot groups this node leads found, and
    /// that wait to give one up (see `ControllerConfig::catch_up_timeout`).
    pub channels_over_factor: usize,
    /// Hash-slot migrations this node drives (it leads their source groups).
    pub slot_migrations: Vec<SlotMigrationReport>,
    /// Inbound frames refused since start, by reason ([`FrameError::kind`](crate::frame::FrameError::kind)); they changed nothing.
    /// `storage_changed`: frames of a peer that came back on another data directory without being
    /// drained (see [`NodeStatus::storage_refused_by`] on that peer).
    pub refused_frames: BTreeMap<&'static str, u64>,
    /// This node's storage identity: drawn when its data directory was first initialized, named by
    /// every frame it sends.
    pub storage_id: StorageId,
    /// Peers that refused this node's frames in the last 10 s, with the storage identity each knows for
    /// it: this node was started on a new or emptied data directory without being drained first, and
    /// takes part in nothing with them (see "A lost data directory" in `docs/operations.md`).
    pub storage_refused_by: Vec<(NodeId, StorageId)>,
    /// This node is held back until a majority of the cluster took its storage identity (a new
    /// cluster's first start, for a round trip; a node on a new or emptied directory its peers refuse,
    /// for good): it takes no frame but identity messages and sends none but its hellos, so it knows no
    /// leader and no channel, and its calls fail or time out.
    pub storage_quarantined: bool,
    /// Channel replicas activated since start (each a new incarnation built from the store): at a
    /// steady load it grows with the channels that come back from eviction. Growing much faster than
    /// the appends, replicas are churning in and out at `active_channels_max`.
    pub activations: u64,
    /// Channel activations refused because `active_channels_max` replicas were active and none idle.
    pub refused_activations: u64,
    /// Channel activations that found `active_channels_max` replicas active and none able to leave at
    /// once, and waited (up to a second or two, their inputs parked) for the next place a replica freed;
    /// those still without one after that are counted in `refused_activations` too.
    pub activations_queued_for_room: u64,
    /// Busy leaders asked to take no new append for a few seconds and leave their place for a leader
    /// refused room (one a shard at a time, each after holding its place for a second or more).
    pub leaders_asked_to_leave: u64,
    /// Leaders that left memory, records not committed yet and no caller waiting on them, for a
    /// follower that found no other room (its leader elsewhere may be what they wait for); each comes
    /// back, resuming its leadership, with the next pull or append.
    pub stalled_leaders_evicted: u64,
    /// Leaders whose only work left was fanout, and which had held their place for a second or more,
    /// that left memory for an activation that found no other room. Each hands its unfinished fanout
    /// to its next incarnation (the node tries it again at the next eviction scans), which plans again
    /// every committed message past the fanout progress it checkpointed: a member may get a message
    /// twice.
    pub fanning_out_leaders_evicted: u64,
    /// Raft messages in accepted frames that the slot layer refused (see `MultiRaft::refused_messages`).
    pub refused_raft_messages: u64,
    /// Channel answers and hints of an older leader epoch than the meta in force (answers refused;
    /// hints answered with the newer epoch, which sends their stale sender for the meta), plus raft
    /// messages of an older term (raft-rs ignores or answers those; they change no state) and slot
    /// raft answers of an older configuration epoch than their group knows (dropped: see
    /// `SlotBody::known_epoch`).
    pub stale_messages: u64,
    /// Channel replicas rebuilt from their store after a storage failure since start. A rebuilt replica
    /// keeps its HW as far as its log holds it durably; a record committed by the other ISR members but
    /// lost here in the failed write comes back from the leader.
    pub storage_failures: u64,
    /// A write or a sync of this node's slot store failed: its slot replicas persist, acknowledge and apply nothing
    /// more until the node restarts (see `MultiRaft::storage_failed`); metadata calls through it time out
    /// or go to other nodes.
    pub slot_storage_failed: bool,
    /// Channel metas the channel shards hold in memory: those of active replicas, and of evicted ones
    /// whose meta this node's slot replicas do not keep (an evicted replica's meta kept there is let go
    /// and read back on its next use).
    pub channel_metas_held: usize,
    /// Channel replicas being activated: their storage reads handed off (at most 1,024 per shard) or
    /// queued, with the inputs that wait for them.
    pub channels_loading: usize,
    /// Replicas this node leads, out of memory, filed to start at the next eviction scans (one a second,
    /// up to a minute) once they find a place: a leadership given to this node while it had no room, or
    /// a leader that left memory with only fanout to do (`fanning_out_leaders_evicted`). Each one's
    /// barrier, its followers' wake-up and the fanout of what it or its predecessor left wait for its
    /// start. Staying above zero: busier channels than places (raise `active_channels_max`).
    pub leaderships_to_start: usize,
    /// Activations given up because their load was not answered within 30 s since start (their
    /// waiting appends got `Busy`).
    pub loads_given_up: u64,
    /// Subscriber pages this node asked for (of other nodes, when it keeps no replica of their channel's
    /// slot group, or its own store could not read them) and that no node served within 30 s: each
    /// ended one message's fanout early (the message stays committed).
    pub fanout_pages_abandoned: u64,
    /// Subscriber pages this node's slot store failed to read, for its own fanout (each is asked of
    /// another node, or read here again after a pause) or for a peer's (answered as not served, so the
    /// peer asks another node). A read of a deny entry or a membership that fails fails its page: no
    /// member is delivered as though it had none.
    pub fanout_page_read_failures: u64,
    /// Committed messages that leaders on this node fanned out again after taking over their channel:
    /// their predecessor's fanout was not known to have finished them, so some members may get them
    /// twice (fanout is at least once).
    pub fanout_planned_again: u64,
    /// Committed messages of earlier leaders that new leaders here did not plan again although their
    /// fanout was not known to finish: more than `MachineConfig::handoff_slots` were past what they
    /// knew, and only the most recent are planned again. Some members may have missed them.
    pub fanout_skipped: u64,
    /// Committed messages this node's fanout has not finished: waiting for the planner, being paged, or
    /// waiting for their deliveries to end. It grows when fanout lags the commits (slow subscriber
    /// pages, a slow host); the oldest committed message waits behind all of them. A leader that left
    /// memory fanning out takes its unfinished messages with it: they count here again once its next
    /// incarnation starts (until then it is one of [`NodeStatus::leaderships_to_start`]).
    pub fanout_backlog: usize,
    /// Logs of channel replicas moved off this node (a replacement, a drain, a surplus removal) that
    /// the stray-log sweep forgot, giving their space back (`NodeConfig::stray_logs`).
    pub stray_logs_forgotten: u64,
    /// Passes of the stray-log sweep over this node's logs finished since the node started.
    pub stray_log_passes: u64,
}

impl NodeStatus {
    /// `true` once this node, leaving, leads nothing: no slot group, no active channel replica, and
    /// every slot group's leader reported none of its channels left, idle ones included
    /// (`channels_left_to_hand_off == Some(0)`). What [`Node::hand_off_leaderships`](crate::Node::hand_off_leaderships)
    /// waits for.
    pub fn handed_off(&self) -> bool {
        let leads_a_group = self.groups.iter().any(|g| g.leader == Some(self.node));
        !leads_a_group && self.channels_leading == 0 && self.channels_left_to_hand_off == Some(0)
    }

    /// Adds a channel shard's counters and its page of replicas, keeping the first `limit` replicas.
    pub(crate) fn add_shard(&mut self, shard: ShardStatus, limit: usize) {
        self.channels = first_in_order([std::mem::take(&mut self.channels), shard.channels], limit);
        self.channels_active += shard.active;
        self.channels_leading += shard.leading;
        self.activations += shard.counters.activations;
        self.refused_activations += shard.counters.refused_activations;
        self.activations_queued_for_room += shard.counters.activations_queued_for_room;
        self.leaders_asked_to_leave += shard.counters.leaders_asked_to_leave;
        self.stalled_leaders_evicted += shard.counters.stalled_leaders_evicted;
        self.fanning_out_leaders_evicted += shard.counters.fanning_out_leaders_evicted;
        self.stale_messages += shard.counters.stale_messages;
        self.storage_failures += shard.counters.storage_failures;
        self.channel_metas_held += shard.metas_held;
        self.channels_loading += shard.loading;
        self.leaderships_to_start += shard.leaderships_to_start;
        self.loads_given_up += shard.counters.loads_given_up;
        self.fanout_skipped += shard.counters.fanout_skipped;
        self.stray_logs_forgotten += shard.counters.stray_logs_forgotten;
    }
}

impl NodeCore {
    /// Status of the node, its slot groups and its first `NodeConfig::status_channels_max` active channel
    /// replicas in channel order (role, epochs, HW, log end, ISR; [`NodeCore::channel_statuses`] pages
    /// through the rest). With the shards detached, their part is added by whoever runs them.
    pub fn status(&self) -> NodeStatus {
        let groups = self.slot.groups().filter_map(|g| self.slot.status(g)).collect();
        let mut status = NodeStatus {
            node: self.config.node,
            groups,
            channels: Vec::new(),
            channels_active: 0,
            channels_leading: 0,
            leaving: self.controller.leaving(),
            tasks: self.controller.status(),
            finished_tasks: self.controller.reports(),
            leadership: self.preferred.decisions(),
            drains: self.controller.drain_reports(),
            hand_offs: self.controller.hand_off_reports(),
            channels_left_to_hand_off: self.controller.channels_left_to_hand_off(self.slot.genesis().groups()),
            channels_over_factor: self.controller.channels_over_factor(),
            slot_migrations: self.migrations.reports(),
            refused_frames: self.refused_frames.clone(),
            storage_id: self.identities.own(),
            storage_refused_by: self.identities.refusing(self.now),
            storage_quarantined: self.identities.quarantined(),
            activations: 0,
            refused_activations: 0,
            activations_queued_for_room: 0,
            leaders_asked_to_leave: 0,
            stalled_leaders_evicted: 0,
            fanning_out_leaders_evicted: 0,
            refused_raft_messages: self.slot.refused_messages(),
            stale_messages: self.slot.stale_messages(),
            storage_failures: 0,
            slot_storage_failed: self.slot.storage_failed(),
            channel_metas_held: 0,
            channels_loading: 0,
            leaderships_to_start: 0,
            loads_given_up: 0,
            fanout_pages_abandoned: self.fanout_pages_abandoned,
            fanout_page_read_failures: self.fanout_page_read_failures,
            fanout_planned_again: self.fanout_planned_again,
            fanout_skipped: 0,
            fanout_backlog: self.fanout_waiting.len() + self.fanout.jobs_open(),
            stray_logs_forgotten: 0,
            stray_log_passes: self.stray_logs.passes,
        };
        if let Shards::Inline(shards) = &self.shards {
            for shard in shards {
                status.add_shard(shard.status(None, self.config.status_channels_max), self.config.status_channels_max);
            }
        }
        status
    }

    /// Status of this node's replica of `channel` when the core drives its shards (`None`: not active
    /// here, or the shards run elsewhere — the runtime answers [`Node::channel_status`](crate::Node::channel_status) from the
    /// channel's reactor).
    pub fn channel_status(&self, channel: &ChannelId) -> Option<ChannelStatus> {
        match &self.shards {
            Shards::Inline(shards) => shards[shard_of(channel, shards.len())].channel_status(channel),
            Shards::Detached { .. } => None,
        }
    }

    /// A page of this node's active channel replicas when the core drives its shards: the first `limit`
    /// (at most `NodeConfig::status_channels_max`) in channel order past `after` (empty when the shards
    /// run elsewhere — the runtime answers [`Node::channel_statuses`](crate::Node::channel_statuses)
    /// from its reactors). The next page starts after the last channel of this one.
    pub fn channel_statuses(&self, after: Option<&ChannelId>, limit: usize) -> Vec<ChannelStatus> {
        let limit = limit.min(self.config.status_channels_max);
        match &self.shards {
            Shards::Inline(shards) => first_in_order(shards.iter().map(|s| s.status(after, limit).channels), limit),
            Shards::Detached { .. } => Vec::new(),
        }
    }
}

/// The first `limit` replicas in channel order of the shards' `pages`.
pub(crate) fn first_in_order(pages: impl IntoIterator<Item = Vec<ChannelStatus>>, limit: usize) -> Vec<ChannelStatus> {
    let mut page: Vec<ChannelStatus> = pages.into_iter().flatten().collect();
    page.sort_by(|a, b| a.channel.cmp(&b.channel));
    page.truncate(limit);
    page
}
