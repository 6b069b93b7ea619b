//! The client of the container topologies (`scripts/docker-test.sh topologies`): drives a
//! mixed load of every writing family from inside the topology's Docker network,
//! following the primary through Sentinel, then reads what the primary holds and counts
//! the acknowledged calls whose effects it lacks.
//!
//!   topology --sentinels HOST:PORT,... --master NAME | --server HOST:PORT
//!            | --cluster HOST:PORT,...
//!            [--verify-sentinels HOST:PORT,...] [--seconds N] [--max-calls N]
//!            [--wait-replicas N]
//!
//! Prints one line, `result: ...`: calls, acknowledged calls, the longest time writes
//! failed (from the first failed call to the next one that succeeded), the calls refused
//! with NOREPLICAS, and the lost effects by family, read from the primary (or, with
//! `--verify-sentinels`, from the primary those Sentinels name: after a partition, the
//! one that won). With `--wait-replicas N`, a call counts as acknowledged only when
//! `WAIT N` after it says N replicas have it, as a gateway that wants that would do.
//! Against a cluster it also checks, at the end, that a TAKE2 on keys of two slots is
//! refused with CROSSSLOT (`crossslot_refused=1`).

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use std::collections::HashMap;

use redis::{cmd, Cmd, ConnectionLike, ErrorKind, RedisError, RedisResult, ServerErrorKind, Value};

/// A connection to one server, or to a cluster.
enum Connection {
    Single(redis::Connection),
    Cluster(Cluster),
}

impl ConnectionLike for Connection {
    fn req_packed_command(&mut self, packed: &[u8]) -> RedisResult<Value> {
        match self {
            Connection::Single(c) => c.req_packed_command(packed),
            Connection::Cluster(_) => Err(unroutable()),
        }
    }

    fn req_packed_commands(
        &mut self,
        packed: &[u8],
        offset: usize,
        count: usize,
    ) -> RedisResult<Vec<Value>> {
        match self {
            Connection::Single(c) => c.req_packed_commands(packed, offset, count),
            Connection::Cluster(_) => Err(unroutable()),
        }
    }

    fn req_command(&mut self, command: &Cmd) -> RedisResult<Value> {
        match self {
            Connection::Single(c) => c.req_command(command),
            Connection::Cluster(c) => c.request(command),
        }
    }

    fn get_db(&self) -> i64 {
        0
    }

    fn check_connection(&mut self) -> bool {
        true
    }

    fn is_open(&self) -> bool {
        true
    }
}

fn unroutable() -> RedisError {
    RedisError::from((ErrorKind::Client, "only whole commands are routed"))
}

/// A cluster followed by hand, every connection with the same timeouts as a single
/// server's: the slot map from CLUSTER SLOTS, read again after MOVED or a failed call.
struct Cluster {
    seeds: Vec<String>,
    slots: Vec<(u16, u16, String)>,
    connections: HashMap<String, redis::Connection>,
}

impl Cluster {
    fn new(seeds: Vec<String>) -> Option<Cluster> {
        let mut cluster = Cluster {
            seeds,
            slots: Vec::new(),
            connections: HashMap::new(),
        };
        cluster.refresh().then_some(cluster)
    }

    /// Reads the slot map from the first node that answers.
    fn refresh(&mut self) -> bool {
        let known = self.slots.iter().map(|(_, _, node)| node.clone());
        let candidates: Vec<String> = self.seeds.iter().cloned().chain(known).collect();
        for node in candidates {
            let Some(Connection::Single(mut con)) = connect(&node) else {
                continue;
            };
            let Ok(ranges) = cmd("CLUSTER").arg("SLOTS").query::<Vec<Value>>(&mut con) else {
                continue;
            };
            self.slots = ranges.iter().filter_map(slot_range).collect();
            self.connections.clear();
            return !self.slots.is_empty();
        }
        false
    }

