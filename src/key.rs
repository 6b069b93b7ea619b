//! Keys through the module's low-level key API: open once, read and write in place,
//! close on drop. No call goes through another command. Every write here is also the
//! one place that replicates it (as the plain command with the same effect) and fires
//! its keyspace notifications, so no command can write without replicating. A key is
//! signalled as modified (WATCH, client tracking) when it closes only if something was
//! written to it: the module loads with the server's implicit signal on every key
//! opened for writing turned off, so a refusal or a no-op is not a write.

use std::cell::RefCell;
use std::ffi::{c_int, CStr};
use std::ptr;
use std::sync::OnceLock;

use qag_core::number::{format_signed, NumberBuffer};
use redis_module::raw;

use crate::server::{string_bytes, CommandError, Ctx, RawString};

/// The most fields one `set_fields` writes.
const MAX_FIELDS: usize = 8;

/// HashGet and HashSet flags: field names are server strings.
const NONE: c_int = raw::REDISMODULE_HASH_NONE as c_int;
/// The NULL that ends HashGet's and HashSet's variadic arguments.
const END: *const u8 = ptr::null();

/// The `PXAT` of a replicated `SET`, made once at load like the field names.
static PXAT: FieldName = FieldName::new("PXAT");

/// Makes the shared strings; called once when the module loads.
pub fn init() {
    PXAT.create();
}

/// The type of value a command works on.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum ValueType {
    Hash,
    SortedSet,
    String,
}

/// An open key, closed when dropped.
pub struct Key<'ctx> {
    ctx: &'ctx Ctx,
    raw: *mut raw::RedisModuleKey,
    name: RawString,
    /// Whether the key holds a value (of the expected type) rather than nothing.
    exists: bool,
    /// Whether anything was written, so that closing signals the key as modified.
    written: bool,
    /// The key's expiry (-1: none) when known without asking the server: a key that
    /// was missing when opened, or whose expiry this handle set.
    known_expiry: Option<i64>,
}

#[derive(Clone, Copy)]
pub enum Access {
    Read,
    /// Read without touching the key's idle time, for a type check only.
    ReadUntouched,
    ReadWrite,
}

impl<'ctx> Key<'ctx> {
    /// Opens `name` for `access`; refuses with WRONGTYPE a key that holds anything but
    /// a value of type `expected`, before anything is written.
    pub fn open(
        ctx: &'ctx Ctx,
        name: RawString,
        access: Access,
        expected: ValueType,
    ) -> Result<Key<'ctx>, CommandError> {
        let mode = match access {
            Access::Read => raw::REDISMODULE_READ,
            Access::ReadUntouched => raw::REDISMODULE_READ | raw::REDISMODULE_OPEN_KEY_NOTOUCH,
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
        let expected_type = match expected {
            ValueType::Hash => raw::REDISMODULE_KEYTYPE_HASH,
            ValueType::SortedSet => raw::REDISMODULE_KEYTYPE_ZSET,
            ValueType::String => raw::REDISMODULE_KEYTYPE_STRING,
        };
        // Built before any early return, so that the key is closed on every path.
        let key = Key {
            ctx,
            raw: raw_key,
            name,
            exists: key_type == expected_type,
            written: false,
            known_expiry: (key_type == raw::REDISMODULE_KEYTYPE_EMPTY).then_some(-1),
        };
        if key_type != raw::REDISMODULE_KEYTYPE_EMPTY && key_type != expected_type {
            return Err(CommandError::WrongType);
        }
        Ok(key)
    }

    /// Reads `N` fields, four to a call; each is None when missing.
    pub fn hash_get<const N: usize>(&self, fields: [RawString; N]) -> [Option<OwnedString>; N] {
        let mut values = [ptr::null_mut::<raw::RedisModuleString>(); N];
        if self.exists {
            for (names, outs) in fields.chunks(4).zip(values.chunks_mut(4)) {
                // SAFETY: the API table is filled in at load and never changes.
                let get = unsafe { raw::RedisModule_HashGet.unwrap() };
                // SAFETY: field names each followed by an out pointer, ended by NULL.
                unsafe {
                    match (names, outs) {
                        ([a, b, c, d], [va, vb, vc, vd]) => get(
                            self.raw,
                            NONE,
                            *a,
                            va as *mut _,
                            *b,
                            vb as *mut _,
                            *c,
                            vc as *mut _,
                            *d,
                            vd as *mut _,
                            END,
                        ),
                        ([a, b, c], [va, vb, vc]) => get(
                            self.raw,
                            NONE,
                            *a,
                            va as *mut _,
                            *b,
                            vb as *mut _,
                            *c,
                            vc as *mut _,
                            END,
                        ),
                        ([a, b], [va, vb]) => {
                            get(self.raw, NONE, *a, va as *mut _, *b, vb as *mut _, END)
                        }
                        ([a], [va]) => get(self.raw, NONE, *a, va as *mut _, END),
                        _ => unreachable!("chunks of four"),
                    };
                }
            }
        }
        values.map(|v| OwnedString::adopt(self.ctx, v))
    }

