//! Message-log figures, measured in one run on this machine: `cargo run --release --example store_bench`.
//!
//! 1. the physical ceiling: sequential append + `fdatasync`, 128-byte records, 1,000 per sync, and the
//!    disk's `fdatasync` latency;
//! 2. the journal's durable append rate: group commits of 1,000 records spread over 1,000 and over 10,000
//!    channels (one record per channel per commit), write-behind idle, after one untimed pass over the
//!    channels (the steady rate, without each channel's one-off set-up), with spare journal segments
//!    ready (`JournalLog::fill_spares`), as write-behind's recycling keeps them under steady load;
//! 3. the sustained rate with sled write-behind running in the background (steady state: long enough to
//!    fill the memory table several times, so staging waits for write-behind);
//! 4. sled alone with one key per record and a real fsync per batch of 1,000, for contrast;
//!
//! and the ratios to the ceiling. The disk's speed drifts over a run (here: 1.5 to 3.1 M records/s from one
//! minute to the next), so the ceiling is measured three times — first, between the journal runs and the
//! sustained run, and last — and the ratios use the median. `--quick` runs each part shorter.
#![allow(clippy::disallowed_methods)] // A benchmark tool reads the clock.

#[path = "support/mod.rs"]
mod support;

use std::sync::Arc;
use std::time::Duration;
use support::store::{channel, journal_run, sled_alone, SUSTAINED_COMMITS};
use support::{ceiling, PER_SYNC, RECORD_BYTES};
use tidings::store::message::{JournalConfig, JournalLog};
use tidings::store::{Kv, SledKv};
use tidings::types::ChannelId;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let quick = std::env::args().any(|a| a == "--quick");
    let scale = if quick { 1 } else { 4 };
    let dir = tempfile::tempdir()?;
    println!("store_bench: {RECORD_BYTES}-byte records, {PER_SYNC} per sync, data in {}", dir.path().display());

    let mut ceilings = vec![measure_ceiling(dir.path(), scale)?];

    let kv: Arc<dyn Kv> = Arc::new(SledKv::open(dir.path().join("sled"), 256 << 20)?);
    let config = JournalConfig { write_behind_interval: Duration::from_secs(3600), ..JournalConfig::default() };
    let log = Arc::new(JournalLog::open(dir.path().join("journal"), kv.clone(), config)?);
    // Spare segments ready, as write-behind's recycling keeps them under steady load (write-behind is
    // idle in the journal runs, so nothing is recycled here).
    log.fill_spares()?;
    let mut rows = Vec::new();
    for count in [1_000usize, 10_000] {
        let channels: Vec<ChannelId> = (0..count).map(|i| channel(count * 10 + i)).collect();
        let mut next = vec![1u64; count];
        // One untimed pass first, a record per channel: what is measured is the steady rate of channels the
        // log already knows, not the one-off set-up of each channel's state and tables.
        journal_run(&log, &channels, &mut next, count.div_ceil(PER_SYNC));
        let f = journal_run(&log, &channels, &mut next, 100 * scale);
        println!(
            "journal  ({count:>6} channels)           {:>10.0} records/s   commit    p50 {:>7.1?} p99 {:>7.1?}",
            f.rate, f.p50, f.p99
        );
        rows.push((count, f.rate));
        log.write_behind()?;
        log.fill_spares()?;
    }

    ceilings.push(measure_ceiling(dir.path(), scale)?);

    let sustained_channels: Vec<ChannelId> = (0..10_000).map(|i| channel(1_000_000 + i)).collect();
    let mut next = vec![1u64; sustained_channels.len()];
    let background = log.start_write_behind();
    let sustained = journal_run(&log, &sustained_channels, &mut next, SUSTAINED_COMMITS * scale);
    drop(background);
    let stats = log.stats();
    println!(
        "sustained (10,000 channels, sled w-b)  {:>10.0} records/s   commit    p50 {:>7.1?} p99 {:>7.1?}   ({} write-behinds, {} segments deleted)",
        sustained.rate, sustained.p50, sustained.p99, stats.write_behinds, stats.segments_deleted
    );

    let sled = sled_alone(dir.path(), 10 * scale);
    println!(
        "sled alone (key per record + fsync)    {:>10.0} records/s   batch     p50 {:>7.1?} p99 {:>7.1?}",
        sled.rate, sled.p50, sled.p99
    );

    ceilings.push(measure_ceiling(dir.path(), scale)?);

    ceilings.sort_by(|a, b| a.total_cmp(b));
    let ceiling = ceilings[1];
    println!();
    println!("ceiling: median of three {ceiling:.0} records/s (range {:.0} to {:.0})", ceilings[0], ceilings[2]);
    for (count, rate) in rows {
        println!("journal at {count:>6} channels / ceiling   = {:>5.1}%  (target >= 50%)", 100.0 * rate / ceiling);
    }
    println!("sustained at 10,000 channels / ceiling = {:>5.1}%  (target >= 25%)", 100.0 * sustained.rate / ceiling);
    println!("sled alone / ceiling                   = {:>5.1}%", 100.0 * sled.rate / ceiling);
    Ok(())
}

/// One measure of the ceiling, printed; returns its rate.
fn measure_ceiling(dir: &std::path::Path, scale: usize) -> std::io::Result<f64> {
    let figures = ceiling(dir, 100 * scale)?;
    println!(
        "ceiling  (append + fdatasync)          {:>10.0} records/s   fdatasync p50 {:>7.1?} p99 {:>7.1?}",
        figures.rate, figures.p50, figures.p99
    );
    Ok(figures.rate)
}
