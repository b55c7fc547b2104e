//! FLUX (BFL `flux.model.Flux`; FLUX.1 dev and schnell, and a tiny test model of the
//! same structure) behind the [`Transformer`] interface: double-stream blocks, then
//! single-stream blocks over the concatenated text and image tokens.
//!
//! - [`config`]: hyper-parameters and the checkpoint tensors they imply;
//! - [`blocks`]: the stem, the two block kinds and the final layer, built from
//!   replicated, column- and row-parallel layers;
//! - [`inputs`]: one call's inputs and deterministic random ones for benchmarks.

pub mod blocks;
pub mod config;
pub mod inputs;

pub use blocks::{DoubleBlock, FinalLayer, SingleBlock, Stem};
pub use config::{FluxConfig, TIME_EMBED_DIM};
pub use inputs::{random_inputs, FluxInputs};

use super::layers::TensorMap;
use super::transformer::{Activations, BlockRef, Packable, TensorSpec, Transformer, Weights};
use super::{Ctx, Shard, WeightSource};
use crate::error::{ExecError, Result};
use candle_core::{DType, Device, IndexOp, Tensor};

type CResult<T> = candle_core::Result<T>;

/// The block kinds, in execution order.
pub const DOUBLE: &str = "double";
pub const SINGLE: &str = "single";

/// One FLUX block of a rank.
#[derive(Clone, Debug)]
pub enum FluxBlock {
    Double(DoubleBlock),
    Single(SingleBlock),
}

impl Weights for FluxBlock {
    fn to_device(&self, d: &Device) -> CResult<Self> {
        Ok(match self {
            FluxBlock::Double(b) => FluxBlock::Double(b.to_device(d)?),
            FluxBlock::Single(b) => FluxBlock::Single(b.to_device(d)?),
        })
    }
    fn bytes(&self) -> u64 {
        match self {
            FluxBlock::Double(b) => b.bytes(),
            FluxBlock::Single(b) => b.bytes(),
        }
    }
}

impl Packable for FluxBlock {
    fn map_tensors(&self, f: &mut TensorMap) -> CResult<Self> {
        Ok(match self {
            FluxBlock::Double(b) => FluxBlock::Double(b.map_tensors(f)?),
            FluxBlock::Single(b) => FluxBlock::Single(b.map_tensors(f)?),
        })
    }
}

impl Weights for Stem {
    fn to_device(&self, d: &Device) -> CResult<Self> {
        Stem::to_device(self, d)
    }
    fn bytes(&self) -> u64 {
        Stem::bytes(self)
    }
}

impl Weights for FinalLayer {
    fn to_device(&self, d: &Device) -> CResult<Self> {
        FinalLayer::to_device(self, d)
    }
    fn bytes(&self) -> u64 {
        FinalLayer::bytes(self)
    }
}

/// Activations between FLUX blocks: the two streams before the single blocks, the
/// concatenated stream (text first) after.
#[derive(Clone, Debug)]
pub enum FluxActs {
    Double {
        img: Tensor,
        txt: Tensor,
        vec: Tensor,
        pe: Tensor,
    },
    Single {
        x: Tensor,
        vec: Tensor,
        pe: Tensor,
        txt_len: usize,
    },
}

impl Activations for FluxActs {
    fn map(&self, f: &mut dyn FnMut(&Tensor) -> CResult<Tensor>) -> CResult<Self> {
        Ok(match self {
            FluxActs::Double { img, txt, vec, pe } => FluxActs::Double {
                img: f(img)?,
                txt: f(txt)?,
                vec: f(vec)?,
                pe: f(pe)?,
            },
            FluxActs::Single {
                x,
                vec,
                pe,
                txt_len,
            } => FluxActs::Single {
                x: f(x)?,
                vec: f(vec)?,
                pe: f(pe)?,
                txt_len: *txt_len,
            },
        })
    }

    fn to_wire(&self) -> CResult<(u8, Vec<Tensor>)> {
        Ok(match self {
            FluxActs::Double { img, txt, vec, pe } => {
                (0, vec![img.clone(), txt.clone(), vec.clone(), pe.clone()])
            }
            FluxActs::Single {
                x,
                vec,
                pe,
                txt_len,
            } => {
                let len = u32::try_from(*txt_len)
                    .map_err(|_| candle_core::Error::Msg(format!("txt_len {txt_len}")))?;
                let tl = Tensor::new(&[len], &Device::Cpu)?;
                (1, vec![x.clone(), vec.clone(), pe.clone(), tl])
            }
        })
    }

    fn from_wire(tag: u8, tensors: Vec<Tensor>) -> CResult<Self> {
        let n = tensors.len();
        let bad = || {
            candle_core::Error::Msg(format!(
                "malformed FLUX activations: tag {tag}, {n} tensors"
            ))
        };
        match (tag, <[Tensor; 4]>::try_from(tensors)) {
            (0, Ok([img, txt, vec, pe])) => Ok(FluxActs::Double { img, txt, vec, pe }),
            (1, Ok([x, vec, pe, tl])) => {
                let tl = tl.to_vec1::<u32>().map_err(|_| bad())?;
                let txt_len = *tl.first().ok_or_else(bad)? as usize;
                if txt_len > x.dim(1)? {
                    return Err(bad());
                }
                Ok(FluxActs::Single {
                    x,
                    vec,
                    pe,
                    txt_len,
                })
            }
            _ => Err(bad()),
        }
    }
}

