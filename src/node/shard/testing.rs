//! What the unit tests of the shard's modules share: a shard over a memory log, and loads and floor
//! writes carried out as the node would.

use super::activation::ROOM_PATIENCE;
use super::room::RESIDENCE_MIN;
use super::{ChannelShard, KnownMeta, ShardInput, ShardOutput};
use crate::node::config::NodeConfig;
use crate::node::core::NodeEffect;
use std::sync::Arc;
use tidings_slot::query::SlotReader;
use tidings_store::message::{LogBatch, LogOp, MemoryLog, MessageLog, Record, RecordKind};
use tidings_types::{ChannelId, ChannelRuntimeMeta, ChannelType, Epoch, LeaderEpoch, NodeId, Seq, Time};

/// The test shard over a memory log the test also writes and reads.
pub(super) fn shard_over_memory_log(config: NodeConfig) -> (ChannelShard, Arc<MemoryLog>) {
    let log = Arc::new(MemoryLog::new(Default::default()));
    let shard = super::test_shard(config, Arc::clone(&log) as Arc<dyn tidings_store::message::MessageLog>);
    (shard, log)
}

/// Carries out the loads (over a slot replica holding nothing) and the meta floor writes among the
/// shard's outputs, each answer handled at once, as the node and its durable workers would; returns
/// the other outputs (a machine's own writes among them: the test answers those it means to).
pub(super) fn carry_out_loads_and_floors(shard: &mut ChannelShard, log: &MemoryLog) -> Vec<ShardOutput> {
    let reader = SlotReader::new(tidings_store::MetaStore::new(Arc::new(tidings_store::MemoryKv::new())));
    let mut others = Vec::new();
    while let Some(output) = shard.poll_output() {
        match output {
            ShardOutput::Effect(NodeEffect::Lookup(lookup)) => {
                shard.handle(Time::ZERO, lookup.carry_out(log, &reader).into_input());
            }
            ShardOutput::Effect(NodeEffect::Persist { token, batch })
                if matches!(batch.ops[..], [LogOp::RaiseMetaFloor { .. }]) =>
            {
                let channel = batch.channel.clone();
                let result = log.commit(batch);
                shard.handle(Time::ZERO, ShardInput::Persisted { channel, token, result });
            }
            other => others.push(other),
        }
    }
    others
}

pub(super) const ME: NodeId = NodeId::new(1);

/// A shard over a memory log with room for `places` active replicas, on a node of a two-node cluster.
pub(super) fn shard_with_places(places: usize) -> (ChannelShard, Arc<MemoryLog>) {
    shard_over_memory_log(NodeConfig { active_channels_max: places, ..NodeConfig::new(ME, vec![ME, NodeId::new(2)]) })
}

/// Channel `name`, its meta known to the shard with `leader` leading.
pub(super) fn known(shard: &mut ChannelShard, name: &str, leader: u64) -> ChannelId {
    let channel = ChannelId::new(ChannelType::GROUP, name).unwrap();
    let replicas = vec![ME, NodeId::new(2)];
    let meta = ChannelRuntimeMeta {
        channel: channel.clone(),
        version: 3,
        leader: NodeId::new(leader),
        isr: replicas.clone(),
        replicas,
        min_isr: 1,
        epoch: Epoch::new(1),
        leader_epoch: LeaderEpoch::new(2),
        write_fence: None,
        retention_through: Seq::new(0),
    };
    shard.metas.insert(channel.clone(), KnownMeta { meta, stored_here: true });
    channel
}

/// Stores in `channel`'s log one leader epoch's records, seqs 1 to `last` (its barrier, then
/// messages), made durable with `checkpoints`.
pub(super) fn store_epoch(log: &MemoryLog, channel: &ChannelId, epoch: u64, last: u64, checkpoints: Vec<LogOp>) {
    let records = (1..=last)
        .map(|seq| Record {
            seq: Seq::new(seq),
            kind: if seq == 1 { RecordKind::Barrier } else { RecordKind::Message },
            leader_epoch: LeaderEpoch::new(epoch),
            idempotency_key: None,
            timestamp_ms: seq,
            payload: bytes::Bytes::from_static(b"m"),
        })
        .collect();
    let ops = [vec![LogOp::Append(records)], checkpoints].concat();
    tidings_store::message::MessageLog::commit(log, LogBatch::new(channel.clone(), ops)).unwrap();
}

/// The barrier a leader of epoch 2 (the epoch `known` names) writes first, at seq 1.
pub(super) fn first_barrier_of_epoch_2() -> Record {
    Record {
        seq: Seq::new(1),
        kind: RecordKind::Barrier,
        leader_epoch: LeaderEpoch::new(2),
        idempotency_key: None,
        timestamp_ms: 1,
        payload: bytes::Bytes::new(),
    }
}

/// Moves the shard's time on by [`RESIDENCE_MIN`]: every replica active now may leave for another's
/// room.
pub(super) fn let_residence_pass(shard: &mut ChannelShard) {
    let now = shard.now + RESIDENCE_MIN;
    shard.advance(now);
}

/// A channel this node leads whose replica was evicted earlier (its epoch's barrier in its log): it
/// comes back as a returning leader, which takes no place free past the leaders' share.
pub(super) fn returning_leader(shard: &mut ChannelShard, log: &MemoryLog, name: &str) -> ChannelId {
    let leader = known(shard, name, 1);
    store_epoch(log, &leader, 2, 1, vec![LogOp::CheckpointHw(Seq::new(1))]);
    shard.resumable.insert(leader.clone(), LeaderEpoch::new(2));
    leader
}

/// Tries `channel`'s activation and, when it waits in the room queue, lets its patience pass and tries
/// it once more: a try that finds no room ends refused (filed to be tried again), as it did before
/// activations waited for room.
pub(super) fn try_activation(shard: &mut ChannelShard, log: &MemoryLog, channel: &ChannelId) {
    shard.activate(channel);
    carry_out_loads_and_floors(shard, log);
    if shard.is_queued_for_room(channel) {
        let patience_over = shard.now + ROOM_PATIENCE;
        shard.advance(patience_over);
        shard.retry_queued_for_room();
        carry_out_loads_and_floors(shard, log);
    }
}

/// Answers every durable write among `outputs` and those the answers bring, until none is left;
/// returns the other outputs.
pub(super) fn answer_persists(
    shard: &mut ChannelShard,
    log: &MemoryLog,
    mut outputs: Vec<ShardOutput>,
) -> Vec<ShardOutput> {
    let mut others = Vec::new();
    while let Some(output) = outputs.pop() {
        let ShardOutput::Effect(NodeEffect::Persist { token, batch }) = output else {
            others.push(output);
            continue;
        };
        let channel = batch.channel.clone();
        let result = tidings_store::message::MessageLog::commit(log, batch);
        shard.handle(Time::ZERO, ShardInput::Persisted { channel, token, result });
        outputs.extend(carry_out_loads_and_floors(shard, log));
    }
    others
}
