//! How the module writes numbers into hash fields: the shortest decimal text that reads
//! back as the same f64, with no heap allocation, so the script and the module read
//! exactly what the other wrote.

/// Formats a finite `value` into `buffer`; whole numbers lose their ".0", as Redis
/// writes a Lua number (e.g. `59`, `1764441000.123456`, `1e16`).
pub fn format_number(buffer: &mut ryu::Buffer, value: f64) -> &str {
    let text = buffer.format_finite(value);
    text.strip_suffix(".0").unwrap_or(text)
}

/// Reads a count the module stored (calls, rows, requests, tokens): a non-negative
/// integer; a missing or unreadable field counts as 0.
pub fn stored_count(bytes: Option<&[u8]>) -> i64 {
    bytes
        .and_then(crate::args::parse_integer)
        .filter(|n| *n >= 0)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn familiar_values() {
        let mut b = ryu::Buffer::new();
        assert_eq!(format_number(&mut b, 59.0), "59");
        assert_eq!(format_number(&mut b, 0.0), "0");
        assert_eq!(format_number(&mut b, 2.5), "2.5");
        assert_eq!(
            format_number(&mut b, 1_764_441_000.123456),
            "1764441000.123456"
        );
        assert_eq!(
            format_number(&mut b, 9007199254740992.0),
            "9007199254740992"
        );
    }

    #[test]
    fn stored_counts() {
        assert_eq!(stored_count(Some(b"12")), 12);
        assert_eq!(stored_count(Some(b"-3")), 0);
        assert_eq!(stored_count(Some(b"1.5")), 0);
        assert_eq!(stored_count(None), 0);
    }

    proptest! {
        #[test]
        fn reads_back_exactly(v in proptest::num::f64::NORMAL | proptest::num::f64::SUBNORMAL | proptest::num::f64::ZERO) {
            let mut b = ryu::Buffer::new();
            let text = format_number(&mut b, v);
            prop_assert_eq!(text.parse::<f64>().unwrap(), v);
            prop_assert_eq!(crate::bucket::parse_field(text.as_bytes()), Some(v));
        }
    }
}
