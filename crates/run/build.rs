//! Records the git commit and the Cargo.lock hash for run.json (reproducibility).
use sha2::{Digest, Sha256};
use std::process::Command;

fn main() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let git = |args: &[&str]| {
        Command::new("git")
            .args(args)
            .current_dir(&root)
            .output()
            .ok()
            .filter(|o| o.status.success())
    };
    let commit = git(&["rev-parse", "HEAD"])
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "unknown".into());
    let dirty = git(&["status", "--porcelain", "--untracked-files=no"])
        .is_some_and(|o| !o.stdout.is_empty());
    let commit = if dirty {
        format!("{commit}-dirty")
    } else {
        commit
    };
    let lock = std::fs::read(root.join("Cargo.lock"))
        .map(|b| format!("{:x}", Sha256::digest(&b)))
        .unwrap_or_default();
    println!("cargo:rustc-env=RTUNE_GIT_COMMIT={commit}");
    println!("cargo:rustc-env=RTUNE_CARGO_LOCK_SHA256={lock}");
    println!("cargo:rerun-if-changed=../../Cargo.lock");
    println!("cargo:rerun-if-changed=../../.git/HEAD");
    println!("cargo:rerun-if-changed=../../.git/index");
}
