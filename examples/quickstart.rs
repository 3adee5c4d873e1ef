//! The README's main command: `cargo run --release --example quickstart`.
//!
//! Three nodes in one process, each on its own sled directory under a temp dir, joined by an in-process
//! transport. Creates users and channels, appends messages over many channels concurrently and prints
//! throughput and commit latency, then stops a node under load: slot groups re-elect through raft, and
//! the controller fails over every channel the node led (fence, durable evidence from the surviving
//! replicas, new leader in a new leader epoch, unfence) while the client retries with idempotency keys.
//! It prints one failover (old leader, evidence, new leader and epoch) and how long channels took to
//! resume, restarts the node from its directory, shows it caught up, and reads every acknowledged
//! message back in order. A toy gateway (half the users online, on node 1 or 2) counts the post-commit
//! fanout deliveries, and checks that every message acknowledged around the stop reached its online
//! subscribers at least once (the new leaders plan again what the stopped one had not). Then it
//! restarts another node as planned, under load: `Node::hand_off_leaderships` moves its leaderships to
//! the others first, so none of its channels needs a failover, and it leads them again once it is
//! back. It gives up the older half of one channel's history (`Node::set_retention`). Last, a
//! hash slot of users migrates to another slot group while they are written.
#![allow(clippy::disallowed_methods)] // An example is a runtime shell: it reads the clock to report figures.

use bytes::Bytes;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tidings::channel::fanout::DeliveryPlan;
use tidings::channel::machine::AppendRecord;
use tidings::mesh::InProcessMesh;
use tidings::node::{NodeConfig, NodeError, Remedy};
use tidings::node::{TaskKind, TaskReport};
use tidings::router::hash_slot;
use tidings::slot::command::{Command, MemberList};
use tidings::slot::fsm::{Outcome, Refusal};
use tidings::slot::model::{ChannelFlags, ChannelInfo, Uid, User};
use tidings::store::message::IdempotencyKey;
use tidings::types::{ChannelId, ChannelType, NodeId, Seq};
use tidings::{AppendHandle, FanoutHost, Node, RouteKey, StorageOptions};

const CHANNELS: usize = 200;
const MESSAGES: usize = 20_000;
const IN_FLIGHT: usize = 256;

/// The host's presence and delivery: even-numbered users are online (on node 1 or 2), the rest offline.
/// Counts what it is asked to deliver, and how many member deliveries each message had (a real gateway
/// drops a repeat by channel and seq: delivery is at least once around a leader change).
#[derive(Default)]
struct Gateway {
    plans: AtomicU64,
    deliveries: AtomicU64,
    per_message: Mutex<HashMap<(ChannelId, Seq), u64>>,
}

impl Gateway {
    /// Of `messages`, how many have reached `members` members or more, and the member deliveries beyond
    /// that (repeats).
    fn reached(&self, messages: &[Acked], members: u64) -> (usize, u64) {
        let per_message = self.per_message.lock().expect("gateway lock");
        let counts = messages.iter().map(|(channel, seq, ..)| per_message.get(&(channel.clone(), *seq)).copied());
        counts.fold((0, 0), |(reached, repeats), count| match count {
            Some(n) if n >= members => (reached + 1, repeats + n - members),
            _ => (reached, repeats),
        })
    }
}

impl FanoutHost for Gateway {
    fn locate(&self, uids: &[String]) -> Vec<Option<NodeId>> {
        uids.iter()
            .map(|uid| {
                let n: u64 = uid.trim_start_matches("user-").parse().unwrap_or(1);
                (n % 2 == 0).then(|| NodeId::new(1 + (n / 2) % 2))
            })
            .collect()
    }

    fn deliver(&self, plan: &DeliveryPlan) -> bool {
        self.plans.fetch_add(1, Ordering::Relaxed);
        self.deliveries.fetch_add(plan.members.len() as u64, Ordering::Relaxed);
        let key = (plan.message.channel.clone(), plan.message.seq);
        *self.per_message.lock().expect("gateway lock").entry(key).or_default() += plan.members.len() as u64;
        true
    }
}

/// How long a restarted node must be up before its channels' leadership comes back to it (see
/// `Cluster::start_node`).
const REBALANCE_AFTER: Duration = Duration::from_secs(3);

