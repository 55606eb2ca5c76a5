//! TensorBoard event files, written by hand from two specs:
//!
//! - TFRecord (tensorflow/core/lib/io/record_writer.cc): each record is
//!   `u64 length | u32 masked_crc32c(length bytes) | data | u32 masked_crc32c(data)`, little-endian,
//!   with `masked(c) = ((c >> 15) | (c << 17)) + 0xa282ead8`.
//! - The `Event` protobuf (tensorflow/core/util/event.proto, summary.proto), of which rtune writes
//!   `wall_time` (1, double), `step` (2, int64), `file_version` (3, string) and `summary` (5), a
//!   `Summary` holding `Value{tag (1, string), simple_value (2, float)}` entries.
//!
//! The first record of a file is `Event{wall_time, file_version: "brain.Event:2"}`, as TensorFlow
//! writes it; TensorBoard finds the files by the `tfevents` in their names.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use rtune_fsio::{IoError, Privacy};

use crate::{Result, WatchError};

/// Where a run keeps its event files: `run_dir/tb/`.
pub const TB_DIR: &str = "tb";
pub const FILE_VERSION: &str = "brain.Event:2";

/// TFRecord's CRC: CRC-32C (Castagnoli), rotated and offset so that a CRC of data that itself holds
/// CRCs is not trivially related to them.
pub fn masked_crc32c(data: &[u8]) -> u32 {
    let c = crc32c::crc32c(data);
    c.rotate_right(15).wrapping_add(0xa282_ead8)
}

fn now_secs() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

fn hostname() -> String {
    let h = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .or_else(|_| std::fs::read_to_string("/etc/hostname"))
        .unwrap_or_default();
    // One path component, no dots that would read as more of the name's fields.
    let h: String = h
        .trim()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect();
    if h.is_empty() {
        "localhost".into()
    } else {
        h
    }
}

// ---- protobuf, the few wire forms used ----

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn key(out: &mut Vec<u8>, field: u32, wire: u8) {
    varint(out, (u64::from(field) << 3) | u64::from(wire));
}

