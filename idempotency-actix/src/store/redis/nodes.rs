//! Commands that name no record: where they go when the store's connection reaches several
//! nodes (Redis Cluster).
//!
//! The request path never needs this file: every request-path command names exactly one key,
//! so the redis crate's cluster connection sends it to that key's node. What names no key is
//! operator work: walking the records (`SCAN`, for [`purge_expired`] and idem-cli) and reading
//! the eviction policy (`CONFIG GET`). On one server (or a `ConnectionManager`) these are
//! plain commands. On a cluster each primary holds its own part of the keyspace and its own
//! configuration, so they must reach every primary, and a `SCAN` cursor is only meaningful on
//! the node that issued it.
//!
//! The store stays generic over any [`ConnectionLike`]; with the feature `redis-cluster` a
//! connection that turns out to be the redis crate's
//! [`ClusterConnection`](redis::cluster_async::ClusterConnection) (a run-time type check, no
//! extra bound on the store's public API) has these commands routed to every primary (`SCAN`
//! cursors then continue on the node that returned them). Home-made because the redis crate
//! routes `SCAN` to one random node and has no cluster-wide scan in the version we can use.
//!
//! [`purge_expired`]: crate::store::IdempotencyStore::purge_expired

use redis::aio::ConnectionLike;
use redis::{Cmd, RedisResult, Value};

/// Keys asked for per `SCAN` call.
const SCAN_COUNT: usize = 1000;

/// A walk over every record key matching a `SCAN MATCH` pattern, on every primary, batch by
/// batch. A key written or deleted during the walk may or may not be returned; a key present
/// for the whole walk is returned at least once (`SCAN`'s own guarantee, per node), unless a
/// resharding moves it during the walk from a node not yet walked to one already walked. Fine
/// for what walks keys here: a purge run again later, and idem-cli's listings.
#[derive(Debug)]
pub struct KeyScan {
    pattern: String,
    state: ScanState,
    /// Keys of every type, not strings only.
    any_type: bool,
}

#[derive(Debug)]
enum ScanState {
    /// No command sent yet.
    Start,
    /// One server: the cursor to continue from.
    Single(u64),
    /// A cluster: the primaries (host, port) whose scan is not finished, with their cursors.
    Nodes(Vec<(String, u16, u64)>),
    /// Every node said cursor 0.
    Done,
}

impl KeyScan {
    /// A walk over the string keys (records are strings, [`record`](super::record)) matching
    /// `pattern` (a glob: build it from encoded key parts, see
    /// [`encode_key_part`](super::encode_key_part)).
    pub fn new(pattern: impl Into<String>) -> KeyScan {
        KeyScan {
            pattern: pattern.into(),
            state: ScanState::Start,
            any_type: false,
        }
    }

    /// The same walk over keys of every type: `idem-cli` names a value of another type sitting
    /// where a record belongs (requests with its key get 503), rather than leave it out.
    pub fn any_type(mut self) -> KeyScan {
        self.any_type = true;
        self
    }

    /// The next batch of keys (possibly empty), or `None` when the walk is over.
    ///
    /// # Errors
    /// The first error of a `SCAN` call; the walk is left where it was, so calling again
    /// retries the failed call.
    pub async fn next_batch<C>(&mut self, conn: &mut C) -> RedisResult<Option<Vec<Vec<u8>>>>
    where
        C: ConnectionLike + Send + 'static,
    {
        let (state, keys) = self.advance(conn).await?;
        self.state = state;
        Ok(keys)
    }

