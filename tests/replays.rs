//! Charges that count once: `ID request-id` replays on every counting command (a lost
//! reply, a promoted replica), reservations on QAG.ADMIT committed by QAG.RECORD, partial
//! charges of a stream, holds that expire, and the memory ids take.

mod common;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use common::*;

/// Every field of a hash, sorted, and its expiry: what a replay must leave as it was.
fn state(con: &mut Connection, key: &str) -> (Vec<(String, String)>, i64) {
    let mut fields: Vec<(String, String)> = cmd("HGETALL").arg(key).query(con).unwrap();
    fields.sort();
    let at: i64 = cmd("PEXPIRETIME").arg(key).query(con).unwrap();
    (fields, at)
}

/// A relay on loopback that forwards one connection's bytes to `server` and drops
/// everything the server answers: a call that runs and whose reply is lost.
fn reply_dropping_relay(server: u16) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        let (mut client, _) = listener.accept().unwrap();
        let mut upstream = TcpStream::connect(("127.0.0.1", server)).unwrap();
        let mut downstream = upstream.try_clone().unwrap();
        std::thread::spawn(move || {
            let mut sink = [0u8; 4096];
            while matches!(downstream.read(&mut sink), Ok(n) if n > 0) {}
        });
        let mut buffer = [0u8; 4096];
        while let Ok(n) = client.read(&mut buffer) {
            if n == 0 || upstream.write_all(&buffer[..n]).is_err() {
                break;
            }
        }
    });
    port
}

/// Sends `words` through a relay that loses the reply: the call runs on the server, and
/// the caller, like a client whose connection dropped, never hears of it.
fn call_losing_the_reply(server: u16, words: &[&str]) {
    let port = reply_dropping_relay(server);
    let mut request = format!("*{}\r\n", words.len());
    for word in words {
        request.push_str(&format!("${}\r\n{word}\r\n", word.len()));
    }
    let mut relay = TcpStream::connect(("127.0.0.1", port)).unwrap();
    relay.write_all(request.as_bytes()).unwrap();
    relay
        .set_read_timeout(Some(Duration::from_millis(300)))
        .unwrap();
    let mut reply = [0u8; 64];
    assert!(relay.read(&mut reply).is_err(), "the reply was to be lost");
}

/// A server of the test's own, the module loaded with `module_args`.
fn server_with(module_args: &[&str]) -> Server {
    Server::start(&ServerOptions {
        module_args: module_args.iter().map(|a| a.to_string()).collect(),
        ..Default::default()
    })
}

fn value(reply: &redis::RedisResult<Value>) -> String {
    format!("{reply:?}")
}

#[test]
fn a_lost_reply_replayed_with_its_id_counts_once() {
    if external("a_lost_reply_replayed_with_its_id_counts_once") {
        return;
    }
    let server = Server::start(&ServerOptions::default());
    let mut con = server.client().get_connection().unwrap();
    let calls: [(&str, Vec<&str>); 6] = [
        ("b", vec!["QAG.TAKE", "b", "3", "3600", "ID", "req-1"]),
        (
            "c",
            vec![
                "QAG.TAKE2",
                "c",
                "3",
                "3600",
                "k",
                "5",
                "3600",
                "ID",
                "req-1",
            ],
        ),
        (
            "b",
            vec!["QAG.REFUND", "b", "3", "3600", "1", "ID", "req-1"],
        ),
        (
            "q",
            vec![
                "QAG.QUOTA.ADD",
                "q",
                "PER",
                "day",
                "TZ",
                "UTC",
                "CALLS",
                "1",
                "ID",
                "req-1",
            ],
        ),
        (
            "w",
            vec![
                "QAG.ADMIT",
                "2",
                "w",
                "10",
                "0",
                "w2",
                "10",
                "0",
                "ID",
                "req-1",
            ],
        ),
        ("w", vec!["QAG.RECORD", "2", "w", "w2", "40", "ID", "req-1"]),
    ];
    // A refund needs tokens taken to show; so does the key bucket under TAKE2.
    send_line(&mut con, "QAG.TAKE b 3 3600").unwrap();
    for (key, words) in &calls {
        call_losing_the_reply(server.port, words);
        let before = state(&mut con, key);
        let replayed = send(&mut con, words);
        assert!(replayed.is_ok(), "{words:?}: {replayed:?}");
        let again = send(&mut con, words);
        assert_eq!(value(&replayed), value(&again), "{words:?}");
        assert_eq!(
            state(&mut con, key),
            before,
            "{words:?}: the replay changed nothing"
        );
    }
    // Counted once each: 3 - 1 (plain) - 1 (TAKE, id) + 1 (REFUND) = 2, then TAKE2's.
    let tokens: String = cmd("HGET").arg("b").arg("tokens").query(&mut con).unwrap();
    assert!(tokens.starts_with('2'), "b holds {tokens}");
    let left: Vec<i64> = cmd("QAG.PEEK")
        .arg("c")
        .arg(3)
        .arg(3600)
        .query(&mut con)
        .unwrap();
    assert_eq!(
        left[1], 1,
        "one TAKE2 of c (PEEK answers what a take would leave)"
    );
    let left: Vec<i64> = cmd("QAG.PEEK")
        .arg("k")
        .arg(5)
        .arg(3600)
        .query(&mut con)
        .unwrap();
    assert_eq!(left[1], 3, "one TAKE2 of k");
    let calls_used: i64 = cmd("HGET").arg("q").arg("calls").query(&mut con).unwrap();
    assert_eq!(calls_used, 1);
    for scope in ["w", "w2"] {
        let counts = (
            counted(&mut con, scope, "req:"),
            counted(&mut con, scope, "tok:"),
        );
        assert_eq!(counts, (1, 40), "{scope}");
    }
    let info: String = cmd("INFO").arg("qag").query(&mut con).unwrap();
    assert!(
        info.contains("qag_replays:12\r\n"),
        "each call replayed twice:\n{info}"
    );
    // A different id is a new call.
    let other: Vec<i64> = cmd("QAG.TAKE")
        .arg("b")
        .arg(3)
        .arg(3600)
        .arg("ID")
        .arg("req-2")
        .query(&mut con)
        .unwrap();
    assert_eq!(other[..2], [1, 1]);
    server.shutdown();
}

