//! A task's steps: started, fenced, evidence gathered and evaluated, the switch or unfence proposed and
//! seen applied, its timer, and its end.

use super::report::{EvidenceEntry, EvidenceReport, TaskBlocked, TaskError, TaskKind, TaskReport};
use super::{fenced, replacement_target, switch_proof, unfenced, Action, Change, Controller, Step, Task};
use crate::node::message::NodeMessage;
use std::collections::{BTreeMap, BTreeSet};
use tidings_slot::command::Command;
use tidings_types::{ChannelId, ChannelRuntimeMeta, NodeId, Time, WriteFence};

impl Controller {
    /// First step: the fence (or, for an abandoned fence, its removal).
    pub(super) fn start(&mut self, now: Time, task: Task) {
        let channel = task.meta.channel.clone();
        tracing::info!(%channel, task = task.id, kind = ?task.kind, node = %self.me, "channel task starts");
        self.tasks.insert(channel.clone(), task);
        let task = self.tasks.get_mut(&channel).expect("just inserted");
        let (change, next) = match task.kind {
            TaskKind::ClearFence => (Change::Unfence { switched: false }, unfenced(&task.meta)),
            TaskKind::Failover => (Change::Fence, fenced(&task.meta, task.id, true)),
            TaskKind::Transfer { .. } | TaskKind::HandOff { .. } => (Change::Fence, fenced(&task.meta, task.id, false)),
            TaskKind::Replace { to, .. } if task.meta.is_replica(to) => {
                // Already a learner (a replacement that was interrupted): straight to catching up.
                task.step = Step::CatchingUp;
                task.deadline = Some(now + self.config.catch_up_timeout);
                self.ask(now, &channel);
                return;
            }
            TaskKind::Replace { to, .. } => (Change::AddLearner, with_replicas(&task.meta, |r| r.push(to))),
            TaskKind::RemoveLearner { node } => {
                (Change::RemoveLearner, with_replicas(&task.meta, |r| r.retain(|n| *n != node)))
            }
        };
        self.propose(now, &channel, change, next);
    }

    /// Resumes (or enters) evidence gathering on an already fenced meta.
    pub(super) fn gather(&mut self, now: Time, mut task: Task) {
        let channel = task.meta.channel.clone();
        tracing::info!(%channel, task = task.id, node = %self.me, "channel failover resumes at evidence gathering");
        task.step = Step::Gathering;
        self.tasks.insert(channel.clone(), task);
        self.ask(now, &channel);
    }

    pub(super) fn propose(&mut self, now: Time, channel: &ChannelId, change: Change, next: ChannelRuntimeMeta) {
        let Some(task) = self.tasks.get_mut(channel) else { return };
        let proof = (change == Change::Switch).then(|| switch_proof(task));
        let command = Command::CasRuntimeMeta { expected_version: task.meta.version, meta: next.clone(), proof };
        let tag = self.next_tag;
        self.next_tag += 1;
        task.step = Step::Proposing { change, proposed: next, tag, confirming: false, fetched: false };
        if change != Change::Fence {
            // Past the drain: the deadline no longer applies.
            task.deadline = None;
        }
        // A proposal's outcome always arrives (raft-rs reports drops and timeouts); the timer is only a
        // backstop for confirmations.
        task.next_ask = now + self.config.ask_interval * 10;
        self.actions.push_back(Action::Propose { channel: channel.clone(), tag, command });
    }

    pub(super) fn applied(&mut self, now: Time, channel: &ChannelId, change: Change, committed: ChannelRuntimeMeta) {
        let Some(task) = self.tasks.get_mut(channel) else { return };
        task.meta = committed;
        match change {
            Change::AddLearner => {
                task.step = Step::CatchingUp;
                task.deadline = Some(now + self.config.catch_up_timeout);
                self.ask(now, channel);
            }
            Change::Fence => {
                task.step = Step::Gathering;
                task.drain_recheck = super::DRAIN_RECHECK_FIRST;
                if task.kind.waits_for_drain() {
                    task.deadline = Some(now + self.config.drain_timeout);
                }
                self.ask(now, channel);
            }
            Change::Switch => {
                task.new_leader = Some((task.meta.leader, task.meta.leader_epoch));
                let next = unfenced(&task.meta);
                self.propose(now, channel, Change::Unfence { switched: true }, next);
            }
            Change::RemoveLearner => {
                let task = self.tasks.remove(channel).expect("present");
                self.finish(now, task, Ok(()));
            }
            Change::Unfence { switched } => {
                let task = self.tasks.remove(channel).expect("present");
                let outcome = match (switched, task.kind) {
                    (true, _) | (false, TaskKind::ClearFence) => Ok(()),
                    (false, _) => Err(task.failure.clone().unwrap_or(TaskError::MetaChanged)),
                };
                self.finish(now, task, outcome);
            }
        }
    }

