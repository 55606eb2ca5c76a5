//! `[train] objective = "grpo"`'s keys (`grpo.rs`) and its `[[reward]]` tables (`run.rs`):
//! TRL's defaults, every key read, each refusal naming its key.

use std::path::Path;

use crate::{ConfigFile, Objective, RunConfig};
use crate::{Grpo, Level, LossType, Result, ScaleRewards};

fn parse(extra: &str) -> Result<RunConfig> {
    // max_seq_len above TRL's default max_completion_length (512): room for a prompt.
    let text =
        format!("[model]\npath = \"m\"\n[data]\ntrain = \"d.jsonl\"\nmax_seq_len = 1024\n{extra}");
    ConfigFile::parse(&text, Path::new("c.toml"), &[])?.validate(Path::new("c.toml"))
}

const REGEX: &str = "[[reward]]\nname = \"f\"\nkind = \"regex\"\npattern = \"x\"\n";

/// TRL 1.16's `GRPOConfig` defaults when only the objective and a reward are set.
#[test]
fn grpo_defaults_are_trls() {
    let c = parse(&format!(
        "[train]\nobjective = \"grpo\"\nmicro_batch_size = 8\n{REGEX}"
    ))
    .unwrap();
    let Objective::Grpo(g) = c.train.objective else {
        panic!("{:?}", c.train.objective)
    };
    assert_eq!(
        g,
        Grpo {
            num_generations: 8,
            max_completion_length: 512,
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: None,
            repetition_penalty: 1.0,
            beta: 0.0,
            epsilon: 0.2,
            epsilon_high: 0.2,
            delta: None,
            loss_type: LossType::Dapo,
            scale_rewards: ScaleRewards::Group,
            importance_sampling_level: Level::Token,
            num_iterations: 1,
            steps_per_generation: 1,
            mask_truncated_completions: false,
        }
    );
    assert_eq!(c.rewards.len(), 1);
    assert_eq!(c.rewards[0].weight, 1.0);
}

/// Every key read under its TRL name; `reward_weights` sets the tables' weights in order.
#[test]
fn grpo_keys_are_read() {
    let c = parse(&format!(
        "[train]\nobjective = \"grpo\"\nmicro_batch_size = 4\ngrad_accum = 2\n\
         num_generations = 4\nmax_completion_length = 64\ntemperature = 0.7\ntop_p = 0.9\n\
         top_k = 50\nmin_p = 0.05\nrepetition_penalty = 1.1\nbeta = 0.04\nepsilon = 0.1\n\
         epsilon_high = 0.28\ndelta = 1.5\nloss_type = \"dr_grpo\"\nscale_rewards = false\n\
         importance_sampling_level = \"sequence\"\nnum_iterations = 2\n\
         mask_truncated_completions = true\nreward_weights = [0.5, 2.0]\n{REGEX}\
         [[reward]]\nname = \"l\"\nkind = \"length\"\ntarget = 10\n"
    ))
    .unwrap();
    let Objective::Grpo(g) = c.train.objective else {
        panic!()
    };
    assert_eq!(g.num_generations, 4);
    assert_eq!(g.max_completion_length, 64);
    assert_eq!((g.temperature, g.top_p, g.top_k), (0.7, 0.9, 50));
    assert_eq!((g.min_p, g.repetition_penalty), (Some(0.05), 1.1));
    assert_eq!((g.beta, g.epsilon, g.epsilon_high), (0.04, 0.1, 0.28));
    assert_eq!(g.delta, Some(1.5));
    assert_eq!(g.loss_type, LossType::DrGrpo);
    assert_eq!(g.scale_rewards, ScaleRewards::None);
    assert_eq!(g.importance_sampling_level, Level::Sequence);
    assert_eq!((g.num_iterations, g.steps_per_generation), (2, 2));
    assert!(g.mask_truncated_completions);
    let w: Vec<f64> = c.rewards.iter().map(|r| r.weight).collect();
    assert_eq!(w, [0.5, 2.0]);
}

/// Each refusal names its key: a GRPO knob under another objective, a bad value, a rule
/// across sections, rewards without GRPO or GRPO without rewards.
#[test]
fn grpo_refusals_name_the_key() {
    let grpo = "[train]\nobjective = \"grpo\"\nmicro_batch_size = 8\n";
    for (extra, key) in [
        (
            "[train]\nnum_generations = 4".to_string(),
            "train.num_generations",
        ),
        (
            "[train]\nobjective = \"dpo\"\ntemperature = 0.5".into(),
            "train.temperature",
        ),
        (
            "[train]\nmask_truncated_completions = true".into(),
            "train.mask_truncated_completions",
        ),
        (
            format!("{grpo}num_generations = 1\n{REGEX}"),
            "train.num_generations",
        ),
        (
            format!("{grpo}num_generations = 3\n{REGEX}"),
            "train.num_generations",
        ),
        (
            format!("{grpo}temperature = 0\n{REGEX}"),
            "train.temperature",
        ),
        (format!("{grpo}top_p = 1.5\n{REGEX}"), "train.top_p"),
        (format!("{grpo}beta = -1\n{REGEX}"), "train.beta"),
        (format!("{grpo}delta = 0.5\n{REGEX}"), "train.delta"),
        (
            format!("{grpo}loss_type = \"sigmoid\"\n{REGEX}"),
            "train.loss_type",
        ),
        (
            format!("{grpo}scale_rewards = \"grp\"\n{REGEX}"),
            "train.scale_rewards",
        ),
        (
            format!("{grpo}importance_sampling_level = \"seq\"\n{REGEX}"),
            "train.importance_sampling_level",
        ),
        (
            format!("{grpo}num_iterations = 0\n{REGEX}"),
            "train.num_iterations",
        ),
        (
            format!("{grpo}reward_weights = [1.0, 2.0]\n{REGEX}"),
            "train.reward_weights",
        ),
        (
            format!("{grpo}max_completion_length = 4096\n{REGEX}"),
            "train.max_completion_length",
        ),
        (grpo.to_string(), "reward"),
        (REGEX.to_string(), "reward"),
        (
            format!("{grpo}[[reward]]\nname = \"f\"\nkind = \"regex\"\ncolumn = \"a\"\n"),
            "reward",
        ),
    ] {
        let e = match parse(&extra) {
            Ok(_) => panic!("accepted: {extra}"),
            Err(e) => e.to_string(),
        };
        assert!(e.contains(key), "{extra}: {e}");
    }
    // `data.packing` is SFT's.
    let text = format!(
        "[model]\npath = \"m\"\n[data]\ntrain = \"d.jsonl\"\nmax_seq_len = 1024\npacking = true\n{grpo}{REGEX}"
    );
    let e = ConfigFile::parse(&text, Path::new("c.toml"), &[])
        .and_then(|f| f.validate(Path::new("c.toml")))
        .unwrap_err()
        .to_string();
    assert!(e.contains("data.packing"), "{e}");
}
