//! Replica moves of slot groups, carried out by each group's leader. The move itself is replicated state:
//! the group's intent names the voters wanted (`target_peers`, set by `Command::MoveGroupReplica`).
//! Every reconcile pass the leader compares the membership in force with it and takes the next step —
//! learner, catch-up, hand-off of its own leadership, joint configuration, leaving it, committing the
//! assignment — so a crash or a leader change at any phase resumes from what raft shows, and aborting a
//! move (`Command::AbortGroupMove`) drives the membership back the same way.

use crate::node::rendezvous;
use std::collections::BTreeSet;
use tidings_slot::model::GroupIntent;
use tidings_slot::raft::{GroupStatus, MembershipChange};
use tidings_types::NodeId;

/// What a membership decision knows of the cluster beyond the group.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ClusterView<'a> {
    /// Every node of the cluster.
    pub(crate) nodes: &'a [NodeId],
    /// Nodes the failure detector holds down.
    pub(crate) down: &'a BTreeSet<NodeId>,
    /// Nodes silent for `ControllerConfig::replace_down_after` or more (a subset of `down`): a move
    /// towards one is given up.
    pub(crate) gone: &'a BTreeSet<NodeId>,
    /// Nodes leaving (this one included, if it is): they should lead no group.
    pub(crate) leaving: &'a BTreeSet<NodeId>,
}

/// With no move in progress: the first drained voter starts moving to a live, undrained node outside the
/// group (chosen by rendezvous hash on the group, so drains spread).
fn drain_step(intent: &GroupIntent, status: &GroupStatus, cluster: &ClusterView<'_>) -> MembershipStep {
    let Some(from) = status.voters.iter().copied().find(|v| intent.draining.contains(v)) else {
        return MembershipStep::Settled;
    };
    let eligible =
        |n: &&NodeId| !status.voters.contains(n) && !intent.draining.contains(n) && !cluster.down.contains(n);
    match rendezvous::best(&status.group.get().to_le_bytes(), cluster.nodes.iter().filter(eligible).copied()) {
        Some(to) => MembershipStep::StartDrainMove { from, to },
        None => MembershipStep::NoDrainTarget(from),
    }
}

/// A learner (or successor) this many entries behind the commit index counts as caught up.
const CAUGHT_UP_SLACK: u64 = 16;

/// Caught up: within a few entries of the commit index (under load it moves on while a sample is taken),
/// and acknowledged something to this leader at all — a replica that never answered has matched 0, which
/// the slack alone would let through while the commit index is small.
fn caught_up(matched: u64, commit: u64) -> bool {
    matched > 0 && matched + CAUGHT_UP_SLACK >= commit
}

/// The next step of a group's membership toward its intent, as its leader decided it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MembershipStep {
    /// No move is in progress and the configuration is not joint: nothing to do.
    Settled,
    /// Leave the joint configuration (a move's promotion applied).
    LeaveJoint,
    /// Add the move's target as a learner.
    AddLearner(NodeId),
    /// The learner has not caught up with the commit index yet.
    CatchingUp {
        /// The learner.
        node: NodeId,
        /// Its match index.
        matched: u64,
        /// The commit index.
        commit: u64,
    },
    /// The learner has not answered recently (down or cut off): the move waits (or is aborted).
    LearnerInactive(NodeId),
    /// A node the move adds has been silent for `replace_down_after`: the move is given up
    /// (`Command::AbortGroupMove`), its learner removed and the assignment kept. A drain's next step
    /// then picks another target; an operator asks again.
    GiveUpMove(NodeId),
    /// This node is the voter to remove: it hands its leadership to a staying voter first.
    HandOffLeadership {
        /// The staying voter.
        to: NodeId,
    },
    /// This node is the voter to remove and no staying voter is active and caught up to take over.
    NoSuccessor,
    /// Promote the caught-up learners and remove the old voters, in one joint configuration.
    EnterJoint {
        /// Nodes to make voters.
        promote: Vec<NodeId>,
        /// Voters to remove.
        remove: Vec<NodeId>,
    },
    /// Remove a learner the intent does not want (a move aborted before its promotion).
    RemoveLearner(NodeId),
    /// The voters in force are the ones wanted: record them (and the configuration epoch) as the assignment.
    CommitAssignment,
    /// A voter is being drained: start moving it to a live node that holds no replica of the group.
    StartDrainMove {
        /// The drained voter.
        from: NodeId,
        /// Where its replica goes.
        to: NodeId,
    },
    /// A voter is being drained and no live, undrained node outside the group can take its replica.
    NoDrainTarget(NodeId),
}