    /// Asks the ISR members for evidence: all of them for a transfer (drain status changes), the ones
    /// that have not answered for a failover. The fenced meta travels with the request, so a replica
    /// that has not seen it yet applies it before it answers.
    pub(super) fn ask(&mut self, now: Time, channel: &ChannelId) {
        let Some(task) = self.tasks.get_mut(channel) else { return };
        let repeat = task.kind.waits_for_drain();
        let interval = if repeat && matches!(task.step, Step::Gathering) {
            // Soon at first, then less often: the drain usually takes a commit round or two.
            let next = task.drain_recheck.min(self.config.ask_interval);
            task.drain_recheck = next * 2;
            next
        } else {
            self.config.ask_interval
        };
        task.next_ask = now + interval;
        let mut targets: Vec<NodeId> =
            task.meta.isr.iter().copied().filter(|n| repeat || !task.evidence.contains_key(n)).collect();
        if let TaskKind::Replace { to, .. } = task.kind {
            if !targets.contains(&to) {
                targets.push(to);
            }
        }
        if matches!(task.step, Step::CatchingUp) {
            // Catching up needs only the leader's and the new replica's progress.
            let (leader, joining) = (task.meta.leader, replacement_target(task.kind));
            targets.retain(|n| *n == leader || Some(*n) == joining);
        }
        for to in targets {
            let message = NodeMessage::EvidenceRequest { task: task.id, meta: task.meta.clone() };
            self.actions.push_back(Action::Send { to, message });
        }
    }

    pub(super) fn task_timer(&mut self, now: Time, channel: &ChannelId) {
        if self.leader_gone_from_move(now, channel) {
            // A transfer or hand-off waits for its leader to drain, and a leader that went down never
            // will: a failover takes over now instead of after the drain timeout (a planned stop that
            // came before its hand-offs finished would otherwise hold their channels fenced longer
            // than a crash).
            let task = self.tasks.remove(channel).expect("present");
            let meta = task.meta.clone();
            tracing::info!(%channel, leader = %meta.leader, "the leader of a leadership move went down: failover");
            self.finish(now, task, Err(TaskError::Preempted));
            self.start_failover(now, meta);
            return;
        }
        let Some(task) = self.tasks.get_mut(channel) else { return };
        if task.deadline.is_some_and(|d| d <= now) {
            match task.step {
                Step::Gathering => {
                    task.deadline = None;
                    task.failure = Some(TaskError::DrainTimedOut);
                    let next = unfenced(&task.meta);
                    self.propose(now, channel, Change::Unfence { switched: false }, next);
                    return;
                }
                Step::CatchingUp => {
                    // Nothing is fenced yet. In a healthy channel the learner goes again (a failed task
                    // leaves the members as they were); in one below MinISR it stays, for the next
                    // replacement to resume from.
                    let task = self.tasks.remove(channel).expect("present");
                    let (meta, to) = (task.meta.clone(), replacement_target(task.kind));
                    self.finish(now, task, Err(TaskError::DrainTimedOut));
                    if let Some(to) = to {
                        self.remove_own_learner(now, &meta, to);
                    }
                    return;
                }
                Step::Proposing { .. } => {}
            }
        }
        match &task.step {
            Step::Gathering | Step::CatchingUp => self.ask(now, channel),
            Step::Proposing { .. } => {
                task.next_ask = now + self.config.ask_interval;
                if let Step::Proposing { confirming, fetched, .. } = &mut task.step {
                    *confirming = true;
                    *fetched = true;
                }
                self.actions.push_back(Action::FetchMeta(channel.clone()));
            }
        }
    }

    /// `true` if the task for `channel` is a transfer or hand-off waiting, fenced, for a leader the
    /// failure detector now holds down, and enough of the other ISR members are up for a failover to
    /// gather its evidence (a controller cut off from them holds everyone down: it leaves the task to
    /// its deadline).
    fn leader_gone_from_move(&self, now: Time, channel: &ChannelId) -> bool {
        let Some(task) = self.tasks.get(channel) else { return false };
        let meta = &task.meta;
        if !matches!(task.step, Step::Gathering) || task.kind.leadership_target().is_none() {
            return false;
        }
        if meta.leader == self.me || !self.is_down(meta.leader, now) {
            return false;
        }
        let need = meta.isr.len().saturating_sub(usize::from(meta.min_isr)) + 1;
        let up = meta.isr.iter().filter(|n| **n == self.me || !self.is_down(**n, now)).count();
        up >= need
    }

    /// Decides whether the evidence gathered allows the switch, and proposes it.
    pub(super) fn evaluate(&mut self, now: Time, channel: &ChannelId) {
        let leaving = self.leaving_nodes(now);
        let Some(task) = self.tasks.get_mut(channel) else { return };
        let chosen = match switch_target(task.kind, &task.meta, &task.evidence, &leaving) {
            None => return,
            Some(Err(blocked)) => {
                task.blocked = Some(blocked);
                return;
            }
            Some(Ok(chosen)) => chosen,
        };
        task.blocked = None;
        task.proof = task
            .evidence
            .iter()
            .map(|(node, r)| EvidenceEntry { node: *node, last_epoch: r.last_epoch, last_seq: r.last_seq })
            .collect();
        let next = switched_meta(task.kind, &task.meta, chosen);
        self.propose(now, channel, Change::Switch, next);
    }

