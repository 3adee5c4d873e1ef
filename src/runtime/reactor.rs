//! A reactor thread: runs one channel shard. It takes the shard's inputs from its mailbox (peer channel
//! messages and metas from the core thread, API appends, reads and status from callers) and its
//! storage completions, carries out the shard's IO itself (frames, durable appends, pull reads, calls
//! that finished) and hands what only the core can do (fanout, metadata proposals, meta fetches,
//! messages to its own controller) to the core thread.
//!
//! Neither side ever blocks on the other: what does not fit in the core's inbox waits here and is
//! offered again a millisecond later, and the core does the same with a full mailbox (dropping only peer
//! channel messages, which the protocols resend).

use super::calls::{Calls, Io, Reply};
use super::core_thread::Input;
use super::handle::Completer;
use super::workers::ReadJob;
use super::{Clock, STEP_STALL_WARNING};
use crate::node::shard::{ChannelShard, ShardInput, ShardOutput, ShardStatus};
use crate::node::{ApiResult, ChannelStatus, NodeEffect, NodeError};
use crossbeam_channel::{select, Receiver, RecvTimeoutError, Sender, TrySendError};
use std::collections::VecDeque;
use std::time::{Duration, Instant};
use tidings_channel::machine::{AppendRecord, ChannelMessage, PersistToken, ReadToken};
use tidings_slot::model::Uid;
use tidings_store::message::Record;
use tidings_store::StoreError;
use tidings_types::{ChannelId, NodeId, Seq};

/// Most inputs a reactor takes before it drains the shard's outputs.
const INPUTS_PER_STEP: usize = 1024;
/// How soon outputs the core thread had no room for are offered again.
const RETRY: Duration = Duration::from_millis(1);
/// How long a stopping reactor waits for the checkpoints its replicas write at a clean stop.
const STOP_CHECKPOINT_WAIT: Duration = Duration::from_secs(2);

/// What a reactor's mailbox carries.
pub(super) enum ReactorInput {
    /// From the core thread.
    Shard(ShardInput),
    /// Channel messages of one peer frame, in order (decoded by the thread that received it).
    Messages { from: NodeId, messages: Vec<ChannelMessage> },
    /// An API append.
    Append { channel: ChannelId, sender: Option<Uid>, records: Vec<AppendRecord>, reply: Reply },
    /// An API retention move.
    Retain { channel: ChannelId, through: Seq, reply: Reply },
    /// An API read.
    Read { channel: ChannelId, from: Seq, limit: usize, reply: Completer<Vec<Record>> },
    /// An API latest-seq query.
    Latest { channel: ChannelId, reply: Completer<Seq> },
    /// The shard's part of the node's status.
    Status { after: Option<ChannelId>, limit: usize, reply: Sender<ShardStatus> },
    /// One channel replica's status.
    ChannelStatus { channel: ChannelId, reply: Sender<Option<ChannelStatus>> },
    /// The node stops.
    Stop,
}

/// A storage completion for a reactor's channels.
pub(super) enum Completion {
    /// A durable-append round's outcomes for this reactor's channels.
    Persisted(Vec<(ChannelId, PersistToken, Result<(), StoreError>)>),
    /// A pull read finished.
    ReadDone { channel: ChannelId, token: ReadToken, result: Result<Vec<Record>, StoreError> },
    /// The [`Lookup`](crate::node::Lookup)s of one step, answered.
    Answers(Vec<ShardInput>),
}

/// One reactor thread's state.
pub(super) struct Reactor {
    pub(super) shard: ChannelShard,
    pub(super) clock: Clock,
    pub(super) io: Io,
    pub(super) core: Sender<Input>,
    pub(super) calls: Calls,
    /// Outputs for the core thread that did not fit in its inbox yet.
    pub(super) for_core: Vec<ShardOutput>,
    /// Durable appends and lookups the workers' full queues did not take yet, oldest first. Bounded by
    /// the shard's replicas: a machine has one durable append in flight, and its appends meanwhile wait
    /// in its own bounded queue (full: `Busy`); a shard hands off a bounded number of loads, and a sender
    /// check's append waits in it.
    pub(super) not_taken: VecDeque<NodeEffect>,
}

