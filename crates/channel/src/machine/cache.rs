//! Recent records of the local log, kept in memory to serve pulls without a store read.

use std::collections::VecDeque;
use tidings_store::message::Record;
use tidings_types::Seq;

/// A suffix of the local log: consecutive records, bounded in bytes by the caller's eviction.
#[derive(Debug, Default)]
pub(crate) struct RecordCache {
    records: VecDeque<Record>,
    bytes: usize,
}

impl RecordCache {
    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }

    pub(crate) fn first_seq(&self) -> Option<Seq> {
        self.records.front().map(|r| r.seq)
    }

    /// Appends `record`; a record that does not follow the last one resets the cache (it starts a new
    /// suffix).
    pub(crate) fn push(&mut self, record: Record) {
        if self.records.back().is_some_and(|last| last.seq.checked_next() != Some(record.seq)) {
            self.clear();
        }
        self.bytes += record.encoded_len();
        self.records.push_back(record);
    }

    pub(crate) fn clear(&mut self) {
        self.records.clear();
        self.bytes = 0;
    }

    pub(crate) fn truncate_after(&mut self, seq: Seq) {
        while self.records.back().is_some_and(|r| r.seq > seq) {
            let r = self.records.pop_back().expect("checked non-empty");
            self.bytes -= r.encoded_len();
        }
    }

    /// Drops every record at or below `unneeded_through`, then the oldest records while over `max_bytes`,
    /// never past `keep_after` (records after it stay whatever their size).
    pub(crate) fn evict(&mut self, unneeded_through: Seq, max_bytes: usize, keep_after: Seq) {
        while self
            .records
            .front()
            .is_some_and(|r| r.seq <= unneeded_through || (self.bytes > max_bytes && r.seq <= keep_after))
        {
            let r = self.records.pop_front().expect("checked non-empty");
            self.bytes -= r.encoded_len();
        }
    }

    /// Records from `from` (which must be cached) up to `max_bytes` (at least one), or `None` if `from` is
    /// not in the cache.
    pub(crate) fn range(&self, from: Seq, max_bytes: usize) -> Option<Vec<Record>> {
        let first = self.first_seq()?;
        if from < first {
            return None;
        }
        let skip = usize::try_from(from.get() - first.get()).ok()?;
        let mut out = Vec::new();
        let mut bytes = 0;
        for record in self.records.iter().skip(skip) {
            bytes += record.encoded_len();
            if !out.is_empty() && bytes > max_bytes {
                break;
            }
            out.push(record.clone());
        }
        Some(out)
    }
}
