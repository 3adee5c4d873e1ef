//! A planned stop on virtual time: a leaving node hands off its channel and slot-group leaderships, the
//! stop that follows costs its channels no failover, and once it is back it leads its channels again.

mod support;

use std::time::Duration;
use support::{append_acked, Cluster};
use tidings::node::{NodeError, Reconcile, TaskError, TaskKind};
use tidings::types::{ChannelId, ChannelRuntimeMeta, ChannelType, GroupId, NodeId};

const LEAVING: u64 = 1;

fn channel(name: &str) -> ChannelId {
    ChannelId::new(ChannelType::GROUP, name).unwrap()
}

/// The meta of `channel` as node `n`'s slot replica has it.
fn stored_meta(cluster: &mut Cluster, n: u64, channel: &ChannelId) -> ChannelRuntimeMeta {
    cluster.core(n).reader().runtime_meta(channel).unwrap().expect("meta stored")
}

/// Creates channels through node 2 until node `leader` leads `count` of them (placement spreads the
/// leaderships), and returns those.
fn channels_led_by(cluster: &mut Cluster, leader: u64, count: usize) -> Vec<ChannelId> {
    let mut led = Vec::new();
    for i in 0..60 {
        let room = channel(&format!("room-{i}"));
        cluster.create_channel(2, &room);
        if stored_meta(cluster, 2, &room).leader == NodeId::new(leader) {
            led.push(room);
            if led.len() == count {
                return led;
            }
        }
    }
    panic!("placement never chose node {leader} to lead {count} of 60 channels");
}

/// Node `n` leads no slot group, no active channel replica, and no meta of `channels` names it leader.
fn leads_nothing(cluster: &mut Cluster, n: u64, channels: &[ChannelId]) -> bool {
    let status = cluster.core(n).status();
    let groups = status.groups.iter().any(|g| g.leader == Some(NodeId::new(n)));
    let metas = channels.iter().any(|room| stored_meta(cluster, 2, room).leader == NodeId::new(n));
    !groups && status.channels_leading == 0 && !metas
}

#[test]
fn a_leaving_node_hands_off_its_leaderships_stops_without_a_failover_and_leads_again_after_its_restart() {
    let mut cluster =
        Cluster::with(3, |config| config.controller.rebalance_leaders_after = Some(Duration::from_secs(3)));
    cluster.run_for(3_000);
    let led = channels_led_by(&mut cluster, LEAVING, 3);
    for room in &led {
        append_acked(&mut cluster, 2, room, "before", 3);
    }
    assert!(cluster.core(LEAVING).status().channels_leading > 0);
    // And a slot group, through its intent: which also asks its next leader to hand it back.
    let group = GroupId::new(1);
    let answer = cluster.call(2, |core, now, id| core.set_preferred_leader(now, id, group, Some(NodeId::new(LEAVING))));
    assert_eq!(answer, "Meta(Ok(()))");
    assert!(cluster.run_until(10_000, |c| c.slot_leader(group) == Some(LEAVING)), "node {LEAVING} never led {group}");

    let answer = cluster.call(LEAVING, |core, now, id| core.set_leaving(now, id, true));
    assert_eq!(answer, "Meta(Ok(()))");
    assert!(cluster.core(LEAVING).status().leaving);
    assert!(
        cluster.run_until(10_000, |c| leads_nothing(c, LEAVING, &led)),
        "node {LEAVING} still leads something: {:?}",
        cluster.core(LEAVING).status().groups
    );
    for room in &led {
        let meta = stored_meta(&mut cluster, 2, room);
        assert_eq!(meta.write_fence, None, "{room}: the hand-off unfenced");
        assert_eq!(meta.replicas[0], NodeId::new(LEAVING), "{room}: a hand-off keeps the preferred replica");
        assert!(meta.in_isr(NodeId::new(LEAVING)), "{room}: the leaving node stays in the ISR");
    }
    // The groups' leaders report what the leaving node still leads: nothing, once their passes see it.
    let reported = cluster.run_until(2_000, |c| {
        let reports: Vec<_> = (1..=3).flat_map(|n| c.core(n).status().hand_offs).collect();
        !reports.is_empty() && reports.iter().all(|r| r.node == NodeId::new(LEAVING) && r.channels_led == 0)
    });
    assert!(reported, "no repair pass reported the hand-off done");
    let hand_offs: Vec<_> = (2..=3)
        .flat_map(|n| cluster.core(n).status().finished_tasks)
        .filter(|r| led.contains(&r.channel) && matches!(r.kind, TaskKind::HandOff { .. }) && r.outcome.is_ok())
        .collect();
    assert_eq!(hand_offs.len(), led.len(), "one hand-off per channel: {hand_offs:?}");

    // An operator's transfer to it is refused as well, with a typed error.
    let id = cluster.api();
    let now = cluster.now;
    cluster.core(2).transfer_leader(now, id, led[0].clone(), NodeId::new(LEAVING));
    assert!(cluster.run_until(1_000, |c| c.tasks.contains_key(&id)));
    let refused = cluster.tasks[&id].as_ref().err();
    assert!(
        matches!(refused, Some(NodeError::Task(TaskError::TargetLeaving(n))) if *n == NodeId::new(LEAVING)),
        "{:?}",
        cluster.tasks[&id]
    );

    // Past `rebalance_leaders_after` and the groups' transfer cooldown, nothing is moved back to a
    // node that is leaving.
    cluster.run_for(12_000);
    assert!(leads_nothing(&mut cluster, LEAVING, &led), "a leadership went back to the leaving node");
    let leader = cluster.slot_leader(group).expect("a leader");
    let decision = cluster.core(leader).status().leadership.into_iter().find(|(g, _)| *g == group);
    assert_eq!(decision, Some((group, Reconcile::TargetLeaving(NodeId::new(LEAVING)))));

    // The stop: every channel commits at once, with no failover to wait for.
    cluster.crash(LEAVING);
    for room in &led {
        let id = cluster.append(2, room, &["right after the stop"]);
        assert!(cluster.run_until(300, |c| c.appended.contains_key(&id)), "{room}: {:?}", cluster.results.get(&id));
    }
    let failovers = (2..=3)
        .flat_map(|n| cluster.core(n).status().finished_tasks)
        .filter(|r| led.contains(&r.channel) && r.kind == TaskKind::Failover)
        .count();
    assert_eq!(failovers, 0, "a channel handed off needed a failover");

    // Back: its pings no longer say it leaves, and its channels return to it, their preferred replica.
    cluster.restart(LEAVING);
    assert!(!cluster.core(LEAVING).status().leaving, "a restarted node is not leaving");
    let back =
        cluster.run_until(30_000, |c| led.iter().all(|room| stored_meta(c, 2, room).leader == NodeId::new(LEAVING)));
    assert!(back, "the restarted node did not get its leaderships back");
    let group_back = cluster.run_until(30_000, |c| c.slot_leader(group) == Some(LEAVING));
    assert!(group_back, "the restarted node did not get the group it is preferred for back");
}

