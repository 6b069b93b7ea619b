//! QAG.THROTTLE (and CL.THROTTLE by name) against redis-cell itself, on the same keys.
//!
//! redis-cell is built from its crates.io source by `scripts/redis-cell.sh` (0.2.2, the
//! only version there) and found through QAG_CELL_MODULE; the differential tests say so
//! and skip without it. Pointed at a build of redis-cell 0.5.0 (from its repository,
//! outside this one), they also compare the edges where 0.2.2 computes otherwise or
//! aborts: they tell the two apart by how one reply rounds.

mod common;

use std::time::Duration;

use common::*;

const NANOS: i128 = 1_000_000_000;

/// One limiter's parameters and a call's quantity.
#[derive(Clone, Copy, Debug)]
struct Call {
    max_burst: i64,
    count: i64,
    period: i64,
    quantity: i64,
}

/// How a module turns a duration into the reply's seconds.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Rounding {
    /// redis-cell 0.5.0 and qag: `as_seconds_f64() as i64` (the seconds and the
    /// nanoseconds as one double, truncated), plus one for a remainder of at least a
    /// whole millisecond.
    AsSecondsF64UpFromAMillisecond,
    /// redis-cell 0.2.2: whole seconds.
    Truncated,
}

/// GCRA as redis-cell 0.5.0 computes it, written out apart from the module from its
/// code (times as whole nanoseconds, exact; the interval and `remaining` in doubles):
/// the reply and the value written (None: nothing written), for a stored TAT and a
/// clock in nanoseconds. `peek_writes`: whether a quantity of 0 rewrites the key
/// (redis-cell) or not (qag).
fn reference(
    call: Call,
    stored: Option<i128>,
    now: i128,
    rounding: Rounding,
    peek_writes: bool,
) -> ([i64; 5], Option<i128>) {
    let interval = i128::from(interval(call));
    let tolerance = interval * i128::from(call.max_burst + 1);
    let increment = interval * i128::from(call.quantity);
    let tat = stored.unwrap_or(now);
    let new_tat = if now > tat { now } else { tat } + increment;
    let allow_at = new_tat - tolerance;
    let (limited, retry, ttl, written) = if now - allow_at < 0 {
        let retry = if increment <= tolerance {
            allow_at - now
        } else {
            -NANOS
        };
        (true, retry, tat - now, None)
    } else {
        let write = call.quantity > 0 || peek_writes;
        (false, -NANOS, new_tat - now, write.then_some(new_tat))
    };
    let next = tolerance - ttl;
    let remaining = if next > -interval {
        ((next / 1000) as f64 / (interval / 1000) as f64) as i64
    } else {
        0
    };
    let seconds = |nanos: i128| match rounding {
        Rounding::Truncated => (nanos / NANOS) as i64,
        Rounding::AsSecondsF64UpFromAMillisecond => {
            let (whole, below) = ((nanos / NANOS) as i64, (nanos % NANOS) as i64);
            (whole as f64 + below as f64 / 1e9) as i64 + i64::from(below / 1_000_000 > 0)
        }
    };
    (
        [
            i64::from(limited),
            call.max_burst + 1,
            remaining,
            seconds(retry),
            seconds(ttl),
        ],
        written,
    )
}

/// The emission interval: the period's nanoseconds over the count, as doubles.
fn interval(call: Call) -> i64 {
    ((i128::from(call.period) * NANOS) as f64 / call.count as f64) as i64
}

fn server_micros(con: &mut Connection) -> i64 {
    let (s, us): (i64, i64) = cmd("TIME").query(con).unwrap();
    s * 1_000_000 + us
}

/// The stored TAT, read as redis-cell reads it (a u64, `+5` included).
fn stored(con: &mut Connection, key: &str) -> Option<i128> {
    let value: Option<String> = cmd("GET").arg(key).query(con).unwrap();
    value.map(|v| v.parse::<u64>().unwrap().into())
}

/// A server and how its throttle behaves.
struct Limiter {
    server: Server,
    command: &'static str,
    rounding: Rounding,
    peek_writes: bool,
}

