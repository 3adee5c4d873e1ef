//! The channel controller on virtual time: failover after the leader's node crashes (every acknowledged
//! message survives), leader transfer with a drain proof, the refusals, failing closed on too little or
//! conflicting evidence, and fences left by a controller that stopped in each phase being taken over.

mod support;

use bytes::Bytes;
use std::time::Duration;
use support::{append_acked, deliver, force_meta, read_all, with_fence, Cluster};
use tidings::channel::machine::AppendRecord;
use tidings::node::{NodeConfig, NodeError, NodeMessage, TaskBlocked, TaskError, TaskKind, TaskReport};
use tidings::router::hash_slot;
use tidings::slot::model::SwitchProof;
use tidings::store::message::{IdempotencyKey, MessageLog};
use tidings::store::{FailOp, Keyspace, MetaSpace};
use tidings::types::{ChannelId, ChannelRuntimeMeta, ChannelType, GroupId, NodeId, Seq};

fn channel(name: &str) -> ChannelId {
    ChannelId::new(ChannelType::GROUP, name).unwrap()
}

/// The meta of `channel` as node `n`'s slot replica has it.
fn stored_meta(cluster: &mut Cluster, n: u64, channel: &ChannelId) -> ChannelRuntimeMeta {
    cluster.core(n).reader().runtime_meta(channel).unwrap().expect("meta stored")
}

/// Three nodes, settled, and a channel created through node 1, with its meta.
fn three_nodes_and_a_channel(name: &str) -> (Cluster, ChannelId, ChannelRuntimeMeta) {
    let mut cluster = Cluster::new(3);
    cluster.run_for(3_000);
    let room = channel(name);
    cluster.create_channel(1, &room);
    let meta = stored_meta(&mut cluster, 1, &room);
    (cluster, room, meta)
}

/// Finished task reports for `channel` on every running node.
fn reports(cluster: &mut Cluster, channel: &ChannelId) -> Vec<TaskReport> {
    let ids: Vec<u64> = cluster.nodes.keys().map(|n| n.get()).collect();
    let mut found = Vec::new();
    for n in ids {
        if cluster.nodes[&NodeId::new(n)].core.is_none() {
            continue;
        }
        found.extend(cluster.core(n).status().finished_tasks.into_iter().filter(|r| &r.channel == channel));
    }
    found
}

/// Every acknowledged message is readable on node `n`, in seq order, once.
fn assert_all_readable(cluster: &mut Cluster, n: u64, channel: &ChannelId, acked: &[(Seq, String)]) {
    let ok = cluster.run_until(5_000, |c| {
        let read = read_all(c.core(n), channel).unwrap_or_default();
        let got: Vec<(Seq, String)> =
            read.iter().map(|r| (r.seq, String::from_utf8(r.payload.to_vec()).unwrap())).collect();
        acked.iter().all(|a| got.contains(a)) && got.windows(2).all(|w| w[0].0 < w[1].0)
    });
    assert!(ok, "node {n} misses acknowledged messages of {channel}");
}

#[test]
fn failover_after_the_leaders_node_crashes_loses_no_acknowledged_message() {
    let (mut cluster, lobby, old) = three_nodes_and_a_channel("lobby");
    let follower = old.replicas.iter().copied().find(|n| *n != old.leader).unwrap().get();
    let mut acked = append_acked(&mut cluster, follower, &lobby, "before", 20);

    cluster.crash(old.leader.get());
    // Appends through the follower fail while the leader is gone, then succeed under the new leader.
    acked.extend(append_acked(&mut cluster, follower, &lobby, "after", 10));
    let meta = stored_meta(&mut cluster, follower, &lobby);
    assert_ne!(meta.leader, old.leader);
    assert!(meta.leader_epoch > old.leader_epoch);
    assert_eq!(meta.write_fence, None, "the failover cleared its fence");
    let report = reports(&mut cluster, &lobby).into_iter().find(|r| r.kind == TaskKind::Failover).expect("report");
    assert_eq!(report.outcome, Ok(()));
    assert_eq!(report.old_leader, old.leader);
    assert_eq!(report.new_leader.map(|(n, _)| n), Some(meta.leader));
    assert!(report.evidence.len() > old.isr.len() - usize::from(old.min_isr), "{report:?}");
    assert!(report.evidence.iter().all(|e| e.node != old.leader), "a crashed node gave no evidence");
    assert_all_readable(&mut cluster, meta.leader.get(), &lobby, &acked);

    // The old leader comes back as a follower of the new epoch and catches up.
    cluster.restart(old.leader.get());
    let more = append_acked(&mut cluster, follower, &lobby, "later", 3);
    acked.extend(more);
    assert_all_readable(&mut cluster, old.leader.get(), &lobby, &acked);
}

#[test]
fn leader_transfer_drains_then_switches() {
    let (mut cluster, room, old) = three_nodes_and_a_channel("room");
    let mut acked = append_acked(&mut cluster, 1, &room, "m", 10);
    let target = old.replicas.iter().copied().find(|n| *n != old.leader).unwrap();
    let id = cluster.api();
    let now = cluster.now;
    cluster.core(3).transfer_leader(now, id, room.clone(), target);
    assert!(cluster.run_until(3_000, |c| c.tasks.contains_key(&id)));
    let report = cluster.tasks[&id].as_ref().expect("transfer succeeded").clone();
    assert_eq!(report.kind, TaskKind::Transfer { target });
    assert_eq!(report.new_leader, Some((target, old.leader_epoch.next())));
    let meta = stored_meta(&mut cluster, 1, &room);
    assert_eq!((meta.leader, meta.write_fence), (target, None));
    assert_eq!(meta.replicas[0], target, "an explicit transfer names the preferred replica");
    // The drain proof: the old leader and the target at the same end.
    let end = acked.last().unwrap().0;
    let by = |n: NodeId| report.evidence.iter().find(|e| e.node == n).map(|e| e.last_seq);
    assert!(by(old.leader) >= Some(end) && by(old.leader) == by(target), "{report:?}");
    acked.extend(append_acked(&mut cluster, 2, &room, "n", 5));
    for n in 1..=3 {
        assert_all_readable(&mut cluster, n, &room, &acked);
    }
}

