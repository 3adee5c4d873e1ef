//! Hash-slot ownership as replicated state: which slots a group serves, and the steps of moving one to
//! another group. Pure functions of the group's own records and the genesis table, so every replica of a
//! group decides the same whatever table its node has learned.

use super::Refusal;
use crate::keys::{Key, Kind};
use crate::model::{SlotMigrationStep, SlotRecord, SlotState};
use serde::{Deserialize, Serialize};
use tidings_router::HashToSlot;
use tidings_store::Placement;
use tidings_types::{GroupId, HashSlot};

/// Why a step of a hash-slot migration was refused. Nothing changed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
#[non_exhaustive]
pub enum SlotMigrationError {
    /// Only the group serving the slot (and not migrating it already) can export it.
    #[error("the group does not own the slot outright (it is {found:?})")]
    NotOwned {
        /// The group's record of the slot, `None` if it never had it.
        found: Option<SlotRecord>,
    },
    /// A slot cannot migrate to the group it is in.
    #[error("the slot is in that group already")]
    SameGroup,
    /// The other group is not a group of the table.
    #[error("{0} is not a slot group of the table")]
    UnknownGroup(GroupId),
    /// The step does not follow from where the slot stands in this group (another migration, another
    /// epoch, or a step done already).
    #[error("the step does not fit the slot's record {found:?}")]
    OutOfStep {
        /// The group's record of the slot.
        found: Option<SlotRecord>,
    },
    /// A copy attempt older than the one being received (a former source leader still sending).
    #[error("copy attempt {offered} is older than the current {current}")]
    StaleAttempt {
        /// The attempt of the step.
        offered: u64,
        /// The attempt being received.
        current: u64,
    },
    /// The target took the slot over already at this epoch: the import is over.
    #[error("the slot was imported at epoch {epoch} already")]
    Imported {
        /// The epoch this group owns the slot at.
        epoch: u64,
    },
    /// The export is fenced: the target may own the slot already, so it can only go forward.
    #[error("the export is fenced: it can only complete")]
    Fenced,
}

/// Key of a group's record of `slot` among the group's own records.
pub(crate) fn record_key(slot: HashSlot) -> Vec<u8> {
    Key::new(Kind::SlotRecord).u16(slot.index()).build()
}

/// Prefix of the marks of keys of `slot` written while it was exporting.
pub(crate) fn marks_prefix(slot: HashSlot) -> Vec<u8> {
    Key::new(Kind::SlotMark).u16(slot.index()).build()
}

/// The record in force: the stored one, else what the genesis table says (owned at epoch 0, or nothing).
pub fn record_in_force(
    group: GroupId,
    genesis: &HashToSlot,
    slot: HashSlot,
    stored: Option<SlotRecord>,
) -> Option<SlotRecord> {
    stored.or_else(|| (genesis.group_of(slot) == group).then_some(SlotRecord { epoch: 0, state: SlotState::Owned }))
}

/// Whether a group whose record of `slot` is `record` serves writes and authoritative reads of the slot;
/// else the typed answer that sends the caller on. A fenced slot serves neither: the target may own it
/// already and have taken writes the source's copy lacks.
pub fn admits(genesis: &HashToSlot, slot: HashSlot, record: Option<&SlotRecord>) -> Result<(), Refusal> {
    let Some(record) = record else { return Err(Refusal::WrongSlot { slot, owner: genesis.group_of(slot) }) };
    match record.state {
        SlotState::Owned | SlotState::Exporting { .. } => Ok(()),
        SlotState::Fenced { to } => Err(Refusal::SlotFenced { slot, to }),
        SlotState::Gone { to } => Err(Refusal::SlotMoved { slot, owner: to, epoch: record.epoch }),
        SlotState::Importing { from, .. } => Err(Refusal::WrongSlot { slot, owner: from }),
    }
}

/// What a migration step changes in the group.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Transition {
    /// The group's new record of the slot (`None`: unchanged, the step was done already).
    pub(crate) record: Option<SlotRecord>,
    /// Drop the group's copy of the slot.
    pub(crate) clear_copy: bool,
    /// Drop the marks of keys written while exporting.
    pub(crate) clear_marks: bool,
    /// Where the node should now look for the slot.
    pub(crate) placement: Option<Placement>,
}

