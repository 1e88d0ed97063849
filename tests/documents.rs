//! Documents (PDFs) end to end: the real `mmgate serve` on the demo models, the built-in document
//! plugin rendering pages inside its sandbox, over loopback HTTP; another real mmgate as the
//! upstream of a forwarded model. Fixtures: tests/fixtures/documents (made by its make.py).

use crate::common;

use std::time::Duration;

use base64::Engine as _;
use common::fixture;
use common::server::Server;
use serde_json::{Value, json};

fn start(config: &str) -> (Server, tempfile::TempDir) {
    Server::with_config(config)
}

fn client() -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(120))
        .build()
        .unwrap()
}

/// A chat completion; its status, `x-mmgate-media` header and body.
fn post(server: &Server, body: &Value) -> (u16, Option<Value>, Value) {
    let response = client()
        .post(format!("http://{}/v1/chat/completions", server.addr))
        .json(body)
        .send()
        .unwrap();
    let status = response.status().as_u16();
    let media = response
        .headers()
        .get("x-mmgate-media")
        .map(|h| serde_json::from_slice(h.as_bytes()).unwrap());
    (status, media, response.json().unwrap())
}

fn pdf_data(name: &str) -> String {
    format!(
        "data:application/pdf;base64,{}",
        base64::engine::general_purpose::STANDARD.encode(fixture(&format!("documents/{name}")))
    )
}

fn ask(file: Value, max_tokens: u64) -> Value {
    json!({
        "model": "demo",
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "What does it say?"},
            {"type": "file", "file": file},
        ]}],
        "max_tokens": max_tokens,
        "temperature": 0,
    })
}

fn upload(server: &Server, name: &str, bytes: Vec<u8>) -> String {
    let form = reqwest::blocking::multipart::Form::new()
        .text("purpose", "user_data")
        .part(
            "file",
            reqwest::blocking::multipart::Part::bytes(bytes).file_name(name.to_owned()),
        );
    let answer: Value = client()
        .post(format!("http://{}/v1/files", server.addr))
        .multipart(form)
        .send()
        .unwrap()
        .json()
        .unwrap();
    answer["id"].as_str().expect("an upload id").to_owned()
}

/// A PDF is read as its pages: each page an image of the model's family, rendered at the size
/// the image plan chose, accounted as one document; the same by upload and inline; the text a
/// request without the document costs plus the pages' tokens.
#[test]
fn a_pdf_is_its_pages_inline_or_uploaded() {
    let (server, _dir) = start("");
    let (status, _, body) = post(
        &server,
        &ask(
            json!({"filename": "r.pdf", "file_data": pdf_data("three-pages.pdf")}),
            4,
        ),
    );
    assert_eq!(status, 200, "{body}");
    let document = &body["usage"]["media"][0];
    assert_eq!(document["kind"], "document", "{document}");
    assert_eq!(document["pages"], 3);
    assert_eq!(document["pages_kept"], json!([1, 2, 3]));
    let per_page = document["per_page"].as_array().unwrap();
    let tokens: u64 = per_page.iter().map(|p| p["tokens"].as_u64().unwrap()).sum();
    assert_eq!(document["tokens"], tokens);
    // The slide (page 2) is landscape, the letter pages portrait: each page keeps its shape.
    let size = |p: &Value| {
        (
            p["size"]["width"].as_u64().unwrap(),
            p["size"]["height"].as_u64().unwrap(),
        )
    };
    let (w1, h1) = size(&per_page[0]);
    let (w2, h2) = size(&per_page[1]);
    assert!(h1 > w1 && w2 > h2, "{per_page:?}");

    // The same file uploaded costs the same.
    let id = upload(&server, "report.pdf", fixture("documents/three-pages.pdf"));
    let (status, _, uploaded) = post(&server, &ask(json!({"file_id": id}), 4));
    assert_eq!(status, 200, "{uploaded}");
    assert_eq!(
        uploaded["usage"]["prompt_tokens"],
        body["usage"]["prompt_tokens"]
    );
    assert_eq!(uploaded["choices"], body["choices"]);

    // Each page costs what an image of its size costs the model: one page alone, less the
    // same request with no document, is page 1's tokens plus its image placeholder's text.
    let (_, _, one) = post(&server, &ask(json!({"file_data": pdf_data("text.pdf")}), 4));
    let page_tokens = one["usage"]["media"][0]["tokens"].as_u64().unwrap();
    let mut text_only = ask(json!({}), 4);
    text_only["messages"][0]["content"] = json!("What does it say?");
    let (_, _, text) = post(&server, &text_only);
    let extra = one["usage"]["prompt_tokens"].as_u64().unwrap()
        - text["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(
        extra >= page_tokens && extra <= page_tokens + 4,
        "{extra} vs {page_tokens}"
    );
}