#[test]
fn a_follower_activated_without_its_recent_records_leads_with_the_whole_idempotency_window() {
    // Replicas idle for a second are evicted; a follower activates again without its recent records.
    let mut cluster = Cluster::with(3, |config| config.channel_idle_evict = std::time::Duration::from_secs(1));
    cluster.run_for(3_000);
    let room = channel("keyed");
    cluster.create_channel(1, &room);
    let old = stored_meta(&mut cluster, 1, &room);
    let keyed = |payload: &str| {
        vec![AppendRecord {
            idempotency_key: IdempotencyKey::new(b"client-7:1".to_vec()),
            payload: Bytes::from(payload.to_owned()),
        }]
    };
    let first = cluster.api();
    let now = cluster.now;
    cluster.core(old.leader.get()).append(now, first, room.clone(), keyed("hello"));
    assert!(cluster.run_until(3_000, |c| c.appended.contains_key(&first)));
    let original = cluster.appended[&first].clone();
    cluster.run_for(5_000);
    assert!((1..=3).all(|n| cluster.core(n).active_channels() == 0), "every replica evicted");
    // An append without a key activates the leader (with its recent records) and, through replication,
    // the followers (without them).
    let acked = append_acked(&mut cluster, old.leader.get(), &room, "later", 1);
    let target = old.replicas.iter().copied().find(|n| *n != old.leader).unwrap();
    let id = cluster.api();
    let now = cluster.now;
    cluster.core(1).transfer_leader(now, id, room.clone(), target);
    assert!(cluster.run_until(3_000, |c| c.tasks.contains_key(&id)));
    assert!(cluster.tasks[&id].is_ok(), "{:?}", cluster.tasks[&id]);
    // The client retries its first append at the new leader: the original seq, not a second copy.
    let retry = cluster.api();
    let now = cluster.now;
    cluster.core(target.get()).append(now, retry, room.clone(), keyed("hello"));
    assert!(cluster.run_until(3_000, |c| c.appended.contains_key(&retry) || c.results.contains_key(&retry)));
    assert_eq!(cluster.appended.get(&retry), Some(&original), "{:?}", cluster.results.get(&retry));
    let copies = cluster
        .core(target.get())
        .read(&room, Seq::new(1), 100)
        .unwrap()
        .into_iter()
        .filter(|r| r.payload.as_ref() == b"hello")
        .count();
    assert_eq!(copies, 1);
    assert!(acked.iter().all(|(seq, _)| *seq > original[0]));
}

#[test]
fn transfers_that_cannot_work_are_refused_with_the_reason() {
    let (mut cluster, room, meta) = three_nodes_and_a_channel("refusals");
    let now = cluster.now;
    let ask = |cluster: &mut Cluster, channel: ChannelId, target: NodeId| {
        let id = cluster.api();
        cluster.core(1).transfer_leader(now, id, channel, target);
        cluster.run_for(100);
        cluster.tasks.remove(&id).expect("answered")
    };
    let to_leader = ask(&mut cluster, room.clone(), meta.leader);
    assert!(matches!(to_leader, Err(NodeError::Task(TaskError::AlreadyLeader(n))) if n == meta.leader));
    let outsider = ask(&mut cluster, room.clone(), NodeId::new(9));
    assert!(matches!(outsider, Err(NodeError::Task(TaskError::NotInIsr(n))) if n == NodeId::new(9)));
    let unknown = ask(&mut cluster, channel("nowhere"), NodeId::new(2));
    assert!(matches!(unknown, Err(NodeError::UnknownChannel(_))));
    let replace = |cluster: &mut Cluster, from: NodeId, to: NodeId| {
        let id = cluster.api();
        cluster.core(1).replace_replica(now, id, room.clone(), from, to);
        cluster.run_for(100);
        cluster.tasks.remove(&id).expect("answered")
    };
    let member = meta.isr[1];
    assert!(matches!(
        replace(&mut cluster, NodeId::new(9), NodeId::new(2)),
        Err(NodeError::Task(TaskError::NotReplica(_)))
    ));
    assert!(
        matches!(replace(&mut cluster, meta.leader, member), Err(NodeError::Task(TaskError::CannotJoin(n))) if n == member)
    );
    assert!(matches!(
        replace(&mut cluster, meta.leader, NodeId::new(9)),
        Err(NodeError::Task(TaskError::CannotJoin(_)))
    ));
    // A replica cannot replace itself (found by the simulator: the task ran and left the channel stuck).
    let follower = meta.isr[2];
    assert!(
        matches!(replace(&mut cluster, follower, follower), Err(NodeError::Task(TaskError::CannotJoin(n))) if n == follower)
    );
    assert_eq!(stored_meta(&mut cluster, 1, &room), meta, "refusals change nothing");
}

#[test]
fn a_transfer_whose_target_cannot_catch_up_unfences_and_keeps_the_leader() {
    let (mut cluster, room, old) = three_nodes_and_a_channel("stuck");
    let target = old.replicas.iter().copied().find(|n| *n != old.leader).unwrap();
    let other = old.replicas.iter().copied().find(|n| *n != old.leader && *n != target).unwrap();
    // The target is cut off; a message commits on the other two, so the target lags behind it.
    cluster.cut.insert(target);
    let acked = append_acked(&mut cluster, old.leader.get(), &room, "x", 1);
    let id = cluster.api();
    let now = cluster.now;
    cluster.core(other.get()).transfer_leader(now, id, room.clone(), target);
    assert!(cluster.run_until(10_000, |c| c.tasks.contains_key(&id)));
    assert!(matches!(cluster.tasks[&id], Err(NodeError::Task(TaskError::DrainTimedOut))), "{:?}", cluster.tasks[&id]);
    let meta = stored_meta(&mut cluster, other.get(), &room);
    assert_eq!((meta.leader, meta.leader_epoch, meta.write_fence), (old.leader, old.leader_epoch, None));
    let more = append_acked(&mut cluster, other.get(), &room, "y", 1);
    assert!(more[0].0 > acked[0].0, "the channel takes appends again after the failed transfer");
}

/// Five nodes and a channel whose leader `l` and a second replica `b` can both be lost while its slot
/// group keeps a quorum; `c` is the third replica, `s` a member of the slot group other than `l` and `b`.
fn five_nodes_and_a_channel() -> (Cluster, ChannelId, u64, u64, u64, u64) {
    let mut cluster = Cluster::new(5);
    cluster.run_for(3_000);
    let (room, replicas, slot_members) =
        find_channel(5, "five", |replicas, slot| !(slot.contains(&replicas[0]) && slot.contains(&replicas[1])));
    let (l, b, c) = (replicas[0], replicas[1], replicas[2]);
    let s = slot_members.iter().copied().find(|n| *n != l && *n != b).unwrap();
    cluster.create_channel(c.get(), &room);
    (cluster, room, l.get(), b.get(), c.get(), s.get())
}

/// The configuration the harness gives node 1 in a cluster of `nodes` (placement and slot groups are
/// the same on every node).
fn harness_config(nodes: u64) -> NodeConfig {
    let ids: Vec<NodeId> = (1..=nodes).map(NodeId::new).collect();
    NodeConfig { slot_groups: 4, ..NodeConfig::new(NodeId::new(1), ids) }
}

/// The members of slot group `group` in a cluster of `nodes`.
fn slot_members(nodes: u64, group: tidings::types::GroupId) -> Vec<NodeId> {
    harness_config(nodes).slot_group_members().into_iter().find(|(g, _)| *g == group).unwrap().1
}

