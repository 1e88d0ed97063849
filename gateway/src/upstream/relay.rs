//! The passthrough lane's forwarding: a plain chat completion goes to a pool server as the bytes
//! the client sent (its head rewritten as [`UpstreamPool::forward`] does), and the server's
//! response comes back as the bytes it sent, its head less the hop-by-hop headers, its body (SSE
//! streams included) relayed read by read. No header maps are built on either side:
//! [`crate::wire::http1`] finds where the head and the body end.

use bytes::{Buf, BytesMut};
use http::StatusCode;
use pingora::protocols::Stream;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::{Attempts, Connection, Target, UpstreamAuth, UpstreamPool, idle};
use crate::access::CLIENT_CLOSED;
use crate::deadline::{Deadline, within};
use crate::error::ApiError;
use crate::keylimits::TokenTally;
use crate::wire::http1::{self, Framing, Passable, ResponseHead};

/// A response head larger than this is refused (pingora's own limit for a head is about as large).
const MAX_RESPONSE_HEAD: usize = 64 * 1024;

/// What reads from an upstream connection ask room for.
const READ_SIZE: usize = 16 * 1024;

/// The outcome of relaying.
pub enum Relayed {
    /// The upstream's answer, with this status, went to the client (completely, unless
    /// `keep_alive` is false: then the client connection is done either way).
    Answered {
        status: StatusCode,
        keep_alive: bool,
    },
    /// The answer began with this status and the upstream failed before its end; the client
    /// connection is done.
    BrokeOff(StatusCode),
    /// Nothing was sent to the client yet: answer with this error.
    Failed(ApiError),
}

#[derive(Debug, thiserror::Error)]
enum HeadError {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("{0}")]
    Response(#[from] http1::ResponseError),
    #[error("the connection closed before a response")]
    Closed,
    #[error("the response head is over {MAX_RESPONSE_HEAD} bytes")]
    TooLarge,
}

/// The client a request is relayed for.
pub struct ClientSide<'c> {
    /// Who sent the request, as the upstream is told: the forwarding headers
    /// ([`super::ClientHop::headers`]), the same for every request of a connection.
    pub forwarding: &'c [u8],
    /// Whether the client's connection closes after this answer.
    pub closing: bool,
    /// Where the answer's bytes are told, for the caller's tokens per minute.
    pub tally: Option<&'c TokenTally>,
    /// How long the client may take none of the answer before it is dropped.
    pub send_timeout: std::time::Duration,
    /// The client connection's timer for its upstream's answers, re-armed for each.
    pub answer_deadline: &'c mut Deadline,
}

impl UpstreamPool {
    /// Sends `request` (the client's bytes, `passable` says what they hold) to a healthy server
    /// and relays its answer to `client`. Servers are tried as [`UpstreamPool::forward`] tries
    /// them ([`Attempts`]).
    pub async fn relay(
        &self,
        client: &mut Stream,
        request: &[u8],
        passable: &Passable,
        key: &[u8],
        side: ClientSide<'_>,
    ) -> Relayed {
        let ClientSide {
            forwarding,
            closing,
            tally,
            send_timeout,
            answer_deadline,
        } = side;
        let mut attempts = Attempts::new(self, key);
        while let Some(Connection {
            server,
            target,
            stream: mut upstream,
            reused,
        }) = attempts.connect().await
        {
            let wire = wire(request, passable, &target, &self.auth, forwarding);
            let written = async {
                upstream.write_all(&wire).await?;
                upstream.flush().await
            }
            .await;
            // Only a request that could not be written can go to another server: once written it
            // may have been acted on (see `Attempts`).
            if let Err(e) = written {
                match attempts.unsent(server, &e, reused) {
                    None => continue,
                    Some(error) => return Relayed::Failed(error),
                }
            }
            let mut buf = BytesMut::with_capacity(READ_SIZE);
            let head =
                answer_deadline.within(self.answer_timeout, read_head(&mut upstream, &mut buf));
            return match head.await {
                Ok(Ok(head)) => {
                    let answer = Answer {
                        idle_key: (server, target.id),
                        closing,
                        model: &self.model,
                        timeout: self.answer_timeout,
                        tally,
                        send_timeout,
                        deadline: &mut *answer_deadline,
                    };
                    relay_answer(client, upstream, buf, head, answer).await
                }
                Ok(Err(e)) => Relayed::Failed(attempts.failed(server, &e)),
                Err(_) => Relayed::Failed(self.timed_out(server)),
            };
        }
        Relayed::Failed(attempts.exhausted())
    }
}

