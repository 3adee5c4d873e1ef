//! What every seed must satisfy, checked as the run goes (HW never goes back, slot replicas agree) and
//! once it healed (every acknowledged append read back in order and once, every channel writable again,
//! no move or migration left half done).

use super::World;
use bytes::Bytes;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use tidings::channel::machine::{AppendError, AppendRecord};
use tidings::node::{ApiResult, ChannelStatus, NodeCore, NodeError, RemoteAppendError};
use tidings::slot::model::SlotState;
use tidings::store::message::{MessageLog, ReadLimits, Record};
use tidings::store::{Kv, MetaStore};
use tidings::types::{ChannelId, GroupId, HashSlot, NodeId, Seq};

/// Route probes in flight at most (see `World::route_probes`).
const ROUTE_PROBES_MAX: usize = 4;

impl World {
    /// After healing, no slot-replica move is left half done: every group's leader shows no move target
    /// in its intent and no joint configuration.
    pub(super) fn check_moves_settled(&mut self) {
        let table = self.nodes.values().next().expect("nodes").config.table();
        for group in table.groups().collect::<Vec<_>>() {
            let Some(core) = self.group_leader(group) else {
                continue;
            };
            let joint = core.slot().status(group).is_some_and(|s| s.joint);
            let intent = core.reader().group_intent(group).ok().flatten();
            let moving = intent.as_ref().and_then(|i| i.target_peers.clone());
            // A move to a node back on an empty disk waits for a learner its peers refuse: for good,
            // until an operator aborts it (as one would, seeing `LearnerInactive`).
            let to_lost_disk = moving.as_ref().is_some_and(|to| self.lost_disk.is_some_and(|l| to.contains(&l)));
            if (joint || moving.is_some()) && !to_lost_disk {
                let decision = core.status().leadership.into_iter().find(|(g, _)| *g == group);
                self.oracle.violation(format!(
                    "liveness: {group} still moving after healing (joint {joint}, target {moving:?}, {decision:?})"
                ));
            }
        }
    }

    /// The running core that leads `group`, if any.
    pub(super) fn group_leader(&self, group: GroupId) -> Option<&tidings::node::NodeCore> {
        self.running_cores().find(|c| c.slot().is_leader(group))
    }

    /// The newest runtime meta of `channel` any running node stores.
    pub(super) fn newest_meta(&self, channel: &ChannelId) -> Option<tidings::types::ChannelRuntimeMeta> {
        self.nodes
            .values()
            .filter_map(|n| n.core.as_ref()?.reader().runtime_meta(channel).ok().flatten())
            .max_by_key(|m| m.version)
    }

    /// After healing, a node being drained holds no slot-group replica and no channel replica, if the
    /// nodes left undrained can hold them all (a drain with too few left waits, by design, for an
    /// operator). Replacements interrupted before their switch once left their new replicas behind, so
    /// that each retry added another until every node held one and the drained replica had nowhere to go
    /// (sim seed 269000079); and a replica behind its leader's retention boundary never caught up, so
    /// the replacement waiting for it timed out again and again (269000187).
    pub(super) fn check_drains_finished(&mut self) {
        let (draining, left) = self.drains_left();

        if !left.is_empty() {
            if std::env::var("SIM_DEBUG").is_ok() {
                for group in self.genesis().groups() {
                    let Some(core) = self.group_leader(group) else {
                        continue;
                    };
                    eprintln!("{} leads {group}: {:?}", core.node(), core.slot().status(group));
                    eprintln!("  intent {:?}; drains {:?}", core.reader().group_intent(group), core.status().drains);
                }
                for node in self.nodes.values() {
                    let Some(core) = node.core.as_ref() else { continue };
                    for task in core.status().tasks {
                        eprintln!("{} runs {task:?}", core.node());
                        for other in self.nodes.values() {
                            let status = other.core.as_ref().and_then(|c| c.channel_status(&task.channel));
                            eprintln!("  {}: {status:?}; log {:?}", other.config.node, other.log.state(&task.channel));
                        }
                    }
                }
            }
            self.oracle.violation(format!("liveness: drains of {draining:?} unfinished after healing: {left:?}"));
        }
    }

