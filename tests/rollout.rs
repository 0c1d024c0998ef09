//! The rollout engine: recorded log-probs against the full forward, seeds, stops, routing records, and
//! batching invariances (padding, fan-out of samples).

mod common;

use burn::tensor::Device;
use common::{fixture_models, fixtures_dir, ragged_prompts as prompts};
use qarl::model::mlp::routing_to_host;
use qarl::model::scoring::{forward_ragged, response_logprobs};
use qarl::model::{Decoder, Weights};
use qarl::rollout::{generate, generate_greedy, FinishReason, SamplingParams};

fn sampling() -> SamplingParams {
    common::sampling(1234)
}

/// Must-show: the log-prob the sampler recorded is bitwise the learner's full-forward log-prob of the same
/// token (same model, same precision, same temperature; deterministic mode).
#[test]
fn recorded_logprobs_equal_full_forward() {
    let device = Device::flex();
    for dir in fixture_models() {
        let model = Decoder::load(&dir, &device).unwrap();
        let params = sampling();
        let out = generate(&model, &prompts(), 3, &params, None);
        assert_eq!(out.ids.len(), 9);
        let full = response_logprobs(&model, &out.ids, &out.prompt_lens, params.temperature);
        let (mut worst, mut bitwise, mut n) = (0.0f32, 0usize, 0usize);
        for (rec, fwd) in out.logprobs.iter().zip(&full) {
            assert_eq!(rec.len(), fwd.len());
            for (a, b) in rec.iter().zip(fwd) {
                worst = worst.max((a - b).abs());
                bitwise += usize::from(a.to_bits() == b.to_bits());
                n += 1;
            }
        }
        println!(
            "{}: max |recorded - full| = {worst:.3e}, bitwise equal {bitwise}/{n}",
            dir.display()
        );
        // Deterministic mode (the default): every product, softmax and reduction of the cached decode (one
        // query row) and of the full forward (T query rows) runs in a fixed, batch-invariant order, so the
        // two agree to the bit on every architecture of the fixtures.
        assert_eq!(
            bitwise,
            n,
            "{}: recorded log-probs differ by up to {worst}",
            dir.display()
        );
        assert!(n > 0);
    }
}

#[test]
fn same_seed_same_tokens_different_seed_different_tokens() {
    let model = Decoder::load(fixtures_dir().join("qwen3_moe"), &Device::flex()).unwrap();
    let p = sampling();
    let a = generate(&model, &prompts(), 2, &p, None);
    let b = generate(&model, &prompts(), 2, &p, None);
    assert_eq!(a.ids, b.ids);
    assert_eq!(a.logprobs, b.logprobs);
    let c = generate(
        &model,
        &prompts(),
        2,
        &SamplingParams {
            seed: 99,
            ..p.clone()
        },
        None,
    );
    assert_ne!(a.ids, c.ids);
    // Samples of one prompt differ from each other (independent streams).
    assert_ne!(a.ids[0], a.ids[1]);
}

/// A sequence's tokens depend only on (seed, its row index), not on the other prompts of the batch.
#[test]
fn a_prompt_alone_samples_what_it_samples_in_a_batch() {
    let model = Decoder::load(fixtures_dir().join("qwen3"), &Device::flex()).unwrap();
    let p = sampling();
    let batch = generate(&model, &prompts(), 1, &p, None);
    let alone = generate(&model, &prompts()[..1], 1, &p, None);
    assert_eq!(batch.ids[0], alone.ids[0]);
}

#[test]
fn greedy_with_ragged_prompts_matches_each_prompt_alone() {
    let model = Decoder::load(fixtures_dir().join("qwen3_moe"), &Device::flex()).unwrap();
    let batch = generate_greedy(&model, &prompts(), 8, &[]);
    for (i, pr) in prompts().iter().enumerate() {
        let alone = generate_greedy(&model, std::slice::from_ref(pr), 8, &[]);
        assert_eq!(batch[i], alone[0], "prompt {i}");
    }
}

