//! The load benchmark: what each qag command costs Redis's one thread, beside INCR (the
//! floor) and the token-bucket script (what gateways run today), on one hot key and on
//! 100,000 keys. It starts its own server with the module on loopback and stops it.
//!
//! Run with `scripts/bench.sh` (or `cargo bench --bench load` after a release build).
//! Environment: REDIS_SERVER (the server binary), QAG_BENCH_RUNS (runs per row, the
//! median is reported; default 3), QAG_BENCH_CELL_MODULE (a redis-cell module to load
//! for a CL.THROTTLE row), QAG_BENCH_OUT (where the markdown table goes; default
//! target/bench/load.md), QAG_BENCH_ONLY (comma-separated row names, e.g.
//! `INCR,QAG.TAKE`: only those rows, for a before-and-after comparison).

#[path = "../tests/common/mod.rs"]
mod common;

use std::time::{Duration, Instant};

use common::{cmd, load_script, Connection, Server, ServerOptions};
use rand::{Rng, SeedableRng};

/// One row: a name, the commands whose server time one call costs, and how to make call
/// number `i` on key number `k`.
struct Case {
    name: &'static str,
    commands: &'static [&'static str],
    make: fn(k: u64, i: u64, sha: &str) -> Vec<redis::Cmd>,
    /// Every call on a key of its own, created by the call (named by `i`): one row,
    /// no warm-up.
    fresh: bool,
}

fn one(c: &mut redis::Cmd) -> Vec<redis::Cmd> {
    vec![c.clone()]
}

