//! QAG.QUOTA, QAG.QUOTA.ADD and QAG.QUOTA.SEED on a real server.

mod common;

use std::sync::{Arc, Barrier};

use common::*;
use jiff::{tz::TimeZone, Timestamp, ZonedDateTime};

fn quota(con: &mut Connection, key: &str, options: &[&str]) -> Vec<Option<i64>> {
    let mut c = cmd("QAG.QUOTA");
    c.arg(key).arg("PER").arg("month").arg("TZ").arg("UTC");
    for o in options {
        c.arg(*o);
    }
    c.query(con).unwrap()
}

fn count(con: &mut Connection, command: &str, key: &str, calls: i64, rows: i64) -> [i64; 3] {
    let v: Vec<i64> = cmd(command)
        .arg(key)
        .arg("PER")
        .arg("month")
        .arg("TZ")
        .arg("UTC")
        .arg("CALLS")
        .arg(calls)
        .arg("ROWS")
        .arg(rows)
        .query(con)
        .unwrap();
    v.try_into().unwrap()
}

/// The label and end of the UTC month `ahead` months after the server clock's, computed
/// apart from the module.
fn month_utc(con: &mut Connection, ahead: usize) -> (String, i64) {
    let (s, _): (i64, i64) = cmd("TIME").query(con).unwrap();
    let now = ZonedDateTime::new(Timestamp::from_second(s).unwrap(), TimeZone::UTC);
    let mut first = now.date().first_of_month();
    for _ in 0..ahead {
        first = first.last_of_month().tomorrow().unwrap();
    }
    let end = first.last_of_month().tomorrow().unwrap();
    let label = format!("{:04}-{:02}", first.year(), first.month());
    let end = end.to_zoned_datetime(TimeZone::UTC).unwrap();
    (label, end.timestamp().as_second())
}

/// The end of the current UTC month.
fn end_of_month_utc(con: &mut Connection) -> i64 {
    month_utc(con, 0).1
}

#[test]
fn counts_and_refuses_at_the_limits() {
    let mut t = Target::new();
    let mut con = t.con();
    let key = t.key("quota");
    let resets_at = end_of_month_utc(&mut con);
    assert_eq!(
        quota(&mut con, &key, &["CALLS", "3", "ROWS", "100"]),
        [Some(1), Some(3), Some(100), Some(resets_at)]
    );
    assert_eq!(int_exists(&mut con, &key), 0, "the check writes nothing");
    assert_eq!(
        count(&mut con, "QAG.QUOTA.ADD", &key, 1, 60),
        [1, 60, resets_at]
    );
    assert_eq!(
        quota(&mut con, &key, &["CALLS", "3", "ROWS", "100"]),
        [Some(1), Some(2), Some(40), Some(resets_at)]
    );
    // The call that crosses the row limit still counts in full; the next is refused.
    assert_eq!(
        count(&mut con, "QAG.QUOTA.ADD", &key, 1, 60),
        [2, 120, resets_at]
    );
    assert_eq!(
        quota(&mut con, &key, &["CALLS", "3", "ROWS", "100"]),
        [Some(0), Some(1), Some(0), Some(resets_at)]
    );
    // A check with only a calls limit ignores rows: null remaining for rows.
    assert_eq!(
        quota(&mut con, &key, &["CALLS", "3"]),
        [Some(1), Some(1), None, Some(resets_at)]
    );
    assert_eq!(
        count(&mut con, "QAG.QUOTA.ADD", &key, 1, 0),
        [3, 120, resets_at]
    );
    assert_eq!(
        quota(&mut con, &key, &["CALLS", "3"]),
        [Some(0), Some(0), None, Some(resets_at)]
    );
    assert_eq!(
        quota(&mut con, &key, &["ROWS", "1000"]),
        [Some(1), None, Some(880), Some(resets_at)]
    );
    let fields: Vec<(String, String)> = cmd("HGETALL").arg(&key).query(&mut con).unwrap();
    let label = ZonedDateTime::new(
        Timestamp::from_second(resets_at - 1).unwrap(),
        TimeZone::UTC,
    )
    .strftime("%Y-%m")
    .to_string();
    assert!(fields.contains(&("period".into(), label)), "{fields:?}");
    let pexpiretime: i64 = cmd("PEXPIRETIME").arg(&key).query(&mut con).unwrap();
    assert_eq!(
        pexpiretime,
        (resets_at + 86_400) * 1000,
        "a day after the period ends"
    );
    t.assert_healthy();
}

