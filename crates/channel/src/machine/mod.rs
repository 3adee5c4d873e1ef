//! The channel replica machine: one instance per replica of one channel, pure and deterministic.
//!
//! # Calling contract
//!
//! Inputs are `handle_*` calls, each taking the current logical [`Time`] (never earlier than the last
//! one). Outputs are [`Effect`]s drained with [`ChannelMachine::poll_effect`] until `None` after every
//! input; [`ChannelMachine::poll_timeout`] says when to call [`ChannelMachine::handle_timeout`] next.
//! The machine never calls the host: the runtime carries out effects and feeds the results back
//! (`handle_persisted`, `handle_read`), so the same code runs in production and in the simulator.
//!
//! # The rules it keeps
//!
//! * **Commit.** HW is the MinISR-th highest durable match among ISR members, the leader's own durable log
//!   included; learners never count. A follower's match is what its pull acknowledges (`next_seq - 1`),
//!   and it pulls only once what it received is durable. Appends complete, in seq order, when HW covers
//!   them. HW never goes back; reads are bounded by it.
//! * **New-leader barrier.** A new leader first appends a barrier record of its own epoch and counts
//!   nothing as committed until the barrier is. Without it, quorum commit has Raft's "figure 8" hazard: a
//!   leader could count replicas for a record of an earlier epoch, crash, and be followed by a leader
//!   chosen on a higher last epoch that never had the record — which would then be overwritten although
//!   acknowledged. Committing the barrier proves MinISR replicas hold the new leader's log through it.
//! * **Divergence** (KIP-101/279): a pull carries the follower's last epoch; the leader answers with the
//!   end of that epoch in its own history when the follower's log goes beyond it, and the follower
//!   truncates there. Never by HW alone.
//! * **One leadership per leader epoch.** A new leader sends nothing to followers before its barrier is
//!   durable locally, and a replica whose durable log already holds the leader epoch it is named leader
//!   in refuses to lead ([`Effect::NeedsFailover`]): after a restart it may have lost records of that
//!   epoch that followers hold, and writing new ones at the same seqs under the same epoch would hide the
//!   divergence from the epoch check.
//! * **Generations.** A meta that changes the leader or this replica's role starts a new generation: the
//!   old generation's pending appends end as `LeaderChanged`, and completions are matched by token.
//!
//! See `crates/channel/tests/` for the scenarios each rule prevents (KIP-101's two, and figure 8).

mod cache;
mod config;
mod effect;
mod error;
mod follower;
mod handoff;
mod idempotency;
mod leader;
mod message;
mod replica_map;
mod retention;

pub use config::{MachineConfig, UnsafeTestSwitches};
pub use effect::{
    AppendAborted, AppendRecord, AppendRequest, Effect, MetaChangeReason, PersistToken, ReadToken, RequestId,
    RetentionRequest,
};
pub use error::{AppendError, ApplyMetaError};
pub use follower::PullInFlight;
pub use message::{ChannelMessage, PullBody, PullHint, PullRequest, PullResponse};

use cache::RecordCache;
use follower::FollowerState;
use handoff::Handoff;
use idempotency::IdempotencyIndex;
use leader::LeaderState;
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;
use tidings_store::message::{ChannelLogState, LogBatch, LogOp, Record};
use tidings_store::StoreError;
use tidings_types::{ChannelId, ChannelRuntimeMeta, LeaderEpoch, MetaError, NodeId, Seq, Time};

/// This replica's role under its current meta.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RoleKind {
    /// No meta yet, or this node is not a replica.
    None,
    /// Accepts appends and serves pulls.
    Leader,
    /// Pulls from the leader and counts toward HW.
    Follower,
    /// Pulls from the leader; does not count and cannot lead.
    Learner,
}

/// Whether the channel is drained (before a leader transfer): nothing pending and HW at the log end.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DrainStatus {
    /// Appends admitted and not completed.
    pub pending_appends: usize,
    /// The high watermark.
    pub hw: Seq,
    /// Last seq of the local log (durable or not).
    pub log_end: Seq,
    /// Last durable seq.
    pub durable_last: Seq,
    /// `true` when nothing is pending and HW, log end and durable end are equal.
    pub drained: bool,
}

/// What a leader knows of one other replica's replication, for operators: how far behind it is and how
/// long it has been silent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReplicaProgress {
    /// The replica.
    pub node: NodeId,
    /// `true` if it is in the ISR (counts toward HW); `false`: a learner catching up.
    pub in_isr: bool,
    /// The last seq it acknowledged as durable (its last pull's `next_seq - 1`; zero until its log was
    /// found consistent with the leader's).
    pub match_seq: Seq,
    /// Records the leader's log holds past `match_seq`.
    pub lag: u64,
    /// Time since its last pull reached the leader.
    pub silent_for: Duration,
    /// Time since its acknowledgement last reached the leader's log end (zero while caught up); past
    /// `MachineConfig::isr_lag` an ISR member is proposed out of the ISR.
    pub behind_for: Duration,
}

/// Durable evidence a controller gathers to pick a new leader after a failure.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Evidence {
    /// The replica.
    pub node: NodeId,
    /// Leader epoch of its last durable record.
    pub last_epoch: LeaderEpoch,
    /// Its last durable seq.
    pub last_seq: Seq,
    /// Its checkpointed high watermark.
    pub hw: Seq,
}

/// Operations not yet handed to storage, in log order.
#[derive(Clone, Debug)]
enum PendingOp {
    Append(Record),
    Truncate(Seq),
    StartAfter {
        seq: Seq,
        epoch: LeaderEpoch,
    },
    /// An ISR the leader proposes from meta version `from_version`: durable before it is sent.
    ProposeIsr {
        from_version: u64,
        isr: Vec<NodeId>,
    },
}

/// The durable append in flight (at most one per channel: batches grow while it runs).
#[derive(Debug)]
struct InFlight {
    token: PersistToken,
    /// Durable state once it completes.
    next: ChannelLogState,
    /// Lowest truncation point in the batch, if it truncates.
    truncated_to: Option<Seq>,
}

