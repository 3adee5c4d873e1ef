//! The public API on real nodes (threads, sled, in-process transport): single node, three nodes with
//! forwarding from non-leaders, typed errors, and restart from the data directory.

// These tests drive real threaded nodes: waiting on them needs the wall clock.
#![allow(clippy::disallowed_methods)]

use bytes::Bytes;
use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tidings::channel::fanout::DeliveryPlan;
use tidings::channel::machine::{AppendError, AppendRecord};
use tidings::mesh::InProcessMesh;
use tidings::node::{NodeConfig, NodeError, Remedy};
use tidings::slot::command::{Command, MemberList};
use tidings::slot::fsm::Outcome;
use tidings::slot::model::{ChannelFlags, ChannelInfo};
use tidings::slot::model::{Uid, User};
use tidings::store::message::{JournalConfig, JournalLog, MessageLog};
use tidings::types::{ChannelId, ChannelType, NodeId, Seq};
use tidings::{FanoutHost, Node, RouteKey, StorageOptions};

fn start(
    id: NodeId,
    ids: &[NodeId],
    dir: &std::path::Path,
    mesh: &Arc<InProcessMesh>,
    tweak: impl Fn(&mut NodeConfig),
) -> Arc<Node> {
    start_with(id, ids, dir, mesh, tweak, |_| {}, None)
}

/// [`start`] with the storage options tweaked too, and fanout through `host` if one is given.
fn start_with(
    id: NodeId,
    ids: &[NodeId],
    dir: &std::path::Path,
    mesh: &Arc<InProcessMesh>,
    tweak: impl Fn(&mut NodeConfig),
    tweak_storage: impl Fn(&mut StorageOptions),
    host: Option<Arc<dyn FanoutHost>>,
) -> Arc<Node> {
    let mut config = NodeConfig::new(id, ids.to_vec());
    config.slot_groups = 2;
    tweak(&mut config);
    let mut storage = StorageOptions::new(dir.join(id.to_string()));
    tweak_storage(&mut storage);
    let transport = mesh.transport(id);
    let node = Arc::new(
        match host {
            Some(host) => Node::start_with_fanout(config, storage, transport, host),
            None => Node::start(config, storage, transport),
        }
        .unwrap(),
    );
    mesh.attach(&node);
    node
}

/// Creates `ch` through `node`, retrying until the slot group takes it.
#[track_caller]
fn create_channel(node: &Node, ch: &ChannelId) {
    eventually(|| node.create_channel(ChannelInfo { channel: ch.clone(), flags: ChannelFlags::default() }));
}

#[track_caller]
fn eventually<T>(mut f: impl FnMut() -> Result<T, NodeError>) -> T {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match f() {
            Ok(v) => return v,
            Err(e) if Instant::now() < deadline => {
                let _ = e;
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => panic!("never succeeded: {e}"),
        }
    }
}

/// Waits until every node that replicates the slot group of each of `keys` has applied the metadata
/// writes acknowledged before this call (a read barrier there); nodes that do not replicate it are
/// passed over. A channel leader fans out from pages and sender checks read on its own replica, so a
/// test that needs them current waits here, not for a guessed while.
fn applied_everywhere(nodes: &[Arc<Node>], keys: &[RouteKey]) {
    for node in nodes {
        for key in keys {
            eventually(|| match node.read_barrier_async(key.clone()).wait() {
                Err(NodeError::NotServed(_)) => Ok(()),
                other => other,
            });
        }
    }
}

/// Reads `ch` from its first seq on `reader` until it holds as many records as `acked` (within the
/// `eventually` deadline), then checks each acknowledged message is there, at its seq and as sent.
#[track_caller]
fn reads_back_every_acked(reader: &Node, ch: &ChannelId, acked: &[(Seq, String)]) {
    let read = eventually(|| {
        let read = reader.read(ch, Seq::new(1), 100)?;
        if read.len() < acked.len() {
            return Err(NodeError::Stopped);
        }
        Ok(read)
    });
    for (seq, text) in acked {
        assert!(read.iter().any(|r| r.seq == *seq && r.payload.as_ref() == text.as_bytes()), "lost {seq} {text}");
    }
}

/// Checks that every node reads back every message of `ch` among `acked` (channel, seq, text); returns
/// how many there were.
#[track_caller]
fn every_node_reads_back(nodes: &[Arc<Node>], ch: &ChannelId, acked: &[(ChannelId, Seq, String)]) -> usize {
    let mine: Vec<(Seq, String)> =
        acked.iter().filter(|(c, _, _)| c == ch).map(|(_, seq, text)| (*seq, text.clone())).collect();
    for node in nodes {
        reads_back_every_acked(node, ch, &mine);
    }
    mine.len()
}

/// Waits (within the `eventually` deadline) until `node`'s replica of `ch` has checkpointed an HW of at
/// least `seq`: what it reads after a restart of every node, when no leader serves the channel yet.
fn wait_hw_checkpointed(node: &Node, ch: &ChannelId, seq: Seq) {
    eventually(|| match node.channel_status(ch)? {
        Some(status) if status.hw_durable >= seq => Ok(()),
        _ => Err(NodeError::Busy(ch.clone())),
    });
}

/// The status of `ch`'s leading replica among `nodes`, once one leads (within the `eventually` deadline).
fn leader_status(nodes: &[Arc<Node>], ch: &ChannelId) -> tidings::node::ChannelStatus {
    eventually(|| {
        let statuses = nodes.iter().filter_map(|n| n.channel_status(ch).ok().flatten());
        statuses.into_iter().find(|s| s.role == tidings::channel::machine::RoleKind::Leader).ok_or(NodeError::Stopped)
    })
}

fn record(text: &str) -> Vec<AppendRecord> {
    vec![AppendRecord { idempotency_key: None, payload: Bytes::from(text.to_owned()) }]
}

fn channel(name: &str) -> ChannelId {
    ChannelId::new(ChannelType::GROUP, name).unwrap()
}

/// A one-node cluster under a temp dir, with `name` created on it: the dir and mesh it lives in (keep
/// them while it runs), the node and the channel.
fn one_node_with_channel(
    name: &str,
    tweak: impl Fn(&mut NodeConfig),
) -> (tempfile::TempDir, Arc<InProcessMesh>, Arc<Node>, ChannelId) {
    let dir = tempfile::tempdir().unwrap();
    let mesh = InProcessMesh::new();
    let ids = [NodeId::new(1)];
    let node = start(ids[0], &ids, dir.path(), &mesh, tweak);
    let ch = channel(name);
    create_channel(&node, &ch);
    (dir, mesh, node, ch)
}

/// Three nodes under a temp dir with `name` created: the dir and mesh they live in (keep them while
/// they run), their ids, the nodes and the channel.
fn three_nodes_with_channel(
    name: &str,
) -> (tempfile::TempDir, Arc<InProcessMesh>, Vec<NodeId>, Vec<Arc<Node>>, ChannelId) {
    let dir = tempfile::tempdir().unwrap();
    let mesh = InProcessMesh::new();
    let ids: Vec<NodeId> = (1..=3).map(NodeId::new).collect();
    let nodes: Vec<Arc<Node>> = ids.iter().map(|id| start(*id, &ids, dir.path(), &mesh, |_| {})).collect();
    let ch = channel(name);
    create_channel(&nodes[1], &ch);
    (dir, mesh, ids, nodes, ch)
}

#[test]
fn a_clean_stop_writes_the_last_hw_its_leader_knew_to_the_store() {
    // Appends one after another, then the node stops at once: no checkpoint fell due meanwhile (one
    // trails the HW by up to ~1.1 s), so only the stop's own writes put the last HW in the store.
    let (dir, mesh, node, ch) = one_node_with_channel("stopping", |_| {});
    let mut last = Seq::new(0);
    for i in 0..20 {
        last = eventually(|| node.append(ch.clone(), record(&format!("m{i}")))?.wait())[0];
    }
    let id = node.id();
    mesh.detach(id);
    drop(node);

    let node_dir = dir.path().join(id.to_string());
    let kv: Arc<dyn tidings::store::Kv> =
        Arc::new(tidings::store::SledKv::open(node_dir.join("sled"), 1 << 20).unwrap());
    let journal = JournalLog::open(node_dir.join("journal"), kv, JournalConfig::default()).unwrap();
    let stored = journal.state(&ch).unwrap();
    assert_eq!((stored.last_seq, stored.hw), (last, last), "the stored HW is the last one the leader knew");
}

