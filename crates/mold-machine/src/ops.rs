//! Operation tables: what `mold devices --calibrate --model M` measured of a model's own
//! operations on one kind of device — the matrix products its blocks run (full,
//! tensor-parallel and sequence-parallel shapes), attention over heads × sequence, the
//! bandwidth of its element-wise kernels and the collectives the executor runs. The
//! cost model (`mold-cost`) prices a block as the sum of these operations, interpolated
//! between the measured sizes, wherever a profile has the tables a block needs.
//!
//! A table is plain data, kept in a profile's `ops:` list, one per (model, dtype,
//! device name). Its keys are sorted and unique so a lookup is a search, and every
//! time is finite and positive; [`OpTables::validate`] says which field is wrong.

use mold_plan::{ByteSize, DType};
use serde::{Deserialize, Serialize};

/// One model's measured operations on one kind of device.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OpTables {
    /// The catalogue id of the model whose shapes were measured (`flux-dev`).
    pub model: String,
    /// The dtype the model ran in.
    pub dtype: DType,
    /// The devices the tables describe: the profile's devices of this `name`.
    pub device: String,
    /// Matrix products `(m × k) · (k × n)`: `m` rows (tokens), `k` input and `n`
    /// output features. Sorted by (n, k, m).
    #[serde(default)]
    pub gemm: Vec<GemmPoint>,
    /// Attention of one sample: `heads` heads over `seq` tokens (queries and keys) of
    /// `head_dim`. Sorted by (head_dim, heads, seq).
    #[serde(default)]
    pub attention: Vec<AttentionPoint>,
    /// FP8 attention of one sample, as a plan with `attention: fp8` runs it in its FP8
    /// blocks: q, k and v quantized to e4m3 (one pass, their maxima given) and cuDNN's FP8
    /// flash attention. Only in FP8 tables, where it was measured (a GPU with cuDNN's FP8
    /// attention, or the CPU's emulation); empty otherwise. Sorted as `attention`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub fp8_attention: Vec<AttentionPoint>,
    /// Bytes per second (GB/s) the model's element-wise kernels (the norm with its
    /// modulation, the gated residual) reach: bytes read and written over their time.
    pub elementwise_gbps: f64,
    /// Bytes per second (GB/s) of the copy around a sequence-parallel all-to-all, as
    /// `mold-exec`'s `model/sequence.rs` runs it: the attention output's pieces put
    /// together, bytes read and written over their time. (Profiles calibrated before the
    /// q/k/v messages were written in place, 2026-11-28, measured the older copies here — q,
    /// k and v stacked per destination, the received pieces put together — which ran at
    /// about half the rate.) `None` in profiles calibrated before it was measured: the copy
    /// is priced at `elementwise_gbps`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layout_copy_gbps: Option<f64>,
    #[serde(default)]
    pub collectives: CollectiveTables,
    /// The pinned host→device copy's rate while this model's blocks compute on the
    /// device, over its idle rate, both timed in one calibration: what a streamed
    /// block's copy gets beside the blocks before it. Preferred to the profile's
    /// GEMM-only `links.host_pinned_busy_gbps` for this model's blocks; at most 1 where
    /// it is used (above is noise). `None` where it was not measured (emulated devices,
    /// older profiles).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub htod_busy_ratio: Option<f64>,
    /// Where the tables come from when not from this profile's own devices: `scaled by
    /// spec sheet from NVIDIA H100 80GB HBM3 (4x-h100-measured, 2026-11-27)` for a GPU
    /// mold has not measured ([`crate::shipped`]). `None`: measured on these devices.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub estimated: Option<String>,
    /// The device memory the CUDA libraries hold beyond the tensors once the model's
    /// blocks have run: kernel code loaded on first use (candle's and mold's
    /// modules, cuBLAS/cuBLASLt's and cuDNN's generated kernels), cuBLAS/cuBLASLt handles
    /// and workspaces, curand, streams. Measured in a fresh process (`mold calibrate-footprint`,
    /// spawned by `mold devices --calibrate --model M`): the device's memory in use after
    /// each of the blocks' operations has run once and their tensors are dropped, less
    /// before (the CUDA context already made), less what the memory pool grew by and keeps
    /// free for reuse (the tensors' memory); the median of three processes.
    /// The cost model, the simulator and the planner count it in every device the plan
    /// uses. `None` in profiles calibrated before it was measured and on emulated devices:
    /// priced as before, without it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub library_bytes: Option<ByteSize>,
    /// The pipeline's other components run alone on one of the devices, warm: each text
    /// encoder over its prompt tokens, the VAE decoding one image; with what their first
    /// run in a fresh process costs on top. Sorted by (component, dtype, size).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub components: Vec<ComponentPoint>,
}

