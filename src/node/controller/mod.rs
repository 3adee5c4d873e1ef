//! The channel controller: leader transfers and failovers run as tasks, and a repair loop that starts
//! them. Sans-IO like the rest of the core: `NodeCore` feeds it time, frames' senders, proposal outcomes,
//! metas and evidence, and carries out its [`Action`]s.
//!
//! Every step of a task is a compare-and-set of the channel's runtime meta through its slot group, so
//! the task's state (the fence and its task id) is replicated, two controllers racing on one channel
//! are settled by the meta version, and a controller that stops leaves a fence another one resumes
//! (the repair loop takes over a fence nobody moved for `fence_takeover_after`).
//!
//! * **Failover** — fence with `freeze_replication` (replicas stop replicating from, and acknowledging
//!   to, the old leader), gather durable `(last leader epoch, last seq)` evidence from at least
//!   |ISR| − MinISR + 1 ISR members (each answers only once it applied the fence), pick the most
//!   advanced, commit leader + new leader epoch with the evidence as proof (the slot FSM checks it
//!   again), then clear the fence. A committed record sits on MinISR ISR members, so any
//!   |ISR| − MinISR + 1 of them include one that has it, and the most advanced of those has every
//!   committed record. Too little evidence, or evidence of an epoch the meta never granted, keeps the
//!   channel fenced and says why ([`TaskBlocked`]).
//! * **Transfer** — fence without freezing, wait until the old leader has nothing pending and HW = log
//!   end, and the target holds the log end, switch with that drain proof, clear the fence. Not drained
//!   in time: clear the fence, leader unchanged ([`TaskError::DrainTimedOut`]).
//! * **Repair loop** — on the leader of each slot group, walks the runtime metas of the group's slots
//!   (a page per step): a channel whose leader is down gets a failover; a fence nobody moves gets taken
//!   over. At most `tasks_max` tasks run at once.
//!
//! * **Preferred slot-group leaders** (`preferred`): each group's leader hands leadership to the
//!   preferred node of the group's replicated intent only when it is safe and useful, and records why
//!   not otherwise.
//!
//! * **Slot-group replica moves and drains** (`membership`): each group's leader takes the group's
//!   membership one step at a time towards its intent (learner, catch-up, joint consensus, commit).
//!
//! * **Hash-slot migrations** (`slot_migration`): the leader of a slot's source group copies the slot
//!   to the target group, fences it, copies what changed meanwhile and hands it over.

mod applied_cache;
mod liveness;
mod membership;
mod preferred;
mod repair;
mod report;
mod slot_migration;
mod steps;
mod surplus;

pub(crate) use membership::ClusterView;
pub use membership::MembershipStep;
pub use preferred::Reconcile;
pub(crate) use preferred::{NodeView, PreferredLeaders};
pub use report::{EvidenceEntry, EvidenceReport, TaskBlocked, TaskError, TaskKind, TaskReport, TaskStatus};
pub(crate) use slot_migration::{ExportQuestion, MigrationProposal, SlotMigrations};
pub use slot_migration::{MigrationPhase, SlotMigrationReport};

use super::core::ApiId;
use super::message::NodeMessage;
use liveness::Liveness;
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Duration;
use tidings_slot::command::Command;
use tidings_slot::fsm::{Outcome, Refusal};
use tidings_slot::model::SwitchProof;
use tidings_slot::query::SlotReader;
use tidings_slot::raft::{MultiRaft, ProposeError};
use tidings_types::{ChannelId, ChannelRuntimeMeta, GroupId, HashSlot, NodeId, Time, WriteFence};

