//! A small quantized MoE block and the routings the MoE tests replay (shared by the CPU and wgpu tests).

use std::path::Path;

use burn::tensor::{Device, Tensor};
use qarl::host::tensor_from_vec;
use qarl::model::layers::Linear;
use qarl::model::mlp::{routing_to_host, DeviceRouting, MoeBlock, Replay, SwiGlu};
use qarl::model::scoring::response_logprobs;
use qarl::model::Decoder;
use qarl::quant::{QuantConfig, QuantScheme};

use super::values;

pub const MOE_SCHEMES: [QuantScheme; 5] = [
    QuantScheme::Int4G32,
    QuantScheme::Int8PerChannel,
    QuantScheme::Fp8Block128,
    QuantScheme::Nvfp4,
    QuantScheme::Mxfp4,
];
pub const HIDDEN: usize = 64;
pub const INTER: usize = 32;
pub const EXPERTS: usize = 8;
pub const TOP_K: usize = 2;
pub const TOKENS: usize = 21;

/// An unquantized linear layer with HF-layout (`[out, in]`) weights `w`.
pub fn linear(w: &[f32], out: usize, inn: usize, device: &Device) -> Linear {
    let w_in_out = tensor_from_vec(w.to_vec(), [out, inn], device).transpose();
    Linear {
        weight: burn::module::Param::from_tensor(Tensor::from_data(w_in_out.into_data(), device)),
        bias: None,
        quant: None,
    }
}

/// A quantized MoE block (hidden 64, inter 32, 8 experts, top-2) from fixed values; with `autodiff` every
/// master and the router require gradients.
pub fn moe_block(device: &Device, scheme: QuantScheme, autodiff: bool) -> MoeBlock {
    let lin = |out: usize, inn: usize, seed: u64, quantize: bool| {
        let w: Vec<f32> = values(out * inn, seed).iter().map(|v| 0.4 * v).collect();
        let mut l = linear(&w, out, inn, device);
        if autodiff {
            l.weight = l.weight.clone().map(|t| t.require_grad());
        }
        if quantize {
            l.quantize(scheme).unwrap();
        }
        l
    };
    let experts = (0..EXPERTS as u64)
        .map(|e| SwiGlu {
            gate_proj: lin(INTER, HIDDEN, 100 + 3 * e, true),
            up_proj: lin(INTER, HIDDEN, 101 + 3 * e, true),
            down_proj: lin(HIDDEN, INTER, 102 + 3 * e, true),
        })
        .collect();
    MoeBlock {
        gate: lin(EXPERTS, HIDDEN, 99, false),
        experts,
        top_k: TOP_K,
        norm_topk_prob: true,
    }
}

/// A layer's routing, read from the device.
pub fn host_ids(r: DeviceRouting) -> Vec<u32> {
    routing_to_host(vec![Some(r)])
        .remove(0)
        .expect("one MoE layer")
}

/// `ids` (a routing of [`moe_routings`]) replayed on `device`.
pub fn replay<'a>(ids: Option<&'a [u32]>, device: &Device) -> Option<Replay<'a>> {
    ids.map(|r| Replay::upload(r, TOP_K, device))
}

/// The routings the MoE tests replay (`None`: the router's own top-2).
pub fn moe_routings() -> Vec<(&'static str, Option<Vec<u32>>)> {
    // Ragged: expert 7 gets no token, expert 6 exactly one (token 4, slot 1), the others uneven groups.
    let mut ragged: Vec<u32> = (0..TOKENS as u32 * 2)
        .map(|i| {
            let t = i / 2;
            if i % 2 == 0 {
                t % 3
            } else {
                3 + (t * t) % 3
            }
        })
        .collect();
    ragged[4 * 2 + 1] = 6;
    let all_to_one: Vec<u32> = (0..TOKENS).flat_map(|_| [2, 5]).collect();
    vec![
        ("ragged", Some(ragged)),
        ("all tokens to experts 2 and 5", Some(all_to_one)),
        ("router top-2", None),
    ]
}

pub fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|f| f.to_bits()).collect()
}

/// The response log-probs of `seqs` from the model in `dir` quantized with `scheme`, by the inference
/// (rollout) forward on `infer_dev` and by the training forward on `train_dev` (an autodiff device, every
/// master weight tracked): `(inference, training)`.
pub fn infer_and_train_logprobs(
    dir: &Path,
    infer_dev: &Device,
    train_dev: &Device,
    scheme: QuantScheme,
    seqs: &[Vec<u32>],
    prompt_lens: &[usize],
) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let cfg = QuantConfig::new(scheme);
    let mut infer = Decoder::load(dir, infer_dev).unwrap();
    infer.quantize(&cfg).unwrap();
    let mut train = Decoder::load(dir, train_dev).unwrap();
    for (_, lin) in train.linears_mut() {
        lin.weight = lin.weight.clone().map(|t| t.require_grad());
    }
    train.quantize(&cfg).unwrap();
    (
        response_logprobs(&infer, seqs, prompt_lens, 1.0),
        response_logprobs(&train, seqs, prompt_lens, 1.0),
    )
}
