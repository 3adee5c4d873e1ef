//! Many raft-rs groups on one node, driven sans-IO.
//!
//! # Calling contract
//!
//! Inputs: [`MultiRaft::handle_tick`] (the logical time), [`MultiRaft::handle_message`] (from another
//! node), [`MultiRaft::propose`] / [`MultiRaft::read_index`] (API calls), and
//! [`MultiRaft::handle_synced`] (the runtime made the stores durable). Outputs: [`SlotEffect`]s drained
//! with [`MultiRaft::poll_effect`] after every input.
//!
//! The driver writes raft entries and applied metadata to the stores it was given (visible at once, as
//! raft-rs requires of its `Storage`), but never syncs: it asks for a sync with [`SlotEffect::Sync`] and
//! releases what depends on durability — raft-rs's `persisted_messages` (votes, acknowledgements) and
//! `on_persist_ready` — only when [`MultiRaft::handle_synced`] confirms it. One sync covers the writes of
//! every group. Committed entries are applied in bounded batches, each one atomic write with the group's
//! applied index; raft-rs hands out only entries persisted locally, so the applied index is never ahead of
//! the durable log.
//!
//! Elections are deterministic yet randomized: every time raft-rs resets a group's election clock, its
//! own (thread-local) draw is replaced by one from the group's seeded stream in
//! `[election_ticks_min, 2 * election_ticks_min)`, so the same seed gives the same run and members whose
//! timeouts once coincided (a split vote) draw apart. Pre-vote and check-quorum are on; `batch_append`
//! is off (see `open_group`).
//!
//! Proposals of one round (this node's and those forwarded to it) are proposed per group as batch entries
//! (module `batch`) when the round is processed. Membership changes ([`MultiRaft::change_membership`]) are
//! ConfChangeV2 entries; a node a leader reaches for a group it does not hold gets an empty replica that a
//! snapshot initializes, and a replica outside its leader's configuration is destroyed only on that
//! leader's `SlotBody::Removed` (see `removed_by_peer`), leaving a tombstone. A voter whose vote a
//! committed change takes holds that change back until then (module `retiring`).

mod batch;
mod config;
mod effect;
mod forwarding;
mod guard;
mod lifecycle;
mod membership;
mod message;
mod ready;
mod retiring;
mod snapshot;

pub use config::MultiRaftConfig;
pub use effect::{ProposalId, ProposeError, ReadId, SlotEffect};
pub use membership::MembershipChange;
pub use message::{SlotBody, SlotMessage};

use crate::command::Command;
use crate::fsm::{GroupConf, SlotFsm};
use protobuf::Message as _;
use raft::prelude::{ConfState, Message, MessageType};
use raft::{RawNode, StateRole, Storage};
use snapshot::{Reassembly, SlotSnapshots};
use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use tidings_router::{GroupObservation, HashToSlot};
use tidings_store::{GroupStorage, MetaStore, MetaWriteBatch, Placement, RaftLogBatch, RaftLogStore, StoreError};
use tidings_types::{ConfigEpoch, DetRng, GroupId, HashSlot, NodeId, TakenForwards, Time};

/// What raft status shows of one group on this node (for operators and the controller).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupStatus {
    /// The group.
    pub group: GroupId,
    /// The leader this node knows.
    pub leader: Option<NodeId>,
    /// Current term.
    pub term: u64,
    /// Commit index.
    pub commit: u64,
    /// Applied index.
    pub applied: u64,
    /// Voters of the applied configuration (the incoming ones while joint), ascending.
    pub voters: Vec<NodeId>,
    /// Learners of the applied configuration, ascending.
    pub learners: Vec<NodeId>,
    /// On the leader: each peer's match index and whether it was recently active.
    pub peers: Vec<(NodeId, u64, bool)>,
    /// The configuration is joint (a membership change has not left its joint state).
    pub joint: bool,
    /// On the leader: a leadership transfer in flight, to this node.
    pub transferring: Option<NodeId>,
    /// The group's configuration epoch: the raft index of the membership change that made the
    /// configuration in force (0 for the bootstrap membership).
    pub config_epoch: ConfigEpoch,
    /// The raft index of a committed membership change that takes this replica's vote, which it holds
    /// unapplied (with everything after it) until the group releases the replica: its vote may still
    /// be needed by a member that comes back from a crash without that commit.
    pub held_back_from: Option<u64>,
}

/// A proposal of this node waiting for its outcome.
#[derive(Debug)]
struct PendingProposal {
    group: GroupId,
    deadline: Time,
}

/// An authoritative read waiting for the apply to reach its index.
#[derive(Debug)]
struct PendingRead {
    id: ReadId,
    deadline: Time,
    index: Option<u64>,
}

