//! Records of a channel log and their binary encoding, shared by journal frames and sled packs.

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use std::fmt;
use tidings_types::{LeaderEpoch, Seq};

/// Longest idempotency key accepted, in bytes.
pub const IDEMPOTENCY_KEY_BYTES_MAX: usize = 64;

/// A key that makes an append idempotent, e.g. sender id + client message number. Stored with the record,
/// so every replica can answer a retry with the original seq.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(transparent)]
pub struct IdempotencyKey(Bytes);

impl<'de> Deserialize<'de> for IdempotencyKey {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let bytes = Bytes::deserialize(d)?;
        IdempotencyKey::new(bytes).ok_or_else(|| serde::de::Error::custom("idempotency key is empty or too long"))
    }
}

impl IdempotencyKey {
    /// Wraps `bytes`, refusing empty keys and keys longer than [`IDEMPOTENCY_KEY_BYTES_MAX`].
    pub fn new(bytes: impl Into<Bytes>) -> Option<Self> {
        let bytes = bytes.into();
        (!bytes.is_empty() && bytes.len() <= IDEMPOTENCY_KEY_BYTES_MAX).then_some(Self(bytes))
    }

    /// The key's bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }
}

impl fmt::Debug for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "IdempotencyKey({:02x?})", &self.0[..])
    }
}

/// What a record is: a message, or a control record the log writes for itself and reads skip.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum RecordKind {
    /// A message appended by a client.
    Message,
    /// The barrier a new leader writes at the start of its epoch: it commits nothing until a record of
    /// its own epoch is committed (Raft's no-op entry).
    Barrier,
}

impl RecordKind {
    fn tag(self) -> u8 {
        match self {
            RecordKind::Message => 0,
            RecordKind::Barrier => 1,
        }
    }

    fn from_tag(tag: u8) -> Option<Self> {
        match tag {
            0 => Some(RecordKind::Message),
            1 => Some(RecordKind::Barrier),
            _ => None,
        }
    }
}

/// One record in a channel log.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    /// Position in the channel log; consecutive from 1.
    pub seq: Seq,
    /// Message or control record.
    pub kind: RecordKind,
    /// Leader epoch of the leader that assigned `seq`.
    pub leader_epoch: LeaderEpoch,
    /// Idempotency key of the append, if it had one.
    pub idempotency_key: Option<IdempotencyKey>,
    /// Leader's wall-clock time at assignment, in milliseconds since the Unix epoch (informational).
    pub timestamp_ms: u64,
    /// The message body, opaque to tidings.
    pub payload: Bytes,
}

/// Fixed part of an encoded record: seq, kind, leader epoch, timestamp, key length, payload length.
pub(crate) const RECORD_HEADER_BYTES: usize = 8 + 1 + 8 + 8 + 1 + 4;

impl Record {
    /// Bytes this record takes when encoded.
    pub fn encoded_len(&self) -> usize {
        RECORD_HEADER_BYTES + self.idempotency_key.as_ref().map_or(0, |k| k.0.len()) + self.payload.len()
    }

    /// Appends the encoding of this record to `out`.
    pub(crate) fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.seq.get().to_le_bytes());
        out.push(self.kind.tag());
        out.extend_from_slice(&self.leader_epoch.get().to_le_bytes());
        out.extend_from_slice(&self.timestamp_ms.to_le_bytes());
        let key = self.idempotency_key.as_ref().map_or(&[][..], |k| k.as_bytes());
        // Cannot truncate: keys are at most IDEMPOTENCY_KEY_BYTES_MAX (64) bytes, checked in `new`.
        out.push(u8::try_from(key.len()).expect("idempotency key length checked at construction"));
        out.extend_from_slice(key);
        // Payload length is bounded by the log's limits (far below 4 GiB) before a record is encoded.
        out.extend_from_slice(&u32::try_from(self.payload.len()).unwrap_or(u32::MAX).to_le_bytes());
        out.extend_from_slice(&self.payload);
    }

    /// Decodes one record from the front of `input`, advancing it. `None` if the bytes are not a record.
    pub(crate) fn decode(input: &mut Reader<'_>) -> Option<Record> {
        let seq = Seq::new(input.u64()?);
        let kind = RecordKind::from_tag(input.u8()?)?;
        let leader_epoch = LeaderEpoch::new(input.u64()?);
        let timestamp_ms = input.u64()?;
        let key_len = usize::from(input.u8()?);
        let idempotency_key = match key_len {
            0 => None,
            len => Some(IdempotencyKey::new(Bytes::copy_from_slice(input.bytes(len)?))?),
        };
        let payload_len = usize::try_from(input.u32()?).ok()?;
        let payload = Bytes::copy_from_slice(input.bytes(payload_len)?);
        Some(Record { seq, kind, leader_epoch, idempotency_key, timestamp_ms, payload })
    }
}

