//! The simulated cluster: every node's real `NodeCore` on in-memory stores, a seeded network and disk,
//! faults, a client workload, and the checks. One thread, virtual time in 1 ms steps.

mod checks;
mod clock;
mod disk_loss;
mod grow;
mod planned_stops;
mod registers;
mod senders;
mod shrink;
mod store_faults;
mod workload;

use crate::oracle::Oracle;
use crate::params::SimParams;
use bytes::Bytes;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;
use tidings::channel::machine::PersistToken;
use tidings::frame::FrameError;
use tidings::node::{carry_out_fanout, ApiId, ApiResult, NodeConfig, NodeCore, NodeEffect};
use tidings::router::Router;
use tidings::slot::command::RoutingKey;
use tidings::slot::model::Uid;
use tidings::slot::model::{ChannelFlags, ChannelInfo};
use tidings::store::message::{LogBatch, LogFailOp, LogLimits, LogOp, MemoryLog, MessageLog, ReadLimits};
use tidings::store::{Kv, MemoryKv, MetaStore, RaftLogStore};
use tidings::types::{ChannelId, ChannelType, DetRng, HashSlot, NodeId, Seq, Time};

/// What a run did, and what it found.
#[derive(Clone, Debug)]
pub struct SimReport {
    /// The parameters (print them with the seed).
    pub params: SimParams,
    /// Virtual milliseconds simulated.
    pub steps: u64,
    /// Faults injected: frames lost, frames duplicated, crashes, partitions.
    pub faults: Faults,
    /// Appends acknowledged.
    pub acked: usize,
    /// Fanout deliveries (message, member) the host recorded.
    pub delivered: usize,
    /// Requests still unanswered at the end.
    pub unanswered: usize,
    /// Hash of every delivered frame and answer: the same seed gives the same hash.
    pub trace_hash: u64,
    /// Invariant violations (empty: the seed passed).
    pub violations: Vec<String>,
}

impl SimReport {
    /// No invariant was violated.
    pub fn passed(&self) -> bool {
        self.violations.is_empty()
    }

    /// The command that replays this seed.
    pub fn replay_command(&self) -> String {
        let (params, drawn) = (&self.params, SimParams::from_seed(self.params.seed));
        let mut command = format!("cargo run --release -p tidings-sim -- --seed {}", params.seed);
        if !params.metadata_workload {
            command.push_str(" --no-metadata");
        }
        if params.safety_ms != drawn.safety_ms {
            command.push_str(&format!(" --safety-ms {}", params.safety_ms));
        }
        if params.liveness_ms != drawn.liveness_ms {
            command.push_str(&format!(" --liveness-ms {}", params.liveness_ms));
        }
        if params.channels != drawn.channels {
            command.push_str(&format!(" --channels {}", params.channels));
        }
        if params.idle_evict_ms != drawn.idle_evict_ms {
            command.push_str(&format!(" --idle-evict-ms {}", params.idle_evict_ms));
        }
        if params.tight_limits != drawn.tight_limits {
            command.push_str(if params.tight_limits { " --tight-limits" } else { " --no-tight-limits" });
        }
        if params.hurried_timings != drawn.hurried_timings {
            command.push_str(if params.hurried_timings { " --hurried-timings" } else { " --no-hurried-timings" });
        }
        if params.clock_skew != drawn.clock_skew {
            command.push_str(if params.clock_skew { " --clock-skew" } else { " --no-clock-skew" });
        }
        if params.disk_loss != drawn.disk_loss {
            command.push_str(if params.disk_loss { " --disk-loss" } else { " --no-disk-loss" });
        }
        if params.grow != drawn.grow {
            command.push_str(if params.grow { " --grow" } else { " --no-grow" });
        }
        if params.shrink != drawn.shrink {
            command.push_str(if params.shrink { " --shrink" } else { " --no-shrink" });
        }
        if params.planned_stops != drawn.planned_stops {
            command.push_str(if params.planned_stops { " --planned-stops" } else { " --no-planned-stops" });
        }
        if params.late_duplicates {
            command.push_str(" --late-duplicates");
        }
        if params.all_metadata {
            command.push_str(" --all-metadata");
        }
        if params.meta_read_errors {
            command.push_str(" --meta-read-errors");
        }
        if params.meta_write_errors {
            command.push_str(" --meta-write-errors");
        }
        command
    }
}

/// Time between two nodes' restarts in a rolling restart (`SimParams::grow`, `SimParams::shrink`).
const ROLLING_STEP_MS: u64 = 300;

/// Most virtual time the cluster gets, after the liveness phase, to finish its fanout and bring every
/// slot replica to its group's applied index; and the step it is looked at with.
const SETTLE_MAX_MS: u64 = 120_000;
const SETTLE_STEP_MS: u64 = 10;
/// Past `SETTLE_MAX_MS`, a fanout still going gets up to this much virtual time in all, for as long as
/// its backlog keeps falling within `FANOUT_STALL_MS`: with tight limits (pages of two members, one job
/// at a time) a channel that took a few thousand messages and gathered a hundred subscribers fans out
/// for minutes after the last commit (493001007: about ten messages a second, pages asked of another
/// node), and that is a rate, not a message that never goes out.
const FANOUT_SETTLE_MAX_MS: u64 = 900_000;
const FANOUT_STALL_MS: u64 = 30_000;

