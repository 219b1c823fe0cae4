//! The observers, both kinds in one registry type, and out of memory, every part: what a malloc
//! does once the cache and a new segment have failed (PyTorch `DeviceCachingAllocator::malloc`'s
//! end: release-and-retry, the out-of-memory observers, the error), the out-of-memory observers
//! (PyTorch `attachOutOfMemoryObserver`), the error's message, and the segment observers
//! (PyTorch's `AllocatorTraceTracker`: every segment and page range made or given back).
//!
//! - [`list`]: the registry both kinds use (attach, detach, call each without a lock held);
//! - [`device`]: release-and-retry, then the out-of-memory observers, one more attempt if one of
//!   them asked, and the error;
//! - [`out_of_memory`]: the functions called when a request fails, before its error returns;
//! - [`message`]: the message, PyTorch's text with the device's figures, fragmentation and tags;
//! - [`segments`]: the segment observers, told of every segment and mapped range.
//!
//! Elsewhere: the memory fraction's byte limit (`caching::limit`), a pool's budget and its own
//! out-of-memory path (`caching::budget`), the C functions (`ffi::oom`).

mod device;
pub(crate) mod list;
pub(crate) mod message;
pub(crate) mod out_of_memory;
pub(crate) mod segments;
