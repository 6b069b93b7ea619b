//! Effects replication: a replica (run without the module, so it can only apply plain
//! commands) ends up with exactly the primary's fields, members, scores and expiry times.

mod common;

use std::time::{Duration, Instant};

use common::*;

#[test]
fn a_replica_holds_exactly_the_primarys_fields_and_expiry() {
    if external("replication") {
        return;
    }
    let primary = Server::start(&ServerOptions::default());
    let mut replica = Server::start(&ServerOptions {
        without_module: true,
        replica_of: Some(primary.port),
        ..Default::default()
    });
    let mut p = primary.client().get_connection().unwrap();
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
    let sha = load_script(&mut p);
    for round in 0..30 {
        let bucket = format!("qag:rl:{{t}}:{}", round % 4);
        let _: Value = cmd("QAG.TAKE")
            .arg(&bucket)
            .arg(3)
            .arg(0.5)
            .query(&mut p)
            .unwrap();
        let _: Value = cmd("QAG.TAKE")
            .arg(&bucket)
            .arg(3)
            .arg(0.5)
            .arg("COST")
            .arg(2)
            .query(&mut p)
            .unwrap();
        let _: Value = cmd("QAG.TAKE2")
            .arg("qag:rl:{t}:ip")
            .arg(20)
            .arg(1)
            .arg(&bucket)
            .arg(3)
            .arg(0.5)
            .query(&mut p)
            .unwrap();
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
        let slots = "qag:running:{t}";
        let _: Value = cmd("QAG.LEASE")
            .arg(slots)
            .arg(3)
            .arg(400)
            .arg(format!("req{round}"))
            .query(&mut p)
            .unwrap();
        let _: Value = cmd("QAG.RENEW")
            .arg(slots)
            .arg(format!("req{}", round.max(1) - 1))
            .arg(500)
            .query(&mut p)
            .unwrap();
        if round % 3 == 0 {
            let _: Value = cmd("QAG.RELEASE")
                .arg(slots)
                .arg(format!("req{round}"))
                .query(&mut p)
                .unwrap();
        }
        let quota = "qag:quota:{t}";
        let command = if round % 7 == 3 {
            "QAG.QUOTA.SEED"
        } else {
            "QAG.QUOTA.ADD"
        };
        let _: Value = cmd(command)
            .arg(quota)
            .arg("PER")
            .arg("day")
            .arg("TZ")
            .arg("America/New_York")
            .arg("CALLS")
            .arg(round)
            .arg("ROWS")
            .arg(10 * round)
            .query(&mut p)
            .unwrap();
        let (org, key) = ("qag:win:{t}:org", "qag:win:{t}:key");
        let _: Value = cmd("QAG.ADMIT")
            .arg(2)
            .arg(org)
            .arg(40)
            .arg(5000)
            .arg(key)
            .arg(3)
            .arg(0)
            .arg("WINDOW")
            .arg(1)
            .query(&mut p)
            .unwrap();
        let _: Value = cmd("QAG.RECORD")
            .arg(2)
            .arg(org)
            .arg(key)
            .arg(100 + round)
            .arg("WINDOW")
            .arg(1)
            .query(&mut p)
            .unwrap();
        if round % 10 == 9 {
            std::thread::sleep(Duration::from_millis(300));
        }
    }
    let acked: i64 = cmd("WAIT").arg(1).arg(5000).query(&mut p).unwrap();
    assert_eq!(acked, 1, "the replica acknowledged the stream");
    let on_primary = dataset(&mut p);
    let on_replica = dataset(&mut r);
    assert_eq!(on_primary.len(), 11);
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
