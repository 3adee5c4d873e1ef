//! Everything a seed decides about a run, drawn from the seed and printed with it.

use std::fmt;
use std::time::Duration;
use tidings::node::NodeConfig;
use tidings::types::DetRng;

/// Parameters of one simulated run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SimParams {
    /// The seed everything derives from.
    pub seed: u64,
    /// Nodes in the cluster (1 to 5).
    pub nodes: u64,
    /// Slot groups.
    pub slot_groups: u32,
    /// Replicas per channel (at most `nodes`, at most 3).
    pub channel_replicas: usize,
    /// MinISR of the channels.
    pub min_isr: u8,
    /// Channels the workload uses.
    pub channels: usize,
    /// Virtual milliseconds of the safety phase (faults on).
    pub safety_ms: u64,
    /// Virtual milliseconds of the liveness phase (faults healed).
    pub liveness_ms: u64,
    /// Per million per frame: lost.
    pub loss_ppm: u32,
    /// Per million per frame: delivered twice.
    pub dup_ppm: u32,
    /// Most network delay, ms (delays are uniform in 0..=max, so frames reorder).
    pub delay_max_ms: u64,
    /// Most storage completion delay, ms (slow disk).
    pub disk_delay_max_ms: u64,
    /// Per million per ms: a node crashes (and restarts `restart_ms` later).
    pub crash_ppm: u32,
    /// Down time of a crashed node, ms.
    pub restart_ms: u64,
    /// Per million per ms: a one-way partition between two nodes starts (it heals `partition_ms` later).
    pub partition_ppm: u32,
    /// Length of a partition, ms.
    pub partition_ms: u64,
    /// Per million per ms: a storage IO error is armed on a node (its message log's next few syncs or
    /// reads; one of them fails).
    pub io_error_ppm: u32,
    /// Per million per ms: a client request (append, retry or read) is issued.
    pub request_ppm: u32,
    /// Metadata workload: user writes, subscriber changes and authoritative reads beside the appends.
    pub metadata_workload: bool,
    /// Controller workload: about one request in a hundred asks a random node to move a random
    /// channel's leadership to a random node, as many to replace a random replica by a random node
    /// (refusals included), and as many set a slot group's preferred leader to a random member.
    pub leader_transfers: bool,
    /// How long channel leaders may hold back HW news for followers (`MachineConfig::hw_notify_delay`),
    /// ms: zero in a third of the seeds, the node's default (as long as a long poll) in a third, 5 to
    /// 400 ms in the rest. Drawn from its own stream, so the other parameters of a seed are what they
    /// were before it existed.
    pub hw_notify_delay_ms: u64,
    /// How long a channel replica stays idle before it is evicted (`NodeConfig::channel_idle_evict`), ms:
    /// 300 to 3,000 in a third of the seeds, so replicas leave memory and come back (from the log, the
    /// slot replica's meta and a resumable leadership) mid-run; 0 in the rest (the node's default of
    /// 30 s, longer than a run). Drawn from its own stream.
    pub idle_evict_ms: u64,
    /// Channel shards per node (`NodeConfig::reactors`), 1 to 3: the node's channels split over them
    /// and their messages with the core cross a shard boundary. Drawn from its own stream.
    pub reactors: usize,
    /// How long a channel's preferred replica must be back before its leadership is transferred back
    /// (`ControllerConfig::rebalance_leaders_after`), ms: 500 to 5,000 in a third of the seeds, so those
    /// transfers run beside the faults and the healing; 0 in the rest (the default of 30 s, longer than
    /// most runs' healed phase). Drawn from its own stream.
    pub rebalance_leaders_ms: u64,
    /// Clients now and then give up a channel's older records (`NodeCore::set_retention`), up to a
    /// little past the last acknowledged one (some refused as past HW): in half of the seeds. Drawn
    /// from its own stream.
    pub retention_moves: bool,
    /// The nodes run with every page, batch, chunk and cache limit cut to a few items or bytes
    /// (`tighten`): raft logs compacted every few entries (so lagging and new replicas are sent
    /// snapshots, in many chunks), pulls, reads, subscriber pages, delivery plans, migration chunks and
    /// repair passes of one or a few items, record caches too small to answer pulls from memory, room
    /// for fewer active channel replicas (3 to 8) than a node holds. Paths
    /// that only run once a limit is reached (the second page, the snapshot instead of the log) run in
    /// every such seed, under the same faults. In a third of the seeds; its own stream.
    pub tight_limits: bool,
    /// The nodes run with their timeouts and intervals cut down (`hurry`): raft ticks, elections and
    /// heartbeats; failure detection; long polls, pull timeouts and ISR clocks; append and proposal
    /// timeouts; a controller's fence takeover, drain and catch-up deadlines, repair and reconcile
    /// intervals. Timers then fire beside the faults' delays and each other (a fence taken over while
    /// its own controller still drives its task, an append given up while it commits), as they may on
    /// a loaded cluster. In a third of the seeds; its own stream.
    pub hurried_timings: bool,
    /// Each node's clock runs at its own rate, 0.95 to 1.05 times the simulation's, and starts over at
    /// zero whenever its node boots, as the threaded runtime's clock does (it counts from the process's
    /// start): timeouts on two nodes then disagree on how long a while is, and a restarted node's times
    /// begin again below those it had. In a third of the seeds; its own stream.
    pub clock_skew: bool,
    /// One node loses its disk once in the safety phase: it crashes and starts again on empty stores,
    /// without being drained first (what `docs/operations.md` says never to do). Its peers must refuse
    /// it for good (a new storage identity), and it is left out of the checks of what replicas hold and
    /// of the nodes requests go through from then on. Only where [`SimParams::disk_loss_possible`]: the
    /// others commit, fail over and elect without it (with MinISR 1 a record committed on the lost
    /// node alone is gone, and its channel rightly stays fenced). In a quarter of those seeds; its own
    /// stream.
    pub disk_loss: bool,
    /// A node joins the cluster in the safety phase, as `docs/operations.md` tells an operator to add
    /// one: every node restarts in turn (a crash and an immediate start) with the new node in its list,
    /// the founders kept; then the new node starts on empty stores. It holds nothing until the
    /// workload's transfers, replacements, slot-replica moves and drains give it replicas. Only where
    /// [`SimParams::grow_possible`]; in a quarter of those seeds; its own stream.
    pub grow: bool,
    /// A node leaves the cluster, as `docs/operations.md` tells an operator to remove one: it is
    /// drained (asked in the safety phase until a node takes the call), and once the drain is done
    /// (looked at every 300 ms of the safety phase; a drain not done by its end removes nothing) it
    /// stops for good and every other node restarts in turn without it in its list. No operator request targets it once it leaves. Only where
    /// [`SimParams::shrink_possible`]; in a quarter of those seeds; its own stream.
    pub shrink: bool,
    /// Half of the crashes are planned stops instead, as a host stops a node for a restart or an
    /// upgrade: the node is set leaving (`NodeCore::set_leaving`), its peers hand off its channel
    /// leaderships and it hands off its slot groups, and it stops 0 to 3 s later (a crash, as every
    /// stop here: sometimes in the middle of the hand-offs). A stop still pending when the faults heal
    /// is called off (the node stops leaving). Only with two nodes or more; in a third of those seeds;
    /// its own stream.
    pub planned_stops: bool,
    /// The second copy of a duplicated frame comes up to 3 s late (`LATE_DUPLICATE_MS`) instead of
    /// within the delay drawn, and the workload's subscriber changes go to two channels and four users,
    /// so that a late copy of one can land after a later change to the same pair (the final check holds
    /// every pair to its last acknowledged change). A late copy may reach a later start of its receiver,
    /// as from a transport that held it across the restart. Off in every seed's own draws (turning it on
    /// changes a seed's run); `--late-duplicates` turns it on.
    pub late_duplicates: bool,
    /// The workload's member-list changes become every kind of per-key metadata write, drawn alike:
    /// subscriber, allow and deny lists, devices, memberships, plugin bindings and system uids, each
    /// put or removed, all held to their last acknowledged change by the final check (`registers`).
    /// The simulator's own draws send only subscriber changes, and reach the slot FSM's paths for the
    /// other kinds nowhere else. Off in every seed's own draws (turning it on changes a seed's run);
    /// `--all-metadata` turns it on.
    pub all_metadata: bool,
    /// The nodes' metadata stores fail reads now and then: a get or a scan of the slot metadata
    /// keyspace, one or two in a row, on a running node, about every 2 virtual seconds in the faulty
    /// phase (their own stream). Whatever reads them must fail closed: a controller, a fanout page, a
    /// migration's export, an activation, a sender check, an API read. A slot FSM whose apply cannot
    /// read stops its node's slot replicas (`MultiRaft::storage_failed`), and the simulator restarts
    /// such a node, as its operator would. The raft logs' keyspaces are spared: raft-rs takes a failed
    /// log read for a fatal error. Off in every seed's own draws; `--meta-read-errors` turns it on.
    pub meta_read_errors: bool,
    /// The nodes' metadata stores fail a write (of the slot metadata keyspace: every slot-layer round
    /// writes its raft logs and FSM changes in one batch with it) or a sync now and then, on a running
    /// node, about every 5 virtual seconds in the faulty phase (their own stream). Either stops the
    /// node's slot replicas until a restart, which the simulator then makes: nothing the failed
    /// operation covered may have been acknowledged. Off in every seed's own draws;
    /// `--meta-write-errors` turns it on.
    pub meta_write_errors: bool,
    /// Unsafe, for the simulator's own test: storage acknowledges persists without writing them.
    pub unsafe_lying_disk: bool,
    /// Unsafe, for the simulator's own test: a node that loses its disk (`disk_loss`) keeps its storage
    /// identity, as if its peers could not tell it from the node it was.
    pub unsafe_disk_loss_keeps_identity: bool,
    /// Unsafe, for the simulator's own test: appends from the banned and the denied sender go through
    /// `append` (no sender check), as a host that forgot the check would send them.
    pub unsafe_unchecked_senders: bool,
}

