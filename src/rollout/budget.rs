//! Sizes a rollout will allocate, checked before anything is allocated: the positions a row reaches against
//! the model's `max_position_embeddings`, and the KV cache of every row against the memory the machine has,
//! so that a flag like `--samples 100000000` is an error naming the limit instead of an allocation abort.

use crate::model::ModelConfig;

/// The inputs that size a rollout, as its errors name them (flags or config keys, several joined by " / "):
/// those that set its row count, and those that set how far a row reaches (the new tokens, and the prompt's
/// length where it is an input). A positions error names the reach's inputs alone, the memory error all.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RolloutInputs<'a> {
    pub rows: &'a str,
    pub reach: &'a str,
}

impl RolloutInputs<'_> {
    fn all(&self) -> String {
        format!("{} / {}", self.rows, self.reach)
    }
}

/// Why a rollout of that size cannot run.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum BudgetError {
    #[error(
        "{what}: {} plus {new} new tokens reaches position {reach}, past the model's \
         max_position_embeddings ({limit})",
        prompt_phrase(*prompt)
    )]
    Positions {
        what: String,
        /// The longest prompt's tokens; `None` before the prompts are made (counted as one token).
        prompt: Option<usize>,
        new: usize,
        reach: usize,
        limit: usize,
    },
    #[error(
        "{what}: {rows} rows of up to {tokens} tokens need a {need_gb:.1} GB KV cache (its key axis in \
         whole blocks of 64 slots), more than the \
         {have_gb:.1} GB of memory available; use fewer rows or tokens"
    )]
    Memory {
        what: String,
        rows: usize,
        tokens: usize,
        need_gb: f64,
        have_gb: f64,
    },
    #[error(
        "{what}: a training sequence of {tokens} tokens is longer than the model's max_position_embeddings \
         ({limit})"
    )]
    TrainPositions {
        what: String,
        tokens: usize,
        limit: usize,
    },
    #[error(
        "{what}: {rows} sequences of up to {tokens} tokens need over {need_gb:.1} GB for the activations \
         the backward keeps, more than the {have_gb:.1} GB of memory available; use a smaller batch"
    )]
    TrainMemory {
        what: String,
        rows: usize,
        tokens: usize,
        need_gb: f64,
        have_gb: f64,
    },
    #[error(
        "{what}: {rows} rows of {tokens} tokens need over {need_gb:.1} GB for their logits over the \
         {vocab}-token vocabulary and their keys and values, more than the {have_gb:.1} GB of memory \
         available; score fewer rows at a time"
    )]
    ScoreMemory {
        what: String,
        rows: usize,
        tokens: usize,
        vocab: usize,
        need_gb: f64,
        have_gb: f64,
    },
}

/// Checks a full forward of `rows` rows of `tokens` tokens whose logits are kept at every position (`qarl
/// score`): the f32 logits (twice when they are also copied out to be written) and the keys and values,
/// against the memory available; `what` names the input. A batch too large aborted on the allocation.
pub fn check_scoring_size(
    config: &ModelConfig,
    what: &str,
    rows: usize,
    tokens: usize,
    logits_written: bool,
) -> Result<(), BudgetError> {
    let logits = rows as u128 * tokens as u128 * config.vocab_size as u128 * 4;
    let need = logits * if logits_written { 2 } else { 1 } + kv_cache_bytes(config, rows, tokens);
    match short_of(need) {
        Some(have) => Err(BudgetError::ScoreMemory {
            what: what.to_string(),
            rows,
            tokens,
            vocab: config.vocab_size,
            need_gb: need as f64 / 1e9,
            have_gb: have as f64 / 1e9,
        }),
        None => Ok(()),
    }
}

