//! The tests' one HTTP/1.1 client, over a blocking [`TcpStream`]: raw bytes are the point for
//! the tests that must send what a well-behaved client library never would (a header twice, a
//! lying `Content-Length`, chunked bodies, invalid UTF-8, raw bytes in header values) or read a
//! response as it streams. Response heads are parsed by `httparse`; bodies are read by
//! `Content-Length`, chunked framing or to EOF. Every socket operation has a timeout, so a
//! server that hangs fails the test instead of hanging it. Async tests use [`post_json`].
//!
//! ```no_run
//! use idempotency_e2e::raw_http::{Conn, Request};
//! let mut conn = Conn::connect("127.0.0.1:8080", std::time::Duration::from_secs(5)).unwrap();
//! let response = conn
//!     .send(&Request::post("/payments").key("k1").json(r#"{"amount":1,"currency":"EUR"}"#))
//!     .unwrap();
//! assert_eq!(response.status, 201);
//! ```

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

/// Largest response head or body this client reads (a guard against a runaway server).
const MAX_RESPONSE_BYTES: usize = 64 * 1024 * 1024;

/// A response head: the status and the header fields, names lower-cased as received.
pub type Head = (u16, Vec<(String, Vec<u8>)>);

/// One parsed response.
#[derive(Debug, Clone)]
pub struct Response {
    /// The status code.
    pub status: u16,
    /// Header names (lower case) and raw values, in order.
    pub headers: Vec<(String, Vec<u8>)>,
    /// The body, de-chunked.
    pub body: Vec<u8>,
}

impl Response {
    /// The first value of `name` (case-insensitive), as lossy UTF-8.
    pub fn header(&self, name: &str) -> Option<String> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
    }

    /// Every value of `name`.
    pub fn header_all(&self, name: &str) -> Vec<Vec<u8>> {
        self.headers
            .iter()
            .filter(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.clone())
            .collect()
    }

    /// `Idempotent-Replayed: true`?
    pub fn is_replay(&self) -> bool {
        self.header("idempotent-replayed").as_deref() == Some("true")
    }

    /// The `code` of an `application/problem+json` body, if it is one.
    pub fn problem_code(&self) -> Option<String> {
        let content_type = self.header("content-type")?;
        if !content_type.starts_with("application/problem+json") {
            return None;
        }
        let json: serde_json::Value = serde_json::from_slice(&self.body).ok()?;
        json.get("code")?.as_str().map(str::to_owned)
    }

    /// The body parsed as JSON (`Null` if it is not JSON).
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or(serde_json::Value::Null)
    }

    /// The body as lossy UTF-8.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// A one-line description for assertion messages.
    pub fn describe(&self) -> String {
        let mut body = self.text();
        if body.len() > 300 {
            body.truncate(300);
            body.push_str("...");
        }
        format!("{} {:?} {body}", self.status, self.problem_code())
    }
}

/// A request to serialise. Headers are sent exactly as given, in order, so a test can repeat
/// one or put raw bytes in a value.
#[derive(Debug, Clone)]
pub struct Request {
    /// Method, sent as is.
    pub method: String,
    /// Request target (path and query).
    pub target: String,
    /// Headers, raw.
    pub headers: Vec<(String, Vec<u8>)>,
    /// How the body is framed.
    pub body: Body,
}

/// The body and its framing.
#[derive(Debug, Clone)]
pub enum Body {
    /// No body and no `Content-Length`.
    None,
    /// `Content-Length: <len>` and the bytes.
    Sized(Vec<u8>),
    /// `Transfer-Encoding: chunked`, the bytes in chunks of the given size.
    Chunked(Vec<u8>, usize),
    /// Bytes written as they are after the head; the test wrote any framing headers itself.
    Raw(Vec<u8>),
}

impl Request {
    /// A request with no headers and no body.
    pub fn new(method: &str, target: &str) -> Self {
        Self {
            method: method.to_owned(),
            target: target.to_owned(),
            headers: Vec::new(),
            body: Body::None,
        }
    }

    /// `POST target`.
    pub fn post(target: &str) -> Self {
        Self::new("POST", target)
    }

    /// `GET target`.
    pub fn get(target: &str) -> Self {
        Self::new("GET", target)
    }

    /// Add a header (repeating a name sends it twice).
    pub fn header(mut self, name: &str, value: impl AsRef<[u8]>) -> Self {
        self.headers
            .push((name.to_owned(), value.as_ref().to_vec()));
        self
    }

    /// Add `Idempotency-Key: <key>`, raw.
    pub fn key(self, key: impl AsRef<[u8]>) -> Self {
        self.header("Idempotency-Key", key)
    }

    /// A JSON body with `Content-Length`.
    pub fn json(self, body: impl AsRef<[u8]>) -> Self {
        self.header("Content-Type", "application/json")
            .body(Body::Sized(body.as_ref().to_vec()))
    }

    /// Set the body.
    pub fn body(mut self, body: Body) -> Self {
        self.body = body;
        self
    }

