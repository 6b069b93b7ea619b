//! The example programs, run as a user runs them, and docs/rust-client.md's Rust example, which
//! must be examples/gateway.rs verbatim (so the docs' code is compiled).

#[path = "../../../tests/common/mod.rs"]
mod common;

use std::process::{Command, Output};

use common::*;

fn example(name: &str, args: &[&str]) -> Output {
    Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args([
            "run",
            "--quiet",
            "--package",
            "qag-client",
            "--example",
            name,
            "--",
        ])
        .args(args)
        .output()
        .expect("run cargo")
}

fn signal(server: &Server, which: &str) {
    let status = Command::new("kill")
        .arg(which)
        .arg(server.pid().to_string())
        .status()
        .expect("run kill");
    assert!(status.success());
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn the_take_example_prints_one_line() {
    if external("the_take_example_prints_one_line") {
        return;
    }
    for without_module in [false, true] {
        let server = Server::start(&ServerOptions {
            without_module,
            ..Default::default()
        });
        let url = format!("redis://127.0.0.1:{}/", server.port);
        let backend = if without_module { "script" } else { "module" };
        // A period long enough that nothing refills between the runs.
        let run = example("take", &[&url, "qag:k", "60", "36000"]);
        assert!(run.status.success(), "{}", text(&run.stderr));
        assert_eq!(
            text(&run.stdout),
            format!("allowed=1 remaining=59 retry_after=0 backend={backend}\n")
        );
        let run = example(
            "take",
            &[
                "--backend",
                "script",
                "--cost",
                "100",
                &url,
                "qag:k",
                "60",
                "36000",
            ],
        );
        assert_eq!(
            text(&run.stdout),
            "allowed=0 remaining=59 retry_after=never backend=script\n"
        );
        let run = example(
            "take",
            &["--backend", "module", &url, "qag:k", "60", "36000"],
        );
        if without_module {
            assert_eq!(run.status.code(), Some(1));
            assert!(
                text(&run.stderr).contains("module is required"),
                "{}",
                text(&run.stderr)
            );
            assert!(run.stdout.is_empty());
        } else {
            assert!(run.status.success());
        }
        let run = example("take", &[&url, "qag:k", "0", "60"]);
        assert_eq!(run.status.code(), Some(1));
        assert!(text(&run.stderr).contains("count must be an integer"));
    }
    // A server that accepts connections but never answers: the deadline (0.5 s) covers
    // connecting, so the program ends within it.
    let server = Server::start(&ServerOptions::default());
    let url = format!("redis://127.0.0.1:{}/", server.port);
    example("take", &["--help"]); // built before it is timed
    let program = std::env::var_os("CARGO_TARGET_DIR")
        .map_or_else(|| repository_root().join("target"), Into::into)
        .join("debug/examples/take");
    signal(&server, "-STOP");
    let started = std::time::Instant::now();
    let run = Command::new(&program)
        .args([&url, "qag:k", "60", "36000"])
        .output()
        .expect("run the take example");
    let took = started.elapsed();
    signal(&server, "-CONT");
    assert_eq!(run.status.code(), Some(1), "{}", text(&run.stderr));
    assert!(text(&run.stderr).contains("did not answer in time"));
    assert!(
        took < std::time::Duration::from_millis(600),
        "exited after {took:?}"
    );
    let usage = example("take", &["--backend", "lua"]);
    assert_eq!(usage.status.code(), Some(2));
    assert!(text(&usage.stderr).contains("usage: take"));
}

/// docs/rust-client.md's tower example is examples/tower_layer.rs verbatim, and it runs: a
/// request with a key is answered with the headers of its limits, its quota's among
/// them.
#[test]
fn the_tower_example_runs_and_is_the_readmes() {
    let source =
        std::fs::read_to_string(repository_root().join("clients/rust/examples/tower_layer.rs"))
            .unwrap();
    let readme = std::fs::read_to_string(repository_root().join("docs/rust-client.md")).unwrap();
    assert!(
        readme.contains(&format!("```rust\n{source}```\n")),
        "docs/rust-client.md's tower example is not clients/rust/examples/tower_layer.rs verbatim"
    );
    if external("the_tower_example_runs_and_is_the_readmes") {
        return;
    }
    let server = Server::start(&ServerOptions::default());
    let mut child = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args([
            "run",
            "--quiet",
            "--package",
            "qag-client",
            "--features",
            "tower",
        ])
        .args(["--example", "tower_layer", "--"])
        .arg(format!("redis://127.0.0.1:{}/", server.port))
        .arg("127.0.0.1:0")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("run the tower example");
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(child.stdout.take().unwrap()),
        &mut line,
    )
    .unwrap();
    let address = line.trim().strip_prefix("listening on ").map(str::to_owned);
    let answer = address.map(|address| {
        let runtime = tokio::runtime::Runtime::new().unwrap();
        runtime.block_on(async {
            let response = reqwest::Client::new()
                .get(format!("http://{address}/v1/query"))
                .header("x-api-key", "acme~partner")
                .send()
                .await
                .unwrap();
            let fields = response.headers().clone();
            (response.status().as_u16(), fields)
        })
    });
    let _ = child.kill();
    let _ = child.wait();
    let (status, fields) = answer.unwrap_or_else(|| panic!("the example said {line:?}"));
    assert_eq!(status, 200);
    for (name, value) in [
        ("x-ratelimit-remaining", "19"),
        ("x-ratelimit-key-remaining", "99"),
        ("x-quota-remaining-calls", "99999"),
        ("x-quota-remaining-rows", "9999750"),
    ] {
        assert_eq!(fields[name], value, "{name}: {fields:?}");
    }
    assert!(fields.contains_key("ratelimit-policy"), "{fields:?}");
}

