//! The in-process 3-node cluster the benchmark examples drive, and its closed- and open-loop load.

use super::{env_value, figures, Figures, RECORD_BYTES};
use bytes::Bytes;
use crossbeam_channel::RecvTimeoutError;
use std::collections::{BTreeSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tidings::channel::machine::AppendRecord;
use tidings::mesh::InProcessMesh;
use tidings::node::{NodeConfig, NodeError, Remedy};
use tidings::slot::model::{ChannelFlags, ChannelInfo, Uid};
use tidings::types::{ChannelId, NodeId};
use tidings::{AppendHandle, Node, StorageOptions};

/// Client threads submitting appends.
pub const CLIENTS: usize = 4;

pub struct Cluster {
    pub ids: Vec<NodeId>,
    pub nodes: Vec<Arc<Node>>,
    /// Appends go through `append_from` with these many senders in turn (their uids `u0`, `u1`, ...), so
    /// each one pays for the sender check (banned? on the channel's deny list?); `None`: plain `append`.
    senders: Option<(u64, AtomicU64)>,
    _mesh: Arc<InProcessMesh>,
}

impl Cluster {
    pub fn start(root: &std::path::Path, tuned: bool) -> Cluster {
        Self::start_with(root, tuned, |_| {})
    }

    /// Like [`Cluster::start`], with `tweak` applied to every node's configuration.
    pub fn start_with(root: &std::path::Path, tuned: bool, tweak: impl Fn(&mut NodeConfig)) -> Cluster {
        let ids: Vec<NodeId> = (1..=3).map(NodeId::new).collect();
        let mesh = InProcessMesh::new();
        let nodes = ids
            .iter()
            .map(|id| {
                let mut config = NodeConfig::new(*id, ids.clone());
                if let Some(reactors) = env_value("TIDINGS_REACTORS") {
                    config.reactors = reactors;
                }
                if tuned {
                    // Quieter idle channels: followers go idle after one empty pull (parked 3 s, the
                    // default) and then pull every 4 s (a hint wakes them at once when data arrives).
                    config.machine.idle_after_empty_pulls = 1;
                    config.machine.idle_pull_interval = Duration::from_secs(4);
                    // Such a follower is silent for up to 3 + 4 s: it must still count as alive.
                    config.machine.isr_alive = Duration::from_secs(10);
                    // HW news waits as long as the long poll (a shorter hold answers parked pulls from
                    // timers: see `MachineConfig::hw_notify_delay`).
                    config.machine.hw_notify_delay = config.machine.pull_park;
                }
                // A/B knobs: they win over `tuned`.
                if let Some(ms) = env_value("TIDINGS_HW_NOTIFY_MS") {
                    config.machine.hw_notify_delay = Duration::from_millis(ms);
                }
                if let Some(ms) = env_value("TIDINGS_PULL_PARK_MS") {
                    // The defaults' margins stay: the pull timeout 2 s past the park, the alive window
                    // 3 s past a healthy idle follower's silence (so the node starts with any park).
                    config.machine.pull_park = Duration::from_millis(ms);
                    config.machine.pull_timeout = config.machine.pull_park + Duration::from_secs(2);
                    config.machine.isr_alive = config.machine.healthy_silence() + Duration::from_secs(3);
                }
                if let Some(pulls) = env_value("TIDINGS_IDLE_AFTER_EMPTY_PULLS") {
                    config.machine.idle_after_empty_pulls = pulls;
                }
                if let Some(ms) = env_value("TIDINGS_NODE_DOWN_AFTER_MS") {
                    // For runs on a much slower host (under callgrind, ~50x): pings late by more than the
                    // default 1.5 s would fail channels over in the middle of the measurement.
                    config.controller.node_down_after = Duration::from_millis(ms);
                }
                tweak(&mut config);
                let mut storage = StorageOptions::new(root.join(format!("node-{id}")));
                if tuned {
                    // Fewer, larger sled packs when each channel gets a few messages per second.
                    storage.journal.write_behind_interval = Duration::from_secs(30);
                }
                if let Some(mb) = env_value::<u64>("TIDINGS_SLED_CACHE_MB") {
                    storage.sled_cache_bytes = mb << 20;
                }
                if let Some(ms) = env_value("TIDINGS_WRITE_BEHIND_MS") {
                    storage.journal.write_behind_interval = Duration::from_millis(ms);
                }
                if let Some(nice) = env_value("TIDINGS_WRITE_BEHIND_NICE") {
                    storage.journal.write_behind_nice = nice;
                }
                if let Some(rest) = env_value("TIDINGS_WRITE_BEHIND_REST") {
                    storage.journal.write_behind_rest_percent = rest;
                }
                if let Some(kb) = env_value::<usize>("TIDINGS_PACK_KB") {
                    storage.journal.pack_bytes_max = kb << 10;
                }
                if let Some(us) = env_value("TIDINGS_SYNC_INTERVAL_US") {
                    storage.journal.sync_interval_min = Duration::from_micros(us);
                }
                if let Some(workers) = env_value("TIDINGS_DURABLE_WORKERS") {
                    storage.durable_workers = workers;
                }
                let node = Arc::new(Node::start(config, storage, mesh.transport(*id)).expect("node starts"));
                mesh.attach(&node);
                node
            })
            .collect();
        Cluster { ids, nodes, senders: None, _mesh: mesh }
    }

    /// The node that leads `channel` (placement's first replica).
    pub fn leader(&self, channel: &ChannelId) -> &Arc<Node> {
        &self.nodes[self.leader_index(channel)]
    }

    /// The index in `nodes` of the node that leads `channel`.
    pub fn leader_index(&self, channel: &ChannelId) -> usize {
        let leader = NodeConfig::new(self.ids[0], self.ids.clone()).channel_placement(channel)[0];
        self.ids.iter().position(|id| *id == leader).expect("a cluster node")
    }

    /// Waits (up to 20 s) for idle eviction to leave at most `most` replicas active across the cluster.
    pub fn wait_until_evicted(&self, most: usize) {
        let from = Instant::now();
        while from.elapsed() < Duration::from_secs(20) {
            let active: usize = self.nodes.iter().map(|n| n.status().map_or(0, |s| s.channels_active)).sum();
            if active <= most {
                return;
            }
            std::thread::sleep(Duration::from_millis(500));
        }
    }

    /// Waits (up to 30 s) until write-behind stored every record waiting in the journals' memory tables
    /// and the entries of evicted channels left memory (at the end of the round after their eviction);
    /// how long it waited.
    pub fn wait_for_write_behind(&self) -> Duration {
        let from = Instant::now();
        let waiting = |node: &Arc<Node>| {
            let log = node.message_log_stats();
            let active = node.status().map_or(0, |s| s.channels_active);
            log.mem_bytes > 0 || log.channels_in_memory > active
        };
        // Every 100 ms: each poll builds every node's status on its reactors, an entry per listed replica
        // (under callgrind, polls every 20 ms were 7% of the reactors' instructions in `--channels 400` runs).
        while from.elapsed() < Duration::from_secs(30) && self.nodes.iter().any(waiting) {
            std::thread::sleep(Duration::from_millis(100));
        }
        from.elapsed()
    }

    /// Creates `channels` from several threads (metadata writes batch in the slot groups' raft logs).
    pub fn create(&self, channels: &[ChannelId]) {
        std::thread::scope(|scope| {
            for part in channels.chunks(channels.len().div_ceil(32)) {
                scope.spawn(move || {
                    for channel in part {
                        let info = ChannelInfo { channel: channel.clone(), flags: ChannelFlags::default() };
                        retry(|| match self.nodes[0].create_channel(info.clone()) {
                            // Applied by an attempt whose answer was lost.
                            Err(NodeError::NotApplied(_)) => Ok(()),
                            other => other,
                        });
                    }
                });
            }
        });
    }

    /// Appends from now on name a sender, one of `count` in turn (`--senders N`): the leader checks each.
    pub fn with_senders(mut self, count: u64) -> Cluster {
        self.senders = Some((count.max(1), AtomicU64::new(0)));
        self
    }

    /// The next sender, when appends name one.
    fn next_sender(&self) -> Option<Uid> {
        let (count, next) = self.senders.as_ref()?;
        let n = next.fetch_add(1, Ordering::Relaxed) % count;
        Some(Uid::new(format!("u{n}")).expect("a short uid"))
    }

    pub fn append(&self, channel: &ChannelId, payload: &Bytes) -> AppendHandle {
        let record = AppendRecord { idempotency_key: None, payload: payload.clone() };
        let sender = self.next_sender();
        retry(|| {
            let leader = self.leader(channel);
            match &sender {
                Some(uid) => leader.append_from(channel.clone(), uid.clone(), vec![record.clone()]),
                None => leader.append(channel.clone(), vec![record.clone()]),
            }
        })
    }

    /// Appends one record at `channel`'s leader; `then` gets the outcome on the channel's reactor thread.
    pub fn append_then(
        &self,
        channel: &ChannelId,
        payload: &Bytes,
        then: impl FnOnce(Result<Vec<tidings::types::Seq>, NodeError>) + Send + Clone + 'static,
    ) {
        let record = AppendRecord { idempotency_key: None, payload: payload.clone() };
        let sender = self.next_sender();
        retry(|| {
            let leader = self.leader(channel);
            match &sender {
                Some(uid) => leader.append_from_then(channel.clone(), uid.clone(), vec![record.clone()], then.clone()),
                None => leader.append_then(channel.clone(), vec![record.clone()], then.clone()),
            }
        });
    }
}

pub fn retry<T>(mut call: impl FnMut() -> Result<T, NodeError>) -> T {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match call() {
            Ok(value) => return value,
            Err(error) if error.remedy() != Remedy::GiveUp && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(error) => panic!("gave up: {error}"),
        }
    }
}

