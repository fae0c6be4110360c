//! TCP proxies for fault and round-trip tests, first of all in front of PostgreSQL.
//!
//! - [`PgProxy::stop`] closes the port and cuts every connection (the database "goes away");
//!   [`PgProxy::resume`] listens on the same port again (it "comes back").
//! - It parses the frontend (client to server) side of the PostgreSQL wire protocol and counts
//!   messages by type, so a test can assert how many round trips an operation cost: with the
//!   extended query protocol every round trip ends in one `Sync` (`S`), a simple query is one
//!   `Query` (`Q`), and a `Parse` (`P`) means a statement was (re)prepared.
//!
//! Only plain connections can be parsed (TLS is opaque); forwarding works either way.
//!
//! [`delaying_proxy`] is a second, simpler proxy: it holds back one chunk carrying a marker (a
//! late answer, or a statement that reaches the server late). [`FaultyProxy`], for any
//! protocol, black-holes open connections or swallows replies.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// Message counts seen from clients, by message type byte.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct MessageCounts(pub HashMap<u8, u64>);

impl std::fmt::Debug for MessageCounts {
    /// `B=1 E=1 S=1`: message type letters, sorted.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut kinds: Vec<_> = self.0.iter().collect();
        kinds.sort();
        let parts: Vec<String> = kinds
            .iter()
            .map(|(k, v)| format!("{}={v}", char::from(**k)))
            .collect();
        f.write_str(&parts.join(" "))
    }
}

impl MessageCounts {
    /// How many messages of type `kind` (e.g. `b'S'`).
    pub fn get(&self, kind: u8) -> u64 {
        self.0.get(&kind).copied().unwrap_or(0)
    }

    /// Round trips: one per `Sync` (extended protocol) plus one per simple `Query`.
    pub fn round_trips(&self) -> u64 {
        self.get(b'S') + self.get(b'Q')
    }

    /// Counts accumulated since `earlier`.
    pub fn since(&self, earlier: &MessageCounts) -> MessageCounts {
        MessageCounts(
            self.0
                .iter()
                .map(|(k, v)| (*k, v - earlier.get(*k)))
                .filter(|(_, v)| *v > 0)
                .collect(),
        )
    }
}

#[derive(Default)]
struct Shared {
    counts: Mutex<HashMap<u8, u64>>,
    connections: Mutex<Vec<JoinHandle<()>>>,
}

/// See the module docs. Must be created inside a tokio runtime (it spawns tasks there).
pub struct PgProxy {
    /// The port clients connect to, on 127.0.0.1.
    pub port: u16,
    upstream: String,
    shared: Arc<Shared>,
    listener: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for PgProxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgProxy")
            .field("port", &self.port)
            .field("upstream", &self.upstream)
            .finish()
    }
}