impl MembershipStep {
    /// The raft membership change this step proposes, if it proposes one.
    pub(crate) fn change(&self) -> Option<MembershipChange> {
        match self {
            MembershipStep::LeaveJoint => Some(MembershipChange::LeaveJoint),
            MembershipStep::AddLearner(node) => Some(MembershipChange::AddLearner(*node)),
            MembershipStep::RemoveLearner(node) => Some(MembershipChange::RemoveLearner(*node)),
            MembershipStep::EnterJoint { promote, remove } => {
                Some(MembershipChange::EnterJoint { promote: promote.clone(), remove: remove.clone() })
            }
            _ => None,
        }
    }
}

/// Decides the next step for a group this node (`me`) leads, from its intent, raft status and the nodes the
/// failure detector holds down (raft-rs's recent-activity flag is cleared every election timeout, so a
/// sample of it says little).
pub(crate) fn next_step(
    intent: &GroupIntent,
    status: &GroupStatus,
    me: NodeId,
    cluster: &ClusterView<'_>,
) -> MembershipStep {
    let down = cluster.down;
    if status.joint {
        // Always safe, and nothing else can happen to the group while joint — but a leader only in the
        // outgoing half (it inherited the change) hands its leadership to an incoming voter first.
        if !status.voters.contains(&me) {
            return hand_off(status, me, cluster, &status.voters);
        }
        return MembershipStep::LeaveJoint;
    }
    // Only a move changes the membership: an assignment that differs from the voters in force is reported
    // by the leadership reconciliation (`VoterMismatch`), never acted on.
    let Some(wanted) = intent.target_peers.as_deref() else { return drain_step(intent, status, cluster) };
    let add: Vec<NodeId> = wanted.iter().copied().filter(|n| !status.voters.contains(n)).collect();
    let remove: Vec<NodeId> = status.voters.iter().copied().filter(|n| !wanted.contains(n)).collect();
    if add.is_empty() && remove.is_empty() {
        if let Some(stray) = status.learners.iter().find(|n| !wanted.contains(n)) {
            return MembershipStep::RemoveLearner(*stray);
        }
        return MembershipStep::CommitAssignment;
    }
    // Before its promotion only: a voter added is the joint configuration's to settle. Without this, a
    // move (a drain's, chosen by this node) towards a node lost for good — one refused for its storage
    // identity — waited for it until an operator aborted it.
    if let Some(node) = add.iter().find(|n| cluster.gone.contains(n)) {
        return MembershipStep::GiveUpMove(*node);
    }
    if let Some(node) = add.iter().find(|n| !status.learners.contains(n)) {
        return MembershipStep::AddLearner(*node);
    }
    let matched = |node: NodeId| status.peers.iter().find(|(n, _, _)| *n == node).map(|(_, m, _)| *m);
    let caught_up = |matched: u64| caught_up(matched, status.commit);
    for node in &add {
        match matched(*node) {
            _ if down.contains(node) => return MembershipStep::LearnerInactive(*node),
            Some(matched) if caught_up(matched) => {}
            Some(matched) => return MembershipStep::CatchingUp { node: *node, matched, commit: status.commit },
            None => return MembershipStep::LearnerInactive(*node),
        }
    }
    if remove.contains(&me) {
        // raft-rs does not step a removed leader down cleanly: leadership moves first.
        let staying: Vec<NodeId> = status.voters.iter().copied().filter(|n| wanted.contains(n)).collect();
        if staying.is_empty() {
            // A group of one voter, this leader, moving to another node: no voter stays to take over
            // before the change. The joint configuration comes first (it needs this leader and the
            // caught-up learners), and there this leader, in its outgoing half only, hands over to an
            // incoming voter before the joint configuration is left (above). Waiting for a successor
            // among the staying voters, the move waited for ever (sim seed 9 with a node joining a
            // one-node cluster).
            return MembershipStep::EnterJoint { promote: add, remove };
        }
        let preferred = intent.preferred_leader.filter(|p| staying.contains(p));
        let ordered: Vec<NodeId> = preferred.into_iter().chain(staying).collect();
        return hand_off(status, me, cluster, &ordered);
    }
    MembershipStep::EnterJoint { promote: add, remove }
}

