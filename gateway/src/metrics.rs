//! `GET /metrics` in the Prometheus text format. Counters and histograms are updated as requests
//! finish; gauges (queues, feature-store bytes, upstream health) are read from their owners at
//! scrape time, so they are never stale.

use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use crate::media::account::MediaAccount;
use crate::media::feature_cache::LookupCounters;
use http::StatusCode;
use mmgate_inference::engine::{BatchObserver, BatchReport};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    path: &'static str,
    route: &'static str,
    status: u16,
}

/// Routes' labels are fixed strings: counting a request allocates nothing.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PathLabels {
    path: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ModalityLabels {
    modality: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EncodeLabels {
    model: String,
    device: String,
    encoder: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModelLabels {
    pub model: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PluginLabels {
    pub plugin: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct UpstreamLabels {
    pub model: String,
    pub upstream: String,
}

/// A snapshot of one native model's queues and memory, taken at scrape time.
pub struct ModelGauges {
    pub model: String,
    pub running: usize,
    pub queued: usize,
    pub waiting_for_encoder: usize,
    pub kv_bytes: usize,
    pub feature_pinned_bytes: usize,
    pub feature_cached_bytes: usize,
    /// Pieces of items (made in their plugin's parts) not yet encoded.
    pub pieces_in_flight: usize,
    /// Items made in pieces whose pieces are all encoded, and the milliseconds from admission to
    /// their first and to their last piece ready, summed.
    pub pieced_items: u64,
    pub first_piece_ms: u64,
    pub last_piece_ms: u64,
}

/// Everything sampled at scrape time.
pub struct Snapshot {
    pub models: Vec<ModelGauges>,
    /// Encode jobs queued or running per model with encoder devices here: native models, and
    /// upstream ones whose images are encoded here.
    pub encoder_queues: Vec<(String, usize)>,
    pub upstreams: Vec<(String, String, bool)>,
    pub plugin_queue: usize,
    pub plugin_running: usize,
    /// Per plugin loaded now: its calls stopped by a deadline since it was loaded.
    pub plugin_deadlines: Vec<(String, u64)>,
    pub file_bytes: usize,
}

pub struct Metrics {
    registry: Mutex<Registry>,
    requests: Family<RequestLabels, Counter>,
    latency: Family<PathLabels, Histogram>,
    media_items: Family<ModalityLabels, Counter>,
    media_tokens: Family<ModalityLabels, Counter>,
    budget_cuts: Family<ModalityLabels, Counter>,
    plugin_seconds: Family<ModalityLabels, Histogram>,
    encode_seconds: Family<EncodeLabels, Histogram>,
    encoded_items: Family<EncodeLabels, Counter>,
    encode_failures: Family<EncodeLabels, Counter>,
    engine_running: Family<ModelLabels, Gauge>,
    engine_queued: Family<ModelLabels, Gauge>,
    waiting_for_encoder: Family<ModelLabels, Gauge>,
    encoder_queue: Family<ModelLabels, Gauge>,
    kv_bytes: Family<ModelLabels, Gauge>,
    feature_pinned: Family<ModelLabels, Gauge>,
    feature_cached: Family<ModelLabels, Gauge>,
    pieces_in_flight: Family<ModelLabels, Gauge>,
    pieced_items: Family<ModelLabels, Gauge>,
    first_piece_ms: Family<ModelLabels, Gauge>,
    last_piece_ms: Family<ModelLabels, Gauge>,
    upstream_healthy: Family<UpstreamLabels, Gauge>,
    plugin_queue: Gauge,
    plugin_running: Gauge,
    plugin_deadlines: Family<PluginLabels, Counter>,
    file_bytes: Gauge,
    shared_features: LookupCounters,
    /// The series of the passthrough lane's usual outcome (a chat completion relayed with a 200),
    /// looked up once: hashing the labels into the families on every request was a visible share
    /// of a relayed one's time.
    relayed_ok: OnceLock<(Counter, Histogram)>,
}

/// The path and route of [`Metrics::relayed_ok`].
const RELAYED: (&str, &str) = ("/v1/chat/completions", "upstream");

fn seconds_histogram() -> Histogram {
    // 1 ms .. ~65 s
    Histogram::new(exponential_buckets(0.001, 2.0, 17))
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("mmgate");
        let requests = Family::<RequestLabels, Counter>::default();
        let latency = Family::<PathLabels, Histogram>::new_with_constructor(
            seconds_histogram as fn() -> Histogram,
        );
        let media_items = Family::<ModalityLabels, Counter>::default();
        let media_tokens = Family::<ModalityLabels, Counter>::default();
        let budget_cuts = Family::<ModalityLabels, Counter>::default();
        let plugin_seconds = Family::<ModalityLabels, Histogram>::new_with_constructor(
            seconds_histogram as fn() -> Histogram,
        );
        registry.register(
            "requests",
            "HTTP requests by path, route (native, upstream, none) and status",
            requests.clone(),
        );
        registry.register(
            "request_duration_seconds",
            "Time from the request to the end of its response",
            latency.clone(),
        );
        registry.register(
            "media_items",
            "Media items run through their plugins",
            media_items.clone(),
        );
        registry.register(
            "media_tokens",
            "Tokens the plugins planned for media",
            media_tokens.clone(),
        );
        registry.register(
            "budget_cuts",
            "Media items reduced to fit the request's token budget",
            budget_cuts.clone(),
        );
        registry.register(
            "plugin_duration_seconds",
            "Probe + plan + preprocess time of one media item",
            plugin_seconds.clone(),
        );
        let encode_seconds = Family::<EncodeLabels, Histogram>::new_with_constructor(
            seconds_histogram as fn() -> Histogram,
        );
        let encoded_items = Family::<EncodeLabels, Counter>::default();
        let encode_failures = Family::<EncodeLabels, Counter>::default();
        registry.register(
            "encode_duration_seconds",
            "Time an encoder device spent on one batch, by model, device and encoder (vision, audio)",
            encode_seconds.clone(),
        );
        registry.register(
            "encoded_items",
            "Media items encoded (cache hits are not encoded again)",
            encoded_items.clone(),
        );
        registry.register(
            "encode_failures",
            "Media items whose encoding failed",
            encode_failures.clone(),
        );
        let gauges = [
            ("engine_running", "Sequences in the engine's batch"),
            ("engine_queued", "Requests waiting for a place in the batch"),
            (
                "engine_waiting_for_encoder",
                "Running requests whose media are still encoding",
            ),
            (
                "encoder_queue",
                "Encode jobs queued or running on the model's encoder devices",
            ),
            ("kv_cache_bytes", "Bytes of live KV caches"),
            (
                "feature_store_pinned_bytes",
                "Encoder outputs in use by requests",
            ),
            (
                "feature_store_cached_bytes",
                "Encoder outputs kept for reuse",
            ),
            (
                "engine_pieces_in_flight",
                "Pieces of media items (made in their plugin's parts) still encoding",
            ),
            (
                "engine_pieced_items",
                "Media items made in pieces whose pieces are all encoded, since start",
            ),
            (
                "engine_first_piece_ms_sum",
                "Milliseconds from admission to an item's first piece encoded, summed over engine_pieced_items",
            ),
            (
                "engine_last_piece_ms_sum",
                "Milliseconds from admission to an item's last piece encoded, summed over engine_pieced_items",
            ),
        ];
        let families: Vec<Family<ModelLabels, Gauge>> = gauges
            .iter()
            .map(|(name, help)| {
                let family = Family::<ModelLabels, Gauge>::default();
                registry.register(*name, *help, family.clone());
                family
            })
            .collect();
        let upstream_healthy = Family::<UpstreamLabels, Gauge>::default();
        registry.register(
            "upstream_healthy",
            "1 when the upstream server is in rotation",
            upstream_healthy.clone(),
        );
        let plugin_queue = Gauge::default();
        registry.register(
            "plugin_queue",
            "Plugin calls waiting for a worker",
            plugin_queue.clone(),
        );
        let plugin_running = Gauge::default();
        registry.register(
            "plugin_running",
            "Plugin calls running on a worker",
            plugin_running.clone(),
        );
        let plugin_deadlines = Family::<PluginLabels, Counter>::default();
        registry.register(
            "plugin_deadlines",
            "Plugin calls stopped by their deadline (a stuck plugin, or a server too busy)",
            plugin_deadlines.clone(),
        );
        let file_bytes = Gauge::default();
        registry.register(
            "file_store_bytes",
            "Bytes of uploaded files",
            file_bytes.clone(),
        );
        let shared_features = LookupCounters::default();
        registry.register(
            "shared_feature_cache_lookups",
            "Lookups in the feature cache replicas share, by outcome (hit, miss, error)",
            shared_features.family(),
        );
        let mut families = families.into_iter();
        let mut next = || families.next().unwrap_or_default();
        Metrics {
            requests,
            latency,
            media_items,
            media_tokens,
            budget_cuts,
            plugin_seconds,
            encode_seconds,
            encoded_items,
            encode_failures,
            engine_running: next(),
            engine_queued: next(),
            waiting_for_encoder: next(),
            encoder_queue: next(),
            kv_bytes: next(),
            feature_pinned: next(),
            feature_cached: next(),
            pieces_in_flight: next(),
            pieced_items: next(),
            first_piece_ms: next(),
            last_piece_ms: next(),
            upstream_healthy,
            plugin_queue,
            plugin_running,
            plugin_deadlines,
            file_bytes,
            shared_features,
            relayed_ok: OnceLock::new(),
            registry: Mutex::new(registry),
        }
    }

    pub fn request_done(
        &self,
        path: &'static str,
        route: &'static str,
        status: StatusCode,
        took: Duration,
    ) {
        let labels = RequestLabels {
            path,
            route,
            status: status.as_u16(),
        };
        if (path, route) == RELAYED && status == StatusCode::OK {
            let (count, latency) = self.relayed_ok.get_or_init(|| {
                (
                    self.requests.get_or_create(&labels).clone(),
                    self.latency.get_or_create(&PathLabels { path }).clone(),
                )
            });
            count.inc();
            latency.observe(took.as_secs_f64());
            return;
        }
        self.requests.get_or_create(&labels).inc();
        self.latency
            .get_or_create(&PathLabels { path })
            .observe(took.as_secs_f64());
    }

    /// One request's media accounts (`usage.media` entries).
    pub fn media_prepared(&self, media: &[MediaAccount]) {
        for item in media {
            let modality = ModalityLabels {
                modality: item.kind.name().to_owned(),
            };
            self.media_items.get_or_create(&modality).inc();
            self.media_tokens
                .get_or_create(&modality)
                .inc_by(item.tokens as u64);
            if item.reduced {
                self.budget_cuts.get_or_create(&modality).inc();
            }
            if let Some(ms) = item.plugin_ms {
                self.plugin_seconds
                    .get_or_create(&modality)
                    .observe(ms / 1e3);
            }
        }
    }

    /// What the shared feature cache counts its lookups in.
    pub fn shared_feature_lookups(&self) -> LookupCounters {
        self.shared_features.clone()
    }

    /// What `model`'s encoder pool reports each batch to (called on the encoder devices' threads).
    pub fn encode_observer(&self, model: &str) -> BatchObserver {
        let (seconds, items, failures) = (
            self.encode_seconds.clone(),
            self.encoded_items.clone(),
            self.encode_failures.clone(),
        );
        let model = model.to_owned();
        Arc::new(move |batch: &BatchReport<'_>| {
            let labels = EncodeLabels {
                model: model.clone(),
                device: batch.device.to_owned(),
                encoder: batch.kind.name().to_owned(),
            };
            seconds
                .get_or_create(&labels)
                .observe(batch.took.as_secs_f64());
            items.get_or_create(&labels).inc_by(batch.items as u64);
            failures.get_or_create(&labels).inc_by(batch.failed as u64);
        })
    }

    /// The text exposition, gauges set from `snapshot` first.
    pub fn render(&self, snapshot: Snapshot) -> String {
        for m in &snapshot.models {
            let labels = ModelLabels {
                model: m.model.clone(),
            };
            let set = |family: &Family<ModelLabels, Gauge>, value: usize| {
                family
                    .get_or_create(&labels)
                    .set(i64::try_from(value).unwrap_or(i64::MAX));
            };
            set(&self.engine_running, m.running);
            set(&self.engine_queued, m.queued);
            set(&self.waiting_for_encoder, m.waiting_for_encoder);
            set(&self.kv_bytes, m.kv_bytes);
            set(&self.feature_pinned, m.feature_pinned_bytes);
            set(&self.feature_cached, m.feature_cached_bytes);
            set(&self.pieces_in_flight, m.pieces_in_flight);
            let set64 = |family: &Family<ModelLabels, Gauge>, value: u64| {
                family
                    .get_or_create(&labels)
                    .set(i64::try_from(value).unwrap_or(i64::MAX));
            };
            set64(&self.pieced_items, m.pieced_items);
            set64(&self.first_piece_ms, m.first_piece_ms);
            set64(&self.last_piece_ms, m.last_piece_ms);
        }
        for (model, queued) in snapshot.encoder_queues {
            self.encoder_queue
                .get_or_create(&ModelLabels { model })
                .set(i64::try_from(queued).unwrap_or(i64::MAX));
        }
        for (model, upstream, healthy) in snapshot.upstreams {
            self.upstream_healthy
                .get_or_create(&UpstreamLabels { model, upstream })
                .set(i64::from(healthy));
        }
        self.plugin_queue
            .set(i64::try_from(snapshot.plugin_queue).unwrap_or(i64::MAX));
        self.plugin_running
            .set(i64::try_from(snapshot.plugin_running).unwrap_or(i64::MAX));
        for (plugin, passed) in snapshot.plugin_deadlines {
            // The plugin counts its own; a reloaded plugin starts again from 0, and the counter
            // moves on only once it is past what it showed.
            let counter = self
                .plugin_deadlines
                .get_or_create(&PluginLabels { plugin });
            let shown = counter.get();
            if passed > shown {
                counter.inc_by(passed - shown);
            }
        }
        self.file_bytes
            .set(i64::try_from(snapshot.file_bytes).unwrap_or(i64::MAX));
        let mut text = String::new();
        let registry = self
            .registry
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Err(e) = prometheus_client::encoding::text::encode(&mut text, &registry) {
            tracing::error!(error = %e, "encoding metrics");
        }
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn empty() -> Snapshot {
        Snapshot {
            models: Vec::new(),
            encoder_queues: Vec::new(),
            upstreams: Vec::new(),
            plugin_queue: 0,
            plugin_running: 0,
            plugin_deadlines: Vec::new(),
            file_bytes: 0,
        }
    }

    /// The relayed-200 series kept aside is the families' own: it counts with the requests of the
    /// same labels made otherwise, beside the other outcomes and routes.
    #[test]
    fn relayed_answers_count_in_the_same_series_as_any_other() {
        let metrics = Metrics::new();
        let chat = "/v1/chat/completions";
        for _ in 0..3 {
            metrics.request_done(chat, "upstream", StatusCode::OK, Duration::from_millis(2));
        }
        metrics.request_done(chat, "upstream", StatusCode::BAD_GATEWAY, Duration::ZERO);
        metrics.request_done(chat, "native", StatusCode::OK, Duration::ZERO);
        let text = metrics.render(empty());
        let line = |labels: &str| {
            text.lines()
                .find(|l| l.starts_with(&format!("mmgate_requests_total{{{labels}}}")))
                .map(|l| l.rsplit(' ').next().unwrap_or_default().to_owned())
        };
        let ok = r#"path="/v1/chat/completions",route="upstream",status="200""#;
        assert_eq!(line(ok).as_deref(), Some("3"));
        let bad = r#"path="/v1/chat/completions",route="upstream",status="502""#;
        assert_eq!(line(bad).as_deref(), Some("1"));
        let native = r#"path="/v1/chat/completions",route="native",status="200""#;
        assert_eq!(line(native).as_deref(), Some("1"));
        assert!(
            text.contains(
                r#"mmgate_request_duration_seconds_count{path="/v1/chat/completions"} 5"#
            ),
            "{text}"
        );
    }
}
