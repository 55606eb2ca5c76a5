//! GRPO as a [`Recipe`] (`[train] objective = "grpo"`, TRL 1.16's `GRPOTrainer`):
//!
//! - [`draw`](Recipe::draw): every `steps_per_generation × num_iterations` micro-batches, a new
//!   generation batch of `micro_batch_size × steps_per_generation` completions
//!   (`rollout.rs`: sampled, scored, advantages, old and reference log-probs), its lines appended
//!   to `rollouts.jsonl`; the batch is shuffled (TRL's `shuffle_sequence_dict`, a seeded
//!   permutation: [`rollout::shuffled`]) and each micro-batch is the next `micro_batch_size` of
//!   its shuffled rows (TRL's buffer); on W ranks each samples its share and the shares are
//!   gathered (`Grpo::generate`), rank 0 alone writing rollouts.jsonl;
//! - [`pass`](Recipe::pass): the head hands every position's `−log softmax(z / T)[target]`, the
//!   completion tokens' log-probs go through [`policy_loss`] and its `∂loss/∂logp` back to the
//!   model's backward as `−∂loss/∂nll`;
//! - [`state`](Recipe::state): the sampler's RNG, the unfinished generation batch and
//!   rollouts.jsonl's length, so a resumed run samples, trains and writes what an uninterrupted
//!   one does.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use rtune_config::{Grpo as GrpoConfig, RunConfig};
use rtune_data::{Batcher, MicroBatch, Prompt, Tokenizer};
use rtune_infer::warp::Warpers;
use rtune_model::AuxShare;
use rtune_reward::{Reward, Rewards, Sample};

use super::rollout::{self, Rng, Row, Sampler};
use super::{metrics, policy_loss, Aggregation, Normalizer, PolicyConfig, Rows};
use crate::dataset::RunData;
use crate::evaluate::{no_dropout, EvalMetrics};
use crate::objective::{About, HeadLoss, Live, Micro, Recipe, ReferencePass};
use crate::TrainError;

pub const ROLLOUTS: &str = "rollouts.jsonl";

/// A prompt row in the stream, with its index in the training files' order.
pub struct PromptRow {
    index: usize,
    prompt: Prompt,
}

impl rtune_data::Row for PromptRow {
    fn tokens(&self) -> usize {
        self.prompt.ids.len()
    }
}

/// The generation batch being trained on, as a checkpoint keeps it.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Generation {
    /// In generation order (a prompt's group consecutive: the metrics read groups).
    rows: Vec<Row>,
    /// The order the rows train in: `order[k]` is row `k` of the shuffled batch (empty, from a
    /// checkpoint written before the shuffle: generation order).
    #[serde(default)]
    order: Vec<usize>,
    /// Masked completion tokens of the whole batch (TRL's `num_items_in_batch`).
    tokens: f32,
    /// Micro-batches drawn from it so far.
    served: usize,
}

/// What [`Recipe::state`] saves.
#[derive(Serialize, Deserialize)]
struct State {
    rng: Rng,
    rollouts_bytes: u64,
    generation: Option<Generation>,
    /// The ranks that sampled `generation` (its micro-batches' order depends on it).
    #[serde(default = "one")]
    world: usize,
}

fn one() -> usize {
    1
}

/// One micro-batch: its rows as the model takes them and as the loss reads them.
pub struct GrpoMicro {
    packed: rollout::Packed,
    rows: Vec<Row>,
    tokens: f32,
}

impl Micro for GrpoMicro {
    fn batch(&self) -> &MicroBatch {
        &self.packed.batch
    }
    fn batch_mut(&mut self) -> &mut MicroBatch {
        &mut self.packed.batch
    }
}

