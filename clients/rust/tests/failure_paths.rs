//! The failure paths an independent review read against the client's promises (issue
//! 49), each a test that failed before its fix: a cluster limiter before its first slot
//! read (a back-off ended only by the server's answer), waiting calls after a restart
//! (no outage), and no password in any error text.

#[path = "../../../tests/common/mod.rs"]
mod common;
#[path = "support/gateway.rs"]
mod gateway;

use std::net::TcpListener;
use std::time::{Duration, Instant};

use common::fault_proxy::FaultProxy;
use common::*;
use gateway::Gateway;
use qag_client::{AnsweredBy, Bucket, Error, Limiter, OnUnavailable, Options};

const DEADLINE: Duration = Duration::from_millis(200);

fn policy(on_unavailable: OnUnavailable) -> Options {
    Options {
        on_unavailable,
        deadline: DEADLINE,
        ..Options::default()
    }
}

/// A loopback port nothing listens on.
fn closed_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("a free port");
    listener.local_addr().expect("its address").port()
}

/// Takes from a bucket of 5 a minute every 20 ms for `over`: how many were allowed.
async fn allowed_in<C>(limiter: &Limiter<C>, over: Duration) -> usize
where
    C: redis::aio::ConnectionLike + Clone + Send + Sync + 'static,
{
    let bucket = Bucket::with_key("qag:review:five", 5, 60.0);
    let started = Instant::now();
    let mut allowed = 0;
    while started.elapsed() < over {
        if limiter.take(&bucket, 1).await.is_ok_and(|d| d.allowed) {
            allowed += 1;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    allowed
}

/// Review finding 1: before the slot table was read, the probe pinged a node named ""
/// and took its client-side error for an answer, so the back-off ended (and the local
/// counts were cleared) every 0.1 s: 119 allowed of a bucket of 5.
#[tokio::test(flavor = "multi_thread")]
async fn a_cluster_limiter_before_its_slot_table_counts_locally_within_the_limit() {
    let port = closed_port();
    let url = format!("redis://127.0.0.1:{port}/");
    let cluster = Limiter::connect_cluster(&[&url], policy(OnUnavailable::Local)).unwrap();
    let single = Limiter::connect(&url, policy(OnUnavailable::Local))
        .await
        .unwrap();
    let over = Duration::from_secs(2);
    let (cluster_allowed, single_allowed) =
        tokio::join!(allowed_in(&cluster, over), allowed_in(&single, over));
    assert_eq!(single_allowed, 5);
    assert_eq!(cluster_allowed, 5, "the back-off ended without an answer");
    assert!(cluster.backing_off());
}

/// The same under `Raise`, against a server that accepts and never answers: one call
/// pays the deadline, the rest are refused at once by the back-off (10 paid it before).
#[tokio::test(flavor = "multi_thread")]
async fn a_cluster_limiter_before_its_slot_table_pays_one_deadline_per_back_off() {
    let silent = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("redis://{}/", silent.local_addr().unwrap());
    // Accepted, never read.
    let accepted =
        std::thread::spawn(move || silent.incoming().take(64).flatten().collect::<Vec<_>>());
    let cluster = Limiter::connect_cluster(&[&url], policy(OnUnavailable::Raise)).unwrap();
    let bucket = Bucket::with_key("qag:review:silent", 5, 60.0);
    let started = Instant::now();
    let mut slow = 0;
    while started.elapsed() < Duration::from_secs(2) {
        let call = Instant::now();
        let answer = cluster.take(&bucket, 1).await;
        assert!(
            matches!(answer, Err(Error::Timeout | Error::Unavailable(_))),
            "{answer:?}"
        );
        if call.elapsed() >= DEADLINE / 2 {
            slow += 1;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(slow, 1, "calls that waited out the deadline");
    drop(accepted);
}

/// Review finding 5: a waiting call took an idle kept connection that a restart had
/// killed, failed with "broken pipe", and started a back-off (209 calls refused over
/// 2.3 s with 20 idle connections). A dropped connection now drops the node's idle
/// ones and sends once more.
#[tokio::test(flavor = "multi_thread")]
async fn a_restart_is_no_outage_for_waiting_calls() {
    if external("a_restart_is_no_outage_for_waiting_calls") {
        return;
    }
    let mut server = Server::start(&ServerOptions::default());
    let port = server.port;
    let url = format!("redis://127.0.0.1:{port}/");
    let limiter = Limiter::connect(&url, Options::default()).await.unwrap();
    let waiting = limiter.with_wait(Duration::from_secs(1)).unwrap();
    let bucket = Bucket::with_key("qag:review:restart", 1000, 60.0);
    // Twenty waiting calls at once leave twenty idle connections behind.
    let calls = (0..20).map(|_| waiting.take(&bucket, 1));
    for answer in futures_util::future::join_all(calls).await {
        assert!(answer.unwrap().allowed);
    }
    for round in 0..3 {
        server.shutdown();
        server = Server::start(&ServerOptions {
            port: Some(port),
            ..Default::default()
        });
        let plain = limiter.take(&bucket, 1).await.unwrap();
        assert_eq!(plain.answered_by, AnsweredBy::Module, "round {round}");
        let waited = waiting.take(&bucket, 1).await.unwrap();
        assert_eq!(waited.answered_by, AnsweredBy::Module, "round {round}");
        let after = limiter.take(&bucket, 1).await.unwrap();
        assert_eq!(after.answered_by, AnsweredBy::Module, "round {round}");
        assert!(!limiter.backing_off(), "round {round}");
    }
    assert_eq!(limiter.counts().errors, 0);
}

/// Review finding 7: an address that fails to parse was printed whole, password and all.
#[tokio::test(flavor = "multi_thread")]
async fn no_error_text_carries_a_password() {
    let urls = [
        "redis://:hunter2@127.0.0.1:notaport/",
        "redis://alice:hunter2@127.0.0.1:notaport/0",
        "rediss://hunter2@[::1:6379/",
    ];
    for url in urls {
        let single = Limiter::connect(url, Options::default()).await;
        let cluster =
            Limiter::connect_cluster(&["redis://127.0.0.1:7000", url], Options::default());
        for error in [single.err(), cluster.err()] {
            let error = error.unwrap_or_else(|| panic!("{url} was taken"));
            assert!(matches!(error, Error::InvalidArgument(_)), "{error:?}");
            for printed in [error.to_string(), format!("{error:?}")] {
                assert!(!printed.contains("hunter2"), "{printed}");
                assert!(printed.contains("***"), "{printed}");
            }
        }
    }
}

/// Suspected in the review, confirmed: the quota add at the response's start shares the
/// request's one deadline with the admission's calls, so through a relay that adds
/// 150 ms a round trip (a bucket, the quota check and the slot spend 450 ms of 500) the
/// add had 50 ms, missed it though Redis counted it, and its timeout started a
/// back-off: the next five requests answered 503 on a healthy, slow Redis. A call its
/// request's time cut short is no outage now (the add is logged as failed; sending it
/// apart from the request, until answered, is issue 45's).
#[tokio::test(flavor = "multi_thread")]
async fn a_slow_redis_is_no_outage_for_the_quota_add() {
    let server = Server::start(&ServerOptions::default());
    let proxy = FaultProxy::start(server.port);
    proxy.delay(Duration::from_millis(150));
    let url = format!("redis://127.0.0.1:{}/", proxy.port);
    let gateway = Gateway::start_at(
        &url,
        &[
            "--key-limit",
            "100/60",
            "--max-concurrent",
            "4",
            "--quota-calls",
            "1000",
            "--policy",
            "raise",
        ],
        None,
    );
    let mut statuses = Vec::new();
    for _ in 0..6 {
        let response = reqwest::get(gateway.url("key=slow")).await.unwrap();
        statuses.push(response.status().as_u16());
    }
    let mut con = server.client().get_connection().unwrap();
    let counted: Option<u64> = cmd("HGET")
        .arg("qag:quota:slow")
        .arg("calls")
        .query(&mut con)
        .unwrap();
    let served = statuses.iter().filter(|status| **status == 200).count() as u64;
    assert_eq!(statuses, [200; 6], "counted {counted:?}");
    assert_eq!(counted, Some(served));
}
