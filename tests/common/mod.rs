//! The integration tests' harness: a real server with the module loaded, started on a
//! free loopback port and stopped on drop; or, when QAG_REDIS_URL is set, a server that
//! is already running (tests that need servers of their own are then skipped).

#![allow(dead_code)] // each test binary uses its own part of the harness

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

pub use redis::{cmd, Connection, Value};

pub mod fault_proxy;
pub mod resp;

/// The token-bucket script, the reference QAG.TAKE must match.
pub const TOKEN_BUCKET_LUA: &str = include_str!("../../lua/token_bucket.lua");
/// The refund script, the reference QAG.REFUND must match.
pub const TOKEN_REFUND_LUA: &str = include_str!("../../lua/token_refund.lua");

/// The lease family's script, the reference QAG.LEASE, RENEW, RELEASE and LEASES match.
pub const LEASE_LUA: &str = include_str!("../../lua/lease.lua");
/// The quota family's script: the request ids' part, then its own (as the clients send it).
pub const QUOTA_LUA: &str = concat!(
    include_str!("../../lua/request_ids.lua"),
    include_str!("../../lua/quota.lua")
);
/// The token-bucket script for a call with a request id: the ids' part, the buckets'
/// part of ids, then the script (as the clients send it).
pub const TOKEN_BUCKET_IDS_LUA: &str = concat!(
    include_str!("../../lua/request_ids.lua"),
    include_str!("../../lua/bucket_ids.lua"),
    include_str!("../../lua/token_bucket.lua")
);
/// The refund script for a call with a request id, as the token-bucket script's.
pub const TOKEN_REFUND_IDS_LUA: &str = concat!(
    include_str!("../../lua/request_ids.lua"),
    include_str!("../../lua/bucket_ids.lua"),
    include_str!("../../lua/token_refund.lua")
);
/// The window family's script: the request ids' part, then its own.
pub const WINDOW_LUA: &str = concat!(
    include_str!("../../lua/request_ids.lua"),
    include_str!("../../lua/window.lua")
);

/// Loads the token-bucket script; returns its SHA for EVALSHA.
pub fn load_script(con: &mut Connection) -> String {
    cmd("SCRIPT")
        .arg("LOAD")
        .arg(TOKEN_BUCKET_LUA)
        .query(con)
        .unwrap()
}

/// A redis-server process of the test's own, killed on drop.
pub struct Server {
    child: Child,
    pub port: u16,
    dir: PathBuf,
    keep_dir: bool,
}

/// What a test talks to: its own server, or the external one.
pub struct Target {
    pub client: redis::Client,
    pub server: Option<Server>,
    prefix: String,
}

/// The repository's root: this harness is shared by the module's tests and the Rust
/// client's (clients/rust), so it is found from the package, not assumed to be it.
pub fn repository_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .find(|dir| dir.join("lua/token_bucket.lua").exists())
        .expect("the repository holds lua/token_bucket.lua")
        .to_path_buf()
}

pub fn module_path() -> PathBuf {
    std::env::var_os("QAG_MODULE")
        .map(PathBuf::from)
        .unwrap_or_else(|| repository_root().join("target/release/libqag.so"))
}

fn server_binary() -> String {
    std::env::var("REDIS_SERVER").unwrap_or_else(|_| "redis-server".into())
}

/// A free loopback port whose cluster bus port (10000 higher) is free too.
fn free_port() -> u16 {
    loop {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind a loopback port");
        let port = listener.local_addr().expect("local address").port();
        if port <= 55535 && TcpListener::bind(("127.0.0.1", port + 10000)).is_ok() {
            return port;
        }
    }
}

/// Options for a server of the test's own.
#[derive(Default, Clone)]
pub struct ServerOptions {
    /// Load the module (a replica may run without it: it only applies effects).
    pub without_module: bool,
    pub replica_of: Option<u16>,
    /// Arguments to the module, after its path in --loadmodule.
    pub module_args: Vec<String>,
    /// A data directory that outlives the server (for restarts); else a fresh one,
    /// removed with the server.
    pub dir: Option<PathBuf>,
    /// A port of the caller's choice (to restart a server where its clients connect);
    /// else a free one.
    pub port: Option<u16>,
    /// A program (and its arguments) to run the server under, e.g. valgrind.
    pub wrapper: Vec<String>,
    pub extra: Vec<String>,
}