/// The local log as the machine sees it.
#[derive(Debug)]
struct LocalLog {
    /// Mirror of the store's durable state.
    durable: ChannelLogState,
    /// Last seq of the whole local log: durable, in flight, and not yet handed to storage.
    end: Seq,
    /// Epoch history of the whole local log.
    epochs: Vec<(LeaderEpoch, Seq)>,
    /// High watermark in memory (the checkpoint in `durable.hw` may trail it).
    hw: Seq,
    cache: RecordCache,
    unpersisted: VecDeque<PendingOp>,
    persisting: Option<InFlight>,
    next_persist_id: u64,
    /// When HW was last checkpointed (to bound how stale the checkpoint gets when idle).
    hw_checkpointed_at: Time,
    /// When the standalone HW checkpoint wanted now is due (see [`checkpoint_due_at`]); `None` while
    /// none is wanted.
    checkpoint_at: Option<Time>,
}

impl LocalLog {
    fn last_epoch(&self) -> LeaderEpoch {
        self.epochs.last().map_or(LeaderEpoch::new(0), |(e, _)| *e)
    }

    /// The epoch a replica starting its log right after `seq` takes as its last: the one in force at
    /// the next record (every later record's is at least that), or the last one when none follows.
    /// Never the epoch in force at `seq` itself, which retention may have dropped from the history.
    fn epoch_after(&self, seq: Seq) -> Option<LeaderEpoch> {
        let next = seq.next();
        let in_force = self.epochs.iter().take_while(|(_, start)| *start <= next).last();
        in_force.or(self.epochs.first()).map(|(epoch, _)| *epoch)
    }

    /// Largest epoch at or below `epoch` in the local log, and its last seq.
    fn end_of_epoch(&self, epoch: LeaderEpoch) -> (LeaderEpoch, Seq) {
        tidings_store::message::end_of_epoch(&self.epochs, self.end, epoch)
    }

    /// The end of the longest durable prefix that agrees with the log as the machine sees it: a truncation
    /// not yet durable cuts it, because the durable records after that point are about to go.
    fn consistent_durable_end(&self) -> Seq {
        let mut end = self.durable.last_seq;
        if let Some(seq) = self.persisting.as_ref().and_then(|p| p.truncated_to) {
            end = end.min(seq);
        }
        for op in &self.unpersisted {
            if let PendingOp::Truncate(seq) = op {
                end = end.min(*seq);
            }
        }
        end
    }

    /// `true` when everything received or assigned is durable.
    fn settled(&self) -> bool {
        self.persisting.is_none() && self.unpersisted.is_empty()
    }

    fn push_record(&mut self, record: Record) {
        tidings_store::message::note_epoch(&mut self.epochs, &record);
        self.end = record.seq;
        self.cache.push(record.clone());
        self.unpersisted.push_back(PendingOp::Append(record));
    }

    fn record_isr_proposal(&mut self, from_version: u64, isr: Vec<NodeId>) {
        self.unpersisted.push_back(PendingOp::ProposeIsr { from_version, isr });
    }

    fn truncate_after(&mut self, seq: Seq) {
        self.end = seq;
        self.epochs.retain(|(_, start)| *start <= seq);
        self.cache.truncate_after(seq);
        self.unpersisted.push_back(PendingOp::Truncate(seq));
    }
}

/// What the machine is doing in its role.
#[derive(Debug)]
enum Role {
    None,
    Leader(Box<LeaderState>),
    Follower(FollowerState),
}

/// One replica of one channel. See the [module docs](self) for the calling contract.
#[derive(Debug)]
pub struct ChannelMachine {
    channel: ChannelId,
    me: NodeId,
    /// Shared by every machine a runtime creates (one copy per machine was 208 bytes per replica).
    config: Arc<MachineConfig>,
    incarnation: u64,
    now: Time,
    meta: Option<ChannelRuntimeMeta>,
    generation: u64,
    log: LocalLog,
    idempotency: IdempotencyIndex,
    role: Role,
    effects: VecDeque<Effect>,
    /// Handoff slots held, messages handed to fanout and not finished, and how far fanout finished.
    handoff: Handoff,
    /// The local log failed: no more leading until a new incarnation.
    broken: bool,
    /// A leader epoch this incarnation may lead although its log holds it (see `resume_leadership`).
    resumable_epoch: Option<LeaderEpoch>,
    /// Started without its recent records ([`ChannelMachine::without_recent`]): its idempotency window
    /// holds only the keys of records it received since.
    recent_left_out: bool,
    /// The id of this replica's next pull as a follower (see `follower::first_pull_id`).
    next_pull_id: u64,
    /// A pull of the previous incarnation, taken as this one's if it fits (see `inherit_pull`).
    inherited_pull: Option<PullInFlight>,
}

impl ChannelMachine {
    /// A machine for `channel` on node `me`, over a log whose durable state is `durable` and whose last
    /// records (up to the idempotency window; at least none) are `recent`. `incarnation` must differ from
    /// every earlier machine of this channel on this node, across the node's restarts too (completions
    /// of those are then ignored, and a leader's late answer to one of their pulls matches no pull of
    /// this one: pull ids start from the incarnation).
    /// `config` may be an `Arc` shared by many machines.
    pub fn new(
        channel: ChannelId,
        me: NodeId,
        config: impl Into<Arc<MachineConfig>>,
        incarnation: u64,
        now: Time,
        durable: ChannelLogState,
        recent: Vec<Record>,
    ) -> Self {
        let config = config.into();
        let mut cache = RecordCache::default();
        let mut idempotency = IdempotencyIndex::new(config.idempotency_window);
        let suffix_ok = recent.last().is_none_or(|r| r.seq == durable.last_seq);
        for record in recent.into_iter().filter(|_| suffix_ok) {
            idempotency.insert(&record);
            cache.push(record);
        }
        let durable_fanned = durable.fanned_through;
        let log = LocalLog {
            end: durable.last_seq,
            epochs: durable.epochs.clone(),
            hw: durable.hw,
            durable,
            cache,
            unpersisted: VecDeque::new(),
            persisting: None,
            next_persist_id: 0,
            hw_checkpointed_at: now,
            checkpoint_at: None,
        };
        Self {
            channel,
            me,
            config,
            incarnation,
            now,
            meta: None,
            generation: 0,
            log,
            idempotency,
            role: Role::None,
            effects: VecDeque::new(),
            handoff: Handoff::knowing(durable_fanned),
            broken: false,
            resumable_epoch: None,
            recent_left_out: false,
            next_pull_id: follower::first_pull_id(incarnation),
            inherited_pull: None,
        }
    }

