//! Replicas whose vote a committed membership change takes: a voter the end of a joint configuration
//! leaves out, which learnt that end committed.
//!
//! Such a replica applies neither the change nor anything after it. It holds them
//! (`Group::held_back`) and keeps its place in the joint configuration as raft-rs sees it — it votes,
//! and it campaigns — until the leader of the new configuration releases it (`SlotBody::Removed`,
//! sent once that leader and every member heard from lately hold the change committed durably; see
//! `removal`). Its vote may still be needed: a member of the new configuration that had not synced
//! the commit comes back from a crash joint, and its election needs a majority of the outgoing
//! voters. Applying the change would take this replica out of elections (raft-rs does not let a
//! non-voter campaign) while its log, holding entries a crashed leader had sent before syncing them,
//! makes it refuse that member's vote: nobody could lead again (sim seed 518000858, where the group
//! had one voter before the move and one after).
//!
//! A leader in that position (it inherited the change from an earlier leader's log) hands its
//! leadership to the incoming voter holding the most log, again until one takes it over, and takes
//! no proposals meanwhile. (raft-rs keeps a leader that applied its own removal leading without a
//! progress of its own, and aborts on its next persist.) A joint configuration counts a majority of
//! both halves, so a leader or candidate of the outgoing half acts under a stricter quorum than the
//! new configuration's: nothing it decides can contradict what the new configuration commits.

use super::{membership, MultiRaft};
use raft::prelude::{Entry, EntryType};
use raft::StateRole;
use tidings_types::GroupId;

impl MultiRaft {
    /// `true` if `entry`, committed in `group`, is a membership change that takes this replica's vote.
    pub(super) fn takes_own_vote(&self, group: GroupId, entry: &Entry) -> bool {
        let Some(g) = self.groups.get(&group) else { return false };
        membership::entry_conf_change(entry)
            .is_some_and(|change| membership::takes_vote(&change, self.config.node, &g.conf()))
    }

    /// The index of the last of `entries` that adds this node to the group (as a learner or a voter).
    /// A replica applies a change taking its vote when a later committed change adds it back: the
    /// group went on without it and counts on it again.
    pub(super) fn last_added_back(&self, entries: &[Entry]) -> Option<u64> {
        entries
            .iter()
            .rev()
            .filter(|entry| entry.get_entry_type() != EntryType::EntryNormal)
            .find(|entry| membership::entry_conf_change(entry).is_some_and(|c| membership::adds(&c, self.config.node)))
            .map(|entry| entry.index)
    }

    /// Holds `entries` (from the change that takes this replica's vote on) unapplied.
    pub(super) fn hold_back(&mut self, group: GroupId, entries: Vec<Entry>) {
        let Some(g) = self.groups.get_mut(&group) else { return };
        if let Some(change) = entries.first() {
            tracing::info!(%group, index = change.index, "slot replica holds back its removal until the group releases it");
        }
        g.held_back = entries;
        self.hand_over(group);
    }

    /// A leader holding back its removal moves its leadership to the incoming voter that holds the
    /// most log (among those heard from lately, if any), unless a transfer is under way. Called each
    /// round: raft-rs gives a transfer up after an election timeout.
    pub(super) fn hand_over(&mut self, group: GroupId) {
        let me = self.config.node.get();
        let Some(g) = self.groups.get_mut(&group) else { return };
        let raft = &g.raw.raft;
        if g.held_back.is_empty() || raft.state != StateRole::Leader || raft.lead_transferee.is_some() {
            return;
        }
        let incoming = g.conf().voters;
        let target = raft
            .prs()
            .iter()
            .filter(|(id, _)| **id != me && incoming.iter().any(|n| n.get() == **id))
            .max_by_key(|(id, progress)| (progress.recent_active, progress.matched, std::cmp::Reverse(**id)))
            .map(|(id, _)| *id);
        if let Some(target) = target {
            tracing::info!(%group, to = target, "slot leader hands over before applying its removal");
            g.raw.transfer_leader(target);
        }
    }
}
