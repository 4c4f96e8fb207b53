//! [`Gpu`] on a CUDA device through `cudarc`'s driver API, with the kernels compiled by NVRTC
//! for the device's architecture. Opened with a one-line error for whatever is missing
//! (cudarc panics when it calls into a library it cannot load, so each is checked first).

use super::gpu::{Arg, Gpu};
use super::kernels;
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{
    result, CudaContext, CudaFunction, CudaGraph, CudaModule, CudaStream, LaunchConfig,
    PushKernelArg,
};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

pub struct CudaGpu {
    ctx: Arc<CudaContext>,
    /// Not the legacy default stream, which cannot be recorded into a graph.
    stream: Arc<CudaStream>,
    name: String,
    functions: HashMap<&'static str, CudaFunction>,
    _module: Arc<CudaModule>,
    graphs: Mutex<HashMap<u64, Graph>>,
    next_graph: AtomicU64,
}

struct Graph(CudaGraph);

// SAFETY: a graph's handles are plain driver handles, valid from any thread with the context
// bound (every use binds it), and the map's mutex keeps uses one at a time.
#[allow(unsafe_code)]
unsafe impl Send for Graph {}

#[allow(unsafe_code)]
fn library_present(check: unsafe fn() -> bool) -> bool {
    // SAFETY: the checks only try to open a library by its names.
    unsafe { check() }
}

fn driver_error(what: &str) -> impl Fn(result::DriverError) -> String + '_ {
    move |e| format!("{what}: {e:?}")
}

impl CudaGpu {
    /// Device `gpu`, with the kernels built for heads of `head_dim`.
    pub fn open(gpu: usize, head_dim: usize) -> Result<CudaGpu, String> {
        if !library_present(cudarc::driver::sys::is_culib_present) {
            return Err("no NVIDIA driver here: libcuda.so.1 cannot be loaded (the cuda backend needs an NVIDIA GPU and its driver)".into());
        }
        if !kernels::nvrtc_present() {
            return Err("CUDA's NVRTC library (libnvrtc.so.13) cannot be loaded: install CUDA 13 or the nvidia-cuda-nvrtc wheel and put its lib directory on LD_LIBRARY_PATH".into());
        }
        let count = CudaContext::device_count().map_err(driver_error("CUDA driver"))?;
        if gpu >= count.max(0) as usize {
            return Err(format!(
                "no CUDA device {gpu}: this machine has {count} (--gpu counts from 0)"
            ));
        }
        let ctx = CudaContext::new(gpu).map_err(driver_error("CUDA device"))?;
        // SAFETY: everything runs on one stream in order, so cudarc's events between streams
        // are not needed.
        #[allow(unsafe_code)]
        unsafe {
            ctx.disable_event_tracking();
        }
        let stream = ctx.new_stream().map_err(driver_error("CUDA stream"))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(driver_error("CUDA device"))?;
        let module = ctx
            .load_module(kernels::compile(major, minor, head_dim)?)
            .map_err(driver_error("loading the kernels"))?;
        let mut functions = HashMap::new();
        for name in super::NAMES {
            let f = module
                .load_function(name)
                .map_err(|e| format!("kernel {name}: {e:?}"))?;
            functions.insert(name, f);
        }
        let name = format!(
            "{} (sm_{major}{minor})",
            ctx.name().unwrap_or_else(|_| "CUDA device".into())
        );
        Ok(CudaGpu {
            ctx,
            stream,
            name,
            functions,
            _module: module,
            graphs: Mutex::new(HashMap::new()),
            next_graph: AtomicU64::new(1),
        })
    }
}

// SAFETY (for every unsafe block below): addresses come from `alloc` and are used within the
// sizes `Buffer` checks; copies are ordered on the one stream (an upload from pageable memory
// is staged before the call returns, so `data` may go at once), and a download waits for the
// stream before the host reads its bytes.
#[allow(unsafe_code)]
impl Gpu for CudaGpu {
    fn describe(&self) -> String {
        self.name.clone()
    }

