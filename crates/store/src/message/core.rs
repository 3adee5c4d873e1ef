//! The durable, visible part of a message log that both implementations share: applying durable batches to per-channel state, memory tables and idempotency
//! windows, and serving reads from memory with older records supplied by the implementation.

use super::record::{IdempotencyKey, Record};
use super::staging::StagedBatch;
use super::state::{ChannelLogState, IdempotencyWindow, IdempotentHit, LogBatch, LogOp, LogRefusal, MemTable};
use super::state::{ReadBudget, ReadLimits};
use super::LogLimits;
use crate::error::StoreResult;
use rustc_hash::FxHashMap;
use std::collections::VecDeque;
use std::sync::Arc;
use tidings_types::{ChannelId, Seq};

/// Batches [`LogCore::warm`] reads ahead of applying them: enough misses to keep the CPU busy, few
/// enough that what they brought in is still cached when the apply reaches it.
const WARM_RUN: usize = 32;

/// Index of a channel's entry in [`LogCore`]; stable while the entry is in memory (a slot is reused only
/// after its entry left, and an entry leaves only when no staged batch names it: see
/// [`LogCore::drop_released`]).
///
/// Staging resolves it once per channel and hands it with each staged batch, so applying a durable group
/// neither hashes channel ids nor touches them: the id's bytes and reference count were last written by
/// the staging thread, and reading them on the applying thread cost a cache miss per batch (perf: about
/// half of the apply's time at 10,000 channels).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct EntryId(u32);

/// One channel as held in memory.
#[derive(Debug)]
pub(crate) struct ChannelEntry {
    pub(crate) channel: ChannelId,
    pub(crate) state: ChannelLogState,
    /// Records after those of `flushing` (after `older_through` when there is none), in memory.
    pub(crate) mem: MemTable,
    /// Records a write-behind round took out of `mem` to write into sled (shared with the round, which
    /// therefore copies nothing under the lock); readable here until the round finished. Only during a
    /// round: a finished round drops it, a failed one or a truncation puts its records back into `mem`.
    pub(crate) flushing: Option<Arc<MemTable>>,
    /// Records at or below this seq live in the implementation's older storage (sled), not in `mem`.
    pub(crate) older_through: Seq,
    /// Older storage may hold stale records after this seq (left by a truncation); the implementation
    /// removes them before writing there again.
    pub(crate) older_dirty_after: Option<Seq>,
    /// Bumped by every truncation, so write-behind can tell that its snapshot went stale.
    pub(crate) generation: u64,
    /// Boxed: built only for channels whose keys are looked up, and dropped on eviction, so most entries
    /// hold `None` (8 bytes instead of 64 inline).
    pub(crate) idempotency: Option<Box<IdempotencyWindow>>,
    /// Count of durable batches applied; write-behind persists the channel when it differs from
    /// `persisted_changes`.
    pub(crate) changes: u64,
    pub(crate) persisted_changes: u64,
    /// On [`LogCore`]'s list of changed entries (see [`LogCore::take_changed`]).
    listed: bool,
    /// Nothing in memory uses the channel (its replica left, or it was loaded only to be read): the entry
    /// may leave memory once everything it holds is in older storage ([`LogCore::drop_released`]).
    released: bool,
}

impl ChannelEntry {
    /// Puts the records of a write-behind round still running back in front of `mem` (before a change
    /// the shared copy cannot follow; the round sees the generation moved and writes nothing it relies on).
    pub(crate) fn unflush(&mut self) {
        if let Some(flushing) = self.flushing.take() {
            let mut records = (*flushing).clone();
            records.append(std::mem::take(&mut self.mem));
            self.mem = records;
        }
    }

    fn new(channel: ChannelId) -> Self {
        Self {
            channel,
            state: ChannelLogState::default(),
            mem: MemTable::default(),
            flushing: None,
            older_through: Seq::default(),
            // New to this process, not to the store: a round cut before the channel's state landed,
            // then a restart, leaves packs with no state saying so. Its first write-behind clears them
            // (one range scan that finds nothing for a channel really new).
            older_dirty_after: Some(Seq::default()),
            generation: 0,
            idempotency: None,
            changes: 0,
            persisted_changes: 0,
            listed: false,
            released: false,
        }
    }