/// Fault counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Faults {
    /// Frames lost.
    pub lost: u64,
    /// Frames delivered twice.
    pub duplicated: u64,
    /// Node crashes.
    pub crashes: u64,
    /// One-way partitions.
    pub partitions: u64,
    /// Storage IO errors armed.
    pub io_errors: u64,
    /// Leader transfers asked for.
    pub transfers: u64,
    /// Leader transfers that switched the leader.
    pub transfers_done: u64,
    /// Slot-group replica moves (and aborts) asked for.
    pub slot_moves: u64,
    /// Slot-group replica moves (and aborts) the group accepted.
    pub slot_moves_accepted: u64,
    /// Slot groups whose membership changed during the run (configuration epoch above 0 at the end).
    pub slot_groups_reconfigured: u64,
    /// Node drains started or stopped.
    pub drains: u64,
    /// Hash-slot migrations (and aborts) asked for.
    pub slot_migrations: u64,
    /// Hash-slot migrations completed during the run (slots whose owner changed).
    pub slots_migrated: u64,
    /// Retention moves asked for.
    pub retention_moves: u64,
    /// Retention moves answered with the boundary in force.
    pub retention_moves_done: u64,
    /// Committed messages never delivered to a subscriber in runs where a subscriber page went unserved
    /// for 30 s (which ends a message's fanout by design); in any other run one is a violation.
    pub fanout_missed: u64,
    /// Committed messages new channel leaders planned again (on the nodes up at the end).
    pub fanout_planned_again: u64,
    /// Learners taken out of channels over their replication factor (`TaskKind::RemoveLearner` that
    /// succeeded), from the finished-task reports of the nodes up at the end (each keeps its last few).
    pub learners_removed: u64,
    /// Slot-group snapshots sent (their first chunk), counted in `tight_limits` seeds only (it takes a
    /// decode of every frame).
    pub snapshots_sent: u64,
    /// Logs of replicas moved away that nodes forgot (`LogOp::Forget` made durable).
    pub stray_logs_forgotten: u64,
    /// Disks lost (`SimParams::disk_loss`): a node started again on empty stores without a drain.
    pub disks_lost: u64,
    /// Frames the peers of a node back on an empty disk refused (`storage_changed`), at the end.
    pub storage_refusals: u64,
    /// Nodes that joined mid-run (`SimParams::grow`).
    pub nodes_joined: u64,
    /// Replicas the joined nodes held at the end: slot-group replicas, and channel replicas the
    /// newest metas name.
    pub joined_replicas: u64,
    /// Nodes that left mid-run, drained first (`SimParams::shrink`).
    pub nodes_removed: u64,
    /// Planned stops (`SimParams::planned_stops`): nodes set leaving, then stopped.
    pub planned_stops: u64,
    /// Planned stops at which the node led nothing any more, idle channels included (`NodeStatus::handed_off`).
    pub stops_handed_off: u64,
    /// Planned stops whose checkpoints (`NodeCore::checkpoint_for_stop`) had all landed when the node
    /// stopped.
    pub stops_written_out: u64,
    /// Metadata registers (a user on a channel's list, a device, a membership, a plugin binding, a
    /// system uid) whose last change was known and checked on every replica (see `registers`).
    pub registers_checked: u64,
    /// Metadata stores armed to fail reads (`SimParams::meta_read_errors`).
    pub meta_read_errors: u64,
    /// Metadata stores armed to fail a write or a sync (`SimParams::meta_write_errors`).
    pub meta_write_errors: u64,
    /// Nodes restarted because their slot replicas stopped on a failed store access.
    pub slot_store_restarts: u64,
}

impl std::ops::AddAssign for Faults {
    fn add_assign(&mut self, other: Faults) {
        self.lost += other.lost;
        self.snapshots_sent += other.snapshots_sent;
        self.duplicated += other.duplicated;
        self.crashes += other.crashes;
        self.partitions += other.partitions;
        self.io_errors += other.io_errors;
        self.transfers += other.transfers;
        self.transfers_done += other.transfers_done;
        self.slot_moves += other.slot_moves;
        self.slot_moves_accepted += other.slot_moves_accepted;
        self.slot_groups_reconfigured += other.slot_groups_reconfigured;
        self.drains += other.drains;
        self.slot_migrations += other.slot_migrations;
        self.slots_migrated += other.slots_migrated;
        self.retention_moves += other.retention_moves;
        self.retention_moves_done += other.retention_moves_done;
        self.fanout_missed += other.fanout_missed;
        self.learners_removed += other.learners_removed;
        self.stray_logs_forgotten += other.stray_logs_forgotten;
        self.fanout_planned_again += other.fanout_planned_again;
        self.disks_lost += other.disks_lost;
        self.storage_refusals += other.storage_refusals;
        self.nodes_joined += other.nodes_joined;
        self.joined_replicas += other.joined_replicas;
        self.nodes_removed += other.nodes_removed;
        self.planned_stops += other.planned_stops;
        self.stops_handed_off += other.stops_handed_off;
        self.stops_written_out += other.stops_written_out;
        self.registers_checked += other.registers_checked;
        self.meta_read_errors += other.meta_read_errors;
        self.meta_write_errors += other.meta_write_errors;
        self.slot_store_restarts += other.slot_store_restarts;
    }
}

