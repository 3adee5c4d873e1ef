//! Meta floors (`ChannelLogState::meta_floor`): a controller acts on a replica's evidence — a switch of
//! leader counts on every replica that answered under the fenced meta never acting under an older one
//! again — so a replica answers a controller under a meta only once its log holds that meta's version
//! as its floor, durably; and no meta below a log's floor activates its replica or routes a call here.
//!
//! What it closes (found in session 32 by sim seed 383000412, under two changes since reverted): a
//! leader answered a transfer's evidence request under the fenced meta, drained, then crashed before
//! its slot replica had applied the fence. Restarted, it read the meta before the fence from that
//! replica and led again under it — an epoch whose barrier it had never written, so the rule that a
//! replica never leads an epoch it led before did not stop it — and its follower, at the fence (the
//! same leader epoch, no replication freeze), acknowledged what it admitted while the controller
//! switched the leadership away on its evidence. A follower that answered a failover's fence is held
//! the same way: restarted on a stale slot replica it would follow the old leader again.
//!
//! The shard remembers the floors it knows (written here, or read by a load) in memory, bounded; one it
//! forgets costs a load or a write again, never safety: the durable floor is what a load checks.

use super::activation::Deferred;
use super::ChannelShard;
use tidings_channel::machine::PersistToken;
use tidings_store::message::LogOp;
use tidings_store::StoreError;
use tidings_types::{ChannelId, ChannelRuntimeMeta, NodeId};

/// Most evidence requests of one channel held while its floor is written; more are dropped (the
/// controller asks again every `ask_interval`).
const ANSWERS_HELD_MAX: usize = 8;

/// A floor being written: its token, the version it raises the floor to, and the controllers' requests
/// (`(from, task)`) answered once it is durable.
#[derive(Debug)]
pub(super) struct FloorWrite {
    token: PersistToken,
    version: u64,
    held: Vec<(NodeId, u64)>,
}

impl ChannelShard {
    /// The floor known for `channel`'s log (0: none known here; the log may still hold one).
    pub(super) fn known_floor(&self, channel: &ChannelId) -> u64 {
        self.floors.get(channel).copied().unwrap_or(0)
    }

    /// `true` if `meta` is below the floor known for its channel's log: stale here for good.
    pub(super) fn below_floor(&self, meta: &ChannelRuntimeMeta) -> bool {
        meta.version < self.known_floor(&meta.channel)
    }

    /// Notes that `channel`'s log holds `floor` (durably). Past `floors_max` entries the shard forgets
    /// those of replicas not in memory first (see the module docs: forgetting one is safe).
    pub(super) fn floor_known(&mut self, channel: &ChannelId, floor: u64) {
        if floor <= self.known_floor(channel) {
            return;
        }
        if self.floors.len() >= self.floors_max() && !self.floors.contains_key(channel) {
            let channels = &self.channels;
            self.floors.retain(|c, _| channels.contains(c));
            if self.floors.len() >= self.floors_max() {
                return;
            }
        }
        self.floors.insert(channel.clone(), floor);
    }

    /// Most floors a shard keeps in memory: twice its room for active replicas.
    fn floors_max(&self) -> usize {
        self.active_max.saturating_mul(2).max(64)
    }

    /// `channel`'s replica left memory with its meta: its next load reads the floor again with the
    /// log's state, so it need not be remembered meanwhile.
    pub(super) fn forget_floor(&mut self, channel: &ChannelId) {
        self.floors.remove(channel);
    }

    /// A controller asks this replica for evidence under the fenced (or changed) `meta`: answered once
    /// the log's floor is at `meta`'s version — at once when it is known to be, else after a write
    /// raising it — by an active replica, else once its activation has loaded it.
    pub(super) fn answer_evidence(&mut self, from: NodeId, task: u64, meta: ChannelRuntimeMeta) {
        let channel = meta.channel.clone();
        let version = meta.version;
        self.learn_meta(meta, false);
        if self.known_floor(&channel) >= version {
            return self.answer_at_floor(from, task, &channel);
        }
        let room = self.floor_writes.len() < self.floors_max();
        match self.floor_writes.get_mut(&channel) {
            // Held for the write under way, when it covers this version; else dropped: the controller
            // asks again once that one is durable, and the next write raises the floor further.
            Some(write)
                if write.version >= version
                    && write.held.len() < ANSWERS_HELD_MAX
                    && !write.held.contains(&(from, task)) =>
            {
                write.held.push((from, task))
            }
            Some(_) => {}
            // At most as many writes at once as floors kept: more wait for the controller's next ask.
            None if room => self.write_floor(&channel, version, vec![(from, task)]),
            None => {}
        }
    }

