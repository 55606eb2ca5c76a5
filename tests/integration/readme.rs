//! The README's architecture section, checked against the tree so that it cannot go stale:
//! - the crate diagram names every crate under `crates/` exactly once, each above every crate it
//!   depends on (the normal and target-specific `[dependencies]` of its Cargo.toml; the `rtune`
//!   binary's are the root Cargo.toml's, its sources `crates/cli/`);
//! - the crate table has one row per crate, and no row for a crate that is gone;
//! - the trace of one training step lists exactly the workspace files that step executes, as
//!   callgrind sees them: `rtune train` on the smoke config for one step under valgrind, counting
//!   from the entry of `Trainer::step` to the return of `Trainer::checkpoint` on every thread
//!   (rayon's workers included). Valgrind comes from `scripts/deps/valgrind.sh`; without it the
//!   test fails and says so. Valgrind hides AVX-512 from the program, so the AVX2 row loops run;
//!   they live in the same files, so the list does not depend on the CPU.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Command;

use crate::common::root;

/// Where the measured window starts and ends (callgrind's `--zero-before` / `--dump-after`;
/// the trainer is generic over its recipe; both are `#[inline(never)]` so that the frames exist).
const STEP_FN: &str = "rtune_train::trainer::Trainer<R>::step";
const CHECKPOINT_FN: &str = "rtune_train::trainer::Trainer<R>::checkpoint";

fn readme() -> String {
    std::fs::read_to_string(root().join("README.md")).expect("README.md")
}

/// The text between `<!-- {tag} -->` and `<!-- /{tag} -->`.
fn section(text: &str, tag: &str) -> String {
    let (open, close) = (format!("<!-- {tag} -->"), format!("<!-- /{tag} -->"));
    let start = text
        .find(&open)
        .unwrap_or_else(|| panic!("README.md has no `{open}` marker"));
    let rest = &text[start + open.len()..];
    let end = rest
        .find(&close)
        .unwrap_or_else(|| panic!("README.md has no `{close}` after `{open}`"));
    rest[..end].to_string()
}

/// Every `crates/<dir>` in `text`, in order, with the line it is on.
fn crate_mentions(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let mut rest = line;
        while let Some(at) = rest.find("crates/") {
            let name: String = rest[at + 7..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_' || *c == '-')
                .collect();
            rest = &rest[at + 7 + name.len()..];
            // `crates/<dir>/…` is a file inside a crate, not the crate.
            if !name.is_empty() && !rest.starts_with('/') {
                out.push((i, name));
            }
        }
    }
    out
}

/// Each crate's directory under `crates/` → the directories of the workspace crates it depends on.
fn workspace_crates() -> BTreeMap<String, BTreeSet<String>> {
    let root = root();
    let read = |p: &Path| -> toml::Table {
        let text = std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        text.parse()
            .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
    };
    // (dir, manifest): the root manifest is the `rtune` binary's, whose sources are crates/cli.
    let mut manifests = vec![("cli".to_string(), read(&root.join("Cargo.toml")))];
    for entry in std::fs::read_dir(root.join("crates")).expect("crates/") {
        let dir = entry.expect("crates/ entry").path();
        let manifest = dir.join("Cargo.toml");
        if manifest.is_file() {
            let name = dir.file_name().unwrap().to_string_lossy().into_owned();
            manifests.push((name, read(&manifest)));
        }
    }
    let package_dir: BTreeMap<String, String> = manifests
        .iter()
        .map(|(dir, m)| {
            let name = m["package"]["name"].as_str().expect("package.name");
            (name.to_string(), dir.clone())
        })
        .collect();
    let mut out = BTreeMap::new();
    for (dir, m) in &manifests {
        let mut tables: Vec<&toml::Table> = m
            .get("dependencies")
            .and_then(|d| d.as_table())
            .into_iter()
            .collect();
        if let Some(targets) = m.get("target").and_then(|t| t.as_table()) {
            for t in targets.values() {
                tables.extend(t.get("dependencies").and_then(|d| d.as_table()));
            }
        }
        let mut deps = BTreeSet::new();
        for table in tables {
            for (key, spec) in table {
                let package = spec.get("package").and_then(|p| p.as_str()).unwrap_or(key);
                if let Some(d) = package_dir.get(package) {
                    deps.insert(d.clone());
                }
            }
        }
        out.insert(dir.clone(), deps);
    }
    out
}

