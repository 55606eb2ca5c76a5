//! The source tree's layering (issue 32), read from the workspace's files (no build, no Python):
//! - no import circle between the files of a crate. The nodes are source files: each crate root
//!   (`src/lib.rs`, `src/main.rs`, `build.rs`, `tests/`, `benches/` and `examples/` files, and the
//!   `path = "….rs"` targets of every Cargo.toml) and the files its `mod x;` declarations reach
//!   (`x.rs` or `x/mod.rs`, or `#[path]`); an inline `mod x { … }` (a file's `mod tests`) belongs
//!   to its file. File A has an edge to file B when A names module B, or an item defined or
//!   re-exported in B, through a path that starts with `crate`, `super`, `self` or the name of a
//!   child module — in a `use` or inline in code; a path resolves to the deepest module it names,
//!   following named re-exports (`crate::Batch`, re-exported by lib.rs from batch.rs, names
//!   batch.rs; glob re-exports are not followed). A module naming
//!   one of its own ancestors is no edge: a child using its parent's items is ownership. Comments
//!   (doc comments included) and string literals are skipped. A circle is a strongly connected
//!   component of more than one file, printed as one cycle through it, each step with the line
//!   that makes it;
//! - no crate holding more than 18% of the project's Rust lines: all tracked `*.rs` files (and new
//!   ones git does not ignore) count toward the total, and a crate (`crates/<name>/`) owns
//!   everything under its folder, tests included; the root `tests/` and `fuzz/` count toward the
//!   total but to no crate.
//!
//! The lexer is `layering/lex.rs`, the module tree, paths and circles `layering/graph.rs`.

mod graph;
mod lex;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Command;

use crate::common::root;
use graph::{normalize, Graph};

/// The largest share of the project's Rust lines one crate may hold, in percent.
const MAX_CRATE_SHARE_PCT: usize = 18;

/// Crates excused from both rules: none. (Until issue 32 split them into `crates/ops` and
/// `crates/backend`, `crates/model` held 24% of the lines and `crates/model` and `crates/kernels`
/// had circles.) An entry that allows nothing fails `allow_list_is_not_stale`.
const ALLOWED: &[&str] = &[];

#[test]
fn no_import_circle_within_a_crate() {
    let files = tracked_sources();
    let graph = Graph::build(&files, &crate_roots(&files));
    let mut failures = Vec::new();
    let mut allowed_used = BTreeSet::new();
    for circle in graph.circles() {
        let text = graph.describe(&circle);
        let inside = |c: &&str| circle.iter().all(|f| f.starts_with(&format!("{c}/")));
        match allowed_crate(&circle[0]).filter(inside) {
            Some(c) => {
                allowed_used.insert(c);
                eprintln!("allowed (ALLOWED: {c}):\n{text}");
            }
            None => failures.push(text),
        }
    }
    assert!(
        failures.is_empty(),
        "{} import circle(s) between source files (move what both sides need into the lower \
         module or a new small one):\n\n{}",
        failures.len(),
        failures.join("\n")
    );
    eprintln!("circles allowed in: {allowed_used:?}");
}

#[test]
fn no_crate_holds_more_than_its_share_of_the_lines() {
    let files = tracked_sources();
    let total: usize = files.values().map(|s| s.lines().count()).sum();
    let mut per_crate: BTreeMap<String, usize> = BTreeMap::new();
    for (path, src) in &files {
        if let Some(c) = crate_of(path) {
            *per_crate.entry(c).or_default() += src.lines().count();
        }
    }
    let mut failures = Vec::new();
    for (c, lines) in &per_crate {
        if lines * 100 > total * MAX_CRATE_SHARE_PCT {
            let pct = 100.0 * *lines as f64 / total as f64;
            let line = format!("{c}: {lines} of {total} lines ({pct:.1}%)");
            if ALLOWED.contains(&c.as_str()) {
                eprintln!("allowed (ALLOWED): {line}");
            } else {
                failures.push(line);
            }
        }
    }
    assert!(
        failures.is_empty(),
        "crates over {MAX_CRATE_SHARE_PCT}% of the project's Rust lines (split them by concern):\n{}",
        failures.join("\n")
    );
}