impl PgProxy {
    /// Listen on a free port and forward to `upstream` (`host:port`).
    pub async fn start(upstream: &str) -> std::io::Result<PgProxy> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let proxy = PgProxy {
            port,
            upstream: upstream.to_owned(),
            shared: Arc::new(Shared::default()),
            listener: Mutex::new(None),
        };
        proxy.serve(listener);
        Ok(proxy)
    }

    /// A proxy in front of the server of `url` (a `postgres://` URL).
    pub async fn for_url(url: &str) -> std::io::Result<PgProxy> {
        Self::start(&host_port(url)).await
    }

    /// `url` (a `postgres://` URL) pointed at the proxy instead of the server.
    pub fn url_through(&self, url: &str) -> String {
        at_local_port(url, self.port)
    }

    fn serve(&self, listener: TcpListener) {
        let shared = Arc::clone(&self.shared);
        let upstream = self.upstream.clone();
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let shared2 = Arc::clone(&shared);
                let upstream = upstream.clone();
                let conn = tokio::spawn(async move {
                    if let Ok(server) = TcpStream::connect(&upstream).await {
                        pipe(client, server, shared2).await;
                    }
                });
                if let Ok(mut conns) = shared.connections.lock() {
                    conns.retain(|c| !c.is_finished());
                    conns.push(conn);
                }
            }
        });
        if let Ok(mut slot) = self.listener.lock() {
            *slot = Some(task);
        }
    }

    /// Close the port and cut every open connection.
    pub fn stop(&self) {
        if let Some(task) = self.listener.lock().ok().and_then(|mut l| l.take()) {
            task.abort();
        }
        if let Ok(mut conns) = self.shared.connections.lock() {
            for conn in conns.drain(..) {
                conn.abort();
            }
        }
    }

    /// Listen on the same port again.
    pub async fn resume(&self) -> std::io::Result<()> {
        // The aborted listener task drops its socket asynchronously; retry briefly.
        let mut last = None;
        for _ in 0..50 {
            match TcpListener::bind(("127.0.0.1", self.port)).await {
                Ok(listener) => {
                    self.serve(listener);
                    return Ok(());
                }
                Err(e) => last = Some(e),
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        Err(last.unwrap_or_else(|| std::io::Error::other("bind failed")))
    }

    /// Messages counted so far.
    pub fn counts(&self) -> MessageCounts {
        MessageCounts(
            self.shared
                .counts
                .lock()
                .map(|c| c.clone())
                .unwrap_or_default(),
        )
    }
}

impl Drop for PgProxy {
    fn drop(&mut self) {
        self.stop();
    }
}

/// `url` (a `postgres://` URL) pointed at 127.0.0.1:`port`.
pub fn at_local_port(url: &str, port: u16) -> String {
    let (scheme, rest) = url.split_once("://").unwrap_or(("postgres", url));
    let (userinfo, after) = match rest.split_once('@') {
        Some((user, after)) => (format!("{user}@"), after),
        None => (String::new(), rest),
    };
    let end = after.find(['/', '?']).unwrap_or(after.len());
    format!("{scheme}://{userinfo}127.0.0.1:{port}{}", &after[end..])
}

/// Which way a [`delaying_proxy`] holds a chunk back.
#[derive(Clone, Copy, Debug)]
pub enum Hold {
    /// A server-to-client chunk: the server has answered, the answer arrives late (a slow
    /// network, a stalled runtime).
    Answer,
    /// A client-to-server chunk: the statement reaches the server late, after the client gave
    /// up on it (and after its cancel, which then finds nothing to cancel).
    Statement,
}

/// A TCP proxy to `upstream` (`host:port`) that, once armed (the flag returned with its port),
/// holds back the first chunk going the `hold` way that carries `needle` for `delay`, then
/// disarms. Everything else is forwarded as it comes.
pub async fn delaying_proxy(
    upstream: String,
    hold: Hold,
    needle: &'static [u8],
    delay: Duration,
) -> (u16, Arc<AtomicBool>) {
    let listener = TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind a proxy port");
    let port = listener.local_addr().expect("proxy address").port();
    let armed = Arc::new(AtomicBool::new(false));
    let armed_for_task = Arc::clone(&armed);
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let Ok(server) = TcpStream::connect(&upstream).await else {
                continue;
            };
            let armed = Arc::clone(&armed_for_task);
            let (client_read, client_write) = client.into_split();
            let (server_read, server_write) = server.into_split();
            let (held, held_to, plain, plain_to) = match hold {
                Hold::Answer => (server_read, client_write, client_read, server_write),
                Hold::Statement => (client_read, server_write, server_read, client_write),
            };
            tokio::spawn(async move {
                let (mut plain, mut plain_to) = (plain, plain_to);
                let _ = tokio::io::copy(&mut plain, &mut plain_to).await;
            });
            tokio::spawn(async move {
                let (mut held, mut held_to) = (held, held_to);
                let mut buf = vec![0u8; 64 * 1024];
                loop {
                    let n = match held.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => n,
                    };
                    let chunk = &buf[..n];
                    if armed.load(Ordering::SeqCst)
                        && chunk.windows(needle.len()).any(|w| w == needle)
                    {
                        armed.store(false, Ordering::SeqCst);
                        tokio::time::sleep(delay).await;
                    }
                    if held_to.write_all(chunk).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (port, armed)
}

/// A plain TCP proxy to `upstream` (`host:port`) whose faults a test switches on:
/// - [`cut_open_connections`](Self::cut_open_connections): every connection open at that
///   moment becomes a black hole both ways (bytes read and dropped, sockets kept open: a
///   half-open path, a NAT or firewall entry lost), while connections made afterwards work;
/// - [`mute_replies`](Self::mute_replies): while on, what the server sends is swallowed on
///   every connection (commands still reach it: replies lost on the way back).
///
/// A connection whose one side ends is closed on the other side too.
pub struct FaultyProxy {
    port: u16,
    cuts: Arc<AtomicU64>,
    mute: Arc<AtomicBool>,
}

impl FaultyProxy {
    /// Listen on a free loopback port, forwarding to `upstream`.
    pub async fn start(upstream: String) -> FaultyProxy {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind a proxy port");
        let port = listener.local_addr().expect("proxy address").port();
        let (cuts, mute) = (
            Arc::new(AtomicU64::new(0)),
            Arc::new(AtomicBool::new(false)),
        );
        let (cuts_now, mute_now) = (Arc::clone(&cuts), Arc::clone(&mute));
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = TcpStream::connect(&upstream).await else {
                    continue;
                };
                let cut_at = cuts_now.load(Ordering::SeqCst);
                let (client_read, client_write) = client.into_split();
                let (server_read, server_write) = server.into_split();
                let ways = [
                    (client_read, server_write, None),
                    (server_read, client_write, Some(Arc::clone(&mute_now))),
                ];
                for (mut from, mut to, mute) in ways {
                    let cuts = Arc::clone(&cuts_now);
                    tokio::spawn(async move {
                        let mut buf = vec![0u8; 64 * 1024];
                        loop {
                            let n = match from.read(&mut buf).await {
                                Ok(0) | Err(_) => return,
                                Ok(n) => n,
                            };
                            let cut = cuts.load(Ordering::SeqCst) > cut_at;
                            if cut || mute.as_ref().is_some_and(|m| m.load(Ordering::SeqCst)) {
                                continue;
                            }
                            if to.write_all(&buf[..n]).await.is_err() {
                                return;
                            }
                        }
                    });
                }
            }
        });
        FaultyProxy { port, cuts, mute }
    }

    /// The loopback port it listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Black-hole every connection open now (see the type's docs).
    pub fn cut_open_connections(&self) {
        self.cuts.fetch_add(1, Ordering::SeqCst);
    }

    /// Swallow (`true`) or forward (`false`) what the server sends.
    pub fn mute_replies(&self, on: bool) {
        self.mute.store(on, Ordering::SeqCst);
    }
}

