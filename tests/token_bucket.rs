//! QAG.TAKE, QAG.TAKE2 and QAG.PEEK on a real server: the arithmetic, agreement with
//! the shipped script call by call, atomicity under concurrency, MULTI and Lua.

mod common;

use std::sync::{Arc, Barrier};
use std::time::Duration;

use common::*;

fn take(con: &mut Connection, key: &str, count: u64, period: f64) -> [i64; 3] {
    let v: Vec<i64> = cmd("QAG.TAKE")
        .arg(key)
        .arg(count)
        .arg(period)
        .query(con)
        .unwrap();
    v.try_into().unwrap()
}

fn take_cost(con: &mut Connection, key: &str, count: u64, period: f64, cost: u64) -> [i64; 3] {
    let v: Vec<i64> = cmd("QAG.TAKE")
        .arg(key)
        .arg(count)
        .arg(period)
        .arg("COST")
        .arg(cost)
        .query(con)
        .unwrap();
    v.try_into().unwrap()
}

type PairReply = (Vec<i64>, Option<Vec<i64>>);

fn take2(
    con: &mut Connection,
    client: (&str, u64, f64),
    key: (&str, u64, f64),
    cost: u64,
) -> PairReply {
    cmd("QAG.TAKE2")
        .arg(client.0)
        .arg(client.1)
        .arg(client.2)
        .arg(key.0)
        .arg(key.1)
        .arg(key.2)
        .arg("COST")
        .arg(cost)
        .query(con)
        .unwrap()
}

fn run_script(
    con: &mut Connection,
    sha: &str,
    key: &str,
    count: u64,
    period: f64,
    cost: u64,
) -> Vec<i64> {
    cmd("EVALSHA")
        .arg(sha)
        .arg(1)
        .arg(key)
        .arg(count)
        .arg(period)
        .arg(cost)
        .query(con)
        .unwrap()
}

fn server_now(con: &mut Connection) -> f64 {
    let (s, us): (f64, f64) = cmd("TIME").query(con).unwrap();
    s + us / 1e6
}

#[test]
fn a_burst_of_exactly_count_then_refusal_with_retry() {
    let mut t = Target::new();
    let mut con = t.con();
    let key = t.key("burst");
    for left in (0..10).rev() {
        assert_eq!(take(&mut con, &key, 10, 3600.0), [1, left, 0]);
    }
    // 10 an hour: a token every 360 s; what refilled meanwhile is a sliver of one.
    assert_eq!(take(&mut con, &key, 10, 3600.0), [0, 0, 360]);
    let (tokens, _) = bucket_fields(&mut con, &key).unwrap();
    assert!((0.0..0.01).contains(&tokens), "tokens {tokens}");
    // Expiry: ceil(period) seconds after the first call plus a slack of 3600 / 4 =
    // 900 s, where the later calls, all within that slack, left it.
    let pttl: i64 = cmd("PTTL").arg(&key).query(&mut con).unwrap();
    assert!((4_490_000..=4_500_001).contains(&pttl), "pttl {pttl}");
    t.assert_healthy();
}

#[test]
fn refill_over_real_time() {
    let mut t = Target::new();
    let mut con = t.con();
    let key = t.key("refill");
    for _ in 0..4 {
        assert_eq!(take(&mut con, &key, 4, 1.0)[0], 1);
    }
    assert_eq!(take(&mut con, &key, 4, 1.0)[0], 0);
    let before = bucket_fields(&mut con, &key).unwrap();
    std::thread::sleep(Duration::from_millis(600)); // 4/s: about 2.4 tokens
    let reply = take(&mut con, &key, 4, 1.0);
    let after = bucket_fields(&mut con, &key).unwrap();
    assert!(after.1 - before.1 >= 0.6, "the clock moved on");
    let (expected, state) = expected_take(4.0, 1.0, 1.0, Some(before), after.1);
    assert_eq!(reply, expected);
    assert_eq!(after.0, state.0);
    assert!(reply[0] == 1 && reply[1] >= 1, "refilled: {reply:?}");
    // A full second later the bucket is full again, capped at count.
    std::thread::sleep(Duration::from_millis(1100));
    assert_eq!(take(&mut con, &key, 4, 1.0), [1, 3, 0]);
    t.assert_healthy();
}

