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
    /// Leader's wall-clock time at assignment, in milliseconds since the Unix epoch (informational: each
    /// leader's own clock, so it may go back across a leader change; `seq` is the order). The channel
    /// machine stamps `MachineConfig::clock_origin_unix_ms` plus its `now`.
    pub timestamp_ms: u64,
    /// The message body, opaque to tidings.
    pub payload: Bytes,
}

/// Most bytes an encoded record takes besides its key and payload: flags, an explicit seq, the leader
/// epoch and the timestamp (varints of up to 10 bytes), the key length, the payload length (a varint of up
/// to 5 bytes). Most records take far less (see [`encode_records`]).
pub(crate) const RECORD_OVERHEAD_MAX: usize = 1 + 10 + 10 + 10 + 1 + 5;
/// Fewest bytes an encoded record takes: flags, timestamp, payload length.
const RECORD_BYTES_MIN: usize = 3;

/// Flags of an encoded record: what follows it.
const BARRIER: u8 = 1;
const HAS_KEY: u8 = 2;
/// The leader epoch follows (first record of a pack, or a change of epoch).
const HAS_EPOCH: u8 = 4;
/// The seq follows: the record does not follow the one before it (never the case in a valid pack: decoding
/// refuses it, so a gap written by mistake is caught on read).
const HAS_SEQ: u8 = 8;
const KNOWN_FLAGS: u8 = BARRIER | HAS_KEY | HAS_EPOCH | HAS_SEQ;

impl Record {
    /// A message record at `seq` under `leader_epoch`, without idempotency key or timestamp (what tests
    /// and tools need; the channel machine builds its records itself).
    ///
    /// ```
    /// use tidings_store::message::{Record, RecordKind};
    /// use tidings_types::{LeaderEpoch, Seq};
    ///
    /// let record = Record::message(Seq::new(7), LeaderEpoch::new(2), "hello");
    /// assert_eq!((record.kind, record.seq, &record.payload[..]), (RecordKind::Message, Seq::new(7), &b"hello"[..]));
    /// ```
    pub fn message(seq: Seq, leader_epoch: LeaderEpoch, payload: impl Into<Bytes>) -> Self {
        Self {
            seq,
            kind: RecordKind::Message,
            leader_epoch,
            idempotency_key: None,
            timestamp_ms: 0,
            payload: payload.into(),
        }
    }

    /// Most bytes this record takes when encoded (memory and batch-size accounting use it).
    pub fn encoded_len(&self) -> usize {
        RECORD_OVERHEAD_MAX + self.idempotency_key.as_ref().map_or(0, |k| k.0.len()) + self.payload.len()
    }
}

/// Appends `value` as a LEB128 varint.
pub(crate) fn put_varint(out: &mut Vec<u8>, value: u64) {
    let mut header = Header::default();
    header.varint(value);
    out.extend_from_slice(header.bytes());
}

/// A record's encoded header, built on the stack and appended in one copy (pushing byte by byte into
/// the journal's buffer cost more than the bytes the compact layout saves).
struct Header {
    bytes: [u8; RECORD_OVERHEAD_MAX],
    len: usize,
}

impl Default for Header {
    fn default() -> Self {
        Self { bytes: [0; RECORD_OVERHEAD_MAX], len: 0 }
    }
}

impl Header {
    fn byte(&mut self, byte: u8) {
        self.bytes[self.len] = byte;
        self.len += 1;
    }

    fn varint(&mut self, mut value: u64) {
        while value >= 0x80 {
            self.byte(value.to_le_bytes()[0] | 0x80);
            value >>= 7;
        }
        self.byte(value.to_le_bytes()[0]);
    }

    fn bytes(&self) -> &[u8] {
        &self.bytes[..self.len]
    }
}

/// Zigzag: small negative and positive differences both encode short.
fn zigzag(delta: i64) -> u64 {
    u64::from_ne_bytes(((delta << 1) ^ (delta >> 63)).to_ne_bytes())
}

