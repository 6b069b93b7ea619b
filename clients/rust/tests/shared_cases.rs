//! The cases both clients must agree on (clients/shared_cases.json): bucket names,
//! header fields, and local bucket arithmetic, the last checked against qag-core.

use qag_client::answers::Refusal;
use qag_client::decision::{
    Admission, AnsweredBy, Decision, LeaseRefusal, QuotaDecision, QuotaUsage, Scope,
};
use qag_client::local::LocalBuckets;
use qag_client::{bucket_key, Headers, RetryAfter};
use serde_json::Value;
use std::time::Duration;

fn cases() -> Value {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../shared_cases.json");
    serde_json::from_str(&std::fs::read_to_string(path).expect("read the shared cases"))
        .expect("the shared cases are JSON")
}

fn u64_of(value: &Value) -> u64 {
    value.as_u64().expect("a non-negative integer")
}

fn optional_u64(value: &Value) -> Option<u64> {
    value.as_u64()
}

fn answered_by(value: &Value) -> AnsweredBy {
    match value["answered_by"].as_str() {
        None | Some("module") => AnsweredBy::Module,
        Some("forwarded") => AnsweredBy::Forwarded,
        Some(other) => panic!("answered_by {other}"),
    }
}

fn bucket(value: &Value) -> Option<Decision> {
    value.as_object()?;
    Some(Decision {
        allowed: value["allowed"].as_bool().unwrap(),
        limit: u64_of(&value["limit"]),
        period: value["period"].as_f64().unwrap(),
        remaining: u64_of(&value["remaining"]),
        retry_after: RetryAfter::from_reply(value["retry_after"].as_i64().unwrap()).unwrap(),
        answered_by: answered_by(value),
        waited: Duration::from_millis(value["waited_ms"].as_u64().unwrap_or(0)),
    })
}

/// A window chain: its scopes, QAG.ADMIT's answer and the window's seconds.
fn window(value: &Value) -> Option<(Vec<Scope>, Admission, Option<u32>)> {
    value.as_object()?;
    let scopes = value["scopes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|scope| Scope {
            key: scope[0].as_str().unwrap().to_owned(),
            rpm: u64_of(&scope[1]),
            tpm: u64_of(&scope[2]),
        })
        .collect();
    let admission = &value["admission"];
    let admission = Admission {
        admitted: admission["admitted"].as_bool().unwrap(),
        refused_by: admission["refused_by"].as_u64().map(|index| index as usize),
        retry_after: RetryAfter::Seconds(u64_of(&admission["retry_after"])),
        requests_remaining: optional_u64(&admission["requests_remaining"]),
        tokens_remaining: optional_u64(&admission["tokens_remaining"]),
        answered_by: answered_by(admission),
    };
    let seconds = value["seconds"].as_u64().map(|seconds| seconds as u32);
    Some((scopes, admission, seconds))
}

fn quota(value: &Value) -> Option<QuotaDecision> {
    value.as_object()?;
    Some(QuotaDecision {
        allowed: value["allowed"].as_bool().unwrap(),
        calls_limit: optional_u64(&value["calls_limit"]),
        calls_remaining: optional_u64(&value["calls_remaining"]),
        rows_limit: optional_u64(&value["rows_limit"]),
        rows_remaining: optional_u64(&value["rows_remaining"]),
        resets_at: value["resets_at"].as_i64().unwrap(),
        answered_by: AnsweredBy::Module,
    })
}

fn usage(value: &Value) -> Option<QuotaUsage> {
    value.as_object()?;
    Some(QuotaUsage {
        calls: u64_of(&value["calls"]),
        rows: u64_of(&value["rows"]),
        resets_at: value["resets_at"].as_i64().unwrap(),
        answered_by: AnsweredBy::Module,
    })
}

fn lease(value: &Value) -> Option<LeaseRefusal> {
    value.as_object()?;
    Some(LeaseRefusal {
        live: u64_of(&value["live"]),
        retry_after: RetryAfter::Seconds(u64_of(&value["retry_after"])),
        answered_by: AnsweredBy::Module,
        waited: Duration::ZERO,
    })
}

#[test]
fn bucket_names() {
    let cases = cases();
    for case in cases["bucket_keys"].as_array().unwrap() {
        let name = bucket_key(
            case["scope"].as_str().unwrap(),
            u64_of(&case["count"]),
            case["period"].as_f64().unwrap(),
            case["client"].as_str().unwrap(),
            case["hash_tag"].as_str(),
        );
        assert_eq!(name, case["key"].as_str().unwrap());
    }
}

