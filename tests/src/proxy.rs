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
//! protocol, black-holes open connections or swallows replies. [`CutProxy`] cuts the connection
//! that carries a chosen statement, before it reaches the server or after it ran (its answer
//! lost).

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
    /// Where new connections go ([`repoint`](Self::repoint)).
    upstream: Arc<Mutex<String>>,
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
        let upstream = Arc::new(Mutex::new(upstream));
        let upstream_now = Arc::clone(&upstream);
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let target = upstream_now.lock().map(|u| u.clone()).unwrap_or_default();
                let Ok(server) = TcpStream::connect(&target).await else {
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
        FaultyProxy {
            port,
            cuts,
            mute,
            upstream,
        }
    }

    /// Send connections made from now on to `upstream` (`host:port`), as a DNS name moved to
    /// a new server by a failover; open connections stay where they are.
    pub fn repoint(&self, upstream: String) {
        if let Ok(mut target) = self.upstream.lock() {
            *target = upstream;
        }
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

/// Where a [`CutProxy`] cuts the connection that carries the armed statement.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cut {
    /// Cut before the statement reaches the server: it never runs.
    BeforeSend,
    /// Forward the statement, then cut before the server's answer reaches the client: it ran
    /// (and, outside a transaction or for a `COMMIT`, committed), the client never learns it.
    AfterSend,
    /// As [`Cut::AfterSend`], but the client gets a `FATAL` error instead of the answer before
    /// the cut (SQLSTATE 57P01, "terminating connection due to administrator command"), as
    /// when the server shuts its sessions down right after the statement committed.
    AfterSendFatal,
}

/// The `ErrorResponse` a [`Cut::AfterSendFatal`] sends: `FATAL` 57P01.
fn fatal_error_message() -> Vec<u8> {
    let fields: &[u8] =
        b"SFATAL\0VFATAL\0C57P01\0Mterminating connection due to administrator command\0\0";
    let mut message = vec![b'E'];
    let len = u32::try_from(4 + fields.len()).unwrap_or(u32::MAX);
    message.extend_from_slice(&len.to_be_bytes());
    message.extend_from_slice(fields);
    message
}

/// A PostgreSQL proxy that cuts one connection at one chosen statement.
///
/// [`arm`](Self::arm)`(needle, cut)`: the next execution, on any connection, of a statement
/// whose SQL contains `needle` cuts that connection (both sockets closed), once. Executions are
/// simple `Query` messages (their text) and extended-protocol `Bind`s (the text of the `Parse`
/// that prepared the named statement on that connection: diesel-async prepares once per
/// connection and binds by name afterwards). A `Parse` alone never triggers.
///
/// [`Cut::AfterSend`] relays every earlier answer, then waits for the armed statement's own
/// `ReadyForQuery` (counted: one per `Sync` or simple `Query`), so a statement outside a
/// transaction, or a `COMMIT`, has committed when the cut happens; drops that answer and cuts.
/// Plain connections only (the client must not ask for TLS).
pub struct CutProxy {
    port: u16,
    arm: Arc<Mutex<Vec<(String, Cut)>>>,
    fired: Arc<AtomicU64>,
    listener: JoinHandle<()>,
}

impl CutProxy {
    /// A proxy in front of the server of `url` (a `postgres://` URL).
    pub async fn for_url(url: &str) -> CutProxy {
        let upstream = host_port(url);
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind a proxy port");
        let port = listener.local_addr().expect("proxy address").port();
        let arm: Arc<Mutex<Vec<(String, Cut)>>> = Arc::new(Mutex::new(Vec::new()));
        let fired = Arc::new(AtomicU64::new(0));
        let (arm2, fired2) = (Arc::clone(&arm), Arc::clone(&fired));
        let listener = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = TcpStream::connect(&upstream).await else {
                    continue;
                };
                let (arm, fired) = (Arc::clone(&arm2), Arc::clone(&fired2));
                tokio::spawn(cut_pipe(client, server, arm, fired));
            }
        });
        CutProxy {
            port,
            arm,
            fired,
            listener,
        }
    }

    /// `url` pointed at the proxy.
    pub fn url_through(&self, url: &str) -> String {
        at_local_port(url, self.port)
    }

    /// Cut at the next execution of a statement containing `needle` (see the type's docs).
    /// Arms add up: each fires once, the oldest matching one first.
    pub fn arm(&self, needle: &str, cut: Cut) {
        self.arm.lock().expect("arm").push((needle.to_owned(), cut));
    }

    /// Forget the arms that have not fired.
    pub fn disarm(&self) {
        self.arm.lock().expect("arm").clear();
    }

    /// How many cuts happened.
    pub fn fired(&self) -> u64 {
        self.fired.load(Ordering::SeqCst)
    }
}

impl Drop for CutProxy {
    fn drop(&mut self) {
        self.listener.abort();
    }
}

fn cstring(bytes: &[u8]) -> (&[u8], &[u8]) {
    match bytes.iter().position(|b| *b == 0) {
        Some(end) => (&bytes[..end], &bytes[end + 1..]),
        None => (bytes, &[]),
    }
}