/// Controller settings. Defaults suit a LAN cluster.
#[derive(Clone, Debug)]
pub struct ControllerConfig {
    /// A peer is pinged when nothing was sent to it for this long.
    pub ping_interval: Duration,
    /// A peer not heard from for this long is down (its channels get failovers).
    pub node_down_after: Duration,
    /// Pause between repair passes while some node is down or being drained.
    pub repair_interval: Duration,
    /// Pause between repair passes otherwise (they then only look for abandoned fences). A drain that a
    /// group this node leads records meanwhile starts a pass at once.
    pub repair_idle_interval: Duration,
    /// Runtime metas read per repair step.
    pub repair_page: usize,
    /// Tasks running at once on this node.
    pub tasks_max: usize,
    /// Evidence requests and meta confirmations are repeated this often.
    pub ask_interval: Duration,
    /// A transfer or replacement gives up (and unfences) when the old leader has not drained by then.
    pub drain_timeout: Duration,
    /// A replacement gives up when its new replica has not caught up by then (nothing was fenced). In a
    /// healthy channel the learner it added is taken out again (`TaskKind::RemoveLearner`); in one
    /// below MinISR it stays, for the next replacement to resume from.
    pub catch_up_timeout: Duration,
    /// The repair loop replaces an ISR member down this long when the live ISR is below MinISR.
    pub replace_down_after: Duration,
    /// A fence no local task owns is taken over after this long.
    pub fence_takeover_after: Duration,
    /// A channel led by another node than its preferred replica (the first of its replicas: where
    /// placement put the leader, or where an explicit transfer moved it) gets a leader transfer back
    /// once that replica is in the ISR and has been up this long — after a failover, the node that
    /// came back takes its share of the leaderships again (Kafka's preferred replica election). `None`
    /// leaves leaders where failovers put them. Default 30 s.
    pub rebalance_leaders_after: Option<Duration>,
    /// Most transfers back to preferred leaders one repair pass starts (each fences its channel while
    /// the old leader drains, a few milliseconds); with more to do, the next pass follows after
    /// `repair_interval`. Default 16.
    pub rebalance_transfers_per_pass: usize,
    /// Finished task reports kept for status.
    pub reports_max: usize,
    /// A slot group's leader checks the group's preferred leader this often.
    pub reconcile_interval: Duration,
    /// After handing a group's leadership to its preferred node, no other transfer of that group for this long.
    pub transfer_cooldown: Duration,
    /// Most bytes of keys and values in one chunk of a hash-slot migration's copy (below the slot layer's
    /// `proposal_bytes_max`).
    pub migration_chunk_bytes: usize,
    /// A hash-slot migration step whose outcome is unknown is tried again after this long.
    pub migration_retry: Duration,
    /// Pause between two steps of one hash-slot migration (each a proposal to a slot group), so a copy
    /// shares the groups with their writes.
    pub migration_step_pause: Duration,
}

impl Default for ControllerConfig {
    fn default() -> Self {
        Self {
            ping_interval: Duration::from_millis(250),
            node_down_after: Duration::from_millis(1_500),
            repair_interval: Duration::from_millis(500),
            repair_idle_interval: Duration::from_secs(10),
            repair_page: 256,
            tasks_max: 64,
            ask_interval: Duration::from_millis(200),
            drain_timeout: Duration::from_secs(5),
            catch_up_timeout: Duration::from_secs(120),
            replace_down_after: Duration::from_secs(30),
            fence_takeover_after: Duration::from_secs(5),
            rebalance_leaders_after: Some(Duration::from_secs(30)),
            rebalance_transfers_per_pass: 16,
            reports_max: 64,
            reconcile_interval: Duration::from_secs(1),
            transfer_cooldown: Duration::from_secs(10),
            migration_chunk_bytes: 256 << 10,
            migration_retry: Duration::from_millis(500),
            migration_step_pause: Duration::from_millis(1),
        }
    }
}

/// Work for `NodeCore`.
#[derive(Debug)]
pub(crate) enum Action {
    /// Propose a meta change of the channel; report the outcome with [`Controller::proposal_done`],
    /// echoing `tag` (unique per proposal), so a late outcome of an earlier step or an earlier task is
    /// never taken for the current one.
    Propose { channel: ChannelId, tag: u64, command: Command },
    /// Send a message (possibly to this node).
    Send { to: NodeId, message: NodeMessage },
    /// Learn the channel's current meta (feed it back through [`Controller::meta_seen`]).
    FetchMeta(ChannelId),
    /// A task ended; answer the API call that started it, if any.
    Finished { api: Option<ApiId>, report: TaskReport },
}

/// The meta change a task has in flight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Change {
    /// A replacement adds its new replica as a learner.
    AddLearner,
    /// A learner left behind by an unfinished replacement leaves the replicas.
    RemoveLearner,
    Fence,
    Switch,
    Unfence {
        switched: bool,
    },
}

#[derive(Debug)]
enum Step {
    /// A CAS is proposed; `confirming` once its outcome was unclear and the controller waits to see the
    /// meta in force; `fetched` once the retry timer asked for it (a lost proposal is proposed again
    /// only then, so a group that refuses at once is not hammered).
    Proposing { change: Change, proposed: ChannelRuntimeMeta, tag: u64, confirming: bool, fetched: bool },
    /// Fenced: asking ISR members for evidence (and drain status).
    Gathering,
    /// Unfenced: waiting for a replacement's new replica to catch up with the leader.
    CatchingUp,
}

#[derive(Debug)]
struct Task {
    id: u64,
    kind: TaskKind,
    api: Option<ApiId>,
    old_leader: NodeId,
    /// The meta this task last saw committed (the base of its next CAS).
    meta: ChannelRuntimeMeta,
    step: Step,
    evidence: BTreeMap<NodeId, EvidenceReport>,
    blocked: Option<TaskBlocked>,
    started: Time,
    next_ask: Time,
    /// How soon a task waiting, fenced, for its leader to drain asks again: from
    /// `DRAIN_RECHECK_FIRST`, doubling up to `ask_interval`.
    drain_recheck: Duration,
    /// A transfer's drain deadline.
    deadline: Option<Time>,
    new_leader: Option<(NodeId, tidings_types::LeaderEpoch)>,
    proof: Vec<EvidenceEntry>,
    /// Why an unfence that ends the task without its change is being made.
    failure: Option<TaskError>,
}