    /// Lets this incarnation lead in `epoch` although its log already holds that epoch. Only for a runtime
    /// that evicted the previous incarnation of this replica while it led `epoch` and was quiescent
    /// ([`ChannelMachine::is_quiescent`]): everything it ever assigned was durable then, so no follower
    /// holds a record of `epoch` that this log lacks. Never after a crash.
    pub fn resume_leadership(&mut self, epoch: LeaderEpoch) {
        self.resumable_epoch = Some(epoch);
    }

    /// Says the machine was built without the recent records the log holds (`recent` empty though the
    /// log is not): a follower does not need them — they fill the idempotency window a leader checks
    /// retries against, and a leader's record cache — so an activation can skip reading them. Such a
    /// machine must not lead: give it no meta naming it leader ([`ChannelMachine::recent_left_out`]);
    /// build a new incarnation with its recent records instead.
    pub fn without_recent(mut self) -> Self {
        self.recent_left_out = self.log.durable.last_seq > Seq::new(0);
        self
    }

    /// `true` if the machine was built [`ChannelMachine::without_recent`] from a log that held records.
    pub fn recent_left_out(&self) -> bool {
        self.recent_left_out
    }

    /// The channel.
    pub fn channel(&self) -> &ChannelId {
        &self.channel
    }

    /// The meta in force.
    pub fn meta(&self) -> Option<&ChannelRuntimeMeta> {
        self.meta.as_ref()
    }

    /// This replica's role.
    pub fn role(&self) -> RoleKind {
        match (&self.role, &self.meta) {
            (Role::Leader(_), _) => RoleKind::Leader,
            (Role::Follower(_), Some(meta)) if meta.in_isr(self.me) => RoleKind::Follower,
            (Role::Follower(_), _) => RoleKind::Learner,
            (Role::None, _) => RoleKind::None,
        }
    }

    /// The high watermark: reads never go beyond it.
    pub fn hw(&self) -> Seq {
        self.log.hw
    }

    /// Last seq of the local log (durable or not).
    pub fn log_end(&self) -> Seq {
        self.log.end
    }

    /// Last durable seq of the local log.
    pub fn durable_last(&self) -> Seq {
        self.log.durable.last_seq
    }

    /// The durable state of the local log as last confirmed by storage.
    pub fn durable_state(&self) -> &ChannelLogState {
        &self.log.durable
    }

    /// Meta generation (bumped by leader and role changes).
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Drain status, for a leader transfer.
    pub fn drain_status(&self) -> DrainStatus {
        let pending_appends = match &self.role {
            Role::Leader(leader) => leader.pending.len(),
            _ => 0,
        };
        let drained = pending_appends == 0 && self.log.hw == self.log.end && self.log.durable.last_seq == self.log.end;
        DrainStatus {
            pending_appends,
            hw: self.log.hw,
            log_end: self.log.end,
            durable_last: self.log.durable.last_seq,
            drained,
        }
    }

    /// The leader's view of every other replica's progress at `now`, in node order; empty unless this
    /// replica leads.
    pub fn replica_progress(&self, now: Time) -> Vec<ReplicaProgress> {
        match (&self.role, &self.meta) {
            (Role::Leader(leader), Some(meta)) => leader.report(meta, self.log.end, now),
            _ => Vec::new(),
        }
    }

    /// Durable evidence for choosing a new leader.
    ///
    /// Only the durable prefix that agrees with the machine's view counts: records a pending truncation
    /// is about to remove are not evidence.
    pub fn evidence(&self) -> Evidence {
        let last_seq = self.log.consistent_durable_end();
        Evidence {
            node: self.me,
            last_epoch: self.log.durable.epoch_of(last_seq).unwrap_or_default(),
            last_seq,
            hw: self.log.durable.hw,
        }
    }

    /// Approximate memory held by this machine's caches, in bytes.
    pub fn cached_bytes(&self) -> usize {
        self.log.cache.bytes() + self.idempotency.len() * 96
    }

    /// Raises HW to `floor`, capped at the durable log end: what an earlier incarnation of this replica
    /// knew to be committed (its store may hold an older checkpoint). The checkpoint follows within a
    /// second, and until then the replica is not quiescent.
    pub fn raise_hw(&mut self, floor: Seq) {
        let hw = floor.min(self.log.durable.last_seq);
        if hw > self.log.hw {
            self.log.hw = hw;
        }
    }

    /// Takes what an earlier incarnation of this replica knew of fanout's progress
    /// ([`ChannelMachine::fanned_through`]; its store may hold an older checkpoint). Without it, a
    /// replica that leads next would take its HW for that progress and plan nothing again.
    pub fn learn_fanned_through(&mut self, fanned_through: Seq) {
        self.handoff.learn(fanned_through);
    }

    /// `true` if the machine can be evicted without losing anything: no meta-dependent work pending,
    /// everything durable, nothing waiting for commit or handoff, and its HW checkpointed (the next
    /// incarnation starts from the checkpoint: an HW ahead of it would go back — seen in the simulator
    /// once replicas were evicted mid-run; an idle replica checkpoints within 1.1 s, see `checkpoint_due_at`).
    /// A leader reading records for a follower's pull is not quiescent either: evicted then, the read's
    /// answer is lost, and the follower waits a pull timeout (seen tracing sim seed 560000612, where
    /// the leaders of a draining node were evicted for room within a millisecond of their activation).
    pub fn is_quiescent(&self) -> bool {
        self.leader_waits_for_nothing() && self.handoff_quiet() && self.log.hw == self.log.end && self.at_rest()
    }

