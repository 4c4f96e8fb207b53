//! The CUDA backend: the model on an NVIDIA GPU through `cudarc`, behind the engine's
//! `Backend` trait, built with the cargo feature `cuda`. CUDA's libraries (the driver and
//! NVRTC) are loaded at run time, so that a build with the feature runs anywhere and a
//! machine without them gets a one-line error. Kernels are CUDA C (`kernels.cu`), compiled
//! at start by NVRTC for the device's architecture and the model's head size, and compute
//! what the CPU backend computes bit for bit: integer products of the GGUF's quantised
//! weights with 8-bit activations, llama.cpp's summation orders. The paged KV cache lives in
//! device memory as f16, in the block layout the CPU backend exports.

mod backend;
#[cfg(feature = "cuda")]
mod device;
mod forward;
pub mod gpu;
#[cfg(feature = "cuda")]
pub mod kernels;
pub mod plan;
pub mod weights;

pub use backend::CudaBackend;

/// The kernels' CUDA C source (compiled by NVRTC on a device, as C++ by the test suite's
/// emulator).
pub const KERNELS: &str = include_str!("kernels.cu");

/// Every kernel the forward pass launches.
pub const NAMES: [&str; 10] = [
    "embed",
    "rms_norm_q8",
    "silu_q8",
    "matmul_q",
    "rope_store",
    "attn_scores",
    "attn_softmax",
    "attn_pv",
    "argmax",
    "top_k",
];

/// The most tokens the device picks for sampling with top-k (`top_k` in kernels.cu); a row
/// sampled with a larger or no top-k comes to the host whole.
pub const TOP_K_MAX: usize = 1024;

/// Head sizes the attention kernel is built for (it splits a block of 128 threads into
/// whole heads).
pub const HEAD_DIMS: [usize; 3] = [32, 64, 128];

#[derive(Debug, Clone)]
pub struct CudaConfig {
    /// The device's ordinal.
    pub gpu: usize,
    /// Share of the device's free memory (after the weights) this worker takes for the KV
    /// cache and its scratch.
    pub memory_utilization: f64,
    pub block_size: usize,
}

/// Why the CUDA backend cannot start here, or `None` when this build has it (the libraries
/// are checked when it loads).
pub fn unavailable() -> Option<&'static str> {
    if cfg!(feature = "cuda") {
        None
    } else {
        Some("this kvgate was built without the CUDA backend: build with `cargo build --release --features cuda`")
    }
}
