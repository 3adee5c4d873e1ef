//! Adding a node to a running cluster and taking one out, as `docs/operations.md` ("Adding and removing
//! nodes") tells an operator to: a rolling restart with the new node list, the founders kept; replicas
//! moved onto the new node; a founder drained, stopped, and left out of the list by a second rolling
//! restart. Every acknowledged message and metadata write stays readable throughout.

mod support;

use support::{append_acked, read_all, Cluster};
use tidings::node::NodeConfig;
use tidings::types::{ChannelId, ChannelType, GroupId, NodeId, Seq};

const GROUP: GroupId = GroupId::new(1);

fn channel(name: &str) -> ChannelId {
    ChannelId::new(ChannelType::GROUP, name).unwrap()
}

fn ids(range: std::ops::RangeInclusive<u64>) -> Vec<NodeId> {
    range.map(NodeId::new).collect()
}

/// `group`'s voters as its leader sees them, once no membership change is under way.
fn settled_voters(cluster: &mut Cluster, group: GroupId) -> Option<Vec<NodeId>> {
    let leader = cluster.slot_leader(group)?;
    let status = cluster.core(leader).slot().status(group)?;
    (!status.joint && status.learners.is_empty()).then_some(status.voters)
}

/// Every message in `acked` reads back, in order, from `channel`'s leader.
fn assert_all_readable(cluster: &mut Cluster, channel: &ChannelId, acked: &[(Seq, String)]) {
    let group = cluster.nodes[&NodeId::new(2)].config.table().group_of_key(channel.route_key());
    let slot_leader = cluster.slot_leader(group).expect("the channel's slot group has a leader");
    let meta = cluster.core(slot_leader).reader().runtime_meta(channel).unwrap().expect("meta");
    let records = read_all(cluster.core(meta.leader.get()), channel).unwrap();
    for (seq, text) in acked {
        let record = records.iter().find(|r| r.seq == *seq);
        assert_eq!(record.map(|r| r.payload.as_ref()), Some(text.as_bytes()), "{channel} {seq}");
    }
}

