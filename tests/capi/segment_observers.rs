//! The C API of segment observers and of pools over the program's allocator on the simulated
//! device: bad input refused with a status and a message naming it, events told with their
//! kind, device, address, bytes and stream, nothing told after the detach, and a pool's
//! segments from its C functions. One test, in a process of its own (`common::process::alone`):
//! the process-wide allocator is set up once.

use crate::common;

use std::ffi::{CStr, c_void};
use std::sync::Mutex;

use std::alloc::Layout;
use std::sync::atomic::{AtomicUsize, Ordering};

use common::process::alone_on_sim;
use gpupool::ffi::memory::{gpupool_empty_cache, gpupool_free, gpupool_malloc};
use gpupool::ffi::pool_allocator::{gpupool_pool_create_with_allocator, gpupool_pool_create_with_allocator_aligned};
use gpupool::ffi::pools::{gpupool_begin_allocate_to_pool, gpupool_end_allocate_to_pool, gpupool_release_pool};
use gpupool::ffi::segments::{
    GPUPOOL_SEGMENT_MAP, GPUPOOL_SEGMENT_UNMAP, gpupool_attach_segment_observer, gpupool_detach_segment_observer,
    gpupool_segment_event_t,
};
use gpupool::ffi::status::gpupool_last_error_message;
use gpupool::ffi::status::gpupool_status::*;
use gpupool::ffi::{CUstream_st, gpupool_stream_t};

/// (kind, device, address, bytes, stream) of each event told, with the `user` it came with.
type Told = Vec<(u32, i32, usize, usize, usize, usize)>;
static TOLD: Mutex<Told> = Mutex::new(Vec::new());

unsafe extern "C" fn observer(user: *mut c_void, e: *const gpupool_segment_event_t) {
    // SAFETY: gpupool passes an event valid for the call.
    let e = unsafe { &*e };
    TOLD.lock().unwrap().push((e.kind, e.device, e.address as usize, e.bytes, e.stream as usize, user as usize));
}

fn message() -> String {
    // SAFETY: the thread's message is a NUL-terminated string valid until its next call.
    unsafe { CStr::from_ptr(gpupool_last_error_message()) }.to_string_lossy().into_owned()
}

fn stream(s: usize) -> gpupool_stream_t {
    s as *mut CUstream_st
}

#[test]
fn the_c_api_of_segment_observers_and_allocator_pools() {
    if !alone_on_sim("256MiB") {
        return;
    }
    let user = 0x5eed as *mut c_void;
    // SAFETY (every call below): valid function pointers and storage, as the header asks.
    unsafe {
        assert_eq!(gpupool_attach_segment_observer(None, user), GPUPOOL_ERROR_INVALID_VALUE);
        assert!(message().contains("observer is NULL"), "{}", message());
        assert_eq!(gpupool_detach_segment_observer(Some(observer), user), GPUPOOL_ERROR_INVALID_VALUE);
        assert!(message().contains("no segment observer is attached"), "{}", message());

        assert_eq!(gpupool_attach_segment_observer(Some(observer), user), GPUPOOL_SUCCESS);
        assert_eq!(gpupool_attach_segment_observer(Some(observer), user), GPUPOOL_ERROR_INVALID_VALUE);
        assert!(message().contains("attached already"), "{}", message());

        let mut p: *mut c_void = std::ptr::null_mut();
        assert_eq!(gpupool_malloc(&mut p, 1 << 20, 0, stream(7)), GPUPOOL_SUCCESS);
        {
            // Expandable segments (the default): 2 MiB mapped, told once (the pair was refused
            // the second time), before the malloc returned.
            let told = TOLD.lock().unwrap();
            assert_eq!(told.len(), 1, "{told:?}");
            let (kind, device, address, bytes, s, u) = told[0];
            assert_eq!((kind, device, bytes, s, u), (GPUPOOL_SEGMENT_MAP, 0, 2 << 20, 7, 0x5eed));
            assert!(address <= p as usize && (p as usize) < address + bytes, "the block lies in the pages told");
        }
        assert_eq!(gpupool_free(p), GPUPOOL_SUCCESS);
        assert_eq!(gpupool_empty_cache(0), GPUPOOL_SUCCESS);
        {
            let told = TOLD.lock().unwrap();
            assert_eq!(told.len(), 2, "{told:?}");
            assert_eq!(told[1].0, GPUPOOL_SEGMENT_UNMAP);
            assert_eq!((told[1].2, told[1].3), (told[0].2, told[0].3), "the same pages unmapped");
        }
        assert_eq!(gpupool_detach_segment_observer(Some(observer), user), GPUPOOL_SUCCESS);
        assert_eq!(gpupool_detach_segment_observer(Some(observer), user), GPUPOOL_ERROR_INVALID_VALUE);
        assert_eq!(gpupool_malloc(&mut p, 1 << 20, 0, stream(7)), GPUPOOL_SUCCESS);
        assert_eq!(gpupool_free(p), GPUPOOL_SUCCESS);
        assert_eq!(gpupool_empty_cache(0), GPUPOOL_SUCCESS);
        assert_eq!(TOLD.lock().unwrap().len(), 2, "told after the detach");
    }
    pool_from_c_functions();
}

const SEGMENT_ALIGN: usize = 2 << 20;
static LIVE: AtomicUsize = AtomicUsize::new(0);

