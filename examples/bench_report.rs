//! The benchmark report: `cargo run --release --example bench_report` (`--quick` for a shorter run,
//! `--max-channels N` to skip the larger scenarios). Everything is measured in one process and one run
//! on this machine, side by side, so the ratios hold on a noisy machine:
//!
//! 1. the physical ceiling: sequential append + `fdatasync`, 128-byte records, 1,000 per sync;
//! 2. the store: the journal's group commit over 10,000 channels, the sustained rate with sled
//!    write-behind running, and sled alone with a key per record;
//! 3. tidings, 3 nodes in one process on one disk: committed messages/s and p50/p99/p99.9 commit latency
//!    at 1, 100, 10,000 and 100,000 channels (idle replicas evicted after 5 s), plus p99 at half rate;
//! 4. one raft-rs group per channel (`support/raft_baseline.rs`) on the same storage, same workload, at
//!    1, 100 and 10,000 channels (100,000 raft groups do not fit this machine's run time);
//! 5. memory, as live heap bytes (jemalloc's statistics): per active channel replica, per evicted idle
//!    channel replica, per raft group replica (what a slot group costs). Each measure starts from a quiet
//!    cluster (earlier replicas evicted, write-behind done) and includes what sled's page cache grew by
//!    meanwhile, up to its capacity (64 MiB per node; `TIDINGS_SLED_CACHE_MB=N` sets it);
//!
//! then the ratios (tidings / (ceiling / 3), tidings / raft-per-channel) against the targets, a CSV
//! (`bench_report.csv`) and two plots (`bench_report_throughput.svg`, `bench_report_latency.svg`) in the
//! current directory.
#![allow(clippy::disallowed_methods)] // A benchmark tool reads the clock.
#![allow(clippy::cast_precision_loss)] // Figures are printed, not computed on.

#[path = "support/mod.rs"]
mod support;

use std::fmt::Write as _;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};
use support::cluster::{max_rate, paced, Cluster, CLIENTS};
use support::raft_baseline::RaftPerChannel;
use support::store::{channel, journal_run, sled_alone, SUSTAINED_COMMITS};
use support::{ceiling, env_value, flag_value, with_cpu_per_message, Figures, CDF_POINTS, PER_SYNC, RECORD_BYTES};
use tidings::store::message::{JournalConfig, JournalLog};
use tidings::store::{Kv, SledKv};
use tidings::types::{ChannelId, ChannelType};

/// Live heap bytes (jemalloc's `stats.allocated`, refreshed).
fn live() -> usize {
    let _ = tikv_jemalloc_ctl::epoch::advance();
    tikv_jemalloc_ctl::stats::allocated::read().unwrap_or(0)
}

/// One line of the report.
struct Row {
    section: &'static str,
    scenario: String,
    rate: Option<f64>,
    figures: Option<Figures>,
    note: String,
}

impl Row {
    /// A measured rate with its latency figures.
    fn measured(section: &'static str, scenario: impl Into<String>, figures: Figures, note: String) -> Row {
        Row { section, scenario: scenario.into(), rate: Some(figures.rate), figures: Some(figures), note }
    }
}

/// The run's options, from the command line.
struct Options {
    /// `--quick`: 1 instead of 3, a multiplier of the phases' lengths.
    scale: usize,
    /// `--max-channels N`: scenarios with more channels are skipped.
    max_channels: usize,
}

/// The disk's physical ceiling, which the ratios are taken against.
struct Disk {
    /// Records per second, appended and `fdatasync`ed 1,000 at a time.
    rate: f64,
    /// The 99th percentile of one `fdatasync`.
    p99: Duration,
}

