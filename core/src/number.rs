//! How the module writes numbers into hash fields: the shortest decimal text that reads
//! back as the same f64, with no heap allocation, so the script and the module read
//! exactly what the other wrote.

/// Room for one number's text: ryu's for any f64, or a whole number or a decimal of at
/// most six places written directly.
pub struct NumberBuffer {
    digits: [u8; 24],
    ryu: ryu::Buffer,
}

impl NumberBuffer {
    pub fn new() -> NumberBuffer {
        NumberBuffer {
            digits: [0; 24],
            ryu: ryu::Buffer::new(),
        }
    }
}

impl Default for NumberBuffer {
    fn default() -> Self {
        NumberBuffer::new()
    }
}

/// Formats a finite `value` into `buffer`; whole numbers lose their ".0", as Redis
/// writes a Lua number (e.g. `59`, `1764441000.123456`, `1e16`).
///
/// What a bucket stores is mostly a whole number of tokens and a time of whole
/// microseconds: those are written from their integer digits (a tenth of ryu's cost),
/// and only where that is the very text ryu gives (see `whole_or_micros`).
pub fn format_number(buffer: &mut NumberBuffer, value: f64) -> &str {
    if let Some(start) = whole_or_micros(&mut buffer.digits, value) {
        // SAFETY: whole_or_micros writes ASCII digits and a dot only.
        return unsafe { std::str::from_utf8_unchecked(&buffer.digits[start..]) };
    }
    let text = buffer.ryu.format_finite(value);
    text.strip_suffix(".0").unwrap_or(text)
}

/// A number as the scripts' Lua 5.1 reads text with `tonumber` (its `luaO_str2d`): C's
/// strtod on the text up to its first NUL (a C string: decimal or hexadecimal, `inf`,
/// `nan`), C's blanks (space, `\t`, `\n`, `\v`, `\f`, `\r`) before and after it, nothing
/// else after; where strtod stops at an `x`, strtoul's hexadecimal instead. None where
/// it reads no number. Only for text that is not a plain decimal: it copies the text.
pub fn c_number(bytes: &[u8]) -> Option<f64> {
    let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    let text = std::ffi::CString::new(&bytes[..end]).ok()?;
    let start = text.as_ptr();
    let mut stop: *mut std::ffi::c_char = std::ptr::null_mut();
    // SAFETY: a NUL-terminated string; strtod sets `stop` within it.
    let mut value = unsafe { libc::strtod(start, &mut stop) };
    let mut read = stop as usize - start as usize;
    if read == 0 {
        return None;
    }
    if matches!(bytes.get(read), Some(b'x' | b'X')) {
        // SAFETY: as above.
        value = unsafe { libc::strtoul(start, &mut stop, 16) } as f64;
        read = stop as usize - start as usize;
    }
    let blank = |b: &u8| matches!(b, b' ' | b'\t' | b'\n' | 0x0b | 0x0c | b'\r');
    bytes[read..end].iter().all(blank).then_some(value)
}

/// Formats `n` in decimal into `buffer`.
pub fn format_integer(buffer: &mut NumberBuffer, n: u64) -> &str {
    let end = buffer.digits.len();
    let start = write_digits(&mut buffer.digits, end, n);
    // SAFETY: write_digits writes ASCII digits only.
    unsafe { std::str::from_utf8_unchecked(&buffer.digits[start..]) }
}

/// Formats `n` in decimal into `buffer`, a minus first when negative.
pub fn format_signed(buffer: &mut NumberBuffer, n: i64) -> &str {
    let end = buffer.digits.len();
    let mut start = write_digits(&mut buffer.digits, end, n.unsigned_abs());
    if n < 0 {
        start -= 1;
        buffer.digits[start] = b'-';
    }
    // SAFETY: ASCII digits and a minus only.
    unsafe { std::str::from_utf8_unchecked(&buffer.digits[start..]) }
}

/// Below 2^53 every whole f64 is exact, and ryu writes its digits (then ".0").
const WHOLE_LIMIT: f64 = 9_007_199_254_740_992.0;
/// Below 2^32 the gap between two f64 is under a microsecond, so at most one number of
/// six decimal places rounds to a given f64; from 10^-5 on, ryu writes a fraction
/// without an exponent.
const MICROS_LIMIT: (f64, f64) = (1e-5, 4_294_967_296.0);