#[test]
fn a_promoted_replica_recognises_a_replay_of_what_the_primary_answered() {
    if external("a_promoted_replica_recognises_a_replay_of_what_the_primary_answered") {
        return;
    }
    let (primary, replica) = primary_and_linked_replica(false);
    let mut p = primary.client().get_connection().unwrap();
    let mut r = replica.client().get_connection().unwrap();
    let take = "QAG.TAKE2 c 2 3600 k 9 3600 ID req-7";
    let admit = "QAG.ADMIT 1 w 0 1000 RESERVE 300 ID req-7";
    let first_take = value(&send_line(&mut p, take));
    let first_admit = value(&send_line(&mut p, admit));
    let _: i64 = cmd("WAIT").arg(1).arg(5000).query(&mut p).unwrap();
    let _: () = cmd("REPLICAOF").arg("NO").arg("ONE").query(&mut r).unwrap();
    let before = (state(&mut r, "c"), state(&mut r, "k"), state(&mut r, "w"));
    assert_eq!(value(&send_line(&mut r, take)), first_take);
    assert_eq!(value(&send_line(&mut r, admit)), first_admit);
    assert_eq!(
        (state(&mut r, "c"), state(&mut r, "k"), state(&mut r, "w")),
        before
    );
    // The hold came along: the promoted replica commits it once.
    assert_eq!(
        value(&send_line(&mut r, "QAG.RECORD 1 w 120 ID req-7")),
        value(&Ok(Value::Int(1)))
    );
    let holds: Option<String> = cmd("HGET").arg("w").arg("holds").query(&mut r).unwrap();
    assert_eq!(holds, None, "committed on the promoted replica");
    replica.shutdown();
    primary.shutdown();
}

/// Whether a reservation of 100 tokens against a tpm of 1000 is admitted.
fn reserve_100(con: &mut Connection, key: &str, id: &str) -> bool {
    let line = format!("QAG.ADMIT 1 {key} 0 1000 RESERVE 100 ID {id}");
    let reply: Vec<i64> =
        redis::FromRedisValue::from_redis_value(send_line(con, &line).unwrap()).unwrap();
    reply[0] == 1
}

