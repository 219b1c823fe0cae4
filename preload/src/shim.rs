//! The shim's state: gpupool's process-wide allocator, the deferred frees and the counters
//! printed at exit. The shim's options (`GPUPOOL_PRELOAD_*`) are fields of gpupool's `Config`,
//! read with every other option by gpupool's one reader (`gpupool::config`); the shim parses
//! no variable itself.

use std::ffi::c_int;
use std::io::Write;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

use gpupool::config::PreloadMode;
use gpupool::driver::{DevicePtr, StreamHandle};
use gpupool::{Allocator, Error};

/// What the shim did, for `GPUPOOL_PRELOAD_STATS`: counts of calls since the process started,
/// updated with relaxed atomics from any thread.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    /// `cudaMalloc` calls served by gpupool.
    pub cuda_malloc: AtomicU64,
    /// `cudaMallocAsync` calls served by gpupool.
    pub cuda_malloc_async: AtomicU64,
    /// `cuMemAlloc_v2` calls served by gpupool (directly or through `cuGetProcAddress`).
    pub cu_mem_alloc: AtomicU64,
    /// `cuMemAllocAsync` calls served by gpupool.
    pub cu_mem_alloc_async: AtomicU64,
    /// `cudaFree`/`cuMemFree_v2` of gpupool's pointers (deferred in safe mode).
    pub frees: AtomicU64,
    /// `cudaFreeAsync`/`cuMemFreeAsync` of gpupool's pointers.
    pub async_frees: AtomicU64,
    /// Driver allocations passed to the real function (another context current).
    pub passed_allocs: AtomicU64,
    /// Frees passed to the real function (NULL, or pointers that are not gpupool's).
    pub passed_frees: AtomicU64,
}

pub(crate) struct Shim {
    /// gpupool's process-wide allocator; its `config()` holds the shim's options too.
    pub alloc: &'static Allocator,
    pub counters: Counters,
}

static SHIM: OnceLock<Option<Shim>> = OnceLock::new();

fn say(msg: &str) {
    let _ = writeln!(std::io::stderr(), "gpupool_preload: {msg}");
}

/// The shim, started on first use; `None` when gpupool cannot start (then every call passes
/// through to CUDA, and the reason was written to stderr once).
pub(crate) fn shim() -> Option<&'static Shim> {
    SHIM.get_or_init(|| match start() {
        Ok(s) => Some(s),
        Err(e) => {
            say(&format!("gpupool did not start ({e}); every call passes through to CUDA"));
            None
        }
    })
    .as_ref()
}

/// Starts gpupool's process-wide allocator, which reads every option, the shim's too, through
/// gpupool's one options table (`gpupool::config`).
fn start() -> Result<Shim, Error> {
    let alloc = gpupool::ffi::process_allocator()?;
    if alloc.config().preload_stats {
        // SAFETY: registers a plain function with no arguments.
        unsafe { libc::atexit(print_stats_at_exit) };
    }
    Ok(Shim { alloc, counters: Counters::default() })
}

/// Runs `f`, turning a panic into `on_panic` (no panic may cross into the program).
pub(crate) fn guard<R>(on_panic: R, f: impl FnOnce() -> R) -> R {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|_| {
        say("internal error: gpupool panicked; please report this");
        on_panic
    })
}

// The CUDA statuses the shim returns itself. The runtime's `cudaError_t` and the driver's
// `CUresult` agree on these values, so both halves of the shim use them.

/// `cudaSuccess`, `CUDA_SUCCESS`.
pub(crate) const SUCCESS: c_int = 0;
/// `cudaErrorInvalidValue`, `CUDA_ERROR_INVALID_VALUE`.
pub(crate) const INVALID_VALUE: c_int = 1;
/// `cudaErrorMemoryAllocation`, `CUDA_ERROR_OUT_OF_MEMORY`.
pub(crate) const OUT_OF_MEMORY: c_int = 2;
/// `CUDA_ERROR_NOT_INITIALIZED` (the runtime's `cudaErrorInitializationError`): the driver
/// API's answer before `cuInit` has succeeded, so the shim's answer without `libcuda.so`.
pub(crate) const NOT_INITIALIZED: c_int = 3;
/// `cudaErrorUnknown`, `CUDA_ERROR_UNKNOWN`: a panic caught in the shim, or a real function
/// that could not be found.
pub(crate) const UNKNOWN: c_int = 999;

/// CUDA's status for a gpupool error.
pub(crate) fn cuda_status(e: &Error) -> c_int {
    match e {
        Error::InvalidValue(_) | Error::InvalidPointer(_) => INVALID_VALUE,
        Error::OutOfMemory(_) => OUT_OF_MEMORY,
        _ => UNKNOWN,
    }
}

