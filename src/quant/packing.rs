//! Int4 packing. The storage format is bytes; a u32-word view exists for kernels that load 32 bits at a time.
//!
//! **Bytes (the storage, in memory and on disk).** Row-major, each row of `inn` codes takes
//! `ceil(inn / 2)` bytes; byte `j` of a row holds column `2j` in its low nibble (bits 0..4) and column
//! `2j + 1` in its high nibble (bits 4..8). A nibble is the code's 4-bit two's complement,
//! `(q as u8) & 0xF` (so -8 is `0x8`, -1 is `0xF`). When `inn` is odd the high nibble of the last byte of
//! each row is padding and is always 0; rows never share a byte, so row `r` starts at byte
//! `r * ceil(inn / 2)`.
//!
//! **u32 words (a view).** Row-major, each row takes `ceil(inn / 8)` words; word `w` of a row holds columns
//! `8w .. 8w + 8`, column `8w + k` in bits `4k .. 4k + 4` (little nibble first); padding nibbles past `inn`
//! are 0. When `inn` is a multiple of 8 this is exactly the byte storage read as little-endian u32s.
//!
//! Both are the storage and kernel layouts of `cube_kernels::format` for 4-bit codes (the word view is what
//! the CubeCL kernels read); the lengths and the padding rule come from there.

use cube_kernels::format::{packed_bytes, packed_words, padding_fault, INT4_BITS};

use super::error::{check_matrix_len, QuantError};
use super::int::{INT4_MAX, INT4_MIN};

/// Bytes per packed int4 row of `inn` codes.
pub fn int4_row_bytes(inn: usize) -> usize {
    packed_bytes(INT4_BITS, inn)
}

/// u32 words per int4 row of `inn` codes in the word view.
pub fn int4_row_words(inn: usize) -> usize {
    packed_words(INT4_BITS, inn)
}

/// The 4-bit two's-complement nibble of an int4 code.
pub fn int4_to_nibble(code: i8) -> u8 {
    (code as u8) & 0x0F
}

/// The int4 code held in the low 4 bits of `nibble` (sign-extended).
pub fn nibble_to_int4(nibble: u8) -> i8 {
    ((nibble << 4) as i8) >> 4
}

/// Packs row-major int4 codes `[out, inn]` (each in [-8, 7]) into the byte storage.
pub fn pack_int4(codes: &[i8], out: usize, inn: usize) -> Result<Vec<u8>, QuantError> {
    check_matrix_len("int4 codes", out, inn, codes.len())?;
    if let Some(index) = codes
        .iter()
        .position(|q| !(INT4_MIN..=INT4_MAX).contains(q))
    {
        return Err(QuantError::InvalidCode {
            what: "int4 codes",
            index,
            detail: format!("{} is outside [-8, 7]", codes[index]),
        });
    }
    let row_bytes = int4_row_bytes(inn);
    let mut bytes = vec![0u8; out * row_bytes];
    if inn == 0 {
        return Ok(bytes);
    }
    for (row_codes, row) in codes.chunks(inn).zip(bytes.chunks_mut(row_bytes)) {
        for (pair, byte) in row_codes.chunks(2).zip(row.iter_mut()) {
            let high = pair.get(1).map_or(0, |&q| int4_to_nibble(q));
            *byte = int4_to_nibble(pair[0]) | (high << 4);
        }
    }
    Ok(bytes)
}

/// Unpacks the byte storage of an `[out, inn]` int4 tensor into row-major codes. A non-zero padding nibble
/// is an error: the storage is canonical, so equal tensors have equal bytes.
pub fn unpack_int4(bytes: &[u8], out: usize, inn: usize) -> Result<Vec<i8>, QuantError> {
    let row_bytes = check_int4_storage(bytes, out, inn)?;
    let mut codes = Vec::with_capacity(out * inn);
    if inn == 0 {
        return Ok(codes);
    }
    for row in bytes.chunks(row_bytes) {
        for col in 0..inn {
            codes.push(nibble_to_int4(row[col / 2] >> (4 * (col % 2))));
        }
    }
    Ok(codes)
}

/// Checks the length and the padding nibbles of the byte storage of an `[out, inn]` int4 tensor; returns the
/// bytes per row.
fn check_int4_storage(bytes: &[u8], out: usize, inn: usize) -> Result<usize, QuantError> {
    let row_bytes = int4_row_bytes(inn);
    check_matrix_len("int4 packed bytes", out, row_bytes, bytes.len())?;
    check_int4_padding(bytes, inn)?;
    Ok(row_bytes)
}

/// Checks that the padding nibbles of odd-length rows are zero.
fn check_int4_padding(bytes: &[u8], inn: usize) -> Result<(), QuantError> {
    match padding_fault(INT4_BITS, inn, bytes) {
        None => Ok(()),
        Some(bad) => Err(QuantError::InvalidCode {
            what: "int4 packed bytes",
            index: bad.byte(),
            detail: bad.to_string(),
        }),
    }
}

/// Converts the byte storage of an `[out, inn]` int4 tensor to the u32-word view.
pub fn int4_bytes_to_words(bytes: &[u8], out: usize, inn: usize) -> Result<Vec<u32>, QuantError> {
    let row_bytes = check_int4_storage(bytes, out, inn)?;
    let row_words = int4_row_words(inn);
    let mut words = vec![0u32; out * row_words];
    if inn == 0 {
        return Ok(words);
    }
    for (row, word_row) in bytes.chunks(row_bytes).zip(words.chunks_mut(row_words)) {
        for (chunk, word) in row.chunks(4).zip(word_row.iter_mut()) {
            let mut le = [0u8; 4];
            le[..chunk.len()].copy_from_slice(chunk);
            *word = u32::from_le_bytes(le);
        }
    }
    Ok(words)
}

/// Converts the u32-word view of an `[out, inn]` int4 tensor back to the byte storage. Non-zero padding
/// nibbles are an error.
pub fn int4_words_to_bytes(words: &[u32], out: usize, inn: usize) -> Result<Vec<u8>, QuantError> {
    let row_words = int4_row_words(inn);
    check_matrix_len("int4 packed words", out, row_words, words.len())?;
    let row_bytes = int4_row_bytes(inn);
    let mut bytes = vec![0u8; out * row_bytes];
    if inn == 0 {
        return Ok(bytes);
    }
    let used_nibbles_in_last_word = inn - 8 * (row_words - 1);
    let padding_mask = if used_nibbles_in_last_word == 8 {
        0
    } else {
        u32::MAX << (4 * used_nibbles_in_last_word)
    };
    for (row, (word_row, byte_row)) in words
        .chunks(row_words)
        .zip(bytes.chunks_mut(row_bytes))
        .enumerate()
    {
        let last = word_row[row_words - 1];
        if last & padding_mask != 0 {
            return Err(QuantError::InvalidCode {
                what: "int4 packed words",
                index: row * row_words + row_words - 1,
                detail: format!("padding nibbles of row {row} are not 0 (word {last:#010x})"),
            });
        }
        let le: Vec<u8> = word_row.iter().flat_map(|w| w.to_le_bytes()).collect();
        byte_row.copy_from_slice(&le[..row_bytes]);
    }
    Ok(bytes)
}
