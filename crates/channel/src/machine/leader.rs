//! The leader's side: admission, seq assignment, serving pulls (with long polls), the high watermark,
//! and ISR maintenance.

use super::effect::{AppendAborted, AppendRequest, Effect, MetaChangeReason, ReadToken, RequestId};
use super::error::AppendError;
use super::message::{ChannelMessage, PullBody, PullHint, PullRequest, PullResponse};
use super::replica_map::ReplicaMap;
use super::retention::RetentionWait;
use super::{ChannelMachine, MachineConfig, ReplicaProgress, Role};
use std::collections::VecDeque;
use std::time::Duration;
use tidings_store::message::{Record, RecordKind};
use tidings_store::StoreError;
use tidings_types::{ChannelRuntimeMeta, Epoch, LeaderEpoch, NodeId, Seq, Time};

/// What the leader knows of one other replica.
#[derive(Debug)]
pub(super) struct Progress {
    /// Last seq the replica acknowledged as durable (its pull's `next_seq - 1`), once its log was found
    /// consistent with ours.
    match_seq: Seq,
    last_pull_at: Time,
    /// Last time its acknowledgement reached our log end.
    caught_up_at: Time,
    /// A pull with nothing new, answered when records arrive, HW moves, or the deadline passes.
    parked: Option<Parked>,
    /// A store read is running to answer this replica's pull.
    reading: bool,
    /// The last answer carried no records: the replica may be idling, so new records earn it a hint.
    idle: bool,
    /// The highest HW this replica was told; a pull is parked only when it already knows the current HW.
    told_hw: Seq,
    /// The membership epoch of the meta under which this leadership first counted the replica (its
    /// start's, or the one that added it): an older pull may be a late copy from the replica the node
    /// held before it left the channel, its log forgotten since, and is refused (`StaleEpoch`).
    joined: Epoch,
}

#[derive(Debug, Clone, Copy)]
struct Parked {
    pull_id: u64,
    next_seq: Seq,
    deadline: Time,
    max_bytes: usize,
}

/// An admitted append waiting for HW.
#[derive(Debug)]
pub(super) struct PendingAppend {
    id: RequestId,
    seqs: Vec<Seq>,
    /// Completes when HW reaches this seq.
    through: Seq,
    admitted_at: Time,
}

/// Leader-only state.
#[derive(Debug)]
pub(super) struct LeaderState {
    /// Seq of this leader's barrier record: nothing counts as committed before it is.
    barrier_seq: Seq,
    /// The log's last seq when this leadership began: records through it are earlier leaders' (or an
    /// earlier incarnation's), the ones a successor may have to fan out again.
    inherited_end: Seq,
    /// The barrier is durable locally: only then are records sent to followers, so a leader epoch that
    /// reached any follower is always on the leader's own disk.
    barrier_durable: bool,
    progress: ReplicaMap<Progress>,
    pub(super) pending: VecDeque<PendingAppend>,
    /// Message records this leader assigned, not yet committed: each holds a handoff slot.
    pub(super) reserved: VecDeque<Seq>,
    /// HW up to which `Committed` was reported.
    reported: Seq,
    /// How far fanout was known to have finished when this leadership (incarnation) began: fanout
    /// progress checkpointed past it is this incarnation's own (`ChannelMachine::can_leave_memory_fanning_out`).
    pub(super) fanned_from: Seq,
    /// A meta change proposed and not yet answered: (when, version it was based on).
    pub(super) proposal: Option<(Time, u64)>,
    /// Every ISR this leader proposed from the meta version in force, until a newer meta is (at most
    /// [`PENDING_ISRS_MAX`]). HW counts under each of them too: a shrink that commits late must not find
    /// committed records on fewer than MinISR of the ISR it leaves (a failover's evidence quorum relies
    /// on that). All of them, not only the last: proposals from one version race for one
    /// compare-and-set, so at most one commits — but an earlier one whose answer was lost may be the one
    /// (sim seed 241005257: a shrink committed unheard, the leader proposed another from the old version,
    /// counted HW under that one alone, and committed records only one member of the ISR in force had).
    pending_isrs: Vec<(u64, Vec<NodeId>)>,
    /// The last ISR proposed, held until its record (`LogOp::ProposeIsr`) is durable: an incarnation
    /// that comes after this one (evicted, or restarted) must know of every proposal that may be in
    /// force, and learns of them from the log (`ChannelLogState::isr_proposals`).
    unsent_proposal: Option<(ChannelRuntimeMeta, MetaChangeReason)>,
    became_at: Time,
    /// When silent ISR members were last woken by an append that could not be admitted.
    woken_at: Option<Time>,
    /// When an append refused by a fence last asked for the meta in force.
    fence_refresh_at: Option<Time>,
    /// Retention moves admitted and not yet seen in force, oldest first.
    pub(super) retention_waits: VecDeque<RetentionWait>,
}

/// Most ISRs a leader keeps proposed from one meta version (see `LeaderState::pending_isrs`): each
/// unanswered proposal counts until a newer meta is in force, and a leader that cannot learn one stops
/// proposing rather than keep more. As many as its log keeps.
const PENDING_ISRS_MAX: usize = tidings_store::message::ISR_PROPOSALS_MAX;

/// Silent ISR members are woken at most this often by refused appends.
const WAKE_INTERVAL: std::time::Duration = std::time::Duration::from_millis(100);

impl LeaderState {
    /// See [`ChannelMachine::warm`]: the state itself and its followers' progress.
    pub(super) fn warm(&self) -> u64 {
        let progress = self.progress.values().next().map_or(0, |p| p.match_seq.get());
        self.barrier_seq.get() ^ self.reported.get() ^ progress
    }

    pub(super) fn new(meta: &ChannelRuntimeMeta, me: NodeId, now: Time) -> Self {
        let progress =
            meta.replicas.iter().filter(|n| **n != me).map(|n| (*n, Progress::new(now, meta.epoch))).collect();
        Self {
            barrier_seq: Seq::new(0),
            inherited_end: Seq::new(0),
            barrier_durable: false,
            progress,
            pending: VecDeque::new(),
            reserved: VecDeque::new(),
            reported: Seq::new(0),
            fanned_from: Seq::new(0),
            proposal: None,
            pending_isrs: Vec::new(),
            unsent_proposal: None,
            became_at: now,
            woken_at: None,
            fence_refresh_at: None,
            retention_waits: VecDeque::new(),
        }
    }