/// Every ALLOWED entry still allows something: a circle inside it or a size over the limit.
#[test]
fn allow_list_is_not_stale() {
    let files = tracked_sources();
    let graph = Graph::build(&files, &crate_roots(&files));
    let total: usize = files.values().map(|s| s.lines().count()).sum();
    for c in ALLOWED {
        let lines: usize = files
            .iter()
            .filter(|(p, _)| crate_of(p).as_deref() == Some(c))
            .map(|(_, s)| s.lines().count())
            .sum();
        let prefix = format!("{c}/");
        let circle = graph
            .circles()
            .iter()
            .any(|k| k.iter().all(|f| f.starts_with(&prefix)));
        assert!(
            circle || lines * 100 > total * MAX_CRATE_SHARE_PCT,
            "{c} has no circle and is within {MAX_CRATE_SHARE_PCT}% of the lines: remove it from \
             ALLOWED in tests/integration/layering.rs"
        );
    }
}

/// The resolver on a small tree: a circle through `super::` and a bare child path is found, with
/// the lines that make it; a parent used by its child, comments and strings are not edges.
#[test]
fn resolver_finds_a_planted_circle_and_nothing_else() {
    let src = |s: &str| s.to_string();
    let files: BTreeMap<String, String> = [
        (
            "c/src/lib.rs",
            src("mod a;\nmod b;\npub mod d;\npub struct Top;\n"),
        ),
        (
            "c/src/a.rs",
            src("//! see crate::d\nuse crate::Top;\nmod inner { use super::super::b::X; }\n"),
        ),
        (
            "c/src/b.rs",
            src("pub struct X;\nfn f() { let _ = \"crate::d\"; crate::a::g(); }\n"),
        ),
        ("c/src/d.rs", src("mod e;\npub use e::Y;\n/* crate::b */\n")),
        (
            "c/src/d/e.rs",
            src("pub struct Y;\nfn h() -> super::super::Top { todo!() }\n"),
        ),
    ]
    .into_iter()
    .map(|(p, s)| (p.to_string(), s))
    .collect();
    let graph = Graph::build(&files, &["c/src/lib.rs".to_string()]);
    let circles = graph.circles();
    assert_eq!(
        circles,
        vec![vec!["c/src/a.rs".to_string(), "c/src/b.rs".to_string()]]
    );
    let text = graph.describe(&circles[0]);
    assert!(
        text.contains("c/src/a.rs:3") && text.contains("c/src/b.rs:2"),
        "{text}"
    );
    // d → d/e (a parent naming its child) is an edge; e → lib (an ancestor) is not.
    assert!(graph.edges["c/src/d.rs"].contains_key("c/src/d/e.rs"));
    assert!(!graph.edges.contains_key("c/src/d/e.rs"));
}

/// Issue 43: re-exports are followed. `crate::Batch` (re-exported by lib.rs from batch.rs) names
/// batch.rs, `crate::p::Pair as Two` (re-exported by p.rs, renamed, from p/inner.rs) names
/// p/inner.rs, so batch.rs ↔ p/inner.rs is a circle; not following them, each named its
/// re-exporting file (an ancestor or a parent) and the circle was invisible. A glob re-export
/// and an external crate's item stay where they are.
#[test]
fn resolver_follows_re_exports() {
    let files: BTreeMap<String, String> = [
        (
            "c/src/lib.rs",
            "mod batch;
pub mod p;
mod g;
pub use batch::Batch;
pub use rtune_x::Ext;
",
        ),
        (
            "c/src/batch.rs",
            "pub struct Batch;
fn f(_: crate::p::Two) {}
",
        ),
        (
            "c/src/p.rs",
            "mod inner;
pub(crate) use inner::{Pair as Two};
",
        ),
        (
            "c/src/p/inner.rs",
            "pub struct Pair;
use crate::Batch;
",
        ),
        (
            "c/src/g.rs",
            "pub use crate::p::*;
use crate::Ext;
",
        ),
    ]
    .into_iter()
    .map(|(p, s)| (p.to_string(), s.to_string()))
    .collect();
    let graph = Graph::build(&files, &["c/src/lib.rs".to_string()]);
    assert_eq!(
        graph.circles(),
        vec![vec![
            "c/src/batch.rs".to_string(),
            "c/src/p/inner.rs".to_string()
        ]]
    );
    assert!(graph.edges["c/src/batch.rs"].contains_key("c/src/p/inner.rs"));
    assert!(graph.edges["c/src/p/inner.rs"].contains_key("c/src/batch.rs"));
    // `crate::p::*` names p.rs; `crate::Ext` (an external crate's item) names lib.rs, an ancestor.
    assert_eq!(
        graph.edges["c/src/g.rs"].keys().collect::<Vec<_>>(),
        vec!["c/src/p.rs"]
    );
}

