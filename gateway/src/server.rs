//! Starting the gateway: plugins, models (native engines or upstream pools with their health
//! checks), and the HTTP API on pingora.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use mmgate_host::PluginPool;
use std::sync::atomic::AtomicUsize;
use std::time::Duration;

use pingora::server::configuration::ServerConf;
use pingora::server::{RunArgs, Server, ShutdownSignal, ShutdownSignalWatch};
use pingora::services::ServiceWithDependents;
use pingora::services::listening::Service as ListeningService;

use crate::api::{App, EcMedia, Gateway, Route, UpstreamMedia};
use crate::config::{Config, MediaMode, ModelConfig};
use crate::draining::Draining;
use crate::ec_store::EcStore;
use crate::keylimits::KeyLimits;
use crate::media::feature_cache::RedisFeatures;
use crate::media::fetch::Fetcher;
use crate::media::files::FileStore;
use crate::media::plugins::LivePlugins;
use crate::metrics::Metrics;
use crate::model::LocalModel;
use crate::model::{
    Devices, ModelRuntime, RuntimeOptions, default_cache_dir, resolve_model_dir,
    weights_fingerprint,
};
use crate::responses_store::ResponseStore;
use crate::store::{Redis, StoreKind};
use crate::upstream::UpstreamPool;
use mmgate_inference::devices::{DeviceName, Placement};
use mmgate_inference::engine::SharedFeatures;
use mmgate_inference::prompt::PromptModel;

/// Loads a model onto its devices, its encoders reporting to `metrics`: all of it when it is served
/// here, only its encoders when its LLM runs upstream.
fn load_model(
    model: &ModelConfig,
    spec: &Path,
    metrics: &Metrics,
    shared_features: Option<Arc<dyn SharedFeatures>>,
    encoders_only: bool,
) -> anyhow::Result<LocalModel> {
    let dir = resolve_model_dir(spec, &default_cache_dir())?;
    let mut devices = Devices::for_this_machine();
    match (model.llm_device, model.llm_threads) {
        (Some(DeviceName::Cuda(ordinal)), _) => devices.llm = Placement::Cuda { ordinal },
        (_, Some(threads)) => devices.llm = Placement::Cpu { threads },
        _ => {}
    }
    if !model.encoder_devices.is_empty() {
        devices.encoders = model
            .encoder_devices
            .iter()
            .map(|d| Placement::new(d.device, d.threads))
            .collect::<Result<_, _>>()?;
    }
    devices.cpu_bf16_inputs = model.cpu_bf16_inputs;
    let options = RuntimeOptions {
        devices,
        max_running: model.max_running,
        prefill_chunk: model.prefill_chunk,
        feature_cache_bytes: model.feature_cache_bytes,
        max_model_len: model.max_model_len,
        shared_features,
    };
    let observer = metrics.encode_observer(&model.name);
    let load = if encoders_only {
        ModelRuntime::load_encoders
    } else {
        ModelRuntime::load
    };
    let runtime = load(&model.name, &dir, &options, Some(observer))
        .with_context(|| format!("model {}: loading {}", model.name, dir.display()))?;
    Ok(LocalModel {
        runtime,
        on_encode_error: model.on_encode_error,
        accept_image_embeds: model.accept_image_embeds,
        media_parts: model.media_parts,
    })
}

/// Each client connection holds a descriptor, and one more to its upstream when it is relayed: the
/// soft limit on open files (often 1 024) is raised towards what `connections.max` needs, up to
/// the hard limit, as nginx's `worker_rlimit_nofile` and Go's runtime do. Below it, connections
/// past the limit would fail to be accepted rather than get their 503.
fn raise_open_files_limit(max_connections: usize) {
    let wanted = (max_connections as u64)
        .saturating_mul(2)
        .saturating_add(256);
    match rlimit::increase_nofile_limit(wanted) {
        Ok(limit) if limit < wanted => tracing::warn!(
            limit,
            wanted,
            "the hard limit on open files is below what connections.max needs"
        ),
        Ok(_) => {}
        Err(e) => tracing::warn!(error = %e, "cannot raise the limit on open files"),
    }
}