/// The first channel `<prefix>-<i>` whose replicas (leader first) and slot-group members satisfy `fits`.
fn find_channel(
    nodes: u64,
    prefix: &str,
    fits: impl Fn(&[NodeId], &[NodeId]) -> bool,
) -> (ChannelId, Vec<NodeId>, Vec<NodeId>) {
    let config = harness_config(nodes);
    (0..)
        .find_map(|i| {
            let candidate = channel(&format!("{prefix}-{i}"));
            let replicas = config.channel_placement(&candidate);
            let members = slot_members(nodes, config.table().group_of_key(candidate.route_key()));
            fits(&replicas, &members).then_some((candidate, replicas, members))
        })
        .unwrap()
}

/// The task running for `channel` on any node, with the node.
fn running_task(cluster: &mut Cluster, channel: &ChannelId) -> Option<(u64, tidings::node::TaskStatus)> {
    let ids: Vec<u64> = cluster.nodes.iter().filter(|(_, n)| n.core.is_some()).map(|(id, _)| id.get()).collect();
    ids.into_iter()
        .find_map(|n| cluster.core(n).status().tasks.into_iter().find(|t| &t.channel == channel).map(|t| (n, t)))
}

#[test]
fn a_failover_without_enough_evidence_stays_fenced_until_evidence_arrives() {
    let (mut cluster, room, l, b, c, s) = five_nodes_and_a_channel();
    let acked = append_acked(&mut cluster, c, &room, "m", 5);
    cluster.crash(l);
    cluster.cut.insert(NodeId::new(b));
    cluster.run_for(4_000);
    let (_, task) = running_task(&mut cluster, &room).expect("a failover runs");
    assert_eq!(task.kind, TaskKind::Failover);
    assert_eq!(task.blocked, Some(TaskBlocked::NotEnoughEvidence { have: 1, need: 2 }));
    let meta = stored_meta(&mut cluster, s, &room);
    assert!(meta.replication_frozen(), "fenced with replication frozen: {meta:?}");
    assert_eq!(meta.leader, NodeId::new(l), "no leader is chosen on too little evidence");
    let replica = cluster.core(c).channel(&room).and_then(|m| m.meta().cloned()).expect("c replicates");
    assert!(replica.replication_frozen(), "the surviving replica froze before it answered");
    // The second replica's evidence arrives: the failover completes and nothing acknowledged is lost.
    cluster.cut.clear();
    let mut all = acked;
    all.extend(append_acked(&mut cluster, c, &room, "n", 3));
    let meta = stored_meta(&mut cluster, s, &room);
    assert!(meta.leader != NodeId::new(l) && meta.write_fence.is_none());
    assert_all_readable(&mut cluster, meta.leader.get(), &room, &all);
}

#[test]
fn conflicting_evidence_keeps_the_channel_fenced() {
    let (mut cluster, room, l, b, c, s) = five_nodes_and_a_channel();
    append_acked(&mut cluster, c, &room, "m", 3);
    cluster.crash(l);
    cluster.cut.insert(NodeId::new(b));
    cluster.run_for(4_000);
    let (controller, task) = running_task(&mut cluster, &room).expect("a failover runs");
    let version = stored_meta(&mut cluster, s, &room).version;
    // A replica claims a record of a leader epoch no meta ever granted.
    let forged = tidings::node::EvidenceReport {
        last_epoch: tidings::types::LeaderEpoch::new(99),
        last_seq: Seq::new(1_000),
        hw: Seq::new(0),
        pending_appends: 0,
        log_end: Seq::new(1_000),
        drained: false,
        fenced_by: Some(task.task),
    };
    let body =
        tidings::node::NodeMessage::EvidenceReply { task: task.task, channel: room.clone(), version, report: forged };
    deliver(&mut cluster, b, controller, body);
    cluster.run_for(100);
    let (_, task) = running_task(&mut cluster, &room).expect("still running");
    assert!(matches!(task.blocked, Some(TaskBlocked::ConflictingEvidence { node, .. }) if node == NodeId::new(b)));
    cluster.run_for(5_000);
    let meta = stored_meta(&mut cluster, s, &room);
    assert!(meta.replication_frozen() && meta.leader == NodeId::new(l), "fail closed: {meta:?}");
}

/// Proposes `next` over `current` through node `via` as a vanished controller would have, and waits.
#[test]
fn fences_left_by_a_vanished_controller_are_taken_over_in_every_phase() {
    let mut cluster = Cluster::new(3);
    cluster.run_for(3_000);
    // Phase "gathering": a failover fence (replication frozen) nobody finishes → the failover resumes.
    let frozen = channel("abandoned-failover");
    cluster.create_channel(1, &frozen);
    let acked = append_acked(&mut cluster, 1, &frozen, "f", 5);
    let base = stored_meta(&mut cluster, 1, &frozen);
    force_meta(&mut cluster, 1, &base, with_fence(&base, 777, true), None);
    // Phase "fenced for a transfer": a transfer fence nobody finishes → cleared, leader unchanged.
    let transfer = channel("abandoned-transfer");
    cluster.create_channel(1, &transfer);
    let base_t = stored_meta(&mut cluster, 1, &transfer);
    force_meta(&mut cluster, 1, &base_t, with_fence(&base_t, 778, false), None);
    // Phase "switched": the leader moved but the fence stayed → cleared, new leader kept.
    let switched = channel("abandoned-switch");
    cluster.create_channel(1, &switched);
    let sacked = append_acked(&mut cluster, 1, &switched, "s", 3);
    let base_s = stored_meta(&mut cluster, 1, &switched);
    let fenced_s = with_fence(&base_s, 779, false);
    force_meta(&mut cluster, 1, &base_s, fenced_s.clone(), None);
    let target = base_s.replicas.iter().copied().find(|n| *n != base_s.leader).unwrap();
    let end = sacked.last().unwrap().0;
    let mut next = fenced_s.clone();
    next.version += 1;
    next.leader = target;
    next.leader_epoch = base_s.leader_epoch.next();
    let epoch = base_s.leader_epoch;
    let proof = SwitchProof {
        task: 779,
        expected_leader_epoch: epoch,
        evidence: vec![(base_s.leader, epoch, end), (target, epoch, end)],
    };
    force_meta(&mut cluster, 1, &fenced_s, next, Some(proof));

    let settled = cluster.run_until(20_000, |c| {
        [&frozen, &transfer, &switched].iter().all(|ch| stored_meta(c, 1, ch).write_fence.is_none())
    });
    assert!(settled, "every abandoned fence is cleared");
    let f = stored_meta(&mut cluster, 1, &frozen);
    assert_eq!(f.leader_epoch, base.leader_epoch.next(), "the resumed failover named a leader in a new epoch");
    let report = reports(&mut cluster, &frozen).into_iter().find(|r| r.task == 777).expect("resumed under its task id");
    assert_eq!((report.kind, report.outcome.clone()), (TaskKind::Failover, Ok(())));
    let t = stored_meta(&mut cluster, 1, &transfer);
    assert_eq!((t.leader, t.leader_epoch), (base_t.leader, base_t.leader_epoch));
    assert!(reports(&mut cluster, &transfer).iter().any(|r| r.kind == TaskKind::ClearFence && r.task == 778));
    let s = stored_meta(&mut cluster, 1, &switched);
    assert_eq!((s.leader, s.leader_epoch), (target, base_s.leader_epoch.next()));
    // Every channel takes appends again; nothing acknowledged was lost.
    let mut all_f = acked;
    all_f.extend(append_acked(&mut cluster, 2, &frozen, "g", 2));
    assert_all_readable(&mut cluster, f.leader.get(), &frozen, &all_f);
    append_acked(&mut cluster, 2, &transfer, "t", 2);
    let mut all_s = sacked;
    all_s.extend(append_acked(&mut cluster, 2, &switched, "u", 2));
    assert_all_readable(&mut cluster, target.get(), &switched, &all_s);
}

