//! Chat rows (`{"messages": [{"role", "content"}, ...], "tools": [...]}`), rendered with the
//! model's chat template, with the loss on the assistant turns.
//!
//! Masks come from the rendered text, by role, never from guessed token patterns. For assistant
//! message `i`, the render of `messages[..i]` with `add_generation_prompt=true` ends where the
//! turn's content starts, and the render of `messages[..=i]` ends where the turn ends. Both must be
//! prefixes of the whole conversation's render: a template for which they are not ("not
//! prefix-stable", e.g. one that moves the system prompt into the last user turn) is refused, since
//! its spans could only be guessed, unless the renders differ from the whole only inside earlier
//! assistant turns (Qwen3 drops an assistant turn's `<think>` reasoning once a user query follows
//! it): the turn is then found in the whole render by aligning the partial renders with it turn by
//! turn ([`render_spans`]), and trained as the whole render shows it. Each span is cut right after its last special token (the
//! end-of-turn token or EOS), so the separator a template puts between turns (ChatML's "\n" after
//! `<|im_end|>`) is not trained but the token that teaches the model to stop is. The text is then
//! tokenised once, with offsets, and a token is trained when its bytes overlap a trained span (as
//! transformers' `assistant_masks` does).

use minijinja::value::{Value, ValueKind};
use std::ops::Range;

use crate::template::{ChatTemplate, TemplateError};
use crate::{Example, Tokenizer, TrainOn, IGNORE};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    System,
    User,
    Assistant,
    Tool,
}

impl Role {
    fn parse(s: &str) -> Option<Role> {
        Some(match s {
            "system" => Role::System,
            "user" => Role::User,
            "assistant" => Role::Assistant,
            "tool" => Role::Tool,
            _ => return None,
        })
    }
}

/// A checked conversation, with its messages as the template will see them.
#[derive(Debug, Clone)]
pub struct Conversation {
    /// Key order is kept from the JSON (tool schemas and arguments are printed with `tojson`).
    messages: Vec<Value>,
    roles: Vec<Role>,
    tools: Option<Value>,
}

/// JSON-ish names for error messages.
fn kind(v: &Value) -> &'static str {
    match v.kind() {
        ValueKind::Undefined => "nothing",
        ValueKind::None => "null",
        ValueKind::Bool => "a boolean",
        ValueKind::Number => "a number",
        ValueKind::String => "a string",
        ValueKind::Seq => "an array",
        ValueKind::Map => "an object",
        _ => "an unsupported value",
    }
}

fn present(v: &Value) -> bool {
    !v.is_undefined() && !v.is_none()
}

/// The message as `apply_chat_template` hands it to the template: keys whose value is null dropped
/// (`_normalize_chat_messages`), and a reasoning field copied to both `thinking` and
/// `reasoning_content` (`_alias_reasoning_fields`, i.e. `{"thinking": r, **m, "reasoning_content": r}`).
fn normalize(m: &Value) -> Result<Value, minijinja::Error> {
    let reasoning = ["reasoning_content", "thinking", "reasoning"]
        .iter()
        .find_map(|k| m.get_attr(k).ok().filter(present));
    // Pairs are collected like a Python dict literal: a repeated key keeps its first place and
    // takes the last value.
    let mut pairs = Vec::new();
    if let Some(r) = &reasoning {
        pairs.push((Value::from("thinking"), r.clone()));
    }
    for k in m.try_iter()? {
        let v = m.get_item(&k)?;
        if !v.is_none() {
            pairs.push((k, v));
        }
    }
    if let Some(r) = reasoning {
        pairs.push((Value::from("reasoning_content"), r));
    }
    Ok(Value::from_pairs(pairs))
}

impl Conversation {
    /// Parses and checks one JSONL row (`{"messages": [...], "tools"?: [...]}`); the error says
    /// what is wrong (the caller adds `file:line`). See also [`Conversation::check_trainable`].
    pub fn from_json(row: &str) -> Result<Self, String> {
        // A byte-order mark at the start of the line is accepted, as for every JSONL row.
        let row = row.strip_prefix('\u{feff}').unwrap_or(row);
        let v: Value = serde_json::from_str(row).map_err(|e| format!("not valid JSON: {e}"))?;
        Self::from_value(&v)
    }

