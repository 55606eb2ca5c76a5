//! The LoRA variants' part of setting up a run (issue 17): the fresh adapter for `[lora] init`, and
//! for PiSSA / OLoRA the model loaded with each targeted weight replaced by its residual
//! `W − s·B₀·A₀` while it is read (`rtune_lora::init` holds the math and the reference).
//!
//! The split happens in a [`TensorSource`] wrapped around the checkpoint, so it sees each weight
//! once, as stored, before the model quantizes it: with `[model] quantize = "nf4"` the residual is
//! what gets quantized (PiSSA's recommended order). A checkpoint that is already bnb-4bit has no
//! full-precision W to split: refused, as PEFT refuses it. Deterministic: the modules are split in
//! model order and `pissa_niter_N`'s random draws come from the run's seed, so a resumed run
//! rebuilds the same residual base and `(A₀, B₀)`.

use candle_core::{DType, Device, Tensor};
use rand::SeedableRng;
use std::cell::RefCell;
use std::collections::HashMap;

use rtune_config::RunConfig;
use rtune_lora::{init, Adapter, Init, LoraPair, LoraSpec, ModuleShape};
use rtune_model::weights::{TensorSource, Weights};
use rtune_model::{Gather, HfConfig, Model, ModelError};
use rtune_quant::Nf4Weight;
use std::rc::Rc;

use crate::compute::dtype;
use crate::TrainError;

/// What a base-mutating init leaves for saving: each module's `(A₀, B₀)`, in adapter order.
#[derive(Debug, Clone)]
pub struct InitialAdapter {
    pub init: Init,
    pub pairs: Vec<LoraPair>,
}

/// Wraps a checkpoint: targeted linear weights come out as residuals, their factors kept.
struct SplitSource<'a> {
    inner: &'a Weights,
    init: Init,
    spec: &'a LoraSpec,
    rng: RefCell<rand_chacha::ChaCha8Rng>,
    /// `module name → (A₀, B₀)` f32 row-major, with the residual `(out, in)` f32.
    split: RefCell<HashMap<String, (init::Decomposed, [usize; 2])>>,
}

impl SplitSource<'_> {
    /// `model.layers.3.self_attn.q_proj` for a targeted `model.layers.3.self_attn.q_proj.weight`.
    fn target<'n>(&self, name: &'n str) -> Option<&'n str> {
        let module = name.strip_suffix(".weight")?;
        let short = module.rsplit('.').next()?;
        (module.starts_with("model.layers.") && self.spec.targets_module(short)).then_some(module)
    }

    /// The residual of `name` in f32, splitting it on first use (the error boxed: ModelError is
    /// large, and this is not the trait's signature).
    fn residual(
        &self,
        module: &str,
        name: &str,
        shape: &[usize],
    ) -> Result<Tensor, Box<ModelError>> {
        if let Some((d, [o, i])) = self.split.borrow().get(module) {
            return Tensor::from_vec(d.residual.clone(), (*o, *i), &Device::Cpu)
                .map_err(|e| Box::new(ModelError::candle(format!("residual {name}"), e)));
        }
        let w = self.inner.stored(name, shape).map_err(Box::new)?;
        let (o, i) = (shape[0], shape[1]);
        let v: Vec<f32> = w
            .to_dtype(DType::F32)
            .and_then(|t| t.flatten_all())
            .and_then(|t| t.to_vec1())
            .map_err(|e| Box::new(ModelError::candle(format!("read {name}"), e)))?;
        let scaling = self.spec.scaling();
        let mut rng = self.rng.borrow_mut();
        let d = init::decompose(
            self.init,
            module,
            &v,
            (o, i),
            self.spec.r,
            scaling,
            &mut rng,
        )
        .map_err(|e| ModelError::File {
            path: name.into(),
            message: e.to_string(),
        })?;
        let t = Tensor::from_vec(d.residual.clone(), (o, i), &Device::Cpu)
            .map_err(|e| Box::new(ModelError::candle(format!("residual {name}"), e)))?;
        self.split
            .borrow_mut()
            .insert(module.to_string(), (d, [o, i]));
        Ok(t)
    }
}

impl TensorSource for SplitSource<'_> {
    fn tensor(&self, name: &str, shape: &[usize]) -> rtune_model::Result<Tensor> {
        match self.target(name) {
            Some(module) => self
                .residual(module, name, shape)
                .map_err(|e| *e)?
                .to_dtype(self.inner_dtype())
                .and_then(|t| t.to_device(self.inner_device()))
                .map_err(|e| ModelError::candle(format!("convert {name}"), e)),
            None => self.inner.tensor(name, shape),
        }
    }

    fn stored(&self, name: &str, shape: &[usize]) -> rtune_model::Result<Tensor> {
        match self.target(name) {
            Some(module) => self
                .residual(module, name, shape)
                .map_err(|e| *e)?
                .to_device(self.inner_device())
                .map_err(|e| ModelError::candle(format!("residual {name}"), e)),
            None => self.inner.stored(name, shape),
        }
    }

    fn has(&self, name: &str) -> bool {
        self.inner.has(name)
    }

    fn quantized(&self, name: &str, shape: &[usize]) -> rtune_model::Result<Option<Nf4Weight>> {
        let q = self.inner.quantized(name, shape)?;
        if q.is_some() && self.target(name).is_some() {
            return Err(ModelError::File {
                path: name.into(),
                message: format!(
                    "[lora] init = \"{}\" needs the full-precision weight, and this checkpoint stores it \
                     bnb-4bit; use the full-precision model with [model] quantize = \"nf4\" (the residual \
                     is quantized after the split)",
                    self.init
                ),
            });
        }
        Ok(q)
    }
}

