//! Cluster figures, measured in one run: `cargo run --release --example bench` (`--quick` for a short run).
//!
//! Three nodes in one process on one disk (each with its own sled + journal under a temp dir), in-process
//! transport, channels of 3 replicas with MinISR 2, fanout off. For 1, 100 and 10,000 active channels:
//! committed 128-byte messages per second with many appends in flight (appends go to each channel's
//! leader; forwarding is measured by the quickstart), then append-to-commit latency p50/p99 at half that
//! rate (open loop: latency counts from the scheduled send time, so queueing shows; 15 s, 3 s with
//! `--quick`), once write-behind has written what the full-rate phase left in memory (at most 30 s: a
//! moderate load in steady state, not beside an earlier burst's backlog).
//! Reported next to the
//! disk's raw group-commit ceiling and its `fdatasync` p99, measured first in the same run. Three copies
//! share one disk here, so the fair reference for throughput is ceiling / 3. Each phase's CPU per message
//! is printed whole and split by thread kind (reactors, durable workers, write-behind, core, sled, the
//! node's other threads, and the load's own threads with any that exited meanwhile), with the cores it
//! kept busy and how often per message each kind of thread was put on a core (each time is a wakeup or
//! a preemption: thread hops, not work, dominate the cost at moderate rates); each phase's journal syncs
//! with their latency percentiles under that load; and for the paced phase how late the sender thread
//! sent (p99: that much of the latency is the load waiting for a core), how many appends were refused
//! busy and sent again, and where the slowest 1% fell: in how many 10 ms windows of send time (few:
//! stalls that held up everything sent meanwhile) and by the node leading their channel.
//!
//! `--channels N` runs only the scenario with N channels (any N); `--idle-evict-secs S` evicts idle
//! replicas after S seconds (`NodeConfig::channel_idle_evict`; with more channels than a phase can
//! touch in S seconds, every message then pays a replica activation); `--tuned` runs with quieter idle channels
//! (HW news for followers held as long as the 3 s long poll, followers idle after one empty pull and
//! then pulling every 4 s) and a 30 s write-behind interval, which matter when thousands of channels each see a few messages
//! per second. `--in-flight N` sets the appends in flight at full rate (default 256 for one channel,
//! 2,048 otherwise), `--messages N` how many the full-rate phase sends (a longer phase takes in more
//! background work: write-behind rounds, timers); `--paced-rate R` paces the latency phase at R msg/s instead of half the full rate
//! (to compare two settings at the same load); `--senders N` sends every append through
//! `Node::append_from` / `append_from_then`, naming senders `u0` .. `uN-1` in turn, so each append pays
//! its sender check (the user banned? on the channel's deny list? read from the leader's slot replicas). `TIDINGS_REACTORS=N` sets every node's number of channel
//! reactor threads (default: the runtime's choice, one per two cores); `TIDINGS_HW_NOTIFY_MS=N` its
//! channels' `hw_notify_delay`; `TIDINGS_WRITE_BEHIND_MS=N` and `TIDINGS_WRITE_BEHIND_NICE=N` its
//! journal's `write_behind_interval` and `write_behind_nice`, `TIDINGS_DURABLE_WORKERS=N` its durable
//! workers, `TIDINGS_SYNC_INTERVAL_US=N` its journal's `sync_interval_min`, `TIDINGS_WRITE_BEHIND_REST=N`
//! its `write_behind_rest_percent`, `TIDINGS_PACK_KB=N` its `pack_bytes_max`, `TIDINGS_PULL_PARK_MS=N` its channels' `pull_park` (`pull_timeout` and `isr_alive` follow) and
//! `TIDINGS_IDLE_AFTER_EMPTY_PULLS=N` their `idle_after_empty_pulls` (for A/B runs);
//! `TIDINGS_NODE_DOWN_AFTER_MS=N` the controllers' `node_down_after`, for runs on a much slower host.
//!
//! Instructions per message, which do not move with the machine's load as times do: run the reactors
//! under callgrind at one message per channel round, then divide the instructions by the appends
//! (`ChannelMachine::handle_append` calls), e.g.
//! `TIDINGS_PULL_PARK_MS=10000 TIDINGS_NODE_DOWN_AFTER_MS=60000 valgrind --tool=callgrind
//! --toggle-collect='tidings::runtime::reactor::Reactor::run' target/release/examples/bench --quick
//! --channels 400 --in-flight 400 --messages 20000` (see `docs/performance-history.md`, session 24).
#![allow(clippy::disallowed_methods)] // A benchmark tool reads the clock.

#[path = "support/mod.rs"]
mod support;

