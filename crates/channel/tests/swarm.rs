//! Random interleavings of appends (with and without idempotency keys, and retries), message loss,
//! duplication and delay, partitions, crashes that lose unsynced writes, and leader changes chosen with
//! proper evidence. Throughout: replicas agree at every seq at or below their HW and acknowledged records
//! never change (checked by the harness after every step). After healing: every acknowledged record is
//! at its seq on every ISR replica.
//!
//! A failure prints its seed; replay one with `TIDINGS_SEED=<seed> cargo test -p tidings-channel --test
//! swarm replay_seed -- --nocapture`.

mod harness;

use harness::{node, Cluster, Faults, Outcome};
use proptest::prelude::*;
use std::time::Duration;
use tidings_channel::machine::MachineConfig;
use tidings_types::{DetRng, NodeId};

fn config() -> MachineConfig {
    MachineConfig {
        pull_park: Duration::from_millis(100),
        pull_timeout: Duration::from_millis(400),
        idle_pull_interval: Duration::from_millis(200),
        isr_lag: Duration::from_secs(2),
        isr_alive: Duration::from_secs(1),
        append_timeout: Duration::from_secs(2),
        proposal_timeout: Duration::from_millis(500),
        ..MachineConfig::default()
    }
}

/// Runs one seed: every parameter and every choice comes from it.
fn run_seed(seed: u64) {
    run_seed_with(seed, config());
}

fn run_seed_with(seed: u64, config: MachineConfig) {
    let mut rng = DetRng::new(seed);
    let n = rng.range(1, 4);
    let min_isr = u8::try_from(rng.range(1, n)).unwrap();
    let faults = Faults {
        loss: u32::try_from(rng.range(0, 50_000)).unwrap(),
        duplicate: u32::try_from(rng.range(0, 50_000)).unwrap(),
        delay_ms: (1, rng.range(1, 20)),
        disk_ms: (1, if rng.chance(300_000) { rng.range(20, 150) } else { rng.range(1, 5) }),
    };
    let mut cluster = Cluster::new(seed, n, min_isr, faults, config);
    let nodes: Vec<NodeId> = (1..=n).map(node).collect();
    let mut sent: Vec<(Vec<String>, Vec<Option<String>>)> = Vec::new();
    for step in 0..150u64 {
        let action = rng.below(100);
        if action < 55 {
            let leader = cluster.meta.leader;
            // Retry an earlier request (same keys and payloads) or send a new one.
            let (payloads, keys) = match rng.chance(200_000).then(|| rng.pick(&sent).cloned()).flatten() {
                Some(previous) => previous,
                None => {
                    let count = rng.range(1, 3);
                    let keyed = rng.chance(500_000);
                    let payloads: Vec<String> = (0..count).map(|i| format!("s{step}r{i}")).collect();
                    let keys = (0..count).map(|i| keyed.then(|| format!("k{step}:{i}"))).collect();
                    (payloads, keys)
                }
            };
            let p: Vec<&str> = payloads.iter().map(String::as_str).collect();
            let k: Vec<Option<&str>> = keys.iter().map(Option::as_deref).collect();
            if cluster.append(leader, &p, &k).is_ok() {
                sent.push((payloads, keys));
            }
        } else if action < 62 {
            let victim = *rng.pick(&nodes).unwrap();
            if cluster.is_up(victim) {
                cluster.crash(victim);
            }
        } else if action < 72 {
            let back = *rng.pick(&nodes).unwrap();
            if !cluster.is_up(back) {
                cluster.start(back);
            }
        } else if action < 78 {
            let (a, b) = (*rng.pick(&nodes).unwrap(), *rng.pick(&nodes).unwrap());
            cluster.blocked.insert((a, b));
        } else if action < 84 {
            cluster.blocked.clear();
        } else if action < 90 || !cluster.is_up(cluster.meta.leader) {
            let down: Vec<NodeId> = nodes.iter().copied().filter(|n| !cluster.is_up(*n)).collect();
            cluster.failover(&down, None, None);
        }
        let pause = rng.range(1, 60);
        cluster.run_for(pause);
    }
    // Liveness phase: heal everything, bring every node back, make sure a leader leads, let it settle.
    cluster.blocked.clear();
    cluster.faults.loss = 0;
    cluster.faults.duplicate = 0;
    for id in &nodes {
        if !cluster.is_up(*id) {
            cluster.start(*id);
        }
    }
    cluster.failover(&[], None, None).expect("all replicas up: evidence is sufficient");
    cluster.run_for(10_000);
    cluster.check_converged();
    let pending = cluster.requests.values().filter(|r| r.outcome == Outcome::Pending).count();
    assert_eq!(pending, 0, "every request ends (acked or aborted) within the liveness bound");
}

fn run_reporting(seed: u64) {
    let result = std::panic::catch_unwind(|| run_seed(seed));
    if let Err(panic) = result {
        eprintln!("SEED={seed} failed; replay: TIDINGS_SEED={seed} cargo test -p tidings-channel --test swarm replay_seed -- --nocapture");
        std::panic::resume_unwind(panic);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn swarm(seed in any::<u64>()) {
        run_reporting(seed);
    }
}

/// Seeds that once failed, kept as regression tests.
#[test]
fn pinned_seeds() {
    for seed in [
        1u64,
        2,
        3,
        42,
        746_827_152_949_687_055,
        3_857_559_647_765_658_687,
        18_021_203_479_180_976_350,
        4_818_233_387_287_601_572,
        11_332_940_861_357_840_558,
    ] {
        run_reporting(seed);
    }
}

/// Replays `TIDINGS_SEED` (no-op when unset).
#[test]
fn replay_seed() {
    if let Some(seed) = std::env::var("TIDINGS_SEED").ok().and_then(|s| s.parse().ok()) {
        run_reporting(seed);
    }
}

/// The checks must be able to fail: with followers acknowledging before their writes are durable, a
/// crash loses acknowledged records, and some seed among the first few hundred shows it.
#[test]
fn acking_before_durable_is_caught() {
    let mut config = config();
    config.unsafe_test_switches.ack_before_durable = true;
    // The expected panic carries the whole trace: keep it off the test output.
    let previous_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let caught = (0..400u64).find(|seed| {
        let config = config.clone();
        std::panic::catch_unwind(move || run_seed_with(*seed, config)).is_err()
    });
    std::panic::set_hook(previous_hook);
    let seed = caught.expect("no seed caught acknowledgements before durability");
    eprintln!("ack-before-durable caught by seed {seed}");
}
