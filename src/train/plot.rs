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

/// `(step, value)` series of `key` among the rows of `phase`; a row without a finite value (a step that
/// logged no update, a NaN written as null) is a NaN point, where a drawn line breaks.
fn series(rows: &[serde_json::Value], phase: &str, key: &str) -> Series {
    rows.iter()
        .filter(|r| r["phase"] == phase)
        .filter_map(|r| {
            let step = r["step"].as_f64()?;
            Some((step, r[key].as_f64().unwrap_or(f64::NAN)))
        })
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

/// The k3 panel's title: its values are drawn as log10, an exact 0 (deterministic mode) at -30.
const K3_TITLE: &str = "rollout_corr/k3_kl (log10; an exact 0 at -30)";

/// The warm start's loss panel, whose steps are SFT steps: it keeps its own step axis.
const SFT_TITLE: &str = "sft/loss (warm start; SFT steps)";

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
            K3_TITLE,
            vec![(
                "k3".into(),
                series(&rows, "rl", "rollout_corr/k3_kl")
                    .into_iter()
                    .map(|(s, v)| (s, log10_with_zero_at_minus_30(v)))
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
        panels.push((SFT_TITLE, vec![("loss".into(), sft_loss)]));
    }
    let out = run_plots(run_dir);
    draw_panels(&out, &panels, None)?;
    Ok(out)
}

/// A panel title's font size: 20, smaller where a long title (names listed in it) would run past its
/// panel's 600 pixels (a character is about half the size wide).
fn caption_size(title: &str) -> f64 {
    (1100.0 / title.chars().count().max(1) as f64).clamp(11.0, 20.0)
}

/// Entries per row of a figure's shared legend: 3, fewer where the longest name would run into the next
/// column (a 16-point character is about 9 pixels wide; the entry's line and gap take 60).
fn legend_columns(names: &[String]) -> usize {
    let longest = names.iter().map(|n| n.chars().count()).max().unwrap_or(0);
    (1160 / (60 + 9 * longest)).clamp(1, 3)
}

/// The height in pixels of a shared legend of `names`.
fn legend_strip_height(names: &[String]) -> u32 {
    16 + 24 * names.len().div_ceil(legend_columns(names)).max(1) as u32
}

/// One legend above every panel, for figures whose panels draw the same lines (the variants of a
/// comparison, each in the colour of its index): a legend inside each panel covered the curves' ends.
fn draw_legend_strip<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    names: &[String],
) -> anyhow::Result<()> {
    let (width, _) = area.dim_in_pixel();
    let columns = legend_columns(names);
    let column = (width as usize / columns) as i32;
    for (i, name) in names.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let x = 20 + column * (i % columns) as i32;
        let y = 24 + 24 * (i / columns) as i32;
        area.draw(&PathElement::new(
            vec![(x, y), (x + 30, y)],
            color.stroke_width(3),
        ))
        .map_err(|e| anyhow::anyhow!("{e}"))?;
        area.draw(&Text::new(
            name.clone(),
            (x + 38, y - 8),
            ("sans-serif", 16),
        ))
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    }
    Ok(())
}

/// The smallest and largest step of the panels' finite points (`None` without one).
fn step_range<'a>(panels: impl Iterator<Item = &'a [(String, Series)]>) -> Option<(f64, f64)> {
    let mut range: Option<(f64, f64)> = None;
    for lines in panels {
        for p in lines
            .iter()
            .flat_map(|(_, s)| s.iter())
            .filter(|p| finite(p))
        {
            let (a, b) = range.get_or_insert((p.0, p.0));
            (*a, *b) = (a.min(p.0), b.max(p.0));
        }
    }
    range
}

/// A series' finite points in pieces that a line may join: it breaks at a point without a value (a row of
/// the phase that did not log the metric: a step without an update logs no loss-side metric), so that a
/// line never draws values between two steps across one that measured nothing. Irregular spacing (the
/// final evaluation at `train.steps` after every `eval.every`) is no gap.
fn unbroken_pieces(s: &Series) -> Vec<Series> {
    let mut pieces: Vec<Series> = Vec::new();
    let mut broken = true;
    for &p in s {
        if !finite(&p) {
            broken = true;
            continue;
        }
        match pieces.last_mut() {
            Some(piece) if !broken => piece.push(p),
            _ => pieces.push(vec![p]),
        }
        broken = false;
    }
    pieces
}

