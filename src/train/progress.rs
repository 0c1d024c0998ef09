//! Progress bars with rate and ETA (hidden with `--quiet`). On a terminal they redraw in place; when stderr
//! is not a terminal (CI, `nohup`, a pipe into a log file) a redrawing bar would print nothing (indicatif
//! hides itself there), so the same state is written as plain lines instead: at most one every
//! [`PLAIN_INTERVAL`], the last one always, without colour or cursor codes.

use std::io::{IsTerminal, Write};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use indicatif::{
    HumanDuration, ProgressBar, ProgressDrawTarget, ProgressState, ProgressStyle, TermLike,
};

/// The shortest time between two plain progress lines (a step that takes longer gets one line each).
pub const PLAIN_INTERVAL: Duration = Duration::from_secs(5);

pub fn progress_bar(len: u64, phase: &str, quiet: bool) -> ProgressBar {
    if quiet {
        return ProgressBar::hidden();
    }
    if !std::io::stderr().is_terminal() {
        let bar = ProgressBar::with_draw_target(Some(len), plain_target());
        let style = ProgressStyle::with_template(&format!(
            "{phase} {{pos}}/{{len}} ({{percent}}%) {{per_sec}} elapsed {{elapsed}} eta {{eta}} {{msg}}"
        ))
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .with_key("eta", eta_once_measured);
        bar.set_style(style);
        return bar;
    }
    let bar = ProgressBar::new(len);
    let style = ProgressStyle::with_template(&format!(
        "{phase:>5} [{{bar:30}}] {{pos}}/{{len}} {{per_sec}} eta {{eta}} {{msg}}"
    ))
    .unwrap_or_else(|_| ProgressStyle::default_bar())
    .progress_chars("=> ")
    .with_key("eta", eta_once_measured);
    bar.set_style(style);
    bar
}

/// The time left, `?` while indicatif has no rate (before the first item, and after a resumed bar's
/// `reset_eta`): it would print `0s`, which reads as "almost finished" at the start of an hour-long
/// run.
fn eta_once_measured(state: &ProgressState, w: &mut dyn std::fmt::Write) {
    let left = state.len().is_some_and(|len| state.pos() < len);
    let known = state.is_finished() || !left || state.per_sec() > 0.0;
    let _ = if known {
        write!(w, "{:#}", HumanDuration(state.eta()))
    } else {
        w.write_str("?")
    };
}

/// A spinner with elapsed time for work of unknown length (evaluation); hidden with `--quiet`. Off a
/// terminal it writes a plain line when its message changes (no ticking).
pub fn spinner(phase: &str, quiet: bool) -> ProgressBar {
    if quiet {
        return ProgressBar::hidden();
    }
    let plain = !std::io::stderr().is_terminal();
    let bar = if plain {
        ProgressBar::with_draw_target(None, plain_target())
    } else {
        ProgressBar::new_spinner()
    };
    let template = if plain {
        format!("{phase} {{msg}} elapsed {{elapsed}}")
    } else {
        format!("{{spinner}} {phase} {{msg}} {{elapsed}}")
    };
    let style = ProgressStyle::with_template(&template)
        .unwrap_or_else(|_| ProgressStyle::default_spinner());
    bar.set_style(style);
    if !plain {
        bar.enable_steady_tick(Duration::from_millis(200));
    }
    bar
}

fn plain_target() -> ProgressDrawTarget {
    ProgressDrawTarget::term_like_with_hz(
        Box::new(PlainLines::new(std::io::stderr(), PLAIN_INTERVAL)),
        1,
    )
}

/// A "terminal" that turns indicatif's redraws into plain lines: cursor movements and clears are dropped,
/// repeated states are written once, and a state arriving within `interval` of the last line waits until
/// the next one is due (or the bar is dropped, which writes the last state).
#[derive(Debug)]
pub struct PlainLines<W: Write + Send + std::fmt::Debug> {
    out: Mutex<W>,
    interval: Duration,
    state: Mutex<PlainState>,
}

#[derive(Debug, Default)]
struct PlainState {
    last_written: Option<(Instant, String)>,
    pending: Option<String>,
}

impl<W: Write + Send + std::fmt::Debug> PlainLines<W> {
    pub fn new(out: W, interval: Duration) -> Self {
        Self {
            out: Mutex::new(out),
            interval,
            state: Mutex::new(PlainState::default()),
        }
    }

    /// Takes one drawn line.
    fn offer(&self, line: &str) -> std::io::Result<()> {
        let line = line.trim_end();
        if line.is_empty() {
            return Ok(());
        }
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if st.last_written.as_ref().is_some_and(|(_, l)| l == line) {
            st.pending = None;
            return Ok(());
        }
        let due = st
            .last_written
            .as_ref()
            .is_none_or(|(t, _)| t.elapsed() >= self.interval);
        if !due {
            st.pending = Some(line.to_string());
            return Ok(());
        }
        st.pending = None;
        st.last_written = Some((Instant::now(), line.to_string()));
        self.emit(line)
    }

    fn emit(&self, line: &str) -> std::io::Result<()> {
        let mut out = self.out.lock().unwrap_or_else(|e| e.into_inner());
        writeln!(out, "{line}")?;
        out.flush()
    }
}

