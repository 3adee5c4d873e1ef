//! Cluster figures, measured in one run: `cargo run --release --example bench` (`--quick` for a short run).
//!
//! Three nodes in one process on one disk (each with its own sled + journal under a temp dir), in-process
//! transport, channels of 3 replicas with MinISR 2, fanout off. For 1, 100 and 10,000 active channels:
//! committed 128-byte messages per second with many appends in flight (appends go to each channel's
//! leader; forwarding is measured by the quickstart), then append-to-commit latency p50/p99 at half that
//! rate (open loop: latency counts from the scheduled send time, so queueing shows). Reported next to the
//! disk's raw group-commit ceiling and its `fdatasync` p99, measured first in the same run. Three copies
//! share one disk here, so the fair reference for throughput is ceiling / 3.
//!
//! `--channels N` runs only the scenario with N channels; `--tuned` runs with quieter idle channels
//! (longer long polls, followers idle after one empty pull) and a 30 s write-behind interval, which
//! matter when thousands of channels each see a few messages per second.
#![allow(clippy::disallowed_methods)] // A benchmark tool reads the clock.

#[path = "support/mod.rs"]
mod support;

use bytes::Bytes;
use crossbeam_channel::bounded;
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};
use support::{ceiling, figures, Figures, RECORD_BYTES};
use tidings::channel::machine::AppendRecord;
use tidings::mesh::InProcessMesh;
use tidings::node::{NodeConfig, NodeError};
use tidings::slot::model::{ChannelFlags, ChannelInfo};
use tidings::types::{ChannelId, ChannelType, NodeId};
use tidings::{AppendHandle, Node, StorageOptions};

/// Client threads submitting appends.
const CLIENTS: usize = 4;

struct Cluster {
    ids: Vec<NodeId>,
    nodes: Vec<Arc<Node>>,
    _mesh: Arc<InProcessMesh>,
}

impl Cluster {
    fn start(root: &std::path::Path, tuned: bool) -> Cluster {
        let ids: Vec<NodeId> = (1..=3).map(NodeId::new).collect();
        let mesh = InProcessMesh::new();
        let nodes = ids
            .iter()
            .map(|id| {
                let mut config = NodeConfig::new(*id, ids.clone());
                if tuned {
                    // Quieter idle channels: long polls park longer, followers go idle after one empty
                    // pull and then pull every 4 s (a hint wakes them at once when data arrives).
                    config.machine.pull_park = Duration::from_secs(3);
                    config.machine.pull_timeout = Duration::from_secs(5);
                    config.machine.idle_after_empty_pulls = 1;
                    config.machine.idle_pull_interval = Duration::from_secs(4);
                }
                let mut storage = StorageOptions::new(root.join(format!("node-{id}")));
                if tuned {
                    // Fewer, larger sled packs when each channel gets a few messages per second.
                    storage.journal.write_behind_interval = Duration::from_secs(30);
                }
                let node = Arc::new(Node::start(config, storage, mesh.transport(*id)).expect("node starts"));
                mesh.attach(&node);
                node
            })
            .collect();
        Cluster { ids, nodes, _mesh: mesh }
    }

    /// The node that leads `channel` (placement's first replica).
    fn leader(&self, channel: &ChannelId) -> &Arc<Node> {
        let leader = NodeConfig::new(self.ids[0], self.ids.clone()).channel_placement(channel)[0];
        &self.nodes[self.ids.iter().position(|id| *id == leader).expect("a cluster node")]
    }

    /// Creates `channels` from several threads (metadata writes batch in the slot groups' raft logs).
    fn create(&self, channels: &[ChannelId]) {
        std::thread::scope(|scope| {
            for part in channels.chunks(channels.len().div_ceil(32)) {
                scope.spawn(move || {
                    for channel in part {
                        let info = ChannelInfo { channel: channel.clone(), flags: ChannelFlags::default() };
                        retry(|| match self.nodes[0].create_channel(info.clone()) {
                            // Applied by an attempt whose answer was lost.
                            Err(NodeError::NotApplied(_)) => Ok(()),
                            other => other,
                        });
                    }
                });
            }
        });
    }

    fn append(&self, channel: &ChannelId, payload: &Bytes) -> AppendHandle {
        let record = AppendRecord { idempotency_key: None, payload: payload.clone() };
        retry(|| self.leader(channel).append(channel.clone(), vec![record.clone()]))
    }
}

fn retry<T>(mut call: impl FnMut() -> Result<T, NodeError>) -> T {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match call() {
            Ok(value) => return value,
            Err(error) if Instant::now() < deadline => {
                let _ = error;
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(error) => panic!("gave up: {error}"),
        }
    }
}

