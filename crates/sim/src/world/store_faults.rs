//! Failed reads, writes and syncs of the nodes' metadata stores (`SimParams::meta_read_errors`,
//! `SimParams::meta_write_errors`), the restart of a node whose slot replicas stopped on one, and the
//! simulator's own reads, which the failures must not reach.

use super::{SimNode, World};
use std::collections::BTreeMap;
use tidings::store::{FailOp, Keyspace};
use tidings::types::{DetRng, NodeId};

/// Chance per virtual millisecond that a running node's metadata store is armed to fail reads: about
/// one every 2 s.
const META_READ_ERROR_PPM: u32 = 500;
/// The same for a write or a sync: about one every 5 s (each stops a node's slot replicas).
const META_WRITE_ERROR_PPM: u32 = 200;

impl World {
    /// Now and then arms a running node's metadata store to fail one or two reads (gets or scans of
    /// the slot metadata keyspace), after letting up to three through. The raft logs' keyspaces are
    /// spared: raft-rs takes a failed log read for a fatal error.
    pub(super) fn inject_meta_read_errors(&mut self) {
        let reads = [FailOp::Get, FailOp::Scan];
        if self.params.meta_read_errors && arm(&mut self.meta_faults, &self.nodes, META_READ_ERROR_PPM, reads, 2) {
            self.faults.meta_read_errors += 1;
        }
    }

    /// Now and then arms a running node's metadata store to fail one write of the slot metadata
    /// keyspace or one sync, after letting up to three through.
    pub(super) fn inject_meta_write_errors(&mut self) {
        let writes = [FailOp::Apply, FailOp::Sync];
        let (rng, ppm) = (&mut self.meta_write_faults, META_WRITE_ERROR_PPM);
        if self.params.meta_write_errors && arm(rng, &self.nodes, ppm, writes, 1) {
            self.faults.meta_write_errors += 1;
        }
    }

    /// Restarts every running node whose slot replicas stopped on a failed store access
    /// (`MultiRaft::storage_failed`: they stay stopped until the process restarts), as its operator
    /// would: a crash, and the restart that follows.
    pub(super) fn restart_stopped_slot_stores(&mut self) {
        if !self.params.meta_read_errors && !self.params.meta_write_errors {
            return;
        }
        let stopped: Vec<NodeId> = self
            .nodes
            .iter()
            .filter(|(_, n)| n.core.as_ref().is_some_and(|core| core.slot().storage_failed()))
            .map(|(id, _)| *id)
            .collect();
        for id in stopped {
            self.faults.slot_store_restarts += 1;
            self.crash(id);
        }
    }

    /// Runs the simulator's own reads (`f`) with every node's metadata store failpoints held off: a
    /// check must read what the stores hold, and must not take a failure meant for the nodes.
    pub(super) fn unfaulted<T>(&mut self, f: impl FnOnce(&mut Self) -> T) -> T {
        let stores: Vec<_> = self.nodes.values().map(|n| n.kv.clone()).collect();
        hold_off(&stores, || f(self))
    }
}

/// With chance `ppm`, arms a running node's metadata store to fail one of `ops` (drawn alike) on the
/// slot metadata keyspace, 1 to `times_max` calls in a row, after letting up to three through; `true`
/// if it did.
fn arm(rng: &mut DetRng, nodes: &BTreeMap<NodeId, SimNode>, ppm: u32, ops: [FailOp; 2], times_max: u64) -> bool {
    if !rng.chance(ppm) {
        return false;
    }
    let running: Vec<NodeId> = nodes.iter().filter(|(_, n)| n.core.is_some()).map(|(id, _)| *id).collect();
    let Some(id) = rng.pick(&running).copied() else { return false };
    let op = if rng.chance(500_000) { ops[0] } else { ops[1] };
    let after = rng.below(4);
    let times = if times_max > 1 { 1 + rng.below(times_max) } else { 1 };
    nodes[&id].kv.fail_under(op, Keyspace::Meta, &[], after, times);
    true
}

/// Runs `f` with the failpoints of every store in `stores` held off.
fn hold_off<T>(stores: &[std::sync::Arc<tidings::store::MemoryKv>], f: impl FnOnce() -> T) -> T {
    match stores.split_first() {
        None => f(),
        Some((first, rest)) => first.without_failpoints(|| hold_off(rest, f)),
    }
}