impl Transition {
    /// Nothing changes: the step was done already, or it only carries keys.
    const NONE: Transition = Transition { record: None, clear_copy: false, clear_marks: false, placement: None };

    fn to(record: SlotRecord) -> Self {
        Self { record: Some(record), ..Self::NONE }
    }
}

/// The transition `step` makes from the record in force `current`, or why it is refused.
pub(crate) fn transition(
    group: GroupId,
    genesis: &HashToSlot,
    current: Option<&SlotRecord>,
    step: &SlotMigrationStep,
) -> Result<Transition, SlotMigrationError> {
    use SlotMigrationStep as Step;
    use SlotState::*;
    let out_of_step = || SlotMigrationError::OutOfStep { found: current.cloned() };
    let known = |other: GroupId| {
        if other == group {
            Err(SlotMigrationError::SameGroup)
        } else if !genesis.groups().any(|g| g == other) {
            Err(SlotMigrationError::UnknownGroup(other))
        } else {
            Ok(())
        }
    };
    let record = |epoch, state| SlotRecord { epoch, state };
    match (step, current.map(|r| (r.epoch, r.state))) {
        (Step::Export { to }, Some((epoch, Owned))) => {
            known(*to)?;
            Ok(Transition::to(record(epoch + 1, Exporting { to: *to })))
        }
        (Step::Export { .. }, _) => Err(SlotMigrationError::NotOwned { found: current.cloned() }),
        (Step::AbortExport, Some((epoch, Exporting { .. }))) => {
            Ok(Transition { clear_marks: true, ..Transition::to(record(epoch - 1, Owned)) })
        }
        (Step::AbortExport, Some((_, Fenced { .. }))) => Err(SlotMigrationError::Fenced),
        (Step::Fence { to, epoch }, Some((e, Exporting { to: t }))) if e == *epoch && t == *to => {
            Ok(Transition::to(record(e, Fenced { to: *to })))
        }
        (Step::Finish { to, epoch }, Some((e, Fenced { to: t }))) if e == *epoch && t == *to => Ok(Transition {
            record: Some(record(e, Gone { to: *to })),
            clear_copy: true,
            clear_marks: true,
            placement: Some(Placement { group: *to, epoch: e }),
        }),
        (Step::Finish { to, epoch }, Some((e, Gone { to: t }))) if e == *epoch && t == *to => Ok(Transition::NONE),
        (Step::BeginImport { from, epoch, attempt }, current) => {
            known(*from)?;
            match current {
                Some((e, Importing { attempt: a, .. })) if e == *epoch && a >= *attempt => {
                    Err(SlotMigrationError::StaleAttempt { offered: *attempt, current: a })
                }
                Some((e, Owned | Exporting { .. } | Fenced { .. })) if e >= *epoch => {
                    Err(SlotMigrationError::Imported { epoch: e })
                }
                Some((e, Gone { .. })) if e >= *epoch => Err(out_of_step()),
                Some((e, Importing { .. })) if e > *epoch => Err(out_of_step()),
                // Owned at an older epoch: this group cannot be the target of a later epoch while it
                // still serves the slot (its own export must complete first).
                Some((_, Owned | Exporting { .. } | Fenced { .. })) => Err(out_of_step()),
                _ => Ok(Transition {
                    clear_copy: true,
                    ..Transition::to(record(*epoch, Importing { from: *from, attempt: *attempt }))
                }),
            }
        }
        (Step::ImportChunk { from, epoch, attempt, .. }, current) => {
            importing(current, *from, *epoch, *attempt).map(|()| Transition::NONE)
        }
        (Step::CommitImport { from, epoch, attempt }, current) => match importing(current, *from, *epoch, *attempt) {
            Ok(()) => Ok(Transition {
                placement: Some(Placement { group, epoch: *epoch }),
                ..Transition::to(record(*epoch, Owned))
            }),
            // Committed already (an answer was lost and the source asks again): done.
            Err(SlotMigrationError::Imported { epoch: e }) if e == *epoch => Ok(Transition::NONE),
            Err(error) => Err(error),
        },
        (Step::AbortImport { from, epoch }, Some((e, Importing { from: f, .. }))) if e == *epoch && f == *from => {
            // The source owns the slot still, at the epoch before.
            Ok(Transition { clear_copy: true, ..Transition::to(record(e - 1, Gone { to: *from })) })
        }
        _ => Err(out_of_step()),
    }
}