    fn memory(&self) -> Result<(usize, usize), String> {
        self.ctx.mem_get_info().map_err(driver_error("memory"))
    }

    fn alloc(&self, bytes: usize) -> Result<u64, String> {
        self.ctx
            .bind_to_thread()
            .map_err(driver_error("CUDA context"))?;
        let what = || format!("allocating {bytes} bytes on the device");
        let ptr =
            unsafe { result::malloc_sync(bytes) }.map_err(|e| format!("{}: {e:?}", what()))?;
        unsafe { result::memset_d8_sync(ptr, 0, bytes) }
            .map_err(|e| format!("{}: {e:?}", what()))?;
        Ok(ptr)
    }

    fn free(&self, ptr: u64) {
        if self.ctx.bind_to_thread().is_ok() {
            // Waits for the work that may still read it.
            let _ = self.stream.synchronize();
            let _ = unsafe { result::free_sync(ptr) };
        }
    }

    fn upload(&self, ptr: u64, data: &[u8]) -> Result<(), String> {
        self.ctx
            .bind_to_thread()
            .map_err(driver_error("CUDA context"))?;
        // Synchronous from pageable memory: `data` may be freed as soon as this returns.
        self.stream.synchronize().map_err(driver_error("stream"))?;
        unsafe { result::memcpy_htod_sync(ptr, data) }
            .map_err(driver_error("copying to the device"))
    }

    fn download(&self, ptr: u64, out: &mut [u8]) -> Result<(), String> {
        self.ctx
            .bind_to_thread()
            .map_err(driver_error("CUDA context"))?;
        self.stream.synchronize().map_err(driver_error("stream"))?;
        unsafe { result::memcpy_dtoh_sync(out, ptr) }
            .map_err(driver_error("copying from the device"))
    }

    fn launch(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        args: &[Arg],
    ) -> Result<(), String> {
        let f = self
            .functions
            .get(name)
            .ok_or_else(|| format!("no kernel {name}"))?;
        let mut builder = self.stream.launch_builder(f);
        for arg in args {
            match arg {
                Arg::Ptr(v) => builder.arg(v),
                Arg::I32(v) => builder.arg(v),
                Arg::I64(v) => builder.arg(v),
                Arg::F32(v) => builder.arg(v),
            };
        }
        let config = LaunchConfig {
            grid_dim: grid,
            block_dim: (block, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the forward pass passes each kernel the arguments `kernels.cu` declares, in
        // order, with buffers sized for the step.
        unsafe { builder.launch(config) }
            .map(|_| ())
            .map_err(|e| format!("launching {name}: {e:?}"))
    }

    fn synchronize(&self) -> Result<(), String> {
        self.stream.synchronize().map_err(driver_error("stream"))
    }

    fn begin_capture(&self) -> Result<(), String> {
        self.stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(driver_error("recording a graph"))
    }

    fn end_capture(&self) -> Result<u64, String> {
        let graph = self
            .stream
            .end_capture(CUgraphInstantiate_flags(0))
            .map_err(driver_error("recording a graph"))?
            .ok_or("the recorded graph is empty")?;
        let id = self.next_graph.fetch_add(1, Ordering::Relaxed);
        self.graphs
            .lock()
            .map_err(|e| e.to_string())?
            .insert(id, Graph(graph));
        Ok(id)
    }

    fn replay(&self, graph: u64) -> Result<(), String> {
        let graphs = self.graphs.lock().map_err(|e| e.to_string())?;
        let graph = graphs.get(&graph).ok_or("no such graph")?;
        graph.0.launch().map_err(driver_error("replaying a graph"))
    }

    fn drop_graph(&self, graph: u64) {
        if let Ok(mut graphs) = self.graphs.lock() {
            graphs.remove(&graph);
        }
    }
}
