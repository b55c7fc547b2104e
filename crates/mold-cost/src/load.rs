//! Loading a plan's weights, as a one-shot `mold exec` does it (`mold-exec`'s
//! `staging.rs`, `executor/read_resident.rs`, `executor/copy_out.rs`), priced from the
//! machine profile:
//!
//! - each component and each transformer part loads after the one before it;
//! - a slice read for a GPU goes from the page cache through page-locked buffers to the
//!   device, at the host's read rate ([`mold_machine::Host::read_gbps`], all cores) or the
//!   device's page-locked upload rate, whichever is lower;
//! - a part's reading ranks (a tensor-parallel group's shards) read at once and share the
//!   host's read rate; each uploads its own shard;
//! - the other ranks of a sequence-parallel group on one peer domain get each block by peer
//!   copy while the reading goes on: the part takes the longest of the reading, the uploads
//!   and the reading rank's copies out over its links; without peer access every rank reads;
//! - streamed blocks are read into host memory only (the device gets them per step).
//!
//! The stem is read once and uploaded from pageable memory to each rank of the first part;
//! the final layer likewise to the last part's first rank. What the host does to a slice
//! besides copying it (an FP8 quantization, a LoRA merged in) is not priced, nor a cold page
//! cache (the disk's rate).

use crate::{Ctx, Group};
use mold_plan::{CfgMode, ComponentRole, DeviceId, Plan, Residency};
use serde::Serialize;

/// The page cache's read rate into page-locked memory where the profile has none (GB/s,
/// all cores): a conservative figure for a desktop host. The 16-core host of a lent
/// H100 machine read 19–38 GB/s (BENCHMARKS.md, loading).
pub const DEFAULT_HOST_READ_GBPS: f64 = 10.0;

/// The most bytes of bf16 (or f16) rows a GPU holds at once while its FP8 weights are
/// quantized at load (`mold-exec`'s `staging.rs`, `Stager::window`): each product's rows are
/// staged as stored and quantized there, and a product waits for room in this window, so
/// the several reading threads add at most this much to what is resident (a product larger
/// than the window is quantized alone; every product of the catalogue's transformers fits,
/// `mold-exec` tests it). The cost model charges it as the least activation of a resident FP8
/// block on a GPU ([`crate::Ctx::block`]).
pub const FP8_STAGING_WINDOW_BYTES: u64 = 256 << 20;

/// A one-shot request's loading, by what loads.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct LoadTime {
    /// Each component other than the transformer, in the plan's order: its name and seconds.
    pub components: Vec<(String, f64)>,
    /// The transformer: every part (both replicas' under CFG-parallel), one after another.
    pub transformer_s: f64,
    pub total_s: f64,
}

impl Ctx<'_> {
    /// The host's read rate (GB/s): the profile's, else [`DEFAULT_HOST_READ_GBPS`].
    pub fn host_read_gbps(&self) -> f64 {
        self.machine
            .host
            .read_gbps
            .filter(|g| *g > 0.0)
            .unwrap_or(DEFAULT_HOST_READ_GBPS)
    }

    /// Whether the profile measured the host's read rate (else the default prices loading).
    pub fn host_read_measured(&self) -> bool {
        self.machine.host.read_gbps.is_some_and(|g| g > 0.0)
    }

    /// Seconds to load `bytes` from the page cache onto `on` (the host: into its memory).
    fn load_one_s(&self, bytes: u64, on: &DeviceId) -> f64 {
        let read = self.host_read_gbps();
        let rate = if on.is_host() {
            read
        } else {
            read.min(self.machine.links.host_pinned_gbps.max(f64::MIN_POSITIVE))
        };
        bytes as f64 / (rate * 1e9)
    }
}

/// Prices the loading of `plan` on `ctx`'s machine (see the module's notes).
pub fn load_time(plan: &Plan, ctx: &Ctx) -> LoadTime {
    let model = ctx.model;
    let mut out = LoadTime::default();
    for c in &plan.components {
        if c.role == ComponentRole::Transformer {
            continue;
        }
        let Some(spec) = model.component(&c.name) else {
            continue;
        };
        let w = spec.weight_bytes(c.dtype);
        // A decoder in bands loads its weights on each band's device, one after another.
        let s: f64 = c.parts.first().map_or(0.0, |p| {
            p.devices.iter().map(|d| ctx.load_one_s(w, d)).sum()
        });
        out.components.push((c.name.clone(), s));
    }
    let placements: Vec<Plan> = match plan.cfg_mode() {
        Some(CfgMode::Parallel) => plan.replica_plans().unwrap_or_else(|_| vec![plan.clone()]),
        _ => vec![plan.clone()],
    };
    for tc in placements.iter().filter_map(|p| p.transformer()) {
        let dtype = tc.dtype;
        let stem = model.transformer.stem_bytes(dtype);
        let last = tc.parts.len().saturating_sub(1);
        for (pi, p) in tc.parts.iter().enumerate() {
            let group = Group::of(p);
            // One rank's share of the part's blocks.
            let mut rank_bytes = 0u64;
            for r in &p.blocks {
                let Some((_, kind)) = model.transformer.kind(&r.kind) else {
                    continue;
                };
                let bc = ctx.block(kind, &group, dtype);
                rank_bytes =
                    rank_bytes.saturating_add((r.len() as u64).saturating_mul(bc.weight_bytes));
            }
            let ranks = p.devices.len().max(1) as u64;
            // The stem, read once, uploaded from pageable memory to every rank of the first
            // part; the final layer (about the stem's size) read and uploaded to the last
            // part's first rank.
            let read_rate = ctx.host_read_gbps() * 1e9;
            let pageable = ctx.machine.links.host_pageable_gbps.max(f64::MIN_POSITIVE) * 1e9;
            let mut extra_s = 0.0;
            if pi == 0 {
                extra_s += stem as f64 / read_rate + ranks as f64 * stem as f64 / pageable;
            }
            if pi == last {
                extra_s += stem as f64 / read_rate + stem as f64 / pageable;
            }
            let first = p.devices.first().cloned().unwrap_or(DeviceId::Host);
            let s = match p.residency {
                Residency::Streamed => {
                    rank_bytes.saturating_mul(ranks) as f64 / read_rate + extra_s
                }
                Residency::Resident => {
                    let tp = (p.tp.max(1) as u64).min(ranks);
                    let peers = ranks > tp && ctx.machine.domain_of(&p.devices).is_some();
                    let readers = if peers { tp } else { ranks };
                    let read = readers as f64 * rank_bytes as f64 / read_rate;
                    let upload = rank_bytes as f64
                        / (ctx.machine.links.host_pinned_gbps.max(f64::MIN_POSITIVE) * 1e9);
                    // Each reading rank sends its shard to the other ranks holding it.
                    let copies = if peers {
                        let followers = ranks / tp - 1;
                        let to = p.devices.get(tp as usize).cloned().unwrap_or(first.clone());
                        followers as f64 * ctx.machine.transfer_s(&first, &to, rank_bytes).max(0.0)
                    } else {
                        0.0
                    };
                    read.max(upload).max(copies) + extra_s
                }
            };
            out.transformer_s += s;
        }
    }
    out.total_s = out.components.iter().map(|(_, s)| s).sum::<f64>() + out.transformer_s;
    out
}