#[test]
fn single_node_goes_through_the_same_path() {
    let (_dir, _mesh, node, ch) = one_node_with_channel("solo", |_| {});
    let seqs = eventually(|| node.append(ch.clone(), record("hello"))?.wait());
    let read = node.read(&ch, Seq::new(1), 10).unwrap();
    assert_eq!(read.len(), 1);
    let status = node.status().unwrap();
    assert_eq!(status.groups.len(), 2);
    assert!(status.groups.iter().any(|g| g.leader == Some(NodeId::new(1))), "{status:?}");
    let replica = status.channels.iter().find(|c| c.channel == ch).unwrap();
    assert_eq!(replica.role, tidings::channel::machine::RoleKind::Leader);
    assert!(replica.hw >= seqs[0]);
    assert_eq!(read[0].seq, seqs[0]);
    assert_eq!(read[0].payload, Bytes::from_static(b"hello"));
    // The message log's figures, for operators: the append went through a group commit, and its record
    // waits in memory for write-behind or is already stored in sled.
    let stats = node.message_log_stats();
    assert!(stats.syncs >= 1 && stats.frames >= 1, "{stats:?}");
    // (Read after `syncs`: a sync meanwhile may count once more here.)
    assert!(stats.sync_latency.count() >= stats.syncs, "each sync's latency is counted: {stats:?}");
    assert!(stats.sync_latency.percentile(0.99) > std::time::Duration::ZERO);
    assert!(stats.mem_bytes > 0 || stats.records_written_behind >= 1, "{stats:?}");
}

/// A record's timestamp is the leader's wall-clock time at its append, in ms since the Unix epoch (the
/// runtime's clock counts from the node's start; its records once carried that count, which a host
/// showed as dates in 1970).
#[test]
fn records_carry_the_wall_clock_time_of_their_append() {
    let unix_ms = || {
        let since = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap();
        u64::try_from(since.as_millis()).unwrap()
    };
    let (_dir, _mesh, node, ch) = one_node_with_channel("stamped", |_| {});
    std::thread::sleep(Duration::from_millis(300)); // so a count from the start could not pass either
    let before = unix_ms();
    let seqs = eventually(|| node.append(ch.clone(), record("now"))?.wait());
    let after = unix_ms();
    let read = node.read(&ch, seqs[0], 1).unwrap();
    // The origin is read to the millisecond and the elapsed time counted in whole ones.
    let stamped = read[0].timestamp_ms;
    assert!(before.saturating_sub(2) <= stamped && stamped <= after, "{before} <= {stamped} <= {after}");
}

/// An idle channel's replica is evicted, and its entry in the message log leaves memory once written
/// behind (a node does not hold every channel it ever wrote); reads and appends then read it back from
/// sled, and nothing is lost.
#[test]
fn an_evicted_channel_leaves_the_message_logs_memory_and_comes_back_from_sled() {
    let (_dir, _mesh, node, ch) =
        one_node_with_channel("cold", |config| config.channel_idle_evict = Duration::from_millis(300));
    let mut acked = Vec::new();
    for i in 0..3 {
        acked.extend(eventually(|| node.append(ch.clone(), record(&format!("m{i}")))?.wait()));
    }
    eventually(|| {
        let active = node.status()?.channels.iter().any(|c| c.channel == ch);
        let stats = node.message_log_stats();
        if active || stats.channels_in_memory > 0 {
            return Err(NodeError::Stopped);
        }
        Ok(())
    });
    assert!(node.message_log_stats().channels_dropped >= 1);
    // Not in memory: the reader thread answers from the HW the store holds.
    assert_eq!(node.latest(&ch).unwrap(), acked[2]);
    let read = node.read(&ch, Seq::new(1), 10).unwrap();
    let texts: Vec<&[u8]> = read.iter().filter(|r| acked.contains(&r.seq)).map(|r| r.payload.as_ref()).collect();
    assert_eq!(texts, [b"m0", b"m1", b"m2"]);
    let next = eventually(|| node.append(ch.clone(), record("m3"))?.wait())[0];
    assert!(next > acked[2], "the log went on from its stored state");
    let read = node.read(&ch, Seq::new(1), 10).unwrap();
    assert_eq!(read.last().map(|r| (r.seq, r.payload.clone())), Some((next, Bytes::from_static(b"m3"))));
    assert_eq!(read.iter().filter(|r| acked.contains(&r.seq)).count(), 3);
}

#[test]
fn a_node_asked_to_prepare_journal_spares_starts_with_them_and_serves() {
    let dir = tempfile::tempdir().unwrap();
    let mesh = InProcessMesh::new();
    let id = NodeId::new(1);
    let mut config = NodeConfig::new(id, vec![id]);
    config.slot_groups = 2;
    let mut storage = StorageOptions::new(dir.path().join("1"));
    storage.journal_spares_at_start = true;
    storage.journal.segment_bytes = 1 << 20;
    storage.journal.limits.batch_bytes_max = 64 << 10;
    let node = Arc::new(Node::start(config, storage, mesh.transport(id)).unwrap());
    mesh.attach(&node);
    // Two spares, and a third after one replaced the new journal's preallocated first segment.
    assert_eq!(node.message_log_stats().spares_filled, 3);
    let ch = channel("spared");
    create_channel(&node, &ch);
    let seqs = eventually(|| node.append(ch.clone(), record("first"))?.wait());
    assert_eq!(node.read(&ch, seqs[0], 1).unwrap()[0].payload, Bytes::from_static(b"first"));
}

#[test]
fn append_then_calls_back_once_with_the_seqs_or_with_stopped() {
    let (dir, mesh, node, ch) = one_node_with_channel("callbacks", |_| {});
    let first = eventually(|| node.append(ch.clone(), record("first"))?.wait())[0];
    let (done, outcomes) = std::sync::mpsc::channel();
    for i in 0..3 {
        let done = done.clone();
        node.append_then(ch.clone(), record(&format!("then {i}")), move |result| done.send((i, result)).unwrap())
            .unwrap();
    }
    drop(done);
    let mut seqs: Vec<(i32, Vec<Seq>)> = outcomes.iter().map(|(i, result)| (i, result.unwrap())).collect();
    seqs.sort();
    // One call each, in the order the appends were made (seqs follow request order).
    let after = |n: u64| vec![Seq::new(first.get() + n)];
    assert_eq!(seqs, vec![(0, after(1)), (1, after(2)), (2, after(3))]);
    drop(node);

    // A node alone in a three-node cluster learns no channel meta: its append waits, then the node stops.
    let ids: Vec<NodeId> = (1..=3).map(NodeId::new).collect();
    let lonely = start(ids[0], &ids, &dir.path().join("lonely"), &mesh, |_| {});
    let (done, outcome) = std::sync::mpsc::channel();
    lonely.append_then(channel("nowhere"), record("lost"), move |result| done.send(result).unwrap()).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    assert!(outcome.try_recv().is_err(), "nothing to answer yet");
    mesh.detach(ids[0]);
    drop(lonely);
    assert!(matches!(outcome.recv_timeout(Duration::from_secs(5)), Ok(Err(NodeError::Stopped))));
    assert!(outcome.recv_timeout(Duration::from_millis(100)).is_err(), "called exactly once");
}

/// Runs `future` to completion on this thread, parked until its waker is called (a stand-in for the
/// host's async runtime).
fn block_on<F: std::future::Future>(future: F) -> F::Output {
    struct Unpark(std::thread::Thread);
    impl std::task::Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = std::task::Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut context = std::task::Context::from_waker(&waker);
    let mut future = std::pin::pin!(future);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let std::task::Poll::Ready(output) = future.as_mut().poll(&mut context) {
            return output;
        }
        assert!(Instant::now() < deadline, "never woken");
        std::thread::park_timeout(Duration::from_secs(1));
    }
}

