use std::time::{Duration, Instant};

use serde_json::{json, Map, Value};

use super::builtin::{answers_equal, extract_answer, length_reward};
use super::*;

static P: Value = Value::Null;

fn table(v: Value) -> RewardTable {
    serde_json::from_value(v).unwrap()
}

fn err(v: Value) -> String {
    table(v).check(0).unwrap_err().to_string()
}

fn columns(v: Value) -> Map<String, Value> {
    v.as_object().unwrap().clone()
}

fn command(argv: &[&str], timeout_s: f64) -> Rewards {
    let r = Reward {
        name: "judge".into(),
        weight: 1.0,
        kind: Kind::Command {
            argv: argv.iter().map(|s| s.to_string()).collect(),
            timeout_s,
        },
    };
    Rewards::start(&[r]).unwrap()
}

fn shell(script: &str, timeout_s: f64) -> Rewards {
    command(&["sh", "-c", script], timeout_s)
}

/// `n` samples with an empty row.
fn score_n(r: &mut Rewards, step: u64, n: usize) -> Result<Scores> {
    let cols = Map::new();
    let samples: Vec<Sample> = (0..n)
        .map(|_| Sample {
            prompt: &P,
            completion: "c",
            completion_ids: &[5, 6],
            columns: &cols,
        })
        .collect();
    r.score(step, &samples)
}

#[test]
fn tables_check_their_own_keys() {
    let ok = table(json!({"name": "format", "kind": "regex", "pattern": "<answer>.*</answer>"}))
        .check(0)
        .unwrap();
    assert_eq!(ok.weight, 1.0);
    assert_eq!(
        ok.kind,
        Kind::Regex {
            pattern: "<answer>.*</answer>".into()
        }
    );
    let e = err(json!({"name": "acc", "kind": "answer", "column": "a", "pattern": "x"}));
    assert!(
        e.contains("[[reward]] #1 (`acc`): `pattern`: not a key of kind = \"answer\""),
        "{e}"
    );
    let e = err(json!({"name": "x", "kind": "judge"}));
    assert!(e.contains("`kind`: `judge` is not a reward kind"), "{e}");
    let e = err(json!({"kind": "length", "target": 3}));
    assert!(e.contains("`name`: missing"), "{e}");
    let e = err(json!({"name": "f", "kind": "regex", "pattern": "(unclosed"}));
    assert!(e.contains("`pattern`:") && !e.contains('\n'), "{e}");
    let e = err(json!({"name": "l", "kind": "length", "target": 0}));
    assert!(e.contains("`target`: must be at least 1"), "{e}");
    let e = err(json!({"name": "c", "kind": "command", "command": []}));
    assert!(e.contains("`command`: must name a program"), "{e}");
    let e = err(json!({"name": "c", "kind": "command", "command": ["x"], "timeout_s": -1.0}));
    assert!(e.contains("`timeout_s`"), "{e}");
    let e = err(json!({"name": "a", "kind": "answer", "column": "c", "tolerance": -0.5}));
    assert!(e.contains("`tolerance`"), "{e}");
    // TOML spells NaN `nan`; JSON cannot, so the table is built here.
    let nan = RewardTable {
        weight: Some(f64::NAN),
        ..table(json!({"name": "w", "kind": "length", "target": 4}))
    };
    let e = nan.check(0).unwrap_err().to_string();
    assert!(e.contains("`weight`: NaN is not a finite number"), "{e}");
    let dup = [
        table(json!({"name": "a", "kind": "length", "target": 3})),
        table(json!({"name": "a", "kind": "length", "target": 4})),
    ];
    let e = check_all(&dup).unwrap_err().to_string();
    assert!(e.contains("#2 (`a`): `name`: another"), "{e}");
    assert!(
        serde_json::from_value::<RewardTable>(json!({"name": "a", "kind": "length", "targt": 3}))
            .is_err(),
        "an unknown key is refused"
    );
}

#[test]
fn builtins_score_as_documented() {
    let re = builtin::compile(spec::DEFAULT_EXTRACT);
    assert_eq!(
        extract_answer(&re, "<answer>1</answer> then <answer> 42 </answer>"),
        Some("42")
    );
    assert_eq!(extract_answer(&re, "no tag"), None);
    assert!(answers_equal("42", &json!("42"), None));
    assert!(answers_equal("42", &json!(42), None));
    assert!(!answers_equal("42.0", &json!(42), None));
    assert!(answers_equal("42.0", &json!(42), Some(1e-9)));
    assert!(answers_equal("1,234.5", &json!("$1234.5"), Some(0.0)));
    assert!(!answers_equal("forty", &json!("40"), Some(1.0)));
    assert!(!answers_equal("x", &Value::Null, None));
    assert_eq!(length_reward(10, 10), 1.0);
    assert_eq!(length_reward(5, 10), 0.5);
    assert_eq!(length_reward(30, 10), 0.0);

    let specs = check_all(&[
        table(json!({"name": "format", "kind": "regex", "pattern": "^<answer>.*</answer>$"})),
        table(json!({"name": "acc", "kind": "answer", "column": "answer", "tolerance": 0.01, "weight": 2.0})),
        table(json!({"name": "len", "kind": "length", "target": 4, "weight": 0.5})),
    ])
    .unwrap();
    let mut r = Rewards::start(&specs).unwrap();
    let row = columns(json!({"answer": "3.14"}));
    let s = |completion, ids: &'static [u32]| Sample {
        prompt: &P,
        completion,
        completion_ids: ids,
        columns: &row,
    };
    let scores = r
        .score(
            1,
            &[
                s("<answer>3.141</answer>", &[1, 2, 3, 4]),
                s("it is 3.14", &[1, 2]),
            ],
        )
        .unwrap();
    assert_eq!(scores.names, ["format", "acc", "len"]);
    assert_eq!(
        scores.per_reward,
        [
            vec![Some(1.0), Some(0.0)],
            vec![Some(1.0), Some(0.0)],
            vec![Some(1.0), Some(0.5)]
        ]
    );
    // 1 + 2·1 + 0.5·1 and 0 + 0 + 0.5·0.5.
    assert_eq!(scores.total(), [3.5, 0.25]);

    let empty = Map::new();
    let e = r
        .score(
            7,
            &[Sample {
                prompt: &P,
                completion: "c",
                completion_ids: &[],
                columns: &empty,
            }],
        )
        .unwrap_err()
        .to_string();
    assert_eq!(
        e,
        "reward `acc` at step 7: completion 0's prompt row has no column `answer`"
    );
}

