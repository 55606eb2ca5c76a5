//! The plan and its execution against a host fake of NCCL's collectives: every rank of a world of
//! 1–4 issues its plan into a recorder ([`Rank`]), then [`World::run`] plays the recorded calls
//! with `ncclAllGather`'s, `ncclBroadcast`'s and a group's semantics over in-process buffers. It
//! refuses what NCCL would hang or fault on (ranks whose calls differ, a read past a send buffer,
//! a write past the receive buffer, two writes into the same bytes of one group, a group left
//! open), and the gathered bytes must be the ranks' shards concatenated in rank order. This tests
//! the plan and `execute`, not NCCL.

use super::*;
use rtune_model::shard::span;

/// One call as a rank issued it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    AllGather(usize),
    GroupStart,
    Broadcast {
        root: usize,
        at: usize,
        count: usize,
    },
    GroupEnd,
}

/// A rank's [`Primitives`]: records the calls (the fake has no stream: the world plays them
/// once every rank has issued its own, as NCCL runs a collective once every rank joined).
#[derive(Default)]
struct Rank {
    ops: Vec<Op>,
    /// Fail the n-th broadcast (0-based), as an NCCL call returning an error.
    fail_broadcast: Option<usize>,
}

impl Primitives for Rank {
    type Error = String;
    fn all_gather(&mut self, count: usize) -> Result<(), String> {
        self.ops.push(Op::AllGather(count));
        Ok(())
    }
    fn group_start(&mut self) -> Result<(), String> {
        self.ops.push(Op::GroupStart);
        Ok(())
    }
    fn broadcast(&mut self, root: usize, at: usize, count: usize) -> Result<(), String> {
        let n = self
            .ops
            .iter()
            .filter(|o| matches!(o, Op::Broadcast { .. }))
            .count();
        if self.fail_broadcast == Some(n) {
            return Err(format!("broadcast {n} failed"));
        }
        self.ops.push(Op::Broadcast { root, at, count });
        Ok(())
    }
    fn group_end(&mut self) -> Result<(), String> {
        self.ops.push(Op::GroupEnd);
        Ok(())
    }
}

/// Every rank's send buffer (its shard) and receive buffer.
struct World {
    mine: Vec<Vec<u8>>,
    out: Vec<Vec<u8>>,
}

impl World {
    /// Ranks with `counts[r]` distinct pseudo-random bytes each, and receive buffers of `total`
    /// bytes filled with a marker (a byte no call writes stays visible).
    fn new(counts: &[usize], total: usize, seed: u64) -> Self {
        let mut x = seed | 1;
        let mut byte = || {
            // xorshift64
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        };
        let mine = counts
            .iter()
            .map(|&n| (0..n).map(|_| byte()).collect())
            .collect();
        Self {
            mine,
            out: vec![vec![0xA5; total]; counts.len()],
        }
    }

    /// Plays every rank's recorded calls (collective: all ranks must have issued the same).
    fn run(&mut self, ranks: &[Rank]) -> Result<(), String> {
        let ops = &ranks[0].ops;
        if let Some(r) = ranks.iter().position(|r| &r.ops != ops) {
            return Err(format!(
                "rank {r} issued {:?}, rank 0 {ops:?}: the collective would hang",
                ranks[r].ops
            ));
        }
        let mut group: Option<Vec<(usize, usize, usize)>> = None;
        for op in ops {
            match (*op, &mut group) {
                (Op::GroupStart, None) => group = Some(Vec::new()),
                (Op::GroupStart, Some(_)) => return Err("a group inside a group".into()),
                (Op::Broadcast { root, at, count }, Some(g)) => g.push((root, at, count)),
                (Op::Broadcast { root, at, count }, None) => {
                    self.broadcasts(&[(root, at, count)])?
                }
                (Op::GroupEnd, Some(g)) => {
                    let g = std::mem::take(g);
                    group = None;
                    self.broadcasts(&g)?;
                }
                (Op::GroupEnd, None) => return Err("ncclGroupEnd without a start".into()),
                (Op::AllGather(count), _) => self.all_gather(count)?,
            }
        }
        match group {
            Some(_) => Err("a group left open".into()),
            None => Ok(()),
        }
    }

