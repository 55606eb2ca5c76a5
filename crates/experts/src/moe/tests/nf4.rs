//! NF4 expert stacks ([`super::stack`], `[model] quantize_experts`): each expert quantized as
//! bitsandbytes quantizes that 2-D matrix alone (`tests/parity/golden_nf4_experts.safetensors`,
//! made by `tests/parity/make_nf4_experts_golden.py`: codes, scales and dequantized values bit for
//! bit), and the op on an NF4 stack against the op on the whole stack dequantized beforehand.
//!
//! The op's NF4 path dequantizes each expert to exactly the f32 (or bf16) values of the whole
//! dequantized stack's slice and runs the same products in the same order on them, so forward,
//! `dx`, `∂L/∂w` and the LoRA gradients are bit-equal to the dense path on that stack (asserted
//! bit for bit), and against the plain reference (every expert on every token, candle's autograd
//! in f64 on the dequantized stack) within the dense tests' f32 bound, 2e-6 of the largest entry
//! (f32 products of depth ≤ H + I + R against f64).

use super::*;
use crate::moe::stack::Nf4Stack;

struct Golden(Vec<u8>);

impl Golden {
    fn load() -> Golden {
        let p = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../tests/parity/golden_nf4_experts.safetensors"
        );
        Golden(std::fs::read(p).unwrap())
    }
    fn raw(&self, k: &str) -> (Vec<usize>, Vec<u8>) {
        let st = safetensors::SafeTensors::deserialize(&self.0).unwrap();
        let t = st.tensor(k).unwrap_or_else(|_| panic!("no {k}"));
        (t.shape().to_vec(), t.data().to_vec())
    }
    fn f32s(&self, k: &str) -> (Vec<usize>, Vec<u32>) {
        let (shape, b) = self.raw(k);
        let v = b
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        (shape, v)
    }
}

#[test]
fn nf4_stack_is_bitsandbytes_expert_by_expert() {
    let g = Golden::load();
    for case in ["gate_up", "down", "wide"] {
        let (shape, stack) = g.f32s(&format!("{case}.stack"));
        let stack: Vec<f32> = stack.into_iter().map(f32::from_bits).collect();
        let t = Tensor::from_vec(stack, shape.as_slice(), &Device::Cpu).unwrap();
        for (q, dq) in [("nf4", false), ("nf4dq", true)] {
            let s = Nf4Stack::quantize(&t, dq).unwrap();
            let (_, packed) = g.raw(&format!("{case}.{q}.packed"));
            let (_, absmax) = g.f32s(&format!("{case}.{q}.absmax"));
            let (_, deq) = g.f32s(&format!("{case}.{q}.dequant"));
            let e_n = shape[0];
            let (pn, an) = (packed.len() / e_n, absmax.len() / e_n);
            for (e, w) in s.experts.iter().enumerate() {
                let what = format!("{case} {q} expert {e}");
                assert_eq!(w.shape, &shape[1..], "{what}: shape");
                assert_eq!(w.absmax.is_double(), dq, "{what}: double quant");
                assert_eq!(w.packed, &packed[e * pn..(e + 1) * pn], "{what}: codes");
                let a: Vec<u32> = w.absmax.decode().iter().map(|x| x.to_bits()).collect();
                assert_eq!(a, &absmax[e * an..(e + 1) * an], "{what}: scales");
            }
            // The whole stack dequantized expert by expert: bitsandbytes' `dequantize_4bit`.
            let got = bits(&s.dequantize(DType::F32, &Device::Cpu).unwrap());
            assert_eq!(got, deq, "{case} {q}: dequantized stack");
            // Resident: n/2 codes + 4 bytes a block of 64 (+ tables), ≈ 0.56 byte a parameter.
            if case == "wide" && !dq {
                let n = shape.iter().product::<usize>() as f64;
                let per = s.resident_bytes() as f64 / n;
                assert!((0.56..0.57).contains(&per), "{per} bytes a parameter");
            }
        }
    }
}