impl SimParams {
    /// The parameters `seed` draws.
    pub fn from_seed(seed: u64) -> Self {
        let mut rng = DetRng::new(seed ^ 0x5eed_5eed_5eed_5eed);
        let nodes = rng.range(1, 5);
        let channel_replicas = usize::try_from(nodes.min(3)).unwrap_or(3);
        let min_isr = u8::try_from(rng.range(1, channel_replicas as u64)).unwrap_or(1);
        let drawn = SimParams {
            seed,
            nodes,
            slot_groups: u32::try_from(rng.range(1, 4)).unwrap_or(1),
            channel_replicas,
            min_isr,
            channels: usize::try_from(rng.range(1, 6)).unwrap_or(1),
            safety_ms: rng.range(3_000, 8_000),
            liveness_ms: 15_000,
            loss_ppm: u32::try_from(rng.range(0, 50_000)).unwrap_or(0),
            dup_ppm: u32::try_from(rng.range(0, 20_000)).unwrap_or(0),
            delay_max_ms: rng.range(0, 20),
            disk_delay_max_ms: rng.range(0, 5),
            crash_ppm: u32::try_from(rng.range(0, 300)).unwrap_or(0),
            restart_ms: rng.range(100, 2_000),
            partition_ppm: u32::try_from(rng.range(0, 500)).unwrap_or(0),
            partition_ms: rng.range(50, 3_000),
            request_ppm: u32::try_from(rng.range(20_000, 300_000)).unwrap_or(100_000),
            io_error_ppm: u32::try_from(rng.range(0, 200)).unwrap_or(0),
            metadata_workload: true,
            leader_transfers: true,
            hw_notify_delay_ms: {
                let mut own = DetRng::new(seed ^ 0x4877_6e6f_7469_6679);
                match own.range(0, 2) {
                    0 => 0,
                    1 => own.range(5, 400),
                    _ => default_hw_notify_delay_ms(),
                }
            },
            reactors: usize::try_from(DetRng::new(seed ^ 0x7265_6163_746f_7273).range(1, 3)).unwrap_or(1),
            idle_evict_ms: {
                let mut own = DetRng::new(seed ^ 0x6576_6963_7469_6f6e);
                if own.range(0, 2) == 0 {
                    own.range(300, 3_000)
                } else {
                    0
                }
            },
            rebalance_leaders_ms: {
                let mut own = DetRng::new(seed ^ 0x7265_6261_6c61_6e63);
                if own.range(0, 2) == 0 {
                    own.range(500, 5_000)
                } else {
                    0
                }
            },
            // Its own generator, as the knobs above: the draws of the seed's other parameters stay.
            retention_moves: DetRng::new(seed ^ 0x7265_7465_6e74_696f).range(0, 1) == 0,
            tight_limits: DetRng::new(seed ^ TIGHT_LIMITS_STREAM).range(0, 2) == 0,
            hurried_timings: DetRng::new(seed ^ HURRIED_TIMINGS_STREAM).range(0, 2) == 0,
            clock_skew: DetRng::new(seed ^ CLOCK_SKEW_STREAM).range(0, 2) == 0,
            disk_loss: nodes >= 3
                && channel_replicas == 3
                && min_isr == 2
                && DetRng::new(seed ^ DISK_LOSS_STREAM).range(0, 3) == 0,
            grow: false,
            shrink: false,
            planned_stops: nodes >= 2 && DetRng::new(seed ^ PLANNED_STOPS_STREAM).range(0, 2) == 0,
            late_duplicates: false,
            all_metadata: false,
            meta_read_errors: false,
            meta_write_errors: false,
            unsafe_lying_disk: false,
            unsafe_disk_loss_keeps_identity: false,
            unsafe_unchecked_senders: false,
        };
        let grow = drawn.grow_possible() && DetRng::new(seed ^ GROW_STREAM).range(0, 3) == 0;
        let drawn = SimParams { grow, ..drawn };
        let shrink = drawn.shrink_possible() && DetRng::new(seed ^ SHRINK_STREAM).range(0, 3) == 0;
        SimParams { shrink, ..drawn }
    }
}