    /// Since when records have waited to commit (`uncommitted`: the log holds records past HW): from the
    /// first waiting append, or, their appends timed out, from when this leader began.
    fn waiting_since(&self, uncommitted: bool) -> Option<Time> {
        self.pending.front().map(|p| p.admitted_at).or(uncommitted.then_some(self.became_at))
    }

    /// When the leader's next timer is due; `uncommitted`: its log holds records past HW.
    pub(super) fn next_timeout(&self, config: &MachineConfig, now: Time, uncommitted: bool) -> Option<Time> {
        // One pass over the followers (this runs after every input): their earliest parked deadline, and
        // their earliest ISR check still ahead — due when a follower's lag bound expires; one already past
        // was checked then.
        let (mut parked, mut isr) = (None::<Time>, None::<Time>);
        let isr_floor = self.became_at + config.isr_lag;
        for p in self.progress.values() {
            if let Some(deadline) = p.parked.map(|parked| parked.deadline) {
                parked = Some(parked.map_or(deadline, |at| at.min(deadline)));
            }
            let check = (p.caught_up_at + config.isr_lag).max(isr_floor);
            if check > now {
                isr = Some(isr.map_or(check, |at| at.min(check)));
            }
        }
        let append = self.pending.front().map(|p| p.admitted_at + config.append_timeout);
        // Records waiting to commit: wake silent ISR followers every `pull_timeout` (see
        // `wake_isr_silent_for`), from the first waiting append, or from when this leader began.
        let wake = self.waiting_since(uncommitted).map(|since| {
            let first = since + config.pull_timeout;
            self.woken_at.map_or(first, |at| first.max(at + config.pull_timeout))
        });
        let proposal = self.proposal.map(|(at, _)| at + config.proposal_timeout);
        let retention = self.retention_waits.front().map(|w| w.admitted_at + config.append_timeout);
        [parked, append, wake, isr, proposal, retention].into_iter().flatten().min()
    }

    /// `true` while this leader may yet drop a lagging follower from its ISR on its own: the ISR is
    /// larger than MinISR and the leader has not led for the ISR lag (each follower's lag is judged
    /// from the leader's start at the earliest, `maybe_propose_shrink`).
    pub(super) fn may_yet_shrink_isr(&self, meta: &ChannelRuntimeMeta, config: &MachineConfig, now: Time) -> bool {
        meta.isr.len() > usize::from(meta.min_isr) && now < self.became_at + config.isr_lag
    }

    /// Each other replica's progress at `now` (see [`ChannelMachine::replica_progress`]).
    pub(super) fn report(&self, meta: &ChannelRuntimeMeta, log_end: Seq, now: Time) -> Vec<ReplicaProgress> {
        self.progress
            .iter()
            .map(|(node, p)| ReplicaProgress {
                node: *node,
                in_isr: meta.in_isr(*node),
                match_seq: p.match_seq,
                lag: log_end.get().saturating_sub(p.match_seq.get()),
                silent_for: now.since(p.last_pull_at),
                behind_for: if p.match_seq >= log_end { Duration::ZERO } else { now.since(p.caught_up_at) },
            })
            .collect()
    }

    /// Every message at or below this seq went to fanout (or was not this leader's to fan out).
    pub(super) fn handed_through(&self) -> Seq {
        self.reported
    }

    /// The lowest match among every other replica (learners included): records at or below it are needed
    /// by no pull.
    pub(super) fn lowest_replica_match(&self, meta: &ChannelRuntimeMeta, me: NodeId) -> Seq {
        meta.replicas
            .iter()
            .filter(|n| **n != me)
            .map(|n| self.progress.get(n).map_or(Seq::new(0), |p| p.match_seq))
            .min()
            .unwrap_or(Seq::new(u64::MAX))
    }

    /// The lowest durable match among ISR members (the leader's own durable end included).
    pub(super) fn lowest_isr_match(&self, meta: &ChannelRuntimeMeta, me: NodeId, own: Seq) -> Seq {
        meta.isr
            .iter()
            .map(|n| if *n == me { own } else { self.progress.get(n).map_or(Seq::new(0), |p| p.match_seq) })
            .min()
            .unwrap_or(Seq::new(0))
    }
}

impl Progress {
    fn new(now: Time, joined: Epoch) -> Self {
        // A fresh leader gives every replica one lag period of grace before judging it.
        Progress {
            joined,
            match_seq: Seq::new(0),
            last_pull_at: now,
            caught_up_at: now,
            parked: None,
            reading: false,
            idle: false,
            told_hw: Seq::new(0),
        }
    }
}

impl ChannelMachine {
    pub(super) fn leader(&mut self) -> Option<&mut LeaderState> {
        match &mut self.role {
            Role::Leader(leader) => Some(leader),
            _ => None,
        }
    }