    /// The nodes whose drain is expected to finish, and what they still hold (see
    /// [`Self::check_drains_finished`]); nothing when no drain is expected to finish.
    pub(super) fn drains_left(&self) -> (BTreeSet<NodeId>, Vec<String>) {
        let leaders: Vec<(GroupId, &tidings::node::NodeCore)> = self
            .genesis()
            .groups()
            .filter_map(|group| {
                let core = self.group_leader(group)?;
                Some((group, core))
            })
            .collect();
        // A drain call that failed in some group (the workload does not retry it, as an operator would)
        // leaves the node draining in the others only: a drain is expected to finish only once every
        // group recorded it.
        let intents: Vec<Vec<NodeId>> = leaders
            .iter()
            .map(|(group, core)| {
                core.reader().group_intent(*group).ok().flatten().map(|i| i.draining).unwrap_or_default()
            })
            .collect();
        let every_group_led = leaders.len() == self.genesis().groups().count();
        let draining: BTreeSet<NodeId> = self
            .nodes
            .keys()
            .copied()
            .filter(|node| every_group_led && intents.iter().all(|d| d.contains(node)))
            .collect();
        // Where a replica may go depends on the nodes any group holds draining (each leader avoids those
        // its groups name): expected to finish only if the nodes no group names can hold every replica.
        let named: BTreeSet<&NodeId> = intents.iter().flatten().collect();
        let config = &self.nodes.values().next().expect("nodes").config;
        let needed = config.slot_replicas.max(config.channel_replicas);
        // A node back on an empty disk receives nothing either (its peers refuse it).
        let receiving = self.nodes.keys().filter(|n| !named.contains(n) && Some(**n) != self.lost_disk).count();
        if draining.is_empty() || receiving < needed {
            return (draining, Vec::new());
        }
        let mut left = Vec::new();
        for (group, core) in &leaders {
            // A move to a node back on an empty disk waits for good (see `check_moves_settled`).
            let target = core.reader().group_intent(*group).ok().flatten().and_then(|i| i.target_peers);
            if target.is_some_and(|to| self.lost_disk.is_some_and(|lost| to.contains(&lost))) {
                continue;
            }
            let members = core.slot().status(*group).map(|s| [s.voters, s.learners].concat()).unwrap_or_default();
            left.extend(members.iter().filter(|n| draining.contains(n)).map(|n| format!("{n} in {group}")));
        }
        for channel in &self.channels {
            let meta = self.newest_meta(channel);
            let on_drained = meta.iter().flat_map(|m| m.replicas.iter()).filter(|n| draining.contains(n));
            left.extend(on_drained.map(|n| format!("{n} in {channel} ({meta:?})")));
        }
        (draining, left)
    }

    /// After healing, no channel holds more replicas than it is created with (unless it has a replica
    /// on a node some group names draining, whose drain moves it first), when the seed's timings let
    /// the controllers give the surplus up in the healed phase and the settling time: a repair pass
    /// waits until the channel has kept the same replicas for `catch_up_timeout` before it gives one up
    /// (see `tidings::node::controller::surplus`), and an in-place replacement may wait for a drain.
    pub(super) fn check_surplus_given_up(&mut self) {
        let left = self.surplus_left();
        if !left.is_empty() {
            self.oracle.violation(format!("liveness: channels over their replication factor after healing: {left:?}"));
        }
    }

    /// What [`Self::check_surplus_given_up`] finds, or nothing when the seed's timings do not let it
    /// expect anything.
    pub(super) fn surplus_left(&self) -> Vec<String> {
        let config = &self.nodes.values().next().expect("nodes").config;
        let timings = &config.controller;
        let needed = timings.catch_up_timeout * 2 + timings.repair_idle_interval * 2 + timings.drain_timeout * 2;
        if needed > std::time::Duration::from_millis(self.params.liveness_ms + super::SETTLE_MAX_MS / 2) {
            return Vec::new();
        }
        let genesis = self.genesis();
        let leaders = genesis.groups().filter_map(|group| Some((group, self.group_leader(group)?)));
        let intents = leaders.map(|(group, core)| core.reader().group_intent(group).ok().flatten());
        let named: BTreeSet<NodeId> = intents.flatten().flat_map(|i| i.draining).collect();
        let factor = config.channel_replicas;
        self.channels
            .iter()
            .filter_map(|channel| {
                let meta = self.newest_meta(channel)?;
                let surplus = meta.replicas.len() > factor && !meta.replicas.iter().any(|n| named.contains(n));
                surplus.then(|| format!("{channel}: replicas {:?}, ISR {:?}", meta.replicas, meta.isr))
            })
            .collect()
    }