/// A three-node cluster grown to five by a rolling restart: the new nodes hold no slot replica of their
/// own, node 4 takes one when moved to it, and takes a channel replica (then its leadership) with every
/// message; new channels are placed on the new nodes.
///
/// Why the founders matter: drawn from all five nodes, slot group 3's first members would be nodes 3, 4
/// and 5. The two new nodes, a majority of that configuration, would each make an empty replica of it
/// and elect a leader of their own beside the group's real one (of nodes 1, 2 and 3): a second group 3
/// taking writes for the same hash slots.
fn grown_cluster() -> (Cluster, ChannelId, Vec<(Seq, String)>) {
    let mut cluster = Cluster::new(3);
    cluster.run_for(3_000);
    let room = channel("room");
    cluster.create_channel(1, &room);
    let mut acked = append_acked(&mut cluster, 1, &room, "three", 10);

    // Nodes 4 and 5 are added to every node's list, one restart at a time; the founders stay 1, 2 and 3.
    for id in 1..=3 {
        cluster.restart_with(id, |config| config.nodes = ids(1..=5));
        cluster.run_for(2_000);
        acked.extend(append_acked(&mut cluster, 2, &room, &format!("rolling-{id}"), 2));
    }
    for id in 4..=5 {
        let joining =
            NodeConfig { slot_groups: 4, founders: ids(1..=3), ..NodeConfig::new(NodeId::new(id), ids(1..=5)) };
        let as_founders = NodeConfig { founders: ids(1..=5), ..joining.clone() };
        assert!(as_founders.slot_group_members().contains(&(GroupId::new(3), ids(3..=5))));
        cluster.add_node(joining);
    }
    // The new nodes hear only each other at first (a network still being set up), so nothing but the
    // configuration can keep them from acting on a replica they made up.
    let new = |n: NodeId| n.get() >= 4;
    cluster.lose_if = Some(Box::new(move |from, to, _| new(from) != new(to)));
    cluster.run_for(5_000);
    for id in 4..=5 {
        let groups: Vec<GroupId> = cluster.core(id).slot().groups().collect();
        assert!(groups.is_empty(), "node {id}, added later, made slot replicas of its own: {groups:?}");
    }
    cluster.lose_if = None;
    cluster.run_for(3_000);

    // A slot-group replica moves to it.
    let before = settled_voters(&mut cluster, GROUP).expect("group 1 is settled");
    assert_eq!(before, ids(1..=3));
    let answer =
        cluster.call(1, |core, now, id| core.move_slot_replica(now, id, GROUP, NodeId::new(3), NodeId::new(4)));
    assert_eq!(answer, "Meta(Ok(()))");
    let after = vec![NodeId::new(1), NodeId::new(2), NodeId::new(4)];
    assert!(
        cluster.run_until(30_000, |c| settled_voters(c, GROUP).as_ref() == Some(&after)),
        "group 1 moved to node 4: {:?}",
        settled_voters(&mut cluster, GROUP)
    );
    assert!(cluster.core(4).slot().groups().any(|g| g == GROUP));

    // A channel replica moves to it, then the channel's leadership.
    let meta = {
        let group = cluster.nodes[&NodeId::new(1)].config.table().group_of_key(room.route_key());
        let leader = cluster.slot_leader(group).unwrap();
        cluster.core(leader).reader().runtime_meta(&room).unwrap().unwrap()
    };
    let from = meta.replicas.iter().copied().find(|n| *n != meta.leader).unwrap();
    let id = cluster.api();
    let now = cluster.now;
    cluster.core(1).replace_replica(now, id, room.clone(), from, NodeId::new(4));
    assert!(cluster.run_until(30_000, |c| c.tasks.contains_key(&id)), "the replacement ends");
    cluster.tasks.remove(&id).unwrap().expect("the replacement succeeds");
    acked.extend(append_acked(&mut cluster, 1, &room, "replaced", 5));
    let id = cluster.api();
    let now = cluster.now;
    cluster.core(1).transfer_leader(now, id, room.clone(), NodeId::new(4));
    assert!(cluster.run_until(30_000, |c| c.tasks.contains_key(&id)), "the transfer ends");
    cluster.tasks.remove(&id).unwrap().expect("the transfer succeeds");
    acked.extend(append_acked(&mut cluster, 4, &room, "led-by-4", 5));
    let on_four = read_all(cluster.core(4), &room).unwrap();
    assert_eq!(on_four.len(), acked.len(), "node 4 leads with every message");
    assert_all_readable(&mut cluster, &room, &acked);

    // New channels are placed over the five nodes.
    let placed: Vec<ChannelId> = (0..12).map(|i| channel(&format!("new-{i}"))).collect();
    let config = cluster.nodes[&NodeId::new(1)].config.clone();
    assert!(placed.iter().any(|c| config.channel_placement(c).contains(&NodeId::new(5))));
    for new in &placed {
        cluster.create_channel(1, new);
        append_acked(&mut cluster, 2, new, "new", 1);
    }
    (cluster, room, acked)
}

#[test]
fn a_node_added_by_a_rolling_restart_takes_the_replicas_moved_to_it() {
    grown_cluster();
}