    pub(super) fn finish(&mut self, now: Time, task: Task, outcome: Result<(), TaskError>) {
        if task.api.is_none() && task.kind.leadership_target().is_some() {
            self.rebalance_finished(now, &task.meta.channel, outcome.is_ok());
        }
        let report = TaskReport {
            task: task.id,
            channel: task.meta.channel.clone(),
            kind: task.kind,
            old_leader: task.old_leader,
            new_leader: task.new_leader,
            evidence: task.proof,
            outcome,
            started: task.started,
            finished: now,
        };
        tracing::info!(channel = %report.channel, task = report.task, outcome = ?report.outcome, new_leader = ?report.new_leader, "channel task finished");
        if self.reports.len() >= self.config.reports_max {
            self.reports.pop_front();
        }
        self.reports.push_back(report.clone());
        self.actions.push_back(Action::Finished { api: task.api, report });
    }
}

/// `true` when the leader's evidence shows its leadership begun: the barrier of the meta's leader epoch
/// is in its log (a leader writes it as it begins, before it answers anything). One not begun yet — not
/// activated since it was named, or refused a place — still writes that barrier when it is activated,
/// fence or not: a switch away from it on evidence of its log without the barrier left the barrier to be
/// written, and committed, after the switch, at the seq the new leader's own barrier took; the follower
/// holding the first could never follow the new leader (sim seed 385000231). A transfer or a replacement
/// waits for it to begin — a replacement that keeps its leader too: the barrier, written under the
/// fence (which does not freeze replication), committed under the old ISR with the member being
/// replaced, and the new ISR, judged on the log without it, held it on fewer than MinISR members; a later
/// failover's evidence then elected a member without it (sim seed 569000206). A failover needs no such
/// wait, as its fence freezes replication (nothing the old leader writes then commits).
fn began(leader: &EvidenceReport, meta: &ChannelRuntimeMeta) -> bool {
    leader.last_epoch == meta.leader_epoch
}

/// Who leads once a task of `kind` on `meta` makes its switch, judged on the `evidence` it gathered:
/// `Err` says what the task waits for (or why it must stop: evidence nothing explains fails closed);
/// `None` for a task that switches nothing. A failover prefers a node that is not `leaving` among
/// equally advanced logs (never over a more advanced one); a hand-off whose target lags goes to another
/// ISR member that is not `leaving` and holds the drained leader's whole log.
fn switch_target(
    kind: TaskKind,
    meta: &ChannelRuntimeMeta,
    evidence: &BTreeMap<NodeId, EvidenceReport>,
    leaving: &BTreeSet<NodeId>,
) -> Option<Result<NodeId, TaskBlocked>> {
    if let Some((node, report)) = evidence.iter().find(|(_, r)| r.last_epoch > meta.leader_epoch) {
        // Fail closed: nothing explains such a record; an operator must look.
        return Some(Err(TaskBlocked::ConflictingEvidence {
            node: *node,
            last_epoch: report.last_epoch,
            meta_leader_epoch: meta.leader_epoch,
        }));
    }
    let need = meta.isr.len() - usize::from(meta.min_isr) + 1;
    let have = evidence.keys().filter(|n| meta.in_isr(**n)).count();
    Some(match kind {
        TaskKind::Failover if have < need => Err(TaskBlocked::NotEnoughEvidence { have, need }),
        TaskKind::Failover => Ok(failover_target(meta, evidence, leaving)),
        TaskKind::Transfer { target } | TaskKind::HandOff { target } => {
            let may_stand_in = matches!(kind, TaskKind::HandOff { .. });
            match hand_over_target(target, may_stand_in, meta, evidence, leaving) {
                Some(chosen) if have >= need => Ok(chosen),
                _ => Err(TaskBlocked::Draining),
            }
        }
        TaskKind::Replace { from, to } => {
            // Only a change of leader needs the evidence quorum (the slot FSM checks it as proof).
            let leader_moves = from == meta.leader;
            if replacement_ready(from, to, meta, evidence) && (!leader_moves || have >= need) {
                Ok(to)
            } else {
                Err(TaskBlocked::Draining)
            }
        }
        // Neither gathers evidence.
        TaskKind::ClearFence | TaskKind::RemoveLearner { .. } => return None,
    })
}

/// A failover's new leader, among replicas that answered (at least one): the most advanced log; on a
/// tie one that is not `leaving` (it would hand the leadership off again), then the current leader
/// (least churn), then the lowest id.
fn failover_target(
    meta: &ChannelRuntimeMeta,
    evidence: &BTreeMap<NodeId, EvidenceReport>,
    leaving: &BTreeSet<NodeId>,
) -> NodeId {
    evidence
        .iter()
        .max_by_key(|(node, r)| {
            let staying = !leaving.contains(*node);
            (r.last_epoch, r.last_seq, staying, **node == meta.leader, std::cmp::Reverse(**node))
        })
        .map(|(node, _)| *node)
        .expect("need >= 1 answers")
}

