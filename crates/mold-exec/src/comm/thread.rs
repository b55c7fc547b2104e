//! [`ThreadComm`]: the ranks of a group are threads of this process; tensors are staged
//! through host memory and summed in rank order (bit-identical on every rank).

use super::{Comm, CommError};
use candle_core::{Device, Result, Shape, Tensor};
use std::sync::{Arc, Condvar, Mutex};

struct State {
    slots: Vec<Option<Tensor>>,
    /// All-to-all mailboxes: `mail[from][to]`.
    mail: Vec<Vec<Option<Tensor>>>,
    arrived: usize,
    generation: u64,
    /// The failure that aborted the group, once one did.
    aborted: Option<String>,
}

struct Shared {
    world: usize,
    state: Mutex<State>,
    cv: Condvar,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A barrier that fails (instead of hanging) once any rank has aborted.
    fn barrier(&self, rank: usize) -> Result<()> {
        let peer_failed = |why: &Option<String>| CommError::PeerAborted {
            rank: format!("rank {rank} of {}", self.world),
            cause: why.clone().unwrap_or_default(),
        };
        let mut st = self.lock();
        if st.aborted.is_some() {
            return Err(peer_failed(&st.aborted).into());
        }
        let gen = st.generation;
        st.arrived += 1;
        if st.arrived == self.world {
            st.arrived = 0;
            st.generation += 1;
            self.cv.notify_all();
            return Ok(());
        }
        while st.generation == gen && st.aborted.is_none() {
            st = self.cv.wait(st).unwrap_or_else(|e| e.into_inner());
        }
        if st.generation == gen {
            return Err(peer_failed(&st.aborted).into());
        }
        Ok(())
    }

    fn abort(&self, why: String) {
        let mut st = self.lock();
        if st.aborted.is_none() {
            st.aborted = Some(why);
        }
        self.cv.notify_all();
    }
}

/// In-process group: one rank per thread, shared buffers and a barrier.
#[derive(Clone)]
pub struct ThreadComm {
    rank: usize,
    shared: Arc<Shared>,
    /// [`Comm::overlap_chunks`]: host-staged sums do not overlap anything, but the model
    /// code's chunked path is the same one NCCL groups run, so emulated devices prove it.
    chunks: usize,
}

impl ThreadComm {
    /// Handles for ranks `0..world`, to be moved one per thread (none for `world == 0`).
    pub fn group(world: usize) -> Vec<ThreadComm> {
        let shared = Arc::new(Shared {
            world,
            state: Mutex::new(State {
                slots: vec![None; world],
                mail: vec![vec![None; world]; world],
                arrived: 0,
                generation: 0,
                aborted: None,
            }),
            cv: Condvar::new(),
        });
        (0..world)
            .map(|rank| ThreadComm {
                rank,
                shared: shared.clone(),
                chunks: 1,
            })
            .collect()
    }

    /// The same handle, splitting row-parallel products into `n` token chunks
    /// ([`Comm::overlap_chunks`]; at least 1).
    pub fn with_overlap_chunks(mut self, n: usize) -> ThreadComm {
        self.chunks = n.max(1);
        self
    }
}

