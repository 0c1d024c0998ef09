//! Recorded launch sequences ([`Kernels::record`]) on the wgpu runtime (lavapipe in CI; a software graph
//! there, a CUDA graph on CUDA): the MoE block's decode step, recorded once, replays bitwise what the
//! same launches compute directly, on the recorded inputs and on new ones written in place.
//!
//! Its own test binary, its tests one at a time: while a capture records, the runtime refuses reads on
//! the stream it records on, which other tests of one process could share.
#![cfg(feature = "wgpu")]

use cube_kernels::{ActDType, DeviceBuffer, Kernels, MatmulPath, PackedWeights, WeightFormat};
mod common;
use common::kernels;

const EXPERTS: usize = 8;
const HIDDEN: usize = 64;
const INTER: usize = 96;
const TOP_K: usize = 4;

/// A decode step's inputs: activations, `TOP_K` distinct expert ids per token and routing weights.
fn step_inputs(tokens: usize, seed: u64) -> (Vec<f32>, Vec<u32>, Vec<f32>) {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    let mut uniform = move || (next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
    let x = (0..tokens * HIDDEN).map(|_| uniform()).collect();
    let ids = (0..tokens)
        .flat_map(|t| {
            let first = (seed as usize + 3 * t) % EXPERTS;
            (0..TOP_K).map(move |j| ((first + 2 * j + j / 4) % EXPERTS) as u32)
        })
        .collect();
    let route_w = (0..tokens * TOP_K).map(|_| uniform().abs()).collect();
    (x, ids, route_w)
}

/// The decode step of the MoE block: routing on the device, the grouped GEMV, down projection and
/// combine as two launches (`inputs`: activations, expert ids, routing weights).
fn decode(
    k: &Kernels,
    inputs: &[DeviceBuffer],
    weights: &[cube_kernels::DeviceWeights; 3],
    tokens: usize,
) -> Result<DeviceBuffer, cube_kernels::KernelError> {
    let table = k.route(&inputs[1], tokens, TOP_K, EXPERTS)?;
    let [gate, up, down] = weights;
    k.moe_routed(
        &inputs[0],
        &table,
        &inputs[2],
        [gate, up, down],
        MatmulPath::Gemv,
    )
}

/// Held by each test: one recording at a time in this process (a capture refuses reads on its stream).
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
#[ignore = "needs a wgpu adapter (a Vulkan driver, e.g. Mesa lavapipe: mesa-vulkan-drivers); .ci/run installs it and runs --include-ignored"]
fn a_recorded_moe_decode_replays_the_launches_bitwise() {
    let Some(k) = kernels() else { return };
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let k = k.clone().with_decode_combine(Some(false));
    let format = WeightFormat::Int4 { group: 32 };
    let weights = [(INTER, HIDDEN, 1), (INTER, HIDDEN, 2), (HIDDEN, INTER, 3)]
        .map(|(out, inn, seed)| PackedWeights::random(format, EXPERTS, out, inn, 40 + seed))
        .map(|w| k.upload_weights(&w.unwrap()));
    for (tokens, dtype) in [(1, ActDType::F32), (3, ActDType::F32), (3, ActDType::F16)] {
        if !k.supports(dtype) {
            continue;
        }
        let what = format!("{tokens} tokens, {dtype}");
        let upload = |(x, ids, rw): &(Vec<f32>, Vec<u32>, Vec<f32>)| {
            vec![
                k.upload(x, dtype).unwrap(),
                k.upload_u32(ids),
                k.upload(rw, dtype).unwrap(),
            ]
        };
        let direct = |step: &(Vec<f32>, Vec<u32>, Vec<f32>)| {
            let out = decode(&k, &upload(step), &weights, tokens).unwrap();
            k.read_f32(&out).unwrap()
        };
        let first = step_inputs(tokens, 7);
        let recorded = k
            .record(upload(&first), |k, inputs| {
                decode(k, inputs, &weights, tokens)
            })
            .unwrap();
        // The recorded run only recorded: the output holds a result once a replay has run. Cleared
        // first, so that a replay that wrote nothing fails here.
        let want = direct(&first);
        assert!(want.iter().any(|v| *v != 0.0), "{what}: all zero");
        let output = recorded.output();
        k.write(output, &vec![0.0; output.len()]).unwrap();
        recorded.replay().unwrap();
        assert_eq!(
            bits(&k.read_f32(output).unwrap()),
            bits(&want),
            "{what}: replay"
        );
        // New activations, experts and weights written in place: each replay follows them.
        for seed in [8, 9, 10] {
            let step = step_inputs(tokens, seed);
            let [x, ids, rw] = recorded.inputs() else {
                panic!("three inputs")
            };
            k.write(x, &step.0).unwrap();
            k.write_u32(ids, &step.1).unwrap();
            k.write(rw, &step.2).unwrap();
            recorded.replay().unwrap();
            let got = k.read_f32(recorded.output()).unwrap();
            let want = direct(&step);
            assert_ne!(
                bits(&want),
                bits(&direct(&first)),
                "{what}: seed {seed} changes nothing"
            );
            assert_eq!(
                bits(&got),
                bits(&want),
                "{what}: replay after writing seed {seed}"
            );
        }
        // A write of the wrong length is refused, naming both lengths.
        let err = k.write(&recorded.inputs()[0], &[0.0; 3]).unwrap_err();
        assert!(
            err.to_string()
                .contains("writing 3 values into a buffer of"),
            "{err}"
        );
    }
}

/// A run that fails before or while recording is an error, and the runtime is left able to record; a
/// replay from another thread than the recording one is refused.
#[test]
#[ignore = "needs a wgpu adapter (a Vulkan driver, e.g. Mesa lavapipe: mesa-vulkan-drivers); .ci/run installs it and runs --include-ignored"]
fn a_failed_recording_is_an_error_and_leaves_recording_possible() {
    let Some(k) = kernels() else { return };
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let format = WeightFormat::Int8PerRow;
    let weights = [(INTER, HIDDEN, 4), (INTER, HIDDEN, 5), (HIDDEN, INTER, 6)]
        .map(|(out, inn, seed)| PackedWeights::random(format, EXPERTS, out, inn, 40 + seed))
        .map(|w| k.upload_weights(&w.unwrap()));
    let step = step_inputs(2, 11);
    let upload = || {
        vec![
            k.upload_f32(&step.0),
            k.upload_u32(&step.1),
            k.upload_f32(&step.2),
        ]
    };
    // Before recording: the warm-up run fails (too few ids for the tokens).
    let err = k
        .record(upload(), |k, inputs| decode(k, inputs, &weights, 5))
        .err()
        .expect("a route over too few ids");
    assert!(err.to_string().contains("expert ids"), "{err}");
    // While recording: the second run fails.
    let runs = std::cell::Cell::new(0);
    let err = k
        .record(upload(), |k, inputs| {
            runs.set(runs.get() + 1);
            let tokens = if runs.get() == 2 { 5 } else { 2 };
            decode(k, inputs, &weights, tokens)
        })
        .err()
        .expect("the recorded run fails");
    assert!(err.to_string().contains("expert ids"), "{err}");
    assert_eq!(runs.get(), 2);
    // And a recording after both replays what the launches compute.
    let recorded = k
        .record(upload(), |k, inputs| decode(k, inputs, &weights, 2))
        .unwrap();
    let output = recorded.output();
    k.write(output, &vec![0.0; output.len()]).unwrap();
    recorded.replay().unwrap();
    let want = k
        .read_f32(&decode(k, &upload(), &weights, 2).unwrap())
        .unwrap();
    assert!(want.iter().any(|v| *v != 0.0));
    assert_eq!(bits(&k.read_f32(output).unwrap()), bits(&want));
    // From another thread (another stream, unordered against this one's writes) a replay is refused.
    let elsewhere = std::thread::spawn(move || recorded.replay().err().map(|e| e.to_string()));
    let err = elsewhere
        .join()
        .unwrap()
        .expect("a replay from another thread is refused");
    assert!(err.contains("another thread"), "{err}");
}
