//! Another replica of a loaded transformer, by copying instead of reading: every weight of
//! an [`Executor`] copied device to device onto the devices another replica of the same
//! placement names ([`mold_plan::Plan::replica_plans`]: throughput replicas, CFG-parallel's
//! second pass). Between GPUs with peer access a copy runs over NVLink or PCIe at the
//! link's rate ([`runtime::hand_off`]) where reading the checkpoint again would go through
//! host memory at the page cache's; without peer access it goes through the host.
//!
//! One thread per receiving device queues its ranks' copies on its own stream, then waits
//! for them; the source's weights are complete (its load waited for every device).

use super::plan_check::{check_parts, transformer_of, weights_dtype};
use super::{warm_groups, Executor, PartRt, PartSpec, Rank};
use crate::error::{ExecError, Result};
use crate::model::{ActivationMeter, Packable, Profiler, Transformer, Weights};
use crate::runtime::{self, DeviceMap, Held};
use candle_core::{DType, Device};
use mold_plan::{DeviceId, Plan, Residency};
use std::sync::Mutex;

/// A rank by its part and its index in the part: `(part, rank)`.
type RankAt = (usize, usize);

/// One receiving device's ranks, copied.
type Copied<M> = Vec<(RankAt, Rank<M>)>;

impl<M: Transformer> Executor<M> {
    /// This executor's weights on the devices of `plan`, a replica of the placement it
    /// was loaded for: the same parts, each with the same blocks, layout and number of
    /// devices, every part resident, one process. Refused in one line otherwise (load the
    /// replica from the checkpoint instead).
    pub fn replicate(&self, plan: &Plan) -> Result<Self> {
        let refuse = |why: String| {
            Err(ExecError::Plan(format!(
                "cannot copy the loaded transformer to this replica: {why}; load it from the checkpoint instead"
            )))
        };
        if self.dist.is_some() {
            return refuse("it runs over several processes".into());
        }
        if !self.rings.is_empty() {
            return refuse("it streams blocks from host memory".into());
        }
        let comp = transformer_of(plan)?;
        if comp.parts.len() != self.parts.len() {
            return refuse(format!(
                "{} parts against {}",
                comp.parts.len(),
                self.parts.len()
            ));
        }
        let steps = check_parts(&self.model, &comp.parts)?;
        for (pi, ((p, rt), steps)) in comp.parts.iter().zip(&self.parts).zip(&steps).enumerate() {
            let same = p.devices.len() == rt.devices.len()
                && p.tp as usize == rt.tp
                && p.sp as usize == rt.sp
                && *steps == rt.steps;
            if !same {
                return refuse(format!("part {pi} differs from the loaded one"));
            }
            if p.residency != Residency::Resident {
                return refuse(format!("part {pi} is not resident"));
            }
            if rt.ranks.len() != rt.devices.len() {
                return refuse(format!("part {pi} runs some of its ranks elsewhere"));
            }
        }
        let (dtype, fp8) = weights_dtype(comp.dtype)?;
        if (dtype, fp8) != (self.dtype, self.fp8) {
            let name =
                |d: DType, f: bool| format!("{d:?}{}", if f { " with FP8 products" } else { "" });
            return refuse(format!(
                "it computes in {}, the loaded one in {}",
                name(dtype, fp8),
                name(self.dtype, self.fp8)
            ));
        }
        let mut devmap = DeviceMap::new(self.opts.deterministic);
        // Each receiving device with the ranks it gets: (part, rank).
        let mut to: Vec<(DeviceId, Device, Vec<RankAt>)> = Vec::new();
        for (pi, p) in comp.parts.iter().enumerate() {
            for (ri, id) in p.devices.iter().enumerate() {
                let device = devmap.get(id)?;
                match to.iter_mut().find(|(d, _, _)| d == id) {
                    Some((_, _, ranks)) => ranks.push((pi, ri)),
                    None => to.push((id.clone(), device, vec![(pi, ri)])),
                }
            }
        }
        // Through host memory a copy is slower than reading the checkpoint again (pageable
        // reads and writes, tensor by tensor): only pairs that copy directly.
        let peer = self.opts.peer_copies;
        for (id, device, ranks) in &to {
            for &(pi, ri) in ranks {
                let src = &self.parts[pi].ranks[ri];
                if !runtime::copies_directly(&src.device, device, peer) {
                    return refuse(format!(
                        "{} cannot copy from {} directly ({})",
                        id,
                        src.id,
                        if peer {
                            "no peer access between them"
                        } else {
                            "peer copies are off"
                        }
                    ));
                }
            }
        }
        // Communicators of the new groups start beside the copies (made and dropped: pooled
        // for the first step), as a load starts them beside its reading.
        let specs: Vec<PartSpec> = comp
            .parts
            .iter()
            .zip(&steps)
            .map(|(p, steps)| PartSpec {
                devices: p.devices.clone(),
                tp: p.tp as usize,
                sp: p.sp as usize,
                residency: p.residency,
                buffers: 0,
                steps: steps.clone(),
            })
            .collect();
        let warming = warm_groups(&specs, &self.opts.comm);
        let t = std::time::Instant::now();
        let copied: Vec<Result<Copied<M>>> = std::thread::scope(|s| {
            let threads: Vec<_> = to
                .iter()
                .map(|(id, device, ranks)| {
                    s.spawn(move || {
                        let mut out = Vec::with_capacity(ranks.len());
                        for &(pi, ri) in ranks {
                            out.push(((pi, ri), self.copy_rank(pi, ri, id, device, peer)?));
                        }
                        // The copies were queued on this thread's stream of `device`: done
                        // before the replica runs (on other threads) or the source is freed.
                        device.synchronize().map_err(|e| device_error(id, e))?;
                        Ok(out)
                    })
                })
                .collect();
            threads
                .into_iter()
                .map(|t| {
                    t.join().unwrap_or_else(|_| {
                        Err(ExecError::Plan("a weight-copy thread panicked".into()))
                    })
                })
                .collect()
        });
        let mut ranks: Vec<Vec<Option<Rank<M>>>> = comp
            .parts
            .iter()
            .map(|p| p.devices.iter().map(|_| None).collect())
            .collect();
        for got in copied {
            for ((pi, ri), r) in got? {
                ranks[pi][ri] = Some(r);
            }
        }
        let copy_s = t.elapsed().as_secs_f64();
        let t = std::time::Instant::now();
        if let Some(w) = warming {
            let _ = w.join();
        }
        let groups_s = t.elapsed().as_secs_f64();
        let mut blocks_copied = 0;
        let mut parts: Vec<PartRt<M>> = comp
            .parts
            .iter()
            .zip(&self.parts)
            .zip(ranks)
            .map(|((p, rt), ranks)| {
                let ranks: Vec<Rank<M>> = ranks
                    .into_iter()
                    .map(|r| r.expect("every rank copied"))
                    .collect();
                blocks_copied += ranks.iter().map(|r| r.blocks.len()).sum::<usize>();
                PartRt {
                    devices: p.devices.clone(),
                    tp: rt.tp,
                    sp: rt.sp,
                    keep_sliced: false,
                    steps: rt.steps.clone(),
                    ranks,
                    local_ids: p.devices.clone(),
                    comms: None,
                }
            })
            .collect();
        // As the load decides it: a sequence-parallel part hands its slices straight to a
        // next part on the same devices with the same layout.
        for i in 1..parts.len() {
            let (a, b) = (&parts[i - 1], &parts[i]);
            let same = a.devices == b.devices && a.tp == b.tp && a.sp == b.sp;
            parts[i - 1].keep_sliced = same && a.sp > 1;
        }
        Ok(Executor {
            model: self.model.clone(),
            dtype: self.dtype,
            fp8: self.fp8,
            fp8_attention: self.fp8_attention,
            parts,
            opts: self.opts.clone(),
            rings: Vec::new(),
            dist: None,
            timeline: Mutex::default(),
            waits: Default::default(),
            blocks_copied,
            load_phases: vec![
                ("blocks copied between GPUs", copy_s),
                ("waiting for the communicators", groups_s),
            ],
        })
    }

