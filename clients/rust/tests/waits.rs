//! Waiting instead of a refusal through the crate (`Limiter::with_wait`): waiting calls
//! served in arrival order on connections of their own while every other call goes on
//! unstalled; a wait cut short (its future dropped) leaves nothing charged or held; a
//! lease waiting for a slot; waits beyond `max_waiting` busy; a server without the
//! module answering at once; the bounds.

#[path = "../../../tests/common/mod.rs"]
mod common;

use std::time::{Duration, Instant};

use common::*;
use qag_client::{AnsweredBy, Bucket, Error, Lease, Limiter, Options};
use redis::aio::ConnectionManager;

async fn limiter(server: &Server) -> Limiter<ConnectionManager> {
    let url = format!("redis://127.0.0.1:{}/", server.port);
    Limiter::connect(&url, Options::default()).await.unwrap()
}

fn info(con: &mut Connection, field: &str) -> i64 {
    let text: String = cmd("INFO").arg("qag").query(con).unwrap();
    text.lines()
        .find_map(|line| {
            line.strip_prefix(&format!("qag_{field}:"))?
                .trim()
                .parse()
                .ok()
        })
        .unwrap_or(-1)
}

/// Twenty waiting takes on a drained bucket of 10 a second, each on a connection of its
/// own: served one a tenth of a second after the other, in the order they were made,
/// while plain calls on the shared connection answer at once.
#[tokio::test(flavor = "multi_thread")]
async fn waiting_calls_never_stall_the_shared_connection() {
    if external("waiting_calls_never_stall_the_shared_connection") {
        return;
    }
    let _timed = Cores::shared();
    let server = Server::start(&ServerOptions::default());
    let mut con = server.client().get_connection().unwrap();
    let limiter = limiter(&server).await;
    let bucket = Bucket::with_key("qag:ratelimit:key:10/1:acme~wait", 10, 1.0);
    assert!(limiter.take(&bucket, 10).await.unwrap().allowed);
    let waiting = limiter.with_wait(Duration::from_secs(3)).unwrap();
    let mut calls = Vec::new();
    for n in 0..20 {
        let (waiting, bucket) = (waiting.clone(), bucket.clone());
        calls.push(tokio::spawn(async move { waiting.take(&bucket, 1).await }));
        // Each waiting before the next is made.
        while info(&mut con, "wait_started") < n + 1 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
    // Meanwhile the shared connection answers at once.
    let other = Bucket::with_key("qag:ratelimit:key:100/1:acme~other", 100, 1.0);
    let started = Instant::now();
    for _ in 0..20 {
        assert!(limiter.take(&other, 1).await.unwrap().allowed);
    }
    assert!(
        started.elapsed() < Duration::from_millis(200),
        "{:?}",
        started.elapsed()
    );
    let mut waited = Vec::new();
    for call in calls {
        let decision = call.await.unwrap().unwrap();
        assert!(decision.allowed);
        assert_eq!(decision.answered_by, AnsweredBy::Module);
        waited.push(decision.waited);
    }
    // In order: each waited more than the one before it (made a little later, served a
    // tenth of a second later).
    for pair in waited.windows(2) {
        assert!(pair[1] > pair[0], "{waited:?}");
    }
    assert!(waited[19] > Duration::from_millis(1500), "{waited:?}");
    assert_eq!(limiter.counts().errors, 0);
}

/// A waiting take whose future is dropped (the request cancelled) closes its
/// connection: the server gives back what it was charged, so the token is there for
/// the next caller at its time.
#[tokio::test(flavor = "multi_thread")]
async fn a_wait_cut_short_leaves_nothing_charged() {
    if external("a_wait_cut_short_leaves_nothing_charged") {
        return;
    }
    let server = Server::start(&ServerOptions::default());
    let mut con = server.client().get_connection().unwrap();
    let limiter = limiter(&server).await;
    let bucket = Bucket::with_key("qag:ratelimit:key:1/2:acme~cut", 1, 2.0);
    assert!(limiter.take(&bucket, 1).await.unwrap().allowed);
    let waiting = limiter.with_wait(Duration::from_secs(5)).unwrap();
    let cut = tokio::time::timeout(Duration::from_millis(300), waiting.take(&bucket, 1)).await;
    assert!(cut.is_err(), "cut short before its token's time");
    let deadline = Instant::now() + Duration::from_secs(5);
    while info(&mut con, "wait_given_back") < 1 {
        assert!(Instant::now() < deadline, "never given back");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(info(&mut con, "waiters"), 0);
    let tokens: f64 = cmd("HGET")
        .arg(bucket.key())
        .arg("tokens")
        .query(&mut con)
        .unwrap();
    assert!(tokens > -0.5, "the charge given back: {tokens}");
    // A wait that cannot fit is refused at once, as without it.
    let short = limiter.with_wait(Duration::from_millis(100)).unwrap();
    let started = Instant::now();
    let refused = short.take(&bucket, 1).await.unwrap();
    assert!(!refused.allowed && started.elapsed() < Duration::from_millis(100));
    assert_eq!(refused.waited, Duration::ZERO);
}

/// A lease that finds every slot held waits for one: given the slot a release frees,
/// saying how long it waited; a wait cut short holds nothing.
#[tokio::test(flavor = "multi_thread")]
async fn a_lease_waits_for_a_slot() {
    if external("a_lease_waits_for_a_slot") {
        return;
    }
    let server = Server::start(&ServerOptions::default());
    let mut con = server.client().get_connection().unwrap();
    let limiter = limiter(&server).await;
    let key = "qag:running:acme~wait";
    let Lease::Held(first) = limiter
        .lease(key, 1, Duration::from_secs(30), "first")
        .await
        .unwrap()
    else {
        panic!("a free slot");
    };
    let waiting = limiter.with_wait(Duration::from_secs(5)).unwrap();
    let second = tokio::spawn({
        let waiting = waiting.clone();
        async move {
            waiting
                .lease(key, 1, Duration::from_secs(30), "second")
                .await
        }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    first.release().await.unwrap();
    let Lease::Held(second) = second.await.unwrap().unwrap() else {
        panic!("the freed slot");
    };
    assert!(
        second.waited() >= Duration::from_millis(150),
        "{:?}",
        second.waited()
    );
    // A third waits, and is cut short: it holds nothing.
    let cut = tokio::time::timeout(
        Duration::from_millis(200),
        waiting.lease(key, 1, Duration::from_secs(30), "third"),
    )
    .await;
    assert!(cut.is_err());
    second.release().await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let live: i64 = cmd("QAG.LEASES").arg(key).query(&mut con).unwrap();
    assert_eq!(live, 0, "nothing held by the wait cut short");
}

/// Without the module the script answers, at once, as without a wait; the bounds of
/// a wait are checked before anything is sent.
#[tokio::test(flavor = "multi_thread")]
async fn without_the_module_a_wait_answers_at_once() {
    if external("without_the_module_a_wait_answers_at_once") {
        return;
    }
    let server = Server::start(&ServerOptions {
        without_module: true,
        ..Default::default()
    });
    let limiter = limiter(&server).await;
    let bucket = Bucket::with_key("qag:ratelimit:key:1/60:acme~script", 1, 60.0);
    let waiting = limiter.with_wait(Duration::from_secs(5)).unwrap();
    assert!(waiting.take(&bucket, 1).await.unwrap().allowed);
    let started = Instant::now();
    let refused = waiting.take(&bucket, 1).await.unwrap();
    assert_eq!(
        (refused.allowed, refused.answered_by),
        (false, AnsweredBy::Script)
    );
    assert!(started.elapsed() < Duration::from_millis(200));
    assert!(matches!(
        limiter.with_wait(Duration::from_secs(61)),
        Err(Error::InvalidArgument(_))
    ));
    let own = Limiter::new(
        server
            .client()
            .get_multiplexed_async_connection()
            .await
            .unwrap(),
    );
    assert!(matches!(
        own.with_wait(Duration::from_secs(1)),
        Err(Error::InvalidArgument(_))
    ));
}

/// `max_waiting` bounds the connections a process keeps waiting: with two waiting, a
/// third waiting call finds none free within its deadline and is `Error::Busy` (this
/// process's overload: no back-off), while calls that do not wait go on; once a waiter
/// is answered its connection serves the next.
#[tokio::test(flavor = "multi_thread")]
async fn waits_beyond_max_waiting_are_busy() {
    if external("waits_beyond_max_waiting_are_busy") {
        return;
    }
    let server = Server::start(&ServerOptions::default());
    let mut con = server.client().get_connection().unwrap();
    let url = format!("redis://127.0.0.1:{}/", server.port);
    let options = Options {
        max_waiting: 2,
        ..Options::default()
    };
    let limiter = Limiter::connect(&url, options).await.unwrap();
    let bucket = Bucket::with_key("qag:ratelimit:key:2/2:acme~busy", 2, 2.0);
    assert!(limiter.take(&bucket, 2).await.unwrap().allowed);
    let waiting = limiter.with_wait(Duration::from_secs(5)).unwrap();
    let mut calls = Vec::new();
    for n in 0..2 {
        let (waiting, bucket) = (waiting.clone(), bucket.clone());
        calls.push(tokio::spawn(async move { waiting.take(&bucket, 1).await }));
        while info(&mut con, "wait_started") < n + 1 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
    let started = Instant::now();
    let third = waiting.take(&bucket, 1).await;
    let took = started.elapsed();
    assert!(matches!(third, Err(Error::Busy(_))), "{third:?}");
    // Within its deadline (0.5 s) and not before it: it waited for a connection.
    assert!(
        took >= Duration::from_millis(450) && took < Duration::from_millis(1500),
        "{took:?}"
    );
    assert!(!limiter.backing_off());
    let other = Bucket::with_key("qag:ratelimit:key:100/1:acme~other", 100, 1.0);
    assert!(limiter.take(&other, 1).await.unwrap().allowed);
    for call in calls {
        assert!(call.await.unwrap().unwrap().allowed);
    }
    // Their connections are free again: the next waiting call is sent, and served at
    // its token's time.
    let next = waiting.take(&bucket, 1).await.unwrap();
    assert!(next.allowed, "{next:?}");
}