impl SimParams {
    /// Whether a seed with these parameters may lose a disk (`disk_loss`): at least three nodes, and
    /// channels of three replicas with MinISR 2, which commit and fail over without the lost one.
    pub fn disk_loss_possible(&self) -> bool {
        self.nodes >= 3 && self.channel_replicas == 3 && self.min_isr == 2
    }

    /// Whether a node may join in this run (`grow`): fewer than five nodes, and no lost disk (a node
    /// that joins after a disk was lost never saw the lost node's first identity, so it could not
    /// refuse the new one as the checks require of every peer).
    pub fn grow_possible(&self) -> bool {
        self.nodes < 5 && !self.disk_loss
    }

    /// Whether a node may leave in this run (`shrink`): at least four nodes, so the others can hold
    /// every slot and channel replica (three each) once it is drained; no lost disk and no node joining
    /// (one change of the node list per run).
    pub fn shrink_possible(&self) -> bool {
        self.nodes >= 4 && !self.disk_loss && !self.grow
    }

    /// A run that measures cost, not faults: three nodes, `channels` channels of three replicas with
    /// MinISR 2, no faults of any kind, no metadata or operator workload, a client request every
    /// millisecond for `load_ms`. Being a simulation, two runs of one build are the same run (their
    /// trace hashes agree), so the instructions it takes under callgrind, divided by its acknowledged
    /// appends, compare two builds that run it alike to within what the compiler's inlining moves
    /// between them (about 1% for an unrelated change): what the bench's wall-clock figures, on a
    /// shared machine, cannot do for a change of a few percent.
    pub fn steady(channels: usize, load_ms: u64) -> Self {
        SimParams {
            seed: 1,
            nodes: 3,
            slot_groups: 3,
            channel_replicas: 3,
            min_isr: 2,
            channels: channels.max(1),
            safety_ms: load_ms,
            liveness_ms: 2_000,
            loss_ppm: 0,
            dup_ppm: 0,
            delay_max_ms: 1,
            disk_delay_max_ms: 1,
            crash_ppm: 0,
            restart_ms: 0,
            partition_ppm: 0,
            partition_ms: 0,
            io_error_ppm: 0,
            request_ppm: 1_000_000,
            metadata_workload: false,
            leader_transfers: false,
            hw_notify_delay_ms: default_hw_notify_delay_ms(),
            idle_evict_ms: 0,
            reactors: 1,
            rebalance_leaders_ms: 0,
            retention_moves: false,
            tight_limits: false,
            hurried_timings: false,
            clock_skew: false,
            disk_loss: false,
            grow: false,
            shrink: false,
            planned_stops: false,
            late_duplicates: false,
            all_metadata: false,
            meta_read_errors: false,
            meta_write_errors: false,
            unsafe_lying_disk: false,
            unsafe_disk_loss_keeps_identity: false,
            unsafe_unchecked_senders: false,
        }
    }
}

