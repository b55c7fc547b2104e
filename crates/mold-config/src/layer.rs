//! The levels below the command line: the environment's (`MOLD_*`) and the config
//! file's, each value remembering the variable or the file and key that set it.

use crate::parse::{parse_caps, parse_gpu_list, parse_size};
use crate::{
    invalid, one_line, ConfigError, Layer, Val, ENV_CONFIG, ENV_GPU, ENV_GPUS, ENV_HEADROOM,
    ENV_MACHINE, ENV_MAX_VRAM, ENV_OBJECTIVE, ENV_WEIGHTS_DIRS, KEYS,
};
use mold_plan::{ByteSize, DeviceId};
use std::path::{Path, PathBuf};

impl Layer {
    /// The environment's level, reading variables through `get` (tests pass a map).
    pub(crate) fn from_env(get: impl Fn(&str) -> Option<String>) -> Result<Layer, ConfigError> {
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
pub(crate) fn config_path(get: impl Fn(&str) -> Option<String>) -> Option<(PathBuf, bool)> {
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

/// mold's cache directory (kept cuDNN plans), from the environment: `$MOLD_CACHE_DIR`, else
/// `$XDG_CACHE_HOME/mold`, else `%LOCALAPPDATA%/mold` on Windows, else `~/.cache/mold`; none
/// where no variable says (a process without a home keeps nothing).
pub fn cache_dir(get: impl Fn(&str) -> Option<String>) -> Option<PathBuf> {
    let var = |k: &str| get(k).filter(|v| !v.is_empty());
    if let Some(p) = var("MOLD_CACHE_DIR") {
        return Some(PathBuf::from(p));
    }
    if let Some(x) = var("XDG_CACHE_HOME") {
        return Some(Path::new(&x).join("mold"));
    }
    if cfg!(windows) {
        if let Some(a) = var("LOCALAPPDATA") {
            return Some(Path::new(&a).join("mold"));
        }
    }
    var("HOME").map(|h| Path::new(&h).join(".cache").join("mold"))
}

/// Reads the config file, if there is one.
pub(crate) fn load_file(
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
