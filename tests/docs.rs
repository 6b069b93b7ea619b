//! The docs cannot drift: every code block of README.md and docs/*.md that shows a
//! command and its reply (`> COMMAND` lines, then the reply as redis-cli prints it) is
//! run against a real server with the module, the blocks of one page in order on one
//! server of their own, and each reply compared with the page's.
//!
//! What a page may leave open, because it depends on the clock: an integer of ten or
//! more digits (a Unix time in seconds or milliseconds) stands for any such integer,
//! and in a text reply (INFO) the digits of a `name:value` line stand for any digits
//! and a line `...` for any lines after it.
//!
//! And every link between the pages resolves: its file exists, and its anchor is a
//! heading of that page (as GitHub makes anchors) or an `<a id>` of it.

mod common;

use common::*;

/// README.md and docs/*.md, sorted.
fn pages() -> Vec<std::path::PathBuf> {
    let root = repository_root();
    let mut pages = vec![root.join("README.md")];
    let mut docs: Vec<_> = std::fs::read_dir(root.join("docs"))
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.sort();
    pages.extend(docs);
    pages
}

/// A heading's anchor as GitHub makes it: lowercase, only letters, digits, `_` and `-`
/// kept, spaces made `-`.
fn anchor_of(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, '_' | '-' | ' '))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// The anchors a page defines: its headings' (outside code blocks) and its `<a id>`s.
fn anchors(page: &str) -> Vec<String> {
    let mut found = Vec::new();
    let mut fenced = false;
    for line in page.lines() {
        if line.starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        let hashes = line.len() - line.trim_start_matches('#').len();
        if (1..=6).contains(&hashes) && line[hashes..].starts_with(' ') {
            found.push(anchor_of(&line[hashes..]));
        }
        for (at, _) in line.match_indices("<a id=\"") {
            let rest = &line[at + 7..];
            if let Some(end) = rest.find('"') {
                found.push(rest[..end].to_owned());
            }
        }
    }
    found
}

/// The targets of a page's Markdown links (`](target)`) that are not URLs.
fn local_links(page: &str) -> Vec<&str> {
    page.match_indices("](")
        .filter_map(|(at, _)| {
            let rest = &page[at + 2..];
            let end = rest.find([')', ' ', '\n'])?;
            Some(&rest[..end])
        })
        .filter(|target| !target.contains("://") && !target.starts_with("mailto:"))
        .collect()
}

