//! Cluster and node configuration, and the deterministic placement derived from it.

use super::controller::ControllerConfig;
use super::core::StrayLogConfig;
use super::rendezvous;
use std::collections::BTreeSet;
use std::time::Duration;
use tidings_channel::fanout::FanoutConfig;
use tidings_channel::machine::MachineConfig;
use tidings_router::HashToSlot;
use tidings_slot::raft::MultiRaftConfig;
use tidings_types::{ChannelId, GroupId, NodeId};

/// Everything a node needs to join a cluster. Every node of a cluster must be given the same cluster
/// description (`cluster`, `founders`, `slot_groups`, `slot_replicas`, and `nodes` but while a node is
/// being added or removed), and should be given the same
/// `channel_replicas`: a slot group's leader brings the channels of its slots back to its own value
/// (a node configured with more would create channels the others shrink again).
#[derive(Clone, Debug)]
pub struct NodeConfig {
    /// This node.
    pub node: NodeId,
    /// Identifies the cluster; frames of other clusters are refused.
    pub cluster: u64,
    /// Every node of the cluster, this one included: frames from any other node are refused, and new
    /// channels, drains and repairs place replicas on these. May change from one start of the nodes to
    /// the next, to add or remove nodes (`docs/operations.md`, "Adding and removing nodes").
    pub nodes: Vec<NodeId>,
    /// The nodes the cluster was first started with: each slot group's first members are drawn from
    /// them ([`NodeConfig::slot_group_members`]). Never changes once the cluster has started, whatever
    /// nodes are added or removed later: a node added later is no founder, so it creates no slot-group
    /// replica of its own (it gets replicas moved to it), and a founder removed stays one. Defaults to
    /// `nodes` in [`NodeConfig::new`].
    pub founders: Vec<NodeId>,
    /// This node starts into a cluster that is already running: it creates no slot-group replica of its
    /// own, founder or not, and holds only what is on its disk and what moves to it. Set it for a node
    /// added to the cluster, and for a node started again on an empty directory after its drain (see
    /// `docs/operations.md`): on an empty directory a founder would otherwise make the first replicas
    /// again, and two such founders would be a quorum of a made-up first configuration. Harmless on a
    /// node's own directory (what it holds opens from disk), so it may stay set once the cluster has
    /// first started. Default `false`: the first start of a new cluster needs its founders to make the
    /// first replicas.
    pub join_existing: bool,
    /// Number of slot groups the 256 hash slots are split into (contiguously).
    pub slot_groups: u32,
    /// Replicas (raft voters) per slot group.
    pub slot_replicas: usize,
    /// Replicas per new channel: the channels' replication factor. A healthy channel holding more (a
    /// replacement that did not finish left one behind) gives the surplus up, one replica per
    /// `ControllerConfig::catch_up_timeout`, so lowering this setting shrinks existing channels too
    /// (not below their MinISR); raising it does not add replicas to them.
    pub channel_replicas: usize,
    /// MinISR of new channels.
    pub channel_min_isr: u8,
    /// Seed of every random choice (elections). Mixed with the node id, so nodes may share it.
    pub seed: u64,
    /// Slot-layer raft settings and limits (tick, election, proposal and read bounds, apply batches,
    /// snapshot chunks and reassembly, compaction, FSM limits). Its `node`, `seed` and `boot_id` are
    /// taken from this configuration.
    pub raft: MultiRaftConfig,
    /// Channel replica machine limits and timings.
    pub machine: MachineConfig,
    /// Largest inbound frame body, in bytes.
    pub frame_bytes_max: usize,
    /// Calls (appends, retention moves) waiting for a channel's meta to arrive, or for its replica to load,
    /// per channel.
    pub waiting_appends_max: usize,
    /// Most records one API read ([`crate::Node::read`]) returns, whatever limit the caller asks;
    /// page on from the last seq returned. Default 1,000.
    pub read_records_max: usize,
    /// Most record bytes one API read returns (at least one record when any is committed from where it
    /// starts). Default 1 MiB.
    pub read_bytes_max: usize,
    /// A channel replica idle (no input) this long and quiescent is evicted from memory; its log stays.
    /// Default 30 s.
    pub channel_idle_evict: Duration,
    /// Most channel replicas active in memory; at the cap the least recently used quiescent one is
    /// evicted (else the least recently used follower whose state is all on disk), and with none the
    /// activation is refused (`TooManyChannels`). Leaders take at most seven eighths of each shard's
    /// part: the rest is kept for followers, so leaders that wait for their followers (and cannot be
    /// evicted) never fill every node's room while those followers have none; a leader whose only work
    /// left is its fanout waits for no follower and is not counted in that share. A follower named leader
    /// while active (a failover or transfer to this node) keeps its place, so leaders may hold more than
    /// their share; while they hold the followers' places, followers are let in past the cap, by at
    /// most that eighth (at least one place): a shard holds at most its part plus an eighth of it.
    /// Each shard keeps room for at least 2. Default 100,000.
    pub active_channels_max: usize,
    /// Post-commit fanout limits.
    pub fanout: FanoutConfig,
    /// Fan committed messages out to online subscribers (off for a host without sessions).
    pub fanout_enabled: bool,
    /// Distinguishes this start of the node from its earlier ones: request ids that cross the network
    /// (forwarded appends, channel replicas' pulls) carry it, so a reply addressed to an earlier start
    /// is never taken for a new request. `Node::start` sets it from the wall clock; a host driving `NodeCore` itself must give
    /// each start a different value (low 32 bits). Default 0.
    pub boot_id: u64,
    /// Channel controller: failure detection, failovers, leader transfers, repair loop.
    pub controller: ControllerConfig,
    /// The sweep that finds and forgets the logs of channel replicas moved off this node.
    pub stray_logs: StrayLogConfig,
    /// Channel reactors: the node's channels are split over this many shards by the hash slot of their
    /// id, and the threaded runtime runs each shard on its own thread (the simulator runs them in turn).
    /// Each shard keeps its part of `active_channels_max`. At most 256. `0` (the default) lets the
    /// threaded runtime choose: one reactor per two cores the process may use, between 1 and 16 (the
    /// node's IO workers and the host need the rest); a `NodeCore` driven directly then runs 1.
    pub reactors: usize,
    /// Most channel replicas a status lists (`NodeStatus::channels`, in channel order; the rest page
    /// through `Node::channel_statuses`), and most a page of `channel_statuses` holds. Each listed
    /// replica is built on its reactor while its channels wait: listing 100,000 at once would stall
    /// them for tens of milliseconds. Default 1,000.
    pub status_channels_max: usize,
    /// Capacity of the threaded runtime's core-thread inbox (peers' slot and node frames, metadata and
    /// operator calls, what the reactors hand the core). Full: inbound frames are dropped and counted
    /// (`Node::dropped_frames`; raft and the other protocols resend) and API calls get
    /// `NodeError::Overloaded`. Between 1 and [`QUEUE_CAPACITY_MAX`]; the runtime sets the whole ring
    /// aside at start. Default 65,536.
    pub inbox_max: usize,
    /// Capacity of each reactor's mailbox (API appends, reads and `latest`, peers' channel messages,
    /// the core's inputs for the shard). Full: peers' channel messages are dropped and counted, API
    /// calls get `NodeError::Overloaded`, and the core's inputs wait on the core thread and are offered
    /// again. Between 1 and [`QUEUE_CAPACITY_MAX`]. Default 65,536.
    pub mailbox_max: usize,
}