/// One run of a pipeline component (batch 1, weights resident, after a warm-up run).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ComponentPoint {
    /// The component's name in the model's catalogue entry (`t5`, `clip`, `vae`).
    pub component: String,
    /// The dtype it was planned in (what a plan's component says).
    pub dtype: DType,
    /// The image's pixels (width × height) for a decoder; the prompt's tokens for a text
    /// encoder.
    pub size: u64,
    pub seconds: f64,
    /// What the component's first run in a fresh process takes beyond `seconds` (its cold
    /// run less its warm median, both timed in one new process that runs the components
    /// in a one-shot `mold exec`'s order: the CUDA libraries' kernels loaded on first use
    /// land there). Paid once per process; `None` in profiles calibrated before it was
    /// measured, which price as they did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_use_seconds: Option<f64>,
}

#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GemmPoint {
    pub m: u64,
    pub n: u64,
    pub k: u64,
    pub seconds: f64,
}

#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AttentionPoint {
    pub heads: u64,
    pub seq: u64,
    pub head_dim: u64,
    pub seconds: f64,
}

/// The measured sequences of `points` over `heads` heads of `head_dim`, by sequence.
fn curve_of(points: &[AttentionPoint], heads: u64, head_dim: u64) -> Vec<(f64, f64)> {
    points
        .iter()
        .filter(|p| p.heads == heads && p.head_dim == head_dim)
        .map(|p| (p.seq as f64, p.seconds))
        .collect()
}

/// Collectives over groups of `devices` ranks of the profile's devices, by message size.
/// `bytes` is, per rank: the tensor reduced (all-reduce), the tensor gathered on every
/// rank (all-gather: the output), the tensor sent in pieces to the ranks (all-to-all).
/// Each list sorted by (devices, bytes).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CollectiveTables {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub all_reduce: Vec<CollectivePoint>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub all_gather: Vec<CollectivePoint>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub all_to_all: Vec<CollectivePoint>,
}

#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CollectivePoint {
    pub devices: u32,
    pub bytes: u64,
    pub seconds: f64,
}

/// Which collective a [`CollectivePoint`] list holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CollectiveOp {
    AllReduce,
    AllGather,
    AllToAll,
}

impl CollectiveOp {
    pub fn name(self) -> &'static str {
        match self {
            CollectiveOp::AllReduce => "all_reduce",
            CollectiveOp::AllGather => "all_gather",
            CollectiveOp::AllToAll => "all_to_all",
        }
    }
}

impl CollectiveTables {
    pub fn of(&self, op: CollectiveOp) -> &[CollectivePoint] {
        match op {
            CollectiveOp::AllReduce => &self.all_reduce,
            CollectiveOp::AllGather => &self.all_gather,
            CollectiveOp::AllToAll => &self.all_to_all,
        }
    }
}

impl OpTables {
    /// The measured `m` of the products `(n, k)`, with their times, by increasing `m`.
    pub fn gemm_curve(&self, n: u64, k: u64) -> Vec<(f64, f64)> {
        self.gemm
            .iter()
            .filter(|p| p.n == n && p.k == k)
            .map(|p| (p.m as f64, p.seconds))
            .collect()
    }

    /// The measured sequences of attention over `heads` heads of `head_dim`, with their
    /// times, by increasing sequence.
    pub fn attention_curve(&self, heads: u64, head_dim: u64) -> Vec<(f64, f64)> {
        curve_of(&self.attention, heads, head_dim)
    }

    /// [`Self::attention_curve`] of FP8 attention ([`OpTables::fp8_attention`]).
    pub fn fp8_attention_curve(&self, heads: u64, head_dim: u64) -> Vec<(f64, f64)> {
        curve_of(&self.fp8_attention, heads, head_dim)
    }

    /// The measured sizes of `op` over `devices` ranks, with their times, by size.
    pub fn collective_curve(&self, op: CollectiveOp, devices: u32) -> Vec<(f64, f64)> {
        self.collectives
            .of(op)
            .iter()
            .filter(|p| p.devices == devices)
            .map(|p| (p.bytes as f64, p.seconds))
            .collect()
    }

