//! Metadata write figures: `cargo run --release --example meta_bench` (`--quick` for a short run).
//!
//! Three nodes in one process on one disk (sled under a temp dir, in-process transport), default
//! configuration. Each phase has callers on their own threads, each waiting for its write before the next
//! (a chat server's request threads), all through node 1, which forwards to each slot group's leader:
//!
//! * channel creation (`Node::create_channel`: two raft proposals, the channel and its runtime meta with
//!   the replicas placed);
//! * subscriber adds (`Node::propose(AddMembers)` of 10 users to one of those channels: one proposal).
//!
//! For 1, 8, 32 and 128 callers it prints writes per second, the latency p50/p99 and the CPU per write
//! by thread kind. A created channel's replicas stay inactive until first used, so creation costs only
//! the slot layer: two proposals replicated to three nodes, each durable (a sled write and a sync) and
//! applied (a sled write). Batching is what concurrency buys: one processing round of a node's slot
//! groups writes all their raft log changes in one sled batch and all their FSM changes in another, and
//! one sync covers both.
#![allow(clippy::disallowed_methods)] // A benchmark tool reads the clock.

#[path = "support/mod.rs"]
mod support;

use std::sync::Mutex;
use std::time::{Duration, Instant};
use support::cluster::{retry, Cluster};
use support::{figures, with_cpu_per};
use tidings::slot::command::{Command, MemberList};
use tidings::slot::model::{ChannelFlags, ChannelInfo, Uid};
use tidings::types::{ChannelId, ChannelType};

/// Callers per phase.
const CALLERS: [usize; 4] = [1, 8, 32, 128];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let quick = std::env::args().any(|a| a == "--quick");
    let per_caller_scale = if quick { 1 } else { 4 };
    let dir = tempfile::tempdir()?;
    println!("meta_bench: 3 nodes in one process, one disk, data in {}", dir.path().display());
    let cluster = Cluster::start(dir.path(), false);
    // Slot groups elect their leaders first.
    retry(|| cluster.nodes[0].create_channel(info(&channel("warm-up"))));
    for callers in CALLERS {
        // Enough writes that each caller makes a few dozen, and the phase lasts about a second or more.
        let writes = (callers * 40).max(500) * per_caller_scale;
        let channels: Vec<ChannelId> = (0..writes).map(|i| channel(&format!("m{callers}-{i}"))).collect();
        let create = |channel: &ChannelId| {
            retry(|| cluster.nodes[0].create_channel(info(channel)));
        };
        let (created, cpu) = with_cpu_per("write", writes, || run(&channels, callers, create));
        println!("{callers:>4} callers, channel creation: {created}; {cpu}");
        let subscribe = |channel: &ChannelId| {
            let uids = (0..10).map(|u| Uid::new(format!("u{u}")).expect("uid")).collect();
            let add = Command::AddMembers { channel: channel.clone(), list: MemberList::Subscribers, uids };
            retry(|| cluster.nodes[0].propose(add.clone()));
        };
        let (added, cpu) = with_cpu_per("write", writes, || run(&channels, callers, subscribe));
        println!("{callers:>4} callers, subscriber adds:   {added}; {cpu}");
    }
    Ok(())
}

fn channel(name: &str) -> ChannelId {
    ChannelId::new(ChannelType::GROUP, name).expect("channel id")
}

fn info(channel: &ChannelId) -> ChannelInfo {
    ChannelInfo { channel: channel.clone(), flags: ChannelFlags::default() }
}

/// `write` once per channel, from `callers` threads each taking its share in turn; the rate and latency.
fn run(channels: &[ChannelId], callers: usize, write: impl Fn(&ChannelId) + Sync) -> String {
    let latencies = Mutex::new(Vec::with_capacity(channels.len()));
    let started = Instant::now();
    std::thread::scope(|scope| {
        for part in channels.chunks(channels.len().div_ceil(callers)) {
            let (write, latencies) = (&write, &latencies);
            scope.spawn(move || {
                let mut mine: Vec<Duration> = Vec::with_capacity(part.len());
                for channel in part {
                    let t = Instant::now();
                    write(channel);
                    mine.push(t.elapsed());
                }
                latencies.lock().expect("no caller panicked").extend(mine);
            });
        }
    });
    let latencies = latencies.into_inner().expect("no caller panicked");
    let figures = figures(channels.len(), started.elapsed(), latencies);
    format!("{:>6.0} writes/s, p50 {:.2?} p99 {:.2?}", figures.rate, figures.p50, figures.p99)
}
