//! The wire frame between tidings nodes: versioned, length-checked, checksummed, decoded with a serde
//! binary codec. Garbage, truncated, oversized, corrupted or other-version bytes are a typed
//! [`FrameError`], never a panic; a frame from a node outside the cluster is refused before its body is
//! looked at.
//!
//! Layout: `magic "TD" | version u8 | body length u32 LE | crc32 u32 LE (of the body) | body`, where the
//! body is the postcard encoding of `(cluster id, sender, sender's storage identity, sender's start,
//! receiver's start as the sender knows it, FrameBody)`.
//!
//! ```
//! use tidings::frame::{decode, encode, Frame, FrameBody, FrameLimits};
//! use tidings::channel::machine::{ChannelMessage, PullHint};
//! use tidings::types::{ChannelId, ChannelType, LeaderEpoch, NodeId, StorageId};
//!
//! let hint = PullHint { channel: ChannelId::new(ChannelType::GROUP, "g").unwrap(), leader_epoch: LeaderEpoch::new(1) };
//! let body = FrameBody::Channel(ChannelMessage::Hint(hint));
//! let frame = Frame { cluster: 7, from: NodeId::new(1), storage: StorageId::new(9), start: 3, to_start: 4, body };
//! let bytes = encode(&frame);
//! assert_eq!(decode(&bytes, &FrameLimits::default()).unwrap(), frame);
//! assert!(decode(&bytes[..bytes.len() - 1], &FrameLimits::default()).is_err());
//! ```

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use tidings_channel::machine::ChannelMessage;
use tidings_slot::raft::SlotMessage;
use tidings_types::{NodeId, StorageId};

/// Frame format version this build writes, and the only one it reads: a frame of another version is
/// refused as [`FrameError::UnsupportedVersion`] (its body is not looked at), since postcard bodies
/// carry no field names and an older or newer layout would decode as something else or not at all.
/// Any change to the layout of a message that crosses the wire bumps it; `tests/formats.rs` holds
/// encodings of this version and fails when a layout changes under it. Nodes of two frame versions
/// refuse each other's frames (as a partition between them would): a cluster moves to a new frame
/// version by restarting its nodes together, not one at a time.
///
/// A new kind of message (a variant added at the end of an enum) leaves every other message's layout
/// as it was, so it does not bump the version: a build that does not know it refuses each frame carrying
/// it as [`FrameError::Malformed`] (counted and dropped, as a lost frame is), and whatever waits for
/// that message from such a peer waits out its own timeout. A rolling restart across such builds
/// works; one across frame versions is a partition until the last node is restarted.
///
/// Version 2: pull answers carry how far the leader's fanout finished (`PullBody::Records::fanned_through`).
/// Version 3: every frame names the sender's storage identity (`Frame::storage`), a node tells a peer
/// whose identity it refuses (`NodeMessage::StorageRefused`), and one held back until a majority took
/// its identity asks for it (`StorageHello`, `StorageAccepted`).
/// Version 4: every frame names its sender's start and the receiver's start as the sender last heard
/// it (`Frame::start`, `Frame::to_start`): a node refuses a frame addressed to an earlier start of it.
/// Version 5: slot raft messages name the highest configuration epoch their sending replica knows of
/// (`SlotBody::known_epoch`): a replica drops answers naming an older one; channel pulls name the
/// membership epoch of their meta (`PullRequest::epoch`): a leader refuses one older than the meta
/// that added its sender.
pub const FRAME_VERSION: u8 = 5;

const MAGIC: [u8; 2] = *b"TD";
const HEADER_BYTES: usize = 2 + 1 + 4 + 4;

/// Limits enforced on inbound frames.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameLimits {
    /// Largest body accepted, in bytes. Default 16 MiB (snapshots travel in smaller chunks).
    pub frame_bytes_max: usize,
}

impl Default for FrameLimits {
    fn default() -> Self {
        Self { frame_bytes_max: 16 << 20 }
    }
}

/// What a frame carries.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum FrameBody {
    /// A message between slot-group drivers.
    Slot(SlotMessage),
    /// A message between channel replicas.
    Channel(ChannelMessage),
    /// A message between node cores (meta propagation, append forwarding).
    Node(crate::node::NodeMessage),
    /// Several messages between channel replicas, handled in order: what one drain of the sender's core
    /// had for this node.
    Channels(Vec<ChannelMessage>),
}

