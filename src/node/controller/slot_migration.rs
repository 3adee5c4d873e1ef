//! The driver of hash-slot migrations, run by the leader of the source group.
//!
//! Everything that decides ownership is replicated (the groups' slot records, see
//! `tidings_slot::fsm::migration`); this driver only holds where its copy stands, so a new leader simply
//! starts a new copy attempt. For each slot its group's records show exporting, it proposes in turn:
//! `BeginImport` to the target (a fresh copy attempt: the leader's term and a counter, so chunks of an
//! older attempt or an older leader are refused), the slot's keys as `ImportChunk`s of at most
//! `chunk_bytes`, `Fence` to its own group, the keys marked as written during the copy (their values now,
//! or their absence) as more chunks, `CommitImport` to the target, and `Finish` to its own group. One
//! proposal at a time per slot; an outcome it cannot be sure of (timeout, leader change) restarts the
//! copy with a new attempt, which the target begins by dropping what it received.
//!
//! On the target's side, the leader of a group holding an unfinished import asks the source's leader
//! every `IMPORT_CHECK_INTERVAL` whether the export is still on; when it was given up (an abort whose
//! clean-up was lost, or a late `BeginImport` of an abandoned attempt), it drops the import.

use crate::node::controller::applied_cache::AppliedCache;
use crate::node::controller::ControllerConfig;
use std::collections::BTreeMap;
use tidings_slot::command::Command;
use tidings_slot::fsm::migration::SlotMigrationError;
use tidings_slot::fsm::{Outcome, Refusal};
use tidings_slot::model::{SlotMigrationStep, SlotRecord, SlotState};
use tidings_slot::query::SlotReader;
use tidings_slot::raft::{MultiRaft, ProposeError};
use tidings_types::{GroupId, HashSlot, Time};

/// Where one migration's driver stands (in the order the phases run).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum MigrationPhase {
    /// Asking the target to (re)start receiving the slot.
    Begin,
    /// Copying the slot's keys.
    Copy,
    /// Fencing the slot at the source.
    Fence,
    /// Copying the keys written during the copy.
    Marks,
    /// Asking the target to take the slot over.
    Commit,
    /// Dropping the source's copy.
    Finish,
}

impl MigrationPhase {
    /// The phase's step is proposed to the target group (the others to the source).
    fn addresses_target(self) -> bool {
        matches!(self, Self::Begin | Self::Copy | Self::Marks | Self::Commit)
    }
}

/// A hash-slot migration this node drives, for operators ([`crate::node::NodeStatus::slot_migrations`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlotMigrationReport {
    /// The slot.
    pub slot: HashSlot,
    /// The source group (this node leads it).
    pub from: GroupId,
    /// The target group.
    pub to: GroupId,
    /// The slot's ownership epoch at the target once done.
    pub epoch: u64,
    /// The copy attempt.
    pub attempt: u64,
    /// The step in progress.
    pub phase: MigrationPhase,
    /// Keys sent to the target in this attempt.
    pub keys_copied: u64,
    /// Reads of the source's copy that failed since this node took the export on. Each makes the step
    /// wait `ControllerConfig::migration_retry` and read again from where it was; a figure that keeps
    /// growing points at the source leader's store.
    pub read_failures: u64,
}

/// One export in progress.
#[derive(Debug)]
struct Export {
    to: GroupId,
    epoch: u64,
    /// The raft term of the source group the attempt was started in.
    term: u64,
    attempt: u64,
    phase: MigrationPhase,
    /// The last key sent in the current phase (`Copy` or `Marks`).
    cursor: Option<Vec<u8>>,
    /// Where the phase continues once the chunk in flight is applied (`None`: the phase is done).
    next_cursor: Option<Vec<u8>>,
    in_flight: bool,
    retry_at: Time,
    keys_copied: u64,
    read_failures: u64,
}