/// Largest `NodeConfig::inbox_max` and `mailbox_max`: 16 Mi places.
pub const QUEUE_CAPACITY_MAX: usize = 1 << 24;

impl NodeConfig {
    /// A configuration for `node` in a cluster of `nodes`, with defaults: 8 slot groups of up to 3
    /// replicas, channels of up to 3 replicas with MinISR 2 (1 and 1 on a single node).
    pub fn new(node: NodeId, nodes: Vec<NodeId>) -> Self {
        let replicas = nodes.len().min(3);
        Self {
            node,
            cluster: 1,
            slot_groups: 8,
            slot_replicas: replicas,
            channel_replicas: replicas,
            channel_min_isr: if replicas >= 3 { 2 } else { 1 },
            seed: node.get(),
            raft: MultiRaftConfig::new(node),
            machine: MachineConfig::default(),
            frame_bytes_max: 16 << 20,
            waiting_appends_max: 1024,
            read_records_max: 1000,
            read_bytes_max: 1 << 20,
            channel_idle_evict: Duration::from_secs(30),
            active_channels_max: 100_000,
            fanout: FanoutConfig::default(),
            fanout_enabled: true,
            boot_id: 0,
            controller: ControllerConfig::default(),
            stray_logs: StrayLogConfig::default(),
            reactors: 0,
            status_channels_max: 1000,
            inbox_max: 65_536,
            mailbox_max: 65_536,
            founders: nodes.clone(),
            join_existing: false,
            nodes,
        }
    }

