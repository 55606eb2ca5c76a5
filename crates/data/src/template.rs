//! Chat templates, rendered byte-identically to transformers' `apply_chat_template(...,
//! tokenize=False)`.
//!
//! transformers compiles the template in a Jinja2 `ImmutableSandboxedEnvironment(trim_blocks=True,
//! lstrip_blocks=True, extensions=[loopcontrols])` with `raise_exception`, `strftime_now` and its own
//! `tojson` (plain `json.dumps`, no HTML escaping), and renders it with `messages`, `tools`,
//! `documents`, `add_generation_prompt` and the tokenizer's special tokens (`bos_token`,
//! `eos_token`, ...) as variables (transformers 5.24, `utils/chat_template_utils.py` and
//! `PreTrainedTokenizerBase.apply_chat_template`). [`ChatTemplate`] sets minijinja up the same way;
//! Python string methods (`.strip()`, `.startswith()`, `.items()`, ...) come from minijinja-contrib's
//! pycompat. Parity is checked against renders made by transformers itself
//! (`crates/data/tests/chat/`).

use minijinja::syntax::SyntaxConfig;
use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind};
use rtune_fsio::FileKind;
use std::path::Path;

use crate::pyjson::{self, Dumps};
use crate::{DataError, Tokenizer};

#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    #[error("{origin}: not a valid chat template: {message}")]
    Syntax { origin: String, message: String },
    /// The template called `raise_exception(message)`: it refuses this conversation.
    #[error("the chat template refused this conversation: {message}")]
    Raised { message: String },
    #[error("the chat template failed to render: {message}")]
    Render { message: String },
}

/// Carried as the source of the minijinja error `raise_exception` returns, so that a refusal can be
/// told apart from a template bug.
#[derive(Debug)]
struct Raised(String);

impl std::fmt::Display for Raised {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Raised {}

/// A compiled chat template plus the variables it is rendered with.
#[derive(Clone)]
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    origin: String,
    /// Special tokens and extra variables (e.g. a pinned `date_string`), passed to every render.
    vars: Vec<(String, Value)>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("origin", &self.origin)
            .field("vars", &self.vars)
            .finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Compiles `source`; `origin` names it in errors (a path, or `tokenizer_config.json`);
    /// `special_tokens` are `(name, text)` pairs such as `("bos_token", "<s>")`.
    pub fn new(
        source: impl Into<String>,
        origin: impl Into<String>,
        special_tokens: &[(String, String)],
    ) -> Result<Self, TemplateError> {
        let source = source.into();
        let origin = origin.into();
        let env = environment(&source).map_err(|e| TemplateError::Syntax {
            origin: origin.clone(),
            message: describe(&e),
        })?;
        let vars = special_tokens
            .iter()
            .map(|(k, v)| (k.clone(), Value::from(v.as_str())))
            .collect();
        Ok(ChatTemplate {
            env,
            source,
            origin,
            vars,
        })
    }

