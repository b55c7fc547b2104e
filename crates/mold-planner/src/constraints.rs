//! User constraints: from flags (`--pin`, `--tp`, `--no-stream`, …) or a YAML file
//! (`--constraints`), with the same meaning. The file's refusals are one line naming the
//! file and the field (`my.yaml: pin.t5: empty: …`).

use crate::{Objective, PlanError};
use mold_machine::Machine;
use mold_models::ModelSpec;
use mold_plan::{ByteSize, DeviceId};
use serde::{Deserialize, Deserializer};
use std::collections::BTreeMap;
use std::str::FromStr;

/// A parallel degree choice: tensor parallel (`--tp`) or sequence parallel (`--sp`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum ParallelChoice {
    /// Any degree (with the other kind's, dividing the heads).
    #[default]
    Auto,
    /// Not this kind of parallelism (degree 1).
    Off,
    /// Every parallel group has exactly this degree of this kind (single devices still
    /// allowed).
    Degree(u32),
}

/// Tensor-parallel choice (`--tp`).
pub type TpChoice = ParallelChoice;
/// Sequence-parallel choice (`--sp`).
pub type SpChoice = ParallelChoice;

impl ParallelChoice {
    /// Whether a group's degree `d` of this kind is allowed.
    pub fn allows(self, d: u32) -> bool {
        match self {
            ParallelChoice::Auto => d >= 1,
            ParallelChoice::Off => d == 1,
            ParallelChoice::Degree(n) => d == n,
        }
    }
}

impl FromStr for ParallelChoice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(ParallelChoice::Auto),
            "off" | "1" => Ok(ParallelChoice::Off),
            n => match n.parse::<u32>() {
                Ok(d) if d >= 2 => Ok(ParallelChoice::Degree(d)),
                _ => Err(format!(
                    "`{s}` is not a parallel degree: use auto, off, or a degree such as 2"
                )),
            },
        }
    }
}

impl<'de> Deserialize<'de> for ParallelChoice {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let v = serde_yaml_ng::Value::deserialize(d)?;
        let s = match &v {
            serde_yaml_ng::Value::String(s) => s.clone(),
            serde_yaml_ng::Value::Number(n) => n.to_string(),
            serde_yaml_ng::Value::Bool(false) => "off".into(),
            _ => {
                return Err(serde::de::Error::custom(
                    "use auto, off, or a degree such as 2",
                ))
            }
        };
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// Planner constraints.
#[derive(Clone, Debug, PartialEq)]
pub struct Constraints {
    /// Component → the devices it may use (`host` allowed for encoders and VAE).
    pub pins: BTreeMap<String, Vec<DeviceId>>,
    pub tp: TpChoice,
    /// Sequence parallel (Ulysses). The library's default is `Auto`; `mold plan`
    /// resolves its own default (off when `--tp` is given or the machine has no peer
    /// links).
    pub sp: SpChoice,
    /// Allow host-streamed transformer blocks.
    pub stream: bool,
    /// Allow encoders and VAE to run on the host CPU.
    pub host_components: bool,
    /// Device buffers per streamed part (double buffering = 2).
    pub stream_buffers: u32,
    /// The VAE's decode in row bands over several GPUs (`--vae-bands`): auto (where the
    /// cost model says it shortens the request), off, or exactly this many bands.
    pub vae_bands: ParallelChoice,
}

impl Default for Constraints {
    fn default() -> Self {
        Constraints {
            pins: BTreeMap::new(),
            tp: TpChoice::Auto,
            sp: SpChoice::Auto,
            stream: true,
            host_components: true,
            stream_buffers: 2,
            vae_bands: ParallelChoice::Auto,
        }
    }
}

/// The constraints file (`--constraints my.yaml`). Every key is optional; flags given on
/// the command line win over the file.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConstraintsFile {
    #[serde(default)]
    pub devices: Option<Vec<DeviceId>>,
    #[serde(default)]
    pub max_vram: BTreeMap<DeviceId, ByteSize>,
    #[serde(default)]
    pub pin: BTreeMap<String, OneOrMany>,
    #[serde(default)]
    pub tp: Option<TpChoice>,
    #[serde(default)]
    pub sp: Option<SpChoice>,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub host_components: Option<bool>,
    #[serde(default)]
    pub stream_buffers: Option<u32>,
    #[serde(default)]
    pub vae_bands: Option<ParallelChoice>,
    #[serde(default)]
    pub objective: Option<ObjectiveName>,
}

/// A device, or a list of devices.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(untagged)]
pub enum OneOrMany {
    One(DeviceId),
    Many(Vec<DeviceId>),
}

