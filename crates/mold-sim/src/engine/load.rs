//! Loading: the components' and the transformer's weights, stream buffers, stem and
//! pinned host memory, the CUDA libraries, and when each is live in a one-shot run.

use super::{Sim, LIBRARIES};
use crate::text::{human, list};
use crate::Live;
use mold_cost::Group;
use mold_plan::{ComponentPlan, ComponentRole, MemoryPhases, Plan, Residency};

impl<'a> Sim<'a> {
    /// Components' weights (the encoders' first, then the VAE's, as allocation
    /// indices) and host memory: loaded at the start (see [`Sim::phase_allocs`]).
    pub(super) fn load_components(&mut self, plan: &Plan) -> (Vec<usize>, Vec<usize>) {
        let (mut encoders, mut vaes) = (Vec::new(), Vec::new());
        for c in &plan.components {
            if c.role == ComponentRole::Transformer {
                continue;
            }
            let spec = self.model.component(&c.name).expect("validated");
            let w = spec.weight_bytes(c.dtype);
            // One device, or a VAE's row bands: its weights on each band's device.
            for id in &c.parts[0].devices {
                let on = self.di(id);
                if on == self.host() {
                    let act = self.ctx.component_activation(spec, c.dtype);
                    self.host_ram += w + act;
                    self.host_ram_items.push(crate::Live {
                        what: format!("{} weights and activations", c.name),
                        bytes: w + act,
                    });
                } else {
                    self.weights[on] += w;
                    match c.role {
                        ComponentRole::Encoder => encoders.push(self.allocs.len()),
                        _ => vaes.push(self.allocs.len()),
                    }
                    self.alloc(on, 0.0, None, w, format!("{} weights", c.name), "load");
                }
            }
        }
        (encoders, vaes)
    }

    /// A transformer placement's resident blocks, stream buffers, stem and pinned host
    /// memory; the allocations' indices.
    pub(super) fn load_transformer(&mut self, tc: &ComponentPlan) -> Vec<usize> {
        let first = self.allocs.len();
        let dtype = tc.dtype;
        let n = self.devs.len();
        let mut resident = vec![0u64; n];
        let mut resident_ranges: Vec<Vec<String>> = vec![Vec::new(); n];
        let mut groups: Vec<Group> = Vec::new();
        let mut group_buffers: Vec<(u64, u32, u64)> = Vec::new();
        for (pi, p) in tc.parts.iter().enumerate() {
            let group = Group::of(p);
            let gi = match groups.iter().position(|g| g == &group) {
                Some(i) => i,
                None => {
                    groups.push(group.clone());
                    group_buffers.push((0, 0, 0));
                    groups.len() - 1
                }
            };
            let mut largest = 0u64;
            for r in &p.blocks {
                let info = self.info(&r.kind, &group, dtype);
                let wb = info.cost.weight_bytes;
                match p.residency {
                    Residency::Resident => {
                        for d in &p.devices {
                            let i = self.di(d);
                            resident[i] += r.len() as u64 * wb;
                            resident_ranges[i].push(r.to_string());
                        }
                    }
                    Residency::Streamed => {
                        largest = largest.max(wb);
                        let bytes = r.len() as u64 * wb * p.devices.len() as u64;
                        self.host_pinned += bytes;
                        self.streamed_per_step += bytes;
                        self.pinned_parts.push(Live {
                            what: format!(
                                "streamed weights of part {} ({r} on {})",
                                pi + 1,
                                list(&p.devices)
                            ),
                            bytes,
                        });
                    }
                }
            }
            let set = p.buffers() as u64 * largest;
            if set > group_buffers[gi].0 {
                group_buffers[gi] = (set, p.buffers(), largest);
            }
        }
        let stem = self.model.transformer.stem_bytes(dtype);
        for i in 0..n {
            if resident[i] > 0 {
                self.weights[i] += resident[i];
                let what = format!("transformer blocks {}", resident_ranges[i].join(", "));
                self.alloc(i, 0.0, None, resident[i], what, "load");
            }
        }
        for (g, (set, count, each)) in groups.iter().zip(group_buffers) {
            for d in &g.devices {
                let i = self.di(d);
                if set > 0 {
                    self.buffers[i] += set;
                    let what = format!("stream buffers ({count} × {})", human(each));
                    self.alloc(i, 0.0, None, set, what, "load");
                }
            }
        }
        let mut stemmed = vec![false; n];
        for g in &groups {
            for d in &g.devices {
                let i = self.di(d);
                if !stemmed[i] {
                    stemmed[i] = true;
                    self.weights[i] += stem;
                    self.alloc(i, 0.0, None, stem, "transformer stem".into(), "load");
                }
            }
        }
        (first..self.allocs.len()).collect()
    }

    /// The CUDA libraries' device memory where the profile measured it
    /// ([`mold_cost::plan_libraries`], what the cost model adds to every phase): live from
    /// the start to the end of the request on each device the plan uses.
    pub(super) fn load_libraries(&mut self) {
        let libraries = mold_cost::plan_libraries(self.plan, &self.ctx);
        for (i, bytes) in libraries.into_iter().enumerate() {
            self.alloc(i, 0.0, None, bytes, LIBRARIES.into(), "load");
        }
    }

    /// One-shot phases: encoders' weights live until `encoded`, the transformer's from
    /// then until `denoised`, the VAE's from then on; resident, all for the whole run.
    pub(super) fn phase_allocs(
        &mut self,
        (encoders, vaes): (&[usize], &[usize]),
        transformer: &[usize],
        encoded: f64,
        denoised: f64,
    ) {
        if self.plan.memory_phases != MemoryPhases::OneShot {
            return;
        }
        for &i in encoders {
            self.allocs[i].end = Some(encoded);
        }
        for &i in transformer {
            self.allocs[i].start = encoded;
            self.allocs[i].end = Some(denoised);
        }
        for &i in vaes {
            self.allocs[i].start = denoised;
        }
    }
}
