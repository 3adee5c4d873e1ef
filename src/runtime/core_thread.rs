//! The core thread: owns the `NodeCore` (slot groups, controller, routing, fanout), takes peer frames,
//! metadata calls and what the reactors hand it, carries out its effects, and passes the inputs of each
//! channel shard on to that shard's reactor.
//!
//! The IO workers answer it on a channel of their own ([`WorkerAnswer`]), never through the bounded
//! inbox: the core waits (bounded) for room in the slot-sync and fanout queues, and a worker that
//! waited in turn for room in an inbox that peers' frames keep full would close a cycle that stops both.

use super::calls::{Calls, Io, Reply};
use super::reactor::ReactorInput;
use super::{Clock, RouteKey, STEP_STALL_WARNING};
use crate::frame::FrameBody;
use crate::node::shard::{ShardInput, ShardOutput};
use crate::node::FanoutWork;
use crate::node::{FanoutAnswer, LogsListed, NodeCore, NodeEffect, NodeStatus};
use bytes::Bytes;
use crossbeam_channel::{select, Receiver, Sender, TrySendError};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tidings_slot::command::{Command, RoutingKey};
use tidings_slot::model::ChannelInfo;
use tidings_store::StoreError;
use tidings_types::{ChannelId, GroupId, HashSlot, NodeId};

/// Most inputs the core thread takes before it carries out effects.
const INPUTS_PER_STEP: usize = 1024;
/// How soon shard inputs a full mailbox did not take are offered again.
const RETRY: Duration = Duration::from_millis(1);

/// What the core thread's inbox carries.
pub(super) enum Input {
    /// A peer's frame the receiving thread could not decode (the core counts it by kind and refuses it).
    Frame { from: NodeId, bytes: Bytes },
    /// A peer's frame, decoded and checked, without channel messages (those went to the reactors).
    Decoded { from: NodeId, body: FrameBody },
    /// A metadata or controller API call.
    Call { call: Call, reply: Reply },
    /// The node's status (without its shards' part).
    Status { reply: Sender<NodeStatus> },
    /// What a reactor's shard asks of the core.
    FromShard(Vec<ShardOutput>),
    /// The node stops.
    Stop,
}

/// What an IO worker answers the core thread. The channel is unbounded and bounded by the work: each
/// answer is for one piece of work the core handed out through a bounded queue (slot syncs, fanout
/// work, the reader's jobs), and the core takes every waiting answer before its next inputs.
pub(super) enum WorkerAnswer {
    /// The slot stores are durable through this sync token.
    SlotsSynced { token: u64 },
    /// The metadata store's sync failed.
    SlotsSyncFailed(StoreError),
    /// A fanout worker's answer.
    Fanout(FanoutAnswer),
    /// The reader thread listed a page of the stray-log sweep.
    LogsListed(LogsListed),
}

/// A call the core thread runs.
pub(super) enum Call {
    Propose(Command),
    CreateChannel(ChannelInfo),
    ReadBarrier(RouteKey),
    TransferLeader { channel: ChannelId, target: NodeId },
    ReplaceReplica { channel: ChannelId, from: NodeId, to: NodeId },
    SetGroupIntent(tidings_slot::model::GroupIntent),
    MoveSlotReplica { group: GroupId, from: NodeId, to: NodeId },
    AbortSlotMove(GroupId),
    MigrateSlot { slot: HashSlot, to: GroupId },
    AbortSlotMigration(HashSlot),
    SetPreferredLeader { group: GroupId, preferred: Option<NodeId> },
    DrainNode { node: NodeId, drain: bool },
    SetLeaving(bool),
    ForgetStorageIdentity(NodeId),
}

/// The core thread's state.
pub(super) struct Shell {
    pub(super) core: NodeCore,
    pub(super) clock: Clock,
    pub(super) io: Io,
    pub(super) sync_tx: Sender<u64>,
    pub(super) fanout_tx: Sender<FanoutWork>,
    pub(super) calls: Calls,
    /// Each shard's reactor mailbox, by shard index.
    pub(super) reactors: Vec<Sender<ReactorInput>>,
    /// Shard inputs a full mailbox did not take yet, by shard index.
    pub(super) parked: Vec<VecDeque<ShardInput>>,
    /// Peer messages dropped because a mailbox was full (shared with the `Node` handle's count).
    pub(super) dropped_frames: Arc<AtomicU64>,
}

impl Shell {
    pub(super) fn run(&mut self, inputs: &Receiver<Input>, answers: &Receiver<WorkerAnswer>) {
        loop {
            let now = self.clock.now().as_millis();
            let due = self.core.poll_timeout().as_millis().saturating_sub(now).min(100);
            let parked = self.parked.iter().any(|queue| !queue.is_empty());
            let wait = if parked { RETRY } else { Duration::from_millis(due) };
            select! {
                recv(answers) -> answer => match answer {
                    Ok(answer) => self.answered(answer),
                    // Every worker is gone (they end only when their queues close, or by a panic): no
                    // sync or fanout would ever be answered again.
                    Err(_) => {
                        tracing::error!(node = %self.core.node(), "the IO workers are gone; the core stops");
                        return;
                    }
                },
                recv(inputs) -> input => match input {
                    Ok(Input::Stop) | Err(_) => return,
                    Ok(input) => self.handle(input),
                },
                default(wait) => {}
            }
            // Every waiting answer, then whatever else is queued before carrying out effects: bigger
            // batches.
            for answer in answers.try_iter() {
                self.answered(answer);
            }
            for _ in 0..INPUTS_PER_STEP {
                match inputs.try_recv() {
                    Ok(Input::Stop) => return,
                    Ok(input) => self.handle(input),
                    Err(_) => break,
                }
            }
            // Drained first: the timeout is then cheap to ask.
            let busy_since = Instant::now();
            self.carry_out();
            let now = self.clock.now();
            if self.core.poll_timeout() <= now {
                self.core.handle_tick(now);
                self.carry_out();
            }
            let busy = busy_since.elapsed();
            if busy >= STEP_STALL_WARNING {
                // Peers count a node silent for `node_down_after` (1.5 s) as down: say why it went quiet.
                tracing::warn!(node = %self.core.node(), ?busy, "core thread busy in one step (storage waits?)");
            }
        }
    }

