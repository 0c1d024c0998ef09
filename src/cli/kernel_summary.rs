//! The lines `qarl bench kernels` ends its table with, read off the rows (`--json`'s `rows`; also
//! `--summarize TABLE.json` for a saved table): the MoE block's two yardsticks, the fragment tiles'
//! layouts against their default, and the canonical decode's variants against its default.

use serde_json::Value;

/// Prints the MoE yardsticks ([`moe_summary`]), the fragment layouts ([`fragment_summary`]) and the
/// canonical decode's variants ([`decode_summary`]) of `rows` under their headings (`base`: the baseline matmul's type). Rows during which a device task
/// failed (`device_failures`) are left out: their times are not to be trusted.
pub fn print_summaries(base: &str, rows: &[Value]) {
    let trusted: Vec<Value> = rows
        .iter()
        .filter(|r| r["device_failures"].as_u64().unwrap_or(0) == 0)
        .cloned()
        .collect();
    let rows = trusted.as_slice();
    print_summary(base, &moe_summary(rows));
    let layouts = fragment_summary(rows);
    if !layouts.is_empty() {
        println!("Fragment tiles' layouts against the default (moe/mma-frag; at 64 tokens or fewer the decode step's moe/decode-mma-frag) and the tiles, fastest first:");
        for line in layouts {
            println!("  {line}");
        }
    }
    let decode = decode_summary(rows);
    if !decode.is_empty() {
        println!("The canonical decode step's variants against moe/decode-split (-p4: 4 assignments a pass, -r: the tile's words held in registers, graph: the launches replayed, fused: down and combine in one launch), fastest first:");
        for line in decode {
            println!("  {line}");
        }
    }
}

/// The two summation orders a deterministic run takes ([`order_of`]): rollout and training must meet
/// the yardsticks in the same one, so each is read off its own rows.
const ORDERS: [&str; 2] = ["canonical", "tensor-core"];

/// The summation order of a kernel row: the tensor-core tiles' (`mma` rows, on the instruction, and
/// `grouped` rows, their scalar twin) or the canonical one (every other: `gemv`, `tiled`, the grouped
/// GEMV's `decode-split` / `-fused` / `-graph`).
fn order_of(kernel: &str) -> &'static str {
    if kernel.contains("mma") || kernel.contains("grouped") {
        ORDERS[1]
    } else {
        ORDERS[0]
    }
}

/// The MoE block's two yardsticks, read off a table's rows (the `rows` of `--json`), per summation
/// order ([`order_of`]: a rollout and its training share one, so a yardstick met in the other order
/// does not count): at prefill and training sizes (more than 64 tokens) the order's fastest exact kernel
/// against the baseline matmul on the same FLOPs (`moe/...` rows, decode rows aside), and at decode
/// sizes (64 tokens or fewer) its decode path's best share of the copy bandwidth (`moe/decode-...`
/// rows: from ids on the device, as a rollout runs them). One line per format, activation type, token
/// count and order that has rows, in the table's order.
pub fn moe_summary(rows: &[Value]) -> Vec<String> {
    let text = |r: &Value, k: &str| r[k].as_str().unwrap_or_default().to_string();
    let num = |r: &Value, k: &str| r[k].as_f64().unwrap_or(f64::NAN);
    let mut keys: Vec<(String, String, u64)> = Vec::new();
    for r in rows
        .iter()
        .filter(|r| text(r, "kernel").starts_with("moe/"))
    {
        let key = (
            text(r, "format"),
            text(r, "act_dtype"),
            r["tokens"].as_u64().unwrap_or(0),
        );
        if !keys.contains(&key) {
            keys.push(key);
        }
    }
    let mut lines = Vec::new();
    for ((format, act, tokens), order) in keys
        .iter()
        .flat_map(|key| ORDERS.map(|order| (key.clone(), order)))
    {
        let decode = tokens <= 64;
        let of_key = rows.iter().filter(|r| {
            let kernel = text(r, "kernel");
            kernel.starts_with("moe/")
                && !kernel.starts_with(ROUTE_ROWS)
                && kernel.starts_with("moe/decode-") == decode
                && order_of(&kernel) == order
                && text(r, "format") == format
                && text(r, "act_dtype") == act
                && r["tokens"].as_u64() == Some(tokens)
        });
        let best = if decode {
            of_key.max_by(|a, b| {
                num(a, "bandwidth_fraction").total_cmp(&num(b, "bandwidth_fraction"))
            })
        } else {
            of_key.min_by(|a, b| num(a, "micros").total_cmp(&num(b, "micros")))
        };
        let Some(best) = best else { continue };
        let kernel = text(best, "kernel");
        // The same yardstick at the fastest and the slowest batch's time, where the row has them.
        let batches = batch_range(best)
            .map(|(fast, slow)| (fast / num(best, "micros"), slow / num(best, "micros")));
        lines.push(if decode {
            let share = num(best, "bandwidth_fraction");
            let verdict = if share >= 0.5 { "at least" } else { "under" };
            let range = batches.map_or(String::new(), |(fast, slow)| {
                format!("; batches {:.1}-{:.1}%", 100.0 * share / slow, 100.0 * share / fast)
            });
            format!(
                "{format} {act} {tokens:>5} tokens, {order:>11}: {kernel} at {:.1}% of copy ({verdict} 50%{range})",
                100.0 * share
            )
        } else {
            let ratio = num(best, "micros") / num(best, "bf16_micros");
            let verdict = if ratio <= 1.3 { "within" } else { "beyond" };
            let range = batches.map_or(String::new(), |(fast, slow)| {
                format!("; batches {:.2}-{:.2}x", ratio * fast, ratio * slow)
            });
            format!(
                "{format} {act} {tokens:>5} tokens, {order:>11}: {kernel} {ratio:.2}x the baseline's time ({verdict} 1.3x{range})"
            )
        });
    }
    lines.extend(routing_lines(rows, &keys));
    lines
}

