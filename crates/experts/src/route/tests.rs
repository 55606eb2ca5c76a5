//! Routing and the load-balancing loss against transformers' own routers and
//! `load_balancing_loss_func` (`tests/parity/golden_route.safetensors`, made by
//! `tests/parity/make_route_golden.py`). Chosen experts: equal. Weights, gradients and the loss:
//! within 1e-6 relative to the largest entry (the same f32 operations; torch's vectorised sums
//! round in another order).

use super::*;

struct Golden(Vec<u8>);

impl Golden {
    fn load() -> Golden {
        Golden::named("golden_route")
    }
    fn named(name: &str) -> Golden {
        let p = format!(
            "{}/../../tests/parity/{name}.safetensors",
            env!("CARGO_MANIFEST_DIR")
        );
        Golden(std::fs::read(p).unwrap())
    }
    fn names(&self) -> Vec<String> {
        let st = safetensors::SafeTensors::deserialize(&self.0).unwrap();
        st.names().into_iter().map(String::from).collect()
    }
    fn f32s(&self, k: &str) -> Vec<f32> {
        let st = safetensors::SafeTensors::deserialize(&self.0).unwrap();
        st.tensor(k)
            .unwrap_or_else(|_| panic!("no {k}"))
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect()
    }
    fn u32s(&self, k: &str) -> Vec<u32> {
        let st = safetensors::SafeTensors::deserialize(&self.0).unwrap();
        st.tensor(k)
            .unwrap()
            .data()
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().unwrap()) as u32)
            .collect()
    }
}

fn close(what: &str, got: &[f32], want: &[f32]) {
    close_within(what, got, want, 1e-6);
}

/// `got` within `tol` of `want`'s largest entry, entry by entry.
fn close_within(what: &str, got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len(), "{what}");
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        assert!(
            (a - b).abs() <= tol * scale,
            "{what}[{i}]: {a:e} vs transformers {b:e} (scale {scale:e})"
        );
    }
}

const E: usize = 8;
const K: usize = 2;

/// The goldens' routers by their names in `tests/parity/identity_routers.py`.
const ROUTERS: [(&str, Routing); 4] = [
    ("qwen3", Routing::SoftmaxTopK { normalize: true }),
    ("qwen3_nonorm", Routing::SoftmaxTopK { normalize: false }),
    ("mixtral", Routing::SoftmaxTopK { normalize: true }),
    ("gptoss", Routing::TopKSoftmax),
];

#[test]
fn routers_match_transformers() {
    let g = Golden::load();
    let logits = g.f32s("logits");
    let dweights = g.f32s("dweights");
    for (name, routing) in ROUTERS {
        let r = route(&logits, E, K, routing).unwrap();
        assert_eq!(r.experts, g.u32s(&format!("{name}.experts")), "{name}");
        close(name, &r.weights, &g.f32s(&format!("{name}.weights")));
        let d = route_backward(&r, &dweights, E, routing, DType::F32).unwrap();
        close(
            &format!("{name} dlogits"),
            &d,
            &g.f32s(&format!("{name}.dlogits")),
        );
    }
}

#[test]
fn load_balancing_loss_matches_transformers() {
    let g = Golden::load();
    let layers: Vec<Vec<f32>> = (0..3).map(|i| g.f32s(&format!("aux.l{i}"))).collect();
    let refs: Vec<&[f32]> = layers.iter().map(|l| &l[..]).collect();
    let mask = g.f32s("aux.mask");
    let (loss, grads) = aux_loss(&refs, E, K, Some(&mask), 1.0, DType::F32);
    close("aux loss", &[loss], &g.f32s("aux.loss"));
    for (i, d) in grads.iter().enumerate() {
        close(&format!("aux d{i}"), d, &g.f32s(&format!("aux.d{i}")));
    }
    // Without the mask every token counts: a different loss.
    let (unmasked, _) = aux_loss(&refs, E, K, None, 1.0, DType::F32);
    assert_ne!(unmasked, loss);
}

#[test]
fn bad_shapes_are_errors_naming_the_op() {
    let logits = vec![0f32; 2 * E];
    let routing = Routing::TopKSoftmax;
    for k in [0, E + 1] {
        let e = route(&logits, E, k, routing).unwrap_err().to_string();
        assert!(
            e.contains("route: top-") && e.contains(&format!("{E} experts")),
            "{e}"
        );
    }
    let e = route(&logits[..E + 3], E, 2, routing)
        .unwrap_err()
        .to_string();
    assert!(e.contains("not n × 8 experts"), "{e}");
    let r = route(&logits, E, 2, routing).unwrap();
    let e = route_backward(&r, &[0f32; 3], E, routing, DType::F32)
        .unwrap_err()
        .to_string();
    assert!(e.contains("route backward") && e.contains("2 × 2"), "{e}");
}