/// Where a panel's legend goes, and how high its value axis must reach for the legend to cover no line.
#[derive(Debug, Clone, Copy)]
struct LegendPlace {
    corner: Corner,
    /// The top of the value axis: the data's own top, or above it where every corner held a line.
    y_top: f64,
}

/// A corner of a panel's plot area (plotters' own position type is neither `Copy` nor comparable).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Corner {
    UpperLeft,
    UpperRight,
    LowerLeft,
    LowerRight,
}

impl Corner {
    fn position(self) -> SeriesLabelPosition {
        match self {
            Corner::UpperLeft => SeriesLabelPosition::UpperLeft,
            Corner::UpperRight => SeriesLabelPosition::UpperRight,
            Corner::LowerLeft => SeriesLabelPosition::LowerLeft,
            Corner::LowerRight => SeriesLabelPosition::LowerRight,
        }
    }
}

/// The share of a panel's plot area (width, height) that its legend of `names` takes: about 7 pixels
/// a character of the 12-point label and 40 for the line sample and border, 16 a row, on a plot area of
/// about 520 x 220 pixels (a 600 x 300 panel less its caption, tick labels and margins).
fn legend_box_share(names: &[&str]) -> (f64, f64) {
    let longest = names.iter().map(|n| n.chars().count()).max().unwrap_or(0);
    let width = (40.0 + 7.0 * longest as f64) / 520.0;
    let height = (12.0 + 16.0 * names.len() as f64) / 220.0;
    (width.min(1.0), height.min(1.0))
}

/// Points along every drawn segment of `lines`, as shares of the plot area (0 to 1 each way): a line
/// between two sparse points (the evaluations every 20 steps) crosses a corner that holds none of its
/// points, and the legend was put over it.
fn traced_shares(
    lines: &[(String, Series)],
    (x0, x1): (f64, f64),
    (y0, y1): (f64, f64),
) -> Vec<(f64, f64)> {
    const STEPS_PER_SEGMENT: usize = 32;
    let share = |p: (f64, f64)| {
        (
            (p.0 - x0) / (x1 - x0).max(f64::MIN_POSITIVE),
            (p.1 - y0) / (y1 - y0).max(f64::MIN_POSITIVE),
        )
    };
    let mut out = Vec::new();
    for piece in lines.iter().flat_map(|(_, s)| unbroken_pieces(s)) {
        out.extend(piece.first().map(|&p| share(p)));
        for w in piece.windows(2) {
            let (a, b) = (share(w[0]), share(w[1]));
            out.extend((1..=STEPS_PER_SEGMENT).map(|k| {
                let t = k as f64 / STEPS_PER_SEGMENT as f64;
                (a.0 + t * (b.0 - a.0), a.1 + t * (b.1 - a.1))
            }));
        }
    }
    out
}

/// The legend's place: the first corner (upper left, upper right, lower left, lower right) whose
/// legend-sized box no line crosses; where every corner is crossed, the value axis is raised until the
/// lines stay below the legend's height and the legend takes the upper left (a legend in the least
/// crowded corner still hid a curve). A legend taller than half the plot is not given that much room: it
/// takes the least crowded corner.
fn legend_place(
    lines: &[(String, Series)],
    x: (f64, f64),
    (y0, y1): (f64, f64),
    (width, height): (f64, f64),
) -> LegendPlace {
    // A little room between the box and a line that passes just outside it.
    const GAP: f64 = 0.03;
    let corners = [
        (Corner::UpperLeft, false, true),
        (Corner::UpperRight, true, true),
        (Corner::LowerLeft, false, false),
        (Corner::LowerRight, true, false),
    ];
    let shares = traced_shares(lines, x, (y0, y1));
    let crossings = |right: bool, upper: bool| {
        shares
            .iter()
            .filter(|p| {
                (if right {
                    p.0 >= 1.0 - width - GAP
                } else {
                    p.0 <= width + GAP
                }) && (if upper {
                    p.1 >= 1.0 - height - GAP
                } else {
                    p.1 <= height + GAP
                })
            })
            .count()
    };
    let counted = corners.map(|(corner, right, upper)| (corner, crossings(right, upper)));
    let place = |corner| LegendPlace { corner, y_top: y1 };
    if let Some(&(corner, _)) = counted.iter().find(|c| c.1 == 0) {
        return place(corner);
    }
    if height + 2.0 * GAP <= 0.5 {
        return LegendPlace {
            corner: Corner::UpperLeft,
            y_top: y0 + (y1 - y0) / (1.0 - height - 2.0 * GAP),
        };
    }
    counted
        .into_iter()
        .min_by_key(|c| c.1)
        .map_or(place(Corner::UpperLeft), |c| place(c.0))
}

