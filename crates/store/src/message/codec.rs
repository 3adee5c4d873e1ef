//! Binary encodings of log batches (journal frames) and channel log state (sled), checked on decode.

use super::record::{decode_records, encode_records, put_varint, Reader};
use super::state::ISR_PROPOSALS_MAX;
use super::state::{ChannelLogState, LogBatch, LogOp};
use super::stored::StoredState;
use tidings_types::{ChannelId, LeaderEpoch, NodeId, Seq};

const OP_APPEND: u8 = 1;
const OP_TRUNCATE_AFTER: u8 = 2;
const OP_CHECKPOINT_HW: u8 = 3;
const OP_SET_RETENTION: u8 = 4;
const OP_START_AFTER: u8 = 5;
const OP_CHECKPOINT_FANNED: u8 = 6;
const OP_FORGET: u8 = 7;
const OP_RAISE_META_FLOOR: u8 = 8;
const OP_PROPOSE_ISR: u8 = 9;

/// Most bytes [`encode_batch`]'s output takes for `batch` (what the journal reserves for the frame).
pub(crate) fn encoded_batch_len_max(batch: &LogBatch) -> usize {
    let channel = 2 + batch.channel.id().len();
    let ops: usize = batch
        .ops
        .iter()
        .map(|op| match op {
            // Tag, record count and first seq (varints), the records.
            LogOp::Append(records) => 1 + 10 + 10 + records.iter().map(|r| r.encoded_len()).sum::<usize>(),
            LogOp::StartAfter { .. } => 1 + 16,
            LogOp::ProposeIsr { isr, .. } => 1 + 8 + 1 + 8 * isr.len(),
            _ => 1 + 8,
        })
        .sum();
    channel + 10 + ops
}

/// Appends the encoding of `batch` to `out`.
pub(crate) fn encode_batch(batch: &LogBatch, out: &mut Vec<u8>) {
    batch.channel.encode_key(out);
    put_varint(out, batch.ops.len() as u64);
    for op in &batch.ops {
        match op {
            LogOp::Append(records) => {
                out.push(OP_APPEND);
                encode_records(records, out);
            }
            LogOp::TruncateAfter(seq) => put_seq(out, OP_TRUNCATE_AFTER, *seq),
            LogOp::CheckpointHw(seq) => put_seq(out, OP_CHECKPOINT_HW, *seq),
            LogOp::SetRetention(seq) => put_seq(out, OP_SET_RETENTION, *seq),
            LogOp::CheckpointFanned(seq) => put_seq(out, OP_CHECKPOINT_FANNED, *seq),
            LogOp::StartAfter { seq, epoch } => {
                put_seq(out, OP_START_AFTER, *seq);
                out.extend_from_slice(&epoch.get().to_le_bytes());
            }
            LogOp::Forget { version } => put_seq(out, OP_FORGET, Seq::new(*version)),
            LogOp::RaiseMetaFloor { version } => put_seq(out, OP_RAISE_META_FLOOR, Seq::new(*version)),
            LogOp::ProposeIsr { from_version, isr } => {
                put_seq(out, OP_PROPOSE_ISR, Seq::new(*from_version));
                put_nodes(out, isr);
            }
        }
    }
}

/// A list of node ids: its length (one byte; an ISR is a handful of nodes), then each id.
fn put_nodes(out: &mut Vec<u8>, nodes: &[NodeId]) {
    out.push(u8::try_from(nodes.len()).unwrap_or(u8::MAX));
    for node in nodes.iter().take(usize::from(u8::MAX)) {
        out.extend_from_slice(&node.get().to_le_bytes());
    }
}

/// Decodes [`put_nodes`]'s output.
fn read_nodes(input: &mut Reader<'_>) -> Option<Vec<NodeId>> {
    let count = input.u8()?;
    (0..count).map(|_| input.u64().map(NodeId::new)).collect()
}

fn put_seq(out: &mut Vec<u8>, tag: u8, seq: Seq) {
    out.push(tag);
    out.extend_from_slice(&seq.get().to_le_bytes());
}

/// Decodes a batch written by [`encode_batch`]; `None` if the bytes are not exactly one batch.
pub(crate) fn decode_batch(bytes: &[u8]) -> Option<LogBatch> {
    let (channel, rest) = ChannelId::decode_key(bytes)?;
    let mut input = Reader::new(rest);
    let count = usize::try_from(input.varint()?).ok()?;
    // Every op takes at least 9 bytes: a count beyond that is garbage.
    if count > rest.len() / 9 + 1 {
        return None;
    }
    let mut ops = Vec::with_capacity(count);
    for _ in 0..count {
        let op = match input.u8()? {
            OP_APPEND => LogOp::Append(decode_records(&mut input)?),
            OP_TRUNCATE_AFTER => LogOp::TruncateAfter(Seq::new(input.u64()?)),
            OP_CHECKPOINT_HW => LogOp::CheckpointHw(Seq::new(input.u64()?)),
            OP_SET_RETENTION => LogOp::SetRetention(Seq::new(input.u64()?)),
            OP_CHECKPOINT_FANNED => LogOp::CheckpointFanned(Seq::new(input.u64()?)),
            OP_START_AFTER => {
                let seq = Seq::new(input.u64()?);
                LogOp::StartAfter { seq, epoch: LeaderEpoch::new(input.u64()?) }
            }
            OP_FORGET => LogOp::Forget { version: input.u64()? },
            OP_RAISE_META_FLOOR => LogOp::RaiseMetaFloor { version: input.u64()? },
            OP_PROPOSE_ISR => {
                let from_version = input.u64()?;
                LogOp::ProposeIsr { from_version, isr: read_nodes(&mut input)? }
            }
            _ => return None,
        };
        ops.push(op);
    }
    input.is_empty().then_some(LogBatch { channel, ops })
}

