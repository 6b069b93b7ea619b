//! Every kind of bad input gets a clear error, changes nothing, and leaves the server
//! answering.

mod common;

use common::*;
use rand::{Rng, SeedableRng};

const COUNT_ERROR: &str = "count must be an integer from 1 to 9007199254740992";
const PERIOD_ERROR: &str = "period must be a number from 0.000001 to 10000000000";
const LONG_ID: &[u8] = &[b'x'; 257];
const COST_ERROR: &str = "cost must be an integer from 1 to 9223372036854775807";

/// The error code (`ERR`, `WRONGTYPE`) and the whole text of a call that must fail.
fn error_of(con: &mut Connection, args: &[&[u8]]) -> (String, String) {
    let mut c = cmd(std::str::from_utf8(args[0]).unwrap());
    for a in &args[1..] {
        c.arg(*a);
    }
    match c.query::<Value>(con) {
        Ok(v) => panic!(
            "{:?} succeeded with {v:?}",
            String::from_utf8_lossy(&args.concat())
        ),
        Err(e) => (e.code().unwrap_or_default().to_string(), e.to_string()),
    }
}

/// The bad calls, each with what its error must say. `K` stands for an existing bucket,
/// `H` for a second one, `S` for a string key.
fn bad_calls() -> Vec<(Vec<&'static [u8]>, &'static str)> {
    let take: &[u8] = b"QAG.TAKE";
    let take2: &[u8] = b"QAG.TAKE2";
    let peek: &[u8] = b"QAG.PEEK";
    let mut calls: Vec<(Vec<&'static [u8]>, &'static str)> = vec![
        (
            vec![take],
            "wrong number of arguments for 'qag.take' command",
        ),
        (vec![take, b"K"], "wrong number of arguments"),
        (vec![take, b"K", b"5"], "wrong number of arguments"),
        (
            vec![take, b"K", b"5", b"60", b"COST"],
            "wrong number of arguments",
        ),
        (
            vec![take, b"K", b"5", b"60", b"COST", b"1", b"COST"],
            "wrong number of arguments",
        ),
        (
            vec![take, b"K", b"5", b"60", b"COST", b"1", b"COST", b"2"],
            "COST given more than once",
        ),
        (
            vec![take, b"K", b"5", b"60", b"ID", &[b'x'; 129]],
            "ID must be 1 to 128 bytes",
        ),
        (
            vec![take, b"K", b"5", b"60", b"WEIGHT", b"1"],
            "syntax error: expected COST n",
        ),
        (
            vec![take, b"K", b"5", b"60", b"", b"1"],
            "syntax error: expected COST n",
        ),
        (vec![take, b"S", b"5", b"60"], "WRONGTYPE"),
        (vec![peek, b"S", b"5", b"60"], "WRONGTYPE"),
        (
            vec![take2, b"S", b"5", b"60", b"K", b"5", b"60"],
            "WRONGTYPE",
        ),
        (
            vec![take2, b"K", b"5", b"60", b"S", b"5", b"60"],
            "WRONGTYPE",
        ),
        (
            vec![take2, b"K", b"5", b"60", b"H", b"5"],
            "wrong number of arguments for 'qag.take2' command",
        ),
        (
            vec![take2, b"K", b"5", b"60", b"H", b"5", b"0"],
            PERIOD_ERROR,
        ),
        (
            vec![take2, b"K", b"0", b"60", b"H", b"5", b"60"],
            COUNT_ERROR,
        ),
        (
            vec![take2, b"K", b"5", b"60", b"H", b"5", b"60", b"COST", b"0"],
            COST_ERROR,
        ),
        (vec![peek, b"K", b"5", b"60", b"COST", b"-1"], COST_ERROR),
        (
            vec![peek, b"K"],
            "wrong number of arguments for 'qag.peek' command",
        ),
    ];
    let lease: &[u8] = b"QAG.LEASE";
    let renew: &[u8] = b"QAG.RENEW";
    let release: &[u8] = b"QAG.RELEASE";
    let leases: &[u8] = b"QAG.LEASES";
    let (max_error, ttl_error) = (
        "max must be an integer from 1 to 1000000",
        "ttl_ms must be an integer from 1 to 604800000",
    );
    let id_error = "id must be non-empty and at most 256 bytes";
    calls.extend([
        (
            vec![lease, b"Z", b"5", b"1000"],
            "wrong number of arguments for 'qag.lease' command",
        ),
        (vec![lease, b"Z", b"0", b"1000", b"id"], max_error),
        (vec![lease, b"Z", b"1000001", b"1000", b"id"], max_error),
        (vec![lease, b"Z", b"5", b"0", b"id"], ttl_error),
        (vec![lease, b"Z", b"5", b"604800001", b"id"], ttl_error),
        (vec![lease, b"Z", b"5", b"1e3", b"id"], ttl_error),
        (vec![lease, b"Z", b"5", b"1000", b""], id_error),
        (vec![lease, b"Z", b"5", b"1000", LONG_ID], id_error),
        (vec![lease, b"S", b"5", b"1000", b"id"], "WRONGTYPE"),
        (vec![lease, b"K", b"5", b"1000", b"id"], "WRONGTYPE"),
        (
            vec![renew, b"Z", b"id"],
            "wrong number of arguments for 'qag.renew' command",
        ),
        (vec![renew, b"Z", b"id", b"-1"], ttl_error),
        (vec![renew, b"Z", b"", b"100"], id_error),
        (vec![renew, b"S", b"id", b"100"], "WRONGTYPE"),
        (
            vec![release, b"Z"],
            "wrong number of arguments for 'qag.release' command",
        ),
        (vec![release, b"Z", b""], id_error),
        (vec![release, b"K", b"id"], "WRONGTYPE"),
        (
            vec![leases, b"Z", b"extra"],
            "wrong number of arguments for 'qag.leases' command",
        ),
        (vec![leases, b"S"], "WRONGTYPE"),
    ]);
    let quota: &[u8] = b"QAG.QUOTA";
    let add: &[u8] = b"QAG.QUOTA.ADD";
    let seed: &[u8] = b"QAG.QUOTA.SEED";
    let count_error = "must be an integer from 0 to 9223372036854775807";
    let admit: &[u8] = b"QAG.ADMIT";
    let record: &[u8] = b"QAG.RECORD";
    let limit_error = "must be an integer from 0 to 9223372036854775807";
    let mismatch = "numscopes does not match the number of arguments";
    calls.extend([
        (
            vec![admit, b"1", b"B", b"1"],
            "wrong number of arguments for 'qag.admit' command",
        ),
        (
            vec![admit, b"0", b"B", b"1", b"1"],
            "numscopes must be an integer from 1 to 64",
        ),
        (
            vec![admit, b"65", b"B", b"1", b"1"],
            "numscopes must be an integer from 1 to 64",
        ),
        (vec![admit, b"2", b"B", b"1", b"1"], mismatch),
        (
            vec![admit, b"1", b"B", b"1", b"1", b"O"],
            "syntax error: expected WINDOW seconds, RESERVE tokens, ID request-id or HOLD milliseconds",
        ),
        (
            vec![admit, b"1", b"B", b"0", b"10", b"RESERVE", b"5"],
            "RESERVE needs an ID to commit it by",
        ),
        (
            vec![admit, b"1", b"B", b"0", b"10", b"RESERVE", b"11", b"ID", b"r"],
            "RESERVE is above a scope's tpm",
        ),
        (vec![record, b"1", b"W", b"5", b"PARTIAL"], "PARTIAL needs the ID"),
        (vec![admit, b"1", b"B", b"-1", b"1"], limit_error),
        (vec![admit, b"1", b"B", b"1", b"nan"], limit_error),
        (
            vec![admit, b"1", b"B", b"1", b"1", b"WINDOW", b"0"],
            "WINDOW must be an integer from 1 to 86400",
        ),
        (
            vec![admit, b"1", b"B", b"1", b"1", b"WINDOW", b"86401"],
            "WINDOW must be an integer from 1 to 86400",
        ),
        (
            vec![admit, b"1", b"B", b"1", b"1", b"SPAN", b"5"],
            "syntax error: expected WINDOW seconds",
        ),
        (
            vec![admit, b"2", b"B", b"1", b"1", b"B", b"1", b"1"],
            "each scope must have its own key",
        ),
        (
            vec![admit, b"2", b"W", b"1", b"1", b"S", b"1", b"1"],
            "WRONGTYPE",
        ),
        (
            vec![admit, b"2", b"W", b"1", b"1", b"Z", b"1", b"1"],
            "WRONGTYPE",
        ),
        (
            vec![record, b"1", b"W"],
            "wrong number of arguments for 'qag.record' command",
        ),
        (vec![record, b"2", b"W", b"5"], mismatch),
        (vec![record, b"1", b"W", b"-5"], limit_error),
        (
            vec![
                record,
                b"1",
                b"W",
                b"9223372036854775807",
                b"WINDOW",
                b"3600",
            ],
            "overflow",
        ),
        (vec![record, b"2", b"W", b"S", b"5"], "WRONGTYPE"),
    ]);
    calls.extend([
        (
            vec![quota, b"Q", b"PER", b"month", b"TZ"],
            "wrong number of arguments for 'qag.quota' command",
        ),
        (
            vec![quota, b"Q", b"PER", b"month", b"TZ", b"UTC"],
            "missing CALLS or ROWS",
        ),
        (
            vec![quota, b"Q", b"PER", b"month", b"CALLS", b"1"],
            "missing PER day|month and TZ zone",
        ),
        (
            vec![quota, b"Q", b"PER", b"year", b"TZ", b"UTC", b"CALLS", b"1"],
            "PER must be day or month",
        ),
        (
            vec![
                quota,
                b"Q",
                b"PER",
                b"day",
                b"TZ",
                b"Europe/Nowhere",
                b"CALLS",
                b"1",
            ],
            "TZ must be a known IANA time zone name",
        ),
        (
            vec![quota, b"Q", b"PER", b"day", b"TZ", b"\xff", b"CALLS", b"1"],
            "TZ must be a known IANA time zone name",
        ),
        (
            vec![quota, b"Q", b"PER", b"day", b"TZ", b"UTC", b"CALLS", b"-1"],
            count_error,
        ),
        (
            vec![quota, b"Q", b"PER", b"day", b"TZ", b"UTC", b"ROWS", b"1e3"],
            count_error,
        ),
        (
            vec![
                quota, b"Q", b"PER", b"day", b"TZ", b"UTC", b"CALLS", b"1", b"ROWS",
            ],
            "wrong number of arguments",
        ),
        (
            vec![quota, b"Q", b"PER", b"day", b"PER", b"day", b"TZ", b"UTC"],
            "PER given more than once",
        ),
        (
            vec![quota, b"Q", b"PER", b"day", b"TZ", b"UTC", b"LIMIT", b"5"],
            "syntax error: expected PER, TZ, CALLS or ROWS",
        ),
        (
            vec![quota, b"S", b"PER", b"day", b"TZ", b"UTC", b"CALLS", b"5"],
            "WRONGTYPE",
        ),
        (
            vec![
                add,
                b"Q",
                b"PER",
                b"day",
                b"TZ",
                b"UTC",
                b"CALLS",
                b"99999999999999999999",
            ],
            count_error,
        ),
        (
            vec![
                add, b"Q", b"PER", b"day", b"TZ", b"UTC", b"CALLS", b"1.5", b"ROWS", b"1",
            ],
            count_error,
        ),
        (
            vec![
                add,
                b"Q",
                b"PER",
                b"day",
                b"TZ",
                b"UTC",
                b"CALLS",
                b"9223372036854775807",
            ],
            "overflow",
        ),
        (
            vec![add, b"Z", b"PER", b"day", b"TZ", b"UTC", b"CALLS", b"1"],
            "WRONGTYPE",
        ),
        (
            vec![seed, b"Q", b"PER", b"day", b"TZ", b"UTC", b"ROWS", b"-5"],
            count_error,
        ),
        (
            vec![seed, b"Q", b"TZ", b"UTC", b"ROWS", b"5"],
            "missing PER day|month and TZ zone",
        ),
    ]);
    let bad_counts: &[&[u8]] = &[
        b"0",
        b"-1",
        b"1.5",
        b"abc",
        b"",
        b"nan",
        b"inf",
        b"9007199254740993",
        b"99999999999999999999999",
        b"1e3",
        b" 5",
        b"5 ",
        b"0x10",
        b"\xff\xfe",
        b"5\x00",
    ];
    for &count in bad_counts {
        calls.push((vec![take, b"K", count, b"60"], COUNT_ERROR));
        calls.push((vec![peek, b"K", count, b"60"], COUNT_ERROR));
        calls.push((
            vec![take2, b"K", b"5", b"60", b"H", count, b"60"],
            COUNT_ERROR,
        ));
    }
    let bad_periods: &[&[u8]] = &[
        b"0",
        b"-1",
        b"-0",
        b"nan",
        b"NaN",
        b"inf",
        b"-inf",
        b"infinity",
        b"1e400",
        b"1e-7",
        b"10000000001",
        b"",
        b"abc",
        b"1,5",
        b"\xff",
    ];
    for &period in bad_periods {
        calls.push((vec![take, b"K", b"5", period], PERIOD_ERROR));
        calls.push((
            vec![take2, b"K", b"5", period, b"H", b"5", b"60"],
            PERIOD_ERROR,
        ));
    }
    let bad_costs: &[&[u8]] = &[
        b"0",
        b"-5",
        b"1.0",
        b"x",
        b"",
        b"9223372036854775808",
        b"nan",
    ];
    for &cost in bad_costs {
        calls.push((vec![take, b"K", b"5", b"60", b"COST", cost], COST_ERROR));
        calls.push((vec![take, b"K", b"5", b"60", b"cost", cost], COST_ERROR));
    }
    calls
}

