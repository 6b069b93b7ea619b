//! QAG.REFUND: tokens given back to a bucket, refilled to now first and never above its
//! count, against `lua/token_refund.lua` call by call on the same keys.

mod common;

use std::time::Duration;

use common::*;

fn take(con: &mut Connection, key: &str, count: u64, period: f64) -> Vec<i64> {
    cmd("QAG.TAKE")
        .arg(key)
        .arg(count)
        .arg(period)
        .query(con)
        .unwrap()
}

fn refund(con: &mut Connection, key: &str, count: u64, period: f64, n: u64) -> i64 {
    cmd("QAG.REFUND")
        .arg(key)
        .arg(count)
        .arg(period)
        .arg(n)
        .query(con)
        .unwrap()
}

#[test]
fn a_refund_gives_back_exactly_what_it_says() {
    let mut t = Target::new();
    let mut con = t.con();
    let key = t.key("refund");
    // 5 per 10 hours: nothing refills within the test.
    for _ in 0..5 {
        assert_eq!(take(&mut con, &key, 5, 36000.0)[0], 1);
    }
    assert_eq!(take(&mut con, &key, 5, 36000.0)[0], 0);
    assert_eq!(refund(&mut con, &key, 5, 36000.0, 2), 2);
    assert_eq!(take(&mut con, &key, 5, 36000.0)[..2], [1, 1]);
    assert_eq!(take(&mut con, &key, 5, 36000.0)[..2], [1, 0]);
    assert_eq!(take(&mut con, &key, 5, 36000.0)[0], 0);
    // Never above the count.
    assert_eq!(refund(&mut con, &key, 5, 36000.0, 1000), 5);
    let (tokens, _) = bucket_fields(&mut con, &key).unwrap();
    assert_eq!(tokens, 5.0);
    // The expiry follows TAKE's rule: ceil(period) after the first call, then kept
    // within a slack of period / 4 (the calls here are all within it).
    let pttl: i64 = cmd("PTTL").arg(&key).query(&mut con).unwrap();
    assert!((44_990_000..=45_000_001).contains(&pttl), "pttl {pttl}");
    t.assert_healthy();
}

#[test]
fn a_refund_on_a_missing_bucket_writes_nothing() {
    let mut t = Target::new();
    let mut con = t.con();
    let key = t.key("missing");
    assert_eq!(refund(&mut con, &key, 7, 60.0, 3), 7);
    let exists: i64 = cmd("EXISTS").arg(&key).query(&mut con).unwrap();
    assert_eq!(exists, 0);
    let sha: String = cmd("SCRIPT")
        .arg("LOAD")
        .arg(TOKEN_REFUND_LUA)
        .query(&mut con)
        .unwrap();
    let by_script: i64 = cmd("EVALSHA")
        .arg(&sha)
        .arg(1)
        .arg(&key)
        .arg(7)
        .arg(60)
        .arg(3)
        .query(&mut con)
        .unwrap();
    assert_eq!(by_script, 7);
    let exists: i64 = cmd("EXISTS").arg(&key).query(&mut con).unwrap();
    assert_eq!(exists, 0);
    t.assert_healthy();
}

#[test]
fn bad_refunds_are_refused_and_change_nothing() {
    let mut t = Target::new();
    let mut con = t.con();
    let key = t.key("bad");
    take(&mut con, &key, 5, 60.0);
    let before = snapshot(&mut con, &key);
    for (args, error) in [
        (vec!["5", "60", "0"], "n must be an integer from 1"),
        (vec!["5", "60", "-1"], "n must be an integer from 1"),
        (vec!["5", "60", "1.5"], "n must be an integer from 1"),
        (vec!["0", "60", "1"], "count must be an integer from 1"),
        (vec!["5", "0", "1"], "period must be"),
        (vec!["5", "60", "1", "ID"], "wrong number of arguments"),
    ] {
        let mut call = cmd("QAG.REFUND");
        call.arg(&key).arg(&args);
        let answer: redis::RedisResult<i64> = call.query(&mut con);
        let text = answer.unwrap_err().to_string();
        assert!(text.contains(error), "{args:?}: {text}");
    }
    assert_eq!(snapshot(&mut con, &key), before);
    let list = t.key("list");
    let _: () = cmd("RPUSH").arg(&list).arg("x").query(&mut con).unwrap();
    let answer: redis::RedisResult<i64> = cmd("QAG.REFUND")
        .arg(&list)
        .arg(5)
        .arg(60)
        .arg(1)
        .query(&mut con);
    assert_eq!(answer.unwrap_err().code(), Some("WRONGTYPE"));
    t.assert_healthy();
}

/// One key taken from and refunded to, alternately by the module and by the scripts,
/// across refill boundaries: every refund's reply and the fields it leaves agree with
/// the rule, whoever made it.
#[test]
fn agrees_with_the_refund_script_call_by_call() {
    let mut t = Target::new();
    let mut con = t.con();
    let take_sha = load_script(&mut con);
    let refund_sha: String = cmd("SCRIPT")
        .arg("LOAD")
        .arg(TOKEN_REFUND_LUA)
        .query(&mut con)
        .unwrap();
    let key = t.key("differential");
    let (count, period) = (6u64, 2.0);
    for i in 0..40u64 {
        let via_script = i % 2 == 0;
        // Two takes (one of them by the script), then a refund of 1 to 3.
        let _: Vec<i64> = cmd("EVALSHA")
            .arg(&take_sha)
            .arg(1)
            .arg(&key)
            .arg(count)
            .arg(period)
            .arg(2)
            .query(&mut con)
            .unwrap();
        take(&mut con, &key, count, period);
        let n = 1 + i % 3;
        let before = bucket_fields(&mut con, &key);
        let reply: i64 = if via_script {
            cmd("EVALSHA")
                .arg(&refund_sha)
                .arg(1)
                .arg(&key)
                .arg(count)
                .arg(period)
                .arg(n)
                .query(&mut con)
                .unwrap()
        } else {
            refund(&mut con, &key, count, period, n)
        };
        let after = bucket_fields(&mut con, &key).unwrap();
        let (expected, state) = expected_refund(count as f64, period, n as f64, before, after.1);
        let who = if via_script { "script" } else { "QAG.REFUND" };
        assert_eq!(reply, expected, "call {i} by {who}, before {before:?}");
        assert_eq!(Some(after), state, "call {i} by {who}: stored fields");
        if i % 5 == 4 {
            std::thread::sleep(Duration::from_millis(200 + 150 * (i % 3)));
        }
    }
    t.assert_healthy();
}
