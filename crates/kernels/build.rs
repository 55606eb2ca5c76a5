//! With the `cuda` feature: compiles every `kernels/*.cu` of the repository to PTX with nvcc into
//! OUT_DIR (embedded by `src/lib.rs`). Without it: does nothing, so the CPU build never needs CUDA.
//!
//! nvcc comes from PATH, or `$CUDA_ROOT/bin` / `$CUDA_PATH/bin`; the PTX targets
//! `compute_$CUDA_COMPUTE_CAP` (default 80: Ampere, JIT-compiled by the driver for newer GPUs).
//! Warnings are errors, as in `scripts/check-kernels.sh`.

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    for v in ["CUDA_COMPUTE_CAP", "CUDA_ROOT", "CUDA_PATH", "NVCC"] {
        println!("cargo:rerun-if-env-changed={v}");
    }
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap());
    let kernels = manifest.join("../../kernels");
    println!("cargo:rerun-if-changed={}", kernels.display());
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap());
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "80".into());
    let nvcc = nvcc();
    let mut sources: Vec<PathBuf> = std::fs::read_dir(&kernels)
        .unwrap_or_else(|e| panic!("{}: {e}", kernels.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "cu"))
        .collect();
    sources.sort();
    for src in &sources {
        println!("cargo:rerun-if-changed={}", src.display());
        let ptx = out.join(src.file_stem().unwrap()).with_extension("ptx");
        let status = Command::new(&nvcc)
            .args(["--ptx", "-O3", "-std=c++17", "-Werror", "all-warnings"])
            .arg(format!("-arch=compute_{cap}"))
            .arg("-o")
            .arg(&ptx)
            .arg(src)
            .status()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot run `{}` ({e}). The `cuda` feature needs the CUDA toolkit's nvcc on PATH \
                     or in $CUDA_ROOT/bin (see scripts/check-kernels.sh for a pip-installed one)",
                    nvcc.display()
                )
            });
        if !status.success() {
            panic!("nvcc failed on {} ({status})", src.display());
        }
    }
}

fn nvcc() -> PathBuf {
    if let Some(p) = std::env::var_os("NVCC") {
        return p.into();
    }
    for root in ["CUDA_ROOT", "CUDA_PATH"] {
        if let Some(r) = std::env::var_os(root) {
            let p = Path::new(&r).join("bin/nvcc");
            if p.exists() {
                return p;
            }
        }
    }
    "nvcc".into()
}
