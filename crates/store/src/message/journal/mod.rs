//! [`MessageLog`] as a group-committed journal in front of sled.
//!
//! Appends of many channels are framed into one journal ([`segment`]) and made durable by ONE real
//! `fdatasync` per [`MessageLog::sync`] — the ack point. Durable records then sit in per-channel memory
//! tables and are written behind into sled, packed per channel (key = channel + first seq of the pack),
//! together with each channel's state and the journal checkpoint in the same sled batch, followed by a
//! real fsync of sled's files; journal segments before the checkpoint are then deleted. Recovery opens
//! sled and replays the journal after the checkpoint. Reads look at the memory table, then sled.
//!
//! Memory is bounded: past [`JournalConfig::mem_bytes_max`] of records waiting for write-behind, staging
//! waits up to [`JournalConfig::busy_wait`] for write-behind to drain them, then returns
//! [`StoreError::Busy`]. Nothing is dropped.

mod packs;
mod segment;
mod write_behind;

pub use write_behind::WriteBehindThread;

use super::codec::{decode_batch, decode_state, encode_batch, encoded_batch_len_max};
use super::core::LogCore;
use super::record::{IdempotencyKey, Record};
use super::staging::{BatchFate, Staged, StagedBatch, Staging};
use super::state::{ChannelLogState, IdempotentHit, LogBatch, LogRefusal, ReadLimits};
use super::{LogLimits, MessageLog};
use crate::error::{CorruptLocation, StoreError, StoreResult};
use crate::kv::{Direction, KeyRange, Keyspace, Kv, KvBatch};
use crate::latency::{LatencyHistogram, LatencyRecorder};
use parking_lot::{Condvar, Mutex, MutexGuard};
use segment::{Journal, Position};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tidings_types::{ChannelId, Seq};

/// Configuration of a [`JournalLog`].
#[derive(Clone, Debug)]
pub struct JournalConfig {
    /// Size of a journal segment file, preallocated. Default 64 MiB; at least twice the largest batch.
    pub segment_bytes: u64,
    /// Most record bytes held in memory waiting for write-behind. Default 256 MiB.
    pub mem_bytes_max: usize,
    /// The background write-behind runs once this many record bytes wait. Default 64 MiB: larger rounds
    /// pack more records per channel into each sled value.
    pub write_behind_bytes: usize,
    /// The background write-behind also runs at least this often, to keep the journal short. Default 1 s.
    pub write_behind_interval: Duration,
    /// How long staging waits for memory before [`StoreError::Busy`]. Default 1 s.
    pub busy_wait: Duration,
    /// Largest pack of one channel's records stored as one sled value. Default 8 KiB. sled stores any page
    /// over a quarter of its 512 KiB segment as a separate blob file (a file created, written and fsynced
    /// per page write), and a leaf holds up to 16 keys before it splits: with 64 KiB packs a sustained
    /// run at 10,000 channels created about 2,400 blob files, with 8 KiB about 10, at the same rate.
    pub pack_bytes_max: usize,
    /// Most channels in one sled batch of a write-behind round. Default 256. A round goes to sled in
    /// several batches: sled applies a batch under a lock that every other sled operation of the
    /// process waits for (the raft logs and metadata included), so one batch of a whole round (10,000
    /// channels, or tens of MiB) stalled them for its full duration.
    pub write_behind_batch_channels: usize,
    /// A sled batch of write-behind is cut once it holds this many bytes of packs. Default 1 MiB. The
    /// cut falls between two packs, so one busy channel's packs may span batches (its state goes with
    /// the last) — except a channel whose stale packs are cleared first (after a truncation or a failed
    /// round): its clean-up, packs and state go in one batch, since the stored state may rely on what
    /// the clean-up removes.
    pub write_behind_batch_bytes: usize,
    /// After each sled batch of a round, write-behind writes it out ([`Kv::write_out`]) and rests for this
    /// percentage of the time the batch took. Default 100. sled applies a batch under a process-wide lock,
    /// and its reads take that lock once per item read: without rests, a metadata scan on another thread
    /// waited for one whole batch per item (seen: one controller step of 256 metas taking 1.1 s during a
    /// round, long enough for peers to think the node was down). No rests while half of `mem_bytes_max`
    /// or more waits: then the backlog matters more. 0: never rest.
    pub write_behind_rest_percent: u32,
    /// Least time between the starts of two syncs. Default zero: a sync starts as soon as the one
    /// before it ended and anything is staged, which gives the lowest commit latency and, at moderate
    /// load, many small syncs (each costs tens of µs of CPU in the kernel and the syncing thread).
    /// A few hundred µs to a millisecond trades up to that much commit latency (per sync on the commit
    /// path: a leader's and a follower's) for fewer, larger syncs — PostgreSQL's `commit_delay`.
    /// `examples/bench --quick --channels 10000` at half rate, two runs each of 0 / 0.5 / 1 ms: syncs
    /// 4.2–7.4 / 2.8–3.2 / 1.9–2.1 k/s for the three nodes, CPU per message 71–73 / 64–70 / 60–67 µs,
    /// commit latency within that machine's run-to-run noise.
    pub sync_interval_min: Duration,
    /// Nice value the background write-behind thread runs at (Linux; elsewhere ignored). Default 10:
    /// write-behind is deferred work, and its bursts (a round every `write_behind_interval`, sled busy
    /// on a core meanwhile) should not take the CPU from the threads that commit messages. Should it
    /// fall behind, the memory table fills and appends wait (bounded), nothing is lost. 0 keeps the
    /// priority of the thread that started it.
    pub write_behind_nice: i32,
    /// Batch and idempotency limits.
    pub limits: LogLimits,
}

impl Default for JournalConfig {
    fn default() -> Self {
        Self {
            segment_bytes: 64 << 20,
            mem_bytes_max: 256 << 20,
            write_behind_bytes: 64 << 20,
            write_behind_interval: Duration::from_secs(1),
            busy_wait: Duration::from_secs(1),
            pack_bytes_max: 8 << 10,
            write_behind_batch_channels: 256,
            write_behind_batch_bytes: 1 << 20,
            write_behind_rest_percent: 100,
            write_behind_nice: 10,
            sync_interval_min: Duration::ZERO,
            limits: LogLimits::default(),
        }
    }
}

impl JournalConfig {
    fn validate(&self) -> StoreResult<()> {
        let largest_frame = self.limits.batch_bytes_max as u64 * 2 + 4096;
        if self.segment_bytes < largest_frame {
            return Err(StoreError::BadConfig { what: "segment_bytes must exceed twice batch_bytes_max" });
        }
        if self.write_behind_bytes > self.mem_bytes_max || self.mem_bytes_max < self.limits.batch_bytes_max {
            return Err(StoreError::BadConfig {
                what: "need batch_bytes_max <= mem_bytes_max and write_behind_bytes <= mem_bytes_max",
            });
        }
        if self.pack_bytes_max == 0 || self.write_behind_batch_channels == 0 || self.write_behind_batch_bytes == 0 {
            return Err(StoreError::BadConfig {
                what: "pack_bytes_max and the write-behind batch limits must be positive",
            });
        }
        Ok(())
    }
}

