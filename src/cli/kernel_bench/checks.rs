//! What `qarl bench kernels --check` checks beside the timing: each kernel against the host reference
//! under the rounding contract, the tiles' bits independent of the batch and of the staging, and the
//! fragment tiles' layouts against the tiles; and the inputs the checks and the rows share.

use cube_kernels::{
    reference, ActDType, DeviceBuffer, DeviceWeights, FragmentShape, Kernels, MatmulPath,
    MoeRouting, PackedWeights,
};

use super::timing::{time, Timing};
use super::KernelBenchArgs;

/// An MoE block's packed weights (gate, up, down) on the host and on the device.
pub(super) struct MoeBlock<'a> {
    pub weights: [&'a PackedWeights; 3],
    pub device: [&'a DeviceWeights; 3],
}

pub(super) fn random_routing(tokens: usize, top_k: usize, experts: usize, seed: u64) -> Vec<u32> {
    let mut state = seed | 1;
    let mut ids = Vec::with_capacity(tokens * top_k);
    for _ in 0..tokens {
        let mut chosen: Vec<u32> = Vec::with_capacity(top_k);
        while chosen.len() < top_k.min(experts) {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let e = (state % experts as u64) as u32;
            if !chosen.contains(&e) {
                chosen.push(e);
            }
        }
        ids.extend(chosen);
    }
    ids
}

pub(super) fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x2545_F491_4F6C_DD1D) | 1;
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        })
        .collect()
}

/// The largest `max(0, |got - want| - r(want)) / max |want|`: the error beyond rounding `want` (the
/// f32 reference) to `dtype`, whose rounding moves a value by at most `r(w) = max(u |w|, s / 2)`, `u`
/// the unit roundoff and `s` the spacing of the type's subnormals (f16's 2^-24 matters: an MoE output
/// of 5e-5 is subnormal in f16, where rounding is absolute; 0 for f32).
pub(super) fn max_rounded_err(got: &[f32], want: &[f32], dtype: ActDType) -> f32 {
    let (u, half_subnormal) = match dtype {
        ActDType::F32 => (0.0, 0.0),
        ActDType::F16 => (2f32.powi(-11), 2f32.powi(-25)),
        ActDType::BF16 => (2f32.powi(-8), 2f32.powi(-134)),
    };
    let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(1e-6);
    got.iter().zip(want).fold(0.0f32, |m, (g, w)| {
        let rounding = (u * w.abs()).max(half_subnormal);
        m.max(((g - w).abs() - rounding).max(0.0) / scale)
    })
}

/// How many values of `got` (in `dtype`) differ in bits from `f32_run` rounded to `dtype`.
pub(super) fn contract_mismatches(got: &[f32], f32_run: &[f32], dtype: ActDType) -> usize {
    got.iter()
        .zip(f32_run)
        .filter(|(g, f)| g.to_bits() != dtype.round(**f).to_bits())
        .count()
}

/// The fragment tiles' layouts a table times and checks, by the suffix of their rows: as `frag` is,
/// with chunks of 2 K steps (`-c2`: fewer registers, more cubes per multiprocessor), with the staging
/// in two buffers (`-db`: one barrier per chunk), and in the other [`FragmentShape`]s with int4 codes
/// decoded two at a time: one tile of 16 assignments per cube (`-pairs`, and `-ldm` with the A
/// fragments read by `ldmatrix`), two tiles sharing each decoded weight with 32 rows per cube
/// (`-m2`) or 64 (`-m2x64`), four with 32 (`-m4`, `-m4-db` with two buffers, `-m4-ldm` with
/// `ldmatrix`).
pub(super) fn fragment_variants(frag: &Kernels) -> anyhow::Result<Vec<(&'static str, Kernels)>> {
    let mut variants = vec![
        ("", frag.clone()),
        ("-c2", frag.clone().with_fragment_chunk_steps(Some(2))),
    ];
    for (suffix, m_tiles, blocks, pairs, two, ldmatrix) in [
        ("-db", 1, 2, false, true, false),
        ("-pairs", 1, 2, true, false, false),
        ("-ldm", 1, 2, true, false, true),
        ("-m2", 2, 1, true, false, false),
        ("-m2x64", 2, 2, true, false, false),
        ("-m4", 4, 1, true, false, false),
        ("-m4-db", 4, 1, true, true, false),
        ("-m4-ldm", 4, 1, true, false, true),
    ] {
        let shape = FragmentShape::new(m_tiles, blocks, pairs)?
            .with_double_buffer(two)
            .with_ldmatrix(ldmatrix);
        variants.push((suffix, frag.clone().with_fragment_shape(shape)));
    }
    Ok(variants)
}

