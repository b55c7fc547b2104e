//! Operation tables mold ships: measured on lent boxes by `mold devices --calibrate
//! --model M` (`sim/machines/4x-h100-measured.yaml` and `4x-h200-measured.yaml`, each with
//! its box, date and commit in its description), built into the binary. A profile built
//! from a box's inventory (`--machine local`) adopts the tables of the GPUs it has
//! ([`Machine::adopt_tables`]), so a box nobody calibrated is priced from measurement;
//! `mold devices --calibrate` measures the box's own and never adopts.
//!
//! A GPU's products, attention, element-wise kernels, encoders and decoder are the GPU's
//! own and travel with its name. A GPU mold has not measured gets the tables of one it
//! has, scaled by the two devices' figures in their profiles ([`scaled`]: a product by
//! the bf16 rate where its arithmetic intensity is past the measured GPU's ridge point,
//! else by memory bandwidth; attention, the encoders and the decoder by the bf16 rate;
//! element-wise kernels by bandwidth), a spec-sheet estimate labelled as one. Its collectives depend on the links between the GPUs:
//! they are adopted only where the box's devices of that name share one peer domain of
//! the same kind (NVLink, PCIe) as the measured box's, for the group sizes that domain
//! holds; elsewhere the profile's link model prices them. A box with more devices of a
//! name than the measured box adopts nothing for them: its wider layouts are not in the
//! tables, and the peak-rate model pricing them beside measured ones would favour them.

use crate::{LinkKind, Machine};

/// The measured profiles mold carries: `(name, YAML)`.
/// The H100's first: a GPU mold has not measured is scaled from the first measured one.
const PROFILES: &[(&str, &str)] = &[
    (
        "4x-h100-measured",
        include_str!("../../../sim/machines/4x-h100-measured.yaml"),
    ),
    (
        "4x-h200-measured",
        include_str!("../../../sim/machines/4x-h200-measured.yaml"),
    ),
];

/// The shipped measured profiles (those that parse: each is checked by a test).
pub fn profiles() -> Vec<Machine> {
    PROFILES
        .iter()
        .filter_map(|(name, text)| Machine::from_yaml(text, name).ok())
        .collect()
}

/// One table a profile took from a shipped one.
#[derive(Clone, Debug, PartialEq)]
pub struct Adopted {
    /// The shipped profile (`4x-h100-measured`).
    pub from: String,
    /// When it was measured.
    pub date: Option<String>,
    /// `flux-dev bf16 on NVIDIA H100 80GB HBM3`.
    pub table: String,
    /// Whether its collectives came with it.
    pub collectives: bool,
    /// Scaled from another GPU's tables: `(that GPU's name, bf16 rate ratio, bandwidth
    /// ratio)`, this device's over that one's.
    pub scaled: Option<(String, f64, f64)>,
}

impl Adopted {
    /// `flux-dev bf16 on NVIDIA H100 80GB HBM3 from 4x-h100-measured (2026-11-27, collectives
    /// included)`.
    pub fn describe(&self) -> String {
        let date = self.date.as_deref().unwrap_or("undated");
        if let Some((src, f, b)) = &self.scaled {
            return format!(
                "{} scaled by spec sheet from {src} in {} ({date}: bf16 rate x{f:.2}, bandwidth x{b:.2}; collectives from the link model)",
                self.table, self.from
            );
        }
        format!(
            "{} from {} ({date}{})",
            self.table,
            self.from,
            if self.collectives {
                ", collectives included"
            } else {
                "; collectives from the link model: the box's links differ"
            }
        )
    }
}

/// How many devices of `m` are named `name`.
fn count(m: &Machine, name: &str) -> usize {
    m.devices.iter().filter(|d| d.name == name).count()
}

/// Whether `src`'s tables for devices named `name` were measured on at least `n` of them:
/// the layouts and groups of a larger box (six or eight GPUs) are not in them, and pricing
/// those from the peak-rate model beside measured ones would favour them.
fn covers(src: &Machine, name: &str, n: usize) -> bool {
    count(src, name) >= n
}

/// The shipped GPUs' figures as `mold devices` estimates them from the driver's counts
/// (SMs × clock × dense rate × 0.75; memory clock × bus width): spec-sheet scaling
/// compares a box's estimates with these, like with like, not with the measured figures
/// of the shipped profile. `(name, bf16 TFLOP/s, GB/s)`.
const ESTIMATES: &[(&str, f64, f64)] = &[
    // 132 SMs at 1980 MHz, 4096 bf16 FLOPs per clock per SM; 2619 MHz × 5120 bits.
    ("NVIDIA H100 80GB HBM3", 802.9, 3352.3),
];

