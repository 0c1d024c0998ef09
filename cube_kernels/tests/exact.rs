//! The fixed-order f32 kernels (matmul, row softmax, row mean) on the wgpu runtime: against host sums in
//! the same order, and invariant to the shape of the call (a row alone, inside a batch, or followed by
//! masked entries gives the same bits), which is what the bitwise rollout = training contract needs.
//!
//! Without a Vulkan driver the tests skip with a message, unless `QARL_REQUIRE_WGPU=1`.
#![cfg(feature = "wgpu")]

mod common;
use common::kernels;

fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        })
        .collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|f| f.to_bits()).collect()
}

/// `x [b, m, k] · w [b, k, n]` (or `w [b, n, k]` transposed) on the host, fused multiply-adds in `k` order.
fn host_matmul(x: &[f32], w: &[f32], b: usize, m: usize, k: usize, n: usize, wt: bool) -> Vec<f32> {
    let mut y = Vec::with_capacity(b * m * n);
    for bb in 0..b {
        for i in 0..m {
            for j in 0..n {
                let mut acc = 0.0f32;
                for kk in 0..k {
                    let wv = if wt {
                        w[(bb * n + j) * k + kk]
                    } else {
                        w[bb * k * n + kk * n + j]
                    };
                    acc = x[(bb * m + i) * k + kk].mul_add(wv, acc);
                }
                y.push(acc);
            }
        }
    }
    y
}

#[test]
#[ignore = "needs a wgpu adapter (a Vulkan driver, e.g. Mesa lavapipe: mesa-vulkan-drivers); .ci/run installs it and runs --include-ignored"]
fn matmul_sums_in_k_order_and_rows_do_not_depend_on_the_batch() {
    let Some(kn) = kernels() else { return };
    let (b, m, k, n) = (3, 7, 45, 5);
    for wt in [false, true] {
        let x = values(b * m * k, 1);
        let w = values(b * k * n, 2 + u64::from(wt));
        let y = kn
            .matmul_f32(&kn.upload_f32(&x), &kn.upload_f32(&w), b, m, k, n, wt)
            .unwrap();
        let y = kn.read_f32(&y).unwrap();
        let want = host_matmul(&x, &w, b, m, k, n, wt);
        for (i, (g, h)) in y.iter().zip(&want).enumerate() {
            assert!(
                (g - h).abs() <= 1e-6 * (1.0 + h.abs()),
                "wt={wt} y[{i}]: {g} vs host {h}"
            );
        }
        // The last row of batch 1 alone: the same bits.
        let row = &x[(m + m - 1) * k..(m + m) * k];
        let wb = &w[k * n..2 * k * n];
        let alone = kn
            .matmul_f32(&kn.upload_f32(row), &kn.upload_f32(wb), 1, 1, k, n, wt)
            .unwrap();
        assert_eq!(
            bits(&kn.read_f32(&alone).unwrap()),
            bits(&y[(m + m - 1) * n..(m + m) * n]),
            "wt={wt}: a row's bits depend on its batch"
        );
    }
    let bad = kn.matmul_f32(
        &kn.upload_f32(&[1.0; 6]),
        &kn.upload_f32(&[1.0; 6]),
        1,
        2,
        3,
        3,
        false,
    );
    assert!(bad.is_err(), "a weight of 6 values for [3, 3] is refused");
}

#[test]
#[ignore = "needs a wgpu adapter (a Vulkan driver, e.g. Mesa lavapipe: mesa-vulkan-drivers); .ci/run installs it and runs --include-ignored"]
fn softmax_rows_ignore_masked_tails_and_sum_to_one() {
    let Some(kn) = kernels() else { return };
    let (rows, len) = (4, 37);
    let x: Vec<f32> = values(rows * len, 5).iter().map(|v| 4.0 * v).collect();
    let y = kn
        .read_f32(&kn.softmax_rows_f32(&kn.upload_f32(&x), rows, len).unwrap())
        .unwrap();
    for r in 0..rows {
        let row = &x[r * len..(r + 1) * len];
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let sum: f64 = row.iter().map(|v| f64::from((v - max).exp())).sum();
        for (i, v) in row.iter().enumerate() {
            let want = f64::from((v - max).exp()) / sum;
            let got = f64::from(y[r * len + i]);
            assert!((got - want).abs() <= 1e-6, "row {r}[{i}]: {got} vs {want}");
        }
    }
    // Row 2's first 20 entries followed by masked (-inf) keys, as a full-sequence forward sees a query whose
    // later keys are masked, against the 20 entries alone, as a decode step sees them: the same bits.
    let head = &x[2 * len..2 * len + 20];
    let mut masked = head.to_vec();
    masked.resize(len, f32::NEG_INFINITY);
    let full = kn
        .read_f32(
            &kn.softmax_rows_f32(&kn.upload_f32(&masked), 1, len)
                .unwrap(),
        )
        .unwrap();
    let short = kn
        .read_f32(&kn.softmax_rows_f32(&kn.upload_f32(head), 1, 20).unwrap())
        .unwrap();
    assert_eq!(bits(&full[..20]), bits(&short));
    assert!(full[20..].iter().all(|&p| p == 0.0));
}