/// Writes of one ready awaiting a sync.
#[derive(Debug)]
struct AwaitingSync {
    token: u64,
    group: GroupId,
    number: u64,
    messages: Vec<Message>,
    /// Index of a snapshot installed by this ready: the group counts as applied through it once durable.
    snapshot_index: Option<u64>,
    /// The commit index of the hard state this ready wrote, if it wrote one.
    commit: Option<u64>,
}

struct Group {
    raw: RawNode<GroupStorage>,
    fsm: SlotFsm,
    reads: VecDeque<PendingRead>,
    observed: Option<GroupObservation>,
    /// Draws the election timeouts of this group on this node.
    election_rng: DetRng,
    /// Election timeouts are drawn in `[election_tick, 2 * election_tick)`.
    election_tick: usize,
    /// Raft index of the membership change in force (0: the bootstrap membership).
    config_epoch: u64,
    /// The highest configuration epoch this replica knows of: its own, or one its peers' messages named
    /// (see [`SlotBody::known_epoch`]). Never below `config_epoch`.
    known_epoch: u64,
    /// The commit index this replica's store holds durably: what a restart comes back with. A leader
    /// sends followers a commit index before its own hard state holding it is synced.
    durable_commit: u64,
    /// Committed entries not applied, from a membership change that takes this replica's vote on
    /// (module `retiring`); empty otherwise.
    held_back: Vec<raft::prelude::Entry>,
}

impl Group {
    /// The membership in force, as the FSM and the controller see it.
    fn conf(&self) -> GroupConf {
        let conf = self.raw.store().initial_state().map(|s| s.conf_state).unwrap_or_default();
        let sorted = |ids: Vec<u64>| {
            let mut nodes: Vec<NodeId> = ids.into_iter().map(NodeId::new).collect();
            nodes.sort_unstable();
            nodes
        };
        GroupConf {
            voters: sorted(conf.voters),
            learners: sorted(conf.learners.into_iter().chain(conf.learners_next).collect()),
            joint: !conf.voters_outgoing.is_empty(),
            config_epoch: ConfigEpoch::new(self.config_epoch),
        }
    }

    /// The membership change at `epoch` is in force (applied, or installed by a snapshot).
    fn set_config_epoch(&mut self, epoch: u64) {
        self.config_epoch = epoch;
        self.known_epoch = self.known_epoch.max(epoch);
    }

    /// `true` if `node` is in the configuration in force in any role.
    fn has_member(&self, node: u64) -> bool {
        self.raw.raft.prs().get(node).is_some()
    }

    /// On a leader: `true` once every other member heard from lately (raft-rs `recent_active`) reported a
    /// commit index at or past the membership change in force (`config_epoch`), so each has applied it.
    /// A member silent meanwhile is not waited for: one down for good (a node refused for its storage
    /// identity) would keep every removed replica of the group for ever.
    fn members_committed_conf(&self) -> bool {
        let (me, epoch) = (self.raw.raft.id, self.config_epoch);
        let applied = |progress: &raft::Progress| !progress.recent_active || progress.committed_index >= epoch;
        self.raw.raft.prs().iter().all(|(id, progress)| *id == me || applied(progress))
    }

    /// One logical tick. raft-rs does not campaign while a committed membership change is unapplied; a
    /// replica holding back its removal campaigns all the same (module `retiring`).
    fn tick(&mut self) {
        let raft = &self.raw.raft;
        let timing_out = raft.election_elapsed + 1 >= raft.randomized_election_timeout();
        self.raw.tick();
        let raft = &mut self.raw.raft;
        if timing_out && !self.held_back.is_empty() && raft.state != StateRole::Leader && raft.promotable() {
            raft.campaign(raft::CAMPAIGN_PRE_ELECTION);
        }
        self.seed_election_timeout();
    }

    /// raft-rs draws a new election timeout from a thread-local RNG whenever it resets its election
    /// clock; each draw is replaced by one from the group's seeded stream, so a run is reproducible and
    /// members that once timed out together (a split vote) draw different timeouts next round.
    fn seed_election_timeout(&mut self) {
        let raft = &mut self.raw.raft;
        if raft.state != StateRole::Leader && raft.election_elapsed == 0 {
            let spread = u64::try_from(self.election_tick).unwrap_or(1).max(1);
            let extra = usize::try_from(self.election_rng.below(spread)).unwrap_or(0);
            raft.set_randomized_election_timeout(self.election_tick + extra);
        }
    }
}