#[test]
fn reservations_hold_tokens_until_committed_and_fit_exactly() {
    let mut t = Target::new();
    let key = t.key("tpm");
    let threads: Vec<_> = (0..64)
        .map(|i| {
            let mut con = t.con();
            let key = key.clone();
            std::thread::spawn(move || (i, reserve_100(&mut con, &key, &format!("r{i}"))))
        })
        .collect();
    let admitted: Vec<usize> = threads
        .into_iter()
        .map(|t| t.join().unwrap())
        .filter(|(_, ok)| *ok)
        .map(|(i, _)| i)
        .collect();
    assert_eq!(admitted.len(), 10, "10 holds of 100 fill a tpm of 1000");
    let mut con = t.con();
    for i in &admitted {
        // A second commit changes nothing.
        for _ in 0..2 {
            let charged = send_line(&mut con, &format!("QAG.RECORD 1 {key} 40 ID r{i}"));
            assert_eq!(value(&charged), value(&Ok(Value::Int(1))));
        }
    }
    let more = (0..10)
        .filter(|i| reserve_100(&mut con, &key, &format!("more{i}")))
        .count();
    assert_eq!(more, 6, "400 committed: six more holds of 100");
    // A hold never committed stops counting when it expires: HOLD 400 ms, rounded up to
    // a sixteenth of a 4 s window.
    let short = t.key("short");
    let admit = |con: &mut Connection, id: &str, hold: Option<u64>| -> Vec<i64> {
        let mut c = cmd("QAG.ADMIT");
        c.arg(1)
            .arg(&short)
            .arg(0)
            .arg(100)
            .arg("RESERVE")
            .arg(80)
            .arg("ID")
            .arg(id)
            .arg("WINDOW")
            .arg(4);
        if let Some(ms) = hold {
            c.arg("HOLD").arg(ms);
        }
        c.query(con).unwrap()
    };
    assert_eq!(admit(&mut con, "a", Some(400))[0], 1);
    assert_eq!(admit(&mut con, "b", None)[0], 0, "80 held of 100");
    std::thread::sleep(Duration::from_millis(700));
    assert_eq!(admit(&mut con, "c", None)[..], [1, 0, 0, -1, 20]);
    let err = send_line(
        &mut con,
        &format!("QAG.ADMIT 1 {short} 0 100 RESERVE 101 ID d"),
    )
    .unwrap_err();
    assert!(err.to_string().contains("above a scope's tpm"), "{err}");
    t.assert_healthy();
}

#[test]
fn a_stream_charged_in_parts_sums_exactly_and_a_late_commit_counts_once() {
    let mut t = Target::new();
    let mut con = t.con();
    let key = t.key("stream");
    let tokens = |con: &mut Connection| counted(con, &key, "tok:");
    send_line(
        &mut con,
        &format!("QAG.ADMIT 1 {key} 0 1000 RESERVE 500 ID s1"),
    )
    .unwrap();
    for _ in 0..5 {
        send_line(&mut con, &format!("QAG.RECORD 1 {key} 70 ID s1 PARTIAL")).unwrap();
    }
    assert_eq!(tokens(&mut con), 350);
    let holds: String = cmd("HGET").arg(&key).arg("holds").query(&mut con).unwrap();
    assert!(holds.starts_with("150 "), "{holds}");
    let record: String = cmd("HGET")
        .arg(&key)
        .arg("id:admit:s1")
        .query(&mut con)
        .unwrap();
    assert!(record.contains(" h150,"), "the ADMIT's record: {record}");
    let admission: Vec<i64> = cmd("QAG.ADMIT")
        .arg(1)
        .arg(&key)
        .arg(0)
        .arg(1000)
        .query(&mut con)
        .unwrap();
    assert_eq!(
        admission[4],
        1000 - 350 - 150,
        "remaining counts the hold left"
    );
    // The commit gives the response's whole count: the partials paid 350 of it.
    send_line(&mut con, &format!("QAG.RECORD 1 {key} 380 ID s1")).unwrap();
    send_line(&mut con, &format!("QAG.RECORD 1 {key} 380 ID s1")).unwrap();
    assert_eq!(tokens(&mut con), 380, "the commit counted once");
    // A partial run after the commit (late, or sent again) was in the commit's count.
    let late_partial = send_line(&mut con, &format!("QAG.RECORD 1 {key} 70 ID s1 PARTIAL"));
    assert_eq!(value(&late_partial), value(&Ok(Value::Int(1))));
    assert_eq!(
        tokens(&mut con),
        380,
        "a partial after the commit charges nothing"
    );
    // A partial charge replayed (its reply lost, the driver sending it again) pays early
    // twice; the commit settles the count: the total is the count, 120 here, below what
    // the partials paid.
    let again = t.key("again");
    send_line(
        &mut con,
        &format!("QAG.ADMIT 1 {again} 0 1000 RESERVE 500 ID s3"),
    )
    .unwrap();
    for _ in 0..2 {
        send_line(&mut con, &format!("QAG.RECORD 1 {again} 70 ID s3 PARTIAL")).unwrap();
    }
    send_line(&mut con, &format!("QAG.RECORD 1 {again} 120 ID s3")).unwrap();
    let charged = counted(&mut con, &again, "tok:");
    assert_eq!(charged, 120);
    let holds: Option<String> = cmd("HGET").arg(&key).arg("holds").query(&mut con).unwrap();
    assert_eq!(holds, None, "committed: nothing held");
    let record: String = cmd("HGET")
        .arg(&key)
        .arg("id:admit:s1")
        .query(&mut con)
        .unwrap();
    assert!(
        !record.contains(" h"),
        "closed in the ADMIT's record: {record}"
    );
    // A commit after its hold expired is a plain record, counted once.
    let late = t.key("late");
    send_line(
        &mut con,
        &format!("QAG.ADMIT 1 {late} 0 1000 RESERVE 500 ID s2 HOLD 100"),
    )
    .unwrap();
    std::thread::sleep(Duration::from_millis(200));
    for _ in 0..2 {
        send_line(&mut con, &format!("QAG.RECORD 1 {late} 123 ID s2")).unwrap();
    }
    let charged = counted(&mut con, &late, "tok:");
    assert_eq!(charged, 123);
    t.assert_healthy();
}

