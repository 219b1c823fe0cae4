//! One stream's share of a pool going to sleep and waking (see `caching::sleep`): the work on
//! its blocks waited for by events, its live blocks copied to host memory, every page
//! of its expandable segments unmapped and its handles given back to the driver; and at wake
//! the same pages mapped again from new handles and the copies put back. The blocks never
//! move: a sleeping shard keeps its segments, blocks, live map and counters (reserved bytes
//! included: they count the pages it will map again), only the page tables are empty.

use super::copy::Copies;
use super::sleepers::SleepMode;
use crate::caching::block::{BlockId, BlockState};
use crate::caching::expandable::Expandable;
use crate::caching::observers::segments::SegmentEventKind;
use crate::caching::shard::{ShardCtx, ShardState};
use crate::driver::{DevicePtr, DriverError, HostPtr, PhysHandle};
use crate::error::Error;
use crate::history::Action;

/// The stream handle that names each thread's own default stream (`CU_STREAM_PER_THREAD`):
/// an event recorded on it covers only the calling thread's work.
const PER_THREAD_STREAM: usize = 2;

/// A sleep or a wake of an expandable segment's pages ([`Expandable::sleep`],
/// [`Expandable::wake`]).
type PageChange<'c> = &'c dyn Fn(&mut Expandable, &mut Vec<PhysHandle>) -> Result<(), DriverError>;

/// A sleep of an expandable segment's pages ([`Expandable::sleep`]) on `ctx`'s device.
fn unmap_all<'c>(ctx: &'c ShardCtx) -> impl Fn(&mut Expandable, &mut Vec<PhysHandle>) -> Result<(), DriverError> + 'c {
    move |e, out| e.sleep(ctx.driver, ctx.device, out)
}

/// What a sleeping shard keeps: its mode and the copies of its live blocks.
#[derive(Debug)]
pub(crate) struct ShardSleep {
    pub mode: SleepMode,
    /// Offload: each live block at sleep, as (address, bytes, offset in the host copy).
    copies: Vec<(DevicePtr, usize, usize)>,
    /// The same bytes as runs of neighbouring live blocks of one segment, each one range of
    /// device addresses and of the host copy (address, bytes, offset): what is copied, so that
    /// a thousand blocks of 1 MiB side by side are a few copies of a buffer each, not a
    /// thousand.
    runs: Vec<(DevicePtr, usize, usize)>,
    /// The host copy; `ptr` 0 for none.
    host: SleepHost,
    /// The driver would not unmap some page at sleep: it stays mapped, and counted as such.
    partial: bool,
}

/// A shard's host copy while it sleeps: `used` bytes at `ptr`, pageable memory of
/// `driver::pageable` (`pinned` 0) or the first `used` bytes of a pinned copy of `pinned`
/// bytes that the pool keeps (`pinned_copies`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct SleepHost {
    pub ptr: HostPtr,
    pub used: usize,
    pub pinned: usize,
}

/// The stretches of neighbouring pages `i` of `flags` for which `pick(i, flags[i])` holds, as
/// (first page, pages).
fn runs(flags: &[bool], pick: impl Fn(usize, bool) -> bool) -> Vec<(usize, usize)> {
    let mut out: Vec<(usize, usize)> = Vec::new();
    for (i, _) in flags.iter().enumerate().filter(|&(i, &f)| pick(i, f)) {
        match out.last_mut() {
            Some((first, n)) if *first + *n == i => *n += 1,
            _ => out.push((i, 1)),
        }
    }
    out
}

impl ShardSleep {
    /// The host copy of a sleep prepared but not begun (a later step failed), for the caller
    /// to give back.
    pub fn discard(self) -> SleepHost {
        self.host
    }
}

impl ShardState {
    /// Whether the shard's pool sleeps (its pages are given back).
    pub fn is_asleep(&self) -> bool {
        self.asleep.is_some()
    }

    /// Bytes of the pages of its expandable segments that are slept: unmapped by a sleep, to
    /// be mapped again at wake.
    pub fn slept_bytes(&self) -> usize {
        self.segments.values().filter_map(|s| s.exp.as_deref()).map(|e| e.slept_bytes).sum()
    }

