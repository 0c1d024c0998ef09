//! Comparisons of training variants over seeds, resumable: each (variant, seed) run lives in its own
//! directory, finished runs are skipped, unfinished ones resume from their newest checkpoint, and the report
//! is rebuilt from whatever has finished.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use serde::Deserialize;

use super::config::TrainConfig;

/// One variant: overrides (dotted keys) applied to the base config.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Variant {
    pub name: String,
    /// Short description for the report.
    #[serde(default)]
    pub about: String,
    #[serde(default)]
    pub set: BTreeMap<String, toml::Value>,
}

/// An experiment file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExperimentConfig {
    pub name: String,
    /// The base training config (relative to the experiment file).
    pub base: PathBuf,
    pub seeds: Vec<u64>,
    /// Where results go (default `experiments/results/<name>`).
    #[serde(default)]
    pub results_dir: Option<PathBuf>,
    #[serde(rename = "variant")]
    pub variants: Vec<Variant>,
}

/// Sets `key` (dotted path such as `rollout.precision`) in a TOML document, creating missing tables on the
/// way (`sft.steps` on a config without `[sft]`); a misspelt key is then rejected by the config's own parse,
/// which names the unknown field.
pub fn set_dotted(doc: &mut toml::Value, key: &str, value: toml::Value) -> anyhow::Result<()> {
    let parts: Vec<&str> = key.split('.').collect();
    let mut cur = doc;
    for p in &parts[..parts.len() - 1] {
        let table = cur.as_table_mut().with_context(|| {
            format!("override `{key}`: `{p}` is inside a value that is not a table")
        })?;
        cur = table
            .entry(p.to_string())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
    }
    let table = cur
        .as_table_mut()
        .with_context(|| format!("override `{key}`: parent is not a table"))?;
    table.insert(parts[parts.len() - 1].to_string(), value);
    Ok(())
}

/// Parses one `--set key.path=value` override. The value is read as a TOML value (`3e-4`, `true`,
/// `["add","mul"]`, `"int4-g32"`); anything that is not valid TOML is taken as a bare string (`int4-g32`).
pub fn parse_override(text: &str) -> anyhow::Result<(String, toml::Value)> {
    let (key, raw) = text
        .split_once('=')
        .with_context(|| format!("--set `{text}`: expected key.path=value"))?;
    let key = key.trim();
    if key.is_empty() || key.split('.').any(str::is_empty) {
        bail!("--set `{text}`: the key `{key}` is not a dotted path like `train.lr`");
    }
    let raw = raw.trim();
    let value = toml::from_str::<toml::Table>(&format!("v = {raw}"))
        .ok()
        .and_then(|mut t| t.remove("v"))
        .unwrap_or_else(|| toml::Value::String(raw.to_string()));
    Ok((key.to_string(), value))
}

fn marker(run_dir: &Path) -> PathBuf {
    run_dir.join("finished.json")
}

/// Runs every (variant, seed) not finished yet, then writes `report.md`.
pub fn run_experiment(path: &Path, quiet: bool) -> anyhow::Result<PathBuf> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("{}: cannot read", path.display()))?;
    let exp: ExperimentConfig =
        toml::from_str(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    if exp.seeds.is_empty() || exp.variants.is_empty() {
        bail!(
            "{}: needs at least one seed and one variant",
            path.display()
        );
    }
    let base_dir = path.parent().unwrap_or(Path::new("."));
    let base_path = base_dir.join(&exp.base);
    let base_text = std::fs::read_to_string(&base_path)
        .with_context(|| format!("{}: cannot read", base_path.display()))?;
    let base: toml::Value =
        toml::from_str(&base_text).map_err(|e| anyhow::anyhow!("{}: {e}", base_path.display()))?;
    let results = exp
        .results_dir
        .clone()
        .unwrap_or_else(|| PathBuf::from("experiments/results").join(&exp.name));
    // One experiment process per results directory (each run directory is locked by its run as well).
    let _lock = super::lock::RunLock::acquire(&results)?;
    for v in &exp.variants {
        for &seed in &exp.seeds {
            let run_dir = results.join(&v.name).join(format!("seed{seed}"));
            if marker(&run_dir).is_file() {
                continue;
            }
            let mut doc = base.clone();
            for (k, val) in &v.set {
                set_dotted(&mut doc, k, val.clone())?;
            }
            set_dotted(&mut doc, "seed", toml::Value::Integer(seed as i64))?;
            set_dotted(
                &mut doc,
                "run_dir",
                toml::Value::String(run_dir.display().to_string()),
            )?;
            let origin = format!("{} (variant {}, seed {seed})", path.display(), v.name);
            let cfg = TrainConfig::from_toml(&toml::to_string(&doc)?, &origin)?;
            if !quiet {
                eprintln!("== {} seed {seed} -> {}", v.name, run_dir.display());
            }
            let resume = run_dir.join("checkpoints").is_dir();
            let s = super::run(&cfg, resume, quiet)?;
            crate::io::write_json_atomic(
                &marker(&run_dir),
                &serde_json::json!({
                    "accuracy_after": s.accuracy_after,
                    "accuracy_before": s.accuracy_before,
                    "paired": s.paired.as_ref().map(|p| serde_json::json!({
                        "problems": p.problems,
                        "fixed": p.fixed,
                        "broken": p.broken,
                        "diff": p.diff(),
                        "diff_se": p.diff_se,
                        "p_value": p.p_value,
                    })),
                }),
            )?;
        }
    }
    let report = write_report(&exp, &results)?;
    Ok(report)
}

