//! The request from start to end: encoders, the denoising steps (each pass of each
//! placement, CFG's replicas and micro-batches), the decoder.

use super::{PassRun, Sim, SIMULATED_STEPS};
use crate::text::{gbps_text, human};
use crate::{EventKind, Lane, SimReport};
use mold_plan::{CfgMode, ComponentRole, DeviceId, Plan};

impl<'a> Sim<'a> {
    pub(super) fn run(&mut self) -> SimReport {
        let mode = self.plan.cfg_mode();
        // The placements that run passes: under CFG-parallel both replicas (the
        // conditional one runs the encoders and the VAE), else the plan as written.
        let placements: Vec<Plan> = match mode {
            Some(CfgMode::Parallel) => self
                .plan
                .replica_plans()
                .unwrap_or_else(|_| vec![self.plan.clone()]),
            _ => vec![self.plan.clone()],
        };
        let plan = &placements[0];
        let components = self.load_components(plan);
        let mut transformer_allocs = Vec::new();
        for p in &placements {
            if let Some(tc) = p.transformer() {
                transformer_allocs.extend(self.load_transformer(tc));
            }
        }
        self.load_libraries();
        self.host_ram += self.host_pinned;

        // Encode: each encoder on its device, then its conditioning to the
        // transformer's first devices (each replica's under CFG-parallel).
        let mut first: Vec<DeviceId> = Vec::new();
        for p in &placements {
            if let Some(t) = p.transformer() {
                for d in &t.parts[0].devices {
                    if !first.contains(d) {
                        first.push(d.clone());
                    }
                }
            }
        }
        let mut encoded = 0.0f64;
        let mut cond_ready = vec![0.0f64; self.devs.len()];
        let mut cond_allocs: Vec<usize> = Vec::new();
        for c in &plan.components {
            if c.role != ComponentRole::Encoder {
                continue;
            }
            let spec = self.model.component(&c.name).expect("validated");
            let on_id = c.parts[0].devices[0].clone();
            let on = self.di(&on_id);
            let start = self.devs[on].compute;
            let end = start + self.ctx.component_s(spec, &on_id, c.dtype);
            self.devs[on].compute = end;
            encoded = encoded.max(end);
            let phase = format!("encode: {}", c.name);
            self.event(
                on,
                Lane::Compute,
                EventKind::Encoder,
                start,
                end,
                c.name.clone(),
                &phase,
            );
            let act = self.ctx.component_activation(spec, c.dtype);
            self.alloc(
                on,
                start,
                Some(end),
                act,
                format!("{} activations", c.name),
                &phase,
            );
            let bytes = self.conditioning_bytes(&c.name, c.dtype);
            for d in &first {
                let di = self.di(d);
                let (s, e) = if d == &on_id {
                    (end, end)
                } else {
                    let g = self.machine.transfer_gbps(&on_id, d);
                    let s = end.max(self.devs[di].comm);
                    let e = s + self.machine.transfer_s(&on_id, d, bytes);
                    self.devs[di].comm = e;
                    let what = format!(
                        "conditioning from {} ({}, {} from {})",
                        c.name,
                        human(bytes),
                        gbps_text(g),
                        on_id
                    );
                    self.event(di, Lane::Comm, EventKind::Transfer, s, e, what, "encode");
                    (s, e)
                };
                cond_ready[di] = cond_ready[di].max(e);
                if self.opts.transfer_buffers && bytes > 0 && di != self.host() {
                    cond_allocs.push(self.allocs.len());
                    self.alloc(
                        di,
                        s,
                        None,
                        bytes,
                        format!("conditioning from {}", c.name),
                        &phase,
                    );
                }
            }
        }

        let steps = plan.workload.steps;
        let sim_steps = steps.min(SIMULATED_STEPS);
        let mut denoise_start = 0.0f64;
        let mut step_ends: Vec<f64> = Vec::new();
        let mut last_group: Vec<DeviceId> = first.clone();
        let mut ready = cond_ready.clone();
        let mut runs: Vec<PassRun> = placements
            .iter()
            .filter_map(|p| p.transformer())
            .map(PassRun::new)
            .collect();
        if !runs.is_empty() {
            denoise_start = first
                .iter()
                .map(|d| cond_ready[self.di(d)])
                .fold(0.0, f64::max);
            for d in &first {
                let i = self.di(d);
                ready[i] = denoise_start;
            }
            for r in runs.iter_mut() {
                for g in r.streams.iter_mut() {
                    for x in g.gate.iter_mut() {
                        *x = denoise_start;
                    }
                }
            }
            let latent = self.latent_bytes();
            last_group = runs[0].tc.parts.last().unwrap().devices.clone();
            for s in 1..=sim_steps {
                // The step's input: the latents, back on each placement's first devices.
                if s > 1 {
                    for r in &runs {
                        let to = r.tc.parts[0].devices.clone();
                        let phase = format!("step {s}, part 1");
                        self.step_input(&last_group, &to, latent, &mut ready, &phase);
                    }
                }
                match mode {
                    None => self.pass(&mut runs[0], s, "", &mut ready),
                    Some(CfgMode::Serial) => {
                        self.pass(&mut runs[0], s, "cond", &mut ready);
                        // The unconditional pass starts when the conditional one ends.
                        let end = self.end_of(&last_group, &ready);
                        for d in &runs[0].tc.parts[0].devices {
                            let i = self.di(d);
                            ready[i] = ready[i].max(end);
                        }
                        self.pass(&mut runs[0], s, "uncond", &mut ready);
                    }
                    Some(CfgMode::Pipelined) => {
                        // Two micro-batches, each with its own inputs' readiness; the
                        // devices' streams order them.
                        let mut second = ready.clone();
                        self.pass(&mut runs[0], s, "mb0", &mut ready);
                        self.pass(&mut runs[0], s, "mb1", &mut second);
                        for (r, x) in ready.iter_mut().zip(second) {
                            *r = r.max(x);
                        }
                    }
                    Some(CfgMode::Parallel) => {
                        self.pass(&mut runs[0], s, "cond", &mut ready);
                        if runs.len() > 1 {
                            self.pass(&mut runs[1], s, "uncond", &mut ready);
                            let from = runs[1].tc.parts.last().unwrap().devices[0].clone();
                            let to = last_group[0].clone();
                            self.combine(&from, &to, latent, s, &mut ready);
                        }
                    }
                }
                step_ends.push(self.end_of(&last_group, &ready));
            }
        }
        let denoise_end = step_ends.last().copied().unwrap_or(denoise_start);
        for i in cond_allocs {
            self.allocs[i].end = Some(denoise_end);
        }
        self.phase_allocs(
            (&components.0, &components.1),
            &transformer_allocs,
            encoded,
            denoise_end,
        );

        // Decode: latents to the VAE's device, then the VAE.
        let mut sim_end = denoise_end;
        for c in &plan.components {
            if c.role != ComponentRole::Vae {
                continue;
            }
            let spec = self.model.component(&c.name).expect("validated");
            // The first band's device receives the latents (the one device of a one-device
            // decode); every band's device decodes from when they are there.
            let bands = &c.parts[0].devices;
            let on_id = bands[0].clone();
            let on = self.di(&on_id);
            let phase = format!("decode: {}", c.name);
            let latent = self.latent_bytes();
            let arrive = if plan.transformer().is_none() || last_group.contains(&on_id) {
                denoise_end
            } else {
                let (src, g) = self.best_source(&last_group, &on_id);
                let s = denoise_end.max(self.devs[on].comm);
                let e = s + latent as f64 / (g * 1e9);
                self.devs[on].comm = e;
                let what = format!("latents from {src} ({}, {})", human(latent), gbps_text(g));
                self.event(on, Lane::Comm, EventKind::Transfer, s, e, what, &phase);
                e
            };
            let start = bands
                .iter()
                .map(|d| self.devs[self.di(d)].compute)
                .fold(arrive, f64::max);
            let end = start + self.ctx.decode_bands_s(spec, bands, c.dtype);
            let act = self
                .ctx
                .component_activation(spec, c.dtype)
                .div_ceil(bands.len() as u64);
            let what = if bands.len() > 1 {
                format!("{} (band of {})", c.name, bands.len())
            } else {
                c.name.clone()
            };
            for d in bands {
                let i = self.di(d);
                self.devs[i].compute = end;
                self.event(
                    i,
                    Lane::Compute,
                    EventKind::Vae,
                    start,
                    end,
                    what.clone(),
                    &phase,
                );
            }
            if self.opts.transfer_buffers {
                self.alloc(
                    on,
                    denoise_end.min(arrive),
                    Some(end),
                    latent,
                    "latents".into(),
                    &phase,
                );
            }
            for d in bands {
                let i = self.di(d);
                self.alloc(
                    i,
                    start,
                    Some(end),
                    act,
                    format!("{} activations", c.name),
                    &phase,
                );
            }
            sim_end = sim_end.max(end);
        }
        for s in &self.devs {
            sim_end = sim_end.max(s.compute).max(s.copy).max(s.comm);
        }
        self.finish(denoise_start, step_ends, sim_end, sim_steps)
    }

    /// When the last of `devices` is ready.
    pub(super) fn end_of(&self, devices: &[DeviceId], ready: &[f64]) -> f64 {
        devices
            .iter()
            .map(|d| ready[self.di(d)])
            .fold(0.0, f64::max)
    }
}
