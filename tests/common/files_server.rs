//! A minimal HTTP/1.1 server on loopback for media URLs: fixed paths answer with fixed bodies or
//! redirects; anything else is a 404.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::sync::Arc;

pub enum Answer {
    Body { content_type: String, data: Vec<u8> },
    Redirect(String),
}

pub struct FilesServer {
    pub base: String,
}

impl FilesServer {
    pub fn start(routes: HashMap<String, Answer>) -> FilesServer {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let routes = Arc::new(routes);
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { continue };
                let routes = routes.clone();
                std::thread::spawn(move || {
                    let mut reader = BufReader::new(stream.try_clone().unwrap());
                    let mut line = String::new();
                    if reader.read_line(&mut line).is_err() {
                        return;
                    }
                    // Skip the headers.
                    loop {
                        let mut header = String::new();
                        if reader.read_line(&mut header).is_err() || header.trim().is_empty() {
                            break;
                        }
                    }
                    let path = line.split(' ').nth(1).unwrap_or("/").to_owned();
                    let (head, body): (String, &[u8]) = match routes.get(&path) {
                        Some(Answer::Body { content_type, data }) => (
                            format!(
                                "HTTP/1.1 200 OK\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                                data.len()
                            ),
                            data,
                        ),
                        Some(Answer::Redirect(to)) => (
                            format!("HTTP/1.1 302 Found\r\nLocation: {to}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"),
                            b"",
                        ),
                        None => (
                            "HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".into(),
                            b"",
                        ),
                    };
                    let _ = stream.write_all(head.as_bytes());
                    let _ = stream.write_all(body);
                });
            }
        });
        FilesServer { base }
    }
}
