//! Three `NodeCore`s on virtual time in one thread: channel creation through the slot layer, meta
//! propagation, appends on the leader and forwarded from other nodes, reads bounded by HW on every
//! replica, and bad frames refused.

mod support;

use bytes::Bytes;
use std::time::Duration;
use support::{read_all, records, Cluster};
use tidings::channel::machine::AppendRecord;
use tidings::frame::FrameError;
use tidings::node::{ApiId, Lookup, NodeConfig, NodeError, Remedy};
use tidings::slot::command::Command;
use tidings::slot::model::{ChannelFlags, ChannelInfo, Uid, User};
use tidings::store::message::{IdempotencyKey, LogFailOp, MessageLog};
use tidings::store::FailOp;
use tidings::types::{ChannelId, ChannelType, NodeId, Seq};

#[test]
fn three_nodes_create_append_forward_and_read() {
    let mut cluster = Cluster::new(3);
    cluster.run_for(5_000);
    let channel = ChannelId::new(ChannelType::GROUP, "lobby").unwrap();
    cluster.create_channel(1, &channel);
    // Metadata writes work from any node too.
    let user = cluster.api();
    let now = cluster.now;
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

/// A node that cannot get a channel's meta (every member of its slot group is cut off from it) cannot
/// tell whether the channel exists: its append and read fail with `MetaUnavailable` (retry), not
/// `UnknownChannel` (give up), and the append goes through once the group is back.
#[test]
fn a_node_that_cannot_get_a_channel_s_meta_refuses_its_calls_for_a_retry() {
    let mut cluster = Cluster::with(4, |config| config.slot_replicas = 3);
    cluster.run_for(5_000);
    let config = cluster.nodes[&NodeId::new(1)].config.clone();
    let members = config.slot_group_members();
    // A channel neither placed on node `via` nor in a slot group it keeps.
    let (channel, via, keepers) = (0..)
        .map(|i| ChannelId::new(ChannelType::GROUP, &format!("far-{i}")).unwrap())
        .find_map(|channel| {
            let group = config.table().group_of_key(channel.route_key());
            let (_, keepers) = members.iter().find(|(g, _)| *g == group)?;
            let placement = config.channel_placement(&channel);
            let via = config.nodes.iter().copied().find(|n| !keepers.contains(n) && !placement.contains(n))?;
            Some((channel, via, keepers.clone()))
        })
        .unwrap();
    cluster.create_channel(keepers[0].get(), &channel);
    cluster.cut.extend(keepers.iter().copied());
    let id = cluster.append(via.get(), &channel, &["while its group is out of reach"]);
    cluster.run_for(6_000);
    let refused = cluster.results.get(&id).cloned().unwrap_or_default();
    assert!(refused.contains("MetaUnavailable"), "{refused}");
    let read = cluster.core(via.get()).read(&channel, Seq::new(1), 10);
    assert!(matches!(&read, Err(error @ NodeError::MetaUnavailable(_)) if error.remedy() == Remedy::Retry), "{read:?}");

    cluster.cut.clear();
    let id = cluster.append(via.get(), &channel, &["once it is back"]);
    assert!(cluster.run_until(10_000, |c| c.appended.contains_key(&id)), "{:?}", cluster.results.get(&id));
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
    let read = cluster.core(1).read(&ghost, Seq::new(1), 10);
    assert!(matches!(&read, Err(error @ NodeError::UnknownChannel(_)) if error.remedy() == Remedy::GiveUp), "{read:?}");
    assert!(matches!(
        cluster.core(1).handle_frame(now, NodeId::new(2), b"garbage"),
        Err(FrameError::Truncated { .. } | FrameError::BadMagic)
    ));
    let frame = tidings::frame::encode(&tidings::frame::Frame {
        cluster: 1,
        from: NodeId::new(9),
        storage: tidings::types::StorageId::new(9),
        start: 1,
        to_start: 0,
        body: tidings::frame::FrameBody::Node(tidings::node::NodeMessage::MetaFetch(ghost)),
    });
    assert_eq!(cluster.core(1).handle_frame(now, NodeId::new(9), &frame), Err(FrameError::UnknownNode(NodeId::new(9))));
}

/// A forwarded append whose frame arrives twice (a network or a transport that resends) commits once.
#[test]
fn a_forward_delivered_twice_is_taken_once() {
    let (mut cluster, channel, _) = cluster_with_one_message("twice", |_| {});
    let leader = cluster.core(1).reader().runtime_meta(&channel).unwrap().expect("stored meta").leader;
    let from = NodeId::new(if leader.get() == 1 { 2 } else { 1 });
    let forward = tidings::node::NodeMessage::AppendForward {
        id: 77,
        channel: channel.clone(),
        sender: None,
        records: vec![(None, Bytes::from_static(b"once"))],
    };
    let frame = forward_frame(&mut cluster, from, leader, forward, |start| start);
    let now = cluster.now;
    for _ in 0..2 {
        cluster.core(leader.get()).handle_frame(now, from, &frame).expect("a valid frame");
    }
    cluster.run_for(1_000);
    let payloads: Vec<Vec<u8>> =
        read_all(cluster.core(leader.get()), &channel).unwrap().iter().map(|r| r.payload.to_vec()).collect();
    assert_eq!(payloads, vec![b"before".to_vec(), b"once".to_vec()]);
}

/// The frame `from` sends `to` with `forward`, naming the start of `to` that `address` makes of its
/// current one (a test forges an earlier start, or none).
fn forward_frame(
    cluster: &mut Cluster,
    from: NodeId,
    to: NodeId,
    forward: tidings::node::NodeMessage,
    address: impl Fn(u64) -> u64,
) -> Bytes {
    tidings::frame::encode(&tidings::frame::Frame {
        cluster: 1,
        from,
        storage: cluster.core(from.get()).storage_id(),
        start: cluster.core(from.get()).start_id(),
        to_start: address(cluster.core(to.get()).start_id()),
        body: tidings::frame::FrameBody::Node(forward),
    })
}

/// A forwarded append addressed to an earlier start of its leader (a transport held it across the
/// leader's restart, or sent it again after reconnecting), or to no start, is refused and commits
/// nothing: the earlier start may have taken it already.
#[test]
fn a_forward_addressed_to_an_earlier_start_or_to_none_is_refused() {
    let (mut cluster, channel, _) = cluster_with_one_message("earlier", |_| {});
    let leader = cluster.core(1).reader().runtime_meta(&channel).unwrap().expect("stored meta").leader;
    let from = NodeId::new(if leader.get() == 1 { 2 } else { 1 });
    let forward = || tidings::node::NodeMessage::AppendForward {
        id: 78,
        channel: channel.clone(),
        sender: None,
        records: vec![(None, Bytes::from_static(b"never"))],
    };
    let now = cluster.now;
    let earlier = forward_frame(&mut cluster, from, leader, forward(), |start| start + 1);
    let refused = cluster.core(leader.get()).handle_frame(now, from, &earlier);
    assert!(matches!(refused, Err(FrameError::EarlierStart { node, .. }) if node == from), "{refused:?}");
    let unaddressed = forward_frame(&mut cluster, from, leader, forward(), |_| 0);
    let refused = cluster.core(leader.get()).handle_frame(now, from, &unaddressed);
    assert_eq!(refused, Err(FrameError::UnaddressedForward { node: from }));
    assert_eq!(cluster.core(leader.get()).status().refused_frames.get("earlier_start"), Some(&1));
    cluster.run_for(1_000);
    let payloads: Vec<Vec<u8>> =
        read_all(cluster.core(leader.get()), &channel).unwrap().iter().map(|r| r.payload.to_vec()).collect();
    assert_eq!(payloads, vec![b"before".to_vec()], "nothing of the refused forwards committed");
}

/// Three nodes evicting replicas idle for 3 s, and `name`, a channel created on node 1 whose first
/// message, "before", was appended through node 2 and committed (its id is returned).
fn evicting_cluster_with_one_message(name: &str) -> (Cluster, ChannelId, ApiId) {
    cluster_with_one_message(name, |config| config.channel_idle_evict = Duration::from_secs(3))
}

/// Three nodes configured by `tweak`, and `name`, a channel created on node 1 whose first message,
/// "before", was appended through node 2 and committed (its id is returned).
fn cluster_with_one_message(name: &str, tweak: impl Fn(&mut NodeConfig)) -> (Cluster, ChannelId, ApiId) {
    let mut cluster = Cluster::with(3, tweak);
    cluster.run_for(5_000);
    let channel = ChannelId::new(ChannelType::GROUP, name).unwrap();
    cluster.create_channel(1, &channel);
    let first = cluster.append(2, &channel, &["before"]);
    cluster.run_for(1_000);
    assert!(cluster.appended.contains_key(&first));
    (cluster, channel, first)
}

#[test]
fn idle_channels_are_evicted_and_reactivate_without_loss() {
    let (mut cluster, channel, first) = evicting_cluster_with_one_message("sleepy");
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

/// An input for an evicted replica starts its activation's load and waits for it: the shard reads no
/// storage itself (with the leader's message-log reads failing meanwhile, an activation that read on
/// the shard's thread would fail and refuse the append). Once the load is carried out, the parked
/// inputs go through in order, and the leader has its idempotency window back.
#[test]
fn an_evicted_replica_loads_off_the_shard_and_then_takes_the_inputs_that_waited() {
    let (mut cluster, channel, _) = evicting_cluster_with_one_message("parked");
    let keyed = |key: &str, text: &str| AppendRecord {
        idempotency_key: IdempotencyKey::new(key.as_bytes().to_vec()),
        payload: Bytes::from(text.as_bytes().to_vec()),
    };
    let first = cluster.api();
    let now = cluster.now;
    cluster.core(1).append(now, first, channel.clone(), vec![keyed("k1", "keyed")]);
    cluster.run_for(1_000);
    let keyed_seq = cluster.appended.get(&first).expect("keyed append")[0];
    cluster.run_for(8_000);
    assert!((1..=3).all(|n| cluster.core(n).channel(&channel).is_none()), "every replica evicted");
    let leader = cluster.core(1).reader().runtime_meta(&channel).unwrap().expect("stored meta").leader;
    cluster.nodes[&leader].log.fail(LogFailOp::Read, 0, u64::MAX);
    cluster.hold_reads = true;
    let (after, retry) = (cluster.api(), cluster.api());
    let now = cluster.now;
    let via = leader.get();
    cluster.core(via).append(now, after, channel.clone(), records(&["after"]));
    cluster.core(via).append(now, retry, channel.clone(), vec![keyed("k1", "keyed")]);
    cluster.run_for(200);
    assert!(cluster.core(via).channel(&channel).is_none(), "inactive until its load is carried out");
    assert!(!cluster.results.contains_key(&after) && !cluster.appended.contains_key(&after), "the append waits");
    assert!(
        cluster
            .held_reads
            .iter()
            .any(|(node, read)| *node == leader && matches!(read, Lookup::Load(job) if job.channel() == &channel)),
        "the leader asked for its load: {:?}",
        cluster.held_reads
    );
    // A read of the inactive replica answers from the HW its store holds.
    assert!(cluster.core(via).latest(&channel).unwrap() >= keyed_seq);
    cluster.nodes[&leader].log.clear_failpoints();
    cluster.release_reads();
    cluster.run_for(2_000);
    let after_seq = cluster.appended.get(&after).unwrap_or_else(|| panic!("{:?}", cluster.results.get(&after)))[0];
    assert!(after_seq > keyed_seq);
    assert_eq!(cluster.appended.get(&retry).map(|s| s[0]), Some(keyed_seq), "a retry keeps its first seq");
    for n in 1..=3 {
        let texts: Vec<Vec<u8>> =
            read_all(cluster.core(n), &channel).unwrap().iter().map(|r| r.payload.to_vec()).collect();
        assert_eq!(texts, vec![b"before".to_vec(), b"keyed".to_vec(), b"after".to_vec()], "node {n}");
    }
}

/// A retention move through another node waits in loads like an append (for the meta there, for the
/// evicted leader's replica there) and then gives up the records on every replica.
#[test]
fn a_forwarded_retention_move_waits_for_loads_like_an_append_and_trims_every_replica() {
    let (mut cluster, channel, first) = evicting_cluster_with_one_message("retained");
    let second = cluster.append(3, &channel, &["kept"]);
    cluster.run_for(1_000);
    let (given_up, kept) = (cluster.appended[&first][0], cluster.appended[&second][0]);
    cluster.run_for(8_000);
    assert!((1..=3).all(|n| cluster.core(n).channel(&channel).is_none()), "every replica evicted");
    let leader = cluster.core(1).reader().runtime_meta(&channel).unwrap().expect("stored meta").leader;
    let via = (1..=3).find(|n| *n != leader.get()).expect("a node that does not lead");
    cluster.hold_reads = true;
    let api = cluster.api();
    let now = cluster.now;
    cluster.core(via).set_retention(now, api, channel.clone(), given_up);
    cluster.run_for(200);
    // The node asked keeps the channel's slot group: its shard let the evicted replica's meta go, and
    // the move waits in that replica's load, which reads the meta back.
    assert!(!cluster.results.contains_key(&api), "it waits for the load");
    assert!(
        cluster
            .held_reads
            .iter()
            .any(|(n, read)| n.get() == via && matches!(read, Lookup::Load(job) if job.channel() == &channel)),
        "a load holds it: {:?}",
        cluster.held_reads
    );
    // Then it is forwarded to the leader, whose evicted replica loads (off its shard) before the move.
    cluster.hold_reads = false;
    cluster.release_reads();
    cluster.run_for(2_000);
    assert_eq!(cluster.results.get(&api).map(String::as_str), Some(format!("Retained(Ok({given_up:?}))").as_str()));
    for n in 1..=3 {
        let seqs: Vec<Seq> = read_all(cluster.core(n), &channel).unwrap().iter().map(|r| r.seq).collect();
        assert_eq!(seqs, vec![kept], "node {n} reads past the boundary");
        let stored = cluster.nodes[&NodeId::new(n)].log.state(&channel).expect("a stored state");
        assert_eq!(stored.retention_through, given_up, "node {n} trimmed its store");
    }
}

/// A replica that was down while records were given up still holds them; read back before its load
/// trims them, it starts after the boundary of the meta its node learned meanwhile.
#[test]
fn a_replica_that_missed_a_retention_move_reads_past_it_before_it_trims() {
    let (mut cluster, channel, first) = cluster_with_one_message("missed", |_| {});
    let kept = cluster.append(2, &channel, &["kept"]);
    cluster.run_for(1_000);
    let (given_up, kept) = (cluster.appended[&first][0], cluster.appended[&kept][0]);
    let meta = cluster.core(1).reader().runtime_meta(&channel).unwrap().expect("stored meta");
    let down = meta.replicas.iter().copied().find(|n| *n != meta.leader).expect("a follower").get();
    cluster.crash(down);
    let api = cluster.api();
    let now = cluster.now;
    cluster.core(meta.leader.get()).set_retention(now, api, channel.clone(), given_up);
    // Its slot group may have to elect a leader first.
    cluster.run_for(5_000);
    assert!(cluster.results[&api].starts_with("Retained(Ok"), "{:?}", cluster.results.get(&api));
    // Back, its replica's load held: the store still has the record given up.
    cluster.hold_reads = true;
    cluster.restart(down);
    cluster.run_for(3_000);
    let stored = cluster.nodes[&NodeId::new(down)].log.state(&channel).expect("a stored state");
    assert!(stored.retention_through < given_up, "not trimmed yet: {stored:?}");
    let seqs: Vec<Seq> = read_all(cluster.core(down), &channel).unwrap().iter().map(|r| r.seq).collect();
    assert_eq!(seqs, vec![kept]);
}

/// A load never answered does not hold a replica's inputs for good: after 30 s its parked appends get
/// `Busy`, its late answer changes nothing, and the next append activates the replica again.
#[test]
fn a_load_never_answered_is_given_up_and_its_appends_get_busy() {
    let (mut cluster, channel, first) = evicting_cluster_with_one_message("lost");
    cluster.run_for(8_000);
    let leader = cluster.core(1).reader().runtime_meta(&channel).unwrap().expect("stored meta").leader;
    cluster.hold_reads = true;
    let waiting = cluster.append(leader.get(), &channel, &["waits"]);
    cluster.run_for(29_000);
    assert!(!cluster.results.contains_key(&waiting), "still waiting for its load");
    cluster.run_for(2_000);
    assert!(cluster.results.get(&waiting).is_some_and(|r| r.contains("Busy")), "{:?}", cluster.results.get(&waiting));
    let status = cluster.core(leader.get()).status();
    assert_eq!((status.loads_given_up, status.channels_loading), (1, 0), "counted, and nothing left loading");
    cluster.release_reads();
    let again = cluster.append(leader.get(), &channel, &["again"]);
    cluster.run_for(2_000);
    let (a, b) = (cluster.appended[&first][0], cluster.appended.get(&again).expect("append after the lost load")[0]);
    assert!(b > a);
}

/// A shard hands off at most 1,024 loads at once; activations beyond wait in its queue instead of
/// being refused, and go as loads come back.
#[test]
fn activations_beyond_the_loads_in_flight_wait_their_turn() {
    let mut cluster = Cluster::new(1);
    cluster.run_for(3_000);
    let channels: Vec<ChannelId> =
        (0..1_100).map(|i| ChannelId::new(ChannelType::GROUP, &format!("many-{i}")).unwrap()).collect();
    let creates: Vec<ApiId> = channels
        .iter()
        .map(|channel| {
            let id = cluster.api();
            let now = cluster.now;
            let info = ChannelInfo { channel: channel.clone(), flags: ChannelFlags::default() };
            cluster.core(1).create_channel(now, id, info);
            id
        })
        .collect();
    cluster.run_for(5_000);
    assert!(creates.iter().all(|id| cluster.results.get(id).map(String::as_str) == Some("Meta(Ok(()))")));
    assert_eq!(cluster.core(1).active_channels(), 0, "created channels stay inactive until used");
    cluster.hold_reads = true;
    let appends: Vec<ApiId> = channels.iter().map(|channel| cluster.append(1, channel, &["first"])).collect();
    cluster.run_for(100);
    assert_eq!(cluster.held_reads.len(), 1_024, "loads handed off at once");
    assert_eq!(cluster.core(1).status().channels_loading, 1_100, "the rest queued");
    assert!(appends.iter().all(|id| !cluster.results.contains_key(id)), "none refused while queued");
    cluster.release_reads();
    cluster.run_for(2_000);
    let missing: Vec<_> = appends.iter().filter(|id| !cluster.appended.contains_key(id)).collect();
    assert!(missing.is_empty(), "{} not appended, e.g. {:?}", missing.len(), cluster.results.get(missing[0]));
    assert_eq!(cluster.core(1).active_channels(), 1_100);
}

/// `append_from` checks its sender in this node's slot replicas off the shard: the append waits for
/// the check's answer, then goes on — admitted for an allowed sender, refused for a banned one.
#[test]
fn a_sender_is_checked_off_the_shard_and_the_append_waits_for_the_answer() {
    let (mut cluster, channel, _) = evicting_cluster_with_one_message("checked");
    for (name, banned) in [("alice", false), ("mallory", true)] {
        let user = User { uid: Uid::new(name).unwrap(), name: name.into(), banned };
        assert_eq!(cluster.call(1, |core, now, id| core.propose(now, id, Command::PutUser(user))), "Meta(Ok(()))");
    }
    cluster.run_for(1_000);
    cluster.hold_reads = true;
    let (allowed, refused) = (cluster.api(), cluster.api());
    let now = cluster.now;
    cluster.core(1).append_from(now, allowed, channel.clone(), Uid::new("alice").unwrap(), records(&["hi"]));
    cluster.core(1).append_from(now, refused, channel.clone(), Uid::new("mallory").unwrap(), records(&["x"]));
    cluster.run_for(200);
    let checks =
        cluster.held_reads.iter().filter(|(node, read)| node.get() == 1 && matches!(read, Lookup::CheckSender(_)));
    assert_eq!(checks.count(), 2, "both checks handed off: {:?}", cluster.held_reads);
    assert!(!cluster.appended.contains_key(&allowed) && !cluster.results.contains_key(&refused), "both wait");
    cluster.release_reads();
    cluster.run_for(1_000);
    assert!(cluster.appended.contains_key(&allowed), "{:?}", cluster.results.get(&allowed));
    assert!(
        cluster.results.get(&refused).is_some_and(|r| r.contains("SenderBanned")),
        "{:?}",
        cluster.results.get(&refused)
    );
}

#[test]
fn an_evicted_replica_lets_go_of_a_meta_its_slot_replica_applied_without_reading_it_back() {
    let (mut cluster, channel, _) = evicting_cluster_with_one_message("forgetful");
    for n in 1..=3 {
        assert_eq!(cluster.core(n).status().channel_metas_held, 1, "node {n} holds its active replica's meta");
    }
    // Every node's slot replica applied the meta. With every store read failing, eviction still lets it
    // go: it knows the store holds it (reading it back, as before, would fail and keep it).
    for node in cluster.nodes.values() {
        node.kv.fail(FailOp::Get, 0, u64::MAX);
    }
    cluster.run_for(8_000);
    for n in 1..=3 {
        assert!(cluster.core(n).channel(&channel).is_none(), "node {n} kept an idle channel");
        assert_eq!(cluster.core(n).status().channel_metas_held, 0, "node {n} kept an evicted replica's meta");
    }
    // Read back on the next use.
    for node in cluster.nodes.values() {
        node.kv.clear_failpoints();
    }
    let second = cluster.append(3, &channel, &["after"]);
    cluster.run_for(2_000);
    assert!(cluster.appended.contains_key(&second), "{:?}", cluster.results.get(&second));
}

#[test]
fn messages_of_an_older_leadership_are_counted_answers_refused_and_hints_answered_with_the_epoch_in_force() {
    let mut cluster = Cluster::new(3);
    cluster.run_for(3_000);
    let channel = ChannelId::new(ChannelType::GROUP, "epochs").unwrap();
    cluster.create_channel(1, &channel);
    let id = cluster.append(1, &channel, &["one"]);
    cluster.run_for(500);
    assert!(cluster.appended.contains_key(&id));
    let before: Vec<_> = (1..=3).map(|n| cluster.core(n).status().channels).collect();
    // A hint of leader epoch 0 (every replica is in epoch 1) from a cluster member.
    let hint = tidings::channel::machine::PullHint {
        channel: channel.clone(),
        leader_epoch: tidings::types::LeaderEpoch::new(0),
    };
    let frame = tidings::frame::encode(&tidings::frame::Frame {
        cluster: 1,
        from: NodeId::new(2),
        storage: cluster.core(2).storage_id(),
        start: cluster.core(2).start_id(),
        to_start: cluster.core(3).start_id(),
        body: tidings::frame::FrameBody::Channel(tidings::channel::machine::ChannelMessage::Hint(hint)),
    });
    let now = cluster.now;
    let stale_before = cluster.core(3).status().stale_messages;
    cluster.core(3).handle_frame(now, NodeId::new(2), &frame).unwrap();
    assert_eq!(cluster.core(3).status().stale_messages, stale_before + 1);
    // The hint's sender hears of the newer epoch: a leader that missed its successor would refresh.
    cluster.captured.clear();
    cluster.capture_max = 1_000;
    cluster.settle();
    use tidings::channel::machine::ChannelMessage;
    use tidings::frame::FrameBody;
    let told = cluster.captured.iter().filter(|(from, to, _)| (*from, *to) == (NodeId::new(3), NodeId::new(2))).any(
        |(_, _, frame)| {
            let messages = match tidings::frame::decode(frame, &Default::default()).map(|f| f.body) {
                Ok(FrameBody::Channel(message)) => vec![message],
                Ok(FrameBody::Channels(messages)) => messages,
                _ => vec![],
            };
            messages.iter().any(|m| matches!(m, ChannelMessage::Hint(h) if h.leader_epoch.get() == 1))
        },
    );
    assert!(told, "a stale hint is answered with the epoch in force");
    let after: Vec<_> = (1..=3).map(|n| cluster.core(n).status().channels).collect();
    assert_eq!(before, after, "a stale message changes no replica");
}

/// Three nodes of four shards each, and 16 channels that took an append through every node (forwarded
/// appends are answered to the shard that sent them); `tweak` adjusts every node's configuration.
fn sixteen_channels_over_four_shards(tweak: impl Fn(&mut NodeConfig)) -> (Cluster, Vec<ChannelId>) {
    let mut cluster = Cluster::with(3, |config| {
        config.reactors = 4;
        tweak(config);
    });
    cluster.run_for(5_000);
    let channels: Vec<ChannelId> =
        (0..16).map(|i| ChannelId::new(ChannelType::GROUP, &format!("spread-{i}")).unwrap()).collect();
    for channel in &channels {
        cluster.create_channel(1, channel);
    }
    let mut appends = Vec::new();
    for channel in &channels {
        for n in 1..=3 {
            let id = cluster.api();
            let now = cluster.now;
            cluster.core(n).append(now, id, channel.clone(), records(&[&format!("{channel} via n{n}")]));
            appends.push((id, channel.clone()));
        }
    }
    cluster.run_for(2_000);
    for (id, channel) in &appends {
        assert!(cluster.appended.contains_key(id), "{channel}: {:?}", cluster.results.get(id));
    }
    (cluster, channels)
}

#[test]
fn channels_spread_over_several_shards_commit_forward_and_report_as_one_node_and_each_alone() {
    let (mut cluster, channels) = sixteen_channels_over_four_shards(|_| {});
    for n in 1..=3 {
        let status = cluster.core(n).status();
        assert_eq!(status.channels_active, channels.len());
        for channel in &channels {
            let replica = status.channels.iter().find(|c| &c.channel == channel);
            // Committed everywhere (the log also holds the leadership's barrier records).
            assert!(
                replica.is_some_and(|r| r.hw == r.log_end && r.hw >= Seq::new(3)),
                "node {n}, {channel}: {replica:?}"
            );
            assert_eq!(cluster.core(n).read(channel, Seq::new(1), 10).unwrap().len(), 3);
            // The same replica alone, from its shard.
            assert_eq!(cluster.core(n).channel_status(channel).as_ref(), replica);
        }
        assert_eq!(cluster.core(n).active_channels(), channels.len());
    }
}

/// A status lists at most `status_channels_max` replicas, the first in channel order across the
/// shards, and counts them all; pages of at most that many list every replica once, in order.
#[test]
fn a_status_lists_a_bounded_page_of_replicas_and_pages_list_them_all_in_order() {
    let (mut cluster, channels) = sixteen_channels_over_four_shards(|config| config.status_channels_max = 5);
    let mut sorted = channels.clone();
    sorted.sort();
    let core = cluster.core(2);
    let status = core.status();
    assert_eq!(status.channels_active, 16);
    let listed: Vec<&ChannelId> = status.channels.iter().map(|c| &c.channel).collect();
    assert_eq!(listed, sorted.iter().take(5).collect::<Vec<_>>(), "the first five in channel order");
    let mut paged: Vec<ChannelId> = Vec::new();
    // Bounded: a page that did not move past `after` would come back for ever.
    for _ in 0..=16 {
        // A page asked larger than the limit holds at most the limit.
        let page = core.channel_statuses(paged.last(), 100);
        assert!(page.len() <= 5, "a page of {}", page.len());
        if page.is_empty() {
            break;
        }
        paged.extend(page.into_iter().map(|c| c.channel));
    }
    assert_eq!(paged, sorted, "every replica once, in channel order");
    assert_eq!(core.channel_statuses(Some(&sorted[13]), 2).len(), 2);
    assert!(core.channel_statuses(sorted.last(), 5).is_empty());
}

#[test]
fn a_created_channel_activates_on_first_use_not_at_creation() {
    let mut cluster = Cluster::with(3, |_| {});
    cluster.run_for(5_000);
    let channels: Vec<ChannelId> =
        (0..4).map(|i| ChannelId::new(ChannelType::GROUP, &format!("lazy-{i}")).unwrap()).collect();
    for channel in &channels {
        cluster.create_channel(1, channel);
    }
    cluster.run_for(2_000);
    // Created, its meta pushed to every replica: nothing to do until it is used.
    for n in 1..=3 {
        assert_eq!(cluster.core(n).active_channels(), 0, "node {n} activated a channel nobody used");
    }
    let id = cluster.api();
    let now = cluster.now;
    cluster.core(2).append(now, id, channels[0].clone(), records(&["first"]));
    cluster.run_for(2_000);
    assert!(cluster.appended.contains_key(&id), "{:?}", cluster.results.get(&id));
    for n in 1..=3 {
        // The used channel on each of its replicas (the leader by the append, the followers by its
        // replication), the others still not.
        assert_eq!(cluster.core(n).active_channels(), 1, "node {n}");
        let read = cluster.core(n).read(&channels[0], Seq::new(1), 10).unwrap();
        assert!(read.iter().any(|r| r.payload.as_ref() == b"first"), "node {n}: {read:?}");
    }
}

#[test]
fn a_node_whose_slot_store_failed_a_write_says_so_and_the_others_go_on() {
    let mut cluster = Cluster::with(3, |_| {});
    cluster.run_for(5_000);
    assert!((1..=3).all(|n| !cluster.core(n).status().slot_storage_failed));
    cluster.nodes.get(&NodeId::new(3)).unwrap().kv.fail(FailOp::Apply, 0, 1);
    let channel = ChannelId::new(ChannelType::GROUP, "after-a-failed-write").unwrap();
    let create = cluster.api();
    let now = cluster.now;
    cluster.core(1).create_channel(now, create, ChannelInfo { channel, flags: ChannelFlags::default() });
    // Node 3's slot replicas stop at the failed write (a leader among them is replaced by an election).
    assert!(cluster.run_until(10_000, |c| c.results.contains_key(&create)), "no answer");
    assert_eq!(cluster.results[&create], "Meta(Ok(()))");
    assert!(cluster.core(3).status().slot_storage_failed);
    assert!(!cluster.core(1).status().slot_storage_failed && !cluster.core(2).status().slot_storage_failed);
}

/// Each node has room for 2 active replicas and holds a replica of each of 12 busy channels (MinISR 2
/// of 3). A leader waiting for its followers cannot leave memory; were every place taken by such
/// leaders, each waiting for a follower another node has no room for, nothing would commit again. A
/// share of the room is kept for followers, and followers make room among themselves, without churning.
#[test]
fn more_busy_channels_than_room_for_active_replicas_all_commit() {
    let mut cluster = Cluster::with(3, |c| {
        c.active_channels_max = 2;
        c.reactors = 1;
    });
    cluster.run_for(3_000);
    let rooms: Vec<ChannelId> =
        (0..12).map(|i| ChannelId::new(ChannelType::GROUP, &format!("crowd-{i}")).unwrap()).collect();
    for room in &rooms {
        cluster.create_channel(1, room);
    }
    let leader = |cluster: &mut Cluster, room: &ChannelId| {
        cluster.core(1).reader().runtime_meta(room).ok().flatten().map_or(1, |m| m.leader.get())
    };
    // Load on every channel at once, each through the node that leads it, for 5 s.
    for _ in 0..50 {
        for room in &rooms {
            let via = leader(&mut cluster, room);
            cluster.append(via, room, &["load"]);
        }
        cluster.run_for(100);
    }
    // Then every channel must take an append again; refused ones (`TooManyChannels`: no room yet, or
    // timed out) are sent again.
    let mut waiting: Vec<(ChannelId, ApiId)> = Vec::new();
    for room in &rooms {
        let via = leader(&mut cluster, room);
        waiting.push((room.clone(), cluster.append(via, room, &["probe"])));
    }
    for _ in 0..120 {
        cluster.run_for(250);
        let mut still = Vec::new();
        for (room, id) in waiting {
            match (cluster.appended.contains_key(&id), cluster.results.contains_key(&id)) {
                (true, _) => {}
                (false, true) => {
                    let via = leader(&mut cluster, &room);
                    still.push((room.clone(), cluster.append(via, &room, &["probe"])));
                }
                (false, false) => still.push((room, id)),
            }
        }
        waiting = still;
    }
    let stuck: Vec<&ChannelId> = waiting.iter().map(|(room, _)| room).collect();
    assert!(stuck.is_empty(), "no append commits on {stuck:?} after the load");
    // Replicas come and go at the cap, but do not churn: 15-23 activations per node here. (A change that
    // let leaderships not started yet past the leaders' share made two quiescent leaders sharing one
    // leader's place evict each other 3.4 M times within one instant, each start hinting followers whose
    // pulls activated it again; the test still passed, 25-43 s later.)
    let activations: Vec<u64> = (1..=3).map(|n| cluster.core(n).status().activations).collect();
    assert!(activations.iter().all(|a| *a < 1_000), "activations churned at the cap: {activations:?}");
    for n in 1..=3 {
        // Its room, and past it at most the followers' reserve (an eighth, at least one place).
        let active = cluster.core(n).status().channels_active;
        assert!(active <= 2 + 1, "node {n} holds {active} active replicas, more than its room allows");
    }
}
