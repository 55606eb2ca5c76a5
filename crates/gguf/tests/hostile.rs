//! Hostile and broken GGUF files (issue 46): metadata that would take gigabytes as candle parses
//! it, an alignment of 0, tensors without dimensions or with shapes the metadata contradicts, no
//! tensors at all, and Gemma 3 vocabularies whose merges grow cubically. Each is refused as the
//! input's error, naming the file and the key or tensor; none panics or allocates past the caps.

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::GgmlDType;
use candle_core::Device;
use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use rtune_gguf::scan::{scan, Limits, LIMITS};
use rtune_gguf::GgufError;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-llama")
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("rtune-gguf-hostile-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A GGUF v3 written byte by byte, for layouts candle's writer cannot make (sizes it would have to
/// hold in memory, sparse data).
#[derive(Default)]
struct Raw {
    kvs: Vec<u8>,
    n_kv: u64,
    tensors: Vec<u8>,
    n_tensors: u64,
}

fn string(b: &[u8]) -> Vec<u8> {
    let mut v = (b.len() as u64).to_le_bytes().to_vec();
    v.extend_from_slice(b);
    v
}

impl Raw {
    fn kv(mut self, key: &str, ty: u32, payload: &[u8]) -> Self {
        self.kvs.extend(string(key.as_bytes()));
        self.kvs.extend(ty.to_le_bytes());
        self.kvs.extend_from_slice(payload);
        self.n_kv += 1;
        self
    }
    fn u32(self, key: &str, v: u32) -> Self {
        self.kv(key, 4, &v.to_le_bytes())
    }
    fn f32(self, key: &str, v: f32) -> Self {
        self.kv(key, 6, &v.to_le_bytes())
    }
    fn str(self, key: &str, v: &str) -> Self {
        self.kv(key, 8, &string(v.as_bytes()))
    }
    /// An array header: element type and count (the elements follow in `tail`).
    fn array_head(self, key: &str, elem: u32, n: u64) -> Self {
        let mut p = elem.to_le_bytes().to_vec();
        p.extend(n.to_le_bytes());
        self.kv(key, 9, &p)
    }
    fn strings(self, key: &str, items: &[String]) -> Self {
        let mut p = 8u32.to_le_bytes().to_vec();
        p.extend((items.len() as u64).to_le_bytes());
        for s in items {
            p.extend(string(s.as_bytes()));
        }
        self.kv(key, 9, &p)
    }
    fn tensor(mut self, name: &str, dims: &[u64], ty: u32, offset: u64) -> Self {
        self.tensors.extend(string(name.as_bytes()));
        self.tensors.extend((dims.len() as u32).to_le_bytes());
        for d in dims {
            self.tensors.extend(d.to_le_bytes());
        }
        self.tensors.extend(ty.to_le_bytes());
        self.tensors.extend(offset.to_le_bytes());
        self.n_tensors += 1;
        self
    }
    fn bytes(&self) -> Vec<u8> {
        let mut v = b"GGUF".to_vec();
        v.extend(3u32.to_le_bytes());
        v.extend(self.n_tensors.to_le_bytes());
        v.extend(self.n_kv.to_le_bytes());
        v.extend_from_slice(&self.kvs);
        v.extend_from_slice(&self.tensors);
        v
    }
    /// Writes the file, then `tail` zero bytes (sparse: no disk).
    fn write(&self, path: &Path, tail: u64) {
        let mut f = std::fs::File::create(path).unwrap();
        let b = self.bytes();
        f.write_all(&b).unwrap();
        f.set_len(b.len() as u64 + tail).unwrap();
    }
}

fn scan_bytes(b: &[u8], limits: &Limits) -> Result<rtune_gguf::scan::Scanned, GgufError> {
    scan(b, b.len() as u64, Path::new("m.gguf"), limits)
}

fn convert_err(d: &Path, gguf: &Path) -> String {
    let e = rtune_gguf::convert(gguf, &d.join("hf")).unwrap_err();
    assert!(e.is_input_error(), "{e}");
    assert!(!d.join("hf").exists());
    let e = e.to_string();
    assert_eq!(e.lines().count(), 1, "{e}");
    e
}

/// The 64 MiB file with one u8 array of 2²⁶ elements: 2.1 GB as candle holds it. Refused
/// from the array's header, naming the key, before any element is read.
#[test]
fn a_huge_metadata_array_is_refused_before_it_is_read() {
    let d = tmp("array");
    let gguf = d.join("m.gguf");
    Raw::default()
        .array_head("x.big", 0, 1 << 26)
        .write(&gguf, 1 << 26);
    let e = convert_err(&d, &gguf);
    assert!(
        e.contains("metadata `x.big`") && e.contains("67108864 elements"),
        "{e}"
    );
    // Sparse, 2³⁰ elements (candle's own cap): an abort before.
    Raw::default()
        .array_head("x.huge", 0, 1 << 30)
        .write(&gguf, 1 << 30);
    let e = convert_err(&d, &gguf);
    assert!(e.contains("metadata `x.huge`"), "{e}");
    std::fs::remove_dir_all(&d).unwrap();
}

/// Eight sparse strings of 1 GiB each: each is over the string cap, refused at its length.
#[test]
fn a_huge_metadata_string_is_refused_at_its_length() {
    let d = tmp("string");
    let gguf = d.join("m.gguf");
    let mut raw = Raw::default();
    for i in 0..8 {
        raw = raw.kv(&format!("k{i}"), 8, &(1u64 << 30).to_le_bytes());
    }
    raw.write(&gguf, 8 << 30);
    let e = convert_err(&d, &gguf);
    assert!(
        e.contains("metadata `k0`") && e.contains("16.0 MiB cap"),
        "{e}"
    );
    std::fs::remove_dir_all(&d).unwrap();
}

/// The caps one by one, on bytes: string length, array length, entries, the memory total (many
/// arrays each under the array cap), nested arrays, duplicated keys and tensors, a truncated file.
#[test]
fn each_cap_is_checked_before_allocating() {
    let small = Limits {
        max_string: 16,
        max_name: 8,
        max_array: 100,
        max_entries: 4,
        max_memory: 8 << 10,
    };
    let ok = Raw::default().str("a", "0123456789abcdef").bytes();
    assert_eq!(scan_bytes(&ok, &small).unwrap().entries, 1);
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (
            Raw::default().str("a", "0123456789abcdefg").bytes(),
            "16 B cap",
        ),
        (
            Raw::default().str("long.key.", "").bytes(),
            "the key of metadata entry 0",
        ),
        (
            Raw::default().array_head("a", 0, 101).bytes(),
            "101 elements is over the 100-element cap",
        ),
        (
            (0..5)
                .fold(Raw::default(), |r, i| r.u32(&format!("k{i}"), 1))
                .bytes(),
            "5 metadata entries",
        ),
        (
            (0..3)
                .fold(Raw::default(), |r, i| {
                    let mut r = r.array_head(&format!("k{i}"), 0, 100);
                    r.kvs.extend([0u8; 100]);
                    r
                })
                .bytes(),
            "over the 8.0 KiB cap",
        ),
        (
            Raw::default().array_head("a", 9, 1).bytes(),
            "an array of arrays",
        ),
        (
            Raw::default().u32("a", 1).u32("a", 2).bytes(),
            "appears twice",
        ),
        (
            Raw::default()
                .tensor("t", &[1], 0, 0)
                .tensor("t", &[1], 0, 0)
                .bytes(),
            "tensor `t`: appears twice",
        ),
        (
            Raw::default().tensor("t", &[1, 1, 1, 1, 1], 0, 0).bytes(),
            "5 dimensions",
        ),
        (
            Raw::default()
                .tensor("t", &[1 << 40, 1 << 40], 0, 0)
                .bytes(),
            "overflows",
        ),
        (
            Raw::default().array_head("a", 4, 3).bytes(),
            "file has 0 left",
        ),
        (b"GGUF\x04\0\0\0".to_vec(), "GGUF version 4"),
        (b"PK\x03\x04 zip".to_vec(), "not a GGUF file"),
        (b"GG".to_vec(), "not a GGUF file"),
    ];
    for (bytes, want) in cases {
        let e = scan_bytes(&bytes, &small).unwrap_err().to_string();
        assert!(e.contains(want), "want {want:?}: {e}");
        assert_eq!(e.lines().count(), 1, "{e}");
    }
    // Names must be UTF-8: candle decodes them lossily, so these two keys (distinct bytes) were
    // one key there, past the duplicate check (the fuzz target's find).
    let mut two = Raw::default().u32("x", 1).u32("x", 1);
    let at = two.kvs.len() - 9; // the second key's byte: 8-byte length, key, type, value
    two.kvs[at] = 0xff;
    two.kvs[8] = 0xfe; // the first key's
    let e = scan_bytes(&two.bytes(), &LIMITS).unwrap_err().to_string();
    assert!(e.contains("not UTF-8") && e.lines().count() == 1, "{e}");
    // Nor may they differ only in trailing NULs, which candle drops: `x` and `x\0` are one key.
    let e = scan_bytes(&Raw::default().u32("x", 1).u32("x\0", 1).bytes(), &LIMITS)
        .unwrap_err()
        .to_string();
    assert!(e.contains("appears twice"), "{e}");
    // A hostile key prints on one line.
    let e = scan_bytes(
        &Raw::default().u32("a\nb", 1).u32("a\nb", 1).bytes(),
        &LIMITS,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("`a\\nb`") && e.lines().count() == 1, "{e}");
}

