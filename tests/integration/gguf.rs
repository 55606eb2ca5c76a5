//! `rtune convert gguf` and GGUF model paths against hostile and broken files (issue 46): exit 2
//! and one line naming the file for bad input (also under `RUST_BACKTRACE=1`), bounded memory
//! under an address-space limit, the magic read before a file is hashed, and no temporary left by
//! SIGINT or SIGTERM.

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::GgmlDType;
use std::io::Write;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use crate::common::{fixture, rtune, rtune_env, stderr};

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("rtune-it-gguf-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Exit 2, one `error:` line holding each of `want`, no panic.
fn assert_refused(o: &Output, want: &[&str]) {
    let err = stderr(o);
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert_eq!(lines.len(), 1, "{err}");
    assert!(lines[0].starts_with("error: "), "{err}");
    for w in want {
        assert!(lines[0].contains(w), "want {w:?}: {err}");
    }
    assert!(!err.contains("panicked"), "{err}");
}

/// A GGUF v3 header with one metadata entry whose value bytes are `value` (type `ty`).
fn one_entry(path: &Path, key: &str, ty: u32, value: &[u8], sparse_tail: u64) {
    let mut b = b"GGUF".to_vec();
    b.extend(3u32.to_le_bytes());
    b.extend(0u64.to_le_bytes());
    b.extend(1u64.to_le_bytes());
    b.extend((key.len() as u64).to_le_bytes());
    b.extend(key.as_bytes());
    b.extend(ty.to_le_bytes());
    b.extend(value);
    let mut f = std::fs::File::create(path).unwrap();
    f.write_all(&b).unwrap();
    f.set_len(b.len() as u64 + sparse_tail).unwrap();
}

/// `rtune convert gguf` under an address-space limit of `kib` KiB.
fn convert_limited(gguf: &Path, out: &Path, kib: u64, env: &[(&str, &str)]) -> Output {
    let mut c = Command::new("sh");
    c.args([
        "-c",
        &format!("ulimit -v {kib}; exec \"$0\" convert gguf \"$1\" \"$2\""),
        env!("CARGO_BIN_EXE_rtune"),
        s(gguf),
        s(out),
    ]);
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().unwrap()
}

/// The 64 MiB file with one u8 array of 2²⁶ elements took 2.1 GB (candle's 32 bytes an
/// element): refused at the array's header under a 1.5 GiB address-space limit, one line naming
/// the key also with `RUST_BACKTRACE=1`. A 1 GiB array (sparse) aborted the process.
#[test]
fn hostile_metadata_is_refused_within_a_memory_limit() {
    let d = tmp("metadata");
    let gguf = d.join("m.gguf");
    let mut arr = 0u32.to_le_bytes().to_vec();
    arr.extend((1u64 << 26).to_le_bytes());
    one_entry(&gguf, "x.big", 9, &arr, 1 << 26);
    let limit = 3 << 19; // 1.5 GiB
    let o = convert_limited(&gguf, &d.join("hf"), limit, &[("RUST_BACKTRACE", "1")]);
    assert_refused(&o, &["m.gguf", "metadata `x.big`", "67108864 elements"]);
    let mut arr = 0u32.to_le_bytes().to_vec();
    arr.extend((1u64 << 30).to_le_bytes());
    one_entry(&gguf, "x.huge", 9, &arr, 1 << 30);
    let o = convert_limited(&gguf, &d.join("hf"), limit, &[]);
    assert_refused(&o, &["metadata `x.huge`"]);
    assert!(!d.join("hf").exists());
    std::fs::remove_dir_all(&d).unwrap();
}

/// The fixture as an f32 llama GGUF, its metadata and tensors rewritten by candle's writer with
/// `md` changed and no tensors when `drop_tensors`.
fn edited(d: &Path, md: &[(&str, Value)], drop_tensors: bool) -> PathBuf {
    let src = d.join("tiny.gguf");
    rtune_gguf::write_llama_gguf(&fixture("fixtures/tiny-llama"), &src, GgmlDType::F32).unwrap();
    let mut f = std::fs::File::open(&src).unwrap();
    let c = gguf_file::Content::read(&mut f).unwrap();
    let mut meta = c.metadata.clone();
    for (k, v) in md {
        meta.insert(k.to_string(), v.clone());
    }
    let tensors: Vec<(String, _)> = if drop_tensors {
        vec![]
    } else {
        c.tensor_infos
            .keys()
            .map(|n| {
                (
                    n.clone(),
                    c.tensor(&mut f, n, &candle_core::Device::Cpu).unwrap(),
                )
            })
            .collect()
    };
    let out = d.join("edited.gguf");
    let mut w = std::fs::File::create(&out).unwrap();
    let m: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let t: Vec<(&str, _)> = tensors.iter().map(|(k, t)| (k.as_str(), t)).collect();
    gguf_file::write(&mut w, &m, &t).unwrap();
    out
}

/// `general.alignment = 0` panicked in candle's reader (exit 101); a GGUF without tensors
/// converted with exit 0; a tensor of an unknown ggml type printed candle's backtrace (48 lines)
/// under `RUST_BACKTRACE=1`. Each: exit 2, one line.
#[test]
fn broken_ggufs_are_refused_in_one_line() {
    let d = tmp("broken");
    let out = d.join("hf");
    let gguf = edited(&d, &[("general.alignment", Value::U32(0))], false);
    let o = rtune(&["convert", "gguf", s(&gguf), s(&out)]);
    assert_refused(&o, &["edited.gguf", "general.alignment", "power of two"]);
    let gguf = edited(&d, &[], true);
    let o = rtune(&["convert", "gguf", s(&gguf), s(&out)]);
    assert_refused(&o, &["edited.gguf", "holds no tensors"]);
    // A tensor info whose ggml type is 99: candle's reader refuses it (with a backtrace).
    let gguf = edited(&d, &[], false);
    let mut b = std::fs::read(&gguf).unwrap();
    let name = b"output_norm.weight";
    let at = b.windows(name.len()).position(|w| w == name).unwrap() + name.len();
    // n_dims (u32) = 1, one u64 dimension, then the type.
    b[at + 12..at + 16].copy_from_slice(&99u32.to_le_bytes());
    std::fs::write(&gguf, b).unwrap();
    let o = rtune_env(
        &["convert", "gguf", s(&gguf), s(&out)],
        &[("RUST_BACKTRACE", "1")],
    );
    assert_refused(&o, &["edited.gguf", "not a readable GGUF file"]);
    assert!(!out.exists());
    std::fs::remove_dir_all(&d).unwrap();
}

/// A missing input exited 1; a FIFO or a device said "not found" as a model path and exited 1 in
/// `convert`. Each is named for what it is, exit 2, at once.
#[test]
fn missing_fifo_and_device_inputs_are_named() {
    let d = tmp("inputs");
    let out = d.join("hf");
    let o = rtune(&["convert", "gguf", s(&d.join("none.gguf")), s(&out)]);
    assert_refused(&o, &["none.gguf", "No such file"]);
    let fifo = d.join("fifo.gguf");
    let c = std::ffi::CString::new(s(&fifo)).unwrap();
    // SAFETY: `c` is a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let zero = d.join("zero.gguf");
    std::os::unix::fs::symlink("/dev/zero", &zero).unwrap();
    for (p, what) in [(&fifo, "a FIFO"), (&zero, "a character device")] {
        let o = rtune(&["convert", "gguf", s(p), s(&out)]);
        assert_refused(&o, &[s(p), what, "not a regular file"]);
        let o = rtune(&[
            "train",
            "--config",
            s(&fixture("bad_inputs/model-missing-dir/config.toml")),
            "--set",
            &format!("model.path={}", s(p)),
            "--set",
            &format!("output.dir={}", s(&d.join("runs"))),
        ]);
        assert_refused(&o, &[s(p), what]);
        assert!(!stderr(&o).contains("not found"), "{}", stderr(&o));
    }
    assert!(!out.exists());
    std::fs::remove_dir_all(&d).unwrap();
}

/// A 50 GB file named `.gguf` that is not one was hashed whole (50 s and more) before its magic
/// was read: refused from its first four bytes.
#[test]
fn a_non_gguf_is_refused_from_its_magic_before_hashing() {
    let d = tmp("magic");
    let big = d.join("big.gguf");
    let mut f = std::fs::File::create(&big).unwrap();
    f.write_all(b"NOPE").unwrap();
    f.set_len(50_000_000_000).unwrap();
    let t0 = Instant::now();
    let o = rtune(&[
        "train",
        "--config",
        s(&fixture("bad_inputs/model-missing-dir/config.toml")),
        "--set",
        &format!("model.path={}", s(&big)),
        "--set",
        &format!("output.dir={}", s(&d.join("runs"))),
    ]);
    assert_refused(&o, &["big.gguf", "not a GGUF file"]);
    assert!(t0.elapsed() < Duration::from_secs(20), "{:?}", t0.elapsed());
    std::fs::remove_dir_all(&d).unwrap();
}

/// `.<name>.tmp-<pid>` entries of `dir`.
fn temporaries(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".tmp-"))
        .collect()
}

