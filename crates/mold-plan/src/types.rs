use crate::ByteSize;
use serde::{de, Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;
use std::str::FromStr;

/// Weight storage type. Quantized types count their block scales: q8 is 34 bytes per 32
/// weights (GGUF Q8_0), q4 is 18 bytes per 32 (Q4_0).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    F32,
    Bf16,
    Fp16,
    Fp8,
    Q8,
    Q4,
}

impl DType {
    pub const ALL: [DType; 6] = [
        DType::F32,
        DType::Bf16,
        DType::Fp16,
        DType::Fp8,
        DType::Q8,
        DType::Q4,
    ];

    /// Bytes per parameter as a fraction (numerator, denominator).
    fn bytes_ratio(self) -> (u64, u64) {
        match self {
            DType::F32 => (4, 1),
            DType::Bf16 | DType::Fp16 => (2, 1),
            DType::Fp8 => (1, 1),
            DType::Q8 => (34, 32),
            DType::Q4 => (18, 32),
        }
    }

    /// Bytes taken by `params` weights stored in this type.
    pub fn weight_bytes(self, params: u64) -> u64 {
        let (n, d) = self.bytes_ratio();
        (params as u128 * n as u128).div_ceil(d as u128) as u64
    }

    /// Bytes per element of activations computed in this type (quantized weights compute
    /// in bf16).
    pub fn activation_bytes(self) -> u64 {
        match self {
            DType::F32 => 4,
            _ => 2,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::Bf16 => "bf16",
            DType::Fp16 => "fp16",
            DType::Fp8 => "fp8",
            DType::Q8 => "q8",
            DType::Q4 => "q4",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        DType::ALL
            .into_iter()
            .find(|d| d.name() == s.to_ascii_lowercase())
            .ok_or_else(|| format!("unknown dtype `{s}`: use one of f32, bf16, fp16, fp8, q8, q4"))
    }
}

/// A device as plans and machine profiles name it: `cuda:N` (a GPU), `emu:N` (an emulated
/// device on the CPU, for tests), or `host` (the CPU and host memory).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DeviceId {
    Cuda(u32),
    Emu(u32),
    Host,
}

impl DeviceId {
    pub fn is_host(&self) -> bool {
        matches!(self, DeviceId::Host)
    }
    /// The ordinal of a GPU or emulated device.
    pub fn ordinal(&self) -> Option<u32> {
        match self {
            DeviceId::Cuda(n) | DeviceId::Emu(n) => Some(*n),
            DeviceId::Host => None,
        }
    }
}

impl fmt::Display for DeviceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceId::Cuda(n) => write!(f, "cuda:{n}"),
            DeviceId::Emu(n) => write!(f, "emu:{n}"),
            DeviceId::Host => write!(f, "host"),
        }
    }
}

impl FromStr for DeviceId {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || {
            format!(
                "`{s}` is not a device: write cuda:N (a GPU), emu:N (an emulated device) or host"
            )
        };
        let t = s.trim();
        if t == "host" || t == "cpu" {
            return Ok(DeviceId::Host);
        }
        let (kind, n) = t.split_once(':').ok_or_else(bad)?;
        let n: u32 = n.parse().map_err(|_| bad())?;
        match kind {
            "cuda" | "gpu" => Ok(DeviceId::Cuda(n)),
            "emu" => Ok(DeviceId::Emu(n)),
            _ => Err(bad()),
        }
    }
}

macro_rules! string_serde {
    ($t:ty, $what:expr) => {
        impl Serialize for $t {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.collect_str(self)
            }
        }
        impl<'de> Deserialize<'de> for $t {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                struct V;
                impl de::Visitor<'_> for V {
                    type Value = $t;
                    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                        f.write_str($what)
                    }
                    fn visit_str<E: de::Error>(self, v: &str) -> Result<$t, E> {
                        v.parse().map_err(E::custom)
                    }
                }
                d.deserialize_str(V)
            }
        }
    };
}
string_serde!(DeviceId, "a device such as cuda:0, emu:0 or host");
string_serde!(BlockRange, "a block range such as `double 0..19`");

/// A range of one kind of transformer block, `kind start..end` (end exclusive), e.g.
/// `double 0..19` or `single 0..38`. Kinds are never mixed by index: a part that crosses
/// from double to single blocks lists two ranges.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct BlockRange {
    pub kind: String,
    pub start: u32,
    pub end: u32,
}

impl BlockRange {
    pub fn new(kind: &str, start: u32, end: u32) -> Self {
        BlockRange {
            kind: kind.to_string(),
            start,
            end,
        }
    }
    pub fn len(&self) -> u32 {
        self.end.saturating_sub(self.start)
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl fmt::Display for BlockRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}..{}", self.kind, self.start, self.end)
    }
}

