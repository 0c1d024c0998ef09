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
    InvalidCode {
        expert: usize,
        code: crate::format::InvalidCode,
    },
    /// Lengths or shapes that do not fit together.
    #[error("shape error: {0}")]
    Shape(String),
    /// A combination the kernels do not implement.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// The runtime has no usable device (not linked, or no such device on this machine).
    #[error("no device: {0}")]
    NoDevice(String),
    /// A launch or a read failed on the device.
    #[error("device error: {0}")]
    Device(String),
}
