//! A bounded walk over a GGUF's header, metadata and tensor infos, made before candle's reader
//! sees the file (issue 46).
//!
//! candle's `Content::read` checks each length against the bytes left in the file, but holds every
//! array element as a 32-byte `Value`: a 64 MiB file with one `u8` array of 2²⁶ elements became
//! 2.1 GB of memory, a sparse file with a 2³⁰-element array or 1 GiB strings aborted the process,
//! and `general.alignment = 0` divided by zero. [`scan`] reads the same layout without keeping
//! anything (strings and array elements are skipped, not stored) and refuses, naming the key or
//! tensor, anything past [`LIMITS`]: a string's length, an array's element count, the number of
//! entries and tensors, and the memory the parsed metadata would take as candle holds it (counted
//! before candle allocates it). It also refuses what llama.cpp's reader refuses and candle lets
//! through: nested arrays, a duplicated key or tensor name, an alignment that is not a power of
//! two.
//!
//! The layout (GGUF v1–v3, little-endian; v1's lengths and counts are u32, later ones u64): magic
//! `GGUF`, version u32, tensor count, metadata count; each entry a key string, a value type u32
//! and the value (an array: element type u32, count, elements); each tensor info a name string,
//! dimension count u32, the dimensions, the ggml type u32 and the data offset u64.

use candle_core::quantized::gguf_file::{TensorInfo, Value};
use std::collections::HashSet;
use std::fs::File;
use std::io::{BufReader, Read, Seek};
use std::path::Path;

use crate::{GgufError, Result};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

/// What the metadata of a GGUF may hold. Far above any real model's: Gemma 3's 262,144-token
/// vocabulary (tokens, scores, types) takes ~32 MiB as candle holds it, Llama 3's 128,256 tokens
/// and 280,147 merges ~45 MiB, a chat template tens of KB; a model has ~50 keys and at most a few
/// thousand tensors.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Bytes of one string value or array element (tokens, merges, the chat template).
    pub max_string: u64,
    /// Bytes of a key or a tensor name.
    pub max_name: u64,
    /// Elements of one array.
    pub max_array: u64,
    /// Metadata entries, and separately tensors.
    pub max_entries: u64,
    /// Memory the parsed metadata and tensor infos take as candle holds them (a `Value` per
    /// element, its vectors grown by doubling, each string's allocation, the two maps' entries).
    pub max_memory: u64,
}

/// The limits `convert` reads with.
pub const LIMITS: Limits = Limits {
    max_string: 16 * MIB,
    max_name: KIB,
    max_array: 1 << 21,
    max_entries: 1 << 16,
    max_memory: 256 * MIB,
};

/// What the walk found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Scanned {
    pub version: u32,
    pub tensors: u64,
    pub entries: u64,
    /// `general.alignment` (32 when absent).
    pub alignment: u64,
    /// Memory the metadata and tensor infos take once parsed (as counted against
    /// [`Limits::max_memory`]).
    pub memory: u64,
}

// GGUF value types.
const T_STRING: u32 = 8;
const T_ARRAY: u32 = 9;

/// On-disk bytes of a fixed-size value type; `None` for strings, arrays and unknown types.
fn fixed_size(ty: u32) -> Option<u64> {
    Some(match ty {
        0 | 1 | 7 => 1, // u8, i8, bool
        2 | 3 => 2,     // u16, i16
        4..=6 => 4,     // u32, i32, f32
        10..=12 => 8,   // u64, i64, f64
        _ => return None,
    })
}

/// A key or name as printed in an error: lossy UTF-8, control characters escaped, so that a
/// hostile key cannot break the one-line message.
fn printable(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).escape_debug().to_string()
}

/// What the allocator takes for a string of `n` bytes (glibc: the bytes and an 8-byte header in
/// 16-byte steps, 32 at least; nothing for an empty one).
fn heap(n: u64) -> u64 {
    if n == 0 {
        0
    } else {
        (n + 8).next_multiple_of(16).max(32)
    }
}

fn human(bytes: u64) -> String {
    if bytes >= 1 << 30 {
        format!("{:.1} GiB", bytes as f64 / (1u64 << 30) as f64)
    } else if bytes >= MIB {
        format!("{:.1} MiB", bytes as f64 / MIB as f64)
    } else if bytes >= KIB {
        format!("{:.1} KiB", bytes as f64 / KIB as f64)
    } else {
        format!("{bytes} B")
    }
}