    /// After healing, no running node holds the log of a channel whose newest meta does not name it: the
    /// stray-log sweep forgot the logs of replicas moved away (`tidings::node::StrayLogConfig`; a pass a
    /// second here). A replica moved away while its node was down is found once the node is back.
    pub(super) fn check_stray_logs_forgotten(&mut self) {
        let left = self.stray_logs_left();
        if !left.is_empty() {
            self.oracle.violation(format!("liveness: logs of replicas moved away still held: {left:?}"));
        }
    }

    /// What [`Self::check_stray_logs_forgotten`] finds: node and channel of each log left.
    pub(super) fn stray_logs_left(&self) -> Vec<(NodeId, ChannelId)> {
        let mut left = Vec::new();
        // A node back on an empty disk cannot have a log confirmed stray by peers that refuse it.
        let running = self.nodes.iter().filter(|(id, n)| n.core.is_some() && Some(**id) != self.lost_disk);
        for (id, node) in running {
            for channel in node.log.logs_after(None, usize::MAX).unwrap_or_default() {
                if self.newest_meta(&channel).is_some_and(|meta| !meta.is_replica(*id)) {
                    left.push((*id, channel));
                }
            }
        }
        left
    }

    /// The voters of `group` in force, as its leader has them: replica moves change them, a replica moved
    /// away may linger until it hears it was removed, and a learner a move added late in the healing phase
    /// may still be catching up (neither is a replica the checks compare).
    pub(super) fn group_members(&self, group: GroupId) -> Vec<NodeId> {
        let mut members =
            self.group_leader(group).and_then(|c| c.slot().status(group)).map(|s| s.voters).unwrap_or_else(|| {
                // No leader to ask: every replica held counts (the checks then stay strict).
                let holding = self
                    .nodes
                    .iter()
                    .filter(|(_, n)| n.core.as_ref().is_some_and(|c| c.slot().groups().any(|g| g == group)));
                holding.map(|(id, _)| *id).collect()
            });
        // A node back on an empty disk stays a voter its peers refuse: it holds nothing to compare.
        members.retain(|id| Some(*id) != self.lost_disk);
        members
    }

    /// The highest seq of `channel` known committed: the highest of the HWs given (what replicas show
    /// now), of any HW a replica showed earlier (a leader may commit, answer and then lose its in-memory
    /// HW to a crash or a storage failure, or be replaced before anyone else shows it), and of the
    /// acknowledged seqs.
    pub(super) fn committed_through(&self, channel: &ChannelId, known: impl IntoIterator<Item = Seq>) -> Seq {
        known
            .into_iter()
            .chain(self.committed_seen.get(channel).copied())
            .chain([Seq::new(self.oracle.last_acked(channel))])
            .max()
            .unwrap_or(Seq::new(0))
    }

    /// Whether every running member of every slot group has applied the same index.
    pub(super) fn slot_replicas_agree(&self) -> bool {
        let groups: Vec<GroupId> = self.genesis().groups().collect();
        groups.into_iter().all(|group| {
            let members = self.group_members(group);
            let mut applied = self
                .nodes
                .iter()
                .filter(|(id, _)| members.contains(id))
                .filter_map(|(_, n)| n.core.as_ref().and_then(|c| c.slot().applied_index(group)));
            let first = applied.next();
            applied.all(|a| Some(a) == first)
        })
    }

