//! Every CUDA kernel compiles with NVRTC to PTX for sm_90 (the H100/H200), for every head size
//! the backend takes: a kernel that does not compile fails here, on a machine without a GPU.
//! NVRTC comes from CUDA 13 or the `nvidia-cuda-nvrtc` wheel (`scripts/fetch-nvrtc`, which the
//! test command runs); without it the test says so loudly, and fails where
//! `KVGATE_REQUIRE_NVRTC` is set (CI sets it).
#![cfg(feature = "cuda")]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kvgate_worker::backend::cuda::{kernels, HEAD_DIMS, NAMES};

#[test]
fn every_kernel_compiles_to_ptx_for_sm_90() {
    if !kernels::nvrtc_present() {
        let message = "NVRTC (libnvrtc.so.13) is not on the library path: the CUDA kernels were NOT compiled (run scripts/fetch-nvrtc and put its lib directory on LD_LIBRARY_PATH)";
        assert!(
            std::env::var_os("KVGATE_REQUIRE_NVRTC").is_none(),
            "{message}"
        );
        eprintln!("SKIPPED: {message}");
        return;
    }
    for head_dim in HEAD_DIMS {
        let ptx = kernels::compile(9, 0, head_dim)
            .unwrap_or_else(|e| panic!("head_dim {head_dim}: {e}"))
            .to_src();
        assert!(ptx.contains(".target sm_90"), "head_dim {head_dim}");
        for name in NAMES {
            assert!(
                ptx.contains(&format!(".entry {name}(")),
                "kernel {name} missing from the PTX (head_dim {head_dim})"
            );
        }
    }
}

#[test]
fn a_head_size_the_kernels_cannot_take_is_an_error_not_a_crash() {
    if !kernels::nvrtc_present() {
        eprintln!("SKIPPED: NVRTC is not on the library path");
        return;
    }
    // The source refuses a head size that does not divide its block, with NVRTC's log in
    // the error.
    for head_dim in [0, 16, 48, 256] {
        let err = kernels::compile(9, 0, head_dim).unwrap_err();
        assert!(err.contains("HEAD_DIM must divide"), "{err}");
    }
}
