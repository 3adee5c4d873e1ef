//! `NodeCore`s on virtual time, on clusters with more nodes than slot replicas, where most nodes keep no
//! replica of most slot groups: a channel's leader reads its subscribers' pages for fanout from a node
//! that keeps their group, and any node checks `append_from`'s sender by asking nodes that keep the
//! user's and the channel's groups.

mod support;

use bytes::Bytes;
use parking_lot::Mutex;
use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;
use support::Cluster;
use tidings::channel::fanout::DeliveryPlan;
use tidings::frame::{decode, FrameBody, FrameLimits};
use tidings::node::{ApiId, FanoutHost, NodeMessage, NodeStatus};
use tidings::router::hash_slot;
use tidings::slot::command::{Command, MemberList, RoutingKey};
use tidings::slot::model::{Uid, User};
use tidings::store::{FailOp, Keyspace, MetaSpace};
use tidings::types::{ChannelId, ChannelType, NodeId, Seq};

/// Everyone is online on node 1; records each (seq, uid) delivered.
#[derive(Default)]
struct Recorder {
    taken: Mutex<Vec<(Seq, String)>>,
}

impl FanoutHost for Recorder {
    fn locate(&self, uids: &[String]) -> Vec<Option<NodeId>> {
        vec![Some(NodeId::new(1)); uids.len()]
    }

    fn deliver(&self, plan: &DeliveryPlan) -> bool {
        self.taken.lock().extend(plan.members.iter().map(|m| (plan.message.seq, m.uid.clone())));
        true
    }
}

/// `n` nodes, slot groups of three, fanout pages of three subscribers (so a message takes several).
fn cluster_of(n: u64, recorder: &Arc<Recorder>) -> Cluster {
    cluster_tweaked(n, recorder, |_| {})
}

/// [`cluster_of`], each node's configuration changed by `tweak` too.
fn cluster_tweaked(n: u64, recorder: &Arc<Recorder>, tweak: impl Fn(&mut tidings::node::NodeConfig)) -> Cluster {
    let mut cluster = Cluster::with(n, |config| {
        config.slot_replicas = 3;
        config.fanout.page_size = 3;
        tweak(config);
    });
    cluster.fanout_host = recorder.clone();
    cluster.run_for(5_000);
    cluster
}

/// A group channel whose leader (first in its placement) keeps no replica of the channel's slot group;
/// `all_outside`: nor does any of its replicas.
fn channel_led_outside_its_slot_group(cluster: &mut Cluster, all_outside: bool) -> (ChannelId, u64) {
    let config = cluster.nodes[&NodeId::new(1)].config.clone();
    let members = config.slot_group_members();
    (0..)
        .map(|i| ChannelId::new(ChannelType::GROUP, &format!("team-{i}")).unwrap())
        .find_map(|channel| {
            let group = config.table().group_of_key(channel.route_key());
            let (_, serving) = members.iter().find(|(g, _)| *g == group).expect("every group has members");
            let placement = config.channel_placement(&channel);
            let outside = if all_outside { &placement[..] } else { &placement[..1] };
            outside.iter().all(|n| !serving.contains(n)).then_some((channel, placement[0].get()))
        })
        .expect("some channel is led outside its slot group")
}

fn subscribe(cluster: &mut Cluster, channel: &ChannelId, list: MemberList, uids: &[&str]) {
    let uids: Vec<Uid> = uids.iter().map(|u| Uid::new(*u).unwrap()).collect();
    let command = Command::AddMembers { channel: channel.clone(), list, uids };
    let result = cluster.call(1, |core, now, id| core.propose(now, id, command));
    assert_eq!(result, "Meta(Ok(()))");
}

/// Appends one message per payload through the channel's leader and returns their seqs.
fn append_all(cluster: &mut Cluster, leader: u64, channel: &ChannelId, payloads: &[&str]) -> Vec<Seq> {
    payloads
        .iter()
        .map(|payload| {
            let id = cluster.append(leader, channel, &[payload]);
            assert!(cluster.run_until(5_000, |c| c.appended.contains_key(&id)), "{:?}", cluster.results.get(&id));
            cluster.appended[&id][0]
        })
        .collect()
}

