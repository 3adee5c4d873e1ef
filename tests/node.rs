//! The public API on real nodes (threads, sled, in-process transport): single node, three nodes with
//! forwarding from non-leaders, typed errors, and restart from the data directory.

// These tests drive real threaded nodes: waiting on them needs the wall clock.
#![allow(clippy::disallowed_methods)]

use bytes::Bytes;
use parking_lot::RwLock;
use std::collections::BTreeMap;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};
use tidings::channel::machine::{AppendError, AppendRecord};
use tidings::node::{NodeConfig, NodeError};
use tidings::slot::model::{ChannelFlags, ChannelInfo};
use tidings::types::{ChannelId, ChannelType, NodeId, Seq};
use tidings::{Node, StorageOptions, Transport};

#[derive(Default)]
struct Mesh {
    nodes: RwLock<BTreeMap<NodeId, Weak<Node>>>,
}

struct LocalTransport {
    from: NodeId,
    mesh: Arc<Mesh>,
}

impl Transport for LocalTransport {
    fn send(&self, to: NodeId, frame: Bytes) {
        let node = self.mesh.nodes.read().get(&to).and_then(Weak::upgrade);
        if let Some(node) = node {
            node.handle_frame(self.from, frame);
        }
    }
}

fn start(
    id: NodeId,
    ids: &[NodeId],
    dir: &std::path::Path,
    mesh: &Arc<Mesh>,
    tweak: impl Fn(&mut NodeConfig),
) -> Arc<Node> {
    let mut config = NodeConfig::new(id, ids.to_vec());
    config.slot_groups = 2;
    tweak(&mut config);
    let node = Arc::new(
        Node::start(
            config,
            StorageOptions::new(dir.join(id.to_string())),
            Arc::new(LocalTransport { from: id, mesh: mesh.clone() }),
        )
        .unwrap(),
    );
    mesh.nodes.write().insert(id, Arc::downgrade(&node));
    node
}

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

fn record(text: &str) -> Vec<AppendRecord> {
    vec![AppendRecord { idempotency_key: None, payload: Bytes::from(text.to_owned()) }]
}

fn channel(name: &str) -> ChannelId {
    ChannelId::new(ChannelType::GROUP, name).unwrap()
}

#[test]
fn single_node_goes_through_the_same_path() {
    let dir = tempfile::tempdir().unwrap();
    let mesh = Arc::new(Mesh::default());
    let ids = [NodeId::new(1)];
    let node = start(ids[0], &ids, dir.path(), &mesh, |_| {});
    let ch = channel("solo");
    eventually(|| node.create_channel(ChannelInfo { channel: ch.clone(), flags: ChannelFlags::default() }));
    let seqs = eventually(|| node.append(ch.clone(), record("hello"))?.wait());
    let read = node.read(&ch, Seq::new(1), 10).unwrap();
    assert_eq!(read.len(), 1);
    let status = node.status().unwrap();
    assert_eq!(status.groups.len(), 2);
    assert!(status.groups.iter().any(|g| g.leader == Some(ids[0])), "{status:?}");
    let replica = status.channels.iter().find(|c| c.channel == ch).unwrap();
    assert_eq!(replica.role, tidings::channel::machine::RoleKind::Leader);
    assert!(replica.hw >= seqs[0]);
    assert_eq!(read[0].seq, seqs[0]);
    assert_eq!(read[0].payload, Bytes::from_static(b"hello"));
}

#[test]
fn three_nodes_forward_from_non_leaders_and_survive_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let mesh = Arc::new(Mesh::default());
    let ids: Vec<NodeId> = (1..=3).map(NodeId::new).collect();
    let mut nodes: Vec<Arc<Node>> = ids.iter().map(|id| start(*id, &ids, dir.path(), &mesh, |_| {})).collect();
    let ch = channel("shared");
    eventually(|| nodes[1].create_channel(ChannelInfo { channel: ch.clone(), flags: ChannelFlags::default() }));
    let mut acked = Vec::new();
    for (i, node) in nodes.iter().cycle().take(30).enumerate() {
        let text = format!("m{i}");
        let seq = eventually(|| node.append(ch.clone(), record(&text))?.wait())[0];
        acked.push((seq, text));
    }
    // Let followers learn and checkpoint the final HW (idle checkpoint within 1 s), then stop every node
    // and restart from the data directories. The channel's old leader will not lead its old epoch again
    // (that takes a failover), so the acknowledged messages are read from a follower, bounded by the HW it
    // checkpointed.
    std::thread::sleep(Duration::from_millis(2_500));
    mesh.nodes.write().clear();
    nodes.clear();
    let nodes: Vec<Arc<Node>> = ids.iter().map(|id| start(*id, &ids, dir.path(), &mesh, |_| {})).collect();
    let leader = NodeConfig::new(ids[0], ids.clone()).channel_placement(&ch);
    let reader = &nodes[usize::try_from(leader[1].get() - 1).unwrap()];
    let read = eventually(|| {
        let read = reader.read(&ch, Seq::new(1), 100)?;
        if read.len() < acked.len() {
            return Err(NodeError::Stopped);
        }
        Ok(read)
    });
    for (seq, text) in &acked {
        assert!(read.iter().any(|r| r.seq == *seq && r.payload.as_ref() == text.as_bytes()), "lost {seq} {text}");
    }
}

#[test]
fn a_flood_gets_typed_busy_errors_not_unbounded_queues() {
    let dir = tempfile::tempdir().unwrap();
    let mesh = Arc::new(Mesh::default());
    let ids = [NodeId::new(1)];
    let node = start(ids[0], &ids, dir.path(), &mesh, |config| {
        config.machine.pending_records_max = 8;
        config.machine.request_records_max = 4;
        config.machine.handoff_slots = 8;
    });
    let ch = channel("flood");
    eventually(|| node.create_channel(ChannelInfo { channel: ch.clone(), flags: ChannelFlags::default() }));
    eventually(|| node.append(ch.clone(), record("warm-up"))?.wait());
    let handles: Vec<_> = (0..200).map(|i| node.append(ch.clone(), record(&format!("f{i}"))).unwrap()).collect();
    let mut busy = 0;
    let mut ok = 0;
    for handle in handles {
        match handle.wait() {
            Ok(_) => ok += 1,
            Err(NodeError::Append(AppendError::Busy)) => busy += 1,
            Err(other) => panic!("unexpected {other}"),
        }
    }
    assert!(ok > 0 && busy > 0, "ok {ok}, busy {busy}");
}
