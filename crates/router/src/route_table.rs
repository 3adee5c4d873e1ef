//! Immutable route snapshots and key resolution against them.

use crate::hash_to_slot::{hash_slot, HashToSlot};
use std::{collections::BTreeMap, sync::Arc};
use tidings_types::{ConfigEpoch, GroupId, HashSlot, NodeId, RouteRevision, Term};

/// What the raft status of a group last showed: its leader (if any), term, members and config epoch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupObservation {
    /// The leader the group reported, `None` while an election runs.
    pub leader: Option<NodeId>,
    /// The term of that observation.
    pub term: Term,
    /// Voting members.
    pub voters: Vec<NodeId>,
    /// Non-voting members catching up.
    pub learners: Vec<NodeId>,
    /// Configuration epoch of the group's assignment.
    pub config_epoch: ConfigEpoch,
}

/// A group's entry in a route snapshot.
pub type GroupRoute = GroupObservation;

/// Where a key goes: its physical slot, the owning group and that group's leader, all from one snapshot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Route {
    /// The key's physical slot.
    pub hash_slot: HashSlot,
    /// The logical group that owns the slot.
    pub group: GroupId,
    /// The group's observed leader.
    pub leader: NodeId,
    /// The term in which `leader` was observed.
    pub leader_term: Term,
    /// The group's configuration epoch.
    pub config_epoch: ConfigEpoch,
    /// Revision of the snapshot that produced this route.
    pub route_revision: RouteRevision,
}

/// Why a key could not be routed. Every variant means "do not send": the caller retries later, refreshes
/// its snapshot, or reports the error; it never picks a node on its own.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RouteError {
    /// The slot's group has no entry in this snapshot: the group was never observed here.
    #[error("{slot} maps to {group}, which has no route yet")]
    NoMapping {
        /// The key's slot.
        slot: HashSlot,
        /// The group the slot maps to.
        group: GroupId,
    },
    /// The group is known but has no leader (an election is running or the group lost quorum).
    #[error("{group} has no known leader (term {term})")]
    NoLeader {
        /// The group.
        group: GroupId,
        /// The last observed term.
        term: Term,
    },
    /// The snapshot is older than the revision the caller requires (e.g. one named by a stale-route
    /// refusal from a peer).
    #[error("route revision {current} is older than the required {required}")]
    RevisionTooOld {
        /// Revision of the snapshot.
        current: RouteRevision,
        /// Revision required.
        required: RouteRevision,
    },
}

/// An immutable snapshot of routing state. Cheap to share (`Arc`); never mutated after publication.
#[derive(Clone, Debug)]
pub struct RouteTable {
    revision: RouteRevision,
    hash_to_slot: Arc<HashToSlot>,
    groups: BTreeMap<GroupId, GroupRoute>,
}

impl RouteTable {
    /// Revision 1 of a table with the given slot map and nothing observed yet.
    pub fn new(hash_to_slot: HashToSlot) -> Self {
        Self { revision: RouteRevision::new(1), hash_to_slot: Arc::new(hash_to_slot), groups: BTreeMap::new() }
    }

    /// The snapshot's revision.
    pub fn revision(&self) -> RouteRevision {
        self.revision
    }

    /// The slot → group table of this snapshot.
    pub fn hash_to_slot(&self) -> &HashToSlot {
        &self.hash_to_slot
    }

    /// What this snapshot knows of `group`.
    pub fn group(&self, group: GroupId) -> Option<&GroupRoute> {
        self.groups.get(&group)
    }

    /// All observed groups, ascending.
    pub fn groups(&self) -> impl Iterator<Item = (GroupId, &GroupRoute)> {
        self.groups.iter().map(|(g, r)| (*g, r))
    }

    /// Routes `key` to its group's leader.
    #[inline]
    pub fn resolve(&self, key: &[u8]) -> Result<Route, RouteError> {
        self.resolve_slot(hash_slot(key))
    }

    /// Routes `key`, refusing if this snapshot is older than `required`.
    pub fn resolve_at_least(&self, key: &[u8], required: RouteRevision) -> Result<Route, RouteError> {
        if self.revision < required {
            return Err(RouteError::RevisionTooOld { current: self.revision, required });
        }
        self.resolve(key)
    }

