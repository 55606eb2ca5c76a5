//! The process's allocator: glibc's malloc, tuned once at start ([`tune`]), with its large blocks
//! and its main heap backed by transparent huge pages ([`Thp`], the global allocator).
//!
//! Why huge pages: a training step streams its frozen weights from memory (a mixture of experts'
//! stacks are 150 MB a layer at the bench's shape, read once a pass) and its activations through
//! buffers of several MiB; with 4 KiB pages each 2 MiB of that costs 512 TLB entries and, when
//! fresh, 512 page faults. Most kernels ship transparent huge pages in `madvise` mode
//! (`/sys/kernel/mm/transparent_hugepage/enabled`), where only ranges marked `MADV_HUGEPAGE` get
//! them; in `always` or `never` mode the marks change nothing. [`Thp`] marks each block glibc maps
//! on its own (≥ [`MMAP_THRESHOLD`]) and each stretch the main heap grows by, before they are
//! first touched. The worker threads' arenas stay on 4 KiB pages (glibc's own
//! `GLIBC_TUNABLES=glibc.malloc.hugetlb=1` marks those too; it cannot be set from inside the
//! process).
//!
//! Measured on `benches/moe_vs_peft.sh`'s model (2-core AVX2-only EPYC, release, runs
//! alternating; benches/README.md, session 35): page faults 210 660 → 23 485 (glibc's tunable:
//! 8 363), ~700 of the ~800 MB resident on huge pages, tokens/s +2.0 to +4.4%, the same losses to
//! the last digit, the same peak.

use std::alloc::{GlobalAlloc, Layout, System};

/// Blocks from this size up are mapped on their own unless a free stretch of the heap fits them
/// (glibc's largest mmap threshold). Below it, freed memory stays in the heap and is reused (no
/// fresh pages each step).
pub const MMAP_THRESHOLD: usize = 32 << 20;

/// Training allocates and frees the same large activation buffers every step. By default glibc
/// serves blocks above a moving threshold with mmap and hands them back to the kernel when freed,
/// and trims the heap top, so each step paid again for fresh zeroed pages (~25% of a bench-small
/// step in page faults). With the mmap threshold fixed at its maximum (rtune keeps its big
/// buffers below it: attention scores per batch row, 24 MiB logits chunks) and no trimming, freed
/// memory stays in the heap and is reused: faster and smaller (measured in benches/README.md).
/// Also starts [`Thp`]'s watch on the main heap from its current end.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub fn tune() {
    // SAFETY: mallopt only sets allocator parameters; no other thread exists yet. sbrk(0) only
    // reads the current end of the heap.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD as i32);
        libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
        libc::mallopt(libc::M_TOP_PAD, 64 << 20);
        thp::HEAP_MARKED.store(libc::sbrk(0) as usize, std::sync::atomic::Ordering::Relaxed);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub fn tune() {}

/// The system allocator, marking for transparent huge pages each block of [`MMAP_THRESHOLD`] or
/// more and each stretch the main heap grew by (module note). Every call goes to `System`
/// unchanged; the marks only change how pages are backed, never their contents.
pub struct Thp;

#[cfg(all(target_os = "linux", target_env = "gnu"))]
mod thp {
    use super::MMAP_THRESHOLD;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// The end of the main heap as last marked; 0 until [`super::tune`] starts the watch.
    pub(super) static HEAP_MARKED: AtomicUsize = AtomicUsize::new(0);

    /// Marks the whole pages inside `[start, end)`. Best effort: a kernel without transparent
    /// huge pages answers `EINVAL`, which leaves the range as it was.
    fn mark(start: usize, end: usize) {
        // SAFETY: sysconf only reads a system constant.
        let page = match unsafe { libc::sysconf(libc::_SC_PAGESIZE) } {
            p if p > 0 => p as usize,
            _ => 4096,
        };
        let (start, end) = (start.next_multiple_of(page), end / page * page);
        if end > start {
            // SAFETY: the range is memory this process's allocator holds (a block it just
            // handed out, or heap it just grew); MADV_HUGEPAGE changes how its pages are backed,
            // never their contents.
            unsafe {
                libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
            }
        }
    }

