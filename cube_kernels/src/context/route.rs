//! The launcher of routing on the device ([`crate::kernels::route`]): the routing table of the
//! router's expert ids, built where the ids are, in one cube for a decode step's few ids or in three
//! launches over blocks of ids for a prefill's or a training batch's many.

use cubecl::prelude::*;

use super::{expect_len, DeviceBuffer, Kernels};
use crate::error::KernelError;
use crate::kernels::route::{self as route_kernels, ROUTE_BLOCKS, ROUTE_BLOCK_ROUNDS, ROUTE_UNITS};
use crate::moe::{RoutingTable, TableLayout};

impl Kernels {
    /// These kernels with the routing always in three launches over blocks of ids (`Some(true)`),
    /// always in one cube (`Some(false)`), or by [`Self::routes_in_blocks`] (`None`): the same table
    /// every way; for tests, and for timing the choice. (On lavapipe, whose llvmpipe ends a shader
    /// invocation's loops after 65535 iterations in all, the one cube routes at most some 16k ids
    /// whole; the rule gives it 512.)
    pub fn with_block_routing(mut self, blocks: Option<bool>) -> Self {
        self.block_routing = blocks;
        self
    }

    /// Most assignments the one-cube routing takes unless [`Self::with_block_routing`] says: two
    /// rounds of ids (a decode step of 64 tokens routed 8 ways). Its one cube reads every id on one
    /// multiprocessor, where one launch is what a decode step's few ids cost most; beyond, the blocks
    /// spread the ids over the device for the price of two more launches.
    pub const ONE_CUBE_ROUTING_MAX: usize = 2 * ROUTE_UNITS;

    /// Whether [`Self::route`] runs the three launches over blocks for `assignments` ids.
    pub fn routes_in_blocks(&self, assignments: usize) -> bool {
        self.block_routing
            .unwrap_or(assignments > Self::ONE_CUBE_ROUTING_MAX)
    }

    /// The routing table of `ids` (`tokens * top_k` expert ids as `u32`, or `i32` holding non-negative
    /// values: the same bits, token-major) built on the device, with no read back and no upload
    /// ([`crate::kernels::route`]: one cube, or three launches over blocks of ids by
    /// [`Self::routes_in_blocks`]): the same sorted order, positions and tiles as
    /// [`crate::MoeRouting::new`] on the same ids, then empty tiles up to [`RoutingTable::tile_bound`].
    /// An id outside `0..experts` is not checked here (the router's top-k never makes one): it is
    /// routed to no expert and its slot's output is undefined (every read stays in bounds). No experts,
    /// or more than [`Self::MAX_ROUTED_EXPERTS`], is an error.
    pub fn route(
        &self,
        ids: &DeviceBuffer,
        tokens: usize,
        top_k: usize,
        experts: usize,
    ) -> Result<RoutingTable, KernelError> {
        let assignments = tokens * top_k;
        expect_len("expert ids", ids, assignments)?;
        if experts == 0 || experts > Self::MAX_ROUTED_EXPERTS {
            return Err(KernelError::Shape(format!(
                "{experts} experts: device routing takes 1 to {} (two words per expert in shared memory)",
                Self::MAX_ROUTED_EXPERTS
            )));
        }
        let layout = TableLayout {
            tiles: RoutingTable::tile_bound(assignments, experts),
            assignments,
        };
        let table = self.empty_u32(layout.len(experts));
        if self.routes_in_blocks(assignments) {
            self.route_in_blocks(ids, &table, layout, top_k.max(1), experts);
        } else {
            route_kernels::route::launch(
                &self.client,
                CubeCount::Static(1, 1, 1),
                CubeDim::new_1d(ROUTE_UNITS as u32),
                ids.arg(),
                table.arg(),
                assignments,
                top_k.max(1),
                layout.tiles,
                layout.rows_at(),
                layout.positions_at(),
                layout.experts_at(),
                layout.offsets_at(),
                experts,
            );
        }
        Ok(RoutingTable {
            table,
            tokens,
            top_k,
            experts,
            layout,
        })
    }