/// Pages are shrunk to fit the context before any is left out; what does not fit at the
/// legibility floor is refused with how many pages fit, or, with `documents.overflow =
/// "first_pages"`, the first pages are kept and the account says so.
#[test]
fn pages_that_do_not_fit_are_refused_or_the_first_kept() {
    // The demo's processor makes a letter page no larger than at the floor (768 px long): a
    // page costs the same at either, and a budget of a page and a half fits one.
    let (server, _dir) = start("");
    let (status, _, full) = post(
        &server,
        &ask(json!({"file_data": pdf_data("three-pages.pdf")}), 4),
    );
    assert_eq!(status, 200, "{full}");
    let prompt = full["usage"]["prompt_tokens"].as_u64().unwrap();
    let context = 32768;
    // Leave room for the text and about one and a half pages at their smallest.
    let first_page = full["usage"]["media"][0]["per_page"][0]["tokens"]
        .as_u64()
        .unwrap();
    let tight = context - prompt + first_page + first_page / 2;
    let (status, _, refused) = post(
        &server,
        &ask(json!({"file_data": pdf_data("three-pages.pdf")}), tight),
    );
    assert_eq!(status, 400, "{refused}");
    let message = refused["error"]["message"].as_str().unwrap();
    assert_eq!(
        refused["error"]["code"], "context_length_exceeded",
        "{refused}"
    );
    assert!(
        message.contains("documents.overflow") && message.contains("1 of them fit"),
        "{message}"
    );

    let (first, _dir2) = start("[documents]\noverflow = \"first_pages\"\n");
    let (status, _, kept) = post(
        &first,
        &ask(json!({"file_data": pdf_data("three-pages.pdf")}), tight),
    );
    assert_eq!(status, 200, "{kept}");
    let document = &kept["usage"]["media"][0];
    let pages_kept = document["pages_kept"].as_array().unwrap();
    assert_eq!(pages_kept, &[json!(1)], "{document}");
    assert_eq!(document["pages"], 3);
    assert!(
        document["reason"].as_str().unwrap().contains("left out"),
        "{document}"
    );
    assert!(
        kept["usage"]["prompt_tokens"].as_u64().unwrap() + tight <= context,
        "{kept}"
    );
}

