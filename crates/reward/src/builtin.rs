//! The built-in verifiable rewards: a format pattern, the final answer against a data column, a
//! length target. Each gives a number for every completion (never null).

use regex::Regex;
use serde_json::Value;

use crate::spec::REGEX_SIZE_LIMIT;
use crate::{Result, RewardError, Sample};

pub(crate) enum Builtin {
    Regex(Regex),
    Answer {
        column: String,
        extract: Regex,
        tolerance: Option<f64>,
    },
    Length {
        target: u64,
    },
}

pub(crate) fn compile(p: &str) -> Regex {
    regex::RegexBuilder::new(p)
        .size_limit(REGEX_SIZE_LIMIT)
        .build()
        .expect("patterns are compiled once by RewardTable::check")
}

impl Builtin {
    pub(crate) fn score(&self, name: &str, step: u64, samples: &[Sample]) -> Result<Vec<f64>> {
        samples
            .iter()
            .enumerate()
            .map(|(row, s)| match self {
                Builtin::Regex(re) => Ok(f64::from(u8::from(re.is_match(s.completion)))),
                Builtin::Length { target } => Ok(length_reward(s.completion_ids.len(), *target)),
                Builtin::Answer {
                    column,
                    extract,
                    tolerance,
                } => {
                    let want = s.columns.get(column).ok_or_else(|| RewardError::Column {
                        name: name.to_string(),
                        step,
                        row,
                        column: column.clone(),
                    })?;
                    let got = extract_answer(extract, s.completion);
                    Ok(f64::from(u8::from(
                        got.is_some_and(|g| answers_equal(g, want, *tolerance)),
                    )))
                }
            })
            .collect()
    }
}

/// `max(0, 1 − |n − target| / target)`.
pub(crate) fn length_reward(n: usize, target: u64) -> f64 {
    let (n, t) = (n as f64, target as f64);
    (1.0 - (n - t).abs() / t).max(0.0)
}

/// The last match's first group (or the whole match when the pattern has none), trimmed.
pub(crate) fn extract_answer<'a>(re: &Regex, text: &'a str) -> Option<&'a str> {
    let caps = re.captures_iter(text).last()?;
    let m = caps.get(1).or_else(|| caps.get(0))?;
    Some(m.as_str().trim())
}

/// The answer against the column's value: as numbers within `tolerance` when one is set (a
/// value that is not a number is never equal), else as trimmed text (a JSON number compared
/// as it is written).
pub(crate) fn answers_equal(got: &str, want: &Value, tolerance: Option<f64>) -> bool {
    let want_text = match want {
        Value::String(s) => s.trim().to_string(),
        Value::Null => return false,
        other => other.to_string(),
    };
    match tolerance {
        None => got == want_text,
        Some(tol) => match (parse_number(got), parse_number(&want_text)) {
            (Some(a), Some(b)) => (a - b).abs() <= tol,
            _ => false,
        },
    }
}

/// A decimal number as people write answers: `1,234.5`, `$12`, `-3` (commas and a leading
/// currency sign dropped); nothing else.
pub(crate) fn parse_number(s: &str) -> Option<f64> {
    let t: String = s.trim().trim_start_matches('$').replace(',', "");
    t.parse::<f64>().ok().filter(|v| v.is_finite())
}
