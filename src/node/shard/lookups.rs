//! The storage reads a channel shard hands off and waits for — an activation's load, an
//! `append_from`'s sender check — as one effect ([`Lookup`]) and one answer ([`LookupAnswer`]), so
//! whoever runs the shard carries both out the same way: the threaded runtime on its reader thread
//! (never a reactor), the simulator after a disk delay, a host driving `NodeCore` as it likes.

use super::activation::ActivationLoad;
use super::senders::SenderCheck;
use super::ShardInput;
use tidings_slot::query::SlotReader;
use tidings_store::message::MessageLog;
use tidings_types::ChannelId;

/// A read a channel shard waits for (its inputs parked meanwhile): carry it out with
/// [`Lookup::carry_out`], off the thread that drives the shard, and hand the answer to
/// [`NodeCore::handle_lookup`](crate::node::NodeCore::handle_lookup).
#[derive(Debug)]
pub enum Lookup {
    /// What activating a channel replica needs: its meta, log state and recent records.
    Load(ActivationLoad),
    /// Whether an `append_from`'s sender may send: its ban and the channel's deny entry.
    CheckSender(SenderCheck),
}

/// What a [`Lookup`] found, for the shard that asked.
#[derive(Debug)]
pub struct LookupAnswer {
    channel: ChannelId,
    input: ShardInput,
}

impl Lookup {
    /// The channel it is for (its shard takes the answer).
    pub fn channel(&self) -> &ChannelId {
        match self {
            Lookup::Load(job) => job.channel(),
            Lookup::CheckSender(check) => check.channel(),
        }
    }

    /// Reads what it needs from this node's message log and slot replicas.
    pub fn carry_out(self, log: &dyn MessageLog, reader: &SlotReader) -> LookupAnswer {
        let channel = self.channel().clone();
        let input = match self {
            Lookup::Load(job) => ShardInput::Loaded(job.carry_out(log, reader)),
            Lookup::CheckSender(check) => ShardInput::SenderLookedUp(check.carry_out(reader)),
        };
        LookupAnswer { channel, input }
    }
}

impl LookupAnswer {
    /// The channel it is for.
    pub fn channel(&self) -> &ChannelId {
        &self.channel
    }

    /// The shard's input.
    pub(crate) fn into_input(self) -> ShardInput {
        self.input
    }
}
