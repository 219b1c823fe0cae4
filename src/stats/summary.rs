//! The text table of `torch.cuda.memory_summary()`, and PyTorch's size formats.

use std::fmt::Write;

use super::{DeviceStats, PoolStats, Stat, StatArray};

/// A byte count as PyTorch's allocator writes it in messages (`format_size` in
/// `CUDACachingAllocator.cpp`): "512 bytes", "1.50 KiB", "20.00 MiB", "79.19 GiB".
pub fn format_size(size: u64) -> String {
    let s = size as f64;
    if size <= 1024 {
        format!("{size} bytes")
    } else if size <= 1 << 20 {
        format!("{:.2} KiB", s / 1024.0)
    } else if size <= 1 << 30 {
        format!("{:.2} MiB", s / 1048576.0)
    } else {
        format!("{:.2} GiB", s / 1073741824.0)
    }
}

/// A table value scaled as PyTorch's `memory_summary` does: divided by `base` and given the
/// next unit while the row's reference value is at least `threshold` (768 KiB for sizes in
/// `_format_size`, 750 K for counts in `_format_count`).
fn scaled<'u>(mut value: i64, reference: i64, units: &[&'u str], base: i64, threshold: f64) -> (i64, &'u str) {
    let mut reference = reference as f64;
    let mut unit = 0;
    while unit + 1 < units.len() && reference >= threshold {
        unit += 1;
        value /= base;
        reference /= base as f64;
    }
    (value, units[unit])
}

/// PyTorch `memory_summary`'s `_format_size`.
fn table_size(value: i64, reference: i64) -> String {
    let (v, unit) = scaled(value, reference, &["B  ", "KiB", "MiB", "GiB", "TiB", "PiB"], 1024, 768.0 * 1024.0);
    format!("{v:6} {unit}")
}

/// PyTorch `memory_summary`'s `_format_count`.
fn table_count(value: i64, reference: i64) -> String {
    let (v, unit) = scaled(value, reference, &[" ", "K", "M"], 1000, 750.0 * 1000.0);
    format!("{v:7} {unit} ")
}

const WIDTH: usize = 75;

fn rule(out: &mut String, c: char) {
    out.push('|');
    out.extend(std::iter::repeat_n(c, WIDTH));
    out.push_str("|\n");
}

fn row(out: &mut String, name: &str, stat: &Stat, reference: &Stat, bytes: bool) {
    let f = |v: i64, r: i64| if bytes { table_size(v, r) } else { table_count(v, r) };
    let _ = writeln!(
        out,
        "| {:<21} | {} | {} | {} | {} |",
        name,
        f(stat.current, reference.current),
        f(stat.peak, reference.peak),
        f(stat.allocated, reference.allocated),
        f(stat.freed, reference.freed),
    );
}

fn section(out: &mut String, name: &str, a: &StatArray, bytes: bool) {
    row(out, name, &a.all, &a.all, bytes);
    row(out, "      from large pool", &a.large_pool, &a.all, bytes);
    row(out, "      from small pool", &a.small_pool, &a.all, bytes);
    rule(out, '-');
}

/// The table for one device, with the rows and columns of `torch.cuda.memory_summary()`.
pub fn memory_summary(device: i32, driver: &str, s: &DeviceStats) -> String {
    let mut out = String::with_capacity(4096);
    rule(&mut out, '=');
    let title = format!("gpupool memory summary, device ID {device} ({driver} driver)");
    let _ = writeln!(out, "|{title:^WIDTH$}|");
    rule(&mut out, '-');
    let ooms = format!("OOMs: {:<9}", s.num_ooms);
    let retries = format!("device alloc retries: {:<5}", s.num_alloc_retries);
    let _ = writeln!(out, "|{ooms:^37}|{retries:^37}|");
    rule(&mut out, '=');
    let _ = writeln!(out, "|        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  |");
    rule(&mut out, '-');
    section(&mut out, "Allocated memory", &s.allocated_bytes, true);
    section(&mut out, "Active memory", &s.active_bytes, true);
    section(&mut out, "Requested memory", &s.requested_bytes, true);
    section(&mut out, "GPU reserved memory", &s.reserved_bytes, true);
    section(&mut out, "Non-releasable memory", &s.inactive_split_bytes, true);
    section(&mut out, "Allocations", &s.allocation, false);
    section(&mut out, "Active allocs", &s.active, false);
    section(&mut out, "GPU reserved segments", &s.segment, false);
    section(&mut out, "Non-releasable allocs", &s.inactive_split, false);
    row(&mut out, "Oversize allocations", &s.oversize_allocations, &s.oversize_allocations, false);
    rule(&mut out, '-');
    row(&mut out, "Oversize GPU segments", &s.oversize_segments, &s.oversize_segments, false);
    rule(&mut out, '=');
    let sync = format!("syncs of all streams: {:<6}", s.num_sync_all_streams);
    let calls = format!("device allocs: {:<7} frees: {:<7}", s.num_device_alloc, s.num_device_free);
    let _ = writeln!(out, "|{sync:^37}|{calls:^37}|");
    rule(&mut out, '-');
    // Not in PyTorch: physical pages held unmapped for expandable segments, outside reserved.
    let h = &s.unmapped_held_bytes;
    let held = format!(
        "Unmapped pages held: {} now, {} at peak",
        format_size(h.current.max(0) as u64),
        format_size(h.peak.max(0) as u64)
    );
    let _ = writeln!(out, "|{held:^WIDTH$}|");
    // Not in PyTorch: reserved bytes of sleeping pools, given back to the driver until wake.
    let z = &s.sleeping_bytes;
    if z.peak > 0 {
        let asleep = format!(
            "Sleeping (in reserved, given back): {} now, {} at peak",
            format_size(z.current.max(0) as u64),
            format_size(z.peak.max(0) as u64)
        );
        let _ = writeln!(out, "|{asleep:^WIDTH$}|");
    }
    rule(&mut out, '=');
    out
}

