//! API reads of committed messages: the shard admits one and bounds it ([`ReadPlan`]); the read itself
//! may touch storage, so the threaded runtime carries it out on its reader thread, never on a reactor.
//! An inactive replica is not loaded for a read: the plan reads up to the high watermark its store
//! holds (the one its next incarnation starts from), and the shard starts the activation meanwhile.

use super::ChannelShard;
use crate::node::error::NodeError;
use tidings_slot::query::SlotReader;
use tidings_store::message::{MessageLog, ReadLimits, Record, RecordKind};
use tidings_types::{ChannelId, NodeId, Seq, Time};

/// An admitted API read (or `latest`): which records it may return.
#[derive(Clone, Debug)]
pub struct ReadPlan {
    channel: ChannelId,
    me: NodeId,
    from: Seq,
    through: Through,
    limits: ReadLimits,
}

/// The high watermark a read stops at.
#[derive(Clone, Copy, Debug)]
enum Through {
    /// The one the active replica knew when the read was admitted.
    Known(Seq),
    /// The one an inactive replica's store holds. `check_meta`: the shard held no meta for the channel,
    /// so the read first checks in this node's slot replica that this node keeps a replica of it.
    Stored { check_meta: bool },
}

impl ReadPlan {
    /// The high watermark known when the plan was made, if any: `None` when it is read from the store.
    pub fn known_high_watermark(&self) -> Option<Seq> {
        match self.through {
            Through::Known(hw) => Some(hw),
            Through::Stored { .. } => None,
        }
    }

    /// The high watermark this read stops at: known at admission, or read from the store (and the
    /// channel's meta from `reader`, when the shard held none).
    pub fn high_watermark(&self, log: &dyn MessageLog, reader: &SlotReader) -> Result<Seq, NodeError> {
        self.range(log, reader).map(|(_, through)| through)
    }

    /// The first and last seq the read may return. A plan made without the channel's meta reads it
    /// here, and starts after its retention boundary: the store may not have trimmed yet (an evicted
    /// replica trims when it next applies the meta).
    fn range(&self, log: &dyn MessageLog, reader: &SlotReader) -> Result<(Seq, Seq), NodeError> {
        let check_meta = match self.through {
            Through::Known(hw) => return Ok((self.from, hw)),
            Through::Stored { check_meta } => check_meta,
        };
        let mut from = self.from;
        if check_meta {
            match reader.runtime_meta(&self.channel)? {
                None => return Err(NodeError::UnknownChannel(self.channel.clone())),
                Some(meta) if !meta.is_replica(self.me) => return Err(NodeError::NotReplica(self.channel.clone())),
                Some(meta) => from = from.max(meta.retention_through.next()),
            }
        }
        Ok((from, log.state(&self.channel)?.hw))
    }

    /// Reads the committed messages the plan covers, from its first seq on: at most its record limit,
    /// within its byte limit (at least one message when any is committed). Barrier records (a new
    /// leader's first record) are skipped and read past, so a page comes back short only at the
    /// high watermark or at the byte limit.
    pub fn carry_out(&self, log: &dyn MessageLog, reader: &SlotReader) -> Result<Vec<Record>, NodeError> {
        let (mut from, through) = self.range(log, reader)?;
        let mut messages = Vec::new();
        let mut wanted = self.limits.records_max;
        while wanted > 0 && from <= through {
            let limits = ReadLimits { records_max: wanted, bytes_max: self.limits.bytes_max };
            let records = log.read(&self.channel, from, through, limits)?;
            let Some(last) = records.last() else { break };
            from = last.seq.next();
            let read = records.len();
            let before = messages.len();
            messages.extend(records.into_iter().filter(|r| r.kind == RecordKind::Message));
            let skipped = read - (messages.len() - before);
            // Stopped short of what it asked (the byte limit or the end): this page is done.
            if skipped == 0 || read < wanted {
                break;
            }
            wanted = skipped;
        }
        Ok(messages)
    }
}

