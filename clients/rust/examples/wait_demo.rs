//! Why a gateway waits: an upstream that answers 429 above 10 calls a second (a model
//! provider's hard rate limit), behind a gateway, driven by 50 concurrent callers. Three
//! runs, each `--seconds` long:
//!
//! - `none`: the gateway forwards every call: the upstream refuses what is over its rate.
//! - `take`: the gateway takes from a qag bucket of 10 a second (QAG.TAKE) first: it
//!   answers 429 itself for what is over, and the upstream refuses nothing.
//! - `wait`: the same bucket with a wait (QAG.TAKE … WAIT): every call is delayed to its
//!   turn, in arrival order across callers, and answered; none refused anywhere.
//!
//! cargo run --release -p qag-client --example wait_demo -- --redis redis://127.0.0.1:6379/ \
//!   [--callers 50] [--seconds 20] [--wait-ms 10000] [--runs none,take,wait]
//!
//! Prints one line a run: calls answered 200, refused by the gateway, refused by the
//! upstream, and the calls' latency (p50, p99, max).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use qag_client::{Bucket, Limiter, Options};

/// The upstream's own limit: 10 calls a second, a burst of 10 (a token bucket).
struct Upstream {
    state: Mutex<(f64, Instant)>,
}

impl Upstream {
    const RATE: f64 = 10.0;

    fn new() -> Upstream {
        Upstream {
            state: Mutex::new((Self::RATE, Instant::now())),
        }
    }

    /// True: served; false: 429.
    fn call(&self) -> bool {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let (tokens, at) = *state;
        let now = Instant::now();
        let tokens = (tokens + now.duration_since(at).as_secs_f64() * Self::RATE).min(Self::RATE);
        let served = tokens >= 1.0;
        *state = (if served { tokens - 1.0 } else { tokens }, now);
        served
    }
}

#[derive(Default)]
struct Tally {
    served: AtomicU64,
    gateway_429: AtomicU64,
    upstream_429: AtomicU64,
    latencies: Mutex<Vec<Duration>>,
    /// The run, to its last answer.
    took: Mutex<Duration>,
}

struct Run {
    name: &'static str,
    limiter: Option<Limiter<redis::aio::ConnectionManager>>,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse(std::env::args().skip(1))?;
    let options = Options {
        max_waiting: args.callers,
        ..Options::default()
    };
    let limiter = Limiter::connect(&args.redis, options).await?;
    // The gateway's bucket: the upstream's rate, one call at a time (a burst of 1), so
    // its calls reach the upstream spaced out, never more than it serves.
    let bucket = Bucket::with_key(format!("qag:demo:upstream:{}", std::process::id()), 1, 0.1);
    for name in &args.runs {
        let run = match name.as_str() {
            "none" => Run {
                name: "none",
                limiter: None,
            },
            "take" => Run {
                name: "take",
                limiter: Some(limiter.clone()),
            },
            "wait" => Run {
                name: "wait",
                limiter: Some(limiter.with_wait(Duration::from_millis(args.wait_ms))?),
            },
            other => return Err(format!("--runs: none, take or wait, not {other}").into()),
        };
        let tally = drive(&run, &bucket, &args).await;
        report(run.name, &tally, &args);
        // The next run starts from a full bucket and a rested upstream.
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Ok(())
}

/// `--callers` callers, each calling again as soon as it is answered (after the
/// `retry-after` of a 429), for `--seconds`; the calls under way then are finished.
async fn drive(run: &Run, bucket: &Bucket, args: &Args) -> Arc<Tally> {
    let (upstream, tally) = (Arc::new(Upstream::new()), Arc::new(Tally::default()));
    let started = Instant::now();
    let until = started + Duration::from_secs_f64(args.seconds);
    let callers: Vec<_> = (0..args.callers)
        .map(|_| {
            let (limiter, bucket) = (run.limiter.clone(), bucket.clone());
            let (upstream, tally) = (upstream.clone(), tally.clone());
            tokio::spawn(async move {
                while Instant::now() < until {
                    let started = Instant::now();
                    if let Some(limiter) = &limiter {
                        match limiter.take(&bucket, 1).await {
                            Ok(decision) if decision.allowed => {}
                            Ok(decision) => {
                                tally.gateway_429.fetch_add(1, Ordering::Relaxed);
                                // A caller told to retry after a while does.
                                let wait = decision.retry_after.seconds().unwrap_or(1).max(1);
                                tokio::time::sleep(Duration::from_secs(wait)).await;
                                continue;
                            }
                            Err(error) => panic!("the limiter failed: {error}"),
                        }
                    }
                    if upstream.call() {
                        tally.served.fetch_add(1, Ordering::Relaxed);
                        let took = started.elapsed();
                        tally
                            .latencies
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .push(took);
                    } else {
                        tally.upstream_429.fetch_add(1, Ordering::Relaxed);
                        // The upstream's 429 says `retry-after: 1`.
                        tokio::time::sleep(Duration::from_secs(1)).await;
                    }
                }
            })
        })
        .collect();
    for caller in callers {
        let _ = caller.await;
    }
    *tally.took.lock().unwrap_or_else(|e| e.into_inner()) = started.elapsed();
    tally
}

fn report(name: &str, tally: &Tally, args: &Args) {
    let served = tally.served.load(Ordering::Relaxed);
    let gateway = tally.gateway_429.load(Ordering::Relaxed);
    let upstream = tally.upstream_429.load(Ordering::Relaxed);
    let all = (served + gateway + upstream).max(1);
    let mut latencies = tally
        .latencies
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    latencies.sort();
    let at = |share: f64| {
        let index =
            ((latencies.len() as f64 * share) as usize).min(latencies.len().saturating_sub(1));
        latencies.get(index).map_or(0, Duration::as_millis)
    };
    let took = tally
        .took
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .as_secs_f64();
    println!(
        "{name}: {} callers, {took:.1} s: {served} served ({:.1}/s), {gateway} refused by the gateway ({:.0}%), \
         {upstream} refused by the upstream ({:.0}%); served in p50 {} ms, p99 {} ms, max {} ms",
        args.callers,
        served as f64 / took.max(0.001),
        100.0 * gateway as f64 / all as f64,
        100.0 * upstream as f64 / all as f64,
        at(0.5),
        at(0.99),
        latencies.last().map_or(0, Duration::as_millis),
    );
}

/// The command line.
struct Args {
    redis: String,
    callers: usize,
    seconds: f64,
    wait_ms: u64,
    runs: Vec<String>,
}

impl Args {
    fn parse(mut words: impl Iterator<Item = String>) -> Result<Args, String> {
        let mut args = Args {
            redis: "redis://127.0.0.1:6379/".into(),
            callers: 50,
            seconds: 20.0,
            wait_ms: 10_000,
            runs: vec!["none".into(), "take".into(), "wait".into()],
        };
        while let Some(flag) = words.next() {
            let value = words.next().ok_or(format!("{flag} needs a value"))?;
            let bad = format!("{flag}: {value}");
            match flag.as_str() {
                "--redis" => args.redis = value,
                "--callers" => args.callers = value.parse().map_err(|_| bad)?,
                "--seconds" => args.seconds = value.parse().map_err(|_| bad)?,
                "--wait-ms" => args.wait_ms = value.parse().map_err(|_| bad)?,
                "--runs" => args.runs = value.split(',').map(str::to_owned).collect(),
                _ => return Err(format!("unknown flag {flag}")),
            }
        }
        Ok(args)
    }
}
