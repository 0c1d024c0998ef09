//! `qarl import-gguf` and `qarl quantize` write into a temporary directory and move the result into place on
//! success: a failed run leaves an existing output directory exactly as it was and no partial directory
//! behind; outputs get the usual permissions.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

fn fixture(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(rel)
}

fn files(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| {
            (
                e.file_name().to_string_lossy().to_string(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect()
}

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().to_string())
        .collect();
    v.sort();
    v
}

fn qarl(args: &[&std::ffi::OsStr]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_qarl"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

/// A copy of the tiny GGUF fixture with `edit` applied to its bytes.
fn edited(dir: &Path, name: &str, edit: impl FnOnce(&mut Vec<u8>)) -> PathBuf {
    let mut bytes = std::fs::read(fixture("gguf/tiny_llama.gguf")).unwrap();
    edit(&mut bytes);
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

#[test]
fn a_failed_import_leaves_the_output_directory_unchanged() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("model");
    let good = fixture("gguf/tiny_llama.gguf");
    let (ok, err) = qarl(&[
        "import-gguf".as_ref(),
        good.as_os_str(),
        "--output".as_ref(),
        out.as_os_str(),
    ]);
    assert!(ok, "{err}");
    let before = files(&out);
    assert!(before.contains_key("model.safetensors") && before.contains_key("tokenizer.json"));
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        for f in ["model.safetensors", "config.json", "tokenizer.json"] {
            let mode = std::fs::metadata(out.join(f)).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o644, "{f}: mode {mode:o}");
        }
        let mode = std::fs::metadata(&out).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o755, "the output directory: mode {mode:o}");
    }

    // An unsupported tokenizer (found before any weight is written), then a file cut inside its tensor data.
    let bad_tok = edited(tmp.path(), "bad_tok.gguf", |b| {
        let key = b"tokenizer.ggml.model";
        let at = b.windows(key.len()).position(|w| w == key).unwrap() + key.len() + 12;
        assert_eq!(&b[at..at + 4], b"gpt2");
        b[at..at + 4].copy_from_slice(b"gptX");
    });
    let cut = edited(tmp.path(), "cut.gguf", |b| b.truncate(b.len() - 100));
    for (bad, want) in [(&bad_tok, "gptX"), (&cut, "cut.gguf")] {
        let (ok, err) = qarl(&[
            "import-gguf".as_ref(),
            bad.as_os_str(),
            "--output".as_ref(),
            out.as_os_str(),
        ]);
        // An output that holds a model already is refused before anything is read or written.
        assert!(!ok && err.contains("exists and is not empty"), "{err}");
        assert_eq!(
            files(&out),
            before,
            "a failed import changed {}",
            out.display()
        );
        let fresh = tmp.path().join("fresh");
        let (ok, err) = qarl(&[
            "import-gguf".as_ref(),
            bad.as_os_str(),
            "--output".as_ref(),
            fresh.as_os_str(),
        ]);
        println!("{}: {err}", bad.display());
        assert!(!ok && err.contains(want), "{err}");
        assert!(!fresh.exists(), "a failed import left {}", fresh.display());
    }
    let mut left = names(tmp.path());
    left.retain(|n| n.starts_with('.'));
    assert!(left.is_empty(), "partial directories left: {left:?}");

    // A directory given as the GGUF file.
    let (ok, err) = qarl(&[
        "import-gguf".as_ref(),
        tmp.path().as_os_str(),
        "--output".as_ref(),
        tmp.path().join("x").as_os_str(),
    ]);
    assert!(!ok && err.contains("is a directory"), "{err}");
    assert!(!err.contains("os error"), "{err}");
}

