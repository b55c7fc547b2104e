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

use mold_plan::{ByteSize, DeviceId};
use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
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

/// A list of GPUs as flags and variables write it: `1,2`, `cuda:1,cuda:2`, `1`.
pub fn parse_gpu_list(s: &str, origin: &str) -> Result<Vec<u32>, ConfigError> {
    let mut out = Vec::new();
    for item in s.split(',').map(str::trim).filter(|t| !t.is_empty()) {
        let n = match item.parse::<u32>() {
            Ok(n) => n,
            Err(_) => match item.parse::<DeviceId>() {
                Ok(d @ DeviceId::Cuda(_)) | Ok(d @ DeviceId::Emu(_)) => d.ordinal().unwrap(),
                _ => {
                    return Err(invalid(
                        origin,
                        format!(
                            "`{item}` is not a GPU: write ordinals such as 1,2 or cuda:1,cuda:2"
                        ),
                    ))
                }
            },
        };
        if out.contains(&n) {
            return Err(invalid(origin, format!("GPU {n} is named twice")));
        }
        out.push(n);
    }
    if out.is_empty() {
        return Err(invalid(origin, "names no GPU: write ordinals such as 1,2"));
    }
    Ok(out)
}

/// One budget cap: `cuda:0=20GiB`.
pub fn parse_cap(s: &str, origin: &str) -> Result<(DeviceId, ByteSize), ConfigError> {
    let (d, size) = s.split_once('=').ok_or_else(|| {
        invalid(
            origin,
            format!("`{s}`: write DEVICE=SIZE, e.g. cuda:0=20GiB"),
        )
    })?;
    let d: DeviceId = d.trim().parse().map_err(|e: String| invalid(origin, e))?;
    let size: ByteSize = size
        .trim()
        .parse()
        .map_err(|e: mold_plan::ByteSizeError| invalid(origin, format!("{d}: {e}")))?;
    Ok((d, size))
}

/// Budget caps, comma-separated: `cuda:0=20GiB,cuda:1=30GiB` (`MOLD_MAX_VRAM`).
fn parse_caps(s: &str, origin: &str) -> Result<BTreeMap<DeviceId, ByteSize>, ConfigError> {
    let mut out = BTreeMap::new();
    for item in s.split(',').map(str::trim).filter(|t| !t.is_empty()) {
        let (d, size) = parse_cap(item, origin)?;
        if out.insert(d.clone(), size).is_some() {
            return Err(invalid(origin, format!("{d} is capped twice")));
        }
    }
    Ok(out)
}

fn parse_size(s: &str, origin: &str) -> Result<ByteSize, ConfigError> {
    s.trim()
        .parse()
        .map_err(|e: mold_plan::ByteSizeError| invalid(origin, e.to_string()))
}

impl Layer {
    /// The environment's level, reading variables through `get` (tests pass a map).
    fn from_env(get: impl Fn(&str) -> Option<String>) -> Result<Layer, ConfigError> {
        let var = |k: &str| get(k).filter(|v| !v.trim().is_empty());
        let mut l = Layer::default();
        match (var(ENV_GPUS), var(ENV_GPU)) {
            (Some(_), Some(_)) => {
                return Err(invalid(
                    format!("{ENV_GPUS} and {ENV_GPU}"),
                    "both are set: set one",
                ))
            }
            (Some(v), None) => {
                let key = format!("{ENV_GPUS}={v}");
                l.gpus = Some(Val::new(parse_gpu_list(&v, &key)?, key));
            }
            (None, Some(v)) => {
                let key = format!("{ENV_GPU}={v}");
                let g = parse_gpu_list(&v, &key)?;
                if g.len() != 1 {
                    return Err(invalid(
                        key,
                        format!("names one GPU (use {ENV_GPUS} for several)"),
                    ));
                }
                l.gpus = Some(Val::new(g, key));
            }
            (None, None) => {}
        }
        if let Some(v) = var(ENV_MAX_VRAM) {
            for (d, size) in parse_caps(&v, ENV_MAX_VRAM)? {
                l.max_vram.insert(d, Val::new(size, ENV_MAX_VRAM));
            }
        }
        if let Some(v) = var(ENV_HEADROOM) {
            l.headroom = Some(Val::new(parse_size(&v, ENV_HEADROOM)?, ENV_HEADROOM));
        }
        if let Some(v) = var(ENV_MACHINE) {
            l.machine = Some(Val::new(v, ENV_MACHINE));
        }
        if let Some(v) = var(ENV_OBJECTIVE) {
            let o = v.parse().map_err(|e: String| invalid(ENV_OBJECTIVE, e))?;
            l.objective = Some(Val::new(o, ENV_OBJECTIVE));
        }
        if let Some(v) = var(ENV_WEIGHTS_DIRS) {
            let dirs = std::env::split_paths(&v).collect();
            l.weights_dirs = Some(Val::new(dirs, ENV_WEIGHTS_DIRS));
        }
        Ok(l)
    }

