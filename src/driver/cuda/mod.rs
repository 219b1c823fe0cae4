//! The CUDA driver, through cudarc's bindings of the driver API (`libcuda.so.1`, loaded at run
//! time so gpupool builds and links with no CUDA toolkit).
//!
//! Every call runs in the device's primary context (`cuDevicePrimaryCtxRetain`), pushed for the
//! call and popped after, so the caller's current context is left as it was and pointers are
//! valid for code that uses the runtime API (which also uses primary contexts).
//!
//! cudarc panics when its library is missing, or when a function it is asked for is missing
//! from it (a partial stub, as some containers ship); [`CudaDriver::new`] checks for the
//! library and for every function gpupool calls first, and returns
//! [`DriverError::Unavailable`] naming what is missing instead, printing nothing.
//!
//! The virtual memory calls (expandable segments) are optional: a driver without them still
//! starts. Their functions are looked up once at start, apart from the required ones; when one is
//! missing, or the device cannot manage virtual memory, [`Driver::vmm_granularity`] says so
//! (`Ok(None)`) and the allocator keeps to `cuMemAlloc` segments, as PyTorch does when
//! `expandable_segments` cannot be honoured.

use std::ffi::{CStr, c_char};
use std::sync::OnceLock;

use cudarc::driver::sys;

use super::{
    CaptureMode, CaptureStatus, DevicePtr, Driver, DriverError, EventHandle, HostPtr, MemInfo, PhysHandle, StreamHandle,
};

/// Every driver function gpupool calls: checked at start, so that a library lacking one is
/// refused with its name instead of panicking inside cudarc at the first call.
const REQUIRED: [&str; 18] = [
    "cuInit",
    "cuGetErrorName",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDevicePrimaryCtxRetain",
    "cuCtxPushCurrent_v2",
    "cuCtxPopCurrent_v2",
    "cuCtxGetCurrent",
    "cuCtxGetDevice",
    "cuCtxSynchronize",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemGetInfo_v2",
    "cuEventCreate",
    "cuEventRecord",
    "cuEventQuery",
    "cuEventSynchronize",
    "cuEventDestroy_v2",
];

/// The driver functions of the virtual memory calls (CUDA 10.2 and later), and the two device
/// queries they depend on. Not in [`REQUIRED`]: a driver without them still starts, without
/// expandable segments. cudarc panics at the first call of a missing function, so none of
/// these is called unless all were found.
const VMM_FUNCTIONS: [&str; 10] = [
    "cuDeviceGetAttribute",
    "cuDeviceCanAccessPeer",
    "cuMemGetAllocationGranularity",
    "cuMemAddressReserve",
    "cuMemAddressFree",
    "cuMemCreate",
    "cuMemRelease",
    "cuMemMap",
    "cuMemSetAccess",
    "cuMemUnmap",
];

/// The driver functions of pinned host memory (`crate::host`), required at start with
/// [`REQUIRED`]: every driver since CUDA 4.0 has them.
const HOST_FUNCTIONS: [&str; 5] =
    ["cuMemHostAlloc", "cuMemFreeHost", "cuMemHostRegister_v2", "cuMemHostUnregister", "cuStreamGetCtx"];

/// The driver functions of stream capture (CUDA 11.3 and later). Not in [`REQUIRED`]: a
/// driver without them still starts, and no stream can capture there, so every stream reads
/// as not capturing. `cuStreamGetCaptureInfo_v2` is the symbol behind CUDA 12's
/// `cuStreamGetCaptureInfo`, still exported by CUDA 13's drivers (whose `cuStreamGetCaptureInfo`
/// has the third version's signature).
const CAPTURE_FUNCTIONS: [&str; 2] = ["cuStreamGetCaptureInfo_v2", "cuThreadExchangeStreamCaptureMode"];

