//! Routing bookkeeping for the grouped MoE matmul (`tokens * top_k` ids): a stable counting sort of the
//! (token, slot) assignments by expert, the inverse permutation for the combine, and the tiles of 16
//! assignments that never straddle two experts. [`MoeRouting`] computes it on the host (the reference, and
//! the path for ids the host has); [`RoutingTable`] is the same table on the device, uploaded from a
//! [`MoeRouting`] or built there from ids that never leave the device ([`crate::Kernels::route`]: the
//! router's top-k of a decode step, with no read back).

use crate::buffer::DeviceBuffer;
use crate::error::KernelError;
use crate::kernels::TILE;

/// Assignments sorted by expert, their tiles, and the way back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MoeRouting {
    tokens: usize,
    top_k: usize,
    experts: usize,
    /// For sorted assignment `a`: the token it reads.
    pub row_index: Vec<u32>,
    /// For token `t`, slot `j` (index `t * top_k + j`): its position in the sorted order.
    pub position: Vec<u32>,
    /// `offsets[e]..offsets[e + 1]` are expert `e`'s sorted assignments.
    pub offsets: Vec<u32>,
    /// Per tile: its expert, first assignment, and one past its last.
    pub tile_expert: Vec<u32>,
    /// See `tile_expert`.
    pub tile_start: Vec<u32>,
    /// See `tile_expert`.
    pub tile_end: Vec<u32>,
}

impl MoeRouting {
    /// Builds the routing from `ids[t * top_k + j]`, the expert of token `t`'s `j`-th slot. An id outside
    /// `0..experts` or a length that is not `tokens * top_k` is an error.
    pub fn new(
        ids: &[u32],
        tokens: usize,
        top_k: usize,
        experts: usize,
    ) -> Result<Self, KernelError> {
        if ids.len() != tokens * top_k {
            return Err(KernelError::Shape(format!(
                "{} expert ids for {tokens} tokens x top-{top_k}",
                ids.len()
            )));
        }
        if let Some(i) = ids.iter().position(|&e| e as usize >= experts) {
            return Err(KernelError::Shape(format!(
                "expert id {} at token {} slot {} is out of range (0..{experts})",
                ids[i],
                i / top_k.max(1),
                i % top_k.max(1)
            )));
        }
        let mut offsets = vec![0u32; experts + 1];
        for &e in ids {
            offsets[e as usize + 1] += 1;
        }
        for e in 0..experts {
            offsets[e + 1] += offsets[e];
        }
        let mut next = offsets.clone();
        let mut row_index = vec![0u32; ids.len()];
        let mut position = vec![0u32; ids.len()];
        for (i, &e) in ids.iter().enumerate() {
            let a = next[e as usize];
            next[e as usize] += 1;
            row_index[a as usize] = (i / top_k) as u32;
            position[i] = a;
        }
        let (mut tile_expert, mut tile_start, mut tile_end) = (vec![], vec![], vec![]);
        for e in 0..experts {
            let mut start = offsets[e];
            while start < offsets[e + 1] {
                let end = (start + TILE as u32).min(offsets[e + 1]);
                tile_expert.push(e as u32);
                tile_start.push(start);
                tile_end.push(end);
                start = end;
            }
        }
        Ok(MoeRouting {
            tokens,
            top_k,
            experts,
            row_index,
            position,
            offsets,
            tile_expert,
            tile_start,
            tile_end,
        })
    }

    /// Tokens routed.
    pub fn tokens(&self) -> usize {
        self.tokens
    }
    /// Experts per token.
    pub fn top_k(&self) -> usize {
        self.top_k
    }
    /// Number of experts.
    pub fn experts(&self) -> usize {
        self.experts
    }
    /// Number of assignments (`tokens * top_k`).
    pub fn assignments(&self) -> usize {
        self.row_index.len()
    }
    /// Number of 16-assignment tiles.
    pub fn tiles(&self) -> usize {
        self.tile_expert.len()
    }

    /// Everything the kernels read, as one `u32` table (one upload per call): `(tile_expert, tile_start,
    /// tile_end)` interleaved per tile from 0, then `row_index`, `position`, the expert of every sorted
    /// assignment and `offsets` (`experts + 1`), where [`Self::layout`] says. [`RoutingTable`] has the
    /// same layout.
    pub fn table(&self) -> Vec<u32> {
        let mut t = Vec::with_capacity(3 * self.tiles() + 3 * self.assignments());
        for i in 0..self.tiles() {
            t.extend([self.tile_expert[i], self.tile_start[i], self.tile_end[i]]);
        }
        t.extend_from_slice(&self.row_index);
        t.extend_from_slice(&self.position);
        for e in 0..self.experts {
            let run = (self.offsets[e + 1] - self.offsets[e]) as usize;
            t.extend(std::iter::repeat_n(e as u32, run));
        }
        t.extend_from_slice(&self.offsets);
        t
    }

    /// Where the sections of [`Self::table`] start.
    pub fn layout(&self) -> TableLayout {
        TableLayout {
            tiles: self.tiles(),
            assignments: self.assignments(),
        }
    }
}

/// Where the sections of a routing table ([`MoeRouting::table`], [`RoutingTable`]) start: `3 * tiles`
/// tile entries, then `assignments` each of rows, positions and sorted experts, then the offsets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TableLayout {
    /// Tile entries in the table (a device-built table reserves a bound: [`RoutingTable::tile_bound`]).
    pub tiles: usize,
    pub assignments: usize,
}

impl TableLayout {
    /// Where `row_index` starts.
    pub fn rows_at(&self) -> usize {
        3 * self.tiles
    }

    /// Where `position` starts.
    pub fn positions_at(&self) -> usize {
        self.rows_at() + self.assignments
    }

    /// Where the experts of the sorted assignments start.
    pub fn experts_at(&self) -> usize {
        self.positions_at() + self.assignments
    }

    /// Where `offsets` starts.
    pub fn offsets_at(&self) -> usize {
        self.experts_at() + self.assignments
    }

    /// `u32` values of a table with `experts` experts.
    pub fn len(&self, experts: usize) -> usize {
        self.offsets_at() + experts + 1
    }
}

/// A routing table on the device, in [`MoeRouting::table`]'s layout, with the routing's sizes: what the
/// grouped kernel reads ([`crate::Kernels::moe_routed`]). Built on the device ([`crate::Kernels::route`]) it
/// reserves [`RoutingTable::tile_bound`] tiles, the real ones first and empty ones after, so that its
/// layout and the launch grid follow from the sizes alone, never from the ids.
#[derive(Debug, Clone)]
pub struct RoutingTable {
    pub(crate) table: DeviceBuffer,
    pub(crate) tokens: usize,
    pub(crate) top_k: usize,
    pub(crate) experts: usize,
    pub(crate) layout: TableLayout,
}

impl RoutingTable {
    /// The most tiles `assignments` can need over `experts` experts: every full 16 plus at most one partial
    /// tile per expert that has assignments.
    pub fn tile_bound(assignments: usize, experts: usize) -> usize {
        assignments / TILE + experts.min(assignments)
    }

    /// Tokens routed.
    pub fn tokens(&self) -> usize {
        self.tokens
    }
    /// Experts per token.
    pub fn top_k(&self) -> usize {
        self.top_k
    }
    /// Number of experts.
    pub fn experts(&self) -> usize {
        self.experts
    }
    /// Where the sections of the table start.
    pub fn layout(&self) -> TableLayout {
        self.layout
    }
    /// The table's buffer (`u32` values).
    pub fn buffer(&self) -> &DeviceBuffer {
        &self.table
    }
}
