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
use gpupool::host::HostAllocator;
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
    /// `cudaFree`/`cuMemFree_v2` of gpupool's pointers that gpupool took (deferred in safe
    /// mode).
    pub frees: AtomicU64,
    /// `cudaFreeAsync`/`cuMemFreeAsync` of gpupool's pointers that gpupool took.
    pub async_frees: AtomicU64,
    /// `cudaFree`/`cuMemFree_v2` that gpupool refused (a pointer inside its memory that is not
    /// an allocation's start, or one freed already): the call returned an error.
    pub refused_frees: AtomicU64,
    /// `cudaFreeAsync`/`cuMemFreeAsync` that gpupool refused, as `refused_frees`.
    pub refused_async_frees: AtomicU64,
    /// Driver allocations passed to the real function (another context current).
    pub passed_allocs: AtomicU64,
    /// Frees passed to the real function (NULL, or pointers that are not gpupool's).
    pub passed_frees: AtomicU64,
    /// `cudaMallocHost`/`cudaHostAlloc` calls served by gpupool's pinned host allocator.
    pub cuda_host_alloc: AtomicU64,
    /// `cuMemAllocHost_v2`/`cuMemHostAlloc` calls served by gpupool.
    pub cu_host_alloc: AtomicU64,
    /// `cudaFreeHost`/`cuMemFreeHost` of gpupool's pinned blocks that gpupool took (each waits
    /// for a device synchronisation).
    pub host_frees: AtomicU64,
    /// `cudaFreeHost`/`cuMemFreeHost` that gpupool refused (inside a block, or freed already).
    pub refused_host_frees: AtomicU64,
    /// Pinned allocations passed to the real function (flags gpupool does not serve).
    pub passed_host_allocs: AtomicU64,
}

pub(crate) struct Shim {
    /// gpupool's process-wide allocator; its `config()` holds the shim's options too.
    pub alloc: &'static Allocator,
    /// gpupool's process-wide pinned host allocator (the one `gpupool_host_malloc` uses).
    pub host: &'static HostAllocator,
    pub counters: Counters,
    /// `GPUPOOL_PRELOAD_MODE` and `GPUPOOL_PRELOAD_SYNC_BYTES`, read once at start: a free
    /// then reads no configuration (which `gpupool_set_config` may replace behind a lock-free
    /// pointer, one atomic operation to load).
    mode: PreloadMode,
    sync_bytes: usize,
}

/// The shim once started (`None` inside: gpupool could not start); unset until first use.
pub(crate) static SHIM: OnceLock<Option<Shim>> = OnceLock::new();

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
    Ok(Shim::new(alloc, gpupool::ffi::process_host_allocator()?))
}

impl Shim {
    /// The shim over `alloc`, with the options of its configuration.
    fn new(alloc: &'static Allocator, host: &'static HostAllocator) -> Shim {
        let config = alloc.config();
        let (mode, sync_bytes) = (config.preload_mode, config.preload_sync_bytes);
        Shim { alloc, host, counters: Counters::default(), mode, sync_bytes }
    }
}

/// Runs `f`, turning a panic into `on_panic` (no panic may cross into the program). The
/// calling thread's end (`pthread_exit`, or cancellation) inside a callback gpupool called on
/// the way (an observer, CPython waiting for the GIL at exit) is no panic: gpupool carries it
/// out of the finished call, and it goes on from here, out of the exported function
/// (`extern "C-unwind"` for that reason), as the program's `pthread_exit` asked.
pub(crate) fn guard<R>(on_panic: R, f: impl FnOnce() -> R) -> R {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(payload) if gpupool::ffi::is_thread_exit(&*payload) => {
            drop(payload);
            gpupool::ffi::continue_thread_exit()
        }
        Err(_) => {
            say("internal error: gpupool panicked; please report this");
            on_panic
        }
    }
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
                SUCCESS
            }
            Err(e) => cuda_status(&e),
        }
    }

    /// A free through `cudaFree`/`cuMemFree` of a pointer gpupool owns: in safe mode the block
    /// waits for a device synchronisation (`Allocator::free_after_device_sync`), made here once
    /// the device's deferred bytes reach `GPUPOOL_PRELOAD_SYNC_BYTES`; in stream mode it is
    /// freed at once.
    ///
    /// Counted in `frees` when gpupool took it, else in `refused_frees`.
    ///
    /// Errors: [`Error::InvalidPointer`] for a pointer inside a block, or one already freed.
    pub fn free(&self, ptr: DevicePtr) -> Result<(), Error> {
        let r = self.free_uncounted(ptr);
        let c = &self.counters;
        bump(if r.is_ok() { &c.frees } else { &c.refused_frees });
        r
    }

    fn free_uncounted(&self, ptr: DevicePtr) -> Result<(), Error> {
        if self.mode == PreloadMode::Stream {
            return self.alloc.free(ptr);
        }
        let (device, waiting) = self.alloc.free_after_device_sync(ptr)?;
        if waiting >= self.sync_bytes
            && let Err(e) = self.alloc.release_deferred(device)
        {
            say(&format!("releasing deferred frees: {e}"));
        }
        Ok(())
    }

    /// A stream-ordered free (`cudaFreeAsync`, `cuMemFreeAsync`) of a pointer gpupool owns,
    /// counted in `async_frees` when gpupool took it, else in `refused_async_frees`.
    ///
    /// Errors: as [`Shim::free`].
    pub fn free_async(&self, ptr: DevicePtr, stream: StreamHandle) -> Result<(), Error> {
        let r = self.alloc.record_stream(ptr, stream).and_then(|()| self.alloc.free(ptr));
        let c = &self.counters;
        bump(if r.is_ok() { &c.async_frees } else { &c.refused_async_frees });
        r
    }
}

