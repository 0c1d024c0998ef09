//! Random checkpoints made from a `config.json`: a Hugging Face model directory with f32 weights drawn from
//! a seed, for benchmarks and tests that need a model of a given shape but not trained weights.
//!
//! Matrices (embeddings, projections, router, `lm_head`) are normal(0, std), norm weights 1, biases 0. Each
//! tensor has its own ChaCha8 stream (the seed, stream = the tensor's index in [`tensor_specs`]), so the
//! values do not depend on the order the file is written in. Tensors are generated one at a time while the
//! file is written: memory stays at the size of the largest tensor, whatever the model's size.

use std::borrow::Cow;
use std::path::Path;

use anyhow::Context;
use burn::tensor::Device;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use safetensors::tensor::{Dtype, View};

use super::checkpoint::SINGLE_FILE;
use super::config::ModelConfig;
use super::decoder::Decoder;
use super::names::tensor_name;

/// How a tensor is initialised.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InitKind {
    /// normal(0, std)
    Normal,
    /// All ones (RMSNorm weights).
    Ones,
    /// All zeros (biases).
    Zeros,
}

impl InitKind {
    /// The initialisation of the HF tensor `name`.
    pub fn of(name: &str) -> Self {
        if name.ends_with(".bias") {
            Self::Zeros
        } else if name.ends_with("norm.weight") {
            Self::Ones
        } else {
            Self::Normal
        }
    }
}

/// Every tensor the loader reads for `cfg`, by HF name, with its on-disk shape (`[out, in]` for linears), in
/// the order the decoder reads them: the tensors of a [`Decoder::lazy`] model of `cfg`, which allocates no
/// weights. That order numbers the random streams, so it is part of what a seed means.
pub fn tensor_specs(cfg: &ModelConfig) -> Vec<(String, Vec<usize>)> {
    // Nothing is allocated, so the device is only a label.
    let model = Decoder::lazy(cfg.clone(), &Device::flex());
    let mut out = Vec::new();
    model.visit_parts(|path, part| {
        for (suffix, shape) in part.hf_shapes() {
            out.push((tensor_name(path, suffix), shape));
        }
    });
    out
}

/// Number of parameters of a model of `cfg` (the elements of every tensor in [`tensor_specs`]).
pub fn param_count(cfg: &ModelConfig) -> usize {
    tensor_specs(cfg)
        .iter()
        .map(|(_, s)| s.iter().product::<usize>())
        .sum()
}

/// Fills `out` with normal(0, std) values (Box-Muller on uniform draws of `rng`).
pub fn fill_normal(rng: &mut impl Rng, std: f32, out: &mut [f32]) {
    let mut pairs = out.chunks_exact_mut(2);
    for pair in &mut pairs {
        let (a, b) = box_muller(rng);
        pair[0] = a * std;
        pair[1] = b * std;
    }
    if let [last] = pairs.into_remainder() {
        *last = box_muller(rng).0 * std;
    }
}

/// Two independent standard normal draws.
fn box_muller(rng: &mut impl Rng) -> (f32, f32) {
    // u1 in (0, 1] so that ln(u1) is finite; computed in f64 so that the tails are not cut at f32's resolution.
    let u1 = 1.0 - rng.random::<f64>();
    let u2 = rng.random::<f64>();
    let r = (-2.0 * u1.ln()).sqrt();
    let (s, c) = (std::f64::consts::TAU * u2).sin_cos();
    ((r * c) as f32, (r * s) as f32)
}

/// The values of tensor number `index` of [`tensor_specs`] (`numel` of them).
pub fn tensor_values(name: &str, index: usize, numel: usize, seed: u64, std: f32) -> Vec<f32> {
    match InitKind::of(name) {
        InitKind::Zeros => vec![0.0; numel],
        InitKind::Ones => vec![1.0; numel],
        InitKind::Normal => {
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            rng.set_stream(index as u64);
            let mut v = vec![0.0f32; numel];
            fill_normal(&mut rng, std, &mut v);
            v
        }
    }
}

/// A tensor whose bytes are generated when the writer asks for them.
struct LazyTensor {
    name: String,
    index: usize,
    shape: Vec<usize>,
    seed: u64,
    std: f32,
}

impl View for LazyTensor {
    fn dtype(&self) -> Dtype {
        Dtype::F32
    }

    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        let numel = self.shape.iter().product();
        let values = tensor_values(&self.name, self.index, numel, self.seed, self.std);
        let mut bytes = Vec::with_capacity(numel * 4);
        for x in values {
            bytes.extend_from_slice(&x.to_le_bytes());
        }
        Cow::Owned(bytes)
    }

    fn data_len(&self) -> usize {
        self.shape.iter().product::<usize>() * 4
    }
}

