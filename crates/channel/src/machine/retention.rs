//! Moving the channel's retention boundary (Kafka's `DeleteRecords`): the leader, which knows the high
//! watermark, admits a move only up to it and proposes it to the slot layer as the meta's next version;
//! the caller hears back once a meta with the boundary is in force here. Every replica then trims its
//! own log when it applies that meta (`ChannelMachine::retention_target`).

use super::effect::{AppendAborted, Effect, MetaChangeReason, RequestId, RetentionRequest};
use super::error::AppendError;
use super::{ChannelMachine, Role};
use tidings_types::{Seq, Time};

/// Retention moves a leader holds at once; more are refused `Busy` (they are rare operator calls).
const RETENTION_WAITS_MAX: usize = 64;

/// An admitted retention move waiting to see its boundary in force.
#[derive(Debug)]
pub(super) struct RetentionWait {
    id: RequestId,
    through: Seq,
    pub(super) admitted_at: Time,
}

impl ChannelMachine {
    /// Asks this replica, as the channel's leader, to give up every record through `request.through`:
    /// they stop being readable and each replica's store trims them. Only committed records can be given
    /// up (`BeyondHw` past HW); a boundary at or below the one in force is answered at once. The result
    /// arrives as [`Effect::RetentionDone`] once a meta with the boundary is in force (or as `Timeout`
    /// after `append_timeout`, `LeaderChanged` if leadership moves first).
    pub fn handle_retention(&mut self, now: Time, request: RetentionRequest) -> Result<(), AppendError> {
        self.advance(now);
        let result = self.admit_retention(request);
        self.maybe_persist();
        result
    }

    fn admit_retention(&mut self, request: RetentionRequest) -> Result<(), AppendError> {
        let (meta, leader) = self.admitting_leader()?;
        if request.through > self.log.hw {
            return Err(AppendError::BeyondHw { through: request.through, hw: self.log.hw });
        }
        if request.through <= meta.retention_through {
            let result = Ok(meta.retention_through);
            self.effects.push_back(Effect::RetentionDone { id: request.id, result });
            return Ok(());
        }
        if leader.retention_waits.len() >= RETENTION_WAITS_MAX {
            return Err(AppendError::Busy);
        }
        let now = self.now;
        let wait = RetentionWait { id: request.id, through: request.through, admitted_at: now };
        self.leader().expect("checked leader").retention_waits.push_back(wait);
        self.maybe_propose_retention();
        Ok(())
    }

    /// Proposes the furthest boundary asked for, when no other proposal of this leader is open (an ISR
    /// change carries the boundary in force, and this one follows it).
    fn maybe_propose_retention(&mut self) {
        let now = self.now;
        let (Some(meta), Role::Leader(leader)) = (&self.meta, &self.role) else { return };
        if leader.proposal.is_some() || meta.write_fence.is_some() {
            return;
        }
        let Some(through) = leader.retention_waits.iter().map(|w| w.through).max() else { return };
        if through <= meta.retention_through {
            return;
        }
        let mut next = meta.clone();
        next.retention_through = through;
        next.version += 1;
        let expected_version = meta.version;
        self.leader().expect("checked leader").proposal = Some((now, expected_version));
        let reason = MetaChangeReason::Retention { through };
        self.effects.push_back(Effect::ProposeMeta { expected_version, meta: Box::new(next), reason });
    }

    /// A new meta is in force on this leader: moves it covers are done; the rest are proposed again.
    pub(super) fn retention_meta_changed(&mut self) {
        let Some(in_force) = self.meta.as_ref().map(|m| m.retention_through) else { return };
        let Some(leader) = self.leader() else { return };
        let (done, waiting) = leader.retention_waits.drain(..).partition(|w| w.through <= in_force);
        leader.retention_waits = waiting;
        self.finish_retention(done, Ok(in_force));
        self.maybe_propose_retention();
    }

    /// Moves not seen in force within `append_timeout` end `Timeout`; the others are proposed again if
    /// their proposal timed out.
    pub(super) fn retention_timeout(&mut self) {
        let (now, timeout) = (self.now, self.config.append_timeout);
        let Some(leader) = self.leader() else { return };
        let mut expired = Vec::new();
        while leader.retention_waits.front().is_some_and(|w| w.admitted_at + timeout <= now) {
            expired.push(leader.retention_waits.pop_front().expect("checked non-empty"));
        }
        self.finish_retention(expired, Err(AppendAborted::Timeout));
        self.maybe_propose_retention();
    }

    /// Leadership ends: every waiting move ends with `reason` (it may still come into force).
    pub(super) fn retention_stop(&mut self, reason: AppendAborted) {
        let Some(leader) = self.leader() else { return };
        let stopped: Vec<RetentionWait> = leader.retention_waits.drain(..).collect();
        self.finish_retention(stopped, Err(reason));
    }

    fn finish_retention(&mut self, waits: impl IntoIterator<Item = RetentionWait>, result: Result<Seq, AppendAborted>) {
        for wait in waits {
            self.effects.push_back(Effect::RetentionDone { id: wait.id, result });
        }
    }
}
