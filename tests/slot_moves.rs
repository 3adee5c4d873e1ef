//! Slot-group replica moves through the node API, on a virtual-time cluster: learner, catch-up, hand-off,
//! joint configuration, commit of the assignment; every refusal; abort; a crash of the leader mid-move;
//! metadata writes running throughout, none lost.

mod support;

use support::Cluster;
use tidings::node::{MembershipStep, Reconcile};
use tidings::slot::model::ChannelInfo;
use tidings::types::{ChannelId, ChannelType, GroupId, NodeId};

const GROUP: GroupId = GroupId::new(1);

fn members(cluster: &Cluster, group: GroupId) -> Vec<NodeId> {
    let config = &cluster.nodes[&NodeId::new(1)].config;
    config.slot_group_members().into_iter().find(|(g, _)| *g == group).unwrap().1
}

/// Proposes a move (or abort) through node 1 and returns the API result.
fn call(
    cluster: &mut Cluster,
    op: impl FnOnce(&mut tidings::node::NodeCore, tidings::types::Time, tidings::node::ApiId),
) -> String {
    cluster.call(1, op)
}

fn channel(name: &str) -> ChannelId {
    ChannelId::new(ChannelType::GROUP, name).unwrap()
}

/// Metadata writes issued while a move runs: one channel creation per call, through rotating nodes.
struct Load {
    next: u64,
    issued: Vec<(tidings::node::ApiId, ChannelId)>,
}

impl Load {
    fn step(&mut self, cluster: &mut Cluster) {
        self.next += 1;
        let via = 1 + self.next % cluster.nodes.len() as u64;
        if cluster.nodes[&NodeId::new(via)].core.is_none() {
            return;
        }
        let id = cluster.api();
        let now = cluster.now;
        let name = channel(&format!("load-{}", self.next));
        let info = ChannelInfo { channel: name.clone(), flags: Default::default() };
        cluster.core(via).create_channel(now, id, info);
        self.issued.push((id, name));
    }

    /// Every acknowledged creation is readable on every current voter of its group.
    fn check(&self, cluster: &mut Cluster) {
        let table = cluster.nodes[&NodeId::new(1)].config.table();
        let mut acked = 0;
        for (id, name) in &self.issued {
            if cluster.results.get(id).map(String::as_str) != Some("Meta(Ok(()))") {
                continue;
            }
            acked += 1;
            let group = table.group_of_key(name.route_key());
            let leader = cluster.slot_leader(group).expect("group has a leader");
            let voters = cluster.core(leader).slot().status(group).unwrap().voters;
            for voter in voters {
                let found = cluster.core(voter.get()).reader().channel(name).unwrap();
                assert!(found.is_some(), "{name} acknowledged but missing on {voter} of {group}");
            }
        }
        assert!(acked > 10, "the load made progress ({acked} acknowledged)");
    }
}

/// Runs with load until `done`, at most `ms`.
fn run_loaded(cluster: &mut Cluster, load: &mut Load, ms: u64, done: impl Fn(&mut Cluster) -> bool) -> bool {
    for _ in 0..ms / 50 {
        if done(cluster) {
            return true;
        }
        load.step(cluster);
        cluster.run_for(50);
    }
    done(cluster)
}

/// What the group's leader shows (for failure messages).
fn describe(cluster: &mut Cluster, group: GroupId) -> String {
    let Some(leader) = cluster.slot_leader(group) else { return "no leader".into() };
    let status = cluster.core(leader).slot().status(group);
    let intent = cluster.core(leader).reader().group_intent(group);
    let decision = cluster.core(leader).status().leadership.into_iter().find(|(g, _)| *g == group);
    format!("leader {leader}\nstatus {status:?}\nintent {intent:?}\ndecision {decision:?}")
}

/// The group's membership equals `voters`, is not joint, and the intent committed it with its epoch.
fn moved_to(cluster: &mut Cluster, group: GroupId, voters: &[NodeId]) -> bool {
    let Some(leader) = cluster.slot_leader(group) else { return false };
    let status = cluster.core(leader).slot().status(group).unwrap();
    let Ok(Some(intent)) = cluster.core(leader).reader().group_intent(group) else { return false };
    !status.joint
        && status.voters == voters
        && status.learners.is_empty()
        && intent.target_peers.is_none()
        && intent.desired_peers == voters
        && intent.config_epoch == status.config_epoch
}

