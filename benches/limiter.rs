//! Microbenchmarks of the pure limiter code: what a command spends outside Redis, for
//! every family (token bucket, sliding window, leases, calendar quotas).
//! Run with `cargo bench`.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion};
use qag_core::bucket::{self, Limit, State};
use qag_core::number::format_number;
use qag_core::{lease, quota, window};

const NOW: f64 = 1_764_441_000.123456;
const NOW_MICROS: i64 = 1_764_441_000_123_456;

fn token_bucket(c: &mut Criterion) {
    let limit = Limit {
        count: 60.0,
        period: 60.0,
    };
    let stored = Some(State {
        tokens: 12.5,
        ts: NOW - 0.75,
    });
    c.bench_function("bucket::take", |b| {
        b.iter(|| {
            bucket::take(
                black_box(limit),
                black_box(1),
                black_box(stored),
                black_box(NOW),
            )
        })
    });
    let args: [&[u8]; 6] = [
        b"QAG.TAKE",
        b"qag:ratelimit:key",
        b"60",
        b"60",
        b"COST",
        b"2",
    ];
    c.bench_function("bucket::parse_take", |b| {
        b.iter(|| bucket::parse_take(black_box(&args[..]), true))
    });
    c.bench_function("bucket::parse_state", |b| {
        b.iter(|| {
            bucket::parse_state(
                black_box(Some(b"12.5")),
                black_box(Some(b"1764440999.373456")),
            )
        })
    });
    c.bench_function("number::format_number", |b| {
        let mut buffer = qag_core::number::NumberBuffer::new();
        b.iter(|| format_number(&mut buffer, black_box(NOW)).len())
    });
}

fn sliding_window(c: &mut Criterion) {
    let clock = window::Clock::new(60, NOW_MICROS);
    let scope = |rpm, tpm, requests| {
        (
            window::Limits { rpm, tpm },
            window::Counters {
                requests,
                previous_requests: 2 * requests,
                tokens: 900 * requests,
                previous_tokens: 1_800 * requests,
                held: 0,
            },
        )
    };
    // Organisation, team, key: the chain QAG.ADMIT decides in one call.
    let chain = [
        scope(10_000, 2_000_000, 4_000),
        scope(1_000, 200_000, 400),
        scope(100, 20_000, 40),
    ];
    c.bench_function("window::admit (3 scopes)", |b| {
        b.iter(|| window::admit(black_box(&chain[..]), black_box(&clock), 0))
    });
    c.bench_function("window::is_stale", |b| {
        b.iter(|| window::is_stale(black_box(b"req:29407349"), black_box(&clock)))
    });
}

fn leases(c: &mut Criterion) {
    // QAG.LEASE's bookkeeping: which of the held leases are live, then the decision.
    let expiries: Vec<f64> = (0..16)
        .map(|i| (NOW_MICROS / 1000 + 1_000 * i - 4_000) as f64)
        .collect();
    c.bench_function("lease::is_live + acquire (16 held)", |b| {
        b.iter(|| {
            let now = black_box(NOW_MICROS / 1000);
            let live = expiries.iter().filter(|&&e| lease::is_live(e, now)).count();
            lease::acquire(black_box(20), live as u64, false)
        })
    });
}

fn quotas(c: &mut Criterion) {
    c.bench_function("quota::zone (Europe/Berlin)", |b| {
        b.iter(|| quota::zone(black_box(b"Europe/Berlin")))
    });
    let berlin = quota::zone(b"Europe/Berlin").expect("a bundled zone");
    c.bench_function("quota::period (month, Europe/Berlin)", |b| {
        b.iter(|| quota::period(quota::Per::Month, &berlin, black_box(NOW_MICROS)))
    });
    let utc = quota::zone(b"UTC").expect("UTC");
    c.bench_function("quota::period (day, UTC)", |b| {
        b.iter(|| quota::period(quota::Per::Day, &utc, black_box(NOW_MICROS)))
    });
}

criterion_group!(benches, token_bucket, sliding_window, leases, quotas);
criterion_main!(benches);
