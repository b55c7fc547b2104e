//! Collective communication between the ranks of a tensor-parallel group.
//!
//! Model code sees only the [`Comm`] trait. Implementations:
//! - [`LocalComm`]: a group of one (no communication).
//! - [`ThreadComm`]: ranks are threads of this process; tensors are staged through host
//!   memory and summed in rank order, so every rank gets bit-identical results. It is
//!   the implementation for emulated devices and works (slowly) for any candle device.
//! - [`nccl::NcclComm`] (feature `nccl`): ranks are threads of this process, one GPU
//!   each; all-reduce through NCCL on candle's compute stream, with a watchdog
//!   (`MOLD_NCCL_TIMEOUT_S`) that aborts the group instead of hanging. See [`nccl`].

use candle_core::{Device, Result, Tensor};
use std::sync::{Arc, Condvar, Mutex};

/// A rank's handle on its tensor-parallel group.
pub trait Comm: Send + Sync {
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;
    /// Element-wise sum of `t` over all ranks; every rank must call it, in the same order,
    /// with tensors of the same shape and dtype. The result is on `t`'s device.
    fn all_reduce_sum(&self, t: &Tensor) -> Result<Tensor>;
    /// Every rank's `t`, stacked in rank order: shape `(world_size, ..t.shape)`. Every
    /// rank must call it with a tensor of the same shape and dtype.
    ///
    /// The provided implementation is an all-reduce of a `world_size`-times larger tensor
    /// that is zero except for this rank's slot, which is exact (x + 0 = x) and costs one
    /// all-reduce's latency: meant for small tensors (modulation vectors).
    fn all_gather(&self, t: &Tensor) -> Result<Tensor> {
        let n = self.world_size();
        if n == 1 {
            return t.unsqueeze(0);
        }
        let zero = t.zeros_like()?.unsqueeze(0)?;
        let mine = t.unsqueeze(0)?;
        let slots: Vec<&Tensor> = (0..n)
            .map(|i| if i == self.rank() { &mine } else { &zero })
            .collect();
        self.all_reduce_sum(&Tensor::cat(&slots, 0)?)
    }
    /// Marks the group failed so the other ranks stop waiting for this one (called when a
    /// rank errors or panics). The default does nothing.
    fn abort(&self) {}
    /// Fails if the group failed since this rank's last collective (called after the
    /// rank's work is done, because a collective may fail after it was enqueued). The
    /// default has nothing to check.
    fn check(&self) -> Result<()> {
        Ok(())
    }
}

/// The group of one: all-reduce is the identity.
#[derive(Clone, Copy, Debug, Default)]
pub struct LocalComm;

impl Comm for LocalComm {
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        1
    }
    fn all_reduce_sum(&self, t: &Tensor) -> Result<Tensor> {
        Ok(t.clone())
    }
}

struct State {
    slots: Vec<Option<Tensor>>,
    arrived: usize,
    generation: u64,
    aborted: bool,
}

struct Shared {
    world: usize,
    state: Mutex<State>,
    cv: Condvar,
}

impl Shared {
    /// A barrier that fails (instead of hanging) once any rank has aborted.
    fn barrier(&self) -> Result<()> {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if st.aborted {
            candle_core::bail!("another rank of the tensor-parallel group failed");
        }
        let gen = st.generation;
        st.arrived += 1;
        if st.arrived == self.world {
            st.arrived = 0;
            st.generation += 1;
            self.cv.notify_all();
            return Ok(());
        }
        while st.generation == gen && !st.aborted {
            st = self.cv.wait(st).unwrap_or_else(|e| e.into_inner());
        }
        if st.generation == gen {
            candle_core::bail!("another rank of the tensor-parallel group failed");
        }
        Ok(())
    }
}

/// In-process group: one rank per thread, shared buffers and a barrier.
#[derive(Clone)]
pub struct ThreadComm {
    rank: usize,
    shared: Arc<Shared>,
}

impl ThreadComm {
    /// Handles for ranks `0..world`, to be moved one per thread.
    pub fn group(world: usize) -> Vec<ThreadComm> {
        assert!(world > 0, "a group needs at least one rank");
        let shared = Arc::new(Shared {
            world,
            state: Mutex::new(State {
                slots: vec![None; world],
                arrived: 0,
                generation: 0,
                aborted: false,
            }),
            cv: Condvar::new(),
        });
        (0..world)
            .map(|rank| ThreadComm {
                rank,
                shared: shared.clone(),
            })
            .collect()
    }
}

