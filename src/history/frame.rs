//! One frame of a symbolised call stack, as a snapshot writes it. Its own module, which imports
//! nothing of the history's, so that `stacks` (which makes frames) depends on it and not on
//! `snapshot` (which holds them, and which depends on `stacks`).

/// One frame of a call stack, as PyTorch's snapshot writes it: `{filename, line, name}`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Frame {
    /// The function, demangled; the address in hexadecimal when no symbol was found.
    pub name: String,
    /// Its source file, `??` when unknown (no debug information).
    pub filename: String,
    /// The line in it, 0 when unknown.
    pub line: u32,
}