#[test]
fn cost_spends_several_tokens_and_a_refusal_spends_none() {
    let mut t = Target::new();
    let mut con = t.con();
    let key = t.key("cost");
    assert_eq!(take_cost(&mut con, &key, 10, 100.0, 3), [1, 7, 0]);
    assert_eq!(take_cost(&mut con, &key, 10, 100.0, 3), [1, 4, 0]);
    assert_eq!(take_cost(&mut con, &key, 10, 100.0, 3), [1, 1, 0]);
    // 0.1 token/s: (3 - 1.0x) / 0.1 is just under 20 s.
    assert_eq!(take_cost(&mut con, &key, 10, 100.0, 3), [0, 1, 20]);
    assert_eq!(take_cost(&mut con, &key, 10, 100.0, 1), [1, 0, 0]);
    t.assert_healthy();
}

#[test]
fn cost_above_count_never_fits() {
    let mut t = Target::new();
    let mut con = t.con();
    let key = t.key("huge-cost");
    assert_eq!(take_cost(&mut con, &key, 5, 60.0, 6), [0, 5, -1]);
    assert_eq!(
        take(&mut con, &key, 5, 60.0),
        [1, 4, 0],
        "the refusal spent nothing"
    );
    // As integers, even where the cost as a double would round down to the count.
    let edge = t.key("edge-cost");
    let count = 1u64 << 53;
    assert_eq!(
        take_cost(&mut con, &edge, count, 1.0, count + 1),
        [0, count as i64, -1]
    );
    assert_eq!(bucket_fields(&mut con, &edge).unwrap().0, count as f64);
    assert_eq!(take_cost(&mut con, &edge, count, 1.0, count), [1, 0, 0]);
    t.assert_healthy();
}

#[test]
fn a_bucket_written_with_a_later_ts_than_the_clock() {
    let mut t = Target::new();
    let mut con = t.con();
    let key = t.key("future");
    // 100 s ahead, within the bucket's period of an hour: trusted.
    let future = server_now(&mut con) + 100.0;
    let _: () = cmd("HSET")
        .arg(&key)
        .arg("tokens")
        .arg(2)
        .arg("ts")
        .arg(future.to_string())
        .query(&mut con)
        .unwrap();
    assert_eq!(take(&mut con, &key, 10, 3600.0), [1, 1, 0]);
    assert_eq!(take(&mut con, &key, 10, 3600.0), [1, 0, 0]);
    // No credit for the time until the stored ts. The retry counts as if refilling from
    // now (a token every 360 s): the real wait is longer by ts - now.
    assert_eq!(take(&mut con, &key, 10, 3600.0), [0, 0, 360]);
    // The key lives until the bucket is full by its own time, an hour after ts (with a
    // slack of up to 900 s), not an hour after now.
    let expiry: i64 = cmd("PEXPIRETIME").arg(&key).query(&mut con).unwrap();
    let full = ((future + 3600.0) * 1000.0).ceil() as i64;
    assert!(
        (full..=full + 900_000).contains(&expiry),
        "expires at {expiry}, full at {full}"
    );
    assert_eq!(
        bucket_fields(&mut con, &key),
        Some((0.0, future)),
        "ts never moves back"
    );
    t.assert_healthy();
}