enum Event {
    Frame {
        from: NodeId,
        to: NodeId,
        bytes: Bytes,
    },
    SlotsSynced {
        node: NodeId,
        incarnation: u64,
        token: u64,
    },
    Persisted {
        node: NodeId,
        incarnation: u64,
        token: PersistToken,
        batch: LogBatch,
    },
    ReadDone {
        node: NodeId,
        incarnation: u64,
        channel: ChannelId,
        token: tidings::channel::machine::ReadToken,
        from: Seq,
        through: Seq,
        max_bytes: usize,
    },
    Lookup {
        node: NodeId,
        incarnation: u64,
        lookup: tidings::node::Lookup,
    },
    ListLogs {
        node: NodeId,
        incarnation: u64,
        page: tidings::node::LogPage,
    },
    Restart {
        node: NodeId,
    },
    /// `node` loses its disk (`SimParams::disk_loss`).
    LoseDisk {
        node: NodeId,
    },
    /// `node` restarts with the joining node in its list (`SimParams::grow`).
    RestartWithJoiner {
        node: NodeId,
    },
    /// `node`, set leaving in its incarnation `incarnation`, stops (`SimParams::planned_stops`).
    PlannedStop {
        node: NodeId,
        incarnation: u64,
    },
    /// `node`, asked for its checkpoints at its planned stop, goes down (`SimParams::planned_stops`).
    StopAfterCheckpoints {
        node: NodeId,
        incarnation: u64,
    },
    /// The joining node starts (`SimParams::grow`).
    Join,
    /// The leaving node's drain is asked (again) (`SimParams::shrink`).
    AskDrain,
    /// The leaving node leaves if its drain is done (`SimParams::shrink`).
    RemoveOnceDrained,
    /// `node` restarts without the removed node in its list (`SimParams::shrink`).
    RestartWithout {
        node: NodeId,
    },
}

struct SimNode {
    config: NodeConfig,
    kv: Arc<MemoryKv>,
    log: Arc<MemoryLog>,
    core: Option<NodeCore>,
    /// Bumped at every crash: completions of an older incarnation are dropped (the work died with it).
    incarnation: u64,
    /// How the node reads the time (`SimParams::clock_skew`).
    clock: clock::NodeClock,
    /// Its clock's rate when skewed, in millionths of the simulation's.
    clock_rate_ppm: u64,
}

/// One simulated cluster.
pub struct World {
    params: SimParams,
    rng: DetRng,
    /// Planned stops under way (`SimParams::planned_stops`).
    stops: planned_stops::PlannedStops,
    /// How late each second copy of a duplicated frame comes (`SimParams::late_duplicates`).
    late_duplicates: DetRng,
    /// Which metadata stores fail reads, and when (`SimParams::meta_read_errors`).
    meta_faults: DetRng,
    /// Which metadata stores fail writes or syncs, and when (`SimParams::meta_write_errors`).
    meta_write_faults: DetRng,
    now: Time,
    nodes: BTreeMap<NodeId, SimNode>,
    events: BTreeMap<(Time, u64), Event>,
    next_event: u64,
    /// One-way partitions: (from, to) → heals at.
    cut: BTreeMap<(NodeId, NodeId), Time>,
    faulty: bool,
    /// The client workload runs (off while the liveness phase drains).
    requests_on: bool,
    channels: Vec<ChannelId>,
    oracle: Oracle,
    faults: Faults,
    trace: u64,
    next_api: u64,
    /// Last HW seen per (node, channel) since the node's last crash.
    hw_seen: BTreeMap<(NodeId, ChannelId), Seq>,
    /// The highest HW any replica of each channel showed (a crash does not uncommit anything).
    committed_seen: BTreeMap<ChannelId, Seq>,
    /// Storage failures each node reported when its HWs were last seen.
    storage_failures_seen: BTreeMap<NodeId, u64>,
    /// Liveness probes in flight: request → channel, and the node it went through (a crash of that node
    /// ends it unanswered, and the channel is probed again).
    probes: BTreeMap<ApiId, (ChannelId, NodeId)>,
    /// Retention moves asked for and not answered yet: their channel.
    retentions: BTreeMap<ApiId, ChannelId>,
    /// Channels that acknowledged a probe after healing, and through which serving nodes.
    probed: BTreeSet<(ChannelId, NodeId)>,
    /// Channels and serving nodes no probe was acknowledged through, whose last probes were refused as
    /// sent to a node that does not lead the channel: how many in a row, and the last answer. Any node
    /// may take a channel's append (one not leading it forwards it), so a node still routing there at
    /// the end has a stale route.
    misrouted: BTreeMap<(ChannelId, NodeId), (u32, String)>,
    /// Where the next round's route probes start among those not acknowledged yet.
    route_cursor: usize,
    /// Metadata writes in flight: request → the user written.
    user_writes: BTreeMap<ApiId, Uid>,
    /// Acknowledged user writes, by the hash slot of the uid.
    users_acked: BTreeMap<HashSlot, Vec<Uid>>,
    /// Metadata writes the final check follows (see `registers`).
    register_changes: BTreeMap<ApiId, registers::RegisterChange>,
    /// Authoritative reads in flight: request → the users acknowledged in its group before it was issued.
    barriers: BTreeMap<ApiId, Vec<Uid>>,
    /// Slot-group replica moves and aborts asked for, waiting for their answer.
    slot_moves: BTreeSet<ApiId>,
    /// Every node's fanout host: records what was delivered.
    fanout_host: Arc<senders::RecordingHost>,
    /// The node that lost its disk, once it has (`SimParams::disk_loss`): its peers refuse it for good,
    /// so requests no longer go through it and the checks of what replicas hold leave it out.
    lost_disk: Option<NodeId>,
    /// The storage identity it started with on its new disk (once it has).
    lost_disk_identity: Option<tidings::types::StorageId>,
    /// The node that joins mid-run, until it does (`SimParams::grow`).
    joiner: Option<(NodeId, SimNode)>,
    /// When the safety phase ends at the latest (once it started): its drawn length, and for a seed whose
    /// node leaves, a grace for the drain to finish and the rolling restart to end (`shrink_pending`).
    safety_ends: Time,
    /// The node that leaves (`SimParams::shrink`), the last ask of its drain, whether a node took it,
    /// and the node once it left.
    leaving: Option<NodeId>,
    drain_asked: Option<ApiId>,
    drain_taken: bool,
    removed: Option<NodeId>,
    /// When the rolling restart after the removal ends (its last node's restart).
    removal_restarts_end: Time,
}

