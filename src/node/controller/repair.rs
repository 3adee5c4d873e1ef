//! The repair pass over the metas of the slot groups this node leads: failovers for channels whose
//! leader is down, replacements of replicas on down or drained nodes, and fences a vanished controller
//! left behind.

use super::report::{TaskError, TaskKind};
use super::{Action, Controller, DrainReport, HandOffReport, FENCES_SEEN_MAX};
use crate::node::message::NodeMessage;
use crate::node::rendezvous;
use std::collections::BTreeMap;
use std::time::Duration;
use tidings_slot::query::SlotReader;
use tidings_slot::raft::MultiRaft;
use tidings_types::{ChannelId, ChannelRuntimeMeta, GroupId, NodeId, Time};

impl super::RepairScan {
    /// Files, for each node `group`'s intent says is `draining`, that its drain is under way and, if it
    /// is still one of the group's `members` (voter or learner) or `named` by its assignment or a move
    /// under way, that the group is left to it: an aborted move goes back to the assignment, so a group
    /// naming the node may take a replica back to it though it holds none now.
    fn note_drains(&mut self, group: GroupId, draining: &[NodeId], members: &[NodeId], named: &[NodeId]) {
        for node in draining {
            self.drain_left.entry(*node).or_default();
            if members.contains(node) || named.contains(node) {
                self.drain_groups.entry(*node).or_default().push(group);
            }
            self.draining.insert(*node);
        }
    }
}

impl Controller {
    /// One page of the repair walk over the slots of the groups this node leads: a pass starts when the
    /// last one is done, walks `ControllerConfig::repair_page` metas per step, and when it has walked
    /// every slot files its reports and schedules the next.
    pub(super) fn repair_step(&mut self, now: Time, slot: &MultiRaft, reader: &SlotReader) {
        if !self.scan.active {
            self.begin_repair_pass(now, slot, reader);
        }
        self.walk_repair_page(now, slot, reader);
        if self.scan.index >= self.scan.slots.len() {
            self.finish_repair_pass(now);
        } else {
            // Continue on the next tick; pages keep each step short.
            self.scan.next_pass = now + Duration::from_millis(5);
        }
    }

    /// Starts a pass: the slots of the groups led now, and what every local group's intent says of
    /// drains.
    fn begin_repair_pass(&mut self, now: Time, slot: &MultiRaft, reader: &SlotReader) {
        let table = slot.table();
        let led: Vec<GroupId> = slot.groups().filter(|g| slot.is_leader(*g)).collect();
        self.scan.slots = led.iter().flat_map(|g| table.slots_of(*g).map(|s| (*g, s)).collect::<Vec<_>>()).collect();
        self.scan.index = 0;
        self.scan.cursor = None;
        self.scan.active = true;
        self.scan.pass += 1;
        self.scan.draining.clear();
        self.scan.drain_left.clear();
        self.scan.drain_groups.clear();
        // Every node leaving shows, in every group walked, with nothing left once none of the
        // pass's channels names it.
        let walked: BTreeMap<GroupId, usize> = led.iter().map(|group| (*group, 0)).collect();
        self.scan.hand_offs_left = self.leaving_nodes(now).into_iter().map(|node| (node, walked.clone())).collect();
        self.scan.incomplete = false;
        self.scan.rebalances = 0;
        self.scan.rebalance_due = None;
        // Every local group's intent, read once: drains are recorded in all of them, so any local copy
        // tells placement; the led groups' also drive this pass's replacements and drain reports.
        let mut draining_by_group: BTreeMap<GroupId, Vec<NodeId>> = BTreeMap::new();
        // The nodes each group's assignment, and any move under way, name: a drained node is still in
        // a group a move is taking back to it (an abort retargets a move to the assignment, which may
        // name it), so its drain is not done even while it holds no replica there.
        let mut named_by_group: BTreeMap<GroupId, Vec<NodeId>> = BTreeMap::new();
        for group in slot.groups() {
            match reader.group_intent(group) {
                Ok(None) => {
                    draining_by_group.insert(group, Vec::new());
                }
                Ok(Some(intent)) => {
                    let named = intent.desired_peers.iter().chain(intent.target_peers.iter().flatten()).copied();
                    named_by_group.insert(group, named.collect());
                    draining_by_group.insert(group, intent.draining);
                }
                Err(error) => {
                    tracing::warn!(%error, %group, "repair: cannot read the group's intent");
                    self.scan.incomplete = true;
                }
            }
        }
        self.drains_known = draining_by_group.values().flatten().copied().collect();
        for group in led {
            let draining = draining_by_group.remove(&group).unwrap_or_default();
            let members = slot.status(group).map(|s| [s.voters, s.learners].concat()).unwrap_or_default();
            let named = named_by_group.remove(&group).unwrap_or_default();
            self.scan.note_drains(group, &draining, &members, &named);
        }
    }

    /// Walks one page of metas from where the pass stands, considering each for repair.
    fn walk_repair_page(&mut self, now: Time, slot: &MultiRaft, reader: &SlotReader) {
        let mut budget = self.config.repair_page;
        // Whether this node hears a quorum of a group, judged once per group in this step.
        let mut heard: BTreeMap<GroupId, bool> = BTreeMap::new();
        while budget > 0 && self.tasks.len() < self.config.tasks_max {
            let Some((group, hash_slot)) = self.scan.slots.get(self.scan.index).copied() else { break };
            if !*heard.entry(group).or_insert_with(|| self.hears_quorum_of(slot, group, now)) {
                // This node may be the one cut off: its failure detector's verdicts are not to be acted on.
                self.scan.incomplete = true;
                self.scan.index += 1;
                self.scan.cursor = None;
                budget -= 1;
                continue;
            }
            let page = match reader.runtime_metas(group, hash_slot, self.scan.cursor.as_deref(), budget) {
                Ok(page) => page,
                Err(error) => {
                    tracing::warn!(%error, slot = %hash_slot, "repair: cannot read runtime metas; slot skipped");
                    self.scan.incomplete = true;
                    tidings_slot::query::Page { items: Vec::new(), cursor: None }
                }
            };
            budget = budget.saturating_sub(page.items.len().max(1));
            for meta in page.items {
                if self.is_leaving(meta.leader, now) && !self.is_down(meta.leader, now) {
                    let led = self.scan.hand_offs_left.entry(meta.leader).or_default();
                    *led.entry(group).or_default() += 1;
                }
                self.consider(now, meta);
            }
            match page.cursor {
                Some(cursor) => self.scan.cursor = Some(cursor),
                None => {
                    self.scan.index += 1;
                    self.scan.cursor = None;
                }
            }
        }
    }