    /// One `SCAN` call from the current state: the state after it and the keys it returned.
    async fn advance<C>(&self, conn: &mut C) -> RedisResult<(ScanState, Option<Vec<Vec<u8>>>)>
    where
        C: ConnectionLike + Send + 'static,
    {
        match &self.state {
            ScanState::Done => Ok((ScanState::Done, None)),
            ScanState::Start => {
                let mut nodes = Vec::new();
                let mut keys = Vec::new();
                let mut single = None;
                for (node, reply) in on_every_primary(conn, &self.scan(0)).await? {
                    let (cursor, batch): (u64, Vec<Vec<u8>>) =
                        redis::from_owned_redis_value(reply)?;
                    keys.extend(batch);
                    match node {
                        Some((host, port)) if cursor != 0 => nodes.push((host, port, cursor)),
                        Some(_) => {}
                        None => single = Some(cursor),
                    }
                }
                let state = match single {
                    Some(0) => ScanState::Done,
                    Some(cursor) => ScanState::Single(cursor),
                    None if nodes.is_empty() => ScanState::Done,
                    None => ScanState::Nodes(nodes),
                };
                Ok((state, Some(keys)))
            }
            ScanState::Single(cursor) => {
                let (next, keys): (u64, Vec<Vec<u8>>) =
                    self.scan(*cursor).query_async(conn).await?;
                let state = match next {
                    0 => ScanState::Done,
                    next => ScanState::Single(next),
                };
                Ok((state, Some(keys)))
            }
            ScanState::Nodes(nodes) => {
                let mut nodes = nodes.clone();
                let Some((host, port, cursor)) = nodes.pop() else {
                    return Ok((ScanState::Done, None));
                };
                let reply = on_node(conn, &host, port, &self.scan(cursor)).await?;
                let (next, keys): (u64, Vec<Vec<u8>>) = redis::from_owned_redis_value(reply)?;
                if next != 0 {
                    nodes.push((host, port, next));
                }
                let state = if nodes.is_empty() {
                    ScanState::Done
                } else {
                    ScanState::Nodes(nodes)
                };
                Ok((state, Some(keys)))
            }
        }
    }

    /// Every remaining key, in one vector.
    ///
    /// # Errors
    /// As [`KeyScan::next_batch`].
    pub async fn collect<C>(mut self, conn: &mut C) -> RedisResult<Vec<Vec<u8>>>
    where
        C: ConnectionLike + Send + 'static,
    {
        let mut keys = Vec::new();
        while let Some(batch) = self.next_batch(conn).await? {
            keys.extend(batch);
        }
        Ok(keys)
    }

    fn scan(&self, cursor: u64) -> Cmd {
        let mut cmd = redis::cmd("SCAN");
        cmd.arg(cursor)
            .arg("MATCH")
            .arg(&self.pattern)
            .arg("COUNT")
            .arg(SCAN_COUNT);
        if !self.any_type {
            cmd.arg("TYPE").arg("string");
        }
        cmd
    }
}

/// Whether the server at the end of `conn` runs in cluster mode (`INFO cluster` says
/// `cluster_enabled:1`): a plain connection to such a node gets `MOVED` for most keys.
///
/// # Errors
/// The `INFO` call's (refused by an ACL, or the server unreachable).
pub async fn cluster_enabled<C: ConnectionLike + Send>(conn: &mut C) -> RedisResult<bool> {
    let info: String = redis::cmd("INFO").arg("cluster").query_async(conn).await?;
    Ok(info.lines().any(|line| line.trim() == "cluster_enabled:1"))
}

/// `cmd` on every primary: one reply per node, with the node's address on a cluster and
/// `None` for a single server.
pub(crate) async fn on_every_primary<C>(
    conn: &mut C,
    cmd: &Cmd,
) -> RedisResult<Vec<(Option<(String, u16)>, Value)>>
where
    C: ConnectionLike + Send + 'static,
{
    #[cfg(feature = "redis-cluster")]
    if let Some(cluster) = as_cluster(conn) {
        return cluster::on_every_primary(cluster, cmd).await;
    }
    let reply: Value = cmd.query_async(conn).await?;
    Ok(vec![(None, reply)])
}

/// `cmd` on the node at `host:port` (a cluster's primary named by [`on_every_primary`]).
async fn on_node<C>(conn: &mut C, host: &str, port: u16, cmd: &Cmd) -> RedisResult<Value>
where
    C: ConnectionLike + Send + 'static,
{
    #[cfg(feature = "redis-cluster")]
    if let Some(cluster) = as_cluster(conn) {
        return cluster::on_node(cluster, host, port, cmd).await;
    }
    let _ = (host, port);
    cmd.query_async(conn).await
}

/// The connection as the redis crate's cluster connection, if it is one.
#[cfg(feature = "redis-cluster")]
fn as_cluster<C: 'static>(conn: &mut C) -> Option<&mut redis::cluster_async::ClusterConnection> {
    (conn as &mut dyn std::any::Any).downcast_mut()
}

#[cfg(feature = "redis-cluster")]
mod cluster {
    use redis::cluster_async::ClusterConnection;
    use redis::cluster_routing::{MultipleNodeRoutingInfo, RoutingInfo, SingleNodeRoutingInfo};
    use redis::{Cmd, ErrorKind, RedisError, RedisResult, Value};
    use std::collections::BTreeSet;