/// The request as `target` gets it: the client's request line and forwarded headers, `Host`
/// naming the server, `Authorization` as `auth` says, who the client is (`forwarding`, the lane
/// taking no request that carries forwarding headers of its own), and the body.
fn wire(
    request: &[u8],
    passable: &Passable,
    target: &Target,
    auth: &UpstreamAuth,
    forwarding: &[u8],
) -> Vec<u8> {
    let body = &request[passable.head_len..passable.len()];
    let mut wire = Vec::with_capacity(passable.head_len + 64 + body.len());
    wire.extend_from_slice(b"POST ");
    wire.extend_from_slice(&request[passable.target.clone()]);
    wire.extend_from_slice(b" HTTP/1.1\r\nhost: ");
    wire.extend_from_slice(target.authority.as_bytes());
    wire.extend_from_slice(b"\r\n");
    let authorization = match auth {
        UpstreamAuth::Key(value) => Some(value.as_bytes()),
        UpstreamAuth::PassThrough => passable.authorization.clone().map(|r| &request[r]),
        UpstreamAuth::Strip => None,
    };
    if let Some(value) = authorization {
        wire.extend_from_slice(b"authorization: ");
        wire.extend_from_slice(value);
        wire.extend_from_slice(b"\r\n");
    }
    wire.extend_from_slice(&passable.forwarded_headers);
    wire.extend_from_slice(forwarding);
    wire.extend_from_slice(b"content-length: ");
    wire.extend_from_slice(body.len().to_string().as_bytes());
    wire.extend_from_slice(b"\r\n\r\n");
    wire.extend_from_slice(body);
    wire
}

/// Reads until `buf` starts with a final (non-1xx) response head; informational ones are dropped.
async fn read_head(upstream: &mut Stream, buf: &mut BytesMut) -> Result<ResponseHead, HeadError> {
    loop {
        match http1::parse_response(buf)? {
            Some(head) if (100..200).contains(&head.status) => buf.advance(head.head_len),
            Some(head) => return Ok(head),
            None if buf.len() > MAX_RESPONSE_HEAD => return Err(HeadError::TooLarge),
            None => {
                buf.reserve(READ_SIZE);
                if upstream.read_buf(buf).await? == 0 {
                    return Err(HeadError::Closed);
                }
            }
        }
    }
}

/// What relaying one answer needs to know besides the bytes.
struct Answer<'m> {
    /// Where the upstream connection goes back to when it can take another request.
    idle_key: idle::Key,
    /// Whether the client's connection closes after this answer.
    closing: bool,
    model: &'m str,
    /// How long the upstream may take to send each next piece.
    timeout: std::time::Duration,
    tally: Option<&'m TokenTally>,
    /// How long the client may take none of the answer.
    send_timeout: std::time::Duration,
    /// What `timeout` is kept by.
    deadline: &'m mut Deadline,
}

/// Relays the answer whose head `buf` starts with, then keeps the upstream connection for the
/// next request when it can take one.
async fn relay_answer(
    client: &mut Stream,
    mut upstream: Stream,
    mut buf: BytesMut,
    mut head: ResponseHead,
    answer: Answer<'_>,
) -> Relayed {
    let Answer {
        idle_key,
        closing,
        model,
        timeout,
        tally,
        send_timeout,
        deadline,
    } = answer;
    let status = StatusCode::from_u16(head.status).unwrap_or(StatusCode::BAD_GATEWAY);
    let (server, _) = idle_key;
    if closing {
        head.announce_close();
    }
    buf.advance(head.head_len);
    let mut framing = head.framing;
    let cut = Cut {
        event_stream: head.event_stream,
        model,
        server,
        status,
        send_timeout,
    };
    // The head and what came with it leave in one write.
    let mut out = head.client_head;
    let mut progress = match framing.advance(&buf) {
        Ok(progress) => progress,
        Err(e) => {
            return cut.end(client, &framing, e.to_string()).await;
        }
    };
    out.extend_from_slice(&buf[..progress.body]);
    if let Some(tally) = tally {
        tally.answer(&buf[..progress.body]);
    }
    let mut overread = buf.len() > progress.body;
    if let Err(e) = send_within(client, &out, send_timeout).await {
        return client_gone(status, &e);
    }
    while !progress.done {
        buf.clear();
        buf.reserve(READ_SIZE);
        let failure = match deadline.within(timeout, upstream.read_buf(&mut buf)).await {
            Ok(Ok(0)) if framing == Framing::Close => break,
            Ok(Ok(0)) => Some("the connection closed mid-body".to_owned()),
            Ok(Ok(_)) => None,
            Ok(Err(e)) => Some(e.to_string()),
            Err(_) => Some(format!(
                "no more of the answer within {} ms",
                timeout.as_millis()
            )),
        };
        if let Some(why) = failure {
            return cut.end(client, &framing, why).await;
        }
        progress = match framing.advance(&buf) {
            Ok(progress) => progress,
            Err(e) => {
                return cut.end(client, &framing, e.to_string()).await;
            }
        };
        overread |= buf.len() > progress.body;
        if let Some(tally) = tally {
            tally.answer(&buf[..progress.body]);
        }
        if let Err(e) = send_within(client, &buf[..progress.body], send_timeout).await {
            return client_gone(status, &e);
        }
    }
    // Bytes past the body would be read as the next response's: such a connection is not kept.
    if head.reusable && !overread {
        idle::put(idle_key, upstream);
    }
    Relayed::Answered {
        status,
        keep_alive: !closing && framing != Framing::Close,
    }
}