pub(crate) fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// CUDA's status for the outcome of a free: 0 (success) or [`cuda_status`].
pub(crate) fn status(r: Result<(), Error>) -> c_int {
    r.map_or_else(|e| cuda_status(&e), |()| SUCCESS)
}

/// The shim, when the free of `ptr` is gpupool's to take (the pointer is in one of its
/// segments); `None` when it goes to the real function, counted as passed through if the shim
/// runs. NULL (0) is never gpupool's: it goes to the real function (`cudaFree` answers NULL
/// itself on the simulated device).
pub(crate) fn owner_of(ptr: DevicePtr) -> Option<&'static Shim> {
    let s = shim()?;
    if ptr != 0 && s.alloc.owns(ptr) {
        return Some(s);
    }
    bump(&s.counters.passed_frees);
    None
}

impl Shim {
    /// An interposed allocation served by gpupool on `device` (-1: current) for `stream`:
    /// counted in `counter`, the pointer given to `out` on success. Returns CUDA's status. When
    /// the device is full, gpupool's out-of-memory path synchronises the device for the
    /// deferred frees, releases them and the cache, and retries.
    pub fn serve(
        &self,
        counter: &AtomicU64,
        size: usize,
        device: i32,
        stream: StreamHandle,
        out: impl FnOnce(DevicePtr),
    ) -> c_int {
        bump(counter);
        match self.alloc.malloc(size, device, stream) {
            Ok(p) => {
                out(p);
                0
            }
            Err(e) => cuda_status(&e),
        }
    }

    /// A free through `cudaFree`/`cuMemFree` of a pointer gpupool owns: in safe mode the block
    /// waits for a device synchronisation (`Allocator::free_after_device_sync`), made here once
    /// the device's deferred bytes reach `GPUPOOL_PRELOAD_SYNC_BYTES`; in stream mode it is
    /// freed at once.
    ///
    /// Errors: [`Error::InvalidPointer`] for a pointer inside a block, or one already freed.
    pub fn free(&self, ptr: DevicePtr) -> Result<(), Error> {
        bump(&self.counters.frees);
        let config = self.alloc.config();
        if config.preload_mode == PreloadMode::Stream {
            return self.alloc.free(ptr);
        }
        let (device, waiting) = self.alloc.free_after_device_sync(ptr)?;
        if waiting >= config.preload_sync_bytes
            && let Err(e) = self.alloc.release_deferred(device)
        {
            say(&format!("releasing deferred frees: {e}"));
        }
        Ok(())
    }

    /// A stream-ordered free (`cudaFreeAsync`, `cuMemFreeAsync`) of a pointer gpupool owns.
    pub fn free_async(&self, ptr: DevicePtr, stream: StreamHandle) -> Result<(), Error> {
        bump(&self.counters.async_frees);
        self.alloc.record_stream(ptr, stream)?;
        self.alloc.free(ptr)
    }
}

extern "C" fn print_stats_at_exit() {
    guard((), || {
        let Some(Some(s)) = SHIM.get() else { return };
        let c = &s.counters;
        let n = |a: &AtomicU64| a.load(Ordering::Relaxed);
        // Summed over the devices; counters only, no CUDA call.
        let mut d = [0i64; 4];
        for dev in 0..s.alloc.device_count() {
            if let Ok(x) = s.alloc.deferred(dev) {
                d.iter_mut().zip(x).for_each(|(a, b)| *a += b);
            }
        }
        let mut out = format!(
            "gpupool_preload: mode {:?}; served {} cudaMalloc, {} cudaMallocAsync, {} cuMemAlloc, {} cuMemAllocAsync; \
             {} frees, {} stream-ordered frees; passed through {} allocations and {} frees; \
             {} device synchronisations released {} deferred frees; {} frees ({} bytes) still deferred at exit\n",
            s.alloc.config().preload_mode,
            n(&c.cuda_malloc),
            n(&c.cuda_malloc_async),
            n(&c.cu_mem_alloc),
            n(&c.cu_mem_alloc_async),
            n(&c.frees),
            n(&c.async_frees),
            n(&c.passed_allocs),
            n(&c.passed_frees),
            d[2],
            d[3],
            d[0],
            d[1],
        );
        for dev in 0..s.alloc.device_count() {
            // Reads counters only: no CUDA call (CUDA may have shut down already).
            match s.alloc.stats(dev) {
                Ok(st) if st.num_device_alloc > 0 => {
                    if let Ok(text) = s.alloc.memory_summary(dev) {
                        out.push_str(&text);
                        out.push('\n');
                    }
                }
                _ => {}
            }
        }
        let _ = std::io::stderr().write_all(out.as_bytes());
    })
}
