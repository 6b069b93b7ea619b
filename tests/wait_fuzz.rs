//! Issue 44's search: random schedules of waiters and of everything that can end or
//! wake them, raced in one turn of the server's event loop, checked after every
//! schedule against the promises.
//!
//! A schedule: waiters (QAG.TAKE, TAKE2, THROTTLE, LEASE with WAIT; some with request ids,
//! some replays of them) from connections of their own; then a few batches, each one write
//! on an admin connection, plain, in MULTI/EXEC or in an EVAL: releases, refunds, takes
//! and leases without WAIT, CLIENT KILL (by id, by address, every normal client), CLIENT
//! UNBLOCK (TIMEOUT, ERROR), CLIENT PAUSE … WRITE, and in a "wild" schedule DEL, UNLINK,
//! SET, RENAME and EXPIRE of waited keys, FLUSHDB and FLUSHALL (sync and ASYNC), SWAPDB,
//! SELECT, DEBUG RELOAD and a primary turned replica; beside each batch, waiters closing
//! (a half close: whatever the server sent can still be read) or resetting their
//! connection. Short leases run out on their own.
//!
//! After each schedule: the server is alive; nothing waits (`qag_waiters` 0, the
//! server's `blocked_clients` 0); each waiter got exactly one reply, or none when it was
//! gone (and never two); in a schedule that destroys nothing, every charge stands or
//! was given back exactly as the answers say: each bucket's tokens equal the arithmetic
//! of the answers sent (a waiter's cost stands exactly when its allowed answer reached
//! it, a request's once however many replays), and a lease key's live members are the
//! leases acquired and not released; the replica equals the primary. At the end, the
//! primary's AOF, loaded by a server without the module, equals its data.
//!
//! `QAG_FUZZ_SECONDS` (default 45) bounds a run; `QAG_FUZZ_SEED` replays one (the
//! schedules' choices, not the machine's timing), `QAG_FUZZ_TRACE` prints its waiters
//! and batches; every failure names its seed and schedule. A second test runs the primary under valgrind's memcheck for
//! `QAG_FUZZ_VALGRIND_SECONDS` (default 30, beside the first: about a minute in all) and finds no invalid access (the server's
//! frames included) and no leak or uninitialised read in the module's.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use common::resp::{NoReply, RawCon, Resp};
use common::*;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

/// A bucket whose arithmetic the model follows: a refill of 10 a second, a count no
/// schedule comes near (so no call is ever capped by it).
const COUNT: i64 = 1000;
const PERIOD: &str = "100";
const RATE: f64 = 10.0;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Family {
    /// QAG.TAKE on the checked bucket.
    Take,
    /// QAG.TAKE2 on the checked pair.
    Pair,
    Throttle,
    /// QAG.LEASE on the checked lease key.
    Lease,
    /// QAG.TAKE and QAG.LEASE on keys a wild schedule destroys.
    WildTake,
    WildLease,
}

/// How a waiter's client ended, as far as the test made it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum End {
    Open,
    /// Half closed by the test: what the server sent can still be read (a reply it had
    /// not sent yet may be lost: the server frees the client at its end).
    Closed,
    /// Reset by the test: what the server sent is lost to it.
    Reset,
    /// Killed by the server (CLIENT KILL, or closed after a demotion's error).
    Killed,
}

struct Waiter {
    con: Option<RawCon>,
    family: Family,
    client_id: String,
    addr: String,
    words: Vec<String>,
    cost: i64,
    /// A request id (shared with its replays).
    request: Option<String>,
    /// A lease's id.
    lease: Option<String>,
    end: End,
    /// Unblocked by CLIENT UNBLOCK … TIMEOUT: on 7.0, one answered in the same turn gets
    /// no reply at all (the server's doing).
    unblocked_timeout: bool,
    answer: Option<Resp>,
    /// Replies after the first (a violation).
    extra: usize,
}

/// The keys of one schedule.
struct Keys {
    bucket: String,
    client: String,
    key: String,
    throttle: String,
    lease: String,
    wild_bucket: String,
    wild_lease: String,
}

impl Keys {
    fn new(schedule: u64) -> Keys {
        let k = |name: &str| format!("f{schedule}:{name}");
        Keys {
            bucket: k("b"),
            client: k("c"),
            key: k("k"),
            throttle: k("t"),
            lease: k("L"),
            wild_bucket: k("x"),
            wild_lease: k("y"),
        }
    }
}

/// What the answers of one schedule say the checked keys must hold.
#[derive(Default)]
struct Ledger {
    /// Per bucket: its tokens and `ts` after the drain, and the tokens taken (plain takes
    /// allowed) and refunded by the admin's calls.
    drained: BTreeMap<String, (f64, f64)>,
    taken: BTreeMap<String, f64>,
    /// Per lease id of the checked lease key: acquired (an allowed answer read) and
    /// released (a RELEASE answered 1).
    acquired: BTreeSet<String>,
    released: BTreeSet<String>,
    /// Leases that run out about when the schedule ends: there, or not.
    short: BTreeSet<String>,
}

struct Stats {
    schedules: u64,
    wild: u64,
    waiters: u64,
    actions: u64,
    served: u64,
    gone: u64,
}

struct Fuzz {
    rng: StdRng,
    seed: u64,
    primary: Server,
    replica: Option<Server>,
    valgrind: bool,
    redis_70: bool,
    schedule: u64,
    stats: Stats,
}

fn server_options(aof: bool, replica_of: Option<u16>, wrapper: Vec<String>) -> ServerOptions {
    let mut extra: Vec<String> = ["--enable-debug-command", "yes"].map(String::from).to_vec();
    if aof {
        extra.extend(["--appendonly", "yes", "--appendfsync", "always"].map(String::from));
    }
    ServerOptions {
        replica_of,
        wrapper,
        extra,
        ..Default::default()
    }
}

