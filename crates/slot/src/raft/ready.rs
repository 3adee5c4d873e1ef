//! Raft readies of the groups: persisting, sending, applying committed entries through the slot FSM,
//! configuration changes, log compaction, finished reads and what the route table observes.

use super::effect::SlotEffect;
use super::message::SlotBody;
use super::{batch, membership, snapshot, AwaitingSync, MultiRaft};
use raft::prelude::{Entry, EntryType, Snapshot};
use raft::{StateRole, Storage};
use std::sync::Arc;
use tidings_router::{GroupObservation, HashToSlot};
use tidings_store::{Placement, RaftLogBatch, StoreError};
use tidings_types::{GroupId, HashSlot, NodeId, Term};

impl MultiRaft {
    /// Proposes what this round queued, handles every group's ready, then asks for one sync covering all
    /// their writes.
    pub(super) fn process_all(&mut self) {
        if self.storage_failed {
            return;
        }
        self.flush_queued();
        let ids: Vec<GroupId> = self.groups.keys().copied().collect();
        for id in ids {
            // A group may produce several readies in a row (e.g. after applying).
            for _ in 0..4 {
                if !self.groups.get(&id).is_some_and(|g| g.raw.has_ready()) {
                    break;
                }
                if let Err(error) = self.process_ready(id) {
                    return self.fail_storage(&error, Some(id));
                }
            }
            if self.groups.contains_key(&id) {
                self.hand_over(id);
                self.observe(id);
            }
        }
        // Before anything is destroyed (a batch naming a removed group would fail whole) and before the
        // sync that is to cover it.
        if let Err(error) = self.write_round() {
            return self.fail_storage(&error, None);
        }
        self.destroy_leaving();
        if self.sync_requested {
            self.sync_requested = false;
            let token = self.next_sync;
            self.next_sync += 1;
            for awaiting in self.awaiting.iter_mut().filter(|a| a.token == 0) {
                awaiting.token = token;
            }
            self.effects.push_back(SlotEffect::Sync { token });
        }
    }

    /// Writes the round's changes so far, the raft logs' and the FSMs', in one atomic batch (the two
    /// stores share one backend).
    fn write_round(&mut self) -> Result<(), StoreError> {
        let logs = std::mem::take(&mut self.round_writes);
        let applied = std::mem::take(&mut self.round_meta);
        if logs.is_empty() && applied.is_empty() {
            return Ok(());
        }
        self.meta.write_all_with(applied.iter().map(|(_, batch)| batch), |applied| self.logs.write_with(logs, applied))
    }

    /// A write to the slot store failed, in `group`'s ready or in the round's write, or a sync failed:
    /// raft-rs counts those writes as handed to storage, so no later sync may declare them persisted (a
    /// disk may drop the pages of a failed sync and report the next one clean). Every replica on this
    /// node stops here (see `MultiRaft::storage_failed`).
    pub(super) fn fail_storage(&mut self, error: &StoreError, group: Option<GroupId>) {
        tracing::error!(%error, ?group, "slot store write failed: this node's slot replicas stop until a restart");
        self.storage_failed = true;
        self.round_writes = RaftLogBatch::new();
        self.round_meta.clear();
        self.awaiting.clear();
        self.sync_requested = false;
    }

