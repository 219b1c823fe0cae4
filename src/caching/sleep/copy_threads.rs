//! A crew of CPU threads for one sleep or wake (`copy`): host-to-host copies between
//! the pinned staging buffers and a pool's pageable host copy, cut into one part per thread
//! and run in parallel, the calling thread taking a part too. One thread copies ordinary
//! memory at a fraction of the bus's 50 GB/s (and faults in the fresh pages of the host copy
//! as it writes them); several reach it. The threads are scoped to the call
//! (`std::thread::scope`): none outlives it, none is left behind in the program, and a forked
//! child inherits none.

use std::sync::mpsc;
use std::thread::Scope;

/// One host-to-host copy: (destination, source, bytes), ranges that do not overlap.
pub(crate) type Move = (usize, usize, usize);

/// A part of a batch for one thread: copies, or a function run on ranges (start, bytes).
/// The pointers are valid until [`Crew::copy`] or [`Crew::each`] returns, which waits for
/// every part: sending them to another thread is sound.
enum Part {
    Copy(Vec<Move>),
    Each(Vec<(usize, usize)>, fn(usize, usize)),
}

// SAFETY: see `Part`: the memory it names outlives its use, and no two parts overlap.
unsafe impl Send for Part {}

/// Runs every copy, or every call, of `part`.
fn run(part: &Part) {
    match part {
        Part::Copy(moves) => {
            for &(dst, src, len) in moves {
                // SAFETY: per `Crew::copy`'s contract, valid and non-overlapping ranges.
                unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, len) };
            }
        }
        Part::Each(ranges, f) => {
            for &(at, len) in ranges {
                f(at, len);
            }
        }
    }
}

/// The threads of one sleep or wake. Dropped (before its scope ends, or as a panic unwinds),
/// its threads see their channels close and end; the scope joins them.
pub(crate) struct Crew {
    workers: Vec<mpsc::Sender<Part>>,
    done: mpsc::Receiver<()>,
}

/// The threads a crew of `configured` threads has (`GPUPOOL_SLEEP_THREADS`; 0: the cores the
/// process may use, at most 16), the calling one included: at least 1.
pub(crate) fn crew_size(configured: usize) -> usize {
    match configured {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get().min(16)),
        n => n,
    }
}

impl Crew {
    /// A crew of `threads` threads (the calling one included), `threads - 1` spawned in
    /// `scope`. A thread the system refuses is done without: the crew is smaller (at least the
    /// calling thread).
    pub fn new<'scope, 'env>(scope: &'scope Scope<'scope, 'env>, threads: usize) -> Crew {
        let (done_tx, done) = mpsc::channel();
        let mut crew = Crew { workers: Vec::new(), done };
        for _ in 1..threads.max(1) {
            let (tx, rx) = mpsc::channel::<Part>();
            let done_tx = done_tx.clone();
            let spawned = std::thread::Builder::new().name("gpupool-sleep".into()).spawn_scoped(scope, move || {
                for part in rx {
                    run(&part);
                    if done_tx.send(()).is_err() {
                        return;
                    }
                }
            });
            match spawned {
                Ok(_) => crew.workers.push(tx),
                Err(_) => break,
            }
        }
        crew
    }

    /// Threads of the crew, the calling one included.
    pub fn threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// Runs every copy of `moves`, cut into parts of about equal bytes, one per thread, and
    /// returns once all have run.
    ///
    /// # Safety
    /// Each move's source must be readable and its destination writable for its bytes until
    /// this returns, and no destination may overlap another move's source or destination.
    pub unsafe fn copy(&self, moves: &[Move]) {
        let total: usize = moves.iter().map(|m| m.2).sum();
        let parts = cut(moves, total, self.threads()).into_iter().map(Part::Copy).collect();
        self.run_parts(parts);
    }

