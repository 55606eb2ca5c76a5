//! GeGLU's plain formulation in f64 on slices: what [`super::geglu`] and
//! [`super::geglu_backward`] are tested against (`tests.rs`).

/// `gelu_tanh(x) = x/2·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`.
fn gelu_tanh(x: f64) -> f64 {
    let k = (2.0 / std::f64::consts::PI).sqrt();
    0.5 * x * (1.0 + (k * (x + 0.044715 * x * x * x)).tanh())
}

/// `gelu_tanh(g[i]) · u[i]`.
pub fn geglu_reference(g: &[f64], u: &[f64]) -> Vec<f64> {
    g.iter().zip(u).map(|(&g, &u)| gelu_tanh(g) * u).collect()
}

/// `(dg, du)`: `dg = dh·u·gelu_tanh'(g)` by a central difference of step 1e-5 (independent of
/// the closed form the op uses; error O(1e-10)), `du = dh·gelu_tanh(g)`.
pub fn geglu_backward_reference(dh: &[f64], g: &[f64], u: &[f64]) -> (Vec<f64>, Vec<f64>) {
    let eps = 1e-5;
    let dg = dh
        .iter()
        .zip(g)
        .zip(u)
        .map(|((&d, &g), &u)| d * u * (gelu_tanh(g + eps) - gelu_tanh(g - eps)) / (2.0 * eps))
        .collect();
    let du = dh.iter().zip(g).map(|(&d, &g)| d * gelu_tanh(g)).collect();
    (dg, du)
}