/// A frame between two nodes of one cluster.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Frame {
    /// The cluster the sender belongs to (frames of another cluster are refused).
    pub cluster: u64,
    /// The sending node.
    pub from: NodeId,
    /// The sender's storage identity: its receivers refuse a node that comes back with another one than
    /// they knew (see `node::identity`).
    pub storage: StorageId,
    /// The sender's start (its `NodeConfig::boot_id`, 1 for 0).
    pub start: u64,
    /// The receiver's start as the sender last heard it, 0 if it has not: a node refuses a frame
    /// addressed to an earlier start of it, and a forwarded request addressed to none (see
    /// `node::peer_starts`).
    pub to_start: u64,
    /// The message.
    pub body: FrameBody,
}

/// Why inbound bytes are not an acceptable frame. Nothing was processed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FrameError {
    /// Fewer bytes than a header.
    #[error("frame of {len} bytes is shorter than its header")]
    Truncated {
        /// Bytes received.
        len: usize,
    },
    /// The bytes do not start with the frame magic.
    #[error("not a tidings frame")]
    BadMagic,
    /// A frame of another format version than this build's [`FRAME_VERSION`].
    #[error("frame version {got}, this build reads only version {FRAME_VERSION}")]
    UnsupportedVersion {
        /// Version found.
        got: u8,
    },
    /// The declared body is larger than the limit.
    #[error("frame body of {len} bytes exceeds the limit of {max}")]
    TooLarge {
        /// Declared length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// The declared length does not match the bytes received.
    #[error("frame declares {declared} body bytes, {actual} received")]
    LengthMismatch {
        /// Declared length.
        declared: usize,
        /// Bytes after the header.
        actual: usize,
    },
    /// The body does not match its checksum.
    #[error("frame checksum mismatch")]
    Checksum,
    /// The body does not decode.
    #[error("frame body does not decode")]
    Malformed,
    /// The frame comes from another cluster.
    #[error("frame from cluster {got}, this is cluster {expected}")]
    WrongCluster {
        /// Cluster in the frame.
        got: u64,
        /// This cluster.
        expected: u64,
    },
    /// The sender is not a member of this cluster.
    #[error("frame from {0}, which is not in the cluster")]
    UnknownNode(NodeId),
    /// The transport says the frame came from one node, the frame claims another.
    #[error("frame claims to come from {claimed}, the transport says {actual}")]
    SenderMismatch {
        /// Sender in the frame.
        claimed: NodeId,
        /// Sender according to the transport.
        actual: NodeId,
    },
    /// The sender names another storage identity than the one this node knew for it: it was started
    /// again on a new or emptied data directory, without the votes and records the cluster counted on,
    /// and is refused until it has been drained (see `node::identity`).
    #[error("frame from {node} with storage {got}, which this node knows as {known}")]
    StorageChanged {
        /// The sender.
        node: NodeId,
        /// The identity this node knew for it.
        known: StorageId,
        /// The identity the frame names.
        got: StorageId,
    },
    /// The frame was sent to an earlier start of this node (a transport held it across this node's
    /// restart, or sent it again after reconnecting): what it carries was meant for a node that is gone.
    #[error("frame from {node} addressed to start {addressed} of this node, which is now at start {current}")]
    EarlierStart {
        /// The sender.
        node: NodeId,
        /// The start the frame names.
        addressed: u64,
        /// This node's start.
        current: u64,
    },
    /// A forwarded request from a sender that had not heard from this node since either started: it
    /// may be a copy of one sent to an earlier start, so it is not taken (its caller retries).
    #[error("forwarded request from {node} addressed to no start of this node")]
    UnaddressedForward {
        /// The sender.
        node: NodeId,
    },
}

impl FrameError {
    /// A short name of the refusal, for counters.
    pub fn kind(&self) -> &'static str {
        match self {
            FrameError::Truncated { .. } => "truncated",
            FrameError::BadMagic => "bad_magic",
            FrameError::UnsupportedVersion { .. } => "unsupported_version",
            FrameError::TooLarge { .. } => "too_large",
            FrameError::LengthMismatch { .. } => "length_mismatch",
            FrameError::Checksum => "checksum",
            FrameError::Malformed => "malformed",
            FrameError::WrongCluster { .. } => "wrong_cluster",
            FrameError::UnknownNode(_) => "unknown_node",
            FrameError::SenderMismatch { .. } => "sender_mismatch",
            FrameError::StorageChanged { .. } => "storage_changed",
            FrameError::EarlierStart { .. } => "earlier_start",
            FrameError::UnaddressedForward { .. } => "unaddressed_forward",
        }
    }
}

