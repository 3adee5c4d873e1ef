//! Appends on their way in: routed to the local leader or forwarded to the channel's leader, held
//! while the channel's meta is fetched, and their failures.

use super::activation::Deferred;
use super::{remote_error, AppendOrigin, ChannelShard, Waiting, FORWARD_SLACK, META_WAIT};
use crate::node::core::{ApiId, ApiResult};
use crate::node::error::NodeError;
use crate::node::message::{NodeMessage, RemoteAppendError};
use tidings_channel::machine::{AppendError, AppendRecord, AppendRequest, RequestId};
use tidings_types::ChannelId;

impl ChannelShard {
    pub(super) fn route_append(
        &mut self,
        api: ApiId,
        channel: ChannelId,
        sender: Option<String>,
        records: Vec<AppendRecord>,
    ) {
        let Some(leader) = self.metas.get(&channel).map(|m| m.meta.leader) else {
            // A meta this node's slot replica keeps (one let go at eviction) comes with the replica's
            // load, off this thread; else the node fetches it.
            if self.served.serves(&channel) {
                self.activate(&channel);
            }
            if self.is_loading(&channel) {
                if let Err(Deferred::Route { api, .. }) = self.park(&channel, Deferred::Route { api, sender, records })
                {
                    self.done(api, ApiResult::Appended(Err(NodeError::Busy(channel))));
                }
                return;
            }
            self.wait_for_meta(api, channel, sender, records);
            return;
        };
        if leader == self.config.node {
            self.append_locally(AppendOrigin::Local(api), &channel, sender, records);
        } else {
            let forward = self.next_id();
            self.forwarded.insert(forward, (api, channel.clone(), leader));
            // A lost forward or reply must not leave the caller waiting forever: after the leader's own
            // append timeout (plus slack for the round trip) the caller gets `Aborted(Timeout)`, outcome
            // unknown, and retries with the same idempotency keys.
            let deadline = self.now + self.config.machine.append_timeout + FORWARD_SLACK;
            self.forward_deadlines.push_back((deadline, forward));
            let records = records.into_iter().map(|r| (r.idempotency_key, r.payload)).collect();
            self.send_node(leader, NodeMessage::AppendForward { id: forward, channel, sender, records });
        }
    }

    pub(super) fn wait_for_meta(
        &mut self,
        api: ApiId,
        channel: ChannelId,
        sender: Option<String>,
        records: Vec<AppendRecord>,
    ) {
        let queue = self.waiting.entry(channel.clone()).or_default();
        if queue.len() >= self.config.waiting_appends_max {
            self.done(api, ApiResult::Appended(Err(NodeError::Busy(channel))));
            return;
        }
        let first = queue.is_empty();
        queue.push(Waiting { api, sender, records, deadline: self.now + META_WAIT });
        if first {
            self.fetch_meta(&channel);
        }
    }

    /// Fails the appends waiting for `channel`'s meta that `expired` selects.
    pub(super) fn fail_waiting(&mut self, channel: &ChannelId, expired: impl Fn(&Waiting) -> bool) {
        let Some(queue) = self.waiting.remove(channel) else { return };
        let (failed, kept): (Vec<Waiting>, Vec<Waiting>) = queue.into_iter().partition(|w| expired(w));
        if !kept.is_empty() {
            self.waiting.insert(channel.clone(), kept);
        }
        for waiting in failed {
            self.done(waiting.api, ApiResult::Appended(Err(NodeError::UnknownChannel(channel.clone()))));
        }
    }

    pub(super) fn append_locally(
        &mut self,
        origin: AppendOrigin,
        channel: &ChannelId,
        sender: Option<String>,
        records: Vec<AppendRecord>,
    ) {
        let now = self.now;
        if !self.channels.contains(channel) {
            self.activate(channel);
            if self.is_loading(channel) {
                let parked = self.park(channel, Deferred::Append { origin, sender, records });
                if let Err(Deferred::Append { origin, .. }) = parked {
                    self.fail_append(origin, RemoteAppendError::Refused(AppendError::Busy));
                }
                return;
            }
        }
        let request = self.next_id();
        let Some(machine) = self.channels.get_used(channel, now) else {
            let full = self.loading.len() >= self.active_max;
            let error = if full { RemoteAppendError::TooManyChannels } else { RemoteAppendError::NotReplica };
            self.fail_append(origin, error);
            return;
        };
        match machine.handle_append(now, AppendRequest { id: RequestId(request), records }) {
            Ok(()) => {
                self.appends.insert(request, (origin, sender));
            }
            Err(error) => self.fail_append(origin, RemoteAppendError::Refused(error)),
        }
    }

    pub(super) fn fail_append(&mut self, origin: AppendOrigin, error: RemoteAppendError) {
        match origin {
            AppendOrigin::Local(api) => self.done(api, ApiResult::Appended(Err(remote_error(error)))),
            AppendOrigin::Remote { node, id } => {
                self.send_node(node, NodeMessage::AppendReply { id, result: Err(error) })
            }
        }
    }
}
