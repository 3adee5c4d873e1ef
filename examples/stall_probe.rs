#![allow(clippy::disallowed_methods, missing_docs, dead_code)]
#[path = "support/mod.rs"]
mod support;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use support::cluster::{max_rate, paced, Cluster};
use tidings::types::{ChannelId, ChannelType};
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = Cluster::start(dir.path(), false);
    let channels = vec![ChannelId::new(ChannelType::GROUP, "c1-0").unwrap()];
    cluster.create(&channels);
    max_rate(&cluster, &channels, 1024, 1024);
    let top = max_rate(&cluster, &channels, 20_000, 256);
    println!("top {:.0}", top.rate);
    let stop = AtomicBool::new(false);
    let rate: f64 = support::flag_value("--rate").unwrap_or(top.rate / 2.0);
    let leader = cluster.leader(&channels[0]).clone();
    let samples = std::thread::scope(|s| {
        let probe = s.spawn(|| {
            let mut out = Vec::new();
            let t0 = Instant::now();
            while !stop.load(Ordering::Relaxed) {
                let before = t0.elapsed();
                let st = leader.channel_status(&channels[0]).unwrap().unwrap();
                let after = t0.elapsed();
                let syncs: Vec<u64> = cluster.nodes.iter().map(|n| n.message_log_stats().syncs).collect();
                let wbs: Vec<u64> = cluster.nodes.iter().map(|n| n.message_log_stats().write_behinds).collect();
                out.push((
                    before,
                    after,
                    st.log_end.get(),
                    st.durable_last.get(),
                    st.hw.get(),
                    st.replicas.iter().map(|r| r.match_seq.get()).collect::<Vec<_>>(),
                    st.pending_appends,
                    syncs,
                    wbs,
                ));
                std::thread::sleep(Duration::from_micros(200));
            }
            out
        });
        let half = paced(&cluster, &channels, rate, Duration::from_secs(3));
        stop.store(true, Ordering::Relaxed);
        println!("half p50 {:?} p99 {:?} {}", half.p50, half.p99, half.slowest.clone().unwrap_or_default());
        probe.join().unwrap()
    });
    println!("{} samples", samples.len());
    let mut last_hw = (Duration::ZERO, 0u64);
    for (k, s) in samples.iter().enumerate() {
        if s.4 != last_hw.1 {
            let gap = s.0.saturating_sub(last_hw.0);
            if gap > Duration::from_millis(4) {
                println!("== hw stuck {:?} until {:?}", gap, s.0);
                let from = samples.iter().position(|x| x.0 >= last_hw.0).unwrap_or(0);
                for x in &samples[from.saturating_sub(1)..=k] {
                    println!(
                        "  t {:>9.3?} (+{:>7.3?}) end {} durable {} hw {} match {:?} pending {} syncs {:?} wb {:?}",
                        x.0,
                        x.1 - x.0,
                        x.2,
                        x.3,
                        x.4,
                        x.5,
                        x.6,
                        x.7,
                        x.8
                    );
                }
            }
            last_hw = (s.0, s.4);
        }
    }
    let mut lat: Vec<Duration> = samples.iter().map(|s| s.1 - s.0).collect();
    lat.sort();
    println!(
        "probe call p50 {:?} p99 {:?} max {:?}",
        lat[lat.len() / 2],
        lat[lat.len() * 99 / 100],
        lat.last().unwrap()
    );
}
