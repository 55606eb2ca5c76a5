//! A `[[reward]]` table as written, and its check into a [`Reward`]: each kind takes its own keys
//! and a key of another kind is refused naming it (as the objectives refuse each other's knobs).

use serde::Deserialize;

use crate::{Result, RewardError};

/// Built-in answer extraction: the text inside the last `<answer>…</answer>`, trimmed.
pub const DEFAULT_EXTRACT: &str = r"(?s)<answer>\s*(.*?)\s*</answer>";

/// Longest a command may take to answer one request, when `timeout_s` is not set.
pub const DEFAULT_TIMEOUT_S: f64 = 300.0;

/// Compiled-regex size limit: a pattern from a config file cannot make the process allocate
/// without bound (the `regex` crate's own default is 10 MiB too; stated here so it stays).
pub(crate) const REGEX_SIZE_LIMIT: usize = 10 << 20;

/// One `[[reward]]` table as written in the config (every key of every kind; [`RewardTable::check`]
/// keeps those of its kind).
#[derive(Debug, Clone, Default, PartialEq, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct RewardTable {
    pub name: Option<String>,
    pub kind: Option<String>,
    pub weight: Option<f64>,
    /// `regex`: the pattern the completion must match (searched anywhere, `regex` crate syntax).
    pub pattern: Option<String>,
    /// `answer`: the data column holding the expected answer.
    pub column: Option<String>,
    /// `answer`: a pattern whose first group (or whole match) is the completion's answer; the
    /// last match counts. Default [`DEFAULT_EXTRACT`].
    pub extract: Option<String>,
    /// `answer`: compare as numbers within this absolute tolerance instead of as text.
    pub tolerance: Option<f64>,
    /// `length`: the completion length in tokens that earns 1.
    pub target: Option<u64>,
    /// `command`: the program and its arguments, started once.
    pub command: Option<Vec<String>>,
    /// `command`: seconds one request may take. Default [`DEFAULT_TIMEOUT_S`].
    pub timeout_s: Option<f64>,
}

/// A checked reward function.
#[derive(Debug, Clone, PartialEq)]
pub struct Reward {
    pub name: String,
    /// The weight TRL's `reward_weights` gives it: the total is Σ weight · reward over the
    /// functions that gave one.
    pub weight: f64,
    pub kind: Kind,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Kind {
    /// 1 when the completion matches `pattern`, else 0.
    Regex { pattern: String },
    /// 1 when the completion's answer equals the row's `column` (as text, or as numbers within
    /// `tolerance`), else 0.
    Answer {
        column: String,
        extract: String,
        tolerance: Option<f64>,
    },
    /// `max(0, 1 − |n − target| / target)` for a completion of `n` tokens.
    Length { target: u64 },
    /// A long-lived process speaking JSON lines (see [`crate::command`]).
    Command { argv: Vec<String>, timeout_s: f64 },
}

/// The keys each kind takes besides `name`, `kind` and `weight`.
const KEYS: [(&str, &[&str]); 4] = [
    ("regex", &["pattern"]),
    ("answer", &["column", "extract", "tolerance"]),
    ("length", &["target"]),
    ("command", &["command", "timeout_s"]),
];

impl RewardTable {
    /// The keys set in this table, among the kind-specific ones.
    fn set_keys(&self) -> Vec<&'static str> {
        let set = [
            ("pattern", self.pattern.is_some()),
            ("column", self.column.is_some()),
            ("extract", self.extract.is_some()),
            ("tolerance", self.tolerance.is_some()),
            ("target", self.target.is_some()),
            ("command", self.command.is_some()),
            ("timeout_s", self.timeout_s.is_some()),
        ];
        set.iter().filter(|(_, s)| *s).map(|(k, _)| *k).collect()
    }

