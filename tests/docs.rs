//! The documentation's own links: every relative link of the README, ARCHITECTURE.md and the
//! pages under `docs/` names a file of the repository, and every `#anchor` a heading of that
//! file (as GitHub makes a heading's anchor), so moving a page or renaming a section cannot
//! leave a reader at a dead link.

use std::path::{Path, PathBuf};

/// The Markdown files a reader starts from.
fn pages() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut pages = vec![root.join("README.md"), root.join("ARCHITECTURE.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .expect("the docs folder")
        .map(|e| e.expect("a docs entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    docs.sort();
    pages.extend(docs);
    pages
}

/// The targets of a page's inline links `[text](target)` outside code blocks and code spans
/// (a link's text may span lines; its target may not).
fn link_targets(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        // Code spans hold Rust and shell, whose `](` is not a link.
        let prose: String = line.split('`').step_by(2).collect::<Vec<_>>().join(" ");
        let mut rest = prose.as_str();
        while let Some(i) = rest.find("](") {
            let after = &rest[i + 2..];
            let Some(end) = after.find(')') else { break };
            out.push(after[..end].to_string());
            rest = &after[end..];
        }
    }
    out
}

/// GitHub's anchor of a heading: lower case, punctuation but `-` and `_` dropped, spaces made
/// `-`.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, ' ' | '-' | '_'))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// The anchors of a page's headings.
fn anchors(text: &str) -> Vec<String> {
    let mut fenced = false;
    text.lines()
        .filter(|l| {
            if l.trim_start().starts_with("```") {
                fenced = !fenced;
            }
            !fenced && l.starts_with('#')
        })
        .map(|l| anchor(l.trim_start_matches('#')))
        .collect()
}

#[test]
fn every_relative_link_of_the_docs_names_a_file_and_heading_that_exist() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut dead = Vec::new();
    let mut checked = 0;
    for page in pages() {
        let text = std::fs::read_to_string(&page).expect("a page");
        let name = page
            .strip_prefix(root)
            .unwrap_or(&page)
            .display()
            .to_string();
        for target in link_targets(&text) {
            if target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            checked += 1;
            let (path, fragment) = match target.split_once('#') {
                Some((p, f)) => (p, Some(f)),
                None => (target.as_str(), None),
            };
            let file = if path.is_empty() {
                page.clone()
            } else {
                page.parent().expect("a page's folder").join(path)
            };
            let Ok(linked) = std::fs::read_to_string(&file) else {
                dead.push(format!("{name}: {target} (no such file)"));
                continue;
            };
            if let Some(f) = fragment
                && !anchors(&linked).iter().any(|a| a == f)
            {
                dead.push(format!("{name}: {target} (no such heading)"));
            }
        }
    }
    assert!(dead.is_empty(), "dead links:\n{}", dead.join("\n"));
    assert!(
        checked >= 20,
        "only {checked} links found: the scan is broken"
    );
}

#[test]
fn anchors_and_links_are_read_as_github_reads_them() {
    assert_eq!(anchor(" `burn::Dispatch`"), "burndispatch");
    assert_eq!(
        anchor(" Every op is the inner backend's"),
        "every-op-is-the-inner-backends"
    );
    assert_eq!(anchor(" The `plan` command"), "the-plan-command");
    assert_eq!(
        link_targets("see [a\nb](x.md#y) and `[c](not-a-link)`, [d](../e.md)"),
        ["x.md#y", "../e.md"]
    );
    assert_eq!(
        link_targets("```\n[a](in-code.md)\n```\n"),
        Vec::<String>::new()
    );
    assert_eq!(
        anchors("# A\n```\n# not a heading\n```\n## B c\n"),
        ["a", "b-c"]
    );
}
