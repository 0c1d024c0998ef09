//! Run-time backend selection. Model code is written once against burn's `Device`; this is the only place
//! that knows which backends exist, and each non-default one is behind its cargo feature.

use std::fmt;

/// A compute backend the user can pick with `--backend`.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    /// Pure-Rust CPU backend (default, always built).
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
    /// The device for this backend, or an error saying which cargo feature to build with.
    pub fn device(self) -> anyhow::Result<burn::tensor::Device> {
        match self {
            Self::Flex => Ok(burn::tensor::Device::flex()),
            #[cfg(feature = "wgpu")]
            Self::Wgpu => Ok(burn::tensor::Device::wgpu(burn::tensor::DeviceKind::DefaultDevice)),
            #[cfg(feature = "cuda")]
            Self::Cuda => Ok(burn::tensor::Device::cuda(0)),
            #[allow(unreachable_patterns)]
            other => anyhow::bail!(
                "backend `{other}` is not compiled in: rebuild with `cargo build --release --features {other}`"
            ),
        }
    }
}
