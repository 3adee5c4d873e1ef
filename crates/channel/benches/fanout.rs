//! Post-commit fanout planning: one message to a group of 10,000 and of 100,000 members (10% online),
//! pages of 1,000, plans of up to 500 members; throughput in members paged.

#[path = "support/fanout_driver.rs"]
mod fanout_driver;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use fanout_driver::{fan_out, member_store};

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("fanout_planning");
    group.sample_size(10);
    for members in [10_000usize, 100_000] {
        let store = member_store(members);
        group.throughput(Throughput::Elements(members as u64));
        group.bench_function(format!("{members} members"), |b| {
            b.iter(|| assert_eq!(fan_out(&store).located, members));
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