pub fn serve(config: Config) -> anyhow::Result<()> {
    raise_open_files_limit(config.connections.max);
    let sandbox = crate::media::plugins::sandbox(config.sandbox.clone(), &config.plugins)?;
    let plugins = Arc::new(LivePlugins::load(sandbox, config.plugin_dir.as_deref())?);
    let reload = plugins.watch()?;
    let pool = PluginPool::new(
        config.plugins.threads(),
        config.plugins.queue(),
        config.plugins.nice(),
    )
    .context("starting the plugin pool")?;

    let metrics = Metrics::new();
    let redis = match config.store.kind {
        StoreKind::Memory => None,
        StoreKind::Redis => Some(Arc::new(Redis::connect(&config.store)?)),
    };
    let shared_features = redis
        .as_ref()
        .filter(|_| config.store.feature_ttl_seconds > 0)
        .map(|redis| {
            Arc::new(RedisFeatures::new(
                redis.clone(),
                config.store.feature_ttl_seconds,
                config.store.max_feature_entry_bytes,
                metrics.shared_feature_lookups(),
            )) as Arc<dyn SharedFeatures>
        });
    let mut models = BTreeMap::new();
    let mut background: Vec<Box<dyn ServiceWithDependents>> = Vec::new();
    for model in &config.models {
        let route = match (&model.path, model.media_mode()) {
            (Some(path), None) => Route::Native(load_model(
                model,
                path,
                &metrics,
                shared_features.clone(),
                false,
            )?),
            (path, mode) => {
                let (pool, health_checks) =
                    UpstreamPool::build(model, !config.api_keys.is_empty())?;
                background.push(health_checks);
                // The config's checks leave a path wherever the mode needs one.
                // The prompt side of the model's server, for what is planned here.
                let planned = |path: &std::path::Path| -> anyhow::Result<PromptModel> {
                    let dir = resolve_model_dir(path, &default_cache_dir())?;
                    PromptModel::load(&model.name, &dir, model.max_model_len)
                        .and_then(|m| m.for_server_processor(&model.processor_kwargs))
                        .with_context(|| format!("model {}: reading {}", model.name, dir.display()))
                };
                let media = match (mode, path) {
                    (Some(MediaMode::Embed), Some(path)) => UpstreamMedia::Embed {
                        model: load_model(model, path, &metrics, shared_features.clone(), true)?,
                        planned: planned(path)?,
                    },
                    (Some(MediaMode::Ec), Some(path)) => {
                        // Whole items: vLLM takes one item per video, not its runs of frames.
                        let mut whole = model.clone();
                        whole.media_parts = false;
                        let native =
                            load_model(&whole, path, &metrics, shared_features.clone(), true)?;
                        let dir = resolve_model_dir(path, &default_cache_dir())?;
                        let storage = model.ec_storage.as_deref().unwrap_or(Path::new("."));
                        let store = EcStore::open(storage, model.ec_storage_bytes)
                            .with_context(|| format!("model {}: ec_storage", model.name))?;
                        UpstreamMedia::Ec {
                            ec: EcMedia::new(
                                native,
                                store,
                                model.ec_dtype,
                                &dir,
                                weights_fingerprint(&dir)?,
                            )
                            .with_context(|| {
                                format!("model {}: reading {}", model.name, dir.display())
                            })?,
                            planned: planned(path)?,
                        }
                    }
                    (Some(MediaMode::Preprocess), Some(path)) => {
                        UpstreamMedia::Preprocess(planned(path)?)
                    }
                    _ => UpstreamMedia::Forward,
                };
                Route::Upstream { pool, media }
            }
        };
        models.insert(model.name.clone(), route);
    }
    let files = match &redis {
        Some(redis) => FileStore::in_redis(config.files.clone(), redis.clone()),
        None => FileStore::in_memory(config.files.clone()),
    };
    let responses = match &redis {
        Some(redis) => ResponseStore::in_redis(config.store.response_ttl_seconds, redis.clone()),
        None => ResponseStore::in_memory(config.store.response_ttl_seconds),
    };
    let key_limits = match &redis {
        Some(redis) => KeyLimits::in_redis(config.key_limits.clone(), redis.clone()),
        None => KeyLimits::in_memory(config.key_limits.clone()),
    };
    let draining = Draining::default();
    let gateway = Gateway {
        plugins,
        pool: Arc::new(pool),
        models,
        files,
        responses,
        fetcher: Fetcher::new(config.fetch.clone())?,
        limits: config.limits.clone(),
        documents: config.documents.clone(),
        connections: config.connections.clone(),
        open_connections: AtomicUsize::new(0),
        api_keys: config.api_keys.clone(),
        trusted_proxies: config.trusted_proxies.clone(),
        https: config.tls.is_some(),
        metrics,
        redis,
        key_limits,
        draining: draining.clone(),
        _reload: reload,
    };
    tracing::info!(
        listen = %config.listen,
        tls = config.tls.is_some(),
        plugins = gateway.plugins.registry().len(),
        models = ?gateway.models.keys().collect::<Vec<_>>(),
        "mmgate is serving"
    );

    let mut conf = ServerConf::new().context("creating the pingora configuration")?;
    conf.threads = config.http_threads.unwrap_or_else(crate::config::cores);
    conf.work_stealing = config.http_work_stealing;
    // On SIGTERM pingora keeps serving for a grace period meant for handing listeners to an upgraded
    // process (5 minutes by default); mmgate does not upgrade in place, so in-flight requests get
    // `shutdown_grace_seconds` to finish and then it exits. SIGINT stops at once.
    conf.grace_period_seconds = Some(config.shutdown_grace_seconds);
    conf.graceful_shutdown_timeout_seconds = Some(1);
    let mut server = Server::new_with_opt_and_conf(None, conf);
    server.bootstrap();
    let mut service = ListeningService::new("mmgate http".to_owned(), App(Arc::new(gateway)));
    match &config.tls {
        Some(tls) => {
            let path = |p: &std::path::Path| {
                p.to_str()
                    .map(str::to_owned)
                    .with_context(|| format!("{} is not a UTF-8 path", p.display()))
            };
            service
                .add_tls(
                    &config.listen.to_string(),
                    &path(&tls.cert)?,
                    &path(&tls.key)?,
                )
                .map_err(|e| anyhow::anyhow!("{e}"))
                .context("serving TLS")?;
        }
        None => service.add_tcp(&config.listen.to_string()),
    }
    server.add_service(service);
    for service in background {
        server.add_boxed_service(service);
    }
    server.run(RunArgs {
        shutdown_signal: Box::new(DrainOnTerm {
            draining,
            drain: Duration::from_secs(config.drain_seconds),
        }),
    });
    crate::telemetry::flush();
    Ok(())
}

/// Shutdown as a load balancer needs it. On SIGTERM `/ready` answers 503 at once while requests
/// are still accepted for `drain` (so that the balancer, polling `/ready`, stops sending traffic
/// before connections would be refused); then the listener closes and requests in flight get
/// `shutdown_grace_seconds` to finish. SIGINT stops at once.
struct DrainOnTerm {
    draining: Draining,
    drain: Duration,
}

#[async_trait::async_trait]
impl ShutdownSignalWatch for DrainOnTerm {
    async fn recv(&self) -> ShutdownSignal {
        use tokio::signal::unix::{SignalKind, signal};
        let (Ok(mut term), Ok(mut int)) = (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) else {
            tracing::error!("cannot watch for SIGTERM and SIGINT; stop this process with SIGKILL");
            return std::future::pending().await;
        };
        tokio::select! {
            _ = term.recv() => {
                self.draining.begin();
                tracing::info!(
                    drain_seconds = self.drain.as_secs(),
                    "SIGTERM: draining (/ready answers 503), then closing the listener"
                );
                tokio::time::sleep(self.drain).await;
                ShutdownSignal::GracefulTerminate
            }
            _ = int.recv() => ShutdownSignal::FastShutdown,
        }
    }
}
