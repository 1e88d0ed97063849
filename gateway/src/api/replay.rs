//! A client connection whose first bytes were already read (by the lane, to see whether a request
//! is its own), handed to pingora's session with those bytes read again first.
//!
//! pingora takes such bytes as a "pipelined prefix", but refuses a prefix over its header limit
//! (1 MiB) before parsing it, as if it were all header: a request whose body the lane had read
//! (a large image in a data URL, a chunked upload followed to its end) would be dropped. Replayed
//! from the stream instead, in reads of at most [`REPLAY_READ`] bytes, the bytes reach pingora as
//! if they came from the socket.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use async_trait::async_trait;
use bytes::{Buf, BytesMut};
use pingora::protocols::raw_connect::ProxyDigest;
use pingora::protocols::{
    GetProxyDigest, GetSocketDigest, GetTimingDigest, Peek, Shutdown, SocketDigest, Ssl, Stream,
    TimingDigest, UniqueID, UniqueIDType,
};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// The most bytes one read hands back from the replayed prefix.
const REPLAY_READ: usize = 64 * 1024;

/// `prefix`, then whatever `inner` reads.
#[derive(Debug)]
pub struct Replay {
    prefix: BytesMut,
    inner: Stream,
}

impl Replay {
    pub fn stream(prefix: BytesMut, inner: Stream) -> Stream {
        Box::new(Replay { prefix, inner })
    }

    /// `stream` without a replay wrapper that has nothing left to replay (so a kept-alive
    /// connection does not gather wrappers request after request).
    pub fn unwrap(stream: Stream) -> Stream {
        if !stream.as_any().is::<Replay>() {
            return stream;
        }
        match stream.into_any().downcast::<Replay>() {
            Ok(replay) if replay.prefix.is_empty() => replay.inner,
            Ok(replay) => replay,
            Err(_) => unreachable!("checked to be a Replay above"),
        }
    }
}

impl AsyncRead for Replay {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        if self.prefix.is_empty() {
            return Pin::new(&mut self.inner).poll_read(cx, buf);
        }
        let n = self.prefix.len().min(buf.remaining()).min(REPLAY_READ);
        buf.put_slice(&self.prefix[..n]);
        self.prefix.advance(n);
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for Replay {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[async_trait]
impl Shutdown for Replay {
    async fn shutdown(&mut self) {
        self.inner.shutdown().await;
    }
}

impl UniqueID for Replay {
    fn id(&self) -> UniqueIDType {
        self.inner.id()
    }
}

impl Ssl for Replay {
    fn get_ssl(&self) -> Option<&pingora::protocols::tls::TlsRef> {
        self.inner.get_ssl()
    }

    fn get_ssl_digest(&self) -> Option<Arc<pingora::protocols::tls::SslDigest>> {
        self.inner.get_ssl_digest()
    }

    fn selected_alpn_proto(&self) -> Option<pingora::protocols::ALPN> {
        self.inner.selected_alpn_proto()
    }
}

impl GetTimingDigest for Replay {
    fn get_timing_digest(&self) -> Vec<Option<TimingDigest>> {
        self.inner.get_timing_digest()
    }

    fn get_read_pending_time(&self) -> Duration {
        self.inner.get_read_pending_time()
    }

    fn get_write_pending_time(&self) -> Duration {
        self.inner.get_write_pending_time()
    }
}

impl GetProxyDigest for Replay {
    fn get_proxy_digest(&self) -> Option<Arc<ProxyDigest>> {
        self.inner.get_proxy_digest()
    }
}

impl GetSocketDigest for Replay {
    fn get_socket_digest(&self) -> Option<Arc<SocketDigest>> {
        self.inner.get_socket_digest()
    }
}

#[async_trait]
impl Peek for Replay {}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use tokio::io::AsyncReadExt;

    use super::*;

    #[tokio::test]
    async fn the_prefix_is_read_first_in_bounded_pieces_then_the_stream() {
        let (client, mut server) = tokio::io::duplex(1024);
        let prefix = BytesMut::from(&vec![7u8; 3 * REPLAY_READ / 2][..]);
        let mut stream = Replay::stream(prefix, Box::new(client));
        tokio::io::AsyncWriteExt::write_all(&mut server, b"rest")
            .await
            .unwrap();
        let mut buf = vec![0; 4 * REPLAY_READ];
        assert_eq!(stream.read(&mut buf).await.unwrap(), REPLAY_READ);
        assert_eq!(stream.read(&mut buf).await.unwrap(), REPLAY_READ / 2);
        assert_eq!(stream.read(&mut buf).await.unwrap(), 4);
        assert_eq!(&buf[..4], b"rest");
        let unwrapped = Replay::unwrap(stream);
        assert!(!unwrapped.as_any().is::<Replay>());
    }
}