impl fmt::Display for SimParams {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "SEED={} nodes={} groups={} replicas={} min_isr={} channels={} safety={}ms loss={}ppm dup={}ppm \
             delay<={}ms disk<={}ms crash={}ppm/ms restart={}ms partition={}ppm/ms for {}ms io-errors={}ppm/ms \
             requests={}ppm/ms reactors={}{}{}{}{}{}{}{}{}{}{}{}{}{}{}{}{}{}{}{}{}",
            self.seed,
            self.nodes,
            self.slot_groups,
            self.channel_replicas,
            self.min_isr,
            self.channels,
            self.safety_ms,
            self.loss_ppm,
            self.dup_ppm,
            self.delay_max_ms,
            self.disk_delay_max_ms,
            self.crash_ppm,
            self.restart_ms,
            self.partition_ppm,
            self.partition_ms,
            self.io_error_ppm,
            self.request_ppm,
            self.reactors,
            if self.metadata_workload { "" } else { " appends-only" },
            if self.leader_transfers { "" } else { " no-transfers" },
            if self.hw_notify_delay_ms > 0 {
                format!(" hw-delay={}ms", self.hw_notify_delay_ms)
            } else {
                String::new()
            },
            if self.idle_evict_ms > 0 { format!(" idle-evict={}ms", self.idle_evict_ms) } else { String::new() },
            if self.rebalance_leaders_ms > 0 {
                format!(" rebalance-after={}ms", self.rebalance_leaders_ms)
            } else {
                String::new()
            },
            if self.retention_moves { " retention-moves" } else { "" },
            if self.tight_limits { " tight-limits" } else { "" },
            if self.hurried_timings { " hurried-timings" } else { "" },
            if self.clock_skew { " clock-skew" } else { "" },
            if self.disk_loss { " disk-loss" } else { "" },
            if self.grow { " grow" } else { "" },
            if self.shrink { " shrink" } else { "" },
            if self.planned_stops { " planned-stops" } else { "" },
            if self.late_duplicates { " late-duplicates" } else { "" },
            if self.all_metadata { " all-metadata" } else { "" },
            if self.meta_read_errors { " meta-read-errors" } else { "" },
            if self.meta_write_errors { " meta-write-errors" } else { "" },
            if self.unsafe_lying_disk { " UNSAFE-lying-disk" } else { "" },
            if self.unsafe_disk_loss_keeps_identity { " UNSAFE-disk-loss-keeps-identity" } else { "" },
            if self.unsafe_unchecked_senders { " UNSAFE-unchecked-senders" } else { "" }
        )
    }
}

