//! Proposals forwarded between nodes: queued until their group has a leader here, sent in batches,
//! answered, and expired when nobody answers.

use super::effect::{ProposalId, ProposeError, SlotEffect};
use super::message::SlotBody;
use super::{batch, MultiRaft, BATCH_PROPOSALS_MAX};
use crate::fsm::Outcome;
use raft::StateRole;
use tidings_types::{GroupId, NodeId};

impl MultiRaft {
    pub(super) fn forwarded(&mut self, from: NodeId, group: GroupId, origin: NodeId, id: u64, command: Vec<u8>) {
        // A copy the network delivers again is dropped, whatever became of the first (the origin hears
        // that one's answer; a retry is a new proposal with a new id). Proposed again, a write could
        // apply after a later acknowledged write to the same key and undo it.
        if !self.taken_forwards.first_time(origin, id) {
            return;
        }
        let Some(g) = self.groups.get_mut(&group) else {
            self.send(from, group, SlotBody::NotLeader { id, hint: None });
            return;
        };
        if g.raw.raft.state != StateRole::Leader || command.len() > self.config.proposal_bytes_max {
            let hint = (g.raw.raft.leader_id != 0).then(|| NodeId::new(g.raw.raft.leader_id));
            self.send(from, group, SlotBody::NotLeader { id, hint });
            return;
        }
        if self.queued.get(&group).is_some_and(|q| q.len() >= self.config.pending_proposals_max) {
            // Bounded: the forwarder's proposal fails without a hint and its caller may retry.
            self.send(from, group, SlotBody::NotLeader { id, hint: None });
            return;
        }
        self.enqueue(group, from, origin, id, command);
    }

    /// Queues a proposal of this round for `group` (this node leads it); `reply_to` hears a refusal.
    pub(super) fn enqueue(&mut self, group: GroupId, reply_to: NodeId, origin: NodeId, id: u64, command: Vec<u8>) {
        self.queued.entry(group).or_default().push((reply_to, batch::Queued { origin, id, command }));
    }

    /// Proposes the proposals queued this round: per group, as few entries as the batch bounds allow.
    /// Proposals a group can no longer take (leadership lost meanwhile) are refused to whoever waits.
    pub(super) fn flush_queued(&mut self) {
        for (group, queued) in std::mem::take(&mut self.queued) {
            let (leading, hint) = match self.groups.get(&group) {
                Some(g) => {
                    let raft = &g.raw.raft;
                    let leader = (raft.leader_id != 0).then(|| NodeId::new(raft.leader_id));
                    if raft.state != StateRole::Leader {
                        (false, leader)
                    } else if !g.held_back.is_empty() {
                        // A leader holding back its removal hands over and takes nothing meanwhile
                        // (module `retiring`): the node it hands over to is the one to ask.
                        (false, raft.lead_transferee.map(NodeId::new))
                    } else {
                        (true, leader)
                    }
                }
                None => (false, None),
            };
            let mut rest = queued;
            while !rest.is_empty() {
                let mut count = 0;
                let mut bytes = 0;
                while count < rest.len()
                    && count < BATCH_PROPOSALS_MAX
                    && (count == 0 || bytes + rest[count].1.command.len() <= self.config.proposal_bytes_max)
                {
                    bytes += rest[count].1.command.len();
                    count += 1;
                }
                let tail = rest.split_off(count);
                let chunk = std::mem::replace(&mut rest, tail);
                let data = batch::encode(chunk.iter().map(|(_, q)| q));
                let accepted = leading
                    && self
                        .groups
                        .get_mut(&group)
                        .is_some_and(|g| g.raw.propose(batch::BATCH_CONTEXT.to_vec(), data).is_ok());
                if !accepted {
                    for (reply_to, queued) in chunk {
                        if queued.origin == self.config.node {
                            let error =
                                if leading { ProposeError::Dropped } else { ProposeError::NotLeader { group, hint } };
                            self.complete(queued.id, Err(error));
                        } else {
                            self.send(reply_to, group, SlotBody::NotLeader { id: queued.id, hint });
                        }
                    }
                }
            }
        }
    }

    pub(super) fn pending(&self, group: GroupId) -> usize {
        self.pending_per_group.get(&group).copied().unwrap_or(0)
    }

    pub(super) fn complete(&mut self, id: u64, result: Result<Outcome, ProposeError>) {
        if let Some(proposal) = self.proposals.remove(&id) {
            if let Some(count) = self.pending_per_group.get_mut(&proposal.group) {
                *count = count.saturating_sub(1);
            }
            self.effects.push_back(SlotEffect::ProposalDone { id: ProposalId(id), result });
        }
    }

    pub(super) fn expire_requests(&mut self) {
        let now = self.now;
        let expired: Vec<u64> = self.proposals.iter().filter(|(_, p)| p.deadline <= now).map(|(id, _)| *id).collect();
        for id in expired {
            self.complete(id, Err(ProposeError::Timeout));
        }
        for group in self.groups.values_mut() {
            while group.reads.front().is_some_and(|r| r.deadline <= now) {
                let read = group.reads.pop_front().expect("checked non-empty");
                self.effects.push_back(SlotEffect::ReadFailed { id: read.id, error: ProposeError::Timeout });
            }
        }
    }
}
