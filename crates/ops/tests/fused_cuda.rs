//! The fused CUDA kernels (`kernels/fused.cu`, `kernels/attn.cu`) against their CPU references (each op's `reference.rs`) on fresh
//! random inputs (the seed is printed), for f32, bf16 and f16: every forward and backward, on
//! shapes with odd and non-multiple-of-8 dims (the scalar path), the model sizes (RMSNorm 4096 and
//! 8192, head_dim 64/128, vocabularies 32000, 128256, 152064), and buffers starting one element
//! into their allocation (unaligned: the scalar path on vector-friendly shapes).
//!
//! Tolerances (`rtune_backend::check::tolerance`, reasons there): f32 1e-5 relative, plus 1e-5 of the
//! output's largest value for outputs that are differences of larger terms (RoPE 1e-6: its
//! roundings equal the reference's); bf16/f16: 2 ulps of the type plus those f32 terms — both
//! sides round the same intermediates to the type, and one rounding landing an ulp apart is carried
//! into the output once. `ce_fwd`'s output is f32 for every logit type. The widening cast to f32 is
//! exact: no tolerance. The soft-capped cross-entropy's 16-bit tolerance is wider (the device's
//! `tanhf` against the host's, rounded to the type: `ce/check.rs`).
//!
//! Skips, saying so, where there is no CUDA driver or GPU; compiled only with `--features cuda`.
#![cfg(feature = "kernels")]

use cudarc::driver::{CudaContext, CudaStream};
use half::{bf16, f16};
use rtune_backend::cast::check::check_widen;
use rtune_backend::check::CheckResult;
use rtune_backend::{FusedFloat, GpuKernel};
use rtune_ops::add_norm::check::check_add_rms_norm;
use rtune_ops::add_norm::reference::Weight;
use rtune_ops::attention::check::check_attn_softmax;
use rtune_ops::ce::check::{check_ce, check_ce_capped};
use rtune_ops::glu::check::{check_geglu, check_swiglu};
use rtune_ops::norm::check::check_rms_norm;
use rtune_ops::rope::check::{check_rope, check_rope_qk};
use rtune_ops::{norm, rope, selftest};
use std::sync::Arc;

fn gpu(what: &str) -> Option<Arc<CudaStream>> {
    // With dynamic loading cudarc panics when libcuda is absent (silenced here); an error means no
    // usable device.
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let ctx = std::panic::catch_unwind(|| CudaContext::new(0));
    std::panic::set_hook(hook);
    match ctx {
        Ok(Ok(ctx)) => Some(ctx.default_stream()),
        Ok(Err(e)) => {
            eprintln!("SKIPPED fused CUDA test {what}: no usable GPU ({e})");
            None
        }
        Err(_) => {
            eprintln!("SKIPPED fused CUDA test {what}: no CUDA driver library (libcuda)");
            None
        }
    }
}

fn seed() -> u64 {
    let s = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64;
    eprintln!("fused CUDA test seed {s}");
    s
}

/// Prints every result and fails listing those that did not pass.
fn report(results: Vec<CheckResult>) {
    for r in &results {
        eprintln!("{}", r.line());
    }
    let failed: Vec<String> = results
        .iter()
        .filter(|r| !r.cmp.pass)
        .map(|r| r.line())
        .collect();
    assert!(failed.is_empty(), "failed:\n{}", failed.join("\n"));
}

/// `$check::<T>(args)` for T = f32, bf16, f16, all results.
macro_rules! each_type {
    ($check:ident($($arg:expr),*)) => {
        [
            $check::<f32>($($arg),*).unwrap(),
            $check::<bf16>($($arg),*).unwrap(),
            $check::<f16>($($arg),*).unwrap(),
        ]
        .concat()
    };
}

#[test]
fn rms_norm_matches_reference() {
    let Some(s) = gpu("rms_norm") else { return };
    let seed = seed();
    let shapes = [
        (1, 1, 0),
        (3, 17, 0),
        (7, 576, 0),
        (33, 4096, 0),
        (5, 8192, 0),
        (2, 4097, 0),
        (4, 5120, 1),
        (300, 2048, 0),
    ];
    let mut all = Vec::new();
    for (i, &(rows, dim, off)) in shapes.iter().enumerate() {
        let sd = seed + i as u64;
        all.extend(each_type!(check_rms_norm(&s, rows, dim, off, sd)));
    }
    report(all);
}

