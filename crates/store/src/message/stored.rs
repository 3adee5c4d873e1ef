//! The stored encodings of the message log, public for tools and fuzzing: a journal frame body (one
//! channel batch), a sled pack (consecutive records of one channel) and a channel state record. Every
//! decoder returns `None` for bytes that are not exactly one well-formed value — truncated, oversized
//! counts, inconsistent seqs or states — and never panics; the log turns that into
//! `StoreError::Corrupt` with the location it read from.
//!
//! ```
//! use tidings_store::message::stored;
//! assert!(stored::batch_from_bytes(b"garbage").is_none());
//! assert!(stored::pack_from_bytes(&[0xff; 16]).is_none());
//! ```

use super::codec::{decode_batch, decode_state, encode_batch, encode_state};
use super::record::{decode_records, encode_records, Reader};
use super::{ChannelLogState, LogBatch, Record};
use tidings_types::Seq;

/// Encodes a batch as the journal stores it.
pub fn batch_to_bytes(batch: &LogBatch) -> Vec<u8> {
    let mut out = Vec::new();
    encode_batch(batch, &mut out);
    out
}

/// Decodes a journal frame body.
pub fn batch_from_bytes(bytes: &[u8]) -> Option<LogBatch> {
    decode_batch(bytes)
}

/// Encodes consecutive records as a sled pack.
pub fn pack_to_bytes(records: &[Record]) -> Vec<u8> {
    let mut out = Vec::new();
    encode_records(records, &mut out);
    out
}

/// Decodes a sled pack: exactly one list of consecutive records.
pub fn pack_from_bytes(bytes: &[u8]) -> Option<Vec<Record>> {
    let mut reader = Reader::new(bytes);
    let records = decode_records(&mut reader)?;
    reader.is_empty().then_some(records)
}

/// A channel state record as sled holds it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredState {
    /// The channel's durable state.
    pub state: ChannelLogState,
    /// Records at or below this seq are written behind into sled.
    pub sled_through: Seq,
    /// The first journal frame the state does not include (recovery replays the channel's frames from
    /// there).
    pub frames_before: u64,
    /// The opening of the log (counted from 1 across restarts) whose write-behind wrote the record; 0 for
    /// a record written before openings were counted. A record written in the current opening has no
    /// stale pack after `sled_through`: those are left only by a round a crash cut short.
    pub opening: u64,
}

/// Encodes a channel state record.
pub fn state_to_bytes(stored: &StoredState) -> Vec<u8> {
    encode_state(stored)
}

/// Decodes a channel state record, checking that it is self-consistent (seqs in order, epochs ascending).
pub fn state_from_bytes(bytes: &[u8]) -> Option<StoredState> {
    decode_state(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::RecordKind;
    use bytes::Bytes;
    use tidings_types::LeaderEpoch;

    fn record(seq: u64) -> Record {
        Record {
            seq: Seq::new(seq),
            kind: RecordKind::Message,
            leader_epoch: LeaderEpoch::new(1),
            idempotency_key: None,
            timestamp_ms: 0,
            payload: Bytes::from_static(b"x"),
        }
    }

    /// Found by the `stored_records` fuzz target: the seq after `u64::MAX` used to overflow (a panic).
    #[test]
    fn a_pack_past_the_largest_seq_is_refused_not_a_panic() {
        assert_eq!(pack_from_bytes(&pack_to_bytes(&[record(u64::MAX)])), Some(vec![record(u64::MAX)]));
        assert_eq!(pack_from_bytes(&pack_to_bytes(&[record(u64::MAX), record(0)])), None);
        assert_eq!(pack_from_bytes(&pack_to_bytes(&[record(1), record(2)])), Some(vec![record(1), record(2)]));
    }
}
