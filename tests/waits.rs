//! `WAIT ms` on a real server: waiters served in arrival order at their tokens' time,
//! from many connections and from two client processes; a waiter gone or unblocked
//! giving back what it was charged; leases given to waiters on a release, when a
//! lease runs out and when another command frees a slot; TAKE2 and THROTTLE; MULTI, scripts and MAX-WAITERS answering at once;
//! the charge and the give-back replicated as effects and replayed from the AOF (with
//! the module or without it); a replay after a failover
//! charged once; the script reading a bucket its waiters charged ahead.

mod common;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

fn info(con: &mut Connection, field: &str) -> i64 {
    let text: String = cmd("INFO").arg("qag").query(con).unwrap();
    text.lines()
        .find_map(|line| {
            line.strip_prefix(&format!("qag_{field}:"))?
                .trim()
                .parse()
                .ok()
        })
        .unwrap_or_else(|| panic!("no qag_{field} in INFO"))
}

/// Waits until INFO says `field` is `value`.
fn until_info(con: &mut Connection, field: &str, value: i64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while info(con, field) != value {
        assert!(
            Instant::now() < deadline,
            "qag_{field} never became {value}"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn ints(con: &mut Connection, words: &[&str]) -> Vec<i64> {
    let mut c = cmd(words[0]);
    for word in &words[1..] {
        c.arg(*word);
    }
    c.query(con).unwrap_or_else(|e| panic!("{words:?}: {e}"))
}

/// A waiter on a connection of its own, its reply and when it came.
type Waiting = std::thread::JoinHandle<(Vec<i64>, Instant)>;

fn wait_on(server: &Server, words: &[&str]) -> Waiting {
    send_on(server.client().get_connection().unwrap(), words)
}

/// A waiter on `con`, connected already.
fn send_on(mut con: Connection, words: &[&str]) -> Waiting {
    let words: Vec<String> = words.iter().map(|w| w.to_string()).collect();
    std::thread::spawn(move || {
        let words: Vec<&str> = words.iter().map(String::as_str).collect();
        let reply = ints(&mut con, &words);
        (reply, Instant::now())
    })
}

/// Issue 36: 100 waiters from separate connections on a drained 10/s bucket: every one
/// served, in arrival order, each within 50 ms of its token's time, and over every
/// interval no more departures than the count and the refill allow. When a waiter was
/// served is read off the server's clock (when it arrived, and the wait its reply
/// says), not off a test thread that a loaded machine may wake late.
#[test]
fn a_hundred_waiters_are_served_in_arrival_order_at_their_tokens_time() {
    if external("a_hundred_waiters_are_served_in_arrival_order_at_their_tokens_time") {
        return;
    }
    let _timed = Cores::shared();
    let server = Server::start(&ServerOptions::default());
    let mut con = server.client().get_connection().unwrap();
    let connections: Vec<Connection> = (0..100)
        .map(|_| server.client().get_connection().unwrap())
        .collect();
    assert_eq!(
        ints(&mut con, &["QAG.TAKE", "b", "10", "1", "COST", "10"])[0],
        1
    );
    let drained = Instant::now();
    let mut waiters = Vec::new();
    for (n, waiter) in connections.into_iter().enumerate() {
        let sent = Instant::now();
        let thread = send_on(waiter, &["QAG.TAKE", "b", "10", "1", "WAIT", "15000"]);
        // Each one waiting before the next is sent: their arrival order is known.
        until_info(&mut con, "wait_started", n as i64 + 1);
        waiters.push((sent, Instant::now(), thread));
    }
    // When each was served: between its sending and its arrival, plus its wait.
    let mut served = Vec::new();
    for (n, (sent, arrived, thread)) in waiters.into_iter().enumerate() {
        let (reply, _) = thread.join().unwrap();
        assert_eq!(reply[..3], [1, 0, 0], "waiter {n}: {reply:?}");
        let waited = Duration::from_millis(reply[3] as u64);
        let (earliest, latest) = (sent + waited, arrived + waited);
        // Its token: the (n+1)-th tenth of a second after the bucket was drained.
        let token = drained + Duration::from_millis(100 * (n as u64 + 1));
        let late = earliest.saturating_duration_since(token);
        let early = token.saturating_duration_since(latest);
        assert!(
            late < Duration::from_millis(50),
            "waiter {n} came {late:?} late"
        );
        assert!(
            early < Duration::from_millis(10),
            "waiter {n} came {early:?} early"
        );
        served.push(earliest + (latest - earliest) / 2);
    }
    for (n, pair) in served.windows(2).enumerate() {
        assert!(pair[1] > pair[0], "waiter {} overtook waiter {n}", n + 1);
    }
    for i in 0..served.len() {
        for j in i..served.len() {
            let span = served[j].duration_since(served[i]).as_secs_f64();
            let departures = (j - i + 1) as f64;
            // 2 ms for the span read off two clocks.
            assert!(
                departures <= 10.0 + 10.0 * (span + 0.002),
                "{i}..{j} in {span} s"
            );
        }
    }
    assert_eq!(info(&mut con, "wait_served"), 100);
    assert_eq!(info(&mut con, "waiters"), 0);
    assert!(
        info(&mut con, "wait_ms") > 100 * 5_000 / 2,
        "total time waited"
    );
}

/// A `redis-cli` process of its own sending one call.
fn cli(server: &Server, words: &[&str]) -> Child {
    Command::new("redis-cli")
        .arg("-p")
        .arg(server.port.to_string())
        .args(words)
        .stdout(Stdio::piped())
        .spawn()
        .expect("run redis-cli")
}

/// Issue 36: waiters from two client processes (two gateway instances), interleaved:
/// served in arrival order across both, each at its token's time (read off the
/// server's clock, as above).
#[test]
fn waiters_of_two_processes_keep_their_arrival_order() {
    if external("waiters_of_two_processes_keep_their_arrival_order") {
        return;
    }
    let _timed = Cores::shared();
    let server = Server::start(&ServerOptions::default());
    let mut con = server.client().get_connection().unwrap();
    ints(&mut con, &["QAG.TAKE", "b", "5", "1", "COST", "5"]);
    let drained = Instant::now();
    let mut waiters = Vec::new();
    for n in 0..8 {
        let who = if n % 2 == 0 { "a" } else { "b" };
        let sent = Instant::now();
        let child = cli(&server, &["QAG.TAKE", "b", "5", "1", "WAIT", "5000"]);
        until_info(&mut con, "wait_started", n + 1);
        waiters.push((who, sent, Instant::now(), child));
    }
    for (n, (who, sent, arrived, child)) in waiters.into_iter().enumerate() {
        let output = child.wait_with_output().unwrap();
        let text = String::from_utf8(output.stdout).unwrap();
        assert!(text.starts_with("1\n"), "{who}{n}: {text}");
        let waited: u64 = text.lines().nth(3).unwrap().trim().parse().unwrap();
        let waited = Duration::from_millis(waited);
        // Its token: the (n+1)-th fifth of a second after the drain.
        let token = drained + Duration::from_millis(200 * (n as u64 + 1));
        let late = (sent + waited).saturating_duration_since(token);
        let early = token.saturating_duration_since(arrived + waited);
        assert!(
            late < Duration::from_millis(50),
            "{who}{n} came {late:?} late"
        );
        assert!(
            early < Duration::from_millis(10),
            "{who}{n} came {early:?} early"
        );
    }
}

/// Issue 36: a waiter whose connection closes gets nothing and gives back what it was
/// charged: the next plain TAKE after its would-be token time is allowed.
#[test]
fn a_waiter_that_disconnects_gives_back_its_tokens() {
    if external("a_waiter_that_disconnects_gives_back_its_tokens") {
        return;
    }
    let _timed = Cores::shared();
    let server = Server::start(&ServerOptions::default());
    let mut con = server.client().get_connection().unwrap();
    assert_eq!(ints(&mut con, &["QAG.TAKE", "b", "1", "1"])[0], 1);
    let drained = Instant::now();
    {
        let mut waiter = std::net::TcpStream::connect(("127.0.0.1", server.port)).unwrap();
        use std::io::Write;
        waiter
            .write_all(b"*6\r\n$8\r\nQAG.TAKE\r\n$1\r\nb\r\n$1\r\n1\r\n$1\r\n1\r\n$4\r\nWAIT\r\n$4\r\n5000\r\n")
            .unwrap();
        until_info(&mut con, "waiters", 1);
        let owed: f64 = cmd("HGET").arg("b").arg("tokens").query(&mut con).unwrap();
        assert!(owed < -0.5, "charged when it arrived: {owed}");
    }
    until_info(&mut con, "wait_given_back", 1);
    assert_eq!(info(&mut con, "waiters"), 0);
    // Its token time: a second after the drain. The token is there for anyone.
    std::thread::sleep(
        (drained + Duration::from_millis(1050)).saturating_duration_since(Instant::now()),
    );
    assert_eq!(ints(&mut con, &["QAG.TAKE", "b", "1", "1"])[..2], [1, 0]);
}

/// CLIENT UNBLOCK on a waiter: refused at once (with how long it waited), its charge
/// given back, its request id forgotten (so the request may be sent again).
#[test]
fn client_unblock_refuses_a_waiter_and_gives_back() {
    if external("client_unblock_refuses_a_waiter_and_gives_back") {
        return;
    }
    let server = Server::start(&ServerOptions::default());
    let mut con = server.client().get_connection().unwrap();
    ints(&mut con, &["QAG.TAKE", "b", "1", "10"]);
    let mut waiter_con = server.client().get_connection().unwrap();
    let id: i64 = cmd("CLIENT").arg("ID").query(&mut waiter_con).unwrap();
    let waiter = std::thread::spawn(move || {
        ints(
            &mut waiter_con,
            &["QAG.TAKE", "b", "1", "10", "ID", "r1", "WAIT", "20000"],
        )
    });
    until_info(&mut con, "waiters", 1);
    assert!(cmd("HEXISTS")
        .arg("b")
        .arg("id:take:r1")
        .query::<bool>(&mut con)
        .unwrap());
    std::thread::sleep(Duration::from_millis(100));
    let unblocked: i64 = cmd("CLIENT")
        .arg("UNBLOCK")
        .arg(id)
        .query(&mut con)
        .unwrap();
    assert_eq!(unblocked, 1);
    let reply = waiter.join().unwrap();
    assert_eq!(reply[..2], [0, 0], "{reply:?}");
    assert!(
        reply[2] >= 9 && reply[3] >= 100,
        "retry in ~10 s, waited ~0.1 s: {reply:?}"
    );
    until_info(&mut con, "wait_given_back", 1);
    let tokens: f64 = cmd("HGET").arg("b").arg("tokens").query(&mut con).unwrap();
    assert!((0.0..0.1).contains(&tokens), "given back: {tokens}");
    assert!(!cmd("HEXISTS")
        .arg("b")
        .arg("id:take:r1")
        .query::<bool>(&mut con)
        .unwrap());
}

/// Issue 36: four waiters on a full `max 2`, released one by one: acquired in arrival
/// order within 20 ms of each release, each lease running its ttl from then; a lease
/// running out wakes the first waiter; a timed-out waiter holds nothing.
#[test]
fn leases_go_to_waiters_in_arrival_order_on_release_and_on_expiry() {
    if external("leases_go_to_waiters_in_arrival_order_on_release_and_on_expiry") {
        return;
    }
    let _timed = Cores::shared();
    let server = Server::start(&ServerOptions::default());
    let mut con = server.client().get_connection().unwrap();
    let lease = |id: &str, wait: &str| {
        ["QAG.LEASE", "l", "2", "60000", id, "WAIT", wait].map(str::to_owned)
    };
    for id in ["a", "b"] {
        assert_eq!(
            ints(&mut con, &["QAG.LEASE", "l", "2", "60000", id]),
            [1, 1 + i64::from(id == "b"), 0]
        );
    }
    let mut waiters = Vec::new();
    for n in 0..4 {
        let words = lease(&format!("w{n}"), "10000");
        let words: Vec<&str> = words.iter().map(String::as_str).collect();
        waiters.push(wait_on(&server, &words));
        until_info(&mut con, "wait_started", n + 1);
    }
    let mut released = Vec::new();
    for id in ["a", "b", "w0", "w1"] {
        std::thread::sleep(Duration::from_millis(100));
        released.push(Instant::now());
        let released: i64 = cmd("QAG.RELEASE").arg("l").arg(id).query(&mut con).unwrap();
        assert_eq!(released, 1, "{id}");
        // Its slot went to the next waiter: still two held.
        let live: i64 = cmd("QAG.LEASES").arg("l").query(&mut con).unwrap();
        assert_eq!(live, 2);
    }
    for (n, waiter) in waiters.into_iter().enumerate() {
        let (reply, at) = waiter.join().unwrap();
        assert_eq!(reply[..3], [1, 2, 0], "w{n}");
        let after = at.saturating_duration_since(released[n]);
        assert!(
            after < Duration::from_millis(20),
            "w{n} {after:?} after its release"
        );
    }
    // A lease running out wakes the first waiter, whose lease runs its ttl from then.
    assert_eq!(ints(&mut con, &["QAG.LEASE", "e", "1", "300", "x"])[0], 1);
    let started = Instant::now();
    let reply = ints(
        &mut con,
        &["QAG.LEASE", "e", "1", "60000", "y", "WAIT", "2000"],
    );
    assert_eq!(reply[..3], [1, 1, 0]);
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(280) && took < Duration::from_millis(400),
        "{took:?}"
    );
    let (s, us): (i64, i64) = cmd("TIME").query(&mut con).unwrap();
    let expiry: f64 = cmd("ZSCORE").arg("e").arg("y").query(&mut con).unwrap();
    assert!(
        expiry >= (s * 1000 + us / 1000 + 59_900) as f64,
        "ttl from when it was acquired"
    );
    // A waiter whose time runs out is refused and holds nothing.
    let reply = ints(
        &mut con,
        &["QAG.LEASE", "e", "1", "60000", "z", "WAIT", "200"],
    );
    assert_eq!(reply[..3], [0, 1, 1]);
    assert!(reply[3] >= 200);
    let score: Option<f64> = cmd("ZSCORE").arg("e").arg("z").query(&mut con).unwrap();
    assert_eq!(score, None);
    assert_eq!(info(&mut con, "wait_timed_out"), 1);
    // WAIT 0 never waits; without WAIT the reply keeps its three elements.
    assert_eq!(
        ints(
            &mut con,
            &["QAG.LEASE", "e", "1", "60000", "z", "WAIT", "0"]
        ),
        [0, 1, 1, 0]
    );
    assert_eq!(
        ints(&mut con, &["QAG.LEASE", "e", "1", "60000", "z"]),
        [0, 1, 1]
    );
}

/// A slot freed by another command wakes the first slot waiter: DEL, ZREM (a script's
/// release) and the key expiring. The module subscribes to those events only while slot
/// waiters wait, and subscribes again for the next: the last case comes after the
/// module has had time to drop its subscription (where the server can).
#[test]
fn a_slot_freed_by_another_command_wakes_a_waiter() {
    if external("a_slot_freed_by_another_command_wakes_a_waiter") {
        return;
    }
    let _timed = Cores::shared();
    let server = Server::start(&ServerOptions::default());
    let mut con = server.client().get_connection().unwrap();
    let frees: [(&str, &[&str]); 4] = [
        ("del", &["DEL", "k"]),
        ("zrem", &["ZREM", "k", "a"]),
        ("expired", &["PEXPIRE", "k", "50"]),
        ("del after quiet", &["DEL", "k"]),
    ];
    for (n, (what, free)) in frees.into_iter().enumerate() {
        if what.ends_with("quiet") {
            std::thread::sleep(Duration::from_millis(2500));
        }
        assert_eq!(ints(&mut con, &["QAG.LEASE", "k", "1", "60000", "a"])[0], 1);
        let waiter = wait_on(
            &server,
            &["QAG.LEASE", "k", "1", "60000", "w", "WAIT", "5000"],
        );
        until_info(&mut con, "wait_started", n as i64 + 1);
        let freed = Instant::now();
        let _: redis::Value = cmd(free[0]).arg(&free[1..]).query(&mut con).unwrap();
        let (reply, at) = waiter.join().unwrap();
        assert_eq!(reply[..3], [1, 1, 0], "{what}");
        let after = at.saturating_duration_since(freed);
        let bound = Duration::from_millis(if what == "expired" { 300 } else { 50 });
        assert!(
            after < bound,
            "{what}: served {after:?} after the slot was freed"
        );
        let _: i64 = cmd("DEL").arg("k").query(&mut con).unwrap();
    }
}

/// TAKE2 waits for the later of its buckets and charges both when it arrives, or
/// neither (then answering as without WAIT); THROTTLE waits its turn as TAKE does.
#[test]
fn take2_and_throttle_wait_their_turn() {
    if external("take2_and_throttle_wait_their_turn") {
        return;
    }
    let _timed = Cores::shared();
    let server = Server::start(&ServerOptions::default());
    let mut con = server.client().get_connection().unwrap();
    // The key bucket empty (5 a second), the client bucket full.
    ints(&mut con, &["QAG.TAKE", "k", "5", "1", "COST", "5"]);
    let started = Instant::now();
    let pair: Vec<Vec<i64>> = cmd("QAG.TAKE2")
        .arg(&["c", "100", "1", "k", "5", "1", "WAIT", "1000"])
        .query(&mut con)
        .unwrap();
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(180) && took < Duration::from_millis(300),
        "{took:?}"
    );
    assert_eq!(
        (pair[0][..3].to_vec(), pair[1][..3].to_vec()),
        (vec![1, 99, 0], vec![1, 0, 0])
    );
    assert_eq!(pair[0][3], pair[1][3], "one wait for both");
    // Too long a wait for the key bucket: as without WAIT, the client bucket charged.
    ints(&mut con, &["QAG.TAKE", "k", "5", "1", "COST", "5"]);
    let pair: Vec<Option<Vec<i64>>> = cmd("QAG.TAKE2")
        .arg(&["c", "100", "1", "k", "5", "1", "WAIT", "10"])
        .query(&mut con)
        .unwrap();
    assert_eq!(pair[0].as_deref().map(|r| r[0]), Some(1));
    assert_eq!(pair[1].as_deref().map(|r| (r[0], r[3])), Some((0, 0)));
    assert_eq!(info(&mut con, "wait_refused"), 1);
    // THROTTLE: one a second, no burst: the second call waits a second.
    assert_eq!(
        ints(
            &mut con,
            &["QAG.THROTTLE", "t", "0", "1", "1", "WAIT", "3000"]
        )[..1],
        [0]
    );
    let started = Instant::now();
    let reply = ints(
        &mut con,
        &["QAG.THROTTLE", "t", "0", "1", "1", "WAIT", "3000"],
    );
    let took = started.elapsed();
    assert_eq!(
        reply[..4],
        [0, 1, 0, -1],
        "allowed after its wait: {reply:?}"
    );
    assert!(
        took >= Duration::from_millis(950) && took < Duration::from_millis(1100),
        "{took:?}"
    );
    assert_eq!(reply.len(), 6);
    let limited = ints(
        &mut con,
        &["QAG.THROTTLE", "t", "0", "1", "1", "WAIT", "100"],
    );
    assert_eq!(
        (limited[0], limited[5]),
        (1, 0),
        "too long a wait: limited at once"
    );
}

/// Inside MULTI/EXEC or a script a WAIT never blocks: answered at once as without
/// WAIT. MAX-WAITERS caps the server's waiting clients: beyond it, at once too. Bad
/// WAIT values are errors that write nothing.
#[test]
fn where_no_client_may_wait_the_answer_comes_at_once() {
    if external("where_no_client_may_wait_the_answer_comes_at_once") {
        return;
    }
    let _timed = Cores::shared();
    let server = Server::start(&ServerOptions {
        module_args: vec!["MAX-WAITERS".into(), "1".into()],
        ..Default::default()
    });
    let mut con = server.client().get_connection().unwrap();
    ints(&mut con, &["QAG.TAKE", "b", "1", "10"]);
    let replies: Vec<Vec<i64>> = redis::pipe()
        .atomic()
        .cmd("QAG.TAKE")
        .arg(&["b", "1", "10", "WAIT", "30000"])
        .query(&mut con)
        .unwrap();
    assert_eq!(replies[0][..2], [0, 0]);
    assert_eq!(replies[0][3], 0);
    let script = "return redis.call('QAG.TAKE', KEYS[1], 1, 10, 'WAIT', 30000)";
    let reply: Vec<i64> = cmd("EVAL")
        .arg(script)
        .arg(1)
        .arg("b")
        .query(&mut con)
        .unwrap();
    assert_eq!((reply[0], reply[3]), (0, 0));
    assert_eq!(info(&mut con, "wait_started"), 0);
    // One waiter fills MAX-WAITERS 1: the next answers at once.
    let first = wait_on(&server, &["QAG.TAKE", "b", "1", "10", "WAIT", "30000"]);
    until_info(&mut con, "waiters", 1);
    let at_once = Instant::now();
    let reply = ints(&mut con, &["QAG.TAKE", "b", "1", "10", "WAIT", "30000"]);
    assert!(at_once.elapsed() < Duration::from_millis(100));
    assert_eq!((reply[0], reply[3]), (0, 0));
    assert_eq!(info(&mut con, "wait_full"), 1);
    let clients: String = cmd("CLIENT").arg("LIST").query(&mut con).unwrap();
    let waiter_id = clients
        .lines()
        .find(|line| line.contains("cmd=qag.take") && line.contains("flags=b"))
        .and_then(|line| line.split_whitespace().next()?.strip_prefix("id="))
        .expect("the waiter");
    let _: i64 = cmd("CLIENT")
        .arg("UNBLOCK")
        .arg(waiter_id)
        .query(&mut con)
        .unwrap();
    first.join().unwrap();
    until_info(&mut con, "wait_given_back", 1);
    // Bad values: an error, nothing written.
    let before = dataset(&mut con);
    for (words, error) in [
        (
            vec!["QAG.TAKE", "b", "1", "10", "WAIT"],
            "WAIT needs a number of milliseconds",
        ),
        (
            vec!["QAG.TAKE", "b", "1", "10", "WAIT", "-1"],
            "WAIT must be an integer from 0 to 60000",
        ),
        (
            vec!["QAG.TAKE", "b", "1", "10", "WAIT", "0.5"],
            "WAIT must be an integer from 0 to 60000",
        ),
        (
            vec!["QAG.TAKE", "b", "1", "10", "WAIT", "60001"],
            "WAIT must be an integer from 0 to 60000",
        ),
        (
            vec!["QAG.TAKE", "b", "1", "10", "WAIT", "1", "WAIT", "1"],
            "WAIT given more than once",
        ),
        (
            vec!["QAG.TAKE2", "b", "1", "10", "k", "1", "10", "WAIT", "x"],
            "WAIT must be an integer from 0 to 60000",
        ),
        (
            vec!["QAG.LEASE", "l", "1", "100", "x", "WAIT", "1", "WAIT", "1"],
            "WAIT given more than once",
        ),
        (
            vec![
                "QAG.THROTTLE",
                "t",
                "0",
                "1",
                "1",
                "WAIT",
                "99999999999999999999",
            ],
            "WAIT must be an integer from 0 to 60000",
        ),
        (
            vec!["QAG.PEEK", "b", "1", "10", "WAIT", "5"],
            "syntax error",
        ),
    ] {
        let mut c = cmd(words[0]);
        for word in &words[1..] {
            c.arg(*word);
        }
        let e = c.query::<redis::Value>(&mut con).unwrap_err();
        assert!(e.to_string().contains(error), "{words:?}: {e}");
    }
    assert_eq!(dataset(&mut con), before, "nothing written");
}

/// The charge is replicated when it is made and the give-back when it happens, as
/// effects: a replica without the module stays equal to the primary.
#[test]
fn charges_and_give_backs_replicate_as_effects() {
    if external("charges_and_give_backs_replicate_as_effects") {
        return;
    }
    let (primary, replica) = primary_and_replica();
    let mut p = primary.client().get_connection().unwrap();
    let mut r = replica.client().get_connection().unwrap();
    ints(&mut p, &["QAG.TAKE", "b", "1", "10"]);
    let waiter = std::net::TcpStream::connect(("127.0.0.1", primary.port)).unwrap();
    {
        use std::io::Write;
        (&waiter)
            .write_all(b"*6\r\n$8\r\nQAG.TAKE\r\n$1\r\nb\r\n$1\r\n1\r\n$2\r\n10\r\n$4\r\nWAIT\r\n$5\r\n30000\r\n")
            .unwrap();
    }
    until_info(&mut p, "waiters", 1);
    let synced = |p: &mut Connection, r: &mut Connection| {
        let _: i64 = cmd("WAIT").arg(1).arg(5000).query(p).unwrap();
        assert_eq!(dataset(p), dataset(r));
    };
    synced(&mut p, &mut r);
    let owed: f64 = cmd("HGET").arg("b").arg("tokens").query(&mut r).unwrap();
    assert!(owed < -0.9, "the charge reached the replica: {owed}");
    drop(waiter);
    until_info(&mut p, "wait_given_back", 1);
    synced(&mut p, &mut r);
    let back: f64 = cmd("HGET").arg("b").arg("tokens").query(&mut r).unwrap();
    assert!(back > -0.1, "the give-back reached the replica: {back}");
}

/// Issue 36: the AOF holds a waiter's charge and its give-back as the plain writes
/// they are: a server without the module replays it into the same data, and so does
/// one with the module.
#[test]
fn charges_and_give_backs_replay_from_the_aof_without_the_module() {
    if external("charges_and_give_backs_replay_from_the_aof_without_the_module") {
        return;
    }
    let dir = std::env::temp_dir().join(format!("qag-wait-aof-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let options = |without_module| ServerOptions {
        without_module,
        dir: Some(dir.clone()),
        extra: ["--appendonly", "yes", "--appendfsync", "always"]
            .map(String::from)
            .to_vec(),
        ..Default::default()
    };
    let server = Server::start(&options(false));
    let mut con = server.client().get_connection().unwrap();
    ints(&mut con, &["QAG.TAKE", "b", "1", "10"]);
    let waiter = std::net::TcpStream::connect(("127.0.0.1", server.port)).unwrap();
    {
        use std::io::Write;
        (&waiter)
            .write_all(b"*6\r\n$8\r\nQAG.TAKE\r\n$1\r\nb\r\n$1\r\n1\r\n$2\r\n10\r\n$4\r\nWAIT\r\n$5\r\n30000\r\n")
            .unwrap();
    }
    until_info(&mut con, "waiters", 1);
    let owed: f64 = cmd("HGET").arg("b").arg("tokens").query(&mut con).unwrap();
    assert!(owed < -0.9, "charged on arrival: {owed}");
    drop(waiter);
    until_info(&mut con, "wait_given_back", 1);
    let written = dataset(&mut con);
    let tokens: f64 = cmd("HGET").arg("b").arg("tokens").query(&mut con).unwrap();
    assert!(tokens > -0.1, "given back: {tokens}");
    server.shutdown();
    for without_module in [true, false] {
        let server = Server::start(&options(without_module));
        let mut con = server.client().get_connection().unwrap();
        assert_eq!(
            dataset(&mut con),
            written,
            "without the module: {without_module}"
        );
        server.shutdown();
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Issue 36: a waiter with an id whose primary is killed, replayed with its id on the
/// promoted replica: it waits what is left of its wait and is charged once.
#[test]
fn a_waiter_replayed_after_a_failover_is_charged_once() {
    if external("a_waiter_replayed_after_a_failover_is_charged_once") {
        return;
    }
    let _timed = Cores::shared();
    let (primary, replica) = primary_and_linked_replica(false);
    let mut p = primary.client().get_connection().unwrap();
    let mut r = replica.client().get_connection().unwrap();
    let take = ["QAG.TAKE", "b", "1", "2", "ID", "req-9", "WAIT", "5000"];
    ints(&mut p, &["QAG.TAKE", "b", "1", "2"]);
    let started = Instant::now();
    let mut first = primary.client().get_connection().unwrap();
    // Its connection breaks with the primary: no answer.
    let first = std::thread::spawn(move || cmd(take[0]).arg(&take[1..]).query::<Value>(&mut first));
    until_info(&mut p, "waiters", 1);
    let _: i64 = cmd("WAIT").arg(1).arg(5000).query(&mut p).unwrap();
    drop(primary);
    assert!(first.join().unwrap().is_err());
    let _: () = cmd("REPLICAOF").arg("NO").arg("ONE").query(&mut r).unwrap();
    let reply = ints(&mut r, &take);
    let took = started.elapsed();
    assert_eq!(reply[..3], [1, 0, 0], "{reply:?}");
    // Its token: two seconds after the drain, not two seconds after the replay.
    assert!(
        took >= Duration::from_millis(1900) && took < Duration::from_millis(2300),
        "{took:?}"
    );
    // Stored as its charge left it (-1: one token owed), not -2.
    let tokens: f64 = cmd("HGET").arg("b").arg("tokens").query(&mut r).unwrap();
    assert!((-1.1..-0.9).contains(&tokens), "charged once: {tokens}");
}

/// A bucket charged ahead by waiters reads, to `lua/token_bucket.lua`, as a bucket
/// with fewer tokens: it refuses until they have refilled, and keeps the key until the
/// bucket is full, so its expiry erases nothing the waiters were charged.
#[test]
fn the_script_reads_a_bucket_charged_ahead_as_one_with_fewer_tokens() {
    if external("the_script_reads_a_bucket_charged_ahead_as_one_with_fewer_tokens") {
        return;
    }
    let _timed = Cores::shared();
    let server = Server::start(&ServerOptions::default());
    let mut con = server.client().get_connection().unwrap();
    let sha = load_script(&mut con);
    ints(&mut con, &["QAG.TAKE", "b", "2", "1", "COST", "2"]);
    let waiters: Vec<Waiting> = (0..4)
        .map(|n| {
            let waiter = wait_on(&server, &["QAG.TAKE", "b", "2", "1", "WAIT", "5000"]);
            until_info(&mut con, "wait_started", n + 1);
            waiter
        })
        .collect();
    // Four owed at 2 a second: 2 s to none, 3 s to full.
    let reply: Vec<i64> = cmd("EVALSHA")
        .arg(&sha)
        .arg(1)
        .arg("b")
        .arg(2)
        .arg(1)
        .arg(1)
        .query(&mut con)
        .unwrap();
    assert_eq!(
        reply,
        [0, 0, 3],
        "refused until the waiters' tokens are there"
    );
    let ttl: i64 = cmd("PTTL").arg("b").query(&mut con).unwrap();
    assert!(ttl > 2_900, "kept until full: {ttl} ms");
    for waiter in waiters {
        assert_eq!(waiter.join().unwrap().0[0], 1);
    }
    std::thread::sleep(Duration::from_millis(600));
    let reply: Vec<i64> = cmd("EVALSHA")
        .arg(&sha)
        .arg(1)
        .arg("b")
        .arg(2)
        .arg(1)
        .arg(1)
        .query(&mut con)
        .unwrap();
    assert_eq!(reply[0], 1, "its tokens refill after the waiters'");
}
