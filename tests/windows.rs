//! QAG.ADMIT and QAG.RECORD on a real server.

mod common;

use std::sync::{Arc, Barrier};

use common::*;

/// Admits one request against `scopes` (key, rpm, tpm) with a window of `window` s.
fn admit(con: &mut Connection, scopes: &[(&str, i64, i64)], window: i64) -> [i64; 5] {
    let mut c = cmd("QAG.ADMIT");
    c.arg(scopes.len());
    for (key, rpm, tpm) in scopes {
        c.arg(*key).arg(*rpm).arg(*tpm);
    }
    let v: Vec<i64> = c.arg("WINDOW").arg(window).query(con).unwrap();
    v.try_into().unwrap()
}

fn record(con: &mut Connection, keys: &[&str], tokens: i64, window: i64) -> i64 {
    cmd("QAG.RECORD")
        .arg(keys.len())
        .arg(keys)
        .arg(tokens)
        .arg("WINDOW")
        .arg(window)
        .query(con)
        .unwrap()
}

/// Runs `per_connection` ADMITs on each of `connections` connections at once; returns
/// how many were admitted.
fn race(
    t: &Target,
    connections: usize,
    per_connection: usize,
    scopes: Vec<(String, i64, i64)>,
) -> i64 {
    let barrier = Arc::new(Barrier::new(connections));
    let handles: Vec<_> = (0..connections)
        .map(|_| {
            let (client, barrier, scopes) = (t.client.clone(), barrier.clone(), scopes.clone());
            std::thread::spawn(move || {
                let mut con = client.get_connection().unwrap();
                let scopes: Vec<(&str, i64, i64)> = scopes
                    .iter()
                    .map(|(k, r, t)| (k.as_str(), *r, *t))
                    .collect();
                barrier.wait();
                (0..per_connection)
                    .map(|_| admit(&mut con, &scopes, 3600)[0])
                    .sum::<i64>()
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).sum()
}

#[test]
fn sixty_four_connections_against_rpm_1_admit_exactly_one() {
    let mut t = Target::new();
    let key = t.key("{w}one");
    let admitted = race(&t, 64, 1, vec![(key.clone(), 1, 0)]);
    assert_eq!(admitted, 1);
    assert_eq!(counted(&mut t.con(), &key, "req:"), 1);
    t.assert_healthy();
}

#[test]
fn three_connections_racing_96_requests_against_rpm_5() {
    let mut t = Target::new();
    let key = t.key("{w}five");
    let admitted = race(&t, 3, 32, vec![(key.clone(), 5, 0)]);
    assert_eq!(admitted, 5, "exactly 5 admitted");
    assert_eq!(counted(&mut t.con(), &key, "req:"), 5, "exactly 5 counted");
    t.assert_healthy();
}

#[test]
fn the_keys_cap_wins_and_the_organisation_pays_only_for_what_it_admitted() {
    let mut t = Target::new();
    let (org, team, key) = (t.key("{w}org"), t.key("{w}team"), t.key("{w}key"));
    let chain = vec![
        (org.clone(), 1000, 0),
        (team.clone(), 100, 0),
        (key.clone(), 7, 0),
    ];
    let admitted = race(&t, 4, 20, chain);
    assert_eq!(admitted, 7);
    let mut con = t.con();
    for scope in [&org, &team, &key] {
        assert_eq!(counted(&mut con, scope, "req:"), 7, "{scope}");
    }
    // The key refuses (scope 3); retry_after is the rest of the window.
    let reply = admit(
        &mut con,
        &[(&org, 1000, 0), (&team, 100, 0), (&key, 7, 0)],
        3600,
    );
    assert_eq!(reply[..2], [0, 3]);
    assert!((1..=3600).contains(&reply[2]), "{reply:?}");
    assert_eq!(reply[3], 0, "the least requests remaining: the key's");
    assert_eq!(reply[4], -1, "no scope limits tokens");
    t.assert_healthy();
}

#[test]
fn a_full_token_window_refuses_and_charges_no_request() {
    let mut t = Target::new();
    let mut con = t.con();
    let (org, key) = (t.key("{tpm}org"), t.key("{tpm}key"));
    let chain = [(org.as_str(), 100, 1000), (key.as_str(), 10, 0)];
    assert_eq!(admit(&mut con, &chain, 3600), [1, 0, 0, 9, 1000]);
    assert_eq!(record(&mut con, &[&org, &key], 600, 3600), 2);
    assert_eq!(
        admit(&mut con, &chain, 3600),
        [1, 0, 0, 8, 400],
        "RECORD moved tpm"
    );
    assert_eq!(record(&mut con, &[&org, &key], 400, 3600), 2);
    let before = (
        counted(&mut con, &org, "req:"),
        counted(&mut con, &key, "req:"),
    );
    let reply = admit(&mut con, &chain, 3600);
    assert_eq!(reply[..2], [0, 1], "the organisation's tokens are spent");
    assert_eq!((reply[3], reply[4]), (8, 0));
    let after = (
        counted(&mut con, &org, "req:"),
        counted(&mut con, &key, "req:"),
    );
    assert_eq!(after, before, "a refused request is charged to no scope");
    assert_eq!(
        counted(&mut con, &key, "tok:"),
        1000,
        "RECORD charges every scope named"
    );
    t.assert_healthy();
}

#[test]
fn fields_and_expiry_follow_the_window() {
    let mut t = Target::new();
    let mut con = t.con();
    let key = t.key("fields");
    let _: () = cmd("HSET")
        .arg(&key)
        .arg("req:1")
        .arg(5)
        .arg("tok:1")
        .arg(5)
        .query(&mut con)
        .unwrap();
    assert_eq!(admit(&mut con, &[(&key, 10, 0)], 1), [1, 0, 0, 9, -1]);
    let (s, _): (i64, i64) = cmd("TIME").query(&mut con).unwrap();
    let fields: Vec<(String, i64)> = cmd("HGETALL").arg(&key).query(&mut con).unwrap();
    // WINDOW 1: the window number is the second of the call.
    let window = [s, s - 1]
        .into_iter()
        .find(|w| fields == vec![(format!("req:{w}"), 1)]);
    let window = window.unwrap_or_else(|| panic!("only the call's window's counter: {fields:?}"));
    let pexpiretime: i64 = cmd("PEXPIRETIME").arg(&key).query(&mut con).unwrap();
    assert_eq!(
        pexpiretime,
        (window + 2) * 1000,
        "expires as the next window ends"
    );
    // An old hash whose windows are long gone: counted as nothing, cleaned on write.
    let old = t.key("old");
    let _: () = cmd("HSET")
        .arg(&old)
        .arg(format!("req:{}", window / 60 - 2))
        .arg(99)
        .query(&mut con)
        .unwrap();
    assert_eq!(admit(&mut con, &[(&old, 10, 0)], 60)[0], 1);
    let fields: Vec<String> = cmd("HKEYS").arg(&old).query(&mut con).unwrap();
    assert_eq!(fields.len(), 1, "{fields:?}");
    // A stale field beside the current window's counter goes with the next window's
    // first write (a hash's fields are looked through only then).
    let beside = t.key("beside");
    assert_eq!(admit(&mut con, &[(&beside, 10, 0)], 1)[0], 1);
    let stale = format!("tok:{}", window - 5);
    let _: () = cmd("HSET")
        .arg(&beside)
        .arg(&stale)
        .arg(7)
        .query(&mut con)
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(1100));
    assert_eq!(admit(&mut con, &[(&beside, 10, 0)], 1)[0], 1);
    let fields: Vec<String> = cmd("HKEYS").arg(&beside).query(&mut con).unwrap();
    assert!(
        !fields.is_empty() && fields.iter().all(|f| f.starts_with("req:")),
        "{fields:?}"
    );
    t.assert_healthy();
}

#[test]
fn keys_are_declared_even_between_limits() {
    let mut t = Target::new();
    let mut con = t.con();
    let keys: Vec<String> = cmd("COMMAND")
        .arg(&[
            "GETKEYS",
            "QAG.ADMIT",
            "3",
            "org",
            "1",
            "1",
            "team",
            "1",
            "1",
            "key",
            "1",
            "1",
            "WINDOW",
            "5",
        ])
        .query(&mut con)
        .unwrap();
    assert_eq!(keys, ["org", "team", "key"]);
    let keys: Vec<String> = cmd("COMMAND")
        .arg(&["GETKEYS", "QAG.RECORD", "2", "org", "key", "5"])
        .query(&mut con)
        .unwrap();
    assert_eq!(keys, ["org", "key"]);
    t.assert_healthy();
}

#[test]
fn a_later_windows_counts_keep_their_expiry() {
    let mut t = Target::new();
    let mut con = t.con();
    let key = t.key("ahead");
    let (s, _): (i64, i64) = cmd("TIME").query(&mut con).unwrap();
    // Counts of the next window (a clock stepped back within a window), expiring with it.
    let later = s / 60 + 1;
    let expiry = (later + 2) * 60_000;
    let _: () = cmd("HSET")
        .arg(&key)
        .arg(format!("req:{later}"))
        .arg(3)
        .query(&mut con)
        .unwrap();
    let _: () = cmd("PEXPIREAT")
        .arg(&key)
        .arg(expiry)
        .query(&mut con)
        .unwrap();
    assert_eq!(admit(&mut con, &[(&key, 10, 0)], 60)[0], 1);
    assert_eq!(record(&mut con, &[&key], 7, 60), 1);
    let at: i64 = cmd("PEXPIRETIME").arg(&key).query(&mut con).unwrap();
    assert_eq!(at, expiry, "the expiry never moves back");
    let kept: Option<i64> = cmd("HGET")
        .arg(&key)
        .arg(format!("req:{later}"))
        .query(&mut con)
        .unwrap();
    assert_eq!(kept, Some(3));
    t.assert_healthy();
}

#[test]
fn counts_more_than_a_window_ahead_are_dropped_with_their_expiry() {
    let mut t = Target::new();
    let mut con = t.con();
    let key = t.key("far");
    let (s, _): (i64, i64) = cmd("TIME").query(&mut con).unwrap();
    // Hour windows, so that the clock stays in one for the test. Counts five windows
    // ahead, and an expiry years ahead: no clock behind by under a window wrote them.
    let now = s / 3600;
    let _: () = cmd("HSET")
        .arg(&key)
        .arg(format!("req:{}", now + 5))
        .arg(3)
        .arg(format!("tok:{}", now + 2))
        .arg(4)
        .arg(format!("req:{}", now + 1))
        .arg(5)
        .query(&mut con)
        .unwrap();
    let _: () = cmd("PEXPIREAT")
        .arg(&key)
        .arg(4_000_000_000_000i64)
        .query(&mut con)
        .unwrap();
    assert_eq!(admit(&mut con, &[(&key, 10, 0)], 3600)[0], 1);
    let mut fields: Vec<String> = cmd("HKEYS").arg(&key).query(&mut con).unwrap();
    fields.sort();
    let mut expected = vec![format!("req:{now}"), format!("req:{}", now + 1)];
    expected.sort();
    assert_eq!(
        fields, expected,
        "the next window's counts kept, later ones dropped"
    );
    // An expiry beyond the latest the next window's counts give is brought back to it.
    let at: i64 = cmd("PEXPIRETIME").arg(&key).query(&mut con).unwrap();
    assert_eq!(at, (now + 3) * 3_600_000);
    let other = t.key("far-alone");
    let _: () = cmd("HSET")
        .arg(&other)
        .arg(format!("req:{}", now + 9))
        .arg(1)
        .query(&mut con)
        .unwrap();
    let _: () = cmd("PEXPIREAT")
        .arg(&other)
        .arg(4_000_000_000_000i64)
        .query(&mut con)
        .unwrap();
    assert_eq!(record(&mut con, &[&other], 5, 3600), 1);
    let at: i64 = cmd("PEXPIRETIME").arg(&other).query(&mut con).unwrap();
    assert_eq!(at, (now + 3) * 3_600_000);
    // Windows shorter than ID-SECONDS: the dropped count was the hash's only other
    // field, so it is kept for no id, and the expiry comes back with the first write.
    let short = t.key("far-short");
    let _: () = cmd("HSET")
        .arg(&short)
        .arg("req:99999999999")
        .arg(5)
        .query(&mut con)
        .unwrap();
    let _: () = cmd("PEXPIRE")
        .arg(&short)
        .arg(10_000_000)
        .query(&mut con)
        .unwrap();
    assert_eq!(admit(&mut con, &[(&short, 10, 0)], 2)[0], 1);
    let ttl: i64 = cmd("PTTL").arg(&short).query(&mut con).unwrap();
    assert!((0..=6_000).contains(&ttl), "{ttl}");
    let fields: Vec<String> = cmd("HKEYS").arg(&other).query(&mut con).unwrap();
    assert_eq!(fields, [format!("tok:{now}")]);
    t.assert_healthy();
}

/// The server's clock, in Unix ms.
fn now_millis(con: &mut Connection) -> i64 {
    let (s, us): (i64, i64) = cmd("TIME").query(con).unwrap();
    s * 1000 + us / 1000
}

#[test]
fn holds_ending_after_the_window_after_next_hold_nothing_and_go() {
    let mut t = Target::new();
    let mut con = t.con();
    // The review's case: 9,000 tokens held for a day (a clock stepped far forward, a
    // stray write) against a tpm of 10,000 on one-second windows, a key kept by traffic.
    let key = t.key("held-far");
    let day_ahead = now_millis(&mut con) + 86_400_000;
    let _: () = cmd("HSET")
        .arg(&key)
        .arg("holds")
        .arg(format!("9000 {day_ahead}"))
        .query(&mut con)
        .unwrap();
    let _: () = cmd("PEXPIRE").arg(&key).arg(5000).query(&mut con).unwrap();
    for _ in 0..2 {
        assert_eq!(
            admit(&mut con, &[(&key, 0, 10_000)], 1),
            [1, 0, 0, -1, 10_000]
        );
    }
    let holds: Option<String> = cmd("HGET").arg(&key).arg("holds").query(&mut con).unwrap();
    assert_eq!(holds, None, "removed by the first write");
    let ttl: i64 = cmd("PTTL").arg(&key).query(&mut con).unwrap();
    assert!((0..=3_000).contains(&ttl), "the window's expiry: {ttl}");
    // Hour windows, so that the clock stays in one for the test. A hold made in the next
    // window (by a clock a little ahead) ends at the end of the window after it: trusted
    // to the millisecond, kept with the expiry it needs; one a millisecond later is not.
    let n = now_millis(&mut con) / 3_600_000;
    let latest = (n + 3) * 3_600_000;
    let near = t.key("held-near");
    let _: () = cmd("HSET")
        .arg(&near)
        .arg("holds")
        .arg(format!("300 {latest} 400 {}", latest + 1))
        .query(&mut con)
        .unwrap();
    let _: () = cmd("PEXPIREAT")
        .arg(&near)
        .arg(4_000_000_000_000i64)
        .query(&mut con)
        .unwrap();
    assert_eq!(
        admit(&mut con, &[(&near, 0, 1000)], 3600),
        [1, 0, 0, -1, 700]
    );
    let holds: Option<String> = cmd("HGET").arg(&near).arg("holds").query(&mut con).unwrap();
    assert_eq!(holds, Some(format!("300 {latest}")));
    let at: i64 = cmd("PEXPIRETIME").arg(&near).query(&mut con).unwrap();
    assert_eq!(
        at, latest,
        "the expiry brought back to the trusted hold's end"
    );
    t.assert_healthy();
}

#[test]
fn a_reservation_remembered_far_ahead_holds_nothing_and_keeps_its_id_no_longer() {
    let mut t = Target::new();
    let mut con = t.con();
    let key = t.key("reserved-far");
    let admitted = send_line(
        &mut con,
        &format!("QAG.ADMIT 1 {key} 0 10000 RESERVE 9000 ID x WINDOW 3600"),
    )
    .unwrap();
    assert_eq!(
        admitted,
        Value::Array([1, 0, 0, -1, 1000].map(Value::Int).to_vec())
    );
    // As an ADMIT by a clock a day ahead would have left it: the group and the
    // reservation, and the id's forget time with them, a day ahead.
    let record: String = cmd("HGET")
        .arg(&key)
        .arg("id:admit:x")
        .query(&mut con)
        .unwrap();
    let parts: Vec<&str> = record.split(' ').collect();
    let chain = parts[2].split(',').nth(2).unwrap();
    let day_ahead = now_millis(&mut con) + 86_400_000;
    let _: () = cmd("HSET")
        .arg(&key)
        .arg("holds")
        .arg(format!("9000 {day_ahead}"))
        .arg("id:admit:x")
        .arg(format!(
            "{day_ahead} {} h9000,{day_ahead},{chain},0",
            parts[1]
        ))
        .query(&mut con)
        .unwrap();
    assert_eq!(
        admit(&mut con, &[(&key, 0, 10_000)], 3600),
        [1, 0, 0, -1, 10_000],
        "nothing held"
    );
    let forget_at = |con: &mut Connection| -> i64 {
        let record: String = cmd("HGET").arg(&key).arg("id:admit:x").query(con).unwrap();
        record.split(' ').next().unwrap().parse().unwrap()
    };
    // A partial pays early and releases nothing; the id is kept ID-SECONDS (300 s by
    // default) from then, not a day.
    send_line(
        &mut con,
        &format!("QAG.RECORD 1 {key} 500 WINDOW 3600 ID x PARTIAL"),
    )
    .unwrap();
    let limit = now_millis(&mut con) + 300_000;
    assert!(
        forget_at(&mut con) <= limit,
        "{} > {limit}",
        forget_at(&mut con)
    );
    // The commit charges the rest of its count, once.
    for _ in 0..2 {
        send_line(
            &mut con,
            &format!("QAG.RECORD 1 {key} 1000 WINDOW 3600 ID x"),
        )
        .unwrap();
    }
    assert_eq!(counted(&mut con, &key, "tok:"), 1000);
    let limit = now_millis(&mut con) + 300_000;
    assert!(
        forget_at(&mut con) <= limit,
        "{} > {limit}",
        forget_at(&mut con)
    );
    let ttl: i64 = cmd("PTTL").arg(&key).query(&mut con).unwrap();
    assert!(
        ttl <= 2 * 3_600_000,
        "the window's expiry, not a day's: {ttl}"
    );
    t.assert_healthy();
}
