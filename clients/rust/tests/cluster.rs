//! Redis Cluster through the async cluster connection: hash-tagged pairs by the module,
//! and without the module the script, loaded where it runs.

#[path = "../../../tests/common/mod.rs"]
mod common;

use common::*;
use qag_client::{bucket_key, AnsweredBy, Bucket, Limiter};

async fn cluster_limiter(nodes: &[Server]) -> Limiter<redis::cluster_async::ClusterConnection> {
    let urls: Vec<String> = nodes
        .iter()
        .map(|node| format!("redis://127.0.0.1:{}/", node.port))
        .collect();
    let client = redis::cluster::ClusterClient::new(urls).expect("cluster client");
    Limiter::new(
        client
            .get_async_connection()
            .await
            .expect("connect the cluster"),
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn tagged_pairs_by_module_and_by_script_across_the_cluster() {
    if external("tagged_pairs_by_module_and_by_script_across_the_cluster") {
        return;
    }
    for without_module in [false, true] {
        let nodes = start_cluster(&ServerOptions {
            without_module,
            ..Default::default()
        });
        let limiter = cluster_limiter(&nodes).await;
        let expected = if without_module {
            AnsweredBy::Script
        } else {
            AnsweredBy::Module
        };
        let mut nodes_used = std::collections::BTreeSet::new();
        for tenant in 0..12 {
            let tag = format!("tenant{tenant}");
            let client = bucket_key("ip", 2, 60.0, "203.0.113.9", Some(&tag));
            let key = bucket_key("key", 60, 60.0, "partner", Some(&tag));
            for n in 0..3 {
                let pair = limiter
                    .take_pair(
                        &Bucket::with_key(&client, 2, 60.0),
                        &Bucket::with_key(&key, 60, 60.0),
                        1,
                    )
                    .await
                    .unwrap();
                assert_eq!(pair.answered_by(), expected);
                assert_eq!(pair.allowed(), n < 2, "{client} call {n}");
            }
            let owner = nodes
                .iter()
                .position(|node| {
                    let mut con = node.client().get_connection().unwrap();
                    // Other nodes answer MOVED.
                    matches!(cmd("EXISTS").arg(&key).query::<i64>(&mut con), Ok(1))
                })
                .expect("a node holds the key bucket");
            nodes_used.insert(owner);
            if without_module {
                let mut con = nodes[owner].client().get_connection().unwrap();
                let sha = load_script(&mut con);
                let _: () = cmd("SCRIPT").arg("FLUSH").query(&mut con).unwrap();
                // Flushed on the owner: the next call loads it there again.
                let decision = limiter
                    .take(&Bucket::with_key(&client, 2, 60.0), 1)
                    .await
                    .unwrap();
                assert_eq!(decision.answered_by, AnsweredBy::Script);
                let loaded: Vec<bool> = cmd("SCRIPT")
                    .arg("EXISTS")
                    .arg(&sha)
                    .query(&mut con)
                    .unwrap();
                assert_eq!(loaded, vec![true]);
            }
        }
        assert_eq!(nodes_used.len(), 3, "the tags spread over every node");
    }
}
