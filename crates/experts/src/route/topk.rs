//! torch's CPU `topk` (largest, sorted), ties included: which of several equal scores a router
//! keeps, and in which order, is what torch's kernel (`at::native::topk_impl_loop`) leaves, and
//! that is the order of the C++ standard library's algorithms it calls on `(value, index)` pairs
//! compared by value alone (NaN ranking first). With `k · 64 ≤ n` it is `std::partial_sort` of the
//! first `k`; otherwise `std::nth_element` at `k − 1`, then `std::sort` of the first `k − 1`. This
//! module runs libstdc++'s versions of them step for step (the heap select, the median-of-three
//! introselect and introsort, the insertion sorts), since torch's Linux wheels are built against
//! it. No tie order is promised by either library, so the equivalence is measured, not derived:
//! `tests/parity/golden_topk.safetensors` (torch's indices on rows made of a few repeated values,
//! NaN among them, on both paths and past the 16-element insertion sort) and transformers' routers
//! on tied logits (`route/tests.rs`).
//!
//! Without ties this is the one sorted top-k. Its cost: 2048 rows of 128 scores, top-8, softmax
//! included, 1.9-2.1 ms on one thread of the 2-core AVX2 EPYC, against 2.2-2.3 ms for the
//! one-pass insertion it replaced (that kept the lower index first on ties).

/// A score and its index.
type Elem = (f32, u32);

/// `a` ranks before `b`: a NaN before a number, else the larger value (torch's comparator for
/// `largest`). Equal values are unordered: where they land is the algorithms' doing.
#[inline]
fn before(a: Elem, b: Elem) -> bool {
    (a.0.is_nan() && !b.0.is_nan()) || a.0 > b.0
}

/// `⌊log₂ n⌋`, `n ≥ 1` (libstdc++'s `__lg`, the depth limit's base).
fn lg(n: usize) -> usize {
    (usize::BITS - 1 - n.leading_zeros()) as usize
}

/// A top-k's buffers, reused from row to row.
#[derive(Debug, Default)]
pub(super) struct TopK {
    /// The row being ranked, as `(value, index)` pairs.
    q: Vec<Elem>,
    /// The chosen indices.
    top: Vec<usize>,
}

impl TopK {
    /// The indices of the `k` largest of `x` (`k` clamped to `x.len()`), largest first, as
    /// torch's `topk` chooses and orders them.
    pub(super) fn of(&mut self, x: &[f32], k: usize) -> &[usize] {
        let (n, q) = (x.len(), &mut self.q);
        let k = k.min(n);
        self.top.clear();
        if k == 0 {
            return &self.top;
        }
        q.clear();
        q.extend(x.iter().enumerate().map(|(i, &v)| (v, i as u32)));
        if k * 64 <= n {
            heap_select(q, k);
            sort_heap(&mut q[..k]);
        } else {
            nth_element(q, k - 1);
            sort(&mut q[..k - 1]);
        }
        self.top.extend(q[..k].iter().map(|&(_, i)| i as usize));
        &self.top
    }
}

/// libstdc++'s `__insertion_sort`: each element moved left past those it ranks before (to the
/// front in one move when it ranks before the first).
fn insertion_sort(s: &mut [Elem]) {
    for i in 1..s.len() {
        let v = s[i];
        if before(v, s[0]) {
            s.copy_within(0..i, 1);
            s[0] = v;
        } else {
            linear_insert(s, i);
        }
    }
}

/// `__unguarded_linear_insert`: `s[i]` moved left while it ranks before its neighbour. Something
/// to its left does not rank after it (the caller's guarantee), so `j` stays above 0.
fn linear_insert(s: &mut [Elem], i: usize) {
    let v = s[i];
    let mut j = i;
    while before(v, s[j - 1]) {
        s[j] = s[j - 1];
        j -= 1;
    }
    s[j] = v;
}

/// `__move_median_to_first`: the median of `s[a]`, `s[b]`, `s[c]` swapped into `s[r]`.
fn move_median_to_first(s: &mut [Elem], r: usize, (a, b, c): (usize, usize, usize)) {
    let m = if before(s[a], s[b]) {
        if before(s[b], s[c]) {
            b
        } else if before(s[a], s[c]) {
            c
        } else {
            a
        }
    } else if before(s[a], s[c]) {
        a
    } else if before(s[b], s[c]) {
        c
    } else {
        b
    };
    s.swap(r, m);
}

/// `__unguarded_partition` of `s[first..last]` around `s[pivot]` (outside that range): the
/// median-of-three left an element on each side that stops each scan.
fn unguarded_partition(s: &mut [Elem], mut first: usize, mut last: usize, pivot: usize) -> usize {
    loop {
        while before(s[first], s[pivot]) {
            first += 1;
        }
        last -= 1;
        while before(s[pivot], s[last]) {
            last -= 1;
        }
        if first >= last {
            return first;
        }
        s.swap(first, last);
        first += 1;
    }
}

