//! `qarl bench kernels` end to end on wgpu (lavapipe in CI): the command the GPU check runs on an H200,
//! at sizes a CPU compiles and runs in seconds. Every kernel it times is checked against the host
//! reference (`--check`), the fragment tiles' layouts against the tiles' scalar twin bit for bit, and
//! the table it writes (`--json`) is whole and summarized. The tensor-core rows need an instruction
//! lavapipe lacks; what is left is every path the twins share with them (indexing, staging, layouts).
//!
//! Runs on whatever adapter wgpu finds; skips with a message when there is none, unless
//! `QARL_REQUIRE_WGPU=1`.
#![cfg(feature = "wgpu")]

mod common;

use std::path::Path;
use std::process::{Command, Output};

use common::wgpu_available;

/// `qarl bench kernels` on wgpu at the small block's sizes (256 wide, 4 experts, top-2, int4-g128, f32,
/// one timed iteration), its table written to `json`, with `extra` arguments.
fn bench_small(extra: &[&str], json: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_qarl"))
        .args(["bench", "kernels", "--runtime", "wgpu"])
        .args(["--formats", "int4-g128", "--experts", "4", "--top-k", "2"])
        .args(["--hidden", "256", "--inter", "128", "--iters", "1"])
        .args([
            "--matmul-size",
            "64",
            "--copy-mib",
            "1",
            "--act-dtype",
            "f32",
        ])
        .args(extra)
        .arg("--json")
        .arg(json)
        .output()
        .unwrap()
}

/// A small MoE block (256 wide, 4 experts, top-2) at 1 and 17 tokens, int4-g128, f32 activations:
/// every check passes (the routing tables among them), each fragment layout's count of differing values is 0, the JSON holds every row
/// with `"complete": true`, and the summary names each summation order.
#[test]
fn bench_kernels_checks_and_writes_its_table_on_wgpu() {
    if !wgpu_available() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let json = tmp.path().join("table.json");
    let out = bench_small(&["--check", "--tokens", "1,17"], &json);
    let text = String::from_utf8_lossy(&out.stdout);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}\n{err}");
    assert!(
        text.contains("check: every kernel matched the host reference"),
        "{text}"
    );
    // The fragment layouts, ldmatrix's row among them (the twin reads by pairs): no value differs.
    let layouts: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("values differ from the tiles'"))
        .collect();
    assert!(
        layouts.iter().any(|l| l.contains("moe/grouped-frag-ldm")),
        "{text}"
    );
    for line in &layouts {
        assert!(line.contains(": 0 of "), "{line}");
    }
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(doc["complete"], serde_json::json!(true));
    let kernels: Vec<&str> = doc["rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["kernel"].as_str().unwrap())
        .collect();
    for want in [
        "linear/grouped-frag",
        "moe/decode-split",
        // The tile's words held in registers (checked against moe/tiled, at 17 tokens across passes).
        "moe/decode-split-r",
        "moe/decode-split-p4-r",
        "moe/grouped-frag-m4-ldm",
        // The routing on the device, both launches (each checked against the host's table).
        "moe/route",
        "moe/route-blocks",
    ] {
        assert!(kernels.contains(&want), "{want} missing: {kernels:?}");
    }
    assert!(text.contains("1 tokens,   canonical"), "{text}");
    assert!(
        text.contains("17 tokens,     routing: moe/route "),
        "{text}"
    );
    // `--parts moe` (the GPU check's MoE table): the block's rows alone.
    let out = bench_small(&["--parts", "moe", "--tokens", "1"], &json);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let rows = doc["rows"].as_array().unwrap();
    assert!(!rows.is_empty());
    for r in rows {
        assert!(r["kernel"].as_str().unwrap().starts_with("moe/"), "{r}");
    }
    // A label no row has timed nothing: refused after the run, naming it.
    let out = bench_small(
        &[
            "--parts",
            "moe",
            "--tokens",
            "1",
            "--only",
            "moe/route,moe/nosuchrow",
        ],
        &json,
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("moe/nosuchrow"),
        "{err}"
    );
    assert!(!err.contains("\"moe/route\""), "{err}");
}