    fn from_value(row: &Value) -> Result<Self, String> {
        let err = |e: minijinja::Error| e.to_string();
        if row.kind() != ValueKind::Map {
            return Err("a row must be a JSON object".into());
        }
        let msgs = row.get_attr("messages").map_err(err)?;
        match msgs.kind() {
            ValueKind::Seq => {}
            ValueKind::Undefined => return Err("missing `messages`".into()),
            _ => return Err(format!("`messages` must be an array, got {}", kind(&msgs))),
        }
        let mut messages = Vec::new();
        let mut roles = Vec::new();
        for (i, m) in msgs.try_iter().map_err(err)?.enumerate() {
            if m.kind() != ValueKind::Map {
                return Err(format!("messages[{i}] must be an object, got {}", kind(&m)));
            }
            let role = m.get_attr("role").map_err(err)?;
            let role = match role.as_str() {
                Some(r) => Role::parse(r).ok_or_else(|| {
                    format!("messages[{i}].role is {r:?}; expected system, user, assistant or tool")
                })?,
                None if !present(&role) => return Err(format!("messages[{i}] has no `role`")),
                None => {
                    return Err(format!(
                        "messages[{i}].role must be a string, got {}",
                        kind(&role)
                    ))
                }
            };
            let content = m.get_attr("content").map_err(err)?;
            let calls = m.get_attr("tool_calls").map_err(err)?;
            let has_calls = present(&calls) && calls.len().unwrap_or(0) > 0;
            match (role, content.as_str()) {
                // Tool results may be structured (Llama-3.x templates print them with tojson).
                (Role::Tool, _) if present(&content) => {}
                (Role::Tool, _) => return Err(format!("messages[{i}] (tool) has no `content`")),
                (Role::Assistant, _) if has_calls && !present(&content) => {}
                (_, Some(_)) => {}
                (_, None) if !present(&content) => {
                    return Err(format!("messages[{i}] has no `content`"))
                }
                (_, None) => {
                    return Err(format!(
                        "messages[{i}].content must be a string, got {}",
                        kind(&content)
                    ))
                }
            }
            messages.push(normalize(&m).map_err(err)?);
            roles.push(role);
        }
        if messages.is_empty() {
            return Err("`messages` is empty".into());
        }
        let tools = row.get_attr("tools").map_err(err)?;
        let tools = match tools.kind() {
            ValueKind::Undefined | ValueKind::None => None,
            ValueKind::Seq => Some(tools),
            _ => return Err(format!("`tools` must be an array, got {}", kind(&tools))),
        };
        Ok(Conversation {
            messages,
            roles,
            tools,
        })
    }

    /// An error unless there is an assistant turn to train on and none is empty (a tool-calling
    /// turn may have no content).
    pub fn check_trainable(&self) -> Result<(), String> {
        if !self.roles.contains(&Role::Assistant) {
            return Err("no assistant turn to train on".into());
        }
        for (i, (m, r)) in self.messages.iter().zip(&self.roles).enumerate() {
            let content = m.get_attr("content").unwrap_or_default();
            let calls = m.get_attr("tool_calls").unwrap_or_default();
            let has_calls = present(&calls) && calls.len().unwrap_or(0) > 0;
            let empty = content.as_str().is_none_or(|c| c.trim().is_empty());
            if *r == Role::Assistant && empty && !has_calls {
                return Err(format!("messages[{i}] (assistant) is empty"));
            }
        }
        Ok(())
    }

    pub fn roles(&self) -> &[Role] {
        &self.roles
    }

    pub fn len(&self) -> usize {
        self.messages.len()
    }

    pub fn is_empty(&self) -> bool {
        self.messages.is_empty()
    }

