//! Logs of replicas this node no longer holds: a replacement, a drain or a surplus removal moved the
//! replica away, and its log would otherwise stay on disk for good. The node's sweep
//! (`core::stray_logs`) pages through the logs it holds and names each channel whose local meta does
//! not name this node; the shard forgets such a log ([`LogOp::Forget`]) only once an authoritative
//! read of the channel's meta says this node is no replica.
//!
//! Why an authoritative read, asked only after the candidate is filed: a replica of an ISR must never
//! lose its log. A meta this node read locally may be stale (its slot replica lags; after a restart the
//! shard knows no meta at all), and a node that was removed and then added back may hold the only
//! copies of committed records. The read's answer reflects every meta committed before the read began,
//! and the read begins after the candidate is filed; every meta this shard learns that names it a
//! replica, and every activation, withdraws the candidate. So when the answer excludes this node and the
//! candidate still stands, no meta naming this node was committed before the read, or one was and a
//! later one removed it again; either way this node is no replica now, and it has not acted as one
//! since. While the forget is on its way, the channel is not activated; a meta that adds the node
//! back then activates a new replica, on the empty log, once the forget is durable.

use super::{ChannelShard, ShardOutput};
use std::time::Duration;
use tidings_channel::machine::PersistToken;
use tidings_store::message::LogOp;
use tidings_store::StoreError;
use tidings_types::{ChannelId, ChannelRuntimeMeta, Seq, Time};

/// Most candidates a shard has filed at once: more wait for a later pass of the sweep.
pub(super) const STRAY_CANDIDATES_MAX: usize = 64;
/// A candidate whose authoritative read did not come back within this is withdrawn (the next pass of
/// the sweep files it again).
const CONFIRM_PATIENCE: Duration = Duration::from_secs(30);

/// A log being forgotten: the forget's token, and the HW and fanout progress its replica knew when it
/// left memory, for its next incarnation should the forget fail.
#[derive(Debug)]
pub(super) struct Forgetting {
    token: PersistToken,
    floor: Option<(Seq, Seq)>,
}

/// A channel whose log may belong to no replica here, waiting for its authoritative meta.
#[derive(Debug)]
pub(super) struct StrayCandidate {
    /// Names the read asked for it: only that read's answer counts.
    ask: u64,
    since: Time,
    /// Its log's stored state fanned out less than its HW: should the meta name this node the leader,
    /// the replica is activated, and its resumed leadership plans again what was not known to finish.
    fanout_behind: bool,
}

impl ChannelShard {
    /// The node's sweep found a log of `channel` here, and no meta naming this node in its slot
    /// replica: files it as a candidate and asks for its authoritative meta
    /// ([`ShardOutput::ConfirmStray`]), unless the shard is busy with the channel. Neither a meta the
    /// shard holds nor an active replica's own is trusted: nothing tells a replica moved away that it
    /// was, so the meta it holds may be stale for good (sim seed 316007578: an active follower kept
    /// a meta naming it that its own slot replica, which held none, never corrected).
    pub(super) fn consider_stray(&mut self, channel: ChannelId, fanout_behind: bool) {
        let busy = self.stray.contains_key(&channel)
            || self.forgetting.contains_key(&channel)
            || self.is_loading(&channel)
            || self.stray.len() >= STRAY_CANDIDATES_MAX;
        if busy {
            return;
        }
        let ask = self.next_id();
        self.stray.insert(channel.clone(), StrayCandidate { ask, since: self.now, fanout_behind });
        self.outputs.push_back(ShardOutput::ConfirmStray { channel, ask });
    }

    /// This node learned a meta naming it a replica of `channel`, or activated its replica: a
    /// candidate filed before is withdrawn (its read may have begun before that meta was committed).
    pub(super) fn withdraw_stray(&mut self, channel: &ChannelId) {
        self.stray.remove(channel);
    }

