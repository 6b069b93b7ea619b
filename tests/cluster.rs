//! Redis Cluster: three primaries on loopback. Single-key commands are routed by key
//! from a cluster client; multi-key commands (TAKE2, ADMIT, RECORD) are refused with
//! CROSSSLOT on keys of different slots and work with a common hash tag.

mod common;

use common::*;

/// A connection to the node that serves `key`'s slot.
fn owner(nodes: &[Server], key: &str) -> Connection {
    for node in nodes {
        let mut con = node.client().get_connection().unwrap();
        match cmd("QAG.LEASES").arg(key).query::<i64>(&mut con) {
            Ok(_) => return con,
            Err(e) => assert_eq!(e.code(), Some("MOVED"), "{e}"),
        }
    }
    panic!("no node serves {key}");
}

#[test]
fn commands_route_by_key_and_multi_key_calls_need_one_slot() {
    if external("cluster") {
        return;
    }
    let nodes = start_cluster(&ServerOptions::default());
    let urls: Vec<String> = nodes
        .iter()
        .map(|n| format!("redis://127.0.0.1:{}/", n.port))
        .collect();
    let client = redis::cluster::ClusterClient::new(urls).unwrap();
    let mut cluster = client.get_connection().unwrap();
    // Keys spread over every node, each routed by its key.
    for i in 0..30 {
        let key = format!("qag:ratelimit:key{i}");
        let reply: Vec<i64> = cmd("QAG.TAKE")
            .arg(&key)
            .arg(5)
            .arg(60)
            .query(&mut cluster)
            .unwrap();
        assert_eq!(reply, vec![1, 4, 0], "{key}");
        let peek: Vec<i64> = cmd("QAG.PEEK")
            .arg(&key)
            .arg(5)
            .arg(60)
            .query(&mut cluster)
            .unwrap();
        assert_eq!(peek, vec![1, 3, 0], "{key}");
        let lease: Vec<i64> = cmd("QAG.LEASE")
            .arg(format!("qag:running:{i}"))
            .arg(2)
            .arg(60_000)
            .arg("q")
            .query(&mut cluster)
            .unwrap();
        assert_eq!(lease, vec![1, 1, 0]);
        let quota: Vec<i64> = cmd("QAG.QUOTA.ADD")
            .arg(format!("qag:quota:{i}"))
            .arg(&["PER", "day", "TZ", "UTC", "CALLS", "1"])
            .query(&mut cluster)
            .unwrap();
        assert_eq!(quota[0], 1);
    }
    let mut served = 0;
    for node in &nodes {
        let size: i64 = cmd("DBSIZE")
            .query(&mut node.client().get_connection().unwrap())
            .unwrap();
        served += usize::from(size > 0);
    }
    assert_eq!(served, 3, "the keys landed on every node");

    // Multi-key commands: different slots are refused, a common hash tag works.
    let (a, b) = ("qag:ip:1", "qag:key:2");
    let mut con = owner(&nodes, a);
    for call in [
        cmd("QAG.TAKE2")
            .arg(a)
            .arg(5)
            .arg(60)
            .arg(b)
            .arg(5)
            .arg(60)
            .clone(),
        cmd("QAG.ADMIT")
            .arg(2)
            .arg(a)
            .arg(5)
            .arg(0)
            .arg(b)
            .arg(5)
            .arg(0)
            .clone(),
        cmd("QAG.RECORD").arg(2).arg(a).arg(b).arg(10).clone(),
    ] {
        let err = call.query::<Value>(&mut con).unwrap_err();
        assert_eq!(err.code(), Some("CROSSSLOT"), "{err}");
    }
    let (a, b) = ("qag:{acme}:ip", "qag:{acme}:key");
    let mut con = owner(&nodes, a);
    let pair: (Vec<i64>, Option<Vec<i64>>) = cmd("QAG.TAKE2")
        .arg(a)
        .arg(5)
        .arg(60)
        .arg(b)
        .arg(5)
        .arg(60)
        .query(&mut con)
        .unwrap();
    assert_eq!(pair, (vec![1, 4, 0], Some(vec![1, 4, 0])));
    let admit: Vec<i64> = cmd("QAG.ADMIT")
        .arg(2)
        .arg(&["qag:{acme}:org", "5", "0", "qag:{acme}:team", "5", "0"])
        .query(&mut con)
        .unwrap();
    assert_eq!(admit, vec![1, 0, 0, 4, -1]);
    let charged: i64 = cmd("QAG.RECORD")
        .arg(2)
        .arg(&["qag:{acme}:org", "qag:{acme}:team", "10"])
        .query(&mut con)
        .unwrap();
    assert_eq!(charged, 2);
}
