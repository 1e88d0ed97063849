//! HTTP/1.1 on the wire, for the passthrough lane: recognising a client request that can be
//! forwarded as bytes, and finding where an upstream's response begins and ends so it can be relayed
//! as bytes. Parsing only (no I/O), so every case is tested here.
//!
//! The lane exists for speed: building pingora's header maps for a request and its response, and
//! serialising them again, costs more than the rest of a passthrough together. Anything out of the
//! ordinary (other paths and methods, chunked or `Expect` requests, HTTP/1.0, `Connection: close`)
//! is left to pingora's full HTTP/1 implementation.

use std::ops::Range;

use http::StatusCode;

mod response;
pub use response::{Chunked, Framing, ResponseError, ResponseHead, parse_response};

/// Headers that say who the client is (`X-Forwarded-For`, `X-Forwarded-Proto`, `Forwarded`): the
/// hop that forwards a message writes them itself, so a client's own values are never forwarded as
/// they are.
pub const FORWARDING_HEADERS: [&str; 3] = ["x-forwarded-for", "x-forwarded-proto", "forwarded"];

/// Whether `name` is one of [`FORWARDING_HEADERS`].
pub fn is_forwarding_header(name: &str) -> bool {
    FORWARDING_HEADERS
        .iter()
        .any(|h| name.eq_ignore_ascii_case(h))
}

/// Headers that describe one connection, not the message: never forwarded, either way.
const HOP_BY_HOP: [&str; 8] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "upgrade",
];

/// Which headers of one message stay on this hop: the fixed hop-by-hop ones, and every header its
/// `Connection` headers name (RFC 9110 7.6.1: `Connection: close, X-Foo` makes `X-Foo` describe
/// this connection only). Neither is ever forwarded, in either direction.
#[derive(Debug, Default)]
pub struct HopByHop<'a> {
    listed: Vec<&'a [u8]>,
}