/// Where the repair loop is in its walk over the slots this node's groups own.
#[derive(Debug, Default)]
struct RepairScan {
    /// Passes started, this one included.
    pass: u64,
    slots: Vec<(GroupId, HashSlot)>,
    index: usize,
    cursor: Option<Vec<u8>>,
    active: bool,
    next_pass: Time,
    /// Nodes being drained, per the intents of the groups this pass walks.
    draining: BTreeSet<NodeId>,
    /// Channel replicas this pass found on drained nodes.
    drain_left: BTreeMap<NodeId, usize>,
    /// Slot groups walked by this pass that still hold a replica on a drained node.
    drain_groups: BTreeMap<NodeId, Vec<GroupId>>,
    /// Channels this pass found led by a leaving node (up), per node and slot group (every group the
    /// pass walks, with 0 where it found none).
    hand_offs_left: BTreeMap<NodeId, BTreeMap<GroupId, usize>>,
    /// Something this pass should have read it could not: a group's intent or a slot's metas (the
    /// store failed), or a led group's slots, skipped while this node heard no quorum of it. Its drain
    /// and hand-off counts would then be short, so the pass files none: the last complete pass's stand.
    incomplete: bool,
    /// Transfers back to preferred leaders this pass started.
    rebalances: usize,
    /// When a transfer back this pass could not start yet (its preferred replica not up long enough, or
    /// the pass's limit reached) may start: the next pass comes no later (nor sooner than
    /// `repair_interval`), instead of after a whole idle interval.
    rebalance_due: Option<Time>,
}

/// How far the drain of a node has come, in the slot groups one node leads (every node reports its own;
/// a drain is complete when no node reports anything left).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DrainReport {
    /// The drained node.
    pub node: NodeId,
    /// Led slot groups that still have a replica (voter or learner) on it, or whose assignment or a move
    /// under way still names it (an aborted move goes back to the assignment, which may).
    pub slot_groups: Vec<GroupId>,
    /// Channel replicas still on it, among the channels of the led groups' slots.
    pub channel_replicas: usize,
}

/// How far the hand-off of a leaving node's channel leaderships has come, in the slot groups one node
/// leads (every node reports its own, from its last complete repair pass; see `NodeCore::set_leaving`).
/// Every node leaving when the pass began is listed; `channels_led == 0` on every slot-group leader
/// means its channels are all handed off.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HandOffReport {
    /// The leaving node.
    pub node: NodeId,
    /// Channels of the led groups' slots that it still leads, active or idle.
    pub channels_led: usize,
}

/// The channel controller of one node. See the [module docs](self).
#[derive(Debug)]
pub(crate) struct Controller {
    config: ControllerConfig,
    me: NodeId,
    /// Replicas a channel is created with: a channel holding more (replacements interrupted after
    /// adding their new replica) may lose one on a drained node without a replacement.
    replication_factor: usize,
    /// When this controller started: this node's own uptime.
    started: Time,
    liveness: Liveness,
    next_ping: Time,
    down: BTreeSet<NodeId>,
    tasks: BTreeMap<ChannelId, Task>,
    reports: VecDeque<TaskReport>,
    actions: VecDeque<Action>,
    scan: RepairScan,
    /// Drain progress seen by the last complete repair pass.
    drain_reports: Vec<DrainReport>,
    /// Hand-offs of leaving nodes' leaderships seen by the last complete repair pass.
    hand_off_reports: Vec<HandOffReport>,
    /// Nodes being drained per the intents of every slot group this node holds, as of the last repair
    /// pass's start: new channels are not placed on them.
    drains_known: BTreeSet<NodeId>,
    /// Channels whose transfer back to the preferred leader failed, and when one may be tried again
    /// (each failed try fenced the channel for up to `drain_timeout`). At most `FENCES_SEEN_MAX`.
    rebalance_backoff: BTreeMap<ChannelId, Time>,
    /// Fences seen by the repair loop that no local task owns: task id and when first seen.
    fences_seen: BTreeMap<ChannelId, (u64, Time)>,
    /// Healthy channels holding more replicas than they are created with, as the repair passes found
    /// them: one replica is given up once they kept the same replicas for `catch_up_timeout` (see
    /// `surplus`). At most `FENCES_SEEN_MAX`.
    surplus_seen: BTreeMap<ChannelId, surplus::SurplusSeen>,
    /// This node is leaving (`NodeCore::set_leaving`): its pings say so, and the controllers of the
    /// other nodes hand its leaderships off.
    leaving: bool,
    /// While leaving: per slot group, the channels this node still leads there, as the group's leader
    /// last reported ([`NodeMessage::HandOffProgress`]) since the leave began.
    hand_off_progress: BTreeMap<GroupId, usize>,
    /// Slot groups this node led at the last tick.
    led: BTreeSet<GroupId>,
    /// The hash slots of the groups in `led`, as of the last ping round.
    led_slots: Vec<HashSlot>,
    next_task: u64,
    /// Tags proposals (see [`Action::Propose`]).
    next_tag: u64,
}