/// Work the live nodes have in flight, summed over them: what the settle wait waits for besides the
/// cluster-wide checks.
#[derive(Default)]
struct WorkInFlight {
    /// Committed messages whose fanout has not finished.
    fanout_backlog: usize,
    /// Channel tasks (failovers, transfers, replacements) their controllers run: a leadership changing.
    channel_tasks: usize,
    /// Leaderships filed to start once they find a place: a leader that left memory fanning out plans
    /// that fanout again only then.
    leaderships_to_start: usize,
}

impl World {
    /// A cluster for `params`, not started.
    pub fn new(params: SimParams) -> World {
        let founders: Vec<NodeId> = (1..=params.nodes).map(NodeId::new).collect();
        // A joiner is built as the others are, one id past them, and set aside until it joins.
        let ids: Vec<NodeId> = (1..=params.nodes + u64::from(params.grow)).map(NodeId::new).collect();
        let mut nodes = BTreeMap::new();
        for id in &ids {
            let config = World::node_config(&params, &founders, *id);
            let kv = Arc::new(MemoryKv::new());
            let log = Arc::new(MemoryLog::new(LogLimits::default()));
            let clock_rate_ppm = clock::NodeClock::skewed_rate(
                DetRng::new(params.seed ^ crate::params::CLOCK_SKEW_STREAM ^ id.get()).next_u64(),
            );
            let clock = clock::NodeClock::exact();
            nodes.insert(*id, SimNode { config, kv, log, core: None, incarnation: 0, clock, clock_rate_ppm });
        }
        let joiner = World::set_joiner_aside(&mut nodes, params.grow);
        let channels = (0..params.channels)
            .map(|i| ChannelId::new(ChannelType::GROUP, &format!("sim-{i}")).expect("valid channel id"))
            .collect();
        World {
            rng: DetRng::new(params.seed),
            stops: planned_stops::PlannedStops::new(params.seed),
            late_duplicates: DetRng::new(params.seed ^ crate::params::LATE_DUPLICATES_STREAM),
            meta_faults: DetRng::new(params.seed ^ crate::params::META_READ_ERRORS_STREAM),
            meta_write_faults: DetRng::new(params.seed ^ crate::params::META_WRITE_ERRORS_STREAM),
            params,
            now: Time::ZERO,
            nodes,
            events: BTreeMap::new(),
            next_event: 0,
            cut: BTreeMap::new(),
            faulty: false,
            requests_on: false,
            channels,
            oracle: Oracle::default(),
            faults: Faults::default(),
            trace: 0xcbf2_9ce4_8422_2325,
            next_api: 1,
            hw_seen: BTreeMap::new(),
            committed_seen: BTreeMap::new(),
            storage_failures_seen: BTreeMap::new(),
            probes: BTreeMap::new(),
            retentions: BTreeMap::new(),
            probed: BTreeSet::new(),
            misrouted: BTreeMap::new(),
            route_cursor: 0,
            user_writes: BTreeMap::new(),
            slot_moves: BTreeSet::new(),
            users_acked: BTreeMap::new(),
            register_changes: BTreeMap::new(),
            barriers: BTreeMap::new(),
            fanout_host: Arc::new(senders::RecordingHost::default()),
            lost_disk: None,
            lost_disk_identity: None,
            joiner,
            safety_ends: Time::ZERO,
            leaving: None,
            drain_asked: None,
            drain_taken: false,
            removed: None,
            removal_restarts_end: Time::ZERO,
        }
    }

    /// Node `id`'s configuration for a run of `params`: the cluster of `founders` (a joiner adds itself),
    /// the run's drawn settings, and the limits and timings its flags cut.
    fn node_config(params: &SimParams, founders: &[NodeId], id: NodeId) -> NodeConfig {
        let mut config = NodeConfig::new(id, founders.to_vec());
        if !founders.contains(&id) {
            // The joiner, configured as the operator's guide says.
            config.nodes.push(id);
            config.join_existing = true;
        }
        config.slot_groups = params.slot_groups;
        config.channel_replicas = params.channel_replicas;
        config.channel_min_isr = params.min_isr;
        config.seed = params.seed;
        config.reactors = params.reactors;
        config.machine.hw_notify_delay = std::time::Duration::from_millis(params.hw_notify_delay_ms);
        // The sweep for logs of replicas moved away, within a run's length (by default a pass
        // every 10 minutes), a few channels a page so that passes page.
        config.stray_logs = tidings::node::StrayLogConfig {
            page: 4,
            page_interval: std::time::Duration::from_millis(100),
            pass_interval: std::time::Duration::from_secs(1),
            resume_after: std::time::Duration::from_millis(500),
        };
        if params.idle_evict_ms > 0 {
            config.channel_idle_evict = std::time::Duration::from_millis(params.idle_evict_ms);
        }
        if params.rebalance_leaders_ms > 0 {
            config.controller.rebalance_leaders_after =
                Some(std::time::Duration::from_millis(params.rebalance_leaders_ms));
        }
        if params.tight_limits {
            crate::params::tighten(&mut config, params.seed);
        }
        if params.hurried_timings {
            crate::params::hurry(&mut config, params.seed);
        }
        if params.disk_loss {
            // The emptied node never comes back: its ISR places are given to others within the run
            // (by default a down member is replaced after 30 s, longer than the healed phase).
            let soon = std::time::Duration::from_secs(3);
            config.controller.replace_down_after = config.controller.replace_down_after.min(soon);
        }
        config
    }

    /// Runs setup, the safety phase and the liveness phase, then the final checks.
    pub fn run(mut self) -> SimReport {
        self.set_up();
        self.faulty_phase();
        self.healed_phase();
        self.settle();
        self.final_checks();
        let steps = self.now.as_millis();
        SimReport {
            acked: self.oracle.acked_count(),
            delivered: self.fanout_host.count(),
            unanswered: self.oracle.unanswered(),
            params: self.params,
            steps,
            faults: self.faults,
            trace_hash: self.trace,
            violations: self.oracle.into_violations(),
        }
    }

