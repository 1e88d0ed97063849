//! Every fuzz target (gateway/fuzz, run by `./dev fuzz`) replayed on stable over its corpus (the
//! seeds and what campaigns kept) and its regression inputs (each a crash a campaign found, fixed):
//! a panic here is a bug a fuzzer found before. Seconds, on every test run.

use std::path::Path;

#[test]
fn fuzz_corpora_and_regressions_replay_cleanly() {
    let fuzz = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz");
    let mut replayed = 0;
    for (target, run) in mmgate::fuzzing::TARGETS {
        for dir in ["corpus", "regressions"] {
            let Ok(entries) = std::fs::read_dir(fuzz.join(dir).join(target)) else {
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
}