#[test]
fn a_bucket_stored_more_than_a_period_ahead_reads_as_a_full_one() {
    let mut t = Target::new();
    let mut con = t.con();
    let key = t.key("far");
    let empty_at = |con: &mut Connection, key: &str, ts: f64| {
        let _: () = cmd("HSET")
            .arg(key)
            .arg("tokens")
            .arg(0)
            .arg("ts")
            .arg(ts.to_string())
            .query(con)
            .unwrap();
    };
    // Years ahead (the review's case): refused for years before, full now.
    empty_at(&mut con, &key, 2_000_000_000.0);
    assert_eq!(
        cmd("QAG.PEEK")
            .arg(&key)
            .arg(10)
            .arg(1)
            .query::<Vec<i64>>(&mut con)
            .unwrap(),
        [1, 9, 0]
    );
    assert_eq!(take(&mut con, &key, 10, 1.0), [1, 9, 0]);
    let now = server_now(&mut con);
    let (tokens, ts) = bucket_fields(&mut con, &key).unwrap();
    assert_eq!(tokens, 9.0);
    assert!(ts <= now, "ts {ts} written from the clock, now {now}");
    let pttl: i64 = cmd("PTTL").arg(&key).query(&mut con).unwrap();
    assert!(
        (0..=2_001).contains(&pttl),
        "expires a period from now, and a slack of a second: {pttl} ms"
    );
    // Just past one period (60 s) ahead: fresh; just within it: trusted, no refill.
    let (beyond, within) = (t.key("beyond"), t.key("within"));
    let now = server_now(&mut con);
    empty_at(&mut con, &beyond, now + 61.0);
    empty_at(&mut con, &within, now + 59.0);
    assert_eq!(take(&mut con, &beyond, 10, 60.0), [1, 9, 0]);
    assert_eq!(take(&mut con, &within, 10, 60.0), [0, 0, 6]);
    // TAKE2 reads its buckets the same way.
    let (client, bucket) = (t.key("{p}client"), t.key("{p}key"));
    empty_at(&mut con, &client, 2_000_000_000.0);
    empty_at(&mut con, &bucket, 2_000_000_000.0);
    assert_eq!(
        take2(&mut con, (&client, 10, 1.0), (&bucket, 5, 1.0), 1),
        (vec![1, 9, 0], Some(vec![1, 4, 0]))
    );
    // REFUND too: a missing bucket, full, so nothing is written.
    let refunded = t.key("refunded");
    empty_at(&mut con, &refunded, 2_000_000_000.0);
    let before = snapshot(&mut con, &refunded);
    let left: i64 = cmd("QAG.REFUND")
        .arg(&refunded)
        .arg(&[10, 1, 3])
        .query(&mut con)
        .unwrap();
    assert_eq!(left, 10);
    assert_eq!(snapshot(&mut con, &refunded), before);
    t.assert_healthy();
}

#[test]
fn unreadable_fields_read_as_a_full_bucket() {
    let mut t = Target::new();
    let mut con = t.con();
    for (i, (tokens, ts)) in [("x", "1"), ("1", "nan"), ("inf", "1"), ("", "")]
        .iter()
        .enumerate()
    {
        let key = t.key(&format!("garbage{i}"));
        let _: () = cmd("HSET")
            .arg(&key)
            .arg("tokens")
            .arg(*tokens)
            .arg("ts")
            .arg(*ts)
            .query(&mut con)
            .unwrap();
        assert_eq!(
            take(&mut con, &key, 5, 60.0),
            [1, 4, 0],
            "tokens={tokens} ts={ts}"
        );
    }
    let key = t.key("half");
    let _: () = cmd("HSET")
        .arg(&key)
        .arg("tokens")
        .arg(0)
        .arg("other")
        .arg(1)
        .query(&mut con)
        .unwrap();
    assert_eq!(take(&mut con, &key, 5, 60.0), [1, 4, 0], "no ts: full");
    let other: String = cmd("HGET").arg(&key).arg("other").query(&mut con).unwrap();
    assert_eq!(other, "1", "other fields are left alone");
    t.assert_healthy();
}