impl Fuzz {
    fn new(valgrind_log: Option<&std::path::Path>) -> Fuzz {
        let seed = std::env::var("QAG_FUZZ_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| unix_ms() ^ u64::from(std::process::id()));
        eprintln!("wait fuzz: seed {seed} (QAG_FUZZ_SEED={seed} replays its schedules)");
        let wrapper = valgrind_log.map(memcheck).unwrap_or_default();
        let primary = Server::start(&server_options(true, None, wrapper));
        let replica = Some(Server::start(&server_options(
            true,
            Some(primary.port),
            Vec::new(),
        )));
        let mut con = RawCon::connect(primary.port);
        let version = con.call(&["INFO", "server"]).text();
        let redis_70 = version.contains("redis_version:7.0.") && !version.contains("valkey");
        let mut fuzz = Fuzz {
            rng: StdRng::seed_from_u64(seed),
            seed,
            primary,
            replica,
            valgrind: valgrind_log.is_some(),
            redis_70,
            schedule: 0,
            stats: Stats {
                schedules: 0,
                wild: 0,
                waiters: 0,
                actions: 0,
                served: 0,
                gone: 0,
            },
        };
        fuzz.until_linked();
        fuzz
    }

    /// How much longer everything takes: valgrind slows the server tens of times.
    fn slow(&self, d: Duration) -> Duration {
        if self.valgrind {
            d * 20
        } else {
            d
        }
    }

    fn fail(&self, what: &str) -> ! {
        panic!(
            "seed {} schedule {}: {what}\nthe primary's log:\n{}",
            self.seed,
            self.schedule,
            self.primary.log()
        )
    }

    fn admin(&self) -> RawCon {
        RawCon::connect(self.primary.port)
    }

    fn until_linked(&mut self) {
        let Some(replica) = &self.replica else {
            return;
        };
        let mut con = RawCon::connect(replica.port);
        let deadline = Instant::now() + Duration::from_secs(30);
        while !con
            .call(&["INFO", "replication"])
            .text()
            .contains("master_link_status:up")
        {
            if Instant::now() > deadline {
                self.fail("the replica never linked");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Runs schedules for `seconds`.
    fn run(&mut self, seconds: u64) {
        let end = Instant::now() + Duration::from_secs(seconds);
        while Instant::now() < end {
            self.schedule += 1;
            let wild = self.rng.gen_bool(0.35);
            self.run_schedule(wild);
            self.stats.schedules += 1;
            self.stats.wild += u64::from(wild);
        }
        self.check_aof();
        let s = &self.stats;
        eprintln!(
            "wait fuzz (seed {}): {} schedules ({} wild), {} waiters ({} served, {} gone), {} actions: nothing found",
            self.seed, s.schedules, s.wild, s.waiters, s.served, s.gone, s.actions
        );
    }

    fn run_schedule(&mut self, wild: bool) {
        let keys = Keys::new(self.schedule);
        let mut admin = self.admin();
        let mut ledger = Ledger::default();
        self.set_up(&mut admin, &keys, &mut ledger);
        let mut waiters = self.start_waiters(&keys);
        // Every waiter that waits has blocked.
        std::thread::sleep(self.slow(Duration::from_millis(20)));
        let mut pause_until = Instant::now();
        let mut demoted = false;
        let batches = self.rng.gen_range(1..=4);
        for batch in 0..batches {
            if wild && batch == batches - 1 && self.replica.is_some() && self.rng.gen_bool(0.15) {
                self.demote(&mut waiters);
                demoted = true;
                break;
            }
            self.batch(
                &mut admin,
                &keys,
                &mut waiters,
                &mut ledger,
                wild,
                &mut pause_until,
            );
            let gap = self.rng.gen_range(0..120);
            std::thread::sleep(Duration::from_millis(gap));
        }
        let mut admin = self.admin();
        self.settle(&mut admin, &mut waiters, pause_until);
        self.check_replies(&waiters);
        if !wild && !demoted {
            self.check_ledger(&mut admin, &keys, &waiters, &ledger);
        }
        self.check_replica();
    }

    /// The keys' starting state: the checked buckets drained, the checked lease key full
    /// (one lease for the whole schedule, one that runs out within it).
    fn set_up(&mut self, admin: &mut RawCon, keys: &Keys, ledger: &mut Ledger) {
        admin.call(&["SELECT", "0"]);
        for bucket in [&keys.bucket, &keys.client, &keys.key] {
            let all = COUNT.to_string();
            let reply = admin.call(&["QAG.TAKE", bucket, &all, PERIOD, "COST", &all]);
            if reply.ints().first() != Some(&1) {
                self.fail(&format!("draining {bucket}: {reply:?}"));
            }
            let fields = admin.call(&["HMGET", bucket, "tokens", "ts"]);
            let Resp::Array(values) = fields else {
                self.fail("HMGET");
            };
            let tokens: f64 = values[0].text().parse().unwrap();
            let ts: f64 = values[1].text().parse().unwrap();
            ledger.drained.insert(bucket.clone(), (tokens, ts));
        }
        let short_ttl = self.rng.gen_range(100..400).to_string();
        admin.call(&["QAG.LEASE", &keys.lease, "2", "60000", "h1"]);
        admin.call(&["QAG.LEASE", &keys.lease, "2", &short_ttl, "h2"]);
        ledger.acquired.extend(["h1".into(), "h2".into()]);
        ledger.short.insert("h2".into());
        admin.call(&["QAG.THROTTLE", &keys.throttle, "1", "5", "1", "2"]);
        for db in ["0", "1"] {
            admin.call(&["SELECT", db]);
            admin.call(&["QAG.TAKE", &keys.wild_bucket, "2", "1", "COST", "2"]);
            admin.call(&["QAG.LEASE", &keys.wild_lease, "1", "60000", "hy"]);
        }
        admin.call(&["SELECT", "0"]);
    }

    fn start_waiters(&mut self, keys: &Keys) -> Vec<Waiter> {
        let count = self.rng.gen_range(3..=8);
        let mut waiters: Vec<Waiter> = Vec::new();
        for n in 0..count {
            let family = *[
                Family::Take,
                Family::Take,
                Family::Pair,
                Family::Throttle,
                Family::Lease,
                Family::Lease,
                Family::WildTake,
                Family::WildLease,
            ]
            .choose(&mut self.rng)
            .unwrap();
            // Waits long enough to meet the batches on a server slowed by valgrind.
            let scale = if self.valgrind { 5 } else { 1 };
            let wait = (self.rng.gen_range(150..1500) * scale).to_string();
            let cost = self.rng.gen_range(1..=3i64);
            let mut request = None;
            let mut lease = None;
            // A replay: the words of an earlier waiter with a request id.
            let earlier = waiters
                .iter()
                .filter(|w| w.request.is_some())
                .map(|w| (w.family, w.words.clone(), w.cost, w.request.clone()))
                .collect::<Vec<_>>();
            let (family, words) = if !earlier.is_empty() && self.rng.gen_bool(0.3) {
                let (family, words, replay_cost, id) =
                    earlier.choose(&mut self.rng).unwrap().clone();
                request = id;
                let _ = replay_cost;
                (family, words)
            } else {
                let all = COUNT.to_string();
                let mut words: Vec<String> = match family {
                    Family::Take => {
                        vec!["QAG.TAKE".into(), keys.bucket.clone(), all, PERIOD.into()]
                    }
                    Family::Pair => vec![
                        "QAG.TAKE2".into(),
                        keys.client.clone(),
                        all.clone(),
                        PERIOD.into(),
                        keys.key.clone(),
                        all,
                        PERIOD.into(),
                    ],
                    Family::Throttle => {
                        vec![
                            "QAG.THROTTLE".into(),
                            keys.throttle.clone(),
                            "1".into(),
                            "5".into(),
                            "1".into(),
                        ]
                    }
                    Family::WildTake => {
                        vec![
                            "QAG.TAKE".into(),
                            keys.wild_bucket.clone(),
                            "2".into(),
                            "1".into(),
                        ]
                    }
                    Family::Lease | Family::WildLease => {
                        let id = format!("w{n}");
                        lease = Some(id.clone());
                        let key = match family {
                            Family::Lease => keys.lease.clone(),
                            _ => keys.wild_lease.clone(),
                        };
                        vec!["QAG.LEASE".into(), key, "2".into(), "60000".into(), id]
                    }
                };
                if matches!(family, Family::Take | Family::Pair | Family::WildTake) {
                    words.extend(["COST".into(), cost.to_string()]);
                    if self.rng.gen_bool(0.4) {
                        let id = format!("r{n}");
                        request = Some(id.clone());
                        words.extend(["ID".into(), id]);
                    }
                }
                if family == Family::Throttle {
                    words.push(cost.to_string());
                }
                words.extend(["WAIT".into(), wait]);
                (family, words)
            };
            let cost = match words.iter().position(|w| w == "COST") {
                Some(at) => words[at + 1].parse().unwrap(),
                None => 1,
            };
            let mut con = RawCon::connect(self.primary.port);
            let client_id = con.id().to_string();
            let addr = con
                .call(&["CLIENT", "INFO"])
                .text()
                .split(' ')
                .find_map(|f| f.strip_prefix("addr=").map(String::from))
                .unwrap_or_default();
            if matches!(family, Family::WildTake | Family::WildLease) && self.rng.gen_bool(0.3) {
                con.call(&["SELECT", "1"]);
            }
            let refs: Vec<&str> = words.iter().map(String::as_str).collect();
            con.send(&[&refs]);
            if tracing() {
                eprintln!(
                    "schedule {} waiter {n} (client {client_id}): {refs:?}",
                    self.schedule
                );
            }
            self.stats.waiters += 1;
            waiters.push(Waiter {
                con: Some(con),
                family,
                client_id,
                addr,
                words,
                cost,
                request,
                lease,
                end: End::Open,
                unblocked_timeout: false,
                answer: None,
                extra: 0,
            });
            if self.rng.gen_bool(0.5) {
                std::thread::sleep(Duration::from_millis(self.rng.gen_range(0..20)));
            }
        }
        waiters
    }

    /// One batch: the admin's calls in one write (plain, MULTI/EXEC or EVAL), with
    /// waiters closing or resetting beside it.
    fn batch(
        &mut self,
        admin: &mut RawCon,
        keys: &Keys,
        waiters: &mut [Waiter],
        ledger: &mut Ledger,
        wild: bool,
        pause_until: &mut Instant,
    ) {
        #[derive(Clone, Copy, PartialEq)]
        enum Wrap {
            Plain,
            Multi,
            Eval,
        }
        let wrap = *[Wrap::Plain, Wrap::Plain, Wrap::Multi, Wrap::Eval]
            .choose(&mut self.rng)
            .unwrap();
        let n = self.rng.gen_range(1..=5);
        // Each call, and what its reply tells the ledger.
        let mut calls: Vec<(Vec<String>, Effect)> = Vec::new();
        for _ in 0..n {
            if wrap != Wrap::Eval && self.rng.gen_bool(0.3) {
                calls.extend(self.race(keys, waiters));
            } else {
                let call = self.action(keys, waiters, wild, wrap != Wrap::Eval, pause_until);
                calls.push(call);
            }
        }
        self.stats.actions += calls.len() as u64;
        // Waiters leaving beside the batch: before its write, or after it.
        let mut leaving: Vec<(usize, bool)> = Vec::new();
        for (i, waiter) in waiters.iter().enumerate() {
            if waiter.end == End::Open && self.rng.gen_bool(0.12) {
                leaving.push((i, self.rng.gen_bool(0.5)));
            }
        }
        let leave = |waiters: &mut [Waiter], i: usize, rng: &mut StdRng| {
            let waiter = &mut waiters[i];
            let Some(con) = waiter.con.take() else {
                return;
            };
            if rng.gen_bool(0.5) {
                con.reset();
                waiter.end = End::Reset;
            } else {
                waiter.con = Some(con.half_close());
                waiter.end = End::Closed;
            }
        };
        for &(i, before) in &leaving {
            if before {
                leave(waiters, i, &mut self.rng);
            }
        }
        let words: Vec<Vec<&str>> = calls
            .iter()
            .map(|(w, _)| w.iter().map(String::as_str).collect())
            .collect();
        if tracing() {
            eprintln!(
                "schedule {} batch: {words:?}, leaving {leaving:?}",
                self.schedule
            );
        }
        let replies: Vec<Resp> = match wrap {
            Wrap::Plain => {
                let all: Vec<&[&str]> = words.iter().map(Vec::as_slice).collect();
                admin.send(&all);
                (0..all.len()).map(|_| self.admin_reply(admin)).collect()
            }
            Wrap::Multi => {
                let mut all: Vec<&[&str]> = vec![&["MULTI"]];
                all.extend(words.iter().map(Vec::as_slice));
                all.push(&["EXEC"]);
                admin.send(&all);
                for _ in 0..=words.len() {
                    self.admin_reply(admin);
                }
                match self.admin_reply(admin) {
                    Resp::Array(items) => items,
                    other => vec![other; words.len()],
                }
            }
            Wrap::Eval => {
                // Each call through redis.pcall, the replies returned as one array.
                let mut script = String::from("local r = {}\n");
                let mut argv: Vec<&str> = Vec::new();
                for (i, call) in words.iter().enumerate() {
                    let args: Vec<String> = call
                        .iter()
                        .map(|w| {
                            argv.push(w);
                            format!("ARGV[{}]", argv.len())
                        })
                        .collect();
                    script.push_str(&format!(
                        "r[{}] = redis.pcall({})\n",
                        i + 1,
                        args.join(", ")
                    ));
                }
                script.push_str("return r\n");
                let mut all: Vec<&str> = vec!["EVAL", &script, "0"];
                all.extend(argv.iter());
                admin.send(&[&all]);
                match self.admin_reply(admin) {
                    Resp::Array(items) => items,
                    other => vec![other; words.len()],
                }
            }
        };
        for &(i, before) in &leaving {
            if !before {
                leave(waiters, i, &mut self.rng);
            }
        }
        for ((_, effect), reply) in calls.iter().zip(replies) {
            effect.apply(&reply, keys, waiters, ledger);
        }
    }

    fn admin_reply(&self, admin: &mut RawCon) -> Resp {
        match admin.reply(self.slow(Duration::from_secs(10))) {
            Ok(reply) => reply,
            Err(e) => self.fail(&format!("the admin's reply: {e:?}")),
        }
    }

    /// A waiter's wake-up and its end, in one batch: a slot freed (or tokens refunded,
    /// its time moved to now) and its client killed or unblocked.
    fn race(&mut self, keys: &Keys, waiters: &[Waiter]) -> Vec<(Vec<String>, Effect)> {
        let w = |words: &[&str]| words.iter().map(|s| s.to_string()).collect::<Vec<String>>();
        let waiter = waiters.choose(&mut self.rng).unwrap();
        let all = COUNT.to_string();
        let wake = match waiter.family {
            Family::Lease => {
                let id = ["h1", "h2"].choose(&mut self.rng).unwrap().to_string();
                (w(&["QAG.RELEASE", &keys.lease, &id]), Effect::Release(id))
            }
            Family::WildLease => (w(&["QAG.RELEASE", &keys.wild_lease, "hy"]), Effect::None),
            Family::Pair => (
                w(&["QAG.REFUND", &keys.key, &all, PERIOD, "30"]),
                Effect::Refund(keys.key.clone(), 30.0),
            ),
            _ => (
                w(&["QAG.REFUND", &keys.bucket, &all, PERIOD, "30"]),
                Effect::Refund(keys.bucket.clone(), 30.0),
            ),
        };
        let id = waiter.client_id.clone();
        let end = match self.rng.gen_range(0..3) {
            0 => (w(&["CLIENT", "KILL", "ID", &id]), Effect::Killed(id)),
            1 => (w(&["CLIENT", "UNBLOCK", &id]), Effect::Unblocked(id)),
            _ => (w(&["CLIENT", "UNBLOCK", &id, "ERROR"]), Effect::None),
        };
        match self.rng.gen_bool(0.7) {
            true => vec![wake, end],
            false => vec![end, wake],
        }
    }

    /// One call of a batch. `admin_calls`: CLIENT and the server's own commands may be
    /// sent (not in a script).
    fn action(
        &mut self,
        keys: &Keys,
        waiters: &[Waiter],
        wild: bool,
        admin_calls: bool,
        pause_until: &mut Instant,
    ) -> (Vec<String>, Effect) {
        let w = |words: &[&str]| words.iter().map(|s| s.to_string()).collect::<Vec<String>>();
        let all = COUNT.to_string();
        let waiter = waiters.choose(&mut self.rng).unwrap();
        loop {
            let choice = self.rng.gen_range(0..20);
            let call = match choice {
                0..=2 => {
                    let id = match self.rng.gen_range(0..3) {
                        0 => "h1".to_string(),
                        1 => "h2".to_string(),
                        _ => waiter.lease.clone().unwrap_or_else(|| "h1".into()),
                    };
                    (w(&["QAG.RELEASE", &keys.lease, &id]), Effect::Release(id))
                }
                3 => {
                    let n = self.rng.gen_range(1..=3).to_string();
                    let bucket = [&keys.bucket, &keys.client, &keys.key]
                        .choose(&mut self.rng)
                        .unwrap()
                        .to_string();
                    let effect = Effect::Refund(bucket.clone(), n.parse().unwrap());
                    (w(&["QAG.REFUND", &bucket, &all, PERIOD, &n]), effect)
                }
                4 => (
                    w(&["QAG.TAKE", &keys.bucket, &all, PERIOD]),
                    Effect::Take(keys.bucket.clone(), 1.0),
                ),
                5 => {
                    let id = format!("p{}", self.rng.gen_range(0..1000));
                    (
                        w(&["QAG.LEASE", &keys.lease, "2", "60000", &id]),
                        Effect::Lease(id),
                    )
                }
                6 => (
                    w(&[
                        "QAG.TAKE2",
                        &keys.client,
                        &all,
                        PERIOD,
                        &keys.key,
                        &all,
                        PERIOD,
                    ]),
                    Effect::Pair,
                ),
                7 => (w(&["QAG.RELEASE", &keys.wild_lease, "hy"]), Effect::None),
                8 => (
                    w(&["QAG.REFUND", &keys.wild_bucket, "2", "1", "1"]),
                    Effect::None,
                ),
                9 if admin_calls => (
                    w(&["CLIENT", "KILL", "ID", &waiter.client_id]),
                    Effect::Killed(waiter.client_id.clone()),
                ),
                10 if admin_calls => (
                    w(&["CLIENT", "KILL", "ADDR", &waiter.addr]),
                    Effect::Killed(waiter.client_id.clone()),
                ),
                11 if admin_calls && self.rng.gen_bool(0.2) => {
                    (w(&["CLIENT", "KILL", "TYPE", "normal"]), Effect::KilledAll)
                }
                12 if admin_calls => (
                    w(&["CLIENT", "UNBLOCK", &waiter.client_id]),
                    Effect::Unblocked(waiter.client_id.clone()),
                ),
                13 if admin_calls => (
                    w(&["CLIENT", "UNBLOCK", &waiter.client_id, "ERROR"]),
                    Effect::None,
                ),
                14 if admin_calls && self.rng.gen_bool(0.3) => {
                    let ms = self.rng.gen_range(20..250);
                    *pause_until = (*pause_until).max(Instant::now() + Duration::from_millis(ms));
                    (
                        w(&["CLIENT", "PAUSE", &ms.to_string(), "WRITE"]),
                        Effect::None,
                    )
                }
                15 if wild => {
                    let key = [&keys.wild_bucket, &keys.wild_lease]
                        .choose(&mut self.rng)
                        .copied()
                        .unwrap();
                    let call = match self.rng.gen_range(0..5) {
                        0 => w(&["DEL", key]),
                        1 => w(&["UNLINK", key]),
                        2 => w(&["SET", key, "s"]),
                        3 => w(&["RENAME", key, &format!("{key}:moved")]),
                        _ => w(&["PEXPIRE", key, &self.rng.gen_range(0..50).to_string()]),
                    };
                    (call, Effect::None)
                }
                16 if wild && self.rng.gen_bool(0.4) => {
                    let call = match self.rng.gen_range(0..5) {
                        0 => w(&["FLUSHDB"]),
                        1 => w(&["FLUSHDB", "ASYNC"]),
                        2 => w(&["FLUSHALL"]),
                        3 => w(&["FLUSHALL", "ASYNC"]),
                        _ => w(&["SWAPDB", "0", "1"]),
                    };
                    (call, Effect::None)
                }
                17 if wild && admin_calls && self.rng.gen_bool(0.15) => {
                    (w(&["DEBUG", "RELOAD"]), Effect::None)
                }
                18 if wild => {
                    let db = ["0", "1"].choose(&mut self.rng).unwrap();
                    (w(&["SELECT", db]), Effect::None)
                }
                19 => (
                    w(&["QAG.THROTTLE", &keys.throttle, "1", "5", "1"]),
                    Effect::None,
                ),
                _ => continue,
            };
            return call;
        }
    }

    /// A primary turned replica, its replica promoted, at the same offset.
    fn demote(&mut self, waiters: &mut [Waiter]) {
        let replica = self.replica.take().unwrap();
        let mut p = self.admin();
        let mut r = RawCon::connect(replica.port);
        let offset = p.info("replication", "master_repl_offset").unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while r.info("replication", "master_repl_offset") != Some(offset) {
            if Instant::now() > deadline {
                self.fail("the replica never caught up");
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        r.call(&["REPLICAOF", "NO", "ONE"]);
        p.call(&["REPLICAOF", "127.0.0.1", &replica.port.to_string()]);
        for waiter in waiters.iter_mut() {
            if waiter.end == End::Open {
                waiter.end = End::Killed;
            }
        }
        let old = std::mem::replace(&mut self.primary, replica);
        self.replica = Some(old);
        self.until_linked();
    }

    /// Waits for every answer and for the module to hold no one.
    fn settle(&mut self, admin: &mut RawCon, waiters: &mut [Waiter], pause_until: Instant) {
        let deadline = Instant::now()
            + self
                .slow(Duration::from_secs(4))
                .min(Duration::from_secs(20));
        // One that may get no reply (CLIENT UNBLOCK on 7.0) is read last: it waits out
        // the time left.
        let mut order: Vec<&mut Waiter> = waiters.iter_mut().collect();
        order.sort_by_key(|waiter| waiter.unblocked_timeout);
        for waiter in order {
            let Some(con) = waiter.con.as_mut() else {
                continue;
            };
            let left = deadline.saturating_duration_since(Instant::now());
            match con.reply(left) {
                Ok(reply) => waiter.answer = Some(reply),
                Err(NoReply::Closed) => {
                    if waiter.end == End::Open {
                        waiter.end = End::Killed;
                    }
                    continue;
                }
                Err(NoReply::Late) => continue,
            }
            while con.reply(Duration::from_millis(20)).is_ok() {
                waiter.extra += 1;
            }
        }
        let deadline = Instant::now() + self.slow(Duration::from_secs(5));
        loop {
            let waiters_now = admin.info("qag", "qag_waiters");
            let blocked = admin.info("clients", "blocked_clients");
            if waiters_now == Some(0) && blocked == Some(0) {
                break;
            }
            if Instant::now() > deadline {
                self.fail(&format!(
                    "still waiting: qag_waiters {waiters_now:?}, blocked_clients {blocked:?}"
                ));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        // Give-backs come a moment later, or once a pause of writes ends.
        std::thread::sleep(pause_until.saturating_duration_since(Instant::now()));
        std::thread::sleep(self.slow(Duration::from_millis(60)));
        if !self.primary.alive() {
            self.fail("the primary died");
        }
        for waiter in waiters.iter() {
            if waiter
                .answer
                .as_ref()
                .is_some_and(|a| a.ints().first() == Some(&1))
            {
                self.stats.served += 1;
            }
            if waiter.end != End::Open {
                self.stats.gone += 1;
            }
        }
    }

    fn check_replies(&self, waiters: &[Waiter]) {
        for (n, waiter) in waiters.iter().enumerate() {
            if waiter.extra > 0 {
                self.fail(&format!(
                    "waiter {n} ({:?}) got {} replies more",
                    waiter.words, waiter.extra
                ));
            }
            let excused = waiter.unblocked_timeout && self.redis_70;
            if waiter.end == End::Open && waiter.answer.is_none() && !excused {
                self.fail(&format!(
                    "waiter {n} ({:?}) never got a reply",
                    waiter.words
                ));
            }
            if let Some(answer) = &waiter.answer {
                let fine = match answer {
                    Resp::Err(text) => text.starts_with("UNBLOCKED"),
                    Resp::Array(items) => !items.is_empty(),
                    _ => false,
                };
                if !fine {
                    self.fail(&format!(
                        "waiter {n} ({:?}) was answered {answer:?}",
                        waiter.words
                    ));
                }
            }
        }
    }

    /// The checked keys against the answers: every charge stands or was given back.
    fn check_ledger(&self, admin: &mut RawCon, keys: &Keys, waiters: &[Waiter], ledger: &Ledger) {
        admin.call(&["SELECT", "0"]);
        // Per request (a waiter without an id is a request of its own): the answer read
        // that allows most (a replay is answered what its first call was, but CLIENT
        // UNBLOCK refuses one call while another is served), or whether one may have
        // been sent and lost to a reset.
        let mut requests: BTreeMap<String, (Option<&Resp>, bool, &Waiter)> = BTreeMap::new();
        for (n, waiter) in waiters.iter().enumerate() {
            if !matches!(waiter.family, Family::Take | Family::Pair | Family::Lease) {
                continue;
            }
            let name = waiter.request.clone().unwrap_or_else(|| format!("#{n}"));
            let entry = requests
                .entry(format!("{:?}:{name}", waiter.family))
                .or_insert((None, false, waiter));
            let answer = waiter.answer.as_ref().filter(|a| !a.is_err());
            let rank =
                |a: Option<&Resp>| a.map_or(0, |a| 1 + pair_rows(a).iter().filter(|&&r| r).count());
            if rank(answer) > rank(entry.0) {
                entry.0 = answer;
            }
            // An answer lost: to a reset, or to a kill or a close that may have come in a
            // later turn than the wake-up it raced (a batch behind CLIENT PAUSE runs in
            // several: seed 1796488893653, schedule 29, served then killed; seed
            // 1796500981746, schedule 3 on Redis 7.0, a pair served then half closed, its
            // reply never sent), when it was written: the server frees a client whose
            // end it reads before it has sent what the client was answered.
            entry.1 |= waiter.end != End::Open && waiter.answer.is_none();
        }
        // What each request charged: certain (an answer read), or one of some choices
        // (an answer lost to a reset: sent, or not).
        let mut charged: BTreeMap<String, f64> = BTreeMap::new();
        let mut choices: Vec<Vec<Vec<(String, f64)>>> = Vec::new();
        let mut acquired = ledger.acquired.clone();
        let mut maybe: BTreeSet<String> = ledger.short.clone();
        for (answer, unread, waiter) in requests.values() {
            let cost = waiter.cost as f64;
            let (client, key) = (keys.client.clone(), keys.key.clone());
            // An answer read that allows less than all (a refusal, CLIENT UNBLOCK's) says
            // nothing of a replay of the same request whose answer a reset lost: it may
            // have been served (found by this fuzzer's seed 1796486659012, schedule 32:
            // the first call unblocked, its replay served, then reset unread).
            match (waiter.family, answer) {
                (Family::Take, Some(answer)) if answer.ints().first() == Some(&1) => {
                    *charged.entry(keys.bucket.clone()).or_default() += cost;
                }
                (Family::Take, _) if *unread => {
                    choices.push(vec![vec![], vec![(keys.bucket.clone(), cost)]]);
                }
                (Family::Pair, Some(answer)) => {
                    let rows = pair_rows(answer);
                    for (bucket, &row) in [client.clone(), key.clone()].into_iter().zip(&rows) {
                        if row {
                            *charged.entry(bucket).or_default() += cost;
                        }
                    }
                    // Served further by an unread replay: the key's bucket after the
                    // client's, as QAG.TAKE2 takes them.
                    match (*unread, rows.as_slice()) {
                        (true, [false, ..]) => choices.push(vec![
                            vec![],
                            vec![(client.clone(), cost)],
                            vec![(client, cost), (key, cost)],
                        ]),
                        (true, [true, false]) => choices.push(vec![vec![], vec![(key, cost)]]),
                        _ => {}
                    }
                }
                (Family::Pair, None) if *unread => choices.push(vec![
                    vec![],
                    vec![(client.clone(), cost)],
                    vec![(client, cost), (key, cost)],
                ]),
                (Family::Lease, Some(answer)) if answer.ints().first() == Some(&1) => {
                    acquired.insert(waiter.lease.clone().unwrap());
                }
                (Family::Lease, _) if *unread => {
                    maybe.insert(waiter.lease.clone().unwrap());
                }
                _ => {}
            }
        }
        let mut stored: BTreeMap<String, (f64, f64)> = BTreeMap::new();
        for bucket in [&keys.bucket, &keys.client, &keys.key] {
            let Resp::Array(values) = admin.call(&["HMGET", bucket, "tokens", "ts"]) else {
                self.fail("HMGET");
            };
            let tokens: f64 = values[0].text().parse().unwrap_or(f64::NAN);
            let ts: f64 = values[1].text().parse().unwrap_or(f64::NAN);
            stored.insert(bucket.clone(), (tokens, ts));
        }
        let expected = |bucket: &String, extra: &BTreeMap<String, f64>| {
            let (tokens0, ts0) = ledger.drained[bucket];
            let ts = stored[bucket].1;
            tokens0 + RATE * (ts - ts0)
                - charged.get(bucket).copied().unwrap_or(0.0)
                - extra.get(bucket).copied().unwrap_or(0.0)
                + ledger.taken.get(bucket).copied().unwrap_or(0.0)
        };
        // Some choice of each lost answer's fate fits every bucket.
        let combinations: usize = choices.iter().map(Vec::len).product();
        let fits = (0..combinations).any(|mut pick| {
            let mut extra: BTreeMap<String, f64> = BTreeMap::new();
            for options in &choices {
                for (bucket, cost) in &options[pick % options.len()] {
                    *extra.entry(bucket.clone()).or_default() += cost;
                }
                pick /= options.len();
            }
            stored
                .iter()
                .all(|(bucket, (tokens, _))| (tokens - expected(bucket, &extra)).abs() < 1e-6)
        });
        if !fits {
            let none = BTreeMap::new();
            let said: Vec<_> = stored.keys().map(|b| (b, expected(b, &none))).collect();
            self.fail(&format!(
                "the buckets hold {stored:?}; the answers say {said:?} (less any of {choices:?}); the admin's net {:?}; waiters {:#?}",
                ledger.taken,
                waiters.iter().map(|w| (&w.words, w.end, &w.answer)).collect::<Vec<_>>()
            ));
        }
        // The lease key's live members: acquired and not released (and those whose fate
        // is unsure, or that run out about now, either way).
        let now = unix_ms() as f64;
        let members = match admin.call(&["ZRANGE", &keys.lease, "0", "-1", "WITHSCORES"]) {
            Resp::Array(items) => items,
            other => self.fail(&format!("ZRANGE: {other:?}")),
        };
        let live: BTreeSet<String> = members
            .chunks(2)
            .filter(|pair| pair[1].text().parse::<f64>().unwrap_or(0.0) > now)
            .map(|pair| pair[0].text())
            .collect();
        let expected: BTreeSet<String> = acquired.difference(&ledger.released).cloned().collect();
        let certain: BTreeSet<String> = live.difference(&maybe).cloned().collect();
        let wanted: BTreeSet<String> = expected.difference(&maybe).cloned().collect();
        if certain != wanted {
            self.fail(&format!(
                "{} holds leases {live:?}; the answers say {expected:?} (any of {maybe:?} may be there): waiters {:#?}",
                keys.lease,
                waiters.iter().map(|w| (&w.words, w.end, &w.answer)).collect::<Vec<_>>()
            ));
        }
    }

    /// The replica equals the primary, once it has the primary's offset.
    fn check_replica(&self) {
        let Some(replica) = &self.replica else {
            return;
        };
        let mut p = self.admin();
        let mut r = RawCon::connect(replica.port);
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let offset = p.info("replication", "master_repl_offset");
            if r.info("replication", "master_repl_offset") == offset {
                break;
            }
            if Instant::now() > deadline {
                self.fail("the replica never reached the primary's offset");
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        for db in ["0", "1"] {
            let (a, b) = (lasting(&mut p, db), lasting(&mut r, db));
            if a != b {
                self.fail(&format!(
                    "db {db}: the replica differs:\nprimary {a:?}\nreplica {b:?}"
                ));
            }
        }
    }

    /// The primary's AOF, loaded by a server without the module, holds its data.
    fn check_aof(&self) {
        let mut p = self.admin();
        let source = self.primary.dir().join("appendonlydir");
        if !source.exists() {
            return;
        }
        let dir = std::env::temp_dir().join(format!(
            "qag-fuzz-aof-{}-{}",
            std::process::id(),
            self.schedule
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("appendonlydir")).unwrap();
        let expected: Vec<_> = ["0", "1"].iter().map(|db| lasting(&mut p, db)).collect();
        for entry in std::fs::read_dir(&source).unwrap() {
            let entry = entry.unwrap();
            std::fs::copy(
                entry.path(),
                dir.join("appendonlydir").join(entry.file_name()),
            )
            .unwrap();
        }
        let loaded = Server::start(&ServerOptions {
            without_module: true,
            dir: Some(dir.clone()),
            extra: ["--appendonly", "yes"].map(String::from).to_vec(),
            ..Default::default()
        });
        let mut l = RawCon::connect(loaded.port);
        for (db, expected) in ["0", "1"].iter().zip(expected) {
            let got = lasting(&mut l, db);
            if got != expected {
                self.fail(&format!("db {db}: the AOF replays to other data:\nprimary {expected:?}\nreplayed {got:?}"));
            }
        }
        drop(loaded);
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// A database's keys that outlive a comparison (no expiry within 3 s), each with its
/// content and absolute expiry.
fn lasting(con: &mut RawCon, db: &str) -> Vec<(String, String, String)> {
    con.call(&["SELECT", db]);
    let Resp::Array(keys) = con.call(&["KEYS", "*"]) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for key in keys.iter().map(Resp::text) {
        let ttl = con
            .call(&["PTTL", &key])
            .ints()
            .first()
            .copied()
            .unwrap_or(-2);
        if ttl == -2 || (0..3000).contains(&ttl) {
            continue;
        }
        let content = match con.call(&["TYPE", &key]).text().as_str() {
            "hash" => {
                let Resp::Array(items) = con.call(&["HGETALL", &key]) else {
                    continue;
                };
                let mut fields: Vec<String> = items
                    .chunks(2)
                    .map(|f| format!("{}={}", f[0].text(), f[1].text()))
                    .collect();
                fields.sort();
                fields.join(" ")
            }
            "zset" => format!("{:?}", con.call(&["ZRANGE", &key, "0", "-1", "WITHSCORES"])),
            "string" => con.call(&["GET", &key]).text(),
            other => other.to_string(),
        };
        let expiry = format!("{:?}", con.call(&["PEXPIRETIME", &key]));
        out.push((key, content, expiry));
    }
    out.sort();
    con.call(&["SELECT", "0"]);
    out
}

/// Whether an answer allows: a row starting 1, or a pair whose rows both do.
fn allowed(answer: &Resp) -> bool {
    match answer {
        Resp::Array(items) => match items.first() {
            Some(Resp::Int(n)) => *n == 1,
            Some(Resp::Array(_)) => pair_rows(answer).iter().all(|&a| a) && items.len() == 2,
            _ => false,
        },
        _ => false,
    }
}

/// A pair's rows, each allowed or not (a null row: not).
fn pair_rows(answer: &Resp) -> Vec<bool> {
    match answer {
        Resp::Array(items) if matches!(items.first(), Some(Resp::Array(_))) => items
            .iter()
            .map(|row| row.ints().first() == Some(&1))
            .collect(),
        other => vec![allowed(other)],
    }
}

/// What a call's reply tells the ledger.
#[derive(Clone)]
enum Effect {
    None,
    /// A RELEASE of this lease id on the checked key.
    Release(String),
    /// A REFUND of n tokens to this bucket.
    Refund(String, f64),
    /// A plain TAKE of n tokens from this bucket.
    Take(String, f64),
    /// A plain TAKE2 on the checked pair.
    Pair,
    /// A plain LEASE of this id on the checked key.
    Lease(String),
    Killed(String),
    KilledAll,
    Unblocked(String),
}

impl Effect {
    fn apply(&self, reply: &Resp, keys: &Keys, waiters: &mut [Waiter], ledger: &mut Ledger) {
        match self {
            Effect::None => {}
            Effect::Release(id) => {
                if reply == &Resp::Int(1) {
                    ledger.released.insert(id.clone());
                }
            }
            Effect::Refund(bucket, n) => {
                if matches!(reply, Resp::Int(_)) {
                    *ledger.taken.entry(bucket.clone()).or_default() += n;
                }
            }
            Effect::Take(bucket, n) => {
                if reply.ints().first() == Some(&1) {
                    *ledger.taken.entry(bucket.clone()).or_default() -= n;
                }
            }
            Effect::Pair => {
                let rows = pair_rows(reply);
                for (bucket, row) in [&keys.client, &keys.key].into_iter().zip(rows) {
                    if row {
                        *ledger.taken.entry(bucket.clone()).or_default() -= 1.0;
                    }
                }
            }
            Effect::Lease(id) => {
                if reply.ints().first() == Some(&1) {
                    ledger.acquired.insert(id.clone());
                }
            }
            Effect::Killed(id) => {
                if reply == &Resp::Int(1) || reply == &Resp::Str(b"OK".to_vec()) {
                    for waiter in waiters.iter_mut().filter(|w| &w.client_id == id) {
                        if waiter.end == End::Open {
                            waiter.end = End::Killed;
                        }
                    }
                }
            }
            Effect::KilledAll => {
                for waiter in waiters.iter_mut() {
                    if waiter.end == End::Open {
                        waiter.end = End::Killed;
                    }
                }
            }
            Effect::Unblocked(id) => {
                for waiter in waiters.iter_mut().filter(|w| &w.client_id == id) {
                    waiter.unblocked_timeout = true;
                }
            }
        }
    }
}

/// Whether to print each schedule's waiters and batches (`QAG_FUZZ_TRACE`), to read
/// one a seed replays.
fn tracing() -> bool {
    std::env::var_os("QAG_FUZZ_TRACE").is_some()
}

fn seconds(variable: &str, default: u64) -> u64 {
    std::env::var(variable)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

#[test]
fn random_schedules_of_waiters_and_their_ends_keep_every_promise() {
    if external("random_schedules_of_waiters_and_their_ends_keep_every_promise") {
        return;
    }
    let mut fuzz = Fuzz::new(None);
    fuzz.run(seconds("QAG_FUZZ_SECONDS", 45));
}

#[test]
fn random_schedules_under_memcheck_find_nothing_in_the_module() {
    if external("random_schedules_under_memcheck_find_nothing_in_the_module") {
        return;
    }
    if !memcheck_sees_the_servers_allocations() {
        return;
    }
    let log = std::env::temp_dir().join(format!("qag-fuzz-memcheck-{}.log", std::process::id()));
    let mut fuzz = Fuzz::new(Some(&log));
    fuzz.run(seconds("QAG_FUZZ_VALGRIND_SECONDS", 30));
    let Fuzz { primary, .. } = fuzz;
    primary.shutdown();
    let found = memcheck_findings(&log, true);
    assert!(
        found.is_empty(),
        "memcheck found problems in the module:\n{found:#?}"
    );
}
