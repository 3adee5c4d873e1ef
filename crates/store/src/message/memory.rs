//! [`MessageLog`] in memory, with a crash model and failpoints, for the simulator and tests.

use super::core::LogCore;
use super::record::{IdempotencyKey, Record};
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
    core: Mutex<LogCore>,
    failpoints: Mutex<Failpoints<LogFailOp>>,
}

impl MemoryLog {
    /// An empty log with `limits`.
    pub fn new(limits: LogLimits) -> Self {
        Self { core: Mutex::new(LogCore::new(limits)), failpoints: Mutex::new(Failpoints::default()) }
    }

    /// Forgets every unsynced batch and every cache.
    pub fn crash(&self) {
        let mut core = self.core.lock();
        core.drop_unsynced();
        let channels: Vec<ChannelId> = core.channels.keys().cloned().collect();
        for channel in &channels {
            core.release_caches(channel);
        }
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
    fn stage(&self, batch: LogBatch) -> StoreResult<()> {
        self.failpoints.lock().check(LogFailOp::Stage, "stage")?;
        self.core.lock().stage(batch)
    }

    fn sync(&self) -> StoreResult<usize> {
        let mut core = self.core.lock();
        if let Err(error) = self.failpoints.lock().check(LogFailOp::Sync, "sync") {
            core.drop_unsynced();
            return Err(error);
        }
        let (epoch, _) = core.begin_sync();
        Ok(core.finish_sync(epoch).expect("nothing dropped it: the core was locked throughout"))
    }

    fn read(&self, channel: &ChannelId, from: Seq, through: Seq, limits: ReadLimits) -> StoreResult<Vec<Record>> {
        self.failpoints.lock().check(LogFailOp::Read, "read")?;
        // Everything readable is in the memory table: nothing is older.
        self.core.lock().read(channel, from, through, limits, |_, _, _, _| Ok(()))
    }

    fn state(&self, channel: &ChannelId) -> StoreResult<ChannelLogState> {
        Ok(self.core.lock().state(channel))
    }

    fn idempotent(&self, channel: &ChannelId, key: &IdempotencyKey) -> StoreResult<Option<IdempotentHit>> {
        let limits = ReadLimits { records_max: usize::MAX, bytes_max: usize::MAX };
        self.core.lock().idempotency(channel, key, |core, from, through| {
            core.read(channel, from, through, limits, |_, _, _, _| Ok(()))
        })
    }

    fn release_caches(&self, channel: &ChannelId) {
        self.core.lock().release_caches(channel);
    }
}