/// The first of `names` for which `present` is false, in the order of `names`.
fn first_missing(names: &[&'static str], present: impl Fn(&str) -> bool) -> Option<&'static str> {
    names.iter().copied().find(|name| !present(name))
}

/// Whether the loaded driver library exports `name`. Only looks it up: never calls it.
fn exported(name: &str) -> bool {
    let symbol = format!("{name}\0");
    // SAFETY: looks a symbol up without calling it; the library is present (checked first).
    unsafe { sys::culib().get::<unsafe extern "C" fn()>(symbol.as_bytes()) }.is_ok()
}

/// The first function of [`REQUIRED`], then of [`HOST_FUNCTIONS`], that the loaded driver
/// library lacks.
fn missing_function() -> Option<&'static str> {
    first_missing(&REQUIRED, exported).or_else(|| first_missing(&HOST_FUNCTIONS, exported))
}

/// What `cuMemCreate` is asked for, and what the granularity is queried for: pinned memory on
/// device `dev` (a `CUdevice`), as PyTorch's `ExpandableSegment::map` fills it, except for the
/// handle type. PyTorch requests `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR` so that a segment
/// can be exported to another process (`ExpandableSegment::share`, for IPC of CUDA tensors);
/// gpupool shares no memory between processes, so it requests no shareable handle (none),
/// which also works where file-descriptor handles are not supported.
fn allocation_prop(dev: sys::CUdevice) -> sys::CUmemAllocationProp {
    sys::CUmemAllocationProp {
        type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE,
        location: sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: dev },
        win32HandleMetaData: std::ptr::null_mut(),
        // No compression, no GPUDirect RDMA, no special usage: what `prop = {}` leaves.
        allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: 0,
            usage: 0,
            reserved: [0; 4],
        },
    }
}

/// The devices (`CUdevice`s, of `devices`) other than `owner` that can access `owner`'s memory
/// directly: those for which `can_access(accessor, owner)` is true, the argument order of
/// `cuDeviceCanAccessPeer(&can, dev, peerDev)` ("can `dev` access memory on `peerDev`").
fn peers_of(
    owner: sys::CUdevice,
    devices: &[sys::CUdevice],
    can_access: impl Fn(sys::CUdevice, sys::CUdevice) -> Result<bool, DriverError>,
) -> Result<Vec<sys::CUdevice>, DriverError> {
    let mut peers = Vec::new();
    for &dev in devices.iter().filter(|&&d| d != owner) {
        if can_access(dev, owner)? {
            peers.push(dev);
        }
    }
    Ok(peers)
}

/// The access descriptors of one `cuMemSetAccess`: read and write from `owner` (the device
/// the memory is on), then from each of `peers`.
fn access_descs(owner: sys::CUdevice, peers: &[sys::CUdevice]) -> Vec<sys::CUmemAccessDesc> {
    std::iter::once(owner)
        .chain(peers.iter().copied())
        .map(|dev| sys::CUmemAccessDesc {
            location: sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: dev },
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        })
        .collect()
}

fn check(call: &'static str, r: sys::CUresult) -> Result<(), DriverError> {
    if r == sys::CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    if r == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
        return Err(DriverError::OutOfMemory);
    }
    let mut name: *const c_char = std::ptr::null();
    // SAFETY: cuGetErrorName writes a pointer to a static string or leaves it null.
    let named = unsafe { sys::cuGetErrorName(r, &mut name) } == sys::CUresult::CUDA_SUCCESS && !name.is_null();
    let name = if named {
        // SAFETY: non-null and NUL-terminated, owned by the driver for the process's life.
        unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned()
    } else {
        "an unknown CUDA error".to_string()
    };
    Err(DriverError::Cuda { call, code: r as i32, name })
}

/// The CUDA driver for every device of the machine.
pub struct CudaDriver {
    devices: Vec<sys::CUdevice>,
    /// Primary contexts (as integers: `CUcontext` is a raw pointer), retained on first use.
    contexts: Vec<OnceLock<Result<usize, DriverError>>>,
    /// The first of [`VMM_FUNCTIONS`] that the driver library lacks, looked up at start.
    vmm_missing: Option<&'static str>,
    /// Per device: the virtual memory granularity, `None` where the device cannot manage
    /// virtual memory; set on the first answer (a failed query is asked again next time).
    granularity: Vec<OnceLock<Option<usize>>>,
    /// Whether the driver library has every function of [`CAPTURE_FUNCTIONS`].
    capture: bool,
    /// Per device: the access descriptors of [`Driver::mem_set_access`] (the device, then its
    /// peers); set on the first success.
    access: Vec<OnceLock<Vec<sys::CUmemAccessDesc>>>,
}