#[test]
fn every_link_between_the_pages_resolves() {
    let mut broken = Vec::new();
    let mut checked = 0;
    for page in pages() {
        let text = std::fs::read_to_string(&page).unwrap();
        for target in local_links(&text) {
            let (file, anchor) = target.split_once('#').unwrap_or((target, ""));
            let destination = if file.is_empty() {
                page.clone()
            } else {
                page.parent().unwrap().join(file)
            };
            checked += 1;
            if !destination.exists() {
                broken.push(format!("{}: {target}: no such file", page.display()));
            } else if !anchor.is_empty() && destination.extension().is_some_and(|e| e == "md") {
                let defined = anchors(&std::fs::read_to_string(&destination).unwrap());
                if !defined.iter().any(|defined| defined == anchor) {
                    broken.push(format!("{}: {target}: no such anchor", page.display()));
                }
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
    assert!(checked >= 100, "only {checked} links found in the docs");
}

#[test]
fn anchors_are_made_as_github_makes_them() {
    assert_eq!(anchor_of(" Rust: qag-client"), "rust-qag-client");
    assert_eq!(
        anchor_of("A model API's window chain"),
        "a-model-apis-window-chain"
    );
    assert_eq!(
        anchor_of("QAG.THROTTLE key max_burst count period [quantity] [WAIT ms]"),
        "qagthrottle-key-max_burst-count-period-quantity-wait-ms"
    );
    let page = "# Title\n```\n# not a heading\n```\n<a id=\"kept\"></a>\n## Two words\n";
    assert_eq!(anchors(page), ["title", "kept", "two-words"]);
    assert_eq!(
        local_links("[a](b.md#c) [d](https://e) [f](#g)"),
        ["b.md#c", "#g"]
    );
}

/// One `> COMMAND` and the reply lines shown under it.
struct Call {
    line: usize,
    words: Vec<String>,
    reply: Vec<String>,
}

/// The calls of every block that starts with `> `, in the page's order.
fn calls(page: &str) -> Vec<Call> {
    let mut calls: Vec<Call> = Vec::new();
    let (mut in_block, mut shows_replies) = (false, false);
    for (n, line) in page.lines().enumerate() {
        if line.starts_with("```") {
            in_block = !in_block;
            shows_replies = false;
            continue;
        }
        if !in_block {
            continue;
        }
        if let Some(command) = line.strip_prefix("> ") {
            shows_replies = true;
            calls.push(Call {
                line: n + 1,
                words: command.split_whitespace().map(String::from).collect(),
                reply: Vec::new(),
            });
        } else if shows_replies {
            if let Some(call) = calls.last_mut() {
                call.reply.push(line.to_owned());
            }
        }
    }
    calls
}

/// A reply as redis-cli prints it (its default, human form), one line a string.
fn render(value: &Value, out: &mut Vec<String>) {
    let pad = |out: &mut Vec<String>, text: String| out.push(text);
    match value {
        Value::Int(n) => pad(out, format!("(integer) {n}")),
        Value::Nil => pad(out, "(nil)".into()),
        Value::Okay => pad(out, "OK".into()),
        Value::SimpleString(text) => pad(out, text.clone()),
        Value::BulkString(bytes) => {
            let text = String::from_utf8_lossy(bytes);
            if text.contains('\n') {
                out.extend(
                    text.lines()
                        .map(|line| line.trim_end_matches('\r').to_owned()),
                );
            } else {
                pad(out, format!("\"{text}\""));
            }
        }
        Value::Array(items) if items.is_empty() => pad(out, "(empty array)".into()),
        Value::Array(items) => {
            for (i, item) in items.iter().enumerate() {
                let label = format!("{}) ", i + 1);
                let mut inner = Vec::new();
                render(item, &mut inner);
                for (j, line) in inner.into_iter().enumerate() {
                    let prefix = if j == 0 {
                        label.clone()
                    } else {
                        " ".repeat(label.len())
                    };
                    out.push(format!("{prefix}{line}"));
                }
            }
        }
        other => pad(out, format!("{other:?}")),
    }
}

/// Whether a shown line stands for an actual one (see the module's comment).
fn line_matches(shown: &str, actual: &str) -> bool {
    if shown == actual {
        return true;
    }
    let (shown_head, shown_number) = split_number(shown);
    let (actual_head, actual_number) = split_number(actual);
    match (shown_number, actual_number) {
        (Some(a), Some(b)) if shown_head == actual_head => {
            (a.len() >= 10 && b.len() >= 10) || shown_head.ends_with(':')
        }
        _ => false,
    }
}

/// A line's text before a trailing integer, and the integer's digits.
fn split_number(line: &str) -> (&str, Option<&str>) {
    let digits = line.len() - line.trim_end_matches(|c: char| c.is_ascii_digit()).len();
    if digits == 0 {
        return (line, None);
    }
    let (head, number) = line.split_at(line.len() - digits);
    (head.trim_end_matches('-'), Some(number))
}

fn replies_match(shown: &[String], actual: &[String]) -> bool {
    if let Some(stop) = shown.iter().position(|line| line == "...") {
        return actual.len() >= stop
            && shown[..stop]
                .iter()
                .zip(actual)
                .all(|(s, a)| line_matches(s, a));
    }
    shown.len() == actual.len() && shown.iter().zip(actual).all(|(s, a)| line_matches(s, a))
}

#[test]
fn every_reply_the_docs_show_is_the_servers() {
    if external("every_reply_the_docs_show_is_the_servers") {
        return;
    }
    let mut checked = 0;
    for page in pages() {
        let text = std::fs::read_to_string(&page).unwrap();
        let calls = calls(&text);
        if calls.is_empty() {
            continue;
        }
        let server = Server::start(&ServerOptions::default());
        let mut con = server.client().get_connection().unwrap();
        for call in calls {
            let mut command = cmd(&call.words[0]);
            command.arg(&call.words[1..]);
            let mut actual = Vec::new();
            match command.query::<Value>(&mut con) {
                Ok(value) => render(&value, &mut actual),
                Err(error) => actual.push(format!("(error) {error}")),
            }
            assert!(
                replies_match(&call.reply, &actual),
                "{}:{}: `{}` shows\n{}\nbut the server answers\n{}",
                page.display(),
                call.line,
                call.words.join(" "),
                call.reply.join("\n"),
                actual.join("\n")
            );
            checked += 1;
        }
    }
    assert!(checked >= 20, "only {checked} replies found in the docs");
    eprintln!("{checked} replies checked against the server");
}

#[test]
fn the_matching_rules_hold_only_what_they_say() {
    let shown = |lines: &[&str]| lines.iter().map(|l| l.to_string()).collect::<Vec<_>>();
    assert!(replies_match(
        &shown(&["1) (integer) 1", "2) (integer) 1796079600"]),
        &shown(&["1) (integer) 1", "2) (integer) 1798758000"])
    ));
    // A small integer is exact; a time does not stand for a small one.
    assert!(!replies_match(
        &shown(&["(integer) 59"]),
        &shown(&["(integer) 58"])
    ));
    assert!(!replies_match(
        &shown(&["(integer) 1796079600"]),
        &shown(&["(integer) 5"])
    ));
    assert!(replies_match(
        &shown(&["# qag", "qag_take_calls:1520", "..."]),
        &shown(&["# qag", "qag_take_calls:0", "qag_take_errors:0"])
    ));
    assert!(!replies_match(
        &shown(&["qag_take_calls:1520"]),
        &shown(&["qag_peek_calls:1520"])
    ));
    assert!(!replies_match(
        &shown(&["1) (integer) 1"]),
        &shown(&["1) (integer) 1", "2) (integer) 0"])
    ));
}