/// Closed loop: each client keeps `in_flight / CLIENTS` appends outstanding over its share of channels.
pub fn max_rate(cluster: &Cluster, channels: &[ChannelId], messages: usize, in_flight: usize) -> Figures {
    let payload = Bytes::from(vec![0x42u8; RECORD_BYTES]);
    let started = Instant::now();
    let latencies: Vec<Duration> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..CLIENTS)
            .map(|client| {
                let payload = payload.clone();
                scope.spawn(move || {
                    let mut latencies = Vec::with_capacity(messages / CLIENTS);
                    let mut pending: VecDeque<(Instant, AppendHandle)> = VecDeque::new();
                    let mine: Vec<&ChannelId> = channels.iter().skip(client).step_by(CLIENTS).collect();
                    let mine = if mine.is_empty() { channels.iter().collect() } else { mine };
                    for i in 0..messages / CLIENTS {
                        pending.push_back((Instant::now(), cluster.append(mine[i % mine.len()], &payload)));
                        while pending.len() >= in_flight / CLIENTS {
                            let (t, handle) = pending.pop_front().expect("non-empty");
                            handle.wait().expect("append committed");
                            latencies.push(t.elapsed());
                        }
                    }
                    for (t, handle) in pending {
                        handle.wait().expect("append committed");
                        latencies.push(t.elapsed());
                    }
                    latencies
                })
            })
            .collect();
        workers.into_iter().flat_map(|w| w.join().expect("client")).collect()
    });
    let count = latencies.len();
    figures(count, started.elapsed(), latencies)
}