    /// Becoming leader: write the barrier record of this leader epoch. A leadership resumed after an
    /// eviction (`resume_leadership`) keeps the barrier its epoch started with (committed, unless it
    /// left memory stalled: then it replicates on as before): a leader epoch keeps exactly one barrier,
    /// at its start — which is how a successor tells barriers from messages it fans out again without
    /// reading them. Records past HW then are handed to fanout as a predecessor's once committed.
    pub(super) fn leader_start(&mut self) {
        let meta = self.meta.as_ref().expect("a leader has meta");
        // ISRs an earlier incarnation of this leadership proposed from the meta in force (or a newer one)
        // may be in force unheard: HW counts under them too, as it did for that incarnation.
        let recorded: Vec<(u64, Vec<NodeId>)> =
            self.log.durable.isr_proposals.iter().filter(|(version, _)| *version >= meta.version).cloned().collect();
        if let Some(leader) = self.leader() {
            leader.pending_isrs = recorded;
        }
        let meta = self.meta.as_ref().expect("a leader has meta");
        let inherited_end = self.log.end;
        let epoch_start = self.log.epochs.last().filter(|(epoch, _)| *epoch == meta.leader_epoch).map(|(_, s)| *s);
        let seq = match epoch_start {
            Some(start) => start,
            None => {
                let barrier = Record {
                    seq: self.log.end.next(),
                    kind: RecordKind::Barrier,
                    leader_epoch: meta.leader_epoch,
                    idempotency_key: None,
                    timestamp_ms: self.config.unix_ms(self.now),
                    payload: bytes::Bytes::new(),
                };
                let seq = barrier.seq;
                self.log.push_record(barrier);
                seq
            }
        };
        let hw = self.log.hw;
        let replicas: Vec<NodeId> = meta.replicas.iter().copied().filter(|n| *n != self.me).collect();
        let hint = PullHint { channel: self.channel.clone(), leader_epoch: meta.leader_epoch };
        // Records at or below the HW we start with were committed under an earlier leader, which fanned
        // them out as far as we last heard; past that (or, knowing nothing, past our HW) they are ours to
        // fan out again, at once — except records given up. (Nothing of an earlier term of this replica's
        // is still handed off: stepping down handed it over.)
        debug_assert!(self.handoff.is_idle(), "a replica starts leading with nothing handed off");
        let fanned = self.handoff.known().unwrap_or(hw);
        let given_up = meta.retention_through.max(self.log.durable.retention_through);
        let handed_through = fanned.max(given_up).min(hw);
        let durable_end = self.log.consistent_durable_end();
        if let Some(leader) = self.leader() {
            leader.barrier_seq = seq;
            leader.inherited_end = inherited_end;
            leader.barrier_durable = durable_end >= seq;
            leader.reported = handed_through;
            // A barrier right past it is no message: as good as fanned out already.
            leader.fanned_from = if handed_through.next() == seq { seq } else { handed_through };
        }
        self.leader_hand_off_committed();
        // Wake every replica: idle or evicted followers start pulling from this leader now.
        for replica in replicas {
            self.send(replica, ChannelMessage::Hint(hint.clone()));
        }
    }

    /// Stepping down (or failing): pending appends end with `reason`; parked pulls learn we are not the leader.
    pub(super) fn leader_stop(&mut self, reason: AppendAborted) {
        // What this leader saw of its fanout stays known: it reports it again if it leads again.
        let fanned = self.fanned_through();
        let Role::Leader(leader) = &mut self.role else { return };
        let pending: Vec<RequestId> = leader.pending.drain(..).map(|p| p.id).collect();
        let unreleased = leader.reserved.len();
        leader.reserved.clear();
        let parked: Vec<(NodeId, u64)> = leader
            .progress
            .iter_mut()
            .filter_map(|(n, p)| p.parked.take().map(|parked| (*n, parked.pull_id)))
            .collect();
        self.handoff.held = self.handoff.held.saturating_sub(unreleased);
        self.handoff.learn(fanned);
        if !self.handoff.is_idle() {
            self.handoff.hand_over_unfinished();
            self.effects.push_back(Effect::FanoutHandedOver);
        }
        for id in pending {
            self.effects.push_back(Effect::AppendDone { id, result: Err(reason) });
        }
        self.retention_stop(reason);
        let leader_epoch = self.meta.as_ref().map(|m| m.leader_epoch).unwrap_or_default();
        for (node, pull_id) in parked {
            let response =
                PullResponse { channel: self.channel.clone(), pull_id, leader_epoch, body: PullBody::NotLeader };
            self.send(node, ChannelMessage::PullResponse(response));
        }
    }

    /// The meta changed without a leader change: ISR or replicas, fence, retention.
    pub(super) fn leader_meta_changed(&mut self) {
        let now = self.now;
        let meta = self.meta.clone().expect("a leader has meta");
        let me = self.me;
        let Some(leader) = self.leader() else { return };
        leader.progress.retain(|n, _| meta.is_replica(*n));
        for node in meta.replicas.iter().filter(|n| **n != me) {
            leader.progress.get_or_insert_with(*node, || Progress::new(now, meta.epoch));
        }
        if leader.proposal.is_some_and(|(_, version)| meta.version > version) {
            leader.proposal = None;
        }
        leader.pending_isrs.retain(|(version, _)| meta.version <= *version);
        // A proposal from an older version than the one in force can only lose its compare-and-set.
        if leader.unsent_proposal.as_ref().is_some_and(|(next, _)| next.version <= meta.version) {
            leader.unsent_proposal = None;
        }
        self.leader_recompute_hw();
        self.retention_meta_changed();
    }

    pub(super) fn leader_append(&mut self, request: AppendRequest) -> Result<(), AppendError> {
        if let Err(error) = self.check_admission(&request) {
            match error {
                AppendError::NotEnoughReplicas { .. } => self.wake_silent_isr(),
                // A fence is transient, and the meta that clears it may have been lost on its way.
                AppendError::Fenced { .. } => self.refresh_fenced_meta(),
                _ => {}
            }
            return Err(error);
        }
        let meta = self.meta.as_ref().expect("admission checked meta");
        let leader_epoch = meta.leader_epoch;
        // Resolve idempotency first, so a conflict refuses the request before anything is written.
        let mut plan: Vec<Planned> = Vec::with_capacity(request.records.len());
        let mut keys_here: Vec<(&tidings_store::message::IdempotencyKey, u32, usize)> = Vec::new();
        for (index, record) in request.records.iter().enumerate() {
            let Some(key) = &record.idempotency_key else {
                plan.push(Planned::New);
                continue;
            };
            let crc = crc32fast::hash(&record.payload);
            if let Some(found) = self.idempotency.get(key) {
                if found.payload_crc32 != crc {
                    return Err(AppendError::IdempotencyConflict);
                }
                plan.push(Planned::Existing(found.seq));
            } else if let Some((_, first_crc, first)) = keys_here.iter().find(|(k, _, _)| *k == key) {
                if *first_crc != crc {
                    return Err(AppendError::IdempotencyConflict);
                }
                plan.push(Planned::SameAs(*first));
            } else {
                keys_here.push((key, crc, index));
                plan.push(Planned::New);
            }
        }
        let mut seqs: Vec<Seq> = Vec::with_capacity(plan.len());
        let mut assigned = Vec::new();
        for (record, planned) in request.records.into_iter().zip(plan) {
            let seq = match planned {
                Planned::Existing(seq) => seq,
                Planned::SameAs(first) => seqs[first],
                Planned::New => {
                    let record = Record {
                        seq: self.log.end.next(),
                        kind: RecordKind::Message,
                        leader_epoch,
                        idempotency_key: record.idempotency_key,
                        timestamp_ms: self.config.unix_ms(self.now),
                        payload: record.payload,
                    };
                    let seq = record.seq;
                    self.idempotency.insert(&record);
                    self.log.push_record(record);
                    assigned.push(seq);
                    seq
                }
            };
            seqs.push(seq);
        }
        let through = seqs.iter().copied().max().unwrap_or(Seq::new(0));
        self.handoff.held += assigned.len();
        let now = self.now;
        let hw = self.log.hw;
        let leader = self.leader().expect("admission checked role");
        leader.reserved.extend(assigned.iter().copied());
        if through <= hw {
            // Every record is a retry of a committed one.
            self.effects.push_back(Effect::AppendDone { id: request.id, result: Ok(seqs) });
        } else {
            leader.pending.push_back(PendingAppend { id: request.id, seqs, through, admitted_at: now });
            // An ISR member silent for a pull timeout is not long-polling: it was evicted, restarted, or
            // refused room. Tell it now — waiting a pull timeout first would outlast an append timeout
            // shorter than it, and such appends would time out one after another without a word to it.
            self.wake_isr_silent_for(self.config.pull_timeout, self.config.pull_timeout);
        }
        if !assigned.is_empty() {
            self.leader_new_records();
        }
        Ok(())
    }