/// Checks that the group is receiving the slot from `from` at `epoch` as copy `attempt`.
fn importing(
    current: Option<(u64, SlotState)>,
    from: GroupId,
    epoch: u64,
    attempt: u64,
) -> Result<(), SlotMigrationError> {
    match current {
        Some((e, SlotState::Importing { from: f, attempt: a })) if e == epoch && f == from => match a.cmp(&attempt) {
            std::cmp::Ordering::Equal => Ok(()),
            _ => Err(SlotMigrationError::StaleAttempt { offered: attempt, current: a }),
        },
        Some((e, SlotState::Owned | SlotState::Exporting { .. } | SlotState::Fenced { .. })) if e >= epoch => {
            Err(SlotMigrationError::Imported { epoch: e })
        }
        found => Err(SlotMigrationError::OutOfStep { found: found.map(|(epoch, state)| SlotRecord { epoch, state }) }),
    }
}

/// Where the node should look for `slot` according to a group's record of it (used when a snapshot
/// brings records in).
pub(crate) fn placement_of(group: GroupId, record: &SlotRecord) -> Option<Placement> {
    match record.state {
        SlotState::Owned if record.epoch > 0 => Some(Placement { group, epoch: record.epoch }),
        SlotState::Gone { to } => Some(Placement { group: to, epoch: record.epoch }),
        _ => None,
    }
}

/// Records the genesis table's placement of every slot the store has no placement for (local reads find
/// each slot's copy by its placement). Idempotent; [`crate::raft::MultiRaft::open`] calls it.
pub fn seed_placements(store: &tidings_store::MetaStore, genesis: &HashToSlot) -> tidings_store::StoreResult<()> {
    let mut seed = tidings_store::MetaWriteBatch::new();
    for slot in HashSlot::all() {
        seed.place(slot, Placement { group: genesis.group_of(slot), epoch: 0 });
    }
    store.write(&seed)
}

