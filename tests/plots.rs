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
    // A report draws a finished run's plots once: not again while they are there (a committed study's
    // plots changed bytes with every report, between builds); a run that takes more steps removes them.
    std::fs::write(&png, b"drawn before").unwrap();
    train::plot::plot_run_if_missing(&cfg.run_dir).unwrap();
    assert_eq!(std::fs::read(&png).unwrap(), b"drawn before");
    let mut longer = cfg.clone();
    longer.train.steps = 3;
    train::run(&longer, true, true).unwrap();
    assert!(
        !png.exists(),
        "plots of fewer steps left beside a longer run"
    );
    train::plot::plot_run_if_missing(&cfg.run_dir).unwrap();
    assert!(std::fs::read(&png).unwrap().starts_with(b"\x89PNG"));
}

/// A damaged log whose values span more than an f64 (here +-1e308) left the chart library placing ticks on
/// an infinite axis forever: such a panel is now left empty (with a warning) and the plot written. Steps
/// that span as much are no step numbers, and the log is refused naming the line.
#[test]
#[ignore = "needs a TrueType font (fonts-dejavu-core, or QARL_FONT=/path/to/font.ttf); .ci/run installs it and runs --include-ignored"]
fn values_beyond_an_f64_span_leave_their_panel_empty() {
    train::plot::register_font().unwrap();
    let steps = tempfile::tempdir().unwrap();
    std::fs::write(
        steps.path().join("metrics.jsonl"),
        "{\"phase\":\"rl\",\"step\":-1e308,\"critic/rewards/mean\":1.0}\n",
    )
    .unwrap();
    let err = format!("{:#}", train::plot::plot_run(steps.path()).unwrap_err());
    assert!(
        err.contains("line 1: `step` is -1e+308, not a step number"),
        "{err}"
    );
    // Values spanning an f64: the panel is left empty and the plot written.
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_path_buf();
    std::fs::write(
        dir.join("metrics.jsonl"),
        "{\"phase\":\"rl\",\"step\":0,\"critic/rewards/mean\":1e308}\n\
         {\"phase\":\"rl\",\"step\":1,\"critic/rewards/mean\":-1e308}\n",
    )
    .unwrap();
    let (done, wait) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = done.send(train::plot::plot_run(&dir).map_err(|e| e.to_string()));
    });
    let png = wait
        .recv_timeout(std::time::Duration::from_secs(120))
        .unwrap_or_else(|_| panic!("the plot did not finish in 2 minutes"))
        .unwrap();
    assert!(std::fs::read(&png).unwrap().starts_with(b"\x89PNG"));
}

/// A metric no step logged takes no place in the grid (it left a blank panel): a log of rewards alone is
/// one row of panels, 300 pixels high.
#[test]
#[ignore = "needs a TrueType font (fonts-dejavu-core, or QARL_FONT=/path/to/font.ttf); .ci/run installs it and runs --include-ignored"]
fn panels_without_values_take_no_place() {
    train::plot::register_font().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let log: String = (0..3)
        .map(|s| format!("{{\"phase\":\"rl\",\"step\":{s},\"critic/rewards/mean\":0.{s}}}\n"))
        .collect();
    std::fs::write(tmp.path().join("metrics.jsonl"), log).unwrap();
    let png = std::fs::read(train::plot::plot_run(tmp.path()).unwrap()).unwrap();
    let height = u32::from_be_bytes(png[20..24].try_into().unwrap());
    assert_eq!(height, 300);
    // A folder where the picture goes is named as such.
    std::fs::remove_file(tmp.path().join("plots.png")).unwrap();
    std::fs::create_dir(tmp.path().join("plots.png")).unwrap();
    let err = train::plot::plot_run(tmp.path()).unwrap_err().to_string();
    assert!(
        err.ends_with("plots.png: is a folder; give the path of a file to write"),
        "{err}"
    );
}