/// The controller cannot read the meta of a channel whose abandoned fence is due for a takeover: the
/// fence is looked at again a takeover delay later, not forgotten as though it were cleared (before
/// session 60 it waited for the next repair pass to be seen again, here an hour away).
#[test]
fn a_fence_whose_meta_cannot_be_read_at_its_takeover_is_looked_at_again() {
    let mut cluster = Cluster::with(3, |config| config.controller.repair_idle_interval = Duration::from_secs(3600));
    cluster.run_for(3_000);
    let room = channel("unreadable-fence");
    cluster.create_channel(1, &room);
    let base = stored_meta(&mut cluster, 1, &room);
    let group = cluster.nodes[&NodeId::new(1)].config.table().group_of_key(room.route_key());
    let controller = cluster.slot_leader(group).expect("the group has a leader");
    force_meta(&mut cluster, 1, &base, with_fence(&base, 778, false), None);
    // The takeover is due 5 s after the fence was seen (when it was applied): its read of the meta
    // fails then.
    cluster.run_for(4_000);
    let space = MetaSpace::slot(group, hash_slot(room.route_key()));
    let kv = cluster.nodes[&NodeId::new(controller)].kv.clone();
    kv.fail_under(FailOp::Get, Keyspace::Meta, &space.kv_prefix(), 0, 1);
    assert!(stored_meta(&mut cluster, 1, &room).write_fence.is_some(), "not taken over yet");
    let cleared = cluster.run_until(12_000, |c| stored_meta(c, 1, &room).write_fence.is_none());
    assert_eq!(kv.injected_failures(), 1, "the takeover's read failed");
    assert!(cleared, "the fence is cleared a takeover delay after the failed read");
    assert!(reports(&mut cluster, &room).iter().any(|r| r.kind == TaskKind::ClearFence && r.task == 778));
}

/// A slot-group leader whose store fails to list the channels of its group's slots does not report a
/// drain as further along than it is: a pass that could not read everything files no report, and the
/// last complete one stands. (Before session 60 the pass counted the channels it could read, so the
/// report said fewer channel replicas were left on the drained node, down to none.)
#[test]
fn a_repair_pass_that_cannot_read_its_slots_does_not_report_a_drain_further_along() {
    let mut cluster = Cluster::new(3);
    cluster.run_for(3_000);
    for i in 0..12 {
        cluster.create_channel(1, &channel(&format!("drained-{i}")));
    }
    // Three nodes, three replicas a channel: the drained node's replicas have nowhere to go.
    let drained = NodeId::new(3);
    assert_eq!(cluster.call(1, |core, now, id| core.drain_node(now, id, drained, true)), "Meta(Ok(()))");
    let report_of = |c: &mut Cluster, n: u64| c.core(n).status().drains.into_iter().find(|r| r.node == drained);
    let leaders: Vec<(GroupId, u64)> =
        (1..=4).map(GroupId::new).map(|g| (g, cluster.slot_leader(g).expect("a leader"))).collect();
    assert!(cluster.run_until(5_000, |c| leaders.iter().all(|(_, l)| report_of(c, *l).is_some())));
    // The leader whose report counts the most channel replicas stops being able to list its slots.
    let (group, leader) =
        *leaders.iter().max_by_key(|(_, l)| report_of(&mut cluster, *l).unwrap().channel_replicas).unwrap();
    let before = report_of(&mut cluster, leader).unwrap();
    assert!(before.channel_replicas > 0, "{before:?}");
    let kv = cluster.nodes[&NodeId::new(leader)].kv.clone();
    let table = cluster.nodes[&NodeId::new(leader)].config.table();
    for slot in table.slots_of(group) {
        kv.fail_under(FailOp::Scan, Keyspace::Meta, &MetaSpace::slot(group, slot).kv_prefix(), 0, u64::MAX);
    }
    cluster.run_for(5_000);
    assert!(kv.injected_failures() > 0, "the passes tried to list the slots");
    assert_eq!(cluster.slot_leader(group), Some(leader), "still the group's leader");
    assert_eq!(report_of(&mut cluster, leader), Some(before), "the last complete pass's report stands");
    // Readable again: the passes are complete and report again.
    kv.clear_failpoints();
    cluster.run_for(3_000);
    assert!(report_of(&mut cluster, leader).is_some_and(|r| r.channel_replicas > 0));
}

#[test]
fn a_leader_that_restarts_before_anyone_notices_gets_a_failover_it_asked_for() {
    let (mut cluster, room, old) = three_nodes_and_a_channel("quick-restart");
    let follower = old.replicas.iter().copied().find(|n| *n != old.leader).unwrap().get();
    let mut acked = append_acked(&mut cluster, follower, &room, "a", 5);
    // Back within a fraction of the failure-detection time: nobody saw it down, but its replica must
    // not lead the epoch it led before the crash again.
    cluster.crash(old.leader.get());
    cluster.run_for(200);
    cluster.restart(old.leader.get());
    acked.extend(append_acked(&mut cluster, follower, &room, "b", 5));
    let meta = stored_meta(&mut cluster, follower, &room);
    assert!(meta.leader_epoch > old.leader_epoch && meta.write_fence.is_none(), "{meta:?}");
    assert!(reports(&mut cluster, &room).iter().any(|r| r.kind == TaskKind::Failover && r.outcome.is_ok()));
    assert_all_readable(&mut cluster, meta.leader.get(), &room, &acked);
}

/// Four nodes, a channel on three of them, and the fourth (`spare`).
fn four_nodes_and_a_channel(name: &str) -> (Cluster, ChannelId, ChannelRuntimeMeta, NodeId) {
    four_nodes_and_a_channel_with(name, |_| {})
}

/// [`four_nodes_and_a_channel`] with every node's configuration changed by `tweak`.
fn four_nodes_and_a_channel_with(
    name: &str,
    tweak: impl Fn(&mut NodeConfig),
) -> (Cluster, ChannelId, ChannelRuntimeMeta, NodeId) {
    let mut cluster = Cluster::with(4, tweak);
    cluster.run_for(3_000);
    let room = channel(name);
    cluster.create_channel(1, &room);
    let meta = any_stored_meta(&mut cluster, &room);
    let spare = (1..=4).map(NodeId::new).find(|n| !meta.is_replica(*n)).unwrap();
    (cluster, room, meta, spare)
}

