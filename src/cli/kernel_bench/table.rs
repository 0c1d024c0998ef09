//! The table `qarl bench kernels` prints and writes: its rows (time, bandwidth and FLOP rate against
//! the rooflines measured in the same run), and the timer.

use std::path::PathBuf;
use std::time::Instant;

use burn::tensor::DType;
use cube_kernels::ActDType;
use serde::Serialize;

use crate::io::write_json_atomic;

#[derive(Debug, Serialize)]
pub(super) struct Row {
    pub(super) kernel: String,
    format: String,
    act_dtype: String,
    tokens: usize,
    micros: f64,
    gb_per_s: f64,
    bandwidth_fraction: f64,
    tflops: f64,
    bf16_micros: f64,
    speedup_over_bf16: f64,
    /// Device tasks that failed while the row (or the checks before it) ran: CubeCL only logs them,
    /// and the row's time is not to be trusted ([`crate::device_failures`]).
    #[serde(skip_serializing_if = "is_zero")]
    device_failures: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// Mean seconds of `f` over `iters` runs after two warm-ups, `sync` closing each measurement.
pub(super) fn time(iters: usize, mut f: impl FnMut(), sync: &dyn Fn()) -> f64 {
    for _ in 0..2 {
        f();
    }
    sync();
    let start = Instant::now();
    for _ in 0..iters {
        f();
    }
    sync();
    start.elapsed().as_secs_f64() / iters.max(1) as f64
}

/// The timing table, printed a row at a time as the rows are measured (so a run stopped part-way,
/// by a time limit on a lent GPU, keeps what it measured), and kept for the JSON; with `json` (the
/// file of `--json` and the table's header fields) the rows so far are also written there after
/// each row, `"complete": false` until the run's end writes the whole table, so `--summarize` reads
/// what a stopped run measured.
pub(super) struct Table {
    base: DType,
    pub(super) rows: Vec<Row>,
    json: Option<(PathBuf, serde_json::Value)>,
    /// The rows during which a device task failed, described for the run's failures.
    pub(super) failed_rows: Vec<String>,
}

impl Table {
    pub(super) fn new(base: DType, json: Option<(PathBuf, serde_json::Value)>) -> Self {
        Table {
            base,
            rows: Vec::new(),
            json,
            failed_rows: Vec::new(),
        }
    }

    /// Prints `r` (after the header, before the first row), keeps it, and writes the rows so far
    /// where the table has a JSON file (a file it cannot write is reported once per row, and the
    /// run goes on: the end of the run writes it again, and fails there). Device failures since the
    /// last row are marked on this one and taken as reported, so the table goes on being written
    /// (a lent GPU's run keeps its other rows) and the run fails at its end.
    pub(super) fn push(&mut self, mut r: Row) {
        r.device_failures = crate::device_failures::acknowledge();
        if self.rows.is_empty() {
            println!(
                "{:<25} {:<10} {:<5} {:>6} {:>11} {:>9} {:>8} {:>9} {:>11} {:>8}",
                "kernel",
                "format",
                "act",
                "tokens",
                "time (us)",
                "GB/s",
                "% copy",
                "TFLOP/s",
                format!("{:?} (us)", self.base),
                "speedup"
            );
        }
        println!(
            "{:<25} {:<10} {:<5} {:>6} {:>11.1} {:>9.1} {:>7.1}% {:>9.3} {:>11.1} {:>7.2}x",
            r.kernel,
            r.format,
            r.act_dtype,
            r.tokens,
            r.micros,
            r.gb_per_s,
            100.0 * r.bandwidth_fraction,
            r.tflops,
            r.bf16_micros,
            r.speedup_over_bf16
        );
        if r.device_failures > 0 {
            let what = format!(
                "{} {} {} {} tokens: {} device task(s) failed during the row or the checks before it",
                r.kernel, r.format, r.act_dtype, r.tokens, r.device_failures
            );
            println!("  ^ {what}: its time is not to be trusted");
            self.failed_rows.push(what);
        }
        self.rows.push(r);
        if let Some((path, header)) = &self.json {
            let mut doc = header.clone();
            doc["rows"] = serde_json::json!(self.rows);
            doc["complete"] = serde_json::json!(false);
            if let Err(e) = write_json_atomic(path, &doc) {
                eprintln!("writing the rows so far to {}: {e:#}", path.display());
            }
        }
    }

    /// The table's footnote.
    pub(super) fn finish(&self) {
        let base = self.base;
        println!("moe {base:?} baseline: the same FLOPs as dense matmuls over all assignments (a lower bound on a {base:?} MoE)");
    }
}

#[allow(clippy::too_many_arguments)]
pub(super) fn row(
    kernel: &str,
    format: &str,
    act_dtype: ActDType,
    tokens: usize,
    t: f64,
    bytes: f64,
    flops: f64,
    tb: f64,
    copy_gbs: f64,
) -> Row {
    let gbs = bytes / t / 1e9;
    Row {
        kernel: kernel.into(),
        format: format.into(),
        act_dtype: act_dtype.name().into(),
        tokens,
        micros: t * 1e6,
        gb_per_s: gbs,
        bandwidth_fraction: gbs / copy_gbs,
        tflops: flops / t / 1e12,
        bf16_micros: tb * 1e6,
        speedup_over_bf16: tb / t,
        device_failures: 0,
    }
}