/// A cluster of `n` nodes and a channel created on it, led outside its slot group (`all_outside`: every
/// replica outside it), with `subscribers` and a deny list of `denied`; the recorder of its fanout.
fn led_outside_its_slot_group(
    n: u64,
    all_outside: bool,
    subscribers: &[&str],
    denied: &[&str],
) -> (Cluster, Arc<Recorder>, ChannelId, u64) {
    let recorder = Arc::new(Recorder::default());
    let cluster = cluster_of(n, &recorder);
    with_channel_led_outside(cluster, recorder, all_outside, subscribers, denied)
}

/// [`led_outside_its_slot_group`] on `cluster`.
fn with_channel_led_outside(
    mut cluster: Cluster,
    recorder: Arc<Recorder>,
    all_outside: bool,
    subscribers: &[&str],
    denied: &[&str],
) -> (Cluster, Arc<Recorder>, ChannelId, u64) {
    let (channel, leader) = channel_led_outside_its_slot_group(&mut cluster, all_outside);
    cluster.create_channel(1, &channel);
    subscribe(&mut cluster, &channel, MemberList::Subscribers, subscribers);
    if !denied.is_empty() {
        subscribe(&mut cluster, &channel, MemberList::Deny, denied);
    }
    cluster.run_for(1_000);
    (cluster, recorder, channel, leader)
}

/// The nodes serving `channel`'s slot group, as `leader`'s configuration places it.
fn serving_nodes(cluster: &Cluster, leader: u64, channel: &ChannelId) -> Vec<NodeId> {
    let config = &cluster.nodes[&NodeId::new(leader)].config;
    let group = config.table().group_of_key(channel.route_key());
    config.slot_group_members().into_iter().find(|(g, _)| *g == group).map(|(_, nodes)| nodes).unwrap()
}

/// `count` of every node's status, summed.
fn over_nodes(cluster: &mut Cluster, count: impl Fn(&NodeStatus) -> u64) -> u64 {
    let ids: Vec<u64> = cluster.nodes.keys().map(|n| n.get()).collect();
    ids.into_iter().map(|n| count(&cluster.core(n).status())).sum()
}

/// Pages given up, over every node.
fn abandoned(cluster: &mut Cluster) -> u64 {
    over_nodes(cluster, |status| status.fanout_pages_abandoned)
}

#[test]
fn a_leader_without_the_channel_s_slot_group_fans_out_from_pages_read_on_another_node() {
    let subscribers = ["u0", "u1", "u2", "u3", "u4", "u5", "u6", "u7"];
    let (mut cluster, recorder, channel, leader) = led_outside_its_slot_group(5, false, &subscribers, &["u3"]);
    let group = cluster.nodes[&NodeId::new(leader)].config.table().group_of_key(channel.route_key());
    assert!(!cluster.core(leader).slot().groups().any(|g| g == group), "the leader must not serve the group");

    let seqs = append_all(&mut cluster, leader, &channel, &["hello", "again"]);
    cluster.run_for(3_000);

    let taken = recorder.taken.lock().clone();
    let distinct: BTreeSet<(Seq, String)> = taken.iter().cloned().collect();
    assert_eq!(distinct.len(), taken.len(), "a member got a message twice: {taken:?}");
    let expected: BTreeSet<(Seq, String)> = seqs
        .iter()
        .flat_map(|seq| subscribers.iter().filter(|u| **u != "u3").map(|u| (*seq, (*u).to_owned())))
        .collect();
    assert_eq!(distinct, expected, "every allowed subscriber, over three pages, for each message");
    assert_eq!(cluster.core(leader).status().fanout_pages_abandoned, 0);
}

