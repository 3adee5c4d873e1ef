//! Measurement helpers shared by the benchmark examples (`#[path]`-included; not an example itself).
#![allow(dead_code)] // Each example uses part of it.

pub mod cluster;
pub mod raft_baseline;
pub mod store;

use std::fs::OpenOptions;
use std::io::Write;
use std::str::FromStr;
use std::time::{Duration, Instant};

// Every benchmark example allocates with jemalloc, as a host running a busy node would: under glibc's
// allocator, large buffers freed and mapped again each group commit cost a fifth of the time in page
// faults (perf: clear_page), which says more about glibc than about the log
// (`GLIBC_TUNABLES=glibc.malloc.mmap_threshold=268435456:glibc.malloc.trim_threshold=268435456` gives
// glibc the same figures). `bench_report` also reads its live-heap statistics for the memory figures.
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// The value after `flag` on the command line, if there is one and it parses.
pub fn flag_value<T: FromStr>(flag: &str) -> Option<T> {
    std::env::args().skip_while(|a| a != flag).nth(1).and_then(|v| v.parse().ok())
}

/// The environment variable `name`, if it is set and parses (the examples' A/B knobs).
pub fn env_value<T: FromStr>(name: &str) -> Option<T> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

/// CPU time this process has used so far, all threads, user and system (Linux: `/proc/self/stat`, in
/// clock ticks of 10 ms; `None` elsewhere). Over a phase of a second or more on two cores that is
/// within about 1%: steadier than a rate, which moves with the disk of the day.
pub fn process_cpu() -> Option<Duration> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the command name (which may hold spaces, so split after its closing parenthesis):
    // state is field 3; utime and stime are fields 14 and 15.
    let mut fields = stat.rsplit_once(')')?.1.split_whitespace().skip(11);
    let user: u64 = fields.next()?.parse().ok()?;
    let system: u64 = fields.next()?.parse().ok()?;
    // USER_HZ is 100 on every Linux this runs on (it is fixed in the kernel's ABI, not CONFIG_HZ).
    Some(Duration::from_millis((user + system) * 10))
}

/// The kinds of thread a node runs, as `bench` reports them.
const THREAD_KINDS: [&str; 7] = ["reactors", "durable", "reader", "write-behind", "core", "sled", "other node"];

/// Thread name prefixes (Linux cuts names at 15 bytes) and their kind in [`THREAD_KINDS`]; the first
/// that matches wins.
const THREAD_PREFIXES: [(&str, usize); 8] = [
    ("tidings-reactor", 0),
    ("tidings-durable", 1),
    // Pull and API reads, activations' loads, sender checks.
    ("tidings-reader", 2),
    ("tidings-write-b", 3),
    ("tidings-core", 4),
    ("sled-", 5),
    ("log flusher", 5),
    // Slot sync, fanout.
    ("tidings-", 6),
];

/// CPU time used so far by the live threads of each kind in [`THREAD_KINDS`], to the nanosecond
/// (`/proc/self/task/*/schedstat`: per-thread clock ticks, rounded down thread by thread, would leave
/// tens of milliseconds to "load" in a phase of a tenth of a second).
fn cpu_by_kind() -> Option<[(Duration, u64); THREAD_KINDS.len()]> {
    let mut sums = [(Duration::ZERO, 0); THREAD_KINDS.len()];
    for task in std::fs::read_dir("/proc/self/task").ok()?.flatten() {
        let read = |file: &str| std::fs::read_to_string(task.path().join(file)).ok();
        let (Some(name), Some(schedstat)) = (read("comm"), read("schedstat")) else { continue };
        // Time on a CPU (ns), time waiting for one (ns), times it was put on one.
        let mut fields = schedstat.split_whitespace().map(|n| n.parse::<u64>().ok());
        let (Some(Some(nanos)), _, Some(Some(runs))) = (fields.next(), fields.next(), fields.next()) else { continue };
        if let Some((_, kind)) = THREAD_PREFIXES.iter().find(|(prefix, _)| name.starts_with(prefix)) {
            sums[*kind].0 += Duration::from_nanos(nanos);
            sums[*kind].1 += runs;
        }
    }
    Some(sums)
}

/// Runs `phase`, which sends `messages`, and returns its result with the process's CPU per message
/// over it, as "N µs CPU/msg (reactors a, durable b, ...; C cores busy)": the split by thread kind, the
/// rest (the load's threads, and threads that exited during the phase) as "load", and the CPU used per
/// second of the phase (on a machine with two cores, 1.8 means the phase ran near saturation, where
/// any hiccup queues work for many times its length) — empty where [`process_cpu`] is unknown. The whole counts in 10 ms ticks, so in a phase much shorter than a second (the quick
/// run's full-rate phase at one channel lasts ~0.1 s) "load" is within about ±10 ms / messages.
pub fn with_cpu_per_message<T>(messages: usize, phase: impl FnOnce() -> T) -> (T, String) {
    with_cpu_per("msg", messages, phase)
}