#[test]
fn stop_tokens_and_lengths() {
    let model = Decoder::load(fixtures_dir().join("qwen3"), &Device::flex()).unwrap();
    let free = generate(&model, &prompts(), 2, &sampling(), None);
    assert!(free
        .finish_reasons
        .iter()
        .all(|&f| f == FinishReason::Length));
    assert!(free.logprobs.iter().all(|l| l.len() == 10));
    // Stop on the third token that row 0 produced: it finishes there with reason `stop`, token kept.
    let stop = free.response(0)[2];
    let p = SamplingParams {
        stop_token_ids: vec![stop],
        ..sampling()
    };
    let out = generate(&model, &prompts(), 2, &p, None);
    let first = out.response(0).iter().position(|&t| t == stop).unwrap();
    assert_eq!(out.response(0).len(), first + 1);
    assert_eq!(out.finish_reasons[0], FinishReason::Stop);
    assert_eq!(out.logprobs[0].len(), out.response(0).len());
    // Rows that did not meet the stop token are untouched by another row finishing early.
    for r in 1..out.ids.len() {
        if !free.response(r).contains(&stop) {
            assert_eq!(out.ids[r], free.ids[r], "row {r}");
            assert_eq!(out.finish_reasons[r], FinishReason::Length);
        }
    }
}

/// For MoE models the engine records the experts of every token that went through the model; they are
/// the experts a full forward of the final sequence picks, and replaying them reproduces its logits.
#[test]
fn moe_routing_is_recorded() {
    let model = Decoder::load(fixtures_dir().join("qwen3_moe"), &Device::flex()).unwrap();
    let k = model.config.moe.as_ref().unwrap().num_experts_per_tok;
    let out = generate(&model, &prompts(), 2, &sampling(), None);
    for (r, seq) in out.ids.iter().enumerate() {
        let (full, _) = forward_ragged(&model, Weights::Packed, std::slice::from_ref(seq), None);
        let full_routing = routing_to_host(full.routing);
        for (layer, rec) in out.routing[r].iter().enumerate() {
            let sparse = model.config.is_sparse_layer(layer);
            assert_eq!(rec.is_some(), sparse, "layer {layer}");
            if let Some(rec) = rec {
                assert_eq!(rec.len(), (seq.len() - 1) * k);
                let fwd = full_routing[layer].as_ref().unwrap();
                assert_eq!(&fwd[..rec.len()], &rec[..], "row {r} layer {layer}");
            }
        }
    }
}

/// The learner-side forward is batch-invariant: a sequence scored inside a right-padded batch of other
/// lengths gets bitwise the log-probs it gets alone (the attention key axis is padded to a fixed block).
#[test]
fn full_forward_logprobs_do_not_depend_on_the_batch() {
    let model = Decoder::load(fixtures_dir().join("qwen3_moe"), &Device::flex()).unwrap();
    let out = generate(&model, &prompts(), 2, &sampling(), None);
    let batch = response_logprobs(&model, &out.ids, &out.prompt_lens, 0.8);
    for (r, row) in batch.iter().enumerate() {
        let alone = response_logprobs(&model, &out.ids[r..r + 1], &out.prompt_lens[r..r + 1], 0.8);
        let same = alone[0]
            .iter()
            .zip(row)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "row {r}: {:?} vs {row:?}", alone[0]);
    }
}

/// The prefill's logits at chosen positions are the full forward's rows at those positions, bit for bit
/// (deterministic mode's LM head is row-invariant), for every fixture model.
#[test]
fn logits_at_positions_are_the_full_forwards_rows() {
    let device = Device::flex();
    for dir in fixture_models() {
        let model = Decoder::load(&dir, &device).unwrap();
        let ids = prompts();
        let padded = qarl::model::scoring::right_pad(&ids);
        let t = padded[0].len();
        let lens: Vec<usize> = ids.iter().map(Vec::len).collect();
        let at: Vec<usize> = lens.iter().map(|l| l - 1).collect();
        let full = model.forward(&padded, Some(&lens), None, None).logits;
        let some = model
            .forward_logits_at(&padded, Some(&lens), None, None, Some(&at))
            .logits;
        let [b, _, v] = full.dims();
        assert_eq!(some.dims(), [b, 1, v]);
        let full = qarl::host::to_f32_vec(full);
        let some = qarl::host::to_f32_vec(some);
        for (r, &p) in at.iter().enumerate() {
            let want = &full[(r * t + p) * v..(r * t + p + 1) * v];
            let got = &some[r * v..(r + 1) * v];
            assert!(
                want.iter()
                    .zip(got)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{}: row {r} position {p}",
                dir.display()
            );
        }
    }
}

