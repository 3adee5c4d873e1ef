//! The channel machine alone: three replicas, no IO and no store (a durable append completes at once and
//! keeps nothing: the log a replica needs to serve pulls is in its cache), effects carried out synchronously.
//! Records committed per second at 128-byte payloads for append batches of 1, 16 and 256; and the
//! memory an idle, caught-up replica holds (printed once).

use bytes::Bytes;
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use std::collections::VecDeque;
use tidings_channel::machine::{AppendRecord, AppendRequest, ChannelMachine, Effect, MachineConfig, RequestId};
use tidings_store::message::ChannelLogState;
use tidings_types::{ChannelId, ChannelRuntimeMeta, ChannelType, Epoch, LeaderEpoch, NodeId, Seq, Time};

struct Trio {
    machines: Vec<ChannelMachine>,
    now: Time,
    next_request: u64,
}

impl Trio {
    fn new() -> Self {
        let channel = ChannelId::new(ChannelType::GROUP, "bench").unwrap();
        let nodes: Vec<NodeId> = (1..=3).map(NodeId::new).collect();
        let meta = ChannelRuntimeMeta {
            channel: channel.clone(),
            version: 1,
            leader: nodes[0],
            replicas: nodes.clone(),
            isr: nodes.clone(),
            min_isr: 2,
            epoch: Epoch::new(1),
            leader_epoch: LeaderEpoch::new(1),
            write_fence: None,
            retention_through: Seq::new(0),
        };
        let config = MachineConfig { cache_bytes_max: 1 << 20, ..MachineConfig::default() };
        let mut trio = Trio { machines: Vec::new(), now: Time::ZERO, next_request: 0 };
        for (i, node) in nodes.iter().enumerate() {
            let mut machine = ChannelMachine::new(
                channel.clone(),
                *node,
                config.clone(),
                i as u64,
                Time::ZERO,
                ChannelLogState::default(),
                vec![],
            );
            machine.handle_meta(Time::ZERO, meta.clone()).unwrap();
            trio.machines.push(machine);
        }
        trio.settle();
        trio
    }

    /// Carries out every effect until the cluster is quiet; returns how many appends completed.
    fn settle(&mut self) -> usize {
        let mut done = 0;
        let mut queue: VecDeque<(usize, Effect)> = VecDeque::new();
        loop {
            for (i, machine) in self.machines.iter_mut().enumerate() {
                while let Some(effect) = machine.poll_effect() {
                    queue.push_back((i, effect));
                }
            }
            let Some((i, effect)) = queue.pop_front() else { return done };
            match effect {
                Effect::Persist { token, batch } => {
                    drop(batch);
                    self.machines[i].handle_persisted(self.now, token, Ok(()));
                }
                Effect::Send { to, message } => {
                    let sender = NodeId::new(i as u64 + 1);
                    let target = usize::try_from(to.get() - 1).unwrap();
                    self.machines[target].handle_message(self.now, sender, message);
                }
                Effect::AppendDone { .. } => done += 1,
                Effect::Committed { messages, .. } => {
                    for seq in messages {
                        self.machines[i].fanout_finished(seq);
                    }
                }
                _ => {}
            }
        }
    }

    fn append(&mut self, batch: usize, payload: &Bytes) {
        self.next_request += 1;
        let records = (0..batch).map(|_| AppendRecord { idempotency_key: None, payload: payload.clone() }).collect();
        self.machines[0].handle_append(self.now, AppendRequest { id: RequestId(self.next_request), records }).unwrap();
        let done = self.settle();
        assert_eq!(done, 1);
    }
}

fn bench(c: &mut Criterion) {
    let payload = Bytes::from(vec![0x42u8; 128]);
    let mut group = c.benchmark_group("channel_machine");
    for batch in [1usize, 16, 256] {
        group.throughput(Throughput::Elements(batch as u64));
        let mut trio = Trio::new();
        group.bench_with_input(
            BenchmarkId::new("commit, 3 replicas, records per append", batch),
            &batch,
            |b, &batch| b.iter(|| trio.append(batch, &payload)),
        );
    }
    group.finish();
    let trio = Trio::new();
    let idle = &trio.machines[1];
    eprintln!(
        "idle caught-up follower: {} bytes inline + {} bytes cached (cache bound {} bytes)",
        std::mem::size_of::<ChannelMachine>(),
        idle.cached_bytes(),
        MachineConfig::default().cache_bytes_max
    );
}

criterion_group!(benches, bench);
criterion_main!(benches);
