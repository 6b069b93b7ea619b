//! The tower layer on an axum app, whole: every address's bucket, each API key's bucket,
//! monthly quota and concurrent requests, the answers and headers of ADR 0032, the key
//! from the `x-api-key` header and the address from the connection.
//! Run: cargo run -p qag-client --features tower --example tower_layer -- \
//!   redis://127.0.0.1:6379/ 127.0.0.1:8080
use std::net::SocketAddr;

use axum::extract::ConnectInfo;
use axum::routing::get;
use axum::{Extension, Router};
use qag_client::tower::{Admitted, KeyLimits, RateLimitLayer};
use qag_client::{Limiter, Options, Per, Quota};

/// The handler: admitted by every limit (the layer answered the others), with the
/// decisions in the `Admitted` extension.
async fn query(Extension(admitted): Extension<Admitted>) -> String {
    admitted.rows.add(250); // rows this call returned, counted in the key's quota
    format!("{{\"request_id\":\"{}\"}}\n", admitted.request_id)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let url = args.next().unwrap_or("redis://127.0.0.1:6379/".into());
    let listen = args.next().unwrap_or("127.0.0.1:8080".into());
    // The layer logs through the `log` crate (503s while Redis fails, limits in
    // shadow): without a logger installed its lines go nowhere.
    env_logger::Builder::new()
        .filter_level(log::LevelFilter::Warn)
        .init();
    let limiter = Limiter::connect(&url, Options::default()).await?;
    let quota = Quota {
        per: Per::Month,
        zone: "Europe/Berlin".into(),
        calls: Some(100_000),
        rows: Some(10_000_000),
    };
    let limits = RateLimitLayer::new(limiter)
        .client_bucket(20, 1.0)
        .client_address(|parts| {
            let peer = parts.extensions.get::<ConnectInfo<SocketAddr>>()?;
            Some(peer.0.ip().to_string())
        })
        .api_key(|parts| {
            let key = parts.headers.get("x-api-key")?.to_str().ok()?;
            Some(key.to_owned())
        })
        .key_limits(KeyLimits {
            bucket: Some((100, 60.0)),
            max_concurrent: Some(4),
            quota: Some(quota),
        });
    let app = Router::new().route("/v1/query", get(query)).layer(limits);
    let listener = tokio::net::TcpListener::bind(&listen).await?;
    println!("listening on {}", listener.local_addr()?);
    let service = app.into_make_service_with_connect_info::<SocketAddr>();
    axum::serve(listener, service).await?;
    Ok(())
}
