//! The timer of `qarl bench kernels`: a row's calls timed in batches, each closed by a device sync, so
//! that a row has a spread as well as a mean.

use std::time::Instant;

/// A row's time: the mean seconds per call over every timed call, and the per-call seconds of the
/// fastest and the slowest of the batches they were timed in, so that two rows a few percent apart can
/// be told apart from the noise of one call (the summaries mark rows whose batches overlap).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Timing {
    pub(super) mean: f64,
    pub(super) fastest: f64,
    pub(super) slowest: f64,
    /// How many batches the calls were split into (1: no spread measured).
    pub(super) batches: usize,
}

/// The shortest batch worth a synchronisation of its own: a device sync costs some microseconds, so a
/// batch of at least this long biases the mean by well under 1% against timing every call in one batch.
const MIN_BATCH_S: f64 = 2e-3;
/// The most batches a row's calls are split into.
const MOST_BATCHES: usize = 5;

/// How many batches `iters` calls of `one_call_s` seconds each are split into: as many as keep each at
/// least [`MIN_BATCH_S`] long, at most [`MOST_BATCHES`] and at most one per call, at least one.
fn batch_count(iters: usize, one_call_s: f64) -> usize {
    let fit = (iters as f64 * one_call_s / MIN_BATCH_S).floor();
    let most = MOST_BATCHES.min(iters).max(1);
    if fit.is_finite() && fit >= 1.0 {
        (fit as usize).min(most)
    } else {
        1
    }
}

/// Times `iters` runs of `f` (at least one) after two warm-ups (the first compiles; the second, timed,
/// sizes the batches: [`batch_count`]), in batches each closed by `sync`.
pub(super) fn time(iters: usize, mut f: impl FnMut(), sync: &dyn Fn()) -> Timing {
    f();
    sync();
    let start = Instant::now();
    f();
    sync();
    let iters = iters.max(1);
    let batches = batch_count(iters, start.elapsed().as_secs_f64());
    let (mut total, mut fastest, mut slowest) = (0.0, f64::INFINITY, 0.0f64);
    for b in 0..batches {
        let calls = iters / batches + usize::from(b < iters % batches);
        let start = Instant::now();
        for _ in 0..calls {
            f();
        }
        sync();
        let seconds = start.elapsed().as_secs_f64();
        total += seconds;
        fastest = fastest.min(seconds / calls as f64);
        slowest = slowest.max(seconds / calls as f64);
    }
    Timing {
        mean: total / iters as f64,
        fastest,
        slowest,
        batches,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    /// Batches last at least `MIN_BATCH_S` each: calls too short for that are timed in one batch (no
    /// spread, no extra sync), longer ones in up to five, never more batches than calls.
    #[test]
    fn batches_are_as_many_as_keep_each_long_enough() {
        assert_eq!(batch_count(20, 50e-6), 1); // 1 ms of calls in all
        assert_eq!(batch_count(20, 250e-6), 2); // 5 ms
        assert_eq!(batch_count(20, 1e-3), 5);
        assert_eq!(batch_count(3, 10e-3), 3);
        assert_eq!(batch_count(1, 1.0), 1);
        assert_eq!(batch_count(0, 1.0), 1);
        assert_eq!(batch_count(20, f64::NAN), 1);
    }

    /// Every asked-for call runs once after the two warm-ups, split over the batches, and the mean lies
    /// between the fastest and the slowest batch. Calls of at least 3 ms give 4 calls 4 batches.
    #[test]
    fn time_runs_each_call_once_in_batches() {
        let (calls, syncs) = (Cell::new(0usize), Cell::new(0usize));
        let t = time(
            4,
            || {
                calls.set(calls.get() + 1);
                std::thread::sleep(std::time::Duration::from_millis(3));
            },
            &|| syncs.set(syncs.get() + 1),
        );
        assert_eq!(calls.get(), 2 + 4);
        assert_eq!(t.batches, 4);
        assert_eq!(syncs.get(), 2 + t.batches);
        assert!(t.fastest >= 3e-3 && t.fastest <= t.mean && t.mean <= t.slowest);
        // Odd counts spread over the batches; zero calls still time one.
        let calls = Cell::new(0usize);
        let t = time(0, || calls.set(calls.get() + 1), &|| ());
        assert_eq!((calls.get(), t.batches), (3, 1));
        let calls = Cell::new(0usize);
        let t = time(
            7,
            || {
                calls.set(calls.get() + 1);
                std::thread::sleep(std::time::Duration::from_millis(3));
            },
            &|| (),
        );
        assert_eq!((calls.get(), t.batches), (9, 5));
    }
}