    fn handle(&mut self, input: Input) {
        let now = self.clock.now();
        match input {
            Input::Frame { from, bytes } => {
                if let Err(error) = self.core.handle_frame(now, from, &bytes) {
                    tracing::debug!(%error, %from, "refused a frame");
                }
            }
            Input::Decoded { from, body } => self.core.handle_decoded(now, from, body),
            Input::Call { call, reply } => {
                let id = self.calls.open(reply);
                let core = &mut self.core;
                match call {
                    Call::Propose(command) => core.propose(now, id, command),
                    Call::CreateChannel(info) => core.create_channel(now, id, info),
                    Call::ReadBarrier(RouteKey::Uid(uid)) => core.read_barrier(now, id, RoutingKey::Uid(&uid)),
                    Call::ReadBarrier(RouteKey::Channel(channel)) => {
                        core.read_barrier(now, id, RoutingKey::Channel(&channel))
                    }
                    Call::TransferLeader { channel, target } => core.transfer_leader(now, id, channel, target),
                    Call::ReplaceReplica { channel, from, to } => core.replace_replica(now, id, channel, from, to),
                    Call::SetGroupIntent(intent) => core.set_group_intent(now, id, intent),
                    Call::MoveSlotReplica { group, from, to } => core.move_slot_replica(now, id, group, from, to),
                    Call::AbortSlotMove(group) => core.abort_slot_move(now, id, group),
                    Call::MigrateSlot { slot, to } => core.migrate_slot(now, id, slot, to),
                    Call::AbortSlotMigration(slot) => core.abort_slot_migration(now, id, slot),
                    Call::DrainNode { node, drain } => core.drain_node(now, id, node, drain),
                    Call::SetLeaving(leaving) => core.set_leaving(now, id, leaving),
                    Call::ForgetStorageIdentity(node) => core.forget_storage_identity(now, id, node),
                    Call::SetPreferredLeader { group, preferred } => {
                        core.set_preferred_leader(now, id, group, preferred)
                    }
                }
            }
            Input::Status { reply } => {
                let _ = reply.send(self.core.status());
            }
            Input::FromShard(outputs) => {
                for output in outputs {
                    self.core.handle_shard_output(now, output);
                }
            }
            Input::Stop => {}
        }
    }

    fn answered(&mut self, answer: WorkerAnswer) {
        let now = self.clock.now();
        match answer {
            WorkerAnswer::SlotsSynced { token } => self.core.handle_slots_synced(now, token),
            WorkerAnswer::SlotsSyncFailed(error) => self.core.handle_slots_sync_failed(now, &error),
            WorkerAnswer::Fanout(answer) => self.core.handle_fanout(now, answer),
            WorkerAnswer::LogsListed(listed) => self.core.handle_logs_listed(now, listed),
        }
    }

    fn carry_out(&mut self) {
        while let Some(effect) = self.core.poll_effect() {
            match self.io.carry_out(effect, &mut self.calls) {
                None => {}
                // Bounded wait when the worker is behind: never an unbounded queue. (The workers never
                // wait on this thread, so the wait ends.)
                Some(NodeEffect::SyncSlots { token }) => drop(self.sync_tx.send(token)),
                // The queue has room for all the work the core may have handed out (`fanout_work_max`).
                Some(NodeEffect::Fanout(work)) => drop(self.fanout_tx.send(work)),
                // A page the reader's full queue does not take is asked again later (the sweep's
                // patience): never a wait on this thread.
                Some(NodeEffect::ListLogs(page)) => drop(self.io.read_tx.try_send(super::workers::ReadJob::Logs(page))),
                // The core's shards are on the reactors: no durable append comes this way.
                Some(other) => tracing::error!(?other, "an effect the core thread does not carry out"),
            }
        }
        self.pass_on_shard_inputs();
    }

    /// Passes the core's inputs for each shard on to its reactor, after those parked earlier.
    fn pass_on_shard_inputs(&mut self) {
        for index in 0..self.parked.len() {
            while let Some(input) = self.parked[index].pop_front() {
                if let Some(input) = self.offer(index, input) {
                    self.parked[index].push_front(input);
                    break;
                }
            }
        }
        while let Some((index, input)) = self.core.poll_shard_input() {
            if !self.parked[index].is_empty() {
                self.parked[index].push_back(input);
            } else if let Some(input) = self.offer(index, input) {
                self.parked[index].push_back(input);
            }
        }
    }

    /// Offers `input` to reactor `index`; gives it back when the mailbox is full. A peer's channel
    /// message is dropped instead (the protocols resend), so only control inputs wait — few, and
    /// bounded by the protocols (one meta, handoff release or reply per change).
    fn offer(&mut self, index: usize, input: ShardInput) -> Option<ShardInput> {
        match self.reactors[index].try_send(ReactorInput::Shard(input)) {
            Ok(()) | Err(TrySendError::Disconnected(_)) => None,
            Err(TrySendError::Full(ReactorInput::Shard(ShardInput::Message { .. }))) => {
                self.dropped_frames.fetch_add(1, Ordering::Relaxed);
                None
            }
            Err(TrySendError::Full(ReactorInput::Shard(input))) => Some(input),
            Err(TrySendError::Full(_)) => None,
        }
    }
}