fn substitute(t: &Target, args: &[&[u8]]) -> Vec<Vec<u8>> {
    args.iter()
        .map(|a| match *a {
            b"K" => t.key("bucket").into_bytes(),
            b"H" => t.key("other").into_bytes(),
            b"S" => t.key("string").into_bytes(),
            b"Z" => t.key("slots").into_bytes(),
            b"Q" => t.key("quota").into_bytes(),
            b"W" => t.key("window").into_bytes(),
            other => other.to_vec(),
        })
        .collect()
}

/// Makes a key of every kind the commands use, and a string key; returns each with
/// its snapshot.
fn prepare(t: &Target, con: &mut Connection) -> Vec<(String, (Value, i64))> {
    let [bucket, other, string, slots, quota, window, throttle] = [
        "bucket", "other", "string", "slots", "quota", "window", "throttle",
    ]
    .map(|k| t.key(k));
    for key in [&bucket, &other] {
        let _: Value = cmd("QAG.TAKE").arg(key).arg(5).arg(60).query(con).unwrap();
    }
    let _: () = cmd("SET")
        .arg(&string)
        .arg("not a bucket")
        .arg("EX")
        .arg(600)
        .query(con)
        .unwrap();
    let _: Value = cmd("QAG.LEASE")
        .arg(&slots)
        .arg(5)
        .arg(600_000)
        .arg("held")
        .query(con)
        .unwrap();
    let _: Value = cmd("QAG.QUOTA.ADD")
        .arg(&quota)
        .arg(&["PER", "day", "TZ", "UTC", "CALLS", "1"])
        .query(con)
        .unwrap();
    let _: Value = cmd("QAG.ADMIT")
        .arg(1)
        .arg(&window)
        .arg(5)
        .arg(0)
        .arg("WINDOW")
        .arg(3600)
        .query(con)
        .unwrap();
    let _: Value = cmd("QAG.RECORD")
        .arg(1)
        .arg(&window)
        .arg(10)
        .arg("WINDOW")
        .arg(3600)
        .query(con)
        .unwrap();
    let _: Value = cmd("QAG.THROTTLE")
        .arg(&throttle)
        .arg(5)
        .arg(10)
        .arg(3600)
        .query(con)
        .unwrap();
    [bucket, other, string, slots, quota, window, throttle]
        .into_iter()
        .map(|k| (k.clone(), snapshot(con, &k)))
        .collect()
}