    /// The template's render of the first `n` messages.
    pub fn render(
        &self,
        t: &ChatTemplate,
        n: usize,
        add_generation_prompt: bool,
    ) -> Result<String, TemplateError> {
        let msgs = Value::from(self.messages[..n].to_vec());
        t.render_values(msgs, self.tools.as_ref(), add_generation_prompt)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    #[error(transparent)]
    Template(#[from] TemplateError),
    /// A render of the messages before an assistant turn failed (e.g. a conversation that opens
    /// with the assistant, where the template reads `messages[0]`): the row's shape, not the
    /// template, so the row is a bad row.
    #[error(
        "the chat template cannot render messages[..{turn}] alone, which is needed to find where \
         that assistant turn starts: {source}"
    )]
    Prefix { turn: usize, source: TemplateError },
    #[error(
        "the chat template is not prefix-stable at messages[{turn}]: {detail}; the assistant spans \
         cannot be read from its renders (set [data] chat_template to a template that renders \
         earlier turns the same whatever follows them)"
    )]
    NotPrefixStable { turn: usize, detail: String },
    #[error(
        "the assistant turn messages[{turn}] renders as {text:?}, which does not end with a special \
         token (EOS or end-of-turn): the model would never learn to stop (use a template that \
         closes assistant turns with one, registered as a special token in tokenizer.json)"
    )]
    NoEndOfTurn { turn: usize, text: String },
}

/// A rendered conversation and the byte ranges of it that carry a loss.
#[derive(Debug, Clone, PartialEq)]
pub struct RenderedChat {
    pub text: String,
    pub trained: Vec<Range<usize>>,
}

/// Where `a` and `b` first differ, shown for an error.
fn divergence(part: &str, full: &str) -> String {
    let at = part
        .char_indices()
        .zip(full.chars())
        .find(|((_, a), b)| a != b)
        .map(|((i, _), _)| i)
        .unwrap_or(part.len().min(full.len()));
    let snip = |s: &str| s[at..].chars().take(40).collect::<String>();
    format!(
        "from byte {at}, the partial render has {:?} where the whole conversation has {:?}",
        snip(part),
        snip(full)
    )
}

/// Ends `span` (a slice of the render) right after its last special token, provided only
/// whitespace follows it; `None` if it has no such token. Also says which token it is.
fn end_of_turn<'s>(span: &str, specials: &'s [String]) -> Option<(usize, &'s str)> {
    specials
        .iter()
        .filter(|s| !s.is_empty())
        .filter_map(|s| {
            let pos = span.rfind(s.as_str())?;
            let end = pos + s.len();
            span[end..].trim().is_empty().then_some((end, s.as_str()))
        })
        .max_by_key(|(end, _)| *end)
}

/// An assistant turn found in the whole render: `start..end` is trained, and ends with `eot`.
struct Located {
    start: usize,
    end: usize,
    eot: String,
}

/// Where `part` (a render of the first messages) ends in `text` (the whole conversation's render),
/// when the two differ at most inside the earlier assistant turns `located` (e.g. Qwen3, which
/// shows an assistant turn's reasoning only while no user query follows it). Outside those turns
/// they must agree byte for byte; inside turn `l`, `text` runs from `l.start` to `l.end` and `part`
/// from the same place through the first `l.eot` after it.
fn align(part: &str, text: &str, located: &[Located]) -> Result<usize, String> {
    let mismatch = |p: usize, t: usize| {
        let snip = |s: &str, at: usize| {
            s.get(at..)
                .unwrap_or("")
                .chars()
                .take(40)
                .collect::<String>()
        };
        format!(
            "outside the earlier assistant turns, the partial render has {:?} where the whole \
             conversation has {:?} (byte {t})",
            snip(part, p),
            snip(text, t)
        )
    };
    let (pb, tb) = (part.as_bytes(), text.as_bytes());
    let (mut p, mut t) = (0, 0);
    for l in located {
        let n = l.start - t;
        if pb.len() - p <= n {
            break;
        }
        if pb[p..p + n] != tb[t..l.start] {
            return Err(mismatch(p, t));
        }
        p += n;
        let body = part.get(p..).ok_or_else(|| mismatch(p, t))?;
        let q = body.find(l.eot.as_str()).ok_or_else(|| {
            format!(
                "the partial render has no {:?} closing the assistant turn that starts at byte {} \
                 of the whole",
                l.eot, l.start
            )
        })?;
        p += q + l.eot.len();
        t = l.end;
    }
    if tb[t..].starts_with(&pb[p..]) {
        Ok(t + (pb.len() - p))
    } else {
        Err(mismatch(p, t))
    }
}

