//! The per-channel message log: ordered records per channel, many channels made durable by one sync.
//!
//! Use it the way group commit wants: a durable-append worker [`MessageLog::stage`]s the batches of many
//! channels (each checked against the state it will find: contiguous seqs, leader epochs never going
//! back, no truncation below the high watermark), then calls [`MessageLog::sync`] once; every staged
//! batch becomes durable and visible together, and the worker completes all of them. Suffix truncation,
//! HW checkpoints and retention go through the same ordered path as appends, so a replay can never
//! resurrect a truncated record or lose a truncation.
//!
//! Two implementations share all of that logic: [`JournalLog`] (a journal of CRC-framed segments, one
//! real `fdatasync` per sync, written behind into sled) and [`MemoryLog`] (in memory, with a crash model
//! and failpoints, for the simulator). `JournalLog` holds in memory only the channels in use: a channel
//! released with [`MessageLog::release_caches`] leaves memory once written behind, and its next read,
//! state lookup or staged batch reads it back from sled ([`JournalStats::channels_in_memory`]).
//!
//! ```
//! use bytes::Bytes;
//! use tidings_store::message::{LogBatch, LogOp, MemoryLog, MessageLog, ReadLimits, Record, RecordKind};
//! use tidings_types::{ChannelId, ChannelType, LeaderEpoch, Seq};
//!
//! let log = MemoryLog::new(Default::default());
//! let mut staged = Vec::new();
//! for name in ["room-1", "room-2"] {
//!     let channel = ChannelId::new(ChannelType::GROUP, name).unwrap();
//!     let record = Record {
//!         seq: Seq::new(1),
//!         kind: RecordKind::Message,
//!         leader_epoch: LeaderEpoch::new(1),
//!         idempotency_key: None,
//!         timestamp_ms: 0,
//!         payload: Bytes::from_static(b"hi"),
//!     };
//!     log.stage(LogBatch::new(channel.clone(), vec![LogOp::Append(vec![record])])).unwrap();
//!     staged.push(channel);
//! }
//! log.sync().unwrap(); // one sync makes both channels' appends durable
//! let limits = ReadLimits { records_max: 10, bytes_max: 1 << 20 };
//! for channel in &staged {
//!     assert_eq!(log.read(channel, Seq::new(1), Seq::new(1), limits).unwrap().len(), 1);
//!     assert_eq!(log.state(channel).unwrap().last_seq, Seq::new(1));
//! }
//! ```

mod codec;
mod core;
mod journal;
mod memory;
mod record;
mod staging;
mod state;
pub mod stored;

pub use journal::{JournalConfig, JournalLog, JournalStats, WriteBehindThread};
pub use memory::{LogFailOp, MemoryLog};
pub use record::{IdempotencyKey, Record, RecordKind, IDEMPOTENCY_KEY_BYTES_MAX};
pub use staging::{BatchFate, Staged};
pub use state::{
    end_of_epoch, note_epoch, ChannelLogState, IdempotentHit, LogBatch, LogOp, LogRefusal, ReadLimits,
    ISR_PROPOSALS_MAX,
};

use crate::error::{StoreError, StoreResult};
use tidings_types::{ChannelId, Seq};

/// Limits every message log enforces.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LogLimits {
    /// Most records one batch may append. Default 4,096.
    pub batch_records_max: usize,
    /// Most encoded record bytes one batch may append. Default 4 MiB.
    pub batch_bytes_max: usize,
    /// Idempotency keys are remembered for the last this many seqs of a channel. Default 1,024. Memory: at
    /// most this many keys (≤ 64 bytes each) per channel whose window is loaded.
    pub idempotency_window: usize,
}

impl Default for LogLimits {
    fn default() -> Self {
        Self { batch_records_max: 4096, batch_bytes_max: 4 << 20, idempotency_window: 1024 }
    }
}

/// A durable, ordered log per channel. See the [module docs](self) for the calling pattern.
pub trait MessageLog: Send + Sync {
    /// Checks `batch` against the channel's state after every batch staged before it and stages it. Not
    /// durable or visible until a [`MessageLog::sync`]. A refused batch changes nothing. The receipt tells
    /// later what became of the batch ([`MessageLog::fate`]).
    fn stage(&self, batch: LogBatch) -> StoreResult<Staged>;

    /// Stages `batches` in order, as [`MessageLog::stage`] one by one would, with one outcome each — the
    /// way a group commit fills its group: the journal takes its locks once per run of batches instead
    /// of once per batch.
    fn stage_all(&self, batches: Vec<LogBatch>) -> Vec<StoreResult<Staged>> {
        batches.into_iter().map(|batch| self.stage(batch)).collect()
    }

