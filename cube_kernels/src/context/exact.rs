//! Launchers of the fixed-order f32 kernels ([`crate::kernels::exact`]): the matmul, row softmax and row
//! mean whose every output is summed in index order, so that a token's bits do not depend on the shape of
//! the call (rollout decode and training forward agree).

use cubecl::prelude::*;

use super::{expect_len, f32_only, grid, DeviceBuffer, Kernels};
use crate::error::KernelError;
use crate::kernels::exact;

/// What [`f32_only`] calls these launchers.
const KERNELS: &str = "fixed-order kernels";

/// Units per cube of these kernels.
const UNITS: usize = 256;

impl Kernels {
    /// `y[b] = x[b] · w[b]` for `batches` products of `x [m, k]` and `w [k, n]` (`w [n, k]`, used transposed,
    /// with `w_transposed`), all contiguous f32; every output one fused multiply-add chain in `k` order.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_f32(
        &self,
        x: &DeviceBuffer,
        w: &DeviceBuffer,
        batches: usize,
        m: usize,
        k: usize,
        n: usize,
        w_transposed: bool,
    ) -> Result<DeviceBuffer, KernelError> {
        f32_only("matmul x", x, KERNELS)?;
        f32_only("matmul w", w, KERNELS)?;
        expect_len("matmul x", x, batches * m * k)?;
        expect_len("matmul w", w, batches * k * n)?;
        let total = batches * m * n;
        let y = self.empty_f32(total);
        if total > 0 {
            exact::matmul::launch(
                &self.client,
                grid(total.div_ceil(UNITS)),
                CubeDim::new_1d(UNITS as u32),
                x.arg(),
                w.arg(),
                y.arg(),
                total,
                m,
                k,
                n,
                w_transposed,
            );
        }
        Ok(y)
    }

    /// The softmax of each of `rows` contiguous f32 rows of `len` values (maximum and sum in index order).
    pub fn softmax_rows_f32(
        &self,
        x: &DeviceBuffer,
        rows: usize,
        len: usize,
    ) -> Result<DeviceBuffer, KernelError> {
        f32_only("softmax", x, KERNELS)?;
        expect_len("softmax x", x, rows * len)?;
        let y = self.empty_f32(rows * len);
        if rows * len > 0 {
            exact::softmax_rows::launch(
                &self.client,
                grid(rows.div_ceil(UNITS)),
                CubeDim::new_1d(UNITS as u32),
                x.arg(),
                y.arg(),
                rows,
                len,
            );
        }
        Ok(y)
    }

    /// The mean of each of `rows` contiguous f32 rows of `len` (>= 1) values (the sum in index order, then
    /// one division by `len`).
    pub fn mean_rows_f32(
        &self,
        x: &DeviceBuffer,
        rows: usize,
        len: usize,
    ) -> Result<DeviceBuffer, KernelError> {
        f32_only("mean", x, KERNELS)?;
        expect_len("mean x", x, rows * len)?;
        if len == 0 {
            return Err(KernelError::Shape("mean over rows of 0 values".into()));
        }
        let y = self.empty_f32(rows);
        if rows > 0 {
            exact::mean_rows::launch(
                &self.client,
                grid(rows.div_ceil(UNITS)),
                CubeDim::new_1d(UNITS as u32),
                x.arg(),
                y.arg(),
                rows,
                len,
                len as f32,
            );
        }
        Ok(y)
    }
}
