//! Write-behind: durable records move from the memory tables into sled, packed per channel, with the
//! channel states and then the journal checkpoint, in rounds cut into bounded sled batches; a round
//! that fails leaves the next one to clean up after it.

use super::packs::{body_key, pack_key};
use super::segment::Position;
use super::{lower_thread_priority, JournalConfig, JournalLog, CHECKPOINT_KEY, SCAN_PAGE};
use crate::error::StoreResult;
use crate::kv::{Direction, KeyRange, Keyspace, Kv, KvBatch};
use crate::message::codec::encode_state;
use crate::message::record::{encode_records, Record};
use crate::message::state::{ChannelLogState, MemTable};
use crate::message::stored::StoredState;
use parking_lot::MutexGuard;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;
use tidings_types::{ChannelId, Seq};

/// Channels a write-behind round takes from memory, or marks written, per hold of the lock every sync's
/// apply needs (see [`JournalLog::take_round`]).
const CHANNELS_PER_HOLD: usize = 256;

impl JournalLog {
    /// Runs write-behind in a background thread until the returned handle is dropped. Without it,
    /// write-behind runs inline when memory fills, or when [`JournalLog::write_behind`] is called.
    pub fn start_write_behind(self: &Arc<Self>) -> WriteBehindThread {
        self.background.store(true, Ordering::SeqCst);
        let log = Arc::clone(self);
        let thread = std::thread::Builder::new()
            .name("tidings-write-behind".into())
            .spawn(move || log.write_behind_loop())
            .expect("spawn write-behind thread");
        WriteBehindThread { log: Arc::clone(self), thread: Some(thread) }
    }

    pub(super) fn write_behind_loop(&self) {
        lower_thread_priority(self.config.write_behind_nice);
        while !self.stop.load(Ordering::SeqCst) {
            {
                let mut visible = self.visible.lock();
                if visible.core.mem_bytes < self.config.write_behind_bytes && !self.stop.load(Ordering::SeqCst) {
                    self.write_behind_wanted.wait_for(&mut visible, self.config.write_behind_interval);
                }
            }
            if self.stop.load(Ordering::SeqCst) {
                break;
            }
            if let Err(error) = self.write_behind() {
                tracing::error!(%error, "message log write-behind failed; will retry");
                std::thread::sleep(self.config.write_behind_interval);
            }
        }
    }

    /// Writes every durable record still in memory into sled with the channel states, then the journal
    /// checkpoint, then a real fsync; then deletes the journal segments before the checkpoint.
    ///
    /// The round goes to sled in several batches (`write_behind_batch_channels`,
    /// `write_behind_batch_bytes`), cut between packs; a channel's state follows its last pack and names
    /// the journal frame it includes everything before. A crash between two batches (sled may have
    /// flushed some) leaves some channels ahead of the checkpoint — recovery skips the frames they
    /// include — and some with packs past their stored state, which reads never look at and the
    /// channel's next write-behind clears first.
    pub fn write_behind(&self) -> StoreResult<()> {
        self.write_behind_round(CHANNELS_PER_HOLD, || {})
    }

    /// [`JournalLog::write_behind`], taking `per_hold` channels per hold of the lock every sync's apply
    /// needs and calling `between_holds` while it is let go (tests commit batches there).
    pub(super) fn write_behind_round(&self, per_hold: usize, between_holds: impl FnMut()) -> StoreResult<()> {
        let mut persisted = self.write_behind.lock();
        let (items, checkpoint) = self.take_round(per_hold, between_holds);
        if items.is_empty() && checkpoint == *persisted {
            drop(persisted);
            self.drop_released_entries();
            return Ok(());
        }
        // In key order: the round's pack bodies then go into sled one after another (see `body_key`).
        let mut items = items;
        items.sort_by_cached_key(|item| {
            let mut prefix = Vec::new();
            item.channel.encode_key(&mut prefix);
            prefix
        });
        let mut writer = RoundWriter::new(self.kv.as_ref(), &self.config, &self.mem_bytes);
        let written = items
            .iter()
            .try_for_each(|item| self.persist_item(item, &mut writer))
            .and_then(|()| writer.finish(&checkpoint))
            .and_then(|()| self.kv.sync());
        if let Err(error) = written {
            // Batches of this round may be in sled, packed from where memory starts: the next round
            // checks these channels' packs past what is known to be there.
            self.distrust_written(&items);
            return Err(error);
        }
        *persisted = checkpoint;
        let records: usize = items.iter().map(|i| i.records.len()).sum();
        self.finish_write_behind(items, per_hold);
        self.write_behinds.fetch_add(1, Ordering::Relaxed);
        self.records_written_behind.fetch_add(records as u64, Ordering::Relaxed);
        let deleted = self.journal.lock().delete_before(checkpoint)?;
        self.segments_deleted.fetch_add(deleted as u64, Ordering::Relaxed);
        drop(persisted);
        self.drop_released_entries();
        Ok(())
    }

