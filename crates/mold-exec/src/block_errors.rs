//! FP8's error block by block: each block of a transformer with its products' weights in FP8
//! against the same block dense, given the dense model's own activations (the error the
//! block adds), and the FP8 model's activations against the dense model's after each block
//! (the error carried so far), then at the output. One block of each kind is on the device
//! at a time, so a model runs where only one of its blocks fits.
//! `crates/mold-exec/examples/fp8_block_errors.rs` prints it for FLUX.1-dev and Qwen-Image
//! (`benches/fp8/blocks`).

use crate::checkpoint::Checkpoint;
use crate::comm::LocalComm;
use crate::error::Result;
use crate::model::{
    ops::Kernels, ActivationMeter, Activations, BlockRef, Ctx, Shard, Transformer, Weights,
};
use crate::runtime::CheckpointSource;
use crate::verify::max_relative_error;
use candle_core::{DType, Device, Tensor};

/// One block's error.
#[derive(Clone, Debug, PartialEq)]
pub struct BlockError {
    pub block: BlockRef,
    /// The FP8 block against the dense block on the dense model's activations
    /// (`--verify`'s measure: max |a − b| / max |b|, the largest over the activations'
    /// tensors).
    pub own: f64,
    /// The FP8 model's activations after this block against the dense model's.
    pub carried: f64,
}

/// Every block's error and the output's.
#[derive(Clone, Debug, PartialEq)]
pub struct BlockErrors {
    pub blocks: Vec<BlockError>,
    /// The FP8 model's output against the dense model's (`--verify`'s figure for one call).
    pub output: f64,
}

/// The largest relative error over the tensors the two activations carry (those that are the
/// same in both, such as the rotary table, count 0).
fn acts_error<A: Activations>(a: &A, b: &A) -> Result<f64> {
    let ((_, xs), (_, ys)) = (a.to_wire()?, b.to_wire()?);
    let mut worst = 0f64;
    for (x, y) in xs.iter().zip(&ys) {
        if x.dims() == y.dims() && x.dtype().is_float() && x.elem_count() > 0 {
            worst = worst.max(max_relative_error(x, y)?);
        }
    }
    Ok(worst)
}

/// FP8's error through `model` on `inputs`: the checkpoint's weights read in `dtype`, dense
/// and with every product quantized to FP8 (as an FP8 plan loads them), one call of the
/// transformer on `dev` with `kernels`; the FP8 blocks' attention in FP8 where
/// `fp8_attention` (as a plan's `attention: fp8`).
pub fn fp8_block_errors<M: Transformer>(
    model: &M,
    ckpt: &Checkpoint,
    inputs: &M::Inputs,
    dev: &Device,
    dtype: DType,
    kernels: Kernels,
    fp8_attention: bool,
) -> Result<BlockErrors> {
    model.check_inputs(inputs)?;
    let dense = CheckpointSource {
        ckpt,
        dtype,
        fp8: false,
    };
    let fp8 = CheckpointSource {
        ckpt,
        dtype,
        fp8: true,
    };
    let meter = ActivationMeter::default();
    let ctx = |slot: usize| Ctx {
        comm: &LocalComm,
        sp: &LocalComm,
        meter: &meter,
        kernels,
        token_split: false,
        profile: None,
        ahead: None,
        slot,
        fp8_attention,
    };
    let stem = model.load_stem(&dense)?.to_device(dev)?;
    let start = model.stem(&stem, inputs, dtype, dev, &ctx(0))?;
    drop(stem);
    let (mut reference, mut quantized) = (start.clone(), start);
    let mut blocks = Vec::new();
    for (slot, b) in model.all_blocks().into_iter().enumerate() {
        let c = ctx(slot);
        let exact = model.load_block(&dense, b, Shard::FULL)?.to_device(dev)?;
        let out = model.block(&exact, reference.clone(), &c)?;
        drop(exact);
        let approx = model.load_block(&fp8, b, Shard::FULL)?.to_device(dev)?;
        let own = model.block(&approx, reference, &c)?;
        quantized = model.block(&approx, quantized, &c)?;
        blocks.push(BlockError {
            block: b,
            own: acts_error(&own, &out)?,
            carried: acts_error(&quantized, &out)?,
        });
        reference = out;
    }
    let last = ctx(0);
    let fin = model.load_final(&dense)?.to_device(dev)?;
    let (a, b): (Tensor, Tensor) = (
        model.final_layer(&fin, quantized, &last)?,
        model.final_layer(&fin, reference, &last)?,
    );
    Ok(BlockErrors {
        blocks,
        output: max_relative_error(&a, &b)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::flux::{random_inputs, testdata::write_testdata, FluxConfig};

    /// Every FLUX block in FP8 adds an error of FP8's size on the dense activations; the
    /// error carried grows from the first block's own; the output's is the last carried
    /// through the final layer. The dense weights against themselves would give 0 (the
    /// source's FP8 flag is what differs).
    #[test]
    fn every_fp8_block_adds_an_error_of_fp8s_size() {
        let dir = std::env::temp_dir().join(format!("mold-block-errors-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let cfg = FluxConfig::flux_tiny();
        let path = write_testdata(&cfg, &dir, 3, DType::F32).unwrap();
        let ckpt = Checkpoint::open(&path).unwrap();
        let inputs = random_inputs(&cfg, 64, 64, 8, 1, 5).unwrap();
        let e = fp8_block_errors(
            &cfg,
            &ckpt,
            &inputs,
            &Device::Cpu,
            DType::F32,
            Kernels::Auto,
            false,
        )
        .unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(e.blocks.len(), cfg.depth + cfg.depth_single);
        for b in &e.blocks {
            assert!(b.own > 1e-4 && b.own < 0.2, "{b:?}");
            assert!(b.carried > 0.0 && b.carried < 0.5, "{b:?}");
        }
        assert_eq!(e.blocks[0].own, e.blocks[0].carried);
        assert!(e.output > 1e-4 && e.output < 0.5, "{}", e.output);
    }
}
