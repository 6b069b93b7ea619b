//! Charges that count once, through the crate: a call whose reply is lost on a dropped
//! connection is replayed with its id and counts once (take, the pair, quota add, a
//! reservation, record; also on a replica promoted between the call and the replay),
//! reservations fit exactly and release their holds (a dropped guard at once), a stream
//! charged in parts sums exactly, and a caller's own ids are checked before anything is
//! sent.

#[path = "../../../tests/common/mod.rs"]
mod common;

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use qag_client::{AnsweredBy, Bucket, Error, Limiter, Options, Per, Quota, Recorded, Scope};
use redis::aio::ConnectionManager;

type Hook = Box<dyn FnOnce(&AtomicU16) + Send>;

/// A relay on loopback to a server: it forwards every connection both ways, except
/// that the first command naming `marker` (a command word, e.g. `QAG.TAKE`) runs on
/// the server and its reply is lost: the relay closes both sides of that connection
/// (after `before_closing`, e.g. a failover), as a connection that drops does. Later
/// connections go to `target`, which the hook may move.
struct Relay {
    port: u16,
    dropped: Arc<AtomicUsize>,
    /// Where new connections go.
    target: Arc<AtomicU16>,
}

impl Relay {
    fn new(server: u16, marker: &str, before_closing: Option<Hook>) -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let relay_target = Arc::new(AtomicU16::new(server));
        let dropped = Arc::new(AtomicUsize::new(0));
        let armed = Arc::new(AtomicBool::new(true));
        let hook = Arc::new(Mutex::new(before_closing));
        // RESP spells a command word as a bulk string: `$8\r\nQAG.TAKE\r\n`.
        let marker = format!("${}\r\n{marker}\r\n", marker.len()).into_bytes();
        let relay_dropped = dropped.clone();
        let target = relay_target.clone();
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { return };
                let upstream =
                    TcpStream::connect(("127.0.0.1", relay_target.load(Ordering::SeqCst)));
                let Ok(upstream) = upstream else { continue };
                let (armed, hook, marker) = (armed.clone(), hook.clone(), marker.clone());
                let (target, dropped) = (relay_target.clone(), relay_dropped.clone());
                std::thread::spawn(move || {
                    proxy(client, upstream, &armed, &hook, &marker, &target, &dropped)
                });
            }
        });
        Relay {
            port,
            dropped,
            target,
        }
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }
}

fn proxy(
    mut client: TcpStream,
    mut upstream: TcpStream,
    armed: &AtomicBool,
    hook: &Mutex<Option<Hook>>,
    marker: &[u8],
    target: &AtomicU16,
    dropped: &AtomicUsize,
) {
    let mute = Arc::new(AtomicBool::new(false));
    let (mut from_server, mut to_client) =
        (upstream.try_clone().unwrap(), client.try_clone().unwrap());
    let muted = mute.clone();
    std::thread::spawn(move || {
        let mut buffer = [0u8; 65536];
        while let Ok(n) = from_server.read(&mut buffer) {
            if n == 0 {
                break;
            }
            if !muted.load(Ordering::SeqCst) && to_client.write_all(&buffer[..n]).is_err() {
                break;
            }
        }
    });
    let mut buffer = [0u8; 65536];
    while let Ok(n) = client.read(&mut buffer) {
        if n == 0 {
            break;
        }
        let chunk = &buffer[..n];
        let hit = chunk.windows(marker.len()).any(|w| w == marker);
        if hit && armed.swap(false, Ordering::SeqCst) {
            mute.store(true, Ordering::SeqCst);
            let _ = upstream.write_all(chunk);
            // The server runs it; the reply goes nowhere.
            std::thread::sleep(Duration::from_millis(150));
            if let Some(hook) = hook.lock().unwrap().take() {
                hook(target);
            }
            dropped.fetch_add(1, Ordering::SeqCst);
            let _ = client.shutdown(Shutdown::Both);
            let _ = upstream.shutdown(Shutdown::Both);
            return;
        }
        if upstream.write_all(chunk).is_err() {
            break;
        }
    }
    let _ = upstream.shutdown(Shutdown::Both);
}