    /// Sends `command` to the node serving its hash-tagged key.
    fn request(&mut self, command: &Cmd) -> RedisResult<Value> {
        // The first hash-tagged argument is a key (every key here has a tag); else the
        // first argument after the command's name.
        let args: Vec<&[u8]> = command
            .args_iter()
            .filter_map(|arg| match arg {
                redis::Arg::Simple(bytes) => Some(bytes),
                _ => None,
            })
            .collect();
        let slot = args
            .iter()
            .find_map(|arg| hash_tag(arg))
            .or_else(|| args.get(1).copied())
            .map_or(0, key_slot);
        let node = self
            .slots
            .iter()
            .find(|(start, end, _)| (*start..=*end).contains(&slot))
            .map(|(_, _, node)| node.clone());
        let Some(node) = node else {
            self.refresh();
            return Err(RedisError::from((
                ErrorKind::Server(ServerErrorKind::ClusterDown),
                "no node serves the slot",
            )));
        };
        if !self.connections.contains_key(&node) {
            let Some(Connection::Single(con)) = connect(&node) else {
                self.refresh();
                return Err(RedisError::from((ErrorKind::Io, "node unreachable")));
            };
            self.connections.insert(node.clone(), con);
        }
        let result = self
            .connections
            .get_mut(&node)
            .map(|con| con.req_command(command))
            .unwrap_or_else(|| Err(unroutable()));
        if let Err(e) = &result {
            // Moved slots, a failed node, a timeout: the map is read again.
            if e.is_io_error()
                || e.is_timeout()
                || e.kind() == ErrorKind::Server(ServerErrorKind::Moved)
            {
                self.connections.remove(&node);
                self.refresh();
            }
        }
        result
    }
}

/// One CLUSTER SLOTS entry: start, end, and the primary's address.
fn slot_range(entry: &Value) -> Option<(u16, u16, String)> {
    let Value::Array(fields) = entry else {
        return None;
    };
    let number = |v: &Value| match v {
        Value::Int(n) => u16::try_from(*n).ok(),
        _ => None,
    };
    let Some(Value::Array(primary)) = fields.get(2) else {
        return None;
    };
    let host = match primary.first()? {
        Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
        _ => return None,
    };
    let port = number(primary.get(1)?)?;
    Some((
        number(&fields[0])?,
        number(fields.get(1)?)?,
        format!("{host}:{port}"),
    ))
}

/// The part of a key between its first `{` and the next `}`, when not empty.
fn hash_tag(key: &[u8]) -> Option<&[u8]> {
    let open = key.iter().position(|&b| b == b'{')?;
    let close = key[open + 1..].iter().position(|&b| b == b'}')?;
    (close > 0).then(|| &key[open + 1..open + 1 + close])
}