impl<W: Write + Send + std::fmt::Debug> Drop for PlainLines<W> {
    fn drop(&mut self) {
        let pending = self
            .state
            .get_mut()
            .map(|s| s.pending.take())
            .unwrap_or_default();
        if let Some(line) = pending {
            let _ = self.emit(&line);
        }
    }
}

impl<W: Write + Send + Sync + std::fmt::Debug> TermLike for PlainLines<W> {
    fn width(&self) -> u16 {
        200
    }
    fn move_cursor_up(&self, _: usize) -> std::io::Result<()> {
        Ok(())
    }
    fn move_cursor_down(&self, _: usize) -> std::io::Result<()> {
        Ok(())
    }
    fn move_cursor_right(&self, _: usize) -> std::io::Result<()> {
        Ok(())
    }
    fn move_cursor_left(&self, _: usize) -> std::io::Result<()> {
        Ok(())
    }
    fn write_line(&self, s: &str) -> std::io::Result<()> {
        self.offer(s)
    }
    fn write_str(&self, s: &str) -> std::io::Result<()> {
        self.offer(s)
    }
    fn clear_line(&self) -> std::io::Result<()> {
        Ok(())
    }
    fn flush(&self) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Clone, Default)]
    struct Shared(std::sync::Arc<Mutex<Vec<u8>>>);
    impl Write for Shared {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn text(s: &Shared) -> String {
        String::from_utf8(s.0.lock().unwrap().clone()).unwrap()
    }

    /// A bar of `len` items writing plain lines (at most one per `interval`) into the returned
    /// buffer, styled by `style`.
    fn plain_bar(len: u64, interval: Duration, style: ProgressStyle) -> (ProgressBar, Shared) {
        let out = Shared::default();
        let target = ProgressDrawTarget::term_like_with_hz(
            Box::new(PlainLines::new(out.clone(), interval)),
            20,
        );
        let bar = ProgressBar::with_draw_target(Some(len), target);
        bar.set_style(style);
        (bar, out)
    }

    /// `template` with the time left as the bars print it.
    fn eta_style(template: &str) -> ProgressStyle {
        ProgressStyle::with_template(template)
            .unwrap()
            .with_key("eta", eta_once_measured)
    }

    /// Every step of a slow loop gets a line with its position, rate and ETA; no escape codes.
    #[test]
    fn plain_lines_have_one_line_per_step_without_escape_codes() {
        let style =
            ProgressStyle::with_template("rl {pos}/{len} {per_sec} eta {eta} {msg}").unwrap();
        let (bar, out) = plain_bar(3, Duration::ZERO, style);
        for i in 0..3 {
            std::thread::sleep(Duration::from_millis(60));
            bar.set_message(format!("reward {i}"));
            bar.inc(1);
        }
        bar.finish();
        drop(bar);
        let t = text(&out);
        println!("{t}");
        assert!(!t.contains('\u{1b}'), "escape codes: {t:?}");
        for pos in 1..=3 {
            assert!(
                t.contains(&format!("rl {pos}/3 ")),
                "no line for step {pos}: {t}"
            );
        }
        assert!(t.lines().all(|l| l.contains("eta")), "{t}");
        let lines: Vec<&str> = t.lines().collect();
        let mut dedup = lines.clone();
        dedup.dedup();
        assert_eq!(lines, dedup, "repeated lines");
    }

    /// Before the first item, and on a resumed bar before its next, the time left is unknown (`?`, not
    /// indicatif's `0s`); after it, a duration.
    #[test]
    fn eta_is_unknown_until_a_rate_is_measured() {
        let (bar, out) = plain_bar(2, Duration::ZERO, eta_style("rl {pos}/{len} eta {eta}"));
        bar.tick();
        std::thread::sleep(Duration::from_millis(60));
        bar.inc(1);
        bar.finish();
        drop(bar);
        let t = text(&out);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.first(), Some(&"rl 0/2 eta ?"), "{t}");
        let after = lines.iter().find(|l| l.starts_with("rl 1/2")).expect(&t);
        let eta = after.trim_start_matches("rl 1/2 eta ");
        assert!(
            eta.ends_with('s') && eta.chars().next().is_some_and(|c| c.is_ascii_digit()),
            "{t}"
        );
        // A resumed bar (position set, rate reset) has no rate either.
        let (bar, out) = plain_bar(3, Duration::ZERO, eta_style("sft {pos}/{len} eta {eta}"));
        bar.set_position(1);
        bar.reset_eta();
        bar.tick();
        drop(bar);
        let t = text(&out);
        assert_eq!(t.lines().last(), Some("sft 1/3 eta ?"), "{t}");
    }

    /// Fast steps are throttled to one line per interval, and the final state is always written.
    #[test]
    fn fast_progress_is_throttled_and_ends_with_the_final_state() {
        let style = ProgressStyle::with_template("sft {pos}/{len}").unwrap();
        let (bar, out) = plain_bar(1000, Duration::from_secs(3600), style);
        for _ in 0..1000 {
            bar.inc(1);
        }
        bar.finish();
        drop(bar);
        let t = text(&out);
        let lines: Vec<&str> = t.lines().collect();
        assert!(lines.len() <= 2, "{t}");
        assert_eq!(lines.last(), Some(&"sft 1000/1000"), "{t}");
    }
}
