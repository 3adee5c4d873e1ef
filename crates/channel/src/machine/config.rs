//! Limits and timings of a channel replica machine.

use std::time::Duration;

/// Configuration of a [`super::ChannelMachine`]. Every queue it keeps is bounded by one of these.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MachineConfig {
    /// Most records one append request may carry. Default 256.
    pub request_records_max: usize,
    /// Most payload bytes one append request may carry (no larger than `persist_bytes_max`, so any
    /// admitted request fits one durable append). Default 1 MiB.
    pub request_bytes_max: usize,
    /// Most records assigned a seq but not yet committed; beyond it appends get `Busy`. Default 8,192.
    pub pending_records_max: usize,
    /// Post-commit handoff slots (records admitted and not yet fanned out). Reserved at admission; none
    /// free: `ChannelBusy` before anything is written. Also the most messages of earlier leaders a new
    /// leader fans out again. Default 16,384.
    pub handoff_slots: usize,
    /// Most records in one durable append. Default 1,024.
    pub persist_records_max: usize,
    /// Most payload bytes in one durable append. Default 1 MiB.
    pub persist_bytes_max: usize,
    /// Most record bytes in one pull response. Default 1 MiB.
    pub pull_bytes_max: usize,
    /// Recent records kept in memory to serve pulls without a store read. Default 4 MiB.
    pub cache_bytes_max: usize,
    /// Idempotency keys are remembered for this many recent seqs. Default 1,024.
    pub idempotency_window: usize,
    /// How long the leader parks a pull that has nothing new (long poll). Default 3 s. A parked pull is
    /// answered as soon as records (or HW news, see `hw_notify_delay`) arrive, so the park sets only how
    /// often a caught-up follower of a quiet channel pulls: each expiry costs a timer, an empty answer
    /// and a new pull on both sides. `examples/bench` at 100,000 channels (every message activates its
    /// replicas, which then sit idle until evicted): reactor CPU per message 297 µs with a 500 ms park,
    /// 211 µs with 3 s.
    pub pull_park: Duration,
    /// How long the leader may hold back telling a follower that HW moved, hoping to tell it with the
    /// next records instead (one answer and one pull per follower per message instead of two each).
    /// Zero: followers learn every HW change at once. Commits are not delayed by it, only the moment
    /// followers learn them (what a read on a follower sees). Capped at `pull_park`. Default 500 ms: a
    /// follower hears of HW with the next records, or half a second after the last ones, as a Kafka
    /// follower does with its next fetch (`replica.fetch.wait.max.ms`). A hold shorter than the gap
    /// between a channel's messages measured worse than either end (`examples/bench`, 10,000 channels
    /// at 30 k msg/s, a message every ~330 ms per channel: 200 ms gave p50 / p99 of 5.3 / 35 ms, zero
    /// 2.9 / 12 ms, 500 ms 1.9 / 13 ms): the parked pulls are then answered by timers, message by
    /// message, instead of by the records that follow.
    pub hw_notify_delay: Duration,
    /// A follower resends a pull that got no answer after this long. Default 5 s (it must exceed
    /// `pull_park`: a pull is parked that long before its answer; a lost one is found out only after).
    pub pull_timeout: Duration,
    /// After this many empty pulls in a row a follower waits `idle_pull_interval` between pulls. Default 4.
    pub idle_after_empty_pulls: u32,
    /// Pull interval of an idle follower; a `PullHint` cuts it short. Default 2 s.
    pub idle_pull_interval: Duration,
    /// An ISR follower not caught up for this long is proposed for removal from the ISR. Default 10 s.
    pub isr_lag: Duration,
    /// An ISR follower not heard from for this long does not count as alive for admission. Default 8 s.
    /// Must exceed `pull_park + idle_pull_interval`, the longest a healthy idle follower stays silent
    /// (its pull parked, answered empty, then its idle wait); otherwise such a follower counts as dead
    /// part of the time and the first append after a quiet spell gets `NotEnoughReplicas`.
    pub isr_alive: Duration,
    /// An append not committed after this long completes with `Timeout` (its outcome is unknown). Default 10 s.
    pub append_timeout: Duration,
    /// A meta proposal with no answer after this long may be proposed again. Default 5 s.
    pub proposal_timeout: Duration,
    /// Unix time, in milliseconds, of the origin of the `now` the machine is given (`Time::ZERO`): a
    /// record's `timestamp_ms` is this plus `now`. The threaded runtime sets it to the wall clock at its
    /// start (its `now` counts from there), so records carry the leader's wall-clock time, read once and
    /// then advanced by the monotonic clock (a clock step during the run moves no timestamp). Default 0:
    /// timestamps are `now` itself, as a host driving the cores on its own time chooses.
    pub clock_origin_unix_ms: u64,
    /// Switches that break safety on purpose, so tests and the simulator can show their checks catch the
    /// loss. All off by default; never turn one on outside a test.
    pub unsafe_test_switches: UnsafeTestSwitches,
}

