//! What the learner knows of a step's kept sequences before its update ([`Scored`]: the batch, `lp_old`,
//! the rollout's records) and the metrics of the learner's forward at the step's start ([`ForwardStats`]),
//! shared by the scoring ([`super::rl::score`]) and the update ([`super::update`]) phases.

use std::collections::BTreeMap;

use anyhow::Context;

use super::batch::{replay_routing, ResponseForward, SeqBatch};
use crate::model::mlp::routing_to_host;
use crate::rl::metrics::{routing_disagreement, RoutingDisagreement, TokenErrors};

/// The kept sequences as the learner sees them at the start of the step.
pub struct Scored<'a> {
    pub batch: SeqBatch,
    /// The rollout's expert choices of each kept sequence (MoE).
    pub records: Vec<&'a Vec<Option<Vec<u32>>>>,
    /// Routing replay for `batch`, when on.
    pub replay: Option<Vec<Option<Vec<u32>>>>,
    /// `lp_old` of each kept response: the learner's log-probs before any update of this step.
    pub lp_old: Vec<Vec<f32>>,
    /// The rollout's recorded log-probs of each kept response.
    pub lp_roll: Vec<Vec<f32>>,
    /// The reference policy's log-probs of each kept response, where the KL term is on
    /// ([`super::reference::Reference`]).
    pub lp_ref: Option<Vec<Vec<f32>>>,
    /// The rollout's recorded entropy at each response token (empty rows when not recorded): where
    /// `lp_old` is the rollout's record, bitwise the learner forward's entropy.
    pub entropy_roll: Vec<Vec<f32>>,
    pub advantages: Vec<f32>,
    /// Whether `lp_old` is the rollout's record (no forward ran): the first update's forward then supplies
    /// the metrics of the learner's forward (entropy, routing).
    pub lp_old_reused: bool,
    /// Experts per token of the model's MoE layers (0 for a dense model).
    pub top_k: usize,
    /// The kept response with the highest fraction of error tokens (its index in `batch`), that fraction,
    /// and the criteria each of its tokens meets; `None` when no response has an error token.
    pub worst: Option<(usize, f64, Vec<TokenErrors>)>,
}

impl Scored<'_> {
    /// Whether the rollout recorded the entropy of every response token (and `lp_old` is its record, so
    /// that the entropy is the learner forward's bit for bit).
    pub fn has_rollout_entropy(&self) -> bool {
        self.lp_old_reused
            && self
                .entropy_roll
                .iter()
                .zip(&self.lp_roll)
                .all(|(h, lp)| h.len() == lp.len())
    }

    /// The kept sequences `rows` as a batch of their own, with their routing replay (when on).
    pub fn subset(
        &self,
        rows: &[usize],
        layers: usize,
    ) -> (SeqBatch, Option<Vec<Option<Vec<u32>>>>) {
        let sub = SeqBatch::new(
            rows.iter().map(|&i| self.batch.seqs[i].clone()).collect(),
            rows.iter().map(|&i| self.batch.prompt_lens[i]).collect(),
        );
        let replay = self.replay.as_ref().map(|_| {
            let recs: Vec<&Vec<Option<Vec<u32>>>> = rows.iter().map(|&i| self.records[i]).collect();
            replay_routing(&recs, &sub.seqs, self.top_k, layers)
        });
        (sub, replay)
    }
}

/// Per-response rows of values laid out response by response, position by position (as
/// [`ResponseForward::entropy`](super::batch::ResponseForward::entropy)).
pub fn split_responses(batch: &SeqBatch, flat: &[f32]) -> Vec<Vec<f32>> {
    let mut at = 0;
    batch
        .seqs
        .iter()
        .zip(&batch.prompt_lens)
        .map(|(q, &p)| {
            let n = q.len().saturating_sub(p).min(flat.len() - at);
            at += n;
            flat[at - n..at].to_vec()
        })
        .collect()
}

/// The metrics of the learner's forward at the step's start, gathered over the pieces it ran in: the
/// token entropy over the responses and, for MoE without routing replay, how often the learner routes a
/// token differently from the rollout.
#[derive(Default)]
pub struct ForwardStats {
    entropy_sum: f64,
    entropy_tokens: usize,
    routing: Option<RoutingDisagreement>,
}

impl ForwardStats {
    /// One forward of `batch` (rows in the order of `records`, the rollout's expert choices): its entropy
    /// and routing.
    pub fn add(
        &mut self,
        fwd: &ResponseForward,
        batch: &SeqBatch,
        records: &[&Vec<Option<Vec<u32>>>],
        replayed: bool,
        top_k: usize,
    ) -> anyhow::Result<()> {
        let entropy = fwd
            .entropy
            .as_ref()
            .context("the learner forward of the step's start computes the entropy")?;
        self.add_entropy(entropy.iter().copied());
        self.add_routing(fwd, batch, records, replayed, top_k)
    }

    /// Entropies of response positions, in row order.
    pub fn add_entropy(&mut self, values: impl IntoIterator<Item = f32>) {
        for h in values {
            self.entropy_sum += f64::from(h);
            self.entropy_tokens += 1;
        }
    }

    /// The routing of one forward of `batch` against the rollout's `records` (MoE without replay).
    pub fn add_routing(
        &mut self,
        fwd: &ResponseForward,
        batch: &SeqBatch,
        records: &[&Vec<Option<Vec<u32>>>],
        replayed: bool,
        top_k: usize,
    ) -> anyhow::Result<()> {
        if top_k == 0 || replayed {
            return Ok(());
        }
        // Routing of the learner forward vs the rollout, over the tokens the rollout routed.
        let t = fwd.padded_len;
        let learner = routing_to_host(fwd.routing.clone());
        for (b, rec) in records.iter().enumerate() {
            let learner_row: Vec<Option<Vec<u32>>> = learner
                .iter()
                .map(|l| {
                    l.as_ref().map(|v| {
                        v[b * t * top_k..(b * t + batch.seqs[b].len() - 1) * top_k].to_vec()
                    })
                })
                .collect();
            let d = routing_disagreement(rec, &learner_row, top_k)?;
            self.routing = Some(match self.routing.take() {
                None => d,
                Some(a) => a + d,
            });
        }
        Ok(())
    }

    pub fn record(&self, m: &mut BTreeMap<String, f64>) {
        let entropy = if self.entropy_tokens == 0 {
            f64::NAN
        } else {
            self.entropy_sum / self.entropy_tokens as f64
        };
        m.insert("actor/entropy".into(), entropy);
        if let Some(f) = self.routing.as_ref().and_then(|a| a.fraction()) {
            m.insert("moe/routing_disagreement_frac".into(), f);
        }
    }
}
