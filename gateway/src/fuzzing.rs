//! Entry points for the fuzz targets (`gateway/fuzz`, libFuzzer through cargo-fuzz) and for the
//! replay of their corpora and regression inputs in `cargo test` (`tests/fuzz_corpus.rs`): each
//! takes any bytes, must never panic on its own account, and panics only when a property the
//! gateway relies on is broken.

use std::io::Cursor;
use std::sync::OnceLock;

use pingora::protocols::http::ServerSession;

use crate::wire::http1::{self, Chunked, Request, RequestCheck};

/// A fuzz target: any bytes in; a panic is a finding.
pub type Target = fn(&[u8]);

/// The fuzz targets, by name: what `./dev fuzz` runs and the corpus replay covers.
pub const TARGETS: [(&str, Target); 14] = [
    ("lane_request", lane_request),
    ("request_framing", request_framing),
    ("upstream_response", upstream_response),
    ("torch_file", torch_file),
    ("chat_request", chat_request),
    ("multipart_upload", multipart_upload),
    ("data_url", data_url),
    ("checkpoint", checkpoint),
    ("image_plugin", image_plugin),
    ("audio_plugin", audio_plugin),
    ("video_plugin", video_plugin),
    ("document_plugin", document_plugin),
    ("video_decoder", video_decoder),
    ("image_decoder", image_decoder),
];

/// The largest body the targets let a request claim.
const MAX_BODY: usize = 1 << 20;

fn runtime() -> &'static tokio::runtime::Runtime {
    static RUNTIME: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RUNTIME.get_or_init(|| {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap_or_else(|e| panic!("a tokio runtime for the fuzz targets: {e}"))
    })
}

/// How pingora's HTTP/1 server session frames `data`: `None` when it refuses or cannot finish the
/// request, else the head's length and the body it reads.
fn pingora_framing(data: &[u8]) -> Option<(usize, Vec<u8>)> {
    runtime().block_on(async {
        let mut session = ServerSession::new_http1(Box::new(Cursor::new(data.to_vec())));
        if !matches!(session.read_request().await, Ok(true)) {
            return None;
        }
        let head_len = session
            .as_http1()
            .map(|s| s.get_headers_raw_bytes().len())?;
        let mut body = Vec::new();
        loop {
            match session.read_request_body().await {
                Ok(Some(chunk)) => body.extend_from_slice(&chunk),
                Ok(None) => break,
                Err(_) => return None,
            }
            if body.len() > MAX_BODY {
                return None;
            }
        }
        Some((head_len, body))
    })
}

/// The passthrough lane's parser, differential: a request the lane relays as it is must be framed
/// the same by the strict check the lane applies to everything else (no ambiguity: one length, no
/// chunking) and by pingora's own HTTP/1 session (the head and the body it reads). A request that
/// smuggles a second one past either would frame differently.
pub fn lane_request(data: &[u8]) {
    let Request::Passable(passable) = http1::parse_request(data, MAX_BODY) else {
        return;
    };
    match http1::check_request(data) {
        RequestCheck::Pass(head) => {
            assert_eq!(head.head_len, passable.head_len, "head length");
            assert!(!head.chunked, "the lane relayed a chunked request");
            assert_eq!(head.content_length, Some(passable.body_len), "body length");
        }
        other => panic!("the lane relays a request the framing check answers {other:?}"),
    }
    if data.len() < passable.len() {
        return; // the body is not all here: pingora would wait for it
    }
    let (head_len, body) = pingora_framing(data)
        .unwrap_or_else(|| panic!("the lane relays a request pingora refuses"));
    assert_eq!(head_len, passable.head_len, "pingora's head length");
    assert_eq!(
        body,
        &data[passable.head_len..passable.len()],
        "pingora's body"
    );
}