/// An answer the upstream failed to finish: what ending it for the client needs.
struct Cut<'m> {
    /// Whether the answer is a stream of events.
    event_stream: bool,
    model: &'m str,
    server: std::net::SocketAddr,
    status: StatusCode,
    send_timeout: std::time::Duration,
}

impl Cut<'_> {
    /// The upstream failed mid-answer (`why`; `framing` is where the body had got to): the
    /// client's connection ends. A stream of events ends with an error event (and, chunked, its
    /// last chunk) where the cut left a clean place for one, so a streaming client learns why
    /// rather than seeing the connection drop.
    async fn end(&self, client: &mut Stream, framing: &Framing, why: String) -> Relayed {
        tracing::warn!(upstream = %self.server, error = %why, "upstream failed mid-answer");
        if self.event_stream {
            let event = super::mid_stream_error_event(self.model, &why);
            let ending = match framing {
                Framing::Chunked(chunked) if chunked.between_chunks() => {
                    let mut ending = format!("{:x}\r\n", event.len()).into_bytes();
                    ending.extend_from_slice(&event);
                    ending.extend_from_slice(b"\r\n0\r\n\r\n");
                    Some(ending)
                }
                Framing::Close => Some(event),
                _ => None,
            };
            if let Some(ending) = ending
                && let Err(e) = send_within(client, &ending, self.send_timeout).await
            {
                tracing::debug!(error = %e, "client went away before the error event");
            }
        }
        Relayed::BrokeOff(self.status)
    }
}

/// Writes `bytes` to the client, which must take them within `wait`: a client that reads
/// nothing holds its answer in the socket buffers only, and then loses it.
pub(crate) async fn send_within(
    client: &mut Stream,
    bytes: &[u8],
    wait: std::time::Duration,
) -> std::io::Result<()> {
    let written = async {
        client.write_all(bytes).await?;
        client.flush().await
    };
    within(wait, written)
        .await
        .unwrap_or_else(|_| Err(std::io::ErrorKind::TimedOut.into()))
}

/// The client left: the upstream connection is dropped with its unread answer, not reused.
fn client_gone(status: StatusCode, error: &std::io::Error) -> Relayed {
    tracing::debug!(error = %error, %status, "client went away mid-answer");
    Relayed::Answered {
        status: CLIENT_CLOSED,
        keep_alive: false,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::config::UpstreamAddr;
    use crate::upstream::ClientHop;
    use crate::wire::http1::Request;

    #[test]
    fn the_relayed_request_names_the_server_and_carries_the_key_the_pool_says() {
        let request = b"POST /v1/chat/completions?a=1 HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer sk-client\r\nConnection: keep-alive\r\nX-Trace: 7\r\nContent-Length: 2\r\n\r\n{}";
        let Request::Passable(passable) = http1::parse_request(request, 1024) else {
            panic!("passable");
        };
        let target = Target::new(UpstreamAddr::try_from("vllm:8000".to_owned()).unwrap());
        let hop = ClientHop::new(Some([127, 0, 0, 1].into()), false, &[]).headers(|_| None);
        let text =
            |auth| String::from_utf8(wire(request, &passable, &target, &auth, &hop)).unwrap();
        const FORWARDED: &str = "x-forwarded-for: 127.0.0.1\r\nx-forwarded-proto: http\r\nforwarded: for=127.0.0.1;proto=http\r\n";
        assert_eq!(
            text(UpstreamAuth::PassThrough),
            format!(
                "POST /v1/chat/completions?a=1 HTTP/1.1\r\nhost: vllm:8000\r\nauthorization: Bearer sk-client\r\nX-Trace: 7\r\n{FORWARDED}content-length: 2\r\n\r\n{{}}"
            )
        );
        assert_eq!(
            text(UpstreamAuth::Strip),
            format!(
                "POST /v1/chat/completions?a=1 HTTP/1.1\r\nhost: vllm:8000\r\nX-Trace: 7\r\n{FORWARDED}content-length: 2\r\n\r\n{{}}"
            )
        );
        let key = UpstreamAuth::Key(http::HeaderValue::from_static("Bearer sk-up"));
        assert!(text(key).contains("\r\nauthorization: Bearer sk-up\r\n"));
    }
}
