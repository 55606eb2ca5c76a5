//! The grouping plan and the lease's views, on the CPU (the forced path; a whole QLoRA step with
//! it is `tests/fused_layer.rs`).

use super::*;
use rtune_ops::nf4::{quantize_nf4, QuantType, FP4};

fn weight(out: usize, inp: usize, dq: bool, seed: usize) -> Nf4Weight {
    let x: Vec<f32> = (0..out * inp)
        .map(|i| ((i * 7 + seed) as f32 * 0.37).sin() * 0.05)
        .collect();
    quantize_nf4(&x, &[out, inp], dq).unwrap()
}

/// q/k/v of a GQA layer whose `in` is a multiple of 128: back to back, the buffer is
/// `(Σout, in)`; `in` = 96 (192 bytes a row in bf16): each weight at the next 256 bytes.
#[test]
fn offsets_are_aligned_and_tight_when_sizes_allow() {
    let (q, k, v) = (
        weight(256, 128, true, 1),
        weight(64, 128, false, 2),
        weight(64, 128, true, 3),
    );
    let p = plan(&[&q, &k, &v], 2).unwrap();
    assert_eq!(
        p.slots,
        vec![(0, 256 * 128), (256 * 128, 64 * 128), (320 * 128, 64 * 128)]
    );
    assert!(p.tight);
    assert_eq!((p.rows, p.cols, p.total), (384, 128, 384 * 128));

    let (a, b, c) = (
        weight(3, 96, false, 4),
        weight(5, 96, true, 5),
        weight(1, 96, false, 6),
    );
    let p = plan(&[&a, &b, &c], 2).unwrap();
    // 288 elements → the next multiple of 128 (256 bytes of bf16) is 384; 384 + 480 = 864 → 896.
    assert_eq!(p.slots, vec![(0, 288), (384, 480), (896, 96)]);
    assert!(!p.tight);
    assert_eq!(p.total, 992);
    // In f32, 288 elements = 1152 bytes → 1280 bytes = 320 elements.
    let p = plan(&[&a, &b], 4).unwrap();
    assert_eq!(p.slots, vec![(0, 288), (320, 480)]);
}

#[test]
fn what_does_not_group_says_why() {
    let a = weight(4, 64, false, 1);
    assert_eq!(plan(&[&a], 2), Err(Ungrouped::TooFew(1)));
    let nine: Vec<&Nf4Weight> = std::iter::repeat_n(&a, 9).collect();
    assert_eq!(plan(&nine, 2), Err(Ungrouped::TooMany(9)));
    let other_in = weight(4, 32, false, 2);
    assert!(matches!(
        plan(&[&a, &other_in], 2),
        Err(Ungrouped::Shape { index: 1, .. })
    ));
    let mut bs = weight(4, 64, false, 3);
    bs.blocksize = 128;
    assert_eq!(
        plan(&[&a, &bs], 2),
        Err(Ungrouped::Blocksize {
            index: 1,
            blocksize: 128
        })
    );
    // Mixed scale kinds and code tables group: both are per entry in the kernel.
    let mut fp4 = weight(4, 64, true, 4);
    fp4.quant_type = QuantType::Fp4;
    fp4.quant_map = FP4;
    assert!(plan(&[&a, &fp4], 2).is_ok());
}

fn linear(q: Nf4Weight, dtype: DType) -> Linear {
    Linear {
        name: "m".into(),
        w: Frozen::quant(q, dtype, &Device::Cpu).unwrap(),
        bias: None,
        lora: None,
        dora_norm: Default::default(),
    }
}

/// The leased views are each weight's own dequantization; the tight plan's block is their row
/// concatenation; unforced (the CPU), or with a dense member, nothing is leased.
#[test]
fn leased_views_are_each_weights_dequantization() {
    for inp in [128, 37] {
        let lins: Vec<Linear> = [(8, 1), (3, 2), (5, 3)]
            .into_iter()
            .map(|(o, s)| linear(weight(o, inp, s % 2 == 0, s), DType::BF16))
            .collect();
        let members: Vec<&Linear> = lins.iter().collect();
        assert!(lease(&members).unwrap().is_none());
        let (l, ran) = fused::forced(&[Fused::Nf4Group], || {
            lease(&members).unwrap().expect("forced")
        });
        assert_eq!(ran, vec![1]);
        for (v, m) in l.weights.iter().zip(&lins) {
            let want = m.w.dense().unwrap();
            assert_eq!(v.dims(), want.dims());
            let eq = v.eq(&*want).unwrap().flatten_all().unwrap();
            assert_eq!(eq.min(0).unwrap().to_scalar::<u8>().unwrap(), 1);
        }
        assert_eq!(l.block.is_some(), inp == 128);
        if let Some(b) = &l.block {
            let cat = Tensor::cat(&l.weights, 0).unwrap();
            let eq = b.eq(&cat).unwrap().flatten_all().unwrap();
            assert_eq!(eq.min(0).unwrap().to_scalar::<u8>().unwrap(), 1);
        }
        drop(l);
        let mut mixed = lins.clone();
        mixed[1].w = Frozen::Dense(mixed[1].w.dense().unwrap().into_owned());
        let members: Vec<&Linear> = mixed.iter().collect();
        let (none, _) = fused::forced(&[Fused::Nf4Group], || lease(&members).unwrap());
        assert!(none.is_none());
    }
}
