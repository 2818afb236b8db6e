//! `cargo xtask limits`: the size limits of issue 22 on production code.
//! No function over 120 lines, no file over 1,200 lines in `profiler/src`
//! and `profiler-parse/src`, test code excluded: `#[cfg(test)]` items and
//! files of modules declared under `#[cfg(test)]` (`tests.rs`,
//! `test_support.rs`, ...).
//!
//! It reads Rust text, not a syntax tree: comments, strings and character
//! literals are blanked first, then items are found by their keyword and
//! measured by matching braces. Good enough for code rustfmt formats.

use std::{
    collections::HashSet,
    fs,
    path::{Path, PathBuf},
};

use anyhow::Context as _;

pub const MAX_FUNCTION_LINES: usize = 120;
pub const MAX_FILE_LINES: usize = 1200;

/// Prints every offender under `src`; fails when there is one.
pub fn check(src: &Path) -> anyhow::Result<()> {
    let mut files = Vec::new();
    collect_rs(src, &mut files)?;
    files.sort();
    let mut test_files = HashSet::new();
    let mut texts = Vec::new();
    for path in &files {
        let text = fs::read_to_string(path).with_context(|| format!("read {}", path.display()))?;
        let blanked = blank(&text);
        test_files.extend(test_module_files(path, &blanked));
        texts.push(blanked);
    }
    let mut offenders = 0;
    for (path, text) in files.iter().zip(&texts) {
        if test_files.contains(path) {
            continue;
        }
        let test = test_mask(text);
        let lines = text.lines().count();
        let test_lines = text
            .char_indices()
            .filter(|&(i, c)| c == '\n' && test[i])
            .count();
        let shown = path.strip_prefix(src).unwrap_or(path).display();
        if lines - test_lines > MAX_FILE_LINES {
            println!("{shown}: {} production lines", lines - test_lines);
            offenders += 1;
        }
        for (name, line, len) in functions(text, &test) {
            if len > MAX_FUNCTION_LINES {
                println!("{shown}:{line}: fn {name}: {len} lines");
                offenders += 1;
            }
        }
    }
    anyhow::ensure!(
        offenders == 0,
        "{offenders} over the limits ({MAX_FUNCTION_LINES}-line functions, {MAX_FILE_LINES}-line files)"
    );
    println!(
        "limits: no production function over {MAX_FUNCTION_LINES} lines, no file over {MAX_FILE_LINES}"
    );
    Ok(())
}

