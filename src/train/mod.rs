//! The training loops: supervised warm start and RL (QaRL). The only module that knows the whole step.

pub mod batch;
pub mod bench;
pub mod checkpoint;
pub mod compare;
pub mod config;
pub mod eval;
pub mod experiment;
pub mod lock;
pub mod metrics;
mod model_dir;
pub mod paired;
pub mod plot;
pub mod progress;
pub mod reference;
mod resume;
pub mod rl;
mod run;
pub mod scored;
pub mod seeds;
pub mod sft;
pub mod update;

pub use config::overrides::{load_config, load_config_on};
pub use config::TrainConfig;
pub use model_dir::{prepare_model, MADE_BY_FILE};
pub use resume::{ResumeChanged, RESUME_MAY_CHANGE};
pub use run::{apply_process_modes, run, run_with, RunOptions, RunSummary, GRAD_NORM_SPIKE_FACTOR};
pub use update::optimizer;