/// What the report has measured so far; each phase adds its rows.
#[derive(Default)]
struct Report {
    rows: Vec<Row>,
    /// (what, live heap bytes per replica).
    memory: Vec<(&'static str, f64)>,
    /// (channels, full rate, half-rate p99).
    tidings_rates: Vec<(usize, f64, Duration)>,
    /// (channels, rate) of one raft group per channel.
    baseline_rates: Vec<(usize, f64)>,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let quick = std::env::args().any(|a| a == "--quick");
    let options =
        Options { scale: if quick { 1 } else { 3 }, max_channels: flag_value("--max-channels").unwrap_or(100_000) };
    let dir = tempfile::tempdir()?;
    println!("bench_report: {RECORD_BYTES}-byte messages, data in {}", dir.path().display());
    let mut report = Report::default();
    let disk = report.ceiling(dir.path(), &options)?;
    report.store(dir.path(), &options)?;
    report.tidings(dir.path(), &options);
    report.raft_per_channel(dir.path(), &options);
    report.print_ratios(&disk);
    report.print_memory(dir.path());
    report.write_files(disk.rate / 3.0)?;
    Ok(())
}

impl Report {
    /// 1. The ceiling: sequential append + `fdatasync`.
    fn ceiling(&mut self, dir: &Path, options: &Options) -> std::io::Result<Disk> {
        let disk = ceiling(dir, 100 * options.scale)?;
        println!(
            "ceiling: {:.0} records/s (ceiling/3 = {:.0}), fdatasync p99 {:.2?}",
            disk.rate,
            disk.rate / 3.0,
            disk.p99
        );
        let measured = Disk { rate: disk.rate, p99: disk.p99 };
        self.rows.push(Row::measured("ceiling", "append+fdatasync", disk, String::new()));
        Ok(measured)
    }

    /// 2. The store: the journal's group commit, sustained with write-behind, and sled alone.
    fn store(&mut self, dir: &Path, options: &Options) -> Result<(), Box<dyn std::error::Error>> {
        let scale = options.scale;
        let kv: Arc<dyn Kv> = Arc::new(SledKv::open(dir.join("store-sled"), 256 << 20)?);
        let config = JournalConfig { write_behind_interval: Duration::from_secs(3600), ..JournalConfig::default() };
        let log = Arc::new(JournalLog::open(dir.join("store-journal"), kv, config)?);
        let channels: Vec<ChannelId> = (0..10_000).map(channel).collect();
        let mut next = vec![1u64; channels.len()];
        // As store_bench measures it: spare segments ready, and one untimed pass over the channels first.
        log.fill_spares()?;
        journal_run(&log, &channels, &mut next, channels.len().div_ceil(PER_SYNC));
        let journal = journal_run(&log, &channels, &mut next, 50 * scale);
        println!("store: journal group commit over 10,000 channels {:.0} records/s", journal.rate);
        self.rows.push(Row::measured("store", "journal 10k channels", journal, String::new()));
        let background = log.start_write_behind();
        let sustained = journal_run(&log, &channels, &mut next, SUSTAINED_COMMITS * scale);
        drop(background);
        println!("store: sustained with sled write-behind {:.0} records/s", sustained.rate);
        self.rows.push(Row::measured("store", "sustained with write-behind", sustained, String::new()));
        let sled = sled_alone(dir, 10 * scale);
        println!("store: sled alone, key per record {:.0} records/s", sled.rate);
        self.rows.push(Row::measured("store", "sled alone", sled, String::new()));
        Ok(())
    }

    /// 3. tidings at each channel count, and 5. memory per active and per evicted channel.
    fn tidings(&mut self, dir: &Path, options: &Options) {
        let cluster = Cluster::start_with(dir, false, |config| config.channel_idle_evict = Duration::from_secs(5));
        for (count, messages) in [(1usize, 20_000usize), (100, 50_000), (10_000, 60_000), (100_000, 100_000)] {
            if count <= options.max_channels {
                self.tidings_scenario(&cluster, count, messages * options.scale.min(2), options.scale);
            }
        }
    }

