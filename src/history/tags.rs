//! Tags: which part of a program holds the memory. A thread pushes a name
//! ([`push`], `gpupool_push_tag`) and every block it allocates until the matching [`pop`]
//! carries the innermost name; an allocator counts, per tag, the bytes and blocks its tagged
//! blocks hold ([`TagCounters`]), and the snapshot, the live report and the out-of-memory
//! message name them. PyTorch has no tags (its users group by Python stack); gpupool's are
//! meant for C and C++ engines, whose native stacks say less than a stage's name.
//!
//! Names are interned process-wide to small ids (1 and up, in the order first pushed; 0 is "no
//! tag"), so that a block stores its tag in the bits of `Block::ctx` (see `stacks`). Each
//! thread has its own stack of tags. Until the first push, no allocation pays more than one
//! relaxed load of [`in_use`].

use std::cell::{Cell, RefCell};
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, LazyLock};

use parking_lot::{Mutex, RwLock};
use rustc_hash::FxHashMap;

use crate::error::Error;
use crate::stats::Stat;

/// The longest name accepted, in bytes of UTF-8.
pub(crate) const MAX_TAG_LEN: usize = 255;
/// Distinct names a process may intern: ids must stay under `stacks::TAG_ONLY`'s bit.
pub(crate) const MAX_TAGS: usize = 1 << 16;
/// Tags one thread may have pushed at once: deeper nesting is a missing pop.
pub(crate) const MAX_DEPTH: usize = 1024;

/// Set by the first push in the process, never cleared: until then malloc and free skip every
/// tag's bookkeeping.
static EVER: AtomicBool = AtomicBool::new(false);

#[derive(Default)]
struct Registry {
    ids: FxHashMap<Arc<str>, u32>,
    /// Name of tag `id` at `id - 1`.
    names: Vec<Arc<str>>,
}

static REGISTRY: LazyLock<Mutex<Registry>> = LazyLock::new(Mutex::default);

thread_local! {
    /// The thread's pushed tags, outermost first.
    static STACK: RefCell<Vec<u32>> = const { RefCell::new(Vec::new()) };
    /// The innermost of them (0: none), read by each tagged allocation.
    static CURRENT: Cell<u32> = const { Cell::new(0) };
}

/// Whether any thread ever pushed a tag: one relaxed load, all that malloc and free pay before
/// the first push.
#[inline(always)]
pub fn in_use() -> bool {
    EVER.load(Ordering::Relaxed)
}

/// The calling thread's innermost tag, 0 when none.
pub fn current() -> u32 {
    CURRENT.with(Cell::get)
}

/// Whether `c` may not stand in a tag's name: a control character (C0, DEL, C1) or a Unicode
/// line or paragraph separator. Each would break the lines of the live report, the
/// out-of-memory message or a viewer's labels (`"x\n  8.00 GiB in 999 blocks: tag fake"`
/// forged a line of the report).
fn breaks_lines(c: char) -> bool {
    c.is_control() || c == '\u{2028}' || c == '\u{2029}'
}

/// Checks `name` (1 to [`MAX_TAG_LEN`] bytes, no character that [`breaks_lines`]) and interns
/// it: its id.
fn intern(name: &str) -> Result<u32, Error> {
    if name.is_empty() || name.len() > MAX_TAG_LEN {
        return Err(Error::InvalidValue(format!(
            "a tag name is 1 to {MAX_TAG_LEN} bytes of UTF-8; this one has {} bytes",
            name.len()
        )));
    }
    if let Some((at, c)) = name.char_indices().find(|&(_, c)| breaks_lines(c)) {
        return Err(Error::InvalidValue(format!(
            "a tag name may not hold control characters or line separators; {name:?} has U+{:04X} at byte {at}",
            c as u32
        )));
    }
    let mut r = REGISTRY.lock();
    if let Some(&id) = r.ids.get(name) {
        return Ok(id);
    }
    if r.names.len() + 1 >= MAX_TAGS {
        return Err(Error::InvalidValue(format!(
            "tag {name:?} would be the {}th distinct tag of the process; at most {} are kept",
            MAX_TAGS,
            MAX_TAGS - 1
        )));
    }
    let name: Arc<str> = name.into();
    r.names.push(name.clone());
    let id = r.names.len() as u32;
    r.ids.insert(name, id);
    Ok(id)
}

/// Pushes `name` on the calling thread's stack of tags: the blocks it allocates carry it until
/// the matching [`pop`]. Returns the tag's id.
///
/// Errors, each changing nothing: [`Error::InvalidValue`] for an empty name or one over
/// [`MAX_TAG_LEN`] bytes, one holding a control character (C0, DEL, C1) or U+2028/U+2029
/// (the message names its byte offset), a new name past [`MAX_TAGS`], or a stack
/// [`MAX_DEPTH`] deep.
pub fn push(name: &str) -> Result<u32, Error> {
    let id = intern(name)?;
    STACK.with_borrow_mut(|s| {
        if s.len() >= MAX_DEPTH {
            return Err(Error::InvalidValue(format!(
                "{MAX_DEPTH} tags are pushed on this thread already: is a gpupool_pop_tag missing?"
            )));
        }
        s.push(id);
        CURRENT.set(id);
        Ok(())
    })?;
    EVER.store(true, Ordering::Relaxed);
    Ok(id)
}