impl FromStr for BlockRange {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let bad =
            || format!("`{s}` is not a block range: write `KIND START..END`, e.g. `double 0..19`");
        let (kind, range) = s.trim().split_once(char::is_whitespace).ok_or_else(bad)?;
        let (a, b) = range.trim().split_once("..").ok_or_else(bad)?;
        let start: u32 = a.trim().parse().map_err(|_| bad())?;
        let end: u32 = b.trim().parse().map_err(|_| bad())?;
        if kind.is_empty() {
            return Err(bad());
        }
        Ok(BlockRange {
            kind: kind.to_string(),
            start,
            end,
        })
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Plan {
    pub version: u32,
    pub model: ModelRef,
    pub workload: Workload,
    /// How a step's two true-CFG passes (conditional, unconditional) run (version 4):
    /// absent when the workload has no true CFG (`cfg_scale`; FLUX is guidance-distilled).
    /// A plan with a `cfg_scale` and no `cfg` runs them serially ([`Plan::cfg_mode`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cfg: Option<CfgPlan>,
    /// Whether the components are loaded one phase at a time (version 4; absent:
    /// resident, what earlier versions meant).
    #[serde(default)]
    pub memory_phases: MemoryPhases,
    pub machine: MachineIdentity,
    pub components: Vec<ComponentPlan>,
    /// Copies of the placement serving requests side by side (version 3): each maps every
    /// device the placement uses to the device that copy runs on, replicas on disjoint
    /// devices. Absent: one copy, the placement as written ([`Plan::replica_plans`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<Vec<Replica>>,
    pub predicted: Prediction,
    pub solver: SolverRecord,
}

/// How true CFG runs a step's two transformer passes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CfgPlan {
    pub mode: CfgMode,
}

/// The CFG strategies.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CfgMode {
    /// The conditional pass, then the unconditional one, on the same placement.
    Serial,
    /// The conditional pass on `replicas[0]`, the unconditional one on `replicas[1]`,
    /// at the same time; the unconditional output is then sent to replica 0's output
    /// device and combined there.
    Parallel,
    /// The two passes as two micro-batches (conditional first) through the stages of a
    /// block split: stage s works on one while stage s+1 works on the other.
    Pipelined,
}

impl CfgMode {
    pub const ALL: [CfgMode; 3] = [CfgMode::Serial, CfgMode::Parallel, CfgMode::Pipelined];
    pub fn name(self) -> &'static str {
        match self {
            CfgMode::Serial => "serial",
            CfgMode::Parallel => "parallel",
            CfgMode::Pipelined => "pipelined",
        }
    }
}

impl fmt::Display for CfgMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for CfgMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        CfgMode::ALL
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| format!("unknown CFG mode `{s}`: use serial, parallel or pipelined"))
    }
}

/// When a request's components hold device memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum MemoryPhases {
    /// One request, one phase at a time: the text encoders are freed before the
    /// transformer loads, and the transformer before the VAE loads, so each device's
    /// peak is the largest of its encode, denoise and decode phases (what `mold exec
    /// --prompt` does).
    OneShot,
    /// Everything loaded at once for the whole run (a server): peaks count every
    /// component together.
    #[default]
    Resident,
}

impl MemoryPhases {
    pub fn name(self) -> &'static str {
        match self {
            MemoryPhases::OneShot => "one-shot",
            MemoryPhases::Resident => "resident",
        }
    }
}

impl fmt::Display for MemoryPhases {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for MemoryPhases {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "one-shot" => Ok(MemoryPhases::OneShot),
            "resident" => Ok(MemoryPhases::Resident),
            _ => Err(format!(
                "unknown memory phases `{s}`: use one-shot (encoders freed before the transformer loads) or resident (everything loaded at once)"
            )),
        }
    }
}