    /// Takes every channel listed as changed at the start of the round, with the round's checkpoint: the
    /// journal position applied at that start. O(1) per channel under the lock every sync's apply needs
    /// (the memory tables are taken, not copied: copying them held up every apply for 100-190 ms at
    /// times), and the lock goes fairly to any thread waiting for it after each `per_hold` channels.
    /// Taken whole, 10,000 channels held it for 2-14 ms, a stall of every commit on the node (longer when
    /// this lower-priority thread lost the CPU while holding it). A channel taken later in the round
    /// holds the frames applied until then: its state names the frame it includes everything before
    /// (`frames_before`), past the checkpoint, and recovery skips those frames for it.
    fn take_round(&self, per_hold: usize, mut between_holds: impl FnMut()) -> (Vec<WriteBehindItem>, Position) {
        let mut visible = self.visible.lock();
        let checkpoint = visible.applied;
        let listed = visible.core.changed_list();
        let mut items = Vec::with_capacity(listed.len());
        let mut holds = listed.chunks(per_hold.max(1)).peekable();
        while let Some(ids) = holds.next() {
            let frames_before = visible.applied.next_frame;
            items.extend(visible.core.take_changed(ids, |e, records| WriteBehindItem {
                channel: e.channel.clone(),
                records,
                state: e.state.clone(),
                older_through: e.older_through,
                dirty_after: e.older_dirty_after,
                generation: e.generation,
                changes: e.changes,
                frames_before,
            }));
            if holds.peek().is_some() {
                MutexGuard::unlocked_fair(&mut visible, &mut between_holds);
            }
        }
        (items, checkpoint)
    }

    /// After a failed round: packs of `items` may be in sled past what memory says sled holds; the next
    /// round clears after that point first (as after a truncation).
    pub(super) fn distrust_written(&self, items: &[WriteBehindItem]) {
        let mut visible = self.visible.lock();
        for item in items {
            let Some(entry) = visible.core.get_mut(&item.channel) else { continue };
            // Its records are not known to be in sled: back to memory, for the next round.
            entry.unflush();
            let valid = entry.older_through;
            entry.older_dirty_after = Some(entry.older_dirty_after.map_or(valid, |d| d.min(valid)));
            visible.core.relist(&item.channel);
        }
    }

    /// Marks the round's channels written, `per_hold` per hold of the lock every sync's apply needs, which
    /// goes fairly to any thread waiting for it between holds (see [`JournalLog::take_round`]).
    pub(super) fn finish_write_behind(&self, items: Vec<WriteBehindItem>, per_hold: usize) {
        let mut written = Vec::with_capacity(items.len());
        let mut visible = self.visible.lock();
        let mut holds = items.chunks(per_hold.max(1)).peekable();
        while let Some(chunk) = holds.next() {
            let core = &mut visible.core;
            for item in chunk {
                let Some(entry) = core.get_mut(&item.channel) else { continue };
                if entry.generation == item.generation {
                    let through = item.records.last().map_or(item.older_through, |r| r.seq);
                    entry.older_through = through;
                    entry.older_dirty_after = None;
                    entry.persisted_changes = item.changes;
                    // The records taken are in sled now; what came since stays in `mem`.
                    if let Some(flushing) = entry.flushing.take() {
                        core.mem_bytes -= flushing.bytes();
                        written.push(flushing);
                    }
                } else {
                    // Truncated meanwhile (which put the taken records back into `mem`): what was just written
                    // past the valid prefix is stale; clean it next time.
                    let valid = entry.older_through;
                    entry.older_dirty_after = Some(entry.older_dirty_after.map_or(valid, |d| d.min(valid)));
                }
                // Changed since it was taken, or its round was overtaken: the next round takes it.
                core.relist(&item.channel);
            }
            self.mem_bytes.store(visible.core.mem_bytes, Ordering::Relaxed);
            self.mem_freed.notify_all();
            if holds.peek().is_some() {
                MutexGuard::unlocked_fair(&mut visible, || {});
            }
        }
        drop(visible);
        // Freeing hundreds of thousands of records takes milliseconds: not under the lock every sync's
        // apply needs (this thread runs at a lower priority and may lose the CPU meanwhile).
        drop(written);
        drop(items);
    }

