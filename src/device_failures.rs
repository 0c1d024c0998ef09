//! Device failures that CubeCL reports only in its log. A task that panics on a device's runner thread
//! (a kernel that does not compile for the device, a type the device lacks) is logged by
//! `cubecl_common` as a warning, and the caller goes on with an output that nothing wrote (zeros, or a
//! reused buffer's bits): a silent wrong answer unless somebody reads the log. [`DeviceFailureLayer`]
//! counts those log events (CubeCL's own words, "task panicked on device runner thread", and nothing
//! else: a failed autotune candidate that another candidate replaces is no failure of the run); the
//! writers of results (atomic files, metrics rows) call [`check`] first and stop with an error instead of
//! writing values computed after a failure. Probes whose failure is the answer they look for (does this
//! device have bf16?) run through [`expecting_failures`], after the device has finished the work queued
//! before them (`crate::host::probe_device`), so that they forgive only their own failure.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::layer::Context;
use tracing_subscriber::Layer;

/// What CubeCL's log says, and only says, of a task that panicked on a device's runner thread.
const RUNNER_PANIC: &str = "task panicked on device runner thread";

/// Failed device tasks counted so far, and how many of them a probe expected.
pub struct FailureCount {
    failed: AtomicU64,
    expected: AtomicU64,
    /// The last failure's message, for the error (the log that printed it may be filtered).
    last: Mutex<Option<String>>,
}

impl FailureCount {
    pub const fn new() -> Self {
        Self {
            failed: AtomicU64::new(0),
            expected: AtomicU64::new(0),
            last: Mutex::new(None),
        }
    }

    /// Failed device tasks so far that no probe expected.
    pub fn unexpected(&self) -> u64 {
        let failed = self.failed.load(Ordering::SeqCst);
        failed.saturating_sub(self.expected.load(Ordering::SeqCst))
    }

    /// Counts one failed device task, with what the log said of it.
    pub fn record(&self, message: &str) {
        *self.last.lock().unwrap_or_else(|e| e.into_inner()) = Some(message.to_string());
        self.failed.fetch_add(1, Ordering::SeqCst);
    }

    /// Runs `probe`, counting the failures meanwhile as expected (see [`expecting_failures`]).
    pub fn expecting<R>(&self, probe: impl FnOnce() -> R) -> R {
        let before = self.failed.load(Ordering::SeqCst);
        let out = probe();
        let during = self.failed.load(Ordering::SeqCst) - before;
        self.expected.fetch_add(during, Ordering::SeqCst);
        out
    }

    /// Counts the unexpected failures so far as expected and returns how many (see [`acknowledge`]).
    pub fn acknowledge(&self) -> u64 {
        let n = self.unexpected();
        self.expected.fetch_add(n, Ordering::SeqCst);
        n
    }

    /// An error when a failure no probe expected was counted (see [`check`]).
    pub fn check(&self) -> anyhow::Result<()> {
        match self.unexpected() {
            0 => Ok(()),
            n => {
                let last = self.last.lock().unwrap_or_else(|e| e.into_inner()).clone();
                anyhow::bail!(
                    "the device reported {n} failed task(s) (the last: {}); the values computed since \
                     are not to be trusted, so they are not written",
                    last.unwrap_or_default()
                )
            }
        }
    }
}

impl Default for FailureCount {
    fn default() -> Self {
        Self::new()
    }
}

/// This process's count, which the installed [`DeviceFailureLayer`] feeds.
static PROCESS: FailureCount = FailureCount::new();

/// Runs `probe`, counting the device failures logged meanwhile as expected: its failure is an answer.
/// (A failure of another thread's work in the same moment is forgiven too; probes run at start-up.)
pub fn expecting_failures<R>(probe: impl FnOnce() -> R) -> R {
    PROCESS.expecting(probe)
}

/// Counts the process's unexpected failures so far as expected and returns how many: for a caller that
/// reports them itself and goes on (the kernel bench marks the row they happened in and fails at its end,
/// keeping the rows of a lent GPU's run).
pub fn acknowledge() -> u64 {
    PROCESS.acknowledge()
}

/// The process's failed device tasks so far that no probe expected.
pub fn unexpected_failures() -> u64 {
    PROCESS.unexpected()
}

/// An error when a device task failed since the process started (and no probe expected it): what was
/// computed since may be wrong, so nothing computed is to be written.
pub fn check() -> anyhow::Result<()> {
    PROCESS.check()
}