impl CudaDriver {
    /// Loads `libcuda.so.1`, initialises the driver and counts the devices.
    ///
    /// Errors: [`DriverError::Unavailable`] when the library is missing or lacks a function
    /// gpupool calls (named in the message), `cuInit` fails or no device is present; [`DriverError::Cuda`] for other failures.
    pub fn new() -> Result<CudaDriver, DriverError> {
        // SAFETY: only tries to open the library; nothing is called through it.
        if !unsafe { sys::is_culib_present() } {
            return Err(DriverError::Unavailable(
                "the CUDA driver library (libcuda.so.1) was not found: this machine has no NVIDIA driver; \
                 set GPUPOOL_DRIVER=sim to use the simulated device"
                    .into(),
            ));
        }
        if let Some(name) = missing_function() {
            return Err(DriverError::Unavailable(format!(
                "the CUDA driver library (libcuda.so.1) lacks {name}, which gpupool needs: the driver is incomplete \
                 or too old; set GPUPOOL_DRIVER=sim to use the simulated device"
            )));
        }
        // SAFETY: the library is present; cuInit takes flags 0.
        check("cuInit", unsafe { sys::cuInit(0) }).map_err(|e| {
            DriverError::Unavailable(format!(
                "the CUDA driver could not be initialised ({e}); set GPUPOOL_DRIVER=sim to use the simulated device"
            ))
        })?;
        let mut count = 0;
        // SAFETY: writes one int.
        check("cuDeviceGetCount", unsafe { sys::cuDeviceGetCount(&mut count) })?;
        if count <= 0 {
            return Err(DriverError::Unavailable(
                "the CUDA driver reports no device; set GPUPOOL_DRIVER=sim to use the simulated device".into(),
            ));
        }
        let mut devices = Vec::with_capacity(count as usize);
        for ordinal in 0..count {
            let mut dev = 0;
            // SAFETY: ordinal is in range; writes one CUdevice.
            check("cuDeviceGet", unsafe { sys::cuDeviceGet(&mut dev, ordinal) })?;
            devices.push(dev);
        }
        fn per_device<T>(count: i32) -> Vec<OnceLock<T>> {
            (0..count).map(|_| OnceLock::new()).collect()
        }
        let vmm_missing = first_missing(&VMM_FUNCTIONS, exported);
        let capture = first_missing(&CAPTURE_FUNCTIONS, exported).is_none();
        Ok(CudaDriver {
            capture,
            devices,
            contexts: per_device(count),
            vmm_missing,
            granularity: per_device(count),
            access: per_device(count),
        })
    }

    fn context(&self, device: i32) -> Result<sys::CUcontext, DriverError> {
        let ctx = self.contexts[device as usize].get_or_init(|| {
            let mut ctx: sys::CUcontext = std::ptr::null_mut();
            // SAFETY: the device handle came from cuDeviceGet; the context is retained for the
            // life of the process (never released: pointers handed out stay valid until exit).
            check("cuDevicePrimaryCtxRetain", unsafe {
                sys::cuDevicePrimaryCtxRetain(&mut ctx, self.devices[device as usize])
            })
            .map(|_| ctx as usize)
        });
        ctx.clone().map(|c| c as sys::CUcontext)
    }

    /// `Ok` when the driver library has every virtual memory function; otherwise
    /// [`DriverError::Unavailable`] naming the missing one, before anything calls it (cudarc
    /// would panic).
    fn vmm_functions(&self) -> Result<(), DriverError> {
        match self.vmm_missing {
            None => Ok(()),
            Some(name) => Err(DriverError::Unavailable(format!(
                "the CUDA driver library (libcuda.so.1) lacks {name}, which the virtual memory calls of \
                 expandable segments need: the driver is too old or incomplete; expandable segments are unavailable"
            ))),
        }
    }

    /// The granularity of [`Driver::vmm_granularity`], or [`DriverError::Unavailable`] where
    /// the device cannot manage virtual memory.
    fn granularity(&self, device: i32) -> Result<usize, DriverError> {
        self.vmm_granularity(device)?.ok_or_else(|| {
            DriverError::Unavailable(format!(
                "device {device} cannot manage virtual memory \
                 (CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED is 0): expandable segments are unavailable"
            ))
        })
    }

    /// Runs `f` with the device's primary context current, then restores the caller's.
    fn in_context<R>(&self, device: i32, f: impl FnOnce() -> Result<R, DriverError>) -> Result<R, DriverError> {
        let ctx = self.context(device)?;
        // SAFETY: a retained primary context.
        check("cuCtxPushCurrent", unsafe { sys::cuCtxPushCurrent_v2(ctx) })?;
        let r = f();
        let mut popped: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: pops the context pushed above.
        let pop = check("cuCtxPopCurrent", unsafe { sys::cuCtxPopCurrent_v2(&mut popped) });
        match (r, pop) {
            (Ok(v), Ok(())) => Ok(v),
            (Err(e), _) | (Ok(_), Err(e)) => Err(e),
        }
    }
}