    /// Whether blocks await a device synchronisation (`free_after_device_sync`).
    pub fn has_deferred_sync(&self) -> bool {
        self.deferred.len() != 0
    }

    /// Whether the shard sleeps with its live blocks copied to host memory.
    pub fn offloaded(&self) -> bool {
        self.asleep.as_ref().is_some_and(|s| s.mode.offloads())
    }

    /// Whether the shard's pages must stay as they are: its pool sleeps, or a sleep has
    /// prepared it and not yet unmapped them (`empty_cache`, the out-of-memory path, the
    /// high-water rule and gc release nothing of it then: PyTorch has no sleep; vLLM's
    /// `CuMemAllocator` and torch_memory_saver hold their own lock over a whole sleep).
    pub fn keeps_pages(&self) -> bool {
        self.asleep.is_some() || self.sleep_prepared
    }

    /// Undoes the first half of a sleep that will not go on (a later step failed): the shard's
    /// pages may be released again.
    pub fn abandon_sleep(&mut self) {
        self.sleep_prepared = false;
    }

    /// The first half of a sleep with [`SleepMode::Discard`]: nothing to copy.
    pub fn prepare_discard(&mut self) -> ShardSleep {
        self.sleep_prepared = true;
        ShardSleep {
            mode: SleepMode::Discard,
            copies: Vec::new(),
            runs: Vec::new(),
            host: SleepHost::default(),
            partial: false,
        }
    }

    /// Bytes mapped in its expandable segments.
    pub fn mapped_bytes(&self) -> usize {
        self.segments.values().filter_map(|s| s.exp.as_deref()).map(|e| e.mapped).sum()
    }

    /// The base of an ordinary segment of the shard, which could not sleep; `None` when every
    /// segment is expandable.
    pub fn ordinary_segment(&self) -> Option<(DevicePtr, usize)> {
        self.segments.iter().find(|(_, s)| s.exp.is_none()).map(|(&b, s)| (b, s.size))
    }

    /// Waits for the work that may still use the shard's memory, by events, not by
    /// synchronising the device: the events of freed blocks (`record_stream`, PyTorch
    /// `synchronize_and_free_events`), then an event recorded now on the shard's stream and on
    /// every stream a live block was recorded on (`cuEventRecord`, `cuEventSynchronize`). The
    /// per-thread default stream is waited for by a device synchronisation (its handle names
    /// every thread's stream).
    ///
    /// Errors: [`Error::Cuda`] when an event call or the synchronisation fails; the events
    /// recorded go back to the idle ones.
    pub fn wait_for_work(&mut self, ctx: &ShardCtx) -> Result<(), Error> {
        if self.has_capture_deferred() {
            self.insert_deferred_events(ctx);
        }
        self.synchronize_events(ctx)?;
        let mut streams = vec![ctx.shard.stream];
        for &id in self.live.values() {
            for &s in self.blocks[id].stream_uses.iter() {
                if s != crate::caching::ipc::EXPORTED && !streams.contains(&s) {
                    streams.push(s);
                }
            }
        }
        let fail = |e| Error::driver(e, "waiting for the work queued on a pool's blocks before it sleeps");
        if streams.contains(&PER_THREAD_STREAM) {
            return ctx.driver.device_synchronize(ctx.device).map_err(fail);
        }
        for s in streams {
            let ev = self.events.record(ctx.driver, ctx.device, s).map_err(fail)?;
            let r = ctx.driver.event_synchronize(ev);
            self.events.unused([ev]);
            r.map_err(fail)?;
        }
        Ok(())
    }

    /// Bytes of the shard's live blocks: what its host copy must hold.
    pub fn live_bytes(&self) -> usize {
        self.live.values().map(|&id| self.blocks[id].size).sum()
    }