#[test]
fn a_node_that_stops_leaving_is_given_leaderships_again() {
    let rebalance_after = Duration::from_secs(2);
    let mut cluster = Cluster::with(3, |config| config.controller.rebalance_leaders_after = Some(rebalance_after));
    cluster.run_for(3_000);
    let led = channels_led_by(&mut cluster, LEAVING, 2);
    let answer = cluster.call(LEAVING, |core, now, id| core.set_leaving(now, id, true));
    assert_eq!(answer, "Meta(Ok(()))");
    assert!(cluster.run_until(10_000, |c| leads_nothing(c, LEAVING, &led)));

    // It changes its mind: once its peers' marks lapse, the rebalance hands its channels back.
    let answer = cluster.call(LEAVING, |core, now, id| core.set_leaving(now, id, false));
    assert_eq!(answer, "Meta(Ok(()))");
    assert!(!cluster.core(LEAVING).status().leaving);
    let back =
        cluster.run_until(20_000, |c| led.iter().all(|room| stored_meta(c, 2, room).leader == NodeId::new(LEAVING)));
    assert!(back, "leaderships did not come back to a node no longer leaving");
}

/// Idle channels a leaving node leads (no replica active anywhere) are handed off as well, and the
/// node learns it: the leader of each slot group reports what is left in its slots after each repair
/// pass, and `channels_left_to_hand_off` says `Some(0)` only once no channel names it leader.
#[test]
fn a_leaving_node_learns_when_its_idle_channels_are_handed_off_too() {
    let mut cluster = Cluster::new(3);
    cluster.run_for(3_000);
    let idle = channels_led_by(&mut cluster, LEAVING, 3);
    let status = cluster.core(LEAVING).status();
    assert_eq!(status.channels_leading, 0, "the channels are idle: no active replica leads");
    assert_eq!(status.channels_left_to_hand_off, None, "not leaving");

    let answer = cluster.call(LEAVING, |core, now, id| core.set_leaving(now, id, true));
    assert_eq!(answer, "Meta(Ok(()))");
    let mut most_left = 0;
    let done = cluster.run_until(20_000, |c| {
        let left = c.core(LEAVING).status().channels_left_to_hand_off;
        most_left = most_left.max(left.unwrap_or(0));
        left == Some(0)
    });
    assert!(done, "the leaving node never learnt its idle channels were handed off");
    assert!(most_left > 0, "no report counted the idle channels it led");
    cluster.run_for(500);
    for room in &idle {
        assert_ne!(stored_meta(&mut cluster, 2, room).leader, NodeId::new(LEAVING), "{room} is still led by it");
    }
}