/// A bounds-checked cursor over bytes read from disk or the wire: every read returns `None` rather than
/// panicking when the bytes run out.
pub(crate) struct Reader<'a> {
    bytes: &'a [u8],
}

impl<'a> Reader<'a> {
    pub(crate) fn new(bytes: &'a [u8]) -> Self {
        Self { bytes }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    pub(crate) fn bytes(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.bytes.len() < n {
            return None;
        }
        let (head, rest) = self.bytes.split_at(n);
        self.bytes = rest;
        Some(head)
    }

    pub(crate) fn u8(&mut self) -> Option<u8> {
        Some(self.bytes(1)?[0])
    }

    pub(crate) fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.bytes(4)?.try_into().ok()?))
    }

    pub(crate) fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.bytes(8)?.try_into().ok()?))
    }
}

/// Encodes `records` as a pack: a count, then the records.
pub(crate) fn encode_records(records: &[Record], out: &mut Vec<u8>) {
    out.extend_from_slice(&u32::try_from(records.len()).unwrap_or(u32::MAX).to_le_bytes());
    for record in records {
        record.encode(out);
    }
}

/// Decodes a pack written by [`encode_records`]; `None` if the bytes are not one, or if its seqs are not
/// consecutive.
pub(crate) fn decode_records(input: &mut Reader<'_>) -> Option<Vec<Record>> {
    let count = usize::try_from(input.u32()?).ok()?;
    // Each record takes at least its header: a count larger than the bytes left is garbage.
    if count > input.bytes.len() / RECORD_HEADER_BYTES {
        return None;
    }
    let mut records: Vec<Record> = Vec::with_capacity(count);
    for _ in 0..count {
        let record = Record::decode(input)?;
        if let Some(prev) = records.last() {
            if prev.seq.checked_next() != Some(record.seq) {
                return None;
            }
        }
        records.push(record);
    }
    Some(records)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(seq: u64, key: Option<&str>, payload: &str) -> Record {
        Record {
            seq: Seq::new(seq),
            kind: RecordKind::Message,
            leader_epoch: LeaderEpoch::new(3),
            idempotency_key: key.map(|k| IdempotencyKey::new(k.as_bytes().to_vec()).unwrap()),
            timestamp_ms: 1_700_000_000_000,
            payload: Bytes::from(payload.to_owned()),
        }
    }

    #[test]
    fn pack_round_trips() {
        let records = vec![record(7, Some("alice:1"), "hello"), record(8, None, ""), record(9, None, "x")];
        let mut out = Vec::new();
        encode_records(&records, &mut out);
        assert_eq!(out.len(), 4 + records.iter().map(Record::encoded_len).sum::<usize>());
        let mut reader = Reader::new(&out);
        assert_eq!(decode_records(&mut reader).unwrap(), records);
        assert!(reader.is_empty());
    }

    #[test]
    fn truncated_or_garbage_packs_are_refused() {
        let records = vec![record(1, Some("k"), "payload"), record(2, None, "more")];
        let mut out = Vec::new();
        encode_records(&records, &mut out);
        for cut in 0..out.len() {
            assert!(decode_records(&mut Reader::new(&out[..cut])).is_none(), "cut at {cut}");
        }
        let huge_count = [0xff, 0xff, 0xff, 0x7f, 1, 2, 3];
        assert!(decode_records(&mut Reader::new(&huge_count)).is_none());
        let gap = vec![record(1, None, "a"), record(3, None, "b")];
        let mut out = Vec::new();
        encode_records(&gap, &mut out);
        assert!(decode_records(&mut Reader::new(&out)).is_none());
    }

    #[test]
    fn idempotency_keys_are_bounded() {
        assert!(IdempotencyKey::new(Vec::new()).is_none());
        assert!(IdempotencyKey::new(vec![1u8; IDEMPOTENCY_KEY_BYTES_MAX]).is_some());
        assert!(IdempotencyKey::new(vec![1u8; IDEMPOTENCY_KEY_BYTES_MAX + 1]).is_none());
    }
}
