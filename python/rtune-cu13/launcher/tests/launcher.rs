//! The CUDA wheel's launcher as pip installs it: a copy of the built launcher as `rtune` in a temp
//! `bin/`, beside a stand-in `rtune-cuda`, started with or without a driver library to open.
//!
//! - no driver: one line naming the missing `libcuda.so.1` and the CPU wheel, exit 2, nothing
//!   started; `--version` / `-V` still answer (exit 0);
//! - a driver: the stand-in is exec'd with the same argv[0], arguments (non-UTF-8 ones included) and
//!   environment, and its exit status and output are the launcher's; also through a symlink to the
//!   launcher elsewhere (as `~/bin/rtune -> venv/bin/rtune`);
//! - a driver but no `rtune-cuda`: one line naming the missing file, exit 1.
//!
//! A library "present" is a `libcuda.so.1` in `LD_LIBRARY_PATH` that is a link to this process's own
//! libc (so the driver's name and the loader's search are the ones checked); "absent" is, in debug
//! builds, another name to open (`RTUNE_LAUNCHER_TEST_LIBCUDA`, which holds on a machine that has the
//! driver too).
//!
//! `harness = false`: this binary is also the stand-in `rtune-cuda` (a script would not see the
//! argv[0] it was given). Started with `RTUNE_FAKE_CUDA_RECORD` set (which only reaches it through
//! the launcher's environment), it writes its argv, NUL-separated, to that file, prints one line and
//! exits with [`FAKE_STATUS`]. Arguments not starting with `-` filter the tests by name.

use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const RECORD: &str = "RTUNE_FAKE_CUDA_RECORD";
const FAKE_STATUS: i32 = 7;
const FAKE_STDOUT: &str = "stand-in rtune-cuda ran\n";

fn main() {
    if let Some(record) = std::env::var_os(RECORD) {
        let argv: Vec<Vec<u8>> = std::env::args_os().map(OsString::into_vec).collect();
        std::fs::write(record, argv.join(&0u8)).expect("write the record");
        print!("{FAKE_STDOUT}");
        std::process::exit(FAKE_STATUS);
    }
    let tests: [(&str, fn()); 5] = [
        (
            "no_driver_is_one_line_and_exit_2",
            no_driver_is_one_line_and_exit_2,
        ),
        ("no_driver_version_answers", no_driver_version_answers),
        (
            "driver_execs_the_cuda_binary_unchanged",
            driver_execs_the_cuda_binary_unchanged,
        ),
        (
            "symlinked_launcher_finds_its_sibling",
            symlinked_launcher_finds_its_sibling,
        ),
        (
            "cuda_binary_missing_is_one_line",
            cuda_binary_missing_is_one_line,
        ),
    ];
    let filters: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let mut failed = Vec::new();
    let mut ran = 0;
    for (name, test) in tests {
        if !filters.is_empty() && !filters.iter().any(|f| name.contains(f.as_str())) {
            continue;
        }
        ran += 1;
        if std::panic::catch_unwind(test).is_ok() {
            println!("test {name} ... ok");
        } else {
            println!("test {name} ... FAILED");
            failed.push(name);
        }
    }
    println!(
        "\nlauncher tests: {} passed, {} failed",
        ran - failed.len(),
        failed.len()
    );
    if !failed.is_empty() {
        std::process::exit(101);
    }
}

/// A temp dir with `bin/rtune` (a copy: `current_exe()` resolves links) and, if `with_cuda`,
/// `bin/rtune-cuda` (this binary).
struct Install {
    dir: tempfile::TempDir,
}

impl Install {
    fn new(with_cuda: bool) -> Install {
        let dir = tempfile::tempdir().expect("temp dir");
        let bin = dir.path().join("bin");
        std::fs::create_dir(&bin).unwrap();
        std::fs::copy(env!("CARGO_BIN_EXE_rtune-cu13-launcher"), bin.join("rtune")).unwrap();
        if with_cuda {
            let me = std::env::current_exe().unwrap();
            std::os::unix::fs::symlink(me, bin.join("rtune-cuda")).unwrap();
        }
        Install { dir }
    }