/// The program's allocator: host memory aligned as device segments are (gpupool never touches
/// a segment's bytes), counted in LIVE and in `*user`.
unsafe extern "C" fn seg_alloc(
    user: *mut c_void,
    bytes: usize,
    _: i32,
    _: gpupool_stream_t,
    ptr: *mut *mut c_void,
) -> i32 {
    // SAFETY: `user` is the AtomicUsize given below; `ptr` is gpupool's storage for one pointer.
    unsafe {
        (*(user as *const AtomicUsize)).fetch_add(1, Ordering::SeqCst);
        *ptr = std::alloc::alloc(Layout::from_size_align(bytes, SEGMENT_ALIGN).unwrap()).cast();
    }
    LIVE.fetch_add(1, Ordering::SeqCst);
    0
}

unsafe extern "C" fn seg_free(_: *mut c_void, ptr: *mut c_void, bytes: usize, _: i32, _: gpupool_stream_t) {
    // SAFETY: `ptr` came from seg_alloc with these bytes.
    unsafe { std::alloc::dealloc(ptr.cast(), Layout::from_size_align(bytes, SEGMENT_ALIGN).unwrap()) };
    LIVE.fetch_sub(1, Ordering::SeqCst);
}

fn pool_from_c_functions() {
    let calls = AtomicUsize::new(0);
    let user = &calls as *const AtomicUsize as *mut c_void;
    let mut pool = 0u64;
    // SAFETY (every call below): valid function pointers and storage, as the header asks.
    unsafe {
        assert_eq!(
            gpupool_pool_create_with_allocator(std::ptr::null_mut(), Some(seg_alloc), Some(seg_free), user),
            GPUPOOL_ERROR_INVALID_VALUE
        );
        assert!(message().contains("pool"), "{}", message());
        assert_eq!(
            gpupool_pool_create_with_allocator(&mut pool, None, Some(seg_free), user),
            GPUPOOL_ERROR_INVALID_VALUE
        );
        assert!(message().contains("alloc is NULL"), "{}", message());
        assert_eq!(
            gpupool_pool_create_with_allocator(&mut pool, Some(seg_alloc), None, user),
            GPUPOOL_ERROR_INVALID_VALUE
        );
        assert!(message().contains("free is NULL"), "{}", message());
        assert_eq!(pool, 0, "nothing written on error");

        assert_eq!(
            gpupool_pool_create_with_allocator(&mut pool, Some(seg_alloc), Some(seg_free), user),
            GPUPOOL_SUCCESS
        );
        assert_ne!(pool, 0);
        assert_eq!(gpupool_begin_allocate_to_pool(0, pool, stream(9)), GPUPOOL_SUCCESS);
        let mut p: *mut c_void = std::ptr::null_mut();
        assert_eq!(gpupool_malloc(&mut p, 4096, 0, stream(9)), GPUPOOL_SUCCESS);
        assert_eq!(gpupool_end_allocate_to_pool(0, pool), GPUPOOL_SUCCESS);
        assert_eq!(
            (calls.load(Ordering::SeqCst), LIVE.load(Ordering::SeqCst)),
            (1, 1),
            "the segment came from seg_alloc"
        );
        assert_eq!(gpupool_free(p), GPUPOOL_SUCCESS);
        assert_eq!(gpupool_empty_cache(0), GPUPOOL_SUCCESS);
        assert_eq!(LIVE.load(Ordering::SeqCst), 0, "given back through seg_free");

        // Not split below 1 MiB: 4 KiB takes a whole MiB of a segment of whole MiBs.
        let mut aligned = 0u64;
        assert_eq!(
            gpupool_pool_create_with_allocator_aligned(&mut aligned, Some(seg_alloc), Some(seg_free), user, 1000),
            GPUPOOL_ERROR_INVALID_VALUE
        );
        assert!(message().contains("1000 bytes is not a multiple of 512"), "{}", message());
        assert_eq!(aligned, 0, "nothing written on error");
        assert_eq!(
            gpupool_pool_create_with_allocator_aligned(&mut aligned, Some(seg_alloc), Some(seg_free), user, 1 << 20),
            GPUPOOL_SUCCESS
        );
        assert_eq!(gpupool_begin_allocate_to_pool(0, aligned, stream(9)), GPUPOOL_SUCCESS);
        let (mut x, mut y): (*mut c_void, *mut c_void) = (std::ptr::null_mut(), std::ptr::null_mut());
        assert_eq!(gpupool_malloc(&mut x, 4096, 0, stream(9)), GPUPOOL_SUCCESS);
        assert_eq!(gpupool_malloc(&mut y, 4096, 0, stream(9)), GPUPOOL_SUCCESS);
        assert_eq!(gpupool_end_allocate_to_pool(0, aligned), GPUPOOL_SUCCESS);
        assert_eq!((y as usize).abs_diff(x as usize) % (1 << 20), 0, "{x:?} and {y:?} a MiB apart");
        assert_eq!(gpupool_free(x), GPUPOOL_SUCCESS);
        assert_eq!(gpupool_free(y), GPUPOOL_SUCCESS);
        assert_eq!(gpupool_release_pool(0, aligned), GPUPOOL_SUCCESS);
        assert_eq!(LIVE.load(Ordering::SeqCst), 0, "given back through seg_free");
    }
}
