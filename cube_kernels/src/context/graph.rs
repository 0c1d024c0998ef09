//! A launch sequence recorded once and replayed ([`Kernels::record`], [`Recorded::replay`]): CubeCL's
//! graph capture, a CUDA graph on CUDA (one dispatch per replay) and a software graph of the resolved
//! dispatches on wgpu.
//!
//! Why: at decode sizes a launch costs more than its arithmetic. On an H200 (2026-12-04) one int4 [768,
//! 2048] GEMV took 12 us against 0.2 us of bytes, and the MoE block's decode path, four launches (route,
//! gate-up, down, combine), took 50 us against 5 us of bytes at one token: the launch path on the host,
//! not the kernels, sets the time. A replay skips it (pipeline lookup, argument binding and metadata
//! upload happened once, while recording), which is how rollout engines run decode steps (vLLM's CUDA
//! graphs). The kernels and their arguments are the recorded ones, so a replay computes bitwise what
//! the same launches compute directly (`tests/graph.rs` checks it on lavapipe, `qarl bench kernels
//! --check` on GPUs).
//!
//! What keeps a replay's buffers valid: CubeCL 0.11.3 guards every memory page the recorded launches
//! touched (weights, inputs, intermediates, launch metadata) for the graph's life, so none of them is
//! handed to another allocation or moved, even once its handle is dropped (`cubecl-server`'s capture
//! window; the crate is pinned to that version). The price: free room on those pages stays unused
//! while a recording lives.

use cubecl::client::Graph;
use cubecl::prelude::*;

use super::{DeviceBuffer, Kernels};
use crate::error::KernelError;

/// A launch sequence recorded on the device, replayed on the buffers it was recorded with: `inputs`,
/// which [`Kernels::write`] refreshes in place between replays, and `output`, what the recorded run
/// returned, whose buffers hold each replay's result (nothing valid before the first replay: the
/// recorded run only recorded). Inputs are written and outputs read from the thread that recorded it,
/// so that they are ordered against the replays (one stream).
pub struct Recorded<T> {
    graph: Graph,
    inputs: Vec<DeviceBuffer>,
    output: T,
    /// The thread that recorded it: its stream is the one replays, input writes and output reads must
    /// share to be ordered against each other.
    thread: std::thread::ThreadId,
}

impl Kernels {
    /// Records `run` on `inputs` into a graph: `run` runs once to warm the runtime's memory pools (its
    /// result dropped: nothing may be allocated while recording), then again while recording, and that
    /// second run's result is the recording's output (its buffers, written by each replay; the recorded
    /// run itself executes nothing). `run` must launch on the kernels it is given and
    /// neither read nor upload (a recording holds launches only; a refused operation fails the
    /// recording). Errors where the runtime records no graphs.
    pub fn record<T>(
        &self,
        inputs: Vec<DeviceBuffer>,
        run: impl Fn(&Kernels, &[DeviceBuffer]) -> Result<T, KernelError>,
    ) -> Result<Recorded<T>, KernelError> {
        fn failed(what: &'static str) -> impl Fn(cubecl::server::ServerError) -> KernelError {
            move |e| KernelError::Device(format!("{what}: {e:?}"))
        }
        self.client
            .graph_prepare()
            .map_err(failed("preparing a graph capture"))?;
        let warmed = run(self, &inputs).map(drop);
        let recorded = warmed.and_then(|()| {
            self.client
                .start_capture()
                .map_err(failed("starting a graph capture"))?;
            run(self, &inputs)
        });
        // Closed whatever happened: a capture left open would record every later launch.
        let graph = self
            .client
            .stop_capture()
            .map_err(failed("recording a graph"));
        let output = recorded?;
        Ok(Recorded {
            graph: graph?,
            inputs,
            output,
            thread: std::thread::current().id(),
        })
    }

    /// Writes `values` into `buffer` in place, encoded in its element type (each rounded to it as
    /// [`Kernels::upload`] does), where a recording reads it: the next replay sees them (write from the
    /// thread that replays). The length must be the buffer's; the element type is not checked against
    /// how the buffer was made (a buffer of `u32` reports f32): ids go through [`Kernels::write_u32`].
    pub fn write(&self, buffer: &DeviceBuffer, values: &[f32]) -> Result<(), KernelError> {
        self.check_write(buffer, values.len())?;
        let mut bytes = buffer.dtype.encode(values);
        bytes.resize(bytes.len().next_multiple_of(4), 0);
        self.write_bytes(buffer, bytes);
        Ok(())
    }

    /// [`Kernels::write`] for a buffer of `u32` values ([`Kernels::upload_u32`]: expert ids, say).
    pub fn write_u32(&self, buffer: &DeviceBuffer, values: &[u32]) -> Result<(), KernelError> {
        self.check_write(buffer, values.len())?;
        self.write_bytes(buffer, u32::as_bytes(values).to_vec());
        Ok(())
    }

    fn check_write(&self, buffer: &DeviceBuffer, len: usize) -> Result<(), KernelError> {
        if len != buffer.len || len == 0 {
            return Err(KernelError::Shape(format!(
                "writing {len} values into a buffer of {}",
                buffer.len
            )));
        }
        Ok(())
    }

    fn write_bytes(&self, buffer: &DeviceBuffer, bytes: Vec<u8>) {
        let bytes = cubecl::bytes::Bytes::from_bytes_vec(bytes);
        self.client.write(&buffer.handle, bytes);
    }
}

impl<T> Recorded<T> {
    /// The buffers the recording reads: refresh them with [`Kernels::write`] before a replay.
    pub fn inputs(&self) -> &[DeviceBuffer] {
        &self.inputs
    }

    /// What the recorded run returned; after a replay its buffers hold that replay's result (before the
    /// first replay, nothing valid).
    pub fn output(&self) -> &T {
        &self.output
    }

    /// Runs the recorded launches again on the recorded buffers (enqueued: a read of the output waits
    /// for it). Refused from another thread than the one that recorded it, whose stream would not be
    /// ordered against this one's writes and reads.
    pub fn replay(&self) -> Result<(), KernelError> {
        if std::thread::current().id() != self.thread {
            return Err(KernelError::Unsupported(
                "replaying a recorded graph from another thread than the one that recorded it \
                 (its writes and reads would race the replay)"
                    .into(),
            ));
        }
        // SAFETY: liveness: the pages of every buffer the recorded launches touched are guarded by the
        // runtime for the graph's life (CubeCL 0.11.3's capture window guards them when it closes; see
        // the module docs), and the inputs and output are held here. Ordering: this replay is issued
        // from the recording thread, hence on the recording's stream; the documented use writes inputs
        // and reads outputs from the same thread. No other stream writes these buffers: the weights are
        // only read and the intermediates belong to the recording.
        unsafe { self.graph.replay() }
            .map_err(|e| KernelError::Device(format!("replaying a recorded graph: {e:?}")))
    }
}