/// Leadership goes to the first of `candidates` (other than `me`) that is up and caught up.
fn hand_off(status: &GroupStatus, me: NodeId, cluster: &ClusterView<'_>, candidates: &[NodeId]) -> MembershipStep {
    let ready = |node: &NodeId| {
        *node != me
            && !cluster.down.contains(node)
            && status.peers.iter().any(|(n, matched, _)| n == node && caught_up(*matched, status.commit))
    };
    match candidates.iter().find(|n| ready(n)) {
        Some(to) => MembershipStep::HandOffLeadership { to: *to },
        None => MembershipStep::NoSuccessor,
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use tidings_types::{ConfigEpoch, GroupId};

    fn n(id: u64) -> NodeId {
        NodeId::new(id)
    }

    /// A group led by node 1, every member matched at the commit index 10, configuration epoch 6.
    pub(in crate::node::controller) fn status(voters: &[u64], learners: &[u64]) -> GroupStatus {
        let peers = voters.iter().chain(learners).map(|id| (n(*id), 10, true)).collect();
        GroupStatus {
            group: GroupId::new(1),
            leader: Some(n(1)),
            term: 3,
            commit: 10,
            applied: 10,
            voters: voters.iter().copied().map(n).collect(),
            learners: learners.iter().copied().map(n).collect(),
            peers,
            joint: false,
            transferring: None,
            config_epoch: ConfigEpoch::new(6),
            held_back_from: None,
        }
    }

    const NODES: [NodeId; 5] = [NodeId::new(1), NodeId::new(2), NodeId::new(3), NodeId::new(4), NodeId::new(5)];

    fn none() -> BTreeSet<NodeId> {
        BTreeSet::new()
    }

    fn step(intent: &GroupIntent, status: &GroupStatus, down: &BTreeSet<NodeId>) -> MembershipStep {
        next_step(intent, status, n(1), &ClusterView { nodes: &NODES, down, gone: &none(), leaving: &none() })
    }

    fn moving(target: &[u64]) -> GroupIntent {
        GroupIntent {
            group: GroupId::new(1),
            desired_peers: vec![n(1), n(2), n(3)],
            config_epoch: ConfigEpoch::new(6),
            preferred_leader: None,
            target_peers: Some(target.iter().copied().map(n).collect()),
            draining: Vec::new(),
        }
    }

    #[test]
    fn a_move_goes_learner_catch_up_joint_leave_commit() {
        let intent = moving(&[1, 2, 4]);
        assert_eq!(step(&intent, &status(&[1, 2, 3], &[]), &none()), MembershipStep::AddLearner(n(4)));
        let mut lagging = status(&[1, 2, 3], &[4]);
        lagging.commit = 100;
        lagging.peers[3].1 = 70;
        assert_eq!(
            step(&intent, &lagging, &none()),
            MembershipStep::CatchingUp { node: n(4), matched: 70, commit: 100 }
        );
        assert_eq!(step(&intent, &lagging, &[n(4)].into()), MembershipStep::LearnerInactive(n(4)));
        // A learner that never answered this leader is not caught up, however small the commit index.
        let mut silent = status(&[1, 2, 3], &[4]);
        silent.peers[3].1 = 0;
        assert_eq!(step(&intent, &silent, &none()), MembershipStep::CatchingUp { node: n(4), matched: 0, commit: 10 });
        assert_eq!(
            step(&intent, &status(&[1, 2, 3], &[4]), &none()),
            MembershipStep::EnterJoint { promote: vec![n(4)], remove: vec![n(3)] }
        );
        let joint = GroupStatus { joint: true, ..status(&[1, 2, 4], &[]) };
        assert_eq!(step(&intent, &joint, &none()), MembershipStep::LeaveJoint);
        // A leader only in the outgoing half (it inherited the joint change) hands over before leaving it.
        let outgoing = GroupStatus { joint: true, ..status(&[2, 3, 4], &[]) };
        assert_eq!(step(&intent, &outgoing, &none()), MembershipStep::HandOffLeadership { to: n(2) });
        let moved = GroupStatus { config_epoch: ConfigEpoch::new(9), ..status(&[1, 2, 4], &[]) };
        assert_eq!(step(&intent, &moved, &none()), MembershipStep::CommitAssignment);
        let committed = GroupIntent {
            desired_peers: vec![n(1), n(2), n(4)],
            config_epoch: ConfigEpoch::new(9),
            target_peers: None,
            ..intent
        };
        assert_eq!(step(&committed, &moved, &none()), MembershipStep::Settled);
    }

    #[test]
    fn a_leaving_leader_hands_off_first_and_an_aborted_move_removes_its_learner() {
        let intent = moving(&[2, 3, 4]);
        let ready = status(&[1, 2, 3], &[4]);
        assert_eq!(step(&intent, &ready, &none()), MembershipStep::HandOffLeadership { to: n(2) });
        let preferring = GroupIntent { preferred_leader: Some(n(3)), ..intent.clone() };
        assert_eq!(step(&preferring, &ready, &none()), MembershipStep::HandOffLeadership { to: n(3) });
        let mut alone = ready.clone();
        alone.commit = 100;
        alone.peers = vec![(n(1), 100, true), (n(2), 3, true), (n(3), 100, true), (n(4), 100, true)];
        assert_eq!(step(&intent, &alone, &[n(3)].into()), MembershipStep::NoSuccessor);
        // A group of one voter moving off its leader: nobody stays to take over first, so the joint
        // configuration comes first, and there the leader hands over to the incoming voter.
        let single = moving(&[2]);
        assert_eq!(
            step(&single, &status(&[1], &[2]), &none()),
            MembershipStep::EnterJoint { promote: vec![n(2)], remove: vec![n(1)] }
        );
        let joint = GroupStatus { joint: true, ..status(&[2], &[]) };
        assert_eq!(step(&single, &joint, &none()), MembershipStep::HandOffLeadership { to: n(2) });
        // An abort retargets the move to the assignment: the learner goes, then the assignment is committed.
        let aborted = GroupIntent { target_peers: Some(vec![n(1), n(2), n(3)]), ..intent };
        assert_eq!(step(&aborted, &ready, &none()), MembershipStep::RemoveLearner(n(4)));
        assert_eq!(step(&aborted, &status(&[1, 2, 3], &[]), &none()), MembershipStep::CommitAssignment);
        let settled = GroupIntent { target_peers: None, ..aborted };
        assert_eq!(step(&settled, &status(&[1, 2, 3], &[]), &none()), MembershipStep::Settled);
    }

    /// A move towards a node silent for `replace_down_after` is given up, whether its learner was added
    /// or not; a node only down (not yet gone) is waited for.
    #[test]
    fn a_move_towards_a_node_gone_silent_is_given_up_before_its_promotion() {
        let intent = moving(&[1, 2, 4]);
        let down: BTreeSet<NodeId> = [n(4)].into();
        let gone_step = |status: &GroupStatus| {
            next_step(&intent, status, n(1), &ClusterView { nodes: &NODES, down: &down, gone: &down, leaving: &none() })
        };
        assert_eq!(gone_step(&status(&[1, 2, 3], &[])), MembershipStep::GiveUpMove(n(4)));
        assert_eq!(gone_step(&status(&[1, 2, 3], &[4])), MembershipStep::GiveUpMove(n(4)));
        assert_eq!(step(&intent, &status(&[1, 2, 3], &[4]), &down), MembershipStep::LearnerInactive(n(4)));
        // Promoted, it is a voter: the joint configuration is left, as raft asks, gone or not.
        let joint = GroupStatus { joint: true, ..status(&[1, 2, 4], &[]) };
        assert_eq!(gone_step(&joint), MembershipStep::LeaveJoint);
    }

    #[test]
    fn a_drained_voter_moves_to_a_live_undrained_outsider() {
        let draining = GroupIntent { target_peers: None, draining: vec![n(2), n(4)], ..moving(&[1, 2, 3]) };
        let settled = status(&[1, 2, 3], &[]);
        // 4 is drained too, so only 5 can take it; once 5 is down, nobody can.
        assert_eq!(step(&draining, &settled, &none()), MembershipStep::StartDrainMove { from: n(2), to: n(5) });
        assert_eq!(step(&draining, &settled, &[n(5)].into()), MembershipStep::NoDrainTarget(n(2)));
        let elsewhere = GroupIntent { draining: vec![n(4)], ..draining };
        assert_eq!(step(&elsewhere, &settled, &none()), MembershipStep::Settled);
    }
}
