//! Bucket names as the gateway writes them, so that the crate and the gateway's Python
//! control plane count into the same keys.

/// The key of a token bucket: `qag:ratelimit:<scope>:<count>/<period>:<client>`, the
/// period written as Python's `format(period, 'g')` writes it (`60`, `0.5`, `1e+20`).
/// With a `hash_tag`, `qag:ratelimit:{<tag>}:<scope>:...`: give a request's two buckets
/// the same tag so that QAG.TAKE2 finds them in one cluster slot.
pub fn bucket_key(
    scope: &str,
    count: u64,
    period: f64,
    client: &str,
    hash_tag: Option<&str>,
) -> String {
    let period = format_g(period);
    match hash_tag {
        Some(tag) => format!("qag:ratelimit:{{{tag}}}:{scope}:{count}/{period}:{client}"),
        None => format!("qag:ratelimit:{scope}:{count}/{period}:{client}"),
    }
}

/// A token bucket described once: its key and its limit, `count` tokens refilled per
/// `period` seconds, so a key's name and its limit cannot drift apart.
#[derive(Clone, Debug, PartialEq)]
pub struct Bucket {
    key: String,
    count: u64,
    period: f64,
}

impl Bucket {
    /// The bucket of `name` (an address, or `<workspace>~<name>` for a key) under ADR
    /// 0032's name: `qag:ratelimit:<scope>:<count>/<period>:<name>`.
    pub fn named(scope: &str, count: u64, period: f64, name: &str) -> Bucket {
        Bucket {
            key: bucket_key(scope, count, period, name, None),
            count,
            period,
        }
    }

    /// A bucket at a key of the caller's choice.
    pub fn with_key(key: impl Into<String>, count: u64, period: f64) -> Bucket {
        Bucket {
            key: key.into(),
            count,
            period,
        }
    }

    pub fn key(&self) -> &str {
        &self.key
    }

    pub fn count(&self) -> u64 {
        self.count
    }

    pub fn period(&self) -> f64 {
        self.period
    }
}

/// Python's `format(value, 'g')`: six significant digits, scientific notation when the
/// exponent is below -4 or at least 6, trailing zeros removed, an exponent of at least
/// two digits with its sign.
pub fn format_g(value: f64) -> String {
    if value.is_nan() {
        return "nan".into();
    }
    if value.is_infinite() {
        return if value > 0.0 { "inf" } else { "-inf" }.into();
    }
    if value == 0.0 {
        return if value.is_sign_negative() { "-0" } else { "0" }.into();
    }
    // Rounded to six significant digits first: the exponent that picks the notation is
    // the rounded one (999999.5 is written 1e+06), as in Python.
    let scientific = format!("{value:.5e}");
    let (mantissa, exponent) = scientific
        .split_once('e')
        .expect("{:e} always writes an exponent");
    let exponent: i32 = exponent.parse().expect("{:e} writes a decimal exponent");
    if (-4..6).contains(&exponent) {
        let decimals = (5 - exponent) as usize;
        strip_zeros(&format!("{value:.decimals$}")).to_string()
    } else {
        let sign = if exponent < 0 { '-' } else { '+' };
        format!("{}e{sign}{:02}", strip_zeros(mantissa), exponent.abs())
    }
}

fn strip_zeros(number: &str) -> &str {
    if number.contains('.') {
        number.trim_end_matches('0').trim_end_matches('.')
    } else {
        number
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn periods_are_written_as_python_writes_them() {
        // Each pair checked with CPython 3.11's format(value, 'g').
        let cases: &[(f64, &str)] = &[
            (60.0, "60"),
            (1.0, "1"),
            (0.5, "0.5"),
            (3600.0, "3600"),
            (86400.0, "86400"),
            (123456.0, "123456"),
            (999999.0, "999999"),
            (999999.5, "1e+06"),
            (1e6, "1e+06"),
            (1234567.0, "1.23457e+06"),
            (1e20, "1e+20"),
            (1e10, "1e+10"),
            (0.1, "0.1"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (0.000001, "1e-06"),
            (1.5e-7, "1.5e-07"),
            (2.5, "2.5"),
            (0.123456789, "0.123457"),
            (12.3456789, "12.3457"),
            (1e100, "1e+100"),
            (1e-100, "1e-100"),
            (0.0, "0"),
            (-2.0, "-2"),
        ];
        for (value, expected) in cases {
            assert_eq!(format_g(*value), *expected, "format({value:?}, 'g')");
        }
    }

    #[test]
    fn bucket_keys_with_and_without_a_hash_tag() {
        assert_eq!(
            bucket_key("key", 60, 60.0, "default~partner", None),
            "qag:ratelimit:key:60/60:default~partner"
        );
        assert_eq!(
            bucket_key("ip", 10, 0.5, "203.0.113.9", Some("acme")),
            "qag:ratelimit:{acme}:ip:10/0.5:203.0.113.9"
        );
    }
}
