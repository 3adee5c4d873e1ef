//! Many proposals in one raft entry. A leader queues the proposals of a round (its own and forwarded
//! ones) and proposes them per group as one entry: one log append, one message per follower and one
//! acknowledgement for the whole batch instead of one per command. Each proposal keeps its origin and id,
//! so its outcome still reaches the node that waits for it.

use serde::{Deserialize, Serialize};
use tidings_types::NodeId;

/// Context of an entry that carries a [`ProposalBatch`].
pub(crate) const BATCH_CONTEXT: &[u8] = b"tidings/batch/1";

/// The proposals of one entry, in proposal order.
#[derive(Debug, Default, Serialize, Deserialize)]
pub(crate) struct ProposalBatch<'a> {
    #[serde(borrow)]
    pub(crate) proposals: Vec<Proposal<'a>>,
}

/// One proposal: who waits for it, under which id, and the encoded command.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Proposal<'a> {
    pub(crate) origin: NodeId,
    pub(crate) id: u64,
    #[serde(borrow)]
    pub(crate) command: &'a [u8],
}

/// A proposal waiting for the end of the round.
#[derive(Debug)]
pub(crate) struct Queued {
    pub(crate) origin: NodeId,
    pub(crate) id: u64,
    pub(crate) command: Vec<u8>,
}

/// Encodes `queued` as one entry's data.
pub(crate) fn encode<'a>(queued: impl Iterator<Item = &'a Queued>) -> Vec<u8> {
    let batch = ProposalBatch {
        proposals: queued.map(|q| Proposal { origin: q.origin, id: q.id, command: &q.command }).collect(),
    };
    // Cannot fail: plain data into memory.
    postcard::to_allocvec(&batch).expect("proposal batch encodes")
}

/// The proposals of an entry's data; `None` if it does not decode (the entry then applies nothing).
pub(crate) fn decode(data: &[u8]) -> Option<ProposalBatch<'_>> {
    postcard::from_bytes(data).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_round_trips_and_garbage_is_refused() {
        let queued = [
            Queued { origin: NodeId::new(1), id: 7, command: b"one".to_vec() },
            Queued { origin: NodeId::new(3), id: 9, command: b"two".to_vec() },
        ];
        let data = encode(queued.iter());
        let batch = decode(&data).unwrap();
        let got: Vec<(u64, u64, &[u8])> = batch.proposals.iter().map(|p| (p.origin.get(), p.id, p.command)).collect();
        assert_eq!(got, vec![(1, 7, &b"one"[..]), (3, 9, &b"two"[..])]);
        assert!(decode(&[0xff, 0xff, 0xff]).is_none());
    }
}