    /// Setup, fault-free: the nodes boot and elect, then the channels are created and the senders'
    /// users and lists written (retried; what is still missing after that is a violation).
    fn set_up(&mut self) {
        let ids: Vec<NodeId> = self.nodes.keys().copied().collect();
        for id in &ids {
            self.boot(*id);
        }
        self.run_for(2_000);
        let mut created = BTreeSet::new();
        for _ in 0..20 {
            for channel in self.channels.clone() {
                if created.contains(&channel) {
                    continue;
                }
                let api = self.api();
                let info = ChannelInfo { channel: channel.clone(), flags: ChannelFlags::default() };
                let first = ids[0];
                let now = self.node_now(first);
                if let Some(core) = self.nodes.get_mut(&first).and_then(|n| n.core.as_mut()) {
                    core.create_channel(now, api, info);
                }
                self.oracle.expect_create(api, first, channel);
            }
            self.run_for(500);
            created.extend(self.oracle.created());
            if created.len() == self.channels.len() {
                break;
            }
        }
        if created.len() < self.channels.len() {
            self.oracle.violation(format!("setup: only {} of {} channels created", created.len(), self.channels.len()));
        }
        let senders_set_up = (0..20).any(|_| {
            let done = self.set_up_senders();
            self.run_for(500);
            done
        });
        if !senders_set_up {
            self.oracle.violation("setup: the senders' users and lists were not all written".into());
        }
        self.run_for(1_000);
    }

    /// The safety phase: client requests and faults for `safety_ms`, longer while a planned shrink is
    /// still under way.
    fn faulty_phase(&mut self) {
        self.faulty = true;
        self.safety_ends = self.now + Duration::from_millis(self.params.safety_ms + self.shrink_grace_ms());
        self.requests_on = true;
        self.schedule_disk_loss();
        self.schedule_growth();
        self.schedule_shrink();
        self.run_for(self.params.safety_ms);
        while self.shrink_pending() && self.now < self.safety_ends {
            self.run_for(100);
        }
        self.faulty = false;
    }

    /// Liveness: everything healed, no new client requests; every request must be answered in time
    /// (an append commits or times out within the leader's append timeout plus the forward slack),
    /// and every channel must take a new append again (the controller fails over channels whose
    /// leader crashed or cannot lead, and clears fences).
    fn healed_phase(&mut self) {
        self.requests_on = false;
        self.heal();
        let probe_every = 500;
        for _ in 0..self.params.liveness_ms / probe_every {
            self.probe();
            self.run_for(probe_every);
        }
    }

    /// Time for what lags to settle before the final checks, bounded.
    ///
    /// Fanout lags the commits under load, and by far with tight limits (a page of one member, a
    /// round trip per page): with nothing new committed, it gets time to finish before the checks
    /// look for messages that never reached their subscribers. And a slot group's followers learn
    /// the last commit with the leader's next heartbeat: the checks compare replicas once they
    /// agree. A drain asked late in the faulty phase may still be moving replicas (a repair pass
    /// may come only an idle interval later, and a replacement waits for its replica to catch up).
    /// A probe sent late in the healed phase may still wait for its answer (an append commits or
    /// times out within its leader's append timeout): it is let finish, so that a request counts as
    /// never answered only once it has waited far longer than any timeout.
    /// A channel task (a transfer, a replacement, a failover) may be under way: a leader that steps
    /// down for a transfer stops its fanout, and its successor plans it again from the checkpoint, so
    /// a backlog read between the two is not a finished one (755005205 once ended the wait there).
    /// Whatever does not settle in time is reported by those checks.
    fn settle(&mut self) {
        let (mut settled_ms, mut backlog_low, mut stalled_ms) = (0, usize::MAX, 0);
        loop {
            let work = self.work_in_flight();
            let backlog = work.fanout_backlog;
            if backlog < backlog_low {
                (backlog_low, stalled_ms) = (backlog, 0);
            }
            let settling = settled_ms < SETTLE_MAX_MS
                && (backlog > 0
                    || self.oracle.unanswered() > 0
                    || !self.slot_replicas_agree()
                    || work.channel_tasks > 0
                    || work.leaderships_to_start > 0
                    || !self.drains_left().1.is_empty()
                    || !self.surplus_left().is_empty()
                    || !self.stray_logs_left().is_empty());
            let fanning_out = backlog > 0 && stalled_ms < FANOUT_STALL_MS && settled_ms < FANOUT_SETTLE_MAX_MS;
            if !settling && !fanning_out {
                break;
            }
            self.run_for(SETTLE_STEP_MS);
            settled_ms += SETTLE_STEP_MS;
            stalled_ms += SETTLE_STEP_MS;
        }
    }

    /// The cores of the nodes running now.
    fn running_cores(&self) -> impl Iterator<Item = &NodeCore> {
        self.nodes.values().filter_map(|n| n.core.as_ref())
    }

    /// What the live nodes still have in flight, from one status of each.
    fn work_in_flight(&self) -> WorkInFlight {
        let mut work = WorkInFlight::default();
        for status in self.running_cores().map(NodeCore::status) {
            work.fanout_backlog += status.fanout_backlog;
            work.channel_tasks += status.tasks.len();
            work.leaderships_to_start += status.leaderships_to_start;
        }
        work
    }

    fn api(&mut self) -> ApiId {
        self.next_api += 1;
        ApiId(self.next_api)
    }