    /// What every call on the leader needs first: a working log, a meta, this replica leading under it,
    /// and no write fence (a task owns the channel meanwhile).
    pub(super) fn admitting_leader(&self) -> Result<(&ChannelRuntimeMeta, &LeaderState), AppendError> {
        if self.broken {
            return Err(AppendError::StorageFailed);
        }
        let Some(meta) = &self.meta else { return Err(AppendError::NotReady) };
        let Role::Leader(leader) = &self.role else {
            return Err(AppendError::NotLeader { leader: Some(meta.leader).filter(|l| *l != self.me) });
        };
        if let Some(fence) = meta.write_fence {
            return Err(AppendError::Fenced { task: fence.task });
        }
        Ok((meta, leader))
    }

    fn check_admission(&self, request: &AppendRequest) -> Result<(), AppendError> {
        let (meta, leader) = self.admitting_leader()?;
        let records = request.records.len();
        if records == 0 {
            return Err(AppendError::Empty);
        }
        if records > self.config.request_records_max {
            return Err(AppendError::TooLarge { records, max: self.config.request_records_max });
        }
        let bytes: usize = request.records.iter().map(|r| r.payload.len()).sum();
        if bytes > self.config.request_bytes_max {
            return Err(AppendError::RequestTooLarge { bytes, max: self.config.request_bytes_max });
        }
        let alive_after = self.now - self.config.isr_alive;
        let alive = 1 + meta
            .isr
            .iter()
            .filter(|n| **n != self.me)
            .filter(|n| leader.progress.get(n).is_some_and(|p| p.last_pull_at >= alive_after))
            .count();
        if alive < usize::from(meta.min_isr) {
            return Err(AppendError::NotEnoughReplicas { alive, min_isr: meta.min_isr });
        }
        if leader.reserved.len() + records > self.config.pending_records_max {
            return Err(AppendError::Busy);
        }
        if self.handoff.held + records > self.config.handoff_slots {
            return Err(AppendError::ChannelBusy);
        }
        Ok(())
    }

    /// New records in the log: answer parked pulls, hint idle replicas.
    fn leader_new_records(&mut self) {
        let leader_epoch = self.meta.as_ref().expect("leader has meta").leader_epoch;
        let Some(leader) = self.leader() else { return };
        if !leader.barrier_durable {
            return;
        }
        let mut answer = Vec::new();
        let mut hint = Vec::new();
        for (node, progress) in leader.progress.iter_mut() {
            if let Some(parked) = progress.parked.take() {
                answer.push((*node, parked));
            } else if progress.idle {
                progress.idle = false;
                hint.push(*node);
            }
        }
        for (node, parked) in answer {
            self.answer_pull(node, parked.pull_id, parked.next_seq, parked.max_bytes);
        }
        for node in hint {
            let message = ChannelMessage::Hint(PullHint { channel: self.channel.clone(), leader_epoch });
            self.send(node, message);
        }
    }

    /// Asks the runtime for the meta in force, at most once per `WAKE_INTERVAL` however many appends the
    /// fence refuses.
    fn refresh_fenced_meta(&mut self) {
        let Role::Leader(leader) = &mut self.role else { return };
        if leader.fence_refresh_at.is_some_and(|at| self.now < at + WAKE_INTERVAL) {
            return;
        }
        leader.fence_refresh_at = Some(self.now);
        self.effects.push_back(Effect::RefreshMeta);
    }

    /// Sends a hint to the ISR members that have not pulled lately: an evicted or idle follower comes
    /// back only on news, and an append refused for want of live replicas makes none.
    fn wake_silent_isr(&mut self) {
        self.wake_isr_silent_for(self.config.isr_alive, WAKE_INTERVAL);
    }

    /// How long records may wait to commit before the leader suspects its own meta: twice the pull
    /// timeout, by which a live follower has pulled after a hint even when the first hint was lost.
    fn suspect_meta_after(&self) -> std::time::Duration {
        self.config.pull_timeout * 2
    }

    /// Hints the ISR members that have not pulled for `silent` (at most once per `every`; false when it
    /// was too soon): a follower that restarted comes back only on news, and appends waiting for it to
    /// commit make none.
    fn wake_isr_silent_for(&mut self, silent: std::time::Duration, every: std::time::Duration) -> bool {
        let (Some(meta), Role::Leader(leader)) = (&self.meta, &mut self.role) else { return false };
        if leader.woken_at.is_some_and(|at| self.now < at + every) {
            return false;
        }
        leader.woken_at = Some(self.now);
        let alive_after = self.now - silent;
        let silent: Vec<NodeId> = meta
            .isr
            .iter()
            .copied()
            .filter(|n| *n != self.me && leader.progress.get(n).is_none_or(|p| p.last_pull_at < alive_after))
            .collect();
        let hint = PullHint { channel: self.channel.clone(), leader_epoch: meta.leader_epoch };
        for node in silent {
            self.send(node, ChannelMessage::Hint(hint.clone()));
        }
        true
    }

