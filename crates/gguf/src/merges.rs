//! Gemma's BPE merges rebuilt from a SentencePiece vocabulary (transformers' `generate_merges`, see
//! [`crate::vocab`]) in time linear in the vocabulary's bytes plus the merges written, and refused
//! past [`CAPS`] (issue 46).
//!
//! The direct reading — every cut of every token, each half looked up by hashing it — is quadratic
//! in a token's length (one 2 M-character token: over 150 s) and writes every merge of a token of
//! `a`s (`a` … `a`×1500: 1.1 M merges holding 1.1 GB of text, an abort at 4.9 GB). Here each
//! half's presence is read from rolling hashes: a token's prefix hashes left to right, each
//! suffix's from the whole token's hash and the prefix's (a polynomial hash over the bytes modulo
//! the prime 2⁶¹ − 1, its base drawn at random per process so that a file cannot be made of
//! collisions). A hash hit is confirmed by comparing the strings, so the result is exact; a
//! comparison costs what the merge it confirms writes.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};

/// The most a vocabulary's rebuilt merges may hold. Gemma 3's 262,144-token vocabulary gives
/// under a million merges of a few MiB of text (its converted tokenizer.json is 33 MB). Inside every
/// cap, a 1.9 M-token vocabulary rebuilding 3.8 M merges converted at a peak RSS of 3.7 GB.
#[derive(Debug, Clone, Copy)]
pub struct Caps {
    pub max_merges: usize,
    /// Bytes of the merges' text (a merge of a token holds the token's bytes).
    pub max_bytes: usize,
}

pub const CAPS: Caps = Caps {
    max_merges: 1 << 22,
    max_bytes: 64 << 20,
};

const P: u64 = (1 << 61) - 1;

fn mul(a: u64, b: u64) -> u64 {
    let x = a as u128 * b as u128;
    // x mod 2⁶¹ − 1 without a division: fold the high bits onto the low ones.
    let folded = (x & P as u128) + (x >> 61);
    let r = (folded & P as u128) as u64 + (folded >> 61) as u64;
    if r >= P {
        r - P
    } else {
        r
    }
}

fn add(a: u64, b: u64) -> u64 {
    let r = a + b;
    if r >= P {
        r - P
    } else {
        r
    }
}

fn sub(a: u64, b: u64) -> u64 {
    if a >= b {
        a - b
    } else {
        a + P - b
    }
}

fn pow(mut b: u64, mut e: u64) -> u64 {
    let mut r = 1;
    while e > 0 {
        if e & 1 == 1 {
            r = mul(r, b);
        }
        b = mul(b, b);
        e >>= 1;
    }
    r
}

/// `Σ s[i]·Bⁱ mod P` with the bytes shifted by one (so that a zero byte counts), and its base.
struct Hash {
    base: u64,
    inv: u64,
}

impl Hash {
    fn random() -> Hash {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(0x9e37_79b9_7f4a_7c15);
        let base = 256 + h.finish() % (P - 512);
        Hash {
            base,
            // Fermat: B^(P−2) = B⁻¹ (P is prime).
            inv: pow(base, P - 2),
        }
    }

    fn of(&self, s: &[u8]) -> u64 {
        let (mut h, mut pw) = (0, 1);
        for &c in s {
            h = add(h, mul(c as u64 + 1, pw));
            pw = mul(pw, self.base);
        }
        h
    }
}

/// The vocabulary by (hash, byte length) → one token with them.
struct Index<'a> {
    hash: Hash,
    by_hash: HashMap<(u64, usize), &'a str>,
    vocab: &'a HashMap<&'a str, usize>,
}

impl<'a> Index<'a> {
    fn new(vocab: &'a HashMap<&'a str, usize>) -> Self {
        let hash = Hash::random();
        let by_hash = vocab
            .keys()
            .map(|&t| ((hash.of(t.as_bytes()), t.len()), t))
            .collect();
        Index {
            hash,
            by_hash,
            vocab,
        }
    }

    /// Whether `s` (whose hash is `h`) is in the vocabulary, exactly: a miss on the hash is a
    /// miss, a hit is confirmed (a collision falls back to the vocabulary's own lookup).
    fn has(&self, s: &str, h: u64) -> bool {
        match self.by_hash.get(&(h, s.len())) {
            None => false,
            Some(&t) => t == s || self.vocab.contains_key(s),
        }
    }

    fn probably_has(&self, len: usize, h: u64) -> bool {
        self.by_hash.contains_key(&(h, len))
    }
}

