//! Membership changes of a slot group, as the controller asks for them, and their raft-rs encoding.
//!
//! A replica move is a sequence of these, each proposed by the group's leader once the previous one
//! applied: add the target as a learner, let it catch up, enter a joint configuration that promotes it and
//! removes the old voter, leave the joint configuration explicitly.

use raft::prelude::{ConfChangeSingle, ConfChangeTransition, ConfChangeType, ConfChangeV2};
use tidings_types::NodeId;

/// One membership change of a slot group.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MembershipChange {
    /// Adds a learner (it receives the log, it does not vote).
    AddLearner(NodeId),
    /// Removes a learner (a move abandoned before its promotion).
    RemoveLearner(NodeId),
    /// Enters a joint configuration: `promote` become voters, `remove` leave. The group stays joint until
    /// [`MembershipChange::LeaveJoint`] applies.
    EnterJoint {
        /// Learners (or new nodes) to make voters.
        promote: Vec<NodeId>,
        /// Voters to remove.
        remove: Vec<NodeId>,
    },
    /// Leaves the joint configuration for its incoming half.
    LeaveJoint,
}

impl MembershipChange {
    /// `true` if applying this change to `conf` leaves `node`, a voter now, without a vote.
    pub(crate) fn removes_voter(&self, node: NodeId, conf: &crate::fsm::GroupConf) -> bool {
        match self {
            // A voter removed by the joint configuration still votes in its outgoing half, and a leader
            // there still leads: it hands over to an incoming voter before the group leaves the joint
            // configuration (the controller's next step). The controller hands over before entering
            // when a voter stays to take over; a group of one voter has none.
            MembershipChange::EnterJoint { .. } => false,
            // `conf.voters` are the incoming voters: leaving the joint state keeps only them.
            MembershipChange::LeaveJoint => conf.joint && !conf.voters.contains(&node),
            MembershipChange::AddLearner(_) | MembershipChange::RemoveLearner(_) => false,
        }
    }

    /// The raft-rs change. Joint changes use the explicit transition, so leaving is a step of its own
    /// that the controller observes and proposes.
    pub(crate) fn to_conf_change(&self) -> ConfChangeV2 {
        let single = |node: NodeId, kind: ConfChangeType| {
            let mut change = ConfChangeSingle { node_id: node.get(), ..Default::default() };
            change.set_change_type(kind);
            change
        };
        let mut change = ConfChangeV2::default();
        match self {
            MembershipChange::AddLearner(node) => {
                change.mut_changes().push(single(*node, ConfChangeType::AddLearnerNode));
            }
            MembershipChange::RemoveLearner(node) => {
                change.mut_changes().push(single(*node, ConfChangeType::RemoveNode));
            }
            MembershipChange::EnterJoint { promote, remove } => {
                change.set_transition(ConfChangeTransition::Explicit);
                for node in promote {
                    change.mut_changes().push(single(*node, ConfChangeType::AddNode));
                }
                for node in remove {
                    change.mut_changes().push(single(*node, ConfChangeType::RemoveNode));
                }
            }
            MembershipChange::LeaveJoint => {} // An empty ConfChangeV2 leaves the joint state.
        }
        change
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn joint_changes_are_explicit_and_leaving_is_empty() {
        let n = NodeId::new;
        let enter = MembershipChange::EnterJoint { promote: vec![n(4)], remove: vec![n(1)] }.to_conf_change();
        assert_eq!(enter.get_transition(), ConfChangeTransition::Explicit);
        let kinds: Vec<_> = enter.get_changes().iter().map(|c| (c.node_id, c.get_change_type())).collect();
        assert_eq!(kinds, vec![(4, ConfChangeType::AddNode), (1, ConfChangeType::RemoveNode)]);
        assert!(MembershipChange::LeaveJoint.to_conf_change().leave_joint());
        let learner = MembershipChange::AddLearner(n(4)).to_conf_change();
        assert!(!learner.leave_joint() && learner.enter_joint().is_none());
    }

    /// Only leaving the joint configuration takes a removed voter's vote: a leader may enter one that
    /// removes it (a group of one voter has nobody to hand over to first), never leave it.
    #[test]
    fn a_voter_loses_its_vote_only_when_the_joint_configuration_is_left() {
        let n = NodeId::new;
        let conf = |voters: &[u64], joint: bool| crate::fsm::GroupConf {
            voters: voters.iter().copied().map(n).collect(),
            learners: Vec::new(),
            joint,
            config_epoch: tidings_types::ConfigEpoch::new(1),
        };
        let enter = MembershipChange::EnterJoint { promote: vec![n(2)], remove: vec![n(1)] };
        assert!(!enter.removes_voter(n(1), &conf(&[1], false)));
        assert!(MembershipChange::LeaveJoint.removes_voter(n(1), &conf(&[2], true)));
        assert!(!MembershipChange::LeaveJoint.removes_voter(n(2), &conf(&[2], true)));
    }
}
