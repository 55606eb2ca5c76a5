//! Rewards for online reinforcement learning (`objective = "grpo"`), declared in the config as
//! `[[reward]]` tables:
//! - [`spec`]: a table as written, checked into a [`Reward`] (each kind's own keys);
//! - built-in verifiable rewards: `regex` (the completion matches a pattern), `answer` (its final
//!   answer equals a data column, as text or as a number within a tolerance), `length` (close to a
//!   token count);
//! - [`command`]: a long-lived process the user names, any language, JSON lines on stdin/stdout.
//!
//! [`Rewards::score`] gives each function's reward per completion (or none) and
//! [`Scores::total`] their weighted sum as TRL's `GRPOTrainer` forms it.

mod builtin;
pub mod command;
pub mod spec;
#[cfg(test)]
mod tests;

pub use spec::{check_all, Kind, Reward, RewardTable};

use builtin::Builtin;
use command::CommandReward;

pub type Result<T> = std::result::Result<T, RewardError>;

#[derive(Debug, thiserror::Error)]
pub enum RewardError {
    /// A `[[reward]]` table is wrong (before anything starts).
    #[error("[[reward]] #{index}{}: `{key}`: {message}", name_part(.name))]
    Spec {
        /// 1-based, in the config's order.
        index: usize,
        name: String,
        key: String,
        message: String,
    },
    /// A `command` reward's program would not start.
    #[error("reward `{name}`: could not start `{program}`: {message}")]
    Start {
        name: String,
        program: String,
        message: String,
    },
    /// A `command` reward failed while the run scored a batch.
    #[error("reward `{name}` at step {step}: {message}")]
    Command {
        name: String,
        step: u64,
        message: String,
    },
    /// An `answer` reward's column is missing from a prompt row.
    #[error(
        "reward `{name}` at step {step}: completion {row}'s prompt row has no column `{column}`"
    )]
    Column {
        name: String,
        step: u64,
        row: usize,
        column: String,
    },
}

fn name_part(name: &str) -> String {
    if name.is_empty() {
        String::new()
    } else {
        format!(" (`{name}`)")
    }
}

/// One completion to score, with its prompt and the prompt row's other columns.
#[derive(Debug, Clone, Copy)]
pub struct Sample<'a> {
    /// The row's `prompt` as written: text, or messages (what TRL hands its reward functions);
    /// null for a pre-tokenized row.
    pub prompt: &'a serde_json::Value,
    pub completion: &'a str,
    pub completion_ids: &'a [u32],
    pub columns: &'a serde_json::Map<String, serde_json::Value>,
}

enum Func {
    Builtin(Builtin),
    Command(CommandReward),
}

/// The run's reward functions, started (command processes running) and ready to score.
pub struct Rewards {
    funcs: Vec<(Reward, Func)>,
}

/// Each function's rewards for one batch: `per_reward[f][i]` for function `f`, completion `i`
/// (`None`: the function gave none).
#[derive(Debug, Clone, PartialEq)]
pub struct Scores {
    pub names: Vec<String>,
    pub weights: Vec<f64>,
    pub per_reward: Vec<Vec<Option<f64>>>,
}

impl Rewards {
    /// Compiles the built-ins and starts every command process.
    pub fn start(rewards: &[Reward]) -> Result<Rewards> {
        let funcs = rewards
            .iter()
            .map(|r| {
                let f = match &r.kind {
                    Kind::Regex { pattern } => {
                        Func::Builtin(Builtin::Regex(builtin::compile(pattern)))
                    }
                    Kind::Answer {
                        column,
                        extract,
                        tolerance,
                    } => Func::Builtin(Builtin::Answer {
                        column: column.clone(),
                        extract: builtin::compile(extract),
                        tolerance: *tolerance,
                    }),
                    Kind::Length { target } => Func::Builtin(Builtin::Length { target: *target }),
                    Kind::Command { argv, timeout_s } => {
                        Func::Command(CommandReward::start(&r.name, argv, *timeout_s)?)
                    }
                };
                Ok((r.clone(), f))
            })
            .collect::<Result<_>>()?;
        Ok(Rewards { funcs })
    }

    /// Scores one batch of completions with every function, in the config's order.
    pub fn score(&mut self, step: u64, samples: &[Sample]) -> Result<Scores> {
        let mut per_reward = Vec::with_capacity(self.funcs.len());
        for (r, f) in &mut self.funcs {
            per_reward.push(match f {
                Func::Builtin(b) => b
                    .score(&r.name, step, samples)?
                    .into_iter()
                    .map(Some)
                    .collect(),
                Func::Command(c) => c.score(step, samples)?,
            });
        }
        Ok(Scores {
            names: self.funcs.iter().map(|(r, _)| r.name.clone()).collect(),
            weights: self.funcs.iter().map(|(r, _)| r.weight).collect(),
            per_reward,
        })
    }
}

impl Scores {
    /// The reward of each completion as TRL's `GRPOTrainer` forms it, in f32 as it does:
    /// `nansum` over the functions of weight · reward, a missing reward counting as NaN (so it
    /// adds nothing); a completion no function scored is NaN (TRL leaves it out of the group's
    /// mean and std, and gives it advantage 0).
    pub fn total(&self) -> Vec<f32> {
        let n = self.per_reward.first().map_or(0, Vec::len);
        (0..n)
            .map(|i| {
                if self.per_reward.iter().all(|r| r[i].is_none()) {
                    return f32::NAN;
                }
                self.per_reward
                    .iter()
                    .zip(&self.weights)
                    .filter_map(|(r, w)| r[i].map(|v| v as f32 * *w as f32))
                    .sum()
            })
            .collect()
    }
}