fn mean_std(xs: &[f64]) -> (f64, f64) {
    let n = xs.len().max(1) as f64;
    let m = xs.iter().sum::<f64>() / n;
    let v = if xs.len() > 1 {
        xs.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (n - 1.0)
    } else {
        0.0
    };
    (m, v.sqrt())
}

fn read_rows(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .map(|t| {
            t.lines()
                .filter_map(|l| serde_json::from_str(l).ok())
                .collect()
        })
        .unwrap_or_default()
}

/// The report table from the finished runs.
pub fn write_report(exp: &ExperimentConfig, results: &Path) -> anyhow::Result<PathBuf> {
    let mut md = String::new();
    writeln!(md, "# {}\n", exp.name)?;
    writeln!(md, "Seeds: {:?}. Mean ± sample std over finished seeds. Accuracy: held-out greedy pass@1 before RL (the warm start) and at the end of RL, in the rollout precision and in f32; mean@k: the fraction of k sampled answers per held-out problem that are right (T = 1), before and at the end of RL, in the rollout precision; the mismatch and stability columns average the RL steps.\n", exp.seeds)?;
    writeln!(md, "RL gain: greedy accuracy after minus before RL in the rollout precision, paired problem by problem and pooled over seeds, ± its standard error, with McNemar's exact p-value (see `train::paired`).\n")?;
    writeln!(md, "| variant | seeds done | acc before RL (rollout prec.) | acc (rollout prec.) | RL gain, paired (p) | acc (f32) | mean@k before RL | mean@k (rollout prec.) | k3 KL | error-token frac | entropy | rollout tok/s | step s |")?;
    writeln!(md, "|---|---|---|---|---|---|---|---|---|---|---|---|---|")?;
    for v in &exp.variants {
        let mut cols: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
        let (mut pooled_before, mut pooled_after) = (Vec::new(), Vec::new());
        let mut done = 0;
        for &seed in &exp.seeds {
            let run_dir = results.join(&v.name).join(format!("seed{seed}"));
            if !marker(&run_dir).is_file() {
                continue;
            }
            done += 1;
            let rows = read_rows(&run_dir.join("metrics.jsonl"));
            // `eval/<precision>/<metric>`: the rollout precision's, else f32's (the same for f32 runs).
            let eval_value = |e: &serde_json::Value, suffix: &str, quantized: bool| {
                let e = e.as_object()?;
                let find = |q: bool| {
                    e.iter()
                        .find(|(k, _)| k.ends_with(suffix) && k.starts_with("eval/f32/") != q)
                        .and_then(|(_, v)| v.as_f64())
                };
                find(quantized).or_else(|| find(false))
            };
            let evals: Vec<&serde_json::Value> =
                rows.iter().filter(|r| r["phase"] == "eval").collect();
            if let (Some(first), Some(last)) = (evals.first(), evals.last()) {
                let outcomes = |e: &serde_json::Value| {
                    let o = e.as_object()?;
                    o.iter()
                        .filter(|(k, _)| k.ends_with("/greedy_correct"))
                        .min_by_key(|(k, _)| k.starts_with("eval/f32/"))
                        .and_then(|(_, v)| super::paired::decode(v.as_str()?))
                };
                if let (Some(b), Some(a)) = (outcomes(first), outcomes(last)) {
                    if b.len() == a.len() && evals.len() > 1 {
                        pooled_before.extend(b);
                        pooled_after.extend(a);
                    }
                }
                for (col, e, suffix, quantized) in [
                    ("acc0_roll", first, "/pass@1_greedy", true),
                    ("acc_roll", last, "/pass@1_greedy", true),
                    ("acc_f32", last, "/pass@1_greedy", false),
                ] {
                    if let Some(v) = eval_value(e, suffix, quantized) {
                        cols.entry(col).or_default().push(v);
                    }
                }
                for (col, e) in [("meank0_roll", first), ("meank_roll", last)] {
                    if let Some((_, v)) = e.as_object().and_then(|o| {
                        o.iter()
                            .filter(|(k, _)| k.contains("/mean@"))
                            .min_by_key(|(k, _)| k.starts_with("eval/f32/"))
                    }) {
                        if let Some(v) = v.as_f64() {
                            cols.entry(col).or_default().push(v);
                        }
                    }
                }
            }
            let rl: Vec<&serde_json::Value> = rows.iter().filter(|r| r["phase"] == "rl").collect();
            let avg = |key: &str| -> f64 {
                let xs: Vec<f64> = rl.iter().filter_map(|r| r[key].as_f64()).collect();
                xs.iter().sum::<f64>() / xs.len().max(1) as f64
            };
            cols.entry("k3")
                .or_default()
                .push(avg("rollout_corr/k3_kl"));
            cols.entry("err")
                .or_default()
                .push(avg("error_tokens/frac"));
            cols.entry("ent").or_default().push(avg("actor/entropy"));
            cols.entry("tps")
                .or_default()
                .push(avg("perf/rollout_tokens_per_s"));
            cols.entry("step").or_default().push(avg("perf/step_s"));
        }
        let f = |k: &str, prec: usize| -> String {
            match cols.get(k) {
                Some(xs) if !xs.is_empty() => {
                    let (m, s) = mean_std(xs);
                    if prec == 99 {
                        format!("{m:.2e} ± {s:.1e}")
                    } else {
                        format!("{m:.prec$} ± {s:.prec$}")
                    }
                }
                _ => "-".into(),
            }
        };
        let gain = super::paired::PairedComparison::new(&pooled_before, &pooled_after)
            .map_or("-".into(), |p| {
                format!("{:+.3} ± {:.3} (p {:.1e})", p.diff(), p.diff_se, p.p_value)
            });
        writeln!(
            md,
            "| {} | {done}/{} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            v.name,
            exp.seeds.len(),
            f("acc0_roll", 3),
            f("acc_roll", 3),
            gain,
            f("acc_f32", 3),
            f("meank0_roll", 3),
            f("meank_roll", 3),
            f("k3", 99),
            f("err", 3),
            f("ent", 3),
            f("tps", 0),
            f("step", 2)
        )?;
    }
    let finished: Vec<(String, Vec<Vec<serde_json::Value>>)> = exp
        .variants
        .iter()
        .map(|v| {
            let runs = exp
                .seeds
                .iter()
                .map(|seed| results.join(&v.name).join(format!("seed{seed}")))
                .filter(|d| marker(d).is_file())
                .map(|d| read_rows(&d.join("metrics.jsonl")))
                .collect();
            (v.name.clone(), runs)
        })
        .collect();
    match super::plot::plot_comparison(&results.join("comparison.png"), &finished) {
        Ok(()) => writeln!(
            md,
            "\n![reward, accuracy, k3 KL, entropy and error tokens per RL step, mean over seeds](comparison.png)\n"
        )?,
        Err(e) => writeln!(md, "\n(comparison plot not drawn: {e:#})\n")?,
    }
    writeln!(
        md,
        "\nPer-run plots (reward, held-out accuracy, k3 KL, entropy, error tokens, step time):\n"
    )?;
    for v in &exp.variants {
        for &seed in &exp.seeds {
            let run_dir = results.join(&v.name).join(format!("seed{seed}"));
            if marker(&run_dir).is_file() && super::plot::plot_run(&run_dir).is_ok() {
                writeln!(
                    md,
                    "- `{}` seed {seed}: ![]({}/seed{seed}/plots.png)",
                    v.name, v.name
                )?;
            }
        }
    }
    writeln!(md, "\nVariants:\n")?;
    for v in &exp.variants {
        writeln!(md, "- `{}`: {} {:?}", v.name, v.about, v.set)?;
    }
    let path = results.join("report.md");
    std::fs::write(&path, md)?;
    Ok(path)
}
