//! The `rtune` of the CUDA wheel (rtune-cu13): a launcher in front of the CUDA binary.
//!
//! candle links the CUDA driver library (cudarc's dynamic *linking*), so the CUDA binary names
//! `libcuda.so.1` in its `DT_NEEDED` and on a machine without the NVIDIA driver the dynamic loader
//! refuses to start it: `error while loading shared libraries: libcuda.so.1`, exit 127, before
//! rtune's `main` can say anything. The wheel therefore installs two executables side by side in the
//! environment's `bin/`: this launcher as `rtune`, and the CUDA binary as [`REAL`] (`rtune-cuda`).
//!
//! [`run`] opens [`DRIVER`] with `dlopen`, which searches as the loader would for the CUDA binary
//! (`LD_LIBRARY_PATH`, the ld.so cache, the default directories; the CUDA binary's RUNPATH only
//! points into NVIDIA's wheels, which never hold the driver). When it opens, the launcher `exec`s
//! the CUDA binary with the same `argv[0]`, arguments and environment, so the process, its exit
//! status and its signals are the CUDA binary's own. When it does not, the launcher prints one line
//! (the loader's reason, and that the CPU wheel is the one for this machine) and exits 2, the status
//! the CUDA binary itself gives when the driver is there but no device opens; `--version` / `-V`
//! still answer, naming the build and the missing driver.
//!
//! Debug builds only (the tests): `RTUNE_LAUNCHER_TEST_LIBCUDA` names another library to open in
//! place of [`DRIVER`], so that a test can simulate a machine without the driver on one that has it.

use std::ffi::{CStr, CString, OsStr, OsString};
use std::os::unix::process::CommandExt;
use std::process::{Command, ExitCode};

/// The NVIDIA driver's library, as the CUDA binary's `DT_NEEDED` names it.
pub const DRIVER: &str = "libcuda.so.1";

/// The CUDA binary's file name, in the launcher's own directory.
pub const REAL: &str = "rtune-cuda";

/// The exit status when the driver is missing: the CUDA binary's for "no device will open".
const NO_DEVICE: u8 = 2;

/// Checks for the driver, then execs the CUDA binary; returns only when it cannot.
pub fn run() -> ExitCode {
    let mut args = std::env::args_os();
    let argv0 = args.next().unwrap_or_else(|| OsString::from("rtune"));
    let rest: Vec<OsString> = args.collect();

    if let Err(why) = open_driver(&driver_name()) {
        if rest.first().is_some_and(|a| a == "--version" || a == "-V") {
            println!(
                "rtune {} (cuda; no NVIDIA driver found)",
                env!("CARGO_PKG_VERSION")
            );
            return ExitCode::SUCCESS;
        }
        eprintln!(
            "error: no CUDA device: the NVIDIA driver's {DRIVER} is not on this machine ({why}); \
             this is rtune's CUDA build (rtune-cu13): on a machine without an NVIDIA GPU, \
             pip install rtune (the CPU build) instead"
        );
        return ExitCode::from(NO_DEVICE);
    }

    let real = match std::env::current_exe() {
        // current_exe() resolves symlinks: a link to the launcher elsewhere still finds its sibling.
        Ok(me) => me.with_file_name(REAL),
        Err(e) => {
            eprintln!(
                "error: rtune-cu13: cannot find the launcher's own path to start {REAL}: {e}"
            );
            return ExitCode::FAILURE;
        }
    };
    if !real.is_file() {
        eprintln!(
            "error: rtune-cu13: the CUDA binary {} is missing (the launcher `rtune` runs it); \
             the install is incomplete: pip install --force-reinstall rtune-cu13",
            real.display()
        );
        return ExitCode::FAILURE;
    }
    // Replaces this process: on success nothing below runs.
    let e = Command::new(&real).arg0(&argv0).args(&rest).exec();
    eprintln!("error: rtune-cu13: cannot start {}: {e}", real.display());
    ExitCode::FAILURE
}

/// [`DRIVER`], or in a debug build the test's stand-in.
fn driver_name() -> OsString {
    #[cfg(debug_assertions)]
    if let Some(name) = std::env::var_os("RTUNE_LAUNCHER_TEST_LIBCUDA") {
        return name;
    }
    OsString::from(DRIVER)
}

/// Opens `name` as the CUDA binary's loader would; the error is `dlerror()`'s text.
fn open_driver(name: &OsStr) -> Result<(), String> {
    use std::os::unix::ffi::OsStrExt;
    let c = CString::new(name.as_bytes()).map_err(|_| format!("{name:?} holds a NUL byte"))?;
    // SAFETY: `c` is NUL-terminated and outlives the call. The handle is never closed: the library
    // stays loaded until `exec` replaces the process (as it would in the CUDA binary anyway).
    let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL) };
    if !handle.is_null() {
        return Ok(());
    }
    // SAFETY: dlerror returns NULL or a NUL-terminated string that stays valid until the next dl*
    // call on this thread; it is copied out at once.
    let err = unsafe { libc::dlerror() };
    Err(if err.is_null() {
        format!("{} did not load", name.to_string_lossy())
    } else {
        // SAFETY: non-NULL, NUL-terminated (above).
        unsafe { CStr::from_ptr(err) }
            .to_string_lossy()
            .into_owned()
    })
}