/// `general.alignment = 0` divided by zero in candle's reader (exit 101); 3 or -32 are not powers
/// of two either. 64 is read.
#[test]
fn an_alignment_that_is_not_a_power_of_two_is_refused() {
    for (v, ty) in [(0u32, 4u32), (3, 4), ((-32i32) as u32, 5)] {
        let b = Raw::default()
            .kv("general.alignment", ty, &v.to_le_bytes())
            .bytes();
        let e = scan_bytes(&b, &LIMITS).unwrap_err().to_string();
        assert!(
            e.contains("metadata `general.alignment`") && e.contains("power of two"),
            "{e}"
        );
    }
    let b = Raw::default().u32("general.alignment", 64).bytes();
    assert_eq!(scan_bytes(&b, &LIMITS).unwrap().alignment, 64);
    // Through convert: an error, not a panic.
    let d = tmp("align");
    let gguf = d.join("m.gguf");
    let mut f = std::fs::File::create(&gguf).unwrap();
    let md = [
        ("general.architecture", Value::String("llama".into())),
        ("general.alignment", Value::U32(0)),
    ];
    let refs: Vec<(&str, &Value)> = md.iter().map(|(k, v)| (*k, v)).collect();
    gguf_file::write(&mut f, &refs, &[]).unwrap();
    drop(f);
    let e = convert_err(&d, &gguf);
    assert!(e.contains("general.alignment"), "{e}");
    std::fs::remove_dir_all(&d).unwrap();
}

