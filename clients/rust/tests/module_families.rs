//! Leases, quotas and windows through the crate: the lease guard renews, releases and
//! reports a lost lease; quotas and windows are typed, and answered by the family's
//! script where the backend says so (or the module is missing); a request's buckets and
//! quota check go in one round trip.

#[path = "../../../tests/common/mod.rs"]
mod common;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use qag_client::{
    AnsweredBy, Backend, Bucket, Error, Lease, Limiter, OnUnavailable, Options, Per, Quota,
    Recorded, RetryAfter, Scope,
};
use redis::aio::MultiplexedConnection;

async fn limiter(server: &Server) -> Limiter<MultiplexedConnection> {
    Limiter::new(
        server
            .client()
            .get_multiplexed_async_connection()
            .await
            .expect("connect"),
    )
}

fn exists(con: &mut Connection, key: &str) -> bool {
    cmd("EXISTS").arg(key).query::<i64>(con).unwrap() == 1
}

#[tokio::test(flavor = "multi_thread")]
async fn the_lease_guard_renews_releases_and_reports_a_lost_lease() {
    if external("the_lease_guard_renews_releases_and_reports_a_lost_lease") {
        return;
    }
    let server = Server::start(&ServerOptions::default());
    let mut raw = server.client().get_connection().unwrap();
    let limiter = limiter(&server).await;
    let ttl = Duration::from_millis(600);

    // Held through three TTLs of work, then released.
    let Lease::Held(guard) = limiter.lease("qag:run", 1, ttl, "q1").await.unwrap() else {
        panic!("a free slot was refused");
    };
    let started = Instant::now();
    while started.elapsed() < ttl * 3 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(limiter.leases("qag:run").await.unwrap(), 1);
        assert!(!guard.is_lost());
    }
    match limiter.lease("qag:run", 1, ttl, "q2").await.unwrap() {
        Lease::Refused(refusal) => assert_eq!(
            (refusal.live, refusal.retry_after),
            (1, RetryAfter::Seconds(1))
        ),
        Lease::Held(_) => panic!("a second holder got the only slot"),
    }
    assert_eq!(guard.release().await, Ok(true));
    assert!(
        !exists(&mut raw, "qag:run"),
        "the last release deletes the key"
    );

    // Dropped without release: released in the background, renewals stopped.
    let Lease::Held(guard) = limiter.lease("qag:run", 1, ttl, "q3").await.unwrap() else {
        panic!("a free slot was refused");
    };
    drop(guard);
    let deadline = Instant::now() + Duration::from_secs(1);
    while exists(&mut raw, "qag:run") {
        assert!(
            Instant::now() < deadline,
            "a dropped guard released nothing"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let renewals = command_calls(&mut raw, "qag.renew");
    tokio::time::sleep(ttl).await;
    assert_eq!(
        command_calls(&mut raw, "qag.renew"),
        renewals,
        "no renewal after the drop"
    );

    // Removed behind its back: the next renewal reports it.
    let Lease::Held(mut guard) = limiter.lease("qag:run", 1, ttl, "q4").await.unwrap() else {
        panic!("a free slot was refused");
    };
    let _: i64 = cmd("DEL").arg("qag:run").query(&mut raw).unwrap();
    tokio::time::timeout(ttl, guard.lost())
        .await
        .expect("the loss is reported within a TTL");
    assert!(guard.is_lost());
    assert_eq!(guard.release().await, Ok(false));

    // Arguments the module refuses are refused before anything is sent.
    let bad = limiter.lease("qag:run", 0, ttl, "q").await;
    assert!(
        matches!(bad, Err(Error::InvalidArgument(_))),
        "{:?}",
        bad.err()
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn quotas_and_windows_are_typed() {
    if external("quotas_and_windows_are_typed") {
        return;
    }
    let server = Server::start(&ServerOptions::default());
    let limiter = limiter(&server).await;
    let quota = Quota {
        per: Per::Month,
        zone: "Europe/Berlin".into(),
        calls: Some(2),
        rows: Some(1000),
    };
    let before = limiter.quota_check("qag:q", &quota).await.unwrap();
    assert!(before.allowed);
    assert_eq!(
        (before.calls_remaining, before.rows_remaining),
        (Some(2), Some(1000))
    );
    let usage = limiter.quota_add("qag:q", &quota, 1, 250).await.unwrap();
    assert_eq!(
        (usage.calls, usage.rows, usage.resets_at),
        (1, 250, before.resets_at)
    );
    let seeded = limiter.quota_seed("qag:q", &quota, 2, 100).await.unwrap();
    assert_eq!((seeded.calls, seeded.rows), (2, 250));
    let after = limiter.quota_check("qag:q", &quota).await.unwrap();
    assert!(!after.allowed);
    assert_eq!(after.calls_remaining, Some(0));
    let bad_zone = Quota {
        zone: "Mars/Olympus".into(),
        ..quota.clone()
    };
    assert!(matches!(
        limiter.quota_check("qag:q", &bad_zone).await,
        Err(Error::InvalidArgument(_))
    ));

    let scopes = [
        Scope {
            key: "qag:win:{a}:org".into(),
            rpm: 100,
            tpm: 0,
        },
        Scope {
            key: "qag:win:{a}:key".into(),
            rpm: 1,
            tpm: 1000,
        },
    ];
    let first = limiter.admit(&scopes, None).await.unwrap();
    assert!(first.admitted);
    assert_eq!(
        (first.requests_remaining, first.tokens_remaining),
        (Some(0), Some(1000))
    );
    let second = limiter.admit(&scopes, Some(60)).await.unwrap();
    assert!(!second.admitted);
    assert_eq!(second.refused_by, Some(1));
    assert!(second
        .retry_after
        .seconds()
        .is_some_and(|seconds| seconds >= 1));
    let keys = ["qag:win:{a}:org", "qag:win:{a}:key"];
    assert_eq!(
        limiter.record(&keys, 700, None).await,
        Ok(Recorded {
            charged: 2,
            answered_by: AnsweredBy::Module
        })
    );

    // A client that uses the scripts only counts on the same keys, and says so.
    let script_only = Limiter::with_options(
        server
            .client()
            .get_multiplexed_async_connection()
            .await
            .unwrap(),
        Options {
            backend: Backend::Script,
            ..Options::default()
        },
    );
    assert_eq!(
        script_only.record(&keys, 1, None).await,
        Ok(Recorded {
            charged: 2,
            answered_by: AnsweredBy::Script
        })
    );
    let third = script_only.admit(&scopes, None).await.unwrap();
    assert_eq!(
        (third.admitted, third.refused_by, third.answered_by),
        (false, Some(1), AnsweredBy::Script),
        "the module's request counted by the script"
    );
    let mut raw = server.client().get_connection().unwrap();
    assert_eq!(counted(&mut raw, "qag:win:{a}:key", "tok:"), 701);
    let checked = script_only.quota_check("qag:q", &quota).await.unwrap();
    assert_eq!(
        (
            checked.allowed,
            checked.calls_remaining,
            checked.answered_by
        ),
        (false, Some(0), AnsweredBy::Script)
    );
    let Lease::Held(guard) = script_only
        .lease("qag:run", 1, Duration::from_secs(5), "s1")
        .await
        .unwrap()
    else {
        panic!("a free slot was refused");
    };
    assert_eq!(guard.answered_by(), AnsweredBy::Script);
    assert_eq!(
        limiter.leases("qag:run").await.unwrap(),
        1,
        "the module sees the script's lease"
    );
    assert_eq!(guard.release().await, Ok(true));
}

/// A relay on loopback to a server that keeps what the client wrote, one entry a read.
fn relay(server: u16) -> (u16, Arc<Mutex<Vec<String>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let writes = Arc::new(Mutex::new(Vec::new()));
    let kept = writes.clone();
    std::thread::spawn(move || {
        for client in listener.incoming() {
            let (Ok(mut client), Ok(mut upstream)) =
                (client, TcpStream::connect(("127.0.0.1", server)))
            else {
                return;
            };
            let (mut from_server, mut to_client) =
                (upstream.try_clone().unwrap(), client.try_clone().unwrap());
            std::thread::spawn(move || std::io::copy(&mut from_server, &mut to_client));
            let kept = kept.clone();
            std::thread::spawn(move || {
                let mut buffer = [0u8; 65536];
                while let Ok(n @ 1..) = client.read(&mut buffer) {
                    let text = String::from_utf8_lossy(&buffer[..n]).into_owned();
                    kept.lock().unwrap().push(text);
                    if upstream.write_all(&buffer[..n]).is_err() {
                        break;
                    }
                }
            });
        }
    });
    (port, writes)
}

/// Issue 35: a request's buckets and its quota's check in one round trip; a bucket that
/// refuses still shows the quota, counting nothing; a check that fails on its own
/// leaves the buckets' answer standing; without the module the buckets go by script.
#[tokio::test(flavor = "multi_thread")]
async fn the_buckets_and_the_quota_check_share_a_round_trip() {
    if external("the_buckets_and_the_quota_check_share_a_round_trip") {
        return;
    }
    let server = Server::start(&ServerOptions::default());
    let mut raw = server.client().get_connection().unwrap();
    let (port, writes) = relay(server.port);
    let url = format!("redis://127.0.0.1:{port}/");
    let relayed = Limiter::connect(&url, Options::default()).await.unwrap();
    let client = Bucket::named("client", 1, 3600.0, "203.0.113.9");
    let key = Bucket::named("key", 10, 3600.0, "acme~r");
    let quota = Quota {
        per: Per::Day,
        zone: "UTC".into(),
        calls: Some(5),
        rows: None,
    };
    let take = |client: Option<&Bucket>| {
        let limiter = relayed.clone();
        let (key, quota, client) = (key.clone(), quota.clone(), client.cloned());
        async move {
            let taken =
                limiter.take_with_quota(client.as_ref(), Some(&key), 1, "qag:quota:acme~r", &quota);
            taken.await.unwrap()
        }
    };
    let first = take(Some(&client)).await;
    assert!(first.buckets_allowed());
    assert_eq!(first.quota.as_ref().unwrap().calls_remaining, Some(5));
    // One write: QAG.TAKE2 and QAG.QUOTA together.
    let sent = writes.lock().unwrap().clone();
    let both: Vec<&String> = sent.iter().filter(|w| w.contains("QAG.QUOTA")).collect();
    assert_eq!(both.len(), 1, "{sent:?}");
    assert!(both[0].contains("QAG.TAKE2"), "{sent:?}");
    // The client's bucket refuses: the quota is read all the same, and counts nothing.
    let refused = take(Some(&client)).await;
    assert!(!refused.buckets_allowed());
    assert_eq!(refused.key, None);
    assert_eq!(refused.quota.as_ref().unwrap().calls_remaining, Some(5));
    assert!(!exists(&mut raw, "qag:quota:acme~r"));
    // A quota key of another type: the check's error, the refusal standing.
    cmd("SET")
        .arg("qag:quota:acme~r")
        .arg("x")
        .query::<()>(&mut raw)
        .unwrap();
    let refused = take(Some(&client)).await;
    assert!(!refused.client.unwrap().allowed);
    assert!(
        matches!(refused.quota, Err(Error::Server(_))),
        "{:?}",
        refused.quota
    );
    cmd("DEL")
        .arg("qag:quota:acme~r")
        .query::<()>(&mut raw)
        .unwrap();
    // The key's bucket alone.
    let alone = take(None).await;
    assert_eq!(
        (alone.client, alone.key.map(|key| key.remaining)),
        (None, Some(8))
    );

    // Without the module: the buckets and the check by script.
    let bare = Server::start(&ServerOptions {
        without_module: true,
        ..Default::default()
    });
    let bare_limiter = limiter(&bare).await;
    let taken =
        bare_limiter.take_with_quota(Some(&client), Some(&key), 1, "qag:quota:acme~r", &quota);
    let taken = taken.await.unwrap();
    assert_eq!(taken.client.unwrap().answered_by, AnsweredBy::Script);
    let quota_decision = taken.quota.unwrap();
    assert_eq!(quota_decision.answered_by, AnsweredBy::Script);
    assert_eq!(quota_decision.calls_remaining, Some(5));

    // Redis stopped, under the local policy: both answered in this process.
    let options = Options {
        on_unavailable: OnUnavailable::Local,
        ..Options::default()
    };
    let direct = format!("redis://127.0.0.1:{}/", server.port);
    let local = Limiter::connect(&direct, options).await.unwrap();
    let _stopped = Stopped::new(&server);
    let taken = local.take_with_quota(None, Some(&key), 1, "qag:quota:acme~l", &quota);
    let taken = taken.await.unwrap();
    assert_eq!(taken.key.unwrap().answered_by, AnsweredBy::Local);
    assert_eq!(taken.quota.unwrap().answered_by, AnsweredBy::Local);
}