    /// The measured sizes of `component` planned in `dtype`, with their times, by size.
    pub fn component_curve(&self, component: &str, dtype: DType) -> Vec<(f64, f64)> {
        self.components
            .iter()
            .filter(|p| p.component == component && p.dtype == dtype)
            .map(|p| (p.size as f64, p.seconds))
            .collect()
    }

    /// The measured points of `component` planned in `dtype`, by size.
    pub fn component_points(&self, component: &str, dtype: DType) -> Vec<&ComponentPoint> {
        self.components
            .iter()
            .filter(|p| p.component == component && p.dtype == dtype)
            .collect()
    }

    /// Sorts every list into the order [`OpTables::validate`] requires (a measurement
    /// writes its points in the order it took them).
    pub fn sort(&mut self) {
        self.gemm.sort_by_key(|p| (p.n, p.k, p.m));
        self.attention.sort_by_key(|p| (p.head_dim, p.heads, p.seq));
        self.fp8_attention
            .sort_by_key(|p| (p.head_dim, p.heads, p.seq));
        for l in [
            &mut self.collectives.all_reduce,
            &mut self.collectives.all_gather,
            &mut self.collectives.all_to_all,
        ] {
            l.sort_by_key(|p| (p.devices, p.bytes));
        }
        self.components.sort_by_key(component_key);
    }