#[test]
fn pages_go_to_another_node_when_the_one_asked_is_cut_off_and_are_given_up_when_none_answers() {
    // Six nodes: the channel's three replicas all outside its slot group, so cutting the whole group
    // off leaves the channel committing.
    let (mut cluster, recorder, channel, leader) = led_outside_its_slot_group(6, true, &["a", "b", "c", "d"], &[]);
    let serving = serving_nodes(&cluster, leader, &channel);

    // One member of the slot group goes silent (frames to it are lost, not refused): the leader's ask
    // to it times out and the page comes from another member. Which one the leader asks first depends
    // on the group's leader; cutting each in turn, one message at a time, covers both paths.
    let mut seqs = Vec::new();
    // A message takes two pages: after the first ask to a silent node times out (2 s), the node that
    // answered is asked first for the next page, so a message never waits out two timeouts.
    for silent in &serving {
        cluster.cut.insert(*silent);
        let seq = append_all(&mut cluster, leader, &channel, &["while one is silent"])[0];
        let start = cluster.now;
        let all_four = |_: &mut Cluster| recorder.taken.lock().iter().filter(|(s, _)| *s == seq).count() == 4;
        assert!(cluster.run_until(8_000, all_four), "fanned out while {silent} is silent");
        let took = cluster.now.since(start);
        assert!(took < std::time::Duration::from_millis(3_000), "fanout while {silent} is silent took {took:?}");
        seqs.push(seq);
        cluster.cut.remove(silent);
        cluster.run_for(3_000);
    }
    let taken: BTreeSet<(Seq, String)> = recorder.taken.lock().iter().cloned().collect();
    let expected: BTreeSet<(Seq, String)> =
        seqs.iter().flat_map(|seq| ["a", "b", "c", "d"].map(|u| (*seq, u.to_owned()))).collect();
    assert_eq!(taken, expected);
    assert_eq!(abandoned(&mut cluster), 0);

    // Every member of the slot group silent: nobody serves the page; after 30 s the message's fanout is
    // given up (counted) and the next message still fans out once they are back.
    for node in &serving {
        cluster.cut.insert(*node);
    }
    let lost = append_all(&mut cluster, leader, &channel, &["nobody lists the members"]);
    cluster.run_for(35_000);
    assert_eq!(abandoned(&mut cluster), 1);
    let taken: BTreeSet<(Seq, String)> = recorder.taken.lock().iter().cloned().collect();
    assert!(taken.iter().all(|(seq, _)| *seq != lost[0]), "nothing for the given-up message");
    for node in &serving {
        cluster.cut.remove(node);
    }
    cluster.run_for(10_000);
    let after = append_all(&mut cluster, leader, &channel, &["they are back"]);
    cluster.run_for(5_000);
    // (A leader that takes over before its replica heard that the given-up fanout ended plans that
    // message again: fanout is at least once.)
    let taken: BTreeSet<(Seq, String)> = recorder.taken.lock().iter().cloned().collect();
    assert!(["a", "b", "c", "d"].iter().all(|u| taken.contains(&(after[0], (*u).to_owned()))));
}

/// A leader whose fanout of a committed message is stuck (no node serves its subscriber pages) crashes:
/// its successor plans the message again, and every subscriber gets it — fanout is at least once.
#[test]
fn a_message_whose_fanout_its_crashed_leader_had_not_finished_reaches_every_subscriber_through_the_next() {
    let (mut cluster, recorder, channel, leader) = led_outside_its_slot_group(6, true, &["a", "b", "c", "d"], &[]);
    let serving = serving_nodes(&cluster, leader, &channel);
    for node in &serving {
        cluster.cut.insert(*node);
    }
    let stuck = append_all(&mut cluster, leader, &channel, &["its pages are out of reach"])[0];
    // The replicas hear how far fanout got (not this message) with their next pull answers.
    cluster.run_for(4_000);
    assert!(recorder.taken.lock().iter().all(|(seq, _)| *seq != stuck), "no page was served: nothing delivered");
    cluster.crash(leader);
    for node in &serving {
        cluster.cut.remove(node);
    }
    let all_four = |_: &mut Cluster| recorder.taken.lock().iter().filter(|(seq, _)| *seq == stuck).count() == 4;
    assert!(cluster.run_until(20_000, all_four), "the next leader fans the message out");
    let ids: Vec<u64> = cluster.nodes.keys().map(|n| n.get()).filter(|n| *n != leader).collect();
    let planned_again: u64 = ids.into_iter().map(|n| cluster.core(n).status().fanout_planned_again).sum();
    assert_eq!(planned_again, 1, "one message planned again, by the new leader");
}

/// A leader restarted in place (no failover: it was down for a moment) with a message whose fanout had
/// not finished, on a channel that then stays quiet and whose followers' pulls do not reach it: the
/// resume pass after its start finds the log's fanout behind its HW and activates the replica, and the
/// message reaches every subscriber within seconds, though the sweep's regular passes are 10 minutes
/// apart. Before session 36 nothing activated the replica until the channel's next input (the
/// simulator met it once nodes were restarted in turn to leave the cluster); in session 36 the first
/// regular pass did, 10 minutes after the start. Without the resume pass (put off past the run here),
/// nothing reaches the subscribers.
#[test]
fn a_leader_restarted_in_place_resumes_its_unfinished_fanout_without_a_next_message() {
    assert_eq!(subscribers_reached_after_a_restart_in_place(Duration::from_secs(2)), 4);
    assert_eq!(subscribers_reached_after_a_restart_in_place(Duration::from_secs(3600)), 0);
}

