//! mold's configuration: `config.toml`, `MOLD_*` environment variables and command-line
//! flags, merged with the precedence **command line > environment > config file >
//! defaults**. Every resolved value remembers where it came from ([`Setting::source`]), so
//! errors can name the flag, the variable or the file and key that set it.
//!
//! The config file is `$MOLD_CONFIG` if set (it must then exist), else
//! `$XDG_CONFIG_HOME/mold/config.toml`, else `~/.config/mold/config.toml`
//! (`%APPDATA%\mold\config.toml` on Windows); a missing default file is no error.
//!
//! ```toml
//! gpus = [1, 2]                 # devices cuda:1, cuda:2 (MOLD_GPUS=1,2, MOLD_GPU=1, --gpus, --gpu)
//! # gpu = 1                     # or one GPU, cuda:1 (not together with `gpus`)
//! headroom = "2GiB"             # kept free on every device (MOLD_HEADROOM, --headroom)
//! machine = "sim/machines/2x-l40s.yaml"   # or "local" (MOLD_MACHINE, --machine)
//! objective = "latency"         # or "memory" (MOLD_OBJECTIVE, --objective)
//! weights_dirs = ["/data/weights"]        # (MOLD_WEIGHTS_DIRS, path-list)
//!
//! [max_vram]                    # (MOLD_MAX_VRAM=cuda:0=20GiB,cuda:1=30GiB, --max-vram)
//! "cuda:0" = "20GiB"
//! ```
//!
//! Relative paths in the file (`machine`, `weights_dirs`) are relative to the file's
//! directory. Unknown keys are an error naming the key.
//!
//! Here: the levels, their merge ([`resolve`]) and how the result shows; `layer.rs`: the
//! environment's and the config file's levels; `parse.rs`: values as flags and variables
//! write them.

mod layer;
mod parse;

pub use layer::cache_dir;
pub use parse::{parse_cap, parse_gpu_list};

use layer::load_file;
use mold_plan::{ByteSize, DeviceId};
use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

const ENV_CONFIG: &str = "MOLD_CONFIG";
const ENV_GPUS: &str = "MOLD_GPUS";
const ENV_GPU: &str = "MOLD_GPU";
const ENV_MAX_VRAM: &str = "MOLD_MAX_VRAM";
const ENV_HEADROOM: &str = "MOLD_HEADROOM";
const ENV_MACHINE: &str = "MOLD_MACHINE";
const ENV_OBJECTIVE: &str = "MOLD_OBJECTIVE";
const ENV_WEIGHTS_DIRS: &str = "MOLD_WEIGHTS_DIRS";

/// The keys a config file may hold.
const KEYS: [&str; 7] = [
    "gpus",
    "gpu",
    "max_vram",
    "headroom",
    "machine",
    "objective",
    "weights_dirs",
];

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{path}: cannot read the config file: {message}")]
    Read { path: String, message: String },
    #[error("{path}: not valid TOML: {message}")]
    Syntax { path: String, message: String },
    #[error("{path}: unknown key `{key}` (known keys: {known})")]
    UnknownKey {
        path: String,
        key: String,
        known: String,
    },
    /// A value that does not parse; `origin` names the flag, variable or file and key.
    #[error("{origin}: {message}")]
    Invalid { origin: String, message: String },
}

fn invalid(origin: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        origin: one_line(&origin.into()),
        message: one_line(&message.into()),
    }
}

/// `s` with line breaks escaped, so that every error is one line whatever the file held.
fn one_line(s: &str) -> String {
    s.replace('\r', "\\r").replace('\n', "\\n")
}

/// Which level a value comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Origin {
    Flag,
    Env,
    File(PathBuf),
    Default,
}

/// A resolved value, the level it came from and the exact key there (`--gpus`,
/// `MOLD_GPUS`, `gpus`).
#[derive(Clone, Debug, PartialEq)]
pub struct Setting<T> {
    pub value: T,
    pub origin: Origin,
    pub key: String,
}

impl<T> Setting<T> {
    /// Where the value was set, for messages: `--gpus`, `MOLD_GPUS`,
    /// `config /home/me/.config/mold/config.toml: gpus`, `default`.
    pub fn source(&self) -> String {
        match &self.origin {
            Origin::Flag | Origin::Env => self.key.clone(),
            Origin::File(p) => format!("config {}: {}", p.display(), self.key),
            Origin::Default => "default".into(),
        }
    }
}

/// The planner's objective, as the configuration names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Objective {
    Latency,
    Memory,
}

impl Objective {
    pub fn name(self) -> &'static str {
        match self {
            Objective::Latency => "latency",
            Objective::Memory => "memory",
        }
    }
}

impl FromStr for Objective {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "latency" => Ok(Objective::Latency),
            "memory" => Ok(Objective::Memory),
            _ => Err(format!("unknown objective `{s}`: use latency or memory")),
        }
    }
}

/// A value of one level with the key that set it there.
#[derive(Clone, Debug, PartialEq)]
pub struct Val<T> {
    pub value: T,
    pub key: String,
}

impl<T> Val<T> {
    pub fn new(value: T, key: impl Into<String>) -> Val<T> {
        Val {
            value,
            key: key.into(),
        }
    }
}

