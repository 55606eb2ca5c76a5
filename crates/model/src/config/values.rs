//! The values of `config.json` that reach a division, a logarithm or a square root: a present
//! key of the wrong type, or a value that would train to NaN (a soft cap of 0, a RoPE base or
//! factor of 0, a negative norm epsilon), is an error naming the key and the value (issue 46:
//! such configs trained to NaN, or silently fell back to a default).

use serde_json::Value;

/// `v` shortened for an error line (a hostile config may hold a long list where a number goes).
pub(super) fn shown(v: &Value) -> String {
    let s = v.to_string();
    match s.char_indices().nth(60) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s,
    }
}

/// `p[k]` as a number: absent or `null` is `None`; any other type is an error naming `at.k`.
pub(super) fn number(p: &Value, at: &str, k: &str) -> Result<Option<f64>, String> {
    match p.get(k) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .map(Some)
            .ok_or_else(|| format!("{at}.{k} = {}: not a number", shown(v))),
    }
}

/// `p[k]` as a string: absent or `null` is `None`; any other type is an error naming `at.k`.
pub(super) fn string<'a>(p: &'a Value, at: &str, k: &str) -> Result<Option<&'a str>, String> {
    match p.get(k) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(v) => Err(format!("{at}.{k} = {}: not a string", shown(v))),
    }
}

/// `v` (the value of `key`) is an object of RoPE parameters, or `null`: a list or a number
/// there was ignored before, and the run trained with the defaults.
pub(super) fn table<'a>(v: &'a Value, key: &str) -> Result<Option<&'a Value>, String> {
    match v {
        Value::Null => Ok(None),
        Value::Object(_) => Ok(Some(v)),
        v => Err(format!(
            "{key} = {}: not an object of RoPE parameters",
            shown(v)
        )),
    }
}

/// `v` (the value of `key`) is a number above 0 that stays one in f32, where the kernels use
/// it: 0 divides by zero (a soft cap, a RoPE factor), a negative base or factor gives NaN
/// frequencies, and an f32 underflow is a 0.
pub(crate) fn positive(key: &str, v: f64) -> Result<f64, String> {
    let f = v as f32;
    if v.is_finite() && v > 0.0 && f.is_finite() && f > 0.0 {
        Ok(v)
    } else {
        Err(format!(
            "{key} = {v}: must be a number above 0 (within f32's range); the model would \
             compute NaN with it"
        ))
    }
}