/// Finds assistant turn `turn` in `text` when the renders of the messages before it (`bare`, and
/// `before` with the generation prompt) or through it (`upto`) are not prefixes of `text`, but
/// differ from it only inside the earlier assistant turns `located`. The turn starts after the
/// generation prompt where `text` shows it whole; where it does not (Qwen3's empty think block
/// with `enable_thinking=false`, which earlier turns do not keep), after the prompt's first line,
/// its role header, which `text` and `upto` must both show. It ends at the first end-of-turn token
/// after that (the token that closes the turn in `upto`), which must be followed in `text` by
/// what follows it in `upto` (the separator). The renders are not guessed at: anything else is
/// an error.
fn realign(
    text: &str,
    located: &[Located],
    turn: usize,
    (bare, before, upto): (&str, &str, &str),
    specials: &[String],
) -> Result<Located, String> {
    let gen = before.strip_prefix(bare).ok_or_else(|| {
        format!(
            "the render of messages[..{turn}] with the generation prompt does not extend the one \
             without it"
        )
    })?;
    let own = upto.strip_prefix(bare).ok_or_else(|| {
        format!("the render of messages[..={turn}] does not extend that of messages[..{turn}]")
    })?;
    let at = align(bare, text, located)?;
    let shown = &text[at..];
    let start = if !gen.is_empty() && shown.starts_with(gen) {
        at + gen.len()
    } else {
        let header = gen.find('\n').map(|k| &gen[..=k]).ok_or_else(|| {
            format!("the whole render does not show the generation prompt {gen:?}")
        })?;
        if !(shown.starts_with(header) && own.starts_with(header)) {
            return Err(format!(
                "the whole render shows neither the generation prompt {gen:?} nor its first line \
                 there (it has {:?})",
                shown.chars().take(40).collect::<String>()
            ));
        }
        at + header.len()
    };
    let (own_end, eot) = end_of_turn(own, specials).ok_or_else(|| {
        format!("its render through messages[..={turn}] does not end with a special token")
    })?;
    let q = text[start..]
        .find(eot)
        .ok_or_else(|| format!("the whole render has no {eot:?} after the turn's start"))?;
    let end = start + q + eot.len();
    let sep = &own[own_end..];
    if !text[end..].starts_with(sep) {
        return Err(format!(
            "the turn's {eot:?} is not followed by {sep:?} in the whole render"
        ));
    }
    Ok(Located {
        start,
        end,
        eot: eot.to_string(),
    })
}

