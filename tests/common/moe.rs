//! A small quantized MoE block and the routings the MoE tests replay (shared by the CPU and wgpu tests).

use burn::tensor::{Device, Tensor};
use qarl::model::layers::{tensor_from_vec, Linear};
use qarl::model::mlp::{MoeBlock, SwiGlu};
use qarl::quant::QuantScheme;

use super::values;

pub const MOE_SCHEMES: [QuantScheme; 3] = [
    QuantScheme::Int4G32,
    QuantScheme::Int8PerChannel,
    QuantScheme::Fp8Block128,
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
