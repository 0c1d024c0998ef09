//! Progress bars with rate and ETA (hidden with `--quiet`).

use indicatif::{ProgressBar, ProgressStyle};

pub fn progress_bar(len: u64, phase: &str, quiet: bool) -> ProgressBar {
    if quiet {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(len);
    let style = ProgressStyle::with_template(&format!(
        "{phase:>5} [{{bar:30}}] {{pos}}/{{len}} {{per_sec}} eta {{eta}} {{msg}}"
    ))
    .unwrap_or_else(|_| ProgressStyle::default_bar())
    .progress_chars("=> ");
    bar.set_style(style);
    bar
}

/// A spinner with elapsed time for work of unknown length (evaluation); hidden with `--quiet`.
pub fn spinner(phase: &str, quiet: bool) -> ProgressBar {
    if quiet {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new_spinner();
    let style = ProgressStyle::with_template(&format!("{{spinner}} {phase} {{msg}} {{elapsed}}"))
        .unwrap_or_else(|_| ProgressStyle::default_spinner());
    bar.set_style(style);
    bar.enable_steady_tick(std::time::Duration::from_millis(200));
    bar
}