    fn all_gather(&mut self, count: usize) -> Result<(), String> {
        let size = self.mine.len();
        if let Some(r) = (0..size).find(|&r| self.mine[r].len() < count) {
            return Err(format!(
                "all-gather reads {count} bytes of rank {r}'s shorter shard"
            ));
        }
        if count * size > self.out[0].len() {
            return Err(format!(
                "all-gather writes past the {}-byte buffer",
                self.out[0].len()
            ));
        }
        for out in &mut self.out {
            for (r, m) in self.mine.iter().enumerate() {
                out[r * count..(r + 1) * count].copy_from_slice(&m[..count]);
            }
        }
        Ok(())
    }

    /// Broadcasts launched together: their receive ranges must not overlap (the group runs them
    /// at once).
    fn broadcasts(&mut self, group: &[(usize, usize, usize)]) -> Result<(), String> {
        let mut ranges: Vec<(usize, usize)> =
            group.iter().map(|&(_, at, n)| (at, at + n)).collect();
        ranges.sort();
        if ranges.windows(2).any(|w| w[1].0 < w[0].1) {
            return Err(format!("broadcasts of one group overlap: {group:?}"));
        }
        for &(root, at, count) in group {
            let Some(src) = self.mine.get(root) else {
                return Err(format!("broadcast from rank {root} of {}", self.mine.len()));
            };
            if count > src.len() {
                return Err(format!(
                    "broadcast reads {count} bytes of rank {root}'s {}",
                    src.len()
                ));
            }
            let src = src[..count].to_vec();
            for out in &mut self.out {
                let Some(dst) = out.get_mut(at..at + count) else {
                    return Err(format!(
                        "broadcast writes {at}..{} past the buffer",
                        at + count
                    ));
                };
                dst.copy_from_slice(&src);
            }
        }
        Ok(())
    }
}

/// Every rank executes `p` (as rank r would, with its own buffers) and the world plays them:
/// each rank's gathered buffer, or what the fake refused.
fn gather(p: &Plan, seed: u64) -> Result<(Vec<u8>, Vec<Vec<u8>>), String> {
    let size = p.counts.len();
    let mut world = World::new(&p.counts, p.total(), seed);
    let mut ranks: Vec<Rank> = (0..size).map(|_| Rank::default()).collect();
    for r in &mut ranks {
        execute(p, r)?;
    }
    world.run(&ranks)?;
    Ok((world.mine.concat(), world.out))
}

/// A weight's shards' byte counts as the sharded base cuts them: `n` elements in units of
/// `unit`, `elem` bytes each (`rtune_model::shard::span`).
fn counts(n: usize, unit: usize, elem: usize, size: usize) -> Vec<usize> {
    (0..size)
        .map(|r| span(n, unit, size, r).len() * elem)
        .collect()
}

#[test]
fn equal_shards_are_one_all_gather_and_unequal_ones_a_group_of_broadcasts() {
    assert_eq!(
        plan(&[8, 8, 8]).calls,
        [Call::AllGather { count: 8 }],
        "a world that divides the weight"
    );
    assert_eq!(
        plan(&[5]).calls,
        [Call::AllGather { count: 5 }],
        "a world of one"
    );
    // 7 units of 2 bytes on 4 ranks: 2, 2, 2, 1 units; then 2 units on 4 ranks: 1, 1, 0, 0.
    let p = plan(&counts(7, 1, 2, 4));
    assert_eq!(p.counts, [4, 4, 4, 2]);
    assert_eq!(p.offsets, [0, 4, 8, 12]);
    let b = |root, at, count| Bcast { root, at, count };
    assert_eq!(
        p.calls,
        [Call::Broadcasts(vec![
            b(0, 0, 4),
            b(1, 4, 4),
            b(2, 8, 4),
            b(3, 12, 2)
        ])]
    );
    let p = plan(&counts(2, 1, 4, 4));
    assert_eq!(
        p.calls,
        [Call::Broadcasts(vec![b(0, 0, 4), b(1, 4, 4)])],
        "empty shards make no call"
    );
    assert!(plan(&[0, 0]).calls.is_empty(), "nothing to move");
    assert!(plan(&[16, 16, 16]).aligned());
    assert!(!plan(&counts(7, 1, 2, 4)).aligned());
}

