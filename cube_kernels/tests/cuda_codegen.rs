//! The tensor-core tiles compiled for an H100/H200 (sm_90) without a GPU (`cube_kernels::ptx`): every
//! variant the launchers can ask for compiles, the instruction variants contain the matrix instruction
//! and the scalar twins do not, and, where `ptxas` is found (`QARL_PTXAS`, else on `PATH`), the PTX
//! assembles for sm_90a. Builds only with `--features cuda` (which needs LLVM: `scripts/offline_llvm.sh`
//! or `scripts/cuda_build_chroot.sh cargo test -p cube_kernels --features cuda --test cuda_codegen`).
//! `QARL_PTX_DIR` keeps the PTX files there for reading.
#![cfg(feature = "cuda")]

use std::path::{Path, PathBuf};
use std::process::Command;

use cube_kernels::ptx::{compile_all_tiles, CompiledTile, CudaTarget};
use cube_kernels::WeightFormat;

const H200: CudaTarget = CudaTarget {
    arch: 90,
    driver: 13000,
};

fn formats() -> Vec<WeightFormat> {
    ["int4-g32", "int4-g128", "int8-pc", "nvfp4", "mxfp4"]
        .iter()
        .map(|name| WeightFormat::parse(name).unwrap())
        .collect()
}

/// Whether the PTX multiplies on tensor cores: `wmma.mma` (what CubeCL's `cmma` lowers to) or `mma.sync`.
fn has_matrix_instruction(ptx: &str) -> bool {
    ptx.contains("wmma.mma") || ptx.contains("mma.sync")
}

fn ptxas() -> Option<PathBuf> {
    if let Ok(path) = std::env::var("QARL_PTXAS") {
        return Some(PathBuf::from(path));
    }
    let found = Command::new("ptxas").arg("--version").output().ok()?;
    found.status.success().then(|| PathBuf::from("ptxas"))
}

/// `ptxas -arch=sm_90a` on `tile`'s PTX; its verbose report (registers, spills, shared memory).
fn assemble(ptxas: &Path, dir: &Path, tile: &CompiledTile) -> Result<String, String> {
    let stem: String = tile
        .name
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    let ptx = dir.join(format!("{stem}.ptx"));
    std::fs::write(&ptx, &tile.source).map_err(|e| e.to_string())?;
    let out = Command::new(ptxas)
        .args(["-arch=sm_90a", "-v", "-o"])
        .arg(dir.join(format!("{stem}.cubin")))
        .arg(&ptx)
        .output()
        .map_err(|e| format!("running {}: {e}", ptxas.display()))?;
    let text = String::from_utf8_lossy(&out.stderr).into_owned();
    if out.status.success() {
        Ok(text)
    } else {
        Err(text)
    }
}

/// ptxas's register and spill lines, joined: what a kernel costs an SM.
fn usage(report: &str) -> String {
    report
        .lines()
        .filter(|line| line.contains("registers") || line.contains("spill"))
        .map(|line| line.trim().trim_start_matches("ptxas info    : "))
        .collect::<Vec<_>>()
        .join("; ")
}

#[test]
fn tensor_core_tiles_compile_for_sm90_and_use_the_instruction() {
    let dir = std::env::var("QARL_PTX_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| std::env::temp_dir().join("qarl-cuda-codegen"));
    std::fs::create_dir_all(&dir).unwrap();
    let ptxas = ptxas();
    if ptxas.is_none() {
        eprintln!(
            "no ptxas (QARL_PTXAS or PATH): the PTX is compiled and inspected, not assembled"
        );
    }
    let mut failures = Vec::new();
    let results = compile_all_tiles(H200, &formats());
    let variants = results.len();
    for result in results {
        let tile = match result {
            Ok(tile) => tile,
            Err(err) => {
                failures.push(err.to_string());
                continue;
            }
        };
        if tile.is_ptx && has_matrix_instruction(&tile.source) != tile.tensor_cores {
            failures.push(format!(
                "{}: the matrix instruction is {} the PTX",
                tile.name,
                if tile.tensor_cores {
                    "missing from"
                } else {
                    "in"
                }
            ));
        }
        if let (Some(ptxas), true) = (&ptxas, tile.is_ptx) {
            match assemble(ptxas, &dir, &tile) {
                Ok(report) => eprintln!(
                    "{} (shared {} B): {}",
                    tile.name,
                    tile.shared_bytes,
                    usage(&report)
                ),
                Err(report) => failures.push(format!("{}: ptxas: {report}", tile.name)),
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} problems in {variants} variants:\n{}",
        failures.len(),
        failures.join("\n")
    );
    // 5 formats x (dense, MoE gate-up, MoE down) x 3 operand pairs x (instruction, scalar twin).
    assert_eq!(variants, 5 * 3 * 3 * 2);
}
