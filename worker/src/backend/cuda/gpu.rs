//! What the backend needs from a GPU: memory, copies, kernel launches on one in-order stream.
//! `device.rs` gives it on a CUDA device; the test suite gives it on the CPU (an emulator that
//! runs `kernels.cu` compiled as C++), so that the forward pass and its kernels are checked
//! bit for bit against the CPU backend on machines without a GPU.

use bytemuck::Pod;
use std::sync::Arc;

/// A kernel argument, as `kernels.cu` declares it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Arg {
    /// A device address.
    Ptr(u64),
    I32(i32),
    I64(i64),
    F32(f32),
}

pub trait Gpu: Send + Sync {
    /// Its name, for the log.
    fn describe(&self) -> String;
    /// Free and total memory, in bytes.
    fn memory(&self) -> Result<(usize, usize), String>;
    /// `bytes` of zeroed memory; its address.
    fn alloc(&self, bytes: usize) -> Result<u64, String>;
    fn free(&self, ptr: u64);
    /// Copies `data` to `ptr` (in stream order).
    fn upload(&self, ptr: u64, data: &[u8]) -> Result<(), String>;
    /// Copies from `ptr` into `out`, after everything enqueued before.
    fn download(&self, ptr: u64, out: &mut [u8]) -> Result<(), String>;
    /// Enqueues kernel `name` on `grid` blocks of `block` threads.
    fn launch(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        args: &[Arg],
    ) -> Result<(), String>;
    /// Waits for everything enqueued.
    fn synchronize(&self) -> Result<(), String>;

    /// Starts recording launches instead of running them, for a graph that replays them
    /// (with the same arguments) in one launch.
    fn begin_capture(&self) -> Result<(), String> {
        Err("this GPU does not record graphs".into())
    }

    /// Ends the recording; the graph's handle.
    fn end_capture(&self) -> Result<u64, String> {
        Err("this GPU does not record graphs".into())
    }

    /// Enqueues a recorded graph.
    fn replay(&self, _graph: u64) -> Result<(), String> {
        Err("this GPU does not record graphs".into())
    }

    fn drop_graph(&self, _graph: u64) {}
}

/// Device memory, freed when dropped.
pub struct Buffer {
    ptr: u64,
    bytes: usize,
    gpu: Arc<dyn Gpu>,
}

impl Buffer {
    pub fn zeros(gpu: &Arc<dyn Gpu>, bytes: usize) -> Result<Buffer, String> {
        let ptr = gpu.alloc(bytes.max(1))?;
        Ok(Buffer {
            ptr,
            bytes,
            gpu: Arc::clone(gpu),
        })
    }

    /// A buffer holding `data`.
    pub fn from<T: Pod>(gpu: &Arc<dyn Gpu>, data: &[T]) -> Result<Buffer, String> {
        let buffer = Buffer::zeros(gpu, std::mem::size_of_val(data))?;
        buffer.write(0, data)?;
        Ok(buffer)
    }

    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// The address `offset` values of `T` in.
    pub fn at<T>(&self, offset: usize) -> u64 {
        self.ptr + (offset * std::mem::size_of::<T>()) as u64
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Writes `data` from value `offset` on.
    pub fn write<T: Pod>(&self, offset: usize, data: &[T]) -> Result<(), String> {
        let start = offset * std::mem::size_of::<T>();
        self.check(start, std::mem::size_of_val(data))?;
        self.gpu
            .upload(self.ptr + start as u64, bytemuck::cast_slice(data))
    }

    /// `len` values of `T` from value `offset` on (waits for the stream).
    pub fn read<T: Pod>(&self, offset: usize, len: usize) -> Result<Vec<T>, String> {
        let start = offset * std::mem::size_of::<T>();
        self.check(start, len * std::mem::size_of::<T>())?;
        let mut out = vec![T::zeroed(); len];
        self.gpu
            .download(self.ptr + start as u64, bytemuck::cast_slice_mut(&mut out))?;
        Ok(out)
    }

    fn check(&self, start: usize, len: usize) -> Result<(), String> {
        if start + len > self.bytes {
            return Err(format!(
                "bytes {start}..{} of a {}-byte buffer",
                start + len,
                self.bytes
            ));
        }
        Ok(())
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        self.gpu.free(self.ptr);
    }
}
