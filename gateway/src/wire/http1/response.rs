//! An upstream's HTTP/1.1 response on the wire: where its head ends and what the client is sent of
//! it, and how its body is framed (a length, chunks, or the connection's end), followed chunk by
//! chunk so the body can be relayed as bytes.

use super::{HopByHop, MAX_HEADERS, content_length};

/// An upstream's response head, rewritten for the client.
#[derive(Debug, PartialEq, Eq)]
pub struct ResponseHead {
    /// Bytes of the upstream's status line and headers, the blank line included.
    pub head_len: usize,
    pub status: u16,
    /// How the body that follows ends.
    pub framing: Framing,
    /// Whether the upstream connection may take another request after this response.
    pub reusable: bool,
    /// The head the client gets: the status line and the headers less the hop-by-hop ones (a body
    /// that ends when the connection does adds `connection: close`).
    pub client_head: Vec<u8>,
    /// Whether the body is a stream of server-sent events (`Content-Type: text/event-stream`).
    pub event_stream: bool,
}

impl ResponseHead {
    /// Makes the client's head say the connection ends after this response (`connection: close`),
    /// as a server shutting down says it.
    pub fn announce_close(&mut self) {
        // A close-delimited body says so already.
        if self.framing != Framing::Close {
            self.client_head.truncate(self.client_head.len() - 2);
            self.client_head
                .extend_from_slice(b"connection: close\r\n\r\n");
        }
    }
}

/// Why an upstream's response cannot be relayed.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ResponseError {
    #[error("the upstream's response head is not HTTP/1: {0}")]
    Head(String),
    #[error("the upstream's response has an invalid Content-Length")]
    Length,
    #[error("the upstream's chunked body is malformed")]
    Chunk,
}

/// Looks at the response at the start of `buf`: `None` until its head is complete. Informational
/// (1xx) heads come back as they are; the caller skips them.
pub fn parse_response(buf: &[u8]) -> Result<Option<ResponseHead>, ResponseError> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut response = httparse::Response::new(&mut headers);
    let head_len = match response.parse(buf) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(e) => return Err(ResponseError::Head(e.to_string())),
    };
    let (Some(version), Some(status)) = (response.version, response.code) else {
        return Err(ResponseError::Head("no status".to_owned()));
    };
    let mut client_head = Vec::with_capacity(head_len + 32);
    client_head.extend_from_slice(b"HTTP/1.1 ");
    // httparse reads a status as exactly three digits.
    client_head.extend_from_slice(&[
        b'0' + (status / 100 % 10) as u8,
        b'0' + (status / 10 % 10) as u8,
        b'0' + (status % 10) as u8,
    ]);
    client_head.push(b' ');
    client_head.extend_from_slice(response.reason.unwrap_or("").as_bytes());
    client_head.extend_from_slice(b"\r\n");

    let hop = HopByHop::new(
        response
            .headers
            .iter()
            .filter(|h| h.name.eq_ignore_ascii_case("connection"))
            .map(|h| h.value),
    );
    let transfer_encoded = response
        .headers
        .iter()
        .any(|h| h.name.eq_ignore_ascii_case("transfer-encoding"));
    let mut length = None;
    let mut chunked = false;
    let mut close = version == 0;
    let mut event_stream = false;
    for header in response.headers.iter() {
        let name = header.name;
        if name.eq_ignore_ascii_case("content-type") {
            event_stream = header
                .value
                .trim_ascii_start()
                .get(..17)
                .is_some_and(|t| t.eq_ignore_ascii_case(b"text/event-stream"));
        }
        if name.eq_ignore_ascii_case("content-length") {
            let n = content_length(header.value).ok_or(ResponseError::Length)?;
            if length.is_some_and(|m| m != n) {
                return Err(ResponseError::Length);
            }
            length = Some(n);
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            // Only the last coding decides the framing (RFC 9112 6.3).
            chunked = header
                .value
                .rsplit(|&b| b == b',')
                .next()
                .is_some_and(|last| last.trim_ascii().eq_ignore_ascii_case(b"chunked"));
        } else if name.eq_ignore_ascii_case("connection") {
            let value = header.value;
            if value
                .split(|&b| b == b',')
                .any(|t| t.trim_ascii().eq_ignore_ascii_case(b"close"))
            {
                close = true;
            } else if version == 0
                && value
                    .split(|&b| b == b',')
                    .any(|t| t.trim_ascii().eq_ignore_ascii_case(b"keep-alive"))
            {
                close = false;
            }
        }
        if hop.drops(name) {
            continue;
        }
        // With Transfer-Encoding, Content-Length means nothing (RFC 9112 6.3) and is not passed on.
        if transfer_encoded && name.eq_ignore_ascii_case("content-length") {
            continue;
        }
        client_head.extend_from_slice(name.as_bytes());
        client_head.extend_from_slice(b": ");
        client_head.extend_from_slice(header.value);
        client_head.extend_from_slice(b"\r\n");
    }
    // A response framed both ways may be an attempt to desynchronise the connection: it is read
    // by its Transfer-Encoding and the upstream connection is not reused (RFC 9112 6.3).
    if transfer_encoded && length.is_some() {
        close = true;
    }
    let framing = if (100..200).contains(&status) || status == 204 || status == 304 {
        Framing::Empty
    } else if transfer_encoded {
        if chunked {
            Framing::Chunked(Chunked::default())
        } else {
            Framing::Close
        }
    } else if let Some(n) = length {
        Framing::Length(n)
    } else {
        Framing::Close
    };
    if framing == Framing::Close {
        client_head.extend_from_slice(b"connection: close\r\n");
    }
    client_head.extend_from_slice(b"\r\n");
    Ok(Some(ResponseHead {
        head_len,
        status,
        reusable: !close && framing != Framing::Close,
        framing,
        client_head,
        event_stream,
    }))
}

