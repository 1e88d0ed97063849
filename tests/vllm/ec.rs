//! mmgate as the encode tier of an unmodified vLLM (its CPU build, started as an EC consumer with
//! `ECExampleConnector`): media encoded here reach vLLM as files in the shared store, and the
//! request carries only each item's grid and identifier. The greedy answer and prompt tokens are
//! vLLM's own for the same planned media, the grids are what transformers' processor computes for
//! them, the body vLLM gets stays small, and a store that lost a file or is full never costs vLLM
//! its engine.

use std::io::{BufReader, Write};
use std::net::TcpListener;
use std::sync::{Arc, Mutex};

use super::*;

/// The body limit the issue set for what vLLM gets of any request in `ec` mode.
const MAX_UPSTREAM_BODY: usize = 64 << 10;

/// A stand-in upstream that keeps every request body it gets and answers each with a minimal
/// completion: what the gateway sends, seen whole.
fn recording_upstream() -> (String, Arc<Mutex<Vec<Vec<u8>>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = seen.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(stream) = stream else { continue };
            let log = log.clone();
            std::thread::spawn(move || {
                let mut reader = BufReader::new(stream.try_clone().unwrap());
                let mut stream = stream;
                while let Some((_, body)) = common::read_request(&mut reader) {
                    if !body.is_empty() {
                        log.lock().unwrap().push(body);
                    }
                    let answer = json!({"id": "x", "object": "chat.completion", "created": 0,
                        "model": "m", "choices": [{"index": 0, "finish_reason": "stop",
                        "message": {"role": "assistant", "content": "ok"}}],
                        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})
                    .to_string();
                    let head = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
                        answer.len()
                    );
                    if stream.write_all(head.as_bytes()).is_err()
                        || stream.write_all(answer.as_bytes()).is_err()
                    {
                        return;
                    }
                }
            });
        }
    });
    (addr, seen)
}

/// The grids transformers' image processor (the checkpoint's) computes for `images`.
fn transformers_grids(venv: &Path, model: &Path, images: &[&str]) -> Vec<Value> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/vllm/images");
    let script = "import json, sys\nfrom PIL import Image\nfrom transformers import AutoImageProcessor\n\
                  p = AutoImageProcessor.from_pretrained(sys.argv[1])\n\
                  for f in sys.argv[2:]:\n    \
                  print(json.dumps(p(images=[Image.open(f).convert('RGB')])['image_grid_thw'][0].tolist()))\n";
    let output = common::run_ok(
        Command::new(venv.join("bin/python"))
            .args(["-c", script])
            .arg(model)
            .args(images.iter().map(|i| root.join(i))),
    );
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// The grid transformers' video processor (the checkpoint's) computes for a video of `frames`,
/// taken as they are (as vLLM's processor takes a frame list).
fn transformers_video_grid(venv: &Path, model: &Path, frames: &[PathBuf]) -> Value {
    let script = "import json, sys\nimport numpy as np\nfrom PIL import Image\n\
                  from transformers import AutoVideoProcessor\n\
                  p = AutoVideoProcessor.from_pretrained(sys.argv[1])\n\
                  video = np.stack([np.asarray(Image.open(f).convert('RGB')) for f in sys.argv[2:]])\n\
                  out = p(videos=[video], do_sample_frames=False, return_tensors='pt')\n\
                  print(json.dumps(out['video_grid_thw'][0].tolist()))\n";
    let output = common::run_ok(
        Command::new(venv.join("bin/python"))
            .args(["-c", script])
            .arg(model)
            .args(frames),
    );
    serde_json::from_slice(&output.stdout).unwrap()
}

/// `content` through `model` (in `ec` mode) and through `reference` (vLLM encoding the media
/// itself): the same prompt tokens, kept as promised, and the same greedy answer.
fn answers_alike(gateway: &Server, model: &str, reference: &str, content: Value) {
    answers_alike_told(gateway, model, reference, content, &json!({}));
}

