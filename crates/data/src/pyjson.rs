//! Python's `json.dumps`, byte for byte, over template values.
//!
//! transformers replaces Jinja's `tojson` filter with
//! `json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`
//! (`utils/chat_template_utils.py`), and Llama-3.x / Qwen2.5 templates print tool schemas and
//! tool-call arguments through it, so rendering them byte-identically needs Python's exact output:
//! `", "` / `": "` separators (`","` when indenting), a newline before every item when `indent` is
//! set (even `indent=0`), non-ASCII kept, and floats written as Python's `repr` writes them.

use minijinja::value::{Value, ValueKind};
use minijinja::{Error, ErrorKind};

/// The arguments of `json.dumps` that the filter exposes.
#[derive(Debug, Clone)]
pub struct Dumps {
    pub ensure_ascii: bool,
    /// `None`: one line. `Some(s)`: one item a line, indented by `s` per level.
    pub indent: Option<String>,
    pub item_sep: String,
    pub key_sep: String,
    pub sort_keys: bool,
}

impl Dumps {
    /// Python's defaults for the given indent: separators `(", ", ": ")`, or `(",", ": ")` with
    /// an indent (so lines carry no trailing space).
    pub fn new(indent: Option<String>) -> Self {
        let item_sep = if indent.is_some() { "," } else { ", " };
        Dumps {
            ensure_ascii: false,
            indent,
            item_sep: item_sep.into(),
            key_sep: ": ".into(),
            sort_keys: false,
        }
    }
}

fn not_serializable(v: &Value) -> Error {
    Error::new(
        ErrorKind::InvalidOperation,
        format!("tojson: a {} is not JSON serializable", v.kind()),
    )
}

/// `json.dumps(v, ...)`.
pub fn dumps(v: &Value, o: &Dumps) -> Result<String, Error> {
    let mut out = String::new();
    write_value(&mut out, v, o, 0)?;
    Ok(out)
}

fn newline(out: &mut String, o: &Dumps, level: usize) {
    if let Some(ind) = &o.indent {
        out.push('\n');
        for _ in 0..level {
            out.push_str(ind);
        }
    }
}

fn write_value(out: &mut String, v: &Value, o: &Dumps, level: usize) -> Result<(), Error> {
    match v.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => out.push_str(&number(v)?),
        ValueKind::String => write_str(out, v.as_str().unwrap_or_default(), o.ensure_ascii),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&o.item_sep);
                }
                newline(out, o, level + 1);
                write_value(out, item, o, level + 1)?;
            }
            newline(out, o, level);
            out.push(']');
        }
        ValueKind::Map => {
            let mut items = Vec::new();
            for k in v.try_iter()? {
                let val = v.get_item(&k)?;
                items.push((key(&k)?, val));
            }
            if o.sort_keys {
                items.sort_by(|a, b| a.0.cmp(&b.0));
            }
            if items.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, (k, val)) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&o.item_sep);
                }
                newline(out, o, level + 1);
                write_str(out, k, o.ensure_ascii);
                out.push_str(&o.key_sep);
                write_value(out, val, o, level + 1)?;
            }
            newline(out, o, level);
            out.push('}');
        }
        _ => return Err(not_serializable(v)),
    }
    Ok(())
}

/// Dict keys as `json.dumps` coerces them: strings as-is, numbers, booleans and None as text.
fn key(k: &Value) -> Result<String, Error> {
    match k.kind() {
        ValueKind::String => Ok(k.as_str().unwrap_or_default().to_string()),
        ValueKind::None => Ok("null".into()),
        ValueKind::Bool => Ok(if k.is_true() { "true" } else { "false" }.into()),
        ValueKind::Number => number(k),
        _ => Err(Error::new(
            ErrorKind::InvalidOperation,
            format!(
                "tojson: keys must be str, int, float, bool or None, not {}",
                k.kind()
            ),
        )),
    }
}

fn number(v: &Value) -> Result<String, Error> {
    if v.is_integer() {
        // Integers print their digits in both languages (minijinja's Display is exact for
        // i64/u64/i128/u128).
        return Ok(v.to_string());
    }
    let f = f64::try_from(v.clone())?;
    Ok(if f.is_nan() {
        "NaN".into()
    } else if f.is_infinite() {
        if f > 0.0 { "Infinity" } else { "-Infinity" }.into()
    } else {
        py_float_repr(f)
    })
}