    /// Replicas of a slot group hold identical metadata at the same applied index, and after the
    /// liveness phase every running replica of a group has applied as far as the others.
    pub(super) fn check_slot_replicas(&mut self) {
        let table = self.nodes.values().next().expect("nodes").config.table();
        for group in table.groups().collect::<Vec<_>>() {
            let reconfigured = self
                .running_cores()
                .any(|c| c.slot().is_leader(group) && c.slot().status(group).is_some_and(|s| s.config_epoch.get() > 0));
            self.faults.slot_groups_reconfigured += u64::from(reconfigured);
            let members = self.group_members(group);
            let mut seen: Vec<(NodeId, u64, u64)> = Vec::new();
            for (id, node) in self.nodes.iter().filter(|(id, _)| members.contains(id)) {
                let Some(applied) = node.core.as_ref().and_then(|c| c.slot().applied_index(group)) else { continue };
                let kv: Arc<dyn Kv> = node.kv.clone();
                let store = MetaStore::new(kv);
                let mut digest = 0xcbf2_9ce4_8422_2325u64;
                // Everything the replica holds of the group: its copies of slots and its own records.
                let entries = store.export_group(group, None, usize::MAX).map(|c| c.entries).unwrap_or_default();
                for entry in entries {
                    let space = entry.space.hash_slot().map_or(u16::MAX, |s| s.index());
                    for byte in [&space.to_le_bytes()[..], &entry.key, &entry.value].concat() {
                        digest = (digest ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3);
                    }
                }
                seen.push((*id, applied, digest));
            }
            let Some(&(first, applied, digest)) = seen.first() else { continue };
            for &(id, other_applied, other_digest) in &seen[1..] {
                if other_applied != applied && std::env::var("SIM_DEBUG").is_ok() {
                    for (nid, n) in &self.nodes {
                        let st = n.core.as_ref().and_then(|c| c.slot().status(group));
                        eprintln!("{nid}: {st:?}");
                    }
                }
                if other_applied != applied {
                    self.oracle.violation(format!(
                        "{group}: {first} applied through {applied}, {id} through {other_applied} after healing"
                    ));
                } else if other_digest != digest {
                    self.oracle.violation(format!("{group}: {first} and {id} differ at applied index {applied}"));
                }
            }
        }
    }

    /// The probes of a round: one append to every channel that acknowledged none yet (and waits for
    /// none) through a node drawn at random, and route probes (see [`World::route_probes`]).
    pub(super) fn probe(&mut self) {
        let waiting: BTreeSet<ChannelId> = self.probes.values().map(|(channel, _)| channel.clone()).collect();
        let ids = self.serving_nodes();
        for channel in self.channels.clone() {
            if self.acknowledged(&channel) || waiting.contains(&channel) {
                continue;
            }
            let node = *self.rng.pick(&ids).expect("nodes");
            self.send_probe(channel, node);
        }
        for (channel, node) in self.route_probes() {
            self.send_probe(channel, node);
        }
    }

    /// Route probes: appends to channels that took one already, through serving nodes none was
    /// acknowledged through yet, at most [`ROUTE_PROBES_MAX`] in flight. Any node takes any channel's
    /// append (one not leading it forwards it), so a node whose route to a leader went stale is found
    /// out (`misrouted`) — a probe through a node drawn at random was answered through another. Those
    /// refused as misrouted go first (a refusal stands only while its node is not probed again), the
    /// rest in turn from a cursor. Few at a time: probes through every node of every channel kept the
    /// activations of a whole round coming through the healed phase, more than tight limits have room
    /// for, and channels that took no turn failed the check of any append at all.
    fn route_probes(&mut self) -> Vec<(ChannelId, NodeId)> {
        let in_flight: BTreeSet<(ChannelId, NodeId)> = self.probes.values().cloned().collect();
        let routing = in_flight.iter().filter(|(channel, _)| self.acknowledged(channel)).count();
        let room = ROUTE_PROBES_MAX.saturating_sub(routing);
        let misrouted =
            self.misrouted.keys().filter(|pair| self.acknowledged(&pair.0) && !in_flight.contains(*pair)).cloned();
        let ids = self.serving_nodes();
        let unprobed: Vec<(ChannelId, NodeId)> = self
            .channels
            .iter()
            .filter(|channel| self.acknowledged(channel))
            .flat_map(|channel| ids.iter().map(move |node| (channel.clone(), *node)))
            .filter(|pair| {
                !self.probed.contains(pair) && !self.misrouted.contains_key(pair) && !in_flight.contains(pair)
            })
            .collect();
        let start = if unprobed.is_empty() { 0 } else { self.route_cursor % unprobed.len() };
        let in_turn = unprobed[start..].iter().chain(&unprobed[..start]).cloned();
        let chosen: Vec<(ChannelId, NodeId)> = misrouted.chain(in_turn).take(room).collect();
        self.route_cursor += chosen.len();
        chosen
    }

    /// `true` once a probe of `channel` was acknowledged through any node.
    fn acknowledged(&self, channel: &ChannelId) -> bool {
        self.probed.range((channel.clone(), NodeId::new(0))..).next().is_some_and(|(c, _)| c == channel)
    }