impl SplitSource<'_> {
    fn inner_dtype(&self) -> DType {
        self.inner.dtype()
    }
    fn inner_device(&self) -> &Device {
        self.inner.device()
    }
}

/// The base model as `[model]` asks, whole, or with `shard` (`[distributed] shard_base`) this
/// rank's shard of it.
pub fn load_model(
    cfg: &RunConfig,
    dev: &Device,
    shard: Option<&Rc<dyn Gather>>,
) -> Result<Model, TrainError> {
    let (path, dtype, quantize) = (&cfg.model.path, dtype(cfg.model.dtype), cfg.model.quantize);
    Ok(match shard {
        Some(comm) => Model::load_sharded(path, dtype, dev, quantize, comm.clone())?,
        None => Model::load_with(path, dtype, dev, quantize)?,
    })
}

/// The model and the fresh adapter for `cfg` (`init_from` unset): the model as stored and
/// PEFT's default or gaussian init, or for PiSSA / OLoRA the residual model, the split adapter
/// and its initial factors.
pub fn fresh(
    cfg: &RunConfig,
    spec: &LoraSpec,
    dev: &Device,
    shard: Option<&Rc<dyn Gather>>,
) -> Result<(Model, Adapter, Option<InitialAdapter>), TrainError> {
    // (A sharded base with PiSSA / OLoRA is refused by the config.)
    if !cfg.lora.init.mutates_base() || shard.is_some() {
        let model = load_model(cfg, dev, shard)?;
        let modules = model.lora_modules(spec);
        let adapter = match cfg.lora.init {
            Init::Gaussian => init::gaussian(spec.clone(), &modules, cfg.train.seed, dev)?,
            _ => Adapter::init(spec.clone(), &modules, cfg.train.seed, dev)?,
        };
        return Ok((model, adapter, None));
    }
    let dir = &cfg.model.path;
    let cfg_path = dir.join("config.json");
    let mcfg = HfConfig::from_file(&cfg_path)?.into_config(&cfg_path)?;
    let weights = Weights::open(dir, dtype(cfg.model.dtype), dev)?;
    let source = SplitSource {
        inner: &weights,
        init: cfg.lora.init,
        spec,
        rng: RefCell::new(rand_chacha::ChaCha8Rng::seed_from_u64(cfg.train.seed)),
        split: RefCell::new(HashMap::new()),
    };
    let model = Model::build_with(
        mcfg,
        &source,
        dtype(cfg.model.dtype),
        dev,
        cfg.model.quantize,
    )?;
    let modules: Vec<ModuleShape> = model.lora_modules(spec);
    let mut split = source.split.into_inner();
    let (mut pairs, mut initial) = (Vec::new(), Vec::new());
    for m in &modules {
        let (d, _) = split
            .remove(&m.name)
            .ok_or_else(|| ModelError::MissingTensor {
                path: dir.to_path_buf(),
                name: format!("{}.weight", m.name),
            })?;
        let t = |v: Vec<f32>, shape: (usize, usize)| {
            Tensor::from_vec(v, shape, dev).map_err(TrainError::candle("initial adapter"))
        };
        let a = t(d.a, (spec.r, m.in_features))?;
        let b = t(d.b, (m.out_features, spec.r))?;
        initial.push(LoraPair {
            a: a.clone(),
            b: b.clone(),
            m: None,
        });
        pairs.push(LoraPair { a, b, m: None });
    }
    let adapter = Adapter {
        spec: spec.clone(),
        names: modules.iter().map(|m| m.name.clone()).collect(),
        pairs,
        tokens: None,
    };
    Ok((
        model,
        adapter,
        Some(InitialAdapter {
            init: cfg.lora.init,
            pairs: initial,
        }),
    ))
}

/// The adapter to save for other tools: as trained, or converted to a plain LoRA against the
/// original base when the init changed the base.
pub fn for_saving(
    adapter: &Adapter,
    initial: Option<&InitialAdapter>,
) -> Result<Adapter, TrainError> {
    match initial {
        Some(i) => Ok(init::converted(adapter, &i.pairs)?),
        None => Ok(adapter.clone()),
    }
}