#[test]
fn every_bad_call_is_refused_clearly_and_changes_nothing() {
    let mut t = Target::new();
    let mut con = t.con();
    let before = prepare(&t, &mut con);
    for (args, expected) in bad_calls() {
        let args = substitute(&t, &args);
        let refs: Vec<&[u8]> = args.iter().map(|a| &a[..]).collect();
        let (code, error) = error_of(&mut con, &refs);
        let call = String::from_utf8_lossy(&refs.join(&b' ')).into_owned();
        let expected_code = if expected == "WRONGTYPE" {
            "WRONGTYPE"
        } else {
            "ERR"
        };
        assert_eq!(code, expected_code, "{call}: {error}");
        assert!(
            error.contains(expected),
            "{call}: {error:?} lacks {expected:?}"
        );
    }
    for (key, snap) in &before {
        assert_eq!(&snapshot(&mut con, key), snap, "{key} changed");
    }
    t.assert_healthy();
}

/// Thousands of random argument vectors: every call is answered, none crashes or hangs
/// the server, and a call that errs changes nothing.
#[test]
fn random_arguments_never_crash_the_server() {
    let mut t = Target::new();
    let mut con = t.con();
    let before = prepare(&t, &mut con);
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x9a9);
    let words: Vec<Vec<u8>> = [
        &b"0"[..],
        b"1",
        b"-1",
        b"5",
        b"60",
        b"0.5",
        b"1e-6",
        b"1e10",
        b"1e400",
        b"nan",
        b"inf",
        b"-inf",
        b"9007199254740992",
        b"9007199254740993",
        b"9223372036854775807",
        b"9223372036854775808",
        b"-9223372036854775808",
        b"COST",
        b"cost",
        b"PER",
        b"day",
        b"month",
        b"TZ",
        b"UTC",
        b"Europe/Berlin",
        b"CALLS",
        b"ROWS",
        b"ID",
        b"RESERVE",
        b"HOLD",
        b"PARTIAL",
        b"WINDOW",
        b"",
        b" ",
        b"\x00",
        b"\xff\xfe\xfd",
        b"\r\n",
    ]
    .iter()
    .map(|w| w.to_vec())
    .chain([vec![b'9'; 400], vec![b'x'; 70_000]])
    .collect();
    // Each command with a valid call, as a template to mutate: B, O, Z, Q, W, T stand
    // for the keys below.
    let templates: [(&str, &[&str]); 20] = [
        ("QAG.TAKE", &["B", "5", "60", "ID", "r1"]),
        ("QAG.TAKE2", &["B", "5", "60", "O", "5", "60", "ID", "r1"]),
        ("QAG.REFUND", &["B", "5", "60", "1", "ID", "r2"]),
        (
            "QAG.ADMIT",
            &[
                "1", "W", "0", "100", "RESERVE", "30", "ID", "r3", "HOLD", "500",
            ],
        ),
        ("QAG.RECORD", &["1", "W", "25", "ID", "r3", "PARTIAL"]),
        (
            "QAG.QUOTA.ADD",
            &["Q", "PER", "day", "TZ", "UTC", "CALLS", "1", "ID", "r4"],
        ),
        ("QAG.THROTTLE", &["T", "5", "10", "3600", "1"]),
        (
            "QAG.ADMIT",
            &["2", "W", "5", "100", "O", "1", "0", "WINDOW", "60"],
        ),
        ("QAG.RECORD", &["2", "W", "O", "25", "WINDOW", "60"]),
        ("QAG.TAKE", &["B", "5", "60", "COST", "2"]),
        ("QAG.TAKE2", &["B", "5", "60", "O", "5", "60", "COST", "1"]),
        ("QAG.PEEK", &["B", "5", "60"]),
        ("QAG.REFUND", &["B", "5", "60", "2"]),
        ("QAG.LEASE", &["Z", "5", "1000", "id"]),
        ("QAG.RENEW", &["Z", "id", "1000"]),
        ("QAG.RELEASE", &["Z", "id"]),
        ("QAG.LEASES", &["Z"]),
        (
            "QAG.QUOTA",
            &["Q", "PER", "day", "TZ", "UTC", "CALLS", "5", "ROWS", "5"],
        ),
        (
            "QAG.QUOTA.ADD",
            &["Q", "PER", "month", "TZ", "UTC", "CALLS", "1", "ROWS", "5"],
        ),
        (
            "QAG.QUOTA.SEED",
            &["Q", "PER", "day", "TZ", "Europe/Berlin", "CALLS", "1"],
        ),
    ];
    let keys = [
        t.key("bucket"),
        t.key("other"),
        t.key("string"),
        t.key("slots"),
        t.key("quota"),
        t.key("window"),
        t.key("throttle"),
    ];
    let mut answered = 0;
    for round in 0..4000 {
        let (name, template) = templates[rng.gen_range(0..templates.len())];
        let random_arg = |rng: &mut rand::rngs::StdRng| -> Vec<u8> {
            match rng.gen_range(0..4) {
                0 => keys[rng.gen_range(0..keys.len())].clone().into_bytes(),
                1 => (0..rng.gen_range(0..12)).map(|_| rng.gen()).collect(),
                _ => words[rng.gen_range(0..words.len())].clone(),
            }
        };
        let args: Vec<Vec<u8>> = if round % 2 == 0 {
            // A valid call with one to three arguments replaced, dropped or added.
            let mut args: Vec<Vec<u8>> = template
                .iter()
                .map(|a| match *a {
                    "B" => keys[0].clone().into_bytes(),
                    "O" => keys[1].clone().into_bytes(),
                    "Z" => keys[3].clone().into_bytes(),
                    "Q" => keys[4].clone().into_bytes(),
                    "W" => keys[5].clone().into_bytes(),
                    "T" => keys[6].clone().into_bytes(),
                    other => other.as_bytes().to_vec(),
                })
                .collect();
            for _ in 0..rng.gen_range(1..4) {
                let at = rng.gen_range(0..=args.len());
                match rng.gen_range(0..3) {
                    0 if at < args.len() => args[at] = random_arg(&mut rng),
                    1 if at < args.len() => {
                        args.remove(at);
                    }
                    _ => args.insert(at, random_arg(&mut rng)),
                }
            }
            args
        } else {
            (0..rng.gen_range(0..10))
                .map(|_| random_arg(&mut rng))
                .collect()
        };
        let mut c = cmd(name);
        for arg in &args {
            c.arg(&arg[..]);
        }
        let snapshots: Vec<_> = keys.iter().map(|k| snapshot(&mut con, k)).collect();
        let (seconds, micros): (i64, i64) = cmd("TIME").query(&mut con).unwrap();
        let now_ms = seconds * 1000 + micros / 1000;
        // Ok or a server error: either way an answer; an I/O error fails here.
        match c.query::<Value>(&mut con) {
            Ok(_) => {}
            Err(e) => {
                assert!(e.kind() != redis::ErrorKind::Io, "{name}: {e}");
                for (key, before) in keys.iter().zip(&snapshots) {
                    // A key that a valid call gave a short life may expire meanwhile,
                    // even between the snapshot's DUMP and PEXPIRETIME (then -2).
                    let (dump, expire_at) = before;
                    let vanished = *expire_at == -2 && *dump != Value::Nil;
                    if vanished || (*expire_at > 0 && *expire_at < now_ms + 2_000) {
                        continue;
                    }
                    assert_eq!(
                        &snapshot(&mut con, key),
                        before,
                        "{name} erred ({e}) and changed {key}"
                    );
                }
            }
        }
        answered += 1;
    }
    assert_eq!(answered, 4000);
    // Valid calls may have written the buckets; the string key was never a bucket.
    let (string_key, string_snapshot) = &before[2];
    assert_eq!(&snapshot(&mut con, string_key), string_snapshot);
    t.assert_healthy();
}

