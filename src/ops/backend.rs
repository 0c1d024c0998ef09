//! Run-time backend selection. Model code is written once against burn's `Device`; this is the only place
//! that knows which backends exist, and each non-default one is behind its cargo feature.

use std::fmt;

/// A compute backend the user can pick with `--backend`.
#[derive(
    Debug,
    Clone,
    Copy,
    Default,
    PartialEq,
    Eq,
    clap::ValueEnum,
    serde::Serialize,
    serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    /// Pure-Rust CPU backend (default, always built).
    #[default]
    Flex,
    /// wgpu (Vulkan / Metal / DX12, or Mesa's software Vulkan on a CPU-only machine); cargo feature `wgpu`.
    Wgpu,
    /// CUDA; cargo feature `cuda`.
    Cuda,
}

impl fmt::Display for BackendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Flex => "flex",
            Self::Wgpu => "wgpu",
            Self::Cuda => "cuda",
        })
    }
}

impl BackendKind {
    /// The device for this backend, or an error saying which cargo feature to build with, or that the
    /// machine has no such device. Training commands wrap it with `.autodiff()`; the inference ones use
    /// it as is.
    pub fn device(self) -> anyhow::Result<burn::tensor::Device> {
        match self {
            Self::Flex => Ok(burn::tensor::Device::flex()),
            #[cfg(feature = "wgpu")]
            Self::Wgpu => probed(
                self,
                burn::tensor::Device::wgpu(burn::tensor::DeviceKind::DefaultDevice),
            ),
            #[cfg(feature = "cuda")]
            Self::Cuda => probed(self, burn::tensor::Device::cuda(0)),
            #[allow(unreachable_patterns)]
            other => anyhow::bail!(
                "backend `{other}` is not compiled in: rebuild with `cargo build --release --features {other}`"
            ),
        }
    }
}

impl BackendKind {
    /// Whether the aligned training forward on this backend computes the rollout's log-probs bit for bit
    /// (every op of the forward batch-invariant: a token's bits do not depend on how many tokens are computed
    /// with it, so a full-sequence forward reproduces a decode of one token at a time). Then the trainer
    /// takes `lp_old` from the rollout's record instead of running a forward. In deterministic mode on every
    /// backend: the CPU's fixed-order kernels, and on CubeCL the `cube_kernels` low-bit and grouped MoE
    /// kernels with the fixed-order f32 matmul, softmax and RMSNorm mean (`src/ops/cube/exact.rs`).
    pub fn reproduces_rollout(self) -> bool {
        super::deterministic()
    }
}

/// `device` after one small upload and read-back: burn creates a GPU device lazily and panics on its first
/// op when the machine has none (no adapter, no driver), which this turns into an error naming the backend.
#[cfg(any(feature = "wgpu", feature = "cuda"))]
fn probed(kind: BackendKind, device: burn::tensor::Device) -> anyhow::Result<burn::tensor::Device> {
    let touch = device.clone();
    let read = crate::host::probe_device(&device, move || {
        crate::host::to_f32_vec(burn::tensor::Tensor::<1>::zeros([1], &touch)).len()
    });
    match read {
        Ok(1) => Ok(device),
        _ => anyhow::bail!(
            "backend `{kind}`: no usable device on this machine (wgpu needs a Vulkan, Metal or DX12 driver, \
             e.g. Mesa's lavapipe from `mesa-vulkan-drivers`; cuda an NVIDIA GPU and driver)"
        ),
    }
}
