//! The CUDA driver's unit tests, which need no GPU: the function lists checked at start, the
//! pure helpers of the virtual memory calls, and cudarc's bindings against cuda.h.

use super::copy::COPY_FUNCTIONS;
use super::dmabuf::DMABUF_FUNCTIONS;
use super::ipc::IPC_FUNCTIONS;
use super::loading::{CAPTURE_FUNCTIONS, HOST_FUNCTIONS, REQUIRED, VMM_FUNCTIONS, first_missing};
use super::streams::capture_status;
use super::vmm::{access_descs, allocation_prop};
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
    use crate::driver::sim::SimOp;
    for op in SimOp::ALL.into_iter().filter(|op| !matches!(op, SimOp::HostMap | SimOp::HostUnmap)) {
        let name = op.symbol();
        let checked = [
            &REQUIRED[..],
            &VMM_FUNCTIONS,
            &HOST_FUNCTIONS,
            &CAPTURE_FUNCTIONS,
            &COPY_FUNCTIONS,
            &IPC_FUNCTIONS,
            &DMABUF_FUNCTIONS,
        ]
        .iter()
        .any(|l| l.contains(&name));
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
fn access_is_read_write_or_none_for_each_device_named() {
    let descs = access_descs(&[3, 1, 5], true);
    let ids: Vec<i32> = descs.iter().map(|d| d.location.id).collect();
    assert_eq!(ids, [3, 1, 5]);
    for d in &descs {
        assert_eq!(d.location.type_, sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE);
        assert_eq!(d.flags, sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    }
    let none = access_descs(&[2], false);
    assert_eq!(none[0].flags, sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_NONE);
    assert_eq!(none[0].location.id, 2);
}

#[test]
fn memory_is_pinned_on_the_device_with_a_file_descriptor_handle_or_none() {
    let prop = allocation_prop(7, true, true);
    assert_eq!(prop.requestedHandleTypes, sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    assert_eq!(prop.allocFlags.gpuDirectRDMACapable, 1);
    let prop = allocation_prop(7, false, false);
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