/// The GRPO recipe (module docs).
pub struct Grpo {
    g: GrpoConfig,
    policy: PolicyConfig,
    specs: Vec<Reward>,
    rewards: Option<Rewards>,
    tok: Option<Tokenizer>,
    stop: Vec<u32>,
    train: Vec<PromptRow>,
    stream: Option<Batcher<PromptRow>>,
    rng: Rng,
    generation: Option<Generation>,
    /// β > 0 with `init_from`: that adapter, frozen, is the reference (TRL copies a PEFT model's
    /// adapter as its "ref" adapter); `None`: the base alone.
    ref_adapter: Option<rtune_lora::Adapter>,
    /// `[lora] init_from` is set.
    init_from: bool,
    micro_batch: usize,
    grad_accum: usize,
    run_dir: PathBuf,
    privacy: rtune_fsio::Privacy,
    rollouts_bytes: u64,
    /// rollouts.jsonl opened this attempt (a fresh run starts it empty; a resume cuts it back).
    rollouts_open: bool,
    resumed: bool,
    /// The ranks of the run (set by each [`Recipe::draw`]; the loss's normaliser reads it).
    world: usize,
    /// The ranks of the resumed checkpoint's run, until the first draw compares them.
    saved_world: Option<usize>,
    /// `[distributed] shard_base` (refused on several ranks: [`Recipe::about`]).
    shard_base: bool,
}

impl Grpo {
    pub fn new(g: GrpoConfig, cfg: &RunConfig) -> Self {
        let policy = PolicyConfig {
            loss_type: g.loss_type,
            level: g.importance_sampling_level,
            epsilon_low: g.epsilon as f32,
            epsilon_high: g.epsilon_high as f32,
            delta: g.delta.map(|d| d as f32),
            beta: g.beta as f32,
            ..PolicyConfig::default()
        };
        Grpo {
            g,
            policy,
            specs: cfg.rewards.clone(),
            rewards: None,
            tok: None,
            stop: Vec::new(),
            train: Vec::new(),
            stream: None,
            // The sampler's stream is its own: the seed's bits moved off the data order's.
            rng: Rng(cfg.train.seed.rotate_left(29) ^ 0x6772_706F),
            generation: None,
            ref_adapter: None,
            init_from: cfg.lora.init_from.is_some(),
            micro_batch: cfg.train.micro_batch_size,
            grad_accum: cfg.train.grad_accum,
            run_dir: cfg.output.dir.clone(),
            privacy: rtune_fsio::Privacy {
                private: cfg.output.private,
            },
            rollouts_bytes: 0,
            rollouts_open: false,
            resumed: false,
            world: 1,
            saved_world: None,
            shard_base: cfg.distributed.shard_base,
        }
    }

    fn warpers(&self) -> Warpers {
        Warpers {
            temperature: self.g.temperature as f32,
            top_k: self.g.top_k,
            top_p: self.g.top_p as f32,
            min_p: self.g.min_p.map(|p| p as f32),
            repetition_penalty: self.g.repetition_penalty as f32,
        }
    }

    /// Whether TRL keeps the sampling policy's log-probs (`num_iterations > 1`, or a batch
    /// trained over more micro-batches than one optimizer step).
    fn keeps_old(&self) -> bool {
        self.g.num_iterations > 1 || self.g.steps_per_generation > self.grad_accum
    }