    /// Adds one channel's clean-ups, packs and state to the round; a sled batch may be cut between two
    /// packs (the state goes after the last one: until it lands, sled's packs past the stored state are
    /// ignored, and cleaned before the channel is written again — see [`LogCore::insert_loaded`](crate::message::core::LogCore::insert_loaded)).
    pub(super) fn persist_item(&self, item: &WriteBehindItem, writer: &mut RoundWriter<'_>) -> StoreResult<()> {
        let frames_before = item.frames_before;
        let mut prefix = Vec::new();
        item.channel.encode_key(&mut prefix);
        if let Some(valid_through) = item.dirty_after {
            // The stored state may rely on the packs this clears (one a failed round wrote): the clear
            // must land with the new state, so this channel's packs are not cut into separate batches.
            writer.whole_channel = true;
            self.clear_after(&prefix, valid_through, &mut writer.batch)?;
        }
        // Packs of up to `pack_bytes_max`, across the memory table's runs.
        let mut pack: Vec<&Record> = Vec::new();
        let mut bytes = 0;
        let mut records = item.records.slices().flatten().peekable();
        while let Some(record) = records.next() {
            pack.push(record);
            bytes += record.encoded_len();
            if bytes >= self.config.pack_bytes_max || records.peek().is_none() {
                // The body under the round's key, the channel's index entry naming it: both in one batch
                // (a cut falls after them).
                let body = body_key(frames_before, &prefix, pack[0].seq);
                writer.batch.put_encoded(Keyspace::MessageBody, body.clone(), |out| {
                    out.reserve(4 + bytes);
                    encode_records(pack.iter().copied(), out);
                });
                writer.batch.put(Keyspace::MessagePack, pack_key(&prefix, pack[0].seq), &body);
                writer.added(bytes)?;
                pack.clear();
                bytes = 0;
            }
        }
        if item.state.retention_through.get() > 0 {
            self.trim_through(&prefix, item.state.retention_through, &mut writer.batch)?;
        }
        let through = item.records.last().map_or(item.older_through, |r| r.seq);
        let stored =
            StoredState { state: item.state.clone(), sled_through: through, frames_before, opening: self.opening };
        writer.batch.put(Keyspace::MessageState, prefix, &encode_state(&stored));
        writer.channel_done()
    }

    /// Removes records after `valid_through` from sled: the pack holding it is rewritten, later ones deleted.
    pub(super) fn clear_after(&self, prefix: &[u8], valid_through: Seq, batch: &mut KvBatch) -> StoreResult<()> {
        let up_to =
            KeyRange { start: pack_key(prefix, Seq::new(0)), end: Some(pack_key(prefix, valid_through.next())) };
        if let Some((key, body)) = self.kv.scan(Keyspace::MessagePack, &up_to, Direction::Reverse, 1)?.pop() {
            let records = self.read_pack(&key, &body)?;
            if records.last().is_some_and(|r| r.seq > valid_through) {
                let kept: Vec<Record> = records.into_iter().filter(|r| r.seq <= valid_through).collect();
                let mut pack = Vec::new();
                encode_records(&kept, &mut pack);
                batch.put(Keyspace::MessageBody, body, &pack);
            }
        }
        let mut after = KeyRange { start: pack_key(prefix, valid_through.next()), end: crate::kv::prefix_end(prefix) };
        loop {
            let page = self.kv.scan(Keyspace::MessagePack, &after, Direction::Forward, SCAN_PAGE)?;
            let done = page.len() < SCAN_PAGE;
            for (key, body) in page {
                after.start = [key.as_slice(), &[0]].concat();
                batch.delete(Keyspace::MessagePack, key);
                batch.delete(Keyspace::MessageBody, body);
            }
            if done {
                return Ok(());
            }
        }
    }

