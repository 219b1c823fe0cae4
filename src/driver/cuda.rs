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

use std::ffi::{CStr, c_char};
use std::sync::OnceLock;

use cudarc::driver::sys;

use super::{DevicePtr, Driver, DriverError, EventHandle, MemInfo, PhysHandle, StreamHandle};

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

/// The first function of [`REQUIRED`] that the loaded driver library lacks.
fn missing_function() -> Option<&'static str> {
    REQUIRED.into_iter().find(|name| {
        let symbol = format!("{name}\0");
        // SAFETY: looks a symbol up without calling it; the library is present (checked first).
        unsafe { sys::culib().get::<unsafe extern "C" fn()>(symbol.as_bytes()) }.is_err()
    })
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
        let contexts = (0..count).map(|_| OnceLock::new()).collect();
        Ok(CudaDriver { devices, contexts })
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

    // Virtual memory: not yet on the CUDA driver; expandable segments are unavailable there.
    fn vmm_granularity(&self, _device: i32) -> Result<Option<usize>, DriverError> {
        Ok(None)
    }

    fn address_reserve(&self, _device: i32, _size: usize) -> Result<DevicePtr, DriverError> {
        Err(DriverError::Unavailable("virtual memory calls are not wired to the CUDA driver".into()))
    }

    fn address_free(&self, _device: i32, _ptr: DevicePtr, _size: usize) -> Result<(), DriverError> {
        Err(DriverError::Unavailable("virtual memory calls are not wired to the CUDA driver".into()))
    }

    fn mem_create(&self, _device: i32, _size: usize) -> Result<PhysHandle, DriverError> {
        Err(DriverError::Unavailable("virtual memory calls are not wired to the CUDA driver".into()))
    }

    fn mem_release(&self, _device: i32, _handle: PhysHandle) -> Result<(), DriverError> {
        Err(DriverError::Unavailable("virtual memory calls are not wired to the CUDA driver".into()))
    }

    fn mem_map(&self, _device: i32, _ptr: DevicePtr, _size: usize, _handle: PhysHandle) -> Result<(), DriverError> {
        Err(DriverError::Unavailable("virtual memory calls are not wired to the CUDA driver".into()))
    }

    fn mem_set_access(&self, _device: i32, _ptr: DevicePtr, _size: usize) -> Result<(), DriverError> {
        Err(DriverError::Unavailable("virtual memory calls are not wired to the CUDA driver".into()))
    }

    fn mem_unmap(&self, _device: i32, _ptr: DevicePtr, _size: usize) -> Result<(), DriverError> {
        Err(DriverError::Unavailable("virtual memory calls are not wired to the CUDA driver".into()))
    }
}
