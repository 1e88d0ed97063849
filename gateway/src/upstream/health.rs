//! Active health checks of a pool's servers, run by pingora's load balancer in the background.
//!
//! pingora's own checks use one TLS server name and one `Host` for every server of a pool; a pool
//! here may mix servers (plain and TLS, several host names), so each check connects as requests
//! do: through the pool's connector, to that server's name.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use pingora::connectors::TransportConnector;
use pingora::lb::Backend;
use pingora::lb::health_check::HealthCheck as PingoraHealthCheck;
use pingora::protocols::http::v1::client::HttpSession as UpstreamSession;
use pingora::{Error, ErrorType, Result};
use tokio::io::AsyncWriteExt;

use super::{Target, Targets};
use crate::config::HealthCheck;

/// How long a server has to answer a check once connected.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(2);

pub struct ServerCheck {
    /// `GET` this path, 2xx is healthy; `None`: connecting (and the TLS handshake) is the check.
    path: Option<String>,
    failures: usize,
    successes: usize,
    targets: Arc<Targets>,
    connector: Arc<TransportConnector>,
    /// The `Authorization` value the pool sends, if it sends its own.
    auth: Option<http::HeaderValue>,
}

impl ServerCheck {
    pub fn new(
        config: &HealthCheck,
        targets: Arc<Targets>,
        connector: Arc<TransportConnector>,
        auth: Option<http::HeaderValue>,
    ) -> ServerCheck {
        ServerCheck {
            path: (!config.path.is_empty()).then(|| config.path.clone()),
            failures: config.failures.max(1),
            successes: config.successes.max(1),
            targets,
            connector,
            auth,
        }
    }

    async fn get(
        &self,
        target: &Target,
        mut stream: pingora::protocols::Stream,
        path: &str,
    ) -> Result<()> {
        let mut request = format!(
            "GET {path} HTTP/1.1\r\nhost: {}\r\nconnection: close\r\n",
            target.authority
        )
        .into_bytes();
        if let Some(auth) = &self.auth {
            request.extend_from_slice(b"authorization: ");
            request.extend_from_slice(auth.as_bytes());
            request.extend_from_slice(b"\r\n");
        }
        request.extend_from_slice(b"\r\n");
        let answer = async {
            stream
                .write_all(&request)
                .await
                .map_err(|e| Error::because(ErrorType::WriteError, "sending the check", e))?;
            stream
                .flush()
                .await
                .map_err(|e| Error::because(ErrorType::WriteError, "sending the check", e))?;
            let mut session = UpstreamSession::new(stream);
            session.read_response().await?;
            Ok::<_, Box<Error>>(session.get_status())
        };
        let status = tokio::time::timeout(ANSWER_TIMEOUT, answer)
            .await
            .map_err(|_| {
                Error::explain(ErrorType::ReadTimedout, "no answer to the health check")
            })??;
        match status {
            Some(status) if status.is_success() => Ok(()),
            other => Error::e_explain(
                ErrorType::CustomCode("unhealthy", 0),
                format!("health check {path} answered {other:?}"),
            ),
        }
    }
}

#[async_trait]
impl PingoraHealthCheck for ServerCheck {
    async fn check(&self, backend: &Backend) -> Result<()> {
        let Some((socket, target)) = backend
            .addr
            .as_inet()
            .and_then(|s| Some((*s, self.targets.get(s)?)))
        else {
            return Error::e_explain(ErrorType::InternalError, "not one of the pool's servers");
        };
        let stream = self.connector.new_stream(&target.peer(socket)).await?;
        match &self.path {
            None => Ok(()),
            Some(path) => self.get(target, stream, path).await,
        }
    }

    fn health_threshold(&self, success: bool) -> usize {
        if success {
            self.successes
        } else {
            self.failures
        }
    }
}
