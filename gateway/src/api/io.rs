//! Reading request bodies and writing JSON and server-sent-event responses on a pingora session.

use bytes::Bytes;
use http::StatusCode;
use pingora::http::ResponseHeader;
use pingora::protocols::http::ServerSession;
use serde_json::Value;

use crate::error::ApiError;

/// The request body, refused past `limit` bytes (by Content-Length before reading, else while
/// reading).
pub async fn read_body(session: &mut ServerSession, limit: usize) -> Result<Bytes, ApiError> {
    let too_large = || {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "request_too_large",
            format!("the request body is over {limit} bytes"),
        )
    };
    let declared = session
        .req_header()
        .headers
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    if declared.is_some_and(|n| n > limit) {
        return Err(too_large());
    }
    let mut body = Vec::with_capacity(declared.unwrap_or(0));
    loop {
        let chunk = session.read_request_body().await.map_err(|e| {
            ApiError::new(
                StatusCode::BAD_REQUEST,
                "bad_request_body",
                format!("cannot read the request body: {e}"),
            )
        })?;
        let Some(chunk) = chunk else { break };
        if body.len() + chunk.len() > limit {
            return Err(too_large());
        }
        body.extend_from_slice(&chunk);
    }
    Ok(Bytes::from(body))
}

/// A complete JSON response. A client that went away is only logged: there is no one to tell.
pub async fn write_json(session: &mut ServerSession, status: StatusCode, body: &Value) {
    let bytes = Bytes::from(body.to_string());
    write_complete(session, status, "application/json", bytes, &[]).await;
}

/// [`write_json`] with `headers` besides.
pub async fn write_json_with(
    session: &mut ServerSession,
    status: StatusCode,
    body: &Value,
    headers: &[(&str, &str)],
) {
    let bytes = Bytes::from(body.to_string());
    write_complete(session, status, "application/json", bytes, headers).await;
}

/// A complete non-JSON response (the metrics exposition).
pub async fn write_text(session: &mut ServerSession, content_type: &str, text: String) {
    write_complete(
        session,
        StatusCode::OK,
        content_type,
        Bytes::from(text),
        &[],
    )
    .await;
}

/// One of the console's files, with `headers` (its security policy).
pub async fn write_static(
    session: &mut ServerSession,
    content_type: &str,
    body: &'static [u8],
    headers: &[(&str, &str)],
) {
    let body = Bytes::from_static(body);
    write_complete(session, StatusCode::OK, content_type, body, headers).await;
}

/// `204 No Content` with `headers` (an `OPTIONS` answer's `Allow`).
pub async fn write_no_content(session: &mut ServerSession, headers: &[(&str, &str)]) {
    let written = async {
        let mut header = ResponseHeader::build(StatusCode::NO_CONTENT, Some(headers.len()))?;
        for (name, value) in headers {
            header.insert_header(name.to_string(), value.to_string())?;
        }
        session.write_response_header(Box::new(header)).await?;
        session.finish_body().await
    }
    .await;
    if let Err(e) = written {
        tracing::debug!(error = %e, "writing a response");
    }
}

/// A redirect to `location` on this server.
pub async fn write_redirect(session: &mut ServerSession, location: &str) {
    let headers = [("location", location)];
    write_complete(
        session,
        StatusCode::FOUND,
        "text/plain",
        Bytes::new(),
        &headers,
    )
    .await;
}

async fn write_complete(
    session: &mut ServerSession,
    status: StatusCode,
    content_type: &str,
    bytes: Bytes,
    extra_headers: &[(&str, &str)],
) {
    let written = async {
        let mut header = ResponseHeader::build(status, Some(3 + extra_headers.len()))?;
        header.insert_header("content-type", content_type)?;
        header.insert_header("content-length", bytes.len().to_string())?;
        for (name, value) in extra_headers {
            header.insert_header(name.to_string(), value.to_string())?;
        }
        crate::telemetry::with_trace_id(&mut header)?;
        session.write_response_header(Box::new(header)).await?;
        // A HEAD answer is the GET answer's head alone (its Content-Length included).
        let body = if session.req_header().method == http::Method::HEAD {
            Bytes::new()
        } else {
            bytes
        };
        session.write_response_body(body, true).await
    }
    .await;
    if let Err(e) = written {
        tracing::debug!(error = %e, "writing a response");
    }
}

pub async fn write_error(session: &mut ServerSession, error: &ApiError) {
    let retry_after = error.retry_after.map(|s| s.to_string());
    let extra: Vec<(&str, &str)> = retry_after
        .as_deref()
        .map(|s| ("retry-after", s))
        .into_iter()
        .chain(error.allow.map(|methods| ("allow", methods)))
        .collect();
    // Each API's errors in its own shape: Anthropic's on its routes, OpenAI's elsewhere.
    let body = if crate::wire::anthropic::owns(session.req_header().uri.path()) {
        crate::wire::anthropic::error_json(error.status, &error.message)
            .to_string()
            .into_bytes()
    } else {
        error.body()
    };
    write_complete(
        session,
        error.status,
        "application/json",
        Bytes::from(body),
        &extra,
    )
    .await;
}

/// A `text/event-stream` response: one `data:` event per call, chunked as it goes.
pub struct EventStream<'s> {
    session: &'s mut ServerSession,
}

impl<'s> EventStream<'s> {
    pub async fn start(session: &'s mut ServerSession) -> pingora::Result<EventStream<'s>> {
        Self::start_with(session, &[]).await
    }

    /// [`Self::start`] with `headers` besides.
    pub async fn start_with(
        session: &'s mut ServerSession,
        headers: &[(&str, &str)],
    ) -> pingora::Result<EventStream<'s>> {
        let mut header = ResponseHeader::build(StatusCode::OK, Some(4 + headers.len()))?;
        header.insert_header("content-type", "text/event-stream")?;
        header.insert_header("cache-control", "no-cache")?;
        header.insert_header("transfer-encoding", "chunked")?;
        for (name, value) in headers {
            header.insert_header(name.to_string(), value.to_string())?;
        }
        crate::telemetry::with_trace_id(&mut header)?;
        session.write_response_header(Box::new(header)).await?;
        Ok(EventStream { session })
    }

    /// `event: <name>\ndata: <json>\n\n` (the Responses API names its events).
    pub async fn send_event(&mut self, name: &str, data: &Value) -> pingora::Result<()> {
        let event = Bytes::from(format!("event: {name}\ndata: {data}\n\n"));
        self.session.write_response_body(event, false).await
    }

    /// `data: <json>\n\n`; an error means the client is gone.
    pub async fn send(&mut self, data: &Value) -> pingora::Result<()> {
        self.send_raw(&data.to_string()).await
    }

    pub async fn send_raw(&mut self, data: &str) -> pingora::Result<()> {
        let event = Bytes::from(format!("data: {data}\n\n"));
        self.session.write_response_body(event, false).await
    }

    pub async fn finish(self) -> pingora::Result<()> {
        self.session.finish_body().await
    }
}