    pub(super) fn leader_pull(&mut self, from: NodeId, request: PullRequest) {
        let Some(meta) = &self.meta else { return };
        if !meta.is_replica(from) || from == self.me {
            return;
        }
        let leader_epoch = meta.leader_epoch;
        let respond = |body| {
            ChannelMessage::PullResponse(PullResponse {
                channel: request.channel.clone(),
                pull_id: request.pull_id,
                leader_epoch,
                body,
            })
        };
        if request.leader_epoch > leader_epoch {
            // The follower knows a newer leader: our meta is stale.
            self.effects.push_back(Effect::RefreshMeta);
            return;
        }
        if !matches!(self.role, Role::Leader(_)) || self.broken {
            self.send(from, respond(PullBody::NotLeader));
            return;
        }
        if meta.replication_frozen() {
            return; // A failover is gathering evidence: count no acknowledgement, send no record.
        }
        let joined = self.leader().and_then(|l| l.progress.get(&from)).map(|p| p.joined);
        if request.leader_epoch < leader_epoch || joined.is_some_and(|joined| request.epoch < joined) {
            // Of an older leadership, or made before this leadership counted the replica: possibly a
            // late copy from the replica the node held before it left the channel and came back, which
            // claims records its new, empty log does not hold (counted, they made it look caught up,
            // took it into the ISR and toward MinISR). The follower refreshes its meta.
            self.send(from, respond(PullBody::StaleEpoch));
            return;
        }
        // Divergence check (KIP-279): the follower's last record must lie within the same epoch of ours.
        // Not for a follower whose log ends before the retention boundary: the history that would judge
        // it is given up with the records, and so is everything it holds, which it gives up for the
        // `StartAfter` its pull gets (judged by the epochs left, it was told to truncate below its HW,
        // which it refuses, and pulled the same answer for good: sim seed 273001409).
        let follower_last = Seq::new(request.next_seq.get().saturating_sub(1));
        let retention = self.log.durable.retention_through;
        if follower_last.get() > 0 && follower_last >= retention {
            // A history that knows no epoch at or below the follower's starts after it: every record
            // this leader holds past the retention boundary is of a later epoch, so the follower's past
            // the boundary diverge, and what is at or below it is given up, never read again — as far as
            // the check can tell, the follower's epoch ended at the boundary. Answered `(0, 0)` (no such
            // epoch), the follower was told to truncate below its HW, refused, and pulled the same answer
            // for good: an ISR member that never caught up again (sim seed 376003898, a lost disk).
            let (epoch, end) = match self.log.end_of_epoch(request.last_epoch) {
                (none, _) if none.get() == 0 && !self.log.epochs.is_empty() => (request.last_epoch, retention),
                found => found,
            };
            if epoch != request.last_epoch || end < follower_last {
                self.send(from, respond(PullBody::Diverging { epoch, end_seq: end }));
                return;
            }
        }
        self.withdraw_queued_hint(from);
        let now = self.now;
        let log_end = self.log.end;
        let max_bytes = usize::try_from(request.max_bytes).unwrap_or(usize::MAX).min(self.config.pull_bytes_max);
        let Some(leader) = self.leader() else { return };
        let Some(progress) = leader.progress.get_mut(&from) else { return };
        progress.match_seq = follower_last;
        progress.last_pull_at = now;
        progress.parked = None;
        if follower_last >= log_end {
            progress.caught_up_at = now;
        }
        self.leader_recompute_hw();
        self.maybe_propose_expansion(from);
        let barrier_durable = self.leader().is_some_and(|l| l.barrier_durable);
        let hw = self.log.hw;
        let knows_hw = self.leader().and_then(|l| l.progress.get(&from)).is_some_and(|p| p.told_hw >= hw);
        // Answer at once when there are records to send, or when the replica has not heard the current HW
        // (its own acknowledgement may just have advanced it) unless HW news may wait for the next records.
        let records = request.next_seq <= self.log.end && barrier_durable;
        let hw_delay = self.config.hw_hold();
        if records || (!knows_hw && hw_delay.is_zero()) {
            self.answer_pull(from, request.pull_id, request.next_seq, max_bytes);
        } else {
            let deadline = now + if knows_hw { self.config.pull_park } else { hw_delay };
            if let Some(progress) = self.leader().and_then(|l| l.progress.get_mut(&from)) {
                progress.parked =
                    Some(Parked { pull_id: request.pull_id, next_seq: request.next_seq, deadline, max_bytes });
            }
        }
    }

    /// Drops a hint to `to` queued and not yet sent: a pull of this leader epoch from `to` came first,
    /// and it is what the hint asks for. Sent anyway, the hint would only make the follower give this
    /// pull up and send another. A leadership resumed for its followers' pulls hints them at its start;
    /// two such leaders sharing one leader's place then evicted each other at once, for ever, each
    /// start's hints bringing pulls that activated it again after the other took the place.
    fn withdraw_queued_hint(&mut self, to: NodeId) {
        self.effects.retain(
            |effect| !matches!(effect, Effect::Send { to: peer, message: ChannelMessage::Hint(_) } if *peer == to),
        );
    }

    /// `true` while a store read runs to answer a follower's pull (a leader's only). Such a leader is not
    /// quiescent: evicted meanwhile, the read's answer finds no machine, and the follower waits a pull
    /// timeout for nothing.
    pub(super) fn reading_for_a_follower(&self) -> bool {
        matches!(&self.role, Role::Leader(leader) if leader.progress.values().any(|p| p.reading))
    }

