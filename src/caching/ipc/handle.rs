//! The handle one process sends another (`gpupool_ipc_handle_t`): a fixed-size plain array of
//! bytes, the same for every export of one block, that names the owner process (pid and start
//! time), its shared record of the export (a descriptor number there), the device (by UUID, so
//! that another GPU's memory is refused whatever the ordinals), the export, and the block's
//! size and offset; for ordinary segments also the driver's 64-byte `CUipcMemHandle`. A
//! checksum catches a handle damaged in transit. Every field is checked before anything is
//! done with it; each failure names what is wrong.

use crate::error::Error;

/// Bytes of a handle.
pub(crate) const HANDLE_SIZE: usize = 160;
const MAGIC: &[u8; 8] = b"GPUPOOLH";
const VERSION: u32 = 1;
/// Bytes covered by the checksum; the rest up to [`HANDLE_SIZE`] is zero.
const BODY: usize = 144;

/// How the importer maps the block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    /// Pages of an expandable segment (`cuMemExportToShareableHandle`, one descriptor each).
    Pages = 1,
    /// An ordinary segment (`cuIpcGetMemHandle`), the block at an offset in it.
    Segment = 2,
}

/// A handle's fields.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct IpcHandle {
    pub kind: Kind,
    pub owner: crate::os::process::Identity,
    /// The owner's descriptor of the export's record.
    pub record_fd: i32,
    /// The owner's ordinal of the device (for messages).
    pub device: i32,
    pub uuid: [u8; 16],
    pub export_id: u64,
    /// The block's bytes.
    pub size: u64,
    /// The block's start in what the importer maps: the first page, or the segment.
    pub offset: u64,
    /// The segment's `CUipcMemHandle` ([`Kind::Segment`]); zero for pages.
    pub segment: [u8; 64],
}

/// FNV-1a, 64 bits: enough to catch damage, not an adversary.
fn checksum(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3))
}

fn uuid_text(u: &[u8; 16]) -> String {
    let hex: String = u.iter().map(|b| format!("{b:02x}")).collect();
    format!("GPU-{}-{}-{}-{}-{}", &hex[..8], &hex[8..12], &hex[12..16], &hex[16..20], &hex[20..])
}

impl IpcHandle {
    /// The handle's bytes: the fields little-endian, then the checksum of the first 144
    /// bytes, then zeros.
    pub fn encode(&self) -> [u8; HANDLE_SIZE] {
        let mut b = [0u8; HANDLE_SIZE];
        b[..8].copy_from_slice(MAGIC);
        b[8..12].copy_from_slice(&VERSION.to_le_bytes());
        b[12..16].copy_from_slice(&(self.kind as u32).to_le_bytes());
        b[16..20].copy_from_slice(&self.owner.pid.to_le_bytes());
        b[20..24].copy_from_slice(&self.record_fd.to_le_bytes());
        b[24..32].copy_from_slice(&self.owner.start.to_le_bytes());
        b[32..36].copy_from_slice(&self.device.to_le_bytes());
        b[40..56].copy_from_slice(&self.uuid);
        b[56..64].copy_from_slice(&self.export_id.to_le_bytes());
        b[64..72].copy_from_slice(&self.size.to_le_bytes());
        b[72..80].copy_from_slice(&self.offset.to_le_bytes());
        b[80..144].copy_from_slice(&self.segment);
        let sum = checksum(&b[..BODY]);
        b[BODY..BODY + 8].copy_from_slice(&sum.to_le_bytes());
        b
    }

    /// Reads a handle, checking each field.
    ///
    /// Errors: [`Error::InvalidValue`] naming the first thing wrong: the magic (not a gpupool
    /// handle), the version (another gpupool's), the checksum (damaged or truncated), the
    /// kind, a zero pid, a negative descriptor, a zero size or export id.
    pub fn decode(b: &[u8; HANDLE_SIZE]) -> Result<IpcHandle, Error> {
        let bad = |what: String| Err(Error::InvalidValue(format!("the IPC handle is not valid: {what}")));
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        if &b[..8] != MAGIC {
            return bad("its magic is wrong (not a handle from gpupool_ipc_export, or not all of one)".into());
        }
        if u32_at(8) != VERSION {
            return bad(format!("its version is {}, this gpupool reads version {VERSION}", u32_at(8)));
        }
        if u64_at(BODY) != checksum(&b[..BODY]) || b[BODY + 8..].iter().any(|&x| x != 0) {
            return bad("its checksum is wrong (damaged or truncated in transit)".into());
        }
        let kind = match u32_at(12) {
            1 => Kind::Pages,
            2 => Kind::Segment,
            k => return bad(format!("its kind {k} is unknown")),
        };
        let h = IpcHandle {
            kind,
            owner: crate::os::process::Identity { pid: u32_at(16), start: u64_at(24) },
            record_fd: u32_at(20) as i32,
            device: u32_at(32) as i32,
            uuid: b[40..56].try_into().expect("16 bytes"),
            export_id: u64_at(56),
            size: u64_at(64),
            offset: u64_at(72),
            segment: b[80..144].try_into().expect("64 bytes"),
        };
        if h.owner.pid == 0 || h.record_fd < 0 || h.size == 0 || h.export_id == 0 {
            return bad("a field is out of range (pid, descriptor, size or export id)".into());
        }
        Ok(h)
    }

    /// Errors: [`Error::InvalidValue`] when `uuid` (of the importer's `device`) is not the
    /// handle's device.
    pub fn check_device(&self, device: i32, uuid: &[u8; 16]) -> Result<(), Error> {
        if &self.uuid == uuid {
            return Ok(());
        }
        Err(Error::InvalidValue(format!(
            "the IPC handle is for device {} ({}) of process {}, not device {device} ({}) of this process",
            self.device,
            uuid_text(&self.uuid),
            self.owner.pid,
            uuid_text(uuid)
        )))
    }
}
