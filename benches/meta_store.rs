//! A metadata write batch followed by a durable sync, on sled with its real fsync.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use std::sync::Arc;
use tidings::store::{MetaSpace, MetaStore, MetaWriteBatch, SledKv};
use tidings::types::{GroupId, HashSlot};

fn bench_write_and_sync(c: &mut Criterion) {
    let dir = tempfile::tempdir().unwrap();
    let kv = Arc::new(SledKv::open(dir.path(), 64 << 20).unwrap());
    let store = MetaStore::new(kv);
    let mut group = c.benchmark_group("meta_store");
    for records in [1usize, 64, 512] {
        group.throughput(Throughput::Elements(records as u64));
        let mut applied = 0u64;
        group.bench_function(format!("batch of {records} x 64B + fsync"), |b| {
            b.iter(|| {
                let mut batch = MetaWriteBatch::new();
                for i in 0..records {
                    let slot = HashSlot::new(u16::try_from(i % 256).unwrap()).unwrap();
                    batch.put(MetaSpace::slot(GroupId::new(1), slot), format!("user/{applied}/{i}"), vec![7u8; 64]);
                }
                applied += 1;
                batch.set_applied(GroupId::new(1), applied);
                store.write(&batch).unwrap();
                store.sync().unwrap();
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench_write_and_sync);
criterion_main!(benches);