impl<'a> HopByHop<'a> {
    /// From the values of a message's `Connection` headers.
    pub fn new(connection_values: impl IntoIterator<Item = &'a [u8]>) -> HopByHop<'a> {
        let listed = connection_values
            .into_iter()
            .flat_map(|value| value.split(|&b| b == b','))
            .map(<[u8]>::trim_ascii)
            .filter(|token| !token.is_empty())
            .collect();
        HopByHop { listed }
    }

    /// Whether the header `name` stays on this hop.
    pub fn drops(&self, name: &str) -> bool {
        HOP_BY_HOP.iter().any(|h| name.eq_ignore_ascii_case(h))
            || self
                .listed
                .iter()
                .any(|token| token.eq_ignore_ascii_case(name.as_bytes()))
    }
}

/// Headers parsed per message; a message with more goes to pingora (which takes more).
const MAX_HEADERS: usize = 64;

/// What the start of a client's buffer holds.
#[derive(Debug, PartialEq, Eq)]
pub enum Request {
    /// Not a whole request head yet.
    Partial,
    /// A chat completion the lane can forward; its body may not all be read yet.
    Passable(Passable),
    /// Anything else: pingora serves it.
    Other,
}

/// A `POST /v1/chat/completions` with a plain `Content-Length` body, as the upstream gets it.
#[derive(Debug, PartialEq, Eq)]
pub struct Passable {
    /// Bytes of the request line and headers, the blank line included.
    pub head_len: usize,
    pub body_len: usize,
    /// The request target (path and query) within the buffer.
    pub target: Range<usize>,
    /// The client's `Authorization` value within the buffer.
    pub authorization: Option<Range<usize>>,
    /// The client's other headers as they are forwarded (`name: value\r\n` each): less `Host`,
    /// `Content-Length` and the hop-by-hop ones.
    pub forwarded_headers: Vec<u8>,
}

impl Passable {
    /// The whole request's length: head and body.
    pub fn len(&self) -> usize {
        self.head_len + self.body_len
    }
}

/// Looks at the request at the start of `buf`. `max_body`: a larger body is pingora's to refuse.
pub fn parse_request(buf: &[u8], max_body: usize) -> Request {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut request = httparse::Request::new(&mut headers);
    let head_len = match request.parse(buf) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => return Request::Partial,
        Err(_) => return Request::Other,
    };
    let (Some("POST"), Some(target), Some(1)) = (request.method, request.path, request.version)
    else {
        return Request::Other;
    };
    let path = target.split_once('?').map_or(target, |(path, _)| path);
    // httparse lets through target bytes a URI may not hold (`<`, say); pingora refuses them, and
    // the lane must not forward what pingora would refuse.
    // (The bare path, the usual target, needs no second look.)
    if path != "/v1/chat/completions"
        || (target != path && http::uri::PathAndQuery::try_from(target).is_err())
    {
        return Request::Other;
    }
    let mut body_len = None;
    let mut authorization = None;
    let mut seen_host = false;
    let mut forwarded_headers = Vec::with_capacity(256);
    for header in request.headers.iter() {
        let name = header.name;
        if name.eq_ignore_ascii_case("content-length") {
            match (body_len, content_length(header.value)) {
                (None, Some(n)) if n <= max_body => body_len = Some(n),
                _ => return Request::Other,
            }
        } else if name.eq_ignore_ascii_case("transfer-encoding")
            || name.eq_ignore_ascii_case("expect")
            // Whether a client's own forwarding headers are believed depends on who it is.
            || is_forwarding_header(name)
            || name.eq_ignore_ascii_case("upgrade")
            || (name.eq_ignore_ascii_case("connection") && !keep_alive_only(header.value))
        {
            return Request::Other;
        } else if name.eq_ignore_ascii_case("authorization") {
            if authorization.is_some() {
                // Which of two keys counts is pingora's to decide, as for every other route.
                return Request::Other;
            }
            authorization = Some(range_in(buf, header.value));
        } else if name.eq_ignore_ascii_case("host") {
            if seen_host || !valid_host(header.value) {
                return Request::Other; // the framing check refuses it
            }
            seen_host = true;
        } else if !HOP_BY_HOP.iter().any(|h| name.eq_ignore_ascii_case(h)) {
            forwarded_headers.extend_from_slice(name.as_bytes());
            forwarded_headers.extend_from_slice(b": ");
            forwarded_headers.extend_from_slice(header.value);
            forwarded_headers.extend_from_slice(b"\r\n");
        }
    }
    let (Some(body_len), true) = (body_len, seen_host) else {
        return Request::Other; // no Host: the framing check refuses it
    };
    Request::Passable(Passable {
        head_len,
        body_len,
        target: range_in(buf, target.as_bytes()),
        authorization,
        forwarded_headers,
    })
}

/// Headers parsed per request head that the lane leaves to pingora: pingora's own limit.
const MAX_CHECKED_HEADERS: usize = 256;

/// A request head larger than this is refused with 431, whether it is still arriving or whole:
/// pingora would close the connection on it without an answer.
pub const MAX_REQUEST_HEAD: usize = 64 * 1024;

/// What the framing rules make of a request the lane leaves to pingora, checked on the bytes before
/// pingora reads them (pingora is lenient in places where a proxy must not be: a chunk line ending
/// in a bare LF, say). The rules, RFC 9112 and 9110:
///
/// | the request has | it gets | connection |
/// |---|---|---|
/// | `Content-Length` and `Transfer-Encoding` (either order) | 400 `ambiguous_framing` | closed |
/// | several `Content-Length`s, or a list, all the same valid number | forwarded with one `Content-Length` | kept |
/// | several `Content-Length`s that differ, or one that is not digits | 400 `bad_content_length` | closed |
/// | `Transfer-Encoding` whose last coding is not `chunked` | 400 `bad_transfer_encoding` | closed |
/// | `Transfer-Encoding` with codings besides `chunked` (`gzip, chunked`) | 501 `unsupported_transfer_encoding` | closed |
/// | `Transfer-Encoding` on an HTTP/1.0 request | 400 `bad_transfer_encoding` | closed |
/// | a chunked body: bad size, a chunk line or trailer with a bare CR or LF, a chunk that does not end in CRLF | 400 `bad_chunked_body` | closed |
/// | a chunked body, well formed | forwarded with its decoded length as `Content-Length` | kept |
/// | obs-fold (a header line starting with whitespace), whitespace before a colon, a bare CR, a control byte in a field, a malformed request line | 400 `bad_request_head` | closed |
/// | header lines ending in a bare LF | read as lines (RFC 9112 2.2 allows it); forwarded with CRLF | kept |
/// | more than 256 header lines, or a head over 64 KiB | 431 `headers_too_large` | closed |
/// | more than one `Host` line, or a `Host` that is not `host[:port]`, or none (HTTP/1.1) | 400 `bad_request_head` | closed |
/// | an absolute-form target (`POST http://host/v1/...`) | served by its path; forwarded in origin form | kept |
/// | `Expect: 100-continue` | `100 Continue` from this gateway before the body is read; `Expect` is not forwarded | kept |
/// | any other `Expect` | 417 `expectation_failed` | closed |
/// | `Connection: close, X-Foo` / `keep-alive, X-Foo` | `X-Foo` (and every fixed hop-by-hop header) is not forwarded; likewise for the upstream's answer | as `Connection` says |
///
/// Upstream responses follow the same rules where they apply ([`parse_response`]): a response
/// with both framings is read as chunked, its `Content-Length` dropped and the upstream connection
/// not reused; differing `Content-Length`s, a malformed head or chunked body is a 502.
#[derive(Debug, PartialEq, Eq)]
pub enum RequestCheck {
    /// Not a whole head yet.
    Partial,
    /// pingora may read it.
    Pass(CheckedHead),
    /// Refused with this status and error code; the connection closes after the answer.
    Refuse {
        status: StatusCode,
        code: &'static str,
        message: &'static str,
    },
}