/// The multi-raft driver of one node. See the [module docs](self).
pub struct MultiRaft {
    config: MultiRaftConfig,
    now: Time,
    last_tick: Time,
    logs: Arc<RaftLogStore>,
    meta: MetaStore,
    /// The table the cluster was built with: the FSMs decide slot ownership from it and their records.
    genesis: Arc<HashToSlot>,
    /// The table this node routes with: the genesis table plus every slot migration it learned of.
    table: Arc<HashToSlot>,
    groups: BTreeMap<GroupId, Group>,
    effects: VecDeque<SlotEffect>,
    proposals: BTreeMap<u64, PendingProposal>,
    /// Pending proposals per group (the bound is per group).
    pending_per_group: BTreeMap<GroupId, usize>,
    next_proposal: u64,
    next_read: u64,
    next_transfer: u64,
    /// Readies whose writes wait for a sync, in token order (0 = not yet covered by a requested sync).
    awaiting: VecDeque<AwaitingSync>,
    /// The raft log writes of every group in this round, written as one batch at its end: every atomic
    /// batch costs the backend a log buffer write under a lock the whole process shares (sled's
    /// `apply_batch`), so one per round instead of one per group and ready.
    round_writes: RaftLogBatch,
    /// The FSM writes of this round, one batch per group and apply, written at its end in the same batch
    /// as the raft logs' changes. A group's FSM reads what it wrote: a group that applies again in the
    /// round has them written first.
    round_meta: Vec<(GroupId, MetaWriteBatch)>,
    /// A write to the slot store failed: this node's slot replicas stop (nothing more is persisted,
    /// acknowledged or applied), since raft-rs already counts the lost writes as handed to storage. The
    /// store holds what was written before; a restart resumes from it.
    storage_failed: bool,
    /// Inputs arrived since the last processing round: [`MultiRaft::poll_effect`] runs one first.
    dirty: bool,
    next_sync: u64,
    sync_requested: bool,
    reassembly: Reassembly,
    logger: slog::Logger,
    /// Raft messages from the wire dropped before raft-rs saw them (undecodable, or ones a correct peer
    /// never sends: see `guard`).
    refused_messages: u64,
    /// Raft messages of an older term than the group's (raft-rs ignores or answers them), and answers
    /// of an older configuration epoch than the group knows (dropped).
    stale_messages: u64,
    /// Proposals of this round, per group this node leads, with the node that hears a refusal: proposed
    /// as batch entries when the round is processed.
    queued: BTreeMap<GroupId, Vec<(NodeId, batch::Queued)>>,
    /// Seeds the election streams of groups opened later (created when a leader adds this node).
    rng: DetRng,
    /// Groups whose membership no longer includes this node: destroyed at the end of the round.
    leaving: Vec<GroupId>,
    /// Replicas let go of (out of memory) whose stored state could not be destroyed yet, with the
    /// configuration epoch that removed this node: tried again every round (see `destroy_leaving`).
    destroying: BTreeMap<GroupId, u64>,
    /// Snapshots sent and not yet acknowledged, per (group, follower): when to give up on them. raft-rs
    /// sends nothing more to a follower while its snapshot is outstanding, and the transport may lose it.
    snapshots_sent: BTreeMap<(GroupId, NodeId), Time>,
    /// When replicas outside their own configuration next ask whether they are still members.
    next_member_check: Time,
    /// Proposals other nodes forwarded here lately: a copy delivered again is dropped.
    taken_forwards: TakenForwards,
}

/// The genesis table moved forward by every placement the store recorded (and the genesis placements
/// recorded where none is, so local reads find every slot).
fn learned_table(meta: &MetaStore, genesis: &HashToSlot) -> Result<HashToSlot, StoreError> {
    crate::fsm::migration::seed_placements(meta, genesis)?;
    let mut table = genesis.clone();
    for (slot, placement) in meta.placements()? {
        if let Some(next) = table.with_owner(slot, placement.group, placement.epoch) {
            table = next;
        }
    }
    Ok(table)
}

/// Most proposals in one batch entry (the entry's bytes are bounded by `proposal_bytes_max` too).
const BATCH_PROPOSALS_MAX: usize = 256;

/// How often a replica outside its own configuration asks its leader whether it is still a member.
const MEMBER_CHECK_INTERVAL: std::time::Duration = std::time::Duration::from_secs(3);

/// The answer of a leader to a replica its configuration does not include — only once every member
/// heard from lately knows the change that left it out committed (each applies it then). Until they do, they count the
/// replica in the configuration they hold, a joint one needs it for a quorum of the old voters, and
/// were the leader lost meanwhile (its disk with it), the rest could not elect without it (simulator
/// seed 351001530). The replica asks again (`MEMBER_CHECK_INTERVAL`), or its next message asks.
///
/// Only once this leader's own store holds the change in force as committed: a voter the end of a joint
/// configuration removed still votes in it, and a leader that crashed before syncing that commit comes
/// back joint and needs the outgoing voters for an election (sim seed 518000858: a group of one voter
/// moved to another node, whose crash left it joint with its only outgoing voter destroyed).
fn removal(g: &Group) -> Option<SlotBody> {
    (g.members_committed_conf() && g.durable_commit >= g.config_epoch)
        .then(|| SlotBody::Removed { config_epoch: g.config_epoch, last_index: g.raw.raft.raft_log.last_index() })
}

