//! Entry points for the fuzz targets (`gateway/fuzz`, libFuzzer through cargo-fuzz) and for the
//! replay of their corpora and regression inputs in `cargo test` (`tests/fuzz_corpus.rs`): each
//! takes any bytes, must never panic on its own account, and panics only when a property the
//! gateway relies on is broken.

use std::io::Cursor;
use std::sync::OnceLock;

use pingora::protocols::http::ServerSession;

use crate::http1::{self, Chunked, Request, RequestCheck};

/// A fuzz target: any bytes in; a panic is a finding.
pub type Target = fn(&[u8]);

/// The fuzz targets, by name: what `./dev fuzz` runs and the corpus replay covers.
pub const TARGETS: [(&str, Target); 6] = [
    ("lane_request", lane_request),
    ("request_framing", request_framing),
    ("upstream_response", upstream_response),
    ("torch_file", torch_file),
    ("chat_request", chat_request),
    ("multipart_upload", multipart_upload),
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
    if let Ok(tensor) = crate::torchfile::read(data, "fuzz", MAX_BODY) {
        assert!(
            tensor.validate().is_ok(),
            "an inconsistent tensor: {tensor:?}"
        );
    }
}

/// A chat completion body and its content parts, as every route parses them, and each media
/// part's source (data URL, URL, upload) as it is resolved: never a panic.
pub fn chat_request(data: &[u8]) {
    let Ok(request) = serde_json::from_slice::<crate::openai::ChatCompletionRequest>(data) else {
        return;
    };
    for message in &request.messages {
        if let Some(crate::openai::Content::Parts(parts)) = &message.content {
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