/// Counters of a [`JournalLog`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct JournalStats {
    /// Journal syncs (one `fdatasync` each) that made batches durable.
    pub syncs: u64,
    /// How long those syncs took: the write of the frames still buffered and the `fdatasync`. Under
    /// load this, not the disk's figure alone, bounds commit latency (see [`LatencyHistogram`]). Counts
    /// at least `syncs` (a sync finishing while the stats are read may count here and not there).
    pub sync_latency: LatencyHistogram,
    /// Frames (batches) written to the journal.
    pub frames: u64,
    /// Write-behind rounds that reached sled (each one sled batch + fsync).
    pub write_behinds: u64,
    /// Records written behind into sled.
    pub records_written_behind: u64,
    /// Journal segments deleted after a checkpoint (or kept as spares).
    pub segments_deleted: u64,
    /// Spare segments zero-filled ahead of need ([`JournalLog::fill_spares`]).
    pub spares_filled: u64,
    /// Record bytes waiting in memory for write-behind now.
    pub mem_bytes: usize,
    /// Journal segment files on disk now.
    pub segments: usize,
    /// Channels whose entry (state, memory table) is in memory now. An entry leaves once its channel was
    /// released ([`MessageLog::release_caches`]) and everything it holds is written behind.
    pub channels_in_memory: usize,
    /// Entries that left memory that way.
    pub channels_dropped: u64,
}

struct Visible {
    core: LogCore,
    /// Journal position after the last frame applied to `core`.
    applied: Position,
}

/// The journal + sled message log: segments of CRC-framed batches made durable with one `fdatasync` per
/// sync, written behind into sled (see the [`message`](crate::message) module docs).
pub struct JournalLog {
    kv: Arc<dyn Kv>,
    /// This opening's number (see `OPENINGS_KEY`).
    opening: u64,
    config: JournalConfig,
    /// Lock order: `sync_lock`, then `journal`, then `staging`, then `visible`.
    journal: Mutex<Journal>,
    /// Batches staged and in flight; a group is applied to `visible` without this lock, so staging goes on.
    staging: Mutex<Staging<Position>>,
    visible: Mutex<Visible>,
    /// Serializes the writes and fdatasyncs of syncs (each runs them outside `journal`) and keeps rollbacks
    /// from running under them; a sync applies its group after releasing it, so the next one's write and
    /// fdatasync overlap that work. Holds when the last sync started (`sync_interval_min`).
    sync_lock: Mutex<Option<Instant>>,
    /// One write-behind at a time; holds the last checkpoint persisted to sled.
    write_behind: Mutex<Position>,
    mem_freed: Condvar,
    write_behind_wanted: Condvar,
    background: AtomicBool,
    stop: AtomicBool,
    unusable: AtomicBool,
    /// `visible.core.mem_bytes`, for stagers to check without waiting for `visible`.
    mem_bytes: AtomicUsize,
    syncs: AtomicU64,
    sync_latency: LatencyRecorder,
    frames: AtomicU64,
    write_behinds: AtomicU64,
    records_written_behind: AtomicU64,
    segments_deleted: AtomicU64,
    spares_filled: AtomicU64,
    channels_dropped: AtomicU64,
    /// One spare zero-filled at a time.
    filling_spares: Mutex<()>,
}

const CHECKPOINT_KEY: &[u8] = b"checkpoint";
/// Most batches [`MessageLog::stage_all`] stages under one hold of the journal's locks (a sync waits for
/// the run to end before it takes the group).
const STAGE_RUN: usize = 256;

/// Why a batch was not staged.
enum StageFailure {
    /// Refused by the log's rules or limits; nothing was written.
    Refused(StoreError),
    /// Framing it into the journal failed: what is not yet synced must be rolled back.
    Append(StoreError),
}
/// The layout of journal frames and sled packs this build writes and reads (2: compact records, pack
/// bodies keyed by write-behind round; 3: channel states stamped with their opening). A store in
/// another layout is refused at open, never misread.
const FORMAT: u32 = 3;
/// The previous layout, which this build reads: format 3 only adds the opening to channel states.
const FORMAT_READ_TOO: u32 = 2;
/// How many times the log was opened (`u64`, little endian): each opening stamps the channel states it
/// writes, so that a state read back in the opening that wrote it is known to have no stale packs.
const OPENINGS_KEY: &[u8] = b"openings";
const FORMAT_KEY: &[u8] = b"format";
const SCAN_PAGE: usize = 64;
/// Most released entries [`JournalLog::drop_released_entries`] looks at under one hold of the locks.
const DROP_RUN: usize = 4096;
/// Packs a read looks at first, from its end backwards (see `JournalLog::read_older`).
const TAIL_PACKS: usize = 4;

impl JournalLog {
    /// Opens the log: the journal in `dir`, older records and the checkpoint in `kv`. Replays the journal
    /// after the checkpoint.
    pub fn open(dir: impl AsRef<Path>, kv: Arc<dyn Kv>, config: JournalConfig) -> StoreResult<JournalLog> {
        config.validate()?;
        check_format(kv.as_ref(), dir.as_ref())?;
        let opening = count_opening(kv.as_ref())?;
        let checkpoint = match kv.get(Keyspace::Journal, CHECKPOINT_KEY)? {
            None => Position::ORIGIN,
            Some(bytes) => Position::decode(&bytes).ok_or_else(|| StoreError::Corrupt {
                location: CorruptLocation::Kv { keyspace: Keyspace::Journal, key: CHECKPOINT_KEY.to_vec() },
                detail: "journal checkpoint does not decode",
            })?,
        };
        // Entries are loaded as the replay meets their channels, not all at open: a node that wrote a
        // million channels opens in the time its journal takes, and keeps in memory only those it uses.
        let mut core = LogCore::backed(config.limits);
        // Channels whose stored state is ahead of the checkpoint, with the frame it includes everything before.
        let mut ahead = rustc_hash::FxHashMap::default();
        let journal = Journal::open(dir.as_ref(), config.segment_bytes, checkpoint, |pos, body| {
            let corrupt = |detail| StoreError::Corrupt {
                location: CorruptLocation::Journal { segment: pos.segment, offset: pos.offset },
                detail,
            };
            let batch = decode_batch(body).ok_or(corrupt("journal frame does not decode"))?;
            if !core.contains(&batch.channel) {
                if let Some(frames_before) = load_entry(kv.as_ref(), &mut core, &batch.channel, opening)? {
                    if frames_before > checkpoint.next_frame {
                        ahead.insert(batch.channel.clone(), frames_before);
                    }
                }
            }
            // A channel written by a round that stopped before its checkpoint already holds this frame.
            if ahead.get(&batch.channel).is_some_and(|before| pos.next_frame < *before) {
                return Ok(());
            }
            let channel = batch.channel.clone();
            core.apply_durable(batch).map_err(|_| corrupt("journal frame does not apply to the log"))?;
            // No replica uses it yet: it leaves memory once written behind, unless one stages to it.
            core.release(&channel);
            Ok(())
        })?;
        let applied = journal.position();
        let mem_bytes = core.mem_bytes;
        Ok(JournalLog {
            kv,
            opening,
            staging: Mutex::new(Staging::new(config.limits)),
            config,
            journal: Mutex::new(journal),
            visible: Mutex::new(Visible { core, applied }),
            sync_lock: Mutex::new(None),
            write_behind: Mutex::new(checkpoint),
            mem_freed: Condvar::new(),
            write_behind_wanted: Condvar::new(),
            background: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            unusable: AtomicBool::new(false),
            mem_bytes: AtomicUsize::new(mem_bytes),
            syncs: AtomicU64::new(0),
            sync_latency: LatencyRecorder::default(),
            frames: AtomicU64::new(0),
            write_behinds: AtomicU64::new(0),
            records_written_behind: AtomicU64::new(0),
            segments_deleted: AtomicU64::new(0),
            spares_filled: AtomicU64::new(0),
            channels_dropped: AtomicU64::new(0),
            filling_spares: Mutex::new(()),
        })
    }

