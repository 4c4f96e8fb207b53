//! `kvgate worker --backend cuda` on a machine without what it needs (this build without the
//! `cuda` feature, or with it but no driver or device) exits non-zero with one line naming
//! what is missing: never a panic, never a worker that serves nothing.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{free_port, kvgate};

#[test]
fn the_cuda_backend_without_a_gpu_is_one_clear_error() {
    let has_driver = [
        "/usr/lib/x86_64-linux-gnu/libcuda.so.1",
        "/usr/lib64/libcuda.so.1",
    ]
    .iter()
    .any(|p| std::path::Path::new(p).exists());
    if has_driver {
        eprintln!("SKIPPED: this machine has an NVIDIA driver, so the cuda backend may start");
        return;
    }
    let out = kvgate()
        .args(["worker", "--backend", "cuda", "--port"])
        .arg(free_port().to_string())
        .env("KVGATE_LOG", "error")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    let line = lines[0];
    assert!(
        line.contains("built without the CUDA backend") || line.contains("no NVIDIA driver"),
        "{line}"
    );
}