impl ChannelShard {
    /// Admits an API read of `channel` from `from`, at most `limit` messages (and the node's
    /// `read_records_max` / `read_bytes_max`), bounded by the high watermark this replica knows.
    pub(crate) fn plan_read(
        &mut self,
        now: Time,
        channel: &ChannelId,
        from: Seq,
        limit: usize,
    ) -> Result<ReadPlan, NodeError> {
        let through = self.through_for_api(now, channel)?;
        let limits =
            ReadLimits { records_max: limit.min(self.config.read_records_max), bytes_max: self.config.read_bytes_max };
        // Records given up stop being readable once the meta that gives them up is known here, before
        // the store has trimmed them (its next durable write).
        let retained_after = self.metas.get(channel).map_or(Seq::new(0), |known| known.meta.retention_through);
        let from = from.max(retained_after.next());
        Ok(ReadPlan { channel: channel.clone(), me: self.config.node, from, through, limits })
    }

    /// Admits a `latest` query: the plan's high watermark is the answer.
    pub(crate) fn plan_latest(&mut self, now: Time, channel: &ChannelId) -> Result<ReadPlan, NodeError> {
        self.plan_read(now, channel, Seq::new(0), 0)
    }

    /// [`ChannelShard::plan_read`] carried out at once, on this thread (the sans-IO core's callers and
    /// the simulator, whose stores are in memory).
    pub(crate) fn read(
        &mut self,
        now: Time,
        channel: &ChannelId,
        from: Seq,
        limit: usize,
    ) -> Result<Vec<Record>, NodeError> {
        let plan = self.plan_read(now, channel, from, limit)?;
        plan.carry_out(self.log.as_ref(), &self.reader)
    }

    /// [`ChannelShard::plan_latest`] answered at once, on this thread (as [`ChannelShard::read`]).
    pub(crate) fn latest(&mut self, now: Time, channel: &ChannelId) -> Result<Seq, NodeError> {
        let plan = self.plan_latest(now, channel)?;
        plan.high_watermark(self.log.as_ref(), &self.reader)
    }