/// Closed loop: each client keeps `in_flight / CLIENTS` appends outstanding over its share of channels.
fn max_rate(cluster: &Cluster, channels: &[ChannelId], messages: usize, in_flight: usize) -> Figures {
    let payload = Bytes::from(vec![0x42u8; RECORD_BYTES]);
    let started = Instant::now();
    let latencies: Vec<Duration> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..CLIENTS)
            .map(|client| {
                let payload = payload.clone();
                scope.spawn(move || {
                    let mut latencies = Vec::with_capacity(messages / CLIENTS);
                    let mut pending: VecDeque<(Instant, AppendHandle)> = VecDeque::new();
                    let mine: Vec<&ChannelId> = channels.iter().skip(client).step_by(CLIENTS).collect();
                    let mine = if mine.is_empty() { channels.iter().collect() } else { mine };
                    for i in 0..messages / CLIENTS {
                        pending.push_back((Instant::now(), cluster.append(mine[i % mine.len()], &payload)));
                        while pending.len() >= in_flight / CLIENTS {
                            let (t, handle) = pending.pop_front().expect("non-empty");
                            handle.wait().expect("append committed");
                            latencies.push(t.elapsed());
                        }
                    }
                    for (t, handle) in pending {
                        handle.wait().expect("append committed");
                        latencies.push(t.elapsed());
                    }
                    latencies
                })
            })
            .collect();
        workers.into_iter().flat_map(|w| w.join().expect("client")).collect()
    });
    let count = latencies.len();
    figures(count, started.elapsed(), latencies)
}

/// Open loop at `rate` messages/s for `duration`: latency from each message's scheduled send time.
fn paced(cluster: &Cluster, channels: &[ChannelId], rate: f64, duration: Duration) -> Figures {
    let payload = Bytes::from(vec![0x42u8; RECORD_BYTES]);
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)] // A few hundred thousand at most.
    let total = (rate * duration.as_secs_f64()) as usize;
    let interval = Duration::from_secs_f64(1.0 / rate);
    let (to_waiter, handles) = bounded::<(Instant, AppendHandle)>(1 << 20);
    let started = Instant::now();
    let latencies = std::thread::scope(|scope| {
        let waiter = scope.spawn(move || {
            let mut latencies = Vec::with_capacity(total);
            for (scheduled, handle) in handles {
                handle.wait().expect("append committed");
                latencies.push(scheduled.elapsed());
            }
            latencies
        });
        for i in 0..total {
            let scheduled = started + interval * u32::try_from(i).expect("fits");
            if let Some(wait) = scheduled.checked_duration_since(Instant::now()) {
                std::thread::sleep(wait);
            }
            let handle = cluster.append(&channels[i % channels.len()], &payload);
            to_waiter.send((scheduled, handle)).expect("waiter alive");
        }
        drop(to_waiter);
        waiter.join().expect("waiter")
    });
    figures(total, duration, latencies)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let quick = std::env::args().any(|a| a == "--quick");
    let scale = if quick { 1 } else { 3 };
    let dir = tempfile::tempdir()?;
    println!("bench: 3 nodes in one process, one disk, {RECORD_BYTES}-byte messages, data in {}", dir.path().display());
    let disk = ceiling(dir.path(), 100 * scale)?;
    let fair = disk.rate / 3.0;
    println!(
        "disk ceiling (append + fdatasync, 1,000 per sync): {:.0} records/s (/3 = {fair:.0}); fdatasync p50 {:.2?} p99 {:.2?}",
        disk.rate, disk.p50, disk.p99
    );

    let tuned = std::env::args().any(|a| a == "--tuned");
    let cluster = Cluster::start(dir.path(), tuned);
    let mut summary = Vec::new();
    let only: Option<usize> = std::env::args().skip_while(|a| a != "--channels").nth(1).and_then(|n| n.parse().ok());
    for (count, messages) in [(1usize, 20_000usize), (100, 50_000), (10_000, 60_000)] {
        if only.is_some_and(|only| only != count) {
            continue;
        }
        let channels: Vec<ChannelId> = (0..count)
            .map(|i| ChannelId::new(ChannelType::GROUP, &format!("c{count}-{i}")).expect("channel id"))
            .collect();
        let t = Instant::now();
        cluster.create(&channels);
        let created = t.elapsed();
        // Warm up: every channel activated on its replicas and its first message committed.
        max_rate(&cluster, &channels, channels.len().max(CLIENTS * 64), 1024);
        let in_flight = if count == 1 { 256 } else { 2048 };
        let top = max_rate(&cluster, &channels, messages * scale, in_flight);
        let half = paced(&cluster, &channels, top.rate / 2.0, Duration::from_secs(2 * scale as u64));
        println!(
            "{count:>6} channels (created in {created:.2?}): {:>7.0} msg/s ({in_flight} in flight, p50 {:.2?} p99 {:.2?}); at half rate p50 {:.2?} p99 {:.2?}",
            top.rate, top.p50, top.p99, half.p50, half.p99
        );
        summary.push((count, top.rate, half.p99));
    }
    println!();
    for (count, rate, p99) in summary {
        println!(
            "{count:>6} channels: {:>5.1}% of ceiling/3 (target >= 25% at 10,000); half-rate p99 = {:.1}x fdatasync p99 (target <= 4x)",
            100.0 * rate / fair,
            p99.as_secs_f64() / disk.p99.as_secs_f64()
        );
    }
    Ok(())
}
