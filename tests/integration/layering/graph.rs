//! The file graph of the layering test: each file parsed into its module declarations and the
//! paths it names (with the inline module each stands in), the module tree of every crate built
//! from its root, each path resolved to the deepest module it names — through the named
//! re-exports on the way (`pub use b::X;` in `a` makes `crate::a::X` name `b`, where `X` lives;
//! glob re-exports are not followed) — and the edges between files that are not a file naming
//! itself or an ancestor; then the circles (Tarjan's strongly connected components) and a readable
//! cycle through each.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};

use super::lex::{lex, Tok, Token};

enum Event {
    /// `mod name;` (a file) or `mod name { … }` (inline), in the inline modules `scope`.
    Mod {
        scope: Vec<String>,
        name: String,
        inline: bool,
        path_attr: Option<String>,
    },
    /// A path in a `use` tree or in code.
    Path {
        scope: Vec<String>,
        segments: Vec<String>,
        line: usize,
    },
    /// A named re-export: `pub use segments;` (or `… as name`) makes `name` an item of the module.
    ReExport {
        scope: Vec<String>,
        name: String,
        segments: Vec<String>,
    },
}

fn parse(src: &str) -> Vec<Event> {
    let t = lex(src);
    let is = |k: usize, s: &str| match t.get(k).map(|x| &x.tok) {
        Some(Tok::Punct(p)) | Some(Tok::Ident(p)) => p == s,
        _ => false,
    };
    let ident = |k: usize| match t.get(k).map(|x| &x.tok) {
        Some(Tok::Ident(s)) => Some(s.clone()),
        _ => None,
    };
    let mut events = Vec::new();
    let mut scope: Vec<(String, usize)> = Vec::new();
    let names = |scope: &[(String, usize)]| scope.iter().map(|(n, _)| n.clone()).collect();
    let (mut depth, mut path_attr, mut k) = (0usize, None, 0);
    while k < t.len() {
        if is(k, "#") && is(k + 1, "[") && is(k + 2, "path") && is(k + 3, "=") {
            if let Some(Tok::Str(s)) = t.get(k + 4).map(|x| &x.tok) {
                let s = s.trim_start_matches(['b', 'c', 'r', '#']);
                path_attr = Some(s.trim_matches(['"', '#']).to_string());
            }
            k += 4;
        } else if is(k, "mod") && ident(k + 1).is_some() && (is(k + 2, ";") || is(k + 2, "{")) {
            let name = ident(k + 1).unwrap();
            let inline = is(k + 2, "{");
            events.push(Event::Mod {
                scope: names(&scope),
                name: name.clone(),
                inline,
                path_attr: path_attr.take(),
            });
            if inline {
                depth += 1;
                scope.push((name, depth));
            }
            k += 3;
        } else if is(k, "use") && !is(k + 1, "<") && !(k > 0 && is(k - 1, "::")) {
            let line = t[k].line;
            // `pub use`, `pub(crate) use`, `pub(super) use`, `pub(in …) use`.
            let public = (k >= 1 && is(k - 1, "pub"))
                || (k >= 4
                    && is(k - 1, ")")
                    && (k - 4..k - 1).any(|j| is(j, "pub") && is(j + 1, "(")));
            let mut paths = Vec::new();
            k += 1;
            use_tree(&t, &mut k, Vec::new(), &mut paths);
            for (segments, alias) in paths.into_iter().filter(|(p, _)| !p.is_empty()) {
                let name = alias.or_else(|| segments.last().cloned());
                if let Some(name) = name.filter(|n| public && n != "self" && n != "*") {
                    events.push(Event::ReExport {
                        scope: names(&scope),
                        name,
                        segments: segments.clone(),
                    });
                }
                events.push(Event::Path {
                    scope: names(&scope),
                    segments,
                    line,
                });
            }
        } else if ident(k).is_some() && is(k + 1, "::") && !(k > 0 && is(k - 1, "::")) {
            let line = t[k].line;
            let mut segments = vec![ident(k).unwrap()];
            k += 1;
            while is(k, "::") && ident(k + 1).is_some() {
                segments.push(ident(k + 1).unwrap());
                k += 2;
            }
            events.push(Event::Path {
                scope: names(&scope),
                segments,
                line,
            });
        } else {
            if is(k, "{") {
                depth += 1;
            } else if is(k, "}") {
                if scope.last().is_some_and(|(_, d)| *d == depth) {
                    scope.pop();
                }
                depth = depth.saturating_sub(1);
            }
            if is(k, ";") || is(k, "{") || is(k, "}") {
                path_attr = None;
            }
            k += 1;
        }
    }
    events
}

