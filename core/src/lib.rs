//! The arithmetic and argument grammar of qag's limiters, in plain Rust.
//!
//! Nothing here knows about Redis: state comes in as values, the clock as an argument,
//! and what to write back goes out as values, so every rule is unit-tested directly.
//! The module crate (`qag`) is the thin glue that reads and writes Redis keys.

pub mod args;
pub mod bucket;
pub mod lease;
pub mod load;
pub mod number;
pub mod quota;
pub mod replay;
pub mod throttle;
pub mod wait;
pub mod waiter;
pub mod window;
