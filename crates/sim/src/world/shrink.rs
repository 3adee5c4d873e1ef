//! A node leaving mid-run (`SimParams::shrink`), the way `docs/operations.md` removes one: it is drained,
//! and once its drain is done it stops for good and every other node restarts in turn without it in
//! its list. From the drain on, no operator request targets it; once removed, no request goes through
//! it and nothing starts it again.

use super::{Event, World, ROLLING_STEP_MS};
use std::time::Duration;
use tidings::node::ApiResult;
use tidings::types::{DetRng, NodeId};

/// How often the drain is asked again until a node takes the call, and whether it is done looked at.
const STEP_MS: u64 = 300;
/// How much longer the safety phase may last for the leaving node's drain to finish and the rolling
/// restart that removes it to end: drains under faults take seconds, and with the drawn phase alone
/// (3–8 s) three quarters of them removed nothing.
const GRACE_MS: u64 = 20_000;

impl World {
    /// Picks the node that leaves and files the first ask of its drain, when the seed draws one (its own
    /// stream, so the seed's other draws stay).
    pub(super) fn schedule_shrink(&mut self) {
        if !self.params.shrink {
            return;
        }
        let mut own = DetRng::new(self.params.seed ^ crate::params::SHRINK_STREAM ^ 0x0077_686f);
        self.leaving = Some(NodeId::new(own.range(1, self.params.nodes)));
        let after = own.range(self.params.safety_ms / 5, self.params.safety_ms * 2 / 5);
        self.schedule(self.now + Duration::from_millis(after), Event::AskDrain);
        self.schedule(self.now + Duration::from_millis(after + STEP_MS), Event::RemoveOnceDrained);
    }

    /// How much longer than drawn the safety phase may last for this seed's removal.
    pub(super) fn shrink_grace_ms(&self) -> u64 {
        if self.params.shrink {
            GRACE_MS
        } else {
            0
        }
    }

    /// Whether the safety phase goes on past its drawn length for the removal: a node is to leave and
    /// has not, or the rolling restart that removes it has not ended.
    pub(super) fn shrink_pending(&self) -> bool {
        self.leaving.is_some() && (self.removed.is_none() || self.now < self.removal_restarts_end)
    }

    /// Asks a running node other than the leaving one to drain it, again every `STEP_MS` until one takes
    /// the call (`drain_answered`).
    pub(super) fn ask_drain(&mut self) {
        let Some(leaving) = self.leaving else { return };
        if self.drain_taken {
            return;
        }
        let running: Vec<NodeId> =
            self.nodes.iter().filter(|(id, n)| **id != leaving && n.core.is_some()).map(|(id, _)| *id).collect();
        if let Some(via) = self.rng.pick(&running).copied() {
            let api = self.api();
            let now = self.node_now(via);
            if let Some(core) = self.nodes.get_mut(&via).and_then(|n| n.core.as_mut()) {
                core.drain_node(now, api, leaving, true);
                self.drain_asked = Some(api);
            }
        }
        self.schedule(self.now + Duration::from_millis(STEP_MS), Event::AskDrain);
    }

    /// Takes the answer to an ask of the drain.
    pub(super) fn drain_answered(&mut self, api: tidings::node::ApiId, result: &ApiResult) {
        if self.drain_asked == Some(api) && matches!(result, ApiResult::Meta(Ok(()))) {
            self.drain_taken = true;
        }
    }

    /// In the safety phase, every `STEP_MS` once the drain was taken: once the leaving node's drain is
    /// done — no slot group holds a replica of it or names it in its assignment or a move under way, no
    /// channel's newest meta names it, and no node reports anything left of its drain — it stops for good
    /// and the others restart in turn without it. The phase goes on past its drawn length, by up to
    /// `GRACE_MS`, until that rolling restart has ended; a drain that does not finish in time for it to
    /// end by then (other drains the workload asked may leave too few nodes to take its replicas)
    /// removes nothing. Not in the healed phase: its
    /// probes and checks ask for a cluster left alone, and a rolling restart is a disturbance of its own
    /// (each node crashes and starts again).
    pub(super) fn remove_once_drained(&mut self) {
        let Some(leaving) = self.leaving else { return };
        // The rolling restart that follows must end within the safety phase too.
        let restarts = Duration::from_millis(ROLLING_STEP_MS * self.params.nodes);
        if self.removed.is_some() || !self.faulty || self.now + restarts >= self.safety_ends {
            return;
        }
        self.schedule(self.now + Duration::from_millis(STEP_MS), Event::RemoveOnceDrained);
        if !self.drain_taken {
            return;
        }
        // Each group as its leader has it: the members, and the assignment and any move under way (each
        // node's drain report covers its last repair pass over the groups it led then: a group whose
        // leadership just moved may be in no report yet).
        let groups_clear = self.genesis().groups().all(|group| {
            let Some(leader) = self.group_leader(group) else { return false };
            let members_clear = leader
                .slot()
                .status(group)
                .is_some_and(|s| !s.joint && !s.voters.contains(&leaving) && !s.learners.contains(&leaving));
            let intent = leader.reader().group_intent(group).ok().flatten();
            let intent_clear = intent.is_some_and(|i| i.target_peers.is_none() && !i.desired_peers.contains(&leaving));
            members_clear && intent_clear
        });
        let channels_clear = self.channels.iter().all(|c| self.newest_meta(c).is_some_and(|m| !m.is_replica(leaving)));
        let reports_clear = self.running_cores().all(|c| {
            c.status().drains.iter().all(|r| r.node != leaving || (r.slot_groups.is_empty() && r.channel_replicas == 0))
        });
        if !(groups_clear && channels_clear && reports_clear) {
            return;
        }
        if std::env::var("SIM_DEBUG").is_ok() {
            eprintln!("{:?} {leaving} leaves", self.now);
        }
        self.crash(leaving);
        self.removed = Some(leaving);
        self.faults.nodes_removed += 1;
        let mut at = self.now;
        for node in self.nodes.keys().copied().filter(|n| *n != leaving).collect::<Vec<_>>() {
            at = at + Duration::from_millis(ROLLING_STEP_MS);
            self.schedule(at, Event::RestartWithout { node });
        }
        self.removal_restarts_end = at;
    }

    /// `id` restarts without the removed node in its list (`World::restart_with`).
    pub(super) fn restart_without(&mut self, id: NodeId) {
        let Some(removed) = self.removed else { return };
        self.restart_with(id, |config| config.nodes.retain(|n| *n != removed));
    }

    /// Whether `id` may be started: not once it left the cluster.
    pub(super) fn may_start(&self, id: NodeId) -> bool {
        self.removed != Some(id)
    }

    /// The nodes an operator request may target: not the one that is to leave.
    pub(super) fn operator_targets(&self, ids: &[NodeId]) -> Vec<NodeId> {
        ids.iter().copied().filter(|n| Some(*n) != self.leaving).collect()
    }
}