#[test]
fn only_a_record_on_the_reservations_own_chain_releases_it() {
    let mut t = Target::new();
    let mut con = t.con();
    let (org, key) = (t.key("org"), t.key("key"));
    let held = |con: &mut Connection, scope: &str| -> Option<String> {
        cmd("HGET").arg(scope).arg("holds").query(con).unwrap()
    };
    send_line(
        &mut con,
        &format!("QAG.ADMIT 2 {org} 0 1000 {key} 0 1000 RESERVE 100 ID x"),
    )
    .unwrap();
    // Another chain (one scope, or the scopes the other way round) releases nothing.
    send_line(&mut con, &format!("QAG.RECORD 1 {key} 10 ID x")).unwrap();
    send_line(&mut con, &format!("QAG.RECORD 2 {key} {org} 10 ID x")).unwrap();
    assert!(held(&mut con, &org).unwrap().starts_with("100 "));
    assert!(held(&mut con, &key).unwrap().starts_with("100 "));
    send_line(&mut con, &format!("QAG.RECORD 2 {org} {key} 10 ID x")).unwrap();
    assert_eq!((held(&mut con, &org), held(&mut con, &key)), (None, None));
    t.assert_healthy();
}

#[test]
fn a_commit_closes_its_reservation_whatever_records_on_other_chains_used_its_id() {
    let mut t = Target::new();
    let mut con = t.con();
    let (k, k2) = (t.key("{c}k"), t.key("{c}k2"));
    let tokens = |con: &mut Connection| (counted(con, &k, "tok:"), counted(con, &k2, "tok:"));
    let run = |con: &mut Connection, line: &str| value(&send_line(con, line));
    let holds = |con: &mut Connection| (held(con, &k), held(con, &k2));
    // The review's case: a plain record on another chain (its first key the ADMIT's),
    // then the commit on the ADMIT's own chain.
    let admit = format!("QAG.ADMIT 2 {k} 0 10000 {k2} 0 10000 RESERVE 300 ID c WINDOW 3600");
    let other = format!("QAG.RECORD 1 {k} 10 ID c WINDOW 3600");
    let commit = format!("QAG.RECORD 2 {k} {k2} 10 ID c WINDOW 3600");
    run(&mut con, &admit);
    assert_eq!(holds(&mut con), (300, 300));
    assert_eq!(run(&mut con, &other), value(&Ok(Value::Int(1))));
    assert_eq!(
        holds(&mut con),
        (300, 300),
        "another chain releases nothing"
    );
    assert_eq!(run(&mut con, &commit), value(&Ok(Value::Int(2))));
    assert_eq!(holds(&mut con), (0, 0), "the commit closed the reservation");
    assert_eq!(tokens(&mut con), (20, 10));
    // Each is replayable on its own: sent again, each answers as it did and changes
    // nothing.
    let before = (state(&mut con, &k), state(&mut con, &k2));
    assert_eq!(run(&mut con, &commit), value(&Ok(Value::Int(2))));
    assert_eq!(run(&mut con, &other), value(&Ok(Value::Int(1))));
    assert_eq!((state(&mut con, &k), state(&mut con, &k2)), before);
    // The other way round: the commit first, then a plain record on another chain,
    // which the commit does not shadow either: it counts once.
    let admit = admit.replace("ID c", "ID d");
    let (other, commit) = (
        other.replace("ID c", "ID d"),
        commit.replace("ID c", "ID d"),
    );
    run(&mut con, &admit);
    assert_eq!(run(&mut con, &commit), value(&Ok(Value::Int(2))));
    assert_eq!(holds(&mut con), (0, 0));
    for _ in 0..2 {
        assert_eq!(run(&mut con, &other), value(&Ok(Value::Int(1))));
        assert_eq!(run(&mut con, &commit), value(&Ok(Value::Int(2))));
    }
    assert_eq!(tokens(&mut con), (40, 20));
    t.assert_healthy();
}

