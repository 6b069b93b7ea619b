//! Token buckets through the crate, on real servers with and without the module: the
//! module and the script answer alike call by call, share one budget, and `Auto`
//! follows a server restarted without and with the module.

#[path = "../../../tests/common/mod.rs"]
mod common;

use std::time::Duration;

use common::*;
use qag_client::{AnsweredBy, Backend, Bucket, Error, Limiter, Options, RetryAfter, Side};
use redis::aio::ConnectionManager;

async fn manager(server: &Server) -> ConnectionManager {
    server
        .client()
        .get_connection_manager()
        .await
        .expect("connect a ConnectionManager")
}

fn options(backend: Backend) -> Options {
    Options {
        backend,
        ..Options::default()
    }
}

/// The bucket's own field names and whether the key expires: its form, whatever the
/// clock. The ids the module remembers for replays (`id:...`) are left out.
fn form(con: &mut Connection, key: &str) -> (Vec<String>, bool) {
    let mut fields: Vec<String> = cmd("HKEYS").arg(key).query(con).unwrap();
    fields.retain(|field| !field.starts_with("id:"));
    fields.sort();
    let ttl: i64 = cmd("PTTL").arg(key).query(con).unwrap();
    (fields, ttl > 0)
}

/// A bucket that refills too slowly to move within a test: replies depend on the
/// calls alone.
const COUNT: u64 = 5;
const PERIOD: f64 = 36000.0;
const COSTS: [u64; 8] = [1, 2, 1, 3, 1, 9, 1, 1];

