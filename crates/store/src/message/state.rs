//! Per-channel log state shared by every message-log implementation: the checks and transitions of log
//! operations, the epoch history, the in-memory table of recent records, and the idempotency window.

use super::record::{IdempotencyKey, Record, RecordKind};
use crate::error::StoreError;
use std::collections::{BTreeMap, VecDeque};
use tidings_types::{ChannelId, LeaderEpoch, NodeId, Seq};

/// One operation on a channel log. Operations of a batch apply in order, atomically.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LogOp {
    /// Appends records with consecutive seqs following the log's last seq; leader epochs never decrease.
    Append(Vec<Record>),
    /// Removes every record after `seq` (a divergent suffix). Never below the checkpointed HW.
    TruncateAfter(Seq),
    /// Checkpoints the high watermark. Never beyond the last seq, never backwards.
    CheckpointHw(Seq),
    /// Moves the logical retention boundary: records at or below it are no longer readable and may be
    /// removed physically. Never beyond the checkpointed HW, never backwards.
    SetRetention(Seq),
    /// Records how far post-commit fanout is known to have finished (every message at or below the seq
    /// was fanned out), so that a replica that leads after a restart fans out again only what may not
    /// have been. Never beyond the checkpointed HW, never backwards.
    CheckpointFanned(Seq),
    /// Starts an empty log after `seq` (a replica that joins after the leader trimmed its history): sets
    /// last seq, HW, retention and fanout's progress to `seq`, with `epoch` as the epoch in force.
    StartAfter {
        /// Last seq the log skips.
        seq: Seq,
        /// The leader epoch in force at `seq`.
        epoch: LeaderEpoch,
    },
    /// Forgets the log: every record and the state go, and a later batch starts again at seq 1. What
    /// stays is a tombstone: the meta floor rises to `version`, the channel meta version that named
    /// this node no replica (`ChannelLogState::meta_floor`), so that no older meta, read from a stale
    /// copy, can ever make this empty log act as the replica it was (a leader that led an epoch before
    /// would lead it again). The meta at `version` itself names no replica here, so it cannot; and it
    /// must stay usable, as the meta in force, for this node to route the channel's calls to its leader. For a replica its channel no longer names: the caller must know it holds nothing the
    /// channel still needs (see `tidings::Node`'s stray-log sweep). The only operation that lowers the
    /// HW, which is why nothing else may take its place.
    Forget {
        /// The meta version that removed this node's replica.
        version: u64,
    },
    /// Raises the meta floor (`ChannelLogState::meta_floor`) to `version`, never lowers it: this replica
    /// answered a controller under that channel meta, which may act on the answer (a switch of leader),
    /// so no older meta — read after a restart from a slot replica that has not applied the newer one —
    /// may ever make it act as before.
    RaiseMetaFloor {
        /// The meta version the replica answered under.
        version: u64,
    },
    /// Records an ISR this replica, leading, proposes from channel meta version `from_version`
    /// (`ChannelLogState::isr_proposals`), written before the proposal leaves it. Proposals from an
    /// older version are dropped; one from an older version than those kept changes nothing.
    ProposeIsr {
        /// The meta version the proposal is based on (it compares and sets that version).
        from_version: u64,
        /// The ISR proposed.
        isr: Vec<NodeId>,
    },
}

/// Most ISRs a log keeps proposed from one meta version ([`LogOp::ProposeIsr`]).
pub const ISR_PROPOSALS_MAX: usize = 4;

/// Operations on one channel's log, applied atomically and in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LogBatch {
    /// The channel.
    pub channel: ChannelId,
    /// The operations.
    pub ops: Vec<LogOp>,
}

impl LogBatch {
    /// A batch of `ops` for `channel`.
    pub fn new(channel: ChannelId, ops: Vec<LogOp>) -> Self {
        Self { channel, ops }
    }

    /// Encoded size of the records this batch appends.
    pub fn record_bytes(&self) -> usize {
        self.records().map(Record::encoded_len).sum()
    }

    /// The records this batch appends, in order.
    pub fn records(&self) -> impl Iterator<Item = &Record> {
        self.ops.iter().flat_map(|op| match op {
            LogOp::Append(records) => records.as_slice(),
            _ => &[],
        })
    }
}