impl Limiter {
    /// Calls the throttle once and checks the reply and the stored TAT against the
    /// reference at some instant between the TIME read before the call and the one
    /// read after it (the module's clock is in that window); returns the reply.
    fn call(&self, key: &str, call: Call) -> [i64; 5] {
        let mut con = self.server.client().get_connection().unwrap();
        let before = stored(&mut con, key);
        let t0 = server_micros(&mut con);
        let reply: Vec<i64> = cmd(self.command)
            .arg(key)
            .arg(call.max_burst)
            .arg(call.count)
            .arg(call.period)
            .arg(call.quantity)
            .query(&mut con)
            .unwrap();
        let t1 = server_micros(&mut con);
        let after = stored(&mut con, key);
        let reply: [i64; 5] = reply.try_into().unwrap();
        // Candidate clocks: every microsecond of the window, and, where a write shows
        // it, the exact nanosecond the module read (new TAT − increment).
        let increment = i128::from(interval(call)) * i128::from(call.quantity);
        let exact = after.map(|tat| tat - increment);
        let window = (t0..=t1).map(|us| i128::from(us) * 1000);
        let fits = window.chain(exact).any(|now| {
            let (expected, written) = reference(call, before, now, self.rounding, self.peek_writes);
            expected == reply && written.or(before) == after
        });
        assert!(
            fits,
            "{} {key} {call:?}: reply {reply:?}, stored {before:?} -> {after:?}, clock {t0}..{t1} µs",
            self.command
        );
        reply
    }

    fn copy_key_to(&self, other: &Limiter, key: &str) {
        let mut from = self.server.client().get_connection().unwrap();
        let mut to = other.server.client().get_connection().unwrap();
        let value: Option<String> = cmd("GET").arg(key).query(&mut from).unwrap();
        let expiry: i64 = cmd("PEXPIRETIME").arg(key).query(&mut from).unwrap();
        let _: () = cmd("DEL").arg(key).query(&mut to).unwrap();
        if let Some(value) = value {
            let _: () = cmd("SET")
                .arg(key)
                .arg(value)
                .arg("PXAT")
                .arg(expiry)
                .query(&mut to)
                .unwrap();
        }
    }
}

/// redis-cell's module, or None with a line saying why the test is skipped.
fn cell_module(test: &str) -> Option<String> {
    if external(test) {
        return None;
    }
    let module = std::env::var("QAG_CELL_MODULE").ok();
    if module.is_none() {
        eprintln!("{test}: skipped, QAG_CELL_MODULE is not set (scripts/test.sh builds redis-cell with scripts/redis-cell.sh)");
    }
    module
}

fn limiters(cell: &str) -> (Limiter, Limiter) {
    let qag = Limiter {
        // Every stored TAT trusted, as redis-cell does (the default skew reads one far
        // ahead as missing: see the_skew_is_a_load_argument).
        server: Server::start(&ServerOptions {
            module_args: vec!["THROTTLE-SKEW".into(), i64::MAX.to_string()],
            ..Default::default()
        }),
        command: "QAG.THROTTLE",
        rounding: Rounding::AsSecondsF64UpFromAMillisecond,
        peek_writes: false,
    };
    let server = Server::start(&ServerOptions {
        without_module: true,
        extra: vec!["--loadmodule".into(), cell.into()],
        ..Default::default()
    });
    let redis_cell = Limiter {
        rounding: cell_rounding(&server),
        server,
        command: "CL.THROTTLE",
        peek_writes: true,
    };
    (qag, redis_cell)
}

/// How the redis-cell at `server` rounds durations: a fresh limiter of 2 per 3 s is
/// full again after 1.5 s, which 0.5.0 answers as 2 and 0.2.2 as 1.
fn cell_rounding(server: &Server) -> Rounding {
    let mut con = server.client().get_connection().unwrap();
    let reply: Vec<i64> = cmd("CL.THROTTLE")
        .arg("qag:probe")
        .arg(&[0, 2, 3, 1])
        .query(&mut con)
        .unwrap();
    let _: () = cmd("DEL").arg("qag:probe").query(&mut con).unwrap();
    match reply[4] {
        2 => Rounding::AsSecondsF64UpFromAMillisecond,
        1 => Rounding::Truncated,
        other => panic!("redis-cell answered a reset of 1.5 s as {other}"),
    }
}

fn call(max_burst: i64, count: i64, period: i64, quantity: i64) -> Call {
    Call {
        max_burst,
        count,
        period,
        quantity,
    }
}

