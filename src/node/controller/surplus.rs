//! Channels back to their replication factor. A replacement that does not finish leaves the replica
//! it added behind: as a learner (it timed out catching up, or its controller stopped), or in the ISR
//! (the leader takes a caught-up learner in itself). Left there, such a replica replicates the channel
//! for ever, and each later interrupted replacement may add one more. The repair pass gives one up per
//! channel at a time, once every pass for `catch_up_timeout` found the channel healthy with the same
//! replicas (a replacement on another node's controller may still be catching one up: operators start
//! tasks on any node); a replacement of this node's that gives up takes its own learner out at once.

use super::report::TaskKind;
use super::{Controller, FENCES_SEEN_MAX};
use tidings_types::{ChannelRuntimeMeta, NodeId, Time};

/// A channel over its replication factor as the repair passes found it: healthy, with `replicas`,
/// since `since`; `pass` is the last pass that saw it so (an entry no pass saw goes at the pass's end:
/// its channel healed, went to another group, or has a task).
#[derive(Debug)]
pub(super) struct SurplusSeen {
    replicas: Vec<NodeId>,
    since: Time,
    pass: u64,
}

/// The replica a channel holding more replicas than it is created with gives up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Surplus {
    /// A replica outside the ISR: taken out in one meta change, without a fence (a learner never
    /// counts towards commit or leadership).
    Learner(NodeId),
    /// Every replica is in the ISR: `from` leaves through a replacement in place by `to`, another of
    /// the channel's replicas (fenced, as any change of the ISR by a controller is).
    InSync { from: NodeId, to: NodeId },
}

impl Controller {
    /// What `meta`'s channel gives up, if it holds more replicas than it is created with and is
    /// healthy: unfenced, its leader up, no replica on a drained node (the drain moves replicas first),
    /// at least MinISR live ISR members (a channel below MinISR keeps its learner: the replacement that
    /// repairs it takes the learner instead of adding another). A learner goes first — one on a down
    /// node, else the last added —; else the last added ISR member that neither leads nor is the
    /// preferred replica (one on a down node first), replaced in place by a live replica.
    pub(super) fn surplus_replica(&self, meta: &ChannelRuntimeMeta, now: Time) -> Option<Surplus> {
        let down = |n: &NodeId| self.is_down(*n, now);
        let drained = |n: &NodeId| self.scan.draining.contains(n) || self.drains_known.contains(n);
        let healthy = meta.write_fence.is_none()
            && !down(&meta.leader)
            && !meta.replicas.iter().any(drained)
            && meta.isr.iter().filter(|n| !down(n)).count() >= usize::from(meta.min_isr);
        if !healthy || meta.replicas.len() <= self.replication_factor {
            return None;
        }
        let learners: Vec<NodeId> = meta.learners().collect();
        if let Some(node) = learners.iter().copied().find(down).or(learners.last().copied()) {
            return Some(Surplus::Learner(node));
        }
        let first = meta.replicas.first().copied();
        let leaving = || meta.replicas.iter().rev().copied().filter(|n| *n != meta.leader && Some(*n) != first);
        let from = leaving().find(down).or_else(|| leaving().next())?;
        let staying = || meta.replicas.iter().rev().copied().filter(|n| *n != from && !down(n));
        let to = staying().find(|n| Some(*n) != first).or_else(|| staying().next())?;
        Some(Surplus::InSync { from, to })
    }

    /// The repair pass's part: gives up `meta`'s surplus replica once every pass for
    /// `catch_up_timeout` found the channel healthy with the same replicas (by then a replacement
    /// catching one of them up has fenced — the pass then finds the channel fenced, or its replicas
    /// changed by the switch — or given up). The ISR may change meanwhile: under load or tight limits
    /// leaders shrink and expand it all the time. `true` if the channel has a surplus (given up now or
    /// later).
    pub(super) fn give_up_surplus_replica(&mut self, now: Time, meta: &ChannelRuntimeMeta) -> bool {
        let Some(surplus) = self.surplus_replica(meta, now) else {
            self.surplus_seen.remove(&meta.channel);
            return false;
        };
        let pass = self.scan.pass;
        match self.surplus_seen.get_mut(&meta.channel) {
            Some(seen) if seen.replicas == meta.replicas => {
                seen.pass = pass;
                if now.since(seen.since) < self.config.catch_up_timeout {
                    return true;
                }
            }
            _ => {
                let full = self.surplus_seen.len() >= FENCES_SEEN_MAX;
                if !full || self.surplus_seen.contains_key(&meta.channel) {
                    let seen = SurplusSeen { replicas: meta.replicas.clone(), since: now, pass };
                    self.surplus_seen.insert(meta.channel.clone(), seen);
                }
                return true;
            }
        }
        self.surplus_seen.remove(&meta.channel);
        match surplus {
            Surplus::Learner(node) => self.start_learner_removal(now, meta, node),
            Surplus::InSync { from, to } => {
                tracing::info!(channel = %meta.channel, %from, %to, "repair: an over-replicated channel gives up a replica");
                if let Err(error) = self.start_replace(now, None, meta.clone(), from, to) {
                    tracing::debug!(%error, %from, "repair: surplus replica not given up");
                }
            }
        }
        true
    }