    fn send_probe(&mut self, channel: ChannelId, node: NodeId) {
        let api = self.api();
        let now = self.node_now(node);
        let payload = Bytes::from(format!("probe-{}-{}", self.params.seed, api.0));
        let record = AppendRecord { idempotency_key: None, payload: payload.clone() };
        if let Some(core) = self.nodes.get_mut(&node).and_then(|n| n.core.as_mut()) {
            core.append(now, api, channel.clone(), vec![record]);
            self.oracle.expect_append(api, node, channel.clone(), payload, None);
            self.probes.insert(api, (channel, node));
        }
    }

    /// A probe of `channel` through `via` was answered.
    ///
    /// A refusal as misrouted counts only once the channel took a probe through some node: before, a
    /// channel without a leader able to lead (one asking for its failover, the failover still to come)
    /// refuses through every node alike, and that is the liveness check's to judge, not a stale route
    /// (757000180: probes refused so while a channel waited for its failover were never probed again
    /// once it took appends — the route probes' room was held by channels waiting at the cap).
    pub(super) fn probe_answered(&mut self, channel: ChannelId, via: NodeId, result: &ApiResult) {
        let leader_found = self.acknowledged(&channel);
        let pair = (channel, via);
        let refused_before = self.misrouted.remove(&pair).map_or(0, |(times, _)| times);
        match result {
            ApiResult::Appended(Ok(_)) => {
                self.probed.insert(pair);
            }
            ApiResult::Appended(Err(
                error @ (NodeError::Append(AppendError::NotLeader { .. })
                | NodeError::Remote(RemoteAppendError::NotReplica)),
            )) if leader_found => {
                self.misrouted.insert(pair, (refused_before + 1, format!("{error:?}")));
            }
            _ => {}
        }
    }

    pub(super) fn genesis(&self) -> tidings::router::HashToSlot {
        self.nodes.values().next().expect("nodes").config.table()
    }

    /// The group that owns `slot` now: from its genesis owner along the groups' records of where it went
    /// (as their leaders have them).
    pub(super) fn owner_of(&self, slot: HashSlot) -> GroupId {
        let mut group = self.genesis().group_of(slot);
        for _ in 0..64 {
            let leader = self.group_leader(group);
            let record = leader.and_then(|c| c.reader().slot_record(group, slot).ok().flatten());
            match record.map(|r| r.state) {
                Some(SlotState::Gone { to }) => group = to,
                _ => return group,
            }
        }
        group
    }

    /// After healing, no hash-slot migration is left half done: no group's leader shows a slot exporting,
    /// fenced or importing (an import whose export was given up is dropped).
    pub(super) fn check_migrations_settled(&mut self) {
        let mut unsettled = Vec::new();
        for group in self.genesis().groups() {
            let Some(core) = self.group_leader(group) else { continue };
            let records = core.reader().slot_records(group).unwrap_or_default();
            for (slot, record) in records {
                if matches!(
                    record.state,
                    SlotState::Exporting { .. } | SlotState::Fenced { .. } | SlotState::Importing { .. }
                ) {
                    let driver = core.status().slot_migrations;
                    unsettled.push(format!(
                        "liveness: {slot} of {group} still migrating after healing ({record:?}, driver {driver:?})"
                    ));
                }
            }
        }
        if !unsettled.is_empty() && std::env::var("SIM_DEBUG").is_ok() {
            for (id, node) in &self.nodes {
                let Some(core) = node.core.as_ref() else { continue };
                for group in core.slot().groups() {
                    eprintln!("{id} {group}: {:?}", core.slot().status(group));
                }
            }
        }
        for violation in unsettled {
            self.oracle.violation(violation);
        }
    }

    pub(super) fn check_hw_monotonic(&mut self) {
        for (id, node) in &self.nodes {
            let Some(core) = node.core.as_ref() else { continue };
            let status = core.status();
            let channels = every_channel_status(core);
            if channels.len() != status.channels_active
                || !status.channels.iter().eq(&channels[..status.channels.len()])
            {
                self.oracle.violation(format!(
                    "{id}: its status counts {} active replicas and lists {:?}; its pages list {:?}",
                    status.channels_active, status.channels, channels
                ));
            }
            // A replica rebuilt after a storage failure lost what the failed write held, like a crash of
            // that replica: its HW may go back to what its log holds durably (the rest is on the others).
            if self
                .storage_failures_seen
                .insert(*id, status.storage_failures)
                .is_some_and(|s| s < status.storage_failures)
            {
                self.hw_seen.retain(|(n, _), _| n != id);
            }
            for channel in channels {
                let key = (*id, channel.channel.clone());
                if let Some(seen) = self.hw_seen.get(&key) {
                    if channel.hw < *seen {
                        self.oracle.violation(format!(
                            "{id}: HW of {} went back from {seen} to {}",
                            channel.channel, channel.hw
                        ));
                    }
                }
                let committed = self.committed_seen.entry(channel.channel.clone()).or_default();
                *committed = (*committed).max(channel.hw);
                self.hw_seen.insert(key, channel.hw);
            }
        }
    }