/// Who takes over in a transfer or hand-off once the leader has drained: `target` if it holds the
/// drained leader's whole log; else, when `may_stand_in` (a hand-off: it only needs some staying member
/// to take over), another ISR member that is not `leaving` and holds it (an idle follower that missed a
/// hint waits a pull interval). `None` while the leader has not drained, or no one holds it.
fn hand_over_target(
    target: NodeId,
    may_stand_in: bool,
    meta: &ChannelRuntimeMeta,
    evidence: &BTreeMap<NodeId, EvidenceReport>,
    leaving: &BTreeSet<NodeId>,
) -> Option<NodeId> {
    let l = evidence.get(&meta.leader).filter(|l| began(l, meta) && l.drained && l.pending_appends == 0)?;
    let holds_the_log =
        |node: &NodeId| evidence.get(node).is_some_and(|t| (t.last_epoch, t.last_seq) == (l.last_epoch, l.log_end));
    if holds_the_log(&target) {
        return Some(target);
    }
    if !may_stand_in {
        return None;
    }
    let mut others = meta.isr.iter().filter(|n| **n != meta.leader && !leaving.contains(*n));
    others.find(|n| holds_the_log(n)).copied()
}

/// `true` when a replacement of `from` by `to` may switch: the leader's barrier began and `to` holds its
/// whole log, and every committed record stays on MinISR members of the new ISR. Only a leader that
/// hands over waits for its appends: one that stays completes them under the new ISR. Waiting for them
/// there was waiting for the switch itself when the old ISR had fewer than MinISR live members, which
/// is when the repair loop replaces a member that is down: the switch waited until the appends timed
/// out, fencing the channel for drain timeout after drain timeout (sim seed 365000175). Their records
/// are in the log end the bar below counts (the fence admits no new ones).
fn replacement_ready(
    from: NodeId,
    to: NodeId,
    meta: &ChannelRuntimeMeta,
    evidence: &BTreeMap<NodeId, EvidenceReport>,
) -> bool {
    let leader_moves = from == meta.leader;
    let Some(l) = evidence.get(&meta.leader) else { return false };
    let caught_up = began(l, meta)
        && (!leader_moves || l.pending_appends == 0)
        && l.log_end == l.last_seq
        && evidence.get(&to).is_some_and(|t| (t.last_epoch, t.last_seq) == (l.last_epoch, l.log_end));
    // `to` may already be one of the holders (the leader puts a caught-up learner in the ISR itself),
    // so count the holders rather than assume `to` adds one. The bar is the leader's log end, not its
    // HW: under this fence (which does not freeze) HW may still rise to the log end under the old ISR
    // before the switch commits. A holder's log ends in the leader's last epoch: one longer but of an
    // earlier epoch diverged from it and lacks those records. Counted by its length alone, a member
    // that had missed two leaderships (its log ended past the leader's in an old epoch) was counted,
    // the replaced member that held the commits left the ISR, they stood on fewer than MinISR of it,
    // and a failover on that member's evidence alone lost them (sim seed 637002638: MinISR the whole
    // ISR of three).
    let holds_through = |e: &EvidenceReport| e.last_epoch == l.last_epoch && e.last_seq >= l.log_end;
    let new_isr: BTreeSet<NodeId> =
        meta.isr.iter().copied().chain(std::iter::once(to)).filter(|n| *n != from).collect();
    let holders = new_isr.iter().filter(|n| evidence.get(n).is_some_and(holds_through)).count();
    caught_up && holders >= usize::from(meta.min_isr)
}

/// `base`'s next version in the next membership epoch, its replicas changed by `change` (a learner
/// added or taken out: the ISR, the leader and the fence stay).
fn with_replicas(base: &ChannelRuntimeMeta, change: impl FnOnce(&mut Vec<NodeId>)) -> ChannelRuntimeMeta {
    let mut next = base.clone();
    next.version += 1;
    next.epoch = next.epoch.next();
    change(&mut next.replicas);
    next
}

/// The meta a task of `kind` proposes to switch `meta` to `chosen`: the next version with `chosen` leading
/// in the next leader epoch (a replacement also swaps the replica and moves to the next membership
/// epoch), the fence kept but no longer freezing replication. The first replica is the channel's
/// preferred leader (see `ControllerConfig::rebalance_leaders_after`): a transfer's target becomes it,
/// a replacement takes the place of the replica it replaces, and a failover or a hand-off leaves the
/// order alone, so leadership returns to the preferred replica once it is back.
fn switched_meta(kind: TaskKind, meta: &ChannelRuntimeMeta, chosen: NodeId) -> ChannelRuntimeMeta {
    let mut next = meta.clone();
    next.version += 1;
    if let TaskKind::Replace { from, to } = kind {
        next.epoch = next.epoch.next();
        // `to` joined at the end as a learner; it moves into `from`'s place.
        next.replicas.retain(|n| *n != to);
        match next.replicas.iter_mut().find(|n| **n == from) {
            Some(place) => *place = to,
            None => next.replicas.push(to),
        }
        next.isr.retain(|n| *n != from);
        if !next.isr.contains(&to) {
            next.isr.push(to);
        }
        if next.leader == from {
            next.leader = to;
            next.leader_epoch = meta.leader_epoch.next();
        }
    } else {
        next.leader = chosen;
        next.leader_epoch = meta.leader_epoch.next();
        if matches!(kind, TaskKind::Transfer { .. }) {
            next.replicas.retain(|n| *n != chosen);
            next.replicas.insert(0, chosen);
        }
    }
    // The fence stays until the new leader is in place; it no longer freezes replication, so the
    // followers replicate from the new leader at once.
    next.write_fence = meta.write_fence.map(|f| WriteFence { freeze_replication: false, ..f });
    next
}