    /// Healthy channels over their replication factor the last repair passes found and wait to give a
    /// replica up for.
    pub(crate) fn channels_over_factor(&self) -> usize {
        self.surplus_seen.len()
    }

    /// At the end of a repair pass: forgets the channels it did not find over their factor.
    pub(super) fn surplus_pass_done(&mut self) {
        let pass = self.scan.pass;
        self.surplus_seen.retain(|_, seen| seen.pass == pass);
    }

    /// A replacement of this node's gave up catching `to` up: in a healthy channel over its factor the
    /// learner it added goes at once (a failed task leaves the members as they were).
    pub(super) fn remove_own_learner(&mut self, now: Time, meta: &ChannelRuntimeMeta, to: NodeId) {
        let surplus = matches!(self.surplus_replica(meta, now), Some(Surplus::Learner(_)));
        if surplus && meta.is_replica(to) && !meta.in_isr(to) {
            self.start_learner_removal(now, meta, to);
        }
    }

    /// Starts taking `node`, a learner, out of `meta`'s channel (`TaskKind::RemoveLearner`), unless a
    /// task runs for the channel here.
    fn start_learner_removal(&mut self, now: Time, meta: &ChannelRuntimeMeta, node: NodeId) {
        if self.admit(&meta.channel).is_err() {
            return;
        }
        tracing::info!(channel = %meta.channel, %node, "repair: taking a learner out of an over-replicated channel");
        let id = self.task_id();
        let task = self.new_task(id, TaskKind::RemoveLearner { node }, None, meta.clone(), now);
        self.start(now, task);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::controller::{Action, ControllerConfig};
    use std::time::Duration;
    use tidings_slot::command::Command;
    use tidings_slot::fsm::Outcome;

    fn n(id: u64) -> NodeId {
        NodeId::new(id)
    }

    /// Five nodes, all heard at `now`; channels of 3 replicas; no transfers back to preferred leaders.
    fn controller(now: Time) -> (Controller, ControllerConfig) {
        let nodes = [n(1), n(2), n(3), n(4), n(5)];
        let config = ControllerConfig { rebalance_leaders_after: None, ..ControllerConfig::default() };
        let mut controller = Controller::new(config.clone(), n(1), &nodes, 3, 1, Time::ZERO);
        for node in &nodes[1..] {
            controller.heard(*node, now);
        }
        (controller, config)
    }

    /// Node 1 leads replicas 2, 1, 3 and `more`; the ISR is `isr`.
    fn meta(more: &[u64], isr: &[u64]) -> ChannelRuntimeMeta {
        let base = super::super::repair::tests::led_away_from_its_preferred_replica();
        let replicas = base.replicas.iter().copied().chain(more.iter().map(|id| n(*id))).collect();
        ChannelRuntimeMeta { replicas, isr: isr.iter().map(|id| n(*id)).collect(), ..base }
    }

    #[test]
    fn a_healthy_channel_over_its_factor_gives_up_a_learner_first_and_keeps_what_a_repair_needs() {
        let now = Time::from_millis(100);
        let (mut controller, _) = controller(now);
        assert_eq!(controller.surplus_replica(&meta(&[], &[2, 1, 3]), now), None, "at its factor");
        let two_learners = meta(&[4, 5], &[2, 1, 3]);
        assert_eq!(controller.surplus_replica(&two_learners, now), Some(Surplus::Learner(n(5))), "the last added");
        let below = ChannelRuntimeMeta { min_isr: 3, ..meta(&[4, 5], &[2, 1]) };
        assert_eq!(controller.surplus_replica(&below, now), None, "below MinISR: kept for a repair");
        controller.scan.draining.insert(n(3));
        assert_eq!(controller.surplus_replica(&two_learners, now), None, "a drain moves replicas first");
        controller.scan.draining.clear();
        // All in the ISR: the last added that neither leads nor is preferred, replaced in place.
        let in_sync = meta(&[4], &[2, 1, 3, 4]);
        assert_eq!(controller.surplus_replica(&in_sync, now), Some(Surplus::InSync { from: n(4), to: n(3) }));
        let led_by_the_last = ChannelRuntimeMeta { leader: n(4), ..in_sync.clone() };
        assert_eq!(
            controller.surplus_replica(&led_by_the_last, now),
            Some(Surplus::InSync { from: n(3), to: n(4) }),
            "the leader stays"
        );
    }

    /// A channel a repair pass did not find over its factor (healed, moved to another group, or with a
    /// task) is forgotten at the pass's end: the wait starts again when one finds it so again.
    #[test]
    fn a_pass_that_does_not_find_a_channel_over_its_factor_forgets_it() {
        let now = Time::from_millis(100);
        let (mut controller, _) = controller(now);
        controller.scan.pass = 1;
        controller.consider(now, meta(&[4], &[2, 1, 3]));
        controller.surplus_pass_done();
        assert_eq!(controller.channels_over_factor(), 1, "seen by this pass");
        controller.scan.pass = 2;
        controller.surplus_pass_done();
        assert_eq!(controller.channels_over_factor(), 0, "not seen by the next");
    }

    /// A replacement of this node's whose learner does not catch up in time fails, and the learner it
    /// added leaves at once (no wait: the task knows it is its own); in a channel below MinISR it stays
    /// for the replacement that repairs the channel.
    #[test]
    fn a_replacement_that_times_out_takes_its_own_learner_out_at_once_unless_the_channel_needs_it() {
        let now = Time::from_millis(100);
        // MinISR 3 of replicas 2, 1, 3: with node 3 down at the deadline, the channel is below MinISR.
        for node_3_up in [true, false] {
            let (mut controller, config) = controller(now);
            let base = ChannelRuntimeMeta { min_isr: 3, ..meta(&[], &[2, 1, 3]) };
            controller.start_replace(now, None, base.clone(), n(3), n(4)).expect("the replacement starts");
            let Some(Action::Propose { tag, .. }) = controller.poll_action() else { panic!("adds the learner") };
            controller.proposal_done(now, &base.channel, tag, Ok(Outcome::Applied));
            let deadline = now + config.catch_up_timeout;
            for node in [n(2), n(3), n(4), n(5)].into_iter().filter(|node| node_3_up || *node != n(3)) {
                controller.heard(node, deadline);
            }
            controller.task_timer(deadline, &base.channel);
            let report = controller.reports().pop().expect("the replacement's report");
            assert_eq!(report.outcome, Err(super::super::report::TaskError::DrainTimedOut));
            let removal = controller.tasks.get(&base.channel).map(|t| t.kind);
            let expected = node_3_up.then_some(TaskKind::RemoveLearner { node: n(4) });
            assert_eq!(removal, expected, "node 3 up: {node_3_up}");
        }
    }

    /// The pass gives up a surplus only once the channel kept its replicas for `catch_up_timeout` (a
    /// change of the ISR does not start the wait again, one of the replicas does), a learner on a down
    /// node first, in one meta change of the next version and membership epoch, without a fence or
    /// proof.
    #[test]
    fn the_pass_waits_for_settled_replicas_then_takes_the_learner_on_a_down_node_out() {
        let now = Time::from_millis(100);
        let (mut controller, config) = controller(now);
        let mut meta = meta(&[4, 5], &[2, 1, 3]);
        let mut at = now + config.node_down_after + Duration::from_millis(1);
        let pass = |controller: &mut Controller, at: Time, meta: &ChannelRuntimeMeta| {
            for node in [n(2), n(3), n(5)] {
                controller.heard(node, at); // node 4 falls silent
            }
            controller.consider(at, meta.clone());
        };
        pass(&mut controller, at, &meta);
        assert!(controller.tasks.is_empty(), "first seen: wait");
        assert_eq!(controller.channels_over_factor(), 1);
        let reordered = ChannelRuntimeMeta { replicas: vec![n(2), n(1), n(3), n(5), n(4)], ..meta.clone() };
        at = at + config.catch_up_timeout;
        pass(&mut controller, at, &reordered);
        assert!(controller.tasks.is_empty(), "other replicas: wait again");
        at = at + config.catch_up_timeout / 2;
        meta.version += 1;
        meta.isr.retain(|node| *node != n(3));
        meta.replicas = reordered.replicas.clone();
        pass(&mut controller, at, &meta);
        assert!(controller.tasks.is_empty(), "the ISR changed: the wait goes on");
        at = at + config.catch_up_timeout / 2;
        pass(&mut controller, at, &meta);
        assert_eq!(controller.tasks[&meta.channel].kind, TaskKind::RemoveLearner { node: n(4) });
        assert_eq!(controller.channels_over_factor(), 0, "given up: no longer waiting");
        let Some(Action::Propose { tag, command: Command::CasRuntimeMeta { meta: next, proof, .. }, .. }) =
            controller.poll_action()
        else {
            panic!("a meta change proposed")
        };
        assert_eq!(next.replicas, vec![n(2), n(1), n(3), n(5)]);
        assert_eq!((&next.isr, next.leader, next.leader_epoch), (&meta.isr, meta.leader, meta.leader_epoch));
        assert_eq!(
            (next.version, next.epoch, next.write_fence, proof),
            (meta.version + 1, meta.epoch.next(), None, None)
        );
        controller.proposal_done(at, &meta.channel, tag, Ok(Outcome::Applied));
        assert!(controller.tasks.is_empty());
        let report = controller.reports().pop().expect("a report");
        assert_eq!((report.kind, report.outcome), (TaskKind::RemoveLearner { node: n(4) }, Ok(())));
    }
}
