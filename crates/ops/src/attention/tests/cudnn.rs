//! The cuDNN descriptor ([`crate::attention::cudnn::plan`]) against rtune's tensors: each
//! (B, H, S, D) stride set addresses the element the tensor holds there, the band keeps exactly
//! the keys `AttnMask`'s starts do, and each case cuDNN cannot take falls back with its reason.
//! Integer checks: exact.

use candle_core::{DType, Device, IndexOp, Tensor};

use crate::attention::cudnn::{extents, plan, Band, NoCudnn};
use crate::attention::flash_ref::FlashShape;
use crate::AttnMask;

fn shape(b: usize, h: usize, hkv: usize, t: usize, dh: usize) -> FlashShape {
    FlashShape {
        b,
        h,
        hkv,
        t,
        dh,
        sb: 1,
    }
}

const CAUSAL: Option<Band> = Some(Band { window: None });

/// `x`'s element at logical `(b, h, s, d)` through `strides`, from its contiguous storage.
fn at(flat: &[f32], strides: [i64; 4], idx: [usize; 4]) -> f32 {
    let off: i64 = idx.iter().zip(strides).map(|(&i, s)| i as i64 * s).sum();
    flat[off as usize]
}

/// Every element of q `(B, H, T, Dh)`, k/v `(B, Hkv, T, Dh)`, o `(B, T, H, Dh)` and lse
/// `(B, T, H)`, built as rtune builds them (o and lse as the tiled forward lays them out: the
/// transposes of a `(B, H, T, ·)` tensor), is found at the offset the descriptor's strides give
/// for its logical (b, h, s, d).
#[test]
fn the_descriptor_strides_address_rtunes_layouts() {
    let dev = Device::Cpu;
    let (b, h, hkv, t, dh) = (2, 6, 2, 5, 8);
    let d = plan(&shape(b, h, hkv, t, dh), CAUSAL, DType::BF16, 0.25).unwrap();
    let bhtd = |heads: usize| {
        let n = b * heads * t * dh;
        Tensor::arange(0f32, n as f32, &dev)
            .unwrap()
            .reshape((b, heads, t, dh))
            .unwrap()
    };
    let flat = |x: &Tensor| x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let q = bhtd(h);
    let k = bhtd(hkv);
    // o: (B, T, H, Dh) contiguous, holding the (b, h, t, d) element of a (B, H, T, Dh) tensor
    let o_bthd = q.transpose(1, 2).unwrap().contiguous().unwrap();
    let lse_bhs = Tensor::arange(0f32, (b * h * t) as f32, &dev)
        .unwrap()
        .reshape((b, h, t))
        .unwrap();
    let lse_bth = lse_bhs.transpose(1, 2).unwrap().contiguous().unwrap();
    let (fq, fk, fo, fl) = (flat(&q), flat(&k), flat(&o_bthd), flat(&lse_bth));
    let lse_strides = [d.lse[0], d.lse[1], d.lse[2], 0];
    for bi in 0..b {
        for hi in 0..h {
            for s in 0..t {
                let want_l = lse_bhs.i((bi, hi, s)).unwrap().to_scalar::<f32>().unwrap();
                assert_eq!(
                    at(&fl, lse_strides, [bi, hi, s, 0]),
                    want_l,
                    "lse ({bi},{hi},{s})"
                );
                for e in 0..dh {
                    let want = q.i((bi, hi, s, e)).unwrap().to_scalar::<f32>().unwrap();
                    assert_eq!(at(&fq, d.q, [bi, hi, s, e]), want, "q");
                    assert_eq!(at(&fo, d.o, [bi, hi, s, e]), want, "o");
                    if hi < hkv {
                        let want = k.i((bi, hi, s, e)).unwrap().to_scalar::<f32>().unwrap();
                        assert_eq!(at(&fk, d.k, [bi, hi, s, e]), want, "k");
                        assert_eq!(at(&fk, d.v, [bi, hi, s, e]), want, "v");
                    }
                }
            }
        }
    }
    // Each tensor spans exactly its elements: the launcher's length checks.
    assert_eq!(
        extents(&d),
        [
            b * h * t * dh,
            b * hkv * t * dh,
            b * hkv * t * dh,
            b * h * t * dh,
            b * h * t
        ]
    );
    assert_eq!((d.b, d.h, d.hkv, d.s, d.d), (2, 6, 2, 5, 8));
    assert_eq!(
        (d.dtype, d.window, d.scale),
        (rtune_backend::cudnn::SDPA_BF16, 0, 0.25)
    );
}