#[cfg(test)]
mod tests {
    use super::super::repair::tests::led_away_from_its_preferred_replica;
    use super::super::ControllerConfig;
    use super::*;
    use tidings_types::{ChannelType, Epoch, LeaderEpoch, Seq};

    /// Three replicas, all in the ISR, MinISR 2, node 1 leading in leader epoch 3, fenced by task 7.
    fn meta() -> ChannelRuntimeMeta {
        let nodes: Vec<NodeId> = (1..=3).map(NodeId::new).collect();
        ChannelRuntimeMeta {
            channel: ChannelId::new(ChannelType::GROUP, "switch").expect("channel id"),
            version: 5,
            leader: NodeId::new(1),
            replicas: nodes.clone(),
            isr: nodes,
            min_isr: 2,
            epoch: Epoch::new(2),
            leader_epoch: LeaderEpoch::new(3),
            write_fence: Some(WriteFence { task: 7, since_version: 5, freeze_replication: true }),
            retention_through: Seq::new(0),
        }
    }

    /// A replica's evidence: its last durable record `(epoch, seq)`, its log end, drained or not.
    fn report(epoch: u64, seq: u64, log_end: u64, drained: bool) -> EvidenceReport {
        EvidenceReport {
            last_epoch: LeaderEpoch::new(epoch),
            last_seq: Seq::new(seq),
            hw: Seq::new(seq.min(log_end)),
            pending_appends: 0,
            log_end: Seq::new(log_end),
            drained,
            fenced_by: Some(7),
        }
    }

    fn evidence(reports: &[(u64, EvidenceReport)]) -> BTreeMap<NodeId, EvidenceReport> {
        reports.iter().map(|(n, r)| (NodeId::new(*n), *r)).collect()
    }

    #[test]
    fn a_failover_switches_to_the_most_advanced_log_and_on_a_tie_keeps_a_staying_current_leader() {
        let ahead = evidence(&[(2, report(3, 10, 10, false)), (3, report(3, 12, 12, false))]);
        assert_eq!(switch_target(TaskKind::Failover, &meta(), &ahead, &BTreeSet::new()), Some(Ok(NodeId::new(3))));
        let tie = evidence(&[(1, report(3, 10, 10, false)), (2, report(3, 10, 10, false))]);
        assert_eq!(switch_target(TaskKind::Failover, &meta(), &tie, &BTreeSet::new()), Some(Ok(NodeId::new(1))));
        // A node leaving loses a tie, even as the current leader, and never a lead.
        let one_leaving: BTreeSet<NodeId> = [NodeId::new(1)].into();
        assert_eq!(switch_target(TaskKind::Failover, &meta(), &tie, &one_leaving), Some(Ok(NodeId::new(2))));
        let behind = evidence(&[(1, report(3, 11, 11, false)), (2, report(3, 10, 10, false))]);
        assert_eq!(switch_target(TaskKind::Failover, &meta(), &behind, &one_leaving), Some(Ok(NodeId::new(1))));
        // A later leader epoch beats a longer log of an earlier one.
        let epochs = evidence(&[(2, report(2, 20, 20, false)), (3, report(3, 11, 11, false))]);
        assert_eq!(switch_target(TaskKind::Failover, &meta(), &epochs, &BTreeSet::new()), Some(Ok(NodeId::new(3))));
    }

    #[test]
    fn a_failover_waits_for_isr_minus_min_isr_plus_one_isr_members() {
        // |ISR| 3 − MinISR 2 + 1 = 2 answers needed; a node outside the ISR does not count.
        let mut outside = meta();
        outside.isr.retain(|n| *n != NodeId::new(3));
        outside.min_isr = 1;
        let one = evidence(&[(2, report(3, 10, 10, false))]);
        let blocked = Some(Err(TaskBlocked::NotEnoughEvidence { have: 1, need: 2 }));
        assert_eq!(switch_target(TaskKind::Failover, &meta(), &one, &BTreeSet::new()), blocked);
        let from_outside = evidence(&[(3, report(3, 10, 10, false))]);
        let blocked = Some(Err(TaskBlocked::NotEnoughEvidence { have: 0, need: 2 }));
        assert_eq!(switch_target(TaskKind::Failover, &outside, &from_outside, &BTreeSet::new()), blocked);
    }

    #[test]
    fn evidence_of_a_leader_epoch_newer_than_the_meta_fails_closed() {
        let newer = evidence(&[(2, report(4, 10, 10, false)), (3, report(3, 12, 12, false))]);
        let blocked = Some(Err(TaskBlocked::ConflictingEvidence {
            node: NodeId::new(2),
            last_epoch: LeaderEpoch::new(4),
            meta_leader_epoch: LeaderEpoch::new(3),
        }));
        assert_eq!(switch_target(TaskKind::Failover, &meta(), &newer, &BTreeSet::new()), blocked);
    }