impl Comm for ThreadComm {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.shared.world
    }
    fn overlap_chunks(&self) -> usize {
        self.chunks
    }
    /// Ranks waiting in (or later entering) a collective get
    /// [`CommError::PeerAborted`] instead of waiting forever for this rank.
    fn abort(&self) {
        self.shared.abort(format!(
            "rank {} of {} failed",
            self.rank, self.shared.world
        ));
    }

    fn all_reduce_sum(&self, t: &Tensor) -> Result<Tensor> {
        let world = self.shared.world;
        if world == 1 {
            return Ok(t.clone());
        }
        let host = t.to_device(&Device::Cpu)?;
        self.shared.lock().slots[self.rank] = Some(host);
        self.shared.barrier(self.rank)?;
        // Every rank sums the same host tensors in rank order: bit-identical results.
        let parts: Vec<Option<Tensor>> = self.shared.lock().slots.clone();
        let mut acc: Option<Tensor> = None;
        for p in parts {
            let Some(p) = p else {
                return Err(
                    CommError::Local("all_reduce_sum: a rank's slot is empty".into()).into(),
                );
            };
            acc = Some(match acc {
                None => p,
                Some(a) if p.shape() != a.shape() || p.dtype() != a.dtype() => {
                    self.abort();
                    return Err(CommError::Local(format!(
                        "all_reduce_sum: ranks passed {:?}/{:?} and {:?}/{:?}",
                        a.shape(),
                        a.dtype(),
                        p.shape(),
                        p.dtype()
                    ))
                    .into());
                }
                Some(a) => (a + p)?,
            });
        }
        // Nobody may overwrite a slot before every rank has read them all.
        self.shared.barrier(self.rank)?;
        acc.unwrap_or_else(|| t.clone()).to_device(t.device())
    }

    /// Host-staged: each rank posts its tensors in the mailboxes, then takes its own.
    fn all_to_all(&self, send: &[Tensor], recv: &[Shape]) -> Result<Vec<Tensor>> {
        let (me, world) = (self.rank, self.shared.world);
        super::check_all_to_all(me, world, send, recv)?;
        if world == 1 {
            return Ok(vec![send[0].contiguous()?]);
        }
        let host: Vec<Option<Tensor>> = send
            .iter()
            .enumerate()
            .map(|(j, t)| (j != me).then(|| t.to_device(&Device::Cpu)).transpose())
            .collect::<Result<_>>()?;
        self.shared.lock().mail[me] = host;
        self.shared.barrier(me)?;
        let mut got = Vec::with_capacity(world);
        for (j, shape) in recv.iter().enumerate() {
            if j == me {
                got.push(send[me].contiguous()?);
                continue;
            }
            let t = self.shared.lock().mail[j][me].take();
            let Some(t) = t else {
                self.abort();
                return Err(CommError::Local(format!(
                    "all_to_all: nothing from rank {j} for rank {me}"
                ))
                .into());
            };
            if t.shape() != shape || t.dtype() != send[me].dtype() {
                self.abort();
                return Err(CommError::Local(format!(
                    "all_to_all: rank {j} sent rank {me} {:?}/{:?}, expected {:?}/{:?}",
                    t.shape(),
                    t.dtype(),
                    shape,
                    send[me].dtype()
                ))
                .into());
            }
            got.push(t.to_device(send[me].device())?);
        }
        // Nobody may post again before every rank has taken its tensors.
        self.shared.barrier(me)?;
        Ok(got)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::LocalComm;

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
        assert!(ThreadComm::group(0).is_empty());
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

    /// `all_to_all_cat` puts what every rank sent here one after another in rank order,
    /// uneven pieces included, and refuses shapes that differ past dimension 0.
    #[test]
    fn all_to_all_cat_puts_the_pieces_one_after_another() {
        let world = 3usize;
        let comms = ThreadComm::group(world);
        // Rank r sends rank j a (r + 1, 2) piece of values 100·r + 10·j + i.
        let outs: Vec<(Vec<Vec<f32>>, String)> = std::thread::scope(|s| {
            let hs: Vec<_> = comms
                .iter()
                .map(|c| {
                    s.spawn(move || {
                        let r = c.rank();
                        let send: Vec<Tensor> = (0..world)
                            .map(|j| {
                                let v: Vec<f32> = (0..2 * (r + 1))
                                    .map(|i| (100 * r + 10 * j + i) as f32)
                                    .collect();
                                Tensor::from_vec(v, (r + 1, 2), &Device::Cpu).unwrap()
                            })
                            .collect();
                        let recv: Vec<Shape> = (0..world).map(|j| (j + 1, 2).into()).collect();
                        let got = c.all_to_all_cat(&send, &recv, None).unwrap();
                        // Started and finished apart: the same pieces, one buffer or apart.
                        let started = c
                            .all_to_all_start(send.clone(), recv.clone(), Some(None))
                            .unwrap()
                            .finish()
                            .unwrap();
                        assert_eq!(started.len(), 1);
                        assert_eq!(
                            started[0].to_vec2::<f32>().unwrap(),
                            got.to_vec2::<f32>().unwrap()
                        );
                        let apart = c
                            .all_to_all_start(send.clone(), recv.clone(), None)
                            .unwrap()
                            .finish()
                            .unwrap();
                        assert_eq!(
                            Tensor::cat(&apart, 0).unwrap().to_vec2::<f32>().unwrap(),
                            got.to_vec2::<f32>().unwrap()
                        );
                        let bad: Vec<Shape> = (0..world).map(|j| (1, j + 1).into()).collect();
                        let err = c.all_to_all_cat(&send, &bad, None).unwrap_err().to_string();
                        (got.to_vec2::<f32>().unwrap(), err)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (me, (got, err)) in outs.into_iter().enumerate() {
            let want: Vec<Vec<f32>> = (0..world)
                .flat_map(|j| {
                    (0..j + 1).map(move |row| {
                        (0..2)
                            .map(|col| (100 * j + 10 * me + 2 * row + col) as f32)
                            .collect()
                    })
                })
                .collect();
            assert_eq!(got, want, "rank {me}");
            assert!(err.contains("differ past dimension 0"), "{err}");
        }
    }

    /// The all-gather along dimension 0 puts every rank's rows in rank order; the
    /// reduce-scatter gives each rank its slice of the sum; gathering the scattered sums
    /// gives the all-reduce back, exactly (integers in f32).
    #[test]
    fn all_gather_cat_and_reduce_scatter_are_the_all_reduce_in_two_halves() {
        for world in [1usize, 2, 3, 4] {
            let comms = ThreadComm::group(world);
            // Per rank: the gather, the scattered sum, the sums gathered, the refusal.
            type Rows = Vec<Vec<f32>>;
            let outs: Vec<(Rows, Rows, Rows, String)> = std::thread::scope(|s| {
                let hs: Vec<_> = comms
                    .iter()
                    .map(|c| {
                        s.spawn(move || {
                            let r = c.rank() as f32;
                            let rows: Vec<f32> =
                                (0..2 * world * 3).map(|i| i as f32 * (r + 1.0)).collect();
                            let t = Tensor::from_vec(rows, (2 * world, 3), &Device::Cpu).unwrap();
                            let mine = t.narrow(0, 0, 2).unwrap();
                            let g = c.all_gather_cat(&mine).unwrap();
                            let rs = c.reduce_scatter_sum(&t).unwrap();
                            let back = c.all_gather_cat(&rs).unwrap();
                            let bad = c
                                .reduce_scatter_sum(&t.narrow(0, 0, 2 * world - 1).unwrap())
                                .map(|_| String::new())
                                .unwrap_or_else(|e| e.to_string());
                            (
                                g.to_vec2::<f32>().unwrap(),
                                rs.to_vec2::<f32>().unwrap(),
                                back.to_vec2::<f32>().unwrap(),
                                bad,
                            )
                        })
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).collect()
            });
            // Every rank's first two rows, in rank order.
            let gathered: Vec<Vec<f32>> = (0..world)
                .flat_map(|r| {
                    (0..2).map(move |row| {
                        (0..3)
                            .map(|col| (row * 3 + col) as f32 * (r as f32 + 1.0))
                            .collect::<Vec<f32>>()
                    })
                })
                .collect();
            // The sum over ranks: element i times 1 + 2 + … + world.
            let k = (world * (world + 1) / 2) as f32;
            let sum: Vec<Vec<f32>> = (0..2 * world)
                .map(|row| (0..3).map(|col| (row * 3 + col) as f32 * k).collect())
                .collect();
            for (r, (g, rs, back, bad)) in outs.into_iter().enumerate() {
                assert_eq!(g, gathered, "world {world}");
                assert_eq!(rs, sum[2 * r..2 * r + 2].to_vec(), "world {world} rank {r}");
                assert_eq!(back, sum, "world {world}");
                if world > 1 {
                    assert!(bad.contains("split evenly over"), "{bad}");
                }
            }
        }
    }

    #[test]
    fn abort_releases_waiting_ranks_as_peer_aborted() {
        let comms = ThreadComm::group(2);
        let t = Tensor::new(&[1f32], &Device::Cpu).unwrap();
        std::thread::scope(|s| {
            let c0 = &comms[0];
            let h = s.spawn(|| c0.all_reduce_sum(&t));
            std::thread::sleep(std::time::Duration::from_millis(20));
            comms[1].abort();
            let e = h.join().unwrap().unwrap_err();
            assert!(CommError::is_peer_aborted(&e), "{e}");
            assert!(e.to_string().contains("rank 1 of 2 failed"), "{e}");
        });
    }

    #[test]
    fn the_rank_that_failed_first_is_the_root_cause() {
        // Rank 1 passes a tensor of another shape: it fails on its own (a local error)
        // and aborts the group; rank 0 and 2 are released as PeerAborted, or see the
        // mismatch too. The root cause is never a PeerAborted while a local one exists.
        let comms = ThreadComm::group(3);
        let results: Vec<Result<Tensor>> = std::thread::scope(|s| {
            let hs: Vec<_> = comms
                .iter()
                .map(|c| {
                    s.spawn(move || {
                        if c.rank() == 1 {
                            c.abort();
                            return Err(CommError::Local("rank 1: out of memory".into()).into());
                        }
                        c.all_reduce_sum(&Tensor::new(&[1f32], &Device::Cpu)?)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let (i, e) = crate::comm::root_cause(&results).unwrap();
        assert_eq!(i, 1, "{e}");
        assert_eq!(
            CommError::of(e),
            Some(&CommError::Local("rank 1: out of memory".into()))
        );
        assert!(CommError::is_peer_aborted(results[0].as_ref().unwrap_err()));
    }
}
