//! `libgpupool_preload.so`: gpupool under a CUDA program that was not written for it.
//!
//! ```text
//! LD_PRELOAD=libgpupool_preload.so ./program
//! ```
//!
//! The library exports the CUDA allocation functions, so that the dynamic linker binds the
//! program's calls to them instead of to CUDA's, and serves them from gpupool's process-wide
//! allocator (the one the C API uses, so `gpupool_stats` from the same process sees it):
//!
//! | call | served by gpupool when | otherwise |
//! |---|---|---|
//! | `cudaMalloc`, `cudaMallocAsync` | always (gpupool started) | the real function |
//! | `cuMemAlloc_v2`, `cuMemAllocAsync` | a primary context is current (the runtime API's) | the real function |
//! | `cudaFree`, `cudaFreeAsync`, `cuMemFree_v2`, `cuMemFreeAsync` | the pointer is gpupool's | the real function |
//! | `cudaFree(NULL)` | on the simulated device: success, as CUDA's no-op | the real function (it initialises the runtime) |
//! | `cudaMallocHost`, `cudaHostAlloc`, `cuMemAllocHost_v2`, `cuMemHostAlloc` | flags default or portable (gpupool started): gpupool's pinned host allocator | the real function (other flags: mapped, write-combined) |
//! | `cudaFreeHost`, `cuMemFreeHost` | the pointer is one of gpupool's pinned blocks | the real function |
//! | `cuMemFreeAsync_ptsz` (the per-thread default stream's) | the pointer is gpupool's (NULL stream: as `cuMemFree`) | the real function |
//! | `cudaStreamDestroy`, `cuStreamDestroy_v2`, `cuStreamDestroy` | never: gpupool started, it first waits for the stream if it holds anything of it (`Allocator::retire_stream`), then the real function | - |
//! | `cuGetProcAddress`, `cuGetProcAddress_v2`, `cuGetProcAddress_v2_ptsz` | always: the real lookup, with gpupool's functions returned for the driver symbols above (`cuMemAllocAsync` not for the per-thread default stream) | - |
//! | `cudaGetDriverEntryPoint`, `cudaGetDriverEntryPointByVersion` and their `_ptsz` twins | always: the runtime's lookup, with gpupool's functions returned as by `cuGetProcAddress` | - |
//! | `cuMemCreate` | never: counted for the exit report, then the real function (memory a program maps itself, as ggml's VMM pool does) | - |
//! | `dlsym` | a driver or runtime function above that glibc finds in a `libcuda.so*` or `libcudart.so*` (a handle opened by any name or path, or of a library that links it): the shim's function | glibc's, unchanged (`RTLD_DEFAULT`, `RTLD_NEXT` too) |
//!
//! Everything else is the real library's: the shim defines nothing else. On a machine without
//! `libcuda.so` (the simulated device, `GPUPOOL_DRIVER=sim`), a driver call that would go to the
//! real function returns `CUDA_ERROR_NOT_INITIALIZED` (3), as the driver does before `cuInit`
//! has succeeded, and prints nothing. Memory from
//! gpupool is valid in the device's primary context, so a driver-API allocation made while a
//! context the program created itself (`cuCtxCreate`) is current goes to the real driver.
//!
//! Its options are `GPUPOOL_PRELOAD_MODE`, `GPUPOOL_PRELOAD_SYNC_BYTES` and
//! `GPUPOOL_PRELOAD_STATS`, read with gpupool's own options by the one reader of
//! `gpupool::config`, whose list gives their syntax and defaults; gpupool's own apply to the
//! shim's allocator too (`GPUPOOL_RECORD_HISTORY` with `GPUPOOL_SNAPSHOT_AT_EXIT` writes a
//! snapshot for PyTorch's viewer at exit). A value that does not parse
//! stops gpupool from starting: every call then passes through to CUDA, and the reason is
//! written to stderr once.
//!
//! ## When a freed block is reused
//!
//! A program may rely on `cudaFree` waiting for the device: memory it frees is not in use by
//! any kernel or copy issued before. gpupool does not wait at the free, so by default
//! (`GPUPOOL_PRELOAD_MODE=safe`) a block freed with `cudaFree` or `cuMemFree` is *deferred*
//! (`Allocator::free_after_device_sync`): gpupool hands it out again only after it has
//! synchronised the device (`cuCtxSynchronize`) after the free, which happens once for every
//! deferred block, when the device's deferred blocks reach `GPUPOOL_PRELOAD_SYNC_BYTES`
//! (default 256 MiB), and when an allocation finds the device full (gpupool then retries from
//! the cache before releasing it). So a block is never handed out again while work issued
//! before its free, on any stream, may still use it. Until then gpupool counts it as active
//! and no longer allocated, as PyTorch counts a block awaiting `record_stream` events.
//!
//! `GPUPOOL_PRELOAD_MODE=stream` is the faster opt-in for programs that use one stream: a freed
//! block goes back to gpupool at once and is reused by later allocations in stream order, as
//! PyTorch's caching allocator does. Every `cudaMalloc` is counted against the legacy default
//! stream.
//!
//! `cudaFreeAsync(ptr, stream)` and `cuMemFreeAsync` are stream-ordered by CUDA's definition
//! and never deferred: gpupool records `stream` on the block (`record_stream`) and frees it,
//! so the block is reused on its allocating stream at once if `stream` is that stream, and
//! after `stream` has passed the free otherwise.
//!
//! ## Pinned host memory
//!
//! `cudaMallocHost`, `cudaHostAlloc` and their driver twins are served by gpupool's caching
//! host allocator (`gpupool_host_malloc`: sizes rounded up to a power of two up to 1 MiB, to a
//! 32nd of one above, blocks cached per size class), so a program that pins and unpins staging buffers in a loop stops paying
//! milliseconds per call. A program may rely on `cudaFreeHost` waiting for the device, so a
//! block freed with `cudaFreeHost` or `cuMemFreeHost` is reused only after gpupool has
//! synchronised the device that was current at the free: when a later pinned allocation of its
//! size finds no other free block, when the waiting pinned bytes reach
//! `GPUPOOL_PRELOAD_SYNC_BYTES`, or at `gpupool_host_empty_cache`. This holds in both modes:
//! host memory has no stream order that `GPUPOOL_PRELOAD_MODE=stream` could rely on instead.
//! `cudaHostAllocMapped` and `cudaHostAllocWriteCombined` (`CU_MEMHOSTALLOC_DEVICEMAP`,
//! `CU_MEMHOSTALLOC_WRITECOMBINED`) ask for memory of another kind: those calls, and frees of
//! their pointers, go to CUDA. `cudaHostRegister` is not interposed.
//!
//! ## What is not caught
//!
//! A statically linked CUDA runtime (nvcc's default, `-cudart static`) is part of the program:
//! its `cudaMalloc` is not a dynamic symbol, and it finds the driver through its own handle of
//! `libcuda.so`, so neither its runtime nor its driver calls reach the shim. Build with
//! `-cudart shared` (PyTorch's libraries link `libcudart.so` dynamically). A program that calls
//! the driver API directly (`-lcuda`, or `cuGetProcAddress` through its dynamic symbol) is
//! caught, and so is one that opens the driver itself (`dlopen("libcuda.so.1")`, then `dlsym`
//! and `cuGetProcAddress`, as XLA does; x86-64 glibc only, see `dlsym.rs`), and one that
//! resolves the runtime with `dlsym` in its handle. `dlvsym` is not interposed. `cudaMallocManaged`, `cudaMallocPitch`, `cuMemCreate` and the
//! other allocation functions are not interposed (`cuMemCreate` called by name is counted, `vmm.rs`); their frees pass through. Where the program
//! looks one of them up (`dlsym` in the driver's or runtime's handle, `cuGetProcAddress`,
//! `cudaGetDriverEntryPoint`), it gets the real function behind a counting trampoline
//! (`passed.rs`), and the exit report names the calls that went past gpupool.
//!
//! ## Statistics at exit
//!
//! `GPUPOOL_PRELOAD_STATS=1` writes to stderr, when the program exits, what the shim served,
//! refused (frees gpupool answered with an error: a pointer inside one of its blocks, or one
//! freed already; they are not counted as frees) and passed through, the lookups (`dlsym` of
//! driver or runtime functions, `cuGetProcAddress`, `cudaGetDriverEntryPoint`) it answered
//! with its own and the driver lookups it passed through, the calls to memory functions it
//! does not serve (`passed through 812 calls to cuMemCreate (not served)`), the stream
//! destroys it retired first and how many of them waited, the deferred frees, every
//! option with its value (`Config::options_text`), and gpupool's memory summary of each device
//! it used, and the same for pinned host memory. It reads gpupool's counters only and calls nothing in CUDA, which may have shut
//! down by then.
//!
//! ## The files
//!
//! - `runtime_api.rs`: the CUDA runtime's allocation functions, interposed;
//! - `driver_api.rs`: the driver API's allocation functions and `cuGetProcAddress`, interposed;
//! - `dlsym.rs`: `dlsym`, interposed, for programs that open the driver themselves;
//! - `shim.rs`: the shim's state: gpupool's process-wide allocator, the deferred frees, the
//!   counters printed at exit;
//! - `lookups.rs`: counts of the lookups of driver functions, for the exit report;
//! - `passed.rs`: calls to memory functions the shim does not serve, counted by name;
//! - `real.rs`: how the shim reaches the real driver's and runtime's functions;
//! - `vmm.rs`: `cuMemCreate`, interposed only to be counted;
//! - `streams.rs`: `cudaStreamDestroy` and `cuStreamDestroy`, interposed so that gpupool waits
//!   for a stream it holds blocks of before CUDA gives its handle to the next stream created.

// glibc's dlsym is entered with the caller's return address by x86-64 assembly (dlsym.rs).
#[cfg(all(target_arch = "x86_64", target_os = "linux", target_env = "gnu"))]
mod dlsym;
mod driver_api;
mod lookups;
mod passed;
mod real;
mod runtime_api;
mod shim;
mod streams;
mod vmm;