#[test]
fn awaited_appends_and_metadata_writes_complete_with_their_outcome_or_with_stopped() {
    let dir = tempfile::tempdir().unwrap();
    let mesh = InProcessMesh::new();
    let ids = [NodeId::new(1)];
    let node = start(ids[0], &ids, dir.path(), &mesh, |_| {});
    let ch = channel("awaited");
    eventually(|| {
        block_on(node.create_channel_async(ChannelInfo { channel: ch.clone(), flags: ChannelFlags::default() }))
    });
    let first = eventually(|| block_on(node.append(ch.clone(), record("first"))?))[0];
    // A metadata write's outcome, awaited: applied, or refused with its reason.
    let sender = Uid::new("user-1").unwrap();
    let banned = User { uid: sender.clone(), name: "One".into(), banned: true };
    block_on(node.propose_async(Command::PutUser(banned))).unwrap();
    block_on(node.read_barrier_async(RouteKey::Uid(sender.clone()))).unwrap();
    assert!(node.local_reader().user(&sender).unwrap().is_some_and(|user| user.banned), "read after the barrier");
    let refused = node.append_from(ch.clone(), sender.clone(), record("x")).unwrap().wait();
    assert!(matches!(refused, Err(NodeError::SenderBanned(_))), "{refused:?}");
    let again =
        block_on(node.create_channel_async(ChannelInfo { channel: ch.clone(), flags: ChannelFlags::default() }));
    assert!(matches!(again, Err(NodeError::NotApplied(Outcome::AlreadyExists))), "the channel exists: {again:?}");
    block_on(node.propose_async(Command::PutUser(User { uid: sender.clone(), name: "One".into(), banned: false })))
        .unwrap();
    let handles: Vec<_> = (0..3)
        .map(|i| node.append_from(ch.clone(), sender.clone(), record(&format!("awaited {i}"))).unwrap())
        .collect();
    let seqs: Vec<Seq> = handles.into_iter().map(|handle| block_on(handle).unwrap()[0]).collect();
    assert_eq!(seqs, (1..=3).map(|n| Seq::new(first.get() + n)).collect::<Vec<_>>());
    drop(node);

    // A node alone in a three-node cluster learns no channel meta: the append waits until the node stops.
    let ids: Vec<NodeId> = (1..=3).map(NodeId::new).collect();
    let lonely = start(ids[0], &ids, &dir.path().join("lonely"), &mesh, |_| {});
    let pending = lonely.append(channel("nowhere"), record("lost")).unwrap();
    let stopping = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(100));
        mesh.detach(ids[0]);
        drop(lonely);
    });
    assert!(matches!(block_on(pending), Err(NodeError::Stopped)));
    stopping.join().unwrap();
}

#[test]
fn reads_come_in_pages_no_larger_than_the_node_allows_and_can_be_awaited() {
    let (_dir, _mesh, node, ch) = one_node_with_channel("paged", |config| config.read_records_max = 5);
    let texts: Vec<String> = (0..12).map(|i| format!("m{i}")).collect();
    let records = texts
        .iter()
        .map(|text| AppendRecord { idempotency_key: None, payload: Bytes::from(text.clone()) })
        .collect::<Vec<_>>();
    let seqs = eventually(|| node.append(ch.clone(), records.clone())?.wait());
    let (mut from, mut pages, mut read) = (Seq::new(1), Vec::new(), Vec::new());
    loop {
        let page = node.read(&ch, from, 100).unwrap();
        let Some(last) = page.last() else { break };
        from = last.seq.next();
        pages.push(page.len());
        read.extend(page.into_iter().map(|r| (r.seq, String::from_utf8(r.payload.to_vec()).unwrap())));
    }
    assert_eq!(pages, vec![5, 5, 2], "at most read_records_max per page, whatever the limit asked");
    assert_eq!(read, seqs.iter().copied().zip(texts).collect::<Vec<_>>(), "every message once, in order");
    assert_eq!(block_on(node.latest_async(&ch)).unwrap(), seqs[11]);
    let awaited = block_on(node.read_async(&ch, seqs[10], 100)).unwrap();
    assert_eq!(awaited.iter().map(|r| r.seq).collect::<Vec<_>>(), seqs[10..].to_vec());
    let unknown = block_on(node.read_async(&channel("nowhere"), Seq::new(1), 10));
    assert!(matches!(unknown, Err(NodeError::UnknownChannel(_))), "{unknown:?}");
}

#[test]
fn a_ready_node_takes_metadata_writes_at_once_and_one_without_its_peers_never_gets_ready() {
    let dir = tempfile::tempdir().unwrap();
    let mesh = InProcessMesh::new();
    let ids: Vec<NodeId> = (1..=3).map(NodeId::new).collect();
    let nodes: Vec<Arc<Node>> = ids.iter().map(|id| start(*id, &ids, dir.path(), &mesh, |_| {})).collect();
    for node in &nodes {
        node.wait_ready(Duration::from_secs(20)).unwrap();
        assert!(node.status().unwrap().groups.iter().all(|g| g.leader.is_some()));
    }
    // No retry loop: every group knows its leader.
    for (i, node) in nodes.iter().enumerate() {
        let user = User { uid: Uid::new(format!("ready-{i}")).unwrap(), name: "Ready".into(), banned: false };
        node.propose(Command::PutUser(user)).unwrap();
    }
    drop(nodes);

    let alone = start(ids[0], &ids, &dir.path().join("alone"), &mesh, |_| {});
    let waited = alone.wait_ready(Duration::from_millis(500));
    assert!(matches!(waited, Err(NodeError::TimedOut)), "{waited:?}");
}

#[test]
fn three_nodes_forward_from_non_leaders_and_survive_a_restart() {
    let (dir, mesh, ids, mut nodes, ch) = three_nodes_with_channel("shared");
    let mut acked = Vec::new();
    for (i, node) in nodes.iter().cycle().take(30).enumerate() {
        let text = format!("m{i}");
        let seq = eventually(|| node.append(ch.clone(), record(&text))?.wait())[0];
        acked.push((seq, text));
    }
    // Stop every node and restart from the data directories. The channel's old leader will not lead its
    // old epoch again (that takes a failover), so the acknowledged messages are read from a follower,
    // bounded by the HW it checkpointed: first let it learn the final HW (an idle follower pulls every
    // 2 s) and checkpoint it (within about 1 s when idle), as its status shows.
    let follower = NodeConfig::new(ids[0], ids.clone()).channel_placement(&ch)[1];
    let index = usize::try_from(follower.get() - 1).unwrap();
    wait_hw_checkpointed(&nodes[index], &ch, acked.iter().map(|(seq, _)| *seq).max().unwrap());
    ids.iter().for_each(|id| mesh.detach(*id));
    nodes.clear();
    let nodes: Vec<Arc<Node>> = ids.iter().map(|id| start(*id, &ids, dir.path(), &mesh, |_| {})).collect();
    reads_back_every_acked(&nodes[index], &ch, &acked);
    // And the channel takes appends again, after what was acknowledged before.
    let after = eventually(|| nodes[0].append(ch.clone(), record("after"))?.wait())[0];
    assert!(acked.iter().all(|(seq, _)| *seq < after), "{after} after {acked:?}");
}

#[test]
fn a_node_that_hands_off_its_leaderships_stops_without_its_channel_missing_an_append() {
    let (_dir, mesh, ids, mut nodes, ch) = three_nodes_with_channel("planned");
    let leader = NodeConfig::new(ids[0], ids.clone()).channel_placement(&ch)[0];
    let index = |id: NodeId| usize::try_from(id.get() - 1).unwrap();
    let mut acked = Vec::new();
    for i in 0..10 {
        let text = format!("before-{i}");
        acked.push((eventually(|| nodes[index(leader)].append(ch.clone(), record(&text))?.wait())[0], text));
    }

    nodes[index(leader)].hand_off_leaderships(Duration::from_secs(20)).expect("handed off");
    let status = nodes[index(leader)].status().unwrap();
    assert!(status.leaving && status.channels_leading == 0, "{status:?}");
    assert!(status.groups.iter().all(|g| g.leader != Some(leader)), "{:?}", status.groups);
    mesh.detach(leader);
    drop(nodes.remove(index(leader)));

    // The channel's new leader took over before the stop: the first try commits.
    for (i, node) in nodes.iter().cycle().take(10).enumerate() {
        let text = format!("after-{i}");
        let seqs = node.append(ch.clone(), record(&text)).and_then(|handle| handle.wait());
        acked.push((seqs.unwrap_or_else(|error| panic!("{text}: {error}"))[0], text));
    }
    reads_back_every_acked(&nodes[0], &ch, &acked);

    // Nothing can take over from a node alone: the wait runs out, and says so.
    let (_dir, _mesh, single, _) = one_node_with_channel("alone", |_| {});
    assert!(matches!(single.hand_off_leaderships(Duration::from_millis(300)), Err(NodeError::TimedOut)));
}

