//! The tower layer's CPU per request against the same calls written by hand:
//! `cargo bench -p qag-client --features tower --bench layer`. Starts its own Redis with
//! the module; each request takes both buckets, checks a calls quota, holds a slot, runs
//! a trivial handler, adds to the quota and renders the headers. Alternates rounds of
//! each way and compares this process's CPU time per request (the server's is the same
//! for both: the same commands).

#[path = "../../../tests/common/mod.rs"]
mod common;

use std::convert::Infallible;
use std::time::Duration;

use bytes::Bytes;
use common::*;
use http::{Request, Response};
use http_body_util::{BodyExt, Empty};
use qag_client::tower::{KeyLimits, RateLimitLayer};
use qag_client::{Bucket, Headers, Lease, Limiter, Per, Quota};
use redis::aio::MultiplexedConnection;
use tower::{Layer, Service, ServiceExt};

/// Rounds of each way, and requests a round (QAG_BENCH_ROUNDS, QAG_BENCH_REQUESTS;
/// QAG_BENCH_WAY=layer or hand runs one way only, e.g. under callgrind).
fn setting(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// This process's CPU time in user space: the layer's own work, without the kernel's
/// (sockets and wake-ups, the same calls either way but batched differently run to run).
fn cpu_seconds() -> f64 {
    // SAFETY: a zeroed rusage is valid, and the pointer is valid during the call.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) };
    usage.ru_utime.tv_sec as f64 + usage.ru_utime.tv_usec as f64 / 1e6
}

fn quota() -> Quota {
    Quota {
        per: Per::Month,
        zone: "UTC".into(),
        calls: Some(1_000_000_000),
        rows: None,
    }
}

async fn handler(_: Request<Empty<Bytes>>) -> Result<Response<Empty<Bytes>>, Infallible> {
    Ok(Response::new(Empty::new()))
}

/// The same calls as the layer's, written by hand as a gateway would: names built from
/// the request's address and key, a fresh lease id per request.
async fn by_hand(limiter: &Limiter<MultiplexedConnection>, n: usize) -> Response<Empty<Bytes>> {
    let (address, api_key) = ("127.0.0.1", "acme~bench");
    let client = Bucket::named("client", 1_000_000_000, 60.0, address);
    let key = Bucket::named("key", 1_000_000_000, 60.0, api_key);
    let pair = limiter.take_pair(&client, &key, 1).await.unwrap();
    let (quota, quota_key) = (quota(), format!("qag:quota:{api_key}"));
    let check = limiter.quota_check(&quota_key, &quota).await.unwrap();
    let slots = format!("qag:running:{api_key}");
    let lease_id = format!("{:x}-{n:x}", std::process::id());
    let ttl = Duration::from_secs(30);
    let Lease::Held(guard) = limiter.lease(&slots, 1000, ttl, &lease_id).await.unwrap() else {
        panic!("refused")
    };
    let mut response = handler(Request::new(Empty::new())).await.unwrap();
    let usage = limiter.quota_add(&quota_key, &quota, 1, 0).await.unwrap();
    let after = check.after_add(&usage);
    let fields = Headers::new().pair(&pair).quota(&after).header_map();
    response.headers_mut().extend(fields);
    drop(guard);
    response
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let server = Server::start(&ServerOptions::default());
    let client = server.client();
    let limiter = Limiter::new(client.get_multiplexed_async_connection().await.unwrap());
    let layer = RateLimitLayer::new(limiter.clone())
        .client_address(|_| Some("127.0.0.1".into()))
        .api_key(|_| Some("acme~bench".into()))
        .client_bucket(1_000_000_000, 60.0)
        .key_limits(KeyLimits {
            bucket: Some((1_000_000_000, 60.0)),
            max_concurrent: Some(1000),
            quota: Some(quota()),
        });
    let mut service = layer.layer(tower::service_fn(handler));
    let (rounds, requests) = (
        setting("QAG_BENCH_ROUNDS", 20),
        setting("QAG_BENCH_REQUESTS", 2000),
    );
    let only = std::env::var("QAG_BENCH_WAY").ok();
    let (mut layered, mut handwritten) = (0.0, 0.0);
    for round in 0..rounds {
        for way in [round % 2, 1 - round % 2] {
            match (only.as_deref(), way) {
                (Some("layer"), 1) | (Some("hand"), 0) => continue,
                _ => {}
            }
            let started = cpu_seconds();
            for n in 0..requests {
                if way == 0 {
                    let ready = service.ready().await.unwrap();
                    let response = ready.call(Request::new(Empty::new())).await.unwrap();
                    assert_eq!(response.status(), 200);
                    response.into_body().collect().await.unwrap();
                } else {
                    let response = by_hand(&limiter, n).await;
                    response.into_body().collect().await.unwrap();
                }
            }
            // Let the background releases finish inside the round that caused them.
            tokio::time::sleep(Duration::from_millis(50)).await;
            let spent = cpu_seconds() - started;
            if way == 0 {
                layered += spent;
            } else {
                handwritten += spent;
            }
        }
    }
    let per = |total: f64| total / (rounds * requests) as f64 * 1e6;
    println!(
        "{} requests each way, alternating rounds, this process's CPU:",
        rounds * requests
    );
    println!("  by hand:   {:.2} µs per request", per(handwritten));
    println!("  the layer: {:.2} µs per request", per(layered));
    println!(
        "  the layer costs {:+.1} %",
        (layered - handwritten) / handwritten * 100.0
    );
}