/// Checks a training batch of `rows` sequences of up to `tokens` tokens (the SFT batch; an RL learner pass
/// is [`check_learner_size`]'s):
/// the positions against `max_position_embeddings`, and the activations the backward keeps
/// ([`training_activation_bytes`], a lower bound) against the memory available. `what` names the config
/// key. Counting the keys and values alone, a batch 20x too large passed and was killed by the kernel.
pub fn check_training_size(
    config: &ModelConfig,
    what: &str,
    rows: usize,
    tokens: usize,
) -> Result<(), BudgetError> {
    if tokens > config.max_position_embeddings {
        return Err(BudgetError::TrainPositions {
            what: what.to_string(),
            tokens,
            limit: config.max_position_embeddings,
        });
    }
    train_memory_fits(
        what,
        rows,
        tokens,
        training_activation_bytes(config, rows, tokens),
    )
}

/// [`BudgetError::TrainMemory`] when a training pass of `rows` sequences of up to `tokens` tokens needs
/// `need` bytes, more than the memory available.
fn train_memory_fits(
    what: &str,
    rows: usize,
    tokens: usize,
    need: u128,
) -> Result<(), BudgetError> {
    match short_of(need) {
        Some(have) => Err(BudgetError::TrainMemory {
            what: what.to_string(),
            rows,
            tokens,
            need_gb: need as f64 / 1e9,
            have_gb: have as f64 / 1e9,
        }),
        None => Ok(()),
    }
}

/// A lower bound of the f32 bytes a training forward of `rows` sequences of `tokens` tokens keeps for its
/// backward: tensors that every implementation's backward reads, per token and layer: the inputs of the
/// projections (the normed attention and MLP inputs, the heads' output), the keys and values, the MLP's
/// gate and up outputs and their gated product (per routed expert for a mixture of experts), and each
/// head's attention probabilities over the sequence's keys. What else is kept depends on the path (the
/// norms' inputs, the queries, the logits; fused SwiGLU and chunked LM-head backwards keep less, the
/// grouped MoE more) and is left out, so the real peak is higher. Measured (peak resident memory over
/// SFT steps of different batch sizes, AMD EPYC Zen 4; the marginal cost of a sequence): the 4-layer
/// arithmetic MoE (`configs/models/qwen3-moe-arith.json`, batches 256/1024/2048 of up to 51 tokens)
/// 1.64 MB against 0.90 MB estimated; SmolLM2-135M (batches 4/32 of up to 74 tokens) 79 MB against
/// 66 MB.
pub fn training_activation_bytes(config: &ModelConfig, rows: usize, tokens: usize) -> u128 {
    let all = rows as u128 * tokens as u128;
    all * activation_bytes_per_token(config)
        + rows as u128 * attention_bytes(config, tokens, tokens)
}

/// [`training_activation_bytes`]' part that grows with the tokens computed: per token and layer the
/// projections' inputs (two normed inputs and the heads' output), the keys and values, and the MLP's gate
/// and up outputs and their gated product.
fn activation_bytes_per_token(config: &ModelConfig) -> u128 {
    let c = config;
    let mlp = match &c.moe {
        Some(m) => (m.num_experts_per_tok * m.moe_intermediate_size).min(c.intermediate_size),
        None => c.intermediate_size,
    } as u128;
    let heads = (c.num_attention_heads * c.head_dim) as u128;
    let kv = 2 * (c.num_key_value_heads * c.head_dim) as u128;
    let per_token_layer = 2 * c.hidden_size as u128 + heads + kv + 3 * mlp;
    c.num_hidden_layers as u128 * per_token_layer * 4
}

/// The attention probabilities of `queries` tokens over `keys` keys, every head and layer, in f32.
fn attention_bytes(config: &ModelConfig, queries: usize, keys: usize) -> u128 {
    let c = config;
    (c.num_hidden_layers * c.num_attention_heads) as u128 * queries as u128 * keys as u128 * 4
}

