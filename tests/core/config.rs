//! `GPUPOOL_CONF`'s settings at work in an allocator on the simulated device: the rounding of
//! `roundup_power2_divisions`, the oversize rule of `max_non_split_rounding_mb`, the segments of
//! `large_segment_size_mb`, `per_process_memory_fraction`, and `set_config` before and after a
//! device starts.

use crate::common;

use common::{MIB, check, sim_with};
use gpupool::Error;
use gpupool::config::Config;
use gpupool::driver::DriverError;
use gpupool::driver::sim::SimOp;

const KIB: usize = 1 << 10;

/// `s` on PyTorch's defaults (ordinary segments), whose rules these tests check.
fn conf(s: &str) -> Config {
    Config::pytorch_conf(s).unwrap_or_else(|e| panic!("{s}: {e}"))
}

/// The block size an allocation of `size` bytes gets.
fn block_size(a: &gpupool::Allocator, size: usize) -> usize {
    let p = a.malloc(size, 0, 0).unwrap();
    a.block_info(p).expect("an allocated block").size
}

#[test]
fn roundup_power2_divisions_gives_blocks_of_the_rounded_size() {
    let (a, _) = sim_with(1, 4 << 30, conf("roundup_power2_divisions:4"));
    // 1200 KiB lies between 1 MiB and 2 MiB, in steps of 256 KiB.
    assert_eq!(block_size(&a, 1200 * KIB), 1280 * KIB);
    assert_eq!(block_size(&a, 1536 * KIB), 1536 * KIB);
    assert_eq!(block_size(&a, 1536 * KIB + 1), 1792 * KIB);
    // Small requests too: 3000 bytes, between 2048 and 4096 in steps of 512; up to 512 * 4
    // bytes, the usual multiple of 512.
    assert_eq!(block_size(&a, 3000), 3072);
    assert_eq!(block_size(&a, 2000), 2048);
    // 300 MiB: between 256 and 512 MiB in steps of 64 MiB.
    assert_eq!(block_size(&a, 300 * MIB), 320 * MIB);
    let s = a.stats(0).unwrap();
    assert_eq!(
        s.requested_bytes.all.current,
        (1200 * KIB + 1536 * KIB + 1536 * KIB + 1 + 3000 + 2000 + 300 * MIB) as i64
    );
    check(&a);

    // Per interval: 1 division (512-byte rounding) under 512 MiB, 2 from there to 1 GiB.
    let (a, _) = sim_with(1, 4 << 30, conf("roundup_power2_divisions:[256:1,512:2,1024:4,>:8]"));
    assert_eq!(block_size(&a, 1200 * KIB), 1200 * KIB);
    assert_eq!(block_size(&a, 300 * MIB + 1), 300 * MIB + 512);
    assert_eq!(block_size(&a, 600 * MIB), 768 * MIB);
    check(&a);

    // Without the key: PyTorch's 512-byte rounding.
    let (a, _) = sim_with(1, 1 << 30, Config::pytorch());
    assert_eq!(block_size(&a, 1200 * KIB), 1200 * KIB);
    assert_eq!(block_size(&a, 3000), 3072);
}

#[test]
fn max_non_split_rounding_bounds_the_waste_of_an_oversize_block() {
    for (rounding, reused) in [("", false), (",max_non_split_rounding_mb:40", true)] {
        let (a, drv) = sim_with(1, 1 << 30, conf(&format!("max_split_size_mb:64{rounding}")));
        let big = a.malloc(100 * MIB, 0, 0).unwrap();
        a.free(big).unwrap();
        // 64 MiB is at least max_split_size: the cached 100 MiB block may serve it only if it is
        // under 64 + max_non_split_rounding MiB (84 by default, 104 with 40).
        let p = a.malloc(64 * MIB, 0, 0).unwrap();
        assert_eq!(p == big, reused, "max_non_split_rounding {rounding:?}");
        assert_eq!(
            a.block_info(p).unwrap().size,
            if reused { 100 * MIB } else { 64 * MIB },
            "an oversize block is never split"
        );
        assert_eq!(drv.counts().mem_alloc, if reused { 1 } else { 2 });
        check(&a);
    }
}