/// Runs the scenario above with the resume pass `resume_after` the restart: how many subscribers the
/// stuck message reached within 20 s of it.
fn subscribers_reached_after_a_restart_in_place(resume_after: Duration) -> usize {
    let recorder = Arc::new(Recorder::default());
    let sweep = tidings::node::StrayLogConfig { resume_after, ..Default::default() };
    let cluster = cluster_tweaked(6, &recorder, |config| config.stray_logs = sweep.clone());
    let (mut cluster, recorder, channel, leader) =
        with_channel_led_outside(cluster, recorder, true, &["a", "b", "c", "d"], &[]);
    let serving = serving_nodes(&cluster, leader, &channel);
    for node in &serving {
        cluster.cut.insert(*node);
    }
    let stuck = append_all(&mut cluster, leader, &channel, &["its pages are out of reach"])[0];
    cluster.run_for(3_000);
    assert!(recorder.taken.lock().is_empty(), "no page was served: nothing delivered");
    // Down for a moment, too short for a failover; the channel's frames to it are lost from now on, so
    // no follower's pull wakes its replica.
    cluster.crash(leader);
    cluster.restart(leader);
    for node in &serving {
        cluster.cut.remove(node);
    }
    let to_leader = NodeId::new(leader);
    cluster.lose_if = Some(Box::new(move |_, to, frame| {
        let body = decode(frame, &FrameLimits::default()).unwrap().body;
        to == to_leader && matches!(body, FrameBody::Channel(_) | FrameBody::Channels(_))
    }));
    let reached = || recorder.taken.lock().iter().filter(|(seq, _)| *seq == stuck).count();
    cluster.run_until(20_000, |_| reached() >= 4);
    reached()
}

/// A leader asking other nodes for its fanout's pages, none of which answers, becomes a replica of the
/// subscribers' slot group meanwhile (a drain moves the group's replica to it): its next attempt reads
/// the page itself, and the message reaches every subscriber long before the page would be given up
/// (sim seed 429006070: a leader went on asking nodes that did not serve the page for 30 s, though it
/// had become a replica of the group, and its idle leadership held its shard's one leader's place).
#[test]
fn a_page_asked_elsewhere_is_read_here_once_this_node_becomes_a_replica_of_the_group() {
    let (mut cluster, recorder, channel, leader) = led_outside_its_slot_group(4, false, &["a", "b", "c", "d"], &[]);
    let serving = serving_nodes(&cluster, leader, &channel);
    let group = cluster.nodes[&NodeId::new(leader)].config.table().group_of_key(channel.route_key());
    // Every page ask is lost: no other node serves a page.
    cluster.lose_if = Some(Box::new(is_slot_read_request));
    let seq = append_all(&mut cluster, leader, &channel, &["its pages are out of reach"])[0];
    cluster.run_for(3_000);
    assert!(recorder.taken.lock().is_empty(), "no page was served: nothing delivered");

    // Draining a member of the group moves its replica to the one node outside it: the leader.
    let drained = serving[0];
    let answer = cluster.call(leader, |core, now, id| core.drain_node(now, id, drained, true));
    assert_eq!(answer, "Meta(Ok(()))");
    let joined = |c: &mut Cluster| c.core(leader).slot().applied_index(group).is_some_and(|a| a > 0);
    assert!(cluster.run_until(15_000, joined), "the leader becomes a replica of the group");
    let all_four = |_: &mut Cluster| recorder.taken.lock().iter().filter(|(s, _)| *s == seq).count() == 4;
    assert!(cluster.run_until(5_000, all_four), "the leader reads the page itself: {:?}", recorder.taken.lock());
    assert_eq!(abandoned(&mut cluster), 0);
}

