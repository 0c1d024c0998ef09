//! CubeCL kernels for qarl's low-bit matmuls.
//!
//! Empty until the CubeCL kernels issue lands: the crate exists so the workspace layout is the one of the
//! design card and so CI already builds it. Keeping `cubecl` out of its dependencies until then keeps the
//! cold CPU build short.
