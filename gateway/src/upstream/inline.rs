//! The media a forwarded request points at, made part of it. An upstream model's server gets every
//! http(s) URL fetched here and every upload read here, as data URLs: this gateway's SSRF guard, byte
//! limits and file store apply whichever route serves the model. Left as they were, an upstream
//! engine would fetch the URLs itself from inside the network (past the guard), and would know
//! nothing of this gateway's uploads. A PDF goes as its pages, rendered here as PNG images: no
//! engine takes PDFs.

use std::sync::LazyLock;

use base64::Engine as _;
use memchr::memmem;
use serde_json::Value;

use super::UpstreamPool;
use crate::error::ApiError;
use crate::media::sniff::sniff_mime_type;
use crate::prepare::documents::{pages_for_engine, probe_pdf};
use crate::prepare::errors::embeds_refused;
use crate::prepare::items::ChatServices;
use crate::prepare::media::{MediaTally, source_bytes};
use crate::wire::openai::parts::{Carried, carried, url_part, url_part_type};
use mmgate_inference::families::MediaKind;

/// Whether the body needs a look: it may hold a part whose bytes are elsewhere, or (when the model
/// takes none) `image_embeds`. A cheap scan that lets the common requests (text, data URLs) go on
/// without being parsed: `://` is in every URL but data URLs (base64 has no colon), `file_id` in
/// every upload reference, `file_data` in every file given inline (its kind is told here, from
/// its bytes); a false alarm only costs a parse.
pub fn needs_a_look(body: &[u8], accept_image_embeds: bool) -> bool {
    // Built once: building a searcher costs more than running it over a typical body.
    static FINDERS: LazyLock<[memmem::Finder<'static>; 4]> = LazyLock::new(|| {
        [b"://".as_slice(), b"file_id", b"file_data", b"image_embeds"].map(memmem::Finder::new)
    });
    let [url, upload, inline_file, embeds] = &*FINDERS;
    url.find(body).is_some()
        || upload.find(body).is_some()
        || inline_file.find(body).is_some()
        || (!accept_image_embeds && embeds.find(body).is_some())
}

/// Replaces the body's URL and upload parts with data URLs of their bytes, counting every media part
/// against the request limits as a native model's request would be; `image_embeds` parts are
/// refused unless `pool` accepts them. Whether anything changed.
pub async fn inline_media(
    body: &mut Value,
    pool: &UpstreamPool,
    services: &ChatServices<'_>,
) -> Result<bool, ApiError> {
    let mut found = Vec::new();
    let messages = body.get("messages").and_then(Value::as_array);
    for (m, message) in messages.into_iter().flatten().enumerate() {
        let parts = message.get("content").and_then(Value::as_array);
        for (p, part) in parts.into_iter().flatten().enumerate() {
            if let Some(media) = carried(part) {
                found.push((m, p, media));
            }
        }
    }
    let mut tally = MediaTally::new(services.limits, found.len())?;
    let mut changed = false;
    // Each PDF's place and its pages as image parts, spliced in once every place is known.
    let mut documents = Vec::new();
    for (index, (m, p, media)) in found.into_iter().enumerate() {
        let (kind, source) = match media {
            Carried::Inline { kind, bytes } => {
                tally.add(index, kind, bytes)?;
                continue;
            }
            Carried::Embeddings if pool.accept_image_embeds => continue,
            Carried::Embeddings => return Err(embeds_refused(&pool.model)),
            Carried::Elsewhere { kind, source } => (kind, source),
        };
        let (data, declared) = source_bytes(index, source, tally.limit(kind), services).await?;
        let mime = sniff_mime_type(&data).map(str::to_owned).or(declared);
        if kind.is_none() && mime.as_deref() == Some("application/pdf") {
            let document = probe_pdf(index, data, services).await?;
            tally.add_pages(index, document.pages.len())?;
            let mut pages = Vec::new();
            for page in pages_for_engine(index, &document, services).await? {
                tally.add(index, MediaKind::Image, page.data.len())?;
                let url = format!(
                    "data:image/png;base64,{}",
                    base64::engine::general_purpose::STANDARD.encode(&page.data)
                );
                pages.push(url_part(MediaKind::Image, url));
            }
            documents.push((m, p, pages));
            continue;
        }
        let kind = match kind {
            Some(kind) => kind,
            None => kind_of(mime.as_deref()).ok_or_else(|| {
                ApiError::new(
                    http::StatusCode::UNSUPPORTED_MEDIA_TYPE,
                    "unsupported_media",
                    format!(
                        "media item {index}: the file is {}, not an image, a video or audio",
                        mime.as_deref().unwrap_or("of unknown type")
                    ),
                )
            })?,
        };
        tally.add(index, kind, data.len())?;
        let url = format!(
            "data:{};base64,{}",
            mime.as_deref().unwrap_or("application/octet-stream"),
            base64::engine::general_purpose::STANDARD.encode(&data)
        );
        // Where the walk above found it: nothing has moved since.
        let Some(part) = body.pointer_mut(&format!("/messages/{m}/content/{p}")) else {
            continue;
        };
        let field = url_part_type(kind);
        match part.get_mut(field).and_then(Value::as_object_mut) {
            // A URL part keeps its other fields (`detail`).
            Some(object) => {
                object.insert("url".into(), Value::String(url));
            }
            // An upload (or a URL given as a bare string) becomes its kind's URL part.
            None => *part = url_part(kind, url),
        }
        changed = true;
    }
    for (m, p, pages) in documents.into_iter().rev() {
        if let Some(parts) = body
            .pointer_mut(&format!("/messages/{m}/content"))
            .and_then(Value::as_array_mut)
            && p < parts.len()
        {
            parts.splice(p..=p, pages);
            changed = true;
        }
    }
    Ok(changed)
}

/// The kind of media a MIME type names (`None` for other types).
pub(crate) fn kind_of(mime: Option<&str>) -> Option<MediaKind> {
    let (family, _) = mime?.split_once('/')?;
    match family {
        "image" => Some(MediaKind::Image),
        "video" => Some(MediaKind::Video),
        "audio" => Some(MediaKind::Audio),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn only_bodies_with_urls_uploads_or_refused_embeddings_are_parsed() {
        for accept in [false, true] {
            assert!(!needs_a_look(br#"{"messages":[{"content":"hi"}]}"#, accept));
            assert!(!needs_a_look(
                br#"{"messages":[{"content":[{"type":"image_url","image_url":{"url":"data:image/png;base64,iVBO"}}]}]}"#,
                accept
            ));
            assert!(needs_a_look(
                br#"{"url":"https://example.com/a.png"}"#,
                accept
            ));
            assert!(needs_a_look(br#"{"file":{"file_id":"file-1"}}"#, accept));
        }
        let embeds = br#"{"type":"image_embeds","image_embeds":"UEsDBA"}"#;
        assert!(needs_a_look(embeds, false));
        assert!(!needs_a_look(embeds, true));
    }

    #[test]
    fn an_upload_is_the_kind_its_mime_type_says() {
        assert_eq!(kind_of(Some("image/png")), Some(MediaKind::Image));
        assert_eq!(kind_of(Some("video/mp4")), Some(MediaKind::Video));
        assert_eq!(kind_of(Some("audio/x-wav")), Some(MediaKind::Audio));
        assert_eq!(kind_of(Some("application/pdf")), None);
        assert_eq!(kind_of(None), None);
    }
}
