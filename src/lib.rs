//! qag: native rate-limiting commands for API and model gateways, as a Redis (and
//! Valkey) module. The arithmetic lives in `qag-core`; this crate is the glue.

mod bucket;
mod command;
mod key;
mod lease;
mod quota;
mod replay;
mod server;
mod stats;
mod testing;
mod throttle;
mod wait;
mod window;

use redis_module::{redis_module, Context, RedisString, Status};

use command::{register, Features};
use stats::VERSION;

/// The version MODULE LIST shows: major × 10000 + minor × 100 + patch.
const MODULE_VERSION: i32 = decimal(env!("CARGO_PKG_VERSION_MAJOR")) * 10_000
    + decimal(env!("CARGO_PKG_VERSION_MINOR")) * 100
    + decimal(env!("CARGO_PKG_VERSION_PATCH"));

/// A version part as a number, at compile time.
const fn decimal(digits: &str) -> i32 {
    let digits = digits.as_bytes();
    let mut value = 0;
    let mut i = 0;
    while i < digits.len() {
        assert!(digits[i].is_ascii_digit(), "a version part is not a number");
        value = value * 10 + (digits[i] - b'0') as i32;
        i += 1;
    }
    value
}

/// The server API entries the commands call without checking (the optional ones,
/// clock, key specs and ACL categories, are checked where used). A server without one
/// of them refuses the module at load, so no command can meet a missing entry.
fn missing_api() -> Option<&'static str> {
    use redis_module::raw::*;
    // SAFETY: reading the API table filled in at load.
    let present = unsafe {
        [
            ("CloseKey", { RedisModule_CloseKey }.is_some()),
            ("CreateCommand", { RedisModule_CreateCommand }.is_some()),
            ("CreateString", { RedisModule_CreateString }.is_some()),
            (
                "CreateStringFromLongLong",
                { RedisModule_CreateStringFromLongLong }.is_some(),
            ),
            (
                "CreateStringFromString",
                { RedisModule_CreateStringFromString }.is_some(),
            ),
            ("FreeString", { RedisModule_FreeString }.is_some()),
            ("HashGet", { RedisModule_HashGet }.is_some()),
            ("HashSet", { RedisModule_HashSet }.is_some()),
            ("InfoAddSection", { RedisModule_InfoAddSection }.is_some()),
            (
                "InfoAddFieldCString",
                { RedisModule_InfoAddFieldCString }.is_some(),
            ),
            (
                "InfoAddFieldULongLong",
                { RedisModule_InfoAddFieldULongLong }.is_some(),
            ),
            (
                "IsKeysPositionRequest",
                { RedisModule_IsKeysPositionRequest }.is_some(),
            ),
            ("KeyAtPos", { RedisModule_KeyAtPos }.is_some()),
            ("KeyType", { RedisModule_KeyType }.is_some()),
            (
                "NotifyKeyspaceEvent",
                { RedisModule_NotifyKeyspaceEvent }.is_some(),
            ),
            ("OpenKey", { RedisModule_OpenKey }.is_some()),
            (
                "RegisterInfoFunc",
                { RedisModule_RegisterInfoFunc }.is_some(),
            ),
            ("Replicate", { RedisModule_Replicate }.is_some()),
            ("ReplyWithArray", { RedisModule_ReplyWithArray }.is_some()),
            ("ReplyWithError", { RedisModule_ReplyWithError }.is_some()),
            (
                "ReplyWithLongLong",
                { RedisModule_ReplyWithLongLong }.is_some(),
            ),
            ("ReplyWithNull", { RedisModule_ReplyWithNull }.is_some()),
            (
                "ScanCursorCreate",
                { RedisModule_ScanCursorCreate }.is_some(),
            ),
            (
                "ScanCursorDestroy",
                { RedisModule_ScanCursorDestroy }.is_some(),
            ),
            ("ScanKey", { RedisModule_ScanKey }.is_some()),
            (
                "SetModuleOptions",
                { RedisModule_SetModuleOptions }.is_some(),
            ),
            (
                "SignalModifiedKey",
                { RedisModule_SignalModifiedKey }.is_some(),
            ),
            ("GetAbsExpire", { RedisModule_GetAbsExpire }.is_some()),
            ("SetAbsExpire", { RedisModule_SetAbsExpire }.is_some()),
            ("StringDMA", { RedisModule_StringDMA }.is_some()),
            ("StringPtrLen", { RedisModule_StringPtrLen }.is_some()),
            ("StringSet", { RedisModule_StringSet }.is_some()),
            ("StringTruncate", { RedisModule_StringTruncate }.is_some()),
            ("ValueLength", { RedisModule_ValueLength }.is_some()),
            ("ZsetAdd", { RedisModule_ZsetAdd }.is_some()),
            (
                "ZsetFirstInScoreRange",
                { RedisModule_ZsetFirstInScoreRange }.is_some(),
            ),
            (
                "ZsetLastInScoreRange",
                { RedisModule_ZsetLastInScoreRange }.is_some(),
            ),
            (
                "ZsetRangeCurrentElement",
                { RedisModule_ZsetRangeCurrentElement }.is_some(),
            ),
            (
                "ZsetRangeEndReached",
                { RedisModule_ZsetRangeEndReached }.is_some(),
            ),
            ("ZsetRangeNext", { RedisModule_ZsetRangeNext }.is_some()),
            ("ZsetRangeStop", { RedisModule_ZsetRangeStop }.is_some()),
            ("ZsetRem", { RedisModule_ZsetRem }.is_some()),
            ("ZsetScore", { RedisModule_ZsetScore }.is_some()),
            ("BlockClient", { RedisModule_BlockClient }.is_some()),
            ("UnblockClient", { RedisModule_UnblockClient }.is_some()),
            (
                "SetDisconnectCallback",
                { RedisModule_SetDisconnectCallback }.is_some(),
            ),
            (
                "GetBlockedClientHandle",
                { RedisModule_GetBlockedClientHandle }.is_some(),
            ),
            (
                "GetBlockedClientPrivateData",
                { RedisModule_GetBlockedClientPrivateData }.is_some(),
            ),
            ("CreateTimer", { RedisModule_CreateTimer }.is_some()),
            ("StopTimer", { RedisModule_StopTimer }.is_some()),
            ("GetContextFlags", { RedisModule_GetContextFlags }.is_some()),
            ("GetSelectedDb", { RedisModule_GetSelectedDb }.is_some()),
            ("SelectDb", { RedisModule_SelectDb }.is_some()),
            (
                "SubscribeToKeyspaceEvents",
                { RedisModule_SubscribeToKeyspaceEvents }.is_some(),
            ),
            (
                "SubscribeToServerEvent",
                { RedisModule_SubscribeToServerEvent }.is_some(),
            ),
            ("Call", { RedisModule_Call }.is_some()),
            ("Milliseconds", { RedisModule_Milliseconds }.is_some()),
            ("FreeCallReply", { RedisModule_FreeCallReply }.is_some()),
            (
                "AvoidReplicaTraffic",
                { RedisModule_AvoidReplicaTraffic }.is_some(),
            ),
        ]
    };
    present
        .iter()
        .find(|(_, there)| !there)
        .map(|(name, _)| *name)
}

