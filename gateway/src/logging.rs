//! Logging: `tracing` to stderr (command output on stdout stays machine-readable), with records of
//! libraries that log through `log` (pingora) bridged in — all but one kind.
//!
//! pingora logs every failed TLS handshake of a client at ERROR, one line each: a port scanner or
//! a client speaking plain HTTP to the TLS port floods the log with what is neither this
//! gateway's error nor actionable one by one. Those records become a WARN, at most one per
//! [`HANDSHAKE_REPORT_INTERVAL`], saying how many failed since the last one.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use tracing_log::LogTracer;
use tracing_subscriber::EnvFilter;

/// The most often a failed client handshake is reported.
pub const HANDSHAKE_REPORT_INTERVAL: Duration = Duration::from_secs(10);

/// The `log` target and message start of pingora's failed-handshake records.
const HANDSHAKE_TARGET: &str = "pingora_core::services::listening";
const HANDSHAKE_PREFIX: &str = "Downstream handshake";

/// How log lines are written.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// One line of text per record.
    #[default]
    Text,
    /// One JSON object per line: what log collectors parse without a pattern.
    Json,
}

/// Logs as `filter` and `format` say; the command-line tools log only.
pub fn init(filter: Option<&str>, format: LogFormat) {
    let _ = install(filter, format, false);
}

/// [`init`] for the server, with its traces sent where the environment says
/// ([`crate::telemetry`]); an error if the trace settings cannot be followed.
pub fn init_with_traces(filter: Option<&str>, format: LogFormat) -> anyhow::Result<()> {
    install(filter, format, true)
}

fn install(filter: Option<&str>, format: LogFormat, traces: bool) -> anyhow::Result<()> {
    use tracing_subscriber::Layer as _;
    use tracing_subscriber::filter::FilterExt as _;
    use tracing_subscriber::layer::SubscriberExt as _;

    let filter = match filter {
        Some(f) => EnvFilter::new(f),
        None => EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
    };
    // Colour only for a person at a terminal: a log file or a pipe gets plain text (NO_COLOR,
    // https://no-color.org, turns it off at a terminal too).
    let colour = std::io::IsTerminal::is_terminal(&std::io::stderr())
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    let lines = tracing_subscriber::fmt::layer()
        .with_ansi(colour)
        .with_writer(std::io::stderr);
    let lines = match format {
        LogFormat::Text => lines.boxed(),
        LogFormat::Json => lines.json().boxed(),
    };
    // The log's filter is the log's alone: spans are traced whatever the log level.
    let traced = match traces {
        true => crate::telemetry::layer()?
            .map(|layer| layer.with_filter(tracing_subscriber::filter::filter_fn(traced))),
        false => None,
    };
    // Log lines are events alone: the spans that make traces would prefix each with their fields.
    let events = tracing_subscriber::filter::filter_fn(|m| !m.is_span());
    let subscriber = tracing_subscriber::registry()
        .with(lines.with_filter(filter.and(events)))
        .with(traced);
    if tracing::subscriber::set_global_default(subscriber).is_err() {
        return Ok(()); // already set (a test harness)
    }
    if log::set_boxed_logger(Box::new(Bridge::default())).is_ok() {
        log::set_max_level(log::LevelFilter::Trace);
    }
    Ok(())
}

/// What a trace holds: this project's spans (the gateway's, the host's, the engine's), not the
/// libraries' nor any event.
fn traced(metadata: &tracing::Metadata<'_>) -> bool {
    metadata.is_span() && metadata.target().starts_with("mmgate")
}

/// `log` records into `tracing`, failed client handshakes rate-limited.
#[derive(Default)]
struct Bridge {
    tracer: LogTracer,
    handshakes: Mutex<HandshakeFailures>,
}

impl log::Log for Bridge {
    fn enabled(&self, metadata: &log::Metadata) -> bool {
        self.tracer.enabled(metadata)
    }

    fn log(&self, record: &log::Record) {
        if record.target() != HANDSHAKE_TARGET {
            return self.tracer.log(record);
        }
        let message = record.args().to_string();
        if !message.starts_with(HANDSHAKE_PREFIX) {
            return self.tracer.log(record);
        }
        let report = match self.handshakes.lock() {
            Ok(mut failures) => failures.failed(Instant::now()),
            Err(_) => Some(0),
        };
        if let Some(earlier) = report {
            tracing::warn!(
                failed_since_last_report = earlier,
                "client TLS handshake failed (reported at most every {}s): {message}",
                HANDSHAKE_REPORT_INTERVAL.as_secs()
            );
        }
    }

    fn flush(&self) {
        self.tracer.flush();
    }
}

/// Counts failed handshakes between reports.
#[derive(Default)]
struct HandshakeFailures {
    last_report: Option<Instant>,
    since: u64,
}

impl HandshakeFailures {
    /// A failure at `now`: `Some(n)` when it is to be reported (`n` more failed since the last
    /// report), `None` when it is only counted.
    fn failed(&mut self, now: Instant) -> Option<u64> {
        match self.last_report {
            Some(last) if now.duration_since(last) < HANDSHAKE_REPORT_INTERVAL => {
                self.since += 1;
                None
            }
            _ => {
                self.last_report = Some(now);
                Some(std::mem::take(&mut self.since))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_of_failed_handshakes_is_one_report_then_a_count() {
        let start = Instant::now();
        let mut failures = HandshakeFailures::default();
        assert_eq!(failures.failed(start), Some(0));
        for i in 1..=99 {
            assert_eq!(failures.failed(start + Duration::from_millis(i)), None);
        }
        let later = start + HANDSHAKE_REPORT_INTERVAL;
        assert_eq!(failures.failed(later), Some(99));
        assert_eq!(failures.failed(later + Duration::from_secs(1)), None);
        assert_eq!(
            failures.failed(later + HANDSHAKE_REPORT_INTERVAL * 2),
            Some(1)
        );
    }
}