    /// The model's own template: `chat_template` in `tokenizer_config.json` (a string, or a named
    /// list from which "default" is used), else `chat_template.jinja` beside it (where transformers
    /// 5 saves it). `None` when the model has neither (e.g. a base model).
    pub fn from_tokenizer(tok: &Tokenizer) -> Result<Option<Self>, DataError> {
        let cfg_path = tok.dir.join("tokenizer_config.json");
        let file_err = |path: &Path, message: String| DataError::File {
            path: path.to_path_buf(),
            message,
        };
        let (source, origin) = match tok.config.get("chat_template") {
            Some(serde_json::Value::String(s)) => (s.clone(), cfg_path.clone()),
            Some(serde_json::Value::Array(list)) => {
                let named = |want: &str| {
                    list.iter().find_map(|t| {
                        (t.get("name")?.as_str()? == want)
                            .then(|| t.get("template")?.as_str().map(str::to_string))?
                    })
                };
                let Some(s) = named("default") else {
                    let names: Vec<&str> = list
                        .iter()
                        .filter_map(|t| t.get("name")?.as_str())
                        .collect();
                    return Err(file_err(
                        &cfg_path,
                        format!(
                            "`chat_template` lists {names:?} but no \"default\"; set [data] chat_template to a .jinja file"
                        ),
                    ));
                };
                (s, cfg_path.clone())
            }
            Some(serde_json::Value::Null) | None => {
                let jinja = tok.dir.join("chat_template.jinja");
                match crate::read_optional(&jinja, FileKind::ChatTemplate)? {
                    Some(s) => (s, jinja),
                    None => return Ok(None),
                }
            }
            Some(other) => {
                return Err(file_err(
                    &cfg_path,
                    format!(
                    "`chat_template` must be a string or a list of {{name, template}}, got {other}"
                ),
                ))
            }
        };
        let t = ChatTemplate::new(
            source,
            origin.display().to_string(),
            &tok.special_token_vars(),
        )?;
        Ok(Some(t))
    }

    /// A template from a `.jinja` file (`chat_template = "path.jinja"`, for base models without
    /// one), rendered with `tok`'s special tokens.
    pub fn from_file(path: &Path, tok: &Tokenizer) -> Result<Self, DataError> {
        let source =
            rtune_fsio::read_string_bounded(path, FileKind::ChatTemplate).map_err(|e| {
                DataError::File {
                    path: path.to_path_buf(),
                    message: format!("cannot read chat template: {e}"),
                }
            })?;
        Ok(ChatTemplate::new(
            source,
            path.display().to_string(),
            &tok.special_token_vars(),
        )?)
    }

    /// Sets an extra template variable for every render, as transformers' `**kwargs` would, e.g.
    /// `date_string` to pin the date Llama-3.x templates print (else `strftime_now` gives today's,
    /// and tokens change from day to day).
    pub fn with_var(mut self, name: &str, value: &serde_json::Value) -> Self {
        // serde_json's Value always converts; its maps are sorted, which only `tojson` could see.
        let value = serde::Deserialize::deserialize(value.clone()).unwrap_or_default();
        match self.vars.iter_mut().find(|(k, _)| k == name) {
            Some(slot) => slot.1 = value,
            None => self.vars.push((name.to_string(), value)),
        }
        self
    }

    pub fn source(&self) -> &str {
        &self.source
    }

    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// The text of the BOS token the template sees as `bos_token`, if any.
    pub fn bos_token(&self) -> Option<&str> {
        self.vars
            .iter()
            .find(|(k, _)| k == "bos_token")
            .and_then(|(_, v)| v.as_str())
    }

    /// Renders `messages` (a sequence of message maps, as the template sees them) and `tools`
    /// (`None` renders as Python's `None`, as transformers passes it).
    pub(crate) fn render_values(
        &self,
        messages: Value,
        tools: Option<&Value>,
        add_generation_prompt: bool,
    ) -> Result<String, TemplateError> {
        // As in transformers, the caller's variables come after (and override) the special tokens.
        let ctx = Value::from_pairs(
            self.vars
                .iter()
                .map(|(k, v)| (k.as_str(), v.clone()))
                .chain([
                    ("messages", messages),
                    ("tools", tools.cloned().unwrap_or(Value::from(()))),
                    ("documents", Value::from(())),
                    ("add_generation_prompt", Value::from(add_generation_prompt)),
                ]),
        );
        let tmpl = self
            .env
            .get_template("chat")
            .map_err(|e| TemplateError::Render {
                message: describe(&e),
            })?;
        let mut out = CappedWriter::default();
        match tmpl.render_captured_to(ctx, &mut out) {
            Ok(_) => String::from_utf8(out.buf).map_err(|_| TemplateError::Render {
                message: "the output is not valid UTF-8".into(),
            }),
            Err(e) if e.kind() == ErrorKind::OutOfFuel => Err(TemplateError::Render {
                message: format!(
                    "stopped after {TEMPLATE_FUEL} steps for one conversation: the template loops \
                     or explodes (a chat template from a model is untrusted input)"
                ),
            }),
            Err(_) if out.over => Err(TemplateError::Render {
                message: format!(
                    "stopped at {} MiB of output for one conversation: the template explodes (a \
                     chat template from a model is untrusted input)",
                    TEMPLATE_MAX_OUTPUT >> 20
                ),
            }),
            Err(e) => Err(match raised_message(&e) {
                Some(message) => TemplateError::Raised { message },
                None => TemplateError::Render {
                    message: describe(&e),
                },
            }),
        }
    }
}