    /// No acknowledged append lost or changed; replicas agree at every seq at or below their HW; every
    /// acknowledged metadata write kept; every request answered unless its channel waits for a failover;
    /// every channel live and every route right once healed.
    pub(super) fn final_checks(&mut self) {
        self.check_channel_logs();
        self.check_users_kept();
        self.check_registers();
        self.count_final_faults();
        self.check_lost_disk_refused();
        self.check_joined();
        self.check_slot_replicas();
        self.check_moves_settled();
        self.check_drains_finished();
        self.check_surplus_given_up();
        self.check_stray_logs_forgotten();
        self.check_migrations_settled();
        self.oracle.check_answered();
        self.check_routes_healed();
        self.check_channels_live();
    }

    /// Every channel's replicas, as the newest meta names them, hold every acknowledged append and agree.
    fn check_channel_logs(&mut self) {
        for channel in self.channels.clone() {
            // The replicas the newest meta names (replacements move them).
            let Some(meta) = self.newest_meta(&channel) else {
                self.oracle.violation(format!("{channel}: no node stores its meta"));
                continue;
            };
            let (replicas, leader) = (meta.replicas, meta.leader);
            let mut logs: Vec<(NodeId, Seq, Vec<Record>)> = Vec::new();
            // A node back on an empty disk holds nothing its peers counted on (they refuse it).
            for id in replicas.iter().filter(|id| Some(**id) != self.lost_disk) {
                let node = &self.nodes[id];
                // An evicted replica's HW is its log's checkpoint.
                let active_hw =
                    node.core.as_ref().and_then(|c| c.channel_status(&channel)).map_or(Seq::new(0), |s| s.hw);
                let hw = active_hw.max(node.log.state(&channel).map_or(Seq::new(0), |s| s.hw));
                let limits = ReadLimits { records_max: usize::MAX, bytes_max: usize::MAX };
                let records = node.log.read(&channel, Seq::new(1), Seq::new(u64::MAX), limits).unwrap_or_default();
                logs.push((*id, hw, records));
            }
            self.oracle.check_durable(&channel, &logs);
            let in_memory_end =
                self.nodes[&leader].core.as_ref().and_then(|c| c.channel_status(&channel)).map(|s| s.log_end);
            self.oracle.check_leader_complete(&channel, leader, in_memory_end, &logs);
            self.check_senders_and_fanout(&channel, &logs);
        }
    }

    /// Every acknowledged metadata write is on every replica of the group owning its slot once healed.
    fn check_users_kept(&mut self) {
        let owners: BTreeMap<HashSlot, GroupId> =
            self.users_acked.keys().map(|slot| (*slot, self.owner_of(*slot))).collect();
        for (slot, uids) in &self.users_acked {
            let group = &owners[slot];
            let members = self.group_members(*group);
            for (id, node) in self.nodes.iter().filter(|(id, _)| members.contains(id)) {
                let Some(core) = node.core.as_ref() else { continue };
                for uid in uids {
                    if !matches!(core.reader().user(uid), Ok(Some(_))) {
                        if std::env::var("SIM_DEBUG").is_ok() {
                            eprintln!("{id} {group}: {:?}", core.slot().status(*group));
                        }
                        self.oracle.violation(format!("{id}: acknowledged user {} missing in {group}", uid.as_str()));
                    }
                }
            }
        }
    }