/// For each token of `order` in turn, its splits `token = l + r` at a character with both halves
/// in `vocab`, `l` longest first (transformers' `generate_merges` order); refused with the reason
/// past `caps`.
pub fn rebuild<'a>(
    order: &[&'a str],
    vocab: &'a HashMap<&'a str, usize>,
    caps: Caps,
) -> Result<Vec<(&'a str, &'a str)>, String> {
    let index = Index::new(vocab);
    let (base, inv) = (index.hash.base, index.hash.inv);
    let mut merges = Vec::new();
    let mut bytes = 0usize;
    let mut cuts = Vec::new();
    for &t in order {
        let b = t.as_bytes();
        let whole = index.hash.of(b);
        // Left to right: the prefix's hash, Bⁱ and B⁻ⁱ; the suffix t[i..] hashes to
        // (whole − prefix)·B⁻ⁱ.
        let (mut prefix, mut pw, mut ipw) = (0u64, 1u64, 1u64);
        cuts.clear();
        for (i, &c) in b.iter().enumerate() {
            if i > 0 && t.is_char_boundary(i) {
                let suffix = mul(sub(whole, prefix), ipw);
                if index.probably_has(i, prefix)
                    && index.probably_has(b.len() - i, suffix)
                    && index.has(&t[..i], prefix)
                    && index.has(&t[i..], suffix)
                {
                    cuts.push(i);
                }
            }
            prefix = add(prefix, mul(c as u64 + 1, pw));
            pw = mul(pw, base);
            ipw = mul(ipw, inv);
        }
        for &i in cuts.iter().rev() {
            merges.push((&t[..i], &t[i..]));
            bytes += t.len();
            if merges.len() > caps.max_merges || bytes > caps.max_bytes {
                let head: String = t.chars().take(40).collect();
                return Err(format!(
                    "the merges rebuilt from this vocabulary pass {} merges or {} MiB of text \
                     (at the token {head:?}…, of {} bytes); no real SentencePiece vocabulary \
                     comes near",
                    caps.max_merges,
                    caps.max_bytes >> 20,
                    t.len()
                ));
            }
        }
    }
    Ok(merges)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The direct reading the rolling hashes replace.
    fn naive<'a>(order: &[&'a str], vocab: &HashMap<&'a str, usize>) -> Vec<(&'a str, &'a str)> {
        let mut out = Vec::new();
        for &t in order {
            let cuts: Vec<usize> = t.char_indices().map(|(b, _)| b).skip(1).collect();
            for &b in cuts.iter().rev() {
                let (l, r) = t.split_at(b);
                if vocab.contains_key(l) && vocab.contains_key(r) {
                    out.push((l, r));
                }
            }
        }
        out
    }

    fn vocab<'a>(tokens: &[&'a str]) -> HashMap<&'a str, usize> {
        tokens.iter().enumerate().map(|(i, &t)| (t, i)).collect()
    }

    #[test]
    fn the_same_merges_as_the_direct_reading() {
        let tokens = [
            "a",
            "b",
            "ab",
            "ba",
            "abab",
            "aba",
            "▁",
            "▁▁",
            "▁▁▁",
            "é",
            "aé",
            "éa",
            "\0",
            "a\0",
            "ü▁",
            "ü",
            "xyz",
            "x",
            "yz",
            "y",
            "z",
            "\u{10348}",
            "\u{10348}a",
        ];
        let v = vocab(&tokens);
        let got = rebuild(&tokens, &v, CAPS).unwrap();
        assert_eq!(got, naive(&tokens, &v));
        assert!(got.len() > 10, "{got:?}");
    }

    #[test]
    fn a_long_token_is_linear() {
        // One 2 M-character token over {a, b}: 2 M cuts, each looked up in O(1).
        let long = "ab".repeat(1_000_000);
        let tokens = ["a", "b", "ab", long.as_str()];
        let v = vocab(&tokens);
        let t0 = std::time::Instant::now();
        let got = rebuild(&tokens, &v, CAPS).unwrap();
        assert_eq!(got, [("a", "b")]);
        // The direct reading took over 150 s; this is well under a second even unoptimised.
        assert!(t0.elapsed().as_secs() < 20, "{:?}", t0.elapsed());
    }

    #[test]
    fn a_vocabulary_of_runs_is_refused_past_the_caps() {
        let runs: Vec<String> = (1..=1500).map(|k| "a".repeat(k)).collect();
        let tokens: Vec<&str> = runs.iter().map(String::as_str).collect();
        let v = vocab(&tokens);
        let e = rebuild(&tokens, &v, CAPS).unwrap_err();
        assert!(e.contains("64 MiB"), "{e}");
        // Under small caps the same rule: counted as written.
        let small = Caps {
            max_merges: 3,
            max_bytes: 1 << 20,
        };
        let e = rebuild(&tokens[..4], &v, small).unwrap_err();
        assert!(e.contains("3 merges"), "{e}");
        assert_eq!(rebuild(&tokens[..3], &v, small).unwrap().len(), 3);
    }
}