/// A limiter on its own ConnectionManager through `url`, with room for a failover.
async fn limiter_at(url: &str, deadline: Duration) -> Limiter<ConnectionManager> {
    let options = Options {
        deadline,
        ..Options::default()
    };
    Limiter::connect(url, options).await.unwrap()
}

/// A bucket's whole tokens.
fn tokens(con: &mut Connection, key: &str) -> i64 {
    bucket_fields(con, key).map_or(-1, |(tokens, _)| tokens.floor() as i64)
}

fn quota() -> Quota {
    Quota {
        per: Per::Day,
        zone: "UTC".into(),
        calls: Some(100),
        rows: None,
    }
}

fn scope(key: &str, tpm: u64) -> Scope {
    Scope {
        key: key.into(),
        rpm: 0,
        tpm,
    }
}

/// One call of each counting family through a relay that loses its reply: the client
/// replays it on a fresh connection. With an id (a caller's for an admission, the
/// limiter's own for spend) it counts once; an admission without one is charged again.
#[tokio::test(flavor = "multi_thread")]
async fn a_call_whose_reply_is_lost_is_replayed_and_counts_once() {
    if external("a_call_whose_reply_is_lost_is_replayed_and_counts_once") {
        return;
    }
    let server = Server::start(&ServerOptions::default());
    let mut con = server.client().get_connection().unwrap();
    let deadline = Duration::from_secs(2);

    let relay = Relay::new(server.port, "QAG.TAKE", None);
    let limiter = limiter_at(&relay.url(), deadline).await;
    let limiter = limiter.with_id("gateway-request-1").unwrap();
    let bucket = Bucket::named("key", 10, 3600.0, "acme~take");
    let decision = limiter.take(&bucket, 1).await.unwrap();
    assert_eq!(
        relay.dropped.load(Ordering::SeqCst),
        1,
        "the reply was lost"
    );
    assert_eq!((decision.allowed, decision.remaining), (true, 9));
    assert_eq!(
        command_calls(&mut con, "qag.take"),
        2,
        "sent, then replayed"
    );
    assert_eq!(
        tokens(&mut con, bucket.key()),
        9,
        "one token taken, not two"
    );

    // Without an id (the default for an admission): replayed, and charged again.
    let relay = Relay::new(server.port, "QAG.TAKE", None);
    let limiter = limiter_at(&relay.url(), deadline).await;
    let bucket = Bucket::named("key", 10, 3600.0, "acme~take-no-id");
    let decision = limiter.take(&bucket, 1).await.unwrap();
    assert_eq!((decision.allowed, decision.remaining), (true, 8));
    assert_eq!(command_calls(&mut con, "qag.take"), 4);
    assert_eq!(
        tokens(&mut con, bucket.key()),
        8,
        "stricter by one, never more"
    );
    // A refund without one is never sent twice: twice would give back twice.
    let relay = Relay::new(server.port, "QAG.REFUND", None);
    let limiter = limiter_at(&relay.url(), deadline).await;
    let refunded = limiter.refund(&bucket, 1).await;
    assert!(
        matches!(refunded, Err(Error::Unavailable(_))),
        "{refunded:?}"
    );
    assert_eq!(command_calls(&mut con, "qag.refund"), 1);
    assert_eq!(tokens(&mut con, bucket.key()), 9, "given back once");

    let relay = Relay::new(server.port, "QAG.TAKE2", None);
    let limiter = limiter_at(&relay.url(), deadline).await;
    let limiter = limiter.with_id("gateway-request-2").unwrap();
    let (client, key) = (
        Bucket::named("client", 10, 3600.0, "203.0.113.9"),
        Bucket::named("key", 10, 3600.0, "acme~pair"),
    );
    let pair = limiter.take_pair(&client, &key, 1).await.unwrap();
    assert_eq!(relay.dropped.load(Ordering::SeqCst), 1);
    assert!(pair.allowed());
    assert_eq!(command_calls(&mut con, "qag.take2"), 2);
    for bucket in [&client, &key] {
        assert_eq!(
            tokens(&mut con, bucket.key()),
            9,
            "{}: one token taken",
            bucket.key()
        );
    }

    // A pair without an id: replayed, both buckets charged again (stricter by one).
    let relay = Relay::new(server.port, "QAG.TAKE2", None);
    let limiter = limiter_at(&relay.url(), deadline).await;
    let (client, key) = (
        Bucket::named("client", 10, 3600.0, "203.0.113.10"),
        Bucket::named("key", 10, 3600.0, "acme~pair-no-id"),
    );
    let pair = limiter.take_pair(&client, &key, 1).await.unwrap();
    assert_eq!(relay.dropped.load(Ordering::SeqCst), 1);
    assert!(pair.allowed());
    assert_eq!(pair.key.map(|key| key.remaining), Some(8));
    assert_eq!(command_calls(&mut con, "qag.take2"), 4);
    for bucket in [&client, &key] {
        assert_eq!(tokens(&mut con, bucket.key()), 8, "{}", bucket.key());
    }

    // An admission without an id (no reservation): replayed, the request counted twice
    // on its window, never admitted beyond its rpm.
    let relay = Relay::new(server.port, "QAG.ADMIT", None);
    let limiter = limiter_at(&relay.url(), deadline).await;
    let window = "qag:win:{acme}:admit-no-id";
    let rpm = Scope {
        key: window.into(),
        rpm: 2,
        tpm: 0,
    };
    let admission = limiter
        .admit(std::slice::from_ref(&rpm), None)
        .await
        .unwrap();
    assert_eq!(relay.dropped.load(Ordering::SeqCst), 1);
    assert!(admission.admitted);
    assert_eq!(admission.requests_remaining, Some(0));
    assert_eq!(counted(&mut con, window, "req:"), 2, "stricter by one");
    let next = limiter.admit(&[rpm], None).await.unwrap();
    assert!(!next.admitted, "never more than the rpm");
    let admits = command_calls(&mut con, "qag.admit");

    let relay = Relay::new(server.port, "QAG.QUOTA.ADD", None);
    let limiter = limiter_at(&relay.url(), deadline).await;
    let usage = limiter
        .quota_add("qag:quota:acme~q", &quota(), 1, 0)
        .await
        .unwrap();
    assert_eq!(relay.dropped.load(Ordering::SeqCst), 1);
    assert_eq!(usage.calls, 1);
    assert_eq!(command_calls(&mut con, "qag.quota.add"), 2);
    let check = limiter
        .quota_check("qag:quota:acme~q", &quota())
        .await
        .unwrap();
    assert_eq!(check.calls_remaining, Some(99), "one call added, not two");

    let relay = Relay::new(server.port, "QAG.ADMIT", None);
    let limiter = limiter_at(&relay.url(), deadline).await;
    let window = "qag:win:{acme}:reserve";
    let reservation = limiter
        .reserve(&[scope(window, 1000)], 100, None, None)
        .await
        .unwrap();
    assert_eq!(relay.dropped.load(Ordering::SeqCst), 1);
    assert!(reservation.admitted());
    assert_eq!(reservation.admission().tokens_remaining, Some(900));
    assert_eq!(command_calls(&mut con, "qag.admit"), admits + 2);
    assert_eq!(counted(&mut con, window, "req:"), 1, "one request admitted");
    assert_eq!(held(&mut con, window), 100, "one hold");

    // The commit of that reservation loses its reply too: charged once, hold released.
    let relay = Relay::new(server.port, "QAG.RECORD", None);
    let limiter = limiter_at(&relay.url(), deadline).await;
    let recorded = limiter
        .record(&["qag:win:{acme}:record"], 70, None)
        .await
        .unwrap();
    assert_eq!(relay.dropped.load(Ordering::SeqCst), 1);
    assert_eq!(recorded.charged, 1);
    assert_eq!(
        counted(&mut con, "qag:win:{acme}:record", "tok:"),
        70,
        "70 once"
    );
    let records = command_calls(&mut con, "qag.record");
    assert_eq!(records, 2);
    let committed = reservation.commit(40).await.unwrap();
    assert_eq!(committed.answered_by, AnsweredBy::Module);
    assert_eq!(
        (held(&mut con, window), counted(&mut con, window, "tok:")),
        (0, 40)
    );
    server.shutdown();
}