async fn cut_pipe(
    client: TcpStream,
    server: TcpStream,
    arm: Arc<Mutex<Vec<(String, Cut)>>>,
    fired: Arc<AtomicU64>,
) {
    // Messages are written one by one: without this, Nagle and delayed ACKs add ~40 ms each.
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    // For `AfterSend`: the number (1-based) of the server's `ReadyForQuery` that ends the
    // answer to the armed statement; 0 while none is armed on this connection.
    let target = Arc::new(AtomicU64::new(0));
    let target_up = Arc::clone(&target);
    // For `AfterSendFatal`: send a FATAL error before cutting.
    let fatal = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let fatal_up = Arc::clone(&fatal);
    let upstream = async move {
        let mut splitter = MessageSplitter::default();
        let mut statements: HashMap<Vec<u8>, String> = HashMap::new();
        // `Sync`s and simple `Query`s forwarded: each gets one `ReadyForQuery`.
        let mut syncs: u64 = 0;
        let mut pending_target = false;
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match client_read.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            for message in splitter.feed(&buf[..n]) {
                let typed =
                    splitter.started && message.len() >= 5 && message[0].is_ascii_alphabetic();
                let kind = if typed { message[0] } else { 0 };
                let sql: Option<String> = match kind {
                    b'Q' => Some(String::from_utf8_lossy(cstring(&message[5..]).0).into_owned()),
                    b'P' => {
                        let (name, rest) = cstring(&message[5..]);
                        let (text, _) = cstring(rest);
                        statements.insert(name.to_vec(), String::from_utf8_lossy(text).into());
                        None
                    }
                    b'B' => {
                        let (_portal, rest) = cstring(&message[5..]);
                        let (name, _) = cstring(rest);
                        statements.get(name).cloned()
                    }
                    _ => None,
                };
                let mut cut = None;
                if let Some(sql) = sql {
                    let mut arms = arm.lock().expect("arm");
                    if let Some(i) = arms
                        .iter()
                        .position(|(needle, _)| sql.contains(needle.as_str()))
                    {
                        cut = Some(arms.remove(i).1);
                        fired.fetch_add(1, Ordering::SeqCst);
                    }
                }
                match cut {
                    Some(Cut::BeforeSend) => return,
                    Some(Cut::AfterSend) => pending_target = true,
                    Some(Cut::AfterSendFatal) => {
                        fatal_up.store(true, Ordering::SeqCst);
                        pending_target = true;
                    }
                    None => {}
                }
                if kind == b'Q' || kind == b'S' {
                    syncs += 1;
                    if pending_target {
                        // Set before the message leaves: its answer comes after.
                        target_up.store(syncs, Ordering::SeqCst);
                        pending_target = false;
                    }
                }
                if server_write.write_all(&message).await.is_err() {
                    return;
                }
            }
        }
    };
    let downstream = async move {
        let mut splitter = BackendSplitter::default();
        // `ReadyForQuery`s answering a `Sync` or `Query` (the one ending the startup is not).
        let mut ready: u64 = 0;
        let mut started = false;
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match server_read.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            for message in splitter.feed(&buf[..n]) {
                if !started {
                    started = message.first() == Some(&b'Z');
                    if client_write.write_all(&message).await.is_err() {
                        return;
                    }
                    continue;
                }
                let goal = target.load(Ordering::SeqCst);
                // The answer to the `goal`th Sync/Query: what follows the `goal - 1`th answer.
                let swallowed = goal != 0 && ready + 1 >= goal;
                if message.first() == Some(&b'Z') {
                    ready += 1;
                }
                if swallowed {
                    if ready >= goal {
                        // The whole answer to the armed statement is in: cut.
                        if fatal.load(Ordering::SeqCst) {
                            let _ = client_write.write_all(&fatal_error_message()).await;
                        }
                        return;
                    }
                    continue;
                }
                if client_write.write_all(&message).await.is_err() {
                    return;
                }
            }
        }
    };
    // Whichever side ends first ends the connection: both sockets are dropped.
    tokio::select! {
        () = upstream => {}
        () = downstream => {}
    }
}

/// Splits the server's byte stream into whole messages (every one has a type byte; no TLS).
#[derive(Default)]
struct BackendSplitter {
    buf: Vec<u8>,
}

impl BackendSplitter {
    fn feed(&mut self, bytes: &[u8]) -> Vec<Vec<u8>> {
        self.buf.extend_from_slice(bytes);
        let mut out = Vec::new();
        while self.buf.len() >= 5 {
            let len =
                u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]]) as usize;
            if self.buf.len() < 1 + len {
                break;
            }
            out.push(self.buf.drain(..1 + len).collect());
        }
        out
    }
}

/// Splits the client's byte stream into whole messages (raw bytes, type byte included; the
/// startup-phase messages without one are passed through as they come).
#[derive(Default)]
struct MessageSplitter {
    buf: Vec<u8>,
    started: bool,
}

impl MessageSplitter {
    fn feed(&mut self, bytes: &[u8]) -> Vec<Vec<u8>> {
        self.buf.extend_from_slice(bytes);
        let mut out = Vec::new();
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
                out.push(self.buf.drain(..len).collect());
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
            out.push(self.buf.drain(..1 + len).collect());
        }
        out
    }
}