/// Renders `conv` and finds the spans to train: every assistant turn (`TrainOn::Assistant`) or the
/// whole text (`TrainOn::All`). `specials` are the tokenizer's special tokens.
///
/// A turn whose prefix renders are not prefixes of the whole (Qwen3 drops the reasoning of an
/// assistant turn once a user query follows it) is found by `realign` when the renders differ
/// only inside earlier assistant turns; the trained text is then the turn as the whole render shows
/// it, through its end-of-turn token.
pub fn render_spans(
    t: &ChatTemplate,
    conv: &Conversation,
    train_on: TrainOn,
    specials: &[String],
) -> Result<RenderedChat, ChatError> {
    let n = conv.messages.len();
    let text = conv.render(t, n, false)?;
    if train_on == TrainOn::All {
        let all = 0..text.len();
        return Ok(RenderedChat {
            text,
            trained: vec![all],
        });
    }
    let mut located: Vec<Located> = Vec::new();
    for (i, _) in conv
        .roles
        .iter()
        .enumerate()
        .filter(|(_, r)| **r == Role::Assistant)
    {
        let prefix = |n, agp| {
            conv.render(t, n, agp).map_err(|e| match e {
                TemplateError::Render { .. } => ChatError::Prefix { turn: i, source: e },
                e => ChatError::Template(e),
            })
        };
        let before = prefix(i, true)?;
        let upto = prefix(i + 1, false)?;
        let unstable = [(&before, "with the generation prompt"), (&upto, "")]
            .into_iter()
            .find(|(part, _)| !text.starts_with(part.as_str()));
        if let Some((part, what)) = unstable {
            let upto_what = if what.is_empty() {
                format!("messages[..={i}]")
            } else {
                format!("messages[..{i}] {what}")
            };
            let bare = prefix(i, false)?;
            let l =
                realign(&text, &located, i, (&bare, &before, &upto), specials).map_err(|why| {
                    ChatError::NotPrefixStable {
                        turn: i,
                        detail: format!(
                        "the render of {upto_what} is not a prefix of the whole conversation's \
                         ({}), and they do not differ only inside earlier assistant turns ({why})",
                        divergence(part, &text)
                    ),
                    }
                })?;
            // The turns were cut at the first end-of-turn token after their start: exact only if no
            // assistant message so far holds that token's text itself.
            let eots: Vec<&str> = located.iter().chain([&l]).map(|l| l.eot.as_str()).collect();
            let holds = conv.roles[..=i]
                .iter()
                .zip(&conv.messages)
                .filter(|(r, _)| **r == Role::Assistant)
                .find_map(|(_, m)| {
                    let m = m.to_string();
                    eots.iter().find(|e| m.contains(**e))
                });
            if let Some(eot) = holds {
                return Err(ChatError::NotPrefixStable {
                    turn: i,
                    detail: format!(
                        "the render of {upto_what} is not a prefix of the whole conversation's, \
                         and an assistant message holds the text of the end-of-turn token {eot:?} \
                         itself, so the turns cannot be told apart exactly"
                    ),
                });
            }
            located.push(l);
            continue;
        }
        if upto.len() <= before.len() {
            return Err(ChatError::NotPrefixStable {
                turn: i,
                detail: "the turn adds no text after the generation prompt".into(),
            });
        }
        let span = &text[before.len()..upto.len()];
        let (end, eot) = end_of_turn(span, specials).ok_or_else(|| ChatError::NoEndOfTurn {
            turn: i,
            text: span.to_string(),
        })?;
        located.push(Located {
            start: before.len(),
            end: before.len() + end,
            eot: eot.to_string(),
        });
    }
    let trained = located.into_iter().map(|l| l.start..l.end).collect();
    Ok(RenderedChat { text, trained })
}