/// Where a response body ends.
#[derive(Debug, PartialEq, Eq)]
pub enum Framing {
    /// No body (1xx, 204, 304).
    Empty,
    /// This many bytes still to come.
    Length(usize),
    Chunked(Chunked),
    /// Until the upstream closes the connection.
    Close,
}

/// How much of a buffer belongs to the body.
#[derive(Debug, PartialEq, Eq)]
pub struct Progress {
    /// Bytes at the start of the buffer that are body (framing included, for chunked bodies).
    pub body: usize,
    /// Whether the body ended within them.
    pub done: bool,
}

impl Framing {
    /// Takes the next bytes of the body from the start of `buf`.
    pub fn advance(&mut self, buf: &[u8]) -> Result<Progress, ResponseError> {
        match self {
            Framing::Empty => Ok(Progress {
                body: 0,
                done: true,
            }),
            Framing::Length(left) => {
                let body = (*left).min(buf.len());
                *left -= body;
                Ok(Progress {
                    body,
                    done: *left == 0,
                })
            }
            Framing::Chunked(chunked) => chunked.advance(buf),
            Framing::Close => Ok(Progress {
                body: buf.len(),
                done: false,
            }),
        }
    }
}

/// Where a chunked body is (RFC 9112 7.1): followed byte by byte, never decoded, so the receiver
/// gets the chunks as they came. Every line must end in CRLF: a bare CR or LF in a chunk line or a
/// trailer is refused (RFC 9112 allows a lenient reader to accept a bare LF; a proxy that did
/// would frame the body differently from a strict one beside it).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Chunked {
    state: ChunkState,
}

#[derive(Debug, Default, PartialEq, Eq, Clone, Copy)]
enum ChunkState {
    /// In a chunk's size (this much so far).
    #[default]
    SizeStart,
    Size(u64),
    /// Whitespace after the size.
    SizeSpace(u64),
    /// After the size: an extension, up to the line's end.
    Extension(u64),
    SizeLf(u64),
    Data(u64),
    DataCr,
    DataLf,
    /// At the start of a trailer line (or the final blank line).
    TrailerStart,
    Trailer,
    TrailerLf,
    FinalLf,
    Done,
}

impl Chunked {
    /// Whether what was taken so far ends between chunks (where another chunk may follow).
    pub fn between_chunks(&self) -> bool {
        self.state == ChunkState::SizeStart
    }

    /// Takes the next bytes of the body from the start of `buf`.
    pub fn advance(&mut self, buf: &[u8]) -> Result<Progress, ResponseError> {
        use ChunkState::*;
        let mut i = 0;
        while i < buf.len() && self.state != Done {
            let byte = buf[i];
            self.state = match self.state {
                SizeStart | Size(_) => {
                    let size = match self.state {
                        Size(n) => n,
                        _ => 0,
                    };
                    match byte {
                        b'0'..=b'9' | b'a'..=b'f' | b'A'..=b'F' => {
                            let digit = u64::from((byte as char).to_digit(16).unwrap_or(0));
                            if size >> 56 != 0 {
                                return Err(ResponseError::Chunk);
                            }
                            Size(size * 16 + digit)
                        }
                        _ if self.state == SizeStart => return Err(ResponseError::Chunk),
                        b';' => Extension(size),
                        b' ' | b'\t' => SizeSpace(size),
                        b'\r' => SizeLf(size),
                        _ => return Err(ResponseError::Chunk),
                    }
                }
                // Whitespace after the size may only lead to an extension or the line's end.
                SizeSpace(size) => match byte {
                    b' ' | b'\t' => SizeSpace(size),
                    b';' => Extension(size),
                    b'\r' => SizeLf(size),
                    _ => return Err(ResponseError::Chunk),
                },
                // A bare CR or LF (or any other control byte) inside a chunk line is where two
                // parsers could end the line in different places: refused, never passed on.
                Extension(size) => match byte {
                    b'\r' => SizeLf(size),
                    b'\t' => Extension(size),
                    0..=0x1f | 0x7f => return Err(ResponseError::Chunk),
                    _ => Extension(size),
                },
                SizeLf(size) if byte == b'\n' => Self::after_size(size),
                Data(left) => {
                    let take = usize::try_from(left)
                        .unwrap_or(usize::MAX)
                        .min(buf.len() - i);
                    i += take;
                    let left = left - take as u64;
                    self.state = if left == 0 { DataCr } else { Data(left) };
                    continue;
                }
                DataCr if byte == b'\r' => DataLf,
                DataLf if byte == b'\n' => SizeStart,
                TrailerStart => match byte {
                    b'\r' => FinalLf,
                    b'\n' => return Err(ResponseError::Chunk),
                    _ => Trailer,
                },
                Trailer => match byte {
                    b'\r' => TrailerLf,
                    b'\n' => return Err(ResponseError::Chunk),
                    _ => Trailer,
                },
                TrailerLf if byte == b'\n' => TrailerStart,
                FinalLf if byte == b'\n' => Done,
                SizeLf(_) | DataCr | DataLf | TrailerLf | FinalLf | Done => {
                    return Err(ResponseError::Chunk);
                }
            };
            i += 1;
        }
        Ok(Progress {
            body: i,
            done: self.state == Done,
        })
    }

    fn after_size(size: u64) -> ChunkState {
        if size == 0 {
            ChunkState::TrailerStart
        } else {
            ChunkState::Data(size)
        }
    }
}
