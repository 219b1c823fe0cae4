//! The devices' primary contexts: retained once, pushed around each call and popped after; and
//! the calls of [`DeviceOps`]: how many devices there are, which device or context is current,
//! which one a stream belongs to.

use cudarc::driver::sys;

use super::{CudaDriver, DriverError, StreamHandle, check};
use crate::driver::ops::DeviceOps;

impl CudaDriver {
    pub(super) fn context(&self, device: i32) -> Result<sys::CUcontext, DriverError> {
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
    pub(super) fn in_context<R>(
        &self,
        device: i32,
        f: impl FnOnce() -> Result<R, DriverError>,
    ) -> Result<R, DriverError> {
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

impl DeviceOps for CudaDriver {
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
}