    pub(super) fn process_ready(&mut self, id: GroupId) -> Result<(), StoreError> {
        let table = Arc::clone(&self.genesis);
        let group = self.groups.get_mut(&id).expect("group exists");
        let mut ready = group.raw.ready();
        let messages = ready.take_messages();
        let mut batch = RaftLogBatch::new();
        let snapshot: Snapshot = ready.snapshot().clone();
        let snapshot_index = (!snapshot.is_empty()).then(|| snapshot.get_metadata().index);
        if !snapshot.is_empty() {
            self.install_snapshot(id, &snapshot)?;
            batch.apply_snapshot(id, snapshot.get_metadata().clone());
        }
        let entries = ready.take_entries();
        let commit = ready.hs().map(|hs| hs.commit);
        let wrote = !snapshot.is_empty() || !entries.is_empty() || commit.is_some();
        batch.append(id, entries);
        if let Some(hs) = ready.hs() {
            batch.set_hard_state(id, hs.clone());
        }
        // Written with the round's other groups (`process_all`). Committed entries come from earlier
        // rounds' writes (raft-rs hands out only entries declared persisted, which waits for the sync
        // after that write). Once the ready is advanced raft-rs reads these entries' terms back from the
        // store, so nothing may make it send appends before the round is written: within a round only a
        // membership change does (see `apply_conf_change`).
        self.round_writes.extend(batch);
        if snapshot_index.is_some() {
            // Now: the configuration the FSM applies later entries under is read back from the store
            // (`Group::conf`), and a snapshot replaces it. Snapshots are rare.
            self.write_round()?;
        }
        let committed = ready.take_committed_entries();
        let persisted_messages = ready.take_persisted_messages();
        let number = ready.number();
        for message in messages {
            self.send_raft(id, message);
        }
        let read_states = ready.take_read_states();
        let group = self.groups.get_mut(&id).expect("group exists");
        for state in read_states {
            let read_id = state.request_ctx.get(..8).and_then(|b| b.try_into().ok()).map(u64::from_le_bytes);
            if let Some(read) = group.reads.iter_mut().find(|r| Some(r.id.0) == read_id) {
                read.index = Some(state.index);
            }
        }
        group.raw.advance_append_async(ready);
        // A ready that wrote nothing still waits behind this group's earlier readies that await a sync:
        // `on_persist_ready(number)` declares every ready up to `number` persisted, and its messages (an
        // append response for entries already in the log, say) must not overtake their sync. (Found by the
        // simulator: a follower acknowledged entries before they were durable.)
        let behind_unsynced = self.awaiting.iter().any(|a| a.group == id);
        if wrote || behind_unsynced {
            let awaiting =
                AwaitingSync { token: 0, group: id, number, messages: persisted_messages, snapshot_index, commit };
            self.awaiting.push_back(awaiting);
            self.sync_requested = true;
        } else {
            group.raw.on_persist_ready(number);
            for message in persisted_messages {
                self.send_raft(id, message);
            }
        }
        self.apply_committed(id, &table, committed)?;
        self.finish_reads(id);
        Ok(())
    }

    /// Installs a snapshot a ready carries into the store, before anything of the ready is written.
    fn install_snapshot(&mut self, id: GroupId, snapshot: &Snapshot) -> Result<(), StoreError> {
        let index = snapshot.get_metadata().index;
        // The install replaces the group's data in the store: the round's writes go first.
        self.write_round()?;
        let installed = snapshot::install(&self.meta, id, index, &snapshot.data);
        let group = self.groups.get_mut(&id).expect("group exists");
        // Whatever happened to the store, the FSM reads its records afresh. raft-rs installs only
        // snapshots past its commit index: they cover every entry held back (module `retiring`).
        group.fsm.forget_records();
        group.held_back.clear();
        // Not installed, it must not be recorded as applied either: the replica would go on as if it
        // held the group's data, and a replica promoted so held none of its acknowledged writes (sim
        // seed 580000053). The node's slot replicas stop instead (`fail_storage`), as for any write
        // raft-rs counts on and the store did not take; a restart reads the log as it stands.
        let installed = installed.map_err(|error| match error {
            snapshot::InstallError::Store(error) => error,
            malformed => StoreError::io(
                "install slot snapshot",
                std::io::Error::new(std::io::ErrorKind::InvalidData, malformed.to_string()),
            ),
        })?;
        group.set_config_epoch(installed.config_epoch);
        self.placed(installed.placements);
        if !installed.metas.is_empty() {
            let metas = std::sync::Arc::new(installed.metas);
            self.effects.push_back(SlotEffect::MetasInstalled { group: id, metas });
        }
        Ok(())
    }

    pub(super) fn apply_committed(
        &mut self,
        id: GroupId,
        table: &HashToSlot,
        entries: Vec<Entry>,
    ) -> Result<(), StoreError> {
        let group = self.groups.get_mut(&id).expect("group exists");
        // Entries held back come first (module `retiring`).
        let mut entries = if group.held_back.is_empty() {
            entries
        } else {
            let mut all = std::mem::take(&mut group.held_back);
            all.extend(entries);
            all
        };
        let added_back = self.last_added_back(&entries);
        let mut start = 0;
        while start < entries.len() {
            let mut end = start;
            let mut bytes = 0;
            while end < entries.len() && end - start < self.config.apply_batch_records_max {
                bytes += entries[end].data.len();
                if end > start && bytes > self.config.apply_batch_bytes_max {
                    break;
                }
                end += 1;
            }
            let applied = self.apply_batch(id, table, &entries[start..end], added_back)?;
            if start + applied < end {
                let rest = entries.split_off(start + applied);
                self.hold_back(id, rest);
                return Ok(());
            }
            start = end;
        }
        Ok(())
    }