/// A node checking a sender by asking other nodes, none of which answers, becomes a replica of the
/// user's and the channel's slot group meanwhile (a drain moves the group's replica to it): its next
/// attempt reads the answers itself, and the append commits within its timeout.
#[test]
fn a_sender_check_asked_elsewhere_is_read_here_once_this_node_becomes_a_replica_of_the_group() {
    let recorder = Arc::new(Recorder::default());
    let mut cluster = cluster_of(4, &recorder);
    let config = cluster.nodes[&NodeId::new(1)].config.clone();
    let members = config.slot_group_members();
    // With four nodes and groups of three, each group lacks one node: `via`, for the group of both the
    // channel and the user.
    let (group, keepers) = members[0].clone();
    let via = *config.nodes.iter().find(|n| !keepers.contains(n)).unwrap();
    let channel = (0..)
        .map(|i| ChannelId::new(ChannelType::GROUP, &format!("room-{i}")).unwrap())
        .find(|c| config.table().group_of_key(c.route_key()) == group)
        .unwrap();
    let user = (0..)
        .map(|i| format!("user-{i}"))
        .find(|u| config.table().group_of_key(RoutingKey::Uid(&Uid::new(u.as_str()).unwrap()).bytes()) == group)
        .unwrap();
    cluster.create_channel(1, &channel);
    subscribe(&mut cluster, &channel, MemberList::Subscribers, &[&user]);
    cluster.run_for(1_000);

    // Every read asked of another node is lost.
    cluster.lose_if = Some(Box::new(is_slot_read_request));
    let id = start_append_from(&mut cluster, via.get(), &channel, &user);
    cluster.run_for(2_000);
    assert!(!decided(&cluster, id), "nobody answered yet");

    let drained = keepers[0];
    let answer = cluster.call(via.get(), |core, now, api| core.drain_node(now, api, drained, true));
    assert_eq!(answer, "Meta(Ok(()))");
    assert!(cluster.run_until(15_000, |c| decided(c, id)));
    assert!(cluster.appended.contains_key(&id), "the check is read here: {:?}", cluster.results.get(&id));
    assert!(cluster.core(via.get()).slot().applied_index(group).is_some_and(|a| a > 0));
}

/// `true` for a frame asking a node for a slot read (a fanout page or a sender check).
fn is_slot_read_request(_: NodeId, _: NodeId, frame: &Bytes) -> bool {
    let frame = decode(frame, &FrameLimits::default()).unwrap();
    matches!(frame.body, FrameBody::Node(NodeMessage::SlotReadRequest { .. }))
}

/// Starts an `append_from` of one message by `sender` through node `via`.
fn start_append_from(cluster: &mut Cluster, via: u64, channel: &ChannelId, sender: &str) -> ApiId {
    let id = cluster.api();
    let now = cluster.now;
    let records = support::records(&["from a user"]);
    cluster.core(via).append_from(now, id, channel.clone(), Uid::new(sender).unwrap(), records);
    id
}

/// `true` once the call `id` has its outcome.
fn decided(cluster: &Cluster, id: ApiId) -> bool {
    cluster.appended.contains_key(&id) || cluster.results.contains_key(&id)
}

/// `append_from` through node `via`: the seqs, or the error's debug text.
fn append_from(cluster: &mut Cluster, via: u64, channel: &ChannelId, sender: &str) -> Result<Vec<Seq>, String> {
    let id = start_append_from(cluster, via, channel, sender);
    assert!(cluster.run_until(15_000, |c| decided(c, id)));
    cluster.appended.get(&id).cloned().ok_or_else(|| cluster.results[&id].clone())
}