use std::time::{Duration, Instant};
use support::cluster::{max_rate, paced, Cluster, CLIENTS};
use support::{ceiling, flag_value, with_cpu_per_message, RECORD_BYTES};
use tidings::store::LatencyHistogram;
use tidings::types::{ChannelId, ChannelType};

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
    let evict_after: Option<u64> = flag_value("--idle-evict-secs");
    let mut cluster = Cluster::start_with(dir.path(), tuned, |config| {
        if let Some(secs) = evict_after {
            config.channel_idle_evict = Duration::from_secs(secs);
        }
    });
    if let Some(senders) = flag_value::<u64>("--senders") {
        println!("appends through append_from, {senders} senders in turn (each append's sender checked)");
        cluster = cluster.with_senders(senders);
    }
    let mut summary = Vec::new();
    let only: Option<usize> = flag_value("--channels");
    let in_flight_override: Option<usize> = flag_value("--in-flight");
    let paced_rate: Option<usize> = flag_value("--paced-rate");
    // (channels, messages at full rate); any other `--channels N` sends as many as the last.
    const SCENARIOS: [(usize, usize); 3] = [(1, 20_000), (100, 50_000), (10_000, 60_000)];
    let scenarios = match only {
        Some(count) => vec![(count, SCENARIOS.iter().find(|s| s.0 == count).unwrap_or(&SCENARIOS[2]).1)],
        None => SCENARIOS.to_vec(),
    };
    let messages_override: Option<usize> = flag_value("--messages");
    for (count, messages) in scenarios {
        let messages = messages_override.unwrap_or(messages);
        let channels: Vec<ChannelId> = (0..count)
            .map(|i| ChannelId::new(ChannelType::GROUP, &format!("c{count}-{i}")).expect("channel id"))
            .collect();
        let t = Instant::now();
        cluster.create(&channels);
        let created = t.elapsed();
        // Warm up: every channel activated on its replicas and its first message committed.
        max_rate(&cluster, &channels, channels.len().max(CLIENTS * 64), 1024);
        if evict_after.is_some() && count > 10_000 {
            // With more channels than a phase touches within the eviction bound, each message meets
            // evicted replicas in steady state: start there, not from what the warm-up's tail left active.
            cluster.wait_until_evicted(3 * 1_000);
        }
        let in_flight = in_flight_override.unwrap_or(if count == 1 { 256 } else { 2048 });
        let journal = JournalTally::now(&cluster);
        let (top, cpu_top) =
            with_cpu_per_message(messages * scale, || max_rate(&cluster, &channels, messages * scale, in_flight));
        let (journal_top, _) = journal.since(&cluster);
        // The paced phase measures a moderate load in steady state: the full-rate phase's records still
        // on their way into sled (write-behind trails by a round or two) are written first, rather than
        // beside the paced load, whose CPU they would take.
        let caught_up = cluster.wait_for_write_behind();
        // Full runs pace for 15 s: long enough to include write-behind rounds (every second) and the
        // controller's idle repair pass (every 10 s), which both read and write sled beside the traffic.
        let paced_for = Duration::from_secs(if quick { 3 } else { 15 });
        let journal = JournalTally::now(&cluster);
        #[allow(clippy::cast_precision_loss)] // A rate of messages per second.
        let half_rate = paced_rate.map_or(top.rate / 2.0, |r| r as f64);
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)] // A count of messages sent.
        let sent = (half_rate * paced_for.as_secs_f64()) as usize;
        let (half, cpu_half) = with_cpu_per_message(sent, || paced(&cluster, &channels, half_rate, paced_for));
        let (journal_half, sync_p99_half) = journal.since(&cluster);
        println!(
            "{count:>6} channels (created in {created:.2?}): {:>7.0} msg/s ({in_flight} in flight, p50 {:.2?} p99 {:.2?}); at half rate p50 {:.2?} p99 {:.2?}{}",
            top.rate, top.p50, top.p99, half.p50, half.p99, half.open_loop_notes()
        );
        if let Some(slowest) = half.slowest.as_deref().filter(|s| !s.is_empty()) {
            println!("         at half rate, the {slowest}");
        }
        println!("         journal syncs, all nodes: {journal_top} at full rate; {journal_half} at half rate");
        println!("         write-behind caught up with the full-rate phase in {caught_up:.2?} before the paced phase");
        println!("         whole process: {cpu_top} at full rate; {cpu_half} at half rate");
        summary.push((count, top.rate, half.p99, sync_p99_half));
    }
    println!();
    for (count, rate, p99, sync_p99) in summary {
        println!(
            "{count:>6} channels: {:>5.1}% of ceiling/3 (target >= 25% at 10,000); half-rate p99 = {:.1}x fdatasync p99 (target <= 4x), {:.1}x the journals' own sync p99 in that phase",
            100.0 * rate / fair,
            p99.as_secs_f64() / disk.p99.as_secs_f64(),
            p99.as_secs_f64() / sync_p99.as_secs_f64().max(1e-9)
        );
    }
    Ok(())
}

/// The journals' sync and frame counts and sync latencies summed over the nodes, to tell how many
/// channel batches each `fdatasync` carried in a phase (every sync costs CPU in the kernel and a device
/// round trip) and how long the syncs took under that phase's load (a commit waits for two in a row).
struct JournalTally {
    at: Instant,
    syncs: u64,
    frames: u64,
    latency: LatencyHistogram,
}

impl JournalTally {
    fn now(cluster: &Cluster) -> Self {
        let mut tally = Self { at: Instant::now(), syncs: 0, frames: 0, latency: LatencyHistogram::default() };
        for stats in cluster.nodes.iter().map(|n| n.message_log_stats()) {
            tally.syncs += stats.syncs;
            tally.frames += stats.frames;
            tally.latency.merge(&stats.sync_latency);
        }
        tally
    }

    /// What happened since `self`, as a printable summary, and the syncs' p99 latency.
    fn since(&self, cluster: &Cluster) -> (String, Duration) {
        let now = Self::now(cluster);
        let syncs = now.syncs - self.syncs;
        let per_second = syncs as f64 / now.at.duration_since(self.at).as_secs_f64();
        let per_sync = (now.frames - self.frames) as f64 / syncs.max(1) as f64;
        let latency = now.latency.since(&self.latency);
        let (p50, p99) = (latency.percentile(0.5), latency.percentile(0.99));
        let (p999, max) = (latency.percentile(0.999), latency.percentile(1.0));
        let took = format!("took p50 {p50:.2?} p99 {p99:.2?} p99.9 {p999:.2?} max {max:.2?}");
        (format!("{per_second:.0}/s, {per_sync:.1} channel batches each, {took}"), p99)
    }
}
