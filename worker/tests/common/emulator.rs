//! The CUDA backend's [`Gpu`] on the CPU: `kernels.cu` compiled as C++ with g++ against
//! `tests/emulator/cuda_on_cpu.h` (each CUDA thread an OS thread, barriers for
//! `__syncthreads` and warp shuffles), device memory as host memory. Slow, but it runs the
//! backend's real forward pass and kernels, so the test suite checks them bit for bit
//! against the CPU backend on machines without a GPU.
#![allow(unsafe_code)]

use kvgate_worker::backend::cuda::gpu::{Arg, Gpu};
use std::alloc::Layout;
use std::collections::HashMap;
use std::ffi::{c_char, c_void, CString};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

type Launch = unsafe extern "C" fn(*const c_char, u32, u32, u32, u32, *mut *mut c_void) -> i32;

/// Memory the emulator says it has (it allocates only what is asked for).
const MEMORY: usize = 16 << 30;
const ALIGN: usize = 256;

pub struct Emulator {
    _library: libloading::Library,
    launch: Launch,
    allocations: Mutex<HashMap<u64, Layout>>,
    /// Graphs as CUDA records them: each launch with the arguments it had.
    recording: Mutex<Option<Vec<Recorded>>>,
    graphs: Mutex<Vec<Vec<Recorded>>>,
}

type Recorded = (String, (u32, u32, u32), u32, Vec<Arg>);

impl Emulator {
    /// The kernels built for heads of `head_dim`; `Err` when g++ is missing or fails.
    pub fn build(head_dim: usize) -> Result<Emulator, String> {
        let worker = crate::common::worker_dir();
        let out = Self::library_path(head_dim);
        let status = std::process::Command::new("g++")
            .args(["-std=c++20", "-O2", "-fPIC", "-shared", "-pthread"])
            // The device's arithmetic: no multiply-add fused unless written as one.
            .arg("-ffp-contract=off")
            .arg(format!("-DHEAD_DIM={head_dim}"))
            .arg("-I")
            .arg(worker.join("src/backend/cuda"))
            .arg("-I")
            .arg(worker.join("tests/emulator"))
            .arg(worker.join("tests/emulator/launch.cpp"))
            .arg("-o")
            .arg(&out)
            .status()
            .map_err(|e| format!("g++: {e}"))?;
        if !status.success() {
            return Err(format!("g++ could not build the emulator ({status})"));
        }
        // SAFETY: the library is ours (launch.cpp); its initialisers only build a table.
        let library = unsafe { libloading::Library::new(&out) }.map_err(|e| e.to_string())?;
        let _ = std::fs::remove_file(&out);
        // SAFETY: `emu_launch` has this signature in launch.cpp.
        let launch = unsafe { library.get::<Launch>(b"emu_launch\0") }
            .map(|f| *f)
            .map_err(|e| e.to_string())?;
        Ok(Emulator {
            _library: library,
            launch,
            allocations: Mutex::new(HashMap::new()),
            recording: Mutex::new(None),
            graphs: Mutex::new(Vec::new()),
        })
    }

    /// A file name no other build uses, in this process or another.
    pub fn library_path(head_dim: usize) -> PathBuf {
        static BUILDS: AtomicUsize = AtomicUsize::new(0);
        let build = BUILDS.fetch_add(1, Ordering::Relaxed);
        PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!(
            "cuda-emulator-{head_dim}-{}-{build}.so",
            std::process::id()
        ))
    }

    fn allocated(&self) -> usize {
        self.allocations
            .lock()
            .map(|a| a.values().map(Layout::size).sum())
            .unwrap_or(0)
    }
}

impl Gpu for Emulator {
    fn describe(&self) -> String {
        "CUDA emulated on the CPU".into()
    }

    fn memory(&self) -> Result<(usize, usize), String> {
        Ok((MEMORY.saturating_sub(self.allocated()), MEMORY))
    }

    fn alloc(&self, bytes: usize) -> Result<u64, String> {
        let layout = Layout::from_size_align(bytes.max(1), ALIGN).map_err(|e| e.to_string())?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(format!("cannot allocate {bytes} bytes"));
        }
        let addr = ptr as u64;
        self.allocations
            .lock()
            .map_err(|e| e.to_string())?
            .insert(addr, layout);
        Ok(addr)
    }

    fn free(&self, ptr: u64) {
        if let Some(layout) = self
            .allocations
            .lock()
            .ok()
            .and_then(|mut a| a.remove(&ptr))
        {
            // SAFETY: allocated by `alloc` with this layout, and freed once.
            unsafe { std::alloc::dealloc(ptr as *mut u8, layout) };
        }
    }

    fn upload(&self, ptr: u64, data: &[u8]) -> Result<(), String> {
        // SAFETY: `Buffer` checked that the range lies inside an allocation.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), ptr as *mut u8, data.len()) };
        Ok(())
    }

    fn download(&self, ptr: u64, out: &mut [u8]) -> Result<(), String> {
        // SAFETY: as for `upload`.
        unsafe { std::ptr::copy_nonoverlapping(ptr as *const u8, out.as_mut_ptr(), out.len()) };
        Ok(())
    }

    fn launch(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        args: &[Arg],
    ) -> Result<(), String> {
        if let Some(recording) = self.recording.lock().map_err(|e| e.to_string())?.as_mut() {
            recording.push((name.to_string(), grid, block, args.to_vec()));
            return Ok(());
        }
        // Each argument in a word of its own, read by the kernel as its declared type (the
        // low bytes, little-endian).
        let mut words: Vec<u64> = args
            .iter()
            .map(|a| match *a {
                Arg::Ptr(v) => v,
                Arg::I32(v) => u64::from(v as u32),
                Arg::I64(v) => v as u64,
                Arg::F32(v) => u64::from(v.to_bits()),
            })
            .collect();
        let mut pointers: Vec<*mut c_void> =
            words.iter_mut().map(|w| (w as *mut u64).cast()).collect();
        let name_c = CString::new(name).map_err(|e| e.to_string())?;
        // SAFETY: `pointers` holds one pointer per kernel parameter, each to a live word.
        let rc = unsafe {
            (self.launch)(
                name_c.as_ptr(),
                grid.0,
                grid.1,
                grid.2,
                block,
                pointers.as_mut_ptr(),
            )
        };
        if rc != 0 {
            return Err(format!(
                "the emulator has no kernel {name} for {block} threads"
            ));
        }
        Ok(())
    }

    fn synchronize(&self) -> Result<(), String> {
        Ok(())
    }

    fn begin_capture(&self) -> Result<(), String> {
        *self.recording.lock().map_err(|e| e.to_string())? = Some(Vec::new());
        Ok(())
    }

    fn end_capture(&self) -> Result<u64, String> {
        let recorded = self
            .recording
            .lock()
            .map_err(|e| e.to_string())?
            .take()
            .ok_or("not recording")?;
        let mut graphs = self.graphs.lock().map_err(|e| e.to_string())?;
        graphs.push(recorded);
        Ok(graphs.len() as u64 - 1)
    }

    fn replay(&self, graph: u64) -> Result<(), String> {
        let launches = self.graphs.lock().map_err(|e| e.to_string())?[graph as usize].clone();
        for (name, grid, block, args) in launches {
            self.launch(&name, grid, block, &args)?;
        }
        Ok(())
    }
}