fn cases(with_cell: bool) -> Vec<Case> {
    let mut cases = vec![
        Case {
            name: "INCR",
            fresh: false,
            commands: &["incr"],
            make: |k, _, _| one(cmd("INCR").arg(format!("bench:incr:{k}"))),
        },
        Case {
            name: "EVALSHA token_bucket.lua",
            fresh: false,
            commands: &["evalsha"],
            make: |k, _, sha| {
                one(cmd("EVALSHA")
                    .arg(sha)
                    .arg(1)
                    .arg(format!("bench:script:{k}"))
                    .arg(60)
                    .arg(60))
            },
        },
        Case {
            name: "QAG.TAKE",
            fresh: false,
            commands: &["qag.take"],
            make: |k, _, _| {
                one(cmd("QAG.TAKE")
                    .arg(format!("bench:take:{k}"))
                    .arg(60)
                    .arg(60))
            },
        },
        Case {
            name: "QAG.TAKE2",
            fresh: false,
            commands: &["qag.take2"],
            make: |k, _, _| {
                one(cmd("QAG.TAKE2")
                    .arg(format!("bench:{{{k}}}:ip"))
                    .arg(600)
                    .arg(60)
                    .arg(format!("bench:{{{k}}}:key"))
                    .arg(60)
                    .arg(60))
            },
        },
        Case {
            name: "QAG.TAKE × 2",
            fresh: false,
            commands: &["qag.take"],
            make: |k, _, _| {
                vec![
                    cmd("QAG.TAKE")
                        .arg(format!("bench:take2a:{k}"))
                        .arg(600)
                        .arg(60)
                        .clone(),
                    cmd("QAG.TAKE")
                        .arg(format!("bench:take2b:{k}"))
                        .arg(60)
                        .arg(60)
                        .clone(),
                ]
            },
        },
        Case {
            name: "EVALSHA × 2",
            fresh: false,
            commands: &["evalsha"],
            make: |k, _, sha| {
                vec![
                    cmd("EVALSHA")
                        .arg(sha)
                        .arg(1)
                        .arg(format!("bench:s2a:{k}"))
                        .arg(600)
                        .arg(60)
                        .clone(),
                    cmd("EVALSHA")
                        .arg(sha)
                        .arg(1)
                        .arg(format!("bench:s2b:{k}"))
                        .arg(60)
                        .arg(60)
                        .clone(),
                ]
            },
        },
        Case {
            name: "QAG.LEASE + QAG.RELEASE",
            fresh: false,
            commands: &["qag.lease", "qag.release"],
            make: |k, i, _| {
                let (key, id) = (format!("bench:running:{k}"), format!("req{i}"));
                vec![
                    cmd("QAG.LEASE")
                        .arg(&key)
                        .arg(1_000_000)
                        .arg(30_000)
                        .arg(&id)
                        .clone(),
                    cmd("QAG.RELEASE").arg(&key).arg(&id).clone(),
                ]
            },
        },
        Case {
            name: "QAG.QUOTA + QAG.QUOTA.ADD",
            fresh: false,
            commands: &["qag.quota", "qag.quota.add"],
            make: |k, _, _| {
                let key = format!("bench:quota:{k}");
                let zone = ["PER", "month", "TZ", "Europe/Berlin"];
                vec![
                    cmd("QAG.QUOTA")
                        .arg(&key)
                        .arg(&zone)
                        .arg("CALLS")
                        .arg(i64::MAX)
                        .clone(),
                    cmd("QAG.QUOTA.ADD")
                        .arg(&key)
                        .arg(&zone)
                        .arg("CALLS")
                        .arg(1)
                        .arg("ROWS")
                        .arg(25)
                        .clone(),
                ]
            },
        },
        Case {
            name: "QAG.ADMIT (3 scopes) + QAG.RECORD",
            fresh: false,
            commands: &["qag.admit", "qag.record"],
            make: |k, _, _| {
                let scopes = [
                    format!("bench:{{{k}}}:org"),
                    format!("bench:{{{k}}}:team"),
                    format!("bench:{{{k}}}:key"),
                ];
                let limit = i64::MAX / 4;
                let mut admit = cmd("QAG.ADMIT");
                admit.arg(3);
                for scope in &scopes {
                    admit.arg(scope).arg(limit).arg(limit);
                }
                vec![
                    admit.clone(),
                    cmd("QAG.RECORD").arg(3).arg(&scopes).arg(120).clone(),
                ]
            },
        },
    ];
    // GCRA: 61 at once, then one a minute, so a key called once outlives the run. Key
    // names as long as redis-cell's rows', so that bytes per key compare.
    cases.push(Case {
        name: "QAG.THROTTLE",
        fresh: false,
        commands: &["qag.throttle"],
        make: |k, _, _| one(&mut throttle("QAG.THROTTLE", format!("bench:qagt:{k}"))),
    });
    cases.push(Case {
        name: "QAG.THROTTLE new keys",
        fresh: true,
        commands: &["qag.throttle"],
        make: |_, i, _| one(&mut throttle("QAG.THROTTLE", format!("bench:qagt:new:{i}"))),
    });
    if with_cell {
        cases.push(Case {
            name: "CL.THROTTLE (redis-cell)",
            fresh: false,
            commands: &["cl.throttle"],
            make: |k, _, _| one(&mut throttle("CL.THROTTLE", format!("bench:cell:{k}"))),
        });
        cases.push(Case {
            name: "CL.THROTTLE (redis-cell) new keys",
            fresh: true,
            commands: &["cl.throttle"],
            make: |_, i, _| one(&mut throttle("CL.THROTTLE", format!("bench:cell:new:{i}"))),
        });
    }
    cases
}

/// `command key 60 60 3600 1`: a burst of 61, refilled at 60 an hour.
fn throttle(command: &str, key: String) -> redis::Cmd {
    cmd(command)
        .arg(key)
        .arg(60)
        .arg(60)
        .arg(3600)
        .arg(1)
        .clone()
}

const CONNECTIONS: usize = 50;
const PIPELINE: usize = 16;
const CALLS_PIPELINED: u64 = 160_000;
const CALLS_UNPIPELINED: u64 = 20_000;
const CALLS_ONE_CALLER: u64 = 3_000;
const MANY_KEYS: u64 = 100_000;

