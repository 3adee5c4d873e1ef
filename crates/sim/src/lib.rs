//! Deterministic cluster simulator: the real `NodeCore` of every node, in one thread, on virtual time, with
//! one seeded RNG (in the style of FoundationDB's simulation and TigerBeetle's VOPR).
//!
//! A seed draws the cluster (1–5 nodes, slot groups, replicas, MinISR, channels), the fault rates and the
//! nodes' own settings — reactors per node, the HW news hold, idle eviction, tight limits, hurried
//! timings, skewed clocks ([`SimParams`]). A run boots the nodes on in-memory stores, creates the channels, then runs a
//! safety phase with faults — frame loss, duplication, reordering and delay, one-way partitions, node
//! crashes that lose every unsynced write, slow disk, storage IO errors (failed syncs and reads), a node
//! started again on empty stores without a drain (a lost disk: its peers must refuse it), a node that
//! joins (every node restarted in turn with it in its list, then it starts on empty stores), a node
//! that leaves (drained, then stopped and left out of every list by a second rolling restart) — under
//! a client workload: appends with and without idempotency keys (some from allowed, banned and denied
//! senders), retries of keyed appends, reads, retention moves, user and subscriber writes,
//! authoritative metadata reads, and operator requests (leader transfers, replica replacements,
//! preferred leaders, slot-replica moves, node drains, hash-slot migrations). A liveness phase follows
//! with every fault healed: every request must be answered and every channel must take an append again
//! (the controller's failovers, fence takeovers and repairs included); the cluster then gets time to
//! finish its fanout and bring slot replicas level before the final checks.
//!
//! The oracle checks, as it goes and at the end: no acknowledged append lost or changed, an idempotent
//! retry never yields a second record, nothing from a refused sender acknowledged or stored, reads match
//! what was acknowledged, HW never goes back on a replica that did not crash, replicas agree at every
//! seq at or below their HWs, no retention boundary past HW, every committed message reached its
//! online subscribers at least once and none reached a denied member, an authoritative read sees every
//! user write acknowledged before it, every acknowledged user write is on every replica of its group
//! once healed, slot replicas agree at each applied index, and moves and migrations settle.
//!
//! ```
//! let report = tidings_sim::run_seed(7);
//! assert!(report.passed(), "{}: {:?}", report.params, report.violations);
//! ```
//!
//! Time is virtual: one clock for the simulation, read by each node through its own. In a third of the
//! seeds (`clock-skew`) a node's clock runs 0.95–1.05 times as fast as the simulation's and starts over
//! at zero whenever the node boots, as the threaded runtime's clock does; in the rest every node reads
//! the simulation's time.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

mod oracle;
mod params;
mod world;

pub use params::SimParams;
pub use world::{Faults, SimReport, World};

/// Runs the seed with the parameters it draws.
pub fn run_seed(seed: u64) -> SimReport {
    run(SimParams::from_seed(seed))
}

/// Runs `params`. A panic inside the cluster (a bug) is reported as a violation of the seed, so a batch
/// goes on and the seed can be replayed.
pub fn run(params: SimParams) -> SimReport {
    let world = World::new(params.clone());
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || world.run())) {
        Ok(report) => report,
        Err(panic) => {
            let what = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                .unwrap_or_default();
            SimReport {
                params,
                steps: 0,
                faults: Faults::default(),
                acked: 0,
                delivered: 0,
                unanswered: 0,
                trace_hash: 0,
                violations: vec![format!("panic: {what}")],
            }
        }
    }
}