impl Reactor {
    pub(super) fn run(&mut self, mailbox: &Receiver<ReactorInput>, completions: &Receiver<Completion>) {
        loop {
            let now = self.clock.now().as_millis();
            let due = self.shard.poll_timeout().map_or(100, |at| at.as_millis().saturating_sub(now)).min(100);
            let waiting = !self.for_core.is_empty() || !self.not_taken.is_empty();
            let wait = if waiting { RETRY } else { Duration::from_millis(due) };
            select! {
                recv(mailbox) -> input => match input {
                    Ok(ReactorInput::Stop) | Err(_) => return self.stop(completions),
                    Ok(input) => self.handle(input),
                },
                recv(completions) -> completion => {
                    if let Ok(completion) = completion {
                        self.complete(completion);
                    }
                }
                default(wait) => {}
            }
            // Take whatever else is queued before carrying out effects: bigger batches.
            for _ in 0..INPUTS_PER_STEP {
                let completion = completions.try_recv();
                let input = mailbox.try_recv();
                if completion.is_err() && input.is_err() {
                    break;
                }
                if let Ok(completion) = completion {
                    self.complete(completion);
                }
                match input {
                    Ok(ReactorInput::Stop) => return self.stop(completions),
                    Ok(input) => self.handle(input),
                    Err(_) => {}
                }
            }
            let busy_since = Instant::now();
            self.carry_out();
            let now = self.clock.now();
            if self.shard.poll_timeout().is_some_and(|at| at <= now) {
                self.shard.handle_tick(now);
                self.carry_out();
            }
            self.offer_to_core();
            let busy = busy_since.elapsed();
            if busy >= STEP_STALL_WARNING {
                tracing::warn!(shard = self.shard.index(), ?busy, "reactor busy in one step (storage waits?)");
            }
        }
    }

    /// A clean stop: every active replica writes its checkpoint now (`ChannelShard::checkpoint_for_stop`)
    /// and the reactor carries the writes out and takes their completions, for at most
    /// [`STOP_CHECKPOINT_WAIT`]; it then stops whether they all landed or not (a checkpoint spares the
    /// next start work, nothing more: what is committed is in the logs). Inputs from the mailbox are no
    /// longer taken.
    fn stop(&mut self, completions: &Receiver<Completion>) {
        let deadline = Instant::now() + STOP_CHECKPOINT_WAIT;
        self.shard.checkpoint_for_stop(self.clock.now());
        loop {
            self.carry_out();
            let left = deadline.saturating_duration_since(Instant::now());
            if self.shard.written_out() || left.is_zero() {
                return;
            }
            let wait = if self.not_taken.is_empty() { left } else { RETRY.min(left) };
            match completions.recv_timeout(wait) {
                Ok(completion) => self.complete(completion),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return,
            }
        }
    }

    fn handle(&mut self, input: ReactorInput) {
        let now = self.clock.now();
        match input {
            ReactorInput::Shard(input) => self.shard.handle(now, input),
            ReactorInput::Messages { from, messages } => {
                self.shard.handle_all(now, messages, ChannelMessage::channel, |message| ShardInput::Message {
                    from,
                    message,
                });
            }
            ReactorInput::Append { channel, sender, records, reply } => {
                let api = self.calls.open(reply);
                self.shard.handle(now, ShardInput::Append { api, channel, sender, records });
            }
            ReactorInput::Retain { channel, through, reply } => {
                let api = self.calls.open(reply);
                self.shard.handle(now, ShardInput::Retain { api, channel, through });
            }
            ReactorInput::Read { channel, from, limit, reply } => {
                match self.shard.plan_read(now, &channel, from, limit) {
                    // The read itself may touch storage: the reader thread carries it out.
                    Ok(plan) => self.io.api_read(ReadJob::Api(plan, reply)),
                    Err(error) => reply.complete(Err(error)),
                }
            }
            ReactorInput::Latest { channel, reply } => match self.shard.plan_latest(now, &channel) {
                Ok(plan) => match plan.known_high_watermark() {
                    Some(hw) => reply.complete(Ok(hw)),
                    // A replica not in memory: its store holds the answer, read on the reader thread.
                    None => self.io.api_read(ReadJob::Latest(plan, reply)),
                },
                Err(error) => reply.complete(Err(error)),
            },
            ReactorInput::Status { after, limit, reply } => {
                let _ = reply.send(self.shard.status(after.as_ref(), limit));
            }
            ReactorInput::ChannelStatus { channel, reply } => {
                let _ = reply.send(self.shard.channel_status(&channel));
            }
            ReactorInput::Stop => {}
        }
    }