    /// One tidings scenario: `count` fresh channels, `sent` messages at full rate, then half of that rate
    /// paced.
    fn tidings_scenario(&mut self, cluster: &Cluster, count: usize, sent: usize, scale: usize) {
        let channels: Vec<ChannelId> = (0..count)
            .map(|i| ChannelId::new(ChannelType::GROUP, &format!("r{count}-{i}")).expect("channel id"))
            .collect();
        if count >= 10_000 {
            // Memory is measured from a quiet start: the earlier scenarios' replicas evicted (their record
            // caches would be freed during the measure — for the 100,000-channel scenario, the 10,000
            // active replicas before it, whose freeing once hid most of what the evicted ones cost) and
            // the journals' memory tables empty (records waiting for write-behind are not the replicas'
            // memory).
            cluster.wait_until_evicted(0);
            cluster.wait_for_write_behind();
        }
        let before = live();
        let t = Instant::now();
        cluster.create(&channels);
        let created = t.elapsed();
        max_rate(cluster, &channels, channels.len().max(CLIENTS * 64), 1024);
        if count == 100_000 {
            // The steady state of this scenario: a channel's next message comes after the eviction bound,
            // so each meets evicted replicas — not however many the warm-up's tail left active (a faster
            // warm-up once made the phase meet fewer activations and read twice the rate).
            cluster.wait_until_evicted(3 * 1_000);
        }
        if count == 10_000 {
            cluster.wait_for_write_behind();
            let per = (live().saturating_sub(before)) as f64 / (count * 3) as f64;
            println!("memory: {per:.0} B per active channel replica");
            self.memory.push(("per active channel replica", per));
        }
        let in_flight = if count == 1 { 256 } else { 2048 };
        let (top, cpu) = with_cpu_per_message(sent, || max_rate(cluster, &channels, sent, in_flight));
        let paced_for = Duration::from_secs(2 * scale as u64);
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)] // A count of messages sent.
        let sent_half = (top.rate / 2.0 * paced_for.as_secs_f64()) as usize;
        let (half, cpu_half) = with_cpu_per_message(sent_half, || paced(cluster, &channels, top.rate / 2.0, paced_for));
        println!(
            "tidings {count:>6} channels (created in {created:.1?}): {:>7.0} msg/s ({cpu}), p50 {:.2?} p99 {:.2?} p99.9 {:.2?}; half rate p99 {:.2?}{} ({cpu_half})",
            top.rate, top.p50, top.p99, top.p999, half.p99, half.open_loop_notes()
        );
        self.tidings_rates.push((count, top.rate, half.p99));
        if count == 100_000 {
            // Wait for idle eviction: (nearly) every replica of these channels leaves memory.
            cluster.wait_until_evicted(3 * 1_000);
            cluster.wait_for_write_behind();
            let per = (live().saturating_sub(before)) as f64 / (count * 3) as f64;
            let held: usize = cluster.nodes.iter().map(|n| n.message_log_stats().channels_in_memory).sum();
            println!("memory: {per:.0} B per evicted idle channel replica ({held} channels left in the message logs' memory)");
            self.memory.push(("per evicted idle channel replica", per));
        }
        let note = format!("half-rate p99 {:.2?}{}; {cpu}; at half rate {cpu_half}", half.p99, half.open_loop_notes());
        self.rows.push(Row::measured("tidings", format!("{count} channels"), top, note));
    }

    /// 4. One raft group per channel; memory per raft group replica.
    fn raft_per_channel(&mut self, dir: &Path, options: &Options) {
        for (count, messages) in [(1u32, 20_000usize), (100, 50_000), (10_000, 60_000)] {
            if count as usize > options.max_channels {
                continue;
            }
            let before = live();
            let t = Instant::now();
            let mut baseline = RaftPerChannel::start(dir, count);
            let started = t.elapsed();
            if count == 10_000 {
                let per = (live().saturating_sub(before)) as f64 / (f64::from(count) * 3.0);
                self.memory.push(("per raft group replica (= per slot group replica)", per));
            }
            let in_flight = if count == 1 { 256 } else { 2048 };
            let sent = messages * options.scale.min(2);
            let (f, cpu) = with_cpu_per_message(sent, || baseline.run(sent, in_flight));
            println!(
                "raft-per-channel {count:>6} groups (elected in {started:.1?}): {:>7.0} msg/s ({cpu}), p50 {:.2?} p99 {:.2?} p99.9 {:.2?}",
                f.rate, f.p50, f.p99, f.p999
            );
            self.baseline_rates.push((count as usize, f.rate));
            self.rows.push(Row::measured("raft-per-channel", format!("{count} channels"), f, cpu));
        }
        self.rows.push(Row {
            section: "raft-per-channel",
            scenario: "100000 channels".into(),
            rate: None,
            figures: None,
            note: "not run: 300,000 raft groups on 2 cores".into(),
        });
    }

    /// The ratios against the targets.
    fn print_ratios(&self, disk: &Disk) {
        println!();
        let fair = disk.rate / 3.0;
        for (count, rate, half_p99) in &self.tidings_rates {
            let vs_raft = self.baseline_rates.iter().find(|(c, _)| c == count).map(|(_, r)| rate / r);
            println!(
                "{count:>6} channels: tidings {:>5.1}% of ceiling/3, {} raft-per-channel; half-rate p99 {:.1}x fdatasync p99",
                100.0 * rate / fair,
                vs_raft.map_or("-".to_string(), |x| format!("{x:.2}x")),
                half_p99.as_secs_f64() / disk.p99.as_secs_f64(),
            );
        }
        println!("targets: 10,000 channels >= 25% of ceiling/3 and >= 3x raft-per-channel; 1 channel >= 1x; 100,000 >= half of 10,000; half-rate p99 <= 4x fdatasync p99");
    }

    /// The memory figures against their targets (and into the CSV).
    fn print_memory(&mut self, dir: &Path) {
        for (what, bytes) in &self.memory {
            println!("memory: {what}: {bytes:.0} bytes of live heap");
            self.rows.push(Row {
                section: "memory",
                scenario: (*what).into(),
                rate: Some(*bytes),
                figures: None,
                note: "bytes".into(),
            });
        }
        println!("targets: evicted idle channel <= 256 B; active channel <= 4 KiB plus configured caches");
        println!(
            "(the channel figures include what sled's page cache grew by meanwhile, up to its capacity of {} MiB per node: \
             TIDINGS_SLED_CACHE_MB=2 leaves it out)",
            env_value::<u64>("TIDINGS_SLED_CACHE_MB").unwrap_or(tidings::StorageOptions::new(dir).sled_cache_bytes >> 20)
        );
    }

    /// The CSV and the two plots, in the current directory.
    fn write_files(&self, fair: f64) -> std::io::Result<()> {
        write_csv(&self.rows)?;
        std::fs::write("bench_report_throughput.svg", throughput_svg(&self.tidings_rates, &self.baseline_rates, fair))?;
        std::fs::write("bench_report_latency.svg", latency_svg(&self.rows))?;
        println!("wrote bench_report.csv, bench_report_throughput.svg, bench_report_latency.svg");
        Ok(())
    }
}