/// The fragment tiles against the tiles (`run`: the product on `n` tokens with either kernels): the
/// scalar twins must give the same bits (a failure otherwise); on the instruction the count of values
/// that differ is printed, 0 where NVIDIA's `m16n16k16` is two `m16n8k16` with the same arithmetic
/// (then the two kernels are interchangeable under the contract).
pub(super) fn compare_fragments(
    [k, frag]: [&Kernels; 2],
    run: &impl Fn(&Kernels) -> anyhow::Result<Vec<f32>>,
    (name, dtype, path, kernel, n): (&str, ActDType, MatmulPath, &str, usize),
    failures: &mut Vec<String>,
) -> anyhow::Result<()> {
    let (got, want) = (run(frag)?, run(k)?);
    let differ = contract_mismatches(&got, &want, ActDType::F32);
    println!(
        "{name} {dtype} {kernel}: {differ} of {} values differ from the tiles' ({n} tokens)",
        want.len()
    );
    if differ > 0 && !path.tiles(dtype).is_some_and(|(tc, _)| tc) {
        failures.push(format!(
            "{name} {dtype} {kernel}: {differ} values differ from the tiles' scalar twin ({n} tokens)"
        ));
    }
    Ok(())
}

/// The grouped tiles of one dense weight (`path`: [`MatmulPath::Mma`] on tensor cores, or
/// [`MatmulPath::GroupedScalar`]): within the type's rounding plus a tensor-core accumulation tolerance
/// of the host reference, and batch-invariant: each token count's rows are bitwise the first rows of
/// the largest count's result on the same activations (a decode step padded to the instruction's 16
/// rows computes what a prefill computes).
#[allow(clippy::too_many_arguments)]
pub(super) fn check_grouped(
    args: &KernelBenchArgs,
    k: &Kernels,
    w: &PackedWeights,
    name: &str,
    dtype: ActDType,
    (path, kernel): (MatmulPath, &str),
    failures: &mut Vec<String>,
) -> anyhow::Result<()> {
    let (hidden, out) = (w.in_features(), w.out_features());
    let most = args.most_tokens();
    let x: Vec<f32> = values(most * hidden, 999)
        .iter()
        .map(|v| dtype.round(*v))
        .collect();
    let dw = k.upload_weights(w);
    // Tokens `first..first + n` alone.
    let run = |first: usize, n: usize| -> anyhow::Result<Vec<f32>> {
        let dx = k.upload(&x[first * hidden..(first + n) * hidden], dtype)?;
        Ok(k.read_f32(&k.linear_with(&dx, n, &dw, path)?)?)
    };
    let all = run(0, most)?;
    let want = reference::linear(&x, most, w, 0);
    // Products of half activations and exact codes summed on tensor cores, whose f32 accumulation
    // may round more coarsely than IEEE f32 (a few bits), then one rounding to the type.
    let err = max_rounded_err(&all, &want, dtype);
    if err > 1e-3 {
        failures.push(format!(
            "{name} {dtype} {kernel} n={most}: max rel err beyond rounding {err:.2e}"
        ));
    }
    // Prefixes, and single tokens at other rows of the instruction than in the full run (a decode
    // step puts a token on row 0 of its tile, a prefill on any row).
    let prefixes = args.tokens.iter().map(|&n| (0, n));
    let singles = (1..most.min(8)).chain([most - 1]).map(|t| (t, 1));
    let what = format!("{name} {dtype} {kernel}");
    check_windows(
        prefixes.chain(singles),
        (most, out),
        &all,
        run,
        &what,
        failures,
    )?;
    if let Some(widened) = widened_tiles(path, dtype) {
        let f32_run = k.read_f32(&k.linear_with(&k.upload_f32(&x), most, &dw, widened)?)?;
        let bad = contract_mismatches(&all, &f32_run, dtype);
        if bad > 0 {
            failures.push(format!(
                "{name} {dtype} {kernel}: {bad} values of the half run are not round(the run on widened inputs)"
            ));
        }
    }
    println!(
        "{name} {dtype} {kernel}: max rel err beyond rounding {err:.2e}, batch invariance checked"
    );
    Ok(())
}