/// The stream `disk_loss`, the node that loses its disk and when, are drawn from.
pub(crate) const DISK_LOSS_STREAM: u64 = 0x6469_736b_5f6c_6f73;

/// The stream `shrink`, which node leaves and when its drain is asked, are drawn from.
pub(crate) const SHRINK_STREAM: u64 = 0x7368_7269_6e6b_5f6e;

/// The stream `planned_stops`, which crashes are planned stops and when they stop, are drawn from.
pub(crate) const PLANNED_STOPS_STREAM: u64 = 0x706c_616e_6e65_645f;

/// The stream how late each second copy comes is drawn from (`SimParams::late_duplicates`).
pub(crate) const LATE_DUPLICATES_STREAM: u64 = 0x6c61_7465_5f64_7570;

/// The stream which metadata stores fail reads, and when, is drawn from (`SimParams::meta_read_errors`).
pub(crate) const META_READ_ERRORS_STREAM: u64 = 0x6d65_7461_5f72_6561;

/// The stream which metadata stores fail writes or syncs, and when, is drawn from
/// (`SimParams::meta_write_errors`).
pub(crate) const META_WRITE_ERRORS_STREAM: u64 = 0x6d65_7461_5f77_7269;

/// How late the second copy of a duplicated frame comes at most (`SimParams::late_duplicates`).
pub(crate) const LATE_DUPLICATE_MS: u64 = 3_000;

/// The stream `grow`, and when the node joins, are drawn from.
pub(crate) const GROW_STREAM: u64 = 0x6772_6f77_5f6e_6f64;

/// The stream `clock_skew` and each node's clock rate are drawn from.
pub(crate) const CLOCK_SKEW_STREAM: u64 = 0x636c_6f63_6b5f_736b;

/// The stream `tight_limits` and the limits themselves are drawn from.
const TIGHT_LIMITS_STREAM: u64 = 0x7469_6768_745f_6c69;