/// `__unguarded_partition_pivot` of `s[first..last]` (at least 4 elements): the median of the
/// second, middle and last moved to the front, the rest partitioned around it.
fn partition_pivot(s: &mut [Elem], first: usize, last: usize) -> usize {
    let mid = first + (last - first) / 2;
    move_median_to_first(s, first, (first + 1, mid, last - 1));
    unguarded_partition(s, first + 1, last, first)
}

/// `__adjust_heap` on the heap `s[..len]`: the hole at `hole` sunk to a leaf along the children
/// that rank first, then `v` pushed up from there (`__push_heap`) no higher than `hole` was.
fn adjust_heap(s: &mut [Elem], hole: usize, len: usize, v: Elem) {
    let top = hole;
    let mut hole = hole;
    let mut child = hole;
    while child < (len - 1) / 2 {
        child = 2 * (child + 1);
        if before(s[child], s[child - 1]) {
            child -= 1;
        }
        s[hole] = s[child];
        hole = child;
    }
    if len.is_multiple_of(2) && child == (len - 2) / 2 {
        child = 2 * (child + 1);
        s[hole] = s[child - 1];
        hole = child - 1;
    }
    while hole > top {
        let parent = (hole - 1) / 2;
        if !before(s[parent], v) {
            break;
        }
        s[hole] = s[parent];
        hole = parent;
    }
    s[hole] = v;
}

/// `__make_heap` over all of `s`.
fn make_heap(s: &mut [Elem]) {
    let len = s.len();
    if len < 2 {
        return;
    }
    let mut parent = (len - 2) / 2;
    loop {
        adjust_heap(s, parent, len, s[parent]);
        if parent == 0 {
            return;
        }
        parent -= 1;
    }
}

/// `__pop_heap` of the heap `s[..len]` into `s[result]` (`result ≥ len`, or `len` itself when
/// sorting), `s[result]`'s old value sifted into the heap.
fn pop_heap(s: &mut [Elem], len: usize, result: usize) {
    let v = s[result];
    s[result] = s[0];
    adjust_heap(s, 0, len, v);
}

/// `__heap_select`: a heap of `s[..middle]`, each later element that ranks before its top
/// swapped in.
fn heap_select(s: &mut [Elem], middle: usize) {
    make_heap(&mut s[..middle]);
    for i in middle..s.len() {
        if before(s[i], s[0]) {
            pop_heap(s, middle, i);
        }
    }
}

/// `__sort_heap`: the heap `s` popped from the back.
fn sort_heap(s: &mut [Elem]) {
    let mut last = s.len();
    while last > 1 {
        last -= 1;
        pop_heap(s, last, last);
    }
}

/// `std::nth_element(s, nth)` (`__introselect`): partitions until at most 3 elements are left
/// around `nth`, then an insertion sort; past `2⌊log₂ n⌋` partitions, a heap select.
fn nth_element(s: &mut [Elem], nth: usize) {
    let (mut first, mut last) = (0, s.len());
    if nth >= last {
        return;
    }
    let mut depth = 2 * lg(last);
    while last - first > 3 {
        if depth == 0 {
            heap_select(&mut s[first..last], nth + 1 - first);
            s.swap(first, nth);
            return;
        }
        depth -= 1;
        let cut = partition_pivot(s, first, last);
        if cut <= nth {
            first = cut;
        } else {
            last = cut;
        }
    }
    insertion_sort(&mut s[first..last]);
}

/// Above this many elements `std::sort` partitions; at or below, insertion sort (`_S_threshold`).
const SORT_THRESHOLD: usize = 16;

/// `std::sort(s)`: introsort down to runs of 16, then the final insertion sort (guarded over the
/// first 16, unguarded after them).
fn sort(s: &mut [Elem]) {
    if s.is_empty() {
        return;
    }
    introsort(s, 0, s.len(), 2 * lg(s.len()));
    if s.len() > SORT_THRESHOLD {
        insertion_sort(&mut s[..SORT_THRESHOLD]);
        for i in SORT_THRESHOLD..s.len() {
            linear_insert(s, i);
        }
    } else {
        insertion_sort(s);
    }
}

/// `__introsort_loop` over `s[first..last]`: partitions, recursing into the right part; past
/// `depth` partitions a heap sort.
fn introsort(s: &mut [Elem], first: usize, mut last: usize, mut depth: usize) {
    while last - first > SORT_THRESHOLD {
        if depth == 0 {
            let part = &mut s[first..last];
            let len = part.len();
            heap_select(part, len);
            sort_heap(part);
            return;
        }
        depth -= 1;
        let cut = partition_pivot(s, first, last);
        introsort(s, cut, last, depth);
        last = cut;
    }
}
