//! config.json values that used to load and then give wrong results without a word (an ignored `hidden_act`,
//! a non-positive epsilon or RoPE base, zero sizes), and the `QARL_SIMD` choice: each is refused (or warned
//! about) with the file, the key, the value and what it must be.

use std::path::Path;

use qarl::model::ModelConfig;
use qarl::ops::cpu::kernel::SimdPath;
use serde_json::{json, Value};

fn base(name: &str) -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hf")
        .join(name)
        .join("config.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// The error of `name`'s config with `key` set to `value` (`null` removes it), which must be refused.
fn refused(name: &str, key: &str, value: Value) -> String {
    let mut v = base(name);
    if value.is_null() {
        v.as_object_mut().unwrap().remove(key);
    } else {
        v[key] = value.clone();
    }
    match ModelConfig::from_json_str(&v.to_string(), Path::new("m/config.json")) {
        Ok(_) => panic!("`{key}` = {value} was accepted"),
        Err(e) => {
            let e = e.to_string();
            assert!(e.contains("m/config.json"), "no file in: {e}");
            e
        }
    }
}

fn accepted(name: &str, key: &str, value: Value) -> ModelConfig {
    let mut v = base(name);
    v[key] = value;
    ModelConfig::from_json_str(&v.to_string(), Path::new("m/config.json")).unwrap()
}

#[test]
fn hidden_act_other_than_silu_is_refused_by_name() {
    for act in ["gelu", "gelu_pytorch_tanh", "relu", "tanh"] {
        for model in ["qwen3", "qwen3_moe", "llama"] {
            let e = refused(model, "hidden_act", json!(act));
            assert!(
                e.contains(&format!("`hidden_act` = {act} is not supported")),
                "{e}"
            );
            assert!(e.contains("supported: silu, swish"), "{e}");
        }
    }
    let e = refused("qwen3", "hidden_act", json!(3));
    assert!(e.contains("`hidden_act` must be a string"), "{e}");
    // SiLU under both names, and absent (the default), still load.
    accepted("qwen3", "hidden_act", json!("silu"));
    accepted("qwen3", "hidden_act", json!("swish"));
    let mut v = base("qwen3");
    v.as_object_mut().unwrap().remove("hidden_act");
    ModelConfig::from_json_str(&v.to_string(), Path::new("c.json")).unwrap();
}

#[test]
fn non_positive_or_non_finite_floats_are_refused() {
    // The fixture's RoPE base is in `rope_parameters`, which would win over a top-level `rope_theta`: this
    // test's model states it at the top level only.
    let refused = |model: &str, key: &str, bad: Value| {
        let e = load_edited(model, |v| {
            if key == "rope_theta" {
                v.as_object_mut().unwrap().remove("rope_parameters");
            }
            v[key] = bad.clone();
        })
        .expect_err(&format!("`{key}` = {bad} was accepted"));
        assert!(e.contains("m/config.json"), "no file in: {e}");
        e
    };
    for key in ["rms_norm_eps", "rope_theta"] {
        // 1e-50 is above zero, but 0 in the f32 forward; 1e300 infinite there.
        for bad in [json!(1e-50), json!(1e300)] {
            let e = refused("qwen3", key, bad);
            assert!(
                e.contains(&format!(
                    "`{key}` must be a finite number above zero, within f32's normal range"
                )),
                "{e}"
            );
        }
        for bad in [json!(-1), json!(0), json!(0.0), json!(-1e-6), json!("1e-6")] {
            let e = refused("qwen3", key, bad.clone());
            assert!(
                e.contains(&format!(
                    "`{key}` must be a finite number above zero, within f32's normal range, found {bad}"
                )),
                "{e}"
            );
        }
    }
    // NaN and infinities are not JSON; an overflowing literal is refused too.
    let mut v = base("qwen3").to_string();
    v = v.replacen("\"rope_theta\":", "\"rope_theta\": 1e999, \"x\":", 1);
    assert!(ModelConfig::from_json_str(&v, Path::new("m/config.json")).is_err());
    // transformers 5.x key: the error names the key that was found.
    let mut v = base("qwen3");
    v.as_object_mut().unwrap().remove("rope_theta");
    v["rope_parameters"] = json!({"rope_type": "default", "rope_theta": 0});
    let e = ModelConfig::from_json_str(&v.to_string(), Path::new("m/config.json"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("`rope_parameters.rope_theta` must be a finite number above zero"),
        "{e}"
    );
}

#[test]
fn zero_sizes_are_refused_with_the_key() {
    let dense = [
        "hidden_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "num_hidden_layers",
        "intermediate_size",
        "max_position_embeddings",
    ];
    for key in dense {
        let e = refused("qwen3", key, json!(0));
        assert!(
            e.contains(&format!("`{key}` must be ")) && e.contains("found 0"),
            "{key}: {e}"
        );
    }
    for key in [
        "num_local_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "decoder_sparse_step",
    ] {
        let e = refused("qwen3_moe", key, json!(0));
        assert!(
            e.contains(&format!("`{key}` must be positive, found 0")),
            "{e}"
        );
    }
    let e = refused("qwen3", "intermediate_size", Value::Null);
    assert!(e.contains("missing key `intermediate_size`"), "{e}");
    let experts = base("qwen3_moe")["num_local_experts"].as_u64().unwrap();
    let e = refused("qwen3_moe", "num_experts_per_tok", json!(experts + 1));
    assert!(e.contains("exceeds the number of experts"), "{e}");
    let heads = base("qwen3")["num_attention_heads"].as_u64().unwrap();
    let e = refused("qwen3", "num_key_value_heads", json!(heads + 1));
    assert!(
        e.contains("must be a multiple of `num_key_value_heads`"),
        "{e}"
    );
}

#[test]
fn moe_intermediate_size_is_needed_only_with_a_dense_layer() {
    let mut v = base("qwen3_moe");
    let o = v.as_object_mut().unwrap();
    o.insert("mlp_only_layers".into(), json!([]));
    o.insert("decoder_sparse_step".into(), json!(1));
    o.insert("intermediate_size".into(), json!(0));
    let c = ModelConfig::from_json_str(&v.to_string(), Path::new("c.json")).unwrap();
    assert_eq!(c.intermediate_size, 0);
    v["mlp_only_layers"] = json!([0]);
    let e = ModelConfig::from_json_str(&v.to_string(), Path::new("m/config.json"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("`intermediate_size` must be positive, found 0"),
        "{e}"
    );
    // An index past the last layer, which transformers would ignore: a typo or another model's list.
    let layers = base("qwen3_moe")["num_hidden_layers"].as_u64().unwrap();
    let e = refused("qwen3_moe", "mlp_only_layers", json!([layers]));
    assert!(
        e.contains(&format!(
            "`mlp_only_layers` names layer {layers}, but `num_hidden_layers` is {layers}"
        )),
        "{e}"
    );
}

#[test]
fn rope_scaling_kind_is_plain_text_with_the_supported_ones() {
    for (section, body, want) in [
        (
            "rope_scaling",
            json!({"rope_type": "linear", "factor": 2.0}),
            "`rope_scaling.rope_type` = linear is not supported yet (supported: default)",
        ),
        (
            "rope_scaling",
            json!({"type": "yarn", "factor": 4.0}),
            "`rope_scaling.type` = yarn is not supported yet (supported: default)",
        ),
        (
            "rope_scaling",
            json!({"factor": 4.0}),
            "`rope_scaling` has no `rope_type` (supported: default",
        ),
        (
            "rope_scaling",
            json!({"rope_type": 3}),
            "`rope_scaling.rope_type` must be a string (supported: default), found 3",
        ),
        (
            "rope_scaling",
            json!("linear"),
            "`rope_scaling` must be an object",
        ),
    ] {
        let e = refused("qwen3", section, body);
        assert!(e.contains(want), "expected `{want}` in: {e}");
        assert!(!e.contains("String("), "debug formatting in: {e}");
    }
    let c = accepted(
        "qwen3",
        "rope_scaling",
        json!({"rope_type": "default", "rope_theta": 5e5}),
    );
    assert_eq!(c.rope_theta, 5e5);
    accepted("qwen3", "rope_scaling", json!({}));
    // A `rope_scaling` without a base hides `rope_parameters`' from transformers, which then takes its
    // class default (1e4) whatever `rope_parameters` says (transformers 5.25, checked with 5e5 there): so
    // does the decoder.
    let c = accepted("qwen3", "rope_scaling", json!({"rope_type": "default"}));
    assert_eq!(c.rope_theta, 1e4);
}

/// A `partial_rotary_factor` below 1 (RoPE over part of each head, as transformers applies it) is refused
/// wherever config.json puts it; 1.0 is plain RoPE and loads.
#[test]
fn partial_rotary_factor_other_than_one_is_refused() {
    for (section, body, want) in [
        (
            "partial_rotary_factor",
            json!(0.25),
            "`partial_rotary_factor` = 0.25 is not supported",
        ),
        (
            "rope_parameters",
            json!({"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
            "`rope_parameters.partial_rotary_factor` = 0.5 is not supported",
        ),
        (
            "partial_rotary_factor",
            json!("half"),
            "`partial_rotary_factor` must be a number",
        ),
    ] {
        let e = refused("qwen3", section, body);
        assert!(e.contains(want), "expected `{want}` in: {e}");
    }
    accepted("qwen3", "partial_rotary_factor", json!(1.0));
}

#[test]
fn qarl_simd_names_an_unknown_or_unavailable_path() {
    use SimdPath::*;
    let here = [Avx2, Portable];
    assert_eq!(SimdPath::choose(None, &here), (Avx2, None));
    assert_eq!(SimdPath::choose(Some(""), &here), (Avx2, None));
    assert_eq!(SimdPath::choose(Some("portable"), &here), (Portable, None));
    let (p, w) = SimdPath::choose(Some("avx9"), &here);
    assert_eq!(p, Avx2);
    let w = w.expect("an unknown value is reported");
    assert!(
        w.contains("QARL_SIMD=avx9")
            && w.contains("valid values: avx512, avx2, neon, portable")
            && w.contains("using avx2"),
        "{w}"
    );
    let (p, w) = SimdPath::choose(Some("avx512"), &here);
    assert_eq!(p, Avx2);
    let w = w.expect("an unavailable path is reported");
    assert!(
        w.contains("QARL_SIMD=avx512 is not available on this machine (available: avx2, portable)"),
        "{w}"
    );
    // The detected path is one of this machine's.
    assert!(SimdPath::available().contains(&SimdPath::detect()));
}

/// The command line refuses a `QARL_SIMD` it cannot honour before doing anything (the kernels would only warn
/// and run another path than the one asked for); a valid value runs.
#[test]
fn qarl_simd_typo_is_an_error_on_the_command_line() {
    let run = |value: &str| {
        std::process::Command::new(env!("CARGO_BIN_EXE_qarl"))
            .args(["config", "show", "default"])
            .env("QARL_SIMD", value)
            .output()
            .unwrap()
    };
    let out = run("avx9");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains(
            "QARL_SIMD=avx9 is not a SIMD path (valid values: avx512, avx2, neon, portable); unset it"
        ) && !err.contains("using"),
        "{err}"
    );
    assert!(out.stdout.is_empty(), "it ran anyway");
    let out = run("portable");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A special token outside the vocabulary is never generated (a stop at it never happens): refused,
/// with the key, the id and the bound; inside it, accepted.
#[test]
fn special_tokens_outside_the_vocabulary_are_refused() {
    let vocab = base("qwen3")["vocab_size"].as_u64().unwrap();
    for key in ["eos_token_id", "bos_token_id"] {
        let e = refused("qwen3", key, json!(vocab));
        assert!(
            e.contains(&format!(
                "`{key}` must be a token id below vocab_size ({vocab})"
            )),
            "{e}"
        );
    }
    let e = refused("qwen3", "eos_token_id", json!([1, vocab + 5]));
    assert!(e.contains(&format!("found {}", vocab + 5)), "{e}");
    let ok = accepted("qwen3", "eos_token_id", json!([1, vocab - 1]));
    assert_eq!(ok.eos_token_ids, vec![1, vocab as u32 - 1]);
}

/// `pad_token_id` reads as torch's `padding_idx`: absent or null is none, a negative id counts from the end
/// of the vocabulary (early LLaMA conversions write -1), and an id outside it or a list is refused.
#[test]
fn pad_token_id_reads_as_torchs_padding_idx() {
    let vocab = base("qwen3")["vocab_size"].as_i64().unwrap();
    assert_eq!(
        accepted("qwen3", "pad_token_id", json!(null)).pad_token_id,
        None
    );
    assert_eq!(
        accepted("qwen3", "pad_token_id", json!(7)).pad_token_id,
        Some(7)
    );
    assert_eq!(
        accepted("qwen3", "pad_token_id", json!(-1)).pad_token_id,
        Some(vocab as u32 - 1)
    );
    assert_eq!(
        accepted("qwen3", "pad_token_id", json!(-vocab)).pad_token_id,
        Some(0)
    );
    for bad in [
        json!(vocab),
        json!(-vocab - 1),
        json!([3]),
        json!("3"),
        json!(1.5),
    ] {
        let e = refused("qwen3", "pad_token_id", bad.clone());
        assert!(
            e.contains(&format!(
                "`pad_token_id` must be one token id in [-{vocab}, {vocab})"
            )),
            "{bad}: {e}"
        );
    }
}

/// The config of `name` with `edit` applied (loaded, or the error).
fn load_edited(name: &str, edit: impl FnOnce(&mut Value)) -> Result<ModelConfig, String> {
    let mut v = base(name);
    edit(&mut v);
    ModelConfig::from_json_str(&v.to_string(), Path::new("m/config.json"))
        .map_err(|e| e.to_string())
}

/// What transformers 5.25's `AutoConfig` reads where config.json leaves a key out or states it twice
/// (each value below printed by it): the defaults of each model class, and the RoPE base of a section
/// winning over the top-level one.
#[test]
fn absent_keys_and_doubled_rope_bases_read_as_transformers_reads_them() {
    let without = |name: &str, key: &str| {
        load_edited(name, |v| {
            v.as_object_mut().unwrap().remove(key);
        })
        .unwrap()
    };
    // Qwen3Config: head_dim 128 (not hidden / heads); Qwen3-MoE and Llama divide.
    assert_eq!(without("qwen3", "head_dim").head_dim, 128);
    let moe = base("qwen3_moe");
    let divided =
        moe["hidden_size"].as_u64().unwrap() / moe["num_attention_heads"].as_u64().unwrap();
    assert_eq!(without("qwen3_moe", "head_dim").head_dim as u64, divided);
    // Qwen3MoeConfig: 4 key/value heads; the others as many as the query heads.
    let c = load_edited("qwen3_moe", |v| {
        v.as_object_mut().unwrap().remove("num_key_value_heads");
        v["num_attention_heads"] = json!(8);
    })
    .unwrap();
    assert_eq!(c.num_key_value_heads, 4);
    // Qwen3Config and Qwen2Config: 32 where the key is absent (the fixture's 4 query heads then do not
    // divide: refused), the query heads where it is `null`; Llama the query heads either way.
    for name in ["qwen3", "qwen2"] {
        let e = load_edited(name, |v| {
            v.as_object_mut().unwrap().remove("num_key_value_heads");
        })
        .unwrap_err();
        assert!(
            e.contains("must be a multiple of `num_key_value_heads` (32)"),
            "{e}"
        );
        let c = load_edited(name, |v| {
            v.as_object_mut().unwrap().remove("num_key_value_heads");
            v["num_attention_heads"] = json!(64);
            v["hidden_size"] = json!(64 * 16);
            v["head_dim"] = json!(16);
        })
        .unwrap();
        assert_eq!(c.num_key_value_heads, 32);
        let c = load_edited(name, |v| v["num_key_value_heads"] = Value::Null).unwrap();
        assert_eq!(c.num_key_value_heads, c.num_attention_heads);
    }
    let llama = without("llama", "num_key_value_heads");
    assert_eq!(llama.num_key_value_heads, llama.num_attention_heads);
    // LlamaConfig: bos 1 and eos 2 where the keys are absent, none where they are `null`.
    let c = load_edited("llama", |v| {
        let o = v.as_object_mut().unwrap();
        o.remove("bos_token_id");
        o.remove("eos_token_id");
    })
    .unwrap();
    assert_eq!(
        (c.bos_token_id, c.eos_token_ids.clone()),
        (Some(1), vec![2])
    );
    let c = load_edited("llama", |v| {
        v["bos_token_id"] = Value::Null;
        v["eos_token_id"] = Value::Null;
    })
    .unwrap();
    assert_eq!((c.bos_token_id, c.eos_token_ids.clone()), (None, vec![]));
    // LlamaConfig: 2048 positions; Qwen's 32768.
    assert_eq!(
        without("llama", "max_position_embeddings").max_position_embeddings,
        2048
    );
    assert_eq!(
        without("qwen3", "max_position_embeddings").max_position_embeddings,
        32768
    );
    // A theta in `rope_scaling` or `rope_parameters` wins over the top-level one; `rope_scaling`'s over
    // `rope_parameters`'.
    let theta = |sections: Value| {
        load_edited("qwen3", |v| {
            v["rope_theta"] = json!(1e6);
            for (key, section) in sections.as_object().unwrap() {
                v[key.as_str()] = section.clone();
            }
        })
        .unwrap()
        .rope_theta
    };
    let section = |t: f64| json!({"rope_type": "default", "rope_theta": t});
    assert_eq!(theta(json!({"rope_parameters": section(1e4)})), 1e4);
    assert_eq!(theta(json!({"rope_scaling": section(1e4)})), 1e4);
    assert_eq!(
        theta(json!({"rope_scaling": section(1e4), "rope_parameters": section(5e5)})),
        1e4
    );
    assert_eq!(
        theta(json!({"rope_scaling": {"rope_type": "default"}})),
        1e6
    );
}

/// A `model_type` that is not the architecture's is refused (transformers builds the model from
/// `model_type`); RoPE parameters nested per layer type are refused; `mlp_bias` counts for Llama only.
#[test]
fn model_type_nested_rope_and_mlp_bias_follow_transformers() {
    let e = load_edited("llama", |v| v["model_type"] = json!("mistral")).unwrap_err();
    assert!(
        e.contains("m/config.json")
            && e.contains("`model_type` is `mistral` but `architectures[0]` is `LlamaForCausalLM`"),
        "{e}"
    );
    for (name, ty) in [
        ("llama", "llama"),
        ("qwen2", "qwen2"),
        ("qwen3", "qwen3"),
        ("qwen3_moe", "qwen3_moe"),
    ] {
        load_edited(name, |v| v["model_type"] = json!(ty)).unwrap();
    }
    let e = load_edited("qwen3", |v| {
        v["rope_parameters"] = json!({"full_attention": {"rope_type": "yarn", "factor": 4.0}});
    })
    .unwrap_err();
    assert!(
        e.contains("`rope_parameters` holds RoPE parameters per layer type (full_attention)"),
        "{e}"
    );
    assert!(accepted("llama", "mlp_bias", json!(true)).mlp_bias);
    for name in ["qwen2", "qwen3", "qwen3_moe"] {
        assert!(!accepted(name, "mlp_bias", json!(true)).mlp_bias, "{name}");
    }
}

/// Configs transformers 5.25 refuses or reads otherwise, which loaded here (review against transformers on
/// tiny models): a `sliding_attention` entry of `layer_types` ran as full attention (transformers raises at
/// the forward), a `null` for a key its config class types as a value took a default, and
/// `num_experts` was read over `num_local_experts` where both are written (transformers reads the latter).
#[test]
fn layer_types_nulls_and_expert_counts_follow_transformers() {
    let err = load_edited("qwen3", |v| {
        v["layer_types"] = json!(["full_attention", "sliding_attention"]);
        v["sliding_window"] = json!(8);
    })
    .unwrap_err();
    assert!(
        err.contains("`layer_types[1]` is \"sliding_attention\": only \"full_attention\""),
        "{err}"
    );
    let err = load_edited("qwen3", |v| v["layer_types"] = json!(["full_attention"])).unwrap_err();
    assert!(
        err.contains("`layer_types` lists 1 layers, but `num_hidden_layers` is 2"),
        "{err}"
    );
    load_edited("qwen3", |v| {
        v["layer_types"] = json!(["full_attention", "full_attention"])
    })
    .unwrap();
    for (name, key) in [
        ("qwen3", "head_dim"),
        ("qwen3_moe", "head_dim"),
        ("qwen3_moe", "num_key_value_heads"),
        ("llama", "rms_norm_eps"),
        ("qwen2", "tie_word_embeddings"),
        ("qwen3", "attention_bias"),
        ("llama", "max_position_embeddings"),
    ] {
        let err = load_edited(name, |v| v[key] = Value::Null).unwrap_err();
        assert!(err.contains(&format!("`{key}` is null")), "{name}: {err}");
    }
    // A llama's `head_dim` and a Qwen2's `attention_bias` may be null: transformers reads them as absent.
    load_edited("llama", |v| v["head_dim"] = Value::Null).unwrap();
    load_edited("qwen2", |v| v["attention_bias"] = Value::Null).unwrap();
    let err = load_edited("qwen3_moe", |v| v["num_experts"] = json!(4)).unwrap_err();
    assert!(
        err.contains("`num_local_experts` (8) and `num_experts` (4) disagree"),
        "{err}"
    );
    let same = load_edited("qwen3_moe", |v| v["num_experts"] = json!(8)).unwrap();
    assert_eq!(same.moe.unwrap().num_experts, 8);
}

/// What changes training in transformers but is not implemented here is refused, not read as its
/// default: attention dropout, Qwen3-MoE's router load-balancing loss; `null` where transformers 5.25's
/// typed configs refuse it (`hidden_act`, `decoder_sparse_step`) or cannot build the model
/// (`rope_theta`); a Llama whose hidden size the heads do not divide, even with `head_dim` given.
#[test]
fn training_only_keys_nulls_and_llama_shapes_are_refused() {
    for name in ["qwen3", "qwen3_moe", "llama", "qwen2"] {
        let e = refused(name, "attention_dropout", json!(0.1));
        assert!(
            e.contains("`attention_dropout` = 0.1 is not supported"),
            "{e}"
        );
        accepted(name, "attention_dropout", json!(0.0));
        accepted(name, "attention_dropout", json!(0));
        for key in ["hidden_act", "rope_theta"] {
            let e = load_edited(name, |v| v[key] = Value::Null).unwrap_err();
            assert!(e.contains(&format!("`{key}` is null")), "{e}");
        }
    }
    let e = refused("qwen3_moe", "output_router_logits", json!(true));
    assert!(
        e.contains("`output_router_logits` = true is not supported"),
        "{e}"
    );
    accepted("qwen3_moe", "output_router_logits", json!(false));
    // Not a Qwen3-MoE key: a dense model has no router.
    accepted("qwen3", "output_router_logits", json!(true));
    let e = load_edited("qwen3_moe", |v| v["decoder_sparse_step"] = Value::Null).unwrap_err();
    assert!(e.contains("`decoder_sparse_step` is null"), "{e}");
    let e = load_edited("llama", |v| {
        v["hidden_size"] = json!(100);
        v["num_attention_heads"] = json!(8);
        v["num_key_value_heads"] = json!(8);
        v["head_dim"] = json!(16);
    })
    .unwrap_err();
    assert!(
        e.contains("`hidden_size` (100) is not a multiple of `num_attention_heads` (8)"),
        "{e}"
    );
}
