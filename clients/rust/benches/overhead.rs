//! The crate's cost per call over a raw `redis::cmd("QAG.TAKE")`, one caller at a
//! time on loopback: `cargo bench -p qag-client --bench overhead`. Starts its own Redis
//! with the module (REDIS_SERVER, default Debian's redis-server), interleaves the two
//! ways call by call, and prints the round trip of each and the difference.

#[path = "../../../tests/common/mod.rs"]
mod common;

use std::time::Instant;

use common::*;
use qag_client::{Bucket, Limiter};

const CALLS: usize = 100_000;

fn percentile(values: &mut [f64], share: f64) -> f64 {
    values.sort_by(f64::total_cmp);
    values[((values.len() - 1) as f64 * share) as usize]
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let server = Server::start(&ServerOptions::default());
    let client = server.client();
    let mut raw = client.get_multiplexed_async_connection().await.unwrap();
    let limiter = Limiter::new(client.get_multiplexed_async_connection().await.unwrap());
    // Interleaved call by call, the order swapped every call, so that the machine's
    // drift weighs on both alike.
    let (mut raw_micros, mut crate_micros) = (Vec::new(), Vec::new());
    for n in 0..CALLS {
        let key = n % 1000;
        for way in [n % 2, 1 - n % 2] {
            let started = Instant::now();
            if way == 0 {
                let _: Vec<i64> = redis::cmd("QAG.TAKE")
                    .arg(format!("qag:raw:{key}"))
                    .arg(1_000_000)
                    .arg(60)
                    .query_async(&mut raw)
                    .await
                    .unwrap();
                raw_micros.push(started.elapsed().as_secs_f64() * 1e6);
            } else {
                limiter
                    .take(
                        &Bucket::with_key(format!("qag:crate:{key}"), 1_000_000, 60.0),
                        1,
                    )
                    .await
                    .unwrap();
                crate_micros.push(started.elapsed().as_secs_f64() * 1e6);
            }
        }
    }
    let mean = |values: &[f64]| values.iter().sum::<f64>() / values.len() as f64;
    let (raw_mean, crate_mean) = (mean(&raw_micros), mean(&crate_micros));
    let (raw_p50, crate_p50) = (
        percentile(&mut raw_micros, 0.5),
        percentile(&mut crate_micros, 0.5),
    );
    println!("{CALLS} calls each, interleaved, one caller on loopback:");
    println!("  raw QAG.TAKE:   p50 {raw_p50:.2} µs, mean {raw_mean:.2} µs");
    println!("  Limiter::take:  p50 {crate_p50:.2} µs, mean {crate_mean:.2} µs");
    println!(
        "  overhead: p50 {:+.2} µs ({:+.1} %), mean {:+.2} µs ({:+.1} %)",
        crate_p50 - raw_p50,
        (crate_p50 - raw_p50) / raw_p50 * 100.0,
        crate_mean - raw_mean,
        (crate_mean - raw_mean) / raw_mean * 100.0
    );
}
