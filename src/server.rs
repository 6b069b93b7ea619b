//! The server's side of a call, below everything else in the module: the call's context
//! (its clock, replication, keyspace notifications), server strings, and why a command
//! refused to run. The reply path and the entry point are command.rs's; keys are
//! key.rs's.

use std::ffi::{c_int, CStr};

use qag_core::args::ArgError;
use redis_module::raw;

/// A server string, as the key API takes it.
pub type RawString = *mut raw::RedisModuleString;

/// The context of one command call.
pub struct Ctx(pub(crate) *mut raw::RedisModuleCtx);

impl Ctx {
    pub fn raw(&self) -> *mut raw::RedisModuleCtx {
        self.0
    }

    /// The server's wall clock in microseconds since the Unix epoch: the time cached
    /// for this command where the server offers it (7.2 and later), else
    /// CLOCK_REALTIME, the clock TIME reads (`clock_name` says which).
    pub fn now_micros(&self) -> i64 {
        // SAFETY: the API table is filled in at load and never changes afterwards.
        if let Some(cached) = unsafe { raw::RedisModule_CachedMicroseconds } {
            return unsafe { cached() };
        }
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: a valid timespec to fill.
        unsafe { libc::clock_gettime(libc::CLOCK_REALTIME, &mut ts) };
        ts.tv_sec * 1_000_000 + ts.tv_nsec / 1000
    }

    /// Replicates `command key args...` to replicas and the AOF: the plain command
    /// that has the effect the module just had.
    pub fn replicate(&self, command: &CStr, key: RawString, args: &[RawString]) {
        // SAFETY: the API table is filled in at load and never changes afterwards.
        let replicate = unsafe { raw::RedisModule_Replicate.unwrap() };
        let (ctx, command) = (self.0, command.as_ptr());
        // SAFETY: each format letter "s" matched by a live string; "v" by an array of
        // live strings and its length. Short lists go as single strings: an array costs
        // the server a second allocation per call.
        unsafe {
            match *args {
                [a] => replicate(ctx, command, c"ss".as_ptr(), key, a),
                [a, b] => replicate(ctx, command, c"sss".as_ptr(), key, a, b),
                [a, b, c] => replicate(ctx, command, c"ssss".as_ptr(), key, a, b, c),
                [a, b, c, d] => replicate(ctx, command, c"sssss".as_ptr(), key, a, b, c, d),
                [a, b, c, d, e, f] => {
                    replicate(ctx, command, c"sssssss".as_ptr(), key, a, b, c, d, e, f)
                }
                [a, b, c, d, e, f, g, h] => replicate(
                    ctx,
                    command,
                    c"sssssssss".as_ptr(),
                    key,
                    a,
                    b,
                    c,
                    d,
                    e,
                    f,
                    g,
                    h,
                ),
                _ => replicate(ctx, command, c"sv".as_ptr(), key, args.as_ptr(), args.len()),
            };
        }
    }

    /// Replicates `command key arg`, as `replicate` does, from the argument's bytes (see
    /// `replicate_set_pxat`).
    pub fn replicate_bytes(&self, command: &CStr, key: RawString, arg: &[u8]) {
        // SAFETY: as for replicate_set_pxat.
        unsafe {
            raw::RedisModule_Replicate.unwrap()(
                self.0,
                command.as_ptr(),
                c"sb".as_ptr(),
                key,
                arg.as_ptr(),
                arg.len(),
            )
        };
    }

    /// Replicates `SET key value PXAT at`, as `replicate` does, from the bytes of the
    /// value and of the time: the server makes their strings itself, which saves making
    /// and freeing a module string of each (and its own formatting of an integer
    /// argument costs more than a string made from digits).
    pub fn replicate_set_pxat(&self, key: RawString, value: &[u8], pxat: RawString, at: &[u8]) {
        // SAFETY: the API table is filled in at load and never changes afterwards; "s" is
        // a live string, "b" a buffer and its length.
        unsafe {
            raw::RedisModule_Replicate.unwrap()(
                self.0,
                c"SET".as_ptr(),
                c"sbsb".as_ptr(),
                key,
                value.as_ptr(),
                value.len(),
                pxat,
                at.as_ptr(),
                at.len(),
            )
        };
    }

    /// Fires a keyspace notification, as the equivalent plain command would.
    pub fn notify(&self, class: c_int, event: &CStr, key: *mut raw::RedisModuleString) {
        // SAFETY: valid context, event and key.
        unsafe {
            raw::RedisModule_NotifyKeyspaceEvent.unwrap()(self.0, class, event.as_ptr(), key)
        };
    }
}

/// Why a command refused to run; nothing was written.
pub enum CommandError {
    Arg(ArgError),
    WrongType,
    /// Valid arguments the command still cannot act on; the text is the whole error.
    Refused(&'static str),
}

impl From<ArgError> for CommandError {
    fn from(e: ArgError) -> Self {
        CommandError::Arg(e)
    }
}

/// The bytes of a Redis string, read in place.
///
/// # Safety
/// `s` must be a live string that outlives the returned slice and is not modified
/// meanwhile.
pub unsafe fn string_bytes<'a>(s: *const raw::RedisModuleString) -> &'a [u8] {
    let mut len = 0usize;
    let p = raw::RedisModule_StringPtrLen.unwrap()(s, &mut len);
    if p.is_null() {
        return &[];
    }
    std::slice::from_raw_parts(p.cast::<u8>(), len)
}

/// Which clock `Ctx::now_micros` reads on this server, for the load log and INFO.
pub fn clock_name() -> &'static CStr {
    // SAFETY: reading the API table filled in at load.
    match unsafe { raw::RedisModule_CachedMicroseconds }.is_some() {
        true => c"RedisModule_CachedMicroseconds",
        false => c"clock_gettime(CLOCK_REALTIME)",
    }
}