/// Writes `value` at the end of `out` as ryu would (without ".0") when it is a whole
/// number below 2^53, or the f64 nearest to a number of at most six decimal places
/// from 10^-5 to 2^32; returns where the text starts, None for any other value.
///
/// For a decimal: let N be value × 10^6 rounded. The decimal N / 10^6 is the shortest
/// text that reads back as `value` when `value` is the f64 nearest to it, checked
/// exactly in integers: `value` = M / 2^k, and |M·10^6 − N·2^k| must be under half a
/// unit in the last place (10^6 / 2 in these units; a quarter below a power of two,
/// where the next f64 down is nearer). Then N / 10^6 is inside the interval of reals
/// that round to `value`, which is narrower than 10^-6 below 2^32, so no other text of
/// six places or fewer is in it, and ryu's shortest is N / 10^6 with its trailing zeros
/// dropped. Any other value goes to ryu.
fn whole_or_micros(out: &mut [u8; 24], value: f64) -> Option<usize> {
    if value.is_nan() || value.is_sign_negative() {
        return None;
    }
    if value < WHOLE_LIMIT && value.fract() == 0.0 {
        return Some(write_digits(out, out.len(), value as u64));
    }
    if !(MICROS_LIMIT.0..MICROS_LIMIT.1).contains(&value) {
        return None;
    }
    let micros = (value * 1e6).round() as u64;
    let bits = value.to_bits();
    let mantissa = (bits & ((1 << 52) - 1)) | (1 << 52);
    // value = mantissa / 2^shift; from 10^-5 to 2^32 the shift is 21 to 69.
    let shift = 1075 - ((bits >> 52) & 0x7ff) as u32;
    let off = (i128::from(mantissa) * 1_000_000) - (i128::from(micros) << shift);
    let half_ulp = match mantissa == 1 << 52 {
        true if off > 0 => 250_000,
        _ => 500_000,
    };
    if off.abs() >= half_ulp {
        return None;
    }
    let (whole, mut fraction) = (micros / 1_000_000, micros % 1_000_000);
    if fraction == 0 {
        // Only a whole value has no fraction, and that was written above.
        return None;
    }
    let mut places = 6;
    while fraction % 10 == 0 {
        fraction /= 10;
        places -= 1;
    }
    let dot = write_digits_exactly(out, out.len(), fraction, places) - 1;
    out[dot] = b'.';
    Some(write_digits(out, dot, whole))
}

/// "00" to "99", so that digits are written two at a time.
const DIGIT_PAIRS: &[u8; 200] = b"\
    0001020304050607080910111213141516171819202122232425262728293031323334353637383940414243444546474849\
    5051525354555657585960616263646566676869707172737475767778798081828384858687888990919293949596979899";

/// Writes `n` in decimal so that it ends before `end`; returns where it starts.
fn write_digits(out: &mut [u8; 24], end: usize, mut n: u64) -> usize {
    let mut at = end;
    while n >= 10 {
        let pair = (n % 100) as usize * 2;
        n /= 100;
        at -= 2;
        out[at..at + 2].copy_from_slice(&DIGIT_PAIRS[pair..pair + 2]);
    }
    if n > 0 || at == end {
        at -= 1;
        out[at] = b'0' + n as u8;
    }
    at
}

