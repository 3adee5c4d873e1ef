//! What the unit tests of the shard's modules share: a shard over a memory log, and loads and floor
//! writes carried out as the node would.

use super::{ChannelShard, ShardInput, ShardOutput};
use crate::node::config::NodeConfig;
use crate::node::core::NodeEffect;
use std::sync::Arc;
use tidings_slot::query::SlotReader;
use tidings_store::message::{LogOp, MemoryLog, MessageLog};
use tidings_types::Time;

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