/// The meta of `channel` from any running node whose slot replica has it.
fn any_stored_meta(cluster: &mut Cluster, channel: &ChannelId) -> ChannelRuntimeMeta {
    let ids: Vec<u64> = cluster.nodes.iter().filter(|(_, n)| n.core.is_some()).map(|(id, _)| id.get()).collect();
    ids.into_iter()
        .filter_map(|n| cluster.core(n).reader().runtime_meta(channel).ok().flatten())
        .max_by_key(|m| m.version)
        .expect("some node stores the meta")
}

/// Replaces `from` by `to` through node `via` while appending through `via`; returns the report and
/// every acknowledged message.
fn replace_under_load(
    cluster: &mut Cluster,
    via: u64,
    room: &ChannelId,
    from: NodeId,
    to: NodeId,
) -> (TaskReport, Vec<(Seq, String)>) {
    let mut acked = append_acked(cluster, via, room, "before", 20);
    let id = cluster.api();
    let now = cluster.now;
    cluster.core(via).replace_replica(now, id, room.clone(), from, to);
    let mut round = 0;
    while !cluster.tasks.contains_key(&id) && round < 40 {
        acked.extend(append_acked(cluster, via, room, &format!("during-{round}"), 1));
        round += 1;
    }
    assert!(cluster.run_until(10_000, |c| c.tasks.contains_key(&id)));
    let report = cluster.tasks.remove(&id).unwrap().expect("replacement succeeded");
    acked.extend(append_acked(cluster, via, room, "after", 5));
    (report, acked)
}

#[test]
fn replacing_a_follower_keeps_appends_going_and_loses_nothing() {
    let (mut cluster, room, old, spare) = four_nodes_and_a_channel("replace-follower");
    let from = old.isr.iter().copied().find(|n| *n != old.leader).unwrap();
    let (report, acked) = replace_under_load(&mut cluster, spare.get(), &room, from, spare);
    assert_eq!(report.kind, TaskKind::Replace { from, to: spare });
    let meta = any_stored_meta(&mut cluster, &room);
    assert!(!meta.is_replica(from) && meta.in_isr(spare) && meta.write_fence.is_none(), "{meta:?}");
    assert_eq!((meta.leader, meta.leader_epoch), (old.leader, old.leader_epoch), "the leader stays");
    assert!(meta.epoch > old.epoch, "membership changes bump the epoch");
    assert_all_readable(&mut cluster, spare.get(), &room, &acked);
    assert_all_readable(&mut cluster, old.leader.get(), &room, &acked);
}

/// A sweep for logs of replicas moved away that passes every second (by default every 10 minutes).
fn quick_stray_sweep(config: &mut NodeConfig) {
    config.stray_logs.pass_interval = std::time::Duration::from_secs(1);
    config.stray_logs.page_interval = std::time::Duration::from_millis(100);
}

/// `true` once node `n` holds no log of `channel`.
fn log_forgotten(cluster: &Cluster, n: NodeId, channel: &ChannelId) -> bool {
    use tidings::store::message::MessageLog;
    !cluster.nodes[&n].log.logs_after(None, usize::MAX).unwrap().contains(channel)
}

#[test]
fn a_replica_moved_away_forgets_its_log_and_starts_from_nothing_when_added_back() {
    let (mut cluster, room, old, spare) = four_nodes_and_a_channel_with("moved-away", quick_stray_sweep);
    let from = old.isr.iter().copied().find(|n| *n != old.leader).unwrap();
    let (_, mut acked) = replace_under_load(&mut cluster, spare.get(), &room, from, spare);
    assert!(!log_forgotten(&cluster, spare, &room));
    assert!(cluster.run_until(10_000, |c| log_forgotten(c, from, &room)), "the log moved away stays");
    assert_eq!(cluster.core(from.get()).status().stray_logs_forgotten, 1);
    assert!(cluster.core(from.get()).status().stray_log_passes > 0);
    for replica in any_stored_meta(&mut cluster, &room).replicas {
        assert!(!log_forgotten(&cluster, replica, &room), "{replica} is a replica");
        assert_all_readable(&mut cluster, replica.get(), &room, &acked);
    }
    // The node it left still takes appends for the channel (it forwards them to the leader). Also once
    // restarted, when the first meta it hears of is a late push from before the move (a lagging slot
    // replica's): its log's tombstone makes that one stale, and the meta in force, the one that moved
    // the replica away, routes the appends (sim seed 438001303: refused as older than the tombstone,
    // it left the node's appends for the channel waiting for a newer meta, and failing, for good).
    acked.extend(append_acked(&mut cluster, from.get(), &room, "through-the-node-it-left", 3));
    cluster.crash(from.get());
    cluster.restart(from.get());
    cluster.run_for(3_000);
    // (A version the move went through, which still named this node; not the one as created, which
    // activates nothing until used.)
    let stale = ChannelRuntimeMeta { version: old.version + 1, ..old.clone() };
    deliver(&mut cluster, old.leader.get(), from.get(), NodeMessage::MetaPush(stale));
    acked.extend(append_acked(&mut cluster, from.get(), &room, "through-it-restarted", 3));
    // Added back in place of another follower: it catches up from an empty log, and holds everything.
    let other = any_stored_meta(&mut cluster, &room).isr.into_iter().find(|n| *n != old.leader && *n != spare);
    let (_, again) = replace_under_load(&mut cluster, old.leader.get(), &room, other.unwrap(), from);
    acked.extend(again);
    assert!(any_stored_meta(&mut cluster, &room).in_isr(from));
    assert_all_readable(&mut cluster, from.get(), &room, &acked);
}

#[test]
fn a_replica_moved_away_while_its_node_was_down_is_forgotten_once_the_node_is_back() {
    let (mut cluster, room, old, spare) = four_nodes_and_a_channel_with("moved-while-down", quick_stray_sweep);
    let acked = append_acked(&mut cluster, old.leader.get(), &room, "m", 10);
    let from = old.isr.iter().copied().find(|n| *n != old.leader).unwrap();
    cluster.crash(from.get());
    let id = cluster.api();
    let now = cluster.now;
    cluster.core(old.leader.get()).replace_replica(now, id, room.clone(), from, spare);
    assert!(cluster.run_until(20_000, |c| c.tasks.contains_key(&id)));
    assert!(cluster.tasks[&id].is_ok(), "{:?}", cluster.tasks[&id]);
    assert!(!log_forgotten(&cluster, from, &room), "down: nothing forgot it");
    cluster.restart(from.get());
    assert!(cluster.run_until(15_000, |c| log_forgotten(c, from, &room)), "the log moved away stays");
    for replica in any_stored_meta(&mut cluster, &room).replicas {
        assert_all_readable(&mut cluster, replica.get(), &room, &acked);
    }
}

