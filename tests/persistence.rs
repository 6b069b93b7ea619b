//! Persistence and failover: what every command wrote survives an AOF replay, an AOF
//! rewrite, an RDB save and a replica's promotion, key for key, field for field, with the
//! same absolute expiry.

mod common;

use std::time::{Duration, Instant};

use common::*;

fn data_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("qag-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn wait_for(con: &mut Connection, section: &str, done: &dyn Fn(&str) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let info: String = cmd("INFO").arg(section).query(con).unwrap();
        if done(&info) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting on INFO {section}:\n{info}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn fill(con: &mut Connection) -> Vec<KeyState> {
    for round in 0..12 {
        mixed_round(con, round, 3600);
    }
    let data = dataset(con);
    assert_eq!(data.len(), 12, "{data:?}");
    // Each reservation closed by its commit but the last, whatever other chains used
    // its id for: one hold is open, not twelve.
    let holding = held(con, "qag:win:{t}:model");
    assert!((1..=500).contains(&holding), "{holding} tokens held");
    data
}

#[test]
fn aof_replay_and_rewrite_keep_every_key() {
    if external("persistence") {
        return;
    }
    let dir = data_dir("aof");
    let options = ServerOptions {
        dir: Some(dir.clone()),
        extra: ["--appendonly", "yes", "--appendfsync", "always"]
            .map(String::from)
            .to_vec(),
        ..Default::default()
    };
    let server = Server::start(&options);
    let written = fill(&mut server.client().get_connection().unwrap());
    server.shutdown();

    // The log of effects replays into the same data.
    let server = Server::start(&options);
    let mut con = server.client().get_connection().unwrap();
    assert_eq!(dataset(&mut con), written, "after replaying the AOF");
    let _: Value = cmd("BGREWRITEAOF").query(&mut con).unwrap();
    wait_for(&mut con, "persistence", &|i| {
        i.contains("aof_rewrite_in_progress:0") && i.contains("aof_rewrite_scheduled:0")
    });
    server.shutdown();

    // A rewritten AOF holds the same.
    let server = Server::start(&options);
    let mut con = server.client().get_connection().unwrap();
    assert_eq!(dataset(&mut con), written, "after BGREWRITEAOF");
    // And the module carries on from it: bucket 0 took 1 + 2 tokens three times.
    let reply: Vec<i64> = cmd("QAG.TAKE")
        .arg("qag:rl:{t}:0")
        .arg(3)
        .arg(3600)
        .query(&mut con)
        .unwrap();
    assert_eq!(reply[0], 0, "the restored bucket is still spent: {reply:?}");
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_rdb_written_with_the_module_restores_every_key() {
    if external("persistence") {
        return;
    }
    let dir = data_dir("rdb");
    let options = ServerOptions {
        dir: Some(dir.clone()),
        ..Default::default()
    };
    let server = Server::start(&options);
    let mut con = server.client().get_connection().unwrap();
    let written = fill(&mut con);
    let _: () = cmd("SAVE").query(&mut con).unwrap();
    server.shutdown();

    let server = Server::start(&options);
    let mut con = server.client().get_connection().unwrap();
    assert_eq!(dataset(&mut con), written);
    let leases: i64 = cmd("QAG.LEASES")
        .arg("qag:running:{t}")
        .query(&mut con)
        .unwrap();
    assert_eq!(leases, 2, "two leases of the last rounds are held");
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_promoted_replica_carries_on_with_tokens_leases_and_counts() {
    if external("failover") {
        return;
    }
    let (primary, replica) = primary_and_linked_replica(false);
    let mut p = primary.client().get_connection().unwrap();
    let mut r = replica.client().get_connection().unwrap();
    for round in 0..12 {
        mixed_round(&mut p, round, 3600);
    }
    for _ in 0..7 {
        let _: Value = cmd("QAG.TAKE")
            .arg("failover:bucket")
            .arg(10)
            .arg(3600)
            .query(&mut p)
            .unwrap();
    }
    let acked: i64 = cmd("WAIT").arg(1).arg(5000).query(&mut p).unwrap();
    assert_eq!(acked, 1);
    let on_primary = dataset(&mut p);
    assert_eq!(dataset(&mut r), on_primary);

    // The primary is lost; the replica takes over.
    drop(p);
    drop(primary);
    let _: () = cmd("REPLICAOF").arg("NO").arg("ONE").query(&mut r).unwrap();
    let reply: Vec<i64> = cmd("QAG.TAKE")
        .arg("failover:bucket")
        .arg(10)
        .arg(3600)
        .query(&mut r)
        .unwrap();
    assert_eq!(
        reply,
        vec![1, 2, 0],
        "the bucket keeps its remaining tokens"
    );
    let leases: i64 = cmd("QAG.LEASES")
        .arg("qag:running:{t}")
        .query(&mut r)
        .unwrap();
    assert_eq!(leases, 2, "the leases keep their holders");
    let quota: Vec<i64> = cmd("QAG.QUOTA.ADD")
        .arg("qag:quota:{t}")
        .arg(&[
            "PER",
            "day",
            "TZ",
            "America/New_York",
            "CALLS",
            "1",
            "ROWS",
            "0",
        ])
        .query(&mut r)
        .unwrap();
    let before: Vec<(String, String)> = on_primary
        .iter()
        .find(|(k, _, _)| k == "qag:quota:{t}")
        .unwrap()
        .1
        .clone();
    let calls: i64 = before
        .iter()
        .find(|(f, _)| f == "calls")
        .unwrap()
        .1
        .parse()
        .unwrap();
    assert_eq!(quota[0], calls + 1, "the quota keeps its count");
}
