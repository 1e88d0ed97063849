//! Telling an upstream who its client is: `X-Forwarded-For`, `X-Forwarded-Proto` and `Forwarded`
//! (RFC 7239), as reverse proxies do (an engine's access logs, rate limits and uvicorn's
//! `--forwarded-allow-ips` read them).
//!
//! What a client says of itself in these headers is believed only when the client is a trusted
//! proxy (`trusted_proxies`, e.g. the load balancer in front of the replicas): then its chain is
//! kept and this hop appended. From anyone else the headers are dropped and the chain starts at the
//! connection's peer, so a client cannot pose as another address.

use std::net::IpAddr;

use ipnet::IpNet;

/// The client side of one request: the connection's peer and whether it came over TLS.
#[derive(Debug, Clone, Copy)]
pub struct ClientHop {
    pub peer: Option<IpAddr>,
    pub https: bool,
    /// The peer is a trusted proxy: the forwarding headers it sent are kept.
    pub trusted: bool,
}

impl ClientHop {
    pub fn new(peer: Option<IpAddr>, https: bool, trusted_proxies: &[IpNet]) -> ClientHop {
        let trusted = peer.is_some_and(|ip| trusted_proxies.iter().any(|net| net.contains(&ip)));
        ClientHop {
            peer,
            https,
            trusted,
        }
    }

    /// The forwarding headers the upstream gets (`name: value\r\n` each), given the values of
    /// each the client sent (`incoming(name)`, all of that name, joined with ", "; empty when
    /// none).
    pub fn headers(&self, incoming: impl Fn(&str) -> Option<String>) -> Vec<u8> {
        let proto = if self.https { "https" } else { "http" };
        let kept = |name: &str| {
            if self.trusted {
                incoming(name).filter(|v| !v.trim().is_empty())
            } else {
                None
            }
        };
        let mut out = Vec::with_capacity(128);
        let mut header = |name: &str, value: &str| {
            out.extend_from_slice(name.as_bytes());
            out.extend_from_slice(b": ");
            out.extend_from_slice(value.as_bytes());
            out.extend_from_slice(b"\r\n");
        };
        let peer = self.peer.map(|ip| ip.to_string());
        let chain = match (kept("x-forwarded-for"), &peer) {
            (Some(before), Some(peer)) => Some(format!("{before}, {peer}")),
            (Some(before), None) => Some(before),
            (None, peer) => peer.clone(),
        };
        if let Some(chain) = chain {
            header("x-forwarded-for", &chain);
        }
        let forwarded_proto = kept("x-forwarded-proto").unwrap_or_else(|| proto.to_owned());
        header("x-forwarded-proto", &forwarded_proto);
        // RFC 7239: an IPv6 address is quoted and bracketed; an unknown peer is "unknown".
        let node = match self.peer {
            Some(IpAddr::V6(ip)) => format!("\"[{ip}]\""),
            Some(IpAddr::V4(ip)) => ip.to_string(),
            None => "unknown".to_owned(),
        };
        let element = format!("for={node};proto={proto}");
        match kept("forwarded") {
            Some(before) => header("forwarded", &format!("{before}, {element}")),
            None => header("forwarded", &element),
        }
        out
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn headers(hop: &ClientHop, incoming: &[(&str, &str)]) -> String {
        let bytes = hop.headers(|name| {
            let values: Vec<&str> = incoming
                .iter()
                .filter(|(n, _)| n.eq_ignore_ascii_case(name))
                .map(|(_, v)| *v)
                .collect();
            (!values.is_empty()).then(|| values.join(", "))
        });
        String::from_utf8(bytes).unwrap()
    }

    #[test]
    fn a_clients_own_chain_is_kept_only_from_a_trusted_proxy() {
        let trusted: Vec<IpNet> = vec!["10.0.0.0/8".parse().unwrap()];
        let spoof = [
            ("X-Forwarded-For", "1.2.3.4"),
            ("Forwarded", "for=1.2.3.4"),
            ("X-Forwarded-Proto", "https"),
        ];
        let stranger = ClientHop::new(Some("192.0.2.7".parse().unwrap()), false, &trusted);
        assert_eq!(
            headers(&stranger, &spoof),
            "x-forwarded-for: 192.0.2.7\r\nx-forwarded-proto: http\r\nforwarded: for=192.0.2.7;proto=http\r\n"
        );
        let balancer = ClientHop::new(Some("10.1.2.3".parse().unwrap()), false, &trusted);
        assert_eq!(
            headers(&balancer, &spoof),
            "x-forwarded-for: 1.2.3.4, 10.1.2.3\r\nx-forwarded-proto: https\r\nforwarded: for=1.2.3.4, for=10.1.2.3;proto=http\r\n"
        );
        let v6 = ClientHop::new(Some("2001:db8::1".parse().unwrap()), true, &[]);
        assert_eq!(
            headers(&v6, &[]),
            "x-forwarded-for: 2001:db8::1\r\nx-forwarded-proto: https\r\nforwarded: for=\"[2001:db8::1]\";proto=https\r\n"
        );
        assert!(crate::wire::http1::is_forwarding_header("X-Forwarded-For"));
        assert!(!crate::wire::http1::is_forwarding_header(
            "x-forwarded-host"
        ));
    }
}