/// The reader, the bytes left in the file and the memory counted so far.
struct Walk<'a, R> {
    r: R,
    path: &'a Path,
    left: u64,
    v1: bool,
    limits: &'a Limits,
    memory: u64,
}

/// Where an error is: the file, a metadata key or a tensor.
enum At<'k> {
    File,
    Key(&'k str),
    Tensor(&'k str),
}

impl<R: Read> Walk<'_, R> {
    fn err(&self, at: &At, message: String) -> GgufError {
        let path = self.path.to_path_buf();
        match at {
            At::File => GgufError::File { path, message },
            At::Key(k) => GgufError::Metadata {
                path,
                key: k.to_string(),
                message,
            },
            At::Tensor(n) => GgufError::Tensor {
                path,
                name: n.to_string(),
                message,
            },
        }
    }

    /// Consumes `n` bytes of the file's remaining ones, refusing a length past the end.
    fn take(&mut self, at: &At, n: u64, what: &str) -> Result<()> {
        if n > self.left {
            return Err(self.err(
                at,
                format!(
                    "{what} needs {n} bytes but the file has {} left (truncated or corrupt)",
                    self.left
                ),
            ));
        }
        self.left -= n;
        Ok(())
    }

    fn bytes<const N: usize>(&mut self, at: &At, what: &str) -> Result<[u8; N]> {
        self.take(at, N as u64, what)?;
        let mut b = [0u8; N];
        self.r
            .read_exact(&mut b)
            .map_err(|e| self.err(at, format!("reading {what}: {e}")))?;
        Ok(b)
    }

    fn u32(&mut self, at: &At, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.bytes(at, what)?))
    }

    fn u64(&mut self, at: &At, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.bytes(at, what)?))
    }

    /// A length or count: u32 in v1, u64 after.
    fn len(&mut self, at: &At, what: &str) -> Result<u64> {
        if self.v1 {
            Ok(self.u32(at, what)? as u64)
        } else {
            self.u64(at, what)
        }
    }

    /// Skips `n` bytes already counted by [`Walk::take`], reading them (the reader need not seek).
    fn skip(&mut self, at: &At, n: u64, what: &str) -> Result<()> {
        let got = std::io::copy(&mut (&mut self.r).take(n), &mut std::io::sink())
            .map_err(|e| self.err(at, format!("reading {what}: {e}")))?;
        if got != n {
            return Err(self.err(at, format!("{what}: the file ends early")));
        }
        Ok(())
    }

    /// Counts `bytes` of memory against the cap.
    fn count(&mut self, at: &At, bytes: u64, what: &str) -> Result<()> {
        self.memory = self.memory.saturating_add(bytes);
        if self.memory > self.limits.max_memory {
            return Err(self.err(
                at,
                format!(
                    "{what} brings the parsed metadata to {} in memory, over the {} cap",
                    human(self.memory),
                    human(self.limits.max_memory)
                ),
            ));
        }
        Ok(())
    }

    /// A string's length, checked against `cap` and the file before anything is read.
    fn string_len(&mut self, at: &At, cap: u64, what: &str) -> Result<u64> {
        let n = self.len(at, what)?;
        if n > cap {
            return Err(self.err(
                at,
                format!("{what} of {n} bytes is over the {} cap", human(cap)),
            ));
        }
        self.take(at, n, what)?;
        Ok(n)
    }

    /// A key or tensor name, read (it is short: [`Limits::max_name`]), as candle's reader will
    /// hold it: trailing NULs dropped. It must be UTF-8, as GGUF says: candle decodes names
    /// lossily, so two names differing only in invalid bytes — or in trailing NULs — would become
    /// one key there, past the duplicate check here (the fuzz target's finds).
    fn name(&mut self, at: &At, what: &str) -> Result<Vec<u8>> {
        let n = self.string_len(at, self.limits.max_name, what)?;
        let mut b = vec![0u8; n as usize];
        self.r
            .read_exact(&mut b)
            .map_err(|e| self.err(at, format!("reading {what}: {e}")))?;
        while b.last() == Some(&0) {
            b.pop();
        }
        if std::str::from_utf8(&b).is_err() {
            return Err(self.err(
                at,
                format!("{what} `{}` is not UTF-8 (GGUF names are)", printable(&b)),
            ));
        }
        Ok(b)
    }

    /// One value of type `ty` (not an array), skipped; returns its integer value when it is one
    /// that fits (for `general.alignment`).
    fn scalar(&mut self, at: &At, ty: u32) -> Result<Option<i128>> {
        let value = std::mem::size_of::<Value>() as u64;
        if ty == T_STRING {
            let n = self.string_len(at, self.limits.max_string, "a string")?;
            self.count(at, value + heap(n), "a string")?;
            self.skip(at, n, "a string")?;
            return Ok(None);
        }
        let size =
            fixed_size(ty).ok_or_else(|| self.err(at, format!("unknown value type {ty}")))?;
        self.count(at, value, "a value")?;
        self.take(at, size, "a value")?;
        let mut b = [0u8; 8];
        self.r
            .read_exact(&mut b[..size as usize])
            .map_err(|e| self.err(at, format!("reading a value: {e}")))?;
        let u = u64::from_le_bytes(b);
        Ok(match ty {
            0 | 2 | 4 | 10 => Some(u as i128),
            1 => Some(b[0] as i8 as i128),
            3 => Some(i16::from_le_bytes([b[0], b[1]]) as i128),
            5 => Some(i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as i128),
            11 => Some(u as i64 as i128),
            _ => None,
        })
    }

    /// An array, its count checked against the caps and the file before any element is read.
    fn array(&mut self, at: &At) -> Result<()> {
        let ty = self.u32(at, "an array's element type")?;
        let n = self.len(at, "an array's length")?;
        if ty == T_ARRAY {
            return Err(self.err(at, "an array of arrays (llama.cpp refuses them too)".into()));
        }
        if n > self.limits.max_array {
            return Err(self.err(
                at,
                format!(
                    "an array of {n} elements is over the {}-element cap",
                    self.limits.max_array
                ),
            ));
        }
        // Each element takes at least its fixed size (a string: its length prefix) on disk.
        let min = fixed_size(ty).unwrap_or(if self.v1 { 4 } else { 8 });
        if fixed_size(ty).is_none() && ty != T_STRING {
            return Err(self.err(at, format!("unknown array element type {ty}")));
        }
        if n.saturating_mul(min) > self.left {
            return Err(self.err(
                at,
                format!(
                    "an array of {n} elements needs at least {} bytes but the file has {} left",
                    n.saturating_mul(min),
                    self.left
                ),
            ));
        }
        // candle pushes each element as a `Value` into a vector grown by doubling.
        let value = std::mem::size_of::<Value>() as u64;
        let slots = n.checked_next_power_of_two().unwrap_or(u64::MAX);
        self.count(
            at,
            value.saturating_add(slots.saturating_mul(value)),
            &format!("an array of {n} elements"),
        )?;
        if ty == T_STRING {
            for _ in 0..n {
                let len = self.string_len(at, self.limits.max_string, "an array's string")?;
                self.count(at, heap(len), "an array's string")?;
                self.skip(at, len, "an array's string")?;
            }
        } else {
            let bytes = n * min;
            self.take(at, bytes, "an array")?;
            self.skip(at, bytes, "an array")?;
        }
        Ok(())
    }
}