/// Why a log operation was refused. The log is unchanged.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LogRefusal {
    /// An appended record does not follow the log's last seq.
    #[error("{channel}: record {got} does not follow last seq {last}")]
    NotContiguous {
        /// The channel.
        channel: ChannelId,
        /// The log's last seq.
        last: Seq,
        /// The refused record's seq.
        got: Seq,
    },
    /// An appended record carries an older leader epoch than the log's last record.
    #[error("{channel}: record {seq} has leader epoch {got}, older than the log's {last}")]
    EpochRegression {
        /// The channel.
        channel: ChannelId,
        /// The refused record's seq.
        seq: Seq,
        /// The log's last leader epoch.
        last: LeaderEpoch,
        /// The refused record's epoch.
        got: LeaderEpoch,
    },
    /// A truncation would remove records at or below the checkpointed high watermark.
    #[error("{channel}: truncation after {to} would remove records below HW {hw}")]
    TruncateBelowHw {
        /// The channel.
        channel: ChannelId,
        /// Requested last kept seq.
        to: Seq,
        /// Checkpointed HW.
        hw: Seq,
    },
    /// A high watermark beyond the log's end, or below the checkpointed one.
    #[error("{channel}: HW {got} is outside [{hw}, {last}]")]
    BadHw {
        /// The channel.
        channel: ChannelId,
        /// Refused HW.
        got: Seq,
        /// Checkpointed HW.
        hw: Seq,
        /// The log's last seq.
        last: Seq,
    },
    /// A retention boundary beyond the HW, or below the current boundary.
    #[error("{channel}: retention {got} is outside [{current}, {hw}]")]
    BadRetention {
        /// The channel.
        channel: ChannelId,
        /// Refused boundary.
        got: Seq,
        /// Current boundary.
        current: Seq,
        /// Checkpointed HW.
        hw: Seq,
    },
    /// A fanout checkpoint beyond the HW, or below the checkpointed one.
    #[error("{channel}: fanned through {got} is outside [{current}, {hw}]")]
    BadFanned {
        /// The channel.
        channel: ChannelId,
        /// Refused checkpoint.
        got: Seq,
        /// Checkpointed fanout progress.
        current: Seq,
        /// Checkpointed HW.
        hw: Seq,
    },
    /// `StartAfter` on a log that still holds readable records, or that would move it backwards.
    #[error("{channel}: cannot start after {seq}: log holds records through {last}")]
    NotEmpty {
        /// The channel.
        channel: ChannelId,
        /// Requested start.
        seq: Seq,
        /// The log's last seq.
        last: Seq,
    },
    /// The batch exceeds the configured record count or byte limit.
    #[error("batch of {records} records / {bytes} bytes exceeds the limit of {records_max} / {bytes_max}")]
    BatchTooLarge {
        /// Records in the batch.
        records: usize,
        /// Record bytes in the batch.
        bytes: usize,
        /// Record limit.
        records_max: usize,
        /// Byte limit.
        bytes_max: usize,
    },
    /// A proposed ISR past [`ISR_PROPOSALS_MAX`] kept from one meta version.
    #[error("{channel}: already {ISR_PROPOSALS_MAX} ISRs proposed from meta version {from_version}")]
    TooManyIsrProposals {
        /// The channel.
        channel: ChannelId,
        /// The meta version they were proposed from.
        from_version: u64,
    },
}

/// Durable state of one channel log, apart from its records.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ChannelLogState {
    /// Seq of the last record (0 when none was ever written). The log end offset is `last_seq + 1`.
    pub last_seq: Seq,
    /// `(leader_epoch, start_seq)` for each epoch that wrote records, ascending. Consistent with
    /// truncation: no entry starts after `last_seq`.
    pub epochs: Vec<(LeaderEpoch, Seq)>,
    /// Checkpointed high watermark.
    pub hw: Seq,
    /// Records at or below this seq are no longer readable.
    pub retention_through: Seq,
    /// Every message at or below this seq finished its post-commit fanout, as this replica knew at its
    /// last checkpoint; 0: nothing known.
    pub fanned_through: Seq,
    /// The oldest channel meta version this replica may act under (0: any): an older meta is stale
    /// here for good. Raised to the meta that removed this node's replica when its log was forgotten
    /// ([`LogOp::Forget`]), and to the meta a controller's evidence request came under
    /// ([`LogOp::RaiseMetaFloor`]). Kept across every later write (a replica added back by a newer meta).
    pub meta_floor: u64,
    /// The ISRs this replica proposed, as its channel's leader, from the newest meta version it proposed
    /// from (at most [`ISR_PROPOSALS_MAX`], all from that one version), each durable before it was
    /// sent: one of them may be in force without this replica having heard. A leader that comes back
    /// under that version — evicted, or restarted — counts HW under each of them too, as the
    /// incarnation that proposed them did: counted under the older ISR alone, a record committed on
    /// members the proposal left out was on fewer than MinISR of the ISR in force, and a failover's
    /// evidence from the others lost it.
    pub isr_proposals: Vec<(u64, Vec<NodeId>)>,
}

impl ChannelLogState {
    /// `true` if the log holds nothing (never written, or forgotten: a tombstone at most).
    pub fn is_empty(&self) -> bool {
        *self == ChannelLogState { meta_floor: self.meta_floor, ..ChannelLogState::default() }
    }