    /// The bytes on the wire.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(format!("{} {} HTTP/1.1\r\n", self.method, self.target).as_bytes());
        let has = |name: &str| {
            self.headers
                .iter()
                .any(|(n, _)| n.eq_ignore_ascii_case(name))
        };
        if !has("host") {
            out.extend_from_slice(b"Host: 127.0.0.1\r\n");
        }
        for (name, value) in &self.headers {
            out.extend_from_slice(name.as_bytes());
            out.extend_from_slice(b": ");
            out.extend_from_slice(value);
            out.extend_from_slice(b"\r\n");
        }
        match &self.body {
            Body::None => out.extend_from_slice(b"\r\n"),
            Body::Sized(bytes) => {
                out.extend_from_slice(
                    format!("Content-Length: {}\r\n\r\n", bytes.len()).as_bytes(),
                );
                out.extend_from_slice(bytes);
            }
            Body::Chunked(bytes, size) => {
                out.extend_from_slice(b"Transfer-Encoding: chunked\r\n\r\n");
                for chunk in bytes.chunks((*size).max(1)) {
                    out.extend_from_slice(format!("{:x}\r\n", chunk.len()).as_bytes());
                    out.extend_from_slice(chunk);
                    out.extend_from_slice(b"\r\n");
                }
                out.extend_from_slice(b"0\r\n\r\n");
            }
            Body::Raw(bytes) => {
                out.extend_from_slice(b"\r\n");
                out.extend_from_slice(bytes);
            }
        }
        out
    }
}

/// A keep-alive connection.
pub struct Conn {
    reader: BufReader<TcpStream>,
    timeout: Duration,
}

impl std::fmt::Debug for Conn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Conn")
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl Conn {
    /// Connect with `timeout` applied to the connect and to every read and write.
    pub fn connect(addr: impl ToSocketAddrs, timeout: Duration) -> io::Result<Conn> {
        let addr = addr
            .to_socket_addrs()?
            .next()
            .ok_or_else(|| io::Error::other("no address"))?;
        assert!(addr.ip().is_loopback(), "tests talk to loopback only");
        let stream = TcpStream::connect_timeout(&addr, timeout)?;
        stream.set_read_timeout(Some(timeout))?;
        stream.set_write_timeout(Some(timeout))?;
        stream.set_nodelay(true)?;
        Ok(Conn {
            reader: BufReader::new(stream),
            timeout,
        })
    }

    /// Send a request and read its response.
    pub fn send(&mut self, request: &Request) -> io::Result<Response> {
        self.send_raw(&request.to_bytes())?;
        self.read_response(&request.method)
    }

    /// Write raw bytes.
    pub fn send_raw(&mut self, bytes: &[u8]) -> io::Result<()> {
        let stream = self.reader.get_mut();
        stream.write_all(bytes)?;
        stream.flush()
    }

    /// Close the writing half (the server sees EOF).
    pub fn shutdown_write(&mut self) -> io::Result<()> {
        self.reader.get_mut().shutdown(Shutdown::Write)
    }

    /// Read one response (to a request with `method`, which decides whether a body follows).
    pub fn read_response(&mut self, method: &str) -> io::Result<Response> {
        let head = self.read_head_bytes()?;
        let (status, headers) = parse_head(&head)?;
        let mut response = Response {
            status,
            headers,
            body: Vec::new(),
        };
        let no_body = method.eq_ignore_ascii_case("HEAD")
            || status / 100 == 1
            || status == 204
            || status == 304;
        if no_body {
            return Ok(response);
        }
        let chunked = response
            .header("transfer-encoding")
            .is_some_and(|te| te.to_ascii_lowercase().contains("chunked"));
        if chunked {
            response.body = self.read_chunked()?;
        } else if let Some(len) = response.header("content-length") {
            let len: usize = len
                .trim()
                .parse()
                .map_err(|_| io::Error::other("bad content-length"))?;
            if len > MAX_RESPONSE_BYTES {
                return Err(io::Error::other("response body too large"));
            }
            let mut body = vec![0; len];
            self.reader.read_exact(&mut body)?;
            response.body = body;
        } else {
            // Delimited by close.
            let mut body = Vec::new();
            self.reader
                .by_ref()
                .take(MAX_RESPONSE_BYTES as u64)
                .read_to_end(&mut body)?;
            response.body = body;
        }
        Ok(response)
    }

    fn read_chunked(&mut self) -> io::Result<Vec<u8>> {
        let mut body = Vec::new();
        loop {
            let mut line = String::new();
            self.reader.read_line(&mut line)?;
            let size_text = line.trim().split(';').next().unwrap_or_default();
            let size = usize::from_str_radix(size_text, 16)
                .map_err(|_| io::Error::other(format!("bad chunk size {line:?}")))?;
            if size == 0 {
                // Trailers, then the empty line.
                loop {
                    let mut trailer = String::new();
                    if self.reader.read_line(&mut trailer)? == 0 || trailer.trim().is_empty() {
                        return Ok(body);
                    }
                }
            }
            if body.len() + size > MAX_RESPONSE_BYTES {
                return Err(io::Error::other("chunked body too large"));
            }
            let start = body.len();
            body.resize(start + size, 0);
            self.reader.read_exact(&mut body[start..])?;
            let mut crlf = [0u8; 2];
            self.reader.read_exact(&mut crlf)?;
        }
    }

    /// Close the connection with a TCP reset (RST) instead of a FIN: `SO_LINGER` 0 makes the
    /// kernel drop unsent data and send RST on close, as a crashed or impatient client would.
    pub fn reset(self) -> io::Result<()> {
        let socket = socket2::SockRef::from(self.reader.get_ref());
        socket.set_linger(Some(Duration::ZERO))?;
        drop(self);
        Ok(())
    }

    /// Read only a response head (status line and headers), leaving the body on the wire.
    pub fn read_head(&mut self) -> io::Result<Head> {
        parse_head(&self.read_head_bytes()?)
    }

    /// The bytes of one response head, up to and including the empty line.
    fn read_head_bytes(&mut self) -> io::Result<Vec<u8>> {
        let deadline = Instant::now() + self.timeout;
        let mut head = Vec::new();
        loop {
            let before = head.len();
            let n = self.reader.read_until(b'\n', &mut head)?;
            if n == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "connection closed before a complete response head",
                ));
            }
            if head[before..] == *b"\r\n" || head[before..] == *b"\n" {
                return Ok(head);
            }
            if head.len() > MAX_RESPONSE_BYTES || Instant::now() > deadline {
                return Err(io::Error::other("response head too large or too slow"));
            }
        }
    }

    /// Read until the bytes read so far contain `needle` (or the read times out).
    pub fn read_until_contains(&mut self, needle: &[u8]) -> io::Result<Vec<u8>> {
        let mut seen = Vec::new();
        let mut buf = [0u8; 4096];
        while !seen.windows(needle.len().max(1)).any(|w| w == needle) {
            let n = self.reader.read(&mut buf)?;
            if n == 0 {
                return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "closed"));
            }
            seen.extend_from_slice(&buf[..n]);
        }
        Ok(seen)
    }

    /// Read whatever bytes arrive until the server closes the connection or `wait` passes.
    pub fn read_rest(&mut self, wait: Duration) -> Vec<u8> {
        let _ = self.reader.get_mut().set_read_timeout(Some(wait));
        let mut rest = Vec::new();
        let _ = self.reader.read_to_end(&mut rest);
        let _ = self.reader.get_mut().set_read_timeout(Some(self.timeout));
        rest
    }

    /// Whether the server closed the connection (reads EOF or an error within `wait`).
    pub fn is_closed_by_peer(&mut self, wait: Duration) -> bool {
        let _ = self.reader.get_mut().set_read_timeout(Some(wait));
        let mut byte = [0u8; 1];
        let closed = matches!(self.reader.read(&mut byte), Ok(0) | Err(_));
        let _ = self.reader.get_mut().set_read_timeout(Some(self.timeout));
        closed
    }
}