/// `a + b` of two bf16-valued gradients rounded to bf16: autograd's sum of the logits' two
/// gradients in the model's dtype (`MoeMlp::backward` in rtune-model).
fn bf16_sum(a: &[f32], b: &[f32]) -> Vec<f32> {
    a.iter()
        .zip(b)
        .map(|(x, y)| round(x + y, DType::BF16))
        .collect()
}

/// How many entries of `got` differ from `want` (exactly: both hold bf16 values).
fn differing(got: &[f32], want: &[f32]) -> usize {
    got.iter().zip(want).filter(|(a, b)| a != b).count()
}

/// torch's router-logit gradient in a bf16 model (`bf16.*` of the golden: two layers of 64
/// tokens, the three routers, the load-balancing loss at coefficient 0.1 without and with
/// padding): the routing path's gradient rounded to bf16, the aux loss's from the bf16
/// probabilities rounded to bf16, summed in bf16. gpt-oss's: bit-equal (each entry a bf16 value,
/// so `==` on the f32s). Qwen3-MoE's and Mixtral's: bit-equal but where the routing path's own
/// gradient is not (measured: 0 to 8 of 512 a layer, all within 1e-6 of the largest): the
/// experts off the top-k get `-p_j · Σ_m p_m·dp_m`, a sum that cancels to f32 noise (~1e-9 of
/// the largest), and torch's vectorised `exp` differs from Rust's in the last bit of 201 of the
/// 512 probabilities. The aux loss within 1e-6 (f32 sums in another order). The old rounding
/// (both paths in f32 from f32 probabilities, summed, rounded once) must differ (measured: 312
/// to 374 of 512 entries a layer), or the golden would not tell the two apart.
#[test]
fn bf16_router_gradient_sums_the_two_rounded_paths_as_torch() {
    let g = Golden::load();
    let layers: Vec<Vec<f32>> = (0..2).map(|i| g.f32s(&format!("bf16.l{i}"))).collect();
    let refs: Vec<&[f32]> = layers.iter().map(|l| &l[..]).collect();
    let mask = g.f32s("bf16.mask");
    let coef = 0.1f32;
    for (name, routing) in [
        ("qwen3", Routing::SoftmaxTopK { normalize: true }),
        ("mixtral", Routing::SoftmaxTopK { normalize: true }),
        ("gptoss", Routing::TopKSoftmax),
    ] {
        let backward = |i: usize, dtype| {
            let r = route(&layers[i], E, K, routing).unwrap();
            route_backward(&r, &g.f32s(&format!("bf16.dw{i}")), E, routing, dtype).unwrap()
        };
        for (masked, m) in [("all", None), ("masked", Some(&mask[..]))] {
            let (loss, aux) = aux_loss(&refs, E, K, m, coef, DType::BF16);
            let want_loss = g.f32s(&format!("bf16.aux.{masked}"));
            close(&format!("{name} {masked} aux loss"), &[loss], &want_loss);
            let (_, aux32) = aux_loss(&refs, E, K, m, coef, DType::F32);
            for i in 0..2 {
                let what = format!("{name} {masked} layer {i}");
                let want = g.f32s(&format!("bf16.{name}.{masked}.d{i}"));
                let route_want = g.f32s(&format!("bf16.{name}.route.d{i}"));
                let routed = backward(i, DType::BF16);
                close(&format!("{what}'s routing path"), &routed, &route_want);
                let got = bf16_sum(&routed, &aux[i]);
                for (j, (a, b)) in got.iter().zip(&want).enumerate() {
                    let noise = routing != Routing::TopKSoftmax && routed[j] != route_want[j];
                    assert!(a == b || noise, "{what}[{j}]: {a} vs torch's {b}");
                }
                close(&what, &got, &want);
                let old: Vec<f32> = (backward(i, DType::F32).iter().zip(&aux32[i]))
                    .map(|(a, b)| round(a + b, DType::BF16))
                    .collect();
                let (new_off, old_off) = (differing(&got, &want), differing(&old, &want));
                eprintln!("{what}: {new_off} of 512 off torch's, {old_off} the old way");
                assert!(old_off > 0, "{what}: the old rounding gives torch's");
            }
        }
    }
}

