//! Generation for RL: batched sampling with recorded log-probs (and MoE routing), on whatever weights the
//! model holds. No RL knowledge lives here.

pub mod budget;
pub mod engine;
pub mod sampler;

pub use budget::{
    check_learner_size, check_prompts_size, check_rollout_size, check_rollout_size_before_prompts,
    check_training_size, shown_question, BudgetError, RolloutInputs,
};
pub use engine::{generate, FinishReason, Rollout};
pub use sampler::{RolloutError, SamplingParams};

use crate::model::Decoder;

/// Greedy decoding of up to `max_new_tokens` tokens per prompt, stopping a row at any of `stop_ids`.
/// Returns prompt + generated ids per row.
pub fn generate_greedy(
    model: &Decoder,
    prompts: &[Vec<u32>],
    max_new_tokens: usize,
    stop_ids: &[u32],
) -> Vec<Vec<u32>> {
    let params = SamplingParams {
        temperature: 0.0,
        max_new_tokens,
        stop_token_ids: stop_ids.to_vec(),
        ..SamplingParams::default()
    };
    generate(model, prompts, 1, &params, None).ids
}
