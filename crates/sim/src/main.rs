//! `cargo run --release -p tidings-sim -- --seeds N [--from S]` runs N seeds and prints a summary;
//! `-- --seed S` replays one seed and prints its report. `--no-metadata` runs appends only;
//! `--idle-evict-ms N` overrides the seed's idle eviction (0: the node's default, longer than a run);
//! `--tight-limits` runs every seed with its limits cut to a few items (`SimParams::tight_limits`),
//! `--no-tight-limits` none; `--hurried-timings` / `--no-hurried-timings` the same for its timeouts and
//! intervals (`SimParams::hurried_timings`), `--clock-skew` / `--no-clock-skew` for its nodes' own
//! clocks (`SimParams::clock_skew`), `--disk-loss` / `--no-disk-loss` for a node that loses its disk
//! (`SimParams::disk_loss`, only in the seeds where it may), `--grow` / `--no-grow` for a node that
//! joins mid-run (`SimParams::grow`, only where it may), `--shrink` / `--no-shrink` for a node that is
//! drained and leaves (`SimParams::shrink`, only where it may), `--planned-stops` /
//! `--no-planned-stops` for crashes that are planned stops after a hand-off (`SimParams::planned_stops`,
//! only with two nodes or more); `--late-duplicates` lets second copies of duplicated frames come up
//! to 3 s late (`SimParams::late_duplicates`, off in every seed's own draws); `--all-metadata` makes
//! the workload's member-list changes every kind of per-key metadata write (`SimParams::all_metadata`,
//! off in every seed's own draws); `--meta-read-errors` makes the nodes' metadata stores fail reads
//! now and then (`SimParams::meta_read_errors`, off in every seed's own draws), `--meta-write-errors`
//! writes and syncs (`SimParams::meta_write_errors`, the same). `--safety-ms N` runs every seed's faults
//! for N virtual milliseconds instead of the 3–8 s it draws (a soak: faults that pile up, such as epoch
//! histories, compacted raft logs and many failovers of one channel), `--channels N` gives every seed N
//! channels instead of the 1–6 it draws (more replicas than tight limits leave room for), `--liveness-ms N`
//! gives the healed phase N virtual milliseconds instead of 15 s (a channel that takes no append in 15 s
//! but does in a longer phase waited for a turn; one that never does is stuck). A failed
//! seed prints the command that replays it, with these flags. `--unsafe-disk-loss-keeps-identity` lets the node that loses its disk
//! keep its storage identity (the simulator's own check: its peers then cannot refuse it, and the
//! seeds fail).
//! `TIDINGS_SIM_LOG=info` (or `debug`, `trace`) prints the nodes' logs while one seed replays.
//! `-- --cost N [--load-ms MS]` runs the fault-free steady load of `SimParams::steady` over N channels
//! (10 virtual seconds by default) and prints its report: run it under
//! `valgrind --tool=callgrind` and divide the instructions by the appends acknowledged to compare
//! two builds' cost per append (to within the ~1% the compiler's inlining moves between builds).
#![allow(clippy::disallowed_methods)] // The command-line tool reads the clock to report speed.

use std::time::Instant;
use tidings_sim::{run, SimParams};

