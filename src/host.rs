//! Host tensor helpers: tensors from host values and host copies of tensors. The one place that moves
//! values between `Vec`s and burn tensors, used by every layer above, and so the one place that counts the
//! device-to-host reads ([`device_reads`], [`ReadCount`]): a read waits for the device to finish the
//! work queued before it, so on a GPU each one is a round trip the decode loop and the training forward
//! must not make per layer (issue 25's contract: one read per decode step, none per layer). Also
//! [`catch_quietly`] and [`probe_device`], for the probes of a library or a device whose panic is an
//! expected answer.

use std::sync::atomic::{AtomicU64, Ordering};

use burn::tensor::{Device, Int, Tensor, TensorData};

/// Device-to-host reads so far in this process ([`device_reads`]).
static DEVICE_READS: AtomicU64 = AtomicU64::new(0);

/// Device-to-host reads made so far in this process through this module: reads of tensors on a device
/// other than the CPU backend (flex tensors are host memory already; reading one is a copy, not a
/// transfer, and is not counted). Process-wide: exact for one computation when nothing else reads
/// meanwhile. Take differences ([`ReadCount`]); the counter is never reset.
pub fn device_reads() -> u64 {
    DEVICE_READS.load(Ordering::Relaxed)
}

/// The device-to-host reads since it was started: `let c = ReadCount::start(); ...; c.reads()`.
#[derive(Debug, Clone, Copy)]
pub struct ReadCount(u64);

impl ReadCount {
    pub fn start() -> Self {
        Self(device_reads())
    }

    /// Reads since [`ReadCount::start`].
    pub fn reads(self) -> u64 {
        device_reads() - self.0
    }
}

/// Whether reading a tensor on `device` is a transfer (any device but the CPU backend's, whose tensors
/// are host memory already).
pub fn reads_transfer(device: &Device) -> bool {
    *device != Device::flex()
}

/// Counts one read of a tensor on `device` when that is not the CPU backend.
fn count_read(device: &Device) {
    if reads_transfer(device) {
        DEVICE_READS.fetch_add(1, Ordering::Relaxed);
    }
}

/// Runs `probe`, turning a panic into `Err` without printing it: for the probes whose panic is an
/// expected answer (the tokenizers library on a malformed file, a backend without bf16:
/// [`probe_device`]), where the default hook would print a panic message and a backtrace hint before
/// the caller's own clear error. The hook is process-wide, so probes take turns; a panic on another
/// thread meanwhile is silenced too.
pub fn catch_quietly<R>(
    probe: impl FnOnce() -> R + std::panic::UnwindSafe,
) -> std::thread::Result<R> {
    static TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let out = std::panic::catch_unwind(probe);
    std::panic::set_hook(previous);
    out
}

/// [`catch_quietly`] for a probe of `device` whose failure is its answer (does it have bf16, is there
/// a device at all): the device first finishes the work queued before (whose failures stay failures),
/// then the device failures the probe causes count as expected
/// ([`crate::device_failures::expecting_failures`]).
pub fn probe_device<R>(
    device: &Device,
    probe: impl FnOnce() -> R + std::panic::UnwindSafe,
) -> std::thread::Result<R> {
    let queued = device.clone();
    let _ = catch_quietly(move || queued.sync());
    crate::device_failures::expecting_failures(|| catch_quietly(probe))
}

/// Makes a float tensor of `shape` from host values.
pub fn tensor_from_vec<const D: usize>(
    values: Vec<f32>,
    shape: [usize; D],
    device: &Device,
) -> Tensor<D> {
    Tensor::from_data(TensorData::new(values, shape), device)
}

/// The `[cols, rows]` tensor (contiguous) of the transpose of the row-major `[rows, cols]` host `values`:
/// a weight stored `[out, in]` laid out `[in, out]` once, transposed on the host rather than read back
/// from a transposed view on the device.
pub fn transposed_from_vec(values: &[f32], [rows, cols]: [usize; 2], device: &Device) -> Tensor<2> {
    tensor_from_vec(transpose(values, rows, cols), [cols, rows], device)
}

