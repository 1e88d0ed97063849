//! Fetching http(s) media for a request, with a byte cap, a timeout and an SSRF guard.
//!
//! The guard: every host is resolved by our resolver, which drops the addresses a client must not
//! make the gateway reach (loopback, private, link-local, multicast, unspecified, and the other
//! special-purpose ranges, in v4, v6 and v4-mapped v6 form) unless an allow-list names them; the
//! HTTP client then connects only to what the resolver returned, so what was checked is what is
//! dialled (no second lookup to rebind). Hosts written as IP literals never reach a resolver: they
//! are checked here, on the first URL and on every redirect.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use http::StatusCode;
use ipnet::IpNet;
use serde::Deserialize;

use crate::error::ApiError;

#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FetchConfig {
    /// Whether http(s) media URLs are fetched at all.
    pub enabled: bool,
    /// Addresses or networks the guard lets through anyway (e.g. `"10.1.2.0/24"`, `"127.0.0.1"`).
    pub allow: Vec<IpNet>,
    pub timeout_ms: u64,
    pub max_redirects: usize,
}

impl Default for FetchConfig {
    fn default() -> Self {
        FetchConfig {
            enabled: true,
            allow: Vec::new(),
            timeout_ms: 10_000,
            max_redirects: 5,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error("fetching media from URLs is disabled on this gateway")]
    Disabled,
    #[error("{0:?} is not an http(s) URL")]
    BadUrl(String),
    #[error("{0} is not a public address; the gateway does not fetch from it")]
    Forbidden(String),
    #[error("the media at the URL is over {limit} bytes")]
    TooLarge { limit: usize },
    #[error("fetching the media timed out")]
    Timeout,
    #[error("the media URL answered {0}")]
    Status(StatusCode),
    #[error("fetching the media failed: {0}")]
    Network(String),
}

impl From<&FetchError> for ApiError {
    fn from(error: &FetchError) -> ApiError {
        let status = match error {
            FetchError::Disabled | FetchError::BadUrl(_) | FetchError::Forbidden(_) => {
                StatusCode::BAD_REQUEST
            }
            FetchError::TooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            // The client's URL did not deliver: not the gateway's fault, not a bad request either.
            FetchError::Timeout | FetchError::Status(_) | FetchError::Network(_) => {
                StatusCode::BAD_REQUEST
            }
        };
        let code = match error {
            FetchError::Forbidden(_) => "media_url_forbidden",
            FetchError::TooLarge { .. } => "media_too_large",
            _ => "media_fetch_failed",
        };
        ApiError::new(status, code, error.to_string())
    }
}

pub struct Fetched {
    pub data: Vec<u8>,
    /// The response's Content-Type, without parameters.
    pub mime_type: Option<String>,
}

pub struct Fetcher {
    config: FetchConfig,
    client: reqwest::Client,
}

impl Fetcher {
    pub fn new(config: FetchConfig) -> anyhow::Result<Fetcher> {
        let allow = Arc::new(config.allow.clone());
        let max_redirects = config.max_redirects;
        let redirect_allow = allow.clone();
        let redirects = reqwest::redirect::Policy::custom(move |attempt| {
            if attempt.previous().len() > max_redirects {
                return attempt.error(FetchError::Network("too many redirects".into()));
            }
            match check_url(attempt.url(), &redirect_allow) {
                Ok(()) => attempt.follow(),
                Err(e) => attempt.error(e),
            }
        });
        let client = reqwest::Client::builder()
            .dns_resolver(Arc::new(GuardedResolver { allow }))
            .redirect(redirects)
            .timeout(Duration::from_millis(config.timeout_ms))
            .connect_timeout(Duration::from_millis(config.timeout_ms))
            // Proxies from the environment would dial addresses the guard never saw.
            .no_proxy()
            .user_agent(concat!("mmgate/", env!("CARGO_PKG_VERSION")))
            .build()?;
        Ok(Fetcher { config, client })
    }