/// A panic inside a command becomes an error reply; the server and its data live on.
#[test]
fn a_panic_in_a_command_is_an_error_reply_not_a_crash() {
    if external("panic guard") {
        return;
    }
    let mut server = Server::start(&ServerOptions {
        module_args: vec!["TEST-COMMANDS".into()],
        ..Default::default()
    });
    let mut con = server.client().get_connection().unwrap();
    let _: Value = cmd("QAG.TAKE")
        .arg("b")
        .arg(5)
        .arg(60)
        .query(&mut con)
        .unwrap();
    for _ in 0..3 {
        let err = cmd("QAG.TEST.PANIC")
            .arg("b")
            .query::<Value>(&mut con)
            .unwrap_err();
        assert_eq!(err.code(), Some("ERR"), "{err}");
        assert!(err.to_string().contains("qag internal error"), "{err}");
    }
    let reply: Vec<i64> = cmd("QAG.TAKE")
        .arg("b")
        .arg(5)
        .arg(60)
        .query(&mut con)
        .unwrap();
    assert_eq!(reply, vec![1, 3, 0]);
    assert!(server.alive(), "{}", server.log());
    // Without the load argument the test command does not exist.
    let plain = Server::start(&ServerOptions::default());
    let err = cmd("QAG.TEST.PANIC")
        .arg("b")
        .query::<Value>(&mut plain.client().get_connection().unwrap())
        .unwrap_err();
    assert!(
        err.to_string().to_lowercase().contains("unknown command"),
        "{err}"
    );
}
