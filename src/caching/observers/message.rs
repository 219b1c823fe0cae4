//! The out-of-memory error's message: PyTorch's text (`CUDACachingAllocator.cpp`, the
//! `OutOfMemoryError` raised at the end of `malloc`), with the device's figures, and what
//! PyTorch's users have asked it to say of fragmentation (pytorch/pytorch#29554, #32101): the
//! inactive split bytes and the largest free block of each pool; and, when tags were used
//! (`crate::history::tags`), the tags that hold the most of the device's allocated bytes.

use std::sync::Arc;

use crate::caching::shard::Request;
use crate::driver::Driver;
use crate::error::Error;
use crate::stats::DeviceStats;
use crate::stats::summary::format_size;

/// What the message reports of a failed request, gathered once the request had failed.
pub(crate) struct Report<'a> {
    pub device: i32,
    pub req: &'a Request,
    /// The device's statistics after the last attempt.
    pub stats: &'a DeviceStats,
    /// The device's byte limit (`None`: no memory fraction set).
    pub limit: Option<i64>,
    /// The largest free block of the small and of the large pool, in bytes, over every stream
    /// of the device (0: the pool has none).
    pub largest_free: [usize; 2],
    /// The tags holding the most allocated bytes on the device, most first, at most
    /// [`TOP_TAGS`]: name, bytes (rounded), blocks. Empty when no tag was ever pushed.
    pub top_tags: Vec<(Arc<str>, usize, usize)>,
}

/// Tags the message names at most.
pub(crate) const TOP_TAGS: usize = 3;

/// The sentence naming `top` (see [`Report::top_tags`]), empty when there is none.
fn tags_sentence(top: &[(Arc<str>, usize, usize)]) -> String {
    if top.is_empty() {
        return String::new();
    }
    let list: Vec<String> = top
        .iter()
        .map(|(name, bytes, blocks)| {
            format!("{name} {} in {blocks} block{}", format_size(*bytes as u64), if *blocks == 1 { "" } else { "s" })
        })
        .collect();
    format!(" Tags holding the most allocated memory on this device: {}.", list.join(", "))
}

/// The error for the request in `r`. Asks `driver` for the free memory (`cuMemGetInfo`); says
/// so when it cannot.
pub(crate) fn message(driver: &dyn Driver, r: &Report) -> Error {
    let (device, s) = (r.device, r.stats);
    let (allocated, reserved) = (s.allocated_bytes.all.current as u64, s.reserved_bytes.all.current as u64);
    let capacity = match driver.mem_info(device) {
        Ok(info) => format!(
            "GPU {device} has a total capacity of {} of which {} is free",
            format_size(info.total as u64),
            format_size(info.free as u64)
        ),
        Err(e) => format!("GPU {device}'s free memory could not be read ({e})"),
    };
    let fraction = match r.limit {
        None => String::new(),
        Some(l) => format!(" The memory fraction set for this device allows gpupool {} in all.", format_size(l as u64)),
    };
    let largest = |bytes: usize| if bytes == 0 { "none".to_string() } else { format_size(bytes as u64) };
    let fragmentation = format!(
        " Of the reserved but unallocated memory, {} is in inactive split blocks (free blocks of segments that also \
         hold live blocks, which empty_cache cannot release). Largest free block over all streams: {} in the small \
         pool, {} in the large pool.",
        format_size(s.inactive_split_bytes.all.current as u64),
        largest(r.largest_free[0]),
        largest(r.largest_free[1]),
    );
    let tags = tags_sentence(&r.top_tags);
    Error::OutOfMemory(format!(
        "CUDA out of memory. Tried to allocate {} (for a request of {} bytes). {capacity}. \
         Of the allocated memory {} is allocated by gpupool, and {} is reserved by gpupool but unallocated.{fraction}\
         {fragmentation}{tags} If reserved but unallocated memory is large, the cache is fragmented: see the memory summary.",
        format_size(r.req.segment as u64),
        r.req.size,
        format_size(allocated),
        format_size(reserved - allocated),
    ))
}