    /// Samples, scores and prepares the next generation batch (module docs of `rollout.rs`).
    ///
    /// On W ranks, as TRL's `_generate_and_score_completions`: the batch is W shares of
    /// `micro_batch_size × steps_per_generation` completions (whole groups: checked by the
    /// config), rank r sampling, scoring and computing the old/reference log-probs of share r
    /// (every rank draws the whole batch's prompts from its copy of the stream and takes its
    /// share); the shares are then gathered in rank order, so that every rank holds the whole
    /// batch (the advantages over whole groups, `scale_rewards = "batch"` over the batch, the
    /// global token count, the metrics, and a checkpoint any rank can resume from). Completion
    /// i of the batch samples from its own stream ([`rollout::Rng::stream`]), so the batch is
    /// the same on any number of ranks.
    fn generate(&mut self, live: &Live) -> Result<(), TrainError> {
        let step = live.step + 1;
        let group = self.g.num_generations;
        let (w, rank) = (live.world.size, live.world.rank);
        let share = self.micro_batch * self.g.steps_per_generation;
        let stream = self
            .stream
            .as_mut()
            .expect("the prompts' stream is made at start");
        let per = share / group;
        let picked: Vec<(usize, Prompt)> = stream
            .next_rows(per * w)
            .into_iter()
            .skip(rank * per)
            .take(per)
            .map(|p| (p.index, p.prompt.clone()))
            .collect();
        let ids: Vec<Vec<u32>> = picked.iter().map(|(_, p)| p.ids.clone()).collect();
        let lc = no_dropout(live.adapter);
        let sampler = Sampler {
            warpers: self.warpers(),
            max_new: self.g.max_completion_length,
            stop: &self.stop,
        };
        let base = self.rng.next_u64();
        // The training order of the whole batch (every rank draws the same), from a stream of
        // its own: the completions sample what they did before the shuffle existed.
        let order = rollout::shuffled(share * w, &mut Rng::stream(base, usize::MAX));
        let mut rngs: Vec<Rng> = (0..picked.len() * group)
            .map(|c| Rng::stream(base, rank * share + c))
            .collect();
        let started = std::time::Instant::now();
        let done = rollout::sample(live.model, &lc, &ids, group, &sampler, &mut rngs)?;
        // The rate of sampling alone (TRL #2610: rollouts are where the time goes), for the log
        // and `benches/grpo_sampling.sh`; this rank's share.
        let secs = started.elapsed().as_secs_f64();
        let sampled: usize = done.iter().map(|(c, _)| c.len()).sum();
        tracing::info!(
            "step {step}: sampled {} completions, {sampled} tokens in {secs:.2} s ({:.1} tokens/s)",
            done.len(),
            sampled as f64 / secs.max(1e-9)
        );
        let tok = self.tok.as_ref();
        let mut texts: Vec<String> = done
            .iter()
            .map(|(c, _)| match tok {
                Some(t) => Ok(t.decode(c, true)?),
                None => Ok(String::new()),
            })
            .collect::<Result<_, TrainError>>()?;
        let samples: Vec<Sample> = (done.iter().zip(&texts).enumerate())
            .map(|(i, ((c, _), text))| {
                let p = &picked[i / group].1;
                Sample {
                    prompt: &p.prompt,
                    completion: text,
                    completion_ids: c,
                    columns: &p.columns,
                }
            })
            .collect();
        let rewards = match self.rewards.as_mut() {
            Some(r) => r,
            None => self.rewards.insert(Rewards::start(&self.specs)?),
        };
        let scores = rewards.score(step as u64, &samples)?;
        // This rank's rows; the reward's total and the advantages follow the gather.
        let mut rows: Vec<Row> = done
            .into_iter()
            .enumerate()
            .map(|(i, (completion, truncated))| Row {
                prompt_index: picked[i / group].0,
                prompt: ids[i / group].clone(),
                completion,
                truncated,
                rewards: scores.per_reward.iter().map(|r| r[i]).collect(),
                reward: None,
                advantage: 0.0,
                std_zero: false,
                old: None,
                reference: None,
            })
            .collect();
        let refs: Vec<&Row> = rows.iter().collect();
        let (t, pad) = (self.g.temperature, live.pad_id);
        let old = match self.keeps_old() {
            true => Some(rollout::completion_logps(
                live.model,
                Some(&lc),
                &refs,
                t,
                pad,
                self.micro_batch,
            )?),
            false => None,
        };
        let ref_lc = self.ref_adapter.as_ref().map(no_dropout);
        let reference = match self.g.beta > 0.0 {
            true => Some(rollout::completion_logps(
                live.model,
                ref_lc.as_ref(),
                &refs,
                t,
                pad,
                self.micro_batch,
            )?),
            false => None,
        };
        for (i, r) in rows.iter_mut().enumerate() {
            r.old = old.as_ref().map(|o| o[i].clone());
            r.reference = reference.as_ref().map(|o| o[i].clone());
        }
        if live.world.is_distributed() {
            (rows, texts) = gather(live.world, step, &rows, &texts)?;
        }
        let per_reward: Vec<Vec<Option<f64>>> = (0..scores.names.len())
            .map(|f| rows.iter().map(|r| r.rewards[f]).collect())
            .collect();
        let per: Vec<Vec<f32>> = (rows.iter())
            .map(|r| {
                (r.rewards.iter())
                    .map(|v| v.map_or(f32::NAN, |v| v as f32))
                    .collect()
            })
            .collect();
        let weights: Vec<f32> = scores.weights.iter().map(|w| *w as f32).collect();
        let scale = self.g.scale_rewards;
        let adv = super::advantages(&per, &weights, group, scale, Aggregation::SumThenNormalize);
        let total = rtune_reward::Scores {
            per_reward,
            ..scores
        }
        .total();
        for (i, r) in rows.iter_mut().enumerate() {
            r.reward = (!total[i].is_nan()).then_some(total[i]);
            r.advantage = adv.advantages[i];
            r.std_zero = adv.std_zero[i];
        }
        let mask_truncated = self.g.mask_truncated_completions;
        let tokens = (rows.iter())
            .map(|r| rollout::row_mask(r, mask_truncated) * r.completion.len() as f32)
            .sum();
        let names: Vec<String> = self.specs.iter().map(|r| r.name.clone()).collect();
        self.write_rollouts(step, &rows, &texts, &names, &order, live.world.is_root())?;
        self.generation = Some(Generation {
            rows,
            order,
            tokens,
            served: 0,
        });
        Ok(())
    }

