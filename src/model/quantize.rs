//! Quantizing a model: putting a [`Decoder`]'s weights in a precision (one weight version of its selected
//! linear layers), and quantized checkpoints: the selected projections stored as packed codes
//! (`X.qweight`, U8) and f32 scales (`X.scales`), everything else copied unchanged, and
//! `quantization_config` in config.json. Loading one reads the packed weights as they are: no
//! re-quantization.

use std::path::Path;

use anyhow::{bail, Context};
use safetensors::Dtype;
use serde_json::Value;

use super::error::QuantizeError;
use super::names::{tensor_name, QWEIGHT, SCALES, WEIGHT};
use super::{Checkpoint, Decoder, ModelConfig};
use crate::quant::{Precision, QuantConfig, QuantizedTensor};

impl Decoder {
    /// Puts the weights in `precision`: f32 drops every quantized version; a scheme quantizes the default
    /// layer selection ([`QuantConfig::new`]) from the current masters (one new weight version, whose packed
    /// weights then serve the rollout and the aligned training forward). Returns how many layers are
    /// quantized. The one way every command puts a model in a precision.
    pub fn set_precision(&mut self, precision: Precision) -> Result<usize, QuantizeError> {
        match precision.scheme() {
            Some(scheme) => self.quantize(&QuantConfig::new(scheme)),
            None => {
                for (_, lin) in self.linears_mut() {
                    lin.dequantize();
                }
                Ok(0)
            }
        }
    }

    /// The precision of the weights' current version: the scheme of the quantized layers, or f32.
    pub fn precision(&self) -> Precision {
        let scheme = self
            .linears()
            .find_map(|lin| lin.quant.as_ref().map(|q| q.scheme()));
        Precision::from(scheme)
    }

    /// Bytes of the weights one forward step reads in the current precision: every linear layer's packed
    /// codes and scales (or its f32 master) and the LM head (the tied embeddings when there is none). The
    /// denominator of a decode step's bandwidth; norms and the embedding rows looked up are left out.
    pub fn weight_bytes(&self) -> usize {
        let linears: usize = self.linears().map(linear_bytes).sum();
        let tied_head = match self.lm_head {
            Some(_) => 0,
            None => self.config.vocab_size * self.config.hidden_size * 4,
        };
        linears + tied_head
    }

    /// Bytes of each MoE layer's experts in the current precision, `[layer][expert]` (empty for a dense
    /// layer): a decode step reads only the experts its tokens were routed to, where [`Self::weight_bytes`]
    /// counts them all.
    pub fn expert_weight_bytes(&self) -> Vec<Vec<usize>> {
        self.layers
            .iter()
            .map(|layer| match &layer.mlp {
                super::mlp::FeedForward::Moe(moe) => moe
                    .experts
                    .iter()
                    .map(|e| {
                        [&e.gate_proj, &e.up_proj, &e.down_proj]
                            .map(linear_bytes)
                            .iter()
                            .sum()
                    })
                    .collect(),
                super::mlp::FeedForward::Dense(_) => Vec::new(),
            })
            .collect()
    }

    /// Bytes of weights a forward reads whose tokens were routed as `routing` (per layer, the expert ids
    /// of its tokens; `None` for dense layers): `all` ([`Self::weight_bytes`]) with only the experts routed
    /// to. `all` and `experts` ([`Self::expert_weight_bytes`]) are computed once by the caller: walking
    /// the model's parts names every expert, too slow for every decode step of a large MoE.
    pub fn routed_weight_bytes(
        all: usize,
        experts: &[Vec<usize>],
        routing: &[Option<Vec<u32>>],
    ) -> usize {
        let mut bytes = all;
        for (layer, ids) in experts.iter().zip(routing) {
            let (Some(ids), false) = (ids, layer.is_empty()) else {
                continue;
            };
            let mut touched = vec![false; layer.len()];
            for &e in ids {
                if let Some(t) = touched.get_mut(e as usize) {
                    *t = true;
                }
            }
            bytes -= layer
                .iter()
                .zip(&touched)
                .filter(|(_, t)| !**t)
                .map(|(b, _)| b)
                .sum::<usize>();
        }
        bytes
    }