/// Safety rules a test may disable to prove that the invariant checks notice. See
/// [`MachineConfig::unsafe_test_switches`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UnsafeTestSwitches {
    /// Count replicas toward HW for records of earlier epochs (no new-leader barrier rule).
    pub skip_barrier_rule: bool,
    /// Followers acknowledge records as soon as they receive them, before they are durable.
    pub ack_before_durable: bool,
}

impl Default for MachineConfig {
    fn default() -> Self {
        Self {
            request_records_max: 256,
            request_bytes_max: 1 << 20,
            pending_records_max: 8192,
            handoff_slots: 16_384,
            persist_records_max: 1024,
            persist_bytes_max: 1 << 20,
            pull_bytes_max: 1 << 20,
            cache_bytes_max: 4 << 20,
            idempotency_window: 1024,
            pull_park: Duration::from_secs(3),
            hw_notify_delay: Duration::from_millis(500),
            pull_timeout: Duration::from_secs(5),
            idle_after_empty_pulls: 4,
            idle_pull_interval: Duration::from_secs(2),
            isr_lag: Duration::from_secs(10),
            isr_alive: Duration::from_secs(8),
            append_timeout: Duration::from_secs(10),
            proposal_timeout: Duration::from_secs(5),
            clock_origin_unix_ms: 0,
            unsafe_test_switches: UnsafeTestSwitches::default(),
        }
    }
}

impl MachineConfig {
    /// How long HW news may wait for the next records: `hw_notify_delay`, never longer than a long poll.
    pub(crate) fn hw_hold(&self) -> Duration {
        self.hw_notify_delay.min(self.pull_park)
    }

    /// The wall-clock time of `now`, in milliseconds since the Unix epoch (see `clock_origin_unix_ms`).
    pub(crate) fn unix_ms(&self, now: tidings_types::Time) -> u64 {
        self.clock_origin_unix_ms.saturating_add(now.as_millis())
    }

    /// The longest a healthy idle follower goes without a pull reaching its leader: its last pull parked
    /// for `pull_park` and answered empty, then its `idle_pull_interval` wait.
    pub fn healthy_silence(&self) -> Duration {
        self.pull_park.saturating_add(self.idle_pull_interval)
    }

    /// Checks the relationships between limits that the machine relies on.
    pub fn validate(&self) -> Result<(), &'static str> {
        if self.request_records_max == 0 || self.persist_records_max == 0 || self.pull_bytes_max == 0 {
            return Err("record and byte limits must be positive");
        }
        if self.request_records_max > self.pending_records_max || self.request_records_max > self.handoff_slots {
            return Err("one request must fit in the pending and handoff bounds");
        }
        if self.request_bytes_max == 0 || self.request_bytes_max > self.persist_bytes_max {
            return Err("request_bytes_max must be positive and fit in persist_bytes_max");
        }
        if self.pull_timeout <= self.pull_park {
            return Err("pull_timeout must exceed pull_park, or every parked pull would be resent");
        }
        if self.isr_alive <= self.healthy_silence() {
            return Err(
                "isr_alive must exceed pull_park + idle_pull_interval, or healthy idle followers count as dead",
            );
        }
        Ok(())
    }
}