    /// Checks the configuration.
    pub fn validate(&self) -> Result<(), &'static str> {
        if !self.nodes.contains(&self.node) {
            return Err("this node is not among the cluster's nodes");
        }
        if self.nodes.iter().any(|n| n.get() == 0) {
            return Err("node id 0 is reserved");
        }
        if self.founders.iter().any(|n| n.get() == 0) {
            return Err("node id 0 is reserved");
        }
        if self.slot_replicas == 0 || self.slot_replicas > self.founders.iter().collect::<BTreeSet<_>>().len() {
            return Err("slot_replicas must be between 1 and the number of founders");
        }
        if self.channel_replicas == 0 || self.channel_replicas > self.nodes.len() {
            return Err("channel_replicas must be between 1 and the number of nodes");
        }
        if self.channel_min_isr == 0 || usize::from(self.channel_min_isr) > self.channel_replicas {
            return Err("channel_min_isr must be between 1 and channel_replicas");
        }
        if self.active_channels_max == 0 || self.waiting_appends_max == 0 || self.frame_bytes_max == 0 {
            return Err("active_channels_max, waiting_appends_max and frame_bytes_max must be positive");
        }
        if self.read_records_max == 0 || self.read_bytes_max == 0 {
            return Err("read_records_max and read_bytes_max must be positive");
        }
        if !(1..=QUEUE_CAPACITY_MAX).contains(&self.inbox_max) || !(1..=QUEUE_CAPACITY_MAX).contains(&self.mailbox_max)
        {
            return Err("inbox_max and mailbox_max must be between 1 and 16,777,216");
        }
        if self.reactors > super::shard::SHARDS_MAX {
            return Err("reactors must be at most 256");
        }
        HashToSlot::even_split(self.slot_groups).map_err(|_| "slot_groups must be between 1 and 256")?;
        self.stray_logs.validate()?;
        self.machine.validate()
    }

    /// The number of channel shards `reactors` asks for, `auto` standing in for the default (`0`).
    pub fn reactors_or(&self, auto: usize) -> usize {
        match self.reactors {
            0 => auto.clamp(1, 16),
            fixed => fixed.min(super::shard::SHARDS_MAX),
        }
    }

    /// The initial slot → group table.
    pub fn table(&self) -> HashToSlot {
        // Cannot fail: validated.
        HashToSlot::even_split(self.slot_groups).expect("slot_groups validated")
    }

    /// First members of every slot group, when the cluster starts: `slot_replicas` consecutive founders
    /// (sorted by id, duplicates ignored), starting at a rotating offset so leaders spread. Members
    /// change afterwards only through raft (slot-replica moves, drains); a node creates at start the
    /// replicas this names it in that it never held nor left, unless it joins a running cluster
    /// ([`NodeConfig::join_existing`]).
    pub fn slot_group_members(&self) -> Vec<(GroupId, Vec<NodeId>)> {
        let mut nodes = self.founders.clone();
        nodes.sort_unstable();
        nodes.dedup();
        self.table()
            .groups()
            .map(|group| {
                let start = usize::try_from(group.get() - 1).unwrap_or(0) % nodes.len();
                let members = (0..self.slot_replicas).map(|i| nodes[(start + i) % nodes.len()]).collect();
                (group, members)
            })
            .collect()
    }

    /// Replicas of a new channel, first one leading: the nodes with the highest rendezvous hash of
    /// (channel, node), so placement is stable and each node leads and holds an even share of the
    /// channels. When a node creates a channel while it holds some nodes down or knows they are being
    /// drained, those go to the end of this ranking (see [`NodeCore::create_channel`](crate::node::NodeCore::create_channel)).
    pub fn channel_placement(&self, channel: &ChannelId) -> Vec<NodeId> {
        self.channel_placement_avoiding(channel, &BTreeSet::new())
    }

    /// [`NodeConfig::channel_placement`] with the nodes in `avoided` (down or being drained) moved to the
    /// end of the ranking: they hold a replica only when too few other nodes are left, and lead only
    /// when no other node is left. With nothing avoided, the two are the same placement.
    pub(crate) fn channel_placement_avoiding(&self, channel: &ChannelId, avoided: &BTreeSet<NodeId>) -> Vec<NodeId> {
        let mut key = Vec::new();
        channel.encode_key(&mut key);
        let ranked = rendezvous::ranked(&key, self.nodes.iter().copied());
        let (preferred, fallback): (Vec<NodeId>, Vec<NodeId>) = ranked.into_iter().partition(|n| !avoided.contains(n));
        preferred.into_iter().chain(fallback).take(self.channel_replicas).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn avoided_nodes_go_last_in_a_placement_and_nothing_avoided_changes_nothing() {
        let ids: Vec<NodeId> = (1..=5).map(NodeId::new).collect();
        let config = NodeConfig::new(ids[0], ids.clone());
        for i in 0..200 {
            let channel = ChannelId::new(tidings_types::ChannelType::GROUP, &format!("room-{i}")).expect("id");
            let preferred = config.channel_placement(&channel);
            assert_eq!(preferred.len(), config.channel_replicas);
            assert_eq!(config.channel_placement_avoiding(&channel, &BTreeSet::new()), preferred);
            // The preferred leader down: the others move up in order and the next ranked node joins.
            let avoided: BTreeSet<NodeId> = [preferred[0]].into();
            let placed = config.channel_placement_avoiding(&channel, &avoided);
            assert_eq!(placed[..placed.len() - 1], preferred[1..], "{channel}: the rest keep their order");
            assert!(!placed.contains(&preferred[0]), "{channel}: enough other nodes, so none on the avoided one");
            // Three of five avoided: only two others remain, so one avoided node fills the third place.
            let avoided: BTreeSet<NodeId> = ids[..3].iter().copied().collect();
            let placed = config.channel_placement_avoiding(&channel, &avoided);
            assert_eq!(placed.len(), 3);
            assert!(placed[..2].iter().all(|n| !avoided.contains(n)), "{channel}: the live nodes lead and follow");
            assert!(avoided.contains(&placed[2]));
        }
    }

    #[test]
    fn slot_groups_start_on_the_founders_whatever_nodes_come_and_go() {
        let founders: Vec<NodeId> = (1..=3).map(NodeId::new).collect();
        let founded = NodeConfig { slot_groups: 4, ..NodeConfig::new(founders[0], founders.clone()) };
        assert_eq!(founded.founders, founders, "`new` takes the nodes as the founders");
        // Two nodes added, one founder gone: the first members stay what they were.
        let grown = NodeConfig {
            founders: founders.clone(),
            slot_groups: 4,
            ..NodeConfig::new(NodeId::new(2), (2..=5).map(NodeId::new).collect())
        };
        assert_eq!(grown.slot_group_members(), founded.slot_group_members());
        assert!(grown.validate().is_ok());
        // Duplicates count once: three distinct founders cannot start groups of four.
        let doubled = NodeConfig {
            founders: [1, 2, 3, 3].map(NodeId::new).to_vec(),
            slot_replicas: 4,
            ..NodeConfig::new(NodeId::new(1), (1..=4).map(NodeId::new).collect())
        };
        assert!(doubled.validate().is_err());
        let none = NodeConfig { founders: Vec::new(), ..founded.clone() };
        assert!(none.validate().is_err());
    }

    /// Each rule refuses the configuration that breaks it, with the rule's own message, and the default
    /// passes them all.
    #[test]
    fn each_rule_refuses_the_configuration_that_breaks_it_with_its_own_reason() {
        let ids: Vec<NodeId> = (1..=3).map(NodeId::new).collect();
        let base = NodeConfig::new(ids[0], ids.clone());
        assert_eq!(base.validate(), Ok(()));
        type Breaks = fn(&mut NodeConfig);
        let broken: [(Breaks, &str); 14] = [
            (|c| c.node = NodeId::new(9), "this node is not among the cluster's nodes"),
            (|c| c.nodes.push(NodeId::new(0)), "node id 0 is reserved"),
            (|c| c.founders.push(NodeId::new(0)), "node id 0 is reserved"),
            (|c| c.slot_replicas = 0, "slot_replicas must be between 1 and the number of founders"),
            (|c| c.channel_replicas = 4, "channel_replicas must be between 1 and the number of nodes"),
            (|c| c.channel_min_isr = 4, "channel_min_isr must be between 1 and channel_replicas"),
            (|c| c.channel_min_isr = 0, "channel_min_isr must be between 1 and channel_replicas"),
            (
                |c| c.waiting_appends_max = 0,
                "active_channels_max, waiting_appends_max and frame_bytes_max must be positive",
            ),
            (|c| c.read_bytes_max = 0, "read_records_max and read_bytes_max must be positive"),
            (|c| c.slot_groups = 0, "slot_groups must be between 1 and 256"),
            (|c| c.slot_groups = 257, "slot_groups must be between 1 and 256"),
            (|c| c.inbox_max = 0, "inbox_max and mailbox_max must be between 1 and 16,777,216"),
            (|c| c.mailbox_max = 0, "inbox_max and mailbox_max must be between 1 and 16,777,216"),
            (|c| c.mailbox_max = QUEUE_CAPACITY_MAX + 1, "inbox_max and mailbox_max must be between 1 and 16,777,216"),
        ];
        for (breaks, reason) in broken {
            let mut config = base.clone();
            breaks(&mut config);
            assert_eq!(config.validate(), Err(reason));
        }
    }

    #[test]
    fn reactors_default_to_the_runtime_choice_and_are_bounded() {
        let ids: Vec<NodeId> = (1..=3).map(NodeId::new).collect();
        let mut config = NodeConfig::new(ids[0], ids.clone());
        assert_eq!(config.reactors, 0, "the default leaves the choice to the runtime");
        assert_eq!(config.reactors_or(0), 1, "at least one");
        assert_eq!(config.reactors_or(6), 6);
        assert_eq!(config.reactors_or(64), 16, "auto stays at most 16");
        config.reactors = 40;
        assert_eq!(config.reactors_or(2), 40, "a fixed count is kept");
        assert!(config.validate().is_ok());
        config.reactors = 257;
        assert!(config.validate().is_err());
    }
}