#[tokio::test(flavor = "multi_thread")]
async fn module_and_script_answer_as_the_raw_command_and_the_script() {
    if external("module_and_script_answer_as_the_raw_command_and_the_script") {
        return;
    }
    let server = Server::start(&ServerOptions::default());
    let mut raw = server.client().get_connection().unwrap();
    let sha = load_script(&mut raw);
    let module = Limiter::with_options(manager(&server).await, options(Backend::Module));
    let script = Limiter::with_options(manager(&server).await, options(Backend::Script));
    let auto = Limiter::new(manager(&server).await);
    for (n, cost) in COSTS.into_iter().enumerate() {
        let by_module = module
            .take(&Bucket::with_key("qag:m", COUNT, PERIOD), cost)
            .await
            .unwrap();
        let by_auto = auto
            .take(&Bucket::with_key("qag:a", COUNT, PERIOD), cost)
            .await
            .unwrap();
        let by_script = script
            .take(&Bucket::with_key("qag:s", COUNT, PERIOD), cost)
            .await
            .unwrap();
        let raw_module: Vec<i64> = cmd("QAG.TAKE")
            .arg("qag:rm")
            .arg(COUNT)
            .arg(PERIOD)
            .arg("COST")
            .arg(cost)
            .query(&mut raw)
            .unwrap();
        let raw_script: Vec<i64> = cmd("EVALSHA")
            .arg(&sha)
            .arg(1)
            .arg("qag:rs")
            .arg(COUNT)
            .arg(PERIOD)
            .arg(cost)
            .query(&mut raw)
            .unwrap();
        assert_eq!(raw_module, raw_script, "call {n}");
        for decision in [by_module, by_auto, by_script] {
            let reply = vec![
                i64::from(decision.allowed),
                decision.remaining as i64,
                decision
                    .retry_after
                    .seconds()
                    .map_or(-1, |seconds| seconds as i64),
            ];
            assert_eq!(reply, raw_module, "call {n} by {}", decision.answered_by);
            assert_eq!((decision.limit, decision.period), (COUNT, PERIOD));
        }
        assert_eq!(by_module.answered_by, AnsweredBy::Module);
        assert_eq!(by_auto.answered_by, AnsweredBy::Module);
        assert_eq!(by_script.answered_by, AnsweredBy::Script);
    }
    let expected = (vec!["tokens".to_string(), "ts".to_string()], true);
    for key in ["qag:m", "qag:a", "qag:s", "qag:rm", "qag:rs"] {
        assert_eq!(form(&mut raw, key), expected, "{key}");
    }
    // PEEK: the module's and the fallback's (the hash computed with qag-core) agree.
    let peeked = module
        .peek(&Bucket::with_key("qag:m", COUNT, PERIOD), 1)
        .await
        .unwrap();
    let fallback = script
        .peek(&Bucket::with_key("qag:m", COUNT, PERIOD), 1)
        .await
        .unwrap();
    assert_eq!(
        (peeked.allowed, peeked.remaining, peeked.retry_after),
        (fallback.allowed, fallback.remaining, fallback.retry_after)
    );
    assert_eq!(fallback.answered_by, AnsweredBy::Script);
    let never = script
        .peek(&Bucket::with_key("qag:absent", COUNT, PERIOD), 6)
        .await
        .unwrap();
    assert_eq!(
        (never.allowed, never.remaining, never.retry_after),
        (false, 5, RetryAfter::Never)
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn without_the_module_auto_runs_the_script_and_module_is_an_error() {
    if external("without_the_module_auto_runs_the_script_and_module_is_an_error") {
        return;
    }
    let server = Server::start(&ServerOptions {
        without_module: true,
        ..Default::default()
    });
    let auto = Limiter::new(manager(&server).await);
    let module = Limiter::with_options(manager(&server).await, options(Backend::Module));
    for left in (0..COUNT).rev() {
        let decision = auto
            .take(&Bucket::with_key("qag:k", COUNT, PERIOD), 1)
            .await
            .unwrap();
        assert_eq!(decision.answered_by, AnsweredBy::Script);
        assert_eq!((decision.allowed, decision.remaining), (true, left));
    }
    assert!(
        !auto
            .take(&Bucket::with_key("qag:k", COUNT, PERIOD), 1)
            .await
            .unwrap()
            .allowed
    );
    assert_eq!(
        module
            .take(&Bucket::with_key("qag:k", COUNT, PERIOD), 1)
            .await,
        Err(Error::ModuleRequired)
    );
    // Every family: the scripts where the module is missing, ModuleRequired for Module.
    let quota = qag_client::Quota {
        per: qag_client::Per::Day,
        zone: "UTC".into(),
        calls: Some(10),
        rows: None,
    };
    let added = auto.quota_add("qag:q", &quota, 1, 0).await.unwrap();
    assert_eq!((added.calls, added.answered_by), (1, AnsweredBy::Script));
    assert_eq!(
        module.quota_add("qag:q", &quota, 1, 0).await,
        Err(Error::ModuleRequired)
    );
    // Bad arguments are refused before anything is sent, with the module's words.
    let bad = auto.take(&Bucket::with_key("qag:k", 0, PERIOD), 1).await;
    assert_eq!(
        bad,
        Err(Error::InvalidArgument(
            "count must be an integer from 1 to 9007199254740992".into()
        ))
    );
    assert!(matches!(
        auto.take(&Bucket::with_key("qag:k", 5, f64::NAN), 1).await,
        Err(Error::InvalidArgument(_))
    ));
}

#[tokio::test(flavor = "multi_thread")]
async fn pairs_by_module_and_by_script_agree_and_leave_a_refused_key_alone() {
    if external("pairs_by_module_and_by_script_agree_and_leave_a_refused_key_alone") {
        return;
    }
    let server = Server::start(&ServerOptions::default());
    let mut raw = server.client().get_connection().unwrap();
    let module = Limiter::with_options(manager(&server).await, options(Backend::Module));
    let script = Limiter::with_options(manager(&server).await, options(Backend::Script));
    // Client bucket of 3, key bucket of 5 for the module, 5 for the script.
    for n in 0..6 {
        let by_module = module
            .take_pair(
                &Bucket::with_key("qag:mc", 3, PERIOD),
                &Bucket::with_key("qag:mk", 5, PERIOD),
                1,
            )
            .await
            .unwrap();
        let by_script = script
            .take_pair(
                &Bucket::with_key("qag:sc", 3, PERIOD),
                &Bucket::with_key("qag:sk", 5, PERIOD),
                1,
            )
            .await
            .unwrap();
        let shape = |pair: qag_client::PairDecision| {
            (
                pair.allowed(),
                pair.refused_by(),
                pair.client.remaining,
                pair.key.map(|k| k.remaining),
                pair.retry_after(),
            )
        };
        assert_eq!(shape(by_module), shape(by_script), "call {n}");
        assert_eq!(by_module.answered_by(), AnsweredBy::Module);
        assert_eq!(by_script.answered_by(), AnsweredBy::Script);
        if n >= 3 {
            assert_eq!(by_module.refused_by(), Some(Side::Client));
            assert!(by_module.key.is_none());
        }
    }
    // The key buckets were counted only for the three allowed requests.
    for key in ["qag:mk", "qag:sk"] {
        let tokens: f64 = cmd("HGET").arg(key).arg("tokens").query(&mut raw).unwrap();
        assert!((2.0..2.01).contains(&tokens), "{key}: {tokens}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn one_bucket_through_module_and_script_refuses_where_the_module_alone_does() {
    if external("one_bucket_through_module_and_script_refuses_where_the_module_alone_does") {
        return;
    }
    let server = Server::start(&ServerOptions::default());
    let module = Limiter::with_options(manager(&server).await, options(Backend::Module));
    let script = Limiter::with_options(manager(&server).await, options(Backend::Script));
    let mut mixed = Vec::new();
    let mut alone = Vec::new();
    for n in 0..8 {
        let through = if n % 2 == 0 { &module } else { &script };
        mixed.push(
            through
                .take(&Bucket::with_key("qag:shared", COUNT, PERIOD), 1)
                .await
                .unwrap(),
        );
        alone.push(
            module
                .take(&Bucket::with_key("qag:alone", COUNT, PERIOD), 1)
                .await
                .unwrap(),
        );
    }
    let verdicts = |decisions: &[qag_client::Decision]| -> Vec<(bool, u64)> {
        decisions.iter().map(|d| (d.allowed, d.remaining)).collect()
    };
    assert_eq!(verdicts(&mixed), verdicts(&alone));
    assert_eq!(mixed.iter().position(|d| !d.allowed), Some(COUNT as usize));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_user_with_only_the_module_commands() {
    if external("a_user_with_only_the_module_commands") {
        return;
    }
    for without_module in [false, true] {
        let server = Server::start(&ServerOptions {
            without_module,
            ..Default::default()
        });
        let mut admin = server.client().get_connection().unwrap();
        let acl: Result<String, _> = cmd("ACL")
            .arg(&["SETUSER", "gateway", "on", ">secret", "~qag:*"])
            .arg(&["+qag.take", "+qag.take2"])
            .query(&mut admin);
        if without_module {
            // The server does not know the commands: the user gets none.
            assert!(acl.is_err(), "{acl:?}");
            let _: String = cmd("ACL")
                .arg(&["SETUSER", "gateway", "on", ">secret", "~qag:*"])
                .query(&mut admin)
                .unwrap();
        } else {
            acl.unwrap();
        }
        let url = format!("redis://gateway:secret@127.0.0.1:{}/", server.port);
        let con = redis::Client::open(url)
            .unwrap()
            .get_connection_manager()
            .await
            .unwrap();
        let auto = Limiter::new(con.clone());
        let script = Limiter::with_options(con, options(Backend::Script));
        if without_module {
            // COMMAND is not granted either: the module command is tried, is unknown,
            // and the script is refused: a permission error, not a missing module.
            let answer = auto
                .take(&Bucket::with_key("qag:k", COUNT, PERIOD), 1)
                .await;
            assert!(matches!(answer, Err(Error::Permission(_))), "{answer:?}");
        } else {
            let decision = auto
                .take(&Bucket::with_key("qag:k", COUNT, PERIOD), 1)
                .await
                .unwrap();
            assert_eq!(decision.answered_by, AnsweredBy::Module);
            let pair = auto
                .take_pair(
                    &Bucket::with_key("qag:{t}c", 3, 1.0),
                    &Bucket::with_key("qag:{t}k", 5, 60.0),
                    1,
                )
                .await
                .unwrap();
            assert!(pair.allowed());
        }
        let answer = script
            .take(&Bucket::with_key("qag:k", COUNT, PERIOD), 1)
            .await;
        assert!(matches!(answer, Err(Error::Permission(_))), "{answer:?}");
    }
}

/// A directory removed when the test ends, however it ends.
struct TempDir(std::path::PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn auto_follows_a_restart_without_and_with_the_module() {
    if external("auto_follows_a_restart_without_and_with_the_module") {
        return;
    }
    let dir =
        TempDir(std::env::temp_dir().join(format!("qag-client-restart-{}", std::process::id())));
    let start = |without_module: bool, port: Option<u16>| {
        Server::start(&ServerOptions {
            without_module,
            port,
            dir: Some(dir.0.clone()),
            extra: vec!["--appendonly".into(), "yes".into()],
            ..Default::default()
        })
    };
    let server = start(false, None);
    let port = server.port;
    // Believe a missing module for long: only the reconnect may make Auto ask again.
    // No back-off: the call after a restart goes to Redis (the subject here is the
    // backend, not the outage policy).
    let auto = Limiter::with_options(
        manager(&server).await,
        Options {
            recheck_missing_module: Duration::from_secs(3600),
            back_off: Duration::ZERO,
            ..Options::default()
        },
    );
    let mut seen = Vec::new();
    let mut take = |answer: Result<qag_client::Decision, Error>| match answer {
        Ok(decision) => seen.push((decision.answered_by, decision.remaining)),
        // The first call after a restart may find the old connection dropped; it was
        // not sent, and the next call reconnects.
        Err(error) => assert!(error.is_unavailable(), "{error}"),
    };
    for _ in 0..2 {
        take(auto.take(&Bucket::with_key("qag:k", 10, PERIOD), 1).await);
    }
    server.shutdown();
    let server = start(true, Some(port));
    for _ in 0..3 {
        take(auto.take(&Bucket::with_key("qag:k", 10, PERIOD), 1).await);
    }
    server.shutdown();
    let _server = start(false, Some(port));
    for _ in 0..3 {
        take(auto.take(&Bucket::with_key("qag:k", 10, PERIOD), 1).await);
    }
    eprintln!("answers across the restarts: {seen:?}");
    use AnsweredBy::{Module, Script};
    let remaining: Vec<u64> = seen.iter().map(|(_, left)| *left).collect();
    assert!(
        remaining.windows(2).all(|pair| pair[1] + 1 == pair[0]),
        "one bucket counted down across the restarts: {seen:?}"
    );
    assert_eq!(seen.first(), Some(&(Module, 9)));
    assert!(seen.iter().any(|(by, _)| *by == Script), "{seen:?}");
    assert_eq!(seen.last().map(|(by, _)| *by), Some(Module), "{seen:?}");
    let order: Vec<AnsweredBy> = seen.iter().map(|(by, _)| *by).collect();
    let switches = order.windows(2).filter(|pair| pair[0] != pair[1]).count();
    assert_eq!(switches, 2, "module, then script, then module: {seen:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_refund_gives_tokens_back_through_module_and_script_alike() {
    if external("a_refund_gives_tokens_back_through_module_and_script_alike") {
        return;
    }
    for without_module in [false, true] {
        let server = Server::start(&ServerOptions {
            without_module,
            ..Default::default()
        });
        let mut raw = server.client().get_connection().unwrap();
        let limiter = Limiter::new(manager(&server).await);
        let by = if without_module {
            AnsweredBy::Script
        } else {
            AnsweredBy::Module
        };
        for _ in 0..COUNT {
            assert!(
                limiter
                    .take(&Bucket::with_key("qag:r", COUNT, PERIOD), 1)
                    .await
                    .unwrap()
                    .allowed
            );
        }
        let back = limiter
            .refund(&Bucket::with_key("qag:r", COUNT, PERIOD), 2)
            .await
            .unwrap();
        assert_eq!((back.remaining, back.answered_by), (2, by));
        let next = limiter
            .take(&Bucket::with_key("qag:r", COUNT, PERIOD), 1)
            .await
            .unwrap();
        assert_eq!((next.allowed, next.remaining), (true, 1));
        let capped = limiter
            .refund(&Bucket::with_key("qag:r", COUNT, PERIOD), 100)
            .await
            .unwrap();
        assert_eq!(capped.remaining, COUNT);
        // A missing bucket is full and stays missing.
        let missing = limiter
            .refund(&Bucket::with_key("qag:none", COUNT, PERIOD), 1)
            .await
            .unwrap();
        assert_eq!(missing.remaining, COUNT);
        // No bucket made: the module keeps only the refund's id there, the script nothing.
        assert_eq!(form(&mut raw, "qag:none").0, Vec::<String>::new());
        assert!(matches!(
            limiter.refund(&Bucket::with_key("qag:r", COUNT, PERIOD), 0).await,
            Err(Error::InvalidArgument(why)) if why.contains("n must be")
        ));
    }
}

/// An admission sends no id of the limiter's (issue 37): 300 takes and pairs leave their
/// buckets as 300 plain QAG.TAKEs do; a caller's id is still remembered.
#[tokio::test(flavor = "multi_thread")]
async fn takes_through_the_defaults_cost_what_a_plain_bucket_costs() {
    if external("takes_through_the_defaults_cost_what_a_plain_bucket_costs") {
        return;
    }
    let server = Server::start(&ServerOptions::default());
    let mut raw = server.client().get_connection().unwrap();
    let limiter = Limiter::new(manager(&server).await);
    let (plain, through, pair) = ("qag:plain", "qag:defaults", "qag:pair");
    let bucket = |key: &str| Bucket::with_key(key, 1000, 3600.0);
    for _ in 0..300 {
        let _: Value = cmd("QAG.TAKE")
            .arg(plain)
            .arg(1000)
            .arg(3600)
            .query(&mut raw)
            .unwrap();
        assert!(limiter.take(&bucket(through), 1).await.unwrap().allowed);
        let (client, key) = (bucket(pair), bucket("qag:defaults2"));
        let both = limiter.take_pair(&client, &key, 1).await.unwrap();
        assert!(both.allowed());
    }
    limiter.refund(&bucket(through), 1).await.unwrap();
    let memory = |con: &mut Connection, key: &str| -> i64 {
        cmd("MEMORY").arg("USAGE").arg(key).query(con).unwrap()
    };
    let plain_bytes = memory(&mut raw, plain);
    for key in [through, pair, "qag:defaults2"] {
        let mut fields: Vec<String> = cmd("HKEYS").arg(key).query(&mut raw).unwrap();
        fields.sort();
        assert_eq!(fields, ["tokens", "ts"], "{key}");
        assert!(memory(&mut raw, key) <= 2 * plain_bytes, "{key}");
    }
    let with_id = limiter.with_id("gateway-request-1").unwrap();
    with_id.take(&bucket(through), 1).await.unwrap();
    let fields: Vec<String> = cmd("HKEYS").arg(through).query(&mut raw).unwrap();
    assert!(fields
        .iter()
        .any(|field| field == "id:take:gateway-request-1"));
}
