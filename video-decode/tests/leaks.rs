//! The decoder's memory stays flat over 1 000 decodes of varied and broken files: every clip of
//! the fixtures, each also cut short and with bytes flipped, opened and decoded at its first,
//! middle and last frame, again and again. A leak of a few kilobytes per decode (an FFmpeg context,
//! a frame, a packet not freed) would show as megabytes here.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;

use mmgate_video_decode::{Limits, Video};

const DECODES: usize = 1000;
/// Decodes before the first measure: allocators and FFmpeg's own tables settle first.
const WARM_UP: usize = 200;
/// Growth allowed from the warm-up to the end: 5 KiB per decode of the rest.
const MAX_GROWTH_BYTES: u64 = 4 << 20;

fn resident_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    let kib: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kib * 1024
}

/// Every clip as it is, cut in half, and with every 97th byte past the first 64 flipped.
fn inputs() -> Vec<(String, Vec<u8>)> {
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/video");
    let mut inputs = Vec::new();
    for dir in ["clips", "bad"] {
        let mut paths: Vec<_> = std::fs::read_dir(fixtures.join(dir))
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        paths.sort();
        for path in paths {
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            let data = std::fs::read(&path).unwrap();
            let mut flipped = data.clone();
            for byte in flipped.iter_mut().skip(64).step_by(97) {
                *byte ^= 0x5a;
            }
            inputs.push((format!("{name} cut"), data[..data.len() / 2].to_vec()));
            inputs.push((format!("{name} flipped"), flipped));
            inputs.push((name, data));
        }
    }
    inputs
}

fn decode(data: &[u8]) -> (bool, usize) {
    let limits = Limits {
        decoder_threads: 1,
        ..Limits::default()
    };
    let Ok(mut video) = Video::open(data, limits) else {
        return (false, 0);
    };
    let count = video.info().frame_count;
    let decoded = [0, count / 2, count.saturating_sub(1)]
        .into_iter()
        .filter(|&index| video.frame(index, None).is_ok())
        .count();
    (true, decoded)
}

#[test]
fn memory_is_flat_over_a_thousand_decodes_of_varied_and_broken_files() {
    let inputs = inputs();
    assert!(inputs.len() >= 20, "{} inputs", inputs.len());
    let (mut opened, mut refused, mut frames) = (0, 0, 0);
    let mut after_warm_up = 0;
    for i in 0..DECODES {
        if i == WARM_UP {
            after_warm_up = resident_bytes();
        }
        let (ok, decoded) = decode(&inputs[i % inputs.len()].1);
        if ok {
            opened += 1;
        } else {
            refused += 1;
        }
        frames += decoded;
    }
    let growth = resident_bytes().saturating_sub(after_warm_up);
    eprintln!(
        "{DECODES} decodes: {opened} opened, {refused} refused, {frames} frames; resident memory \
         grew {growth} bytes after the first {WARM_UP}"
    );
    // Both kinds of input were exercised.
    assert!(opened > 0 && refused > 0 && frames > 0);
    assert!(
        growth < MAX_GROWTH_BYTES,
        "resident memory grew {growth} bytes over {} decodes",
        DECODES - WARM_UP
    );
}