/// What one level (flags, environment, config file) sets; everything optional.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Layer {
    /// GPU ordinals: `[1, 2]` selects cuda:1, cuda:2.
    pub gpus: Option<Val<Vec<u32>>>,
    /// Budget caps per device; levels merge per device, the higher level winning.
    pub max_vram: BTreeMap<DeviceId, Val<ByteSize>>,
    pub headroom: Option<Val<ByteSize>>,
    /// A machine profile path, or `local`.
    pub machine: Option<Val<String>>,
    pub objective: Option<Val<Objective>>,
    pub weights_dirs: Option<Val<Vec<PathBuf>>>,
}

/// The configuration in effect.
#[derive(Clone, Debug, PartialEq)]
pub struct Settings {
    pub gpus: Option<Setting<Vec<u32>>>,
    pub max_vram: BTreeMap<DeviceId, Setting<ByteSize>>,
    pub headroom: Option<Setting<ByteSize>>,
    pub machine: Option<Setting<String>>,
    pub objective: Setting<Objective>,
    pub weights_dirs: Setting<Vec<PathBuf>>,
    /// The config file read, if any.
    pub file: Option<PathBuf>,
}

/// Merges the levels: flags > environment > config file > defaults.
pub fn resolve(flags: Layer, env: Layer, file: Option<(PathBuf, Layer)>) -> Settings {
    let (file_path, file) = match file {
        Some((p, l)) => (Some(p), l),
        None => (None, Layer::default()),
    };
    let fo = || Origin::File(file_path.clone().unwrap_or_default());
    fn pick<T>(levels: [(Option<Val<T>>, Origin); 3]) -> Option<Setting<T>> {
        levels.into_iter().find_map(|(v, origin)| {
            v.map(|v| Setting {
                value: v.value,
                origin,
                key: v.key,
            })
        })
    }
    let mut max_vram = BTreeMap::new();
    for (layer, origin) in [
        (file.max_vram, fo()),
        (env.max_vram, Origin::Env),
        (flags.max_vram, Origin::Flag),
    ] {
        for (d, v) in layer {
            max_vram.insert(
                d,
                Setting {
                    value: v.value,
                    origin: origin.clone(),
                    key: v.key,
                },
            );
        }
    }
    Settings {
        gpus: pick([
            (flags.gpus, Origin::Flag),
            (env.gpus, Origin::Env),
            (file.gpus, fo()),
        ]),
        max_vram,
        headroom: pick([
            (flags.headroom, Origin::Flag),
            (env.headroom, Origin::Env),
            (file.headroom, fo()),
        ]),
        machine: pick([
            (flags.machine, Origin::Flag),
            (env.machine, Origin::Env),
            (file.machine, fo()),
        ]),
        objective: pick([
            (flags.objective, Origin::Flag),
            (env.objective, Origin::Env),
            (file.objective, fo()),
        ])
        .unwrap_or(Setting {
            value: Objective::Latency,
            origin: Origin::Default,
            key: "objective".into(),
        }),
        weights_dirs: pick([
            (flags.weights_dirs, Origin::Flag),
            (env.weights_dirs, Origin::Env),
            (file.weights_dirs, fo()),
        ])
        .unwrap_or(Setting {
            value: Vec::new(),
            origin: Origin::Default,
            key: "weights_dirs".into(),
        }),
        file: file_path,
    }
}

/// Reads the environment and the config file of this process and merges them under
/// `flags`.
pub fn load(flags: Layer) -> Result<Settings, ConfigError> {
    let get = |k: &str| std::env::var(k).ok();
    let env = Layer::from_env(get)?;
    let file = load_file(get)?;
    Ok(resolve(flags, env, file))
}

impl fmt::Display for Settings {
    /// The configuration in effect, one line per setting with its source.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.file {
            Some(p) => writeln!(f, "config file   {}", p.display())?,
            None => writeln!(f, "config file   (none)")?,
        }
        let unset = "(not set)".to_string();
        let line = |name: &str, v: Option<(String, String)>| match v {
            Some((v, s)) => format!("{name:<13} {v}  [{s}]"),
            None => format!("{name:<13} {unset}"),
        };
        writeln!(
            f,
            "{}",
            line(
                "gpus",
                self.gpus.as_ref().map(|s| (
                    s.value
                        .iter()
                        .map(|n| n.to_string())
                        .collect::<Vec<_>>()
                        .join(","),
                    s.source()
                ))
            )
        )?;
        if self.max_vram.is_empty() {
            writeln!(f, "{}", line("max_vram", None))?;
        }
        for (d, s) in &self.max_vram {
            writeln!(
                f,
                "{}",
                line("max_vram", Some((format!("{d}={}", s.value), s.source())))
            )?;
        }
        writeln!(
            f,
            "{}",
            line(
                "headroom",
                self.headroom
                    .as_ref()
                    .map(|s| (s.value.to_string(), s.source()))
            )
        )?;
        writeln!(
            f,
            "{}",
            line(
                "machine",
                self.machine.as_ref().map(|s| (s.value.clone(), s.source()))
            )
        )?;
        writeln!(
            f,
            "{}",
            line(
                "objective",
                Some((
                    self.objective.value.name().to_string(),
                    self.objective.source()
                ))
            )
        )?;
        writeln!(
            f,
            "{}",
            line(
                "weights_dirs",
                (!self.weights_dirs.value.is_empty()).then(|| (
                    self.weights_dirs
                        .value
                        .iter()
                        .map(|p| p.display().to_string())
                        .collect::<Vec<_>>()
                        .join(", "),
                    self.weights_dirs.source()
                ))
            )
        )
    }
}

#[cfg(test)]
mod tests;
