//! End-to-end append through the node runtime: three nodes in one process on sled (real fsync) and the
//! in-process transport, 128-byte messages to the channel's leader, each iteration waiting for commit
//! (MinISR 2 of 3). Closed loop with one append in flight, and a burst of 256 over 100 channels.
#![allow(clippy::disallowed_methods)] // The shared cluster support reads the clock for its own figures.

#[path = "../examples/support/mod.rs"]
mod support;

use bytes::Bytes;
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use support::cluster::Cluster;
use tidings::types::{ChannelId, ChannelType};

fn bench(c: &mut Criterion) {
    let dir = tempfile::tempdir().expect("temp dir");
    let cluster = Cluster::start(dir.path(), false);
    let channels: Vec<ChannelId> =
        (0..100).map(|i| ChannelId::new(ChannelType::GROUP, &format!("b{i}")).expect("channel id")).collect();
    cluster.create(&channels);
    let payload = Bytes::from(vec![0x42u8; support::RECORD_BYTES]);
    // Warm up: every channel active on its replicas.
    for channel in &channels {
        cluster.append(channel, &payload).wait().expect("committed");
    }
    let mut group = c.benchmark_group("node_append");
    group.sample_size(20);
    group.throughput(Throughput::Elements(1));
    group.bench_function("one append in flight, 1 channel", |b| {
        b.iter(|| cluster.append(&channels[0], &payload).wait().expect("committed"))
    });
    group.throughput(Throughput::Elements(256));
    group.bench_function("256 appends over 100 channels", |b| {
        b.iter(|| {
            let handles: Vec<_> = (0..256).map(|i| cluster.append(&channels[i % channels.len()], &payload)).collect();
            for handle in handles {
                handle.wait().expect("committed");
            }
        })
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
