//! What an operator relies on beyond single calls: the module unloads and loads again,
//! memory comes back once every key has expired, a long mixed load runs without an
//! error, and memcheck finds no leak in the module.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use common::*;
use rand::{Rng, SeedableRng};

/// These tests load the machine; one at a time, so that none times another's work.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn alone() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[test]
fn the_module_unloads_and_loads_again() {
    let _alone = alone();
    if external("unload") {
        return;
    }
    let server = Server::start(&ServerOptions {
        extra: ["--enable-module-command", "yes"]
            .map(String::from)
            .to_vec(),
        ..Default::default()
    });
    let mut con = server.client().get_connection().unwrap();
    for round in 0..3 {
        mixed_round(&mut con, round, 3600);
    }
    let before = dataset(&mut con);
    let _: () = cmd("MODULE")
        .arg("UNLOAD")
        .arg("qag")
        .query(&mut con)
        .unwrap();
    let err = cmd("QAG.TAKE")
        .arg("k")
        .arg(1)
        .arg(1)
        .query::<Value>(&mut con)
        .unwrap_err();
    assert!(
        err.to_string().to_lowercase().contains("unknown command"),
        "{err}"
    );
    assert_eq!(dataset(&mut con), before, "the data outlives the module");
    let path = module_path().display().to_string();
    let _: () = cmd("MODULE")
        .arg("LOAD")
        .arg(&path)
        .query(&mut con)
        .unwrap();
    for round in 3..6 {
        mixed_round(&mut con, round, 3600);
    }
    let leases: i64 = cmd("QAG.LEASES")
        .arg("qag:running:{t}")
        .query(&mut con)
        .unwrap();
    assert_eq!(
        leases, 2,
        "the reloaded module reads what the first one wrote"
    );
}

/// 100,000 keys of each kind that expires on its own (buckets, leases, windows), then
/// the wait for every one to expire: used memory comes back to where it started.
/// Quota keys live a day past their period, so for them every key's expiry is checked.
#[test]
fn memory_comes_back_when_every_key_has_expired() {
    let _alone = alone();
    if external("memory") {
        return;
    }
    let server = Server::start(&ServerOptions::default());
    let mut con = server.client().get_connection().unwrap();
    let used = |con: &mut Connection| -> i64 {
        let info: String = cmd("INFO").arg("memory").query(con).unwrap();
        info.lines()
            .find_map(|l| l.strip_prefix("used_memory:"))
            .and_then(|v| v.trim().parse().ok())
            .expect("used_memory")
    };
    // Warm the server's own structures (the first connections, script cache, ...).
    let _: Value = cmd("QAG.TAKE")
        .arg("warm")
        .arg(1)
        .arg(1)
        .query(&mut con)
        .unwrap();
    std::thread::sleep(Duration::from_millis(2100));
    let start = used(&mut con);
    const KEYS: u64 = 100_000;
    for chunk in 0..(KEYS / 1000) {
        let mut pipe = redis::pipe();
        for i in chunk * 1000..(chunk + 1) * 1000 {
            pipe.cmd("QAG.TAKE")
                .arg(format!("soak:bucket:{i}"))
                .arg(10)
                .arg(1);
            pipe.cmd("QAG.LEASE")
                .arg(format!("soak:running:{i}"))
                .arg(3)
                .arg(1000)
                .arg(format!("q{i}"));
            pipe.cmd("QAG.ADMIT")
                .arg(1)
                .arg(format!("soak:win:{i}"))
                .arg(100)
                .arg(0)
                .arg("WINDOW")
                .arg(1);
            pipe.cmd("QAG.QUOTA.ADD")
                .arg(format!("soak:quota:{i}"))
                .arg(&["PER", "day", "TZ", "UTC", "CALLS", "1"]);
        }
        let _: Vec<Value> = pipe.query(&mut con).unwrap();
    }
    // Lifetimes of about 15 s: most keys still live when the fill ends (the quota
    // keys all do).
    let size: i64 = cmd("DBSIZE").query(&mut con).unwrap();
    assert!(size > KEYS as i64, "{size} keys");
    let peak = used(&mut con);
    // Every quota key has an expiry: none lives for ever.
    let mut cursor = 0u64;
    loop {
        let (next, keys): (u64, Vec<String>) = cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg("soak:quota:*")
            .arg("COUNT")
            .arg(5000)
            .query(&mut con)
            .unwrap();
        for key in keys {
            let ttl: i64 = cmd("PTTL").arg(&key).query(&mut con).unwrap();
            assert!(ttl > 86_400_000, "{key}: {ttl}");
        }
        if next == 0 {
            break;
        }
        cursor = next;
    }
    let _: i64 = cmd("DEL").arg("warm").query(&mut con).unwrap();
    let mut unlink = redis::pipe();
    for i in 0..KEYS {
        unlink.cmd("UNLINK").arg(format!("soak:quota:{i}")).ignore();
    }
    let _: () = unlink.query(&mut con).unwrap();
    // The rest expires on its own within 16 seconds; active expiry then reclaims it.
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let size: i64 = cmd("DBSIZE").query(&mut con).unwrap();
        if size == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "{size} keys never expired");
        std::thread::sleep(Duration::from_millis(250));
    }
    // Keys that expire at one instant (bucket steps and window ends are aligned) leave
    // the server's tables to shrink in its next cron runs: give it a few seconds.
    let settle = Instant::now() + Duration::from_secs(10);
    let mut end = used(&mut con);
    while end >= start + 1_000_000 && Instant::now() < settle {
        std::thread::sleep(Duration::from_millis(200));
        end = used(&mut con);
    }
    eprintln!("used_memory: {start} at the start, {peak} with {size} keys, {end} after expiry");
    assert!(
        peak > start + 20_000_000,
        "the keys took memory: {start} -> {peak}"
    );
    assert!(
        end < start + 1_000_000,
        "memory came back: {start} -> {peak} -> {end}"
    );
}

