//! The device hit path's shortcuts attacked from outside: the shard's hint, and the thread's
//! shard cache (its strong counts measured on the heap, in `cache_hostile`, whose counting
//! allocator is this binary's global one). One test binary, a module per file.

#[path = "../common/mod.rs"]
mod common;

mod cache_hostile;
mod cache_hostile_calls;
mod hostile;
