//! The plugin guide (docs/plugins.md) stays true: its contract reference is generated from the WIT
//! (`MMGATE_BLESS=1 cargo test --test end_to_end guide::` rewrites it), and every command in it
//! runs, in order, in a scratch directory with the real binary, a real build of a new plugin and a
//! running gateway.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use wit_parser::{Docs, Resolve, Type, TypeDefKind};

const BEGIN: &str =
    "<!-- contract reference: generated from wit/modality.wit by tests/guide.rs -->";
const END: &str = "<!-- end of contract reference -->";

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn guide_path() -> PathBuf {
    repo().join("docs/plugins.md")
}

/// Documentation as Markdown paragraphs.
fn doc(docs: &Docs) -> String {
    docs.contents
        .as_deref()
        .unwrap_or("")
        .trim()
        .split("\n\n")
        .map(|paragraph| paragraph.split_whitespace().collect::<Vec<_>>().join(" "))
        .collect::<Vec<_>>()
        .join("\n\n")
}

/// Documentation on one line after a list item's name (nothing when there is none).
fn doc_line(docs: &Docs) -> String {
    let text = doc(docs).replace("\n\n", " ");
    if text.is_empty() {
        text
    } else {
        format!(": {text}")
    }
}

/// A type as WIT spells it.
fn wit_type(resolve: &Resolve, ty: &Type) -> String {
    match ty {
        Type::Bool => "bool".into(),
        Type::U8 => "u8".into(),
        Type::U16 => "u16".into(),
        Type::U32 => "u32".into(),
        Type::U64 => "u64".into(),
        Type::S8 => "s8".into(),
        Type::S16 => "s16".into(),
        Type::S32 => "s32".into(),
        Type::S64 => "s64".into(),
        Type::F32 => "f32".into(),
        Type::F64 => "f64".into(),
        Type::Char => "char".into(),
        Type::String => "string".into(),
        Type::ErrorContext => "error-context".into(),
        Type::Id(id) => {
            let def = &resolve.types[*id];
            if let Some(name) = &def.name {
                return name.clone();
            }
            let inner = |t: &Type| wit_type(resolve, t);
            let maybe = |t: &Option<Type>| t.as_ref().map_or("_".to_owned(), inner);
            match &def.kind {
                TypeDefKind::List(t) => format!("list<{}>", inner(t)),
                TypeDefKind::Option(t) => format!("option<{}>", inner(t)),
                TypeDefKind::Result(r) => format!("result<{}, {}>", maybe(&r.ok), maybe(&r.err)),
                TypeDefKind::Tuple(t) => format!(
                    "tuple<{}>",
                    t.types.iter().map(inner).collect::<Vec<_>>().join(", ")
                ),
                TypeDefKind::Type(t) => inner(t),
                TypeDefKind::Handle(wit_parser::Handle::Own(t)) => inner(&Type::Id(*t)),
                TypeDefKind::Handle(wit_parser::Handle::Borrow(t)) => {
                    format!("borrow<{}>", inner(&Type::Id(*t)))
                }
                other => other.as_str().to_owned(),
            }
        }
    }
}