/// Pops the calling thread's innermost tag.
///
/// Errors: [`Error::InvalidValue`] when this thread has none pushed (nothing changes).
pub fn pop() -> Result<(), Error> {
    STACK.with_borrow_mut(|s| {
        s.pop().ok_or_else(|| Error::InvalidValue("no tag is pushed on this thread".into()))?;
        CURRENT.set(s.last().copied().unwrap_or(0));
        Ok(())
    })
}

/// The id of `name`, if some thread pushed it.
pub fn id_of(name: &str) -> Option<u32> {
    REGISTRY.lock().ids.get(name).copied()
}

/// The name of tag `id`.
pub fn name_of(id: u32) -> Option<Arc<str>> {
    REGISTRY.lock().names.get((id as usize).checked_sub(1)?).cloned()
}

/// Every name interned, in the order first pushed (tag `i + 1` at `i`).
pub fn names() -> Vec<Arc<str>> {
    REGISTRY.lock().names.clone()
}

/// What a tag's blocks hold on one allocator, over all its devices, as PyTorch's `Stat`s:
/// `bytes` counts the blocks' sizes after rounding (what `allocated_bytes` counts, so that the
/// tags' `current` add up to it when every block is tagged), `blocks` the blocks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TagStats {
    /// Bytes: held now, the most ever held at once, the sums allocated and freed.
    pub bytes: Stat,
    /// Blocks, as `bytes`.
    pub blocks: Stat,
}

#[derive(Default)]
struct Cells {
    bytes: [AtomicI64; 4],
    blocks: [AtomicI64; 4],
}

const CURRENT_: usize = 0;
const PEAK: usize = 1;
const ALLOCATED: usize = 2;
const FREED: usize = 3;

fn change(c: &[AtomicI64; 4], by: i64) {
    if by > 0 {
        let now = c[CURRENT_].fetch_add(by, Ordering::Relaxed) + by;
        c[PEAK].fetch_max(now, Ordering::Relaxed);
        c[ALLOCATED].fetch_add(by, Ordering::Relaxed);
    } else {
        c[CURRENT_].fetch_add(by, Ordering::Relaxed);
        c[FREED].fetch_add(-by, Ordering::Relaxed);
    }
}

fn read(c: &[AtomicI64; 4]) -> Stat {
    let r = |i: usize| c[i].load(Ordering::Relaxed);
    Stat { current: r(CURRENT_), peak: r(PEAK), allocated: r(ALLOCATED), freed: r(FREED) }
}

/// An allocator's statistics per tag. Updated with atomics under a read lock (the write lock
/// only to make room for a tag it has not seen), so that threads allocating under different
/// tags, or under the same, do not wait for each other; a block freed on another thread than
/// the one that allocated it counts to the tag it was allocated under.
#[derive(Default)]
pub(crate) struct TagCounters {
    /// Tag `id` at `id - 1`.
    cells: RwLock<Vec<Cells>>,
}

impl TagCounters {
    fn update(&self, tag: u32, bytes: usize, sign: i64) {
        let Some(i) = (tag as usize).checked_sub(1) else { return };
        {
            let cells = self.cells.read();
            if let Some(c) = cells.get(i) {
                change(&c.bytes, sign * bytes as i64);
                change(&c.blocks, sign);
                return;
            }
        }
        let mut cells = self.cells.write();
        if cells.len() <= i {
            cells.resize_with(i + 1, Cells::default);
        }
        change(&cells[i].bytes, sign * bytes as i64);
        change(&cells[i].blocks, sign);
    }

    /// A block of `bytes` (rounded) allocated under `tag` (0: none, not counted).
    pub fn alloc(&self, tag: u32, bytes: usize) {
        self.update(tag, bytes, 1);
    }

    /// A block of `bytes` allocated under `tag` freed.
    pub fn free(&self, tag: u32, bytes: usize) {
        self.update(tag, bytes, -1);
    }

    /// Tag `tag`'s statistics (all zero for a tag under which nothing was allocated).
    pub fn get(&self, tag: u32) -> TagStats {
        let cells = self.cells.read();
        match (tag as usize).checked_sub(1).and_then(|i| cells.get(i)) {
            Some(c) => TagStats { bytes: read(&c.bytes), blocks: read(&c.blocks) },
            None => TagStats::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nesting_and_bad_input() {
        assert_eq!(current(), 0);
        assert!(pop().is_err(), "nothing pushed");
        let a = push("unit-a").unwrap();
        let b = push("unit-b").unwrap();
        assert_ne!(a, b);
        assert_eq!(current(), b);
        assert_eq!(push("unit-a").unwrap(), a, "interned");
        pop().unwrap();
        assert_eq!(current(), b);
        pop().unwrap();
        assert_eq!(current(), a);
        pop().unwrap();
        assert_eq!(current(), 0);
        assert!(push("").is_err());
        assert!(push(&"x".repeat(MAX_TAG_LEN + 1)).is_err());
        assert_eq!(current(), 0, "a refused push changes nothing");
        assert_eq!(name_of(a).as_deref(), Some("unit-a"));
        assert_eq!(id_of("unit-b"), Some(b));
        assert!(in_use());
    }

    #[test]
    fn counters() {
        let t = TagCounters::default();
        t.alloc(3, 1024);
        t.alloc(3, 512);
        t.free(3, 1024);
        t.alloc(0, 99);
        let s = t.get(3);
        assert_eq!(s.bytes, Stat { current: 512, peak: 1536, allocated: 1536, freed: 1024 });
        assert_eq!(s.blocks, Stat { current: 1, peak: 2, allocated: 2, freed: 1 });
        assert_eq!(t.get(1), TagStats::default());
        assert_eq!(t.get(0), TagStats::default());
    }
}
