//! The placement plan: mold's contract between `plan`, `sim` and `exec`.
//!
//! A plan is YAML with `version: 5`; unknown fields are refused. A `version: 1` plan (no
//! `tp`/`sp`: a part's devices were one tensor-parallel group), a `version: 2` plan (no
//! `replicas`: one copy of the placement), a `version: 3` plan (no `cfg` nor
//! `memory_phases`: true CFG serial, everything resident) and a `version: 4` plan (no
//! component `attention`: attention in the activations' dtype) are migrated on load. It records the model,
//! the workload, the machine it was made for, where each component's parts run, the
//! replicas serving requests side by side, and what the planner predicted. Semantic checks that need the model catalogue or the machine
//! (block coverage, device existence, tensor-parallel divisibility) live with the cost
//! model; this crate checks what can be checked from the plan alone.

mod bytes;
mod replicas;
mod types;

pub use bytes::{ByteSize, ByteSizeError, GIB, MIB};
pub use replicas::{shifted_replicas, ReplicaError};
pub use types::*;

use std::path::Path;

/// The plan schema version this build writes. Version 2 added a part's parallel layout
/// (`tp`, `sp`), version 3 `replicas`, version 4 `cfg` (how true CFG's two passes run)
/// and `memory_phases`, version 5 a component's `attention` (FP8 attention); older plans
/// are migrated on load ([`migrate_v1`], [`migrate_v2`], [`migrate_v3`], [`migrate_v4`]).
pub const PLAN_VERSION: u32 = 5;

/// The oldest plan version this build still reads (migrating it).
pub const OLDEST_READ_VERSION: u32 = 1;

#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    #[error("{source_name}: {message}")]
    Parse {
        source_name: String,
        message: String,
    },
    #[error("{source_name}: version: this plan is version {found}; this mold reads versions {OLDEST_READ_VERSION} to {PLAN_VERSION}: regenerate it with `mold plan`")]
    Version { source_name: String, found: u64 },
    #[error("{source_name}: {field}: {message}")]
    Invalid {
        source_name: String,
        field: String,
        message: String,
    },
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

impl Plan {
    /// Parses a plan from YAML text. `source_name` (a file name) prefixes every error.
    pub fn from_yaml(text: &str, source_name: &str) -> Result<Plan, PlanError> {
        // Check the version first, so an old or future plan gets the version message
        // rather than a confusing complaint about a field this version does not know.
        let value: serde_yaml_ng::Value =
            serde_yaml_ng::from_str(text).map_err(|e| PlanError::Parse {
                source_name: source_name.to_string(),
                message: one_line(&format!("not valid YAML: {e}")),
            })?;
        let map = value.as_mapping().ok_or_else(|| PlanError::Parse {
            source_name: source_name.to_string(),
            message: format!("a plan is a YAML mapping starting with `version: {PLAN_VERSION}`"),
        })?;
        let version = match map.get("version") {
            None => {
                return Err(PlanError::Invalid {
                    source_name: source_name.into(),
                    field: "version".into(),
                    message: format!("missing: add `version: {PLAN_VERSION}` at the top"),
                })
            }
            Some(v) => match v.as_u64() {
                Some(n) if (OLDEST_READ_VERSION as u64..=PLAN_VERSION as u64).contains(&n) => n,
                Some(n) => {
                    return Err(PlanError::Version {
                        source_name: source_name.into(),
                        found: n,
                    })
                }
                None => {
                    return Err(PlanError::Invalid {
                        source_name: source_name.into(),
                        field: "version".into(),
                        message: format!("must be the integer {PLAN_VERSION}"),
                    })
                }
            },
        };
        let mut value = value;
        let migrated = |r: Result<(), (String, String)>| {
            r.map_err(|(field, message)| PlanError::Invalid {
                source_name: source_name.into(),
                field,
                message,
            })
        };
        if version == 1 {
            migrated(migrate_v1(&mut value))?;
        }
        if version <= 2 {
            migrated(migrate_v2(&mut value))?;
        }
        if version <= 3 {
            migrated(migrate_v3(&mut value))?;
        }
        if version <= 4 {
            migrated(migrate_v4(&mut value))?;
        }
        let plan: Plan = from_value_with_path(value).map_err(|message| PlanError::Parse {
            source_name: source_name.to_string(),
            message,
        })?;
        plan.check_structure(source_name)?;
        Ok(plan)
    }