/// Drives the exports of the slot groups this node leads.
#[derive(Debug)]
pub(crate) struct SlotMigrations {
    exports: BTreeMap<(GroupId, HashSlot), Export>,
    next_scan: Time,
    /// Counts attempts started by this node (the low bits of an attempt number).
    attempts: u64,
    /// Clean-ups of imports whose export was given up: (source, slot, target, epoch).
    abandoned: Vec<(GroupId, HashSlot, GroupId, u64)>,
    /// Unfinished imports of the groups this node leads, by (target, slot).
    imports: BTreeMap<(GroupId, HashSlot), ImportWatch>,
    /// Each led group's slot records as of its applied index.
    records: AppliedCache<Vec<(HashSlot, SlotRecord)>>,
}

/// An import a led group holds, watched for an export given up.
#[derive(Debug)]
struct ImportWatch {
    from: GroupId,
    epoch: u64,
    attempt: u64,
    /// When this attempt was first seen.
    since: Time,
    next_ask: Time,
}

/// An import is asked about once it has been there this long, and then this often.
const IMPORT_CHECK_INTERVAL: std::time::Duration = std::time::Duration::from_secs(3);

/// A question for the leader of group `from`: does it still export `slot` to `to` at `epoch`?
pub(crate) struct ExportQuestion {
    pub(crate) from: GroupId,
    pub(crate) slot: HashSlot,
    pub(crate) to: GroupId,
    pub(crate) epoch: u64,
}

/// How often the records of the groups this node leads are read for exports.
const SCAN_INTERVAL: std::time::Duration = std::time::Duration::from_millis(200);
/// Bits of an attempt number below the term.
const ATTEMPT_COUNTER_BITS: u32 = 24;

/// A proposal the driver wants made: `command`, on behalf of the export of `slot` from `group`.
pub(crate) struct MigrationProposal {
    pub(crate) group: GroupId,
    pub(crate) slot: HashSlot,
    pub(crate) command: Command,
    /// The copy attempt whose step it is, to which its outcome is reported back; `None` for a
    /// fire-and-forget clean-up.
    pub(crate) attempt: Option<u64>,
}

impl SlotMigrations {
    pub(crate) fn new(now: Time) -> Self {
        Self {
            exports: BTreeMap::new(),
            next_scan: now,
            attempts: 0,
            abandoned: Vec::new(),
            imports: BTreeMap::new(),
            records: AppliedCache::default(),
        }
    }

    /// What the exports in progress look like.
    pub(crate) fn reports(&self) -> Vec<SlotMigrationReport> {
        self.exports
            .iter()
            .map(|((from, slot), e)| SlotMigrationReport {
                slot: *slot,
                from: *from,
                to: e.to,
                epoch: e.epoch,
                attempt: e.attempt,
                phase: e.phase,
                keys_copied: e.keys_copied,
                read_failures: e.read_failures,
            })
            .collect()
    }

    /// Reads the records of the groups this node leads (every `SCAN_INTERVAL`), then returns the next
    /// proposal of every export that waits for none.
    pub(crate) fn tick(
        &mut self,
        now: Time,
        config: &ControllerConfig,
        slot: &MultiRaft,
        reader: &SlotReader,
    ) -> Vec<MigrationProposal> {
        // A driver reads the slot's keys and marks from this node's replica of the source group, which
        // holds every step it proposed only while it leads the group in the term the export began in.
        // Past that its proposals went to another leader, whose answer says nothing of this replica:
        // a fence applied there was followed by a read of the marks here, before this replica applied
        // the writes marked ahead of the fence, and the target committed the slot without them (sim
        // seed 206001022, with skewed clocks: an acknowledged user gone from the slot's new group).
        // The group's leader in the new term starts its own attempt from the records.
        self.exports.retain(|(group, _), export| {
            slot.is_leader(*group) && slot.status(*group).is_some_and(|status| status.term == export.term)
        });
        if now >= self.next_scan {
            self.next_scan = now + SCAN_INTERVAL;
            self.scan(now, slot, reader);
        }
        let mut proposals: Vec<MigrationProposal> = self
            .abandoned
            .drain(..)
            .map(|(from, slot, to, epoch)| MigrationProposal {
                group: from,
                slot,
                command: Command::MigrateSlot { group: to, slot, step: SlotMigrationStep::AbortImport { from, epoch } },
                attempt: None,
            })
            .collect();
        for ((group, hash_slot), export) in self.exports.iter_mut() {
            if export.in_flight || now < export.retry_at {
                continue;
            }
            match next_command(*group, *hash_slot, export, config.migration_chunk_bytes, reader) {
                Ok(Some(command)) => {
                    export.in_flight = true;
                    let attempt = Some(export.attempt);
                    proposals.push(MigrationProposal { group: *group, slot: *hash_slot, command, attempt });
                }
                Ok(None) => {}
                Err(error) => {
                    tracing::warn!(%error, %group, slot = %hash_slot, "slot migration: cannot read the slot");
                    export.read_failures += 1;
                    export.retry_at = now + config.migration_retry;
                }
            }
        }
        proposals
    }