fn len_delimited(out: &mut Vec<u8>, field: u32, bytes: &[u8]) {
    key(out, field, 2);
    varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

/// `Event{wall_time, step, summary{value{tag, simple_value}...}}` (or `file_version` instead).
fn encode_event(
    wall_time: f64,
    step: i64,
    file_version: Option<&str>,
    scalars: &[(&str, f32)],
) -> Vec<u8> {
    let mut e = Vec::new();
    key(&mut e, 1, 1);
    e.extend_from_slice(&wall_time.to_le_bytes());
    if step != 0 {
        key(&mut e, 2, 0);
        varint(&mut e, step as u64); // int64: two's complement, 10 bytes when negative
    }
    if let Some(v) = file_version {
        len_delimited(&mut e, 3, v.as_bytes());
    }
    if !scalars.is_empty() {
        let mut summary = Vec::new();
        for (tag, value) in scalars {
            let mut v = Vec::new();
            len_delimited(&mut v, 1, tag.as_bytes());
            key(&mut v, 2, 5);
            v.extend_from_slice(&value.to_le_bytes());
            len_delimited(&mut summary, 1, &v);
        }
        len_delimited(&mut e, 5, &summary);
    }
    e
}

fn record(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut r = Vec::with_capacity(data.len() + 16);
    r.extend_from_slice(&len);
    r.extend_from_slice(&masked_crc32c(&len).to_le_bytes());
    r.extend_from_slice(data);
    r.extend_from_slice(&masked_crc32c(data).to_le_bytes());
    r
}

/// Appends scalars to one event file. Each record is written whole; [`flush`](Self::flush) hands
/// them to the OS so a TensorBoard watching the directory sees them.
pub struct TbWriter {
    path: PathBuf,
    out: BufWriter<File>,
}

impl TbWriter {
    /// Creates `dir` if needed and a new event file in it.
    pub fn create(dir: &Path, privacy: Privacy) -> Result<Self> {
        privacy.create_dir_all(dir)?;
        let now = now_secs();
        let base = format!("events.out.tfevents.{}.{}", now as u64, hostname());
        // A second writer in the same second (a quick resume) gets its own file.
        let mut path = dir.join(&base);
        let mut n = 1;
        while path.exists() {
            path = dir.join(format!("{base}.{n}"));
            n += 1;
        }
        let file = privacy.create(&path)?;
        let mut w = Self {
            path,
            out: BufWriter::new(file),
        };
        w.write(&encode_event(now, 0, Some(FILE_VERSION), &[]))?;
        w.flush()?;
        Ok(w)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn write(&mut self, data: &[u8]) -> Result<()> {
        let path = &self.path;
        self.out.write_all(&record(data)).map_err(|source| {
            WatchError::Io(IoError {
                path: path.clone(),
                op: "write",
                source,
            })
        })
    }

    /// One scalar (`tag` as TensorBoard shows it, e.g. `train/loss`) at `step`.
    pub fn scalar(&mut self, tag: &str, step: u64, value: f64) -> Result<()> {
        self.scalars(step, &[(tag, value)])
    }

    /// Several scalars of one step in one event.
    pub fn scalars(&mut self, step: u64, values: &[(&str, f64)]) -> Result<()> {
        let v: Vec<(&str, f32)> = values.iter().map(|(t, x)| (*t, *x as f32)).collect();
        self.write(&encode_event(now_secs(), step as i64, None, &v))
    }

    pub fn flush(&mut self) -> Result<()> {
        let path = &self.path;
        self.out.flush().map_err(|source| {
            WatchError::Io(IoError {
                path: path.clone(),
                op: "flush",
                source,
            })
        })
    }
}

impl Drop for TbWriter {
    fn drop(&mut self) {
        let _ = self.out.flush();
    }
}

/// One decoded `Event`.
#[derive(Debug, Clone, PartialEq)]
pub struct TbEvent {
    pub wall_time: f64,
    pub step: i64,
    pub file_version: Option<String>,
    /// `(tag, simple_value)` of each summary value.
    pub scalars: Vec<(String, f32)>,
}

/// Reads an event file back: every record's two CRCs are checked and every Event decoded. A file
/// that ends inside a record is an error (TensorBoard would stop there silently).
pub fn read_events(path: &Path) -> Result<Vec<TbEvent>> {
    let bytes = std::fs::read(path).map_err(|source| IoError {
        path: path.to_path_buf(),
        op: "read",
        source,
    })?;
    let mut events = Vec::new();
    let mut pos = 0usize;
    while pos < bytes.len() {
        let bad = |message: String| WatchError::Record {
            path: path.to_path_buf(),
            offset: pos as u64,
            message,
        };
        let head = bytes
            .get(pos..pos + 12)
            .ok_or_else(|| bad("truncated header".into()))?;
        let len_bytes = &head[..8];
        let len = u64::from_le_bytes(len_bytes.try_into().expect("8 bytes")) as usize;
        let crc = u32::from_le_bytes(head[8..12].try_into().expect("4 bytes"));
        if crc != masked_crc32c(len_bytes) {
            return Err(bad(format!("length CRC {crc:#010x} does not match")));
        }
        let data = bytes
            .get(pos + 12..pos + 12 + len)
            .ok_or_else(|| bad(format!("truncated data ({len} bytes announced)")))?;
        let tail = bytes
            .get(pos + 12 + len..pos + 16 + len)
            .ok_or_else(|| bad("truncated data CRC".into()))?;
        let crc = u32::from_le_bytes(tail.try_into().expect("4 bytes"));
        if crc != masked_crc32c(data) {
            return Err(bad(format!("data CRC {crc:#010x} does not match")));
        }
        events.push(decode_event(data).map_err(bad)?);
        pos += 16 + len;
    }
    Ok(events)
}

/// A protobuf field: number and value (varint, fixed 64/32 bits, or bytes).
enum Field<'a> {
    Varint(u64),
    Fixed64([u8; 8]),
    Fixed32([u8; 4]),
    Bytes(&'a [u8]),
}

struct Fields<'a> {
    buf: &'a [u8],
}

fn read_varint(buf: &mut &[u8]) -> std::result::Result<u64, String> {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let (&b, rest) = buf.split_first().ok_or("truncated varint")?;
        *buf = rest;
        v |= u64::from(b & 0x7f) << shift;
        if b & 0x80 == 0 {
            return Ok(v);
        }
    }
    Err("varint longer than 10 bytes".into())
}

fn read_bytes<'a>(buf: &mut &'a [u8], n: usize) -> std::result::Result<&'a [u8], String> {
    if buf.len() < n {
        return Err(format!("field of {n} bytes truncated"));
    }
    let (v, rest) = buf.split_at(n);
    *buf = rest;
    Ok(v)
}

impl<'a> Iterator for Fields<'a> {
    type Item = std::result::Result<(u64, Field<'a>), String>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.buf.is_empty() {
            return None;
        }
        let mut take = || -> std::result::Result<(u64, Field<'a>), String> {
            let buf = &mut self.buf;
            let k = read_varint(buf)?;
            let field = match k & 7 {
                0 => Field::Varint(read_varint(buf)?),
                1 => Field::Fixed64(read_bytes(buf, 8)?.try_into().expect("8 bytes")),
                5 => Field::Fixed32(read_bytes(buf, 4)?.try_into().expect("4 bytes")),
                2 => {
                    let n = read_varint(buf)? as usize;
                    Field::Bytes(read_bytes(buf, n)?)
                }
                w => return Err(format!("field {}: unsupported wire type {w}", k >> 3)),
            };
            Ok((k >> 3, field))
        };
        let r = take();
        if r.is_err() {
            self.buf = &[];
        }
        Some(r)
    }
}

fn fields(buf: &[u8]) -> Fields<'_> {
    Fields { buf }
}

fn utf8(b: &[u8]) -> std::result::Result<String, String> {
    String::from_utf8(b.to_vec()).map_err(|e| format!("string field: {e}"))
}

