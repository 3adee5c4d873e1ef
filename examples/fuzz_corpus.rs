//! Writes the seed corpus of the fuzz targets (`fuzz/seeds/<target>/`): valid frames, slot commands and
//! stored message-log values, so the fuzzers start from real encodings. Run from the repository root:
//! `cargo run --example fuzz_corpus`.

use bytes::Bytes;
use std::path::Path;
use tidings::channel::fanout::Member;
use tidings::channel::machine::{AppendError, ChannelMessage, PullBody, PullHint, PullRequest, PullResponse};
use tidings::frame::{encode, Frame, FrameBody};
use tidings::node::{FlagQuery, NodeMessage, RemoteAppendError, SlotQuery, SlotReadAnswer};
use tidings::slot::command::{Command, MemberList};
use tidings::slot::model::{ChannelFlags, ChannelInfo, SlotMigrationStep, Uid, User};
use tidings::slot::raft::{SlotBody, SlotMessage};
use tidings::store::message::{stored, ChannelLogState, IdempotencyKey, LogBatch, LogOp, Record, RecordKind};
use tidings::types::{
    ChannelId, ChannelRuntimeMeta, ChannelType, Epoch, GroupId, HashSlot, LeaderEpoch, NodeId, Seq, StorageId,
};

fn write(target: &str, name: &str, bytes: &[u8]) {
    let dir = Path::new("fuzz/seeds").join(target);
    std::fs::create_dir_all(&dir).expect("corpus directory");
    std::fs::write(dir.join(name), bytes).expect("corpus file");
}

fn main() {
    let channel = ChannelId::new(ChannelType::GROUP, "lobby").expect("channel id");
    let meta = ChannelRuntimeMeta {
        channel: channel.clone(),
        version: 3,
        leader: NodeId::new(1),
        replicas: vec![NodeId::new(1), NodeId::new(2), NodeId::new(3)],
        isr: vec![NodeId::new(1), NodeId::new(2), NodeId::new(3)],
        min_isr: 2,
        epoch: Epoch::new(1),
        leader_epoch: LeaderEpoch::new(2),
        write_fence: None,
        retention_through: Seq::new(0),
    };
    let records: Vec<Record> = (1..=3)
        .map(|seq| Record {
            seq: Seq::new(seq),
            kind: RecordKind::Message,
            leader_epoch: LeaderEpoch::new(1),
            idempotency_key: IdempotencyKey::new(format!("key-{seq}")),
            timestamp_ms: 1_700_000_000_000 + seq,
            payload: Bytes::from(format!("message {seq}")),
        })
        .collect();
    frames(&channel, &meta, &records);
    commands(&channel, meta);
    stored_values(&channel, &records);
    println!("wrote the seed corpus under fuzz/seeds/");
}