fn unzigzag(value: u64) -> i64 {
    let half = i64::from_ne_bytes((value >> 1).to_ne_bytes());
    half ^ -i64::from_ne_bytes((value & 1).to_ne_bytes())
}

/// The difference `now - before` of two timestamps, as a signed number (clocks may go back).
fn time_delta(now: u64, before: u64) -> i64 {
    i64::from_ne_bytes(now.wrapping_sub(before).to_ne_bytes())
}

/// `before` moved by `delta` (the inverse of [`time_delta`]).
fn time_after(before: u64, delta: i64) -> u64 {
    before.wrapping_add(u64::from_ne_bytes(delta.to_ne_bytes()))
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

    /// A LEB128 varint of at most 10 bytes that fits in a `u64`.
    pub(crate) fn varint(&mut self) -> Option<u64> {
        let mut value = 0u64;
        for i in 0..10 {
            let byte = self.u8()?;
            let bits = u64::from(byte & 0x7f);
            if i == 9 && bits > 1 {
                return None;
            }
            value |= bits << (7 * i);
            if byte & 0x80 == 0 {
                return Some(value);
            }
        }
        None
    }
}

/// Encodes `records` (consecutive seqs) as a pack: the count and the first seq, then each record as its
/// flags, its leader epoch when it differs from the record before, its timestamp as the difference from
/// the record before, its idempotency key, and its payload with its length. A one-record pack of a
/// 128-byte message takes 142 bytes with a wall-clock timestamp (162 in the fixed-width layout this
/// replaced): at 10,000 channels most group-committed batches hold one record.
pub(crate) fn encode_records<'a, I>(records: I, out: &mut Vec<u8>)
where
    I: IntoIterator<Item = &'a Record>,
    I::IntoIter: ExactSizeIterator,
{
    let records = records.into_iter();
    put_varint(out, records.len() as u64);
    let mut prev: Option<&Record> = None;
    for record in records {
        if prev.is_none() {
            put_varint(out, record.seq.get());
        }
        let key = record.idempotency_key.as_ref().map(IdempotencyKey::as_bytes);
        let follows = prev.is_none_or(|p| p.seq.checked_next() == Some(record.seq));
        let epoch_changes = prev.is_none_or(|p| p.leader_epoch != record.leader_epoch);
        let mut flags = 0;
        if record.kind == RecordKind::Barrier {
            flags |= BARRIER;
        }
        if key.is_some() {
            flags |= HAS_KEY;
        }
        if epoch_changes {
            flags |= HAS_EPOCH;
        }
        if !follows {
            flags |= HAS_SEQ;
        }
        // At most RECORD_OVERHEAD_MAX bytes: flags, three varints, the key length; the payload length
        // goes after the key.
        let mut header = Header::default();
        header.byte(flags);
        if !follows {
            header.varint(record.seq.get());
        }
        if epoch_changes {
            header.varint(record.leader_epoch.get());
        }
        let before = prev.map_or(0, |p| p.timestamp_ms);
        header.varint(zigzag(time_delta(record.timestamp_ms, before)));
        if let Some(key) = key {
            // Cannot truncate: keys are at most IDEMPOTENCY_KEY_BYTES_MAX (64) bytes, checked in `new`.
            header.byte(u8::try_from(key.len()).expect("idempotency key length checked at construction"));
            out.extend_from_slice(header.bytes());
            out.extend_from_slice(key);
            header = Header::default();
        }
        header.varint(record.payload.len() as u64);
        out.extend_from_slice(header.bytes());
        out.extend_from_slice(&record.payload);
        prev = Some(record);
    }
}

