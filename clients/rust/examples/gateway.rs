//! A gateway's use of qag-client: both buckets of a request, a calls quota, a slot held
//! for the query's length, the headers to send, and the data plane's outage rule.
//! Run: cargo run -p qag-client --example gateway -- redis://127.0.0.1:6379/
use std::time::Duration;

use qag_client::{Bucket, Error, Headers, Lease, Limiter, OnUnavailable, Options, Per, Quota};
use redis::aio::ConnectionManager;

/// The answer to one request: its status and header fields.
async fn handle(
    limiter: &Limiter<ConnectionManager>,
    client_ip: &str,
    api_key: &str, // "<workspace>~<name>"
    request_id: &str,
) -> Result<(u16, http::HeaderMap), Error> {
    // ADR 0032's names: the address's bucket is its own, whatever key it uses.
    let per_ip = Bucket::named("client", 20, 1.0, client_ip);
    let per_key = Bucket::named("key", 100, 60.0, api_key);
    let pair = limiter.take_pair(&per_ip, &per_key, 1).await?;
    if !pair.allowed() {
        return Ok((429, Headers::new().pair(&pair).header_map()));
    }
    let quota = Quota {
        per: Per::Month,
        zone: "Europe/Berlin".into(),
        calls: Some(100_000),
        rows: None,
    };
    let quota_key = format!("qag:quota:{api_key}");
    let check = limiter.quota_check(&quota_key, &quota).await?;
    if !check.allowed {
        return Ok((429, Headers::new().pair(&pair).quota(&check).header_map()));
    }
    let slots = format!("qag:running:{api_key}");
    let ttl = Duration::from_secs(30);
    let guard = match limiter.lease(&slots, 4, ttl, request_id).await? {
        Lease::Held(guard) => guard,
        Lease::Refused(refusal) => {
            let fields = Headers::new().pair(&pair).lease_refused(&refusal);
            return Ok((429, fields.header_map())); // too_many_concurrent
        }
    };
    tokio::time::sleep(Duration::from_millis(10)).await; // the query; renewed meanwhile
    drop(guard); // released in the background; never fails the request
    let usage = limiter.quota_add(&quota_key, &quota, 1, 0).await?;
    let quota = check.after_add(&usage); // the last allowed call says 0 left
    Ok((200, Headers::new().pair(&pair).quota(&quota).header_map()))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::args().nth(1);
    let url = url.as_deref().unwrap_or("redis://127.0.0.1:6379/");
    // When Redis fails: let requests through uncounted, and leave Redis alone for 5 s
    // (at most one 0.5 s timeout every 5 s).
    let options = Options {
        on_unavailable: OnUnavailable::Forward,
        ..Options::default()
    };
    let limiter = Limiter::connect(url, options).await?;
    match handle(&limiter, "203.0.113.9", "acme~partner", "req-1").await {
        Ok((status, fields)) => println!("{status} {fields:?}"),
        // Permission, WRONGTYPE, a missing module for leases: a configuration error.
        Err(error) => println!("500: {error}"),
    }
    Ok(())
}