/// The routing rows' prefix (`moe/route`, and the other launch beside it): the table a layer builds
/// before the block, not a block kernel, so never a yardstick's best row.
const ROUTE_ROWS: &str = "moe/route";

/// For each of `keys` (format, activation type, tokens) with a `moe/route` row: the device routing's
/// time and its share of the fastest block row of the same key (either order), what a layer pays on
/// top of the block rows (which upload a host-built table).
fn routing_lines(rows: &[Value], keys: &[(String, String, u64)]) -> Vec<String> {
    let text = |r: &Value, k: &str| r[k].as_str().unwrap_or_default().to_string();
    let micros = |r: &Value| r["micros"].as_f64().unwrap_or(f64::NAN);
    let mut lines = Vec::new();
    for (format, act, tokens) in keys {
        let of_key = |r: &&Value| {
            text(r, "format") == *format
                && text(r, "act_dtype") == *act
                && r["tokens"].as_u64() == Some(*tokens)
        };
        let Some(route) = rows
            .iter()
            .filter(of_key)
            .find(|r| text(r, "kernel") == ROUTE_ROWS)
        else {
            continue;
        };
        let block = rows
            .iter()
            .filter(of_key)
            .filter(|r| {
                let kernel = text(r, "kernel");
                kernel.starts_with("moe/") && !kernel.starts_with(ROUTE_ROWS)
            })
            .map(micros)
            .min_by(f64::total_cmp);
        let share = block.map_or(String::new(), |b| {
            format!(
                " ({:.1}% of the fastest block row)",
                100.0 * micros(route) / b
            )
        });
        lines.push(format!(
            "{format} {act} {tokens:>5} tokens,     routing: moe/route {:.1} us{share}",
            micros(route)
        ));
    }
    lines
}

/// The per-call microseconds of a row's fastest and slowest batch, where it was timed in several
/// (`micros_fastest_batch`, `micros_slowest_batch`; tables before 2026-12-07 have neither).
fn batch_range(row: &Value) -> Option<(f64, f64)> {
    let fast = row["micros_fastest_batch"].as_f64()?;
    let slow = row["micros_slowest_batch"].as_f64()?;
    Some((fast, slow))
}

/// Whether two rows' batch times overlap: a difference between them is then within what one call's
/// noise moves; `false` where either row has no batches (nothing says so).
fn batches_overlap(a: &Value, b: &Value) -> bool {
    match (batch_range(a), batch_range(b)) {
        (Some((fast_a, slow_a)), Some((fast_b, slow_b))) => fast_a <= slow_b && fast_b <= slow_a,
        _ => false,
    }
}