/// `top_k` keeps what a full sort by descending value keeps, in its order: the same values (a tie
/// may be another of the equal entries: `top_k_matches_torchs_on_ties`), on rows with many ties,
/// a NaN and ±0 (equal, as torch compares them).
#[test]
fn top_k_is_a_full_sorts_first_k() {
    let full = |x: &[f32], k: usize| {
        let mut idx: Vec<usize> = (0..x.len()).collect();
        idx.sort_by(|&a, &b| x[b].total_cmp(&x[a]));
        idx.truncate(k);
        idx
    };
    let same = |a: f32, b: f32| a == b || (a.is_nan() && b.is_nan());
    let mut rows: Vec<Vec<f32>> = (0..50u32)
        .map(|s| {
            (0..37u32)
                .map(|i| ((i * 7 + s * 13) % 5) as f32 * 0.25)
                .collect()
        })
        .collect();
    rows.push(vec![0.0, -0.0, f32::NAN, 1.0, 1.0, -1.0, 0.0]);
    for row in &rows {
        for k in 1..=row.len() {
            let (got, want) = (super::top_k(row, k), full(row, k));
            assert_eq!(got.len(), k);
            let distinct: std::collections::HashSet<usize> = got.iter().copied().collect();
            assert_eq!(distinct.len(), k, "{row:?}, k {k}: {got:?}");
            for (&g, &w) in got.iter().zip(&want) {
                assert!(same(row[g], row[w]), "{row:?}, k {k}: {got:?} vs {want:?}");
            }
        }
    }
}

/// torch's `topk` on rows of a few repeated values (`golden_topk`): the same indices in the same
/// order, exactly, on both of its paths (partial sort when `k · 64 ≤ n`, else nth_element and a
/// sort) and past the sort's 16-element insertion sort. A stable order (ties: the lower index
/// first, this module's before) differs from torch's on most of these rows: counted, so that the
/// golden keeps testing ties.
#[test]
fn top_k_matches_torchs_on_ties() {
    let g = Golden::named("golden_topk");
    let (mut rows, mut stable_off) = (0, 0);
    for name in g.names().iter().filter(|n| n.starts_with("x.")) {
        let mut it = name.split('.').skip(1).map(|v| v.parse::<usize>().unwrap());
        let (n, k) = (it.next().unwrap(), it.next().unwrap());
        let (x, idx) = (g.f32s(name), g.u32s(&format!("idx.{n}.{k}")));
        for (row, want) in x.chunks(n).zip(idx.chunks(k)) {
            let want: Vec<usize> = want.iter().map(|&i| i as usize).collect();
            assert_eq!(super::top_k(row, k), want, "n {n}, k {k}: {row:?}");
            let mut stable: Vec<usize> = (0..n).collect();
            stable.sort_by(|&a, &b| match (row[a].is_nan(), row[b].is_nan()) {
                (true, false) => std::cmp::Ordering::Less,
                (false, true) => std::cmp::Ordering::Greater,
                _ => row[b]
                    .partial_cmp(&row[a])
                    .unwrap_or(std::cmp::Ordering::Equal),
            });
            stable_off += usize::from(stable[..k] != want[..]);
            rows += 1;
        }
    }
    assert_eq!(rows, 13 * 40);
    assert!(stable_off > rows / 2, "{stable_off} of {rows}");
}

/// transformers' routers on logits where many tie (`golden_topk`'s 64 × 128, top-8): the experts
/// torch chose, exactly; the weights within 1e-5 of the largest: a softmax over 128 experts sums
/// its 128 terms in another order than torch's vectorised sum (up to ~128 roundings of 2⁻²⁴ in
/// the denominator; measured 1.05e-6 on qwen3_nonorm's unnormalised weights, 2.4e-7 on the
/// normalised ones, 0 on gpt-oss's).
#[test]
fn routers_choose_as_transformers_on_tied_logits() {
    let g = Golden::named("golden_topk");
    let logits = g.f32s("router.logits");
    for (name, routing) in ROUTERS {
        let r = route(&logits, 128, 8, routing).unwrap();
        assert_eq!(
            r.experts,
            g.u32s(&format!("router.{name}.experts")),
            "{name}"
        );
        let want = g.f32s(&format!("router.{name}.weights"));
        close_within(name, &r.weights, &want, 1e-5);
    }
}

/// The load-balancing loss sums its rows over rayon in blocks of a fixed size: the same bits on
/// one thread as on four, on 1000 tokens (four blocks, the last one short), three layers, a mask
/// with holes.
#[test]
fn the_load_balancing_loss_is_the_same_on_any_thread_count() {
    let (n, e, k) = (1000, 16, 4);
    let layers: Vec<Vec<f32>> = (0..3u32)
        .map(|l| {
            (0..(n * e) as u32)
                .map(|i| ((i.wrapping_mul(2654435761) ^ (l * 40503)) % 1000) as f32 * 0.01 - 5.0)
                .collect()
        })
        .collect();
    let refs: Vec<&[f32]> = layers.iter().map(|l| &l[..]).collect();
    let mask: Vec<f32> = (0..n).map(|t| if t % 7 == 3 { 0.0 } else { 1.0 }).collect();
    let on = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| aux_loss(&refs, e, k, Some(&mask), 0.01, DType::F32))
    };
    let ((l1, g1), (l4, g4)) = (on(1), on(4));
    assert_eq!(l1.to_bits(), l4.to_bits());
    for (a, b) in g1.iter().zip(&g4) {
        assert!(a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()));
    }
    assert!(l1.is_finite() && l1 > 0.0);
}