    /// Everything the entry holds is in older storage, and no write-behind round holds it.
    fn is_written_behind(&self) -> bool {
        self.changes == self.persisted_changes && self.flushing.is_none() && self.mem.last().is_none()
    }
}

/// The entries, each boxed in a slot of one vector; a slot emptied by an entry that left memory is reused
/// by the next new one. Boxed so that entries that left cost 8 bytes at most (a burst of channels would
/// otherwise keep its whole footprint), and so that growing the vector copies pointers, not entries.
#[derive(Debug, Default)]
struct EntryTable {
    slots: Vec<Option<Box<ChannelEntry>>>,
    /// Empty slots.
    free: Vec<u32>,
}

impl EntryTable {
    /// Entries in memory.
    fn len(&self) -> usize {
        self.slots.len() - self.free.len()
    }

    fn insert(&mut self, entry: ChannelEntry) -> EntryId {
        let entry = Some(Box::new(entry));
        if let Some(slot) = self.free.pop() {
            self.slots[slot as usize] = entry;
            return EntryId(slot);
        }
        let slot = u32::try_from(self.slots.len()).expect("fewer than 2^32 channels in memory");
        self.slots.push(entry);
        EntryId(slot)
    }

    fn remove(&mut self, id: EntryId) -> Box<ChannelEntry> {
        let entry = self.slots[id.0 as usize].take().expect("an entry removed once");
        self.free.push(id.0);
        entry
    }

    /// Gives back the room of empty slots once most slots are empty.
    fn shrink_if_sparse(&mut self) {
        if self.slots.len() <= 4 * self.len() + 1024 {
            return;
        }
        while self.slots.last().is_some_and(Option::is_none) {
            self.slots.pop();
        }
        let len = self.slots.len();
        self.free.retain(|slot| (*slot as usize) < len);
        self.slots.shrink_to(2 * self.len() + 1024);
        self.free.shrink_to_fit();
    }

    fn iter_mut(&mut self) -> impl Iterator<Item = &mut ChannelEntry> {
        self.slots.iter_mut().flatten().map(|entry| &mut **entry)
    }
}

impl std::ops::Index<EntryId> for EntryTable {
    type Output = ChannelEntry;

    fn index(&self, id: EntryId) -> &ChannelEntry {
        self.slots[id.0 as usize].as_deref().expect("an id in use names an entry in memory")
    }
}

impl std::ops::IndexMut<EntryId> for EntryTable {
    fn index_mut(&mut self, id: EntryId) -> &mut ChannelEntry {
        self.slots[id.0 as usize].as_deref_mut().expect("an id in use names an entry in memory")
    }
}

/// Shared message-log state. Not thread-safe by itself: implementations hold it behind a lock.
///
/// A log backed by older storage ([`LogCore::backed`], the journal) lets entries leave memory: a
/// channel whose replica left ([`LogCore::release`]) keeps no entry once everything it holds is written
/// behind ([`LogCore::drop_released`]), and the implementation loads it again on its next use
/// ([`LogCore::insert_loaded`]). Without that, every channel a node ever wrote kept its entry here (208
/// bytes plus its index slot and heap parts: ~300 bytes, computed from the types' sizes).
#[derive(Debug)]
pub(crate) struct LogCore {
    /// Fx hashing: deterministic (no random seed), and cheap for the short ids channels have.
    index: FxHashMap<ChannelId, EntryId>,
    entries: EntryTable,
    /// Entries changed since write-behind last took them, each once (so a round's cost follows the
    /// channels written, not the channels in memory). Only when `backed`.
    changed: Vec<EntryId>,
    /// Channels released while in memory, to drop once written behind. May name a channel twice, or one
    /// whose entry left or was used again since. Only when `backed`.
    released: VecDeque<ChannelId>,
    backed: bool,
    pub(crate) mem_bytes: usize,
    pub(crate) limits: LogLimits,
}

impl LogCore {
    /// A log that keeps every entry in memory (nothing is written behind).
    pub(crate) fn new(limits: LogLimits) -> Self {
        Self {
            index: FxHashMap::default(),
            entries: EntryTable::default(),
            changed: Vec::new(),
            released: VecDeque::new(),
            backed: false,
            mem_bytes: 0,
            limits,
        }
    }