/// A tensor to write: its name, shape (Hugging Face order), ggml type and data.
struct T {
    name: String,
    shape: Vec<usize>,
    ty: GgmlDType,
    data: Vec<u8>,
}

/// A metadata value's type and bytes (the types the fixture's GGUF holds).
fn value(v: &Value) -> (u32, Vec<u8>) {
    match v {
        Value::U32(x) => (4, x.to_le_bytes().to_vec()),
        Value::I32(x) => (5, x.to_le_bytes().to_vec()),
        Value::F32(x) => (6, x.to_le_bytes().to_vec()),
        Value::Bool(x) => (7, vec![*x as u8]),
        Value::String(x) => (8, string(x.as_bytes())),
        Value::U64(x) => (10, x.to_le_bytes().to_vec()),
        Value::Array(a) => {
            let ty = a.first().map_or(4, |e| value(e).0);
            let mut b = ty.to_le_bytes().to_vec();
            b.extend((a.len() as u64).to_le_bytes());
            for e in a {
                b.extend(value(e).1);
            }
            (9, b)
        }
        other => panic!("no writer for {other:?}"),
    }
}

/// The fixture as an f32 llama GGUF, rewritten with `edit` applied to its tensors (any shape,
/// even none: candle's writer cannot write a scalar).
fn rewritten(d: &Path, edit: impl FnOnce(&mut Vec<T>)) -> PathBuf {
    let src = d.join("tiny.gguf");
    rtune_gguf::write_llama_gguf(&fixture(), &src, GgmlDType::F32).unwrap();
    let mut f = std::fs::File::open(&src).unwrap();
    let c = gguf_file::Content::read(&mut f).unwrap();
    let mut names: Vec<&String> = c.tensor_infos.keys().collect();
    names.sort();
    let mut tensors: Vec<T> = names
        .into_iter()
        .map(|n| {
            let q = c.tensor(&mut f, n, &Device::Cpu).unwrap();
            T {
                name: n.clone(),
                shape: q.shape().dims().to_vec(),
                ty: q.dtype(),
                data: q.data().unwrap().into_owned(),
            }
        })
        .collect();
    edit(&mut tensors);
    let md: HashMap<String, Value> = c.metadata;
    let mut raw = Raw::default();
    for (k, v) in &md {
        let (ty, b) = value(v);
        raw = raw.kv(k, ty, &b);
    }
    let mut offset = 0u64;
    let mut data = Vec::new();
    for t in &tensors {
        let dims: Vec<u64> = t.shape.iter().rev().map(|&d| d as u64).collect();
        let ty = match t.ty {
            GgmlDType::F32 => 0,
            other => panic!("{other:?}"),
        };
        raw = raw.tensor(&t.name, &dims, ty, offset);
        data.extend_from_slice(&t.data);
        data.resize(data.len().next_multiple_of(32), 0);
        offset = data.len() as u64;
    }
    let mut bytes = raw.bytes();
    bytes.resize(bytes.len().next_multiple_of(32), 0);
    bytes.extend(data);
    let out = d.join("edited.gguf");
    std::fs::write(&out, bytes).unwrap();
    out
}