/// The first repeat of a drain-waiting task's evidence request. A leader with appends in flight when
/// the fence lands drains within a commit round or two; asking again only after `ask_interval` (200 ms)
/// held every transfer, hand-off and replacement of a busy channel fenced that long.
const DRAIN_RECHECK_FIRST: Duration = Duration::from_millis(10);

/// How many abandoned fences the repair loop tracks at once.
const FENCES_SEEN_MAX: usize = 4_096;

impl Controller {
    /// The controller of `me` among `nodes`, whose channels are created with `replication_factor`
    /// replicas (`NodeConfig::channel_replicas`). Task ids start at `first_task` (unique per node start).
    pub(crate) fn new(
        config: ControllerConfig,
        me: NodeId,
        nodes: &[NodeId],
        replication_factor: usize,
        first_task: u64,
        now: Time,
    ) -> Self {
        let peers = nodes.iter().copied().filter(|n| *n != me);
        Self {
            liveness: Liveness::new(peers, config.node_down_after, now),
            config,
            me,
            replication_factor,
            started: now,
            next_ping: now,
            down: BTreeSet::new(),
            tasks: BTreeMap::new(),
            reports: VecDeque::new(),
            actions: VecDeque::new(),
            scan: RepairScan { next_pass: now, ..RepairScan::default() },
            drain_reports: Vec::new(),
            hand_off_reports: Vec::new(),
            drains_known: BTreeSet::new(),
            rebalance_backoff: BTreeMap::new(),
            fences_seen: BTreeMap::new(),
            surplus_seen: BTreeMap::new(),
            leaving: false,
            hand_off_progress: BTreeMap::new(),
            led: BTreeSet::new(),
            led_slots: Vec::new(),
            next_task: first_task,
            next_tag: 0,
        }
    }

    /// A valid frame arrived from `peer`.
    pub(crate) fn heard(&mut self, peer: NodeId, now: Time) {
        self.liveness.heard(peer, now);
    }

    /// `peer` said it is leaving. News to this node: a repair pass starts at once, so the channels of the
    /// groups it leads that `peer` leads are handed off without waiting for the idle interval.
    pub(crate) fn heard_leaving(&mut self, peer: NodeId, now: Time) {
        if !self.liveness.heard_leaving(peer, now) {
            return;
        }
        tracing::info!(node = %self.me, %peer, "a peer is leaving: its leaderships are handed off");
        if !self.led.is_empty() {
            self.scan.active = false;
            self.scan.next_pass = self.scan.next_pass.min(now);
        }
    }

    /// This node starts (`true`) or stops leaving: its pings say so from now on (the first at once).
    pub(crate) fn set_leaving(&mut self, now: Time, leaving: bool) {
        if leaving != self.leaving {
            self.leaving = leaving;
            self.hand_off_progress.clear();
            self.next_ping = now;
            // Its own led groups' channels too: their repair passes run here.
            self.scan.active = false;
            self.scan.next_pass = self.scan.next_pass.min(now);
        }
    }

    /// `true` if this node is leaving.
    pub(crate) fn leaving(&self) -> bool {
        self.leaving
    }

    /// A slot groups' leader reports, for each group it leads, how many channels there this node
    /// still leads (kept only while this node is leaving).
    pub(crate) fn hand_off_progress(&mut self, channels_led: impl IntoIterator<Item = (GroupId, usize)>) {
        if self.leaving {
            self.hand_off_progress.extend(channels_led);
        }
    }

    /// While leaving: the channels this node still leads, active or idle, once the leader of each of
    /// `groups` reported since the leave began (`None` before, or when not leaving).
    pub(crate) fn channels_left_to_hand_off(&self, mut groups: impl Iterator<Item = GroupId>) -> Option<usize> {
        let reported = groups.all(|group| self.hand_off_progress.contains_key(&group));
        (self.leaving && reported).then(|| self.hand_off_progress.values().sum())
    }

    /// `true` if `node` (this node or a peer) is leaving: it should lead nothing.
    pub(crate) fn is_leaving(&self, node: NodeId, now: Time) -> bool {
        if node == self.me {
            self.leaving
        } else {
            self.liveness.is_leaving(node, now)
        }
    }

    /// Every node leaving, this one included.
    pub(crate) fn leaving_nodes(&self, now: Time) -> BTreeSet<NodeId> {
        let mut leaving: BTreeSet<NodeId> = self.liveness.leaving(now).collect();
        if self.leaving {
            leaving.insert(self.me);
        }
        leaving
    }

    /// Drain progress in the groups this node leads, as of the last complete repair pass.
    pub(crate) fn drain_reports(&self) -> Vec<DrainReport> {
        self.drain_reports.clone()
    }

    /// Hand-offs of leaving nodes' leaderships in the groups this node leads, as of the last complete
    /// repair pass.
    pub(crate) fn hand_off_reports(&self) -> Vec<HandOffReport> {
        self.hand_off_reports.clone()
    }