fn replaced(voters: &[NodeId], from: NodeId, to: NodeId) -> Vec<NodeId> {
    let mut next: Vec<NodeId> = voters.iter().map(|n| if *n == from { to } else { *n }).collect();
    next.sort();
    next
}

/// A settled 4-node cluster, `GROUP`'s voters, and a move to plan: from its leader (`from_leader`) or a
/// follower, to the node outside the group.
struct Planned {
    cluster: Cluster,
    before: Vec<NodeId>,
    from: NodeId,
    to: NodeId,
    load: Load,
}

fn plan_move(from_leader: bool) -> Planned {
    let mut cluster = Cluster::new(4);
    cluster.run_for(3_000);
    let before = members(&cluster, GROUP);
    let to = (1..=4).map(NodeId::new).find(|n| !before.contains(n)).unwrap();
    let group_leader = cluster.slot_leader(GROUP).unwrap();
    let from = *before.iter().find(|n| (n.get() == group_leader) == from_leader).unwrap();
    Planned { cluster, before, from, to, load: Load { next: 0, issued: Vec::new() } }
}

/// Asks for the move through node 1; it must be accepted.
fn start_move(cluster: &mut Cluster, from: NodeId, to: NodeId) {
    assert_eq!(call(cluster, |core, now, id| core.move_slot_replica(now, id, GROUP, from, to)), "Meta(Ok(()))");
}

#[test]
fn a_follower_replica_moves_under_load_and_the_old_one_is_destroyed() {
    let Planned { mut cluster, before, from, to, mut load } = plan_move(false);
    for _ in 0..20 {
        load.step(&mut cluster);
        cluster.run_for(50);
    }
    start_move(&mut cluster, from, to);
    let after = replaced(&before, from, to);
    assert!(run_loaded(&mut cluster, &mut load, 30_000, |c| moved_to(c, GROUP, &after)), "the move completes");
    assert!(
        cluster.run_until(10_000, |c| !c.core(from.get()).slot().groups().any(|g| g == GROUP)),
        "the old replica is destroyed"
    );
    assert!(cluster.core(to.get()).slot().groups().any(|g| g == GROUP));
    for _ in 0..20 {
        load.step(&mut cluster);
        cluster.run_for(50);
    }
    cluster.run_for(2_000);
    load.check(&mut cluster);
    // A restart keeps it so: the new member reopens the group, the old one does not bring it back.
    cluster.crash(from.get());
    cluster.crash(to.get());
    cluster.restart(from.get());
    cluster.restart(to.get());
    cluster.run_for(3_000);
    assert!(!cluster.core(from.get()).slot().groups().any(|g| g == GROUP));
    assert!(moved_to(&mut cluster, GROUP, &after));
    load.check(&mut cluster);
}

#[test]
fn a_leader_replica_hands_leadership_over_before_it_leaves() {
    let Planned { mut cluster, before, from, to, mut load } = plan_move(true);
    start_move(&mut cluster, from, to);
    let after = replaced(&before, from, to);
    let done = run_loaded(&mut cluster, &mut load, 30_000, |c| moved_to(c, GROUP, &after));
    assert!(done, "the move completes: {}", describe(&mut cluster, GROUP));
    assert_ne!(cluster.slot_leader(GROUP), Some(from.get()));
    cluster.run_for(2_000);
    load.check(&mut cluster);
}

