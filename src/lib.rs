//! qag: native rate-limiting commands for API and model gateways, as a Redis (and
//! Valkey) module. The arithmetic lives in `qag-core`; this crate is the glue.

mod bucket;
mod command;
mod key;

use redis_module::{redis_module, Context, RedisString, Status};

use command::{register, Features};

fn init(ctx: &Context, _args: &[RedisString]) -> Status {
    bucket::init();
    let mut features = Features::default();
    let registered = register::<bucket::Take>(ctx.ctx, &mut features)
        .and_then(|_| register::<bucket::TakePair>(ctx.ctx, &mut features))
        .and_then(|_| register::<bucket::Peek>(ctx.ctx, &mut features));
    if let Err(e) = registered {
        ctx.log_warning(&format!("qag: {e}"));
        return Status::Err;
    }
    // SAFETY: reading the API table filled in at load.
    let cached_clock = unsafe { redis_module::raw::RedisModule_CachedMicroseconds }.is_some();
    ctx.log_notice(&format!(
        "qag {} loaded: key specs and command docs {}, clock {}",
        env!("CARGO_PKG_VERSION"),
        if features.command_info {
            "registered"
        } else {
            "not supported by this server"
        },
        if cached_clock {
            "RedisModule_CachedMicroseconds"
        } else {
            "clock_gettime(CLOCK_REALTIME)"
        },
    ));
    Status::Ok
}

redis_module! {
    name: "qag",
    version: 1,
    allocator: (redis_module::alloc::RedisAlloc, redis_module::alloc::RedisAlloc),
    data_types: [],
    init: init,
}