    /// Appends the batch's lines to rollouts.jsonl (module docs of `crate::objective::grpo`);
    /// on a rank other than 0 (`write` false) only counts its bytes, so every rank's state is
    /// the same.
    fn write_rollouts(
        &mut self,
        step: usize,
        rows: &[Row],
        texts: &[String],
        names: &[String],
        order: &[usize],
        write: bool,
    ) -> Result<(), TrainError> {
        // Each completion's row in the shuffled batch (its micro-batch: row / micro_batch_size).
        let mut train_row = vec![0; order.len()];
        for (k, &i) in order.iter().enumerate() {
            train_row[i] = k;
        }
        let mut text = String::new();
        for ((r, completion), train_row) in rows.iter().zip(texts).zip(train_row) {
            let rewards: serde_json::Map<String, Value> = (names.iter().zip(&r.rewards))
                .map(|(n, v)| (n.clone(), json!(v)))
                .collect();
            let line = json!({
                "step": step,
                "prompt_index": r.prompt_index,
                "prompt_ids": r.prompt,
                "completion_ids": r.completion,
                "completion": completion,
                "rewards": rewards,
                "reward": r.reward,
                "advantage": r.advantage,
                "truncated": r.truncated,
                "train_row": train_row,
            });
            text.push_str(&line.to_string());
            text.push('\n');
        }
        if write {
            let path = self.run_dir.join(ROLLOUTS);
            let io = |e: std::io::Error| TrainError::Output {
                path: path.clone(),
                message: e.to_string(),
            };
            let mut f = match (self.rollouts_open, self.resumed) {
                // A fresh run: the file starts empty.
                (false, false) => self.privacy.create(&path).map_err(TrainError::from)?,
                _ => self.privacy.append(&path).map_err(TrainError::from)?,
            };
            if !self.rollouts_open && self.resumed {
                // Lines after the checkpoint are written again, identically.
                f.set_len(self.rollouts_bytes).map_err(io)?;
            }
            self.rollouts_open = true;
            f.write_all(text.as_bytes()).map_err(io)?;
        }
        self.rollouts_bytes += text.len() as u64;
        Ok(())
    }
}