#[test]
fn large_segment_size_sets_the_segments_of_requests_from_1_to_10_mib() {
    let (a, _) = sim_with(1, 1 << 30, conf("large_segment_size_mb:64"));
    a.malloc(5 * MIB, 0, 0).unwrap();
    let s = a.stats(0).unwrap();
    assert_eq!(s.reserved_bytes.large_pool.current, 64 * MIB as i64);
    a.malloc(12 * MIB, 0, 0).unwrap();
    assert_eq!(a.stats(0).unwrap().segment.all.current, 1, "12 MiB is carved from the 59 MiB left");
    a.malloc(1000, 0, 0).unwrap();
    assert_eq!(a.stats(0).unwrap().reserved_bytes.small_pool.current, 2 * MIB as i64, "small segments stay 2 MiB");
    check(&a);
}

#[test]
fn per_process_memory_fraction_limits_each_device_from_its_start() {
    let (a, _) = sim_with(2, 1 << 30, conf("per_process_memory_fraction:0.5"));
    for device in 0..2 {
        let e = a.malloc(600 * MIB, device, 0).unwrap_err();
        assert!(matches!(e, Error::OutOfMemory(_)), "{e}");
        a.malloc(400 * MIB, device, 0).unwrap();
        let e = a.malloc(200 * MIB, device, 0).unwrap_err();
        assert!(matches!(e, Error::OutOfMemory(_)), "device {device}: 600 MiB reserved would pass 512: {e}");
    }
    // As gpupool_set_memory_fraction would: the call can still change it.
    a.set_memory_fraction(1.0, 0).unwrap();
    a.malloc(200 * MIB, 0, 0).unwrap();
    check(&a);
}

#[test]
fn a_device_whose_total_cannot_be_read_for_its_fraction_does_not_start() {
    let (a, drv) = sim_with(1, 1 << 30, conf("per_process_memory_fraction:0.5"));
    drv.inject_fault(
        SimOp::MemInfo,
        0,
        DriverError::Cuda { call: "cuMemGetInfo", code: 999, name: "CUDA_ERROR_UNKNOWN".into() },
    );
    let e = a.malloc(MIB, 0, 0).unwrap_err();
    assert!(matches!(e, Error::Cuda(_)) && e.message().contains("cuMemGetInfo"), "{e}");
    // Not started: the configuration may still change, and the next call starts it.
    a.set_config(conf("per_process_memory_fraction:0.25")).unwrap();
    a.malloc(200 * MIB, 0, 0).unwrap();
    assert!(matches!(a.malloc(100 * MIB, 0, 0), Err(Error::OutOfMemory(_))), "a quarter of 1 GiB is 256 MiB");
    check(&a);
}

#[test]
fn set_config_applies_until_a_device_starts() {
    let (a, _) = sim_with(2, 1 << 30, Config::pytorch());
    // device_count starts no device.
    assert_eq!(a.device_count(), 2);
    let c = a.config().with_conf("roundup_power2_divisions:4,max_split_size_mb:64").unwrap();
    a.set_config(c).unwrap();
    assert_eq!(a.config().max_split_size, 64 * MIB);
    assert!(a.config_string().contains(",max_split_size_mb:64,"));
    assert!(a.config_string().contains(",roundup_power2_divisions:4,"));
    assert_eq!(block_size(&a, 1200 * KIB), 1280 * KIB);
    assert_eq!(a.stats(0).unwrap().max_split_size, 64 * MIB as i64);

    // Device 0 has started: no more changes, and the one refused changes nothing.
    let before = a.config_string();
    let e = a.set_config(Config::default()).unwrap_err();
    assert!(matches!(e, Error::InvalidValue(_)));
    assert!(e.message().contains("before the first allocation") && e.message().contains("device 0"), "{e}");
    assert_eq!(a.config_string(), before);
    // Device 1, started afterwards, has the configuration in force too.
    assert_eq!(a.stats(1).unwrap().max_split_size, 64 * MIB as i64);
    assert_eq!(block_size_on(&a, 1, 1200 * KIB), 1280 * KIB);
}

fn block_size_on(a: &gpupool::Allocator, device: i32, size: usize) -> usize {
    let p = a.malloc(size, device, 0).unwrap();
    a.block_info(p).unwrap().size
}