/// Checks one learner forward of an RL update, whose sequences are `(prompt, response)` token counts (a
/// micro-batch, or the whole minibatch with `train.micro_batch_size = 0`): a lower bound of what its backward
/// keeps ([`training_activation_bytes`]' tensors, for every response token and one prompt, since the
/// learner may compute a group's shared prompt once; each response token's probabilities over its
/// sequence) against the memory available.
pub fn check_learner_size(
    config: &ModelConfig,
    what: &str,
    sequences: &[(usize, usize)],
) -> Result<(), BudgetError> {
    let responses: usize = sequences.iter().map(|&(_, r)| r).sum();
    let prompt = sequences.iter().map(|&(p, _)| p).max().unwrap_or(0);
    let probs: u128 = sequences
        .iter()
        .map(|&(p, r)| attention_bytes(config, r, p + r))
        .sum();
    let need = (responses + prompt) as u128 * activation_bytes_per_token(config) + probs;
    let longest = sequences.iter().map(|&(p, r)| p + r).max().unwrap_or(0);
    train_memory_fits(what, sequences.len(), longest, need)
}

/// Bytes of the f32 KV cache of `rows` rows of `tokens` positions.
pub fn kv_cache_bytes(config: &ModelConfig, rows: usize, tokens: usize) -> u128 {
    let per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4;
    rows as u128 * tokens as u128 * per_token as u128
}

/// How a positions error names the prompt: its length, or the one-token bound before prompts are made
/// (a config's first check said "a prompt of 1 tokens" of 15-token prompts).
fn prompt_phrase(prompt: Option<usize>) -> String {
    match prompt {
        Some(1) => "a prompt of 1 token".to_string(),
        Some(n) => format!("a prompt of {n} tokens"),
        None => "a prompt of at least one token".to_string(),
    }
}

/// Checks a rollout of `rows` rows whose longest prompt has `prompt` tokens and which generates up to
/// `new` tokens per row; `what` names the inputs in the error.
pub fn check_rollout_size(
    config: &ModelConfig,
    what: RolloutInputs,
    rows: usize,
    prompt: usize,
    new: usize,
) -> Result<(), BudgetError> {
    check_rows(config, what, rows, Some(prompt), new)
}

/// [`check_rollout_size`] before the prompts are made: with the bound of a one-token prompt, which
/// refuses a count or a length far too large before any prompt is drawn (each rollout checks its real
/// prompts again).
pub fn check_rollout_size_before_prompts(
    config: &ModelConfig,
    what: RolloutInputs,
    rows: usize,
    new: usize,
) -> Result<(), BudgetError> {
    check_rows(config, what, rows, None, new)
}

/// [`check_rollout_size`] with the prompt's length known (`Some`) or bounded below by one token.
fn check_rows(
    config: &ModelConfig,
    what: RolloutInputs,
    rows: usize,
    prompt: Option<usize>,
    new: usize,
) -> Result<(), BudgetError> {
    let reach = prompt.unwrap_or(1).saturating_add(new);
    if reach > config.max_position_embeddings {
        return Err(BudgetError::Positions {
            what: what.reach.to_string(),
            prompt,
            new,
            reach,
            limit: config.max_position_embeddings,
        });
    }
    // A decode step's cache is as wide as the attention's key axis, a whole number of key blocks: a
    // rollout of short rows holds up to 64 slots each (counted by their tokens, 400k rows of 26 tokens
    // passed the check at 11 GB and were killed at 24 GB).
    let slots = reach.div_ceil(crate::model::decoder::KEY_BLOCK) * crate::model::decoder::KEY_BLOCK;
    let need = kv_cache_bytes(config, rows, slots);
    match short_of(need) {
        Some(have) => Err(BudgetError::Memory {
            what: what.all(),
            rows,
            tokens: reach,
            need_gb: need as f64 / 1e9,
            have_gb: have as f64 / 1e9,
        }),
        None => Ok(()),
    }
}

/// [`check_rollout_size`] for `rows` rows of `prompts` and `new` tokens each; where the longest prompt is
/// too long for the model's positions, the error starts with `describe(its index)` (the record: file,
/// line, question), which the flags in `what` alone do not name.
pub fn check_prompts_size(
    config: &ModelConfig,
    what: RolloutInputs,
    rows: usize,
    prompts: &[Vec<u32>],
    new: usize,
    describe: impl FnOnce(usize) -> String,
) -> anyhow::Result<()> {
    let (longest, longest_len) = prompts
        .iter()
        .map(Vec::len)
        .enumerate()
        .max_by_key(|&(i, n)| (n, std::cmp::Reverse(i)))
        .unwrap_or((0, 0));
    check_rollout_size(config, what, rows, longest_len, new).map_err(|e| match e {
        BudgetError::Positions { .. } if !prompts.is_empty() => {
            anyhow::anyhow!("{}: {e}", describe(longest))
        }
        _ => e.into(),
    })
}