#[test]
fn a_node_without_the_user_s_or_the_channel_s_slot_group_checks_senders_through_nodes_that_have_them() {
    let recorder = Arc::new(Recorder::default());
    let mut cluster = cluster_of(5, &recorder);
    let config = cluster.nodes[&NodeId::new(1)].config.clone();
    let members = config.slot_group_members();
    let serves = |node: NodeId, key: RoutingKey<'_>| {
        let group = config.table().group_of_key(key.bytes());
        members.iter().any(|(g, nodes)| *g == group && nodes.contains(&node))
    };
    // A node, a channel and three users none of whose slot groups that node keeps.
    let (via, channel) = (1..=5)
        .flat_map(|n| {
            (0..64).map(move |i| (NodeId::new(n), ChannelId::new(ChannelType::GROUP, &format!("room-{i}")).unwrap()))
        })
        .find(|(n, c)| !serves(*n, RoutingKey::Channel(c)))
        .unwrap();
    let users: Vec<String> = (0..)
        .map(|i| format!("user-{i}"))
        .filter(|u| !serves(via, RoutingKey::Uid(&Uid::new(u.as_str()).unwrap())))
        .take(3)
        .collect();
    let (alice, mallory, eve) = (&users[0], &users[1], &users[2]);
    cluster.create_channel(1, &channel);
    let banned = User { uid: Uid::new(mallory.as_str()).unwrap(), name: "Mallory".into(), banned: true };
    assert_eq!(cluster.call(1, |core, now, id| core.propose(now, id, Command::PutUser(banned))), "Meta(Ok(()))");
    subscribe(&mut cluster, &channel, MemberList::Subscribers, &[alice, mallory, eve]);
    subscribe(&mut cluster, &channel, MemberList::Deny, &[eve]);
    cluster.run_for(1_000);

    let via = via.get();
    let sent = append_from(&mut cluster, via, &channel, alice).expect("alice may send");
    assert_eq!(sent.len(), 1);
    let refused = append_from(&mut cluster, via, &channel, mallory).unwrap_err();
    assert!(refused.contains("SenderBanned"), "{refused}");
    let refused = append_from(&mut cluster, via, &channel, eve).unwrap_err();
    assert!(refused.contains("SenderDenied"), "{refused}");
    // Only alice's message was written.
    let leader = config.channel_placement(&channel)[0].get();
    let read = cluster.core(leader).read(&channel, Seq::new(1), 100).unwrap();
    assert_eq!(read.iter().filter(|r| r.payload.as_ref() == b"from a user").count(), 1);

    // Every node keeping alice's slot group silent: the check fails closed, nothing written.
    let group = config.table().group_of_key(RoutingKey::Uid(&Uid::new(alice.as_str()).unwrap()).bytes());
    let (_, keepers) = members.iter().find(|(g, _)| *g == group).unwrap();
    cluster.cut.extend(keepers.iter().copied());
    cluster.captured.clear();
    cluster.capture_max = usize::MAX;
    let unverified = append_from(&mut cluster, via, &channel, alice).unwrap_err();
    assert!(unverified.contains("SenderUnverified"), "{unverified}");
    // The nodes that keep no replica refuse at once; a whole round of refusals pauses before the next,
    // so the 10 s of asking stay a bounded number of requests, not a storm.
    let asked = cluster
        .captured
        .iter()
        .filter(|(from, _, frame)| {
            let frame = decode(frame, &FrameLimits::default()).unwrap();
            from.get() == via && matches!(frame.body, FrameBody::Node(NodeMessage::SlotReadRequest { .. }))
        })
        .count();
    assert!((4..=250).contains(&asked), "{asked} requests");
}

#[test]
fn a_replica_that_lost_its_leader_does_not_vouch_for_a_sender() {
    // Node 3 is cut off while the user is banned, so its replica of the user's group never learns the
    // ban; by then it knows no leader either. Right after it is back — before the leader reaches it —
    // an append from the banned user through node 3 must still be refused: the check goes to a node
    // whose replica knows its leader instead of reading the stale one.
    let recorder = Arc::new(Recorder::default());
    let mut cluster = cluster_of(3, &recorder);
    let channel = ChannelId::new(ChannelType::GROUP, "lobby").unwrap();
    cluster.create_channel(1, &channel);
    subscribe(&mut cluster, &channel, MemberList::Subscribers, &["mallory"]);
    cluster.cut.insert(NodeId::new(3));
    cluster.run_for(5_000);
    let banned = User { uid: Uid::new("mallory").unwrap(), name: "Mallory".into(), banned: true };
    assert_eq!(cluster.call(1, |core, now, id| core.propose(now, id, Command::PutUser(banned))), "Meta(Ok(()))");
    let stale = cluster.core(3).reader().user(&Uid::new("mallory").unwrap()).unwrap();
    assert!(stale.is_none_or(|u| !u.banned), "node 3's replica must not know the ban yet");
    cluster.cut.clear();
    let refused = append_from(&mut cluster, 3, &channel, "mallory").unwrap_err();
    assert!(refused.contains("SenderBanned"), "{refused}");
}