/// Python's `repr(float)`: the shortest digits that round-trip (Rust's `{:e}` finds the same
/// digits), written in fixed notation when the decimal exponent is in [-4, 16), else as
/// `d.ddde+XX` with at least two exponent digits; fixed notation always has a `.`.
pub fn py_float_repr(f: f64) -> String {
    if f == 0.0 {
        return if f.is_sign_negative() { "-0.0" } else { "0.0" }.into();
    }
    let sci = format!("{f:e}");
    let (mant, exp) = sci.split_once('e').expect("{:e} always has an exponent");
    let exp: i32 = exp.parse().expect("{:e} exponent is an integer");
    let neg = mant.starts_with('-');
    let digits: String = mant.chars().filter(|c| c.is_ascii_digit()).collect();
    let mut s = String::new();
    if neg {
        s.push('-');
    }
    if (-4..16).contains(&exp) {
        if exp >= 0 {
            let int_len = exp as usize + 1;
            if digits.len() <= int_len {
                s.push_str(&digits);
                s.extend(std::iter::repeat_n('0', int_len - digits.len()));
                s.push_str(".0");
            } else {
                s.push_str(&digits[..int_len]);
                s.push('.');
                s.push_str(&digits[int_len..]);
            }
        } else {
            s.push_str("0.");
            s.extend(std::iter::repeat_n('0', (-exp - 1) as usize));
            s.push_str(&digits);
        }
    } else {
        s.push_str(&digits[..1]);
        if digits.len() > 1 {
            s.push('.');
            s.push_str(&digits[1..]);
        }
        s.push_str(&format!(
            "e{}{:02}",
            if exp < 0 { '-' } else { '+' },
            exp.abs()
        ));
    }
    s
}

/// A JSON string literal as Python's encoder writes it: `"` `\` and the C0 controls escaped
/// (`\n` `\r` `\t` `\b` `\f` by name, the rest as `\u00XX`); with `ensure_ascii` every char
/// outside ' '..='~' as `\uXXXX` (surrogate pairs above U+FFFF), else kept as-is.
fn write_str(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c if ensure_ascii && !(' '..='~').contains(&c) => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(json: &str) -> Value {
        serde_json::from_str(json).unwrap()
    }

    // Expected strings are what CPython 3 prints for the same calls, e.g.
    // `json.dumps({"b": [1, 2.5, None], "a": "é\n"}, ensure_ascii=False)`.
    #[test]
    fn dumps_matches_python() {
        let x = v(r#"{"b": [1, 2.5, null, true], "a": "é\n\"\u0001", "e": {}, "l": []}"#);
        assert_eq!(
            dumps(&x, &Dumps::new(None)).unwrap(),
            r#"{"b": [1, 2.5, null, true], "a": "é\n\"\u0001", "e": {}, "l": []}"#
        );
        // json.dumps(x, ensure_ascii=False, indent=2)
        assert_eq!(
            dumps(&x, &Dumps::new(Some("  ".into()))).unwrap(),
            "{\n  \"b\": [\n    1,\n    2.5,\n    null,\n    true\n  ],\n  \"a\": \"é\\n\\\"\\u0001\",\n  \"e\": {},\n  \"l\": []\n}"
        );
        // json.dumps(x, ensure_ascii=True, sort_keys=True, separators=(",", ":"))
        let o = Dumps {
            ensure_ascii: true,
            indent: None,
            item_sep: ",".into(),
            key_sep: ":".into(),
            sort_keys: true,
        };
        assert_eq!(
            dumps(&v(r#"{"z": "😀", "a": 1}"#), &o).unwrap(),
            r#"{"a":1,"z":"\ud83d\ude00"}"#
        );
        // indent=0 still breaks lines.
        assert_eq!(
            dumps(&v("[1, 2]"), &Dumps::new(Some(String::new()))).unwrap(),
            "[\n1,\n2\n]"
        );
    }

    #[test]
    fn floats_print_as_python_repr() {
        for (f, want) in [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (-2.5, "-2.5"),
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (123456789.125, "123456789.125"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (1.5e-7, "1.5e-07"),
            (1e100, "1e+100"),
            (-0.0, "-0.0"),
            (2.0f64.powi(60), "1.152921504606847e+18"),
        ] {
            assert_eq!(py_float_repr(f), want, "{f}");
        }
    }
}
