//! The one argument parser every command uses: a cursor over the command's arguments
//! that reads keys, bounded numbers and options, and names the offending argument in
//! its error. It reads bytes through `ArgList`, so the module hands it Redis's strings
//! without copying and tests hand it plain slices.

use std::fmt;

/// A command's arguments, the command name at index 0.
pub trait ArgList {
    fn len(&self) -> usize;
    fn get(&self, index: usize) -> &[u8];
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl ArgList for [&[u8]] {
    fn len(&self) -> usize {
        <[&[u8]]>::len(self)
    }
    fn get(&self, index: usize) -> &[u8] {
        self[index]
    }
}

/// Why a command's arguments were refused. Its `Display` is the whole error reply.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ArgError {
    /// The command was given too few or too many arguments.
    Arity,
    /// `name` is not an integer within `min..=max`.
    Integer {
        name: &'static str,
        min: i64,
        max: i64,
    },
    /// `name` is not a finite decimal number within `min..=max`.
    Number {
        name: &'static str,
        min: &'static str,
        max: &'static str,
    },
    /// A word where an option was expected that is none of `expected`.
    UnknownOption { expected: &'static str },
    /// The same option twice.
    RepeatedOption { name: &'static str },
    /// Arguments that are each well formed but do not fit together; the text says how.
    Invalid(&'static str),
    /// A string argument `name` that breaks its `rule`.
    Text {
        name: &'static str,
        rule: &'static str,
    },
}

impl fmt::Display for ArgError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ArgError::Arity => write!(f, "ERR wrong number of arguments"),
            ArgError::Integer { name, min, max } => {
                write!(f, "ERR {name} must be an integer from {min} to {max}")
            }
            ArgError::Number { name, min, max } => {
                write!(f, "ERR {name} must be a number from {min} to {max}")
            }
            ArgError::UnknownOption { expected } => {
                write!(f, "ERR syntax error: expected {expected}")
            }
            ArgError::Text { name, rule } => write!(f, "ERR {name} must be {rule}"),
            ArgError::RepeatedOption { name } => write!(f, "ERR {name} given more than once"),
            ArgError::Invalid(message) => write!(f, "ERR {message}"),
        }
    }
}

/// A cursor over a command's arguments, starting after the command name.
pub struct Args<'a, L: ArgList + ?Sized> {
    list: &'a L,
    next: usize,
}

impl<'a, L: ArgList + ?Sized> Args<'a, L> {
    pub fn new(list: &'a L) -> Self {
        Args { list, next: 1 }
    }

    /// Arguments not read yet.
    pub fn remaining(&self) -> usize {
        self.list.len().saturating_sub(self.next)
    }