    /// The three launches of [`Self::route`] over blocks of whole rounds of ids: at most
    /// [`ROUTE_BLOCKS`] blocks (so the offsets cube's walk over them stays short), each of as few
    /// rounds as that allows.
    fn route_in_blocks(
        &self,
        ids: &DeviceBuffer,
        table: &DeviceBuffer,
        layout: TableLayout,
        top_k: usize,
        experts: usize,
    ) {
        let assignments = layout.assignments;
        let (blocks, block_len) = route_blocks(assignments);
        // Per block and expert: the count, then the block's first place of the expert.
        let counts = self.empty_u32(blocks * experts);
        let (grid, cube) = (
            CubeCount::Static(blocks as u32, 1, 1),
            CubeDim::new_1d(ROUTE_UNITS as u32),
        );
        route_kernels::route_count_blocks::launch(
            &self.client,
            grid.clone(),
            cube,
            ids.arg(),
            counts.arg(),
            assignments,
            block_len,
            experts,
        );
        route_kernels::route_offsets::launch(
            &self.client,
            CubeCount::Static(1, 1, 1),
            cube,
            counts.arg(),
            table.arg(),
            blocks,
            assignments,
            layout.tiles,
            layout.rows_at(),
            layout.experts_at(),
            layout.offsets_at(),
            experts,
        );
        route_kernels::route_scatter_blocks::launch(
            &self.client,
            grid,
            cube,
            ids.arg(),
            counts.arg(),
            table.arg(),
            assignments,
            block_len,
            top_k,
            layout.rows_at(),
            layout.positions_at(),
            layout.experts_at(),
            experts,
        );
    }
}

/// The blocks of the three-launch routing for `assignments` ids: `(blocks, ids per block)`, blocks of
/// whole rounds of [`ROUTE_UNITS`] ids (the last one possibly shorter, at least one block), at most
/// [`ROUTE_BLOCKS`] of them until a block would take more than [`ROUTE_BLOCK_ROUNDS`] rounds.
pub(crate) fn route_blocks(assignments: usize) -> (usize, usize) {
    let rounds = assignments.div_ceil(ROUTE_UNITS).max(1);
    let block_rounds = rounds.div_ceil(ROUTE_BLOCKS).min(ROUTE_BLOCK_ROUNDS);
    let block_len = block_rounds * ROUTE_UNITS;
    (assignments.div_ceil(block_len).max(1), block_len)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Blocks cover the ids, in whole rounds, none empty but for no ids: at most the aimed-for count
    /// while a block's rounds stay within their bound, more blocks of the most rounds beyond.
    #[test]
    fn route_blocks_cover_the_ids_in_whole_rounds() {
        let most = ROUTE_BLOCKS * ROUTE_BLOCK_ROUNDS * ROUTE_UNITS;
        for a in [
            0,
            1,
            255,
            256,
            257,
            512,
            16_385,
            300_001,
            most,
            most + 1,
            9_000_000,
        ] {
            let (blocks, len) = route_blocks(a);
            assert!(blocks >= 1, "{a}: no block");
            assert!(a > most || blocks <= ROUTE_BLOCKS, "{a}: {blocks} blocks");
            assert!(
                len <= ROUTE_BLOCK_ROUNDS * ROUTE_UNITS,
                "{a}: block of {len}"
            );
            assert_eq!(len % ROUTE_UNITS, 0, "{a}: block of {len}");
            assert!(blocks * len >= a, "{a}: {blocks} x {len} ids");
            assert!(a == 0 || (blocks - 1) * len < a, "{a}: an empty block");
        }
        assert_eq!(route_blocks(300_001), (118, 2_560));
        assert_eq!(route_blocks(9_000_000), (550, 16_384));
    }

    /// The most experts leave the one cube's shared memory full; one more would not fit.
    #[test]
    fn the_most_routed_experts_fill_the_shared_memory() {
        use crate::kernels::route::route_shared_words;
        let most = Kernels::MAX_ROUTED_EXPERTS;
        assert!(route_shared_words(most) <= super::super::SHARED_FLOATS);
        assert!(route_shared_words(most + 1) > super::super::SHARED_FLOATS);
    }
}