#[test]
fn the_same_sequences_give_redis_cells_replies() {
    let Some(cell) = cell_module("the_same_sequences_give_redis_cells_replies") else {
        return;
    };
    let (qag, redis_cell) = limiters(&cell);
    // (key, call, pause after it in ms)
    let sequence = [
        // A burst of max_burst + 1, then refusals.
        ("burst", call(4, 10, 1, 1), 0),
        ("burst", call(4, 10, 1, 1), 0),
        ("burst", call(4, 10, 1, 1), 0),
        ("burst", call(4, 10, 1, 1), 0),
        ("burst", call(4, 10, 1, 1), 0),
        ("burst", call(4, 10, 1, 1), 0),
        ("burst", call(4, 10, 1, 1), 250),
        // Refilled over real time: 10 a second, 250 ms later.
        ("burst", call(4, 10, 1, 1), 0),
        ("burst", call(4, 10, 1, 3), 0),
        ("burst", call(4, 10, 1, 0), 0),
        // Quantities: more than the burst never fits.
        ("quantity", call(2, 1, 60, 3), 0),
        ("quantity", call(2, 1, 60, 4), 0),
        ("quantity", call(2, 1, 60, 2), 0),
        ("quantity", call(2, 1, 60, 1), 0),
        ("quantity", call(2, 1, 60, 1), 0),
        // max_burst 0: one at a time.
        ("single", call(0, 2, 1, 1), 0),
        ("single", call(0, 2, 1, 1), 600),
        ("single", call(0, 2, 1, 1), 0),
        // Large counts and long periods.
        // 60 µs apart, in large quantities, so the state outlives the checks.
        ("large", call(100_000, 1_000_000, 60, 50_000), 0),
        ("large", call(100_000, 1_000_000, 60, 40_000), 0),
        ("large", call(100_000, 1_000_000, 60, 20_000), 0),
        ("long", call(9, 7, 86_400, 1), 0),
        ("long", call(9, 7, 86_400, 9), 0),
        ("long", call(9, 7, 86_400, 1), 0),
        ("rates", call(2, 3, 1, 1), 0),
        ("rates", call(2, 3, 1, 1), 0),
        ("rates", call(2, 3, 1, 1), 0),
        ("rates", call(2, 3, 1, 1), 0),
    ];
    let mut agreed = 0;
    for (key, c, pause) in sequence {
        let a = qag.call(key, c);
        let b = redis_cell.call(key, c);
        // Decided alike; remaining alike but for the microseconds between the calls.
        assert_eq!(a[..2], b[..2], "{key} {c:?}: qag {a:?}, redis-cell {b:?}");
        agreed += usize::from(a[2] == b[2]);
        std::thread::sleep(Duration::from_millis(pause));
    }
    assert!(agreed >= 26, "remaining agreed on {agreed} of 28 calls");
}

#[test]
fn a_limiter_moved_between_the_modules_continues_where_it_was() {
    let Some(cell) = cell_module("a_limiter_moved_between_the_modules_continues_where_it_was")
    else {
        return;
    };
    let (qag, redis_cell) = limiters(&cell);
    let c = call(2, 1, 60, 1);
    // Two taken in qag, moved to redis-cell: one left there, then refused.
    qag.call("moved", c);
    qag.call("moved", c);
    qag.copy_key_to(&redis_cell, "moved");
    assert_eq!(redis_cell.call("moved", c)[..3], [0, 3, 0]);
    assert_eq!(redis_cell.call("moved", c)[..3], [1, 3, 0]);
    // And back: still refused in qag, with redis-cell's TAT.
    redis_cell.copy_key_to(&qag, "moved");
    assert_eq!(qag.call("moved", c)[..3], [1, 3, 0]);
    let peek = qag.call("moved", call(2, 1, 60, 0));
    assert_eq!(peek[..3], [0, 3, 0]);
    // The other way round from the start.
    redis_cell.call("other", call(0, 1, 60, 1));
    redis_cell.copy_key_to(&qag, "other");
    assert_eq!(qag.call("other", call(0, 1, 60, 1))[0], 1);
}

impl Limiter {
    fn set(&self, key: &str, value: &str) {
        let mut con = self.server.client().get_connection().unwrap();
        let _: () = cmd("SET").arg(key).arg(value).query(&mut con).unwrap();
    }

    fn raw_value(&self, key: &str) -> Option<String> {
        let mut con = self.server.client().get_connection().unwrap();
        cmd("GET").arg(key).query(&mut con).unwrap()
    }
}

/// A key, the value stored in it first, a call, the exact reply when it does not depend
/// on the clock's microsecond, and whether redis-cell 0.2.2 computes it as 0.5.0 does.
type Edge<'a> = (&'a str, Option<&'a str>, Call, Option<[i64; 5]>, bool);