    /// Starts an export for every slot the led groups' records show exporting or fenced (a new attempt
    /// when the group's term changed), and forgets the others.
    fn scan(&mut self, now: Time, slot: &MultiRaft, reader: &SlotReader) {
        let mut seen = Vec::new();
        let mut seen_imports = Vec::new();
        let led: Vec<GroupId> = slot.groups().filter(|g| slot.is_leader(*g)).collect();
        self.records.retain(|g| led.contains(&g));
        for group in led {
            let Some(term) = slot.status(group).map(|s| s.term) else { continue };
            let records =
                match self.records.get_or_read(group, slot.applied_index(group), || reader.slot_records(group)) {
                    Ok(records) => records,
                    Err(error) => {
                        tracing::warn!(%error, %group, "slot migration: cannot read the group's slot records");
                        continue;
                    }
                };
            for (hash_slot, record) in records {
                if let SlotState::Importing { from, attempt } = record.state {
                    seen_imports.push((group, hash_slot));
                    let watch = self.imports.entry((group, hash_slot)).or_insert(ImportWatch {
                        from,
                        epoch: record.epoch,
                        attempt,
                        since: now,
                        next_ask: now + IMPORT_CHECK_INTERVAL,
                    });
                    if (watch.from, watch.epoch, watch.attempt) != (from, record.epoch, attempt) {
                        *watch = ImportWatch {
                            from,
                            epoch: record.epoch,
                            attempt,
                            since: now,
                            next_ask: now + IMPORT_CHECK_INTERVAL,
                        };
                    }
                    continue;
                }
                let (SlotState::Exporting { to } | SlotState::Fenced { to }) = record.state else { continue };
                seen.push((group, hash_slot));
                let current = self.exports.get(&(group, hash_slot));
                if current.is_some_and(|e| e.to == to && e.epoch == record.epoch && e.term == term) {
                    continue;
                }
                self.attempts += 1;
                let attempt = (term << ATTEMPT_COUNTER_BITS) | (self.attempts & ((1 << ATTEMPT_COUNTER_BITS) - 1));
                tracing::info!(%group, slot = %hash_slot, %to, epoch = record.epoch, attempt, "slot migration: copy attempt starts");
                let export = Export {
                    to,
                    epoch: record.epoch,
                    term,
                    attempt,
                    phase: MigrationPhase::Begin,
                    cursor: None,
                    next_cursor: None,
                    in_flight: false,
                    retry_at: now,
                    keys_copied: 0,
                    read_failures: 0,
                };
                self.exports.insert((group, hash_slot), export);
            }
        }
        self.imports.retain(|key, _| seen_imports.contains(key));
        let gone: Vec<(GroupId, HashSlot)> = self.exports.keys().filter(|k| !seen.contains(k)).copied().collect();
        for key in gone {
            let export = self.exports.remove(&key).expect("present");
            let (group, hash_slot) = key;
            // Still leading and the record no longer exporting: aborted (or finished, which the
            // driver knows itself). Tell the target to drop what it received.
            if slot.is_leader(group) && export.phase != MigrationPhase::Finish {
                if let Ok(Some(record)) = reader.slot_record(group, hash_slot) {
                    if record.state == SlotState::Owned {
                        self.abandoned.push((group, hash_slot, export.to, export.epoch));
                    }
                }
            }
        }
    }

    /// The imports to ask their source about now.
    pub(crate) fn export_questions(&mut self, now: Time) -> Vec<ExportQuestion> {
        let mut questions = Vec::new();
        for ((to, slot), watch) in self.imports.iter_mut() {
            if now >= watch.next_ask && now >= watch.since + IMPORT_CHECK_INTERVAL {
                watch.next_ask = now + IMPORT_CHECK_INTERVAL;
                questions.push(ExportQuestion { from: watch.from, slot: *slot, to: *to, epoch: watch.epoch });
            }
        }
        questions
    }