/// `log10 |v|`, an exact 0 at -30 (a run's k3 panel); a row without the metric stays NaN, a break in the
/// line (`NaN.max(1e-30)` is 1e-30: it was drawn as a 0).
fn log10_with_zero_at_minus_30(v: f64) -> f64 {
    if v.is_nan() {
        v
    } else {
        v.abs().max(1e-30).log10()
    }
}

/// Whether a point can be drawn.
fn finite(p: &(f64, f64)) -> bool {
    p.0.is_finite() && p.1.is_finite()
}

/// Draws the panels two per row, 300 pixels high each, to `out` (PNG). A panel with no finite point (a
/// metric no run logged, such as the error-token criteria of logs older than them) takes no place: it left
/// a blank in the grid.
fn draw_panels(
    out: &Path,
    panels: &[Panel],
    shared_legend: Option<&[String]>,
) -> anyhow::Result<()> {
    // Named here: the drawing library reports a folder in the way as a nested debug-printed I/O error.
    crate::io::check_output_file(out)?;
    let panels: Vec<&Panel> = panels
        .iter()
        .filter(|(_, lines)| lines.iter().any(|(_, s)| s.iter().any(finite)))
        .collect();
    // Drawn beside `out` and moved over it whole: a plot stopped half-way never replaces the last one.
    let tmp = crate::io::temp_file_for(out)?;
    let rows = panels.len().div_ceil(2).max(1);
    let legend_height = shared_legend.map_or(0, legend_strip_height);
    let size = (1200, 300 * rows as u32 + legend_height);
    let mut pixels = vec![0u8; 3 * size.0 as usize * size.1 as usize];
    {
        let root = BitMapBackend::with_buffer(&mut pixels, size).into_drawing_area();
        root.fill(&WHITE).map_err(|e| anyhow::anyhow!("{e}"))?;
        let (strip, grid) = root.split_vertically(legend_height);
        if let Some(names) = shared_legend {
            draw_legend_strip(&strip, names)?;
        }
        let areas = grid.split_evenly((rows, 2));
        // One step axis for every panel of RL steps and evaluations, so that panels read side by side
        // (each took its own: a metric without the last steps' values was drawn on a shorter axis).
        let steps = step_range(
            panels
                .iter()
                .filter(|p| p.0 != SFT_TITLE)
                .map(|p| p.1.as_slice()),
        );
        for (area, &(title, lines)) in areas.iter().zip(&panels) {
            let pts: Vec<&(f64, f64)> = lines
                .iter()
                .flat_map(|(_, s)| s.iter())
                .filter(|p| finite(p))
                .collect();
            if pts.is_empty() {
                continue;
            }
            let (x0, x1) = match steps {
                Some(range) if *title != SFT_TITLE => range,
                _ => step_range(std::iter::once(lines.as_slice())).unwrap_or((0.0, 1.0)),
            };
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
            let legend = (lines.len() > 1 && shared_legend.is_none()).then(|| {
                let names: Vec<&str> = lines.iter().map(|(n, _)| n.as_str()).collect();
                legend_place(
                    lines,
                    (x0, x1.max(x0 + 1.0)),
                    (y0 - pad, y1 + pad),
                    legend_box_share(&names),
                )
            });
            let y_top = legend.map_or(y1 + pad, |l| l.y_top);
            let mut chart = ChartBuilder::on(area)
                .caption(*title, ("sans-serif", caption_size(title)))
                .margin(10)
                .x_label_area_size(30)
                .y_label_area_size(60)
                .build_cartesian_2d(x0..x1.max(x0 + 1.0), (y0 - pad)..y_top)
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
                let pieces = unbroken_pieces(s);
                for (k, piece) in pieces.iter().enumerate() {
                    // A line needs two points: a piece of one step (a run of one step, a step between
                    // two gaps) shows as a dot.
                    if piece.len() == 1 {
                        chart
                            .draw_series(piece.iter().map(|&p| Circle::new(p, 4, color.filled())))
                            .map_err(|e| anyhow::anyhow!("{e}"))?;
                    }
                    let drawn = chart
                        .draw_series(LineSeries::new(
                            piece.iter().copied(),
                            color.stroke_width(2),
                        ))
                        .map_err(|e| anyhow::anyhow!("{e}"))?;
                    if k == 0 {
                        drawn.label(name.clone()).legend(move |(x, y)| {
                            PathElement::new(vec![(x, y), (x + 15, y)], color)
                        });
                    }
                }
            }
            if let Some(legend) = legend {
                chart
                    .configure_series_labels()
                    .position(legend.corner.position())
                    .background_style(WHITE.mix(0.8))
                    .border_style(BLACK)
                    .draw()
                    .map_err(|e| anyhow::anyhow!("{e}"))?;
            }
        }
        root.present()
            .map_err(|e| anyhow::anyhow!("{}: {e}", out.display()))?;
    }
    write_png(tmp.as_file(), &pixels, size)
        .map_err(crate::io::failed(tmp.path(), "cannot write"))?;
    crate::io::set_usual_permissions(tmp.path());
    tmp.persist(out)
        .map_err(|e| crate::io::failed(out, "cannot move into place")(e.error))?;
    Ok(())
}

