//! Reading the options from the environment: [`Config::from_env`] and [`Config::from_lookup`],
//! every row of [`OPTIONS`] then `GPUPOOL_CONF`, and the check of the deprecated
//! `GPUPOOL_MAX_SPLIT_SIZE_MB` against `GPUPOOL_CONF`'s `max_split_size_mb`.

use std::ffi::OsString;

use super::options::{OPTIONS, Value};
use super::unknown::warn_unknown_variables_once;
use super::{CONF_VAR, Config, MIB};
use crate::error::Error;

/// The deprecated spelling of `GPUPOOL_CONF=max_split_size_mb:N`.
const MAX_SPLIT_ALIAS: &str = "GPUPOOL_MAX_SPLIT_SIZE_MB";

impl Config {
    /// Reads every option from the environment (`std::env::var_os`). The first call in the
    /// process also warns on stderr of every `GPUPOOL_*` variable that is not known (module
    /// `unknown`); the warning changes nothing, and comes before any error.
    ///
    /// Errors: [`Error::InvalidValue`] naming the first variable, in [`OPTIONS`] order, whose
    /// value is not valid UTF-8 or does not parse.
    pub fn from_env() -> Result<Config, Error> {
        warn_unknown_variables_once();
        Config::from_lookup(|name| std::env::var_os(name))
    }

    /// Reads every option through `get` (the environment, or a test's table), as
    /// [`Config::from_env`] does: the rows of [`OPTIONS`], then `GPUPOOL_CONF`.
    ///
    /// Errors: [`Error::InvalidValue`] naming the first variable whose value is not valid
    /// UTF-8 or does not parse (for `GPUPOOL_CONF`, the key and its value);
    /// `GPUPOOL_MAX_SPLIT_SIZE_MB` and `GPUPOOL_CONF`'s `max_split_size_mb` set to different
    /// sizes, or the former under `large_segment_size_mb`.
    pub fn from_lookup<V: Into<OsString>>(get: impl Fn(&str) -> Option<V>) -> Result<Config, Error> {
        let mut c = Config::default();
        let mut alias = None;
        for opt in &OPTIONS {
            let raw = get(opt.name).map(Into::into);
            if let Some(v) = opt.read(raw.as_deref())? {
                opt.set(&mut c, v);
                if opt.name == MAX_SPLIT_ALIAS {
                    alias = Some(c.max_split_size);
                }
            }
        }
        let origin = format!("environment variable {CONF_VAR}");
        let seen = match get(CONF_VAR).map(Into::into) {
            None => None,
            Some(raw) => match raw.to_str() {
                Some(text) => {
                    c.max_split_size = usize::MAX;
                    Some(c.apply_conf(&origin, text)?)
                }
                None => {
                    return Err(Error::InvalidValue(format!(
                        "{origin}={raw:?} is not valid UTF-8: expected PyTorch's configuration string, \
                         key:value,key:value"
                    )));
                }
            },
        };
        if let Some(bytes) = alias {
            let show = |n| OPTIONS.iter().find(|o| o.name == MAX_SPLIT_ALIAS).expect("a row").kind.show(Value::Size(n));
            if seen.is_some_and(|s| s.max_split_size) {
                if c.max_split_size != bytes {
                    return Err(Error::InvalidValue(format!(
                        "environment variables {MAX_SPLIT_ALIAS}={} and {CONF_VAR} with max_split_size_mb:{} \
                         disagree; set max_split_size_mb in {CONF_VAR} only ({MAX_SPLIT_ALIAS} is deprecated)",
                        show(bytes),
                        show(c.max_split_size),
                    )));
                }
            } else if bytes < c.large_segment_size {
                return Err(Error::InvalidValue(format!(
                    "environment variable {MAX_SPLIT_ALIAS}={} is under {CONF_VAR}'s large_segment_size_mb:{}: \
                     expected at least that (PyTorch's max_split_size_mb floor)",
                    show(bytes),
                    c.large_segment_size / MIB,
                )));
            } else {
                c.max_split_size = bytes;
            }
        }
        Ok(c)
    }
}