#[test]
fn the_gateway_example_runs_and_is_the_readmes() {
    let source =
        std::fs::read_to_string(repository_root().join("clients/rust/examples/gateway.rs"))
            .unwrap();
    let readme = std::fs::read_to_string(repository_root().join("docs/rust-client.md")).unwrap();
    assert!(
        readme.contains(&format!("```rust\n{source}```\n")),
        "docs/rust-client.md's Rust gateway example is not clients/rust/examples/gateway.rs verbatim"
    );
    if external("the_gateway_example_runs_and_is_the_readmes") {
        return;
    }
    let server = Server::start(&ServerOptions::default());
    let run = example("gateway", &[&format!("redis://127.0.0.1:{}/", server.port)]);
    assert!(run.status.success(), "{}", text(&run.stderr));
    assert!(
        text(&run.stdout)
            .starts_with("200 {\"x-ratelimit-limit\": \"20\", \"x-ratelimit-remaining\": \"19\", ")
            && text(&run.stdout).contains("\"x-quota-remaining-calls\": \"99999\""),
        "{}",
        text(&run.stdout)
    );
}

/// The wait demo, short: forwarded as they come, the upstream refuses what is over its
/// 10 a second; taken first, the gateway refuses instead and the upstream nothing; with
/// a wait, nobody refuses and the upstream still serves its 10 a second.
#[test]
fn the_wait_demo_shows_waiting_refuses_nothing() {
    if external("the_wait_demo_shows_waiting_refuses_nothing") {
        return;
    }
    let _timed = Cores::shared();
    let server = Server::start(&ServerOptions::default());
    let url = format!("redis://127.0.0.1:{}/", server.port);
    let run = example(
        "wait_demo",
        &["--redis", &url, "--callers", "20", "--seconds", "3"],
    );
    assert!(run.status.success(), "{}", text(&run.stderr));
    let out = text(&run.stdout);
    // "<run>: … s: <served> served (…), <n> refused by the gateway (…), <n> refused by
    // the upstream (…); …"
    let counts = |name: &str| -> [u64; 3] {
        let line = out
            .lines()
            .find(|line| line.starts_with(&format!("{name}: ")))
            .unwrap_or_else(|| panic!("no {name} line in {out}"));
        let number_before = |words: &str| -> u64 {
            let head = &line[..line.find(words).unwrap_or_else(|| panic!("{line}"))];
            head.trim_end()
                .rsplit(' ')
                .next()
                .and_then(|n| n.parse().ok())
                .unwrap_or_else(|| panic!("{line}"))
        };
        [
            number_before(" served ("),
            number_before(" refused by the gateway"),
            number_before(" refused by the upstream"),
        ]
    };
    let [served, gateway, upstream] = counts("none");
    assert!(served >= 30 && gateway == 0 && upstream > served, "{out}");
    let [served, gateway, upstream] = counts("take");
    assert!(served >= 1 && gateway > served && upstream == 0, "{out}");
    let [served, gateway, upstream] = counts("wait");
    assert!(served >= 25 && gateway == 0 && upstream == 0, "{out}");
}
