//! The kernels that never ran on a CUDA device, compiled for an H100/H200 (sm_90) without a GPU
//! (`cube_kernels::ptx`): every tensor-core tile variant the launchers can ask for, the GPU training
//! kernels and the MoE decode's routing and fused down-and-combine compile, the instruction variants
//! contain the matrix instruction and nothing else does, and, where `ptxas` is found (`QARL_PTXAS`,
//! else on `PATH`), the PTX assembles for sm_90a. Builds only with `--features cuda`, which needs LLVM:
//! `scripts/cuda_codegen.sh` sets it all up and runs this.
//! `QARL_PTX_DIR` keeps the PTX files there for reading.
#![cfg(feature = "cuda")]

use std::path::{Path, PathBuf};
use std::process::Command;

use cube_kernels::ptx::{
    compile_all_tiles, compile_decode_kernels, compile_fragment_tiles, compile_training_kernels,
    device_properties, CompiledKernel, CudaTarget,
};
use cube_kernels::{ActDType, KernelError, WeightFormat};

const H200: CudaTarget = CudaTarget {
    arch: 90,
    driver: 13000,
};

/// The weight-only formats (the tiles take no fp8, whose activations are quantized).
const TILE_FORMATS: &[&str] = &["int4-g32", "int4-g128", "int8-pc", "nvfp4", "mxfp4"];
/// Every format the grouped straight-through backward and the decode's down projection decode.
const TRAINING_FORMATS: &[&str] = &[
    "int4-g32",
    "int4-g128",
    "int8-pc",
    "fp8-b128",
    "nvfp4",
    "mxfp4",
];

fn formats(names: &[&str]) -> Vec<WeightFormat> {
    names
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
fn assemble(ptxas: &Path, dir: &Path, tile: &CompiledKernel) -> Result<String, String> {
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

/// Compiles, inspects and (with ptxas) assembles `results`; every problem, one per line.
fn check(results: Vec<Result<CompiledKernel, KernelError>>) -> Vec<String> {
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
    for result in results {
        let kernel = match result {
            Ok(kernel) => kernel,
            Err(err) => {
                failures.push(err.to_string());
                continue;
            }
        };
        if kernel.is_ptx && has_matrix_instruction(&kernel.source) != kernel.tensor_cores {
            failures.push(format!(
                "{}: the matrix instruction is {} the PTX",
                kernel.name,
                if kernel.tensor_cores {
                    "missing from"
                } else {
                    "in"
                }
            ));
        }
        if let (Some(ptxas), true) = (&ptxas, kernel.is_ptx) {
            match assemble(ptxas, &dir, &kernel) {
                Ok(report) => eprintln!(
                    "{} (shared {} B): {}",
                    kernel.name,
                    kernel.shared_bytes,
                    usage(&report)
                ),
                Err(report) => failures.push(format!("{}: ptxas: {report}", kernel.name)),
            }
        }
    }
    failures
}

#[test]
fn tensor_core_tiles_compile_for_sm90_and_use_the_instruction() {
    let results = compile_all_tiles(H200, &formats(TILE_FORMATS));
    // 5 formats x (dense, MoE gate-up, MoE down) x 3 operand pairs x (instruction, scalar twin) x
    // (1 K step per stage, as many as fit).
    assert_eq!(results.len(), 5 * 3 * 3 * 2 * 2);
    let failures = check(results);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn fragment_tiles_compile_for_sm90_and_use_the_instruction() {
    let results = compile_fragment_tiles(H200, &formats(TILE_FORMATS));
    // 5 formats x (MoE gate-up, MoE down, dense) x 3 operand pairs x (instruction, emulation), then
    // 13 more layouts of int4-g128 on the instruction (3 of them with the scale groups split, 3 with
    // the A fragments by ldmatrix).
    assert_eq!(results.len(), 5 * 3 * 3 * 2 + 13 * 3 * 3);
    let failures = check(results);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn training_kernels_compile_for_sm90() {
    let results = compile_training_kernels(H200, &formats(TRAINING_FORMATS));
    // 7 single-variant kernels, the exact matmul's 2 layouts, the weight gradient with and without
    // gather, and the grouped transposed product's 2 projections for each of 6 formats.
    assert_eq!(results.len(), 7 + 2 + 2 + 2 * 6);
    let failures = check(results);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn decode_kernels_compile_for_sm90() {
    let results = compile_decode_kernels(H200, &formats(TRAINING_FORMATS));
    // The routing (one cube, and the three launches over blocks); per format (6) the grouped GEMV's
    // gate-up for 3 input types and its down, each with one and with 4 assignments per pass, each
    // loading its words per pass and holding them in registers, and the fused down-and-combine for 3
    // output types.
    assert_eq!(results.len(), 4 + 6 * ((3 + 1) * 2 * 2 + 3));
    let failures = check(results);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// On the part the tiles are for, the properties the runtime registers offer the instruction for both
/// half types, so `train.tensor_cores` takes it rather than warning and running the scalar twin.
#[test]
fn an_h200_offers_the_tiles_instruction_for_half_operands() {
    let props = device_properties(H200);
    assert!(ActDType::BF16.has_tensor_tiles_on(&props));
    assert!(ActDType::F16.has_tensor_tiles_on(&props));
    assert!(!ActDType::F32.has_tensor_tiles_on(&props));
    // And the manual m16n8k16 form the fragment tiles issue.
    assert!(ActDType::BF16.has_fragment_mma_on(&props));
    assert!(ActDType::F16.has_fragment_mma_on(&props));
    assert!(!ActDType::F32.has_fragment_mma_on(&props));
    // A part without tensor cores (sm_61) offers none.
    let pascal = device_properties(CudaTarget {
        arch: 61,
        driver: 13000,
    });
    assert!(!ActDType::F16.has_tensor_tiles_on(&pascal));
    assert!(!ActDType::F16.has_fragment_mma_on(&pascal));
}