/// A proposal from a node outside its slot group, at a turn of the contact rotation that names another
/// node outside the group: that contact refuses without naming a leader, and the proposal is sent on
/// to another contact within the same turn, not to the refusing one again (sim seed 358003879: a
/// channel leader's ISR changes went three times each to a node that had left the group, at the same
/// turn of the rotation one proposal timeout later, and its HW stayed held under them for good).
#[test]
fn a_proposal_refused_by_a_contact_outside_its_group_goes_on_to_another_contact() {
    let mut cluster = Cluster::with(5, |config| {
        config.slot_groups = 1;
        config.slot_replicas = 3;
    });
    cluster.run_for(5_000);
    let config = cluster.nodes[&NodeId::new(1)].config.clone();
    let (group, members) = config.slot_group_members().remove(0);
    let outside: Vec<NodeId> = config.nodes.iter().copied().filter(|n| !members.contains(n)).collect();
    let (refuser, asker) = (outside[0], outside[1]);
    // The rotation (`CONTACT_ROTATION`, 500 ms) names node `(now / 500 + group) % nodes` at each turn;
    // wait for the turn that names the refuser, at its start.
    let position = config.nodes.iter().position(|n| *n == refuser).unwrap() as u64;
    let nodes = config.nodes.len() as u64;
    while (cluster.now.as_millis() / 500 + u64::from(group.get())) % nodes != position
        || cluster.now.as_millis() % 500 != 0
    {
        cluster.run_for(1);
    }
    let uid = Uid::new("asked-outside").unwrap();
    let user = User { uid: uid.clone(), name: "A".into(), banned: false };
    let id = cluster.api();
    let now = cluster.now;
    cluster.core(asker.get()).propose(now, id, Command::PutUser(user));
    assert!(cluster.run_until(200, |c| c.results.contains_key(&id)), "answered within the turn");
    assert_eq!(cluster.results[&id], "Meta(Ok(()))");
}

/// Arms `node`'s store to fail its next `times` reads (`op`) of `channel`'s slot group's copy of the
/// channel's hash slot, where its subscriber and deny lists live; every other read goes on working.
fn fail_list_reads(cluster: &Cluster, node: NodeId, channel: &ChannelId, op: FailOp, times: u64) {
    let group = cluster.nodes[&node].config.table().group_of_key(channel.route_key());
    let space = MetaSpace::slot(group, hash_slot(channel.route_key()));
    cluster.nodes[&node].kv.fail_under(op, Keyspace::Meta, &space.kv_prefix(), 0, times);
}

/// What every node's status counts of page reads that failed on its store.
fn page_read_failures(cluster: &mut Cluster) -> u64 {
    over_nodes(cluster, |status| status.fanout_page_read_failures)
}

/// A fanout page whose lists the leader's own store fails to read (the list itself, or one member's deny
/// entry) is read on another node, or on a single node read again after a pause: every allowed
/// subscriber gets the message, and the denied one does not. Before session 60 a failed list read ended
/// the message's fanout as though the list had ended, and a failed deny read delivered to the member as
/// though it were not denied.
#[test]
fn a_page_this_node_s_store_cannot_read_is_read_again_and_never_taken_for_a_shorter_or_laxer_list() {
    let subscribers = ["u0", "u1", "u2", "u3", "u4", "u5", "u6", "u7"];
    for nodes in [3, 1] {
        let recorder = Arc::new(Recorder::default());
        let mut cluster = cluster_of(nodes, &recorder);
        let channel = ChannelId::new(ChannelType::GROUP, "unreadable").unwrap();
        cluster.create_channel(1, &channel);
        subscribe(&mut cluster, &channel, MemberList::Subscribers, &subscribers);
        subscribe(&mut cluster, &channel, MemberList::Deny, &["u3"]);
        let leader = cluster.nodes[&NodeId::new(1)].config.channel_placement(&channel)[0];
        let mut seqs = append_all(&mut cluster, leader.get(), &channel, &["before"]);
        cluster.run_for(2_000);
        // The leader's next list scan fails, then its next deny read (a page of three: u3 is on the
        // second page).
        fail_list_reads(&cluster, leader, &channel, FailOp::Scan, 1);
        seqs.extend(append_all(&mut cluster, leader.get(), &channel, &["scan fails"]));
        cluster.run_for(3_000);
        fail_list_reads(&cluster, leader, &channel, FailOp::Get, 1);
        seqs.extend(append_all(&mut cluster, leader.get(), &channel, &["deny read fails"]));
        cluster.run_for(3_000);

        let kv = &cluster.nodes[&leader].kv;
        assert_eq!(kv.injected_failures(), 2, "{nodes} nodes: both reads failed");
        let taken: BTreeSet<(Seq, String)> = recorder.taken.lock().iter().cloned().collect();
        let expected: BTreeSet<(Seq, String)> = seqs
            .iter()
            .flat_map(|seq| subscribers.iter().filter(|u| **u != "u3").map(|u| (*seq, (*u).to_owned())))
            .collect();
        assert_eq!(taken, expected, "{nodes} nodes: every allowed subscriber, and only those, for each message");
        assert_eq!(page_read_failures(&mut cluster), 2, "{nodes} nodes");
        assert_eq!(abandoned(&mut cluster), 0, "{nodes} nodes");
    }
}

