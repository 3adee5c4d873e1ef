//! `ChannelRuntimeMeta`: how a channel's data plane must run. Stored by the slot layer (in the channel's
//! hash slot), obeyed by every replica of the channel.

use crate::{ChannelId, Epoch, LeaderEpoch, NodeId, Seq};
use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;

/// A durable write fence: while set, the channel accepts no new appends. Only a newer meta clears it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WriteFence {
    /// The task (leader transfer, replica replacement, failover) that set the fence.
    pub task: u64,
    /// Meta version at which the fence was set.
    pub since_version: u64,
    /// Replicas also stop replicating from (and acknowledging to) the current leader. A failover sets it
    /// before gathering evidence: once |ISR| − MinISR + 1 replicas froze, a leader cut off from the
    /// controller can no longer commit anything the evidence does not show. A leader transfer leaves it
    /// unset so the old leader can drain.
    pub freeze_replication: bool,
}

impl ChannelRuntimeMeta {
    /// The version a channel's meta is created with; every change goes above it.
    pub const CREATED_VERSION: u64 = 1;

    /// The meta a channel is created with: the first of `replicas` leads, every replica is in the ISR,
    /// first epochs, no fence, nothing retained.
    ///
    /// # Panics
    /// If `replicas` is empty (a channel has at least one replica).
    ///
    /// ```
    /// use tidings_types::{ChannelId, ChannelRuntimeMeta, ChannelType, NodeId};
    /// let channel = ChannelId::new(ChannelType::GROUP, "room").unwrap();
    /// let meta = ChannelRuntimeMeta::created(channel, vec![NodeId::new(2), NodeId::new(1)], 2);
    /// assert_eq!(meta.leader, NodeId::new(2));
    /// assert!(meta.as_created() && meta.validate().is_ok());
    /// ```
    pub fn created(channel: ChannelId, replicas: Vec<NodeId>, min_isr: u8) -> Self {
        ChannelRuntimeMeta {
            channel,
            version: Self::CREATED_VERSION,
            leader: replicas[0],
            isr: replicas.clone(),
            replicas,
            min_isr,
            epoch: Epoch::new(1),
            leader_epoch: LeaderEpoch::new(1),
            write_fence: None,
            retention_through: Seq::new(0),
        }
    }

    /// `true` while a failover fence freezes replication.
    pub fn replication_frozen(&self) -> bool {
        self.write_fence.is_some_and(|f| f.freeze_replication)
    }

    /// `true` for the meta as the channel was created: nothing (no task, no ISR change) changed it since.
    pub fn as_created(&self) -> bool {
        self.version == Self::CREATED_VERSION
    }
}

/// Runtime metadata of one channel.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChannelRuntimeMeta {
    /// The channel.
    pub channel: ChannelId,
    /// Version of this meta; every change increments it (compare-and-set in the slot layer).
    pub version: u64,
    /// The only node allowed to accept appends.
    pub leader: NodeId,
    /// Nodes that keep the channel's log: the ISR plus learners.
    pub replicas: Vec<NodeId>,
    /// In-sync replicas: they count toward the high watermark. The leader is one of them.
    pub isr: Vec<NodeId>,
    /// ISR members (leader included) that must hold a record durably before it is committed.
    pub min_isr: u8,
    /// Membership epoch: bumped by every change of replicas or ISR.
    pub epoch: Epoch,
    /// Leader epoch: bumped by every change of leader.
    pub leader_epoch: LeaderEpoch,
    /// Set during migrations and failovers: no new appends.
    pub write_fence: Option<WriteFence>,
    /// Records at or below this seq are no longer readable (logical retention).
    pub retention_through: Seq,
}

/// Why a meta, or a change from one meta to another, was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
#[non_exhaustive]
pub enum MetaError {
    /// A node is listed twice in replicas or ISR.
    #[error("{0} is listed twice")]
    Duplicate(NodeId),
    /// An ISR member is not a replica.
    #[error("ISR member {0} is not a replica")]
    IsrNotReplica(NodeId),
    /// The leader is not in the ISR.
    #[error("leader {0} is not in the ISR")]
    LeaderNotInIsr(NodeId),
    /// `1 <= min_isr <= |ISR| <= |replicas|` does not hold.
    #[error("need 1 <= min_isr ({min_isr}) <= |ISR| ({isr}) <= |replicas| ({replicas})")]
    BadSizes {
        /// MinISR.
        min_isr: u8,
        /// ISR size.
        isr: usize,
        /// Replica count.
        replicas: usize,
    },
    /// The new meta's version is not newer.
    #[error("meta version {offered} is not newer than {current}")]
    StaleVersion {
        /// Offered version.
        offered: u64,
        /// Current version.
        current: u64,
    },
    /// An epoch or leader epoch went backwards.
    #[error("epochs went backwards: ({offered_epoch}, {offered_leader_epoch}) after ({epoch}, {leader_epoch})")]
    EpochRegression {
        /// Offered epoch.
        offered_epoch: Epoch,
        /// Offered leader epoch.
        offered_leader_epoch: LeaderEpoch,
        /// Current epoch.
        epoch: Epoch,
        /// Current leader epoch.
        leader_epoch: LeaderEpoch,
    },
    /// The leader changed without a new leader epoch.
    #[error("leader changed from {from} to {to} without a new leader epoch")]
    LeaderChangeWithoutEpoch {
        /// Old leader.
        from: NodeId,
        /// New leader.
        to: NodeId,
    },
    /// Replicas or ISR changed without a new epoch.
    #[error("membership changed without a new epoch")]
    MembershipChangeWithoutEpoch,
    /// The retention boundary went backwards.
    #[error("retention went back from {from} to {to}")]
    RetentionRegression {
        /// Current boundary.
        from: Seq,
        /// Offered boundary.
        to: Seq,
    },
    /// The meta is for another channel.
    #[error("meta is for another channel")]
    WrongChannel,
}

