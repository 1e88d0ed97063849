//! The HTTP service on pingora. So far: health and the plugin inventory; the OpenAI chat API builds
//! on this service.

use std::sync::Arc;

use anyhow::Context;
use async_trait::async_trait;
use http::{Response, StatusCode};
use mmgate_host::{CONTRACT_VERSION, PluginRegistry, Sandbox};
use pingora::apps::http_app::{HttpServer, ServeHttp};
use pingora::protocols::http::ServerSession;
use pingora::server::Server;
use pingora::services::listening::Service;
use serde_json::json;

use crate::config::Config;
use crate::error::ApiError;

/// What every request handler shares.
pub struct Gateway {
    registry: PluginRegistry,
}

impl Gateway {
    pub fn new(config: &Config) -> anyhow::Result<Gateway> {
        let sandbox = Arc::new(Sandbox::new(config.sandbox.clone())?);
        let registry = match &config.plugin_dir {
            Some(dir) => PluginRegistry::with_dir(&sandbox, dir),
            None => PluginRegistry::builtin(&sandbox),
        }
        .context("loading plugins")?;
        Ok(Gateway { registry })
    }

    fn plugins_json(&self) -> serde_json::Value {
        let plugins: Vec<_> = self
            .registry
            .iter()
            .map(|p| {
                let d = p.descriptor();
                json!({
                    "name": d.name,
                    "version": d.version,
                    "contract_version": p.contract_version().to_string(),
                    "modalities": d.modalities,
                    "mime_types": d.mime_types,
                    "origin": p.origin().to_string(),
                })
            })
            .collect();
        json!({ "object": "list", "host_contract_version": CONTRACT_VERSION.to_string(), "data": plugins })
    }
}

#[async_trait]
impl ServeHttp for Gateway {
    async fn response(&self, session: &mut ServerSession) -> Response<Vec<u8>> {
        let request = session.req_header();
        let method = request.method.as_str().to_owned();
        let path = request.uri.path().to_owned();
        let result = match (method.as_str(), path.as_str()) {
            ("GET", "/health") => Ok(json!({ "status": "ok" })),
            ("GET", "/v1/plugins") => Ok(self.plugins_json()),
            (_, "/health" | "/v1/plugins") => Err(ApiError::method_not_allowed(&method, &path)),
            _ => Err(ApiError::not_found(&path)),
        };
        match result {
            Ok(body) => json_response(StatusCode::OK, body.to_string().into_bytes()),
            Err(error) => json_response(error.status, error.body()),
        }
    }
}

fn json_response(status: StatusCode, body: Vec<u8>) -> Response<Vec<u8>> {
    let length = body.len();
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .header("content-length", length)
        .body(body)
        .unwrap_or_else(|_| Response::new(Vec::new()))
}

pub fn serve(config: Config) -> anyhow::Result<()> {
    let gateway = Gateway::new(&config)?;
    tracing::info!(
        listen = %config.listen,
        plugins = gateway.registry.len(),
        "mmgate is serving"
    );
    let mut server = Server::new(None).context("creating the pingora server")?;
    server.bootstrap();
    let mut service = Service::new("mmgate http".to_owned(), HttpServer::new_app(gateway));
    service.add_tcp(&config.listen.to_string());
    server.add_service(service);
    server.run_forever()
}