    /// Calls `f(start, bytes)` once for each of `ranges`, the ranges dealt to the threads in
    /// turn, and returns once all have run (the caller cuts the work into one range a thread).
    ///
    /// # Safety
    /// Whatever `f` does to a range must be sound from any thread while this runs, and no two
    /// ranges may overlap.
    pub unsafe fn each(&self, ranges: &[(usize, usize)], f: fn(usize, usize)) {
        let n = self.threads();
        let mut parts: Vec<Vec<(usize, usize)>> = vec![Vec::new(); n.min(ranges.len()).max(1)];
        let k = parts.len();
        for (i, &r) in ranges.iter().enumerate() {
            parts[i % k].push(r);
        }
        self.run_parts(parts.into_iter().map(|p| Part::Each(p, f)).collect());
    }

    /// Runs the last of `parts` on the calling thread and the others on the workers, and
    /// waits for all.
    fn run_parts(&self, mut parts: Vec<Part>) {
        let mine = parts.pop().unwrap_or(Part::Copy(Vec::new()));
        let mut sent = 0;
        for (worker, part) in self.workers.iter().zip(parts) {
            match worker.send(part) {
                Ok(()) => sent += 1,
                // A worker gone (it cannot be: none returns while its channel is open) leaves
                // its part to this thread.
                Err(mpsc::SendError(part)) => run(&part),
            }
        }
        run(&mine);
        for _ in 0..sent {
            // A worker that ended before replying copied its part first or never got it.
            if self.done.recv().is_err() {
                break;
            }
        }
    }
}

/// Cuts `moves` (of `total` bytes) into at most `n` parts of about `total / n` bytes each,
/// splitting a move where a part ends; parts of less than 64 KiB are not worth a thread.
fn cut(moves: &[Move], total: usize, n: usize) -> Vec<Vec<Move>> {
    let each = total.div_ceil(n.max(1)).max(64 << 10);
    let mut parts = vec![Vec::new()];
    let mut room = each;
    for &(mut dst, mut src, mut len) in moves {
        while len > 0 {
            if room == 0 {
                parts.push(Vec::new());
                room = each;
            }
            let k = len.min(room);
            parts.last_mut().expect("one part").push((dst, src, k));
            (dst, src, len, room) = (dst + k, src + k, len - k, room - k);
        }
    }
    parts
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_byte_is_copied_once_whatever_the_crew_and_the_cuts() {
        let src: Vec<u8> = (0..3_000_017u32).map(|i| (i * 7 + 3) as u8).collect();
        for threads in [1, 2, 3, 8] {
            let mut dst = vec![0u8; src.len()];
            let (d, s) = (dst.as_mut_ptr() as usize, src.as_ptr() as usize);
            let moves = [(d, s, 100), (d + 100, s + 100, 1_500_000), (d + 1_500_100, s + 1_500_100, 1_499_917)];
            std::thread::scope(|scope| {
                let crew = Crew::new(scope, threads);
                assert_eq!(crew.threads(), threads);
                // SAFETY: both vectors outlive the call; the moves tile them without overlap.
                unsafe { crew.copy(&moves) };
                unsafe { crew.copy(&[]) };
            });
            assert_eq!(dst, src, "{threads} threads");
        }
    }

    #[test]
    fn parts_cover_the_moves_in_order() {
        let moves = [(1000, 0, 300_000), (2_000_000, 500_000, 10)];
        let parts = cut(&moves, 300_010, 3);
        assert_eq!(parts.len(), 3);
        let bytes: usize = parts.iter().flat_map(|p| p.iter()).map(|m| m.2).sum();
        assert_eq!(bytes, 300_010);
        assert_eq!(parts[0][0], (1000, 0, 100_004));
        assert_eq!(crew_size(3), 3);
        assert!((1..=8).contains(&crew_size(0)));
    }

    #[test]
    fn each_calls_the_function_once_per_range_from_the_crew() {
        static SEEN: std::sync::Mutex<Vec<(usize, usize)>> = std::sync::Mutex::new(Vec::new());
        fn note(at: usize, len: usize) {
            SEEN.lock().unwrap().push((at, len));
        }
        let ranges: Vec<(usize, usize)> = (0..11).map(|i| (i * 10, 10)).collect();
        std::thread::scope(|scope| {
            let crew = Crew::new(scope, 4);
            // SAFETY: `note` touches no memory of the ranges.
            unsafe { crew.each(&ranges, note) };
        });
        let mut seen = SEEN.lock().unwrap().clone();
        seen.sort_unstable();
        assert_eq!(seen, ranges);
    }
}
