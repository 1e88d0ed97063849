//! Mutated copies of the fixture clips (bytes overwritten, truncated, headers scrambled, stretches of
//! noise) through the plugin's whole item path, natively: each must give a result or a typed error.
//! A panic here would be a trap in the sandbox (a 500 for the client instead of a clear 4xx).

use mmgate_audio_plugin::AudioPlugin;
use mmgate_plugin_sdk::run_natively;

const ITERATIONS: usize = 400;

#[test]
fn mutated_clips_never_panic() {
    let fixtures = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/audio");
    let config = std::fs::read_to_string(format!("{fixtures}/configs/qwen2-audio.json"))
        .expect("the fixture config");
    let mut clips: Vec<(String, Vec<u8>)> = std::fs::read_dir(format!("{fixtures}/clips"))
        .expect("the fixture clips")
        .map(|entry| {
            let path = entry.expect("a directory entry").path();
            let data = std::fs::read(&path).expect("a clip");
            (path.display().to_string(), data)
        })
        // The short clips: the long one would make each iteration slow without new code paths.
        .filter(|(_, data)| data.len() < 300_000)
        .collect();
    clips.sort();
    assert!(clips.len() >= 15, "the fixture clips are missing");

    // xorshift64: deterministic, so a failure reproduces.
    let mut state = 0x9e37_79b9_7f4a_7c15_u64;
    let mut random = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state as usize
    };
    let (mut decoded, mut refused) = (0, 0);
    for i in 0..ITERATIONS {
        let (name, clip) = &clips[i % clips.len()];
        let mut data = clip.clone();
        let what = match random() % 4 {
            0 => {
                for _ in 0..1 + random() % 20 {
                    let at = random() % data.len();
                    data[at] = random() as u8;
                }
                "bytes overwritten"
            }
            1 => {
                data.truncate((random() % data.len()).max(1));
                "truncated"
            }
            2 => {
                let at = random() % data.len().min(200);
                data[at] = random() as u8;
                "header byte changed"
            }
            _ => {
                let at = random() % data.len();
                let len = (random() % 4096).min(data.len() - at);
                data[at..at + len]
                    .iter_mut()
                    .for_each(|b| *b = random() as u8);
                "noise"
            }
        };
        // A panic fails the test with this context.
        let outcome =
            std::panic::catch_unwind(|| run_natively::<AudioPlugin>(data, &config, u32::MAX));
        match outcome {
            Ok(Ok(_)) => decoded += 1,
            Ok(Err(_)) => refused += 1,
            Err(_) => panic!("iteration {i}: {name} ({what}) panicked"),
        }
    }
    println!("{decoded} mutated clips decoded, {refused} refused with a typed error");
    assert!(
        decoded > 0 && refused > 0,
        "{decoded} decoded, {refused} refused"
    );
}