/// The shim, when the pinned free of `ptr` is gpupool's to take (the pointer lies in one of
/// its pinned blocks); `None` when it goes to the real function, counted as passed through if
/// the shim runs.
pub(crate) fn host_owner_of(ptr: usize) -> Option<&'static Shim> {
    let s = shim()?;
    if ptr != 0 && s.host.owns(ptr) {
        return Some(s);
    }
    bump(&s.counters.passed_frees);
    None
}

impl Shim {
    /// A pinned allocation served by gpupool's host allocator, counted in `counter`; the
    /// pointer given to `out` on success. Returns CUDA's status.
    pub fn serve_host(&self, counter: &AtomicU64, size: usize, out: impl FnOnce(usize)) -> c_int {
        bump(counter);
        match self.host.malloc(size) {
            Ok(p) => {
                out(p);
                SUCCESS
            }
            Err(e) => cuda_status(&e),
        }
    }

    /// A pinned free (`cudaFreeHost`, `cuMemFreeHost`) of a pointer gpupool owns, in either
    /// mode: `cudaFreeHost` waits for the device, and host memory has no stream order to rely
    /// on instead, so the block is reused only after gpupool synchronised `device` (the device
    /// current at the free): at a later allocation of its size that finds no other block,
    /// once the waiting pinned bytes reach `GPUPOOL_PRELOAD_SYNC_BYTES`, or at
    /// `gpupool_host_empty_cache`.
    ///
    /// Errors: [`Error::InvalidPointer`] for a pointer inside a block, or one already freed.
    pub fn free_host(&self, ptr: usize, device: i32) -> Result<(), Error> {
        let r = self.host.free_after_device_sync(ptr, device);
        let c = &self.counters;
        bump(if r.is_ok() { &c.host_frees } else { &c.refused_host_frees });
        if let Ok(waiting) = r
            && waiting >= self.sync_bytes
            && let Err(e) = self.host.release_deferred()
        {
            say(&format!("releasing deferred pinned frees: {e}"));
        }
        r.map(|_| ())
    }
}

extern "C" fn print_stats_at_exit() {
    guard((), || {
        if let Some(Some(s)) = SHIM.get() {
            let _ = std::io::stderr().write_all(s.report().as_bytes());
        }
    })
}