#[test]
fn moves_are_refused_with_a_reason_and_one_runs_at_a_time() {
    let mut cluster = Cluster::new(4);
    cluster.run_for(3_000);
    let before = members(&cluster, GROUP);
    let outsider = (1..=4).map(NodeId::new).find(|n| !before.contains(n)).unwrap();
    let answer = call(&mut cluster, |core, now, id| core.move_slot_replica(now, id, GROUP, outsider, before[0]));
    assert!(answer.contains("NotAVoter"), "{answer}");
    let answer = call(&mut cluster, |core, now, id| core.move_slot_replica(now, id, GROUP, before[0], before[1]));
    assert!(answer.contains("AlreadyAVoter"), "{answer}");
    let answer = call(&mut cluster, |core, now, id| core.abort_slot_move(now, id, GROUP));
    assert!(answer.contains("NoMoveInProgress"), "{answer}");
    // The target is cut off: the move waits at the learner, and a second move is refused meanwhile.
    cluster.cut.insert(outsider);
    let answer = call(&mut cluster, |core, now, id| core.move_slot_replica(now, id, GROUP, before[1], outsider));
    assert_eq!(answer, "Meta(Ok(()))");
    let answer = call(&mut cluster, |core, now, id| core.move_slot_replica(now, id, GROUP, before[2], outsider));
    assert!(answer.contains("MoveInProgress"), "{answer}");
    let waiting = |c: &mut Cluster| {
        let Some(l) = c.slot_leader(GROUP) else { return false };
        c.core(l)
            .status()
            .leadership
            .into_iter()
            .any(|(g, d)| g == GROUP && d == Reconcile::Membership(MembershipStep::LearnerInactive(outsider)))
    };
    assert!(
        cluster.run_until(10_000, waiting),
        "the move waits for its learner and says so: {}",
        describe(&mut cluster, GROUP)
    );
    // Abort: the learner is removed, the assignment is committed again, and the members are unchanged.
    let answer = call(&mut cluster, |core, now, id| core.abort_slot_move(now, id, GROUP));
    assert_eq!(answer, "Meta(Ok(()))");
    assert!(cluster.run_until(10_000, |c| moved_to(c, GROUP, &before)), "the abort restores the assignment");
    cluster.cut.remove(&outsider);
    cluster.create_channel(2, &channel("after-abort"));
}

#[test]
fn a_move_resumes_when_its_leader_crashes_mid_way() {
    let Planned { mut cluster, before, from, to, mut load } = plan_move(false);
    let first_leader = cluster.slot_leader(GROUP).unwrap();
    start_move(&mut cluster, from, to);
    // Crash the leader once the learner is in (mid-move), then let another leader carry on.
    let learner_in = |c: &mut Cluster| {
        c.slot_leader(GROUP).is_some_and(|l| c.core(l).slot().status(GROUP).unwrap().learners.contains(&to))
    };
    assert!(run_loaded(&mut cluster, &mut load, 10_000, learner_in), "the learner joins");
    cluster.crash(first_leader);
    let after = replaced(&before, from, to);
    let done = run_loaded(&mut cluster, &mut load, 30_000, |c| moved_to(c, GROUP, &after));
    assert!(done, "another leader finishes: {}", describe(&mut cluster, GROUP));
    cluster.restart(first_leader);
    cluster.run_for(3_000);
    load.check(&mut cluster);
}

#[test]
fn draining_a_node_moves_its_replicas_away_without_loss_and_it_may_then_start_on_an_empty_disk() {
    drain_then_start_on_an_empty_disk(false);
}

/// The procedure for a lost disk (docs/operations.md): the node stays down while its drain moves every
/// replica off it (channels it led fail over first), then it starts on an empty directory.
#[test]
fn a_node_whose_disk_is_lost_is_drained_while_down_and_then_starts_on_an_empty_disk() {
    drain_then_start_on_an_empty_disk(true);
}

