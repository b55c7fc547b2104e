//! Copies of the blocks one rank reads to the ranks that hold the same shard (a
//! sequence-parallel group's), device to device, while the reading goes on: one thread per
//! receiving device takes each block as the reader uploads it and queues its copy
//! ([`runtime::hand_off`]: a peer copy over NVLink or PCIe where the pair has peer access).
//! The receiving devices copy at once, beside each other and beside the reading, instead of
//! one after another once every block is read.
//!
//! Ordering: a block is sent only when its tensors are complete on the reader's device (the
//! caller waits for its own stream first); each copy thread waits for the copies it queued on
//! its own stream of the receiving device before it returns them.

use crate::error::{ExecError, Result};
use crate::model::Packable;
use crate::runtime;
use candle_core::Device;
use std::sync::mpsc::{channel, Sender};
use std::thread::{Scope, ScopedJoinHandle};

/// The copy threads of one reading rank, one per receiving device.
pub(super) struct CopyOut<'scope, B> {
    senders: Vec<Sender<B>>,
    threads: Vec<ScopedJoinHandle<'scope, Result<Vec<B>>>>,
}

impl<'scope, B: Packable + 'scope> CopyOut<'scope, B> {
    /// Starts a thread for each of `to`'s devices in `scope`.
    pub(super) fn start<'env>(
        scope: &'scope Scope<'scope, 'env>,
        to: &'env [(usize, Device)],
        peer_copies: bool,
    ) -> Self {
        let mut senders = Vec::with_capacity(to.len());
        let mut threads = Vec::with_capacity(to.len());
        for (_, device) in to {
            let (tx, rx) = channel::<B>();
            senders.push(tx);
            threads.push(scope.spawn(move || {
                let mut out = Vec::new();
                let mut failed = None;
                for b in rx {
                    match b.map_tensors(&mut |t| runtime::hand_off(t, device, peer_copies)) {
                        Ok(c) => out.push(c),
                        Err(e) => {
                            failed = Some(copy_error(device, e));
                            break;
                        }
                    }
                }
                // The copies were queued on this thread's stream of the receiving device:
                // done before their sources may be freed, also after a failure.
                let synced = device.synchronize().map_err(|e| copy_error(device, e));
                match failed {
                    Some(e) => Err(e),
                    None => synced.map(|_| out),
                }
            }));
        }
        CopyOut { senders, threads }
    }

    /// Hands `block` (complete on its device) to every copy thread. A thread that stopped on
    /// an error no longer takes blocks; [`CopyOut::finish`] reports it.
    pub(super) fn send(&self, block: &B) {
        for tx in &self.senders {
            let _ = tx.send(block.clone());
        }
    }

    /// Waits for every copy: each receiving device's blocks, in the order sent.
    pub(super) fn finish(self) -> Result<Vec<Vec<B>>> {
        drop(self.senders);
        let mut all = Vec::with_capacity(self.threads.len());
        for t in self.threads {
            all.push(
                t.join()
                    .map_err(|_| ExecError::Plan("a weight-copy thread panicked".into()))??,
            );
        }
        Ok(all)
    }
}

fn copy_error(device: &Device, e: candle_core::Error) -> ExecError {
    ExecError::Device {
        device: match device.location() {
            candle_core::DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
            other => format!("{other:?}"),
        },
        // One line: candle's error may carry a captured backtrace after it.
        message: format!(
            "copying weights to it: {}",
            e.to_string().lines().next().unwrap_or("failed")
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::layers::TensorMap;
    use crate::model::Weights;
    use candle_core::{DType, Tensor};

    #[derive(Clone)]
    struct Two(Tensor, Tensor);
    impl Weights for Two {
        fn to_device(&self, d: &Device) -> candle_core::Result<Self> {
            Ok(Two(self.0.to_device(d)?, self.1.to_device(d)?))
        }
        fn bytes(&self) -> u64 {
            ((self.0.elem_count() + self.1.elem_count()) * 4) as u64
        }
    }
    impl Packable for Two {
        fn map_tensors(&self, f: &mut TensorMap) -> candle_core::Result<Self> {
            Ok(Two(f(&self.0)?, f(&self.1)?))
        }
    }

    /// Every receiving device gets every block, in the order sent, with the same values.
    #[test]
    fn each_receiver_gets_every_block_in_order() {
        let blocks: Vec<Two> = (0..7)
            .map(|i| {
                Two(
                    Tensor::full(i as f32, (3, 2), &Device::Cpu).unwrap(),
                    Tensor::arange(0u32, i + 1, &Device::Cpu)
                        .unwrap()
                        .to_dtype(DType::F32)
                        .unwrap(),
                )
            })
            .collect();
        let to: Vec<(usize, Device)> = (1..4).map(|r| (r, Device::Cpu)).collect();
        let got = std::thread::scope(|s| {
            let out = CopyOut::start(s, &to, true);
            for b in &blocks {
                out.send(b);
            }
            out.finish()
        })
        .unwrap();
        assert_eq!(got.len(), 3);
        for copies in &got {
            assert_eq!(copies.len(), blocks.len());
            for (c, b) in copies.iter().zip(&blocks) {
                for (x, y) in [(&c.0, &b.0), (&c.1, &b.1)] {
                    assert_eq!(
                        x.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                        y.flatten_all().unwrap().to_vec1::<f32>().unwrap()
                    );
                }
            }
        }
    }
}
