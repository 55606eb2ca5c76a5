//! The launcher under a name that does not collide with the CPU `rtune` in target/, for its tests.
fn main() -> std::process::ExitCode {
    rtune_cu13_launcher::run()
}