impl Driver for CudaDriver {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn device_count(&self) -> i32 {
        self.devices.len() as i32
    }

    fn current_device(&self) -> Result<i32, DriverError> {
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: writes one pointer.
        check("cuCtxGetCurrent", unsafe { sys::cuCtxGetCurrent(&mut ctx) })?;
        if ctx.is_null() {
            // No context yet: the runtime API would use device 0.
            return Ok(0);
        }
        let mut dev = 0;
        // SAFETY: a context is current; writes one CUdevice.
        check("cuCtxGetDevice", unsafe { sys::cuCtxGetDevice(&mut dev) })?;
        Ok(self.devices.iter().position(|&d| d == dev).map_or(0, |p| p as i32))
    }

    fn mem_alloc(&self, device: i32, size: usize) -> Result<DevicePtr, DriverError> {
        self.in_context(device, || {
            let mut ptr: sys::CUdeviceptr = 0;
            // SAFETY: writes one device pointer.
            check("cuMemAlloc", unsafe { sys::cuMemAlloc_v2(&mut ptr, size) })?;
            Ok(ptr)
        })
    }

    fn mem_free(&self, device: i32, ptr: DevicePtr) -> Result<(), DriverError> {
        // SAFETY: `ptr` came from mem_alloc on this device and is not in use by gpupool.
        self.in_context(device, || check("cuMemFree", unsafe { sys::cuMemFree_v2(ptr) }))
    }