#[test]
fn calls_without_an_id_keep_a_key_for_the_ids_it_remembers() {
    if external("calls_without_an_id_keep_a_key_for_the_ids_it_remembers") {
        return;
    }
    let server = server_with(&["ID-SECONDS", "30"]);
    let mut con = server.client().get_connection().unwrap();
    let ttl = |con: &mut Connection, key: &str| -> i64 { cmd("PTTL").arg(key).query(con).unwrap() };
    // A bucket full again within a second, and a window of a second: without the id,
    // each key would expire within seconds.
    let first = value(&send_line(&mut con, "QAG.TAKE b 10 1 ID x"));
    send_line(&mut con, "QAG.ADMIT 1 w 10 0 WINDOW 1 ID x").unwrap();
    for _ in 0..3 {
        send_line(&mut con, "QAG.TAKE b 10 1").unwrap();
        send_line(&mut con, "QAG.ADMIT 1 w 10 0 WINDOW 1").unwrap();
    }
    assert!(ttl(&mut con, "b") > 25_000, "b: {}", ttl(&mut con, "b"));
    assert!(ttl(&mut con, "w") > 25_000, "w: {}", ttl(&mut con, "w"));
    assert_eq!(value(&send_line(&mut con, "QAG.TAKE b 10 1 ID x")), first);
    // A bucket that never had an id keeps the short life it always had.
    send_line(&mut con, "QAG.TAKE plain 10 1").unwrap();
    assert!(
        ttl(&mut con, "plain") <= 2_100,
        "plain: {}",
        ttl(&mut con, "plain")
    );
    server.shutdown();
}

/// `ID id KEEP seconds`: the id remembered that long (at most ID-SECONDS), and its key
/// kept no longer for it, so a caller that replays only within seconds (the clients'
/// own ids) does not make a hot key remember its ids for minutes (issue 37).
/// A refused reservation holds nothing and remembers nothing: the same request reserves
/// again under its id once tokens are free (issue 34); a refused plain ADMIT is still a
/// remembered refusal.
#[test]
fn a_refused_reservation_forgets_its_id() {
    let t = Target::new();
    let mut con = t.con();
    let w = t.key("w");
    let run = |con: &mut Connection, line: &str| value(&send_line(con, line));
    run(
        &mut con,
        &format!("QAG.ADMIT 1 {w} 0 1000 RESERVE 900 ID a WINDOW 3600"),
    );
    let before = state(&mut con, &w);
    let refused = run(
        &mut con,
        &format!("QAG.ADMIT 1 {w} 0 1000 RESERVE 200 ID b WINDOW 3600"),
    );
    assert!(refused.starts_with("Ok(array([int(0)"), "{refused}");
    assert_eq!(
        state(&mut con, &w),
        before,
        "nothing written, the id neither"
    );
    run(&mut con, &format!("QAG.RECORD 1 {w} 0 ID a WINDOW 3600"));
    let again = run(
        &mut con,
        &format!("QAG.ADMIT 1 {w} 0 1000 RESERVE 200 ID b WINDOW 3600"),
    );
    assert!(
        again.starts_with("Ok(array([int(1)"),
        "reserved on its retry: {again}"
    );
    assert_eq!(held(&mut con, &w), 200);
}

