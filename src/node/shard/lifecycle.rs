//! Replicas coming and going: metas learned, fetched and let go, eviction of idle quiescent replicas,
//! a replica taken out of memory, failover requests and evidence for a controller. Activation is in
//! `activation`, room at the cap in `room`, activations filed to try again in `retries`, and the
//! pulls kept for evicted followers in `kept_pulls`.

use super::activation::Deferred;
use super::retries::LEADER_START_TRIES;
use super::{ChannelShard, KnownMeta, ShardOutput, FAILOVER_REQUEST_INTERVAL};
use crate::node::controller::EvidenceReport;
use crate::node::error::NodeError;
use crate::node::message::NodeMessage;
use std::sync::Arc;
use tidings_channel::machine::{AppendAborted, ChannelMachine, RoleKind};
use tidings_channel::reactor::shrink_if_sparse;
use tidings_store::message::ChannelLogState;
use tidings_types::{ChannelId, ChannelRuntimeMeta, NodeId};

/// `machine`'s evidence for the controller's `task`, under `meta` (the one the machine holds, or the one
/// it would be built with).
fn evidence_reply(task: u64, machine: &ChannelMachine, meta: &ChannelRuntimeMeta) -> NodeMessage {
    let evidence = machine.evidence();
    let drain = machine.drain_status();
    let report = EvidenceReport {
        last_epoch: evidence.last_epoch,
        last_seq: evidence.last_seq,
        // The HW in memory: the checkpointed one may trail it, and a replacement counts holders of HW.
        hw: drain.hw.max(evidence.hw),
        pending_appends: u32::try_from(drain.pending_appends).unwrap_or(u32::MAX),
        log_end: drain.log_end,
        drained: drain.drained,
        fenced_by: meta.write_fence.map(|f| f.task),
    };
    NodeMessage::EvidenceReply { task, channel: meta.channel.clone(), version: meta.version, report }
}

impl ChannelShard {
    /// Has the node learn `channel`'s meta (from its own slot replica when it keeps one at the log's
    /// floor or newer: read on the core's thread, not here) and answer with
    /// [`ShardInput::Meta`](super::ShardInput::Meta).
    pub(super) fn fetch_meta(&mut self, channel: &ChannelId) {
        let at_least = self.known_floor(channel);
        self.outputs.push_back(ShardOutput::FetchMeta { channel: channel.clone(), at_least });
    }

    /// Asks for a failover of every channel whose local replica is named leader but cannot lead, at
    /// most once per `FAILOVER_REQUEST_INTERVAL` each, until a new meta arrives.
    pub(super) fn request_failovers(&mut self) {
        let due: Vec<ChannelId> =
            self.cannot_lead.iter().filter(|(_, at)| **at <= self.now).map(|(c, _)| c.clone()).collect();
        for channel in due {
            self.cannot_lead.insert(channel.clone(), self.now + FAILOVER_REQUEST_INTERVAL);
            let Some(version) = self.metas.get(&channel).map(|m| m.meta.version) else { continue };
            // To every node: only the leader of the channel's slot group acts, and this node's idea of who
            // leads it, or even of who its members are (replica moves change them), may be stale.
            for to in self.config.nodes.clone() {
                self.send_node(to, NodeMessage::RequestFailover { channel: channel.clone(), version });
            }
        }
    }

    /// Sends the active replica's evidence to the controller on `from`.
    pub(super) fn send_evidence(&mut self, from: NodeId, task: u64, channel: &ChannelId) {
        let Some(machine) = self.channels.get(channel) else { return };
        let Some(meta) = machine.meta() else { return };
        let reply = evidence_reply(task, machine, meta);
        self.send_node(from, reply);
    }

