//! Feeding inputs that name many replicas in warm runs: at 10,000 active channels a replica's state is
//! cold when its input comes, and fed one by one each input waits for its own cache misses. Touching a
//! run's replicas first, in one short loop, lets the CPU keep their misses in flight together.

/// How many replicas a caller with many inputs touches in one loop before it feeds them (see
/// [`ChannelMachine::warm`](crate::machine::ChannelMachine::warm)): enough misses to keep the CPU busy,
/// few enough that what they brought in is still cached when their turn comes.
pub const WARM_RUN: usize = 32;

/// Feeds `inputs` to `target` in order, [`WARM_RUN`] at a time: `warm` first touches what a run's inputs
/// will need (in one loop, so that their cache misses overlap), then `feed` takes them one by one.
pub fn feed_in_warm_runs<S: ?Sized, T>(
    target: &mut S,
    inputs: Vec<T>,
    warm: impl Fn(&S, &[T]) -> u64,
    mut feed: impl FnMut(&mut S, T),
) {
    let mut inputs = inputs;
    // Taken from the end, so a run is the last `WARM_RUN`.
    inputs.reverse();
    while !inputs.is_empty() {
        let run = inputs.len().saturating_sub(WARM_RUN);
        std::hint::black_box(warm(target, &inputs[run..]));
        for input in inputs.drain(run..).rev() {
            feed(target, input);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inputs_fed_in_warm_runs_keep_their_order_and_each_run_is_warmed_before_it_is_fed() {
        let count = WARM_RUN * 2 + 5;
        let runs = std::cell::RefCell::new(Vec::new());
        let mut fed: Vec<usize> = Vec::new();
        feed_in_warm_runs(
            &mut fed,
            (0..count).collect(),
            |fed, run| {
                let mut run = run.to_vec();
                run.sort_unstable();
                assert_eq!(fed.len(), run[0], "a run is warmed right before its first input is fed");
                runs.borrow_mut().push(run);
                0
            },
            |fed, input| fed.push(input),
        );
        assert_eq!(fed, (0..count).collect::<Vec<_>>(), "every input fed once, in order");
        let expected: Vec<Vec<usize>> =
            vec![(0..WARM_RUN).collect(), (WARM_RUN..2 * WARM_RUN).collect(), (2 * WARM_RUN..count).collect()];
        assert_eq!(runs.into_inner(), expected);
    }
}
