//! Membership changes of a slot group, as the controller asks for them, and their raft-rs encoding.
//!
//! A replica move is a sequence of these, each proposed by the group's leader once the previous one
//! applied: add the target as a learner, let it catch up, enter a joint configuration that promotes it and
//! removes the old voter, leave the joint configuration explicitly.

use protobuf::Message as _;
use raft::prelude::{
    ConfChange, ConfChangeSingle, ConfChangeTransition, ConfChangeType, ConfChangeV2, Entry, EntryType,
};
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
        takes_vote(&self.to_conf_change(), node, conf)
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

/// `true` if applying `change` to `conf` leaves `node`, a voter now, without a vote.
pub(crate) fn takes_vote(change: &ConfChangeV2, node: NodeId, conf: &crate::fsm::GroupConf) -> bool {
    if change.leave_joint() {
        // `conf.voters` are the incoming voters: leaving the joint state keeps only them.
        return conf.joint && !conf.voters.contains(&node);
    }
    if change.enter_joint().is_some() {
        // A voter removed by the joint configuration still votes in its outgoing half, and a leader
        // there still leads: it hands over to an incoming voter before the group leaves the joint
        // configuration (the controller's next step). The controller hands over before entering when a
        // voter stays to take over; a group of one voter has none.
        return false;
    }
    // A simple change: the voter removed, or made a learner.
    conf.voters.contains(&node)
        && change.get_changes().iter().any(|single| {
            single.node_id == node.get()
                && matches!(single.get_change_type(), ConfChangeType::RemoveNode | ConfChangeType::AddLearnerNode)
        })
}

/// `true` if `change` adds `node` to the group, as a learner or a voter.
pub(crate) fn adds(change: &ConfChangeV2, node: NodeId) -> bool {
    change.get_changes().iter().any(|single| {
        single.node_id == node.get()
            && matches!(single.get_change_type(), ConfChangeType::AddNode | ConfChangeType::AddLearnerNode)
    })
}

/// The membership change a log entry carries, in the V2 form (raft-rs applies a V1 change as the V2
/// change of one step); `None` for an entry of another type or one that does not decode.
pub(crate) fn entry_conf_change(entry: &Entry) -> Option<ConfChangeV2> {
    match entry.get_entry_type() {
        EntryType::EntryConfChangeV2 => ConfChangeV2::parse_from_bytes(&entry.data).ok(),
        EntryType::EntryConfChange => ConfChange::parse_from_bytes(&entry.data).ok().map(|v1| {
            let mut single = ConfChangeSingle { node_id: v1.node_id, ..Default::default() };
            single.set_change_type(v1.get_change_type());
            let mut change = ConfChangeV2::default();
            change.mut_changes().push(single);
            change.context = v1.context;
            change
        }),
        EntryType::EntryNormal => None,
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
        // Simple changes: a voter removed loses its vote, a learner removed had none.
        assert!(MembershipChange::RemoveLearner(n(1)).removes_voter(n(1), &conf(&[1, 2], false)));
        assert!(!MembershipChange::RemoveLearner(n(3)).removes_voter(n(3), &conf(&[1, 2], false)));
        assert!(!MembershipChange::AddLearner(n(3)).removes_voter(n(1), &conf(&[1, 2], false)));
    }

    #[test]
    fn a_v1_entry_reads_as_the_v2_change_of_one_step() {
        let mut v1 = ConfChange { node_id: 3, ..Default::default() };
        v1.set_change_type(ConfChangeType::RemoveNode);
        let mut entry = Entry { data: v1.write_to_bytes().unwrap().into(), ..Default::default() };
        entry.set_entry_type(EntryType::EntryConfChange);
        let change = entry_conf_change(&entry).expect("decodes");
        assert!(change.enter_joint().is_none() && !change.leave_joint());
        let kinds: Vec<_> = change.get_changes().iter().map(|c| (c.node_id, c.get_change_type())).collect();
        assert_eq!(kinds, vec![(3, ConfChangeType::RemoveNode)]);
        entry.set_entry_type(EntryType::EntryNormal);
        assert!(entry_conf_change(&entry).is_none());
    }
}
