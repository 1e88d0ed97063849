//! A pool's servers as connections are made to them (each configured server and the addresses it
//! resolved to), and pingora's load balancer choosing among the healthy ones.

use std::collections::BTreeSet;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::{Context, bail};
use pingora::lb::discovery::Static;
use pingora::lb::selection::{BackendIter, BackendSelection, Consistent, RoundRobin};
use pingora::lb::{Backend, Backends, LoadBalancer};
use pingora::upstreams::peer::HttpPeer;

use crate::config::{ModelConfig, UpstreamAddr};

/// How long connecting to an upstream server (TLS handshake included) may take before the next
/// one is tried.
pub(super) const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// One configured upstream server, as its connections are made.
pub struct Target {
    /// Tells its idle connections apart from those made for another configured server at the same
    /// address (another TLS server name, another CA): those are never handed to it.
    pub(super) id: usize,
    pub(super) addr: UpstreamAddr,
    /// The `Host` header its requests carry.
    pub(super) authority: String,
}

impl Target {
    pub(super) fn new(addr: UpstreamAddr) -> Target {
        static NEXT_ID: AtomicUsize = AtomicUsize::new(0);
        Target {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            authority: addr.authority(),
            addr,
        }
    }

    /// A connection to this server at `socket` (one of the addresses its host resolved to). For
    /// TLS the host is the server name sent and checked against the certificate (an IP address
    /// too: pingora skips verification when no name is given).
    pub(super) fn peer(&self, socket: SocketAddr) -> HttpPeer {
        let sni = if self.addr.tls {
            self.addr.host.clone()
        } else {
            String::new()
        };
        let mut peer = HttpPeer::new(socket, self.addr.tls, sni);
        peer.options.connection_timeout = Some(CONNECT_TIMEOUT);
        peer
    }
}

/// The resolved addresses of a pool's servers, each with the server it belongs to. Few per pool:
/// a list is the cheapest map.
pub struct Targets(Vec<(SocketAddr, Arc<Target>)>);

impl Targets {
    /// Resolves each configured server; an address two of them share is refused (the balancer
    /// could not tell them apart).
    pub(super) fn resolve(model: &ModelConfig) -> anyhow::Result<Targets> {
        let mut resolved: Vec<(SocketAddr, Arc<Target>)> = Vec::new();
        for addr in &model.upstreams {
            let sockets: Vec<SocketAddr> = (addr.host.as_str(), addr.port)
                .to_socket_addrs()
                .with_context(|| format!("resolving {addr}"))?
                .collect();
            if sockets.is_empty() {
                bail!("{addr} resolves to no address");
            }
            let target = Arc::new(Target::new(addr.clone()));
            for socket in sockets {
                if let Some((_, other)) = resolved.iter().find(|(s, _)| *s == socket) {
                    bail!(
                        "{addr} and {} both resolve to {socket}: list the server once",
                        other.addr
                    );
                }
                resolved.push((socket, target.clone()));
            }
        }
        Ok(Targets(resolved))
    }

    /// How many addresses the pool's servers resolved to.
    pub(super) fn len(&self) -> usize {
        self.0.len()
    }

    pub(super) fn get(&self, socket: &SocketAddr) -> Option<&Arc<Target>> {
        self.0.iter().find(|(s, _)| s == socket).map(|(_, t)| t)
    }

    pub(super) fn backends(&self) -> Backends {
        let set: BTreeSet<Backend> = self
            .0
            .iter()
            .map(|&(socket, _)| Backend {
                addr: pingora::protocols::l4::socket::SocketAddr::Inet(socket),
                weight: 1,
                ext: http::Extensions::new(),
            })
            .collect();
        Backends::new(Static::new(set))
    }
}

pub(super) enum Balancer {
    RoundRobin(Arc<LoadBalancer<RoundRobin>>),
    Consistent(Arc<LoadBalancer<Consistent>>),
}

impl Balancer {
    /// The first server the selection offers that is healthy and not yet tried.
    pub(super) fn select(&self, key: &[u8], tried: &[SocketAddr]) -> Option<Backend> {
        fn pick<S>(lb: &LoadBalancer<S>, key: &[u8], tried: &[SocketAddr]) -> Option<Backend>
        where
            S: BackendSelection + 'static,
            S::Iter: BackendIter,
        {
            lb.select_with(key, 256, |b, healthy| {
                healthy && b.addr.as_inet().is_some_and(|a| !tried.contains(a))
            })
        }
        match self {
            Self::RoundRobin(lb) => pick(lb, key, tried),
            Self::Consistent(lb) => pick(lb, key, tried),
        }
    }

    pub(super) fn servers(&self) -> Vec<(SocketAddr, bool)> {
        fn list<S>(lb: &LoadBalancer<S>) -> Vec<(SocketAddr, bool)>
        where
            S: BackendSelection + 'static,
            S::Iter: BackendIter,
        {
            lb.backends()
                .get_backend()
                .iter()
                .filter_map(|b| Some((*b.addr.as_inet()?, lb.backends().ready(b))))
                .collect()
        }
        match self {
            Self::RoundRobin(lb) => list(lb),
            Self::Consistent(lb) => list(lb),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use pingora::upstreams::peer::Peer;

    use super::*;

    #[test]
    fn a_tls_peer_always_names_its_server_so_the_certificate_is_checked() {
        let socket: SocketAddr = "127.0.0.1:8443".parse().unwrap();
        let named =
            Target::new(UpstreamAddr::try_from("https://localhost:8443".to_owned()).unwrap());
        let peer = named.peer(socket);
        assert!(peer.is_tls());
        assert_eq!(peer.sni(), "localhost");
        let by_ip =
            Target::new(UpstreamAddr::try_from("https://127.0.0.1:8443".to_owned()).unwrap());
        assert_eq!(by_ip.peer(socket).sni(), "127.0.0.1");
        let plain = Target::new(UpstreamAddr::try_from("127.0.0.1:8000".to_owned()).unwrap());
        assert!(!plain.peer(socket).is_tls());
        assert_ne!(
            named.id, by_ip.id,
            "two configured servers never share idle connections"
        );
    }
}