    /// Routes every key against this one snapshot, so all answers share one revision.
    pub fn resolve_many<'k, I>(&self, keys: I) -> Vec<Result<Route, RouteError>>
    where
        I: IntoIterator<Item = &'k [u8]>,
    {
        keys.into_iter().map(|key| self.resolve(key)).collect()
    }

    /// Routes a physical slot to its group's leader.
    pub fn resolve_slot(&self, slot: HashSlot) -> Result<Route, RouteError> {
        let group = self.hash_to_slot.group_of(slot);
        let observed = self.groups.get(&group).ok_or(RouteError::NoMapping { slot, group })?;
        let leader = observed.leader.ok_or(RouteError::NoLeader { group, term: observed.term })?;
        Ok(Route {
            hash_slot: slot,
            group,
            leader,
            leader_term: observed.term,
            config_epoch: observed.config_epoch,
            route_revision: self.revision,
        })
    }

    /// The next revision with `group` observed as given. The caller has checked freshness.
    pub(crate) fn with_group(&self, group: GroupId, observation: GroupObservation) -> RouteTable {
        let mut groups = self.groups.clone();
        groups.insert(group, observation);
        RouteTable { revision: self.revision.next(), hash_to_slot: Arc::clone(&self.hash_to_slot), groups }
    }

    /// The next revision with a new slot → group table. Observations of groups are kept.
    pub(crate) fn with_hash_to_slot(&self, hash_to_slot: HashToSlot) -> RouteTable {
        RouteTable { revision: self.revision.next(), hash_to_slot: Arc::new(hash_to_slot), groups: self.groups.clone() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn observed(leader: Option<u64>, term: u64) -> GroupObservation {
        GroupObservation {
            leader: leader.map(NodeId::new),
            term: Term::new(term),
            voters: vec![NodeId::new(1), NodeId::new(2), NodeId::new(3)],
            learners: vec![],
            config_epoch: ConfigEpoch::new(1),
        }
    }

    #[test]
    fn unobserved_group_is_no_mapping() {
        let table = RouteTable::new(HashToSlot::even_split(2).unwrap());
        let slot = hash_slot(b"k");
        assert_eq!(
            table.resolve(b"k"),
            Err(RouteError::NoMapping { slot, group: table.hash_to_slot().group_of(slot) })
        );
    }

    #[test]
    fn leaderless_group_is_no_leader() {
        let table = RouteTable::new(HashToSlot::even_split(1).unwrap());
        let table = table.with_group(GroupId::new(1), observed(None, 4));
        assert_eq!(table.resolve(b"k"), Err(RouteError::NoLeader { group: GroupId::new(1), term: Term::new(4) }));
    }

    #[test]
    fn resolves_with_revision_and_leader() {
        let table =
            RouteTable::new(HashToSlot::even_split(1).unwrap()).with_group(GroupId::new(1), observed(Some(3), 7));
        let route = table.resolve(b"k").unwrap();
        assert_eq!(route.leader, NodeId::new(3));
        assert_eq!(route.leader_term, Term::new(7));
        assert_eq!(route.route_revision, RouteRevision::new(2));
        assert_eq!(route.hash_slot, hash_slot(b"k"));
        assert_eq!(
            table.resolve_at_least(b"k", RouteRevision::new(3)),
            Err(RouteError::RevisionTooOld { current: RouteRevision::new(2), required: RouteRevision::new(3) })
        );
        assert!(table.resolve_at_least(b"k", RouteRevision::new(2)).is_ok());
    }

    #[test]
    fn resolve_many_mixes_answers_from_one_snapshot() {
        // Group 1 has a leader, group 2 does not: each key gets its own group's answer.
        let table = RouteTable::new(HashToSlot::even_split(2).unwrap())
            .with_group(GroupId::new(1), observed(Some(1), 1))
            .with_group(GroupId::new(2), observed(None, 1));
        let keys: Vec<Vec<u8>> = (0..64).map(|i| format!("key-{i}").into_bytes()).collect();
        let routes = table.resolve_many(keys.iter().map(Vec::as_slice));
        for (key, route) in keys.iter().zip(&routes) {
            match table.hash_to_slot().group_of_key(key).get() {
                1 => assert_eq!(route.as_ref().unwrap().route_revision, table.revision()),
                _ => assert!(matches!(route, Err(RouteError::NoLeader { .. }))),
            }
        }
        assert!(routes.iter().any(Result::is_ok) && routes.iter().any(Result::is_err));
    }
}
