//! The gateway's own answers to a limited request (ADR 0032 and ADR 0011): which limit
//! refused, the status, the JSON body and its `retry-after`. Plain code, the same
//! bodies as the Python client's (both checked against `clients/shared_cases.json`).

use crate::decision::RetryAfter;

/// What refused a request, in the order the limits are asked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The caller's address spent its bucket; the key's bucket was not touched.
    Client { retry_after: RetryAfter },
    /// The API key spent its bucket.
    Key { retry_after: RetryAfter },
    /// The key's quota ran out: `exceeded` is `"calls"` or `"rows"`, `resets_at` the
    /// period's end in Unix seconds, `retry_after` the seconds until then.
    Quota {
        exceeded: &'static str,
        resets_at: i64,
        retry_after: u64,
    },
    /// Every concurrency slot of the key is held.
    Concurrency,
    /// A window chain (a model API's requests and tokens per window) has no room for the
    /// request: `exceeded` is `"requests"` (none left) or `"tokens"` (its estimate does
    /// not fit beside what is counted and held).
    Window {
        exceeded: &'static str,
        retry_after: RetryAfter,
    },
    /// Redis failed and the policy is to raise: the request cannot be counted.
    Unavailable { retry_after: u64 },
}

impl Refusal {
    /// The HTTP status: 429, or 503 when the limiter is unavailable.
    pub fn status(&self) -> u16 {
        match self {
            Refusal::Unavailable { .. } => 503,
            _ => 429,
        }
    }

    pub fn code(&self) -> &'static str {
        match self {
            Refusal::Client { .. } | Refusal::Key { .. } | Refusal::Window { .. } => "rate_limited",
            Refusal::Quota { .. } => "quota_exceeded",
            Refusal::Concurrency => "too_many_concurrent",
            Refusal::Unavailable { .. } => "limiter_unavailable",
        }
    }

    pub fn message(&self) -> &'static str {
        match self {
            Refusal::Client { .. } => "Rate limit exceeded",
            Refusal::Key { .. } => "Rate limit exceeded for this API key",
            Refusal::Quota { .. } => "Quota exceeded for this API key",
            Refusal::Concurrency => "Too many concurrent requests for this API key",
            Refusal::Window {
                exceeded: "requests",
                ..
            } => "Request rate limit exceeded",
            Refusal::Window { .. } => "Token rate limit exceeded",
            Refusal::Unavailable { .. } => "Rate limiting is unavailable",
        }
    }

    /// The `retry-after` seconds; None for a cost that can never fit.
    pub fn retry_after(&self) -> Option<u64> {
        match *self {
            Refusal::Client { retry_after }
            | Refusal::Key { retry_after }
            | Refusal::Window { retry_after, .. } => {
                retry_after.seconds().map(|seconds| seconds.max(1))
            }
            Refusal::Quota { retry_after, .. } | Refusal::Unavailable { retry_after } => {
                Some(retry_after.max(1))
            }
            Refusal::Concurrency => Some(1),
        }
    }

    /// The body: `{"error", "code", "retry_after", ["exceeded", ["resets_at",]]
    /// "request_id"}` in that order (`exceeded` for a quota and a window, `resets_at`
    /// for a quota); `retry_after` is null for a cost that never fits.
    pub fn body(&self, request_id: &str) -> String {
        let retry_after = match self.retry_after() {
            Some(seconds) => seconds.to_string(),
            None => "null".into(),
        };
        let mut body = format!(
            "{{\"error\":\"{}\",\"code\":\"{}\",\"retry_after\":{retry_after}",
            self.message(),
            self.code()
        );
        match self {
            Refusal::Quota {
                exceeded,
                resets_at,
                ..
            } => body.push_str(&format!(
                ",\"exceeded\":\"{exceeded}\",\"resets_at\":{resets_at}"
            )),
            Refusal::Window { exceeded, .. } => {
                body.push_str(&format!(",\"exceeded\":\"{exceeded}\""))
            }
            _ => {}
        }
        body.push_str(",\"request_id\":");
        push_json_string(&mut body, request_id);
        body.push('}');
        body
    }
}

/// A JSON string, escaped (a request id is the caller's text).
fn push_json_string(out: &mut String, text: &str) {
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_name_the_refusing_limit_in_a_fixed_order() {
        let client = Refusal::Client {
            retry_after: RetryAfter::Seconds(3),
        };
        assert_eq!(
            client.body("r-1"),
            r#"{"error":"Rate limit exceeded","code":"rate_limited","retry_after":3,"request_id":"r-1"}"#
        );
        let never = Refusal::Key {
            retry_after: RetryAfter::Never,
        };
        assert_eq!(never.retry_after(), None);
        assert!(never.body("x").contains(r#""retry_after":null"#));
        let quota = Refusal::Quota {
            exceeded: "calls",
            resets_at: 1_800_000_000,
            retry_after: 600,
        };
        assert_eq!(
            quota.body("q\"1\n"),
            r#"{"error":"Quota exceeded for this API key","code":"quota_exceeded","retry_after":600,"exceeded":"calls","resets_at":1800000000,"request_id":"q\"1\u000a"}"#
        );
        assert_eq!(
            (
                Refusal::Concurrency.status(),
                Refusal::Concurrency.retry_after()
            ),
            (429, Some(1))
        );
        assert_eq!(Refusal::Unavailable { retry_after: 5 }.status(), 503);
    }
}