impl Comm for ThreadComm {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.shared.world
    }
    /// Ranks waiting in (or later entering) a collective get an error instead of waiting
    /// forever for this rank.
    fn abort(&self) {
        let mut st = self.shared.state.lock().unwrap_or_else(|e| e.into_inner());
        st.aborted = true;
        self.shared.cv.notify_all();
    }

    fn all_reduce_sum(&self, t: &Tensor) -> Result<Tensor> {
        let world = self.shared.world;
        if world == 1 {
            return Ok(t.clone());
        }
        let host = t.to_device(&Device::Cpu)?;
        {
            let mut st = self.shared.state.lock().unwrap_or_else(|e| e.into_inner());
            st.slots[self.rank] = Some(host);
        }
        self.shared.barrier()?;
        // Every rank sums the same host tensors in rank order: bit-identical results.
        let parts: Vec<Tensor> = {
            let st = self.shared.state.lock().unwrap_or_else(|e| e.into_inner());
            st.slots
                .iter()
                .map(|s| s.clone().expect("slot filled"))
                .collect()
        };
        let mut acc = parts[0].clone();
        for p in &parts[1..] {
            if p.shape() != acc.shape() || p.dtype() != acc.dtype() {
                self.abort();
                candle_core::bail!(
                    "all_reduce_sum: ranks passed {:?}/{:?} and {:?}/{:?}",
                    acc.shape(),
                    acc.dtype(),
                    p.shape(),
                    p.dtype()
                );
            }
            acc = (acc + p)?;
        }
        // Nobody may overwrite a slot before every rank has read them all.
        self.shared.barrier()?;
        acc.to_device(t.device())
    }
}

/// NCCL implementation of [`Comm`] (feature `nccl`). `runtime::make_group` is the one
/// place that picks the implementation for a group.
#[cfg(feature = "nccl")]
#[path = "nccl.rs"]
pub mod nccl;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thread_comm_sums_in_rank_order_on_every_rank() {
        let comms = ThreadComm::group(3);
        let outs: Vec<Vec<f32>> = std::thread::scope(|s| {
            let hs: Vec<_> = comms
                .iter()
                .map(|c| {
                    s.spawn(move || {
                        let t = Tensor::new(&[c.rank() as f32, 1.0], &Device::Cpu).unwrap();
                        let r = c.all_reduce_sum(&t).unwrap();
                        let r = c.all_reduce_sum(&r).unwrap();
                        r.to_vec1::<f32>().unwrap()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for o in outs {
            assert_eq!(o, vec![9.0, 9.0]);
        }
    }

    #[test]
    fn all_gather_stacks_every_rank_in_rank_order_exactly() {
        let comms = ThreadComm::group(3);
        let outs: Vec<Vec<Vec<f32>>> = std::thread::scope(|s| {
            let hs: Vec<_> = comms
                .iter()
                .map(|c| {
                    s.spawn(move || {
                        let r = c.rank() as f32;
                        // Values whose sum with anything but zero would round.
                        let t = Tensor::new(&[1e-8 + r, 1e8 + r], &Device::Cpu).unwrap();
                        let g = c.all_gather(&t).unwrap();
                        assert_eq!(g.dims(), &[3, 2]);
                        g.to_vec2::<f32>().unwrap()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let want: Vec<Vec<f32>> = (0..3)
            .map(|r| vec![1e-8 + r as f32, 1e8 + r as f32])
            .collect();
        for o in outs {
            assert_eq!(o, want);
        }
        let one = LocalComm.all_gather(&Tensor::new(&[2f32], &Device::Cpu).unwrap());
        assert_eq!(one.unwrap().to_vec2::<f32>().unwrap(), vec![vec![2.0]]);
    }

    #[test]
    fn abort_releases_waiting_ranks() {
        let comms = ThreadComm::group(2);
        let t = Tensor::new(&[1f32], &Device::Cpu).unwrap();
        std::thread::scope(|s| {
            let c0 = &comms[0];
            let h = s.spawn(|| c0.all_reduce_sum(&t));
            std::thread::sleep(std::time::Duration::from_millis(20));
            comms[1].abort();
            assert!(h.join().unwrap().is_err());
        });
    }
}