/// Runs `calls` calls over `CONNECTIONS` connections, `depth` calls to a round trip;
/// returns calls per second. One client thread drives every connection in turn (send
/// a batch on each, then read each), as redis-benchmark does: on a two-core machine a
/// thread per connection would compete with the server for the cores and inflate the
/// server time it measures.
fn throughput(
    client: &redis::Client,
    case: &Case,
    sha: &str,
    keys: u64,
    calls: u64,
    depth: usize,
) -> f64 {
    let mut connections: Vec<Connection> = (0..CONNECTIONS)
        .map(|_| client.get_connection().expect("connect"))
        .collect();
    let mut rng = rand::rngs::StdRng::seed_from_u64(keys);
    let batches = calls.div_ceil((CONNECTIONS * depth) as u64);
    let mut sent = 0u64;
    let started = Instant::now();
    for _ in 0..batches {
        let mut pending = Vec::with_capacity(CONNECTIONS);
        for con in connections.iter_mut() {
            let mut pipe = redis::pipe();
            let mut commands = 0;
            for _ in 0..depth {
                let k = if keys == 1 { 0 } else { rng.gen_range(0..keys) };
                for command in (case.make)(k, sent, sha) {
                    pipe.add_command(command);
                    commands += 1;
                }
                sent += 1;
            }
            con.send_packed_command(&pipe.get_packed_pipeline())
                .expect("send");
            pending.push(commands);
        }
        for (con, commands) in connections.iter_mut().zip(pending) {
            for _ in 0..commands {
                let reply = con.recv_response().expect("benchmark reply");
                assert!(!matches!(reply, redis::Value::ServerError(_)), "{reply:?}");
            }
        }
    }
    sent as f64 / started.elapsed().as_secs_f64()
}

/// Calls once on every key, so that the rows on many keys measure calls on keys that
/// exist (a limiter's steady state), not the creation of new ones.
fn warm_up(con: &mut Connection, case: &Case, sha: &str, keys: u64) {
    const BATCH: u64 = 1_000;
    for first in (0..keys).step_by(BATCH as usize) {
        let mut pipe = redis::pipe();
        for k in first..(first + BATCH).min(keys) {
            for command in (case.make)(k, k, sha) {
                pipe.add_command(command).ignore();
            }
        }
        let _: () = pipe.query(con).expect("warm-up");
    }
}

/// The median latency of one caller's call, each command its own round trip.
fn one_caller_p50(con: &mut Connection, case: &Case, sha: &str, keys: u64) -> Duration {
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let mut latencies: Vec<Duration> = (0..CALLS_ONE_CALLER)
        .map(|i| {
            let k = if keys == 1 { 0 } else { rng.gen_range(0..keys) };
            let started = Instant::now();
            for command in (case.make)(k, 1_000_000_000 + i, sha) {
                let _: redis::Value = command.query(con).expect("benchmark call");
            }
            started.elapsed()
        })
        .collect();
    latencies.sort();
    latencies[latencies.len() / 2]
}

/// Server CPU per call of `case`, from INFO commandstats since the last CONFIG RESETSTAT:
/// the time of its commands over the calls of its first command.
fn server_micros_per_call(con: &mut Connection, case: &Case) -> f64 {
    let stats: String = cmd("INFO").arg("commandstats").query(con).expect("INFO");
    let field = |name: &str, key: &str| -> f64 {
        stats
            .lines()
            .find(|l| l.starts_with(&format!("cmdstat_{name}:")))
            .and_then(|line| line.split_once(':'))
            .and_then(|(_, fields)| fields.split(',').find_map(|f| f.strip_prefix(key)))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0)
    };
    let micros: f64 = case.commands.iter().map(|name| field(name, "usec=")).sum();
    // A pair of two calls of one command (TAKE × 2) makes two of its calls per call.
    let per_call = (case.make)(0, 0, "").len() as f64 / case.commands.len() as f64;
    micros / (field(case.commands[0], "calls=") / per_call)
}

/// Pins this process to `cpu`; false where that is not possible (one core, no taskset).
fn pin_to_cpu(cpu: usize) -> bool {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let taskset = std::process::Command::new("taskset")
        .arg("--version")
        .output()
        .is_ok();
    if cores <= cpu || !taskset {
        return false;
    }
    // SAFETY: a zeroed cpu_set_t with one bit set, for this process (pid 0).
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0
    }
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

