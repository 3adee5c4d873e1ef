//! Each node's own clock (`SimParams::clock_skew`): the time the simulation hands a node's core.

use std::time::Duration;
use tidings::types::Time;

/// The fastest and slowest a skewed node's clock runs, in millionths of the simulation's rate.
const RATE_PPM_MIN: u64 = 950_000;
const RATE_PPM_MAX: u64 = 1_050_000;
const RATE_PPM_EXACT: u64 = 1_000_000;

/// How a node reads the simulation's time: from its last boot, at its own rate.
#[derive(Clone, Copy, Debug)]
pub(super) struct NodeClock {
    /// Simulation time at the node's last boot.
    booted_at: Time,
    /// What the node's clock read then.
    read_at_boot: Time,
    /// Millionths of a simulated millisecond per millisecond of the node's clock.
    rate_ppm: u64,
}

impl NodeClock {
    /// The simulation's own time, as every node read it before clocks were skewed.
    pub(super) fn exact() -> Self {
        Self { booted_at: Time::ZERO, read_at_boot: Time::ZERO, rate_ppm: RATE_PPM_EXACT }
    }

    /// A skewed node's rate, drawn from `draw` (a number below `u64::MAX`).
    pub(super) fn skewed_rate(draw: u64) -> u64 {
        RATE_PPM_MIN + draw % (RATE_PPM_MAX - RATE_PPM_MIN + 1)
    }

    /// The clock of a process started at `now` on a skewed node: it counts from zero, as the threaded
    /// runtime's does (the milliseconds since its start), at `rate_ppm`.
    pub(super) fn started(now: Time, rate_ppm: u64) -> Self {
        Self { booted_at: now, read_at_boot: Time::ZERO, rate_ppm }
    }

    /// What the node's clock reads at simulation time `now` (never before its boot; it never goes back).
    pub(super) fn at(&self, now: Time) -> Time {
        let elapsed = u128::from(now.as_millis().saturating_sub(self.booted_at.as_millis()));
        let scaled = elapsed * u128::from(self.rate_ppm) / u128::from(RATE_PPM_EXACT);
        self.read_at_boot + Duration::from_millis(u64::try_from(scaled).unwrap_or(u64::MAX))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_exact_clock_reads_the_simulations_time_and_a_skewed_one_its_own() {
        let exact = NodeClock::exact();
        assert_eq!(exact.at(Time::from_millis(12_345)), Time::from_millis(12_345));
        let fast = NodeClock::started(Time::from_millis(10_000), RATE_PPM_MAX);
        assert_eq!(fast.at(Time::from_millis(10_000)), Time::ZERO, "a started process counts from zero");
        assert_eq!(fast.at(Time::from_millis(12_000)), Time::from_millis(2_100));
        let slow = NodeClock::started(Time::ZERO, RATE_PPM_MIN);
        assert_eq!(slow.at(Time::from_millis(2_000)), Time::from_millis(1_900));
        let readings: Vec<Time> = (0..100).map(|ms| slow.at(Time::from_millis(ms))).collect();
        assert!(readings.windows(2).all(|w| w[0] <= w[1]), "never goes back");
        assert!((0..1_000).all(|d| (RATE_PPM_MIN..=RATE_PPM_MAX).contains(&NodeClock::skewed_rate(d * 7_919))));
    }
}
