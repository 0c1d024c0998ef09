//! Errors of the quantization formats. Every one is caused by user input (a scheme name, a shape, a tensor
//! read from disk) and says what was expected, so callers can report it instead of panicking.

/// What can go wrong when quantizing, packing or rebuilding a quantized tensor.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum QuantError {
    /// A scheme name that is not one of [`crate::quant::QuantScheme::ALL`].
    #[error("unknown quantization scheme `{name}` (valid: int4-g32, int4-g64, int4-g128, int8-pc, fp8-b128, nvfp4, mxfp4)")]
    UnknownScheme { name: String },

    /// A layer-selection glob that does not compile.
    #[error("invalid layer pattern `{pattern}`: {msg}")]
    InvalidPattern { pattern: String, msg: String },

    /// A precision name that is neither `f32` nor a scheme.
    #[error(
        "unknown scheme `{name}` (valid: f32, int4-g32, int4-g64, int4-g128, int8-pc, fp8-b128, nvfp4, mxfp4)"
    )]
    UnknownPrecision { name: String },

    /// A buffer whose length does not match the shape it is declared with.
    #[error("{what}: expected {expected} values for shape {shape:?}, got {got}")]
    ShapeMismatch {
        what: &'static str,
        shape: Vec<usize>,
        expected: usize,
        got: usize,
    },

    /// A shape whose element count does not fit in `usize`.
    #[error("{what}: shape {shape:?} is too large")]
    ShapeOverflow {
        what: &'static str,
        shape: Vec<usize>,
    },

    /// NaN or infinity in a weight or an activation: the absmax scale would be meaningless.
    #[error("{what}[{row}, {col}] is {value}; quantization needs finite values")]
    NonFinite {
        what: &'static str,
        row: usize,
        col: usize,
        value: f32,
    },

    /// A stored code outside what the scheme can produce (e.g. -128 for int8-pc, an E4M3 NaN code, a
    /// non-zero padding nibble).
    #[error("{what}: element {index} holds an invalid code ({detail})")]
    InvalidCode {
        what: &'static str,
        index: usize,
        detail: String,
    },

    /// A stored scale that is negative or not finite (the quantizer only produces `absmax / qmax >= 0`).
    #[error("scales[{index}] is {value}; scales must be finite and >= 0")]
    InvalidScale { index: usize, value: f32 },

    /// A weight so close to f32's largest value that its quantized form (scale times code) overflows f32.
    #[error(
        "weights[{row}, {col}] is {value:e}: quantized as {scheme} it dequantizes to infinity (its scale \
         times its code overflows f32); weights this close to f32's largest value cannot take the format"
    )]
    QuantizedOverflow {
        row: usize,
        col: usize,
        value: f32,
        scheme: String,
    },

    /// A stored scale so large that the weights it scales overflow f32 (the quantizer refuses weights
    /// whose own scales would: [`QuantError::QuantizedOverflow`]).
    #[error(
        "scales[{index}] is {value:e}; times a code's value it scales ({largest}) it overflows f32, so \
         the weights are not finite"
    )]
    OverflowingScale {
        index: usize,
        value: f32,
        largest: f32,
    },

    /// A stored mxfp4 scale that is not an E8M0 value (a power of two in [2^-127, 2^127]).
    #[error("scales[{index}] is {value:e}; an mxfp4 scale is a power of two in [2^-127, 2^127]")]
    NotE8m0Scale { index: usize, value: f32 },
}

/// `rows * cols`, or a clear error when it overflows (shapes come from user input and files).
pub(crate) fn element_count(
    what: &'static str,
    rows: usize,
    cols: usize,
) -> Result<usize, QuantError> {
    rows.checked_mul(cols).ok_or(QuantError::ShapeOverflow {
        what,
        shape: vec![rows, cols],
    })
}

/// Checks that a `[rows, cols]` buffer has `rows * cols` elements (and that the product does not overflow).
pub(crate) fn check_matrix_len(
    what: &'static str,
    rows: usize,
    cols: usize,
    got: usize,
) -> Result<(), QuantError> {
    check_len(what, &[rows, cols], element_count(what, rows, cols)?, got)
}

/// Checks that a buffer has the length its shape implies.
pub(crate) fn check_len(
    what: &'static str,
    shape: &[usize],
    expected: usize,
    got: usize,
) -> Result<(), QuantError> {
    if expected == got {
        Ok(())
    } else {
        Err(QuantError::ShapeMismatch {
            what,
            shape: shape.to_vec(),
            expected,
            got,
        })
    }
}

/// Rejects NaN and infinities, naming the first offending element of a row-major `[rows, cols]` buffer.
pub(crate) fn check_finite(
    what: &'static str,
    values: &[f32],
    cols: usize,
) -> Result<(), QuantError> {
    // A branch-free pass first (it vectorizes; activations are checked on every W8A8 product), the
    // position only on failure.
    if values.iter().fold(true, |ok, v| ok & v.is_finite()) {
        return Ok(());
    }
    match values.iter().position(|v| !v.is_finite()) {
        None => Ok(()),
        Some(index) => Err(QuantError::NonFinite {
            what,
            row: index / cols.max(1),
            col: index % cols.max(1),
            value: values[index],
        }),
    }
}