    /// The run's totals of what only the end shows: slots migrated, learners removed, fanout planned again.
    fn count_final_faults(&mut self) {
        self.faults.slots_migrated +=
            HashSlot::all().filter(|slot| self.owner_of(*slot) != self.genesis().group_of(*slot)).count() as u64;
        if std::env::var("SIM_DEBUG").is_ok() {
            for node in self.nodes.values() {
                for task in node.core.as_ref().map(|c| c.status().finished_tasks).unwrap_or_default() {
                    eprintln!("{}: {task:?}", node.config.node);
                }
            }
        }
        let reports = self.running_cores().flat_map(|c| c.status().finished_tasks);
        let removal = |r: &tidings::node::TaskReport| matches!(r.kind, tidings::node::TaskKind::RemoveLearner { .. });
        self.faults.learners_removed += reports.filter(|r| removal(r) && r.outcome.is_ok()).count() as u64;
        self.faults.fanout_planned_again += self.running_cores().map(|c| c.status().fanout_planned_again).sum::<u64>();
    }

    /// No node still forwards a channel's appends to a node that does not lead it.
    fn check_routes_healed(&mut self) {
        // Twice in a row: one probe may straddle a change of leader (a transfer back to a preferred
        // replica late in the healed phase); a stale route refuses every probe.
        for ((channel, node), (_, answer)) in self.misrouted.iter().filter(|(_, (times, _))| *times >= 2) {
            self.oracle.violation(format!(
                "liveness: {node} still forwards {channel}'s appends to a node that does not lead it after healing: {answer}"
            ));
        }
    }

    /// Every channel takes an append after healing.
    fn check_channels_live(&mut self) {
        for channel in &self.channels {
            if !self.acknowledged(channel) {
                let statuses: Vec<String> = self
                    .nodes
                    .values()
                    .filter_map(|n| n.core.as_ref())
                    .filter_map(|c| c.channel_status(channel))
                    .map(|s| format!("{:?}", s))
                    .collect();
                if std::env::var("SIM_DEBUG").is_ok() {
                    for (id, node) in &self.nodes {
                        let Some(core) = node.core.as_ref() else { continue };
                        eprintln!("{id} stored meta of {channel}: {:?}", core.reader().runtime_meta(channel));
                        for replica in every_channel_status(core) {
                            eprintln!("{id} replica: {replica:?}");
                        }
                        for group in core.slot().groups().collect::<Vec<_>>() {
                            eprintln!("{id} {group}: {:?}", core.slot().status(group));
                        }
                    }
                }
                let tasks: Vec<String> = self
                    .nodes
                    .values()
                    .filter_map(|n| n.core.as_ref())
                    .flat_map(|c| {
                        let status = c.status();
                        let running =
                            status.tasks.into_iter().filter(|t| &t.channel == channel).map(|t| format!("{t:?}"));
                        let done = status
                            .finished_tasks
                            .into_iter()
                            .filter(|t| &t.channel == channel)
                            .map(|t| format!("{t:?}"));
                        running.chain(done).map(move |t| format!("{}: {t}", c.node())).collect::<Vec<_>>()
                    })
                    .collect();
                self.oracle.violation(format!(
                    "liveness: {channel} takes no append after healing: {statuses:?}, tasks {tasks:?}"
                ));
            }
        }
    }

    /// A retention boundary answered in force is at or below the channel's high watermark (only
    /// committed records may be given up): HW only grows, so the highest any replica knows now bounds it.
    pub(super) fn check_retention_within_hw(&mut self, channel: &ChannelId, boundary: Seq) {
        let known: Vec<Seq> = self
            .nodes
            .values()
            .flat_map(|node| {
                let active = node.core.as_ref().and_then(|core| core.channel_status(channel)).map(|s| s.hw);
                active.into_iter().chain(node.log.state(channel).map(|s| s.hw))
            })
            .collect();
        let hw = self.committed_through(channel, known);
        if boundary > hw {
            self.oracle.violation(format!("{channel}: retention boundary {boundary} in force past HW {hw}"));
        }
    }
}

/// Every active channel replica of `core`, paged through `NodeCore::channel_statuses` as an operator
/// would (the simulator's tight limits list a few per page). At most a page per active replica and one
/// more: pages that did not move on would show as replicas listed twice.
pub(super) fn every_channel_status(core: &NodeCore) -> Vec<ChannelStatus> {
    let mut all: Vec<ChannelStatus> = Vec::new();
    for _ in 0..=core.active_channels() {
        let page = core.channel_statuses(all.last().map(|s| &s.channel), usize::MAX);
        if page.is_empty() {
            break;
        }
        all.extend(page);
    }
    all
}