/// SIGINT or SIGTERM during a conversion left `.hf.tmp-PID` behind: the temporary is removed and
/// the process still ends by the signal. A temporary of a dead process is swept by the next run;
/// one of a live process is left alone.
#[test]
fn an_interrupted_conversion_leaves_no_temporary() {
    let d = tmp("signal");
    let gguf = d.join("tiny.gguf");
    rtune_gguf::write_llama_gguf(&fixture("fixtures/tiny-llama"), &gguf, GgmlDType::F32).unwrap();
    let out = d.join("hf");
    for sig in [libc::SIGTERM, libc::SIGINT] {
        let mut child = Command::new(env!("CARGO_BIN_EXE_rtune"))
            .args(["convert", "gguf", s(&gguf), s(&out)])
            // 21 tensors × 200 ms: the signal lands while tensors are written.
            .env("RTUNE_FAULT_CONVERT_PAUSE_MS", "200")
            .spawn()
            .unwrap();
        let tmp_dir = d.join(format!(".hf.tmp-{}", child.id()));
        let t0 = Instant::now();
        while !tmp_dir.join("tokenizer_config.json").exists() {
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "no temporary appeared"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        // SAFETY: signals our own child.
        assert_eq!(unsafe { libc::kill(child.id() as i32, sig) }, 0);
        let status = child.wait().unwrap();
        assert_eq!(status.signal(), Some(sig), "{status:?}");
        assert_eq!(temporaries(&d), Vec::<String>::new());
        assert!(!out.exists());
    }
    // A dead process's temporary (a pid that has exited) and a live one's (this test's pid).
    let mut dead = Command::new("true").spawn().unwrap();
    let dead_pid = dead.id();
    dead.wait().unwrap();
    let stale = d.join(format!(".hf.tmp-{dead_pid}"));
    let live = d.join(format!(".hf.tmp-{}", std::process::id()));
    for t in [&stale, &live] {
        std::fs::create_dir_all(t).unwrap();
        std::fs::write(t.join("model.safetensors"), b"partial").unwrap();
    }
    let o = rtune(&["convert", "gguf", s(&gguf), s(&out)]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!stale.exists());
    assert!(live.exists());
    std::fs::remove_dir_all(&d).unwrap();
}
