//! Effects replication: a replica (run without the module, so it can only apply plain
//! commands) ends up with exactly the primary's fields, members, scores and expiry times.

mod common;

use std::time::Duration;

use common::*;

#[test]
fn a_replica_holds_exactly_the_primarys_fields_and_expiry() {
    if external("replication") {
        return;
    }
    let (primary, mut replica) = primary_and_replica();
    let mut p = primary.client().get_connection().unwrap();
    let mut r = replica.client().get_connection().unwrap();
    let sha = load_script(&mut p);
    for round in 0..30 {
        // Every writing command, with lifetimes of a second so that refills, expired
        // leases and new windows all happen during the run.
        mixed_round(&mut p, round, 1);
        let _: Value = cmd("EVALSHA")
            .arg(&sha)
            .arg(1)
            .arg("qag:rl:{t}:script")
            .arg(2)
            .arg(1)
            .query(&mut p)
            .unwrap();
        let _: Value = redis::pipe()
            .atomic()
            .cmd("QAG.TAKE")
            .arg("qag:rl:{t}:multi")
            .arg(2)
            .arg(10)
            .cmd("QAG.PEEK")
            .arg("qag:rl:{t}:multi")
            .arg(2)
            .arg(10)
            .query(&mut p)
            .unwrap();
        if round % 10 == 9 {
            std::thread::sleep(Duration::from_millis(600));
        }
    }
    let acked: i64 = cmd("WAIT").arg(1).arg(5000).query(&mut p).unwrap();
    assert_eq!(acked, 1, "the replica acknowledged the stream");
    let on_primary = dataset(&mut p);
    let on_replica = dataset(&mut r);
    assert_eq!(on_primary.len(), 14);
    assert!(on_primary
        .iter()
        .any(|(k, members, _)| k == "qag:running:{t}" && !members.is_empty()));
    assert_eq!(on_replica, on_primary);
    assert!(replica.alive(), "replica died:\n{}", replica.log());
    assert!(
        !replica.log().contains("Unknown command"),
        "{}",
        replica.log()
    );
}

/// Calls that leave a key's expiry where it was replicate no PEXPIREAT: the replica
/// applies one HSET a call, and a PEXPIREAT only when the expiry moves.
#[test]
fn an_expiry_that_does_not_move_is_not_replicated() {
    if external("replication") {
        return;
    }
    let (primary, replica) = primary_and_replica();
    let mut p = primary.client().get_connection().unwrap();
    let mut r = replica.client().get_connection().unwrap();
    const CALLS: i64 = 20;
    for _ in 0..CALLS {
        // A 600 s bucket's expiry moves at most once in 150 s; a quota's is fixed for
        // its month; a 60 s window's moves once a window.
        let _: Value = cmd("QAG.TAKE")
            .arg("qag:rl:steady")
            .arg(1000)
            .arg(600)
            .query(&mut p)
            .unwrap();
        let _: Value = cmd("QAG.QUOTA.ADD")
            .arg("qag:quota:steady")
            .arg("PER")
            .arg("month")
            .arg("TZ")
            .arg("UTC")
            .arg("CALLS")
            .arg(1)
            .query(&mut p)
            .unwrap();
        let _: Value = cmd("QAG.ADMIT")
            .arg(1)
            .arg("qag:llm:steady")
            .arg(1000)
            .arg(0)
            .query(&mut p)
            .unwrap();
    }
    let acked: i64 = cmd("WAIT").arg(1).arg(5000).query(&mut p).unwrap();
    assert_eq!(acked, 1, "the replica acknowledged the stream");
    let mut applied = |command: &str| command_calls(&mut r, command);
    assert_eq!(applied("hset"), 3 * CALLS, "one HSET a call");
    // One per key, and one more for a key whose window ended during the run.
    let pexpireat = applied("pexpireat");
    assert!(
        (3..=5).contains(&pexpireat),
        "{pexpireat} PEXPIREAT for {} calls",
        3 * CALLS
    );
    assert_eq!(dataset(&mut r), dataset(&mut p));
}
