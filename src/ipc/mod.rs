//! Device memory shared between processes (`gpupool_ipc_export`, `gpupool_ipc_import`,
//! `gpupool_ipc_close`): PyTorch's `torch.multiprocessing` sharing of CUDA tensors
//! (`CudaIPCSentData`: a handle, an offset, a reference count in shared memory, blocks freed
//! while shared held in limbo), for C and C++ engines. docs/ipc.md has the protocol.
//!
//! - [`handle`]: the fixed-size handle a program sends to another process, and its checks;
//! - [`record`]: the owner's shared-memory record of one export: the descriptors an importer
//!   takes, and each importer's count of uses (with its pid and start time, so that a dead
//!   importer's uses are dropped);
//! - [`export`]: the owner's table of exported blocks, and the limbo of those freed while
//!   imported;
//! - [`import`]: an importer's table of what it mapped.

pub(crate) mod export;
pub(crate) mod handle;
pub(crate) mod import;
pub(crate) mod record;

pub(crate) use handle::{HANDLE_SIZE, IpcHandle, Kind};