/// TRL's nansum: a missing reward adds nothing; a completion no function scored is NaN.
#[test]
fn total_skips_missing_rewards() {
    let s = Scores {
        names: vec!["a".into(), "b".into()],
        weights: vec![1.0, 0.5],
        per_reward: vec![
            vec![Some(1.0), None, None],
            vec![Some(2.0), Some(4.0), None],
        ],
    };
    let t = s.total();
    assert_eq!(t[..2], [2.0, 2.0]);
    assert!(t[2].is_nan());
}

/// The repository's Python example, as a user would run it: one process for every request.
#[test]
fn the_python_example_scores_batches() {
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../examples/rewards/contains_answer.py"
    );
    let mut r = command(&["python3", script], 60.0);
    let rows = [
        columns(json!({"answer": "42"})),
        columns(json!({"answer": 7})),
        columns(json!({"other": 1})),
    ];
    let completions = ["so 42.", "maybe 8", "anything"];
    let samples: Vec<Sample> = rows
        .iter()
        .zip(completions)
        .map(|(c, text)| Sample {
            prompt: &P,
            completion: text,
            completion_ids: &[1],
            columns: c,
        })
        .collect();
    for step in 1..=2 {
        let s = r.score(step, &samples).unwrap();
        assert_eq!(s.per_reward, [vec![Some(1.0), Some(0.0), None]]);
    }
}

#[test]
fn a_misbehaving_command_is_one_line_naming_the_reward_and_the_step() {
    let cases: [(&str, &str); 5] = [
        (
            "read l; exit 3",
            "the process exited (exit status: 3) before answering",
        ),
        (
            "while read l; do echo '[1]'; done",
            "answered 1 rewards for 2 completions",
        ),
        ("while read l; do echo '[NaN, 1]'; done", "not finite"),
        (
            "while read l; do printf 'hello\\tworld\\n'; done",
            "not a JSON list of numbers or nulls: hello\\tworld",
        ),
        (
            "read l; head -c 17000000 /dev/zero | tr '\\0' '1'",
            "answered a line over 16 MiB",
        ),
    ];
    for (script, want) in cases {
        let mut r = shell(script, 30.0);
        let e = score_n(&mut r, 12, 2).unwrap_err().to_string();
        assert!(
            e.starts_with("reward `judge` at step 12: "),
            "{script}: {e}"
        );
        assert!(e.contains(want), "{script}: {e}");
        assert!(!e.contains('\n'), "{script}: {e}");
        let again = score_n(&mut r, 13, 2).unwrap_err().to_string();
        assert!(again.contains("stopped after an earlier error"), "{again}");
    }
    // Blank lines between answers are skipped; a good answer after them counts.
    let mut r = shell("while read l; do echo; echo '[0.5, null]'; done", 30.0);
    let s = score_n(&mut r, 1, 2).unwrap();
    assert_eq!(s.per_reward, [vec![Some(0.5), None]]);
}

/// A process that hangs, whether it reads the request or not, is stopped after `timeout_s`:
/// the request is large enough (4 MiB) to fill the pipe, so a blocking write would hang too.
#[test]
fn a_hanging_command_times_out() {
    for script in ["read l; sleep 30", "sleep 30"] {
        let mut r = shell(script, 0.3);
        let cols = Map::new();
        let big = "x".repeat(4 << 20);
        let t = Instant::now();
        let e = r
            .score(
                5,
                &[Sample {
                    prompt: &P,
                    completion: &big,
                    completion_ids: &[],
                    columns: &cols,
                }],
            )
            .unwrap_err()
            .to_string();
        assert!(e.contains("gave no answer within 0.3 s"), "{e}");
        // 0.3 s, plus the grace of 1 s before the kill.
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    }
}

#[test]
fn a_missing_program_is_refused_at_start() {
    let r = Reward {
        name: "judge".into(),
        weight: 1.0,
        kind: Kind::Command {
            argv: vec!["/nonexistent/reward-program".into()],
            timeout_s: 1.0,
        },
    };
    let e = Rewards::start(&[r]).err().unwrap().to_string();
    assert!(
        e.starts_with("reward `judge`: could not start `/nonexistent/reward-program`: "),
        "{e}"
    );
}
