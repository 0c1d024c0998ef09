//! The activations' element type: f32, f16 or bf16 ([`ActDType`]), and the host-side rounding the
//! precision contract of [`crate::kernels`] is stated in.

use cubecl::features::{MmaConfig, TypeUsage};
use cubecl::ir::{DeviceProperties, ElemType, FloatKind};

use crate::error::KernelError;
use crate::kernels::mma::MMA;

/// The element type of the activations a matmul reads and of the result it writes (weights, scales and
/// every sum are f32 whatever it is; see the precision contract in [`crate::kernels`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum ActDType {
    /// IEEE binary32.
    #[default]
    F32,
    /// IEEE binary16 (where the runtime has shader f16 and 16-bit storage).
    F16,
    /// bfloat16 (CUDA; Vulkan drivers with `VK_KHR_shader_bfloat16`).
    BF16,
}

impl ActDType {
    /// Every activation type, f32 first.
    pub const ALL: [ActDType; 3] = [ActDType::F32, ActDType::F16, ActDType::BF16];

    /// `f32`, `f16` or `bf16`.
    pub fn name(self) -> &'static str {
        match self {
            ActDType::F32 => "f32",
            ActDType::F16 => "f16",
            ActDType::BF16 => "bf16",
        }
    }

    /// Parses [`ActDType::name`].
    pub fn parse(s: &str) -> Result<Self, KernelError> {
        match s.trim().to_ascii_lowercase().as_str() {
            "f32" => Ok(ActDType::F32),
            "f16" => Ok(ActDType::F16),
            "bf16" => Ok(ActDType::BF16),
            other => Err(KernelError::Unsupported(format!(
                "activation dtype `{other}` (expected f32, f16 or bf16)"
            ))),
        }
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            ActDType::F32 => 4,
            ActDType::F16 | ActDType::BF16 => 2,
        }
    }

    /// CubeCL's element type, what the kernels are launched with.
    pub fn elem(self) -> ElemType {
        ElemType::Float(match self {
            ActDType::F32 => FloatKind::F32,
            ActDType::F16 => FloatKind::F16,
            ActDType::BF16 => FloatKind::BF16,
        })
    }

    /// Whether a device with `props` can hold and convert activations of this type (f32 always; f16 and
    /// bf16 as the runtime reports them: buffers of the type and conversions to and from f32 are all the
    /// kernels need).
    pub fn usable_on(self, props: &DeviceProperties) -> bool {
        self == ActDType::F32
            || props
                .type_usage(self.elem())
                .is_superset(TypeUsage::Buffer | TypeUsage::Conversion)
    }

    /// Whether a device with `props` has the `m16n16k16` tensor-core instruction on operands of this type
    /// with f32 accumulation, what the tensor-core tiles need (a half type; never f32).
    pub fn has_tensor_tiles_on(self, props: &DeviceProperties) -> bool {
        self != ActDType::F32
            && self.usable_on(props)
            && props.features.matmul.cmma.contains(&MmaConfig {
                a_type: self.elem(),
                b_type: self.elem(),
                cd_type: ActDType::F32.elem(),
                m: MMA as u32,
                n: MMA as u32,
                k: MMA as u32,
            })
    }

    /// Whether `props` (a device's) offer the manual `m16n8k16` instruction on operands of this half type
    /// with f32 accumulators: what [`crate::kernels::mma_frag`] issues.
    pub fn has_fragment_mma_on(self, props: &DeviceProperties) -> bool {
        self != ActDType::F32
            && self.usable_on(props)
            && props.features.matmul.mma.contains(&MmaConfig {
                a_type: self.elem(),
                b_type: self.elem(),
                cd_type: ActDType::F32.elem(),
                m: MMA as u32,
                n: (MMA / 2) as u32,
                k: MMA as u32,
            })
    }

    /// Whether `props` offer `ldmatrix` on operands of this half type (the fragment tiles'
    /// `FragmentShape::with_ldmatrix`).
    pub fn has_ldmatrix_on(self, props: &DeviceProperties) -> bool {
        self != ActDType::F32 && props.features.matmul.ldmatrix.contains(&self.elem())
    }

    /// `v` rounded to this type (round to nearest, ties to even; f32 unchanged) and widened back to f32
    /// exactly: the host side of the precision contract, `y_F = round(y_f32)`.
    pub fn round(self, v: f32) -> f32 {
        match self {
            ActDType::F32 => v,
            ActDType::F16 => half::f16::from_f32(v).to_f32(),
            ActDType::BF16 => half::bf16::from_f32(v).to_f32(),
        }
    }

    /// The little-endian bytes of `values` rounded to this type ([`ActDType::round`]).
    pub fn encode(self, values: &[f32]) -> Vec<u8> {
        let mut bytes = Vec::with_capacity(values.len() * self.size());
        for &v in values {
            match self {
                ActDType::F32 => bytes.extend_from_slice(&v.to_le_bytes()),
                ActDType::F16 => bytes.extend_from_slice(&half::f16::from_f32(v).to_le_bytes()),
                ActDType::BF16 => bytes.extend_from_slice(&half::bf16::from_f32(v).to_le_bytes()),
            }
        }
        bytes
    }

    /// The first `len` values of `bytes` (little-endian, this type) widened to f32 exactly.
    pub fn decode(self, bytes: &[u8], len: usize) -> Vec<f32> {
        let size = self.size();
        bytes
            .chunks_exact(size)
            .take(len)
            .map(|b| match self {
                ActDType::F32 => f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
                ActDType::F16 => half::f16::from_le_bytes([b[0], b[1]]).to_f32(),
                ActDType::BF16 => half::bf16::from_le_bytes([b[0], b[1]]).to_f32(),
            })
            .collect()
    }
}

impl std::fmt::Display for ActDType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}
