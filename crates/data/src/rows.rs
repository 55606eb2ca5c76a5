//! A JSONL data file read a row at a time, bounded, and what a malformed row becomes: the one loop
//! under the streamed loaders (preference pairs, GRPO prompts).

use std::path::Path;

use crate::{DataError, OnBadRow, Result};

/// One line of a data file, without its line end (`\n` or `\r\n`).
pub enum Line<'a> {
    Text(&'a str),
    /// Longer than `max_row_bytes`: passed over unread.
    Oversized,
}

/// Streams `path`'s lines to `f(line, number)` (1-based): memory is one row of at most
/// `max_row_bytes`, whatever the file's size. Only a regular file is read ([`crate::open_data`]);
/// a line that is not UTF-8 is an error naming it.
pub fn for_each_line(
    path: &Path,
    max_row_bytes: usize,
    mut f: impl FnMut(Line, usize) -> Result<()>,
) -> Result<()> {
    let mut reader = std::io::BufReader::with_capacity(1 << 20, crate::open_data(path)?);
    for line in 1.. {
        let mut buf = Vec::new();
        let (n, over) = crate::cache::read_line_capped(&mut reader, &mut buf, max_row_bytes)
            .map_err(|e| DataError::File {
                path: path.to_path_buf(),
                message: format!("cannot read data: {e}"),
            })?;
        if n == 0 {
            break;
        }
        if over {
            f(Line::Oversized, line)?;
            continue;
        }
        let text = crate::line_utf8(path, line, buf)?;
        let text = text.strip_suffix('\n').unwrap_or(&text);
        let text = text.strip_suffix('\r').unwrap_or(text);
        f(Line::Text(text), line)?;
    }
    Ok(())
}

/// Why a row gave nothing.
pub(crate) enum RowError {
    /// The row is malformed: skippable with `on_bad_row = "skip"`.
    Bad(String),
    /// Not the row's fault (no tokenizer, no template, a tokenizer failure): never skipped.
    Fatal(String),
}

impl From<String> for RowError {
    fn from(m: String) -> Self {
        RowError::Bad(m)
    }
}

impl From<&str> for RowError {
    fn from(m: &str) -> Self {
        RowError::Bad(m.into())
    }
}

/// A row's error as `[data] on_bad_row` has it: the error (`file:line: …`), or counted in
/// `count` with the first few messages kept in `samples`.
pub(crate) fn skip_or_fail(
    e: RowError,
    path: &Path,
    line: usize,
    on_bad_row: OnBadRow,
    count: &mut usize,
    samples: &mut Vec<String>,
) -> Result<()> {
    let (skippable, message) = match e {
        RowError::Bad(m) => (true, m),
        RowError::Fatal(m) => (false, m),
    };
    let err = DataError::Row {
        path: path.to_path_buf(),
        line,
        message,
    };
    if !skippable || on_bad_row == OnBadRow::Error {
        return Err(err);
    }
    *count += 1;
    if samples.len() < crate::Dataset::BAD_ROW_SAMPLES {
        samples.push(err.to_string());
    }
    Ok(())
}