#[test]
fn header_fields() {
    let cases = cases();
    for case in cases["headers"].as_array().unwrap() {
        let (client, key) = (bucket(&case["client"]), bucket(&case["key"]));
        let quota = quota(&case["quota"]).map(|quota| match usage(&case["quota_usage"]) {
            Some(usage) => quota.after_add(&usage),
            None => quota,
        });
        let lease = lease(&case["lease"]);
        let window = window(&case["window"]);
        let mut request = match case["now_ms"].as_i64() {
            Some(now) => Headers::new().now_millis(now),
            None => Headers::new().now(case["now"].as_i64().unwrap()),
        };
        if let Some(client) = &client {
            request = request.client(client);
        }
        if let Some(key) = &key {
            request = request.key(key);
        }
        if let Some(quota) = &quota {
            request = request.quota(quota);
        }
        if let Some(slots) = case["slots"].as_object() {
            request = request.slots(u64_of(&slots["max"]), u64_of(&slots["live"]));
        }
        if let Some(lease) = &lease {
            request = request.lease_refused(lease);
        }
        if let Some((scopes, admission, seconds)) = &window {
            request = request.window(scopes, admission, *seconds);
        }
        if let Some(waited) = case["slot_waited_ms"].as_u64() {
            request = request.slot_waited(Duration::from_millis(waited));
        }
        if case["draft"] == Value::Bool(false) {
            request = request.without_draft();
        }
        let fields = request.fields();
        // Every name is a valid lowercase header name: from_static would panic otherwise.
        let map = request.header_map();
        assert_eq!(map.len(), fields.len(), "{}", case["name"]);
        let expected: Vec<(String, String)> = case["headers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|pair| {
                (
                    pair[0].as_str().unwrap().to_owned(),
                    pair[1].as_str().unwrap().to_owned(),
                )
            })
            .collect();
        let actual: Vec<(String, String)> = fields
            .into_iter()
            .map(|(name, value)| (name.to_owned(), value))
            .collect();
        assert_eq!(actual, expected, "{}", case["name"]);
    }
}

#[test]
fn local_bucket_arithmetic() {
    let cases = cases();
    for case in cases["local_buckets"].as_array().unwrap() {
        let limit = qag_core::bucket::Limit {
            count: case["count"].as_f64().unwrap(),
            period: case["period"].as_f64().unwrap(),
        };
        let mut local = LocalBuckets::default();
        for step in case["steps"].as_array().unwrap() {
            let verdict = local.take(
                "k",
                limit,
                step["cost"].as_i64().unwrap(),
                step["now"].as_f64().unwrap(),
            );
            let expected: Vec<i64> = step["reply"]
                .as_array()
                .unwrap()
                .iter()
                .map(|n| n.as_i64().unwrap())
                .collect();
            assert_eq!(
                verdict.as_reply().to_vec(),
                expected,
                "{} {step}",
                case["name"]
            );
        }
    }
}

#[test]
fn refusal_answers() {
    let cases = cases();
    for case in cases["answers"].as_array().unwrap() {
        let refusal = &case["refusal"];
        let seconds = || refusal["retry_after"].as_i64().unwrap();
        let refusal = match refusal["kind"].as_str().unwrap() {
            "client" => Refusal::Client {
                retry_after: RetryAfter::from_reply(seconds()).unwrap(),
            },
            "key" => Refusal::Key {
                retry_after: RetryAfter::from_reply(seconds()).unwrap(),
            },
            "quota" => Refusal::Quota {
                exceeded: if refusal["exceeded"] == "calls" {
                    "calls"
                } else {
                    "rows"
                },
                resets_at: refusal["resets_at"].as_i64().unwrap(),
                retry_after: seconds() as u64,
            },
            "concurrency" => Refusal::Concurrency,
            "window" => Refusal::Window {
                exceeded: if refusal["exceeded"] == "requests" {
                    "requests"
                } else {
                    "tokens"
                },
                retry_after: RetryAfter::from_reply(seconds()).unwrap(),
            },
            "unavailable" => Refusal::Unavailable {
                retry_after: seconds() as u64,
            },
            other => panic!("kind {other}"),
        };
        let name = &case["name"];
        assert_eq!(
            refusal.status(),
            case["status"].as_u64().unwrap() as u16,
            "{name}"
        );
        assert_eq!(
            refusal.retry_after().map(|s| s.to_string()).as_deref(),
            case["retry_after"].as_str(),
            "{name}"
        );
        let body = refusal.body(case["request_id"].as_str().unwrap());
        assert_eq!(body, case["body"].as_str().unwrap(), "{name}");
        // The body is JSON, with the request id as given.
        let parsed: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(parsed["request_id"], case["request_id"], "{name}");
    }
}

/// The calendar periods given to lua/quota.lua: qag-core's, the module's own.
#[test]
fn quota_periods() {
    let cases = cases();
    for case in cases["quota_periods"].as_array().unwrap() {
        let per = match case["per"].as_str().unwrap() {
            "day" => qag_core::quota::Per::Day,
            _ => qag_core::quota::Per::Month,
        };
        let zone = qag_core::quota::zone(case["tz"].as_str().unwrap().as_bytes()).unwrap();
        let now = case["now"].as_i64().unwrap() * 1_000_000;
        let period = qag_core::quota::period(per, &zone, now).unwrap();
        let found = (period.label.as_str(), period.start, period.end);
        let expected = (
            case["label"].as_str().unwrap(),
            case["start"].as_i64().unwrap(),
            case["end"].as_i64().unwrap(),
        );
        assert_eq!(found, expected, "{case}");
    }
}