    /// Writes up to MAX_FIELDS fields (name, value), four to a call, creating the hash
    /// if needed; replicated as one `HSET`. No fields: nothing is written.
    pub fn set_fields(&mut self, fields: &[(RawString, RawString)]) {
        assert!(
            fields.len() <= MAX_FIELDS,
            "set_fields replicates at most MAX_FIELDS fields"
        );
        if fields.is_empty() {
            return;
        }
        // SAFETY: the API table is filled in at load and never changes.
        let set = unsafe { raw::RedisModule_HashSet.unwrap() };
        for chunk in fields.chunks(4) {
            // SAFETY: field names each followed by a value, ended by NULL; the server
            // copies both.
            unsafe {
                match chunk {
                    [(a, va), (b, vb), (c, vc), (d, vd)] => {
                        set(self.raw, NONE, *a, *va, *b, *vb, *c, *vc, *d, *vd, END)
                    }
                    [(a, va), (b, vb), (c, vc)] => {
                        set(self.raw, NONE, *a, *va, *b, *vb, *c, *vc, END)
                    }
                    [(a, va), (b, vb)] => set(self.raw, NONE, *a, *va, *b, *vb, END),
                    [(a, va)] => set(self.raw, NONE, *a, *va, END),
                    _ => unreachable!("chunks of four"),
                };
            }
        }
        self.exists = true;
        let mut argv = [ptr::null_mut(); 2 * MAX_FIELDS];
        for (i, (field, value)) in fields.iter().enumerate() {
            argv[2 * i] = *field;
            argv[2 * i + 1] = *value;
        }
        self.replicate(c"HSET", &argv[..2 * fields.len()]);
        self.notify(raw::REDISMODULE_NOTIFY_HASH, c"hset");
        self.written = true;
    }

    /// Deletes those of `fields` the hash has; replicated as one `HDEL` of them.
    pub fn delete_fields(&mut self, fields: &[RawString]) {
        if !self.exists || fields.is_empty() {
            return;
        }
        // HashSet deletes a field given this marker as its value.
        let delete = 1usize as RawString;
        let deleted: Vec<RawString> = fields
            .iter()
            .copied()
            // SAFETY: as for set_fields.
            .filter(|&field| unsafe { raw::RedisModule_HashSet.unwrap()(self.raw, NONE, field, delete, END) } > 0)
            .collect();
        if !deleted.is_empty() {
            self.exists = self.len() > 0;
            self.replicate(c"HDEL", &deleted);
            self.notify(raw::REDISMODULE_NOTIFY_HASH, c"hdel");
            self.notify_if_deleted();
            self.written = true;
        }
    }

    /// The names of the hash's fields that `select` picks, copied out of the hash so
    /// that the caller may then delete them.
    pub fn hash_fields_where(&self, select: &dyn Fn(&[u8]) -> bool) -> Vec<OwnedString> {
        self.hash_entries_where(select)
            .into_iter()
            .map(|(name, _)| name)
            .collect()
    }