/// The framing check the lane holds every other request to, with the chunked body follower on what
/// follows a head it passes: never a panic, and a body it follows to its end is one pingora frames
/// to the same end.
pub fn request_framing(data: &[u8]) {
    let RequestCheck::Pass(head) = http1::check_request(data) else {
        return;
    };
    if !head.chunked {
        return;
    }
    let mut body = Chunked::default();
    let mut at = head.head_len;
    while at < data.len() {
        match body.advance(&data[at..]) {
            Ok(progress) => {
                assert!(progress.body <= data.len() - at, "advanced past the buffer");
                at += progress.body;
                if progress.done {
                    break;
                }
                if progress.body == 0 {
                    return; // needs more bytes
                }
            }
            Err(_) => return,
        }
    }
}

/// An upstream's response head and body framing, as the relay follows them: never a panic, and
/// the body framing never claims more bytes than it was given.
pub fn upstream_response(data: &[u8]) {
    let Ok(Some(mut head)) = http1::parse_response(data) else {
        return;
    };
    assert!(head.head_len <= data.len());
    let mut at = head.head_len;
    while at < data.len() {
        match head.framing.advance(&data[at..]) {
            Ok(progress) => {
                assert!(progress.body <= data.len() - at, "advanced past the buffer");
                at += progress.body;
                if progress.done || progress.body == 0 {
                    break;
                }
            }
            Err(_) => break,
        }
    }
}

/// The `torch.save` reader behind `image_embeds` parts (a pickle: only the layout of a tensor is
/// ever read, nothing is executed): never a panic, and a tensor it reads holds what its shape says.
pub fn torch_file(data: &[u8]) {
    if let Ok(tensor) = crate::wire::torchfile::read(data, "fuzz", MAX_BODY) {
        assert!(
            tensor.validate().is_ok(),
            "an inconsistent tensor: {tensor:?}"
        );
    }
}

/// A chat completion body and its content parts, as every route parses them, and each media
/// part's source (data URL, URL, upload) as it is resolved: never a panic.
pub fn chat_request(data: &[u8]) {
    let Ok(request) = serde_json::from_slice::<crate::wire::openai::ChatCompletionRequest>(data)
    else {
        return;
    };
    for message in &request.messages {
        if let Some(crate::wire::openai::Content::Parts(parts)) = &message.content {
            for part in parts {
                let _ = part.media();
            }
        }
    }
}

/// A `/v1/files` upload's multipart body (the input's first line is the boundary, the rest the
/// body), as the route parses it: never a panic, and a file it finds is bytes of the body.
pub fn multipart_upload(data: &[u8]) {
    let Some(newline) = data.iter().position(|&b| b == b'\n') else {
        return;
    };
    let Ok(boundary) = std::str::from_utf8(&data[..newline]) else {
        return;
    };
    let body = bytes::Bytes::copy_from_slice(&data[newline + 1..]);
    let len = body.len();
    let parsed = runtime().block_on(crate::api::files::parse_upload(body, boundary.to_owned()));
    if let Ok(upload) = parsed {
        assert!(upload.data.len() <= len, "a file larger than the body");
    }
}

/// A media part's URL as every route reads it ([`crate::wire::openai::ByteSource::from_url`]) and a data
/// URL's payload as it is decoded: never a panic, and never more bytes than the limit checked
/// before decoding allowed.
pub fn data_url(data: &[u8]) {
    const LIMIT: usize = 4096;
    let url = String::from_utf8_lossy(data);
    if let crate::wire::openai::ByteSource::Base64 { data, .. } =
        crate::wire::openai::ByteSource::from_url(&url)
        && let Ok(bytes) = crate::wire::openai::decode_payload(&data, LIMIT)
    {
        assert!(bytes.len() <= LIMIT, "{} bytes past the limit", bytes.len());
    }
}