/// `general.alignment` as candle reads it (u8/u16/u32/i8/i16/i32), refused unless a power of two:
/// 0 divided by zero in candle, and llama.cpp refuses anything else.
fn alignment(v: Option<i128>, ty: u32) -> std::result::Result<u64, String> {
    match (ty, v) {
        (0..=5, Some(a)) if a > 0 && (a as u64).is_power_of_two() => Ok(a as u64),
        (0..=5, Some(a)) => Err(format!("{a} is not a power of two")),
        _ => Err(format!(
            "value type {ty}: expected an unsigned 32-bit integer (a power of two)"
        )),
    }
}

/// Walks the GGUF read by `r` (`size` bytes in all) within `limits`; `path` labels errors.
pub fn scan<R: Read>(r: R, size: u64, path: &Path, limits: &Limits) -> Result<Scanned> {
    let mut w = Walk {
        r,
        path,
        left: size,
        v1: false,
        limits,
        memory: 0,
    };
    let file = At::File;
    // The magic first: a file that is not a GGUF is refused from its first four bytes.
    let magic: [u8; 4] = w.bytes(&file, "the magic").map_err(|_| GgufError::File {
        path: path.to_path_buf(),
        message: format!("not a GGUF file ({size} bytes, shorter than its 4-byte magic)"),
    })?;
    // candle also reads the byte-swapped magic.
    if &magic != b"GGUF" && &magic != b"FUGG" {
        return Err(w.err(
            &file,
            format!(
                "not a GGUF file (it starts with {:?}, not the magic \"GGUF\")",
                printable(&magic)
            ),
        ));
    }
    let version = w.u32(&file, "the version")?;
    if !(1..=3).contains(&version) {
        return Err(w.err(&file, format!("GGUF version {version} (1 to 3 are read)")));
    }
    w.v1 = version == 1;
    let tensors = w.len(&file, "the tensor count")?;
    let entries = w.len(&file, "the metadata count")?;
    for (n, what) in [(tensors, "tensors"), (entries, "metadata entries")] {
        if n > limits.max_entries {
            return Err(w.err(
                &file,
                format!("{n} {what}, over the cap of {}", limits.max_entries),
            ));
        }
    }
    let value = std::mem::size_of::<Value>() as u64;
    let string = std::mem::size_of::<String>() as u64;
    let mut keys = HashSet::new();
    let mut align = 32;
    for i in 0..entries {
        let key = w.name(&file, &format!("the key of metadata entry {i}"))?;
        let key_text = printable(&key);
        let at = At::Key(&key_text);
        if !keys.insert(key.clone()) {
            return Err(w.err(
                &at,
                "appears twice (llama.cpp refuses duplicated keys)".into(),
            ));
        }
        // The key's string and its map entry.
        w.count(&at, string + value + 16 + heap(key.len() as u64), "the key")?;
        let ty = w.u32(&at, "the value type")?;
        let v = if ty == T_ARRAY {
            w.array(&at)?;
            None
        } else {
            w.scalar(&at, ty)?
        };
        if key == b"general.alignment" {
            align = alignment(v, ty).map_err(|m| w.err(&at, m))?;
        }
    }
    let mut names = HashSet::new();
    for i in 0..tensors {
        let name = w.name(&file, &format!("the name of tensor {i}"))?;
        let name_text = printable(&name);
        let at = At::Tensor(&name_text);
        if !names.insert(name.clone()) {
            return Err(w.err(
                &at,
                "appears twice (llama.cpp refuses duplicated tensors)".into(),
            ));
        }
        let dims = w.u32(&at, "the dimension count")?;
        if dims > 4 {
            return Err(w.err(&at, format!("{dims} dimensions (ggml has at most 4)")));
        }
        let mut elements: u64 = 1;
        for _ in 0..dims {
            let d = w.len(&at, "a dimension")?;
            elements = elements
                .checked_mul(d)
                .filter(|&e| e <= i64::MAX as u64)
                .ok_or_else(|| w.err(&at, "its element count overflows".into()))?;
        }
        w.u32(&at, "the ggml type")?;
        w.u64(&at, "the data offset")?;
        let info = std::mem::size_of::<TensorInfo>() as u64;
        w.count(
            &at,
            string + heap(name.len() as u64) + info + heap(8 * dims as u64) + 16,
            "the tensor's entry",
        )?;
    }
    Ok(Scanned {
        version,
        tensors,
        entries,
        alignment: align,
        memory: w.memory,
    })
}

/// Opens the GGUF at `path` (a regular file: a FIFO or a device is refused without blocking or
/// reading) and [`scan`]s it within [`LIMITS`]; the file comes back positioned at its start. Every
/// error is the input's (exit status 2) and names the file.
pub fn open(path: &Path) -> Result<(File, Scanned)> {
    let kind = rtune_fsio::FileKind::Sized {
        cap: u64::MAX,
        name: "GGUF model",
    };
    let bad = |message: String| GgufError::File {
        path: path.to_path_buf(),
        message,
    };
    let mut f = rtune_fsio::open_regular(path, kind).map_err(|e| match e {
        rtune_fsio::ReadError::Io(e) => bad(format!("cannot open: {e}")),
        other => bad(other.to_string()),
    })?;
    let size = f
        .metadata()
        .map_err(|e| bad(format!("cannot stat: {e}")))?
        .len();
    let scanned = scan(BufReader::new(&f), size, path, &LIMITS)?;
    f.rewind().map_err(|e| bad(format!("cannot seek: {e}")))?;
    Ok((f, scanned))
}