    /// A config file's level. `path` names the file in errors; relative paths in it are
    /// taken relative to its directory.
    pub fn from_toml(text: &str, path: &Path) -> Result<Layer, ConfigError> {
        let p = path.display().to_string();
        let table: toml::Table = toml::from_str(text).map_err(|e| {
            // toml's message can run over several lines: one line, with the line number.
            let what: Vec<&str> = e
                .message()
                .lines()
                .map(str::trim)
                .filter(|l| !l.is_empty())
                .collect();
            let line = e
                .span()
                .map(|r| {
                    let before = &text.as_bytes()[..r.start.min(text.len())];
                    format!(
                        "line {}: ",
                        before.iter().filter(|&&b| b == b'\n').count() + 1
                    )
                })
                .unwrap_or_default();
            ConfigError::Syntax {
                path: p.clone(),
                message: one_line(&format!("{line}{}", what.join(": "))),
            }
        })?;
        let dir = path.parent().unwrap_or(Path::new(""));
        let rel = |s: &str| -> PathBuf {
            let q = Path::new(s);
            if q.is_absolute() || dir.as_os_str().is_empty() {
                q.to_path_buf()
            } else {
                dir.join(q)
            }
        };
        let origin = |key: &str| format!("{p}: {key}");
        let mut l = Layer::default();
        for (key, value) in &table {
            match key.as_str() {
                "gpus" => {
                    let items: Vec<&toml::Value> = match value {
                        toml::Value::Array(a) => a.iter().collect(),
                        v => vec![v],
                    };
                    let mut g = Vec::new();
                    for v in items {
                        let n = gpu_value(v, &origin(key), "gpus = [1, 2]")?;
                        if g.contains(&n) {
                            return Err(invalid(origin(key), format!("GPU {n} is named twice")));
                        }
                        g.push(n);
                    }
                    if g.is_empty() {
                        return Err(invalid(
                            origin(key),
                            "names no GPU: write e.g. gpus = [1, 2]",
                        ));
                    }
                    l.gpus = Some(Val::new(g, key));
                }
                "gpu" => {
                    if table.contains_key("gpus") {
                        return Err(invalid(
                            origin("gpu and gpus"),
                            "both are set: keep one (gpu = 1 for one GPU, gpus = [1, 2] for several)",
                        ));
                    }
                    if let toml::Value::Array(_) = value {
                        return Err(invalid(
                            origin(key),
                            "names one GPU: write gpu = 1, or gpus = [1, 2] for several",
                        ));
                    }
                    let n = gpu_value(value, &origin(key), "gpu = 1")?;
                    l.gpus = Some(Val::new(vec![n], key));
                }
                "max_vram" => {
                    let t = value.as_table().ok_or_else(|| {
                        invalid(
                            origin(key),
                            "write a table: [max_vram] then \"cuda:0\" = \"20GiB\"",
                        )
                    })?;
                    for (dev, size) in t {
                        let o = origin(&format!("max_vram.\"{dev}\""));
                        let d: DeviceId = dev.parse().map_err(|e: String| invalid(&o, e))?;
                        let size = size_value(size, &o)?;
                        let k = one_line(&format!("max_vram.\"{dev}\""));
                        l.max_vram.insert(d, Val::new(size, k));
                    }
                }
                "headroom" => {
                    l.headroom = Some(Val::new(size_value(value, &origin(key))?, key));
                }
                "machine" => {
                    let s = value
                        .as_str()
                        .ok_or_else(|| invalid(origin(key), "write a profile path or \"local\""))?;
                    let m = if s == "local" {
                        s.to_string()
                    } else {
                        rel(s).display().to_string()
                    };
                    l.machine = Some(Val::new(m, key));
                }
                "objective" => {
                    let s = value
                        .as_str()
                        .ok_or_else(|| invalid(origin(key), "write \"latency\" or \"memory\""))?;
                    let o = s.parse().map_err(|e: String| invalid(origin(key), e))?;
                    l.objective = Some(Val::new(o, key));
                }
                "weights_dirs" => {
                    let a = value.as_array().ok_or_else(|| {
                        invalid(
                            origin(key),
                            "write a list of directories: [\"/data/weights\"]",
                        )
                    })?;
                    let mut dirs = Vec::new();
                    for v in a {
                        let s = v.as_str().ok_or_else(|| {
                            invalid(origin(key), format!("{} is not a directory path", show(v)))
                        })?;
                        dirs.push(rel(s));
                    }
                    l.weights_dirs = Some(Val::new(dirs, key));
                }
                _ => {
                    return Err(ConfigError::UnknownKey {
                        path: p,
                        key: one_line(key),
                        known: KEYS.join(", "),
                    })
                }
            }
        }
        Ok(l)
    }
}