/// [`answers_alike`], the reference request with `told` added (what vLLM is told of the media).
fn answers_alike_told(
    gateway: &Server,
    model: &str,
    reference: &str,
    content: Value,
    told: &Value,
) {
    let what: Vec<String> = content
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["type"].to_string())
        .collect();
    let (status, promised, through_ec) = post(gateway, &chat(model, content.clone()));
    assert!(status.is_success(), "{status}: {through_ec}");
    let mut reference = chat(reference, content);
    for (key, value) in told.as_object().unwrap() {
        reference[key] = value.clone();
    }
    let (status, _, itself) = post(gateway, &reference);
    assert!(status.is_success(), "{status}: {itself}");
    assert_eq!(
        promised,
        through_ec["usage"]["prompt_tokens"].as_u64(),
        "{what:?}: {}",
        through_ec["usage"]
    );
    assert_eq!(
        through_ec["usage"]["prompt_tokens"], itself["usage"]["prompt_tokens"],
        "{what:?}"
    );
    assert_eq!(
        through_ec["choices"][0]["message"]["content"], itself["choices"][0]["message"]["content"],
        "{model}: the greedy answer"
    );
}

/// vLLM serving `model` as an EC consumer of `store`, and a gateway in front of it with the model
/// in `ec` mode (`ec`) and as [`front`] makes it: planned here (`name`, vLLM encoding the planned
/// media itself; the reference of `ec`), under a tight context (`{name}-tight`) and forwarded
/// (`{name}-forward`). One vLLM serves the family's tests of every media mode.
pub(super) fn ec_fronted(
    venv: &Path,
    model: &Path,
    store: &Path,
    (name, tight): (&str, usize),
) -> (Vllm, Server) {
    let transfer = json!({"ec_connector": "ECExampleConnector", "ec_role": "ec_consumer",
        "ec_connector_extra_config": {"shared_storage_path": store}})
    .to_string();
    // Trusting request kwargs lets a reference request tell vLLM a frame list's times.
    let args = [
        "--ec-transfer-config",
        &transfer,
        "--trust-request-mm-kwargs",
    ];
    let vllm = Vllm::start(venv, model, 4096, &args);
    let ec =
        format!("media = \"ec\"\npath = {model:?}\nec_storage = {store:?}\nec_dtype = \"float32\"");
    front(vllm, model, (name, tight, ""), &[("ec", ec.as_str())])
}

/// The demo Qwen2.5-VL (images; videos at one second per temporal patch, as vLLM assumes) or
/// Qwen3-VL (images with their deepstack features; videos with their temporal patches'
/// timestamps) through vLLM's EC connector (`ec`) answer as vLLM encoding the same media itself
/// (`planned`), and the items went through the `store`.
pub(super) fn qwen_vl_encoded_here_answers_as_vllm_itself(
    gateway: &Server,
    family: &str,
    planned: &str,
    store: &Path,
) {
    for image in [
        "scene-640x480.jpg",
        "scene-300x1000.jpg",
        "png-rgb-wide.png",
    ] {
        let content = json!([image_part(image), {"type": "text", "text": "What is this?"}]);
        answers_alike(gateway, "ec", planned, content);
    }
    let two = json!([image_part("scene-1200x300.jpg"), {"type": "text", "text": "and"},
                     image_part("scene-256x256.jpg")]);
    answers_alike(gateway, "ec", planned, two);
    if family == "qwen2.5-vl" {
        let clip = json!([video_part("h264.mp4"), {"type": "text", "text": "What happens?"}]);
        answers_alike(gateway, "ec", planned, clip);
    } else {
        // The reference is told the frames' source rate and indices, so that it writes the
        // same times as the timestamps sent beside the grid (12 s: times of two digits).
        for (clip, told) in [
            ("h264.mp4", qwen3_vl_frames(90, 30.0)),
            ("12s.mp4", qwen3_vl_frames(48, 4.0)),
        ] {
            let content = json!([video_part(clip), {"type": "text", "text": "What happens?"}]);
            answers_alike_told(gateway, "ec", planned, content, &told);
        }
    }
    assert!(
        !stored_items(store).is_empty(),
        "{family}: nothing went through the store"
    );
}

