//! Reconciliation of slot groups with the controller's intent, on each group's actual leader. The intent
//! (desired voters, configuration epoch, preferred leader, a replica move's target) is replicated through
//! the group itself (`Command::PutGroupIntent`, `MoveGroupReplica`...). Periodically the leader first takes
//! the membership one step toward the intent (see [`super::membership`]); once it is settled, it hands
//! leadership to the preferred node only when everything says it is safe and useful. Any other case does
//! nothing and records why — it never picks another node instead.

use super::applied_cache::AppliedCache;
use super::membership::{next_step, ClusterView, MembershipStep};
use super::ControllerConfig;
use std::collections::BTreeMap;
use tidings_slot::command::Command;
use tidings_slot::model::GroupIntent;
use tidings_slot::query::SlotReader;
use tidings_slot::raft::{GroupStatus, MultiRaft};
use tidings_types::{ConfigEpoch, GroupId, NodeId, Time};

/// What reconciliation decided for one group on its leader, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reconcile {
    /// Leadership is being handed to the preferred node.
    Transfer {
        /// The preferred node.
        to: NodeId,
    },
    /// This node is the preferred leader.
    AlreadyPreferred,
    /// No intent was set for the group.
    NoIntent,
    /// The membership is on its way to the intent; this is its step (leadership waits until it settles).
    Membership(MembershipStep),
    /// The intent names no preferred leader.
    NoPreferredLeader,
    /// The intent was made for another configuration epoch.
    StaleIntent {
        /// The intent's epoch.
        intent: ConfigEpoch,
        /// The group's epoch.
        current: ConfigEpoch,
    },
    /// The configuration is joint (a membership change is in progress).
    JointConfig,
    /// The voters are not exactly the desired peers.
    VoterMismatch {
        /// Voters in force.
        voters: Vec<NodeId>,
        /// Voters the intent wants.
        desired: Vec<NodeId>,
    },
    /// The preferred node is not a voter.
    TargetNotVoter(NodeId),
    /// A transfer is already in flight.
    TransferInFlight(NodeId),
    /// The preferred node was not recently active.
    TargetInactive(NodeId),
    /// The preferred node has not caught up with the commit index.
    TargetLagging {
        /// Its match index.
        matched: u64,
        /// The commit index.
        commit: u64,
    },
    /// This node is leaving: leadership is being handed to `to`, a caught-up, active voter that is not
    /// leaving.
    HandOff {
        /// The voter taking over.
        to: NodeId,
    },
    /// This node is leaving, and no voter can take over yet (none other is active, caught up and
    /// staying).
    NoHandOffTarget,
    /// The preferred node is leaving: leadership stays here until it is back.
    TargetLeaving(NodeId),
    /// A transfer was made recently; the next may not come before this time (no flapping).
    Cooldown {
        /// End of the cooldown.
        until: Time,
    },
}

/// Decides for a group this node (`me`) leads.
pub(crate) fn decide(
    intent: Option<&GroupIntent>,
    status: &GroupStatus,
    me: NodeId,
    now: Time,
    cooldown_until: Option<Time>,
    cluster: &ClusterView<'_>,
) -> Reconcile {
    if cluster.leaving.contains(&me) {
        return hand_off(status, me, cluster);
    }
    let Some(intent) = intent else { return Reconcile::NoIntent };
    match next_step(intent, status, me, cluster) {
        MembershipStep::Settled => {}
        step => return Reconcile::Membership(step),
    }
    if intent.config_epoch != status.config_epoch {
        return Reconcile::StaleIntent { intent: intent.config_epoch, current: status.config_epoch };
    }
    if status.joint {
        return Reconcile::JointConfig;
    }
    let (mut voters, mut desired) = (status.voters.clone(), intent.desired_peers.clone());
    voters.sort_unstable();
    desired.sort_unstable();
    if voters != desired {
        return Reconcile::VoterMismatch { voters, desired };
    }
    let Some(target) = intent.preferred_leader else { return Reconcile::NoPreferredLeader };
    if target == me {
        return Reconcile::AlreadyPreferred;
    }
    if !voters.contains(&target) {
        return Reconcile::TargetNotVoter(target);
    }
    if cluster.leaving.contains(&target) {
        return Reconcile::TargetLeaving(target);
    }
    if let Some(to) = status.transferring {
        return Reconcile::TransferInFlight(to);
    }
    let Some(&(_, matched, active)) = status.peers.iter().find(|(n, _, _)| *n == target) else {
        return Reconcile::TargetInactive(target);
    };
    if !active {
        return Reconcile::TargetInactive(target);
    }
    if matched < status.commit {
        return Reconcile::TargetLagging { matched, commit: status.commit };
    }
    if let Some(until) = cooldown_until.filter(|until| now < *until) {
        return Reconcile::Cooldown { until };
    }
    Reconcile::Transfer { to: target }
}

