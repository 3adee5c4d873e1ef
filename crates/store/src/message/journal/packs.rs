//! Records older than the memory tables, read back from the packs write-behind left in sled.

use super::{JournalLog, SCAN_PAGE, TAIL_PACKS};
use crate::error::{CorruptLocation, StoreError, StoreResult};
use crate::kv::{Direction, KeyRange, Keyspace};
use crate::message::record::{decode_records, Reader, Record};
use crate::message::state::ReadBudget;
use tidings_types::{ChannelId, Seq};

impl JournalLog {
    /// The records of the pack `index_key` names, from its body at `body_key`.
    pub(super) fn read_pack(&self, index_key: &[u8], body_key: &[u8]) -> StoreResult<Vec<Record>> {
        let body = self
            .kv
            .get(Keyspace::MessageBody, body_key)?
            .ok_or_else(|| corrupt_pack(index_key, "pack body missing"))?;
        let records = decode_pack(body_key, &body)?;
        if records.first().map(|r| r.seq.get()) != pack_first_seq(index_key) {
            return Err(corrupt_pack(index_key, "pack body does not match its index entry"));
        }
        Ok(records)
    }

    /// Reads records in `[from, through]` from sled packs.
    pub(super) fn read_older(
        &self,
        channel: &ChannelId,
        from: Seq,
        through: Seq,
        budget: &mut ReadBudget,
        out: &mut Vec<Record>,
    ) -> StoreResult<()> {
        let mut prefix = Vec::new();
        channel.encode_key(&mut prefix);
        let mut expected = from;
        // A replica's activation reads its last records (its idempotency window), which most often lie in
        // the channel's last few packs: one reverse scan from `through` finds them, where finding the pack
        // holding `from` and then reading forward takes two (sled scans dominate an activation's cost).
        let up_to_through =
            KeyRange { start: pack_key(&prefix, Seq::new(0)), end: Some(pack_key(&prefix, through.next())) };
        let mut tail = self.kv.scan_sealed(Keyspace::MessagePack, &up_to_through, Direction::Reverse, TAIL_PACKS)?;
        if tail.last().is_some_and(|(key, _)| pack_first_seq(key).is_some_and(|first| first <= from.get())) {
            tail.reverse();
            // Sealed above: a scan that falls back to the forward read checks nothing it will not use.
            for (key, sealed) in tail {
                let body_key = crate::kv::unseal(Keyspace::MessagePack, &key, sealed)?;
                if !self.take_from_pack(&key, &body_key, &mut expected, through, budget, out)? {
                    break;
                }
            }
            return Ok(());
        }
        let containing = KeyRange { start: pack_key(&prefix, Seq::new(0)), end: Some(pack_key(&prefix, from.next())) };
        let start = match self.kv.scan_sealed(Keyspace::MessagePack, &containing, Direction::Reverse, 1)?.pop() {
            Some((key, _)) => key,
            None => pack_key(&prefix, from),
        };
        let mut range = KeyRange { start, end: Some(pack_key(&prefix, through.next())) };
        loop {
            let page = self.kv.scan(Keyspace::MessagePack, &range, Direction::Forward, SCAN_PAGE)?;
            let done = page.len() < SCAN_PAGE;
            for (key, body_key) in page {
                if !self.take_from_pack(&key, &body_key, &mut expected, through, budget, out)? {
                    return Ok(());
                }
                range.start = [key.as_slice(), &[0]].concat();
            }
            if done {
                return Ok(());
            }
        }
    }

    /// Adds the records of pack `key` (body at `body_key`) from `expected` on to `out`, through `through`
    /// and within `budget`. False once the read is complete.
    pub(super) fn take_from_pack(
        &self,
        key: &[u8],
        body_key: &[u8],
        expected: &mut Seq,
        through: Seq,
        budget: &mut ReadBudget,
        out: &mut Vec<Record>,
    ) -> StoreResult<bool> {
        for record in self.read_pack(key, body_key)? {
            if record.seq < *expected {
                continue;
            }
            if record.seq != *expected {
                return Err(corrupt_pack(key, "hole between packs"));
            }
            if record.seq > through || !budget.take(&record) {
                return Ok(false);
            }
            *expected = record.seq.next();
            out.push(record);
        }
        Ok(true)
    }
}

pub(super) fn pack_key(prefix: &[u8], first: Seq) -> Vec<u8> {
    [prefix, &first.get().to_be_bytes()].concat()
}

/// The first seq of the pack whose index key is `key` (its last 8 bytes; `None` if it is shorter).
pub(super) fn pack_first_seq(key: &[u8]) -> Option<u64> {
    key.get(key.len().checked_sub(8)?..).and_then(|b| b.try_into().ok()).map(u64::from_be_bytes)
}

/// The key of a pack's body: the write-behind round (the journal frame its channel states include
/// everything before, which only grows), then the pack's index key. A round's bodies are written in
/// channel order at the end of [`Keyspace::MessageBody`], next to each other: sled finds the leaf for
/// each insert in its cache. Keyed by channel alone, each insert landed in a leaf full of the channel's
/// earlier packs, and at 10,000 channels sled read those leaves back from disk for about 70% of the
/// write-behind thread's time.
pub(super) fn body_key(round: u64, prefix: &[u8], first: Seq) -> Vec<u8> {
    [&round.to_be_bytes()[..], prefix, &first.get().to_be_bytes()].concat()
}

pub(super) fn corrupt_pack(key: &[u8], detail: &'static str) -> StoreError {
    StoreError::Corrupt { location: CorruptLocation::Kv { keyspace: Keyspace::MessagePack, key: key.to_vec() }, detail }
}

pub(super) fn decode_pack(key: &[u8], value: &[u8]) -> StoreResult<Vec<Record>> {
    let mut reader = Reader::new(value);
    let records = decode_records(&mut reader).ok_or_else(|| corrupt_pack(key, "pack does not decode"))?;
    let first = key.get(key.len().saturating_sub(8)..).and_then(|b| b.try_into().ok()).map(u64::from_be_bytes);
    if !reader.is_empty() || records.first().map(|r| r.seq.get()) != first {
        return Err(corrupt_pack(key, "pack does not match its key"));
    }
    Ok(records)
}