/// A model directory as a native model's start reads it: the input is its `config.json`, a NUL
/// byte, and its `model.safetensors`. Every family's config reader reads it, every
/// tensor the header lists is taken at its shape: never a panic, and a tensor holds what its
/// shape says.
pub fn checkpoint(data: &[u8]) {
    use mmgate_inference::families;
    use mmgate_inference::weights::Weights;
    let Some(nul) = data.iter().position(|&b| b == 0) else {
        return;
    };
    // One directory per process, written again for each input (the targets run one at a time).
    let dir = std::env::temp_dir().join(format!("mmgate-fuzz-checkpoint-{}", std::process::id()));
    let written = std::fs::create_dir_all(&dir)
        .and_then(|()| std::fs::write(dir.join("config.json"), &data[..nul]))
        .and_then(|()| std::fs::write(dir.join("model.safetensors"), &data[nul + 1..]));
    if let Err(e) = written {
        panic!("writing the checkpoint: {e}");
    }
    for family in families::registry() {
        let _ = family.read(&dir);
    }
    let Ok(mut weights) = Weights::load(&dir, str::to_owned) else {
        return;
    };
    for name in weights.leftover() {
        let Some(shape) = weights.shape(&name) else {
            continue;
        };
        if let Ok(tensor) = weights.take_host(&name, &shape) {
            assert_eq!(tensor.data.len(), shape.iter().product::<usize>(), "{name}");
        }
    }
}

/// The built-in image plugin through the real host and sandbox: probe, plan (Qwen2-VL's config, a
/// 1 024-token budget), preprocess. Errors are answers; a panic in the host is a finding (a trap
/// in the plugin is an error of that call).
pub fn image_plugin(data: &[u8]) {
    run_plugin(
        "image",
        data,
        include_str!("../../tests/fixtures/image/configs/qwen2-vl.json"),
    );
}

/// The built-in audio plugin, as [`image_plugin`] (Qwen2-Audio's config).
pub fn audio_plugin(data: &[u8]) {
    run_plugin(
        "audio",
        data,
        include_str!("../../tests/fixtures/audio/configs/qwen2-audio.json"),
    );
}

/// The built-in video plugin, as [`image_plugin`], through the host's FFmpeg decoder.
pub fn video_plugin(data: &[u8]) {
    run_plugin("video", data, "{}");
}

/// The built-in document plugin: probe, then page 1 rendered small (what a gateway asks of it
/// once it has planned): never a trap, and a page is a PNG.
pub fn document_plugin(data: &[u8]) {
    let plugin = builtin_plugin("document");
    let media = mmgate_host::Media {
        data: data.to_vec(),
        mime_type: None,
    };
    let Ok(info) = plugin.probe(&media) else {
        return;
    };
    let config = r#"{"mmgate_document_pages": [{"page": 1, "width": 96, "height": 128}]}"#;
    let budget = mmgate_host::Budget { max_tokens: 0 };
    let Ok(plan) = plugin.plan(&info, budget, config) else {
        return;
    };
    if let Ok(pages) = plugin.reduce(&media, &plan, config) {
        for page in &pages.files {
            assert!(page.data.starts_with(b"\x89PNG"), "a page is a PNG");
        }
    }
}

/// The host's video decoder on its own: open (demux and index within the limits), then decode
/// the first, a middle and the last frame: never a panic, and a frame is as large as it says.
pub fn video_decoder(data: &[u8]) {
    use mmgate_video_decode::{Limits, Video};
    let limits = Limits {
        max_decoded_frames: 300,
        max_decode_ms: 2_000,
        decoder_threads: 1,
        ..Limits::default()
    };
    let Ok(mut video) = Video::open(data, limits) else {
        return;
    };
    let count = video.info().frame_count;
    for index in [0, count / 2, count.saturating_sub(1)] {
        if let Ok(frame) = video.frame(index, None) {
            assert_eq!(
                frame.rgb.len(),
                frame.width as usize * frame.height as usize * 3,
                "frame {index}"
            );
        }
    }
}