/// Drains node 2 of five (crashed first when `down`) under metadata load and appends, checks that
/// nothing acknowledged is lost, then starts it on empty stores: the genesis slot replicas it
/// bootstraps there go at their leaders' word, and the groups keep their voters and take writes.
fn drain_then_start_on_an_empty_disk(down: bool) {
    let mut cluster = Cluster::new(5);
    cluster.run_for(3_000);
    let drained = NodeId::new(2);
    let config = cluster.nodes[&NodeId::new(1)].config.clone();
    // Channels with a replica on the drained node, some led by it.
    let rooms: Vec<ChannelId> = (0..40)
        .map(|i| channel(&format!("drain-{i}")))
        .filter(|c| config.channel_placement(c).contains(&drained))
        .take(4)
        .collect();
    assert!(rooms.iter().any(|c| config.channel_placement(c)[0] == drained), "one is led by the drained node");
    for room in &rooms {
        cluster.create_channel(1, room);
    }
    let mut acked: Vec<(ChannelId, tidings::types::Seq, String)> = Vec::new();
    let mut append_some = |cluster: &mut Cluster, tag: &str| {
        for room in &rooms {
            let text = format!("{tag}-{room}");
            let id = cluster.append(1, room, &[&text]);
            cluster.run_for(400);
            if let Some(seqs) = cluster.appended.get(&id) {
                acked.push((room.clone(), seqs[0], text));
            }
        }
    };
    append_some(&mut cluster, "before");
    let voter_of = config.slot_group_members().into_iter().filter(|(_, m)| m.contains(&drained)).count();
    assert!(voter_of > 0, "the drained node holds slot replicas");
    if down {
        cluster.crash(drained.get());
    }
    let answer = call(&mut cluster, |core, now, id| core.drain_node(now, id, drained, true));
    assert_eq!(answer, "Meta(Ok(()))");
    let mut load = Load { next: 0, issued: Vec::new() };
    let table = config.table();
    let drained_everywhere = |c: &mut Cluster| {
        let groups_clear = table.groups().all(|g| {
            c.slot_leader(g).is_some_and(|l| {
                let status = c.core(l).slot().status(g).unwrap();
                !status.joint && !status.voters.contains(&drained) && !status.learners.contains(&drained)
            })
        });
        let channels_clear = rooms.iter().all(|room| {
            let group = table.group_of_key(room.route_key());
            c.slot_leader(group).is_some_and(|l| {
                let meta = c.core(l).reader().runtime_meta(room).unwrap().unwrap();
                !meta.is_replica(drained) && meta.write_fence.is_none()
            })
        });
        let reports_clear = (1..=5)
            .filter(|n| *n != drained.get())
            .all(|n| c.core(n).status().drains.iter().all(|r| r.slot_groups.is_empty() && r.channel_replicas == 0));
        groups_clear && channels_clear && reports_clear
    };
    let done = run_loaded(&mut cluster, &mut load, 120_000, drained_everywhere);
    assert!(
        done,
        "the drain completes: {}",
        (1..=4).map(|g| describe(&mut cluster, GroupId::new(g))).collect::<Vec<_>>().join("\n")
    );
    append_some(&mut cluster, "after");
    // The drained node can go: everything acknowledged stays readable without it.
    if !down {
        cluster.crash(drained.get());
    }
    cluster.run_for(3_000);
    load.check(&mut cluster);
    for (room, seq, text) in &acked {
        let group = table.group_of_key(room.route_key());
        let l = cluster.slot_leader(group).unwrap();
        let meta = cluster.core(l).reader().runtime_meta(room).unwrap().unwrap();
        let records = cluster.core(meta.leader.get()).read(room, *seq, 1).unwrap();
        assert_eq!(records.first().map(|r| r.payload.as_ref()), Some(text.as_bytes()), "{room} {seq}");
    }
    assert!(acked.len() >= rooms.len() * 2 - 1, "appends went through before and after ({})", acked.len());
    // Started again on a new, empty disk, once every node forgot the identity of its old one (its
    // frames are refused until then: see `storage_identity.rs`).
    for node in (1..=5).filter(|n| *n != drained.get()) {
        let answer = cluster.call(node, |core, now, id| core.forget_storage_identity(now, id, drained));
        assert_eq!(answer, "Meta(Ok(()))", "n{node}");
    }
    cluster.restart_empty(drained.get());
    let gone = |c: &mut Cluster| c.core(drained.get()).slot().groups().next().is_none();
    let removed = run_loaded(&mut cluster, &mut load, 20_000, gone);
    let held: Vec<GroupId> = cluster.core(drained.get()).slot().groups().collect();
    assert!(removed, "the empty node still holds replicas of {held:?}");
    for group in table.groups() {
        let leader = cluster.slot_leader(group).expect("a leader");
        let status = cluster.core(leader).slot().status(group).unwrap();
        let held = status.voters.contains(&drained) || status.learners.contains(&drained);
        assert!(!held, "{}", describe(&mut cluster, group));
    }
    load.check(&mut cluster);
}

