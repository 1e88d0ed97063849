//! Traces: one OpenTelemetry trace per request, exported over OTLP, configured the standard way
//! (`OTEL_EXPORTER_OTLP_ENDPOINT` or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, `..._PROTOCOL`,
//! `OTEL_SERVICE_NAME`, `OTEL_TRACES_SAMPLER` and its argument, `OTEL_BSP_*`) and off when no
//! endpoint is set. The gateway's `tracing` spans are the trace's spans (`tracing-opentelemetry`);
//! they are batched and sent from a thread of their own, so a collector that is down or slow
//! costs a request nothing but dropped spans. An incoming W3C `traceparent` is continued, and
//! the request's context goes to upstream engines in the same header.

use std::sync::OnceLock;

use anyhow::{Context, bail};
use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::{TraceContextExt, TracerProvider as _};
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// The provider, kept for the life of the process (dropping it stops the export).
static PROVIDER: OnceLock<SdkTracerProvider> = OnceLock::new();

/// Whether traces are configured: an OTLP endpoint is set and the SDK is not disabled.
pub fn configured() -> bool {
    let set = |name| std::env::var(name).is_ok_and(|v| !v.trim().is_empty());
    let disabled = std::env::var("OTEL_SDK_DISABLED").is_ok_and(|v| v.eq_ignore_ascii_case("true"))
        || std::env::var("OTEL_TRACES_EXPORTER").is_ok_and(|v| v == "none");
    !disabled && (set("OTEL_EXPORTER_OTLP_ENDPOINT") || set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
}

/// The OTLP protocol the environment asks for: HTTP with protobuf (the default) or JSON.
fn protocol() -> anyhow::Result<Protocol> {
    let asked = std::env::var("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        .or_else(|_| std::env::var("OTEL_EXPORTER_OTLP_PROTOCOL"))
        .unwrap_or_else(|_| "http/protobuf".to_owned());
    match asked.as_str() {
        "http/protobuf" => Ok(Protocol::HttpBinary),
        "http/json" => Ok(Protocol::HttpJson),
        other => bail!(
            "OTEL_EXPORTER_OTLP_PROTOCOL={other:?}: mmgate sends traces over http/protobuf or \
             http/json (an OpenTelemetry Collector, Jaeger and Tempo take both on port 4318)"
        ),
    }
}

/// The layer that makes `tracing` spans OpenTelemetry spans, when traces are configured.
pub fn layer<S>() -> anyhow::Result<
    Option<tracing_opentelemetry::OpenTelemetryLayer<S, opentelemetry_sdk::trace::Tracer>>,
>
where
    S: tracing::Subscriber + for<'span> tracing_subscriber::registry::LookupSpan<'span>,
{
    if !configured() {
        return Ok(None);
    }
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(protocol()?)
        .build()
        .context("the OTLP trace exporter")?;
    let mut resource = Resource::builder();
    if std::env::var_os("OTEL_SERVICE_NAME").is_none() {
        resource = resource.with_service_name("mmgate");
    }
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource.build())
        .build();
    let tracer = provider.tracer("mmgate");
    let _ = PROVIDER.set(provider);
    Ok(Some(tracing_opentelemetry::layer().with_tracer(tracer)))
}

/// Sends what is batched (at exit).
pub fn flush() {
    if let Some(provider) = PROVIDER.get() {
        let _ = provider.force_flush();
    }
}

/// Makes `span` continue the trace of an incoming `traceparent` (and `tracestate`), if any.
pub fn continue_trace(span: &tracing::Span, headers: &http::HeaderMap) {
    if PROVIDER.get().is_none() {
        return;
    }
    // The SDK's parser pads a short trace id with zeros (`00-4bf9-00f0-01` became trace
    // `000…4bf9`); W3C says a malformed header is ignored and a new trace started.
    let valid = headers
        .get("traceparent")
        .and_then(|v| v.to_str().ok())
        .is_some_and(valid_traceparent);
    if !valid {
        return;
    }
    let context = TraceContextPropagator::new().extract(&HeaderExtractor(headers));
    if context.span().span_context().is_valid() {
        let _ = span.set_parent(context);
    }
}

/// Whether `value` is a `traceparent` as W3C Trace Context writes it: `version-traceid-parentid-flags`
/// in lowercase hex of 2, 32, 16 and 2 digits, neither id all zeros, version `ff` never; a later
/// version may append fields after the flags (`-...`), version 00 may not.
pub fn valid_traceparent(value: &str) -> bool {
    let hex = |s: &str, len: usize| {
        s.len() == len
            && s.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    let mut fields = value.trim().splitn(5, '-');
    let (Some(version), Some(trace), Some(parent), Some(flags)) =
        (fields.next(), fields.next(), fields.next(), fields.next())
    else {
        return false;
    };
    let rest = fields.next();
    hex(version, 2)
        && version != "ff"
        && (version != "00" || rest.is_none())
        && hex(trace, 32)
        && trace.bytes().any(|b| b != b'0')
        && hex(parent, 16)
        && parent.bytes().any(|b| b != b'0')
        && hex(flags, 2)
}

/// The current span's trace id (32 hex digits), when it is being traced.
pub fn trace_id() -> Option<String> {
    PROVIDER.get()?;
    let context = tracing::Span::current().context();
    let span = context.span();
    let span_context = span.span_context();
    span_context
        .is_valid()
        .then(|| span_context.trace_id().to_string())
}

/// The header that names the request's trace, so that a user's complaint finds it.
pub const TRACE_ID_HEADER: &str = "x-mmgate-trace-id";

/// Adds [`TRACE_ID_HEADER`] to a response when its request is traced.
pub fn with_trace_id(header: &mut pingora::http::ResponseHeader) -> pingora::Result<()> {
    if let Some(id) = trace_id() {
        header.insert_header(TRACE_ID_HEADER, id)?;
    }
    Ok(())
}

/// The W3C `traceparent` (and `tracestate`) headers that carry the current span to an upstream.
pub fn propagation_headers() -> Vec<(String, String)> {
    if PROVIDER.get().is_none() {
        return Vec::new();
    }
    let mut headers = HeaderInjector(Vec::new());
    TraceContextPropagator::new().inject_context(&tracing::Span::current().context(), &mut headers);
    headers.0
}

struct HeaderExtractor<'h>(&'h http::HeaderMap);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(http::HeaderName::as_str).collect()
    }
}

struct HeaderInjector(Vec<(String, String)>);

impl Injector for HeaderInjector {
    fn set(&mut self, key: &str, value: String) {
        self.0.push((key.to_owned(), value));
    }
}

#[cfg(test)]
mod tests {
    use super::valid_traceparent;

    #[test]
    fn only_well_formed_traceparents_are_continued() {
        let good = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        assert!(valid_traceparent(good));
        assert!(valid_traceparent(
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00-x"
        ));
        for bad in [
            "00-4bf9-00f0-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "",
        ] {
            assert!(!valid_traceparent(bad), "{bad}");
        }
    }
}