fn decode_event(data: &[u8]) -> std::result::Result<TbEvent, String> {
    let mut ev = TbEvent {
        wall_time: 0.0,
        step: 0,
        file_version: None,
        scalars: Vec::new(),
    };
    for f in fields(data) {
        match f? {
            (1, Field::Fixed64(b)) => ev.wall_time = f64::from_le_bytes(b),
            (2, Field::Varint(v)) => ev.step = v as i64,
            (3, Field::Bytes(b)) => ev.file_version = Some(utf8(b)?),
            (5, Field::Bytes(summary)) => {
                for v in fields(summary) {
                    let (1, Field::Bytes(value)) = v? else {
                        continue;
                    };
                    let (mut tag, mut x) = (None, None);
                    for f in fields(value) {
                        match f? {
                            (1, Field::Bytes(b)) => tag = Some(utf8(b)?),
                            (2, Field::Fixed32(b)) => x = Some(f32::from_le_bytes(b)),
                            _ => {}
                        }
                    }
                    match (tag, x) {
                        (Some(t), Some(x)) => ev.scalars.push((t, x)),
                        (t, _) => {
                            return Err(format!("summary value {t:?} without a simple_value"))
                        }
                    }
                }
            }
            _ => {} // other Event fields (log_message, session_log, ...) are not rtune's
        }
    }
    Ok(ev)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmpdir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("rtune-watch-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    #[allow(clippy::manual_rotate)] // the spec's formula, written out
    fn crc32c_check_value_and_mask() {
        // CRC-32C check value (RFC 3720 B.4 / the CRC catalogue): "123456789" -> 0xE3069283.
        assert_eq!(crc32c::crc32c(b"123456789"), 0xE306_9283);
        // TensorFlow's crc32c.h Mask: ((c >> 15) | (c << 17)) + 0xa282ead8, by hand.
        let c = 0xE306_9283u32;
        let masked = ((c >> 15) | (c << 17)).wrapping_add(0xa282_ead8);
        assert_eq!(masked_crc32c(b"123456789"), masked);
    }

    #[test]
    fn scalars_round_trip_with_both_crcs_checked() {
        let dir = tmpdir("rt");
        let mut w = TbWriter::create(&dir, Privacy::PRIVATE).unwrap();
        let points = [(1u64, 6.25f64), (2, 5.5), (300, 0.125), (1 << 40, -1.5)];
        for (s, v) in points {
            w.scalar("train/loss", s, v).unwrap();
        }
        w.scalars(7, &[("train/lr", 1e-3), ("train/grad_norm", 0.5)])
            .unwrap();
        w.flush().unwrap();
        let path = w.path().to_path_buf();
        drop(w);
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        assert!(name.starts_with("events.out.tfevents."), "{name}");

        let ev = read_events(&path).unwrap();
        assert_eq!(ev.len(), 6);
        assert_eq!(ev[0].file_version.as_deref(), Some(FILE_VERSION));
        assert!(ev[0].wall_time > 1.6e9);
        for (e, (s, v)) in ev[1..5].iter().zip(points) {
            assert_eq!(e.step, s as i64);
            assert_eq!(e.scalars, vec![("train/loss".to_string(), v as f32)]);
        }
        assert_eq!(
            ev[5].scalars,
            vec![
                ("train/lr".to_string(), 1e-3f32),
                ("train/grad_norm".to_string(), 0.5)
            ]
        );

        // A flipped byte in the data and a cut file are both reported.
        let mut bytes = std::fs::read(&path).unwrap();
        let n = bytes.len();
        bytes[n - 6] ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        let e = read_events(&path).unwrap_err().to_string();
        assert!(e.contains("data CRC"), "{e}");
        bytes[n - 6] ^= 1;
        std::fs::write(&path, &bytes[..n - 3]).unwrap();
        let e = read_events(&path).unwrap_err().to_string();
        assert!(e.contains("truncated"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn same_bytes_as_tensorboards_writer() {
        // `Event(wall_time=1.5, step=3, summary=Summary(value=[Summary.Value(tag="loss",
        // simple_value=0.25)]))` framed by tensorboard.summary.writer.record_writer.RecordWriter
        // (tensorboard 2.21; the command is in scripts/check_tensorboard.py --golden).
        let golden: [u8; 42] = [
            0x1a, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x12, 0x9b, 0xd8, 0x2d, 0x09, 0x00,
            0x00, 0x00, 0x00, 0x00, 0x00, 0xf8, 0x3f, 0x10, 0x03, 0x2a, 0x0d, 0x0a, 0x0b, 0x0a,
            0x04, 0x6c, 0x6f, 0x73, 0x73, 0x15, 0x00, 0x00, 0x80, 0x3e, 0xd0, 0x54, 0xb2, 0x55,
        ];
        let ours = record(&encode_event(1.5, 3, None, &[("loss", 0.25)]));
        assert_eq!(ours, golden);
        let dir = tmpdir("golden");
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("events.out.tfevents.0.tb");
        std::fs::write(&p, golden).unwrap();
        let ev = read_events(&p).unwrap();
        assert_eq!(
            ev,
            vec![TbEvent {
                wall_time: 1.5,
                step: 3,
                file_version: None,
                scalars: vec![("loss".into(), 0.25)],
            }]
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