    /// Applies `entries`: commands under the membership in force at their index, so a membership change
    /// ends a run; the change itself is recorded (configuration and epoch) with its applied index.
    /// Returns how many entries it applied: all but those from a change that takes this replica's vote,
    /// which wait (module `retiring`) unless a change committed after it, at `added_back`, adds this
    /// node again.
    pub(super) fn apply_batch(
        &mut self,
        id: GroupId,
        table: &HashToSlot,
        entries: &[Entry],
        added_back: Option<u64>,
    ) -> Result<usize, StoreError> {
        let mut start = 0;
        for (at, entry) in entries.iter().enumerate() {
            if entry.get_entry_type() != EntryType::EntryNormal {
                let hold = added_back.is_none_or(|index| index < entry.index) && self.takes_own_vote(id, entry);
                self.apply_run(id, table, &entries[start..at], false)?;
                if hold {
                    self.maybe_compact(id)?;
                    return Ok(at);
                }
                self.apply_conf_change(id, entry)?;
                self.apply_run(id, table, &entries[at..=at], true)?;
                start = at + 1;
                // A configuration without this node (a learner removed) does not destroy the replica
                // here: later entries (which it may have acknowledged already) can add it back, and a
                // leader counting on those acknowledgements must never face an emptied replica. The
                // leader says when it may go (`SlotBody::Removed`), asked by `check_membership` if need be.
            }
        }
        self.apply_run(id, table, &entries[start..], false)?;
        self.maybe_compact(id)?;
        Ok(entries.len())
    }

    /// Applies a run of entries through the FSM in one atomic write (membership-change entries carry no
    /// command), then answers their proposers.
    pub(super) fn apply_run(
        &mut self,
        id: GroupId,
        table: &HashToSlot,
        entries: &[Entry],
        record_config_epoch: bool,
    ) -> Result<(), StoreError> {
        if entries.is_empty() {
            return Ok(());
        }
        let me = self.config.node;
        // One FSM command per proposal: batch entries are unpacked, each proposal keeps who waits for it.
        let mut commands: Vec<(u64, &[u8])> = Vec::with_capacity(entries.len());
        let mut owners: Vec<Option<(NodeId, u64)>> = Vec::with_capacity(entries.len());
        for entry in entries {
            let normal = entry.get_entry_type() == EntryType::EntryNormal;
            match (normal && entry.context == batch::BATCH_CONTEXT).then(|| batch::decode(&entry.data)) {
                Some(Some(decoded)) => {
                    for proposal in decoded.proposals {
                        commands.push((entry.index, proposal.command));
                        owners.push(Some((proposal.origin, proposal.id)));
                    }
                }
                // A batch that does not decode applies nothing (its index still counts as applied).
                Some(None) => {
                    commands.push((entry.index, &[]));
                    owners.push(None);
                }
                // A leader's empty entry or a membership change: no command.
                None => {
                    commands.push((entry.index, &[]));
                    owners.push(None);
                }
            }
        }
        if self.round_meta.iter().any(|(group, _)| *group == id) {
            // The FSM reads its own earlier writes (its applied index, its records) from the store.
            self.write_round()?;
        }
        let group = self.groups.get_mut(&id).expect("group exists");
        let conf = group.conf();
        let (applied, write) = group.fsm.stage_in(table, &conf, record_config_epoch, &commands)?;
        if let Some(write) = write {
            // Written with the round's other groups (`process_all`), before any effect below leaves:
            // a proposer told `Applied` reads its write back.
            self.round_meta.push((id, write));
        }
        let leader = group.raw.raft.state == StateRole::Leader;
        for meta in applied.metas {
            self.effects.push_back(SlotEffect::MetaChanged { group: id, meta, leader });
        }
        for node in applied.drains_started {
            self.effects.push_back(SlotEffect::DrainStarted { group: id, node });
        }
        self.placed(applied.placements);
        let outcomes = applied.outcomes;
        let group = self.groups.get_mut(&id).expect("group exists");
        let last = entries.last().map(|e| e.index);
        let mut forwarded = Vec::new();
        let mut local = Vec::new();
        for (owner, outcome) in owners.into_iter().zip(outcomes) {
            let (Some(outcome), Some((origin, pid))) = (outcome, owner) else { continue };
            if origin == me {
                local.push((pid, outcome));
            } else if leader {
                forwarded.push((origin, pid, outcome));
            }
        }
        if let Some(last) = last {
            group.raw.advance_apply_to(last);
        }
        for (pid, outcome) in local {
            self.complete(pid, Ok(outcome));
        }
        for (origin, pid, outcome) in forwarded {
            self.send(origin, id, SlotBody::ForwardDone { id: pid, outcome });
        }
        Ok(())
    }