#[test]
fn an_abort_after_the_promotion_takes_the_membership_back() {
    let Planned { mut cluster, before, from, to, mut load } = plan_move(false);
    start_move(&mut cluster, from, to);
    // Abort once the promotion applied: the joint configuration already has `to` voting and `from` leaving.
    let joint = |c: &mut Cluster| c.slot_leader(GROUP).is_some_and(|l| c.core(l).slot().status(GROUP).unwrap().joint);
    assert!(run_loaded(&mut cluster, &mut load, 20_000, joint), "the move reaches its joint configuration");
    let l = cluster.slot_leader(GROUP).unwrap();
    let joint_epoch = cluster.core(l).slot().status(GROUP).unwrap().config_epoch;
    assert_eq!(call(&mut cluster, |core, now, id| core.abort_slot_move(now, id, GROUP)), "Meta(Ok(()))");
    // The membership goes back: `from` is added again (its replica, destroyed or not, catches up) and `to`
    // leaves; the assignment is committed again with the epoch it ends in.
    let done = run_loaded(&mut cluster, &mut load, 60_000, |c| moved_to(c, GROUP, &before));
    assert!(done, "the abort restores the assignment: {}", describe(&mut cluster, GROUP));
    let l = cluster.slot_leader(GROUP).unwrap();
    let status = cluster.core(l).slot().status(GROUP).unwrap();
    // Leaving the joint state, adding `from` back as a learner, the second joint state and its end.
    assert!(status.config_epoch.get() >= joint_epoch.get() + 4, "{:?} after {joint_epoch:?}", status.config_epoch);
    assert!(
        cluster.run_until(10_000, |c| !c.core(to.get()).slot().groups().any(|g| g == GROUP)),
        "the replica on the move's target is destroyed"
    );
    cluster.run_for(2_000);
    load.check(&mut cluster);
}

/// Which node a phase test crashes.
#[derive(Clone, Copy, Debug)]
enum Victim {
    Leader,
    Source,
    Target,
}

#[test]
fn a_move_finishes_after_a_crash_of_any_participant_in_any_phase() {
    for phase_joint in [false, true] {
        for victim in [Victim::Leader, Victim::Source, Victim::Target] {
            let Planned { mut cluster, before, from, to, mut load } = plan_move(false);
            start_move(&mut cluster, from, to);
            let reached = |c: &mut Cluster| {
                c.slot_leader(GROUP).is_some_and(|l| {
                    let status = c.core(l).slot().status(GROUP).unwrap();
                    if phase_joint {
                        status.joint
                    } else {
                        status.learners.contains(&to)
                    }
                })
            };
            assert!(run_loaded(&mut cluster, &mut load, 20_000, reached), "phase reached ({phase_joint}, {victim:?})");
            let crashed = match victim {
                Victim::Leader => cluster.slot_leader(GROUP).unwrap(),
                Victim::Source => from.get(),
                Victim::Target => to.get(),
            };
            cluster.crash(crashed);
            run_loaded(&mut cluster, &mut load, 3_000, |_| false);
            cluster.restart(crashed);
            let after = replaced(&before, from, to);
            let done = run_loaded(&mut cluster, &mut load, 60_000, |c| moved_to(c, GROUP, &after));
            assert!(done, "joint {phase_joint}, {victim:?} crashed: {}", describe(&mut cluster, GROUP));
            cluster.run_for(2_000);
            load.check(&mut cluster);
        }
    }
}