/// A sharded base sends NF4 experts as records (`Nf4Stack::records`): every expert of the
/// golden stacks, plain and double-quantized, from f32 and bf16, comes back equal (codes, scales,
/// offset, tables, dtype); a record short of a byte (an expert missing) or an expert with a
/// table of its own (which a record does not carry) is an error.
#[test]
fn nf4_experts_travel_as_records_unchanged() {
    let g = Golden::load();
    for case in ["gate_up", "down", "wide"] {
        let (shape, stack) = g.f32s(&format!("{case}.stack"));
        let stack: Vec<f32> = stack.into_iter().map(f32::from_bits).collect();
        let t = Tensor::from_vec(stack, shape.as_slice(), &Device::Cpu).unwrap();
        for (dq, dtype) in [(false, DType::F32), (true, DType::F32), (true, DType::BF16)] {
            let t = t.to_dtype(dtype).unwrap();
            let s = Nf4Stack::quantize(&t, dq).unwrap();
            let what = format!("{case} dq {dq} {dtype:?}");
            let r = s.records().unwrap();
            let (e, out, inp) = s.dims;
            assert_eq!(r.len(), e * Nf4Stack::record_len(out, inp, dq), "{what}");
            let back = Nf4Stack::from_records(&r, s.dims, dq, dtype).unwrap();
            assert!(back == s, "{what}: the stack from its records");
            let short = Nf4Stack::from_records(&r[1..], s.dims, dq, dtype);
            assert!(short.is_err(), "{what}: a byte short");
            let mut odd = s.clone();
            odd.experts[e - 1].quant_map[0] = 0.5;
            assert!(odd.records().is_err(), "{what}: a table of its own");
        }
    }
}

/// `c`'s stacks quantized, and the same stacks dequantized to `dtype`.
fn quantized(c: &Case, dq: bool, dtype: DType) -> (Nf4Stack, Nf4Stack, Tensor, Tensor) {
    let (gu, dn) = (
        Nf4Stack::quantize(&c.gate_up, dq).unwrap(),
        Nf4Stack::quantize(&c.down, dq).unwrap(),
    );
    let (gu_d, dn_d) = (
        gu.dequantize(dtype, &Device::Cpu).unwrap(),
        dn.dequantize(dtype, &Device::Cpu).unwrap(),
    );
    (gu, dn, gu_d, dn_d)
}

fn grad_bits(g: &MoeGrads) -> Vec<Vec<u32>> {
    let mut v = vec![
        bits(&g.dx),
        g.dweights.iter().map(|x| x.to_bits()).collect(),
    ];
    for (a, b) in g.gate_up.iter().chain(&g.down) {
        v.push(bits(a));
        v.push(bits(b));
    }
    v
}

#[test]
fn nf4_experts_compute_as_the_dequantized_stack() {
    for (n, (lora, dq)) in [(false, false), (true, false), (true, true)]
        .into_iter()
        .enumerate()
    {
        let seed = 300 + 10 * n as u64;
        let c = case(seed);
        let (ids, w) = routing(seed + 1);
        let (gu, dn, gu_d, dn_d) = quantized(&c, dq, DType::F32);
        let nf4 = Experts {
            gate_up: (&gu).into(),
            down: (&dn).into(),
            ..experts(&c, lora)
        };
        let dense = Experts {
            gate_up: (&gu_d).into(),
            down: (&dn_d).into(),
            ..experts(&c, lora)
        };
        let what = format!("lora {lora}, double quant {dq}");
        // The grouped f32 path takes NF4 stacks; each engine bit-equal to the dense stack's.
        assert!(grouped::applies(&c.x, &nf4));
        let groups = Groups::new(&ids, K, E).unwrap();
        for engine in [grouped::Engine::Gemm, grouped::Engine::Blas] {
            if engine == grouped::Engine::Blas && rtune_backend::blas::init().is_none() {
                eprintln!("no CBLAS found (install libopenblas0): the Blas engine not compared");
                continue;
            }
            let (y, fc) = grouped::forward(engine, &c.x, &groups, &w, &nf4).unwrap();
            let (y_d, fc_d) = grouped::forward(engine, &c.x, &groups, &w, &dense).unwrap();
            assert_eq!(bits(&y), bits(&y_d), "{engine:?} forward ({what})");
            let g = grouped::backward(engine, &c.dy, &w, &nf4, &fc, K).unwrap();
            let g_d = grouped::backward(engine, &c.dy, &w, &dense, &fc_d, K).unwrap();
            assert_eq!(bits(&g.0), bits(&g_d.0), "{engine:?} dx ({what})");
            assert_eq!(g.1, g_d.1, "{engine:?} d weights ({what})");
            for (p, q) in [(&g.2, &g_d.2), (&g.3, &g_d.3)] {
                assert_eq!(p.is_some(), lora);
                if let (Some((a, b)), Some((a_d, b_d))) = (p, q) {
                    assert_eq!(bits(a), bits(a_d), "{engine:?} d lora_A ({what})");
                    assert_eq!(bits(b), bits(b_d), "{engine:?} d lora_B ({what})");
                }
            }
        }
        // The per-expert path (other dtypes and devices) likewise.
        let (y, slow) = per_expert_forward(&c.x, &groups, &w, &nf4).unwrap();
        let (y_d, slow_d) = per_expert_forward(&c.x, &groups, &w, &dense).unwrap();
        assert_eq!(bits(&y), bits(&y_d), "per-expert forward ({what})");
        let g = per_expert_backward(&c.dy, &w, &nf4, &groups, &slow).unwrap();
        let g_d = per_expert_backward(&c.dy, &w, &dense, &groups, &slow_d).unwrap();
        assert_eq!(
            grad_bits(&g),
            grad_bits(&g_d),
            "per-expert backward ({what})"
        );

        // The op (public entry) against the plain reference on the dequantized stack, f64
        // autograd.
        let (y, cache) = moe_forward(&c.x, &ids, &w, K, &nf4).unwrap();
        let g = moe_backward(&c.dy, &w, &nf4, &cache).unwrap();
        let f64v = |t: &Tensor| Var::from_tensor(&t.to_dtype(DType::F64).unwrap()).unwrap();
        let x = f64v(&c.x);
        let comb = f64v(&combine_matrix(&ids, &w, K, E, DType::F32, &Device::Cpu).unwrap());
        let (agu, bgu, ad, bd) = (f64v(&c.lgu.0), f64v(&c.lgu.1), f64v(&c.ld.0), f64v(&c.ld.1));
        let f64t = |t: &Tensor| t.to_dtype(DType::F64).unwrap();
        let y_ref = moe_reference(
            &x,
            &comb,
            &f64t(&gu_d),
            &f64t(&dn_d),
            lora.then_some((&*agu, &*bgu, S_GU)),
            lora.then_some((&*ad, &*bd, S_D)),
        )
        .unwrap();
        let tol = 2e-6;
        let check = |name: &str, got: &Tensor, want: &Tensor| {
            let e = rel64(got, want);
            eprintln!("nf4 experts {name} ({what}): relative error {e:.2e}");
            assert!(e < tol, "nf4 experts {name} ({what}): {e:e}");
        };
        check("y", &y, &y_ref);
        let dy = f64t(&c.dy);
        let grads = (y_ref * dy).unwrap().sum_all().unwrap().backward().unwrap();
        let want = |v: &Var| grads.get(v).unwrap().clone();
        check("dx", &g.dx, &want(&x));
        if lora {
            let (dagu, dbgu) = g.gate_up.as_ref().expect("gate_up adapted");
            let (dad, dbd) = g.down.as_ref().expect("down adapted");
            check("d lora_A gate_up", dagu, &want(&agu));
            check("d lora_B gate_up", dbgu, &want(&bgu));
            check("d lora_A down", dad, &want(&ad));
            check("d lora_B down", dbd, &want(&bd));
        }
    }
}

