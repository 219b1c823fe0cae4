//! Out of memory, every part: what a malloc does once the cache and a new segment have failed
//! (PyTorch `DeviceCachingAllocator::malloc`'s end: release-and-retry, the observers, the
//! error), the observers themselves (PyTorch `attachOutOfMemoryObserver`), and the error's
//! message.
//!
//! - [`device`]: release-and-retry, then the observers, one more attempt if one of them asked,
//!   and the error;
//! - [`observers`]: the functions called when a request fails, before its error returns;
//! - [`message`]: the message, PyTorch's text with the device's figures, fragmentation and tags.
//!
//! Elsewhere: the memory fraction's byte limit (`caching::limit`), a pool's budget and its own
//! out-of-memory path (`caching::budget`), the C functions (`ffi::oom`).

mod device;
pub(crate) mod message;
pub(crate) mod observers;