/// Decodes a pack written by [`encode_records`]; `None` if the bytes are not one, or if its seqs are not
/// consecutive.
pub(crate) fn decode_records(input: &mut Reader<'_>) -> Option<Vec<Record>> {
    let count = usize::try_from(input.varint()?).ok()?;
    // Each record takes a few bytes at least: a count larger than the bytes left allow is garbage.
    if count > input.bytes.len() / RECORD_BYTES_MIN {
        return None;
    }
    let mut records: Vec<Record> = Vec::with_capacity(count);
    if count == 0 {
        return Some(records);
    }
    let mut seq = Seq::new(input.varint()?);
    let mut leader_epoch = LeaderEpoch::new(0);
    let mut timestamp_ms = 0u64;
    for i in 0..count {
        let flags = input.u8()?;
        if flags & !KNOWN_FLAGS != 0 || (i == 0 && flags & HAS_EPOCH == 0) {
            return None;
        }
        if i > 0 {
            // Consecutive by construction; an explicit seq only ever says the pack has a gap.
            if flags & HAS_SEQ != 0 {
                return None;
            }
            seq = seq.checked_next()?;
        } else if flags & HAS_SEQ != 0 {
            return None;
        }
        if flags & HAS_EPOCH != 0 {
            leader_epoch = LeaderEpoch::new(input.varint()?);
        }
        timestamp_ms = time_after(timestamp_ms, unzigzag(input.varint()?));
        let idempotency_key = if flags & HAS_KEY != 0 {
            let len = usize::from(input.u8()?);
            Some(IdempotencyKey::new(Bytes::copy_from_slice(input.bytes(len)?))?)
        } else {
            None
        };
        let payload_len = usize::try_from(input.varint()?).ok()?;
        let payload = Bytes::copy_from_slice(input.bytes(payload_len)?);
        let kind = if flags & BARRIER != 0 { RecordKind::Barrier } else { RecordKind::Message };
        records.push(Record { seq, kind, leader_epoch, idempotency_key, timestamp_ms, payload });
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
        let mut records = vec![record(7, Some("alice:1"), "hello"), record(8, None, ""), record(9, None, "x")];
        // A new leader epoch, a barrier, and a clock that went back: each must come back as it was.
        records[1].leader_epoch = LeaderEpoch::new(4);
        records[1].kind = RecordKind::Barrier;
        records[2].timestamp_ms = 5;
        let mut out = Vec::new();
        encode_records(&records, &mut out);
        assert!(out.len() <= records.iter().map(Record::encoded_len).sum::<usize>());
        let mut reader = Reader::new(&out);
        assert_eq!(decode_records(&mut reader).unwrap(), records);
        assert!(reader.is_empty());
        let mut empty = Vec::new();
        encode_records(&[] as &[Record], &mut empty);
        assert_eq!(decode_records(&mut Reader::new(&empty)), Some(Vec::new()));
    }

    #[test]
    fn a_one_record_pack_is_compact() {
        // 128-byte payload, wall-clock timestamp, no key: flags, epoch, timestamp (6), length (2), payload,
        // behind the count and first seq.
        let one = vec![record(1_000, None, &"m".repeat(128))];
        let mut out = Vec::new();
        encode_records(&one, &mut out);
        assert_eq!(out.len(), 1 + 2 + 1 + 1 + 6 + 2 + 128);
    }

    #[test]
    fn varints_round_trip_and_overlong_ones_are_refused() {
        for value in [0, 1, 127, 128, 300, u64::from(u32::MAX), u64::MAX] {
            let mut out = Vec::new();
            put_varint(&mut out, value);
            let mut reader = Reader::new(&out);
            assert_eq!(reader.varint(), Some(value));
            assert!(reader.is_empty());
        }
        assert_eq!(Reader::new(&[0xff; 10]).varint(), None, "more than 64 bits");
        assert_eq!(Reader::new(&[0x80; 11]).varint(), None, "more than 10 bytes");
        assert_eq!(Reader::new(&[0x80]).varint(), None, "cut short");
        for delta in [0i64, 1, -1, i64::MAX, i64::MIN] {
            assert_eq!(unzigzag(zigzag(delta)), delta);
        }
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
