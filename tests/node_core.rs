//! Three `NodeCore`s on virtual time in one thread: channel creation through the slot layer, meta
//! propagation, appends on the leader and forwarded from other nodes, reads bounded by HW on every
//! replica, and bad frames refused.

use bytes::Bytes;
use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;
use tidings::channel::machine::AppendRecord;
use tidings::frame::FrameError;
use tidings::node::{carry_out_fanout, ApiId, ApiResult, NoFanout, NodeConfig, NodeCore, NodeEffect, NodeError};
use tidings::router::Router;
use tidings::slot::command::Command;
use tidings::slot::model::{ChannelFlags, ChannelInfo, Uid, User};
use tidings::store::message::{LogLimits, MemoryLog, MessageLog};
use tidings::store::{Kv, MemoryKv, MetaStore, RaftLogStore};
use tidings::types::{ChannelId, ChannelType, NodeId, Seq, Time};

struct Cluster {
    now: Time,
    nodes: BTreeMap<NodeId, (NodeCore, Arc<MemoryKv>, Arc<MemoryLog>)>,
    queue: VecDeque<(NodeId, NodeId, Bytes)>,
    results: BTreeMap<ApiId, String>,
    appended: BTreeMap<ApiId, Vec<Seq>>,
    next_api: u64,
}

impl Cluster {
    fn new(n: u64) -> Self {
        Self::with(n, |_| {})
    }

    fn with(n: u64, tweak: impl Fn(&mut NodeConfig)) -> Self {
        let ids: Vec<NodeId> = (1..=n).map(NodeId::new).collect();
        let mut nodes = BTreeMap::new();
        for id in &ids {
            let mut config = NodeConfig { slot_groups: 4, ..NodeConfig::new(*id, ids.clone()) };
            tweak(&mut config);
            let kv = Arc::new(MemoryKv::new());
            let dyn_kv: Arc<dyn Kv> = kv.clone();
            let logs = Arc::new(RaftLogStore::open(dyn_kv.clone()).unwrap());
            let log = Arc::new(MemoryLog::new(LogLimits::default()));
            let router = Arc::new(Router::new(config.table()));
            let core = NodeCore::new(config, logs, MetaStore::new(dyn_kv), log.clone(), router, Time::ZERO).unwrap();
            nodes.insert(*id, (core, kv, log));
        }
        Cluster {
            now: Time::ZERO,
            nodes,
            queue: VecDeque::new(),
            results: BTreeMap::new(),
            appended: BTreeMap::new(),
            next_api: 1,
        }
    }

    fn api(&mut self) -> ApiId {
        self.next_api += 1;
        ApiId(self.next_api)
    }

    /// Carries out every effect of every node until quiet.
    fn settle(&mut self) {
        for _ in 0..10_000 {
            let mut progressed = false;
            let ids: Vec<NodeId> = self.nodes.keys().copied().collect();
            for id in ids {
                loop {
                    let (core, kv, log) = self.nodes.get_mut(&id).unwrap();
                    let Some(effect) = core.poll_effect() else { break };
                    progressed = true;
                    match effect {
                        NodeEffect::Send { to, frame } => self.queue.push_back((id, to, frame)),
                        NodeEffect::SyncSlots { token } => {
                            kv.sync().unwrap();
                            core.handle_slots_synced(self.now, token);
                        }
                        NodeEffect::Persist { token, batch } => {
                            let channel = batch.channel.clone();
                            let result = log.commit(batch);
                            core.handle_persisted(self.now, &channel, token, result);
                        }
                        NodeEffect::Read { channel, token, from, through, max_bytes } => {
                            let limits =
                                tidings::store::message::ReadLimits { records_max: usize::MAX, bytes_max: max_bytes };
                            let result = log.read(&channel, from, through, limits);
                            core.handle_read(self.now, &channel, token, result);
                        }
                        NodeEffect::Fanout(work) => {
                            if let Some(answer) = carry_out_fanout(core.reader(), &NoFanout, work) {
                                core.handle_fanout(self.now, answer);
                            }
                        }
                        NodeEffect::Done { id: api, result } => match result {
                            ApiResult::Appended(Ok(seqs)) => {
                                self.appended.insert(api, seqs);
                            }
                            other => {
                                self.results.insert(api, format!("{other:?}"));
                            }
                        },
                    }
                }
            }
            while let Some((from, to, frame)) = self.queue.pop_front() {
                progressed = true;
                let now = self.now;
                self.nodes.get_mut(&to).unwrap().0.handle_frame(now, from, &frame).unwrap();
            }
            if !progressed {
                return;
            }
        }
    }

    fn run_for(&mut self, ms: u64) {
        let end = self.now + Duration::from_millis(ms);
        while self.now < end {
            self.settle();
            let next = self.nodes.values().map(|(c, _, _)| c.poll_timeout()).min().unwrap().min(end);
            self.now = self.now.max(next);
            let now = self.now;
            for (core, _, _) in self.nodes.values_mut() {
                if core.poll_timeout() <= now {
                    core.handle_tick(now);
                }
            }
        }
        self.settle();
    }

    fn core(&mut self, id: u64) -> &mut NodeCore {
        &mut self.nodes.get_mut(&NodeId::new(id)).unwrap().0
    }
}