/// Retries a call while the cluster settles (elections, meta propagation).
fn retry<T>(what: &str, mut call: impl FnMut() -> Result<T, tidings::node::NodeError>) -> T {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match call() {
            Ok(value) => return value,
            // What the error says to do (`NodeError::remedy`): the calls here are idempotent or keyed, so
            // any retry is the same call again; one that cannot succeed as made stops the run.
            Err(error) if error.remedy() != Remedy::GiveUp && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(error) => panic!("{what}: {error}"),
        }
    }
}

/// Every committed message of `channel` on `node`, page by page (a read returns at most
/// `NodeConfig::read_records_max` messages): each one's seq and payload.
fn read_all(node: &Node, channel: &ChannelId) -> Result<Vec<(Seq, Bytes)>, NodeError> {
    let (mut all, mut from) = (Vec::new(), Seq::new(1));
    loop {
        let page = node.read(channel, from, usize::MAX)?;
        let Some(last) = page.last() else { return Ok(all) };
        from = last.seq.next();
        all.extend(page.into_iter().map(|r| (r.seq, r.payload)));
    }
}

fn percentile(sorted: &[Duration], per_mille: usize) -> Duration {
    sorted[(sorted.len() - 1) * per_mille / 1000]
}

/// An acknowledged message: channel, seq, payload, when it was acknowledged.
type Acked = (ChannelId, Seq, Bytes, Instant);

/// Appends `count` messages round-robin over `channels` through `node`, at most `IN_FLIGHT` at a time.
/// Every message carries an idempotency key, and one that fails (its leader gone, a failover fencing
/// the channel) is sent again with the same key until it is acknowledged: exactly once in the log.
/// Returns every acknowledged message and the commit latencies (first attempt to acknowledgement).
fn load(node: &Node, channels: &[ChannelId], count: usize, tag: &str) -> (Vec<Acked>, Vec<Duration>) {
    let mut acked = Vec::with_capacity(count);
    let mut latencies = Vec::with_capacity(count);
    let mut pending: std::collections::VecDeque<(ChannelId, AppendRecord, Instant, AppendHandle)> = Default::default();
    let send = |channel: &ChannelId, record: &AppendRecord| {
        retry("append", || node.append(channel.clone(), vec![record.clone()]))
    };
    for i in 0..count {
        let channel = channels[i % channels.len()].clone();
        let payload = Bytes::from(format!("{tag}-{i:06} hello from the quickstart"));
        let key = IdempotencyKey::new(format!("{tag}-{i}")).expect("short key");
        let record = AppendRecord { idempotency_key: Some(key), payload };
        let handle = send(&channel, &record);
        pending.push_back((channel, record, Instant::now(), handle));
        while pending.len() >= IN_FLIGHT || (i + 1 == count && !pending.is_empty()) {
            let (channel, record, started, handle) = pending.pop_front().expect("non-empty");
            match handle.wait() {
                Ok(seqs) => {
                    latencies.push(started.elapsed());
                    acked.push((channel, seqs[0], record.payload, Instant::now()));
                }
                Err(error) => {
                    assert!(started.elapsed() < Duration::from_secs(60), "{channel}: not acknowledged: {error}");
                    std::thread::sleep(Duration::from_millis(5));
                    let handle = send(&channel, &record);
                    pending.push_back((channel, record, started, handle));
                }
            }
        }
    }
    latencies.sort();
    (acked, latencies)
}

/// The demo's three nodes, their in-process mesh and the host's gateway. Fields drop in declaration
/// order: the nodes (which flush their stores) before the temp dir that holds their data.
struct Cluster {
    nodes: BTreeMap<NodeId, Arc<Node>>,
    mesh: Arc<InProcessMesh>,
    gateway: Arc<Gateway>,
    ids: Vec<NodeId>,
    root: tempfile::TempDir,
}

impl Cluster {
    /// Starts nodes 1 to 3, each on its own directory under a fresh temp dir.
    fn start() -> Self {
        let mut cluster = Cluster {
            nodes: BTreeMap::new(),
            mesh: InProcessMesh::new(),
            gateway: Arc::new(Gateway::default()),
            ids: (1..=3).map(NodeId::new).collect(),
            root: tempfile::tempdir().expect("temp dir"),
        };
        for id in cluster.ids.clone() {
            cluster.start_node(id);
        }
        cluster
    }