struct Row {
    name: &'static str,
    fresh: bool,
    keys: u64,
    micros: f64,
    per_second_p1: f64,
    per_second_p16: f64,
    p50: Duration,
    bytes_per_key: Option<i64>,
}

fn measure(server: &Server, case: &Case, sha: &str, keys: u64, runs: usize) -> Row {
    let client = server.client();
    let mut con = client.get_connection().expect("connect");
    let (mut micros, mut p1, mut p16, mut p50) = (vec![], vec![], vec![], vec![]);
    for _ in 0..runs {
        let _: () = cmd("FLUSHALL").query(&mut con).expect("FLUSHALL");
        if !case.fresh {
            warm_up(&mut con, case, sha, keys);
        }
        let _: () = cmd("CONFIG")
            .arg("RESETSTAT")
            .query(&mut con)
            .expect("RESETSTAT");
        p16.push(throughput(
            &client,
            case,
            sha,
            keys,
            CALLS_PIPELINED,
            PIPELINE,
        ));
        micros.push(server_micros_per_call(&mut con, case));
        p1.push(throughput(&client, case, sha, keys, CALLS_UNPIPELINED, 1));
        p50.push(one_caller_p50(&mut con, case, sha, keys).as_secs_f64());
    }
    // A typical key: the one the calls on key 0 wrote (for pairs, the first command's).
    let first = (case.make)(0, 0, sha).remove(0);
    let key = first.args_iter().nth(if case.name.starts_with("EVALSHA") {
        3
    } else if case.name.starts_with("QAG.ADMIT") {
        2
    } else {
        1
    });
    let bytes_per_key = key.and_then(|arg| match arg {
        redis::Arg::Simple(bytes) => cmd("MEMORY")
            .arg("USAGE")
            .arg(bytes)
            .query::<Option<i64>>(&mut con)
            .ok()
            .flatten(),
        _ => None,
    });
    Row {
        name: case.name,
        fresh: case.fresh,
        keys,
        micros: median(micros),
        per_second_p1: median(p1),
        per_second_p16: median(p16),
        p50: Duration::from_secs_f64(median(p50)),
        bytes_per_key,
    }
}