    /// Asks the store to raise `channel`'s floor to `version`; `held` are answered once it is durable.
    fn write_floor(&mut self, channel: &ChannelId, version: u64, held: Vec<(NodeId, u64)>) {
        let token = self.persist_own(channel, LogOp::RaiseMetaFloor { version });
        self.floor_writes.insert(channel.clone(), FloorWrite { token, version, held });
    }

    /// `true` if `token` is the floor write of `channel`, which this finishes: durable, the requests it
    /// held are answered; failed, they are dropped (the controller asks again).
    pub(super) fn floor_persisted(
        &mut self,
        channel: &ChannelId,
        token: PersistToken,
        result: &Result<(), StoreError>,
    ) -> bool {
        if self.floor_writes.get(channel).is_none_or(|write| write.token != token) {
            return false;
        }
        let Some(FloorWrite { version, held, .. }) = self.floor_writes.remove(channel) else { return false };
        match result {
            Ok(()) => {
                self.floor_known(channel, version);
                for (from, task) in held {
                    self.answer_at_floor(from, task, channel);
                }
            }
            Err(error) => tracing::warn!(%channel, node = %self.config.node, %error, "could not raise a meta floor"),
        }
        true
    }

    /// Answers a controller's request once the floor covers it: from the active replica, else once its
    /// activation has loaded it (an evicted replica, or one whose activation failed, answers from a new
    /// incarnation).
    fn answer_at_floor(&mut self, from: NodeId, task: u64, channel: &ChannelId) {
        self.activate(channel);
        if self.is_loading(channel) {
            // Refused when too many wait: the controller asks again.
            let _ = self.park(channel, Deferred::Evidence { from, task });
        } else {
            self.send_evidence(from, task, channel);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{carry_out_loads_and_floors, shard_over_memory_log};
    use super::super::{ApiId, ShardInput, ShardOutput};
    use super::*;
    use crate::node::config::NodeConfig;
    use crate::node::core::NodeEffect;
    use crate::node::message::NodeMessage;
    use std::sync::Arc;
    use tidings_channel::machine::{AppendRecord, RoleKind};
    use tidings_store::message::{LogBatch, MemoryLog, MessageLog};
    use tidings_types::{ChannelType, Epoch, LeaderEpoch, Seq, Time, WriteFence};

    const ME: NodeId = NodeId::new(1);
    const PEER: NodeId = NodeId::new(2);

    fn room() -> ChannelId {
        ChannelId::new(ChannelType::GROUP, "room").unwrap()
    }

    /// The channel's meta at `version`: replicas this node and `PEER`, `leader` leading its
    /// `leader_epoch`, under the transfer fence of task 9 when `fenced`.
    fn meta(version: u64, leader: NodeId, leader_epoch: u64, fenced: bool) -> ChannelRuntimeMeta {
        ChannelRuntimeMeta {
            channel: room(),
            version,
            leader,
            isr: vec![ME, PEER],
            replicas: vec![ME, PEER],
            min_isr: 1,
            epoch: Epoch::new(1),
            leader_epoch: LeaderEpoch::new(leader_epoch),
            write_fence: fenced.then_some(WriteFence { task: 9, since_version: version, freeze_replication: false }),
            retention_through: Seq::new(0),
        }
    }

    fn shard() -> (ChannelShard, Arc<MemoryLog>) {
        shard_over_memory_log(NodeConfig::new(ME, vec![ME, PEER]))
    }

    /// The versions of the evidence replies among `outputs` (sent to this node's own controller).
    fn replies(outputs: &[ShardOutput]) -> Vec<u64> {
        outputs
            .iter()
            .filter_map(|output| match output {
                ShardOutput::Loopback(NodeMessage::EvidenceReply { version, .. }) => Some(*version),
                _ => None,
            })
            .collect()
    }

    /// The floor writes among `outputs`, with their tokens.
    fn floor_writes(outputs: &[ShardOutput]) -> Vec<(PersistToken, u64)> {
        outputs
            .iter()
            .filter_map(|output| match output {
                ShardOutput::Effect(NodeEffect::Persist { token, batch }) => match batch.ops[..] {
                    [LogOp::RaiseMetaFloor { version }] => Some((*token, version)),
                    _ => None,
                },
                _ => None,
            })
            .collect()
    }

    fn drain(shard: &mut ChannelShard) -> Vec<ShardOutput> {
        std::iter::from_fn(|| shard.poll_output()).collect()
    }

    /// A controller's evidence request is answered only once the replica's log holds the request's
    /// meta version as its floor: the answer waits for the write, a failed write answers nothing, and
    /// a floor known durable answers at once.
    #[test]
    fn evidence_is_answered_only_once_the_floor_at_its_meta_is_durable() {
        let (mut shard, log) = shard();
        shard.handle(Time::ZERO, ShardInput::Meta { meta: meta(3, ME, 2, false), stored_here: true });
        carry_out_loads_and_floors(&mut shard, &log);
        assert!(shard.channels.contains(&room()), "the leader is active");

        let ask = |shard: &mut ChannelShard, version| {
            let request = ShardInput::Evidence { from: ME, task: 9, meta: meta(version, ME, 2, true) };
            shard.handle(Time::ZERO, request);
            drain(shard)
        };
        let outputs = ask(&mut shard, 4);
        assert!(replies(&outputs).is_empty(), "not before the floor is durable: {outputs:?}");
        let writes = floor_writes(&outputs);
        assert_eq!(writes.iter().map(|(_, v)| *v).collect::<Vec<_>>(), vec![4]);
        // Asked again meanwhile: held by the write under way, not written twice.
        let outputs = ask(&mut shard, 4);
        assert!(replies(&outputs).is_empty() && floor_writes(&outputs).is_empty());

        // The write fails: nothing is answered; the next request writes again.
        let failed = Err(StoreError::Io { op: "test", source: std::io::Error::other("disk full") });
        shard.handle(Time::ZERO, ShardInput::Persisted { channel: room(), token: writes[0].0, result: failed });
        assert!(replies(&drain(&mut shard)).is_empty(), "a failed write answers nothing");
        assert_eq!(log.state(&room()).unwrap().meta_floor, 0);
        let outputs = ask(&mut shard, 4);
        let (token, version) = floor_writes(&outputs)[0];
        let batch = LogBatch::new(room(), vec![LogOp::RaiseMetaFloor { version }]);
        let result = log.commit(batch);
        shard.handle(Time::ZERO, ShardInput::Persisted { channel: room(), token, result });
        assert_eq!(replies(&drain(&mut shard)), vec![4], "one answer per request held, once durable");
        assert_eq!(log.state(&room()).unwrap().meta_floor, 4);

        // Known durable now: answered at once.
        let outputs = ask(&mut shard, 4);
        assert_eq!(replies(&outputs), vec![4]);
        assert!(floor_writes(&outputs).is_empty());
    }

    /// Past `floors_max` the shard forgets the floors of replicas not in memory (a load reads them again
    /// from the log) and keeps those of active ones; a floor never goes down.
    #[test]
    fn floors_past_the_bound_are_forgotten_for_replicas_not_in_memory_first() {
        let mut config = NodeConfig::new(ME, vec![ME, PEER]);
        config.active_channels_max = 8;
        let (mut shard, log) = shard_over_memory_log(config);
        shard.handle(Time::ZERO, ShardInput::Meta { meta: meta(3, ME, 2, false), stored_here: true });
        carry_out_loads_and_floors(&mut shard, &log);
        assert!(shard.channels.contains(&room()), "active");
        shard.floor_known(&room(), 3);
        shard.floor_known(&room(), 2);
        assert_eq!(shard.known_floor(&room()), 3, "never lowered");
        let idle = |i: usize| ChannelId::new(ChannelType::GROUP, &format!("idle-{i}")).unwrap();
        let max = shard.floors_max();
        for i in 1..max {
            shard.floor_known(&idle(i), 1);
        }
        assert_eq!(shard.floors.len(), max);
        shard.floor_known(&idle(0), 2);
        assert_eq!(shard.known_floor(&idle(0)), 2, "the new floor is kept");
        assert_eq!(shard.known_floor(&room()), 3, "an active replica's floor is kept");
        assert_eq!(shard.known_floor(&idle(1)), 0, "replicas not in memory are forgotten");
        assert_eq!(shard.floors.len(), 2);
    }

    /// The zombie leader of session 32's known gap: a leader answered a transfer's evidence under the
    /// fenced meta, then restarted while its slot replica held only the meta before the fence. Under
    /// that meta it would lead its epoch again and admit appends its follower, at the fence, would
    /// acknowledge. Now the stale meta activates nothing, routes nothing and is not kept; the meta in
    /// force is fetched, and the replica follows the leader it names.
    #[test]
    fn a_replica_restarted_on_a_stale_slot_replica_never_acts_under_a_meta_below_its_floor() {
        let (mut shard, log) = shard();
        shard.handle(Time::ZERO, ShardInput::Meta { meta: meta(3, ME, 2, false), stored_here: true });
        shard.handle(Time::ZERO, ShardInput::Evidence { from: ME, task: 9, meta: meta(4, ME, 2, true) });
        let outputs = carry_out_loads_and_floors(&mut shard, &log);
        assert_eq!(replies(&outputs), vec![4], "the evidence went out once the floor was durable");

        // A restart: a new shard over the same log, whose slot replica gives the meta before the fence.
        let config = NodeConfig::new(ME, vec![ME, PEER]);
        let mut shard = super::super::test_shard(config, Arc::clone(&log) as Arc<dyn MessageLog>);
        shard.handle(Time::ZERO, ShardInput::Meta { meta: meta(3, ME, 2, false), stored_here: true });
        let outputs = carry_out_loads_and_floors(&mut shard, &log);
        assert!(!shard.channels.contains(&room()), "not activated under the stale meta");
        assert!(!shard.metas.contains_key(&room()), "the stale meta is not kept");
        assert!(
            outputs.iter().any(|o| matches!(o, ShardOutput::FetchMeta { channel, at_least: 4 } if *channel == room())),
            "the meta in force is fetched, at the floor or newer: {outputs:?}"
        );
        assert!(!outputs.iter().any(|o| matches!(o, ShardOutput::Effect(NodeEffect::Persist { .. }))), "no barrier");

        // An append waits for the meta; the stale meta pushed again changes nothing.
        let records = vec![AppendRecord { idempotency_key: None, payload: bytes::Bytes::from_static(b"m") }];
        let append = ShardInput::Append { api: ApiId(7), channel: room(), sender: None, records };
        shard.handle(Time::ZERO, append);
        shard.handle(Time::ZERO, ShardInput::Meta { meta: meta(3, ME, 2, false), stored_here: false });
        let outputs = carry_out_loads_and_floors(&mut shard, &log);
        assert!(!shard.channels.contains(&room()) && !shard.metas.contains_key(&room()));
        assert!(!outputs.iter().any(|o| matches!(o, ShardOutput::Effect(NodeEffect::Persist { .. }))));
        assert!(!outputs.iter().any(|o| matches!(o, ShardOutput::Effect(NodeEffect::Done { .. }))), "it waits");

        // The meta in force (the peer leads a new epoch) activates a follower; the append goes to the peer.
        shard.handle(Time::ZERO, ShardInput::Meta { meta: meta(6, PEER, 3, false), stored_here: false });
        let outputs = carry_out_loads_and_floors(&mut shard, &log);
        let machine = shard.channels.get(&room()).expect("active under the meta in force");
        assert_eq!(machine.role(), RoleKind::Follower);
        assert!(outputs.iter().any(|o| matches!(o, ShardOutput::Effect(NodeEffect::Send { to, .. }) if *to == PEER)));
        assert!(!outputs.iter().any(|o| matches!(o, ShardOutput::Effect(NodeEffect::Done { .. }))));
    }
}