    /// Where an API call on `channel` finds its high watermark. An active replica is marked used and
    /// answers from memory; an inactive one starts its activation (a restarted replica activates this
    /// way too) and the call reads the HW its store holds. A channel whose meta the shard does not know
    /// (and this node's slot replica cannot tell) has it fetched for next time.
    fn through_for_api(&mut self, now: Time, channel: &ChannelId) -> Result<Through, NodeError> {
        self.advance(now);
        if let Some(machine) = self.channels.get_used(channel, self.now) {
            return Ok(Through::Known(machine.hw()));
        }
        self.activate(channel);
        match self.metas.get(channel) {
            Some(known) if known.meta.is_replica(self.config.node) => Ok(Through::Stored { check_meta: false }),
            Some(_) => Err(NodeError::NotReplica(channel.clone())),
            None if self.served.serves(channel) => Ok(Through::Stored { check_meta: true }),
            None => Err(NodeError::MetaUnavailable(channel.clone())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use tidings_store::message::{LogBatch, LogLimits, LogOp, MemoryLog};
    use tidings_types::{ChannelType, LeaderEpoch};

    fn record(seq: u64, kind: RecordKind, payload_bytes: usize) -> Record {
        Record {
            seq: Seq::new(seq),
            kind,
            leader_epoch: LeaderEpoch::new(if seq < 4 { 1 } else { 2 }),
            idempotency_key: None,
            timestamp_ms: seq,
            payload: Bytes::from(vec![b'x'; payload_bytes]),
        }
    }

    /// Seqs 1..=9: messages, with barriers at 1 and 4 (two leader epochs).
    fn log(channel: &ChannelId) -> MemoryLog {
        let log = MemoryLog::new(LogLimits::default());
        let records = (1..=9)
            .map(|seq| record(seq, if seq == 1 || seq == 4 { RecordKind::Barrier } else { RecordKind::Message }, 100))
            .collect();
        log.commit(LogBatch::new(channel.clone(), vec![LogOp::Append(records)])).unwrap();
        log
    }

    fn reader() -> SlotReader {
        SlotReader::new(tidings_store::MetaStore::new(std::sync::Arc::new(tidings_store::kv::MemoryKv::new())))
    }

    fn seqs(records: &[Record]) -> Vec<u64> {
        records.iter().map(|r| r.seq.get()).collect()
    }

    fn plan(channel: &ChannelId, from: u64, through: u64, records_max: usize, bytes_max: usize) -> ReadPlan {
        let limits = ReadLimits { records_max, bytes_max };
        let (me, through) = (NodeId::new(1), Through::Known(Seq::new(through)));
        ReadPlan { channel: channel.clone(), me, from: Seq::new(from), through, limits }
    }

    #[test]
    fn a_page_reads_past_barriers_to_fill_its_limit_and_stops_at_the_high_watermark() {
        let channel = ChannelId::new(ChannelType::GROUP, "reads").unwrap();
        let log = log(&channel);
        let all = usize::MAX;
        assert_eq!(
            seqs(&plan(&channel, 1, 9, 3, all).carry_out(&log, &reader()).unwrap()),
            vec![2, 3, 5],
            "two barriers skipped"
        );
        assert_eq!(
            seqs(&plan(&channel, 4, 9, 1, all).carry_out(&log, &reader()).unwrap()),
            vec![5],
            "a page starting on a barrier"
        );
        assert_eq!(
            seqs(&plan(&channel, 1, 6, 100, all).carry_out(&log, &reader()).unwrap()),
            vec![2, 3, 5, 6],
            "nothing past HW"
        );
        assert!(plan(&channel, 7, 6, 100, all).carry_out(&log, &reader()).unwrap().is_empty(), "from past HW");
    }

    #[test]
    fn a_page_stops_at_its_byte_limit_with_at_least_one_message() {
        let channel = ChannelId::new(ChannelType::GROUP, "bytes").unwrap();
        let log = log(&channel);
        let one = record(5, RecordKind::Message, 100).encoded_len();
        let page = plan(&channel, 5, 9, 100, 2 * one).carry_out(&log, &reader()).unwrap();
        assert_eq!(seqs(&page), vec![5, 6]);
        assert_eq!(
            seqs(&plan(&channel, 5, 9, 100, 1).carry_out(&log, &reader()).unwrap()),
            vec![5],
            "one, whatever the limit"
        );
    }

    #[test]
    fn a_plan_made_without_the_meta_starts_after_the_boundary_its_slot_replica_holds() {
        use tidings_slot::command::Command;
        use tidings_slot::fsm::{migration::seed_placements, FsmLimits, SlotFsm};
        let channel = ChannelId::new(ChannelType::GROUP, "unloaded").unwrap();
        // The store holds everything through 9, committed, not trimmed (the replica was evicted when the
        // meta giving up 1..=5 was applied).
        let log = log(&channel);
        log.commit(LogBatch::new(channel.clone(), vec![LogOp::CheckpointHw(Seq::new(9))])).unwrap();
        let store = tidings_store::MetaStore::new(std::sync::Arc::new(tidings_store::kv::MemoryKv::new()));
        let table = tidings_router::HashToSlot::even_split(1).unwrap();
        seed_placements(&store, &table).unwrap();
        let fsm = SlotFsm::new(tidings_types::GroupId::new(1), store.clone(), FsmLimits::default());
        let me = NodeId::new(1);
        let meta = tidings_types::ChannelRuntimeMeta {
            channel: channel.clone(),
            version: 1,
            leader: me,
            replicas: vec![me],
            isr: vec![me],
            min_isr: 1,
            epoch: tidings_types::Epoch::new(1),
            leader_epoch: LeaderEpoch::new(1),
            write_fence: None,
            retention_through: Seq::new(5),
        };
        let command = Command::CreateRuntimeMeta(meta).encode();
        fsm.apply(&table, &[(1, command.as_slice())]).unwrap();
        let all = ReadLimits { records_max: 100, bytes_max: usize::MAX };
        let plan = ReadPlan {
            channel: channel.clone(),
            me,
            from: Seq::new(1),
            through: Through::Stored { check_meta: true },
            limits: all,
        };
        assert_eq!(seqs(&plan.carry_out(&log, &SlotReader::new(store)).unwrap()), vec![6, 7, 8, 9]);
    }
}