#[test]
fn replacing_the_leader_hands_the_leadership_to_the_new_replica() {
    let (mut cluster, room, old, spare) = four_nodes_and_a_channel("replace-leader");
    let (report, acked) = replace_under_load(&mut cluster, spare.get(), &room, old.leader, spare);
    let meta = any_stored_meta(&mut cluster, &room);
    assert_eq!((meta.leader, meta.leader_epoch), (spare, old.leader_epoch.next()));
    assert_eq!(report.new_leader, Some((spare, old.leader_epoch.next())));
    assert!(!meta.is_replica(old.leader));
    assert_all_readable(&mut cluster, spare.get(), &room, &acked);
}

#[test]
fn a_replacement_that_cannot_catch_up_fails_and_takes_its_learner_out_again() {
    let catch_up = |config: &mut NodeConfig| config.controller.catch_up_timeout = std::time::Duration::from_secs(3);
    let (mut cluster, room, old, spare) = four_nodes_and_a_channel_with("replace-gives-up", catch_up);
    let mut acked = append_acked(&mut cluster, old.leader.get(), &room, "before", 5);
    // The spare is gone: it is added as a learner, and never catches up.
    cluster.crash(spare.get());
    let from = old.isr.iter().copied().find(|n| *n != old.leader).unwrap();
    let id = cluster.api();
    let now = cluster.now;
    cluster.core(old.leader.get()).replace_replica(now, id, room.clone(), from, spare);
    assert!(cluster.run_until(10_000, |c| c.tasks.contains_key(&id)));
    assert!(matches!(cluster.tasks[&id], Err(NodeError::Task(TaskError::DrainTimedOut))), "{:?}", cluster.tasks[&id]);
    // The members are what they were, one membership change later than the learner's addition.
    let removed = |c: &mut Cluster| !any_stored_meta(c, &room).is_replica(spare);
    assert!(cluster.run_until(5_000, removed), "the learner stays: {:?}", any_stored_meta(&mut cluster, &room));
    let meta = any_stored_meta(&mut cluster, &room);
    assert_eq!((&meta.replicas, &meta.isr, meta.leader), (&old.replicas, &old.isr, old.leader));
    assert_eq!(meta.epoch, old.epoch.next().next(), "added, then taken out");
    let removal = TaskKind::RemoveLearner { node: spare };
    assert!(reports(&mut cluster, &room).iter().any(|r| r.kind == removal && r.outcome.is_ok()));
    acked.extend(append_acked(&mut cluster, old.leader.get(), &room, "after", 3));
    for replica in &meta.replicas {
        assert_all_readable(&mut cluster, replica.get(), &room, &acked);
    }
}

#[test]
fn a_channel_over_its_replication_factor_gives_a_replica_up_while_appends_go_on() {
    let catch_up = |config: &mut NodeConfig| config.controller.catch_up_timeout = std::time::Duration::from_secs(2);
    let (mut cluster, room, old, spare) = four_nodes_and_a_channel_with("over-factor", catch_up);
    let mut acked = append_acked(&mut cluster, old.leader.get(), &room, "before", 5);
    // What a replacement interrupted after adding its new replica leaves: a fourth replica, which the
    // leader takes into the ISR once it has caught up.
    let mut over = old.clone();
    over.version += 1;
    over.epoch = over.epoch.next();
    over.replicas.push(spare);
    force_meta(&mut cluster, old.leader.get(), &old, over, None);
    let mut round = 0;
    while any_stored_meta(&mut cluster, &room).replicas.len() > 3 && round < 60 {
        acked.extend(append_acked(&mut cluster, old.leader.get(), &room, &format!("during-{round}"), 1));
        round += 1;
    }
    let meta = any_stored_meta(&mut cluster, &room);
    assert_eq!(meta.replicas.len(), 3, "the surplus stays: {meta:?}");
    let mut kept = meta.replicas.clone();
    kept.sort();
    let mut before = old.replicas.clone();
    before.sort();
    assert_eq!(kept, before, "the last added replica (neither leader nor preferred) leaves");
    let gave_up = |r: &TaskReport| match r.kind {
        TaskKind::Replace { from, .. } => from == spare && r.outcome.is_ok(),
        TaskKind::RemoveLearner { node } => node == spare && r.outcome.is_ok(),
        _ => false,
    };
    assert!(reports(&mut cluster, &room).iter().any(gave_up), "{:?}", reports(&mut cluster, &room));
    acked.extend(append_acked(&mut cluster, old.leader.get(), &room, "after", 3));
    for replica in &meta.replicas {
        assert_all_readable(&mut cluster, replica.get(), &room, &acked);
    }
}

#[test]
fn repair_replaces_a_dead_replica_when_the_isr_falls_below_min_isr() {
    let mut cluster =
        Cluster::with(4, |config| config.controller.replace_down_after = std::time::Duration::from_secs(3));
    cluster.run_for(3_000);
    // A channel whose two followers can die while its slot group keeps a quorum.
    let (room, meta, _) =
        find_channel(4, "repair", |replicas, slot| slot.iter().filter(|n| replicas[1..].contains(n)).count() <= 1);
    cluster.create_channel(meta[0].get(), &room);
    let leader = meta[0].get();
    let mut acked = append_acked(&mut cluster, leader, &room, "a", 10);
    cluster.crash(meta[1].get());
    cluster.crash(meta[2].get());
    // One replica is replaced by the spare; the channel commits again with MinISR 2 of the new ISR.
    acked.extend(append_acked(&mut cluster, leader, &room, "b", 3));
    let now_meta = any_stored_meta(&mut cluster, &room);
    let spare = (1..=4).map(NodeId::new).find(|n| !meta.contains(n)).unwrap();
    assert!(now_meta.in_isr(spare), "{now_meta:?}");
    let replaced = |c: &mut Cluster| {
        reports(c, &room)
            .iter()
            .any(|r| matches!(r.kind, TaskKind::Replace { to, .. } if to == spare) && r.outcome.is_ok())
    };
    let done = cluster.run_until(15_000, replaced);
    if !done {
        eprintln!("reports {:?}", reports(&mut cluster, &room));
        eprintln!("meta {:?}", any_stored_meta(&mut cluster, &room));
    }
    assert!(done, "the repair's replacement finishes");
    let final_meta = any_stored_meta(&mut cluster, &room);
    assert_eq!(final_meta.replicas.len(), 3, "one dead replica left, the spare joined: {final_meta:?}");
    assert_all_readable(&mut cluster, spare.get(), &room, &acked);
}

/// The node leading `group`, if any running node leads it.
fn group_leader(cluster: &mut Cluster, group: tidings::types::GroupId) -> Option<u64> {
    let ids: Vec<u64> = cluster.nodes.iter().filter(|(_, n)| n.core.is_some()).map(|(id, _)| id.get()).collect();
    ids.into_iter().find(|n| cluster.core(*n).slot().is_leader(group))
}

