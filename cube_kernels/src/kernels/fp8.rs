//! FP8 activation quantization (W8A8): per token per 128 inputs, `s = absmax / 448`, code = E4M3 of
//! `x / s` (round to nearest even, saturating), and the dequantized value `e4m3(code) * s` the matmul reads.
//! Both divisions are IEEE's correctly rounded quotient ([`div_rn`](fn@div_rn)), whatever the runtime's `/`
//! does.

use cubecl::prelude::*;

/// The E4M3 code of `v` by the bit operations of qarl's `f32_to_e4m3` (inputs are finite).
#[cube]
pub fn e4m3_code(v: f32) -> u32 {
    let bits = u32::reinterpret(v);
    let sign = (bits >> 24u32) & 128u32;
    let mag_bits = bits & 0x7FFF_FFFFu32;
    let mag = f32::reinterpret(mag_bits);
    let mut code = 0x7Eu32;
    if mag < 448.0f32 {
        if mag < 0.015625f32 {
            // m * 512 is exact and below 8; adding 2^23 rounds it to an integer, ties to even.
            let shifted = mag * 512.0f32 + 8388608.0f32;
            code = u32::reinterpret(shifted) - 0x4B00_0000u32;
        } else {
            let rebiased = mag_bits - (120u32 << 23u32);
            let lsb = (rebiased >> 20u32) & 1u32;
            code = (rebiased + 0x7FFFFu32 + lsb) >> 20u32;
            if code > 0x7Eu32 {
                code = 0x7Eu32;
            }
        }
    }
    sign | code
}

/// The significand of a positive finite nonzero f32 (bits `mag`) with its implicit bit, in `[2^23, 2^24)`,
/// and its biased exponent; a subnormal's significand is shifted up into that range and its exponent goes
/// below 1 to match.
#[cube]
pub fn significand_exponent(mag: u32) -> (u32, i32) {
    let mut m = mag & 0x7F_FFFFu32;
    let mut e = i32::cast_from(mag >> 23u32);
    if e == 0i32 {
        e = 1i32;
        while m < 0x80_0000u32 {
            m <<= 1u32;
            e -= 1i32;
        }
    } else {
        m |= 0x80_0000u32;
    }
    (m, e)
}

/// `a / b` correctly rounded, as IEEE division gives it (finite `a`, nonzero finite `b`; subnormals too),
/// by integer long division of the significands.
///
/// WGSL's and SPIR-V's `/` may be off by 2.5 ulp: with it, the fp8 activations of 256 tokens came out of
/// NVIDIA's Vulkan driver on an H200 with codes one step off the host's (CUDA's IEEE division matched),
/// since a code at an E4M3 rounding boundary depends on the quotient's last bit. Refining the runtime's quotient with fused
/// multiply-adds is no cure: Vulkan lets `fma` be a multiply and an add, and such a refinement (exact
/// with a fused `fma` on the host, from reciprocals up to 64 ulps off) missed the host's bits on lavapipe.
/// Integer arithmetic is exact everywhere: 26 quotient bits (the 24 kept, a guard bit and one more) and
/// the remainder as sticky bit give the round-to-nearest-even result, subnormal results included. The
/// host mirror in the `tests` module below is checked against `a / b`.
#[cube]
pub fn div_rn(a: f32, b: f32) -> f32 {
    let sign = (u32::reinterpret(a) ^ u32::reinterpret(b)) & 0x8000_0000u32;
    let ax = u32::reinterpret(a) & 0x7FFF_FFFFu32;
    let by = u32::reinterpret(b) & 0x7FFF_FFFFu32;
    let mut out = sign;
    if ax != 0u32 {
        let (ma0, ea) = significand_exponent(ax);
        let (mb, eb) = significand_exponent(by);
        let mut ma = ma0;
        // The result's biased exponent, with ma / mb brought into [1, 2).
        let mut e = ea - eb + 127i32;
        if ma < mb {
            ma <<= 1u32;
            e -= 1i32;
        }
        // 26 quotient bits: 1.(25 fraction bits); the remainder stays below 2 mb < 2^25.
        let mut q = 0u32;
        let mut rem = ma;
        for _ in 0..26u32 {
            q <<= 1u32;
            if rem >= mb {
                rem -= mb;
                q |= 1u32;
            }
            rem <<= 1u32;
        }
        // Round to nearest even at the 24th bit (further right for a subnormal result).
        let mut shift = 2i32;
        if e < 1i32 {
            shift = 3i32 - e;
        }
        let mut bits = 0u32;
        if shift < 27i32 {
            let sh = u32::cast_from(shift);
            let kept = q >> sh;
            let dropped = q & ((1u32 << sh) - 1u32);
            let half = 1u32 << (sh - 1u32);
            let mut up = 0u32;
            if dropped > half || (dropped == half && (rem != 0u32 || (kept & 1u32) == 1u32)) {
                up = 1u32;
            }
            bits = kept + up;
            if e >= 1i32 {
                bits += u32::cast_from(e - 1i32) << 23u32;
            }
            if bits >= 0x7F80_0000u32 {
                bits = 0x7F80_0000u32;
            }
        }
        out = sign | bits;
    }
    f32::reinterpret(out)
}

