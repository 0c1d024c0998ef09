//! The one error type of the RL module: a bad config, or inputs that do not fit together.

/// What can go wrong when configuring or calling the RL objectives and metrics.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RlError {
    /// A config value out of its range, or a field that does not apply to the chosen objective.
    #[error("invalid RL config: {0}")]
    Config(String),
    /// An objective name that is not in the registry (src/rl/losses/objectives.rs).
    #[error("invalid RL config: unknown objective `{name}` (registered: {registered})")]
    UnknownObjective { name: String, registered: String },
    /// Inputs whose shapes or lengths do not agree, or values that cannot be used (NaN rewards, say).
    #[error("invalid RL inputs: {0}")]
    Input(String),
}