    fn complete(&mut self, completion: Completion) {
        let now = self.clock.now();
        match completion {
            Completion::Persisted(outcomes) => {
                self.shard.handle_all(
                    now,
                    outcomes,
                    |(channel, ..)| channel,
                    |(channel, token, result)| ShardInput::Persisted { channel, token, result },
                );
            }
            Completion::ReadDone { channel, token, result } => {
                self.shard.handle(now, ShardInput::ReadDone { channel, token, result })
            }
            Completion::Answers(answers) => {
                for answer in answers {
                    self.shard.handle(now, answer);
                }
            }
        }
    }

    fn carry_out(&mut self) {
        // Durable appends the workers had no room for go first, in order: the workers never block this
        // thread, their backlog waits here (retried every millisecond) instead.
        while let Some(effect) = self.not_taken.pop_front() {
            if let Some(effect) = self.io.carry_out(effect, &mut self.calls) {
                self.not_taken.push_front(effect);
                break;
            }
        }
        // A step's loads and sender checks go to the reader thread as one job: one hop each way for all.
        let mut lookups = Vec::new();
        while let Some(output) = self.shard.poll_output() {
            match output {
                ShardOutput::Effect(effect @ NodeEffect::Persist { .. }) if !self.not_taken.is_empty() => {
                    self.not_taken.push_back(effect)
                }
                ShardOutput::Effect(NodeEffect::Lookup(lookup)) => lookups.push(lookup),
                ShardOutput::Effect(effect) => match self.io.carry_out(effect, &mut self.calls) {
                    None => {}
                    Some(effect @ NodeEffect::Persist { .. }) => self.not_taken.push_back(effect),
                    // Shards do not sync slot stores or fan out; should one ever, the core does it.
                    Some(core_only) => self.for_core.push(ShardOutput::Effect(core_only)),
                },
                for_core => self.for_core.push(for_core),
            }
        }
        // What the reader's full queue did not take waits here and is offered again, never dropped.
        let refused = self.io.hand_off(lookups);
        self.not_taken.extend(refused);
    }

    /// Hands the core thread what only it can do, in one inbox message.
    fn offer_to_core(&mut self) {
        if self.for_core.is_empty() {
            return;
        }
        let outputs = std::mem::take(&mut self.for_core);
        match self.core.try_send(Input::FromShard(outputs)) {
            Ok(()) => {}
            Err(TrySendError::Full(Input::FromShard(outputs))) => self.for_core = outputs,
            // The core thread stopped: the node is stopping.
            Err(_) => {}
        }
    }
}

/// An append's result as the API's `append_then` callback takes it.
pub(super) fn appended(result: ApiResult) -> Result<Vec<Seq>, NodeError> {
    match result {
        ApiResult::Appended(result) => result,
        ApiResult::Meta(_) | ApiResult::Task(_) | ApiResult::Retained(_) => Err(NodeError::Stopped),
    }
}

/// A retention move's result as its caller takes it.
pub(super) fn retained(result: ApiResult) -> Result<Seq, NodeError> {
    match result {
        ApiResult::Retained(result) => result,
        ApiResult::Meta(_) | ApiResult::Task(_) | ApiResult::Appended(_) => Err(NodeError::Stopped),
    }
}
