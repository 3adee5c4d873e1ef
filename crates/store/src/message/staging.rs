//! Batches between `stage` and visibility: checked against the state they will find, grouped per sync,
//! marked durable when their sync succeeded, and handed out in order to be applied.
//!
//! Kept apart from [`LogCore`](super::core::LogCore) (the durable, visible state) so that a log can apply
//! one durable group while the next group is staged and made durable: applying a group of 1,000 batches
//! over 10,000 channels costs about as much CPU as the `fdatasync` that made it durable takes.

use super::core::EntryId;
use super::state::{ChannelLogState, LogBatch, LogOp, LogRefusal};
use super::LogLimits;
use crate::error::StoreResult;
use rustc_hash::FxHashMap;
use std::collections::VecDeque;
use tidings_types::ChannelId;

/// Receipt for one staged batch, to ask its [`BatchFate`] once a sync returned: with several threads
/// staging and syncing, one thread's failed write drops the batches others staged meanwhile.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Staged(u64);

/// What became of a staged batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BatchFate {
    /// Durable and visible.
    Durable,
    /// Dropped by a failed write or sync: not visible, and it will not reappear after a restart.
    Dropped,
    /// Not yet made durable by a sync that finished (or too old to tell: treat as failed).
    Pending,
}

/// Drops remembered for [`Staging::fate`]; each is a failed write or sync, so this covers any receipt a
/// caller still holds unless that many IO errors happened since.
const DROPS_REMEMBERED: usize = 1024;

/// Identifies a sync's group of batches from [`Staging::begin_sync`] to [`Staging::mark_durable`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SyncTicket {
    /// `drop_epoch` when the sync began: a different epoch at the end means its batches were dropped.
    epoch: u64,
    group: u64,
}

/// Batches one sync makes durable.
#[derive(Debug)]
pub(crate) struct Group<M> {
    id: u64,
    /// Receipts after the last batch of the group.
    end: u64,
    /// `Some(mark)` once durable; the mark is the implementation's (the journal's position after it).
    durable: Option<M>,
    pub(crate) batches: Vec<StagedBatch>,
}

/// A staged batch as it waits to be applied: its channel is named by its entry in the visible state (the
/// channel id itself is dropped by the staging thread, see [`EntryId`]).
#[derive(Debug)]
pub(crate) struct StagedBatch {
    pub(crate) entry: EntryId,
    pub(crate) ops: Vec<LogOp>,
}

/// What staging knows of a channel: its state after every staged batch, and its entry in the visible state.
#[derive(Debug)]
struct Tail {
    state: ChannelLogState,
    entry: EntryId,
    /// Receipt of the last batch staged for the channel (or one a later batch took: never too low).
    last_receipt: u64,
}

/// Staged and in-flight batches of a log. `M` is what the implementation records with a durable group.
#[derive(Debug)]
pub(crate) struct Staging<M> {
    limits: LogLimits,
    /// State each channel will have once every staged batch is applied. Kept across syncs (a channel's state
    /// is not copied again for each group commit) until the channel's replica leaves memory
    /// ([`Staging::forget_tail`]); stale after unsynced batches were dropped.
    tails: FxHashMap<ChannelId, Tail>,
    /// `tails` include dropped batches: rebuild them (after every durable group is applied) before staging.
    tails_stale: bool,
    staged: Vec<StagedBatch>,
    /// Groups of running or finished syncs, oldest first, not yet taken to be applied.
    in_flight: VecDeque<Group<M>>,
    next_group: u64,
    /// Receipt of the next batch staged.
    next_receipt: u64,
    /// Receipts below this were made durable or dropped.
    durable_end: u64,
    /// Receipts below this are in groups taken to be applied ([`Staging::take_durable`]) or were dropped.
    taken_end: u64,
    /// Ranges of receipts dropped, oldest first (at most [`DROPS_REMEMBERED`]).
    dropped: VecDeque<(u64, u64)>,
    /// Receipts below this may have been dropped by a range no longer remembered.
    forgotten_below: u64,
    /// Bumped whenever unsynced batches are dropped, so a sync that began before knows its batches are gone.
    drop_epoch: u64,
}

