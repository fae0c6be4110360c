//! A throwaway `redis-server` per test: on a free loopback port, without persistence
//! (`--save '' --appendonly no`), in a working directory of its own (a replica's full sync
//! still writes an RDB file there), killed and removed on drop. Tests never touch a shared Redis.
//!
//! ```no_run
//! let redis = idempotency_e2e::redis_server::RedisServer::start();
//! let url = redis.url(); // redis://127.0.0.1:<port>/
//! # let _ = url;
//! ```

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use idempotency_actix::store::redis::redis;

use crate::raw_http::free_port;

/// How long a fresh server may take to accept connections.
const START_TIMEOUT: Duration = Duration::from_secs(20);

/// A `redis-server` child process. Dropping it kills the process.
pub struct RedisServer {
    child: Option<Child>,
    port: u16,
    extra: Vec<String>,
    dir: PathBuf,
}

impl std::fmt::Debug for RedisServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisServer")
            .field("port", &self.port)
            .finish()
    }
}

/// How many ports a test server is tried on before its test fails.
const START_ATTEMPTS: usize = 5;

impl RedisServer {
    /// A server with the defaults (and `maxmemory-policy noeviction`, Redis's own default).
    pub fn start() -> RedisServer {
        Self::start_with(&[])
    }

    /// A server with extra command-line options, e.g. `["--maxmemory-policy", "allkeys-lru"]`.
    pub fn start_with(extra: &[&str]) -> RedisServer {
        let mut failed = String::new();
        for _ in 0..START_ATTEMPTS {
            match Self::try_start_with(extra) {
                Ok(server) => return server,
                Err(why) => failed = why,
            }
        }
        panic!("{failed} ({START_ATTEMPTS} attempts)");
    }

    /// As [`RedisServer::start_with`], once: `Err` when the server exits at once, which is
    /// how a port taken between [`free_port`] and the server's bind shows (another test's
    /// server or connection got it first), so the caller can try another.
    pub fn try_start_with(extra: &[&str]) -> Result<RedisServer, String> {
        // One directory per start, never shared: a start that lost its port to another of
        // this process's servers removes its directory on drop, and must not remove theirs.
        static STARTS: AtomicU64 = AtomicU64::new(0);
        let start = STARTS.fetch_add(1, Ordering::Relaxed);
        let port = free_port();
        let dir =
            std::env::temp_dir().join(format!("idem-redis-{}-{port}-{start}", std::process::id()));
        if let Err(e) = std::fs::create_dir_all(&dir) {
            panic!("cannot create {}: {e}", dir.display());
        }
        let mut server = RedisServer {
            child: None,
            port,
            extra: extra.iter().map(|s| (*s).to_owned()).collect(),
            dir,
        };
        server.try_spawn()?;
        Ok(server)
    }

    /// `redis://127.0.0.1:<port>/`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// The port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Create the user `name` (password `pw`) with every permission but those `denied` (e.g.
    /// `["-info"]`), by `redis-cli`; returns its URL.
    pub fn user_url(&self, name: &str, denied: &[&str]) -> String {
        let out = Command::new("redis-cli")
            .args(["-p", &self.port.to_string(), "ACL", "SETUSER", name])
            .args(["on", ">pw", "~*", "&*", "+@all"])
            .args(denied)
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| panic!("cannot run redis-cli ({e})"));
        assert_eq!(
            String::from_utf8_lossy(&out.stdout).trim(),
            "OK",
            "ACL SETUSER: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        format!("redis://{name}:pw@127.0.0.1:{}/", self.port)
    }

    /// Kill the server (SIGKILL: nothing is saved, it has no persistence anyway).
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Send the server `signal` (`"STOP"`, `"CONT"`, ...) with `kill(1)`.
    pub fn signal(&self, signal: &str) {
        if let Some(child) = &self.child {
            let sent = Command::new("kill")
                .arg(format!("-{signal}"))
                .arg(child.id().to_string())
                .status();
            assert!(
                sent.is_ok_and(|s| s.success()),
                "kill -{signal} of redis-server on port {} failed",
                self.port
            );
        }
    }