/// Tokens for a rendered conversation: `labels` keep the tokens that overlap a trained span and
/// are `-100` elsewhere. The tokenizer adds its special tokens (BOS) only when the render does not
/// already start with the template's `bos_token`, so BOS is never doubled (transformers'
/// `apply_chat_template(tokenize=True)` never adds them; the two agree whenever the template emits
/// BOS itself or the tokenizer adds none). `keep`: only the first `keep` tokens are needed (a long
/// render is cut before tokenizing, [`Tokenizer::encode_prefix`]); `usize::MAX` for all.
pub fn tokenize(
    tok: &Tokenizer,
    t: &ChatTemplate,
    r: &RenderedChat,
    train_on: TrainOn,
    keep: usize,
) -> crate::Result<Example> {
    let has_bos = t
        .bos_token()
        .is_some_and(|b| !b.is_empty() && r.text.starts_with(b));
    // At least the first `keep` tokens (all of them for a text that is not long): a token's label
    // depends only on its id and offsets, which a harmless cut leaves as they are.
    let (ids, offsets) = tok.encode_prefix(&r.text, !has_bos, keep)?;
    let labels = ids
        .iter()
        .zip(&offsets)
        .map(|(&id, &(a, b))| {
            let keep =
                train_on == TrainOn::All || r.trained.iter().any(|s| a < s.end && b > s.start);
            if keep {
                id as i64
            } else {
                IGNORE
            }
        })
        .collect();
    Ok(Example {
        input_ids: ids,
        labels,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conv(json: &str) -> Result<Conversation, String> {
        let c = Conversation::from_json(json)?;
        c.check_trainable()?;
        Ok(c)
    }

    #[test]
    fn bad_conversations_say_what_is_wrong() {
        for (row, needle) in [
            (r#"[1]"#, "a row must be a JSON object"),
            (r#"{"msgs": []}"#, "missing `messages`"),
            (
                r#"{"messages": {}}"#,
                "`messages` must be an array, got an object",
            ),
            (r#"{"messages": []}"#, "`messages` is empty"),
            (
                r#"{"messages": ["hi"]}"#,
                "messages[0] must be an object, got a string",
            ),
            (
                r#"{"messages": [{"content": "x"}]}"#,
                "messages[0] has no `role`",
            ),
            (
                r#"{"messages": [{"role": "bot", "content": "x"}]}"#,
                r#"messages[0].role is "bot"; expected system, user, assistant or tool"#,
            ),
            (
                r#"{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": " \n"}]}"#,
                "messages[1] (assistant) is empty",
            ),
            (
                r#"{"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "a"}]}"#,
                "messages[0].content must be a string, got a number",
            ),
            (
                r#"{"messages": [{"role": "user", "content": "q"}]}"#,
                "no assistant turn",
            ),
            (
                r#"{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "tools": 1}"#,
                "`tools` must be an array",
            ),
        ] {
            let e = conv(row).unwrap_err();
            assert!(e.contains(needle), "{row}: {e}");
        }
        // A tool-calling assistant turn may have no content.
        conv(r#"{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}]}"#).unwrap();
    }

    #[test]
    fn messages_are_normalized_as_transformers_does() {
        let c = conv(r#"{"messages": [{"role": "user", "content": "q", "name": null}, {"role": "assistant", "content": "a", "reasoning": "r"}]}"#).unwrap();
        // null keys dropped; reasoning copied to thinking (first) and reasoning_content (last).
        let t = ChatTemplate::new("{{ messages | tojson }}", "t", &[]).unwrap();
        assert_eq!(
            c.render(&t, 2, false).unwrap(),
            r#"[{"role": "user", "content": "q"}, {"thinking": "r", "role": "assistant", "content": "a", "reasoning": "r", "reasoning_content": "r"}]"#
        );
    }

    #[test]
    fn spans_end_after_the_end_of_turn_token() {
        let chatml = "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";
        let t = ChatTemplate::new(chatml, "t", &[]).unwrap();
        let c = conv(r#"{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "A1"}, {"role": "user", "content": "r"}, {"role": "assistant", "content": "A2"}]}"#).unwrap();
        let specials = vec!["<|im_start|>".to_string(), "<|im_end|>".to_string()];
        let r = render_spans(&t, &c, TrainOn::Assistant, &specials).unwrap();
        let spans: Vec<&str> = r.trained.iter().map(|s| &r.text[s.clone()]).collect();
        assert_eq!(spans, ["A1<|im_end|>", "A2<|im_end|>"]);
        // Without the end token registered as special, the turn has nothing to stop on.
        let e = render_spans(&t, &c, TrainOn::Assistant, &specials[..1]).unwrap_err();
        assert!(matches!(e, ChatError::NoEndOfTurn { turn: 1, .. }), "{e}");
        let all = render_spans(&t, &c, TrainOn::All, &specials).unwrap();
        assert_eq!(all.trained, vec![0..all.text.len()]);
    }

    /// A conversation that opens with the assistant cannot be split where the template reads
    /// `messages[0]`: that is the row's problem (a skippable bad row), not a template failure.
    #[test]
    fn a_prefix_the_template_cannot_render_is_the_rows_problem() {
        let t = ChatTemplate::new(
            "{{ messages[0]['role'] }}:{% for m in messages %}{{ m.content }}</s>{% endfor %}",
            "t",
            &[],
        )
        .unwrap();
        let c = conv(r#"{"messages": [{"role": "assistant", "content": "hi"}]}"#).unwrap();
        let e = render_spans(&t, &c, TrainOn::Assistant, &["</s>".into()]).unwrap_err();
        assert!(matches!(e, ChatError::Prefix { turn: 0, .. }), "{e}");
    }

    #[test]
    fn a_template_that_rewrites_earlier_turns_is_refused() {
        // Prints the number of messages first, so every prefix render differs from the whole.
        let t = ChatTemplate::new(
            "{{ messages | length }}{% for m in messages %}{{ m.content }}</s>{% endfor %}",
            "t",
            &[],
        )
        .unwrap();
        let c = conv(r#"{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}"#).unwrap();
        let e = render_spans(&t, &c, TrainOn::Assistant, &["</s>".into()]).unwrap_err();
        assert!(
            matches!(e, ChatError::NotPrefixStable { turn: 1, .. }),
            "{e}"
        );
        assert!(
            e.to_string().contains("not prefix-stable at messages[1]"),
            "{e}"
        );
        // The difference is not inside an earlier assistant turn, so it is not realigned either.
        assert!(
            e.to_string()
                .contains("they do not differ only inside earlier assistant turns"),
            "{e}"
        );
    }

    /// A ChatML template that, like Qwen3's, shows an assistant turn's reasoning only while no user
    /// message follows it: earlier turns are found in the final render and trained as shown there.
    #[test]
    fn earlier_assistant_turns_rewritten_by_the_template_are_realigned() {
        let t = ChatTemplate::new(
            "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' and loop.last and m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% if plain %}<think></think>{% endif %}{% endif %}",
            "t",
            &[],
        )
        .unwrap();
        let c = conv(r#"{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "A1", "reasoning_content": "R1"}, {"role": "user", "content": "r"}, {"role": "assistant", "content": "A2", "reasoning_content": "R2"}]}"#).unwrap();
        let specials = vec!["<|im_start|>".to_string(), "<|im_end|>".to_string()];
        let spans = |t: &ChatTemplate| {
            let r = render_spans(t, &c, TrainOn::Assistant, &specials).unwrap();
            let s: Vec<String> = r
                .trained
                .iter()
                .map(|s| r.text[s.clone()].to_string())
                .collect();
            s
        };
        assert_eq!(spans(&t), ["A1<|im_end|>", "<think>R2</think>A2<|im_end|>"]);
        // A generation prompt the final render does not show whole: from its first line.
        let plain = t.clone().with_var("plain", &serde_json::Value::Bool(true));
        assert_eq!(
            spans(&plain),
            ["A1<|im_end|>", "<think>R2</think>A2<|im_end|>"]
        );
        // Without the end-of-turn token registered as special, the turn cannot be closed.
        let e = render_spans(&t, &c, TrainOn::Assistant, &specials[..1]).unwrap_err();
        assert!(
            matches!(e, ChatError::NotPrefixStable { turn: 1, .. }),
            "{e}"
        );
        assert!(
            e.to_string().contains("does not end with a special token"),
            "{e}"
        );
        // An assistant message holding the end-of-turn token's text cannot be cut exactly.
        let c = conv(r#"{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "A<|im_end|>\n1", "reasoning_content": "R1"}, {"role": "user", "content": "r"}, {"role": "assistant", "content": "A2"}]}"#).unwrap();
        let e = render_spans(&t, &c, TrainOn::Assistant, &specials).unwrap_err();
        assert!(
            matches!(e, ChatError::NotPrefixStable { turn: 1, .. }),
            "{e}"
        );
        assert!(
            e.to_string().contains("cannot be told apart exactly"),
            "{e}"
        );
    }
}