    fn boot(&mut self, id: NodeId) {
        let boot_id = self.rng.next_u64();
        let node = self.nodes.get_mut(&id).expect("known node");
        node.config.boot_id = boot_id;
        let kv: Arc<dyn Kv> = node.kv.clone();
        let logs = Arc::new(RaftLogStore::open(kv.clone()).expect("memory raft log opens"));
        let router = Arc::new(Router::new(node.config.table()));
        let log: Arc<dyn MessageLog> = node.log.clone();
        if self.params.clock_skew {
            node.clock = clock::NodeClock::started(self.now, node.clock_rate_ppm);
        }
        let core = NodeCore::new(node.config.clone(), logs, MetaStore::new(kv), log, router, node.clock.at(self.now))
            .expect("node core starts");
        if self.lost_disk == Some(id) {
            self.lost_disk_identity = Some(core.storage_id());
        }
        node.core = Some(core);
    }

    /// A step of a rolling restart: `id`'s configuration changes, and it restarts at once if it runs (a
    /// crash, so whatever it had not synced is lost, as in any crash), or at its scheduled start if it
    /// is down.
    fn restart_with(&mut self, id: NodeId, change: impl FnOnce(&mut NodeConfig)) {
        let node = self.nodes.get_mut(&id).expect("known node");
        change(&mut node.config);
        if node.core.is_some() {
            self.crash(id);
            self.boot(id);
        }
    }

    fn crash(&mut self, id: NodeId) {
        let node = self.nodes.get_mut(&id).expect("known node");
        if node.core.take().is_none() {
            return;
        }
        node.incarnation += 1;
        if std::env::var("SIM_DEBUG").is_ok() {
            eprintln!("{:?} crash {id}", self.now);
        }
        node.kv.crash();
        node.log.crash();
        self.hw_seen.retain(|(n, _), _| *n != id);
        self.probes.retain(|_, (_, via)| *via != id);
        self.faults.crashes += 1;
        self.oracle.node_crashed(id);
        let at = self.now + Duration::from_millis(self.params.restart_ms);
        self.schedule(at, Event::Restart { node: id });
    }

    fn heal(&mut self) {
        self.call_off_planned_stops();
        self.cut.clear();
        for node in self.nodes.values() {
            node.log.clear_failpoints();
            node.kv.clear_failpoints();
        }
        let down: Vec<NodeId> =
            self.nodes.iter().filter(|(id, n)| n.core.is_none() && self.may_start(**id)).map(|(id, _)| *id).collect();
        for id in down {
            self.boot(id);
        }
    }

    /// What node `id`'s clock reads now: the time its core is handed.
    fn node_now(&self, id: NodeId) -> Time {
        self.nodes.get(&id).map_or(self.now, |n| n.clock.at(self.now))
    }

    fn schedule(&mut self, at: Time, event: Event) {
        self.next_event += 1;
        self.events.insert((at, self.next_event), event);
    }