    /// The authoritative meta of candidate `channel` (`None`: the read failed, or found no meta; the
    /// candidate is withdrawn). A meta that names no replica here forgets the log, unless something
    /// changed since the candidate was filed.
    pub(super) fn stray_confirmed(&mut self, channel: ChannelId, ask: u64, meta: Option<ChannelRuntimeMeta>) {
        if self.stray.get(&channel).is_none_or(|candidate| candidate.ask != ask) {
            return;
        }
        let fanout_behind = self.stray.remove(&channel).is_some_and(|candidate| candidate.fanout_behind);
        let me = self.config.node;
        if let Some(meta) = meta.as_ref().filter(|meta| meta.leader == me && fanout_behind) {
            // This node leads it, and its fanout is behind: the replica resumes (a leader restarted in
            // place would otherwise wait for the channel's next input).
            self.learn_meta(meta.clone(), false);
            self.activate(&channel);
            return;
        }
        // A meta naming this node is not learned here: after a restart the shard knows no meta, and a
        // sweep that learned every one it read would activate every replica whose log it lists.
        let Some(meta) = meta.filter(|meta| !meta.is_replica(me)) else { return };
        // Committed, and as new as anything committed before the read: the shard keeps the newest it has
        // (an active replica it names no more leaves its role).
        self.learn_meta(meta, false);
        let removed = self.metas.get(&channel).is_some_and(|known| !known.meta.is_replica(me));
        if !removed || self.is_loading(&channel) || self.forgetting.contains_key(&channel) {
            return;
        }
        if let Some(machine) = self.channels.get(&channel) {
            // A replica still writing is left for a later pass: its batch must not land after the forget.
            if machine.is_writing() || machine.meta().is_some_and(|m| m.is_replica(me)) {
                return;
            }
        }
        let version = self.metas.get(&channel).map_or(0, |known| known.meta.version);
        self.forget_log(&channel, version);
    }

    /// Takes `channel`'s replica out of memory with everything kept for its next incarnation, and asks
    /// the store to forget its log, leaving the tombstone `version` (the meta that named no replica
    /// here): activation refuses any older meta (see `activation`), and that one names no replica here
    /// but routes the channel's calls to its leader.
    fn forget_log(&mut self, channel: &ChannelId, version: u64) {
        // HW and fanout progress as the replica knew them: a failed forget leaves the log, and its next
        // incarnation keeps them, as after any retirement (its checkpointed HW may trail what it knew).
        let kept = self.carried_over.remove(channel);
        let floor = self.deactivate(channel).map(|machine| (machine.hw(), machine.fanned_through())).or(kept);
        self.resumable.remove(channel);
        self.pulls_in_flight.remove(channel);
        self.cannot_lead.remove(channel);
        self.unfile(channel);
        tracing::info!(%channel, node = %self.config.node, "forgetting the log of a replica moved away");
        let token = self.persist_own(channel, LogOp::Forget { version });
        self.forgetting.insert(channel.clone(), Forgetting { token, floor });
    }

    /// `true` if `token` is the forget of `channel`'s log, which this finishes: the channel may be
    /// activated again (a meta added this node back meanwhile: a new replica starts on the empty log).
    pub(super) fn forget_persisted(
        &mut self,
        channel: &ChannelId,
        token: PersistToken,
        result: &Result<(), StoreError>,
    ) -> bool {
        if self.forgetting.get(channel).is_none_or(|forgetting| forgetting.token != token) {
            return false;
        }
        let Some(Forgetting { floor, .. }) = self.forgetting.remove(channel) else { return false };
        match result {
            Ok(()) => self.counters.stray_logs_forgotten += 1,
            // Nothing changed in the store: a later pass of the sweep tries again, and meanwhile the log
            // is what it was, HW included (sim seed 354000256: added back at once, the replica showed the
            // HW its store had checkpointed, below the one it had known).
            Err(error) => {
                tracing::warn!(%channel, node = %self.config.node, %error, "could not forget a log");
                if let Some(floor) = floor {
                    self.carried_over.insert(channel.clone(), floor);
                }
            }
        }
        self.log.release_caches(channel);
        let me = self.config.node;
        if self.metas.get(channel).is_some_and(|known| known.meta.is_replica(me)) {
            self.activate(channel);
        } else if !self.waiting.contains_key(channel) {
            // Nothing here needs the meta of a channel this node holds nothing of: the next use fetches
            // it (kept, every log a drain moved away would leave one in memory for good).
            self.metas.remove(channel);
        }
        true
    }

