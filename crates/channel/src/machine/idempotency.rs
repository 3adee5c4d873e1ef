//! Idempotency keys of the channel's recent records, on every replica, so that a retry — to this leader or
//! to a new one after failover — finds the original seq.

use rustc_hash::FxHashMap;
use std::collections::VecDeque;
use tidings_store::message::{IdempotencyKey, Record};
use tidings_types::Seq;

/// The original append of a key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct KeyedRecord {
    pub(crate) seq: Seq,
    pub(crate) payload_crc32: u32,
}

/// Keys of the records among the last `window` seqs of the local log.
#[derive(Debug, Default)]
pub(crate) struct IdempotencyIndex {
    by_key: FxHashMap<IdempotencyKey, KeyedRecord>,
    order: VecDeque<(Seq, IdempotencyKey)>,
    window: u64,
}

impl IdempotencyIndex {
    pub(crate) fn new(window: usize) -> Self {
        Self { window: window as u64, ..Self::default() }
    }

    pub(crate) fn insert(&mut self, record: &Record) {
        let Some(key) = &record.idempotency_key else { return };
        if self.window == 0 || self.by_key.contains_key(key) {
            return;
        }
        let entry = KeyedRecord { seq: record.seq, payload_crc32: crc32fast::hash(&record.payload) };
        self.by_key.insert(key.clone(), entry);
        self.order.push_back((record.seq, key.clone()));
        while self.order.front().is_some_and(|(seq, _)| seq.get() + self.window <= record.seq.get()) {
            let (_, old) = self.order.pop_front().expect("checked non-empty");
            self.by_key.remove(&old);
        }
    }

    /// Forgets keys of records after `seq` (they were truncated).
    pub(crate) fn truncate_after(&mut self, seq: Seq) {
        while self.order.back().is_some_and(|(s, _)| *s > seq) {
            let (_, key) = self.order.pop_back().expect("checked non-empty");
            self.by_key.remove(&key);
        }
    }

    pub(crate) fn get(&self, key: &IdempotencyKey) -> Option<KeyedRecord> {
        self.by_key.get(key).copied()
    }

    pub(crate) fn len(&self) -> usize {
        self.order.len()
    }
}