/// A drain recorded after a repair pass found nothing to do starts moving replicas at once, not after
/// the idle pause between passes (`repair_idle_interval`): the group's leader starts a pass as it
/// applies the drain.
#[test]
fn a_drain_starts_moving_replicas_without_waiting_for_the_idle_pause_between_repair_passes() {
    let idle = std::time::Duration::from_secs(60);
    let mut cluster = Cluster::with(4, |config| config.controller.repair_idle_interval = idle);
    cluster.run_for(6_000);
    let drained = NodeId::new(2);
    let config = cluster.nodes[&NodeId::new(1)].config.clone();
    let room = (0..40)
        .map(|i| channel(&format!("prompt-{i}")))
        .find(|c| config.channel_placement(c).contains(&drained))
        .expect("a channel with a replica on the drained node");
    cluster.create_channel(1, &room);
    // Every leader's pass has ended with nothing to repair: the next would come a minute later.
    cluster.run_for(2_000);
    let answer = call(&mut cluster, |core, now, id| core.drain_node(now, id, drained, true));
    assert_eq!(answer, "Meta(Ok(()))");
    let group = config.table().group_of_key(room.route_key());
    let moved = cluster.run_until(15_000, |c| {
        c.slot_leader(group).is_some_and(|l| {
            let meta = c.core(l).reader().runtime_meta(&room).unwrap().unwrap();
            !meta.is_replica(drained) && meta.write_fence.is_none()
        })
    });
    assert!(moved, "the channel's replica left the drained node well within the idle pause");
}

/// A drain's move whose target then falls silent for `replace_down_after` is given up (its learner
/// removed, the assignment kept), and the drain moves the replica to another node instead: before, it
/// waited for the lost target until an operator aborted the move.
#[test]
fn a_drain_move_towards_a_node_gone_silent_is_given_up_and_goes_elsewhere() {
    let mut cluster =
        Cluster::with(5, |config| config.controller.replace_down_after = std::time::Duration::from_secs(5));
    cluster.run_for(3_000);
    let before = members(&cluster, GROUP);
    let leader = NodeId::new(cluster.slot_leader(GROUP).unwrap());
    let drained = *before.iter().find(|n| **n != leader).unwrap();
    let answer = call(&mut cluster, |core, now, id| core.drain_node(now, id, drained, true));
    assert_eq!(answer, "Meta(Ok(()))");
    // The move the drain starts: cut its target off as soon as it is named.
    let target_named = |c: &mut Cluster| {
        let leader = c.slot_leader(GROUP)?;
        let intent = c.core(leader).reader().group_intent(GROUP).ok()??;
        intent.target_peers?.into_iter().find(|n| !before.contains(n))
    };
    let mut lost = None;
    assert!(cluster.run_until(10_000, |c| {
        lost = target_named(c);
        lost.is_some()
    }));
    let lost = lost.unwrap();
    cluster.cut.insert(lost);
    let other = (1..=5).map(NodeId::new).find(|n| !before.contains(n) && *n != lost).unwrap();
    let after = replaced(&before, drained, other);
    assert!(
        cluster.run_until(40_000, |c| moved_to(c, GROUP, &after)),
        "the drain's replica goes to the other node: {}",
        describe(&mut cluster, GROUP)
    );
    cluster.cut.remove(&lost);
    cluster.create_channel(1, &channel("after-the-lost-target"));
}

/// A group of one voter moves off it, its leader: no voter stays to take over first, so the joint
/// configuration comes first and the leader hands over inside it (sim seed 9 with a node joining a
/// one-node cluster: the move waited for a successor for ever).
#[test]
fn a_group_of_one_voter_moves_to_another_node() {
    let mut cluster = Cluster::with(2, |config| config.slot_replicas = 1);
    cluster.run_for(3_000);
    let (from, to) = (NodeId::new(1), NodeId::new(2));
    assert_eq!(members(&cluster, GROUP), vec![from]);
    let mut load = Load { next: 0, issued: Vec::new() };
    for _ in 0..20 {
        load.step(&mut cluster);
        cluster.run_for(50);
    }
    start_move(&mut cluster, from, to);
    let done = run_loaded(&mut cluster, &mut load, 30_000, |c| moved_to(c, GROUP, &[to]));
    assert!(done, "the move completes: {}", describe(&mut cluster, GROUP));
    assert!(
        cluster.run_until(10_000, |c| !c.core(from.get()).slot().groups().any(|g| g == GROUP)),
        "the old replica is destroyed"
    );
    cluster.run_for(2_000);
    load.check(&mut cluster);
}