/// Steps (minijinja's fuel: about one per instruction) one render may take. Real templates take a
/// few thousand per conversation (tens per message); 5 M is ~0.1 s of work on an idle core, so a
/// template that loops is refused quickly instead of hanging the run.
pub const TEMPLATE_FUEL: u64 = 5_000_000;

/// Bytes one render may produce. A conversation the trainer keeps is at most `max_seq_len` tokens;
/// 64 MiB is far past that and still bounds what an exploding template can allocate.
pub const TEMPLATE_MAX_OUTPUT: usize = 64 << 20;

/// The render's output, refusing to grow past [`TEMPLATE_MAX_OUTPUT`].
#[derive(Default)]
struct CappedWriter {
    buf: Vec<u8>,
    over: bool,
}

impl std::io::Write for CappedWriter {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        if self.buf.len() + b.len() > TEMPLATE_MAX_OUTPUT {
            self.over = true;
            return Err(std::io::Error::other("template output limit"));
        }
        self.buf.extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// An error's text with its line, and the chain of causes minijinja keeps.
fn describe(e: &Error) -> String {
    let mut s = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(inner) = src {
        s.push_str(&format!(": {inner}"));
        src = inner.source();
    }
    s
}

fn raised_message(e: &Error) -> Option<String> {
    let mut src: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = src {
        if let Some(r) = err.downcast_ref::<Raised>() {
            return Some(r.0.clone());
        }
        src = err.source();
    }
    None
}

fn environment(source: &str) -> Result<Environment<'static>, Error> {
    let mut env = Environment::new();
    env.set_fuel(Some(TEMPLATE_FUEL));
    env.set_syntax(
        SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()?,
    );
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_filter("tojson", tojson);
    env.add_function(
        "raise_exception",
        |message: String| -> Result<Value, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, message.clone())
                .with_source(Raised(message)))
        },
    );
    env.add_function("strftime_now", |format: String| -> Result<String, Error> {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs() as i64)
            .unwrap_or(0);
        strftime(&format, now)
    });
    env.add_template_owned("chat", source.to_string())?;
    Ok(env)
}

/// transformers' `tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`.
fn tojson(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) if v.kind() == ValueKind::String => Some(v.as_str().unwrap_or_default().into()),
        Some(v) => Some(" ".repeat(usize::try_from(v)?)),
    };
    let mut o = Dumps::new(indent);
    if let Some(b) = kwargs.get::<Option<bool>>("ensure_ascii")? {
        o.ensure_ascii = b;
    }
    if let Some(b) = kwargs.get::<Option<bool>>("sort_keys")? {
        o.sort_keys = b;
    }
    if let Some(seps) = kwargs.get::<Option<Value>>("separators")? {
        if !seps.is_none() {
            let parts: Vec<Value> = seps.try_iter()?.collect();
            match parts.as_slice() {
                [a, b] if a.as_str().is_some() && b.as_str().is_some() => {
                    o.item_sep = a.as_str().unwrap_or_default().into();
                    o.key_sep = b.as_str().unwrap_or_default().into();
                }
                _ => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be a pair of strings",
                    ))
                }
            }
        }
    }
    kwargs.assert_all_used()?;
    Ok(Value::from(pyjson::dumps(value, &o)?))
}

