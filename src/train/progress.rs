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
