//! The table `qarl bench kernels` prints and writes: its rows (time, bandwidth and FLOP rate against
//! the rooflines measured in the same run).

use std::path::PathBuf;

use burn::tensor::DType;
use cube_kernels::ActDType;
use serde::Serialize;

use super::timing::Timing;
use crate::io::write_json_atomic;

#[derive(Debug, Serialize)]
pub(super) struct Row {
    pub(super) kernel: String,
    format: String,
    act_dtype: String,
    tokens: usize,
    micros: f64,
    /// The per-call time of the fastest and the slowest batch ([`Timing`]); absent where the calls
    /// were timed in one batch (rows too short for a sync per batch, and tables of older runs).
    #[serde(skip_serializing_if = "Option::is_none")]
    micros_fastest_batch: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    micros_slowest_batch: Option<f64>,
    batches: usize,
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

impl Row {
    /// The batches' spread as a share of the mean, for the table ("-" with one batch).
    fn spread(&self) -> String {
        match (self.micros_fastest_batch, self.micros_slowest_batch) {
            (Some(fast), Some(slow)) => format!("{:.1}%", 100.0 * (slow - fast) / self.micros),
            _ => "-".into(),
        }
    }
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
                "{:<25} {:<10} {:<5} {:>6} {:>11} {:>7} {:>9} {:>8} {:>9} {:>11} {:>8}",
                "kernel",
                "format",
                "act",
                "tokens",
                "time (us)",
                "spread",
                "GB/s",
                "% copy",
                "TFLOP/s",
                format!("{:?} (us)", self.base),
                "speedup"
            );
        }
        println!(
            "{:<25} {:<10} {:<5} {:>6} {:>11.1} {:>7} {:>9.1} {:>7.1}% {:>9.3} {:>11.1} {:>7.2}x",
            r.kernel,
            r.format,
            r.act_dtype,
            r.tokens,
            r.micros,
            r.spread(),
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

    /// The table's footnotes.
    pub(super) fn finish(&self) {
        let base = self.base;
        println!("spread: the slowest batch's time per call less the fastest's, over the mean (\"-\": one batch)");
        println!("moe {base:?} baseline: the same FLOPs as dense matmuls over all assignments (a lower bound on a {base:?} MoE)");
    }
}

#[allow(clippy::too_many_arguments)]
pub(super) fn row(
    kernel: &str,
    format: &str,
    act_dtype: ActDType,
    tokens: usize,
    timing: Timing,
    bytes: f64,
    flops: f64,
    tb: f64,
    copy_gbs: f64,
) -> Row {
    let t = timing.mean;
    let gbs = bytes / t / 1e9;
    let spread = timing.batches > 1;
    Row {
        kernel: kernel.into(),
        format: format.into(),
        act_dtype: act_dtype.name().into(),
        tokens,
        micros: t * 1e6,
        micros_fastest_batch: spread.then_some(timing.fastest * 1e6),
        micros_slowest_batch: spread.then_some(timing.slowest * 1e6),
        batches: timing.batches,
        gb_per_s: gbs,
        bandwidth_fraction: gbs / copy_gbs,
        tflops: flops / t / 1e12,
        bf16_micros: tb * 1e6,
        speedup_over_bf16: tb / t,
        device_failures: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A row keeps its batches' times where there were several, and shows their spread; one batch
    /// writes neither time and prints "-".
    #[test]
    fn rows_carry_the_batch_spread() {
        let timing = Timing {
            mean: 100e-6,
            fastest: 95e-6,
            slowest: 110e-6,
            batches: 5,
        };
        let r = row(
            "moe/mma",
            "int4-g128",
            ActDType::BF16,
            256,
            timing,
            1e6,
            1e9,
            200e-6,
            3000.0,
        );
        assert_eq!(r.spread(), "15.0%");
        let json = serde_json::to_value(&r).unwrap();
        assert!((json["micros_fastest_batch"].as_f64().unwrap() - 95.0).abs() < 1e-9);
        assert!((json["micros_slowest_batch"].as_f64().unwrap() - 110.0).abs() < 1e-9);
        let one = Timing {
            batches: 1,
            ..timing
        };
        let r = row(
            "moe/mma",
            "int4-g128",
            ActDType::BF16,
            256,
            one,
            1e6,
            1e9,
            200e-6,
            3000.0,
        );
        assert_eq!(r.spread(), "-");
        let json = serde_json::to_value(&r).unwrap();
        assert!(json.get("micros_fastest_batch").is_none() && json["batches"] == 1);
    }
}