    /// The body at `url`, refused past `limit` bytes (by Content-Length before reading, else while
    /// streaming).
    pub async fn fetch(&self, url: &str, limit: usize) -> Result<Fetched, FetchError> {
        if !self.config.enabled {
            return Err(FetchError::Disabled);
        }
        let parsed = reqwest::Url::parse(url).map_err(|_| FetchError::BadUrl(url.to_owned()))?;
        check_url(&parsed, &self.config.allow)?;
        let mut response = self.client.get(parsed).send().await.map_err(classify)?;
        if !response.status().is_success() {
            return Err(FetchError::Status(response.status()));
        }
        if response.content_length().is_some_and(|n| n > limit as u64) {
            return Err(FetchError::TooLarge { limit });
        }
        let mime_type = response
            .headers()
            .get(http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split(';').next())
            .map(|v| v.trim().to_ascii_lowercase())
            .filter(|v| !v.is_empty());
        let mut data = Vec::new();
        while let Some(chunk) = response.chunk().await.map_err(classify)? {
            if data.len() + chunk.len() > limit {
                return Err(FetchError::TooLarge { limit });
            }
            data.extend_from_slice(&chunk);
        }
        Ok(Fetched { data, mime_type })
    }
}

/// The scheme must be http(s); a host written as an IP literal is checked here (names are checked
/// when they are resolved).
fn check_url(url: &reqwest::Url, allow: &[IpNet]) -> Result<(), FetchError> {
    if !matches!(url.scheme(), "http" | "https") {
        return Err(FetchError::BadUrl(url.to_string()));
    }
    let ip = match url.host() {
        Some(url::Host::Ipv4(ip)) => IpAddr::V4(ip),
        Some(url::Host::Ipv6(ip)) => IpAddr::V6(ip),
        Some(url::Host::Domain(_)) => return Ok(()),
        None => return Err(FetchError::BadUrl(url.to_string())),
    };
    if permitted(ip, allow) {
        Ok(())
    } else {
        Err(FetchError::Forbidden(ip.to_string()))
    }
}

/// The reason a request failed, unwrapped from reqwest's error chain.
fn classify(error: reqwest::Error) -> FetchError {
    if error.is_timeout() {
        return FetchError::Timeout;
    }
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&error);
    while let Some(e) = source {
        if let Some(ours) = e.downcast_ref::<FetchError>() {
            return match ours {
                FetchError::Forbidden(ip) => FetchError::Forbidden(ip.clone()),
                other => FetchError::Network(other.to_string()),
            };
        }
        source = e.source();
    }
    FetchError::Network(error.without_url().to_string())
}

struct GuardedResolver {
    allow: Arc<Vec<IpNet>>,
}

impl reqwest::dns::Resolve for GuardedResolver {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let allow = self.allow.clone();
        Box::pin(async move {
            let host = name.as_str().to_owned();
            let found: Vec<SocketAddr> =
                tokio::net::lookup_host((host.as_str(), 0)).await?.collect();
            let permitted: Vec<SocketAddr> = found
                .iter()
                .copied()
                .filter(|a| permitted(a.ip(), &allow))
                .collect();
            if permitted.is_empty() {
                let shown = match found.first() {
                    Some(a) => format!("{host} ({})", a.ip()),
                    None => host,
                };
                return Err(Box::new(FetchError::Forbidden(shown)) as _);
            }
            Ok(Box::new(permitted.into_iter()) as reqwest::dns::Addrs)
        })
    }
}

/// Whether the gateway may connect to `ip` for a client: public unicast, or allow-listed.
pub fn permitted(ip: IpAddr, allow: &[IpNet]) -> bool {
    allow.iter().any(|net| net.contains(&ip)) || is_public(ip)
}

fn is_public(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => is_public_v4(v4),
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            // ::ffff:a.b.c.d reaches a.b.c.d.
            Some(v4) => is_public_v4(v4),
            None => is_public_v6(v6),
        },
    }
}