impl<M> Staging<M> {
    pub(crate) fn new(limits: LogLimits) -> Self {
        Self {
            limits,
            tails: FxHashMap::default(),
            tails_stale: false,
            staged: Vec::new(),
            in_flight: VecDeque::new(),
            next_group: 0,
            next_receipt: 0,
            durable_end: 0,
            taken_end: 0,
            dropped: VecDeque::new(),
            forgotten_below: 0,
            drop_epoch: 0,
        }
    }

    /// `true` if the tails must be rebuilt ([`Staging::refresh_tails`]) before the next
    /// [`Staging::stage`]; the caller applies every durable group first.
    pub(crate) fn tails_stale(&self) -> bool {
        self.tails_stale
    }

    /// Forgets the tails; call once every durable group is applied (tails are then read from the durable
    /// state again).
    pub(crate) fn refresh_tails(&mut self) {
        debug_assert!(self.in_flight.iter().all(|g| g.durable.is_none()), "durable groups applied first");
        self.tails.clear();
        self.tails_stale = false;
    }

    /// Checks `batch` against the state after every batch staged before it and advances its channel's tail
    /// past it; the caller then frames it and hands it to [`Staging::push`]. `durable` gives the visible
    /// state and entry of a channel with no tail (every batch of it is applied then).
    ///
    /// A refusal changes nothing. Once the check passed, the batch must be pushed, or the staged batches
    /// dropped ([`Staging::drop_unsynced`]): the tail already counts it.
    pub(crate) fn check(
        &mut self,
        batch: &LogBatch,
        durable: impl FnOnce(&ChannelId) -> StoreResult<(ChannelLogState, EntryId)>,
    ) -> StoreResult<EntryId> {
        debug_assert!(!self.tails_stale, "refresh_tails first");
        let records = batch.records().count();
        let bytes = batch.record_bytes();
        if records > self.limits.batch_records_max || bytes > self.limits.batch_bytes_max {
            return Err(LogRefusal::BatchTooLarge {
                records,
                bytes,
                records_max: self.limits.batch_records_max,
                bytes_max: self.limits.batch_bytes_max,
            }
            .into());
        }
        let tail = match self.tails.get_mut(&batch.channel) {
            Some(tail) => tail,
            None => {
                let (state, entry) = durable(&batch.channel)?;
                self.tails.entry(batch.channel.clone()).or_insert(Tail { state, entry, last_receipt: 0 })
            }
        };
        if let [op] = batch.ops.as_slice() {
            // One op: `apply` changes nothing when it refuses, so no copy is needed.
            tail.state.apply(&batch.channel, op)?;
        } else {
            let mut next = tail.state.clone();
            for op in &batch.ops {
                next.apply(&batch.channel, op)?;
            }
            tail.state = next;
        }
        // The receipt `push` gives this batch next.
        tail.last_receipt = self.next_receipt;
        Ok(tail.entry)
    }

    /// Forgets `channel`'s tail once none of its batches waits to be staged, synced or taken to be
    /// applied: the visible state then says the same, and the next batch reads it from there (the
    /// caller takes the visible state's lock only while holding this one, so a group taken is applied
    /// before that read). Called when the channel's replica leaves memory: otherwise every channel ever
    /// written keeps a copy of its state here. A channel with batches still on their way keeps its tail.
    ///
    /// Returns `true` if the channel still has a tail. Without one (and with tails not stale), no batch
    /// of the channel waits to be staged, synced or taken to be applied: its visible state says everything.
    pub(crate) fn forget_tail(&mut self, channel: &ChannelId) -> bool {
        let on_their_way =
            self.tails.get(channel).is_some_and(|t| !self.tails_stale && t.last_receipt >= self.taken_end);
        if !on_their_way && self.tails.remove(channel).is_some() {
            crate::shrink_if_sparse(&mut self.tails);
        }
        on_their_way
    }

