//! Every fuzz target (gateway/fuzz, run by `./dev fuzz`) replayed on stable over its seeds and its
//! regression inputs (each a crash a campaign found, fixed), and over the corpus campaigns grew on
//! this machine (`~/.cache/mmgate/fuzz-corpus`) when there is one: a panic here is a bug a fuzzer
//! found before. Seconds, on every test run.

use std::path::Path;

#[test]
fn fuzz_corpora_and_regressions_replay_cleanly() {
    let fuzz = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz");
    let grown =
        std::env::var_os("HOME").map(|home| Path::new(&home).join(".cache/mmgate/fuzz-corpus"));
    let mut replayed = 0;
    for (target, run) in mmgate::fuzzing::TARGETS {
        let dirs = [
            Some(fuzz.join("corpus")),
            Some(fuzz.join("regressions")),
            grown.clone(),
        ];
        for dir in dirs.into_iter().flatten() {
            let Ok(entries) = std::fs::read_dir(dir.join(target)) else {
                continue;
            };
            for entry in entries {
                let path = entry.unwrap_or_else(|e| panic!("{e}")).path();
                let data =
                    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
                let outcome = std::panic::catch_unwind(|| run(&data));
                assert!(outcome.is_ok(), "{target}: {} fails", path.display());
                replayed += 1;
            }
        }
    }
    assert!(
        replayed >= 30,
        "only {replayed} inputs found under {}",
        fuzz.display()
    );
    eprintln!("replayed {replayed} inputs");
}