    /// Counters and gauges.
    pub fn stats(&self) -> JournalStats {
        JournalStats {
            syncs: self.syncs.load(Ordering::Acquire),
            sync_latency: self.sync_latency.snapshot(),
            frames: self.frames.load(Ordering::Relaxed),
            write_behinds: self.write_behinds.load(Ordering::Relaxed),
            records_written_behind: self.records_written_behind.load(Ordering::Relaxed),
            segments_deleted: self.segments_deleted.load(Ordering::Relaxed),
            spares_filled: self.spares_filled.load(Ordering::Relaxed),
            mem_bytes: self.mem_bytes.load(Ordering::Relaxed),
            segments: self.journal.lock().segment_count(),
            channels_in_memory: self.visible.lock().core.resident(),
            channels_dropped: self.channels_dropped.load(Ordering::Relaxed),
        }
    }

    /// Zero-fills spare journal segments until the journal holds its two spares; returns how many it
    /// made. The next segment rolls then take a spare: syncs write over blocks already written, which
    /// costs the disk less than writing into fresh, preallocated ones (store_bench's journal at 10,000
    /// channels: 1.67–1.70 M records/s with spares against 1.30–1.43 M without), and a roll never waits
    /// for a segment to be created. A journal that has not written a frame since it was created also
    /// swaps its first segment for a spare.
    ///
    /// ```no_run
    /// # use std::sync::Arc;
    /// # use tidings_store::message::{JournalConfig, JournalLog};
    /// # use tidings_store::{Kv, MemoryKv};
    /// let kv: Arc<dyn Kv> = Arc::new(MemoryKv::new());
    /// let log = JournalLog::open("/var/lib/host/journal", kv, JournalConfig::default())?;
    /// let made = log.fill_spares()?; // before load arrives: 64 MiB of zeros per spare
    /// assert_eq!(log.stats().spares_filled, made as u64);
    /// # Ok::<(), tidings_store::StoreError>(())
    /// ```
    ///
    /// Write-behind recycles checkpointed segments as spares, so a journal under steady load has them
    /// anyway; this is for the start (a host may call it before load arrives) and for benchmarks. It is
    /// not called in the background: filling spares while the node served load delayed the write-behind
    /// thread and competed with the journal's syncs (bench, 100 channels at half rate: p99 2.2 s against
    /// 15 ms without). Writes `segment_bytes` (64 MiB) per spare, in 1 MiB pieces each made durable,
    /// without holding the journal's lock.
    pub fn fill_spares(&self) -> StoreResult<usize> {
        let _one_at_a_time = self.filling_spares.lock();
        let mut made = 0;
        loop {
            let (missing, (dir, capacity)) = {
                let mut journal = self.journal.lock();
                if journal.spares_missing() == 0 && journal.start_in_a_spare()? {
                    // A new journal's first segment was preallocated, not written: one spare replaced it.
                    continue;
                }
                (journal.spares_missing(), journal.spare_shape())
            };
            if missing == 0 || self.stop.load(Ordering::SeqCst) {
                return Ok(made);
            }
            let Some(spare) = segment::zero_filled_spare(&dir, capacity, || !self.stop.load(Ordering::SeqCst))? else {
                return Ok(made);
            };
            self.journal.lock().add_spare(spare)?;
            self.spares_filled.fetch_add(1, Ordering::Relaxed);
            made += 1;
        }
    }

    /// Waits (bounded) until the memory table has room, running write-behind inline if no background
    /// thread does it.
    fn wait_for_memory(&self) -> StoreResult<()> {
        self.wait_for_memory_up_to(self.config.busy_wait)
    }

    #[allow(clippy::disallowed_methods)] // An adapter, not a core: a bounded wait needs the clock.
    fn wait_for_memory_up_to(&self, patience: Duration) -> StoreResult<()> {
        let limit = self.config.mem_bytes_max;
        // Without `visible`, which a sync holds while it applies a group: the mirror lags by at most the
        // group being applied, so memory stays bounded by the limit plus one group.
        if self.mem_bytes.load(Ordering::Relaxed) < limit {
            return Ok(());
        }
        if !self.background.load(Ordering::SeqCst) {
            self.write_behind()?;
        }
        let deadline = Instant::now() + patience;
        let mut visible = self.visible.lock();
        while visible.core.mem_bytes >= limit {
            self.write_behind_wanted.notify_one();
            let now = Instant::now();
            if now >= deadline {
                return Err(StoreError::Busy { bytes: visible.core.mem_bytes, limit });
            }
            self.mem_freed.wait_for(&mut visible, deadline - now);
        }
        Ok(())
    }

    /// Fails every batch staged since the last sync: rolls the journal back and drops them. The caller holds
    /// `sync_lock` (no sync job is writing).
    fn fail_staged(&self, journal: &mut Journal) {
        if let Err(error) = journal.rollback() {
            tracing::error!(%error, "journal rollback failed; the message log is unusable until reopened");
            self.unusable.store(true, Ordering::SeqCst);
        }
        self.staging.lock().drop_unsynced();
    }

    /// Applies the durable groups at the front of `staging`, in order, and returns once every group made
    /// durable before the call is visible (another thread may be applying some of them: taking `visible`
    /// before releasing `staging` keeps appliers in order, and waiting for `visible` waits for them).
    fn apply_durable(&self, mut staging: MutexGuard<'_, Staging<Position>>) {
        let groups = staging.take_durable();
        let mut visible = self.visible.lock();
        drop(staging);
        self.apply_groups(&mut visible, groups);
    }

    fn apply_groups(&self, visible: &mut Visible, groups: Vec<(Vec<StagedBatch>, Position)>) {
        if let Some(position) = visible.core.apply_groups(groups) {
            visible.applied = position;
        }
        self.mem_bytes.store(visible.core.mem_bytes, Ordering::Relaxed);
        if visible.core.mem_bytes >= self.config.write_behind_bytes {
            self.write_behind_wanted.notify_one();
        }
    }

