//! The tower layer as a user runs it: examples/axum_gateway.rs, started as a program
//! against a real server, driven by a real HTTP client. Exact headers call by call, the
//! 429 at the right request with ADR 0032's body, the client's bucket refusing without
//! touching the key's, refunds on later refusals, the quota counting down, streams
//! holding their slot to the last byte, a client gone mid-stream freeing it, and a
//! cancelled request leaving no token hold and no slot behind; each the same on a server
//! without the module (the scripts answer), and 200 requests at once within every limit.

#[path = "../../../tests/common/mod.rs"]
mod common;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

/// The example gateway, running until dropped.
struct Gateway {
    child: Child,
    base: String,
}

impl Gateway {
    fn start(server: &Server, flags: &[&str]) -> Gateway {
        let mut child = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
            .args([
                "run",
                "--quiet",
                "--package",
                "qag-client",
                "--features",
                "tower",
                "--example",
                "axum_gateway",
                "--",
                "--redis",
                &format!("redis://127.0.0.1:{}/", server.port),
                "--listen",
                "127.0.0.1:0",
            ])
            .args(flags)
            .stdout(Stdio::piped())
            .spawn()
            .expect("run the axum gateway example");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let address = line
            .trim()
            .strip_prefix("listening on ")
            .unwrap_or_else(|| panic!("the gateway said {line:?}"))
            .to_owned();
        Gateway {
            child,
            base: format!("http://{address}"),
        }
    }

