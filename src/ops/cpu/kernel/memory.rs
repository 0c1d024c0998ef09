//! The memory the CPU kernels read: weights on 64-byte boundaries (in huge pages where large), the DRAM
//! probe's buffer of the same kind, and activation rows copied onto a boundary where they are not on one.

/// Copies the rows of `src` (`[rows, k]`) into the first `k` elements of each `kp`-long row of `dst`; the
/// rest of `dst` (the padding, zero in every caller) is left as it is.
pub(super) fn pad_rows_into<T: Copy>(dst: &mut [T], src: &[T], k: usize, kp: usize) {
    for (d, s) in dst.chunks_mut(kp.max(1)).zip(src.chunks(k.max(1))) {
        d[..k].copy_from_slice(s);
    }
}

/// One 64-byte line (the unit of [`AlignedBytes`]'s small buffers and of [`AlignedRows`]' copies).
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub(super) struct Line([u8; 64]);

/// Bytes starting on a 64-byte boundary (an int4 chunk of four rows is exactly one cache line), zeroed.
///
/// Buffers of at least [`HUGE_PAGE`] bytes live in their own anonymous mapping, aligned to 2 MiB and advised
/// `MADV_HUGEPAGE` on Linux: a decode step streams every weight once, and with 4 KiB pages that is one TLB
/// miss (a page walk) per 4 KiB of codes, e.g. ~2200 per 4096x4096 int4 matrix, on the critical path of a
/// memory-bound GEMV. Where the kernel ignores the advice (THP `never`) or the mapping fails, the bytes are
/// the same, only the pages are small. The price: the last huge page of a buffer may be mostly unused (at
/// most 2 MiB per buffer, which is why smaller buffers stay in ordinary pages).
pub(super) struct AlignedBytes {
    storage: Storage,
    len: usize,
}

/// Size of a transparent huge page on x86_64 and most aarch64 kernels.
const HUGE_PAGE: usize = 2 << 20;

enum Storage {
    Lines(Vec<Line>),
    /// The mapping and the offset of the first 2 MiB boundary in it.
    Mapped(memmap2::MmapMut, usize),
}

impl AlignedBytes {
    pub(super) fn zeroed(len: usize) -> Self {
        if len >= HUGE_PAGE {
            if let Some(storage) = Self::huge(len) {
                return Self { storage, len };
            }
        }
        Self {
            storage: Storage::Lines(vec![Line([0; 64]); len.div_ceil(64)]),
            len,
        }
    }

    /// Whether the bytes live in a mapping advised for huge pages (false where the mapping failed or the
    /// buffer is under one huge page).
    pub(super) fn in_huge_page_mapping(&self) -> bool {
        matches!(self.storage, Storage::Mapped(..))
    }

    /// An anonymous mapping (zero pages until written) with a 2 MiB-aligned run of `len` bytes.
    fn huge(len: usize) -> Option<Storage> {
        let map = memmap2::MmapMut::map_anon(len.checked_add(HUGE_PAGE)?).ok()?;
        let offset = map.as_ptr().align_offset(HUGE_PAGE);
        #[cfg(target_os = "linux")]
        {
            // Advice only: on failure the pages stay small.
            let _ = map.advise_range(memmap2::Advice::HugePage, offset, len);
        }
        Some(Storage::Mapped(map, offset))
    }
}

impl Clone for AlignedBytes {
    fn clone(&self) -> Self {
        let mut copy = Self::zeroed(self.len);
        copy.copy_from_slice(self);
        copy
    }
}

impl std::ops::Deref for AlignedBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match &self.storage {
            // SAFETY: `lines` holds at least `len` initialised bytes (64 per line, no padding in `Line`).
            Storage::Lines(lines) => unsafe {
                std::slice::from_raw_parts(lines.as_ptr() as *const u8, self.len)
            },
            Storage::Mapped(map, offset) => &map[*offset..*offset + self.len],
        }
    }
}