    /// `true` for a leader that may leave memory with records not committed yet: no caller waits on it
    /// (no append or retention move: those waiting for the records timed out), nothing it handed to
    /// fanout is unfinished, nothing is on its way to the store or being read, and its HW and fanout
    /// progress are checkpointed. Its log holds the uncommitted records durably; the next incarnation
    /// resumes the leadership from it, replicates them, and hands them to fanout once committed as a
    /// new leader hands its predecessors' (the handoff slots they reserved go with this incarnation).
    /// A node out of room evicts such a leader for a follower when nothing else can leave: with every
    /// place of two nodes held by leaders each waiting for a follower the other had no room for,
    /// neither committed again (sim seed 621000689, MinISR all three replicas, two places a shard).
    /// A leader that may still unblock itself by shrinking its ISR stays: one with no ISR proposal in
    /// flight leaves only once it cannot shrink (its ISR is its MinISR) or has led for the ISR lag, when
    /// a follower silent all along would have been shrunk. Each incarnation judges its followers from
    /// its own start, so a leader evicted sooner, turn after turn, would never drop a dead follower.
    pub fn can_leave_memory_as_stalled_leader(&self) -> bool {
        let (Role::Leader(leader), Some(meta)) = (&self.role, &self.meta) else { return false };
        leader.pending.is_empty()
            && leader.retention_waits.is_empty()
            && leader.proposal.is_none()
            && !leader.may_yet_shrink_isr(meta, &self.config, self.now)
            && self.handoff.is_idle()
            && self.at_rest()
    }

    /// Nothing of the log on its way to the store or being read for a follower, and HW (and a leader's
    /// fanout progress) checkpointed: what every replica leaving memory needs (the next incarnation
    /// starts from the checkpoint: an HW ahead of it would go back).
    fn at_rest(&self) -> bool {
        !self.reading_for_a_follower()
            && self.log.settled()
            && self.log.durable.hw >= self.log.hw
            && self.leader_fanned_unwritten(&self.log.durable).is_none()
    }

    /// `true` for a leader whose only unfinished work is its fanout: no append, reservation or
    /// retention move waits, and every record it holds is committed. It waits for no follower, so a
    /// node need not count it among the leaders whose share of the room for active replicas keeps
    /// followers' room free (a shard's one leader's place held through a long fanout refused every
    /// other leader of that shard meanwhile). A write of its own may be on its way to the store (a
    /// checkpoint, or records a quorum of followers made durable first): that waits for no follower
    /// either. Counted meanwhile, a leader whose checkpoint was in flight kept a leader waiting for
    /// room out of another's freed place, with nothing to hand that place on once the write landed.
    pub fn leads_only_fanning_out(&self) -> bool {
        matches!(self.role, Role::Leader(_))
            && self.leader_waits_for_nothing()
            && self.log.hw == self.log.end
            && !self.handoff_quiet()
    }

    /// `true` for a leader only fanning out ([`ChannelMachine::leads_only_fanning_out`]) that may leave
    /// memory for another replica's place: nothing of its log on its way to the store or being read for
    /// a follower, its HW checkpointed, and fanout progress of its own checkpointed — at least one
    /// message this incarnation handed to fanout finished and is durably known to have. Leaving hands
    /// its unfinished fanout over to its next incarnation, which plans again every committed message
    /// past the checkpointed progress (a member may so get a message twice, as after a failover; the
    /// host drops the second by its seq). Held in memory, such a leader kept a third leader of its
    /// node's shard out for as long as its fanout ran (sim seed 660003161: two places, both held by
    /// leaders whose fanout finished ~2.5 messages a second at tight limits). The progress rule keeps
    /// turns at the cap from starving a message: each incarnation sees one through before it may
    /// leave, so a message whose fanout takes longer than a turn is not started over for ever.
    pub fn can_leave_memory_fanning_out(&self) -> bool {
        let Role::Leader(leader) = &self.role else { return false };
        self.leads_only_fanning_out()
            && self.log.settled()
            && !self.reading_for_a_follower()
            && self.log.durable.hw >= self.log.hw
            && self.log.durable.fanned_through > leader.fanned_from
    }

    /// `true` when only a checkpoint not written yet keeps this replica in memory: it would be
    /// quiescent (a leader) or free to leave as a follower once its HW (and a leader's fanout progress)
    /// is checkpointed, and no checkpoint is on its way or due already.
    pub fn kept_only_by_its_checkpoint(&self) -> bool {
        let leader_done = match &self.role {
            Role::Leader(_) => self.leader_waits_for_nothing() && self.log.hw == self.log.end,
            _ => true,
        };
        leader_done && self.log.settled() && self.handoff_quiet() && self.checkpoint_wanted_not_due()
    }

    /// `true` for a leader only fanning out that only a checkpoint not written yet keeps from leaving
    /// memory for another replica's place ([`ChannelMachine::can_leave_memory_fanning_out`]): fanout
    /// progress of its own is known but not durable (or its HW is not), and no checkpoint is on its way
    /// or due already. Left to fall due, that checkpoint came up to ~1.1 s later, and an activation
    /// waiting for the place waited as long.
    pub fn kept_fanning_out_only_by_its_checkpoint(&self) -> bool {
        let Role::Leader(leader) = &self.role else { return false };
        self.leads_only_fanning_out()
            && self.log.settled()
            && !self.reading_for_a_follower()
            && self.fanned_through().min(self.log.hw) > leader.fanned_from
            && self.checkpoint_wanted_not_due()
    }

    /// A checkpoint of its own is wanted (`standalone_checkpoint_wanted`) and none is due already.
    fn checkpoint_wanted_not_due(&self) -> bool {
        self.standalone_checkpoint_wanted() && self.log.checkpoint_at.is_none_or(|at| at > self.now)
    }

