//! Host tensor helpers: tensors from host values and host copies of tensors. The one place that moves
//! values between `Vec`s and burn tensors, used by every layer above.

use burn::tensor::{Device, Int, Tensor, TensorData};

/// Makes a float tensor of `shape` from host values.
pub fn tensor_from_vec<const D: usize>(
    values: Vec<f32>,
    shape: [usize; D],
    device: &Device,
) -> Tensor<D> {
    Tensor::from_data(TensorData::new(values, shape), device)
}

/// Host copy of a float tensor's values (row-major).
pub fn to_f32_vec<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .try_to_vec::<f32>()
        .expect("converted to f32")
}

/// Host copy of an int tensor's values (row-major).
pub fn to_i64_vec<const D: usize>(t: Tensor<D, Int>) -> Vec<i64> {
    t.into_data()
        .convert::<i64>()
        .try_to_vec::<i64>()
        .expect("converted to i64")
}

/// Host copy of a `[B, V]` tensor, row by row.
pub fn rows(t: Tensor<2>) -> Vec<Vec<f32>> {
    let [_, v] = t.dims();
    let flat = to_f32_vec(t);
    flat.chunks(v.max(1)).map(<[f32]>::to_vec).collect()
}
