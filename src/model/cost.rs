//! The arithmetic a forward does, counted from the config: what benchmarks divide by a phase's time to
//! report GFLOP/s next to the machine's FMA peak. Counts the matmuls (2 flops per multiply-add) as the
//! kernels run them: every linear projection on every token that goes through the model (MoE: the router
//! and the `top_k` experts each token is routed to), the attention products over the padded keys the
//! forward computes, and the LM head at the rows it is applied to. Norms, rotary embeddings, softmax and
//! activations (a few percent) are left out.

use super::config::ModelConfig;

/// Multiply-add counts of one forward, in flops (2 per multiply-add).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ForwardFlops {
    /// The linear projections of every layer (attention q/k/v/o, MLP or routed experts, router).
    pub projections: f64,
    /// `q k^T` and `p v` of every head over the keys each query is scored against.
    pub attention: f64,
    /// The LM head at the rows it is applied to.
    pub head: f64,
}

impl ForwardFlops {
    pub fn total(&self) -> f64 {
        self.projections + self.attention + self.head
    }
}

impl ModelConfig {
    /// Flops of the projections of one token through every layer.
    pub fn projection_flops_per_token(&self) -> f64 {
        let h = self.hidden_size as f64;
        let q = (self.num_attention_heads * self.head_dim) as f64;
        let kv = (self.num_key_value_heads * self.head_dim) as f64;
        let attn = h * (q + 2.0 * kv) + q * h;
        (0..self.num_hidden_layers)
            .map(|l| {
                let mlp = match &self.moe {
                    Some(m) if self.is_sparse_layer(l) => {
                        h * m.num_experts as f64
                            + m.num_experts_per_tok as f64
                                * 3.0
                                * h
                                * m.moe_intermediate_size as f64
                    }
                    _ => 3.0 * h * self.intermediate_size as f64,
                };
                2.0 * (attn + mlp)
            })
            .sum()
    }

    /// Flops of a forward over `rows` sequences padded to `len` tokens whose queries are each scored
    /// against `keys` keys (the padded length for a full-sequence forward, the cache length at decode),
    /// with the LM head applied to `head_rows` rows.
    pub fn forward_flops(
        &self,
        rows: usize,
        len: usize,
        keys: usize,
        head_rows: usize,
    ) -> ForwardFlops {
        let tokens = (rows * len) as f64;
        let per_query = 2.0 * 2.0 * (self.num_attention_heads * self.head_dim) as f64 * keys as f64;
        ForwardFlops {
            projections: tokens * self.projection_flops_per_token(),
            attention: tokens * per_query * self.num_hidden_layers as f64,
            head: 2.0 * (self.hidden_size * self.vocab_size) as f64 * head_rows as f64,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::config::{Architecture, MoeConfig};

    fn dense() -> ModelConfig {
        ModelConfig {
            architecture: Architecture::Llama,
            vocab_size: 100,
            hidden_size: 8,
            intermediate_size: 16,
            num_hidden_layers: 2,
            num_attention_heads: 2,
            num_key_value_heads: 1,
            head_dim: 4,
            rms_norm_eps: 1e-6,
            rope_theta: 1e4,
            max_position_embeddings: 64,
            tie_word_embeddings: true,
            qkv_bias: false,
            o_bias: false,
            mlp_bias: false,
            qk_norm: false,
            moe: None,
            bos_token_id: None,
            eos_token_ids: vec![],
            pad_token_id: None,
            quantization: None,
        }
    }

    #[test]
    fn dense_projections_count_every_weight_twice() {
        let c = dense();
        // Per layer: q [8x8] + k, v [8x4] each + o [8x8] + gate, up [8x16] + down [16x8] = 64+32+32+64+384.
        let weights_per_layer = 64.0 + 32.0 + 32.0 + 64.0 + 3.0 * 128.0;
        assert_eq!(
            c.projection_flops_per_token(),
            2.0 * 2.0 * weights_per_layer
        );
        let f = c.forward_flops(3, 5, 5, 4);
        assert_eq!(f.projections, 15.0 * 2.0 * 2.0 * weights_per_layer);
        // q k^T and p v: 2 products x (2 heads x 4 dims) x 5 keys, 2 flops each, per token and layer.
        assert_eq!(f.attention, 15.0 * 2.0 * 2.0 * 8.0 * 5.0 * 2.0);
        assert_eq!(f.head, 2.0 * 8.0 * 100.0 * 4.0);
        assert_eq!(f.total(), f.projections + f.attention + f.head);
    }

    #[test]
    fn moe_layers_count_the_router_and_the_routed_experts_only() {
        let mut c = dense();
        c.moe = Some(MoeConfig {
            num_experts: 10,
            num_experts_per_tok: 2,
            moe_intermediate_size: 6,
            norm_topk_prob: true,
            decoder_sparse_step: 1,
            mlp_only_layers: vec![1],
        });
        let attn = 64.0 + 32.0 + 32.0 + 64.0;
        let sparse = attn + 8.0 * 10.0 + 2.0 * 3.0 * 8.0 * 6.0;
        let dense_layer = attn + 3.0 * 128.0;
        assert_eq!(c.projection_flops_per_token(), 2.0 * (sparse + dense_layer));
    }
}