#[test]
fn slot_groups_move_to_their_preferred_leader_only_when_the_intent_fits() {
    use tidings::node::Reconcile;
    use tidings::slot::model::GroupIntent;
    use tidings::types::{ConfigEpoch, GroupId};
    let mut cluster = Cluster::new(3);
    cluster.run_for(3_000);
    let group = GroupId::new(1);
    let members = slot_members(3, group);
    let leader = group_leader(&mut cluster, group).expect("group 1 has a leader");
    let preferred = members.iter().copied().find(|n| n.get() != leader).unwrap();
    let set = |cluster: &mut Cluster, intent: GroupIntent| {
        let id = cluster.api();
        let now = cluster.now;
        cluster.core(1).set_group_intent(now, id, intent);
        cluster.run_for(300);
        assert_eq!(cluster.results.get(&id).map(String::as_str), Some("Meta(Ok(()))"));
    };
    // An intent whose voters do not match: the leader does nothing and says why.
    let mut wrong = members.clone();
    wrong.pop();
    set(
        &mut cluster,
        GroupIntent {
            group,
            desired_peers: wrong,
            config_epoch: ConfigEpoch::new(0),
            preferred_leader: Some(preferred),
            target_peers: None,
            draining: Vec::new(),
        },
    );
    cluster.run_for(2_000);
    assert_eq!(group_leader(&mut cluster, group), Some(leader));
    let decision = cluster.core(leader).status().leadership.into_iter().find(|(g, _)| *g == group).map(|(_, d)| d);
    assert!(matches!(decision, Some(Reconcile::VoterMismatch { .. })), "{decision:?}");
    // A fresh, fitting intent: leadership moves to the preferred node, which then has nothing to do.
    set(
        &mut cluster,
        GroupIntent {
            group,
            desired_peers: members.clone(),
            config_epoch: ConfigEpoch::new(0),
            preferred_leader: Some(preferred),
            target_peers: None,
            draining: Vec::new(),
        },
    );
    assert!(cluster.run_until(10_000, |c| group_leader(c, group) == Some(preferred.get())), "leadership moved");
    cluster.run_for(1_500);
    let decision =
        cluster.core(preferred.get()).status().leadership.into_iter().find(|(g, _)| *g == group).map(|(_, d)| d);
    assert_eq!(decision, Some(Reconcile::AlreadyPreferred));
    // Metadata keeps working through the move.
    cluster.create_channel(2, &channel("after-move"));
}

#[test]
fn a_channel_created_while_a_node_is_down_is_placed_on_live_nodes_and_takes_appends_at_once() {
    let mut cluster = Cluster::new(5);
    cluster.run_for(3_000);
    let down = NodeId::new(4);
    let (room, preferred, _) = find_channel(5, "born-while-down", |replicas, _| replicas[0] == down);
    cluster.crash(down.get());
    // Past the failure detector's limit (1.5 s by default): node 1 holds node 4 down.
    cluster.run_for(2_500);
    cluster.create_channel(1, &room);
    let meta = any_stored_meta(&mut cluster, &room);
    assert!(!meta.is_replica(down), "no replica on the down node: {meta:?}");
    assert_eq!(meta.replicas.len(), 3);
    assert_eq!(meta.replicas[..2], preferred[1..], "the other preferred replicas move up, in order");
    assert_eq!(meta.leader, preferred[1]);
    // Led by a live node, the channel commits without waiting for a failover.
    let acked = append_acked(&mut cluster, 1, &room, "born", 3);
    assert_all_readable(&mut cluster, meta.leader.get(), &room, &acked);
    assert!(reports(&mut cluster, &room).is_empty(), "no task was needed to make it writable");
}

/// Crashes the leader of a channel whose preferred replica leads, waits for the failover, restarts it,
/// and runs `then_for` ms; returns the cluster, the channel, the preferred node, every acknowledged
/// message and when the node restarted.
fn fail_over_and_come_back(
    rebalance_after: Option<std::time::Duration>,
    then_for: u64,
) -> (Cluster, ChannelId, NodeId, Vec<(Seq, String)>, tidings::types::Time) {
    let mut cluster = Cluster::with(3, |config| config.controller.rebalance_leaders_after = rebalance_after);
    cluster.run_for(3_000);
    let room = channel("comes-back");
    cluster.create_channel(1, &room);
    let first = any_stored_meta(&mut cluster, &room);
    let preferred = first.replicas[0];
    assert_eq!(first.leader, preferred, "placement's first replica leads a new channel");
    let via = first.replicas[1].get();
    let mut acked = append_acked(&mut cluster, via, &room, "before", 3);
    cluster.crash(preferred.get());
    acked.extend(append_acked(&mut cluster, via, &room, "away", 3));
    let failed_over = any_stored_meta(&mut cluster, &room);
    assert_ne!(failed_over.leader, preferred);
    assert_eq!(failed_over.replicas[0], preferred, "a failover keeps the preferred replica first");
    cluster.restart(preferred.get());
    let restarted_at = cluster.now;
    cluster.run_for(then_for);
    acked.extend(append_acked(&mut cluster, via, &room, "back", 3));
    (cluster, room, preferred, acked, restarted_at)
}

#[test]
fn leadership_returns_to_the_preferred_replica_once_it_has_been_back_long_enough() {
    let after = std::time::Duration::from_secs(3);
    let (mut cluster, room, preferred, acked, restarted_at) = fail_over_and_come_back(Some(after), 0);
    let returned = cluster.run_until(40_000, |c| {
        let meta = any_stored_meta(c, &room);
        meta.leader == preferred && meta.write_fence.is_none()
    });
    assert!(returned, "leadership back on {preferred}: {:?}", any_stored_meta(&mut cluster, &room));
    // The repair pass comes when the wait is over, not after a whole idle interval (10 s).
    let took = cluster.now.since(restarted_at);
    assert!(took < after + std::time::Duration::from_secs(3), "back {took:?} after the restart");
    let report = reports(&mut cluster, &room)
        .into_iter()
        .find(|r| r.kind == TaskKind::Transfer { target: preferred })
        .expect("a transfer back, started by the controller itself");
    assert_eq!(report.outcome, Ok(()));
    let mut acked = acked;
    acked.extend(append_acked(&mut cluster, preferred.get(), &room, "home", 3));
    for n in 1..=3 {
        assert_all_readable(&mut cluster, n, &room, &acked);
    }
}

#[test]
fn without_rebalancing_leadership_stays_where_the_failover_put_it() {
    // 45 s: past the default's 30 s, so a `None` taken for the default would show.
    let (mut cluster, room, preferred, acked, _) = fail_over_and_come_back(None, 45_000);
    let meta = any_stored_meta(&mut cluster, &room);
    assert_ne!(meta.leader, preferred);
    assert!(reports(&mut cluster, &room).iter().all(|r| r.kind == TaskKind::Failover), "no transfer");
    assert_all_readable(&mut cluster, preferred.get(), &room, &acked);
}