/// The edges where redis-cell 0.5.0's arithmetic shows: durations of 2^24 s and more
/// (seconds as a double), periods whose nanoseconds pass 2^63, stored TATs with a `+`
/// or from 2^63 to 2^64 − 1. qag is checked against the reference (0.5.0's code
/// written out) and, where its answer does not depend on the microsecond, against the
/// exact reply; redis-cell 0.5.0, when that is the one given, the same way. redis-cell
/// 0.2.2 computes these otherwise (or aborts), but for the stored `+5`.
#[test]
fn the_edges_give_redis_cell_0_5_0s_replies() {
    let Some(cell) = cell_module("the_edges_give_redis_cell_0_5_0s_replies") else {
        return;
    };
    let (qag, redis_cell) = limiters(&cell);
    let is_0_5_0 = redis_cell.rounding == Rounding::AsSecondsF64UpFromAMillisecond;
    if !is_0_5_0 {
        eprintln!("the_edges_give_redis_cell_0_5_0s_replies: redis-cell 0.2.2 (rounds down): qag alone but for the stored +5");
    }
    let two_63 = (1u64 << 63).to_string();
    let u64_max = u64::MAX.to_string();
    let cases: [Edge; 11] = [
        (
            "f64-a",
            None,
            call(5, 15, 1_000_000_000, 3),
            Some([0, 6, 3, -1, 200_000_001]),
            false,
        ),
        (
            "f64-b",
            None,
            call(100, 3, 100_000_000, 3),
            Some([0, 101, 98, -1, 100_000_001]),
            false,
        ),
        (
            "period",
            None,
            call(1, 10_000_000_000, 10_000_000_000, 1),
            Some([0, 2, 1, -1, 1]),
            false,
        ),
        // One per 10^10 s: the interval saturates at 2^63 − 1 ns; written past 2^63.
        (
            "slow",
            None,
            call(0, 1, 10_000_000_000, 1),
            Some([0, 1, 0, -1, 9_223_372_037]),
            false,
        ),
        (
            "slow",
            None,
            call(0, 1, 10_000_000_000, 1),
            Some([1, 1, 0, 9_223_372_037, 9_223_372_037]),
            false,
        ),
        (
            "plus",
            Some("+5"),
            call(1, 1, 1, 1),
            Some([0, 2, 1, -1, 1]),
            true,
        ),
        ("big", Some(&two_63), call(1, 1, 1, 1), None, false),
        (
            "big",
            Some(&two_63),
            call(9_000_000_000, 1, 1, 0),
            None,
            false,
        ),
        (
            "big",
            Some(&two_63),
            call(9_000_000_000, 1, 1, 1),
            None,
            false,
        ),
        ("max", Some(&u64_max), call(1, 1, 1, 1), None, false),
        ("max", Some(&u64_max), call(0, 7, 60, 0), None, false),
    ];
    for (key, value, c, exact, same_in_0_2_2) in cases {
        let mut limiters = vec![&qag];
        if is_0_5_0 || same_in_0_2_2 {
            limiters.push(&redis_cell);
        }
        for limiter in limiters {
            if let Some(value) = value {
                limiter.set(key, value);
            }
            // Checked against the reference at the call's clock.
            let reply = limiter.call(key, c);
            if let Some(exact) = exact {
                assert_eq!(reply, exact, "{} {key} {c:?}", limiter.command);
            }
            // Written as canonical digits, whatever was read.
            if let Some(written) = limiter.raw_value(key) {
                assert!(
                    written.bytes().all(|b| b.is_ascii_digit()),
                    "{} {key}: {written}",
                    limiter.command
                );
            }
        }
    }
    let slow: u128 = qag.raw_value("slow").unwrap().parse().unwrap();
    assert!(slow > 1 << 63, "written past 2^63: {slow}");
}

fn throttle(con: &mut Connection, key: &str, args: [i64; 4]) -> [i64; 5] {
    let reply: Vec<i64> = cmd("QAG.THROTTLE").arg(key).arg(&args).query(con).unwrap();
    reply.try_into().unwrap()
}

fn set_tat(con: &mut Connection, key: &str, tat: i128) {
    let _: () = cmd("SET").arg(key).arg(tat.to_string()).query(con).unwrap();
}