/// The placement a key of a group's own records implies, if it is a slot record (snapshots carry them).
pub(crate) fn placement_in_record(group: GroupId, key: &[u8], value: &[u8]) -> Option<(HashSlot, Placement)> {
    let [kind, hi, lo] = key else { return None };
    if *kind != Kind::SlotRecord as u8 {
        return None;
    }
    let slot = HashSlot::new(u16::from_be_bytes([*hi, *lo]))?;
    let record: SlotRecord = postcard::from_bytes(value).ok()?;
    placement_of(group, &record).map(|p| (slot, p))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn g(n: u32) -> GroupId {
        GroupId::new(n)
    }

    /// Runs `steps` on group `group`'s record of slot 0 (owned by group 1 in the genesis table),
    /// returning the record after each accepted step or the refusal.
    fn run(group: u32, steps: &[SlotMigrationStep]) -> Vec<Result<Option<SlotRecord>, SlotMigrationError>> {
        let genesis = HashToSlot::even_split(2).unwrap();
        let slot = HashSlot::new(0).unwrap();
        let mut stored: Option<SlotRecord> = None;
        steps
            .iter()
            .map(|step| {
                let current = record_in_force(g(group), &genesis, slot, stored.clone());
                let t = transition(g(group), &genesis, current.as_ref(), step)?;
                if let Some(record) = t.record {
                    stored = Some(record);
                }
                Ok(record_in_force(g(group), &genesis, slot, stored.clone()))
            })
            .collect()
    }

    #[test]
    fn a_source_goes_owned_exporting_fenced_gone_and_only_forward_once_fenced() {
        use SlotMigrationStep::*;
        let steps = [
            Export { to: g(2) },
            Export { to: g(2) },
            Fence { to: g(2), epoch: 2 },
            Fence { to: g(2), epoch: 1 },
            AbortExport,
            Finish { to: g(2), epoch: 1 },
            Finish { to: g(2), epoch: 1 },
            Export { to: g(2) },
        ];
        let results = run(1, &steps);
        let state = |i: usize| results[i].as_ref().map(|r| r.clone().map(|r| (r.epoch, r.state)));
        assert_eq!(state(0), Ok(Some((1, SlotState::Exporting { to: g(2) }))));
        assert!(matches!(results[1], Err(SlotMigrationError::NotOwned { .. })));
        assert!(matches!(results[2], Err(SlotMigrationError::OutOfStep { .. })), "wrong epoch");
        assert_eq!(state(3), Ok(Some((1, SlotState::Fenced { to: g(2) }))));
        assert_eq!(results[4], Err(SlotMigrationError::Fenced));
        assert_eq!(state(5), Ok(Some((1, SlotState::Gone { to: g(2) }))));
        assert_eq!(state(6), Ok(Some((1, SlotState::Gone { to: g(2) }))), "finishing twice is done");
        assert!(matches!(results[7], Err(SlotMigrationError::NotOwned { .. })));
    }

    #[test]
    fn an_aborted_export_is_owned_again_and_can_restart() {
        use SlotMigrationStep::*;
        let results = run(1, &[Export { to: g(2) }, AbortExport, Export { to: g(2) }, Export { to: g(1) }]);
        assert_eq!(results[1].as_ref().unwrap().as_ref().unwrap().state, SlotState::Owned);
        assert_eq!(results[2].as_ref().unwrap().as_ref().unwrap().epoch, 1);
        let fresh = run(1, &[Export { to: g(1) }, Export { to: g(7) }]);
        assert_eq!(fresh[0], Err(SlotMigrationError::SameGroup));
        assert_eq!(fresh[1], Err(SlotMigrationError::UnknownGroup(g(7))));
    }

    #[test]
    fn a_target_takes_only_the_newest_attempt_and_commits_once() {
        use SlotMigrationStep::*;
        let chunk = |attempt| ImportChunk { from: g(1), epoch: 1, attempt, entries: vec![] };
        let steps = [
            chunk(5),
            BeginImport { from: g(1), epoch: 1, attempt: 5 },
            chunk(5),
            BeginImport { from: g(1), epoch: 1, attempt: 7 },
            chunk(5),
            BeginImport { from: g(1), epoch: 1, attempt: 6 },
            CommitImport { from: g(1), epoch: 1, attempt: 7 },
            CommitImport { from: g(1), epoch: 1, attempt: 7 },
            BeginImport { from: g(1), epoch: 1, attempt: 9 },
            chunk(9),
            AbortImport { from: g(1), epoch: 1 },
        ];
        let results = run(2, &steps);
        assert!(matches!(results[0], Err(SlotMigrationError::OutOfStep { found: None })));
        assert!(results[1].is_ok() && results[2].is_ok() && results[3].is_ok());
        assert_eq!(results[4], Err(SlotMigrationError::StaleAttempt { offered: 5, current: 7 }));
        assert_eq!(results[5], Err(SlotMigrationError::StaleAttempt { offered: 6, current: 7 }));
        assert_eq!(results[6].as_ref().unwrap().as_ref().unwrap().state, SlotState::Owned);
        assert!(results[7].is_ok(), "committing again is done");
        assert_eq!(results[8], Err(SlotMigrationError::Imported { epoch: 1 }));
        assert_eq!(results[9], Err(SlotMigrationError::Imported { epoch: 1 }));
        assert!(matches!(results[10], Err(SlotMigrationError::OutOfStep { .. })), "an owned slot is not aborted");
    }

    #[test]
    fn writes_and_reads_are_answered_by_the_record() {
        let genesis = HashToSlot::even_split(2).unwrap();
        let slot = HashSlot::new(0).unwrap();
        let at = |state| SlotRecord { epoch: 3, state };
        assert_eq!(admits(&genesis, slot, Some(&at(SlotState::Exporting { to: g(2) }))), Ok(()));
        assert_eq!(
            admits(&genesis, slot, Some(&at(SlotState::Fenced { to: g(2) }))),
            Err(Refusal::SlotFenced { slot, to: g(2) })
        );
        assert_eq!(
            admits(&genesis, slot, Some(&at(SlotState::Gone { to: g(2) }))),
            Err(Refusal::SlotMoved { slot, owner: g(2), epoch: 3 })
        );
        assert_eq!(
            admits(&genesis, slot, Some(&at(SlotState::Importing { from: g(1), attempt: 1 }))),
            Err(Refusal::WrongSlot { slot, owner: g(1) })
        );
        assert_eq!(admits(&genesis, slot, None), Err(Refusal::WrongSlot { slot, owner: g(1) }));
    }
}