/// Hostile and broken documents get a clear 4xx and cost nothing else: the server answers the
/// next request.
#[test]
fn hostile_documents_are_refused_clearly() {
    let (server, _dir) = start("[limits]\nmax_document_pages = 2\n");
    for (name, status, code, said) in [
        ("bad/encrypted.pdf", 400, "invalid_media", "encrypted"),
        ("bad/deep-nesting.pdf", 400, "invalid_media", "no pages"),
        (
            "three-pages.pdf",
            413,
            "document_too_long",
            "limits.max_document_pages",
        ),
    ] {
        let (got, _, body) = post(&server, &ask(json!({"file_data": pdf_data(name)}), 4));
        assert_eq!(
            (got, body["error"]["code"].as_str()),
            (status, Some(code)),
            "{name}: {body}"
        );
        assert!(
            body["error"]["message"].as_str().unwrap().contains(said),
            "{name}: {body}"
        );
    }
    // Broken cross-reference tables are rebuilt; a huge page box is scaled, not rasterised at
    // 72 dpi; a 400 MB image bomb stays inside the sandbox's bounds.
    for name in [
        "bad/truncated.pdf",
        "bad/bad-xref.pdf",
        "bad/huge-box.pdf",
        "bad/image-bomb.pdf",
    ] {
        let (got, _, body) = post(&server, &ask(json!({"file_data": pdf_data(name)}), 4));
        assert!(
            got == 200 || (400..500).contains(&got),
            "{name}: {got} {body}"
        );
        if got == 200 {
            let page = &body["usage"]["media"][0]["per_page"][0]["size"];
            assert!(
                page["width"].as_u64().unwrap() <= 2048 && page["height"].as_u64().unwrap() <= 2048,
                "{name}: {page}"
            );
        }
    }
    // 100 000 pages (8 MB: one page tree of empty pages) are refused before any is rendered.
    let id = upload(&server, "many.pdf", pdf_of_empty_pages(100_000));
    let (got, _, body) = post(&server, &ask(json!({"file_id": id}), 4));
    assert_eq!(got, 413, "{body}");
    assert!(
        body["error"]["message"].as_str().unwrap().contains("pages"),
        "{body}"
    );
    // A PDF sent as an image is what its part says it is not.
    let (got, _, body) = post(
        &server,
        &json!({"model": "demo", "max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": pdf_data("text.pdf")}}]}]}),
    );
    assert_eq!(
        (got, body["error"]["code"].as_str()),
        (415, Some("unsupported_media")),
        "{body}"
    );
    // A model that takes no images takes no documents.
    let mut audio = ask(json!({"file_data": pdf_data("text.pdf")}), 2);
    audio["model"] = json!("demo-audio");
    let (got, _, body) = post(&server, &audio);
    assert_eq!(got, 415, "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("documents"),
        "{body}"
    );
    let (got, _, body) = post(&server, &ask(json!({"file_data": pdf_data("text.pdf")}), 2));
    assert_eq!(got, 200, "{body}");
}

/// A PDF of `pages` empty US-letter pages under one page tree, with its cross-reference table.
fn pdf_of_empty_pages(pages: usize) -> Vec<u8> {
    let mut pdf = b"%PDF-1.7\n".to_vec();
    let mut offsets = Vec::with_capacity(pages + 2);
    let mut object = |pdf: &mut Vec<u8>, body: String| {
        offsets.push(pdf.len());
        let number = offsets.len();
        pdf.extend_from_slice(format!("{number} 0 obj\n{body}\nendobj\n").as_bytes());
    };
    object(&mut pdf, "<< /Type /Catalog /Pages 2 0 R >>".into());
    let kids: Vec<String> = (0..pages).map(|i| format!("{} 0 R", i + 3)).collect();
    object(
        &mut pdf,
        format!(
            "<< /Type /Pages /Count {pages} /Kids [{}] >>",
            kids.join(" ")
        ),
    );
    for _ in 0..pages {
        object(
            &mut pdf,
            "<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] >>".into(),
        );
    }
    let xref = pdf.len();
    let mut table = format!("xref\n0 {}\n0000000000 65535 f \n", offsets.len() + 1);
    for offset in &offsets {
        table.push_str(&format!("{offset:010} 00000 n \n"));
    }
    table.push_str(&format!(
        "trailer\n<< /Size {} /Root 1 0 R >>\nstartxref\n{xref}\n%%EOF\n",
        offsets.len() + 1
    ));
    pdf.extend_from_slice(table.as_bytes());
    pdf
}