const YEAR: i128 = 365 * 86_400 * NANOS;

#[test]
fn a_tat_beyond_the_burst_window_and_the_skew_reads_as_a_missing_key() {
    let mut t = Target::new();
    let mut con = t.con();
    let (far, peek, near) = (t.key("far"), t.key("far-peek"), t.key("near"));
    let now = i128::from(server_micros(&mut con)) * 1000;
    // Years ahead (a clock stepped far forward, a stray write): refused for years
    // before; now the limiter starts afresh. Burst 5, one a second.
    set_tat(&mut con, &far, now + 6 * YEAR);
    assert_eq!(throttle(&mut con, &far, [4, 1, 1, 1]), [0, 5, 4, -1, 1]);
    let written = stored(&mut con, &far).unwrap();
    assert!(written <= i128::from(server_micros(&mut con)) * 1000 + NANOS);
    // A peek reads it as missing too, and writes nothing.
    set_tat(&mut con, &peek, now + 6 * YEAR);
    assert_eq!(throttle(&mut con, &peek, [4, 1, 1, 0]), [0, 5, 5, -1, 0]);
    assert_eq!(stored(&mut con, &peek), Some(now + 6 * YEAR));
    // Ahead of the burst window (5 s) by 30 s, within the default skew of 60 s (a
    // clock stepped back a little): kept, so the step mints no credit.
    set_tat(&mut con, &near, now + 35 * NANOS);
    assert_eq!(throttle(&mut con, &near, [4, 1, 1, 1]), [1, 5, 0, 31, 35]);
    t.assert_healthy();
}

/// A throttle rewrites an existing key in place, as SET overwrites a value: the key
/// keeps its LFU counter, so a busy limiter ranks for eviction with busy plain keys
/// (setting it anew made it a new key on every write, counter 5), and a stored value of
/// another length is resized to the new one.
#[test]
fn a_rewrite_keeps_the_keys_access_frequency_and_fits_any_length() {
    if external("a_rewrite_keeps_the_keys_access_frequency_and_fits_any_length") {
        return;
    }
    let mut t = Target::new();
    let mut con = t.con();
    let _: () = cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory-policy")
        .arg("allkeys-lfu")
        .query(&mut con)
        .unwrap();
    let (busy, plain) = (t.key("busy"), t.key("plain"));
    for _ in 0..300 {
        assert_eq!(throttle(&mut con, &busy, [1000, 1000, 1, 1])[0], 0);
        let _: () = cmd("SET")
            .arg(&plain)
            .arg("1700000000000000000")
            .arg("PX")
            .arg(60_000)
            .query(&mut con)
            .unwrap();
    }
    let freq = |con: &mut Connection, key: &str| -> i64 {
        cmd("OBJECT").arg("FREQ").arg(key).query(con).unwrap()
    };
    let (busy_freq, plain_freq) = (freq(&mut con, &busy), freq(&mut con, &plain));
    // A new key's counter is 5; 300 touches raise it to 11 to 13 (SET's key, touched
    // more than once a call on some servers, to 13 to 17).
    assert!(
        busy_freq >= 8 && plain_freq >= 8,
        "OBJECT FREQ after 300 calls: throttle {busy_freq}, SET {plain_freq}"
    );
    // Shorter and longer than the TAT written (leading zeros are allowed).
    let now = i128::from(server_micros(&mut con)) * 1000;
    for old in ["1", "000000000000000000000000000001"] {
        let key = t.key(&format!("length-{}", old.len()));
        let _: () = cmd("SET").arg(&key).arg(old).query(&mut con).unwrap();
        assert_eq!(throttle(&mut con, &key, [4, 1, 1, 1]), [0, 5, 4, -1, 1]);
        let written: String = cmd("GET").arg(&key).query(&mut con).unwrap();
        let tat: i128 = written.parse().unwrap();
        assert!(
            written.len() == 19 && (now..now + 2 * NANOS).contains(&tat),
            "{old} rewritten as {written}"
        );
        let pttl: i64 = cmd("PTTL").arg(&key).query(&mut con).unwrap();
        assert!((0..=1_000).contains(&pttl), "{old}: PTTL {pttl}");
    }
    t.assert_healthy();
}