/// One key driven alternately by the script and by QAG.TAKE across refill boundaries:
/// each call's reply and the fields it leaves agree with the rule, whoever made it.
#[test]
fn agrees_with_the_script_call_by_call() {
    let mut t = Target::new();
    let mut con = t.con();
    let sha = load_script(&mut con);
    let key = t.key("differential");
    let (count, period) = (5u64, 1.0);
    let mut script_refusals = 0;
    let mut module_refusals = 0;
    for i in 0..48 {
        let cost = if i % 7 == 6 { 2 } else { 1 };
        let before = bucket_fields(&mut con, &key);
        let via_script = i % 2 == 0;
        let reply: Vec<i64> = if via_script {
            run_script(&mut con, &sha, &key, count, period, cost)
        } else {
            cmd("QAG.TAKE")
                .arg(&key)
                .arg(count)
                .arg(period)
                .arg("COST")
                .arg(cost)
                .query(&mut con)
                .unwrap()
        };
        let after = bucket_fields(&mut con, &key).unwrap();
        // The stored ts is max(old ts, now): the call's clock whenever time moved on.
        let (expected, state) = expected_take(count as f64, period, cost as f64, before, after.1);
        let who = if via_script { "script" } else { "QAG.TAKE" };
        assert_eq!(
            reply, expected,
            "call {i} by {who}, before {before:?}, after {after:?}"
        );
        assert_eq!(after, state, "call {i} by {who}: stored fields");
        if reply[0] == 0 {
            if via_script {
                script_refusals += 1
            } else {
                module_refusals += 1
            }
        }
        // The script expires the key ceil(period) after the call; the module from
        // then to its slack later, a second for a period of 1 s (ts is the call's
        // clock here).
        let pexpiretime: i64 = cmd("PEXPIRETIME").arg(&key).query(&mut con).unwrap();
        let full = (after.1 * 1000.0) as i64 + 1000;
        let (earliest, latest) = if via_script {
            (full - 50, full + 50)
        } else {
            (full, full + 1 + 1000)
        };
        assert!(
            (earliest..=latest).contains(&pexpiretime),
            "call {i} by {who}: expiry {pexpiretime} vs {earliest}..={latest}"
        );
        // Bursts of calls with pauses: some refused, some refilled, a few at the cap.
        if i % 6 == 5 {
            std::thread::sleep(Duration::from_millis(150 + 100 * (i % 4) as u64));
        }
    }
    assert!(
        script_refusals > 0 && module_refusals > 0,
        "both refused at times"
    );
    t.assert_healthy();
}

/// QAG.TAKE2 against the script run twice, on the same pair of keys in turn.
#[test]
fn take2_agrees_with_the_script_run_twice() {
    let mut t = Target::new();
    let mut con = t.con();
    let sha = load_script(&mut con);
    let (ckey, kkey) = (t.key("{pair}client"), t.key("{pair}key"));
    let (ccount, cperiod, kcount, kperiod) = (4u64, 1.0, 3u64, 2.0);
    let mut key_refusals = 0;
    let mut client_refusals = 0;
    for i in 0..36 {
        let c_before = bucket_fields(&mut con, &ckey);
        let k_before = bucket_fields(&mut con, &kkey);
        let k_snapshot = snapshot(&mut con, &kkey);
        let (client_reply, key_reply): PairReply = if i % 2 == 0 {
            take2(
                &mut con,
                (&ckey, ccount, cperiod),
                (&kkey, kcount, kperiod),
                1,
            )
        } else {
            let c: Vec<i64> = run_script(&mut con, &sha, &ckey, ccount, cperiod, 1);
            let k = if c[0] == 1 {
                Some(run_script(&mut con, &sha, &kkey, kcount, kperiod, 1))
            } else {
                None
            };
            (c, k)
        };
        let c_after = bucket_fields(&mut con, &ckey).unwrap();
        let (c_expected, c_state) = expected_take(ccount as f64, cperiod, 1.0, c_before, c_after.1);
        assert_eq!(client_reply, c_expected, "call {i}: client bucket");
        assert_eq!(c_after, c_state, "call {i}: client fields");
        match key_reply {
            Some(reply) => {
                assert_eq!(client_reply[0], 1);
                let k_after = bucket_fields(&mut con, &kkey).unwrap();
                let (k_expected, k_state) =
                    expected_take(kcount as f64, kperiod, 1.0, k_before, k_after.1);
                assert_eq!(reply, k_expected, "call {i}: key bucket");
                assert_eq!(k_after, k_state, "call {i}: key fields");
                key_refusals += usize::from(reply[0] == 0);
            }
            None => {
                assert_eq!(
                    client_reply[0], 0,
                    "call {i}: a null key reply only after a refusal"
                );
                assert_eq!(
                    snapshot(&mut con, &kkey),
                    k_snapshot,
                    "call {i}: key bucket untouched"
                );
                client_refusals += 1;
            }
        }
        if i % 8 == 7 {
            std::thread::sleep(Duration::from_millis(400));
        }
    }
    assert!(
        client_refusals > 0 && key_refusals > 0,
        "both buckets refused at times"
    );
    t.assert_healthy();
}