    #[test]
    fn a_transfer_waits_for_a_drained_leader_and_a_target_that_holds_its_whole_log_and_a_hand_off_takes_a_stand_in() {
        let transfer = TaskKind::Transfer { target: NodeId::new(2) };
        let behind = evidence(&[(1, report(3, 12, 12, true)), (2, report(3, 11, 11, false))]);
        assert_eq!(switch_target(transfer, &meta(), &behind, &BTreeSet::new()), Some(Err(TaskBlocked::Draining)));
        let not_drained = evidence(&[(1, report(3, 12, 12, false)), (2, report(3, 12, 12, false))]);
        assert_eq!(switch_target(transfer, &meta(), &not_drained, &BTreeSet::new()), Some(Err(TaskBlocked::Draining)));
        let ready = evidence(&[(1, report(3, 12, 12, true)), (2, report(3, 12, 12, false))]);
        assert_eq!(switch_target(transfer, &meta(), &ready, &BTreeSet::new()), Some(Ok(NodeId::new(2))));
        // Node 2 lags and node 3 holds the whole log: a transfer waits for its target, a hand-off takes
        // node 3 unless it is leaving too.
        let stand_in =
            evidence(&[(1, report(3, 12, 12, true)), (2, report(3, 11, 11, false)), (3, report(3, 12, 12, false))]);
        assert_eq!(switch_target(transfer, &meta(), &stand_in, &BTreeSet::new()), Some(Err(TaskBlocked::Draining)));
        let hand_off = TaskKind::HandOff { target: NodeId::new(2) };
        assert_eq!(switch_target(hand_off, &meta(), &stand_in, &BTreeSet::new()), Some(Ok(NodeId::new(3))));
        let three_leaving: BTreeSet<NodeId> = [NodeId::new(3)].into();
        assert_eq!(switch_target(hand_off, &meta(), &stand_in, &three_leaving), Some(Err(TaskBlocked::Draining)));
        assert_eq!(
            switch_target(hand_off, &meta(), &ready, &BTreeSet::new()),
            Some(Ok(NodeId::new(2))),
            "its target first"
        );
    }

    #[test]
    fn a_replacement_waits_until_min_isr_members_of_the_new_isr_hold_the_leaders_log() {
        // Node 3 is replaced by node 4, which caught up; node 2 gave no evidence.
        let replace = TaskKind::Replace { from: NodeId::new(3), to: NodeId::new(4) };
        let one_holder = evidence(&[(1, report(3, 12, 12, false)), (4, report(3, 12, 12, false))]);
        // New ISR {1, 2, 4}: holders 1 and 4 = MinISR 2, and the leader does not move, so no quorum needed.
        assert_eq!(switch_target(replace, &meta(), &one_holder, &BTreeSet::new()), Some(Ok(NodeId::new(4))));
        let target_behind = evidence(&[(1, report(3, 12, 12, false)), (4, report(3, 11, 11, false))]);
        assert_eq!(switch_target(replace, &meta(), &target_behind, &BTreeSet::new()), Some(Err(TaskBlocked::Draining)));
    }

    /// A member whose log is longer than the leader's but ends in an earlier leader epoch diverged from
    /// it: it holds none of the leader's last epoch, and is no holder (sim seed 637002638).
    #[test]
    fn a_replacement_counts_no_member_whose_longer_log_ends_in_an_earlier_epoch() {
        // MinISR the whole ISR {1, 2, 3}; node 2 is replaced by node 4 (caught up); node 3's log runs to
        // 14 in leader epoch 2, past the leader's 12 in epoch 3.
        let every_member = ChannelRuntimeMeta { min_isr: 3, ..meta() };
        let replace = TaskKind::Replace { from: NodeId::new(2), to: NodeId::new(4) };
        let diverged = evidence(&[
            (1, report(3, 12, 12, false)),
            (2, report(3, 12, 12, false)),
            (3, report(2, 14, 14, false)),
            (4, report(3, 12, 12, false)),
        ]);
        let blocked = Some(Err(TaskBlocked::Draining));
        assert_eq!(switch_target(replace, &every_member, &diverged, &BTreeSet::new()), blocked);
        // Once it has caught up in the leader's epoch it holds the log, and the replacement goes on.
        let caught_up = evidence(&[
            (1, report(3, 12, 12, false)),
            (2, report(3, 12, 12, false)),
            (3, report(3, 12, 12, false)),
            (4, report(3, 12, 12, false)),
        ]);
        assert_eq!(switch_target(replace, &every_member, &caught_up, &BTreeSet::new()), Some(Ok(NodeId::new(4))));
    }