/// What the check found in a head it lets through.
#[derive(Debug, PartialEq, Eq)]
pub struct CheckedHead {
    pub head_len: usize,
    /// Its body is chunked: the caller follows it with [`Chunked`] (refusing it if it is
    /// malformed) before pingora reads it.
    pub chunked: bool,
    /// `Expect: 100-continue` on an HTTP/1.1 request: the client may wait for `100 Continue`
    /// before it sends the body.
    pub expects_continue: bool,
    /// Its `Content-Length`, if any.
    pub content_length: Option<usize>,
    /// Its `Authorization` value within the buffer, when it has exactly one.
    pub authorization: Option<Range<usize>>,
}

impl RequestCheck {
    fn refuse(status: StatusCode, code: &'static str, message: &'static str) -> RequestCheck {
        RequestCheck::Refuse {
            status,
            code,
            message,
        }
    }
}

/// Checks the request head at the start of `buf` against the table on [`RequestCheck`].
pub fn check_request(buf: &[u8]) -> RequestCheck {
    let mut headers = [httparse::EMPTY_HEADER; MAX_CHECKED_HEADERS];
    let mut request = httparse::Request::new(&mut headers);
    let head_len = match request.parse(buf) {
        Ok(httparse::Status::Complete(n)) if n <= MAX_REQUEST_HEAD => n,
        Ok(httparse::Status::Partial) if buf.len() <= MAX_REQUEST_HEAD => {
            return RequestCheck::Partial;
        }
        Ok(_) => {
            return RequestCheck::refuse(
                StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
                "headers_too_large",
                "the request head is too large",
            );
        }
        Err(httparse::Error::TooManyHeaders) => {
            return RequestCheck::refuse(
                StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
                "headers_too_large",
                "the request has too many header lines",
            );
        }
        Err(_) => {
            return RequestCheck::refuse(
                StatusCode::BAD_REQUEST,
                "bad_request_head",
                "the request line or a header line is malformed (RFC 9112)",
            );
        }
    };
    let http10 = request.version == Some(0);
    // RFC 9112 3.2: a request with more than one Host line, or a Host that is not a host and
    // port, is answered 400 (which Host would a virtual-hosted server behind us take?).
    let mut hosts = request
        .headers
        .iter()
        .filter(|h| h.name.eq_ignore_ascii_case("host"));
    match (hosts.next(), hosts.next()) {
        (Some(_), Some(_)) => {
            return RequestCheck::refuse(
                StatusCode::BAD_REQUEST,
                "bad_request_head",
                "the request has more than one Host header",
            );
        }
        (Some(host), None) if !valid_host(host.value) => {
            return RequestCheck::refuse(
                StatusCode::BAD_REQUEST,
                "bad_request_head",
                "the Host header is not a host and port",
            );
        }
        // HTTP/1.0 had no Host; every HTTP/1.1 request must carry one.
        (None, _) if !http10 => {
            return RequestCheck::refuse(
                StatusCode::BAD_REQUEST,
                "bad_request_head",
                "an HTTP/1.1 request must have a Host header (RFC 9112 3.2)",
            );
        }
        _ => {}
    }
    let mut content_length: Option<usize> = None;
    let mut codings: Vec<&[u8]> = Vec::new();
    let mut expects_continue = false;
    let mut authorizations = request
        .headers
        .iter()
        .filter(|h| h.name.eq_ignore_ascii_case("authorization"));
    // Which of two keys counts is pingora's to decide: neither is taken here.
    let authorization = match (authorizations.next(), authorizations.next()) {
        (Some(one), None) => Some(range_in(buf, one.value)),
        _ => None,
    };
    for header in request.headers.iter() {
        let name = header.name;
        if name.eq_ignore_ascii_case("content-length") {
            for item in header.value.split(|&b| b == b',') {
                match (content_length, self::content_length(item.trim_ascii())) {
                    (_, None) => {
                        return RequestCheck::refuse(
                            StatusCode::BAD_REQUEST,
                            "bad_content_length",
                            "Content-Length is not a number",
                        );
                    }
                    (Some(a), Some(b)) if a != b => {
                        return RequestCheck::refuse(
                            StatusCode::BAD_REQUEST,
                            "bad_content_length",
                            "the request has Content-Lengths that differ",
                        );
                    }
                    (_, n) => content_length = n,
                }
            }
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            codings.extend(
                header
                    .value
                    .split(|&b| b == b',')
                    .map(<[u8]>::trim_ascii)
                    .filter(|c| !c.is_empty()),
            );
        } else if name.eq_ignore_ascii_case("expect") {
            if header
                .value
                .trim_ascii()
                .eq_ignore_ascii_case(b"100-continue")
            {
                expects_continue = !http10;
            } else {
                return RequestCheck::refuse(
                    StatusCode::EXPECTATION_FAILED,
                    "expectation_failed",
                    "the only expectation served is 100-continue",
                );
            }
        }
    }
    let chunked = !codings.is_empty();
    if chunked {
        if content_length.is_some() {
            return RequestCheck::refuse(
                StatusCode::BAD_REQUEST,
                "ambiguous_framing",
                "the request has both Content-Length and Transfer-Encoding",
            );
        }
        if http10 {
            return RequestCheck::refuse(
                StatusCode::BAD_REQUEST,
                "bad_transfer_encoding",
                "an HTTP/1.0 request cannot have Transfer-Encoding",
            );
        }
        if !codings
            .last()
            .is_some_and(|c| c.eq_ignore_ascii_case(b"chunked"))
        {
            return RequestCheck::refuse(
                StatusCode::BAD_REQUEST,
                "bad_transfer_encoding",
                "the request's last transfer coding is not chunked",
            );
        }
        if codings.len() > 1 {
            return RequestCheck::refuse(
                StatusCode::NOT_IMPLEMENTED,
                "unsupported_transfer_encoding",
                "no transfer coding but chunked is supported",
            );
        }
    }
    RequestCheck::Pass(CheckedHead {
        head_len,
        chunked,
        expects_continue,
        content_length,
        authorization,
    })
}