impl OneOrMany {
    pub fn devices(&self) -> Vec<DeviceId> {
        match self {
            OneOrMany::One(d) => vec![d.clone()],
            OneOrMany::Many(v) => v.clone(),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ObjectiveName {
    Latency,
    Memory,
    Throughput,
}

impl From<ObjectiveName> for Objective {
    fn from(o: ObjectiveName) -> Objective {
        match o {
            ObjectiveName::Latency => Objective::Latency,
            ObjectiveName::Memory => Objective::Memory,
            ObjectiveName::Throughput => Objective::Throughput,
        }
    }
}

impl ConstraintsFile {
    pub fn from_yaml(text: &str, source_name: &str) -> Result<ConstraintsFile, PlanError> {
        let bad = |field: String, message: String| {
            PlanError::Constraint(format!("{source_name}: {field}: {message}"))
        };
        let f: ConstraintsFile = mold_plan::from_yaml_with_path(text)
            .map_err(|e| PlanError::Constraint(format!("{source_name}: {e}")))?;
        if let Some(b) = f.stream_buffers {
            if b < 2 {
                return Err(bad(
                    "stream_buffers".into(),
                    format!("{b}: streaming needs at least 2 buffers"),
                ));
            }
        }
        let lists = f
            .devices
            .iter()
            .map(|d| ("devices".to_string(), d.clone()))
            .chain(
                f.pin
                    .iter()
                    .map(|(c, d)| (format!("pin.{}", c.escape_debug()), d.devices())),
            );
        for (field, devs) in lists {
            if devs.is_empty() {
                return Err(bad(
                    field,
                    "empty: name at least one device, e.g. [cuda:0]".into(),
                ));
            }
            for (i, d) in devs.iter().enumerate() {
                if devs[..i].contains(d) {
                    return Err(bad(field, format!("{d} is listed twice: name it once")));
                }
            }
        }
        Ok(f)
    }
}

/// Parses `NAME=DEV[,DEV…]` (for `--pin`).
pub fn parse_pin(s: &str) -> Result<(String, Vec<DeviceId>), String> {
    let (name, devs) = s
        .split_once('=')
        .ok_or_else(|| format!("--pin `{s}`: write COMPONENT=DEVICE, e.g. t5=cuda:1"))?;
    let devs = devs
        .split(',')
        .map(|d| {
            d.parse::<DeviceId>()
                .map_err(|e| format!("--pin {name}: {e}"))
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok((name.trim().to_string(), devs))
}

/// Parses `DEV=SIZE` (for `--max-vram`).
pub fn parse_cap(s: &str) -> Result<(DeviceId, ByteSize), String> {
    let (d, size) = s
        .split_once('=')
        .ok_or_else(|| format!("--max-vram `{s}`: write DEVICE=SIZE, e.g. cuda:0=20GiB"))?;
    let d: DeviceId = d.parse().map_err(|e| format!("--max-vram: {e}"))?;
    let size: ByteSize = size.parse().map_err(|e| format!("--max-vram {d}: {e}"))?;
    Ok((d, size))
}

impl Constraints {
    /// Checks names against the model and machine before solving.
    pub fn check(&self, model: &ModelSpec, machine: &Machine) -> Result<(), PlanError> {
        for (name, devs) in &self.pins {
            let is_transformer = name == "transformer";
            if !is_transformer && model.component(name).is_none() {
                return Err(PlanError::Constraint(format!(
                    "--pin {name}: {} has no component `{name}` (it has {}, transformer)",
                    model.id,
                    model
                        .components
                        .iter()
                        .map(|c| c.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                )));
            }
            if devs.is_empty() {
                return Err(PlanError::Constraint(format!(
                    "--pin {name}: name at least one device"
                )));
            }
            for d in devs {
                if d.is_host() {
                    if is_transformer {
                        return Err(PlanError::Constraint(
                            "--pin transformer=host: the transformer runs on GPUs; its weights can stay on the host with streaming".into(),
                        ));
                    }
                    if !self.host_components {
                        return Err(PlanError::Constraint(format!(
                            "--pin {name}=host conflicts with host components being disallowed"
                        )));
                    }
                } else if machine.device(d).is_none() {
                    return Err(PlanError::Constraint(format!(
                        "--pin {name}: {d} is not a device of machine `{}` (it has {})",
                        machine.name,
                        machine.device_list()
                    )));
                }
            }
        }
        for (flag, choice) in [("--tp", self.tp), ("--sp", self.sp)] {
            if let ParallelChoice::Degree(d) = choice {
                if !model.transformer.tp_divides(d) {
                    return Err(PlanError::Constraint(format!(
                        "{flag} {d}: {} has {} attention heads, which {d} does not divide: use a divisor of {}",
                        model.id,
                        model.transformer.heads(),
                        model.transformer.heads()
                    )));
                }
                if d as usize > machine.devices.len() {
                    return Err(PlanError::Constraint(format!(
                        "{flag} {d}: machine `{}` has only {} devices",
                        machine.name,
                        machine.devices.len()
                    )));
                }
            }
        }
        if let (ParallelChoice::Degree(t), ParallelChoice::Degree(s)) = (self.tp, self.sp) {
            let n = t.saturating_mul(s);
            if !model.transformer.tp_divides(n) {
                return Err(PlanError::Constraint(format!(
                    "--tp {t} --sp {s}: a group of tp × sp = {n} splits {} heads {n} ways, which {n} does not divide: choose degrees whose product divides {}",
                    model.transformer.heads(),
                    model.transformer.heads()
                )));
            }
            if n as usize > machine.devices.len() {
                return Err(PlanError::Constraint(format!(
                    "--tp {t} --sp {s}: a group of tp × sp = {n} devices, but machine `{}` has only {}",
                    machine.name,
                    machine.devices.len()
                )));
            }
        }
        if self.stream_buffers < 2 {
            return Err(PlanError::Constraint(
                "stream buffers: streaming needs at least 2 buffers (double buffering)".into(),
            ));
        }
        Ok(())
    }

    /// Devices component `name` may use.
    pub fn allowed(&self, name: &str, id: &DeviceId) -> bool {
        match self.pins.get(name) {
            Some(devs) => devs.contains(id),
            None => !id.is_host() || self.host_components,
        }
    }
}