/// Where one replica runs: each device the placement uses → the device it runs on.
pub type Replica = std::collections::BTreeMap<DeviceId, DeviceId>;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelRef {
    /// Catalogue id (`flux-dev`), also when the sizes came from a checkpoint.
    pub id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint: Option<CheckpointRef>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckpointRef {
    pub path: String,
    /// sha256 of the safetensors header (names, dtypes, shapes, offsets): the checkpoint's
    /// layout, compared by `exec` without hashing gigabytes of weights.
    pub header_sha256: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Workload {
    pub width: u32,
    pub height: u32,
    #[serde(default = "one")]
    pub frames: u32,
    #[serde(default = "one")]
    pub batch: u32,
    pub steps: u32,
    /// Distilled guidance fed to the transformer (FLUX dev), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guidance: Option<f64>,
    /// Classifier-free guidance scale; when set, every step runs a conditional and an
    /// unconditional transformer pass of `batch` samples each (the plan's `cfg` says how
    /// they run) and the text encoders encode a negative prompt too.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cfg_scale: Option<f64>,
}

fn one() -> u32 {
    1
}

fn is_one(n: &u32) -> bool {
    *n == 1
}

impl Workload {
    /// Samples through the transformer per step, and prompts per text encoder: batch,
    /// doubled under classifier-free guidance (each transformer pass takes `batch`).
    pub fn effective_batch(&self) -> u64 {
        self.batch as u64 * if self.cfg_scale.is_some() { 2 } else { 1 }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MachineIdentity {
    pub name: String,
    /// sha256 over device names and memory sizes, in order: `exec` compares it with the
    /// machine it runs on.
    pub fingerprint: String,
    pub devices: Vec<DeviceIdentity>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceIdentity {
    pub id: DeviceId,
    pub name: String,
    pub memory: ByteSize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ComponentRole {
    Encoder,
    Transformer,
    Vae,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ComponentPlan {
    /// Component name from the catalogue: `t5`, `clip`, `transformer`, `vae`, …
    pub name: String,
    pub role: ComponentRole,
    pub dtype: DType,
    /// The transformer's attention precision where it is not the activations': `fp8`
    /// (q, k, v and the probabilities in e4m3, cuDNN's FP8 flash attention on Hopper and
    /// later) in blocks whose products are FP8 (`dtype: fp8`). Absent: attention in the
    /// activations' dtype. Written only when set (version 5).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention: Option<DType>,
    pub parts: Vec<Part>,
}

impl ComponentPlan {
    /// Whether the component's attention runs in FP8 (`attention: fp8`).
    pub fn fp8_attention(&self) -> bool {
        self.attention == Some(DType::Fp8)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Residency {
    /// Weights live on the part's devices for the whole run.
    Resident,
    /// Weights live in pinned host memory and are copied block by block into
    /// `stream_buffers` device buffers, the copy of block i+1 overlapping block i.
    Streamed,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Part {
    /// Transformer block ranges in execution order; empty for whole components.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub blocks: Vec<BlockRange>,
    /// One device, or `tp × sp` devices. `devices[i]` has sequence-parallel rank `i / tp`
    /// and tensor-parallel rank `i % tp`: tensor-parallel groups are consecutive runs of
    /// `tp` devices, and the sequence-parallel all-to-all runs among the devices of equal
    /// tensor-parallel rank.
    pub devices: Vec<DeviceId>,
    /// Tensor-parallel degree: attention heads and MLP columns split over `tp` devices
    /// (weights `1/tp` per device). Written only when above 1.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub tp: u32,
    /// Sequence-parallel (Ulysses) degree: the joint text + image tokens split over `sp`
    /// devices, an all-to-all turning token shards into head shards around attention.
    /// On the VAE's one part: the image decoded in `sp` row bands, one on each of its
    /// devices in order (band 0 the top rows), the group norms' statistics and the edge
    /// rows exchanged between them. Written only when above 1.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub sp: u32,
    pub residency: Residency,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream_buffers: Option<u32>,
}

impl Part {
    pub fn buffers(&self) -> u32 {
        match self.residency {
            Residency::Resident => 0,
            Residency::Streamed => self.stream_buffers.unwrap_or(2),
        }
    }
    pub fn block_count(&self) -> u32 {
        self.blocks.iter().map(|r| r.len()).sum()
    }
    /// Devices the layout asks for: `tp × sp` (a valid plan lists exactly that many).
    pub fn degree(&self) -> u64 {
        self.tp as u64 * self.sp as u64
    }
    /// Sequence-parallel rank of `devices[i]`.
    pub fn sp_rank(&self, i: usize) -> u32 {
        (i / self.tp.max(1) as usize) as u32
    }
    /// Tensor-parallel rank of `devices[i]`.
    pub fn tp_rank(&self, i: usize) -> u32 {
        (i % self.tp.max(1) as usize) as u32
    }
    /// The tensor-parallel group of sequence-parallel rank `s`: `tp` consecutive devices.
    pub fn tp_group(&self, s: u32) -> &[DeviceId] {
        let tp = self.tp.max(1) as usize;
        let start = (s as usize * tp).min(self.devices.len());
        &self.devices[start..(start + tp).min(self.devices.len())]
    }
    /// The sequence-parallel group of tensor-parallel rank `t`: every `tp`-th device.
    pub fn sp_group(&self, t: u32) -> Vec<DeviceId> {
        self.devices
            .iter()
            .skip(t as usize)
            .step_by(self.tp.max(1) as usize)
            .cloned()
            .collect()
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Prediction {
    pub step_time_s: f64,
    pub request_time_s: f64,
    pub encode_time_s: f64,
    pub denoise_time_s: f64,
    pub decode_time_s: f64,
    pub devices: Vec<DevicePrediction>,
    /// Pinned host memory taken by streamed weights.
    pub host_pinned: ByteSize,
    /// Weight bytes copied host→device per denoising step.
    pub streamed_per_step: ByteSize,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DevicePrediction {
    pub device: DeviceId,
    pub peak: ByteSize,
    pub budget: ByteSize,
    pub weights: ByteSize,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SolverRecord {
    pub solver: String,
    pub status: String,
    pub objective: String,
    pub objective_value: f64,
    pub strategy: String,
    pub solve_time_ms: f64,
}
