//! `/v1/files`: multipart uploads into the file store, listing, lookup and deletion.

use bytes::Bytes;
use http::StatusCode;
use pingora::protocols::http::ServerSession;
use serde_json::{Value, json};

use super::Gateway;
use super::io::read_body;
use crate::error::ApiError;
use crate::media::files::{FileMeta, FilesError, NewFile};
use crate::media::sniff::sniff_mime_type;
use crate::store::Caller;

/// Room for the multipart framing and the other fields around the file itself.
const MULTIPART_OVERHEAD: usize = 64 << 10;

impl Gateway {
    /// `POST /v1/files` (multipart/form-data: `file`, and optionally `purpose`).
    pub(super) async fn upload(&self, session: &mut ServerSession) -> Result<Value, ApiError> {
        let boundary = session
            .req_header()
            .headers
            .get(http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| multer::parse_boundary(v).ok())
            .ok_or_else(|| {
                ApiError::new(
                    StatusCode::BAD_REQUEST,
                    "invalid_request",
                    "uploads are multipart/form-data with a boundary",
                )
            })?;
        let max_file = self.files.max_file_bytes();
        let body = read_body(session, max_file + MULTIPART_OVERHEAD).await?;
        let Upload {
            filename,
            declared,
            data,
            purpose,
        } = parse_upload(body, boundary).await?;
        let mime_type = sniff_mime_type(&data)
            .map(str::to_owned)
            .or(declared.filter(|m| m != "application/octet-stream"));
        let file = NewFile {
            filename,
            purpose,
            mime_type,
            data,
        };
        let stored = self
            .files
            .insert(&self.caller(session), file)
            .await
            .map_err(|e| match e {
                FilesError::FileTooLarge { .. } => ApiError::new(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "file_too_large",
                    e.to_string(),
                ),
                FilesError::Full { .. } => ApiError::new(
                    StatusCode::INSUFFICIENT_STORAGE,
                    "file_store_full",
                    e.to_string(),
                ),
                FilesError::QuotaExceeded { .. } => {
                    ApiError::new(StatusCode::FORBIDDEN, "file_quota_exceeded", e.to_string())
                }
                FilesError::Unavailable(e) => e.into(),
            })?;
        Ok(stored.json())
    }

    pub(super) async fn list_files(&self, caller: &Caller) -> Result<Value, ApiError> {
        let data: Vec<Value> = self
            .files
            .list(caller)
            .await?
            .iter()
            .map(FileMeta::json)
            .collect();
        Ok(json!({"object": "list", "data": data}))
    }

    pub(super) async fn file_json(&self, caller: &Caller, id: &str) -> Result<Value, ApiError> {
        self.files
            .get(caller, id)
            .await?
            .map(|f| f.meta.json())
            .ok_or_else(|| not_found(id))
    }

    pub(super) async fn delete_file(&self, caller: &Caller, id: &str) -> Result<Value, ApiError> {
        if self.files.remove(caller, id).await? {
            Ok(json!({"id": id, "object": "file", "deleted": true}))
        } else {
            Err(not_found(id))
        }
    }
}

/// What a multipart upload holds.
pub struct Upload {
    pub filename: String,
    /// The MIME type the client gave the file, if any.
    pub declared: Option<String>,
    pub data: Bytes,
    pub purpose: String,
}

/// The `file` (and `purpose`) fields of a multipart/form-data `body` with `boundary`.
pub async fn parse_upload(body: Bytes, boundary: String) -> Result<Upload, ApiError> {
    let bad = |e: multer::Error| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_request",
            format!("the multipart body does not parse: {e}"),
        )
    };
    let stream = futures_util::stream::once(async move { Ok::<Bytes, std::io::Error>(body) });
    let mut multipart = multer::Multipart::new(stream, boundary);
    let (mut file, mut purpose) = (None, String::from("user_data"));
    while let Some(field) = multipart.next_field().await.map_err(bad)? {
        match field.name() {
            Some("file") => {
                let filename = field.file_name().unwrap_or("upload").to_owned();
                let declared = field.content_type().map(|m| m.essence_str().to_owned());
                let data = field.bytes().await.map_err(bad)?;
                file = Some((filename, declared, data));
            }
            Some("purpose") => purpose = field.text().await.map_err(bad)?,
            _ => {}
        }
    }
    let (filename, declared, data) = file.ok_or_else(|| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_request",
            "the upload has no `file` field",
        )
    })?;
    Ok(Upload {
        filename,
        declared,
        data,
        purpose,
    })
}

fn not_found(id: &str) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "file_not_found",
        format!("no uploaded file {id:?}"),
    )
}
