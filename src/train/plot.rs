//! `qarl plot RUN_DIR`: the run's metrics as one PNG (reward, held-out accuracy, mismatch KL, entropy,
//! error tokens, step time against the RL step), so a run can be judged at a glance.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use plotters::prelude::*;

use crate::rl::metrics::names;

/// Fonts looked for, in order (`QARL_FONT` first). Text needs a TrueType font; none is embedded.
const FONT_CANDIDATES: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/Library/Fonts/Arial.ttf",
    "C:\\Windows\\Fonts\\arial.ttf",
];

/// Registers a TrueType font for chart text; the error says how to provide one.
pub fn register_font() -> anyhow::Result<()> {
    let env = std::env::var("QARL_FONT").ok();
    // A font asked for by name and not there is an error, not a silent fall-back to another font.
    if let Some(asked) = env.as_deref().filter(|p| !Path::new(p).is_file()) {
        anyhow::bail!("QARL_FONT={asked}: no such file");
    }
    let path = env
        .iter()
        .map(String::as_str)
        .chain(FONT_CANDIDATES.iter().copied())
        .find(|p| Path::new(p).is_file())
        .context("no TrueType font found for plot text: install fonts-dejavu-core or set QARL_FONT=/path/to/font.ttf")?;
    let bytes: &'static [u8] = Box::leak(std::fs::read(path)?.into_boxed_slice());
    plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
        .map_err(|_| anyhow::anyhow!("{path}: not a usable TrueType font"))?;
    Ok(())
}

/// `(step, value)` points.
type Series = Vec<(f64, f64)>;
/// A panel: its title and its named lines.
type Panel<'a> = (&'a str, Vec<(String, Series)>);

/// `(step, value)` series of `key` among the rows of `phase`.
fn series(rows: &[serde_json::Value], phase: &str, key: &str) -> Series {
    rows.iter()
        .filter(|r| r["phase"] == phase)
        .filter_map(|r| Some((r["step"].as_f64()?, r[key].as_f64()?)))
        .filter(|(_, v)| v.is_finite())
        .collect()
}

/// The key of the union of the error-token criteria in `rows`: `error_tokens/any_frac`, or in logs written
/// before the criteria were reported apart, its old name `error_tokens/frac` (the same quantity).
pub fn any_error_key(rows: &[serde_json::Value]) -> String {
    let has = |k: &str| rows.iter().any(|r| r.get(k).is_some());
    if !has(names::ANY_ERROR_FRAC) && has(names::LEGACY_ERROR_TOKEN_FRAC) {
        names::LEGACY_ERROR_TOKEN_FRAC.to_string()
    } else {
        names::ANY_ERROR_FRAC.to_string()
    }
}

/// The error-token lines of a run's panel: the union and each criterion apart (legend label, key). An old
/// log has only the union: its `low_prob_frac` mixed two criteria, so it is not drawn under the new name.
fn error_token_series(rows: &[serde_json::Value]) -> Vec<(&'static str, String)> {
    let any = any_error_key(rows);
    if any == names::LEGACY_ERROR_TOKEN_FRAC {
        return vec![("any (old log)", any)];
    }
    vec![
        ("any", any),
        ("ratio", names::RATIO_FRAC.to_string()),
        ("low prob", names::LOW_PROB_FRAC.to_string()),
        ("repetition", names::REPETITION_FRAC.to_string()),
    ]
}

/// Where [`plot_run`] draws a run's plots.
pub fn run_plots(run_dir: &Path) -> PathBuf {
    run_dir.join("plots.png")
}

/// [`plot_run`] where `plots.png` is missing: a finished run's plots are drawn once, not again at every
/// report (their bytes differ between builds, so a committed study's plots changed with nothing in them
/// changed). A run that takes more steps removes its plots first ([`crate::train::run`]), so one that is
/// there is of the run as it is; `qarl plot` redraws.
pub fn plot_run_if_missing(run_dir: &Path) -> anyhow::Result<PathBuf> {
    let out = run_plots(run_dir);
    if out.is_file() {
        return Ok(out);
    }
    plot_run(run_dir)
}

