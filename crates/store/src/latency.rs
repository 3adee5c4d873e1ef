//! Latency histograms of storage calls, kept with a few atomic adds so the hot path can always record.
//!
//! A sync's latency under load is what bounds commit latency (a commit waits for the leader's sync and
//! then a follower's), and it is not what a disk shows alone: on a shared or virtual disk, syncs that
//! take 0.2 ms in isolation take several milliseconds while other files are written. The journal records
//! each of its syncs here so that an operator (and the benchmarks) can read the figure the cluster
//! actually got.
//!
//! Buckets are logarithmic with four steps per power of two (each bucket at most 25% wider than its
//! lower bound), from 1 µs to about a minute; a percentile is reported as its bucket's upper bound.
//!
//! ```
//! use std::time::Duration;
//! use tidings_store::LatencyHistogram;
//!
//! let mut h = LatencyHistogram::default();
//! for us in [100, 120, 150, 9_000] {
//!     h.record(Duration::from_micros(us));
//! }
//! assert_eq!(h.count(), 4);
//! assert!(h.percentile(0.5) >= Duration::from_micros(120) && h.percentile(0.5) < Duration::from_micros(150));
//! assert!(h.percentile(1.0) >= Duration::from_micros(9_000));
//! ```

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Buckets of a histogram: 4 exact ones for 0–3 µs, then 4 per power of two up to 2^26 µs (~67 s).
const BUCKETS: usize = 100;
/// Longest latency told apart from the next (anything longer lands in the last bucket).
const MICROS_MAX: u64 = (1 << 26) - 1;

/// The bucket holding `micros`.
#[allow(clippy::cast_possible_truncation)] // Below `BUCKETS`.
fn bucket_of(micros: u64) -> usize {
    let micros = micros.min(MICROS_MAX);
    if micros < 4 {
        return micros as usize;
    }
    let log2 = 63 - u64::from(micros.leading_zeros());
    let step = (micros >> (log2 - 2)) & 3;
    ((log2 - 1) * 4 + step) as usize
}

/// The smallest latency, in microseconds, that falls beyond bucket `index`.
fn bucket_end(index: usize) -> u64 {
    if index < 4 {
        return index as u64 + 1;
    }
    let log2 = index as u64 / 4 + 1;
    let step = index as u64 % 4;
    (5 + step) << (log2 - 2)
}

/// A snapshot of latencies: counts per bucket. Two snapshots of one recorder give the latencies
/// between them ([`LatencyHistogram::since`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LatencyHistogram {
    counts: Vec<u64>,
}

impl Default for LatencyHistogram {
    fn default() -> Self {
        Self { counts: vec![0; BUCKETS] }
    }
}

impl LatencyHistogram {
    /// Counts one latency.
    pub fn record(&mut self, latency: Duration) {
        self.counts[bucket_of(micros(latency))] += 1;
    }

    /// Latencies counted.
    pub fn count(&self) -> u64 {
        self.counts.iter().sum()
    }

    /// The latencies counted in `self` and not in `earlier` (an earlier snapshot of the same recorder).
    pub fn since(&self, earlier: &LatencyHistogram) -> LatencyHistogram {
        let counts = self.counts.iter().zip(&earlier.counts).map(|(now, then)| now.saturating_sub(*then)).collect();
        LatencyHistogram { counts }
    }

    /// Adds the latencies counted in `other` (another recorder's, to report several stores as one).
    pub fn merge(&mut self, other: &LatencyHistogram) {
        for (mine, theirs) in self.counts.iter_mut().zip(&other.counts) {
            *mine += theirs;
        }
    }

    /// The latency at or below which a fraction `quantile` (0.0–1.0) of the counted ones fall, rounded up
    /// to its bucket's end (so at most 25% above the true value). Zero when nothing was counted.
    pub fn percentile(&self, quantile: f64) -> Duration {
        let total = self.count();
        if total == 0 {
            return Duration::ZERO;
        }
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_precision_loss)]
        let rank = ((quantile.clamp(0.0, 1.0) * total as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for (index, count) in self.counts.iter().enumerate() {
            seen += count;
            if seen >= rank {
                return Duration::from_micros(bucket_end(index));
            }
        }
        Duration::from_micros(bucket_end(BUCKETS - 1))
    }
}

/// Where a store records latencies from many threads (a relaxed atomic add per latency).
pub(crate) struct LatencyRecorder {
    counts: [AtomicU64; BUCKETS],
}

impl Default for LatencyRecorder {
    fn default() -> Self {
        Self { counts: std::array::from_fn(|_| AtomicU64::new(0)) }
    }
}

impl LatencyRecorder {
    /// Counts one latency.
    pub(crate) fn record(&self, latency: Duration) {
        self.counts[bucket_of(micros(latency))].fetch_add(1, Ordering::Relaxed);
    }

    /// What was counted so far.
    pub(crate) fn snapshot(&self) -> LatencyHistogram {
        LatencyHistogram { counts: self.counts.iter().map(|c| c.load(Ordering::Relaxed)).collect() }
    }
}

fn micros(latency: Duration) -> u64 {
    u64::try_from(latency.as_micros()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_latency_falls_in_the_bucket_whose_range_holds_it() {
        let mut previous_end = 0;
        for index in 0..BUCKETS {
            let end = bucket_end(index);
            assert!(end > previous_end, "bucket {index} ends after the one before");
            // Its first and last microsecond map back to it.
            assert_eq!(bucket_of(previous_end), index, "start of bucket {index}");
            assert_eq!(bucket_of(end - 1), index, "end of bucket {index}");
            // Never more than 25% wide past 4 µs (what `percentile` promises).
            if index >= 4 {
                assert!((end - previous_end) * 4 <= previous_end, "bucket {index} is {previous_end}..{end}");
            }
            previous_end = end;
        }
        assert_eq!(bucket_of(u64::MAX), BUCKETS - 1, "longer than the last bucket: the last bucket");
    }

    #[test]
    fn percentiles_come_from_the_counts_and_a_later_snapshot_minus_an_earlier_one_holds_what_came_between() {
        let recorder = LatencyRecorder::default();
        for _ in 0..98 {
            recorder.record(Duration::from_micros(200));
        }
        recorder.record(Duration::from_millis(5));
        let earlier = recorder.snapshot();
        recorder.record(Duration::from_millis(40));
        let all = recorder.snapshot();
        assert_eq!(all.count(), 100);
        let p50 = all.percentile(0.5);
        assert!(p50 > Duration::from_micros(200) && p50 <= Duration::from_micros(250), "p50 {p50:?}");
        let p99 = all.percentile(0.99);
        assert!(p99 > Duration::from_millis(5) && p99 <= Duration::from_micros(6_250), "p99 {p99:?}");
        let max = all.percentile(1.0);
        assert!(max > Duration::from_millis(40) && max <= Duration::from_millis(50), "max {max:?}");
        let between = all.since(&earlier);
        assert_eq!(between.count(), 1);
        let mut merged = earlier.clone();
        merged.merge(&between);
        assert_eq!(merged, all, "merging what came between into the earlier snapshot gives the later one");
        assert!(between.percentile(0.0) > Duration::from_millis(40));
        assert_eq!(LatencyHistogram::default().percentile(0.99), Duration::ZERO, "nothing counted");
    }
}
