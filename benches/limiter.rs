//! Microbenchmarks of the pure limiter code: what a command spends outside Redis.
//! Run with `cargo bench`.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion};
use qag_core::bucket::{self, Limit, State};
use qag_core::number::format_number;

const NOW: f64 = 1_764_441_000.123456;

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
                black_box(1.0),
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
        b.iter(|| bucket::parse_take(black_box(&args[..])))
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
        let mut buffer = ryu::Buffer::new();
        b.iter(|| format_number(&mut buffer, black_box(NOW)).len())
    });
}

criterion_group!(benches, token_bucket);
criterion_main!(benches);
