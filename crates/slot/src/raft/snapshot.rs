//! Snapshots of a slot group (an export of its hash slots at its applied index) and the reassembly of
//! raft messages sent in chunks.

use crate::keys::{Key, Kind};
use raft::prelude::Snapshot;
use raft::Storage;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::sync::Weak;
use tidings_store::{MetaSpace, MetaStore, MetaWriteBatch, Placement, RaftLogStore, SnapshotSource, StoreResult};
use tidings_types::{ChannelRuntimeMeta, GroupId, HashSlot, NodeId, Time};

/// The data of a slot-group snapshot.
#[derive(Debug, Default, Serialize, Deserialize)]
pub(crate) struct SnapshotData {
    /// The group's configuration epoch at the snapshot's index.
    pub(crate) config_epoch: u64,
    /// Every key of the group: its copy of a hash slot (`Some`) or its own records (`None`).
    pub(crate) entries: Vec<(Option<HashSlot>, Vec<u8>, Vec<u8>)>,
}

/// Builds snapshots for raft-rs from the metadata store.
pub(crate) struct SlotSnapshots {
    pub(crate) meta: MetaStore,
    pub(crate) logs: Weak<RaftLogStore>,
    pub(crate) bytes_max: usize,
}

const EXPORT_CHUNK: usize = 1 << 20;

impl SnapshotSource for SlotSnapshots {
    fn snapshot(&self, group: GroupId, request_index: u64) -> StoreResult<Option<Snapshot>> {
        let Some(logs) = self.logs.upgrade() else { return Ok(None) };
        let applied = self.meta.applied_index(group)?;
        if applied < request_index {
            return Ok(None); // Not applied that far yet: raft-rs asks again later.
        }
        let storage = logs.group(group)?;
        let (Ok(term), Ok(state)) = (storage.term(applied), storage.initial_state()) else { return Ok(None) };
        let mut data = SnapshotData { config_epoch: self.meta.config_epoch(group)?, ..Default::default() };
        let mut bytes = 0usize;
        let mut cursor = None;
        loop {
            let chunk = self.meta.export_group(group, cursor.as_ref(), EXPORT_CHUNK)?;
            for entry in chunk.entries {
                bytes += entry.key.len() + entry.value.len();
                data.entries.push((entry.space.hash_slot(), entry.key, entry.value));
            }
            if bytes > self.bytes_max {
                // Larger than any receiver reassembles: sending it cannot help. The follower stays behind,
                // and the log says why.
                tracing::warn!(%group, bytes, max = self.bytes_max, "snapshot exceeds the reassembly bound");
                return Ok(None);
            }
            match chunk.next {
                Some(next) => cursor = Some(next),
                None => break,
            }
        }
        let mut snapshot = Snapshot::default();
        let metadata = snapshot.mut_metadata();
        metadata.index = applied;
        metadata.term = term;
        metadata.set_conf_state(state.conf_state);
        // Cannot fail: plain data into memory.
        snapshot.data = postcard::to_allocvec(&data).expect("snapshot data encodes").into();
        Ok(Some(snapshot))
    }
}

/// `true` if `data` decodes as a slot-group snapshot's data, the runtime metas in it included:
/// everything [`install`] decodes.
pub(crate) fn decodes(data: &[u8]) -> bool {
    parse(data).is_ok()
}

/// A received snapshot's data and the channel runtime metas it holds, decoded.
fn parse(data: &[u8]) -> Result<(SnapshotData, Vec<ChannelRuntimeMeta>), InstallError> {
    let data: SnapshotData = postcard::from_bytes(data).map_err(|_| InstallError::Malformed)?;
    let meta_prefix = Key::new(Kind::RuntimeMeta).build();
    let metas = data
        .entries
        .iter()
        .filter(|(slot, key, _)| slot.is_some() && key.starts_with(&meta_prefix))
        .map(|(_, _, value)| postcard::from_bytes(value).map_err(|_| InstallError::Malformed))
        .collect::<Result<_, _>>()?;
    Ok((data, metas))
}

/// What installing a snapshot changed besides the data.
pub(crate) struct Installed {
    /// The group's configuration epoch at the snapshot.
    pub(crate) config_epoch: u64,
    /// Slot placements the group's records in the snapshot imply.
    pub(crate) placements: Vec<(HashSlot, Placement)>,
    /// The channel runtime metas the snapshot holds: applied here without the commands that made
    /// them, so whoever keeps copies of them must hear of them (`SlotEffect::MetasInstalled`).
    pub(crate) metas: Vec<ChannelRuntimeMeta>,
}

/// Writes a received snapshot's data over everything the node held of the group, with its applied index,
/// configuration epoch and the slot placements its records imply, atomically.
pub(crate) fn install(meta: &MetaStore, group: GroupId, index: u64, data: &[u8]) -> Result<Installed, InstallError> {
    let (data, metas) = parse(data)?;
    let mut batch = MetaWriteBatch::new();
    batch.clear_group(group);
    let mut placements = Vec::new();
    for (slot, key, value) in data.entries {
        let space = match slot {
            Some(slot) => MetaSpace::slot(group, slot),
            None => {
                placements.extend(crate::fsm::migration::placement_in_record(group, &key, &value));
                MetaSpace::group_records(group)
            }
        };
        batch.put(space, key, value);
    }
    for (slot, placement) in &placements {
        batch.place(*slot, *placement);
    }
    batch.set_applied(group, index).set_config_epoch(group, data.config_epoch);
    meta.write(&batch).map_err(InstallError::Store)?;
    Ok(Installed { config_epoch: data.config_epoch, placements, metas })
}

/// Why a snapshot could not be installed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum InstallError {
    #[error("snapshot data does not decode")]
    Malformed,
    #[error(transparent)]
    Store(tidings_store::StoreError),
}