#[test]
fn an_id_with_keep_is_remembered_that_long_and_keeps_its_key_no_longer() {
    if external("an_id_with_keep_is_remembered_that_long_and_keeps_its_key_no_longer") {
        return;
    }
    let server = server_with(&["ID-SECONDS", "30"]);
    let mut con = server.client().get_connection().unwrap();
    let ttl = |con: &mut Connection, key: &str| -> i64 { cmd("PTTL").arg(key).query(con).unwrap() };
    let quota = "QAG.QUOTA.ADD q PER day TZ UTC CALLS 1 ID a KEEP 1";
    let first = value(&send_line(&mut con, quota));
    assert_eq!(
        value(&send_line(&mut con, quota)),
        first,
        "a replay within its KEEP"
    );
    let take = "QAG.TAKE b 10 1 ID a KEEP 1";
    let taken = value(&send_line(&mut con, take));
    assert_eq!(value(&send_line(&mut con, take)), taken);
    // A full bucket of a second's period, kept for its id's second (rounded up to a
    // whole second), not for ID-SECONDS.
    assert!(ttl(&mut con, "b") <= 2_100, "b: {}", ttl(&mut con, "b"));
    std::thread::sleep(std::time::Duration::from_millis(1_100));
    let again = value(&send_line(&mut con, quota));
    assert_ne!(again, first, "forgotten after its KEEP: counted again");
    let usage: Vec<i64> = cmd("QAG.QUOTA.ADD")
        .arg("q")
        .arg("PER")
        .arg("day")
        .arg("TZ")
        .arg("UTC")
        .arg("CALLS")
        .arg(0)
        .query(&mut con)
        .unwrap();
    assert_eq!(usage[0], 2);
    // A KEEP longer than ID-SECONDS is ID-SECONDS.
    send_line(
        &mut con,
        "QAG.QUOTA.ADD q2 PER day TZ UTC CALLS 1 ID a KEEP 86400",
    )
    .unwrap();
    let record: String = cmd("HGET")
        .arg("q2")
        .arg("id:quota.add:a")
        .query(&mut con)
        .unwrap();
    let forget_at: i64 = record.split(' ').next().unwrap().parse().unwrap();
    let (now, _): (i64, i64) = cmd("TIME").query(&mut con).unwrap();
    assert!(forget_at <= (now + 31) * 1000, "{record}");
    // Bad KEEPs are refused and write nothing.
    for bad in ["KEEP 0", "KEEP 86401", "KEEP x", "KEEP"] {
        let line = format!("QAG.TAKE fresh 10 1 ID z {bad}");
        assert!(send_line(&mut con, &line).is_err(), "{line}");
    }
    let exists: i64 = cmd("EXISTS").arg("fresh").query(&mut con).unwrap();
    assert_eq!(exists, 0);
    server.shutdown();
}

#[test]
fn ids_expire_and_never_grow_a_key_without_bound() {
    if external("ids_expire_and_never_grow_a_key_without_bound") {
        return;
    }
    let server = server_with(&["ID-SECONDS", "1", "ID-MAX", "100"]);
    let mut con = server.client().get_connection().unwrap();
    let used = |con: &mut Connection| -> i64 {
        let info: String = cmd("INFO").arg("memory").query(con).unwrap();
        info.lines()
            .find_map(|l| l.strip_prefix("used_memory:"))
            .unwrap()
            .trim()
            .parse()
            .unwrap()
    };
    let baseline = used(&mut con);
    // 100,000 ids over 1,000 buckets of a tenth of a second.
    for round in 0..100 {
        let mut pipe = redis::pipe();
        for k in 0..1000 {
            pipe.cmd("QAG.TAKE")
                .arg(format!("b{k}"))
                .arg(10)
                .arg(0.1)
                .arg("ID")
                .arg(format!("r{round}"))
                .ignore();
        }
        pipe.query::<()>(&mut con).unwrap();
    }
    let hlen: i64 = cmd("HLEN").arg("b0").query(&mut con).unwrap();
    assert!(
        hlen <= 2 + 1 + 100 + 16,
        "about ID-MAX ids a key: {hlen} fields"
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let keys: i64 = cmd("DBSIZE").query(&mut con).unwrap();
        if keys == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "{keys} keys never expired");
        std::thread::sleep(Duration::from_millis(200));
    }
    let after = used(&mut con);
    assert!(
        after < baseline + 200_000,
        "memory back near its baseline: {baseline} then {after}"
    );
    // One busy key, 5,000 ids: the cap holds.
    for i in 0..5000 {
        let _: Vec<i64> = cmd("QAG.TAKE")
            .arg("busy")
            .arg(1_000_000)
            .arg(60)
            .arg("ID")
            .arg(i)
            .query(&mut con)
            .unwrap();
    }
    let hlen: i64 = cmd("HLEN").arg("busy").query(&mut con).unwrap();
    assert!(hlen <= 2 + 1 + 100 + 16, "about ID-MAX ids: {hlen} fields");
    server.shutdown();
}