#[test]
fn a_founder_drained_and_left_out_of_the_list_takes_nothing_with_it() {
    let (mut cluster, room, mut acked) = grown_cluster();
    let gone = NodeId::new(1);
    let answer = cluster.call(2, |core, now, id| core.drain_node(now, id, gone, true));
    assert_eq!(answer, "Meta(Ok(()))");
    let table = cluster.nodes[&NodeId::new(2)].config.table();
    let drained = |c: &mut Cluster| {
        let groups_clear = table.groups().all(|g| settled_voters(c, g).is_some_and(|voters| !voters.contains(&gone)));
        let reports_clear = (2..=5)
            .all(|n| c.core(n).status().drains.iter().all(|r| r.slot_groups.is_empty() && r.channel_replicas == 0));
        groups_clear && reports_clear
    };
    assert!(cluster.run_until(120_000, drained), "the drain of node 1 completes");
    acked.extend(append_acked(&mut cluster, 2, &room, "drained", 3));

    // Node 1 stops for good and the others are restarted, one at a time, without it; the founders stay.
    cluster.crash(gone.get());
    for id in 2..=5 {
        cluster.restart_with(id, |config| config.nodes = ids(2..=5));
        cluster.run_for(3_000);
        acked.extend(append_acked(&mut cluster, 3, &room, &format!("shrunk-{id}"), 2));
    }
    assert!(cluster.nodes.values().all(|n| n.config.founders == ids(1..=3)));
    let later = channel("after-shrink");
    cluster.create_channel(5, &later);
    let later_acked = append_acked(&mut cluster, 2, &later, "later", 3);
    assert_all_readable(&mut cluster, &room, &acked);
    assert_all_readable(&mut cluster, &later, &later_acked);
    for group in table.groups() {
        let voters = settled_voters(&mut cluster, group).expect("every group has a settled leader");
        assert!(!voters.contains(&gone), "{group}: {voters:?}");
    }
}

/// Two founders drained, stopped, and started again on empty directories as the operator's guide says
/// (every other node forgot their storage identities; `join_existing` set): they make no slot replica
/// of their own — on empty directories, as founders, they would make the first replicas again, and the
/// two of them would be a quorum of that made-up first configuration — and take work again.
#[test]
fn drained_founders_back_on_empty_directories_make_no_replica_of_their_own() {
    let (mut cluster, room, mut acked) = grown_cluster();
    let back = [NodeId::new(1), NodeId::new(2)];
    for node in back {
        let answer = cluster.call(3, |core, now, id| core.drain_node(now, id, node, true));
        assert_eq!(answer, "Meta(Ok(()))");
    }
    let table = cluster.nodes[&NodeId::new(3)].config.table();
    let drained = |c: &mut Cluster| {
        let groups_clear =
            table.groups().all(|g| settled_voters(c, g).is_some_and(|voters| voters.iter().all(|v| !back.contains(v))));
        let reports_clear = (3..=5)
            .all(|n| c.core(n).status().drains.iter().all(|r| r.slot_groups.is_empty() && r.channel_replicas == 0));
        groups_clear && reports_clear
    };
    assert!(cluster.run_until(120_000, drained), "the drains of nodes 1 and 2 complete");
    acked.extend(append_acked(&mut cluster, 3, &room, "drained", 3));
    for node in back {
        cluster.crash(node.get());
        for other in 3..=5 {
            let answer = cluster.call(other, |core, now, id| core.forget_storage_identity(now, id, node));
            assert_eq!(answer, "Meta(Ok(()))");
        }
    }
    for node in back {
        cluster.nodes.get_mut(&node).unwrap().config.join_existing = true;
        cluster.restart_empty(node.get());
    }
    for _ in 0..500 {
        for node in back {
            let groups: Vec<GroupId> = cluster.core(node.get()).slot().groups().collect();
            assert!(groups.is_empty(), "{node}, back on an empty directory, made slot replicas: {groups:?}");
        }
        cluster.run_for(10);
    }
    // Undrained, they take work again: a slot replica moves to node 1.
    for node in back {
        let answer = cluster.call(3, |core, now, id| core.drain_node(now, id, node, false));
        assert_eq!(answer, "Meta(Ok(()))");
    }
    let before = settled_voters(&mut cluster, GROUP).expect("group 1 is settled");
    let from = before[0];
    let answer = cluster.call(3, |core, now, id| core.move_slot_replica(now, id, GROUP, from, NodeId::new(1)));
    assert_eq!(answer, "Meta(Ok(()))");
    assert!(
        cluster.run_until(30_000, |c| settled_voters(c, GROUP).is_some_and(|v| v.contains(&NodeId::new(1)))),
        "group 1 moved to node 1: {:?}",
        settled_voters(&mut cluster, GROUP)
    );
    acked.extend(append_acked(&mut cluster, 1, &room, "back", 3));
    assert_all_readable(&mut cluster, &room, &acked);
}
