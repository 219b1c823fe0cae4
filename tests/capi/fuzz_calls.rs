//! The calls the C API fuzz makes (`Call`, `gpupool_segment_mapped_range` among them) and their
//! strategies: addresses (NULL, live, inside, freed, garbage), sizes, streams, devices and
//! memory fractions, valid and not.

use std::ffi::c_int;

use proptest::prelude::*;

pub(crate) const DEVICES: c_int = 2;
pub(crate) const CAPACITY: &str = "64MiB";
pub(crate) const MIB: usize = 1 << 20;

/// An address argument: which kind of value to pass.
#[derive(Clone, Debug)]
pub(crate) enum Addr {
    Null,
    /// The start of a live block (picked by index among the live ones).
    Live(usize),
    /// Inside a live block, this many bytes (modulo its size) past its start.
    Interior(usize, usize),
    /// A block freed earlier (may have been handed out again since: the model knows).
    Freed(usize),
    /// Just past the end of a live block's requested bytes.
    PastEnd(usize),
    /// The address of a local variable.
    Stack,
    Garbage(u64),
}

pub(crate) fn addr() -> impl Strategy<Value = Addr> {
    prop_oneof![
        1 => Just(Addr::Null),
        6 => any::<usize>().prop_map(Addr::Live),
        2 => (any::<usize>(), any::<usize>()).prop_map(|(i, o)| Addr::Interior(i, o)),
        2 => any::<usize>().prop_map(Addr::Freed),
        1 => any::<usize>().prop_map(Addr::PastEnd),
        1 => Just(Addr::Stack),
        1 => prop_oneof![Just(1u64), Just(u64::MAX), Just(0x1000), Just(1 << 47), any::<u64>()].prop_map(Addr::Garbage),
    ]
}

pub(crate) fn size() -> impl Strategy<Value = usize> {
    prop_oneof![
        1 => Just(0usize),
        6 => 1usize..4096,
        3 => 4096usize..(2 * MIB),
        2 => (2 * MIB)..(24 * MIB),
        1 => (24 * MIB)..(80 * MIB),
        1 => prop_oneof![
            Just(usize::MAX),
            Just(usize::MAX - 511),
            Just(usize::MAX / 2),
            Just(1usize << 60),
            Just(1usize << 63),
            Just(usize::MAX - 8 * MIB),
            (usize::MAX - 4 * MIB)..=usize::MAX,
            (1usize << 40)..(1usize << 62),
        ],
    ]
}

pub(crate) fn stream() -> impl Strategy<Value = usize> {
    prop_oneof![
        4 => Just(0usize),
        4 => prop_oneof![Just(0x10usize), Just(0x20), Just(0x30)],
        1 => any::<usize>(),
    ]
}

pub(crate) fn fraction() -> impl Strategy<Value = f64> {
    prop_oneof![
        3 => 0.0f64..=1.0,
        1 => Just(1.0),
        1 => Just(0.0),
        1 => prop_oneof![
            Just(f64::NAN),
            Just(-0.5),
            Just(1.0 + f64::EPSILON),
            Just(f64::INFINITY),
            Just(f64::NEG_INFINITY),
            Just(-0.0),
        ],
    ]
}

#[derive(Clone, Debug)]
pub(crate) enum Call {
    Malloc {
        out_null: bool,
        size: usize,
        device: c_int,
        stream: usize,
    },
    Free(Addr),
    RecordStream(Addr, usize),
    /// `gpupool_stream_retire`; `null` passes a NULL `waited`.
    RetireStream {
        device: c_int,
        stream: usize,
        null: bool,
    },
    EmptyCache(c_int),
    SetMemoryFraction(f64, c_int),
    DeviceCount {
        null: bool,
    },
    /// `size` is the value put in `out->size`; the buffer is always big enough for it.
    Stats {
        device: c_int,
        null: bool,
        size: u32,
    },
    ResetPeakStats(c_int),
    PeakSettles {
        device: c_int,
        null: bool,
    },
    /// `len` is a fraction (per mille) of the size needed, or past it.
    MemorySummary {
        device: c_int,
        buf: bool,
        per_mille: usize,
        needed: bool,
    },
    StatusString(u32),
    Version,
    LastError,
    Hold(usize),
    Release(usize),
    SetDevice(c_int),
    LargestAllocatable {
        device: c_int,
        stream: usize,
        null: bool,
    },
    /// `gpupool_segment_mapped_range`: `null` passes a NULL range, `fd` asks for a dma-buf.
    MappedRange {
        addr: Addr,
        null: bool,
        fd: bool,
    },
}

/// Mostly a valid device (-1 is the current one), sometimes one out of range.
pub(crate) fn device() -> impl Strategy<Value = c_int> {
    prop_oneof![6 => -1..DEVICES, 1 => -2..=3 as c_int]
}

pub(crate) fn call() -> impl Strategy<Value = Call> {
    prop_oneof![
        12 => (prop::bool::weighted(0.02), size(), device(), stream())
            .prop_map(|(out_null, size, device, stream)| Call::Malloc { out_null, size, device, stream }),
        10 => addr().prop_map(Call::Free),
        3 => (addr(), stream()).prop_map(|(a, s)| Call::RecordStream(a, s)),
        2 => (device(), stream(), any::<bool>())
            .prop_map(|(device, stream, null)| Call::RetireStream { device, stream, null }),
        1 => device().prop_map(Call::EmptyCache),
        1 => (fraction(), device()).prop_map(|(f, d)| Call::SetMemoryFraction(f, d)),
        1 => any::<bool>().prop_map(|null| Call::DeviceCount { null }),
        2 => (device(), prop::bool::weighted(0.1), prop_oneof![0u32..16, 16u32..400, Just(u32::MAX), Just(0)])
            .prop_map(|(device, null, size)| Call::Stats { device, null, size }),
        1 => device().prop_map(Call::ResetPeakStats),
        1 => (device(), prop::bool::weighted(0.1)).prop_map(|(device, null)| Call::PeakSettles { device, null }),
        1 => (device(), prop::bool::weighted(0.7), prop_oneof![0usize..1000, 1000usize..1100], prop::bool::weighted(0.8))
            .prop_map(|(device, buf, per_mille, needed)| Call::MemorySummary { device, buf, per_mille, needed }),
        1 => any::<u32>().prop_map(Call::StatusString),
        1 => Just(Call::Version),
        1 => Just(Call::LastError),
        1 => stream().prop_map(Call::Hold),
        1 => stream().prop_map(Call::Release),
        1 => device().prop_map(Call::SetDevice),
        1 => (device(), stream(), prop::bool::weighted(0.1))
            .prop_map(|(device, stream, null)| Call::LargestAllocatable { device, stream, null }),
        3 => (addr(), prop::bool::weighted(0.1), any::<bool>())
            .prop_map(|(addr, null, fd)| Call::MappedRange { addr, null, fd }),
    ]
}