/// Where a leaving node (`me`) hands the leadership of a group it leads: the active voter, not down and
/// not leaving, with the most of the log (then the lowest id). No intent needs to agree: a leader that
/// is about to stop helps nobody by staying, and raft-rs catches the target up before it hands over.
fn hand_off(status: &GroupStatus, me: NodeId, cluster: &ClusterView<'_>) -> Reconcile {
    if status.joint {
        return Reconcile::JointConfig;
    }
    if let Some(to) = status.transferring {
        return Reconcile::TransferInFlight(to);
    }
    let staying = |node: &NodeId| {
        *node != me && status.voters.contains(node) && !cluster.leaving.contains(node) && !cluster.down.contains(node)
    };
    let best = status
        .peers
        .iter()
        .filter(|(node, _, active)| *active && staying(node))
        .max_by_key(|(node, matched, _)| (*matched, std::cmp::Reverse(*node)));
    best.map_or(Reconcile::NoHandOffTarget, |(to, _, _)| Reconcile::HandOff { to: *to })
}

/// What a reconcile pass reads of its node.
#[derive(Clone, Copy)]
pub(crate) struct NodeView<'a> {
    /// This node.
    pub(crate) me: NodeId,
    /// Its slot metadata.
    pub(crate) reader: &'a SlotReader,
    /// Every node of the cluster, and the ones the failure detector holds down.
    pub(crate) cluster: ClusterView<'a>,
}

/// The reconciliation loop of one node: every `reconcile_interval`, each group it leads.
#[derive(Debug, Default)]
pub(crate) struct PreferredLeaders {
    next_at: Time,
    cooldown_until: BTreeMap<GroupId, Time>,
    decisions: BTreeMap<GroupId, Reconcile>,
    /// Each led group's intent as of its applied index.
    intents: AppliedCache<Option<GroupIntent>>,
}

impl PreferredLeaders {
    /// When the next pass is due.
    pub(crate) fn poll_timeout(&self) -> Time {
        self.next_at
    }

    /// The last decision per group this node led.
    pub(crate) fn decisions(&self) -> Vec<(GroupId, Reconcile)> {
        self.decisions.iter().map(|(g, d)| (*g, d.clone())).collect()
    }

    /// The next pass comes at once (this node just started or stopped leaving).
    pub(crate) fn wake(&mut self, now: Time) {
        self.next_at = self.next_at.min(now);
    }

    /// One pass, if due.
    pub(crate) fn tick(&mut self, now: Time, config: &ControllerConfig, slot: &mut MultiRaft, view: &NodeView<'_>) {
        let NodeView { me, reader, cluster } = *view;
        if now < self.next_at {
            return;
        }
        self.next_at = now + config.reconcile_interval;
        let led: Vec<GroupId> = slot.groups().filter(|g| slot.is_leader(*g)).collect();
        self.decisions.retain(|g, _| led.contains(g));
        self.intents.retain(|g| led.contains(&g));
        for group in led {
            let Some(status) = slot.status(group) else { continue };
            let intent = match self.intents.get_or_read(group, slot.applied_index(group), || reader.group_intent(group))
            {
                Ok(intent) => intent,
                Err(error) => {
                    tracing::warn!(%error, %group, "reconcile: cannot read the group's intent");
                    continue;
                }
            };
            let cooldown = self.cooldown_until.get(&group).copied();
            let decision = decide(intent.as_ref(), &status, me, now, cooldown, &cluster);
            match &decision {
                Reconcile::Transfer { to } if slot.transfer_leader(now, group, *to) => {
                    tracing::info!(%group, %to, "reconcile: handing leadership to the preferred node");
                    self.cooldown_until.insert(group, now + config.transfer_cooldown);
                }
                Reconcile::HandOff { to } if slot.transfer_leader(now, group, *to) => {
                    tracing::info!(%group, %to, "reconcile: a leaving node hands its leadership over");
                    // Raft-rs gives a transfer an election timeout: look again soon.
                    self.next_at = self.next_at.min(now + MEMBERSHIP_RECHECK);
                }
                Reconcile::NoHandOffTarget | Reconcile::TransferInFlight(_) if cluster.leaving.contains(&me) => {
                    self.next_at = self.next_at.min(now + MEMBERSHIP_RECHECK);
                }
                Reconcile::Membership(step) => {
                    take_step(now, slot, group, step);
                    // A move goes step by step: look again soon rather than a whole interval later.
                    self.next_at = self.next_at.min(now + MEMBERSHIP_RECHECK);
                }
                _ => {}
            }
            self.decisions.insert(group, decision);
        }
    }
}