/// cuDNN keeps key `j` of query `i` when `j ≤ i` (right bound 0) and `j + w > i` (left bound `w`,
/// cudnn-frontend's diagonal band: `col + left_bound > row`); that is exactly the run
/// `starts[i] ..= i` of `AttnMask::new` for every window, and a window of at least T is causal.
#[test]
fn the_band_keeps_exactly_the_keys_of_the_masks_starts() {
    let t = 13;
    for window in [
        None,
        Some(1),
        Some(2),
        Some(5),
        Some(12),
        Some(13),
        Some(40),
    ] {
        let mask = AttnMask::new(None, 2, t, window, &Device::Cpu).unwrap();
        let band = mask.band();
        assert_eq!(band, Some(Band { window }), "{window:?}");
        let d = plan(&shape(2, 4, 1, t, 64), band, DType::F16, 0.125).unwrap();
        assert_eq!(d.dtype, rtune_backend::cudnn::SDPA_F16);
        let starts = mask.starts.to_vec2::<u32>().unwrap();
        assert_eq!(starts.len(), 1);
        for (i, &start) in starts[0].iter().enumerate() {
            for j in 0..t {
                let cudnn = j <= i && (d.window == 0 || j as i64 + d.window as i64 > i as i64);
                let rtune = start as usize <= j && j <= i;
                assert_eq!(cudnn, rtune, "window {window:?} query {i} key {j}");
            }
        }
    }
}

/// What cuDNN cannot take runs the own kernel, each with its reason.
#[test]
fn calls_cudnn_cannot_take_fall_back_with_the_reason() {
    let dev = Device::Cpu;
    let s = shape(2, 8, 2, 16, 64);
    // Packed rows and keys after a cache are not one band.
    let packed = AttnMask::new(Some(&[0, 0, 1, 1, 0, 1, 1, 1]), 2, 4, None, &dev).unwrap();
    assert_eq!(packed.band(), None);
    let after = AttnMask::after(3, &[0, 1], 2, None, &dev).unwrap();
    assert_eq!(after.band(), None);
    assert_eq!(plan(&s, None, DType::BF16, 1.0), Err(NoCudnn::Mask));
    // A band with per-row starts would be a caller's bug: refused, not misread.
    assert_eq!(
        plan(&FlashShape { sb: 2, ..s }, CAUSAL, DType::BF16, 1.0),
        Err(NoCudnn::Mask)
    );
    assert_eq!(
        plan(&s, CAUSAL, DType::F32, 1.0),
        Err(NoCudnn::Dtype(DType::F32))
    );
    for dh in [0, 60, 100, 264] {
        let e = plan(&shape(2, 8, 2, 16, dh), CAUSAL, DType::BF16, 1.0);
        assert_eq!(e, Err(NoCudnn::HeadDim(dh)));
    }
    assert!(matches!(
        plan(&shape(1, 6, 4, 16, 64), CAUSAL, DType::BF16, 1.0),
        Err(NoCudnn::Shape(m)) if m.contains("4 kv heads do not divide 6")
    ));
    // Head dims cuDNN takes beyond the own kernel's 64/96/128 (Gemma's 256), GQA and MQA.
    for (h, hkv, dh) in [(8, 8, 256), (8, 2, 72), (8, 1, 128)] {
        let d = plan(&shape(1, h, hkv, 16, dh), CAUSAL, DType::BF16, 1.0).unwrap();
        assert_eq!((d.h, d.hkv, d.d), (h as i64, hkv as i64, dh as i64));
    }
    assert!(NoCudnn::HeadDim(100).to_string().contains("multiple of 8"));
}