    /// A replacement that keeps its leader switches with the leader's appends still pending (they
    /// commit under the new ISR); one that moves the leader waits for them.
    #[test]
    fn only_a_replacement_that_moves_the_leader_waits_for_its_pending_appends() {
        // Node 3 (down) leaves an ISR of {1, 3} with MinISR 2: nothing commits until node 4 takes its place.
        let below = ChannelRuntimeMeta { isr: vec![NodeId::new(1), NodeId::new(3)], ..meta() };
        let pending = EvidenceReport { pending_appends: 1, ..report(3, 12, 12, false) };
        let caught_up = evidence(&[(1, pending), (4, report(3, 12, 12, false))]);
        let replace = TaskKind::Replace { from: NodeId::new(3), to: NodeId::new(4) };
        assert_eq!(switch_target(replace, &below, &caught_up, &BTreeSet::new()), Some(Ok(NodeId::new(4))));
        // Not durable yet at the leader: it waits.
        let unsynced = EvidenceReport { pending_appends: 1, ..report(3, 11, 12, false) };
        let behind = evidence(&[(1, unsynced), (4, report(3, 12, 12, false))]);
        assert_eq!(switch_target(replace, &below, &behind, &BTreeSet::new()), Some(Err(TaskBlocked::Draining)));
        // The leader itself replaced: its appends must finish first.
        let full = evidence(&[(1, pending), (2, report(3, 12, 12, false)), (4, report(3, 12, 12, false))]);
        let moving = TaskKind::Replace { from: NodeId::new(1), to: NodeId::new(4) };
        assert_eq!(switch_target(moving, &meta(), &full, &BTreeSet::new()), Some(Err(TaskBlocked::Draining)));
        let drained =
            evidence(&[(1, report(3, 12, 12, true)), (2, report(3, 12, 12, false)), (4, report(3, 12, 12, false))]);
        assert_eq!(switch_target(moving, &meta(), &drained, &BTreeSet::new()), Some(Ok(NodeId::new(4))));
    }

    /// A leader named in leader epoch 3 that has not begun (its log ends in epoch 2: no barrier of its own
    /// yet) writes that barrier when it is activated, fence or not. A transfer or a replacement switches
    /// only once its evidence shows the leadership begun (sim seeds 385000231, 569000206).
    #[test]
    fn no_transfer_or_replacement_switches_before_its_leader_has_begun() {
        let transfer = TaskKind::Transfer { target: NodeId::new(2) };
        let moving = TaskKind::Replace { from: NodeId::new(1), to: NodeId::new(4) };
        let not_begun =
            evidence(&[(1, report(2, 12, 12, true)), (2, report(2, 12, 12, false)), (4, report(2, 12, 12, false))]);
        assert_eq!(switch_target(transfer, &meta(), &not_begun, &BTreeSet::new()), Some(Err(TaskBlocked::Draining)));
        assert_eq!(switch_target(moving, &meta(), &not_begun, &BTreeSet::new()), Some(Err(TaskBlocked::Draining)));
        let begun =
            evidence(&[(1, report(3, 13, 13, true)), (2, report(3, 13, 13, false)), (4, report(3, 13, 13, false))]);
        assert_eq!(switch_target(transfer, &meta(), &begun, &BTreeSet::new()), Some(Ok(NodeId::new(2))));
        assert_eq!(switch_target(moving, &meta(), &begun, &BTreeSet::new()), Some(Ok(NodeId::new(4))));
        // A replacement that keeps its leader waits too: the barrier may commit under the old ISR, with
        // the member replaced, before the switch does, and be on fewer than MinISR of the new one.
        let keeping = TaskKind::Replace { from: NodeId::new(3), to: NodeId::new(4) };
        let not_begun =
            evidence(&[(1, report(2, 12, 12, false)), (2, report(2, 12, 12, false)), (4, report(2, 12, 12, false))]);
        assert_eq!(switch_target(keeping, &meta(), &not_begun, &BTreeSet::new()), Some(Err(TaskBlocked::Draining)));
        let begun =
            evidence(&[(1, report(3, 13, 13, false)), (2, report(3, 13, 13, false)), (4, report(3, 13, 13, false))]);
        assert_eq!(switch_target(keeping, &meta(), &begun, &BTreeSet::new()), Some(Ok(NodeId::new(4))));
    }

    #[test]
    fn a_fence_clearing_task_switches_nothing() {
        assert_eq!(switch_target(TaskKind::ClearFence, &meta(), &BTreeMap::new(), &BTreeSet::new()), None);
    }