    /// Quantizes the layers `cfg` selects (others go back to full precision); returns how many were
    /// quantized.
    pub fn quantize(&mut self, cfg: &QuantConfig) -> Result<usize, QuantizeError> {
        let sel = cfg.selector()?;
        let mut n = 0;
        for (name, lin) in self.linears_mut() {
            if sel.selects(&name) {
                lin.quantize(cfg.scheme)
                    .map_err(|error| QuantizeError::Layer { layer: name, error })?;
                n += 1;
            } else {
                lin.dequantize();
            }
        }
        if n == 0 {
            return Err(QuantizeError::NoLayerSelected {
                patterns: cfg.patterns_text(),
            });
        }
        Ok(n)
    }

    /// Re-quantizes the layers that are quantized now from their current masters (same schemes); returns how
    /// many. This is the once-per-weight-version step after an optimizer update.
    pub fn requantize(&mut self) -> Result<usize, QuantizeError> {
        let mut n = 0;
        for (name, lin) in self.linears_mut() {
            if let Some(scheme) = lin.quant.as_ref().map(|q| q.scheme()) {
                lin.quantize(scheme)
                    .map_err(|error| QuantizeError::Layer { layer: name, error })?;
                n += 1;
            }
        }
        Ok(n)
    }
}

/// What [`quantize_checkpoint`] did.
#[derive(Debug, Clone, PartialEq)]
pub struct QuantizeSummary {
    pub quantized_tensors: usize,
    pub copied_tensors: usize,
    pub bytes_before: usize,
    pub bytes_after: usize,
}