fn int_exists(con: &mut Connection, key: &str) -> i64 {
    cmd("EXISTS").arg(key).query(con).unwrap()
}

#[test]
fn an_older_period_starts_again_from_zero() {
    let mut t = Target::new();
    let mut con = t.con();
    let key = t.key("stale");
    let _: () = cmd("HSET")
        .arg(&key)
        .arg("period")
        .arg("2025-10")
        .arg("calls")
        .arg(999)
        .arg("rows")
        .arg(5000)
        .query(&mut con)
        .unwrap();
    let resets_at = end_of_month_utc(&mut con);
    assert_eq!(
        quota(&mut con, &key, &["CALLS", "1000"]),
        [Some(1), Some(1000), None, Some(resets_at)]
    );
    assert_eq!(
        count(&mut con, "QAG.QUOTA.ADD", &key, 1, 7),
        [1, 7, resets_at]
    );
    // A day quota on the same kind of hash: its label is a day.
    let day_key = t.key("day");
    let _: () = cmd("HSET")
        .arg(&day_key)
        .arg("period")
        .arg("2025-10-01")
        .arg("calls")
        .arg(5)
        .query(&mut con)
        .unwrap();
    let v: Vec<i64> = cmd("QAG.QUOTA.ADD")
        .arg(&day_key)
        .arg("PER")
        .arg("day")
        .arg("TZ")
        .arg("Europe/Berlin")
        .arg("CALLS")
        .arg(1)
        .query(&mut con)
        .unwrap();
    assert_eq!(v[..2], [1, 0]);
    let label: String = cmd("HGET")
        .arg(&day_key)
        .arg("period")
        .query(&mut con)
        .unwrap();
    assert_eq!(label.len(), 10, "{label}");
    t.assert_healthy();
}

#[test]
fn seed_never_lowers_and_add_after_seed_adds() {
    let mut t = Target::new();
    let mut con = t.con();
    let key = t.key("seed");
    let end = end_of_month_utc(&mut con);
    assert_eq!(count(&mut con, "QAG.QUOTA.ADD", &key, 4, 40), [4, 40, end]);
    assert_eq!(
        count(&mut con, "QAG.QUOTA.SEED", &key, 10, 20),
        [10, 40, end]
    );
    assert_eq!(
        count(&mut con, "QAG.QUOTA.SEED", &key, 10, 20),
        [10, 40, end],
        "seeding twice changes nothing"
    );
    assert_eq!(
        count(&mut con, "QAG.QUOTA.SEED", &key, 2, 2),
        [10, 40, end],
        "a late seed never lowers"
    );
    assert_eq!(count(&mut con, "QAG.QUOTA.ADD", &key, 1, 5), [11, 45, end]);
    let err = cmd("QAG.QUOTA.ADD")
        .arg(&key)
        .arg("PER")
        .arg("month")
        .arg("TZ")
        .arg("UTC")
        .arg("CALLS")
        .arg(i64::MAX)
        .query::<Value>(&mut con)
        .unwrap_err();
    assert!(err.to_string().contains("overflow"), "{err}");
    assert_eq!(
        quota(&mut con, &key, &["CALLS", "100"])[1],
        Some(89),
        "nothing was added"
    );
    t.assert_healthy();
}

