//! A gateway's use of qag-client: both buckets of a request, the headers to send, a
//! slot held for a query's length, and a policy for when Redis fails.
//! Run: cargo run -p qag-client --example gateway -- redis://127.0.0.1:6379/
use std::time::Duration;

use qag_client::{bucket_key, headers, Error, Lease, Limiter, OnUnavailable, Options};
use redis::aio::ConnectionManager;

/// Whether the request may go on, and the header fields to send either way.
async fn limit_request(
    limiter: &Limiter<ConnectionManager>,
    client_ip: &str,
    api_key: &str,
) -> Result<(bool, Vec<(&'static str, String)>), Error> {
    // One hash tag per API key keeps both buckets in one cluster slot.
    let per_ip = bucket_key("ip", 10, 1.0, client_ip, Some(api_key));
    let per_key = bucket_key("key", 60, 60.0, api_key, Some(api_key));
    let pair = limiter
        .take_pair(&per_ip, 10, 1.0, &per_key, 60, 60.0, 1)
        .await?;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| since.as_secs() as i64);
    let fields = headers(Some(&pair.client), pair.key.as_ref(), None, now);
    Ok((pair.allowed(), fields))
}

/// Runs a query while holding one of the key's 4 concurrent slots.
async fn run_query(
    limiter: &Limiter<ConnectionManager>,
    api_key: &str,
    request_id: &str,
) -> Result<bool, Error> {
    let slots = format!("qag:running:{api_key}");
    let guard = match limiter
        .lease(&slots, 4, Duration::from_secs(30), request_id)
        .await?
    {
        Lease::Held(guard) => guard,
        Lease::Refused(_) => return Ok(false), // 429 too_many_concurrent, Retry-After: 1
    };
    tokio::time::sleep(Duration::from_millis(10)).await; // the query; renewed meanwhile
    if guard.is_lost() {
        eprintln!("the slot ran out during the query");
    }
    guard.release().await?;
    Ok(true)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::args()
        .nth(1)
        .unwrap_or("redis://127.0.0.1:6379/".into());
    let con = redis::Client::open(url)?.get_connection_manager().await?;
    // While Redis fails, count in this process for 5 s at a time instead of erring.
    let limiter = Limiter::with_options(
        con,
        Options {
            on_unavailable: OnUnavailable::LOCAL,
            ..Options::default()
        },
    );
    match limit_request(&limiter, "203.0.113.9", "acme").await {
        Ok((true, fields)) => {
            let ran = run_query(&limiter, "acme", "req-1").await?;
            println!("{} {fields:?}", if ran { 200 } else { 429 });
        }
        Ok((false, fields)) => println!("429 {fields:?}"),
        // Under OnUnavailable::Error, this is where to fail open or closed.
        Err(error) => println!("503: {error}"),
    }
    Ok(())
}