impl Server {
    pub fn start(options: &ServerOptions) -> Server {
        let module = module_path();
        assert!(
            options.without_module || module.exists(),
            "{} is missing: build it with `cargo build --release`",
            module.display()
        );
        for _attempt in 0..5 {
            let port = options.port.unwrap_or_else(free_port);
            let dir = options.dir.clone().unwrap_or_else(|| {
                std::env::temp_dir().join(format!("qag-test-{}-{port}", std::process::id()))
            });
            std::fs::create_dir_all(&dir).expect("create the server's directory");
            let mut args: Vec<String> = vec![
                "--port".into(),
                port.to_string(),
                "--bind".into(),
                "127.0.0.1".into(),
                "--dir".into(),
                dir.display().to_string(),
                "--save".into(),
                "".into(),
                "--appendonly".into(),
                "no".into(),
                "--logfile".into(),
                dir.join("server.log").display().to_string(),
            ];
            if !options.without_module {
                args.extend(["--loadmodule".into(), module.display().to_string()]);
                args.extend(options.module_args.iter().cloned());
            }
            if let Some(primary) = options.replica_of {
                args.extend([
                    "--replicaof".into(),
                    "127.0.0.1".into(),
                    primary.to_string(),
                ]);
            }
            args.extend(options.extra.iter().cloned());
            let mut command = match options.wrapper.split_first() {
                Some((program, wrapper_args)) => {
                    let mut c = Command::new(program);
                    c.args(wrapper_args).arg(server_binary());
                    c
                }
                None => Command::new(server_binary()),
            };
            let child = command
                .args(&args)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap_or_else(|e| panic!("start {}: {e}", server_binary()));
            let mut server = Server {
                child,
                port,
                dir,
                keep_dir: options.dir.is_some(),
            };
            if server.wait_ready() {
                return server;
            }
            // Most likely the port was taken between choosing and binding it: retry.
        }
        panic!("could not start {} after 5 attempts", server_binary());
    }

    fn wait_ready(&mut self) -> bool {
        // Generous: a server under valgrind starts slowly.
        let deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return false;
            }
            if let Ok(mut con) = self.client().get_connection() {
                // Its own process, not another test's server that took the port first,
                // and done loading its data (PING answers LOADING until then).
                if let Ok(info) = cmd("INFO").arg("server").query::<String>(&mut con) {
                    if !info.contains(&format!("process_id:{}\r", self.child.id())) {
                        return false;
                    }
                    if cmd("PING").query::<String>(&mut con).is_ok() {
                        return true;
                    }
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }

    pub fn client(&self) -> redis::Client {
        redis::Client::open(format!("redis://127.0.0.1:{}/", self.port)).expect("client")
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("server.log")).unwrap_or_default()
    }

    /// Stops the server the way an operator would (SHUTDOWN, which persists what its
    /// configuration says) and waits for it to exit.
    pub fn shutdown(mut self) {
        let mut con = self.client().get_connection().expect("connect");
        let _ = cmd("SHUTDOWN").query::<Value>(&mut con);
        let deadline = Instant::now() + Duration::from_secs(120);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("the server did not shut down:\n{}", self.log());
    }