/// 50 connections pipelining mixed commands for QAG_LOAD_SECONDS (default 30): every
/// call is answered without error, none is refused (the limits are far above the load),
/// and the latency percentiles of a pipeline's round trip are reported.
#[test]
fn mixed_load_runs_without_errors() {
    let _alone = alone();
    if external("load") {
        return;
    }
    let seconds: u64 = std::env::var("QAG_LOAD_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(30);
    let server = Server::start(&ServerOptions::default());
    let client = server.client();
    let stop = AtomicBool::new(false);
    let (mut latencies, calls): (Vec<Duration>, u64) = std::thread::scope(|s| {
        let workers: Vec<_> = (0..50u64)
            .map(|w| {
                let (client, stop) = (client.clone(), &stop);
                s.spawn(move || {
                    let mut con = client.get_connection().unwrap();
                    let mut rng = rand::rngs::StdRng::seed_from_u64(w);
                    let (mut latencies, mut calls) = (vec![], 0u64);
                    while !stop.load(Ordering::Relaxed) {
                        let mut pipe = redis::pipe();
                        let mut kinds = [0; 16];
                        for kind in kinds.iter_mut() {
                            let k = rng.gen_range(0..10_000);
                            *kind = rng.gen_range(0..6);
                            match *kind {
                                0 => pipe
                                    .cmd("QAG.TAKE")
                                    .arg(format!("load:b:{k}"))
                                    .arg(1_000_000_000)
                                    .arg(1),
                                1 => pipe
                                    .cmd("QAG.TAKE2")
                                    .arg(format!("load:{{{k}}}:c"))
                                    .arg(1_000_000_000)
                                    .arg(1)
                                    .arg(format!("load:{{{k}}}:k"))
                                    .arg(1_000_000_000)
                                    .arg(1),
                                2 => pipe
                                    .cmd("QAG.LEASE")
                                    .arg(format!("load:r:{k}"))
                                    .arg(1_000_000)
                                    .arg(60_000)
                                    .arg(format!("w{w}")),
                                3 => pipe
                                    .cmd("QAG.RELEASE")
                                    .arg(format!("load:r:{k}"))
                                    .arg(format!("w{w}")),
                                4 => pipe.cmd("QAG.QUOTA.ADD").arg(format!("load:q:{k}")).arg(&[
                                    "PER",
                                    "month",
                                    "TZ",
                                    "Europe/Berlin",
                                    "CALLS",
                                    "1",
                                    "ROWS",
                                    "7",
                                ]),
                                _ => pipe
                                    .cmd("QAG.ADMIT")
                                    .arg(2)
                                    .arg(format!("load:{{{k}}}:org"))
                                    .arg(1_000_000_000)
                                    .arg(0)
                                    .arg(format!("load:{{{k}}}:key"))
                                    .arg(1_000_000_000)
                                    .arg(0),
                            };
                        }
                        let started = Instant::now();
                        let replies: Vec<Value> =
                            pipe.query(&mut con).expect("every call answered");
                        latencies.push(started.elapsed());
                        for (kind, reply) in kinds.iter().zip(replies) {
                            match (kind, reply) {
                                // TAKE2: both buckets allowed.
                                (1, Value::Array(pair)) => {
                                    for bucket in pair {
                                        let Value::Array(v) = bucket else {
                                            panic!("{bucket:?}")
                                        };
                                        assert_eq!(v[0], Value::Int(1));
                                    }
                                }
                                // RELEASE: 1 or 0, whether this worker held the slot.
                                (3, Value::Int(released)) => {
                                    assert!(released == 0 || released == 1)
                                }
                                // QUOTA.ADD: [calls used, rows used, resets at].
                                (4, Value::Array(v)) => {
                                    assert!(matches!(v[0], Value::Int(n) if n >= 1), "{v:?}")
                                }
                                // TAKE, LEASE, ADMIT: allowed.
                                (_, Value::Array(v)) => assert_eq!(v[0], Value::Int(1), "{v:?}"),
                                (_, other) => panic!("unexpected reply {other:?}"),
                            }
                        }
                        calls += 16;
                    }
                    (latencies, calls)
                })
            })
            .collect();
        std::thread::sleep(Duration::from_secs(seconds));
        stop.store(true, Ordering::Relaxed);
        workers.into_iter().map(|w| w.join().unwrap()).fold(
            (vec![], 0),
            |(mut all, total), (l, c)| {
                all.extend(l);
                (all, total + c)
            },
        )
    });
    latencies.sort();
    let at = |q: f64| latencies[((latencies.len() as f64 * q) as usize).min(latencies.len() - 1)];
    eprintln!(
        "mixed load: {calls} calls in {seconds} s ({:.0}/s); pipeline of 16 round trip p50 {:?}, p99 {:?}, p99.9 {:?}, max {:?}",
        calls as f64 / seconds as f64,
        at(0.5),
        at(0.99),
        at(0.999),
        latencies[latencies.len() - 1]
    );
    let mut con = client.get_connection().unwrap();
    // The server's own count: no qag call failed or was rejected. (Errorstats would
    // also count the client library's CLIENT SETINFO, unknown to Redis 7.0.)
    let stats: String = cmd("INFO").arg("commandstats").query(&mut con).unwrap();
    let ours: Vec<&str> = stats
        .lines()
        .filter(|l| l.starts_with("cmdstat_qag."))
        .collect();
    assert_eq!(ours.len(), 6, "{stats}");
    for line in ours {
        assert!(line.contains("rejected_calls=0,failed_calls=0"), "{line}");
    }
    assert!(calls > 0);
}

/// The server under valgrind's memcheck, a mixed workload with bad calls among good
/// ones, a clean shutdown: no leak and no invalid access in the module's frames (where
/// memcheck sees the server's allocations: `memcheck_sees_the_servers_allocations`).
#[test]
fn memcheck_finds_nothing_in_the_module() {
    let _alone = alone();
    if external("valgrind") {
        return;
    }
    if !memcheck_sees_the_servers_allocations() {
        return;
    }
    let log = std::env::temp_dir().join(format!("qag-memcheck-{}.log", std::process::id()));
    let server = Server::start(&ServerOptions {
        wrapper: memcheck(&log),
        module_args: vec!["TEST-COMMANDS".into()],
        ..Default::default()
    });
    let mut con = server.client().get_connection().unwrap();
    for round in 0..40 {
        mixed_round(&mut con, round, 1);
        let _: Value = cmd("QAG.PEEK")
            .arg("qag:rl:{t}:0")
            .arg(3)
            .arg(1)
            .query(&mut con)
            .unwrap();
        let _: Value = cmd("QAG.QUOTA")
            .arg("qag:quota:{t}")
            .arg(&["PER", "month", "TZ", "Asia/Tokyo", "CALLS", "5"])
            .query(&mut con)
            .unwrap();
        let _: Value = cmd("QAG.LEASES")
            .arg("qag:running:{t}")
            .query(&mut con)
            .unwrap();
        // Bad calls and a panic, which must free what they allocated too.
        for bad in [
            cmd("QAG.TAKE").arg("qag:rl:{t}:0").arg(0).arg(1).clone(),
            cmd("QAG.QUOTA")
                .arg("q")
                .arg(&["PER", "day", "TZ", "Nowhere", "CALLS", "1"])
                .clone(),
            cmd("QAG.ADMIT")
                .arg(2)
                .arg(&["a", "1", "1", "a", "1", "1"])
                .clone(),
            cmd("QAG.TEST.PANIC").arg("x").clone(),
        ] {
            assert!(bad.query::<Value>(&mut con).is_err());
        }
        if round % 10 == 9 {
            std::thread::sleep(Duration::from_millis(1100));
        }
    }
    drop(con);
    server.shutdown();
    let in_module = memcheck_findings(&log, false);
    assert!(
        in_module.is_empty(),
        "memcheck found problems in the module:\n{in_module:#?}"
    );
}