/// A node asked for a page by a leader outside the channel's slot group that cannot read it says it
/// does not serve it, and the leader asks the next node: nothing is delivered from a page read short.
#[test]
fn a_page_a_peer_s_store_cannot_read_is_asked_of_the_next_node() {
    let subscribers = ["a", "b", "c", "d"];
    let (mut cluster, recorder, channel, leader) = led_outside_its_slot_group(5, false, &subscribers, &[]);
    // Each node keeping the group fails its next list scan: whichever the leader asks first fails it.
    let serving = serving_nodes(&cluster, leader, &channel);
    for node in &serving {
        fail_list_reads(&cluster, *node, &channel, FailOp::Scan, 1);
    }
    let seq = append_all(&mut cluster, leader, &channel, &["hello"])[0];
    cluster.run_for(3_000);
    let taken: BTreeSet<(Seq, String)> = recorder.taken.lock().iter().cloned().collect();
    let expected: BTreeSet<(Seq, String)> = subscribers.iter().map(|u| (seq, (*u).to_owned())).collect();
    assert_eq!(taken, expected);
    let failed: u64 = serving.iter().map(|n| cluster.nodes[n].kv.injected_failures()).sum();
    assert!(failed >= 1, "a serving node's scan failed");
    assert_eq!(page_read_failures(&mut cluster), failed, "each failed scan is counted where it failed");
    assert_eq!(abandoned(&mut cluster), 0);
}

/// A single node whose store cannot tell, for a moment, whether it serves a subscriber page (the
/// lookup of the channel's hash slot's placement fails) reads the page again after a pause. Before
/// session 60 it took that for "not served here", had nobody else to ask, and gave the message's
/// fanout up at once (simulator seed 818000111 with `--meta-read-errors`).
#[test]
fn a_page_whose_serving_copy_cannot_be_looked_up_is_read_again_on_a_single_node() {
    let recorder = Arc::new(Recorder::default());
    let mut cluster = cluster_of(1, &recorder);
    let channel = ChannelId::new(ChannelType::GROUP, "lookup").unwrap();
    cluster.create_channel(1, &channel);
    subscribe(&mut cluster, &channel, MemberList::Subscribers, &["a", "b", "c", "d"]);
    let mut seqs = append_all(&mut cluster, 1, &channel, &["warm"]);
    cluster.run_for(1_000);
    // A write to a group's records moves the placements' version on: the next lookup reads the store.
    let group = tidings::types::GroupId::new(1);
    let answer = cluster.call(1, |core, now, id| core.set_preferred_leader(now, id, group, Some(NodeId::new(1))));
    assert_eq!(answer, "Meta(Ok(()))");
    let kv = cluster.nodes[&NodeId::new(1)].kv.clone();
    kv.fail_under(FailOp::Get, Keyspace::Placement, &[], 0, 1);
    seqs.extend(append_all(&mut cluster, 1, &channel, &["looked up"]));
    cluster.run_for(2_000);
    assert_eq!(kv.injected_failures(), 1);
    let taken: BTreeSet<(Seq, String)> = recorder.taken.lock().iter().cloned().collect();
    let expected: BTreeSet<(Seq, String)> =
        seqs.iter().flat_map(|seq| ["a", "b", "c", "d"].map(|u| (*seq, u.to_owned()))).collect();
    assert_eq!(taken, expected);
    assert_eq!(page_read_failures(&mut cluster), 1);
    assert_eq!(abandoned(&mut cluster), 0);
}