    fn mix(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.trace ^= u64::from(*b);
            self.trace = self.trace.wrapping_mul(0x0100_0000_01b3);
        }
    }

    fn run_for(&mut self, ms: u64) {
        for _ in 0..ms {
            self.step();
        }
    }

    /// One virtual millisecond.
    fn step(&mut self) {
        self.now = self.now + Duration::from_millis(1);
        let now = self.now;
        if self.faulty {
            self.inject_faults();
            self.inject_meta_read_errors();
            self.inject_meta_write_errors();
        }
        self.restart_stopped_slot_stores();
        self.cut.retain(|_, heals| *heals > now);
        while let Some(entry) = self.events.first_entry() {
            if entry.key().0 > now {
                break;
            }
            let event = entry.remove();
            self.deliver(event);
        }
        let ids: Vec<NodeId> = self.nodes.keys().copied().collect();
        for id in &ids {
            let Some(node) = self.nodes.get_mut(id) else { continue };
            let local = node.clock.at(now);
            if let Some(core) = node.core.as_mut() {
                if core.poll_timeout() <= local {
                    core.handle_tick(local);
                }
            }
        }
        if self.requests_on && self.rng.chance(self.params.request_ppm) {
            self.request();
        }
        for id in &ids {
            self.drain(*id);
        }
        if now.as_millis() % 100 == 0 {
            self.check_hw_monotonic();
        }
    }

    fn inject_faults(&mut self) {
        let ids: Vec<NodeId> = self.nodes.keys().copied().collect();
        if self.rng.chance(self.params.crash_ppm) {
            let id = *self.rng.pick(&ids).expect("nodes");
            if self.params.planned_stops && self.stops.rng.chance(500_000) {
                self.plan_stop(id);
            } else {
                self.crash(id);
            }
        }
        if self.rng.chance(self.params.io_error_ppm) {
            let id = *self.rng.pick(&ids).expect("nodes");
            let op = if self.rng.chance(500_000) { LogFailOp::Sync } else { LogFailOp::Read };
            let after = self.rng.below(3);
            self.nodes[&id].log.fail(op, after, 1);
            self.faults.io_errors += 1;
        }
        if ids.len() > 1 && self.rng.chance(self.params.partition_ppm) {
            let from = *self.rng.pick(&ids).expect("nodes");
            let to = *self.rng.pick(&ids).expect("nodes");
            if from != to {
                self.cut.insert((from, to), self.now + Duration::from_millis(self.params.partition_ms));
                self.faults.partitions += 1;
            }
        }
    }

    fn deliver(&mut self, event: Event) {
        let now = self.now;
        match event {
            Event::Frame { from, to, bytes } => self.deliver_frame(now, from, to, &bytes),
            Event::SlotsSynced { node, incarnation, token } => {
                let n = self.nodes.get_mut(&node).expect("known node");
                if n.incarnation != incarnation {
                    return;
                }
                let synced = n.kv.sync();
                if let Some(core) = n.core.as_mut() {
                    match synced {
                        Ok(()) => core.handle_slots_synced(n.clock.at(now), token),
                        Err(error) => core.handle_slots_sync_failed(n.clock.at(now), &error),
                    }
                }
            }
            Event::Persisted { node, incarnation, token, batch } => {
                self.persisted(now, node, incarnation, token, batch)
            }
            Event::ReadDone { node, incarnation, channel, token, from, through, max_bytes } => {
                self.with_running(node, incarnation, |core, log, at| {
                    let limits = ReadLimits { records_max: usize::MAX, bytes_max: max_bytes };
                    let result = log.read(&channel, from, through, limits);
                    core.handle_read(at, &channel, token, result);
                });
            }
            // Read when it runs, as a reader thread would: not when it was asked for.
            Event::Lookup { node, incarnation, lookup } => self.with_running(node, incarnation, |core, log, at| {
                let answer = lookup.carry_out(log, core.reader());
                core.handle_lookup(at, answer);
            }),
            Event::ListLogs { node, incarnation, page } => self.with_running(node, incarnation, |core, log, at| {
                let listed = page.carry_out(log, core.reader());
                core.handle_logs_listed(at, listed);
            }),
            Event::Restart { node } => {
                if self.nodes[&node].core.is_none() && self.may_start(node) {
                    self.boot(node);
                }
            }
            Event::LoseDisk { node } => self.lose_disk(node),
            Event::RestartWithJoiner { node } => self.restart_with_joiner(node),
            Event::Join => self.join(),
            Event::AskDrain => self.ask_drain(),
            Event::RemoveOnceDrained => self.unfaulted(|world| world.remove_once_drained()),
            Event::RestartWithout { node } => self.restart_without(node),
            Event::PlannedStop { node, incarnation } => self.planned_stop(node, incarnation),
            Event::StopAfterCheckpoints { node, incarnation } => self.stop_after_checkpoints(node, incarnation),
        }
    }

    /// A frame from `from` reaches `to`, unless the link is cut or `to` is down.
    fn deliver_frame(&mut self, now: Time, from: NodeId, to: NodeId, bytes: &[u8]) {
        if self.cut.contains_key(&(from, to)) {
            return;
        }
        let local = self.node_now(to);
        if self.nodes.get(&to).is_none_or(|n| n.core.is_none()) {
            return;
        }
        // Every frame a node sends is well formed: a refusal here is a bug, but for the frames of a
        // node back on an empty disk, which its peers must refuse (see `disk_loss`).
        let must_refuse = self.must_refuse_frame(from, to, bytes);
        let Some(core) = self.nodes.get_mut(&to).and_then(|n| n.core.as_mut()) else { return };
        match core.handle_frame(local, from, bytes) {
            Ok(()) if must_refuse => {
                self.oracle.violation(format!("{to} took a frame of {from}, back on an empty disk"));
            }
            Ok(()) => {}
            Err(FrameError::StorageChanged { .. }) if Some(from) == self.lost_disk => {}
            // A frame sent to an earlier start of `to` (delayed across its restart), or a forward sent
            // before its sender heard from `to`'s start: refused by design (`node::peer_starts`).
            Err(FrameError::EarlierStart { .. } | FrameError::UnaddressedForward { .. }) => {}
            // A late copy from a node removed from the cluster since it was sent.
            Err(FrameError::UnknownNode(_)) if self.params.late_duplicates && self.leaving == Some(from) => {}
            Err(error) => self.oracle.violation(format!("{to} refused a frame from {from}: {error}")),
        }
        self.mix(&now.as_millis().to_le_bytes());
        self.mix(bytes);
    }

    /// A durable append of `node`'s incarnation lands in its message log (or fails there).
    fn persisted(&mut self, now: Time, node: NodeId, incarnation: u64, token: PersistToken, batch: LogBatch) {
        let lying = self.params.unsafe_lying_disk;
        let n = self.nodes.get_mut(&node).expect("known node");
        if n.incarnation != incarnation {
            return;
        }
        let channel = batch.channel.clone();
        let forgets = batch.ops.iter().any(|op| matches!(op, LogOp::Forget { .. }));
        let result = if lying { Ok(()) } else { n.log.commit(batch) };
        if forgets && result.is_ok() {
            // The replica's log starts again from nothing: its HW may be lower next time it shows.
            self.hw_seen.remove(&(node, channel.clone()));
            self.faults.stray_logs_forgotten += 1;
        }
        if let Some(core) = n.core.as_mut() {
            core.handle_persisted(n.clock.at(now), &channel, token, result);
        }
    }

    /// Runs `io` on node `node`'s core, its message log and its clock's reading of now, if the node
    /// runs the incarnation that asked for the IO (one asked before a crash finds nothing).
    fn with_running(
        &mut self,
        node: NodeId,
        incarnation: u64,
        io: impl FnOnce(&mut tidings::node::NodeCore, &dyn MessageLog, Time),
    ) {
        let now = self.now;
        let n = self.nodes.get_mut(&node).expect("known node");
        if n.incarnation != incarnation {
            return;
        }
        let at = n.clock.at(now);
        if let Some(core) = n.core.as_mut() {
            io(core, n.log.as_ref(), at);
        }
    }

    /// Carries out every effect of node `id`.
    fn drain(&mut self, id: NodeId) {
        loop {
            let now = self.now;
            let Some(node) = self.nodes.get_mut(&id) else { return };
            let (incarnation, clock) = (node.incarnation, node.clock);
            let Some(core) = node.core.as_mut() else { return };
            let Some(effect) = core.poll_effect() else { return };
            match effect {
                NodeEffect::Send { to, frame } => self.send(id, to, frame),
                NodeEffect::SyncSlots { token } => {
                    let at = now + self.disk_delay();
                    self.schedule(at, Event::SlotsSynced { node: id, incarnation, token });
                }
                NodeEffect::Persist { token, batch } => {
                    let at = now + self.disk_delay();
                    self.schedule(at, Event::Persisted { node: id, incarnation, token, batch });
                }
                NodeEffect::Read { channel, token, from, through, max_bytes } => {
                    let at = now + self.disk_delay();
                    self.schedule(
                        at,
                        Event::ReadDone { node: id, incarnation, channel, token, from, through, max_bytes },
                    );
                }
                NodeEffect::Lookup(lookup) => {
                    let at = now + self.disk_delay();
                    self.schedule(at, Event::Lookup { node: id, incarnation, lookup });
                }
                NodeEffect::ListLogs(page) => {
                    let at = now + self.disk_delay();
                    self.schedule(at, Event::ListLogs { node: id, incarnation, page });
                }
                NodeEffect::Fanout(work) => {
                    if let Some(answer) = carry_out_fanout(core.reader(), self.fanout_host.as_ref(), work) {
                        core.handle_fanout(clock.at(now), answer);
                    }
                }
                NodeEffect::Done { id: api, result } => self.api_done(id, now, api, result),
            }
        }
    }

    /// An API call answered on node `id`: what the workload tracks of it, then the oracle.
    fn api_done(&mut self, id: NodeId, now: Time, api: ApiId, result: ApiResult) {
        if let Some(uid) = self.user_writes.remove(&api) {
            if matches!(result, ApiResult::Meta(Ok(()))) {
                self.users_acked.entry(slot_of_user(&uid)).or_default().push(uid);
            }
        }
        self.register_change_answered(api, &result);
        if let Some(expected) = self.barriers.remove(&api) {
            // A read barrier covers the key's slot (refused while the slot is fenced).
            if matches!(result, ApiResult::Meta(Ok(()))) {
                self.unfaulted(|world| world.check_barrier_read(id, expected));
            }
        }
        if let ApiResult::Task(Ok(_)) = &result {
            self.faults.transfers_done += 1;
        }
        if let ApiResult::Retained(outcome) = &result {
            let channel = self.retentions.remove(&api);
            if let (Some(channel), Ok(boundary)) = (channel, outcome) {
                self.faults.retention_moves_done += 1;
                self.check_retention_within_hw(&channel, *boundary);
            }
        }
        self.drain_answered(api, &result);
        if self.slot_moves.remove(&api) && matches!(result, ApiResult::Meta(Ok(()))) {
            self.faults.slot_moves_accepted += 1;
        }
        if let Some((channel, via)) = self.probes.remove(&api) {
            if std::env::var("SIM_DEBUG").is_ok() {
                eprintln!("{now:?} probe of {channel} via {id}: {result:?}");
            }
            self.probe_answered(channel, via, &result);
        }
        if std::env::var("SIM_DEBUG").is_ok() {
            if let ApiResult::Appended(Ok(seqs)) = &result {
                eprintln!("{now:?} {id} acked {api:?} {seqs:?}");
            }
        }
        self.mix(&api.0.to_le_bytes());
        self.mix(format!("{result:?}").as_bytes());
        self.oracle.answered(api, result);
    }

    /// After a read barrier on node `id`, its local reads show every user acknowledged before it.
    fn check_barrier_read(&mut self, id: NodeId, expected: Vec<Uid>) {
        let core = self.nodes[&id].core.as_ref().expect("answered by a live core");
        for uid in expected {
            if !matches!(core.reader().user(&uid), Ok(Some(_))) {
                let group = core.slot().table().group_of(slot_of_user(&uid));
                self.oracle.violation(format!(
                    "{id}: authoritative read misses acknowledged user {} ({group} here: {:?})",
                    uid.as_str(),
                    core.slot().status(group)
                ));
            }
        }
    }

    fn disk_delay(&mut self) -> Duration {
        Duration::from_millis(self.rng.range(0, self.params.disk_delay_max_ms))
    }

    fn send(&mut self, from: NodeId, to: NodeId, frame: Bytes) {
        if self.params.tight_limits && starts_a_snapshot(&frame) {
            self.faults.snapshots_sent += 1;
        }
        let copies = if !self.faulty {
            1
        } else if self.rng.chance(self.params.loss_ppm) {
            self.faults.lost += 1;
            0
        } else if self.rng.chance(self.params.dup_ppm) {
            self.faults.duplicated += 1;
            2
        } else {
            1
        };
        for copy in 0..copies {
            let delay = if self.faulty { self.rng.range(0, self.params.delay_max_ms) } else { 0 };
            // Its own stream: the seed's other draws stay.
            let late = if copy == 1 && self.params.late_duplicates {
                self.late_duplicates.range(0, crate::params::LATE_DUPLICATE_MS)
            } else {
                0
            };
            let at = self.now + Duration::from_millis(delay.max(1) + late);
            self.schedule(at, Event::Frame { from, to, bytes: frame.clone() });
        }
    }
}

/// Whether `frame` carries the first chunk of a slot-group snapshot.
fn starts_a_snapshot(frame: &[u8]) -> bool {
    use tidings::frame::{decode, FrameBody, FrameLimits};
    use tidings::slot::raft::SlotBody;
    matches!(
        decode(frame, &FrameLimits::default()).map(|f| f.body),
        Ok(FrameBody::Slot(tidings::slot::raft::SlotMessage { body: SlotBody::Chunk { index: 0, .. }, .. }))
    )
}

/// The hash slot of a user's records.
fn slot_of_user(uid: &Uid) -> HashSlot {
    tidings::router::hash_slot(RoutingKey::Uid(uid).bytes())
}