#[test]
fn every_rank_gathers_the_concatenation_for_worlds_of_one_to_four() {
    // (elements, unit, bytes an element): dense bf16/f32 weights that split anywhere, NF4 codes
    // (unit 64 elements, half a byte each: 32 bytes a block), a weight smaller than the world,
    // an empty one.
    let weights = [
        (4096 * 3 + 5, 1, 2),
        (1000, 1, 4),
        (64 * 37, 64, 1),
        (64 * 256 * 3 + 64 * 5, 64 * 256, 1),
        (3, 1, 2),
        (0, 1, 4),
    ];
    let mut unequal = 0;
    for size in 1..=4 {
        for (k, &(n, unit, elem)) in weights.iter().enumerate() {
            let c = counts(n, unit, elem, size);
            let seed = (size * 31 + k) as u64;
            for p in [plan(&c), broadcasts(&c)] {
                let (want, outs) = gather(&p, seed).unwrap_or_else(|e| panic!("{c:?}: {e}"));
                assert_eq!(want.len(), p.total());
                for (r, out) in outs.iter().enumerate() {
                    assert!(
                        out == &want,
                        "rank {r} of {size}, counts {c:?}, {:?}",
                        p.calls
                    );
                }
            }
            unequal += usize::from(c.windows(2).any(|w| w[0] != w[1]));
        }
    }
    assert!(unequal >= 8, "the cases include unequal shards ({unequal})");
}

#[test]
fn a_failed_broadcast_still_closes_its_group() {
    let p = plan(&[4, 4, 2]);
    let mut rank = Rank {
        fail_broadcast: Some(1),
        ..Rank::default()
    };
    let err = execute(&p, &mut rank).expect_err("the second broadcast fails");
    assert_eq!(err, "broadcast 1 failed");
    assert_eq!(
        rank.ops,
        [
            Op::GroupStart,
            Op::Broadcast {
                root: 0,
                at: 0,
                count: 4
            },
            Op::GroupEnd
        ]
    );
}

/// The fake refuses what NCCL would not survive, so the gathers above passing means something.
#[test]
fn the_fake_refuses_mismatched_calls_and_out_of_bounds_slots() {
    let c = [4, 4, 2];
    let run = |ops: Vec<Vec<Op>>| {
        let mut w = World::new(&c, 10, 1);
        let ranks: Vec<Rank> = ops
            .into_iter()
            .map(|ops| Rank {
                ops,
                fail_broadcast: None,
            })
            .collect();
        w.run(&ranks)
    };
    let bc = |root, at, count| Op::Broadcast { root, at, count };
    let good = vec![
        Op::GroupStart,
        bc(0, 0, 4),
        bc(1, 4, 4),
        bc(2, 8, 2),
        Op::GroupEnd,
    ];
    assert!(run(vec![good.clone(); 3]).is_ok());
    let mut other = good.clone();
    other[3] = bc(2, 8, 1);
    assert!(
        run(vec![good.clone(), good.clone(), other]).is_err(),
        "ranks differ"
    );
    let overlap = vec![Op::GroupStart, bc(0, 0, 4), bc(1, 3, 4), Op::GroupEnd];
    assert!(run(vec![overlap; 3]).is_err(), "overlapping slots");
    assert!(
        run(vec![vec![bc(2, 8, 3)]; 3]).is_err(),
        "reads past a shard"
    );
    assert!(
        run(vec![vec![bc(0, 8, 4)]; 3]).is_err(),
        "writes past the buffer"
    );
    assert!(
        run(vec![vec![Op::AllGather(4)]; 3]).is_err(),
        "all-gather of unequal shards"
    );
    assert!(
        run(vec![vec![Op::GroupStart]; 3]).is_err(),
        "group left open"
    );
}