    /// Ends a pass: files the drain and hand-off reports, tells each leaving node what it still leads,
    /// and schedules the next pass (sooner while nodes are down, draining or leaving).
    fn finish_repair_pass(&mut self, now: Time) {
        self.scan.active = false;
        self.surplus_pass_done();
        if !self.scan.incomplete {
            self.file_progress_reports();
        }
        let busy = !self.down.is_empty()
            || !self.scan.draining.is_empty()
            || !self.hand_off_reports.is_empty()
            || self.scan.incomplete;
        let pause = if busy { self.config.repair_interval } else { self.config.repair_idle_interval };
        let rebalance = self.scan.rebalance_due.map(|due| due.max(now + self.config.repair_interval));
        self.scan.next_pass = rebalance.map_or(now + pause, |due| due.min(now + pause));
    }

    /// Files a complete pass's drain and hand-off reports, and tells each leaving node what it still
    /// leads, group by group.
    fn file_progress_reports(&mut self) {
        let scan = &mut self.scan;
        self.drain_reports = scan
            .drain_left
            .iter()
            .map(|(node, left)| DrainReport {
                node: *node,
                slot_groups: scan.drain_groups.remove(node).unwrap_or_default(),
                channel_replicas: *left,
            })
            .collect();
        let hand_offs = std::mem::take(&mut self.scan.hand_offs_left);
        self.hand_off_reports = hand_offs
            .iter()
            .map(|(node, groups)| HandOffReport { node: *node, channels_led: groups.values().sum() })
            .collect();
        // Each leaving node learns what is left of its own, group by group: it waits for none.
        for (node, groups) in hand_offs {
            let channels_led = groups.into_iter().map(|(g, led)| (g, u32::try_from(led).unwrap_or(u32::MAX)));
            let message = NodeMessage::HandOffProgress { channels_led: channels_led.collect() };
            self.actions.push_back(Action::Send { to: node, message });
        }
    }

    /// `true` if this node heard lately from a majority of `group`'s voters, itself included. A slot
    /// group leader cut off from the others keeps leading until check-quorum deposes it (one to two
    /// election timeouts), and meanwhile its failure detector holds every peer down: acting on that, it
    /// would fence and fail over channels whose leaders are fine, and finish once it reaches them again.
    /// "Lately" is the detector's own window less one ping interval: when a cut-off node first holds a
    /// channel's leader down, no other peer has been heard within it either (their last pings came at
    /// most one interval apart), while a healthy peer is heard every interval.
    fn hears_quorum_of(&self, slot: &MultiRaft, group: GroupId, now: Time) -> bool {
        let Some(status) = slot.status(group) else { return false };
        let (window, ping) = (self.config.node_down_after, self.config.ping_interval);
        let lately = window.saturating_sub(ping).max(window / 2);
        let heard = |node: &&NodeId| {
            **node == self.me || self.liveness.silent_for(**node, now).is_some_and(|silent| silent < lately)
        };
        status.voters.iter().filter(heard).count() * 2 > status.voters.len()
    }

    pub(super) fn consider(&mut self, now: Time, meta: ChannelRuntimeMeta) {
        self.track_fence(now, &meta);
        if meta.write_fence.is_some() {
            return;
        }
        let leader_down = meta.leader != self.me && self.is_down(meta.leader, now);
        if self.tasks.contains_key(&meta.channel) {
            self.consider_beside_task(now, meta, leader_down);
            return;
        }
        if leader_down {
            self.start_failover(now, meta);
            return;
        }
        if self.is_leaving(meta.leader, now) && self.hand_off(now, &meta) {
            return;
        }
        let drained = meta.replicas.iter().copied().find(|n| self.scan.draining.contains(n));
        if let Some(from) = drained {
            *self.scan.drain_left.entry(from).or_default() += 1;
        }
        // Fewer live ISR members than MinISR: nothing commits until a replica that has been down for
        // `replace_down_after` is replaced by a live node that keeps no copy yet. First, before a drain:
        // a drained replica moves only with MinISR live members left to hold what is committed, and a
        // member that never comes back (a node its peers refuse for its storage identity) would hold
        // the channel, or the drain, for good.
        let live = meta.isr.iter().filter(|n| !self.is_down(**n, now)).count();
        // Moving a drained ISR member away needs MinISR live members besides it to hold the records.
        let live_besides_drained = meta.isr.iter().filter(|n| !self.is_down(**n, now) && Some(**n) != drained).count();
        if live_besides_drained < usize::from(meta.min_isr) && self.replace_down_isr_member(now, &meta) {
            return;
        }
        if let Some(from) = drained {
            self.move_off_drained(now, meta, from, live_besides_drained);
            return;
        }
        if live >= usize::from(meta.min_isr) && !self.give_up_surplus_replica(now, &meta) {
            self.return_to_preferred_leader(now, meta);
        }
    }