/// One GPU ordinal of the config file: an integer, or a string naming one GPU (`"1"`,
/// `"cuda:1"`); `example` shows the key's form in messages.
fn gpu_value(v: &toml::Value, origin: &str, example: &str) -> Result<u32, ConfigError> {
    match v {
        toml::Value::Integer(n) => u32::try_from(*n).map_err(|_| {
            invalid(
                origin,
                format!("{n} is not a GPU ordinal: write e.g. {example}"),
            )
        }),
        toml::Value::String(s) => {
            let one = parse_gpu_list(s, origin)?;
            if one.len() != 1 {
                return Err(invalid(
                    origin,
                    format!("\"{s}\": write one GPU per item, e.g. {example}"),
                ));
            }
            Ok(one[0])
        }
        v => Err(invalid(
            origin,
            format!("{} is not a GPU ordinal: write e.g. {example}", show(v)),
        )),
    }
}

/// A TOML value as messages quote it.
fn show(v: &toml::Value) -> String {
    match v {
        toml::Value::String(s) => format!("\"{s}\""),
        toml::Value::Integer(n) => n.to_string(),
        toml::Value::Float(x) => x.to_string(),
        toml::Value::Boolean(b) => b.to_string(),
        other => format!("a {}", other.type_str()),
    }
}

fn size_value(v: &toml::Value, origin: &str) -> Result<ByteSize, ConfigError> {
    match v {
        toml::Value::String(s) => parse_size(s, origin),
        toml::Value::Integer(n) if *n > 0 => Ok(ByteSize(*n as u64)),
        v => Err(invalid(
            origin,
            format!("{} is not a size: write e.g. \"20GiB\"", show(v)),
        )),
    }
}

/// Where the config file is, from the environment; `true` when `$MOLD_CONFIG` names it
/// (then it must exist).
fn config_path(get: impl Fn(&str) -> Option<String>) -> Option<(PathBuf, bool)> {
    let var = |k: &str| get(k).filter(|v| !v.is_empty());
    if let Some(p) = var(ENV_CONFIG) {
        return Some((PathBuf::from(p), true));
    }
    if let Some(x) = var("XDG_CONFIG_HOME") {
        return Some((Path::new(&x).join("mold").join("config.toml"), false));
    }
    if cfg!(windows) {
        if let Some(a) = var("APPDATA") {
            return Some((Path::new(&a).join("mold").join("config.toml"), false));
        }
    }
    var("HOME").map(|h| {
        (
            Path::new(&h)
                .join(".config")
                .join("mold")
                .join("config.toml"),
            false,
        )
    })
}