    /// A log whose records and states are written behind into older storage, from which the
    /// implementation loads the entries that left memory.
    pub(crate) fn backed(limits: LogLimits) -> Self {
        Self { backed: true, ..Self::new(limits) }
    }

    /// The entry of `channel`, created (empty: the state of a never-written channel) if it has none. A
    /// backed log's caller loads a channel's stored entry first ([`LogCore::insert_loaded`]).
    pub(crate) fn entry_id(&mut self, channel: &ChannelId) -> EntryId {
        if let Some(&id) = self.index.get(channel) {
            return id;
        }
        let id = self.entries.insert(ChannelEntry::new(channel.clone()));
        self.index.insert(channel.clone(), id);
        id
    }

    /// Puts back in memory the entry of `channel` as older storage holds it: its state and the last seq
    /// stored there. Released: it leaves again once written behind, unless staging takes it. Unless the
    /// caller knows better (`clean`), older storage may hold stale packs past `older_through` (a round
    /// cut before this state landed, before a restart), so its next write-behind clears them first.
    pub(crate) fn insert_loaded(
        &mut self,
        channel: &ChannelId,
        state: ChannelLogState,
        older_through: Seq,
        clean: bool,
    ) {
        debug_assert!(!self.index.contains_key(channel), "loaded only when not in memory");
        let mut entry = ChannelEntry::new(channel.clone());
        entry.state = state;
        entry.older_through = older_through;
        entry.older_dirty_after = (!clean).then_some(older_through);
        let id = self.entries.insert(entry);
        self.index.insert(channel.clone(), id);
        self.release(channel);
    }

    /// `true` if `channel`'s entry is in memory.
    pub(crate) fn contains(&self, channel: &ChannelId) -> bool {
        self.index.contains_key(channel)
    }

    /// Entries in memory.
    pub(crate) fn resident(&self) -> usize {
        self.entries.len()
    }

    /// The entry of `channel`, if it has one.
    pub(crate) fn get(&self, channel: &ChannelId) -> Option<&ChannelEntry> {
        self.index.get(channel).map(|&id| &self.entries[id])
    }

    /// The entry of `channel`, if it has one.
    pub(crate) fn get_mut(&mut self, channel: &ChannelId) -> Option<&mut ChannelEntry> {
        self.index.get(channel).map(|&id| &mut self.entries[id])
    }

    /// The durable state of `channel` and its entry (created if it has none): where staging starts a
    /// channel's tail. The entry is in use again: it stays in memory until released.
    pub(crate) fn durable_tail(&mut self, channel: &ChannelId) -> (ChannelLogState, EntryId) {
        let id = self.entry_id(channel);
        let entry = &mut self.entries[id];
        entry.released = false;
        (entry.state.clone(), id)
    }

    /// The entries listed as changed since their last write-behind, for a write-behind round to take (see
    /// [`LogCore::take_changed`]). They stay marked listed until taken, so none is listed twice; entries
    /// changed from now on go on a new list, for the next round. O(1): the list moves out.
    pub(crate) fn changed_list(&mut self) -> Vec<EntryId> {
        std::mem::take(&mut self.changed)
    }

    /// Takes the entries `ids` of a [`LogCore::changed_list`]: each one's memory table moves to
    /// `flushing` (an `Arc` shared with the caller: no record is copied), and `make` builds the caller's
    /// item from the entry. The ids stay valid while the caller lets go of the log's lock between calls:
    /// an entry listed as changed never leaves memory. A backed log only (others list no changes).
    pub(crate) fn take_changed<T>(
        &mut self,
        ids: &[EntryId],
        mut make: impl FnMut(&ChannelEntry, Arc<MemTable>) -> T,
    ) -> Vec<T> {
        debug_assert!(self.backed, "only a backed log writes behind");
        let mut taken = Vec::with_capacity(ids.len());
        for &id in ids {
            let entry = &mut self.entries[id];
            entry.listed = false;
            if entry.changes == entry.persisted_changes {
                continue;
            }
            // Every round ends by dropping its tables or putting them back; should one not have, its records
            // go first rather than being lost.
            debug_assert!(entry.flushing.is_none(), "one write-behind round at a time");
            entry.unflush();
            let records = Arc::new(std::mem::take(&mut entry.mem));
            entry.flushing = Some(Arc::clone(&records));
            taken.push(make(entry, records));
        }
        taken
    }