/// In bf16 (the per-expert path) each NF4 expert dequantizes into bf16 (its f32 values rounded
/// once, as bitsandbytes' `dequantize_4bit` into bf16) and computes as the stack dequantized to
/// bf16 beforehand, bit for bit, LoRA folded as PEFT folds it.
#[test]
fn nf4_experts_in_bf16_compute_as_the_bf16_dequantized_stack() {
    let c = case(400);
    let (ids, w) = routing(401);
    let bf = |t: &Tensor| t.to_dtype(DType::BF16).unwrap();
    let c16 = Case {
        x: bf(&c.x),
        gate_up: c.gate_up.clone(),
        down: c.down.clone(),
        lgu: (bf(&c.lgu.0), bf(&c.lgu.1)),
        ld: (bf(&c.ld.0), bf(&c.ld.1)),
        dy: bf(&c.dy),
    };
    let (gu, dn, gu_d, dn_d) = quantized(&c16, true, DType::BF16);
    let nf4 = Experts {
        gate_up: (&gu).into(),
        down: (&dn).into(),
        ..experts(&c16, true)
    };
    let dense = Experts {
        gate_up: (&gu_d).into(),
        down: (&dn_d).into(),
        ..experts(&c16, true)
    };
    let (y, cache) = moe_forward(&c16.x, &ids, &w, K, &nf4).unwrap();
    assert!(matches!(cache.kept, Kept::PerExpert(_)));
    let (y_d, cache_d) = moe_forward(&c16.x, &ids, &w, K, &dense).unwrap();
    let bits16 = |t: &Tensor| bits(&t.to_dtype(DType::F32).unwrap());
    assert_eq!(bits16(&y), bits16(&y_d), "bf16 forward");
    let g = moe_backward(&c16.dy, &w, &nf4, &cache).unwrap();
    let g_d = moe_backward(&c16.dy, &w, &dense, &cache_d).unwrap();
    assert_eq!(bits16(&g.dx), bits16(&g_d.dx), "bf16 dx");
    assert_eq!(g.dweights, g_d.dweights, "bf16 d weights");
}