    /// The nodes the failure detector holds down now.
    pub(crate) fn down_nodes(&self, now: Time) -> BTreeSet<NodeId> {
        self.liveness.down(now).collect()
    }

    /// Peers silent for `replace_down_after` or more: their channel replicas are replaced, and a slot
    /// group's move towards one is given up.
    pub(crate) fn gone_nodes(&self, now: Time) -> BTreeSet<NodeId> {
        self.liveness.peers().filter(|n| self.is_gone(*n, now)).collect()
    }

    /// `true` if `peer` has been silent for `replace_down_after` or more.
    pub(crate) fn is_gone(&self, peer: NodeId, now: Time) -> bool {
        self.liveness.silent_for(peer, now).is_some_and(|silent| silent >= self.config.replace_down_after)
    }

    /// Nodes a new channel's replicas should not go to: those the failure detector holds down, those
    /// being drained, and those leaving (about to stop). A replica placed there would have to be moved or
    /// replaced before its channel had its full ISR — or, placed as leader, before the channel could
    /// take an append at all (placement puts them last).
    pub(crate) fn placement_avoided(&self, now: Time) -> BTreeSet<NodeId> {
        let mut avoided = self.down_nodes(now);
        avoided.extend(self.drains_known.iter().copied());
        avoided.extend(self.leaving_nodes(now));
        avoided
    }

    /// `true` if `peer` has been silent for `node_down_after`.
    pub(crate) fn is_down(&self, peer: NodeId, now: Time) -> bool {
        self.liveness.is_down(peer, now)
    }

    /// Next work for `NodeCore`.
    pub(crate) fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    /// Tasks in progress.
    pub(crate) fn status(&self) -> Vec<TaskStatus> {
        self.tasks
            .iter()
            .map(|(channel, task)| TaskStatus {
                task: task.id,
                channel: channel.clone(),
                kind: task.kind,
                step: match &task.step {
                    Step::Proposing { change: Change::AddLearner, .. } => "adding learner",
                    Step::Proposing { change: Change::RemoveLearner, .. } => "removing learner",
                    Step::CatchingUp => "catching up",
                    Step::Proposing { change: Change::Fence, .. } => "fencing",
                    Step::Gathering => "gathering evidence",
                    Step::Proposing { change: Change::Switch, .. } => "switching",
                    Step::Proposing { change: Change::Unfence { .. }, .. } => "unfencing",
                },
                blocked: task.blocked.clone(),
                started: task.started,
            })
            .collect()
    }

    /// The last finished tasks, oldest first.
    pub(crate) fn reports(&self) -> Vec<TaskReport> {
        self.reports.iter().cloned().collect()
    }

    /// When [`Controller::tick`] has work next.
    pub(crate) fn poll_timeout(&self) -> Time {
        let task_timers = self.tasks.values().map(|t| t.deadline.map_or(t.next_ask, |d| d.min(t.next_ask)));
        let fences = self.fences_seen.values().map(|(_, since)| *since + self.config.fence_takeover_after);
        task_timers.chain(fences).fold(self.next_ping.min(self.scan.next_pass), Time::min)
    }

    /// Pings, task retries and deadlines, and one repair step.
    pub(crate) fn tick(&mut self, now: Time, slot: &MultiRaft, reader: &SlotReader) {
        if now >= self.next_ping {
            // Pings, and the views that only change at failure-detection granularity (kept off the
            // per-tick path, which runs for every channel timer).
            self.next_ping = now + self.config.ping_interval;
            let peers: Vec<NodeId> = self.liveness.peers().collect();
            let ping = if self.leaving { NodeMessage::Leaving } else { NodeMessage::Ping };
            for to in peers {
                self.actions.push_back(Action::Send { to, message: ping.clone() });
            }
            let down: BTreeSet<NodeId> = self.liveness.down(now).collect();
            let led: BTreeSet<GroupId> = slot.groups().filter(|g| slot.is_leader(*g)).collect();
            let table = slot.table();
            let led_slots: Vec<HashSlot> = led.iter().flat_map(|g| table.slots_of(*g)).collect();
            let gained_slot = led_slots.iter().any(|s| !self.led_slots.contains(s));
            let gained = led.iter().any(|g| !self.led.contains(g)) || gained_slot;
            if down.iter().any(|n| !self.down.contains(n)) || gained {
                // Someone just went down, or this node just took over a group or a migrated slot: look at
                // its channels now (a migrated slot may bring a fence whose controller gave up while the
                // slot was fenced for the migration, and only a pass here sees it).
                self.scan.next_pass = self.scan.next_pass.min(now);
            }
            if gained {
                // A pass under way walks the slots led when it began: finished, it would rest a whole
                // idle interval before the next one looked at what was gained (a fence left there would
                // hold the channel that much longer). Start over, with every slot led now.
                self.scan.active = false;
            }
            self.down = down;
            self.led = led;
            self.led_slots = led_slots;
        }
        let due: Vec<ChannelId> = self
            .tasks
            .iter()
            .filter(|(_, t)| t.next_ask <= now || t.deadline.is_some_and(|d| d <= now))
            .map(|(c, _)| c.clone())
            .collect();
        for channel in due {
            self.task_timer(now, &channel);
        }
        self.take_over_fences(now, reader);
        if now >= self.scan.next_pass {
            self.repair_step(now, slot, reader);
        }
    }

