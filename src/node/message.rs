//! Messages between the node cores of one cluster (beside slot and channel messages).

use super::controller::EvidenceReport;
use serde::{Deserialize, Serialize};
use tidings_channel::fanout::Member;
use tidings_channel::machine::{AppendAborted, AppendError};
use tidings_slot::command::{MemberList, RoutingKey};
use tidings_slot::model::Uid;
use tidings_slot::query::SlotReader;
use tidings_store::message::IdempotencyKey;
use tidings_store::StoreResult;
use tidings_types::{ChannelId, ChannelRuntimeMeta, GroupId, HashSlot, Seq};

/// A node-to-node message.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum NodeMessage {
    /// The authoritative runtime meta of a channel, pushed by the slot group's leader (or answering a fetch).
    MetaPush(ChannelRuntimeMeta),
    /// Asks a node of the channel's slot group for the channel's runtime meta.
    MetaFetch(ChannelId),
    /// Answer to a fetch: the slot group holds no meta for the channel (it was never created).
    MetaMissing(ChannelId),
    /// An append forwarded to the node that leads the channel.
    AppendForward {
        /// The forwarding node's id for it.
        id: u64,
        /// The channel.
        channel: ChannelId,
        /// The sending user, when the host named one (it was checked on the forwarding node).
        sender: Option<String>,
        /// The records: idempotency key and payload.
        records: Vec<(Option<IdempotencyKey>, bytes::Bytes)>,
    },
    /// The result of a forwarded append.
    AppendReply {
        /// The forwarding node's id.
        id: u64,
        /// Seqs, or why not.
        result: Result<Vec<Seq>, RemoteAppendError>,
    },
    /// A retention move forwarded to the node that leads the channel.
    RetentionForward {
        /// The forwarding node's id for it.
        id: u64,
        /// The channel.
        channel: ChannelId,
        /// Give up the records through this seq.
        through: Seq,
    },
    /// The result of a forwarded retention move.
    RetentionReply {
        /// The forwarding node's id.
        id: u64,
        /// The retention boundary in force, or why not.
        result: Result<Seq, RemoteAppendError>,
    },
    /// Liveness: sent to every peer periodically; any valid frame counts as a sign of life.
    Ping,
    /// The receiver's frames name another storage identity than the one the sender knew for it: the
    /// sender refuses them (it came back on a new or emptied data directory without being drained; see
    /// `node::identity`). At most one a second per refused node.
    StorageRefused {
        /// The identity the sender knows for the receiver.
        known: tidings_types::StorageId,
    },
    /// A node held back until a majority of the cluster took its storage identity (a new cluster's
    /// first start, or a node on a new directory) asks whether the receiver takes the identity its
    /// frame names: answered `StorageAccepted`, or refused.
    StorageHello,
    /// The answer to a `StorageHello`: the sender took this identity for the receiver.
    StorageAccepted {
        /// The identity taken.
        storage: tidings_types::StorageId,
    },
    /// A controller task asks a replica for its durable evidence under `meta` (a committed, fenced meta:
    /// the replica applies it first, so it froze before it answers).
    EvidenceRequest {
        /// The task.
        task: u64,
        /// The fenced meta.
        meta: ChannelRuntimeMeta,
    },
    /// A replica's evidence for a task.
    EvidenceReply {
        /// The task.
        task: u64,
        /// The channel.
        channel: ChannelId,
        /// Meta version the replica applied when it answered.
        version: u64,
        /// Its durable state.
        report: EvidenceReport,
    },
    /// The replica the meta names leader cannot lead (storage failed, or it restarted after leading that
    /// leader epoch): asks the channel's slot group leader for a failover.
    RequestFailover {
        /// The channel.
        channel: ChannelId,
        /// Meta version the replica has.
        version: u64,
    },
    /// The leader of group `to`, which holds an import of `slot` from group `from` at ownership epoch
    /// `epoch` that has not finished, asks whether `from` still exports it there; only `from`'s leader
    /// answers.
    ExportQuery {
        /// The source group.
        from: GroupId,
        /// The hash slot.
        slot: HashSlot,
        /// The group holding the import.
        to: GroupId,
        /// The migration's epoch.
        epoch: u64,
    },
    /// `from`'s leader's answer to an [`NodeMessage::ExportQuery`].
    ExportAnswer {
        /// The source group.
        from: GroupId,
        /// The hash slot.
        slot: HashSlot,
        /// The group holding the import.
        to: GroupId,
        /// The migration's epoch.
        epoch: u64,
        /// `false`: the export was given up (the import can go).
        exporting: bool,
    },
    /// A read of a slot group the asking node keeps no replica of, asked of a node that does: a page of
    /// subscribers for fanout, or `append_from`'s sender check.
    SlotReadRequest {
        /// The asking node's id for this request (a new one for each attempt).
        request: u64,
        /// What to read.
        query: SlotQuery,
    },
    /// The answer to a [`NodeMessage::SlotReadRequest`].
    SlotReadReply {
        /// The request answered.
        request: u64,
        /// What was read, or why not.
        answer: SlotReadAnswer,
    },
    /// Asks a node of the channel's slot group for the channel's runtime meta read after a ReadIndex
    /// of the group: a meta as new as every one committed before the ask. How a node tells that a log
    /// it holds belongs to no replica of the channel any more.
    MetaConfirm {
        /// The asking node's id for it.
        request: u64,
        /// The channel.
        channel: ChannelId,
    },
    /// The answer to a [`NodeMessage::MetaConfirm`]: `None` when the node could not read the meta
    /// that way (it keeps no replica of the group, the read failed, the group no longer serves the
    /// channel's hash slot, or it holds no meta).
    MetaConfirmed {
        /// The request answered.
        request: u64,
        /// The channel.
        channel: ChannelId,
        /// The meta.
        meta: Option<ChannelRuntimeMeta>,
    },
    /// Liveness, from a node that is leaving (`NodeCore::set_leaving`): sent instead of `Ping` while it
    /// hands off its leaderships before it stops. The mark lapses when the pings stop saying so. Among
    /// the last variants, so a node of an earlier build refuses only these (as garbage) and reads every
    /// other.
    Leaving,
    /// To a leaving node, from the leader of slot groups, after each repair pass over their slots: how
    /// many channels of each of those groups it still leads, active or idle. The leaving node waits for
    /// every group to say none (`Node::hand_off_leaderships`). After `Leaving`, so a node of an earlier
    /// build refuses only these two.
    HandOffProgress {
        /// Per slot group the sender leads: the channels of its slots the leaving node still leads.
        channels_led: Vec<(GroupId, u32)>,
    },
}