/// A shipped GPU's bf16 rate and bandwidth to scale from: its estimates ([`ESTIMATES`])
/// where listed, else its profile's figures; `None` for a figure that is not positive.
fn figures(src: &crate::Device) -> (Option<f64>, Option<f64>) {
    let (f, b) = ESTIMATES
        .iter()
        .find(|e| e.0 == src.name)
        .map(|e| (e.1, e.2))
        .unwrap_or((src.bf16_tflops, src.mem_bandwidth_gbps));
    let ok = |x: f64| (x.is_finite() && x > 0.0).then_some(x);
    (ok(f), ok(b))
}

/// The kind of the peer domain holding every device of `m` named `name`, and its size;
/// `None` when they are not all in one domain.
fn domain_of(m: &Machine, name: &str) -> Option<(LinkKind, usize)> {
    let ids: Vec<_> = m
        .devices
        .iter()
        .filter(|d| d.name == name)
        .map(|d| &d.id)
        .collect();
    m.links
        .peer
        .iter()
        .find(|p| ids.iter().all(|id| p.devices.contains(id)))
        .map(|p| (p.kind, p.devices.len()))
}

impl Machine {
    /// Adds, for each device name of this machine, the operation tables `from` holds for
    /// it that this machine has none of (the same model, dtype and device name), the
    /// collectives only where the links match (module doc). Returns what it added.
    pub fn adopt_tables(&mut self, from: &[Machine]) -> Vec<Adopted> {
        let mut added = Vec::new();
        for src in from {
            for t in &src.ops {
                if !self.devices.iter().any(|d| d.name == t.device)
                    || self.op_tables(&t.model, t.dtype, &t.device).is_some()
                    || !covers(src, &t.device, count(self, &t.device))
                {
                    continue;
                }
                // The groups the box's domain can hold, where its links are of the kind
                // measured; none elsewhere.
                let fits = match (domain_of(self, &t.device), domain_of(src, &t.device)) {
                    (Some((kind, size)), Some((src_kind, _))) if kind == src_kind => size,
                    _ => 0,
                };
                let mut t = t.clone();
                for l in [
                    &mut t.collectives.all_reduce,
                    &mut t.collectives.all_gather,
                    &mut t.collectives.all_to_all,
                ] {
                    l.retain(|p| p.devices as usize <= fits);
                }
                let collectives = !t.collectives.all_reduce.is_empty();
                // The copy beside compute is the measured box's host's, not this one's.
                t.htod_busy_ratio = None;
                added.push(Adopted {
                    from: src.name.clone(),
                    date: src.calibration.date.clone(),
                    table: format!("{} {} on {}", t.model, t.dtype, t.device),
                    collectives,
                    scaled: None,
                });
                self.ops.push(t);
            }
        }
        // Device names still without a table of a model and dtype some shipped profile
        // measured: that table scaled by spec sheet.
        let names: Vec<String> = {
            let mut v: Vec<String> = self.devices.iter().map(|d| d.name.clone()).collect();
            v.sort();
            v.dedup();
            v
        };
        for name in names {
            let Some(dst) = self.devices.iter().find(|d| d.name == name).cloned() else {
                continue;
            };
            for src in from {
                for t in &src.ops {
                    if self.op_tables(&t.model, t.dtype, &name).is_some() {
                        continue;
                    }
                    let Some(sd) = src.devices.iter().find(|d| d.name == t.device) else {
                        continue;
                    };
                    if !covers(src, &t.device, count(self, &name)) {
                        continue;
                    }
                    // FP8 products run as FP8 only on GPUs with FP8 tensor cores (compute
                    // capability 8.9 and later); elsewhere they run weight-only, at about
                    // the bf16 rate: no FP8 table is estimated for those, nor for a GPU of
                    // unknown capability.
                    if t.dtype == mold_plan::DType::Fp8 && !fp8_products(&dst) {
                        continue;
                    }
                    let Some(mut scaled) = scaled(t, sd, &dst) else {
                        continue;
                    };
                    scaled.estimated = Some(format!(
                        "scaled by spec sheet from {} ({}, {})",
                        t.device,
                        src.name,
                        src.calibration.date.as_deref().unwrap_or("undated")
                    ));
                    // The element-wise kernels and the layout copies run in bf16 whatever
                    // the products' dtype: where this GPU has a measured table of the
                    // model, its rates stand, so the two dtypes are priced alike there.
                    if let Some(own) = self
                        .ops
                        .iter()
                        .find(|o| o.model == t.model && o.device == name && o.estimated.is_none())
                    {
                        scaled.elementwise_gbps = own.elementwise_gbps;
                        scaled.layout_copy_gbps = own.layout_copy_gbps;
                    }
                    added.push(Adopted {
                        from: src.name.clone(),
                        date: src.calibration.date.clone(),
                        table: format!("{} {} on {}", t.model, t.dtype, name),
                        collectives: false,
                        scaled: Some((
                            t.device.clone(),
                            figures(sd).0.map_or(0.0, |f| dst.bf16_tflops / f),
                            figures(sd).1.map_or(0.0, |b| dst.mem_bandwidth_gbps / b),
                        )),
                    });
                    self.ops.push(scaled);
                }
            }
        }
        added
    }
}

