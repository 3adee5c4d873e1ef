//! A task's steps: started, fenced, evidence gathered and evaluated, the switch or unfence proposed and
//! seen applied, its timer, and its end.

use super::super::message::NodeMessage;
use super::report::{EvidenceEntry, TaskBlocked, TaskError, TaskKind, TaskReport};
use super::{fenced, replacement_target, switch_proof, unfenced, Action, Change, Controller, Step, Task};
use std::collections::BTreeSet;
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
            TaskKind::Transfer { .. } => (Change::Fence, fenced(&task.meta, task.id, false)),
            TaskKind::Replace { to, .. } if task.meta.is_replica(to) => {
                // Already a learner (a replacement that was interrupted): straight to catching up.
                task.step = Step::CatchingUp;
                task.deadline = Some(now + self.config.catch_up_timeout);
                self.ask(now, &channel);
                return;
            }
            TaskKind::Replace { to, .. } => {
                let mut next = task.meta.clone();
                next.version += 1;
                next.epoch = next.epoch.next();
                next.replicas.push(to);
                (Change::AddLearner, next)
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
                if matches!(task.kind, TaskKind::Transfer { .. } | TaskKind::Replace { .. }) {
                    task.deadline = Some(now + self.config.drain_timeout);
                }
                self.ask(now, channel);
            }
            Change::Switch => {
                task.new_leader = Some((task.meta.leader, task.meta.leader_epoch));
                let next = unfenced(&task.meta);
                self.propose(now, channel, Change::Unfence { switched: true }, next);
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
        task.next_ask = now + self.config.ask_interval;
        let repeat = matches!(task.kind, TaskKind::Transfer { .. } | TaskKind::Replace { .. });
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
                    // Nothing is fenced yet: the learner stays (a later replacement resumes from it).
                    let task = self.tasks.remove(channel).expect("present");
                    self.finish(now, task, Err(TaskError::DrainTimedOut));
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

    /// Decides whether the evidence gathered allows the switch, and proposes it.
    pub(super) fn evaluate(&mut self, now: Time, channel: &ChannelId) {
        let Some(task) = self.tasks.get_mut(channel) else { return };
        let meta = &task.meta;
        if let Some((node, report)) = task.evidence.iter().find(|(_, r)| r.last_epoch > meta.leader_epoch) {
            // Fail closed: nothing explains such a record; an operator must look.
            task.blocked = Some(TaskBlocked::ConflictingEvidence {
                node: *node,
                last_epoch: report.last_epoch,
                meta_leader_epoch: meta.leader_epoch,
            });
            return;
        }
        let need = meta.isr.len() - usize::from(meta.min_isr) + 1;
        let have = task.evidence.keys().filter(|n| meta.in_isr(**n)).count();
        let chosen = match task.kind {
            TaskKind::Failover => {
                if have < need {
                    task.blocked = Some(TaskBlocked::NotEnoughEvidence { have, need });
                    return;
                }
                // The most advanced log; on a tie the current leader (least churn), then the lowest id.
                task.evidence
                    .iter()
                    .max_by_key(|(node, r)| {
                        (r.last_epoch, r.last_seq, **node == meta.leader, std::cmp::Reverse(**node))
                    })
                    .map(|(node, _)| *node)
                    .expect("need >= 1 answers")
            }
            TaskKind::Transfer { target } => {
                let leader = task.evidence.get(&meta.leader);
                let caught_up = match (leader, task.evidence.get(&target)) {
                    (Some(l), Some(t)) => {
                        l.drained && l.pending_appends == 0 && (t.last_epoch, t.last_seq) == (l.last_epoch, l.log_end)
                    }
                    _ => false,
                };
                if !caught_up || have < need {
                    task.blocked = Some(TaskBlocked::Draining);
                    return;
                }
                target
            }
            TaskKind::Replace { from, to } => {
                let leader = task.evidence.get(&meta.leader);
                let caught_up = match (leader, task.evidence.get(&to)) {
                    (Some(l), Some(t)) => {
                        l.pending_appends == 0
                            && l.log_end == l.last_seq
                            && (t.last_epoch, t.last_seq) == (l.last_epoch, l.log_end)
                    }
                    _ => false,
                };
                // Every committed record must stay on MinISR members of the new ISR. `to` may already be
                // one of the holders (the leader puts a caught-up learner in the ISR itself), so count
                // the holders rather than assume `to` adds one. The bar is the leader's log end, not its
                // HW: under this fence (which does not freeze) HW may still rise to the log end under the
                // old ISR before the switch commits.
                let bar = leader.map_or(tidings_types::Seq::new(u64::MAX), |l| l.log_end);
                let new_isr: BTreeSet<NodeId> =
                    meta.isr.iter().copied().chain(std::iter::once(to)).filter(|n| *n != from).collect();
                let holders =
                    new_isr.iter().filter(|n| task.evidence.get(n).is_some_and(|e| e.last_seq >= bar)).count();
                // Only a change of leader needs the evidence quorum (the slot FSM checks it as proof).
                let leader_moves = from == meta.leader;
                if !caught_up || holders < usize::from(meta.min_isr) || (leader_moves && have < need) {
                    task.blocked = Some(TaskBlocked::Draining);
                    return;
                }
                to
            }
            TaskKind::ClearFence => return,
        };
        task.blocked = None;
        task.proof = task
            .evidence
            .iter()
            .map(|(node, r)| EvidenceEntry { node: *node, last_epoch: r.last_epoch, last_seq: r.last_seq })
            .collect();
        let mut next = task.meta.clone();
        next.version += 1;
        if let TaskKind::Replace { from, to } = task.kind {
            next.epoch = next.epoch.next();
            next.replicas.retain(|n| *n != from);
            next.isr.retain(|n| *n != from);
            if !next.isr.contains(&to) {
                next.isr.push(to);
            }
            if next.leader == from {
                next.leader = to;
                next.leader_epoch = task.meta.leader_epoch.next();
            }
        } else {
            next.leader = chosen;
            next.leader_epoch = task.meta.leader_epoch.next();
        }
        // The fence stays until the new leader is in place; it no longer freezes replication, so the
        // followers replicate from the new leader at once.
        next.write_fence = task.meta.write_fence.map(|f| WriteFence { freeze_replication: false, ..f });
        self.propose(now, channel, Change::Switch, next);
    }

    pub(super) fn finish(&mut self, now: Time, task: Task, outcome: Result<(), TaskError>) {
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
