//! A sharded base's rank reads only its own experts of a sparse layer's stacks from the
//! checkpoint (`rtune_model::moe::MoeMlp::load` with a transport): each layout of the tiny MoE
//! fixtures — Qwen3-MoE's and Mixtral's released per-expert tensors, gpt-oss's fused `(E, in, out)`
//! stacks and its MXFP4 blocks — gives rank `r` of 1 to 4 (and 9: one rank with none) exactly experts `span(E, 1, world, r)`
//! of the whole model's stacks, bit for bit (in the compute dtype, and as NF4 records expert by
//! expert), reading only those experts' bytes of the stack tensors. (The fused `(E, out, in)`
//! layout is `tests/shard.rs`' seeded Qwen3-MoE.)
//!
//! Tolerance: none; the pieces are the same bytes of the same file.

mod common;

use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};

use candle_core::{DType, Device, Tensor};
use rtune_experts::moe::{Nf4Stack, StackWeights};
use rtune_model::moe::MoeMlp;
use rtune_model::shard::{span, Piece};
use rtune_model::weights::{TensorSource, Weights};
use rtune_model::{Gather, ModelError};

/// A rank of `size` that loads only: the experts' load makes no collective.
struct Rank(usize, usize);

impl Gather for Rank {
    fn rank(&self) -> usize {
        self.0
    }
    fn size(&self) -> usize {
        self.1
    }
    fn all_gather_into(&self, what: &str, _: &[u8], _: &[usize], _: &mut [u8]) {
        panic!("{what}: loading the experts gathers nothing");
    }
}

/// The checkpoint, counting the bytes of the expert stacks (`*.experts.*`, their biases apart)
/// it hands out: a whole tensor's, or a piece's (what `Weights::get_piece` reads of the file).
struct Counting {
    w: Weights,
    bytes: AtomicUsize,
}

impl Counting {
    fn count(&self, name: &str, t: &Result<Tensor, ModelError>) {
        if let (true, Ok(t)) = (name.contains(".experts.") && !name.ends_with("_bias"), t) {
            self.bytes
                .fetch_add(t.elem_count() * t.dtype().size_in_bytes(), SeqCst);
        }
    }
}

impl TensorSource for Counting {
    fn tensor(&self, name: &str, shape: &[usize]) -> Result<Tensor, ModelError> {
        let t = self.w.tensor(name, shape);
        self.count(name, &t);
        t
    }
    fn stored(&self, name: &str, shape: &[usize]) -> Result<Tensor, ModelError> {
        let t = self.w.stored(name, shape);
        self.count(name, &t);
        t
    }
    fn has(&self, name: &str) -> bool {
        self.w.has(name)
    }
    fn piece(&self, name: &str, shape: &[usize], sp: Range<usize>) -> Result<Tensor, ModelError> {
        let t = self.w.piece(name, shape, sp);
        self.count(name, &t);
        t
    }
    fn stored_piece(
        &self,
        name: &str,
        shape: &[usize],
        sp: Range<usize>,
    ) -> Result<Tensor, ModelError> {
        let t = self.w.stored_piece(name, shape, sp);
        self.count(name, &t);
        t
    }
}

/// Sparse layer `l` of fixture `name`, loaded whole or as rank `rank` of `size`, and the bytes
/// of the stacks it read.
fn load(name: &str, nf4: Option<bool>, rank: Option<(usize, usize)>) -> (MoeMlp, usize) {
    let (dir, cfg) = common::fixture_config(name);
    let mc = cfg.moe.as_ref().unwrap();
    let l = mc.sparse_layers.iter().position(|&s| s).unwrap();
    let w = Counting {
        w: Weights::open(&dir, DType::F32, &Device::Cpu).unwrap(),
        bytes: AtomicUsize::new(0),
    };
    let comm = rank.map(|(r, s)| Rank(r, s));
    let layer = format!("model.layers.{l}");
    let m = MoeMlp::load(
        &w,
        &layer,
        mc,
        cfg.hidden_size,
        nf4,
        comm.as_ref().map(|c| c as &dyn Gather),
    )
    .unwrap();
    (m, w.bytes.load(SeqCst))
}

/// The whole stack's bytes for experts `mine`: dense f32 values, or NF4 records.
fn expected(whole: &StackWeights, mine: Range<usize>) -> Vec<u8> {
    match whole {
        StackWeights::Dense(_) | StackWeights::Panels(_) => {
            let t = whole.dense(&Device::Cpu).unwrap().unwrap();
            let t = t.narrow(0, mine.start, mine.len()).unwrap();
            let v = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            v.iter().flat_map(|x| x.to_le_bytes()).collect()
        }
        StackWeights::Nf4(s) => Nf4Stack {
            experts: s.experts[mine.clone()].to_vec(),
            dims: (mine.len(), s.dims.1, s.dims.2),
        }
        .records()
        .unwrap(),
    }
}

#[test]
fn a_rank_reads_and_keeps_only_its_experts_in_every_layout() {
    for name in [
        "tiny-qwen3-moe",
        "tiny-mixtral",
        "tiny-gpt-oss",
        "tiny-gpt-oss-mxfp4",
    ] {
        for nf4 in [None, Some(false), Some(true)] {
            let (whole, whole_read) = load(name, nf4, None);
            let e = whole.experts();
            // A world of 9 leaves the last rank no expert of 8: it still knows the stacks' kind.
            for size in [1, 2, 3, 4, 9] {
                for rank in 0..size {
                    let (m, read) = load(name, nf4, Some((rank, size)));
                    let mine = span(e, 1, size, rank);
                    let what = format!("{name} nf4 {nf4:?}: rank {rank} of {size}");
                    eprintln!(
                        "{what}: read {read} B of the stacks, the whole layer {whole_read} B"
                    );
                    assert_eq!(read * e, whole_read * mine.len(), "{what}");
                    let shards = m.shards.as_ref().unwrap();
                    for (shard, stack) in [
                        (&shards.gate_up, &whole.gate_up),
                        (&shards.down, &whole.down),
                    ] {
                        let got = match &shard.piece {
                            Piece::Dense { bytes, dtype } => {
                                assert_eq!((*dtype, nf4), (DType::F32, None), "{what}");
                                bytes
                            }
                            Piece::Nf4Experts {
                                records,
                                double_quant,
                                dtype,
                            } => {
                                assert_eq!((*dtype, Some(*double_quant)), (DType::F32, nf4));
                                records
                            }
                            Piece::Nf4(_) => panic!("{what}: an NF4 linear's piece"),
                        };
                        assert!(*got == expected(stack, mine.clone()), "{what}: its experts");
                    }
                }
            }
        }
    }
}
