//! The shared holder of the current route snapshot: lock-free reads, serialized checked updates.

use crate::hash_to_slot::{HashToSlot, HashToSlotError};
use crate::route_table::{GroupObservation, RouteTable};
use arc_swap::ArcSwap;
use parking_lot::Mutex;
use std::sync::Arc;
use tidings_types::{ConfigEpoch, GroupId, HashSlot, NodeId, RouteRevision, Term};

/// Why an update of the route table was refused. The table is unchanged after any of these.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum UpdateError {
    /// The observation is from an older term than the one already published.
    #[error("{group}: observation of term {offered} is older than the published term {current}")]
    StaleTerm {
        /// The group.
        group: GroupId,
        /// Term offered.
        offered: Term,
        /// Term published.
        current: Term,
    },
    /// The observation carries an older config epoch than the one already published.
    #[error("{group}: config epoch {offered} is older than the published {current}")]
    StaleConfigEpoch {
        /// The group.
        group: GroupId,
        /// Epoch offered.
        offered: ConfigEpoch,
        /// Epoch published.
        current: ConfigEpoch,
    },
    /// Two different leaders reported for one term: Raft allows at most one, so one report is wrong.
    #[error("{group}: term {term} already has leader {current}, refusing {offered}")]
    ConflictingLeader {
        /// The group.
        group: GroupId,
        /// The term.
        term: Term,
        /// Leader already published.
        current: NodeId,
        /// Leader offered.
        offered: NodeId,
    },
    /// A slot → group table that is older than, or conflicts with, the published one.
    #[error(transparent)]
    HashToSlot(#[from] HashToSlotError),
}

/// What an accepted update did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ObserveOutcome {
    /// A new snapshot was published with this revision.
    Published(RouteRevision),
    /// The update matched what was already published; no new revision.
    Unchanged(RouteRevision),
}

/// Holds the current [`RouteTable`] and publishes new ones atomically.
///
/// Readers call [`Router::snapshot`] and never block, even while an update is published. Updates are
/// serialized by a writer lock, checked for freshness, and replace the snapshot with one pointer swap.
pub struct Router {
    current: ArcSwap<RouteTable>,
    writer: Mutex<()>,
}

impl Router {
    /// A router whose first snapshot holds `hash_to_slot` and no group observations.
    pub fn new(hash_to_slot: HashToSlot) -> Self {
        Self { current: ArcSwap::from_pointee(RouteTable::new(hash_to_slot)), writer: Mutex::new(()) }
    }

    /// The current snapshot. Resolve a batch of keys against one snapshot to get consistent answers.
    #[inline]
    pub fn snapshot(&self) -> Arc<RouteTable> {
        self.current.load_full()
    }

    /// Publishes what raft status showed of `group`, unless it is older than what is published.
    pub fn observe(&self, group: GroupId, observation: GroupObservation) -> Result<ObserveOutcome, UpdateError> {
        let _writer = self.writer.lock();
        let table = self.current.load_full();
        if let Some(current) = table.group(group) {
            check_fresh(group, current, &observation)?;
            if *current == observation {
                return Ok(ObserveOutcome::Unchanged(table.revision()));
            }
        }
        let next = table.with_group(group, observation);
        let revision = next.revision();
        self.current.store(Arc::new(next));
        Ok(ObserveOutcome::Published(revision))
    }

    /// Publishes that `slot` is owned by `group` from ownership epoch `epoch` on (learned from a
    /// migration this node applied, or from a group's stale-route answer), unless the published table
    /// knows that epoch or a later one.
    pub fn learn_slot_owner(&self, slot: HashSlot, group: GroupId, epoch: u64) -> ObserveOutcome {
        let _writer = self.writer.lock();
        let table = self.current.load_full();
        let Some(hash_to_slot) = table.hash_to_slot().with_owner(slot, group, epoch) else {
            return ObserveOutcome::Unchanged(table.revision());
        };
        let next = table.with_hash_to_slot(hash_to_slot);
        let revision = next.revision();
        self.current.store(Arc::new(next));
        ObserveOutcome::Published(revision)
    }
}