    /// The fields (name and value) that `select` picks by name, copied out of the hash.
    pub fn hash_entries_where(
        &self,
        select: &dyn Fn(&[u8]) -> bool,
    ) -> Vec<(OwnedString, OwnedString)> {
        struct Scan<'a> {
            ctx: &'a Ctx,
            select: &'a dyn Fn(&[u8]) -> bool,
            picked: Vec<(OwnedString, OwnedString)>,
        }
        extern "C" fn visit(
            _key: *mut raw::RedisModuleKey,
            field: RawString,
            value: RawString,
            scan: *mut std::ffi::c_void,
        ) {
            // SAFETY: `scan` is the Scan below, alive for the whole ScanKey call; the
            // field and value live for this callback, and are copied before it ends.
            let scan = unsafe { &mut *scan.cast::<Scan>() };
            let name = unsafe { string_bytes(field) };
            // A panic must not unwind into the server: a field it fails on is skipped.
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| (scan.select)(name)))
                .unwrap_or(false)
            {
                let copy = |s: RawString| unsafe {
                    raw::RedisModule_CreateStringFromString.unwrap()(scan.ctx.raw(), s)
                };
                if let (Some(name), Some(value)) = (
                    OwnedString::adopt(scan.ctx, copy(field)),
                    OwnedString::adopt(scan.ctx, copy(value)),
                ) {
                    scan.picked.push((name, value));
                }
            }
        }
        let mut scan = Scan {
            ctx: self.ctx,
            select,
            picked: Vec::new(),
        };
        if !self.exists {
            return scan.picked;
        }
        // SAFETY: a cursor used for one key and destroyed after; `scan` outlives it.
        unsafe {
            let cursor = raw::RedisModule_ScanCursorCreate.unwrap()();
            let scan_key = raw::RedisModule_ScanKey.unwrap();
            while scan_key(
                self.raw,
                cursor,
                Some(visit),
                (&mut scan as *mut Scan).cast(),
            ) != 0
            {}
            raw::RedisModule_ScanCursorDestroy.unwrap()(cursor);
        }
        scan.picked
    }

    /// A string key's value, read in place; None when the key is missing.
    pub fn string_value(&self) -> Option<&[u8]> {
        if !self.exists {
            return None;
        }
        let mut len = 0usize;
        // SAFETY: an open string key; read-only access to its buffer, which lives while
        // the key is open and unwritten, as long as the borrow of `self`.
        unsafe {
            let p = raw::RedisModule_StringDMA.unwrap()(
                self.raw,
                &mut len,
                raw::REDISMODULE_READ as c_int,
            );
            Some(match p.is_null() {
                true => &[],
                false => std::slice::from_raw_parts(p.cast::<u8>(), len),
            })
        }
    }

    /// Sets a string key to `value`, expiring at `at_millis` (Unix milliseconds);
    /// replicated as one `SET key value PXAT at`, which fires `set` and `expire`. The
    /// value is written through the key's buffer: an existing string is rewritten in
    /// place, as SET overwrites a value, so the key keeps its LRU/LFU state and fires no
    /// `new` (setting it anew would delete and re-add it); a missing key is created at
    /// the value's length (firing `new`, as SET does). Either way the value is a raw
    /// string, which the next call reads in place (a read of a string embedded in its
    /// object, as SET leaves a short one, first copies it to a raw one).
    pub fn set_string_expiring_at(&mut self, value: &[u8], at_millis: i64) {
        if !self.rewrite_string(value) {
            let string = OwnedString::new(self.ctx, value);
            // SAFETY: a key open for writing, empty or a string; the server copies it.
            unsafe { raw::RedisModule_StringSet.unwrap()(self.raw, string.raw) };
        }
        // SAFETY: a key open for writing that holds a string.
        unsafe { raw::RedisModule_SetAbsExpire.unwrap()(self.raw, at_millis) };
        self.exists = true;
        self.known_expiry = Some(at_millis);
        let mut at = NumberBuffer::new();
        let at = format_signed(&mut at, at_millis).as_bytes();
        self.ctx
            .replicate_set_pxat(self.name, value, PXAT.raw(), at);
        self.notify(raw::REDISMODULE_NOTIFY_STRING, c"set");
        self.notify(raw::REDISMODULE_NOTIFY_GENERIC, c"expire");
        self.written = true;
    }

    /// Writes `value` through the string's buffer, resized first when the length
    /// differs (which creates a missing key); false (nothing written) if the server gave
    /// no buffer of that length.
    fn rewrite_string(&mut self, value: &[u8]) -> bool {
        let mode = raw::REDISMODULE_WRITE as c_int;
        let mut len = 0usize;
        // SAFETY: a key open for writing, empty or a string: the buffer is the key's own
        // (unshared by the server for writing), `len` bytes long, until the key is
        // written otherwise or closed; it is re-read after a truncate.
        unsafe {
            let dma = raw::RedisModule_StringDMA.unwrap();
            let mut p = dma(self.raw, &mut len, mode);
            if len != value.len() {
                raw::RedisModule_StringTruncate.unwrap()(self.raw, value.len());
                p = dma(self.raw, &mut len, mode);
            }
            if p.is_null() || len != value.len() {
                return false;
            }
            ptr::copy_nonoverlapping(value.as_ptr(), p.cast::<u8>(), len);
        }
        true
    }

    /// The score of `member`, None when absent.
    pub fn zset_score(&self, member: *mut raw::RedisModuleString) -> Option<f64> {
        if !self.exists {
            return None;
        }
        let mut score = 0.0;
        // SAFETY: an open sorted set and a live string.
        let found = unsafe { raw::RedisModule_ZsetScore.unwrap()(self.raw, member, &mut score) };
        (found == raw::REDISMODULE_OK as c_int).then_some(score)
    }

    /// Adds `member` or updates its score, a whole number; replicated as `ZADD`.
    pub fn zset_add(&mut self, member: RawString, score: i64) {
        // SAFETY: a key open for writing, empty or a sorted set.
        unsafe {
            raw::RedisModule_ZsetAdd.unwrap()(self.raw, score as f64, member, ptr::null_mut())
        };
        self.exists = true;
        let score = OwnedString::from_integer(self.ctx, score);
        self.replicate(c"ZADD", &[score.raw, member]);
        self.notify(raw::REDISMODULE_NOTIFY_ZSET, c"zadd");
        self.written = true;
    }

    /// Removes `members`; replicated as one `ZREM`. The server deletes the key when it
    /// empties, and then fires `del` after `zrem`, as ZREM does.
    pub fn zset_remove(&mut self, members: &[RawString]) {
        if !self.exists || members.is_empty() {
            return;
        }
        for &member in members {
            // SAFETY: as above.
            unsafe { raw::RedisModule_ZsetRem.unwrap()(self.raw, member, ptr::null_mut()) };
        }
        self.exists = self.len() > 0;
        self.replicate(c"ZREM", members);
        self.notify(raw::REDISMODULE_NOTIFY_ZSET, c"zrem");
        self.notify_if_deleted();
        self.written = true;
    }

    /// The number of members (or fields, or elements) the key holds.
    pub fn len(&self) -> usize {
        if !self.exists {
            return 0;
        }
        // SAFETY: an open key.
        unsafe { raw::RedisModule_ValueLength.unwrap()(self.raw) }
    }

    /// The members scored from `min` (excluded when `min_excluded`) to `max` (included),
    /// lowest first.
    pub fn zset_range(&self, min: f64, min_excluded: bool, max: f64) -> Vec<OwnedString> {
        let mut members = Vec::new();
        if !self.exists {
            return members;
        }
        let min_excluded = c_int::from(min_excluded);
        // SAFETY: an open sorted set; the range iterator is stopped before returning.
        unsafe {
            if raw::RedisModule_ZsetFirstInScoreRange.unwrap()(self.raw, min, max, min_excluded, 0)
                != raw::REDISMODULE_OK as c_int
            {
                return members;
            }
            while raw::RedisModule_ZsetRangeEndReached.unwrap()(self.raw) == 0 {
                let member =
                    raw::RedisModule_ZsetRangeCurrentElement.unwrap()(self.raw, ptr::null_mut());
                members.extend(OwnedString::adopt(self.ctx, member));
                if raw::RedisModule_ZsetRangeNext.unwrap()(self.raw) == 0 {
                    break;
                }
            }
            raw::RedisModule_ZsetRangeStop.unwrap()(self.raw);
        }
        members
    }

    /// The highest score, None for an empty key.
    pub fn zset_max_score(&self) -> Option<f64> {
        if !self.exists {
            return None;
        }
        let mut score = None;
        // SAFETY: as for zset_range.
        unsafe {
            let inf = f64::INFINITY;
            if raw::RedisModule_ZsetLastInScoreRange.unwrap()(self.raw, -inf, inf, 0, 0)
                == raw::REDISMODULE_OK as c_int
            {
                let mut value = 0.0;
                let member =
                    raw::RedisModule_ZsetRangeCurrentElement.unwrap()(self.raw, &mut value);
                if !member.is_null() {
                    raw::RedisModule_FreeString.unwrap()(ptr::null_mut(), member);
                    score = Some(value);
                }
            }
            raw::RedisModule_ZsetRangeStop.unwrap()(self.raw);
        }
        score
    }

    /// Sets the key's absolute expiry in Unix milliseconds; replicated as `PEXPIREAT`,
    /// absolute, so a replica or a replayed AOF expires it at the same instant. A key
    /// that already expires then is left alone: nothing changes, so nothing is
    /// replicated (a replica already has that expiry from the call that set it).
    pub fn expire_at(&mut self, at_millis: i64) {
        let current = self.expiry();
        self.move_expiry(current, at_millis);
    }

    /// Sets the key's expiry to what `decide` makes of the one it has (-1: none), the
    /// key at hand for what else it needs to know; as `expire_at`, nothing is written
    /// when that is the one it has.
    pub fn expire_given(&mut self, decide: impl FnOnce(i64, &Self) -> i64) {
        let current = self.expiry();
        let at = decide(current, self);
        self.move_expiry(current, at);
    }

    /// The key's absolute expiry in Unix milliseconds, -1 when it has none.
    fn expiry(&self) -> i64 {
        if let Some(known) = self.known_expiry {
            return known;
        }
        // SAFETY: an open, existing key.
        unsafe { raw::RedisModule_GetAbsExpire.unwrap()(self.raw) }
    }

    /// Sets the expiry `current` to `at_millis`, replicated, when they differ.
    fn move_expiry(&mut self, current: i64, at_millis: i64) {
        if current == at_millis {
            return;
        }
        // SAFETY: as above.
        unsafe { raw::RedisModule_SetAbsExpire.unwrap()(self.raw, at_millis) };
        self.known_expiry = Some(at_millis);
        let mut at = NumberBuffer::new();
        let at = format_signed(&mut at, at_millis).as_bytes();
        self.ctx.replicate_bytes(c"PEXPIREAT", self.name, at);
        self.notify(raw::REDISMODULE_NOTIFY_GENERIC, c"expire");
        self.written = true;
    }

    /// Fires `del` when a removal emptied the key, as the plain command does after its
    /// own event.
    fn notify_if_deleted(&mut self) {
        if !self.exists {
            // Deleted with its expiry: a value written again has none.
            self.known_expiry = Some(-1);
            self.notify(raw::REDISMODULE_NOTIFY_GENERIC, c"del");
        }
    }

    fn replicate(&self, command: &CStr, args: &[RawString]) {
        self.ctx.replicate(command, self.name, args);
    }

    fn notify(&self, class: c_int, event: &CStr) {
        self.ctx.notify(class, event, self.name);
    }
}

