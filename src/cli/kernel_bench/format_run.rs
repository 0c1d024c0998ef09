//! What the dense rows and the MoE block's rows of one weight format and activation type share.

use burn::tensor::{DType, Device};
use cube_kernels::{ActDType, Kernels, MatmulPath, WeightFormat};

use super::checks::values;
use super::KernelBenchArgs;

/// One weight format with one activation type: what its dense rows ([`super::dense::bench`]) and its
/// MoE block's ([`super::moe::bench`]) share.
pub(super) struct FormatRun<'a> {
    pub args: &'a KernelBenchArgs,
    pub k: &'a Kernels,
    pub device: &'a Device,
    /// The baseline matmul's type.
    pub base: DType,
    /// The copy bandwidth measured in this run (GB/s).
    pub copy_gbs: f64,
    pub name: &'a str,
    pub format: WeightFormat,
    pub dtype: ActDType,
    /// The same kernels with the tiles' other staging: one K step per pair of barriers where the
    /// default stages as many as the device's shared memory holds (the scalar twins), and the most
    /// where the default stages one (the tensor-core tiles).
    pub staged: [Kernels; 2],
    /// The kernels with the tiles' order on the fragment tiles (`-frag`).
    pub frag: Kernels,
    /// Its layouts, as the rows name them ([`super::checks::fragment_variants`]).
    pub variants: Vec<(&'static str, Kernels)>,
    /// The tensor-core tiles' order: with scalar FMAs on any device, on tensor cores where it has
    /// them (the dense rows' labels).
    pub grouped: Vec<(MatmulPath, &'static str)>,
    /// The same order on the fragment tiles, where the device has their instruction.
    pub frag_grouped: Vec<(MatmulPath, String)>,
}

impl FormatRun<'_> {
    /// `n` inputs already in the activations' type, so the host reference and the f32 run see what the
    /// kernel widens.
    pub fn act_values(&self, n: usize, seed: u64) -> Vec<f32> {
        values(n, seed)
            .iter()
            .map(|v| self.dtype.round(*v))
            .collect()
    }
}