/// Every rank's rows and their texts, in rank order (each rank's share of a generation batch).
fn gather(
    world: &rtune_dist::World,
    step: usize,
    rows: &[Row],
    texts: &[String],
) -> Result<(Vec<Row>, Vec<String>), TrainError> {
    let bad = |e: serde_json::Error| TrainError::Output {
        path: PathBuf::from(ROLLOUTS),
        message: format!("step {step}: a rank's completions do not read back: {e}"),
    };
    let mine = serde_json::to_vec(&(rows, texts)).map_err(bad)?;
    let what = format!("step {step}'s completions gather");
    let (mut all_rows, mut all_texts) = (Vec::new(), Vec::new());
    for theirs in world.all_gather(&what, &mine) {
        let (r, t): (Vec<Row>, Vec<String>) = serde_json::from_slice(&theirs).map_err(bad)?;
        all_rows.extend(r);
        all_texts.extend(t);
    }
    Ok((all_rows, all_texts))
}

impl Recipe for Grpo {
    type Micro = GrpoMicro;
    type Totals = ();
    type Sums = metrics::GrpoSums;

    fn about(&self) -> About {
        About {
            name: "grpo",
            unit: "prompts",
            sides: &[],
            // β > 0 from an `init_from` adapter: its frozen copy, read before the first step.
            reference: self.g.beta > 0.0 && self.init_from,
            uncached: Some(
                "objective \"grpo\": prompt rows are checked, not cached (they are tokenized at \
                 the start of each run)"
                    .into(),
            ),
            // Sampling runs each rank's own number of decoding steps (its completions end
            // when they end), so a sharded base's per-layer gathers would not pair up.
            single_rank: self.shard_base.then_some(
                "[distributed] shard_base: each rank samples its own completions, whose \
                 decoding steps differ between ranks, so the base's per-layer gathers would \
                 not pair up; drop shard_base",
            ),
        }
    }

    /// The prompts of the run's training files; `RunData::train` holds each prompt as a row
    /// (the completions are sampled during training).
    fn load(
        &mut self,
        cfg: &RunConfig,
        tok: Option<&Tokenizer>,
        vocab: usize,
    ) -> Result<RunData, TrainError> {
        let template = crate::dataset::chat_template(&cfg.data, tok)?;
        let (prompts, report) = super::prompts::load(
            cfg,
            self.g.max_completion_length,
            tok,
            template.as_ref(),
            vocab,
        )?;
        let (own_tok, _) = crate::dataset::model_tokenizer(cfg)?;
        self.stop = super::prompts::stop_tokens(cfg, own_tok.as_ref())?;
        self.tok = own_tok;
        let train = super::prompts::as_examples(&prompts);
        self.train = prompts
            .into_iter()
            .enumerate()
            .map(|(index, prompt)| PromptRow { index, prompt })
            .collect();
        Ok(RunData {
            train,
            valid: Vec::new(),
            files: Vec::new(),
            own: Some(Box::new(report)),
        })
    }

    /// β > 0 from an `init_from` adapter: that adapter as read from its directory (on a resume
    /// too, when the live adapter has moved on), the reference of every step.
    fn reference(&mut self, cfg: &RunConfig, pass: ReferencePass) -> Result<usize, TrainError> {
        if let (true, Some(dir)) = (self.g.beta > 0.0, &cfg.lora.init_from) {
            let spec = &pass.adapter.spec;
            let modules = pass.model.lora_modules(spec);
            let dev = &pass.model.device;
            self.ref_adapter = Some(rtune_lora::Adapter::load_peft(dir, spec, &modules, dev)?);
        }
        Ok(0)
    }

    fn start(&mut self, cfg: &RunConfig, data: &mut RunData, pad_id: u32) -> (usize, usize) {
        data.train = Vec::new();
        let rows = std::mem::take(&mut self.train);
        let n = rows.len();
        self.stream = Some(Batcher::new(rows, cfg.data.shuffle, cfg.train.seed, pad_id));
        (n, 0)
    }