/// Each window `(first, n)` of tokens (those shorter than `most`) run alone must give the bits of the
/// same tokens in `all`, the run on all `most` tokens (`width` values per token).
pub(super) fn check_windows(
    windows: impl Iterator<Item = (usize, usize)>,
    (most, width): (usize, usize),
    all: &[f32],
    run: impl Fn(usize, usize) -> anyhow::Result<Vec<f32>>,
    what: &str,
    failures: &mut Vec<String>,
) -> anyhow::Result<()> {
    for (first, n) in windows.filter(|&(_, n)| n < most) {
        let got = run(first, n)?;
        let same = &all[first * width..(first + n) * width];
        let differ = contract_mismatches(&got, same, ActDType::F32);
        if differ > 0 {
            failures.push(format!(
                "{what}: tokens {first}..{} alone differ from the same tokens of n={most} in {differ} values",
                first + n
            ));
        }
    }
    Ok(())
}

/// What a mixed-precision training forward launches for the tiles' `path` on `dtype` activations: the
/// same half operands, from f32 inputs holding the half values, the result in f32 (rounded to the
/// type, the half run's bits). `None` for f32 activations or the canonical kernels.
pub(super) fn widened_tiles(path: MatmulPath, dtype: ActDType) -> Option<MatmulPath> {
    let (tensor_cores, _) = path.tiles(dtype)?;
    (dtype != ActDType::F32).then_some(MatmulPath::Tiles {
        tensor_cores,
        operand: dtype,
    })
}