/// Cuts `config`'s page, batch, chunk and cache limits to a few items or bytes, drawn from `seed`
/// (every node of a seed gets the same ones). Each stays valid for the simulator's workload: appends
/// of one record, keyed retries far fewer than the idempotency window, handoff slots as by default (a
/// new leader plans again everything its predecessors left; the cap has its own unit test).
pub fn tighten(config: &mut NodeConfig, seed: u64) {
    let mut rng = DetRng::new(seed ^ TIGHT_LIMITS_STREAM ^ 0x6c69_6d69_7473);
    let mut draw = |low: u64, high: u64| usize::try_from(rng.range(low, high)).unwrap_or(1);
    let raft = &mut config.raft;
    raft.compact_after_entries = draw(4, 200) as u64;
    raft.chunk_bytes = draw(32, 4096);
    raft.max_size_per_msg = draw(64, 8192) as u64;
    raft.max_inflight_msgs = draw(1, 8);
    raft.apply_batch_records_max = draw(1, 16);
    raft.pending_proposals_max = draw(8, 128);
    let machine = &mut config.machine;
    machine.request_records_max = 1;
    machine.pending_records_max = draw(1, 32);
    machine.persist_records_max = draw(1, 8);
    machine.pull_bytes_max = draw(1, 512);
    machine.cache_bytes_max = draw(0, 1024);
    let fanout = &mut config.fanout;
    fanout.page_size = draw(1, 4);
    fanout.plan_members_max = draw(1, 3);
    fanout.plans_in_flight_max = draw(1, 4);
    fanout.jobs_active_max = draw(1, 3);
    config.controller.migration_chunk_bytes = draw(8, 512);
    config.controller.repair_page = draw(1, 8);
    config.stray_logs.page = draw(1, 4);
    config.read_records_max = draw(1, 8);
    config.waiting_appends_max = draw(2, 64);
    // Fewer active replicas than a node holds: activations evict the least recently used quiescent
    // one (or a follower whose state is on disk), or are refused while none is. Not below 3: with room
    // for 2 (the least a shard keeps), a busy channel whose follower was evicted waits a pull timeout
    // to wake it again, and channels then commit by turns, too slowly for the healed phase.
    config.active_channels_max = draw(3, 8);
    // The checks page through every node's active replicas (`NodeCore::channel_statuses`) a few at a
    // time, and compare what the pages listed with the count the status gives.
    config.status_channels_max = draw(1, 3);
}

/// The stream `hurried_timings` and the timings themselves are drawn from.
const HURRIED_TIMINGS_STREAM: u64 = 0x6875_7272_6965_6474;

/// Cuts `config`'s timeouts and intervals down, drawn from `seed` (every node of a seed gets the same
/// ones), keeping the orders the configuration requires: heartbeats within elections, failure
/// detection over several pings, pull timeouts past long polls, an ISR member's allowed silence past a
/// healthy idle follower's.
pub fn hurry(config: &mut NodeConfig, seed: u64) {
    let mut rng = DetRng::new(seed ^ HURRIED_TIMINGS_STREAM ^ 0x7469_6d69_6e67);
    let mut draw = |low: u64, high: u64| rng.range(low, high);
    let ms = Duration::from_millis;
    let raft = &mut config.raft;
    raft.tick_interval = ms(draw(20, 100));
    raft.election_ticks_min = usize::try_from(draw(4, 10)).unwrap_or(10);
    raft.heartbeat_ticks = usize::try_from(draw(1, 2)).unwrap_or(1);
    let controller = &mut config.controller;
    controller.ping_interval = ms(draw(50, 250));
    controller.node_down_after = controller.ping_interval * u32::try_from(draw(3, 6)).unwrap_or(6);
    controller.fence_takeover_after = ms(draw(300, 5_000));
    controller.drain_timeout = ms(draw(300, 5_000));
    controller.catch_up_timeout = ms(draw(1_000, 10_000));
    controller.replace_down_after = ms(draw(1_000, 30_000));
    controller.repair_interval = ms(draw(100, 500));
    controller.repair_idle_interval = ms(draw(500, 10_000));
    controller.ask_interval = ms(draw(50, 200));
    controller.reconcile_interval = ms(draw(100, 1_000));
    controller.transfer_cooldown = ms(draw(500, 10_000));
    controller.migration_retry = ms(draw(100, 500));
    let machine = &mut config.machine;
    machine.pull_park = ms(draw(100, 3_000));
    machine.pull_timeout = machine.pull_park + ms(draw(100, 2_000));
    machine.idle_pull_interval = ms(draw(50, 2_000));
    machine.isr_alive = machine.healthy_silence() + ms(draw(100, 3_000));
    machine.isr_lag = ms(draw(500, 10_000));
    machine.append_timeout = ms(draw(300, 10_000));
    machine.proposal_timeout = ms(draw(300, 5_000));
}

/// The node's default `hw_notify_delay`, in ms.
fn default_hw_notify_delay_ms() -> u64 {
    let delay = tidings::channel::machine::MachineConfig::default().hw_notify_delay;
    u64::try_from(delay.as_millis()).unwrap_or(u64::MAX)
}