    /// Starts moving the leadership of the channel whose meta is `meta` to `target`.
    pub(crate) fn start_transfer(
        &mut self,
        now: Time,
        api: Option<ApiId>,
        meta: ChannelRuntimeMeta,
        target: NodeId,
    ) -> Result<(), TaskError> {
        self.start_leadership_move(now, api, meta, TaskKind::Transfer { target })
    }

    /// Starts a planned move of leadership, `kind` a transfer or a hand-off.
    fn start_leadership_move(
        &mut self,
        now: Time,
        api: Option<ApiId>,
        meta: ChannelRuntimeMeta,
        kind: TaskKind,
    ) -> Result<(), TaskError> {
        let target = kind.leadership_target().expect("a transfer or a hand-off");
        if self.is_leaving(target, now) {
            return Err(TaskError::TargetLeaving(target));
        }
        if meta.leader == target {
            return Err(TaskError::AlreadyLeader(target));
        }
        if !meta.in_isr(target) {
            return Err(TaskError::NotInIsr(target));
        }
        if let Some(fence) = meta.write_fence {
            return Err(TaskError::Fenced(fence.task));
        }
        self.admit(&meta.channel)?;
        let id = self.task_id();
        let task = self.new_task(id, kind, api, meta, now);
        self.start(now, task);
        Ok(())
    }

    /// Starts replacing replica `from` of `meta`'s channel by `to`: a node of the cluster that holds no
    /// replica of the channel yet, or a learner of it (a replica outside the ISR, left by a replacement
    /// that was interrupted), which the task then brings in instead of adding another. In a channel
    /// holding more replicas than it is created with, `to` may be any other replica: `from` leaves and
    /// `to` takes its place, one replica fewer.
    pub(crate) fn start_replace(
        &mut self,
        now: Time,
        api: Option<ApiId>,
        meta: ChannelRuntimeMeta,
        from: NodeId,
        to: NodeId,
    ) -> Result<(), TaskError> {
        if !meta.is_replica(from) {
            return Err(TaskError::NotReplica(from));
        }
        let known = to == self.me || self.liveness.peers().any(|n| n == to);
        // The new replica is a node that holds no replica of the channel yet, or only a learner's (not
        // `from` itself either) — or, in a channel holding more replicas than it is created with, any
        // other replica: `from` then leaves and `to` takes its place.
        let over_replicated = meta.replicas.len() > self.replication_factor;
        if to == from || (meta.isr.contains(&to) && !over_replicated) || !known {
            return Err(TaskError::CannotJoin(to));
        }
        if self.is_leaving(to, now) {
            return Err(TaskError::TargetLeaving(to));
        }
        let isr_after = meta.isr.iter().filter(|n| **n != from && **n != to).count() + 1;
        if isr_after < usize::from(meta.min_isr) {
            return Err(TaskError::BelowMinIsr);
        }
        if let Some(fence) = meta.write_fence {
            return Err(TaskError::Fenced(fence.task));
        }
        self.admit(&meta.channel)?;
        let id = self.task_id();
        let task = self.new_task(id, TaskKind::Replace { from, to }, api, meta, now);
        self.start(now, task);
        Ok(())
    }

    /// A replacement's new replica reported: fence once it holds what the leader has committed.
    ///
    /// Its log must end in the leader's last epoch: records of one epoch come from one leader, so such
    /// a log is a prefix of the leader's. A longer log ending in an earlier epoch (a member back with
    /// a suffix no leader committed) has diverged and lacks the committed records; counted by length
    /// it fenced the channel for a switch that could not pass until the learner truncated.
    fn caught_up(&mut self, now: Time, channel: &ChannelId) {
        let Some(task) = self.tasks.get_mut(channel) else { return };
        let Some(to) = replacement_target(task.kind) else { return };
        let ready = match (task.evidence.get(&task.meta.leader), task.evidence.get(&to)) {
            (Some(leader), Some(joining)) => joining.last_epoch == leader.last_epoch && joining.last_seq >= leader.hw,
            _ => false,
        };
        if !ready {
            task.blocked = Some(TaskBlocked::CatchingUp);
            return;
        }
        task.blocked = None;
        task.evidence.clear();
        let next = fenced(&task.meta, task.id, false);
        self.propose(now, channel, Change::Fence, next);
    }