#[test]
#[ignore = "needs a wgpu adapter (a Vulkan driver, e.g. Mesa lavapipe: mesa-vulkan-drivers); .ci/run installs it and runs --include-ignored"]
fn mean_rows_sum_in_index_order() {
    let Some(kn) = kernels() else { return };
    let (rows, len) = (9, 128);
    let x = values(rows * len, 9);
    let y = kn
        .read_f32(&kn.mean_rows_f32(&kn.upload_f32(&x), rows, len).unwrap())
        .unwrap();
    for r in 0..rows {
        let sum = x[r * len..(r + 1) * len].iter().fold(0.0f32, |a, &v| a + v);
        assert_eq!(y[r].to_bits(), (sum / len as f32).to_bits(), "row {r}");
    }
    let one = kn
        .read_f32(
            &kn.mean_rows_f32(&kn.upload_f32(&x[4 * len..5 * len]), 1, len)
                .unwrap(),
        )
        .unwrap();
    assert_eq!(one[0].to_bits(), y[4].to_bits());
    assert!(kn.mean_rows_f32(&kn.upload_f32(&[]), 1, 0).is_err());
}

/// Rows longer than Mesa's llvmpipe (lavapipe) lets one loop run: it ends a shader invocation's loops
/// after 65535 iterations in all, so a kernel that took one loop iteration per input stopped short of
/// a 70000-long row and returned a partial sum as if whole. The sums here are checked against the host's
/// in the same order (the mean's adds bit for bit; the matmul's fused multiply-adds and the softmax,
/// whose `exp` differs from the host's, within their tolerances, the softmax summing to one).
#[test]
#[ignore = "needs a wgpu adapter (a Vulkan driver, e.g. Mesa lavapipe: mesa-vulkan-drivers); .ci/run installs it and runs --include-ignored"]
fn long_rows_are_summed_whole() {
    let Some(kn) = kernels() else { return };
    let len = 70_001;
    let x = values(len, 11);
    let w = values(len, 12);
    for wt in [false, true] {
        let y = kn
            .matmul_f32(&kn.upload_f32(&x), &kn.upload_f32(&w), 1, 1, len, 1, wt)
            .unwrap();
        let (got, want) = (
            kn.read_f32(&y).unwrap()[0],
            host_matmul(&x, &w, 1, 1, len, 1, wt)[0],
        );
        // A few ulps apart (lavapipe's fused multiply-add is not always the host's, as for the short
        // rows above); the iterations a cut loop drops move the sum by about 20.
        assert!(
            (got - want).abs() <= 1e-4 * (1.0 + want.abs()),
            "wt={wt}: {got} vs host {want}"
        );
    }
    let mean = kn
        .read_f32(&kn.mean_rows_f32(&kn.upload_f32(&x), 1, len).unwrap())
        .unwrap();
    let sum = x.iter().fold(0.0f32, |s, v| s + v);
    assert_eq!(mean[0].to_bits(), (sum / len as f32).to_bits(), "mean");
    let p = kn
        .read_f32(&kn.softmax_rows_f32(&kn.upload_f32(&x), 1, len).unwrap())
        .unwrap();
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let total: f64 = x.iter().map(|v| f64::from((v - max).exp())).sum();
    for i in [0, 30_000, 65_534, 65_535, len - 1] {
        let want = f64::from((x[i] - max).exp()) / total;
        let got = f64::from(p[i]);
        // An f32 sum of 70001 terms in order is good to about 1e-5 relative; a sum cut short
        // misses some 6% of them.
        assert!(
            (got - want).abs() <= 1e-4 * want,
            "softmax[{i}]: {got} vs {want}"
        );
    }
    let sum_p: f64 = p.iter().map(|&v| f64::from(v)).sum();
    assert!((sum_p - 1.0).abs() < 1e-3, "softmax sums to {sum_p}");
}
