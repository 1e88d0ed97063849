//! Kept-alive connections to upstream servers, one pool per HTTP worker thread.
//!
//! Taking or returning a connection is a thread-local pop or push: no lock, and no task watching
//! each idle connection (what pingora's shared pool does, at a spawn and a wake-up per request).
//! With `http_work_stealing = false` each worker is a single-threaded runtime, so a connection stays
//! with the reactor that registered it; with work stealing the runtime's one reactor serves every
//! worker and the pools are only split per thread. A connection the server closed while it sat here is
//! found out when it is taken (a read that does not block sees the end of the stream), or, the
//! oldest one, when another is returned; one older than the idle timeout is dropped then too.

use std::cell::RefCell;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use futures_util::FutureExt;
use pingora::protocols::Stream;
use tokio::io::AsyncReadExt;

/// How long an idle upstream connection is kept for the next request.
const IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// Idle connections kept per server and worker; past this, a returned connection is closed.
const MAX_IDLE_PER_SERVER: usize = 256;

struct Idle {
    stream: Stream,
    since: Instant,
    /// When it was last looked at for its server having closed it.
    looked: Instant,
}

/// A server address and the configured upstream the connection was made for (its TLS name and
/// trust differ from another's at the same address).
pub type Key = (SocketAddr, usize);

thread_local! {
    static IDLE: RefCell<HashMap<Key, Vec<Idle>>> = RefCell::new(HashMap::new());
}

/// The most recently used idle connection to `server` that is still open, if any.
pub fn take(server: Key) -> Option<Stream> {
    IDLE.with_borrow_mut(|idle| {
        let connections = idle.get_mut(&server)?;
        while let Some(mut connection) = connections.pop() {
            if connection.since.elapsed() > IDLE_TIMEOUT {
                // The rest have waited even longer.
                connections.clear();
                return None;
            }
            if still_open(&mut connection.stream) {
                return Some(connection.stream);
            }
        }
        None
    })
}

/// Keeps `stream`, whose last response was read completely, for the next request to `server`.
pub fn put(server: Key, stream: Stream) {
    IDLE.with_borrow_mut(|idle| {
        let connections = idle.entry(server).or_default();
        // One clock read for all of it: each is a few percent of a relayed request's own time.
        let now = Instant::now();
        retire_oldest(connections, now);
        if connections.len() < MAX_IDLE_PER_SERVER {
            connections.push(Idle {
                stream,
                since: now,
                looked: now,
            });
        }
    });
}

/// How often the oldest kept connection is looked at when another is returned.
const LOOK_EVERY: Duration = Duration::from_secs(1);

/// Drops the kept connections past the idle timeout, and the oldest one if its server has closed
/// it. Reuse takes the newest first, so without this a connection the server closed (its socket
/// in CLOSE-WAIT here) would wait until the load next reached that deep. The look is a read that
/// does not block, taken at most every [`LOOK_EVERY`] per connection: taken on every return it
/// cost the proxy measurable throughput under many connections (measured by `bench/proxy.py`).
fn retire_oldest(connections: &mut Vec<Idle>, now: Instant) {
    let expired = connections
        .iter()
        .take_while(|c| now.saturating_duration_since(c.since) > IDLE_TIMEOUT)
        .count();
    connections.drain(..expired);
    let Some(oldest) = connections.first_mut() else {
        return;
    };
    if now.saturating_duration_since(oldest.looked) < LOOK_EVERY {
        return;
    }
    oldest.looked = now;
    if !still_open(&mut oldest.stream) {
        connections.remove(0);
    }
}

/// Whether an idle connection can take a request: a server never speaks first on an idle HTTP/1
/// connection, so anything readable (the end of the stream, an error, stray bytes) retires it.
fn still_open(stream: &mut Stream) -> bool {
    let mut byte = [0u8; 1];
    // `unconstrained`: the task's cooperative budget must not turn a ready read into "pending".
    tokio::task::unconstrained(stream.read(&mut byte))
        .now_or_never()
        .is_none()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::time::Duration;

    use pingora::protocols::l4::stream::Stream as TcpStream;
    use tokio::net::{TcpListener, TcpStream as TokioTcpStream};

    use super::*;

    #[tokio::test]
    async fn an_open_connection_is_reused_and_one_the_server_closed_is_not() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = (addr, 0);
        let client = TokioTcpStream::connect(addr).await.unwrap();
        let (accepted, _) = listener.accept().await.unwrap();
        assert!(take(server).is_none(), "nothing kept yet");

        put(server, Box::new(TcpStream::from(client)));
        let stream = take(server).unwrap();
        assert!(take(server).is_none(), "taken once");

        put(server, stream);
        drop(accepted);
        // The server's FIN reaches the client's reactor within a few turns of it.
        for _ in 0..500 {
            tokio::time::sleep(Duration::from_millis(10)).await;
            if IDLE.with_borrow(|idle| idle[&server].is_empty()) {
                break;
            }
            match take(server) {
                None => break,
                Some(stream) => put(server, stream),
            }
        }
        assert!(take(server).is_none(), "a closed connection was handed out");
    }

    /// Returning connections retires the oldest kept one once its server has closed it, though
    /// reuse (newest first) never reaches it.
    #[tokio::test]
    async fn returning_a_connection_retires_the_oldest_once_its_server_closed_it() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = (addr, 1);
        let oldest = TokioTcpStream::connect(addr).await.unwrap();
        let (oldest_peer, _) = listener.accept().await.unwrap();
        let newest = TokioTcpStream::connect(addr).await.unwrap();
        let (_newest_peer, _) = listener.accept().await.unwrap();
        put(server, Box::new(TcpStream::from(oldest)));
        put(server, Box::new(TcpStream::from(newest)));

        drop(oldest_peer);
        let kept = || IDLE.with_borrow(|idle| idle[&server].len());
        // The server's FIN reaches the client's reactor within a few turns of it; the oldest is
        // looked at once it has waited `LOOK_EVERY`.
        for _ in 0..1000 {
            tokio::time::sleep(Duration::from_millis(10)).await;
            let stream = take(server).unwrap();
            put(server, stream);
            if kept() == 1 {
                break;
            }
        }
        assert_eq!(kept(), 1, "the connection its server closed is still kept");
        assert!(take(server).is_some(), "the open one was retired instead");
    }
}