/// `[rows, cols]` -> `[cols, rows]` on the host, in 32x32 tiles, output row blocks in parallel. Reading
/// the master contiguous and transposing here instead of `into_data()` of a transposed view: burn-flex
/// copies a strided view on one thread, which was a third of re-quantizing a model (every RL weight sync).
pub fn transpose(src: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    use rayon::prelude::*;
    const TILE: usize = 32;
    let mut dst = vec![0.0f32; rows * cols];
    if rows == 0 || cols == 0 {
        return dst;
    }
    dst.par_chunks_mut(TILE * rows)
        .enumerate()
        .for_each(|(block, out)| {
            let c0 = block * TILE;
            let width = out.len() / rows;
            for r0 in (0..rows).step_by(TILE) {
                for r in r0..(r0 + TILE).min(rows) {
                    let row = &src[r * cols + c0..r * cols + c0 + width];
                    for (c, &v) in row.iter().enumerate() {
                        out[c * rows + r] = v;
                    }
                }
            }
        });
    dst
}

/// Host copy of a float tensor's values (row-major): one read.
pub fn to_f32_vec<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    count_read(&t.device());
    t.into_data()
        .convert::<f32>()
        .try_to_vec::<f32>()
        .expect("converted to f32")
}

/// Host copy of an int tensor's values (row-major): one read.
pub fn to_i64_vec<const D: usize>(t: Tensor<D, Int>) -> Vec<i64> {
    count_read(&t.device());
    t.into_data()
        .convert::<i64>()
        .try_to_vec::<i64>()
        .expect("converted to i64")
}

/// Host copy of a `[B, V]` tensor, row by row: one read.
pub fn rows(t: Tensor<2>) -> Vec<Vec<f32>> {
    let [_, v] = t.dims();
    let flat = to_f32_vec(t);
    split_rows(&flat, v)
}

fn split_rows(flat: &[f32], v: usize) -> Vec<Vec<f32>> {
    flat.chunks(v.max(1)).map(<[f32]>::to_vec).collect()
}

/// [`rows`] of `t` and host copies of the non-negative int tensors `ids` (expert ids), all of one device,
/// in one device-to-host read: on a GPU the ids ride along with the floats as f32 values (exact below
/// 2^24; the floats are copied bit for bit), so a decode step reads its logits and its routing in one
/// round trip. `t: None` reads the ids alone.
pub fn rows_and_ids(
    t: Option<Tensor<2>>,
    ids: Vec<Tensor<1, Int>>,
) -> (Vec<Vec<f32>>, Vec<Vec<u32>>) {
    let device = match (&t, ids.first()) {
        (Some(t), _) => t.device(),
        (None, Some(i)) => i.device(),
        (None, None) => return (Vec::new(), Vec::new()),
    };
    let as_u32 = |v: Vec<i64>| v.into_iter().map(|e| e as u32).collect::<Vec<u32>>();
    // On the CPU nothing travels; with no ids the floats alone are one read.
    if device == Device::flex() || ids.is_empty() {
        let rows = t.map(rows).unwrap_or_default();
        return (
            rows,
            ids.into_iter().map(|i| as_u32(to_i64_vec(i))).collect(),
        );
    }
    let v = t.as_ref().map_or(0, |t| t.dims()[1]);
    let mut parts: Vec<Tensor<1>> = t
        .into_iter()
        .map(|t| {
            let [b, v] = t.dims();
            t.reshape([b * v])
        })
        .collect();
    let float_len = parts.first().map_or(0, |p| p.dims()[0]);
    let lens: Vec<usize> = ids.iter().map(|i| i.dims()[0]).collect();
    parts.extend(ids.into_iter().map(|i| i.float()));
    let flat = to_f32_vec(Tensor::cat(parts, 0));
    let (floats, mut rest) = flat.split_at(float_len);
    let ids = lens
        .iter()
        .map(|&n| {
            let (head, tail) = rest.split_at(n);
            rest = tail;
            head.iter().map(|&x| x as u32).collect()
        })
        .collect();
    let rows = if v == 0 {
        Vec::new()
    } else {
        split_rows(floats, v)
    };
    (rows, ids)
}