/// Rows of different lengths write each new key at the row's own position; the cache's buffers stay as wide
/// as the attention's key axis (a multiple of `KEY_BLOCK`) and grow once per key block, never by a slot
/// per decode step (each such growth copied every layer's keys and values, and the attention copied them
/// again to pad them to the mask's width).
#[test]
fn ragged_cache_buffers_grow_by_key_blocks() {
    use qarl::model::decoder::KEY_BLOCK;
    let model = Decoder::load(fixtures_dir().join("qwen3"), &Device::flex()).unwrap();
    // Right-padded prompts of 5 and 2 real tokens.
    let ids = vec![vec![1, 2, 3, 4, 5], vec![6, 7, 0, 0, 0]];
    let mut cache = model.new_cache(2);
    model.hidden_cached(Weights::Packed, &ids, &[5, 2], &mut cache, None, None);
    let widths = |cache: &qarl::model::decoder::KvCache| -> Vec<usize> {
        let kv = cache.layers.iter().flatten();
        kv.flat_map(|l| [l.k.dims()[2], l.v.dims()[2]]).collect()
    };
    assert!(!widths(&cache).is_empty());
    for step in 0..KEY_BLOCK {
        model.hidden_cached(
            Weights::Packed,
            &[vec![8], vec![9]],
            &[1, 1],
            &mut cache,
            None,
            None,
        );
        let longest = 5 + step + 1;
        let want = longest.div_ceil(KEY_BLOCK) * KEY_BLOCK;
        for w in widths(&cache) {
            assert_eq!(
                w, want,
                "decode step {step}: buffer {w} slots, key axis {want}"
            );
        }
    }
}

