//! What the private pools' tests share: the streams that captures run on.

/// The stream of the first capture.
pub(crate) const S: usize = 0x51;
/// The stream of a second capture, or of another thread's.
pub(crate) const S2: usize = 0x52;
