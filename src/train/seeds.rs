//! The seeds a run derives from its one `seed`: one home, so that no two random streams of a run, or of two
//! runs with different seeds, share a seed by accident.
//!
//! RL derives its streams by hashing (run seed, stream, step, round) with SplitMix64's finalizer: an affine
//! formula such as `seed * 31 + step` gives run 0's step 31 the sampling seed of run 1's step 0, so the
//! seeds of a multi-seed study would reuse each other's random draws. The SFT warm start keeps its affine
//! formula (`seed * 7919 + step`: runs collide only 7919 steps apart) so that committed warm starts
//! reproduce bit for bit.

/// The random streams of an RL step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RlStream {
    /// Which training prompts a step (or a refill round) draws.
    Prompts,
    /// The token sampling of a step's (or a refill round's) rollouts.
    Sampling,
}

impl RlStream {
    fn tag(self) -> u64 {
        match self {
            RlStream::Prompts => 0x7072_6f6d_7074_7331,  // "prompts1"
            RlStream::Sampling => 0x7361_6d70_6c69_6e67, // "sampling"
        }
    }
}

/// SplitMix64's finalizer: a bijection of u64 whose outputs look independent for nearby inputs.
fn mix(z: u64) -> u64 {
    let z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    let z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The seed of `stream` at round `round` (0 for a step's first round; refills count up) of RL step `step`
/// in a run seeded `run_seed`. Each input goes through its own round of mixing, so changing any one of
/// them gives an unrelated seed.
pub fn rl_seed(run_seed: u64, stream: RlStream, step: usize, round: usize) -> u64 {
    [stream.tag(), step as u64, round as u64]
        .into_iter()
        .fold(mix(run_seed), |h, x| mix(h ^ x))
}

/// The seed of SFT step `step` (its examples and their answer-only draws) in a run seeded `run_seed`.
pub fn sft_step_seed(run_seed: u64, step: usize) -> u64 {
    run_seed.wrapping_mul(7919).wrapping_add(step as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn rl_seeds_of_nearby_runs_steps_and_rounds_are_all_distinct() {
        let mut seen = HashSet::new();
        for run in 0..16u64 {
            for stream in [RlStream::Prompts, RlStream::Sampling] {
                for step in 0..300 {
                    for round in 0..4 {
                        assert!(
                            seen.insert(rl_seed(run, stream, step, round)),
                            "run {run} {stream:?} step {step} round {round} repeats a seed"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn rl_seed_is_a_function_of_its_inputs() {
        assert_eq!(
            rl_seed(3, RlStream::Sampling, 17, 1),
            rl_seed(3, RlStream::Sampling, 17, 1)
        );
        // The affine formula this replaced gave these two the same seed.
        assert_ne!(
            rl_seed(0, RlStream::Sampling, 31, 0),
            rl_seed(1, RlStream::Sampling, 0, 0)
        );
    }

    #[test]
    fn mix_spreads_neighbouring_inputs_over_the_bits() {
        // Consecutive inputs differ in about half of their output bits (32 of 64), never in a few.
        for x in 0..1000u64 {
            let flipped = (mix(x) ^ mix(x + 1)).count_ones();
            assert!((12..=52).contains(&flipped), "{x}: {flipped} bits");
        }
    }

    #[test]
    fn sft_step_seeds_keep_the_warm_starts_formula() {
        assert_eq!(sft_step_seed(0, 5), 5);
        assert_eq!(sft_step_seed(2, 1), 2 * 7919 + 1);
    }
}