    /// Answers the controllers' evidence requests among `parked` for a replica left inactive for want
    /// of room, and gives back the other inputs. Evidence needs no place among the active replicas: the
    /// answer is what a machine built from `state` under `meta` would give before any input, and an
    /// inactive replica runs nothing, so it is as frozen as the fence asks. Before, such a request waited
    /// for a place: a failover whose evidence needed the replica its named leader had no place to lead
    /// (every leader's place on its shard held by a busy leader) never gathered enough (sim seed
    /// 351004376, tight limits).
    pub(super) fn send_evidence_at_rest(
        &mut self,
        meta: &ChannelRuntimeMeta,
        state: ChannelLogState,
        parked: Vec<Deferred>,
    ) -> Vec<Deferred> {
        if !parked.iter().any(|input| matches!(input, Deferred::Evidence { .. })) {
            return parked;
        }
        let channel = &meta.channel;
        let (requests, rest): (Vec<_>, Vec<_>) =
            parked.into_iter().partition(|input| matches!(input, Deferred::Evidence { .. }));
        // Built as an activation builds it (see `build_machine`), never inserted: dropped with its effects.
        let mut machine = ChannelMachine::new(
            channel.clone(),
            self.config.node,
            Arc::clone(&self.machine_config),
            self.next_incarnation,
            self.now,
            state,
            Vec::new(),
        );
        if let Some((floor, _)) = self.carried_over.get(channel) {
            machine.raise_hw(*floor);
        }
        for input in requests {
            if let Deferred::Evidence { from, task } = input {
                let reply = evidence_reply(task, &machine, meta);
                self.send_node(from, reply);
            }
        }
        rest
    }

    /// A meta arrived: keep the newest, hand it to the local replica, release appends that waited for it.
    /// `stored_here`: this node's slot replica holds it. One below the log's floor (a slot replica here
    /// or elsewhere that lags) is stale for good and changes nothing (see `floors`).
    pub(super) fn learn_meta(&mut self, meta: ChannelRuntimeMeta, stored_here: bool) {
        if self.below_floor(&meta) {
            return;
        }
        let channel = meta.channel.clone();
        if meta.is_replica(self.config.node) {
            self.withdraw_stray(&channel);
        }
        let mut now_stored = false;
        let (newer, new_leadership) = match self.metas.get_mut(&channel) {
            None => (true, false),
            Some(known) if meta.version > known.meta.version => (true, known.meta.leader_epoch != meta.leader_epoch),
            Some(known) => {
                if known.meta.version == meta.version && stored_here && !known.stored_here {
                    // The version pushed by the slot leader, now applied by this node's slot replica too.
                    known.stored_here = true;
                    now_stored = true;
                }
                (false, false)
            }
        };
        let unused = !self.channels.contains(&channel) && !self.is_loading(&channel);
        if now_stored && unused && !self.waiting.contains_key(&channel) {
            // An evicted replica's meta can go now (see `forget_meta_if_stored`).
            self.forget_meta_if_stored(&channel);
        }
        if newer {
            if new_leadership {
                // A new leadership: whatever this replica asked for is settled, and appends forwarded
                // to another leader end now (outcome unknown: the caller retries with the same keys)
                // instead of at their timeout.
                self.cannot_lead.remove(&channel);
                self.abort_forwards(&channel, meta.leader);
            }
            self.metas.insert(channel.clone(), KnownMeta { meta: meta.clone(), stored_here });
            let now = self.now;
            let me = self.config.node;
            if let Some(machine) = self.machine_mut(&channel) {
                if meta.leader == me && machine.recent_left_out() {
                    // A follower activated without its recent records now leads: a new incarnation
                    // starts from the store with them, under this meta.
                    self.reincarnate(&channel);
                } else {
                    // A meta that is not a valid successor is refused by the machine; it keeps the one it
                    // has.
                    let _ = machine.handle_meta(now, meta);
                }
            } else if !meta.as_created() {
                if meta.leader == me {
                    // A new leadership: tried as long as a leader's start, whatever was filed before.
                    self.unfile(&channel);
                    self.activate_later(&channel, LEADER_START_TRIES);
                }
                // A changed meta may ask something of this replica (a learner to catch up, a new leader
                // to take over). A channel as created asks nothing until it is used: its replicas activate
                // on their first input (an append, a peer's message), not all at once at creation — three
                // activations, an epoch barrier to sync and the followers' long polls for every channel
                // created, most of which a bulk creation (a chat backend importing its groups) leaves idle.
                self.activate(&channel);
            }
        }
        for waiting in self.waiting.remove(&channel).unwrap_or_default() {
            self.route_call(waiting.api, channel.clone(), waiting.call);
        }
    }

    /// `true` while something here needs `channel`'s meta: its replica is active or loading, or calls
    /// wait for the meta.
    pub(super) fn uses_meta(&self, channel: &ChannelId) -> bool {
        self.channels.contains(channel) || self.is_loading(channel) || self.waiting.contains_key(channel)
    }

