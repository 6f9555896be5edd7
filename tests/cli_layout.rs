//! The CLI's shape (issue 39, item 5): at most 3.5k lines, no command imports another
//! command, and no two files of `src/cli` import each other, directly or round a longer
//! circle. Reads the sources: an edge is a `super::NAME`, `crate::cli::NAME` or
//! `$crate::cli::NAME` path (a `use` group counts each of its names), a child's `NAME::` path
//! in its parent, and `out!`/`outln!` (they expand to `cli::output`). A NAME that is no file
//! of `src/cli` is an item of `mod.rs`.

use std::collections::{BTreeMap, BTreeSet};

/// The files that dispatch: the grammar, the entry point and the same commands under mpirun.
/// They may import commands; nothing may import them but each other.
const DISPATCHERS: [&str; 3] = ["mod", "commands", "mpi"];

/// Helpers every command may import: the shared option structs, standard output, the
/// trace's file, and text generation (`run --prompt` and `chat`). They import only each
/// other.
const SHARED: [&str; 4] = ["options", "output", "trace", "text"];

/// The commands. A command's own parts are its name and an underscore (`bench_serve` is
/// `bench`'s); a command imports only shared helpers and its own parts.
const COMMANDS: [&str; 11] = [
    "allreduce",
    "bench",
    "calibrate",
    "chat",
    "compare",
    "devices",
    "embed",
    "plan",
    "project",
    "run",
    "server",
];

type Graph = BTreeMap<String, BTreeSet<String>>;

/// The source without `//` comments (doc comments name other modules in prose).
fn code_of(text: &str) -> String {
    (text.lines())
        .map(|l| l.split_once("//").map_or(l, |(code, _)| code))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The identifier at the start of `s`.
fn ident(s: &str) -> &str {
    let end = s
        .find(|c: char| !(c.is_alphanumeric() || c == '_'))
        .unwrap_or(s.len());
    &s[..end]
}

/// The first names of a path after `prefix`: one, or each of a `{...}` group's.
fn names_after(code: &str, prefix: &str) -> Vec<String> {
    let mut names = Vec::new();
    for (i, _) in code.match_indices(prefix) {
        let before = code[..i].chars().last();
        if prefix.starts_with("super") && before.is_some_and(|c| c == ':' || c.is_alphanumeric()) {
            continue;
        }
        let rest = &code[i + prefix.len()..];
        match rest.strip_prefix('{') {
            Some(group) => {
                let inner = &group[..group.find('}').unwrap_or(group.len())];
                for part in inner.split(',') {
                    let name = ident(part.trim());
                    if !name.is_empty() {
                        names.push(name.to_string());
                    }
                }
            }
            None => names.push(ident(rest).to_string()),
        }
    }
    names
}

/// The modules file `module` (its code `code`) imports, among `modules`. A file of a folder
/// (`server/encoder.rs`) is `server::encoder`, a part of `server`.
fn imports(module: &str, code: &str, modules: &BTreeSet<String>) -> BTreeSet<String> {
    let top = |n: String| match modules.contains(&n) {
        true => n,
        false => "mod".to_string(),
    };
    let mut found: BTreeSet<String> = names_after(code, "crate::cli::")
        .into_iter()
        .map(top)
        .collect();
    let supers = names_after(code, "super::")
        .into_iter()
        .filter(|n| n != "super");
    match module.split_once("::") {
        Some((parent, _)) => {
            found.extend(names_after(code, "super::super::").into_iter().map(top));
            for n in supers {
                let sibling = format!("{parent}::{n}");
                found.insert(match modules.contains(&sibling) {
                    true => sibling,
                    false => parent.to_string(),
                });
            }
        }
        None => found.extend(supers.map(top)),
    }
    // A file names its own children directly (the root: every top-level file).
    for m in modules {
        let child = match module {
            "mod" => (!m.contains("::")).then_some(m.as_str()),
            _ => m.strip_prefix(&format!("{module}::")),
        };
        let Some(child) = child else { continue };
        let path = format!("{child}::");
        let direct = code.match_indices(&path).any(|(i, _)| {
            !code[..i]
                .chars()
                .last()
                .is_some_and(|c| c == ':' || c.is_alphanumeric() || c == '_')
        });
        if direct {
            found.insert(m.clone());
        }
    }
    if module != "mod" && (code.contains("out!(") || code.contains("outln!(")) {
        found.insert("output".into());
    }
    found.remove(module);
    found
}

/// What a file is: a dispatcher, a shared helper, or the command it belongs to.
fn kind(module: &str) -> Option<(&'static str, String)> {
    if DISPATCHERS.contains(&module) {
        return Some(("dispatcher", module.into()));
    }
    if SHARED.contains(&module) {
        return Some(("shared", module.into()));
    }
    let owner = COMMANDS.iter().find(|c| {
        module == **c
            || module.starts_with(&format!("{c}_"))
            || module.starts_with(&format!("{c}::"))
    })?;
    Some(("command", owner.to_string()))
}

/// Every broken rule: unclassified files, forbidden imports, circles.
fn violations(graph: &Graph) -> Vec<String> {
    let mut bad = Vec::new();
    for (from, tos) in graph {
        let Some((from_kind, from_owner)) = kind(from) else {
            bad.push(format!(
                "{from}.rs is neither a dispatcher, shared nor a command"
            ));
            continue;
        };
        for to in tos {
            let Some((to_kind, to_owner)) = kind(to) else {
                continue;
            };
            let allowed = match (from_kind, to_kind) {
                ("dispatcher", _) => true,
                (_, "shared") => true,
                ("command", "command") => from_owner == to_owner,
                _ => false,
            };
            if !allowed {
                bad.push(format!("{from} ({from_kind}) imports {to} ({to_kind})"));
            }
        }
    }
    bad.extend(circles(graph));
    bad
}

/// Each circle, once per file that starts one (depth-first search for a back edge).
fn circles(graph: &Graph) -> Vec<String> {
    fn visit(
        node: &str,
        graph: &Graph,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
        found: &mut Vec<String>,
    ) {
        if let Some(at) = path.iter().position(|p| p == node) {
            found.push(format!("circle: {} -> {node}", path[at..].join(" -> ")));
            return;
        }
        if done.contains(node) {
            return;
        }
        path.push(node.to_string());
        for next in graph.get(node).into_iter().flatten() {
            visit(next, graph, path, done, found);
        }
        path.pop();
        done.insert(node.to_string());
    }
    let (mut done, mut found) = (BTreeSet::new(), Vec::new());
    for node in graph.keys() {
        visit(node, graph, &mut Vec::new(), &mut done, &mut found);
    }
    found
}

/// The code of every `.rs` file under `dir`, by module name (`prefix` + stem), one folder
/// deep.
fn read_sources(dir: &std::path::Path, prefix: &str, sources: &mut BTreeMap<String, String>) {
    for entry in std::fs::read_dir(dir).expect("src/cli") {
        let path = entry.expect("entry").path();
        let stem = path.file_stem().unwrap().to_string_lossy().to_string();
        if path.is_dir() {
            assert!(prefix.is_empty(), "{}: folders nest once", path.display());
            read_sources(&path, &format!("{stem}::"), sources);
        } else if path.extension().is_some_and(|e| e == "rs") {
            let text = std::fs::read_to_string(&path).expect("read");
            sources.insert(format!("{prefix}{stem}"), code_of(&text));
        }
    }
}

/// The code of every file of `src/cli`, by module name.
fn cli_sources() -> BTreeMap<String, String> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/cli");
    let mut sources = BTreeMap::new();
    read_sources(&dir, "", &mut sources);
    sources
}

