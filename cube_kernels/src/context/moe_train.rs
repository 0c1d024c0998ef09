//! Launchers of the grouped MoE block's training kernels ([`crate::kernels::moe_train`]): a forward that
//! keeps what the backward needs ([`Kernels::moe_routed_for_training`], the rollout's bits) and the backward
//! ([`Kernels::moe_backward`]), so a training step computes the experts once, on the routing table built on
//! the device (nothing is read back).

use cubecl::prelude::*;

use super::{expect_len, f32_only, grid, DeviceBuffer, DeviceWeights, Kernels, MatmulPath};
use crate::error::KernelError;
use crate::kernels::moe_train;
use crate::kernels::{CHUNK, TILE};
use crate::moe::RoutingTable;

/// What the MoE block's backward reads from its forward, f32 in the sorted assignment order of the routing
/// table: the gate and up products, the SwiGLU output, the per-assignment down projections.
#[derive(Debug, Clone)]
pub struct MoeActivations {
    /// `g [assignments, inter]`.
    pub gate: DeviceBuffer,
    /// `u [assignments, inter]`.
    pub up: DeviceBuffer,
    /// `h = silu(g) * u`, `[assignments, inter]`.
    pub swiglu: DeviceBuffer,
    /// `y [assignments, hidden]` (before the routing weights).
    pub expert_out: DeviceBuffer,
}

/// The MoE block's gradients (f32). The weight gradients are the straight-through ones of the f32 masters,
/// stacked per expert in the master layout `[in, out]`: gate and up `[experts, hidden, inter]`, down
/// `[experts, inter, hidden]`.
#[derive(Debug, Clone)]
pub struct MoeGradients {
    /// `[tokens, hidden]`.
    pub dx: DeviceBuffer,
    /// `[tokens, top_k]`.
    pub d_route_w: DeviceBuffer,
    pub d_gate: DeviceBuffer,
    pub d_up: DeviceBuffer,
    pub d_down: DeviceBuffer,
}

/// What [`f32_only`] calls these launchers.
const KERNELS: &str = "MoE training kernels";

impl Kernels {
    /// [`Self::moe_routed`]'s output, bit for bit (gate and up as two grouped launches of the same canonical
    /// products, then SwiGLU with the contract's arithmetic, then the same down projection and combine),
    /// with the activations the backward needs. f32 activations only.
    pub fn moe_routed_for_training(
        &self,
        x: &DeviceBuffer,
        routing: &RoutingTable,
        route_w: &DeviceBuffer,
        [gate, up, down]: [&DeviceWeights; 3],
        path: MatmulPath,
    ) -> Result<(DeviceBuffer, MoeActivations), KernelError> {
        self.check_moe(x, routing, route_w, [gate, up, down])?;
        f32_only("moe input", x, KERNELS)?;
        let (tokens, hidden, inter) = (routing.tokens(), gate.inn, gate.out);
        let assignments = routing.layout().assignments;
        let kernel = self.moe_kernel(path, tokens, gate.format, x.dtype)?;
        let out = self.empty_f32(tokens * hidden);
        let [gate_out, up_out, swiglu] = [(); 3].map(|_| self.empty_f32(assignments * inter));
        let expert_out = if routing.layout().tiles == 0 || hidden == 0 {
            self.empty_f32(assignments * hidden)
        } else {
            let xq = self.prepare(x, tokens, gate)?;
            if inter > 0 {
                self.grouped_product(&xq, routing, [gate, gate], &gate_out, false, true, kernel);
                self.grouped_product(&xq, routing, [up, up], &up_out, false, true, kernel);
                let len = assignments * inter;
                moe_train::swiglu_rows::launch(
                    &self.client,
                    grid(len.div_ceil(256)),
                    CubeDim::new_1d(256),
                    gate_out.arg(),
                    up_out.arg(),
                    swiglu.arg(),
                    len,
                );
            }
            self.down_and_combine(&swiglu, routing, route_w, down, &out, kernel)?
        };
        let acts = MoeActivations {
            gate: gate_out,
            up: up_out,
            swiglu,
            expert_out,
        };
        Ok((out, acts))
    }