    /// `true` while `channel`'s log is being forgotten (its replica is not activated meanwhile).
    pub(super) fn is_forgetting(&self, channel: &ChannelId) -> bool {
        self.forgetting.contains_key(channel)
    }

    /// Withdraws the candidates whose read did not come back in time. Called with idle eviction's scan.
    pub(super) fn expire_stray(&mut self) {
        let now = self.now;
        self.stray.retain(|_, candidate| candidate.since + CONFIRM_PATIENCE > now);
    }
}

#[cfg(test)]
mod tests {
    use super::super::ShardInput;
    use super::*;
    use crate::node::config::NodeConfig;
    use crate::node::core::NodeEffect;
    use crate::node::shard::Lookup;
    use std::sync::Arc;
    use tidings_store::message::{LogBatch, MemoryLog, MessageLog, Record, RecordKind};
    use tidings_types::{ChannelType, Epoch, LeaderEpoch, NodeId, Seq};

    const ME: NodeId = NodeId::new(1);

    fn room() -> ChannelId {
        ChannelId::new(ChannelType::GROUP, "moved").unwrap()
    }

    /// The channel's meta at `version`, with `replicas` (the first leads).
    fn meta(version: u64, replicas: &[u64]) -> ChannelRuntimeMeta {
        let replicas: Vec<NodeId> = replicas.iter().copied().map(NodeId::new).collect();
        ChannelRuntimeMeta {
            channel: room(),
            version,
            leader: replicas[0],
            isr: replicas.clone(),
            replicas,
            min_isr: 1,
            epoch: Epoch::new(version),
            leader_epoch: LeaderEpoch::new(1),
            write_fence: None,
            retention_through: Seq::new(0),
        }
    }

    /// A shard of node 1 serving no slot group, over a log that holds three records of the channel.
    fn new_shard() -> (ChannelShard, Arc<MemoryLog>) {
        let config = NodeConfig::new(ME, (1..=4).map(NodeId::new).collect());
        let log = Arc::new(MemoryLog::new(Default::default()));
        let records = (1..=3)
            .map(|seq| Record {
                seq: Seq::new(seq),
                kind: RecordKind::Message,
                leader_epoch: LeaderEpoch::new(1),
                idempotency_key: None,
                timestamp_ms: 0,
                payload: bytes::Bytes::from_static(b"m"),
            })
            .collect();
        log.commit(LogBatch::new(room(), vec![LogOp::Append(records)])).unwrap();
        let dyn_log: Arc<dyn MessageLog> = log.clone();
        (super::super::test_shard(config, dyn_log), log)
    }

    fn outputs(shard: &mut ChannelShard) -> Vec<ShardOutput> {
        std::iter::from_fn(|| shard.poll_output()).collect()
    }

    /// The candidate's ask, from the shard's outputs.
    fn filed(shard: &mut ChannelShard) -> u64 {
        shard.handle(Time::ZERO, ShardInput::MaybeStray { channel: room(), fanout_behind: false });
        let asks: Vec<u64> = outputs(shard)
            .into_iter()
            .filter_map(|o| match o {
                ShardOutput::ConfirmStray { ask, .. } => Some(ask),
                _ => None,
            })
            .collect();
        assert_eq!(asks.len(), 1, "one authoritative read asked for");
        asks[0]
    }

    /// The forget the shard asked the store for, if any.
    fn forget_asked(outputs: &[ShardOutput]) -> Option<PersistToken> {
        outputs.iter().find_map(|o| match o {
            ShardOutput::Effect(NodeEffect::Persist { token, batch })
                if matches!(batch.ops[..], [LogOp::Forget { version: 5 }]) =>
            {
                Some(*token)
            }
            _ => None,
        })
    }