/// vLLM's `media_io_kwargs` naming the frames Qwen3-VL's processor samples (2 a second, at least
/// 4, `linspace(0, n - 1, k).round()`) from a clip of `frames` at `fps`: what the plan chose.
fn qwen3_vl_frames(frames: u64, fps: f64) -> Value {
    let wanted = ((frames as f64 / fps * 2.0) as u64)
        .clamp(4, 768)
        .min(frames);
    let step = (frames - 1) as f64 / (wanted - 1) as f64;
    let indices: Vec<u64> = (0..wanted)
        .map(|k| (k as f64 * step).round() as u64)
        .collect();
    json!({"media_io_kwargs": {"video": {"fps": fps, "frames_indices": indices,
                                         "total_num_frames": frames}}})
}

fn chat(model: &str, content: Value) -> Value {
    json!({"model": model, "max_tokens": 8, "temperature": 0,
           "messages": [{"role": "user", "content": content}]})
}

/// The item folders in the store that hold a file.
fn stored_items(store: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(store)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("encoder_cache.safetensors").is_file())
        .collect()
}

/// The demo Qwen2-VL behind vLLM as an EC consumer of the store mmgate writes.
#[test]
fn qwen2_vl_encoded_here_reaches_vllm_through_its_ec_connector() {
    let Some(venv) = vllm_venv() else { return };
    let scratch = tempfile::tempdir().unwrap();
    let model = common::engine::demo_checkpoint(scratch.path(), "demo", "qwen2-vl");
    let store = scratch.path().join("ec");
    let transfer = json!({"ec_connector": "ECExampleConnector", "ec_role": "ec_consumer",
        "ec_connector_extra_config": {"shared_storage_path": store}})
    .to_string();
    let vllm = Vllm::start(&venv, &model, 4096, &["--ec-transfer-config", &transfer]);
    let (recorder, seen) = recording_upstream();
    // `ec-small` holds one item of a small photo, not two.
    let models = [
        (
            "ec",
            vllm.addr.as_str(),
            format!(
                "media = \"ec\"\npath = {model:?}\nec_storage = {store:?}\nec_dtype = \"float32\""
            ),
        ),
        (
            "ec-small",
            vllm.addr.as_str(),
            format!(
                "media = \"ec\"\npath = {model:?}\nec_storage = {store:?}\nec_dtype = \"float32\"\nec_storage_bytes = 100000"
            ),
        ),
        (
            "planned",
            vllm.addr.as_str(),
            format!("media = \"preprocess\"\npath = {model:?}"),
        ),
        ("forward", vllm.addr.as_str(), String::new()),
        (
            "recorded",
            recorder.as_str(),
            format!(
                "media = \"ec\"\npath = {model:?}\nec_storage = {store:?}\nec_dtype = \"float32\""
            ),
        ),
        (
            "recorded-planned",
            recorder.as_str(),
            format!("media = \"preprocess\"\npath = {model:?}"),
        ),
    ];
    let mut config = String::new();
    for (name, upstream, lines) in &models {
        config.push_str(&format!(
            "[[models]]\nname = {name:?}\nupstream_model = {model:?}\nupstreams = [{upstream:?}]\n{lines}\n\n"
        ));
    }
    let config_file = scratch.path().join("gateway.toml");
    std::fs::write(&config_file, config).unwrap();
    let gateway = Server::start(&["--config", config_file.to_str().unwrap()]);

    // Images of several sizes, alone and several in one message, and videos: the answer and the
    // prompt tokens are vLLM's own for the same media (forwarded images; videos as planned here,
    // whose frames mmgate chooses as qwen-vl-utils does).
    let same = |content: Value, reference: &str| answers_alike(&gateway, "ec", reference, content);
    let images = [
        "scene-640x480.jpg",
        "scene-300x1000.jpg",
        "scene-1200x300.jpg",
        "png-rgb-wide.png",
    ];
    for image in images {
        same(
            json!([image_part(image), {"type": "text", "text": "What is this?"}]),
            "forward",
        );
    }
    same(
        json!([image_part("scene-640x480.jpg"), image_part("scene-900x300.jpg"),
               {"type": "text", "text": "and"}, image_part("scene-640x480.jpg")]),
        "forward",
    );
    for clip in ["h264.mp4", "portrait.mp4"] {
        same(
            json!([video_part(clip), {"type": "text", "text": "What happens?"}]),
            "planned",
        );
    }
    same(
        json!([video_part("h264.mp4"), image_part("scene-256x256.jpg"), {"type": "text", "text": "?"}]),
        "planned",
    );

    // What vLLM gets: metadata and identifiers, a few hundred bytes whatever the media; the grids
    // transformers' processor computes for the same images and the same planned frames.
    let grids = transformers_grids(&venv, &model, &images[..3]);
    for (image, grid) in images.iter().zip(&grids) {
        seen.lock().unwrap().clear();
        let (status, _, _) = post(
            &gateway,
            &chat(
                "recorded",
                json!([image_part(image), {"type": "text", "text": "?"}]),
            ),
        );
        assert!(status.is_success());
        let body = seen.lock().unwrap().pop().unwrap();
        assert!(body.len() < MAX_UPSTREAM_BODY, "{} bytes", body.len());
        let sent: Value = serde_json::from_slice(&body).unwrap();
        let part = &sent["messages"][0]["content"][0];
        assert_eq!(part["type"], "image_embeds", "{sent}");
        assert_eq!(&part["image_embeds"]["image_grid_thw"], grid, "{image}");
        assert!(
            store
                .join(part["uuid"].as_str().unwrap())
                .join("encoder_cache.safetensors")
                .is_file()
        );
    }
    // The body `model` sent upstream for `content`, and its size.
    let recorded = |model: &str, content: &Value| -> (Value, usize) {
        seen.lock().unwrap().clear();
        let (status, _, reply) = post(&gateway, &chat(model, content.clone()));
        assert!(status.is_success(), "{status}: {reply}");
        let body = seen.lock().unwrap().pop().unwrap();
        (serde_json::from_slice(&body).unwrap(), body.len())
    };
    for clip in ["h264.mp4", "portrait.mp4"] {
        let content = json!([image_part("scene-1280x960.jpg"), video_part(clip), {"type": "text", "text": "?"}]);
        // The frames planned here, as `preprocess` sends them, through the video processor.
        let (planned, _) = recorded("recorded-planned", &content);
        let url = planned["messages"][0]["content"][1]["video_url"]["url"]
            .as_str()
            .unwrap();
        let frames = url.strip_prefix("data:video/jpeg;base64,").unwrap();
        let frames: Vec<PathBuf> = frames
            .split(',')
            .enumerate()
            .map(|(n, frame)| {
                use base64::Engine as _;
                let path = scratch.path().join(format!("{clip}-{n}.png"));
                let data = base64::engine::general_purpose::STANDARD.decode(frame);
                std::fs::write(&path, data.unwrap()).unwrap();
                path
            })
            .collect();
        let (sent, bytes) = recorded("recorded", &content);
        assert!(bytes < MAX_UPSTREAM_BODY, "{bytes} bytes");
        let grid = &sent["messages"][0]["content"][1]["video_embeds"]["video_grid_thw"];
        assert_eq!(
            grid,
            &transformers_video_grid(&venv, &model, &frames),
            "{clip}"
        );
    }
    // An item removed from the store by hand is encoded and written again: vLLM is never
    // promised a file that is not there (it would lose its engine).
    let photo = json!([image_part("scene-640x480.jpg"), {"type": "text", "text": "What is this?"}]);
    let (_, _, before) = post(&gateway, &chat("ec", photo.clone()));
    for item in stored_items(&store) {
        std::fs::remove_dir_all(item).unwrap();
    }
    let (status, _, after) = post(&gateway, &chat("ec", photo.clone()));
    assert!(status.is_success(), "{status}: {after}");
    assert_eq!(before["choices"], after["choices"]);
    assert_eq!(stored_items(&store).len(), 1);

    // A store too small for a request's items: 503 with a clear error, nothing sent to vLLM.
    let two = json!([image_part("scene-600x280.jpg"), image_part("scene-1024x200.jpg"), {"type": "text", "text": "?"}]);
    let (status, _, full) = post(&gateway, &chat("ec-small", two));
    assert_eq!(status, 503, "{full}");
    assert_eq!(full["error"]["code"], "ec_store_full", "{full}");
    assert!(
        full["error"]["message"]
            .as_str()
            .unwrap()
            .contains("ec_storage_bytes")
    );
    let (status, _, again) = post(&gateway, &chat("ec", photo));
    assert!(status.is_success(), "vLLM still serves: {again}");

    // What the console's Try page does: the model listed with its media, a request planned (and
    // drawn) by `/v1/preprocess`, then sent as a streamed chat completion.
    let models: Value = client()
        .get(format!("http://{}/v1/models", gateway.addr))
        .send()
        .unwrap()
        .json()
        .unwrap();
    let listed = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["id"] == "ec")
        .unwrap();
    assert_eq!(listed["media"], "ec", "{listed}");
    assert_eq!(listed["modalities"], json!(["image", "video"]), "{listed}");
    let content = json!([image_part("scene-640x480.jpg"), {"type": "text", "text": "What?"}]);
    let plan: Value = client()
        .post(format!("http://{}/v1/preprocess", gateway.addr))
        .json(&json!({"model": "ec", "pictures": true,
                      "messages": [{"role": "user", "content": content.clone()}]}))
        .send()
        .unwrap()
        .json()
        .unwrap();
    assert_eq!(plan["media"][0]["kind"], "image", "{plan}");
    let mut streamed = chat("ec", content);
    streamed["stream"] = json!(true);
    let response = client()
        .post(format!("http://{}/v1/chat/completions", gateway.addr))
        .json(&streamed)
        .send()
        .unwrap();
    assert!(response.status().is_success());
    assert!(response.headers().contains_key("x-mmgate-media"));
    let events = response.text().unwrap();
    assert!(events.trim_end().ends_with("data: [DONE]"), "{events}");

    // OpenAI's SDK through the Responses API.
    let lines = common::responses_sdk(&venv, &gateway.addr, "ec", &["image"]);
    assert_eq!(lines[0]["media"][0]["kind"], "image", "{lines:?}");
}

/// The demo Qwen2-Audio: audio encoded here (`ec`) reaches vLLM as `audio_embeds` with its token
/// count, and vLLM answers as it does encoding the same audio planned here (`planned`) itself.
pub(super) fn qwen2_audio_encoded_here_answers_as_vllm_itself(
    gateway: &Server,
    planned: &str,
    store: &Path,
) {
    use base64::Engine as _;
    let clips = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/audio/clips");
    // Clips under 30 s: of a longer one vLLM's processor keeps the first 30 s, while the encoders
    // here take all of it (the count promised is then the longer one's, which vLLM keeps).
    for name in [
        "speech-16k-s16.wav",
        "speech-44k1-stereo-s16.wav",
        "speech-16k.mp3",
    ] {
        let data = base64::engine::general_purpose::STANDARD
            .encode(std::fs::read(clips.join(name)).unwrap());
        let format = name.rsplit('.').next().unwrap();
        let content = json!([{"type": "input_audio", "input_audio": {"data": data, "format": format}},
                             {"type": "text", "text": "What is said?"}]);
        answers_alike(gateway, "ec", planned, content);
    }
    assert!(
        !stored_items(store).is_empty(),
        "nothing went through the store"
    );
}