    /// Makes every batch staged before the call durable, then visible (syncs of several threads may
    /// overlap: one applies its group while the next one's `fdatasync` runs). Returns how many batches this
    /// call's group held. On error, every batch not yet durable failed and none of them is visible or will
    /// reappear after a restart. With one thread staging and syncing, `Ok` means all its batches are
    /// durable; with several, a thread asks [`MessageLog::fate`] of its receipts, since another thread's
    /// failed write drops every batch not yet durable.
    fn sync(&self) -> StoreResult<usize>;

    /// What became of the batch `receipt` was given for. Ask after a `sync` returned: `Pending` before (or
    /// for a receipt older than the last 1,024 failed writes: treat it as failed).
    fn fate(&self, receipt: Staged) -> BatchFate;

    /// Stages `batch` and syncs; `Ok` once it is durable.
    fn commit(&self, batch: LogBatch) -> StoreResult<()> {
        let receipt = self.stage(batch)?;
        let synced = self.sync();
        match self.fate(receipt) {
            BatchFate::Durable => Ok(()),
            BatchFate::Dropped | BatchFate::Pending => Err(synced.err().unwrap_or(StoreError::Dropped)),
        }
    }

    /// Records of `channel` in `[from, through]`, clamped to the readable range (after the retention
    /// boundary, up to the last seq), within `limits` (at least one record when any is in range).
    fn read(&self, channel: &ChannelId, from: Seq, through: Seq, limits: ReadLimits) -> StoreResult<Vec<Record>>;

    /// Durable state of `channel`: last seq and epoch, epoch history, checkpointed HW, retention.
    fn state(&self, channel: &ChannelId) -> StoreResult<ChannelLogState>;

    /// The record appended with `key` among the channel's last [`LogLimits::idempotency_window`] seqs.
    fn idempotent(&self, channel: &ChannelId, key: &IdempotencyKey) -> StoreResult<Option<IdempotentHit>>;

    /// Drops what is held in memory for `channel` (when its replica is evicted): its caches at once and,
    /// in a log that writes behind, everything else once written behind (the next use reads it back).
    /// Durable data is unaffected.
    fn release_caches(&self, channel: &ChannelId);

    /// Up to `limit` channels this log holds a log of, in key order after `after` (from the first with
    /// `None`): what a sweep over a node's logs pages through. A log that keeps older storage lists what
    /// that holds, so a channel first written since the last write-behind may be missing, and one
    /// forgotten since ([`LogOp::Forget`]) may still be listed; a later pass sees the change.
    fn logs_after(&self, after: Option<&ChannelId>, limit: usize) -> StoreResult<Vec<ChannelId>>;

    /// Waits up to `patience` for memory to stage into (a [`StoreError::Busy`] from `stage` means records
    /// wait for write-behind); `Err(Busy)` if there is still none. A background stager calls this before
    /// staging so that backpressure delays its batches instead of failing them. Default: always room.
    fn wait_for_room(&self, patience: std::time::Duration) -> StoreResult<()> {
        let _ = patience;
        Ok(())
    }
}

impl<T: MessageLog + ?Sized> MessageLog for std::sync::Arc<T> {
    fn stage(&self, batch: LogBatch) -> StoreResult<Staged> {
        (**self).stage(batch)
    }

    fn stage_all(&self, batches: Vec<LogBatch>) -> Vec<StoreResult<Staged>> {
        (**self).stage_all(batches)
    }

    fn sync(&self) -> StoreResult<usize> {
        (**self).sync()
    }

    fn fate(&self, receipt: Staged) -> BatchFate {
        (**self).fate(receipt)
    }

    fn read(&self, channel: &ChannelId, from: Seq, through: Seq, limits: ReadLimits) -> StoreResult<Vec<Record>> {
        (**self).read(channel, from, through, limits)
    }

    fn state(&self, channel: &ChannelId) -> StoreResult<ChannelLogState> {
        (**self).state(channel)
    }

    fn idempotent(&self, channel: &ChannelId, key: &IdempotencyKey) -> StoreResult<Option<IdempotentHit>> {
        (**self).idempotent(channel, key)
    }

    fn release_caches(&self, channel: &ChannelId) {
        (**self).release_caches(channel)
    }

    fn logs_after(&self, after: Option<&ChannelId>, limit: usize) -> StoreResult<Vec<ChannelId>> {
        (**self).logs_after(after, limit)
    }

    fn wait_for_room(&self, patience: std::time::Duration) -> StoreResult<()> {
        (**self).wait_for_room(patience)
    }
}

/// Tests: a batch appending records `from..from + count` to `channel` (epoch 1, no idempotency key).
#[cfg(test)]
pub(crate) fn test_append(channel: &ChannelId, from: u64, count: u64) -> LogBatch {
    let records = (from..from + count)
        .map(|seq| Record {
            seq: Seq::new(seq),
            kind: RecordKind::Message,
            leader_epoch: tidings_types::LeaderEpoch::new(1),
            idempotency_key: None,
            timestamp_ms: 0,
            payload: bytes::Bytes::from_static(b"payload"),
        })
        .collect();
    LogBatch::new(channel.clone(), vec![LogOp::Append(records)])
}