    /// Answers a pull with records from `next_seq` (from the cache, or through a store read).
    fn answer_pull(&mut self, to: NodeId, pull_id: u64, next_seq: Seq, max_bytes: usize) {
        let leader_epoch = self.meta.as_ref().expect("leader has meta").leader_epoch;
        let retention = self.log.durable.retention_through;
        // Nothing leaves this leader before its barrier is on its own disk (see `barrier_durable`).
        let barrier_durable = self.leader().is_some_and(|l| l.barrier_durable);
        let body = if next_seq <= retention {
            let epoch = self.log.epoch_after(retention).unwrap_or(leader_epoch);
            PullBody::StartAfter { seq: retention, epoch, hw: self.log.hw }
        } else if next_seq > self.log.end || !barrier_durable {
            self.records_body(Vec::new())
        } else if let Some(records) = self.log.cache.range(next_seq, max_bytes) {
            self.records_body(records)
        } else {
            let token = ReadToken { incarnation: self.incarnation, generation: self.generation, follower: to, pull_id };
            let through = self.log.durable.last_seq;
            if let Some(progress) = self.leader().and_then(|l| l.progress.get_mut(&to)) {
                if progress.reading {
                    return;
                }
                progress.reading = true;
            }
            self.effects.push_back(Effect::Read { token, from: next_seq, through, max_bytes });
            return;
        };
        let idle = matches!(&body, PullBody::Records { records, .. } if records.is_empty());
        let hw = self.log.hw;
        if let Some(progress) = self.leader().and_then(|l| l.progress.get_mut(&to)) {
            progress.idle = idle;
            progress.told_hw = progress.told_hw.max(hw);
        }
        let response = PullResponse { channel: self.channel.clone(), pull_id, leader_epoch, body };
        self.send(to, ChannelMessage::PullResponse(response));
    }

    /// An answer with `records`, and what every answer tells: HW, and how far fanout finished.
    fn records_body(&self, records: Vec<Record>) -> PullBody {
        PullBody::Records { records, hw: self.log.hw, fanned_through: self.fanned_through() }
    }

    pub(super) fn leader_read_done(&mut self, token: ReadToken, result: Result<Vec<Record>, StoreError>) {
        let leader_epoch = match &self.meta {
            Some(meta) => meta.leader_epoch,
            None => return,
        };
        let Some(progress) = self.leader().and_then(|l| l.progress.get_mut(&token.follower)) else { return };
        progress.reading = false;
        // A failed read only affects this follower: it pulls again after its timeout.
        let Ok(records) = result else { return };
        let consecutive = records.windows(2).all(|w| w[0].seq.next() == w[1].seq);
        if records.is_empty() || !consecutive {
            return;
        }
        let body = self.records_body(records);
        let response = PullResponse { channel: self.channel.clone(), pull_id: token.pull_id, leader_epoch, body };
        self.send(token.follower, ChannelMessage::PullResponse(response));
    }

    /// HW = the MinISR-th highest durable match among ISR members, but only once this leader's barrier is
    /// covered.
    pub(super) fn leader_recompute_hw(&mut self) {
        // No meta, or frozen: this leader reported evidence for a failover, and what it commits now the
        // evidence cannot show.
        if self.meta.as_ref().is_none_or(ChannelRuntimeMeta::replication_frozen) {
            return;
        }
        // Our own match: the durable log, cut at any truncation not yet durable.
        let own = self.log.consistent_durable_end();
        if let Some(leader) = self.leader() {
            if !leader.barrier_durable && own >= leader.barrier_seq {
                leader.barrier_durable = true;
                self.leader_new_records();
            }
        }
        let Some(candidate) = self.quorum_candidate(own) else { return };
        let barrier_rule = !self.config.unsafe_test_switches.skip_barrier_rule;
        let Some(leader) = self.leader() else { return };
        if barrier_rule && candidate < leader.barrier_seq {
            return;
        }
        if candidate > self.log.hw {
            self.log.hw = candidate;
            self.leader_hw_advanced();
        }
    }

    /// The highest seq that MinISR members of the ISR hold durably (and of the proposed ISR too, while
    /// one is pending), with `own` as this leader's durable match; never past the log's end. `None`
    /// without meta or leadership, or with fewer ISR members than MinISR.
    fn quorum_candidate(&self, own: Seq) -> Option<Seq> {
        let (Some(meta), Role::Leader(leader)) = (&self.meta, &self.role) else { return None };
        let (me, min_isr) = (self.me, usize::from(meta.min_isr));
        let quorum_match = |isr: &[NodeId]| -> Option<Seq> {
            let matches = isr.iter().map(|n| {
                if *n == me {
                    own
                } else {
                    leader.progress.get(n).map_or(Seq::new(0), |p| p.match_seq)
                }
            });
            kth_highest(matches, min_isr)
        };
        let mut candidate = quorum_match(&meta.isr)?;
        for (_, proposed) in &leader.pending_isrs {
            candidate = candidate.min(quorum_match(proposed).unwrap_or(Seq::new(0)));
        }
        Some(candidate.min(self.log.end))
    }

    fn leader_hw_advanced(&mut self) {
        let hw = self.log.hw;
        // Followers learn the new HW right away, or within `hw_notify_delay` (sooner with new records).
        let hw_delay = self.config.hw_hold();
        let notify_by = self.now + hw_delay;
        let Some(leader) = self.leader() else { return };
        let mut done = Vec::new();
        while leader.pending.front().is_some_and(|p| p.through <= hw) {
            done.push(leader.pending.pop_front().expect("checked non-empty"));
        }
        let parked: Vec<(NodeId, Parked)> = leader
            .progress
            .iter_mut()
            .filter_map(|(n, p)| {
                if hw_delay.is_zero() {
                    return p.parked.take().map(|parked| (*n, parked));
                }
                if let Some(parked) = p.parked.as_mut() {
                    parked.deadline = parked.deadline.min(notify_by);
                }
                None
            })
            .collect();
        for pending in done {
            self.effects.push_back(Effect::AppendDone { id: pending.id, result: Ok(pending.seqs) });
        }
        self.evict_cache();
        self.leader_hand_off_committed();
        for (node, parked) in parked {
            self.answer_pull(node, parked.pull_id, parked.next_seq, parked.max_bytes);
        }
    }

