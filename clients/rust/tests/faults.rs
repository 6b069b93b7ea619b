//! Issue 49's search of the client's failure paths: many concurrent callers take from a
//! bucket, wait for a bucket, hold leases, check and add to a quota and are admitted by
//! a window, and HTTP callers go through the tower
//! layer on a real hyper server (examples/axum_gateway.rs: a key's bucket, its quota
//! and its concurrent queries), through a fault proxy of the test's own
//! (tests/common/fault_proxy.rs) while a seeded schedule delays replies past the
//! deadline, swallows replies after their commands ran, resets and refuses
//! connections, pauses writes (CLIENT PAUSE … WRITE, as a failover does), stops the
//! server (SIGSTOP), restarts it with and without the module, and flushes its scripts.
//! Then the promises are checked against what the callers saw:
//! - between two restarts (each starts the keys afresh), no bucket allowed more than
//!   its size and what refilled (the gateway's 200s included), and no more leases were
//!   held at once than the limit (a call whose answer straddles a restart is left out:
//!   it is of either server);
//! - between two restarts, no more quota checks allowed than the quota and the calls in
//!   flight (a check and its add are two calls), and no more admitted by a window than
//!   its requests a window in each window the server's life touched; at the end, the
//!   quota counted no add twice and lost none that was answered;
//! - no call overran its deadline (and its wait) by more than `SLACK`, and no request
//!   its deadline and its work;
//! - every error is an outage's (`Timeout`, `Unavailable`, `Busy`): nothing else, and
//!   no failure answered as allowed (the policy is `Raise`); the gateway answers 200,
//!   429 or 503, nothing else;
//! - once the faults end, the limiter's back-off ends by itself, with no call (its
//!   prober finds the server answering);
//! - a second after the last call ended, no slot is held in Redis (the library's TTL is
//!   3 s, the gateway's 30 s): every lease that was granted, whether its caller saw the
//!   grant or not, was given back.
//!
//! `QAG_FAULT_SECONDS` (default 25) bounds the run, `QAG_FAULT_SEED` replays a schedule
//! (the faults in the same order; their timing against the calls varies); a failure
//! prints its seed and the faults applied.