/// One `use` tree from `t[*k]`: `a::b`, `a::{b, c::d as e, self}`, `a::*`; each full path pushed
/// to `out` with its `as` name (a group's `self` as the group's path plus `self`, a glob as its
/// path plus `*`). Stops before `,` `}` `;`.
fn use_tree(
    t: &[Token],
    k: &mut usize,
    prefix: Vec<String>,
    out: &mut Vec<(Vec<String>, Option<String>)>,
) {
    let mut path = prefix;
    loop {
        match t.get(*k).map(|x| &x.tok) {
            Some(Tok::Ident(s)) if s == "as" => {
                let alias = match t.get(*k + 1).map(|x| &x.tok) {
                    Some(Tok::Ident(a)) => Some(a.clone()),
                    _ => None,
                };
                *k += 2;
                out.push((path, alias));
                return;
            }
            Some(Tok::Ident(s)) => {
                path.push(s.clone());
                *k += 1;
            }
            Some(Tok::Punct(p)) if p == "::" || p == "$" => *k += 1,
            Some(Tok::Punct(p)) if p == "*" => {
                *k += 1;
                out.push((path, Some("*".into())));
                return;
            }
            Some(Tok::Punct(p)) if p == "{" => {
                *k += 1;
                loop {
                    match t.get(*k).map(|x| &x.tok) {
                        None => return,
                        Some(Tok::Punct(p)) if p == "}" => {
                            *k += 1;
                            return;
                        }
                        Some(Tok::Punct(p)) if p == "," => *k += 1,
                        _ => {
                            let before = *k;
                            use_tree(t, k, path.clone(), out);
                            if *k == before {
                                *k += 1;
                            }
                        }
                    }
                }
            }
            _ => {
                out.push((path, None));
                return;
            }
        }
    }
}

struct Module {
    file: String,
    parent: Option<usize>,
    children: HashMap<String, usize>,
    /// Named re-exports: item name → the path it re-exports, resolved from this module.
    reexports: HashMap<String, Vec<String>>,
}

pub(super) struct Graph {
    /// file → file it names → (line, path as written) of the first reference.
    pub(super) edges: BTreeMap<String, BTreeMap<String, (usize, String)>>,
}

impl Graph {
    pub(super) fn build(files: &BTreeMap<String, String>, roots: &[String]) -> Graph {
        let parsed: HashMap<&str, Vec<Event>> =
            files.iter().map(|(p, s)| (p.as_str(), parse(s))).collect();
        let mut graph = Graph {
            edges: BTreeMap::new(),
        };
        for root in roots.iter().filter(|r| files.contains_key(*r)) {
            let mut mods = Vec::new();
            let mut loaded = Vec::new();
            load(&parsed, files, root, true, None, &mut mods, &mut loaded);
            for (file, top) in &loaded {
                for e in &parsed[file.as_str()] {
                    if let Event::ReExport {
                        scope,
                        name,
                        segments,
                    } = e
                    {
                        let at = inline_module(&mods, *top, scope);
                        mods[at].reexports.insert(name.clone(), segments.clone());
                    }
                }
            }
            for (file, top) in loaded {
                for e in &parsed[file.as_str()] {
                    let Event::Path {
                        scope,
                        segments,
                        line,
                    } = e
                    else {
                        continue;
                    };
                    let from = inline_module(&mods, top, scope);
                    let Some(to) = resolve(&mods, from, segments) else {
                        continue;
                    };
                    // The file itself or an ancestor's file (its items, inline modules too).
                    let mut a = Some(from);
                    while let Some(m) = a {
                        if mods[m].file == mods[to].file {
                            break;
                        }
                        a = mods[m].parent;
                    }
                    if a.is_some() {
                        continue;
                    }
                    // As written, less a `use` group's trailing `self`.
                    let written = segments.join("::");
                    let written = written.strip_suffix("::self").unwrap_or(&written);
                    graph
                        .edges
                        .entry(file.clone())
                        .or_default()
                        .entry(mods[to].file.clone())
                        .or_insert((*line, written.to_string()));
                }
            }
        }
        graph
    }

