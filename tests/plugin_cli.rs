//! `mmgate plugin list` and `mmgate plugin check`, run as a user runs them: the real binary.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::Output;

use mmgate_host::builtin::artifact_dir;
use sha2::{Digest, Sha256};

use common::mmgate;

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn testing_wasm() -> PathBuf {
    artifact_dir().join("testing.wasm")
}

fn sha256_hex(path: &Path) -> String {
    hex::encode(Sha256::digest(std::fs::read(path).unwrap()))
}

/// A plugin directory holding the test plugin and a manifest with `fields` (TOML lines).
fn plugin_dir(manifest: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(testing_wasm(), dir.path().join("testing.wasm")).unwrap();
    std::fs::write(dir.path().join("testing.toml"), manifest).unwrap();
    dir
}

fn good_manifest() -> String {
    format!(
        "name = \"testing\"\nversion = \"0.1.0\"\nmodalities = [\"test\", \"image\"]\nsha256 = \"{}\"\n\
         component = \"testing.wasm\"\n",
        sha256_hex(&testing_wasm())
    )
}

fn assert_fails_with(out: &Output, needle: &str) {
    assert!(
        !out.status.success(),
        "expected failure, got success: {}",
        stdout(out)
    );
    let err = stderr(out);
    assert!(err.contains(needle), "stderr lacks {needle:?}:\n{err}");
    assert!(
        !err.contains("panicked"),
        "a bad plugin must not panic the CLI:\n{err}"
    );
}