    /// Checks and stages one batch under the journal and staging locks; a refusal writes nothing, then
    /// the batch is framed straight into the journal's buffer.
    fn stage_locked(
        &self,
        journal: &mut Journal,
        staging: &mut Staging<Position>,
        batch: LogBatch,
    ) -> Result<Staged, StageFailure> {
        let body_len = encoded_batch_len_max(&batch);
        if body_len as u64 > journal.body_bytes_max() {
            let records = batch.records().count();
            let limits = self.config.limits;
            let refusal = LogRefusal::BatchTooLarge {
                records,
                bytes: body_len,
                records_max: limits.batch_records_max,
                bytes_max: limits.batch_bytes_max,
            };
            return Err(StageFailure::Refused(refusal.into()));
        }
        if staging.tails_stale() {
            // Batches were dropped: tails start again from the visible state, once every durable group is in.
            let groups = staging.take_durable();
            self.apply_groups(&mut self.visible.lock(), groups);
            staging.refresh_tails();
        }
        let entry = staging
            .check(&batch, |channel| {
                let mut visible = self.visible.lock();
                self.load_if_cold(&mut visible.core, channel)?;
                Ok(visible.core.durable_tail(channel))
            })
            .map_err(StageFailure::Refused)?;
        journal.append_encoded(body_len, |out| encode_batch(&batch, out)).map_err(StageFailure::Append)?;
        self.frames.fetch_add(1, Ordering::Relaxed);
        Ok(staging.push(entry, batch))
    }

    /// Puts `channel`'s entry back in memory from sled if it left (a channel never written has none
    /// there either, and gets an empty one when first staged to).
    fn load_if_cold(&self, core: &mut LogCore, channel: &ChannelId) -> StoreResult<()> {
        if !core.contains(channel) {
            load_entry(self.kv.as_ref(), core, channel, self.opening)?;
        }
        Ok(())
    }

    /// Takes the entries of released channels that are written behind out of memory, a bounded number
    /// per hold of the locks (staging waits meanwhile); one pass over the channels listed at the start.
    fn drop_released_entries(&self) {
        let mut left = self.visible.lock().core.released_listed();
        while left > 0 {
            // Staging before visible (the lock order). A channel without a tail has no batch on its way
            // (see `Staging::forget_tail`), unless tails are stale: then durable batches may still wait to
            // be applied, and nothing is dropped until staging has caught up.
            let mut staging = self.staging.lock();
            if staging.tails_stale() {
                return;
            }
            let mut visible = self.visible.lock();
            let (dropped, looked_at) =
                visible.core.drop_released(DROP_RUN.min(left), |channel| staging.forget_tail(channel));
            self.channels_dropped.fetch_add(dropped as u64, Ordering::Relaxed);
            if looked_at == 0 {
                return;
            }
            left -= looked_at;
        }
    }

    fn check_usable(&self) -> StoreResult<()> {
        if self.unusable.load(Ordering::SeqCst) {
            return Err(StoreError::Unusable);
        }
        Ok(())
    }
}

impl MessageLog for JournalLog {
    fn stage(&self, batch: LogBatch) -> StoreResult<Staged> {
        self.stage_all(vec![batch]).pop().unwrap_or(Err(StoreError::Dropped))
    }

    fn stage_all(&self, batches: Vec<LogBatch>) -> Vec<StoreResult<Staged>> {
        let mut outcomes = Vec::with_capacity(batches.len());
        let mut batches = batches.into_iter().peekable();
        while batches.peek().is_some() {
            if let Err(error) = self.check_usable().and_then(|()| self.wait_for_memory()) {
                // That batch fails, as `stage` alone would have; the next one waits again.
                batches.next();
                outcomes.push(Err(error));
                continue;
            }
            // Both locks for a run of batches, not for each: a sync waits for the run, so runs are short.
            let mut journal = self.journal.lock();
            let mut staging = self.staging.lock();
            for batch in batches.by_ref().take(STAGE_RUN) {
                match self.stage_locked(&mut journal, &mut staging, batch) {
                    Ok(receipt) => outcomes.push(Ok(receipt)),
                    Err(StageFailure::Refused(error)) => outcomes.push(Err(error)),
                    Err(StageFailure::Append(error)) => {
                        // The rollback must wait for a sync job writing outside the journal's lock (see
                        // `SyncJob`), and `sync_lock` comes before `journal`: mark it due, so that no sync
                        // makes the failed frame durable meanwhile, and carry it out once both locks are held.
                        journal.mark_rollback_due();
                        drop(staging);
                        drop(journal);
                        let _no_sync = self.sync_lock.lock();
                        let mut journal = self.journal.lock();
                        if journal.rollback_due() {
                            self.fail_staged(&mut journal);
                        }
                        outcomes.push(Err(error));
                        break;
                    }
                }
            }
        }
        outcomes
    }

    #[allow(clippy::disallowed_methods)] // An adapter, not a core: it times its own fdatasyncs for the stats.
    fn sync(&self) -> StoreResult<usize> {
        self.check_usable()?;
        let (staging, count) = {
            // One write and fdatasync at a time; stagers keep framing the next group while it runs.
            let mut last_sync = self.sync_lock.lock();
            let since_last = last_sync.map_or(Duration::MAX, |at| at.elapsed());
            if let Some(wait) = self.config.sync_interval_min.checked_sub(since_last).filter(|w| !w.is_zero()) {
                // Stagers go on meanwhile: the wait grows this sync's group.
                std::thread::sleep(wait);
            }
            let mut journal = self.journal.lock();
            if journal.rollback_due() {
                // A stager's append failed and waits for this lock to roll back: everything unsynced is lost.
                self.fail_staged(&mut journal);
                return Err(StoreError::Dropped);
            }
            let mut staging = self.staging.lock();
            if !staging.has_staged() {
                // Nothing of ours to write. Batches staged before the call may be in a group another sync
                // made durable: by now it holds `visible` while applying it (it took `visible` before it let
                // go of `staging`), so waiting for `visible` below returns once they are readable.
                drop(journal);
                (staging, 0)
            } else {
                let job = journal.prepare_sync();
                let (ticket, count) = staging.begin_sync();
                drop(staging);
                drop(journal);
                let started = Instant::now();
                *last_sync = Some(started);
                let synced = job.run();
                let took = started.elapsed();
                let mut journal = self.journal.lock();
                if let Err(error) = synced {
                    self.fail_staged(&mut journal);
                    return Err(error);
                }
                let mut staging = self.staging.lock();
                if !staging.mark_durable(ticket, job.position) {
                    // A write failed while the fdatasync ran: the journal was rolled back past these
                    // batches, so the job's position means nothing any more.
                    return Err(StoreError::Dropped);
                }
                journal.complete_sync(job);
                // Latency first, released with the count: a reader that sees this sync counted (stats,
                // acquire) sees its latency too.
                self.sync_latency.record(took);
                self.syncs.fetch_add(1, Ordering::Release);
                (staging, count)
            }
        };
        self.apply_durable(staging);
        Ok(count)
    }

    fn fate(&self, receipt: Staged) -> BatchFate {
        self.staging.lock().fate(receipt)
    }

    fn wait_for_room(&self, patience: Duration) -> StoreResult<()> {
        self.check_usable()?;
        self.wait_for_memory_up_to(patience)
    }

    fn read(&self, channel: &ChannelId, from: Seq, through: Seq, limits: ReadLimits) -> StoreResult<Vec<Record>> {
        let mut visible = self.visible.lock();
        self.load_if_cold(&mut visible.core, channel)?;
        visible.core.read(channel, from, through, limits, |from, through, budget, out| {
            self.read_older(channel, from, through, budget, out)
        })
    }