    /// The source's leader answered: an import whose export was given up is dropped.
    pub(crate) fn export_answer(&mut self, from: GroupId, slot: HashSlot, to: GroupId, epoch: u64, exporting: bool) {
        let Some(watch) = self.imports.get(&(to, slot)) else { return };
        if !exporting && watch.from == from && watch.epoch == epoch {
            tracing::info!(%from, %to, %slot, epoch, "slot migration: the export was given up; the import goes");
            self.imports.remove(&(to, slot));
            self.abandoned.push((from, slot, to, epoch));
        }
    }

    /// The outcome of the proposal the export of `slot` from `group` made.
    pub(crate) fn outcome(
        &mut self,
        now: Time,
        config: &ControllerConfig,
        (group, slot, attempt): (GroupId, HashSlot, u64),
        result: Result<Outcome, ProposeError>,
    ) {
        // Only the attempt that proposed the step moves on with its outcome. An export started over (its
        // group's leader in a new term, see `tick`) may have a step of the attempt it replaced still on
        // its way: that step's outcome, taken for the new attempt's own, would move its phase or its
        // cursor on past keys it has not sent.
        let Some(export) = self.exports.get_mut(&(group, slot)).filter(|export| export.attempt == attempt) else {
            return;
        };
        export.in_flight = false;
        let restart = |export: &mut Export, now: Time, attempts: &mut u64| {
            *attempts += 1;
            export.attempt = (export.term << ATTEMPT_COUNTER_BITS) | (*attempts & ((1 << ATTEMPT_COUNTER_BITS) - 1));
            export.phase = MigrationPhase::Begin;
            export.cursor = None;
            export.keys_copied = 0;
            export.retry_at = now + config.migration_retry;
        };
        match result {
            Ok(Outcome::Applied) => {
                if advance(export) {
                    self.exports.remove(&(group, slot));
                    tracing::info!(%group, %slot, "slot migration: done");
                }
            }
            Ok(Outcome::Refused(Refusal::Migration(SlotMigrationError::Imported { epoch })))
                if epoch >= export.epoch && export.phase != MigrationPhase::Fence =>
            {
                // The target took the slot over already (an earlier attempt committed), and may have given
                // it on since — it owns the slot at a later epoch only through this export's commit:
                // only the source's clean-up is left. The source is fenced then: nothing commits before
                // the fence. (Sim seed 353002875: the target, owning the slot, began exporting it back
                // before the source heard; the source started its copy over and over.)
                export.phase = MigrationPhase::Finish;
            }
            Ok(Outcome::Refused(Refusal::Migration(SlotMigrationError::OutOfStep { found: Some(record) })))
                if record.epoch > export.epoch && export.phase.addresses_target() =>
            {
                // The target is past this epoch: only the owner at this epoch — the target, through this
                // export's commit — could have given the slot on. The commit happened (its answer was
                // lost, or the leader that saw it is gone) and the slot moved on since: only the source's
                // clean-up is left (sim seed 13000241).
                export.phase = MigrationPhase::Finish;
            }
            Ok(Outcome::Refused(refusal)) => {
                // Out of step or a newer attempt elsewhere: the records say what is true. Forget this
                // attempt; the next scan starts over from them if the export is still on.
                tracing::info!(%group, %slot, ?refusal, phase = ?export.phase, "slot migration: step refused");
                self.exports.remove(&(group, slot));
                self.next_scan = now;
            }
            Ok(other) => {
                tracing::warn!(%group, %slot, ?other, "slot migration: unexpected outcome");
                restart(export, now, &mut self.attempts);
            }
            Err(error) => match export.phase {
                // Fencing, committing and finishing can be asked again as they are.
                MigrationPhase::Fence | MigrationPhase::Commit | MigrationPhase::Finish => {
                    tracing::info!(%error, %group, %slot, phase = ?export.phase, "slot migration: step retried");
                    export.retry_at = now + config.migration_retry;
                }
                // A chunk's fate is unknown: copy again under a new attempt.
                _ => {
                    tracing::info!(%error, %group, %slot, "slot migration: copy restarts");
                    restart(export, now, &mut self.attempts);
                }
            },
        }
        if let Some(export) = self.exports.get_mut(&(group, slot)) {
            // The next step waits a little: the copy shares the groups with their writes.
            export.retry_at = export.retry_at.max(now + config.migration_step_pause);
        }
    }