fn write_csv(rows: &[Row]) -> std::io::Result<()> {
    let mut out = String::from("section,scenario,rate,p50_us,p99_us,p999_us,note\n");
    for row in rows {
        let us = |d: Duration| d.as_micros().to_string();
        let (p50, p99, p999) = row
            .figures
            .as_ref()
            .map_or((String::new(), String::new(), String::new()), |f| (us(f.p50), us(f.p99), us(f.p999)));
        let rate = row.rate.map_or(String::new(), |r| format!("{r:.0}"));
        let _ = writeln!(out, "{},{},{rate},{p50},{p99},{p999},{}", row.section, row.scenario, row.note);
    }
    std::fs::write("bench_report.csv", out)
}

/// One plotted line: name, colour, points.
type Series<'a> = (&'a str, &'a str, Vec<(f64, f64)>);

/// A line chart as SVG: `series` of (name, colour, points), axes log-scaled as asked.
fn svg_chart(title: &str, x_label: &str, y_label: &str, series: &[Series<'_>], log_x: bool, log_y: bool) -> String {
    let (w, h, left, bottom, top, right) = (720.0, 420.0, 80.0, 50.0, 40.0, 180.0);
    let tx = |x: f64| if log_x { x.max(1e-9).log10() } else { x };
    let ty = |y: f64| if log_y { y.max(1e-9).log10() } else { y };
    let points: Vec<(f64, f64)> = series.iter().flat_map(|(_, _, p)| p.iter().map(|(x, y)| (tx(*x), ty(*y)))).collect();
    let (min_x, max_x) = points.iter().fold((f64::MAX, f64::MIN), |(a, b), (x, _)| (a.min(*x), b.max(*x)));
    let (min_y, max_y) = points.iter().fold((f64::MAX, f64::MIN), |(a, b), (_, y)| (a.min(*y), b.max(*y)));
    let span = |a: f64, b: f64| if (b - a).abs() < 1e-9 { 1.0 } else { b - a };
    let px = |x: f64| left + (tx(x) - min_x) / span(min_x, max_x) * (w - left - right);
    let py = |y: f64| h - bottom - (ty(y) - min_y) / span(min_y, max_y) * (h - top - bottom);
    let mut svg = format!(
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12"><rect width="100%" height="100%" fill="white"/><text x="{}" y="24" font-size="15">{title}</text><line x1="{left}" y1="{}" x2="{}" y2="{}" stroke="black"/><line x1="{left}" y1="{top}" x2="{left}" y2="{}" stroke="black"/><text x="{}" y="{}">{x_label}</text><text x="12" y="{}" transform="rotate(-90 12 {})">{y_label}</text>"#,
        left,
        h - bottom,
        w - right,
        h - bottom,
        h - bottom,
        left + 200.0,
        h - 12.0,
        h / 2.0,
        h / 2.0
    );
    for (x, y) in [(min_x, min_y), (max_x, max_y)] {
        let raw = |v: f64, log: bool| if log { 10f64.powf(v) } else { v };
        let _ = write!(
            svg,
            r#"<text x="{:.0}" y="{:.0}">{:.3}</text>"#,
            left + (x - min_x) / span(min_x, max_x) * (w - left - right) - 10.0,
            h - bottom + 16.0,
            raw(x, log_x)
        );
        let _ = write!(
            svg,
            r#"<text x="4" y="{:.0}">{:.3}</text>"#,
            h - bottom - (y - min_y) / span(min_y, max_y) * (h - top - bottom) + 4.0,
            raw(y, log_y)
        );
    }
    for (i, (name, colour, pts)) in series.iter().enumerate() {
        let path: Vec<String> = pts.iter().map(|(x, y)| format!("{:.1},{:.1}", px(*x), py(*y))).collect();
        let _ =
            write!(svg, r#"<polyline fill="none" stroke="{colour}" stroke-width="2" points="{}"/>"#, path.join(" "));
        for (x, y) in pts {
            let _ = write!(svg, r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{colour}"/>"#, px(*x), py(*y));
        }
        let ly = top + 20.0 * i as f64;
        let _ = write!(
            svg,
            r#"<rect x="{}" y="{}" width="12" height="12" fill="{colour}"/><text x="{}" y="{}">{name}</text>"#,
            w - right + 10.0,
            ly,
            w - right + 28.0,
            ly + 10.0
        );
    }
    svg.push_str("</svg>\n");
    svg
}

fn throughput_svg(tidings: &[(usize, f64, Duration)], baseline: &[(usize, f64)], fair: f64) -> String {
    let t: Vec<(f64, f64)> = tidings.iter().map(|(c, r, _)| (*c as f64, *r)).collect();
    let b: Vec<(f64, f64)> = baseline.iter().map(|(c, r)| (*c as f64, *r)).collect();
    let xs: Vec<f64> = t.iter().chain(&b).map(|(x, _)| *x).collect();
    let (lo, hi) = xs.iter().fold((f64::MAX, f64::MIN), |(a, b), x| (a.min(*x), b.max(*x)));
    let ceiling = vec![(lo, fair), (hi, fair)];
    svg_chart(
        "Committed messages/s vs channels (3 nodes, one disk)",
        "channels (log)",
        "msg/s (log)",
        &[("tidings", "#1f77b4", t), ("raft per channel", "#d62728", b), ("ceiling / 3", "#7f7f7f", ceiling)],
        true,
        true,
    )
}

fn latency_svg(rows: &[Row]) -> String {
    let series: Vec<(String, Vec<(f64, f64)>)> = rows
        .iter()
        .filter(|r| r.section == "tidings")
        .filter_map(|r| {
            let f = r.figures.as_ref()?;
            let pts = CDF_POINTS.iter().zip(&f.cdf).map(|(q, d)| (d.as_secs_f64() * 1e3, *q as f64 / 1000.0)).collect();
            Some((r.scenario.clone(), pts))
        })
        .collect();
    let colours = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd"];
    let named: Vec<Series<'_>> =
        series.iter().zip(colours).map(|((name, pts), c)| (name.as_str(), c, pts.clone())).collect();
    svg_chart("tidings commit latency CDF at full load", "latency ms (log)", "fraction", &named, true, false)
}
