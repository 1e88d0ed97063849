//! The access log: one line per request at INFO, target `mmgate::access`, when its answer is done.
//! It says who sent what and how it ended (method, route, model, status, error code, latency,
//! tokens, client address, the API key's id), so an operator can see every refusal and why; it
//! never holds a prompt, media or a key's secret (the key's id is the hash the per-key limits
//! use); a server-side failure's message goes in `detail`. `RUST_LOG=mmgate::access=off` (or
//! `--log`) turns it off; `--log-format json` makes each line a JSON object.

use std::net::IpAddr;
use std::time::Instant;

use http::StatusCode;

use crate::error::ApiError;

/// Target of the access log's records.
pub const TARGET: &str = "mmgate::access";

/// The status logged (and counted) for a request whose client left before its answer was whole:
/// nginx's 499, which no client ever receives. Its line's code is `client_closed`.
pub const CLIENT_CLOSED: StatusCode = match StatusCode::from_u16(499) {
    Ok(status) => status,
    Err(_) => StatusCode::BAD_REQUEST,
};

/// The code logged for an answer that began and then broke off because its upstream failed: its
/// status (logged as sent) was already on its way.
pub const UPSTREAM_FAILED_MID_ANSWER: &str = "upstream_failed_mid_answer";

/// Tokens a request's answer reported.
#[derive(Debug, Clone, Copy, Default)]
pub struct Tokens {
    pub prompt: u64,
    pub completion: u64,
    pub media: u64,
}

impl Tokens {
    /// The counts of an OpenAI `usage` object (its `media` accounts' tokens summed).
    pub fn of_usage(usage: &serde_json::Value) -> Tokens {
        let count = |name: &str| usage[name].as_u64().unwrap_or(0);
        let media = usage["media"].as_array().map_or(0, |items| {
            items.iter().filter_map(|m| m["tokens"].as_u64()).sum()
        });
        Tokens {
            prompt: count("prompt_tokens"),
            completion: count("completion_tokens"),
            media,
        }
    }
}

/// What is known of one request so far; [`Access::log`] writes its line.
#[derive(Debug)]
pub struct Access {
    started: Instant,
    method: String,
    client: Option<IpAddr>,
    /// The caller's id (`public` on a gateway without keys); unknown before authentication.
    pub key: Option<String>,
    pub model: Option<String>,
    pub tokens: Option<Tokens>,
    /// What a server-side failure was (which plugin call ran past its deadline, how long, ...):
    /// ours to say, where a client error's message may repeat what the client sent.
    detail: Option<String>,
    /// Why an answer that began broke off, when it did.
    broke_off: Option<&'static str>,
}

impl Access {
    pub fn start(method: &str, client: Option<IpAddr>) -> Access {
        Access {
            started: Instant::now(),
            method: method.to_owned(),
            client,
            key: None,
            model: None,
            tokens: None,
            detail: None,
            broke_off: None,
        }
    }

    /// The answer began with its status and then broke off (`code`: why): the line says so.
    pub fn broke_off(&mut self, code: &'static str) {
        self.broke_off = Some(code);
    }

    /// Keeps a 5xx error's message for the line.
    pub fn failed_with(&mut self, error: &ApiError) {
        if error.status.is_server_error() {
            self.detail = Some(error.message.clone());
        }
    }

    /// Writes the request's line: `path` and `route` as the metrics label them (never the
    /// client's own path, which may hold anything), and the error's code when it failed.
    pub fn log(&self, path: &str, route: &str, status: StatusCode, code: Option<&str>) {
        let code = code
            .or(self.broke_off)
            .or((status == CLIENT_CLOSED).then_some("client_closed"));
        let latency_ms = (self.started.elapsed().as_secs_f64() * 1e4).round() / 10.0;
        let tokens = self.tokens.unwrap_or_default();
        let client = self.client.map(|ip| ip.to_string());
        let span = tracing::Span::current();
        span.record("http.response.status_code", i64::from(status.as_u16()));
        span.record("mmgate.route", route);
        if let Some(model) = &self.model {
            span.record("gen_ai.request.model", model.as_str());
        }
        span.record("gen_ai.usage.input_tokens", as_attribute(tokens.prompt));
        span.record(
            "gen_ai.usage.output_tokens",
            as_attribute(tokens.completion),
        );
        span.record("mmgate.media_tokens", as_attribute(tokens.media));
        if status.is_server_error() {
            span.record("otel.status_code", "ERROR");
        }
        let trace_id = crate::telemetry::trace_id();
        tracing::info!(
            target: TARGET,
            method = %self.method,
            path,
            route,
            model = self.model.as_deref().unwrap_or("-"),
            status = status.as_u16(),
            code = code.unwrap_or("-"),
            latency_ms,
            prompt_tokens = tokens.prompt,
            completion_tokens = tokens.completion,
            media_tokens = tokens.media,
            client = client.as_deref().unwrap_or("-"),
            key = self.key.as_deref().unwrap_or("-"),
            detail = self.detail.as_deref().unwrap_or("-"),
            trace_id = trace_id.as_deref().unwrap_or("-"),
            "request"
        );
    }
}

/// A count as a trace attribute: OpenTelemetry's integers are signed (an unsigned one would go
/// as text).
pub fn as_attribute(count: impl TryInto<i64>) -> i64 {
    count.try_into().unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_come_from_usage_with_the_media_summed() {
        let usage = serde_json::json!({
            "prompt_tokens": 120, "completion_tokens": 7, "total_tokens": 127,
            "media": [{"kind": "image", "tokens": 22}, {"kind": "video", "tokens": 64}],
        });
        let tokens = Tokens::of_usage(&usage);
        assert_eq!(
            (tokens.prompt, tokens.completion, tokens.media),
            (120, 7, 86)
        );
        let none = Tokens::of_usage(&serde_json::Value::Null);
        assert_eq!((none.prompt, none.media), (0, 0));
    }
}
