//! [`Feed`]: the decoder layers of one pass in the order it uses them, a sharded base's next
//! layer gathered on another thread while this one computes.

use candle_core::Device;
use std::borrow::Cow;
use std::thread::JoinHandle;

use crate::gathered::{LayerRef, Planned, Sharded};
use crate::layer::Layer;
use crate::shard::Gather;

/// The decoder layers of one pass, in the order the pass uses them ([`Feed::next`]): a whole
/// base's borrowed; a sharded base's layers kept from an earlier pass as they are, the others
/// gathered — and, when the transport offers a [`Gather::background`], the next one's gathers
/// running on another thread while the caller computes this one. That thread only moves bytes
/// into buffers this one planned ([`Planned`]); this one makes them into the layer's tensors
/// when it needs the layer. (Buffers allocated by the other thread would come from its own
/// allocator arena, which keeps them when they are freed here: 2.2 layers more at the peak,
/// measured, instead of 1.)
///
/// Every rank makes the same gathers in the same order: the order and the kept layers are the
/// same on every rank (set by the same config), and the background thread gathers only between
/// two [`Feed::next`] calls, where the caller computes and makes no collective: this thread's
/// next gather, or any other collective, comes after it has waited for that thread.
pub(crate) struct Feed<'m> {
    layers: &'m [Layer],
    sharded: Option<&'m Sharded>,
    device: &'m Device,
    order: std::iter::Peekable<std::vec::IntoIter<usize>>,
    /// Layers at hand already (kept from the forward for the backward), with their index.
    ready: Vec<(usize, LayerRef<'m>)>,
    ahead: Option<Ahead>,
    /// With the device transport and prefetch: the next layer's gathers, launched on this thread
    /// (they run on the transport's stream while this layer computes), and its index.
    launched: Option<(usize, Planned)>,
}

/// A layer's gathers running on the background thread.
struct Ahead {
    index: usize,
    thread: Option<JoinHandle<candle_core::Result<Planned>>>,
}

impl Ahead {
    /// Waits for the gathers (under the transport's watch).
    fn join(mut self, comm: &dyn Gather) -> candle_core::Result<Planned> {
        let mut thread = self.thread.take();
        let mut joined = None;
        let what = format!("the gather of layer {} (prefetched)", self.index);
        comm.waiting(&what, &mut || joined = thread.take().map(JoinHandle::join));
        match joined {
            Some(Ok(planned)) => planned,
            _ => candle_core::bail!("{what}: the gathering thread panicked"),
        }
    }
}

impl Drop for Ahead {
    /// A pass that ends early (an error) still waits for the gather in flight: the transport
    /// must be idle before this thread's next collective.
    fn drop(&mut self) {
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl<'m> Feed<'m> {
    /// Layers `order` of `layers`, those in `ready` as they are.
    pub(crate) fn new(
        layers: &'m [Layer],
        sharded: Option<&'m Sharded>,
        device: &'m Device,
        order: Vec<usize>,
        ready: Vec<(usize, LayerRef<'m>)>,
    ) -> Self {
        Self {
            layers,
            sharded,
            device,
            order: order.into_iter().peekable(),
            ready,
            ahead: None,
            launched: None,
        }
    }

    /// The next layer of the order and its index (`None` past the last); the one after it is
    /// being gathered on the background thread when this returns.
    pub(crate) fn next(&mut self) -> candle_core::Result<Option<(usize, LayerRef<'m>)>> {
        let Some(i) = self.order.next() else {
            return Ok(None);
        };
        let layer = match self.ready.iter().position(|(j, _)| *j == i) {
            Some(at) => self.ready.swap_remove(at).1,
            None => match (self.sharded, self.ahead.take(), self.launched.take()) {
                (None, ..) => Cow::Borrowed(&self.layers[i]),
                (Some(s), Some(a), _) if a.index == i => {
                    Cow::Owned(a.join(&*s.comm)?.finish(self.device)?)
                }
                (Some(_), _, Some((j, planned))) if j == i => {
                    Cow::Owned(planned.finish(self.device)?)
                }
                (Some(s), ..) => Cow::Owned(s.gather_layer(&self.layers[i], self.device)?),
            },
        };
        let next = self.order.peek().copied();
        if let (Some(j), Some(s)) = (next, self.sharded.filter(|s| s.launch_ahead)) {
            if !self.ready.iter().any(|(k, _)| *k == j) {
                self.launched = Some((j, s.launch_layer(&self.layers[j])?));
            }
        }
        let bg = self.sharded.and_then(|s| s.background.clone());
        if let (Some(j), Some(bg)) = (next, bg) {
            if !self.ready.iter().any(|(k, _)| *k == j) {
                let mut planned = Planned::new(&self.layers[j], bg.size())?;
                let thread = std::thread::Builder::new()
                    .name("rtune-gather".into())
                    .spawn(move || planned.fill(&*bg, None).map(|()| planned))
                    .map_err(|e| {
                        candle_core::Error::Msg(format!("a thread to gather layer {j}: {e}"))
                    })?;
                self.ahead = Some(Ahead {
                    index: j,
                    thread: Some(thread),
                });
            }
        }
        Ok(Some((i, layer)))
    }
}
