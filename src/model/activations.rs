//! The precision of the activations a forward passes between its ops (mixed precision).
//!
//! In `bf16` (or `f16`) the residual stream, the outputs of the projections, norms, RoPE, SwiGLU and
//! attention, and the KV cache are half-precision tensors, while the weights stay f32 masters (or packed
//! codes with f32 scales) and the optimizer state stays f32. Every op reads its half inputs exactly as
//! f32, computes in f32 in its fixed order and rounds its output once to the half type: what the CubeCL
//! kernels do with half activations, so a token's bits are the same on every backend that has the type.
//! Kept in f32 throughout: the norms' statistics, the attention's scores and softmax, the router's logits
//! and softmax, the LM head's logits and the loss. A MoE block rounds only its input and its output (the
//! grouped kernel sums the whole expert chain in f32). The rollout and the aligned training forward run
//! the same ops on the same types, so they still agree bit for bit.

use burn::tensor::{DType, Device, Tensor};

use serde::{Deserialize, Serialize};

/// The activations' type of every forward of a model (rollout, training, evaluation).
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum Activations {
    /// f32 everywhere (the reference).
    #[default]
    F32,
    /// bfloat16 activations, f32 weights and sums.
    Bf16,
    /// IEEE half activations, f32 weights and sums.
    F16,
}

impl std::fmt::Display for Activations {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::F32 => "f32",
            Self::Bf16 => "bf16",
            Self::F16 => "f16",
        })
    }
}

impl Activations {
    /// What to add to a report of non-finite values: f16's range ends at 65504, so a model whose
    /// activations grow past it is finite in f32 and bf16 and infinite here (the weights are not at fault).
    pub fn nonfinite_hint(self) -> &'static str {
        match self {
            Self::F16 => {
                " (with f16 activations any value beyond 65504 is infinite: bf16 or f32 keep the range)"
            }
            Self::F32 | Self::Bf16 => "",
        }
    }

    /// The tensor type.
    pub fn dtype(self) -> DType {
        match self {
            Self::F32 => DType::F32,
            Self::Bf16 => DType::BF16,
            Self::F16 => DType::F16,
        }
    }

    /// Whether `device` computes with this type: one small cast, product and read-back, with a panic
    /// (a backend without the type, such as wgpu's WGSL for bf16) turned into an error naming the type.
    /// CubeCL catches a panic on its device thread itself, logs it and hands back zeros, so wrong values
    /// are the same answer as a panic.
    pub fn check_device(self, device: &Device) -> anyhow::Result<()> {
        if self == Self::F32 {
            return Ok(());
        }
        let dev = device.clone();
        let probe = crate::host::probe_device(device, move || {
            let x = Tensor::<2>::ones([2, 2], &dev).cast(self.dtype());
            let y = (x.clone() * x).cast(DType::F32);
            crate::host::to_f32_vec(y)
        });
        let got = match probe {
            Ok(v) if v.iter().all(|&x| x == 1.0) => return Ok(()),
            Ok(v) => format!("1 x 1 gave {v:?}"),
            Err(_) => "the backend panicked".into(),
        };
        anyhow::bail!(
            "{self} activations are not supported on {device:?} (a test product in {self}: {got}); use \
             f32 activations or another backend"
        )
    }
}