/// Reads the config file, if there is one.
fn load_file(
    get: impl Fn(&str) -> Option<String>,
) -> Result<Option<(PathBuf, Layer)>, ConfigError> {
    let Some((path, explicit)) = config_path(get) else {
        return Ok(None);
    };
    match std::fs::read_to_string(&path) {
        Ok(text) => Ok(Some((path.clone(), Layer::from_toml(&text, &path)?))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && !explicit => Ok(None),
        Err(e) => Err(ConfigError::Read {
            path: path.display().to_string(),
            message: if explicit {
                format!("{e} (named by {ENV_CONFIG})")
            } else {
                e.to_string()
            },
        }),
    }
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
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k: &str| m.get(k).cloned()
    }

    const FILE: &str = r#"
gpus = [1, 2]
headroom = "3GiB"
machine = "machines/box.yaml"
objective = "memory"
weights_dirs = ["w", "/abs/w"]

[max_vram]
"cuda:0" = "20GiB"
"cuda:1" = 1073741824
"#;

    fn file() -> Layer {
        Layer::from_toml(FILE, Path::new("/etc/mold/config.toml")).unwrap()
    }

    #[test]
    fn parses_every_key() {
        let l = file();
        assert_eq!(l.gpus.unwrap().value, vec![1, 2]);
        assert_eq!(l.headroom.unwrap().value, ByteSize(3 << 30));
        assert_eq!(l.machine.unwrap().value, "/etc/mold/machines/box.yaml");
        assert_eq!(l.objective.unwrap().value, Objective::Memory);
        assert_eq!(
            l.weights_dirs.unwrap().value,
            vec![PathBuf::from("/etc/mold/w"), PathBuf::from("/abs/w")]
        );
        assert_eq!(l.max_vram[&DeviceId::Cuda(0)].value, ByteSize(20 << 30));
        assert_eq!(l.max_vram[&DeviceId::Cuda(1)].value, ByteSize(1 << 30));
        let local = Layer::from_toml("machine = \"local\"", Path::new("/x/c.toml")).unwrap();
        assert_eq!(local.machine.unwrap().value, "local");
    }

    #[test]
    fn unknown_key_is_named() {
        let e = Layer::from_toml("gpus = [0]\ngpu_list = [1]\n", Path::new("c.toml")).unwrap_err();
        assert!(matches!(&e, ConfigError::UnknownKey { key, .. } if key == "gpu_list"));
        let s = e.to_string();
        assert!(
            s.contains("c.toml") && s.contains("`gpu_list`") && s.contains("max_vram"),
            "{s}"
        );
    }

    /// The seed's spelling: `gpu = 1` selects one GPU, beside `gpus`; both together are
    /// refused naming both keys.
    #[test]
    fn gpu_names_one_gpu() {
        let c = Path::new("c.toml");
        let l = Layer::from_toml("gpu = 1\n", c).unwrap();
        let g = l.gpus.unwrap();
        assert_eq!((g.value, g.key.as_str()), (vec![1], "gpu"));
        let l = Layer::from_toml("gpu = \"cuda:3\"\n", c).unwrap();
        assert_eq!(l.gpus.unwrap().value, vec![3]);
        for (text, want) in [
            (
                "gpu = 1\ngpus = [2]\n",
                "c.toml: gpu and gpus: both are set",
            ),
            (
                "gpus = [2]\ngpu = 1\n",
                "c.toml: gpu and gpus: both are set",
            ),
            ("gpu = [1, 2]", "c.toml: gpu: names one GPU"),
            (
                "gpu = -1",
                "c.toml: gpu: -1 is not a GPU ordinal: write e.g. gpu = 1",
            ),
            (
                "gpu = \"1,2\"",
                "c.toml: gpu: \"1,2\": write one GPU per item",
            ),
            ("gpu = 1.5", "c.toml: gpu: 1.5 is not a GPU ordinal"),
            ("gpu = \"one\"", "c.toml: gpu: `one` is not a GPU"),
        ] {
            let e = Layer::from_toml(text, c).unwrap_err().to_string();
            assert!(e.starts_with(want), "{text}: {e}");
        }
        // In effect, it is shown with its key.
        let s = resolve(
            Layer::default(),
            Layer::default(),
            Some((
                PathBuf::from("/c.toml"),
                Layer::from_toml("gpu = 2", c).unwrap(),
            )),
        );
        assert_eq!(s.gpus.as_ref().unwrap().source(), "config /c.toml: gpu");
        // The environment's MOLD_GPU still wins over the file's `gpu`.
        let env = Layer::from_env(env(&[(ENV_GPU, "0")])).unwrap();
        let s = resolve(
            Layer::default(),
            env,
            Some((
                PathBuf::from("/c.toml"),
                Layer::from_toml("gpu = 2", c).unwrap(),
            )),
        );
        assert_eq!(s.gpus.unwrap().value, vec![0]);
    }

    /// Every refusal is one line, whatever the file holds (keys and values with line
    /// breaks, syntax errors toml reports over several lines).
    #[test]
    fn refusals_are_one_line() {
        for text in [
            "\"a\\nb\" = 1",
            "gpus = [\"x\\ny\"]",
            "headroom = \"1\\nparsec\"",
            "[max_vram]\n\"cu\\nda:0\" = \"1GiB\"",
            "gpus = [1",
            "gpus = [1,,2]",
            "= 3",
            "machine = 3\nmachine = 4",
        ] {
            let e = Layer::from_toml(text, Path::new("c.toml"))
                .unwrap_err()
                .to_string();
            assert!(
                !e.contains('\n') && e.starts_with("c.toml: "),
                "{text}: {e}"
            );
        }
        let e = Layer::from_toml("x = 1\ngpus = [1", Path::new("c.toml"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("line 2"), "{e}");
    }

    #[test]
    fn bad_values_name_file_and_key() {
        for (text, want) in [
            (
                "headroom = \"lots\"",
                "c.toml: headroom: `lots` is not a size",
            ),
            (
                "objective = \"speed\"",
                "c.toml: objective: unknown objective",
            ),
            ("gpus = [1, 1]", "c.toml: gpus: GPU 1 is named twice"),
            ("gpus = [-1]", "c.toml: gpus: -1 is not a GPU"),
            (
                "[max_vram]\n\"gpu0\" = \"1GiB\"",
                "c.toml: max_vram.\"gpu0\"",
            ),
            ("max_vram = 3", "c.toml: max_vram: write a table"),
        ] {
            let e = Layer::from_toml(text, Path::new("c.toml"))
                .unwrap_err()
                .to_string();
            assert!(e.contains(want), "{text}: {e}");
        }
        let e = Layer::from_toml("gpus = [1", Path::new("c.toml")).unwrap_err();
        assert!(matches!(e, ConfigError::Syntax { .. }), "{e}");
    }

    #[test]
    fn env_level() {
        let l = Layer::from_env(env(&[
            (ENV_GPUS, "cuda:3,1"),
            (ENV_MAX_VRAM, "cuda:0=20GiB, cuda:1=30GiB"),
            (ENV_HEADROOM, "512MiB"),
            (ENV_OBJECTIVE, "memory"),
            (ENV_MACHINE, "local"),
        ]))
        .unwrap();
        assert_eq!(l.gpus.as_ref().unwrap().value, vec![3, 1]);
        assert_eq!(l.gpus.unwrap().key, "MOLD_GPUS=cuda:3,1");
        assert_eq!(l.max_vram[&DeviceId::Cuda(1)].value, ByteSize(30 << 30));
        assert_eq!(l.headroom.unwrap().value, ByteSize(512 << 20));
        assert_eq!(l.objective.unwrap().value, Objective::Memory);
        assert_eq!(l.machine.unwrap().value, "local");

        let one = Layer::from_env(env(&[(ENV_GPU, "2")])).unwrap();
        assert_eq!(one.gpus.unwrap().value, vec![2]);
        assert!(Layer::from_env(env(&[(ENV_GPU, "2,3")])).is_err());
        let both = Layer::from_env(env(&[(ENV_GPU, "2"), (ENV_GPUS, "1")])).unwrap_err();
        assert!(
            both.to_string().contains("MOLD_GPUS and MOLD_GPU"),
            "{both}"
        );
        let e = Layer::from_env(env(&[(ENV_MAX_VRAM, "cuda:0:20GiB")])).unwrap_err();
        assert!(e.to_string().starts_with("MOLD_MAX_VRAM: "), "{e}");
        // Empty variables count as unset.
        assert_eq!(
            Layer::from_env(env(&[(ENV_GPUS, "")])).unwrap(),
            Layer::default()
        );
    }

    #[test]
    fn precedence_flag_env_file_default() {
        let flags = Layer {
            gpus: Some(Val::new(vec![0], "--gpus")),
            max_vram: [(DeviceId::Cuda(1), Val::new(ByteSize(5 << 30), "--max-vram"))].into(),
            ..Layer::default()
        };
        let envl = Layer::from_env(env(&[
            (ENV_GPUS, "4"),
            (ENV_HEADROOM, "2GiB"),
            (ENV_MAX_VRAM, "cuda:1=6GiB,cuda:2=7GiB"),
        ]))
        .unwrap();
        let path = PathBuf::from("/etc/mold/config.toml");
        let s = resolve(flags.clone(), envl.clone(), Some((path.clone(), file())));
        // flag over env over file
        assert_eq!(s.gpus.as_ref().unwrap().value, vec![0]);
        assert_eq!(s.gpus.as_ref().unwrap().source(), "--gpus");
        // env over file
        assert_eq!(s.headroom.as_ref().unwrap().value, ByteSize(2 << 30));
        assert_eq!(s.headroom.as_ref().unwrap().source(), "MOLD_HEADROOM");
        // file over default
        assert_eq!(s.objective.value, Objective::Memory);
        assert_eq!(
            s.objective.source(),
            "config /etc/mold/config.toml: objective"
        );
        // max_vram merges per device
        let cap = |n| s.max_vram[&DeviceId::Cuda(n)].clone();
        assert_eq!(
            (cap(0).value, cap(0).origin),
            (ByteSize(20 << 30), Origin::File(path.clone()))
        );
        assert_eq!(
            (cap(1).value, cap(1).origin),
            (ByteSize(5 << 30), Origin::Flag)
        );
        assert_eq!(
            (cap(2).value, cap(2).origin),
            (ByteSize(7 << 30), Origin::Env)
        );
        // env over file for gpus once the flag is gone
        let s = resolve(Layer::default(), envl, Some((path.clone(), file())));
        assert_eq!(s.gpus.unwrap().value, vec![4]);
        // file when neither
        let s = resolve(Layer::default(), Layer::default(), Some((path, file())));
        assert_eq!(s.gpus.unwrap().value, vec![1, 2]);
        // defaults
        let s = resolve(Layer::default(), Layer::default(), None);
        assert_eq!(s.gpus, None);
        assert_eq!(s.objective.value, Objective::Latency);
        assert_eq!(s.objective.source(), "default");
        assert!(s.weights_dirs.value.is_empty());
        assert!(s.to_string().contains("config file   (none)"));
    }

    #[test]
    fn config_path_order() {
        let p = |pairs: &[(&str, &str)]| config_path(env(pairs));
        assert_eq!(
            p(&[
                (ENV_CONFIG, "/a/c.toml"),
                ("XDG_CONFIG_HOME", "/x"),
                ("HOME", "/h")
            ]),
            Some((PathBuf::from("/a/c.toml"), true))
        );
        if !cfg!(windows) {
            assert_eq!(
                p(&[("XDG_CONFIG_HOME", "/x"), ("HOME", "/h")]),
                Some((PathBuf::from("/x/mold/config.toml"), false))
            );
            assert_eq!(
                p(&[("HOME", "/h")]),
                Some((PathBuf::from("/h/.config/mold/config.toml"), false))
            );
        }
        assert_eq!(p(&[]), None);
    }

    #[test]
    fn missing_files() {
        let dir = std::env::temp_dir().join(format!("mold-config-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let d = dir.display().to_string();
        // A missing default file is no error; a missing $MOLD_CONFIG is.
        assert!(load_file(env(&[("XDG_CONFIG_HOME", &d)]))
            .unwrap()
            .is_none());
        let want = format!("{d}/nope.toml");
        let e = load_file(env(&[(ENV_CONFIG, &want)]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("nope.toml") && e.contains("MOLD_CONFIG"), "{e}");
        std::fs::create_dir_all(dir.join("mold")).unwrap();
        std::fs::write(dir.join("mold/config.toml"), "gpus = [3]\n").unwrap();
        let (path, l) = load_file(env(&[("XDG_CONFIG_HOME", &d)])).unwrap().unwrap();
        assert_eq!(path, dir.join("mold/config.toml"));
        assert_eq!(l.gpus.unwrap().value, vec![3]);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn gpu_lists_and_caps() {
        assert_eq!(parse_gpu_list("1, 2", "--gpus").unwrap(), vec![1, 2]);
        assert_eq!(parse_gpu_list("cuda:2", "--gpus").unwrap(), vec![2]);
        let e = parse_gpu_list("one", "--gpus").unwrap_err().to_string();
        assert!(e.starts_with("--gpus: `one` is not a GPU"), "{e}");
        assert!(parse_gpu_list("", "--gpus").is_err());
        let caps = parse_caps("cuda:0=20GiB,cuda:1=30GiB", "MOLD_MAX_VRAM").unwrap();
        assert_eq!(caps.len(), 2);
        assert!(parse_caps("cuda:0=1GiB,cuda:0=2GiB", "x").is_err());
    }
}