    /// A channel with a task in flight: only a failover may preempt it, or its replacement target went
    /// down.
    fn consider_beside_task(&mut self, now: Time, meta: ChannelRuntimeMeta, leader_down: bool) {
        // A replacement started just before its leader went down (a drain asked right after a crash,
        // before the failure detector held the node down) would otherwise keep the channel without a
        // leader until its catch-up timed out (two minutes by default).
        if leader_down && self.failover_preempts(&meta.channel) {
            self.start_failover(now, meta);
        } else if let Some(to) = self.replacement_target_down(&meta.channel, now) {
            // A replacement still catching up on a target that went down (crashed, or back on an
            // emptied disk and refused) waited out its catch-up timeout, two minutes by default,
            // and the channel had no other repair meanwhile: its leader had taken the learner into
            // the ISR once it caught up, the ISR stood at MinISR with that member down, and nothing
            // committed (sim seed 665000721). Ended, the next pass repairs the channel afresh.
            let task = self.tasks.remove(&meta.channel).expect("present");
            self.finish(now, task, Err(TaskError::TargetDown(to)));
        }
    }

    /// Called with fewer than MinISR live ISR members (a drained one not counted): replaces an ISR
    /// member that has been down for long with a node that can take its place. Whether a replacement
    /// started.
    fn replace_down_isr_member(&mut self, now: Time, meta: &ChannelRuntimeMeta) -> bool {
        let Some(from) = meta.isr.iter().copied().find(|n| self.is_gone(*n, now)) else { return false };
        // Never a member already in the ISR (`replacement_for` may give a drained replica up to one of
        // the channel's other replicas): the ISR must gain a member. Then a learner that is up (it holds
        // a copy), then a drained node when nothing else can take the place: the channel commits again,
        // and the drain moves that replica on once another node can take it.
        let undrained = self.replacement_for(meta, from, now).filter(|to| !meta.in_isr(*to));
        let learner_up = || {
            let mut learners = meta.replicas.iter().copied().filter(|n| *n != from && !meta.in_isr(*n));
            learners.find(|n| !self.is_down(*n, now))
        };
        let drained_up = || {
            let mut key = Vec::new();
            meta.channel.encode_key(&mut key);
            let candidates = self.liveness.peers().chain(std::iter::once(self.me));
            rendezvous::best(&key, candidates.filter(|n| !meta.is_replica(*n) && !self.is_down(*n, now)))
        };
        let Some(to) = undrained.or_else(learner_up).or_else(drained_up) else { return false };
        tracing::info!(channel = %meta.channel, %from, %to, "repair: ISR below MinISR, replacing a replica that is down");
        let _ = self.start_replace(now, None, meta.clone(), from, to);
        true
    }

    /// Moves the replica on drained node `from` to a live, undrained node (one task per channel at a
    /// time).
    fn move_off_drained(&mut self, now: Time, meta: ChannelRuntimeMeta, from: NodeId, live_besides_drained: usize) {
        // Its replacement takes its ISR place: with fewer than MinISR live members in the new ISR,
        // the switch could never find every committed record on MinISR of them, and the task would
        // only fence the channel for its drain timeout, again and again, until the down member is
        // back, or gone and replaced above (sim seed 363001271: a drained leader whose one other ISR
        // member had lost its disk).
        if meta.in_isr(from) && live_besides_drained + 1 < usize::from(meta.min_isr) {
            return;
        }
        if let Some(to) = self.replacement_for(&meta, from, now) {
            tracing::info!(channel = %meta.channel, %from, %to, "repair: moving a replica off a drained node");
            if let Err(error) = self.start_replace(now, None, meta, from, to) {
                tracing::debug!(%error, %from, "repair: drain replacement not started");
            }
        }
    }

    /// Hands the leadership of a channel whose leader is leaving to another live ISR member that is not
    /// leaving or drained: the preferred replica if it is one, else one chosen by rendezvous hash; not
    /// again within the backoff of a hand-off that failed. With fewer than MinISR live members left
    /// once the leader stops, the channel will not commit until it is back, hand-off or not; handed
    /// off, it needs no failover then, and it commits meanwhile. `true` if one started.
    fn hand_off(&mut self, now: Time, meta: &ChannelRuntimeMeta) -> bool {
        if self.rebalance_backoff.get(&meta.channel).is_some_and(|retry_at| *retry_at > now) {
            return false;
        }
        let eligible = |n: &NodeId| *n != meta.leader && self.may_receive(*n, now);
        let preferred = meta.replicas.first().copied().filter(|n| meta.in_isr(*n) && eligible(n));
        let target = preferred.or_else(|| {
            let mut key = Vec::new();
            meta.channel.encode_key(&mut key);
            rendezvous::best(&key, meta.isr.iter().copied().filter(eligible))
        });
        let Some(target) = target else {
            tracing::debug!(channel = %meta.channel, isr = ?meta.isr, "repair: no ISR member can take over from a leaving leader");
            return false;
        };
        let (channel, from) = (meta.channel.clone(), meta.leader);
        match self.start_leadership_move(now, None, meta.clone(), TaskKind::HandOff { target }) {
            Ok(()) => {
                tracing::info!(%channel, %from, to = %target, "repair: handing off the leadership of a leaving node");
                true
            }
            Err(error) => {
                tracing::debug!(%channel, %error, "repair: no hand-off");
                false
            }
        }
    }