/// Encodes `frame`.
pub fn encode(frame: &Frame) -> Bytes {
    // The body is serialized straight behind room left for the header, into a buffer sized from the
    // frame's own estimate: no growth while it is written (every peer message pays this), no copy after.
    let mut out = Vec::with_capacity(HEADER_BYTES + frame.body.size_hint());
    out.resize(HEADER_BYTES, 0);
    // Cannot fail: every field serializes into memory.
    let mut out = postcard::serialize_with_flavor(frame, BehindHeader(out)).expect("frame encodes");
    write_header(&mut out);
    Bytes::from(out)
}

/// Frames raw body bytes with the header (magic, version, length, checksum). [`encode`] builds its
/// frames the same way; tests and fuzzers use it to hand the decoder well-sealed bodies of any content.
pub fn seal(body: &[u8]) -> Bytes {
    let mut out = Vec::with_capacity(HEADER_BYTES + body.len());
    out.resize(HEADER_BYTES, 0);
    out.extend_from_slice(body);
    write_header(&mut out);
    Bytes::from(out)
}

/// Fills the header room at the front of `frame` from the body behind it.
fn write_header(frame: &mut [u8]) {
    let (header, body) = frame.split_at_mut(HEADER_BYTES);
    header[..2].copy_from_slice(&MAGIC);
    header[2] = FRAME_VERSION;
    header[3..7].copy_from_slice(&u32::try_from(body.len()).unwrap_or(u32::MAX).to_le_bytes());
    header[7..11].copy_from_slice(&crc32fast::hash(body).to_le_bytes());
}

/// A postcard output that appends to a buffer holding the header's room already.
struct BehindHeader(Vec<u8>);

impl postcard::ser_flavors::Flavor for BehindHeader {
    type Output = Vec<u8>;

    fn try_push(&mut self, data: u8) -> postcard::Result<()> {
        self.0.push(data);
        Ok(())
    }

    fn try_extend(&mut self, data: &[u8]) -> postcard::Result<()> {
        self.0.extend_from_slice(data);
        Ok(())
    }

    fn finalize(self) -> postcard::Result<Vec<u8>> {
        Ok(self.0)
    }
}

impl FrameBody {
    /// `true` for a forwarded request a node must take once only: an append or retention move for a
    /// channel's leader, or a proposal for a slot group's leader.
    pub(crate) fn is_forward(&self) -> bool {
        use crate::node::NodeMessage;
        matches!(
            self,
            FrameBody::Node(NodeMessage::AppendForward { .. } | NodeMessage::RetentionForward { .. })
                | FrameBody::Slot(SlotMessage { body: tidings_slot::raft::SlotBody::Forward { .. }, .. })
        )
    }

    /// About how many bytes the body takes encoded: its channel messages' own estimates, or a fixed
    /// allowance for the rest (a buffer grows past an estimate that was short).
    fn size_hint(&self) -> usize {
        const OTHER: usize = 256;
        match self {
            FrameBody::Channel(message) => message.size_hint(),
            FrameBody::Channels(messages) => messages.iter().map(ChannelMessage::size_hint).sum(),
            FrameBody::Slot(_) | FrameBody::Node(_) => OTHER,
        }
    }
}

/// Decodes a frame, checking header, size, checksum and body.
pub fn decode(bytes: &[u8], limits: &FrameLimits) -> Result<Frame, FrameError> {
    if bytes.len() < HEADER_BYTES {
        return Err(FrameError::Truncated { len: bytes.len() });
    }
    if bytes[..2] != MAGIC {
        return Err(FrameError::BadMagic);
    }
    if bytes[2] != FRAME_VERSION {
        return Err(FrameError::UnsupportedVersion { got: bytes[2] });
    }
    let declared = usize::try_from(u32::from_le_bytes([bytes[3], bytes[4], bytes[5], bytes[6]])).unwrap_or(usize::MAX);
    if declared > limits.frame_bytes_max {
        return Err(FrameError::TooLarge { len: declared, max: limits.frame_bytes_max });
    }
    let body = &bytes[HEADER_BYTES..];
    if body.len() != declared {
        return Err(FrameError::LengthMismatch { declared, actual: body.len() });
    }
    let crc = u32::from_le_bytes([bytes[7], bytes[8], bytes[9], bytes[10]]);
    if crc32fast::hash(body) != crc {
        return Err(FrameError::Checksum);
    }
    postcard::from_bytes(body).map_err(|_| FrameError::Malformed)
}

