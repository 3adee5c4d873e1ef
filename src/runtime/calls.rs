//! API calls in progress on one runtime thread, and carrying out the effects every thread shares (frames
//! to send, durable appends, pull reads, calls that finished).

use crate::node::Lookup;
use crate::node::{ApiId, ApiResult, NodeEffect, NodeError};
use crate::runtime::workers::ReadJob;
use crate::runtime::Transport;
use crossbeam_channel::{Sender, TrySendError};
use rustc_hash::FxHashMap;
use std::sync::Arc;
use tidings_channel::machine::PersistToken;
use tidings_store::message::LogBatch;
use tidings_types::Seq;

/// Where an API call's result goes.
pub(super) enum Reply {
    /// To a caller waiting on the other end.
    Wait(Sender<ApiResult>),
    /// To a callback, run on the thread that finished the call.
    Then(Box<dyn FnOnce(ApiResult) + Send>),
}

impl Reply {
    /// A reply that hands an append's seqs (or why not) to `then`.
    pub(super) fn then(then: impl FnOnce(Result<Vec<Seq>, NodeError>) + Send + 'static) -> Reply {
        Reply::Then(Box::new(move |result| then(super::reactor::appended(result))))
    }

    fn deliver(self, result: ApiResult) {
        match self {
            // The caller may have stopped waiting: nothing to do then.
            Reply::Wait(sender) => drop(sender.send(result)),
            Reply::Then(callback) => callback(result),
        }
    }
}

/// The API calls a thread took and has not finished. Dropped with the thread: waiting callers see their
/// channel close, callbacks are told `Stopped`, so each is called exactly once.
#[derive(Default)]
pub(super) struct Calls {
    /// By id: looked up once per call (a hash, where an ordered map walked a tree per append).
    open: FxHashMap<ApiId, Reply>,
    next: u64,
}

impl Calls {
    /// Registers a call; its id goes to the core or shard that runs it.
    pub(super) fn open(&mut self, reply: Reply) -> ApiId {
        self.next += 1;
        let id = ApiId(self.next);
        self.open.insert(id, reply);
        id
    }

    /// Hands a finished call's result to its caller.
    pub(super) fn finish(&mut self, id: ApiId, result: ApiResult) {
        if let Some(reply) = self.open.remove(&id) {
            reply.deliver(result);
        }
    }
}

impl Drop for Calls {
    fn drop(&mut self) {
        for (_, reply) in std::mem::take(&mut self.open) {
            if let Reply::Then(callback) = reply {
                callback(ApiResult::Appended(Err(NodeError::Stopped)));
            }
        }
    }
}

/// The IO both the core thread and the reactors carry out.
#[derive(Clone)]
pub(super) struct Io {
    pub(super) transport: Arc<dyn Transport>,
    pub(super) persist_tx: Sender<(PersistToken, LogBatch)>,
    pub(super) read_tx: Sender<ReadJob>,
}

impl Io {
    /// Hands an API read (or `latest`) to the reader thread without blocking: its full queue answers the
    /// caller `Overloaded` (a stopped one drops the job, whose completer then answers `Stopped`).
    pub(super) fn api_read(&self, job: ReadJob) {
        match self.read_tx.try_send(job) {
            Err(TrySendError::Full(ReadJob::Api(_, reply))) => reply.complete(Err(NodeError::Overloaded)),
            Err(TrySendError::Full(ReadJob::Latest(_, reply))) => reply.complete(Err(NodeError::Overloaded)),
            _ => {}
        }
    }

    /// Hands `lookups` (one reactor's) to the reader thread as one job, without blocking. Gives back as
    /// effects what its full queue did not take: their inputs wait parked, so the caller offers them
    /// again later instead of dropping them.
    pub(super) fn hand_off(&self, lookups: Vec<Lookup>) -> Vec<NodeEffect> {
        if lookups.is_empty() {
            return Vec::new();
        }
        match self.read_tx.try_send(ReadJob::Lookups(lookups)) {
            Ok(()) | Err(TrySendError::Disconnected(_)) => Vec::new(),
            Err(TrySendError::Full(ReadJob::Lookups(lookups))) => lookups.into_iter().map(NodeEffect::Lookup).collect(),
            Err(TrySendError::Full(_)) => Vec::new(),
        }
    }

    /// Carries out `effect` if it is shared IO or a call's end, without ever blocking. Gives back what
    /// it did not carry out: a durable append or an activation's load the workers' full queue did not
    /// take (the caller offers it again later: a bounded wait that never blocks its thread), and the
    /// effects only the core thread has (slot syncs, fanout work).
    pub(super) fn carry_out(&self, effect: NodeEffect, calls: &mut Calls) -> Option<NodeEffect> {
        match effect {
            NodeEffect::Send { to, frame } => self.transport.send(to, frame),
            NodeEffect::Persist { token, batch } => match self.persist_tx.try_send((token, batch)) {
                Ok(()) | Err(TrySendError::Disconnected(_)) => {}
                Err(TrySendError::Full((token, batch))) => return Some(NodeEffect::Persist { token, batch }),
            },
            NodeEffect::Read { channel, token, from, through, max_bytes } => {
                if self.read_tx.try_send(ReadJob::Pull(channel, token, from, through, max_bytes)).is_err() {
                    tracing::debug!("reader busy; the follower pulls again");
                }
            }
            NodeEffect::Lookup(lookup) => return self.hand_off(vec![lookup]).pop(),
            NodeEffect::Done { id, result } => calls.finish(id, result),
            other @ (NodeEffect::SyncSlots { .. } | NodeEffect::Fanout(_) | NodeEffect::ListLogs(_)) => {
                return Some(other)
            }
        }
        None
    }
}