#[test]
fn forgotten_ids_are_removed_as_keys_go_on_remembering_others() {
    if external("forgotten_ids_are_removed_as_keys_go_on_remembering_others") {
        return;
    }
    // Far below the cap: only the looks a call makes now and then remove forgotten ids.
    let server = server_with(&["ID-SECONDS", "2", "ID-MAX", "100000"]);
    let mut con = server.client().get_connection().unwrap();
    let take_all = |con: &mut Connection, keys: usize, prefix: &str, calls: usize| {
        let mut pipe = redis::pipe();
        for k in 0..keys {
            for i in 0..calls {
                pipe.cmd("QAG.TAKE")
                    .arg(format!("{{b}}{k}"))
                    .arg(1_000_000)
                    .arg(60)
                    .arg("ID")
                    .arg(format!("{prefix}-{k}-{i}"));
            }
        }
        pipe.query::<Vec<Vec<i64>>>(con).unwrap()
    };
    let hlen = |con: &mut Connection, k: usize| -> usize {
        cmd("HLEN").arg(format!("{{b}}{k}")).query(con).unwrap()
    };
    take_all(&mut con, 200, "old", 10);
    std::thread::sleep(Duration::from_millis(2_100));
    let started = Instant::now();
    let first = take_all(&mut con, 200, "new", 64);
    assert!(
        started.elapsed() < Duration::from_millis(1_500),
        "the new ids are all still remembered"
    );
    // About one call in 32 looks while a key has few fields: most of 200 keys have
    // looked in 64 calls (each with about a 78% chance), and kept every new id.
    let looked = (0..200).filter(|&k| hlen(&mut con, k) == 2 + 64).count();
    let untouched = (0..200)
        .filter(|&k| hlen(&mut con, k) == 2 + 10 + 64)
        .count();
    assert!(
        looked >= 100,
        "{looked} of 200 keys removed their forgotten ids"
    );
    assert_eq!(looked + untouched, 200, "nothing but forgotten ids removed");
    assert_eq!(
        take_all(&mut con, 200, "new", 64),
        first,
        "every new id replayed"
    );
    server.shutdown();
}

#[test]
fn a_busy_key_at_its_cap_keeps_its_open_reservations() {
    if external("a_busy_key_at_its_cap_keeps_its_open_reservations") {
        return;
    }
    let server = server_with(&["ID-MAX", "20"]);
    let mut con = server.client().get_connection().unwrap();
    let key = "qag:win:{acme}:org";
    // A long stream's reservation, the oldest id, and one whose partial charges paid
    // more than its hold (nothing held, what was paid remembered for its commit); then
    // a crowd of short requests on the same key: ten times the cap of ids, admitted and
    // committed.
    let reserve = |con: &mut Connection, id: &str| -> Vec<i64> {
        let line = format!("QAG.ADMIT 1 {key} 0 1000000 RESERVE 500 ID {id}");
        redis::FromRedisValue::from_redis_value(send_line(con, &line).unwrap()).unwrap()
    };
    assert_eq!(reserve(&mut con, "stream")[0], 1);
    assert_eq!(reserve(&mut con, "spent")[0], 1);
    for _ in 0..2 {
        send_line(
            &mut con,
            &format!("QAG.RECORD 1 {key} 300 ID spent PARTIAL"),
        )
        .unwrap();
    }
    for i in 0..200 {
        assert_eq!(reserve(&mut con, &format!("r{i}"))[0], 1);
        let _: i64 = cmd("QAG.RECORD")
            .arg(1)
            .arg(key)
            .arg(10)
            .arg("ID")
            .arg(format!("r{i}"))
            .query(&mut con)
            .unwrap();
    }
    let hlen: i64 = cmd("HLEN").arg(key).query(&mut con).unwrap();
    assert!(hlen <= 20 + 16 + 1, "the cap holds: {hlen} fields");
    // The stream's commit still finds its reservation: the hold is released.
    let _: i64 = cmd("QAG.RECORD")
        .arg(1)
        .arg(key)
        .arg(700)
        .arg("ID")
        .arg("stream")
        .query(&mut con)
        .unwrap();
    // The spent one's commit still finds what its partials paid: 700 in all, not 1,300.
    send_line(&mut con, &format!("QAG.RECORD 1 {key} 700 ID spent")).unwrap();
    let holds: Option<String> = cmd("HGET").arg(key).arg("holds").query(&mut con).unwrap();
    assert_eq!(holds, None, "nothing held after every commit");
    assert_eq!(counted(&mut con, key, "tok:"), 200 * 10 + 700 + 700);
    server.shutdown();
}

