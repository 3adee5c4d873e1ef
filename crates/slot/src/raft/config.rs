//! Configuration of the multi-raft driver.

use crate::fsm::FsmLimits;
use std::time::Duration;
use tidings_types::NodeId;

/// Configuration of a [`super::MultiRaft`]. Every queue is bounded by one of these.
#[derive(Clone, Debug)]
pub struct MultiRaftConfig {
    /// This node.
    pub node: NodeId,
    /// Seed of every random choice (each group's election timeout).
    pub seed: u64,
    /// Distinguishes this start of the node from earlier ones (low 32 bits): proposal and read ids travel
    /// to other nodes and back, so answers addressed to an earlier start must never match a new request.
    /// Set it differently at every start. Default 0.
    pub boot_id: u64,
    /// One raft tick per this interval. Default 100 ms.
    pub tick_interval: Duration,
    /// Election timeout, in ticks, is drawn per group in `[election_ticks_min, 2 * election_ticks_min)`.
    /// Default 10.
    pub election_ticks_min: usize,
    /// Heartbeat interval in ticks. Default 2.
    pub heartbeat_ticks: usize,
    /// Most slot groups this node holds; a leader adding this node to one more is not answered. Default
    /// 1,024.
    pub groups_max: usize,
    /// Proposals waiting for apply per group; beyond it proposals get `Busy`. Default 1,024.
    pub pending_proposals_max: usize,
    /// Largest command, in bytes. Default 1 MiB.
    pub proposal_bytes_max: usize,
    /// Authoritative reads waiting per group. Default 1,024.
    pub pending_reads_max: usize,
    /// Most committed entries applied in one FSM batch. Default 256.
    pub apply_batch_records_max: usize,
    /// Most committed entry bytes applied in one FSM batch. Default 4 MiB.
    pub apply_batch_bytes_max: usize,
    /// raft-rs `max_size_per_msg`. Default 1 MiB.
    pub max_size_per_msg: u64,
    /// raft-rs `max_inflight_msgs`. Default 256.
    pub max_inflight_msgs: usize,
    /// Raft messages larger than this travel in chunks. Default 256 KiB.
    pub chunk_bytes: usize,
    /// Largest message (snapshot) reassembled from chunks. Default 256 MiB.
    pub reassembly_bytes_max: usize,
    /// Reassemblies in progress at once. Default 8.
    pub reassemblies_max: usize,
    /// Compact a group's raft log once this many applied entries sit before its first index. Default 10,000.
    pub compact_after_entries: u64,
    /// A snapshot the follower has not acknowledged within this time, plus its size at 20 MB/s, counts as
    /// lost and is sent again. Default 2 s.
    pub snapshot_ack_timeout: Duration,
    /// Proposals and reads not answered within this time fail with `Timeout`. Default 5 s.
    pub request_timeout: Duration,
    /// FSM limits.
    pub fsm: FsmLimits,
    /// Every node of the cluster. A replica that asks whether it is still wanted asks them too, not only
    /// the voters its own configuration names: those may all have left the group since (or lost their
    /// disks), and then only a node it does not know of leads the group that removed it. Default:
    /// none (the voters it knows only).
    pub cluster: Vec<NodeId>,
}

impl MultiRaftConfig {
    /// Defaults for `node`.
    pub fn new(node: NodeId) -> Self {
        Self {
            node,
            seed: node.get(),
            boot_id: 0,
            tick_interval: Duration::from_millis(100),
            election_ticks_min: 10,
            heartbeat_ticks: 2,
            groups_max: 1024,
            pending_proposals_max: 1024,
            proposal_bytes_max: 1 << 20,
            pending_reads_max: 1024,
            apply_batch_records_max: 256,
            apply_batch_bytes_max: 4 << 20,
            max_size_per_msg: 1 << 20,
            max_inflight_msgs: 256,
            chunk_bytes: 256 << 10,
            reassembly_bytes_max: 256 << 20,
            reassemblies_max: 8,
            compact_after_entries: 10_000,
            snapshot_ack_timeout: Duration::from_secs(2),
            request_timeout: Duration::from_secs(5),
            fsm: FsmLimits::default(),
            cluster: Vec::new(),
        }
    }
}