fn records(payloads: &[&str]) -> Vec<AppendRecord> {
    payloads.iter().map(|p| AppendRecord { idempotency_key: None, payload: Bytes::from(p.to_string()) }).collect()
}

#[test]
fn three_nodes_create_append_forward_and_read() {
    let mut cluster = Cluster::new(3);
    cluster.run_for(5_000);
    let channel = ChannelId::new(ChannelType::GROUP, "lobby").unwrap();
    let create = cluster.api();
    let now = cluster.now;
    cluster.core(1).create_channel(
        now,
        create,
        ChannelInfo { channel: channel.clone(), flags: ChannelFlags::default() },
    );
    cluster.run_for(2_000);
    assert_eq!(cluster.results.get(&create).map(String::as_str), Some("Meta(Ok(()))"));
    // Metadata writes work from any node too.
    let user = cluster.api();
    cluster.core(2).propose(
        now,
        user,
        Command::PutUser(User { uid: Uid::new("alice").unwrap(), name: "Alice".into(), banned: false }),
    );
    cluster.run_for(1_000);
    assert_eq!(cluster.results.get(&user).map(String::as_str), Some("Meta(Ok(()))"));
    // Append through every node: the leader admits, the others forward.
    let mut ids = Vec::new();
    for (n, text) in [(1, "from n1"), (2, "from n2"), (3, "from n3")] {
        let id = cluster.api();
        let now = cluster.now;
        cluster.core(n).append(now, id, channel.clone(), records(&[text]));
        cluster.run_for(500);
        ids.push(id);
    }
    let seqs: Vec<Seq> = ids
        .iter()
        .map(|id| {
            cluster.appended.get(id).unwrap_or_else(|| panic!("append {id:?} not acked: {:?}", cluster.results.get(id)))
                [0]
        })
        .collect();
    assert!(seqs.windows(2).all(|w| w[0] < w[1]));
    cluster.run_for(1_000);
    for n in 1..=3 {
        let read = cluster.core(n).read(&channel, Seq::new(1), 100).unwrap();
        let texts: Vec<&[u8]> = read.iter().map(|r| r.payload.as_ref()).collect();
        assert_eq!(texts, vec![&b"from n1"[..], b"from n2", b"from n3"], "node {n}");
    }
}

#[test]
fn appends_to_unknown_channels_and_bad_frames_are_refused() {
    let mut cluster = Cluster::new(3);
    cluster.run_for(5_000);
    let ghost = ChannelId::new(ChannelType::GROUP, "ghost").unwrap();
    let id = cluster.api();
    let now = cluster.now;
    cluster.core(1).append(now, id, ghost.clone(), records(&["x"]));
    cluster.run_for(6_000);
    assert!(!cluster.appended.contains_key(&id), "no append to a channel that does not exist");
    assert!(cluster.results[&id].contains("UnknownChannel"), "{:?}", cluster.results.get(&id));
    assert!(matches!(cluster.core(1).read(&ghost, Seq::new(1), 10), Err(NodeError::UnknownChannel(_))));
    assert!(matches!(
        cluster.core(1).handle_frame(now, NodeId::new(2), b"garbage"),
        Err(FrameError::Truncated { .. } | FrameError::BadMagic)
    ));
    let frame = tidings::frame::encode(&tidings::frame::Frame {
        cluster: 1,
        from: NodeId::new(9),
        body: tidings::frame::FrameBody::Node(tidings::node::NodeMessage::MetaFetch(ghost)),
    });
    assert_eq!(cluster.core(1).handle_frame(now, NodeId::new(9), &frame), Err(FrameError::UnknownNode(NodeId::new(9))));
}

#[test]
fn idle_channels_are_evicted_and_reactivate_without_loss() {
    let mut cluster = Cluster::with(3, |config| config.channel_idle_evict = Duration::from_secs(3));
    cluster.run_for(5_000);
    let channel = ChannelId::new(ChannelType::GROUP, "sleepy").unwrap();
    let create = cluster.api();
    let now = cluster.now;
    cluster.core(1).create_channel(
        now,
        create,
        ChannelInfo { channel: channel.clone(), flags: ChannelFlags::default() },
    );
    cluster.run_for(2_000);
    let first = cluster.api();
    let now = cluster.now;
    cluster.core(2).append(now, first, channel.clone(), records(&["before"]));
    cluster.run_for(1_000);
    assert!(cluster.appended.contains_key(&first));
    // Idle for longer than the eviction bound: every replica leaves memory, its log stays.
    cluster.run_for(8_000);
    for n in 1..=3 {
        assert!(cluster.core(n).channel(&channel).is_none(), "node {n} kept an idle channel");
    }
    // The next append reactivates the leader (resuming its epoch: it left quiescent) and the followers.
    let second = cluster.api();
    let now = cluster.now;
    cluster.core(3).append(now, second, channel.clone(), records(&["after"]));
    cluster.run_for(2_000);
    let (a, b) = (cluster.appended[&first][0], cluster.appended.get(&second).expect("append after eviction")[0]);
    assert!(b > a);
    for n in 1..=3 {
        let texts: Vec<Vec<u8>> =
            cluster.core(n).read(&channel, Seq::new(1), 10).unwrap().iter().map(|r| r.payload.to_vec()).collect();
        assert_eq!(texts, vec![b"before".to_vec(), b"after".to_vec()], "node {n}");
    }
}
