//! The metrics of a finished run render to a PNG. Text needs a TrueType font, which not every machine has, so
//! the test is ignored by default (saying so) and `.ci/run` runs it after installing one.

mod common;

use common::tiny_train_toml;
use qarl::train::{self, TrainConfig};

#[test]
#[ignore = "needs a TrueType font (fonts-dejavu-core, or QARL_FONT=/path/to/font.ttf); .ci/run installs it and runs --include-ignored"]
fn metrics_render_to_a_png() {
    // Run on purpose: a missing font is a failure here, with the message users get.
    train::plot::register_font().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let cfg = TrainConfig::from_toml(&tiny_train_toml(tmp.path(), "aligned", 2), "tiny").unwrap();
    train::run(&cfg, false, true).unwrap();
    let png = train::plot::plot_run(&cfg.run_dir).unwrap();
    let bytes = std::fs::read(&png).unwrap();
    assert!(
        bytes.starts_with(b"\x89PNG") && bytes.len() > 10_000,
        "{}: {} bytes",
        png.display(),
        bytes.len()
    );
}
