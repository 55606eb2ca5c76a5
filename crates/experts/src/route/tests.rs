//! Routing and the load-balancing loss against transformers' own routers and
//! `load_balancing_loss_func` (`tests/parity/golden_route.safetensors`, made by
//! `tests/parity/make_route_golden.py`). Chosen experts: equal. Weights, gradients and the loss:
//! within 1e-6 relative to the largest entry (the same f32 operations; torch's vectorised sums
//! round in another order).

use super::*;

struct Golden(Vec<u8>);

impl Golden {
    fn load() -> Golden {
        let p = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../tests/parity/golden_route.safetensors"
        );
        Golden(std::fs::read(p).unwrap())
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
    assert_eq!(got.len(), want.len(), "{what}");
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        assert!(
            (a - b).abs() <= 1e-6 * scale,
            "{what}[{i}]: {a} vs transformers {b}"
        );
    }
}

const E: usize = 8;
const K: usize = 2;

#[test]
fn routers_match_transformers() {
    let g = Golden::load();
    let logits = g.f32s("logits");
    let dweights = g.f32s("dweights");
    for (name, routing) in [
        ("qwen3", Routing::SoftmaxTopK { normalize: true }),
        ("qwen3_nonorm", Routing::SoftmaxTopK { normalize: false }),
        ("mixtral", Routing::SoftmaxTopK { normalize: true }),
        ("gptoss", Routing::TopKSoftmax),
    ] {
        let r = route(&logits, E, K, routing).unwrap();
        assert_eq!(r.experts, g.u32s(&format!("{name}.experts")), "{name}");
        close(name, &r.weights, &g.f32s(&format!("{name}.weights")));
        let d = route_backward(&r, &dweights, E, routing).unwrap();
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
    let (loss, grads) = aux_loss(&refs, E, K, Some(&mask));
    close("aux loss", &[loss], &g.f32s("aux.loss"));
    for (i, d) in grads.iter().enumerate() {
        close(&format!("aux d{i}"), d, &g.f32s(&format!("aux.d{i}")));
    }
    // Without the mask every token counts: a different loss.
    let (unmasked, _) = aux_loss(&refs, E, K, None);
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
    let e = route_backward(&r, &[0f32; 3], E, routing)
        .unwrap_err()
        .to_string();
    assert!(e.contains("route backward") && e.contains("2 × 2"), "{e}");
}