/// A question as errors show it: its first 60 characters, quoted.
pub fn shown_question(question: &str) -> String {
    let shown: String = question.chars().take(60).collect();
    format!("the question {shown:?}...")
}

/// The bytes of memory available, where `need` exceeds them (`None` where it fits, or where the kernel
/// does not say).
pub fn short_of(need: u128) -> Option<u64> {
    available_memory_bytes().filter(|&have| need > have as u128)
}

/// `MemAvailable` of `/proc/meminfo` in bytes (`None` where the kernel does not report it).
fn available_memory_bytes() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    const NEW_TOKENS: RolloutInputs = RolloutInputs {
        rows: "--samples",
        reach: "--new-tokens",
    };
    const KEYS: RolloutInputs = RolloutInputs {
        rows: "prompts_per_step",
        reach: "max_new_tokens",
    };

    fn config() -> ModelConfig {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf/llama");
        ModelConfig::from_file(&path).unwrap()
    }

    #[test]
    fn positions_past_the_limit_and_caches_past_the_memory_are_refused() {
        let c = config();
        let limit = c.max_position_embeddings;
        assert!(check_rollout_size(&c, NEW_TOKENS, 4, limit - 8, 8).is_ok());
        let e = check_rollout_size(&c, NEW_TOKENS, 4, limit - 8, 9).unwrap_err();
        assert!(
            e.to_string().starts_with("--new-tokens: ")
                && e.to_string()
                    .contains(&format!("max_position_embeddings ({limit})")),
            "{e}"
        );
        let e = check_rollout_size(&c, NEW_TOKENS, usize::MAX / 2, 4, 4).unwrap_err();
        assert!(matches!(
            check_training_size(&c, "sft.batch_size", usize::MAX / 2, 4),
            Err(BudgetError::TrainMemory { .. })
        ));
        assert!(matches!(
            check_training_size(&c, "sft.batch_size", 1, limit + 1),
            Err(BudgetError::TrainPositions { .. })
        ));
        assert!(check_training_size(&c, "sft.batch_size", 8, limit).is_ok());
        assert!(matches!(e, BudgetError::Memory { .. }), "{e}");
        assert!(
            e.to_string().starts_with("--samples / --new-tokens: "),
            "{e}"
        );
    }

    /// The cache is counted as the decode allocates it, in whole key blocks: rows of two tokens that fit
    /// the memory by their tokens but not by their 64-slot blocks are refused.
    #[test]
    fn the_cache_is_counted_in_whole_key_blocks() {
        let c = config();
        let Some(have) = available_memory_bytes() else {
            return;
        };
        let per_slot = kv_cache_bytes(&c, 1, 1);
        let rows = (have as u128 / (per_slot * 32)) as usize;
        assert!(kv_cache_bytes(&c, rows, 2) < have as u128);
        let e = check_rollout_size(&c, NEW_TOKENS, rows, 1, 1).unwrap_err();
        assert!(matches!(e, BudgetError::Memory { tokens: 2, .. }), "{e}");
        assert!(
            check_rollout_size(&c, NEW_TOKENS, rows / 16, 1, 1).is_ok(),
            "an eighth of the memory fits"
        );
    }

    /// The check before prompts are made says its prompt length is a bound, not the prompts' length.
    #[test]
    fn a_positions_error_names_the_prompt_length_it_knows() {
        let c = config();
        let limit = c.max_position_embeddings;
        assert!(check_rollout_size_before_prompts(&c, KEYS, 1, limit - 1).is_ok());
        let e = check_rollout_size_before_prompts(&c, KEYS, 1, limit).unwrap_err();
        let before = e.to_string();
        assert!(
            before.starts_with("max_new_tokens: a prompt of at least one token plus "),
            "{before}"
        );
        let e = check_rollout_size(&c, KEYS, 1, 15, limit).unwrap_err();
        assert!(e.to_string().contains("a prompt of 15 tokens plus "), "{e}");
        let e = check_rollout_size(&c, KEYS, 1, 1, limit).unwrap_err();
        assert!(e.to_string().contains("a prompt of 1 token plus "), "{e}");
    }

    /// The training check counts the activations the backward keeps, not only the keys and values: a
    /// batch whose cache fits the memory many times over but whose activations do not is refused (the
    /// KV-only count let such an SFT batch through to the kernel's out-of-memory killer).
    #[test]
    fn a_training_batch_is_measured_by_its_activations() {
        let c = config();
        let tokens = 64;
        let kv_row = kv_cache_bytes(&c, 1, tokens);
        let act_row = training_activation_bytes(&c, 1, tokens);
        assert!(act_row > 4 * kv_row, "{act_row} vs {kv_row}");
        // Linear in the rows, and growing faster than the tokens (the attention probabilities).
        assert_eq!(training_activation_bytes(&c, 3, tokens), 3 * act_row);
        assert!(training_activation_bytes(&c, 1, 2 * tokens) > 2 * act_row);
        let Some(have) = available_memory_bytes() else {
            return;
        };
        // Rows whose cache takes a quarter of the memory but whose activations take more than all of it.
        let rows = (have as u128 / 4 / kv_row) as usize;
        assert!(rows as u128 * act_row > have as u128);
        let e = check_training_size(&c, "sft.batch_size", rows, tokens).unwrap_err();
        assert!(matches!(e, BudgetError::TrainMemory { .. }), "{e}");
        assert!(
            e.to_string().contains("activations the backward keeps"),
            "{e}"
        );
    }

    /// The learner's bound: one sequence without a prompt is the training bound; a group's prompt counts
    /// once (the learner may compute it once), and its responses' attention over prompt and response;
    /// a pass far too large is refused naming the setting to change.
    #[test]
    fn a_learner_pass_is_measured_by_its_responses_and_one_prompt() {
        let c = config();
        let per_token = activation_bytes_per_token(&c);
        let need = |seqs: &[(usize, usize)]| {
            let r: usize = seqs.iter().map(|s| s.1).sum();
            let p = seqs.iter().map(|s| s.0).max().unwrap_or(0);
            (r + p) as u128 * per_token
                + seqs
                    .iter()
                    .map(|&(p, r)| attention_bytes(&c, r, p + r))
                    .sum::<u128>()
        };
        assert_eq!(need(&[(0, 40)]), training_activation_bytes(&c, 1, 40));
        assert!(need(&[(30, 10), (30, 10)]) < training_activation_bytes(&c, 2, 40));
        assert!(check_learner_size(&c, "train.micro_batch_size", &[(30, 10), (30, 10)]).is_ok());
        let Some(have) = available_memory_bytes() else {
            return;
        };
        let rows = (have as u128 / need(&[(0, 64)]) + 1) as usize;
        let e = check_learner_size(&c, "train.micro_batch_size", &vec![(0, 64); rows]).unwrap_err();
        assert!(matches!(e, BudgetError::TrainMemory { .. }), "{e}");
        assert!(e.to_string().starts_with("train.micro_batch_size: "), "{e}");
    }

    #[test]
    fn scoring_more_logits_than_the_memory_is_refused() {
        let c = config();
        assert!(check_scoring_size(&c, "in.json", 2, 16, true).is_ok());
        let e = check_scoring_size(&c, "in.json", usize::MAX / 1024, 16, false).unwrap_err();
        assert!(matches!(e, BudgetError::ScoreMemory { .. }), "{e}");
        let text = e.to_string();
        assert!(
            text.starts_with("in.json: ") && text.contains("score fewer rows"),
            "{text}"
        );
        assert!(
            text.contains(&format!("{}-token vocabulary", c.vocab_size)),
            "{text}"
        );
    }
}