fn params(seed: u64) -> SimParams {
    let appends_only = std::env::args().any(|a| a == "--no-metadata");
    let seeded = SimParams::from_seed(seed);
    let idle_evict_ms = arg("--idle-evict-ms").unwrap_or(seeded.idle_evict_ms);
    let flag = |name: &str| std::env::args().any(|a| a == name);
    let tight_limits = (seeded.tight_limits || flag("--tight-limits")) && !flag("--no-tight-limits");
    let hurried_timings = (seeded.hurried_timings || flag("--hurried-timings")) && !flag("--no-hurried-timings");
    let clock_skew = (seeded.clock_skew || flag("--clock-skew")) && !flag("--no-clock-skew");
    let disk_loss = (seeded.disk_loss || flag("--disk-loss") && seeded.disk_loss_possible()) && !flag("--no-disk-loss");
    let unsafe_disk_loss_keeps_identity = flag("--unsafe-disk-loss-keeps-identity");
    let with_disk_loss = SimParams { disk_loss, ..seeded.clone() };
    let grow = (seeded.grow || flag("--grow")) && with_disk_loss.grow_possible() && !flag("--no-grow");
    let with_grow = SimParams { grow, ..with_disk_loss };
    let shrink = (seeded.shrink || flag("--shrink")) && with_grow.shrink_possible() && !flag("--no-shrink");
    let planned_stops =
        (seeded.planned_stops || flag("--planned-stops") && seeded.nodes >= 2) && !flag("--no-planned-stops");
    let late_duplicates = flag("--late-duplicates");
    let all_metadata = flag("--all-metadata");
    let meta_read_errors = flag("--meta-read-errors");
    let meta_write_errors = flag("--meta-write-errors");
    let channels = arg("--channels").and_then(|n| usize::try_from(n).ok()).filter(|n| *n > 0);
    SimParams {
        safety_ms: arg("--safety-ms").unwrap_or(seeded.safety_ms),
        liveness_ms: arg("--liveness-ms").unwrap_or(seeded.liveness_ms),
        channels: channels.unwrap_or(seeded.channels),
        metadata_workload: !appends_only,
        idle_evict_ms,
        tight_limits,
        hurried_timings,
        clock_skew,
        disk_loss,
        grow,
        shrink,
        planned_stops,
        late_duplicates,
        all_metadata,
        meta_read_errors,
        meta_write_errors,
        unsafe_disk_loss_keeps_identity,
        ..seeded
    }
}

fn arg(name: &str) -> Option<u64> {
    let args: Vec<String> = std::env::args().collect();
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).and_then(|v| v.parse().ok())
}

fn main() {
    if let Some(channels) = arg("--cost") {
        let params = SimParams::steady(usize::try_from(channels).unwrap_or(1), arg("--load-ms").unwrap_or(10_000));
        println!("{params}");
        let report = run(params);
        println!("steps {} acked {} trace {:016x}", report.steps, report.acked, report.trace_hash);
        for violation in &report.violations {
            println!("VIOLATION: {violation}");
        }
        std::process::exit(i32::from(!report.passed()));
    }
    if let Some(seed) = arg("--seed") {
        let level = std::env::var("TIDINGS_SIM_LOG").ok().and_then(|l| l.parse::<tracing::Level>().ok());
        if let Some(level) = level {
            tracing_subscriber::fmt().with_max_level(level).without_time().init();
        }
        println!("{}", params(seed));
        let report = run(params(seed));
        println!(
            "steps {} acked {} delivered {} unanswered {} faults {:?} trace {:016x}",
            report.steps, report.acked, report.delivered, report.unanswered, report.faults, report.trace_hash
        );
        for violation in &report.violations {
            println!("VIOLATION: {violation}");
        }
        std::process::exit(i32::from(!report.passed()));
    }
    let seeds = arg("--seeds").unwrap_or(100);
    let from = arg("--from").unwrap_or(0);
    let started = Instant::now();
    let (mut steps, mut acked, mut delivered, mut failures) = (0u64, 0usize, 0usize, 0u64);
    let mut faults = tidings_sim::Faults::default();
    for seed in from..from + seeds {
        let report = run(params(seed));
        steps += report.steps;
        acked += report.acked;
        delivered += report.delivered;
        faults += report.faults;
        if !report.passed() {
            failures += 1;
            println!("FAILED {}", report.params);
            for violation in &report.violations {
                println!("  {violation}");
            }
            println!("  replay: {}", report.replay_command());
        }
    }
    let elapsed = started.elapsed();
    println!(
        "{seeds} seeds in {elapsed:.1?} ({:.0} seeds/hour, {:.0} simulated ms/s): {steps} steps, {acked} appends acknowledged, \
         {delivered} fanout deliveries, faults {faults:?}, {failures} failed",
        seeds as f64 / elapsed.as_secs_f64() * 3600.0,
        steps as f64 / elapsed.as_secs_f64(),
    );
    std::process::exit(i32::from(failures > 0));
}
