//! A node joining mid-run (`SimParams::grow`), the way `docs/operations.md` adds one: each node
//! restarts in turn with the new node in its list (the founders kept), then the new node starts on
//! empty stores. Until then it is no node of the world: no request goes through it and no fault picks
//! it.

use super::{Event, SimNode, World, ROLLING_STEP_MS};
use std::time::Duration;
use tidings::types::{DetRng, NodeId};

impl World {
    /// Files the rolling restart and the join, when the seed draws one: when in the safety phase (its
    /// own stream, so the seed's other draws stay).
    pub(super) fn schedule_growth(&mut self) {
        if self.joiner.is_none() {
            return;
        }
        let mut own = DetRng::new(self.params.seed ^ crate::params::GROW_STREAM ^ 0x7768_656e);
        let mut at =
            self.now + Duration::from_millis(own.range(self.params.safety_ms / 5, self.params.safety_ms * 3 / 5));
        let step = Duration::from_millis(ROLLING_STEP_MS);
        for node in self.nodes.keys().copied().collect::<Vec<_>>() {
            self.schedule(at, Event::RestartWithJoiner { node });
            at = at + step;
        }
        self.schedule(at, Event::Join);
    }

    /// `id` restarts with the joining node in its list (`World::restart_with`).
    pub(super) fn restart_with_joiner(&mut self, id: NodeId) {
        let Some(joiner) = self.joiner.as_ref().map(|(id, _)| *id) else { return };
        self.restart_with(id, |config| config.nodes.push(joiner));
    }

    /// The joining node becomes one of the world's and starts.
    pub(super) fn join(&mut self) {
        let Some((id, node)) = self.joiner.take() else { return };
        if std::env::var("SIM_DEBUG").is_ok() {
            eprintln!("{:?} {id} joins", self.now);
        }
        self.nodes.insert(id, node);
        self.boot(id);
        self.faults.nodes_joined += 1;
    }

    /// Sets the joiner aside, out of the world's nodes, when the run grows.
    pub(super) fn set_joiner_aside(
        nodes: &mut std::collections::BTreeMap<NodeId, SimNode>,
        grow: bool,
    ) -> Option<(NodeId, SimNode)> {
        if !grow {
            return None;
        }
        nodes.pop_last()
    }
}

impl World {
    /// At the end: the joiner joined, and what it holds by then is counted (`Faults::joined_replicas`:
    /// whether the workload gave it work). What it holds is checked as every node's is: slot replicas
    /// agree, and messages survive on the replicas the newest metas name.
    pub(super) fn check_joined(&mut self) {
        if !self.params.grow {
            return;
        }
        if let Some((id, _)) = &self.joiner {
            self.oracle.violation(format!("{id} never joined"));
            return;
        }
        let joined = NodeId::new(self.params.nodes + 1);
        let groups = self.nodes.get(&joined).and_then(|n| n.core.as_ref()).map_or(0, |c| c.slot().groups().count());
        let channels =
            self.channels.clone().iter().filter(|c| self.newest_meta(c).is_some_and(|m| m.is_replica(joined))).count();
        self.faults.joined_replicas += (groups + channels) as u64;
    }
}