    pub fn load(path: &Path) -> Result<Plan, PlanError> {
        let text = std::fs::read_to_string(path).map_err(|source| PlanError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Plan::from_yaml(&text, &path.display().to_string())
    }

    pub fn to_yaml(&self) -> String {
        let body = serde_yaml_ng::to_string(self).expect("a plan always serializes");
        format!("# mold placement plan: review it, then `mold sim` or `mold exec` it\n{body}")
    }

    /// Checks that need nothing but the plan itself.
    fn check_structure(&self, source_name: &str) -> Result<(), PlanError> {
        let invalid = |field: String, message: String| PlanError::Invalid {
            source_name: source_name.into(),
            field,
            message,
        };
        if self.version != PLAN_VERSION {
            return Err(PlanError::Version {
                source_name: source_name.into(),
                found: self.version as u64,
            });
        }
        let w = &self.workload;
        for (field, v) in [
            ("width", w.width),
            ("height", w.height),
            ("frames", w.frames),
            ("batch", w.batch),
            ("steps", w.steps),
        ] {
            if v == 0 {
                return Err(invalid(
                    format!("workload.{field}"),
                    "0: must be at least 1".into(),
                ));
            }
        }
        // Figures are finite and not negative (NaN fails every comparison: test it first).
        let figures = [
            ("workload.guidance", w.guidance),
            ("workload.cfg_scale", w.cfg_scale),
            ("predicted.step_time_s", Some(self.predicted.step_time_s)),
            (
                "predicted.request_time_s",
                Some(self.predicted.request_time_s),
            ),
            (
                "predicted.encode_time_s",
                Some(self.predicted.encode_time_s),
            ),
            (
                "predicted.denoise_time_s",
                Some(self.predicted.denoise_time_s),
            ),
            (
                "predicted.decode_time_s",
                Some(self.predicted.decode_time_s),
            ),
            ("solver.objective_value", Some(self.solver.objective_value)),
            ("solver.solve_time_ms", Some(self.solver.solve_time_ms)),
        ];
        for (field, v) in figures {
            if let Some(x) = v.filter(|x| !(x.is_finite() && *x >= 0.0)) {
                return Err(invalid(
                    field.into(),
                    format!("{x} is not allowed: give a finite number ≥ 0"),
                ));
            }
        }
        if self.components.is_empty() {
            return Err(invalid(
                "components".into(),
                "a plan needs at least one component".into(),
            ));
        }
        let mut seen = std::collections::BTreeSet::new();
        for (ci, c) in self.components.iter().enumerate() {
            if !seen.insert(c.name.as_str()) {
                return Err(invalid(
                    format!("components[{ci}].name"),
                    format!(
                        "component `{}` appears twice: keep one entry",
                        c.name.escape_debug()
                    ),
                ));
            }
            match c.attention {
                None => {}
                Some(DType::Fp8) if c.role != ComponentRole::Transformer => {
                    return Err(invalid(
                        format!("components[{ci}].attention"),
                        format!(
                            "fp8 on {} component `{}`: FP8 attention is the transformer's; remove `attention`",
                            match c.role {
                                ComponentRole::Encoder => "encoder",
                                _ => "VAE",
                            },
                            c.name.escape_debug()
                        ),
                    ));
                }
                Some(DType::Fp8) if c.dtype != DType::Fp8 => {
                    return Err(invalid(
                        format!("components[{ci}].attention"),
                        format!(
                            "fp8 with `dtype: {}`: FP8 attention runs in blocks whose products are FP8: set `dtype: fp8`, or remove `attention`",
                            c.dtype
                        ),
                    ));
                }
                Some(DType::Fp8) => {}
                Some(d) => {
                    return Err(invalid(
                        format!("components[{ci}].attention"),
                        format!("{d}: only `fp8` is written here; remove `attention` for attention in the activations' dtype"),
                    ));
                }
            }
            if c.parts.is_empty() {
                return Err(invalid(
                    format!("components[{ci}].parts"),
                    format!(
                        "component `{}` has no parts: give it at least one",
                        c.name.escape_debug()
                    ),
                ));
            }
            for (pi, p) in c.parts.iter().enumerate() {
                let field = format!("components[{ci}].parts[{pi}]");
                if p.devices.is_empty() {
                    return Err(invalid(
                        format!("{field}.devices"),
                        "empty: name at least one device, e.g. [cuda:0]".into(),
                    ));
                }
                let mut ds = std::collections::BTreeSet::new();
                for d in &p.devices {
                    if !ds.insert(d) {
                        return Err(invalid(
                            format!("{field}.devices"),
                            format!("device {d} is listed twice"),
                        ));
                    }
                }
                for (name, v) in [("tp", p.tp), ("sp", p.sp)] {
                    if v == 0 {
                        return Err(invalid(
                            format!("{field}.{name}"),
                            "0: a parallel degree is at least 1 (1 means not split)".into(),
                        ));
                    }
                }
                if p.degree() != p.devices.len() as u64 {
                    return Err(invalid(
                        field.clone(),
                        format!(
                            "tp {} × sp {} = {} but {} device(s) listed: list tp × sp devices, or set tp/sp so that their product is the device count",
                            p.tp,
                            p.sp,
                            p.degree(),
                            p.devices.len()
                        ),
                    ));
                }
                // A VAE's `sp` is its row bands (one a device); an encoder never splits.
                if p.sp > 1 && c.role == ComponentRole::Encoder {
                    return Err(invalid(
                        format!("{field}.sp"),
                        format!(
                            "{}: sequence parallelism is for transformer parts (and a VAE's row bands) only: remove `sp` from component `{}`",
                            p.sp,
                            c.name.escape_debug()
                        ),
                    ));
                }
                if p.devices.len() > 1 && p.devices.iter().any(|d| d.is_host()) {
                    return Err(invalid(
                        format!("{field}.devices"),
                        "the host cannot be part of a parallel group".into(),
                    ));
                }
                match (p.residency, p.stream_buffers) {
                    (Residency::Streamed, Some(b)) if b < 2 => {
                        return Err(invalid(
                            format!("{field}.stream_buffers"),
                            format!("{b}: streaming needs at least 2 buffers (double buffering)"),
                        ))
                    }
                    (Residency::Resident, Some(_)) => {
                        return Err(invalid(
                            format!("{field}.stream_buffers"),
                            "only streamed parts have stream buffers: remove it or set `residency: streamed`".into(),
                        ))
                    }
                    _ => {}
                }
                if p.residency == Residency::Streamed && c.dtype == DType::Fp8 {
                    return Err(invalid(
                        format!("{field}.residency"),
                        "streamed, but FP8 weights are held resident: use `residency: resident`, or `dtype: bf16` to stream".into(),
                    ));
                }
                if p.residency == Residency::Streamed && p.devices.iter().any(|d| d.is_host()) {
                    return Err(invalid(
                        format!("{field}.residency"),
                        "a part that runs on the host is not streamed: use `residency: resident`"
                            .into(),
                    ));
                }
                for (bi, r) in p.blocks.iter().enumerate() {
                    if r.start >= r.end {
                        return Err(invalid(
                            format!("{field}.blocks[{bi}]"),
                            format!("`{r}` is empty: a range is start..end with start < end"),
                        ));
                    }
                }
            }
        }
        self.check_replicas()
            .map_err(|e| invalid(e.field, e.message))?;
        self.check_cfg().map_err(|(f, m)| invalid(f, m))
    }

    /// How true CFG runs, if the workload has it: the plan's `cfg`, serial without one.
    pub fn cfg_mode(&self) -> Option<CfgMode> {
        self.workload
            .cfg_scale
            .map(|_| self.cfg.map_or(CfgMode::Serial, |c| c.mode))
    }

    /// The transformer's pipeline stages: runs of consecutive parts on the same devices
    /// in the same layout, as indices into its parts (empty without a transformer).
    pub fn stages(&self) -> Vec<std::ops::Range<usize>> {
        let Some(t) = self.transformer() else {
            return vec![];
        };
        let same = |a: &Part, b: &Part| a.devices == b.devices && (a.tp, a.sp) == (b.tp, b.sp);
        let mut out: Vec<std::ops::Range<usize>> = Vec::new();
        for (i, p) in t.parts.iter().enumerate() {
            match out.last_mut() {
                Some(r) if same(&t.parts[r.end - 1], p) => r.end = i + 1,
                _ => out.push(i..i + 1),
            }
        }
        out
    }

    /// `cfg` against the workload, the replicas and the transformer's stages.
    fn check_cfg(&self) -> Result<(), (String, String)> {
        let Some(c) = &self.cfg else { return Ok(()) };
        if self.workload.cfg_scale.is_none() {
            return Err((
                "cfg".into(),
                "the workload has no cfg_scale (true CFG): remove `cfg`, or set workload.cfg_scale"
                    .into(),
            ));
        }
        match c.mode {
            CfgMode::Serial => Ok(()),
            CfgMode::Parallel if self.replica_count() != 2 => Err((
                "cfg.mode".into(),
                format!(
                    "parallel runs the conditional pass on replicas[0] and the unconditional one on replicas[1], and the plan has {} replica(s): list exactly 2 (`mold plan --cfg parallel`), or use `mode: serial`",
                    self.replica_count()
                ),
            )),
            CfgMode::Parallel => Ok(()),
            CfgMode::Pipelined => {
                let stages = self.stages();
                if stages.len() < 2 {
                    return Err((
                        "cfg.mode".into(),
                        format!(
                            "pipelined runs the two passes through the stages of a block split, and the transformer has {} stage(s) (runs of parts on one device group): split its blocks over 2 or more device groups, or use `mode: serial`",
                            stages.len()
                        ),
                    ));
                }
                let t = self.transformer().expect("stages imply a transformer");
                let mut owner: std::collections::BTreeMap<&DeviceId, usize> = Default::default();
                for (si, r) in stages.iter().enumerate() {
                    for d in &t.parts[r.start].devices {
                        if let Some(other) = owner.insert(d, si) {
                            if other != si {
                                return Err((
                                    "cfg.mode".into(),
                                    format!(
                                        "pipelined needs each stage on devices of its own, and {d} runs stages {} and {}: keep each device group's blocks in one range, or use `mode: serial`",
                                        other + 1,
                                        si + 1
                                    ),
                                ));
                            }
                        }
                    }
                }
                Ok(())
            }
        }
    }

    /// The transformer component, if the plan has one.
    pub fn transformer(&self) -> Option<&ComponentPlan> {
        self.components
            .iter()
            .find(|c| c.role == ComponentRole::Transformer)
    }
}

/// Rewrites a `version: 1` plan as version 2, in place: in version 1 a part's devices were
/// one tensor-parallel group, so every part gets `tp` = its device count and `sp` 1. A
/// version 1 part that already names `tp` or `sp` is refused (those fields are version 2).
/// Errors are (field, message).
pub fn migrate_v1(value: &mut serde_yaml_ng::Value) -> Result<(), (String, String)> {
    use serde_yaml_ng::Value;
    let Some(map) = value.as_mapping_mut() else {
        return Ok(());
    };
    map.insert(Value::from("version"), Value::from(2u32));
    let Some(components) = map.get_mut("components").and_then(Value::as_sequence_mut) else {
        return Ok(()); // deserialization names what is missing
    };
    for (ci, c) in components.iter_mut().enumerate() {
        let Some(parts) = c.get_mut("parts").and_then(Value::as_sequence_mut) else {
            continue;
        };
        for (pi, p) in parts.iter_mut().enumerate() {
            let Some(part) = p.as_mapping_mut() else {
                continue;
            };
            for key in ["tp", "sp"] {
                if part.contains_key(key) {
                    return Err((
                        format!("components[{ci}].parts[{pi}].{key}"),
                        format!("`{key}` is a version 2 field: set `version: {PLAN_VERSION}` or remove it"),
                    ));
                }
            }
            if let Some(n) = part
                .get("devices")
                .and_then(Value::as_sequence)
                .map(Vec::len)
            {
                part.insert(Value::from("tp"), Value::from(n.max(1) as u64));
            }
        }
    }
    Ok(())
}

/// Rewrites a `version: 2` plan as version 3, in place: a version 2 plan is one replica,
/// the placement as written, so only the version changes. A version 2 plan that already
/// names `replicas` is refused (that field is version 3). Errors are (field, message).
pub fn migrate_v2(value: &mut serde_yaml_ng::Value) -> Result<(), (String, String)> {
    use serde_yaml_ng::Value;
    let Some(map) = value.as_mapping_mut() else {
        return Ok(());
    };
    if map.contains_key("replicas") {
        return Err((
            "replicas".into(),
            format!("`replicas` is a version 3 field: set `version: {PLAN_VERSION}` or remove it"),
        ));
    }
    map.insert(Value::from("version"), Value::from(3u32));
    Ok(())
}

/// Rewrites a `version: 3` plan as version 4, in place: a version 3 plan ran true CFG's
/// two passes serially and kept every component loaded, so it gets `cfg: {mode: serial}`
/// where its workload has a `cfg_scale`, and `memory_phases: resident`. A version 3 plan
/// that already names `cfg` or `memory_phases` is refused (those fields are version 4).
/// Errors are (field, message).
pub fn migrate_v3(value: &mut serde_yaml_ng::Value) -> Result<(), (String, String)> {
    use serde_yaml_ng::{Mapping, Value};
    let Some(map) = value.as_mapping_mut() else {
        return Ok(());
    };
    for key in ["cfg", "memory_phases"] {
        if map.contains_key(key) {
            return Err((
                key.into(),
                format!("`{key}` is a version 4 field: set `version: {PLAN_VERSION}` or remove it"),
            ));
        }
    }
    map.insert(Value::from("version"), Value::from(4u32));
    let cfg = map
        .get("workload")
        .and_then(|w| w.get("cfg_scale"))
        .is_some_and(|c| !c.is_null());
    if cfg {
        let mut c = Mapping::new();
        c.insert(Value::from("mode"), Value::from("serial"));
        map.insert(Value::from("cfg"), Value::Mapping(c));
    }
    map.insert(Value::from("memory_phases"), Value::from("resident"));
    Ok(())
}

/// Migrates a `version: 4` plan to version 5 in place: a version 4 plan ran attention in
/// the activations' dtype, which a version 5 plan says by leaving a component's
/// `attention` out, so only the version changes. A component's `attention` in a plan
/// that says version 4 or older is refused: the field is version 5's.
pub fn migrate_v4(value: &mut serde_yaml_ng::Value) -> Result<(), (String, String)> {
    use serde_yaml_ng::Value;
    let Some(map) = value.as_mapping_mut() else {
        return Ok(());
    };
    if let Some(cs) = map.get("components").and_then(|c| c.as_sequence()) {
        for (i, c) in cs.iter().enumerate() {
            if c.get("attention").is_some() {
                return Err((
                    format!("components[{i}].attention"),
                    format!("`attention` is a version 5 field: set `version: {PLAN_VERSION}` or remove it"),
                ));
            }
        }
    }
    map.insert(Value::from("version"), Value::from(5u32));
    Ok(())
}

/// Deserializes a YAML value, prefixing any error with the path of the field at fault
/// (`components[1].parts[0].devices: …`). The message is one line, line breaks in what
/// the file held escaped.
fn from_value_with_path<T: serde::de::DeserializeOwned>(
    value: serde_yaml_ng::Value,
) -> Result<T, String> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        one_line(&if path == "." || path.is_empty() {
            e.into_inner().to_string()
        } else {
            format!("{path}: {}", e.into_inner())
        })
    })
}

/// Parses YAML text into `T`, naming the field at fault in any error (one line).
pub fn from_yaml_with_path<T: serde::de::DeserializeOwned>(text: &str) -> Result<T, String> {
    let value: serde_yaml_ng::Value =
        serde_yaml_ng::from_str(text).map_err(|e| one_line(&format!("not valid YAML: {e}")))?;
    from_value_with_path(value)
}

/// `s` with line breaks escaped, so that a refusal is one line whatever the file held.
fn one_line(s: &str) -> String {
    s.replace('\r', "\\r").replace('\n', "\\n")
}

#[cfg(test)]
mod tests;
