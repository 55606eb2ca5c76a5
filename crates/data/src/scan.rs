//! `rtune data scan`: likely secrets and personal data in training files, reported as
//! `file:line: kind` — never the matched text itself, so the report can be shared.
//!
//! Secrets: well-known token formats (cloud, VCS, chat, payment and model-hub keys, private-key
//! blocks, JWTs) and, for anything else, long random-looking strings (Shannon entropy ≥ 4.5 bits a
//! character over ≥ 32 characters with letters and digits). Personal data: e-mail addresses, phone
//! numbers in international or North-American format, and payment-card numbers that pass the Luhn
//! check. Patterns favour recall on the known formats and precision on the generic ones.

use regex::Regex;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    pub path: PathBuf,
    pub line: usize,
    pub kind: &'static str,
}

impl std::fmt::Display for Finding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}: {}", self.path.display(), self.line, self.kind)
    }
}

struct Patterns {
    known: Vec<(&'static str, Regex)>,
    candidate: Regex,
    email: Regex,
    phone: Regex,
    card: Regex,
}

fn patterns() -> &'static Patterns {
    static P: OnceLock<Patterns> = OnceLock::new();
    P.get_or_init(|| {
        let re = |s: &str| Regex::new(s).expect("scan pattern compiles");
        Patterns {
            known: vec![
                ("private key", re(r"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY-----")),
                ("AWS access key id", re(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b")),
                ("GitHub token", re(r"\b(?:gh[pousr]_[A-Za-z0-9]{36,}|github_pat_[A-Za-z0-9_]{22,})")),
                ("Anthropic API key", re(r"\bsk-ant-[A-Za-z0-9_-]{20,}")),
                ("OpenAI API key", re(r"\bsk-(?:proj-)?[A-Za-z0-9_-]{20,}")),
                ("Hugging Face token", re(r"\bhf_[A-Za-z0-9]{30,}\b")),
                ("Slack token", re(r"\bxox[abprs]-[A-Za-z0-9-]{10,}")),
                ("Google API key", re(r"\bAIza[0-9A-Za-z_-]{35}")),
                ("Stripe key", re(r"\b[sr]k_(?:live|test)_[0-9A-Za-z]{16,}")),
                ("JSON web token", re(r"\beyJ[A-Za-z0-9_-]{10,}\.[A-Za-z0-9_-]{10,}\.[A-Za-z0-9_-]{10,}")),
            ],
            candidate: re(r"[A-Za-z0-9+/_=-]{32,}"),
            email: re(r"\b[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}\b"),
            phone: re(r"(?:\+[1-9]\d{0,2}[ .-]?\(?\d{1,4}\)?(?:[ .-]?\d{2,4}){2,4}|\(\d{3}\)[ .-]?\d{3}[ .-]\d{4}|\b\d{3}[.-]\d{3}[.-]\d{4}\b)"),
            card: re(r"\b\d(?:[ -]?\d){12,18}\b"),
        }
    })
}

/// Bits of entropy per character of `s`.
fn entropy(s: &str) -> f64 {
    let mut counts = [0usize; 256];
    for b in s.bytes() {
        counts[b as usize] += 1;
    }
    let n = s.len() as f64;
    counts
        .iter()
        .filter(|&&c| c > 0)
        .map(|&c| -(c as f64 / n) * (c as f64 / n).log2())
        .sum()
}

fn luhn(digits: &[u8]) -> bool {
    let mut sum = 0;
    for (i, d) in digits.iter().rev().enumerate() {
        let mut v = (d - b'0') as u32;
        if i % 2 == 1 {
            v *= 2;
            if v > 9 {
                v -= 9;
            }
        }
        sum += v;
    }
    sum % 10 == 0
}

/// Kinds found in one line of text (each kind once).
pub fn scan_line(line: &str) -> Vec<&'static str> {
    let p = patterns();
    let mut kinds = Vec::new();
    let mut push = |k: &'static str| {
        if !kinds.contains(&k) {
            kinds.push(k);
        }
    };
    let mut known_spans = Vec::new();
    // In order, most specific first: a match inside an earlier one (sk-ant-… is also sk-…) is not
    // reported again.
    for (kind, re) in &p.known {
        for m in re.find_iter(line) {
            if !known_spans
                .iter()
                .any(|r: &std::ops::Range<usize>| r.start < m.end() && m.start() < r.end)
            {
                push(kind);
                known_spans.push(m.range());
            }
        }
    }
    for m in p.candidate.find_iter(line) {
        let s = m.as_str();
        let overlaps = known_spans
            .iter()
            .any(|r| r.start < m.end() && m.start() < r.end);
        let mixed =
            s.bytes().any(|b| b.is_ascii_digit()) && s.bytes().any(|b| b.is_ascii_alphabetic());
        if !overlaps && mixed && entropy(s) >= 4.5 {
            push("high-entropy string (possible secret)");
        }
    }
    if p.email.is_match(line) {
        push("e-mail address");
    }
    if p.phone.is_match(line) {
        push("phone number");
    }
    for m in p.card.find_iter(line) {
        let digits: Vec<u8> = m.as_str().bytes().filter(u8::is_ascii_digit).collect();
        if (13..=19).contains(&digits.len()) && luhn(&digits) {
            push("payment card number");
            break;
        }
    }
    kinds
}

/// Scans a text file line by line, streamed: memory is one line, and lines over `max_row_bytes`
/// (which training drops unread) are passed over unread too.
/// Only a regular file is read ([`crate::open_data`]): a FIFO or a device is an error at once.
pub fn scan_file(path: &Path, max_row_bytes: usize) -> crate::Result<Vec<Finding>> {
    let mut reader = std::io::BufReader::with_capacity(1 << 20, crate::open_data(path)?);
    let read_err = |e: std::io::Error| crate::DataError::File {
        path: path.to_path_buf(),
        message: format!("cannot read data: {e}"),
    };
    let mut out = Vec::new();
    let mut buf = Vec::new();
    for i in 1.. {
        buf.clear();
        let (n, over) = crate::cache::read_line_capped(&mut reader, &mut buf, max_row_bytes)
            .map_err(read_err)?;
        if n == 0 {
            break;
        }
        if over {
            continue;
        }
        let line = String::from_utf8_lossy(&buf);
        for kind in scan_line(line.trim_end_matches(['\n', '\r'])) {
            out.push(Finding {
                path: path.to_path_buf(),
                line: i,
                kind,
            });
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn luhn_and_entropy() {
        assert!(luhn(b"4539578763621486"));
        assert!(!luhn(b"4539578763621487"));
        assert!(entropy("aaaaaaaa") < 0.01);
        assert!((entropy("abcd") - 2.0).abs() < 1e-12);
    }

    #[test]
    fn ordinary_text_is_clean() {
        for s in [
            "Q: How much is Zephyr?\nA: 42 euros.",
            "The meeting on 2024-05-06 had 12 people; see section 3.2.1.",
            "{\"input_ids\": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]}",
            "Use snake_case_names_for_variables_and_functions_in_python please",
        ] {
            assert!(scan_line(s).is_empty(), "{s}: {:?}", scan_line(s));
        }
    }
}
