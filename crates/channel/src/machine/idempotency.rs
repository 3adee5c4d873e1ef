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

    /// Remembers `record`'s key. A key already known from an earlier record now names this one: a key
    /// appears twice only once its first record was given up (or left the window), and a retry must
    /// find the record that is still there.
    pub(crate) fn insert(&mut self, record: &Record) {
        let Some(key) = &record.idempotency_key else { return };
        if self.window == 0 || self.by_key.get(key).is_some_and(|known| known.seq >= record.seq) {
            return;
        }
        let entry = KeyedRecord { seq: record.seq, payload_crc32: crc32fast::hash(&record.payload) };
        self.by_key.insert(key.clone(), entry);
        self.order.push_back((record.seq, key.clone()));
        while self.order.front().is_some_and(|(seq, _)| seq.get() + self.window <= record.seq.get()) {
            let (seq, old) = self.order.pop_front().expect("checked non-empty");
            self.forget(seq, &old);
        }
    }

    /// Forgets keys of records after `seq` (they were truncated).
    pub(crate) fn truncate_after(&mut self, seq: Seq) {
        while self.order.back().is_some_and(|(s, _)| *s > seq) {
            let (s, key) = self.order.pop_back().expect("checked non-empty");
            self.forget(s, &key);
        }
    }

    /// Forgets keys of records at or below `through`, given up by a retention move: a retry of one
    /// appends it again, on whichever replica leads then (one that kept the key would answer with a
    /// seq no read returns, while another had appended the retry anew — sim seed 206002248).
    pub(crate) fn forget_through(&mut self, through: Seq) {
        while self.order.front().is_some_and(|(s, _)| *s <= through) {
            let (s, key) = self.order.pop_front().expect("checked non-empty");
            self.forget(s, &key);
        }
    }

    /// Drops `key` if it still names the record at `seq` (a later record of the key keeps it).
    fn forget(&mut self, seq: Seq, key: &IdempotencyKey) {
        if self.by_key.get(key).is_some_and(|known| known.seq == seq) {
            self.by_key.remove(key);
        }
    }

    pub(crate) fn get(&self, key: &IdempotencyKey) -> Option<KeyedRecord> {
        self.by_key.get(key).copied()
    }

    pub(crate) fn len(&self) -> usize {
        self.order.len()
    }
}
