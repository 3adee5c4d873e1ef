//! Planned stops (`SimParams::planned_stops`): half of a seed's crashes become a host's planned stop.
//! The node is set leaving, so its peers hand off its channel leaderships and it hands off its slot
//! groups, and it stops (a crash, as every stop here) 0 to 3 s later — before, during or after the
//! hand-offs finish. The hand-offs then run beside every other fault, and the checks hold them to the
//! same safety and liveness as everything else. As the threaded runtime does at a clean stop, the node
//! is first asked to write its replicas' checkpoints (`NodeCore::checkpoint_for_stop`); it goes down
//! `STOP_CHECKPOINTS_MS` later, whether they landed or not, having run on meanwhile (so the checkpoints
//! are written in the middle of whatever it was doing).

use super::{Event, World};
use std::collections::BTreeMap;
use std::time::Duration;
use tidings::types::{DetRng, NodeId, Time};

/// Longest wait between a node set leaving and its stop, ms.
const STOP_AFTER_MAX_MS: u64 = 3_000;

/// How long a stopping node has for its checkpoints, ms: several disk delays (at most 3 ms each), so
/// a write in flight and the checkpoint after it land unless the disk fails them.
const STOP_CHECKPOINTS_MS: u64 = 20;

/// The planned stops of one run.
pub(super) struct PlannedStops {
    /// Which crashes are planned stops, and when they stop: a stream of its own, so a seed's other
    /// draws stay what they were.
    pub(super) rng: DetRng,
    /// Nodes set leaving and not stopped yet, with the incarnation that was set and when.
    pending: BTreeMap<NodeId, (u64, Time)>,
}

impl PlannedStops {
    pub(super) fn new(seed: u64) -> Self {
        Self { rng: DetRng::new(seed ^ crate::params::PLANNED_STOPS_STREAM ^ 0x7374_6f70), pending: BTreeMap::new() }
    }
}

impl World {
    /// Sets `id` leaving and schedules its stop; nothing if it is down or already stopping.
    pub(super) fn plan_stop(&mut self, id: NodeId) {
        if self.stops.pending.contains_key(&id) {
            return;
        }
        let api = self.api();
        let now = self.node_now(id);
        let Some(node) = self.nodes.get_mut(&id) else { return };
        let incarnation = node.incarnation;
        let Some(core) = node.core.as_mut() else { return };
        core.set_leaving(now, api, true);
        if std::env::var("SIM_DEBUG").is_ok() {
            eprintln!("{:?} {id} leaving", self.now);
        }
        self.stops.pending.insert(id, (incarnation, self.now));
        let at = self.now + Duration::from_millis(self.stops.rng.range(0, STOP_AFTER_MAX_MS));
        self.schedule(at, Event::PlannedStop { node: id, incarnation });
    }

    /// The stop planned for `id` in its incarnation `incarnation`, unless it crashed meanwhile or the
    /// stop was called off.
    pub(super) fn planned_stop(&mut self, id: NodeId, incarnation: u64) {
        let Some((_, since)) = self.stops.pending.get(&id).copied().filter(|(set, _)| *set == incarnation) else {
            return;
        };
        self.stops.pending.remove(&id);
        let now = self.node_now(id);
        let Some(core) = self.nodes.get_mut(&id).filter(|n| n.incarnation == incarnation).and_then(|n| n.core.as_mut())
        else {
            return;
        };
        let status = core.status();
        core.checkpoint_for_stop(now);
        self.faults.planned_stops += 1;
        if status.handed_off() {
            self.faults.stops_handed_off += 1;
        }
        if std::env::var("SIM_DEBUG").is_ok() {
            self.print_stop(id, since, &status);
        }
        let at = self.now + Duration::from_millis(STOP_CHECKPOINTS_MS);
        self.schedule(at, Event::StopAfterCheckpoints { node: id, incarnation });
    }

    /// The end of a planned stop: node `id` goes down, unless it crashed meanwhile.
    pub(super) fn stop_after_checkpoints(&mut self, id: NodeId, incarnation: u64) {
        let Some(core) = self.nodes.get(&id).filter(|n| n.incarnation == incarnation).and_then(|n| n.core.as_ref())
        else {
            return;
        };
        if core.written_out() {
            self.faults.stops_written_out += 1;
        }
        self.crash(id);
    }

    /// What a node still led when it stopped, how long after it was set leaving, and the tasks running
    /// on every node then (`SIM_DEBUG`).
    fn print_stop(&self, id: NodeId, since: Time, status: &tidings::node::NodeStatus) {
        let groups: Vec<_> = status.groups.iter().filter(|g| g.leader == Some(id)).map(|g| g.group).collect();
        let decisions: Vec<_> = status.leadership.iter().filter(|(g, _)| groups.contains(g)).collect();
        let leader = tidings::channel::machine::RoleKind::Leader;
        let channels: Vec<_> = status.channels.iter().filter(|c| c.role == leader).map(|c| &c.channel).collect();
        eprintln!(
            "{:?} {id} stops {} ms after it was set leaving, leading groups {groups:?} ({decisions:?}) and {} channels {channels:?}",
            self.now,
            self.now.since(since).as_millis(),
            status.channels_leading
        );
        for (peer, node) in &self.nodes {
            let Some(core) = node.core.as_ref() else { continue };
            for task in core.status().tasks {
                eprintln!("  {peer} runs {:?} on {}: {} ({:?})", task.kind, task.channel, task.step, task.blocked);
            }
        }
    }

    /// At the heal: the stops not made yet are called off, their nodes no longer leaving.
    pub(super) fn call_off_planned_stops(&mut self) {
        for (id, (incarnation, _)) in std::mem::take(&mut self.stops.pending) {
            let api = self.api();
            let now = self.node_now(id);
            let node = self.nodes.get_mut(&id).filter(|n| n.incarnation == incarnation);
            if let Some(core) = node.and_then(|n| n.core.as_mut()) {
                core.set_leaving(now, api, false);
            }
        }
    }
}