    /// Starts (or restarts, from its directory) node `id` and joins it to the mesh.
    fn start_node(&mut self, id: NodeId) -> Arc<Node> {
        let mut config = NodeConfig::new(id, self.ids.clone());
        // Channels hand leadership back to their preferred replica once it has been up this long (default
        // 30 s; shorter here so the demo shows it).
        config.controller.rebalance_leaders_after = Some(REBALANCE_AFTER);
        let storage = StorageOptions::new(self.root.path().join(format!("node-{id}")));
        let fanout: Arc<dyn FanoutHost> = self.gateway.clone();
        let node = Node::start_with_fanout(config, storage, self.mesh.transport(id), fanout).expect("node starts");
        let node = Arc::new(node);
        self.mesh.attach(&node);
        self.nodes.insert(id, Arc::clone(&node));
        node
    }

    /// Cuts node `id` off the mesh and shuts it down (its threads joined, its stores flushed).
    fn stop_node(&mut self, id: NodeId) {
        self.mesh.detach(id);
        drop(self.nodes.remove(&id));
    }

    /// Node 1, through which the load and the metadata writes go.
    fn first(&self) -> Arc<Node> {
        Arc::clone(&self.nodes[&self.ids[0]])
    }

    /// The failovers of channels `old_leader` led, as the running nodes' controllers report them.
    fn failovers_from(&self, old_leader: NodeId) -> Vec<TaskReport> {
        self.nodes
            .values()
            .flat_map(|n| n.status().map(|s| s.finished_tasks).unwrap_or_default())
            .filter(|r| r.kind == TaskKind::Failover && r.old_leader == old_leader)
            .collect()
    }
}

fn main() {
    let mut cluster = Cluster::start();
    let first = cluster.first();
    println!(
        "tidings quickstart: 3 nodes ({} channel reactor thread(s) each), data under {}",
        first.reactors(),
        cluster.root.path().display()
    );

    // Every slot group elects its leader first (a few election timeouts); writes then go straight to work
    // (the retries below only cover what a live cluster may still answer: a leader changing meanwhile).
    let t = Instant::now();
    for node in cluster.nodes.values() {
        node.wait_ready(Duration::from_secs(20)).expect("slot groups elect their leaders");
    }
    println!("slot groups ready in {:.2?}", t.elapsed());

    let channels = create_users_and_channels(&first);
    let mut acked = load_and_fan_out(&cluster, &channels);
    let (stopped, led_by_stopped) = (cluster.ids[2], placed_leader(cluster.ids[2], &cluster.ids, &channels));
    acked.extend(stop_a_node_under_load(&mut cluster, stopped, &channels, &led_by_stopped));
    restart_and_catch_up(&mut cluster, stopped, &channels, &acked, &led_by_stopped);
    acked.extend(planned_restart(&mut cluster, &channels));
    let history = read_back_in_order(&cluster, acked);
    give_up_older_half(&cluster, history);
    migrate_a_slot(&first);
}

/// Metadata through the slot layer: ten users, and [`CHANNELS`] channels with all ten as subscribers.
fn create_users_and_channels(node: &Node) -> Vec<ChannelId> {
    let t = Instant::now();
    for u in 0..10 {
        let user = User { uid: Uid::new(format!("user-{u}")).expect("uid"), name: format!("User {u}"), banned: false };
        retry("put user", || node.propose(Command::PutUser(user.clone())));
    }
    let channels: Vec<ChannelId> =
        (0..CHANNELS).map(|i| ChannelId::new(ChannelType::GROUP, &format!("room-{i}")).expect("channel id")).collect();
    for channel in &channels {
        let info = ChannelInfo { channel: channel.clone(), flags: ChannelFlags::default() };
        retry("create channel", || node.create_channel(info.clone()));
        let uids = (0..10).map(|u| Uid::new(format!("user-{u}")).expect("uid")).collect();
        let add = Command::AddMembers { channel: channel.clone(), list: MemberList::Subscribers, uids };
        retry("add subscribers", || node.propose(add.clone()));
    }
    println!("created 10 users and {CHANNELS} channels (10 subscribers each) in {:.2?}", t.elapsed());
    channels
}

