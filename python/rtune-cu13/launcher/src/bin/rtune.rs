//! The CUDA wheel's `rtune`: see the crate's documentation (`src/lib.rs`).
fn main() -> std::process::ExitCode {
    rtune_cu13_launcher::run()
}
