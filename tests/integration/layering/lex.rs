//! The lexer of the layering test: a Rust file as identifiers, `::` and single punctuation
//! marks, each with its line; comments (doc comments too) skipped, string literals one opaque
//! token (only `#[path = "…"]` reads them), char literals dropped, lifetimes one `'`.

#[derive(Clone, Debug, PartialEq)]
pub(super) enum Tok {
    Ident(String),
    /// A string literal's contents (only `#[path = "…"]` reads them).
    Str(String),
    Punct(String),
}

pub(super) struct Token {
    pub(super) tok: Tok,
    pub(super) line: usize,
}

pub(super) fn lex(src: &str) -> Vec<Token> {
    let b: Vec<char> = src.chars().collect();
    let at = |i: usize| b.get(i).copied().unwrap_or('\0');
    let ident_start = |c: char| c.is_alphabetic() || c == '_';
    let ident_char = |c: char| c.is_alphanumeric() || c == '_';
    let mut out = Vec::new();
    let (mut i, mut line) = (0, 1);
    while i < b.len() {
        let c = b[i];
        let start_line = line;
        if c == '\n' {
            line += 1;
            i += 1;
        } else if c.is_whitespace() {
            i += 1;
        } else if c == '/' && at(i + 1) == '/' {
            while i < b.len() && b[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && at(i + 1) == '*' {
            let mut depth = 0;
            loop {
                if i >= b.len() {
                    break;
                } else if b[i] == '/' && at(i + 1) == '*' {
                    depth += 1;
                    i += 2;
                } else if b[i] == '*' && at(i + 1) == '/' {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    line += (b[i] == '\n') as usize;
                    i += 1;
                }
            }
        } else if let Some(end) = string_end(&b, i) {
            let text: String = b[i..end].iter().collect();
            line += text.matches('\n').count();
            out.push(Token {
                tok: Tok::Str(text),
                line: start_line,
            });
            i = end;
        } else if c == '\'' {
            if at(i + 1) == '\\' {
                // '\n', '\'', '\u{…}'
                i += 3;
                while i < b.len() && b[i] != '\'' {
                    i += 1;
                }
                i += 1;
            } else if at(i + 2) == '\'' {
                i += 3;
            } else {
                // A lifetime or label.
                i += 1;
                while ident_char(at(i)) {
                    i += 1;
                }
                out.push(Token {
                    tok: Tok::Punct("'".into()),
                    line,
                });
            }
        } else if ident_start(c) {
            if c == 'r' && at(i + 1) == '#' && ident_start(at(i + 2)) {
                i += 2; // a raw identifier
            }
            let s = i;
            while ident_char(at(i)) {
                i += 1;
            }
            out.push(Token {
                tok: Tok::Ident(b[s..i].iter().collect()),
                line,
            });
        } else if c.is_ascii_digit() {
            while ident_char(at(i)) || (at(i) == '.' && at(i + 1).is_ascii_digit()) {
                i += 1;
            }
        } else if c == ':' && at(i + 1) == ':' {
            out.push(Token {
                tok: Tok::Punct("::".into()),
                line,
            });
            i += 2;
        } else {
            out.push(Token {
                tok: Tok::Punct(c.to_string()),
                line,
            });
            i += 1;
        }
    }
    out
}

/// Where a string literal starting at `i` ends (one past its closing quote): `"…"`, `b"…"`,
/// `c"…"`, `r#"…"#`, `br"…"`, `cr"…"`.
fn string_end(b: &[char], i: usize) -> Option<usize> {
    let at = |j: usize| b.get(j).copied().unwrap_or('\0');
    if i > 0 && (at(i - 1).is_alphanumeric() || at(i - 1) == '_') {
        return None;
    }
    let mut j = i;
    if matches!(at(j), 'b' | 'c') {
        j += 1;
    }
    if at(j) == 'r' {
        j += 1;
        let mut hashes = 0;
        while at(j) == '#' {
            hashes += 1;
            j += 1;
        }
        if at(j) != '"' {
            return None;
        }
        j += 1;
        while j < b.len() {
            if b[j] == '"' && (1..=hashes).all(|h| at(j + h) == '#') {
                return Some(j + 1 + hashes);
            }
            j += 1;
        }
        return Some(b.len());
    }
    if at(j) != '"' {
        return None;
    }
    j += 1;
    while j < b.len() {
        match b[j] {
            '\\' => j += 2,
            '"' => return Some(j + 1),
            _ => j += 1,
        }
    }
    Some(b.len())
}