    /// Leader epoch of the last record (0 if the log never held one).
    pub fn last_epoch(&self) -> LeaderEpoch {
        self.epochs.last().map_or(LeaderEpoch::new(0), |(epoch, _)| *epoch)
    }

    /// For divergence checks (KIP-101/279): the largest epoch in this log at or below `epoch`, and the
    /// last seq written under it (the seq before the next epoch starts, or the log's last seq).
    /// `(0, 0)` when this log has no epoch at or below `epoch`.
    pub fn end_of_epoch(&self, epoch: LeaderEpoch) -> (LeaderEpoch, Seq) {
        end_of_epoch(&self.epochs, self.last_seq, epoch)
    }

    /// The leader epoch that wrote `seq`, if `seq` is in the log's range.
    pub fn epoch_of(&self, seq: Seq) -> Option<LeaderEpoch> {
        if seq > self.last_seq || seq.get() == 0 {
            return None;
        }
        let at = self.epochs.partition_point(|(_, start)| *start <= seq);
        at.checked_sub(1).map(|i| self.epochs[i].0)
    }

    /// Checks `op` against this state and applies it. On refusal, the state is unchanged.
    pub fn apply(&mut self, channel: &ChannelId, op: &LogOp) -> Result<(), LogRefusal> {
        match op {
            LogOp::Append(records) => self.append(channel, records),
            LogOp::TruncateAfter(to) => {
                if *to >= self.last_seq {
                    return Ok(());
                }
                if *to < self.hw {
                    return Err(LogRefusal::TruncateBelowHw { channel: channel.clone(), to: *to, hw: self.hw });
                }
                self.last_seq = *to;
                // An epoch whose first record is gone no longer exists in this log.
                self.epochs.retain(|(_, start)| *start <= *to);
                Ok(())
            }
            LogOp::CheckpointHw(hw) => {
                if *hw < self.hw || *hw > self.last_seq {
                    return Err(LogRefusal::BadHw {
                        channel: channel.clone(),
                        got: *hw,
                        hw: self.hw,
                        last: self.last_seq,
                    });
                }
                self.hw = *hw;
                Ok(())
            }
            LogOp::SetRetention(through) => {
                if *through < self.retention_through || *through > self.hw {
                    return Err(LogRefusal::BadRetention {
                        channel: channel.clone(),
                        got: *through,
                        current: self.retention_through,
                        hw: self.hw,
                    });
                }
                self.retention_through = *through;
                // Keep the epoch in force at the boundary itself and every later one: a follower whose
                // last record is the boundary proves its log consistent by that record's epoch (the
                // divergence check), which must stay in the history even when the next record starts a
                // new epoch.
                let keep_from = self.epochs.partition_point(|(_, start)| *start <= *through).saturating_sub(1);
                self.epochs.drain(..keep_from);
                Ok(())
            }
            LogOp::CheckpointFanned(through) => {
                if *through < self.fanned_through || *through > self.hw {
                    return Err(LogRefusal::BadFanned {
                        channel: channel.clone(),
                        got: *through,
                        current: self.fanned_through,
                        hw: self.hw,
                    });
                }
                self.fanned_through = *through;
                Ok(())
            }
            LogOp::StartAfter { seq, epoch } => {
                if self.last_seq > self.retention_through || *seq < self.last_seq {
                    return Err(LogRefusal::NotEmpty { channel: channel.clone(), seq: *seq, last: self.last_seq });
                }
                self.last_seq = *seq;
                self.hw = *seq;
                self.retention_through = *seq;
                self.fanned_through = *seq;
                self.epochs = vec![(*epoch, *seq)];
                Ok(())
            }
            LogOp::Forget { version } => {
                let meta_floor = self.meta_floor.max(*version);
                *self = ChannelLogState { meta_floor, ..ChannelLogState::default() };
                Ok(())
            }
            LogOp::RaiseMetaFloor { version } => {
                self.meta_floor = self.meta_floor.max(*version);
                Ok(())
            }
            LogOp::ProposeIsr { from_version, isr } => self.propose_isr(channel, *from_version, isr),
        }
    }

    fn propose_isr(&mut self, channel: &ChannelId, from_version: u64, isr: &[NodeId]) -> Result<(), LogRefusal> {
        let kept_from = self.isr_proposals.first().map_or(0, |(version, _)| *version);
        let known = from_version == kept_from && self.isr_proposals.iter().any(|(_, kept)| kept == isr);
        if from_version < kept_from || known {
            return Ok(());
        }
        if from_version > kept_from {
            // A proposal from a newer version: the one it is based on is in force, so each proposal
            // from an older one lost its compare-and-set or is that version.
            self.isr_proposals.clear();
        }
        if self.isr_proposals.len() >= ISR_PROPOSALS_MAX {
            return Err(LogRefusal::TooManyIsrProposals { channel: channel.clone(), from_version });
        }
        self.isr_proposals.push((from_version, isr.to_vec()));
        Ok(())
    }