/// The private pools of a device, after [`memory_summary`]'s table: per pool (by id) its state
/// and its allocated and reserved bytes, current and peak, and its segments (the table's
/// totals include them). Not in PyTorch, whose summary does not list pools.
pub fn pools_summary(pools: &[PoolStats]) -> String {
    let mut out = String::new();
    if pools.is_empty() {
        return out;
    }
    let line = |out: &mut String, pool: &str, state: &str, alloc: &str, reserved: &str, segments: &str| {
        let _ = writeln!(out, "| {pool:>6} {state:<10} | {alloc:^23} | {reserved:^23} | {segments:>8} |");
    };
    let mut header = String::new();
    line(&mut header, "Pool", "State", "Allocated cur / peak", "Reserved cur / peak", "Segments");
    let inner = header.trim_end().chars().count() - 2;
    let bar = |out: &mut String, c: char| {
        out.push('|');
        out.extend(std::iter::repeat_n(c, inner));
        out.push_str("|\n");
    };
    let _ = writeln!(out, "|{:^inner$}|", "Private pools (counted in the table above)");
    bar(&mut out, '-');
    out.push_str(&header);
    bar(&mut out, '-');
    for p in pools {
        let state = if p.released {
            "released".to_string()
        } else {
            format!("{} route{}", p.routes, if p.routes == 1 { "" } else { "s" })
        };
        let (a, r) = (&p.stats.allocated_bytes.all, &p.stats.reserved_bytes.all);
        let alloc = format!("{} / {}", table_size(a.current, a.peak), table_size(a.peak, a.peak));
        let reserved = format!("{} / {}", table_size(r.current, r.peak), table_size(r.peak, r.peak));
        line(&mut out, &p.pool.to_string(), &state, &alloc, &reserved, &p.stats.segment.all.current.to_string());
    }
    bar(&mut out, '=');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_read_like_pytorch() {
        assert_eq!(format_size(512), "512 bytes");
        assert_eq!(format_size(1536), "1.50 KiB");
        assert_eq!(format_size(20 << 20), "20.00 MiB");
        assert_eq!(format_size(3 << 30), "3.00 GiB");
        assert_eq!(table_size(2 << 20, 2 << 20), "  2048 KiB");
        assert_eq!(table_size(1 << 30, 1 << 30), "  1024 MiB");
        assert_eq!(table_count(12, 12), "     12   ");
    }

    #[test]
    fn every_row_has_the_table_width() {
        let text = memory_summary(0, "sim", &DeviceStats::default());
        for line in text.lines() {
            assert_eq!(line.chars().count(), WIDTH + 2, "{line:?}");
        }
        assert!(text.contains("Allocated memory"));
        assert!(text.contains("Non-releasable allocs"));
        let mut s = DeviceStats::default();
        s.unmapped_held_bytes.current = 6 << 20;
        s.unmapped_held_bytes.peak = 3 << 30;
        let text = memory_summary(0, "sim", &s);
        assert!(text.contains("Unmapped pages held: 6.00 MiB now, 3.00 GiB at peak"), "{text}");
        assert!(text.lines().all(|l| l.chars().count() == WIDTH + 2), "{text}");
    }

    #[test]
    fn the_pools_table_lines_up() {
        let mut live = PoolStats { pool: 7, routes: 1, ..Default::default() };
        live.stats.reserved_bytes.all = Stat { current: 20 << 20, peak: 40 << 20, allocated: 0, freed: 0 };
        let released = PoolStats { pool: 12345, released: true, ..Default::default() };
        let text = pools_summary(&[live, released]);
        let widths: Vec<usize> = text.lines().map(|l| l.chars().count()).collect();
        assert!(widths.windows(2).all(|w| w[0] == w[1]), "{text}");
        assert!(text.contains("      7 1 route") && text.contains("  12345 released"), "{text}");
        assert!(text.contains("20480 KiB /  40960 KiB"), "{text}");
        assert_eq!(pools_summary(&[]), "");
    }
}
