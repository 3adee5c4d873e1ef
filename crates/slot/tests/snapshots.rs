//! Received snapshots: data that does not decode as a slot group's never reaches raft-rs (stepped, it
//! would be taken for the group's state — recorded as applied over data never installed — and a replica
//! promoted so held none of the group's acknowledged writes: sim seed 580000053), and the chunks of two
//! starts of a sender never combine into one message (how that seed's snapshot came garbled).

use protobuf::Message as _;
use raft::prelude::{Message, MessageType};
use std::sync::Arc;
use tidings_router::HashToSlot;
use tidings_slot::raft::{MultiRaft, MultiRaftConfig, SlotBody, SlotEffect, SlotMessage};
use tidings_store::{Kv, MemoryKv, MetaStore, RaftLogStore};
use tidings_types::{GroupId, HashSlot, NodeId, Time};

const GROUP: GroupId = GroupId::new(1);

/// Node 2's driver, a member of `GROUP` (members 1, 2, 3) from the start.
fn member() -> MultiRaft {
    let kv: Arc<dyn Kv> = Arc::new(MemoryKv::new());
    let logs = Arc::new(RaftLogStore::open(kv.clone()).unwrap());
    let groups = [(GROUP, vec![NodeId::new(1), NodeId::new(2), NodeId::new(3)])];
    let table = HashToSlot::even_split(1).unwrap();
    MultiRaft::open(MultiRaftConfig::new(NodeId::new(2)), logs, MetaStore::new(kv), table, &groups, Time::ZERO).unwrap()
}

/// Delivers `message` from node 1 and carries out the effects (syncs complete at once); returns the raft
/// messages the driver sent.
fn deliver(driver: &mut MultiRaft, message: Message) -> Vec<Message> {
    let body = SlotBody::Raft { known_epoch: 0, bytes: message.write_to_bytes().unwrap() };
    driver.handle_message(Time::ZERO, NodeId::new(1), SlotMessage { group: GROUP, body });
    let mut sent = Vec::new();
    while let Some(effect) = driver.poll_effect() {
        match effect {
            SlotEffect::Sync { token } => driver.handle_synced(Time::ZERO, token),
            SlotEffect::Send { message: SlotMessage { body: SlotBody::Raft { bytes, .. }, .. }, .. } => {
                sent.push(Message::parse_from_bytes(&bytes).unwrap());
            }
            _ => {}
        }
    }
    sent
}

#[test]
fn a_snapshot_whose_data_does_not_decode_is_refused_and_changes_nothing() {
    // Garbage; and a snapshot's layout (its configuration epoch, then its entries: slot, key, value)
    // holding a channel runtime meta (its key starts with `r`) whose value is garbage.
    let garbled_meta =
        postcard::to_allocvec(&(0u64, vec![(Some(HashSlot::new(0).unwrap()), b"r1".to_vec(), vec![0xff; 9])]));
    for data in [vec![0xff; 64], garbled_meta.unwrap()] {
        let mut driver = member();
        let before = (driver.applied_index(GROUP), driver.status(GROUP).map(|s| s.commit));
        let refused = driver.refused_messages();
        let mut message = Message::default();
        message.set_msg_type(MessageType::MsgSnapshot);
        (message.from, message.to, message.term) = (1, 2, 9);
        let snapshot = message.mut_snapshot();
        (snapshot.mut_metadata().index, snapshot.mut_metadata().term) = (50, 8);
        snapshot.mut_metadata().mut_conf_state().voters = vec![1, 2, 3];
        snapshot.data = data.into();

        let sent = deliver(&mut driver, message);
        assert_eq!(driver.refused_messages(), refused + 1, "refused at the door");
        assert_eq!((driver.applied_index(GROUP), driver.status(GROUP).map(|s| s.commit)), before, "nothing applied");
        assert!(!driver.storage_failed(), "the replica goes on");
        assert!(!sent.iter().any(|m| m.get_msg_type() == MessageType::MsgAppendResponse && m.index >= 50), "{sent:?}");
    }
}

/// Node 1's driver at start `boot_id`, cutting every raft message into chunks of at most 8 bytes.
fn chunking_node_1(boot_id: u64) -> MultiRaft {
    let kv: Arc<dyn Kv> = Arc::new(MemoryKv::new());
    let logs = Arc::new(RaftLogStore::open(kv.clone()).unwrap());
    let groups = [(GROUP, vec![NodeId::new(1), NodeId::new(2), NodeId::new(3)])];
    let table = HashToSlot::even_split(1).unwrap();
    let config = MultiRaftConfig { boot_id, chunk_bytes: 8, ..MultiRaftConfig::new(NodeId::new(1)) };
    MultiRaft::open(config, logs, MetaStore::new(kv), table, &groups, Time::ZERO).unwrap()
}

/// The transfer numbers of the chunked messages `driver` sends until it has campaigned.
fn transfers_until_it_campaigns(driver: &mut MultiRaft) -> std::collections::BTreeSet<u64> {
    let mut transfers = std::collections::BTreeSet::new();
    let mut now = Time::ZERO;
    for _ in 0..100 {
        now = now + std::time::Duration::from_millis(100);
        driver.handle_tick(now);
        while let Some(effect) = driver.poll_effect() {
            match effect {
                SlotEffect::Sync { token } => driver.handle_synced(now, token),
                SlotEffect::Send { message: SlotMessage { body: SlotBody::Chunk { transfer, .. }, .. }, .. } => {
                    transfers.insert(transfer);
                }
                _ => {}
            }
        }
    }
    transfers
}

/// Two starts of one node number their chunked messages apart: a restarted sender numbering from 1 again
/// had a late chunk of its earlier start's transfer taken into a new one of the same number and count,
/// and the snapshot reassembled from both did not decode (sim seed 580000053).
#[test]
fn two_starts_of_a_node_never_share_a_transfer_number() {
    let first = transfers_until_it_campaigns(&mut chunking_node_1(1));
    let second = transfers_until_it_campaigns(&mut chunking_node_1(2));
    assert!(!first.is_empty() && !second.is_empty(), "it campaigned in chunks: {first:?} {second:?}");
    assert!(first.is_disjoint(&second), "{first:?} {second:?}");
}