    /// The first half of a sleep that offloads (`mode`), which changes nothing of the shard
    /// but marking its pages kept ([`ShardState::keeps_pages`]):
    /// the copies of every live block into `host` (at least [`ShardState::live_bytes`] bytes,
    /// pinned for a [`super::copy_direct::Direct`] `copies`) added to `copies` (the
    /// caller finishes them). Returns what the shard will keep asleep.
    ///
    /// Errors: [`Error::Cuda`] when a copy cannot be queued; the caller gives `host` back.
    pub fn prepare_sleep(
        &mut self,
        copies: &mut dyn Copies,
        mode: SleepMode,
        host: SleepHost,
    ) -> Result<ShardSleep, Error> {
        let mut sleep = ShardSleep { mode, copies: Vec::new(), runs: Vec::new(), host, partial: false };
        let mut live: Vec<(DevicePtr, usize, BlockId)> =
            self.live.values().map(|&id| (self.blocks[id].addr, self.blocks[id].size, id)).collect();
        live.sort_unstable_by_key(|l| l.0);
        let (mut at, mut prev) = (0, None);
        for (addr, size, id) in live {
            sleep.copies.push((addr, size, at));
            // The block right after the previous one in its segment: the same run.
            match sleep.runs.last_mut() {
                Some(run) if prev.is_some_and(|p: BlockId| self.blocks[p].next == id) => run.1 += size,
                _ => sleep.runs.push((addr, size, at)),
            }
            prev = Some(id);
            at += size;
        }
        debug_assert!(at == host.used);
        for &(addr, size, off) in &sleep.runs {
            copies
                .add(host.ptr + off, addr, size)
                .map_err(|e| Error::driver(e, "copying a pool's live blocks to host memory"))?;
        }
        // From here a free of one of these blocks leaves its pages mapped until the sleep
        // unmaps them: a concurrent release unmapping them lost the blocks beside it at wake,
        // whose copy spans them (the runs above), for good.
        self.sleep_prepared = true;
        Ok(sleep)
    }

    /// The second half of a sleep: every page of the shard's expandable segments unmapped
    /// (the caller has waited for the work on them and for the copies), its handle appended to
    /// `handles` with its page's bytes for the caller to give back, each page recorded as a
    /// `segment_unmap` while history is on. The shard is asleep from here on, whatever fails.
    ///
    /// Errors: the first failure of the driver; the pages it would not unmap stay mapped (and
    /// counted as mapped), the others are slept. A call that unwinds leaves the shard asleep
    /// likewise, and the handles it unmapped in `handles`.
    pub fn sleep_pages(
        &mut self,
        ctx: &ShardCtx,
        mut sleep: ShardSleep,
        handles: &mut Vec<(usize, PhysHandle)>,
    ) -> Result<(), DriverError> {
        // Asleep from the first page on; `partial` until every page is unmapped.
        sleep.partial = true;
        self.asleep = Some(Box::new(sleep));
        self.sleep_prepared = false;
        let mut failure = Ok(());
        for base in self.expandables.clone() {
            failure = failure.and(self.change_pages(ctx, base, handles, &unmap_all(ctx), true));
        }
        if failure.is_ok()
            && let Some(s) = self.asleep.as_deref_mut()
        {
            s.partial = false;
        }
        failure
    }

