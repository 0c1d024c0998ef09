//! The Hugging Face tensor-name pieces every model file shares (module path + suffix) and the lazy
//! parameter placeholder: the leaves the parameter walk ([`super::params`]) and the layers build on.

use burn::module::{Param, ParamId};
use burn::tensor::{Device, Shape, Tensor};

/// The module path of the output projection; a tied model has none, but its checkpoint may still hold
/// `lm_head.weight` (see [`crate::model::Decoder::from_checkpoint`]).
pub const LM_HEAD: &str = "lm_head";

/// Suffix of a module's (full-precision) weight tensor.
pub const WEIGHT: &str = "weight";
/// Suffix of a linear layer's bias.
pub const BIAS: &str = "bias";
/// Suffix of a quantized checkpoint's packed codes (U8, `[out, row bytes]`), which replace `weight`.
pub const QWEIGHT: &str = "qweight";
/// Suffix of a quantized checkpoint's f32 scales, beside `qweight`.
pub const SCALES: &str = "scales";

/// The HF name of the tensor `suffix` (one of [`WEIGHT`], [`BIAS`], [`QWEIGHT`], [`SCALES`]) of the module
/// at `path`.
pub fn tensor_name(path: &str, suffix: &str) -> String {
    format!("{path}.{suffix}")
}

/// A parameter of `shape` that allocates nothing until read (zeros then): a lazy model's placeholder,
/// which loading replaces and which describes a checkpoint by its shape alone.
pub fn lazy_param<const D: usize>(shape: [usize; D], device: &Device) -> Param<Tensor<D>> {
    Param::uninitialized(
        ParamId::new(),
        move |device, require_grad| {
            let t = Tensor::zeros(shape, device);
            if require_grad {
                t.require_grad()
            } else {
                t
            }
        },
        device.clone(),
        true,
        Shape::from(shape),
    )
}