    /// Routes by slot placements the store recorded (applied or installed here): the table moves forward and
    /// the node hears of it.
    pub(super) fn placed(&mut self, placements: Vec<(HashSlot, Placement)>) {
        for (slot, placement) in placements {
            self.advance_table(slot, placement);
            self.effects.push_back(SlotEffect::SlotPlaced { slot, placement });
        }
    }

    /// Routes `slot` by `placement` unless the table knows its epoch or a later one; `true` if it moved.
    pub(super) fn advance_table(&mut self, slot: HashSlot, placement: Placement) -> bool {
        match self.table.with_owner(slot, placement.group, placement.epoch) {
            Some(next) => {
                self.table = Arc::new(next);
                true
            }
            None => false,
        }
    }

    /// Applies a membership change entry to raft-rs and the stored configuration. Every such entry sets the
    /// configuration epoch to its index — also one raft-rs refuses (the same on every replica), so the epoch
    /// is a pure function of the log.
    pub(super) fn apply_conf_change(&mut self, id: GroupId, entry: &Entry) -> Result<(), StoreError> {
        // raft-rs took this round's entries out of its unstable log when their readies were advanced and
        // reads them back from the store from then on; applying a membership change makes a leader
        // broadcast appends at once. The round so far is written first, or those appends would name an
        // entry the store does not show yet with term 0, and a follower holding one entry fewer would
        // take it as a match and commit past its log (raft-rs panics: sim seed 113003393).
        self.write_round()?;
        let group = self.groups.get_mut(&id).expect("group exists");
        group.set_config_epoch(entry.index);
        let conf = membership::entry_conf_change(entry).and_then(|change| group.raw.apply_conf_change(&change).ok());
        if let Some(conf) = conf {
            // Written now, with the round so far: the configuration the FSM records with this entry is
            // read back from the store (`Group::conf`). Membership changes are rare.
            self.round_writes.set_conf_state(id, conf);
            self.write_round()?;
        }
        Ok(())
    }

    pub(super) fn maybe_compact(&mut self, id: GroupId) -> Result<(), StoreError> {
        let group = self.groups.get(&id).expect("group exists");
        let applied = group.raw.raft.raft_log.applied;
        let first = group.raw.store().first_index().unwrap_or(1);
        if applied.saturating_sub(first) > self.config.compact_after_entries {
            // In the round's batch: a second compaction of the group before it is written goes further
            // or does nothing (the store stages the batch's changes in order).
            let keep_from = applied - self.config.compact_after_entries / 2;
            self.round_writes.compact(id, keep_from);
        }
        Ok(())
    }

    pub(super) fn finish_reads(&mut self, id: GroupId) {
        let group = self.groups.get_mut(&id).expect("group exists");
        let applied = group.raw.raft.raft_log.applied;
        let mut ready = Vec::new();
        group.reads.retain(|read| match read.index {
            Some(index) if index <= applied => {
                ready.push(read.id);
                false
            }
            _ => true,
        });
        for read in ready {
            self.effects.push_back(SlotEffect::ReadReady { id: read, group: id });
        }
    }

    /// Publishes what raft status shows of the group when it changed.
    pub(super) fn observe(&mut self, id: GroupId) {
        let group = self.groups.get_mut(&id).expect("group exists");
        let conf = group.conf();
        let leader = (group.raw.raft.leader_id != 0).then(|| NodeId::new(group.raw.raft.leader_id));
        let observation = GroupObservation {
            leader,
            term: Term::new(group.raw.raft.term),
            voters: conf.voters,
            learners: conf.learners,
            config_epoch: conf.config_epoch,
        };
        if group.observed.as_ref() != Some(&observation) {
            group.observed = Some(observation.clone());
            self.effects.push_back(SlotEffect::Observed { group: id, observation });
        }
    }
}