    pub(super) async fn on_every_primary(
        conn: &mut ClusterConnection,
        cmd: &Cmd,
    ) -> RedisResult<Vec<(Option<(String, u16)>, Value)>> {
        // No response policy: the crate answers with a map of node address to reply.
        let routing = RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllMasters, None));
        let Value::Map(replies) = conn.route_command(cmd, routing).await? else {
            return Err((ErrorKind::TypeError, "expected one reply per primary").into());
        };
        let replies = replies
            .into_iter()
            .map(|(address, reply)| {
                let address: String = redis::from_owned_redis_value(address)?;
                let node = address
                    .rsplit_once(':')
                    .and_then(|(host, port)| Some((host.to_owned(), port.parse().ok()?)))
                    .ok_or((ErrorKind::TypeError, "a primary's address is not host:port"))?;
                Ok((node, reply))
            })
            .collect::<RedisResult<Vec<_>>>()?;
        // The crate leaves out, without an error, a primary it has no connection to (down, or
        // unreachable from here while the cluster still counts it: within
        // `cluster-node-timeout`, or for good with `cluster-require-full-coverage no`). A scan
        // would then walk part of the keyspace and a check read part of the cluster, and say
        // nothing. So the replies are held against the primaries that own the slots, as a node
        // that did answer sees them.
        let Some(((host, port), _)) = replies.first() else {
            return Err(not_connected(
                "no Redis Cluster primary answered (down or unreachable)".to_owned(),
            ));
        };
        let mut cluster_slots = redis::cmd("CLUSTER");
        cluster_slots.arg("SLOTS");
        let slots = on_node(conn, host, *port, &cluster_slots).await?;
        let owners = slot_owners(slots)?;
        let missing: Vec<&(String, u16)> = owners
            .iter()
            .filter(|owner| !replies.iter().any(|(node, _)| node == *owner))
            .collect();
        // Counted, not only matched by name: a node's address as the crate spells it could
        // differ from `CLUSTER SLOTS`'s, and a mismatch of spelling alone must not fail.
        if replies.len() < owners.len() {
            let names = if missing.len() == owners.len() - replies.len() {
                missing
            } else {
                Vec::new()
            };
            return Err(primaries_missing(owners.len(), replies.len(), &names));
        }
        Ok(replies
            .into_iter()
            .map(|(node, reply)| (Some(node), reply))
            .collect())
    }

    /// The distinct primaries (host, port) that `CLUSTER SLOTS` names as owning slots.
    fn slot_owners(reply: Value) -> RedisResult<BTreeSet<(String, u16)>> {
        let ranges: Vec<Vec<Value>> = redis::from_owned_redis_value(reply)?;
        ranges
            .into_iter()
            .map(|range| {
                // [start, end, [host, port, id, ...], replicas...]
                let primary = range.into_iter().nth(2).ok_or((
                    ErrorKind::TypeError,
                    "a CLUSTER SLOTS range names no primary",
                ))?;
                let node: Vec<Value> = redis::from_owned_redis_value(primary)?;
                let mut node = node.into_iter();
                match (node.next(), node.next()) {
                    (Some(host), Some(port)) => Ok((
                        redis::from_owned_redis_value(host)?,
                        redis::from_owned_redis_value(port)?,
                    )),
                    _ => Err((
                        ErrorKind::TypeError,
                        "a CLUSTER SLOTS primary has no host and port",
                    )
                        .into()),
                }
            })
            .collect()
    }

    /// The error for primaries that did not answer.
    fn primaries_missing(owners: usize, answered: usize, missing: &[&(String, u16)]) -> RedisError {
        let names = missing
            .iter()
            .map(|(host, port)| format!("{host}:{port}"))
            .collect::<Vec<_>>()
            .join(", ");
        let mut message = format!(
            "{} of {owners} Redis Cluster primaries did not answer (down or unreachable)",
            owners.saturating_sub(answered)
        );
        if !names.is_empty() {
            message.push_str(": ");
            message.push_str(&names);
        }
        not_connected(message)
    }

    /// An I/O error, so that the store and idem-cli classify it as unavailable (503, exit 3),
    /// as they do a single server that is down.
    fn not_connected(message: String) -> RedisError {
        std::io::Error::new(std::io::ErrorKind::NotConnected, message).into()
    }

    pub(super) async fn on_node(
        conn: &mut ClusterConnection,
        host: &str,
        port: u16,
        cmd: &Cmd,
    ) -> RedisResult<Value> {
        let routing = RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
            host: host.to_owned(),
            port,
        });
        conn.route_command(cmd, routing).await
    }
}