    /// Lists `channel` for the next write-behind again if it still holds changes not written behind (after
    /// a round that failed or that a truncation overtook).
    pub(crate) fn relist(&mut self, channel: &ChannelId) {
        let Some(&id) = self.index.get(channel) else { return };
        let entry = &mut self.entries[id];
        if self.backed && !entry.listed && entry.changes != entry.persisted_changes {
            entry.listed = true;
            self.changed.push(id);
        }
    }

    /// Takes out of memory the entries of released channels that are written behind and that `in_use`
    /// (the caller's staging) does not name, looking at the first `budget` listed channels (those that
    /// must stay go to the back of the list); returns how many left memory and how many were looked at.
    /// The caller must make sure that no staged batch not yet applied names a channel for which `in_use`
    /// is `false`: such a batch would be applied to whatever entry takes the slot next.
    pub(crate) fn drop_released(
        &mut self,
        budget: usize,
        mut in_use: impl FnMut(&ChannelId) -> bool,
    ) -> (usize, usize) {
        let mut dropped = 0;
        let looked_at = budget.min(self.released.len());
        for _ in 0..looked_at {
            let Some(channel) = self.released.pop_front() else { break };
            let Some(&id) = self.index.get(&channel) else { continue };
            let entry = &self.entries[id];
            if !entry.released {
                continue;
            }
            if !entry.is_written_behind() || in_use(&channel) {
                self.released.push_back(channel);
                continue;
            }
            debug_assert!(!entry.listed, "an entry written behind is not listed as changed");
            self.index.remove(&channel);
            self.entries.remove(id);
            dropped += 1;
        }
        crate::shrink_if_sparse(&mut self.index);
        self.entries.shrink_if_sparse();
        if self.released.capacity() > 4 * self.released.len() + 1024 {
            // A burst of evictions listed hundreds of thousands: 24 bytes each, kept for good otherwise.
            self.released.shrink_to(2 * self.released.len());
        }
        (dropped, looked_at)
    }

    /// Channels listed as released (some may have left memory or be in use again since).
    pub(crate) fn released_listed(&self) -> usize {
        self.released.len()
    }

    /// Applies durable groups, oldest first (from [`Staging::take_durable`](super::staging::Staging)).
    pub(crate) fn apply_groups<M>(&mut self, groups: Vec<(Vec<StagedBatch>, M)>) -> Option<M> {
        let mut last = None;
        for (mut batches, mark) in groups {
            for run in batches.chunks_mut(WARM_RUN) {
                self.warm(run);
                for batch in run {
                    // Cannot fail: each batch was checked at stage time against exactly the state it meets now.
                    self.apply_ops(batch.entry, std::mem::take(&mut batch.ops))
                        .expect("staged batch applies to the state it was checked against");
                }
            }
            last = Some(mark);
        }
        last
    }

    /// Reads what applying `run` will touch, in a loop small enough that the CPU keeps many of its cache
    /// misses in flight at once. A staged batch was built on another thread: its ops, its records and its
    /// channel's memory table are each a cache miss away, one behind the other, and the apply loop is too
    /// long for the CPU to overlap one batch's misses with the next's (perf at 10,000 channels: the apply
    /// spent about 85% of its time waiting on the first record load and the memory-table store).
    fn warm(&self, run: &[StagedBatch]) {
        let mut touched = 0u64;
        for batch in run {
            if let Some(LogOp::Append(records)) = batch.ops.first() {
                touched ^= records.first().map_or(0, |r| r.seq.get());
            }
            let entry = &self.entries[batch.entry];
            touched ^= entry.changes ^ entry.mem.last().map_or(0, |r| r.seq.get());
        }
        std::hint::black_box(touched);
    }

    /// Applies a durable batch: state, memory table, idempotency window. The batch was checked when staged
    /// (or is replayed from a checked journal), so a refusal here means the durable log is inconsistent.
    ///
    /// Takes the batch by value: its records move into the memory table (no copy on the hot path).
    pub(crate) fn apply_durable(&mut self, batch: LogBatch) -> Result<(), LogRefusal> {
        let entry = self.entry_id(&batch.channel);
        self.apply_ops(entry, batch.ops)
    }

