//! A refusal is not a write: every command path that writes nothing leaves other
//! clients' WATCH, client-side-caching tracking and keyspace events alone, as plain
//! commands that change nothing do; every real write still signals. And the keyspace
//! events a command fires are exactly those its replicated plain commands fire.

mod common;

use std::time::{Duration, Instant};

use common::*;

fn run(con: &mut Connection, words: &[&str]) -> Value {
    send(con, words).unwrap_or_else(|e| panic!("{}: {e}", words.join(" ")))
}

/// Whether a transaction that WATCHed `keys` still commits after `action` ran on
/// another connection (whether the action succeeded or was refused with an error).
fn watch_survives(t: &Target, keys: &[&str], action: &[&str]) -> bool {
    let mut watcher = t.con();
    let mut other = t.con();
    let mut watch = cmd("WATCH");
    for k in keys {
        watch.arg(*k);
    }
    let _: () = watch.query(&mut watcher).unwrap();
    let _ = send(&mut other, action);
    let _: () = cmd("MULTI").query(&mut watcher).unwrap();
    let _: String = cmd("PING").query(&mut watcher).unwrap();
    let exec: Value = cmd("EXEC").query(&mut watcher).unwrap();
    exec != Value::Nil
}

#[test]
fn refusals_and_no_ops_leave_watch_alone_and_real_writes_abort_it() {
    let mut t = Target::new();
    let mut con = t.con();
    let slots = t.key("slots");
    let gone = t.key("gone");
    run(&mut con, &["QAG.LEASE", &slots, "1", "100000", "a"]);

    // Writes nothing: a transaction watching the key still commits.
    for action in [
        vec!["QAG.LEASE", &slots, "1", "1000", "b"],
        vec!["QAG.RENEW", &slots, "b", "1000"],
        vec!["QAG.RELEASE", &slots, "b"],
        vec!["QAG.RELEASE", &gone, "b"],
        vec!["QAG.LEASES", &slots],
    ] {
        assert!(
            watch_survives(&t, &[&slots, &gone], &action),
            "{action:?} aborted a WATCH"
        );
    }
    // A real write aborts it.
    assert!(!watch_survives(
        &t,
        &[&slots],
        &["QAG.RENEW", &slots, "a", "100000"]
    ));
    assert!(!watch_survives(
        &t,
        &[&slots],
        &["QAG.RELEASE", &slots, "a"]
    ));
    assert!(!watch_survives(
        &t,
        &[&slots],
        &["QAG.LEASE", &slots, "1", "1000", "b"]
    ));
    // RELEASE answering 0 for a lease that ran out removes it (and other expired
    // ones): a write, as the README says.
    let ran_out = t.key("ran-out");
    run(&mut con, &["ZADD", &ran_out, "1000", "x", "2000", "y"]);
    let release = ["QAG.RELEASE", &ran_out, "x"];
    assert!(!watch_survives(&t, &[&ran_out], &release));
    run(&mut con, &["ZADD", &ran_out, "1000", "x", "2000", "y"]);
    assert_eq!(run(&mut con, &release), Value::Int(0));
    assert_eq!(
        run(&mut con, &["EXISTS", &ran_out]),
        Value::Int(0),
        "both removed"
    );

    // A refused admission: every scope of the chain, a missing one included.
    let (org, team, key) = (t.key("{w}org"), t.key("{w}team"), t.key("{w}key"));
    run(&mut con, &["QAG.ADMIT", "1", &team, "1", "0"]);
    let refused = [
        "QAG.ADMIT",
        "3",
        &org,
        "100",
        "0",
        &team,
        "1",
        "0",
        &key,
        "5",
        "0",
    ];
    run(&mut con, &refused);
    assert!(watch_survives(&t, &[&org, &team, &key], &refused));
    let admitted = ["QAG.ADMIT", "2", &org, "100", "0", &key, "5", "0"];
    assert!(!watch_survives(&t, &[&key], &admitted));
    // RECORD refused for overflow charges nothing.
    run(&mut con, &["QAG.RECORD", "1", &org, "9223372036854775000"]);
    let overflow = ["QAG.RECORD", "2", &key, &org, "1000"];
    assert!(send(&mut con, &overflow).is_err(), "overflow refused");
    assert!(watch_survives(
        &t,
        &[&org, &key],
        &["QAG.RECORD", "2", &key, &org, "1000"]
    ));

    // Quotas: the check, and an ADD refused for overflow.
    let quota = t.key("quota");
    let per = ["PER", "month", "TZ", "UTC"];
    let add = |calls: &'static str| {
        let mut words = vec!["QAG.QUOTA.ADD", quota.as_str()];
        words.extend(per);
        words.extend(["CALLS", calls]);
        words
    };
    run(&mut con, &add("9223372036854775807"));
    assert!(send(&mut con, &add("1")).is_err(), "overflow refused");
    assert!(watch_survives(&t, &[&quota], &add("1")));
    let mut check = vec!["QAG.QUOTA", quota.as_str()];
    check.extend(per);
    check.extend(["CALLS", "5"]);
    assert!(watch_survives(&t, &[&quota], &check));
    // Writes that change no count: an ADD of nothing, a SEED at or below the counts.
    let used = t.key("used");
    let count = |command: &'static str, key: &str, calls: &'static str, rows: &'static str| {
        let mut words = vec![command.to_string(), key.to_string()];
        words.extend(per.map(String::from));
        words.extend(["CALLS", calls, "ROWS", rows].map(String::from));
        words
    };
    let words = |w: &[String]| w.iter().map(String::as_str).collect::<Vec<_>>().join(" ");
    run(
        &mut con,
        &count("QAG.QUOTA.ADD", &used, "5", "50")
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
    );
    for no_op in [
        count("QAG.QUOTA.ADD", &used, "0", "0"),
        count("QAG.QUOTA.SEED", &used, "3", "50"),
        count("QAG.QUOTA.SEED", &used, "0", "0"),
        count("QAG.QUOTA.ADD", &quota, "0", "0"),
    ] {
        let action: Vec<&str> = no_op.iter().map(String::as_str).collect();
        assert!(
            watch_survives(&t, &[&used, &quota], &action),
            "{} aborted a WATCH",
            words(&no_op)
        );
    }
    let action = count("QAG.QUOTA.SEED", &used, "6", "0");
    let action: Vec<&str> = action.iter().map(String::as_str).collect();
    assert!(
        !watch_survives(&t, &[&used], &action),
        "a SEED above the count writes"
    );
    let action = count("QAG.QUOTA.ADD", &used, "0", "1");
    let action: Vec<&str> = action.iter().map(String::as_str).collect();
    assert!(!watch_survives(&t, &[&used], &action));
    // RECORD of no tokens charges nothing, on a scope that has counts or none.
    let fresh = t.key("{w}fresh");
    let record = ["QAG.RECORD", "2", &org, &fresh, "0"];
    assert!(watch_survives(&t, &[&org, &fresh], &record));
    assert_eq!(
        run(&mut con, &["EXISTS", &fresh]),
        Value::Int(0),
        "no key made"
    );

    // Buckets: PEEK; TAKE2's key bucket when the client bucket refuses. TAKE writes
    // even when it refuses, as the script does.
    let (client, bucket) = (t.key("{b}client"), t.key("{b}key"));
    run(&mut con, &["QAG.TAKE", &bucket, "5", "60"]);
    assert!(watch_survives(
        &t,
        &[&bucket],
        &["QAG.PEEK", &bucket, "5", "60"]
    ));
    run(&mut con, &["QAG.TAKE", &client, "1", "60"]);
    let take2 = ["QAG.TAKE2", &client, "1", "60", &bucket, "5", "60"];
    assert!(watch_survives(&t, &[&bucket], &take2));
    assert!(!watch_survives(&t, &[&client], &take2));
    // A refund to a missing bucket (a full one) writes nothing; to a stored one, it does.
    let missing = t.key("{b}missing");
    let refund = |key: &str| {
        vec![
            "QAG.REFUND".to_string(),
            key.into(),
            "5".into(),
            "60".into(),
            "1".into(),
        ]
    };
    let words = refund(&missing);
    let words: Vec<&str> = words.iter().map(String::as_str).collect();
    assert!(watch_survives(&t, &[&missing], &words));
    let words = refund(&bucket);
    let words: Vec<&str> = words.iter().map(String::as_str).collect();
    assert!(!watch_survives(&t, &[&bucket], &words));
    t.assert_healthy();
}

