//! Operation tables mold ships: measured on lent boxes by `mold devices --calibrate
//! --model M` (`sim/machines/*-measured.yaml`, each with its box, date and commit in its
//! description), built into the binary. A profile built from a box's inventory (`--machine
//! local`) adopts the tables of the GPUs it has ([`Machine::adopt_tables`]), so a box
//! nobody calibrated is priced from measurement; `mold devices --calibrate` measures the
//! box's own and never adopts.
//!
//! A GPU's products, attention, element-wise kernels, encoders and decoder are the GPU's
//! own and travel with its name. Its collectives depend on the links between the GPUs:
//! they are adopted only where the box's devices of that name share one peer domain of
//! the same kind (NVLink, PCIe) as the measured box's, for the group sizes that domain
//! holds; elsewhere the profile's link model prices them.

use crate::{LinkKind, Machine};

/// The measured profiles mold carries: `(name, YAML)`.
const PROFILES: &[(&str, &str)] = &[(
    "4x-h100-measured",
    include_str!("../../../sim/machines/4x-h100-measured.yaml"),
)];

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
}

impl Adopted {
    /// `flux-dev bf16 on NVIDIA H100 80GB HBM3 from 4x-h100-measured (2026-11-27, collectives
    /// included)`.
    pub fn describe(&self) -> String {
        format!(
            "{} from {} ({}{})",
            self.table,
            self.from,
            self.date.as_deref().unwrap_or("undated"),
            if self.collectives {
                ", collectives included"
            } else {
                "; collectives from the link model: the box's links differ"
            }
        )
    }
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
                added.push(Adopted {
                    from: src.name.clone(),
                    date: src.calibration.date.clone(),
                    table: format!("{} {} on {}", t.model, t.dtype, t.device),
                    collectives,
                });
                self.ops.push(t);
            }
        }
        added
    }
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
        assert_eq!(added.len(), 1, "{added:?}");
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

    #[test]
    fn other_gpus_adopt_nothing() {
        let mut m = two_h100(LinkKind::Nvlink);
        for d in &mut m.devices {
            d.name = "NVIDIA L40S".into();
        }
        assert!(m.adopt_tables(&profiles()).is_empty());
        assert!(m.ops.is_empty());
    }
}