/// Load through node 1 (it forwards to each channel's leader), then waits for every committed message to
/// fan out to its 5 online subscribers (after the commit, off the append path).
fn load_and_fan_out(cluster: &Cluster, channels: &[ChannelId]) -> Vec<Acked> {
    let t = Instant::now();
    let (acked, latencies) = load(&cluster.first(), channels, MESSAGES, "a");
    let elapsed = t.elapsed();
    println!(
        "appended {MESSAGES} messages over {CHANNELS} channels in {elapsed:.2?}: {:.0} msg/s, commit latency p50 {:.2?} p99 {:.2?} p99.9 {:.2?}",
        MESSAGES as f64 / elapsed.as_secs_f64(),
        percentile(&latencies, 500),
        percentile(&latencies, 990),
        percentile(&latencies, 999),
    );

    let gateway = &cluster.gateway;
    let t = Instant::now();
    let expected_deliveries = MESSAGES as u64 * 5;
    while gateway.deliveries.load(Ordering::Relaxed) < expected_deliveries && t.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(10));
    }
    println!(
        "fanout: {} member deliveries in {} plans (expected {expected_deliveries}: 5 online subscribers per message), the last {:.2?} after the last commit",
        gateway.deliveries.load(Ordering::Relaxed),
        gateway.plans.load(Ordering::Relaxed),
        t.elapsed(),
    );
    assert_eq!(gateway.deliveries.load(Ordering::Relaxed), expected_deliveries, "fanout lost or repeated deliveries");
    acked
}

/// Stops `stopped` under load. The load keeps going through node 1 over every channel; those it led
/// (`led_by_stopped`) stall until the controller notices it is gone and fails them over. Returns what
/// was acknowledged meanwhile, after checking it all fanned out.
fn stop_a_node_under_load(
    cluster: &mut Cluster,
    stopped: NodeId,
    channels: &[ChannelId],
    led_by_stopped: &[ChannelId],
) -> Vec<Acked> {
    let loader = load_in_background(&cluster.first(), channels, MESSAGES, "b");
    std::thread::sleep(Duration::from_millis(200));
    // The outage starts as the node is cut off, before its threads wind down (a last write-behind may
    // take a second or more while the others already count it down).
    let stopped_at = Instant::now();
    cluster.stop_node(stopped);
    println!(
        "stopped {stopped} under load ({:.2?} to wind down); it led {} of the {CHANNELS} channels",
        stopped_at.elapsed(),
        led_by_stopped.len()
    );
    let (more, _) = loader.join().expect("load thread");
    let reports: Vec<TaskReport> = cluster.failovers_from(stopped).into_iter().filter(|r| r.outcome.is_ok()).collect();
    // A channel took appends again with the first acknowledged append in its new leader's log: past
    // every seq its failover's evidence showed. (Acknowledgements of what the stopped node committed
    // as it went count for nothing, however late the load thread, waiting on older appends, saw them.)
    let mut first_after: BTreeMap<&ChannelId, Duration> = BTreeMap::new();
    for report in reports.iter().filter(|r| led_by_stopped.contains(&r.channel)) {
        let Some(before) = report.evidence.iter().map(|e| e.last_seq).max() else { continue };
        let acked_after = more.iter().filter(|(ch, seq, ..)| *ch == report.channel && *seq > before);
        if let Some(at) = acked_after.map(|(.., at)| at.saturating_duration_since(stopped_at)).min() {
            first_after.insert(&report.channel, at);
        }
    }
    let mut resumed: Vec<Duration> = first_after.into_values().collect();
    resumed.sort();
    if let Some(report) = reports.first() {
        print_failover(report);
    }
    println!(
        "{} failovers; {} messages acknowledged meanwhile; the {} channels {stopped} led took appends again after {:.2?} (median) / {:.2?} (max) — failure detection is {:?}",
        reports.len(),
        more.len(),
        resumed.len(),
        resumed.get(resumed.len() / 2).copied().unwrap_or_default(),
        resumed.last().copied().unwrap_or_default(),
        NodeConfig::new(stopped, cluster.ids.clone()).controller.node_down_after,
    );
    assert_eq!(resumed.len(), led_by_stopped.len(), "every channel the stopped node led takes appends again");
    // Fanout is at least once: what the stopped node had not finished, the new leaders plan again.
    let t = Instant::now();
    while cluster.gateway.reached(&more, 5).0 < more.len() && t.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(10));
    }
    let (reached, repeats) = cluster.gateway.reached(&more, 5);
    let planned_again: u64 =
        cluster.nodes.values().filter_map(|n| n.status().ok()).map(|s| s.fanout_planned_again).sum();
    println!(
        "fanout around the stop: {reached} of the {} messages acknowledged meanwhile reached their 5 online subscribers; the new leaders planned {planned_again} again ({repeats} member deliveries repeated)",
        more.len()
    );
    assert_eq!(reached, more.len(), "fanout lost a committed message around the stop");
    more
}

