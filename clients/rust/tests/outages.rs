//! A server that stops answering (SIGSTOP): the deadline error within the deadline, and
//! under the `Local` policy, local decisions during the back-off and Redis's after it.

#[path = "../../../tests/common/mod.rs"]
mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use qag_client::{AnsweredBy, Error, Limiter, OnUnavailable, Options};

/// A stopped server, continued when the test ends however it ends.
struct Stopped(u32);

impl Stopped {
    fn new(server: &Server) -> Stopped {
        signal("-STOP", server.pid());
        Stopped(server.pid())
    }
}

impl Drop for Stopped {
    fn drop(&mut self) {
        signal("-CONT", self.0);
    }
}

fn signal(which: &str, pid: u32) {
    let status = Command::new("kill")
        .arg(which)
        .arg(pid.to_string())
        .status()
        .expect("run kill");
    assert!(status.success(), "kill {which} {pid}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_stopped_server_gives_the_deadline_error_or_local_decisions() {
    if external("a_stopped_server_gives_the_deadline_error_or_local_decisions") {
        return;
    }
    let server = Server::start(&ServerOptions::default());
    let connect = || async { server.client().get_connection_manager().await.unwrap() };
    let deadline = Duration::from_millis(500);
    let back_off = Duration::from_secs(2);
    let strict = Limiter::new(connect().await);
    let local = Limiter::with_options(
        connect().await,
        Options {
            on_unavailable: OnUnavailable::Local { back_off },
            ..Options::default()
        },
    );
    assert_eq!(strict.options().deadline, deadline, "the default deadline");
    // Both know the server has the module before it stops.
    for limiter in [&strict, &local] {
        let decision = limiter.take("qag:warm", 5, 3600.0, 1).await.unwrap();
        assert_eq!(decision.answered_by, AnsweredBy::Module);
    }

    let stopped = Stopped::new(&server);
    let started = Instant::now();
    let answer = strict.take("qag:strict", 5, 3600.0, 1).await;
    let waited = started.elapsed();
    assert_eq!(answer, Err(Error::Timeout));
    assert!(
        waited >= deadline && waited < deadline + Duration::from_millis(100),
        "answered after {waited:?}"
    );

    // Local: the failed call and the back-off's calls are decided in memory, the
    // bucket of 5 starting full and refusing the sixth.
    let mut decisions = Vec::new();
    for _ in 0..6 {
        let started = Instant::now();
        let decision = local.take("qag:local", 5, 3600.0, 1).await.unwrap();
        decisions.push((decision.allowed, decision.remaining, decision.answered_by));
        if decisions.len() > 1 {
            assert!(
                started.elapsed() < Duration::from_millis(50),
                "a call in the back-off waited on Redis"
            );
        }
    }
    let expected: Vec<_> = [
        (true, 4),
        (true, 3),
        (true, 2),
        (true, 1),
        (true, 0),
        (false, 0),
    ]
    .into_iter()
    .map(|(allowed, left)| (allowed, left, AnsweredBy::Local))
    .collect();
    assert_eq!(decisions, expected);
    assert!(local.counting_locally());
    assert_eq!(local.local_decisions(), 6);
    let pair = local
        .take_pair("qag:local", 5, 3600.0, "qag:other", 5, 3600.0, 1)
        .await
        .unwrap();
    assert_eq!(pair.client.answered_by, AnsweredBy::Local);
    assert!(
        !pair.allowed() && pair.key.is_none(),
        "the client bucket is spent"
    );

    drop(stopped);
    let until = Instant::now() + back_off + Duration::from_secs(1);
    while local.counting_locally() {
        assert!(Instant::now() < until, "the back-off never ended");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let after = local.take("qag:local", 5, 3600.0, 1).await.unwrap();
    assert_eq!(after.answered_by, AnsweredBy::Module);
    assert_eq!(local.local_decisions(), 7);
    // Redis saw the two warm-up calls, the two sent before the deadlines passed (run
    // once the server continued) and the last one: none of the back-off's.
    let mut con = server.client().get_connection().unwrap();
    assert_eq!(command_calls(&mut con, "qag.take"), 5);
    assert_eq!(
        strict
            .take("qag:strict", 5, 3600.0, 1)
            .await
            .unwrap()
            .answered_by,
        AnsweredBy::Module
    );
}
