//! The runtime's IO workers: durable appends (group commit across channels), pull reads, the slot
//! stores' sync, and fanout's host calls. Storage IO runs here, never on the core or a reactor thread.

use super::core_thread::WorkerAnswer;
use super::handle::Completer;
use super::reactor::Completion;
use super::{spawn, GROUP_COMMIT_MAX, ROOM_PATIENCE};
use crate::node::shard::{shard_of, Lookup, ReadPlan};
use crate::node::FanoutWork;
use crate::node::LogPage;
use crate::node::{carry_out_fanout, FanoutHost};
use crossbeam_channel::{Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use tidings_channel::machine::{PersistToken, ReadToken};
use tidings_slot::query::SlotReader;
use tidings_store::message::{BatchFate, LogBatch, MessageLog, ReadLimits, Record};
use tidings_store::{Kv, MetaStore, StoreError};
use tidings_types::{ChannelId, Seq};

/// Batches staged per wait for room in the message log (see [`MessageLog::stage_all`]).
const STAGE_RUN: usize = 256;

/// What the reader thread reads.
pub(super) enum ReadJob {
    /// For a follower's pull its leader could not answer from memory: channel, token to echo, first and
    /// last seq, byte budget. The records go back to the channel's reactor.
    Pull(ChannelId, ReadToken, Seq, Seq, usize),
    /// An API read a reactor admitted; the messages go to the caller.
    Api(ReadPlan, Completer<Vec<Record>>),
    /// An API `latest` of a replica not in memory: the high watermark its store holds.
    Latest(ReadPlan, Completer<Seq>),
    /// Activations' loads and `append_from`'s sender checks of one reactor's step; the answers go back
    /// to it in one message (one hop each way for all of them).
    Lookups(Vec<Lookup>),
    /// A page of the core's sweep for logs of replicas moved away; the answer goes to the core.
    Logs(LogPage),
}

/// Where storage completions go: the reactor of each channel's shard. Unbounded channels, bounded by
/// the protocol: a channel's machine has at most one durable append and one read per follower in
/// flight, so a reactor has at most that many completions waiting for each of its active replicas.
#[derive(Clone)]
pub(super) struct Completions {
    reactors: Vec<Sender<Completion>>,
}

impl Completions {
    pub(super) fn new(reactors: Vec<Sender<Completion>>) -> Self {
        Self { reactors }
    }

    fn reactor_of(&self, channel: &ChannelId) -> &Sender<Completion> {
        &self.reactors[shard_of(channel, self.reactors.len())]
    }

    /// Hands a round's outcomes to their reactors, one message per reactor (a stopped reactor's are
    /// dropped: the node is stopping).
    fn persisted(&self, outcomes: Vec<(ChannelId, PersistToken, Result<(), StoreError>)>) {
        let mut per_reactor: Vec<Vec<_>> = self.reactors.iter().map(|_| Vec::new()).collect();
        for outcome in outcomes {
            per_reactor[shard_of(&outcome.0, self.reactors.len())].push(outcome);
        }
        for (reactor, outcomes) in self.reactors.iter().zip(per_reactor) {
            if !outcomes.is_empty() {
                let _ = reactor.send(Completion::Persisted(outcomes));
            }
        }
    }
}

/// What the IO workers share: the stores they read and write, the host's fanout, and where they
/// answer.
pub(super) struct Workers {
    pub(super) kv: Arc<dyn Kv>,
    pub(super) log: Arc<dyn MessageLog>,
    pub(super) fanout: Arc<dyn FanoutHost>,
    pub(super) completions: Completions,
    pub(super) answers: Sender<WorkerAnswer>,
}

/// The workers' ends of their queues.
pub(super) struct WorkQueues {
    pub(super) syncs: Receiver<u64>,
    pub(super) persists: Receiver<(PersistToken, LogBatch)>,
    pub(super) reads: Receiver<ReadJob>,
    pub(super) fanout: Receiver<FanoutWork>,
}

impl Workers {
    /// Starts the slot-sync worker, `durable_workers` durable-append workers, the reader and the fanout
    /// worker. Each ends when its queue closes.
    pub(super) fn spawn(self, durable_workers: usize, queues: WorkQueues) -> Vec<JoinHandle<()>> {
        let Workers { kv, log, fanout, completions, answers } = self;
        let WorkQueues { syncs, persists, reads, fanout: fanout_work } = queues;
        let mut threads = Vec::new();
        threads.push(spawn("tidings-slot-sync", {
            let (kv, answers) = (kv.clone(), answers.clone());
            move || slot_sync_worker(&kv, &syncs, &answers)
        }));
        for _ in 0..durable_workers {
            threads.push(spawn("tidings-durable", {
                let (log, completions, persists) = (log.clone(), completions.clone(), persists.clone());
                move || durable_worker(log.as_ref(), &persists, &completions)
            }));
        }
        threads.push(spawn("tidings-reader", {
            let (log, answers) = (log.clone(), answers.clone());
            let reader = SlotReader::new(MetaStore::new(kv.clone()));
            move || reader_worker(log.as_ref(), &reader, &reads, &completions, &answers)
        }));
        threads.push(spawn("tidings-fanout", {
            let reader = SlotReader::new(MetaStore::new(kv));
            move || fanout_worker(&reader, fanout.as_ref(), &fanout_work, &answers)
        }));
        threads
    }
}

fn fanout_worker(reader: &SlotReader, host: &dyn FanoutHost, work: &Receiver<FanoutWork>, core: &Sender<WorkerAnswer>) {
    while let Ok(item) = work.recv() {
        if let Some(answer) = carry_out_fanout(reader, host, item) {
            if core.send(WorkerAnswer::Fanout(answer)).is_err() {
                return;
            }
        }
    }
}

fn slot_sync_worker(kv: &Arc<dyn Kv>, tokens: &Receiver<u64>, core: &Sender<WorkerAnswer>) {
    while let Ok(first) = tokens.recv() {
        // One fsync covers every sync asked for meanwhile.
        let token = tokens.try_iter().fold(first, u64::max);
        match kv.sync() {
            Ok(()) => {
                if core.send(WorkerAnswer::SlotsSynced { token }).is_err() {
                    return;
                }
            }
            Err(error) => {
                tracing::error!(%error, "metadata sync failed: this node's slot replicas stop until a restart");
                if core.send(WorkerAnswer::SlotsSyncFailed(error)).is_err() {
                    return;
                }
            }
        }
    }
}

fn durable_worker(log: &dyn MessageLog, jobs: &Receiver<(PersistToken, LogBatch)>, completions: &Completions) {
    while let Ok(first) = jobs.recv() {
        let mut round = vec![first];
        round.extend(jobs.try_iter().take(GROUP_COMMIT_MAX - 1));
        let mut staged = Vec::with_capacity(round.len());
        let mut outcomes = Vec::with_capacity(round.len());
        let mut round = round.into_iter().peekable();
        while round.peek().is_some() {
            let (ids, batches): (Vec<_>, Vec<_>) =
                round.by_ref().take(STAGE_RUN).map(|(token, batch)| ((batch.channel.clone(), token), batch)).unzip();
            // Backpressure, not failure: a full memory table delays the batches (the machines' pending
            // appends fill meanwhile and new appends get `Busy`); a failed persist would end the replica's
            // leadership. Failing after `ROOM_PATIENCE` means write-behind cannot write at all.
            if let Err(error) = log.wait_for_room(ROOM_PATIENCE) {
                let failed = ids.into_iter().map(|(channel, token)| (channel, token, Err(same_failure(&error))));
                outcomes.extend(failed);
                continue;
            }
            // One run of batches under the journal's locks, not one lock per batch.
            for ((channel, token), outcome) in ids.into_iter().zip(log.stage_all(batches)) {
                match outcome {
                    Ok(receipt) => staged.push((channel, token, receipt)),
                    Err(error) => outcomes.push((channel, token, Err(error))),
                }
            }
        }
        let synced = log.sync();
        for (channel, token, receipt) in staged {
            // Per batch: another worker's failed write drops what this one staged, and a batch this one
            // staged may have been made durable by the other's sync before this one's failed.
            let result = match (log.fate(receipt), &synced) {
                (BatchFate::Durable, _) => Ok(()),
                (_, Err(error)) => Err(same_failure(error)),
                (_, Ok(_)) => Err(StoreError::Dropped),
            };
            outcomes.push((channel, token, result));
        }
        completions.persisted(outcomes);
    }
}

/// The failure one store call reported, for each of the batches it failed (a store error is not `Clone`:
/// it may carry an IO error).
fn same_failure(error: &StoreError) -> StoreError {
    match error {
        StoreError::Busy { bytes, limit } => StoreError::Busy { bytes: *bytes, limit: *limit },
        StoreError::Dropped => StoreError::Dropped,
        other => StoreError::io("group commit", std::io::Error::other(other.to_string())),
    }
}

fn reader_worker(
    log: &dyn MessageLog,
    reader: &SlotReader,
    reads: &Receiver<ReadJob>,
    completions: &Completions,
    core: &Sender<WorkerAnswer>,
) {
    while let Ok(job) = reads.recv() {
        match job {
            ReadJob::Pull(channel, token, from, through, max_bytes) => {
                let limits = ReadLimits { records_max: usize::MAX, bytes_max: max_bytes };
                let result = log.read(&channel, from, through, limits);
                let reactor = completions.reactor_of(&channel);
                let _ = reactor.send(Completion::ReadDone { channel, token, result });
            }
            ReadJob::Api(plan, reply) => reply.complete(plan.carry_out(log, reader)),
            ReadJob::Latest(plan, reply) => reply.complete(plan.high_watermark(log, reader)),
            ReadJob::Lookups(lookups) => {
                // One reactor's: they all go back to it.
                let Some(first) = lookups.first() else { continue };
                let reactor = completions.reactor_of(first.channel()).clone();
                let answers = lookups.into_iter().map(|lookup| lookup.carry_out(log, reader).into_input()).collect();
                let _ = reactor.send(Completion::Answers(answers));
            }
            ReadJob::Logs(page) => {
                let _ = core.send(WorkerAnswer::LogsListed(page.carry_out(log, reader)));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crossbeam_channel::unbounded;
    use std::time::Duration;
    use tidings_store::message::{ChannelLogState, IdempotencyKey, IdempotentHit, LogFailOp, LogOp, MemoryLog, Staged};
    use tidings_store::StoreResult;
    use tidings_types::{ChannelType, LeaderEpoch};

    fn channel(name: &str) -> ChannelId {
        ChannelId::new(ChannelType::GROUP, name).expect("channel id")
    }

    /// A durable append of one record, seq 1, to `name`.
    fn job(name: &str, id: u64) -> (PersistToken, LogBatch) {
        let record = Record::message(Seq::new(1), LeaderEpoch::new(1), name.as_bytes().to_vec());
        let token = PersistToken { incarnation: 1, generation: 1, id };
        (token, LogBatch::new(channel(name), vec![LogOp::Append(vec![record])]))
    }

    /// Runs a durable worker over `jobs`, all queued before it starts (so one round, one group commit),
    /// until the closed queue ends it; returns what it reported, in order.
    fn one_round(
        log: &dyn MessageLog,
        jobs: Vec<(PersistToken, LogBatch)>,
    ) -> Vec<(ChannelId, Result<(), StoreError>)> {
        let (queue, taken) = unbounded();
        for job in jobs {
            queue.send(job).expect("queue open");
        }
        drop(queue);
        let (reactor, completions) = unbounded();
        durable_worker(log, &taken, &Completions::new(vec![reactor]));
        completions
            .try_iter()
            .flat_map(|completion| match completion {
                Completion::Persisted(outcomes) => outcomes.into_iter().map(|(ch, _, result)| (ch, result)),
                _ => panic!("a durable worker reports only persisted outcomes"),
            })
            .collect()
    }

    fn last_seq(log: &dyn MessageLog, name: &str) -> Seq {
        log.state(&channel(name)).expect("state").last_seq
    }

    fn io_failure(result: &Result<(), StoreError>) -> bool {
        matches!(result, Err(StoreError::Io { .. }))
    }

    #[test]
    fn a_failed_sync_fails_every_batch_of_its_round_and_the_next_round_is_durable() {
        let log = MemoryLog::new(Default::default());
        log.fail(LogFailOp::Sync, 0, 1);
        let failed = one_round(&log, vec![job("a", 1), job("b", 2), job("c", 3)]);
        assert_eq!(failed.len(), 3, "every batch gets an outcome");
        assert!(failed.iter().all(|(_, result)| io_failure(result)), "{failed:?}");
        assert!(["a", "b", "c"].iter().all(|name| last_seq(&log, name) == Seq::new(0)), "nothing failed is kept");
        let durable = one_round(&log, vec![job("a", 4), job("d", 5)]);
        assert!(durable.iter().all(|(_, result)| result.is_ok()), "{durable:?}");
        assert_eq!((last_seq(&log, "a"), last_seq(&log, "d")), (Seq::new(1), Seq::new(1)));
    }

    /// A failed metadata sync is reported, so the core stops its slot replicas: the next sync that
    /// succeeds must not acknowledge what the failed one covered.
    #[test]
    fn a_failed_metadata_sync_is_reported_and_the_next_one_answers_its_token() {
        let store = Arc::new(tidings_store::MemoryKv::new());
        store.fail(tidings_store::FailOp::Sync, 0, 1);
        let kv: Arc<dyn Kv> = store;
        let (tokens, taken) = unbounded();
        let (core, answers) = unbounded();
        tokens.send(1).expect("queue open");
        let worker = std::thread::spawn(move || slot_sync_worker(&kv, &taken, &core));
        // Bounded waits: a worker that says nothing of the failure (as before session 60) fails the test
        // instead of hanging it.
        let answer = || answers.recv_timeout(Duration::from_secs(10)).expect("an answer");
        assert!(matches!(answer(), WorkerAnswer::SlotsSyncFailed(StoreError::Io { .. })));
        tokens.send(2).expect("queue open");
        assert!(matches!(answer(), WorkerAnswer::SlotsSynced { token: 2 }));
        drop(tokens);
        worker.join().expect("the worker ends once its queue closes");
    }

    #[test]
    fn a_batch_refused_at_staging_fails_alone_and_the_rest_of_the_round_is_durable() {
        let log = MemoryLog::new(Default::default());
        log.fail(LogFailOp::Stage, 1, 1);
        let outcomes = one_round(&log, vec![job("a", 1), job("b", 2), job("c", 3)]);
        let failed: Vec<&ChannelId> = outcomes.iter().filter(|(_, r)| io_failure(r)).map(|(ch, _)| ch).collect();
        assert_eq!(failed, [&channel("b")], "{outcomes:?}");
        assert_eq!(outcomes.len(), 3);
        assert_eq!(
            (last_seq(&log, "a"), last_seq(&log, "b"), last_seq(&log, "c")),
            (Seq::new(1), Seq::new(0), Seq::new(1))
        );
    }

    /// A log whose memory table never has room: write-behind cannot write at all.
    struct NoRoom(MemoryLog);

    impl MessageLog for NoRoom {
        fn stage(&self, batch: LogBatch) -> StoreResult<Staged> {
            self.0.stage(batch)
        }
        fn sync(&self) -> StoreResult<usize> {
            self.0.sync()
        }
        fn fate(&self, receipt: Staged) -> BatchFate {
            self.0.fate(receipt)
        }
        fn read(&self, channel: &ChannelId, from: Seq, through: Seq, limits: ReadLimits) -> StoreResult<Vec<Record>> {
            self.0.read(channel, from, through, limits)
        }
        fn state(&self, channel: &ChannelId) -> StoreResult<ChannelLogState> {
            self.0.state(channel)
        }
        fn idempotent(&self, channel: &ChannelId, key: &IdempotencyKey) -> StoreResult<Option<IdempotentHit>> {
            self.0.idempotent(channel, key)
        }
        fn release_caches(&self, channel: &ChannelId) {
            self.0.release_caches(channel);
        }
        fn logs_after(&self, after: Option<&ChannelId>, limit: usize) -> StoreResult<Vec<ChannelId>> {
            self.0.logs_after(after, limit)
        }
        fn wait_for_room(&self, patience: Duration) -> StoreResult<()> {
            assert_eq!(patience, ROOM_PATIENCE);
            Err(StoreError::Busy { bytes: 64 << 20, limit: 64 << 20 })
        }
    }

    #[test]
    fn batches_that_find_no_room_fail_busy_and_nothing_of_them_is_staged() {
        let log = NoRoom(MemoryLog::new(Default::default()));
        let outcomes = one_round(&log, vec![job("a", 1), job("b", 2)]);
        assert_eq!(outcomes.len(), 2);
        assert!(outcomes.iter().all(|(_, result)| matches!(result, Err(StoreError::Busy { .. }))), "{outcomes:?}");
        assert_eq!((last_seq(&log, "a"), last_seq(&log, "b")), (Seq::new(0), Seq::new(0)));
    }
}