/// Writes a Hugging Face model directory with random f32 weights for the model `config_path` describes:
/// `out_dir/config.json` (a copy) and `out_dir/model.safetensors` (written to a temporary file in `out_dir`,
/// then renamed). Same seed and std, same bytes.
pub fn write_random_checkpoint(
    config_path: &Path,
    out_dir: &Path,
    seed: u64,
    std: f32,
) -> anyhow::Result<()> {
    // Draws reach several standard deviations: beyond 1e30 some would overflow f32 to infinity and the
    // checkpoint would hold non-finite weights. 0 makes every matrix zero: a model whose outputs ignore
    // its inputs (`model.init_std` refuses it too).
    if !(std.is_finite() && std > 0.0 && std <= 1e30) {
        anyhow::bail!(
            "the standard deviation must be a number above 0 and at most 1e30, got {std}"
        );
    }
    let cfg = ModelConfig::from_file(config_path)?;
    // The config is copied beside f32 weights, and a `quantization_config` there (a quantized checkpoint's)
    // would promise packed tensors the directory never holds: every loader would refuse it.
    if let Some(q) = &cfg.quantization {
        anyhow::bail!(
            "{}: has a `quantization_config` ({}): the config of a quantized checkpoint, while random \
             weights are written in f32; take the config without that block, and quantize the result with \
             `qarl quantize` if packed weights are wanted",
            config_path.display(),
            q.scheme
        );
    }
    let config_file = if config_path.is_dir() {
        config_path.join("config.json")
    } else {
        config_path.to_path_buf()
    };
    let text = std::fs::read_to_string(&config_file)
        .with_context(|| format!("{}: cannot read", config_file.display()))?;
    if out_dir.exists() && !out_dir.is_dir() {
        anyhow::bail!("{}: exists and is not a folder", out_dir.display());
    }
    std::fs::create_dir_all(out_dir)
        .map_err(crate::io::failed(out_dir, "cannot create the folder"))?;
    // A sharded checkpoint left in the directory would be shadowed by the single file; refuse to mix them.
    let index = out_dir.join(super::checkpoint::INDEX_FILE);
    if index.exists() {
        anyhow::bail!(
            "{}: the output directory already holds a sharded checkpoint; choose an empty directory",
            index.display()
        );
    }
    let tensors: Vec<(String, LazyTensor)> = tensor_specs(&cfg)
        .into_iter()
        .enumerate()
        .map(|(index, (name, shape))| {
            let t = LazyTensor {
                name: name.clone(),
                index,
                shape,
                seed,
                std,
            };
            (name, t)
        })
        .collect();
    let weights = out_dir.join(SINGLE_FILE);
    // serialize_to_file writes a temporary file beside the target and renames it into place, asking each
    // tensor for its bytes only while writing it.
    safetensors::serialize_to_file(tensors, None, &weights)
        .with_context(|| format!("{}: cannot write", weights.display()))?;
    // Written from a temporary file (mode 0600): give it an ordinary file's permissions.
    crate::io::set_usual_permissions(&weights);
    crate::io::write_atomic(&out_dir.join("config.json"), f32_config(&text).as_bytes())
}

/// `text` (a config.json) saying float32 where it names a dtype (`torch_dtype`, `dtype`): the weights
/// written are f32, and transformers loads a model in the dtype its config names (a `bfloat16` left there
/// gave log-probs 0.018 from qarl's). Unchanged where it names none or float32 already.
fn f32_config(text: &str) -> String {
    let Ok(serde_json::Value::Object(mut obj)) = serde_json::from_str::<serde_json::Value>(text)
    else {
        return text.to_string();
    };
    let mut changed = false;
    for key in ["torch_dtype", "dtype"] {
        if obj.get(key).is_some_and(|v| v != "float32") {
            obj.insert(key.into(), serde_json::Value::from("float32"));
            changed = true;
        }
    }
    if changed {
        serde_json::to_string_pretty(&obj).unwrap_or_else(|_| text.to_string())
    } else {
        text.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_written_config_names_the_f32_weights() {
        let bf16 = r#"{"dtype": "bfloat16", "torch_dtype": "bfloat16", "hidden_size": 8}"#;
        let out: serde_json::Value = serde_json::from_str(&f32_config(bf16)).unwrap();
        assert_eq!(
            (&out["dtype"], &out["torch_dtype"]),
            (&"float32".into(), &"float32".into())
        );
        assert_eq!(out["hidden_size"], 8);
        let plain = r#"{"hidden_size": 8}"#;
        assert_eq!(f32_config(plain), plain);
    }

    #[test]
    fn normal_draws_have_the_asked_moments() {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let mut v = vec![0.0f32; 100_001];
        fill_normal(&mut rng, 0.5, &mut v);
        let n = v.len() as f64;
        let mean = v.iter().map(|&x| x as f64).sum::<f64>() / n;
        let var = v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n;
        assert!(mean.abs() < 0.01, "mean {mean}");
        assert!((var.sqrt() - 0.5).abs() < 0.01, "std {}", var.sqrt());
        assert!(v.iter().all(|x| x.is_finite()));
    }

    #[test]
    fn values_depend_on_seed_and_tensor_only() {
        let a = tensor_values("x.weight", 3, 10, 1, 0.02);
        assert_eq!(a, tensor_values("x.weight", 3, 10, 1, 0.02));
        assert_ne!(a, tensor_values("x.weight", 4, 10, 1, 0.02));
        assert_ne!(a, tensor_values("x.weight", 3, 10, 2, 0.02));
        assert_eq!(
            tensor_values("a.input_layernorm.weight", 0, 3, 1, 0.02),
            vec![1.0; 3]
        );
        assert_eq!(
            tensor_values("a.q_norm.weight", 0, 3, 1, 0.02),
            vec![1.0; 3]
        );
        assert_eq!(tensor_values("a.q_proj.bias", 0, 3, 1, 0.02), vec![0.0; 3]);
    }
}