    /// Hands to fanout (`Committed`) the committed messages past those handed off before: this leader's
    /// own, each holding the slot reserved at its admission, and earlier leaders' (see `handoff.rs`), at
    /// most `handoff_slots` of those, the most recent.
    fn leader_hand_off_committed(&mut self) {
        let hw = self.log.hw;
        let cap = self.config.handoff_slots;
        let Role::Leader(leader) = &mut self.role else { return };
        if leader.reported >= hw {
            return;
        }
        let first = leader.reported.next();
        leader.reported = hw;
        let inherited_through = hw.min(leader.inherited_end);
        let (mut messages, skipped) = inherited_messages(&self.log.epochs, first, inherited_through, cap);
        let inherited = messages.len();
        while leader.reserved.front().is_some_and(|seq| *seq <= hw) {
            messages.push(leader.reserved.pop_front().expect("checked non-empty"));
        }
        for (i, seq) in messages.iter().enumerate() {
            self.handoff.handed(*seq, i >= inherited);
        }
        self.effects.push_back(Effect::Committed { first, last: hw, messages, inherited, skipped });
    }

    pub(super) fn leader_timeout(&mut self) {
        let now = self.now;
        let append_timeout = self.config.append_timeout;
        let proposal_timeout = self.config.proposal_timeout;
        let Some(leader) = self.leader() else { return };
        let expired: Vec<(NodeId, Parked)> = leader
            .progress
            .iter_mut()
            .filter(|(_, p)| p.parked.is_some_and(|parked| parked.deadline <= now))
            .filter_map(|(n, p)| p.parked.take().map(|parked| (*n, parked)))
            .collect();
        let mut timed_out = Vec::new();
        while leader.pending.front().is_some_and(|p| p.admitted_at + append_timeout <= now) {
            timed_out.push(leader.pending.pop_front().expect("checked non-empty").id);
        }
        let proposal_unanswered = leader.proposal.is_some_and(|(at, _)| at + proposal_timeout <= now);
        if proposal_unanswered {
            leader.proposal = None;
        }
        for (node, parked) in expired {
            self.answer_pull(node, parked.pull_id, parked.next_seq, parked.max_bytes);
        }
        for id in timed_out {
            self.effects.push_back(Effect::AppendDone { id, result: Err(AppendAborted::Timeout) });
        }
        if proposal_unanswered {
            // It may have been taken with its answer lost: until the meta in force is known, HW counts
            // under every ISR proposed from this one (see `pending_isrs`), which may hold commits back.
            self.effects.push_back(Effect::RefreshMeta);
        }
        // Records that cannot commit without a silent follower: appends waiting for them, or (their
        // appends timed out) only the records themselves, which keep this leader from going quiet.
        let uncommitted = self.log.hw < self.log.end;
        let waiting_since = self.leader().and_then(|l| l.waiting_since(uncommitted));
        if waiting_since.is_some_and(|at| at + self.config.pull_timeout <= now) {
            // Silent for half the interval, not the whole: a follower that pulled just after the last
            // wake-up and went silent then (evicted for room, restarted) was not silent long enough at
            // the next, and waited a third — two pull timeouts without a word, longer than a healed
            // cluster's patience (sim seed 216002928, skewed clocks). While records wait to commit, a
            // follower that pulls gets them at once, so half a pull timeout of silence is no long poll.
            let woke = self.wake_isr_silent_for(self.config.pull_timeout / 2, self.config.pull_timeout);
            // Still waiting after the hints of two pull timeouts: this leader may have missed its
            // successor's meta, and the replicas it hints may no longer run the channel to tell it so
            // (removed from it, they drop its hints). Ask for the meta in force, once per wake-up: it
            // is the same meta for a leader that only waits for a slow follower, and changes nothing.
            if woke && waiting_since.is_some_and(|at| at + self.suspect_meta_after() <= now) {
                self.effects.push_back(Effect::RefreshMeta);
            }
        }
        self.maybe_propose_shrink();
        self.retention_timeout();
    }

    /// Proposes removing an ISR follower that has not caught up for longer than the lag bound — never
    /// below MinISR, one proposal at a time, and only if every record that may be committed (through HW
    /// and through the end of what earlier leaders left) stays on MinISR of the remaining members: with
    /// HW at the MinISR-th highest match, a lagging member may sit in the ISR below HW, and taking out a
    /// member that holds HW instead would leave committed records on fewer than MinISR ISR members —
    /// too few for a failover's evidence to be sure to include one.
    fn maybe_propose_shrink(&mut self) {
        let now = self.now;
        let lag = self.config.isr_lag;
        let me = self.me;
        let hw = self.log.hw;
        let own = self.log.consistent_durable_end();
        let (Some(meta), Role::Leader(leader)) = (&self.meta, &self.role) else { return };
        if leader.proposal.is_some() || meta.isr.len() <= usize::from(meta.min_isr) || meta.write_fence.is_some() {
            return;
        }
        let matched =
            |n: &NodeId| if *n == me { own } else { leader.progress.get(n).map_or(Seq::new(0), |p| p.match_seq) };
        // What may be committed: through HW, and everything earlier leaders left in this log, which one of
        // them may have committed without this leader being told (its HW trails its predecessor's until
        // its own barrier commits). Counted by HW alone, a new leader shrank out a member holding a
        // record its predecessor had committed while the member left lacked it: the record was on fewer
        // than MinISR of the new ISR, a failover's evidence from that member alone sufficed, and it
        // overwrote the record (sim seed 564000374).
        let committed_bar = hw.max(Seq::new(leader.barrier_seq.get().saturating_sub(1)));
        let keeps_commits = |out: &NodeId| {
            let holders = meta.isr.iter().filter(|n| *n != out && matched(n) >= committed_bar).count();
            holders >= usize::from(meta.min_isr)
        };
        let lagging = meta.isr.iter().filter(|n| **n != me).find(|n| {
            let late =
                leader.progress.get(n).is_some_and(|p| p.caught_up_at + lag <= now && leader.became_at + lag <= now);
            late && keeps_commits(n)
        });
        let Some(&node) = lagging else { return };
        // Copied only now: this runs on every timer of every leader.
        let meta = meta.clone();
        let mut isr = meta.isr.clone();
        isr.retain(|n| *n != node);
        self.propose_isr(&meta, isr, MetaChangeReason::ShrinkIsr { node });
    }