fn main() {
    // `cargo bench` passes --bench; a filter argument is not supported.
    let runs: usize = std::env::var("QAG_BENCH_RUNS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(3)
        .max(1);
    let cell = std::env::var("QAG_BENCH_CELL_MODULE").ok();
    // The server on the first core, this client on the second: otherwise they take
    // turns on both, and the server's time per call counts the client's turns too.
    let pinned = pin_to_cpu(1);
    let mut options = ServerOptions {
        wrapper: match pinned {
            true => vec!["taskset".into(), "-c".into(), "0".into()],
            false => vec![],
        },
        ..Default::default()
    };
    if let Some(cell) = &cell {
        options
            .extra
            .extend(["--loadmodule".to_string(), cell.clone()]);
    }
    let server = Server::start(&options);
    let mut con = server.client().get_connection().expect("connect");
    let sha = load_script(&mut con);
    let version: String = cmd("INFO").arg("server").query(&mut con).expect("INFO");
    let version = version
        .lines()
        .find(|l| l.starts_with("redis_version:") || l.starts_with("valkey_version:"))
        .unwrap_or("")
        .to_string();
    eprintln!("load benchmark on {version}, {runs} run(s) a row, server and client on separate cores: {pinned}");

    let only = std::env::var("QAG_BENCH_ONLY").ok();
    let selected = |case: &Case| {
        only.as_ref()
            .is_none_or(|names| names.split(',').any(|n| n == case.name))
    };
    let mut rows = vec![];
    for case in cases(cell.is_some()).into_iter().filter(selected) {
        let key_counts: &[u64] = match case.fresh {
            true => &[MANY_KEYS],
            false => &[1, MANY_KEYS],
        };
        for &keys in key_counts {
            let row = measure(&server, &case, &sha, keys, runs);
            eprintln!(
                "{:<36} {:>6} keys: {:.2} µs/call",
                row.name, row.keys, row.micros
            );
            rows.push(row);
        }
    }

    let incr = |keys: u64| {
        rows.iter()
            .find(|r| r.name == "INCR" && r.keys == keys)
            .map_or(1.0, |r| r.micros)
    };
    let mut table = String::new();
    table.push_str(&format!(
        "Measured on {} with {CONNECTIONS} connections; median of {runs} run(s); every key called once before each run; server CPU from INFO commandstats; server and client {}.\n\n",
        version.replace(':', " "),
        if pinned { "pinned to separate cores" } else { "sharing the cores" }
    ));
    table.push_str("| command (one call) | keys | server µs/call | × INCR | calls/s, pipeline 1 | calls/s, pipeline 16 | p50 µs, one caller | bytes/key |\n");
    table.push_str("|---|---:|---:|---:|---:|---:|---:|---:|\n");
    for r in &rows {
        table.push_str(&format!(
            "| {} | {} | {:.2} | {:.1} | {:.0} | {:.0} | {:.0} | {} |\n",
            r.name,
            if r.fresh {
                "new each call".to_string()
            } else if r.keys == 1 {
                "1 (hot)".to_string()
            } else {
                r.keys.to_string()
            },
            r.micros,
            r.micros / incr(r.keys),
            r.per_second_p1,
            r.per_second_p16,
            r.p50.as_secs_f64() * 1e6,
            r.bytes_per_key.map_or("–".to_string(), |b| b.to_string()),
        ));
    }
    let find = |name: &str| rows.iter().find(|r| r.name == name && r.keys == MANY_KEYS);
    if let (Some(take), Some(script), Some(take2), Some(script2)) = (
        find("QAG.TAKE"),
        find("EVALSHA token_bucket.lua"),
        find("QAG.TAKE2"),
        find("EVALSHA × 2"),
    ) {
        table.push_str(&format!(
            "\nTargets (100,000 keys): script / TAKE server CPU = {:.1}× (≥ 3.5×); TAKE2 / TAKE = {:.2}× (≤ 1.8×); \
             TAKE2 p50 / two EVALSHA p50 = {:.2}× (≤ 0.6×); TAKE / script calls/s at pipeline 16 = {:.1}× (≥ 2.5×); \
             bytes per bucket: TAKE {} vs script {}.\n",
            script.micros / take.micros,
            take2.micros / take.micros,
            take2.p50.as_secs_f64() / script2.p50.as_secs_f64(),
            take.per_second_p16 / script.per_second_p16,
            take.bytes_per_key.unwrap_or(-1),
            script.bytes_per_key.unwrap_or(-1),
        ));
        if let Some(cell) = find("CL.THROTTLE (redis-cell)") {
            table.push_str(&format!(
                "TAKE / CL.THROTTLE server CPU = {:.2}× (≤ 0.8×).\n",
                take.micros / cell.micros
            ));
        }
    }
    let pair = |qag: &str, cell: &str| Some((find(qag)?, find(cell)?));
    if let (Some((existing, cell)), Some((new, cell_new))) = (
        pair("QAG.THROTTLE", "CL.THROTTLE (redis-cell)"),
        pair("QAG.THROTTLE new keys", "CL.THROTTLE (redis-cell) new keys"),
    ) {
        table.push_str(&format!(
            "QAG.THROTTLE / CL.THROTTLE server CPU: {:.2}× on existing keys, {:.2}× creating them (≤ 0.8× both); bytes per key {} vs {}.\n",
            existing.micros / cell.micros,
            new.micros / cell_new.micros,
            existing.bytes_per_key.unwrap_or(0),
            cell.bytes_per_key.unwrap_or(0),
        ));
    }
    println!("{table}");
    let out = std::env::var("QAG_BENCH_OUT")
        .unwrap_or_else(|_| format!("{}/target/bench/load.md", env!("CARGO_MANIFEST_DIR")));
    if let Some(dir) = std::path::Path::new(&out).parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    std::fs::write(&out, &table).expect("write the table");
    eprintln!("written to {out}");
}