    fn state(&self, channel: &ChannelId) -> StoreResult<ChannelLogState> {
        let mut visible = self.visible.lock();
        self.load_if_cold(&mut visible.core, channel)?;
        Ok(visible.core.state(channel))
    }

    fn idempotent(&self, channel: &ChannelId, key: &IdempotencyKey) -> StoreResult<Option<IdempotentHit>> {
        let unlimited = ReadLimits { records_max: usize::MAX, bytes_max: usize::MAX };
        let mut visible = self.visible.lock();
        self.load_if_cold(&mut visible.core, channel)?;
        visible.core.idempotency(channel, key, |core, from, through| {
            core.read(channel, from, through, unlimited, |from, through, budget, out| {
                self.read_older(channel, from, through, budget, out)
            })
        })
    }

    fn logs_after(&self, after: Option<&ChannelId>, limit: usize) -> StoreResult<Vec<ChannelId>> {
        // Key order is the order of `ChannelId::encode_key`, which a key's decoding gives back.
        let mut start = after.map_or_else(Vec::new, |channel| {
            let mut key = Vec::new();
            channel.encode_key(&mut key);
            key
        });
        let mut listed = Vec::new();
        let mut first = after.is_none();
        while listed.len() < limit {
            if !first {
                start.push(0); // the first key after the last one seen
            }
            first = false;
            let range = KeyRange { start: std::mem::take(&mut start), end: None };
            let page = self.kv.scan(Keyspace::MessageState, &range, Direction::Forward, limit - listed.len())?;
            let full = page.len() == limit - listed.len();
            let visible = self.visible.lock();
            for (key, value) in page {
                let Some((channel, [])) = ChannelId::decode_key(&key) else {
                    return Err(StoreError::Corrupt {
                        location: CorruptLocation::Kv { keyspace: Keyspace::MessageState, key },
                        detail: "channel state key does not decode",
                    });
                };
                // A tombstone holds no log; nor does one forgotten since its state was stored (not
                // written behind yet).
                let holds = match visible.core.get(&channel) {
                    Some(entry) => !entry.state.is_empty(),
                    None => decode_state(&value).is_none_or(|stored| !stored.state.is_empty()),
                };
                if holds {
                    listed.push(channel);
                }
                start = key;
            }
            if !full {
                break;
            }
        }
        Ok(listed)
    }

    fn release_caches(&self, channel: &ChannelId) {
        // Staging before visible (the lock order); a channel with batches still on their way keeps its tail.
        self.staging.lock().forget_tail(channel);
        self.visible.lock().core.release(channel);
    }
}

/// Lowers the calling thread's CPU priority to `nice` (on Linux a thread's nice value is its own).
#[cfg(any(target_os = "linux", target_os = "android"))]
fn lower_thread_priority(nice: i32) {
    if nice == 0 {
        return;
    }
    if let Err(error) = rustix::process::setpriority_process(Some(rustix::thread::gettid()), nice) {
        tracing::debug!(%error, nice, "could not lower the write-behind thread's priority");
    }
}

#[cfg(not(any(target_os = "linux", target_os = "android")))]
fn lower_thread_priority(_nice: i32) {}

/// Checks that the store is in [`FORMAT`], recording it in a store that holds nothing yet. A store that
/// holds a checkpoint, a channel state or journal segments but no format was written before formats were
/// recorded (format 1).
fn check_format(kv: &dyn Kv, dir: &Path) -> StoreResult<()> {
    if let Some(bytes) = kv.get(Keyspace::Journal, FORMAT_KEY)? {
        let found = <[u8; 4]>::try_from(bytes.as_slice()).map(u32::from_le_bytes).map_err(|_| StoreError::Corrupt {
            location: CorruptLocation::Kv { keyspace: Keyspace::Journal, key: FORMAT_KEY.to_vec() },
            detail: "message log format does not decode",
        })?;
        return match found {
            FORMAT => Ok(()),
            FORMAT_READ_TOO => put_durably(kv, FORMAT_KEY, &FORMAT.to_le_bytes()),
            found => Err(StoreError::IncompatibleFormat { found, expected: FORMAT }),
        };
    }
    let any_state = !kv.scan(Keyspace::MessageState, &KeyRange::prefix(b""), Direction::Forward, 1)?.is_empty();
    let any_segment = dir.exists() && !segment::list_segments(dir)?.is_empty();
    if any_state || any_segment || kv.get(Keyspace::Journal, CHECKPOINT_KEY)?.is_some() {
        return Err(StoreError::IncompatibleFormat { found: 1, expected: FORMAT });
    }
    put_durably(kv, FORMAT_KEY, &FORMAT.to_le_bytes())
}

/// Writes one key of the journal's own keyspace and makes it durable.
fn put_durably(kv: &dyn Kv, key: &[u8], value: &[u8]) -> StoreResult<()> {
    let mut batch = KvBatch::new();
    batch.put(Keyspace::Journal, key.to_vec(), value);
    kv.apply(batch)?;
    kv.sync()
}

/// Counts this opening of the log (durably: two openings never share a number) and returns its number.
fn count_opening(kv: &dyn Kv) -> StoreResult<u64> {
    let before = match kv.get(Keyspace::Journal, OPENINGS_KEY)? {
        None => 0,
        Some(bytes) => {
            <[u8; 8]>::try_from(bytes.as_slice()).map(u64::from_le_bytes).map_err(|_| StoreError::Corrupt {
                location: CorruptLocation::Kv { keyspace: Keyspace::Journal, key: OPENINGS_KEY.to_vec() },
                detail: "message log opening count does not decode",
            })?
        }
    };
    let opening = before + 1;
    put_durably(kv, OPENINGS_KEY, &opening.to_le_bytes())?;
    Ok(opening)
}