    fn append(&mut self, channel: &ChannelId, records: &[Record]) -> Result<(), LogRefusal> {
        let mut last = self.last_seq;
        let mut last_epoch = self.last_epoch();
        for record in records {
            if last.checked_next() != Some(record.seq) {
                return Err(LogRefusal::NotContiguous { channel: channel.clone(), last, got: record.seq });
            }
            if record.leader_epoch < last_epoch {
                return Err(LogRefusal::EpochRegression {
                    channel: channel.clone(),
                    seq: record.seq,
                    last: last_epoch,
                    got: record.leader_epoch,
                });
            }
            last = record.seq;
            last_epoch = record.leader_epoch;
        }
        for record in records {
            note_epoch(&mut self.epochs, record);
        }
        self.last_seq = last;
        Ok(())
    }
}

/// Most records in one run of a [`MemTable`].
const MEM_RUN_MAX: usize = 256;

/// Consecutive records held in memory, oldest first, in runs that never move once allocated.
///
/// A run is allocated at its final size: as large as the table already is (at least 4), at most
/// [`MEM_RUN_MAX`] records; when the last run is full a new one starts. As one growing ring, a busy
/// channel's table copied all its records at each doubling, under the log's lock every sync's apply
/// needs — and under an even load every channel's table doubles at about the same moment: the bench at
/// 100 channels stalled every commit for 0.3–0.5 s each time the memory tables crossed 128 and 192 MiB.
#[derive(Clone, Debug, Default)]
pub(crate) struct MemTable {
    /// Full runs, oldest first.
    full: VecDeque<VecDeque<Record>>,
    /// The run being filled, after every full one: kept here, not behind `full`, so a push touches no
    /// more memory than with one ring (the apply of a group touches thousands of tables).
    tail: VecDeque<Record>,
    bytes: usize,
}

impl MemTable {
    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }

    /// Every run, oldest first (the tail last; any may be empty).
    fn runs(&self) -> impl Iterator<Item = &VecDeque<Record>> {
        self.full.iter().chain(std::iter::once(&self.tail))
    }

    pub(crate) fn first_seq(&self) -> Option<Seq> {
        self.runs().find_map(|run| run.front()).map(|r| r.seq)
    }

    pub(crate) fn push(&mut self, record: Record) {
        debug_assert!(self.last().is_none_or(|last| last.seq.next() == record.seq));
        self.bytes += record.encoded_len();
        if self.tail.len() == self.tail.capacity() {
            let run = VecDeque::with_capacity((self.len() + 1).clamp(4, MEM_RUN_MAX));
            let full = std::mem::replace(&mut self.tail, run);
            if !full.is_empty() {
                self.full.push_back(full);
            }
        }
        self.tail.push_back(record);
    }

    /// Drops records after `seq`.
    pub(crate) fn truncate_after(&mut self, seq: Seq) {
        loop {
            while self.tail.back().is_some_and(|r| r.seq > seq) {
                let r = self.tail.pop_back().expect("checked non-empty");
                self.bytes -= r.encoded_len();
            }
            if !self.tail.is_empty() {
                return;
            }
            // The tail emptied: the last full run becomes the tail (it takes no more records, being full).
            match self.full.pop_back() {
                Some(run) => self.tail = run,
                None => return,
            }
        }
    }

    /// Drops records at or before `seq`.
    pub(crate) fn drop_through(&mut self, seq: Seq) {
        while let Some(run) = self.full.front_mut() {
            while run.front().is_some_and(|r| r.seq <= seq) {
                let r = run.pop_front().expect("checked non-empty");
                self.bytes -= r.encoded_len();
            }
            if !run.is_empty() {
                return;
            }
            self.full.pop_front();
        }
        while self.tail.front().is_some_and(|r| r.seq <= seq) {
            let r = self.tail.pop_front().expect("checked non-empty");
            self.bytes -= r.encoded_len();
        }
    }

    /// Records from `from` on, within `limits`; `budget` carries what earlier reads already used.
    pub(crate) fn read(&self, from: Seq, through: Seq, budget: &mut ReadBudget, out: &mut Vec<Record>) {
        let Some(first) = self.first_seq() else { return };
        let mut skip = usize::try_from(from.get().saturating_sub(first.get())).unwrap_or(usize::MAX);
        for run in self.runs() {
            if skip >= run.len() {
                skip -= run.len();
                continue;
            }
            for record in run.iter().skip(skip) {
                if record.seq > through || !budget.take(record) {
                    return;
                }
                out.push(record.clone());
            }
            skip = 0;
        }
    }

    /// The records as consecutive runs of contiguous memory, oldest first.
    pub(crate) fn slices(&self) -> impl Iterator<Item = &[Record]> {
        self.runs().flat_map(|run| {
            let (front, back) = run.as_slices();
            [front, back]
        })
    }

    /// The last record, if any.
    pub(crate) fn last(&self) -> Option<&Record> {
        self.tail.back().or_else(|| self.full.back().and_then(|run| run.back()))
    }

    /// Number of records, added up over the runs: asked when a run starts (every 256 pushes at most)
    /// and once per channel per write-behind round, so not worth a counter to keep in step.
    pub(crate) fn len(&self) -> usize {
        self.runs().map(VecDeque::len).sum()
    }

    /// Moves every record of `later` (which must follow this table's last) to the end of this one.
    pub(crate) fn append(&mut self, later: MemTable) {
        debug_assert!(self.last().zip(later.first_seq()).is_none_or(|(a, b)| a.seq.next() == b));
        self.bytes += later.bytes;
        let tail = std::mem::replace(&mut self.tail, later.tail);
        if !tail.is_empty() {
            self.full.push_back(tail);
        }
        self.full.extend(later.full.into_iter().filter(|run| !run.is_empty()));
    }
}

