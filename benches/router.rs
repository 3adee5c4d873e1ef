//! Router hot paths: hashing a key to its slot, and resolving batches of keys against one snapshot.

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use std::hint::black_box;
use tidings::router::{hash_slot, GroupObservation, HashToSlot, Router};
use tidings::types::{ConfigEpoch, NodeId, Term};

fn keys(n: usize) -> Vec<Vec<u8>> {
    (0..n).map(|i| format!("uid-{i:012}").into_bytes()).collect()
}

fn bench_hash_slot(c: &mut Criterion) {
    let keys = keys(1024);
    let mut group = c.benchmark_group("hash_slot");
    group.throughput(Throughput::Elements(keys.len() as u64));
    group.bench_function("16B keys x1024", |b| {
        b.iter(|| {
            for key in &keys {
                black_box(hash_slot(black_box(key)));
            }
        })
    });
    group.finish();
}

fn bench_resolve_many(c: &mut Criterion) {
    let router = Router::new(HashToSlot::even_split(64).unwrap());
    let table = router.snapshot().hash_to_slot().clone();
    for g in table.groups() {
        let observation = GroupObservation {
            leader: Some(NodeId::new(u64::from(g.get()) % 3 + 1)),
            term: Term::new(3),
            voters: vec![NodeId::new(1), NodeId::new(2), NodeId::new(3)],
            learners: vec![],
            config_epoch: ConfigEpoch::new(1),
        };
        router.observe(g, observation).unwrap();
    }
    let keys = keys(1024);
    let mut group = c.benchmark_group("resolve_many");
    group.throughput(Throughput::Elements(keys.len() as u64));
    group.bench_function("1024 keys, one snapshot", |b| {
        b.iter_batched(
            || router.snapshot(),
            |snapshot| black_box(snapshot.resolve_many(keys.iter().map(Vec::as_slice))),
            BatchSize::SmallInput,
        )
    });
    group.finish();
}

criterion_group!(benches, bench_hash_slot, bench_resolve_many);
criterion_main!(benches);