#[test]
fn list_shows_builtin_plugins_with_contract_version() {
    let out = mmgate(&["plugin", "list"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(text.contains("host contract version 0.5.1"), "{text}");
    let image = text.lines().find(|l| l.starts_with("image ")).expect(&text);
    assert!(
        image.contains("0.1.0") && image.contains("built-in"),
        "{image}"
    );

    let out = mmgate(&["plugin", "list", "--json"]);
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let image = json["plugins"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "image")
        .unwrap();
    assert_eq!(image["contract_version"], "0.5.1");
    assert_eq!(image["modalities"][0], "image");
}

#[test]
fn list_includes_a_plugin_directory() {
    let dir = plugin_dir(&good_manifest());
    let out = mmgate(&[
        "plugin",
        "list",
        "--plugin-dir",
        dir.path().to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(
        text.lines()
            .any(|l| l.starts_with("testing ") && l.contains("test")),
        "{text}"
    );
    assert!(text.lines().any(|l| l.starts_with("image ")), "{text}");
}

#[test]
fn check_accepts_a_good_plugin() {
    let out = mmgate(&["plugin", "check", testing_wasm().to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(text.starts_with("ok: testing 0.1.0"), "{text}");
    assert!(text.contains("contract:        0.5.1"), "{text}");

    let dir = plugin_dir(&good_manifest());
    let out = mmgate(&[
        "plugin",
        "check",
        "--json",
        dir.path().join("testing.wasm").to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json["name"], "testing");
    assert_eq!(json["sha256"], sha256_hex(&testing_wasm()));
}

#[test]
fn check_rejects_files_that_are_not_components() {
    let dir = tempfile::tempdir().unwrap();
    let cases: [(&str, &[u8], &str); 4] = [
        ("empty.wasm", b"", "not a valid WebAssembly component"),
        (
            "text.wasm",
            b"hello, I am not wasm",
            "not a valid WebAssembly component",
        ),
        // A valid core module (no component wrapper), as an old-style plugin would be.
        (
            "core.wasm",
            b"\0asm\x01\0\0\0",
            "not a valid WebAssembly component",
        ),
        // A valid but empty component: it exports nothing, so it is no plugin.
        (
            "empty-component.wasm",
            b"\0asm\x0d\0\x01\0",
            "does not export mmgate:modality/plugin",
        ),
    ];
    for (name, bytes, needle) in cases {
        let path = dir.path().join(name);
        std::fs::write(&path, bytes).unwrap();
        let out = mmgate(&["plugin", "check", path.to_str().unwrap()]);
        assert_fails_with(&out, needle);
    }
    let out = mmgate(&[
        "plugin",
        "check",
        dir.path().join("missing.wasm").to_str().unwrap(),
    ]);
    assert_fails_with(&out, "cannot read");
}

#[test]
fn check_and_list_reject_a_manifest_that_disagrees() {
    let wasm = testing_wasm();
    let cases = [
        (
            good_manifest().replace(&sha256_hex(&wasm), &"0".repeat(64)),
            "sha256 mismatch",
        ),
        (
            good_manifest().replace("name = \"testing\"", "name = \"other\""),
            "name is \"other\"",
        ),
        (
            good_manifest().replace("version = \"0.1.0\"", "version = \"9.9.9\""),
            "version is \"9.9.9\"",
        ),
        (
            good_manifest().replace("[\"test\", \"image\"]", "[\"image\"]"),
            "modalities",
        ),
        (good_manifest().replace("sha256", "sha"), "manifest"),
    ];
    for (manifest, needle) in cases {
        let dir = plugin_dir(&manifest);
        let out = mmgate(&[
            "plugin",
            "check",
            dir.path().join("testing.wasm").to_str().unwrap(),
        ]);
        assert_fails_with(&out, needle);
        let out = mmgate(&[
            "plugin",
            "list",
            "--plugin-dir",
            dir.path().to_str().unwrap(),
        ]);
        assert_fails_with(&out, needle);
    }
}

/// A plugin built against an earlier patch version of the current series (0.5.0, before
/// `image.decode-jpeg-resized`) loads unchanged: every interface it names is at 0.5.0.
#[test]
fn check_accepts_a_plugin_built_for_an_earlier_patch_version() {
    let bytes = std::fs::read(testing_wasm()).unwrap();
    let (ours, theirs) = (b"mmgate:modality/".as_slice(), "@0.5.1");
    let mut patched = bytes.clone();
    let mut renamed = 0;
    let mut at = 0;
    while let Some(found) = patched[at..].windows(ours.len()).position(|w| w == ours) {
        let start = at + found;
        // `mmgate:modality/<interface>@0.5.1`: the version follows the interface's name.
        let name_end = patched[start..]
            .iter()
            .position(|&b| b == b'@')
            .map(|i| start + i)
            .filter(|&end| end - start < 40);
        if let Some(end) = name_end
            && patched[end..].starts_with(theirs.as_bytes())
        {
            patched[end..end + theirs.len()].copy_from_slice(b"@0.5.0");
            renamed += 1;
        }
        at = start + ours.len();
    }
    assert!(renamed >= 2, "{renamed} interface names rewritten");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("v0.5.0.wasm");
    std::fs::write(&path, patched).unwrap();
    let out = mmgate(&["plugin", "check", path.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(
        text.contains("contract:        0.5.0 (host 0.5.1)"),
        "{text}"
    );
}

#[test]
fn check_rejects_a_plugin_built_for_another_contract_version() {
    // Rewrite the exported interface's version in a real plugin (same length, so the binary stays
    // valid): the host must refuse it by version, before linking.
    let bytes = std::fs::read(testing_wasm()).unwrap();
    let ours = b"mmgate:modality/plugin@0.5.1";
    assert!(bytes.windows(ours.len()).any(|w| w == ours));
    let dir = tempfile::tempdir().unwrap();
    for (version, needle) in [
        (
            "0.6.0",
            "built for contract 0.6.0, but this host implements 0.5.1",
        ),
        ("0.5.9", "built for contract 0.5.9"),
        ("0.4.9", "built for contract 0.4.9"),
        ("0.3.9", "built for contract 0.3.9"),
        ("0.2.9", "built for contract 0.2.9"),
        ("0.1.9", "built for contract 0.1.9"),
        ("1.1.0", "built for contract 1.1.0"),
    ] {
        let theirs = format!("mmgate:modality/plugin@{version}");
        let mut patched = Vec::with_capacity(bytes.len());
        let mut rest = &bytes[..];
        while let Some(at) = rest.windows(ours.len()).position(|w| w == ours) {
            patched.extend_from_slice(&rest[..at]);
            patched.extend_from_slice(theirs.as_bytes());
            rest = &rest[at + ours.len()..];
        }
        patched.extend_from_slice(rest);
        let path = dir.path().join(format!("v{version}.wasm"));
        std::fs::write(&path, patched).unwrap();
        let out = mmgate(&["plugin", "check", path.to_str().unwrap()]);
        assert_fails_with(&out, needle);
    }
}