/// The crate folder a tracked file belongs to (`crates/<name>`), if any.
fn crate_of(path: &str) -> Option<String> {
    let mut parts = path.splitn(3, '/');
    match (parts.next(), parts.next(), parts.next()) {
        (Some("crates"), Some(name), Some(_)) => Some(format!("crates/{name}")),
        _ => None,
    }
}

fn allowed_crate(path: &str) -> Option<&'static str> {
    let c = crate_of(path)?;
    ALLOWED.iter().copied().find(|a| *a == c)
}

/// Every `*.rs` file of the workspace (path relative to the root, `/`-separated) and its text:
/// those git tracks and the new ones it does not ignore (`git ls-files`), or a walk of the tree (without `target/` and hidden folders) where
/// the sources are not a git checkout.
fn tracked_sources() -> BTreeMap<String, String> {
    let root = root();
    let listed = Command::new("git")
        .args([
            "ls-files",
            "-z",
            "--cached",
            "--others",
            "--exclude-standard",
            "--",
            "*.rs",
        ])
        .current_dir(&root)
        .output()
        .ok()
        .filter(|o| o.status.success() && !o.stdout.is_empty());
    let paths: Vec<String> = match listed {
        Some(o) => String::from_utf8(o.stdout)
            .expect("UTF-8 paths")
            .split('\0')
            .filter(|p| !p.is_empty())
            .map(str::to_string)
            .collect(),
        None => {
            let mut out = Vec::new();
            walk(&root, &root, &mut out);
            out
        }
    };
    paths
        .into_iter()
        .filter_map(|p| {
            // A tracked file deleted in the working tree is not a source any more.
            let text = std::fs::read_to_string(root.join(&p)).ok()?;
            Some((p, text))
        })
        .collect()
}

fn walk(root: &Path, dir: &Path, out: &mut Vec<String>) {
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        let skipped = name.starts_with('.') || (dir == root && name.starts_with("target"));
        if path.is_dir() {
            if !skipped {
                walk(root, &path, out);
            }
        } else if name.ends_with(".rs") {
            let rel = path.strip_prefix(root).unwrap().to_string_lossy();
            out.push(rel.replace('\\', "/"));
        }
    }
}

/// The crate roots: Cargo's default target files beside each Cargo.toml, and the `.rs` paths it
/// names (`[[bin]]`, `[[test]]`, … `path = "…"`).
fn crate_roots(files: &BTreeMap<String, String>) -> Vec<String> {
    let root = root();
    let manifests = Command::new("git")
        .args([
            "ls-files",
            "--cached",
            "--others",
            "--exclude-standard",
            "--",
            "Cargo.toml",
            "*/Cargo.toml",
        ])
        .current_dir(&root)
        .output()
        .ok()
        .filter(|o| o.status.success() && !o.stdout.is_empty())
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_else(|| {
            let dirs = files
                .keys()
                .filter_map(|p| crate_of(p))
                .collect::<BTreeSet<_>>();
            let mut m: Vec<String> = dirs
                .into_iter()
                .map(|d| format!("{d}/Cargo.toml"))
                .collect();
            m.push("Cargo.toml".into());
            m
        });
    let mut roots = BTreeSet::new();
    for manifest in manifests {
        let dir = manifest
            .strip_suffix("Cargo.toml")
            .unwrap_or("")
            .to_string();
        let Ok(toml) = std::fs::read_to_string(root.join(&manifest)) else {
            continue;
        };
        for line in toml.lines() {
            let line = line.trim();
            if let Some(v) = line.strip_prefix("path") {
                let v = v
                    .trim_start()
                    .trim_start_matches('=')
                    .trim()
                    .trim_matches('"');
                if v.ends_with(".rs") {
                    roots.insert(normalize(&format!("{dir}{v}")));
                }
            }
        }
        for p in files.keys() {
            let Some(rest) = p.strip_prefix(&dir) else {
                continue;
            };
            let default = matches!(rest, "src/lib.rs" | "src/main.rs" | "build.rs")
                || ["src/bin/", "tests/", "benches/", "examples/"]
                    .iter()
                    .any(|d| {
                        rest.strip_prefix(d).is_some_and(|f| {
                            !f.contains('/')
                                || f.strip_suffix("/main.rs").is_some_and(|s| !s.contains('/'))
                        })
                    });
            if default {
                roots.insert(p.clone());
            }
        }
    }
    roots.into_iter().collect()
}
