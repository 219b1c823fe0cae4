//! Loading the driver: the functions gpupool calls, looked up in `libcuda.so.1` before cudarc
//! is let call any (it panics at the first call of a missing one), then `cuInit` and the
//! devices ([`CudaDriver::new`]).

use std::sync::OnceLock;

use cudarc::driver::sys;

use super::{CudaDriver, DriverError, check};

/// Every driver function gpupool calls: checked at start, so that a library lacking one is
/// refused with its name instead of panicking inside cudarc at the first call.
pub(super) const REQUIRED: [&str; 18] = [
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
pub(super) const VMM_FUNCTIONS: [&str; 10] = [
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
pub(super) const HOST_FUNCTIONS: [&str; 5] =
    ["cuMemHostAlloc", "cuMemFreeHost", "cuMemHostRegister_v2", "cuMemHostUnregister", "cuStreamGetCtx"];

/// The driver functions of stream capture (CUDA 11.3 and later). Not in [`REQUIRED`]: a
/// driver without them still starts, and no stream can capture there, so every stream reads
/// as not capturing. `cuStreamGetCaptureInfo_v2` is the symbol behind CUDA 12's
/// `cuStreamGetCaptureInfo`, still exported by CUDA 13's drivers (whose `cuStreamGetCaptureInfo`
/// has the third version's signature).
pub(super) const CAPTURE_FUNCTIONS: [&str; 2] = ["cuStreamGetCaptureInfo_v2", "cuThreadExchangeStreamCaptureMode"];

/// The first of `names` for which `present` is false, in the order of `names`.
pub(super) fn first_missing(names: &[&'static str], present: impl Fn(&str) -> bool) -> Option<&'static str> {
    names.iter().copied().find(|name| !present(name))
}

/// Whether the loaded driver library exports `name`. Only looks it up: never calls it.
pub(super) fn exported(name: &str) -> bool {
    let symbol = format!("{name}\0");
    // SAFETY: looks a symbol up without calling it; the library is present (checked first).
    unsafe { sys::culib().get::<unsafe extern "C" fn()>(symbol.as_bytes()) }.is_ok()
}

/// The first function of [`REQUIRED`], then of [`HOST_FUNCTIONS`], that the loaded driver
/// library lacks.
fn missing_function() -> Option<&'static str> {
    first_missing(&REQUIRED, exported).or_else(|| first_missing(&HOST_FUNCTIONS, exported))
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
            rdma_vmm: per_device(count),
            ipc_missing: first_missing(&super::ipc::IPC_FUNCTIONS, exported),
            fd_handles_refused: Default::default(),
        })
    }
}