#[test]
fn a_refused_take2_leaves_the_key_buckets_idle_time_alone() {
    let mut t = Target::new();
    let mut con = t.con();
    let (client, bucket) = (t.key("{i}client"), t.key("{i}key"));
    run(&mut con, &["QAG.TAKE", &client, "1", "600"]);
    run(&mut con, &["QAG.TAKE", &bucket, "5", "600"]);
    // The server's LRU clock ticks in seconds.
    std::thread::sleep(Duration::from_millis(2200));
    let reply = run(
        &mut con,
        &["QAG.TAKE2", &client, "1", "600", &bucket, "5", "600"],
    );
    let Value::Array(pair) = reply else {
        panic!("{reply:?}")
    };
    assert_eq!(pair[1], Value::Nil, "the client bucket refused");
    let idle: i64 = cmd("OBJECT")
        .arg("IDLETIME")
        .arg(&bucket)
        .query(&mut con)
        .unwrap();
    assert!(idle >= 2, "the key bucket was touched: idle {idle} s");
    t.assert_healthy();
}

/// Reads pub/sub messages until `last` arrives; returns (channel, payload) pairs.
fn messages_until(
    pubsub: &mut redis::PubSub,
    last: impl Fn(&str, &[String]) -> bool,
) -> Vec<(String, Vec<String>)> {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut seen = Vec::new();
    while Instant::now() < deadline {
        let Ok(message) = pubsub.get_message() else {
            continue;
        };
        let channel = message.get_channel_name().to_string();
        let payload = match message.get_payload::<Vec<String>>() {
            Ok(keys) => keys,
            Err(_) => vec![message.get_payload::<String>().unwrap_or_default()],
        };
        let done = last(&channel, &payload);
        seen.push((channel, payload));
        if done {
            return seen;
        }
    }
    panic!("the closing message never came; saw {seen:?}");
}