impl Drop for Key<'_> {
    fn drop(&mut self) {
        if self.written {
            // SAFETY: a live context and the key's name, a string of this call.
            unsafe { raw::RedisModule_SignalModifiedKey.unwrap()(self.ctx.raw(), self.name) };
        }
        if !self.raw.is_null() {
            // SAFETY: opened by us, closed once.
            unsafe { raw::RedisModule_CloseKey.unwrap()(self.raw) };
        }
    }
}

thread_local! {
    // Where a field name or a value is written before the server copies it: kept from
    // call to call (commands run on the server's main thread only).
    static TEXT: RefCell<Vec<u8>> = RefCell::new(Vec::with_capacity(512));
}

/// A string the module created, freed when dropped.
pub struct OwnedString {
    ctx: *mut raw::RedisModuleCtx,
    pub raw: *mut raw::RedisModuleString,
}

impl OwnedString {
    pub fn from_integer(ctx: &Ctx, value: i64) -> OwnedString {
        // SAFETY: a live context.
        let raw = unsafe { raw::RedisModule_CreateStringFromLongLong.unwrap()(ctx.raw(), value) };
        OwnedString {
            ctx: ctx.raw(),
            raw,
        }
    }

    pub fn new(ctx: &Ctx, bytes: &[u8]) -> OwnedString {
        // SAFETY: a buffer of the given length.
        let raw = unsafe {
            raw::RedisModule_CreateString.unwrap()(ctx.raw(), bytes.as_ptr().cast(), bytes.len())
        };
        OwnedString {
            ctx: ctx.raw(),
            raw,
        }
    }

    /// A string of the text `write` writes into a buffer kept from call to call (no
    /// allocation of the module's own for it).
    pub fn from_text(ctx: &Ctx, write: impl FnOnce(&mut Vec<u8>) -> &[u8]) -> OwnedString {
        TEXT.with_borrow_mut(|text| OwnedString::new(ctx, write(text)))
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