    fn mem_info(&self, device: i32) -> Result<MemInfo, DriverError> {
        self.in_context(device, || {
            let (mut free, mut total) = (0usize, 0usize);
            // SAFETY: writes two sizes.
            check("cuMemGetInfo", unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) })?;
            Ok(MemInfo { free, total })
        })
    }

    fn event_create(&self, device: i32) -> Result<EventHandle, DriverError> {
        self.in_context(device, || {
            let mut ev: sys::CUevent = std::ptr::null_mut();
            let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
            // SAFETY: writes one event handle.
            check("cuEventCreate", unsafe { sys::cuEventCreate(&mut ev, flags) })?;
            Ok(EventHandle(ev as u64))
        })
    }

    fn event_record(&self, device: i32, event: EventHandle, stream: StreamHandle) -> Result<(), DriverError> {
        self.in_context(device, || {
            // SAFETY: the event came from event_create; the stream is the caller's handle.
            check("cuEventRecord", unsafe { sys::cuEventRecord(event.0 as sys::CUevent, stream as sys::CUstream) })
        })
    }

    fn event_query(&self, event: EventHandle) -> Result<bool, DriverError> {
        // SAFETY: the event came from event_create.
        let r = unsafe { sys::cuEventQuery(event.0 as sys::CUevent) };
        if r == sys::CUresult::CUDA_ERROR_NOT_READY {
            return Ok(false);
        }
        check("cuEventQuery", r).map(|_| true)
    }

    fn event_synchronize(&self, event: EventHandle) -> Result<(), DriverError> {
        // SAFETY: the event came from event_create.
        check("cuEventSynchronize", unsafe { sys::cuEventSynchronize(event.0 as sys::CUevent) })
    }

    fn event_destroy(&self, device: i32, event: EventHandle) {
        // SAFETY: the event came from event_create and is no longer used. A failure leaks one
        // event and needs no report.
        let _ = self
            .in_context(device, || check("cuEventDestroy", unsafe { sys::cuEventDestroy_v2(event.0 as sys::CUevent) }));
    }

    fn device_synchronize(&self, device: i32) -> Result<(), DriverError> {
        // SAFETY: no arguments; runs in the device's primary context.
        self.in_context(device, || check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() }))
    }

    fn current_primary_device(&self) -> Result<Option<i32>, DriverError> {
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: writes one pointer.
        check("cuCtxGetCurrent", unsafe { sys::cuCtxGetCurrent(&mut ctx) })?;
        if ctx.is_null() {
            return Ok(None);
        }
        let mut dev = 0;
        // SAFETY: a context is current; writes one CUdevice.
        check("cuCtxGetDevice", unsafe { sys::cuCtxGetDevice(&mut dev) })?;
        let Some(ordinal) = self.devices.iter().position(|&d| d == dev) else { return Ok(None) };
        let primary = self.context(ordinal as i32)?;
        Ok((primary == ctx).then_some(ordinal as i32))
    }

    fn host_alloc(&self, device: i32, size: usize) -> Result<HostPtr, DriverError> {
        self.in_context(device, || {
            let mut p: *mut std::ffi::c_void = std::ptr::null_mut();
            // SAFETY: writes one pointer; PORTABLE makes the memory usable from every context.
            check("cuMemHostAlloc", unsafe { sys::cuMemHostAlloc(&mut p, size, sys::CU_MEMHOSTALLOC_PORTABLE) })?;
            Ok(p as HostPtr)
        })
    }

    fn host_free(&self, device: i32, ptr: HostPtr) -> Result<(), DriverError> {
        // SAFETY: `ptr` came from host_alloc and no work uses it (the caller's duty).
        self.in_context(device, || check("cuMemFreeHost", unsafe { sys::cuMemFreeHost(ptr as *mut _) }))
    }

    fn host_register(&self, device: i32, ptr: HostPtr, size: usize) -> Result<(), DriverError> {
        let flags = sys::CU_MEMHOSTREGISTER_PORTABLE;
        // SAFETY: `ptr` points to `size` bytes the caller owns, allocated and not registered yet.
        self.in_context(device, || {
            check("cuMemHostRegister", unsafe { sys::cuMemHostRegister_v2(ptr as *mut _, size, flags) })
        })
    }

    fn host_unregister(&self, device: i32, ptr: HostPtr) -> Result<(), DriverError> {
        // SAFETY: `ptr` is the start of a range registered by host_register.
        self.in_context(device, || check("cuMemHostUnregister", unsafe { sys::cuMemHostUnregister(ptr as *mut _) }))
    }

    fn stream_device(&self, stream: StreamHandle) -> Result<i32, DriverError> {
        // The legacy default stream and the two special handles name the current context's.
        if stream <= 2 {
            return self.current_device();
        }
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: `stream` is the caller's stream handle; writes one pointer.
        check("cuStreamGetCtx", unsafe { sys::cuStreamGetCtx(stream as sys::CUstream, &mut ctx) })?;
        // SAFETY: a valid context from the driver, pushed for the query and popped after.
        check("cuCtxPushCurrent", unsafe { sys::cuCtxPushCurrent_v2(ctx) })?;
        let mut dev = 0;
        // SAFETY: a context is current; writes one CUdevice.
        let r = check("cuCtxGetDevice", unsafe { sys::cuCtxGetDevice(&mut dev) });
        let mut popped: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: pops the context pushed above.
        check("cuCtxPopCurrent", unsafe { sys::cuCtxPopCurrent_v2(&mut popped) })?;
        r?;
        Ok(self.devices.iter().position(|&d| d == dev).map_or(0, |p| p as i32))
    }

    fn vmm_granularity(&self, device: i32) -> Result<Option<usize>, DriverError> {
        if self.vmm_missing.is_some() {
            return Ok(None);
        }
        let cached = &self.granularity[device as usize];
        if let Some(&g) = cached.get() {
            return Ok(g);
        }
        let dev = self.devices[device as usize];
        let g = self.in_context(device, || {
            let mut supported = 0;
            let attr = sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED;
            // SAFETY: writes one int; cuDeviceGetAttribute was found at start.
            check("cuDeviceGetAttribute", unsafe { sys::cuDeviceGetAttribute(&mut supported, attr, dev) })?;
            if supported == 0 {
                return Ok(None);
            }
            let prop = allocation_prop(dev);
            let mut granularity = 0usize;
            let minimum = sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM;
            // SAFETY: writes one size; `prop` outlives the call.
            check("cuMemGetAllocationGranularity", unsafe {
                sys::cuMemGetAllocationGranularity(&mut granularity, &prop, minimum)
            })?;
            // A granularity of 0 cannot size pages: treated as no virtual memory management.
            Ok((granularity > 0).then_some(granularity))
        })?;
        Ok(*cached.get_or_init(|| g))
    }

    /// Asks for the granularity as the alignment: the trait promises it and `cuMemMap` needs
    /// addresses that are multiples of it. PyTorch passes 0 (the driver's default alignment)
    /// and relies on that default being enough; an explicit alignment must be a power of two,
    /// so any other granularity falls back to the default.
    fn address_reserve(&self, device: i32, size: usize) -> Result<DevicePtr, DriverError> {
        self.vmm_functions()?;
        let granularity = self.granularity(device)?;
        let alignment = if granularity.is_power_of_two() { granularity } else { 0 };
        self.in_context(device, || {
            let mut ptr: sys::CUdeviceptr = 0;
            // SAFETY: writes one device pointer; no address hint (0), flags 0 as required.
            check("cuMemAddressReserve", unsafe { sys::cuMemAddressReserve(&mut ptr, size, alignment, 0, 0) })?;
            Ok(ptr)
        })
    }

    fn address_free(&self, device: i32, ptr: DevicePtr, size: usize) -> Result<(), DriverError> {
        self.vmm_functions()?;
        // SAFETY: `ptr` and `size` are a whole reservation from address_reserve, unmapped.
        self.in_context(device, || check("cuMemAddressFree", unsafe { sys::cuMemAddressFree(ptr, size) }))
    }

    fn mem_create(&self, device: i32, size: usize) -> Result<PhysHandle, DriverError> {
        self.vmm_functions()?;
        let prop = allocation_prop(self.devices[device as usize]);
        self.in_context(device, || {
            let mut handle: sys::CUmemGenericAllocationHandle = 0;
            // SAFETY: writes one handle; `prop` outlives the call; flags 0 as required. Any
            // failure (CUDA_ERROR_NOT_PERMITTED under cuda-gdb, for one) is returned.
            check("cuMemCreate", unsafe { sys::cuMemCreate(&mut handle, size, &prop, 0) })?;
            Ok(PhysHandle(handle))
        })
    }

    fn mem_release(&self, device: i32, handle: PhysHandle) -> Result<(), DriverError> {
        self.vmm_functions()?;
        // SAFETY: a handle from mem_create, mapped nowhere and not used after.
        self.in_context(device, || check("cuMemRelease", unsafe { sys::cuMemRelease(handle.0) }))
    }

    fn mem_map(&self, device: i32, ptr: DevicePtr, size: usize, handle: PhysHandle) -> Result<(), DriverError> {
        self.vmm_functions()?;
        // SAFETY: maps the whole handle (offset 0, `size` bytes) at `ptr`, inside a reservation
        // of this device; flags 0 as required.
        self.in_context(device, || check("cuMemMap", unsafe { sys::cuMemMap(ptr, size, 0, handle.0, 0) }))
    }

    /// One `cuMemSetAccess` for the device and all its peers (the devices for which
    /// `cuDeviceCanAccessPeer(&can, peer, device)` is 1, found once per device).
    ///
    /// Peer access: a program needs to do nothing more than use the memory from a peer. Memory
    /// from `cuMemAlloc` becomes reachable from another device only after that device's context
    /// calls `cuCtxEnablePeerAccess`/`cudaDeviceEnablePeerAccess`, which maps every past and
    /// future allocation of the peer; memory mapped with `cuMemMap` is instead reachable from
    /// exactly the devices named to `cuMemSetAccess`, and peer-access enabling does not apply
    /// to it (CUDA Programming Guide, section "Virtual Memory Management",
    /// docs.nvidia.com/cuda/cuda-programming-guide/04-special-topics/virtual-memory-management.html;
    /// `cuMemMap`'s reference: mapping alone does not make the address accessible; PyTorch's
    /// Note [Expandable Segments]: cudaDeviceEnablePeerAccess does not work for memory from
    /// cuMemMap, the mappings have to be made by hand). So this call grants every capable peer
    /// read and write, and such a peer reaches the memory whether or not the program enabled
    /// peer access. PyTorch grants only the peers a program enabled through the allocator's
    /// `enablePeerAccess`; gpupool has no such call, so it grants all that can.
    fn mem_set_access(&self, device: i32, ptr: DevicePtr, size: usize) -> Result<(), DriverError> {
        self.vmm_functions()?;
        let owner = self.devices[device as usize];
        self.in_context(device, || {
            let cached = &self.access[device as usize];
            let descs = match cached.get() {
                Some(descs) => descs,
                None => {
                    let peers = peers_of(owner, &self.devices, |dev, peer_dev| {
                        let mut can = 0;
                        // SAFETY: writes one int; both are devices from cuDeviceGet.
                        check("cuDeviceCanAccessPeer", unsafe { sys::cuDeviceCanAccessPeer(&mut can, dev, peer_dev) })?;
                        Ok(can == 1)
                    })?;
                    cached.get_or_init(|| access_descs(owner, &peers))
                }
            };
            // SAFETY: `descs` holds descs.len() descriptors and outlives the call; the range
            // is wholly mapped (the caller mapped it).
            check("cuMemSetAccess", unsafe { sys::cuMemSetAccess(ptr, size, descs.as_ptr(), descs.len()) })
        })
    }

    fn mem_unmap(&self, device: i32, ptr: DevicePtr, size: usize) -> Result<(), DriverError> {
        self.vmm_functions()?;
        // SAFETY: whole mappings made by mem_map; no work uses them (the caller's duty).
        self.in_context(device, || check("cuMemUnmap", unsafe { sys::cuMemUnmap(ptr, size) }))
    }

    /// In the device's primary context, where the legacy default stream (0) is the one the
    /// runtime API's kernels use.
    fn stream_capture_status(&self, device: i32, stream: StreamHandle) -> Result<CaptureStatus, DriverError> {
        if !self.capture {
            return Ok(CaptureStatus::None);
        }
        self.in_context(device, || {
            let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
            let mut id: sys::cuuint64_t = 0;
            // SAFETY: writes the status and the id; the graph and dependency outputs are
            // optional (NULL). The stream is the caller's handle.
            check("cuStreamGetCaptureInfo", unsafe {
                sys::cuStreamGetCaptureInfo_v2(
                    stream as sys::CUstream,
                    &mut status,
                    &mut id,
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                )
            })?;
            Ok(capture_status(status, id))
        })
    }

    fn exchange_capture_mode(&self, mode: CaptureMode) -> Result<CaptureMode, DriverError> {
        if !self.capture {
            return Ok(mode);
        }
        let mut m = match mode {
            CaptureMode::Global => sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL,
            CaptureMode::ThreadLocal => sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            CaptureMode::Relaxed => sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
        };
        // SAFETY: reads and writes one mode; affects the calling thread only.
        check("cuThreadExchangeStreamCaptureMode", unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut m) })?;
        Ok(match m {
            sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL => CaptureMode::Global,
            sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL => CaptureMode::ThreadLocal,
            sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED => CaptureMode::Relaxed,
        })
    }
}