    /// The strongly connected components of more than one file (Tarjan), each sorted, in order.
    pub(super) fn circles(&self) -> Vec<Vec<String>> {
        struct State<'a> {
            g: &'a Graph,
            index: HashMap<&'a str, usize>,
            low: HashMap<&'a str, usize>,
            stack: Vec<&'a str>,
            on_stack: BTreeSet<&'a str>,
            out: Vec<Vec<String>>,
        }
        fn visit<'a>(s: &mut State<'a>, v: &'a str) {
            let i = s.index.len();
            s.index.insert(v, i);
            s.low.insert(v, i);
            s.stack.push(v);
            s.on_stack.insert(v);
            for w in s.g.edges.get(v).into_iter().flat_map(|e| e.keys()) {
                if !s.index.contains_key(w.as_str()) {
                    visit(s, w);
                    let lw = s.low[w.as_str()];
                    let lv = s.low.get_mut(v).unwrap();
                    *lv = (*lv).min(lw);
                } else if s.on_stack.contains(w.as_str()) {
                    let iw = s.index[w.as_str()];
                    let lv = s.low.get_mut(v).unwrap();
                    *lv = (*lv).min(iw);
                }
            }
            if s.low[v] == s.index[v] {
                let mut scc = Vec::new();
                loop {
                    let w = s.stack.pop().unwrap();
                    s.on_stack.remove(w);
                    scc.push(w.to_string());
                    if w == v {
                        break;
                    }
                }
                if scc.len() > 1 {
                    scc.sort();
                    s.out.push(scc);
                }
            }
        }
        let mut s = State {
            g: self,
            index: HashMap::new(),
            low: HashMap::new(),
            stack: Vec::new(),
            on_stack: BTreeSet::new(),
            out: Vec::new(),
        };
        for v in self.edges.keys() {
            if !s.index.contains_key(v.as_str()) {
                visit(&mut s, v);
            }
        }
        s.out.sort();
        s.out
    }

    /// A circle as the shortest cycle through its first file, a step a line (`from:line path →
    /// to`), and the files of the component that cycle misses.
    pub(super) fn describe(&self, scc: &[String]) -> String {
        let members: BTreeSet<&str> = scc.iter().map(String::as_str).collect();
        let start = scc[0].as_str();
        let mut prev: HashMap<&str, &str> = HashMap::new();
        let mut queue = VecDeque::from([start]);
        'bfs: while let Some(v) = queue.pop_front() {
            for w in self.edges[v].keys().map(String::as_str) {
                if !members.contains(w) {
                    continue;
                }
                if w == start {
                    prev.insert(start, v);
                    break 'bfs;
                }
                if !prev.contains_key(w) {
                    prev.insert(w, v);
                    queue.push_back(w);
                }
            }
        }
        let mut cycle = vec![start];
        let mut v = prev[start];
        while v != start {
            cycle.push(v);
            v = prev[v];
        }
        cycle.reverse();
        cycle.rotate_right(1);
        let mut text = format!("circle: {} → {}\n", cycle.join(" → "), start);
        for (i, from) in cycle.iter().enumerate() {
            let to = cycle[(i + 1) % cycle.len()];
            let (line, path) = &self.edges[*from][to];
            text += &format!("  {from}:{line} `{path}` → {to}\n");
        }
        let rest: Vec<&str> = scc
            .iter()
            .map(String::as_str)
            .filter(|f| !cycle.contains(f))
            .collect();
        if !rest.is_empty() {
            text += &format!("  also in this circle: {}\n", rest.join(", "));
        }
        text
    }
}