    /// Start the server again on the same port, empty. Panics if it does not come up.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    fn spawn(&mut self) {
        if let Err(why) = self.try_spawn() {
            panic!("{why}");
        }
    }

    fn try_spawn(&mut self) -> Result<(), String> {
        let started = Instant::now();
        let spawned = Command::new("redis-server")
            .args(["--port", &self.port.to_string()])
            .args(["--bind", "127.0.0.1"])
            .args(["--save", ""])
            .args(["--appendonly", "no"])
            .args(["--protected-mode", "no"])
            .arg("--dir")
            .arg(&self.dir)
            .args(&self.extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn();
        let child = match spawned {
            Ok(child) => child,
            Err(e) => panic!(
                "cannot start redis-server ({e}); install it (apt-get install -y redis-server) \
                 or put it on PATH"
            ),
        };
        let pid = child.id();
        self.child = Some(child);
        loop {
            // Ours, not merely something on the port: between `free_port` and our bind another
            // test's server (or a cluster node's bus port) can take it, and a plain connect
            // would then pass (CI once built a cluster on a non-cluster node that way). Ours
            // exits when its bind fails, and the caller tries another port.
            if answering_pid(self.port) == Some(pid) {
                return Ok(());
            }
            if let Some(child) = self.child.as_mut() {
                if let Ok(Some(status)) = child.try_wait() {
                    return Err(format!(
                        "redis-server on port {} exited: {status}",
                        self.port
                    ));
                }
            }
            assert!(
                started.elapsed() < START_TIMEOUT,
                "redis-server on port {} did not accept connections within {START_TIMEOUT:?}",
                self.port
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// The `process_id` of the Redis server answering on `port` (`INFO server`), or `None` when
/// nothing answers there as Redis does.
fn answering_pid(port: u16) -> Option<u32> {
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}/")).ok()?;
    let mut conn = client
        .get_connection_with_timeout(Duration::from_secs(1))
        .ok()?;
    conn.set_read_timeout(Some(Duration::from_secs(1))).ok()?;
    let info: redis::InfoDict = redis::cmd("INFO").arg("server").query(&mut conn).ok()?;
    info.get("process_id")
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A throwaway Redis Cluster: three primaries (and, with
/// [`RedisCluster::start_with_replicas`], one replica each), each a [`RedisServer`] with
/// `--cluster-enabled yes` on free loopback ports (its bus port chosen free too), joined and
/// given the 16384 slots by `redis-cli --cluster create`. Dropping it kills every node.
pub struct RedisCluster {
    nodes: Vec<RedisServer>,
}

/// `--cluster-node-timeout` of a cluster without replicas: long, so a loaded CI machine never
/// makes a node look failed.
const NODE_TIMEOUT_MS: &str = "5000";

/// `--cluster-node-timeout` of a cluster with replicas: short, so a failover takes seconds.
const FAILOVER_NODE_TIMEOUT_MS: &str = "1000";

impl std::fmt::Debug for RedisCluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ports: Vec<u16> = self.nodes.iter().map(RedisServer::port).collect();
        f.debug_struct("RedisCluster")
            .field("ports", &ports)
            .finish()
    }
}

impl RedisCluster {
    /// Three primaries sharing the slots, every node seeing the cluster `ok`. Panics if
    /// `redis-cli` is missing or the cluster does not form in time.
    pub fn start() -> RedisCluster {
        Self::start_with(&[])
    }

    /// As [`RedisCluster::start`], every node with extra options (e.g. an AOF).
    pub fn start_with(extra: &[&str]) -> RedisCluster {
        Self::create(0, NODE_TIMEOUT_MS, extra)
    }

    /// Three primaries, each with one replica (six nodes; the primaries are the first three
    /// of [`RedisCluster::urls`]), and a node timeout of one second, so a killed primary's
    /// replica takes over within seconds.
    pub fn start_with_replicas(extra: &[&str]) -> RedisCluster {
        Self::create(1, FAILOVER_NODE_TIMEOUT_MS, extra)
    }

    /// One cluster node on a free port with a free bus port; both are chosen again when the
    /// node exits at once (a port taken meanwhile, or the two drawn equal).
    fn node(node_timeout_ms: &str, extra: &[&str]) -> RedisServer {
        let mut failed = String::new();
        for _ in 0..START_ATTEMPTS {
            let bus = free_port().to_string();
            let mut args = vec![
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                node_timeout_ms,
                "--cluster-port",
                &bus,
                // A replica's sync starts at once (Redis would wait 5 s for others).
                "--repl-diskless-sync-delay",
                "0",
            ];
            args.extend_from_slice(extra);
            match RedisServer::try_start_with(&args) {
                Ok(node) => return node,
                Err(why) => failed = why,
            }
        }
        panic!("{failed} ({START_ATTEMPTS} attempts)");
    }

    fn create(replicas: usize, node_timeout_ms: &str, extra: &[&str]) -> RedisCluster {
        let nodes: Vec<RedisServer> = (0..3 * (1 + replicas))
            .map(|_| Self::node(node_timeout_ms, extra))
            .collect();
        let addresses: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port()))
            .collect();
        let created = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addresses)
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .stdin(Stdio::null())
            .output();
        match created {
            Ok(out) if out.status.success() => {}
            Ok(out) => panic!(
                "redis-cli --cluster create failed: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ),
            Err(e) => panic!("cannot run redis-cli ({e}); install redis-tools"),
        }
        let cluster = RedisCluster { nodes };
        cluster.wait_ok();
        for node in 0..cluster.nodes.len() {
            if node < 3 {
                cluster.wait_role(node, "master");
            } else {
                // A replica that never finished its first sync refuses to take over
                // ("disconnected from master for longer than allowed").
                cluster.wait_synced(node);
            }
        }
        cluster
    }

    /// An ACL user `name` on every node (see [`RedisServer::user_url`]): its URL per node.
    pub fn user_urls(&self, name: &str, denied: &[&str]) -> Vec<String> {
        self.nodes
            .iter()
            .map(|node| node.user_url(name, denied))
            .collect()
    }

    /// `redis://127.0.0.1:<port>/` of every node.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }

    /// Kill node `node` (SIGKILL) and start it again on the same port and directory, so it
    /// rejoins with its `nodes.conf` (and its AOF, if it has one); then wait for the cluster
    /// to be `ok` again. `down` is how long it stays dead.
    pub fn kill_and_restart(&mut self, node: usize, down: Duration) {
        self.nodes[node].kill();
        std::thread::sleep(down);
        self.nodes[node].restart();
        self.wait_ok();
    }

    /// Cut primary `node` off from its replica, so that its writes of the next `unreplicated`
    /// never reach it (the window asynchronous replication leaves open, made wide enough to
    /// meet; zero: no cut), then kill it (SIGKILL) and wait until the replica has taken its
    /// slots over and every other node sees the cluster `ok`; then start the killed node again
    /// (empty: it has no persistence), which rejoins as the new primary's replica, and wait
    /// until it has synced. Returns the index of the promoted replica.
    pub fn fail_over(&mut self, node: usize, unreplicated: Duration) -> usize {
        let port = self.nodes[node].port().to_string();
        let replica = (0..self.nodes.len())
            .find(|&n| {
                let role = self.cli(n, &["ROLE"]);
                let lines: Vec<&str> = role.lines().collect();
                lines.first() == Some(&"slave") && lines.get(2) == Some(&port.as_str())
            })
            .unwrap_or_else(|| panic!("node {node} of {self:?} has no replica"));
        if !unreplicated.is_zero() {
            // The replica stops reading (SIGSTOP), and a one-byte output limit makes the
            // primary drop the link at the first write the replica does not take: what the
            // primary writes from then on exists only on the primary.
            self.nodes[replica].signal("STOP");
            self.cli(
                node,
                &[
                    "CONFIG",
                    "SET",
                    "client-output-buffer-limit",
                    "replica 1 1 0",
                ],
            );
            // A write larger than the kernel's socket buffers, so it waits in the primary's
            // output buffer (the limit's business): otherwise the kernel would hold the
            // writes and hand them to the replica once it runs again. A key of this node.
            let local = (0..1000)
                .map(|i| format!("replication-cut-{i}"))
                .find(|key| self.cli(node, &["SET", key, "-"]).trim() == "OK")
                .unwrap_or_else(|| panic!("no key of node {node} found to write"));
            self.cli(
                node,
                &[
                    "EVAL",
                    "return redis.call('SET', KEYS[1], string.rep('x', 32 * 1024 * 1024))",
                    "1",
                    &local,
                ],
            );
            std::thread::sleep(unreplicated);
        }
        self.nodes[node].kill();
        self.nodes[replica].signal("CONT");
        self.wait_role(replica, "master");
        let started = Instant::now();
        while !(0..self.nodes.len()).filter(|&n| n != node).all(|n| {
            self.cli(n, &["CLUSTER", "INFO"])
                .contains("cluster_state:ok")
        }) {
            assert!(
                started.elapsed() < START_TIMEOUT,
                "the cluster did not recover from the failover within {START_TIMEOUT:?}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        self.nodes[node].restart();
        self.wait_synced(node);
        replica
    }

    /// Until node `node` is a replica whose link to its primary is up (its first sync done).
    fn wait_synced(&self, node: usize) {
        self.wait_role(node, "slave");
        let started = Instant::now();
        while !self
            .cli(node, &["INFO", "replication"])
            .contains("master_link_status:up")
        {
            assert!(
                started.elapsed() < START_TIMEOUT,
                "replica {node} of {self:?} did not sync within {START_TIMEOUT:?}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Until node `node` reports `role` (`master` or `slave`) as the first line of `ROLE`.
    fn wait_role(&self, node: usize, role: &str) {
        let started = Instant::now();
        while self.cli(node, &["ROLE"]).lines().next() != Some(role) {
            assert!(
                started.elapsed() < START_TIMEOUT,
                "node {node} of {self:?} did not become {role} within {START_TIMEOUT:?}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Move `slots` hash slots, with their keys, from node `from` to node `to` (indexes into
    /// [`RedisCluster::urls`]) with `redis-cli --cluster reshard`, while clients keep running.
    /// Returns what `redis-cli` printed; panics if it fails.
    pub fn reshard(&self, from: usize, to: usize, slots: u32) -> String {
        let id = |i: usize| self.cli(i, &["CLUSTER", "MYID"]).trim().to_owned();
        let (from_id, to_id) = (id(from), id(to));
        let out = Command::new("redis-cli")
            .args(["--cluster", "reshard"])
            .arg(format!("127.0.0.1:{}", self.nodes[from].port()))
            .args(["--cluster-from", &from_id, "--cluster-to", &to_id])
            .args(["--cluster-slots", &slots.to_string(), "--cluster-yes"])
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| panic!("cannot run redis-cli ({e})"));
        let printed = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "redis-cli --cluster reshard failed: {printed}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        printed
    }

    /// `redis-cli -p <node's port> args...`, its standard output.
    fn cli(&self, node: usize, args: &[&str]) -> String {
        Command::new("redis-cli")
            .args(["-p", &self.nodes[node].port().to_string()])
            .args(args)
            .stdin(Stdio::null())
            .output()
            .map(|out| String::from_utf8_lossy(&out.stdout).into_owned())
            .unwrap_or_default()
    }

    /// Until every node reports `cluster_state:ok` and knows every node (gossip takes a moment
    /// after `create` returns).
    fn wait_ok(&self) {
        let started = Instant::now();
        loop {
            let ready = (0..self.nodes.len()).all(|node| {
                let info = self.cli(node, &["CLUSTER", "INFO"]);
                info.contains("cluster_state:ok")
                    && info.contains(&format!("cluster_known_nodes:{}", self.nodes.len()))
            });
            if ready {
                return;
            }
            assert!(
                started.elapsed() < START_TIMEOUT,
                "the Redis Cluster on {self:?} did not become ok within {START_TIMEOUT:?}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// Redis's own count of calls of `command` (lower case, e.g. `"evalsha"`) on the server at
/// the end of `conn`, since its start or last `CONFIG RESETSTAT`; scripts' own calls included.
pub async fn command_calls(
    conn: &mut idempotency_actix::store::redis::redis::aio::MultiplexedConnection,
    command: &str,
) -> u64 {
    let stats: String = idempotency_actix::store::redis::redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await
        .expect("INFO commandstats");
    stats
        .lines()
        .find_map(|l| l.strip_prefix(&format!("cmdstat_{command}:calls=")))
        .and_then(|rest| rest.split(',').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// A multiplexed connection to the test server at `url`.
pub async fn connection(url: &str) -> redis::aio::MultiplexedConnection {
    let client = redis::Client::open(url).expect("test URL parses");
    client
        .get_multiplexed_async_connection()
        .await
        .expect("test redis-server accepts connections")
}

/// Start a replica of `primary` and wait until the primary counts it as connected and in sync.
pub async fn replica_of(primary: &RedisServer) -> RedisServer {
    let port = primary.port().to_string();
    let replica = RedisServer::start_with(&["--replicaof", "127.0.0.1", &port]);
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut primary_conn = connection(&primary.url()).await;
    loop {
        let info: String = redis::cmd("INFO")
            .arg("replication")
            .query_async(&mut primary_conn)
            .await
            .expect("INFO replication");
        if info.contains("connected_slaves:1") && info.contains("state=online") {
            return replica;
        }
        assert!(
            Instant::now() < deadline,
            "the replica did not come online:\n{info}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A server is known by its own pid, and nothing that is not Redis passes for one.
    #[test]
    fn a_server_answers_with_its_own_pid() {
        let server = RedisServer::start();
        let pid = server.child.as_ref().map(Child::id);
        assert_eq!(answering_pid(server.port()), pid);
        let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = silent.local_addr().unwrap().port();
        assert_eq!(answering_pid(port), None);
    }

    /// The CI failure this guards against: our server cannot bind a port another one took
    /// meanwhile, and a start that only connected took the other for ours. It must fail, so
    /// the caller tries another port.
    #[test]
    fn a_port_another_server_holds_is_not_taken_for_ours() {
        let other = RedisServer::start();
        let dir = std::env::temp_dir().join(format!("idem-redis-taken-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut ours = RedisServer {
            child: None,
            port: other.port(),
            extra: Vec::new(),
            dir,
        };
        let started = ours.try_spawn();
        assert!(started.is_err(), "took another server's port for ours");
    }
}