#[test]
fn crate_diagram_names_every_crate_above_its_dependencies() {
    let crates = workspace_crates();
    let diagram = section(&readme(), "crate-diagram");
    let mut line_of: BTreeMap<String, usize> = BTreeMap::new();
    let mut failures = Vec::new();
    for (line, name) in crate_mentions(&diagram) {
        if !crates.contains_key(&name) {
            failures.push(format!(
                "crates/{name} is in the diagram but not in the tree"
            ));
        } else if line_of.insert(name.clone(), line).is_some() {
            failures.push(format!("crates/{name} is in the diagram twice"));
        }
    }
    for (name, deps) in &crates {
        let Some(at) = line_of.get(name) else {
            failures.push(format!("crates/{name} is missing from the diagram"));
            continue;
        };
        for dep in deps {
            if line_of.get(dep).is_some_and(|d| d <= at) {
                failures.push(format!(
                    "crates/{name} depends on crates/{dep}, which the diagram does not put below it"
                ));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "README.md's crate diagram (between the crate-diagram markers) is stale:\n{}",
        failures.join("\n")
    );
}

#[test]
fn crate_table_has_a_row_per_crate() {
    let crates: BTreeSet<String> = workspace_crates().into_keys().collect();
    let table = section(&readme(), "crate-table");
    let rows: BTreeSet<String> = table
        .lines()
        .filter_map(|l| l.strip_prefix("| `crates/"))
        .map(|l| l.split('`').next().unwrap_or("").to_string())
        .collect();
    assert_eq!(
        rows, crates,
        "README.md's crate table (between the crate-table markers): one row per crate"
    );
}

/// The workspace files with cost in a callgrind output file (paths relative to the repository).
fn files_with_cost(callgrind_out: &str, root: &str) -> BTreeSet<String> {
    // Callgrind compresses names: `fl=(7) path` defines id 7 (also under fi=, fe=, cfi=, cfl=),
    // `fl=(7)` reuses it. Cost lines (a number, or a relative `+n`/`-n`/`*` position) belong
    // to the file of the last fl=/fi=/fe= line.
    let mut names: BTreeMap<&str, &str> = BTreeMap::new();
    let mut used = BTreeSet::new();
    let mut current: Option<&str> = None;
    for line in callgrind_out.lines() {
        let spec = ["fl=(", "fi=(", "fe=(", "cfi=(", "cfl=("]
            .iter()
            .find_map(|p| line.strip_prefix(p).map(|rest| (p, rest)));
        if let Some((prefix, rest)) = spec {
            let (id, name) = rest.split_once(')').unwrap_or((rest, ""));
            if let Some(name) = name.strip_prefix(' ') {
                names.insert(id, name);
            }
            if !prefix.starts_with('c') {
                current = Some(id);
            }
        } else if line.starts_with(|c: char| c.is_ascii_digit() || "+-*".contains(c)) {
            used.extend(current);
        }
    }
    used.iter()
        .filter_map(|id| names.get(id))
        .map(|p| p.strip_prefix(root).unwrap_or(p).trim_start_matches('/'))
        .filter(|p| p.starts_with("crates/"))
        .map(str::to_string)
        .collect()
}

#[test]
fn step_trace_lists_every_file_one_step_executes() {
    let root = root();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("callgrind.out");
    let run = Command::new("valgrind")
        .current_dir(&root)
        .arg("--tool=callgrind")
        .arg(format!("--callgrind-out-file={}", out.display()))
        .arg(format!("--zero-before={STEP_FN}"))
        .arg(format!("--dump-after={CHECKPOINT_FN}"))
        .arg(env!("CARGO_BIN_EXE_rtune"))
        .args(["train", "--config", "configs/smoke.toml"])
        .args(["--set", "train.steps=1", "--set", "train.warmup_steps=0"])
        .arg("--set")
        .arg(format!("output.dir={}", dir.path().join("run").display()))
        .output()
        .expect(
            "valgrind did not start: install it with scripts/deps/valgrind.sh (scripts/test.sh does)",
        );
    assert!(
        run.status.success(),
        "rtune train under callgrind failed:\n{}",
        String::from_utf8_lossy(&run.stderr)
    );
    // `--dump-after` writes the window as the first numbered dump.
    let dump = std::fs::read_to_string(dir.path().join("callgrind.out.1"))
        .expect("callgrind wrote no dump after Trainer::checkpoint (was it renamed?)");
    let measured = files_with_cost(&dump, &root.to_string_lossy());
    assert!(
        measured.iter().any(|f| f.ends_with("model/src/layer.rs")),
        "the measured window holds no decoder layer: {measured:?}"
    );

    let trace = section(&readme(), "step-trace");
    let listed: BTreeSet<String> = trace
        .split('`')
        .skip(1)
        .step_by(2)
        .filter(|s| s.starts_with("crates/") && s.ends_with(".rs"))
        .map(str::to_string)
        .collect();
    let missing: Vec<_> = measured.difference(&listed).collect();
    let extra: Vec<_> = listed.difference(&measured).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "README.md's step trace (between the step-trace markers) is not what one step executes:\n\
         executed but not listed: {missing:?}\nlisted but not executed: {extra:?}"
    );
    let count = format!("**{} files**", measured.len());
    assert!(
        trace.contains(&count),
        "README.md's step trace must state its count as {count}"
    );
}

/// The callgrind reader on a small file: compressed names, inline files (`fi=`), call targets
/// named only under `cfi=` and costed later under `fl=`, files outside the workspace dropped.
#[test]
fn callgrind_reader_finds_costed_workspace_files() {
    let out = "\
fl=(1) /r/crates/a/src/lib.rs
fn=(1) a
3 10
cfi=(2) /r/crates/b/src/x.rs
cfn=(2) b
calls=1 0
3 5
fi=(3) /r/crates/a/src/inl.rs
+1 2
fe=(1)
fl=(4) /home/u/.cargo/registry/src/dep/lib.rs
fn=(3) dep
1 1
fl=(2)
fn=(2)
1 5
fl=(5) /r/crates/c/src/unused.rs
fn=(4) c
";
    let got: Vec<String> = files_with_cost(out, "/r").into_iter().collect();
    assert_eq!(
        got,
        [
            "crates/a/src/inl.rs",
            "crates/a/src/lib.rs",
            "crates/b/src/x.rs"
        ]
    );
}