    /// Checks table number `index` (0-based, named 1-based in errors) into a [`Reward`].
    pub fn check(&self, index: usize) -> Result<Reward> {
        let at = |key: &str, message: String| RewardError::Spec {
            index: index + 1,
            name: self.name.clone().unwrap_or_default(),
            key: key.to_string(),
            message,
        };
        let name = match self.name.as_deref().map(str::trim) {
            Some(n) if !n.is_empty() && n.len() <= 64 && !n.contains(['/', '\n', '\r']) => {
                n.to_string()
            }
            Some(_) => {
                return Err(at(
                    "name",
                    "must be 1 to 64 characters, without `/` or line breaks (it names the \
                     reward's metrics, rewards/<name>/mean)"
                        .into(),
                ))
            }
            None => return Err(at("name", "missing: every reward needs a name".into())),
        };
        let weight = self.weight.unwrap_or(1.0);
        if !weight.is_finite() {
            return Err(at("weight", format!("{weight} is not a finite number")));
        }
        let kinds: Vec<&str> = KEYS.iter().map(|(k, _)| *k).collect();
        let kind = self
            .kind
            .as_deref()
            .ok_or_else(|| at("kind", format!("missing: one of {}", kinds.join(", "))))?;
        let Some((_, own)) = KEYS.iter().find(|(k, _)| *k == kind) else {
            return Err(at(
                "kind",
                format!("`{kind}` is not a reward kind: one of {}", kinds.join(", ")),
            ));
        };
        if let Some(other) = self.set_keys().into_iter().find(|k| !own.contains(k)) {
            return Err(at(
                other,
                format!(
                    "not a key of kind = \"{kind}\" (its keys: {})",
                    own.join(", ")
                ),
            ));
        }
        let compile = |key: &str, p: &str| {
            regex::RegexBuilder::new(p)
                .size_limit(REGEX_SIZE_LIMIT)
                .build()
                .map(|_| ())
                .map_err(|e| at(key, one_line(&e.to_string())))
        };
        let kind = match kind {
            "regex" => {
                let pattern = self
                    .pattern
                    .clone()
                    .ok_or_else(|| at("pattern", "missing: the pattern to match".into()))?;
                compile("pattern", &pattern)?;
                Kind::Regex { pattern }
            }
            "answer" => {
                let column = self.column.clone().ok_or_else(|| {
                    at("column", "missing: the data column with the answer".into())
                })?;
                let extract = self
                    .extract
                    .clone()
                    .unwrap_or_else(|| DEFAULT_EXTRACT.into());
                compile("extract", &extract)?;
                if let Some(t) = self.tolerance {
                    if !(t.is_finite() && t >= 0.0) {
                        return Err(at("tolerance", format!("{t} is not a number ≥ 0")));
                    }
                }
                Kind::Answer {
                    column,
                    extract,
                    tolerance: self.tolerance,
                }
            }
            "length" => match self.target {
                Some(t) if t > 0 => Kind::Length { target: t },
                Some(_) => return Err(at("target", "must be at least 1 token".into())),
                None => {
                    return Err(at(
                        "target",
                        "missing: the completion length in tokens".into(),
                    ))
                }
            },
            "command" => {
                let argv = self.command.clone().unwrap_or_default();
                if argv.first().is_none_or(|p| p.is_empty()) {
                    return Err(at(
                        "command",
                        "must name a program: command = [\"python3\", \"rewards/judge.py\"]".into(),
                    ));
                }
                let timeout_s = self.timeout_s.unwrap_or(DEFAULT_TIMEOUT_S);
                if !(timeout_s.is_finite() && timeout_s > 0.0 && timeout_s <= 86_400.0) {
                    return Err(at(
                        "timeout_s",
                        format!("{timeout_s} is not a number of seconds in (0, 86400]"),
                    ));
                }
                Kind::Command { argv, timeout_s }
            }
            _ => unreachable!("kinds checked against KEYS above"),
        };
        Ok(Reward { name, weight, kind })
    }
}

/// Checks every table; names must be unique (they key the metrics and `rollouts.jsonl`).
pub fn check_all(tables: &[RewardTable]) -> Result<Vec<Reward>> {
    let mut out: Vec<Reward> = Vec::with_capacity(tables.len());
    for (i, t) in tables.iter().enumerate() {
        let r = t.check(i)?;
        if out.iter().any(|o| o.name == r.name) {
            return Err(RewardError::Spec {
                index: i + 1,
                name: r.name.clone(),
                key: "name".into(),
                message: "another [[reward]] has this name".into(),
            });
        }
        out.push(r);
    }
    Ok(out)
}

/// `s` on one line: line breaks become spaces (regex errors draw carets on a second line).
pub(crate) fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}