    /// `true` if the task running for `channel` is a replacement that has fenced nothing yet (adding its
    /// learner, or waiting for it to catch up): it waits for a leader that may never serve it, and a
    /// failover takes its place.
    pub(super) fn failover_preempts(&self, channel: &ChannelId) -> bool {
        self.tasks
            .get(channel)
            .is_some_and(|t| matches!(t.step, Step::CatchingUp | Step::Proposing { change: Change::AddLearner, .. }))
    }

    /// The target of the replacement running for `channel`, if it has fenced nothing yet (see
    /// [`Controller::failover_preempts`]) and its target is down: it cannot catch up.
    pub(super) fn replacement_target_down(&self, channel: &ChannelId, now: Time) -> Option<NodeId> {
        let to = replacement_target(self.tasks.get(channel)?.kind)?;
        (self.failover_preempts(channel) && to != self.me && self.is_down(to, now)).then_some(to)
    }

    /// Starts a failover of `meta`'s channel unless a task runs for it; a meta that a failover already
    /// fenced is resumed at evidence gathering.
    pub(crate) fn start_failover(&mut self, now: Time, meta: ChannelRuntimeMeta) {
        if self.failover_preempts(&meta.channel) {
            let task = self.tasks.remove(&meta.channel).expect("present");
            self.finish(now, task, Err(TaskError::Preempted));
        }
        if self.admit(&meta.channel).is_err() {
            return;
        }
        self.fences_seen.remove(&meta.channel);
        let resume = meta.write_fence.filter(|f| f.freeze_replication);
        let id = resume.map_or_else(|| self.task_id(), |f| f.task);
        let task = self.new_task(id, TaskKind::Failover, None, meta, now);
        match resume {
            Some(_) => self.gather(now, task),
            None => self.start(now, task),
        }
    }

    /// A replica asked for a failover (its replica cannot lead: storage failed, or it restarted after
    /// leading the epoch in force). Acted on by the leader of the channel's slot group, when `from` is
    /// the leader the meta names.
    pub(crate) fn failover_requested(&mut self, now: Time, from: NodeId, meta: ChannelRuntimeMeta) {
        if meta.leader != from {
            return;
        }
        // A leader that cannot lead cannot drain either: a transfer or replacement fenced and waiting
        // for its drain would only time out, and the repair loop could start the next such task before
        // the leader asked again. The failover fences over it.
        let draining = self
            .tasks
            .get(&meta.channel)
            .is_some_and(|t| matches!(t.step, Step::Gathering) && t.kind.waits_for_drain());
        if draining {
            let task = self.tasks.remove(&meta.channel).expect("present");
            self.finish(now, task, Err(TaskError::Preempted));
        }
        self.start_failover(now, meta);
    }

    /// A replica's answer to an evidence request.
    pub(crate) fn evidence(
        &mut self,
        now: Time,
        from: NodeId,
        task: u64,
        channel: &ChannelId,
        version: u64,
        report: EvidenceReport,
    ) {
        let Some(t) = self.tasks.get_mut(channel) else { return };
        let joining = matches!(t.kind, TaskKind::Replace { to, .. } if to == from);
        if t.id != task || !(t.meta.in_isr(from) || joining) {
            return;
        }
        match t.step {
            Step::Gathering if t.meta.version == version && report.fenced_by == t.meta.write_fence.map(|f| f.task) => {
                t.evidence.insert(from, report);
                self.evaluate(now, channel);
            }
            Step::CatchingUp => {
                t.evidence.insert(from, report);
                self.caught_up(now, channel);
            }
            _ => {}
        }
    }

    /// The outcome of a task's proposal.
    pub(crate) fn proposal_done(
        &mut self,
        now: Time,
        channel: &ChannelId,
        tag: u64,
        result: Result<Outcome, ProposeError>,
    ) {
        let Some(task) = self.tasks.get_mut(channel) else { return };
        let Step::Proposing { change, proposed, confirming, tag: current, .. } = &mut task.step else { return };
        if *current != tag {
            // The outcome of an earlier step (which `meta_seen` already settled), or of another task.
            return;
        }
        let change = *change;
        match result {
            Ok(Outcome::Applied) => {
                let proposed = proposed.clone();
                self.applied(now, channel, change, proposed);
            }
            Ok(Outcome::Refused(Refusal::BadProof(reason))) if change == Change::Switch => {
                task.blocked = Some(TaskBlocked::ProofRefused(Refusal::BadProof(reason)));
                task.evidence.clear();
                task.step = Step::Gathering;
                task.next_ask = now + self.config.ask_interval;
            }
            // The channel's hash slot is fenced for the last moments of its migration: nothing was
            // applied, and the change can be once the new owner serves the slot. Proposed again as a lost
            // proposal is (below). Ended here, a transfer left its fence standing until a controller took
            // the fence over, and its channel took no append meanwhile (sim seed 565004175: 15 s).
            Ok(Outcome::Refused(Refusal::SlotFenced { .. })) => {
                *confirming = true;
                task.next_ask = now + self.config.ask_interval;
            }
            Ok(Outcome::Refused(refusal)) => {
                let task = self.tasks.remove(channel).expect("present");
                self.finish(now, task, Err(TaskError::Refused(refusal)));
            }
            // Not applied, or outcome unknown (timeout, lost leadership, another version in force):
            // see which meta is in force before deciding.
            Ok(_) | Err(_) => {
                *confirming = true;
                task.next_ask = now + self.config.ask_interval;
            }
        }
    }

