//! The example gateway (examples/axum_gateway.rs) as a program, for the tests that
//! drive it with a real HTTP client.

#![allow(dead_code)] // each test binary uses its own part

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};

use crate::common::Server;

/// The example gateway, running until dropped.
pub struct Gateway {
    child: Child,
    pub base: String,
}

impl Gateway {
    pub fn start(server: &Server, flags: &[&str]) -> Gateway {
        Gateway::start_logging(server, flags, None)
    }

    /// The gateway with its standard error (its log) written to `log`.
    pub fn start_logging(server: &Server, flags: &[&str], log: Option<&Path>) -> Gateway {
        let redis = format!("redis://127.0.0.1:{}/", server.port);
        Gateway::start_at(&redis, flags, log)
    }

    /// The gateway on the Redis at `redis` (a URL).
    pub fn start_at(redis: &str, flags: &[&str], log: Option<&Path>) -> Gateway {
        let stderr = match log {
            Some(path) => Stdio::from(std::fs::File::create(path).unwrap()),
            None => Stdio::inherit(),
        };
        let mut child = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
            .args([
                "run",
                "--quiet",
                "--package",
                "qag-client",
                "--features",
                "tower",
                "--example",
                "axum_gateway",
                "--",
                "--redis",
                redis,
                "--listen",
                "127.0.0.1:0",
            ])
            .args(flags)
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .expect("run the axum gateway example");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let address = line
            .trim()
            .strip_prefix("listening on ")
            .unwrap_or_else(|| panic!("the gateway said {line:?}"))
            .to_owned();
        Gateway {
            child,
            base: format!("http://{address}"),
        }
    }

    pub fn url(&self, query: &str) -> String {
        format!("{}/v1/query?{query}", self.base)
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