#[test]
fn a_call_that_names_a_device_starts_it() {
    let (a, _) = sim_with(2, 1 << 30, Config::pytorch());
    a.stats(1).unwrap();
    let e = a.set_config(conf("expandable_segments:True")).unwrap_err();
    assert!(e.message().contains("device 1"), "{e}");
    assert!(!a.config().expandable_segments);
}

#[test]
fn the_configuration_string_reads_back_to_the_same_allocator_settings() {
    let s = "max_split_size_mb:128,max_non_split_rounding_mb:32,roundup_power2_divisions:[256:1,512:2,>:4],\
             garbage_collection_threshold:0.8,expandable_segments:True,per_process_memory_fraction:0.75";
    let (a, _) = sim_with(1, 1 << 30, conf(s));
    let shown = a.config_string();
    let (b, _) = sim_with(1, 1 << 30, Config::pytorch());
    b.set_config(b.config().with_conf(&shown).unwrap()).unwrap();
    assert_eq!(*b.config(), *a.config());
    assert_eq!(b.config_string(), shown);
}

#[test]
fn set_config_racing_a_device_start_is_all_or_nothing() {
    // Whichever wins, the device runs with the configuration that `config` reports.
    for _ in 0..50 {
        let (a, _) = sim_with(1, 1 << 30, Config::default());
        let wanted = conf("roundup_power2_divisions:4");
        let (set, size) = std::thread::scope(|s| {
            let setter = s.spawn(|| a.set_config(wanted.clone()));
            let size = block_size(&a, 1200 * KIB);
            (setter.join().unwrap(), size)
        });
        match set {
            Ok(()) => assert_eq!(size, 1280 * KIB),
            Err(_) => {
                assert_eq!(size, 1200 * KIB);
                assert_eq!(*a.config(), Config::default());
            }
        }
    }
}

/// Set in the child process of [`an_unknown_gpupool_variable_is_warned_about_once`]; not a
/// `GPUPOOL_*` name, so that it is no unknown variable itself.
const WARN_CHILD: &str = "CONFIG_TEST_UNKNOWN_VARIABLES_CHILD";

/// The child's side: reads the environment three times, twice directly and once by starting
/// the process-wide allocator (the C API's path), and checks that the unknown variables changed
/// nothing. A no-op in an ordinary run.
#[test]
fn unknown_variables_child() {
    if std::env::var_os(WARN_CHILD).is_none() {
        return;
    }
    let want = Config { driver: gpupool::config::DriverKind::Sim, sim_capacity: 64 * MIB, ..Config::default() };
    assert_eq!(Config::from_env().unwrap(), want);
    assert_eq!(Config::from_env().unwrap(), want);
    assert_eq!(*gpupool::ffi::process_allocator().unwrap().config(), want);
}

#[test]
fn an_unknown_gpupool_variable_is_warned_about_once() {
    // A child process of this test binary, with an environment of its own, so that its stderr
    // holds what gpupool writes and nothing of the environment this test runs in matters.
    let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
    let child = common::process::test_path(module_path!(), "unknown_variables_child");
    cmd.args(["--exact", &child, "--test-threads=1", "--nocapture"]);
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("GPUPOOL_") {
            cmd.env_remove(name);
        }
    }
    let out = cmd
        .env(WARN_CHILD, "1")
        .env("GPUPOOL_DRIVER", "sim")
        .env("GPUPOOL_SIM_CAPACITY", "64MiB")
        .env("GPUPOOL_CNF", "expandable_segments:True")
        .env("GPUPOOL_NOT_AN_OPTION", "1")
        .env("GPUPOOL_LIB", "/nonexistent/libgpupool.so")
        .env("GPUPOOL_SOAK_OPS", "10")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "the child failed: {stderr}\n{}", String::from_utf8_lossy(&out.stdout));
    let mut warnings: Vec<&str> = stderr.lines().filter(|l| l.starts_with("gpupool: warning:")).collect();
    warnings.sort_unstable();
    assert_eq!(
        warnings,
        [
            "gpupool: warning: unknown environment variable GPUPOOL_CNF is ignored (did you mean GPUPOOL_CONF?)",
            "gpupool: warning: unknown environment variable GPUPOOL_NOT_AN_OPTION is ignored",
        ],
        "stderr: {stderr}"
    );
}