/// `part`'s place in `buf` (httparse hands out slices of the buffer it parsed).
fn range_in(buf: &[u8], part: &[u8]) -> Range<usize> {
    let start = part.as_ptr() as usize - buf.as_ptr() as usize;
    start..start + part.len()
}

/// A `Content-Length` value: digits only (no sign, no list), as RFC 9110 has it.
fn content_length(value: &[u8]) -> Option<usize> {
    if value.is_empty() || value.len() > 15 || !value.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(value).ok()?.parse().ok()
}

/// Whether a `Host` value is `host[:port]` (RFC 9110 7.2; empty is allowed, as for a target with no
/// authority).
fn valid_host(value: &[u8]) -> bool {
    // The usual `name` or `name:port` is checked by its bytes (parsing it as a URI authority on
    // every request cost more than the check); anything else (an IPv6 literal, an empty port) is
    // parsed.
    let (name, port) = match value.iter().rposition(|&b| b == b':') {
        Some(at) => (&value[..at], Some(&value[at + 1..])),
        None => (value, None),
    };
    let plain_name = !name.is_empty()
        && name
            .iter()
            .all(|&b| b.is_ascii_alphanumeric() || b == b'.' || b == b'-');
    let plain_port = port.is_none_or(|p| {
        !p.is_empty()
            && p.iter().all(u8::is_ascii_digit)
            && std::str::from_utf8(p).is_ok_and(|p| p.parse::<u16>().is_ok())
    });
    (plain_name && plain_port) || valid_authority(value)
}