impl MultiRaft {
    /// A driver over `logs` and `meta` (which share one durable backend, so one sync covers both) for the
    /// given groups and their initial voters (the bootstrap membership). Groups already in the raft log
    /// store keep their state, including groups this node was added to later; a group this node left (a
    /// tombstone) is not brought back.
    pub fn open(
        config: MultiRaftConfig,
        logs: Arc<RaftLogStore>,
        meta: MetaStore,
        table: HashToSlot,
        groups: &[(GroupId, Vec<NodeId>)],
        now: Time,
    ) -> Result<Self, StoreError> {
        let genesis = Arc::new(table);
        let learned = learned_table(&meta, &genesis)?;
        let table = Arc::new(learned);
        logs.set_snapshot_source(Arc::new(SlotSnapshots {
            meta: meta.clone(),
            logs: Arc::downgrade(&logs),
            bytes_max: config.reassembly_bytes_max,
        }));
        let reassembly = Reassembly::new(config.reassembly_bytes_max, config.reassemblies_max);
        let mut driver = MultiRaft {
            now,
            last_tick: now,
            logs,
            meta,
            genesis,
            table,
            groups: BTreeMap::new(),
            effects: VecDeque::new(),
            proposals: BTreeMap::new(),
            pending_per_group: BTreeMap::new(),
            // Ids of this start live in their own range: see `MultiRaftConfig::boot_id`.
            next_proposal: ((config.boot_id & 0xffff_ffff) << 32) | 1,
            next_read: ((config.boot_id & 0xffff_ffff) << 32) | 1,
            // A restarted sender numbering its chunked messages from 1 again had a late chunk of its
            // earlier start's transfer of the same number (and count) taken into a new one: the
            // snapshot reassembled from both did not decode (sim seed 580000053).
            next_transfer: ((config.boot_id & 0xffff_ffff) << 32) | 1,
            awaiting: VecDeque::new(),
            round_writes: RaftLogBatch::new(),
            round_meta: Vec::new(),
            storage_failed: false,
            dirty: false,
            next_sync: 1,
            sync_requested: false,
            reassembly,
            refused_messages: 0,
            stale_messages: 0,
            logger: slog::Logger::root(slog::Discard, slog::o!()),
            rng: DetRng::new(config.seed),
            queued: BTreeMap::new(),
            leaving: Vec::new(),
            destroying: BTreeMap::new(),
            snapshots_sent: BTreeMap::new(),
            next_member_check: now,
            taken_forwards: TakenForwards::default(),
            config,
        };
        for (group, voters) in groups {
            let conf = ConfState { voters: voters.iter().map(|n| n.get()).collect(), ..Default::default() };
            driver.logs.bootstrap_group(*group, conf)?;
        }
        for group in driver.logs.groups() {
            driver.open_group(group)?;
        }
        Ok(driver)
    }

    /// Starts driving `group`, whose log exists in the raft log store.
    fn open_group(&mut self, group: GroupId) -> Result<(), StoreError> {
        let election_rng = self.rng.child(u64::from(group.get()));
        let election_tick = self.config.election_ticks_min;
        let applied = self.meta.applied_index(group)?;
        let config_epoch = self.meta.config_epoch(group)?;
        let raft_config = raft::Config {
            id: self.config.node.get(),
            election_tick,
            heartbeat_tick: self.config.heartbeat_ticks,
            min_election_tick: election_tick,
            max_election_tick: 2 * election_tick,
            applied,
            max_size_per_msg: self.config.max_size_per_msg,
            max_inflight_msgs: self.config.max_inflight_msgs,
            check_quorum: true,
            pre_vote: true,
            // Off: raft-rs 0.7 merges an empty MsgAppend (a probe) with a later one carrying entries into a
            // message whose entries start at its own index, so a follower acknowledges one entry more than it
            // holds (found by the simulator: "to_commit out of range" on the next heartbeat).
            batch_append: false,
            ..Default::default()
        };
        let storage = self.logs.group(group)?;
        let raw = RawNode::new(&raft_config, storage, &self.logger).map_err(raft_error)?;
        let fsm = SlotFsm::new(group, self.meta.clone(), self.config.fsm);
        // raft-rs starts from the stored hard state's commit index.
        let durable_commit = raw.raft.raft_log.committed;
        let mut g = Group {
            raw,
            fsm,
            reads: VecDeque::new(),
            observed: None,
            election_rng,
            election_tick,
            config_epoch,
            known_epoch: config_epoch,
            durable_commit,
            held_back: Vec::new(),
        };
        g.seed_election_timeout();
        self.groups.insert(group, g);
        Ok(())
    }