    /// [`LogCore::apply_durable`] for the channel of entry `id`.
    fn apply_ops(&mut self, id: EntryId, ops: Vec<LogOp>) -> Result<(), LogRefusal> {
        let entry = &mut self.entries[id];
        entry.changes += 1;
        if self.backed && !entry.listed {
            entry.listed = true;
            self.changed.push(id);
        }
        for op in ops {
            entry.state.apply(&entry.channel, &op)?;
            match op {
                LogOp::Append(records) => {
                    for record in records {
                        if let Some(window) = entry.idempotency.as_mut() {
                            window.insert(&record);
                        }
                        self.mem_bytes += record.encoded_len();
                        entry.mem.push(record);
                    }
                }
                LogOp::TruncateAfter(to) => {
                    entry.unflush();
                    let before = entry.mem.bytes();
                    entry.mem.truncate_after(to);
                    self.mem_bytes -= before - entry.mem.bytes();
                    // The window must cover the last seqs of the shortened log: rebuild it on the next lookup.
                    entry.idempotency = None;
                    if to < entry.older_through {
                        entry.older_through = to;
                        entry.older_dirty_after = Some(entry.older_dirty_after.map_or(to, |d| d.min(to)));
                    }
                    entry.generation += 1;
                }
                LogOp::SetRetention(through) => {
                    let before = entry.mem.bytes();
                    entry.mem.drop_through(through);
                    self.mem_bytes -= before - entry.mem.bytes();
                }
                LogOp::StartAfter { seq, .. } => {
                    entry.unflush();
                    entry.older_through = seq;
                    entry.generation += 1;
                }
                LogOp::Forget { .. } => {
                    entry.unflush();
                    self.mem_bytes -= entry.mem.bytes();
                    entry.mem = MemTable::default();
                    entry.idempotency = None;
                    // Every pack in older storage is stale now: the next write-behind clears them all and
                    // stores the tombstone as the channel's state.
                    entry.older_through = Seq::default();
                    entry.older_dirty_after = Some(Seq::default());
                    entry.generation += 1;
                }
                LogOp::CheckpointHw(_)
                | LogOp::CheckpointFanned(_)
                | LogOp::RaiseMetaFloor { .. }
                | LogOp::ProposeIsr { .. } => {}
            }
        }
        Ok(())
    }

    /// Up to `limit` channels in memory whose log holds something (not a tombstone), in key order after
    /// `after` (a log without older storage lists its channels from here). O(channels in memory).
    pub(crate) fn logs_after(&self, after: Option<&ChannelId>, limit: usize) -> Vec<ChannelId> {
        let mut listed: Vec<&ChannelId> = self
            .index
            .iter()
            .filter(|(channel, id)| after.is_none_or(|a| *channel > a) && !self.entries[**id].state.is_empty())
            .map(|(channel, _)| channel)
            .collect();
        listed.sort_unstable();
        listed.into_iter().take(limit).cloned().collect()
    }

    /// The durable state of `channel` (a never-written channel has the default state).
    pub(crate) fn state(&self, channel: &ChannelId) -> ChannelLogState {
        self.get(channel).map(|e| e.state.clone()).unwrap_or_default()
    }

    /// Reads records of `channel` in `[from, through]` (clamped to the readable range) within `limits`;
    /// `older` supplies records at or below the memory table's start.
    pub(crate) fn read(
        &self,
        channel: &ChannelId,
        from: Seq,
        through: Seq,
        limits: ReadLimits,
        older: impl FnOnce(Seq, Seq, &mut ReadBudget, &mut Vec<Record>) -> StoreResult<()>,
    ) -> StoreResult<Vec<Record>> {
        let Some(entry) = self.get(channel) else { return Ok(Vec::new()) };
        let from = from.max(entry.state.retention_through.next());
        let through = through.min(entry.state.last_seq);
        let mut out = Vec::new();
        if from > through {
            return Ok(out);
        }
        let mut budget = ReadBudget::new(limits);
        if from <= entry.older_through {
            older(from, through.min(entry.older_through), &mut budget, &mut out)?;
            if budget.exhausted() || out.last().is_some_and(|r| r.seq >= through) {
                return Ok(out);
            }
        }
        if let Some(flushing) = &entry.flushing {
            let next = out.last().map_or(from, |r| r.seq.next());
            flushing.read(next, through, &mut budget, &mut out);
            if budget.exhausted() || out.last().is_some_and(|r| r.seq >= through) {
                return Ok(out);
            }
        }
        let next = out.last().map_or(from, |r| r.seq.next());
        entry.mem.read(next, through, &mut budget, &mut out);
        Ok(out)
    }

