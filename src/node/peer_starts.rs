//! Which start of each peer this node last heard from, so that a frame addressed to an earlier start of
//! a node is refused by the next one.
//!
//! Every frame names its sender's start (`Frame::start`, the sender's `NodeConfig::boot_id`) and the
//! receiver's start as the sender last heard it (`Frame::to_start`; 0 before it heard from the
//! receiver). A node takes a forwarded request (an append, a retention move, a slot-group proposal) once
//! per start: a copy delivered again within the start is dropped (`TakenForwards`), and one delivered to
//! a later start — held by a transport across the receiver's restart, or sent again after reconnecting
//! — names the earlier start and is refused. A forward that names no start is refused too: its sender
//! had not heard from the receiver, so it may be a copy of one sent to an earlier start. Peers ping
//! each other every `ControllerConfig::ping_interval` (250 ms), so a sender learns a restarted
//! receiver's start, and the receiver its, soon after either starts; forwards sent before then fail
//! (their callers see a timeout and retry).

use crate::frame::{Frame, FrameError};
use parking_lot::RwLock;
use tidings_types::NodeId;

/// This node's start and its peers' latest, shared by every thread that sends or checks frames.
#[derive(Debug)]
pub(crate) struct PeerStarts {
    own: u64,
    known: RwLock<Vec<(NodeId, u64)>>,
}

impl PeerStarts {
    /// Starts known of no peer; this node's start is `boot_id` (1 for 0: 0 means "not known" in a frame).
    pub(crate) fn new(boot_id: u64) -> Self {
        Self { own: boot_id.max(1), known: RwLock::new(Vec::new()) }
    }

    /// This node's start, as its frames name it.
    pub(crate) fn own(&self) -> u64 {
        self.own
    }

    /// The start of `node` this node last heard from (0 if none yet), or this node's own.
    pub(crate) fn of(&self, me: NodeId, node: NodeId) -> u64 {
        if node == me {
            return self.own;
        }
        self.known.read().iter().find(|(n, _)| *n == node).map_or(0, |(_, start)| *start)
    }

    /// Records `frame`'s sender's start, then checks that the frame is addressed to this start (or, but
    /// for forwards, to none in particular). The start is learned from a refused frame too: two nodes
    /// that restarted, each knowing the other's earlier start, would otherwise refuse each other's
    /// frames for good.
    pub(crate) fn accept(&self, frame: &Frame) -> Result<(), FrameError> {
        self.learn(frame.from, frame.start);
        if frame.to_start != 0 && frame.to_start != self.own {
            return Err(FrameError::EarlierStart { node: frame.from, addressed: frame.to_start, current: self.own });
        }
        if frame.to_start == 0 && frame.body.is_forward() {
            return Err(FrameError::UnaddressedForward { node: frame.from });
        }
        Ok(())
    }

    fn learn(&self, node: NodeId, start: u64) {
        if self.known.read().iter().any(|(n, s)| *n == node && *s == start) {
            return;
        }
        let mut known = self.known.write();
        known.retain(|(n, _)| *n != node);
        known.push((node, start));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frame::FrameBody;
    use crate::node::NodeMessage;
    use tidings_types::StorageId;

    fn frame(from: u64, start: u64, to_start: u64, body: FrameBody) -> Frame {
        Frame { cluster: 1, from: NodeId::new(from), storage: StorageId::new(1), start, to_start, body }
    }

    fn ping() -> FrameBody {
        FrameBody::Node(NodeMessage::Ping)
    }

    fn forward() -> FrameBody {
        let command = b"any".to_vec();
        let body = tidings_slot::raft::SlotBody::Forward { origin: NodeId::new(2), id: 7, command };
        FrameBody::Slot(tidings_slot::raft::SlotMessage { group: tidings_types::GroupId::new(1), body })
    }

    #[test]
    fn a_frame_addressed_to_an_earlier_start_is_refused_and_one_to_this_start_taken() {
        let starts = PeerStarts::new(20);
        let (me, peer) = (NodeId::new(1), NodeId::new(2));
        assert_eq!(starts.of(me, peer), 0, "nothing heard from the peer yet");
        assert_eq!(starts.of(me, me), 20);
        assert_eq!(
            starts.accept(&frame(2, 7, 19, forward())),
            Err(FrameError::EarlierStart { node: peer, addressed: 19, current: 20 })
        );
        assert_eq!(starts.accept(&frame(2, 7, 20, forward())), Ok(()));
        assert_eq!(starts.accept(&frame(2, 7, 0, ping())), Ok(()), "anything but a forward may name no start");
        assert_eq!(starts.of(me, peer), 7);
    }

    #[test]
    fn a_forward_naming_no_start_is_refused() {
        let starts = PeerStarts::new(20);
        assert_eq!(
            starts.accept(&frame(2, 7, 0, forward())),
            Err(FrameError::UnaddressedForward { node: NodeId::new(2) })
        );
    }

    #[test]
    fn a_peer_s_start_is_learned_from_a_refused_frame_too_and_follows_its_restarts() {
        // Both ends restarted, each knowing the other's earlier start: the first frame either way is
        // refused, and teaches its receiver the sender's start, so the answer gets through.
        let starts = PeerStarts::new(20);
        let (me, peer) = (NodeId::new(1), NodeId::new(2));
        assert!(starts.accept(&frame(2, 8, 19, ping())).is_err());
        assert_eq!(starts.of(me, peer), 8);
        assert_eq!(starts.accept(&frame(2, 9, 20, ping())), Ok(()));
        assert_eq!(starts.of(me, peer), 9, "the peer restarted");
        assert_eq!(PeerStarts::new(0).own(), 1, "0 names no start in a frame");
    }
}