/// Decodes a frame received from `actual_sender` and checks it belongs here: this cluster, a member
/// sender, and the sender the transport saw.
pub fn decode_from(
    bytes: &[u8],
    actual_sender: NodeId,
    cluster: u64,
    is_member: impl Fn(NodeId) -> bool,
    limits: &FrameLimits,
) -> Result<Frame, FrameError> {
    let frame = decode(bytes, limits)?;
    if frame.cluster != cluster {
        return Err(FrameError::WrongCluster { got: frame.cluster, expected: cluster });
    }
    if !is_member(frame.from) {
        return Err(FrameError::UnknownNode(frame.from));
    }
    if frame.from != actual_sender {
        return Err(FrameError::SenderMismatch { claimed: frame.from, actual: actual_sender });
    }
    Ok(frame)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tidings_channel::machine::PullHint;
    use tidings_slot::raft::SlotBody;
    use tidings_types::{ChannelId, ChannelType, GroupId, LeaderEpoch};

    const STORAGE: StorageId = StorageId::new(5);

    fn frames() -> Vec<Frame> {
        let hint =
            PullHint { channel: ChannelId::new(ChannelType::GROUP, "g").unwrap(), leader_epoch: LeaderEpoch::new(3) };
        vec![
            Frame {
                cluster: 1,
                from: NodeId::new(2),
                storage: STORAGE,
                start: 3,
                to_start: 4,
                body: FrameBody::Channel(ChannelMessage::Hint(hint)),
            },
            Frame {
                cluster: 1,
                from: NodeId::new(3),
                storage: STORAGE,
                start: 3,
                to_start: 4,
                body: FrameBody::Slot(SlotMessage {
                    group: GroupId::new(4),
                    body: SlotBody::Raft { known_epoch: 9, bytes: vec![1, 2, 3] },
                }),
            },
        ]
    }

    #[test]
    fn round_trips_and_checks_membership() {
        let limits = FrameLimits::default();
        for frame in frames() {
            let bytes = encode(&frame);
            assert_eq!(decode_from(&bytes, frame.from, 1, |_| true, &limits).unwrap(), frame);
            assert_eq!(
                decode_from(&bytes, frame.from, 2, |_| true, &limits),
                Err(FrameError::WrongCluster { got: 1, expected: 2 })
            );
            assert_eq!(
                decode_from(&bytes, frame.from, 1, |_| false, &limits),
                Err(FrameError::UnknownNode(frame.from))
            );
            assert!(matches!(
                decode_from(&bytes, NodeId::new(99), 1, |_| true, &limits),
                Err(FrameError::SenderMismatch { .. })
            ));
        }
    }

    #[test]
    fn every_kind_of_bad_frame_is_typed() {
        let limits = FrameLimits { frame_bytes_max: 64 };
        let good = encode(&frames()[0]);
        assert_eq!(decode(&good[..5], &limits), Err(FrameError::Truncated { len: 5 }));
        let mut bad = good.to_vec();
        bad[0] = b'X';
        assert_eq!(decode(&bad, &limits), Err(FrameError::BadMagic));
        let mut newer = good.to_vec();
        newer[2] = FRAME_VERSION + 1;
        assert_eq!(decode(&newer, &limits), Err(FrameError::UnsupportedVersion { got: FRAME_VERSION + 1 }));
        let mut older = good.to_vec();
        older[2] = FRAME_VERSION - 1;
        assert_eq!(decode(&older, &limits), Err(FrameError::UnsupportedVersion { got: FRAME_VERSION - 1 }));
        let big = encode(&Frame {
            cluster: 1,
            from: NodeId::new(1),
            storage: STORAGE,
            start: 3,
            to_start: 4,
            body: FrameBody::Slot(SlotMessage {
                group: GroupId::new(1),
                body: SlotBody::Raft { known_epoch: 0, bytes: vec![0; 100] },
            }),
        });
        assert!(matches!(decode(&big, &limits), Err(FrameError::TooLarge { .. })));
        assert!(matches!(decode(&good[..good.len() - 1], &limits), Err(FrameError::LengthMismatch { .. })));
        let mut flipped = good.to_vec();
        let last = flipped.len() - 1;
        flipped[last] ^= 1;
        assert_eq!(decode(&flipped, &limits), Err(FrameError::Checksum));
        // A well-formed envelope around garbage: checksum fine, body not a frame.
        let garbage = [0xffu8; 9];
        let mut forged = Vec::new();
        forged.extend_from_slice(&MAGIC);
        forged.push(FRAME_VERSION);
        forged.extend_from_slice(&9u32.to_le_bytes());
        forged.extend_from_slice(&crc32fast::hash(&garbage).to_le_bytes());
        forged.extend_from_slice(&garbage);
        assert_eq!(decode(&forged, &limits), Err(FrameError::Malformed));
    }
}