    #[test]
    fn the_switched_meta_moves_leadership_or_the_replica_and_keeps_the_fence_unfrozen() {
        let base = meta();
        let failover = switched_meta(TaskKind::Failover, &base, NodeId::new(3));
        assert_eq!(
            (failover.version, failover.leader, failover.leader_epoch),
            (6, NodeId::new(3), LeaderEpoch::new(4))
        );
        assert_eq!((failover.epoch, failover.isr.clone()), (base.epoch, base.isr.clone()), "membership unchanged");
        assert_eq!(failover.replicas, base.replicas, "a failover keeps the preferred replica first");
        // A transfer's target becomes the preferred replica: first, the others in their order.
        let transferred = switched_meta(TaskKind::Transfer { target: NodeId::new(3) }, &base, NodeId::new(3));
        assert_eq!(transferred.replicas, vec![NodeId::new(3), NodeId::new(1), NodeId::new(2)]);
        assert_eq!((transferred.leader, transferred.isr.clone()), (NodeId::new(3), base.isr.clone()));
        // A hand-off leaves the order alone: the leaving node, still first, takes its leadership back
        // once it is up again.
        let handed = switched_meta(TaskKind::HandOff { target: NodeId::new(3) }, &base, NodeId::new(3));
        assert_eq!((handed.leader, handed.leader_epoch), (NodeId::new(3), LeaderEpoch::new(4)));
        assert_eq!((handed.replicas.clone(), handed.isr.clone()), (base.replicas.clone(), base.isr.clone()));
        let fence = failover.write_fence.expect("the fence stays until the new leader is in place");
        assert!(!fence.freeze_replication && fence.task == 7);
        // Replacing the leader's own replica (node 4 joined the replicas as a learner while it caught
        // up): the membership epoch and the leadership both move.
        let mut base = base;
        base.replicas.push(NodeId::new(4));
        let replace = TaskKind::Replace { from: NodeId::new(1), to: NodeId::new(4) };
        let replaced = switched_meta(replace, &base, NodeId::new(4));
        assert_eq!(replaced.replicas, vec![NodeId::new(4), NodeId::new(2), NodeId::new(3)], "4 takes 1's place, first");
        assert_eq!(replaced.isr, vec![NodeId::new(2), NodeId::new(3), NodeId::new(4)]);
        assert_eq!(
            (replaced.leader, replaced.leader_epoch, replaced.epoch),
            (NodeId::new(4), LeaderEpoch::new(4), Epoch::new(3))
        );
        // Replacing a follower keeps the leader and its leader epoch.
        let follower =
            switched_meta(TaskKind::Replace { from: NodeId::new(3), to: NodeId::new(4) }, &base, NodeId::new(4));
        assert_eq!((follower.leader, follower.leader_epoch), (NodeId::new(1), LeaderEpoch::new(3)));
        assert_eq!(follower.replicas, vec![NodeId::new(1), NodeId::new(2), NodeId::new(4)]);
    }

    fn n(id: u64) -> NodeId {
        NodeId::new(id)
    }

    /// Node 3's controller with a hand-off of `meta`'s channel to node 2 fenced at `Time::ZERO` and
    /// gathering evidence.
    fn hand_off_gathering(config: &ControllerConfig, meta: &ChannelRuntimeMeta) -> Controller {
        let mut controller = Controller::new(config.clone(), n(3), &[n(1), n(2), n(3)], 3, 1, Time::ZERO);
        controller.start_leadership_move(Time::ZERO, None, meta.clone(), TaskKind::HandOff { target: n(2) }).unwrap();
        let fence = super::super::fenced(meta, controller.tasks[&meta.channel].id, false);
        controller.applied(Time::ZERO, &meta.channel, Change::Fence, fence);
        assert!(matches!(controller.tasks[&meta.channel].step, Step::Gathering));
        controller
    }

    /// A leader not drained yet when the fence lands is asked again soon, then less and less often, up
    /// to `ask_interval`: the fence lasts about as long as the drain, not an ask interval.
    #[test]
    fn a_move_waiting_for_its_leader_to_drain_asks_again_soon_then_less_often() {
        let config = ControllerConfig::default();
        let meta = led_away_from_its_preferred_replica();
        let mut controller = hand_off_gathering(&config, &meta);
        let mut asked_at = Vec::new();
        let mut now = Time::ZERO;
        while asked_at.len() < 7 {
            now = controller.tasks[&meta.channel].next_ask;
            asked_at.push(now.as_millis());
            controller.heard(n(1), now);
            controller.heard(n(2), now);
            controller.task_timer(now, &meta.channel);
        }
        assert_eq!(asked_at, vec![10, 30, 70, 150, 310, 510, 710]);
        assert_eq!(controller.tasks[&meta.channel].next_ask, now + config.ask_interval);
    }

    /// A transfer fenced and waiting for its leader to drain gives way to a failover once the leader is
    /// held down, when enough ISR members are up to give the failover its evidence; a controller that
    /// hears none of them (it may be the one cut off) leaves the task to its drain deadline.
    #[test]
    fn a_leadership_move_whose_leader_goes_down_while_it_drains_yields_to_a_failover() {
        let config = ControllerConfig { rebalance_leaders_after: None, ..ControllerConfig::default() };
        let meta = led_away_from_its_preferred_replica(); // leader 1; ISR 2, 1, 3; MinISR 2
        let gathering = || hand_off_gathering(&config, &meta);
        let kind = |controller: &Controller| controller.tasks.get(&meta.channel).map(|t| t.kind);

        let mut controller = gathering();
        let soon = Time::from_millis(500);
        controller.heard(n(1), soon);
        controller.heard(n(2), soon);
        controller.task_timer(soon, &meta.channel);
        assert_eq!(kind(&controller), Some(TaskKind::HandOff { target: n(2) }), "the leader is up: it drains");
        let down = soon + config.node_down_after;
        controller.heard(n(2), down);
        controller.task_timer(down, &meta.channel);
        assert_eq!(kind(&controller), Some(TaskKind::Failover), "the leader is down");
        let report = controller.reports().pop().expect("the hand-off's report");
        assert_eq!((report.kind, report.outcome), (TaskKind::HandOff { target: n(2) }, Err(TaskError::Preempted)));

        // Nobody heard: node 3 alone cannot tell the leader from the rest of the cluster.
        let mut controller = gathering();
        let silent = Time::ZERO + config.node_down_after;
        controller.task_timer(silent, &meta.channel);
        assert_eq!(kind(&controller), Some(TaskKind::HandOff { target: n(2) }));
    }
}
