//! Errors of the kernel layer: bad shapes or formats from the caller, and runtime failures.

/// What went wrong preparing or launching a kernel.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    /// A weight format name that is not `int4-g<G>`, `int8-pc` or `fp8-b128`.
    #[error(
        "unknown weight format `{0}` (expected int4-g<G>, e.g. int4-g128, int8-pc or fp8-b128)"
    )]
    UnknownFormat(String),
    /// A stored code the quantizer never produces (qarl's loader rejects it too).
    #[error("expert {expert}, byte {}: {code}", .code.byte())]
    InvalidCode { expert: usize, code: InvalidCode },
    /// Lengths or shapes that do not fit together.
    #[error("shape error: {0}")]
    Shape(String),
    /// A combination the kernels do not implement.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// The runtime has no usable device (not linked, or no such device on this machine).
    #[error("no device: {0}")]
    NoDevice(String),
    /// A kernel the compiler refused (the compile-only check of `crate::ptx` reports it this way).
    #[error("compile error: {0}")]
    Compile(String),
    /// A launch or a read failed on the device.
    #[error("device error: {0}")]
    Device(String),
}

/// A stored code the quantizer never produces ([`crate::format::WeightFormat::invalid_code`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum InvalidCode {
    /// Padding bits past the last code of a row that are not 0 (the storage is canonical).
    #[error("padding nibble of row {row} is {value:#x}, must be 0")]
    Padding { byte: usize, row: usize, value: u8 },
    /// int8 -128, outside the symmetric grid.
    #[error("-128 is outside [-127, 127]")]
    Int8Min { byte: usize },
    /// One of the two E4M3 NaN codes.
    #[error("{code:#04x} is an E4M3 NaN")]
    E4m3Nan { byte: usize, code: u8 },
}

impl InvalidCode {
    /// The offending byte's index in the storage buffer.
    pub fn byte(&self) -> usize {
        match *self {
            InvalidCode::Padding { byte, .. }
            | InvalidCode::Int8Min { byte }
            | InvalidCode::E4m3Nan { byte, .. } => byte,
        }
    }
}