/// Limits of one read: at most `records_max` records and, beyond the first record, `bytes_max` bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReadLimits {
    /// Most records returned.
    pub records_max: usize,
    /// Most encoded bytes returned (at least one record is returned if any is available).
    pub bytes_max: usize,
}

/// What is left of a read's limits.
#[derive(Debug)]
pub(crate) struct ReadBudget {
    records: usize,
    bytes: usize,
    taken: usize,
}

impl ReadBudget {
    pub(crate) fn new(limits: ReadLimits) -> Self {
        Self { records: limits.records_max, bytes: limits.bytes_max, taken: 0 }
    }

    /// Takes `record` from the budget, or refuses it when the budget is spent.
    pub(crate) fn take(&mut self, record: &Record) -> bool {
        let len = record.encoded_len();
        if self.records == 0 || (self.taken > 0 && len > self.bytes) {
            self.records = 0;
            return false;
        }
        self.records -= 1;
        self.bytes = self.bytes.saturating_sub(len);
        self.taken += 1;
        true
    }

    pub(crate) fn exhausted(&self) -> bool {
        self.records == 0
    }
}

/// A previous append found by its idempotency key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IdempotentHit {
    /// Seq of the original record.
    pub seq: Seq,
    /// CRC-32 of the original payload, to tell a true retry from a conflicting reuse of the key.
    pub payload_crc32: u32,
}

/// The idempotency keys among the last `window` seqs of one channel.
#[derive(Clone, Debug, Default)]
pub(crate) struct IdempotencyWindow {
    by_key: BTreeMap<IdempotencyKey, IdempotentHit>,
    order: VecDeque<(Seq, IdempotencyKey)>,
    window: usize,
}

impl IdempotencyWindow {
    pub(crate) fn new(window: usize) -> Self {
        Self { window, ..Self::default() }
    }

    pub(crate) fn insert(&mut self, record: &Record) {
        let Some(key) = &record.idempotency_key else { return };
        if self.window == 0 {
            return;
        }
        let hit = IdempotentHit { seq: record.seq, payload_crc32: crc32fast::hash(&record.payload) };
        // The first record with a key wins: a later duplicate would have been refused by the machine.
        if self.by_key.contains_key(key) {
            return;
        }
        self.by_key.insert(key.clone(), hit);
        self.order.push_back((record.seq, key.clone()));
        // The window covers the last `window` seqs of the channel, keyed or not.
        let window = self.window as u64;
        while self.order.front().is_some_and(|(seq, _)| seq.get() + window <= record.seq.get()) {
            let (_, old) = self.order.pop_front().expect("checked non-empty");
            self.by_key.remove(&old);
        }
    }

    pub(crate) fn get(&self, key: &IdempotencyKey) -> Option<IdempotentHit> {
        self.by_key.get(key).copied()
    }
}

impl From<LogRefusal> for StoreError {
    fn from(refusal: LogRefusal) -> Self {
        StoreError::Refused(refusal)
    }
}

/// Notes in a log's epoch history (`(leader_epoch, start_seq)`, ascending) the `record` that follows
/// it: a record of a newer epoch starts that epoch; the barrier of the epoch in force moves its start
/// to itself.
///
/// A leader writes its barrier as the first record of its epoch, and a successor tells barriers from
/// the messages it fans out again by these starts alone, without reading the records. A log started
/// by [`LogOp::StartAfter`] names the epoch in force as starting at the skipped seq, not knowing
/// whether the next record is that epoch's barrier; once it arrives, it is (sim seed 317006295: a
/// replica that joined by a `StartAfter` just before a barrier led later and fanned the barrier out
/// as a message).
pub fn note_epoch(epochs: &mut Vec<(LeaderEpoch, Seq)>, record: &Record) {
    match epochs.last_mut() {
        Some((epoch, start)) if record.leader_epoch == *epoch => {
            if record.kind == RecordKind::Barrier && *start < record.seq {
                *start = record.seq;
            }
        }
        Some((epoch, _)) if record.leader_epoch < *epoch => {}
        _ => {
            // Exactly: leader epochs change rarely, and every channel's state keeps its history (a
            // first push would otherwise reserve room for four, 48 bytes unused per channel).
            epochs.reserve_exact(1);
            epochs.push((record.leader_epoch, record.seq));
        }
    }
}