#[test]
fn take2_leaves_the_key_bucket_alone_when_the_client_refuses() {
    let mut t = Target::new();
    let mut con = t.con();
    let (ckey, kkey) = (t.key("{x}c"), t.key("{x}k"));
    let reply = take2(&mut con, (&ckey, 1, 60.0), (&kkey, 5, 60.0), 1);
    assert_eq!(reply, (vec![1, 0, 0], Some(vec![1, 4, 0])));
    let before = snapshot(&mut con, &kkey);
    let reply = take2(&mut con, (&ckey, 1, 60.0), (&kkey, 5, 60.0), 1);
    assert_eq!(reply, (vec![0, 0, 60], None));
    assert_eq!(snapshot(&mut con, &kkey), before);
    // Refused before the key bucket is ever created: no key at all.
    let fresh = t.key("{x}fresh");
    take2(&mut con, (&ckey, 1, 60.0), (&fresh, 5, 60.0), 1);
    let exists: i64 = cmd("EXISTS").arg(&fresh).query(&mut con).unwrap();
    assert_eq!(exists, 0);
    t.assert_healthy();
}

#[test]
fn take2_with_cost_and_with_one_key_twice() {
    let mut t = Target::new();
    let mut con = t.con();
    let (ckey, kkey) = (t.key("{y}c"), t.key("{y}k"));
    let reply = take2(&mut con, (&ckey, 10, 60.0), (&kkey, 5, 60.0), 4);
    assert_eq!(reply, (vec![1, 6, 0], Some(vec![1, 1, 0])));
    // The same key as both buckets: the script run twice on it.
    let same = t.key("{y}same");
    let reply = take2(&mut con, (&same, 5, 60.0), (&same, 5, 60.0), 1);
    assert_eq!(reply, (vec![1, 4, 0], Some(vec![1, 3, 0])));
    t.assert_healthy();
}

#[test]
fn peek_answers_like_take_and_writes_nothing() {
    let mut t = Target::new();
    let mut con = t.con();
    let key = t.key("peek");
    let peek: Vec<i64> = cmd("QAG.PEEK")
        .arg(&key)
        .arg(5)
        .arg(60)
        .query(&mut con)
        .unwrap();
    assert_eq!(peek, vec![1, 4, 0]);
    let exists: i64 = cmd("EXISTS").arg(&key).query(&mut con).unwrap();
    assert_eq!(exists, 0, "no key created");
    for _ in 0..5 {
        take(&mut con, &key, 5, 3600.0);
    }
    let before = snapshot(&mut con, &key);
    let peek: Vec<i64> = cmd("QAG.PEEK")
        .arg(&key)
        .arg(5)
        .arg(3600)
        .query(&mut con)
        .unwrap();
    assert_eq!(peek, vec![0, 0, 720]);
    let peek: Vec<i64> = cmd("QAG.PEEK")
        .arg(&key)
        .arg(5)
        .arg(3600)
        .arg("COST")
        .arg(9)
        .query(&mut con)
        .unwrap();
    assert_eq!(peek, vec![0, 0, -1]);
    assert_eq!(
        snapshot(&mut con, &key),
        before,
        "fields and expiry unchanged"
    );
    t.assert_healthy();
}

/// Many connections race on one bucket of count 5: exactly 5 are admitted.
#[test]
fn racing_connections_admit_exactly_count() {
    let mut t = Target::new();
    let key = t.key("race");
    let threads = 40;
    let barrier = Arc::new(Barrier::new(threads));
    let handles: Vec<_> = (0..threads)
        .map(|_| {
            let barrier = barrier.clone();
            let client = t.client.clone();
            let key = key.clone();
            std::thread::spawn(move || {
                let mut con = client.get_connection().unwrap();
                barrier.wait();
                (0..5)
                    .filter(|_| take(&mut con, &key, 5, 3600.0)[0] == 1)
                    .count()
            })
        })
        .collect();
    let admitted: usize = handles.into_iter().map(|h| h.join().unwrap()).sum();
    assert_eq!(admitted, 5);
    t.assert_healthy();
}