    /// Files the channel, confirms it removed at version 5, and returns the forget the shard asked for.
    fn confirmed_removed(shard: &mut ChannelShard) -> PersistToken {
        let ask = filed(shard);
        let confirmed = ShardInput::StrayConfirmed { channel: room(), ask, meta: Some(meta(5, &[2, 3, 4])) };
        shard.handle(Time::ZERO, confirmed);
        forget_asked(&outputs(shard)).expect("forgotten")
    }

    /// Writes the forget `token` names to `log`, as a durable worker would, and completes it.
    fn finish_forget(shard: &mut ChannelShard, log: &MemoryLog, token: PersistToken) {
        let result = log.commit(LogBatch::new(room(), vec![LogOp::Forget { version: 5 }]));
        shard.handle(Time::ZERO, ShardInput::Persisted { channel: room(), token, result });
    }

    fn activates(outputs: &[ShardOutput]) -> bool {
        outputs.iter().any(|o| matches!(o, ShardOutput::Effect(NodeEffect::Lookup(Lookup::Load(_)))))
    }

    /// Only the answer to the read asked for the candidate counts, and a meta naming this node learned
    /// before it comes withdraws the candidate: that read may have begun before the meta that added the
    /// node back was committed, so its "not a replica" is no proof.
    #[test]
    fn a_log_is_kept_unless_the_read_asked_for_its_candidate_says_no_replica_and_nothing_named_it_since() {
        let (mut shard, _) = new_shard();
        let ask = filed(&mut shard);
        let now = Time::ZERO;
        shard
            .handle(now, ShardInput::StrayConfirmed { channel: room(), ask: ask + 1, meta: Some(meta(5, &[2, 3, 4])) });
        assert!(forget_asked(&outputs(&mut shard)).is_none(), "an answer to another read");
        // Added back (version 6) before the answer to a read of version 5 came.
        shard.handle(now, ShardInput::Meta { meta: meta(6, &[2, 3, 1]), stored_here: false });
        outputs(&mut shard);
        // Withdrawn, not merely outweighed by the newer meta: the shard may let that meta go (an evicted
        // replica's meta stored in its slot replica) before the answer comes.
        assert!(!shard.stray.contains_key(&room()), "withdrawn");
        shard.metas.clear();
        shard.handle(now, ShardInput::StrayConfirmed { channel: room(), ask, meta: Some(meta(5, &[2, 3, 4])) });
        assert!(forget_asked(&outputs(&mut shard)).is_none(), "withdrawn by the meta naming this node");
        // A read that names this node, or that could not tell, forgets nothing either.
        let (mut shard, _) = new_shard();
        let ask = filed(&mut shard);
        shard.handle(now, ShardInput::StrayConfirmed { channel: room(), ask, meta: Some(meta(7, &[1, 2, 3])) });
        let out = outputs(&mut shard);
        assert!(forget_asked(&out).is_none());
        // Nor does the sweep activate the replica it names: after a restart it would activate them all.
        assert!(!activates(&out) && shard.metas.is_empty(), "the meta read is not learned");
        let (mut shard, _) = new_shard();
        let ask = filed(&mut shard);
        shard.handle(now, ShardInput::StrayConfirmed { channel: room(), ask, meta: None });
        assert!(forget_asked(&outputs(&mut shard)).is_none());
    }

    /// A forget that fails leaves the log as it was, and its next incarnation keeps the HW and fanout
    /// progress its replica knew (its store's checkpoint may trail them); a forget that lands drops them
    /// with the log (sim seed 354000256: added back after a failed forget, a replica showed its
    /// checkpointed HW, below the one it had known).
    #[test]
    fn what_a_replica_knew_outlives_a_failed_forget_and_goes_with_a_forgotten_log() {
        for fails in [true, false] {
            let (mut shard, log) = new_shard();
            // Taken out of memory before it was quiescent (a retirement): it knew HW 3, its store none.
            shard.carried_over.insert(room(), (Seq::new(3), Seq::new(2)));
            let token = confirmed_removed(&mut shard);
            assert!(!shard.carried_over.contains_key(&room()), "set aside while the forget runs");
            let result = if fails {
                Err(StoreError::io("test", std::io::Error::other("injected")))
            } else {
                log.commit(LogBatch::new(room(), vec![LogOp::Forget { version: 5 }]))
            };
            shard.handle(Time::ZERO, ShardInput::Persisted { channel: room(), token, result });
            let kept = shard.carried_over.get(&room()).copied();
            assert_eq!(kept, fails.then_some((Seq::new(3), Seq::new(2))), "forget failed: {fails}");
        }
    }