/// How soon a group whose membership is on its way to its intent is looked at again.
const MEMBERSHIP_RECHECK: std::time::Duration = std::time::Duration::from_millis(200);

/// Carries out a membership step on this node, the group's leader. Nothing here waits: the next pass
/// sees the effect in the raft status, or proposes again if raft-rs dropped the change.
fn take_step(now: Time, slot: &mut MultiRaft, group: GroupId, step: &MembershipStep) {
    if let Some(change) = step.change() {
        match slot.change_membership(now, group, &change) {
            Ok(()) => tracing::info!(%group, ?change, "reconcile: membership change proposed"),
            Err(error) => tracing::warn!(%error, %group, ?change, "reconcile: membership change not proposed"),
        }
        return;
    }
    match step {
        MembershipStep::HandOffLeadership { to } if slot.transfer_leader(now, group, *to) => {
            tracing::info!(%group, %to, "reconcile: leaving voter hands its leadership over");
        }
        MembershipStep::CommitAssignment | MembershipStep::StartDrainMove { .. } | MembershipStep::GiveUpMove(_) => {
            // The FSM checks each against the intent and the membership in force at the entry; a refusal
            // changes nothing.
            let command = match *step {
                MembershipStep::StartDrainMove { from, to } => Command::MoveGroupReplica { group, from, to },
                MembershipStep::GiveUpMove(node) => {
                    tracing::warn!(%group, %node, "reconcile: giving up a move towards a node silent for too long");
                    Command::AbortGroupMove { group }
                }
                _ => Command::CommitGroupConfig { group },
            };
            if let Err(error) = slot.propose(now, &command) {
                tracing::warn!(%error, %group, ?step, "reconcile: intent change not proposed");
            }
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn n(id: u64) -> NodeId {
        NodeId::new(id)
    }

    static NO_DOWN: std::collections::BTreeSet<NodeId> = std::collections::BTreeSet::new();

    fn cluster() -> ClusterView<'static> {
        ClusterView { nodes: &[], down: &NO_DOWN, gone: &NO_DOWN, leaving: &NO_DOWN }
    }

    fn status() -> GroupStatus {
        GroupStatus { config_epoch: ConfigEpoch::new(0), ..super::super::membership::tests::status(&[1, 2, 3], &[]) }
    }

    fn intent(preferred: u64) -> GroupIntent {
        GroupIntent {
            group: GroupId::new(1),
            desired_peers: vec![n(3), n(2), n(1)],
            config_epoch: ConfigEpoch::new(0),
            preferred_leader: Some(n(preferred)),
            target_peers: None,
            draining: Vec::new(),
        }
    }

    #[test]
    fn transfers_only_when_every_condition_holds_and_says_why_not_otherwise() {
        let now = Time::from_millis(50_000);
        let me = n(1);
        assert_eq!(decide(Some(&intent(2)), &status(), me, now, None, &cluster()), Reconcile::Transfer { to: n(2) });
        assert_eq!(decide(None, &status(), me, now, None, &cluster()), Reconcile::NoIntent);
        assert_eq!(decide(Some(&intent(1)), &status(), me, now, None, &cluster()), Reconcile::AlreadyPreferred);
        let stale = GroupIntent { config_epoch: ConfigEpoch::new(7), ..intent(2) };
        assert!(matches!(decide(Some(&stale), &status(), me, now, None, &cluster()), Reconcile::StaleIntent { .. }));
        let joint = GroupStatus { joint: true, ..status() };
        assert_eq!(
            decide(Some(&intent(2)), &joint, me, now, None, &cluster()),
            Reconcile::Membership(MembershipStep::LeaveJoint)
        );
        let other_peers = GroupIntent { desired_peers: vec![n(1), n(2), n(4)], ..intent(2) };
        assert!(matches!(
            decide(Some(&other_peers), &status(), me, now, None, &cluster()),
            Reconcile::VoterMismatch { .. }
        ));
        let moving = GroupIntent { target_peers: Some(vec![n(1), n(2), n(4)]), ..intent(2) };
        assert_eq!(
            decide(Some(&moving), &status(), me, now, None, &cluster()),
            Reconcile::Membership(MembershipStep::AddLearner(n(4)))
        );
        let unpreferred = GroupIntent { preferred_leader: None, ..intent(2) };
        assert_eq!(decide(Some(&unpreferred), &status(), me, now, None, &cluster()), Reconcile::NoPreferredLeader);
        let outsider = GroupIntent { desired_peers: vec![n(1), n(2), n(3)], ..intent(9) };
        assert_eq!(decide(Some(&outsider), &status(), me, now, None, &cluster()), Reconcile::TargetNotVoter(n(9)));
        let busy = GroupStatus { transferring: Some(n(3)), ..status() };
        assert_eq!(decide(Some(&intent(2)), &busy, me, now, None, &cluster()), Reconcile::TransferInFlight(n(3)));
        let quiet = GroupStatus { peers: vec![(n(1), 10, true), (n(2), 10, false), (n(3), 10, true)], ..status() };
        assert_eq!(decide(Some(&intent(2)), &quiet, me, now, None, &cluster()), Reconcile::TargetInactive(n(2)));
        let behind = GroupStatus { peers: vec![(n(1), 10, true), (n(2), 8, true), (n(3), 10, true)], ..status() };
        assert_eq!(
            decide(Some(&intent(2)), &behind, me, now, None, &cluster()),
            Reconcile::TargetLagging { matched: 8, commit: 10 }
        );
        let until = now + std::time::Duration::from_secs(5);
        assert_eq!(
            decide(Some(&intent(2)), &status(), me, now, Some(until), &cluster()),
            Reconcile::Cooldown { until }
        );
        assert_eq!(
            decide(Some(&intent(2)), &status(), me, until, Some(until), &cluster()),
            Reconcile::Transfer { to: n(2) }
        );
    }

    #[test]
    fn a_leaving_leader_hands_off_to_the_most_caught_up_staying_voter_and_none_is_handed_to_a_leaving_one() {
        let now = Time::from_millis(50_000);
        let me = n(1);
        let set = |ids: &[u64]| ids.iter().map(|i| n(*i)).collect::<std::collections::BTreeSet<_>>();
        let (me_leaving, three_leaving, two_down) = (set(&[1]), set(&[1, 3]), set(&[2]));
        let view = |leaving| ClusterView { leaving, ..cluster() };
        let peers = GroupStatus { peers: vec![(n(1), 10, true), (n(2), 9, true), (n(3), 10, true)], ..status() };
        // The most of the log first, whatever the intent says (none here, or another preferred node).
        assert_eq!(decide(None, &peers, me, now, None, &view(&me_leaving)), Reconcile::HandOff { to: n(3) });
        assert_eq!(
            decide(Some(&intent(1)), &peers, me, now, None, &view(&me_leaving)),
            Reconcile::HandOff { to: n(3) }
        );
        // Never to another leaving node, a down one, an inactive one, or a learner.
        assert_eq!(decide(None, &peers, me, now, None, &view(&three_leaving)), Reconcile::HandOff { to: n(2) });
        let down = ClusterView { down: &two_down, ..view(&three_leaving) };
        assert_eq!(decide(None, &peers, me, now, None, &down), Reconcile::NoHandOffTarget);
        let quiet = GroupStatus { peers: vec![(n(1), 10, true), (n(2), 9, false), (n(3), 10, false)], ..status() };
        assert_eq!(decide(None, &quiet, me, now, None, &view(&me_leaving)), Reconcile::NoHandOffTarget);
        let learner = GroupStatus {
            voters: vec![n(1), n(2)],
            learners: vec![n(3)],
            peers: vec![(n(1), 10, true), (n(2), 9, true), (n(3), 10, true)],
            ..status()
        };
        assert_eq!(decide(None, &learner, me, now, None, &view(&me_leaving)), Reconcile::HandOff { to: n(2) });
        let busy = GroupStatus { transferring: Some(n(2)), ..peers.clone() };
        assert_eq!(decide(None, &busy, me, now, None, &view(&me_leaving)), Reconcile::TransferInFlight(n(2)));
        // A leader that stays keeps the group from a preferred node that is leaving.
        assert_eq!(
            decide(Some(&intent(3)), &peers, me, now, None, &view(&three_leaving)),
            Reconcile::HandOff { to: n(2) },
            "this node leaves too"
        );
        let others_leaving = set(&[3]);
        assert_eq!(
            decide(Some(&intent(3)), &peers, me, now, None, &view(&others_leaving)),
            Reconcile::TargetLeaving(n(3))
        );
    }
}