    /// A meta of `channel` this node saw (applied, pushed or fetched): settles a confirmation.
    pub(crate) fn meta_seen(&mut self, now: Time, meta: &ChannelRuntimeMeta) {
        let Some(task) = self.tasks.get_mut(&meta.channel) else { return };
        if matches!(task.step, Step::Gathering) && meta.version > task.meta.version {
            // Someone else moved the meta past this task's fence (another controller finished or took
            // it over): its switch can no longer commit, and its evidence is moot.
            let task = self.tasks.remove(&meta.channel).expect("present");
            self.finish(now, task, Err(TaskError::MetaChanged));
            return;
        }
        if matches!(task.step, Step::CatchingUp) && meta.version > task.meta.version {
            // The leader may move its ISR meanwhile (it adds the caught-up learner itself): follow it,
            // or give up if the meta no longer fits the replacement.
            if replacement_fits(task.kind, meta) {
                task.meta = meta.clone();
            } else {
                let task = self.tasks.remove(&meta.channel).expect("present");
                self.finish(now, task, Err(TaskError::MetaChanged));
            }
            return;
        }
        let Step::Proposing { change, proposed, confirming, fetched, .. } = &mut task.step else { return };
        if meta == proposed {
            let (change, proposed) = (*change, proposed.clone());
            self.applied(now, &meta.channel.clone(), change, proposed);
        } else if *confirming && meta.version >= proposed.version {
            if *change == Change::Fence
                && matches!(task.kind, TaskKind::Replace { .. })
                && replacement_fits(task.kind, meta)
            {
                // The leader's own ISR change won the race with the fence: fence again on top of it.
                task.meta = meta.clone();
                task.step = Step::CatchingUp;
                task.next_ask = now;
                return;
            }
            // Something else moved the meta: this task's change did not happen.
            let task = self.tasks.remove(&meta.channel).expect("present");
            self.finish(now, task, Err(TaskError::MetaChanged));
        } else if *confirming && *fetched && *meta == task.meta {
            // Still the base: the proposal was lost; propose again.
            let (change, proposed) = (*change, proposed.clone());
            self.propose(now, &meta.channel.clone(), change, proposed);
        }
    }

    fn admit(&self, channel: &ChannelId) -> Result<(), TaskError> {
        if self.tasks.contains_key(channel) {
            return Err(TaskError::AlreadyRunning(channel.clone()));
        }
        if self.tasks.len() >= self.config.tasks_max {
            return Err(TaskError::TooManyTasks);
        }
        Ok(())
    }

    fn task_id(&mut self) -> u64 {
        let id = self.next_task;
        self.next_task += 1;
        id
    }

    fn new_task(&self, id: u64, kind: TaskKind, api: Option<ApiId>, meta: ChannelRuntimeMeta, now: Time) -> Task {
        Task {
            id,
            kind,
            api,
            old_leader: meta.leader,
            meta,
            step: Step::Gathering,
            evidence: BTreeMap::new(),
            blocked: None,
            started: now,
            next_ask: now,
            drain_recheck: DRAIN_RECHECK_FIRST,
            deadline: None,
            new_leader: None,
            proof: Vec::new(),
            failure: None,
        }
    }
}

/// The replica a replacement adds.
fn replacement_target(kind: TaskKind) -> Option<NodeId> {
    match kind {
        TaskKind::Replace { to, .. } => Some(to),
        _ => None,
    }
}

/// `true` if a replacement can go on under `meta`: unfenced, the old replica still there, the new one a
/// replica.
fn replacement_fits(kind: TaskKind, meta: &ChannelRuntimeMeta) -> bool {
    match kind {
        TaskKind::Replace { from, to } => meta.write_fence.is_none() && meta.is_replica(from) && meta.is_replica(to),
        _ => false,
    }
}

/// `base` fenced by `task`.
fn fenced(base: &ChannelRuntimeMeta, task: u64, freeze_replication: bool) -> ChannelRuntimeMeta {
    let mut next = base.clone();
    next.version += 1;
    next.write_fence = Some(WriteFence { task, since_version: next.version, freeze_replication });
    next
}

/// `base` without its fence.
fn unfenced(base: &ChannelRuntimeMeta) -> ChannelRuntimeMeta {
    let mut next = base.clone();
    next.version += 1;
    next.write_fence = None;
    next
}

fn switch_proof(task: &Task) -> SwitchProof {
    SwitchProof {
        task: task.id,
        expected_leader_epoch: task.meta.leader_epoch,
        evidence: task.proof.iter().map(|e| (e.node, e.last_epoch, e.last_seq)).collect(),
    }
}
