//! Calls on a channel's leader on their way in — appends and retention moves: routed to the local
//! leader or forwarded to the channel's leader, held while the channel's meta is fetched or its
//! replica loads, and their failures, each answered in its own terms.

use super::activation::Deferred;
use super::{remote_error, CallOrigin, ChannelShard, Forwarded, Waiting, FORWARD_SLACK, META_WAIT};
use crate::node::core::{ApiId, ApiResult};
use crate::node::error::NodeError;
use crate::node::message::{NodeMessage, RemoteAppendError};
use tidings_channel::machine::{AppendError, AppendRecord, AppendRequest, RequestId, RetentionRequest};
use tidings_types::{ChannelId, NodeId, Seq};

/// What an API call asks of a channel's leader.
#[derive(Debug)]
pub(crate) enum LeaderCall {
    /// Append `records` (`sender`, when named, was checked already).
    Append { sender: Option<String>, records: Vec<AppendRecord> },
    /// Give up the records through `through` (move the retention boundary).
    Retain { through: Seq },
}

impl LeaderCall {
    pub(super) fn kind(&self) -> CallKind {
        match self {
            LeaderCall::Append { .. } => CallKind::Append,
            LeaderCall::Retain { .. } => CallKind::Retain,
        }
    }
}

/// Which kind of call a caller waits for: its failure is answered in that call's terms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum CallKind {
    Append,
    Retain,
}

impl CallKind {
    /// The caller's answer when the call failed with `error`.
    pub(super) fn failed(self, error: NodeError) -> ApiResult {
        match self {
            CallKind::Append => ApiResult::Appended(Err(error)),
            CallKind::Retain => ApiResult::Retained(Err(error)),
        }
    }
}

impl ChannelShard {
    /// Sends `call` on to `channel`'s leader: this node's machine, or the leader's node; without the
    /// channel's meta it waits for it (in the replica's load when this node's slot replica keeps it).
    pub(super) fn route_call(&mut self, api: ApiId, channel: ChannelId, call: LeaderCall) {
        let Some(leader) = self.metas.get(&channel).map(|m| m.meta.leader) else {
            // A meta this node's slot replica keeps (one let go at eviction) comes with the replica's
            // load, off this thread; else the node fetches it.
            if self.served.serves(&channel) {
                self.activate(&channel);
            }
            if self.is_loading(&channel) {
                if let Err(Deferred::Route { api, call }) = self.park(&channel, Deferred::Route { api, call }) {
                    self.done(api, call.kind().failed(NodeError::Busy(channel)));
                }
                return;
            }
            self.wait_for_meta(api, channel, call);
            return;
        };
        if leader == self.config.node {
            self.call_locally(CallOrigin::Local(api), &channel, call);
            return;
        }
        if self.storages.refuses(leader) {
            // The leader this node knows came back on an emptied directory: it answers nothing, and a
            // forward would wait out its timeout. The channel fails over; learn the meta in force and
            // have the caller try again.
            self.fetch_meta(&channel);
            self.done(api, call.kind().failed(NodeError::Append(AppendError::NotReady)));
            return;
        }
        let forward = self.next_id();
        self.forwarded.insert(forward, Forwarded { api, kind: call.kind(), channel: channel.clone(), leader });
        // A lost forward or reply must not leave the caller waiting forever: after the leader's own
        // append timeout (plus slack for the round trip) the caller gets `Aborted(Timeout)`, outcome
        // unknown, and retries (an append with the same idempotency keys).
        let deadline = self.now + self.config.machine.append_timeout + FORWARD_SLACK;
        self.forward_deadlines.push_back((deadline, forward));
        let message = match call {
            LeaderCall::Append { sender, records } => {
                let records = records.into_iter().map(|r| (r.idempotency_key, r.payload)).collect();
                NodeMessage::AppendForward { id: forward, channel, sender, records }
            }
            LeaderCall::Retain { through } => NodeMessage::RetentionForward { id: forward, channel, through },
        };
        self.send_node(leader, message);
    }

    /// The leader a call was forwarded to says it does not lead `channel` (by its meta, it is not the
    /// leader or holds no replica): the meta that named it here is stale, or its own is. Routed by the
    /// same meta, every later call went to the same node and was refused the same way until something
    /// else refreshed the meta — for a node that neither holds a replica nor serves the channel's slot
    /// group, nothing did (pushes go to replicas). A meta the shard needs for nothing else is let go,
    /// so the next call waits for the one in force (one fetch for all the calls that wait); an active
    /// replica's is fetched again. Unless a newer meta came meanwhile (it names another leader).
    pub(super) fn forget_route(&mut self, channel: &ChannelId, refused_by: NodeId) {
        if self.metas.get(channel).is_none_or(|known| known.meta.leader != refused_by) {
            return;
        }
        if self.uses_meta(channel) {
            self.fetch_meta(channel);
        } else {
            self.metas.remove(channel);
            tidings_channel::reactor::shrink_if_sparse(&mut self.metas);
        }
    }

    /// A call forwarded here, its sender's meta naming this node leader, to a node whose meta does not
    /// even name it a replica: one of the two metas is stale, and this side asks for the one in force
    /// (were it this side's, the sender would be refused again after it fetched its own). A replica
    /// that is not the leader asks nothing: a transfer's forwards reach the old leader by the dozen,
    /// and a replica's stale meta is found out by its channel's own messages (their leader epochs).
    pub(super) fn doubt_meta_unless_replica(&mut self, channel: &ChannelId) {
        let me = self.config.node;
        if self.metas.get(channel).is_none_or(|known| !known.meta.is_replica(me)) {
            self.fetch_meta(channel);
        }
    }