/// The distribution `sample` draws from: `softmax(logits / T)` restricted to the `top_k` most likely
/// tokens, then to the top-p nucleus of their renormalised mass (the token that crosses `p` kept), and
/// renormalised (HF's and vLLM's order: temperature, top-k, top-p). Over 40000 draws (one stream each)
/// every token's frequency is within 5 standard errors of the exact probability worked out here in f64,
/// and a token outside the kept set is never drawn; greedy takes the first maximum.
#[test]
fn samples_follow_the_filtered_distribution() {
    use qarl::rollout::sampler::{sample, sequence_rng};
    let logits = [2.0f64, 1.0, 0.5, 0.0, -1.0, -3.0];
    // (temperature, top_k, top_p): p = 0.8 keeps three tokens (cumulative .561, .767, .892 at T = 1).
    let cases = [
        (1.0f32, 0usize, 1.0f64),
        (0.7, 0, 1.0),
        (1.0, 3, 1.0),
        (1.0, 0, 0.8),
        (1.3, 4, 0.9),
        (1.0, 100, 1.0),
    ];
    for (t, k, p) in cases {
        let scaled: Vec<f64> = logits.iter().map(|l| l / f64::from(t)).collect();
        let lse = scaled.iter().map(|x| x.exp()).sum::<f64>().ln();
        let logprobs: Vec<f32> = scaled.iter().map(|x| (x - lse) as f32).collect();
        // The logits are distinct and already in decreasing order: the kept set is a prefix.
        let probs: Vec<f64> = scaled.iter().map(|x| (x - lse).exp()).collect();
        let mut keep = if k == 0 {
            probs.len()
        } else {
            k.min(probs.len())
        };
        if p < 1.0 {
            let mass: f64 = probs[..keep].iter().sum();
            let mut acc = 0.0;
            for (n, q) in probs[..keep].iter().enumerate() {
                acc += q / mass;
                if acc >= p {
                    keep = n + 1;
                    break;
                }
            }
        }
        let kept: f64 = probs[..keep].iter().sum();
        let want: Vec<f64> = (0..probs.len())
            .map(|i| if i < keep { probs[i] / kept } else { 0.0 })
            .collect();
        let params = SamplingParams {
            temperature: t,
            top_k: k,
            top_p: p,
            ..SamplingParams::default()
        };
        let n = 40_000;
        let mut counts = vec![0usize; probs.len()];
        for i in 0..n {
            counts[sample(&logprobs, &params, &mut sequence_rng(11, i)) as usize] += 1;
        }
        for (token, (&c, &w)) in counts.iter().zip(&want).enumerate() {
            let freq = c as f64 / n as f64;
            if w == 0.0 {
                assert_eq!(
                    c, 0,
                    "T {t}, k {k}, p {p}: token {token} is outside the kept set"
                );
            } else {
                let se = (w * (1.0 - w) / n as f64).sqrt();
                assert!(
                    (freq - w).abs() <= 5.0 * se,
                    "T {t}, k {k}, p {p}: token {token} drawn {freq:.4} of the time, want {w:.4}"
                );
            }
        }
    }
    // Tokens tied with the k-th are kept, as HF and vLLM keep them: logits (2, 1, 1, 0) with k = 2 draw
    // from the first three, e^2 : e : e.
    let logprobs: Vec<f32> = {
        let l = [2.0f64, 1.0, 1.0, 0.0];
        let lse = l.iter().map(|x| x.exp()).sum::<f64>().ln();
        l.iter().map(|x| (x - lse) as f32).collect()
    };
    let top2 = SamplingParams {
        top_k: 2,
        ..SamplingParams::default()
    };
    let n = 40_000;
    let mut counts = [0usize; 4];
    for i in 0..n {
        counts[sample(&logprobs, &top2, &mut sequence_rng(5, i)) as usize] += 1;
    }
    let e = std::f64::consts::E;
    let kept = e * e + 2.0 * e;
    for (token, want) in [(0, e * e / kept), (1, e / kept), (2, e / kept), (3, 0.0)] {
        let freq = counts[token] as f64 / n as f64;
        let se = (want * (1.0 - want) / n as f64).sqrt().max(1e-12);
        assert!(
            (freq - want).abs() <= 5.0 * se,
            "tied top-k: token {token} drawn {freq:.4} of the time, want {want:.4}"
        );
    }
    let greedy = SamplingParams {
        temperature: 0.0,
        ..SamplingParams::default()
    };
    let tied = [-1.0f32, -0.5, -0.5, -2.0];
    assert_eq!(sample(&tied, &greedy, &mut sequence_rng(1, 0)), 1);
}

