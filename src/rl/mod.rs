//! RL objectives, advantages, mismatch corrections and metrics (QARL.md sections 4 and 5): pure functions over
//! tensors, backend-agnostic and differentiable, selected by name from config.