impl Transformer for FluxConfig {
    type Inputs = FluxInputs;
    type Acts = FluxActs;
    type Block = FluxBlock;
    type Stem = Stem;
    type Final = FinalLayer;

    fn family(&self) -> &'static str {
        "FLUX"
    }

    fn validate(&self) -> std::result::Result<(), String> {
        FluxConfig::validate(self)
    }

    fn block_kinds(&self) -> Vec<(&'static str, usize)> {
        vec![(DOUBLE, self.depth), (SINGLE, self.depth_single)]
    }

    fn tp_refusal(&self, degree: usize) -> Option<String> {
        let (heads, mlp) = (self.heads, self.mlp_hidden());
        let what = if degree == 0 {
            "it names no device".to_string()
        } else if !heads.is_multiple_of(degree) {
            format!("{degree} does not divide the {heads} attention heads")
        } else if !mlp.is_multiple_of(degree) {
            format!("{degree} does not divide the MLP width {mlp}")
        } else {
            return None;
        };
        Some(format!(
            "{what}; use a degree that divides both the heads ({heads}) and the MLP width ({mlp})"
        ))
    }

    fn tensor_specs(&self) -> Vec<TensorSpec> {
        FluxConfig::tensor_specs(self)
    }

    fn check_inputs(&self, x: &FluxInputs) -> Result<()> {
        inputs::check(self, x)
    }

    fn load_stem(&self, src: &dyn WeightSource) -> Result<Stem> {
        Stem::load(src, self)
    }

    fn load_final(&self, src: &dyn WeightSource) -> Result<FinalLayer> {
        FinalLayer::load(src)
    }

    fn load_block(&self, src: &dyn WeightSource, b: BlockRef, shard: Shard) -> Result<FluxBlock> {
        match b.kind {
            DOUBLE => Ok(FluxBlock::Double(DoubleBlock::load(
                src, self, b.index, shard,
            )?)),
            SINGLE => Ok(FluxBlock::Single(SingleBlock::load(
                src, self, b.index, shard,
            )?)),
            k => Err(ExecError::Plan(format!(
                "FLUX has no `{k}` blocks (it has `{DOUBLE}` and `{SINGLE}`)"
            ))),
        }
    }

    fn stem(
        &self,
        stem: &Stem,
        x: &FluxInputs,
        dtype: DType,
        dev: &Device,
        ctx: &Ctx,
    ) -> CResult<FluxActs> {
        let mv = |t: &Tensor| t.to_device(dev)?.to_dtype(dtype);
        // Positions, timesteps and guidance stay f32: the RoPE table and the sinusoidal
        // embeddings are computed in f32, then cast.
        let f32 = |t: &Tensor| t.to_device(dev)?.to_dtype(DType::F32);
        let s = stem.forward(
            &mv(&x.img)?,
            &f32(&x.img_ids)?,
            &mv(&x.txt)?,
            &f32(&x.txt_ids)?,
            &f32(&x.timesteps)?,
            &mv(&x.y)?,
            x.guidance.as_ref().map(f32).transpose()?.as_ref(),
        )?;
        ctx.mark("stem", &s.img);
        Ok(FluxActs::Double {
            img: s.img,
            txt: s.txt,
            vec: s.vec,
            pe: s.pe,
        })
    }

    fn block(&self, b: &FluxBlock, acts: FluxActs, ctx: &Ctx) -> CResult<FluxActs> {
        Ok(match (b, acts) {
            (FluxBlock::Double(b), FluxActs::Double { img, txt, vec, pe }) => {
                let (img, txt) = b.forward(&img, &txt, &vec, &pe, ctx)?;
                ctx.meter.see(&img);
                FluxActs::Double { img, txt, vec, pe }
            }
            (FluxBlock::Single(b), a) => {
                let (x, vec, pe, txt_len) = match a {
                    FluxActs::Double { img, txt, vec, pe } => {
                        let txt_len = txt.dim(1)?;
                        (Tensor::cat(&[&txt, &img], 1)?, vec, pe, txt_len)
                    }
                    FluxActs::Single {
                        x,
                        vec,
                        pe,
                        txt_len,
                    } => (x, vec, pe, txt_len),
                };
                let x = b.forward(&x, &vec, &pe, ctx)?;
                ctx.meter.see(&x);
                FluxActs::Single {
                    x,
                    vec,
                    pe,
                    txt_len,
                }
            }
            (FluxBlock::Double(_), FluxActs::Single { .. }) => {
                candle_core::bail!("a double block after single blocks")
            }
        })
    }

    fn final_layer(&self, f: &FinalLayer, acts: FluxActs, ctx: &Ctx) -> CResult<Tensor> {
        let (img, vec) = match acts {
            FluxActs::Double { img, vec, .. } => (img, vec),
            FluxActs::Single {
                x, vec, txt_len, ..
            } => (x.i((.., txt_len..))?, vec),
        };
        ctx.mark_start(&img);
        let out = f.forward(&img, &vec)?;
        ctx.mark("final layer", &out);
        ctx.meter.see(&out);
        Ok(out)
    }
}