/// [`ChannelLogState::end_of_epoch`] over an epoch history (`(epoch, first seq)`, ascending) whose log
/// ends at `last_seq`: for a caller that keeps its history outside a state (a replica's log beyond
/// what is durable), without building one for each pull.
pub fn end_of_epoch(epochs: &[(LeaderEpoch, Seq)], last_seq: Seq, epoch: LeaderEpoch) -> (LeaderEpoch, Seq) {
    let at = epochs.partition_point(|(e, _)| *e <= epoch);
    if at == 0 {
        return (LeaderEpoch::new(0), Seq::new(0));
    }
    let found = epochs[at - 1].0;
    let end = match epochs.get(at) {
        Some((_, next_start)) => Seq::new(next_start.get() - 1),
        None => last_seq,
    };
    (found, end)
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use tidings_types::ChannelType;

    fn channel() -> ChannelId {
        ChannelId::new(ChannelType::GROUP, "c").unwrap()
    }

    fn rec(seq: u64, epoch: u64) -> Record {
        Record::message(Seq::new(seq), LeaderEpoch::new(epoch), Bytes::from_static(b"p"))
    }

    fn state_with(records: &[(u64, u64)]) -> ChannelLogState {
        let mut state = ChannelLogState::default();
        let records: Vec<Record> = records.iter().map(|(s, e)| rec(*s, *e)).collect();
        state.apply(&channel(), &LogOp::Append(records)).unwrap();
        state
    }

    #[test]
    fn isr_proposals_keep_the_newest_version_s_and_are_bounded() {
        let (mut state, c) = (ChannelLogState::default(), channel());
        let isr = |nodes: &[u64]| nodes.iter().copied().map(NodeId::new).collect::<Vec<_>>();
        let propose = |from_version, nodes: &[u64]| LogOp::ProposeIsr { from_version, isr: isr(nodes) };
        state.apply(&c, &propose(5, &[1, 2])).unwrap();
        state.apply(&c, &propose(5, &[1, 3])).unwrap();
        state.apply(&c, &propose(5, &[1, 2])).unwrap();
        assert_eq!(state.isr_proposals, vec![(5, isr(&[1, 2])), (5, isr(&[1, 3]))], "one entry an ISR");
        state.apply(&c, &propose(4, &[1])).unwrap();
        assert_eq!(state.isr_proposals.len(), 2, "an older version's changes nothing");
        state.apply(&c, &propose(7, &[1, 2, 3])).unwrap();
        assert_eq!(state.isr_proposals, vec![(7, isr(&[1, 2, 3]))], "a newer version's replaces them");
        state.apply(&c, &propose(8, &[1, 2, 3])).unwrap();
        assert_eq!(state.isr_proposals, vec![(8, isr(&[1, 2, 3]))], "even with the same ISR");
        state.apply(&c, &propose(7, &[1, 2, 3])).unwrap();
        assert_eq!(state.isr_proposals, vec![(8, isr(&[1, 2, 3]))]);
        for nodes in [&[1][..], &[2], &[3]] {
            state.apply(&c, &propose(8, nodes)).unwrap();
        }
        let refused = state.apply(&c, &propose(8, &[4]));
        assert_eq!(refused, Err(LogRefusal::TooManyIsrProposals { channel: c.clone(), from_version: 8 }));
        assert_eq!(state.isr_proposals.len(), ISR_PROPOSALS_MAX);
        state.apply(&c, &LogOp::Forget { version: 9 }).unwrap();
        assert!(state.isr_proposals.is_empty(), "a forgotten log keeps none");
    }

    #[test]
    fn epoch_history_follows_appends_and_truncation() {
        let mut state = state_with(&[(1, 1), (2, 1), (3, 2), (4, 4), (5, 4)]);
        let e = LeaderEpoch::new;
        assert_eq!(state.epochs, vec![(e(1), Seq::new(1)), (e(2), Seq::new(3)), (e(4), Seq::new(4))]);
        assert_eq!(state.end_of_epoch(e(1)), (e(1), Seq::new(2)));
        assert_eq!(state.end_of_epoch(e(3)), (e(2), Seq::new(3)));
        assert_eq!(state.end_of_epoch(e(9)), (e(4), Seq::new(5)));
        assert_eq!(state.end_of_epoch(e(0)), (e(0), Seq::new(0)));
        assert_eq!(state.epoch_of(Seq::new(3)), Some(e(2)));
        state.apply(&channel(), &LogOp::TruncateAfter(Seq::new(3))).unwrap();
        assert_eq!(state.epochs.len(), 2);
        assert_eq!(state.last_epoch(), e(2));
        assert_eq!(state.epoch_of(Seq::new(4)), None);
    }

    #[test]
    fn refusals_change_nothing() {
        let mut state = state_with(&[(1, 2), (2, 2)]);
        let before = state.clone();
        let c = channel();
        assert!(matches!(state.apply(&c, &LogOp::Append(vec![rec(4, 2)])), Err(LogRefusal::NotContiguous { .. })));
        assert!(matches!(
            state.apply(&c, &LogOp::Append(vec![rec(3, 2), rec(4, 1)])),
            Err(LogRefusal::EpochRegression { .. })
        ));
        assert!(matches!(state.apply(&c, &LogOp::CheckpointHw(Seq::new(3))), Err(LogRefusal::BadHw { .. })));
        assert!(matches!(state.apply(&c, &LogOp::SetRetention(Seq::new(1))), Err(LogRefusal::BadRetention { .. })));
        assert_eq!(state, before);
        state.apply(&c, &LogOp::CheckpointHw(Seq::new(2))).unwrap();
        assert!(matches!(state.apply(&c, &LogOp::TruncateAfter(Seq::new(1))), Err(LogRefusal::TruncateBelowHw { .. })));
        assert!(matches!(state.apply(&c, &LogOp::CheckpointHw(Seq::new(1))), Err(LogRefusal::BadHw { .. })));
        assert!(matches!(state.apply(&c, &LogOp::CheckpointFanned(Seq::new(3))), Err(LogRefusal::BadFanned { .. })));
        state.apply(&c, &LogOp::CheckpointFanned(Seq::new(2))).unwrap();
        assert!(matches!(state.apply(&c, &LogOp::CheckpointFanned(Seq::new(1))), Err(LogRefusal::BadFanned { .. })));
        assert!(matches!(
            state.apply(&c, &LogOp::StartAfter { seq: Seq::new(9), epoch: LeaderEpoch::new(3) }),
            Err(LogRefusal::NotEmpty { .. })
        ));
    }

    #[test]
    fn retention_keeps_the_epoch_in_force() {
        let mut state = state_with(&[(1, 1), (2, 1), (3, 2), (4, 2), (5, 3)]);
        let c = channel();
        state.apply(&c, &LogOp::CheckpointHw(Seq::new(5))).unwrap();
        state.apply(&c, &LogOp::SetRetention(Seq::new(3))).unwrap();
        // Seq 4 (first readable) was written in epoch 2, which started at 3.
        assert_eq!(state.epochs, vec![(LeaderEpoch::new(2), Seq::new(3)), (LeaderEpoch::new(3), Seq::new(5))]);
        assert_eq!(state.epoch_of(Seq::new(4)), Some(LeaderEpoch::new(2)));
        // A boundary right before an epoch begins keeps the boundary record's epoch too: a follower whose
        // last record it is proves its log by it.
        state.apply(&c, &LogOp::SetRetention(Seq::new(4))).unwrap();
        assert_eq!(state.epochs, vec![(LeaderEpoch::new(2), Seq::new(3)), (LeaderEpoch::new(3), Seq::new(5))]);
        assert_eq!(state.end_of_epoch(LeaderEpoch::new(2)), (LeaderEpoch::new(2), Seq::new(4)));
    }

    #[test]
    fn start_after_on_an_empty_log() {
        let mut state = ChannelLogState::default();
        let c = channel();
        state.apply(&c, &LogOp::StartAfter { seq: Seq::new(100), epoch: LeaderEpoch::new(5) }).unwrap();
        assert_eq!((state.last_seq, state.hw, state.retention_through), (Seq::new(100), Seq::new(100), Seq::new(100)));
        state.apply(&c, &LogOp::Append(vec![rec(101, 5)])).unwrap();
        assert_eq!(state.epochs, vec![(LeaderEpoch::new(5), Seq::new(100))]);
    }

    /// After a `StartAfter`, the epoch in force starts at the skipped seq; its barrier, if it follows,
    /// moves the start to itself (a successor takes epoch starts for barriers and fans out the rest).
    #[test]
    fn a_barrier_right_after_start_after_starts_its_epoch() {
        let mut state = ChannelLogState::default();
        let c = channel();
        state.apply(&c, &LogOp::StartAfter { seq: Seq::new(56), epoch: LeaderEpoch::new(2) }).unwrap();
        let barrier = |seq: u64, epoch: u64| Record { kind: RecordKind::Barrier, ..rec(seq, epoch) };
        state.apply(&c, &LogOp::Append(vec![barrier(57, 2), rec(58, 2), barrier(59, 3)])).unwrap();
        assert_eq!(state.epochs, vec![(LeaderEpoch::new(2), Seq::new(57)), (LeaderEpoch::new(3), Seq::new(59))]);
        assert_eq!(state.epoch_of(Seq::new(58)), Some(LeaderEpoch::new(2)));
        assert_eq!(state.end_of_epoch(LeaderEpoch::new(2)), (LeaderEpoch::new(2), Seq::new(58)));
        // A message of the epoch in force moves nothing.
        let mut joined = ChannelLogState::default();
        joined.apply(&c, &LogOp::StartAfter { seq: Seq::new(56), epoch: LeaderEpoch::new(2) }).unwrap();
        joined.apply(&c, &LogOp::Append(vec![rec(57, 2)])).unwrap();
        assert_eq!(joined.epochs, vec![(LeaderEpoch::new(2), Seq::new(56))]);
    }

    #[test]
    fn idempotency_window_covers_the_last_seqs() {
        let mut window = IdempotencyWindow::new(2);
        let keyed = |seq: u64, key: &str| Record {
            idempotency_key: IdempotencyKey::new(key.as_bytes().to_vec()),
            ..rec(seq, 1)
        };
        for (seq, key) in [(1, "a"), (2, "b"), (3, "c")] {
            window.insert(&keyed(seq, key));
        }
        let key = |k: &str| IdempotencyKey::new(k.as_bytes().to_vec()).unwrap();
        assert_eq!(window.get(&key("a")), None, "evicted beyond the window");
        assert_eq!(window.get(&key("c")).unwrap().seq, Seq::new(3));
        assert_eq!(window.get(&key("b")).unwrap().seq, Seq::new(2));
    }

    #[test]
    fn a_memtable_grows_in_runs_that_never_move() {
        let mut mem = MemTable::default();
        mem.push(rec(1, 1));
        let first: *const Record = mem.last().unwrap();
        for seq in 2..=2_000 {
            mem.push(rec(seq, 1));
        }
        assert!(std::ptr::eq(first, mem.slices().next().unwrap().as_ptr()), "the first run never moved");
        assert!(mem.runs().all(|run| run.len() <= MEM_RUN_MAX), "runs stay bounded");
        let seqs: Vec<u64> = mem.slices().flatten().map(|r| r.seq.get()).collect();
        assert_eq!(seqs, (1..=2_000).collect::<Vec<_>>(), "the runs hold every record, in order");
        assert_eq!(
            (mem.len(), mem.first_seq(), mem.last().map(|r| r.seq)),
            (2_000, Some(Seq::new(1)), Some(Seq::new(2_000)))
        );
        // Reads, truncation and trimming across run boundaries.
        let mut out = Vec::new();
        let mut budget = ReadBudget::new(ReadLimits { records_max: 600, bytes_max: usize::MAX });
        mem.read(Seq::new(700), Seq::new(1_000), &mut budget, &mut out);
        assert_eq!(out.iter().map(|r| r.seq.get()).collect::<Vec<_>>(), (700..=1_000).collect::<Vec<_>>());
        mem.truncate_after(Seq::new(1_500));
        mem.drop_through(Seq::new(300));
        let one = rec(1, 1).encoded_len();
        assert_eq!((mem.len(), mem.bytes()), (1_200, 1_200 * one));
        assert_eq!((mem.first_seq(), mem.last().map(|r| r.seq)), (Some(Seq::new(301)), Some(Seq::new(1_500))));
        mem.push(rec(1_501, 1));
        mem.truncate_after(Seq::new(0));
        assert_eq!((mem.len(), mem.bytes(), mem.full.len(), mem.tail.len()), (0, 0, 0, 0), "emptied entirely");
    }

    #[test]
    fn memtable_reads_within_budget() {
        let mut mem = MemTable::default();
        for seq in 1..=10 {
            mem.push(rec(seq, 1));
        }
        let one = rec(1, 1).encoded_len();
        let mut out = Vec::new();
        let mut budget = ReadBudget::new(ReadLimits { records_max: 100, bytes_max: one * 3 });
        mem.read(Seq::new(4), Seq::new(10), &mut budget, &mut out);
        assert_eq!(out.iter().map(|r| r.seq.get()).collect::<Vec<_>>(), vec![4, 5, 6]);
        let mut out = Vec::new();
        let mut budget = ReadBudget::new(ReadLimits { records_max: 100, bytes_max: 0 });
        mem.read(Seq::new(9), Seq::new(10), &mut budget, &mut out);
        assert_eq!(out.len(), 1, "at least one record");
        mem.truncate_after(Seq::new(5));
        mem.drop_through(Seq::new(2));
        assert_eq!(mem.first_seq(), Some(Seq::new(3)));
        assert_eq!(mem.bytes(), one * 3);
    }
}