/// Encodes RGB `pixels` of `size` as a PNG into `file` at the best deflate level with adaptive row
/// filters: a plot is mostly flat colour and thin lines, which the fastest level (plotters' own save)
/// stores in about 5x the bytes, and results are committed.
fn write_png(file: &std::fs::File, pixels: &[u8], size: (u32, u32)) -> std::io::Result<()> {
    use image::codecs::png::{CompressionType, FilterType, PngEncoder};
    use image::ImageEncoder;
    let mut writer = std::io::BufWriter::new(file);
    PngEncoder::new_with_quality(&mut writer, CompressionType::Best, FilterType::Adaptive)
        .write_image(pixels, size.0, size.1, image::ColorType::Rgb8)
        .map_err(std::io::Error::other)?;
    std::io::Write::flush(&mut writer)
}

/// Mean over runs (seeds of one variant) of `key` at each step, over the runs that logged it: a step only
/// some seeds logged (a step without an update under dynamic sampling logs no loss-side metric) is the
/// mean of those, not dropped (keeping only the steps every seed logged drew one arm from 25 of its 40
/// steps, ending 6 steps early).
fn mean_series(runs: &[Vec<serde_json::Value>], phase: &str, key: &str) -> Series {
    let mut at_step: std::collections::BTreeMap<i64, (f64, f64, usize)> = Default::default();
    for run in runs {
        for (step, v) in series(run, phase, key) {
            let e = at_step.entry(step as i64).or_insert((step, 0.0, 0));
            if v.is_finite() {
                e.1 += v;
                e.2 += 1;
            }
        }
    }
    // A step no seed has a value at stays, as NaN: the line breaks there.
    at_step
        .into_values()
        .map(|(step, sum, n)| (step, if n > 0 { sum / n as f64 } else { f64::NAN }))
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
    // Every variant keeps its place in every panel (an empty line where it lacks the metric), so that
    // its colour is the one the shared legend gives it: a variant left out shifted the colours after it.
    let per_variant = |phase: &str, key: &dyn Fn(&[Vec<serde_json::Value>]) -> Option<String>| {
        variants
            .iter()
            .map(|(name, runs)| {
                let s = key(runs).map_or_else(Vec::new, |k| mean_series(runs, phase, &k));
                (name.clone(), s)
            })
            .collect::<Vec<_>>()
    };
    let fixed = |k: &'static str| move |_: &[Vec<serde_json::Value>]| Some(k.to_string());
    let (k3_title, k3_lines) = log10_of_nonzero(
        "rollout_corr/k3_kl",
        per_variant("rl", &fixed("rollout_corr/k3_kl")),
    );
    let panels: Vec<Panel> = vec![
        (
            "reward (mean)",
            per_variant("rl", &fixed("critic/rewards/mean")),
        ),
        (
            "held-out greedy accuracy, rollout precision",
            per_variant("eval", &|r| acc_key(r, false)),
        ),
        (
            "held-out greedy accuracy, f32",
            per_variant("eval", &|r| acc_key(r, true)),
        ),
        (&k3_title, k3_lines),
        ("actor/entropy", per_variant("rl", &fixed("actor/entropy"))),
        (
            "error_tokens/any_frac",
            per_variant("rl", &|r| Some(any_error_key(r.first()?))),
        ),
        (
            "error_tokens/ratio_frac",
            per_variant("rl", &fixed(names::RATIO_FRAC)),
        ),
        (
            "error_tokens/low_prob_frac",
            // Old logs' `low_prob_frac` also counted ratio errors: not drawn under the new meaning.
            per_variant("rl", &|r| {
                (any_error_key(r.first()?) == names::ANY_ERROR_FRAC)
                    .then(|| names::LOW_PROB_FRAC.to_string())
            }),
        ),
        (
            "error_tokens/repetition_frac",
            per_variant("rl", &fixed(names::REPETITION_FRAC)),
        ),
        (
            "response_length/mean",
            per_variant("rl", &fixed("response_length/mean")),
        ),
        (
            "actor/pg_clipfrac",
            per_variant("rl", &fixed("actor/pg_clipfrac")),
        ),
        (
            "actor/mismatch_weight_mean (correction weights x TBPO w)",
            per_variant("rl", &fixed("actor/mismatch_weight_mean")),
        ),
        ("perf/step_s", per_variant("rl", &fixed("perf/step_s"))),
    ];
    let names: Vec<String> = variants
        .iter()
        .map(|(n, runs)| legend_name(n, runs.len()))
        .collect();
    draw_panels(out, &panels, Some(&names))
}