/// Redis Cluster's slot: CRC16 (XMODEM) of the hash tag (or key), modulo 16384.
fn key_slot(tag: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &byte in tag {
        crc ^= u16::from(byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc % 16384
}

/// Where the primary is: asked of Sentinel each time, one fixed server, or a cluster
/// (whose client follows its slots).
#[derive(Clone)]
enum Primary {
    Sentinel {
        sentinels: Vec<String>,
        master: String,
    },
    Fixed(String),
    Cluster(Vec<String>),
}

impl Primary {
    fn address(&self) -> Option<String> {
        match self {
            Primary::Fixed(address) => Some(address.clone()),
            Primary::Cluster(nodes) => nodes.first().cloned(),
            Primary::Sentinel { sentinels, master } => sentinels.iter().find_map(|s| {
                let mut con = connect(s)?;
                let reply: Vec<String> = cmd("SENTINEL")
                    .arg("get-master-addr-by-name")
                    .arg(master)
                    .query(&mut con)
                    .ok()?;
                Some(format!("{}:{}", reply.first()?, reply.get(1)?))
            }),
        }
    }

    fn connect(&self) -> Option<Connection> {
        match self {
            Primary::Cluster(nodes) => Cluster::new(nodes.clone()).map(Connection::Cluster),
            _ => connect(&self.address()?),
        }
    }
}

fn connect(address: &str) -> Option<Connection> {
    let client = redis::Client::open(format!("redis://{address}/")).ok()?;
    let con = client
        .get_connection_with_timeout(Duration::from_millis(500))
        .ok()?;
    con.set_read_timeout(Some(Duration::from_millis(500)))
        .ok()?;
    con.set_write_timeout(Some(Duration::from_millis(500)))
        .ok()?;
    Some(Connection::Single(con))
}

/// The effects of the calls the primary acknowledged.
#[derive(Default)]
struct Acknowledged {
    takes: BTreeMap<String, u64>,
    leases: BTreeSet<String>,
    quota_calls: u64,
    admits: u64,
    record_tokens: u64,
    calls: u64,
}

const BUCKET_COUNT: u64 = 1_000_000;
/// 10^10 s for a million tokens: a refill of 10^-4 tokens a second, nothing in a run.
const BUCKET_PERIOD: u64 = 10_000_000_000;
const LEASE_KEY: &str = "qag:topo:{l}:running";
const QUOTA_KEY: &str = "qag:topo:{q}:quota";
const WINDOW_KEY: &str = "qag:topo:{w}:org";

fn bucket(i: u64) -> String {
    format!("qag:topo:{{b}}:{}", i % 8)
}

/// One round of the mixed load; each call's effect is recorded when acknowledged.
fn round(
    con: &mut Connection,
    i: u64,
    wait: u64,
    acked: &mut Acknowledged,
) -> redis::RedisResult<()> {
    let confirmed = |con: &mut Connection| -> redis::RedisResult<bool> {
        if wait == 0 {
            return Ok(true);
        }
        let replicas: u64 = cmd("WAIT").arg(wait).arg(1000).query(con)?;
        Ok(replicas >= wait)
    };
    let key = bucket(i);
    let reply: Vec<i64> = cmd("QAG.TAKE")
        .arg(&key)
        .arg(BUCKET_COUNT)
        .arg(BUCKET_PERIOD)
        .query(con)?;
    if reply[0] == 1 && confirmed(con)? {
        *acked.takes.entry(key).or_default() += 1;
        acked.calls += 1;
    }
    let (client, bucket_key) = (bucket(i + 1), bucket(i + 2));
    let reply: Value = cmd("QAG.TAKE2")
        .arg(&client)
        .arg(BUCKET_COUNT)
        .arg(BUCKET_PERIOD)
        .arg(&bucket_key)
        .arg(BUCKET_COUNT)
        .arg(BUCKET_PERIOD)
        .query(con)?;
    let both =
        matches!(&reply, Value::Array(pair) if !matches!(pair.get(1), Some(Value::Nil) | None));
    if both && confirmed(con)? {
        *acked.takes.entry(client).or_default() += 1;
        *acked.takes.entry(bucket_key).or_default() += 1;
        acked.calls += 1;
    }
    let id = format!("req{i}");
    let reply: Vec<i64> = cmd("QAG.LEASE")
        .arg(LEASE_KEY)
        .arg(1_000_000)
        .arg(600_000)
        .arg(&id)
        .query(con)?;
    if reply[0] == 1 && confirmed(con)? {
        acked.leases.insert(id);
        acked.calls += 1;
    }
    if i % 3 == 2 {
        let old = format!("req{}", i - 1);
        // A release sent may have run though its reply was lost (a kill after the AOF's
        // fsync, before the reply): the lease is no longer one the primary must hold.
        acked.leases.remove(&old);
        let released: i64 = cmd("QAG.RELEASE").arg(LEASE_KEY).arg(&old).query(con)?;
        if released == 1 && confirmed(con)? {
            acked.calls += 1;
        }
    }
    let _: Value = cmd("QAG.QUOTA.ADD")
        .arg(QUOTA_KEY)
        .arg(&["PER", "month", "TZ", "UTC", "CALLS", "1"])
        .query(con)?;
    if confirmed(con)? {
        acked.quota_calls += 1;
        acked.calls += 1;
    }
    let reply: Vec<i64> = cmd("QAG.ADMIT")
        .arg(1)
        .arg(WINDOW_KEY)
        .arg(1_000_000_000)
        .arg(0)
        .arg("WINDOW")
        .arg(86_400)
        .query(con)?;
    if reply[0] == 1 && confirmed(con)? {
        acked.admits += 1;
        acked.calls += 1;
    }
    let _: i64 = cmd("QAG.RECORD")
        .arg(1)
        .arg(WINDOW_KEY)
        .arg(5)
        .arg("WINDOW")
        .arg(86_400)
        .query(con)?;
    if confirmed(con)? {
        acked.record_tokens += 5;
        acked.calls += 1;
    }
    Ok(())
}

/// The sum of a window hash's counters whose names start with `prefix`.
fn window_sum(con: &mut Connection, prefix: &str) -> redis::RedisResult<u64> {
    let fields: BTreeMap<String, u64> = cmd("HGETALL").arg(WINDOW_KEY).query(con)?;
    Ok(fields
        .iter()
        .filter(|(name, _)| name.starts_with(prefix))
        .map(|(_, v)| v)
        .sum())
}

/// Lost effects, family by family: acknowledged but missing from the primary.
fn lost(
    con: &mut Connection,
    acked: &Acknowledged,
) -> redis::RedisResult<BTreeMap<&'static str, u64>> {
    let mut takes = 0;
    for (key, count) in &acked.takes {
        let tokens: Option<f64> = cmd("HGET").arg(key).arg("tokens").query(con)?;
        let expected = (BUCKET_COUNT - count) as f64;
        // More tokens than the acknowledged takes leave: takes the primary lacks.
        takes += (tokens.unwrap_or(BUCKET_COUNT as f64) - expected)
            .round()
            .max(0.0) as u64;
    }
    let members: BTreeSet<String> = cmd("ZRANGE").arg(LEASE_KEY).arg(0).arg(-1).query(con)?;
    let leases = acked.leases.difference(&members).count() as u64;
    let quota: Option<u64> = cmd("HGET").arg(QUOTA_KEY).arg("calls").query(con)?;
    let admits = acked.admits.saturating_sub(window_sum(con, "req:")?);
    let tokens = acked.record_tokens.saturating_sub(window_sum(con, "tok:")?) / 5;
    Ok(BTreeMap::from([
        ("takes", takes),
        ("leases", leases),
        (
            "quota_adds",
            acked.quota_calls.saturating_sub(quota.unwrap_or(0)),
        ),
        ("admits", admits),
        ("records", tokens),
    ]))
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let option = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let number =
        |name: &str, default: u64| option(name).map_or(default, |v| v.parse().expect(name));
    let list = |value: String| value.split(',').map(String::from).collect::<Vec<_>>();
    let primary = match (
        option("--sentinels"),
        option("--server"),
        option("--cluster"),
    ) {
        (Some(sentinels), _, _) => Primary::Sentinel {
            sentinels: list(sentinels),
            master: option("--master").unwrap_or_else(|| "qag".into()),
        },
        (None, Some(server), _) => Primary::Fixed(server),
        (None, None, Some(nodes)) => Primary::Cluster(list(nodes)),
        _ => panic!("--sentinels HOST:PORT,..., --server HOST:PORT or --cluster HOST:PORT,..."),
    };
    let verify_at = match option("--verify-sentinels") {
        Some(sentinels) => Primary::Sentinel {
            sentinels: list(sentinels),
            master: option("--master").unwrap_or_else(|| "qag".into()),
        },
        None => primary.clone(),
    };
    let seconds = number("--seconds", 12);
    let max_calls = number("--max-calls", 200_000);
    let wait = number("--wait-replicas", 0);

    let started = Instant::now();
    let deadline = started + Duration::from_secs(seconds);
    let mut acked = Acknowledged::default();
    let (mut i, mut attempted) = (0u64, 0u64);
    let mut con: Option<Connection> = None;
    let mut failing_since: Option<Instant> = None;
    let mut longest_outage = Duration::ZERO;
    let mut noreplicas = 0u64;
    while Instant::now() < deadline && attempted < max_calls {
        let Some(c) = con.as_mut() else {
            con = primary.connect();
            if con.is_none() {
                failing_since.get_or_insert_with(Instant::now);
                std::thread::sleep(Duration::from_millis(50));
            }
            continue;
        };
        attempted += 1;
        match round(c, i, wait, &mut acked) {
            Ok(()) => {
                if let Some(since) = failing_since.take() {
                    longest_outage = longest_outage.max(since.elapsed());
                }
                i += 1;
            }
            Err(e) => {
                noreplicas += u64::from(e.code() == Some("NOREPLICAS"));
                // Read-only replicas, refused writes and dead connections alike: ask
                // again where the primary is.
                failing_since.get_or_insert_with(Instant::now);
                con = None;
                i += 1;
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
    if let Some(since) = failing_since {
        longest_outage = longest_outage.max(since.elapsed());
    }
    // Read the primary's state once writes work there (a failover may still be ending).
    let verify_deadline = Instant::now() + Duration::from_secs(30);
    let losses = loop {
        let result = verify_at.connect().and_then(|mut c| {
            let _: () = cmd("SET")
                .arg("qag:topo:{b}:probe")
                .arg(1)
                .query(&mut c)
                .ok()?;
            lost(&mut c, &acked).ok()
        });
        if let Some(losses) = result {
            break losses;
        }
        assert!(
            Instant::now() < verify_deadline,
            "no writable primary to verify against"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    let crossslot = match &primary {
        Primary::Cluster(_) => {
            let refused = primary.connect().map(|mut c| {
                cmd("QAG.TAKE2")
                    .arg("qag:topo:{b}:x")
                    .arg(1)
                    .arg(1)
                    .arg("qag:topo:{l}:y")
                    .arg(1)
                    .arg(1)
                    .query::<Value>(&mut c)
                    .is_err_and(|e| {
                        e.kind() == ErrorKind::Server(ServerErrorKind::CrossSlot)
                            || e.code() == Some("CROSSSLOT")
                    })
            });
            format!(" crossslot_refused={}", u8::from(refused == Some(true)))
        }
        _ => String::new(),
    };
    let total: u64 = losses.values().sum();
    let by_family: Vec<String> = losses
        .iter()
        .map(|(k, v)| format!("lost_{k}={v}"))
        .collect();
    println!(
        "result: rounds={i} acknowledged_calls={} longest_write_outage_ms={} refused_noreplicas={noreplicas} lost_calls={total} {}{crossslot}",
        acked.calls,
        longest_outage.as_millis(),
        by_family.join(" ")
    );
}