/// Open loop: appends sent at `rate` for `duration` from one thread on a fixed schedule, whatever the
/// cluster does; each one's latency runs from its scheduled send time to the moment its callback is
/// called (`Node::append_then`), so queueing shows and a slow append does not delay the measurement of
/// the others. An append refused because its channel's queue is full is sent again after 200 µs,
/// keeping its scheduled time (without holding up the outcomes of the others meanwhile).
pub fn paced(cluster: &Cluster, channels: &[ChannelId], rate: f64, duration: Duration) -> Figures {
    let payload = Bytes::from(vec![0x42u8; RECORD_BYTES]);
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)] // A few hundred thousand at most.
    let total = (rate * duration.as_secs_f64()) as usize;
    let interval = Duration::from_secs_f64(1.0 / rate);
    // Outcomes go from the nodes' core threads (callbacks must not block) to one collector.
    let (outcomes, collected) = crossbeam_channel::unbounded::<(Instant, usize, Result<Duration, NodeError>)>();
    let send = |scheduled: Instant, i: usize| {
        let outcomes = outcomes.clone();
        cluster.append_then(&channels[i % channels.len()], &payload, move |result| {
            let _ = outcomes.send((scheduled, i, result.map(|_| scheduled.elapsed())));
        });
    };
    let started = Instant::now();
    let outcome = std::thread::scope(|scope| {
        let collector = scope.spawn(|| {
            let mut latencies = Vec::with_capacity(total);
            // Refused appends wait here for their retry, in the order they were refused (one delay for
            // all): sleeping on each in turn would delay every outcome behind a burst of refusals.
            let mut retries: VecDeque<(Instant, Instant, usize)> = VecDeque::new();
            let mut refused = 0;
            // (when it was scheduled, which append, its latency): where in time and on which node the slowest
            // ones fell.
            let mut outcomes = Vec::with_capacity(total);
            while latencies.len() < total {
                while let Some(&(_, scheduled, i)) = retries.front().filter(|(due, ..)| *due <= Instant::now()) {
                    retries.pop_front();
                    send(scheduled, i);
                }
                let next = match retries.front() {
                    Some((due, ..)) => collected.recv_timeout(due.saturating_duration_since(Instant::now())),
                    None => collected.recv().map_err(|_| RecvTimeoutError::Disconnected),
                };
                let (scheduled, i, outcome) = match next {
                    Ok(next) => next,
                    Err(RecvTimeoutError::Timeout) => continue,
                    Err(RecvTimeoutError::Disconnected) => panic!("senders alive"),
                };
                match outcome {
                    Ok(latency) => {
                        latencies.push(latency);
                        outcomes.push((scheduled.duration_since(started), i, latency));
                    }
                    Err(NodeError::Append(tidings::channel::machine::AppendError::Busy)) => {
                        refused += 1;
                        retries.push_back((Instant::now() + Duration::from_micros(200), scheduled, i));
                    }
                    Err(error) => panic!("append failed: {error}"),
                }
            }
            let leader_of = |i: usize| cluster.leader_index(&channels[i % channels.len()]);
            (latencies, refused, slowest_percent(outcomes, cluster.nodes.len(), channels.len(), leader_of))
        });
        let mut late = Vec::with_capacity(total);
        for i in 0..total {
            let scheduled = started + interval * u32::try_from(i).expect("fits");
            if let Some(wait) = scheduled.checked_duration_since(Instant::now()) {
                std::thread::sleep(wait);
            }
            // Zero when on time (`elapsed` saturates).
            late.push(scheduled.elapsed());
            send(scheduled, i);
        }
        late.sort_unstable();
        (collector.join().expect("collector"), late)
    });
    let ((latencies, refused, slowest), late) = outcome;
    let mut figures = figures(total, duration, latencies);
    figures.sent_late_p99 = (!late.is_empty()).then(|| super::percentile(&late, 990));
    figures.refused_busy = Some(refused);
    figures.slowest = Some(slowest);
    figures
}

