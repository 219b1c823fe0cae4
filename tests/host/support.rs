//! What the host allocator's tests share: an allocator on a simulated device of two GPUs, and
//! the stream its copies run on.

use std::sync::Arc;

use gpupool::config::Config;
use gpupool::driver::Driver;
use gpupool::driver::sim::SimDriver;
use gpupool::host::HostAllocator;

pub(crate) fn host_with(config: Config) -> (HostAllocator, Arc<SimDriver>) {
    let sim = Arc::new(SimDriver::new(2, 1 << 30));
    (HostAllocator::new(sim.clone() as Arc<dyn Driver>, &config), sim)
}

pub(crate) fn host() -> (HostAllocator, Arc<SimDriver>) {
    host_with(Config::default())
}

pub(crate) const COPY: usize = 0x7000;