    fn url(&self, query: &str) -> String {
        format!("{}/v1/query?{query}", self.base)
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Status, the rate-limit header fields (name=value, in order) and the body.
async fn get(url: &str) -> (u16, Vec<String>, String) {
    let response = reqwest::get(url).await.unwrap();
    let status = response.status().as_u16();
    let fields = response
        .headers()
        .iter()
        .filter(|(name, _)| {
            let name = name.as_str();
            name.starts_with("x-ratelimit") || name.starts_with("x-quota") || name == "retry-after"
        })
        .filter(|(name, _)| name.as_str() != "x-quota-reset")
        .map(|(name, value)| format!("{name}={}", value.to_str().unwrap()))
        .collect();
    (status, fields, response.text().await.unwrap())
}

fn fields(list: &[&str]) -> Vec<String> {
    list.iter().map(|field| field.to_string()).collect()
}

/// The live leases of `key`, asked of the lease script (the module may be missing).
fn live_leases(con: &mut Connection, key: &str) -> i64 {
    cmd("EVAL")
        .arg(LEASE_LUA)
        .arg(1)
        .arg(key)
        .arg("count")
        .query(con)
        .unwrap()
}

/// A server with the module, or without it.
fn server(without_module: bool) -> Server {
    Server::start(&ServerOptions {
        without_module,
        ..Default::default()
    })
}

fn bucket_tokens(con: &mut Connection, key: &str) -> Option<i64> {
    bucket_fields(con, key).map(|(tokens, _)| tokens.floor() as i64)
}

/// The request id a refusal names, for comparing bodies whole.
fn without_request_id(body: &str) -> String {
    match body.split_once(",\"request_id\":") {
        Some((head, _)) => format!("{head}}}"),
        None => body.to_owned(),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn the_client_bucket_refuses_first_and_leaves_the_key_bucket_alone() {
    if external("the_client_bucket_refuses_first_and_leaves_the_key_bucket_alone") {
        return;
    }
    for without_module in [false, true] {
        let server = Server::start(&ServerOptions {
            without_module,
            ..Default::default()
        });
        let mut con = server.client().get_connection().unwrap();
        let gateway = Gateway::start(
            &server,
            &["--client-limit", "3/3600", "--key-limit", "100/3600"],
        );
        let url = gateway.url("key=acme~a");
        for left in ["2", "1", "0"] {
            let key_left = format!(
                "x-ratelimit-key-remaining={}",
                97 + left.parse::<u64>().unwrap()
            );
            let (status, got, _) = get(&url).await;
            assert_eq!(status, 200);
            assert_eq!(
                got,
                fields(&[
                    "x-ratelimit-limit=3",
                    &format!("x-ratelimit-remaining={left}"),
                    "x-ratelimit-key-limit=100",
                    &key_left,
                ])
            );
        }
        let (status, got, body) = get(&url).await;
        assert_eq!(status, 429);
        assert_eq!(
            got,
            fields(&[
                "x-ratelimit-limit=3",
                "x-ratelimit-remaining=0",
                "retry-after=1200"
            ])
        );
        assert_eq!(
            without_request_id(&body),
            r#"{"error":"Rate limit exceeded","code":"rate_limited","retry_after":1200}"#
        );
        assert!(body.contains(r#","request_id":""#));
        // The key's bucket was counted three times, not four.
        let key = "qag:ratelimit:key:100/3600:acme~a";
        assert_eq!(
            bucket_tokens(&mut con, key),
            Some(97),
            "module {}",
            !without_module
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_key_bucket_refusal_gives_the_client_token_back() {
    if external("a_key_bucket_refusal_gives_the_client_token_back") {
        return;
    }
    for without_module in [false, true] {
        let server = Server::start(&ServerOptions {
            without_module,
            ..Default::default()
        });
        let mut con = server.client().get_connection().unwrap();
        let gateway = Gateway::start(
            &server,
            &["--client-limit", "1000/3600", "--key-limit", "2/3600"],
        );
        let url = gateway.url("key=acme~b");
        for _ in 0..2 {
            assert_eq!(get(&url).await.0, 200);
        }
        let (status, got, body) = get(&url).await;
        assert_eq!(status, 429);
        assert_eq!(
            got,
            fields(&[
                "x-ratelimit-limit=1000",
                "x-ratelimit-remaining=998",
                "x-ratelimit-key-limit=2",
                "x-ratelimit-key-remaining=0",
                "retry-after=1800",
            ])
        );
        assert_eq!(
            without_request_id(&body),
            r#"{"error":"Rate limit exceeded for this API key","code":"rate_limited","retry_after":1800}"#
        );
        let client = "qag:ratelimit:client:1000/3600:127.0.0.1";
        assert_eq!(bucket_tokens(&mut con, client), Some(998));
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn the_quota_counts_down_then_refuses_and_costs_no_tokens() {
    if external("the_quota_counts_down_then_refuses_and_costs_no_tokens") {
        return;
    }
    for without_module in [false, true] {
        let server = server(without_module);
        let mut con = server.client().get_connection().unwrap();
        let gateway = Gateway::start(
            &server,
            &[
                "--key-limit",
                "100/3600",
                "--quota-calls",
                "3",
                "--quota-per",
                "day",
            ],
        );
        let url = gateway.url("key=acme~q");
        for (left, key_left) in [("2", "99"), ("1", "98"), ("0", "97")] {
            let (status, got, _) = get(&url).await;
            assert_eq!(status, 200);
            assert_eq!(
                got,
                fields(&[
                    "x-ratelimit-key-limit=100",
                    &format!("x-ratelimit-key-remaining={key_left}"),
                    &format!("x-quota-remaining-calls={left}"),
                ])
            );
        }
        let (status, got, body) = get(&url).await;
        assert_eq!(status, 429);
        assert_eq!(
            &got[..3],
            &fields(&[
                "x-ratelimit-key-limit=100",
                "x-ratelimit-key-remaining=97",
                "x-quota-remaining-calls=0",
            ])[..]
        );
        assert!(got[3].starts_with("retry-after="));
        assert!(body.starts_with(
            r#"{"error":"Quota exceeded for this API key","code":"quota_exceeded","retry_after":"#
        ));
        assert!(
            body.contains(r#","exceeded":"calls","resets_at":"#),
            "{body}"
        );
        let key = "qag:ratelimit:key:100/3600:acme~q";
        assert_eq!(bucket_tokens(&mut con, key), Some(97));
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn streams_hold_their_slot_to_the_last_byte() {
    if external("streams_hold_their_slot_to_the_last_byte") {
        return;
    }
    for without_module in [false, true] {
        let server = server(without_module);
        let mut con = server.client().get_connection().unwrap();
        let gateway = Gateway::start(
            &server,
            &["--key-limit", "100/3600", "--max-concurrent", "2"],
        );
        let slots = "qag:running:acme~s";
        let leases = |con: &mut Connection| live_leases(con, slots);
        // Three streams of 5 rows over 1.5 s at once: two hold the slots, one is refused.
        let url = gateway.url("key=acme~s&work_ms=1500&chunks=5");
        let streams: Vec<_> = (0..3)
            .map(|_| {
                let url = url.clone();
                tokio::spawn(async move { get(&url).await })
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(700)).await;
        assert_eq!(leases(&mut con), 2, "the streams hold their slots mid-body");
        let mut answers = Vec::new();
        for stream in streams {
            answers.push(stream.await.unwrap());
        }
        answers.sort_by_key(|(status, _, _)| *status);
        assert_eq!(
            answers
                .iter()
                .map(|(status, _, _)| *status)
                .collect::<Vec<_>>(),
            [200, 200, 429]
        );
        assert_eq!(answers[0].2.lines().count(), 5);
        assert_eq!(
            without_request_id(&answers[2].2),
            r#"{"error":"Too many concurrent requests for this API key","code":"too_many_concurrent","retry_after":1}"#
        );
        assert!(answers[2].1.contains(&"retry-after=1".to_string()));
        let until = Instant::now() + Duration::from_secs(1);
        while leases(&mut con) != 0 {
            assert!(
                Instant::now() < until,
                "slots still held after the streams ended"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // The refused request cost no tokens: two of 100 spent.
        let key = "qag:ratelimit:key:100/3600:acme~s";
        assert_eq!(bucket_tokens(&mut con, key), Some(98));

        // A client that goes away mid-stream frees its slot within a second.
        let mut response = reqwest::get(gateway.url("key=acme~s&work_ms=10000&chunks=10"))
            .await
            .unwrap();
        assert_eq!(response.status().as_u16(), 200);
        assert!(response.chunk().await.unwrap().is_some());
        assert_eq!(leases(&mut con), 1);
        drop(response);
        let gone = Instant::now();
        while leases(&mut con) != 0 {
            assert!(
                gone.elapsed() < Duration::from_secs(1),
                "the slot outlived its client"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_request_the_limiter_cannot_finish_costs_no_tokens() {
    if external("a_request_the_limiter_cannot_finish_costs_no_tokens") {
        return;
    }
    // A server that refuses the slot (the lease command denied to the gateway's user):
    // every request is a 503, and what its buckets took is given back.
    let server = Server::start(&ServerOptions::default());
    let mut con = server.client().get_connection().unwrap();
    let _: () = cmd("ACL")
        .arg("SETUSER")
        .arg("default")
        .arg("-qag.lease")
        .query(&mut con)
        .unwrap();
    let gateway = Gateway::start(&server, &["--key-limit", "3/3600", "--max-concurrent", "2"]);
    let url = gateway.url("key=acme~m");
    for _ in 0..5 {
        let (status, _, body) = get(&url).await;
        assert_eq!(status, 503);
        assert!(body.contains(r#""code":"limiter_unavailable""#), "{body}");
    }
    let key = "qag:ratelimit:key:3/3600:acme~m";
    assert_eq!(bucket_tokens(&mut con, key), Some(3));
}

/// A request the client gives up on (its future dropped by the server when the
/// connection closes) leaves nothing held: the handler's token reservation is
/// committed with what it charged (nothing, or the parts streamed), and the layer's
/// slot is released, within a second, not when the hold or the lease expire.
#[tokio::test(flavor = "multi_thread")]
async fn a_cancelled_request_leaves_no_hold() {
    if external("a_cancelled_request_leaves_no_hold") {
        return;
    }
    for without_module in [false, true] {
        let server = server(without_module);
        let mut con = server.client().get_connection().unwrap();
        let gateway = Gateway::start(
            &server,
            &[
                "--key-limit",
                "100/3600",
                "--max-concurrent",
                "4",
                "--tpm",
                "10000",
            ],
        );
        let window = "qag:win:{acme~c}:tokens";
        let slots = "qag:running:acme~c";
        let leases = |con: &mut Connection| live_leases(con, slots);
        let nothing_left = |con: &mut Connection, expected_tokens: i64, what: &str| {
            let until = Instant::now() + Duration::from_secs(1);
            loop {
                let now = (held(con, window), leases(con), counted(con, window, "tok:"));
                if now == (0, 0, expected_tokens) {
                    return;
                }
                assert!(
                    Instant::now() < until,
                    "{what}: (held, slots, tokens) = {now:?}"
                );
                std::thread::sleep(Duration::from_millis(20));
            }
        };

        // Finished: 1000 tokens counted, nothing held.
        let (status, _, _) = get(&gateway.url("key=acme~c&reserve=3000&tokens=1000")).await;
        assert_eq!(status, 200);
        nothing_left(&mut con, 1000, "a finished request");

        // Cancelled while the handler waits for its model: 3000 held, then nothing.
        let client = reqwest::Client::new();
        let waiting = client
            .get(gateway.url("key=acme~c&work_ms=30000&reserve=3000&tokens=1000"))
            .timeout(Duration::from_millis(800))
            .send();
        let watch = async {
            tokio::time::sleep(Duration::from_millis(400)).await;
            (
                held(&mut server.client().get_connection().unwrap(), window),
                leases(&mut server.client().get_connection().unwrap()),
            )
        };
        let (answer, mid) = tokio::join!(waiting, watch);
        assert!(answer.is_err(), "the request was to time out");
        assert_eq!(mid, (3000, 1), "held while the handler waited");
        nothing_left(&mut con, 1000, "a request cancelled before its answer");

        // Cancelled mid-stream after 2 of 10 parts of 100: 200 counted, nothing held.
        let mut response = reqwest::get(
            gateway.url("key=acme~c&work_ms=10000&chunks=10&reserve=3000&tokens=1000"),
        )
        .await
        .unwrap();
        assert_eq!(response.status().as_u16(), 200);
        assert!(response.chunk().await.unwrap().is_some());
        assert!(response.chunk().await.unwrap().is_some());
        assert_eq!(held(&mut con, window), 2800);
        drop(response);
        nothing_left(&mut con, 1200, "a stream cancelled after two parts");
    }
}

/// Issue 34: a request with two buckets, a quota and a slot, each asked of a Redis that
/// no longer answers (SIGSTOP, no back-off: every call goes to Redis), waits one
/// deadline (0.5 s) in all, not one a call: the request's calls share it.
#[tokio::test(flavor = "multi_thread")]
async fn a_stopped_redis_costs_a_request_one_deadline() {
    if external("a_stopped_redis_costs_a_request_one_deadline") {
        return;
    }
    let server = Server::start(&ServerOptions::default());
    let flags = [
        "--client-limit",
        "100/1",
        "--key-limit",
        "100/3600",
        "--max-concurrent",
        "4",
        "--quota-calls",
        "1000",
        "--policy",
        "local",
        "--back-off",
        "0",
    ];
    let gateway = Gateway::start(&server, &flags);
    let url = gateway.url("key=acme~d");
    assert_eq!(get(&url).await.0, 200);
    let _stopped = Stopped::new(&server);
    for _ in 0..3 {
        let started = Instant::now();
        let (status, _, _) = get(&url).await;
        let took = started.elapsed();
        assert_eq!(status, 200, "counted locally");
        assert!(took < Duration::from_millis(750), "{took:?}");
    }
}

/// 200 requests at once, with the module and without it: every answer a 200 or a 429
/// with one of the layer's bodies (none a 5xx), and no limit exceeded: the key's bucket
/// spends a token per request that got through (a slot or tokens refused give theirs
/// back), the slots in use never above their number, each request's tokens counted
/// once, its call once on the quota.
#[tokio::test(flavor = "multi_thread")]
async fn two_hundred_requests_at_once_stay_within_every_limit_without_the_module() {
    if external("two_hundred_requests_at_once_stay_within_every_limit_without_the_module") {
        return;
    }
    for without_module in [false, true] {
        let server = server(without_module);
        let mut con = server.client().get_connection().unwrap();
        let flags = [
            "--key-limit",
            "150/3600",
            "--max-concurrent",
            "40",
            "--tpm",
            "60000",
            "--quota-calls",
            "100000",
            "--quota-per",
            "day",
        ];
        let gateway = Gateway::start(&server, &flags);
        let url = gateway.url("key=acme~z&work_ms=60&reserve=1000&tokens=500");
        // One request first: the gateway connected, the scripts loaded.
        assert_eq!(get(&url).await.0, 200);
        let requests: Vec<_> = (0..200)
            .map(|_| {
                let url = url.clone();
                tokio::spawn(async move { get(&url).await })
            })
            .collect();
        let slots = "qag:running:acme~z";
        let mut most_held = 0;
        while requests.iter().any(|request| !request.is_finished()) {
            most_held = most_held.max(live_leases(&mut con, slots));
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let mut served = 1;
        let mut refusals = std::collections::BTreeMap::new();
        for request in requests {
            let (status, _, body) = request.await.unwrap();
            match status {
                200 => served += 1,
                429 => {
                    let code = without_request_id(&body)
                        .split(r#""code":""#)
                        .nth(1)
                        .and_then(|rest| rest.split('"').next())
                        .unwrap_or_default()
                        .to_owned();
                    *refusals.entry(code).or_insert(0) += 1;
                }
                other => panic!("module {}: a {other}: {body}", !without_module),
            }
        }
        let what = format!("module {}: {served} served, {refusals:?}", !without_module);
        eprintln!("{what}, at most {most_held} slots held");
        assert!(most_held <= 40, "{what}: {most_held} slots held at once");
        assert!(
            refusals
                .keys()
                .all(|code| ["rate_limited", "too_many_concurrent"].contains(&code.as_str())),
            "{what}"
        );
        let key = "qag:ratelimit:key:150/3600:acme~z";
        assert_eq!(bucket_tokens(&mut con, key), Some(150 - served), "{what}");
        let window = "qag:win:{acme~z}:tokens";
        assert_eq!(counted(&mut con, window, "tok:"), 500 * served, "{what}");
        assert_eq!(held(&mut con, window), 0, "{what}");
        let calls: Option<i64> = cmd("HGET")
            .arg("qag:quota:acme~z")
            .arg("calls")
            .query(&mut con)
            .unwrap();
        assert_eq!(calls, Some(served), "{what}");
        assert!(served >= 40 && refusals.values().sum::<i64>() > 0, "{what}");
    }
}
