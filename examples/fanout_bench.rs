//! Fanout of one message to groups of 10,000, 100,000 and 1,000,000 members with 10% online:
//! `cargo run --release --example fanout_bench`. Prints plans/s, members paged and entries planned per
//! second, the most plans the planner held at once, and how much the process's resident high-water mark
//! grew during the fanout (the member store is allocated before it is read). The planner is driven by
//! the same code as the criterion bench (`crates/channel/benches/support/fanout_driver.rs`).
#![allow(clippy::disallowed_methods)] // A benchmark tool reads the clock.

#[path = "../crates/channel/benches/support/fanout_driver.rs"]
mod fanout_driver;

use fanout_driver::{fan_out, member_store};
use std::time::Instant;

/// The process's resident-set high-water mark, in KiB (`VmHWM` in `/proc/self/status`).
fn rss_high_water_kib() -> usize {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

fn run(members: usize) {
    let store = member_store(members);
    let baseline = rss_high_water_kib();
    let started = Instant::now();
    let run = fan_out(&store);
    let elapsed = started.elapsed().as_secs_f64();
    let peak = rss_high_water_kib().saturating_sub(baseline);
    println!(
        "{members:>9} members: {:>5} plans, {:>6} online entries in {:>6.1} ms — {:>8.0} plans/s, {:>10.0} members paged/s, {:>9.0} entries planned/s; at most {} plans held; RSS high-water grew {peak} KiB",
        run.plans,
        run.entries,
        elapsed * 1e3,
        run.plans as f64 / elapsed,
        run.located as f64 / elapsed,
        run.entries as f64 / elapsed,
        run.most_pending,
    );
}

fn main() {
    println!("fanout of one message, 10% online, page 1,000, plans of up to 500 members:");
    for members in [10_000, 100_000, 1_000_000] {
        run(members);
    }
}