/// The import graph of `src/cli`.
fn cli_graph() -> Graph {
    let sources = cli_sources();
    let modules: BTreeSet<String> = sources.keys().cloned().collect();
    (sources.iter())
        .map(|(m, code)| (m.clone(), imports(m, code, &modules)))
        .collect()
}

#[test]
fn no_command_imports_another_and_there_is_no_circle() {
    let graph = cli_graph();
    // It read the CLI: every command and shared helper is there, and commands import the
    // shared options.
    for m in COMMANDS.iter().chain(&SHARED).chain(&DISPATCHERS) {
        assert!(graph.contains_key(*m), "src/cli/{m}.rs not found");
    }
    assert!(graph["run"].contains("options") && graph["mod"].contains("run"));
    let bad = violations(&graph);
    assert!(
        bad.is_empty(),
        "src/cli breaks its layout:\n{}",
        bad.join("\n")
    );
}

#[test]
fn the_cli_stays_thin() {
    // Issue 39 item 5: 3.5k lines at most, comments included (`code_of` keeps every line).
    let lines: usize = cli_sources().values().map(|c| c.lines().count()).sum();
    assert!(lines > 1000, "read {lines} lines: not the CLI");
    assert!(
        lines <= 3500,
        "src/cli has {lines} lines, over 3.5k: move orchestration out"
    );
}

#[test]
fn the_check_finds_what_it_forbids() {
    let modules: BTreeSet<String> = [
        "mod",
        "run",
        "text",
        "chat",
        "options",
        "output",
        "odd",
        "run::part",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let code = |c: &str| code_of(c);
    let mut graph = Graph::new();
    // chat borrows run's function, text goes back to run: forbidden and a circle.
    let sources = [
        (
            "run",
            "use super::options::RunArgs;\nfn f() { super::text::go() }",
        ),
        (
            "text",
            "use super::{options, run::Thing}; // super::chat in a comment",
        ),
        (
            "chat",
            "use crate::cli::run::helper;\nfn g() { outln!(\"x\") }",
        ),
        ("options", "use wgpar::run::X;"),
        ("odd", ""),
        ("mod", "fn main() { run::run(); wgpar::chat::x(); }"),
        (
            "run::part",
            "use super::RunArgs;\nuse super::super::chat::x;",
        ),
    ];
    for (m, c) in sources {
        graph.insert(m.to_string(), imports(m, &code(c), &modules));
    }
    assert_eq!(graph["text"], ["options", "run"].map(String::from).into());
    assert_eq!(graph["options"], BTreeSet::new(), "an outside crate's path");
    assert_eq!(graph["mod"], ["run"].map(String::from).into());
    assert!(graph["chat"].contains("output"));
    assert_eq!(graph["run::part"], ["chat", "run"].map(String::from).into());
    let bad = violations(&graph);
    let has = |s: &str| bad.iter().any(|b| b.contains(s));
    assert!(has("chat (command) imports run (command)"), "{bad:?}");
    assert!(has("text (shared) imports run (command)"), "{bad:?}");
    assert!(has("circle: run -> text -> run"), "{bad:?}");
    assert!(has("odd.rs is neither"), "{bad:?}");
    assert!(has("run::part (command) imports chat (command)"), "{bad:?}");
    assert_eq!(bad.len(), 5, "{bad:?}");
}
