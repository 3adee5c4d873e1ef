//! Fanout of one message to groups of 10,000, 100,000 and 1,000,000 members with 10% online:
//! `cargo run --release --example fanout_bench`. Prints plans/s, members paged and entries planned per
//! second, the most plans the planner held at once, and how much the process's resident high-water mark
//! grew during the fanout (the member store is allocated before it is read).
#![allow(clippy::disallowed_methods)] // A benchmark tool reads the clock.

use std::time::Instant;
use tidings::channel::fanout::{FanoutConfig, FanoutEffect, FanoutPlanner, Member, MessageRef, Target};
use tidings::types::{ChannelId, ChannelType, NodeId, Seq};

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
    // The host's subscriber store and presence: 10% online, spread over 3 nodes.
    let store: Vec<String> = (0..members).map(|i| format!("u{i:08}")).collect();
    let online = |i: usize| (i % 10 == 0).then(|| Target { node: NodeId::new(1 + (i % 3) as u64) });
    let baseline = rss_high_water_kib();
    let started = Instant::now();
    let mut most_pending = 0;
    let mut planner = FanoutPlanner::new(FanoutConfig::default());
    let message =
        MessageRef { channel: ChannelId::new(ChannelType::GROUP, "huge").unwrap(), seq: Seq::new(1), sender: None };
    planner.submit(message, None).unwrap();
    let (mut plans, mut entries, mut located) = (0usize, 0usize, 0usize);
    while let Some(effect) = planner.poll_effect() {
        match effect {
            FanoutEffect::FetchPage { job, cursor, limit, .. } => {
                let start = cursor.map_or(0, |c| usize::from_le_bytes(c.try_into().unwrap()));
                let end = (start + limit).min(store.len());
                let page = store[start..end]
                    .iter()
                    .map(|uid| Member { uid: uid.clone(), left: false, hidden: false, denied: false })
                    .collect();
                let next = (end < store.len()).then(|| end.to_le_bytes().to_vec());
                planner.handle_page(job, page, next);
            }
            FanoutEffect::Locate { job, uids } => {
                let first: usize = uids.first().map_or(0, |u| u[1..].parse().unwrap());
                located += uids.len();
                let targets = (first..first + uids.len()).map(online).collect();
                planner.handle_located(job, targets);
            }
            FanoutEffect::Deliver(plan) => {
                most_pending = most_pending.max(planner.plans_pending());
                plans += 1;
                entries += plan.members.len();
                planner.handle_delivered(plan.id, true);
            }
            FanoutEffect::Failed(_) | FanoutEffect::Finished { .. } => {}
        }
    }
    let elapsed = started.elapsed().as_secs_f64();
    let peak = rss_high_water_kib().saturating_sub(baseline);
    println!(
        "{members:>9} members: {plans:>5} plans, {entries:>6} online entries in {:>6.1} ms — {:>8.0} plans/s, {:>10.0} members paged/s, {:>9.0} entries planned/s; at most {most_pending} plans held; RSS high-water grew {peak} KiB",
        elapsed * 1e3,
        plans as f64 / elapsed,
        located as f64 / elapsed,
        entries as f64 / elapsed,
    );
}

fn main() {
    println!("fanout of one message, 10% online, page 1,000, plans of up to 500 members:");
    for members in [10_000, 100_000, 1_000_000] {
        run(members);
    }
}