fn collect_rs(dir: &Path, out: &mut Vec<PathBuf>) -> anyhow::Result<()> {
    for entry in fs::read_dir(dir).with_context(|| format!("list {}", dir.display()))? {
        let path = entry?.path();
        if path.is_dir() {
            collect_rs(&path, out)?;
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
    Ok(())
}

/// `text` with comments, strings and character literals turned to spaces
/// (newlines kept), so braces and keywords in them count for nothing.
fn blank(text: &str) -> String {
    let chars: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    let blank_until = |out: &mut String, from: usize, to: usize| {
        for &c in &chars[from..to.min(chars.len())] {
            out.push(if c == '\n' { '\n' } else { ' ' });
        }
    };
    while i < chars.len() {
        let rest = &chars[i..];
        let end = if rest.starts_with(&['/', '/']) {
            i + rest.iter().position(|&c| c == '\n').unwrap_or(rest.len())
        } else if rest.starts_with(&['/', '*']) {
            let (mut depth, mut j) = (0usize, i);
            while j < chars.len() {
                if chars[j..].starts_with(&['/', '*']) {
                    depth += 1;
                    j += 2;
                } else if chars[j..].starts_with(&['*', '/']) {
                    depth -= 1;
                    j += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    j += 1;
                }
            }
            j
        } else if let Some(len) = raw_string_len(rest, i == 0 || !is_ident(chars[i - 1])) {
            i + len
        } else if rest[0] == '"' {
            let mut j = i + 1;
            while j < chars.len() && chars[j] != '"' {
                j += if chars[j] == '\\' { 2 } else { 1 };
            }
            j + 1
        } else if let Some(len) = char_literal_len(rest) {
            i + len
        } else {
            out.push(rest[0]);
            i += 1;
            continue;
        };
        blank_until(&mut out, i, end);
        i = end.min(chars.len());
    }
    out
}

fn is_ident(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// Length of a raw string (`r"..."`, `r#"..."#`, `br"..."`) at the start.
fn raw_string_len(rest: &[char], at_token_start: bool) -> Option<usize> {
    if !at_token_start {
        return None;
    }
    let start = match rest {
        ['b', 'r', ..] => 2,
        ['r', ..] => 1,
        _ => return None,
    };
    let hashes = rest[start..].iter().take_while(|&&c| c == '#').count();
    if rest.get(start + hashes) != Some(&'"') {
        return None;
    }
    let body = start + hashes + 1;
    (body..rest.len())
        .find(|&j| {
            rest[j] == '"'
                && rest[j + 1..]
                    .iter()
                    .take(hashes)
                    .filter(|&&c| c == '#')
                    .count()
                    == hashes
        })
        .map(|j| j + 1 + hashes)
}

/// Length of a character literal at the start (`'a'`, `'\n'`, `'\u{1F}'`),
/// `None` for a lifetime.
fn char_literal_len(rest: &[char]) -> Option<usize> {
    if rest.first() != Some(&'\'') {
        return None;
    }
    if rest.get(1) == Some(&'\\') {
        let close = rest.iter().skip(2).position(|&c| c == '\'')?;
        return Some(close + 3);
    }
    (rest.get(2) == Some(&'\'')).then_some(3)
}

/// Index of the brace closing the one at `open`.
fn matching_brace(text: &[u8], open: usize) -> usize {
    let mut depth = 0usize;
    for (i, &b) in text.iter().enumerate().skip(open) {
        match b {
            b'{' => depth += 1,
            b'}' => {
                depth -= 1;
                if depth == 0 {
                    return i;
                }
            }
            _ => {}
        }
    }
    text.len().saturating_sub(1)
}

/// For each byte of `text`, whether it is inside a `#[cfg(test)]` item.
fn test_mask(text: &str) -> Vec<bool> {
    let bytes = text.as_bytes();
    let mut mask = vec![false; bytes.len()];
    for (at, _) in text.match_indices("#[cfg(test)]") {
        let after = at + "#[cfg(test)]".len();
        let brace = text[after..].find('{').map(|i| i + after);
        let semi = text[after..].find(';').map(|i| i + after);
        let end = match (brace, semi) {
            (Some(b), Some(s)) if s < b => s,
            (Some(b), _) => matching_brace(bytes, b),
            (None, Some(s)) => s,
            (None, None) => bytes.len() - 1,
        };
        mask[at..=end.min(bytes.len() - 1)].fill(true);
    }
    mask
}

/// `(name, first line, lines)` of every function with a body outside test
/// code.
fn functions(text: &str, test: &[bool]) -> Vec<(String, usize, usize)> {
    let bytes = text.as_bytes();
    let mut out = Vec::new();
    for (at, _) in text.match_indices("fn ") {
        if test[at] || (at > 0 && is_ident(bytes[at - 1] as char)) {
            continue;
        }
        let name: String = text[at + 3..]
            .chars()
            .take_while(|&c| is_ident(c))
            .collect();
        if name.is_empty() {
            continue;
        }
        let brace = text[at..].find('{').map(|i| i + at);
        let semi = text[at..].find(';').map(|i| i + at);
        let Some(open) = brace.filter(|&b| semi.is_none_or(|s| b < s)) else {
            continue;
        };
        let close = matching_brace(bytes, open);
        let first = text[..at].matches('\n').count() + 1;
        let last = text[..close].matches('\n').count() + 1;
        out.push((name, first, last - first + 1));
    }
    out
}

/// Files of the modules `path` declares under `#[cfg(test)]`.
fn test_module_files(path: &Path, text: &str) -> Vec<PathBuf> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let stem = path.file_stem().and_then(|s| s.to_str()).unwrap_or("");
    let base = if matches!(stem, "mod" | "lib" | "main") {
        dir.to_path_buf()
    } else {
        dir.join(stem)
    };
    let mut out = Vec::new();
    for (at, _) in text.match_indices("#[cfg(test)]") {
        let rest = text[at + "#[cfg(test)]".len()..].trim_start();
        let rest = rest.strip_prefix("pub(crate) ").unwrap_or(rest);
        let Some(rest) = rest.strip_prefix("mod ") else {
            continue;
        };
        let name: String = rest.chars().take_while(|&c| is_ident(c)).collect();
        if rest[name.len()..].trim_start().starts_with(';') {
            out.push(base.join(format!("{name}.rs")));
            out.push(base.join(&name).join("mod.rs"));
        }
    }
    out
}