/// The status `cuStreamGetCaptureInfo` wrote, with the capture's id when active.
fn capture_status(status: sys::CUstreamCaptureStatus, id: u64) -> CaptureStatus {
    match status {
        sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE => CaptureStatus::None,
        sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE => CaptureStatus::Active(id),
        sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_INVALIDATED => CaptureStatus::Invalidated,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_old_driver_starts_without_the_virtual_memory_functions() {
        for name in VMM_FUNCTIONS {
            assert!(!REQUIRED.contains(&name), "{name} is required at start, so a driver without it would not start");
        }
    }

    /// The simulated device's missing-symbol faults name functions this driver checks for, so
    /// a fault injected there stands for a library this driver would see.
    #[test]
    fn every_simulated_call_names_a_checked_function() {
        for op in crate::driver::sim::SimOp::ALL {
            let name = op.symbol();
            let checked =
                [&REQUIRED[..], &VMM_FUNCTIONS, &HOST_FUNCTIONS, &CAPTURE_FUNCTIONS].iter().any(|l| l.contains(&name));
            assert!(checked, "{op:?}: {name} is never checked");
        }
    }

    #[test]
    fn capture_statuses_and_modes_have_cuda_h_values() {
        use sys::CUstreamCaptureStatus as S;
        assert_eq!(capture_status(S::CU_STREAM_CAPTURE_STATUS_NONE, 9), CaptureStatus::None);
        assert_eq!(capture_status(S::CU_STREAM_CAPTURE_STATUS_ACTIVE, 9), CaptureStatus::Active(9));
        assert_eq!(capture_status(S::CU_STREAM_CAPTURE_STATUS_INVALIDATED, 9), CaptureStatus::Invalidated);
        assert_eq!(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED as u32, 2);
        assert_eq!(sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED as u32, 900);
        assert_eq!(sys::CUresult::CUDA_ERROR_CAPTURED_EVENT as u32, 907);
        for name in CAPTURE_FUNCTIONS {
            assert!(!REQUIRED.contains(&name), "{name} is required at start, so a driver without it would not start");
        }
    }

    #[test]
    fn the_first_missing_function_is_named_in_list_order() {
        let all = |_: &str| true;
        assert_eq!(first_missing(&VMM_FUNCTIONS, all), None);
        let without = |gone: &'static [&'static str]| move |name: &str| !gone.contains(&name);
        assert_eq!(first_missing(&VMM_FUNCTIONS, without(&["cuMemUnmap", "cuMemCreate"])), Some("cuMemCreate"));
        assert_eq!(first_missing(&VMM_FUNCTIONS, without(&["cuDeviceCanAccessPeer"])), Some("cuDeviceCanAccessPeer"));
        assert_eq!(first_missing(&REQUIRED, without(&["cuMemAlloc_v2"])), Some("cuMemAlloc_v2"));
    }

    #[test]
    fn peers_are_the_other_devices_that_can_reach_the_owner() {
        // Device 1 reaches 0's memory; 0 and 2 reach each other; 2 reaches 1 but not the
        // reverse; every device "reaches itself", which must not make it its own peer.
        let reaches = [(1, 0), (0, 2), (2, 0), (2, 1), (0, 0), (1, 1), (2, 2)];
        let can = |dev: sys::CUdevice, peer_dev: sys::CUdevice| Ok(reaches.contains(&(dev, peer_dev)));
        let devices = [0, 1, 2];
        assert_eq!(peers_of(0, &devices, can).unwrap(), vec![1, 2]);
        assert_eq!(peers_of(1, &devices, can).unwrap(), vec![2]);
        assert_eq!(peers_of(2, &devices, can).unwrap(), vec![0]);
        assert_eq!(peers_of(0, &[0], can).unwrap(), Vec::<sys::CUdevice>::new());
    }

    #[test]
    fn a_failed_peer_query_is_returned() {
        let failing = |_, _| Err(DriverError::Cuda { call: "cuDeviceCanAccessPeer", code: 101, name: "x".into() });
        assert!(matches!(peers_of(0, &[0, 1], failing), Err(DriverError::Cuda { code: 101, .. })));
        // A single device asks nothing.
        assert_eq!(peers_of(0, &[0], failing).unwrap(), Vec::<sys::CUdevice>::new());
    }

    #[test]
    fn access_is_read_write_for_the_owner_then_each_peer() {
        let descs = access_descs(3, &[1, 5]);
        let ids: Vec<i32> = descs.iter().map(|d| d.location.id).collect();
        assert_eq!(ids, [3, 1, 5]);
        for d in &descs {
            assert_eq!(d.location.type_, sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE);
            assert_eq!(d.flags, sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
        }
        assert_eq!(access_descs(0, &[]).len(), 1);
    }

    #[test]
    fn memory_is_pinned_on_the_device_with_no_shareable_handle() {
        let prop = allocation_prop(7);
        assert_eq!(prop.type_, sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED);
        assert_eq!(prop.requestedHandleTypes, sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE);
        assert_eq!(prop.location.type_, sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE);
        assert_eq!(prop.location.id, 7);
        assert!(prop.win32HandleMetaData.is_null());
        assert_eq!(prop.allocFlags.compressionType, 0);
        assert_eq!(prop.allocFlags.gpuDirectRDMACapable, 0);
        assert_eq!(prop.allocFlags.usage, 0);
    }

    /// The layouts the driver reads, as cuda.h (12.x) declares them on 64-bit Linux: cudarc's
    /// bindings are generated per CUDA version, and a mismatch would pass garbage silently.
    #[test]
    fn the_structs_have_cuda_h_layouts() {
        use std::mem::{offset_of, size_of};
        assert_eq!(size_of::<sys::CUmemLocation>(), 8);
        assert_eq!(offset_of!(sys::CUmemLocation, id), 4);
        assert_eq!(size_of::<sys::CUmemAccessDesc>(), 12);
        assert_eq!(offset_of!(sys::CUmemAccessDesc, flags), 8);
        assert_eq!(size_of::<sys::CUmemAllocationProp>(), 32);
        assert_eq!(offset_of!(sys::CUmemAllocationProp, requestedHandleTypes), 4);
        assert_eq!(offset_of!(sys::CUmemAllocationProp, location), 8);
        assert_eq!(offset_of!(sys::CUmemAllocationProp, win32HandleMetaData), 16);
        assert_eq!(offset_of!(sys::CUmemAllocationProp, allocFlags), 24);
        assert_eq!(size_of::<sys::CUmemGenericAllocationHandle>(), 8);
        assert_eq!(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED as i32, 102);
        assert_eq!(sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM as i32, 0);
    }
}