    /// The backward of [`Self::moe_routed_for_training`] for the output gradient `d_out [tokens, hidden]`:
    /// the input and routing-weight gradients, and the straight-through gradients of the experts' f32
    /// masters (`dW = input^T g`, the quantizer as the identity; the input gradients through the same packed
    /// weights, `g · dequant(W)`). Nine launches, all on the device: through the combine, the down
    /// projection (input and weight), SwiGLU, gate and up (input, fused, and weights), back to the tokens.
    /// With fp8-b128 weights the weight gradients read the unquantized inputs, as the per-linear
    /// straight-through backward does.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_backward(
        &self,
        x: &DeviceBuffer,
        routing: &RoutingTable,
        route_w: &DeviceBuffer,
        acts: &MoeActivations,
        d_out: &DeviceBuffer,
        [gate, up, down]: [&DeviceWeights; 3],
    ) -> Result<MoeGradients, KernelError> {
        self.check_moe(x, routing, route_w, [gate, up, down])?;
        f32_only("moe input", x, KERNELS)?;
        f32_only("moe output gradient", d_out, KERNELS)?;
        let (tokens, top_k, experts) = (routing.tokens(), routing.top_k(), routing.experts());
        let (hidden, inter) = (gate.inn, gate.out);
        let layout = routing.layout();
        let assignments = layout.assignments;
        expect_len("moe output gradient", d_out, tokens * hidden)?;
        expect_len("gate activations", &acts.gate, assignments * inter)?;
        expect_len("up activations", &acts.up, assignments * inter)?;
        expect_len("swiglu activations", &acts.swiglu, assignments * inter)?;
        expect_len("expert outputs", &acts.expert_out, assignments * hidden)?;
        let table = &routing.table;
        let sizes = [
            tokens * hidden,
            tokens * top_k,
            experts * hidden * inter,
            experts * hidden * inter,
            experts * inter * hidden,
        ];
        if assignments == 0 || hidden == 0 || inter == 0 {
            // Nothing flows (with `inter = 0` every expert output is 0): zeros.
            let [dx, d_route_w, d_gate, d_up, d_down] =
                sizes.map(|len| self.upload_f32(&vec![0.0; len]));
            return Ok(MoeGradients {
                dx,
                d_route_w,
                d_gate,
                d_up,
                d_down,
            });
        }
        // Each launch below writes every value of its output.
        let [dx, d_route_w, d_gate, d_up, d_down] = sizes.map(|len| self.empty_f32(len));
        let grads = MoeGradients {
            dx,
            d_route_w,
            d_gate,
            d_up,
            d_down,
        };
        // Through the combine.
        let dy = self.empty_f32(assignments * hidden);
        let all = assignments * hidden;
        moe_train::combine_backward::launch(
            &self.client,
            grid(all.div_ceil(256)),
            CubeDim::new_1d(256),
            d_out.arg(),
            table.arg(),
            layout.positions_at(),
            route_w.arg(),
            dy.arg(),
            tokens,
            hidden,
            top_k,
        );
        moe_train::route_weight_grad::launch(
            &self.client,
            grid(assignments.div_ceil(256)),
            CubeDim::new_1d(256),
            d_out.arg(),
            acts.expert_out.arg(),
            table.arg(),
            layout.positions_at(),
            grads.d_route_w.arg(),
            tokens,
            hidden,
            top_k,
        );
        // The down projection: dh = dy · W_down, dW_down = h^T dy.
        let dh = self.empty_f32(assignments * inter);
        self.grouped_transposed(&dy, None, routing, [down, down], &dh);
        self.grouped_weight_grad(
            &acts.swiglu,
            false,
            &dy,
            routing,
            &grads.d_down,
            [inter, hidden],
        );
        // SwiGLU.
        let (dg, du) = (
            self.empty_f32(assignments * inter),
            self.empty_f32(assignments * inter),
        );
        let len = assignments * inter;
        moe_train::swiglu_backward_rows::launch(
            &self.client,
            grid(len.div_ceil(256)),
            CubeDim::new_1d(256),
            acts.gate.arg(),
            acts.up.arg(),
            dh.arg(),
            dg.arg(),
            du.arg(),
            len,
        );
        // Gate and up: their weight gradients from the token rows, their input gradients summed per
        // assignment and then per token.
        self.grouped_weight_grad(x, true, &dg, routing, &grads.d_gate, [hidden, inter]);
        self.grouped_weight_grad(x, true, &du, routing, &grads.d_up, [hidden, inter]);
        let dx_sorted = self.empty_f32(assignments * hidden);
        self.grouped_transposed(&dg, Some(&du), routing, [gate, up], &dx_sorted);
        moe_train::sum_assignments::launch(
            &self.client,
            grid((tokens * hidden).div_ceil(256)),
            CubeDim::new_1d(256),
            dx_sorted.arg(),
            table.arg(),
            layout.positions_at(),
            grads.dx.arg(),
            tokens,
            hidden,
            top_k,
        );
        Ok(grads)
    }

    /// `dx[a] = g1[a] · dequant(w1_e)` (`+ g2[a] · dequant(w2_e)` with `g2`) for every sorted assignment,
    /// one cube per 16 inputs and tile ([`moe_train::grouped_transposed`]).
    fn grouped_transposed(
        &self,
        g1: &DeviceBuffer,
        g2: Option<&DeviceBuffer>,
        routing: &RoutingTable,
        [w1, w2]: [&DeviceWeights; 2],
        dx: &DeviceBuffer,
    ) {
        let layout = routing.layout();
        moe_train::grouped_transposed::launch(
            &self.client,
            CubeCount::Static(w1.inn.div_ceil(TILE) as u32, layout.tiles as u32, 1),
            CubeDim::new_2d(TILE as u32, TILE as u32),
            g1.arg(),
            w1.words.arg(),
            w1.scales.arg(),
            g2.unwrap_or(g1).arg(),
            w2.words.arg(),
            w2.scales.arg(),
            self.lut.arg(),
            routing.table.arg(),
            dx.arg(),
            w1.out,
            w1.inn,
            w1.wpr(),
            w1.spr(),
            w1.expert_words(),
            w1.expert_scales(),
            w1.format.kernel_code(),
            w1.format.kernel_group(),
            w1.out.div_ceil(CHUNK),
            g2.is_some(),
        );
    }

    /// `dw[e] = input_e^T g_e` (`[inn, out]` per expert) over each expert's sorted assignments, the input
    /// rows gathered by token when `gather` ([`moe_train::grouped_weight_grad`]).
    fn grouped_weight_grad(
        &self,
        input: &DeviceBuffer,
        gather: bool,
        g: &DeviceBuffer,
        routing: &RoutingTable,
        dw: &DeviceBuffer,
        [inn, out]: [usize; 2],
    ) {
        let layout = routing.layout();
        moe_train::grouped_weight_grad::launch(
            &self.client,
            CubeCount::Static(
                out.div_ceil(TILE) as u32,
                inn.div_ceil(TILE) as u32,
                routing.experts() as u32,
            ),
            CubeDim::new_2d(TILE as u32, TILE as u32),
            input.arg(),
            g.arg(),
            routing.table.arg(),
            layout.rows_at(),
            layout.offsets_at(),
            dw.arg(),
            inn,
            out,
            gather,
        );
    }
}