    /// Holds `call` (bounded per channel) until the channel's meta arrives, fetching it.
    pub(super) fn wait_for_meta(&mut self, api: ApiId, channel: ChannelId, call: LeaderCall) {
        let queue = self.waiting.entry(channel.clone()).or_default();
        if queue.len() >= self.config.waiting_appends_max {
            self.done(api, call.kind().failed(NodeError::Busy(channel)));
            return;
        }
        let first = queue.is_empty();
        queue.push(Waiting { api, call, deadline: self.now + META_WAIT });
        if first {
            self.fetch_meta(&channel);
        }
    }

    /// Fails the calls waiting for `channel`'s meta that `expired` selects, with `error` (the channel
    /// does not exist, or its meta did not come in time).
    pub(super) fn fail_waiting(
        &mut self,
        channel: &ChannelId,
        expired: impl Fn(&Waiting) -> bool,
        error: impl Fn(ChannelId) -> NodeError,
    ) {
        let Some(queue) = self.waiting.remove(channel) else { return };
        let (failed, kept): (Vec<Waiting>, Vec<Waiting>) = queue.into_iter().partition(|w| expired(w));
        if !kept.is_empty() {
            self.waiting.insert(channel.clone(), kept);
        }
        for waiting in failed {
            self.done(waiting.api, waiting.call.kind().failed(error(channel.clone())));
        }
    }

    /// Hands `call` to the local replica's machine (activating it first).
    pub(super) fn call_locally(&mut self, origin: CallOrigin, channel: &ChannelId, call: LeaderCall) {
        let now = self.now;
        let kind = call.kind();
        if !self.channels.contains(channel) {
            self.activate(channel);
            if self.is_loading(channel) {
                if let Err(Deferred::Call { origin, .. }) = self.park(channel, Deferred::Call { origin, call }) {
                    self.fail_call(origin, kind, RemoteAppendError::Refused(AppendError::Busy));
                }
                return;
            }
        }
        // A busy leader asked to leave for a leader refused room settles only once appends stop
        // coming; the caller retries, as the refused leader's callers do (`ask_a_leader_to_leave`).
        if matches!(call, LeaderCall::Append { .. }) && self.is_leaving_for_room(channel) {
            self.fail_call(origin, kind, RemoteAppendError::TooManyChannels);
            return;
        }
        let request = self.next_id();
        let Some(machine) = self.channels.get_used(channel, now) else {
            let full = self.loading_full();
            let error = if full { RemoteAppendError::TooManyChannels } else { RemoteAppendError::NotReplica };
            self.fail_call(origin, kind, error);
            return;
        };
        let admitted = match call {
            LeaderCall::Append { sender, records } => {
                let admitted = machine.handle_append(now, AppendRequest { id: RequestId(request), records });
                if admitted.is_ok() {
                    self.appends.insert(request, (origin, sender));
                }
                admitted
            }
            LeaderCall::Retain { through } => {
                let admitted = machine.handle_retention(now, RetentionRequest { id: RequestId(request), through });
                if admitted.is_ok() {
                    self.retentions.insert(request, origin);
                }
                admitted
            }
        };
        if let Err(error) = admitted {
            self.fail_call(origin, kind, RemoteAppendError::Refused(error));
        }
    }

    /// Answers a call that failed with `error`: to the local caller, or to the node that forwarded it.
    pub(super) fn fail_call(&mut self, origin: CallOrigin, kind: CallKind, error: RemoteAppendError) {
        let outcome = match kind {
            CallKind::Append => CallOutcome::Appended(Err(error)),
            CallKind::Retain => CallOutcome::Retained(Err(error)),
        };
        self.answer(origin, outcome);
    }

    /// Gives a call's outcome to whoever waits for it: the local caller, or the node that forwarded it.
    pub(super) fn answer(&mut self, origin: CallOrigin, outcome: CallOutcome) {
        match origin {
            CallOrigin::Local(api) => self.done(api, outcome.into_api_result()),
            CallOrigin::Remote { node, id } => {
                let reply = match outcome {
                    CallOutcome::Appended(result) => NodeMessage::AppendReply { id, result },
                    CallOutcome::Retained(result) => NodeMessage::RetentionReply { id, result },
                };
                self.send_node(node, reply);
            }
        }
    }
}

/// A leader call's outcome in its own terms, as the leader's node sends it back.
#[derive(Debug)]
pub(crate) enum CallOutcome {
    /// An append's seqs, or why not.
    Appended(Result<Vec<Seq>, RemoteAppendError>),
    /// The retention boundary in force, or why not.
    Retained(Result<Seq, RemoteAppendError>),
}

impl CallOutcome {
    /// `true` when the node the call went to does not lead the channel by its meta.
    pub(super) fn says_not_leading(&self) -> bool {
        let error = match self {
            CallOutcome::Appended(Err(error)) => error,
            CallOutcome::Retained(Err(error)) => error,
            _ => return false,
        };
        matches!(error, RemoteAppendError::NotReplica | RemoteAppendError::Refused(AppendError::NotLeader { .. }))
    }

    /// What the caller gets.
    pub(super) fn into_api_result(self) -> ApiResult {
        match self {
            CallOutcome::Appended(result) => ApiResult::Appended(result.map_err(remote_error)),
            CallOutcome::Retained(result) => ApiResult::Retained(result.map_err(remote_error)),
        }
    }
}
