//! `append_from`'s sender check against this node's slot replicas, read off the shard's thread: the
//! shard hands a [`SenderCheck`] to whoever runs it (the threaded runtime's reader thread, never a
//! reactor), and the answer comes back as a [`SenderChecked`] that admits, refuses, or — when no
//! replica here can vouch — sends the append on to the node's check through other nodes.

use super::calls::LeaderCall;
use super::{ChannelShard, Served, ShardOutput};
use crate::node::core::{ApiId, ApiResult, NodeEffect};
use crate::node::error::NodeError;
use crate::node::message::FlagQuery;
use std::sync::Arc;
use tidings_channel::machine::AppendRecord;
use tidings_slot::model::Uid;
use tidings_slot::query::SlotReader;
use tidings_types::{ChannelId, GroupId};

/// An `append_from` waiting for its sender to be checked in this node's slot replicas, off the shard's
/// thread (as a [`Lookup::CheckSender`](super::Lookup::CheckSender)).
#[derive(Debug)]
pub struct SenderCheck {
    api: ApiId,
    channel: ChannelId,
    sender: Uid,
    records: Vec<AppendRecord>,
    /// Which slot replicas here may vouch: those of the serving copy, knowing their leader.
    served: Arc<Served>,
}

/// What a [`SenderCheck`] found.
#[derive(Debug)]
pub(crate) struct SenderChecked {
    api: ApiId,
    channel: ChannelId,
    sender: Uid,
    records: Vec<AppendRecord>,
    /// `Ok(true)`: may send; `Ok(false)`: no replica here can tell; `Err`: why not.
    outcome: Result<bool, NodeError>,
}

impl SenderCheck {
    /// The channel appended to.
    pub fn channel(&self) -> &ChannelId {
        &self.channel
    }

    /// Reads the sender's ban and the channel's deny entry for it from this node's slot replicas.
    pub(super) fn carry_out(self, reader: &SlotReader) -> SenderChecked {
        let outcome = self.verdict(reader);
        let Self { api, channel, sender, records, .. } = self;
        SenderChecked { api, channel, sender, records, outcome }
    }

    /// `Ok(true)` if the sender may send, `Ok(false)` if this node's replicas cannot tell — none holding
    /// the serving copy of the user's or the channel's hash slot, or one that knows no leader (the node
    /// then asks nodes that can) — or why not.
    fn verdict(&self, reader: &SlotReader) -> Result<bool, NodeError> {
        // Which replicas here may vouch was decided at the store's routes version then: read at that
        // version only (a replica destroyed since, its records cleared, would vouch for anyone).
        let at = self.served.routes_version();
        if reader.routes_version() != at {
            return Ok(false);
        }
        let verdict = self.read_flags(reader)?;
        Ok(verdict && reader.routes_version() == at)
    }

    fn read_flags(&self, reader: &SlotReader) -> Result<bool, NodeError> {
        let banned = FlagQuery::Banned(self.sender.clone());
        let denied = FlagQuery::Denied { channel: self.channel.clone(), uid: self.sender.clone() };
        // The copy read must be the serving one (not one of a slot migrated away or not yet imported
        // here), in a replica that knows its leader.
        let copy = |flag: &FlagQuery| -> Result<Option<GroupId>, NodeError> {
            let copy = reader.owner_copy_of(flag.routing_key())?;
            Ok(copy.filter(|group| self.served.is_fresh(*group)))
        };
        let (Some(user_copy), Some(channel_copy)) = (copy(&banned)?, copy(&denied)?) else { return Ok(false) };
        // A refusal stands whatever changed meanwhile: the flag was set in a serving copy.
        if banned.read(reader, user_copy)? {
            return Err(NodeError::SenderBanned(self.sender.clone()));
        }
        if denied.read(reader, channel_copy)? {
            return Err(NodeError::SenderDenied(self.sender.clone()));
        }
        Ok(true)
    }
}

impl ChannelShard {
    /// Asks for `append_from`'s sender to be checked off this thread.
    pub(super) fn check_sender(&mut self, api: ApiId, channel: ChannelId, sender: Uid, records: Vec<AppendRecord>) {
        let served = Arc::clone(&self.served);
        let check = SenderCheck { api, channel, sender, records, served };
        self.outputs.push_back(ShardOutput::Effect(NodeEffect::Lookup(super::Lookup::CheckSender(check))));
    }

    /// A sender check came back: admit the append, refuse it, or have the node ask nodes that can tell.
    pub(super) fn sender_checked(&mut self, checked: SenderChecked) {
        let SenderChecked { api, channel, sender, records, outcome } = checked;
        match outcome {
            Ok(true) => {
                let sender = Some(sender.as_str().to_owned());
                self.route_call(api, channel, LeaderCall::Append { sender, records })
            }
            Ok(false) => self.outputs.push_back(ShardOutput::VerifySender { api, channel, sender, records }),
            Err(error) => self.done(api, ApiResult::Appended(Err(error))),
        }
    }
}