#[path = "../../../tests/common/mod.rs"]
mod common;
#[path = "support/gateway.rs"]
mod gateway;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::fault_proxy::FaultProxy;
use common::*;
use gateway::Gateway;
use qag_client::{
    AnsweredBy, Bucket, Error, Lease, Limiter, OnUnavailable, Options, Per, Quota, Scope,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use redis::aio::ConnectionLike;

const DEADLINE: Duration = Duration::from_millis(300);
const WAIT: Duration = Duration::from_millis(200);
/// A call's time past its deadline (and wait) that counts as an overrun: a loaded
/// machine's scheduling, never a round trip more.
const SLACK: Duration = Duration::from_millis(250);
const CALLERS: usize = 24;
/// The end of a run, with the network's faults only.
const TAIL: Duration = Duration::from_secs(4);

const BUCKET: (&str, u64, f64) = ("qag:faults:bucket", 20, 60.0);
const WAITING: (&str, u64, f64) = ("qag:faults:waiting", 10, 30.0);
const LEASES: (&str, u64, Duration) = ("qag:faults:leases", 3, Duration::from_secs(3));
/// The gateway's: its key's bucket (30 a minute), at most 3 of its requests at once,
/// each with the gateway's deadline (the client's default).
const GATEWAY_BUCKET: (u64, f64) = (30, 60.0);
const GATEWAY_DEADLINE: Duration = Duration::from_millis(500);
const HTTP_CALLERS: usize = 8;
const QUOTA: (&str, u64) = ("qag:faults:quota", 40);
const WINDOW: (&str, u64) = ("qag:faults:window", 30);

/// What a caller saw of one call.
enum Seen {
    Allowed {
        bucket: &'static str,
        sent: Instant,
        received: Instant,
    },
    Held {
        sent: Instant,
        received: Instant,
        released: Instant,
    },
    Took {
        what: &'static str,
        took: Duration,
        bound: Duration,
    },
    Failed(Error),
    /// A quota check allowed, an add answered (`counted`) or not.
    QuotaAllowed {
        sent: Instant,
        received: Instant,
    },
    QuotaAdd {
        sent: Instant,
        counted: bool,
    },
    Admitted {
        sent: Instant,
        received: Instant,
    },
    Response {
        status: u16,
        sent: Instant,
        received: Instant,
        work: Duration,
    },
}

#[derive(Default)]
struct Record {
    seen: Mutex<Vec<Seen>>,
    /// When each restart began and when the new server answered.
    restarts: Mutex<Vec<(Instant, Instant)>>,
    faults: Mutex<Vec<String>>,
}

impl Record {
    fn push(&self, seen: Seen) {
        self.seen.lock().unwrap().push(seen);
    }
}

fn seconds() -> f64 {
    std::env::var("QAG_FAULT_SECONDS")
        .ok()
        .and_then(|text| text.parse().ok())
        .unwrap_or(25.0)
}

#[tokio::test(flavor = "multi_thread")]
async fn the_clients_promises_hold_under_a_random_schedule_of_faults() {
    if external("the_clients_promises_hold_under_a_random_schedule_of_faults") {
        return;
    }
    let seed = seed();
    let server = Server::start(&ServerOptions::default());
    let port = server.port;
    let proxy = Arc::new(FaultProxy::start(port));
    let url = format!("redis://127.0.0.1:{}/", proxy.port);
    let options = Options {
        deadline: DEADLINE,
        on_unavailable: OnUnavailable::Raise,
        back_off: Duration::from_millis(500),
        ..Options::default()
    };
    let limiter = Limiter::connect(&url, options).await.unwrap();
    // The gateway's warnings (a 503, a quota add that failed) go to a file of their own.
    let gateway_log =
        std::env::temp_dir().join(format!("qag-faults-gateway-{}.log", std::process::id()));
    let gateway = Gateway::start_at(
        &url,
        &[
            "--key-limit",
            &format!("{}/{}", GATEWAY_BUCKET.0, GATEWAY_BUCKET.1),
            "--max-concurrent",
            "3",
            "--quota-calls",
            "100000",
            "--policy",
            "raise",
            "--back-off",
            "0.5",
        ],
        Some(&gateway_log),
    );
    let record = Arc::new(Record::default());
    // An instant and the Unix time then: the windows a span of instants touches.
    let anchor = (Instant::now(), unix_ms());
    let run = Duration::from_secs_f64(seconds());
    let end = Instant::now() + run;

    let schedule = {
        let (proxy, record) = (proxy.clone(), record.clone());
        std::thread::spawn(move || faults(server, &proxy, &record, seed, end))
    };
    let callers: Vec<_> = (0..CALLERS)
        .map(|n| {
            let (limiter, record) = (limiter.clone(), record.clone());
            let rng = StdRng::seed_from_u64(seed ^ (n as u64 + 1));
            tokio::spawn(call(limiter, record, rng, end))
        })
        .collect();
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    let requests: Vec<_> = (0..HTTP_CALLERS)
        .map(|n| {
            let (http, record) = (http.clone(), record.clone());
            let base = gateway.url("key=faults");
            let rng = StdRng::seed_from_u64(seed ^ (1000 + n as u64));
            tokio::spawn(request(http, base, record, rng, end))
        })
        .collect();
    for caller in callers.into_iter().chain(requests) {
        caller.await.unwrap();
    }
    let server = schedule.join().unwrap();
    proxy.heal();
    let ended = Instant::now();

    let findings = check(&record, ended, anchor);
    let findings = [
        findings,
        left_behind(&record, &[&server]).await,
        back_off_left(&limiter, ended).await,
    ]
    .concat();
    drop(gateway);
    let _ = std::fs::remove_file(&gateway_log);
    let swallowed = format!("{} replies swallowed", proxy.swallowed());
    report(seed, run, &record, &swallowed, &findings);
}

/// The same callers (no gateway) on a cluster of three primaries, each with a replica,
/// while the schedule moves a busy slot to another primary (as redis-cli's reshard
/// does), fails a primary over to its replica (`CLUSTER FAILOVER`: coordinated, so no
/// acknowledged write is lost), pauses a primary's writes, and stops one (SIGSTOP,
/// shorter than the node timeout). Nothing restarts: the limits hold over the whole run.
#[tokio::test(flavor = "multi_thread")]
async fn the_clients_promises_hold_on_a_cluster_under_a_random_schedule_of_faults() {
    if external("the_clients_promises_hold_on_a_cluster_under_a_random_schedule_of_faults") {
        return;
    }
    // A cluster failing over holds the cores alone: its nodes must answer each other
    // within their timeout.
    let _alone = Cores::exclusive();
    let seed = seed();
    let nodes = start_failover_cluster();
    let urls: Vec<String> = nodes
        .iter()
        .map(|node| format!("redis://127.0.0.1:{}/", node.port))
        .collect();
    let seeds: Vec<&str> = urls.iter().map(String::as_str).collect();
    let options = Options {
        deadline: DEADLINE,
        on_unavailable: OnUnavailable::Raise,
        back_off: Duration::from_millis(500),
        ..Options::default()
    };
    let limiter = Limiter::connect_cluster(&seeds, options).unwrap();
    let record = Arc::new(Record::default());
    let anchor = (Instant::now(), unix_ms());
    let run = Duration::from_secs_f64(seconds() * 0.6);
    let end = Instant::now() + run;
    let schedule = {
        let record = record.clone();
        std::thread::spawn(move || {
            cluster_faults(&nodes, &record, seed, end);
            nodes
        })
    };
    let callers: Vec<_> = (0..CALLERS)
        .map(|n| {
            let (limiter, record) = (limiter.clone(), record.clone());
            let rng = StdRng::seed_from_u64(seed ^ (n as u64 + 1));
            tokio::spawn(call(limiter, record, rng, end))
        })
        .collect();
    for caller in callers {
        caller.await.unwrap();
    }
    let nodes = schedule.join().unwrap();
    let ended = Instant::now();
    let findings = check(&record, ended, anchor);
    let primaries: Vec<&Server> = nodes.iter().filter(|node| role(node) == "master").collect();
    let findings = [
        findings,
        left_behind(&record, &primaries).await,
        back_off_left(&limiter, ended).await,
    ]
    .concat();
    report(
        seed,
        run,
        &record,
        "a cluster of 3 primaries and 3 replicas",
        &findings,
    );
}

/// `QAG_FAULT_SEED`, or a random one; printed either way.
fn seed() -> u64 {
    let seed = std::env::var("QAG_FAULT_SEED")
        .ok()
        .and_then(|text| text.parse().ok())
        .unwrap_or_else(|| rand::thread_rng().gen());
    println!("QAG_FAULT_SEED={seed}");
    seed
}

/// What the callers left in Redis, a second after the last one ended (the library's
/// leases would run out at 3 s): a slot still held, a quota count off.
async fn left_behind(record: &Record, servers: &[&Server]) -> Vec<String> {
    tokio::time::sleep(Duration::from_secs(1)).await;
    let now_ms = unix_ms();
    let (mut held, mut counted) = (0, 0);
    for server in servers {
        let mut con = server.client().get_connection().unwrap();
        let gateways: Vec<String> = cmd("KEYS").arg("qag:running:*").query(&mut con).unwrap();
        for key in gateways.iter().map(String::as_str).chain([LEASES.0]) {
            // A key of another node's slot answers MOVED: nothing of it here.
            let live: redis::RedisResult<i64> = cmd("ZCOUNT")
                .arg(key)
                .arg(now_ms)
                .arg("+inf")
                .query(&mut con);
            held += live.unwrap_or(0);
        }
        let calls: redis::RedisResult<Option<u64>> =
            cmd("HGET").arg(QUOTA.0).arg("calls").query(&mut con);
        counted += calls.ok().flatten().unwrap_or(0);
    }
    let mut findings = check_quota_count(record, counted);
    if held > 0 {
        findings.push(format!(
            "{held} slots still held 1 s after the last call ended"
        ));
    }
    findings
}

/// The back-off ends by itself: no call comes once the faults have ended, and the
/// limiter's prober finds the healed server answering within a probe's time (the
/// back-off, at most 2 s, at least the deadline: one out when the faults end), the next
/// back-off and a second for a loaded machine.
async fn back_off_left<C>(limiter: &Limiter<C>, ended: Instant) -> Vec<String>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    let back_off = limiter.options().back_off;
    let probed_by =
        back_off.min(Duration::from_secs(2)).max(DEADLINE) + back_off + Duration::from_secs(1);
    while limiter.backing_off() {
        if ended.elapsed() > probed_by {
            return vec![format!(
                "still backing off {probed_by:?} after the faults ended, no call"
            )];
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Vec::new()
}

/// The run's line, and its failure with the seed and the faults.
fn report(seed: u64, run: Duration, record: &Record, what: &str, findings: &[String]) {
    let faults = record.faults.lock().unwrap();
    println!(
        "seed {seed}: {} faults over {run:?} ({what}); {}",
        faults.len(),
        summary(record)
    );
    assert!(
        findings.is_empty(),
        "QAG_FAULT_SEED={seed}:\n{}\nfaults:\n{}",
        findings.join("\n"),
        faults.join("\n")
    );
}

/// A node's role: "master" or "slave".
fn role(node: &Server) -> String {
    let Ok(mut con) = node.client().get_connection() else {
        return String::new();
    };
    match cmd("ROLE").query::<Vec<Value>>(&mut con) {
        Ok(fields) => match fields.first() {
            Some(Value::BulkString(text)) => String::from_utf8_lossy(text).into_owned(),
            _ => String::new(),
        },
        Err(_) => String::new(),
    }
}

/// The cluster's schedule: a fault every 300–800 ms until `end`.
fn cluster_faults(nodes: &[Server], record: &Record, seed: u64, end: Instant) {
    let mut rng = StdRng::seed_from_u64(seed);
    let started = Instant::now();
    let keys = [BUCKET.0, WAITING.0, LEASES.0, QUOTA.0, WINDOW.0];
    while Instant::now() < end {
        std::thread::sleep(Duration::from_millis(rng.gen_range(300..800)));
        let at = started.elapsed().as_millis();
        let primaries: Vec<&Server> = nodes.iter().filter(|node| role(node) == "master").collect();
        let Some(primary) = primaries.get(rng.gen_range(0..primaries.len().max(1))) else {
            continue;
        };
        let fault = match rng.gen_range(0..4) {
            0 => {
                let key = keys[rng.gen_range(0..keys.len())];
                let slot = slot(nodes, key);
                let owner = slot_owners(nodes)[&slot];
                let others: Vec<u16> = primaries
                    .iter()
                    .map(|node| node.port)
                    .filter(|port| *port != owner)
                    .collect();
                let target = others[rng.gen_range(0..others.len())];
                // SETSLOT to the primaries only (a replica refuses it; gossip tells it).
                let ports: Vec<u16> = primaries.iter().map(|node| node.port).collect();
                migrate(ports, vec![slot], owner, target);
                format!("the slot of {key} moved from {owner} to {target}")
            }
            1 => {
                let replica = nodes.iter().find(|node| {
                    node.client().get_connection().is_ok_and(|mut con| {
                        cmd("ROLE").query::<Vec<Value>>(&mut con).is_ok_and(|fields| {
                            matches!(fields.get(2), Some(Value::Int(port)) if *port == i64::from(primary.port))
                        })
                    })
                });
                match replica {
                    Some(replica) => {
                        let mut con = replica.client().get_connection().unwrap();
                        let _: redis::RedisResult<()> =
                            cmd("CLUSTER").arg("FAILOVER").query(&mut con);
                        let until = Instant::now() + Duration::from_secs(10);
                        while role(replica) != "master" && Instant::now() < until {
                            std::thread::sleep(Duration::from_millis(50));
                        }
                        format!("{} failed over to {}", primary.port, replica.port)
                    }
                    None => format!("{} has no replica in sync", primary.port),
                }
            }
            2 => {
                let ms = rng.gen_range(100..500);
                if let Ok(mut con) = primary.client().get_connection() {
                    let _: redis::RedisResult<()> = cmd("CLIENT")
                        .arg("PAUSE")
                        .arg(ms)
                        .arg("WRITE")
                        .query(&mut con);
                }
                format!("{}'s writes paused {ms} ms", primary.port)
            }
            _ => {
                let lasting = Duration::from_millis(rng.gen_range(100..400));
                let mut stopped = Stopped::new(primary);
                std::thread::sleep(lasting);
                stopped.resume();
                format!("{} stopped (SIGSTOP) for {lasting:?}", primary.port)
            }
        };
        record
            .faults
            .lock()
            .unwrap()
            .push(format!("{at:>6} ms: {fault}"));
    }
}

/// One caller: a take, a waiting take or a lease held a while, at random, until `end`.
async fn call<C>(limiter: Limiter<C>, record: Arc<Record>, mut rng: StdRng, end: Instant)
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    let waiting = limiter.with_wait(WAIT).unwrap();
    let bucket = Bucket::with_key(BUCKET.0, BUCKET.1, BUCKET.2);
    let waited = Bucket::with_key(WAITING.0, WAITING.1, WAITING.2);
    let mut n = 0u64;
    while Instant::now() < end {
        n += 1;
        let sent = Instant::now();
        match rng.gen_range(0..5) {
            0 => {
                let answer = limiter.take(&bucket, 1).await;
                took(&record, "take", sent, DEADLINE);
                taken(&record, BUCKET.0, sent, answer);
            }
            1 => {
                let answer = waiting.take(&waited, 1).await;
                took(&record, "waiting take", sent, DEADLINE + WAIT);
                taken(&record, WAITING.0, sent, answer);
            }
            2 => {
                let answer = limiter.quota_check(QUOTA.0, &quota()).await;
                took(&record, "quota check", sent, DEADLINE);
                match answer {
                    Ok(decision) if decision.allowed => {
                        record.push(Seen::QuotaAllowed {
                            sent,
                            received: Instant::now(),
                        });
                        let sent = Instant::now();
                        let added = limiter.quota_add(QUOTA.0, &quota(), 1, 0).await;
                        took(&record, "quota add", sent, DEADLINE);
                        record.push(Seen::QuotaAdd {
                            sent,
                            counted: added.is_ok(),
                        });
                        if let Err(error) = added {
                            record.push(Seen::Failed(error));
                        }
                    }
                    Ok(_) => {}
                    Err(error) => record.push(Seen::Failed(error)),
                }
            }
            3 => {
                let scope = Scope {
                    key: WINDOW.0.to_owned(),
                    rpm: WINDOW.1,
                    tpm: 0,
                };
                let answer = limiter.admit(&[scope], Some(60)).await;
                took(&record, "admit", sent, DEADLINE);
                match answer {
                    Ok(admission) if admission.admitted => record.push(Seen::Admitted {
                        sent,
                        received: Instant::now(),
                    }),
                    Ok(_) => {}
                    Err(error) => record.push(Seen::Failed(error)),
                }
            }
            _ => {
                let id = format!("caller-{:x}-{n}", rng.gen::<u32>());
                let answer = limiter.lease(LEASES.0, LEASES.1, LEASES.2, &id).await;
                took(&record, "lease", sent, DEADLINE);
                match answer {
                    Ok(Lease::Held(guard)) => {
                        let received = Instant::now();
                        assert!(matches!(
                            guard.answered_by(),
                            AnsweredBy::Module | AnsweredBy::Script
                        ));
                        tokio::time::sleep(Duration::from_millis(rng.gen_range(0..60))).await;
                        let released = Instant::now();
                        record.push(Seen::Held {
                            sent,
                            received,
                            released,
                        });
                        if rng.gen_bool(0.5) {
                            let answer = guard.release().await;
                            took(&record, "release", released, DEADLINE);
                            if let Err(error) = answer {
                                record.push(Seen::Failed(error));
                            }
                        } else {
                            drop(guard);
                        }
                    }
                    Ok(Lease::Refused(_)) => {}
                    Err(error) => record.push(Seen::Failed(error)),
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(rng.gen_range(0..20))).await;
    }
}

/// An HTTP caller of the gateway, a request of up to 40 ms of work at a time.
async fn request(
    http: reqwest::Client,
    base: String,
    record: Arc<Record>,
    mut rng: StdRng,
    end: Instant,
) {
    while Instant::now() < end {
        let work = Duration::from_millis(rng.gen_range(0..40));
        let sent = Instant::now();
        let url = format!("{base}&work_ms={}", work.as_millis());
        let status = match http.get(url).send().await {
            Ok(response) => {
                let status = response.status().as_u16();
                let _ = response.bytes().await;
                status
            }
            Err(_) => 0,
        };
        record.push(Seen::Response {
            status,
            sent,
            received: Instant::now(),
            work,
        });
        tokio::time::sleep(Duration::from_millis(rng.gen_range(0..20))).await;
    }
}

fn quota() -> Quota {
    Quota {
        per: Per::Month,
        zone: "UTC".into(),
        calls: Some(QUOTA.1),
        rows: None,
    }
}

/// A take's answer as the callers saw it.
fn taken(
    record: &Record,
    bucket: &'static str,
    sent: Instant,
    answer: Result<qag_client::Decision, Error>,
) {
    match answer {
        Ok(decision) if decision.allowed => record.push(Seen::Allowed {
            bucket,
            sent,
            received: Instant::now(),
        }),
        Ok(_) => {}
        Err(error) => record.push(Seen::Failed(error)),
    }
}

fn took(record: &Record, what: &'static str, sent: Instant, bound: Duration) {
    record.push(Seen::Took {
        what,
        took: sent.elapsed(),
        bound,
    });
}

/// The schedule: a fault every 150–500 ms until `end`; the server as it ends.
fn faults(
    mut server: Server,
    proxy: &FaultProxy,
    record: &Record,
    seed: u64,
    end: Instant,
) -> Server {
    let mut rng = StdRng::seed_from_u64(seed);
    let started = Instant::now();
    let port = server.port;
    while Instant::now() < end {
        std::thread::sleep(Duration::from_millis(rng.gen_range(150..500)));
        let at = started.elapsed().as_millis();
        // The last seconds keep the server (no restart, stop or pause): what the
        // network's faults leave held is then still there at the end to be found.
        let kinds = if end.saturating_duration_since(Instant::now()) < TAIL {
            3
        } else {
            8
        };
        let fault = match rng.gen_range(0..kinds) {
            0 => {
                let delay = Duration::from_millis(rng.gen_range(20..400));
                let lasting = Duration::from_millis(rng.gen_range(200..800));
                proxy.delay(delay);
                std::thread::sleep(lasting);
                proxy.delay(Duration::ZERO);
                format!("replies delayed {delay:?} for {lasting:?}")
            }
            1 => {
                let replies = rng.gen_range(1..4);
                proxy.swallow(replies);
                format!("the next {replies} replies swallowed")
            }
            2 => {
                proxy.reset_all();
                "every connection reset".to_owned()
            }
            3 => {
                let lasting = Duration::from_millis(rng.gen_range(100..600));
                proxy.refuse(true);
                std::thread::sleep(lasting);
                proxy.refuse(false);
                format!("connections refused for {lasting:?}")
            }
            4 => {
                let ms = rng.gen_range(100..600);
                if let Ok(mut con) = server.client().get_connection() {
                    let _: redis::RedisResult<()> = cmd("CLIENT")
                        .arg("PAUSE")
                        .arg(ms)
                        .arg("WRITE")
                        .query(&mut con);
                }
                format!("writes paused {ms} ms")
            }
            5 => {
                let lasting = Duration::from_millis(rng.gen_range(100..700));
                let mut stopped = Stopped::new(&server);
                std::thread::sleep(lasting);
                stopped.resume();
                format!("the server stopped (SIGSTOP) for {lasting:?}")
            }
            6 => {
                let without_module = rng.gen_bool(0.3);
                let began = Instant::now();
                server.shutdown();
                server = Server::start(&ServerOptions {
                    port: Some(port),
                    without_module,
                    ..ServerOptions::default()
                });
                record
                    .restarts
                    .lock()
                    .unwrap()
                    .push((began, Instant::now()));
                format!(
                    "restarted {}",
                    if without_module {
                        "without the module"
                    } else {
                        "with the module"
                    }
                )
            }
            _ => {
                if let Ok(mut con) = server.client().get_connection() {
                    let _: redis::RedisResult<()> = cmd("SCRIPT").arg("FLUSH").query(&mut con);
                }
                "scripts flushed".to_owned()
            }
        };
        record
            .faults
            .lock()
            .unwrap()
            .push(format!("{at:>6} ms: {fault}"));
    }
    server
}

/// The promises, against what the callers saw; a line per breach.
fn check(record: &Record, ended: Instant, anchor: (Instant, u64)) -> Vec<String> {
    let seen = record.seen.lock().unwrap();
    let restarts = record.restarts.lock().unwrap();
    let first = seen
        .iter()
        .filter_map(|seen| match seen {
            Seen::Allowed { sent, .. } | Seen::Held { sent, .. } => Some(*sent),
            _ => None,
        })
        .min();
    let Some(first) = first else {
        return vec!["no call was allowed at all".to_owned()];
    };
    // The spans between restarts: a server's life each.
    let mut lives = Vec::new();
    let mut begin = first;
    for (down, up) in restarts.iter() {
        lives.push((begin, *down));
        begin = *up;
    }
    lives.push((begin, ended));
    let life_of = |sent: Instant, received: Instant| {
        lives
            .iter()
            .position(|(begin, end)| sent >= *begin && received <= *end)
    };
    let mut findings = Vec::new();
    for (n, (begin, end)) in lives.iter().enumerate() {
        let span = end.duration_since(*begin) + DEADLINE;
        for (key, size, period) in [
            (BUCKET.0, BUCKET.1, BUCKET.2),
            (WAITING.0, WAITING.1, WAITING.2),
        ] {
            let allowed = seen
                .iter()
                .filter(|seen| {
                    matches!(seen, Seen::Allowed { bucket, sent, received }
                        if *bucket == key && life_of(*sent, *received) == Some(n))
                })
                .count() as f64;
            let most = size as f64 + span.as_secs_f64() * size as f64 / period;
            if allowed > most.floor() {
                findings.push(format!(
                    "{key}: {allowed} allowed in a server's life of {span:?} (at most {most:.1})"
                ));
            }
        }
        let served = seen
            .iter()
            .filter(|seen| {
                matches!(seen, Seen::Response { status: 200, sent, received, .. }
                    if life_of(*sent, *received) == Some(n))
            })
            .count() as f64;
        let most = GATEWAY_BUCKET.0 as f64
            + span.as_secs_f64() * GATEWAY_BUCKET.0 as f64 / GATEWAY_BUCKET.1;
        if served > most.floor() {
            findings.push(format!(
                "the gateway served {served} in a server's life of {span:?} (at most {most:.1})"
            ));
        }
        let in_life = |sent: Instant, received: Instant| life_of(sent, received) == Some(n);
        let quota_allowed = seen
            .iter()
            .filter(|seen| matches!(seen, Seen::QuotaAllowed { sent, received } if in_life(*sent, *received)))
            .count() as u64;
        if quota_allowed > QUOTA.1 + CALLERS as u64 {
            findings.push(format!(
                "{quota_allowed} quota checks allowed in a server's life, for a quota of {} and {CALLERS} callers",
                QUOTA.1
            ));
        }
        let minute =
            |at: Instant| (anchor.1 + at.duration_since(anchor.0).as_millis() as u64) / 60_000;
        let windows = minute(*end + DEADLINE) - minute(*begin) + 1;
        let admitted = seen
            .iter()
            .filter(|seen| matches!(seen, Seen::Admitted { sent, received } if in_life(*sent, *received)))
            .count() as u64;
        if admitted > WINDOW.1 * windows {
            findings.push(format!(
                "{admitted} admitted by a window of {} a minute in a server's life of {windows} windows",
                WINDOW.1
            ));
        }
        // Leases held at once: the callers' spans lie inside the server's.
        let mut edges: Vec<(Instant, i64)> = seen
            .iter()
            .filter_map(|seen| match seen {
                Seen::Held {
                    sent,
                    received,
                    released,
                } if life_of(*sent, *received) == Some(n) => {
                    Some([(*received, 1), (*released, -1)])
                }
                _ => None,
            })
            .flatten()
            .collect();
        edges.sort_by_key(|(at, change)| (*at, *change));
        let mut live = 0;
        for (at, change) in edges {
            live += change;
            if live > LEASES.1 as i64 {
                findings.push(format!(
                    "{live} leases of {} held at once, {:?} into a server's life",
                    LEASES.1,
                    at.duration_since(*begin)
                ));
                break;
            }
        }
    }
    for seen in seen.iter() {
        match seen {
            Seen::Took { what, took, bound } if *took > *bound + SLACK => {
                findings.push(format!("a {what} took {took:?} (its bound {bound:?})"));
            }
            Seen::Failed(error)
                if !matches!(
                    error,
                    Error::Timeout | Error::Unavailable(_) | Error::Busy(_)
                ) =>
            {
                findings.push(format!("an error no outage explains: {error:?}"));
            }
            Seen::Response { status, .. } if ![200, 429, 503].contains(status) => {
                findings.push(format!("the gateway answered {status}"));
            }
            Seen::Response {
                sent,
                received,
                work,
                ..
            } if received.duration_since(*sent) > GATEWAY_DEADLINE + *work + SLACK => {
                findings.push(format!(
                    "a request of {work:?} of work took {:?}",
                    received.duration_since(*sent)
                ));
            }
            _ => {}
        }
    }
    findings
}

/// The quota's count at the end, against the adds of the last server's life: none
/// counted twice (an add resent after a dropped connection carries its id), none that
/// was answered lost.
fn check_quota_count(record: &Record, counted: u64) -> Vec<String> {
    let seen = record.seen.lock().unwrap();
    let since = record.restarts.lock().unwrap().last().map(|(_, up)| *up);
    let (mut sent, mut answered) = (0, 0);
    for seen in seen.iter() {
        if let Seen::QuotaAdd { sent: at, counted } = seen {
            if since.is_none_or(|up| *at >= up) {
                sent += 1;
                answered += u64::from(*counted);
            }
        }
    }
    let mut findings = Vec::new();
    if counted > sent {
        findings.push(format!("the quota counted {counted} of {sent} adds sent"));
    }
    if counted < answered {
        findings.push(format!(
            "the quota counted {counted} of {answered} adds answered"
        ));
    }
    findings
}

/// The calls by what they met.
fn summary(record: &Record) -> String {
    let seen = record.seen.lock().unwrap();
    let (mut calls, mut allowed, mut held, mut failed) = (0, 0, 0, 0);
    let (mut quota_allowed, mut admitted) = (0, 0);
    let mut statuses = std::collections::BTreeMap::<u16, usize>::new();
    let mut slowest = Duration::ZERO;
    for seen in seen.iter() {
        match seen {
            Seen::Allowed { .. } => allowed += 1,
            Seen::Held { .. } => held += 1,
            Seen::Failed(_) => failed += 1,
            Seen::Took { took, .. } => {
                calls += 1;
                slowest = slowest.max(*took);
            }
            Seen::Response { status, .. } => *statuses.entry(*status).or_default() += 1,
            Seen::QuotaAllowed { .. } => quota_allowed += 1,
            Seen::Admitted { .. } => admitted += 1,
            Seen::QuotaAdd { .. } => {}
        }
    }
    format!(
        "{calls} calls: {allowed} takes allowed, {held} leases held, {quota_allowed} quota checks allowed, {admitted} admitted, {failed} failures, {} restarts, slowest call {slowest:?}; the gateway's answers {statuses:?}",
        record.restarts.lock().unwrap().len()
    )
}