/// Whether `d` multiplies FP8 in tensor cores: compute capability 8.9 (Ada) or later, as
/// its profile records it.
pub fn fp8_products(d: &crate::Device) -> bool {
    capability(d).is_some_and(|c| c >= (8, 9))
}

/// Whether `d` runs cuDNN's FP8 flash attention: compute capability 9.0 (Hopper) or later.
pub fn fp8_attention(d: &crate::Device) -> bool {
    capability(d).is_some_and(|c| c >= (9, 0))
}

fn capability(d: &crate::Device) -> Option<(u32, u32)> {
    let cc = d.compute_capability.as_deref()?;
    let mut parts = cc.trim().splitn(2, '.');
    let major = parts.next()?.parse::<u32>().ok()?;
    let minor = parts.next().map_or(Some(0), |x| x.parse::<u32>().ok())?;
    Some((major, minor))
}

/// `t`, measured on `src`, as a spec-sheet estimate for `dst`: each time scaled by how
/// much slower `dst` is at what bounds it (module doc), the collectives and the copy
/// beside compute left out (they depend on links and host, not on the GPU), the libraries'
/// memory and the first-use times kept. `None` where a figure is missing or not positive.
pub fn scaled(
    t: &crate::OpTables,
    src: &crate::Device,
    dst: &crate::Device,
) -> Option<crate::OpTables> {
    let ok = |x: f64| x.is_finite() && x > 0.0;
    let (Some(fs), Some(bs)) = figures(src) else {
        return None;
    };
    let (fd, bd) = (dst.bf16_tflops, dst.mem_bandwidth_gbps);
    if ![fs, fd, bs, bd].into_iter().all(ok) {
        return None;
    }
    let (by_rate, by_bandwidth) = (fs / fd, bs / bd);
    // FLOPs per byte where the measured GPU turns from memory- to compute-bound.
    let ridge = fs * 1e12 / (bs * 1e9);
    let mut out = t.clone();
    out.device = dst.name.clone();
    for g in &mut out.gemm {
        let (m, n, k) = (g.m as f64, g.n as f64, g.k as f64);
        let intensity = 2.0 * m * n * k / (2.0 * (m * k + n * k + m * n));
        g.seconds *= if intensity >= ridge {
            by_rate
        } else {
            by_bandwidth
        };
    }
    for a in &mut out.attention {
        a.seconds *= by_rate;
    }
    // cuDNN's FP8 attention runs on Hopper and later: elsewhere the executor runs the
    // table's attention instead, and the cost model prices that.
    if fp8_attention(dst) {
        for a in &mut out.fp8_attention {
            a.seconds *= by_rate;
        }
    } else {
        out.fp8_attention.clear();
    }
    out.elementwise_gbps /= by_bandwidth;
    out.layout_copy_gbps = out.layout_copy_gbps.map(|g| g / by_bandwidth);
    for c in &mut out.components {
        c.seconds *= by_rate;
    }
    out.collectives = Default::default();
    out.htod_busy_ratio = None;
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::PeerDomain;
    use mold_plan::DeviceId;

    fn shipped_h100() -> Machine {
        profiles()
            .into_iter()
            .find(|m| m.name == "4x-h100-measured")
            .unwrap()
    }

    #[test]
    fn every_shipped_profile_parses_and_has_tables() {
        assert_eq!(profiles().len(), PROFILES.len());
        for m in profiles() {
            assert!(!m.ops.is_empty(), "{} ships no tables", m.name);
            assert_eq!(m.calibration.source, "measured");
        }
    }

    /// A two-GPU H100 box with its own links, as an inventory would give it.
    fn two_h100(kind: LinkKind) -> Machine {
        let mut m = shipped_h100();
        m.name = "local".into();
        m.ops.clear();
        m.devices.truncate(2);
        m.links.peer = vec![PeerDomain {
            devices: vec![DeviceId::Cuda(0), DeviceId::Cuda(1)],
            kind,
            gbps: 300.0,
            allreduce: m.links.peer[0].allreduce,
        }];
        m
    }

    #[test]
    fn a_box_of_the_same_gpus_adopts_their_tables() {
        let mut m = two_h100(LinkKind::Nvlink);
        let added = m.adopt_tables(&profiles());
        // flux-dev in bf16 and in FP8, measured on H100s; qwen-image's, measured on H200s
        // only, scaled from there.
        assert_eq!(added.len(), 4, "{added:?}");
        assert!(added[..2].iter().all(|a| a.scaled.is_none()));
        assert!(added[2..]
            .iter()
            .all(|a| a.from == "4x-h200-measured" && a.scaled.is_some()));
        assert!(m
            .op_tables("flux-dev", mold_plan::DType::Fp8, "NVIDIA H100 80GB HBM3")
            .is_some());
        let t = m
            .op_tables("flux-dev", mold_plan::DType::Bf16, "NVIDIA H100 80GB HBM3")
            .unwrap();
        assert!(!t.gemm.is_empty());
        // Measured over 2, 3 and 4 GPUs; this box's NVLink domain holds 2.
        assert!(added[0].collectives);
        assert!(t.collectives.all_reduce.iter().all(|p| p.devices == 2));
        assert!(t.collectives.all_to_all.iter().any(|p| p.devices == 2));
        // Adopting again adds nothing; a box's own tables are never replaced.
        assert!(m.adopt_tables(&profiles()).is_empty());
    }

    /// A two-GPU H200 box adopts the bf16 and FP8 tables measured on H200s (not the
    /// H100's scaled), with their layout-copy rate and their collectives over two.
    #[test]
    fn an_h200_box_adopts_the_measured_h200_tables() {
        let src = profiles()
            .into_iter()
            .find(|m| m.name == "4x-h200-measured")
            .unwrap();
        let mut m = src.clone();
        m.name = "local".into();
        m.ops.clear();
        m.devices.truncate(2);
        m.links.peer[0].devices.truncate(2);
        let added = m.adopt_tables(&profiles());
        // flux-dev and qwen-image, bf16 and FP8, all measured on H200s.
        assert_eq!(added.len(), 4, "{added:?}");
        assert!(added
            .iter()
            .all(|a| a.from == "4x-h200-measured" && a.scaled.is_none()));
        assert_eq!(added[0].from, "4x-h200-measured");
        assert!(added[0].scaled.is_none() && added[0].collectives);
        assert_eq!(added[1].table, "flux-dev fp8 on NVIDIA H200");
        assert_eq!(added[1].from, "4x-h200-measured");
        assert!(added[1].scaled.is_none());
        // Both measured, none estimated.
        let fp8 = m
            .op_tables("flux-dev", mold_plan::DType::Fp8, "NVIDIA H200")
            .unwrap();
        let bf16 = m
            .op_tables("flux-dev", mold_plan::DType::Bf16, "NVIDIA H200")
            .unwrap();
        assert!(fp8.estimated.is_none());
        assert!(bf16.estimated.is_none());
        assert!(bf16.layout_copy_gbps.is_some_and(|g| g > 0.0));
        assert!(bf16.collectives.all_reduce.iter().all(|p| p.devices == 2));
    }

    #[test]
    fn collectives_come_only_over_the_same_kind_of_link() {
        let src = shipped_h100();
        let mut nv = src.clone();
        nv.name = "local".into();
        nv.ops.clear();
        let added = nv.adopt_tables(&profiles());
        assert!(added[0].collectives, "{added:?}");
        assert!(!nv.ops[0].collectives.all_reduce.is_empty());
        let mut pcie = src;
        pcie.name = "local".into();
        pcie.ops.clear();
        for p in &mut pcie.links.peer {
            p.kind = LinkKind::Pcie;
        }
        let added = pcie.adopt_tables(&profiles());
        assert!(!added[0].collectives);
        assert!(added[0].describe().contains("link model"));
    }

    /// A GPU without FP8 tensor cores (an A100, sm_80), or one whose capability the profile
    /// does not say, gets the bf16 table scaled, never an FP8 one.
    #[test]
    fn fp8_tables_go_only_to_gpus_with_fp8_products() {
        for cc in [Some("8.0"), Some("8.6"), None] {
            let mut m = two_h100(LinkKind::Pcie);
            for d in &mut m.devices {
                d.name = "NVIDIA A100-SXM4-80GB".into();
                d.bf16_tflops /= 3.0;
                d.compute_capability = cc.map(String::from);
            }
            let added = m.adopt_tables(&profiles());
            // flux-dev's and qwen-image's bf16 tables.
            assert_eq!(added.len(), 2, "{cc:?}: {added:?}");
            assert!(
                added.iter().all(|a| a.table.contains(" bf16 ")),
                "{added:?}"
            );
            assert!(m
                .op_tables("flux-dev", mold_plan::DType::Fp8, "NVIDIA A100-SXM4-80GB")
                .is_none());
        }
        let d = |cc: &str| crate::Device {
            compute_capability: Some(cc.into()),
            ..shipped_h100().devices[0].clone()
        };
        assert!(fp8_products(&d("9.0")) && fp8_products(&d("8.9")) && fp8_products(&d("12.0")));
        assert!(!fp8_products(&d("8.6")) && !fp8_products(&d("x")) && !fp8_products(&d("")));
    }

    #[test]
    fn a_box_larger_than_the_measured_one_adopts_nothing() {
        let mut m = shipped_h100();
        m.name = "local".into();
        m.ops.clear();
        let mut more = m.devices.clone();
        for (i, d) in more.iter_mut().enumerate() {
            d.id = DeviceId::Cuda(4 + i as u32);
        }
        m.devices.extend(more);
        assert!(m.adopt_tables(&profiles()).is_empty());
    }

    #[test]
    fn other_gpus_get_the_tables_scaled_by_spec_sheet() {
        let src = shipped_h100();
        let mut m = two_h100(LinkKind::Pcie);
        for d in &mut m.devices {
            d.name = "NVIDIA L40S".into();
            d.bf16_tflops /= 3.0;
            d.mem_bandwidth_gbps /= 4.0;
            d.compute_capability = Some("8.9".into());
        }
        let added = m.adopt_tables(&profiles());
        // bf16 and FP8 of both models: an L40S multiplies FP8 in tensor cores.
        assert_eq!(added.len(), 4, "{added:?}");
        assert!(
            added[0].describe().contains("scaled by spec sheet"),
            "{}",
            added[0].describe()
        );
        let h = &src.ops[0];
        let l = m
            .op_tables("flux-dev", mold_plan::DType::Bf16, "NVIDIA L40S")
            .unwrap();
        // A large product (compute-bound) by the rate, a one-row one (bound by reading
        // its weights) by the bandwidth; element-wise by the bandwidth.
        let big = h.gemm.iter().max_by_key(|g| g.m * g.n * g.k).unwrap();
        let at = |t: &crate::OpTables, g: &crate::GemmPoint| {
            t.gemm
                .iter()
                .find(|x| (x.m, x.n, x.k) == (g.m, g.n, g.k))
                .unwrap()
                .seconds
        };
        let r = |a: f64, b: f64| (a / b - 1.0).abs() < 1e-9;
        // Scaled from the H100's estimates ([`ESTIMATES`]), like the box's own figures.
        let (f, b) = figures(&src.devices[0]);
        let rate = f.unwrap() / m.devices[0].bf16_tflops;
        let bw = b.unwrap() / m.devices[0].mem_bandwidth_gbps;
        assert!(r(at(l, big) / at(h, big), rate));
        let thin = h.gemm.iter().find(|g| g.m == 1).unwrap();
        assert!(r(at(l, thin) / at(h, thin), bw));
        assert!(r(h.elementwise_gbps / l.elementwise_gbps, bw));
        let t5 = |t: &crate::OpTables| {
            t.components
                .iter()
                .find(|c| c.component == "t5")
                .unwrap()
                .seconds
        };
        assert!(r(t5(l) / t5(h), rate));
        assert!(l.collectives.all_reduce.is_empty() && l.htod_busy_ratio.is_none());
        assert!(l
            .estimated
            .as_deref()
            .unwrap()
            .starts_with("scaled by spec sheet"));
        // A device without positive figures gets nothing.
        let mut z = two_h100(LinkKind::Pcie);
        for d in &mut z.devices {
            d.name = "Some GPU".into();
            d.bf16_tflops = 0.0;
        }
        assert!(z.adopt_tables(&profiles()).is_empty());
    }
}