/// Writes `n` as exactly `places` digits (leading zeros) ending before `end`.
fn write_digits_exactly(out: &mut [u8; 24], end: usize, mut n: u64, places: usize) -> usize {
    for at in (end - places..end).rev() {
        out[at] = b'0' + (n % 10) as u8;
        n /= 10;
    }
    end - places
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
    use crate::bucket::seconds_from_micros;
    use proptest::prelude::*;

    /// The text before the fast path: ryu's, without ".0".
    fn ryu_text(value: f64) -> String {
        let mut b = ryu::Buffer::new();
        let text = b.format_finite(value);
        text.strip_suffix(".0").unwrap_or(text).to_owned()
    }

    /// Same text as ryu's, and it reads back as the same f64, through the module's
    /// reader of stored fields (what the script's tonumber gives).
    fn check(value: f64) -> Result<(), TestCaseError> {
        let mut b = NumberBuffer::new();
        let text = format_number(&mut b, value);
        prop_assert_eq!(text, ryu_text(value), "for {:e}", value);
        prop_assert_eq!(text.parse::<f64>().unwrap().to_bits(), value.to_bits());
        prop_assert_eq!(
            crate::bucket::parse_field(text.as_bytes()).map(f64::to_bits),
            Some(value.to_bits())
        );
        Ok(())
    }

    #[test]
    fn familiar_values() {
        let mut b = NumberBuffer::new();
        assert_eq!(format_number(&mut b, 59.0), "59");
        assert_eq!(format_number(&mut b, 0.0), "0");
        assert_eq!(format_number(&mut b, -0.0), "-0");
        assert_eq!(format_number(&mut b, 2.5), "2.5");
        assert_eq!(format_number(&mut b, 0.000012), "0.000012");
        assert_eq!(format_number(&mut b, 0.000001), "1e-6");
        assert_eq!(
            format_number(&mut b, 1_764_441_000.123456),
            "1764441000.123456"
        );
        assert_eq!(format_number(&mut b, 1_764_441_000.1), "1764441000.1");
        assert_eq!(
            format_number(&mut b, 9007199254740992.0),
            "9007199254740992"
        );
        assert_eq!(format_number(&mut b, 1e16), "1e16");
        assert_eq!(
            format_number(&mut b, 58.983333333333334),
            "58.983333333333334"
        );
    }

    /// Every microsecond of whole seconds around where the f64 gap changes (2^30, 2^31,
    /// 2^32) and of today's clock, as `seconds_from_micros` makes them, plus every
    /// decimal of six places below 8 and the whole numbers below 10^6.
    #[test]
    fn exhaustive_micros_and_wholes() {
        let seconds = [
            0,
            1,
            7,
            (1 << 30) - 1,
            1 << 30,
            1_764_441_000,
            (1 << 31) - 1,
            1 << 31,
            4_102_444_800,
            (1 << 32) - 1,
            1 << 32,
        ];
        for s in seconds {
            for micros in 0..1_000_000 {
                check(seconds_from_micros(s * 1_000_000 + micros)).unwrap();
            }
        }
        for n in 0..8_000_000 {
            check(n as f64 / 1e6).unwrap();
        }
        for n in 0..1_000_000 {
            check(n as f64).unwrap();
        }
    }

    /// The fast path is taken for what a bucket stores: whole tokens, clock times.
    #[test]
    fn clock_times_and_whole_tokens_skip_ryu() {
        let mut out = [0u8; 24];
        for micros in 0..1_000_000 {
            let ts = seconds_from_micros(1_764_441_000_000_000 + micros);
            assert!(whole_or_micros(&mut out, ts).is_some(), "{ts}");
        }
        assert!(whole_or_micros(&mut out, 59.0).is_some());
        assert!(whole_or_micros(&mut out, 58.983333333333334).is_none());
    }

    #[test]
    fn integers_as_display() {
        let mut b = NumberBuffer::new();
        for n in (0..100_000).chain([u64::MAX, u64::MAX / 10, 1 << 63, 1_700_000_000_123_456_789]) {
            assert_eq!(format_integer(&mut b, n), n.to_string());
        }
    }

    #[test]
    fn stored_counts() {
        assert_eq!(stored_count(Some(b"12")), 12);
        assert_eq!(stored_count(Some(b"-3")), 0);
        assert_eq!(stored_count(Some(b"1.5")), 0);
        assert_eq!(stored_count(None), 0);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(20_000))]

        #[test]
        fn reads_back_exactly(v in proptest::num::f64::NORMAL | proptest::num::f64::SUBNORMAL | proptest::num::f64::ZERO) {
            check(v)?;
        }

        #[test]
        fn clock_times_as_ryu(micros in 0i64..(1 << 33) * 1_000_000) {
            check(seconds_from_micros(micros))?;
        }

        #[test]
        fn any_signed_integer_as_display(n in any::<i64>()) {
            let mut b = NumberBuffer::new();
            prop_assert_eq!(format_signed(&mut b, n), n.to_string());
        }

        #[test]
        fn any_integer_as_display(n in any::<u64>()) {
            let mut b = NumberBuffer::new();
            prop_assert_eq!(format_integer(&mut b, n), n.to_string());
        }

        #[test]
        fn whole_numbers_as_ryu(n in 0u64..(1 << 54)) {
            check(n as f64)?;
        }

        #[test]
        fn fractions_as_ryu(v in 0.0f64..5e9, places in 0i32..9) {
            let scale = 10f64.powi(places);
            check((v * scale).round() / scale)?;
            check(v)?;
        }

        #[test]
        fn near_powers_of_two(exp in -20i32..34, ulps in -4i64..4) {
            let v = f64::from_bits((2f64.powi(exp).to_bits() as i64 + ulps) as u64);
            check(v)?;
        }
    }
}