/// [`valid_host`] by parsing `value` as a URI authority.
fn valid_authority(value: &[u8]) -> bool {
    value.is_empty()
        || http::uri::Authority::try_from(value).is_ok_and(|a| {
            let authority = a.as_str();
            // The port is what follows the last colon outside an IPv6 literal's brackets.
            let port = authority
                .rfind(':')
                .filter(|&at| !authority[at..].contains(']'))
                .map(|at| &authority[at + 1..]);
            !authority.contains('@')
                && port.is_none_or(|p| p.is_empty() || p.parse::<u16>().is_ok())
        })
}

/// Whether a `Connection` header asks for nothing but keeping the connection open.
fn keep_alive_only(value: &[u8]) -> bool {
    value
        .split(|&b| b == b',')
        .all(|token| token.trim_ascii().eq_ignore_ascii_case(b"keep-alive"))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::response::Progress;
    use super::*;

    /// The byte check of the usual `Host` values agrees with parsing them, and leaves the rest to
    /// the parse.
    #[test]
    fn a_plain_host_is_judged_as_parsing_it_would() {
        for host in [
            "localhost",
            "gw",
            "api.example.com",
            "a-b.c",
            "127.0.0.1",
            "h:8080",
            "h:0",
            "h:65535",
            "h:65536",
            "h:99999999",
            "h:",
            ":80",
            "h:8a",
            "h:1:2",
            "[::1]",
            "[::1]:80",
            "u@h",
            "h h",
            "h/x",
            "",
            "-",
            "h.",
            "_h",
            "h%41",
        ] {
            assert_eq!(
                valid_host(host.as_bytes()),
                valid_authority(host.as_bytes()),
                "{host:?}"
            );
        }
        assert!(valid_host(b"api.example.com:443"));
        assert!(!valid_host(b"h:65536"));
        assert!(!valid_host(b"u@h"));
    }

    const CHAT: &[u8] = b"POST /v1/chat/completions?x=1 HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\nConnection: keep-alive\r\nAuthorization: Bearer sk-1\r\nContent-Length: 2\r\n\r\n{}";

    fn passable(buf: &[u8]) -> Passable {
        match parse_request(buf, 1 << 20) {
            Request::Passable(p) => p,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_plain_chat_request_is_passable_with_its_target_key_and_forwarded_headers() {
        let p = passable(CHAT);
        assert_eq!(&CHAT[p.target.clone()], b"/v1/chat/completions?x=1");
        assert_eq!(&CHAT[p.authorization.clone().unwrap()], b"Bearer sk-1");
        assert_eq!(p.forwarded_headers, b"Content-Type: application/json\r\n");
        assert_eq!((p.body_len, p.len()), (2, CHAT.len()));
        // A head cut anywhere is partial, never misread.
        for cut in 0..p.head_len {
            assert_eq!(
                parse_request(&CHAT[..cut], 1 << 20),
                Request::Partial,
                "{cut}"
            );
        }
    }

    #[test]
    fn anything_unusual_is_left_to_pingora() {
        let swap = |from: &str, to: &str| {
            String::from_utf8(CHAT.to_vec())
                .unwrap()
                .replacen(from, to, 1)
        };
        for request in [
            swap("POST", "GET"),
            swap("/v1/chat/completions", "/v1/files"),
            swap("/v1/chat/completions?x=1", "/v1/chat/completions/x"),
            swap("HTTP/1.1", "HTTP/1.0"),
            swap("Connection: keep-alive", "Connection: close"),
            swap("Connection: keep-alive", "Connection: upgrade"),
            swap("Connection: keep-alive", "Expect: 100-continue"),
            swap("Connection: keep-alive", "Transfer-Encoding: chunked"),
            swap("Connection: keep-alive", "Content-Length: 3"),
            swap("Content-Length: 2", "Content-Length: +2"),
            swap("Content-Length: 2", "Content-Length: 2, 2"),
            swap("Content-Length: 2", "X-Length: 2"),
            swap("Host: gw", "Bad Header: x"),
            swap("Host: gw", "Authorization: Bearer sk-2"),
            swap("Host: gw", "X-Forwarded-For: 1.2.3.4"),
            swap("Host: gw", "Forwarded: for=1.2.3.4"),
        ] {
            assert_eq!(
                parse_request(request.as_bytes(), 1 << 20),
                Request::Other,
                "{request}"
            );
        }
        assert_eq!(
            parse_request(CHAT, 1),
            Request::Other,
            "over the body limit"
        );
    }

    fn head(text: &str) -> ResponseHead {
        parse_response(text.as_bytes()).unwrap().unwrap()
    }

    #[test]
    fn response_framing_follows_rfc_9112() {
        let r = head(
            "HTTP/1.1 200 OK\r\nContent-Length: 5\r\nConnection: keep-alive\r\nX-A: 1\r\n\r\nhello",
        );
        assert_eq!(
            (r.status, &r.framing, r.reusable),
            (200, &Framing::Length(5), true)
        );
        assert_eq!(
            String::from_utf8(r.client_head).unwrap(),
            "HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-A: 1\r\n\r\n"
        );
        let r = head(
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\nContent-Length: 9\r\n\r\n",
        );
        assert_eq!(r.framing, Framing::Chunked(Chunked::default()), "TE wins");
        let r = head("HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n");
        assert_eq!((&r.framing, r.reusable), (&Framing::Close, false));
        let r = head("HTTP/1.1 200 OK\r\n\r\n");
        assert_eq!((&r.framing, r.reusable), (&Framing::Close, false));
        assert!(
            String::from_utf8(r.client_head)
                .unwrap()
                .ends_with("connection: close\r\n\r\n")
        );
        let mut r = head("HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n");
        r.announce_close();
        assert_eq!(
            String::from_utf8(r.client_head).unwrap(),
            "HTTP/1.1 200 OK\r\nContent-Length: 0\r\nconnection: close\r\n\r\n"
        );
        let r = head("HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 0\r\n\r\n");
        assert_eq!((&r.framing, r.reusable), (&Framing::Length(0), false));
        let r = head("HTTP/1.0 200 OK\r\nContent-Length: 1\r\n\r\n");
        assert!(!r.reusable, "HTTP/1.0 closes unless it says keep-alive");
        let r = head("HTTP/1.0 200 OK\r\nConnection: Keep-Alive\r\nContent-Length: 1\r\n\r\n");
        assert!(r.reusable);
        for status in ["100 Continue", "204 No Content", "304 Not Modified"] {
            let r = head(&format!("HTTP/1.1 {status}\r\nContent-Length: 9\r\n\r\n"));
            assert_eq!(r.framing, Framing::Empty, "{status}");
        }
        for bad in [
            "HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n",
            "HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
        ] {
            assert_eq!(parse_response(bad.as_bytes()), Err(ResponseError::Length));
        }
        // Framed both ways: read as chunked, the length not passed on, the connection not reused.
        let r = head("HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n");
        assert_eq!(
            (&r.framing, r.reusable),
            (&Framing::Chunked(Chunked::default()), false)
        );
        assert_eq!(
            String::from_utf8(r.client_head).unwrap(),
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        );
        // Headers the upstream's Connection names stay on its hop.
        let r = head(
            "HTTP/1.1 200 OK\r\nX-Hop: 1\r\nConnection: keep-alive, x-hop,X-Other\r\nX-Other: 2\r\nX-End: 3\r\nContent-Length: 0\r\n\r\n",
        );
        assert_eq!(
            String::from_utf8(r.client_head).unwrap(),
            "HTTP/1.1 200 OK\r\nX-End: 3\r\nContent-Length: 0\r\n\r\n"
        );
        assert!(parse_response(b"SSH-2.0-x\r\n\r\n").is_err());
        assert_eq!(parse_response(b"HTTP/1.1 200 OK\r\nContent-Le"), Ok(None));
    }

    /// Feeds `body` to a chunked framing in pieces of `step` bytes: (body bytes, done).
    fn follow(body: &[u8], step: usize) -> Result<(usize, bool), ResponseError> {
        let mut framing = Framing::Chunked(Chunked::default());
        let mut taken = 0;
        for piece in body.chunks(step) {
            let progress = framing.advance(piece)?;
            taken += progress.body;
            if progress.done {
                return Ok((taken, true));
            }
            assert_eq!(progress.body, piece.len());
        }
        Ok((taken, false))
    }

    #[test]
    fn a_chunked_body_ends_where_its_last_chunk_and_trailers_do_however_it_is_split() {
        let body: &[u8] =
            b"5;ext=1\r\nhello\r\n1A\r\nabcdefghijklmnopqrstuvwxyz\r\n0\r\nX-T: 1\r\n\r\n";
        for step in 1..=body.len() {
            let mut with_next = body.to_vec();
            with_next.extend_from_slice(b"HTTP/1.1 200 OK");
            assert_eq!(follow(&with_next, step), Ok((body.len(), true)), "{step}");
            assert_eq!(
                follow(&body[..body.len() - 1], step),
                Ok((body.len() - 1, false))
            );
        }
        assert_eq!(follow(b"0\r\n\r\n", 1), Ok((5, true)));
        let spaced: &[u8] = b"5 \t; a=\"b c\"\r\nhello\r\n0\r\n\r\n";
        assert_eq!(follow(spaced, 1), Ok((spaced.len(), true)));
        for bad in [
            &b"x\r\n"[..],
            b"5\r\nhelloX",
            b"\r\n",
            b"ffffffffffffffffff\r\n",
            // Bare LFs and CRs anywhere in the framing.
            b"0\n\n",
            b"5\nhello\r\n",
            b"5;a\nb\r\nhello\r\n",
            b"5;a\rb\r\nhello\r\n",
            b"5\r\nhello\n0\r\n\r\n",
            b"0\r\nX-T: 1\n\r\n",
            b"0\r\n\n",
            // Only an extension or the line's end may follow whitespace after the size.
            b"5 5\r\nhello\r\n",
            b"5;a\x00\r\nhello\r\n",
        ] {
            assert_eq!(follow(bad, 1), Err(ResponseError::Chunk), "{bad:?}");
        }
    }

    #[test]
    fn a_length_framed_body_takes_exactly_its_length() {
        let mut framing = Framing::Length(5);
        assert_eq!(
            framing.advance(b"abc").unwrap(),
            Progress {
                body: 3,
                done: false
            }
        );
        assert_eq!(
            framing.advance(b"deHTTP").unwrap(),
            Progress {
                body: 2,
                done: true
            }
        );
        assert!(Framing::Empty.advance(b"x").unwrap().done);
        assert!(!Framing::Close.advance(b"x").unwrap().done);
    }

    fn refused(raw: &str) -> (u16, &'static str) {
        match check_request(raw.as_bytes()) {
            RequestCheck::Refuse { status, code, .. } => (status.as_u16(), code),
            other => panic!("{raw:?}: {other:?}"),
        }
    }

    #[test]
    fn request_framing_follows_the_table() {
        let post = |headers: &str| format!("POST /v1/files HTTP/1.1\r\nHost: gw\r\n{headers}\r\n");
        for (headers, expected) in [
            (
                "Content-Length: 5\r\nTransfer-Encoding: chunked\r\n",
                (400, "ambiguous_framing"),
            ),
            (
                "Transfer-Encoding: chunked\r\nContent-Length: 5\r\n",
                (400, "ambiguous_framing"),
            ),
            (
                "Content-Length: 5\r\nContent-Length: 6\r\n",
                (400, "bad_content_length"),
            ),
            ("Content-Length: 5, 6\r\n", (400, "bad_content_length")),
            ("Content-Length: -5\r\n", (400, "bad_content_length")),
            ("Content-Length: 5,\r\n", (400, "bad_content_length")),
            (
                "Transfer-Encoding: chunked, gzip\r\n",
                (400, "bad_transfer_encoding"),
            ),
            (
                "Transfer-Encoding: gzip\r\n",
                (400, "bad_transfer_encoding"),
            ),
            (
                "Transfer-Encoding: gzip, chunked\r\n",
                (501, "unsupported_transfer_encoding"),
            ),
            (
                "Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n",
                (501, "unsupported_transfer_encoding"),
            ),
            ("X-A: 1\r\n folded\r\n", (400, "bad_request_head")),
            ("X-A : 1\r\n", (400, "bad_request_head")),
            ("X-A: 1\rX-B: 2\r\n", (400, "bad_request_head")),
            ("X-A: a\x01b\r\n", (400, "bad_request_head")),
            ("Expect: 200-ok\r\n", (417, "expectation_failed")),
            ("Host: a\r\nHost: b\r\n", (400, "bad_request_head")),
        ] {
            assert_eq!(refused(&post(headers)), expected, "{headers:?}");
        }
        assert_eq!(
            refused("POST /v1/files HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n"),
            (400, "bad_transfer_encoding")
        );
        assert_eq!(
            refused("POST /v1/files HTTP/1.1\r\nContent-Length: 0\r\n\r\n"),
            (400, "bad_request_head"),
            "an HTTP/1.1 request without Host"
        );
        assert!(matches!(
            check_request(b"POST /v1/files HTTP/1.0\r\nContent-Length: 0\r\n\r\n"),
            RequestCheck::Pass(_)
        ));
        for host in ["a b", "u@h", "h:port", "/path"] {
            let raw =
                format!("POST /v1/files HTTP/1.1\r\nHost: {host}\r\nContent-Length: 0\r\n\r\n");
            assert_eq!(refused(&raw), (400, "bad_request_head"), "{host}");
        }
        for host in ["h", "h:8080", "[::1]:80", "10.0.0.1", ""] {
            let raw =
                format!("POST /v1/files HTTP/1.1\r\nHost: {host}\r\nContent-Length: 0\r\n\r\n");
            assert!(
                matches!(check_request(raw.as_bytes()), RequestCheck::Pass(_)),
                "{host}"
            );
        }
        let many = "X-A: 1\r\n".repeat(300);
        assert_eq!(refused(&post(&many)), (431, "headers_too_large"));
        // A whole head past the limit (a long request line) and one still arriving past it.
        let long_line = format!(
            "GET /health?{} HTTP/1.1\r\nHost: gw\r\n\r\n",
            "a".repeat(70_000)
        );
        assert_eq!(refused(&long_line), (431, "headers_too_large"));
        assert_eq!(refused(&long_line[..66_000]), (431, "headers_too_large"));
        let at_limit = format!("X-A: {}\r\n", "a".repeat(60_000));
        assert!(matches!(
            check_request(post(&at_limit).as_bytes()),
            RequestCheck::Pass(_)
        ));

        let pass = |raw: &str| match check_request(raw.as_bytes()) {
            RequestCheck::Pass(head) => (head.chunked, head.expects_continue, head.content_length),
            other => panic!("{raw:?}: {other:?}"),
        };
        assert_eq!(
            pass(&post("Content-Length: 5\r\nContent-Length: 5\r\n")),
            (false, false, Some(5))
        );
        assert_eq!(
            pass(&post("Content-Length: 5 , 5\r\n")),
            (false, false, Some(5))
        );
        assert_eq!(
            pass(&post("Transfer-Encoding: Chunked\r\n")),
            (true, false, None)
        );
        assert_eq!(
            pass(&post("Expect: 100-Continue\r\nContent-Length: 5\r\n")),
            (false, true, Some(5))
        );
        assert_eq!(
            pass("POST /x HTTP/1.0\r\nExpect: 100-continue\r\n\r\n"),
            (false, false, None),
            "an HTTP/1.0 client never waits for 100"
        );
        assert_eq!(
            pass("POST http://gw/v1/files HTTP/1.1\nHost: gw\n\n"),
            (false, false, None)
        );
        assert_eq!(
            check_request(b"POST /v1/files HTTP/1.1\r\nHost: g"),
            RequestCheck::Partial
        );
    }

    #[test]
    fn connection_listed_headers_are_hop_by_hop() {
        let hop = HopByHop::new([&b"keep-alive, X-Foo"[..], b" x-bar ,,"]);
        for name in ["x-foo", "X-FOO", "X-Bar", "connection", "Keep-Alive", "te"] {
            assert!(hop.drops(name), "{name}");
        }
        for name in ["x-foobar", "content-type", "x-ba"] {
            assert!(!hop.drops(name), "{name}");
        }
    }
}
