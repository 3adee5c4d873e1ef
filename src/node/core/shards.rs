//! The core's side of its channel shards: feeding them (inline, or queued for a runtime that runs each
//! on a reactor thread), taking their outputs, and telling them metas and what this node serves.

use super::metadata::ProposalPurpose;
use super::NodeCore;
use crate::node::error::NodeError;
use crate::node::message::NodeMessage;
use crate::node::shard::{shard_of, ChannelShard, Served, ShardInput, ShardOutput};
use std::collections::VecDeque;
use std::sync::Arc;
use tidings_channel::machine::ChannelMessage;
use tidings_types::{ChannelId, ChannelRuntimeMeta, NodeId, Time};

/// Where a node's channel shards run.
pub(super) enum Shards {
    /// Driven by the core itself, in index order (the simulator, tests, hosts without threads).
    Inline(Vec<ChannelShard>),
    /// Taken out by a runtime that runs each on its own thread: their inputs wait in `inputs` for it.
    Detached { count: usize, inputs: VecDeque<(usize, ShardInput)> },
}

impl Shards {
    pub(super) fn count(&self) -> usize {
        match self {
            Shards::Inline(shards) => shards.len(),
            Shards::Detached { count, .. } => *count,
        }
    }
}

impl NodeCore {
    /// Number of channel replicas active in memory (0 once the shards are detached).
    pub fn active_channels(&self) -> usize {
        match &self.shards {
            Shards::Inline(shards) => shards.iter().map(ChannelShard::active_channels).sum(),
            Shards::Detached { .. } => 0,
        }
    }

    /// A clean stop (the host stops this node on purpose): every active channel replica writes now the
    /// checkpoint it would write when due — its HW, a leader's own fanout progress — so that the next
    /// start reads up to what this one knew. The writes come out as effects; [`NodeCore::written_out`]
    /// says when they have all landed. Nothing once the shards are detached: the threaded runtime asks
    /// each reactor's shard itself.
    pub fn checkpoint_for_stop(&mut self, now: Time) {
        self.advance(now);
        if let Shards::Inline(shards) = &mut self.shards {
            for shard in shards {
                shard.checkpoint_for_stop(now);
            }
        }
    }

    /// `true` when no active channel replica of the shards the core drives has anything waiting to be
    /// written (after [`NodeCore::checkpoint_for_stop`], its checkpoints have landed).
    pub fn written_out(&self) -> bool {
        match &self.shards {
            Shards::Inline(shards) => shards.iter().all(ChannelShard::written_out),
            Shards::Detached { .. } => true,
        }
    }

    /// Takes the channel shards out, for a runtime that runs each on its own thread. From then on their
    /// inputs wait in [`NodeCore::poll_shard_input`], and their outputs for the core come back through
    /// [`NodeCore::handle_shard_output`].
    pub(crate) fn detach_shards(&mut self) -> Vec<ChannelShard> {
        let count = self.shards.count();
        match std::mem::replace(&mut self.shards, Shards::Detached { count, inputs: VecDeque::new() }) {
            Shards::Inline(shards) => shards,
            Shards::Detached { count, inputs } => {
                self.shards = Shards::Detached { count, inputs };
                Vec::new()
            }
        }
    }

    /// Next input for a detached shard: its index and the input.
    pub(crate) fn poll_shard_input(&mut self) -> Option<(usize, ShardInput)> {
        match &mut self.shards {
            Shards::Inline(_) => None,
            Shards::Detached { inputs, .. } => inputs.pop_front(),
        }
    }

    /// An output of a shard for the core (not its IO, which whoever runs the shard carries out).
    pub(crate) fn handle_shard_output(&mut self, now: Time, output: ShardOutput) {
        self.advance(now);
        self.shard_output(output);
    }

    /// The shard of `channel` when the core drives its shards.
    pub(super) fn inline_shard(&mut self, channel: &ChannelId) -> Result<&mut ChannelShard, NodeError> {
        match &mut self.shards {
            Shards::Inline(shards) => {
                let index = shard_of(channel, shards.len());
                Ok(&mut shards[index])
            }
            Shards::Detached { .. } => Err(NodeError::Stopped),
        }
    }

    /// Hands `input` to the shard of `channel`.
    pub(super) fn feed_shard(&mut self, channel: &ChannelId, input: ShardInput) {
        let index = shard_of(channel, self.shards.count());
        self.feed_shard_at(index, input);
    }

    pub(super) fn feed_shard_at(&mut self, index: usize, input: ShardInput) {
        self.tell_shards_what_is_served();
        let now = self.now;
        match &mut self.shards {
            Shards::Inline(shards) => shards[index].handle(now, input),
            Shards::Detached { inputs, .. } => inputs.push_back((index, input)),
        }
    }

