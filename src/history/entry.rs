//! One event as the recorder keeps it, before its stack is symbolised. Its own module, which
//! imports nothing of the history's but the event's kind, so that `recorder` (which writes
//! entries) and `snapshot` (which turns them into [`super::TraceEntry`]) both depend on it and
//! neither on the other.

use std::sync::Arc;

use super::Action;
use crate::driver::StreamHandle;

/// One event as recorded (see [`super::TraceEntry`] for the fields); `ctx` names its stack in
/// the recorder's table (0: none); `meta` is the recording thread's metadata, or an
/// annotation's (`super::metadata`).
#[derive(Clone, Debug)]
pub(crate) struct Entry {
    pub action: Action,
    pub ctx: u32,
    pub addr: u64,
    pub size: usize,
    pub block_size: usize,
    pub stream: StreamHandle,
    pub time_us: i64,
    pub meta: Option<Arc<str>>,
}