fn is_public_v4(ip: Ipv4Addr) -> bool {
    let [a, b, c, _] = ip.octets();
    !(ip.is_unspecified()
        || ip.is_loopback()
        || ip.is_private()
        || ip.is_link_local()
        || ip.is_multicast()
        || ip.is_broadcast()
        || ip.is_documentation()
        || a == 0 // "this network"
        || (a == 100 && (64..128).contains(&b)) // carrier-grade NAT
        || (a == 192 && b == 0 && c == 0) // IETF protocol assignments
        || (a == 198 && (18..20).contains(&b)) // benchmarking
        || a >= 240) // reserved
}

fn is_public_v6(ip: Ipv6Addr) -> bool {
    let first = ip.segments()[0];
    !(ip.is_unspecified()
        || ip.is_loopback()
        || ip.is_multicast()
        || (first & 0xfe00) == 0xfc00 // unique local
        || (first & 0xffc0) == 0xfe80 // link-local
        || (first & 0xffc0) == 0xfec0 // site-local (deprecated)
        || first == 0x2001 && ip.segments()[1] == 0x0db8 // documentation
        || first == 0x0064 && ip.segments()[1] == 0xff9b // NAT64 (embeds v4)
        || first == 0x2002 // 6to4 (embeds v4)
        || ip.segments()[..6] == [0; 6]) // v4-compatible (deprecated), embeds v4
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn special_purpose_addresses_are_refused_in_every_form() {
        for refused in [
            "127.0.0.1",
            "127.1.2.3",
            "10.0.0.1",
            "172.16.5.4",
            "192.168.1.1",
            "169.254.169.254",
            "0.0.0.0",
            "100.64.0.1",
            "224.0.0.1",
            "255.255.255.255",
            "::1",
            "::",
            "fe80::1",
            "fc00::1",
            "fd12::1",
            "ff02::1",
            "::ffff:127.0.0.1",
            "::ffff:10.0.0.1",
            "::ffff:169.254.169.254",
            "::127.0.0.1",
            "64:ff9b::a00:1",
            "2002:a00:1::",
        ] {
            let ip: IpAddr = refused.parse().unwrap_or_else(|e| panic!("{refused}: {e}"));
            assert!(!permitted(ip, &[]), "{refused} must be refused");
        }
        for public in [
            "93.184.215.14",
            "8.8.8.8",
            "2606:4700::1111",
            "::ffff:1.1.1.1",
        ] {
            let ip: IpAddr = public.parse().unwrap_or_else(|e| panic!("{public}: {e}"));
            assert!(permitted(ip, &[]), "{public} is public");
        }
    }

    #[test]
    fn the_allow_list_lets_named_networks_through() {
        let allow: Vec<IpNet> = vec!["127.0.0.1/32".parse().unwrap_or_else(|e| panic!("{e}"))];
        assert!(permitted(
            "127.0.0.1".parse().unwrap_or_else(|e| panic!("{e}")),
            &allow
        ));
        assert!(!permitted(
            "127.0.0.2".parse().unwrap_or_else(|e| panic!("{e}")),
            &allow
        ));
    }

    #[test]
    fn urls_with_forbidden_literals_or_schemes_are_refused_before_any_connection() {
        for (url, forbidden) in [
            ("http://127.0.0.1:9/x.png", true),
            ("http://[::1]/x.png", true),
            ("http://[::ffff:7f00:1]/x.png", true),
            ("http://0x7f000001/x.png", true),
            ("file:///etc/passwd", false),
            ("gopher://example.com/", false),
        ] {
            let parsed = reqwest::Url::parse(url).unwrap_or_else(|e| panic!("{url}: {e}"));
            let error = check_url(&parsed, &[]).err();
            match (forbidden, error) {
                (true, Some(FetchError::Forbidden(_))) | (false, Some(FetchError::BadUrl(_))) => {}
                (_, other) => panic!("{url}: {other:?}"),
            }
        }
    }
}