    /// Micro-batch `c` of the generation batch (counted over every rank: the trainer draws the
    /// step's W × `grad_accum` micro-batches on every rank, rank `c mod W` computing `c`) is
    /// rows `k·size..(k + 1)·size` of the shuffled batch, `k = c mod (W × steps_per_generation)`
    /// (each of the `num_iterations` passes in the same order, as TRL reuses its buffer). On one
    /// process this is TRL's split of its shuffled batch; on W ranks TRL shuffles and splits
    /// each process's own share, while here every rank holds the whole batch and the shuffle
    /// spans it, so that W ranks train on the micro-batches of one process with W times the
    /// accumulation (the same batch, order and result).
    fn draw(&mut self, live: &Live, size: usize) -> Result<GrpoMicro, TrainError> {
        let w = live.world.size;
        if let Some(was) = self.saved_world.take() {
            if was != w && self.generation.is_some() {
                return Err(TrainError::Output {
                    path: self.run_dir.clone(),
                    message: format!(
                        "the checkpoint's GRPO generation batch was sampled by {was} rank(s), \
                         this run has {w}: resume it with {was}"
                    ),
                });
            }
        }
        self.world = w;
        let spg = self.g.steps_per_generation;
        let per_batch = spg * self.g.num_iterations * w;
        if self
            .generation
            .as_ref()
            .is_none_or(|g| g.served >= per_batch)
        {
            self.generate(live)?;
        }
        let g = self.generation.as_mut().expect("generated above");
        let c = g.served;
        g.served += 1;
        let at = (c % (w * spg)) * size;
        let n = g.rows.len();
        let rows: Vec<Row> = (at.min(n)..(at + size).min(n))
            .map(|k| g.rows[g.order.get(k).copied().unwrap_or(k)].clone())
            .collect();
        let refs: Vec<&Row> = rows.iter().collect();
        Ok(GrpoMicro {
            packed: rollout::pack(&refs, live.pad_id),
            rows,
            tokens: g.tokens,
        })
    }

    fn totals(&self, _: &[GrpoMicro]) {}

