//! Message log: a group commit of 1,000 128-byte records over 1,000 channels (one `fdatasync`).

use bytes::Bytes;
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use std::sync::Arc;
use tidings::store::message::{JournalConfig, JournalLog, LogBatch, LogOp, MemoryLog, MessageLog, Record, RecordKind};
use tidings::store::{Kv, SledKv};
use tidings::types::{ChannelId, ChannelType, LeaderEpoch, Seq};

const CHANNELS: usize = 1000;

/// One record for each channel, staged as one run (`stage_all`, as the node's durable workers do), then
/// one sync.
fn group_commit(log: &dyn MessageLog, channels: &[ChannelId], next: &mut [u64], payload: &Bytes) {
    let batches = channels
        .iter()
        .enumerate()
        .map(|(i, channel)| {
            let record = Record {
                seq: Seq::new(next[i]),
                kind: RecordKind::Message,
                leader_epoch: LeaderEpoch::new(1),
                idempotency_key: None,
                timestamp_ms: 0,
                payload: payload.clone(),
            };
            next[i] += 1;
            LogBatch::new(channel.clone(), vec![LogOp::Append(vec![record])])
        })
        .collect();
    for staged in log.stage_all(batches) {
        staged.unwrap();
    }
    log.sync().unwrap();
}

fn bench(c: &mut Criterion) {
    let channels: Vec<ChannelId> =
        (0..CHANNELS).map(|i| ChannelId::new(ChannelType::GROUP, &format!("bench-{i}")).unwrap()).collect();
    let payload = Bytes::from(vec![0x42u8; 128]);
    let mut group = c.benchmark_group("message_log");
    group.throughput(Throughput::Elements(CHANNELS as u64));

    let dir = tempfile::tempdir().unwrap();
    let kv: Arc<dyn Kv> = Arc::new(SledKv::open(dir.path().join("sled"), 64 << 20).unwrap());
    let journal = Arc::new(JournalLog::open(dir.path().join("journal"), kv, JournalConfig::default()).unwrap());
    let _write_behind = journal.start_write_behind();
    let mut next = vec![1u64; CHANNELS];
    group.bench_function("journal: 1000 channels x 1 record + fdatasync", |b| {
        b.iter(|| group_commit(journal.as_ref(), &channels, &mut next, &payload))
    });

    let memory = MemoryLog::new(Default::default());
    let mut next = vec![1u64; CHANNELS];
    group.bench_function("memory twin: 1000 channels x 1 record", |b| {
        b.iter(|| group_commit(&memory, &channels, &mut next, &payload))
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