#[test]
fn channels_on_several_reactors_take_forwarded_appends_and_show_in_one_status_and_each_alone() {
    let dir = tempfile::tempdir().unwrap();
    let mesh = InProcessMesh::new();
    let ids: Vec<NodeId> = (1..=3).map(NodeId::new).collect();
    let nodes: Vec<Arc<Node>> = ids
        .iter()
        .map(|id| {
            start(*id, &ids, dir.path(), &mesh, |config| {
                config.reactors = 3;
                config.status_channels_max = 5;
            })
        })
        .collect();
    assert!(nodes.iter().all(|node| node.reactors() == 3));
    let channels: Vec<ChannelId> = (0..12).map(|i| channel(&format!("reactor-{i}"))).collect();
    for ch in &channels {
        create_channel(&nodes[0], ch);
    }
    // Through every node: two of three forward to the leader's reactor, whose reply finds the reactor
    // of the forwarding node that holds the caller.
    for ch in &channels {
        for (n, node) in nodes.iter().enumerate() {
            let text = format!("{ch} via n{}", n + 1);
            eventually(|| node.append(ch.clone(), record(&text))?.wait());
        }
    }
    for ch in &channels {
        let leader = NodeConfig::new(ids[0], ids.clone()).channel_placement(ch)[0];
        let node = &nodes[usize::try_from(leader.get() - 1).unwrap()];
        let texts: BTreeSet<Vec<u8>> =
            node.read(ch, Seq::new(1), 10).unwrap().into_iter().map(|r| r.payload.to_vec()).collect();
        let expected: BTreeSet<Vec<u8>> = (1..=3).map(|n| format!("{ch} via n{n}").into_bytes()).collect();
        assert_eq!(texts, expected, "{ch}");
        assert!(node.latest(ch).unwrap() >= Seq::new(3));
    }
    // One status for the node: every reactor's replicas counted, the first five in channel order
    // listed; pages of at most five list them all.
    let mut sorted = channels.clone();
    sorted.sort();
    let status = nodes[0].status().unwrap();
    assert_eq!(status.channels_active, channels.len());
    let listed: Vec<&ChannelId> = status.channels.iter().map(|c| &c.channel).collect();
    assert_eq!(listed, sorted.iter().take(5).collect::<Vec<_>>());
    let mut paged: Vec<ChannelId> = Vec::new();
    for _ in 0..=channels.len() {
        let page = nodes[0].channel_statuses(paged.last(), 100).unwrap();
        assert!(page.len() <= 5);
        if page.is_empty() {
            break;
        }
        paged.extend(page.into_iter().map(|c| c.channel));
    }
    assert_eq!(paged, sorted, "every replica once, in channel order");
    // One channel's status from its reactor alone: the leader hears both followers catch up (their
    // acknowledging pulls follow their durable writes); a follower reports no one's progress. A slow
    // machine may have shrunk a follower out of the ISR on the way; caught up, it is taken back in.
    for ch in &channels {
        let placement = NodeConfig::new(ids[0], ids.clone()).channel_placement(ch);
        let node_of = |id: NodeId| &nodes[usize::try_from(id.get() - 1).unwrap()];
        let leader = eventually(|| match node_of(placement[0]).channel_status(ch)? {
            Some(s) if s.replicas.iter().all(|r| r.lag == 0 && r.in_isr && r.match_seq == s.log_end) => Ok(s),
            _ => Err(NodeError::Stopped),
        });
        assert_eq!(leader.role, tidings::channel::machine::RoleKind::Leader);
        let mut followers = placement[1..].to_vec();
        followers.sort();
        assert_eq!(leader.replicas.iter().map(|r| r.node).collect::<Vec<_>>(), followers, "in node order");
        assert!(leader.replicas.iter().all(|r| r.in_isr && r.match_seq == leader.log_end), "{leader:?}");
        assert_eq!(leader.pending_appends, 0);
        let follower = node_of(placement[1]).channel_status(ch).unwrap().expect("an active follower");
        assert!(follower.replicas.is_empty(), "{follower:?}");
    }
    assert_eq!(nodes[0].channel_status(&channel("never-created")).unwrap(), None);
}

#[test]
fn a_flood_gets_typed_busy_errors_not_unbounded_queues() {
    let dir = tempfile::tempdir().unwrap();
    let mesh = InProcessMesh::new();
    let ids = [NodeId::new(1)];
    let node = start(ids[0], &ids, dir.path(), &mesh, |config| {
        config.machine.pending_records_max = 8;
        config.machine.request_records_max = 4;
        config.machine.handoff_slots = 8;
    });
    let ch = channel("flood");
    create_channel(&node, &ch);
    eventually(|| node.append(ch.clone(), record("warm-up"))?.wait());
    let handles: Vec<_> = (0..200).map(|i| node.append(ch.clone(), record(&format!("f{i}"))).unwrap()).collect();
    let mut busy = 0;
    let mut ok = 0;
    for handle in handles {
        match handle.wait() {
            Ok(_) => ok += 1,
            // Every bound answers with its own typed busy error: the machine's pending queue, the channel's
            // hand-off slots, or the queue of appends waiting for the channel's meta.
            Err(NodeError::Append(AppendError::Busy | AppendError::ChannelBusy) | NodeError::Busy(_)) => busy += 1,
            Err(other) => panic!("unexpected {other}"),
        }
    }
    assert!(ok > 0 && busy > 0, "ok {ok}, busy {busy}");
}

/// Presence: `user-0` .. `user-3` online on node 1, the rest offline. Refuses every plan's first offer so
/// the retry path runs, and records what it took.
#[derive(Default)]
struct RecordingHost {
    offered: parking_lot::Mutex<BTreeSet<u64>>,
    taken: parking_lot::Mutex<Vec<(Seq, String)>>,
    own_messages: parking_lot::Mutex<Vec<(Seq, String)>>,
}

impl FanoutHost for RecordingHost {
    fn locate(&self, uids: &[String]) -> Vec<Option<NodeId>> {
        uids.iter()
            .map(|uid| ["user-0", "user-1", "user-2", "user-3"].contains(&uid.as_str()).then_some(NodeId::new(1)))
            .collect()
    }

    fn deliver(&self, plan: &DeliveryPlan) -> bool {
        if self.offered.lock().insert(plan.id) {
            return false;
        }
        self.taken.lock().extend(plan.members.iter().map(|m| (plan.message.seq, m.uid.clone())));
        let own = plan.members.iter().filter(|m| m.is_sender).map(|m| (plan.message.seq, m.uid.clone()));
        self.own_messages.lock().extend(own);
        true
    }
}

/// `Node::append_from_then` from `sender`, waiting for its callback.
fn append_from_then(node: &Node, ch: &ChannelId, sender: &str, text: &str) -> Result<Vec<Seq>, NodeError> {
    let (done, outcome) = std::sync::mpsc::channel();
    node.append_from_then(ch.clone(), Uid::new(sender).unwrap(), record(text), move |result| drop(done.send(result)))?;
    outcome.recv_timeout(Duration::from_secs(30)).expect("called back once")
}