/// Prints [`moe_summary`]'s lines under their heading (`base`: the baseline matmul's type).
fn print_summary(base: &str, lines: &[String]) {
    if lines.is_empty() {
        return;
    }
    println!("MoE block, per summation order: the fastest exact kernel against the {base} matmul above 64 tokens, the decode path's share of copy at 64 or fewer; and the routing on the device a layer adds:");
    for line in lines {
        println!("  {line}");
    }
}

/// A family of rows ranked against one of them ([`ranked_against_default`]): for a call of `tokens`
/// tokens, the default row's kernel and which kernels are ranked beside it, or `None` where the family
/// has no rows at that size.
type Family = fn(u64) -> Option<(&'static str, fn(&str) -> bool)>;

/// For each MoE call above 64 tokens whose default fragment layout was timed (`moe/mma-frag`), every
/// fragment row (`moe/mma-frag*`) and the tiles (`moe/mma`) as a ratio of the default's time, fastest
/// first: which layout `FragmentShape`'s default should be at that size; and at 64 tokens or fewer the
/// same for the decode step (`moe/decode-mma-frag*` and `moe/decode-mma` against
/// `moe/decode-mma-frag`: whether to split the scale groups, and whether a graph pays).
pub fn fragment_summary(rows: &[Value]) -> Vec<String> {
    ranked_against_default(rows, |tokens| {
        Some(if tokens > 64 {
            ("moe/mma-frag", |k: &str| {
                k == "moe/mma" || k.starts_with("moe/mma-frag")
            })
        } else {
            ("moe/decode-mma-frag", |k: &str| {
                k == "moe/decode-mma" || k.starts_with("moe/decode-mma-frag")
            })
        })
    })
}

/// At 64 tokens or fewer, the canonical order's decode rows against its default (`moe/decode-split`:
/// the two launches, one assignment a pass, the words loaded per pass): several assignments a pass
/// (`-p4`), the tile's words held in registers (`-r`), the launches recorded as a graph
/// (`moe/decode-graph`) and the down projection fused with the combine (`moe/decode-fused`), fastest
/// first: what `Kernels::gemv_assignments_per_pass`, `holds_gemv_words` and `fuses_decode_combine`
/// should say, and whether a rollout should replay its decode steps.
pub fn decode_summary(rows: &[Value]) -> Vec<String> {
    ranked_against_default(rows, |tokens| {
        (tokens <= 64).then_some(("moe/decode-split", |k: &str| {
            k.starts_with("moe/decode-split") || k == "moe/decode-graph" || k == "moe/decode-fused"
        }))
    })
}

/// For each row whose kernel is its size's default in `family`, the family's rows of the same format,
/// activation type and token count as ratios of the default's time, fastest first; one line each, in
/// the table's order.
fn ranked_against_default(rows: &[Value], family: Family) -> Vec<String> {
    let text = |r: &Value, k: &str| r[k].as_str().unwrap_or_default().to_string();
    let micros = |r: &Value| r["micros"].as_f64().unwrap_or(f64::NAN);
    let key = |r: &Value| {
        (
            text(r, "format"),
            text(r, "act_dtype"),
            r["tokens"].as_u64(),
        )
    };
    let mut lines = Vec::new();
    for default in rows.iter() {
        let Some((name, member)) = default["tokens"].as_u64().and_then(family) else {
            continue;
        };
        if text(default, "kernel") != name {
            continue;
        }
        let base = micros(default);
        let mut others: Vec<(String, f64, bool)> = rows
            .iter()
            .filter(|r| key(r) == key(default) && member(&text(r, "kernel")))
            .map(|r| {
                let kernel = text(r, "kernel");
                let overlaps = kernel != name && batches_overlap(r, default);
                (kernel, micros(r) / base, overlaps)
            })
            .collect();
        others.sort_by(|a, b| a.1.total_cmp(&b.1));
        let (format, act, tokens) = key(default);
        let ratios: Vec<String> = others
            .iter()
            .map(|(kernel, ratio, overlaps)| {
                let mark = if *overlaps { "~" } else { "" };
                format!("{} {ratio:.2}x{mark}", kernel.trim_start_matches("moe/"))
            })
            .collect();
        let note = if others.iter().any(|o| o.2) {
            " (~: its batches' times overlap the default's, not told apart)"
        } else {
            ""
        };
        lines.push(format!(
            "{format} {act} {:>5} tokens ({base:.1} us): {}{note}",
            tokens.unwrap_or(0),
            ratios.join(", ")
        ));
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The summary of the committed H200 run 4 (2026-12-04) gives the numbers its README reads off the
    /// table by hand: the tensor-core tiles at 6.06x / 4.45x / 4.86x of bf16 at 256 / 1024 / 4096
    /// tokens, and the two-launch decode (the canonical order's) at 10.6% / 15.3% / 6.9% of copy at 1 /
    /// 16 / 64 tokens; and per order, the canonical tiles at 8.7-11.6x.
    #[test]
    fn summary_reads_the_moe_yardsticks_off_the_rows() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/experiments/results/gpu_h200/run4_kernels_moe_cuda.json"
        );
        let doc: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let lines = moe_summary(doc["rows"].as_array().unwrap());
        // Run 4 timed the decode in the canonical order only, and both orders above 64 tokens.
        let want = [
            "int4-g128 bf16     1 tokens,   canonical: moe/decode-split at 10.6% of copy (under 50%)",
            "int4-g128 bf16    16 tokens,   canonical: moe/decode-split at 15.3% of copy (under 50%)",
            "int4-g128 bf16    64 tokens,   canonical: moe/decode-split at 6.9% of copy (under 50%)",
            "int4-g128 bf16   256 tokens,   canonical: moe/tiled 11.61x the baseline's time (beyond 1.3x)",
            "int4-g128 bf16   256 tokens, tensor-core: moe/mma-x1 6.06x the baseline's time (beyond 1.3x)",
            "int4-g128 bf16  1024 tokens,   canonical: moe/tiled 8.68x the baseline's time (beyond 1.3x)",
            "int4-g128 bf16  1024 tokens, tensor-core: moe/mma-x1 4.45x the baseline's time (beyond 1.3x)",
            "int4-g128 bf16  4096 tokens,   canonical: moe/tiled 9.83x the baseline's time (beyond 1.3x)",
            "int4-g128 bf16  4096 tokens, tensor-core: moe/mma-x1 4.86x the baseline's time (beyond 1.3x)",
        ];
        assert_eq!(lines, want);
        // A row that meets each yardstick says so, and a faster row of the other order does not stand
        // in for an order's own (the canonical decode row aside from the tiles' one).
        let row = |kernel: &str, tokens: u64, micros: f64, share: f64| {
            serde_json::json!({"kernel": kernel, "format": "f", "act_dtype": "a", "tokens": tokens,
                "micros": micros, "bandwidth_fraction": share, "bf16_micros": 200.0})
        };
        let rows = [
            row("moe/decode-graph", 1, 9.0, 0.55),
            row("moe/decode-mma-frag-s4", 1, 20.0, 0.25),
            row("moe/mma", 256, 250.0, 0.1),
            row("moe/grouped", 256, 900.0, 0.1),
            row("moe/tiled", 256, 800.0, 0.1),
            // The routing is faster than any block row, and no yardstick's best.
            row("moe/route", 256, 10.0, 0.01),
            row("moe/route-1cube", 256, 40.0, 0.01),
        ];
        assert_eq!(
            moe_summary(&rows),
            [
                "f a     1 tokens,   canonical: moe/decode-graph at 55.0% of copy (at least 50%)",
                "f a     1 tokens, tensor-core: moe/decode-mma-frag-s4 at 25.0% of copy (under 50%)",
                "f a   256 tokens,   canonical: moe/tiled 4.00x the baseline's time (beyond 1.3x)",
                "f a   256 tokens, tensor-core: moe/mma 1.25x the baseline's time (within 1.3x)",
                "f a   256 tokens,     routing: moe/route 10.0 us (4.0% of the fastest block row)",
            ]
        );
    }

    /// A timed row of int4-g128 weights and bf16 activations.
    fn row(kernel: &str, tokens: u64, micros: f64) -> Value {
        serde_json::json!({"kernel": kernel, "format": "int4-g128", "act_dtype": "bf16",
            "tokens": tokens, "micros": micros})
    }

    /// The layouts' lines: every fragment row and the tiles as a ratio of the default's time, fastest
    /// first; above 64 tokens the prefill rows, at 64 or fewer the decode step's tensor-core rows (a
    /// prefill row there, or the canonical decode, aside).
    #[test]
    fn fragment_layouts_are_ranked_against_the_default() {
        let rows = [
            row("moe/mma", 4096, 4000.0),
            row("moe/mma-frag", 4096, 1000.0),
            row("moe/mma-frag-m4", 4096, 500.0),
            row("moe/mma-frag-db", 4096, 900.0),
            row("moe/tiled", 4096, 100.0),
            row("moe/mma-frag", 64, 10.0),
            row("moe/mma-frag-m4", 64, 5.0),
            row("moe/decode-mma-frag", 1, 40.0),
            row("moe/decode-mma-frag-s4", 1, 20.0),
            row("moe/decode-mma-frag-s4-graph", 1, 10.0),
            row("moe/decode-mma", 1, 60.0),
            row("moe/decode-split", 1, 5.0),
        ];
        assert_eq!(
            fragment_summary(&rows),
            [
                "int4-g128 bf16  4096 tokens (1000.0 us): mma-frag-m4 0.50x, mma-frag-db 0.90x, \
              mma-frag 1.00x, mma 4.00x",
                "int4-g128 bf16     1 tokens (40.0 us): decode-mma-frag-s4-graph 0.25x, \
              decode-mma-frag-s4 0.50x, decode-mma-frag 1.00x, decode-mma 1.50x"
            ]
        );
        assert!(fragment_summary(&rows[4..7]).is_empty());
    }

    /// Rows timed in batches: a ranked row whose batches overlap the default's is marked (a difference
    /// within one call's noise), and the yardsticks give the range of the best row's batches.
    #[test]
    fn batch_spreads_mark_rows_not_told_apart() {
        let batched = |kernel: &str, tokens: u64, micros: f64, fast: f64, slow: f64| {
            let mut r = row(kernel, tokens, micros);
            r["micros_fastest_batch"] = fast.into();
            r["micros_slowest_batch"] = slow.into();
            r["bf16_micros"] = 100.0.into();
            r["bandwidth_fraction"] = 0.2.into();
            r
        };
        let rows = [
            batched("moe/mma-frag", 4096, 1000.0, 950.0, 1050.0),
            batched("moe/mma-frag-m4", 4096, 980.0, 960.0, 1000.0),
            batched("moe/mma-frag-db", 4096, 800.0, 790.0, 810.0),
            row("moe/mma", 4096, 990.0),
            batched("moe/decode-mma-frag", 16, 50.0, 40.0, 100.0),
        ];
        assert_eq!(
            fragment_summary(&rows),
            [
                "int4-g128 bf16  4096 tokens (1000.0 us): mma-frag-db 0.80x, mma-frag-m4 0.98x~, \
                 mma 0.99x, mma-frag 1.00x (~: its batches' times overlap the default's, not told apart)",
                "int4-g128 bf16    16 tokens (50.0 us): decode-mma-frag 1.00x",
            ]
        );
        assert_eq!(
            moe_summary(&rows),
            [
                "int4-g128 bf16  4096 tokens, tensor-core: moe/mma-frag-db 8.00x the baseline's time \
                 (beyond 1.3x; batches 7.90-8.10x)",
                "int4-g128 bf16    16 tokens, tensor-core: moe/decode-mma-frag at 20.0% of copy \
                 (under 50%; batches 10.0-25.0%)",
            ]
        );
    }

    /// The canonical decode's variants against the two launches, at 64 tokens or fewer only, each
    /// call's rows apart, the tensor-core decode rows aside.
    #[test]
    fn decode_variants_are_ranked_against_the_two_launches() {
        let rows = [
            row("moe/decode-fused", 16, 1000.0),
            row("moe/decode-split", 16, 400.0),
            row("moe/decode-split-p4", 16, 400.0),
            row("moe/decode-split-r", 16, 200.0),
            row("moe/decode-split-p4-r", 16, 100.0),
            row("moe/decode-graph", 16, 300.0),
            row("moe/decode-mma", 16, 50.0),
            row("moe/decode-split", 64, 1000.0),
            row("moe/decode-split-r", 64, 1500.0),
            row("moe/decode-split", 256, 10.0),
            row("moe/decode-split-r", 256, 5.0),
        ];
        assert_eq!(
            decode_summary(&rows),
            [
                "int4-g128 bf16    16 tokens (400.0 us): decode-split-p4-r 0.25x, decode-split-r \
              0.50x, decode-graph 0.75x, decode-split 1.00x, decode-split-p4 1.00x, decode-fused 2.50x",
                "int4-g128 bf16    64 tokens (1000.0 us): decode-split 1.00x, decode-split-r 1.50x"
            ]
        );
        assert!(decode_summary(&rows[6..7]).is_empty());
    }
}
