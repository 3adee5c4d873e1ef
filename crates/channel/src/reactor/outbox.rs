//! Channel messages on their way out, packed per destination: everything one drain of the core sends
//! to a node leaves as one frame (`FrameBody::Channels`) instead of one frame per message.
//!
//! With 10,000 active channels each group commit moves about one message per channel and peer (a pull,
//! its answer, a hint); the fixed cost of a frame — header, checksum, buffer, the transport's queue and
//! wake-up, the receiver's decode — then weighs more than the message itself. A batch is cut when it
//! reaches its byte budget (kept well under the receivers' frame limit) or its message cap, and always
//! at the end of a drain, so packing never delays a message past the drain that made it. Order between
//! two messages to one node is kept.

use crate::machine::ChannelMessage;
use tidings_types::NodeId;

/// Most messages in one batch.
const BATCH_MESSAGES_MAX: usize = 4096;

/// One destination's batch being filled.
struct Batch {
    to: NodeId,
    messages: Vec<ChannelMessage>,
    bytes: usize,
}

/// Channel messages waiting for the end of a drain (see the module docs).
pub struct ChannelOutbox {
    batches: Vec<Batch>,
    bytes_max: usize,
}

impl ChannelOutbox {
    /// An outbox cutting batches at about `bytes_max` bytes.
    pub fn new(bytes_max: usize) -> Self {
        Self { batches: Vec::new(), bytes_max: bytes_max.max(1) }
    }

    /// Adds a message for `to`. Returns a batch for `to` that is full and must leave now: the batch
    /// before this message when the message would not fit beside it, or the batch with it when it
    /// reached the cap.
    pub fn push(&mut self, to: NodeId, message: ChannelMessage) -> Option<Vec<ChannelMessage>> {
        let size = message.size_hint();
        let index = match self.batches.iter().position(|b| b.to == to) {
            Some(index) => index,
            None => {
                self.batches.push(Batch { to, messages: Vec::new(), bytes: 0 });
                self.batches.len() - 1
            }
        };
        let batch = &mut self.batches[index];
        let full_before = !batch.messages.is_empty() && batch.bytes + size > self.bytes_max;
        let cut = full_before.then(|| {
            batch.bytes = 0;
            std::mem::take(&mut batch.messages)
        });
        batch.messages.push(message);
        batch.bytes += size;
        if cut.is_some() {
            return cut;
        }
        if batch.messages.len() >= BATCH_MESSAGES_MAX || batch.bytes >= self.bytes_max {
            batch.bytes = 0;
            return Some(std::mem::take(&mut batch.messages));
        }
        None
    }

    /// Takes every batch (at the end of a drain), in the order their destinations were first used.
    pub fn drain(&mut self) -> impl Iterator<Item = (NodeId, Vec<ChannelMessage>)> + '_ {
        self.batches.drain(..).filter(|b| !b.messages.is_empty()).map(|b| (b.to, b.messages))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::machine::PullHint;
    use tidings_types::{ChannelId, ChannelType, LeaderEpoch};

    fn hint(i: usize) -> ChannelMessage {
        let channel = ChannelId::new(ChannelType::GROUP, &format!("c{i}")).expect("channel id");
        ChannelMessage::Hint(PullHint { channel, leader_epoch: LeaderEpoch::new(1) })
    }

    #[test]
    fn messages_to_one_node_leave_together_and_in_order() {
        let mut outbox = ChannelOutbox::new(1 << 20);
        let (a, b) = (NodeId::new(1), NodeId::new(2));
        for i in 0..5 {
            assert!(outbox.push(if i % 2 == 0 { a } else { b }, hint(i)).is_none());
        }
        let batches: Vec<_> = outbox.drain().collect();
        assert_eq!(batches, vec![(a, vec![hint(0), hint(2), hint(4)]), (b, vec![hint(1), hint(3)])]);
        assert_eq!(outbox.drain().count(), 0, "a drain empties the outbox");
    }

    #[test]
    fn a_batch_is_cut_before_it_outgrows_its_byte_budget() {
        let size = hint(0).size_hint();
        let mut outbox = ChannelOutbox::new(size * 3);
        let a = NodeId::new(1);
        assert!(outbox.push(a, hint(0)).is_none());
        assert!(outbox.push(a, hint(1)).is_none());
        // The third fills the budget exactly: the batch leaves with it.
        assert_eq!(outbox.push(a, hint(2)), Some(vec![hint(0), hint(1), hint(2)]));
        assert!(outbox.push(a, hint(3)).is_none());
        let mut small = ChannelOutbox::new(size + size / 2);
        assert!(small.push(a, hint(4)).is_none());
        // The next would overflow: the batch before it leaves, the new one starts with it.
        assert_eq!(small.push(a, hint(5)), Some(vec![hint(4)]));
        assert_eq!(small.drain().collect::<Vec<_>>(), vec![(a, vec![hint(5)])]);
    }
}
