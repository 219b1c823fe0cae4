//! `roundup_power2_divisions`: reading its value, a single power of two or a list per size
//! interval, into [`Config::roundup_power2_divisions`] (PyTorch
//! `AcceleratorAllocatorConfig::parseRoundUpPower2Divisions`, `c10/core/AllocatorConfig.cpp`),
//! and writing the table back so that it reads back the same.

use std::fmt::Write;

use super::ROUNDUP_INTERVALS;
use super::parse::{Raw, count};
use crate::config::Config;

/// PyTorch `parseRoundUpPower2Divisions`: a single power of two sets every interval; a list
/// writes the intervals it names into the table as it stands.
pub(super) fn apply_roundup(c: &mut Config, v: &Raw) -> Result<(), String> {
    let table = &mut c.roundup_power2_divisions;
    let items = match v {
        Raw::Word(w) => {
            let d = count(w).filter(|d| d.is_power_of_two()).ok_or("a power of two, or a list [MiB:divisions,...]")?;
            *table = [d; ROUNDUP_INTERVALS];
            return Ok(());
        }
        Raw::List(items) => items,
    };
    // Checked first, so that a bad item leaves the table as it was.
    let mut parsed = Vec::with_capacity(items.len());
    for (bound, divisions) in items {
        let d = count(divisions)
            .filter(|d| *d == 0 || d.is_power_of_two())
            .ok_or_else(|| format!("divisions 0 or a power of two, not {divisions:?} (in {bound}:{divisions})"))?;
        let interval = if bound == ">" {
            None
        } else {
            let mb = count(bound)
                .filter(|b| b.is_power_of_two())
                .ok_or_else(|| format!("an interval that is a power of two (MiB) or >, not {bound:?}"))?;
            Some((mb.trailing_zeros() as usize).min(ROUNDUP_INTERVALS - 1))
        };
        parsed.push((interval, d));
    }
    // The first interval named also sets every interval below it; `>` sets every interval
    // after the last one named (after the first interval when none was named).
    let mut first = true;
    let mut last = 0;
    for (interval, d) in parsed {
        match interval {
            None => table[last + 1..].fill(d),
            Some(i) => {
                if first {
                    table[..i].fill(d);
                    first = false;
                }
                table[i] = d;
                last = i;
            }
        }
    }
    Ok(())
}

/// `roundup_power2_divisions` written so that [`apply_roundup`] reads back the same table from
/// PyTorch's reset state (every interval 0): one number when every interval has the same
/// nonzero divisions, else a list: the first item ends the leading run (it fills the
/// intervals below it), the middle intervals one by one, `>` the trailing run.
pub(super) fn show_roundup(t: &[usize; ROUNDUP_INTERVALS]) -> String {
    let last = ROUNDUP_INTERVALS - 1;
    if t.iter().all(|&d| d == t[0]) {
        return if t[0] != 0 { t[0].to_string() } else { "[1:0,>:0]".to_string() };
    }
    let lead = t.iter().position(|&d| d != t[0]).unwrap_or(ROUNDUP_INTERVALS) - 1;
    let trail = (0..=last).rev().find(|&i| t[i] != t[last]).map_or(0, |i| i + 1);
    debug_assert!(lead < trail && trail <= last);
    let mut out = String::from("[");
    let _ = write!(out, "{}:{}", 1usize << lead, t[lead]);
    for (i, d) in t.iter().enumerate().take(trail).skip(lead + 1) {
        let _ = write!(out, ",{}:{d}", 1usize << i);
    }
    // Not all equal: the leading run ends before the trailing one starts, so `>` fills
    // exactly the trailing run.
    let _ = write!(out, ",>:{}", t[last]);
    out.push(']');
    out
}