#[test]
fn swiglu_matches_reference() {
    let Some(s) = gpu("swiglu") else { return };
    let seed = seed();
    let sizes = [
        (1, 0),
        (7, 0),
        (1000, 0),
        (4099, 0),
        (4096, 1),
        (1 << 20, 0),
        ((1 << 20) + 3, 0),
    ];
    let mut all = Vec::new();
    for (i, &(n, off)) in sizes.iter().enumerate() {
        let sd = seed + i as u64;
        all.extend(each_type!(check_swiglu(&s, n, off, sd)));
    }
    report(all);
}

#[test]
fn geglu_matches_reference() {
    let Some(s) = gpu("geglu") else { return };
    let seed = seed();
    let sizes = [(1, 0), (7, 0), (4099, 0), (4096, 1), ((1 << 20) + 3, 0)];
    let mut all = Vec::new();
    for (i, &(n, off)) in sizes.iter().enumerate() {
        let sd = seed + 100 + i as u64;
        all.extend(each_type!(check_geglu(&s, n, off, sd)));
    }
    report(all);
}

#[test]
fn widen_is_exact() {
    let Some(s) = gpu("widen") else { return };
    let seed = seed();
    let sizes = [
        (1, 0),
        (9, 0),
        (1000, 0),
        (4099, 1),
        (4096, 2),
        ((1 << 20) + 5, 0),
    ];
    let mut all = Vec::new();
    for (i, &(n, off)) in sizes.iter().enumerate() {
        let sd = seed + i as u64;
        all.extend(each_type!(check_widen(&s, n, off, sd)));
    }
    report(all);
}

#[test]
fn rope_matches_reference() {
    let Some(s) = gpu("rope") else { return };
    let seed = seed();
    let shapes = [
        ((1, 1, 1, 2), 0),
        ((2, 3, 5, 64), 0),
        ((1, 4, 7, 128), 0),
        ((2, 2, 3, 6), 0),
        ((1, 2, 9, 80), 0),
        ((2, 32, 33, 128), 0),
        ((1, 3, 4, 64), 1),
    ];
    let mut all = Vec::new();
    for (i, &(shape, off)) in shapes.iter().enumerate() {
        let sd = seed + i as u64;
        all.extend(each_type!(check_rope(&s, shape, off, sd)));
    }
    report(all);
}

#[test]
fn cross_entropy_matches_reference() {
    let Some(s) = gpu("cross_entropy") else {
        return;
    };
    let seed = seed();
    let shapes = [
        (1, 7, 0),
        (3, 1001, 0),
        (8, 32000, 0),
        (5, 32001, 0),
        (4, 128256, 0),
        (2, 152064, 0),
        (3, 32000, 1),
        (70, 4096, 0),
    ];
    let mut all = Vec::new();
    for (i, &(n, v, off)) in shapes.iter().enumerate() {
        let sd = seed + i as u64;
        all.extend(each_type!(check_ce(&s, n, v, off, sd)));
    }
    report(all);
}

#[test]
fn add_rms_norm_matches_reference() {
    let Some(s) = gpu("add_rms_norm") else {
        return;
    };
    let seed = seed();
    let shapes = [
        (1, 1, 0),
        (3, 17, 0),
        (33, 4096, 0),
        (5, 8192, 0),
        (2, 4097, 0),
        (4, 3072, 1),
        (300, 2048, 0),
    ];
    let mut all = Vec::new();
    for (i, &(rows, dim, off)) in shapes.iter().enumerate() {
        for (j, w) in [Weight::Typed, Weight::F32].into_iter().enumerate() {
            let sd = seed + 2 * i as u64 + j as u64;
            all.extend(each_type!(check_add_rms_norm(&s, (rows, dim), w, off, sd)));
        }
    }
    report(all);
}

