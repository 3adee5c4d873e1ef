//! Who votes: a replica created on demand (a leader reached this node for a group it does not hold) has
//! an empty log and no configuration until a snapshot initializes it, so it must not vote — its vote
//! would elect any candidate, also one lacking committed entries. A replica with a configuration votes.

use protobuf::Message as _;
use raft::prelude::{Message, MessageType};
use std::sync::Arc;
use tidings_router::HashToSlot;
use tidings_slot::raft::{MultiRaft, MultiRaftConfig, SlotBody, SlotEffect, SlotMessage};
use tidings_store::{Kv, MemoryKv, MetaStore, RaftLogStore};
use tidings_types::{GroupId, NodeId, Time};

const GROUP: GroupId = GroupId::new(1);

/// Node 2's driver, holding `GROUP` from the start (members 1, 2, 3) or not at all.
fn driver(holds_group: bool) -> MultiRaft {
    let kv: Arc<dyn Kv> = Arc::new(MemoryKv::new());
    let logs = Arc::new(RaftLogStore::open(kv.clone()).unwrap());
    let members = [(GROUP, vec![NodeId::new(1), NodeId::new(2), NodeId::new(3)])];
    let groups: &[(GroupId, Vec<NodeId>)] = if holds_group { &members } else { &[] };
    let table = HashToSlot::even_split(1).unwrap();
    MultiRaft::open(MultiRaftConfig::new(NodeId::new(2)), logs, MetaStore::new(kv), table, groups, Time::ZERO).unwrap()
}

fn deliver(driver: &mut MultiRaft, now: Time, message: Message) -> Vec<Message> {
    let from = NodeId::new(message.from);
    let body = SlotBody::Raft { known_epoch: 0, bytes: message.write_to_bytes().unwrap() };
    driver.handle_message(now, from, SlotMessage { group: GROUP, body });
    drain(driver, now)
}

/// Carries out the driver's effects (syncs complete at once); returns the raft messages it sent.
fn drain(driver: &mut MultiRaft, now: Time) -> Vec<Message> {
    let mut sent = Vec::new();
    while let Some(effect) = driver.poll_effect() {
        match effect {
            SlotEffect::Sync { token } => driver.handle_synced(now, token),
            SlotEffect::Send { message: SlotMessage { body: SlotBody::Raft { bytes, .. }, .. }, .. } => {
                sent.push(Message::parse_from_bytes(&bytes).unwrap());
            }
            _ => {}
        }
    }
    sent
}

fn vote_request(term: u64) -> Message {
    let mut vote = Message::default();
    vote.set_msg_type(MessageType::MsgRequestVote);
    (vote.from, vote.to, vote.term, vote.log_term, vote.index) = (3, 2, term, term - 1, 100);
    vote
}

fn granted(sent: &[Message]) -> bool {
    sent.iter().any(|m| m.get_msg_type() == MessageType::MsgRequestVoteResponse && !m.reject)
}

#[test]
fn a_replica_created_on_demand_does_not_vote_until_a_snapshot_initializes_it() {
    let mut fresh = driver(false);
    let mut heartbeat = Message::default();
    heartbeat.set_msg_type(MessageType::MsgHeartbeat);
    (heartbeat.from, heartbeat.to, heartbeat.term) = (1, 2, 7);
    deliver(&mut fresh, Time::ZERO, heartbeat);
    assert!(fresh.groups().any(|g| g == GROUP), "the leader's heartbeat created the replica");
    // The leader falls silent for longer than an election timeout (raft-rs ignores votes before).
    let mut now = Time::ZERO;
    for _ in 0..100 {
        now = now + std::time::Duration::from_millis(100);
        fresh.handle_tick(now);
        drain(&mut fresh, now);
    }
    let sent = deliver(&mut fresh, now, vote_request(8));
    assert!(!sent.iter().any(|m| m.get_msg_type() == MessageType::MsgRequestVoteResponse), "{sent:?}");

    // A member with a configuration (bootstrapped at term 5, its log no newer than the candidate's)
    // grants it.
    let mut member = driver(true);
    let sent = deliver(&mut member, Time::ZERO, vote_request(8));
    assert!(granted(&sent), "{sent:?}");
}