/// Renders `run_dir/metrics.jsonl` to `run_dir/plots.png`; returns the path.
pub fn plot_run(run_dir: &Path) -> anyhow::Result<PathBuf> {
    let metrics = run_dir.join("metrics.jsonl");
    let rows = super::metrics::read_rows(&metrics, super::metrics::BadLines::TornLastOnly)?;
    if !rows.iter().any(|r| r["phase"] == "rl") {
        bail!("{}: no RL steps logged yet", metrics.display());
    }
    register_font()?;
    let eval_keys: Vec<String> = rows
        .iter()
        .filter(|r| r["phase"] == "eval")
        .flat_map(|r| r.as_object().into_iter().flatten().map(|(k, _)| k.clone()))
        .filter(|k| k.contains("pass@1") || k.contains("mean@"))
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    let mut panels: Vec<Panel> = vec![
        (
            "reward (mean)",
            vec![("rl".into(), series(&rows, "rl", "critic/rewards/mean"))],
        ),
        (
            "held-out accuracy",
            eval_keys
                .iter()
                .map(|k| {
                    (
                        k.trim_start_matches("eval/").to_string(),
                        series(&rows, "eval", k),
                    )
                })
                .collect(),
        ),
        (
            "rollout_corr/k3_kl (log10; an exact 0 at -30)",
            vec![(
                "k3".into(),
                series(&rows, "rl", "rollout_corr/k3_kl")
                    .into_iter()
                    .map(|(s, v)| (s, v.abs().max(1e-30).log10()))
                    .collect(),
            )],
        ),
        (
            "actor/entropy",
            vec![("entropy".into(), series(&rows, "rl", "actor/entropy"))],
        ),
        (
            "error_tokens/*_frac",
            error_token_series(&rows)
                .into_iter()
                .map(|(label, key)| (label.to_string(), series(&rows, "rl", &key)))
                .collect(),
        ),
        (
            "response_length/mean",
            vec![("tokens".into(), series(&rows, "rl", "response_length/mean"))],
        ),
        (
            "clip fractions",
            vec![
                (
                    "pg_clipfrac".into(),
                    series(&rows, "rl", "actor/pg_clipfrac"),
                ),
                (
                    "pg_clipfrac_lower".into(),
                    series(&rows, "rl", "actor/pg_clipfrac_lower"),
                ),
            ],
        ),
        (
            "mismatch / TIS weights, sequence ratios",
            vec![
                (
                    "mismatch_weight_mean".into(),
                    series(&rows, "rl", "actor/mismatch_weight_mean"),
                ),
                (
                    "seq_ratio_mean".into(),
                    series(&rows, "rl", "actor/seq_ratio_mean"),
                ),
            ],
        ),
        (
            "perf/step_s",
            vec![("step s".into(), series(&rows, "rl", "perf/step_s"))],
        ),
    ];
    // The warm start's loss, where the run made its model (its steps count SFT steps, not RL steps).
    let sft_loss = series(&rows, "sft", "sft/loss");
    if !sft_loss.is_empty() {
        panels.push((
            "sft/loss (warm start; SFT steps)",
            vec![("loss".into(), sft_loss)],
        ));
    }
    let out = run_plots(run_dir);
    draw_panels(&out, &panels)?;
    Ok(out)
}

/// Whether a point can be drawn.
fn finite(p: &(f64, f64)) -> bool {
    p.0.is_finite() && p.1.is_finite()
}

