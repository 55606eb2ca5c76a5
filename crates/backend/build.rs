//! With the `cuda` feature: compiles every `kernels/*.cu` of the repository with nvcc into OUT_DIR
//! (embedded by `src/image.rs`), once to PTX and once to a cubin (SASS) per architecture of
//! `CUBIN_ARCHS`. Without it: does nothing, so the CPU build never needs CUDA.
//!
//! At run time the cubin matching the device's compute capability is loaded (no JIT); any other
//! GPU JIT-compiles the PTX, which targets `compute_$CUDA_COMPUTE_CAP` (default 80: Ampere).
//! nvcc comes from `$NVCC`, `$CUDA_ROOT/bin` / `$CUDA_PATH/bin`, or PATH. Warnings are errors (the
//! assembler's too), as in `scripts/check-kernels.sh`.

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    if std::env::var_os("CARGO_FEATURE_KERNELS").is_none() {
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
        let stem = src.file_stem().unwrap().to_str().unwrap();
        let ptx = out.join(format!("{stem}.ptx"));
        run_nvcc(
            &nvcc,
            src,
            &["--ptx".into(), format!("-arch=compute_{cap}")],
            &ptx,
        );
        for arch in CUBIN_ARCHS {
            let cubin = out.join(format!("{stem}.sm_{arch}.cubin"));
            let args = [
                "--cubin".into(),
                format!("-arch=sm_{arch}"),
                "-Xptxas".into(),
                "-Werror".into(),
            ];
            run_nvcc(&nvcc, src, &args, &cubin);
        }
    }
}

/// The architectures a cubin of every kernel file is built for (A100, H100/H200); `src/image.rs`
/// embeds exactly these.
const CUBIN_ARCHS: [u32; 2] = [80, 90];

fn run_nvcc(nvcc: &Path, src: &Path, args: &[String], out: &Path) {
    let status = Command::new(nvcc)
        .args(["-O3", "-std=c++17", "-Werror", "all-warnings"])
        .args(args)
        .arg("-o")
        .arg(out)
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
        panic!("nvcc {args:?} failed on {} ({status})", src.display());
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
