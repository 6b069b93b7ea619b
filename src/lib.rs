//! qag: native rate-limiting commands for API and model gateways, as a Redis (and
//! Valkey) module. The arithmetic lives in `qag-core`; this crate is the glue.

mod bucket;
mod command;
mod key;
mod lease;
mod quota;
mod testing;
mod window;

use redis_module::{redis_module, Context, RedisString, Status};

use command::{register, Features};

fn init(ctx: &Context, args: &[RedisString]) -> Status {
    bucket::init();
    quota::init();
    let test_commands = args
        .iter()
        .any(|a| a.as_slice().eq_ignore_ascii_case(b"TEST-COMMANDS"));
    let mut features = Features::default();
    let registered = register::<bucket::Take>(ctx.ctx, &mut features)
        .and_then(|_| register::<bucket::TakePair>(ctx.ctx, &mut features))
        .and_then(|_| register::<bucket::Peek>(ctx.ctx, &mut features))
        .and_then(|_| register::<lease::Lease>(ctx.ctx, &mut features))
        .and_then(|_| register::<lease::Renew>(ctx.ctx, &mut features))
        .and_then(|_| register::<lease::Release>(ctx.ctx, &mut features))
        .and_then(|_| register::<lease::Leases>(ctx.ctx, &mut features))
        .and_then(|_| register::<quota::Check>(ctx.ctx, &mut features))
        .and_then(|_| register::<quota::Add>(ctx.ctx, &mut features))
        .and_then(|_| register::<quota::Seed>(ctx.ctx, &mut features))
        .and_then(|_| register::<window::Admit>(ctx.ctx, &mut features))
        .and_then(|_| register::<window::Record>(ctx.ctx, &mut features))
        .and_then(|_| match test_commands {
            true => register::<testing::Panic>(ctx.ctx, &mut features),
            false => Ok(()),
        });
    if let Err(e) = registered {
        ctx.log_warning(&format!("qag: {e}"));
        return Status::Err;
    }
    // SAFETY: reading the API table filled in at load.
    let cached_clock = unsafe { redis_module::raw::RedisModule_CachedMicroseconds }.is_some();
    let supported = |used: bool, what: &'static str| match used {
        true => what,
        false => "not supported by this server",
    };
    ctx.log_notice(&format!(
        "qag {} loaded: key specs and command docs {}, ACL categories {}, clock {}",
        env!("CARGO_PKG_VERSION"),
        supported(features.command_info, "registered"),
        supported(features.acl_categories, "set"),
        match cached_clock {
            true => "RedisModule_CachedMicroseconds",
            false => "clock_gettime(CLOCK_REALTIME)",
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