/// Draws the panels two per row, 300 pixels high each, to `out` (PNG). A panel with no finite point (a
/// metric no run logged, such as the error-token criteria of logs older than them) takes no place: it left
/// a blank in the grid.
fn draw_panels(out: &Path, panels: &[Panel]) -> anyhow::Result<()> {
    // Named here: the drawing library reports a folder in the way as a nested debug-printed I/O error.
    crate::io::check_output_file(out)?;
    let panels: Vec<&Panel> = panels
        .iter()
        .filter(|(_, lines)| lines.iter().any(|(_, s)| s.iter().any(finite)))
        .collect();
    // Drawn beside `out` and moved over it whole: a plot stopped half-way never replaces the last one.
    let tmp = crate::io::temp_file_for(out)?;
    {
        let rows = panels.len().div_ceil(2).max(1);
        let root = BitMapBackend::new(tmp.path(), (1200, 300 * rows as u32)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| anyhow::anyhow!("{e}"))?;
        let areas = root.split_evenly((rows, 2));
        for (area, &(title, lines)) in areas.iter().zip(&panels) {
            let pts: Vec<&(f64, f64)> = lines
                .iter()
                .flat_map(|(_, s)| s.iter())
                .filter(|p| finite(p))
                .collect();
            if pts.is_empty() {
                continue;
            }
            let (x0, x1) = pts
                .iter()
                .fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(p.0), b.max(p.0)));
            let (y0, y1) = pts
                .iter()
                .fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(p.1), b.max(p.1)));
            // A flat series (k3 KL exactly 0 every step, drawn as log10 = -30) still gets a readable axis.
            let span = y1 - y0;
            let pad = if span > 1e-9 * (1.0 + y0.abs().max(y1.abs())) {
                span * 0.05
            } else {
                (y0.abs() * 0.05).max(0.5)
            };
            // Values that span more than an f64 (steps or rewards of +-1e308 in a damaged log) would make
            // the axis infinite, and the chart library loop forever placing its ticks.
            if !((x1 - x0).is_finite() && (y1 - y0 + 2.0 * pad).is_finite()) {
                tracing::warn!(
                    panel = *title,
                    "its values span beyond what can be plotted ({y0:e} to {y1:e} over steps {x0:e} to \
                     {x1:e}); the panel is left empty"
                );
                continue;
            }
            let mut chart = ChartBuilder::on(area)
                .caption(*title, ("sans-serif", 20))
                .margin(10)
                .x_label_area_size(30)
                .y_label_area_size(60)
                .build_cartesian_2d(x0..x1.max(x0 + 1.0), (y0 - pad)..(y1 + pad))
                .map_err(|e| anyhow::anyhow!("{e}"))?;
            chart
                .configure_mesh()
                .x_desc("step")
                // Steps are whole numbers, which the axis would print as 10.0 (over a few steps its
                // ticks fall between them: two decimals at most, not 0.30000000000000004).
                .x_label_formatter(&|x| {
                    if x1 - x0 >= 10.0 {
                        format!("{x:.0}")
                    } else {
                        let t = format!("{x:.2}");
                        t.trim_end_matches('0').trim_end_matches('.').to_string()
                    }
                })
                .draw()
                .map_err(|e| anyhow::anyhow!("{e}"))?;
            for (i, (name, s)) in lines.iter().enumerate() {
                let color = Palette99::pick(i).to_rgba();
                chart
                    .draw_series(LineSeries::new(
                        s.iter().copied().filter(finite),
                        color.stroke_width(2),
                    ))
                    .map_err(|e| anyhow::anyhow!("{e}"))?
                    .label(name.clone())
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 15, y)], color));
                // A line needs two points: a run of one step shows its one as a dot.
                if s.iter().filter(|p| finite(p)).count() == 1 {
                    chart
                        .draw_series(
                            s.iter()
                                .copied()
                                .filter(finite)
                                .map(|p| Circle::new(p, 4, color.filled())),
                        )
                        .map_err(|e| anyhow::anyhow!("{e}"))?;
                }
            }
            if lines.len() > 1 {
                chart
                    .configure_series_labels()
                    .background_style(WHITE.mix(0.8))
                    .border_style(BLACK)
                    .draw()
                    .map_err(|e| anyhow::anyhow!("{e}"))?;
            }
        }
        root.present()
            .map_err(|e| anyhow::anyhow!("{}: {e}", out.display()))?;
    }
    crate::io::set_usual_permissions(tmp.path());
    tmp.persist(out)
        .map_err(|e| crate::io::failed(out, "cannot move into place")(e.error))?;
    Ok(())
}

/// Mean over runs of `key` at each step all runs logged (seeds of one variant).
fn mean_series(runs: &[Vec<serde_json::Value>], phase: &str, key: &str) -> Series {
    let all: Vec<Series> = runs.iter().map(|r| series(r, phase, key)).collect();
    let Some(first) = all.first() else {
        return Vec::new();
    };
    first
        .iter()
        .filter_map(|&(step, _)| {
            let vals: Vec<f64> = all
                .iter()
                .filter_map(|s| s.iter().find(|p| p.0 == step).map(|p| p.1))
                .collect();
            (vals.len() == all.len()).then(|| (step, vals.iter().sum::<f64>() / vals.len() as f64))
        })
        .collect()
}

