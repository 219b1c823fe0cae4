//! Options, each read once from a `GPUPOOL_<NAME>` environment variable when the process-wide
//! allocator starts (the first call of the C API). A value that does not parse is an error
//! naming the variable, never silently replaced by a default.
//!
//! | variable | default | meaning |
//! |---|---|---|
//! | `GPUPOOL_DRIVER` | `cuda` | `cuda`: the CUDA driver; `sim`: the simulated device (no GPU needed) |
//! | `GPUPOOL_SIM_CAPACITY` | `16GiB` | bytes per simulated device; suffixes K, M, G, T (or KiB, MiB, GiB, TiB), powers of 1024 |
//! | `GPUPOOL_SIM_DEVICES` | `1` | number of simulated devices |
//! | `GPUPOOL_MAX_SPLIT_SIZE_MB` | unlimited | PyTorch's `max_split_size_mb`: blocks of at least this many MiB are never split; over 20 |

use crate::error::Error;

/// Which driver the process-wide allocator uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DriverKind {
    Cuda,
    Sim,
}

/// The options of an allocator.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    pub driver: DriverKind,
    /// Simulated devices (with [`DriverKind::Sim`]).
    pub sim_devices: i32,
    /// Bytes per simulated device.
    pub sim_capacity: usize,
    /// PyTorch's `max_split_size`, in bytes; `usize::MAX` (PyTorch's default) for none.
    pub max_split_size: usize,
}

impl Default for Config {
    fn default() -> Self {
        Config { driver: DriverKind::Cuda, sim_devices: 1, sim_capacity: 16 << 30, max_split_size: usize::MAX }
    }
}

impl Config {
    /// Reads every option from the environment.
    ///
    /// Errors: [`Error::InvalidValue`] naming the variable whose value does not parse.
    pub fn from_env() -> Result<Config, Error> {
        Config::from_lookup(|name| std::env::var(name).ok())
    }

    /// Reads every option through `get` (the environment, or a test's table).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Config, Error> {
        let bad = |name: &str, value: &str, want: &str| {
            Error::InvalidValue(format!("environment variable {name}={value:?} is not valid: expected {want}"))
        };
        let mut c = Config::default();
        if let Some(v) = get("GPUPOOL_DRIVER") {
            c.driver = match v.trim().to_ascii_lowercase().as_str() {
                "cuda" | "" => DriverKind::Cuda,
                "sim" => DriverKind::Sim,
                _ => return Err(bad("GPUPOOL_DRIVER", &v, "cuda or sim")),
            };
        }
        if let Some(v) = get("GPUPOOL_SIM_CAPACITY") {
            c.sim_capacity = parse_size(&v)
                .filter(|&s| s > 0)
                .ok_or_else(|| bad("GPUPOOL_SIM_CAPACITY", &v, "a size in bytes such as 8GiB"))?;
        }
        if let Some(v) = get("GPUPOOL_SIM_DEVICES") {
            c.sim_devices = v
                .trim()
                .parse()
                .ok()
                .filter(|n| (1..=64).contains(n))
                .ok_or_else(|| bad("GPUPOOL_SIM_DEVICES", &v, "a count from 1 to 64"))?;
        }
        if let Some(v) = get("GPUPOOL_MAX_SPLIT_SIZE_MB") {
            // PyTorch: "max_split_size_mb too small, must be > 20".
            let mb: usize = v
                .trim()
                .parse()
                .ok()
                .filter(|&mb| mb > 20)
                .ok_or_else(|| bad("GPUPOOL_MAX_SPLIT_SIZE_MB", &v, "a whole number of MiB over 20"))?;
            c.max_split_size =
                mb.checked_mul(1 << 20).ok_or_else(|| bad("GPUPOOL_MAX_SPLIT_SIZE_MB", &v, "a smaller size"))?;
        }
        Ok(c)
    }
}

/// Parses "4096", "512K", "64MiB", "16 GiB" (case-insensitive; every unit a power of 1024).
pub fn parse_size(text: &str) -> Option<usize> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (digits, unit) = t.split_at(split);
    let n: usize = digits.parse().ok()?;
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => return None,
    };
    n.checked_mul(1usize << shift)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let owned: Vec<(String, String)> = pairs.iter().map(|(a, b)| (a.to_string(), b.to_string())).collect();
        move |k| owned.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())
    }

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("4096"), Some(4096));
        assert_eq!(parse_size("64MiB"), Some(64 << 20));
        assert_eq!(parse_size("16 GiB"), Some(16 << 30));
        assert_eq!(parse_size("2g"), Some(2 << 30));
        assert_eq!(parse_size("lots"), None);
        assert_eq!(parse_size("99999999999T"), None);
    }

    #[test]
    fn options_parse_and_bad_values_are_named() {
        let c = Config::from_lookup(table(&[("GPUPOOL_DRIVER", "sim"), ("GPUPOOL_SIM_DEVICES", "2")])).unwrap();
        assert_eq!((c.driver, c.sim_devices), (DriverKind::Sim, 2));
        let c = Config::from_lookup(table(&[("GPUPOOL_MAX_SPLIT_SIZE_MB", "64")])).unwrap();
        assert_eq!(c.max_split_size, 64 << 20);
        let e = Config::from_lookup(table(&[("GPUPOOL_DRIVER", "opencl")])).unwrap_err();
        assert!(e.message().contains("GPUPOOL_DRIVER"), "{e}");
        let e = Config::from_lookup(table(&[("GPUPOOL_MAX_SPLIT_SIZE_MB", "20")])).unwrap_err();
        assert!(e.message().contains("over 20"), "{e}");
    }
}