/// `lines` as log10 with exact zeros left out, and a title for them that names the lines that were 0 at
/// every step (deterministic mode's k3): drawn at a floor of -30 they stretched the axis until the other
/// lines' sixfold changes looked flat.
fn log10_of_nonzero(metric: &str, lines: Vec<(String, Series)>) -> (String, Vec<(String, Series)>) {
    let zero: Vec<&str> = lines
        .iter()
        .filter(|(_, s)| s.iter().any(finite) && s.iter().filter(|p| finite(p)).all(|p| p.1 == 0.0))
        .map(|(name, _)| name.as_str())
        .collect();
    // Every line 0 at every step (all arms aligned): the panel says so with its lines at -30, rather than
    // vanish as a panel with nothing to draw.
    if !zero.is_empty()
        && lines
            .iter()
            .all(|(_, s)| s.iter().filter(|p| finite(p)).all(|p| p.1 == 0.0))
    {
        let title = format!("{metric} (log10; exactly 0 at every step, drawn at -30)");
        let floor = lines
            .into_iter()
            .map(|(name, s)| {
                let floor = s
                    .into_iter()
                    .map(|(x, v)| (x, if v.is_finite() { -30.0 } else { v }));
                (name, floor.collect())
            })
            .collect();
        return (title, floor);
    }
    let title = match zero.join(", ") {
        names if names.is_empty() => format!("{metric} (log10)"),
        // As many names as a panel's title holds at a readable size; beyond, how many.
        names if names.chars().count() <= 90 => format!("{metric} (log10); exactly 0: {names}"),
        _ => format!("{metric} (log10); exactly 0: {} variants", zero.len()),
    };
    let lines = lines
        .into_iter()
        .map(|(name, s)| {
            let s = s
                .into_iter()
                .map(|(x, v)| (x, if v == 0.0 { f64::NAN } else { v.abs().log10() }))
                .collect();
            (name, s)
        })
        .collect();
    (title, lines)
}