    /// A snapshot replaced one of this node's slot replicas, and with it metas this shard may keep:
    /// each one of a channel this shard knows or is bringing in (a meta kept, a replica active or
    /// loading, calls waiting) is learned as if applied here. The others wait in the store for the
    /// channel's next use: learned, every channel of the snapshot would be activated at once. A
    /// snapshot applies no command, so nothing else told the shard: a node restarted while its slot
    /// replica lagged read an old meta that left it out of a channel, its replica caught up by a
    /// snapshot to the meta that made it the channel's leader, and the shard answered every append
    /// `NotReplica` from the old one for good — committed messages never fanned out (sim seed
    /// 634000935). O(metas) a shard, once a snapshot.
    pub(super) fn learn_installed_metas(&mut self, metas: &[ChannelRuntimeMeta]) {
        for meta in metas {
            let channel = &meta.channel;
            if self.metas.contains_key(channel) || self.uses_meta(channel) {
                self.learn_meta(meta.clone(), true);
            }
        }
    }

    /// Ends the forwarded calls of `channel` sent to a node other than `leader` with `LeaderChanged`.
    pub(super) fn abort_forwards(&mut self, channel: &ChannelId, leader: NodeId) {
        let stale: Vec<u64> = self
            .forwarded
            .iter()
            .filter(|(_, f)| &f.channel == channel && f.leader != leader)
            .map(|(id, _)| *id)
            .collect();
        for id in stale {
            if let Some(forwarded) = self.forwarded.remove(&id) {
                self.done(forwarded.api, forwarded.kind.failed(NodeError::Aborted(AppendAborted::LeaderChanged)));
            }
        }
    }

    /// Evicts channel replicas idle for the configured time and quiescent (nothing pending, everything
    /// durable and committed). Their logs stay; the next input activates them again.
    pub(super) fn evict_idle(&mut self) {
        let idle_since = self.now - self.config.channel_idle_evict;
        let evictable: Vec<ChannelId> = self
            .channels
            .iter()
            .filter(|(c, m)| m.is_quiescent() && self.channels.last_used(c).is_none_or(|t| t <= idle_since))
            .map(|(c, _)| c.clone())
            .collect();
        for channel in evictable {
            self.evict(&channel);
        }
    }

    /// Takes a quiescent replica out of memory; a leader's epoch is kept for its next incarnation to
    /// resume, and its meta is let go when this node's slot replica keeps it.
    pub(super) fn evict(&mut self, channel: &ChannelId) {
        if let Some(machine) = self.deactivate(channel) {
            if machine.role() == RoleKind::Leader {
                if let Some(meta) = machine.meta() {
                    self.resumable.insert(channel.clone(), meta.leader_epoch);
                }
            }
        }
        self.forget_meta_if_stored(channel);
    }

    /// Lets go of an evicted replica's meta when this node's slot replica keeps it (read back on the next
    /// use), so an idle channel costs little more than its log.
    pub(super) fn forget_meta_if_stored(&mut self, channel: &ChannelId) {
        // Only a meta this node's slot replica applied (or was read from) is there, at that version or a
        // newer one; one pushed by the slot leader first stays until the local replica applies it (see
        // `learn_meta`): reading the stored one back to compare would be storage IO on this thread.
        // Should the store have let it go since (a hash slot migrated away before this shard heard), the
        // next use finds none here and fetches it from the slot group: slower, never a wrong meta.
        if !self.served.serves(channel) || !self.metas.get(channel).is_some_and(|known| known.stored_here) {
            return;
        }
        self.metas.remove(channel);
        shrink_if_sparse(&mut self.metas);
        // Read again with the meta at the next activation.
        self.forget_floor(channel);
    }

    /// Takes the channel's machine out of memory (its log stays); the next input activates a new
    /// incarnation from the store.
    pub(super) fn deactivate(&mut self, channel: &ChannelId) -> Option<ChannelMachine> {
        let mut machine = self.channels.remove(channel)?;
        self.hurried_for.remove(channel);
        if self.leaving_for_room.as_ref().is_some_and(|leave| &leave.leaving == channel) {
            self.leaving_for_room = None;
        }
        // What it asked for and was not drained yet goes out first: a replica is quiescent by its state,
        // and one taken out between an input and the next drain dropped that input's effects — a
        // retention move ended by the leadership's end was never answered (sim seed 222001593).
        let mut effects = Vec::new();
        machine.drain_effects(&mut effects);
        for effect in effects {
            self.channel_effect(channel, effect);
        }
        self.log.release_caches(channel);
        if let Some(pull) = machine.pull_in_flight() {
            self.keep_pull_in_flight(channel, pull);
        }
        Some(machine)
    }

