//! The decoder against transformers on the committed fixtures (tests/fixtures/make_hf_fixtures.py):
//! full-sequence logits, greedy generations, and KV-cache decoding against the full forward.

mod common;

use burn::tensor::Device;
use common::{fixture_models, max_abs_diff, reference};
use qarl::host::rows;
use qarl::host::to_f32_vec;
use qarl::model::Decoder;
use qarl::rollout::generate_greedy;

#[test]
fn logits_match_transformers() {
    let device = Device::flex();
    for dir in fixture_models() {
        let r = reference(&dir);
        let model = Decoder::load(&dir, &device).unwrap();
        let got = to_f32_vec(model.forward(&r.input_ids, None, None, None).logits);
        let want: Vec<f32> = r.logits.iter().flatten().flatten().copied().collect();
        let diff = max_abs_diff(&got, &want);
        let scale = want.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        println!(
            "{}: max |logit diff| = {diff:.3e} (max |logit| {scale:.2})",
            dir.display()
        );
        assert!(
            diff <= 1e-4,
            "{}: max |logit diff| {diff} > 1e-4",
            dir.display()
        );
    }
}

#[test]
fn greedy_generation_matches_transformers() {
    let device = Device::flex();
    for dir in fixture_models() {
        let r = reference(&dir);
        let model = Decoder::load(&dir, &device).unwrap();
        let got = generate_greedy(&model, &r.greedy.prompt_ids, r.greedy.max_new_tokens, &[]);
        assert_eq!(got, r.greedy.ids, "{}: greedy ids differ", dir.display());
    }
}

/// Decoding token by token with the cache gives the logits of the full-sequence forward.
#[test]
fn kv_cache_decode_equals_full_forward() {
    let device = Device::flex();
    for dir in fixture_models() {
        let r = reference(&dir);
        let model = Decoder::load(&dir, &device).unwrap();
        let ids = &r.input_ids;
        let t = ids[0].len();
        let full = rows(
            model
                .forward(ids, None, None, None)
                .logits
                .reshape([ids.len() * t, model.config.vocab_size]),
        );
        let prefix = 4;
        let mut cache = model.new_cache(ids.len());
        let pre: Vec<Vec<u32>> = ids.iter().map(|r| r[..prefix].to_vec()).collect();
        let mut steps = vec![model.forward(&pre, None, Some(&mut cache), None).logits];
        for pos in prefix..t {
            let step: Vec<Vec<u32>> = ids.iter().map(|r| vec![r[pos]]).collect();
            steps.push(model.forward(&step, None, Some(&mut cache), None).logits);
        }
        let inc = burn::tensor::Tensor::cat(steps, 1);
        let inc = rows(inc.reshape([ids.len() * t, model.config.vocab_size]));
        let mut worst = 0.0f32;
        for (a, b) in inc.iter().zip(&full) {
            worst = worst.max(max_abs_diff(a, b));
        }
        println!("{}: max |cached - full| = {worst:.3e}", dir.display());
        assert!(
            worst <= 1e-5,
            "{}: cached decode differs from the full forward by {worst}",
            dir.display()
        );
        assert_eq!(cache.lens, vec![t; ids.len()]);
    }
}

/// A right-padded row computes what it computes alone, in prefill and in cached decoding with rows of
/// different lengths.
#[test]
fn padding_is_invisible() {
    let device = Device::flex();
    for dir in fixture_models() {
        let r = reference(&dir);
        let model = Decoder::load(&dir, &device).unwrap();
        let long = r.input_ids[0].clone();
        let short = r.input_ids[1][..6].to_vec();
        let mut padded = short.clone();
        padded.resize(long.len(), 0);
        let v = model.config.vocab_size;

        let mut cache = model.new_cache(2);
        let lens = [long.len(), short.len()];
        let batch = model
            .forward(&[long.clone(), padded], Some(&lens), Some(&mut cache), None)
            .logits;
        let alone = model
            .forward(std::slice::from_ref(&short), None, None, None)
            .logits;
        let batch_row = rows(batch.narrow(0, 1, 1).reshape([long.len(), v]));
        let alone = rows(alone.reshape([short.len(), v]));
        for (i, a) in alone.iter().enumerate() {
            let d = max_abs_diff(a, &batch_row[i]);
            println!("{} prefill tok {i}: {d:e}", dir.display());
            assert!(
                d <= 1e-5,
                "{}: padded prefill differs at token {i}: {d}",
                dir.display()
            );
        }
        // Cached steps on both rows against each row extended by the same tokens, scored in full.
        let mut ext = [long.clone(), short.clone()];
        for next in [7u32, 100, 3] {
            let step = model
                .forward(&[vec![next], vec![next]], None, Some(&mut cache), None)
                .logits;
            let step = rows(step.reshape([2, v]));
            for (row, seq) in ext.iter_mut().enumerate() {
                seq.push(next);
                let full = model
                    .forward(std::slice::from_ref(seq), None, None, None)
                    .logits;
                let full = rows(full.narrow(1, seq.len() - 1, 1).reshape([1, v]));
                let d = max_abs_diff(&full[0], &step[row]);
                println!("{} step row {row}: {d:e}", dir.display());
                assert!(
                    d <= 1e-5,
                    "{}: cached ragged step differs on row {row}: {d}",
                    dir.display()
                );
            }
        }
        assert_eq!(cache.lens, vec![long.len() + 3, short.len() + 3]);
    }
}
