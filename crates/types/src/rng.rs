//! A small deterministic random number generator for cores and simulations: every random choice comes
//! from a seed the caller passes, so a run repeats exactly.

/// SplitMix64: tiny, fast, statistically fine for scheduling and fault injection (not for secrets).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DetRng {
    state: u64,
}

impl DetRng {
    /// A generator seeded with `seed`.
    pub const fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    /// A child generator for `stream` (a group, a channel, a node): independent of the parent's sequence.
    pub fn child(&self, stream: u64) -> DetRng {
        let mut mixer = DetRng::new(self.state ^ stream.wrapping_mul(0xA076_1D64_78BD_642F));
        DetRng::new(mixer.next_u64())
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A value in `0..bound` (`bound` > 0), without modulo bias worth caring about at these sizes.
    pub fn below(&mut self, bound: u64) -> u64 {
        assert!(bound > 0, "empty range");
        // Multiply-shift: maps 64 random bits onto the range.
        let wide = u128::from(self.next_u64()) * u128::from(bound);
        u64::try_from(wide >> 64).expect("high half of a 128-bit product fits in 64 bits")
    }

    /// A value in `low..=high`.
    pub fn range(&mut self, low: u64, high: u64) -> u64 {
        assert!(low <= high, "empty range");
        low + self.below(high - low + 1)
    }

    /// `true` with probability `per_million` / 1,000,000.
    pub fn chance(&mut self, per_million: u32) -> bool {
        self.below(1_000_000) < u64::from(per_million)
    }

    /// A random element of `items`, `None` if empty.
    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> Option<&'a T> {
        if items.is_empty() {
            return None;
        }
        let index = usize::try_from(self.below(items.len() as u64)).expect("index below a usize length");
        items.get(index)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_sequence_and_children_differ() {
        let mut a = DetRng::new(7);
        let mut b = DetRng::new(7);
        let xs: Vec<u64> = (0..8).map(|_| a.next_u64()).collect();
        let ys: Vec<u64> = (0..8).map(|_| b.next_u64()).collect();
        assert_eq!(xs, ys);
        let parent = DetRng::new(7);
        assert_ne!(parent.child(1).next_u64(), parent.child(2).next_u64());
    }

    #[test]
    fn ranges_are_respected() {
        let mut rng = DetRng::new(1);
        for _ in 0..10_000 {
            let v = rng.range(3, 9);
            assert!((3..=9).contains(&v));
        }
        let hits = (0..100_000).filter(|_| rng.chance(250_000)).count();
        assert!((20_000..30_000).contains(&hits), "{hits}");
    }
}