    /// Deletes packs whose records are all at or below `retention` (a bounded number per round).
    pub(super) fn trim_through(&self, prefix: &[u8], retention: Seq, batch: &mut KvBatch) -> StoreResult<()> {
        let range =
            KeyRange { start: pack_key(prefix, Seq::new(0)), end: Some(pack_key(prefix, retention.next().next())) };
        let packs = self.kv.scan(Keyspace::MessagePack, &range, Direction::Forward, SCAN_PAGE)?;
        // A pack is wholly retained-away when the next pack starts at or before the first readable seq.
        for pair in packs.windows(2) {
            let (key, body) = pair[0].clone();
            batch.delete(Keyspace::MessagePack, key);
            batch.delete(Keyspace::MessageBody, body);
        }
        Ok(())
    }
}

/// What write-behind persists of one channel.
pub(super) struct WriteBehindItem {
    channel: ChannelId,
    /// The channel's memory table, taken at the start of the round (shared with its `flushing`).
    records: Arc<MemTable>,
    state: ChannelLogState,
    older_through: Seq,
    dirty_after: Option<Seq>,
    generation: u64,
    changes: u64,
    /// The journal frame this item includes everything of its channel before: the position applied when
    /// it was taken.
    frames_before: u64,
}

/// Stops the background write-behind when dropped (after one last round).
pub struct WriteBehindThread {
    log: Arc<JournalLog>,
    thread: Option<JoinHandle<()>>,
}

impl Drop for WriteBehindThread {
    fn drop(&mut self) {
        self.log.stop.store(true, Ordering::SeqCst);
        {
            let _visible = self.log.visible.lock();
            self.log.write_behind_wanted.notify_all();
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        self.log.background.store(false, Ordering::SeqCst);
        if let Err(error) = self.log.write_behind() {
            tracing::warn!(%error, "final write-behind failed; the journal still holds the records");
        }
    }
}

/// Fills the sled batches of one write-behind round, applying each as it reaches
/// `write_behind_batch_channels` channels or `write_behind_batch_bytes` of packs: sled applies a batch
/// under a lock every other sled operation of the process waits for.
pub(super) struct RoundWriter<'a> {
    kv: &'a dyn Kv,
    /// Record bytes waiting in memory: no rests once they reach `rest_below` (a backlog costs more
    /// than other sled users waiting).
    mem_bytes: &'a AtomicUsize,
    rest_below: usize,
    batch: KvBatch,
    bytes: usize,
    channels: usize,
    bytes_max: usize,
    channels_max: usize,
    rest_percent: u32,
    /// The channel being added goes into one batch (no cut before its state).
    whole_channel: bool,
}

impl<'a> RoundWriter<'a> {
    fn new(kv: &'a dyn Kv, config: &JournalConfig, mem_bytes: &'a AtomicUsize) -> Self {
        Self {
            kv,
            mem_bytes,
            rest_below: config.mem_bytes_max / 2,
            batch: KvBatch::new(),
            bytes: 0,
            channels: 0,
            bytes_max: config.write_behind_batch_bytes,
            channels_max: config.write_behind_batch_channels,
            rest_percent: config.write_behind_rest_percent,
            whole_channel: false,
        }
    }

    /// A pack of `bytes` went into the batch.
    fn added(&mut self, bytes: usize) -> StoreResult<()> {
        self.bytes += bytes;
        if self.bytes >= self.bytes_max && !self.whole_channel {
            self.cut()?;
        }
        Ok(())
    }

    /// A channel's state went into the batch.
    fn channel_done(&mut self) -> StoreResult<()> {
        self.channels += 1;
        self.whole_channel = false;
        if self.channels >= self.channels_max || self.bytes >= self.bytes_max {
            self.cut()?;
        }
        Ok(())
    }

    #[allow(clippy::disallowed_methods)] // An adapter's background thread, not a core: rests are timed.
    fn cut(&mut self) -> StoreResult<()> {
        self.bytes = 0;
        self.channels = 0;
        if self.batch.is_empty() {
            return Ok(());
        }
        let started = Instant::now();
        self.kv.apply(std::mem::take(&mut self.batch))?;
        self.kv.write_out()?;
        if self.rest_percent > 0 && self.mem_bytes.load(Ordering::Relaxed) < self.rest_below {
            // Let the threads that waited for sled's lock meanwhile through before the next batch.
            std::thread::sleep(started.elapsed() * self.rest_percent / 100);
        }
        Ok(())
    }

    /// The round's last batch, with the journal checkpoint.
    fn finish(mut self, checkpoint: &Position) -> StoreResult<()> {
        self.batch.put(Keyspace::Journal, CHECKPOINT_KEY.to_vec(), &checkpoint.encode());
        self.cut()
    }
}