/// Writes a quantized copy of the model in `src` to `dst` (created; must not be `src`).
pub fn quantize_checkpoint(
    src: &Path,
    dst: &Path,
    cfg: &QuantConfig,
) -> anyhow::Result<QuantizeSummary> {
    let config = ModelConfig::from_file(src)?;
    if config.quantization.is_some() {
        bail!(
            "{}: the model is already quantized",
            src.join("config.json").display()
        );
    }
    if dst.exists() && std::fs::canonicalize(dst)? == std::fs::canonicalize(src)? {
        bail!(
            "{}: the output directory must differ from the model directory",
            dst.display()
        );
    }
    let sel = cfg.selector()?;
    // The tensors the loader reads as a linear layer's weight: only those can be read back packed (the
    // embedding or a norm written as `.qweight` would make a checkpoint nothing loads).
    let mut linear_weights = std::collections::BTreeSet::new();
    super::Decoder::lazy(config.clone(), &burn::tensor::Device::flex()).visit_parts(
        |path, part| {
            if matches!(part, super::params::Part::Linear(_)) {
                linear_weights.insert(format!("{path}.{WEIGHT}"));
            }
        },
    );
    let ckpt = Checkpoint::open(src)?;
    // Packed codes in place of a weight (one beside its weight is named below, as a damaged checkpoint).
    let packed_suffix = format!(".{QWEIGHT}");
    let in_place_of_weight = |n: &&str| {
        n.strip_suffix(&packed_suffix)
            .is_some_and(|prefix| !ckpt.contains(&tensor_name(prefix, WEIGHT)))
    };
    if let Some(name) = ckpt.names().find(in_place_of_weight) {
        bail!(
            "{}: holds packed codes already (`{name}`) though its config.json has no \
             `quantization_config`: a quantized checkpoint whose config lost it",
            src.display()
        );
    }
    if let Some(name) = ckpt
        .names()
        .find(|n| sel.selects(n) && !linear_weights.contains(*n))
    {
        bail!(
            "`{name}` matches the layers to quantize but is not a linear layer's weight (the model reads \
             it in full precision); narrow --include or add it to --exclude"
        );
    }
    let mut tensors: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    let mut summary = QuantizeSummary {
        quantized_tensors: 0,
        copied_tensors: 0,
        bytes_before: 0,
        bytes_after: 0,
    };
    let names: Vec<String> = ckpt.names().map(str::to_string).collect();
    for name in names {
        let (dtype, shape, bytes) = ckpt.stored(&name).expect("listed tensor");
        summary.bytes_before += bytes.len();
        let prefix = name.strip_suffix(WEIGHT).and_then(|p| p.strip_suffix('.'));
        match prefix {
            Some(prefix) if shape.len() == 2 && sel.selects(&name) => {
                for part in [QWEIGHT, SCALES] {
                    let made = tensor_name(prefix, part);
                    if ckpt.stored(&made).is_some() {
                        bail!(
                            "{}: `{made}` is already in the checkpoint beside `{name}`, which this would \
                             quantize into it: a damaged or half-quantized checkpoint",
                            src.display()
                        );
                    }
                }
                let (out, inn) = (shape[0], shape[1]);
                let w = ckpt.read_f32(&name, &shape)?;
                let q = QuantizedTensor::quantize(&w, out, inn, cfg.scheme)
                    .with_context(|| format!("quantizing `{name}`"))?;
                let scale_shape = q.scale_shape();
                let (_, _, data, scales) = q.into_parts();
                let row_bytes = data.len() / out.max(1);
                let scale_bytes: Vec<u8> = scales.iter().flat_map(|s| s.to_le_bytes()).collect();
                summary.bytes_after += data.len() + scale_bytes.len();
                tensors.push((
                    tensor_name(prefix, QWEIGHT),
                    Dtype::U8,
                    vec![out, row_bytes],
                    data,
                ));
                tensors.push((
                    tensor_name(prefix, SCALES),
                    Dtype::F32,
                    scale_shape,
                    scale_bytes,
                ));
                summary.quantized_tensors += 1;
            }
            _ => {
                summary.bytes_after += bytes.len();
                tensors.push((name.clone(), dtype, shape, bytes.to_vec()));
                summary.copied_tensors += 1;
            }
        }
    }
    if summary.quantized_tensors == 0 {
        bail!(
            "no tensor of {} matches the quantization patterns ({})",
            src.display(),
            cfg.patterns_text()
        );
    }

    std::fs::create_dir_all(dst).with_context(|| format!("{}: cannot create", dst.display()))?;
    let entries: Vec<(String, Dtype, Vec<usize>, &[u8])> = tensors
        .iter()
        .map(|(n, d, s, b)| (n.clone(), *d, s.clone(), b.as_slice()))
        .collect();
    // The format in the file too: config.json alone said how to read the codes, and two formats of one
    // shape (mxfp4 and int4-g32) read as each other without error, as garbage.
    let metadata = std::collections::HashMap::from([
        ("format".to_string(), "pt".to_string()),
        (
            super::checkpoint::SCHEME_METADATA.to_string(),
            cfg.scheme.name().to_string(),
        ),
    ]);
    crate::io::write_safetensors_with_metadata(
        &dst.join(super::checkpoint::SINGLE_FILE),
        &entries,
        Some(metadata),
    )?;

    let cfg_path = src.join("config.json");
    let mut json: Value = serde_json::from_str(&std::fs::read_to_string(&cfg_path)?)?;
    let mut qc = serde_json::to_value(cfg)?;
    qc["quant_method"] = Value::from("qarl");
    json["quantization_config"] = qc;
    crate::io::write_json_atomic(&dst.join("config.json"), &json)?;
    super::checkpoint::copy_side_files(src, dst)?;
    Ok(summary)
}

/// Bytes of one linear layer's weights as a forward reads them: packed codes and scales, or the f32 master.
fn linear_bytes(lin: &super::layers::Linear) -> usize {
    match &lin.quant {
        Some(q) => q.storage_bytes(),
        None => lin.d_in() * lin.d_out() * 4,
    }
}
