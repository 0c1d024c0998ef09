//! GGUF files with random damage in their header (metadata and tensor infos; 10,000 cases): opening,
//! converting the tokenizer and importing never panic, and every error names the file.

use std::path::Path;

use proptest::prelude::*;
use qarl::model::gguf::{import_gguf, tokenizer::hf_tokenizer, GgufFile, OutputDtype};

/// Where the tensor data of the fixture starts (metadata and tensor infos come before; checked below).
const HEADER: usize = 10_048;

fn fixture() -> Vec<u8> {
    std::fs::read(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gguf/tiny_llama.gguf"))
        .unwrap()
}

#[test]
fn the_fuzzed_range_is_the_header() {
    let bytes = fixture();
    let last_name = b"output.weight";
    let at = bytes.windows(last_name.len()).rposition(|w| w == last_name);
    assert!(at.is_some_and(|a| a < HEADER), "{at:?}");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 10_000, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn damaged_gguf_headers_are_errors_naming_the_file(
        edits in proptest::collection::vec((0usize..HEADER, any::<u8>()), 1..6),
        cut in proptest::option::weighted(0.1, 0usize..HEADER + 64),
        import in proptest::bool::weighted(0.05),
    ) {
        thread_local! {
            static ORIGINAL: Vec<u8> = fixture();
            static DIR: tempfile::TempDir = tempfile::tempdir().unwrap();
        }
        let mut bytes = ORIGINAL.with(Clone::clone);
        for (at, v) in edits {
            bytes[at] = v;
        }
        if let Some(c) = cut {
            bytes.truncate(c);
        }
        let (path, out) = DIR.with(|d| (d.path().join("damaged.gguf"), d.path().join("out")));
        std::fs::write(&path, &bytes).unwrap();
        let name = "damaged.gguf";
        match GgufFile::open(&path) {
            Err(e) => prop_assert!(e.to_string().contains(name), "{}", e),
            Ok(f) => {
                if let Err(e) = hf_tokenizer(&f) {
                    prop_assert!(e.to_string().contains(name), "{}", e);
                }
                if import {
                    let _ = std::fs::remove_dir_all(&out);
                    if let Err(e) = import_gguf(&path, &out, OutputDtype::F32) {
                        prop_assert!(format!("{e:#}").contains(name), "{:#}", e);
                    }
                }
            }
        }
    }
}