    /// Looks `key` up in `channel`'s idempotency window, building the window first from the channel's last
    /// records if it is not in memory (`load` reads `[from, through]`).
    pub(crate) fn idempotency(
        &mut self,
        channel: &ChannelId,
        key: &IdempotencyKey,
        load: impl FnOnce(&LogCore, Seq, Seq) -> StoreResult<Vec<Record>>,
    ) -> StoreResult<Option<IdempotentHit>> {
        let window_size = self.limits.idempotency_window;
        let Some(entry) = self.get(channel) else { return Ok(None) };
        if entry.idempotency.is_none() {
            let last = entry.state.last_seq;
            let from = Seq::new(last.get().saturating_sub(window_size as u64).saturating_add(1));
            let records = load(self, from, last)?;
            let mut window = IdempotencyWindow::new(window_size);
            for record in &records {
                window.insert(record);
            }
            self.get_mut(channel).expect("checked above").idempotency = Some(Box::new(window));
        }
        Ok(self.get(channel).and_then(|e| e.idempotency.as_ref()).and_then(|w| w.get(key)))
    }

    /// Drops every channel's idempotency window from memory (rebuilt on the next lookup).
    pub(crate) fn release_all_caches(&mut self) {
        for entry in self.entries.iter_mut() {
            entry.idempotency = None;
        }
    }