#[test]
fn client_tracking_is_invalidated_by_writes_only() {
    let mut t = Target::new();
    let mut listener = t.con();
    let client_id: i64 = cmd("CLIENT").arg("ID").query(&mut listener).unwrap();
    listener
        .set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let mut pubsub = listener.as_pubsub();
    pubsub.subscribe("__redis__:invalidate").unwrap();

    let mut reader = t.con();
    let mut writer = t.con();
    let slots = t.key("tracked-slots");
    let marker = t.key("tracked-marker");
    run(&mut writer, &["QAG.LEASE", &slots, "1", "100000", "a"]);
    run(&mut writer, &["SET", &marker, "0"]);
    let id = client_id.to_string();
    run(&mut reader, &["CLIENT", "TRACKING", "ON", "REDIRECT", &id]);
    run(&mut reader, &["ZCARD", &slots]);
    run(&mut reader, &["GET", &marker]);

    run(&mut writer, &["QAG.LEASE", &slots, "1", "1000", "b"]);
    run(&mut writer, &["QAG.RENEW", &slots, "b", "1000"]);
    run(&mut writer, &["QAG.RELEASE", &slots, "b"]);
    run(&mut writer, &["SET", &marker, "1"]);
    let seen = messages_until(&mut pubsub, |_, keys| keys.contains(&marker));
    assert_eq!(
        seen,
        [("__redis__:invalidate".to_string(), vec![marker.clone()])],
        "a refusal or no-op invalidated a key"
    );
    // A real write invalidates.
    run(&mut writer, &["QAG.RELEASE", &slots, "a"]);
    let seen = messages_until(&mut pubsub, |_, keys| keys.contains(&slots));
    assert_eq!(seen.len(), 1, "{seen:?}");
    t.assert_healthy();
}

/// Every keyspace event of database 0, as (event, key), until `SET <end>`.
fn key_events(pubsub: &mut redis::PubSub, end: &str) -> Vec<(String, String)> {
    messages_until(pubsub, |channel, payload| {
        channel.ends_with(":set") && payload == [end.to_string()]
    })
    .into_iter()
    .map(|(channel, payload)| {
        let event = channel.rsplit(':').next().unwrap_or_default().to_string();
        (event, payload.concat())
    })
    .collect()
}

fn subscribe_to_key_events(server: &Server) -> redis::Connection {
    let mut con = server.client().get_connection().unwrap();
    run(
        &mut con,
        &["CONFIG", "SET", "notify-keyspace-events", "KEA"],
    );
    con.set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    con
}

