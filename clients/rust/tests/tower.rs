//! The tower layer as a user runs it: examples/axum_gateway.rs, started as a program
//! against a real server, driven by a real HTTP client. Exact headers call by call, the
//! 429 at the right request with ADR 0032's body, the client's bucket refusing without
//! touching the key's, refunds on later refusals, the quota counting down, streams
//! holding their slot to the last byte, a client gone mid-stream freeing it, and a
//! cancelled request leaving no token hold and no slot behind; each the same on a server
//! without the module (the scripts answer), and 200 requests at once within every limit;
//! the quota's fields on every answer to a caller with a quota, the draft's RateLimit
//! fields parsed with a Structured Fields parser and agreeing with the others, a window
//! chain's OpenAI-style fields, a limit in shadow, and a request that waits its turn.

#[path = "../../../tests/common/mod.rs"]
mod common;
#[path = "support/gateway.rs"]
mod gateway;

use std::collections::BTreeMap;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::*;
use gateway::Gateway;

/// Status, the rate-limit header fields (name=value, in order) and the body.
async fn get(url: &str) -> (u16, Vec<String>, String) {
    let response = reqwest::get(url).await.unwrap();
    let status = response.status().as_u16();
    let fields = response
        .headers()
        .iter()
        .filter(|(name, _)| {
            let name = name.as_str();
            name.starts_with("x-ratelimit")
                || name.starts_with("x-quota")
                || name == "retry-after"
                || name == "server-timing"
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

/// A caller that sends its next request once it has read a response finds the slot
/// free: the layer gives it back before the body's end goes out, not after (it was
/// given back in the background, and a key of one slot refused every few requests).
/// A whole body goes out with its headers, at once on a kept-alive connection (held
/// back, it waited ~40 ms for the client's delayed ACK); HEAD requests alike.
#[tokio::test(flavor = "multi_thread")]
async fn a_slot_is_free_once_its_response_has_been_read() {
    if external("a_slot_is_free_once_its_response_has_been_read") {
        return;
    }
    let _timed = Cores::shared();
    for without_module in [false, true] {
        let server = server(without_module);
        let mut con = server.client().get_connection().unwrap();
        let gateway = Gateway::start(
            &server,
            &["--key-limit", "1000/3600", "--max-concurrent", "1"],
        );
        let client = reqwest::Client::new(); // one kept-alive connection
        let mut whole_bodies = Vec::new();
        for n in 0..60 {
            // Whole bodies, streamed ones whose end is a frame of its own, and HEADs.
            let (query, head) = match n % 4 {
                0 => ("key=acme~one&work_ms=5&chunks=2", false),
                1 => ("key=acme~one", true),
                _ => ("key=acme~one", false),
            };
            let url = gateway.url(query);
            let started = Instant::now();
            let sent = if head {
                client.head(&url)
            } else {
                client.get(&url)
            };
            let response = sent.send().await.unwrap();
            let status = response.status().as_u16();
            let body = response.text().await.unwrap();
            if n % 4 > 1 {
                whole_bodies.push(started.elapsed());
            }
            assert_eq!(status, 200, "request {n} ({without_module}): {body}");
            assert_eq!(
                live_leases(&mut con, "qag:running:acme~one"),
                0,
                "request {n} (head: {head})"
            );
        }
        whole_bodies.sort();
        let median = whole_bodies[whole_bodies.len() / 2];
        assert!(median < Duration::from_millis(25), "{median:?}");
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
    let _timed = Cores::shared();
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

/// A parameter of the draft's fields.
#[derive(Clone, Debug, PartialEq)]
enum Param {
    Integer(i64),
    Text(String),
    Bytes(Vec<u8>),
}

type Items = BTreeMap<String, BTreeMap<String, Param>>;

/// A List field of draft-ietf-httpapi-ratelimit-headers-11, parsed with a Structured
/// Fields parser (sfv), each item's name and parameters, checked against the draft's
/// rules: every item a String with parameters; in `ratelimit-policy`, `q` a
/// non-negative Integer (required), `qu` a String, `w` a positive Integer; in
/// `ratelimit`, `r` a non-negative Integer (required), `t` a non-negative Integer;
/// `pk` a Byte Sequence in both. Other parameters are allowed (comments).
fn draft_items(field: &str, value: &str) -> Result<Items, String> {
    let list = sfv::Parser::parse_list(value.as_bytes()).map_err(|e| format!("{value}: {e}"))?;
    let mut items = Items::new();
    for entry in list {
        let sfv::ListEntry::Item(item) = entry else {
            return Err(format!("an inner list in {value}"));
        };
        let name = item
            .bare_item
            .as_str()
            .ok_or(format!("a name not a String: {value}"))?;
        let mut params = BTreeMap::new();
        for (param, bare) in &item.params {
            let value = match bare {
                sfv::BareItem::Integer(n) => Param::Integer(*n),
                sfv::BareItem::String(text) => Param::Text(text.clone()),
                sfv::BareItem::ByteSeq(bytes) => Param::Bytes(bytes.clone()),
                other => Param::Text(format!("{other:?}")),
            };
            params.insert(param.clone(), value);
        }
        let integer = |param: &str, least: i64, required: bool| match params.get(param) {
            Some(Param::Integer(n)) if *n >= least => Ok(()),
            None if !required => Ok(()),
            other => Err(format!("{name}: {param} is {other:?} in {value}")),
        };
        match field {
            "ratelimit-policy" => {
                integer("q", 0, true)?;
                integer("w", 1, false)?;
                if !matches!(params.get("qu"), None | Some(Param::Text(_))) {
                    return Err(format!("{name}: qu not a String in {value}"));
                }
            }
            _ => {
                integer("r", 0, true)?;
                integer("t", 0, false)?;
            }
        }
        if !matches!(params.get("pk"), None | Some(Param::Bytes(_))) {
            return Err(format!("{name}: pk not a Byte Sequence in {value}"));
        }
        items.insert(name.to_owned(), params);
    }
    Ok(items)
}

/// The checks of the gateway's fields, run first on the draft's own examples.
#[test]
fn the_drafts_examples_pass_the_checks_the_gateways_fields_pass() {
    let policies = [
        r#""burst";q=100;w=60,"daily";q=1000;w=86400"#,
        r#""default";q=100;w=10"#,
        r#""permin";q=50;w=60,"perhr";q=1000;w=3600"#,
        r#""peruser";q=100;w=60;pk=:cHsdsRa894==:"#,
        r#""peruser";q=65535;qu="content-bytes";w=10;pk=:sdfjLJUOUH==:"#,
        r#""hour";q=1000;w=3600, "day";q=5000;w=86400"#,
    ];
    for policy in policies {
        draft_items("ratelimit-policy", policy).unwrap();
    }
    let limits = [
        r#""default";r=50;t=30"#,
        r#""default";r=999;pk=:dHJpYWwxMjEzMjM=:"#,
        r#""default";r=300000000;t=60;pk=:QXBwLTk5OQ==:"#,
        r#""dayLimit";r=100;t=36000"#,
        r#""problemPolicy";r=0;t=10"#,
    ];
    for limit in limits {
        draft_items("ratelimit", limit).unwrap();
    }
    // And what the draft rules out: a Token for a name (-08's form), no quota, a window
    // of 0, a negative remaining.
    for (field, bad) in [
        ("ratelimit-policy", "default;q=100;w=60"),
        ("ratelimit-policy", r#""default";w=60"#),
        ("ratelimit-policy", r#""default";q=100;w=0"#),
        ("ratelimit", r#""default";r=-1;t=5"#),
    ] {
        assert!(draft_items(field, bad).is_err(), "{bad}");
    }
}

/// An answer of the gateway, headers whole.
struct Answer {
    status: u16,
    headers: reqwest::header::HeaderMap,
    body: String,
}

async fn answer(response: reqwest::Response) -> Answer {
    Answer {
        status: response.status().as_u16(),
        headers: response.headers().clone(),
        body: response.text().await.unwrap(),
    }
}

impl Answer {
    fn text(&self, name: &str) -> Option<String> {
        let value = self.headers.get(name)?;
        Some(value.to_str().unwrap().to_owned())
    }

    fn number(&self, name: &str) -> Option<i64> {
        self.text(name).map(|value| value.parse().unwrap())
    }
}

fn unix_now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

/// Every answer to a caller with a quota of `calls` carries the quota's fields, and the
/// draft's fields parse and agree with the others: a bucket's `q` and `r` are its
/// `x-ratelimit-*` limit and remaining, the quota's `r` and `t` its remaining calls and
/// the time to its reset, every limit in the policy has its service limit; the
/// refusing limit (`refused_by`) has nothing left and waits what `retry-after` says.
fn check_fields(answer: &Answer, calls: i64, refused_by: Option<&str>) {
    let what = format!("{} {:?} {}", answer.status, answer.headers, answer.body);
    let calls_left = answer.number("x-quota-remaining-calls").expect(&what);
    let resets_at = answer.number("x-quota-reset").expect(&what);
    let policy = draft_items(
        "ratelimit-policy",
        &answer.text("ratelimit-policy").unwrap(),
    );
    let limits = draft_items("ratelimit", &answer.text("ratelimit").unwrap());
    let (policy, limits) = (policy.expect(&what), limits.expect(&what));
    assert!(policy.keys().eq(limits.keys()), "{what}");
    let param = |items: &Items, name: &str, param: &str| match items.get(name)?.get(param) {
        Some(Param::Integer(n)) => Some(*n),
        _ => None,
    };
    for (name, prefix) in [("client", "x-ratelimit"), ("key", "x-ratelimit-key")] {
        let limit = answer.number(&format!("{prefix}-limit"));
        assert_eq!(param(&policy, name, "q"), limit, "{name}: {what}");
        let remaining = answer.number(&format!("{prefix}-remaining"));
        assert_eq!(param(&limits, name, "r"), remaining, "{name}: {what}");
    }
    assert_eq!(param(&policy, "calls", "q"), Some(calls), "{what}");
    assert_eq!(param(&limits, "calls", "r"), Some(calls_left), "{what}");
    let t = param(&limits, "calls", "t").expect(&what);
    assert!((resets_at - unix_now() - t).abs() <= 2, "{what}");
    let retry_after = answer.number("retry-after");
    match refused_by {
        Some(name) => {
            assert_eq!(param(&limits, name, "r"), Some(0), "{what}");
            assert_eq!(param(&limits, name, "t"), retry_after, "{what}");
            assert!(retry_after.is_some(), "{what}");
        }
        None => assert_eq!(retry_after, None, "{what}"),
    }
}

/// Issue 35: a bucket's 429, a slot's and the quota's own carry the quota's fields as
/// the 200s do (read in the round trip of the buckets, counting nothing), and the
/// draft's fields name the limit that refused.
#[tokio::test(flavor = "multi_thread")]
async fn every_answer_to_a_caller_with_a_quota_carries_it_and_the_drafts_fields_agree() {
    if external("every_answer_to_a_caller_with_a_quota_carries_it_and_the_drafts_fields_agree") {
        return;
    }
    let server = Server::start(&ServerOptions::default());
    let mut con = server.client().get_connection().unwrap();
    let flags = [
        "--client-limit",
        "5/3600",
        "--key-limit",
        "2/3600",
        "--max-concurrent",
        "1",
        "--quota-calls",
        "10",
        "--quota-per",
        "day",
    ];
    let gateway = Gateway::start(&server, &flags);
    let client = reqwest::Client::new();
    let get = |query: &str| client.get(gateway.url(query)).send();

    // A stream holds the key's one slot: a second request is refused its slot.
    let stream = get("key=acme~s&work_ms=1000&chunks=2").await.unwrap();
    let held = answer(get("key=acme~s").await.unwrap()).await;
    let stream = answer(stream).await;
    assert_eq!((stream.status, held.status), (200, 429));
    assert!(held.body.contains("too_many_concurrent"), "{}", held.body);
    check_fields(&stream, 10, None);
    check_fields(&held, 10, Some("concurrency"));
    assert_eq!(held.number("x-quota-remaining-calls"), Some(9));

    // The key's bucket of 2, then the client's of 5 (given back what later limits refused).
    let mut answers = Vec::new();
    for query in ["key=acme~k"; 3].into_iter().chain(["key=acme~c"; 3]) {
        answers.push(answer(get(query).await.unwrap()).await);
    }
    let statuses: Vec<u16> = answers.iter().map(|answer| answer.status).collect();
    assert_eq!(statuses, [200, 200, 429, 200, 200, 429]);
    for (answer, refused_by) in
        answers
            .iter()
            .zip([None, None, Some("key"), None, None, Some("client")])
    {
        check_fields(answer, 10, refused_by);
    }
    assert!(answers[2].body.contains("for this API key"));
    assert_eq!(answers[2].number("x-quota-remaining-calls"), Some(8));
    assert!(answers[5]
        .body
        .starts_with(r#"{"error":"Rate limit exceeded","#));
    assert_eq!(answers[5].number("x-quota-remaining-calls"), Some(8));
    // The refused calls counted nothing: 2 + 2 of acme~k and acme~c, 1 of the stream.
    for (key, used) in [("acme~k", "2"), ("acme~c", "2"), ("acme~s", "1")] {
        let calls: Option<String> = cmd("HGET")
            .arg(format!("qag:quota:{key}"))
            .arg("calls")
            .query(&mut con)
            .unwrap();
        assert_eq!(calls.as_deref(), Some(used), "{key}");
    }
    drop(gateway);

    // The quota's own refusal.
    let flags = [
        "--key-limit",
        "100/3600",
        "--quota-calls",
        "2",
        "--quota-per",
        "day",
    ];
    let gateway = Gateway::start(&server, &flags);
    let mut answers = Vec::new();
    for _ in 0..3 {
        let response = client.get(gateway.url("key=acme~q")).send().await.unwrap();
        answers.push(answer(response).await);
    }
    assert_eq!(answers[2].status, 429);
    assert!(answers[2].body.contains("quota_exceeded"));
    for (answer, refused_by) in answers.iter().zip([None, None, Some("calls")]) {
        check_fields(answer, 2, refused_by);
    }
}

/// A duration as Go writes it (`1m47.5s`, `12ms`, `0s`), in milliseconds.
fn go_millis(text: &str) -> u64 {
    if let Some(millis) = text.strip_suffix("ms") {
        return millis.parse().unwrap();
    }
    let mut millis = 0.0;
    let mut number = String::new();
    for c in text.chars() {
        match c {
            'h' | 'm' | 's' => {
                let unit = match c {
                    'h' => 3_600_000.0,
                    'm' => 60_000.0,
                    _ => 1000.0,
                };
                millis += number.parse::<f64>().unwrap() * unit;
                number.clear();
            }
            c => number.push(c),
        }
    }
    assert!(number.is_empty(), "{text}");
    millis.round() as u64
}

/// Issue 35: the model route's OpenAI-style fields follow its window through a
/// reservation (the tokens it holds counted) and its commit.
#[tokio::test(flavor = "multi_thread")]
async fn a_model_route_reports_its_window_as_openai_does() {
    if external("a_model_route_reports_its_window_as_openai_does") {
        return;
    }
    let server = Server::start(&ServerOptions::default());
    let flags = ["--key-limit", "100/3600", "--tpm", "1000", "--rpm", "5"];
    let gateway = Gateway::start(&server, &flags);
    let window = |answer: &Answer| -> Vec<u64> {
        let names = [
            "limit-requests",
            "remaining-requests",
            "limit-tokens",
            "remaining-tokens",
        ];
        let numbers = names.map(|name| answer.number(&format!("x-ratelimit-{name}")).unwrap());
        for kind in ["requests", "tokens"] {
            let reset = answer.text(&format!("x-ratelimit-reset-{kind}")).unwrap();
            // What counts now has stopped counting by the end of the next window.
            let reset = go_millis(&reset);
            assert!(reset > 0 && reset <= 120_000, "{reset}");
        }
        numbers.iter().map(|&n| n as u64).collect()
    };
    // 600 held while the first runs, then 500 counted.
    let first = reqwest::get(gateway.url("key=acme~t&reserve=600&tokens=500"));
    let first = answer(first.await.unwrap()).await;
    assert_eq!(first.status, 200);
    assert_eq!(window(&first), [5, 4, 1000, 400]);
    let second = reqwest::get(gateway.url("key=acme~t&reserve=300"));
    let second = answer(second.await.unwrap()).await;
    assert_eq!(window(&second), [5, 3, 1000, 200]);
    let refused = reqwest::get(gateway.url("key=acme~t&reserve=300"));
    let refused = answer(refused.await.unwrap()).await;
    assert_eq!(refused.status, 429);
    assert_eq!(window(&refused), [5, 3, 1000, 200]);
    let retry = refused.number("retry-after").unwrap();
    assert!((1..=60).contains(&retry), "{retry}");
}

/// The gateway's `/limits` counts of one limit: (allowed, refused, shadow).
async fn limit_counts(gateway: &Gateway, limit: &str) -> (u64, u64, bool) {
    let counts = reqwest::get(format!("{}/limits", gateway.base));
    let counts = counts.await.unwrap().text().await.unwrap();
    let counts: serde_json::Value = serde_json::from_str(&counts).unwrap();
    let limit = &counts[limit];
    (
        limit["allowed"].as_u64().unwrap(),
        limit["refused"].as_u64().unwrap(),
        limit["shadow"].as_bool().unwrap(),
    )
}

/// Issue 35: the layer's window option holds a model call's estimate; a call the window
/// refuses answers 429 naming requests or tokens, with the window's fields and the
/// quota's, gives back its bucket's token and its slot and adds no call to the quota;
/// an estimate above the window's tokens never fits (no retry-after). With the module
/// and without it.
#[tokio::test(flavor = "multi_thread")]
async fn the_window_option_refuses_gives_back_and_says_why() {
    if external("the_window_option_refuses_gives_back_and_says_why") {
        return;
    }
    for without_module in [false, true] {
        let server = server(without_module);
        let mut con = server.client().get_connection().unwrap();
        let flags = [
            "--key-limit",
            "100/3600",
            "--max-concurrent",
            "2",
            "--tpm",
            "1000",
            "--rpm",
            "3",
            "--quota-calls",
            "1000",
            "--quota-per",
            "day",
        ];
        let gateway = Gateway::start(&server, &flags);
        let (bucket, slots) = ("qag:ratelimit:key:100/3600:acme~g", "qag:running:acme~g");
        let calls = |con: &mut Connection| -> i64 {
            let calls: Option<i64> = cmd("HGET")
                .arg("qag:quota:acme~g")
                .arg("calls")
                .query(con)
                .unwrap();
            calls.unwrap_or(0)
        };
        let ask = |query: &str| {
            let url = gateway.url(&format!("key=acme~g&{query}"));
            async move { answer(reqwest::get(url).await.unwrap()).await }
        };
        let what = format!("module {}", !without_module);
        let first = ask("reserve=600&tokens=500").await;
        assert_eq!(first.status, 200, "{what}");
        // Its own 600 held.
        assert_eq!(first.number("x-ratelimit-remaining-tokens"), Some(400));
        let refused = ask("reserve=600&tokens=500").await;
        assert_eq!(refused.status, 429, "{what}: {}", refused.body);
        let body: serde_json::Value = serde_json::from_str(&refused.body).unwrap();
        assert_eq!(
            (&body["code"], &body["exceeded"], &body["error"]),
            (
                &serde_json::json!("rate_limited"),
                &serde_json::json!("tokens"),
                &serde_json::json!("Token rate limit exceeded")
            ),
            "{body}"
        );
        let retry = refused.number("retry-after").unwrap();
        assert_eq!(body["retry_after"].as_i64(), Some(retry));
        assert!((1..=120).contains(&retry), "{retry}");
        assert_eq!(refused.number("x-ratelimit-remaining-tokens"), Some(500));
        assert_eq!(refused.number("x-ratelimit-remaining-requests"), Some(2));
        // Given back: its token, its slot; and its call is not on the quota.
        assert_eq!(refused.number("x-ratelimit-key-remaining"), Some(99));
        assert_eq!(refused.number("x-quota-remaining-calls"), Some(999));
        assert_eq!(bucket_tokens(&mut con, bucket), Some(99), "{what}");
        assert_eq!((live_leases(&mut con, slots), calls(&mut con)), (0, 1));
        // 5000 tokens can never fit in 1000 a minute: no wait helps, none is named.
        let never = ask("reserve=5000&tokens=1").await;
        assert_eq!(never.status, 429);
        assert_eq!(never.text("retry-after"), None);
        assert!(
            never
                .body
                .contains(r#""retry_after":null,"exceeded":"tokens""#),
            "{}",
            never.body
        );
        // Three requests a minute: two more fit, the next names requests.
        for _ in 0..2 {
            assert_eq!(ask("reserve=100&tokens=100").await.status, 200);
        }
        let no_requests = ask("reserve=100&tokens=100").await;
        assert_eq!(no_requests.status, 429, "{}", no_requests.body);
        assert!(no_requests.body.contains(r#""exceeded":"requests""#));
        assert_eq!(
            no_requests.number("x-ratelimit-remaining-requests"),
            Some(0)
        );
        assert_eq!(bucket_tokens(&mut con, bucket), Some(97), "{what}");
        assert_eq!((live_leases(&mut con, slots), calls(&mut con)), (0, 3));
        assert_eq!(limit_counts(&gateway, "window").await, (3, 3, false));
        let window = "qag:win:{acme~g}:tokens";
        assert_eq!(
            (counted(&mut con, window, "tok:"), held(&mut con, window)),
            (700, 0),
            "{what}"
        );
    }
}

/// Issue 35: a window in shadow is asked and counted; a call it refuses is served,
/// holds nothing and charges nothing, and the refusal is logged.
#[tokio::test(flavor = "multi_thread")]
async fn a_window_in_shadow_lets_its_refusals_through_holding_nothing() {
    if external("a_window_in_shadow_lets_its_refusals_through_holding_nothing") {
        return;
    }
    let server = Server::start(&ServerOptions::default());
    let mut con = server.client().get_connection().unwrap();
    let log = std::env::temp_dir().join(format!("qag-window-shadow-{}.log", std::process::id()));
    let flags = ["--tpm", "1000", "--shadow", "window"];
    let gateway = Gateway::start_logging(&server, &flags, Some(&log));
    let mut answers = Vec::new();
    for _ in 0..3 {
        let url = gateway.url("key=acme~h&reserve=600&tokens=500");
        answers.push(answer(reqwest::get(url).await.unwrap()).await);
    }
    let statuses: Vec<u16> = answers.iter().map(|answer| answer.status).collect();
    assert_eq!(statuses, [200, 200, 200]);
    assert_eq!(answers[1].number("x-ratelimit-remaining-tokens"), Some(500));
    assert_eq!(limit_counts(&gateway, "window").await, (1, 2, true));
    let window = "qag:win:{acme~h}:tokens";
    assert_eq!(
        (counted(&mut con, window, "tok:"), held(&mut con, window)),
        (500, 0)
    );
    drop(gateway);
    let text = std::fs::read_to_string(&log).unwrap();
    std::fs::remove_file(&log).ok();
    assert!(
        text.contains("shadow: the window limit refused request"),
        "{text}"
    );
}

/// Issue 35: a quota of rows counts what the handler reports; once spent, its 429 names
/// rows, with `x-quota-remaining-rows: 0`, the reset, and the draft's `"rows"` item
/// agreeing with retry-after.
#[tokio::test(flavor = "multi_thread")]
async fn a_rows_quota_refuses_with_its_fields() {
    if external("a_rows_quota_refuses_with_its_fields") {
        return;
    }
    let server = Server::start(&ServerOptions::default());
    let mut con = server.client().get_connection().unwrap();
    let flags = ["--quota-rows", "100", "--quota-per", "day"];
    let gateway = Gateway::start(&server, &flags);
    let ask = |query: &str| {
        let url = gateway.url(&format!("key=acme~q&{query}"));
        async move { answer(reqwest::get(url).await.unwrap()).await }
    };
    let first = ask("rows=60").await;
    assert_eq!(first.status, 200);
    assert_eq!(first.number("x-quota-remaining-rows"), Some(40));
    let second = ask("rows=60").await;
    assert_eq!(second.status, 200);
    assert_eq!(second.number("x-quota-remaining-rows"), Some(0));
    let refused = ask("rows=1").await;
    assert_eq!(refused.status, 429, "{}", refused.body);
    let body: serde_json::Value = serde_json::from_str(&refused.body).unwrap();
    assert_eq!(
        (&body["code"], &body["exceeded"]),
        (
            &serde_json::json!("quota_exceeded"),
            &serde_json::json!("rows")
        )
    );
    assert_eq!(refused.number("x-quota-remaining-rows"), Some(0));
    assert_eq!(refused.text("x-quota-remaining-calls"), None);
    assert_eq!(refused.number("x-quota-reset"), body["resets_at"].as_i64());
    let items = draft_items("ratelimit", &refused.text("ratelimit").unwrap()).unwrap();
    assert_eq!(items.keys().collect::<Vec<_>>(), ["rows"]);
    let retry = refused.number("retry-after").unwrap();
    assert_eq!(items["rows"].get("r"), Some(&Param::Integer(0)));
    assert_eq!(items["rows"].get("t"), Some(&Param::Integer(retry)));
    assert_eq!(body["retry_after"].as_i64(), Some(retry));
    let rows: Option<i64> = cmd("HGET")
        .arg("qag:quota:acme~q")
        .arg("rows")
        .query(&mut con)
        .unwrap();
    assert_eq!(rows, Some(120));
}

/// Issue 35: a limit in shadow counts as usual and refuses no one: 200 requests at once
/// over a key bucket of 60 a minute are all answered 200; the limit's counts show 60
/// allowed (and what refilled meanwhile, one a second) and the rest refused; its
/// refusals are logged once a second, not once a request.
#[tokio::test(flavor = "multi_thread")]
async fn a_limit_in_shadow_counts_and_refuses_no_one() {
    if external("a_limit_in_shadow_counts_and_refuses_no_one") {
        return;
    }
    let server = Server::start(&ServerOptions::default());
    let log = std::env::temp_dir().join(format!("qag-shadow-{}.log", std::process::id()));
    let flags = ["--key-limit", "60/60", "--shadow", "key"];
    let gateway = Gateway::start_logging(&server, &flags, Some(&log));
    let client = reqwest::Client::new();
    let started = Instant::now();
    let requests: Vec<_> = (0..200)
        .map(|_| {
            let request = client.get(gateway.url("key=acme~shadow")).send();
            tokio::spawn(async move { answer(request.await.unwrap()).await })
        })
        .collect();
    let mut answers = Vec::new();
    for request in requests {
        answers.push(request.await.unwrap());
    }
    let elapsed = started.elapsed().as_secs_f64();
    assert!(answers.iter().all(|answer| answer.status == 200));
    assert!(answers
        .iter()
        .all(|answer| answer.text("retry-after").is_none()));
    let refused = answers
        .iter()
        .filter(|answer| answer.number("x-ratelimit-key-remaining") == Some(0))
        .count();
    let counts = reqwest::get(format!("{}/limits", gateway.base));
    let counts = counts.await.unwrap().text().await.unwrap();
    let counts: serde_json::Value = serde_json::from_str(&counts).unwrap();
    let key = &counts["key"];
    let (allowed, refused_counted) = (
        key["allowed"].as_u64().unwrap(),
        key["refused"].as_u64().unwrap(),
    );
    assert_eq!(key["shadow"], true);
    assert_eq!(allowed + refused_counted, 200, "{counts}");
    let refilled = elapsed.ceil() as u64;
    assert!(
        (60..=60 + refilled).contains(&allowed),
        "{counts} in {elapsed:.2} s"
    );
    assert!(
        refused >= refused_counted as usize,
        "{refused} answers said 0 left"
    );
    drop(gateway);
    let text = std::fs::read_to_string(&log).unwrap();
    std::fs::remove_file(&log).ok();
    let lines: Vec<&str> = text
        .lines()
        .filter(|line| line.contains("shadow: the key limit refused"))
        .collect();
    assert!(
        (1..=1 + refilled as usize).contains(&lines.len()),
        "{} lines in {elapsed:.2} s: {text}",
        lines.len()
    );
}

/// Issue 36: with `--wait`, a request over its key's bucket waits for its token instead
/// of a 429, and says how long in `server-timing`; one whose token would come after its
/// wait is refused at once, with the same body and headers as without a wait.
#[tokio::test(flavor = "multi_thread")]
async fn a_request_waits_for_its_turn_instead_of_a_429() {
    if external("a_request_waits_for_its_turn_instead_of_a_429") {
        return;
    }
    let _timed = Cores::shared();
    let server = Server::start(&ServerOptions::default());
    let waiting = Gateway::start(&server, &["--key-limit", "2/1", "--wait", "1500"]);
    let url = waiting.url("key=acme~wait");
    for _ in 0..2 {
        let (status, fields, _) = get(&url).await;
        assert_eq!(status, 200);
        assert!(
            !fields.iter().any(|f| f.starts_with("server-timing")),
            "{fields:?}"
        );
    }
    let started = Instant::now();
    let (status, fields, _) = get(&url).await;
    let took = started.elapsed();
    assert_eq!(status, 200, "{fields:?}");
    assert!(
        took >= Duration::from_millis(150) && took < Duration::from_millis(900),
        "{took:?}"
    );
    let timing = fields
        .iter()
        .find_map(|f| f.strip_prefix("server-timing=qag-wait;dur="))
        .unwrap_or_else(|| panic!("no server-timing: {fields:?}"));
    let waited: u64 = timing.parse().unwrap();
    // Its token comes half a second after the first of the two (less what the two took).
    assert!((150..900).contains(&waited), "{waited}");
    // A wait that cannot fit: the 429 at once, as a gateway without waits answers it.
    let short = Gateway::start(&server, &["--key-limit", "2/1", "--wait", "100"]);
    let plain = Gateway::start(&server, &["--key-limit", "2/1"]);
    let (url_short, url_plain) = (short.url("key=acme~short"), plain.url("key=acme~plain"));
    for url in [&url_short, &url_plain] {
        for _ in 0..2 {
            assert_eq!(get(url).await.0, 200);
        }
    }
    let started = Instant::now();
    let (status, fields, body) = get(&url_short).await;
    assert!(started.elapsed() < Duration::from_millis(200));
    let (plain_status, plain_fields, plain_body) = get(&url_plain).await;
    assert_eq!((status, plain_status), (429, 429));
    assert_eq!(fields, plain_fields);
    assert_eq!(without_request_id(&body), without_request_id(&plain_body));
}

/// Issue 44: a key of 10 a second, drained; 20 requests wait for their turn, and their
/// HTTP clients give up after 0.3 s. hyper sees each connection close and drops the
/// request's future, and with it the waiting call's connection: the server gives the
/// token back, so a request sent after them is served at once, not 2 s later.
#[tokio::test(flavor = "multi_thread")]
async fn a_client_that_leaves_while_its_request_waits_gives_back() {
    if external("a_client_that_leaves_while_its_request_waits_gives_back") {
        return;
    }
    let _timed = Cores::shared();
    let server = Server::start(&ServerOptions::default());
    let mut con = server.client().get_connection().unwrap();
    let gateway = Gateway::start(&server, &["--key-limit", "10/1", "--wait", "8000"]);
    let url = gateway.url("key=acme~leave");
    assert_eq!(get(&url).await.0, 200);
    // Drained at once (10 calls one after another would take a refill's worth).
    let _: Value = cmd("QAG.TAKE")
        .arg("qag:ratelimit:key:10/1:acme~leave")
        .arg(&[10, 1])
        .arg("COST")
        .arg(9)
        .query(&mut con)
        .unwrap();
    let impatient = reqwest::Client::builder()
        .timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let leaving: Vec<_> = (0..20)
        .map(|_| {
            let (client, url) = (impatient.clone(), url.clone());
            tokio::spawn(async move { client.get(&url).send().await })
        })
        .collect();
    let mut served = 0;
    for request in leaving {
        if let Ok(response) = request.await.unwrap() {
            served += u64::from(response.status() == 200);
        }
    }
    drop(impatient);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let started = Instant::now();
    assert_eq!(get(&url).await.0, 200);
    let took = started.elapsed();
    // Those whose token came within 0.3 s were served; the others gave it back (but
    // for one whose answer was on its way as its client gave up: it was sent).
    assert!(served <= 5, "{served}");
    let given_back = info_field(&mut con, "qag_wait_given_back");
    assert!(
        given_back + 2 + served >= 20,
        "{served} served, {given_back} given back"
    );
    assert!(
        took < Duration::from_millis(500),
        "the request after them waited {took:?}"
    );
    assert_eq!(info_field(&mut con, "qag_waiters"), 0);
}

/// With every connection for waits taken (`--max-waiting 1`), a request that would wait
/// is answered as without a wait, as the server answers one beyond MAX-WAITERS: a 429
/// with the bucket's fields, not a 503 (it was: `Error::Busy`). A wait longer than the
/// deadline (0.5 s) is waited whole.
#[tokio::test(flavor = "multi_thread")]
async fn a_request_beyond_max_waiting_is_answered_at_once() {
    if external("a_request_beyond_max_waiting_is_answered_at_once") {
        return;
    }
    let _timed = Cores::shared();
    let server = Server::start(&ServerOptions::default());
    let mut con = server.client().get_connection().unwrap();
    let flags = ["--key-limit", "2/8", "--wait", "6000", "--max-waiting", "1"];
    let gateway = Gateway::start(&server, &flags);
    let url = gateway.url("key=acme~full");
    for _ in 0..2 {
        assert_eq!(get(&url).await.0, 200);
    }
    let waiting = tokio::spawn({
        let url = url.clone();
        async move { get(&url).await } // its token in 4 s, less what the two took
    });
    let until = Instant::now() + Duration::from_secs(3);
    while info_field(&mut con, "qag_waiters") < 1 {
        assert!(Instant::now() < until, "the third request never waited");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let started = Instant::now();
    let (status, fields, body) = get(&url).await;
    let took = started.elapsed();
    assert_eq!(status, 429, "{body}");
    assert!(body.contains(r#""code":"rate_limited""#), "{body}");
    assert!(
        fields.contains(&"x-ratelimit-key-remaining=0".to_string()),
        "{fields:?}"
    );
    // Its queue time for a connection (the deadline, 0.5 s), then an answer at once.
    assert!(took < Duration::from_millis(1500), "{took:?}");
    let (status, fields, _) = waiting.await.unwrap();
    assert_eq!(status, 200, "{fields:?}");
    assert!(
        fields
            .iter()
            .any(|f| f.starts_with("server-timing=qag-wait")),
        "{fields:?}"
    );
}

fn info_field(con: &mut Connection, name: &str) -> u64 {
    let info: String = cmd("INFO").arg("qag").query(con).unwrap();
    info.lines()
        .find_map(|line| line.strip_prefix(name)?.strip_prefix(':'))
        .and_then(|value| value.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {name} in INFO"))
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