    /// The argument `ahead` places after the next one to read (0: the next), unread.
    pub fn ahead(&self, ahead: usize) -> Option<&'a [u8]> {
        let index = self.next.checked_add(ahead)?;
        (index < self.list.len()).then(|| self.list.get(index))
    }

    /// Fails with `Arity` unless the call has `min..=max` arguments after its name.
    pub fn expect_count(&self, min: usize, max: usize) -> Result<(), ArgError> {
        let n = self.remaining();
        if n < min || n > max {
            return Err(ArgError::Arity);
        }
        Ok(())
    }

    fn take(&mut self) -> Result<(usize, &'a [u8]), ArgError> {
        if self.next >= self.list.len() {
            return Err(ArgError::Arity);
        }
        let index = self.next;
        self.next += 1;
        Ok((index, self.list.get(index)))
    }

    /// The bytes of argument `index`, as read already.
    pub fn bytes(&self, index: usize) -> &'a [u8] {
        self.list.get(index)
    }

    /// A string argument, any bytes: its index and its bytes.
    pub fn string_and_bytes(&mut self) -> Result<(usize, &'a [u8]), ArgError> {
        self.take()
    }

    /// A string argument, any bytes: returns its index, so the module can hand the
    /// server's own string on without copying it.
    pub fn string(&mut self) -> Result<usize, ArgError> {
        self.take().map(|(index, _)| index)
    }

    /// A key: returns its index, which the module uses to open it.
    pub fn key(&mut self) -> Result<usize, ArgError> {
        self.string()
    }

    /// An integer from `min` to `max`.
    pub fn integer(&mut self, name: &'static str, min: i64, max: i64) -> Result<i64, ArgError> {
        let (_, bytes) = self.take()?;
        parse_integer(bytes)
            .filter(|v| (min..=max).contains(v))
            .ok_or(ArgError::Integer { name, min, max })
    }

    /// A finite number from `min` to `max`; the bounds are also given as text for the
    /// error message.
    pub fn number(
        &mut self,
        name: &'static str,
        (min, min_text): (f64, &'static str),
        (max, max_text): (f64, &'static str),
    ) -> Result<f64, ArgError> {
        let (_, bytes) = self.take()?;
        parse_number(bytes)
            .filter(|v| *v >= min && *v <= max)
            .ok_or(ArgError::Number {
                name,
                min: min_text,
                max: max_text,
            })
    }

    /// The next option word, matched case-insensitively against `options`; returns its
    /// position in `options`, or None when every argument has been read.
    pub fn option(
        &mut self,
        options: &[&'static str],
        expected: &'static str,
    ) -> Result<Option<usize>, ArgError> {
        if self.remaining() == 0 {
            return Ok(None);
        }
        let (_, word) = self.take()?;
        options
            .iter()
            .position(|o| o.as_bytes().eq_ignore_ascii_case(word))
            .map(Some)
            .ok_or(ArgError::UnknownOption { expected })
    }
}

/// Where the keys are in a call whose argument 1 counts them and whose first key is
/// argument 2, one every `step` arguments: for the server's key lookups (ACL, cluster
/// routing), which may come before the call is validated, so any input gives an answer.
/// Sets an option given once; a second time is an error naming it.
pub fn set_once<T>(slot: &mut Option<T>, value: T, name: &'static str) -> Result<(), ArgError> {
    if slot.is_some() {
        return Err(ArgError::RepeatedOption { name });
    }
    *slot = Some(value);
    Ok(())
}

pub fn counted_key_positions<L: ArgList + ?Sized>(
    list: &L,
    step: usize,
    most: usize,
) -> Vec<usize> {
    let count = (list.len() > 1)
        .then(|| parse_integer(list.get(1)))
        .flatten()
        .and_then(|n| usize::try_from(n).ok())
        .unwrap_or(0)
        .min(most);
    (0..count)
        .map(|i| 2 + i * step)
        .take_while(|&position| position < list.len())
        .collect()
}

/// A decimal integer: an optional sign and ASCII digits only.
pub fn parse_integer(bytes: &[u8]) -> Option<i64> {
    // The common case first: up to 18 digits, no sign, which cannot overflow.
    if !bytes.is_empty() && bytes.len() <= 18 {
        let mut n: i64 = 0;
        for &b in bytes {
            let digit = b.wrapping_sub(b'0');
            if digit >= 10 {
                return ascii(bytes)?.parse().ok();
            }
            n = n * 10 + i64::from(digit);
        }
        return Some(n);
    }
    ascii(bytes)?.parse().ok()
}

/// A finite decimal number (no `inf`, no `nan`, nothing that overflows to them).
pub fn parse_number(bytes: &[u8]) -> Option<f64> {
    if let Some(value) = plain_decimal(bytes) {
        return Some(value);
    }
    let value: f64 = ascii(bytes)?.parse().ok()?;
    value.is_finite().then_some(value)
}

/// Powers of ten that are exact in an f64.
const EXACT_POWERS_OF_TEN: [f64; 23] = [
    1e0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9, 1e10, 1e11, 1e12, 1e13, 1e14, 1e15, 1e16,
    1e17, 1e18, 1e19, 1e20, 1e21, 1e22,
];

/// The common case of `parse_number`, what the module writes and callers send: digits,
/// optionally a dot and more digits, at most 2^53 as an integer of all its digits.
/// That integer and the power of ten are both exact f64, and a division is correctly
/// rounded, so the quotient is the f64 nearest to the decimal: what the full parser
/// (and the script's tonumber) reads. None for anything else.
fn plain_decimal(bytes: &[u8]) -> Option<f64> {
    // Seventeen characters with a dot hold at most 2^53 in their digits; fewer do too.
    if bytes.is_empty() || bytes.len() > 17 {
        return None;
    }
    let mut mantissa: u64 = 0;
    let mut places = None;
    for (i, &b) in bytes.iter().enumerate() {
        let digit = b.wrapping_sub(b'0');
        if digit < 10 {
            mantissa = mantissa * 10 + u64::from(digit);
        } else if b == b'.' && i > 0 && places.is_none() {
            places = Some(bytes.len() - 1 - i);
        } else {
            return None;
        }
    }
    if mantissa > 1 << 53 {
        return None;
    }
    Some(mantissa as f64 / EXACT_POWERS_OF_TEN[places.unwrap_or(0)])
}

/// `bytes` as text when they are ASCII, as every number is: a cheaper check than full
/// UTF-8 validation, on the hot path of every call.
fn ascii(bytes: &[u8]) -> Option<&str> {
    // SAFETY: ASCII is valid UTF-8.
    bytes
        .is_ascii()
        .then(|| unsafe { std::str::from_utf8_unchecked(bytes) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn list<'a>(words: &'a [&'a str]) -> Vec<&'a [u8]> {
        words.iter().map(|w| w.as_bytes()).collect()
    }

    #[test]
    fn reads_keys_numbers_and_options_in_order() {
        let words = list(&["CMD", "k", "5", "0.5", "cost", "3"]);
        let mut a = Args::new(&words[..]);
        assert_eq!(a.key(), Ok(1));
        assert_eq!(a.integer("count", 1, 10), Ok(5));
        assert_eq!(a.number("period", (0.1, "0.1"), (1.0, "1")), Ok(0.5));
        assert_eq!(a.option(&["COST"], "COST n"), Ok(Some(0)));
        assert_eq!(a.integer("cost", 1, 10), Ok(3));
        assert_eq!(a.option(&["COST"], "COST n"), Ok(None));
    }

    #[test]
    fn integers_are_strict_and_bounded() {
        for (text, ok) in [
            ("1", Some(1)),
            ("-3", Some(-3)),
            ("9223372036854775807", Some(i64::MAX)),
            ("9223372036854775808", None),
            ("1.0", None),
            ("1e3", None),
            (" 1", None),
            ("", None),
            ("0x10", None),
            ("one", None),
        ] {
            assert_eq!(parse_integer(text.as_bytes()), ok, "{text:?}");
        }
        let words = list(&["CMD", "0", "11"]);
        let mut a = Args::new(&words[..]);
        let err = ArgError::Integer {
            name: "count",
            min: 1,
            max: 10,
        };
        assert_eq!(a.integer("count", 1, 10), Err(err.clone()));
        assert_eq!(a.integer("count", 1, 10), Err(err.clone()));
        assert_eq!(err.to_string(), "ERR count must be an integer from 1 to 10");
    }

    #[test]
    fn numbers_are_finite() {
        for text in [
            "nan", "NaN", "inf", "-inf", "infinity", "1e309", "", "1,5", "\u{ff}",
        ] {
            assert_eq!(parse_number(text.as_bytes()), None, "{text:?}");
        }
        assert_eq!(parse_number(b"1e-3"), Some(0.001));
        assert_eq!(parse_number(b"60"), Some(60.0));
        assert_eq!(parse_number(b"5."), Some(5.0));
        assert_eq!(parse_number(b".5"), Some(0.5));
        assert_eq!(parse_number(b"-2.5"), Some(-2.5));
        assert_eq!(
            parse_number(b"1764441000.123456"),
            Some(1_764_441_000.123456)
        );
        assert_eq!(parse_number(b"9007199254740993"), Some(9007199254740992.0));
        assert_eq!(parse_number(&[0xff, 0xfe]), None);
    }

    #[test]
    fn running_out_of_arguments_is_an_arity_error() {
        let words = list(&["CMD", "k"]);
        let mut a = Args::new(&words[..]);
        assert_eq!(a.expect_count(3, 5), Err(ArgError::Arity));
        a.key().unwrap();
        assert_eq!(a.integer("count", 1, 2), Err(ArgError::Arity));
        assert_eq!(ArgError::Arity.to_string(), "ERR wrong number of arguments");
    }

    #[test]
    fn unknown_options_are_refused() {
        let words = list(&["CMD", "COSTS"]);
        let mut a = Args::new(&words[..]);
        assert_eq!(
            a.option(&["COST"], "COST n"),
            Err(ArgError::UnknownOption { expected: "COST n" })
        );
    }

    #[test]
    fn counted_keys_are_found_even_in_bad_calls() {
        let words = list(&["ADMIT", "2", "a", "1", "1", "b", "1", "1", "WINDOW", "5"]);
        assert_eq!(counted_key_positions(&words[..], 3, 64), vec![2, 5]);
        let words = list(&["RECORD", "2", "a", "b", "5"]);
        assert_eq!(counted_key_positions(&words[..], 1, 64), vec![2, 3]);
        let words = list(&["ADMIT", "9", "a", "1"]);
        assert_eq!(
            counted_key_positions(&words[..], 3, 64),
            vec![2],
            "only what is there"
        );
        for bad in [&["ADMIT"][..], &["ADMIT", "-1", "a"], &["ADMIT", "x", "a"]] {
            assert!(counted_key_positions(&list(bad)[..], 3, 64).is_empty());
        }
        let words = list(&["ADMIT", "1000", "a", "b", "c"]);
        assert_eq!(
            counted_key_positions(&words[..], 1, 2),
            vec![2, 3],
            "at most `most`"
        );
    }

    proptest! {
        /// Any bytes at all: the parser answers, it never panics.
        #[test]
        fn any_arguments_get_an_answer(words in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..24), 0..8)) {
            let list: Vec<&[u8]> = words.iter().map(|w| &w[..]).collect();
            let mut a = Args::new(&list[..]);
            let _ = a.key();
            let _ = a.integer("n", i64::MIN, i64::MAX);
            let _ = a.number("x", (f64::MIN, "min"), (f64::MAX, "max"));
            while let Ok(Some(_)) = a.option(&["COST"], "COST n") {}
        }

        /// Digits and signs read as the standard parser reads them.
        #[test]
        fn integers_as_the_standard_parser(text in "[-+]?[0-9]{0,21}") {
            prop_assert_eq!(parse_integer(text.as_bytes()), text.parse::<i64>().ok());
        }

        #[test]
        fn integers_round_trip(v in any::<i64>()) {
            prop_assert_eq!(parse_integer(v.to_string().as_bytes()), Some(v));
        }

        /// The plain decimals read as the full parser reads them, to the bit.
        #[test]
        fn plain_decimals_as_the_full_parser(text in "[0-9]{1,17}(\\.[0-9]{0,17})?") {
            let full: f64 = text.parse().unwrap();
            prop_assert_eq!(parse_number(text.as_bytes()).map(f64::to_bits), Some(full.to_bits()));
        }

        #[test]
        fn finite_numbers_round_trip(v in proptest::num::f64::NORMAL | proptest::num::f64::SUBNORMAL | proptest::num::f64::ZERO) {
            prop_assert_eq!(parse_number(v.to_string().as_bytes()), Some(v));
        }
    }
}
