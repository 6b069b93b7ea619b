//! A gateway on axum, limited by qag's tower layer: the address's bucket, the key's
//! bucket, its quota of calls (and rows) and its concurrent queries, with the answers of
//! ADR 0032; and, with `--tpm`, a model call's window chain: its estimate of tokens held,
//! charged as it streams and committed.
//!
//! cargo run --release -p qag-client --features tower --example axum_gateway -- \
//!   --redis redis://127.0.0.1:6379/ --listen 127.0.0.1:8080 [--client-limit 20/1] \
//!   [--key-limit 60/60] [--max-concurrent 4] [--quota-calls 100000] [--quota-rows N] \
//!   [--quota-per month --quota-tz Europe/Berlin] [--tpm 100000 [--rpm 60]] \
//!   [--shadow key,quota,window,...] \
//!   [--policy raise|forward|local] [--back-off 5] [--wait 500 [--max-waiting 100]]
//!
//! `--wait MS`: a request waits up to MS milliseconds for its buckets' tokens and its
//! slot instead of a 429 (its `server-timing` says how long); at most `--max-waiting`
//! wait at once, a request beyond them is answered at once.
//!
//! GET /v1/query?key=K[&work_ms=N][&chunks=N][&rows=N][&reserve=T][&tokens=A]: a small
//! JSON body after work_ms, or a body streamed in `chunks` pieces over work_ms; `rows`
//! are reported for the key's rows quota. With `--tpm`, the layer holds `reserve` tokens
//! (default 1000) for the request on the key's `qag:win:{K}:tokens` (`--rpm` requests and
//! `--tpm` tokens a minute); the handler is charged `tokens` (default `reserve`) in the
//! end, in parts while it streams; a request cancelled before its end commits what it
//! charged, releasing its hold. Its answers carry the window's OpenAI-style
//! `x-ratelimit-*-requests` and `-tokens` fields.
//!
//! GET /limits (not limited): how each limit answered, `{"key":{"allowed":N,
//! "refused":N,"shadow":false},...}`: the numbers to watch for a limit in `--shadow`.
use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{ConnectInfo, Query};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Extension, Router};
use qag_client::tower::{Admitted, KeyLimits, LimitName, RateLimitLayer, TokenHold, WindowLimit};
use qag_client::{Limiter, OnUnavailable, Options, Per, Quota, Scope};
use redis::aio::ConnectionManager;

async fn query(
    Query(work): Query<HashMap<String, String>>,
    Extension(admitted): Extension<Admitted>,
) -> Response {
    let number = |name: &str| work.get(name).and_then(|n| n.parse::<u64>().ok());
    let wait = Duration::from_millis(number("work_ms").unwrap_or(0));
    let used = number("tokens").or(number("reserve")).unwrap_or(1000);
    // The rows the query returned, for the key's rows quota.
    admitted.rows.add(number("rows").unwrap_or(0));
    let hold = admitted.window.clone();
    let Some(chunks) = number("chunks").filter(|n| *n > 0) else {
        tokio::time::sleep(wait).await; // the model call; a cancel commits what was charged
        if let Some(hold) = &hold {
            commit(hold, used).await;
        }
        let body = format!("{{\"request_id\":\"{}\"}}", admitted.request_id);
        return body.into_response();
    };
    let pieces = futures_util::stream::unfold(0, move |sent| {
        let hold = hold.clone();
        async move {
            if sent == chunks {
                if let Some(hold) = &hold {
                    commit(hold, used).await;
                }
                return None;
            }
            tokio::time::sleep(wait / chunks as u32).await;
            if let Some(hold) = &hold {
                // Each piece's share of the count, paid as it streams.
                let _ = hold.charge(used / chunks).await;
            }
            let piece = Ok::<_, std::io::Error>(format!("row {sent}\n"));
            Some((piece, sent + 1))
        }
    });
    Body::from_stream(pieces).into_response()
}

/// The response's actual count; a commit that fails goes on in the background.
async fn commit(hold: &TokenHold, used: u64) {
    if let Err(error) = hold.commit(used).await {
        eprintln!("committing {used} tokens: {error}");
    }
}

/// The query's `reserve` parameter: the tokens a model call holds (default 1000).
fn estimate(parts: &axum::http::request::Parts) -> u64 {
    let query = parts.uri.query().unwrap_or_default();
    let value = query
        .split('&')
        .find_map(|pair| pair.strip_prefix("reserve="));
    value.and_then(|n| n.parse().ok()).unwrap_or(1000)
}