    /// Writes now the checkpoint that alone keeps this replica in memory
    /// ([`ChannelMachine::kept_only_by_its_checkpoint`]) or alone keeps a leader only fanning out from
    /// leaving ([`ChannelMachine::kept_fanning_out_only_by_its_checkpoint`]) instead of at its due time,
    /// up to ~1.1 s away (see `checkpoint_due_at`); `false` when that is not what keeps it. A node out
    /// of room for active replicas asks this of one, and the activation short of room takes its place
    /// once the write lands: at the cap, waiting for the due time let each place change hands about once
    /// a second (sim seed 487000472: 24 busy channels on five places a node, some refused for the whole
    /// healed phase).
    pub fn checkpoint_to_leave(&mut self, now: Time) -> bool {
        self.advance(now);
        if !self.kept_only_by_its_checkpoint() && !self.kept_fanning_out_only_by_its_checkpoint() {
            return false;
        }
        self.checkpoint_at_once();
        true
    }

    /// Writes now, whatever keeps this replica in memory, the checkpoint it would write when due: its HW
    /// and a leader's own fanout progress, past what its store holds (after the write in flight, if
    /// one is). A node stopping cleanly asks it of every active replica, so that the next start reads
    /// up to the HW this one knew and plans no fanout again that this one finished; without it, a
    /// replica's checkpoint trails by up to ~1.1 s (see `checkpoint_due_at`).
    pub fn checkpoint_now(&mut self, now: Time) {
        self.advance(now);
        self.checkpoint_at_once();
    }

    /// `true` when nothing of this replica waits to be written: no write in flight, no record or
    /// operation waiting for one, no checkpoint wanted (or its log broke, and nothing more will be).
    pub fn written_out(&self) -> bool {
        self.broken
            || (self.log.persisting.is_none()
                && self.log.unpersisted.is_empty()
                && !self.standalone_checkpoint_wanted())
    }

    /// Makes the checkpoint wanted due now and writes it (once the write in flight lands, if one is).
    fn checkpoint_at_once(&mut self) {
        self.log.checkpoint_at = Some(self.now);
        self.maybe_persist();
    }

    /// No handoff slot held and nothing handed to fanout unfinished.
    fn handoff_quiet(&self) -> bool {
        self.handoff.held == 0 && self.handoff.is_idle()
    }

    /// A leader with no append, reservation or retention move waiting (`true` off the leader).
    fn leader_waits_for_nothing(&self) -> bool {
        match &self.role {
            Role::Leader(leader) => {
                leader.pending.is_empty() && leader.reserved.is_empty() && leader.retention_waits.is_empty()
            }
            _ => true,
        }
    }

    /// `true` if a follower (or learner) can leave memory now, caught up or not: nothing of it is on its
    /// way to the store and its HW is checkpointed, so the next incarnation resumes from its log where
    /// this one stands and pulls the rest. A node out of room for active replicas evicts such a follower
    /// when no replica is quiescent: a follower behind waits for its leader, and that leader, elsewhere,
    /// may be waiting for room here. Never a leader: its appends and their callers live here.
    pub fn can_leave_memory_as_follower(&self) -> bool {
        !matches!(self.role, Role::Leader(_))
            && self.log.settled()
            && self.handoff_quiet()
            && self.log.durable.hw >= self.log.hw
    }

    /// `true` while a durable append of this replica is in flight or waits to be built: its log may
    /// still change in the store.
    pub fn is_writing(&self) -> bool {
        !self.log.settled()
    }

    /// Next effect to carry out, if any.
    pub fn poll_effect(&mut self) -> Option<Effect> {
        let effect = self.effects.pop_front();
        if effect.is_none() && self.effects.capacity() > 0 {
            // Drained: the buffer goes too. Kept, it held ~0.7 KB per replica of a node with 10,000
            // channels (heaptrack: 14.7 MB of followers' and 6.4 MB of leaders' buffers, all empty), for
            // an allocation saved per step.
            self.effects = VecDeque::new();
        }
        effect
    }

    /// Moves every pending effect to the end of `out`, in order (what [`ChannelMachine::poll_effect`]
    /// would return one by one, moved in bulk), and frees the machine's buffer as `poll_effect` does.
    pub fn drain_effects(&mut self, out: &mut Vec<Effect>) {
        drop(self.drain_effects_returning_buffer(out));
    }

    /// Like [`ChannelMachine::drain_effects`], and returns the emptied effect buffer (the machine keeps
    /// none), for [`ChannelMachine::lend_effect_buffer`] to pass on to the next machine.
    pub fn drain_effects_returning_buffer(&mut self, out: &mut Vec<Effect>) -> VecDeque<Effect> {
        out.extend(self.effects.drain(..));
        std::mem::take(&mut self.effects)
    }

    /// Gives the machine an empty buffer to push its next effects into, if it holds none. A runtime
    /// that drains many machines passes one machine's emptied buffer on to the next instead of each
    /// input allocating a buffer and each drain freeing it. Returns the buffer when it is not taken.
    pub fn lend_effect_buffer(&mut self, buffer: VecDeque<Effect>) -> Option<VecDeque<Effect>> {
        if self.effects.capacity() == 0 && buffer.is_empty() {
            self.effects = buffer;
            None
        } else {
            Some(buffer)
        }
    }

    /// Room the effect buffer holds (tests: a drained machine holds none).
    #[cfg(test)]
    pub(crate) fn effects_capacity(&self) -> usize {
        self.effects.capacity()
    }

    /// When [`ChannelMachine::handle_timeout`] should next be called, if at all.
    ///
    /// Every deadline returned is one that `handle_timeout` acts on, so a runtime that calls it at that time
    /// always makes progress (no timer stays due).
    pub fn poll_timeout(&self) -> Option<Time> {
        let role = match &self.role {
            Role::Leader(leader) => leader.next_timeout(&self.config, self.now, self.log.hw < self.log.end),
            Role::Follower(follower) => follower.next_timeout(&self.config, self.now),
            Role::None => None,
        };
        // Normally filed by `maybe_persist`; a checkpoint wanted since its last call is due at once, and
        // handle_timeout then files it.
        let checkpoint = self.standalone_checkpoint_wanted().then(|| self.log.checkpoint_at.unwrap_or(self.now));
        [role, checkpoint].into_iter().flatten().min()
    }