/// `processed_logprobs`: the recorded log-prob of a sampled token is the renormalised filtered
/// distribution's (vLLM's `processed_logprobs`): probabilities [0.5, 0.3, 0.2] under top-p 0.7 keep the
/// first two, so token 0 records ln(0.5 / 0.8) = -0.470 (the full vocabulary's -0.693); without a filter
/// the kept mass is exactly 1 and the record is the full log-prob, bit for bit.
#[test]
fn processed_logprobs_are_the_filtered_distributions() {
    use qarl::rollout::sampler::{sample_with_kept_mass, sequence_rng};
    let logprobs: Vec<f32> = [0.5f64, 0.3, 0.2].iter().map(|p| p.ln() as f32).collect();
    let top_p = SamplingParams {
        top_p: 0.7,
        ..SamplingParams::default()
    };
    for i in 0..200 {
        let (tok, log_kept) = sample_with_kept_mass(&logprobs, &top_p, &mut sequence_rng(3, i));
        assert!(tok < 2, "token {tok} outside the nucleus");
        assert!((log_kept - 0.8f64.ln()).abs() < 1e-7, "{log_kept}");
    }
    let processed = logprobs[0] as f64 - 0.8f64.ln();
    assert!((processed - (0.5f64 / 0.8).ln()).abs() < 1e-7 && (processed + 0.470).abs() < 1e-3);
    for params in [
        SamplingParams::default(),
        SamplingParams {
            temperature: 0.0,
            ..top_p.clone()
        },
    ] {
        let (_, log_kept) = sample_with_kept_mass(&logprobs, &params, &mut sequence_rng(3, 0));
        assert_eq!(log_kept, 0.0);
    }
    // Through the engine: with a filter every record is at least the full one (ln of a mass <= 1 taken
    // off), and above it where the filter cut; without one the records are the same bits.
    let device = Device::flex();
    let model = Decoder::load(fixtures_dir().join("qwen3"), &device).unwrap();
    let run = |top_p: f64, processed: bool| {
        let params = SamplingParams {
            top_p,
            max_new_tokens: 6,
            seed: 9,
            processed_logprobs: processed,
            ..SamplingParams::default()
        };
        generate(&model, &prompts(), 2, &params, None)
    };
    let (full, proc) = (run(0.8, false), run(0.8, true));
    assert_eq!(full.ids, proc.ids, "the record changes nothing drawn");
    let pairs: Vec<(f32, f32)> = full
        .logprobs
        .iter()
        .flatten()
        .copied()
        .zip(proc.logprobs.iter().flatten().copied())
        .collect();
    assert!(pairs.iter().all(|(f, p)| p >= f), "{pairs:?}");
    assert!(pairs.iter().any(|(f, p)| p > f), "{pairs:?}");
    let (full, proc) = (run(1.0, false), run(1.0, true));
    let bits = |r: &qarl::rollout::Rollout| -> Vec<u32> {
        r.logprobs.iter().flatten().map(|x| x.to_bits()).collect()
    };
    assert_eq!(bits(&full), bits(&proc));
}

/// What a decode step reads, as the rollout counts it for the bandwidth rates: the dense weights once,
/// of a MoE layer only the experts its token was routed to (every expert was counted), and the K and V
/// of the cache's padded key axis (left out).
#[test]
fn decode_reads_count_routed_experts_and_the_kv_cache() {
    let model = Decoder::load(fixtures_dir().join("qwen3_moe"), &Device::flex()).unwrap();
    // The fixture: 3 layers (the middle one dense), 8 experts of 64 x 32 SwiGLU in f32, 2 KV heads of 32.
    let experts = model.expert_weight_bytes();
    let expert = 3 * 64 * 32 * 4;
    assert_eq!(experts, vec![vec![expert; 8], vec![], vec![expert; 8]]);
    let k = model.config.moe.as_ref().unwrap().num_experts_per_tok;
    let params = qarl::rollout::SamplingParams {
        max_new_tokens: 4,
        ..sampling()
    };
    let prompt = prompts()[0].clone();
    let out = generate(&model, std::slice::from_ref(&prompt), 1, &params, None);
    assert_eq!(
        out.response(0).len(),
        4,
        "no stop token in the fixture's sampling"
    );
    assert_eq!(out.decode_steps, 3);
    let mut want = 0;
    for step in 0..3 {
        // The token fed at decode step s is the response's token s, at position prompt + s.
        let at = prompt.len() + step;
        let mut bytes = model.weight_bytes();
        for layer in [0, 2] {
            let rec = out.routing[0][layer].as_ref().unwrap();
            let routed: std::collections::BTreeSet<u32> =
                rec[at * k..(at + 1) * k].iter().copied().collect();
            bytes -= expert * (8 - routed.len());
        }
        want += bytes;
    }
    assert_eq!(out.decode_weight_bytes, want);
    assert!(want < 3 * model.weight_bytes());
    // A prompt under 64 tokens: one key block of 64 slots per step, K and V of 2 heads x 32 in f32 over 3
    // layers.
    assert!(prompt.len() + 4 < 64);
    assert_eq!(out.decode_key_slots, 3 * 64);
    assert_eq!(out.decode_kv_bytes, 3 * 64 * 3 * 2 * 2 * 32 * 4);
}