    /// The groups this node serves.
    pub fn groups(&self) -> impl Iterator<Item = GroupId> + '_ {
        self.groups.keys().copied()
    }

    /// The hash-slot table this node routes with: the genesis table plus every migration learned.
    pub fn table(&self) -> Arc<HashToSlot> {
        Arc::clone(&self.table)
    }

    /// The hash-slot table the cluster was built with (the FSMs' default ownership).
    pub fn genesis(&self) -> &HashToSlot {
        &self.genesis
    }

    /// Learns that `slot` lives in `placement.group` from `placement.epoch` on (a group's stale-route
    /// answer, or a migration applied here): routes and local reads follow it, also after a restart.
    /// `false` if this node knew that epoch or a later one already.
    pub fn learn_slot_owner(&mut self, slot: HashSlot, placement: Placement) -> bool {
        if !self.advance_table(slot, placement) {
            return false;
        }
        let mut batch = tidings_store::MetaWriteBatch::new();
        batch.place(slot, placement);
        if let Err(error) = self.meta.write(&batch) {
            tracing::warn!(%error, %slot, "cannot record a slot placement (kept in memory)");
        }
        true
    }

    /// The leader this node knows for `group`.
    pub fn leader(&self, group: GroupId) -> Option<NodeId> {
        let raw = &self.groups.get(&group)?.raw;
        (raw.raft.leader_id != 0).then(|| NodeId::new(raw.raft.leader_id))
    }

    /// `true` once a write to the slot store failed: this node's slot replicas persist, acknowledge and
    /// apply nothing more (proposals through them time out, the other members go on without them) until
    /// the node restarts from what the store holds.
    pub fn storage_failed(&self) -> bool {
        self.storage_failed
    }

    /// Raft messages from the wire refused since start: undecodable, naming another sender or receiver,
    /// or ones a correct peer never sends (raft-rs would abort on them). They changed nothing.
    pub fn refused_messages(&self) -> u64 {
        self.refused_messages
    }

    /// Raft messages received with a term older than their group's current one (raft-rs ignores them or
    /// answers so their sender steps down; they change no state here), and answers dropped for naming
    /// an older configuration epoch than their group knows (see [`SlotBody::known_epoch`]).
    pub fn stale_messages(&self) -> u64 {
        self.stale_messages
    }

    /// `true` if this node leads `group`.
    pub fn is_leader(&self, group: GroupId) -> bool {
        self.groups.get(&group).is_some_and(|g| g.raw.raft.state == StateRole::Leader)
    }

    /// `true` if this node's replica of `group` is fit for reads that must not lag far behind the group
    /// (a sender check): it has applied something, it knows a leader (a replica cut off from its leader
    /// forgets it within an election timeout or two; one that restarted knows none until the leader
    /// reaches it), and it has applied everything it knows committed.
    pub fn reads_fresh(&self, group: GroupId) -> bool {
        let Some(g) = self.groups.get(&group) else { return false };
        let raft = &g.raw.raft;
        raft.leader_id != 0 && raft.raft_log.applied > 0 && raft.raft_log.applied >= raft.raft_log.committed
    }

    /// The last index applied by `group`'s FSM on this node.
    pub fn applied_index(&self, group: GroupId) -> Option<u64> {
        self.groups.get(&group).map(|g| g.raw.raft.raft_log.applied)
    }

    /// Raft status of `group` on this node.
    pub fn status(&self, group: GroupId) -> Option<GroupStatus> {
        let g = self.groups.get(&group)?;
        let raw = &g.raw;
        let conf = g.conf();
        let mut peers: Vec<(NodeId, u64, bool)> = if raw.raft.state == StateRole::Leader {
            raw.raft.prs().iter().map(|(id, p)| (NodeId::new(*id), p.matched, p.recent_active)).collect()
        } else {
            Vec::new()
        };
        peers.sort();
        Some(GroupStatus {
            group,
            leader: (raw.raft.leader_id != 0).then(|| NodeId::new(raw.raft.leader_id)),
            term: raw.raft.term,
            commit: raw.raft.raft_log.committed,
            applied: raw.raft.raft_log.applied,
            voters: conf.voters,
            learners: conf.learners,
            peers,
            joint: conf.joint,
            transferring: raw.raft.lead_transferee.map(NodeId::new),
            config_epoch: conf.config_epoch,
            held_back_from: g.held_back.first().map(|entry| entry.index),
        })
    }

    /// Proposes a membership change of `group` on this node, its leader. It applies like any entry; the
    /// caller watches [`MultiRaft::status`] for its effect (raft-rs drops a change proposed while another
    /// has not applied yet, so the caller proposes again when the status still asks for it).
    pub fn change_membership(
        &mut self,
        now: Time,
        group: GroupId,
        change: &MembershipChange,
    ) -> Result<(), ProposeError> {
        self.advance(now);
        let g = self.groups.get_mut(&group).ok_or(ProposeError::UnknownGroup { group })?;
        if g.raw.raft.state != StateRole::Leader {
            let hint = (g.raw.raft.leader_id != 0).then(|| NodeId::new(g.raw.raft.leader_id));
            return Err(ProposeError::NotLeader { group, hint });
        }
        if change.removes_voter(self.config.node, &g.conf()) {
            // Leadership moves first: raft-rs does not step a leader that removed itself down.
            return Err(ProposeError::LeaderWouldLeave { group });
        }
        g.raw.propose_conf_change(Vec::new(), change.to_conf_change()).map_err(|_| ProposeError::Dropped)?;
        self.dirty = true;
        Ok(())
    }

    /// Starts moving `group`'s leadership to `to` (this node must lead it; raft-rs catches `to` up first
    /// and gives up after an election timeout). `false` if this node does not lead the group.
    pub fn transfer_leader(&mut self, now: Time, group: GroupId, to: NodeId) -> bool {
        self.advance(now);
        let Some(g) = self.groups.get_mut(&group) else { return false };
        if g.raw.raft.state != StateRole::Leader {
            return false;
        }
        g.raw.transfer_leader(to.get());
        self.dirty = true;
        true
    }

    /// Proposes `command` through `leader`, for a group this node does not serve (the caller resolved the
    /// leader with its route table). The outcome arrives as [`SlotEffect::ProposalDone`]; a `NotLeader`
    /// answer carries the hint to follow.
    pub fn propose_remote(&mut self, now: Time, command: &Command, leader: NodeId) -> Result<ProposalId, ProposeError> {
        self.advance(now);
        let (group, data) = self.prepare(command)?;
        let id = self.track(group);
        self.send(leader, group, SlotBody::Forward { origin: self.config.node, id, command: data });
        Ok(ProposalId(id))
    }

    /// Routes and encodes a command, checking its size and the group's pending bound.
    fn prepare(&self, command: &Command) -> Result<(GroupId, Vec<u8>), ProposeError> {
        let group = command.group_under(&self.table);
        self.prepare_in(group, command)
    }

    fn prepare_in(&self, group: GroupId, command: &Command) -> Result<(GroupId, Vec<u8>), ProposeError> {
        let data = command.encode();
        if data.len() > self.config.proposal_bytes_max {
            return Err(ProposeError::TooLarge { bytes: data.len(), max: self.config.proposal_bytes_max });
        }
        if self.pending(group) >= self.config.pending_proposals_max {
            return Err(ProposeError::Busy { group });
        }
        Ok((group, data))
    }

    /// Registers a proposal of `group` waiting for its outcome; returns its id.
    fn track(&mut self, group: GroupId) -> u64 {
        let id = self.next_proposal;
        self.next_proposal += 1;
        let deadline = self.now + self.config.request_timeout;
        self.proposals.insert(id, PendingProposal { group, deadline });
        *self.pending_per_group.entry(group).or_default() += 1;
        id
    }

    /// Next effect to carry out. Inputs are processed in one round the first time this is called after
    /// them, so a burst of proposals becomes one raft batch and one sync.
    pub fn poll_effect(&mut self) -> Option<SlotEffect> {
        if self.effects.is_empty() && self.dirty {
            self.dirty = false;
            self.process_all();
        }
        self.effects.pop_front()
    }

    /// When [`MultiRaft::handle_tick`] should next be called.
    pub fn poll_timeout(&self) -> Time {
        self.last_tick + self.config.tick_interval
    }

    /// Advances logical time: ticks every group once per elapsed tick interval (at most a few at a time),
    /// and fails requests past their deadline.
    pub fn handle_tick(&mut self, now: Time) {
        self.advance(now);
        let mut ticks = 0;
        while self.last_tick + self.config.tick_interval <= self.now && ticks < 8 {
            self.last_tick = self.last_tick + self.config.tick_interval;
            for group in self.groups.values_mut() {
                group.tick();
            }
            ticks += 1;
        }
        if self.last_tick + self.config.tick_interval <= self.now {
            self.last_tick = self.now; // Far behind: do not replay the missed ticks.
        }
        self.expire_requests();
        self.retry_lost_snapshots();
        if self.now >= self.next_member_check {
            self.next_member_check = self.now + MEMBER_CHECK_INTERVAL;
            self.check_membership();
        }
        self.dirty = true;
    }

    /// A snapshot the follower has not acknowledged in time is reported failed, so raft-rs probes the
    /// follower again and sends a new one if it still needs it.
    fn retry_lost_snapshots(&mut self) {
        let now = self.now;
        let expired: Vec<(GroupId, NodeId)> =
            self.snapshots_sent.iter().filter(|(_, deadline)| **deadline <= now).map(|(key, _)| *key).collect();
        for (group, to) in expired {
            self.snapshots_sent.remove(&(group, to));
            let Some(g) = self.groups.get_mut(&group) else { continue };
            let waiting = g.raw.raft.state == StateRole::Leader
                && g.raw.raft.prs().get(to.get()).is_some_and(|p| p.state == raft::ProgressState::Snapshot);
            if waiting {
                tracing::debug!(%group, %to, "snapshot not acknowledged in time: sending again");
                g.raw.report_snapshot(to.get(), raft::SnapshotStatus::Failure);
            }
        }
    }

    /// Proposes `command` to the group that owns its hash slot. The outcome arrives as
    /// [`SlotEffect::ProposalDone`]. On a follower (or a node outside the group) the proposal is forwarded
    /// to the leader this node knows.
    pub fn propose(&mut self, now: Time, command: &Command) -> Result<ProposalId, ProposeError> {
        self.advance(now);
        let (group, data) = self.prepare(command)?;
        let id = self.next_proposal;
        let me = self.config.node;
        match self.groups.get_mut(&group) {
            Some(g) if g.raw.raft.state == StateRole::Leader => self.enqueue(group, me, me, id, data),
            Some(g) if g.raw.raft.leader_id != 0 => {
                let leader = NodeId::new(g.raw.raft.leader_id);
                self.send(leader, group, SlotBody::Forward { origin: me, id, command: data });
            }
            // A replica outside its own configuration that knows no leader — an empty one created when a
            // peer reached this node, waiting for a snapshot that comes only to a replica being added — may
            // never learn one: it does not serve the group, and the caller goes to the group's leader as if
            // it were not here (simulator seed 92004055: a migration's `BeginImport` retried for good
            // through one).
            Some(g) if !g.has_member(me.get()) => return Err(ProposeError::UnknownGroup { group }),
            Some(_) => return Err(ProposeError::NotReady { group }),
            None => return Err(ProposeError::UnknownGroup { group }),
        }
        let tracked = self.track(group);
        debug_assert_eq!(tracked, id);
        self.dirty = true;
        Ok(ProposalId(id))
    }

    /// Proposes `command` to `group` on this node, its leader, whatever the command's hash slot: for tools
    /// that drive groups outside the hash-slot table (the benchmark report's raft-per-channel baseline).
    /// The entry commits like any other; the FSM then refuses a command whose slot the group does not own
    /// (`Refusal::WrongSlot`). Fails with `NotLeader` on a non-leader.
    pub fn propose_in(&mut self, now: Time, group: GroupId, command: &Command) -> Result<ProposalId, ProposeError> {
        self.advance(now);
        let (group, data) = self.prepare_in(group, command)?;
        let id = self.next_proposal;
        let me = self.config.node;
        let g = self.groups.get_mut(&group).ok_or(ProposeError::UnknownGroup { group })?;
        if g.raw.raft.state != StateRole::Leader {
            let hint = (g.raw.raft.leader_id != 0).then(|| NodeId::new(g.raw.raft.leader_id));
            return Err(ProposeError::NotLeader { group, hint });
        }
        self.enqueue(group, me, me, id, data);
        let tracked = self.track(group);
        debug_assert_eq!(tracked, id);
        self.dirty = true;
        Ok(ProposalId(id))
    }

    /// Starts an authoritative read of `group` (raft ReadIndex, never a lease). [`SlotEffect::ReadReady`]
    /// says when the local store reflects every write committed before this call.
    pub fn read_index(&mut self, now: Time, group: GroupId) -> Result<ReadId, ProposeError> {
        self.advance(now);
        let deadline = self.now + self.config.request_timeout;
        let max = self.config.pending_reads_max;
        let g = self.groups.get_mut(&group).ok_or(ProposeError::UnknownGroup { group })?;
        if g.raw.raft.leader_id == 0 {
            return Err(ProposeError::NotReady { group });
        }
        if g.reads.len() >= max {
            return Err(ProposeError::Busy { group });
        }
        let id = ReadId(self.next_read);
        self.next_read += 1;
        g.raw.read_index(id.0.to_le_bytes().to_vec());
        g.reads.push_back(PendingRead { id, deadline, index: None });
        self.dirty = true;
        Ok(id)
    }

    /// A message from another node's driver. Messages for unknown groups and undecodable raft payloads are
    /// dropped (and change nothing).
    pub fn handle_message(&mut self, now: Time, from: NodeId, message: SlotMessage) {
        self.advance(now);
        let group = message.group;
        match message.body {
            SlotBody::Raft { known_epoch, bytes } => self.step_raft(from, group, known_epoch, &bytes),
            SlotBody::Chunk { known_epoch, transfer, index, count, bytes } => {
                let chunk = snapshot::Chunk { transfer, index, count, bytes };
                if let Some(whole) = self.reassembly.add(self.now, from, group, chunk) {
                    self.step_raft(from, group, known_epoch, &whole);
                }
            }
            SlotBody::Forward { origin, id, command } => self.forwarded(from, group, origin, id, command),
            SlotBody::ForwardDone { id, outcome } => self.complete(id, Ok(outcome)),
            SlotBody::NotLeader { id, hint } => self.complete(id, Err(ProposeError::NotLeader { group, hint })),
            SlotBody::Removed { config_epoch, last_index } => self.removed_by_peer(group, config_epoch, last_index),
            SlotBody::MemberCheck => {
                if let Some(g) = self.groups.get(&group) {
                    let leader = g.raw.raft.leader_id;
                    if g.raw.raft.state == StateRole::Leader && !g.has_member(from.get()) {
                        if let Some(removed) = removal(g) {
                            self.send(from, group, removed);
                        }
                    } else if leader != 0 && leader != from.get() && !g.has_member(from.get()) {
                        // The asker's idea of the group may predate this leader: tell it whom to ask.
                        self.send(from, group, SlotBody::MemberCheckHint { leader: NodeId::new(leader) });
                    }
                }
            }
            SlotBody::MemberCheckHint { leader } => {
                if leader != self.config.node && self.groups.contains_key(&group) {
                    self.send(leader, group, SlotBody::MemberCheck);
                }
            }
        }
        self.dirty = true;
    }

    /// The runtime made every write up to the [`SlotEffect::Sync`] with `token` durable.
    pub fn handle_synced(&mut self, now: Time, token: u64) {
        self.advance(now);
        if self.storage_failed {
            return;
        }
        while self.awaiting.front().is_some_and(|a| a.token != 0 && a.token <= token) {
            let awaiting = self.awaiting.pop_front().expect("checked non-empty");
            if let Some(group) = self.groups.get_mut(&awaiting.group) {
                group.raw.on_persist_ready(awaiting.number);
                group.durable_commit = group.durable_commit.max(awaiting.commit.unwrap_or(0));
                if let Some(index) = awaiting.snapshot_index {
                    group.raw.advance_apply_to(index);
                }
            }
            for message in awaiting.messages {
                self.send_raft(awaiting.group, message);
            }
        }
        self.dirty = true;
    }

    /// The runtime could not make the writes up to a [`SlotEffect::Sync`] durable: every replica on this
    /// node stops, as on a failed write (see [`MultiRaft::storage_failed`]). A later sync that succeeds
    /// proves nothing about the writes the failed one covered, so none of them is ever acknowledged.
    pub fn handle_sync_failed(&mut self, now: Time, error: &StoreError) {
        self.advance(now);
        if !self.storage_failed {
            self.fail_storage(error, None);
        }
    }

    fn advance(&mut self, now: Time) {
        debug_assert!(now >= self.now, "time went backwards");
        self.now = self.now.max(now);
    }

    fn send_raft(&mut self, group: GroupId, message: Message) {
        let to = NodeId::new(message.to);
        if message.get_msg_type() == MessageType::MsgSnapshot {
            // Time to receive and install it: a base, plus its size at a modest 20 MB/s.
            let bytes = u64::from(message.compute_size());
            let transfer = std::time::Duration::from_micros(bytes / 20);
            self.snapshots_sent.insert((group, to), self.now + self.config.snapshot_ack_timeout + transfer);
        }
        let known_epoch = self.groups.get(&group).map_or(0, |g| g.known_epoch);
        // Cannot fail: raft-rs messages encode into memory.
        let bytes = message.write_to_bytes().expect("raft message encodes");
        if bytes.len() <= self.config.chunk_bytes {
            self.send(to, group, SlotBody::Raft { known_epoch, bytes });
            return;
        }
        let transfer = self.next_transfer;
        self.next_transfer += 1;
        let chunks: Vec<&[u8]> = bytes.chunks(self.config.chunk_bytes).collect();
        let count = u32::try_from(chunks.len()).unwrap_or(u32::MAX);
        for (index, chunk) in chunks.into_iter().enumerate() {
            let index = u32::try_from(index).unwrap_or(u32::MAX);
            let bytes = chunk.to_vec();
            self.send(to, group, SlotBody::Chunk { known_epoch, transfer, index, count, bytes });
        }
    }

    fn send(&mut self, to: NodeId, group: GroupId, body: SlotBody) {
        self.effects.push_back(SlotEffect::Send { to, message: SlotMessage { group, body } });
    }
}

fn raft_error(error: raft::Error) -> StoreError {
    match error {
        raft::Error::Store(raft::StorageError::Other(inner)) => match inner.downcast::<StoreError>() {
            Ok(store) => *store,
            Err(other) => StoreError::io("raft", std::io::Error::other(other.to_string())),
        },
        other => StoreError::io("raft", std::io::Error::other(other.to_string())),
    }
}
