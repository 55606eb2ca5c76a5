//! A contiguous f32 CPU tensor's elements read in place, for the experts' CPU kernels
//! ([`super::grouped`], [`super::panels`]).

use std::ops::Deref;

use candle_core::{bail, CpuStorage, Result, Storage, Tensor};

/// A contiguous f32 CPU tensor's elements, read in place (the read guard held while borrowed).
pub(super) struct View<'a> {
    guard: Box<dyn Deref<Target = Storage> + 'a>,
    start: usize,
    len: usize,
}

impl View<'_> {
    /// `what` names the tensor in the error.
    pub(super) fn of<'a>(t: &'a Tensor, what: &str) -> Result<View<'a>> {
        if !t.is_contiguous() {
            bail!("moe: {what} {:?} is not contiguous", t.dims());
        }
        let (guard, layout) = t.storage_and_layout();
        if !matches!(&*guard, Storage::Cpu(CpuStorage::F32(_))) {
            bail!("moe: {what} is not f32 on the CPU");
        }
        let start = layout.start_offset();
        Ok(View {
            guard: Box::new(guard),
            start,
            len: t.elem_count(),
        })
    }

    pub(super) fn s(&self) -> &[f32] {
        match &**self.guard {
            Storage::Cpu(CpuStorage::F32(v)) => &v[self.start..self.start + self.len],
            // Checked in `of`.
            _ => &[],
        }
    }
}