/// `new` fires where the replica's plain command creates the key, and only there: a
/// throttle's rewrite of an existing key (the replica's `SET … PXAT` overwrites it)
/// fires `set` and `expire` alone, as do a bucket's and a lease's later writes.
#[test]
fn new_key_events_only_where_the_key_is_created() {
    if external("new_key_events_only_where_the_key_is_created") {
        return;
    }
    let (primary, replica) = primary_and_replica();
    let mut con = primary.client().get_connection().unwrap();
    let subscribe = |server: &Server| {
        let mut con = subscribe_to_key_events(server);
        run(
            &mut con,
            &["CONFIG", "SET", "notify-keyspace-events", "KEAn"],
        );
        con
    };
    let (mut primary_events, mut replica_events) = (subscribe(&primary), subscribe(&replica));
    let mut primary_sub = primary_events.as_pubsub();
    let mut replica_sub = replica_events.as_pubsub();
    primary_sub.psubscribe("__keyevent@0__:*").unwrap();
    replica_sub.psubscribe("__keyevent@0__:*").unwrap();
    for line in [
        "QAG.THROTTLE th 5 1 60 1",
        "QAG.THROTTLE th 5 1 60 1",
        "QAG.THROTTLE th 5 1 60 1",
        "SET old 1",
        "QAG.THROTTLE old 5 1 60 1",
        "QAG.TAKE b 5 60",
        "QAG.TAKE b 5 60",
        "QAG.LEASE ls 2 100000 a",
        "QAG.LEASE ls 2 100000 b",
        "SET end 1",
    ] {
        send_line(&mut con, line).unwrap_or_else(|e| panic!("{line}: {e}"));
    }
    let on_primary = key_events(&mut primary_sub, "end");
    let on_replica = key_events(&mut replica_sub, "end");
    assert_eq!(on_primary, on_replica);
    let created: Vec<&str> = on_primary
        .iter()
        .filter(|(event, _)| event == "new")
        .map(|(_, key)| key.as_str())
        .collect();
    assert_eq!(created, ["th", "old", "b", "ls", "end"]);
    let th: Vec<&str> = on_primary
        .iter()
        .filter(|(_, key)| key == "th")
        .map(|(event, _)| event.as_str())
        .collect();
    assert_eq!(
        th,
        ["new", "set", "expire", "set", "expire", "set", "expire"]
    );
    drop((replica, primary));
}

#[test]
fn keyspace_events_are_those_of_the_replicated_plain_commands() {
    if external("keyspace_events_are_those_of_the_replicated_plain_commands") {
        return;
    }
    let (primary, replica) = primary_and_replica();
    let mut con = primary.client().get_connection().unwrap();

    let mut primary_events = subscribe_to_key_events(&primary);
    let mut replica_events = subscribe_to_key_events(&replica);
    let mut primary_sub = primary_events.as_pubsub();
    let mut replica_sub = replica_events.as_pubsub();
    primary_sub.psubscribe("__keyevent@0__:*").unwrap();
    replica_sub.psubscribe("__keyevent@0__:*").unwrap();

    let (s, _): (i64, i64) = cmd("TIME").query(&mut con).unwrap();
    let past = ((s - 100) * 1000).to_string();
    let workload = [
        // The last lease released: zrem, then del.
        "QAG.LEASE ls 2 100000 a".to_string(),
        "QAG.LEASE ls 2 100000 b".into(),
        "QAG.LEASE ls 2 100000 c".into(),
        "QAG.RELEASE ls a".into(),
        "QAG.RELEASE ls b".into(),
        "QAG.RELEASE ls b".into(),
        // Expired members removed by a LEASE empty the set before it adds: zrem, del,
        // zadd, as the replica's ZREM and ZADD fire.
        format!("ZADD old {past} x {past} y"),
        "QAG.LEASE old 1 100000 a".into(),
        // RELEASE of an expired lease with the set emptied by it.
        format!("ZADD stale {past} x"),
        "QAG.RELEASE stale x".into(),
        "QAG.RENEW stale x 1000".into(),
        // Buckets, pairs, quotas, windows, refusals among them.
        "QAG.TAKE b 1 60".into(),
        "QAG.TAKE b 1 60".into(),
        "QAG.TAKE2 b 1 60 k 5 60".into(),
        "QAG.TAKE2 c 1 60 k 5 60".into(),
        "QAG.PEEK k 5 60".into(),
        "QAG.QUOTA.ADD q PER day TZ UTC CALLS 1".into(),
        "QAG.QUOTA.SEED q PER day TZ UTC CALLS 10".into(),
        "QAG.QUOTA q PER day TZ UTC CALLS 5".into(),
        "HSET w req:1 4 tok:2 9".into(),
        "QAG.ADMIT 2 w 10 0 w2 1 0".into(),
        "QAG.ADMIT 2 w 10 0 w2 1 0".into(),
        "QAG.RECORD 2 w w2 50".into(),
        // A throttle: set and expire when it takes, nothing on a peek or a refusal.
        "QAG.THROTTLE th 0 1 60 1".into(),
        "QAG.THROTTLE th 0 1 60 1".into(),
        "QAG.THROTTLE th 0 1 60 0".into(),
        "SET end 1".into(),
    ];
    for line in &workload {
        send_line(&mut con, line).unwrap_or_else(|e| panic!("{line}: {e}"));
    }
    let on_primary = key_events(&mut primary_sub, "end");
    let on_replica = key_events(&mut replica_sub, "end");
    assert_eq!(on_primary, on_replica);
    let pair = |event: &str, key: &str| (event.to_string(), key.to_string());
    let ls: Vec<_> = on_primary.iter().filter(|(_, k)| k == "ls").collect();
    assert_eq!(
        ls.last().copied(),
        Some(&pair("del", "ls")),
        "the last release deletes: {ls:?}"
    );
    for key in ["old", "stale"] {
        assert!(on_primary.contains(&pair("del", key)), "{on_primary:?}");
    }
    let th: Vec<_> = on_primary.iter().filter(|(_, k)| k == "th").collect();
    assert_eq!(
        th,
        [&pair("set", "th"), &pair("expire", "th")],
        "one take, one write"
    );
    drop((replica, primary));
}