    /// Timers: parked pulls, append timeouts, ISR checks, follower pulls, HW checkpoints.
    pub fn handle_timeout(&mut self, now: Time) {
        self.advance(now);
        match self.role {
            Role::Leader(_) => self.leader_timeout(),
            Role::Follower(_) => self.follower_timeout(),
            Role::None => {}
        }
        self.maybe_persist();
    }

    /// Applies a new meta. Invalid metas and metas that are not valid successors are refused and change
    /// nothing.
    pub fn handle_meta(&mut self, now: Time, meta: ChannelRuntimeMeta) -> Result<(), ApplyMetaError> {
        self.advance(now);
        if meta.channel != self.channel {
            return Err(MetaError::WrongChannel.into());
        }
        match &self.meta {
            Some(current) => current.check_successor(&meta)?,
            None => meta.validate()?,
        }
        let previous = self.meta.replace(meta);
        let meta = self.meta.as_ref().expect("just set");
        self.idempotency.forget_through(meta.retention_through);
        let leader_changed =
            previous.as_ref().is_none_or(|p| p.leader != meta.leader || p.leader_epoch != meta.leader_epoch);
        let was_replica = previous.as_ref().is_some_and(|p| p.is_replica(self.me));
        let replica_changed = was_replica != meta.is_replica(self.me);
        if leader_changed || replica_changed {
            self.generation += 1;
            self.leave_role();
            self.enter_role();
        } else if let Role::Leader(_) = self.role {
            self.leader_meta_changed();
        } else if let Role::Follower(_) = self.role {
            self.follower_meta_changed();
        }
        self.maybe_persist();
        Ok(())
    }

    /// Admits an append (leader only). The result arrives later as [`Effect::AppendDone`].
    pub fn handle_append(&mut self, now: Time, request: AppendRequest) -> Result<(), AppendError> {
        self.advance(now);
        let result = self.leader_append(request);
        self.maybe_persist();
        result
    }

    /// A message from another replica of this channel.
    pub fn handle_message(&mut self, now: Time, from: NodeId, message: ChannelMessage) {
        self.advance(now);
        match message {
            ChannelMessage::Pull(request) => self.leader_pull(from, request),
            ChannelMessage::PullResponse(response) => self.follower_response(from, response),
            ChannelMessage::Hint(hint) => self.follower_hint(from, hint),
        }
        self.maybe_persist();
    }

    /// Reads a few fields spread over the machine and its role's state, and returns a value made of them
    /// only so that the reads stay. A caller about to feed many machines touches the next few first:
    /// each touch is a short chain of cache misses, and a loop of touches lets the CPU keep several
    /// machines' misses in flight at once, where feeding them one by one waits for each in turn.
    pub fn warm(&self) -> u64 {
        let role = match &self.role {
            Role::Leader(leader) => leader.warm(),
            Role::Follower(follower) => follower.warm(),
            Role::None => 0,
        };
        let queued = self.effects.len() as u64;
        // The meta's ISR and the record cache live in buffers of their own.
        let isr = self.meta.as_ref().and_then(|m| m.isr.first()).map_or(0, |n| n.get());
        let cached = self.log.cache.first_seq().map_or(0, |s| s.get());
        self.now.as_millis() ^ self.log.end.get() ^ self.log.durable.last_seq.get() ^ queued ^ role ^ isr ^ cached
    }

    /// Completion of a durable append. A token that is not the one in flight is ignored.
    pub fn handle_persisted(&mut self, now: Time, token: PersistToken, result: Result<(), StoreError>) {
        self.advance(now);
        let matches = self.log.persisting.as_ref().is_some_and(|inflight| inflight.token == token);
        if !matches {
            return;
        }
        let inflight = self.log.persisting.take().expect("checked above");
        match result {
            Ok(()) => {
                if inflight.next.hw > self.log.durable.hw {
                    self.log.hw_checkpointed_at = self.now;
                }
                self.log.durable = inflight.next;
                match self.role {
                    Role::Leader(_) => {
                        self.leader_send_recorded_proposal();
                        self.leader_recompute_hw();
                    }
                    Role::Follower(_) => self.follower_persisted(),
                    Role::None => {}
                }
            }
            Err(_) => self.persist_failed(),
        }
        self.evict_cache();
        self.maybe_persist();
    }

    /// Records read from storage to answer a pull (after an [`Effect::Read`]).
    pub fn handle_read(&mut self, now: Time, token: ReadToken, result: Result<Vec<Record>, StoreError>) {
        self.advance(now);
        if token.incarnation != self.incarnation || token.generation != self.generation {
            return;
        }
        self.leader_read_done(token, result);
    }

    /// Post-commit fanout of `seq`, one of the messages of a [`Effect::Committed`], finished: every
    /// member it could reach was handed its delivery (or it ended for good). Frees its handoff slot if it
    /// held one, and lets the leader report fanout past it to the followers. A seq this incarnation did
    /// not hand off is ignored.
    pub fn fanout_finished(&mut self, seq: Seq) {
        if self.handoff.finished(seq) {
            // A leader's progress is checkpointed (it stays known across an eviction or a restart).
            self.maybe_persist();
        }
    }

    /// How far post-commit fanout is known to have finished (every message at or below it was fanned
    /// out): on the leader, its own handoffs past what it knew when it started; elsewhere what a leader
    /// last reported (or the checkpoint, after a restart). Zero: nothing known.
    pub fn fanned_through(&self) -> Seq {
        let handed_through = match &self.role {
            Role::Leader(leader) => Some(leader.handed_through()),
            _ => None,
        };
        self.handoff.fanned_through(handed_through)
    }

    /// The fanout progress a leader has not checkpointed yet (followers' rides with their next write).
    fn leader_fanned_unwritten(&self, durable: &ChannelLogState) -> Option<Seq> {
        if !matches!(self.role, Role::Leader(_)) {
            return None;
        }
        let fanned = self.fanned_through().min(durable.hw);
        (fanned > durable.fanned_through).then_some(fanned)
    }