/// Without the module the bucket scripts remember the caller's id as the module does:
/// a take, a pair and a refund whose replies are lost are replayed with it and count
/// once, answered by the script.
#[tokio::test(flavor = "multi_thread")]
async fn a_bucket_script_whose_reply_is_lost_is_replayed_and_counts_once() {
    if external("a_bucket_script_whose_reply_is_lost_is_replayed_and_counts_once") {
        return;
    }
    let server = Server::start(&ServerOptions {
        without_module: true,
        ..Default::default()
    });
    let mut con = server.client().get_connection().unwrap();
    // Loaded first: the call whose reply is lost runs (a NOSCRIPT would not have).
    for source in [
        qag_client::TOKEN_BUCKET_LUA,
        qag_client::TOKEN_BUCKET_IDS_LUA,
        qag_client::TOKEN_REFUND_IDS_LUA,
    ] {
        let _: String = cmd("SCRIPT")
            .arg("LOAD")
            .arg(source)
            .query(&mut con)
            .unwrap();
    }
    let (port, deadline) = (server.port, Duration::from_secs(2));
    let through_a_relay = |id: &'static str| async move {
        let relay = Relay::new(port, "EVALSHA", None);
        let limiter = limiter_at(&relay.url(), deadline).await;
        (relay, limiter.with_id(id).unwrap())
    };

    let (relay, limiter) = through_a_relay("gateway-request-1").await;
    let bucket = Bucket::named("key", 10, 3600.0, "acme~take");
    let decision = limiter.take(&bucket, 1).await.unwrap();
    assert_eq!(
        relay.dropped.load(Ordering::SeqCst),
        1,
        "the reply was lost"
    );
    assert_eq!(
        (decision.allowed, decision.remaining, decision.answered_by),
        (true, 9, AnsweredBy::Script)
    );
    assert_eq!(command_calls(&mut con, "evalsha"), 2, "sent, then replayed");
    assert_eq!(
        tokens(&mut con, bucket.key()),
        9,
        "one token taken, not two"
    );

    let (relay, limiter) = through_a_relay("gateway-request-2").await;
    let (client, key) = (
        Bucket::named("client", 10, 3600.0, "203.0.113.9"),
        Bucket::named("key", 10, 3600.0, "acme~pair"),
    );
    let pair = limiter.take_pair(&client, &key, 1).await.unwrap();
    assert_eq!(relay.dropped.load(Ordering::SeqCst), 1);
    assert!(pair.allowed() && pair.client.answered_by == AnsweredBy::Script);
    assert_eq!(
        command_calls(&mut con, "evalsha"),
        4,
        "one call for both buckets"
    );
    for bucket in [&client, &key] {
        assert_eq!(tokens(&mut con, bucket.key()), 9, "{}", bucket.key());
    }

    let direct = limiter_at(&format!("redis://127.0.0.1:{port}/"), deadline).await;
    direct.take(&bucket, 3).await.unwrap();
    let (relay, limiter) = through_a_relay("gateway-request-3").await;
    let refunded = limiter.refund(&bucket, 2).await.unwrap();
    assert_eq!(relay.dropped.load(Ordering::SeqCst), 1);
    assert_eq!(
        (refunded.remaining, refunded.answered_by),
        (8, AnsweredBy::Script)
    );
    assert_eq!(command_calls(&mut con, "evalsha"), 7);
    assert_eq!(tokens(&mut con, bucket.key()), 8, "given back once");
    server.shutdown();
}

