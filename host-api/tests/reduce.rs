//! `reduce` (contract 0.3): the built-in plugins hand an item back as planned, in files that the
//! model's own processor turns into exactly the plan's tokens. The promise is checked the way a
//! model server would meet it: the reduced files are probed and planned again with the same
//! processor config and an unlimited budget, and must cost what the plan said, unreduced.

use crate::common;

use mmgate_host::{Budget, LoadedPlugin, Media, ReducedItem, TokenPlan};

const UNLIMITED: Budget = Budget {
    max_tokens: u32::MAX,
};

fn fixture(modality: &str, dir: &str, name: &str) -> Media {
    Media {
        data: std::fs::read(common::fixtures_dir(modality).join(dir).join(name)).unwrap(),
        mime_type: None,
    }
}

fn config(modality: &str, name: &str) -> String {
    std::fs::read_to_string(common::fixtures_dir(modality).join("configs").join(name)).unwrap()
}

fn plan_and_reduce(
    plugin: &LoadedPlugin,
    media: &Media,
    config: &str,
    budget: u32,
) -> (TokenPlan, ReducedItem) {
    let info = plugin.probe(media).unwrap();
    let plan = plugin
        .plan(&info, Budget { max_tokens: budget }, config)
        .unwrap();
    let reduced = plugin.reduce(media, &plan, config).unwrap();
    (plan, reduced)
}

/// What the model's processor makes of a reduced file: its plan with no budget.
fn replanned(plugin: &LoadedPlugin, file: &Media, config: &str) -> TokenPlan {
    let info = plugin.probe(file).unwrap();
    plugin.plan(&info, UNLIMITED, config).unwrap()
}

#[test]
fn an_image_at_its_own_size_goes_as_it_came_and_a_cut_one_at_its_planned_size() {
    let plugin = common::builtin_plugin("image");
    let config = config("image", "qwen2-vl.json");
    let photo = fixture("image", "images", "photo-640x480.jpg");

    let (plan, reduced) = plan_and_reduce(&plugin, &photo, &config, u32::MAX);
    assert!(!plan.reduced);
    assert_eq!(reduced.files.len(), 1);
    assert_eq!(reduced.files[0].data, photo.data, "the original bytes");

    for budget in [plan.tokens / 2, plan.tokens / 5, 4] {
        let (cut, reduced) = plan_and_reduce(&plugin, &photo, &config, budget);
        assert!(cut.reduced && cut.tokens <= budget, "{cut:?}");
        let [file] = &reduced.files[..] else {
            panic!("one file")
        };
        assert_eq!(file.mime_type.as_deref(), Some("image/png"));
        assert_eq!(reduced.timestamps, [0.0]);
        let choices: serde_json::Value = serde_json::from_str(&cut.choices).unwrap();
        let info = plugin.probe(file).unwrap();
        assert_eq!(
            (info.width.unwrap(), info.height.unwrap()),
            (
                choices["width"].as_u64().unwrap() as u32,
                choices["height"].as_u64().unwrap() as u32
            )
        );
        // The server's processor keeps that size: the plan's tokens, no further cut.
        let again = replanned(&plugin, file, &config);
        assert_eq!((again.tokens, again.reduced), (cut.tokens, false));
    }
}

#[test]
fn an_audio_clip_is_cut_to_its_chunks_and_resampled_to_16_khz() {
    let plugin = common::builtin_plugin("audio");
    let config = config("audio", "qwen2-audio.json");
    for (clip, budget) in [
        ("speech-44k1-stereo-s16.wav", u32::MAX),
        ("speech-48k.flac", u32::MAX),
        ("long-61s-16k.flac", 750),
    ] {
        let media = fixture("audio", "clips", clip);
        let (plan, reduced) = plan_and_reduce(&plugin, &media, &config, budget);
        let [file] = &reduced.files[..] else {
            panic!("{clip}: one file")
        };
        assert_eq!(file.mime_type.as_deref(), Some("audio/wav"));
        let info = plugin.probe(file).unwrap();
        assert_eq!((info.sample_rate, info.channels), (Some(16_000), Some(1)));
        let again = replanned(&plugin, file, &config);
        assert_eq!(again.tokens, plan.tokens, "{clip}");
        assert!(!again.reduced, "{clip}: nothing left to cut");
    }
}

#[test]
fn a_video_becomes_its_chosen_frames_at_the_planned_size() {
    let plugin = common::builtin_plugin("video");
    let image = common::builtin_plugin("image");
    let config = config("image", "qwen2-vl.json");
    let media = fixture("video", "clips", "h264.mp4");
    let (plan, reduced) = plan_and_reduce(&plugin, &media, &config, 300);
    let choices: serde_json::Value = serde_json::from_str(&plan.choices).unwrap();
    let indices = choices["frame_indices"].as_array().unwrap();
    assert_eq!(reduced.files.len(), indices.len());
    assert_eq!(reduced.timestamps.len(), indices.len());
    assert!(reduced.timestamps.windows(2).all(|t| t[0] <= t[1]));
    let (width, height) = (
        choices["width"].as_u64().unwrap() as u32,
        choices["height"].as_u64().unwrap() as u32,
    );
    for file in &reduced.files {
        let info = image.probe(file).unwrap();
        assert_eq!((info.width, info.height), (Some(width), Some(height)));
    }
    // Qwen2-VL: frames in pairs, a token per 28x28 of each pair.
    let per_pair = (width / 28) * (height / 28);
    assert_eq!(plan.tokens, per_pair * indices.len() as u32 / 2);
}