    fn advance(&mut self, now: Time) {
        debug_assert!(now >= self.now, "time went backwards: {now} after {}", self.now);
        self.now = self.now.max(now);
    }

    fn enter_role(&mut self) {
        let Some(meta) = &self.meta else { return };
        // A leader epoch is led once: never again after a restart that may have lost its records.
        let led_before = self.log.durable.epochs.iter().any(|(epoch, _)| *epoch >= meta.leader_epoch)
            && self.resumable_epoch != Some(meta.leader_epoch);
        // A machine without its recent records would lead with a partial idempotency window: a retry
        // of an append it lacks the key of would be appended twice. Its runtime gives it no such meta
        // (it builds a new incarnation instead); if one comes anyway, the replica does not lead.
        if meta.leader == self.me && (led_before || self.recent_left_out) {
            self.role = Role::None;
            self.effects.push_back(Effect::NeedsFailover);
            return;
        }
        self.role = if meta.leader == self.me {
            Role::Leader(Box::new(LeaderState::new(meta, self.me, self.now)))
        } else if meta.is_replica(self.me) {
            let (leader, leader_epoch) = (meta.leader, meta.leader_epoch);
            let mut follower = FollowerState::new(leader, self.now);
            follower.outstanding = self.take_inherited_pull(leader, leader_epoch);
            Role::Follower(follower)
        } else {
            Role::None
        };
        match self.role {
            Role::Leader(_) => self.leader_start(),
            Role::Follower(_) => self.follower_maybe_pull(),
            Role::None => {}
        }
    }

    fn leave_role(&mut self) {
        if let Role::Leader(_) = self.role {
            self.leader_stop(AppendAborted::LeaderChanged);
        }
        self.role = Role::None;
    }

    /// `true` when HW moved past its checkpoint and only a checkpoint of its own (no records to carry
    /// it) can write it. Never for a broken log, which writes nothing (its timer would fire for ever).
    fn standalone_checkpoint_wanted(&self) -> bool {
        !self.broken
            && self.log.persisting.is_none()
            && (self.log.hw.min(self.log.durable.last_seq) > self.log.durable.hw
                || self.leader_fanned_unwritten(&self.log.durable).is_some())
    }

    /// The operations that empty the log before a `StartAfter` (the store starts only an empty log): the
    /// records past the checkpointed HW truncated, those at or below it given up as a retention move
    /// would. Only a follower told that the leader gave up everything it holds restarts its log, so none
    /// of them is wanted any more. Rare (a replica that was away while a retention move passed its log
    /// end): the state the batch reaches so far is rebuilt here rather than carried through every batch.
    fn give_up_before_start(&self, ops: &mut Vec<LogOp>) {
        let mut state = self.log.durable.clone();
        for op in ops.iter() {
            if state.apply(&self.channel, op).is_err() {
                return; // The batch's own check reports it.
            }
        }
        if state.last_seq > state.hw {
            ops.push(LogOp::TruncateAfter(state.hw));
        }
        if state.hw > state.retention_through {
            ops.push(LogOp::SetRetention(state.hw));
        }
    }

    /// Builds the next durable append from the pending operations, if none is in flight.
    fn maybe_persist(&mut self) {
        if self.log.persisting.is_some() || self.broken {
            return;
        }
        let (last, now) = (self.log.hw_checkpointed_at, self.now);
        self.log.checkpoint_at = self
            .standalone_checkpoint_wanted()
            .then(|| self.log.checkpoint_at.unwrap_or_else(|| checkpoint_due_at(last, now)));
        let mut ops = Vec::new();
        // Sized once (most batches are the records waiting, up to the limit); no allocation when none waits.
        let mut records: Vec<Record> =
            Vec::with_capacity(self.log.unpersisted.len().min(self.config.persist_records_max));
        let mut bytes = 0usize;
        while let Some(op) = self.log.unpersisted.front() {
            match op {
                PendingOp::Append(record) => {
                    let full = records.len() >= self.config.persist_records_max
                        || (!records.is_empty() && bytes + record.payload.len() > self.config.persist_bytes_max);
                    if full {
                        break;
                    }
                    bytes += record.payload.len();
                    let Some(PendingOp::Append(record)) = self.log.unpersisted.pop_front() else { unreachable!() };
                    records.push(record);
                }
                PendingOp::Truncate(seq) => {
                    let seq = *seq;
                    flush_records(&mut ops, &mut records);
                    ops.push(LogOp::TruncateAfter(seq));
                    self.log.unpersisted.pop_front();
                }
                PendingOp::StartAfter { seq, epoch } => {
                    let (seq, epoch) = (*seq, *epoch);
                    flush_records(&mut ops, &mut records);
                    self.give_up_before_start(&mut ops);
                    ops.push(LogOp::StartAfter { seq, epoch });
                    self.log.unpersisted.pop_front();
                }
                PendingOp::ProposeIsr { .. } => {
                    flush_records(&mut ops, &mut records);
                    let Some(PendingOp::ProposeIsr { from_version, isr }) = self.log.unpersisted.pop_front() else {
                        unreachable!()
                    };
                    ops.push(LogOp::ProposeIsr { from_version, isr });
                }
            }
        }
        flush_records(&mut ops, &mut records);
        // The state after the batch, copied from the durable one only once the batch holds an operation:
        // most calls find nothing to write, and the copy allocates (the epoch list).
        let mut next: Option<ChannelLogState> = None;
        for op in &ops {
            let state = next.get_or_insert_with(|| self.log.durable.clone());
            if state.apply(&self.channel, op).is_err() {
                // The machine only builds operations its own log accepts: reaching this is a bug, and the
                // safe reaction is to stop writing.
                debug_assert!(false, "machine built an operation its log refuses: {op:?}");
                self.persist_failed();
                return;
            }
        }
        self.append_bookkeeping_ops(&mut ops, &mut next);
        // Every operation in `ops` was applied to `next`, so `next` is set whenever `ops` is not empty.
        let Some(next) = next.filter(|_| !ops.is_empty()) else { return };
        let token =
            PersistToken { incarnation: self.incarnation, generation: self.generation, id: self.log.next_persist_id };
        self.log.next_persist_id += 1;
        let truncated_to = ops
            .iter()
            .filter_map(|op| match op {
                LogOp::TruncateAfter(seq) => Some(*seq),
                _ => None,
            })
            .min();
        self.log.persisting = Some(InFlight { token, next, truncated_to });
        self.effects.push_back(Effect::Persist { token, batch: LogBatch::new(self.channel.clone(), ops) });
    }

