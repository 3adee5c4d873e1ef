//! Storage identities on a virtual-time cluster: a node started again on an empty disk without being
//! drained is refused by every peer that knew it — none of its raft messages, votes included, nor its
//! channel messages reach them — and held back (it takes nothing they send), it says so in its status,
//! and the others go on without losing anything; a node restarted on its own disk is taken back as
//! before, and a new cluster's nodes take each other's identities as they start. (The drained case, where the new identity
//! is taken, is `slot_moves::a_node_whose_disk_is_lost_is_drained_while_down_and_then_starts_on_an_empty_disk`.)

mod support;

use support::{append_acked, read_all, Cluster};
use tidings::store::message::MessageLog;
use tidings::types::{ChannelId, ChannelType, GroupId, NodeId, Seq};

fn channel(name: &str) -> ChannelId {
    ChannelId::new(ChannelType::GROUP, name).unwrap()
}

/// A settled three-node cluster with `room` created through n1 and three appends ("before-N") acknowledged.
fn cluster_with_acked(room: &ChannelId) -> (Cluster, Vec<(Seq, String)>) {
    let mut cluster = Cluster::new(3);
    cluster.run_for(3_000);
    cluster.create_channel(1, room);
    let acked = append_acked(&mut cluster, 1, room, "before", 3);
    (cluster, acked)
}

fn refused(cluster: &mut Cluster, node: u64) -> u64 {
    cluster.core(node).status().refused_frames.get("storage_changed").copied().unwrap_or(0)
}

#[test]
fn a_node_back_on_an_empty_disk_without_a_drain_is_refused_and_nothing_is_lost() {
    let mut cluster = Cluster::new(3);
    cluster.run_for(3_000);
    let config = cluster.nodes[&NodeId::new(1)].config.clone();
    // A channel the wiped node follows (it neither leads it nor sends through it).
    let room = (0..50)
        .map(|i| channel(&format!("room-{i}")))
        .find(|c| config.channel_placement(c)[0] != NodeId::new(3))
        .unwrap();
    cluster.create_channel(1, &room);
    let mut acked = append_acked(&mut cluster, 1, &room, "before", 5);
    assert_eq!(acked.len(), 5);
    let old = cluster.core(3).storage_id();
    assert_eq!(refused(&mut cluster, 1) + refused(&mut cluster, 2), 0, "no refusal while every disk is kept");

    cluster.crash(3);
    cluster.restart_empty(3);
    let new = cluster.core(3).storage_id();
    assert_ne!(new, old, "a new directory draws a new identity");
    cluster.run_for(5_000);

    // Both peers refuse it and tell it so; it reports both, and stays held back: no majority took its
    // identity.
    assert!(refused(&mut cluster, 1) > 0 && refused(&mut cluster, 2) > 0);
    let status = cluster.core(3).status();
    assert_eq!(status.storage_refused_by, vec![(NodeId::new(1), old), (NodeId::new(2), old)]);
    assert!(status.storage_quarantined);
    // Held back, it took nothing its peers sent: it knows no leader of any group and no channel.
    for group in config.table().groups() {
        assert_eq!(cluster.core(3).slot().status(group).and_then(|s| s.leader), None, "{group}");
    }
    assert!(cluster.core(3).reader().runtime_meta(&room).unwrap().is_none());
    // Its replicas hear the groups' leaders, but nothing of theirs is heard: no vote of theirs made a
    // leader, and to every leader it is silent (raft-rs's `recent_active`: no message from it lately).
    for group in config.table().groups() {
        let leader = cluster.slot_leader(group).expect("a leader");
        assert_ne!(leader, 3, "{group}");
        let status = cluster.core(leader).slot().status(group).unwrap();
        let active = status.peers.iter().find(|(node, ..)| *node == NodeId::new(3)).map(|(_, _, active)| *active);
        assert_eq!(active, Some(false), "{group}: {status:?}");
    }
    // The others go on: appends commit with MinISR 2 of the two left, every one acknowledged reads back.
    acked.extend(append_acked(&mut cluster, 2, &room, "after", 5));
    assert_eq!(acked.len(), 10, "appends go on without the refused node");
    let leader = cluster.core(1).reader().runtime_meta(&room).unwrap().unwrap().leader.get();
    let read = read_all(cluster.core(leader), &room).unwrap();
    for (seq, text) in &acked {
        assert!(read.iter().any(|r| r.seq == *seq && r.payload.as_ref() == text.as_bytes()), "lost {seq} {text}");
    }
    // Its empty log took none of them, and it serves no read of the channel.
    assert!(read_all(cluster.core(3), &room).is_err());
    // A metadata write through a peer commits without it.
    let answer = cluster.call(1, |core, now, id| {
        core.create_channel(
            now,
            id,
            tidings::slot::model::ChannelInfo { channel: channel("later"), flags: Default::default() },
        )
    });
    assert_eq!(answer, "Meta(Ok(()))");
    assert!(config.table().groups().all(|g: GroupId| cluster.slot_leader(g).is_some()));
}

#[test]
fn a_node_restarted_on_its_own_disk_keeps_its_identity_and_is_taken_back() {
    let room = channel("kept");
    let (mut cluster, before) = cluster_with_acked(&room);
    let old = cluster.core(2).storage_id();
    assert!((1..=3).all(|n| !cluster.core(n).status().storage_quarantined), "a new cluster's nodes took each other");
    cluster.crash(2);
    cluster.run_for(1_000);
    cluster.restart(2);
    assert_eq!(cluster.core(2).storage_id(), old);
    assert!(!cluster.core(2).status().storage_quarantined, "its directory recorded that a majority took it");
    cluster.run_for(3_000);
    let after = append_acked(&mut cluster, 2, &room, "after", 3);
    assert_eq!(before.len() + after.len(), 6, "appends through the restarted node commit");
    assert_eq!(refused(&mut cluster, 1) + refused(&mut cluster, 3), 0);
    assert!(cluster.core(2).status().storage_refused_by.is_empty());
}

/// Two nodes of three back on emptied disks together (more than any majority quorum survives): they
/// take each other's identities, but the third refuses both, and they stay held back — the cluster
/// stops rather than start afresh, with nothing, beside the records the third holds.
#[test]
fn two_nodes_of_three_back_on_emptied_disks_stay_held_back_beside_the_third() {
    let room = channel("two-lost");
    let (mut cluster, acked) = cluster_with_acked(&room);
    for n in [2, 3] {
        cluster.crash(n);
        cluster.restart_empty(n);
    }
    cluster.run_for(5_000);
    for n in [2, 3] {
        let status = cluster.core(n).status();
        assert!(status.storage_quarantined, "n{n} released beside the node that refuses it");
        assert_eq!(status.storage_refused_by.iter().map(|(peer, _)| peer.get()).collect::<Vec<_>>(), vec![1]);
        assert!(status.groups.iter().all(|g| g.leader.is_none()), "n{n} elected nothing: {:?}", status.groups);
    }
    // The node that kept its disk still holds what was acknowledged (in its log: its HW may lag the
    // leader's, and nothing commits any more).
    let limits = tidings::store::message::ReadLimits { records_max: usize::MAX, bytes_max: usize::MAX };
    let log = cluster.nodes[&NodeId::new(1)].log.read(&room, Seq::new(1), Seq::new(u64::MAX), limits).unwrap();
    for (seq, text) in &acked {
        assert!(log.iter().any(|r| r.seq == *seq && r.payload.as_ref() == text.as_bytes()), "n1 lost {seq}");
    }
}
