//! The Hugging Face names of a model's parameters, spelled once.
//!
//! [`Decoder::visit_parts`] and [`Decoder::visit_parts_mut`] walk the parameters of a [`Decoder`] and hand each one to a
//! visitor with its HF module path (`model.layers.0.self_attn.q_proj`; its tensors are `{path}.weight` and
//! `{path}.bias`). Every user of the names goes through that walk:
//! - loading fills a [`Decoder::lazy`] model (shapes, no weights) part by part from the checkpoint;
//! - saving writes each part back under its name;
//! - the random checkpoint writer lists the tensors of a lazy model of the config ([`super::init`]);
//! - the quantization layer list is the walk's linear layers ([`Decoder::linears_mut`]).
//!
//! So a new model family spells its names once, in the `walk!` macro below. The walk's order is the order the loader
//! reads the tensors in, and the random init numbers its tensors in it (each tensor's random stream is its
//! index), so that order is part of the on-disk format of random checkpoints and must not change.

use std::convert::Infallible;

use std::path::Path;

use burn::module::Param;
use burn::tensor::{Device, Tensor};

use super::checkpoint::Checkpoint;
use super::config::ModelConfig;
use super::decoder::Decoder;
use super::error::LoadError;
use super::layers::{Linear, RmsNorm};
use super::mlp::FeedForward;
use super::names::{tensor_name, BIAS, LM_HEAD, WEIGHT};
use crate::host::tensor_from_vec;

