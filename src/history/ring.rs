//! The newest events of one device, at most a set number of them (PyTorch
//! `RingBuffer<TraceEntry>`, whose `max_entries` keeps the newest).

use std::collections::VecDeque;

/// Up to `max` values, the oldest dropped first. Grows as it fills, so that a large `max`
/// costs memory only once that many events happened.
#[derive(Debug)]
pub(crate) struct Ring<T> {
    buf: VecDeque<T>,
    max: usize,
}

impl<T> Default for Ring<T> {
    fn default() -> Self {
        Ring { buf: VecDeque::new(), max: 0 }
    }
}

impl<T: Clone> Ring<T> {
    /// Adds `value`, dropping the oldest when full. Keeps nothing when `max` is 0.
    pub fn push(&mut self, value: T) {
        if self.max == 0 {
            return;
        }
        if self.buf.len() == self.max {
            self.buf.pop_front();
        }
        self.buf.push_back(value);
    }

    /// Keeps at most `max` values from now on, dropping the oldest beyond that now.
    pub fn set_max(&mut self, max: usize) {
        self.max = max;
        if self.buf.len() > max {
            self.buf.drain(..self.buf.len() - max);
        }
        if self.buf.capacity() > 2 * self.buf.len() + 1024 {
            self.buf.shrink_to_fit();
        }
    }

    /// Drops every value.
    pub fn clear(&mut self) {
        self.buf = VecDeque::new();
    }

    /// The values, oldest first.
    pub fn to_vec(&self) -> Vec<T> {
        self.buf.iter().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_newest() {
        let mut r = Ring::default();
        r.push(1);
        assert!(r.to_vec().is_empty(), "max 0 keeps nothing");
        r.set_max(3);
        for i in 0..7 {
            r.push(i);
        }
        assert_eq!(r.to_vec(), [4, 5, 6]);
        r.set_max(2);
        assert_eq!(r.to_vec(), [5, 6]);
        r.set_max(4);
        r.push(7);
        assert_eq!(r.to_vec(), [5, 6, 7]);
        r.clear();
        assert!(r.to_vec().is_empty());
    }
}