/// The replica promoted between the call and its replay answers the replay with what
/// the old primary answered: counted once (a take, and a reservation's commit).
#[tokio::test(flavor = "multi_thread")]
async fn a_replay_on_a_promoted_replica_counts_once() {
    if external("a_replay_on_a_promoted_replica_counts_once") {
        return;
    }
    let deadline = Duration::from_secs(5);
    for marker in ["QAG.TAKE", "QAG.RECORD"] {
        let (primary, replica) = primary_and_linked_replica(false);
        let mut p = primary.client().get_connection().unwrap();
        let mut r = replica.client().get_connection().unwrap();
        let (primary_port, replica_port) = (primary.port, replica.port);
        let promote: Hook = Box::new(move |target: &AtomicU16| {
            let client =
                |port: u16| redis::Client::open(format!("redis://127.0.0.1:{port}/")).unwrap();
            let mut p = client(primary_port).get_connection().unwrap();
            let mut r = client(replica_port).get_connection().unwrap();
            let _: i64 = cmd("WAIT").arg(1).arg(5000).query(&mut p).unwrap();
            let _: () = cmd("REPLICAOF").arg("NO").arg("ONE").query(&mut r).unwrap();
            target.store(replica_port, Ordering::SeqCst);
        });
        let relay = Relay::new(primary.port, marker, Some(promote));
        let limiter = limiter_at(&relay.url(), deadline).await;
        let calls = marker.to_ascii_lowercase();
        if marker == "QAG.TAKE" {
            let bucket = Bucket::named("key", 10, 3600.0, "acme~promoted");
            let limiter = limiter.with_id("gateway-request-3").unwrap();
            let decision = limiter.take(&bucket, 1).await.unwrap();
            assert_eq!((decision.allowed, decision.remaining), (true, 9));
            assert_eq!(
                tokens(&mut r, bucket.key()),
                9,
                "counted once across the failover"
            );
        } else {
            let window = "qag:win:{acme}:promoted";
            let reservation = limiter
                .reserve(&[scope(window, 1000)], 300, None, None)
                .await
                .unwrap();
            assert!(reservation.admitted());
            let committed = reservation.commit(120).await.unwrap();
            assert_eq!(
                committed,
                Recorded {
                    charged: 1,
                    answered_by: AnsweredBy::Module
                }
            );
            assert_eq!(
                (counted(&mut r, window, "tok:"), held(&mut r, window)),
                (120, 0),
                "committed once on the promoted replica, the hold released"
            );
        }
        assert_eq!(
            relay.dropped.load(Ordering::SeqCst),
            1,
            "the reply was lost"
        );
        assert_eq!(
            command_calls(&mut p, &calls),
            1,
            "the call ran on the old primary"
        );
        assert_eq!(
            command_calls(&mut r, &calls),
            1,
            "the replay on the promoted replica"
        );
        replica.shutdown();
        primary.shutdown();
    }
}