    /// Gives every shard the served groups and hash-slot table when they changed since they were told.
    pub(super) fn tell_shards_what_is_served(&mut self) {
        let table = self.slot.table();
        let same_table = Arc::ptr_eq(&table, &self.served.table());
        let routes_version = self.reader.routes_version();
        // Called for every shard input: compared without allocating, rebuilt only on a change.
        let fresh = || self.slot.groups().filter(|g| self.slot.leader(*g).is_some() && self.holds_applied(*g));
        if same_table
            && routes_version == self.served.routes_version()
            && self.slot.groups().eq(self.served.groups().iter().copied())
            && fresh().eq(self.served.fresh().iter().copied())
        {
            return;
        }
        let fresh = fresh().collect();
        self.served = Arc::new(Served::new(table, self.slot.groups().collect(), fresh, routes_version));
        let now = self.now;
        match &mut self.shards {
            Shards::Inline(shards) => {
                for shard in shards {
                    shard.handle(now, ShardInput::Served(Arc::clone(&self.served)));
                }
            }
            Shards::Detached { count, inputs } => {
                for index in 0..*count {
                    inputs.push_back((index, ShardInput::Served(Arc::clone(&self.served))));
                }
            }
        }
    }

    /// A channel message from a peer: to its channel's shard.
    pub(super) fn channel_message(&mut self, from: NodeId, message: ChannelMessage) {
        let channel = message.channel().clone();
        self.feed_shard(&channel, ShardInput::Message { from, message });
    }

    /// What a shard asks of the core.
    pub(super) fn shard_output(&mut self, output: ShardOutput) {
        match output {
            ShardOutput::Effect(effect) => self.effects.push_back(effect),
            ShardOutput::Committed { channel, seq, sender, again } => {
                self.fanout_planned_again += u64::from(again);
                self.fanout_waiting.push_back((channel, seq, sender));
                self.feed_fanout();
            }
            ShardOutput::FanoutHandedOver(channel) => {
                self.fanout_waiting.retain(|(waiting, ..)| *waiting != channel);
                self.fanout.cancel_channel(&channel);
                self.feed_fanout();
            }
            ShardOutput::Propose(command) => {
                // A refused proposal is retried by the machine after its proposal timeout.
                let _ = self.propose_for(&command, ProposalPurpose::Internal);
            }
            ShardOutput::FetchMeta { channel, at_least } => self.fetch_meta(&channel, at_least),
            ShardOutput::Loopback(message) => self.loopback.push_back(message),
            ShardOutput::TaskMeta { api, meta, start } => self.start_task_with(api, meta, start),
            ShardOutput::VerifySender { api, channel, sender, records } => {
                self.verify_sender(api, channel, sender, records)
            }
            ShardOutput::ConfirmStray { channel, ask } => self.confirm_stray(channel, ask),
        }
    }

    /// Asks the channel's slot group for its meta (this node's replica if it serves the group).
    pub(super) fn fetch_meta(&mut self, channel: &ChannelId, at_least: u64) {
        let group = self.slot.table().group_of_key(channel.route_key());
        if self.slot.groups().any(|g| g == group) {
            // One older than `at_least` is stale for the channel's replica here: this node's slot replica
            // lags (it has not applied the meta a controller asked this replica's evidence under).
            if let Ok(Some(meta)) = self.reader.runtime_meta(channel).map(|m| m.filter(|m| m.version >= at_least)) {
                self.learn_meta(meta, true);
                return;
            }
        }
        // A member asks the leader its replica knows. A node outside the group (or a member that knows
        // no leader) asks every node: its hints may name nodes replica moves took the group away from,
        // and only a member holding the meta answers.
        let me = self.config.node;
        match self.slot.leader(group).filter(|leader| *leader != me) {
            Some(leader) => self.send_node(leader, NodeMessage::MetaFetch(channel.clone())),
            None => {
                for node in self.config.nodes.clone().into_iter().filter(|n| *n != me) {
                    self.send_node(node, NodeMessage::MetaFetch(channel.clone()));
                }
            }
        }
    }

    /// A meta arrived (pushed, fetched or applied here): the controller sees it, and the channel's
    /// shard keeps the newest for its replica and the appends that waited for it. `stored_here`: this
    /// node's slot replica holds it (applied or read there).
    pub(super) fn learn_meta(&mut self, meta: ChannelRuntimeMeta, stored_here: bool) {
        self.controller.meta_seen(self.now, &meta);
        self.feed_shard(&meta.channel.clone(), ShardInput::Meta { meta, stored_here });
    }

    /// `true` if this node keeps a replica of the slot group owning `channel`.
    pub(super) fn serves_group_of(&self, channel: &ChannelId) -> bool {
        let group = self.slot.table().group_of_key(channel.route_key());
        self.slot.groups().any(|g| g == group)
    }
}