    /// Replaces `channel`'s machine with a new incarnation from the store (see
    /// [`ChannelShard::retire`]).
    pub(super) fn reincarnate(&mut self, channel: &ChannelId) {
        self.retire(channel);
        self.activate(channel);
    }

    /// Takes `channel`'s machine out of memory, not quiescent as an evicted one is: the next incarnation
    /// keeps its HW and how far it knew fanout finished (`carried_over`), and what it held and had not
    /// made durable (a follower's unacknowledged records) its leader sends again.
    pub(super) fn retire(&mut self, channel: &ChannelId) {
        if let Some(machine) = self.deactivate(channel) {
            self.carried_over.insert(channel.clone(), (machine.hw(), machine.fanned_through()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::super::{ShardInput, ShardOutput};
    use super::*;
    use tidings_store::message::LogOp;
    use tidings_types::{ChannelType, LeaderEpoch, Seq, Time, WriteFence};

    /// A snapshot's metas refresh those the shard keeps, and only those: the others stay in the store
    /// for the channel's next use.
    #[test]
    fn a_snapshot_s_metas_refresh_the_metas_the_shard_keeps_and_no_others() {
        let (mut shard, log) = shard_with_places(4);
        let kept = known(&mut shard, "kept", 2);
        let mut newer = shard.metas[&kept].meta.clone();
        newer.version += 1;
        newer.leader = ME;
        newer.leader_epoch = LeaderEpoch::new(3);
        let unknown = ChannelId::new(ChannelType::GROUP, "unknown").unwrap();
        let elsewhere = ChannelRuntimeMeta { channel: unknown.clone(), ..newer.clone() };
        let mut older = newer.clone();
        older.version -= 2;
        shard.learn_installed_metas(&[newer.clone(), elsewhere]);
        carry_out_loads_and_floors(&mut shard, &log);
        assert_eq!(shard.metas[&kept].meta, newer);
        assert!(shard.metas[&kept].stored_here);
        assert!(shard.channels.contains(&kept) || shard.is_loading(&kept), "its new leadership starts");
        assert!(!shard.metas.contains_key(&unknown) && !shard.is_loading(&unknown));
        // One older than the meta kept changes nothing.
        shard.learn_installed_metas(&[older]);
        assert_eq!(shard.metas[&kept].meta, newer);
    }

    /// A replica named leader on a shard whose one leader's place a busy leader holds is not
    /// activated, yet answers a controller's evidence request: from its stored state, as a machine
    /// built from it would.
    #[test]
    fn a_replica_with_no_room_to_be_activated_answers_evidence_from_its_stored_state() {
        let (mut shard, log) = shard_with_places(2);
        // A leader whose barrier's persist is never answered: not quiescent, never evicted.
        let busy = known(&mut shard, "busy", 1);
        shard.activate(&busy);
        carry_out_loads_and_floors(&mut shard, &log);
        assert_eq!(shard.leaders_active(), 1);

        let named = known(&mut shard, "named", 1);
        store_epoch(&log, &named, 2, 5, vec![LogOp::CheckpointHw(Seq::new(4))]);
        let mut fenced = shard.metas[&named].meta.clone();
        fenced.version = 4;
        fenced.write_fence = Some(WriteFence { task: 77, since_version: 4, freeze_replication: true });
        shard.handle(Time::ZERO, ShardInput::Evidence { from: ME, task: 77, meta: fenced });
        let outputs = carry_out_loads_and_floors(&mut shard, &log);

        assert!(!shard.channels.contains(&named), "no leader's place for it");
        assert!(shard.is_queued_for_room(&named), "it waits for a place, its evidence answered meanwhile");
        let replies: Vec<_> = outputs
            .iter()
            .filter_map(|output| match output {
                ShardOutput::Loopback(NodeMessage::EvidenceReply { task, channel, version, report }) => {
                    Some((*task, channel.clone(), *version, *report))
                }
                _ => None,
            })
            .collect();
        let report = EvidenceReport {
            last_epoch: LeaderEpoch::new(2),
            last_seq: Seq::new(5),
            hw: Seq::new(4),
            pending_appends: 0,
            log_end: Seq::new(5),
            drained: false,
            fenced_by: Some(77),
        };
        assert_eq!(replies, vec![(77, named, 4, report)]);
    }
}