    /// Number of channels with a tail.
    #[cfg(test)]
    pub(crate) fn tails_len(&self) -> usize {
        self.tails.len()
    }

    /// Stages `batch`, checked by [`Staging::check`] (which gave `entry`), and returns its receipt.
    pub(crate) fn push(&mut self, entry: EntryId, batch: LogBatch) -> Staged {
        // The channel id is dropped here, on the thread that just hashed it (see `EntryId`).
        self.staged.push(StagedBatch { entry, ops: batch.ops });
        let receipt = Staged(self.next_receipt);
        self.next_receipt += 1;
        receipt
    }

    /// `true` if batches are staged and not yet handed to a sync.
    pub(crate) fn has_staged(&self) -> bool {
        !self.staged.is_empty()
    }

    /// A sync begins: every staged batch joins its group. Returns the ticket for
    /// [`Staging::mark_durable`] and the number of batches in the group.
    pub(crate) fn begin_sync(&mut self) -> (SyncTicket, usize) {
        let id = self.next_group;
        self.next_group += 1;
        // The next group is likely as large as this one: room for it now, not by doubling while staging.
        let room = self.staged.len();
        let batches = std::mem::replace(&mut self.staged, Vec::with_capacity(room));
        let count = batches.len();
        self.in_flight.push_back(Group { id, end: self.next_receipt, durable: None, batches });
        (SyncTicket { epoch: self.drop_epoch, group: id }, count)
    }

    /// The sync of `ticket` succeeded: its group may be applied. `false` if its batches were dropped
    /// meanwhile (a failed write rolled the journal back).
    pub(crate) fn mark_durable(&mut self, ticket: SyncTicket, mark: M) -> bool {
        if ticket.epoch != self.drop_epoch {
            return false;
        }
        let group =
            self.in_flight.iter_mut().find(|g| g.id == ticket.group).expect("a group is dropped only with an epoch");
        group.durable = Some(mark);
        // Syncs run one at a time, so groups become durable in order.
        self.durable_end = group.end;
        true
    }

    /// Takes the durable groups at the front, oldest first: the caller applies them in this order (holding
    /// the visible state's lock from before it releases this one, so that appliers cannot overtake).
    pub(crate) fn take_durable(&mut self) -> Vec<(Vec<StagedBatch>, M)> {
        let mut out = Vec::new();
        while self.in_flight.front().is_some_and(|g| g.durable.is_some()) {
            let group = self.in_flight.pop_front().expect("checked");
            self.taken_end = group.end;
            out.push((group.batches, group.durable.expect("checked")));
        }
        out
    }

    /// Drops every batch not yet durable (staged, or in a sync still running): they failed. Durable groups
    /// stay, to be applied.
    pub(crate) fn drop_unsynced(&mut self) {
        self.staged.clear();
        self.in_flight.retain(|g| g.durable.is_some());
        self.tails_stale = true;
        self.drop_epoch += 1;
        if self.durable_end < self.next_receipt {
            if self.dropped.len() == DROPS_REMEMBERED {
                let (_, end) = self.dropped.pop_front().expect("full");
                self.forgotten_below = end;
            }
            self.dropped.push_back((self.durable_end, self.next_receipt));
            self.durable_end = self.next_receipt;
        }
    }

    /// What became of the batch `receipt` was given for.
    pub(crate) fn fate(&self, receipt: Staged) -> BatchFate {
        let n = receipt.0;
        if n >= self.durable_end || n < self.forgotten_below {
            return BatchFate::Pending;
        }
        if self.dropped.iter().any(|&(start, end)| (start..end).contains(&n)) {
            return BatchFate::Dropped;
        }
        BatchFate::Durable
    }
}