    /// Runs `change` (a sleep of its pages, `unmaps`, or a wake) on the expandable segment at
    /// `base`, with its handles unmapped or left over appended to `handles` with their page's
    /// bytes, and each page whose mapping changed recorded as a `segment_map` or
    /// `segment_unmap` while history is on, whatever happens, a driver call that unwinds
    /// included. Segment observers are told as for any other mapping (`segment_observers`):
    /// the pages a sleep unmaps before the driver call, with the lock held (an NCCL
    /// registration is taken off memory still there), those a wake maps once the lock is
    /// dropped, and pages the driver would not unmap told mapped again.
    fn change_pages(
        &mut self,
        ctx: &ShardCtx,
        base: DevicePtr,
        handles: &mut Vec<(usize, PhysHandle)>,
        change: PageChange<'_>,
        unmaps: bool,
    ) -> Result<(), DriverError> {
        let observe = ctx.segments.on();
        let e = self.segments.get_mut(&base).and_then(|s| s.exp.as_deref_mut()).expect("expandable");
        let (page, pages) = (e.page, e.size / e.page);
        let before: Vec<bool> =
            if ctx.history.on() || observe { (0..pages).map(|i| e.is_mapped(i * page)).collect() } else { Vec::new() };
        if observe && unmaps {
            for (first, n) in runs(&before, |_, was| was) {
                self.observe_now(ctx, SegmentEventKind::Unmap, base + (first * page) as u64, n * page);
            }
        }
        let e = self.segments.get_mut(&base).and_then(|s| s.exp.as_deref_mut()).expect("expandable");
        let mut out = Vec::new();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| change(e, &mut out)));
        handles.extend(out.into_iter().map(|h| (page, h)));
        if !before.is_empty() {
            let seg = &self.segments[&base];
            let e = seg.exp.as_deref().expect("expandable");
            let now: Vec<bool> = (0..pages).map(|i| e.is_mapped(i * page)).collect();
            if ctx.history.on() {
                for (i, (&was, &is)) in before.iter().zip(&now).enumerate() {
                    if is != was {
                        let action = if is { Action::SegmentMap } else { Action::SegmentUnmap };
                        let at = base + (i * page) as u64;
                        ctx.history.record(action, at, page, page, ctx.shard.stream, seg.ctx);
                    }
                }
            }
            if observe {
                // Mapped now, and either told unmapped above or not mapped before.
                for (first, n) in runs(&now, |i, is| is && (unmaps || !before[i])) {
                    self.observe_later(ctx, SegmentEventKind::Map, base + (first * page) as u64, n * page);
                }
            }
        }
        r.unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    }

    /// The first half of a wake: the slept pages mapped again from new handles. All or
    /// nothing: on a failure the pages this call mapped are unmapped again, their handles
    /// appended to `spare` with their page's bytes, for the caller to give back.
    ///
    /// Errors: the first failure ([`DriverError::OutOfMemory`] when the device has no memory
    /// for a page).
    pub fn map_slept(&mut self, ctx: &ShardCtx, spare: &mut Vec<(usize, PhysHandle)>) -> Result<(), DriverError> {
        let bases = self.expandables.clone();
        // Under the shard's lock: the peers enabled by now (see `caching::peers`).
        let access = ctx.peers.access(ctx.device);
        let wake = |e: &mut Expandable, out: &mut Vec<PhysHandle>| e.wake(ctx.driver, ctx.device, out, &access);
        for (k, &base) in bases.iter().enumerate() {
            if let Err(err) = self.change_pages(ctx, base, spare, &wake, false) {
                for &b in bases[..k].iter().rev() {
                    let _ = self.change_pages(ctx, b, spare, &unmap_all(ctx), true);
                }
                return Err(err);
            }
        }
        Ok(())
    }

    /// Undoes [`ShardState::map_slept`] (another shard of the pool failed): every page
    /// unmapped again and marked slept, its handle appended to `spare` with its page's bytes.
    ///
    /// Errors: the first failure; the pages the driver would not unmap stay mapped.
    pub fn unmap_woken(&mut self, ctx: &ShardCtx, spare: &mut Vec<(usize, PhysHandle)>) -> Result<(), DriverError> {
        // Pages the driver would not unmap stay mapped, counted as such, whatever happens.
        let mut st = scopeguard::guard(self, |st| {
            let mapped = st.mapped_bytes() != 0;
            if let Some(s) = st.asleep.as_deref_mut() {
                s.partial |= mapped;
            }
        });
        let mut failure = Ok(());
        for base in st.expandables.clone() {
            failure = failure.and(st.change_pages(ctx, base, spare, &unmap_all(ctx), true));
        }
        failure
    }

    /// Adds to `copier` the copies of the shard's host copy back to its blocks (offload).
    ///
    /// Errors: the driver's.
    pub fn restore(&self, copies: &mut dyn Copies) -> Result<(), DriverError> {
        let Some(s) = self.asleep.as_deref() else { return Ok(()) };
        for &(addr, size, at) in &s.runs {
            copies.add(s.host.ptr + at, addr, size)?;
        }
        Ok(())
    }

    /// The mode and host copy of a sleeping shard; `None` awake.
    pub fn sleep_host(&self) -> Option<(SleepMode, SleepHost)> {
        self.asleep.as_deref().map(|s| (s.mode, s.host))
    }

    /// Whether the shard sleeps with a pinned host copy (`GPUPOOL_SLEEP_OFFLOAD_PINNED`).
    pub fn pinned_copy(&self) -> bool {
        self.asleep.as_ref().is_some_and(|s| s.host.pinned != 0)
    }

    /// The end of a wake: the shard awake. Returns its host copy (`ptr` 0: none), for the
    /// caller to give back once every stream of the pool is awake.
    pub fn finish_wake(&mut self) -> SleepHost {
        self.asleep.take().map_or(SleepHost::default(), |s| s.host)
    }

    /// The sleep's part of the consistency check: a sleeping shard maps no page (unless the
    /// driver refused to unmap one) and holds only expandable segments, and with offload every
    /// live block has its copy, the copies tiling the host memory; an awake one has no page
    /// slept.
    pub(in crate::caching) fn check_sleep(&self) -> Result<(), String> {
        let exps = || self.segments.values().filter_map(|s| s.exp.as_deref());
        let Some(s) = self.asleep.as_deref() else {
            return match exps().find(|e| e.slept_bytes != 0) {
                Some(e) => Err(format!("segment {:#x} has slept pages, but its pool is awake", e.base)),
                None => Ok(()),
            };
        };
        if let Some((base, _)) = self.ordinary_segment() {
            return Err(format!("a sleeping pool holds the ordinary segment {base:#x}"));
        }
        if let Some(e) = exps().find(|e| e.mapped != 0 && !s.partial) {
            return Err(format!("segment {:#x} of a sleeping pool still maps {} bytes", e.base, e.mapped));
        }
        if s.host.pinned != 0 && s.host.pinned < s.host.used {
            return Err(format!("a sleeping pool uses {} bytes of a pinned copy of {}", s.host.used, s.host.pinned));
        }
        if s.mode.offloads() {
            let mut at = 0;
            for &(_, size, off) in &s.copies {
                if off != at {
                    return Err("the copies of a sleeping pool do not tile its host memory".into());
                }
                at += size;
            }
            if at != s.host.used {
                return Err(format!("a sleeping pool's copies hold {at} bytes, its host memory {}", s.host.used));
            }
            let mut end = 0;
            for &(addr, size, off) in &s.runs {
                let first = s.copies.iter().find(|c| c.2 == off);
                if off != end || first.is_none_or(|c| c.0 != addr) {
                    return Err("the runs of a sleeping pool's copies do not tile its copies".into());
                }
                end += size;
            }
            if end != at {
                return Err(format!("a sleeping pool's runs hold {end} bytes, its copies {at}"));
            }
            // The wake maps the slept pages and copies every run back: each page a run spans
            // is slept (or still mapped), or the wake fails and the copy is lost.
            for &(addr, size, _) in &s.runs {
                let seg = self.segments.iter().filter_map(|(&b, seg)| seg.exp.as_deref().map(|e| (b, e)));
                let Some((base, e)) = seg.into_iter().find(|&(b, e)| addr >= b && addr - b < e.size as u64) else {
                    return Err(format!("the copy of {addr:#x} of a sleeping pool lies in no segment of the pool"));
                };
                let (lo, hi) = ((addr - base) as usize, (addr - base) as usize + size);
                if let Some(off) = (lo / e.page * e.page..hi).step_by(e.page).find(|&o| !e.is_held(o)) {
                    return Err(format!(
                        "the copy of {addr:#x} ({size} bytes) of a sleeping pool spans page {:#x}, which is \
                         neither slept nor mapped: the wake cannot put it back",
                        base + off as u64
                    ));
                }
            }
            for &id in self.live.values() {
                let b = &self.blocks[id];
                // A block freed while the pool sleeps waits in the front cache (listed live, see
                // `front`) and needs no copy.
                if b.state == BlockState::Cached {
                    continue;
                }
                if b.state != BlockState::Allocated || !s.copies.iter().any(|c| c.0 == b.addr && c.1 == b.size) {
                    return Err(format!("live block {:#x} of a sleeping pool has no copy", b.addr));
                }
            }
        }
        Ok(())
    }
}
