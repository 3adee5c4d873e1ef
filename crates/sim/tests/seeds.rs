//! The simulator in CI: a fixed batch of seeds, the seeds that once failed, determinism, and proof that
//! it catches a loss when a safety rule is broken.

use tidings_sim::{run_seed, SimParams, SimReport, World};

fn assert_passes(report: &SimReport) {
    assert!(
        report.passed(),
        "{}\nviolations: {:#?}\nreplay: {}",
        report.params,
        report.violations,
        report.replay_command()
    );
}

#[test]
fn a_batch_of_seeds_passes() {
    let seeds: u64 = std::env::var("TIDINGS_SIM_SEEDS").ok().and_then(|n| n.parse().ok()).unwrap_or(48);
    let mut acked = 0;
    for seed in 0..seeds {
        let report = run_seed(seed);
        assert_passes(&report);
        acked += report.acked;
    }
    assert!(acked > 0, "the workload acknowledged nothing: the batch checks nothing");
}

/// Seeds that found bugs: 8 (a reply to a forward sent before a crash answered a new request after the
/// restart, acknowledging a seq twice), 62 (two-member slot groups with equal pinned election timeouts
/// split their votes forever), 5 (all members of every group shared the seed and never elected).
#[test]
fn seeds_that_once_failed_pass() {
    for seed in [8, 62, 5, 23, 31, 50, 52, 91] {
        assert_passes(&run_seed(seed));
    }
}

#[test]
fn the_same_seed_gives_the_same_trace() {
    let first = run_seed(8);
    let second = run_seed(8);
    assert!(first.acked > 0 && first.faults.crashes > 0, "seed 8 should exercise crashes under load");
    assert_eq!(first.trace_hash, second.trace_hash);
    assert_eq!(first.acked, second.acked);
    assert_ne!(first.trace_hash, run_seed(9).trace_hash);
}

#[test]
fn a_disk_that_lies_about_persisting_is_caught() {
    let caught = (0..16).find(|seed| {
        let params = SimParams { unsafe_lying_disk: true, ..SimParams::from_seed(*seed) };
        let report = World::new(params).run();
        report.violations.iter().any(|v| v.contains("lost or changed"))
    });
    assert!(caught.is_some(), "acknowledged appends that were never stored went unnoticed for 16 seeds");
}

/// Open finding: with metadata writes under faults (loss + duplication + delay + slow disk; no crash
/// needed), seed 83 drives raft-rs into "to_commit out of range": the group's leader sends the follower an
/// empty MsgAppend at index 21 with log_term 0 while the follower's log ends at 20; raft-rs reads the term
/// of an index past the end as 0, so the follower matches it, acknowledges 21, and a later heartbeat tells
/// it to commit 21. Why the leader's progress for that peer ran past what it replicated is not found yet.
/// Kept as a failing reproduction: `cargo test -p tidings-sim -- --ignored`.
#[test]
#[ignore = "open raft-driver bug found by the simulator; see the issue notes"]
fn metadata_workload_seed_83() {
    let params = SimParams { metadata_workload: true, ..SimParams::from_seed(83) };
    assert_passes(&tidings_sim::run(params));
}