#[test]
fn what_partials_paid_is_remembered_for_id_seconds_after_the_last() {
    if external("what_partials_paid_is_remembered_for_id_seconds_after_the_last") {
        return;
    }
    let server = server_with(&["ID-SECONDS", "2"]);
    let mut con = server.client().get_connection().unwrap();
    let key = "qag:win:{acme}:stream";
    // A hold of 100 ms (rounded up to a sixteenth of the 10 s window): the reservation's
    // record would be forgotten 2 s after its ADMIT.
    let admit = format!("QAG.ADMIT 1 {key} 0 100000 WINDOW 10 RESERVE 500 ID s HOLD 100");
    send_line(&mut con, &admit).unwrap();
    std::thread::sleep(Duration::from_millis(1200));
    let partial = format!("QAG.RECORD 1 {key} 70 WINDOW 10 ID s PARTIAL");
    send_line(&mut con, &partial).unwrap();
    std::thread::sleep(Duration::from_millis(1200));
    // 2.4 s after the ADMIT, 1.2 s after the partial: its 70 still count towards 200.
    send_line(&mut con, &format!("QAG.RECORD 1 {key} 200 WINDOW 10 ID s")).unwrap();
    assert_eq!(counted(&mut con, key, "tok:"), 200);
    server.shutdown();
}

#[test]
fn a_record_of_nothing_writes_nothing_even_beside_expired_holds() {
    let mut t = Target::new();
    let mut con = t.con();
    let key = t.key("quiet");
    send_line(
        &mut con,
        &format!("QAG.ADMIT 1 {key} 0 1000 WINDOW 10 RESERVE 100 ID q HOLD 100"),
    )
    .unwrap();
    // Past the hold, rounded up to a sixteenth of the window (625 ms).
    std::thread::sleep(Duration::from_millis(900));
    let before = state(&mut con, &key);
    let reply = send_line(&mut con, &format!("QAG.RECORD 1 {key} 0 WINDOW 10"));
    assert_eq!(value(&reply), value(&Ok(Value::Int(1))));
    assert_eq!(
        state(&mut con, &key),
        before,
        "the expired hold stays until a write"
    );
    // A write drops it.
    send_line(&mut con, &format!("QAG.RECORD 1 {key} 5 WINDOW 10")).unwrap();
    let holds: Option<String> = cmd("HGET").arg(&key).arg("holds").query(&mut con).unwrap();
    assert_eq!(holds, None);
    t.assert_healthy();
}

#[test]
fn a_replay_leaves_watch_alone() {
    let mut t = Target::new();
    let mut con = t.con();
    let key = t.key("watched");
    let take = format!("QAG.TAKE {key} 5 60 ID w1");
    send_line(&mut con, &take).unwrap();
    let _: () = cmd("WATCH").arg(&key).query(&mut con).unwrap();
    let mut other = t.con();
    send_line(&mut other, &take).unwrap();
    let done: Value = redis::pipe().atomic().cmd("PING").query(&mut con).unwrap();
    assert_ne!(done, Value::Nil, "EXEC ran: the replay wrote nothing");
    send_line(&mut other, &format!("QAG.TAKE {key} 5 60 ID w2")).unwrap();
    let _: () = cmd("WATCH").arg(&key).query(&mut con).unwrap();
    send_line(&mut other, &format!("QAG.TAKE {key} 5 60 ID w3")).unwrap();
    let aborted: Value = redis::pipe().atomic().cmd("PING").query(&mut con).unwrap();
    assert_eq!(aborted, Value::Nil, "a new id writes: EXEC aborted");
    t.assert_healthy();
}

#[test]
fn bad_ids_are_refused_and_change_nothing() {
    let mut t = Target::new();
    let mut con = t.con();
    let key = t.key("bad");
    let long = "x".repeat(129);
    for words in [
        vec!["QAG.TAKE", &key, "5", "60", "ID", &long],
        vec!["QAG.TAKE", &key, "5", "60", "ID", ""],
        vec!["QAG.TAKE", &key, "5", "60", "ID"],
        vec!["QAG.TAKE", &key, "5", "60", "ID", "a", "ID", "b"],
        vec!["QAG.PEEK", &key, "5", "60", "ID", "a"],
        vec!["QAG.ADMIT", "1", &key, "0", "10", "RESERVE", "5"],
        vec!["QAG.RECORD", "1", &key, "5", "PARTIAL"],
        vec![
            "QAG.QUOTA",
            &key,
            "PER",
            "day",
            "TZ",
            "UTC",
            "CALLS",
            "1",
            "ID",
            "a",
        ],
    ] {
        let err = send(&mut con, &words).unwrap_err();
        assert!(
            err.to_string().contains("ERR") || err.to_string().contains("rror"),
            "{words:?}: {err}"
        );
    }
    let exists: i64 = cmd("EXISTS").arg(&key).query(&mut con).unwrap();
    assert_eq!(exists, 0);
    t.assert_healthy();
}