    /// Nothing in memory uses `channel` any more: its idempotency window goes now (rebuilt on the next
    /// lookup), and in a backed log its entry once written behind ([`LogCore::drop_released`]).
    pub(crate) fn release(&mut self, channel: &ChannelId) {
        let Some(&id) = self.index.get(channel) else { return };
        let entry = &mut self.entries[id];
        entry.idempotency = None;
        if self.backed && !entry.released {
            entry.released = true;
            self.released.push_back(channel.clone());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::LogLimits;
    use tidings_types::ChannelType;

    fn channel() -> ChannelId {
        ChannelId::new(ChannelType::GROUP, "g").unwrap()
    }

    fn append(from: u64, count: u64) -> LogBatch {
        crate::message::test_append(&channel(), from, count)
    }

    fn seqs(core: &LogCore, records_max: usize) -> Vec<u64> {
        let limits = ReadLimits { records_max, bytes_max: usize::MAX };
        let read = core.read(&channel(), Seq::new(1), Seq::new(u64::MAX), limits, |_, _, _, _| Ok(())).unwrap();
        read.iter().map(|r| r.seq.get()).collect()
    }

    fn named(i: usize) -> ChannelId {
        ChannelId::new(ChannelType::GROUP, &format!("c{i}")).unwrap()
    }

    /// Marks everything written behind, as a finished round does.
    fn write_behind(core: &mut LogCore) {
        let ids = core.changed_list();
        let taken = core.take_changed(&ids, |e, _| (e.channel.clone(), e.changes));
        for (channel, changes) in taken {
            let entry = core.get_mut(&channel).unwrap();
            entry.persisted_changes = changes;
            entry.flushing = None;
        }
    }

    #[test]
    fn entries_keep_their_ids_and_states_and_only_released_written_behind_ones_leave() {
        let mut core = LogCore::backed(LogLimits::default());
        let channels: Vec<ChannelId> = (0..100).map(named).collect();
        let ids: Vec<EntryId> = channels.iter().map(|c| core.durable_tail(c).1).collect();
        for (i, channel) in channels.iter().enumerate().step_by(7) {
            core.apply_durable(crate::message::test_append(channel, 1, i as u64 % 3 + 1)).unwrap();
        }
        for (i, (channel, id)) in channels.iter().zip(&ids).enumerate() {
            assert_eq!(core.entry_id(channel), *id, "ids are stable");
            let expected = if i % 7 == 0 { i as u64 % 3 + 1 } else { 0 };
            assert_eq!(core.state(channel).last_seq, Seq::new(expected), "{channel}");
            assert_eq!(&core.entries[*id].channel, channel);
        }
        // Released: the odd ones. Not yet written behind: the written ones among them stay.
        channels.iter().skip(1).step_by(2).for_each(|c| core.release(c));
        let busy = &channels[3];
        let (dropped, looked_at) = core.drop_released(usize::MAX, |c| c == busy);
        let written_odd = (1..100).step_by(2).filter(|i| i % 7 == 0).count();
        assert_eq!((dropped, looked_at), (50 - written_odd - 1, 50));
        assert!(core.contains(busy), "an entry staging names stays");
        write_behind(&mut core);
        assert_eq!(core.drop_released(usize::MAX, |_| false), (written_odd + 1, written_odd + 1));
        assert_eq!(core.resident(), 50);
        for (i, channel) in channels.iter().enumerate() {
            assert_eq!(core.contains(channel), i % 2 == 0, "{channel}");
        }
        // A staged-to entry is in use again and stays; the slots left empty are reused.
        core.release(&channels[0]);
        core.durable_tail(&channels[0]);
        assert_eq!(core.drop_released(usize::MAX, |_| false), (0, 1));
        let again = core.entry_id(&named(1000));
        assert!(ids.contains(&again), "a new entry takes an empty slot");
        // The budget bounds the work of one call, and what must stay goes to the back: the next call
        // looks at the others first.
        channels.iter().step_by(2).skip(1).for_each(|c| core.release(c));
        let first_ten: Vec<ChannelId> = channels.iter().step_by(2).skip(1).take(10).cloned().collect();
        assert_eq!(core.drop_released(10, |c| first_ten.contains(c)), (0, 10));
        assert_eq!(core.drop_released(39, |c| first_ten.contains(c)), (39, 39));
        assert_eq!(core.released_listed(), 10);
        assert_eq!(core.drop_released(usize::MAX, |_| false), (10, 10));
    }

    /// The room a burst of channels took (slots, index, released list) is given back once they left.
    #[test]
    fn a_burst_of_entries_that_left_gives_its_room_back() {
        let mut core = LogCore::backed(LogLimits::default());
        let channels: Vec<ChannelId> = (0..20_000).map(named).collect();
        channels.iter().for_each(|c| {
            core.durable_tail(c);
            core.release(c);
        });
        assert_eq!(core.drop_released(usize::MAX, |_| false), (20_000, 20_000));
        assert_eq!(core.resident(), 0);
        assert!(core.entries.slots.capacity() <= 1024, "{}", core.entries.slots.capacity());
        assert!(core.released.capacity() <= 1024, "{}", core.released.capacity());
        assert!(core.index.capacity() <= 1024, "{}", core.index.capacity());
    }

    /// Write-behind takes a memory table without copying it: its records stay readable (in order with those
    /// appended meanwhile, within the read's limits), and a truncation meanwhile puts them back into memory
    /// before it cuts.
    #[test]
    fn records_taken_by_write_behind_stay_readable_and_a_truncation_puts_them_back() {
        let mut core = LogCore::backed(LogLimits::default());
        core.apply_durable(append(1, 5)).unwrap();
        let per_record = core.mem_bytes / 5;
        let ids = core.changed_list();
        let taken = core.take_changed(&ids, |_, records| records);
        assert_eq!((taken.len(), taken[0].len()), (1, 5));
        assert!(core.get(&channel()).unwrap().mem.last().is_none(), "taken, not copied");
        core.apply_durable(append(6, 3)).unwrap();
        assert_eq!(seqs(&core, usize::MAX), (1..=8).collect::<Vec<_>>());
        assert_eq!(seqs(&core, 6), (1..=6).collect::<Vec<_>>(), "the limit spans the taken records and memory");
        assert_eq!(core.mem_bytes, 8 * per_record, "taken records count until their round finished");
        core.apply_durable(LogBatch::new(channel(), vec![LogOp::TruncateAfter(Seq::new(4))])).unwrap();
        let entry = core.get(&channel()).unwrap();
        assert!(entry.flushing.is_none(), "the truncation took the records back");
        assert_eq!(seqs(&core, usize::MAX), vec![1, 2, 3, 4]);
        assert_eq!(core.mem_bytes, 4 * per_record);
    }
}