/// How each limit answered, as JSON.
fn limit_counts(layer: &RateLimitLayer<ConnectionManager>) -> String {
    let counts: Vec<String> = LimitName::ALL
        .iter()
        .map(|&limit| {
            let counts = layer.limit_counts(limit);
            format!(
                r#""{}":{{"allowed":{},"refused":{},"shadow":{}}}"#,
                limit.as_str(),
                counts.allowed,
                counts.refused,
                counts.shadow
            )
        })
        .collect();
    format!("{{{}}}", counts.join(","))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse(std::env::args().skip(1))?;
    // The layer logs through `log` (503s, limits in shadow): warnings to standard error.
    env_logger::Builder::new()
        .filter_level(log::LevelFilter::Warn)
        .init();
    let options = Options {
        on_unavailable: args.policy,
        back_off: args.back_off,
        max_waiting: args.max_waiting,
        ..Options::default()
    };
    let limiter = Limiter::connect(&args.redis, options).await?;
    let mut limits = RateLimitLayer::new(limiter)
        .client_address(|parts| {
            let peer = parts.extensions.get::<ConnectInfo<SocketAddr>>()?;
            Some(peer.0.ip().to_string())
        })
        .api_key(|parts| {
            let query = parts.uri.query()?;
            let pair = query.split('&').find_map(|pair| pair.strip_prefix("key="));
            pair.map(str::to_owned)
        })
        .key_limits(KeyLimits {
            bucket: args.key_limit,
            max_concurrent: args.max_concurrent,
            quota: args.quota,
        });
    if let Some((count, period)) = args.client_limit {
        limits = limits.client_bucket(count, period);
    }
    if let Some(tpm) = args.tpm {
        let rpm = args.rpm;
        // A model call's chain: its key's requests and tokens a minute, the query's
        // estimate held until the handler commits.
        limits = limits.window_limit(move |parts, key| {
            Some(WindowLimit {
                scopes: vec![Scope {
                    key: format!("qag:win:{{{}}}:tokens", key?),
                    rpm,
                    tpm,
                }],
                estimate: estimate(parts),
                window: None,
                hold: None,
            })
        });
    }
    for &limit in &args.shadow {
        limits = limits.shadow(limit);
    }
    if let Some(wait) = args.wait {
        for limit in [LimitName::Client, LimitName::Key, LimitName::Concurrency] {
            limits = limits.wait(limit, wait);
        }
    }
    let watched = limits.clone();
    let app = Router::new()
        .route("/v1/query", get(query))
        .layer(limits)
        // Added after the layer: not limited.
        .route(
            "/limits",
            get(move || async move { limit_counts(&watched) }),
        );
    let listener = tokio::net::TcpListener::bind(&args.listen).await?;
    println!("listening on {}", listener.local_addr()?);
    let service = app.into_make_service_with_connect_info::<SocketAddr>();
    axum::serve(listener, service).await?;
    Ok(())
}

/// The command line.
struct Args {
    redis: String,
    listen: String,
    client_limit: Option<(u64, f64)>,
    key_limit: Option<(u64, f64)>,
    max_concurrent: Option<u64>,
    quota: Option<Quota>,
    rpm: u64,
    tpm: Option<u64>,
    shadow: Vec<LimitName>,
    policy: OnUnavailable,
    back_off: Duration,
    wait: Option<Duration>,
    max_waiting: usize,
}

impl Args {
    fn parse(mut words: impl Iterator<Item = String>) -> Result<Args, String> {
        let mut args = Args {
            redis: "redis://127.0.0.1:6379/".into(),
            listen: "127.0.0.1:8080".into(),
            client_limit: None,
            key_limit: None,
            max_concurrent: None,
            quota: None,
            rpm: 0,
            tpm: None,
            shadow: Vec::new(),
            policy: OnUnavailable::Raise,
            back_off: Options::default().back_off,
            wait: None,
            max_waiting: Options::default().max_waiting,
        };
        let (mut calls, mut rows, mut per, mut zone) = (None, None, Per::Month, "UTC".to_string());
        while let Some(flag) = words.next() {
            let value = words.next().ok_or(format!("{flag} needs a value"))?;
            let number = |what: &str| value.parse::<u64>().map_err(|_| format!("{what}: {value}"));
            match flag.as_str() {
                "--redis" => args.redis = value,
                "--listen" => args.listen = value,
                "--client-limit" => args.client_limit = Some(rate(&value)?),
                "--key-limit" => args.key_limit = Some(rate(&value)?),
                "--max-concurrent" => args.max_concurrent = Some(number("--max-concurrent")?),
                "--rpm" => args.rpm = number("--rpm")?,
                "--wait" => args.wait = Some(Duration::from_millis(number("--wait")?)),
                "--max-waiting" => {
                    args.max_waiting = usize::try_from(number("--max-waiting")?)
                        .ok()
                        .filter(|most| *most >= 1)
                        .ok_or(format!("--max-waiting: at least 1, not {value}"))?
                }
                "--tpm" => args.tpm = Some(number("--tpm")?),
                "--shadow" => {
                    for name in value.split(',') {
                        let limit = LimitName::ALL.into_iter().find(|l| l.as_str() == name);
                        args.shadow
                            .push(limit.ok_or(format!("--shadow: no limit {name}"))?);
                    }
                }
                "--back-off" => {
                    let seconds = value
                        .parse::<f64>()
                        .ok()
                        .filter(|s| (0.0..=86_400.0).contains(s));
                    args.back_off = Duration::from_secs_f64(
                        seconds.ok_or(format!("--back-off: seconds, not {value}"))?,
                    );
                }
                "--quota-calls" => calls = Some(number("--quota-calls")?),
                "--quota-rows" => rows = Some(number("--quota-rows")?),
                "--quota-tz" => zone = value,
                "--quota-per" => {
                    per = match value.as_str() {
                        "day" => Per::Day,
                        "month" => Per::Month,
                        _ => return Err(format!("--quota-per: day or month, not {value}")),
                    }
                }
                "--policy" => {
                    args.policy = match value.as_str() {
                        "raise" => OnUnavailable::Raise,
                        "forward" => OnUnavailable::Forward,
                        "local" => OnUnavailable::Local,
                        _ => return Err(format!("--policy: raise, forward or local, not {value}")),
                    }
                }
                _ => return Err(format!("unknown flag {flag}")),
            }
        }
        args.quota = (calls.is_some() || rows.is_some()).then_some(Quota {
            per,
            zone,
            calls,
            rows,
        });
        Ok(args)
    }
}

/// `COUNT/PERIOD`, e.g. `20/1`.
fn rate(text: &str) -> Result<(u64, f64), String> {
    let parsed = text
        .split_once('/')
        .and_then(|(count, period)| Some((count.parse().ok()?, period.parse().ok()?)));
    parsed.ok_or(format!("a rate is COUNT/PERIOD, not {text}"))
}