/// One failover as its controller reports it: the old leader, the evidence, the new leader and epoch.
fn print_failover(report: &TaskReport) {
    let evidence: Vec<String> = report
        .evidence
        .iter()
        .map(|e| format!("{}: epoch {} last {}", e.node, e.last_epoch.get(), e.last_seq))
        .collect();
    let (leader, epoch) = report.new_leader.expect("a successful failover names a leader");
    println!(
        "failover of {}: old leader {}, evidence [{}], new leader {} in leader epoch {}, task took {:.0?} after detection",
        report.channel,
        report.old_leader,
        evidence.join(", "),
        leader,
        epoch.get(),
        report.finished.since(report.started),
    );
}

/// Restarts `stopped` from its directory, shows it catch up on one of its channels and what that
/// channel's leader reports of it, then waits for the leaderships of `led_by_stopped` to come back.
fn restart_and_catch_up(
    cluster: &mut Cluster,
    stopped: NodeId,
    channels: &[ChannelId],
    acked: &[Acked],
    led_by_stopped: &[ChannelId],
) {
    let restarted = cluster.start_node(stopped);
    let config = NodeConfig::new(stopped, cluster.ids.clone());
    let t = Instant::now();
    let sample = channels
        .iter()
        .find(|c| config.channel_placement(c).contains(&stopped))
        .expect("node 3 replicates some channel");
    let expected: usize = acked.iter().filter(|(c, ..)| c == sample).count();
    loop {
        // The first read teaches the restarted node the channel's meta; its replica then pulls.
        let have = restarted.read(sample, Seq::new(1), usize::MAX).map(|r| r.len()).unwrap_or(0);
        if have >= expected || t.elapsed() > Duration::from_secs(30) {
            println!("restarted {stopped}: caught up on {sample} ({have}/{expected} messages) in {:.2?}", t.elapsed());
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    // What the channel's leader reports of the restarted replica (operators watch this to see a replica
    // catch up or fall behind).
    let leader = restarted.channel_status(sample).ok().flatten().map(|s| s.leader);
    let progress = leader
        .and_then(|id| cluster.nodes.get(&id))
        .and_then(|node| node.channel_status(sample).ok().flatten())
        .and_then(|status| status.replicas.into_iter().find(|r| r.node == stopped));
    if let Some(p) = progress {
        println!(
            "  its leader's view of it: acknowledged through seq {}, {} records behind, in ISR: {}, last pull {:.0?} ago",
            p.match_seq, p.lag, p.in_isr, p.silent_for
        );
    }
    // Its channels come back to it: each one's controller (its slot group's leader) transfers the
    // leadership back once the node has been up for `REBALANCE_AFTER`, on its next repair pass.
    lead_again(&restarted, led_by_stopped, t);
}

/// A planned restart of node 2 (an upgrade, say), under load: it hands its channel and slot-group
/// leaderships off to the other nodes first, so its channels keep taking appends through the stop
/// instead of waiting for failure detection and a failover. Returns what was acknowledged meanwhile.
fn planned_restart(cluster: &mut Cluster, channels: &[ChannelId]) -> Vec<Acked> {
    let planned = cluster.ids[1];
    let led_by_planned = placed_leader(planned, &cluster.ids, channels);
    let loader = load_in_background(&cluster.first(), channels, MESSAGES / 2, "c");
    std::thread::sleep(Duration::from_millis(200));
    let t = Instant::now();
    let handed_off = cluster.nodes[&planned].hand_off_leaderships(Duration::from_secs(20));
    let hand_off_took = t.elapsed();
    cluster.stop_node(planned);
    let (during, latencies) = loader.join().expect("load thread");
    let failovers = cluster.failovers_from(planned).len();
    println!(
        "planned restart of {planned}: handed off the leadership of its {} channels and its slot groups in {hand_off_took:.2?} ({}), then stopped; {failovers} failovers; {} messages acknowledged meanwhile, commit latency p99 {:.2?} max {:.2?}",
        led_by_planned.len(),
        if handed_off.is_ok() { "all" } else { "not all" },
        during.len(),
        percentile(&latencies, 990),
        latencies.last().copied().unwrap_or_default(),
    );
    handed_off.expect("a node with live peers hands off everything it leads");
    assert_eq!(failovers, 0, "a channel handed off before the stop needed a failover");
    let restarted = cluster.start_node(planned);
    // A hand-off keeps the node its channels' preferred replica: they come back as after the crash.
    lead_again(&restarted, &led_by_planned, Instant::now());
    during
}

/// Reads every acknowledged message back, in order and exactly once, from a replica of its channel
/// (reads stop at the HW a replica knows, so each channel is read from the first replica that shows
/// everything). Returns one channel and the seqs acknowledged on it.
fn read_back_in_order(cluster: &Cluster, acked: Vec<Acked>) -> (ChannelId, Vec<Seq>) {
    let mut by_channel: BTreeMap<ChannelId, Vec<(Seq, Bytes)>> = BTreeMap::new();
    for (channel, seq, payload, _) in acked {
        by_channel.entry(channel).or_default().push((seq, payload));
    }
    let placement = NodeConfig::new(cluster.ids[0], cluster.ids.clone());
    let mut checked = 0;
    let mut history = None;
    for (channel, mut expected) in by_channel {
        expected.sort();
        if history.is_none() {
            history = Some((channel.clone(), expected.iter().map(|(seq, _)| *seq).collect()));
        }
        let deadline = Instant::now() + Duration::from_secs(20);
        let got = 'found: loop {
            for replica in placement.channel_placement(&channel).iter() {
                let Ok(got) = read_all(&cluster.nodes[replica], &channel) else { continue };
                if expected.iter().all(|e| got.contains(e)) {
                    break 'found got;
                }
            }
            assert!(Instant::now() < deadline, "{channel}: acknowledged messages missing on every replica");
            std::thread::sleep(Duration::from_millis(20));
        };
        assert!(got.windows(2).all(|w| w[0].0 < w[1].0), "{channel}: out of order");
        // Exactly once: retried messages carried their idempotency key.
        let mut payloads: Vec<&Bytes> = got.iter().map(|(_, p)| p).collect();
        payloads.sort();
        assert!(payloads.windows(2).all(|w| w[0] != w[1]), "{channel}: a message is in the log twice");
        checked += expected.len();
    }
    println!("read back all {checked} acknowledged messages in order: ok");
    history.expect("some channel was written")
}

/// Gives up the older half of `channel`'s history (a retention period, a cleared conversation), asked of
/// node 1: the channel's leader checks the boundary against its HW and makes it the meta; every replica
/// then reads from past it and trims its store.
fn give_up_older_half(cluster: &Cluster, (channel, seqs): (ChannelId, Vec<Seq>)) {
    let boundary = seqs[seqs.len() / 2];
    let t = Instant::now();
    let in_force = retry("give up older records", || cluster.first().set_retention(channel.clone(), boundary));
    let took = t.elapsed();
    let replicas = NodeConfig::new(cluster.ids[0], cluster.ids.clone()).channel_placement(&channel);
    let firsts: Vec<Seq> = replicas
        .iter()
        .map(|replica| {
            retry("read past the boundary", || match read_all(&cluster.nodes[replica], &channel)?.first() {
                Some((first, _)) if *first > in_force => Ok(*first),
                _ => Err(NodeError::Busy(channel.clone())), // this replica has not applied the meta yet
            })
        })
        .collect();
    println!(
        "gave up {channel} through {in_force} (of {} messages, via {}) in {took:.2?}: reads on its replicas start at {}",
        seqs.len(),
        cluster.ids[0],
        firsts.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")
    );
}

/// The channels placement makes `node` the leader of.
fn placed_leader(node: NodeId, ids: &[NodeId], channels: &[ChannelId]) -> Vec<ChannelId> {
    let placement = NodeConfig::new(node, ids.to_vec());
    channels.iter().filter(|c| placement.channel_placement(c)[0] == node).cloned().collect()
}

/// Runs [`load`] through `node` on a thread of its own.
fn load_in_background(
    node: &Arc<Node>,
    channels: &[ChannelId],
    count: usize,
    tag: &'static str,
) -> std::thread::JoinHandle<(Vec<Acked>, Vec<Duration>)> {
    let (node, channels) = (Arc::clone(node), channels.to_vec());
    std::thread::spawn(move || load(&node, &channels, count, tag))
}

/// Waits (at most 30 s) until `node`, restarted at `restarted_at`, leads `channels` again, and says how
/// long that took.
fn lead_again(node: &Node, channels: &[ChannelId], restarted_at: Instant) {
    let id = node.id();
    loop {
        let status = node.status().map(|s| s.channels).unwrap_or_default();
        let back = status.iter().filter(|c| c.leader == id && channels.contains(&c.channel)).count();
        if back == channels.len() || restarted_at.elapsed() > Duration::from_secs(30) {
            println!(
                "{id} leads {back} of its {} channels again {:.2?} after its restart (a transfer back waits until the failure detector has held the preferred replica up {REBALANCE_AFTER:?}; a restart quicker than its silence limit does not restart that count)",
                channels.len(),
                restarted_at.elapsed()
            );
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Moves the hash slot of `user-0`'s records to another slot group while users of that slot are being
/// written: writes meet a short fence (and are written again), and every acknowledged one is read back
/// from the new group.
fn migrate_a_slot(node: &Arc<Node>) {
    let slot = hash_slot(b"user-0");
    let table = node.routes().hash_to_slot().clone();
    let from = table.group_of(slot);
    let to = table.groups().find(|g| *g != from).expect("several slot groups");
    let uids: Vec<Uid> = (0..)
        .map(|i| Uid::new(format!("mover-{i}")).expect("uid"))
        .filter(|u| hash_slot(u.as_str().as_bytes()) == slot)
        .take(2_000)
        .collect();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (node, stop) = (Arc::clone(node), Arc::clone(&stop));
        std::thread::spawn(move || {
            let (mut acked, mut fenced) = (Vec::new(), 0u64);
            for uid in uids {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                let user = User { uid: uid.clone(), name: "moving".into(), banned: false };
                let deadline = Instant::now() + Duration::from_secs(20);
                loop {
                    match node.propose(Command::PutUser(user.clone())) {
                        Ok(()) => break acked.push(uid),
                        Err(NodeError::NotApplied(Outcome::Refused(Refusal::SlotFenced { .. }))) => fenced += 1,
                        Err(error) if Instant::now() > deadline => panic!("write during the migration: {error}"),
                        Err(_) => {}
                    }
                    std::thread::sleep(Duration::from_millis(2));
                }
            }
            (acked, fenced)
        })
    };
    std::thread::sleep(Duration::from_millis(100));
    let t = Instant::now();
    retry("migrate a slot", || node.migrate_slot(slot, to));
    while node.routes().hash_to_slot().group_of(slot) != to {
        if t.elapsed() > Duration::from_secs(30) {
            let migrations = node.status().map(|s| s.slot_migrations);
            panic!("the migration of {slot} did not complete: {migrations:?}, routes {:?}", node.routes());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let took = t.elapsed();
    std::thread::sleep(Duration::from_millis(100));
    stop.store(true, Ordering::Relaxed);
    let (acked, fenced) = writer.join().expect("writer thread");
    for uid in &acked {
        let reader = retry("read at the new group", || node.authoritative_reader(RouteKey::Uid(uid.clone())));
        assert!(reader.user(uid).expect("read").is_some(), "{} acknowledged but missing", uid.as_str());
    }
    println!(
        "migrated {slot} from {from} to {to} in {took:.2?} while writing its users: {} writes acknowledged, {fenced} met the fence and were written again; all read back from {to}: ok",
        acked.len()
    );
}