/// Parse a complete response head (status line, header fields, the empty line) with
/// httparse. Names are lower-cased; values are kept as raw bytes, so non-UTF-8 values survive.
fn parse_head(raw: &[u8]) -> io::Result<Head> {
    let mut fields = [httparse::EMPTY_HEADER; 128];
    let mut parsed = httparse::Response::new(&mut fields);
    match parsed.parse(raw) {
        Ok(httparse::Status::Complete(_)) => {}
        Ok(httparse::Status::Partial) => {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "incomplete response head",
            ))
        }
        Err(e) => return Err(io::Error::new(io::ErrorKind::InvalidData, e)),
    }
    let status = parsed
        .code
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "no status code"))?;
    let headers = parsed
        .headers
        .iter()
        .map(|h| (h.name.to_ascii_lowercase(), h.value.to_vec()))
        .collect();
    Ok((status, headers))
}

/// One request on a fresh connection (closed afterwards).
pub fn send_once(addr: &str, request: &Request, timeout: Duration) -> io::Result<Response> {
    Conn::connect(addr, timeout)?.send(request)
}

/// How long [`post_json`] may take, connect to last byte.
const ASYNC_TIMEOUT: Duration = Duration::from_secs(30);

/// `POST path` with `Idempotency-Key: key` and a JSON `body`, on a fresh connection, from async
/// tests: the blocking client on tokio's blocking pool, so the test's runtime (and a server
/// running on it) keeps going while the request waits.
pub async fn post_json(
    addr: SocketAddr,
    path: &str,
    key: &str,
    body: &str,
) -> io::Result<Response> {
    let request = Request::post(path).key(key).json(body);
    tokio::task::spawn_blocking(move || Conn::connect(addr, ASYNC_TIMEOUT)?.send(&request))
        .await
        .map_err(io::Error::other)?
}

/// A free TCP port on 127.0.0.1 (bound and released; a tiny race with other processes).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port on 127.0.0.1")
}
