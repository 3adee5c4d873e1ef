//! Deterministic cluster simulator: the real `NodeCore` of every node, in one thread, on virtual time, with
//! one seeded RNG (in the style of FoundationDB's simulation and TigerBeetle's VOPR).
//!
//! A seed draws the cluster (1–5 nodes, slot groups, replicas, MinISR, channels) and the fault rates
//! ([`SimParams`]). A run boots the nodes on in-memory stores, creates the channels, then runs a safety
//! phase with faults — frame loss, duplication, reordering and delay, one-way partitions, node crashes that
//! lose every unsynced write, slow disk, storage IO errors (failed syncs and reads) — under a client workload (appends with and without idempotency
//! keys, retries of keyed appends, reads, user writes, authoritative metadata reads), then a liveness phase with every fault healed. The oracle
//! checks, as it goes and at the end: no acknowledged append lost or changed, an idempotent retry never
//! yields a second record, reads match what was acknowledged, HW never goes back on a replica that did
//! not crash, replicas agree at every seq at or below their HWs, an authoritative read sees every user
//! write acknowledged before it, every acknowledged user write is on every replica of its group once
//! healed, and every request is answered.
//!
//! ```
//! let report = tidings_sim::run_seed(7);
//! assert!(report.passed(), "{}: {:?}", report.params, report.violations);
//! ```
//!
//! Simplified for now: no failovers, leader transfers or slot-replica moves (they need the controller),
//! so requests on a channel whose leader crashed are exempt from the liveness check (the restarted leader
//! waits for a failover).
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