    /// Rank `ri` of part `pi` with its weights copied to `device` (`id`), queued on this
    /// thread's stream of it.
    fn copy_rank(
        &self,
        pi: usize,
        ri: usize,
        id: &DeviceId,
        device: &Device,
        peer: bool,
    ) -> Result<Rank<M>> {
        let src = &self.parts[pi].ranks[ri];
        let err = |e| device_error(id, e);
        let mut blocks = Vec::with_capacity(src.blocks.len());
        for b in &src.blocks {
            match b {
                Held::Resident(b) => blocks.push(Held::Resident(
                    b.map_tensors(&mut |t| runtime::hand_off(t, device, peer))
                        .map_err(err)?,
                )),
                Held::Streamed(..) | Held::Sync(_) => {
                    return Err(ExecError::Plan(format!(
                        "part {pi}: a streamed block cannot be copied to another replica"
                    )))
                }
            }
        }
        Ok(Rank {
            id: id.clone(),
            index: src.index,
            device: device.clone(),
            stem: src
                .stem
                .as_ref()
                .map(|s| s.to_device(device))
                .transpose()
                .map_err(err)?,
            final_layer: src
                .final_layer
                .as_ref()
                .map(|f| f.to_device(device))
                .transpose()
                .map_err(err)?,
            blocks,
            meter: ActivationMeter::default(),
            profile: Profiler::with_events(self.opts.profile_events),
            mb_profiles: Mutex::default(),
            ahead: crate::model::modulation::ModulationCache::default(),
            resident_bytes: src.resident_bytes,
            sync_stream_bytes: 0,
            sync_host_bytes: 0,
        })
    }
}

fn device_error(id: &DeviceId, e: candle_core::Error) -> ExecError {
    ExecError::Device {
        device: id.to_string(),
        // One line: candle's error may carry a captured backtrace after it.
        message: format!(
            "copying weights to it: {}",
            e.to_string().lines().next().unwrap_or("failed")
        ),
    }
}