    /// Hands a healthy channel's leadership back to its preferred replica, the first of its replicas
    /// (placement's choice, or an explicit transfer's target): a failover moves leadership off a node
    /// that went down, and without this the node that came back would lead nothing while the others
    /// carry its share — the busiest node sets the cluster's tail latency. Only when that replica is in
    /// the ISR, has been up for `rebalance_leaders_after`, is not being drained or leaving, and the
    /// current leader is up (a transfer needs it to drain); at most `rebalance_transfers_per_pass` per repair pass.
    fn return_to_preferred_leader(&mut self, now: Time, meta: ChannelRuntimeMeta) {
        let Some(after) = self.config.rebalance_leaders_after else { return };
        let Some(preferred) = meta.replicas.first().copied() else { return };
        if meta.leader == preferred
            || !meta.in_isr(preferred)
            || self.scan.draining.contains(&preferred)
            || self.is_leaving(preferred, now)
            || self.is_down(meta.leader, now)
        {
            return;
        }
        match self.rebalance_backoff.get(&meta.channel) {
            Some(retry_at) if *retry_at > now => return,
            Some(_) => {
                self.rebalance_backoff.remove(&meta.channel);
            }
            None => {}
        }
        let up_for =
            if preferred == self.me { Some(now.since(self.started)) } else { self.liveness.up_for(preferred, now) };
        let Some(up_for) = up_for else { return };
        let due = if up_for < after { now + (after - up_for) } else { now };
        if due > now || self.scan.rebalances >= self.config.rebalance_transfers_per_pass {
            self.scan.rebalance_due = Some(self.scan.rebalance_due.map_or(due, |d| d.min(due)));
            return;
        }
        self.scan.rebalances += 1;
        let (channel, from) = (meta.channel.clone(), meta.leader);
        match self.start_transfer(now, None, meta, preferred) {
            Ok(()) => {
                tracing::info!(%channel, %from, to = %preferred, "repair: leadership back to the preferred replica")
            }
            Err(error) => tracing::debug!(%channel, %error, "repair: no transfer to the preferred replica"),
        }
    }

    /// An automatic transfer (back to the preferred replica, or a hand-off) ended: a failed one (its
    /// target did not catch up with the drained leader in `drain_timeout`, with the channel fenced
    /// meanwhile) is not tried again on that channel for `rebalance_leaders_after` (`drain_timeout`
    /// without it), so a slow target does not get its channel fenced over and over.
    pub(super) fn rebalance_finished(&mut self, now: Time, channel: &ChannelId, switched: bool) {
        if switched {
            self.rebalance_backoff.remove(channel);
            return;
        }
        let wait = self.config.rebalance_leaders_after.unwrap_or(self.config.drain_timeout);
        if self.rebalance_backoff.len() >= FENCES_SEEN_MAX {
            self.rebalance_backoff.retain(|_, retry_at| *retry_at > now);
        }
        if self.rebalance_backoff.len() < FENCES_SEEN_MAX {
            self.rebalance_backoff.insert(channel.clone(), now + wait);
        }
    }

    /// `group` recorded `node` as being drained. If this node leads the group and its repair pass does
    /// not know the drain yet, a new pass starts at once: a pass that ended with nothing to repair
    /// rests `repair_idle_interval` (10 s by default) before the next, and the drain's first move
    /// would wait that long.
    pub(crate) fn drain_started(&mut self, now: Time, group: GroupId, node: NodeId) {
        if self.led.contains(&group) && !self.scan.draining.contains(&node) {
            self.scan.active = false;
            self.scan.next_pass = self.scan.next_pass.min(now);
        }
    }

    /// Where a replica leaving `meta`'s channel (`from`) goes: a learner of the channel on a live,
    /// undrained node, if it has one — a replacement interrupted after adding it (its fence lost to a
    /// failover, its catch-up timed out) left it there, and another replacement to a spare node would
    /// add a replica more each time, until every node held one and a drain had nowhere to go (sim seed
    /// 269000079: five replicas on five nodes) — else a spare node, else, in a channel holding more
    /// replicas than it is created with, one of its other replicas.
    fn replacement_for(&self, meta: &ChannelRuntimeMeta, from: NodeId, now: Time) -> Option<NodeId> {
        let mut key = Vec::new();
        meta.channel.encode_key(&mut key);
        let others = || meta.replicas.iter().copied().filter(move |n| *n != from && self.may_receive(*n, now));
        let learners = others().filter(|n| !meta.isr.contains(n));
        let in_place = || {
            // No learner and no spare node: a channel holding more replicas than it is created with
            // (its last learner was put in the ISR before its replacement was interrupted) gives up
            // `from` to another of its replicas. A channel at its factor keeps `from` (the drain waits).
            let others = others();
            let over_replicated = meta.replicas.len() > self.replication_factor;
            over_replicated.then(|| rendezvous::best(&key, others)).flatten()
        };
        rendezvous::best(&key, learners).or_else(|| self.spare_node(meta, now)).or_else(in_place)
    }

    /// A live node that keeps no copy of the channel, chosen by rendezvous hash so repairs spread.
    fn spare_node(&self, meta: &ChannelRuntimeMeta, now: Time) -> Option<NodeId> {
        let mut key = Vec::new();
        meta.channel.encode_key(&mut key);
        let candidates = self
            .liveness
            .peers()
            .chain(std::iter::once(self.me))
            .filter(|n| !meta.is_replica(*n) && self.may_receive(*n, now));
        rendezvous::best(&key, candidates)
    }

    /// `true` if a replica may move to `node`: up, not being drained, and not leaving (about to stop;
    /// a replacement of the leader's replica would make it the leader).
    fn may_receive(&self, node: NodeId, now: Time) -> bool {
        !self.is_down(node, now) && !self.scan.draining.contains(&node) && !self.is_leaving(node, now)
    }

    /// Notes when a fence no local task owns was first seen (or forgets a cleared one).
    pub(super) fn track_fence(&mut self, now: Time, meta: &ChannelRuntimeMeta) {
        let owned = self.tasks.get(&meta.channel).map(|t| t.id);
        match meta.write_fence {
            Some(fence) if owned != Some(fence.task) => {
                let full = self.fences_seen.len() >= FENCES_SEEN_MAX;
                match self.fences_seen.get_mut(&meta.channel) {
                    Some(seen) if seen.0 != fence.task => *seen = (fence.task, now),
                    Some(_) => {}
                    None if !full => {
                        self.fences_seen.insert(meta.channel.clone(), (fence.task, now));
                    }
                    None => {}
                }
            }
            _ => {
                self.fences_seen.remove(&meta.channel);
            }
        }
    }