/// 64 reservations of 100 at once against a tpm of 1000: exactly 10 hold; after each
/// commits 40, exactly 6 more fit. A guard dropped without commit releases its hold at
/// once (what it charged is what counts), long before the hold would expire.
#[tokio::test(flavor = "multi_thread")]
async fn reservations_fit_exactly_and_a_dropped_guard_releases_its_hold() {
    if external("reservations_fit_exactly_and_a_dropped_guard_releases_its_hold") {
        return;
    }
    let server = Server::start(&ServerOptions {
        // DEBUG SLEEP, for a stalled server.
        extra: vec!["--enable-debug-command".into(), "local".into()],
        ..ServerOptions::default()
    });
    let mut con = server.client().get_connection().unwrap();
    let limiter = limiter_at(
        &format!("redis://127.0.0.1:{}/", server.port),
        Duration::from_secs(5),
    )
    .await;
    let window = "qag:win:{acme}:tpm";
    let scopes = [scope(window, 1000)];
    let tries: Vec<_> = (0..64)
        .map(|_| {
            let (limiter, scopes) = (limiter.clone(), scopes.clone());
            tokio::spawn(async move { limiter.reserve(&scopes, 100, None, None).await.unwrap() })
        })
        .collect();
    let mut held_by = Vec::new();
    for reservation in tries {
        let reservation = reservation.await.unwrap();
        assert_eq!(reservation.answered_by(), AnsweredBy::Module);
        if reservation.admitted() {
            assert_eq!(reservation.reserved(), 100);
            held_by.push(reservation);
        } else {
            assert_eq!(reservation.reserved(), 0);
        }
    }
    assert_eq!(held_by.len(), 10, "10 holds of 100 fill a tpm of 1000");
    assert_eq!(held(&mut con, window), 1000);
    for reservation in held_by {
        assert_eq!(reservation.commit(40).await.unwrap().charged, 1);
    }
    assert_eq!(
        (held(&mut con, window), counted(&mut con, window, "tok:")),
        (0, 400)
    );
    let more: Vec<_> = (0..64)
        .map(|_| {
            let (limiter, scopes) = (limiter.clone(), scopes.clone());
            tokio::spawn(async move { limiter.reserve(&scopes, 100, None, None).await.unwrap() })
        })
        .collect();
    let mut admitted = Vec::new();
    for reservation in more {
        let reservation = reservation.await.unwrap();
        if reservation.admitted() {
            admitted.push(reservation);
        }
    }
    assert_eq!(admitted.len(), 6, "400 committed: six more holds of 100");
    for reservation in admitted {
        reservation.commit(0).await.unwrap();
    }

    // Dropped after charging 30 of a 500 hold (a handler that failed, a cancelled
    // request): back to 0 held and 30 counted within a second, not at the hold's end.
    let dropped = "qag:win:{acme}:dropped";
    let mut reservation = limiter
        .reserve(
            &[scope(dropped, 1000)],
            500,
            None,
            Some(Duration::from_secs(60)),
        )
        .await
        .unwrap();
    assert!(reservation.admitted());
    reservation.charge(30).await.unwrap();
    assert_eq!(held(&mut con, dropped), 470);
    drop(reservation);
    let released = std::time::Instant::now();
    while held(&mut con, dropped) != 0 {
        assert!(
            released.elapsed() < Duration::from_secs(1),
            "the dropped guard's hold outlived it"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(counted(&mut con, dropped, "tok:"), 30);

    // A reserve cancelled after sending (a stalled server, a caller gone): released too.
    let cancelled = "qag:win:{acme}:cancelled";
    let stall = {
        let client = server.client();
        std::thread::spawn(move || {
            let mut con = client.get_connection().unwrap();
            let _: () = cmd("DEBUG").arg("SLEEP").arg(0.5).query(&mut con).unwrap();
        })
    };
    std::thread::sleep(Duration::from_millis(50));
    let cancelled_scopes = [scope(cancelled, 1000)];
    let reserve = limiter.reserve(&cancelled_scopes, 500, None, None);
    assert!(tokio::time::timeout(Duration::from_millis(100), reserve)
        .await
        .is_err());
    stall.join().unwrap();
    let answered = std::time::Instant::now();
    loop {
        let admitted = counted(&mut con, cancelled, "req:");
        if admitted == 1 && held(&mut con, cancelled) == 0 {
            break;
        }
        assert!(
            answered.elapsed() < Duration::from_secs(2),
            "a cancelled reserve left {} held",
            held(&mut con, cancelled)
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    server.shutdown();
}

/// A stream charged in 5 partials, then committed: the window counts the commit's
/// count exactly, and nothing stays held.
#[tokio::test(flavor = "multi_thread")]
async fn a_stream_charged_in_parts_sums_exactly() {
    if external("a_stream_charged_in_parts_sums_exactly") {
        return;
    }
    let server = Server::start(&ServerOptions::default());
    let mut con = server.client().get_connection().unwrap();
    let limiter = limiter_at(
        &format!("redis://127.0.0.1:{}/", server.port),
        Duration::from_secs(5),
    )
    .await;
    let org = "qag:win:{acme}:org";
    let key = "qag:win:{acme}:key";
    let scopes = [scope(org, 100_000), scope(key, 10_000)];
    let mut reservation = limiter.reserve(&scopes, 4000, None, None).await.unwrap();
    assert!(reservation.admitted());
    assert_eq!(reservation.admission().tokens_remaining, Some(6000));
    for part in 1..=5 {
        assert_eq!(reservation.charge(100).await.unwrap().charged, 2);
        assert_eq!(held(&mut con, key), 4000 - 100 * part);
        assert_eq!(counted(&mut con, key, "tok:"), 100 * part);
    }
    assert_eq!(reservation.charged(), 500);
    assert_eq!(reservation.commit(1600).await.unwrap().charged, 2);
    for scope in [org, key] {
        assert_eq!(
            (counted(&mut con, scope, "tok:"), held(&mut con, scope)),
            (1600, 0),
            "{scope}"
        );
    }
    server.shutdown();
}

/// A caller's own id: refused before anything is sent when it is not 1 to 128 bytes;
/// the same id twice on a take counts once (the second is a replay of the first).
#[tokio::test(flavor = "multi_thread")]
async fn caller_ids_are_checked_and_one_id_counts_once() {
    if external("caller_ids_are_checked_and_one_id_counts_once") {
        return;
    }
    let server = Server::start(&ServerOptions::default());
    let mut con = server.client().get_connection().unwrap();
    let limiter = limiter_at(
        &format!("redis://127.0.0.1:{}/", server.port),
        Duration::from_secs(5),
    )
    .await;
    for bad in [String::new(), "x".repeat(129)] {
        match limiter.with_id(&bad) {
            Err(Error::InvalidArgument(why)) => assert!(why.contains("1 to 128 bytes"), "{why}"),
            other => panic!("{bad:?} was taken: {other:?}"),
        }
    }
    let before: String = cmd("INFO").arg("commandstats").query(&mut con).unwrap();
    assert!(!before.contains("cmdstat_qag"), "nothing sent: {before}");
    let bucket = Bucket::named("key", 10, 3600.0, "acme~ids");
    let request = limiter.with_id(&"r".repeat(128)).unwrap();
    assert_eq!(request.request_id(), Some("r".repeat(128).as_str()));
    for _ in 0..2 {
        let decision = request.take(&bucket, 1).await.unwrap();
        assert_eq!((decision.allowed, decision.remaining), (true, 9));
    }
    assert_eq!(tokens(&mut con, bucket.key()), 9, "one id, one token");
    // One id serves every call of a request: the quota add and the record count too.
    let usage = request
        .quota_add("qag:quota:acme~ids", &quota(), 1, 0)
        .await
        .unwrap();
    assert_eq!(usage.calls, 1);
    let recorded = request
        .record(&["qag:win:{acme}:ids"], 10, None)
        .await
        .unwrap();
    assert_eq!(recorded.charged, 1);
    // Without it, each call has its own.
    assert_eq!(limiter.take(&bucket, 1).await.unwrap().remaining, 8);
    assert_eq!(limiter.take(&bucket, 1).await.unwrap().remaining, 7);
    server.shutdown();
}

/// Blocks until `replica` has everything `primary` wrote (their offsets equal).
fn caught_up(primary: &mut Connection, replica: &mut Connection) {
    let offset = |con: &mut Connection, field: &str| -> i64 {
        let info: String = cmd("INFO").arg("replication").query(con).unwrap();
        info.lines()
            .find_map(|line| line.strip_prefix(field)?.trim().parse().ok())
            .unwrap_or(-1)
    };
    let until = std::time::Instant::now() + Duration::from_secs(10);
    while offset(primary, "master_repl_offset:") != offset(replica, "slave_repl_offset:") {
        assert!(
            std::time::Instant::now() < until,
            "the replica never caught up"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Issue 34: a manual failover while 50 callers run, the address (a relay, as a DNS
/// name or a managed endpoint) moved to the new primary: the old primary, demoted,
/// answers READONLY to the calls it held, each is sent once more on a fresh connection
/// and answered there. Every call is answered, each counted once (the tokens taken
/// and the quota's count are what the callers were told). A fifth of the callers take
/// with a wait, on connections of their own, which follow the failover alike.
#[tokio::test(flavor = "multi_thread")]
async fn a_demoted_primary_is_a_failover_not_an_error() {
    if external("a_demoted_primary_is_a_failover_not_an_error") {
        return;
    }
    let (primary, replica) = primary_and_linked_replica(false);
    let relay = Relay::new(primary.port, "NO.SUCH.COMMAND", None);
    let limiter = limiter_at(&relay.url(), Duration::from_secs(3)).await;
    // A refill of 0.01 a second: what the callers were told is what the bucket lost.
    let bucket = Bucket::named("key", 1_000_000, 1e8, "acme~failover");
    let quota = Quota {
        per: Per::Day,
        zone: "UTC".into(),
        calls: Some(1_000_000),
        rows: None,
    };
    let quota_key = "qag:quota:{acme~failover}";
    let running = Arc::new(AtomicBool::new(true));
    let waiting = limiter.with_wait(Duration::from_secs(1)).unwrap();
    let callers: Vec<_> = (0..50)
        .map(|n| {
            let (limiter, bucket, quota, running) = (
                limiter.clone(),
                bucket.clone(),
                quota.clone(),
                running.clone(),
            );
            let taking = if n % 5 == 0 {
                waiting.clone()
            } else {
                limiter.clone()
            };
            tokio::spawn(async move {
                let (mut taken, mut added) = (0u64, 0u64);
                while running.load(Ordering::SeqCst) {
                    let decision = taking.take(&bucket, 1).await.unwrap();
                    assert_eq!(decision.answered_by, AnsweredBy::Module);
                    taken += u64::from(decision.allowed);
                    limiter.quota_add(quota_key, &quota, 1, 0).await.unwrap();
                    added += 1;
                }
                (taken, added)
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut p = primary.client().get_connection().unwrap();
    let mut r = replica.client().get_connection().unwrap();
    // The old primary holds writes while the replica catches up and takes over; then
    // it follows it, and answers the writes it held READONLY.
    let _: () = cmd("CLIENT")
        .arg("PAUSE")
        .arg(5000)
        .arg("WRITE")
        .query(&mut p)
        .unwrap();
    caught_up(&mut p, &mut r);
    let _: () = cmd("REPLICAOF").arg("NO").arg("ONE").query(&mut r).unwrap();
    relay.target.store(replica.port, Ordering::SeqCst);
    let _: () = cmd("REPLICAOF")
        .arg("127.0.0.1")
        .arg(replica.port)
        .query(&mut p)
        .unwrap();
    let _: () = cmd("CLIENT").arg("UNPAUSE").query(&mut p).unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    running.store(false, Ordering::SeqCst);
    let (mut taken, mut added) = (0, 0);
    for caller in callers {
        let (t, a) = caller.await.unwrap();
        taken += t;
        added += a;
    }
    let counts = limiter.counts();
    assert_eq!((counts.errors, counts.local, counts.forwarded), (0, 0, 0));
    let left = bucket_fields(&mut r, bucket.key()).unwrap().0;
    assert_eq!(
        1_000_000 - left.floor() as u64,
        taken,
        "each take counted once"
    );
    let calls: i64 = cmd("QAG.QUOTA")
        .arg(quota_key)
        .arg("PER")
        .arg("day")
        .arg("TZ")
        .arg("UTC")
        .arg("CALLS")
        .arg(1_000_000)
        .query::<Vec<Value>>(&mut r)
        .map(|reply| match reply[1] {
            Value::Int(remaining) => 1_000_000 - remaining,
            _ => -1,
        })
        .unwrap();
    assert_eq!(calls as u64, added, "each add counted once");
    let info: String = cmd("INFO").arg("replication").query(&mut p).unwrap();
    assert!(info.contains("role:slave"), "{info}");
    println!("{taken} takes and {added} adds across the failover");
}