#[test]
fn a_failed_quantize_leaves_the_output_directory_unchanged() {
    let tmp = tempfile::tempdir().unwrap();
    let src = fixture("hf/llama");
    let out = tmp.path().join("q");
    let (ok, err) = qarl(&[
        "quantize".as_ref(),
        "--model".as_ref(),
        src.as_os_str(),
        "--scheme".as_ref(),
        "int8-pc".as_ref(),
        "--output".as_ref(),
        out.as_os_str(),
    ]);
    assert!(ok, "{err}");
    let before = files(&out);
    let (ok, err) = qarl(&[
        "quantize".as_ref(),
        "--model".as_ref(),
        src.as_os_str(),
        "--scheme".as_ref(),
        "int4-g32".as_ref(),
        "--include".as_ref(),
        "no.such.weight".as_ref(),
        "--output".as_ref(),
        out.as_os_str(),
    ]);
    assert!(!ok && err.contains("exists and is not empty"), "{err}");
    assert_eq!(files(&out), before, "a failed quantize changed the output");
    let fresh = tmp.path().join("fresh");
    let (ok, err) = qarl(&[
        "quantize".as_ref(),
        "--model".as_ref(),
        src.as_os_str(),
        "--scheme".as_ref(),
        "int4-g32".as_ref(),
        "--include".as_ref(),
        "no.such.weight".as_ref(),
        "--output".as_ref(),
        fresh.as_os_str(),
    ]);
    assert!(!ok && err.contains("no tensor"), "{err}");
    assert_eq!(names(tmp.path()), vec!["q".to_string()], "leftovers");
    // The source as the output is refused before anything is written.
    let copy = tmp.path().join("src");
    std::fs::create_dir_all(&copy).unwrap();
    for (n, b) in files(&src) {
        std::fs::write(copy.join(n), b).unwrap();
    }
    let src_files = files(&copy);
    let (ok, err) = qarl(&[
        "quantize".as_ref(),
        "--model".as_ref(),
        copy.as_os_str(),
        "--scheme".as_ref(),
        "int8-pc".as_ref(),
        "--output".as_ref(),
        copy.as_os_str(),
    ]);
    assert!(!ok && err.contains("--output is the --model"), "{err}");
    assert_eq!(files(&copy), src_files);
}

/// Every file a command writes gets an ordinary file's permissions (0644), not the 0600 of the temporary
/// file it was written through: `qarl init-model` created its config.json and weights private to the writer.
#[cfg(unix)]
#[test]
fn written_outputs_get_the_usual_permissions() {
    use std::os::unix::fs::PermissionsExt;
    let tmp = tempfile::tempdir().unwrap();
    let model_cfg =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/models/qwen3-moe-arith.json");
    let init = tmp.path().join("init");
    let ids = tmp.path().join("ids.json");
    std::fs::write(&ids, r#"{"input_ids": [[1, 2, 3]]}"#).unwrap();
    let (scores, quantized) = (tmp.path().join("scores.json"), tmp.path().join("q"));
    let gen = tmp.path().join("gen.json");
    let runs: [&[&std::ffi::OsStr]; 4] = [
        &[
            "init-model".as_ref(),
            "--config".as_ref(),
            model_cfg.as_os_str(),
            "--output".as_ref(),
            init.as_os_str(),
        ],
        &[
            "quantize".as_ref(),
            "--model".as_ref(),
            init.as_os_str(),
            "--scheme".as_ref(),
            "int8-pc".as_ref(),
            "--output".as_ref(),
            quantized.as_os_str(),
        ],
        &[
            "score".as_ref(),
            "--model".as_ref(),
            init.as_os_str(),
            "--input".as_ref(),
            ids.as_os_str(),
            "--output".as_ref(),
            scores.as_os_str(),
        ],
        &[
            "generate".as_ref(),
            "--model".as_ref(),
            init.as_os_str(),
            "--prompt-ids".as_ref(),
            ids.as_os_str(),
            "--max-new-tokens".as_ref(),
            "2".as_ref(),
            "--output".as_ref(),
            gen.as_os_str(),
        ],
    ];
    for args in runs {
        let (ok, err) = qarl(args);
        assert!(ok, "{args:?}: {err}");
    }
    let mut checked = 0;
    for dir in [tmp.path(), &init, &quantized] {
        for e in std::fs::read_dir(dir).unwrap().flatten() {
            let (p, mode) = (e.path(), e.metadata().unwrap().permissions().mode() & 0o777);
            if p.is_file() {
                assert_eq!(mode, 0o644, "{}: mode {mode:o}", p.display());
                checked += 1;
            }
        }
    }
    assert!(checked >= 7, "{checked} files");
}