/// One cube of 128 units per (token, 128-column block), `CUBE_POS` the block's linear index: each unit
/// reads one input (in its own type `F`, widened to f32), the block's absmax comes from a tree of pairwise
/// maxima in shared memory (exact in any order), then every unit writes its dequantized value to `xq` and
/// unit 0 the block scale to `xs`. A block holding a NaN or an infinity is NaN throughout, scale included
/// (its division would otherwise saturate: a NaN read as the block's absmax, a forward gone non-finite
/// hidden in finite codes; the host's quantizer refuses such input and the CPU kernel returns NaN). A unit per
/// block, as this kernel first was, left a decode step's 16 blocks to 16 threads running 128 sequential
/// integer divisions each.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn quantize_activations<F: Float>(
    x: &[F],
    lut: &[f32],
    xq: &mut [f32],
    xs: &mut [f32],
    rows: usize,
    cols: usize,
    blocks: usize,
    #[define(F)] _dtype: ElemType,
) {
    let mut amax = Shared::<[f32]>::new_slice(128usize);
    let id = CUBE_POS;
    let u = UNIT_POS as usize;
    let live = id < rows * blocks;
    let r = id / blocks;
    let k = (id % blocks) * 128 + u;
    let mut v = 0.0f32;
    if live && k < cols {
        v = f32::cast_from(x[r * cols + k]);
    }
    let a = v.abs();
    let mut m = 0.0f32;
    if a > 0.0f32 {
        m = a;
    }
    // A NaN or an infinity counts as +inf, which the maxima keep: the whole block is then NaN below.
    if (u32::reinterpret(v) & 0x7FFF_FFFFu32) >= 0x7F80_0000u32 {
        m = f32::reinterpret(0x7F80_0000u32);
    }
    amax[u] = m;
    sync_cube();
    #[unroll]
    for step in 0..7usize {
        let half = 64usize >> step;
        if u < half {
            let other = amax[u + half];
            if other > amax[u] {
                amax[u] = other;
            }
        }
        sync_cube();
    }
    let nonfinite = u32::reinterpret(amax[0]) == 0x7F80_0000u32;
    let nan = f32::reinterpret(0x7FC0_0000u32);
    let mut s = nan;
    if !nonfinite {
        s = div_rn(amax[0], 448.0f32);
    }
    if live {
        if u == 0 {
            xs[id] = s;
        }
        if k < cols {
            let mut value = nan;
            if !nonfinite {
                let mut code = 0u32;
                if s != 0.0f32 {
                    code = e4m3_code(div_rn(v, s));
                }
                value = lut[code as usize] * s;
            }
            xq[r * cols + k] = value;
        }
    }
}

#[cfg(test)]
mod tests {
    /// The host mirror of [`super::div_rn`], step for step.
    fn div_rn_mirror(a: f32, b: f32) -> f32 {
        let sign = (a.to_bits() ^ b.to_bits()) & 0x8000_0000;
        let (ax, by) = (a.to_bits() & 0x7FFF_FFFF, b.to_bits() & 0x7FFF_FFFF);
        if ax == 0 {
            return f32::from_bits(sign);
        }
        let unpack = |bits: u32| {
            let (mut m, mut e) = (bits & 0x7F_FFFF, (bits >> 23) as i32);
            if e == 0 {
                e = 1;
                while m < 0x80_0000 {
                    m <<= 1;
                    e -= 1;
                }
            } else {
                m |= 0x80_0000;
            }
            (m, e)
        };
        let ((mut ma, ea), (mb, eb)) = (unpack(ax), unpack(by));
        let mut e = ea - eb + 127;
        if ma < mb {
            ma <<= 1;
            e -= 1;
        }
        let (mut q, mut rem) = (0u32, ma);
        for _ in 0..26 {
            q <<= 1;
            if rem >= mb {
                rem -= mb;
                q |= 1;
            }
            rem <<= 1;
        }
        let shift = if e < 1 { 3 - e } else { 2 };
        let mut bits = 0u32;
        if shift < 27 {
            let sh = shift as u32;
            let (kept, dropped, half) = (q >> sh, q & ((1 << sh) - 1), 1 << (sh - 1));
            let up = dropped > half || (dropped == half && (rem != 0 || kept & 1 == 1));
            bits = kept + up as u32;
            if e >= 1 {
                bits += ((e - 1) as u32) << 23;
            }
            bits = bits.min(0x7F80_0000);
        }
        f32::from_bits(sign | bits)
    }

    #[test]
    fn div_rn_mirror_is_ieee_division() {
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        // Random bit patterns over every exponent (subnormals, overflow to infinity, underflow to zero),
        // then the quantizer's own range: |a / b| <= 448 and b = absmax / 448.
        for i in 0..3_000_000u64 {
            let bits = next();
            let (mut a, mut b) = (
                f32::from_bits(bits as u32),
                f32::from_bits((bits >> 32) as u32),
            );
            if i % 2 == 1 {
                b = f32::from_bits(
                    ((100 + (bits % 60) as u32) << 23) | (bits >> 41) as u32 & 0x7F_FFFF,
                );
                a = b * 448.0 * ((bits >> 8) as u32 as f32 / u32::MAX as f32 * 2.0 - 1.0);
                if i % 7 == 0 {
                    b = f32::from_bits(b.to_bits() | 0x7F_FFFF);
                }
            }
            if !a.is_finite() || !b.is_finite() || b == 0.0 {
                continue;
            }
            let (got, want) = (div_rn_mirror(a, b), a / b);
            assert_eq!(
                got.to_bits(),
                want.to_bits(),
                "{a:e} / {b:e}: {got:e}, want {want:e}"
            );
        }
        for (a, b) in [
            (448.0f32, 448.0),
            (262_144.0, f32::from_bits(0x447F_FFFF)),
            (1e-45, 3.0),
            (-0.0, 2.0),
        ] {
            assert_eq!(
                div_rn_mirror(a, b).to_bits(),
                (a / b).to_bits(),
                "{a:e} / {b:e}"
            );
        }
    }
}