/// Adds `file` as a module (child of `parent`), then the modules it declares; `loaded` gets each
/// file with its module.
fn load(
    parsed: &HashMap<&str, Vec<Event>>,
    files: &BTreeMap<String, String>,
    file: &str,
    mod_rs: bool,
    parent: Option<usize>,
    mods: &mut Vec<Module>,
    loaded: &mut Vec<(String, usize)>,
) -> usize {
    let top = mods.len();
    mods.push(Module {
        file: file.to_string(),
        parent,
        children: HashMap::new(),
        reexports: HashMap::new(),
    });
    loaded.push((file.to_string(), top));
    let dir = file.rsplit_once('/').map_or("", |(d, _)| d);
    let own_dir = if mod_rs {
        dir.to_string()
    } else {
        let stem = file.rsplit('/').next().unwrap().trim_end_matches(".rs");
        format!("{dir}/{stem}")
    };
    for e in &parsed[file] {
        let Event::Mod {
            scope,
            name,
            inline,
            path_attr,
        } = e
        else {
            continue;
        };
        let at = inline_module(mods, top, scope);
        if mods[at].children.contains_key(name) {
            continue;
        }
        let child = if *inline {
            mods.push(Module {
                file: file.to_string(),
                parent: Some(at),
                children: HashMap::new(),
                reexports: HashMap::new(),
            });
            mods.len() - 1
        } else {
            let base = scope
                .iter()
                .fold(own_dir.clone(), |d, s| format!("{d}/{s}"));
            let candidates = match path_attr {
                Some(p) if scope.is_empty() => vec![(format!("{dir}/{p}"), true)],
                Some(p) => vec![(format!("{base}/{p}"), true)],
                None => vec![
                    (format!("{base}/{name}.rs"), false),
                    (format!("{base}/{name}/mod.rs"), true),
                ],
            };
            let found = candidates
                .into_iter()
                .map(|(p, m)| (normalize(&p), m))
                .find(|(p, _)| files.contains_key(p) && !loaded.iter().any(|(f, _)| f == p));
            let Some((path, child_mod_rs)) = found else {
                continue;
            };
            load(parsed, files, &path, child_mod_rs, Some(at), mods, loaded)
        };
        mods[at].children.insert(name.clone(), child);
    }
    top
}

/// The inline module at `scope` inside the file module `top`.
fn inline_module(mods: &[Module], top: usize, scope: &[String]) -> usize {
    scope
        .iter()
        .fold(top, |m, s| mods[m].children.get(s).copied().unwrap_or(m))
}

/// The deepest module a path names from module `from`, if it starts inside the crate: `crate`,
/// `super`, `self`, or a child module of `from` (or of the inline modules around it in its file).
/// A name the module re-exports (`pub use b::X;`) leads on to where the re-export points.
fn resolve(mods: &[Module], from: usize, segments: &[String]) -> Option<usize> {
    resolve_within(mods, from, segments, 0)
}

/// [`resolve`], `hops` re-exports deep (a chain of re-exports longer than 16, or a loop, stops
/// where it is).
fn resolve_within(mods: &[Module], from: usize, segments: &[String], hops: usize) -> Option<usize> {
    let mut m = match segments[0].as_str() {
        "crate" => {
            let mut r = from;
            while let Some(p) = mods[r].parent {
                r = p;
            }
            r
        }
        "super" => mods[from].parent?,
        "self" => from,
        name => {
            let mut at = from;
            loop {
                if let Some(c) = mods[at].children.get(name) {
                    break *c;
                }
                match mods[at].parent {
                    Some(p) if mods[p].file == mods[from].file => at = p,
                    _ => return None,
                }
            }
        }
    };
    for (i, s) in segments.iter().enumerate().skip(1) {
        m = match s.as_str() {
            "super" => mods[m].parent?,
            "self" => m,
            name => match mods[m].children.get(name) {
                Some(c) => *c,
                None => {
                    // An item of `m`, or one it re-exports from elsewhere.
                    if let Some(target) = mods[m].reexports.get(name).filter(|_| hops < 16) {
                        let mut rest = target.clone();
                        rest.extend_from_slice(&segments[i + 1..]);
                        if let Some(to) = resolve_within(mods, m, &rest, hops + 1) {
                            return Some(to);
                        }
                    }
                    break;
                }
            },
        };
    }
    Some(m)
}

/// `a/./b/../c` → `a/c`.
pub(super) fn normalize(p: &str) -> String {
    let mut out: Vec<&str> = Vec::new();
    for part in p.split('/') {
        match part {
            "" | "." => {}
            ".." => {
                out.pop();
            }
            _ => out.push(part),
        }
    }
    out.join("/")
}
