use super::*;
use std::sync::atomic::{AtomicUsize, Ordering};

/// A stand-in tokeniser: one token per byte of each line; `bad` lines fail with their number.
struct Bytes {
    calls: AtomicUsize,
}

impl ChunkParser for Bytes {
    fn parse(&self, text: &str, first_line: usize) -> Result<(Vec<Example>, RowCounts)> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let mut out = Vec::new();
        let mut c = RowCounts::default();
        for (i, l) in text.lines().enumerate() {
            if l == "bad" {
                return Err(DataError::Row {
                    path: "d.jsonl".into(),
                    line: first_line + i,
                    message: "bad row".into(),
                });
            }
            if l.is_empty() {
                continue;
            }
            c.rows += 1;
            let ids: Vec<u32> = l.bytes().map(u32::from).collect();
            out.push(Example {
                labels: ids.iter().map(|&x| x as i64 - 1).collect(),
                input_ids: ids,
            });
        }
        Ok((out, c))
    }
}

fn parser() -> Bytes {
    Bytes {
        calls: AtomicUsize::new(0),
    }
}

fn inputs(v: &str) -> BTreeMap<String, String> {
    BTreeMap::from([("data.max_seq_len".to_string(), v.to_string())])
}

#[test]
fn second_load_reuses_and_any_change_rebuilds() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("d.jsonl");
    std::fs::write(&src, "abc\nde\n\nxyz\n").unwrap();
    let root = dir.path().join("cache");
    let p = parser();
    let first = load(Some(&root), &src, &inputs("8"), 2, &p).unwrap();
    assert!(!first.reused);
    assert_eq!(first.counts.rows, 3);
    let calls = p.calls.load(Ordering::SeqCst);
    assert!(calls > 0);

    let second = load(Some(&root), &src, &inputs("8"), 2, &p).unwrap();
    assert!(second.reused);
    assert_eq!(
        p.calls.load(Ordering::SeqCst),
        calls,
        "reuse must not tokenise"
    );
    assert_eq!(second.examples, first.examples);
    assert_eq!(second.counts, first.counts);
    // Private: the data is the user's.
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(second.entry.as_ref().unwrap())
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o700);

    // A changed setting (e.g. the tokenizer's hash) and a changed source each rebuild.
    let third = load(Some(&root), &src, &inputs("9"), 2, &p).unwrap();
    assert!(!third.reused);
    std::fs::write(&src, "abc\nde\nxyz!\n").unwrap();
    let fourth = load(Some(&root), &src, &inputs("8"), 2, &p).unwrap();
    assert!(!fourth.reused);
    assert_eq!(
        fourth.examples[2].input_ids,
        b"xyz!".map(u32::from).to_vec()
    );
}

#[test]
fn a_damaged_entry_is_rebuilt() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("d.jsonl");
    std::fs::write(&src, "abc\nde\n").unwrap();
    let root = dir.path().join("cache");
    let p = parser();
    let first = load(Some(&root), &src, &inputs("8"), 1, &p).unwrap();
    let shard = first.entry.unwrap().join("shard-00000.bin");
    let mut bytes = std::fs::read(&shard).unwrap();
    bytes.pop();
    std::fs::write(&shard, bytes).unwrap();
    let again = load(Some(&root), &src, &inputs("8"), 1, &p).unwrap();
    assert!(!again.reused);
    assert_eq!(again.examples, first.examples);
}

#[test]
fn chunks_keep_file_order_and_line_numbers() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("d.jsonl");
    // ~10 MB: ten chunks of 1 MiB, parsed by two workers.
    let n = 10 * 1024 * 1024 / 32;
    let mut text: String = (0..n).map(|i| format!("{i:031}\n")).collect();
    let p = parser();
    let got = load(None, &src, &inputs("8"), 2, &p);
    assert!(got.is_err(), "a missing file is an error");
    std::fs::write(&src, &text).unwrap();
    let got = load(None, &src, &inputs("8"), 2, &p).unwrap();
    assert!(p.calls.load(Ordering::SeqCst) >= 3);
    assert_eq!(got.examples.len(), n);
    for i in [0, n / 2, n - 1] {
        let want: Vec<u32> = format!("{i:031}").bytes().map(u32::from).collect();
        assert_eq!(got.examples[i].input_ids, want);
    }
    // The failing line is named by its number in the file, not in its chunk.
    let bad_line = n - 5;
    text.replace_range(32 * (bad_line - 1)..32 * bad_line - 1, "bad");
    std::fs::write(&src, &text).unwrap();
    let e = load(Some(&dir.path().join("c")), &src, &inputs("8"), 2, &p).unwrap_err();
    assert!(e.to_string().contains(&format!(":{bad_line}:")), "{e}");
    // Nothing half-built is left behind.
    let left: Vec<_> = std::fs::read_dir(dir.path().join("c")).unwrap().collect();
    assert!(left.is_empty(), "{left:?}");
}