    /// After an allocation that returned `p` of `size` bytes: marks the block when it is large
    /// (glibc mapped it on its own, untouched yet: even `calloc` leaves a fresh mapping
    /// untouched), and whatever the main heap grew by since the last call. The heap's growth is
    /// seen on the next allocation after it, before its memory is handed out again: glibc grows
    /// the heap by at least `M_TOP_PAD` (64 MiB) and touches only the chunk headers.
    pub(super) fn after(p: *mut u8, size: usize) {
        if !p.is_null() && size >= MMAP_THRESHOLD {
            mark(p as usize, p as usize + size);
        }
        let seen = HEAP_MARKED.load(Ordering::Relaxed);
        if seen == 0 {
            return;
        }
        // SAFETY: sbrk(0) only reads glibc's record of the heap's end (a word, written under
        // the main arena's lock when the heap grows; a stale read only delays the mark).
        let end = unsafe { libc::sbrk(0) } as usize;
        if end > seen
            && HEAP_MARKED
                .compare_exchange(seen, end, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            mark(seen, end);
        }
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
mod thp {
    pub(super) fn after(_: *mut u8, _: usize) {}
}

// SAFETY: every call is forwarded to `System` unchanged; `thp::after` only adds a hint on memory
// the allocator holds.
unsafe impl GlobalAlloc for Thp {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract, forwarded.
        let p = unsafe { System.alloc(layout) };
        thp::after(p, layout.size());
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as `alloc`.
        let p = unsafe { System.alloc_zeroed(layout) };
        thp::after(p, layout.size());
        p
    }

    unsafe fn dealloc(&self, p: *mut u8, layout: Layout) {
        // SAFETY: as `alloc`.
        unsafe { System.dealloc(p, layout) }
    }

    unsafe fn realloc(&self, p: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: as `alloc`. A block grown past the threshold is a new or remapped mapping:
        // marked again; the pages it had already touched keep their backing.
        let q = unsafe { System.realloc(p, layout, new_size) };
        thp::after(q, new_size);
        q
    }
}

#[cfg(all(test, target_os = "linux", target_env = "gnu"))]
mod tests {
    use super::*;
    use std::io::Read;
    use std::sync::atomic::Ordering;

    /// The `VmFlags` of the mapping holding `addr`, from `/proc/self/smaps` (read to 64 MiB at
    /// most); `hg` is `MADV_HUGEPAGE`'s flag, set whatever the system's THP mode.
    fn flags_at(addr: usize) -> String {
        let mut text = String::new();
        std::fs::File::open("/proc/self/smaps")
            .expect("/proc/self/smaps")
            .take(64 << 20)
            .read_to_string(&mut text)
            .expect("smaps is text");
        let mut inside = false;
        for line in text.lines() {
            if let Some((range, _)) = line.split_once(' ') {
                if let Some((a, b)) = range.split_once('-') {
                    if let (Ok(a), Ok(b)) =
                        (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16))
                    {
                        inside = (a..b).contains(&addr);
                        continue;
                    }
                }
            }
            if inside {
                if let Some(f) = line.strip_prefix("VmFlags:") {
                    return f.trim().to_string();
                }
            }
        }
        panic!("no mapping holds {addr:#x}");
    }

    fn marked(addr: usize) -> bool {
        flags_at(addr).split(' ').any(|f| f == "hg")
    }

    /// A block at the threshold is marked before it is touched; one just below it is not (it
    /// may share its pages with other blocks).
    #[test]
    fn large_blocks_are_marked() {
        let big = Layout::from_size_align(MMAP_THRESHOLD + (1 << 20), 64).unwrap();
        // SAFETY: a non-zero size; freed below with the same layout.
        let p = unsafe { Thp.alloc_zeroed(big) };
        assert!(!p.is_null());
        let mid = p as usize + big.size() / 2;
        assert!(marked(mid), "{:#x}: {}", mid, flags_at(mid));
        // SAFETY: allocated above with this layout.
        unsafe { Thp.dealloc(p, big) };
    }

    /// What the main heap grows by is marked on the next allocation. The growth here is a bare
    /// sbrk (glibc treats it as a foreign extension and leaves it alone), so the test needs no
    /// allocation from the main thread's arena.
    #[test]
    fn the_heap_growth_is_marked() {
        // The watch is off while the unmarked state is read (reading smaps allocates).
        thp::HEAP_MARKED.store(0, Ordering::Relaxed);
        // SAFETY: the 8 MiB added to the heap are this test's, never freed.
        let start = unsafe { libc::sbrk(8 << 20) } as usize;
        let probe = start + (4 << 20);
        assert!(!marked(probe), "marked with the watch off");
        thp::HEAP_MARKED.store(start, Ordering::Relaxed);
        let small = Layout::from_size_align(64, 8).unwrap();
        // SAFETY: a non-zero size; freed right after.
        unsafe { Thp.dealloc(Thp.alloc(small), small) };
        assert!(marked(probe), "{:#x}: {}", probe, flags_at(probe));
        assert!(thp::HEAP_MARKED.load(Ordering::Relaxed) >= start + (8 << 20));
    }
}