/// Loads `channel`'s stored state from `kv` into `core` as a released entry; returns the journal frame
/// that state includes everything before, or `None` if the channel has no stored state. A state written
/// in an earlier `opening` may have stale packs after it (a round cut by a crash): the channel's next
/// write-behind clears them first. One written in this opening has none — its entry left memory only
/// once written behind by rounds that all succeeded — which spares a channel read back after eviction
/// that clean-up (two sled scans).
fn load_entry(kv: &dyn Kv, core: &mut LogCore, channel: &ChannelId, opening: u64) -> StoreResult<Option<u64>> {
    let mut key = Vec::new();
    channel.encode_key(&mut key);
    let Some(value) = kv.get(Keyspace::MessageState, &key)? else { return Ok(None) };
    let stored = decode_state(&value).ok_or(StoreError::Corrupt {
        location: CorruptLocation::Kv { keyspace: Keyspace::MessageState, key },
        detail: "channel state does not decode",
    })?;
    core.insert_loaded(channel, stored.state, stored.sled_through, stored.opening == opening);
    Ok(Some(stored.frames_before))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::MemoryKv;
    use tidings_types::ChannelType;

    fn append(channel: &ChannelId, seq: u64) -> LogBatch {
        crate::message::test_append(channel, seq, 1)
    }

    use crate::message::LogOp;

    fn reopen(dir: &Path, kv: &Arc<dyn Kv>) -> JournalLog {
        JournalLog::open(dir, Arc::clone(kv), JournalConfig::default()).unwrap()
    }

    /// A new log on a memory store, and a channel to write.
    fn fresh() -> (tempfile::TempDir, Arc<dyn Kv>, ChannelId, JournalLog) {
        let dir = tempfile::tempdir().unwrap();
        let kv: Arc<dyn Kv> = Arc::new(MemoryKv::new());
        let log = reopen(dir.path(), &kv);
        (dir, kv, ChannelId::new(ChannelType::GROUP, "g").unwrap(), log)
    }

    #[test]
    fn a_config_that_cannot_hold_its_own_batches_is_refused_at_open() {
        let base = JournalConfig::default();
        let batch = base.limits.batch_bytes_max;
        let refused = [
            JournalConfig { segment_bytes: batch as u64, ..base.clone() },
            JournalConfig { mem_bytes_max: batch - 1, write_behind_bytes: 0, ..base.clone() },
            JournalConfig { write_behind_bytes: base.mem_bytes_max + 1, ..base.clone() },
            JournalConfig { pack_bytes_max: 0, ..base.clone() },
            JournalConfig { write_behind_batch_channels: 0, ..base.clone() },
            JournalConfig { write_behind_batch_bytes: 0, ..base.clone() },
        ];
        for config in refused {
            let dir = tempfile::tempdir().unwrap();
            let kv: Arc<dyn Kv> = Arc::new(MemoryKv::new());
            let opened = JournalLog::open(dir.path(), Arc::clone(&kv), config.clone());
            assert!(matches!(opened, Err(StoreError::BadConfig { .. })), "{config:?} opened");
            assert!(std::fs::read_dir(dir.path()).unwrap().next().is_none(), "{config:?} wrote a file");
        }
    }

    #[test]
    fn a_bookkeeping_key_that_does_not_decode_refuses_the_open_as_corrupt_and_names_the_key() {
        for key in [CHECKPOINT_KEY, FORMAT_KEY, OPENINGS_KEY] {
            let (dir, kv, channel, log) = fresh();
            log.commit(append(&channel, 1)).unwrap();
            drop(log);
            let mut batch = KvBatch::new();
            batch.put(Keyspace::Journal, key.to_vec(), b"???");
            kv.apply(batch).unwrap();
            match JournalLog::open(dir.path(), Arc::clone(&kv), JournalConfig::default()) {
                Err(StoreError::Corrupt { location: CorruptLocation::Kv { keyspace, key: named }, .. }) => {
                    assert_eq!((keyspace, named.as_slice()), (Keyspace::Journal, key));
                }
                Err(other) => panic!("{}: {other}", String::from_utf8_lossy(key)),
                Ok(_) => panic!("{}: a journal with that key garbled opened", String::from_utf8_lossy(key)),
            }
        }
    }

    #[test]
    fn a_released_channel_keeps_no_staging_tail_once_its_batches_are_applied() {
        let (_dir, _kv, channel, log) = fresh();
        log.stage(append(&channel, 1)).unwrap();
        // Staged, not yet synced: the tail stays (without it the next batch would be checked against a
        // state that lacks seq 1, and refused).
        log.release_caches(&channel);
        assert_eq!(log.staging.lock().tails_len(), 1);
        log.stage(append(&channel, 2)).unwrap();
        log.sync().unwrap();
        log.release_caches(&channel);
        assert_eq!(log.staging.lock().tails_len(), 0, "applied: the visible state says the same");
        // The next batch is checked against the visible state: a gap is refused, the next seq taken.
        assert!(log.stage(append(&channel, 4)).is_err());
        log.stage(append(&channel, 3)).unwrap();
        log.sync().unwrap();
        assert_eq!(log.state(&channel).unwrap().last_seq, Seq::new(3));
    }

    fn seqs(log: &JournalLog, channel: &ChannelId) -> Vec<u64> {
        let all = ReadLimits { records_max: usize::MAX, bytes_max: usize::MAX };
        log.read(channel, Seq::new(1), Seq::new(u64::MAX), all).unwrap().iter().map(|r| r.seq.get()).collect()
    }

    /// An evicted channel's entry leaves memory once written behind, and every later use reads it back
    /// from sled: reads, state, the next append (checked against the stored state), and a restart's
    /// replay of frames written after it left.
    #[test]
    fn a_released_channel_leaves_memory_once_written_behind_and_comes_back_from_sled() {
        let (dir, kv, a, log) = fresh();
        let b = ChannelId::new(ChannelType::GROUP, "b").unwrap();
        log.commit(crate::message::test_append(&a, 1, 3)).unwrap();
        log.commit(LogBatch::new(a.clone(), vec![crate::message::LogOp::CheckpointHw(Seq::new(2))])).unwrap();
        log.commit(append(&b, 1)).unwrap();
        log.release_caches(&a);
        assert_eq!(log.stats().channels_in_memory, 2, "not written behind yet: it stays");
        log.write_behind().unwrap();
        assert_eq!((log.stats().channels_in_memory, log.stats().channels_dropped), (1, 1));

        // Read back from sled, and out again at the next round: a read does not keep it.
        assert_eq!(seqs(&log, &a), vec![1, 2, 3]);
        let state = log.state(&a).unwrap();
        assert_eq!((state.last_seq, state.hw), (Seq::new(3), Seq::new(2)));
        assert_eq!(log.stats().channels_in_memory, 2);
        log.write_behind().unwrap();
        assert_eq!(log.stats().channels_in_memory, 1);

        // Staging loads it and keeps it: the next batch is checked against the stored state.
        assert!(log.stage(append(&a, 5)).is_err(), "a gap after the stored last seq is refused");
        log.commit(append(&a, 4)).unwrap();
        log.write_behind().unwrap();
        assert_eq!(log.stats().channels_in_memory, 2, "in use: it stays");
        assert_eq!(seqs(&log, &a), vec![1, 2, 3, 4]);

        // Released and dropped, then written again (in the journal only) and replayed at a restart.
        log.release_caches(&a);
        log.write_behind().unwrap();
        assert_eq!(log.stats().channels_in_memory, 1);
        log.commit(append(&a, 5)).unwrap();
        drop(log);
        let log = reopen(dir.path(), &kv);
        assert_eq!(seqs(&log, &a), vec![1, 2, 3, 4, 5]);
        assert_eq!(log.state(&a).unwrap().hw, Seq::new(2));
        assert_eq!(seqs(&log, &b), vec![1]);
        log.write_behind().unwrap();
        assert_eq!(log.stats().channels_in_memory, 0, "after a restart no replica uses any channel yet");
        assert_eq!(seqs(&log, &a), vec![1, 2, 3, 4, 5]);
    }

    /// Keys of `keyspace` the store holds for `channel`'s log.
    fn keys_of(kv: &Arc<dyn Kv>, keyspace: Keyspace, channel: &ChannelId) -> usize {
        let mut prefix = Vec::new();
        channel.encode_key(&mut prefix);
        let all = KeyRange { start: Vec::new(), end: None };
        let keys = kv.scan(keyspace, &all, Direction::Forward, usize::MAX).unwrap();
        keys.iter()
            .filter(|(key, value)| key.starts_with(&prefix) || value.windows(prefix.len()).any(|w| w == prefix))
            .count()
    }

    /// A forgotten log leaves only its tombstone behind: its records and packs go, its stored state is
    /// the tombstone (the meta version that removed it), a sweep no longer lists it, a restart does not
    /// bring it back, and the channel can start again at seq 1, keeping the tombstone. The other
    /// channel is untouched.
    #[test]
    fn a_forgotten_log_leaves_nothing_in_the_store_and_may_start_again_at_one() {
        let (dir, kv, a, log) = fresh();
        let b = ChannelId::new(ChannelType::GROUP, "b").unwrap();
        log.commit(crate::message::test_append(&a, 1, 40)).unwrap();
        log.commit(LogBatch::new(a.clone(), vec![LogOp::CheckpointHw(Seq::new(30))])).unwrap();
        log.commit(crate::message::test_append(&b, 1, 2)).unwrap();
        log.write_behind().unwrap();
        log.commit(crate::message::test_append(&a, 41, 5)).unwrap();
        assert!(keys_of(&kv, Keyspace::MessagePack, &a) > 0);
        assert_eq!(log.logs_after(None, 10).unwrap().len(), 2);

        log.commit(LogBatch::new(a.clone(), vec![LogOp::Forget { version: 7 }])).unwrap();
        let tombstone = ChannelLogState { meta_floor: 7, ..ChannelLogState::default() };
        assert_eq!(log.state(&a).unwrap(), tombstone, "forgotten at once");
        assert!(seqs(&log, &a).is_empty());
        assert_eq!(log.logs_after(None, 10).unwrap(), vec![b.clone()], "not listed, though sled still holds it");
        log.write_behind().unwrap();
        assert_eq!(keys_of(&kv, Keyspace::MessagePack, &a), 0, "no pack left");
        assert_eq!(keys_of(&kv, Keyspace::MessageState, &a), 1, "the tombstone");
        assert_eq!(log.logs_after(None, 10).unwrap(), vec![b.clone()]);
        assert_eq!(log.logs_after(Some(&b), 10).unwrap(), Vec::<ChannelId>::new());
        assert!(seqs(&log, &a).is_empty());

        // Forgotten in the journal only, then a restart: the replay forgets it again.
        log.commit(crate::message::test_append(&a, 1, 3)).unwrap();
        log.write_behind().unwrap();
        log.commit(LogBatch::new(a.clone(), vec![LogOp::Forget { version: 7 }])).unwrap();
        drop(log);
        let log = reopen(dir.path(), &kv);
        assert_eq!(log.state(&a).unwrap(), tombstone);
        log.write_behind().unwrap();
        assert_eq!(keys_of(&kv, Keyspace::MessagePack, &a), 0);

        // Starts again at one, as a channel never written does; the other channel kept everything.
        assert!(log.stage(append(&a, 2)).is_err(), "a forgotten log starts at seq 1");
        log.commit(append(&a, 1)).unwrap();
        log.write_behind().unwrap();
        drop(log);
        let log = reopen(dir.path(), &kv);
        assert_eq!(seqs(&log, &a), vec![1]);
        assert_eq!(log.state(&a).unwrap().meta_floor, 7, "the tombstone stays with the new log");
        assert_eq!(seqs(&log, &b), vec![1, 2]);
        assert_eq!(log.logs_after(None, 1).unwrap().len(), 1, "the limit holds");
    }

    /// A meta floor never goes down, outlives a forget (which raises it to the removing meta), a
    /// write-behind and a restart from the journal alone; a log holding nothing but its floor is
    /// empty (a sweep does not list it) yet keeps it.
    #[test]
    fn a_meta_floor_only_rises_and_survives_forgets_write_behind_and_restarts() {
        let (dir, kv, a, log) = fresh();
        let floor = |log: &JournalLog| log.state(&a).unwrap().meta_floor;
        let raise = |version| LogBatch::new(a.clone(), vec![LogOp::RaiseMetaFloor { version }]);

        log.commit(raise(5)).unwrap();
        assert_eq!(floor(&log), 5);
        assert!(log.state(&a).unwrap().is_empty(), "a floor alone holds nothing");
        assert!(log.logs_after(None, 10).unwrap().is_empty(), "a sweep has nothing to forget");
        drop(log);
        let log = reopen(dir.path(), &kv);
        assert_eq!(floor(&log), 5, "replayed from the journal");

        log.commit(crate::message::test_append(&a, 1, 3)).unwrap();
        log.commit(raise(3)).unwrap();
        assert_eq!(floor(&log), 5, "never lowered");
        log.write_behind().unwrap();
        log.release_caches(&a);
        log.write_behind().unwrap();
        drop(log);
        let log = reopen(dir.path(), &kv);
        assert_eq!(floor(&log), 5, "read back from sled");
        assert_eq!(seqs(&log, &a), vec![1, 2, 3]);

        log.commit(LogBatch::new(a.clone(), vec![LogOp::Forget { version: 2 }])).unwrap();
        assert_eq!(floor(&log), 5, "a forget under an older meta keeps the higher floor");
        log.commit(LogBatch::new(a.clone(), vec![LogOp::Forget { version: 9 }])).unwrap();
        assert_eq!(floor(&log), 9, "up to the meta that removed the replica");
        log.commit(raise(12)).unwrap();
        log.write_behind().unwrap();
        drop(log);
        assert_eq!(floor(&reopen(dir.path(), &kv)), 12);
    }

    /// A channel read back in the opening that wrote its state skips the clean-up of stale packs (none
    /// can be there); one whose state an earlier opening wrote gets it (a crash may have cut a round).
    #[test]
    fn only_a_state_written_before_a_restart_makes_the_next_write_behind_clean_up_first() {
        let (dir, kv, channel, log) = fresh();
        let dirty_after = |log: &JournalLog| log.visible.lock().core.get(&channel).unwrap().older_dirty_after;
        log.commit(crate::message::test_append(&channel, 1, 3)).unwrap();
        log.release_caches(&channel);
        log.write_behind().unwrap();
        assert_eq!(log.stats().channels_in_memory, 0);
        log.state(&channel).unwrap();
        assert_eq!(dirty_after(&log), None, "written in this opening");
        drop(log);
        let log = reopen(dir.path(), &kv);
        log.state(&channel).unwrap();
        assert_eq!(dirty_after(&log), Some(Seq::new(3)), "written in an earlier opening");
        log.commit(append(&channel, 4)).unwrap();
        log.write_behind().unwrap();
        assert_eq!(dirty_after(&log), None, "cleaned and stamped by this opening's round");
    }

    /// Reading a channel back from sled can fail: the caller gets the store's error, and nothing changes.
    #[test]
    fn a_failed_read_back_is_an_error_and_changes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let kv = Arc::new(MemoryKv::new());
        let log = JournalLog::open(dir.path(), kv.clone(), JournalConfig::default()).unwrap();
        let channel = ChannelId::new(ChannelType::GROUP, "g").unwrap();
        log.commit(append(&channel, 1)).unwrap();
        log.release_caches(&channel);
        log.write_behind().unwrap();
        assert_eq!(log.stats().channels_in_memory, 0);
        kv.fail(crate::kv::FailOp::Get, 0, 2);
        assert!(log.state(&channel).is_err());
        assert!(log.stage(append(&channel, 2)).is_err());
        assert_eq!(log.stats().channels_in_memory, 0);
        kv.clear_failpoints();
        log.commit(append(&channel, 2)).unwrap();
        assert_eq!(seqs(&log, &channel), vec![1, 2]);
    }

    #[test]
    fn fill_spares_tops_up_the_spares_once_and_a_new_journal_starts_in_one() {
        let dir = tempfile::tempdir().unwrap();
        let limits = LogLimits { batch_bytes_max: 64 << 10, ..LogLimits::default() };
        let config = JournalConfig { segment_bytes: 1 << 20, limits, ..JournalConfig::default() };
        let log = JournalLog::open(dir.path(), Arc::new(MemoryKv::new()), config).unwrap();
        let channel = ChannelId::new(ChannelType::GROUP, "g").unwrap();
        // Two spares, and a third after one replaced the new journal's (preallocated) first segment.
        assert_eq!(log.fill_spares().unwrap(), 3);
        assert_eq!(log.fill_spares().unwrap(), 0, "already full");
        assert_eq!(log.stats().spares_filled, 3);
        let spares = std::fs::read_dir(dir.path())
            .unwrap()
            .filter(|e| e.as_ref().unwrap().path().extension().is_some_and(|x| x == "spare"));
        assert_eq!(spares.count(), 2);
        log.commit(append(&channel, 1)).unwrap();
        assert_eq!(log.state(&channel).unwrap().last_seq, Seq::new(1), "the log works as before");
    }

    /// A store written in another layout is refused, not misread: one with a different format recorded,
    /// and one with data but no format (written before formats were recorded).
    #[test]
    fn a_store_in_another_format_is_refused_at_open() {
        let (dir, kv, channel, log) = fresh();
        log.commit(append(&channel, 1)).unwrap();
        drop(log);
        assert_eq!(reopen(dir.path(), &kv).state(&channel).unwrap().last_seq, Seq::new(1), "its own format opens");
        // The previous format opens, and is recorded as this one (it only lacks the opening stamps).
        let mut previous = KvBatch::new();
        previous.put(Keyspace::Journal, FORMAT_KEY.to_vec(), &FORMAT_READ_TOO.to_le_bytes());
        kv.apply(previous).unwrap();
        assert_eq!(reopen(dir.path(), &kv).state(&channel).unwrap().last_seq, Seq::new(1));
        assert_eq!(kv.get(Keyspace::Journal, FORMAT_KEY).unwrap(), Some(FORMAT.to_le_bytes().to_vec()));
        let mut other = KvBatch::new();
        other.put(Keyspace::Journal, FORMAT_KEY.to_vec(), &7u32.to_le_bytes());
        kv.apply(other).unwrap();
        let refused = JournalLog::open(dir.path(), Arc::clone(&kv), JournalConfig::default());
        assert!(matches!(refused, Err(StoreError::IncompatibleFormat { found: 7, expected: FORMAT })));
        let mut unrecorded = KvBatch::new();
        unrecorded.delete(Keyspace::Journal, FORMAT_KEY.to_vec());
        kv.apply(unrecorded).unwrap();
        let refused = JournalLog::open(dir.path(), Arc::clone(&kv), JournalConfig::default());
        assert!(matches!(refused, Err(StoreError::IncompatibleFormat { found: 1, .. })));
    }

    /// A failed append drops what was staged and not yet synced (their receipts say so); the failed frame
    /// and the dropped ones never come back, and the log goes on from the last synced state.
    #[test]
    fn a_failed_append_rolls_back_what_was_not_synced() {
        let (dir, kv, channel, log) = fresh();
        let synced = log.stage(append(&channel, 1)).unwrap();
        log.sync().unwrap();
        let unsynced = log.stage(append(&channel, 2)).unwrap();
        log.journal.lock().fail_next_append = true;
        assert!(matches!(log.stage(append(&channel, 3)), Err(StoreError::Io { .. })));
        assert_eq!(log.fate(synced), BatchFate::Durable);
        assert_eq!(log.fate(unsynced), BatchFate::Dropped);
        assert_eq!(log.sync().unwrap(), 0, "nothing is left to make durable");
        let again = log.stage(append(&channel, 2)).unwrap();
        log.sync().unwrap();
        assert_eq!(log.fate(again), BatchFate::Durable);
        drop(log);
        let log = reopen(dir.path(), &kv);
        assert_eq!(log.state(&channel).unwrap().last_seq, Seq::new(2));
    }

    /// A sync that gets the journal while a failed append waits to roll it back (the stager marked the
    /// rollback due and let go of the journal to take the sync lock first) makes nothing durable.
    #[test]
    fn a_sync_before_a_due_rollback_drops_everything_unsynced() {
        let (dir, kv, channel, log) = fresh();
        let staged = log.stage(append(&channel, 1)).unwrap();
        log.journal.lock().mark_rollback_due();
        assert!(matches!(log.sync(), Err(StoreError::Dropped)));
        assert_eq!(log.fate(staged), BatchFate::Dropped);
        assert!(!log.journal.lock().rollback_due());
        drop(log);
        let log = reopen(dir.path(), &kv);
        assert_eq!(log.state(&channel).unwrap().last_seq, Seq::new(0));
    }

    /// A round takes its channels a few per hold of the lock every sync's apply needs. Batches committed
    /// between two holds stay whole and are never applied twice: one for a channel taken earlier in the
    /// round waits for the next round (the journal replays it after a restart), one for a channel taken
    /// later goes in this round, whose stored state then includes a frame past the round's checkpoint
    /// (a restart's replay skips it for that channel).
    #[test]
    fn batches_committed_between_a_rounds_holds_are_written_once_and_survive_a_restart() {
        let (dir, kv, _, log) = fresh();
        let channels: Vec<ChannelId> =
            (0..6).map(|i| ChannelId::new(ChannelType::GROUP, &format!("c{i}")).unwrap()).collect();
        for channel in &channels {
            log.commit(crate::message::test_append(channel, 1, 2)).unwrap();
        }
        let (first, last) = (&channels[0], &channels[5]);
        let mut holds = 0;
        log.write_behind_round(2, || {
            holds += 1;
            if holds == 1 {
                // After the first hold: the first channel is taken, the last one is not yet.
                log.commit(append(first, 3)).unwrap();
                log.commit(append(last, 3)).unwrap();
            }
        })
        .unwrap();
        assert_eq!(holds, 2, "six channels, two per hold: the lock let go twice");
        let in_sled =
            |log: &JournalLog, channel: &ChannelId| log.visible.lock().core.get(channel).unwrap().older_through;
        assert_eq!(in_sled(&log, first), Seq::new(2), "its third record waits for the next round");
        assert_eq!(in_sled(&log, last), Seq::new(3), "taken after its third record was applied");
        drop(log);
        let log = reopen(dir.path(), &kv);
        for channel in &channels {
            let expected: Vec<u64> = if channel == first || channel == last { vec![1, 2, 3] } else { vec![1, 2] };
            assert_eq!(seqs(&log, channel), expected, "{channel:?} after the restart");
        }
        log.commit(append(last, 4)).unwrap();
        log.write_behind().unwrap();
        drop(log);
        let log = reopen(dir.path(), &kv);
        assert_eq!(seqs(&log, first), vec![1, 2, 3]);
        assert_eq!(seqs(&log, last), vec![1, 2, 3, 4]);
    }
}