/// A message arriving in chunks.
struct Partial {
    chunks: Vec<Option<Vec<u8>>>,
    bytes: usize,
    started: Time,
    /// When its last chunk came.
    touched: Time,
}

/// A partial message that took no chunk for this long is given up for any other transfer of its
/// sender, older-numbered or not: a sender that restarted numbers its transfers from 1 again, and
/// the chunks of an old transfer that arrive late come within a network delay of each other.
const PARTIAL_IDLE_MAX: std::time::Duration = std::time::Duration::from_secs(1);

/// One received chunk of a message.
pub(crate) struct Chunk {
    pub(crate) transfer: u64,
    pub(crate) index: u32,
    pub(crate) count: u32,
    pub(crate) bytes: Vec<u8>,
}

/// Reassembles chunked raft messages, bounded in count and bytes.
pub(crate) struct Reassembly {
    partials: BTreeMap<(NodeId, GroupId), (u64, Partial)>,
    bytes_max: usize,
    count_max: usize,
}

impl Reassembly {
    pub(crate) fn new(bytes_max: usize, count_max: usize) -> Self {
        Self { partials: BTreeMap::new(), bytes_max, count_max }
    }

    /// Adds a chunk; returns the whole message once every chunk arrived. A newer transfer from the same
    /// sender for the same group replaces an older one; limits drop the chunk.
    pub(crate) fn add(&mut self, now: Time, from: NodeId, group: GroupId, chunk: Chunk) -> Option<Vec<u8>> {
        let Chunk { transfer, index, count, bytes } = chunk;
        let count = usize::try_from(count).ok().filter(|c| *c > 0 && *c <= self.bytes_max)?;
        let index = usize::try_from(index).ok().filter(|i| *i < count)?;
        let key = (from, group);
        let fresh = match self.partials.get(&key) {
            // A sender restarted mid-transfer numbers its next ones from 1 again; were only higher
            // numbers taken, every later snapshot from it would be dropped here (sim seed 238002204:
            // a learner never caught up once healed).
            Some((current, partial)) => {
                transfer > *current || (transfer != *current && partial.touched + PARTIAL_IDLE_MAX <= now)
            }
            None => true,
        };
        if fresh {
            if !self.partials.contains_key(&key) && self.partials.len() >= self.count_max {
                // Make room by dropping the oldest transfer.
                let oldest = self.partials.iter().min_by_key(|(_, (_, p))| p.started).map(|(k, _)| *k)?;
                self.partials.remove(&oldest);
            }
            let partial = Partial { chunks: vec![None; count], bytes: 0, started: now, touched: now };
            self.partials.insert(key, (transfer, partial));
        }
        let (current, partial) = self.partials.get_mut(&key)?;
        if *current != transfer || partial.chunks.len() != count {
            return None;
        }
        partial.touched = now;
        if partial.chunks[index].is_none() {
            partial.bytes += bytes.len();
            if partial.bytes > self.bytes_max {
                self.partials.remove(&key);
                return None;
            }
            partial.chunks[index] = Some(bytes);
        }
        if partial.chunks.iter().any(Option::is_none) {
            return None;
        }
        let (_, partial) = self.partials.remove(&key)?;
        Some(partial.chunks.into_iter().flatten().flatten().collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reassembles_in_any_order_and_bounds_bytes() {
        let mut r = Reassembly::new(10, 2);
        let (n, g) = (NodeId::new(1), GroupId::new(1));
        let chunk = |transfer, index, count, bytes| Chunk { transfer, index, count, bytes };
        assert_eq!(r.add(Time::ZERO, n, g, chunk(1, 1, 2, vec![3, 4])), None);
        assert_eq!(r.add(Time::ZERO, n, g, chunk(1, 1, 2, vec![3, 4])), None, "duplicate chunk ignored");
        assert_eq!(r.add(Time::ZERO, n, g, chunk(1, 0, 2, vec![1, 2])), Some(vec![1, 2, 3, 4]));
        assert_eq!(r.add(Time::ZERO, n, g, chunk(2, 0, 2, vec![0; 8])), None);
        assert_eq!(r.add(Time::ZERO, n, g, chunk(2, 1, 2, vec![0; 8])), None, "over the byte bound: dropped");
        assert_eq!(r.add(Time::ZERO, n, g, chunk(3, 5, 2, vec![1])), None, "index out of range");
    }

    #[test]
    fn a_sender_that_restarted_mid_transfer_is_heard_again_once_its_old_transfer_went_idle() {
        let mut r = Reassembly::new(100, 2);
        let (n, g) = (NodeId::new(1), GroupId::new(1));
        let chunk = |transfer, index, count, bytes| Chunk { transfer, index, count, bytes };
        let at = Time::from_millis;
        // Transfer 40 loses its last chunk: its sender crashed.
        assert_eq!(r.add(at(0), n, g, chunk(40, 0, 2, vec![1])), None);
        // A late chunk of an older transfer while 40 is still arriving is dropped.
        assert_eq!(r.add(at(10), n, g, chunk(39, 0, 1, vec![9])), None, "older transfer while the newer is live");
        // Restarted, the sender numbers from 1 again: taken once 40 took nothing for a while.
        assert_eq!(r.add(at(500), n, g, chunk(1, 0, 1, vec![7])), None, "40 still counts as live");
        assert_eq!(r.add(at(1_010), n, g, chunk(1, 0, 1, vec![7])), Some(vec![7]));
        assert_eq!(r.add(at(1_020), n, g, chunk(2, 1, 2, vec![8])), None);
        assert_eq!(r.add(at(1_030), n, g, chunk(2, 0, 2, vec![6])), Some(vec![6, 8]));
    }
}
