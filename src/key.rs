//! Keys through the module's low-level key API: open once, read and write fields in
//! place, close on drop. No call goes through another command.

use std::ffi::c_int;
use std::ptr;
use std::sync::OnceLock;

use redis_module::raw;

use crate::command::{string_bytes, CommandError, Ctx};

/// What a key holds, as far as qag cares.
#[derive(Clone, Copy, PartialEq, Eq)]
enum KeyKind {
    Empty,
    Hash,
    Other,
}

/// An open key, closed when dropped.
pub struct Key {
    raw: *mut raw::RedisModuleKey,
    kind: KeyKind,
}

#[derive(Clone, Copy)]
pub enum Access {
    Read,
    ReadWrite,
}

impl Key {
    /// Opens `name` for `access`; refuses with WRONGTYPE a key that holds anything but
    /// a hash, before anything is written.
    pub fn open_hash(
        ctx: &Ctx,
        name: *mut raw::RedisModuleString,
        access: Access,
    ) -> Result<Key, CommandError> {
        let mode = match access {
            Access::Read => raw::REDISMODULE_READ,
            Access::ReadWrite => raw::REDISMODULE_READ | raw::REDISMODULE_WRITE,
        };
        // SAFETY: a live context and one of its argument strings.
        let raw_key = unsafe { raw::RedisModule_OpenKey.unwrap()(ctx.raw(), name, mode as c_int) };
        // A read-only open of a missing key may return NULL: that is an empty key.
        let key_type = if raw_key.is_null() {
            raw::REDISMODULE_KEYTYPE_EMPTY
        } else {
            // SAFETY: an open key.
            unsafe { raw::RedisModule_KeyType.unwrap()(raw_key) as isize }
        };
        let kind = match key_type {
            raw::REDISMODULE_KEYTYPE_EMPTY => KeyKind::Empty,
            raw::REDISMODULE_KEYTYPE_HASH => KeyKind::Hash,
            _ => KeyKind::Other,
        };
        // Built before any early return, so that the key is closed on every path.
        let key = Key { raw: raw_key, kind };
        match kind {
            KeyKind::Other => Err(CommandError::WrongType),
            _ => Ok(key),
        }
    }

    /// Reads two fields in one call; each is None when missing.
    pub fn hash_get2(&self, ctx: &Ctx, fields: [&FieldName; 2]) -> [Option<OwnedString>; 2] {
        if self.kind == KeyKind::Empty {
            return [None, None];
        }
        let mut values = [ptr::null_mut::<raw::RedisModuleString>(); 2];
        // SAFETY: field names each followed by an out pointer, the list ended by NULL.
        unsafe {
            raw::RedisModule_HashGet.unwrap()(
                self.raw,
                raw::REDISMODULE_HASH_NONE as c_int,
                fields[0].raw(),
                &mut values[0] as *mut *mut raw::RedisModuleString,
                fields[1].raw(),
                &mut values[1] as *mut *mut raw::RedisModuleString,
                ptr::null::<u8>(),
            );
        }
        values.map(|v| OwnedString::adopt(ctx, v))
    }

    /// Writes two fields in one call, creating the hash if needed.
    pub fn hash_set2(&mut self, fields: [(&FieldName, &OwnedString); 2]) {
        let [(f1, v1), (f2, v2)] = fields;
        // SAFETY: as for HashGet; the server copies names and values.
        unsafe {
            raw::RedisModule_HashSet.unwrap()(
                self.raw,
                raw::REDISMODULE_HASH_NONE as c_int,
                f1.raw(),
                v1.raw,
                f2.raw(),
                v2.raw,
                ptr::null::<u8>(),
            );
        }
        self.kind = KeyKind::Hash;
    }

    /// Sets the key's absolute expiry in Unix milliseconds.
    pub fn set_expire_at(&mut self, at_millis: i64) {
        // SAFETY: an open, existing key.
        unsafe { raw::RedisModule_SetAbsExpire.unwrap()(self.raw, at_millis) };
    }
}

impl Drop for Key {
    fn drop(&mut self) {
        if !self.raw.is_null() {
            // SAFETY: opened by us, closed once.
            unsafe { raw::RedisModule_CloseKey.unwrap()(self.raw) };
        }
    }
}

/// A string the module created, freed when dropped.
pub struct OwnedString {
    ctx: *mut raw::RedisModuleCtx,
    pub raw: *mut raw::RedisModuleString,
}

impl OwnedString {
    pub fn new(ctx: &Ctx, text: &str) -> OwnedString {
        // SAFETY: a buffer of the given length.
        let raw = unsafe {
            raw::RedisModule_CreateString.unwrap()(ctx.raw(), text.as_ptr().cast(), text.len())
        };
        OwnedString {
            ctx: ctx.raw(),
            raw,
        }
    }

    fn adopt(ctx: &Ctx, raw: *mut raw::RedisModuleString) -> Option<OwnedString> {
        (!raw.is_null()).then(|| OwnedString {
            ctx: ctx.raw(),
            raw,
        })
    }

    pub fn bytes(&self) -> &[u8] {
        // SAFETY: a live string; the slice lives no longer than `self`.
        unsafe { string_bytes(self.raw) }
    }
}

impl Drop for OwnedString {
    fn drop(&mut self) {
        // SAFETY: created or handed to us by the server, freed once.
        unsafe { raw::RedisModule_FreeString.unwrap()(self.ctx, self.raw) };
    }
}

/// A hash field name, made into a server string once and shared by every call, so the
/// hot path allocates no field names.
pub struct FieldName {
    name: &'static str,
    string: OnceLock<SharedString>,
}

struct SharedString(*mut raw::RedisModuleString);

// SAFETY: created once at load and only ever used on the server's main thread.
unsafe impl Send for SharedString {}
unsafe impl Sync for SharedString {}

impl FieldName {
    pub const fn new(name: &'static str) -> FieldName {
        FieldName {
            name,
            string: OnceLock::new(),
        }
    }

    /// Creates the server string; called from the module's load.
    pub fn create(&self) {
        self.string.get_or_init(|| {
            // SAFETY: a NULL context makes a string that lives until freed: for ever.
            SharedString(unsafe {
                raw::RedisModule_CreateString.unwrap()(
                    ptr::null_mut(),
                    self.name.as_ptr().cast(),
                    self.name.len(),
                )
            })
        });
    }

    pub fn raw(&self) -> *mut raw::RedisModuleString {
        self.string
            .get()
            .expect("field names are created when the module loads")
            .0
    }
}