/// Connections check then add against a 1,000-call quota: at most 1,000 plus the calls
/// in flight are allowed, and the final count equals the adds made.
#[test]
fn check_then_add_overshoots_by_at_most_the_calls_in_flight() {
    let mut t = Target::new();
    let key = t.key("shared");
    let workers = 8;
    let barrier = Arc::new(Barrier::new(workers));
    let handles: Vec<_> = (0..workers)
        .map(|_| {
            let (client, key, barrier) = (t.client.clone(), key.clone(), barrier.clone());
            std::thread::spawn(move || {
                let mut con = client.get_connection().unwrap();
                barrier.wait();
                let mut adds = 0;
                // Bounded: a worker can be allowed at most 1,000 + 7 times.
                for _ in 0..2_000 {
                    if quota(&mut con, &key, &["CALLS", "1000"])[0] != Some(1) {
                        break;
                    }
                    count(&mut con, "QAG.QUOTA.ADD", &key, 1, 3);
                    adds += 1;
                }
                adds
            })
        })
        .collect();
    let adds: i64 = handles.into_iter().map(|h| h.join().unwrap()).sum();
    assert!(
        (1000..1000 + workers as i64).contains(&adds),
        "{adds} allowed"
    );
    let fields: Vec<i64> = cmd("HMGET")
        .arg(&key)
        .arg("calls")
        .arg("rows")
        .query(&mut t.con())
        .unwrap();
    assert_eq!(
        fields,
        vec![adds, 3 * adds],
        "every add counted exactly once"
    );
    t.assert_healthy();
}

#[test]
fn a_later_period_stored_than_the_clocks_is_kept_and_counted_into() {
    let mut t = Target::new();
    let mut con = t.con();
    let key = t.key("ahead");
    // The key holds next month (a clock stepped back across the month's end).
    let (label, next_end) = month_utc(&mut con, 1);
    let _: () = cmd("HSET")
        .arg(&key)
        .arg("period")
        .arg(&label)
        .arg("calls")
        .arg(5)
        .arg("rows")
        .arg(70)
        .query(&mut con)
        .unwrap();
    assert_eq!(
        quota(&mut con, &key, &["CALLS", "6"]),
        [Some(1), Some(1), None, Some(next_end)]
    );
    assert_eq!(
        count(&mut con, "QAG.QUOTA.ADD", &key, 1, 10),
        [6, 80, next_end]
    );
    assert_eq!(
        count(&mut con, "QAG.QUOTA.SEED", &key, 2, 100),
        [6, 100, next_end]
    );
    let stored: Vec<String> = cmd("HMGET")
        .arg(&key)
        .arg("period")
        .arg("calls")
        .arg("rows")
        .query(&mut con)
        .unwrap();
    assert_eq!(stored, [label.as_str(), "6", "100"]);
    let expiry: i64 = cmd("PEXPIRETIME").arg(&key).query(&mut con).unwrap();
    assert_eq!(expiry, (next_end + 86_400) * 1000);
    t.assert_healthy();
}

#[test]
fn a_period_stored_beyond_the_next_starts_afresh() {
    let mut t = Target::new();
    let mut con = t.con();
    let key = t.key("far");
    // Two months ahead (a clock stepped far forward, or a stray write): not a period
    // the clock can be about to enter. The review's case: a full quota years ahead.
    let (current, current_end) = month_utc(&mut con, 0);
    for ahead in ["2030-06".to_string(), month_utc(&mut con, 2).0] {
        let _: () = cmd("HSET")
            .arg(&key)
            .arg("period")
            .arg(&ahead)
            .arg("calls")
            .arg(100_000)
            .arg("rows")
            .arg(7)
            .query(&mut con)
            .unwrap();
        let _: () = cmd("PEXPIREAT")
            .arg(&key)
            .arg(4_000_000_000_000i64)
            .query(&mut con)
            .unwrap();
        assert_eq!(
            quota(&mut con, &key, &["CALLS", "100000"]),
            [Some(1), Some(100_000), None, Some(current_end)],
            "{ahead}"
        );
        assert_eq!(
            count(&mut con, "QAG.QUOTA.ADD", &key, 1, 10),
            [1, 10, current_end],
            "{ahead}"
        );
        let stored: Vec<String> = cmd("HMGET")
            .arg(&key)
            .arg("period")
            .arg("calls")
            .arg("rows")
            .query(&mut con)
            .unwrap();
        assert_eq!(stored, [current.as_str(), "1", "10"]);
        let expiry: i64 = cmd("PEXPIRETIME").arg(&key).query(&mut con).unwrap();
        assert_eq!(expiry, (current_end + 86_400) * 1000, "{ahead}");
    }
    t.assert_healthy();
}
