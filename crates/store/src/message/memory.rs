//! [`MessageLog`] in memory, with a crash model and failpoints, for the simulator and tests.

use super::core::LogCore;
use super::record::{IdempotencyKey, Record};
use super::staging::{BatchFate, Staged, Staging};
use super::state::{ChannelLogState, IdempotentHit, LogBatch, ReadLimits};
use super::{LogLimits, MessageLog};
use crate::error::StoreResult;
use crate::failpoint::Failpoints;
use parking_lot::Mutex;
use tidings_types::{ChannelId, Seq};

/// An operation a [`MemoryLog`] failpoint can make fail.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum LogFailOp {
    /// [`MessageLog::stage`]: the batch is refused with an IO error.
    Stage,
    /// [`MessageLog::sync`]: every staged batch fails.
    Sync,
    /// [`MessageLog::read`].
    Read,
}

/// A [`MessageLog`] in memory.
///
/// Crash model: [`MemoryLog::crash`] forgets every batch staged since the last successful sync (as a
/// power loss forgets writes never fsynced) and every cache; everything synced survives.
pub struct MemoryLog {
    core: Mutex<Parts>,
    failpoints: Mutex<Failpoints<LogFailOp>>,
}

/// Staging and visible state under one lock: a sync applies its group before it returns.
struct Parts {
    staging: Staging<()>,
    visible: LogCore,
}

impl MemoryLog {
    /// An empty log with `limits`.
    pub fn new(limits: LogLimits) -> Self {
        let parts = Parts { staging: Staging::new(limits), visible: LogCore::new(limits) };
        Self { core: Mutex::new(parts), failpoints: Mutex::new(Failpoints::default()) }
    }

    /// Forgets every unsynced batch and every cache.
    pub fn crash(&self) {
        let mut parts = self.core.lock();
        parts.staging.drop_unsynced();
        parts.visible.release_all_caches();
    }

    /// Lets the next `after` calls of `op` succeed, then fails the following `times` calls.
    pub fn fail(&self, op: LogFailOp, after: u64, times: u64) {
        self.failpoints.lock().arm(op, after, times);
    }

    /// Removes every failpoint.
    pub fn clear_failpoints(&self) {
        self.failpoints.lock().clear();
    }
}

impl MessageLog for MemoryLog {
    fn stage(&self, batch: LogBatch) -> StoreResult<Staged> {
        self.failpoints.lock().check(&LogFailOp::Stage, "stage")?;
        let mut parts = self.core.lock();
        let Parts { staging, visible } = &mut *parts;
        if staging.tails_stale() {
            // Nothing durable waits to be applied here: each sync applied its group before returning.
            staging.refresh_tails();
        }
        let entry = staging.check(&batch, |channel| Ok(visible.durable_tail(channel)))?;
        Ok(staging.push(entry, batch))
    }

    fn sync(&self) -> StoreResult<usize> {
        let mut parts = self.core.lock();
        if let Err(error) = self.failpoints.lock().check(&LogFailOp::Sync, "sync") {
            parts.staging.drop_unsynced();
            return Err(error);
        }
        let (ticket, count) = parts.staging.begin_sync();
        let marked = parts.staging.mark_durable(ticket, ());
        debug_assert!(marked, "nothing dropped it: the log was locked throughout");
        let groups = parts.staging.take_durable();
        parts.visible.apply_groups(groups);
        Ok(count)
    }

    fn fate(&self, receipt: Staged) -> BatchFate {
        self.core.lock().staging.fate(receipt)
    }

    fn read(&self, channel: &ChannelId, from: Seq, through: Seq, limits: ReadLimits) -> StoreResult<Vec<Record>> {
        self.failpoints.lock().check(&LogFailOp::Read, "read")?;
        // Everything readable is in the memory table: nothing is older.
        self.core.lock().visible.read(channel, from, through, limits, |_, _, _, _| Ok(()))
    }

    fn state(&self, channel: &ChannelId) -> StoreResult<ChannelLogState> {
        Ok(self.core.lock().visible.state(channel))
    }

    fn idempotent(&self, channel: &ChannelId, key: &IdempotencyKey) -> StoreResult<Option<IdempotentHit>> {
        let limits = ReadLimits { records_max: usize::MAX, bytes_max: usize::MAX };
        self.core.lock().visible.idempotency(channel, key, |core, from, through| {
            core.read(channel, from, through, limits, |_, _, _, _| Ok(()))
        })
    }

    fn logs_after(&self, after: Option<&ChannelId>, limit: usize) -> StoreResult<Vec<ChannelId>> {
        Ok(self.core.lock().visible.logs_after(after, limit))
    }

    fn release_caches(&self, channel: &ChannelId) {
        let mut parts = self.core.lock();
        parts.staging.forget_tail(channel);
        parts.visible.release(channel);
    }
}