#[test]
fn rope_qk_matches_reference() {
    let Some(s) = gpu("rope_qk") else { return };
    let seed = seed();
    // ((b, hq, hk, t, dh), (table batch, rotary width), offset): GQA, MQA, partial rotary,
    // tables of batch 1, odd widths (the scalar path), unaligned.
    let shapes = [
        ((1, 1, 1, 1, 2), (1, 2), 0),
        ((2, 32, 8, 65, 128), (2, 128), 0),
        ((2, 8, 1, 33, 64), (1, 64), 0),
        ((1, 24, 8, 17, 128), (1, 96), 0),
        ((3, 5, 5, 7, 10), (3, 6), 0),
        ((1, 4, 2, 9, 128), (1, 128), 1),
    ];
    let mut all = Vec::new();
    for (i, &(shape, table, off)) in shapes.iter().enumerate() {
        let sd = seed + i as u64;
        all.extend(check_rope_qk::<f32, f32>(&s, shape, table, off, sd).unwrap());
        all.extend(check_rope_qk::<bf16, bf16>(&s, shape, table, off, sd).unwrap());
        all.extend(check_rope_qk::<f16, f16>(&s, shape, table, off, sd).unwrap());
        // f32 tables on 16-bit q, k (OLMo 2's mode).
        all.extend(check_rope_qk::<bf16, f32>(&s, shape, table, off, sd).unwrap());
        all.extend(check_rope_qk::<f16, f32>(&s, shape, table, off, sd).unwrap());
    }
    report(all);
}

#[test]
fn soft_capped_cross_entropy_matches_reference() {
    let Some(s) = gpu("ce_capped") else {
        return;
    };
    let seed = seed();
    let shapes = [
        (1, 7, 30.0, 0),
        (3, 1001, 30.0, 0),
        (8, 256000, 30.0, 0),
        (4, 128256, 5.0, 0),
        (3, 32000, 30.0, 1),
    ];
    let mut all = Vec::new();
    for (i, &(n, v, cap, off)) in shapes.iter().enumerate() {
        let sd = seed + i as u64;
        all.extend(each_type!(check_ce_capped(&s, (n, v), cap, off, sd)));
    }
    report(all);
}

#[test]
fn attn_softmax_matches_reference() {
    let Some(s) = gpu("attn_softmax") else {
        return;
    };
    let seed = seed();
    // (Hkv·G, Tq, Tk), offset: tiny rows, odd lengths (scalar path), Tq < Tk (a key/value cache),
    // the model's lengths, rows too long for shared memory (12289: scalar, 16384: vector), and
    // buffers one element into their allocation.
    let shapes = [
        ((1, 1, 1), 0),
        ((3, 5, 5), 0),
        ((4, 33, 33), 0),
        ((2, 7, 19), 0),
        ((8, 64, 64), 0),
        ((32, 128, 128), 0),
        ((2, 4, 8192), 0),
        ((1, 2, 12289), 0),
        ((2, 3, 16384), 0),
        ((4, 64, 64), 1),
    ];
    let mut all = Vec::new();
    for (i, &(shape, off)) in shapes.iter().enumerate() {
        let sd = seed + i as u64;
        all.extend(each_type!(check_attn_softmax(&s, shape, off, sd)));
    }
    report(all);
}

#[test]
fn self_test_passes_and_the_module_is_loaded_once() {
    let Some(s) = gpu("self_test") else { return };
    let results = selftest::self_test(&s).unwrap();
    for (name, err, pass) in &results {
        eprintln!(
            "{name:<40} {err:.3e} {}",
            if *pass { "PASS" } else { "FAIL" }
        );
    }
    assert_eq!(results.len(), 3 * 16);
    assert!(results.iter().all(|r| r.2));
    // A kernel is loaded once per context: the second lookup is the cached function.
    let k = GpuKernel::new(&rtune_backend::image::FUSED, "rope_fwd");
    let (a, b) = (
        k.get::<bf16>(s.context()).unwrap(),
        k.get::<bf16>(s.context()).unwrap(),
    );
    assert_eq!(a.cu_function(), b.cu_function());
    assert_eq!(<bf16 as FusedFloat>::SUFFIX, "bf16");
}

#[test]
fn launchers_reject_short_buffers() {
    let Some(s) = gpu("launchers_reject_short_buffers") else {
        return;
    };
    let x = s.alloc_zeros::<f32>(10).unwrap();
    let mut y = s.alloc_zeros::<f32>(10).unwrap();
    let err = norm::cuda::rms_norm_fwd(
        &s,
        &x.slice(..),
        &x.slice(..4),
        &mut y.slice_mut(..),
        2,
        5,
        1e-5,
    )
    .unwrap_err();
    assert!(err.to_string().contains("w has 4 elements"), "{err}");
    let err = rope::cuda::rope_fwd(
        &s,
        &x.slice(..),
        &x.slice(..),
        &x.slice(..),
        &mut y.slice_mut(..),
        1,
        1,
        2,
        5,
    )
    .unwrap_err();
    assert!(err.to_string().contains("odd"), "{err}");
}
