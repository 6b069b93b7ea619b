//! A rolling upgrade under a running client: a primary without the module served by the
//! scripts, its replica with the module promoted (the client's address moved to it, as a
//! managed service's endpoint moves), and the reverse, a node restarted without the
//! module. Every family carries over exactly: a held lease stays held and renewed, quota
//! counts, window counters and an open reservation's hold go on from where they were,
//! whichever answers.

#[path = "../../../tests/common/mod.rs"]
mod common;

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use qag_client::{
    AnsweredBy, Bucket, Lease, LeaseGuard, Limiter, Options, Per, Quota, Reservation, Scope,
};
use redis::aio::ConnectionManager;

/// A TCP address that forwards to a server's port, and can be moved to another one (its
/// connections cut, as a failover cuts them).
struct Endpoint {
    port: u16,
    target: Arc<AtomicU16>,
    open: Arc<Mutex<Vec<TcpStream>>>,
}

impl Endpoint {
    fn to(port: u16) -> Endpoint {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let endpoint = Endpoint {
            port: listener.local_addr().unwrap().port(),
            target: Arc::new(AtomicU16::new(port)),
            open: Arc::default(),
        };
        let (target, open) = (endpoint.target.clone(), endpoint.open.clone());
        std::thread::spawn(move || {
            for client in listener.incoming().flatten() {
                let port = target.load(Ordering::SeqCst);
                let Ok(server) = TcpStream::connect(("127.0.0.1", port)) else {
                    continue;
                };
                let mut open = open.lock().unwrap();
                for stream in [&client, &server] {
                    open.push(stream.try_clone().unwrap());
                }
                pipe(client.try_clone().unwrap(), server.try_clone().unwrap());
                pipe(server, client);
            }
        });
        endpoint
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// New connections go to `port`; the open ones are cut.
    fn move_to(&self, port: u16) {
        self.target.store(port, Ordering::SeqCst);
        for stream in self.open.lock().unwrap().drain(..) {
            let _ = stream.shutdown(Shutdown::Both);
        }
    }
}

fn pipe(mut from: TcpStream, mut to: TcpStream) {
    std::thread::spawn(move || {
        let mut buffer = [0u8; 16 * 1024];
        while let Ok(n) = from.read(&mut buffer) {
            if n == 0 || to.write_all(&buffer[..n]).is_err() {
                break;
            }
        }
        let _ = to.shutdown(Shutdown::Both);
    });
}

fn wait_linked(replica: &Server) {
    let mut con = replica.client().get_connection().unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let info: String = cmd("INFO").arg("replication").query(&mut con).unwrap();
        if info.contains("master_link_status:up") {
            return;
        }
        assert!(Instant::now() < deadline, "replica never linked");
        std::thread::sleep(Duration::from_millis(20));
    }
}

const TTL: Duration = Duration::from_millis(2400);
/// An hour's windows: no window ends within the test (its figures stay exact).
const WINDOW: Option<u32> = Some(3600);

fn quota() -> Quota {
    Quota {
        per: Per::Month,
        zone: "Europe/Berlin".into(),
        calls: Some(10),
        rows: None,
    }
}

fn scopes() -> [Scope; 2] {
    [
        Scope {
            key: "qag:win:{acme}:org".into(),
            rpm: 100,
            tpm: 10_000,
        },
        Scope {
            key: "qag:win:{acme}:key".into(),
            rpm: 5,
            tpm: 5_000,
        },
    ]
}

/// What the first node is driven to: every family's state, with a lease held and a
/// reservation open, each answered by `by`.
struct Before {
    guard: LeaseGuard<ConnectionManager>,
    reservation: Reservation<ConnectionManager>,
}

async fn drive(limiter: &Limiter<ConnectionManager>, by: AnsweredBy) -> Before {
    let bucket = Bucket::with_key("qag:b", 10, 3600.0);
    for left in (7..10).rev() {
        let decision = limiter.take(&bucket, 1).await.unwrap();
        assert_eq!((decision.remaining, decision.answered_by), (left, by));
    }
    let Lease::Held(guard) = limiter.lease("qag:run", 2, TTL, "a").await.unwrap() else {
        panic!("refused")
    };
    assert_eq!(guard.answered_by(), by);
    let usage = limiter.quota_add("qag:q", &quota(), 3, 0).await.unwrap();
    assert_eq!((usage.calls, usage.answered_by), (3, by));
    let admitted = limiter.admit(&scopes(), WINDOW).await.unwrap();
    assert_eq!(
        (admitted.requests_remaining, admitted.answered_by),
        (Some(4), by)
    );
    let keys = ["qag:win:{acme}:org", "qag:win:{acme}:key"];
    assert_eq!(
        limiter
            .record(&keys, 700, WINDOW)
            .await
            .unwrap()
            .answered_by,
        by
    );
    let mut reservation = limiter
        .reserve(&scopes(), 4000, WINDOW, None)
        .await
        .unwrap();
    assert_eq!(
        (reservation.admitted(), reservation.answered_by()),
        (true, by)
    );
    assert_eq!(reservation.charge(500).await.unwrap().answered_by, by);
    Before { guard, reservation }
}