/// One parameter-holding part of a model, shared.
#[derive(Debug, Clone, Copy)]
pub enum Part<'a> {
    /// The token embeddings, `[vocab, hidden]`.
    Embedding(&'a Param<Tensor<2>>),
    Norm(&'a RmsNorm),
    Linear(&'a Linear),
}

/// One parameter-holding part of a model, exclusive (to load it or change its precision).
#[derive(Debug)]
pub enum PartMut<'a> {
    /// The token embeddings, `[vocab, hidden]`.
    Embedding(&'a mut Param<Tensor<2>>),
    Norm(&'a mut RmsNorm),
    Linear(&'a mut Linear),
}

/// The walk over a decoder's parts, written once and expanded for shared (`visit_parts`) and exclusive
/// (`visit_parts_mut`) references, since Rust cannot abstract over mutability: `$m` is nothing or `mut`.
/// `$visit(path, part)` returns a `Result`; the first error ends the walk.
macro_rules! walk {
    ($model:expr, $visit:ident, $Part:ident $(, $m:tt)?) => {{
        let model = $model;
        $visit("model.embed_tokens", $Part::Embedding(&$($m)? model.embed_tokens))?;
        for (i, layer) in (&$($m)? model.layers).into_iter().enumerate() {
            let p = format!("model.layers.{i}");
            $visit(
                &format!("{p}.input_layernorm"),
                $Part::Norm(&$($m)? layer.input_layernorm),
            )?;
            let a = &$($m)? layer.self_attn;
            $visit(&format!("{p}.self_attn.q_proj"), $Part::Linear(&$($m)? a.q_proj))?;
            $visit(&format!("{p}.self_attn.k_proj"), $Part::Linear(&$($m)? a.k_proj))?;
            $visit(&format!("{p}.self_attn.v_proj"), $Part::Linear(&$($m)? a.v_proj))?;
            $visit(&format!("{p}.self_attn.o_proj"), $Part::Linear(&$($m)? a.o_proj))?;
            if let Some(n) = &$($m)? a.q_norm {
                $visit(&format!("{p}.self_attn.q_norm"), $Part::Norm(n))?;
            }
            if let Some(n) = &$($m)? a.k_norm {
                $visit(&format!("{p}.self_attn.k_norm"), $Part::Norm(n))?;
            }
            $visit(
                &format!("{p}.post_attention_layernorm"),
                $Part::Norm(&$($m)? layer.post_attention_layernorm),
            )?;
            match &$($m)? layer.mlp {
                FeedForward::Dense(mlp) => {
                    $visit(&format!("{p}.mlp.gate_proj"), $Part::Linear(&$($m)? mlp.gate_proj))?;
                    $visit(&format!("{p}.mlp.up_proj"), $Part::Linear(&$($m)? mlp.up_proj))?;
                    $visit(&format!("{p}.mlp.down_proj"), $Part::Linear(&$($m)? mlp.down_proj))?;
                }
                FeedForward::Moe(moe) => {
                    for (e, ex) in (&$($m)? moe.experts).into_iter().enumerate() {
                        let x = format!("{p}.mlp.experts.{e}");
                        $visit(&format!("{x}.gate_proj"), $Part::Linear(&$($m)? ex.gate_proj))?;
                        $visit(&format!("{x}.up_proj"), $Part::Linear(&$($m)? ex.up_proj))?;
                        $visit(&format!("{x}.down_proj"), $Part::Linear(&$($m)? ex.down_proj))?;
                    }
                    // The router, after the experts: the order random checkpoints number tensors in.
                    $visit(&format!("{p}.mlp.gate"), $Part::Linear(&$($m)? moe.gate))?;
                }
            }
        }
        $visit("model.norm", $Part::Norm(&$($m)? model.norm))?;
        if let Some(head) = &$($m)? model.lm_head {
            $visit(LM_HEAD, $Part::Linear(head))?;
        }
        Ok(())
    }};
}

impl Decoder {
    /// Hands every part to `visit` with its HF module path, in load order; stops at `visit`'s first error.
    pub fn try_visit_parts<'a, E>(
        &'a self,
        mut visit: impl FnMut(&str, Part<'a>) -> Result<(), E>,
    ) -> Result<(), E> {
        walk!(self, visit, Part)
    }

    /// [`Decoder::try_visit_parts`] with exclusive references.
    pub fn try_visit_parts_mut<'a, E>(
        &'a mut self,
        mut visit: impl FnMut(&str, PartMut<'a>) -> Result<(), E>,
    ) -> Result<(), E> {
        walk!(self, visit, PartMut, mut)
    }

    /// Hands every part to `visit` with its HF module path, in load order.
    pub fn visit_parts<'a>(&'a self, mut visit: impl FnMut(&str, Part<'a>)) {
        let Ok(()) = self.try_visit_parts(|path, part| {
            visit(path, part);
            Ok::<(), Infallible>(())
        });
    }

    /// [`Decoder::visit_parts`] with exclusive references.
    pub fn visit_parts_mut<'a>(&'a mut self, mut visit: impl FnMut(&str, PartMut<'a>)) {
        let Ok(()) = self.try_visit_parts_mut(|path, part| {
            visit(path, part);
            Ok::<(), Infallible>(())
        });
    }
}

impl Part<'_> {
    /// The part's tensors as a Hugging Face checkpoint stores them: suffix and shape (`[out, in]` for a
    /// linear weight), weight before bias.
    pub fn hf_shapes(&self) -> Vec<(&'static str, Vec<usize>)> {
        match self {
            Part::Embedding(p) => vec![(WEIGHT, p.lazy_shape().to_vec())],
            Part::Norm(n) => vec![(WEIGHT, vec![n.dim()])],
            Part::Linear(l) => {
                let mut out = vec![(WEIGHT, vec![l.d_out(), l.d_in()])];
                if l.bias.is_some() {
                    out.push((BIAS, vec![l.d_out()]));
                }
                out
            }
        }
    }
}

impl PartMut<'_> {
    /// Replaces the part's parameters with the checkpoint's tensors of the module at `path`, checking
    /// their shapes against the part's.
    pub fn load(self, ckpt: &Checkpoint, path: &str, device: &Device) -> Result<(), LoadError> {
        match self {
            PartMut::Embedding(p) => {
                let [v, h] = p.lazy_shape().dims::<2>();
                let w = ckpt.read_f32(&tensor_name(path, WEIGHT), &[v, h])?;
                *p = Param::from_tensor(tensor_from_vec(w, [v, h], device));
            }
            PartMut::Norm(n) => {
                let d = n.dim();
                let w = ckpt.read_f32(&tensor_name(path, WEIGHT), &[d])?;
                n.weight = Param::from_tensor(tensor_from_vec(w, [d], device));
            }
            PartMut::Linear(l) => {
                *l = Linear::load(ckpt, path, l.d_in(), l.d_out(), l.bias.is_some(), device)?;
            }
        }
        Ok(())
    }
}

impl Decoder {
    /// Loads `config.json` and the safetensors weights of a Hugging Face model directory.
    pub fn load(dir: impl AsRef<Path>, device: &Device) -> Result<Self, LoadError> {
        let (config, ckpt) = Self::open_checked(dir.as_ref())?;
        Self::from_checkpoint(config, &ckpt, device)
    }

    /// Checks a full-precision model directory as [`Decoder::load`] does (its config, and every tensor
    /// the config asks for under its name, with its shape and a dtype the loader reads, and no other)
    /// without reading a weight: an importer's check before it moves a directory into place, in the
    /// memory of the files' headers rather than of the model in f32. A quantized directory is loaded
    /// (its codes and scales are checked as they are read).
    pub fn check_files(dir: impl AsRef<Path>, device: &Device) -> Result<(), LoadError> {
        let dir = dir.as_ref();
        let (config, ckpt) = Self::open_checked(dir)?;
        if config.quantization.is_some() {
            return Self::from_checkpoint(config, &ckpt, device).map(|_| ());
        }
        let model = Self::lazy(config, device);
        model.check_dense_size(&ckpt)?;
        model.try_visit_parts(|path, part| {
            part.hf_shapes()
                .into_iter()
                .try_for_each(|(suffix, shape)| ckpt.check(&tensor_name(path, suffix), &shape))
        })?;
        model.finish_checkpoint(&ckpt)
    }

    /// A directory's config and open checkpoint, the quantization the config names checked against the
    /// tensors.
    fn open_checked(dir: &Path) -> Result<(ModelConfig, Checkpoint), LoadError> {
        let config = ModelConfig::from_file(dir)?;
        let mut ckpt = Checkpoint::open(dir)?;
        ckpt.quant_scheme = config.quantization.as_ref().map(|q| q.scheme);
        // Packed codes without a config that says how to read them (`quantization_config` dropped from
        // config.json): every such layer would be reported missing its `.weight`.
        let suffix = format!(".{}", super::names::QWEIGHT);
        if let (None, Some(packed)) = (
            ckpt.quant_scheme,
            ckpt.names().find(|n| n.ends_with(&suffix)),
        ) {
            return Err(LoadError::InvalidConfig {
                path: dir.join("config.json"),
                msg: format!(
                    "the weights hold packed codes (`{packed}`), but config.json has no \
                     `quantization_config` to read them with: restore the one `qarl quantize` wrote"
                ),
            });
        }
        if let Some(scheme) = ckpt.quant_scheme {
            // The scheme its files were written in, where they say (a relabelled config.json would read
            // one format's codes as another's).
            let name = scheme.name();
            let written = super::checkpoint::SCHEME_METADATA;
            if let Some((file, other)) = ckpt
                .shard_metadata(written)
                .find_map(|(f, v)| v.filter(|v| *v != name).map(|v| (f, v)))
            {
                return Err(LoadError::InvalidConfig {
                    path: dir.join("config.json"),
                    msg: format!(
                        "`quantization_config` says {name}, but {} holds codes written as {other} (its \
                         `{written}` metadata): one format's codes read as another's are garbage",
                        file.display()
                    ),
                });
            }
            // A config that says quantized over weights that are not: every layer would load its f32
            // `.weight` and run in full precision while the model claims the scheme.
            if !ckpt.names().any(|n| n.ends_with(&suffix)) {
                return Err(LoadError::InvalidConfig {
                    path: dir.join("config.json"),
                    msg: format!(
                        "`quantization_config` says {} but the weights hold no `*.{}` tensor: they are \
                         not quantized (remove `quantization_config`, or quantize them with `qarl quantize`)",
                        scheme.name(),
                        super::names::QWEIGHT
                    ),
                });
            }
        }
        Ok((config, ckpt))
    }

    /// [`Decoder::load`] for work on the full-precision weights (training updates them; a command that
    /// compares precisions quantizes them itself): a quantized checkpoint is refused, since its full
    /// precision would be its dequantized codes, passed off as the model's.
    pub fn load_full_precision(dir: impl AsRef<Path>, device: &Device) -> Result<Self, LoadError> {
        let dir = dir.as_ref();
        let model = Self::load(dir, device)?;
        match &model.config.quantization {
            None => Ok(model),
            Some(q) => Err(LoadError::QuantizedCheckpoint {
                dir: dir.to_path_buf(),
                scheme: q.scheme.name().to_string(),
            }),
        }
    }

    /// Builds the model from an open checkpoint, failing on any missing, mis-shaped or extra tensor: a
    /// [`Decoder::lazy`] model of `config`, each part then read under its name ([`super::params`]).
    pub fn from_checkpoint(
        config: ModelConfig,
        ckpt: &Checkpoint,
        device: &Device,
    ) -> Result<Self, LoadError> {
        let mut model = Self::lazy(config, device);
        model.check_dense_size(ckpt)?;
        model.check_packed_layers(ckpt)?;
        model.try_visit_parts_mut(|path, part| part.load(ckpt, path, device))?;
        model.finish_checkpoint(ckpt)?;
        Ok(model)
    }

    /// In a quantized checkpoint, the linear layers stored packed are exactly those its
    /// `quantization_config` selects: a layer stored otherwise (a shard of the full-precision model mixed
    /// in, edited patterns) would run in another precision than the one the model reports.
    fn check_packed_layers(&self, ckpt: &Checkpoint) -> Result<(), LoadError> {
        let Some(q) = &self.config.quantization else {
            return Ok(());
        };
        let config_path = ckpt.dir().join("config.json");
        let sel = q.selector().map_err(|e| LoadError::InvalidConfig {
            path: config_path.clone(),
            msg: format!("`quantization_config`: {e}"),
        })?;
        let mut wrong = None;
        self.visit_parts(|path, part| {
            if wrong.is_some() || !matches!(part, Part::Linear(_)) {
                return;
            }
            let weight = tensor_name(path, super::names::WEIGHT);
            let packed = ckpt.contains(&tensor_name(path, super::names::QWEIGHT));
            if sel.selects(&weight) != packed {
                wrong = Some((weight, packed));
            }
        });
        match wrong {
            None => Ok(()),
            Some((weight, packed)) => Err(LoadError::InvalidConfig {
                path: config_path,
                msg: if packed {
                    format!(
                        "`{weight}` is stored packed, but `quantization_config`'s patterns leave it in \
                         full precision: the checkpoint and its config disagree"
                    )
                } else {
                    format!(
                        "`quantization_config` selects `{weight}` for {}, but the checkpoint stores it in \
                         full precision (no `.{}`): a layer of another checkpoint mixed in?",
                        q.scheme.name(),
                        super::names::QWEIGHT
                    )
                },
            }),
        }
    }

    /// A dense feed-forward layer needs the config's `intermediate_size`.
    fn check_dense_size(&self, ckpt: &Checkpoint) -> Result<(), LoadError> {
        let dense = self
            .layers
            .iter()
            .any(|l| matches!(l.mlp, FeedForward::Dense(_)));
        if dense && self.config.intermediate_size == 0 {
            return Err(LoadError::MissingKey {
                path: ckpt.dir().join("config.json"),
                key: "intermediate_size".into(),
            });
        }
        Ok(())
    }

    /// After every part was read: no tensor of the checkpoint is left over.
    fn finish_checkpoint(&self, ckpt: &Checkpoint) -> Result<(), LoadError> {
        if self.lm_head.is_none() {
            // Some exports store the tied head anyway; as the embedding matrix it is not an extra.
            check_stored_tied_head(ckpt)?;
            ckpt.ignore(&tensor_name(LM_HEAD, WEIGHT));
        }
        ckpt.ensure_all_used()
    }

    /// Every linear layer (the order of [`Decoder::linears_mut`], without the names).
    pub fn linears(&self) -> impl Iterator<Item = &Linear> {
        let mut out = Vec::new();
        self.visit_parts(|_, part| {
            if let Part::Linear(lin) = part {
                out.push(lin);
            }
        });
        out.into_iter()
    }

    /// Every linear layer with the HF name of its weight (`model.layers.0.self_attn.q_proj.weight`, ...),
    /// in the order of [`Decoder::visit_parts`]: the names quantization patterns select layers by.
    pub fn linears_mut(&mut self) -> Vec<(String, &mut Linear)> {
        let mut out = Vec::new();
        self.visit_parts_mut(|path, part| {
            if let PartMut::Linear(lin) = part {
                out.push((tensor_name(path, WEIGHT), lin));
            }
        });
        out
    }
}
/// Refuses a tied model's stored `lm_head.weight` that is not its embedding matrix: the head would be
/// dropped silently, while transformers 5 unties the two and uses the stored head (vLLM and transformers 4
/// drop it), so the same files would give other log-probs there. Where both are stored, they are compared
/// value by value (a stored copy in another dtype passes when it rounds to the same values).
fn check_stored_tied_head(ckpt: &Checkpoint) -> Result<(), LoadError> {
    let head = tensor_name(LM_HEAD, WEIGHT);
    let embed = tensor_name("model.embed_tokens", WEIGHT);
    let (Some(shape), true) = (ckpt.shape(&embed), ckpt.contains(&head)) else {
        return Ok(());
    };
    let (Ok(e), Ok(h)) = (ckpt.read_f32(&embed, &shape), ckpt.read_f32(&head, &shape)) else {
        return Err(LoadError::BadTensor {
            path: ckpt.path_of(&head),
            name: head,
            msg: format!(
                "the model ties its head to the embedding (`tie_word_embeddings`), but the stored head is \
                 not an f32/bf16/f16 matrix of the embedding's shape {shape:?}"
            ),
        });
    };
    let differ = e.iter().zip(&h).filter(|(a, b)| a != b).count();
    if differ == 0 {
        return Ok(());
    }
    Err(LoadError::BadTensor {
        path: ckpt.path_of(&head),
        name: head,
        msg: format!(
            "{differ} of its {} values differ from `{embed}`, while config.json ties the head to the \
             embedding (`tie_word_embeddings`): transformers 5 would use this head, vLLM and transformers 4 \
             the embedding; set `tie_word_embeddings` to false to use it, or remove it from the checkpoint",
            h.len()
        ),
    })
}