impl ChannelRuntimeMeta {
    /// Checks the meta on its own.
    pub fn validate(&self) -> Result<(), MetaError> {
        let mut seen = BTreeSet::new();
        for node in &self.replicas {
            if !seen.insert(*node) {
                return Err(MetaError::Duplicate(*node));
            }
        }
        let mut in_isr = BTreeSet::new();
        for node in &self.isr {
            if !in_isr.insert(*node) {
                return Err(MetaError::Duplicate(*node));
            }
            if !seen.contains(node) {
                return Err(MetaError::IsrNotReplica(*node));
            }
        }
        let sizes_ok =
            self.min_isr >= 1 && usize::from(self.min_isr) <= self.isr.len() && self.isr.len() <= self.replicas.len();
        if !sizes_ok {
            return Err(MetaError::BadSizes {
                min_isr: self.min_isr,
                isr: self.isr.len(),
                replicas: self.replicas.len(),
            });
        }
        if !in_isr.contains(&self.leader) {
            return Err(MetaError::LeaderNotInIsr(self.leader));
        }
        Ok(())
    }

    /// Checks that `next` is a valid successor of this meta (and valid on its own).
    pub fn check_successor(&self, next: &ChannelRuntimeMeta) -> Result<(), MetaError> {
        next.validate()?;
        if next.channel != self.channel {
            return Err(MetaError::WrongChannel);
        }
        if next.version <= self.version {
            return Err(MetaError::StaleVersion { offered: next.version, current: self.version });
        }
        if next.epoch < self.epoch || next.leader_epoch < self.leader_epoch {
            return Err(MetaError::EpochRegression {
                offered_epoch: next.epoch,
                offered_leader_epoch: next.leader_epoch,
                epoch: self.epoch,
                leader_epoch: self.leader_epoch,
            });
        }
        if next.leader != self.leader && next.leader_epoch == self.leader_epoch {
            return Err(MetaError::LeaderChangeWithoutEpoch { from: self.leader, to: next.leader });
        }
        let same_members = sorted(&next.replicas) == sorted(&self.replicas) && sorted(&next.isr) == sorted(&self.isr);
        if !same_members && next.epoch == self.epoch {
            return Err(MetaError::MembershipChangeWithoutEpoch);
        }
        if next.retention_through < self.retention_through {
            return Err(MetaError::RetentionRegression { from: self.retention_through, to: next.retention_through });
        }
        Ok(())
    }

    /// Replicas that are not in the ISR: they replicate but never count and never lead.
    pub fn learners(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.replicas.iter().copied().filter(|n| !self.isr.contains(n))
    }

    /// `true` if `node` is in the ISR.
    pub fn in_isr(&self, node: NodeId) -> bool {
        self.isr.contains(&node)
    }

    /// `true` if `node` keeps a copy of the log.
    pub fn is_replica(&self, node: NodeId) -> bool {
        self.replicas.contains(&node)
    }
}

fn sorted(nodes: &[NodeId]) -> Vec<NodeId> {
    let mut nodes = nodes.to_vec();
    nodes.sort_unstable();
    nodes
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ChannelType;

    fn meta() -> ChannelRuntimeMeta {
        let channel = ChannelId::new(ChannelType::GROUP, "g").unwrap();
        ChannelRuntimeMeta::created(channel, vec![NodeId::new(1), NodeId::new(2), NodeId::new(3)], 2)
    }

    #[test]
    fn validation_catches_each_rule() {
        assert_eq!(meta().validate(), Ok(()));
        let mut m = meta();
        m.replicas.push(NodeId::new(2));
        assert_eq!(m.validate(), Err(MetaError::Duplicate(NodeId::new(2))));
        let mut m = meta();
        m.isr.push(NodeId::new(9));
        assert_eq!(m.validate(), Err(MetaError::IsrNotReplica(NodeId::new(9))));
        let mut m = meta();
        m.min_isr = 4;
        assert!(matches!(m.validate(), Err(MetaError::BadSizes { .. })));
        let mut m = meta();
        m.min_isr = 0;
        assert!(matches!(m.validate(), Err(MetaError::BadSizes { .. })));
        let mut m = meta();
        m.isr = vec![NodeId::new(2), NodeId::new(3)];
        assert_eq!(m.validate(), Err(MetaError::LeaderNotInIsr(NodeId::new(1))));
        assert_eq!(meta().learners().count(), 0);
    }

    #[test]
    fn successor_rules() {
        let old = meta();
        let mut next = old.clone();
        assert!(matches!(old.check_successor(&next), Err(MetaError::StaleVersion { .. })));
        next.version = 2;
        assert_eq!(old.check_successor(&next), Ok(()));
        next.leader = NodeId::new(2);
        assert!(matches!(old.check_successor(&next), Err(MetaError::LeaderChangeWithoutEpoch { .. })));
        next.leader_epoch = LeaderEpoch::new(2);
        assert_eq!(old.check_successor(&next), Ok(()));
        next.isr = vec![NodeId::new(1), NodeId::new(2)];
        assert_eq!(old.check_successor(&next), Err(MetaError::MembershipChangeWithoutEpoch));
        next.epoch = Epoch::new(2);
        assert_eq!(old.check_successor(&next), Ok(()));
        let mut back = next.clone();
        back.version = 3;
        back.leader_epoch = LeaderEpoch::new(1);
        assert!(matches!(next.check_successor(&back), Err(MetaError::EpochRegression { .. })));
    }
}
