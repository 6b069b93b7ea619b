//! What an operator sees: INFO counters, the module version, COMMAND DOCS, the ACL
//! category `qag`, and the redis_exporter script.

mod common;

use std::collections::BTreeMap;

use common::*;

/// The exporter script, as shipped.
const EXPORTER_LUA: &str = include_str!("../contrib/redis_exporter/qag.lua");

/// Every command's INFO name (after `qag_`), for the fields every command has.
const COMMANDS: [&str; 14] = [
    "take",
    "take2",
    "peek",
    "refund",
    "lease",
    "renew",
    "release",
    "leases",
    "quota",
    "quota_add",
    "quota_seed",
    "admit",
    "record",
    "throttle",
];

/// The integer fields of INFO qag.
fn counters(con: &mut Connection) -> BTreeMap<String, u64> {
    let info: String = cmd("INFO").arg("qag").query(con).unwrap();
    info.lines()
        .filter_map(|line| line.split_once(':'))
        .filter_map(|(name, value)| Some((name.to_string(), value.trim().parse().ok()?)))
        .collect()
}

#[test]
fn info_counts_every_call_error_and_decision() {
    if external("info_counts_every_call_error_and_decision") {
        return;
    }
    // Counters live in the server's memory only: the data survives a restart, they
    // start again from zero.
    let dir = std::env::temp_dir().join(format!("qag-counters-{}", std::process::id()));
    let options = ServerOptions {
        module_args: vec!["TEST-COMMANDS".into()],
        dir: Some(dir.clone()),
        extra: vec!["--appendonly".into(), "yes".into()],
        ..Default::default()
    };
    let server = Server::start(&options);
    let mut con = server.client().get_connection().unwrap();
    let start = counters(&mut con);
    for command in COMMANDS.iter().chain(&["test_panic"]) {
        for suffix in ["calls", "errors"] {
            assert_eq!(start.get(&format!("qag_{command}_{suffix}")), Some(&0));
        }
    }

    send_line(&mut con, "SET str x").unwrap();
    // Each line: the call, and whether it answers an error. (A call with too few or
    // too many arguments for the command's arity is refused by the server before the
    // module sees it: Redis's own commandstats count it, as rejected_calls.)
    let script = [
        ("QAG.TAKE b 2 60", false),
        ("QAG.TAKE b 2 60", false),
        ("QAG.TAKE b 2 60", false), // refused
        ("QAG.TAKE b 0 60", true),
        ("QAG.TAKE2 c 5 60 k 1 60", false),
        ("QAG.TAKE2 c 5 60 k 1 60", false), // refused by the key bucket
        ("QAG.TAKE2 b 2 60 k 1 60", false), // refused by the client bucket
        ("QAG.TAKE2 c 5 60 k 0 60", true),
        ("QAG.PEEK b 2 60", false),
        ("QAG.PEEK str 2 60", true),
        ("QAG.REFUND b 2 60 1", false),
        ("QAG.REFUND missing 2 60 1", false),
        ("QAG.REFUND b 2 60 0", true),
        ("QAG.LEASE ls 1 100000 a", false),
        ("QAG.LEASE ls 1 100000 b", false), // refused
        ("QAG.LEASE ls 0 100000 b", true),
        ("QAG.RENEW ls a 100000", false),
        ("QAG.RENEW ls z 100000", false),
        ("QAG.RENEW str a 100000", true),
        ("QAG.RELEASE ls a", false),
        ("QAG.RELEASE str a", true),
        ("QAG.LEASES ls", false),
        ("QAG.LEASES str", true),
        ("QAG.QUOTA q PER day TZ UTC CALLS 1", false),
        ("QAG.QUOTA.ADD q PER day TZ UTC CALLS 1", false),
        ("QAG.QUOTA q PER day TZ UTC CALLS 1", false), // refused
        ("QAG.QUOTA q PER week TZ UTC CALLS 1", true),
        (
            "QAG.QUOTA.ADD q PER day TZ UTC CALLS 9223372036854775807",
            true,
        ),
        ("QAG.QUOTA.SEED q PER day TZ UTC CALLS 5", false),
        ("QAG.QUOTA.SEED q PER day TZ Mars/Olympus CALLS 5", true),
        ("QAG.ADMIT 1 w 1 0", false),
        ("QAG.ADMIT 1 w 1 0", false), // refused
        ("QAG.ADMIT 2 w 1 0", true),
        ("QAG.RECORD 1 w 10", false),
        ("QAG.RECORD 1 str 10", true),
        ("QAG.THROTTLE th 0 1 60", false),
        ("QAG.THROTTLE th 0 1 60", false), // refused
        ("QAG.THROTTLE th 0 0 60", true),
        ("QAG.TEST.PANIC x", true), // the panic guard's error
    ];
    for (line, errs) in script {
        assert_eq!(send_line(&mut con, line).is_err(), errs, "{line}");
    }
    // In a transaction and from a script, counted like any other call.
    let _: () = cmd("MULTI").query(&mut con).unwrap();
    let _: String = cmd("QAG.TAKE")
        .arg("m")
        .arg(1)
        .arg(60)
        .query(&mut con)
        .unwrap();
    let _: String = cmd("QAG.TAKE")
        .arg("m")
        .arg(1)
        .arg(60)
        .query(&mut con)
        .unwrap();
    let _: Value = cmd("EXEC").query(&mut con).unwrap();
    let _: Value = cmd("EVAL")
        .arg("return redis.call('QAG.ADMIT', 1, KEYS[1], 5, 0)")
        .arg(1)
        .arg("e")
        .query(&mut con)
        .unwrap();

    let expected: BTreeMap<&str, u64> = [
        ("take_calls", 6),
        ("take_errors", 1),
        ("take_allowed", 3),
        ("take_refused", 2),
        ("take2_calls", 4),
        ("take2_errors", 1),
        ("take2_allowed", 1),
        ("take2_refused_client", 1),
        ("take2_refused_key", 1),
        ("peek_calls", 2),
        ("peek_errors", 1),
        ("refund_calls", 3),
        ("refund_errors", 1),
        ("lease_calls", 3),
        ("lease_errors", 1),
        ("lease_acquired", 1),
        ("lease_refused", 1),
        ("renew_calls", 3),
        ("renew_errors", 1),
        ("release_calls", 2),
        ("release_errors", 1),
        ("leases_calls", 2),
        ("leases_errors", 1),
        ("quota_calls", 3),
        ("quota_errors", 1),
        ("quota_allowed", 1),
        ("quota_refused", 1),
        ("quota_add_calls", 2),
        ("quota_add_errors", 1),
        ("quota_seed_calls", 2),
        ("quota_seed_errors", 1),
        ("admit_calls", 4),
        ("admit_errors", 1),
        ("admit_allowed", 2),
        ("admit_refused", 1),
        ("record_calls", 2),
        ("record_errors", 1),
        ("throttle_calls", 3),
        ("throttle_errors", 1),
        ("throttle_allowed", 1),
        ("throttle_refused", 1),
        ("test_panic_calls", 1),
        ("test_panic_errors", 1),
        ("replays", 0),
        ("waiters", 0),
        ("wait_started", 0),
        ("wait_served", 0),
        ("wait_refused", 0),
        ("wait_timed_out", 0),
        ("wait_given_back", 0),
        ("wait_given_back_dropped", 0),
        ("wait_moved", 0),
        ("wait_full", 0),
        ("wait_ms", 0),
    ]
    .into_iter()
    .collect();
    let seen = counters(&mut con);
    let seen_counts: BTreeMap<&str, u64> = seen
        .iter()
        .filter_map(|(name, value)| Some((name.strip_prefix("qag_")?, *value)))
        .collect();
    assert_eq!(seen_counts, expected);
    let info: String = cmd("INFO").arg("qag").query(&mut con).unwrap();
    assert!(info.contains(&format!("qag_version:{}", env!("CARGO_PKG_VERSION"))));
    assert!(
        info.contains("qag_clock:RedisModule_CachedMicroseconds")
            || info.contains("qag_clock:clock_gettime(CLOCK_REALTIME)"),
        "{info}"
    );
    // INFO modules and INFO everything show them too; plain INFO does not.
    for section in ["modules", "everything"] {
        let text: String = cmd("INFO").arg(section).query(&mut con).unwrap();
        assert!(text.contains("qag_take_calls:6"), "INFO {section}");
    }
    let plain: String = cmd("INFO").query(&mut con).unwrap();
    assert!(!plain.contains("qag_take_calls"));

    drop(con);
    drop(server);
    let server = Server::start(&options);
    let mut con = server.client().get_connection().unwrap();
    let kept: i64 = cmd("EXISTS")
        .arg("b")
        .arg("q")
        .arg("w")
        .query(&mut con)
        .unwrap();
    assert_eq!(kept, 3, "the data is back");
    assert!(counters(&mut con).values().all(|value| *value == 0));
    drop(server);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn the_exporter_script_returns_the_info_counters() {
    let mut t = Target::new();
    let mut con = t.con();
    let key = t.key("exported");
    for _ in 0..3 {
        let _: Value = cmd("QAG.TAKE")
            .arg(&key)
            .arg(2)
            .arg(60)
            .query(&mut con)
            .unwrap();
    }
    let pairs: Vec<String> = cmd("EVAL")
        .arg(EXPORTER_LUA)
        .arg(0)
        .query(&mut con)
        .unwrap();
    let exported: BTreeMap<String, u64> = pairs
        .chunks(2)
        .map(|pair| (pair[0].clone(), pair[1].parse().expect("a number")))
        .collect();
    let mut info = counters(&mut con);
    info.insert("qag_module_version".into(), module_version());
    assert_eq!(exported, info);
    assert!(exported["qag_take_calls"] >= 3 && exported["qag_take_refused"] >= 1);
    t.assert_healthy();
}

/// major × 10000 + minor × 100 + patch of the crate's version.
fn module_version() -> u64 {
    [
        env!("CARGO_PKG_VERSION_MAJOR"),
        env!("CARGO_PKG_VERSION_MINOR"),
        env!("CARGO_PKG_VERSION_PATCH"),
    ]
    .iter()
    .fold(0, |n, part| n * 100 + part.parse::<u64>().unwrap())
}

#[test]
fn module_list_shows_the_crate_version() {
    let mut t = Target::new();
    let mut con = t.con();
    let modules: Vec<BTreeMap<String, Value>> = cmd("MODULE").arg("LIST").query(&mut con).unwrap();
    let qag = modules
        .iter()
        .find(|m| m.get("name") == Some(&Value::BulkString(b"qag".to_vec())))
        .expect("qag in MODULE LIST");
    assert_eq!(qag.get("ver"), Some(&Value::Int(module_version() as i64)));
    if let Some(server) = t.server.as_ref() {
        let log = server.log();
        assert!(
            log.contains(&format!(
                "qag {} (module version {})",
                env!("CARGO_PKG_VERSION"),
                module_version()
            )),
            "{log}"
        );
    }
    t.assert_healthy();
}

/// A COMMAND DOCS entry's fields, by name.
fn fields(value: &Value) -> BTreeMap<String, Value> {
    match value {
        Value::Array(items) => items
            .chunks(2)
            .filter_map(|kv| match &kv[0] {
                Value::BulkString(name) => {
                    Some((String::from_utf8_lossy(name).into(), kv[1].clone()))
                }
                Value::SimpleString(name) => Some((name.clone(), kv[1].clone())),
                _ => None,
            })
            .collect(),
        Value::Map(items) => items
            .iter()
            .filter_map(|(k, v)| match k {
                Value::BulkString(name) => Some((String::from_utf8_lossy(name).into(), v.clone())),
                Value::SimpleString(name) => Some((name.clone(), v.clone())),
                _ => None,
            })
            .collect(),
        _ => BTreeMap::new(),
    }
}

fn text(value: Option<&Value>) -> String {
    match value {
        Some(Value::BulkString(b)) => String::from_utf8_lossy(b).into(),
        Some(Value::SimpleString(s)) => s.clone(),
        _ => String::new(),
    }
}

/// Each argument as `name:type[:token][:flags]`, nested ones in brackets.
fn describe(arguments: &Value) -> Vec<String> {
    let Value::Array(list) = arguments else {
        return vec![];
    };
    list.iter()
        .map(|arg| {
            let f = fields(arg);
            let mut out = format!("{}:{}", text(f.get("name")), text(f.get("type")));
            if f.contains_key("token") {
                out.push_str(&format!(":{}", text(f.get("token"))));
            }
            if let Some(Value::Array(flags)) = f.get("flags") {
                for flag in flags {
                    out.push_str(&format!(":{}", text(Some(flag))));
                }
            }
            if let Some(nested) = f.get("arguments") {
                out.push_str(&format!("[{}]", describe(nested).join(" ")));
            }
            out
        })
        .collect()
}

#[test]
fn command_docs_list_every_argument() {
    let mut t = Target::new();
    let mut con = t.con();
    let quota = "key:key per:oneof:PER[day:pure-token:day month:pure-token:month] zone:string:TZ calls:integer:CALLS:optional rows:integer:ROWS:optional";
    let peek = "key:key count:integer period:double cost:integer:COST:optional";
    let id = "id:block:optional[request-id:string:ID seconds:integer:KEEP:optional]";
    let wait = "ms:integer:WAIT:optional";
    let take = format!("{peek} {id} {wait}");
    let quota_add = format!("{quota} {id}");
    let take2 = format!("ckey:key ccount:integer cperiod:double kkey:key kcount:integer kperiod:double cost:integer:COST:optional {id} {wait}");
    let lease = format!("key:key max:integer ttl_ms:integer id:string {wait}");
    let throttle = format!(
        "key:key max_burst:integer count:integer period:integer quantity:integer:optional {wait}"
    );
    let refund = format!("key:key count:integer period:double n:integer {id}");
    let admit = format!("numscopes:integer scope:block:multiple[key:key rpm:integer tpm:integer] seconds:integer:WINDOW:optional tokens:integer:RESERVE:optional {id} milliseconds:integer:HOLD:optional");
    let record = format!("numscopes:integer key:key:multiple tokens:integer seconds:integer:WINDOW:optional {id} PARTIAL:pure-token:PARTIAL:optional");
    for (command, arguments) in [
        ("qag.take", take.as_str()),
        ("qag.peek", peek),
        ("qag.refund", refund.as_str()),
        ("qag.take2", take2.as_str()),
        ("qag.lease", lease.as_str()),
        ("qag.renew", "key:key id:string ttl_ms:integer"),
        ("qag.release", "key:key id:string"),
        ("qag.leases", "key:key"),
        ("qag.quota", quota),
        ("qag.quota.add", quota_add.as_str()),
        ("qag.quota.seed", quota),
        ("qag.admit", admit.as_str()),
        ("qag.record", record.as_str()),
        ("qag.throttle", throttle.as_str()),
    ] {
        let docs: Value = cmd("COMMAND")
            .arg("DOCS")
            .arg(command)
            .query(&mut con)
            .unwrap();
        let docs = fields(&docs);
        let doc = fields(
            docs.get(command)
                .unwrap_or_else(|| panic!("no docs for {command}")),
        );
        let since = match command {
            "qag.throttle" => "0.2.0",
            "qag.refund" => "0.3.0",
            _ => "0.1.0",
        };
        assert_eq!(text(doc.get("since")), since, "{command}");
        assert!(!text(doc.get("summary")).is_empty(), "{command}");
        assert!(text(doc.get("complexity")).starts_with("O("), "{command}");
        let listed = describe(doc.get("arguments").unwrap_or(&Value::Nil)).join(" ");
        assert_eq!(listed, arguments, "{command}");
    }
    t.assert_healthy();
}

/// Whether this server lets a module add an ACL category (Redis 7.4+, Valkey 8+).
fn has_module_acl_categories(con: &mut Connection) -> bool {
    let info: String = cmd("INFO").arg("server").query(con).unwrap();
    if info.contains("valkey_version:") {
        return true;
    }
    let version = info
        .lines()
        .find_map(|l| l.strip_prefix("redis_version:"))
        .unwrap_or("0.0");
    let mut parts = version
        .trim()
        .split('.')
        .map(|p| p.parse::<u32>().unwrap_or(0));
    (parts.next().unwrap_or(0), parts.next().unwrap_or(0)) >= (7, 4)
}

#[test]
fn one_acl_rule_grants_exactly_the_qag_commands() {
    if external("one_acl_rule_grants_exactly_the_qag_commands") {
        return;
    }
    let server = Server::start(&ServerOptions::default());
    let mut con = server.client().get_connection().unwrap();
    if !has_module_acl_categories(&mut con) {
        assert!(
            server
                .log()
                .contains("ACL category @qag not available on this server"),
            "{}",
            server.log()
        );
        assert!(send_line(&mut con, "ACL CAT qag").is_err());
        eprintln!("one_acl_rule_grants_exactly_the_qag_commands: no module ACL categories on this server; the log says so");
        return;
    }
    assert!(server.log().contains("ACL category @qag added"));
    let mut listed: Vec<String> = cmd("ACL").arg("CAT").arg("qag").query(&mut con).unwrap();
    listed.sort();
    let mut all: Vec<String> = COMMANDS
        .iter()
        .map(|c| format!("qag.{}", c.replace("quota_", "quota.")))
        .collect();
    all.sort();
    assert_eq!(listed, all);
    send_line(&mut con, "ACL SETUSER gw on >pw ~qag:* +@qag").unwrap();
    let mut gw = redis::Client::open(format!("redis://gw:pw@127.0.0.1:{}/", server.port))
        .unwrap()
        .get_connection()
        .unwrap();
    assert!(send_line(&mut gw, "QAG.TAKE qag:b 5 60").is_ok());
    assert!(send_line(&mut gw, "QAG.ADMIT 1 qag:w 5 0").is_ok());
    assert!(send_line(&mut gw, "QAG.QUOTA qag:q PER day TZ UTC CALLS 1").is_ok());
    for denied in ["GET qag:b", "HSET qag:b tokens 9", "QAG.TAKE other 5 60"] {
        let error = send_line(&mut gw, denied).unwrap_err();
        assert_eq!(error.code(), Some("NOPERM"), "{denied}: {error}");
    }
}

/// The redis_exporter binary: QAG_REDIS_EXPORTER, else Debian's package's.
fn exporter_binary() -> Option<std::path::PathBuf> {
    let path = std::env::var_os("QAG_REDIS_EXPORTER")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| "/usr/bin/prometheus-redis-exporter".into());
    path.exists().then_some(path)
}