#[test]
fn a_slot_group_leader_cut_off_from_everyone_fails_no_channel_over() {
    // Five nodes, a channel led by a node outside its slot group; the group's leader is cut off. Until
    // check-quorum deposes it, the cut-off node still leads its group, and it hears nobody: every peer
    // looks down to it, the channel's leader included.
    let mut cluster = Cluster::new(5);
    cluster.run_for(3_000);
    let (room, replicas, _) = find_channel(5, "cut", |replicas, slot| !slot.contains(&replicas[0]));
    cluster.create_channel(1, &room);
    let leader = replicas[0].get();
    let group = harness_config(5).table().group_of_key(room.route_key());
    let acked = append_acked(&mut cluster, leader, &room, "before", 3);
    // Whether check-quorum deposes it before the failure detector holds the others down depends on
    // where in its election timeout the cut falls: cut it at several offsets.
    for offset_ms in [0, 300, 600, 900] {
        cluster.run_for(offset_ms);
        let slot_leader = cluster.slot_leader(group).expect("the group has a leader");
        cluster.cut.insert(NodeId::new(slot_leader));
        cluster.run_for(8_000);
        cluster.cut.clear();
        cluster.run_for(8_000);
    }
    let failovers: Vec<TaskReport> =
        reports(&mut cluster, &room).into_iter().filter(|r| r.kind == TaskKind::Failover).collect();
    assert!(failovers.is_empty(), "a failover of a healthy leader: {failovers:?}");
    assert_eq!(any_stored_meta(&mut cluster, &room).leader, replicas[0]);
    assert_all_readable(&mut cluster, leader, &room, &acked);
}

#[test]
fn a_leader_that_asks_for_a_failover_while_a_transfer_waits_for_its_drain_gets_it_at_once() {
    let mut cluster = Cluster::new(3);
    cluster.run_for(3_000);
    // A channel whose leader does not lead its slot group: the group goes on deciding while it is down.
    let config = harness_config(3);
    let room = (0..)
        .map(|i| channel(&format!("restart-mid-transfer-{i}")))
        .find(|c| {
            cluster.slot_leader(config.table().group_of_key(c.route_key()))
                != Some(config.channel_placement(c)[0].get())
        })
        .unwrap();
    cluster.create_channel(1, &room);
    let old = stored_meta(&mut cluster, 1, &room);
    let follower = old.replicas.iter().copied().find(|n| *n != old.leader).unwrap();
    let mut acked = append_acked(&mut cluster, follower.get(), &room, "a", 5);
    // The leader crashes; a transfer fences the channel and waits for it to drain; it is back before
    // anyone holds it down. Its replica must not lead its epoch again, so it never drains: it asks for
    // a failover.
    cluster.crash(old.leader.get());
    let id = cluster.api();
    let now = cluster.now;
    // On the slot group's leader, whose controller also takes the failover request.
    let slot_leader = cluster.slot_leader(config.table().group_of_key(room.route_key())).unwrap();
    cluster.core(slot_leader).transfer_leader(now, id, room.clone(), follower);
    assert!(cluster.run_until(1_000, |c| stored_meta(c, follower.get(), &room).write_fence.is_some()));
    cluster.restart(old.leader.get());
    let started = cluster.now;
    let drain_timeout = tidings::node::ControllerConfig::default().drain_timeout;
    let failed_over = cluster.run_until(u64::try_from(drain_timeout.as_millis()).unwrap() / 2, |c| {
        let meta = stored_meta(c, follower.get(), &room);
        meta.leader_epoch > old.leader_epoch && meta.write_fence.is_none()
    });
    let waited = cluster.now.since(started);
    assert!(failed_over, "still fenced {waited:?} after the leader asked: the transfer waited for its drain");
    assert!(matches!(cluster.tasks.get(&id), Some(Err(_))), "the transfer gave way: {:?}", cluster.tasks.get(&id));
    acked.extend(append_acked(&mut cluster, follower.get(), &room, "b", 5));
    let meta = stored_meta(&mut cluster, follower.get(), &room);
    assert_all_readable(&mut cluster, meta.leader.get(), &room, &acked);
}

/// The zombie leader of session 32 (sim seed 383000412), end to end: a leader answers a transfer's
/// evidence request under the fenced meta while its own slot replica has not applied the fence, then
/// restarts on that replica. Its log holds the fence's version as its floor, so the meta before the
/// fence — which names it leader of an epoch it never began — neither activates it nor admits the
/// append it is given; once it hears from the cluster again the channel takes appends. (Without the
/// floor check it wrote its barrier and committed the append alone, MinISR 1, under a meta the
/// transfer had moved past.)
#[test]
fn a_leader_restarted_on_a_slot_replica_without_the_fence_it_answered_under_does_not_lead() {
    // Channels of two replicas (MinISR 1) on three nodes: the slot groups keep a quorum without the
    // leader. Nodes are taken for down only after a minute: no failover while the leader is cut off.
    let mut cluster = Cluster::with(3, |config| {
        config.channel_replicas = 2;
        config.channel_min_isr = 1;
        config.controller.node_down_after = std::time::Duration::from_secs(60);
    });
    cluster.run_for(3_000);
    let room = channel("zombie");
    cluster.create_channel(1, &room);
    let before = stored_meta(&mut cluster, 1, &room);
    let leader = before.leader.get();
    let other = (1..=3).find(|n| *n != leader).unwrap();
    assert_eq!(cluster.nodes[&before.leader].log.state(&room).unwrap().last_seq, Seq::new(0), "never begun");

    // The leader is cut off; a transfer's fence (no replication freeze) commits without it.
    cluster.cut.insert(before.leader);
    cluster.run_for(3_000);
    let fenced = with_fence(&before, 77, false);
    force_meta(&mut cluster, other, &before, fenced.clone(), None);
    assert_eq!(stored_meta(&mut cluster, leader, &room).version, before.version, "its slot replica lags");

    // The controller's request reaches it (its answer is lost): its floor is written first, then its
    // activation's load is asked for — held here, so that the replica never writes its barrier (as
    // when it crashes before that write is durable).
    cluster.hold_reads = true;
    let request = tidings::node::NodeMessage::EvidenceRequest { task: 77, meta: fenced.clone() };
    deliver(&mut cluster, other, leader, request);
    cluster.run_for(100);
    assert_eq!(cluster.nodes[&before.leader].log.state(&room).unwrap().meta_floor, fenced.version);

    assert!(!cluster.held_reads.is_empty(), "the activation waits for its load");

    // Restarted, still cut off: its slot replica names it leader under the meta before the fence.
    cluster.crash(leader);
    cluster.held_reads.clear();
    cluster.hold_reads = false;
    cluster.restart(leader);
    assert_eq!(stored_meta(&mut cluster, leader, &room).version, before.version);
    let append = cluster.append(leader, &room, &["zombie"]);
    cluster.run_for(1_000);
    let log = cluster.nodes[&before.leader].log.state(&room).unwrap();
    assert_eq!(log.last_seq, Seq::new(0), "no barrier, no record under the stale meta: {log:?}");
    assert!(cluster.core(leader).status().channels.iter().all(|c| c.channel != room), "not activated");
    assert!(!cluster.appended.contains_key(&append));

    // Back in touch: the fence is taken over and the channel takes appends again.
    cluster.cut.clear();
    let acked = append_acked(&mut cluster, leader, &room, "after", 1);
    assert_eq!(acked.len(), 1);
}