    /// When the driver next has something to do.
    pub(crate) fn poll_timeout(&self) -> Time {
        let ready = self.exports.values().filter(|e| !e.in_flight).map(|e| e.retry_at);
        let asks = self.imports.values().map(|w| w.next_ask.max(w.since + IMPORT_CHECK_INTERVAL));
        ready.chain(asks).fold(self.next_scan, Time::min)
    }
}

/// Moves an export past the step that was just applied; `true` when that was the last.
fn advance(export: &mut Export) -> bool {
    use MigrationPhase::*;
    match export.phase {
        Begin => {
            export.phase = Copy;
            export.cursor = None;
        }
        Copy | Marks => match export.next_cursor.take() {
            Some(cursor) => export.cursor = Some(cursor),
            None => {
                export.cursor = None;
                export.phase = if export.phase == Copy { Fence } else { Commit };
            }
        },
        Fence => export.phase = Marks,
        Commit => export.phase = Finish,
        Finish => return true,
    }
    false
}

/// The next command of `export`, or `None` when a phase turned out to have nothing to send (the phase
/// then moved on, and the next tick sends the next step).
fn next_command(
    group: GroupId,
    slot: HashSlot,
    export: &mut Export,
    chunk_bytes: usize,
    reader: &SlotReader,
) -> Result<Option<Command>, tidings_store::StoreError> {
    let (to, epoch, attempt) = (export.to, export.epoch, export.attempt);
    let target = |step| Command::MigrateSlot { group: to, slot, step };
    let source = |step| Command::MigrateSlot { group, slot, step };
    let command = match export.phase {
        MigrationPhase::Begin => target(SlotMigrationStep::BeginImport { from: group, epoch, attempt }),
        MigrationPhase::Copy => {
            let page = reader.export_slot(group, slot, export.cursor.as_deref(), chunk_bytes)?;
            export.next_cursor = page.cursor;
            export.keys_copied += page.items.len() as u64;
            let entries = page.items.into_iter().map(|(k, v)| (k, Some(v))).collect();
            target(SlotMigrationStep::ImportChunk { from: group, epoch, attempt, entries })
        }
        MigrationPhase::Fence => {
            if matches!(reader.slot_record(group, slot)?, Some(r) if matches!(r.state, SlotState::Fenced { .. })) {
                // Fenced already (a leader before this one fenced it): on to the marked keys.
                export.phase = MigrationPhase::Marks;
                return Ok(None);
            }
            source(SlotMigrationStep::Fence { to, epoch })
        }
        MigrationPhase::Marks => {
            let mut entries = Vec::new();
            let mut bytes = 0usize;
            let mut cursor = export.cursor.clone();
            loop {
                let page = reader.slot_marks(group, slot, cursor.as_deref(), 256)?;
                for key in page.items {
                    let value = reader.raw_in(group, slot, &key)?;
                    bytes += key.len() + value.as_ref().map_or(0, Vec::len);
                    cursor = Some(key.clone());
                    entries.push((key, value));
                }
                if page.cursor.is_none() {
                    export.next_cursor = None;
                    break;
                }
                if bytes >= chunk_bytes {
                    export.next_cursor = cursor;
                    break;
                }
            }
            if entries.is_empty() {
                export.phase = MigrationPhase::Commit;
                export.cursor = None;
                return Ok(None);
            }
            export.keys_copied += entries.len() as u64;
            target(SlotMigrationStep::ImportChunk { from: group, epoch, attempt, entries })
        }
        MigrationPhase::Commit => target(SlotMigrationStep::CommitImport { from: group, epoch, attempt }),
        MigrationPhase::Finish => source(SlotMigrationStep::Finish { to, epoch }),
    };
    Ok(Some(command))
}