/// A variant's name in a comparison's legend, with the seeds its lines average.
fn legend_name(name: &str, seeds: usize) -> String {
    match seeds {
        0 => format!("{name} (no finished run)"),
        1 => format!("{name} (1 seed)"),
        n => format!("{name} ({n} seeds)"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(phase: &str, points: &[(u32, f64)]) -> Vec<serde_json::Value> {
        points
            .iter()
            .map(|&(step, v)| serde_json::json!({"phase": phase, "step": step, "k": v}))
            .collect()
    }

    /// A step some seeds did not log is the mean of those that did (it was dropped, and the line joined
    /// the steps around it).
    /// The PNG a plot is written as decodes to the pixels drawn, at the best deflate level: smaller
    /// than plotters' own fast save of the same picture.
    #[test]
    fn plots_are_written_as_lossless_compact_pngs() {
        let size = (120u32, 90u32);
        let mut pixels = vec![255u8; 3 * 120 * 90];
        for x in 0..120usize {
            let y = 20 + (x * 7) % 50;
            pixels[3 * (y * 120 + x)..][..3].copy_from_slice(&[200, 30, (x * 2) as u8]);
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.png");
        write_png(&std::fs::File::create(&path).unwrap(), &pixels, size).unwrap();
        let decoded = image::open(&path).unwrap().to_rgb8();
        assert_eq!(decoded.dimensions(), size);
        assert_eq!(decoded.into_raw(), pixels);
        let fast = dir.path().join("fast.png");
        image::save_buffer(&fast, &pixels, size.0, size.1, image::ColorType::Rgb8).unwrap();
        let len = |p: &Path| std::fs::metadata(p).unwrap().len();
        assert!(
            len(&path) < len(&fast),
            "{} vs {} bytes",
            len(&path),
            len(&fast)
        );
    }

    #[test]
    fn mean_series_averages_the_seeds_that_logged_each_step() {
        let a = rows("rl", &[(0, 1.0), (1, 2.0), (2, 3.0)]);
        let b = rows("rl", &[(0, 3.0), (2, 5.0)]);
        assert_eq!(
            mean_series(&[a, b], "rl", "k"),
            vec![(0.0, 2.0), (1.0, 2.0), (2.0, 4.0)]
        );
        assert!(mean_series(&[], "rl", "k").is_empty());
    }

    /// Exact zeros leave a log panel and name their lines in its title; where every line is 0 the panel
    /// stays, its lines at -30.
    #[test]
    fn log_panels_name_the_lines_that_are_exactly_zero() {
        let line = |name: &str, vs: &[f64]| {
            let s: Series = vs.iter().enumerate().map(|(i, &v)| (i as f64, v)).collect();
            (name.to_string(), s)
        };
        let (title, lines) = log10_of_nonzero(
            "k3",
            vec![line("a", &[0.0, 0.0]), line("b", &[1e-3, 0.0, 1e-2])],
        );
        assert_eq!(title, "k3 (log10); exactly 0: a");
        assert!(lines[0].1.iter().all(|p| !finite(p)));
        let drawn: Series = lines[1].1.iter().copied().filter(finite).collect();
        assert_eq!(drawn, vec![(0.0, -3.0), (2.0, -2.0)]);
        let (title, lines) = log10_of_nonzero("k3", vec![line("a", &[0.0, 0.0])]);
        assert!(title.contains("exactly 0 at every step"), "{title}");
        assert_eq!(lines[0].1, vec![(0.0, -30.0), (1.0, -30.0)]);
    }

    /// Lines break at a row without the metric (a step that logged no update), not at irregular spacing
    /// (the final evaluation at `train.steps` after every `eval.every`: an even spacing rule broke every
    /// regular gap into dots).
    #[test]
    fn lines_break_where_a_row_lacks_the_metric() {
        let mut rl = rows("rl", &[(0, 1.0), (1, 1.0), (3, 1.0), (6, 1.0), (7, 1.0)]);
        rl.insert(2, serde_json::json!({"phase": "rl", "step": 2}));
        rl.insert(4, serde_json::json!({"phase": "rl", "step": 4, "k": null}));
        let s = series(&rl, "rl", "k");
        assert_eq!(s.len(), 7);
        let steps = |pieces: Vec<Series>| -> Vec<Vec<f64>> {
            pieces
                .iter()
                .map(|p| p.iter().map(|q| q.0).collect())
                .collect()
        };
        assert_eq!(
            steps(unbroken_pieces(&s)),
            vec![vec![0.0, 1.0], vec![3.0], vec![6.0, 7.0]]
        );
        let evals = series(&rows("eval", &[(0, 0.5), (2, 0.6), (3, 0.7)]), "eval", "k");
        assert_eq!(steps(unbroken_pieces(&evals)), vec![vec![0.0, 2.0, 3.0]]);
        // Over seeds: a step where no seed has a value breaks the mean's line too.
        let mut a = rows("rl", &[(0, 1.0), (2, 3.0)]);
        a.insert(1, serde_json::json!({"phase": "rl", "step": 1}));
        let mean = mean_series(&[a], "rl", "k");
        assert_eq!(steps(unbroken_pieces(&mean)), vec![vec![0.0], vec![2.0]]);
    }

    #[test]
    fn a_missing_k3_is_no_zero() {
        assert!(log10_with_zero_at_minus_30(f64::NAN).is_nan());
        assert_eq!(log10_with_zero_at_minus_30(0.0), -30.0);
        assert_eq!(log10_with_zero_at_minus_30(1e-3), -3.0);
    }

    /// A shared legend takes fewer columns where names are long (60-character names overprinted each
    /// other in three).
    #[test]
    fn long_variant_names_take_fewer_legend_columns() {
        let names = |len: usize| vec!["x".repeat(len); 4];
        assert_eq!(legend_columns(&names(29)), 3);
        assert_eq!(legend_columns(&names(60)), 1);
        assert_eq!(legend_strip_height(&names(60)), 16 + 24 * 4);
        assert_eq!(legend_columns(&[]), 3);
    }

    /// A line as a named series of `(step, value)` points.
    fn line(points: &[(i32, f64)]) -> (String, Series) {
        let s = points.iter().map(|&(x, y)| (f64::from(x), y)).collect();
        ("line".to_string(), s)
    }

    /// The legend goes where the curves are not: rising curves leave the upper left and lower right
    /// free, and of those the first in the order is taken; curves ending high on the right never get it
    /// there. The axis keeps the data's top.
    #[test]
    fn the_legend_takes_a_corner_no_line_crosses() {
        let small = (0.3, 0.3);
        let rising = line(&(0..=10).map(|i| (i, f64::from(i))).collect::<Vec<_>>());
        let place = legend_place(&[rising], (0.0, 10.0), (0.0, 10.0), small);
        assert_eq!(place.corner, Corner::UpperLeft);
        assert_eq!(place.y_top, 10.0);
        let falling = line(&(0..=10).map(|i| (i, f64::from(10 - i))).collect::<Vec<_>>());
        let place = legend_place(&[falling], (0.0, 10.0), (0.0, 10.0), small);
        assert_eq!(place.corner, Corner::UpperRight);
        // Flat lines at the top and through the middle-right: only the lower left is free.
        let top = line(&(0..=10).map(|i| (i, 10.0)).collect::<Vec<_>>());
        let right = line(&(6..=10).map(|i| (i, 0.0)).collect::<Vec<_>>());
        let place = legend_place(&[top, right], (0.0, 10.0), (0.0, 10.0), small);
        assert_eq!(place.corner, Corner::LowerLeft);
    }

    /// Two points far apart make a line through corners that hold neither of them: evaluations at steps
    /// 0 and 60, crossing the whole panel from the lower left to the upper right, leave only the upper
    /// left and the lower right free (counting points alone, every corner but those two looked free).
    #[test]
    fn a_segment_between_sparse_points_counts_where_it_passes() {
        let diagonal = line(&[(0, 0.0), (60, 1.0)]);
        let upper = line(&[(0, 0.9), (30, 1.0)]);
        let place = legend_place(&[diagonal, upper], (0.0, 60.0), (0.0, 1.0), (0.3, 0.3));
        assert_eq!(place.corner, Corner::LowerRight);
    }

    /// Where lines cross every corner, the axis is raised so that they stay below a legend of the height
    /// asked: the highest traced point lies under the box and its gap, and the legend takes the upper left.
    #[test]
    fn a_crowded_panel_gets_headroom_for_its_legend() {
        let lines = [line(&[(0, 0.0), (10, 0.0)]), line(&[(0, 1.0), (10, 1.0)])];
        let height = 0.3;
        let place = legend_place(&lines, (0.0, 10.0), (0.0, 1.0), (0.3, height));
        assert_eq!(place.corner, Corner::UpperLeft);
        let highest = traced_shares(&lines, (0.0, 10.0), (0.0, place.y_top))
            .iter()
            .map(|p| p.1)
            .fold(f64::MIN, f64::max);
        assert!(
            highest < 1.0 - height,
            "highest line at {highest} of the raised axis"
        );
        // A legend taller than half the panel is not given room: it takes the least crowded corner.
        let place = legend_place(&lines, (0.0, 10.0), (0.0, 1.0), (0.3, 0.6));
        assert_eq!(place.y_top, 1.0);
    }

    /// The box grows with the longest name and the number of entries, and never beyond the plot.
    #[test]
    fn the_legend_box_follows_its_names() {
        let (w2, h2) = legend_box_share(&["f32/mean@4", "int4/mean@4"]);
        let (w4, h4) = legend_box_share(&["f32/mean@4", "f32/pass@1_greedy", "a", "b"]);
        assert!(w4 > w2 && h4 > h2, "{w2} {h2} {w4} {h4}");
        let long = "x".repeat(200);
        assert_eq!(legend_box_share(&[long.as_str(); 40]), (1.0, 1.0));
    }
}