    /// Takes over fences nobody moved for `fence_takeover_after`: a frozen one (or one whose leader is
    /// down) by resuming the failover, any other by clearing it.
    pub(super) fn take_over_fences(&mut self, now: Time, reader: &SlotReader) {
        let due: Vec<ChannelId> = self
            .fences_seen
            .iter()
            .filter(|(_, (_, since))| now.since(*since) >= self.config.fence_takeover_after)
            .map(|(c, _)| c.clone())
            .collect();
        for channel in due {
            let stored = match reader.runtime_meta(&channel) {
                Ok(stored) => stored,
                Err(error) => {
                    // Cannot tell whether the fence still stands: looked at again later, not forgotten
                    // as though it were cleared.
                    tracing::warn!(%error, %channel, "controller: cannot read a fenced channel's meta");
                    if let Some(seen) = self.fences_seen.get_mut(&channel) {
                        seen.1 = now;
                    }
                    continue;
                }
            };
            let Some((meta, fence)) = stored.and_then(|meta| meta.write_fence.map(|f| (meta, f))) else {
                self.fences_seen.remove(&channel);
                continue;
            };
            // Looked at again after another `fence_takeover_after` for as long as the fence stands: a
            // takeover that fails (refused while a migration fences the channel's hash slot, say) is
            // tried again, not forgotten — nothing else would bring the fence back here, and the channel
            // stayed fenced for good (sim seed 473005304).
            self.fences_seen.insert(channel.clone(), (fence.task, now));
            if self.tasks.contains_key(&channel) {
                continue; // A local task on the channel (not the fence's owner) must end first.
            }
            if fence.freeze_replication || self.is_down(meta.leader, now) {
                self.start_failover(now, meta);
            } else if self.admit(&channel).is_ok() {
                let task = self.new_task(fence.task, TaskKind::ClearFence, None, meta, now);
                self.start(now, task);
            }
        }
    }

