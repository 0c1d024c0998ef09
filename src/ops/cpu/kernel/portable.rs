//! The portable path: plain Rust with `f32::mul_add`, the reference the SIMD paths must match bitwise.

use super::{
    decode_e2m1_nibble, decode_fp8, decode_int4_nibble, reduce_lanes, TileSrc, FP8, INT4, INT8,
    LANES, MXFP4, NVFP4, PANEL,
};

/// Decodes chunk `c` of row `o` into `w` (32 values, in lane order).
#[inline(always)]
fn decode_chunk(scheme: u8, src: &TileSrc<'_>, o: usize, c: usize, w: &mut [f32; LANES]) {
    match scheme {
        PANEL => {
            let row = &src.panel[o * src.chunks * LANES..(o + 1) * src.chunks * LANES];
            w.copy_from_slice(&row[c * LANES..(c + 1) * LANES]);
        }
        INT4 => {
            let s = src.scale(o, c / src.seg_chunks);
            let (at, shift) = src.int4_line(o, c);
            for l in 0..16 {
                let word =
                    u32::from_le_bytes(src.codes[at + 4 * l..at + 4 * l + 4].try_into().unwrap());
                w[l] = decode_int4_nibble((word >> shift) as u8, s);
                w[l + 16] = decode_int4_nibble((word >> (shift + 4)) as u8, s);
            }
        }
        NVFP4 | MXFP4 => {
            // Columns 32c..32c+16 (low nibbles) and 32c+16..32c+32 (high nibbles): one nvfp4 block each,
            // one mxfp4 block together.
            let (s_lo, s_hi) = if scheme == NVFP4 {
                (src.scale(o, 2 * c), src.scale(o, 2 * c + 1))
            } else {
                (src.scale(o, c), src.scale(o, c))
            };
            let (at, shift) = src.int4_line(o, c);
            for l in 0..16 {
                let word =
                    u32::from_le_bytes(src.codes[at + 4 * l..at + 4 * l + 4].try_into().unwrap());
                w[l] = decode_e2m1_nibble((word >> shift) as u8, s_lo);
                w[l + 16] = decode_e2m1_nibble((word >> (shift + 4)) as u8, s_hi);
            }
        }
        INT8 => {
            let s = src.scale(o, c / src.seg_chunks);
            let bytes =
                &src.codes[o * src.row_bytes + c * LANES..o * src.row_bytes + (c + 1) * LANES];
            for (w, &b) in w.iter_mut().zip(bytes) {
                *w = b as i8 as f32 * s;
            }
        }
        FP8 => {
            let s = src.scale(o, c / src.seg_chunks);
            let bytes =
                &src.codes[o * src.row_bytes + c * LANES..o * src.row_bytes + (c + 1) * LANES];
            for (w, &b) in w.iter_mut().zip(bytes) {
                *w = decode_fp8(b, s, !src.unfolded);
            }
        }
        _ => unreachable!("unknown decoder {scheme}"),
    }
}

/// Decodes `n` rows from `o0` into `dst` (`[n, chunks * 32]`).
pub(super) fn decode_rows(scheme: u8, src: &TileSrc<'_>, o0: usize, n: usize, dst: &mut [f32]) {
    let kp = src.chunks * LANES;
    let mut w = [0.0f32; LANES];
    for r in 0..n {
        for c in 0..src.chunks {
            decode_chunk(scheme, src, o0 + r, c, &mut w);
            dst[r * kp + c * LANES..r * kp + (c + 1) * LANES].copy_from_slice(&w);
        }
    }
}

/// Rows `o0..o0+ob` against the activation rows `xs`: `res[i][r]`.
pub(super) fn tile(
    scheme: u8,
    src: &TileSrc<'_>,
    o0: usize,
    xs: &[&[f32]],
    ob: usize,
    res: &mut [[f32; 4]; 4],
) {
    let mut w = [0.0f32; LANES];
    #[allow(clippy::needless_range_loop)] // r indexes the rows and the result columns
    for r in 0..ob {
        let mut acc = vec![[0.0f32; LANES]; xs.len()];
        for c in 0..src.chunks {
            decode_chunk(scheme, src, o0 + r, c, &mut w);
            for (a, x) in acc.iter_mut().zip(xs) {
                let x = &x[c * LANES..(c + 1) * LANES];
                for l in 0..LANES {
                    a[l] = x[l].mul_add(w[l], a[l]);
                }
            }
        }
        for (i, a) in acc.iter().enumerate() {
            res[i][r] = reduce_lanes(a);
        }
    }
}