    fn pass(
        &self,
        micro: &GrpoMicro,
        _: (),
        loss_scale: f64,
        sums: &mut metrics::GrpoSums,
        backward: &mut dyn FnMut(HeadLoss) -> Result<f64, TrainError>,
    ) -> Result<f64, TrainError> {
        let (t, pos) = (micro.packed.t, &micro.packed.pos);
        let mask_truncated = self.g.mask_truncated_completions;
        // b × t, 0 past each row's completion.
        let flat = |f: &dyn Fn(&Row, usize) -> f32| -> Vec<f32> {
            (micro.rows.iter())
                .flat_map(|r| {
                    (0..t).map(move |j| if j < r.completion.len() { f(r, j) } else { 0.0 })
                })
                .collect()
        };
        let mask = flat(&|r, _| rollout::row_mask(r, mask_truncated));
        let old = self
            .keeps_old()
            .then(|| flat(&|r, j| r.old.as_ref().map_or(0.0, |o| o[j])));
        let reference =
            (self.g.beta > 0.0).then(|| flat(&|r, j| r.reference.as_ref().map_or(0.0, |o| o[j])));
        let advantages: Vec<f32> = micro.rows.iter().map(|r| r.advantage).collect();
        // rtune sums the ranks' gradients where DDP averages them: each rank's loss is TRL's
        // divided by W, i.e. accumulated over all W × grad_accum micro-batches of the step.
        let norm = Normalizer {
            grad_accum: self.grad_accum * self.world,
            max_completion_length: self.g.max_completion_length,
            num_items_in_batch: micro.tokens,
            num_processes: self.world,
            steps_per_generation: self.g.steps_per_generation,
        };
        let mut weigh = |nll: &[f32], entropy: &[f32]| {
            let logp: Vec<f32> = pos.iter().map(|p| p.map_or(0.0, |p| -nll[p])).collect();
            let rows = Rows {
                t,
                logp: &logp,
                old: old.as_deref(),
                reference: reference.as_deref(),
                advantages: &advantages,
                mask: &mask,
            };
            let step = policy_loss(&self.policy, rows, &norm);
            sums.add(&step.stats);
            // TRL's `entropy`: the masked mean of the tokens' entropy at temperature T.
            sums.entropy_sum += (pos.iter().zip(&mask))
                .filter_map(|(p, m)| p.map(|p| f64::from(entropy[p] * m)))
                .sum::<f64>();
            // loss is a function of logp = −nll: ∂loss/∂nll = −∂loss/∂logp.
            let mut w = vec![0f32; nll.len()];
            for (p, d) in pos.iter().zip(&step.dlogp) {
                if let Some(p) = p {
                    w[*p] = -d * loss_scale as f32;
                }
            }
            Ok((f64::from(step.loss), w))
        };
        // A mixture-of-experts model's load-balancing loss as TRL 1.16's GRPOTrainer adds it:
        // `router_aux_loss_coef · aux / gradient_accumulation_steps` per micro-batch (rtune's
        // `grad_accum` here counts the ranks' micro-batches too), the aux over the policy
        // forward's attention mask: prompt and completion, a completion masked as truncated left
        // out (TRL zeroes its `completion_mask`, which joins the attention mask).
        let share = 1.0 / norm.grad_accum as f64;
        let aux = AuxShare {
            share,
            grad_scale: share * loss_scale,
            tokens: mask_truncated.then(|| {
                let full = |r: &Row| rollout::row_mask(r, mask_truncated) > 0.0;
                (micro.rows.iter())
                    .map(|r| r.prompt.len() + if full(r) { r.completion.len() } else { 0 })
                    .collect()
            }),
        };
        backward(HeadLoss::Tempered {
            temperature: self.g.temperature,
            weigh: &mut weigh,
            aux,
        })
    }

    /// Each micro-batch's loss is already normalised over the step (`loss_type`).
    fn loss(&self, loss_sum: f64, _: ()) -> f64 {
        loss_sum
    }

    fn metrics(&self, sums: &metrics::GrpoSums, _: ()) -> BTreeMap<String, f64> {
        let names: Vec<String> = self.specs.iter().map(|r| r.name.clone()).collect();
        let rows = self.generation.as_ref().map_or(&[][..], |g| &g.rows[..]);
        let mut m = metrics::generation(rows, &names, self.g.num_generations);
        m.extend(sums.metrics(&self.policy));
        m
    }

    /// No held-out reward yet (issue 44: measured greedy by the recipe's script).
    fn evaluate(&self, _: &Live, _: usize) -> Result<Option<EvalMetrics>, TrainError> {
        Ok(None)
    }

    fn position(&self) -> (usize, usize) {
        self.stream.as_ref().map_or((0, 0), |s| s.position())
    }

    fn seek(&mut self, epoch: usize, cursor: usize) {
        if let Some(s) = self.stream.as_mut() {
            s.seek(epoch, cursor);
        }
    }

    fn state(&self) -> Option<Value> {
        let s = State {
            rng: self.rng,
            rollouts_bytes: self.rollouts_bytes,
            generation: self.generation.clone(),
            world: self.world,
        };
        Some(serde_json::to_value(s).expect("the GRPO state serialises"))
    }

    fn restore(&mut self, state: Option<&Value>) -> Result<(), TrainError> {
        let Some(v) = state else {
            return Ok(());
        };
        let s: State = serde_json::from_value(v.clone()).map_err(|e| TrainError::Output {
            path: self.run_dir.clone(),
            message: format!("trainer_state.json: the GRPO state does not read back: {e}"),
        })?;
        self.rng = s.rng;
        self.rollouts_bytes = s.rollouts_bytes;
        self.generation = s.generation;
        self.saved_world = Some(s.world);
        self.resumed = true;
        Ok(())
    }
}