/// A model whose engine preprocesses for itself (`forward`) gets a PDF's pages as PNG image
/// parts, rendered here: no engine takes PDFs.
#[test]
fn a_forwarded_model_gets_the_pages_as_images() {
    let (back, _d1) = start("");
    let (front, _d2) = start(&format!(
        "models = [{{ name = \"demo\", upstreams = [\"{}\"] }}]\n",
        back.addr
    ));
    let (status, _, body) = post(
        &front,
        &ask(json!({"file_data": pdf_data("three-pages.pdf")}), 3),
    );
    assert_eq!(status, 200, "{body}");
    // The upstream (a native mmgate) saw three images, not a document.
    let media = body["usage"]["media"].as_array().unwrap();
    assert_eq!(media.len(), 3, "{body}");
    assert!(media.iter().all(|m| m["kind"] == "image"), "{body}");
    let (status, _, body) = post(
        &front,
        &ask(json!({"file_data": pdf_data("bad/encrypted.pdf")}), 3),
    );
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (400, Some("invalid_media")),
        "{body}"
    );

    // Planned here (`preprocess`): each page rendered at its planned size, and the upstream
    // counts exactly the tokens promised.
    let (planned, _d3) = start(&format!(
        "models = [{{ name = \"demo\", upstreams = [\"{}\"], media = \"preprocess\", path = \"demo\" }}]\n",
        back.addr
    ));
    let response = client()
        .post(format!("http://{}/v1/chat/completions", planned.addr))
        .json(&ask(json!({"file_data": pdf_data("three-pages.pdf")}), 3))
        .send()
        .unwrap();
    assert_eq!(response.status(), 200);
    let header = |name: &str| {
        response
            .headers()
            .get(name)
            .unwrap()
            .to_str()
            .unwrap()
            .to_owned()
    };
    let promised: u64 = header("x-mmgate-prompt-tokens").parse().unwrap();
    let account: Value = serde_json::from_str(&header("x-mmgate-media")).unwrap();
    let body: Value = response.json().unwrap();
    assert_eq!(body["usage"]["prompt_tokens"], promised, "{body}");
    assert_eq!(account[0]["kind"], "document", "{account}");
    assert_eq!(account[0]["pages_kept"], json!([1, 2, 3]));
    // The reply's account is this gateway's: the document, not the three images upstream.
    assert_eq!(body["usage"]["media"][0]["pages_kept"], json!([1, 2, 3]));
}