/// The second node goes on exactly from the first's state, answered by `by`.
async fn carry_on(
    limiter: &Limiter<ConnectionManager>,
    before: Before,
    by: AnsweredBy,
    raw: &mut Connection,
) {
    // The lease held across the switch, renewed there: still one live lease, never lost.
    tokio::time::sleep(TTL).await;
    assert!(!before.guard.is_lost(), "{:?}", before.guard.last_error());
    assert_eq!(limiter.leases("qag:run").await, Ok(1));
    let bucket = Bucket::with_key("qag:b", 10, 3600.0);
    let decision = limiter.take(&bucket, 1).await.unwrap();
    assert_eq!((decision.remaining, decision.answered_by), (6, by));
    let checked = limiter.quota_check("qag:q", &quota()).await.unwrap();
    assert_eq!(
        (checked.calls_remaining, checked.answered_by),
        (Some(7), by)
    );
    // 1200 counted (700 and a partial 500) and 3500 still held of 5000: 300 left.
    let admitted = limiter.admit(&scopes(), WINDOW).await.unwrap();
    assert_eq!(
        (
            admitted.requests_remaining,
            admitted.tokens_remaining,
            admitted.answered_by
        ),
        (Some(2), Some(300), by)
    );
    assert_eq!(held(raw, "qag:win:{acme}:key"), 3500);
    // The commit settles on the new node: 1600 in all, 500 paid, the hold released.
    assert_eq!(
        before.reservation.commit(1600).await.unwrap().answered_by,
        by
    );
    assert_eq!(held(raw, "qag:win:{acme}:key"), 0);
    assert_eq!(counted(raw, "qag:win:{acme}:key", "tok:"), 2300);
    assert_eq!(counted(raw, "qag:win:{acme}:key", "req:"), 3);
    assert_eq!(before.guard.release().await, Ok(true));
    assert_eq!(limiter.leases("qag:run").await, Ok(0));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_replica_with_the_module_promoted_carries_the_scripts_state_over() {
    if external("a_replica_with_the_module_promoted_carries_the_scripts_state_over") {
        return;
    }
    let primary = Server::start(&ServerOptions {
        without_module: true,
        ..Default::default()
    });
    let replica = Server::start(&ServerOptions {
        replica_of: Some(primary.port),
        ..Default::default()
    });
    wait_linked(&replica);
    let endpoint = Endpoint::to(primary.port);
    // A server found without the module is asked again after this long (the default is
    // 10 s): the calls after the move are the module's within the test.
    let options = Options {
        recheck_missing_module: Duration::from_millis(200),
        ..Options::default()
    };
    let limiter = Limiter::connect(&endpoint.url(), options).await.unwrap();
    let before = drive(&limiter, AnsweredBy::Script).await;
    // Replicated, then the replica promoted and the endpoint moved to it.
    let mut con = primary.client().get_connection().unwrap();
    let copies: i64 = cmd("WAIT").arg(1).arg(5000).query(&mut con).unwrap();
    assert_eq!(copies, 1);
    let mut raw = replica.client().get_connection().unwrap();
    let _: () = cmd("REPLICAOF")
        .arg("NO")
        .arg("ONE")
        .query(&mut raw)
        .unwrap();
    endpoint.move_to(replica.port);
    drop(primary);
    carry_on(&limiter, before, AnsweredBy::Module, &mut raw).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_node_restarted_without_the_module_carries_its_state_over() {
    if external("a_node_restarted_without_the_module_carries_its_state_over") {
        return;
    }
    let dir = std::env::temp_dir().join(format!("qag-rolling-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let with_module = ServerOptions {
        dir: Some(dir.clone()),
        extra: ["--appendonly", "yes"].map(String::from).to_vec(),
        ..Default::default()
    };
    let server = Server::start(&with_module);
    let url = format!("redis://127.0.0.1:{}/", server.port);
    let limiter = Limiter::connect(&url, Options::default()).await.unwrap();
    let before = drive(&limiter, AnsweredBy::Module).await;
    let port = server.port;
    server.shutdown();
    let server = Server::start(&ServerOptions {
        without_module: true,
        port: Some(port),
        ..with_module
    });
    let mut raw = server.client().get_connection().unwrap();
    carry_on(&limiter, before, AnsweredBy::Script, &mut raw).await;
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
}