fn qt(name: &str, shape: &[usize]) -> T {
    let n: usize = shape.iter().product();
    T {
        name: name.into(),
        shape: shape.to_vec(),
        ty: GgmlDType::F32,
        data: vec![0; 4 * n],
    }
}

fn replace(tensors: &mut [T], t: T) {
    let slot = tensors.iter_mut().find(|s| s.name == t.name).unwrap();
    *slot = t;
}

/// Structurally broken files converted with exit 0 (or panicked): no tensors, a q projection with
/// no dimensions (index out of bounds in plan), a shape the metadata contradicts, a missing layer
/// tensor. Each is refused naming the tensor, nothing written.
#[test]
fn structurally_broken_llama_files_are_refused() {
    let d = tmp("broken");
    // Unedited, it converts (the writer above is faithful).
    let gguf = rewritten(&d, |_| {});
    rtune_gguf::convert(&gguf, &d.join("ok")).unwrap();
    type Edit = Box<dyn FnOnce(&mut Vec<T>)>;
    let cases: Vec<(Edit, &str)> = vec![
        (Box::new(|t| t.clear()), "holds no tensors"),
        (
            Box::new(|t| replace(t, qt("blk.0.attn_q.weight", &[]))),
            "tensor `blk.0.attn_q.weight`: shape []: a model's tensor has at least one",
        ),
        (
            Box::new(|t| replace(t, qt("blk.1.attn_k.weight", &[0, 64]))),
            "tensor `blk.1.attn_k.weight`: shape [0, 64]: a model's tensor",
        ),
        (
            Box::new(|t| replace(t, qt("blk.0.ffn_up.weight", &[80, 64]))),
            "tensor `blk.0.ffn_up.weight`: shape [80, 64], but the metadata",
        ),
        (
            Box::new(|t| replace(t, qt("token_embd.weight", &[512, 32]))),
            "tensor `token_embd.weight`: shape [512, 32]",
        ),
        (
            Box::new(|t| t.retain(|t| t.name != "blk.1.ffn_down.weight")),
            "tensor `blk.1.ffn_down.weight`: missing",
        ),
        (
            Box::new(|t| t.push(qt("blk.7.ffn_norm.weight", &[64]))),
            "tensor `blk.7.ffn_norm.weight`: layer 7",
        ),
    ];
    for (edit, want) in cases {
        let gguf = rewritten(&d, edit);
        let e = convert_err(&d, &gguf);
        assert!(e.contains(want), "want {want:?}: {e}");
        assert!(e.contains("edited.gguf"), "{e}");
    }
    std::fs::remove_dir_all(&d).unwrap();
}

/// Tensor data past the end of the file is refused before anything is written (candle found it
/// only when the tensor was read, half-way through the output).
#[test]
fn tensor_data_past_the_end_is_refused_before_writing() {
    let d = tmp("past-end");
    let gguf = rewritten(&d, |_| {});
    let len = std::fs::metadata(&gguf).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&gguf)
        .unwrap()
        .set_len(len - 1024)
        .unwrap();
    let e = convert_err(&d, &gguf);
    assert!(e.contains("run past the end of the file"), "{e}");
    std::fs::remove_dir_all(&d).unwrap();
}

