//! QAG.LEASE, QAG.RENEW, QAG.RELEASE and QAG.LEASES on a real server.

mod common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use common::*;

fn lease(con: &mut Connection, key: &str, max: i64, ttl_ms: i64, id: &str) -> [i64; 3] {
    let v: Vec<i64> = cmd("QAG.LEASE")
        .arg(key)
        .arg(max)
        .arg(ttl_ms)
        .arg(id)
        .query(con)
        .unwrap();
    v.try_into().unwrap()
}

fn int(con: &mut Connection, command: &str, args: &[&str]) -> i64 {
    let mut c = cmd(command);
    for a in args {
        c.arg(*a);
    }
    c.query(con).unwrap()
}

fn scores(con: &mut Connection, key: &str) -> Vec<(String, i64)> {
    cmd("ZRANGE")
        .arg(key)
        .arg(0)
        .arg(-1)
        .arg("WITHSCORES")
        .query(con)
        .unwrap()
}

#[test]
fn the_fourth_of_three_is_refused_until_one_is_released() {
    let mut t = Target::new();
    let mut con = t.con();
    let key = t.key("running");
    assert_eq!(lease(&mut con, &key, 3, 30_000, "q1"), [1, 1, 0]);
    assert_eq!(lease(&mut con, &key, 3, 30_000, "q2"), [1, 2, 0]);
    assert_eq!(lease(&mut con, &key, 3, 30_000, "q3"), [1, 3, 0]);
    let before = snapshot(&mut con, &key);
    assert_eq!(lease(&mut con, &key, 3, 30_000, "q4"), [0, 3, 1]);
    assert_eq!(
        snapshot(&mut con, &key),
        before,
        "a refusal changes nothing"
    );
    assert_eq!(int(&mut con, "QAG.LEASES", &[&key]), 3);
    assert_eq!(int(&mut con, "QAG.RELEASE", &[&key, "q2"]), 1);
    assert_eq!(lease(&mut con, &key, 3, 30_000, "q4"), [1, 3, 0]);
    // Scores are expiry times in ms; the key expires with the latest one.
    let (s, us): (i64, i64) = cmd("TIME").query(&mut con).unwrap();
    let now_ms = s * 1000 + us / 1000;
    let members = scores(&mut con, &key);
    let names: Vec<&str> = members.iter().map(|(m, _)| m.as_str()).collect();
    assert_eq!(names, ["q1", "q3", "q4"]);
    for (member, expiry) in &members {
        assert!(
            (expiry - now_ms - 30_000).abs() < 2_000,
            "{member}: {expiry} vs now {now_ms}"
        );
    }
    let pexpiretime: i64 = int(&mut con, "PEXPIRETIME", &[&key]);
    assert_eq!(pexpiretime, members.iter().map(|(_, e)| *e).max().unwrap());
    t.assert_healthy();
}

#[test]
fn a_crashed_holder_is_reclaimed_by_the_clock() {
    let mut t = Target::new();
    let mut con = t.con();
    let key = t.key("crashed");
    assert_eq!(lease(&mut con, &key, 1, 300, "crashed-request"), [1, 1, 0]);
    assert_eq!(lease(&mut con, &key, 1, 300, "next")[0], 0);
    std::thread::sleep(Duration::from_millis(450));
    // Nothing else happened: the lease ran out by the clock alone.
    assert_eq!(int(&mut con, "QAG.LEASES", &[&key]), 0);
    assert_eq!(
        int(&mut con, "EXISTS", &[&key]),
        0,
        "the idle key expired with its lease"
    );
    assert_eq!(lease(&mut con, &key, 1, 30_000, "next"), [1, 1, 0]);
    // An expired lease among live ones is not counted, and is cleared by the next write.
    assert_eq!(lease(&mut con, &key, 3, 200, "short"), [1, 2, 0]);
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(int(&mut con, "ZCARD", &[&key]), 2);
    assert_eq!(int(&mut con, "QAG.LEASES", &[&key]), 1);
    assert_eq!(lease(&mut con, &key, 3, 30_000, "other"), [1, 2, 0]);
    let names: Vec<String> = scores(&mut con, &key).into_iter().map(|(m, _)| m).collect();
    assert_eq!(names, ["next", "other"]);
    t.assert_healthy();
}

#[test]
fn acquire_and_renew_are_idempotent_release_is_harmless_twice() {
    let mut t = Target::new();
    let mut con = t.con();
    let key = t.key("idem");
    assert_eq!(lease(&mut con, &key, 2, 30_000, "req"), [1, 1, 0]);
    let first = scores(&mut con, &key);
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(
        lease(&mut con, &key, 2, 30_000, "req"),
        [1, 1, 0],
        "a retried LEASE counts once"
    );
    let again = scores(&mut con, &key);
    assert_eq!(again.len(), 1);
    assert!(again[0].1 > first[0].1, "renewed to now + ttl");
    // A full key still renews its own holder.
    assert_eq!(lease(&mut con, &key, 2, 30_000, "other"), [1, 2, 0]);
    assert_eq!(lease(&mut con, &key, 2, 30_000, "req"), [1, 2, 0]);
    assert_eq!(int(&mut con, "QAG.RENEW", &[&key, "req", "60000"]), 1);
    assert_eq!(int(&mut con, "QAG.RENEW", &[&key, "req", "60000"]), 1);
    assert_eq!(int(&mut con, "QAG.LEASES", &[&key]), 2);
    let pexpiretime = int(&mut con, "PEXPIRETIME", &[&key]);
    let latest = scores(&mut con, &key)
        .iter()
        .map(|(_, e)| *e)
        .max()
        .unwrap();
    assert_eq!(pexpiretime, latest);
    assert_eq!(int(&mut con, "QAG.RELEASE", &[&key, "req"]), 1);
    assert_eq!(
        int(&mut con, "QAG.RELEASE", &[&key, "req"]),
        0,
        "releasing twice is harmless"
    );
    assert_eq!(
        int(&mut con, "QAG.RENEW", &[&key, "req", "1000"]),
        0,
        "a released lease is gone"
    );
    assert_eq!(int(&mut con, "QAG.RELEASE", &[&key, "other"]), 1);
    assert_eq!(
        int(&mut con, "EXISTS", &[&key]),
        0,
        "the last release removes the key"
    );
    // Renewing after expiry says the slot was lost.
    assert_eq!(lease(&mut con, &key, 2, 100, "late"), [1, 1, 0]);
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(int(&mut con, "QAG.RENEW", &[&key, "late", "1000"]), 0);
    assert_eq!(int(&mut con, "QAG.RELEASE", &[&key, "late"]), 0);
    t.assert_healthy();
}