impl Shim {
    /// The exit report (`GPUPOOL_PRELOAD_STATS`): what the shim served, refused and passed
    /// through, the deferred frees, the options in force, and the memory summary of each
    /// device gpupool allocated on. Reads counters only and calls nothing in CUDA, which may
    /// have shut down by the time `atexit` handlers run.
    fn report(&self) -> String {
        let c = &self.counters;
        let n = |a: &AtomicU64| a.load(Ordering::Relaxed);
        // Summed over the devices; counters only, no CUDA call.
        let mut d = gpupool::DeferredStats::default();
        for dev in 0..self.alloc.device_count() {
            if let Ok(x) = self.alloc.deferred(dev) {
                d.blocks += x.blocks;
                d.bytes += x.bytes;
                d.syncs += x.syncs;
                d.released += x.released;
            }
        }
        let h = self.host.deferred();
        let config = self.alloc.config();
        // One fact a line, each under 100 characters with counts of a few digits, so that the
        // report reads in a terminal and greps line by line.
        let lines = [
            format!("mode {:?}", config.preload_mode),
            format!(
                "served {} cudaMalloc, {} cudaMallocAsync, {} cuMemAlloc, {} cuMemAllocAsync",
                n(&c.cuda_malloc),
                n(&c.cuda_malloc_async),
                n(&c.cu_mem_alloc),
                n(&c.cu_mem_alloc_async)
            ),
            format!(
                "{} frees, {} stream-ordered frees; refused {} frees and {} stream-ordered frees",
                n(&c.frees),
                n(&c.async_frees),
                n(&c.refused_frees),
                n(&c.refused_async_frees)
            ),
            format!("passed through {} allocations and {} frees", n(&c.passed_allocs), n(&c.passed_frees)),
            // Memory the program maps itself (ggml's VMM pool), beside gpupool's.
            format!(
                "passed through {} cuMemCreate ({} MiB created)",
                n(&crate::lookups::VMM_CREATES),
                n(&crate::lookups::VMM_BYTES) >> 20
            ),
            // dlsym of the driver and runtime, cuGetProcAddress, cudaGetDriverEntryPoint(ByVersion).
            format!(
                "CUDA lookups: served {}, passed through {}",
                n(&crate::lookups::SERVED),
                n(&crate::lookups::PASSED)
            ),
            crate::lookups::streams_report(),
            format!("{} device synchronisations released {} deferred frees", d.syncs, d.released),
            format!("{} frees ({} bytes) still deferred at exit", d.blocks, d.bytes),
            format!(
                "pinned: served {} cudaMallocHost/cudaHostAlloc, {} cuMemAllocHost/cuMemHostAlloc",
                n(&c.cuda_host_alloc),
                n(&c.cu_host_alloc)
            ),
            format!(
                "pinned: passed through {}; {} frees, refused {}",
                n(&c.passed_host_allocs),
                n(&c.host_frees),
                n(&c.refused_host_frees)
            ),
            format!("pinned: {} device synchronisations released {} deferred frees", h.syncs, h.released),
            format!("pinned: {} frees ({} bytes) still deferred at exit", h.blocks, h.bytes),
        ];
        let mut out = String::new();
        // Calls to memory functions the shim does not serve (cuMemCreate, ...), by name.
        for line in lines.into_iter().chain(crate::passed::report()) {
            out.push_str("gpupool_preload: ");
            out.push_str(&line);
            out.push('\n');
        }
        for line in config.options_text().lines() {
            out.push_str("gpupool_preload: option ");
            out.push_str(line);
            out.push('\n');
        }
        for dev in 0..self.alloc.device_count() {
            match self.alloc.stats(dev) {
                Ok(st) if st.num_device_alloc > 0 => {
                    if let Ok(text) = self.alloc.memory_summary(dev) {
                        out.push_str(&text);
                        out.push('\n');
                    }
                }
                _ => {}
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use gpupool::config::{Config, DriverKind};
    use gpupool::driver::sim::SimDriver;

    use super::*;

    /// The allocators the tests' shims borrow for the life of the process, as the shim's does;
    /// kept reachable so that leak checkers do not count them as lost.
    static KEPT: std::sync::Mutex<Vec<&'static Allocator>> = std::sync::Mutex::new(Vec::new());
    /// Likewise the pinned host allocators: a leaked one that nothing points to is what
    /// LeakSanitizer reports (its blocks' index and free lists).
    static KEPT_HOST: std::sync::Mutex<Vec<&'static HostAllocator>> = std::sync::Mutex::new(Vec::new());

    fn sim_shim(mode: PreloadMode) -> Shim {
        let config = Config { driver: DriverKind::Sim, preload_mode: mode, ..Config::default() };
        let alloc: &'static Allocator =
            Box::leak(Box::new(Allocator::new(Arc::new(SimDriver::new(1, 64 << 20)), config)));
        KEPT.lock().unwrap_or_else(|e| e.into_inner()).push(alloc);
        let host: &'static HostAllocator =
            Box::leak(Box::new(HostAllocator::new(alloc.driver().clone(), &alloc.config())));
        KEPT_HOST.lock().unwrap_or_else(|e| e.into_inner()).push(host);
        Shim::new(alloc, host)
    }

    #[test]
    fn a_refused_free_is_counted_as_refused_not_as_a_free() {
        for mode in [PreloadMode::Safe, PreloadMode::Stream] {
            let s = sim_shim(mode);
            let p = s.alloc.malloc(1000, 0, 0).unwrap();
            assert!(s.free(p + 512).is_err(), "an interior pointer");
            assert!(s.free(p).is_ok());
            assert!(s.free(p).is_err(), "a second free");
            let a = s.alloc.malloc(1 << 20, 0, 0x10).unwrap();
            assert!(s.free_async(a, 0x20).is_ok());
            assert!(s.free_async(a, 0x20).is_err());
            let h = s.host.malloc(4096).unwrap();
            assert!(s.free_host(h + 8, 0).is_err());
            assert!(s.free_host(h, 0).is_ok());
            assert!(s.free_host(h, 0).is_err());
            let r = s.report();
            let pinned = "gpupool_preload: pinned: served 0 cudaMallocHost/cudaHostAlloc, 0 cuMemAllocHost/cuMemHostAlloc\n\
                          gpupool_preload: pinned: passed through 0; 1 frees, refused 2\n\
                          gpupool_preload: pinned: 0 device synchronisations released 0 deferred frees\n\
                          gpupool_preload: pinned: 1 frees (4096 bytes) still deferred at exit\n";
            assert!(r.contains(pinned), "{r}");
            assert!(r.contains("1 frees, 1 stream-ordered frees; refused 2 frees and 1 stream-ordered frees"), "{r}");
            assert!(r.starts_with(&format!("gpupool_preload: mode {mode:?}\n")), "{r}");
            // The shim's own lines fit a terminal (the options' GPUPOOL_CONF line names every key).
            for line in r.lines().take_while(|l| !l.starts_with("gpupool_preload: option")) {
                assert!(line.len() <= 100, "{} characters: {line}", line.len());
            }
            assert!(r.contains("gpupool_preload: option GPUPOOL_DRIVER=sim\n"), "{r}");
            assert!(r.contains("gpupool memory summary, device ID 0"), "{r}");
        }
    }
}