#[test]
fn works_inside_multi_and_lua() {
    let mut t = Target::new();
    let mut con = t.con();
    let key = t.key("multi");
    let replies: (Vec<i64>, Vec<i64>) = redis::pipe()
        .atomic()
        .cmd("QAG.TAKE")
        .arg(&key)
        .arg(2)
        .arg(60)
        .cmd("QAG.TAKE")
        .arg(&key)
        .arg(2)
        .arg(60)
        .query(&mut con)
        .unwrap();
    assert_eq!(replies, (vec![1, 1, 0], vec![1, 0, 0]));
    let lua = "return redis.call('QAG.TAKE', KEYS[1], ARGV[1], ARGV[2])";
    let reply: Vec<i64> = cmd("EVAL")
        .arg(lua)
        .arg(1)
        .arg(&key)
        .arg(2)
        .arg(60)
        .query(&mut con)
        .unwrap();
    assert_eq!(reply, vec![0, 0, 30]);
    let lua = "return redis.pcall('QAG.TAKE', KEYS[1], 0, 60)";
    let err = cmd("EVAL")
        .arg(lua)
        .arg(1)
        .arg(&key)
        .query::<Value>(&mut con)
        .unwrap_err();
    assert!(
        err.to_string().contains("count must be an integer"),
        "{err}"
    );
    t.assert_healthy();
}

#[test]
fn keys_are_declared_for_acl_and_cluster() {
    let mut t = Target::new();
    let mut con = t.con();
    let keys: Vec<String> = cmd("COMMAND")
        .arg("GETKEYS")
        .arg("QAG.TAKE2")
        .arg("c")
        .arg(1)
        .arg(1)
        .arg("k")
        .arg(1)
        .arg(1)
        .arg("COST")
        .arg(1)
        .query(&mut con)
        .unwrap();
    assert_eq!(keys, vec!["c", "k"]);
    // A legacy key range (1 to 4, every third) and no `movablekeys`: a generic cluster
    // client routes TAKE2 from COMMAND alone, without asking COMMAND GETKEYS each call.
    let info: Vec<Vec<Value>> = cmd("COMMAND")
        .arg("INFO")
        .arg("QAG.TAKE2")
        .query(&mut con)
        .unwrap();
    let flags: Vec<String> = redis::from_redis_value(info[0][2].clone()).unwrap();
    assert!(!flags.iter().any(|flag| flag == "movablekeys"), "{flags:?}");
    let range: Vec<i64> = info[0][3..6]
        .iter()
        .map(|value| redis::from_redis_value(value.clone()).unwrap())
        .collect();
    assert_eq!(range, vec![1, 4, 3]);
    let keys: Vec<String> = cmd("COMMAND")
        .arg("GETKEYS")
        .arg("QAG.PEEK")
        .arg("b")
        .arg(1)
        .arg(1)
        .query(&mut con)
        .unwrap();
    assert_eq!(keys, vec!["b"]);
    t.assert_healthy();
}

/// Declared keys make ACL key patterns hold: a user may take only from its own keys.
#[test]
fn acl_key_patterns_hold() {
    let mut t = Target::new();
    let mut admin = t.con();
    let user = format!("qag-test-{}", std::process::id());
    let own = t.key("ratelimit:");
    let _: () = cmd("ACL")
        .arg("SETUSER")
        .arg(&user)
        .arg("on")
        .arg(">secret")
        .arg("resetkeys")
        .arg(format!("~{own}*"))
        .arg("+qag.take")
        .arg("+qag.take2")
        .query(&mut admin)
        .unwrap();
    let mut con = t.con();
    let _: () = cmd("AUTH")
        .arg(&user)
        .arg("secret")
        .query(&mut con)
        .unwrap();
    let reply: Vec<i64> = cmd("QAG.TAKE")
        .arg(format!("{own}a"))
        .arg(5)
        .arg(60)
        .query(&mut con)
        .unwrap();
    assert_eq!(reply, vec![1, 4, 0]);
    let other = t.key("elsewhere");
    for call in [
        cmd("QAG.TAKE").arg(&other).arg(5).arg(60).clone(),
        cmd("QAG.TAKE2")
            .arg(format!("{own}a"))
            .arg(5)
            .arg(60)
            .arg(&other)
            .arg(5)
            .arg(60)
            .clone(),
        cmd("QAG.PEEK")
            .arg(format!("{own}a"))
            .arg(5)
            .arg(60)
            .clone(),
    ] {
        let err = call.query::<Value>(&mut con).unwrap_err();
        assert_eq!(err.code(), Some("NOPERM"), "{err}");
    }
    let exists: i64 = cmd("EXISTS").arg(&other).query(&mut admin).unwrap();
    assert_eq!(exists, 0);
    let _: i64 = cmd("ACL")
        .arg("DELUSER")
        .arg(&user)
        .query(&mut admin)
        .unwrap();
    t.assert_healthy();
}