    /// A confirmed stray log is forgotten; meanwhile the replica is not activated, even by a meta that
    /// adds the node back, which activates it once the forget is durable: on the empty log.
    #[test]
    fn a_confirmed_log_is_forgotten_and_a_replica_added_back_meanwhile_starts_after_the_forget() {
        let (mut shard, log) = new_shard();
        let now = Time::ZERO;
        let token = confirmed_removed(&mut shard);
        assert!(shard.is_forgetting(&room()));
        shard.handle(now, ShardInput::MaybeStray { channel: room(), fanout_behind: false });
        assert!(outputs(&mut shard).is_empty(), "busy with it: no second read");
        shard.handle(now, ShardInput::Meta { meta: meta(6, &[2, 3, 1]), stored_here: false });
        assert!(!activates(&outputs(&mut shard)), "not activated on a log being forgotten");
        finish_forget(&mut shard, &log, token);
        assert!(activates(&outputs(&mut shard)), "added back: activated once the forget is durable");
        assert!(log.state(&room()).unwrap().is_empty(), "from an empty log");
        assert_eq!(shard.status(None, 0).counters.stray_logs_forgotten, 1);
        // Not added back: the meta of a channel the node holds nothing of is let go with the log.
        let (mut shard, log) = new_shard();
        let token = confirmed_removed(&mut shard);
        assert_eq!(shard.status(None, 0).metas_held, 1);
        finish_forget(&mut shard, &log, token);
        assert_eq!(shard.status(None, 0).metas_held, 0);
    }

    /// Carries out the loads among `outputs` and feeds their answers back.
    fn carry_out_loads(shard: &mut ChannelShard, log: &MemoryLog, outputs: Vec<ShardOutput>) {
        for output in outputs {
            if let ShardOutput::Effect(NodeEffect::Lookup(lookup)) = output {
                let answer = lookup.carry_out(log, &shard.reader.clone());
                shard.handle(Time::ZERO, answer.into_input());
            }
        }
    }

    /// The tombstone a forget leaves keeps a stale meta (one older than the version that removed this
    /// node) from activating the empty log as the replica it was: named leader of an epoch it led
    /// before, it would lead it again with nothing. A newer meta adding the node back activates it.
    #[test]
    fn after_a_forget_a_stale_meta_naming_the_node_activates_nothing_and_a_newer_one_does() {
        let (mut shard, log) = new_shard();
        let now = Time::ZERO;
        let token = confirmed_removed(&mut shard);
        finish_forget(&mut shard, &log, token);
        outputs(&mut shard);
        assert_eq!(log.state(&room()).unwrap().meta_floor, 5);
        // A late push of an older meta that named this node leader (the shard let the newer one go).
        shard.handle(now, ShardInput::Meta { meta: meta(4, &[1, 2, 3]), stored_here: false });
        let out = outputs(&mut shard);
        assert!(activates(&out), "it loads, and finds the tombstone");
        carry_out_loads(&mut shard, &log, out);
        assert!(shard.channel(&room()).is_none(), "no replica under a meta the tombstone outdates");
        shard.handle(now, ShardInput::Meta { meta: meta(6, &[2, 3, 1]), stored_here: false });
        let out = outputs(&mut shard);
        carry_out_loads(&mut shard, &log, out);
        assert!(shard.channel(&room()).is_some(), "added back by a newer meta: a replica on the empty log");
    }
}