    /// Checks the table, naming the first bad field under `at` (`ops[0]`) in one line.
    pub fn validate(&self, at: &str) -> Result<(), (String, String)> {
        let err = |field: String, message: String| Err((field, message));
        if self.model.trim().is_empty() {
            return err(
                format!("{at}.model"),
                "empty: name the model the tables were measured for".into(),
            );
        }
        if self.device.trim().is_empty() {
            return err(
                format!("{at}.device"),
                "empty: name the devices (their profile `name`) the tables describe".into(),
            );
        }
        seconds(&format!("{at}.elementwise_gbps"), self.elementwise_gbps)?;
        if let Some(g) = self.layout_copy_gbps {
            seconds(&format!("{at}.layout_copy_gbps"), g)?;
        }
        if let Some(r) = self.htod_busy_ratio {
            seconds(&format!("{at}.htod_busy_ratio"), r)?;
        }
        // Each list: positive sizes, finite positive times, keys strictly increasing.
        fn list<P>(
            field: &str,
            points: &[P],
            sizes: impl Fn(&P) -> Vec<(&'static str, u64)>,
            time: impl Fn(&P) -> f64,
            order: &str,
        ) -> Result<(), (String, String)> {
            let mut previous: Option<Vec<u64>> = None;
            for (i, p) in points.iter().enumerate() {
                let f = format!("{field}[{i}]");
                let key: Vec<u64> = sizes(p).iter().map(|(_, v)| *v).collect();
                if let Some((name, _)) = sizes(p).into_iter().find(|(_, v)| *v == 0) {
                    return Err((format!("{f}.{name}"), "0: a size is at least 1".into()));
                }
                seconds(&format!("{f}.seconds"), time(p))?;
                if let Some(prev) = &previous {
                    if key == *prev {
                        return Err((
                            f,
                            format!("measured twice ({order} {key:?}): keep one point"),
                        ));
                    }
                    if key < *prev {
                        return Err((
                            f,
                            format!(
                                "out of order: sort the points by {order} ({key:?} after {prev:?})"
                            ),
                        ));
                    }
                }
                previous = Some(key);
            }
            Ok(())
        }
        list(
            &format!("{at}.gemm"),
            &self.gemm,
            |p| vec![("n", p.n), ("k", p.k), ("m", p.m)],
            |p| p.seconds,
            "(n, k, m)",
        )?;
        for (name, points) in [
            ("attention", &self.attention),
            ("fp8_attention", &self.fp8_attention),
        ] {
            list(
                &format!("{at}.{name}"),
                points,
                |p| vec![("head_dim", p.head_dim), ("heads", p.heads), ("seq", p.seq)],
                |p| p.seconds,
                "(head_dim, heads, seq)",
            )?;
        }
        if !self.fp8_attention.is_empty() && self.dtype != DType::Fp8 {
            return err(
                format!("{at}.fp8_attention"),
                format!(
                    "in a {} table: FP8 attention runs in FP8 blocks only; move it to the model's `dtype: fp8` table or remove it",
                    self.dtype
                ),
            );
        }
        for op in [
            CollectiveOp::AllReduce,
            CollectiveOp::AllGather,
            CollectiveOp::AllToAll,
        ] {
            let field = format!("{at}.collectives.{}", op.name());
            let points = self.collectives.of(op);
            if let Some(i) = points.iter().position(|p| p.devices < 2) {
                return err(
                    format!("{field}[{i}].devices"),
                    format!(
                        "{}: a collective joins at least 2 devices",
                        points[i].devices
                    ),
                );
            }
            list(
                &field,
                points,
                |p| vec![("devices", p.devices as u64), ("bytes", p.bytes)],
                |p| p.seconds,
                "(devices, bytes)",
            )?;
        }
        let mut previous: Option<(String, String, u64)> = None;
        for (i, p) in self.components.iter().enumerate() {
            let f = format!("{at}.components[{i}]");
            if p.component.trim().is_empty() {
                return err(
                    format!("{f}.component"),
                    "empty: name the component (t5, clip, vae)".into(),
                );
            }
            if p.size == 0 {
                return err(format!("{f}.size"), "0: a size is at least 1".into());
            }
            seconds(&format!("{f}.seconds"), p.seconds)?;
            if let Some(v) = p.first_use_seconds {
                if !(v.is_finite() && v >= 0.0) {
                    return err(
                        format!("{f}.first_use_seconds"),
                        format!("{v} is not allowed: give a finite number >= 0"),
                    );
                }
            }
            let key = component_key(p);
            if let Some(prev) = &previous {
                if key == *prev {
                    return err(
                        f,
                        "measured twice (component, dtype, size): keep one point".into(),
                    );
                }
                if key < *prev {
                    return err(
                        f,
                        format!(
                            "out of order: sort the points by (component, dtype, size) ({key:?} after {prev:?})"
                        ),
                    );
                }
            }
            previous = Some(key);
        }
        Ok(())
    }
}

/// The order of [`OpTables::components`].
fn component_key(p: &ComponentPoint) -> (String, String, u64) {
    (p.component.clone(), p.dtype.to_string(), p.size)
}

/// A time or rate: finite and above 0.
fn seconds(field: &str, v: f64) -> Result<(), (String, String)> {
    if v.is_finite() && v > 0.0 {
        Ok(())
    } else {
        Err((
            field.into(),
            format!("{v} is not allowed: give a finite number > 0"),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Machine;

    const WITH_OPS: &str = r#"
name: t
calibration: {source: measured}
host: {memory: 64GiB, pinned_limit: 32GiB, tflops: 1.0, mem_bandwidth_gbps: 50}
devices:
- {id: cuda:0, name: GPU A, memory: 24GiB, budget: 23GiB, bf16_tflops: 100, mem_bandwidth_gbps: 1000}
- {id: cuda:1, name: GPU A, memory: 24GiB, budget: 23GiB, bf16_tflops: 100, mem_bandwidth_gbps: 1000}
links: {host_pinned_gbps: 25, host_pageable_gbps: 10}
ops:
- model: flux-dev
  dtype: bf16
  device: GPU A
  gemm:
  - {m: 512, n: 3072, k: 3072, seconds: 0.0001}
  - {m: 4096, n: 3072, k: 3072, seconds: 0.0007}
  attention:
  - {heads: 24, seq: 4608, head_dim: 128, seconds: 0.002}
  elementwise_gbps: 1500
  collectives:
    all_reduce:
    - {devices: 2, bytes: 8192, seconds: 0.00001}
  components:
  - {component: t5, dtype: fp16, size: 512, seconds: 0.02}
  - {component: vae, dtype: bf16, size: 262144, seconds: 0.004, first_use_seconds: 0.03}
  - {component: vae, dtype: bf16, size: 1048576, seconds: 0.015}
"#;

    #[test]
    fn tables_load_round_trip_and_keep_the_fingerprint() {
        let m = Machine::from_yaml(WITH_OPS, "t.yaml").unwrap();
        assert_eq!(m.ops.len(), 1);
        let t = &m.ops[0];
        assert_eq!(
            t.gemm_curve(3072, 3072),
            vec![(512.0, 0.0001), (4096.0, 0.0007)]
        );
        assert!(t.gemm_curve(3072, 12288).is_empty());
        assert_eq!(
            t.component_curve("vae", DType::Bf16),
            vec![(262144.0, 0.004), (1048576.0, 0.015)]
        );
        assert_eq!(t.component_curve("t5", DType::Fp16), vec![(512.0, 0.02)]);
        assert!(t.component_curve("t5", DType::Bf16).is_empty());
        assert_eq!(
            t.collective_curve(CollectiveOp::AllReduce, 2),
            vec![(8192.0, 0.00001)]
        );
        assert_eq!(Machine::from_yaml(&m.to_yaml(), "again").unwrap(), m);
        let (before, _) = WITH_OPS.split_once("\nops:").unwrap();
        let plain = Machine::from_yaml(before, "t.yaml").unwrap();
        assert_eq!(plain.fingerprint(), m.fingerprint());
        assert!(!plain.to_yaml().contains("\nops:"));
        assert!(m.op_tables("flux-dev", DType::Bf16, "GPU A").is_some());
        assert!(m.op_tables("flux-dev", DType::F32, "GPU A").is_none());
        assert!(m.op_tables("flux-dev", DType::Bf16, "GPU B").is_none());
    }

    #[test]
    fn bad_tables_are_refused_naming_the_field() {
        for (from, to, want) in [
            (
                "m: 4096, n: 3072, k: 3072, seconds: 0.0007",
                "m: 4096, n: 3072, k: 3072, seconds: .nan",
                "t.yaml: ops[0].gemm[1].seconds: NaN is not allowed",
            ),
            (
                "m: 4096, n: 3072, k: 3072, seconds: 0.0007",
                "m: 4096, n: 3072, k: 3072, seconds: -1",
                "t.yaml: ops[0].gemm[1].seconds: -1 is not allowed",
            ),
            (
                "m: 4096, n: 3072",
                "m: 256, n: 3072",
                "t.yaml: ops[0].gemm[1]: out of order: sort the points by (n, k, m)",
            ),
            (
                "m: 4096, n: 3072",
                "m: 512, n: 3072",
                "t.yaml: ops[0].gemm[1]: measured twice",
            ),
            (
                "m: 4096, n: 3072",
                "m: 0, n: 3072",
                "t.yaml: ops[0].gemm[1].m: 0",
            ),
            (
                "seq: 4608, head_dim: 128, seconds: 0.002",
                "seq: 4608, head_dim: 128, seconds: .inf",
                "t.yaml: ops[0].attention[0].seconds: inf is not allowed",
            ),
            (
                "size: 1048576, seconds: 0.015",
                "size: 1048576, seconds: .nan",
                "t.yaml: ops[0].components[2].seconds: NaN is not allowed",
            ),
            (
                "seconds: 0.004, first_use_seconds: 0.03",
                "seconds: 0.004, first_use_seconds: -0.1",
                "t.yaml: ops[0].components[1].first_use_seconds: -0.1 is not allowed",
            ),
            (
                "seconds: 0.004, first_use_seconds: 0.03",
                "seconds: 0.004, first_use_seconds: .nan",
                "t.yaml: ops[0].components[1].first_use_seconds: NaN is not allowed",
            ),
            (
                "seconds: 0.004, first_use_seconds: 0.03",
                "seconds: 0.004, first_use_seconds: .inf",
                "t.yaml: ops[0].components[1].first_use_seconds: inf is not allowed",
            ),
            (
                "size: 1048576, seconds: 0.015",
                "size: 1024, seconds: 0.015",
                "t.yaml: ops[0].components[2]: out of order: sort the points by (component, dtype, size)",
            ),
            (
                "size: 1048576, seconds: 0.015",
                "size: 262144, seconds: 0.015",
                "t.yaml: ops[0].components[2]: measured twice",
            ),
            (
                "size: 512, seconds: 0.02",
                "size: 0, seconds: 0.02",
                "t.yaml: ops[0].components[0].size: 0",
            ),
            (
                "{component: t5,",
                "{component: ' ',",
                "t.yaml: ops[0].components[0].component: empty",
            ),
            (
                "elementwise_gbps: 1500",
                "elementwise_gbps: 0",
                "t.yaml: ops[0].elementwise_gbps: 0 is not allowed",
            ),
            (
                "elementwise_gbps: 1500",
                "elementwise_gbps: 1500\n  layout_copy_gbps: -3",
                "t.yaml: ops[0].layout_copy_gbps: -3 is not allowed",
            ),
            (
                "elementwise_gbps: 1500",
                "elementwise_gbps: 1500\n  htod_busy_ratio: -0.5",
                "t.yaml: ops[0].htod_busy_ratio: -0.5 is not allowed",
            ),
            (
                "{devices: 2, bytes",
                "{devices: 1, bytes",
                "t.yaml: ops[0].collectives.all_reduce[0].devices: 1",
            ),
            (
                "device: GPU A\n",
                "device: ''\n",
                "t.yaml: ops[0].device: empty",
            ),
            (
                "device: GPU A\n",
                "device: GPU A\n  speed: 3\n",
                "unknown field `speed`",
            ),
        ] {
            let bad = WITH_OPS.replacen(from, to, 1);
            assert_ne!(bad, WITH_OPS, "{from}");
            let e = Machine::from_yaml(&bad, "t.yaml").unwrap_err().to_string();
            assert!(e.contains(want), "{to}: {e}");
            assert!(!e.contains('\n'), "{e}");
        }
        // Two tables for the same model, dtype and devices.
        let (_, table) = WITH_OPS.split_once("\nops:\n").unwrap();
        let twice = format!("{WITH_OPS}{table}");
        let e = Machine::from_yaml(&twice, "t.yaml")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("t.yaml: ops[1]: a second table for flux-dev bf16 on GPU A"),
            "{e}"
        );
    }

    /// `first_use_seconds` is optional: a profile without it loads as before and is
    /// written back without it; one with it keeps it (0 included: a first run no slower).
    #[test]
    fn first_use_seconds_is_optional_and_round_trips() {
        let m = Machine::from_yaml(WITH_OPS, "t.yaml").unwrap();
        let firsts: Vec<Option<f64>> = m.ops[0]
            .components
            .iter()
            .map(|p| p.first_use_seconds)
            .collect();
        assert_eq!(firsts, [None, Some(0.03), None]);
        let yaml = m.to_yaml();
        assert_eq!(yaml.matches("first_use_seconds").count(), 1, "{yaml}");
        assert_eq!(Machine::from_yaml(&yaml, "again").unwrap(), m);
        let zero = WITH_OPS.replace("first_use_seconds: 0.03", "first_use_seconds: 0");
        let z = Machine::from_yaml(&zero, "t.yaml").unwrap();
        assert_eq!(z.ops[0].components[1].first_use_seconds, Some(0.0));
        let old = WITH_OPS.replace(", first_use_seconds: 0.03", "");
        let o = Machine::from_yaml(&old, "t.yaml").unwrap();
        assert!(o.ops[0]
            .components
            .iter()
            .all(|p| p.first_use_seconds.is_none()));
        assert!(!o.to_yaml().contains("first_use_seconds"));
        let points = o.ops[0].component_points("vae", DType::Bf16);
        assert_eq!(
            points.iter().map(|p| p.size).collect::<Vec<_>>(),
            [262144, 1048576]
        );
    }

    /// `library_bytes` is optional: a profile without it (every profile calibrated before
    /// it was measured) loads with `None` and is written back without it; one with it
    /// keeps it through a write and a load.
    #[test]
    fn library_bytes_is_optional_and_round_trips() {
        let old = Machine::from_yaml(WITH_OPS, "t.yaml").unwrap();
        assert_eq!(old.ops[0].library_bytes, None);
        assert!(!old.to_yaml().contains("library_bytes"));
        let with = WITH_OPS.replace(
            "elementwise_gbps: 1500\n",
            "elementwise_gbps: 1500\n  library_bytes: 214MiB\n",
        );
        let m = Machine::from_yaml(&with, "t.yaml").unwrap();
        assert_eq!(
            m.ops[0].library_bytes,
            Some(mold_plan::ByteSize(214 * mold_plan::MIB))
        );
        let yaml = m.to_yaml();
        assert!(yaml.contains("library_bytes: 214MiB"), "{yaml}");
        assert_eq!(Machine::from_yaml(&yaml, "again").unwrap(), m);
        assert_eq!(m.fingerprint(), old.fingerprint());
        let bad = WITH_OPS.replace(
            "elementwise_gbps: 1500\n",
            "elementwise_gbps: 1500\n  library_bytes: lots\n",
        );
        let e = Machine::from_yaml(&bad, "t.yaml").unwrap_err().to_string();
        assert!(e.contains("not a size"), "{e}");
    }

    #[test]
    fn sort_puts_points_in_the_order_validate_wants() {
        let mut m = Machine::from_yaml(WITH_OPS, "t.yaml").unwrap();
        let t = &mut m.ops[0];
        t.gemm.reverse();
        assert!(t.validate("ops[0]").is_err());
        t.sort();
        t.validate("ops[0]").unwrap();
    }
}