#[test]
fn committed_messages_fan_out_once_to_online_allowed_subscribers_and_senders_are_checked() {
    let dir = tempfile::tempdir().unwrap();
    let mesh = InProcessMesh::new();
    let ids: Vec<NodeId> = (1..=3).map(NodeId::new).collect();
    let host = Arc::new(RecordingHost::default());
    let nodes: Vec<Arc<Node>> = ids
        .iter()
        .map(|id| start_with(*id, &ids, dir.path(), &mesh, |_| {}, |_| {}, Some(host.clone() as Arc<dyn FanoutHost>)))
        .collect();
    let ch = channel("fanout");
    create_channel(&nodes[0], &ch);
    let uids: Vec<Uid> = (0..6).map(|u| Uid::new(format!("user-{u}")).unwrap()).collect();
    let add = Command::AddMembers { channel: ch.clone(), list: MemberList::Subscribers, uids };
    eventually(|| nodes[0].propose(add.clone()));
    let deny =
        Command::AddMembers { channel: ch.clone(), list: MemberList::Deny, uids: vec![Uid::new("user-1").unwrap()] };
    eventually(|| nodes[0].propose(deny.clone()));
    let banned = User { uid: Uid::new("user-5").unwrap(), name: "Banned".into(), banned: true };
    eventually(|| nodes[0].propose(Command::PutUser(banned.clone())));
    // Every replica must know the subscribers and the ban before the leader plans (pages and sender
    // checks come from its local store).
    applied_everywhere(&nodes, &[RouteKey::Channel(ch.clone()), RouteKey::Uid(banned.uid.clone())]);
    let mut seqs = Vec::new();
    for i in 0..10 {
        seqs.push(eventually(|| nodes[i % 3].append(ch.clone(), record(&format!("m{i}")))?.wait())[0]);
    }
    // user-2 sends two messages from different nodes: its own entries are marked.
    let mut sent_by_user_2 = Vec::new();
    // The second through the callback form.
    let sender = Uid::new("user-2").unwrap();
    sent_by_user_2.push(eventually(|| nodes[0].append_from(ch.clone(), sender.clone(), record("mine"))?.wait())[0]);
    sent_by_user_2.push(eventually(|| append_from_then(&nodes[1], &ch, "user-2", "mine"))[0]);
    seqs.extend(&sent_by_user_2);
    let refused = nodes[1].append_from(ch.clone(), Uid::new("user-5").unwrap(), record("x")).unwrap().wait();
    assert!(matches!(refused, Err(NodeError::SenderBanned(_))), "{refused:?}");
    let refused = nodes[2].append_from(ch.clone(), Uid::new("user-1").unwrap(), record("x")).unwrap().wait();
    assert!(matches!(refused, Err(NodeError::SenderDenied(_))), "{refused:?}");
    let refused = append_from_then(&nodes[0], &ch, "user-5", "x");
    assert!(matches!(refused, Err(NodeError::SenderBanned(_))), "{refused:?}");
    let refused = append_from_then(&nodes[2], &ch, "user-1", "x");
    assert!(matches!(refused, Err(NodeError::SenderDenied(_))), "{refused:?}");
    let expected: BTreeSet<(Seq, String)> =
        seqs.iter().flat_map(|seq| ["user-0", "user-2", "user-3"].map(|uid| (*seq, uid.to_owned()))).collect();
    let deadline = Instant::now() + Duration::from_secs(20);
    while host.taken.lock().len() < expected.len() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(200)); // Anything extra would show up by now.
    let taken = host.taken.lock().clone();
    let distinct: BTreeSet<(Seq, String)> = taken.iter().cloned().collect();
    assert_eq!(distinct.len(), taken.len(), "a member got a message twice: {taken:?}");
    assert_eq!(distinct, expected, "offline, denied or missing members");
    let own: BTreeSet<(Seq, String)> = host.own_messages.lock().iter().cloned().collect();
    let expected_own: BTreeSet<(Seq, String)> = sent_by_user_2.iter().map(|seq| (*seq, "user-2".to_owned())).collect();
    assert_eq!(own, expected_own, "only the sender's own entries are marked");
}

/// One node's gateway: every member online; while `held`, a delivery waits (the node's fanout is stuck)
/// and is then refused; once `crashed`, every delivery is refused (a retry cannot slip through while
/// the node stops). Deliveries taken go to a log shared by every node's gateway.
struct GateHost {
    held: std::sync::atomic::AtomicBool,
    crashed: std::sync::atomic::AtomicBool,
    waiting: std::sync::atomic::AtomicBool,
    taken: Arc<parking_lot::Mutex<Vec<(Seq, String)>>>,
}

impl FanoutHost for GateHost {
    fn locate(&self, uids: &[String]) -> Vec<Option<NodeId>> {
        vec![Some(NodeId::new(1)); uids.len()]
    }

    fn deliver(&self, plan: &DeliveryPlan) -> bool {
        use std::sync::atomic::Ordering::SeqCst;
        if self.held.load(SeqCst) {
            self.waiting.store(true, SeqCst);
            while self.held.load(SeqCst) && !self.crashed.load(SeqCst) {
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        if self.held.load(SeqCst) || self.crashed.load(SeqCst) {
            return false;
        }
        self.taken.lock().extend(plan.members.iter().map(|m| (plan.message.seq, m.uid.clone())));
        true
    }
}

#[test]
fn a_message_whose_leader_crashed_before_its_fanout_ended_reaches_every_subscriber_through_the_next() {
    use std::sync::atomic::Ordering::SeqCst;
    let dir = tempfile::tempdir().unwrap();
    let mesh = InProcessMesh::new();
    let ids: Vec<NodeId> = (1..=3).map(NodeId::new).collect();
    let taken = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let hosts: Vec<Arc<GateHost>> = ids
        .iter()
        .map(|_| {
            let (held, crashed, waiting) = (false.into(), false.into(), false.into());
            Arc::new(GateHost { held, crashed, waiting, taken: taken.clone() })
        })
        .collect();
    let mut nodes: Vec<Option<Arc<Node>>> = ids
        .iter()
        .zip(&hosts)
        .map(|(id, host)| Some(start_with(*id, &ids, dir.path(), &mesh, |_| {}, |_| {}, Some(host.clone() as _))))
        .collect();
    let node = |nodes: &[Option<Arc<Node>>], i: usize| nodes[i].clone().expect("running");
    let ch = channel("stuck-fanout");
    create_channel(&node(&nodes, 0), &ch);
    let subscribers: Vec<Uid> = (0..3).map(|u| Uid::new(format!("user-{u}")).unwrap()).collect();
    let add = Command::AddMembers { channel: ch.clone(), list: MemberList::Subscribers, uids: subscribers };
    eventually(|| node(&nodes, 0).propose(add.clone()));
    // (The clones go at once: the leader's node must stop when the test drops it below.)
    applied_everywhere(&nodes.iter().flatten().cloned().collect::<Vec<_>>(), &[RouteKey::Channel(ch.clone())]);
    let leader = usize::try_from(NodeConfig::new(ids[0], ids.clone()).channel_placement(&ch)[0].get() - 1).unwrap();
    let other = (leader + 1) % 3;
    hosts[leader].held.store(true, SeqCst);
    let seq = eventually(|| node(&nodes, other).append(ch.clone(), record("stuck"))?.wait())[0];
    let deadline = Instant::now() + Duration::from_secs(20);
    while !hosts[leader].waiting.load(SeqCst) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(hosts[leader].waiting.load(SeqCst), "the leader's fanout reached its gateway");
    // The followers hear the leader's answers meanwhile: its fanout has not finished this message.
    std::thread::sleep(Duration::from_millis(1_000));
    // The leader crashes: nothing it sends from now on arrives; its stuck delivery is refused.
    mesh.isolate(ids[leader]);
    hosts[leader].crashed.store(true, SeqCst);
    nodes[leader] = None;
    let reached = |taken: &[(Seq, String)]| taken.iter().filter(|(s, _)| *s == seq).count();
    let deadline = Instant::now() + Duration::from_secs(20);
    while reached(&taken.lock()) < 3 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(reached(&taken.lock()), 3, "every subscriber gets the message through the next leader");
    let planned_again: u64 =
        nodes.iter().flatten().map(|n| n.status().map(|s| s.fanout_planned_again).unwrap_or(0)).sum();
    assert!(planned_again >= 1, "the next leader planned it again");
}

#[test]
fn authoritative_metadata_reads_see_acknowledged_writes_and_latest_is_the_hw() {
    let dir = tempfile::tempdir().unwrap();
    let mesh = InProcessMesh::new();
    let ids: Vec<NodeId> = (1..=3).map(NodeId::new).collect();
    let nodes: Vec<Arc<Node>> = ids.iter().map(|id| start(*id, &ids, dir.path(), &mesh, |_| {})).collect();
    for round in 0..5 {
        let uid = Uid::new(format!("reader-{round}")).unwrap();
        let user = User { uid: uid.clone(), name: format!("round {round}"), banned: false };
        eventually(|| nodes[round % 3].propose(Command::PutUser(user.clone())));
        // Right after the acknowledgement, on another node: the authoritative read sees it.
        let other = &nodes[(round + 1) % 3];
        let read = eventually(|| other.authoritative_reader(RouteKey::Uid(uid.clone())));
        assert_eq!(read.user(&uid).unwrap(), Some(user), "round {round}");
    }
    let ch = channel("latest");
    create_channel(&nodes[0], &ch);
    let mut last = Seq::new(0);
    for i in 0..5 {
        last = eventually(|| nodes[i % 3].append(ch.clone(), record("x"))?.wait())[0];
    }
    let leader = NodeConfig::new(ids[0], ids.clone()).channel_placement(&ch)[0];
    let on_leader = nodes[usize::try_from(leader.get() - 1).unwrap()].latest(&ch).unwrap();
    assert_eq!(on_leader, last);
    assert!(nodes[0].local_reader().channel(&ch).unwrap().is_some());
}

#[test]
fn a_config_that_would_count_healthy_idle_followers_as_dead_is_refused_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let mesh = InProcessMesh::new();
    let id = NodeId::new(1);
    let mut config = NodeConfig::new(id, vec![id]);
    // An idle follower may stay silent for the 3 s long poll plus a 4 s idle wait: 6 s is too short a
    // window, and the first append after a quiet spell would get `NotEnoughReplicas`.
    config.machine.idle_pull_interval = Duration::from_secs(4);
    config.machine.isr_alive = Duration::from_secs(6);
    let refused = Node::start(config, StorageOptions::new(dir.path().join("1")), mesh.transport(id)).err();
    assert!(matches!(refused, Some(NodeError::Storage(tidings::store::StoreError::BadConfig { .. }))), "{refused:?}");
}

/// Storage options and runtime queue sizes that cannot run are refused at start with the rule they
/// break, and nothing is created in the data directory.
#[test]
fn storage_options_and_queue_sizes_that_cannot_run_are_refused_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let mesh = InProcessMesh::new();
    let id = NodeId::new(1);
    type Breaks = fn(&mut NodeConfig, &mut StorageOptions);
    let broken: [(Breaks, &str); 5] = [
        (|_, s| s.durable_workers = 0, "durable_workers, durable_queue_max and read_queue_max must be positive"),
        (|_, s| s.durable_queue_max = 0, "durable_workers, durable_queue_max and read_queue_max must be positive"),
        (|_, s| s.read_queue_max = 0, "durable_workers, durable_queue_max and read_queue_max must be positive"),
        (|c, _| c.inbox_max = 0, "inbox_max and mailbox_max must be between 1 and 16,777,216"),
        (
            |c, _| c.mailbox_max = tidings::node::QUEUE_CAPACITY_MAX + 1,
            "inbox_max and mailbox_max must be between 1 and 16,777,216",
        ),
    ];
    for (breaks, rule) in broken {
        let (mut config, mut storage) = (NodeConfig::new(id, vec![id]), StorageOptions::new(dir.path().join("1")));
        breaks(&mut config, &mut storage);
        match Node::start(config, storage, mesh.transport(id)) {
            Err(NodeError::Storage(tidings::store::StoreError::BadConfig { what })) => assert_eq!(what, rule),
            Err(other) => panic!("{rule}: refused for another reason: {other}"),
            Ok(_) => panic!("{rule}: started"),
        }
        assert!(!dir.path().join("1").exists(), "{rule}: nothing created");
    }
}