/// Where the slowest 1% of a paced run's appends fell: in how many 10 ms windows of their send times
/// (a few windows: stalls that held up everything sent meanwhile; many: a tail spread over the run),
/// and their share by the node that led their channel next to that node's share of all appends (one
/// node well over its share: the stalls were that node's, not the cluster's).
fn slowest_percent(
    mut outcomes: Vec<(Duration, usize, Duration)>,
    nodes: usize,
    channels: usize,
    leader_of: impl Fn(usize) -> usize,
) -> String {
    const WINDOW_MS: u128 = 10;
    if outcomes.len() < 100 {
        return String::new();
    }
    outcomes.sort_unstable_by_key(|(_, _, latency)| std::cmp::Reverse(*latency));
    let slowest = &outcomes[..outcomes.len() / 100];
    let windows: BTreeSet<u128> = slowest.iter().map(|(sent, ..)| sent.as_millis() / WINDOW_MS).collect();
    let mut tail_by_node = vec![0usize; nodes];
    for (_, i, _) in slowest {
        tail_by_node[leader_of(*i)] += 1;
    }
    // Appends go round-robin over the channels: a node's share of them is its share of the channels.
    let mut channels_by_node = vec![0usize; nodes];
    for channel in 0..channels {
        channels_by_node[leader_of(channel)] += 1;
    }
    let percent = |part: usize, whole: usize| 100 * part / whole.max(1);
    let by_node: Vec<String> = (0..nodes)
        .map(|n| {
            let tail = percent(tail_by_node[n], slowest.len());
            format!("node {} {tail}% ({}%)", n + 1, percent(channels_by_node[n], channels))
        })
        .collect();
    format!(
        "slowest 1% (>= {:.2?}) sent within {} windows of {WINDOW_MS} ms; by leader, against its share of appends: {}",
        slowest.last().map_or(Duration::ZERO, |(_, _, latency)| *latency),
        windows.len(),
        by_node.join(", ")
    )
}