/// [`with_cpu_per_message`] for a phase of `count` operations of another kind, named `unit`.
pub fn with_cpu_per<T>(unit: &str, count: usize, phase: impl FnOnce() -> T) -> (T, String) {
    let before = process_cpu().zip(cpu_by_kind());
    let started = Instant::now();
    let result = phase();
    let wall = started.elapsed();
    let per_unit = match (before, process_cpu().zip(cpu_by_kind())) {
        (Some((total_before, kinds_before)), Some((total_after, kinds_after))) if count > 0 => {
            #[allow(clippy::cast_precision_loss)] // An operation count.
            let micros = |cpu: Duration| cpu.as_secs_f64() * 1e6 / count as f64;
            let total = total_after.saturating_sub(total_before);
            let mut named = Duration::ZERO;
            let mut split = Vec::new();
            let mut runs = Vec::new();
            for ((after, before), kind) in kinds_after.iter().zip(kinds_before).zip(THREAD_KINDS) {
                let used = after.0.saturating_sub(before.0);
                named += used;
                split.push(format!("{kind} {:.1}", micros(used)));
                #[allow(clippy::cast_precision_loss)] // Counts.
                runs.push(format!("{kind} {:.2}", after.1.saturating_sub(before.1) as f64 / count as f64));
            }
            split.push(format!("load {:.1}", micros(total.saturating_sub(named))));
            let cores = total.as_secs_f64() / wall.as_secs_f64().max(1e-9);
            format!(
                "{:.1} µs CPU/{unit} ({}; {cores:.2} cores busy; per {unit}, threads put on a core: {})",
                micros(total),
                split.join(", "),
                runs.join(", ")
            )
        }
        _ => String::new(),
    };
    (result, per_unit)
}

/// Record size of the message benchmarks.
pub const RECORD_BYTES: usize = 128;
/// Records per sync in the ceiling and journal runs.
pub const PER_SYNC: usize = 1000;

/// A rate and latency percentiles.
pub struct Figures {
    pub rate: f64,
    pub p50: Duration,
    pub p99: Duration,
    pub p999: Duration,
    /// Latency at the per-milles of [`CDF_POINTS`] (for plots).
    pub cdf: Vec<Duration>,
    /// Open-loop runs: the 99th percentile of how late the load's sender thread sent an append after
    /// its scheduled time (the latency counts from the scheduled time, so this much of it is the
    /// sender waiting for a core, not the cluster).
    pub sent_late_p99: Option<Duration>,
    /// Open-loop runs: appends refused as busy (a channel's queue full) and sent again.
    pub refused_busy: Option<usize>,
    /// Open-loop runs: where the slowest 1% fell, in time and by leader node (empty for a short run).
    pub slowest: Option<String>,
}

impl Figures {
    /// ", sender late p99 X, N refused busy" for an open-loop run, "" otherwise.
    pub fn open_loop_notes(&self) -> String {
        let late = self.sent_late_p99.map_or_else(String::new, |late| format!(", sender late p99 {late:.2?}"));
        let refused = self.refused_busy.map_or_else(String::new, |n| format!(", {n} refused busy and sent again"));
        late + &refused
    }
}

/// Per-milles at which [`Figures::cdf`] samples the latency distribution.
pub const CDF_POINTS: [usize; 9] = [10, 100, 250, 500, 750, 900, 990, 999, 1000];

/// The `per_mille`-th per-mille of sorted latencies (500 = median).
pub fn percentile(sorted: &[Duration], per_mille: usize) -> Duration {
    sorted[(sorted.len() - 1) * per_mille / 1000]
}

/// `records` in `elapsed`, with the percentiles of `latencies`.
pub fn figures(records: usize, elapsed: Duration, mut latencies: Vec<Duration>) -> Figures {
    latencies.sort();
    Figures {
        rate: records as f64 / elapsed.as_secs_f64(),
        p50: percentile(&latencies, 500),
        p99: percentile(&latencies, 990),
        p999: percentile(&latencies, 999),
        cdf: CDF_POINTS.iter().map(|q| percentile(&latencies, *q)).collect(),
        sent_late_p99: None,
        refused_busy: None,
        slowest: None,
    }
}

/// The disk's physical ceiling: sequential append + `fdatasync` of `PER_SYNC` records of `RECORD_BYTES`,
/// `syncs` times. Latencies are the `fdatasync` calls alone.
pub fn ceiling(dir: &std::path::Path, syncs: usize) -> std::io::Result<Figures> {
    // A fresh file each time: a measure taken again in the same run writes what the first one did.
    let mut file = OpenOptions::new().create(true).write(true).truncate(true).open(dir.join("ceiling.log"))?;
    let chunk = vec![0x5au8; RECORD_BYTES * PER_SYNC];
    let mut latencies = Vec::with_capacity(syncs);
    let started = Instant::now();
    for _ in 0..syncs {
        file.write_all(&chunk)?;
        let t = Instant::now();
        file.sync_data()?;
        latencies.push(t.elapsed());
    }
    Ok(figures(syncs * PER_SYNC, started.elapsed(), latencies))
}
