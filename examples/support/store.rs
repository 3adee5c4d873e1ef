//! Message-log runs shared by the benchmark examples: the journal's group commit and sled alone.

use super::{figures, Figures, PER_SYNC, RECORD_BYTES};
use bytes::Bytes;
use std::sync::Arc;
use std::time::Instant;
use tidings::store::message::{JournalLog, LogBatch, LogOp, MessageLog, Record, RecordKind};
use tidings::store::{Keyspace, Kv, KvBatch, SledKv, StoreError};
use tidings::types::{ChannelId, ChannelType, LeaderEpoch, Seq};

/// A benchmark channel id.
pub fn channel(i: usize) -> ChannelId {
    ChannelId::new(ChannelType::GROUP, &format!("bench-{i}")).expect("valid id")
}

/// Group commits a sustained run makes per unit of scale: 1.5 M records, more than the journal's memory
/// table holds (256 MiB, ~1.3 M records), so the run reaches the steady state where staging waits for
/// write-behind.
pub const SUSTAINED_COMMITS: usize = 1_500;

/// Group commits of `PER_SYNC` records, one per channel, cycling through `channels` channels. One thread
/// stages each group (`stage_all`) while two others sync (one's `fdatasync` runs while the other applies
/// its group; at most two groups wait). The node's durable-append workers instead each stage and sync
/// their own round; measured that way here (session 8) the rates were the same or lower (10,000
/// channels 1.43–1.44 M against 1.40–1.65 M records/s). Latency is staging start to sync completion per
/// group.
pub fn journal_run(log: &Arc<JournalLog>, channels: &[ChannelId], next_seq: &mut [u64], commits: usize) -> Figures {
    let payload = Bytes::from(vec![0x42u8; RECORD_BYTES]);
    let (to_syncer, staged) = crossbeam_channel::bounded::<Instant>(1);
    let syncers: Vec<_> = (0..2)
        .map(|_| {
            let log = Arc::clone(log);
            let staged = staged.clone();
            std::thread::spawn(move || {
                let mut latencies = Vec::with_capacity(commits);
                while let Ok(started) = staged.recv() {
                    log.sync().expect("sync");
                    latencies.push(started.elapsed());
                }
                latencies
            })
        })
        .collect();
    let mut cursor = 0;
    let started = Instant::now();
    for _ in 0..commits {
        let t = Instant::now();
        let batch = |i: usize, seq: u64| {
            let record = Record {
                seq: Seq::new(seq),
                kind: RecordKind::Message,
                leader_epoch: LeaderEpoch::new(1),
                idempotency_key: None,
                timestamp_ms: 0,
                payload: payload.clone(),
            };
            LogBatch::new(channels[i].clone(), vec![LogOp::Append(vec![record])])
        };
        // The group, staged as the node's durable-append workers stage theirs: in runs (`stage_all`).
        let mut group: Vec<usize> = (0..PER_SYNC).map(|k| (cursor + k) % channels.len()).collect();
        cursor += PER_SYNC;
        while !group.is_empty() {
            let outcomes = log.stage_all(group.iter().map(|&i| batch(i, next_seq[i])).collect());
            // Busy is the backpressure of a memory table full of records write-behind has not stored yet:
            // staging waited for it; those batches are staged again (the sustained rate is write-behind's
            // rate then). A refused batch stops the run's channel from going further: none is expected.
            let mut again = Vec::new();
            for (i, outcome) in group.into_iter().zip(outcomes) {
                match outcome {
                    Ok(_) => next_seq[i] += 1,
                    Err(StoreError::Busy { .. }) => again.push(i),
                    Err(error) => panic!("stage: {error}"),
                }
            }
            group = again;
        }
        to_syncer.send(t).expect("syncer alive");
    }
    drop(to_syncer);
    let latencies = syncers.into_iter().flat_map(|syncer| syncer.join().expect("syncer")).collect();
    figures(commits * PER_SYNC, started.elapsed(), latencies)
}

/// Sled alone: one key per record, a real fsync per batch of `PER_SYNC`.
pub fn sled_alone(dir: &std::path::Path, batches: usize) -> Figures {
    let kv = SledKv::open(dir.join("sled-alone"), 64 << 20).expect("open sled");
    let payload = vec![0x42u8; RECORD_BYTES];
    let mut latencies = Vec::with_capacity(batches);
    let started = Instant::now();
    for b in 0..batches {
        let t = Instant::now();
        let mut batch = KvBatch::new();
        for r in 0..PER_SYNC {
            let key = [&(r as u64).to_be_bytes()[..], &(b as u64).to_be_bytes()].concat();
            batch.put(Keyspace::MessagePack, key, &payload);
        }
        kv.apply(batch).expect("apply");
        kv.sync().expect("sync");
        latencies.push(t.elapsed());
    }
    figures(batches * PER_SYNC, started.elapsed(), latencies)
}
