//! Small masked reductions shared by the objectives and corrections. Masks are float tensors of 0/1 so that
//! they multiply straight into sums; every per-sequence reduction keeps its dimension (`[B, 1]`) so that it
//! broadcasts back over the tokens.

use burn::tensor::{Bool, Tensor};

/// `exp` of a log-ratio clamped to `[-LOG_RATIO_BOUND, LOG_RATIO_BOUND]`, verl's safety bound: a ratio of
/// `e^20` is already meaningless, and the clamp keeps one garbage token from turning the loss into inf/NaN.
pub const LOG_RATIO_BOUND: f32 = 20.0;

/// `exp(clamp(log_ratio, -20, 20))`.
pub fn bounded_exp<const D: usize>(log_ratio: Tensor<D>) -> Tensor<D> {
    log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).exp()
}

/// Number of response tokens of each sequence, `[B, 1]`.
pub fn token_counts(mask: &Tensor<2>) -> Tensor<2> {
    mask.clone().sum_dim(1)
}

/// Zeroes the non-response positions. Unlike `x * mask` this does not turn an inf or NaN left in the padding
/// into NaN, and its gradient there is exactly zero.
pub fn zero_outside<const D: usize>(x: Tensor<D>, mask: &Tensor<D>) -> Tensor<D> {
    x.mask_fill(mask.clone().lower_elem(0.5), 0.0)
}

/// Per-sequence sum over response tokens, `[B, 1]`.
pub fn masked_row_sum(x: Tensor<2>, mask: &Tensor<2>) -> Tensor<2> {
    zero_outside(x, mask).sum_dim(1)
}

/// Per-sequence mean over response tokens, `[B, 1]`; a sequence without response tokens gets 0.
pub fn masked_row_mean(x: Tensor<2>, mask: &Tensor<2>) -> Tensor<2> {
    masked_row_sum(x, mask) / token_counts(mask).clamp_min(1.0)
}

/// Mean over all response tokens, `[1]`; 0 when there are none.
pub fn masked_mean(x: Tensor<2>, mask: &Tensor<2>) -> Tensor<1> {
    zero_outside(x, mask).sum() / mask.clone().sum().clamp_min(1.0)
}

/// 1.0 for sequences with at least one response token, `[B, 1]`.
pub fn valid_rows(mask: &Tensor<2>) -> Tensor<2> {
    token_counts(mask).greater_elem(0.0).float()
}

/// Mean of a per-sequence value `[B, 1]` over the sequences that have response tokens, `[1]`.
pub fn mean_over_valid_rows(per_row: Tensor<2>, mask: &Tensor<2>) -> Tensor<1> {
    let valid = valid_rows(mask);
    (per_row * valid.clone()).sum() / valid.sum().clamp_min(1.0)
}

/// `cond ? a : b`, elementwise, gradients routed to the chosen side. All three must have the same shape.
pub fn select<const D: usize>(cond: Tensor<D, Bool>, a: Tensor<D>, b: Tensor<D>) -> Tensor<D> {
    b.mask_where(cond, a)
}

/// `[B, 1]` -> `[B, T]` by repetition (so that sequence-level terms can be aggregated like token terms).
pub fn over_tokens(per_row: Tensor<2>, tokens: usize) -> Tensor<2> {
    let [b, _] = per_row.dims();
    per_row.expand([b, tokens])
}