#[test]
fn five_real_nodes_fan_out_and_check_senders_across_slot_groups() {
    // Slot groups of three on five nodes: the reads go through the real runtime's paths — a page read
    // on a peer's fanout worker, a sender check handed from a reactor to the core and back.
    let dir = tempfile::tempdir().unwrap();
    let mesh = InProcessMesh::new();
    let ids: Vec<NodeId> = (1..=5).map(NodeId::new).collect();
    let host = Arc::new(RecordingHost::default());
    let tweak = |config: &mut NodeConfig| config.slot_replicas = 3;
    let nodes: Vec<Arc<Node>> = ids
        .iter()
        .map(|id| start_with(*id, &ids, dir.path(), &mesh, tweak, |_| {}, Some(host.clone() as Arc<dyn FanoutHost>)))
        .collect();
    let config = NodeConfig { slot_groups: 2, slot_replicas: 3, ..NodeConfig::new(ids[0], ids.clone()) };
    let members = config.slot_group_members();
    let keeps = |node: NodeId, key: &[u8]| {
        let group = config.table().group_of_key(key);
        members.iter().any(|(g, m)| *g == group && m.contains(&node))
    };
    // A channel led outside its slot group, and a node keeping neither its group nor user-0's.
    let ch = (0..)
        .map(|i| channel(&format!("wide-{i}")))
        .find(|c| !keeps(config.channel_placement(c)[0], c.route_key()))
        .unwrap();
    let outsider = ids
        .iter()
        .copied()
        .find(|n| !keeps(*n, ch.route_key()) && !keeps(*n, b"user-0"))
        .expect("with groups of three on five nodes, some node keeps neither group");
    create_channel(&nodes[0], &ch);
    let uids: Vec<Uid> = ["user-0", "user-1", "user-5"].iter().map(|u| Uid::new(*u).unwrap()).collect();
    let add = Command::AddMembers { channel: ch.clone(), list: MemberList::Subscribers, uids };
    eventually(|| nodes[0].propose(add.clone()));
    let banned = User { uid: Uid::new("user-5").unwrap(), name: "Banned".into(), banned: true };
    eventually(|| nodes[0].propose(Command::PutUser(banned.clone())));
    applied_everywhere(&nodes, &[RouteKey::Channel(ch.clone()), RouteKey::Uid(banned.uid.clone())]);

    let leader = usize::try_from(config.channel_placement(&ch)[0].get() - 1).unwrap();
    let seq = eventually(|| nodes[leader].append(ch.clone(), record("to everyone"))?.wait())[0];
    let via = &nodes[usize::try_from(outsider.get() - 1).unwrap()];
    eventually(|| via.append_from(ch.clone(), Uid::new("user-0").unwrap(), record("mine"))?.wait());
    let refused = via.append_from(ch.clone(), Uid::new("user-5").unwrap(), record("x")).unwrap().wait();
    assert!(matches!(refused, Err(NodeError::SenderBanned(_))), "{refused:?}");
    // user-0 .. user-3 are online (RecordingHost); user-5 is not.
    let expected: BTreeSet<(Seq, String)> = ["user-0", "user-1"].iter().map(|u| (seq, (*u).to_owned())).collect();
    let deadline = Instant::now() + Duration::from_secs(20);
    let got = loop {
        let got: BTreeSet<(Seq, String)> = host.taken.lock().iter().filter(|(s, _)| *s == seq).cloned().collect();
        if got == expected || Instant::now() > deadline {
            break got;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(got, expected, "the leader outside the subscribers' group fanned out");
}

#[test]
fn records_given_up_through_any_node_stop_being_readable_everywhere_and_stay_given_up_after_a_restart() {
    let (dir, mesh, ids, mut nodes, ch) = three_nodes_with_channel("retained");
    let seqs: Vec<Seq> =
        (0..10).map(|i| eventually(|| nodes[i % 3].append(ch.clone(), record(&format!("m{i}")))?.wait())[0]).collect();
    let placement = NodeConfig::new(ids[0], ids.clone()).channel_placement(&ch);
    let follower = &nodes[usize::try_from(placement[1].get() - 1).unwrap()];
    let leader = &nodes[usize::try_from(placement[0].get() - 1).unwrap()];
    let hw = leader.latest(&ch).unwrap();
    assert_eq!(hw, *seqs.last().unwrap());

    // Past the high watermark: refused by the leader, forwarded or not; nothing changes.
    let beyond = hw.next();
    for node in [leader, follower] {
        match node.set_retention(ch.clone(), beyond) {
            Err(NodeError::Append(AppendError::BeyondHw { through, hw: at })) => {
                assert_eq!((through, at), (beyond, hw))
            }
            other => panic!("expected BeyondHw, got {other:?}"),
        }
    }
    // Through a follower (forwarded to the leader): the first five messages go.
    let boundary = seqs[4];
    assert_eq!(follower.set_retention(ch.clone(), boundary).unwrap(), boundary);
    assert_eq!(
        leader.read(&ch, Seq::new(1), 100).unwrap().first().map(|r| r.seq),
        Some(seqs[5]),
        "at once on the leader"
    );
    for node in &nodes {
        let read = eventually(|| {
            // A follower reads up to the HW it knows, which may lag the leader's a little.
            let read = node.read(&ch, Seq::new(1), 100)?;
            if read.first().map(|r| r.seq) != Some(seqs[5]) || read.last().map(|r| r.seq) != Some(hw) {
                return Err(NodeError::Stopped);
            }
            Ok(read)
        });
        assert_eq!(read.iter().map(|r| r.seq).collect::<Vec<_>>(), seqs[5..].to_vec(), "node {}", node.id());
    }
    // Never back: a lower boundary answers the one in force.
    assert_eq!(leader.set_retention(ch.clone(), seqs[1]).unwrap(), boundary);

    // After a restart of every node, the boundary holds (it is the channel's meta) and the rest reads back.
    let reader = usize::try_from(placement[1].get() - 1).unwrap();
    wait_hw_checkpointed(&nodes[reader], &ch, hw);
    ids.iter().for_each(|id| mesh.detach(*id));
    nodes.clear();
    let nodes: Vec<Arc<Node>> = ids.iter().map(|id| start(*id, &ids, dir.path(), &mesh, |_| {})).collect();
    let reader = &nodes[reader];
    let read = eventually(|| {
        let read = reader.read(&ch, Seq::new(1), 100)?;
        if read.len() < seqs.len() - 5 {
            return Err(NodeError::Stopped);
        }
        Ok(read)
    });
    assert_eq!(read.iter().map(|r| r.seq).collect::<Vec<_>>(), seqs[5..].to_vec());
}

#[test]
fn a_replica_moved_off_a_real_node_has_its_log_forgotten_there_and_nothing_is_lost() {
    let dir = tempfile::tempdir().unwrap();
    let mesh = InProcessMesh::new();
    let ids: Vec<NodeId> = (1..=4).map(NodeId::new).collect();
    // A pass of the stray-log sweep every half second (by default every 10 minutes).
    let quick = |config: &mut NodeConfig| {
        config.stray_logs.pass_interval = Duration::from_millis(500);
        config.stray_logs.page_interval = Duration::from_millis(100);
    };
    let nodes: Vec<Arc<Node>> = ids.iter().map(|id| start(*id, &ids, dir.path(), &mesh, quick)).collect();
    let node = |id: NodeId| &nodes[usize::try_from(id.get() - 1).unwrap()];
    let ch = channel("moved-off");
    create_channel(&nodes[0], &ch);
    let mut acked = Vec::new();
    for i in 0..20 {
        let text = format!("m{i}");
        acked.push((eventually(|| nodes[0].append(ch.clone(), record(&text))?.wait())[0], text));
    }
    let leading = leader_status(&nodes, &ch);
    let from = *leading.isr.iter().find(|n| **n != leading.leader).unwrap();
    let spare = *ids.iter().find(|n| !leading.isr.contains(n)).unwrap();
    let report = eventually(|| node(leading.leader).replace_replica(ch.clone(), from, spare));
    assert_eq!(report.kind, tidings::node::TaskKind::Replace { from, to: spare });
    let forgotten = || node(from).status().map(|s| s.stray_logs_forgotten).unwrap_or(0);
    let deadline = Instant::now() + Duration::from_secs(20);
    while forgotten() == 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(forgotten(), 1, "the log of the replica moved away is forgotten on {from}");
    for replica in [leading.leader, spare] {
        assert_eq!(node(replica).status().unwrap().stray_logs_forgotten, 0, "{replica} keeps its log");
    }
    reads_back_every_acked(node(leading.leader), &ch, &acked);
}

/// A real node (threads, sled, the runtime's frame gate on the receiving thread) started again on an
/// emptied data directory: its peers refuse every frame it sends, channel messages included, it says
/// so in its status, holds itself back, and the others go on; once each peer forgot its old identity
/// (the lost-directory procedure's last step, after a drain — which three nodes have no spare node
/// for), its frames are taken again and it is released.
#[test]
fn a_real_node_back_on_an_emptied_directory_is_refused_until_its_peers_forget_its_old_identity() {
    let (dir, mesh, ids, mut nodes, ch) = three_nodes_with_channel("wiped");
    let first = eventually(|| nodes[0].append(ch.clone(), record("before"))?.wait())[0];
    let old = nodes[2].status().unwrap().storage_id;
    mesh.detach(ids[2]);
    nodes.pop();
    std::fs::remove_dir_all(dir.path().join(ids[2].to_string())).unwrap();
    nodes.push(start(ids[2], &ids, dir.path(), &mesh, |_| {}));
    assert_ne!(nodes[2].status().unwrap().storage_id, old, "an emptied directory draws a new identity");
    let refused = |node: &Node| node.status().unwrap().refused_frames.get("storage_changed").copied().unwrap_or(0);
    eventually(|| match nodes[2].status()?.storage_refused_by.len() {
        2 => Ok(()),
        _ => Err(NodeError::TimedOut),
    });
    assert!(nodes[2].status().unwrap().storage_refused_by.iter().all(|(_, known)| *known == old));
    assert!(nodes[2].status().unwrap().storage_quarantined, "held back: no majority took its identity");
    assert!(refused(&nodes[0]) > 0 && refused(&nodes[1]) > 0);
    // The other two commit on their own (MinISR 2), and what was acknowledged before reads back.
    let second = eventually(|| nodes[1].append(ch.clone(), record("after"))?.wait())[0];
    let read = eventually(|| nodes[0].read(&ch, first, 10));
    let texts: Vec<&[u8]> = read.iter().map(|r| r.payload.as_ref()).collect();
    assert_eq!(texts, vec![&b"before"[..], &b"after"[..]], "{first} and {second}");
    for node in &nodes[..2] {
        node.forget_storage_identity(ids[2]).unwrap();
    }
    let taken = |node: &Node| {
        let before = refused(node);
        std::thread::sleep(Duration::from_millis(1_500));
        refused(node) == before
    };
    assert!(taken(&nodes[0]) && taken(&nodes[1]), "refused after its old identity was forgotten");
    eventually(|| match nodes[2].status()?.storage_quarantined {
        false => Ok(()),
        true => Err(NodeError::TimedOut),
    });
}

/// `Ok` once `condition` holds, else an error `eventually` waits past.
fn holds(condition: bool) -> Result<(), NodeError> {
    if condition {
        Ok(())
    } else {
        Err(NodeError::TimedOut)
    }
}

/// The operator's calls through a real node's call path (the core tests cover what each does; this
/// covers the runtime carrying each to the core and its answer back, typed): a channel leadership
/// transfer, a slot group's preferred leader, a hash slot migrated to the other group with its data,
/// a drain recorded and stopped, and the refusals of calls that do not fit.
#[test]
fn operator_calls_on_real_nodes_reach_the_core_and_answer_with_their_outcome() {
    use tidings::node::TaskKind;
    use tidings::slot::fsm::{GroupChangeError, Refusal};
    use tidings::types::GroupId;
    let (_dir, _mesh, ids, nodes, ch) = three_nodes_with_channel("operated");
    let node = |id: NodeId| &nodes[usize::try_from(id.get() - 1).unwrap()];
    let first = eventually(|| nodes[0].append(ch.clone(), record("before"))?.wait())[0];

    // A channel's leadership, to another ISR member.
    let leading = leader_status(&nodes, &ch);
    let target = *leading.isr.iter().find(|n| **n != leading.leader).unwrap();
    let report = eventually(|| node(leading.leader).transfer_leader(ch.clone(), target));
    assert_eq!(report.kind, TaskKind::Transfer { target });
    assert_eq!(report.new_leader.map(|(leader, _)| leader), Some(target));
    let second = eventually(|| nodes[0].append(ch.clone(), record("after"))?.wait())[0];
    reads_back_every_acked(node(target), &ch, &[(first, "before".into()), (second, "after".into())]);

    // A slot group's leadership, to its preferred member.
    let group = GroupId::new(1);
    let group_leader = |via: &Node| -> Option<NodeId> {
        via.status().ok()?.groups.into_iter().find(|g| g.group == group).and_then(|g| g.leader)
    };
    let before = eventually(|| group_leader(&nodes[0]).ok_or(NodeError::NotServed(group)));
    let preferred = *ids.iter().find(|n| **n != before).unwrap();
    eventually(|| nodes[0].set_preferred_leader(group, Some(preferred)));
    eventually(|| holds(group_leader(node(preferred)) == Some(preferred)));

    // A hash slot, with a user in it, migrated to the other group.
    let uid = Uid::new("operated-user").unwrap();
    let user = User { uid: uid.clone(), name: "moved".into(), banned: false };
    eventually(|| nodes[1].propose(Command::PutUser(user.clone())));
    let slot = tidings::router::hash_slot(uid.as_str().as_bytes());
    let from = nodes[1].routes().hash_to_slot().group_of(slot);
    let to = if from == group { GroupId::new(2) } else { group };
    eventually(|| nodes[1].migrate_slot(slot, to));
    for via in &nodes {
        eventually(|| holds(via.routes().hash_to_slot().group_of(slot) == to));
    }
    let read = eventually(|| nodes[2].authoritative_reader(RouteKey::Uid(uid.clone())));
    assert_eq!(read.user(&uid).unwrap(), Some(user), "the user moved with its slot");

    // A drain, recorded by every slot group, then stopped.
    let draining = |via: &Node, group: GroupId| {
        via.local_reader().group_intent(group).ok().flatten().is_some_and(|intent| intent.draining.contains(&ids[2]))
    };
    eventually(|| nodes[0].drain_node(ids[2], true));
    for group in [GroupId::new(1), GroupId::new(2)] {
        eventually(|| holds(draining(&nodes[0], group)));
    }
    eventually(|| nodes[0].drain_node(ids[2], false));
    for group in [GroupId::new(1), GroupId::new(2)] {
        eventually(|| holds(!draining(&nodes[0], group)));
    }

    // Calls that do not fit are refused with their reason, and change nothing.
    let refusal = |result: Result<(), NodeError>| match result {
        Err(NodeError::NotApplied(Outcome::Refused(refusal))) => refusal,
        other => panic!("expected a refusal, got {other:?}"),
    };
    let moved = refusal(nodes[0].move_slot_replica(group, ids[0], ids[1]));
    assert_eq!(moved, Refusal::GroupChange(GroupChangeError::AlreadyAVoter(ids[1])));
    assert_eq!(refusal(nodes[0].abort_slot_move(group)), Refusal::GroupChange(GroupChangeError::NoMoveInProgress));
    assert!(matches!(refusal(nodes[0].abort_slot_migration(slot)), Refusal::Migration(_)), "nothing to abort");
    assert_eq!(nodes[0].routes().hash_to_slot().group_of(slot), to);
}

/// Mailboxes of two places and inboxes of sixteen: a flood of appends from three threads is refused with
/// the typed `Overloaded` at once (never queued without bound, never a blocked caller; peers' frames that
/// find them full are dropped, and the protocols resend), and everything acknowledged reads back on every
/// replica. The slot groups still take metadata writes afterwards.
#[test]
fn full_inboxes_and_mailboxes_refuse_calls_as_overloaded_and_lose_nothing_acknowledged() {
    let dir = tempfile::tempdir().unwrap();
    let mesh = InProcessMesh::new();
    let ids: Vec<NodeId> = (1..=3).map(NodeId::new).collect();
    let tiny = |config: &mut NodeConfig| {
        // Sixteen, not two: a metadata call whose raft message an inbox dropped waits out the 5 s request
        // timeout, and a few of those on a busy machine outlast the test's patience.
        config.inbox_max = 16;
        config.mailbox_max = 2;
        // A dropped pull is found out after `pull_timeout`: kept short so the run is.
        config.machine.pull_park = Duration::from_millis(300);
        config.machine.pull_timeout = Duration::from_secs(1);
        config.machine.append_timeout = Duration::from_secs(3);
    };
    let nodes: Vec<Arc<Node>> = ids.iter().map(|id| start(*id, &ids, dir.path(), &mesh, tiny)).collect();
    let channels: Vec<ChannelId> = (0..8).map(|i| channel(&format!("narrow-{i}"))).collect();
    for ch in &channels {
        create_channel(&nodes[0], ch);
    }
    let floods: Vec<_> = nodes
        .iter()
        .enumerate()
        .map(|(n, node)| {
            let (node, channels) = (Arc::clone(node), channels.clone());
            std::thread::spawn(move || {
                let (mut overloaded, mut handles) = (0, Vec::new());
                for i in 0..200 {
                    let (ch, text) = (channels[i % channels.len()].clone(), format!("{n}-{i}"));
                    match node.append(ch.clone(), record(&text)) {
                        Ok(handle) => handles.push((ch, text, handle)),
                        Err(NodeError::Overloaded) => overloaded += 1,
                        Err(other) => panic!("a full mailbox answers Overloaded, not {other}"),
                    }
                }
                (overloaded, handles)
            })
        })
        .collect();
    let (mut overloaded, mut acked) = (0, Vec::new());
    for flood in floods {
        let (refused, handles) = flood.join().expect("flood thread");
        overloaded += refused;
        for (ch, text, handle) in handles {
            match handle.wait() {
                Ok(seqs) => acked.push((ch, seqs[0], text)),
                // Admitted, then refused or left unknown further on (a full channel queue, a forward that
                // found the leader's mailbox full or its meta not yet read, a commit that frames dropped
                // at full mailboxes slowed past the append timeout): not acknowledged, and worth a retry.
                Err(error) => assert_ne!(error.remedy(), Remedy::GiveUp, "{error}"),
            }
        }
    }
    assert!(overloaded > 0, "600 appends into mailboxes of two: some must be refused");
    assert!(!acked.is_empty(), "the flood must not starve every append");
    for ch in &channels {
        every_node_reads_back(&nodes, ch, &acked);
    }
    // The slot groups' traffic (raft frames, syncs) went through the same narrow inboxes.
    let after = channel("narrow-after");
    create_channel(&nodes[2], &after);
    let seq = eventually(|| nodes[1].append(after.clone(), record("after"))?.wait())[0];
    reads_back_every_acked(&nodes[0], &after, &[(seq, "after".to_owned())]);
}

/// Worker queues of one place each (the durable workers' and the reader thread's): channel batches the
/// durable queue has no room for wait in their reactors and are offered again (some hundreds of times a
/// run), and every acknowledged append still reads back on every replica.
#[test]
fn appends_held_back_by_full_worker_queues_wait_in_their_reactors_and_none_is_lost() {
    let dir = tempfile::tempdir().unwrap();
    let mesh = InProcessMesh::new();
    let ids: Vec<NodeId> = (1..=3).map(NodeId::new).collect();
    let tiny = |storage: &mut StorageOptions| {
        storage.durable_queue_max = 1;
        storage.read_queue_max = 1;
    };
    let nodes: Vec<Arc<Node>> =
        ids.iter().map(|id| start_with(*id, &ids, dir.path(), &mesh, |_| {}, tiny, None)).collect();
    let channels: Vec<ChannelId> = (0..24).map(|i| channel(&format!("tiny-{i}"))).collect();
    for ch in &channels {
        create_channel(&nodes[0], ch);
    }
    // Every channel's appends in flight at once, through every node, so batches meet full queues.
    let rounds = 5;
    let mut handles = Vec::new();
    for round in 0..rounds {
        for (i, ch) in channels.iter().enumerate() {
            let text = format!("{i}-{round}");
            let handle = eventually(|| nodes[(i + round) % 3].append(ch.clone(), record(&text)));
            handles.push((ch.clone(), text, handle));
        }
    }
    let mut acked: Vec<(ChannelId, Seq, String)> = Vec::new();
    for (ch, text, handle) in handles {
        let seq = match handle.wait() {
            Ok(seqs) => seqs[0],
            // Refused before it was admitted (a full channel queue): sent again, as a client would.
            Err(_) => eventually(|| nodes[0].append(ch.clone(), record(&text))?.wait())[0],
        };
        acked.push((ch, seq, text));
    }
    for ch in &channels {
        assert_eq!(every_node_reads_back(&nodes, ch, &acked), rounds);
    }
}