impl std::ops::DerefMut for AlignedBytes {
    fn deref_mut(&mut self) -> &mut [u8] {
        match &mut self.storage {
            // SAFETY: as in `deref`, and the slice borrows `self` mutably.
            Storage::Lines(lines) => unsafe {
                std::slice::from_raw_parts_mut(lines.as_mut_ptr() as *mut u8, self.len)
            },
            Storage::Mapped(map, offset) => &mut map[*offset..*offset + self.len],
        }
    }
}

impl std::fmt::Debug for AlignedBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AlignedBytes({} bytes)", self.len)
    }
}

/// 64-bit words in the memory the kernels' weights live in (a 2 MiB-aligned mapping advised for huge pages
/// where the buffer is that large): the DRAM probe's buffer, so that the probe and the kernels it is the
/// yardstick of read pages of one kind (a `Vec`'s small pages read 2-27% slower on a Zen 4 VM, which let
/// kernels reach "113% of the probe").
pub struct WeightMemoryWords(AlignedBytes);

impl WeightMemoryWords {
    /// `len` words, word `i` set to `value(i)` (written, so every page is resident before a timed read).
    pub fn filled(len: usize, value: impl Fn(usize) -> u64) -> Self {
        let mut words = Self(AlignedBytes::zeroed(len * 8));
        for (i, w) in words.iter_mut().enumerate() {
            *w = value(i);
        }
        words
    }

    /// Whether the words live in a mapping advised for huge pages (false where the mapping failed or the
    /// buffer is under one huge page).
    pub fn in_huge_page_mapping(&self) -> bool {
        self.0.in_huge_page_mapping()
    }
}

impl std::ops::Deref for WeightMemoryWords {
    type Target = [u64];
    fn deref(&self) -> &[u64] {
        // SAFETY: the bytes start on a 64-byte boundary, are initialised, and number 8 per word.
        unsafe { std::slice::from_raw_parts(self.0.as_ptr() as *const u64, self.0.len() / 8) }
    }
}

impl std::ops::DerefMut for WeightMemoryWords {
    fn deref_mut(&mut self) -> &mut [u64] {
        // SAFETY: as in `deref`, borrowed mutably through `self`.
        unsafe { std::slice::from_raw_parts_mut(self.0.as_mut_ptr() as *mut u64, self.0.len() / 8) }
    }
}

/// Activation rows as the kernels read them: each row zero-padded to `kp` floats and the first starting on a
/// 64-byte boundary (so every row does, `kp` being a multiple of 32), borrowed when the caller's already are.
/// A 64-byte load of activations that straddles two cache lines splits in two on Zen 4: with the rows at 16
/// bytes past a line (as the expert-gathered rows of a MoE often are), a cold 4096x4096 int8 GEMV took 0.75-0.82
/// ms, and 0.43-0.50 ms with the rows copied to a boundary (paired probe, same weights). The copy costs one pass
/// over `m * kp` floats.
pub(super) enum AlignedRows<'a> {
    Borrowed(&'a [f32]),
    /// Zeroed lines (16 floats each) holding `len` floats.
    Copied(Vec<Line>, usize),
}

impl<'a> AlignedRows<'a> {
    /// `src` is `[rows, k]`; `kp >= k`.
    pub(super) fn of(src: &'a [f32], rows: usize, k: usize, kp: usize) -> Self {
        if k == kp && (src.as_ptr() as usize).is_multiple_of(64) {
            return Self::Borrowed(src);
        }
        let len = rows * kp;
        let mut lines = vec![Line([0; 64]); len.div_ceil(16)];
        // SAFETY: a `Line` is 64 initialised bytes without padding, aligned for f32, and all-zero bytes are
        // 0.0f32, so the lines are `len` (and more) initialised floats.
        let dst = unsafe { std::slice::from_raw_parts_mut(lines.as_mut_ptr() as *mut f32, len) };
        pad_rows_into(dst, src, k, kp);
        Self::Copied(lines, len)
    }
}

impl std::ops::Deref for AlignedRows<'_> {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        match self {
            Self::Borrowed(s) => s,
            // SAFETY: as in `of`: the lines hold at least `len` initialised floats.
            Self::Copied(lines, len) => unsafe {
                std::slice::from_raw_parts(lines.as_ptr() as *const f32, *len)
            },
        }
    }
}