    /// Adds an HW checkpoint and a retention move to a batch when they are due. `next` is the state after
    /// the batch's operations, `None` while it equals the durable state (copied once an operation is added).
    fn append_bookkeeping_ops(&mut self, ops: &mut Vec<LogOp>, next: &mut Option<ChannelLogState>) {
        fn state<'a>(next: &'a Option<ChannelLogState>, durable: &'a ChannelLogState) -> &'a ChannelLogState {
            next.as_ref().unwrap_or(durable)
        }
        let base = state(next, &self.log.durable);
        let checkpoint = self.log.hw.min(base.last_seq);
        // A retention move waits for nothing: the store takes one only up to its checkpointed HW.
        let retention_wanted = self.meta.as_ref().is_some_and(|m| m.retention_through > base.retention_through);
        let due = !ops.is_empty() || retention_wanted || self.log.checkpoint_at.is_some_and(|at| self.now >= at);
        if checkpoint > base.hw && due {
            let op = LogOp::CheckpointHw(checkpoint);
            if next.get_or_insert_with(|| self.log.durable.clone()).apply(&self.channel, &op).is_ok() {
                ops.push(op);
                self.log.checkpoint_at = None;
            }
        }
        if let Some(target) = self.retention_target(state(next, &self.log.durable)) {
            let op = LogOp::SetRetention(target);
            if next.get_or_insert_with(|| self.log.durable.clone()).apply(&self.channel, &op).is_ok() {
                ops.push(op);
            }
        }
        // Fanout's progress rides with any write; a leader's is due on its own like an HW checkpoint.
        let fanned = self.fanned_through().min(state(next, &self.log.durable).hw);
        if fanned > state(next, &self.log.durable).fanned_through && (!ops.is_empty() || due) {
            let op = LogOp::CheckpointFanned(fanned);
            if next.get_or_insert_with(|| self.log.durable.clone()).apply(&self.channel, &op).is_ok() {
                ops.push(op);
                self.log.checkpoint_at = None;
            }
        }
    }

    /// Physical retention moves only at or below HW, the checkpointed HW, and (leader) the lowest ISR match.
    fn retention_target(&self, next: &ChannelLogState) -> Option<Seq> {
        let wanted = self.meta.as_ref()?.retention_through;
        if wanted <= next.retention_through {
            // The target is at most `wanted`: nothing to move (and no ISR walk on every batch).
            return None;
        }
        let mut target = wanted.min(next.hw).min(self.log.hw);
        if let Role::Leader(leader) = &self.role {
            let own = self.log.consistent_durable_end().min(next.last_seq);
            target = target.min(leader.lowest_isr_match(self.meta.as_ref()?, self.me, own));
        }
        (target > next.retention_through).then_some(target)
    }

    fn persist_failed(&mut self) {
        match self.role {
            Role::Leader(_) => {
                self.broken = true;
                self.leader_stop(AppendAborted::StorageFailed);
                self.role = Role::None;
                self.effects.push_back(Effect::StorageFailed);
            }
            _ => {
                // Storage rolled the failed batch back: forget everything not durable and pull it again.
                let durable = self.log.durable.clone();
                self.log.unpersisted.clear();
                self.log.end = durable.last_seq;
                self.log.epochs = durable.epochs.clone();
                self.log.cache.truncate_after(durable.last_seq);
                self.idempotency.truncate_after(durable.last_seq);
                if let Role::Follower(follower) = &mut self.role {
                    follower.outstanding = None;
                    follower.replaced = None;
                    follower.next_pull_at = Some(self.now + self.config.idle_pull_interval);
                }
            }
        }
    }

    /// Keeps the cache to what pulls may still need: a leader drops what every replica holds, a follower
    /// what is durable and committed (it serves no pulls; a new leader reads older records from storage).
    fn evict_cache(&mut self) {
        let keep_after = self.log.consistent_durable_end().min(self.log.hw);
        let unneeded_through = match (&self.role, &self.meta) {
            (Role::Leader(leader), Some(meta)) => keep_after.min(leader.lowest_replica_match(meta, self.me)),
            _ => keep_after,
        };
        self.log.cache.evict(unneeded_through, self.config.cache_bytes_max, keep_after);
    }

    fn send(&mut self, to: NodeId, message: ChannelMessage) {
        self.effects.push_back(Effect::Send { to, message });
    }
}

/// How long an advanced HW may go without a checkpoint when no append carries one.
const HW_CHECKPOINT_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

/// Standalone checkpoints fall due on multiples of this (in the node's time).
const CHECKPOINT_GRID_MS: u64 = 100;

/// When a standalone HW checkpoint wanted `now` falls due: a second after the last checkpoint, or now
/// if that is past, rounded up to the next multiple of [`CHECKPOINT_GRID_MS`]. On a channel quieter
/// than a message a second every commit is followed by such a checkpoint on every replica; due at
/// shared instants, a node's checkpoints of many channels go out in one timer pass and one group
/// commit instead of one each (waking the runtime and the sync for every one).
fn checkpoint_due_at(last: Time, now: Time) -> Time {
    let earliest = (last + HW_CHECKPOINT_EVERY).max(now).as_millis();
    Time::from_millis(earliest.div_ceil(CHECKPOINT_GRID_MS) * CHECKPOINT_GRID_MS)
}

fn flush_records(ops: &mut Vec<LogOp>, records: &mut Vec<Record>) {
    if !records.is_empty() {
        ops.push(LogOp::Append(std::mem::take(records)));
    }
}
