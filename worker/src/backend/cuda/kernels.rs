//! The kernels compiled by NVRTC for one architecture and head size.

use super::KERNELS;
use cudarc::nvrtc::{compile_ptx_with_opts, CompileError, CompileOptions, Ptx};

/// PTX for compute capability `major.minor` (`sm_90` for 9.0) with heads of `head_dim`.
pub fn compile(major: i32, minor: i32, head_dim: usize) -> Result<Ptx, String> {
    let options = CompileOptions {
        options: vec![
            format!("--gpu-architecture=sm_{major}{minor}"),
            format!("-DHEAD_DIM={head_dim}"),
            "--std=c++17".into(),
        ],
        // IEEE division and square roots, and no multiply-add contracted unless written as
        // one: the CPU backend's roundings.
        prec_div: Some(true),
        prec_sqrt: Some(true),
        fmad: Some(false),
        ftz: Some(false),
        ..Default::default()
    };
    compile_ptx_with_opts(KERNELS, options).map_err(|e| match e {
        CompileError::CompileError { log, .. } => format!(
            "NVRTC could not compile the kernels for sm_{major}{minor}: {}",
            log.to_string_lossy()
        ),
        other => format!("NVRTC: {other:?}"),
    })
}

/// Whether NVRTC's library can be loaded here.
#[allow(unsafe_code)]
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to open the library by its names; nothing from it is called.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}
