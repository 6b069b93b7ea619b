//! The one way the client takes its locks.

use std::sync::{Mutex, MutexGuard};

/// The value behind `mutex`, whether or not a panic poisoned it: the guarded values
/// stay consistent at every await-free step, so a panic elsewhere leaves nothing
/// half-written.
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}
