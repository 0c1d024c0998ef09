//! Device buffers: a runtime handle with its element count and type, the currency of every kernel launch
//! (its own module so that the launch context and the MoE routing tables can both hold one).

use cubecl::prelude::*;
use cubecl::server::Handle;

use crate::dtype::ActDType;

/// Values on the device with their element count and type: activations (f32, f16, bf16) or 32-bit words
/// (u32 buffers report [`ActDType::F32`], their element size).
#[derive(Clone)]
pub struct DeviceBuffer {
    pub(crate) handle: Handle,
    pub(crate) len: usize,
    pub(crate) dtype: ActDType,
}

impl std::fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("len", &self.len)
            .field("dtype", &self.dtype)
            .finish_non_exhaustive()
    }
}

impl DeviceBuffer {
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether it holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The element type.
    pub fn dtype(&self) -> ActDType {
        self.dtype
    }
    /// Wraps `len` values already on the device (a burn tensor's buffer, say); the caller vouches that
    /// the handle holds at least `len` contiguous 32-bit values.
    pub fn from_handle(handle: Handle, len: usize) -> Self {
        Self::from_handle_typed(handle, len, ActDType::F32)
    }
    /// Wraps `len` values of type `dtype` already on the device; the caller vouches that the handle holds
    /// at least `len` contiguous values of that type.
    pub fn from_handle_typed(handle: Handle, len: usize, dtype: ActDType) -> Self {
        DeviceBuffer { handle, len, dtype }
    }
    /// The runtime handle, for callers that hand it to other kernels.
    pub fn handle(&self) -> &Handle {
        &self.handle
    }
    pub(crate) fn arg(&self) -> BufferArg {
        // SAFETY: `len` is the element count the buffer was created with.
        unsafe { BufferArg::from_raw_parts(self.handle.clone(), self.len.max(1)) }
    }
}