    fn launcher(&self) -> PathBuf {
        self.dir.path().join("bin/rtune")
    }

    fn record(&self) -> PathBuf {
        self.dir.path().join("record")
    }

    /// A `lib/libcuda.so.1` that opens: a link to the libc this process runs on.
    fn driver_dir(&self) -> PathBuf {
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        let libc = maps
            .lines()
            .filter_map(|l| l.split_whitespace().nth(5))
            .find(|p| p.ends_with("/libc.so.6"))
            .expect("libc.so.6 in /proc/self/maps");
        let lib = self.dir.path().join("lib");
        std::fs::create_dir_all(&lib).unwrap();
        let link = lib.join("libcuda.so.1");
        if !link.exists() {
            std::os::unix::fs::symlink(libc, link).unwrap();
        }
        lib
    }

    /// Runs `exe` (the launcher or a link to it) with `args`, the driver present or absent.
    fn run(&self, exe: &Path, args: &[&OsStr], driver: bool) -> Output {
        let mut cmd = Command::new(exe);
        cmd.args(args)
            .env(RECORD, self.record())
            .env_remove("RTUNE_LAUNCHER_TEST_LIBCUDA");
        if driver {
            cmd.env("LD_LIBRARY_PATH", self.driver_dir());
        } else {
            cmd.env(
                "RTUNE_LAUNCHER_TEST_LIBCUDA",
                "libcuda-absent-for-this-test.so.1",
            );
        }
        cmd.output().expect("start the launcher")
    }

    /// The stand-in's argv, if it ran.
    fn recorded(&self) -> Option<Vec<OsString>> {
        let bytes = std::fs::read(self.record()).ok()?;
        Some(
            bytes
                .split(|b| *b == 0)
                .map(|a| OsString::from_vec(a.to_vec()))
                .collect(),
        )
    }
}

fn os(args: &[&'static str]) -> Vec<&'static OsStr> {
    args.iter().map(|a| OsStr::new(*a)).collect()
}

/// Whether this machine has the NVIDIA driver's library.
fn machine_has_driver() -> bool {
    // SAFETY: a NUL-terminated literal; a handle, if any, stays open (harmless in a test).
    !unsafe { libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_LAZY) }.is_null()
}

/// Release builds ignore the test's stand-in name: there "absent" needs a machine without the driver.
fn absent_unavailable() -> bool {
    let skip = !cfg!(debug_assertions) && machine_has_driver();
    if skip {
        println!("(skipped: release build on a machine with libcuda.so.1)");
    }
    skip
}

fn stderr_line(out: &Output) -> String {
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(err.lines().count(), 1, "not one line on stderr: {err:?}");
    assert!(err.ends_with('\n'), "{err:?}");
    err
}

fn no_driver_is_one_line_and_exit_2() {
    if absent_unavailable() {
        return;
    }
    let install = Install::new(true);
    for args in [
        &["selftest"][..],
        &["train", "--config", "x.toml"],
        &[],
        &["--help"],
    ] {
        let out = install.run(&install.launcher(), &os(args), false);
        let err = stderr_line(&out);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(out.stdout.is_empty(), "{args:?}: {:?}", out.stdout);
        assert!(
            err.starts_with("error: no CUDA device: the NVIDIA driver's libcuda.so.1"),
            "{err}"
        );
        // dlerror()'s reason and what to do instead.
        assert!(
            err.contains("libcuda-absent-for-this-test.so.1: cannot open shared object file"),
            "{err}"
        );
        assert!(err.contains("pip install rtune (the CPU build)"), "{err}");
        assert!(
            install.recorded().is_none(),
            "{args:?}: rtune-cuda was started without a driver"
        );
    }
    // The name looked for is the driver's own (without the stand-in name, on a machine without it).
    if !machine_has_driver() {
        let out = Command::new(install.launcher())
            .arg("selftest")
            .env_remove("RTUNE_LAUNCHER_TEST_LIBCUDA")
            .env_remove("LD_LIBRARY_PATH")
            .env(RECORD, install.record())
            .output()
            .unwrap();
        let err = stderr_line(&out);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(
            err.contains("(libcuda.so.1: cannot open shared object file"),
            "{err}"
        );
        assert!(
            install.recorded().is_none(),
            "rtune-cuda was started without a driver"
        );
    }
}

fn no_driver_version_answers() {
    if absent_unavailable() {
        return;
    }
    let install = Install::new(true);
    for flag in ["--version", "-V"] {
        let out = install.run(&install.launcher(), &os(&[flag]), false);
        assert_eq!(out.status.code(), Some(0), "{flag}: {out:?}");
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            format!(
                "rtune {} (cuda; no NVIDIA driver found)\n",
                env!("CARGO_PKG_VERSION")
            )
        );
        assert!(out.stderr.is_empty(), "{flag}: {out:?}");
        assert!(
            install.recorded().is_none(),
            "{flag}: rtune-cuda was started without a driver"
        );
    }
}