/// A Gemma 3 GGUF's metadata with `tokens` as its SentencePiece vocabulary, no tensors (the tests
/// call the vocabulary builder on it).
fn gemma_vocab_file(path: &Path, tokens: &[String]) {
    Raw::default()
        .str("general.architecture", "gemma3")
        .u32("gemma3.embedding_length", 64)
        .u32("gemma3.block_count", 1)
        .u32("gemma3.feed_forward_length", 128)
        .u32("gemma3.attention.head_count", 4)
        .f32("gemma3.attention.layer_norm_rms_epsilon", 1e-6)
        .str("tokenizer.ggml.model", "llama")
        .strings("tokenizer.ggml.tokens", tokens)
        .write(path, 0);
}

/// Gemma 3's merges rebuilt from `a` … `a`×1500 hold 1.1 GB of text (an abort at 4.9 GB before):
/// refused at the cap, naming the tokens key, quickly.
#[test]
fn a_vocabulary_whose_merges_explode_is_refused() {
    let d = tmp("cubic");
    let gguf = d.join("m.gguf");
    let tokens: Vec<String> = ["<pad>", "<eos>", "<bos>", "<unk>"]
        .iter()
        .map(|s| s.to_string())
        .chain((1..=1500).map(|k| "a".repeat(k)))
        .collect();
    gemma_vocab_file(&gguf, &tokens);
    let meta_only = rtune_gguf::convert(&gguf, &d.join("hf"))
        .unwrap_err()
        .to_string();
    // No tensors: refused at the plan, before the vocabulary (cheap first).
    assert!(meta_only.contains("holds no tensors"), "{meta_only}");
    let c = gguf_file::Content::read(&mut std::fs::File::open(&gguf).unwrap()).unwrap();
    let m = rtune_gguf::meta::Meta {
        path: &gguf,
        md: &c.metadata,
    };
    let t0 = std::time::Instant::now();
    let e = rtune_gguf::vocab::tokenizer_files(&m, rtune_gguf::names::Family::Gemma3, None)
        .err()
        .expect("refused")
        .to_string();
    assert!(
        e.contains("metadata `tokenizer.ggml.tokens`") && e.contains("64 MiB"),
        "{e}"
    );
    assert!(t0.elapsed().as_secs() < 30, "{:?}", t0.elapsed());
    std::fs::remove_dir_all(&d).unwrap();
}

/// One 2 M-character token: the merges are looked up in linear time (over 150 s before).
#[test]
fn a_two_million_character_token_converts_in_linear_time() {
    let d = tmp("long");
    let gguf = d.join("m.gguf");
    let tokens: Vec<String> = ["<pad>", "<eos>", "<bos>", "<unk>", "a", "b"]
        .iter()
        .map(|s| s.to_string())
        .chain(["ab".repeat(1_000_000)])
        .collect();
    gemma_vocab_file(&gguf, &tokens);
    let c = gguf_file::Content::read(&mut std::fs::File::open(&gguf).unwrap()).unwrap();
    let m = rtune_gguf::meta::Meta {
        path: &gguf,
        md: &c.metadata,
    };
    let t0 = std::time::Instant::now();
    let f =
        rtune_gguf::vocab::tokenizer_files(&m, rtune_gguf::names::Family::Gemma3, None).unwrap();
    assert!(t0.elapsed().as_secs() < 30, "{:?}", t0.elapsed());
    let merges = f.tokenizer["model"]["merges"].as_array().unwrap();
    assert_eq!(merges.len(), 0, "{merges:?}");
    std::fs::remove_dir_all(&d).unwrap();
}

/// A Gemma 3 GGUF of 3.6 KB declaring 2³¹ + 1 layers (the fuzz target's find, kept as its seed)
/// spelled out a `layer_types` entry per layer: 20 s and gigabytes before dying. A block count
/// outside 1 ..= 4096 is refused, naming the key.
#[test]
fn a_hostile_block_count_is_refused() {
    let d = tmp("blocks");
    let seed = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fuzz/seeds/gguf_metadata/regression-block-count-2pow31");
    let gguf = d.join("m.gguf");
    std::fs::copy(&seed, &gguf).unwrap();
    let t0 = std::time::Instant::now();
    let e = convert_err(&d, &gguf);
    assert!(
        e.contains("gemma3.block_count") && e.contains("2147483649 layers"),
        "{e}"
    );
    assert!(t0.elapsed().as_secs() < 5, "{:?}", t0.elapsed());
    std::fs::remove_dir_all(&d).unwrap();
}