/// A read one node asks of another that keeps a replica of the slot group it concerns.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum SlotQuery {
    /// A page of a channel's subscribers, with the state fanout needs.
    SubscriberPage {
        /// The channel.
        channel: ChannelId,
        /// Where the page starts (`None`: at the first subscriber).
        cursor: Option<Vec<u8>>,
        /// Subscribers wanted; the answering node caps it at its own fanout page size.
        limit: u32,
    },
    /// A yes-or-no question.
    Flag(FlagQuery),
}

/// A yes-or-no read (`append_from`'s sender check).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum FlagQuery {
    /// Whether a user is banned.
    Banned(Uid),
    /// Whether a user is on a channel's deny list.
    Denied {
        /// The channel.
        channel: ChannelId,
        /// The user.
        uid: Uid,
    },
}

impl FlagQuery {
    /// The user asked about.
    pub fn uid(&self) -> &Uid {
        match self {
            FlagQuery::Banned(uid) | FlagQuery::Denied { uid, .. } => uid,
        }
    }

    /// The routing key whose slot group holds the answer.
    pub fn routing_key(&self) -> RoutingKey<'_> {
        match self {
            FlagQuery::Banned(uid) => RoutingKey::Uid(uid),
            FlagQuery::Denied { channel, .. } => RoutingKey::Channel(channel),
        }
    }

    /// The answer in group `copy`'s copy of the key's hash slot (the one [`SlotReader::owner_copy`]
    /// named as serving): one read, the same on the node that checks a sender and on one answering a
    /// peer.
    pub fn read(&self, reader: &SlotReader, copy: GroupId) -> StoreResult<bool> {
        match self {
            FlagQuery::Banned(uid) => Ok(reader.user_in(copy, uid)?.is_some_and(|user| user.banned)),
            FlagQuery::Denied { channel, uid } => reader.is_member_in(copy, channel, MemberList::Deny, uid),
        }
    }
}

impl SlotQuery {
    /// The routing key whose slot group holds the answer.
    pub fn routing_key(&self) -> RoutingKey<'_> {
        match self {
            SlotQuery::SubscriberPage { channel, .. } => RoutingKey::Channel(channel),
            SlotQuery::Flag(flag) => flag.routing_key(),
        }
    }
}

/// What a node answers a [`NodeMessage::SlotReadRequest`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum SlotReadAnswer {
    /// A page of subscribers read from the answering node's replica of the slot group.
    Page {
        /// The subscribers, with the state fanout needs.
        members: Vec<Member>,
        /// Where the next page starts; `None` after the last.
        next: Option<Vec<u8>>,
    },
    /// The answer to a [`SlotQuery::Flag`].
    Flag(bool),
    /// The answering node keeps no applied replica of the slot group, or could not read it: ask another.
    NotServed,
    /// The answering node is serving as many pages to its peers as it allows: ask again shortly.
    Busy,
}

/// Why a forwarded append did not complete, as the leader tells it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[non_exhaustive]
pub enum RemoteAppendError {
    /// Refused at admission; nothing was written.
    #[error(transparent)]
    Refused(#[from] AppendError),
    /// Admitted, then not committed (outcome unknown: retry with the same idempotency keys).
    #[error(transparent)]
    Aborted(#[from] AppendAborted),
    /// The receiving node has no replica of the channel, or no meta for it yet.
    #[error("the receiving node has no replica of the channel")]
    NotReplica,
    /// The receiving node has `active_channels_max` channel replicas in memory and none idle: retry later.
    #[error("the receiving node has too many active channels")]
    TooManyChannels,
}
