//! Changes of a slot group's membership intent (replica moves, preferred leader, drains), checked
//! against the intent stored and the membership in force.

use super::{GroupChangeError, GroupConf};
use crate::model::GroupIntent;
use tidings_types::{GroupId, NodeId};

/// A command that changes a group's membership intent.
pub(super) enum IntentChange {
    Move { from: NodeId, to: NodeId },
    Prefer(Option<NodeId>),
    Drain { node: NodeId, drain: bool },
    Abort,
    Commit,
}

/// The intent after a membership-intent change, checked against the stored intent and the membership in
/// force. A group without an intent starts from its voters in force.
pub(super) fn change_intent(
    group: GroupId,
    stored: Option<GroupIntent>,
    conf: &GroupConf,
    change: IntentChange,
) -> Result<GroupIntent, GroupChangeError> {
    let mut intent = stored.unwrap_or_else(|| GroupIntent {
        group,
        desired_peers: sorted(conf.voters.clone()),
        config_epoch: conf.config_epoch,
        preferred_leader: None,
        target_peers: None,
        draining: Vec::new(),
    });
    match change {
        IntentChange::Move { from, to } => {
            if let Some(target) = &intent.target_peers {
                return Err(GroupChangeError::MoveInProgress { target: target.clone() });
            }
            if !intent.desired_peers.contains(&from) {
                return Err(GroupChangeError::NotAVoter(from));
            }
            if intent.desired_peers.contains(&to) {
                return Err(GroupChangeError::AlreadyAVoter(to));
            }
            if intent.draining.contains(&to) {
                return Err(GroupChangeError::TargetDraining(to));
            }
            let target = intent.desired_peers.iter().map(|n| if *n == from { to } else { *n }).collect();
            intent.target_peers = Some(sorted(target));
        }
        IntentChange::Prefer(preferred) => intent.preferred_leader = preferred,
        IntentChange::Drain { node, drain } => {
            intent.draining.retain(|n| *n != node);
            if drain {
                intent.draining.push(node);
                intent.draining.sort_unstable();
            }
        }
        IntentChange::Abort => {
            // Aborting retargets the move to the committed assignment: the leader takes the membership back
            // step by step, then commits it (with the epoch it ends in) like any move.
            if intent.target_peers.as_ref().is_none_or(|target| *target == intent.desired_peers) {
                return Err(GroupChangeError::NoMoveInProgress);
            }
            intent.target_peers = Some(intent.desired_peers.clone());
        }
        IntentChange::Commit => {
            let voters = sorted(conf.voters.clone());
            let wanted = sorted(intent.wanted_voters().to_vec());
            if conf.joint || voters != wanted {
                return Err(GroupChangeError::ConfigMismatch { voters, joint: conf.joint, wanted });
            }
            if intent.target_peers.is_none() {
                return Err(GroupChangeError::NothingToCommit);
            }
            intent.desired_peers = voters;
            intent.config_epoch = conf.config_epoch;
            intent.target_peers = None;
        }
    }
    Ok(intent)
}

pub(super) fn sorted(mut nodes: Vec<NodeId>) -> Vec<NodeId> {
    nodes.sort_unstable();
    nodes.dedup();
    nodes
}