/// Starts a server that loads the module with `module_args`, expecting it to refuse;
/// returns the server's log.
fn refused_load(module_args: &[&str]) -> String {
    let dir = std::env::temp_dir().join(format!(
        "qag-load-{}-{}",
        std::process::id(),
        module_args.join("_")
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let log = dir.join("server.log");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .unwrap()
        .port()
        .to_string();
    let status =
        std::process::Command::new(std::env::var("REDIS_SERVER").unwrap_or("redis-server".into()))
            .args([
                "--port",
                &port,
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--loadmodule",
            ])
            .arg(module_path())
            .args(module_args)
            .arg("--logfile")
            .arg(&log)
            .status()
            .unwrap();
    assert!(
        !status.success(),
        "{module_args:?}: the server refused to start"
    );
    let text = std::fs::read_to_string(&log).unwrap();
    let _ = std::fs::remove_dir_all(dir);
    text
}

#[test]
fn the_skew_is_a_load_argument() {
    if external("the_skew_is_a_load_argument") {
        return;
    }
    let skew = |seconds: &str| {
        Server::start(&ServerOptions {
            module_args: vec!["THROTTLE-SKEW".into(), seconds.into()],
            ..Default::default()
        })
    };
    // No skew: a TAT ahead of the burst window and a longest wait (60 s, as waiters
    // charge it) at all reads as missing.
    let none = skew("0");
    let mut con = none.client().get_connection().unwrap();
    let now = i128::from(server_micros(&mut con)) * 1000;
    set_tat(&mut con, "near", now + 95 * NANOS);
    assert_eq!(throttle(&mut con, "near", [4, 1, 1, 1]), [0, 5, 4, -1, 1]);
    set_tat(&mut con, "inside", now + 3 * NANOS);
    assert_eq!(throttle(&mut con, "inside", [4, 1, 1, 1])[..3], [0, 5, 1]);
    assert!(none.log().contains("THROTTLE-SKEW 0 s"), "{}", none.log());
    // The largest: every TAT is trusted, as redis-cell trusts it.
    let all = skew("9223372036854775807");
    let mut con = all.client().get_connection().unwrap();
    set_tat(&mut con, "big", 1 << 63);
    assert_eq!(throttle(&mut con, "big", [1, 1, 1, 1])[..3], [1, 2, 0]);
    // Anything else refuses to load, and says why.
    for (args, message) in [
        (
            &["THROTTLE-SKEW"][..],
            "THROTTLE-SKEW needs a number of seconds",
        ),
        (
            &["THROTTLE-SKEW", "-1"],
            "THROTTLE-SKEW must be an integer from 0 to 9223372036854775807",
        ),
        (
            &["THROTTLE-SKEW", "1m"],
            "THROTTLE-SKEW must be an integer from 0 to 9223372036854775807",
        ),
        (
            &["THROTTLE-SKEW", "1", "THROTTLE-SKEW", "2"],
            "THROTTLE-SKEW given more than once",
        ),
        (
            &["THROTTLE-SKWE", "1"],
            "syntax error: expected CL-THROTTLE, TEST-COMMANDS, THROTTLE-SKEW seconds, ID-SECONDS seconds, ID-MAX n or MAX-WAITERS n",
        ),
    ] {
        let log = refused_load(args);
        assert!(log.contains(message), "{args:?}: {log}");
    }
}

#[test]
fn a_peek_writes_nothing() {
    let mut t = Target::new();
    let mut con = t.con();
    let key = t.key("peek");
    let peek = |con: &mut Connection| -> Vec<i64> {
        cmd("QAG.THROTTLE")
            .arg(&key)
            .arg(3)
            .arg(1)
            .arg(60)
            .arg(0)
            .query(con)
            .unwrap()
    };
    assert_eq!(peek(&mut con), [0, 4, 4, -1, 0]);
    let exists: i64 = cmd("EXISTS").arg(&key).query(&mut con).unwrap();
    assert_eq!(exists, 0, "no key created");
    let _: Vec<i64> = cmd("QAG.THROTTLE")
        .arg(&key)
        .arg(3)
        .arg(1)
        .arg(60)
        .query(&mut con)
        .unwrap();
    let before = snapshot(&mut con, &key);
    let reply = peek(&mut con);
    assert_eq!(reply[..3], [0, 4, 3]);
    assert_eq!(snapshot(&mut con, &key), before, "nothing changed");
    // The stored value and expiry are redis-cell's: nanoseconds, expiring at them.
    let tat = stored(&mut con, &key).unwrap();
    let expiry: i64 = cmd("PEXPIRETIME").arg(&key).query(&mut con).unwrap();
    assert_eq!(i128::from(expiry), tat / 1_000_000);
    t.assert_healthy();
}

#[test]
fn bad_input_and_stored_garbage_are_errors_that_change_nothing() {
    let mut t = Target::new();
    let mut con = t.con();
    let key = |name: &str| t.key(name);
    let garbage = [
        ("letters", "abc"),
        ("negative", "-5"),
        ("decimal", "1.5"),
        ("empty", ""),
        ("huge", "99999999999999999999"),
        ("beyond", "18446744073709551616"),
        ("spaced", " 123"),
    ];
    for (name, value) in garbage {
        let _: () = cmd("SET")
            .arg(key(name))
            .arg(value)
            .query(&mut con)
            .unwrap();
    }
    let _: () = cmd("HSET")
        .arg(key("hash"))
        .arg("f")
        .arg(1)
        .query(&mut con)
        .unwrap();
    let _: () = cmd("RPUSH")
        .arg(key("list"))
        .arg(1)
        .query(&mut con)
        .unwrap();
    let _: () = cmd("SADD").arg(key("set")).arg(1).query(&mut con).unwrap();
    let _: () = cmd("ZADD")
        .arg(key("zset"))
        .arg(1)
        .arg("m")
        .query(&mut con)
        .unwrap();
    let _: String = cmd("XADD")
        .arg(key("stream"))
        .arg("*")
        .arg("f")
        .arg(1)
        .query(&mut con)
        .unwrap();
    let names = [
        "letters", "negative", "decimal", "empty", "huge", "beyond", "spaced", "hash", "list",
        "set", "zset", "stream", "fresh",
    ];
    let snapshot_all = |con: &mut Connection| {
        names
            .iter()
            .map(|name| snapshot(con, &key(name)))
            .collect::<Vec<_>>()
    };
    let before = snapshot_all(&mut con);
    let mut calls: Vec<(Vec<Vec<u8>>, &str)> = Vec::new();
    let words = |ws: &[&str]| ws.iter().map(|w| w.as_bytes().to_vec()).collect::<Vec<_>>();
    for (name, _) in garbage {
        calls.push((words(&["QAG.THROTTLE", &key(name), "1", "1", "1"]), "ERR the key does not hold a throttle's time (a non-negative integer of nanoseconds); nothing was written"));
    }
    for name in ["hash", "list", "set", "zset", "stream"] {
        calls.push((
            words(&["QAG.THROTTLE", &key(name), "1", "1", "1"]),
            "WRONGTYPE Operation against a key holding the wrong kind of value",
        ));
    }
    let fresh = key("fresh");
    for (args, error) in [
        (vec!["1", "x", "1"], "ERR count must be an integer from 1 to 9223372036854775807"),
        (vec!["-1", "1", "1"], "ERR max_burst must be an integer from 0 to 9223372036854775806"),
        (vec!["1", "0", "1"], "ERR count must be an integer from 1 to 9223372036854775807"),
        (vec!["1", "1", "0"], "ERR period must be an integer from 1 to 9223372036854775807"),
        (vec!["1", "1", "-5"], "ERR period must be an integer from 1 to 9223372036854775807"),
        (vec!["1", "1", "9223372036854775808"], "ERR period must be an integer from 1 to 9223372036854775807"),
        (vec!["1", "1", "1", "-1"], "ERR quantity must be an integer from 0 to 9223372036854775807"),
        (vec!["1", "1", "1", "1", "1"], "ERR syntax error: expected WAIT ms"),
        (vec!["1", "1", "1", "1", "WAIT", "1", "WAIT", "1", "1"], "ERR wrong number of arguments for 'qag.throttle' command"),
        (vec!["1", "1", "1", "WAIT"], "ERR WAIT needs a number of milliseconds"),
        (vec!["1", "1", "1", "WAIT", "60001"], "ERR WAIT must be an integer from 0 to 60000"),
        (vec!["1", "1", "1", "WAIT", "-1"], "ERR WAIT must be an integer from 0 to 60000"),
        (vec!["1", "1", "1", "WAIT", "1", "WAIT", "1"], "ERR WAIT given more than once"),
        (vec!["1", "2000000000", "1"], "ERR count per period is faster than one per nanosecond; nothing was written"),
        (vec!["9223372036854775806", "1", "1"], "ERR the rate, burst or quantity overflows the nanosecond arithmetic; nothing was written"),
        (vec!["1", "1", "1", "9223372036854775807"], "ERR the rate, burst or quantity overflows the nanosecond arithmetic; nothing was written"),
        (vec!["1.5", "1", "1"], "ERR max_burst must be an integer from 0 to 9223372036854775806"),
    ] {
        let mut call = words(&["QAG.THROTTLE", &fresh]);
        call.extend(args.iter().map(|a| a.as_bytes().to_vec()));
        calls.push((call, error));
    }
    // Arguments that are not UTF-8, which abort a server running redis-cell.
    calls.push((
        vec![
            b"QAG.THROTTLE".to_vec(),
            fresh.as_bytes().to_vec(),
            b"\xff\xfe".to_vec(),
            b"1".to_vec(),
            b"1".to_vec(),
        ],
        "ERR max_burst must be an integer from 0 to 9223372036854775806",
    ));
    calls.push((
        vec![
            b"QAG.THROTTLE".to_vec(),
            b"\xff\xfe".to_vec(),
            b"1".to_vec(),
            b"1".to_vec(),
            b"1".to_vec(),
            b"\x80".to_vec(),
        ],
        "ERR quantity must be an integer from 0 to 9223372036854775807",
    ));
    for (call, error) in calls {
        let mut c = cmd(std::str::from_utf8(&call[0]).unwrap());
        for a in &call[1..] {
            c.arg(a.as_slice());
        }
        let e = c.query::<Value>(&mut con).unwrap_err();
        let (code, text) = error.split_once(' ').unwrap();
        assert_eq!(e.code(), Some(code), "{call:?}: {e}");
        assert!(e.to_string().contains(text), "{call:?}: {e} lacks {text}");
    }
    assert_eq!(snapshot_all(&mut con), before, "nothing written");
    t.assert_healthy();
}

#[test]
fn cl_throttle_only_when_asked_and_never_beside_redis_cell() {
    if external("cl_throttle_only_when_asked_and_never_beside_redis_cell") {
        return;
    }
    // Without the argument the name stays free.
    let plain = Server::start(&ServerOptions::default());
    let mut con = plain.client().get_connection().unwrap();
    let error = cmd("CL.THROTTLE")
        .arg("k")
        .arg(1)
        .arg(1)
        .arg(1)
        .query::<Value>(&mut con)
        .unwrap_err();
    assert!(
        error.to_string().to_lowercase().contains("unknown command"),
        "{error}"
    );
    assert!(plain.log().contains("CL.THROTTLE left to redis-cell"));
    // With it, CL.THROTTLE is QAG.THROTTLE under redis-cell's name.
    let named = Server::start(&ServerOptions {
        module_args: vec!["CL-THROTTLE".into()],
        ..Default::default()
    });
    let mut con = named.client().get_connection().unwrap();
    for _ in 0..2 {
        let a: Vec<i64> = cmd("CL.THROTTLE")
            .arg("a")
            .arg(1)
            .arg(1)
            .arg(60)
            .query(&mut con)
            .unwrap();
        let b: Vec<i64> = cmd("QAG.THROTTLE")
            .arg("b")
            .arg(1)
            .arg(1)
            .arg(60)
            .query(&mut con)
            .unwrap();
        assert_eq!(a[..3], b[..3]);
    }
    let info: String = cmd("INFO").arg("qag").query(&mut con).unwrap();
    assert!(info.contains("qag_cl_throttle_calls:2"), "{info}");
    assert!(info.contains("qag_throttle_calls:2"), "{info}");
    // Beside redis-cell, loading with the argument fails, and says why.
    if let Ok(cell) = std::env::var("QAG_CELL_MODULE") {
        let dir = std::env::temp_dir().join(format!("qag-cell-clash-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let log = dir.join("server.log");
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .unwrap()
            .port()
            .to_string();
        let status = std::process::Command::new(
            std::env::var("REDIS_SERVER").unwrap_or("redis-server".into()),
        )
        .args([
            "--port",
            &port,
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--loadmodule",
            &cell,
            "--loadmodule",
        ])
        .arg(module_path())
        .arg("CL-THROTTLE")
        .arg("--logfile")
        .arg(&log)
        .status()
        .unwrap();
        assert!(!status.success(), "the server refused to start");
        let text = std::fs::read_to_string(&log).unwrap();
        assert!(text.contains("the name CL.THROTTLE is taken"), "{text}");
        let _ = std::fs::remove_dir_all(dir);
    }
}