/// Connections race for 5 slots, each holding briefly: a sampler never sees more than
/// 5 live leases, and the set is empty at the end.
#[test]
fn racing_holders_never_exceed_max() {
    let mut t = Target::new();
    let key = t.key("race");
    let workers = 16;
    let rounds = 12;
    let done = Arc::new(AtomicBool::new(false));
    let acquired = Arc::new(AtomicUsize::new(0));
    let barrier = Arc::new(Barrier::new(workers + 1));
    let sampler = {
        let (client, key, done, barrier) =
            (t.client.clone(), key.clone(), done.clone(), barrier.clone());
        std::thread::spawn(move || {
            let mut con = client.get_connection().unwrap();
            barrier.wait();
            let (mut samples, mut most) = (0, 0);
            let deadline = Instant::now() + Duration::from_secs(60);
            while !done.load(Ordering::Acquire) && Instant::now() < deadline {
                let live: i64 = cmd("QAG.LEASES").arg(&key).query(&mut con).unwrap();
                let members: i64 = cmd("ZCARD").arg(&key).query(&mut con).unwrap();
                most = most.max(live).max(members);
                samples += 1;
            }
            (samples, most)
        })
    };
    let handles: Vec<_> = (0..workers)
        .map(|w| {
            let (client, key, acquired, barrier) = (
                t.client.clone(),
                key.clone(),
                acquired.clone(),
                barrier.clone(),
            );
            std::thread::spawn(move || {
                let mut con = client.get_connection().unwrap();
                barrier.wait();
                for r in 0..rounds {
                    let id = format!("worker{w}-round{r}");
                    let deadline = Instant::now() + Duration::from_secs(30);
                    loop {
                        let reply = lease(&mut con, &key, 5, 10_000, &id);
                        assert!(reply[1] <= 5, "{reply:?}");
                        if reply[0] == 1 {
                            break;
                        }
                        assert!(Instant::now() < deadline, "never acquired");
                        std::thread::sleep(Duration::from_millis(1));
                    }
                    acquired.fetch_add(1, Ordering::Relaxed);
                    std::thread::sleep(Duration::from_millis(2));
                    let released: i64 = cmd("QAG.RELEASE")
                        .arg(&key)
                        .arg(&id)
                        .query(&mut con)
                        .unwrap();
                    assert_eq!(released, 1);
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    done.store(true, Ordering::Release);
    let (samples, most) = sampler.join().unwrap();
    assert_eq!(acquired.load(Ordering::Relaxed), workers * rounds);
    assert!(samples > 20, "the sampler ran ({samples} samples)");
    assert!(most <= 5, "saw {most} live leases");
    assert_eq!(most, 5, "the slots were contended");
    assert_eq!(int(&mut t.con(), "EXISTS", &[&key]), 0, "empty at the end");
    t.assert_healthy();
}

#[test]
fn a_lease_expiring_beyond_the_longest_ttl_holds_no_slot() {
    let mut t = Target::new();
    let mut con = t.con();
    let key = t.key("stray");
    let (s, us): (i64, i64) = cmd("TIME").query(&mut con).unwrap();
    let now_ms = s * 1000 + us / 1000;
    // A member scored years ahead (a clock stepped far forward, a stray ZADD): no LEASE
    // gives more than 7 days, so it is no live lease, and the next write removes it.
    let _: () = cmd("ZADD")
        .arg(&key)
        .arg(now_ms + 10 * 365 * 86_400_000)
        .arg("stray")
        .query(&mut con)
        .unwrap();
    assert_eq!(int(&mut con, "QAG.LEASES", &[&key]), 0);
    assert_eq!(lease(&mut con, &key, 1, 60_000, "a"), [1, 1, 0]);
    let members: Vec<String> = scores(&mut con, &key).into_iter().map(|(m, _)| m).collect();
    assert_eq!(members, ["a"]);
    // Within 7 days it is a lease like any other.
    let _: () = cmd("ZADD")
        .arg(&key)
        .arg(now_ms + 6 * 86_400_000)
        .arg("long")
        .query(&mut con)
        .unwrap();
    assert_eq!(int(&mut con, "QAG.LEASES", &[&key]), 2);
    assert_eq!(lease(&mut con, &key, 2, 60_000, "b"), [0, 2, 1]);
    t.assert_healthy();
}