    /// Proposes `meta` with `isr` as the next version and membership epoch (one proposal at a time).
    fn propose_isr(&mut self, meta: &ChannelRuntimeMeta, isr: Vec<NodeId>, reason: MetaChangeReason) {
        let now = self.now;
        let Some(leader) = self.leader() else { return };
        let proposed = (meta.version, isr);
        let known = leader.pending_isrs.contains(&proposed);
        if !known && leader.pending_isrs.len() >= PENDING_ISRS_MAX {
            // Too many unanswered ISRs to count HW under: propose nothing for a proposal timeout, which
            // then asks for the meta in force (see `leader_timeout`).
            leader.proposal = Some((now, meta.version));
            return;
        }
        if !known {
            leader.pending_isrs.push(proposed.clone());
        }
        let (from_version, isr) = proposed;
        leader.proposal = Some((now, meta.version));
        let mut next = meta.clone();
        next.isr = isr.clone();
        next.version += 1;
        next.epoch = next.epoch.next();
        leader.unsent_proposal = Some((next, reason));
        // Sent once its record is durable (`leader_send_recorded_proposal`): the leader's next
        // incarnation counts HW under it too (sim seed 612000817: a leader evicted with a shrink out came
        // back under the meta it shrank from, committed a record on the member the shrink left out, and
        // a failover on evidence from the ISR in force lost it).
        self.log.record_isr_proposal(from_version, isr);
        self.maybe_persist();
    }

    /// Sends the ISR proposal held for its record, once the record is durable.
    pub(super) fn leader_send_recorded_proposal(&mut self) {
        let Role::Leader(leader) = &mut self.role else { return };
        let recorded = leader.unsent_proposal.as_ref().is_some_and(|(next, _)| {
            self.log.durable.isr_proposals.iter().any(|(version, isr)| *version + 1 == next.version && *isr == next.isr)
        });
        if !recorded {
            return;
        }
        let Some((next, reason)) = leader.unsent_proposal.take() else { return };
        let expected_version = next.version - 1;
        self.effects.push_back(Effect::ProposeMeta { expected_version, meta: Box::new(next), reason });
    }

    /// Proposes adding a replica to the ISR once it proved, under this leader and epoch, that it holds
    /// everything committed and has caught up with our log end.
    fn maybe_propose_expansion(&mut self, node: NodeId) {
        let (Some(meta), Role::Leader(leader)) = (&self.meta, &self.role) else { return };
        if meta.in_isr(node) || meta.write_fence.is_some() {
            return;
        }
        let hw = self.log.hw;
        let end = self.log.end;
        let Some(progress) = leader.progress.get(&node) else { return };
        let proven = progress.match_seq >= hw && progress.match_seq >= end && hw >= leader.barrier_seq;
        if leader.proposal.is_some() || !proven {
            return;
        }
        let match_seq = progress.match_seq;
        // Copied only now: this runs on every pull a leader takes.
        let meta = meta.clone();
        let mut isr = meta.isr.clone();
        isr.push(node);
        self.propose_isr(&meta, isr, MetaChangeReason::ExpandIsr { node, match_seq, hw });
    }
}

/// How one record of a request is appended.
enum Planned {
    /// A new record.
    New,
    /// A retry of a record already in the log.
    Existing(Seq),
    /// The same key and payload as an earlier record of this request.
    SameAs(usize),
}

/// The message records among seqs `first..=last` of a log whose epochs start at `epochs` (each with its
/// leader's barrier), at most `cap` of them, the last ones; and how many more there were.
fn inherited_messages(epochs: &[(LeaderEpoch, Seq)], first: Seq, last: Seq, cap: usize) -> (Vec<Seq>, u64) {
    if first > last {
        return (Vec::new(), 0);
    }
    let barriers = epochs.iter().filter(|(_, start)| (first..=last).contains(start)).count() as u64;
    let messages = last.get() - first.get() + 1 - barriers;
    let mut seqs = Vec::new();
    let mut seq = last;
    while seq >= first && seq.get() > 0 && seqs.len() < cap {
        if epochs.binary_search_by_key(&seq, |(_, start)| *start).is_err() {
            seqs.push(seq);
        }
        seq = Seq::new(seq.get() - 1);
    }
    seqs.reverse();
    let skipped = messages - seqs.len() as u64;
    (seqs, skipped)
}

/// The `k`-th highest of `values` (1 for the highest), if there are that many. Sorted on the stack for
/// an ISR of a usual size: the HW is recomputed on every acknowledgement.
fn kth_highest(values: impl ExactSizeIterator<Item = Seq>, k: usize) -> Option<Seq> {
    const ON_STACK: usize = 8;
    let len = values.len();
    if k == 0 || k > len {
        return None;
    }
    let mut heap = Vec::new();
    let mut stack = [Seq::new(0); ON_STACK];
    let all: &mut [Seq] = if len <= ON_STACK {
        for (slot, value) in stack.iter_mut().zip(values) {
            *slot = value;
        }
        &mut stack[..len]
    } else {
        heap.extend(values);
        &mut heap
    };
    all.sort_unstable_by(|a, b| b.cmp(a));
    Some(all[k - 1])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seqs(values: &[u64]) -> Vec<Seq> {
        values.iter().map(|v| Seq::new(*v)).collect()
    }

    #[test]
    fn kth_highest_counts_from_the_top_on_the_stack_and_past_it() {
        let few = seqs(&[5, 9, 7]);
        assert_eq!(kth_highest(few.iter().copied(), 1), Some(Seq::new(9)));
        assert_eq!(kth_highest(few.iter().copied(), 2), Some(Seq::new(7)));
        assert_eq!(kth_highest(few.iter().copied(), 3), Some(Seq::new(5)));
        assert_eq!(kth_highest(few.iter().copied(), 4), None, "fewer values than asked for");
        assert_eq!(kth_highest(few.iter().copied(), 0), None);
        let many = seqs(&[3, 1, 4, 1, 5, 9, 2, 6, 5, 3]);
        assert_eq!(kth_highest(many.iter().copied(), 2), Some(Seq::new(6)));
        assert_eq!(kth_highest(many.iter().copied(), 10), Some(Seq::new(1)));
    }
}