/// One scrape of `/metrics` on a loopback port; None while nothing answers.
fn scrape(port: u16) -> Option<String> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream
        .set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .ok()?;
    let request = "GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
    stream.write_all(request.as_bytes()).ok()?;
    let mut body = String::new();
    stream.read_to_string(&mut body).ok()?;
    Some(body)
}

/// The exporter run as the README says: its own user with the ACL its README asks for,
/// and `--script contrib/redis_exporter/qag.lua`; its metrics carry every counter.
#[test]
fn redis_exporter_exports_the_counters_with_the_documented_acl() {
    if external("redis_exporter_exports_the_counters_with_the_documented_acl") {
        return;
    }
    let Some(exporter) = exporter_binary() else {
        eprintln!("redis_exporter_exports_the_counters_with_the_documented_acl: skipped, no redis_exporter (scripts/setup.sh installs Debian's prometheus-redis-exporter)");
        return;
    };
    let server = Server::start(&ServerOptions::default());
    let mut con = server.client().get_connection().unwrap();
    send_line(&mut con, "ACL SETUSER exporter +client +ping +info +config|get +cluster|info +slowlog +latency +memory +select +get +scan +xinfo +type +pfcount +strlen +llen +scard +zcard +hlen +xlen +eval allkeys on >secret").unwrap();
    for _ in 0..3 {
        send_line(&mut con, "QAG.TAKE b 2 60").unwrap();
    }
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    drop(listener);
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/contrib/redis_exporter/qag.lua"
    );
    let child = std::process::Command::new(exporter)
        .arg(format!("-redis.addr=redis://127.0.0.1:{}", server.port))
        .args(["-redis.user=exporter", "-redis.password=secret"])
        .arg(format!("-script={script}"))
        .arg(format!("-web.listen-address=127.0.0.1:{port}"))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start the exporter");
    struct Stop(std::process::Child);
    impl Drop for Stop {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let _stop = Stop(child);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let metrics = loop {
        if let Some(body) = scrape(port).filter(|b| b.contains("redis_script_values")) {
            break body;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no script metrics from the exporter"
        );
        std::thread::sleep(std::time::Duration::from_millis(200));
    };
    let value = |key: &str| {
        let prefix = format!("redis_script_values{{key=\"{key}\"}} ");
        metrics
            .lines()
            .find_map(|line| line.strip_prefix(&prefix))
            .and_then(|v| v.trim().parse::<f64>().ok())
    };
    assert_eq!(value("qag_take_calls"), Some(3.0), "{metrics}");
    assert_eq!(value("qag_take_allowed"), Some(2.0));
    assert_eq!(value("qag_take_refused"), Some(1.0));
    assert_eq!(value("qag_module_version"), Some(module_version() as f64));
    assert!(metrics.contains("redis_up 1"), "{metrics}");
}