/// Encodes a channel's state and how far its records are in sled.
pub(crate) fn encode_state(stored: &StoredState) -> Vec<u8> {
    let StoredState { state, sled_through, frames_before, opening } = stored;
    let mut out = Vec::with_capacity(64 + state.epochs.len() * 16);
    for v in [state.last_seq.get(), state.hw.get(), state.retention_through.get(), sled_through.get()] {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out.extend_from_slice(&u32::try_from(state.epochs.len()).unwrap_or(u32::MAX).to_le_bytes());
    for (epoch, start) in &state.epochs {
        out.extend_from_slice(&epoch.get().to_le_bytes());
        out.extend_from_slice(&start.get().to_le_bytes());
    }
    out.extend_from_slice(&frames_before.to_le_bytes());
    out.extend_from_slice(&opening.to_le_bytes());
    out.extend_from_slice(&state.fanned_through.get().to_le_bytes());
    // Only a log with a meta floor (a tombstone, or a replica that answered a controller) or ISR
    // proposals writes it: every other state keeps format 4's bytes.
    if state.meta_floor > 0 || !state.isr_proposals.is_empty() {
        out.extend_from_slice(&state.meta_floor.to_le_bytes());
    }
    // Only a leader that proposed an ISR writes its proposals: the version once, then each ISR.
    if let Some((from_version, _)) = state.isr_proposals.first() {
        out.extend_from_slice(&from_version.to_le_bytes());
        out.push(u8::try_from(state.isr_proposals.len()).unwrap_or(u8::MAX));
        for (_, isr) in &state.isr_proposals {
            put_nodes(&mut out, isr);
        }
    }
    out
}

/// Decodes [`encode_state`]'s output, checking that it is self-consistent.
pub(crate) fn decode_state(bytes: &[u8]) -> Option<StoredState> {
    let mut input = Reader::new(bytes);
    let last_seq = Seq::new(input.u64()?);
    let hw = Seq::new(input.u64()?);
    let retention_through = Seq::new(input.u64()?);
    let sled_through = Seq::new(input.u64()?);
    let count = usize::try_from(input.u32()?).ok()?;
    if count > bytes.len() / 16 {
        return None;
    }
    let mut epochs = Vec::with_capacity(count);
    for _ in 0..count {
        epochs.push((LeaderEpoch::new(input.u64()?), Seq::new(input.u64()?)));
    }
    // Written by a build before write-behind rounds were cut into batches: such a state is never ahead
    // of the checkpoint (its round was one atomic batch), which 0 says.
    let frames_before = if input.is_empty() { 0 } else { input.u64()? };
    // Written by a build before openings were counted (format 2): 0, no opening's.
    let opening = if input.is_empty() { 0 } else { input.u64()? };
    // Written before fanout's progress was kept (format 3): 0, nothing known.
    let fanned_through = Seq::new(if input.is_empty() { 0 } else { input.u64()? });
    // Written before logs kept a meta floor, or by a log without one: 0.
    let meta_floor = if input.is_empty() { 0 } else { input.u64()? };
    // Written before leaders kept their ISR proposals, or by a log without any: none.
    let mut isr_proposals = Vec::new();
    if !input.is_empty() {
        let from_version = input.u64()?;
        let count = usize::from(input.u8()?);
        if count == 0 || count > ISR_PROPOSALS_MAX {
            return None;
        }
        for _ in 0..count {
            isr_proposals.push((from_version, read_nodes(&mut input)?));
        }
    }
    let ordered = epochs.windows(2).all(|w| w[0].0 < w[1].0 && w[0].1 < w[1].1);
    let consistent = retention_through <= hw && fanned_through <= hw && hw <= last_seq && sled_through <= last_seq;
    (input.is_empty() && ordered && consistent).then_some(StoredState {
        state: ChannelLogState { last_seq, epochs, hw, retention_through, fanned_through, meta_floor, isr_proposals },
        sled_through,
        frames_before,
        opening,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::record::{IdempotencyKey, Record, RecordKind};
    use bytes::Bytes;
    use tidings_types::ChannelType;

    fn batch() -> LogBatch {
        let record = |seq| Record {
            seq: Seq::new(seq),
            kind: RecordKind::Message,
            leader_epoch: LeaderEpoch::new(2),
            idempotency_key: IdempotencyKey::new(b"u1:9".to_vec()),
            timestamp_ms: 5,
            payload: Bytes::from_static(b"hello"),
        };
        LogBatch::new(
            ChannelId::new(ChannelType::GROUP, "g1").unwrap(),
            vec![
                LogOp::TruncateAfter(Seq::new(3)),
                LogOp::Append(vec![record(4), record(5)]),
                LogOp::CheckpointHw(Seq::new(4)),
                LogOp::SetRetention(Seq::new(1)),
                LogOp::CheckpointFanned(Seq::new(3)),
                LogOp::StartAfter { seq: Seq::new(9), epoch: LeaderEpoch::new(3) },
                LogOp::Forget { version: 12 },
                LogOp::RaiseMetaFloor { version: 14 },
                LogOp::ProposeIsr { from_version: 15, isr: vec![NodeId::new(1), NodeId::new(3)] },
            ],
        )
    }

    #[test]
    fn batch_round_trips_and_every_truncation_is_refused() {
        let batch = batch();
        let mut out = Vec::new();
        encode_batch(&batch, &mut out);
        assert!(out.len() <= encoded_batch_len_max(&batch));
        assert_eq!(decode_batch(&out).unwrap(), batch);
        for cut in 0..out.len() {
            assert!(decode_batch(&out[..cut]).is_none(), "cut at {cut}");
        }
        out.push(0);
        assert!(decode_batch(&out).is_none(), "trailing bytes");
    }

    #[test]
    fn state_round_trips_and_inconsistent_state_is_refused() {
        let state = ChannelLogState {
            last_seq: Seq::new(10),
            epochs: vec![(LeaderEpoch::new(1), Seq::new(1)), (LeaderEpoch::new(3), Seq::new(6))],
            hw: Seq::new(8),
            retention_through: Seq::new(2),
            fanned_through: Seq::new(5),
            meta_floor: 0,
            isr_proposals: Vec::new(),
        };
        let stored = StoredState { state: state.clone(), sled_through: Seq::new(7), frames_before: 12, opening: 4 };
        let bytes = encode_state(&stored);
        assert_eq!(decode_state(&bytes), Some(stored.clone()));
        // A tombstone's version follows (a state never forgotten keeps format 4's bytes).
        let tombstoned = StoredState { state: ChannelLogState { meta_floor: 9, ..state.clone() }, ..stored.clone() };
        let with_tombstone = encode_state(&tombstoned);
        assert_eq!(with_tombstone.len(), bytes.len() + 8);
        assert_eq!(decode_state(&with_tombstone), Some(tombstoned));
        // The layouts before fanout's progress, before the opening, and before `frames_before` existed
        // still read: as a state that knows nothing of fanout, no opening wrote, and not ahead of the
        // checkpoint either.
        let unfanned =
            StoredState { state: ChannelLogState { fanned_through: Seq::new(0), ..state.clone() }, ..stored.clone() };
        let format_3 = &bytes[..bytes.len() - 8];
        assert_eq!(decode_state(format_3), Some(unfanned.clone()));
        let format_2 = &bytes[..bytes.len() - 16];
        assert_eq!(decode_state(format_2), Some(StoredState { opening: 0, ..unfanned.clone() }));
        let format_1 = &bytes[..bytes.len() - 24];
        assert_eq!(decode_state(format_1), Some(StoredState { opening: 0, frames_before: 0, ..unfanned }));
        let bad = ChannelLogState { hw: Seq::new(11), ..state.clone() };
        assert!(decode_state(&encode_state(&StoredState { state: bad, ..stored.clone() })).is_none());
        let fanned_past_hw = ChannelLogState { fanned_through: Seq::new(9), ..state };
        assert!(decode_state(&encode_state(&StoredState { state: fanned_past_hw, ..stored })).is_none());
        assert!(decode_state(&bytes[..bytes.len() - 1]).is_none());
    }

    #[test]
    fn a_state_with_isr_proposals_round_trips_and_a_cut_one_is_refused() {
        let isr = |nodes: &[u64]| nodes.iter().copied().map(NodeId::new).collect::<Vec<_>>();
        let state = ChannelLogState {
            last_seq: Seq::new(4),
            epochs: vec![(LeaderEpoch::new(2), Seq::new(1))],
            hw: Seq::new(3),
            isr_proposals: vec![(6, isr(&[1, 3])), (6, isr(&[1, 2, 3]))],
            ..ChannelLogState::default()
        };
        let stored = StoredState { state, sled_through: Seq::new(2), frames_before: 1, opening: 0 };
        let bytes = encode_state(&stored);
        assert_eq!(decode_state(&bytes), Some(stored.clone()));
        let without =
            StoredState { state: ChannelLogState { isr_proposals: Vec::new(), ..stored.state.clone() }, ..stored };
        // The meta floor (0) is written before them: without them the state reads as one without a floor.
        let before = encode_state(&without).len();
        assert_eq!(bytes.len(), before + 8 + 8 + 1 + (1 + 16) + (1 + 24));
        for cut in before + 8 + 1..bytes.len() {
            assert!(decode_state(&bytes[..cut]).is_none(), "cut at {cut}");
        }
        assert_eq!(decode_state(&bytes[..before]), Some(without));
    }
}