fn driver_execs_the_cuda_binary_unchanged() {
    let install = Install::new(true);
    let odd = OsStr::from_bytes(b"bytes \xff\xfe not UTF-8");
    let args: Vec<&OsStr> = [
        OsStr::new("train"),
        OsStr::new("--config"),
        OsStr::new("a b.toml"),
        OsStr::new(""),
        OsStr::new("--set=x=\"é\"\nnext line"),
        odd,
    ]
    .into();
    let mut cmd = Command::new(install.launcher());
    cmd.arg0("rtune-as-typed")
        .args(&args)
        .env(RECORD, install.record())
        .env("LD_LIBRARY_PATH", install.driver_dir())
        .env_remove("RTUNE_LAUNCHER_TEST_LIBCUDA");
    let out = cmd.output().unwrap();
    // The environment arrived (the stand-in found RECORD), argv[0] and every argument as given.
    let recorded = install.recorded().expect("rtune-cuda did not run");
    let mut expected = vec![OsString::from("rtune-as-typed")];
    expected.extend(args.iter().map(|a| a.to_os_string()));
    assert_eq!(recorded, expected);
    // Its exit status and output are the launcher's: the process is the stand-in's.
    assert_eq!(out.status.code(), Some(FAKE_STATUS), "{out:?}");
    assert_eq!(String::from_utf8_lossy(&out.stdout), FAKE_STDOUT);
    assert!(out.stderr.is_empty(), "{out:?}");

    // With a driver, `--version` is the CUDA binary's to answer.
    std::fs::remove_file(install.record()).unwrap();
    let out = install.run(&install.launcher(), &os(&["--version"]), true);
    assert_eq!(out.status.code(), Some(FAKE_STATUS), "{out:?}");
    let recorded = install
        .recorded()
        .expect("--version with a driver did not reach rtune-cuda");
    assert_eq!(recorded[1..], [OsString::from("--version")]);
}

fn symlinked_launcher_finds_its_sibling() {
    let install = Install::new(true);
    let elsewhere = install.dir.path().join("home-bin");
    std::fs::create_dir(&elsewhere).unwrap();
    let link = elsewhere.join("rtune");
    std::os::unix::fs::symlink(install.launcher(), &link).unwrap();
    let out = install.run(&link, &os(&["selftest"]), true);
    assert_eq!(out.status.code(), Some(FAKE_STATUS), "{out:?}");
    assert_eq!(
        install.recorded().expect("rtune-cuda did not run")[1..],
        [OsString::from("selftest")]
    );
}

fn cuda_binary_missing_is_one_line() {
    let install = Install::new(false);
    let out = install.run(&install.launcher(), &os(&["selftest"]), true);
    let err = stderr_line(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    let real = install.dir.path().join("bin/rtune-cuda");
    assert!(
        err.starts_with(&format!(
            "error: rtune-cu13: the CUDA binary {} is missing",
            real.display()
        )),
        "{err}"
    );
    assert!(
        err.contains("pip install --force-reinstall rtune-cu13"),
        "{err}"
    );
}
