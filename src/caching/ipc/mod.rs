//! Device memory shared between processes (`gpupool_ipc_export`, `gpupool_ipc_import`,
//! `gpupool_ipc_close`): PyTorch's `torch.multiprocessing` sharing of CUDA tensors
//! (`CudaIPCSentData`: a handle, an offset, a reference count in shared memory, blocks freed
//! while shared held in limbo), for C and C++ engines. docs/ipc.md has the protocol. Every
//! part is here, in the order an export travels:
//!
//! - `allocator.rs`: `Allocator::ipc_export`, `ipc_import`, `ipc_close`, and the reclaim of
//!   the limbo; a sleep's refusal of a pool holding exports.
//! - `shard.rs`: a block as an export sees it (its pages' handles or its segment), the mark
//!   that sends an exported block's free off the hit path, and that free.
//! - `handle.rs`: the fixed-size handle a program sends to another process, and its checks.
//! - `record.rs`: the owner's shared-memory record of one export: the descriptors an importer
//!   takes, and each importer's count of uses (with its pid and start time, so that a dead
//!   importer's uses are dropped).
//! - `export.rs`: the owner's table of exported blocks, and the limbo of those freed while
//!   imported.
//! - `import.rs`: an importer's table of what it mapped, import and close.
//! - `device.rs`: a device's blocks in limbo reclaimed on its out-of-memory path.
//!
//! The protocol (`handle`, `record`, `export`, `import`) imports nothing of the allocator; the
//! operating system's part (processes, pidfds, memfds) is `crate::os`.

mod allocator;
mod device;
pub(crate) mod export;
pub(crate) mod handle;
pub(crate) mod import;
pub(crate) mod record;
mod shard;

pub use allocator::IPC_HANDLE_SIZE;
pub(crate) use handle::HANDLE_SIZE;
pub(crate) use shard::EXPORTED;