/// The same PDF through the Responses API (`input_file`) and Anthropic's Messages API (a
/// `document` block, counted before it is sent) costs what it costs as a chat `file` part.
#[test]
fn a_pdf_reaches_the_responses_and_messages_apis() {
    let (server, _dir) = start("");
    let (status, _, chat) = post(&server, &ask(json!({"file_data": pdf_data("text.pdf")}), 4));
    assert_eq!(status, 200, "{chat}");
    let chat_tokens = chat["usage"]["prompt_tokens"].as_u64().unwrap();

    let post_to = |path: &str, body: Value| -> (u16, Value) {
        let response = client()
            .post(format!("http://{}{path}", server.addr))
            .header("anthropic-version", "2023-06-01")
            .json(&body)
            .send()
            .unwrap();
        (response.status().as_u16(), response.json().unwrap())
    };
    let (status, response) = post_to(
        "/v1/responses",
        json!({"model": "demo", "max_output_tokens": 4, "input": [{"role": "user", "content": [
            {"type": "input_text", "text": "What does it say?"},
            {"type": "input_file", "filename": "r.pdf", "file_data": pdf_data("text.pdf")}]}]}),
    );
    assert_eq!(status, 200, "{response}");
    assert_eq!(response["usage"]["input_tokens"], chat_tokens, "{response}");
    assert_eq!(response["usage"]["media"][0]["kind"], "document");

    let pdf = pdf_data("text.pdf");
    let base64 = pdf.split_once(',').unwrap().1;
    let message = json!({"model": "demo", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What does it say?"},
        {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": base64}}]}]});
    let (status, counted) = post_to("/v1/messages/count_tokens", message.clone());
    assert_eq!(status, 200, "{counted}");
    let (status, answer) = post_to("/v1/messages", message);
    assert_eq!(status, 200, "{answer}");
    assert_eq!(
        answer["usage"]["input_tokens"], counted["input_tokens"],
        "{answer}"
    );
    assert!(
        answer["usage"]["input_tokens"].as_u64().unwrap() > 250,
        "{answer}"
    );
}

/// The text layer: with `documents.text = "with_pages"` each page's text goes before its image
/// (and the account counts its characters); with `"only"` the pages' text alone, no image.
#[test]
fn a_pdfs_text_layer_goes_with_or_instead_of_its_pages() {
    let (images, _d1) = start("");
    let (with_pages, _d2) = start("[documents]\ntext = \"with_pages\"\n");
    let (only, _d3) = start("[documents]\ntext = \"only\"\n");
    let file = || json!({"file_data": pdf_data("three-pages.pdf")});
    let prompt = |server: &Server| {
        let (status, _, body) = post(server, &ask(file(), 2));
        assert_eq!(status, 200, "{body}");
        body
    };
    let (images, with_pages, only) = (prompt(&images), prompt(&with_pages), prompt(&only));
    let tokens = |body: &Value| body["usage"]["prompt_tokens"].as_u64().unwrap();
    let media = |body: &Value| body["usage"]["media"].clone();
    // The pages' images cost the same with their text; the text adds its tokens.
    assert_eq!(media(&with_pages)[0]["tokens"], media(&images)[0]["tokens"]);
    let per_page = media(&with_pages)[0]["per_page"].clone();
    let chars: Vec<u64> = per_page
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["text_chars"].as_u64().unwrap())
        .collect();
    // The report page is text, the slide a few words, the photo page a caption and a paragraph.
    assert!(
        chars[0] > 1000 && chars[1] > 10 && chars[1] < 100,
        "{chars:?}"
    );
    assert!(
        tokens(&with_pages) > tokens(&images) + 300,
        "{with_pages} vs {images}"
    );
    // Each page's text tokens are what its text adds to the prompt (give or take the tokens its
    // joins with the parts around it make).
    let text_tokens: Vec<u64> = per_page
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["text_tokens"].as_u64().unwrap())
        .collect();
    let added = tokens(&with_pages) - tokens(&images);
    let counted: u64 = text_tokens.iter().sum();
    assert_eq!(media(&with_pages)[0]["text_tokens"], counted);
    assert!(
        counted.abs_diff(added) <= 2 * text_tokens.len() as u64,
        "{text_tokens:?} vs {added} added"
    );
    // The text alone: no images, and fewer tokens than the images with their text.
    assert!(media(&only).as_array().is_none_or(Vec::is_empty), "{only}");
    assert!(
        tokens(&only) + media(&images)[0]["tokens"].as_u64().unwrap() <= tokens(&with_pages) + 12,
        "{only} vs {with_pages}"
    );

    // A text layer is the request's text: the two together stay within `limits.max_text_bytes`,
    // though each alone fits (a page's character is at most 4 bytes).
    let chars: u64 = chars.iter().sum();
    let limit = 4 * chars + 10;
    let (limited, _d4) = start(&format!(
        "[documents]\ntext = \"with_pages\"\n[limits]\nmax_text_bytes = {limit}\n"
    ));
    let (status, _, body) = post(&limited, &ask(file(), 2));
    assert_eq!(status, 200, "{body}");
    let mut long = ask(file(), 2);
    long["messages"][0]["content"][0]["text"] = json!("a".repeat(4 * chars as usize));
    let (status, _, body) = post(&limited, &long);
    assert_eq!(status, 413, "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("with the document's text") && message.contains("max_text_bytes"),
        "{body}"
    );
}