/// `host:port` of a `postgres://` URL (port 5432 when absent).
pub fn host_port(url: &str) -> String {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let rest = rest.split_once('@').map_or(rest, |(_, r)| r);
    let authority = rest.split(['/', '?']).next().unwrap_or(rest);
    if authority.contains(':') {
        authority.to_owned()
    } else {
        format!("{authority}:5432")
    }
}

async fn pipe(client: TcpStream, server: TcpStream, shared: Arc<Shared>) {
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let upstream = async {
        let mut parser = FrontendParser::default();
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match client_read.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            for kind in parser.feed(&buf[..n]) {
                if let Ok(mut counts) = shared.counts.lock() {
                    *counts.entry(kind).or_default() += 1;
                }
            }
            if server_write.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
        let _ = server_write.shutdown().await;
    };
    let downstream = async {
        let _ = tokio::io::copy(&mut server_read, &mut client_write).await;
        let _ = client_write.shutdown().await;
    };
    tokio::join!(upstream, downstream);
}

/// Splits the client's byte stream into messages. The first message (startup, or an
/// SSL/GSS request followed by the startup) has no type byte; all later ones do.
#[derive(Default)]
struct FrontendParser {
    buf: Vec<u8>,
    started: bool,
}

const SSL_REQUEST: u32 = 80_877_103;
const GSS_REQUEST: u32 = 80_877_104;

impl FrontendParser {
    fn feed(&mut self, bytes: &[u8]) -> Vec<u8> {
        self.buf.extend_from_slice(bytes);
        let mut kinds = Vec::new();
        loop {
            if !self.started {
                if self.buf.len() < 8 {
                    break;
                }
                let len = u32::from_be_bytes([self.buf[0], self.buf[1], self.buf[2], self.buf[3]])
                    as usize;
                if self.buf.len() < len {
                    break;
                }
                let code = u32::from_be_bytes([self.buf[4], self.buf[5], self.buf[6], self.buf[7]]);
                self.buf.drain(..len);
                if code != SSL_REQUEST && code != GSS_REQUEST {
                    self.started = true;
                }
                continue;
            }
            if self.buf.len() < 5 {
                break;
            }
            let len =
                u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]]) as usize;
            if self.buf.len() < 1 + len {
                break;
            }
            kinds.push(self.buf[0]);
            self.buf.drain(..1 + len);
        }
        kinds
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_port_of_urls() {
        assert_eq!(host_port("postgres://u@h/db"), "h:5432");
        assert_eq!(
            host_port("postgres://u:p@127.0.0.1:5433/db?x=y"),
            "127.0.0.1:5433"
        );
        assert_eq!(host_port("postgresql://h:1"), "h:1");
    }

    #[test]
    fn frontend_messages_are_counted_across_reads() {
        let mut p = FrontendParser::default();
        let mut startup = 9u32.to_be_bytes().to_vec();
        startup.extend_from_slice(&196_608u32.to_be_bytes());
        startup.push(0);
        let mut stream = startup;
        for kind in [b'B', b'E', b'S'] {
            stream.push(kind);
            stream.extend_from_slice(&4u32.to_be_bytes());
        }
        let (a, b) = stream.split_at(11);
        let mut kinds = p.feed(a);
        kinds.extend(p.feed(b));
        assert_eq!(kinds, vec![b'B', b'E', b'S']);
    }
}
