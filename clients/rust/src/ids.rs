//! Request ids: what makes a call replayable (`ID <id>`, so that a call sent once more
//! after a dropped connection counts once). Plain code: the default id of each call and
//! the check of a caller's own.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use qag_core::replay::MAX_ID_BYTES;

use crate::error::Error;

/// A new id for one call: `<16 lowercase hex chars, random once per process>-<a
/// per-process counter>`, e.g. `9f86d081884c7d65-42`. No system call per id; two
/// processes share a prefix with a chance of one in 2^64.
pub fn new_request_id() -> String {
    static PROCESS: OnceLock<u64> = OnceLock::new();
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let process = *PROCESS.get_or_init(|| {
        // std's hasher keys come from the operating system's random source.
        let mut hasher = RandomState::new().build_hasher();
        hasher.write_u32(std::process::id());
        hasher.finish()
    });
    format!("{process:016x}-{}", NEXT.fetch_add(1, Ordering::Relaxed))
}

/// A caller's own id, checked before anything is sent: 1 to 128 bytes, as the module
/// takes them.
pub(crate) fn check_id(id: &str) -> Result<(), Error> {
    if id.is_empty() || id.len() > MAX_ID_BYTES {
        return Err(Error::InvalidArgument(format!(
            "a request id must be 1 to {MAX_ID_BYTES} bytes, got {}",
            id.len()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_ids_share_a_random_prefix_and_count_up() {
        let (first, second) = (new_request_id(), new_request_id());
        let (prefix, n) = first.split_once('-').expect("prefix-counter");
        assert_eq!(prefix.len(), 16);
        assert!(prefix
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)));
        let (prefix2, m) = second.split_once('-').expect("prefix-counter");
        assert_eq!(prefix, prefix2);
        assert!(m.parse::<u64>().unwrap() > n.parse::<u64>().unwrap());
        assert!(check_id(&first).is_ok());
    }

    #[test]
    fn caller_ids_are_one_to_128_bytes() {
        assert!(check_id("x").is_ok());
        assert!(check_id(&"x".repeat(128)).is_ok());
        for bad in [String::new(), "x".repeat(129), "é".repeat(65)] {
            assert!(
                matches!(check_id(&bad), Err(Error::InvalidArgument(ref why)) if why.contains("1 to 128 bytes")),
                "{bad:?}"
            );
        }
    }
}