/// The Markdown reference of the contract: every interface, type, field, case and function with the
/// documentation the WIT gives it.
fn contract_reference() -> String {
    let text = std::fs::read_to_string(repo().join("wit/modality.wit")).unwrap();
    let mut resolve = Resolve::new();
    let package = resolve.push_source("modality.wit", &text).unwrap();
    let package = &resolve.packages[package];
    let mut out = String::new();
    writeln!(out, "Package `{}`.", package.name).unwrap();
    for (name, id) in &package.interfaces {
        let interface = &resolve.interfaces[*id];
        writeln!(out, "\n### interface `{name}`\n\n{}", doc(&interface.docs)).unwrap();
        for (type_name, type_id) in &interface.types {
            let def = &resolve.types[*type_id];
            // `use`d types are documented where they are defined.
            if matches!(def.kind, TypeDefKind::Type(_)) && def.docs.contents.is_none() {
                continue;
            }
            writeln!(
                out,
                "\n#### {} `{type_name}`\n\n{}\n",
                def.kind.as_str(),
                doc(&def.docs)
            )
            .unwrap();
            match &def.kind {
                TypeDefKind::Record(record) => {
                    for field in &record.fields {
                        let ty = wit_type(&resolve, &field.ty);
                        writeln!(out, "- `{}: {ty}`{}", field.name, doc_line(&field.docs)).unwrap();
                    }
                }
                TypeDefKind::Variant(variant) => {
                    for case in &variant.cases {
                        let payload = case
                            .ty
                            .as_ref()
                            .map(|t| format!("({})", wit_type(&resolve, t)))
                            .unwrap_or_default();
                        writeln!(out, "- `{}{payload}`{}", case.name, doc_line(&case.docs))
                            .unwrap();
                    }
                }
                TypeDefKind::Enum(e) => {
                    for case in &e.cases {
                        writeln!(out, "- `{}`{}", case.name, doc_line(&case.docs)).unwrap();
                    }
                }
                TypeDefKind::Type(t) => {
                    writeln!(out, "- `= {}`", wit_type(&resolve, t)).unwrap();
                }
                _ => {}
            }
        }
        for function in interface.functions.values() {
            let params: Vec<String> = function
                .params
                .iter()
                .map(|p| format!("{}: {}", p.name, wit_type(&resolve, &p.ty)))
                .collect();
            let result = function
                .result
                .as_ref()
                .map(|t| format!(" -> {}", wit_type(&resolve, t)))
                .unwrap_or_default();
            writeln!(
                out,
                "\n#### func `{}({}){result}`\n\n{}",
                function.name,
                params.join(", "),
                doc(&function.docs)
            )
            .unwrap();
        }
    }
    out
}

#[test]
fn the_contract_reference_is_generated_from_the_wit() {
    let guide = std::fs::read_to_string(guide_path()).unwrap();
    let start = guide
        .find(BEGIN)
        .expect("the guide has the contract markers")
        + BEGIN.len();
    let end = guide.find(END).expect("the guide has the end marker");
    let expected = format!("\n{}\n", contract_reference().trim_end());
    if guide[start..end] == expected {
        return;
    }
    if std::env::var_os("MMGATE_BLESS").is_some() {
        let updated = format!("{}{expected}{}", &guide[..start], &guide[end..]);
        std::fs::write(guide_path(), updated).unwrap();
        return;
    }
    panic!(
        "docs/plugins.md's contract reference is out of date with wit/modality.wit: run \
         `MMGATE_BLESS=1 cargo test -p mmgate-gateway --test end_to_end guide::` and review the diff"
    );
}

/// The guide's ```sh blocks, in order.
fn guide_commands() -> String {
    let guide = std::fs::read_to_string(guide_path()).unwrap();
    let mut script = String::new();
    let mut in_block = false;
    for line in guide.lines() {
        match (in_block, line.trim_end()) {
            (false, "```sh") => in_block = true,
            (true, "```") => in_block = false,
            (true, command) => {
                script.push_str(command);
                script.push('\n');
            }
            _ => {}
        }
    }
    script
}

#[test]
fn every_command_of_the_guide_runs() {
    let commands = guide_commands();
    assert!(commands.contains("mmgate plugin new"), "{commands}");
    assert!(commands.contains("cargo test"), "{commands}");
    let scratch = tempfile::tempdir().unwrap();
    // The guide serves on 127.0.0.1:8080; a test takes a free port instead.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let commands = commands.replace("127.0.0.1:8080", &format!("127.0.0.1:{port}"));
    let script = format!(
        "set -euxo pipefail\nPS4='+ $(date +%T) '\n\
         # Whatever happens, the gateway the guide starts does not outlive the test.\n\
         trap 'kill $(jobs -p) 2>/dev/null || true' EXIT\n{commands}"
    );
    let binary_dir = Path::new(env!("CARGO_BIN_EXE_mmgate")).parent().unwrap();
    let path = format!(
        "{}:{}",
        binary_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    // Nested cargo builds share one target directory beside this build's, so reruns are incremental.
    let target = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .parent()
        .unwrap()
        .join("plugin-projects");
    let output = std::process::Command::new("bash")
        .arg("-c")
        .arg(&script)
        .current_dir(scratch.path())
        .env("PATH", path)
        .env("CARGO_TARGET_DIR", target)
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    // The trace (with times) is shown with --nocapture, and whenever a command fails.
    eprintln!("{}", String::from_utf8_lossy(&output.stderr));
    assert!(
        output.status.success(),
        "the guide's commands failed:\n--- stdout\n{}\n--- stderr\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}