/// Frames of every kind of body, as a node encodes them (`frame_decode`).
fn frames(channel: &ChannelId, meta: &ChannelRuntimeMeta, records: &[Record]) {
    let hint = ChannelMessage::Hint(PullHint { channel: channel.clone(), leader_epoch: LeaderEpoch::new(2) });
    let bodies = [
        FrameBody::Channel(hint.clone()),
        FrameBody::Channels(vec![hint.clone(), hint]),
        FrameBody::Node(NodeMessage::MetaPush(meta.clone())),
        FrameBody::Slot(SlotMessage {
            group: GroupId::new(1),
            body: SlotBody::Removed { config_epoch: 40, last_index: 90 },
        }),
        FrameBody::Slot(SlotMessage { group: GroupId::new(1), body: SlotBody::MemberCheck }),
        FrameBody::Node(NodeMessage::MetaFetch(channel.clone())),
        FrameBody::Node(NodeMessage::Ping),
        FrameBody::Node(NodeMessage::EvidenceRequest { task: 7, meta: meta.clone() }),
        FrameBody::Node(NodeMessage::AppendForward {
            id: 9,
            channel: channel.clone(),
            sender: Some("alice".into()),
            records: vec![(IdempotencyKey::new("k1"), Bytes::from_static(b"hello"))],
        }),
        FrameBody::Node(NodeMessage::SlotReadRequest {
            request: 11,
            query: SlotQuery::SubscriberPage {
                channel: channel.clone(),
                cursor: Some(b"sub/alice".to_vec()),
                limit: 1000,
            },
        }),
        FrameBody::Node(NodeMessage::SlotReadReply {
            request: 11,
            answer: SlotReadAnswer::Page {
                members: vec![Member { uid: "bob".into(), left: false, hidden: true, denied: false }],
                next: None,
            },
        }),
        FrameBody::Node(NodeMessage::SlotReadRequest {
            request: 12,
            query: SlotQuery::Flag(FlagQuery::Denied { channel: channel.clone(), uid: Uid::new("eve").expect("uid") }),
        }),
        FrameBody::Channels(vec![
            ChannelMessage::Pull(PullRequest {
                channel: channel.clone(),
                pull_id: 5,
                leader_epoch: LeaderEpoch::new(2),
                epoch: Epoch::new(3),
                next_seq: Seq::new(1),
                last_epoch: LeaderEpoch::new(0),
                max_bytes: 1 << 20,
            }),
            ChannelMessage::PullResponse(PullResponse {
                channel: channel.clone(),
                pull_id: 5,
                leader_epoch: LeaderEpoch::new(2),
                body: PullBody::Records { records: records.to_vec(), hw: Seq::new(2), fanned_through: Seq::new(1) },
            }),
            ChannelMessage::PullResponse(PullResponse {
                channel: channel.clone(),
                pull_id: 6,
                leader_epoch: LeaderEpoch::new(2),
                body: PullBody::Diverging { epoch: LeaderEpoch::new(1), end_seq: Seq::new(2) },
            }),
            ChannelMessage::PullResponse(PullResponse {
                channel: channel.clone(),
                pull_id: 7,
                leader_epoch: LeaderEpoch::new(2),
                body: PullBody::StartAfter { seq: Seq::new(1), epoch: LeaderEpoch::new(1), hw: Seq::new(2) },
            }),
        ]),
        FrameBody::Node(NodeMessage::AppendReply { id: 9, result: Ok(vec![Seq::new(4), Seq::new(5)]) }),
        FrameBody::Node(NodeMessage::AppendReply {
            id: 10,
            result: Err(RemoteAppendError::Refused(AppendError::NotLeader { leader: Some(NodeId::new(3)) })),
        }),
        FrameBody::Slot(SlotMessage {
            group: GroupId::new(2),
            body: SlotBody::Raft { known_epoch: 3, bytes: vec![8, 3, 16, 2] },
        }),
        FrameBody::Node(NodeMessage::StorageRefused { known: StorageId::new(77) }),
        FrameBody::Node(NodeMessage::StorageHello),
        FrameBody::Node(NodeMessage::StorageAccepted { storage: StorageId::new(0x5eed) }),
        FrameBody::Node(NodeMessage::Leaving),
        FrameBody::Node(NodeMessage::HandOffProgress {
            channels_led: vec![(GroupId::new(1), 3), (GroupId::new(2), 0)],
        }),
    ];
    for (i, body) in bodies.into_iter().enumerate() {
        let frame =
            Frame { cluster: 1, from: NodeId::new(2), storage: StorageId::new(0x5eed), start: 3, to_start: 4, body };
        write("frame_decode", &format!("frame-{i}"), &encode(&frame));
    }
}

/// Slot commands, key-scoped and group-level (`slot_command`).
fn commands(channel: &ChannelId, meta: ChannelRuntimeMeta) {
    let uid = Uid::new("alice").expect("uid");
    let commands = [
        Command::PutUser(User { uid: uid.clone(), name: "Alice".into(), banned: false }),
        Command::CreateChannel(ChannelInfo { channel: channel.clone(), flags: ChannelFlags::default() }),
        Command::AddMembers { channel: channel.clone(), list: MemberList::Subscribers, uids: vec![uid] },
        Command::CreateRuntimeMeta(meta.clone()),
        Command::CasRuntimeMeta { expected_version: 2, meta, proof: None },
        Command::MoveGroupReplica { group: GroupId::new(1), from: NodeId::new(1), to: NodeId::new(4) },
        Command::DrainNode { group: GroupId::new(1), node: NodeId::new(2), drain: true },
        Command::CommitGroupConfig { group: GroupId::new(1) },
        Command::MigrateSlot {
            group: GroupId::new(2),
            slot: HashSlot::new(7).expect("slot"),
            step: SlotMigrationStep::ImportChunk {
                from: GroupId::new(1),
                epoch: 1,
                attempt: 1 << 20,
                entries: vec![(b"ualice".to_vec(), Some(vec![1, 2])), (b"ubob".to_vec(), None)],
            },
        },
    ];
    for (i, command) in commands.iter().enumerate() {
        write("slot_command", &format!("command-{i}"), &command.encode());
    }
}

/// What the message log stores: a journal batch, a pack of records and a channel state
/// (`stored_records`).
fn stored_values(channel: &ChannelId, records: &[Record]) {
    let batch = LogBatch::new(
        channel.clone(),
        vec![
            LogOp::Append(records.to_vec()),
            LogOp::CheckpointHw(Seq::new(2)),
            LogOp::CheckpointFanned(Seq::new(2)),
            LogOp::TruncateAfter(Seq::new(2)),
        ],
    );
    write("stored_records", "batch", &stored::batch_to_bytes(&batch));
    write("stored_records", "pack", &stored::pack_to_bytes(records));
    let state = ChannelLogState {
        last_seq: Seq::new(3),
        epochs: vec![(LeaderEpoch::new(1), Seq::new(1))],
        hw: Seq::new(2),
        retention_through: Seq::new(0),
        fanned_through: Seq::new(1),
        meta_floor: 0,
        isr_proposals: Vec::new(),
    };
    let stored_state = stored::StoredState { state, sled_through: Seq::new(2), frames_before: 1, opening: 1 };
    write("stored_records", "state", &stored::state_to_bytes(&stored_state));
}