fn init(ctx: &Context, args: &[RedisString]) -> Status {
    if let Some(name) = missing_api() {
        ctx.log_warning(&format!(
            "qag: this server lacks RedisModule_{name}; qag needs Redis 7.0 or later, or Valkey"
        ));
        return Status::Err;
    }
    // A key is signalled as modified (WATCH, client tracking) only when a command wrote
    // to it, never merely because it was opened for writing: see key.rs.
    ctx.set_module_options(redis_module::raw::ModuleOptions::NO_IMPLICIT_SIGNAL_MODIFIED);
    key::init();
    bucket::init();
    quota::init();
    window::init();
    let words: Vec<&[u8]> = args.iter().map(RedisString::as_slice).collect();
    let options = match qag_core::load::parse_load_args(&words) {
        Ok(options) => options,
        Err(e) => {
            let message = e.to_string();
            let message = message.strip_prefix("ERR ").unwrap_or(&message);
            ctx.log_warning(&format!("qag: bad load arguments: {message}; not loaded"));
            return Status::Err;
        }
    };
    let (test_commands, cl_throttle) = (options.test_commands, options.cl_throttle);
    throttle::set_skew_seconds(options.throttle_skew_seconds);
    replay::init(options.id_seconds, options.id_max);
    wait::set_max_waiters(options.max_waiters);
    wait::subscribe_to_server_events(ctx.ctx);
    wait::watch_the_clock(ctx.ctx);
    stats::clear();
    let mut features = Features {
        qag_category: add_acl_category(ctx),
        ..Features::default()
    };
    let registered = register::<bucket::Take>(ctx.ctx, &mut features)
        .and_then(|_| register::<bucket::TakePair>(ctx.ctx, &mut features))
        .and_then(|_| register::<bucket::Peek>(ctx.ctx, &mut features))
        .and_then(|_| register::<bucket::Refund>(ctx.ctx, &mut features))
        .and_then(|_| register::<lease::Lease>(ctx.ctx, &mut features))
        .and_then(|_| register::<lease::Renew>(ctx.ctx, &mut features))
        .and_then(|_| register::<lease::Release>(ctx.ctx, &mut features))
        .and_then(|_| register::<lease::Leases>(ctx.ctx, &mut features))
        .and_then(|_| register::<quota::Check>(ctx.ctx, &mut features))
        .and_then(|_| register::<quota::Add>(ctx.ctx, &mut features))
        .and_then(|_| register::<quota::Seed>(ctx.ctx, &mut features))
        .and_then(|_| register::<window::Admit>(ctx.ctx, &mut features))
        .and_then(|_| register::<window::Record>(ctx.ctx, &mut features))
        .and_then(|_| register::<throttle::Throttle<false>>(ctx.ctx, &mut features))
        .and_then(|_| match cl_throttle {
            true => register::<throttle::Throttle<true>>(ctx.ctx, &mut features).map_err(|e| {
                format!("{e}: loaded with CL-THROTTLE, but the name CL.THROTTLE is taken, most likely by redis-cell loaded beside qag; load qag without CL-THROTTLE to keep both")
            }),
            false => Ok(()),
        })
        .and_then(|_| match test_commands {
            true => register::<testing::Panic>(ctx.ctx, &mut features),
            false => Ok(()),
        });
    if let Err(e) = registered {
        ctx.log_warning(&format!("qag: {e}"));
        return Status::Err;
    }
    // SAFETY: checked present above; replaces the framework's empty INFO callback.
    unsafe { redis_module::raw::RedisModule_RegisterInfoFunc.unwrap()(ctx.ctx, Some(stats::info)) };
    let supported = |used: bool, what: &'static str| match used {
        true => what,
        false => "not supported by this server",
    };
    ctx.log_notice(&format!(
        "qag {} (module version {MODULE_VERSION}) loaded: key specs and command docs {}, ACL categories {}, {}, {}, THROTTLE-SKEW {} s, request ids kept {} s (at most {} a key), at most {} waiters, clock {}",
        VERSION.to_string_lossy(),
        supported(features.command_info, "registered"),
        supported(features.acl_categories, "set"),
        match features.qag_category {
            true => "ACL category @qag added (grant with +@qag)",
            false => "ACL category @qag not available on this server (grant the qag commands by name)",
        },
        match cl_throttle {
            true => "CL.THROTTLE registered",
            false => "CL.THROTTLE left to redis-cell (load with CL-THROTTLE to take it)",
        },
        options.throttle_skew_seconds,
        options.id_seconds,
        options.id_max,
        options.max_waiters,
        server::clock_name().to_string_lossy(),
    ));
    Status::Ok
}

/// Adds the ACL category `qag` where the server lets a module add one (Redis 7.4 and
/// later). True where the server has categories for modules: adding fails when the
/// category is left from an earlier load of the module, and then it is there to use;
/// registration finds out if it is not.
fn add_acl_category(ctx: &Context) -> bool {
    // SAFETY: an optional API entry, checked for presence; called during load, the
    // only time a module may add a category.
    match unsafe { redis_module::raw::RedisModule_AddACLCategory } {
        Some(add) => {
            unsafe { add(ctx.ctx, c"qag".as_ptr()) };
            true
        }
        None => false,
    }
}

redis_module! {
    name: "qag",
    version: MODULE_VERSION,
    allocator: (redis_module::alloc::RedisAlloc, redis_module::alloc::RedisAlloc),
    data_types: [],
    init: init,
}