/// A `tracing` layer that counts CubeCL's reports of a task that panicked on a device's runner thread.
/// Install it beside the log's own layer, without the log's filter, so that `RUST_LOG=error` does not
/// hide a failure from it. [`DeviceFailureLayer::default`] feeds the process's count ([`check`]).
pub struct DeviceFailureLayer {
    counts: &'static FailureCount,
}

impl DeviceFailureLayer {
    /// A layer that feeds `counts` instead of the process's count.
    pub fn counting(counts: &'static FailureCount) -> Self {
        Self { counts }
    }
}

impl Default for DeviceFailureLayer {
    fn default() -> Self {
        Self::counting(&PROCESS)
    }
}

impl<S: Subscriber> Layer<S> for DeviceFailureLayer {
    fn on_event(&self, event: &Event<'_>, _ctx: Context<'_, S>) {
        let meta = event.metadata();
        if *meta.level() > Level::WARN {
            return;
        }
        let mut seen = Seen::default();
        event.record(&mut seen);
        // CubeCL logs through the `log` crate: such a record reaches `tracing` with the target "log" and
        // the crate's own target in a field.
        let target = seen.log_target.as_deref().unwrap_or(meta.target());
        if let (true, Some(message)) = (target.starts_with("cubecl"), seen.runner_panic) {
            self.counts.record(&message);
        }
    }

    fn max_level_hint(&self) -> Option<tracing::level_filters::LevelFilter> {
        Some(tracing::level_filters::LevelFilter::WARN)
    }
}

/// What [`DeviceFailureLayer`] reads of an event: its message where it says that a task panicked on a
/// device's runner thread ([`RUNNER_PANIC`]), and the target of a `log` record.
#[derive(Default)]
struct Seen {
    runner_panic: Option<String>,
    log_target: Option<String>,
}

impl Seen {
    fn field(&mut self, field: &Field, value: String) {
        match field.name() {
            "log.target" => self.log_target = Some(value.trim_matches('"').to_string()),
            "message" if value.contains(RUNNER_PANIC) => self.runner_panic = Some(value),
            _ => {}
        }
    }
}

impl Visit for Seen {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.field(field, value.to_string());
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.field(field, format!("{value:?}"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tracing_subscriber::layer::SubscriberExt;

    /// A CubeCL warning that a task panicked counts (and stops [`check`]) unless a probe expected it;
    /// other warnings and other crates' panics do not count.
    #[test]
    fn cubecl_task_panics_are_counted_unless_expected() {
        static COUNTS: FailureCount = FailureCount::new();
        let subscriber = tracing_subscriber::registry().with(DeviceFailureLayer::counting(&COUNTS));
        let panic = "CallError(task panicked on device runner thread: UnsupportedType)";
        tracing::subscriber::with_default(subscriber, || {
            tracing::warn!(target: "cubecl_common::device::handle::channel::task", "slow compile");
            tracing::warn!(target: "other_crate", "task panicked elsewhere");
            tracing::info!(target: "cubecl_common::device", "{panic}, but only info");
            tracing::warn!(target: "cubecl_runtime::tune", "Expanding the kernel `k` panicked");
            assert_eq!(COUNTS.unexpected(), 0);
            COUNTS.check().unwrap();
            COUNTS.expecting(|| tracing::warn!(target: "cubecl_common::device::handle::channel::task", "{panic}"));
            assert_eq!(COUNTS.unexpected(), 0);
            tracing::error!(target: "cubecl_common::device::handle::channel::task", "{panic}");
            assert_eq!(COUNTS.unexpected(), 1);
            let err = COUNTS.check().unwrap_err().to_string();
            assert!(
                err.contains(
                    "1 failed task(s) (the last: CallError(task panicked on device runner"
                ),
                "{err}"
            );
            // A `log` record as tracing-log hands it on (how CubeCL logs): its target in a field.
            let cubecl = "cubecl_common::device::handle::channel::task";
            tracing::warn!(target: "log", { log.target = cubecl }, "{panic}");
            tracing::warn!(target: "log", { log.target = "wgpu_core" }, "{panic}");
            assert_eq!(COUNTS.unexpected(), 2);
            assert_eq!(COUNTS.acknowledge(), 2);
            assert_eq!(COUNTS.unexpected(), 0);
            COUNTS.check().unwrap();
        });
    }
}