/// Refuses observations that would move a group's published state backwards.
fn check_fresh(group: GroupId, current: &GroupObservation, offered: &GroupObservation) -> Result<(), UpdateError> {
    if offered.term < current.term {
        return Err(UpdateError::StaleTerm { group, offered: offered.term, current: current.term });
    }
    if offered.config_epoch < current.config_epoch {
        return Err(UpdateError::StaleConfigEpoch {
            group,
            offered: offered.config_epoch,
            current: current.config_epoch,
        });
    }
    if offered.term == current.term {
        if let (Some(have), Some(new)) = (current.leader, offered.leader) {
            if have != new {
                return Err(UpdateError::ConflictingLeader { group, term: offered.term, current: have, offered: new });
            }
        }
    }
    Ok(())
}

impl std::fmt::Debug for Router {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Router").field("current", &self.current.load()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::route_table::RouteError;

    fn obs(leader: Option<u64>, term: u64, epoch: u64) -> GroupObservation {
        GroupObservation {
            leader: leader.map(NodeId::new),
            term: Term::new(term),
            voters: vec![NodeId::new(1), NodeId::new(2)],
            learners: vec![],
            config_epoch: ConfigEpoch::new(epoch),
        }
    }

    #[test]
    fn newer_observation_publishes_new_revision() {
        let router = Router::new(HashToSlot::even_split(1).unwrap());
        let g = GroupId::new(1);
        assert_eq!(router.observe(g, obs(Some(1), 1, 1)), Ok(ObserveOutcome::Published(RouteRevision::new(2))));
        assert_eq!(router.observe(g, obs(Some(1), 1, 1)), Ok(ObserveOutcome::Unchanged(RouteRevision::new(2))));
        assert_eq!(router.observe(g, obs(Some(2), 2, 1)), Ok(ObserveOutcome::Published(RouteRevision::new(3))));
        assert_eq!(router.snapshot().resolve(b"x").unwrap().leader, NodeId::new(2));
    }

    #[test]
    fn stale_and_conflicting_observations_are_refused_and_change_nothing() {
        let router = Router::new(HashToSlot::even_split(1).unwrap());
        let g = GroupId::new(1);
        router.observe(g, obs(Some(2), 5, 3)).unwrap();
        let before = router.snapshot().revision();
        assert!(matches!(router.observe(g, obs(Some(1), 4, 3)), Err(UpdateError::StaleTerm { .. })));
        assert!(matches!(router.observe(g, obs(Some(2), 5, 2)), Err(UpdateError::StaleConfigEpoch { .. })));
        assert!(matches!(router.observe(g, obs(Some(3), 5, 3)), Err(UpdateError::ConflictingLeader { .. })));
        assert_eq!(router.snapshot().revision(), before);
        assert_eq!(router.snapshot().resolve(b"x").unwrap().leader, NodeId::new(2));
        // Losing the leader within a term is news, not a conflict: routes now fail closed.
        router.observe(g, obs(None, 5, 3)).unwrap();
        assert!(matches!(router.snapshot().resolve(b"x"), Err(RouteError::NoLeader { .. })));
    }

    #[test]
    fn learned_slot_owners_only_move_forward() {
        let table = HashToSlot::even_split(2).unwrap();
        let router = Router::new(table.clone());
        let slot = HashSlot::new(0).unwrap();
        assert!(matches!(router.learn_slot_owner(slot, GroupId::new(2), 1), ObserveOutcome::Published(_)));
        assert!(matches!(router.learn_slot_owner(slot, GroupId::new(2), 1), ObserveOutcome::Unchanged(_)));
        assert!(matches!(router.learn_slot_owner(slot, GroupId::new(1), 1), ObserveOutcome::Unchanged(_)));
        assert_eq!(router.snapshot().hash_to_slot().group_of(slot), GroupId::new(2));
        assert_eq!(router.snapshot().hash_to_slot().version(), table.version().next());
    }
}