const DAYS: [&str; 7] = [
    "Sunday",
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
];
const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];

/// Python's `time.strftime(format, time.gmtime(unix))` for the C89 codes templates use (plus
/// glibc's `%-d`-style unpadded forms). transformers uses the local time; rtune uses UTC so a
/// run's tokens do not depend on the machine's time zone.
pub(crate) fn strftime(format: &str, unix: i64) -> Result<String, Error> {
    let days = unix.div_euclid(86_400);
    let secs = unix.rem_euclid(86_400);
    let (h, mi, s) = (secs / 3600, secs / 60 % 60, secs % 60);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy_mar = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy_mar + 2) / 153;
    let d = doy_mar - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    let leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    let cum = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = cum[(m - 1) as usize] + d + i64::from(leap && m > 2);
    let wday = (days + 4).rem_euclid(7) as usize;
    let h12 = if h % 12 == 0 { 12 } else { h % 12 };

    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let mut spec = chars.next();
        let unpadded = spec == Some('-');
        if unpadded {
            spec = chars.next();
        }
        let num = |n: i64, width: usize| {
            if unpadded {
                n.to_string()
            } else {
                format!("{n:0width$}")
            }
        };
        let piece = match spec {
            Some('Y') => y.to_string(),
            Some('y') => num(y.rem_euclid(100), 2),
            Some('m') => num(m, 2),
            Some('d') => num(d, 2),
            Some('e') => format!("{d:2}"),
            Some('j') => num(yday, 3),
            Some('H') => num(h, 2),
            Some('I') => num(h12, 2),
            Some('M') => num(mi, 2),
            Some('S') => num(s, 2),
            Some('p') => if h < 12 { "AM" } else { "PM" }.into(),
            Some('b') | Some('h') => MONTHS[(m - 1) as usize][..3].into(),
            Some('B') => MONTHS[(m - 1) as usize].into(),
            Some('a') => DAYS[wday][..3].into(),
            Some('A') => DAYS[wday].into(),
            Some('%') => "%".into(),
            other => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!(
                        "strftime_now: unsupported format code %{}",
                        other.unwrap_or(' ')
                    ),
                ))
            }
        };
        out.push_str(&piece);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(src: &str, messages: &str) -> Result<String, TemplateError> {
        let t = ChatTemplate::new(src, "test", &[("bos_token".into(), "<s>".into())])?;
        let msgs: Value = serde_json::from_str(messages).unwrap();
        t.render_values(msgs, None, false)
    }

    // Expected values are CPython's `time.strftime(fmt, time.gmtime(ts))`.
    #[test]
    fn strftime_matches_python_gmtime() {
        let ts = 1_721_995_200 + 3600 * 13 + 60 * 7 + 9;
        assert_eq!(strftime("%d %b %Y", ts).unwrap(), "27 Jul 2024");
        assert_eq!(
            strftime("%Y-%m-%d %H:%M:%S", ts).unwrap(),
            "2024-07-27 01:07:09"
        );
        assert_eq!(
            strftime("%A %B %-d %y %j %I %p %a %e %%", ts).unwrap(),
            "Saturday July 27 24 209 01 AM Sat 27 %"
        );
        assert_eq!(
            strftime("%d %b %Y %A %j", 951_782_400).unwrap(),
            "29 Feb 2000 Tuesday 060"
        );
        assert!(strftime("%Q", 0).is_err());
    }

    /// `strftime_now` is today's date in UTC (the Llama-3.x templates print it).
    #[test]
    fn strftime_now_gives_the_current_date() {
        let before = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs() as i64;
        let got = render("{{ strftime_now('%d %b %Y') }}", "[]").unwrap();
        let after = before + 5;
        let ok = [before, after].map(|t| strftime("%d %b %Y", t).unwrap());
        assert!(ok.contains(&got), "{got} not in {ok:?}");
    }

    /// CPU time this thread has used (CLOCK_THREAD_CPUTIME_ID).
    fn thread_cpu_seconds() -> f64 {
        let mut t = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: clock_gettime writes one timespec, which `t` is.
        let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
        assert_eq!(rc, 0);
        t.tv_sec as f64 + t.tv_nsec as f64 * 1e-9
    }

    #[test]
    fn looping_or_exploding_templates_are_refused_quickly() {
        let t0 = thread_cpu_seconds();
        let e = render(
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
            "[]",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("loops or explodes"), "{e}");
        // Refused within a second of this thread's CPU time (~0.2 s measured in a debug build):
        // CPU time, not wall time, so that other tests running beside it cannot fail it.
        let spent = thread_cpu_seconds() - t0;
        assert!(spent < 1.0, "{spent} s");
        let e = render(
            "{% set s = 'x' * 1000000 %}{% for i in range(100) %}{{ s }}{% endfor %}",
            "[]",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("MiB of output"), "{e}");
        // A normal render is untouched by the limits: Llama 3.2's template over 2000 messages.
        assert_eq!(render("{{ messages|length }}", "[1, 2]").unwrap(), "2");
        let src = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/chat/templates/llama-3.2-instruct.jinja"
        ))
        .unwrap();
        let turns: Vec<String> = (0..2000)
            .map(|i| {
                let role = ["user", "assistant"][i % 2];
                format!(r#"{{"role": "{role}", "content": "message number {i}"}}"#)
            })
            .collect();
        let out = render(&src, &format!("[{}]", turns.join(","))).unwrap();
        assert!(out.contains("message number 1999"));
    }

    #[test]
    fn raise_exception_is_typed_and_keeps_its_message() {
        let e = render("{{ raise_exception('roles must alternate') }}", "[]").unwrap_err();
        match e {
            TemplateError::Raised { message } => assert_eq!(message, "roles must alternate"),
            other => panic!("expected Raised, got {other:?}"),
        }
        // Any other failure is a render error, not a refusal.
        let e = render("{{ messages[0].content.nope() }}", r#"[{"content": "x"}]"#).unwrap_err();
        assert!(matches!(e, TemplateError::Render { .. }), "{e:?}");
        let e = ChatTemplate::new("{% if %}", "bad.jinja", &[]).unwrap_err();
        assert!(
            e.to_string()
                .starts_with("bad.jinja: not a valid chat template"),
            "{e}"
        );
    }

    // trim_blocks drops the newline after a block tag; lstrip_blocks the indentation before it;
    // a single trailing newline of the template is dropped (Jinja2's keep_trailing_newline=False).
    // Expected: Jinja2 3.1.6's `ImmutableSandboxedEnvironment(trim_blocks=True,
    // lstrip_blocks=True)` render of the same source and messages.
    #[test]
    fn whitespace_control_is_jinja2s() {
        let src = "{% for m in messages %}\n    {% if loop.first %}\n[{{ m.content.strip() }}]\n    {% endif %}\n{% endfor %}\n";
        assert_eq!(
            render(src, r#"[{"content": " a "}, {"content": "b"}]"#).unwrap(),
            "[a]\n"
        );
    }

    // Expected: Jinja2 with transformers' `tojson` (json.dumps) on the same source.
    #[test]
    fn tojson_filter_takes_python_kwargs() {
        let src = "{{ messages | tojson }}|{{ messages | tojson(indent=1) }}|{{ messages | tojson(separators=(',', ':'), sort_keys=true) }}";
        assert_eq!(
            render(src, r#"[{"b": 1, "a": "é"}]"#).unwrap(),
            "[{\"b\": 1, \"a\": \"é\"}]|[\n {\n  \"b\": 1,\n  \"a\": \"é\"\n }\n]|[{\"a\":\"é\",\"b\":1}]"
        );
        assert!(render("{{ messages | tojson(bogus=1) }}", "[]").is_err());
    }
}