/// The grouped MoE block in the tensor-core tiles' order (`path`: [`MatmulPath::Mma`] or
/// [`MatmulPath::GroupedScalar`]) on the largest token count: its first tokens within the type's
/// rounding plus the tensor-core tolerance of the host reference (with the SwiGLU output rounded to
/// the type, as the tiles stage it), each smaller count's tokens bitwise the first rows of the largest
/// (the routing of a prefix is the prefix's), and the first tokens decoded one at a time bitwise
/// theirs too: the bits do not depend on the batch.
#[allow(clippy::too_many_arguments)]
pub(super) fn check_grouped_moe(
    args: &KernelBenchArgs,
    k: &Kernels,
    block: &MoeBlock,
    name: &str,
    dtype: ActDType,
    (path, kernel): (MatmulPath, &str),
    failures: &mut Vec<String>,
) -> anyhow::Result<()> {
    let (hidden, top_k, experts) = (args.hidden, args.top_k, args.experts);
    let most = args.most_tokens();
    let ids = random_routing(most, top_k, experts, 4242);
    let round = |v: Vec<f32>| -> Vec<f32> { v.iter().map(|v| dtype.round(*v)).collect() };
    let x = round(values(most * hidden, 4243));
    let rw = round(
        values(most * top_k, 4244)
            .iter()
            .map(|v| v.abs() / 4.0)
            .collect(),
    );
    // The block on tokens `first..first + n`, read back.
    let run = |first: usize, n: usize| -> anyhow::Result<Vec<f32>> {
        let ids = &ids[first * top_k..(first + n) * top_k];
        let routing = MoeRouting::new(ids, n, top_k, experts)?;
        let dx = k.upload(&x[first * hidden..(first + n) * hidden], dtype)?;
        let drw = k.upload(&rw[first * top_k..(first + n) * top_k], dtype)?;
        Ok(k.read_f32(&k.moe_with(&dx, &routing, &drw, block.device, path)?)?)
    };
    let all = run(0, most)?;
    let checked = most.min(8);
    let routing = MoeRouting::new(&ids[..checked * top_k], checked, top_k, experts)?;
    let want = reference::moe_staged(
        &x[..checked * hidden],
        &routing,
        &ids[..checked * top_k],
        &rw[..checked * top_k],
        block.weights,
        |v| dtype.round(v),
    );
    let err = max_rounded_err(&all[..checked * hidden], &want, dtype);
    if err > 1e-3 {
        failures.push(format!(
            "{name} {dtype} {kernel} n={most}: max rel err beyond rounding {err:.2e} (first {checked} tokens)"
        ));
    }
    let prefixes = args.tokens.iter().map(|&n| (0, n));
    let singles = (0..checked).map(|t| (t, 1));
    let what = format!("{name} {dtype} {kernel}");
    check_windows(
        prefixes.chain(singles),
        (most, hidden),
        &all,
        run,
        &what,
        failures,
    )?;
    if let Some(widened) = widened_tiles(path, dtype) {
        let routing = MoeRouting::new(&ids, most, top_k, experts)?;
        let y = k.moe_with(
            &k.upload_f32(&x),
            &routing,
            &k.upload_f32(&rw),
            block.device,
            widened,
        )?;
        let bad = contract_mismatches(&all, &k.read_f32(&y)?, dtype);
        if bad > 0 {
            failures.push(format!(
                "{name} {dtype} {kernel}: {bad} values of the half run are not round(the run on widened inputs)"
            ));
        }
    }
    println!(
        "{name} {dtype} {kernel}: max rel err beyond rounding {err:.2e}, batch invariance checked (counts {:?}, tokens 0..{checked} one at a time)",
        args.tokens
    );
    Ok(())
}

/// The kernels with `path`'s other staging and its row suffix, of `[one step, the most]`: the
/// tensor-core tiles stage one K step per pair of barriers by default, the scalar twins the most.
pub(super) fn other_staging(
    path: MatmulPath,
    dtype: ActDType,
    staged: &[Kernels; 2],
) -> (&Kernels, &str) {
    let tensor_cores = path
        .tiles(dtype)
        .is_some_and(|(tensor_cores, _)| tensor_cores);
    if Kernels::stages_one_step_by_default(tensor_cores) {
        (&staged[1], "-staged")
    } else {
        (&staged[0], "-x1")
    }
}

/// The timing of `run` on `other`, the kernels with the other staging (the `-x1` and `-staged` rows);
/// with `--check`, a failure if its bits differ from `run` on `k`, the default staging.
pub(super) fn time_other_staging(
    args: &KernelBenchArgs,
    [k, other]: [&Kernels; 2],
    run: impl Fn(&Kernels) -> DeviceBuffer,
    sync: &dyn Fn(),
    what: &str,
    failures: &mut Vec<String>,
) -> anyhow::Result<Timing> {
    if args.check {
        let (default, other_bits) = (k.read_f32(&run(k))?, k.read_f32(&run(other))?);
        // f32 rounds nothing: the count of values whose bits differ.
        let differ = contract_mismatches(&other_bits, &default, ActDType::F32);
        if differ > 0 {
            failures.push(format!(
                "{what}: the other staging differs from the default in {differ} values"
            ));
        }
    }
    Ok(time(args.iters, || drop(run(other)), sync))
}