    /// The server's data directory.
    pub fn dir(&self) -> &std::path::Path {
        &self.dir
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Whether the process is still running (it did not crash).
    pub fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if !self.keep_dir {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

static NEXT_PREFIX: AtomicU32 = AtomicU32::new(0);

impl Target {
    /// The external server when QAG_REDIS_URL is set, else a server of the test's own.
    pub fn new() -> Target {
        let prefix = format!(
            "qag:test:{}:{}:",
            std::process::id(),
            NEXT_PREFIX.fetch_add(1, Ordering::Relaxed)
        );
        match std::env::var("QAG_REDIS_URL") {
            Ok(url) => Target {
                client: redis::Client::open(url).expect("QAG_REDIS_URL is a redis:// URL"),
                server: None,
                prefix,
            },
            Err(_) => {
                let server = Server::start(&ServerOptions::default());
                Target {
                    client: server.client(),
                    server: Some(server),
                    prefix,
                }
            }
        }
    }

    pub fn con(&self) -> Connection {
        self.client.get_connection().expect("connect")
    }

    /// A key name unique to this test, so tests may share an external server.
    pub fn key(&self, name: &str) -> String {
        format!("{}{name}", self.prefix)
    }

    /// Checks the server is up and, for a server of our own, that it never crashed.
    pub fn assert_healthy(&mut self) {
        let pong: String = cmd("PING")
            .query(&mut self.con())
            .expect("PING after the test");
        assert_eq!(pong, "PONG");
        if let Some(server) = self.server.as_mut() {
            assert!(server.alive(), "server died:\n{}", server.log());
        }
    }
}

/// A cluster of three primaries on loopback, each started with `options` plus cluster
/// mode, its slots split among them in order; returned once every node reports the
/// cluster ok.
pub fn start_cluster(options: &ServerOptions) -> Vec<Server> {
    start_cluster_of(&ClusterOptions {
        primaries: vec![options.clone(), options.clone(), options.clone()],
        ..Default::default()
    })
}

/// How [`start_cluster_of`] builds a cluster.
#[derive(Clone)]
pub struct ClusterOptions {
    /// Each primary's options (its replica, if any, has the same).
    pub primaries: Vec<ServerOptions>,
    /// A replica per primary (for failovers).
    pub replicas: bool,
    pub node_timeout_ms: u32,
    /// Arguments for every node (e.g. `--cluster-require-full-coverage no`).
    pub extra: Vec<String>,
}

impl Default for ClusterOptions {
    fn default() -> Self {
        ClusterOptions {
            primaries: vec![ServerOptions::default(); 3],
            replicas: false,
            node_timeout_ms: 5000,
            extra: Vec::new(),
        }
    }
}

/// Three primaries with a replica each, for tests that fail a primary over: a node
/// timeout of 2 s (with 1 s, nodes starved by the other suites took healthy nodes for
/// failed: no failover within 7 s, CLUSTERDOWN on healthy shards), and serving without
/// full coverage (else a failed primary takes the whole cluster down).
pub fn start_failover_cluster() -> Vec<Server> {
    start_cluster_of(&ClusterOptions {
        replicas: true,
        node_timeout_ms: 2000,
        extra: ["--cluster-require-full-coverage", "no"]
            .map(String::from)
            .to_vec(),
        ..Default::default()
    })
}

/// A cluster as `cluster` says: the primaries first (in order), then their replicas
/// (the replica of primary n at n + primaries), returned once every node reports the
/// cluster ok and every replica is in sync.
pub fn start_cluster_of(cluster: &ClusterOptions) -> Vec<Server> {
    let count = cluster.primaries.len();
    let copies = if cluster.replicas { 2 } else { 1 };
    let nodes: Vec<Server> = (0..count * copies)
        .map(|n| {
            let mut options = cluster.primaries[n % count].clone();
            let timeout = cluster.node_timeout_ms.to_string();
            options.extra.extend(
                [
                    "--cluster-enabled",
                    "yes",
                    "--cluster-node-timeout",
                    &timeout,
                ]
                .map(String::from),
            );
            options.extra.extend(cluster.extra.iter().cloned());
            Server::start(&options)
        })
        .collect();
    form_cluster(&nodes[..count], &nodes[count..]);
    let deadline = Instant::now() + Duration::from_secs(30);
    for node in &nodes {
        let mut con = node.client().get_connection().unwrap();
        loop {
            let info: String = cmd("CLUSTER").arg("INFO").query(&mut con).unwrap();
            let known: String = cmd("CLUSTER").arg("NODES").query(&mut con).unwrap();
            let replication: String = cmd("INFO").arg("replication").query(&mut con).unwrap();
            let met = known.lines().filter(|line| !line.contains("handshake"));
            if info.contains("cluster_state:ok")
                && met.count() == nodes.len()
                && (replication.contains("role:master")
                    || replication.contains("master_link_status:up"))
            {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "cluster never became ok:\n{info}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    nodes
}

/// Forms the cluster as `redis-cli --cluster create` and `add-node --cluster-slave`
/// would, without their waits, which have no end: a handshake dropped on a loaded
/// machine (it must finish within the node timeout) left `add-node` waiting forever.
/// Here each node is introduced again until it knows every other, all within 30 s.
fn form_cluster(primaries: &[Server], replicas: &[Server]) {
    let deadline = Instant::now() + Duration::from_secs(30);
    let con = |node: &Server| node.client().get_connection().unwrap();
    let slots = 16384 / primaries.len();
    for (n, primary) in primaries.iter().enumerate() {
        let last = if n + 1 == primaries.len() {
            16383
        } else {
            (n + 1) * slots - 1
        };
        let mut con = con(primary);
        let _: () = cmd("CLUSTER")
            .arg("ADDSLOTSRANGE")
            .arg(n * slots)
            .arg(last)
            .query(&mut con)
            .unwrap();
        let _: () = cmd("CLUSTER")
            .arg("SET-CONFIG-EPOCH")
            .arg(n + 1)
            .query(&mut con)
            .unwrap();
    }
    let nodes: Vec<&Server> = primaries.iter().chain(replicas).collect();
    let first = primaries[0].port;
    loop {
        let mut strangers = 0;
        for node in &nodes[1..] {
            let mut con = con(node);
            let known: String = cmd("CLUSTER").arg("NODES").query(&mut con).unwrap();
            // A node still in handshake is not known yet: the handshake may be dropped.
            let met = known.lines().filter(|line| !line.contains("handshake"));
            if met.count() < nodes.len() {
                strangers += 1;
                let _: () = cmd("CLUSTER")
                    .arg("MEET")
                    .arg("127.0.0.1")
                    .arg(first)
                    .query(&mut con)
                    .unwrap();
            }
        }
        if strangers == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "the nodes never met");
        std::thread::sleep(Duration::from_millis(500));
    }
    for (n, replica) in replicas.iter().enumerate() {
        let id: String = cmd("CLUSTER")
            .arg("MYID")
            .query(&mut con(&primaries[n % primaries.len()]))
            .unwrap();
        let mut con = con(replica);
        while let Err(error) = cmd("CLUSTER")
            .arg("REPLICATE")
            .arg(&id)
            .query::<()>(&mut con)
        {
            assert!(Instant::now() < deadline, "never a replica: {error}");
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// How many times the server ran `command` (lower case, e.g. `qag.take`), from
/// INFO commandstats; 0 when never.
pub fn command_calls(con: &mut Connection, command: &str) -> i64 {
    let stats: String = cmd("INFO").arg("commandstats").query(con).unwrap();
    stats
        .lines()
        .find_map(|line| line.strip_prefix(&format!("cmdstat_{command}:calls=")))
        .and_then(|rest| rest.split(',').next())
        .map_or(0, |calls| calls.parse().unwrap())
}

/// True when tests run against an external server; tests that need servers of their
/// own say so and return.
pub fn external(test: &str) -> bool {
    let external = std::env::var_os("QAG_REDIS_URL").is_some();
    if external {
        eprintln!("{test}: skipped against QAG_REDIS_URL: it starts servers of its own");
    }
    external
}

/// Every key's content (a hash's fields, a sorted set's members and scores, sorted; a
/// string's value) and absolute expiry: what persistence and replication must keep exactly.
pub type KeyState = (String, Vec<(String, String)>, i64);

pub fn dataset(con: &mut Connection) -> Vec<KeyState> {
    let mut keys: Vec<String> = cmd("KEYS").arg("*").query(con).unwrap();
    keys.sort();
    keys.into_iter()
        .map(|k| {
            let kind: String = cmd("TYPE").arg(&k).query(con).unwrap();
            let mut fields: Vec<(String, String)> = match kind.as_str() {
                "hash" => cmd("HGETALL").arg(&k).query(con).unwrap(),
                "zset" => cmd("ZRANGE")
                    .arg(&k)
                    .arg(0)
                    .arg(-1)
                    .arg("WITHSCORES")
                    .query(con)
                    .unwrap(),
                "string" => vec![("value".into(), cmd("GET").arg(&k).query(con).unwrap())],
                other => panic!("{k} is a {other}"),
            };
            fields.sort();
            let expire: i64 = cmd("PEXPIRETIME").arg(&k).query(con).unwrap();
            (k, fields, expire)
        })
        .collect()
}

/// A bucket's stored fields, parsed as the script parses them.
pub fn bucket_fields(con: &mut Connection, key: &str) -> Option<(f64, f64)> {
    let fields: Vec<Option<String>> = cmd("HMGET")
        .arg(key)
        .arg("tokens")
        .arg("ts")
        .query(con)
        .unwrap();
    match (&fields[0], &fields[1]) {
        (Some(t), Some(ts)) => Some((t.parse().unwrap(), ts.parse().unwrap())),
        _ => None,
    }
}

/// Everything a key holds that a command could change: its fields and absolute expiry.
pub fn snapshot(con: &mut Connection, key: &str) -> (Value, i64) {
    let dump: Value = cmd("DUMP").arg(key).query(con).unwrap();
    let expire: i64 = cmd("PEXPIRETIME").arg(key).query(con).unwrap();
    (dump, expire)
}

/// The rule of the issue, written out independently of the module: given the stored
/// state before a call and the clock of the call, the reply and the state after it.
pub fn expected_take(
    count: f64,
    period: f64,
    cost: f64,
    before: Option<(f64, f64)>,
    now: f64,
) -> ([i64; 3], (f64, f64)) {
    let (tokens, ts) = before.unwrap_or((count, now));
    let rate = count / period;
    let elapsed = if now - ts > 0.0 { now - ts } else { 0.0 };
    let mut tokens = if tokens + elapsed * rate < count {
        tokens + elapsed * rate
    } else {
        count
    };
    let (allowed, retry) = if tokens >= cost {
        tokens -= cost;
        (1, 0)
    } else if cost > count {
        (0, -1)
    } else {
        (0, ((cost - tokens) / rate).ceil() as i64)
    };
    let new_ts = if now > ts { now } else { ts };
    ([allowed, tokens.floor() as i64, retry], (tokens, new_ts))
}

/// What a refund of `n` does to a bucket stored as `before`, at the call's clock `now`:
/// refilled to now as a take refills it, `n` added, never above the count; a missing
/// bucket is full and written nothing. The reply and the state after (None: unwritten).
pub fn expected_refund(
    count: f64,
    period: f64,
    n: f64,
    before: Option<(f64, f64)>,
    now: f64,
) -> (i64, Option<(f64, f64)>) {
    let Some((tokens, ts)) = before else {
        return (count as i64, None);
    };
    let elapsed = if now - ts > 0.0 { now - ts } else { 0.0 };
    let refilled = (tokens + elapsed * count / period).min(count);
    let tokens = (refilled + n).min(count);
    let new_ts = if now > ts { now } else { ts };
    (tokens.floor() as i64, Some((tokens, new_ts)))
}

/// One round of every writing command, on keys under the hash tag `{t}`, with limits
/// and lifetimes of `lifetime` seconds: a workload whose every effect persistence and
/// replication must keep.
pub fn mixed_round(con: &mut Connection, round: u64, lifetime: u64) {
    let bucket = format!("qag:rl:{{t}}:{}", round % 4);
    let lifetime_ms = lifetime * 1000;
    let calls: Vec<redis::Cmd> = vec![
        // Before the takes, so a bucket ends each of its rounds spent.
        cmd("QAG.REFUND")
            .arg(&bucket)
            .arg(3)
            .arg(lifetime)
            .arg(1 + round % 2)
            .clone(),
        cmd("QAG.TAKE").arg(&bucket).arg(3).arg(lifetime).clone(),
        cmd("QAG.TAKE")
            .arg(&bucket)
            .arg(3)
            .arg(lifetime)
            .arg("COST")
            .arg(2)
            .clone(),
        cmd("QAG.TAKE2")
            .arg("qag:rl:{t}:ip")
            .arg(20)
            .arg(lifetime)
            .arg(&bucket)
            .arg(3)
            .arg(lifetime)
            .clone(),
        // An id used for two rounds: the second is a replay.
        cmd("QAG.TAKE")
            .arg(&bucket)
            .arg(3)
            .arg(lifetime)
            .arg("ID")
            .arg(format!("t{}", round / 2))
            .clone(),
        cmd("QAG.LEASE")
            .arg("qag:running:{t}")
            .arg(3)
            .arg(lifetime_ms)
            .arg(format!("req{round}"))
            .clone(),
        cmd("QAG.RENEW")
            .arg("qag:running:{t}")
            .arg(format!("req{}", round.saturating_sub(1)))
            .arg(lifetime_ms)
            .clone(),
        cmd("QAG.RELEASE")
            .arg("qag:running:{t}")
            .arg(format!("req{}", round.saturating_sub(2)))
            .clone(),
        cmd(if round % 7 == 3 {
            "QAG.QUOTA.SEED"
        } else {
            "QAG.QUOTA.ADD"
        })
        .arg("qag:quota:{t}")
        .arg(&["PER", "day", "TZ", "America/New_York", "CALLS"])
        .arg(round)
        .arg("ROWS")
        .arg(10 * round)
        .clone(),
        cmd("QAG.ADMIT")
            .arg(2)
            .arg(&[
                "qag:win:{t}:org",
                "40",
                "5000",
                "qag:win:{t}:key",
                "3",
                "0",
                "WINDOW",
            ])
            .arg(lifetime)
            .clone(),
        cmd("QAG.RECORD")
            .arg(2)
            .arg(&["qag:win:{t}:org", "qag:win:{t}:key"])
            .arg(100 + round)
            .arg("WINDOW")
            .arg(lifetime)
            .clone(),
        // A model call's tokens: reserved, charged in part, committed a round later.
        cmd("QAG.ADMIT")
            .arg(1)
            .arg(&["qag:win:{t}:model", "0", "100000", "RESERVE", "500", "ID"])
            .arg(format!("m{round}"))
            .arg("WINDOW")
            .arg(lifetime)
            .clone(),
        cmd("QAG.RECORD")
            .arg(1)
            .arg(&["qag:win:{t}:model", "20", "ID"])
            .arg(format!("m{round}"))
            .arg(&["PARTIAL", "WINDOW"])
            .arg(lifetime)
            .clone(),
        // The last reservation's id on another chain first (its id remembered in the
        // same first key): a plain record there, and the commit on the reservation's
        // own chain still closes it (issue 38).
        cmd("QAG.RECORD")
            .arg(2)
            .arg(&["qag:win:{t}:model", "qag:win:{t}:org"])
            .arg(5)
            .arg("ID")
            .arg(format!("m{}", round.saturating_sub(1)))
            .arg("WINDOW")
            .arg(lifetime)
            .clone(),
        cmd("QAG.RECORD")
            .arg(1)
            .arg("qag:win:{t}:model")
            .arg(100 + round)
            .arg("ID")
            .arg(format!("m{}", round.saturating_sub(1)))
            .arg("WINDOW")
            .arg(lifetime)
            .clone(),
        // A hold a day ahead, which no reservation writes: read as gone (issue 38).
        cmd("HSET")
            .arg("qag:win:{t}:org")
            .arg("holds")
            .arg(format!("9000 {}", unix_ms() + 86_400_000))
            .clone(),
        // Quantities 0 (a peek) to 2 against a burst of 3, refilled slowly enough that
        // both keys outlive the round.
        cmd("QAG.THROTTLE")
            .arg(format!("qag:cell:{{t}}:{}", round % 2))
            .arg(2)
            .arg(3)
            .arg(100 * lifetime)
            .arg(round % 3)
            .clone(),
    ];
    for (i, call) in calls.iter().enumerate() {
        let _: Value = call
            .query(con)
            .unwrap_or_else(|e| panic!("round {round}, call {i}: {e}"));
    }
}

/// A primary with the module and a linked replica without it.
pub fn primary_and_replica() -> (Server, Server) {
    primary_and_linked_replica(true)
}

/// A primary with the module and a linked replica, `without_module` or with it (a
/// replica to promote).
pub fn primary_and_linked_replica(without_module: bool) -> (Server, Server) {
    let primary = Server::start(&ServerOptions::default());
    let replica = Server::start(&ServerOptions {
        without_module,
        replica_of: Some(primary.port),
        ..Default::default()
    });
    let mut r = replica.client().get_connection().unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let info: String = cmd("INFO").arg("replication").query(&mut r).unwrap();
        if info.contains("master_link_status:up") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "replica never linked:\n{}",
            replica.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    (primary, replica)
}

/// Sends one command given as words.
pub fn send(con: &mut Connection, words: &[&str]) -> redis::RedisResult<Value> {
    let mut c = cmd(words[0]);
    for w in &words[1..] {
        c.arg(*w);
    }
    c.query(con)
}

/// Sends one command written as words separated by single spaces.
pub fn send_line(con: &mut Connection, line: &str) -> redis::RedisResult<Value> {
    send(con, &line.split(' ').collect::<Vec<_>>())
}

// What tests read of a window scope's hash.

/// The sum of a window hash's counters of one kind (`req:` or `tok:`).
pub fn counted(con: &mut redis::Connection, key: &str, prefix: &str) -> i64 {
    let fields: Vec<(String, String)> = redis::cmd("HGETALL").arg(key).query(con).unwrap();
    fields
        .iter()
        .filter(|(name, _)| name.starts_with(prefix))
        .map(|(_, v)| v.parse::<i64>().unwrap())
        .sum()
}

/// The wall clock in milliseconds.
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// The tokens a scope holds for open reservations now (`holds`: `<tokens> <until ms>`
/// groups; a group past its time counts no more).
pub fn held(con: &mut redis::Connection, key: &str) -> i64 {
    let holds: Option<String> = redis::cmd("HGET").arg(key).arg("holds").query(con).unwrap();
    let now_ms = unix_ms() as i64;
    let words: Vec<i64> = holds
        .unwrap_or_default()
        .split_whitespace()
        .map(|w| w.parse().unwrap())
        .collect();
    words
        .chunks(2)
        .filter(|group| group[1] > now_ms)
        .map(|group| group[0])
        .sum()
}

/// A stopped server (SIGSTOP), continued when the test ends however it ends.
pub struct Stopped(Option<u32>);

impl Stopped {
    pub fn new(server: &Server) -> Stopped {
        signal("-STOP", server.pid());
        Stopped(Some(server.pid()))
    }

    pub fn resume(&mut self) {
        if let Some(pid) = self.0.take() {
            signal("-CONT", pid);
        }
    }
}

impl Drop for Stopped {
    fn drop(&mut self) {
        self.resume();
    }
}

pub fn signal(which: &str, pid: u32) {
    let status = Command::new("kill")
        .arg(which)
        .arg(pid.to_string())
        .status()
        .expect("run kill");
    assert!(status.success(), "kill {which} {pid}");
}

/// The machine's cores, shared by the suites CI runs side by side (the module's, the
/// Rust client's, the Python client's): a test that keeps every core busy on purpose
/// holds them alone, a test that measures how soon the server answers holds them shared,
/// so the two never run at once. A lock on one file of the temporary directory (the
/// Python suite's `cores` fixture takes the same), released when dropped. A cluster
/// failing over holds them alone too: its nodes must answer each other within their
/// timeout.
pub struct Cores(std::fs::File);

impl Cores {
    fn file() -> std::fs::File {
        std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(std::env::temp_dir().join("qag-test-cores.lock"))
            .expect("open the cores' lock")
    }

    /// For a test that times the server.
    pub fn shared() -> Cores {
        let file = Cores::file();
        file.lock_shared().expect("share the cores");
        Cores(file)
    }

    /// For a test that keeps them busy.
    pub fn exclusive() -> Cores {
        let file = Cores::file();
        file.lock().expect("take the cores");
        Cores(file)
    }
}

/// Whether memcheck sees the allocations of the server REDIS_SERVER names: one built with
/// libc malloc (the Valkeys here), or one that links jemalloc as a shared library
/// (Debian's Redis 7.0), whose functions valgrind replaces; not one with jemalloc built
/// in (Redis 8.2 here), whose allocations it cannot see. Says so when not; panics when
/// valgrind is missing.
pub fn memcheck_sees_the_servers_allocations() -> bool {
    let binary = server_binary();
    let version = Command::new(&binary).arg("--version").output().unwrap();
    let libc = String::from_utf8_lossy(&version.stdout).contains("malloc=libc");
    let shared_jemalloc = Command::new("ldd")
        .arg(&binary)
        .output()
        .map(|out| String::from_utf8_lossy(&out.stdout).contains("libjemalloc.so"))
        .unwrap_or(false);
    if !(libc || shared_jemalloc) {
        eprintln!(
            "valgrind: skipped for {binary}: its allocator is built in, out of memcheck's sight"
        );
        return false;
    }
    if Command::new("valgrind").arg("--version").output().is_err() {
        panic!("valgrind is not installed (scripts/setup.sh installs it)");
    }
    true
}

/// valgrind's options for a server under memcheck, its report written to `log`.
pub fn memcheck(log: &std::path::Path) -> Vec<String> {
    vec![
        "valgrind".into(),
        "--leak-check=full".into(),
        "--show-leak-kinds=definite,indirect".into(),
        format!("--log-file={}", log.display()),
    ]
}

/// The records of a memcheck report (the file at `log`, removed) that name the module
/// and say it leaked, read or wrote where it should not, or used uninitialised memory;
/// with `any_invalid`, also every invalid read, write or free in the server's own
/// frames (where a module's misuse of the API shows: a handle the server frees twice).
/// Panics if the report is not whole (valgrind did not finish).
pub fn memcheck_findings(log: &std::path::Path, any_invalid: bool) -> Vec<String> {
    let report = std::fs::read_to_string(log).unwrap();
    let _ = std::fs::remove_file(log);
    // Each error or leak record is a block of "==pid== " lines ended by an empty one.
    let mut records = vec![String::new()];
    for line in report.lines() {
        let text = line.splitn(3, "==").nth(2).unwrap_or(line).trim();
        match (text.is_empty(), records.last_mut()) {
            (true, _) => records.push(String::new()),
            (false, Some(record)) => {
                record.push_str(text);
                record.push('\n');
            }
            (false, None) => unreachable!("records starts non-empty"),
        }
    }
    assert!(
        report.contains("ERROR SUMMARY"),
        "valgrind did not finish:\n{report}"
    );
    let summary: Vec<&String> = records
        .iter()
        .filter(|r| r.contains("LEAK SUMMARY") || r.contains("ERROR SUMMARY"))
        .collect();
    eprintln!("memcheck: {summary:?}");
    let in_module =
        |r: &String| r.contains("libqag") || r.contains("qag::") || r.contains("qag_core::");
    let bad = |r: &String| {
        r.contains("definitely lost") || r.contains("Invalid") || r.contains("uninitialised")
    };
    records
        .into_iter()
        .filter(|r| (in_module(r) && bad(r)) || (any_invalid && r.contains("Invalid")))
        .collect()
}

/// Slot → the port of its primary, from the first node that answers.
pub fn slot_owners(nodes: &[Server]) -> std::collections::HashMap<u16, u16> {
    for node in nodes {
        let Ok(mut con) = node
            .client()
            .get_connection_with_timeout(Duration::from_secs(1))
        else {
            continue;
        };
        let _ = con.set_read_timeout(Some(Duration::from_secs(1)));
        let Ok(redis::Value::Array(ranges)) = cmd("CLUSTER").arg("SLOTS").query(&mut con) else {
            continue;
        };
        let mut owners = std::collections::HashMap::new();
        for range in ranges {
            let redis::Value::Array(fields) = range else {
                panic!("a CLUSTER SLOTS entry")
            };
            let number = |value: &redis::Value| match value {
                redis::Value::Int(n) => *n as u16,
                other => panic!("a number, got {other:?}"),
            };
            let redis::Value::Array(primary) = &fields[2] else {
                panic!("a node")
            };
            for slot in number(&fields[0])..=number(&fields[1]) {
                owners.insert(slot, number(&primary[1]));
            }
        }
        return owners;
    }
    panic!("no node answers")
}

pub fn slot(nodes: &[Server], key: &str) -> u16 {
    let mut con = nodes[0].client().get_connection().unwrap();
    cmd("CLUSTER")
        .arg("KEYSLOT")
        .arg(key)
        .query(&mut con)
        .unwrap()
}

/// Moves `slots` from `source` to `target` as redis-cli's reshard does, two keys at a
/// time (ASK for a key already moved, TRYAGAIN for a pair split).
pub fn migrate(ports: Vec<u16>, slots: Vec<u16>, source: u16, target: u16) {
    let con = |port: u16| {
        redis::Client::open(format!("redis://127.0.0.1:{port}/"))
            .unwrap()
            .get_connection()
            .unwrap()
    };
    let (mut src, mut dst) = (con(source), con(target));
    let id =
        |con: &mut redis::Connection| -> String { cmd("CLUSTER").arg("MYID").query(con).unwrap() };
    let (source_id, target_id) = (id(&mut src), id(&mut dst));
    for slot in slots {
        let _: () = cmd("CLUSTER")
            .arg("SETSLOT")
            .arg(slot)
            .arg("IMPORTING")
            .arg(&source_id)
            .query(&mut dst)
            .unwrap();
        let _: () = cmd("CLUSTER")
            .arg("SETSLOT")
            .arg(slot)
            .arg("MIGRATING")
            .arg(&target_id)
            .query(&mut src)
            .unwrap();
        loop {
            let keys: Vec<String> = cmd("CLUSTER")
                .arg("GETKEYSINSLOT")
                .arg(slot)
                .arg(2)
                .query(&mut src)
                .unwrap();
            if keys.is_empty() {
                break;
            }
            let _: () = cmd("MIGRATE")
                .arg("127.0.0.1")
                .arg(target)
                .arg("")
                .arg(0)
                .arg(5000)
                .arg("KEYS")
                .arg(&keys)
                .query(&mut src)
                .unwrap();
            std::thread::sleep(Duration::from_millis(5)); // calls meet the slot half moved
        }
        // The target first, then the source, as redis-cli does (the other order bounces
        // MOVED between them until both know).
        let mut ports = ports.clone();
        ports.sort_by_key(|port| (*port != target, *port != source));
        for port in &ports {
            let _: () = cmd("CLUSTER")
                .arg("SETSLOT")
                .arg(slot)
                .arg("NODE")
                .arg(&target_id)
                .query(&mut con(*port))
                .unwrap();
        }
    }
}