/// Probe, plan and preprocess `data` with the built-in plugin for `modality`.
fn run_plugin(modality: &str, data: &[u8], config: &str) {
    let plugin = builtin_plugin(modality);
    let media = mmgate_host::Media {
        data: data.to_vec(),
        mime_type: None,
    };
    let Ok(info) = plugin.probe(&media) else {
        return;
    };
    let budget = mmgate_host::Budget { max_tokens: 1024 };
    let Ok(plan) = plugin.plan(&info, budget, config) else {
        return;
    };
    if let Ok(tensors) = plugin.preprocess(&media, &plan, config) {
        for tensor in &tensors {
            assert!(tensor.validate().is_ok(), "{}", tensor.name);
        }
    }
}

/// The built-in plugin for `modality`, loaded once, in a sandbox with tighter limits than a
/// gateway's (a fuzzer's input that needs more is an error, not a finding). With the built-in
/// plugins compiled in (the corpus replay in `cargo test`) those; else (the fuzz targets, built
/// without them) `$MMGATE_FUZZ_PLUGINS/<modality>.wasm`, which `./dev fuzz` builds.
fn builtin_plugin(modality: &str) -> std::sync::Arc<mmgate_host::LoadedPlugin> {
    use mmgate_host::{LoadedPlugin, PluginOrigin, PluginRegistry, Sandbox, SandboxLimits};
    use std::collections::BTreeMap;
    use std::sync::Arc;
    static PLUGINS: OnceLock<BTreeMap<&str, Arc<LoadedPlugin>>> = OnceLock::new();
    let plugins = PLUGINS.get_or_init(|| {
        let limits = SandboxLimits {
            memory_bytes: 256 << 20,
            deadline_ms: 5_000,
            max_instances: 4,
            ..SandboxLimits::default()
        };
        let sandbox = match Sandbox::new(limits) {
            Ok(sandbox) => Arc::new(sandbox),
            Err(e) => panic!("a sandbox for the plugin targets: {e}"),
        };
        const NAMES: [&str; 4] = ["image", "audio", "video", "document"];
        match std::env::var_os("MMGATE_FUZZ_PLUGINS") {
            Some(dir) => NAMES
                .into_iter()
                .map(|name| {
                    let path = std::path::Path::new(&dir).join(format!("{name}.wasm"));
                    let bytes =
                        std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
                    let plugin =
                        LoadedPlugin::load(sandbox.clone(), &bytes, PluginOrigin::File(path))
                            .unwrap_or_else(|e| panic!("loading the {name} plugin: {e}"));
                    (name, Arc::new(plugin))
                })
                .collect(),
            None => {
                let registry = PluginRegistry::builtin(&sandbox)
                    .unwrap_or_else(|e| panic!("loading the built-in plugins: {e}"));
                NAMES
                    .into_iter()
                    .filter_map(|name| Some((name, registry.for_modality(name)?.clone())))
                    .collect()
            }
        }
    });
    match plugins.get(modality) {
        Some(plugin) => plugin.clone(),
        None => panic!(
            "no built-in {modality} plugin: build the fuzz targets through ./dev fuzz, which sets \
             MMGATE_FUZZ_PLUGINS"
        ),
    }
}

/// The host's JPEG decoder (libjpeg-turbo) on its own, under limits small enough to keep each run
/// short: never a panic, and an image is as large as it says and within the limits.
pub fn image_decoder(data: &[u8]) {
    use mmgate_image_decode::{Limits, decode_jpeg};
    let limits = Limits {
        max_pixels: 4096 * 4096,
        max_scans: 100,
        max_decoder_memory_mb: 256,
        ..Limits::default()
    };
    if let Ok(image) = decode_jpeg(data, &limits) {
        let pixels = u64::from(image.width) * u64::from(image.height);
        assert!(
            pixels > 0 && pixels <= limits.max_pixels,
            "{}x{}",
            image.width,
            image.height
        );
        assert_eq!(image.rgb.len() as u64, pixels * 3);
    }
}