/// One PNG comparing variants (each line the mean over that variant's seeds): reward, held-out accuracy in
/// the rollout precision and in f32, k3 KL, entropy, error tokens. `variants` pairs a name with the metric
/// rows of each of its runs.
pub fn plot_comparison(
    out: &Path,
    variants: &[(String, Vec<Vec<serde_json::Value>>)],
) -> anyhow::Result<()> {
    if variants.iter().all(|(_, runs)| runs.is_empty()) {
        bail!("no finished runs to plot");
    }
    register_font()?;
    // The rollout precision's greedy accuracy key of a run: `eval/<precision>/pass@1_greedy`, f32 last.
    let acc_key = |runs: &[Vec<serde_json::Value>], f32_view: bool| -> Option<String> {
        let eval = runs.first()?.iter().find(|r| r["phase"] == "eval")?;
        let keys: Vec<&String> = eval
            .as_object()?
            .keys()
            .filter(|k| k.ends_with("/pass@1_greedy"))
            .collect();
        keys.iter()
            .find(|k| k.starts_with("eval/f32/") == f32_view)
            .or(keys.first())
            .map(|k| k.to_string())
    };
    let per_variant =
        |phase: &str, key: &dyn Fn(&[Vec<serde_json::Value>]) -> Option<String>, log10: bool| {
            variants
                .iter()
                .filter(|(_, runs)| !runs.is_empty())
                .filter_map(|(name, runs)| {
                    let k = key(runs)?;
                    let s = mean_series(runs, phase, &k);
                    let s = if log10 {
                        s.into_iter()
                            .map(|(x, v)| (x, v.abs().max(1e-30).log10()))
                            .collect()
                    } else {
                        s
                    };
                    Some((name.clone(), s))
                })
                .collect::<Vec<_>>()
        };
    let fixed = |k: &'static str| move |_: &[Vec<serde_json::Value>]| Some(k.to_string());
    let panels: Vec<Panel> = vec![
        (
            "reward (mean)",
            per_variant("rl", &fixed("critic/rewards/mean"), false),
        ),
        (
            "held-out greedy accuracy, rollout precision",
            per_variant("eval", &|r| acc_key(r, false), false),
        ),
        (
            "held-out greedy accuracy, f32",
            per_variant("eval", &|r| acc_key(r, true), false),
        ),
        (
            "rollout_corr/k3_kl (log10)",
            per_variant("rl", &fixed("rollout_corr/k3_kl"), true),
        ),
        (
            "actor/entropy",
            per_variant("rl", &fixed("actor/entropy"), false),
        ),
        (
            "error_tokens/any_frac",
            per_variant("rl", &|r| Some(any_error_key(r.first()?)), false),
        ),
        (
            "error_tokens/ratio_frac",
            per_variant("rl", &fixed(names::RATIO_FRAC), false),
        ),
        (
            "error_tokens/low_prob_frac",
            // Old logs' `low_prob_frac` also counted ratio errors: not drawn under the new meaning.
            per_variant(
                "rl",
                &|r| {
                    (any_error_key(r.first()?) == names::ANY_ERROR_FRAC)
                        .then(|| names::LOW_PROB_FRAC.to_string())
                },
                false,
            ),
        ),
        (
            "error_tokens/repetition_frac",
            per_variant("rl", &fixed(names::REPETITION_FRAC), false),
        ),
        (
            "response_length/mean",
            per_variant("rl", &fixed("response_length/mean"), false),
        ),
        (
            "actor/pg_clipfrac",
            per_variant("rl", &fixed("actor/pg_clipfrac"), false),
        ),
        (
            "actor/mismatch_weight_mean (correction weights x TBPO w)",
            per_variant("rl", &fixed("actor/mismatch_weight_mean"), false),
        ),
        (
            "perf/step_s",
            per_variant("rl", &fixed("perf/step_s"), false),
        ),
    ];
    draw_panels(out, &panels)
}