    /// A meta the slot FSM applied here; `leader` when this node leads the group (then it watches the
    /// meta's fence).
    pub(crate) fn meta_applied(&mut self, now: Time, meta: &ChannelRuntimeMeta, leader: bool) {
        if leader {
            self.track_fence(now, meta);
        }
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::super::report::TaskError;
    use super::*;
    use crate::node::controller::ControllerConfig;
    use tidings_types::{ChannelType, Epoch, LeaderEpoch, Seq};

    fn n(id: u64) -> NodeId {
        NodeId::new(id)
    }

    /// Node 1 leads; node 2, the first replica, is the preferred leader.
    pub(in crate::node::controller) fn led_away_from_its_preferred_replica() -> ChannelRuntimeMeta {
        ChannelRuntimeMeta {
            channel: ChannelId::new(ChannelType::GROUP, "away").expect("channel id"),
            version: 4,
            leader: n(1),
            replicas: vec![n(2), n(1), n(3)],
            isr: vec![n(2), n(1), n(3)],
            min_isr: 2,
            epoch: Epoch::new(1),
            leader_epoch: LeaderEpoch::new(2),
            write_fence: None,
            retention_through: Seq::new(0),
        }
    }

    /// A drained node is left in a group while it is a member, and while the group's assignment or a move
    /// under way names it though it holds no replica there (session 36's sim seed 39: an aborted move
    /// took a group back to a node whose drain had been reported done); a group that does neither is
    /// not left to it, and its drain is reported under way either way.
    #[test]
    fn a_group_whose_intent_names_a_drained_node_is_left_to_it_though_it_holds_no_replica() {
        let mut scan = super::super::RepairScan::default();
        let (g1, g2, g3) = (GroupId::new(1), GroupId::new(2), GroupId::new(3));
        scan.note_drains(g1, &[n(4)], &[n(1), n(2), n(4)], &[n(1), n(2), n(4)]);
        scan.note_drains(g2, &[n(4)], &[n(1), n(2), n(3)], &[n(1), n(2), n(4)]);
        scan.note_drains(g3, &[n(4)], &[n(1), n(2), n(3)], &[n(1), n(2), n(3)]);
        assert_eq!(scan.drain_groups.get(&n(4)), Some(&vec![g1, g2]), "a member, and a group naming it");
        assert!(scan.draining.contains(&n(4)));
        assert_eq!(scan.drain_left.get(&n(4)), Some(&0));
    }

    /// A replica on a drained node goes to the channel's learner (left by an interrupted replacement)
    /// before a spare node, and, in a channel holding more replicas than it is created with and no spare
    /// node left, to one of its other replicas; at its replication factor with no spare node, it stays.
    #[test]
    fn a_drained_replica_goes_to_a_learner_first_and_an_over_replicated_channel_gives_it_up() {
        let nodes = [n(1), n(2), n(3), n(4), n(5)];
        let mut controller = Controller::new(ControllerConfig::default(), n(1), &nodes, 3, 1, Time::ZERO);
        let now = Time::from_millis(100);
        for node in &nodes[1..] {
            controller.heard(*node, now);
        }
        controller.scan.draining.insert(n(2));
        let mut meta = led_away_from_its_preferred_replica(); // replicas 2, 1, 3 (all in the ISR)
                                                              // At its factor, with spare nodes 4 and 5: one of them.
        let spare = controller.replacement_for(&meta, n(2), now).expect("a spare node");
        assert!([n(4), n(5)].contains(&spare), "{spare}");
        // Node 5 a learner (a replacement interrupted after adding it): node 5, not another spare.
        meta.replicas.push(n(5));
        assert_eq!(controller.replacement_for(&meta, n(2), now), Some(n(5)));
        // Node 5 put in the ISR before the interruption and node 4 taken too: no learner, no spare node,
        // but more replicas than the factor: another replica takes node 2's place.
        meta.isr.push(n(5));
        meta.replicas.push(n(4));
        meta.isr.push(n(4));
        let in_place = controller.replacement_for(&meta, n(2), now).expect("an in-place replacement");
        assert!([n(1), n(3), n(4), n(5)].contains(&in_place), "{in_place}");
        assert!(controller.start_replace(now, None, meta.clone(), n(2), in_place).is_ok());
        // At the factor with every node a replica (three nodes of three): the drained replica stays.
        let mut small = Controller::new(ControllerConfig::default(), n(1), &nodes[..3], 3, 1, Time::ZERO);
        small.heard(n(2), now);
        small.heard(n(3), now);
        small.scan.draining.insert(n(2));
        let full = led_away_from_its_preferred_replica();
        assert_eq!(small.replacement_for(&full, n(2), now), None);
        assert!(matches!(small.start_replace(now, None, full, n(2), n(3)), Err(TaskError::CannotJoin(_))));
    }

    /// An ISR member down for good (a node its peers refuse for its storage identity, say) is replaced
    /// before a drained replica moves: the drained one could move only with MinISR live members left to
    /// hold what is committed. With every other node drained, a drained node takes the down member's
    /// place rather than leave the channel unable to commit. (The simulator's lost disks found both: a
    /// drain that timed out again and again, and a channel left below MinISR for good.)
    #[test]
    fn a_member_down_for_good_is_replaced_before_a_drained_one_moves_and_on_a_drained_node_if_need_be() {
        let nodes = [n(1), n(2), n(3), n(4)];
        let config = ControllerConfig::default();
        let mut controller = Controller::new(config.clone(), n(1), &nodes, 3, 1, Time::ZERO);
        // Node 3 silent since the start, the others heard lately.
        let now = Time::ZERO + config.replace_down_after + Duration::from_millis(1);
        for node in [n(2), n(4)] {
            controller.heard(node, now);
        }
        controller.scan.draining.insert(n(2));
        // Node 1 leads, node 2 is drained, node 3 is down: moving node 2 away would leave one live member.
        let meta = led_away_from_its_preferred_replica(); // replicas and ISR 2, 1, 3
        controller.consider(now, meta.clone());
        assert_eq!(controller.tasks[&meta.channel].kind, TaskKind::Replace { from: n(3), to: n(4) });
        // Node 4 drained as well: nowhere undrained to go, so a drained node takes the place.
        let mut controller = Controller::new(config, n(1), &nodes, 3, 1, Time::ZERO);
        for node in [n(2), n(4)] {
            controller.heard(node, now);
        }
        controller.scan.draining.extend([n(2), n(4)]);
        controller.consider(now, meta.clone());
        assert_eq!(controller.tasks[&meta.channel].kind, TaskKind::Replace { from: n(3), to: n(4) });
    }

    /// A drained ISR member whose replacement would leave fewer than MinISR live members in the new ISR
    /// does not move while the other member is down: the move could not switch, and would only fence the
    /// channel until its drain timeout, again and again. It moves once that member is back; a member gone
    /// for `replace_down_after` is replaced first.
    #[test]
    fn a_drained_member_waits_while_its_move_would_leave_too_few_live_members() {
        let nodes = [n(1), n(2), n(3), n(4)];
        let config = ControllerConfig { rebalance_leaders_after: None, ..ControllerConfig::default() };
        let meta = ChannelRuntimeMeta {
            replicas: vec![n(1), n(3)],
            isr: vec![n(1), n(3)],
            ..led_away_from_its_preferred_replica()
        };
        let controller_at = |now: Time, heard: &[NodeId]| {
            let mut controller = Controller::new(config.clone(), n(1), &nodes, 3, 1, Time::ZERO);
            for node in heard {
                controller.heard(*node, now);
            }
            controller.scan.draining.insert(n(1));
            controller
        };
        // Node 3 down, not yet for `replace_down_after`: the drained leader stays.
        let down = Time::ZERO + config.node_down_after + Duration::from_millis(1);
        let mut controller = controller_at(down, &[n(2), n(4)]);
        controller.consider(down, meta.clone());
        assert!(!controller.tasks.contains_key(&meta.channel), "no move that could not switch");
        // Node 3 back: the drained leader moves.
        let mut controller = controller_at(down, &[n(2), n(3), n(4)]);
        controller.consider(down, meta.clone());
        assert!(matches!(controller.tasks[&meta.channel].kind, TaskKind::Replace { from, .. } if from == n(1)));
        // Node 3 gone: it is replaced first.
        let gone = Time::ZERO + config.replace_down_after + Duration::from_millis(1);
        let mut controller = controller_at(gone, &[n(2), n(4)]);
        controller.consider(gone, meta.clone());
        assert!(matches!(controller.tasks[&meta.channel].kind, TaskKind::Replace { from, .. } if from == n(3)));
    }

    /// Node 1's controller of four heard nodes (no rebalancing), a replacement of node 3 by node 4 just
    /// started on a channel node 2 leads (its first proposal waiting in the actions), and when it started.
    fn replacing_node_3_by_node_4() -> (Controller, ControllerConfig, ChannelRuntimeMeta, Time) {
        let nodes = [n(1), n(2), n(3), n(4)];
        let config = ControllerConfig { rebalance_leaders_after: None, ..ControllerConfig::default() };
        let mut controller = Controller::new(config.clone(), n(1), &nodes, 3, 1, Time::ZERO);
        let now = Time::from_millis(100);
        for node in &nodes[1..] {
            controller.heard(*node, now);
        }
        let meta = ChannelRuntimeMeta { leader: n(2), ..led_away_from_its_preferred_replica() };
        controller.start_replace(now, None, meta.clone(), n(3), n(4)).expect("the replacement starts");
        (controller, config, meta, now)
    }

    /// [`replacing_node_3_by_node_4`] once its learner was added: the replacement catches up, under the
    /// meta returned.
    fn replacement_catching_up() -> (Controller, ControllerConfig, ChannelRuntimeMeta, Time) {
        use super::super::Action;
        use tidings_slot::fsm::Outcome;
        let (mut controller, config, meta, now) = replacing_node_3_by_node_4();
        let Some(Action::Propose { tag, .. }) = controller.poll_action() else { panic!("adds the learner") };
        controller.proposal_done(now, &meta.channel, tag, Ok(Outcome::Applied));
        let catching_up = controller.tasks[&meta.channel].meta.clone();
        (controller, config, catching_up, now)
    }

    /// A replacement that has fenced nothing yet gives way to a failover at the first repair pass that
    /// finds its channel's leader down. Before, the pass skipped every channel with a task, and a drain
    /// asked right after a crash (before the failure detector held the node down) left a channel it
    /// led without a leader until the replacement's catch-up timed out, two minutes later.
    #[test]
    fn a_failover_preempts_a_replacement_still_catching_up_once_the_leader_is_down() {
        let (mut controller, config, catching_up, now) = replacement_catching_up();
        let meta = catching_up.clone();
        // The leader's node falls silent.
        let later = now + config.node_down_after + Duration::from_millis(1);
        controller.heard(n(3), later);
        controller.heard(n(4), later);
        controller.consider(later, catching_up);
        assert_eq!(controller.tasks[&meta.channel].kind, TaskKind::Failover);
        let report = controller.reports().pop().expect("the replacement's report");
        assert_eq!(
            (report.kind, report.outcome),
            (TaskKind::Replace { from: n(3), to: n(4) }, Err(TaskError::Preempted))
        );
    }

    /// A replacement still catching up ends at the first repair pass that finds its target down: the
    /// leader may have taken the caught-up learner into an ISR at MinISR, and nothing commits until the
    /// next pass replaces that member. Waiting out the catch-up timeout kept the channel from any
    /// repair for two minutes (sim seed 665000721).
    #[test]
    fn a_replacement_still_catching_up_ends_once_its_target_is_down() {
        let (mut controller, config, catching_up, now) = replacement_catching_up();
        let meta = catching_up.clone();
        controller.consider(now, catching_up.clone());
        assert!(controller.tasks.contains_key(&meta.channel), "its target is up: it goes on");
        // The target's node falls silent; the leader's and node 3's are heard.
        let later = now + config.node_down_after + Duration::from_millis(1);
        controller.heard(n(2), later);
        controller.heard(n(3), later);
        controller.consider(later, catching_up);
        assert!(!controller.tasks.contains_key(&meta.channel), "ended");
        let report = controller.reports().pop().expect("the replacement's report");
        assert_eq!(
            (report.kind, report.outcome),
            (TaskKind::Replace { from: n(3), to: n(4) }, Err(TaskError::TargetDown(n(4))))
        );
    }

    /// A learner whose log is longer than the leader's HW but ends in an earlier epoch has diverged: it
    /// lacks the committed records, so the replacement waits for it rather than fence the channel for a
    /// switch that cannot pass. Once its log ends in the leader's epoch at or past HW, the fence goes up.
    #[test]
    fn a_replacement_fences_only_once_its_learner_s_log_ends_in_the_leader_s_epoch() {
        use super::super::report::{EvidenceReport, TaskBlocked};
        use super::super::Step;
        let (mut controller, _, meta, now) = replacement_catching_up();
        while controller.poll_action().is_some() {}
        let task = &controller.tasks[&meta.channel];
        assert!(matches!(task.step, Step::CatchingUp));
        let (id, version) = (task.id, task.meta.version);
        let report = |epoch: u64, seq: u64| EvidenceReport {
            last_epoch: LeaderEpoch::new(epoch),
            last_seq: Seq::new(seq),
            hw: Seq::new(seq),
            pending_appends: 0,
            log_end: Seq::new(seq),
            drained: false,
            fenced_by: None,
        };
        let proposes_fence = |controller: &mut Controller| {
            std::iter::from_fn(|| controller.poll_action()).any(|a| matches!(a, Action::Propose { .. }))
        };
        controller.evidence(now, n(2), id, &meta.channel, version, report(2, 40));
        // Back with epoch 1's records through #50, ten past the leader's HW, none of epoch 2's.
        controller.evidence(now, n(4), id, &meta.channel, version, report(1, 50));
        assert!(!proposes_fence(&mut controller), "a diverged learner is not caught up");
        assert_eq!(controller.tasks[&meta.channel].blocked, Some(TaskBlocked::CatchingUp));
        // Truncated to the common prefix and caught up through the leader's epoch.
        controller.evidence(now, n(2), id, &meta.channel, version, report(2, 40));
        controller.evidence(now, n(4), id, &meta.channel, version, report(2, 40));
        assert!(proposes_fence(&mut controller), "caught up: the fence is proposed");
        assert_eq!(controller.tasks[&meta.channel].blocked, None);
    }

    /// A proposal refused because the channel's hash slot is fenced for the end of its migration is
    /// proposed again once the meta in force shows it was not applied, not ended: ended, a transfer left
    /// its fence standing until a controller took the fence over (sim seed 565004175: 15 s fenced).
    #[test]
    fn a_proposal_refused_while_its_slot_migrates_is_proposed_again() {
        use super::super::Action;
        use tidings_slot::fsm::{Outcome, Refusal};
        let (mut controller, config, meta, now) = replacing_node_3_by_node_4();
        let Some(Action::Propose { tag, command, .. }) = controller.poll_action() else { panic!("adds the learner") };
        let fenced = Refusal::SlotFenced { slot: tidings_types::HashSlot::new(7).expect("slot"), to: GroupId::new(2) };
        controller.proposal_done(now, &meta.channel, tag, Ok(Outcome::Refused(fenced)));
        assert!(controller.tasks.contains_key(&meta.channel) && controller.reports().is_empty(), "not ended");
        let later = now + config.ask_interval;
        controller.task_timer(later, &meta.channel);
        assert!(matches!(controller.poll_action(), Some(Action::FetchMeta(c)) if c == meta.channel));
        controller.meta_seen(later, &meta);
        let Some(Action::Propose { command: again, .. }) = controller.poll_action() else { panic!("proposed again") };
        assert_eq!(again, command);
    }

    #[test]
    fn a_failed_transfer_back_waits_before_it_is_tried_again() {
        let after = Duration::from_secs(3);
        let config = ControllerConfig { rebalance_leaders_after: Some(after), ..ControllerConfig::default() };
        let mut controller = Controller::new(config, n(1), &[n(1), n(2), n(3)], 3, 1, Time::ZERO);
        let meta = led_away_from_its_preferred_replica();
        // Peers heard every 500 ms up to `at` (a longer silence would restart their uptime).
        let mut heard_until = Time::ZERO;
        let mut heard_all = |controller: &mut Controller, at: Time| {
            while heard_until < at {
                heard_until = (heard_until + Duration::from_millis(500)).min(at);
                controller.heard(n(2), heard_until);
                controller.heard(n(3), heard_until);
            }
        };
        let transfers = |controller: &Controller| controller.tasks.len();

        let first = Time::from_millis(4_000);
        heard_all(&mut controller, first);
        controller.consider(first, meta.clone());
        assert_eq!(transfers(&controller), 1, "up 4 s, longer than 3 s: a transfer back starts");
        let task = controller.tasks.remove(&meta.channel).expect("the transfer");
        assert_eq!(task.kind, TaskKind::Transfer { target: n(2) });
        controller.finish(first, task, Err(TaskError::DrainTimedOut));

        let soon = first + Duration::from_secs(2);
        heard_all(&mut controller, soon);
        controller.consider(soon, meta.clone());
        assert_eq!(transfers(&controller), 0, "within the wait after a failed try: nothing");

        let later = first + after;
        heard_all(&mut controller, later);
        controller.consider(later, meta.clone());
        assert_eq!(transfers(&controller), 1, "the wait is over: tried again");
        let task = controller.tasks.remove(&meta.channel).expect("the transfer");
        controller.finish(later, task, Ok(()));
        assert!(controller.rebalance_backoff.is_empty(), "a success forgets the channel");
    }

    /// The repair pass hands a leaving leader's channel to its preferred replica when that one may
    /// lead, else to another staying ISR member; never to a member down or outside the ISR, never
    /// within the backoff of a failed hand-off, and never back to a preferred replica that leaves.
    #[test]
    fn a_leaving_leaders_channel_is_handed_off_to_a_staying_isr_member_that_keeps_the_replicas_order() {
        let config = ControllerConfig { rebalance_leaders_after: Some(Duration::from_secs(3)), ..Default::default() };
        let new_controller = || Controller::new(config.clone(), n(3), &[n(1), n(2), n(3)], 3, 1, Time::ZERO);
        let now = Time::from_millis(1_000);
        let meta = led_away_from_its_preferred_replica(); // leader 1; replicas and ISR 2, 1, 3
        let started = |controller: &Controller| controller.tasks.get(&meta.channel).map(|t| t.kind);
        // As a frame does: heard, then what it says.
        let leaving = |controller: &mut Controller, node: NodeId, at: Time| {
            controller.heard(node, at);
            controller.heard_leaving(node, at);
        };

        let mut controller = new_controller();
        controller.heard(n(2), now);
        leaving(&mut controller, n(1), now);
        controller.consider(now, meta.clone());
        assert_eq!(started(&controller), Some(TaskKind::HandOff { target: n(2) }), "the preferred replica");

        // The preferred replica leaves too: another staying member (this node).
        let mut controller = new_controller();
        leaving(&mut controller, n(1), now);
        leaving(&mut controller, n(2), now);
        controller.consider(now, meta.clone());
        assert_eq!(started(&controller), Some(TaskKind::HandOff { target: n(3) }));

        // No other live ISR member: nothing to hand off to.
        let mut controller = new_controller();
        let down = now + config.node_down_after + Duration::from_millis(1);
        leaving(&mut controller, n(1), down);
        let two_in_isr = ChannelRuntimeMeta { isr: vec![n(2), n(1)], ..meta.clone() };
        controller.consider(down, two_in_isr);
        assert_eq!(started(&controller), None, "node 2 is down, node 3 outside the ISR: no hand-off");

        // A failed hand-off waits before the next.
        let mut controller = new_controller();
        leaving(&mut controller, n(1), now);
        controller.consider(now, meta.clone());
        let task = controller.tasks.remove(&meta.channel).expect("the hand-off");
        controller.finish(now, task, Err(TaskError::DrainTimedOut));
        leaving(&mut controller, n(1), now + Duration::from_secs(1));
        controller.consider(now + Duration::from_secs(1), meta.clone());
        assert_eq!(started(&controller), None, "within the backoff");

        // A channel led by a staying node is not moved back to a preferred replica that leaves,
        // however long it has been up.
        let mut controller = new_controller();
        let staying_leader = ChannelRuntimeMeta { leader: n(3), ..meta.clone() };
        let later = Time::from_millis(5_000);
        for at in (500..=5_000).step_by(500).map(Time::from_millis) {
            controller.heard(n(1), at);
            controller.heard(n(2), at);
        }
        leaving(&mut controller, n(2), later);
        controller.consider(later, staying_leader.clone());
        assert_eq!(started(&controller), None, "the preferred replica is leaving");
        // Its mark lapses once it stops saying so: the transfer back goes ahead.
        let lapsed = later + config.node_down_after;
        for at in (5_500..=6_500).step_by(500).map(Time::from_millis) {
            controller.heard(n(1), at);
            controller.heard(n(2), at);
        }
        assert_eq!(lapsed, Time::from_millis(6_500));
        controller.consider(lapsed, staying_leader);
        assert_eq!(started(&controller), Some(TaskKind::Transfer { target: n(2) }));
    }
}
