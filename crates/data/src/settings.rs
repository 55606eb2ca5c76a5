//! The row settings of `[data]` as the loaders take them — [`Format`], [`TrainOn`],
//! [`Truncation`], [`OnBadRow`] — each with the name configs and messages use. Below every loader
//! (formats, chat, the preference loader) so that none of them names another for its settings.

use std::str::FromStr;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// `{"text": ...}`: loss on every token.
    Text,
    /// `{"prompt": ..., "completion": ...}`: loss on the completion and the EOS after it.
    PromptCompletion,
    /// `{"instruction", "input"?, "output"}`: the Alpaca prompt, loss on the output and EOS.
    Alpaca,
    /// `{"messages": [{role, content}, ...], "tools"?}`: the chat template, loss on assistant turns.
    Chat,
    /// `{"input_ids": [...], "labels"?: [...]}`: pre-tokenized, used as-is.
    Tokens,
}

macro_rules! named_enum {
    ($ty:ident { $($var:ident = $name:literal),* $(,)? }) => {
        impl $ty {
            /// The name used in configs and messages.
            pub fn name(self) -> &'static str {
                match self { $($ty::$var => $name),* }
            }
        }
        impl FromStr for $ty {
            type Err = String;
            fn from_str(s: &str) -> std::result::Result<Self, String> {
                match s {
                    $($name => Ok($ty::$var),)*
                    _ => Err(format!(
                        "{s:?} is not one of {}",
                        [$(concat!("\"", $name, "\"")),*].join(", ")
                    )),
                }
            }
        }
    };
}

named_enum!(Format {
    Text = "text",
    PromptCompletion = "prompt_completion",
    Alpaca = "alpaca",
    Chat = "chat",
    Tokens = "tokens",
});

impl Format {
    /// A config's `format`: `"auto"` gives `None` (detect from the first row).
    pub fn parse_setting(s: &str) -> std::result::Result<Option<Format>, String> {
        if s == "auto" {
            return Ok(None);
        }
        s.parse().map(Some).map_err(|e| format!("{e}, \"auto\""))
    }
}

/// Which chat tokens carry a loss.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TrainOn {
    /// Assistant turns, each with its end-of-turn token (the default).
    #[default]
    Assistant,
    /// Every token of the rendered conversation.
    All,
}
named_enum!(TrainOn { Assistant = "assistant", All = "all" });

/// What to do with a row longer than `max_seq_len`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Truncation {
    /// Cut it to `max_seq_len` (counted in `Dataset::truncated`).
    #[default]
    Truncate,
    /// Leave it out (counted in `Dataset::dropped`).
    Drop,
}
named_enum!(Truncation { Truncate = "truncate", Drop = "drop" });

/// What to do with a malformed row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnBadRow {
    /// Stop with `file:line: what is wrong` (the default).
    #[default]
    Error,
    /// Count it (`Dataset::bad_rows`) and go on.
    Skip,
}
named_enum!(OnBadRow { Error = "error", Skip = "skip" });