#[test]
fn writes_that_change_nothing_replicate_and_fire_nothing() {
    if external("writes_that_change_nothing_replicate_and_fire_nothing") {
        return;
    }
    let (primary, replica) = primary_and_replica();
    let mut con = primary.client().get_connection().unwrap();
    let mut events = subscribe_to_key_events(&primary);
    let mut sub = events.as_pubsub();
    sub.psubscribe("__keyevent@0__:*").unwrap();
    let real = [
        "QAG.QUOTA.ADD q PER day TZ UTC CALLS 5 ROWS 50",
        "QAG.RECORD 1 w 7",
        "QAG.LEASE ls 2 100000 a",
    ];
    let no_ops = [
        "QAG.QUOTA.ADD q PER day TZ UTC CALLS 0 ROWS 0",
        "QAG.QUOTA.ADD q PER day TZ UTC CALLS 0",
        "QAG.QUOTA.SEED q PER day TZ UTC CALLS 5 ROWS 10",
        "QAG.QUOTA.ADD missing PER day TZ UTC CALLS 0 ROWS 0",
        "QAG.QUOTA.SEED missing PER day TZ UTC CALLS 0",
        "QAG.RECORD 1 w 0",
        "QAG.RECORD 2 w missing 0",
    ];
    for line in real.iter().chain(&no_ops) {
        send_line(&mut con, line).unwrap_or_else(|e| panic!("{line}: {e}"));
    }
    // A lease renewed to the expiry it has: twice in one transaction, where the server
    // gives both calls one time (Redis 7.2 and later, Valkey).
    let info: String = cmd("INFO").arg("qag").query(&mut con).unwrap();
    let one_time = info.contains("qag_clock:RedisModule_CachedMicroseconds");
    if one_time {
        let _: Value = redis::pipe()
            .atomic()
            .cmd("QAG.RENEW")
            .arg(&["ls", "a", "5000"])
            .cmd("QAG.RENEW")
            .arg(&["ls", "a", "5000"])
            .cmd("QAG.LEASE")
            .arg(&["ls", "2", "5000", "a"])
            .query(&mut con)
            .unwrap();
    }
    send_line(&mut con, "SET end 1").unwrap();
    let seen = key_events(&mut sub, "end");
    let pair = |event: &str, key: &str| (event.to_string(), key.to_string());
    let mut expected = vec![
        pair("hset", "q"),
        pair("expire", "q"),
        pair("hset", "w"),
        pair("expire", "w"),
        pair("zadd", "ls"),
        pair("expire", "ls"),
    ];
    if one_time {
        expected.extend([pair("zadd", "ls"), pair("expire", "ls")]);
    }
    expected.push(pair("set", "end"));
    assert_eq!(seen, expected, "only the real writes fire");
    // Replicated: the real writes only, and the replica holds what the primary holds.
    let mut r = replica.client().get_connection().unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while send_line(&mut r, "GET end").unwrap() == Value::Nil {
        assert!(
            std::time::Instant::now() < deadline,
            "the replica never caught up"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(command_calls(&mut r, "hset"), 2, "one HSET per real write");
    assert_eq!(command_calls(&mut r, "zadd"), 1 + i64::from(one_time));
    assert_eq!(dataset(&mut r), dataset(&mut con));
    assert_eq!(
        send_line(&mut con, "EXISTS missing").unwrap(),
        Value::Int(0)
    );
    drop((replica, primary));
}
