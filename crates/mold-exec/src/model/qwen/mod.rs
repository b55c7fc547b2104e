//! Qwen-Image (diffusers `QwenImageTransformer2DModel`; the 20B model and a tiny test
//! model of the same structure) behind the [`Transformer`] interface: dual-stream
//! blocks over the text and image tokens, the image tokens alone into the final layer.
//!
//! - [`config`]: hyper-parameters and the checkpoint tensors they imply (the published
//!   diffusers names);
//! - [`blocks`]: the stem, the block and the final layer, built from replicated,
//!   column- and row-parallel layers;
//! - [`rope`]: the 3-axis rotary table of the joint sequence;
//! - [`inputs`]: one call's inputs and deterministic random ones for benchmarks;
//! - [`testdata`]: random checkpoints in the repository's `transformer/` layout.

pub mod blocks;
pub mod config;
pub mod inputs;
pub mod rope;
pub mod testdata;

pub use blocks::{Block, FinalLayer, Stem};
pub use config::{QwenConfig, TIME_EMBED_DIM};
pub use inputs::{random_inputs, QwenInputs};

use super::layers::TensorMap;
use super::transformer::{Activations, BlockRef, Packable, TensorSpec, Transformer, Weights};
use super::{sequence, Ctx, Shard, WeightSource};
use crate::error::{ExecError, Result};
use crate::model::token_split::TokenSplit;
use candle_core::{DType, Device, Tensor};

type CResult<T> = candle_core::Result<T>;

/// The one block kind (the catalogue's name for Qwen-Image's dual-stream blocks).
pub const BLOCK: &str = "block";

impl Weights for Block {
    fn to_device(&self, d: &Device) -> CResult<Self> {
        Block::to_device(self, d)
    }
    fn bytes(&self) -> u64 {
        Block::bytes(self)
    }
}

impl Packable for Block {
    fn map_tensors(&self, f: &mut TensorMap) -> CResult<Self> {
        Block::map_tensors(self, f)
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

/// Activations between blocks: the image and text streams, the conditioning and the
/// rotation table of `[txt; img]`. Under sequence parallelism each rank holds a slice
/// of the text and a slice of the image tokens (`seq`), with their rows of `pe`; between
/// parts and before the final layer the whole sequence.
#[derive(Clone, Debug)]
pub struct QwenActs {
    pub img: Tensor,
    pub txt: Tensor,
    pub temb: Tensor,
    pub pe: Tensor,
    pub seq: Option<SeqSlice>,
    /// Token-split tensor parallelism: `img` and `txt` are this rank's shares.
    pub split: Option<TokenSplit>,
}

/// Which slice of the sequence a sequence-parallel rank holds: text tokens
/// `sequence::split(txt, rank, world)` and image tokens `sequence::split(img, rank,
/// world)`; `pe` is the whole sequence's table (restored on gathering).
#[derive(Clone, Debug)]
pub struct SeqSlice {
    pub rank: usize,
    pub world: usize,
    pub txt: usize,
    pub img: usize,
    pub pe: Tensor,
}

impl SeqSlice {
    /// Every rank's token count (text and image), in rank order.
    fn lens(&self) -> Vec<usize> {
        (0..self.world)
            .map(|j| {
                sequence::split(self.txt, j, self.world).len()
                    + sequence::split(self.img, j, self.world).len()
            })
            .collect()
    }
}

impl QwenActs {
    /// Fails on a rank's slice of the sequence: only the whole sequence leaves a part.
    fn whole_sequence_only(&self) -> CResult<()> {
        if self.seq.is_some() || self.split.is_some() {
            candle_core::bail!("a sequence slice cannot leave its part: gather it first");
        }
        Ok(())
    }
}

impl Activations for QwenActs {
    fn map(&self, f: &mut dyn FnMut(&Tensor) -> CResult<Tensor>) -> CResult<Self> {
        self.whole_sequence_only()?;
        Ok(QwenActs {
            img: f(&self.img)?,
            txt: f(&self.txt)?,
            temb: f(&self.temb)?,
            pe: f(&self.pe)?,
            seq: None,
            split: None,
        })
    }

    fn to_wire(&self) -> CResult<(u8, Vec<Tensor>)> {
        self.whole_sequence_only()?;
        Ok((
            0,
            vec![
                self.img.clone(),
                self.txt.clone(),
                self.temb.clone(),
                self.pe.clone(),
            ],
        ))
    }

    fn from_wire(tag: u8, tensors: Vec<Tensor>) -> CResult<Self> {
        let n = tensors.len();
        match (tag, <[Tensor; 4]>::try_from(tensors)) {
            (0, Ok([img, txt, temb, pe])) => Ok(QwenActs {
                img,
                txt,
                temb,
                pe,
                seq: None,
                split: None,
            }),
            _ => candle_core::bail!("malformed Qwen-Image activations: tag {tag}, {n} tensors"),
        }
    }
}

impl Transformer for QwenConfig {
    type Inputs = QwenInputs;
    type Acts = QwenActs;
    type Block = Block;
    type Stem = Stem;
    type Final = FinalLayer;

    fn family(&self) -> &'static str {
        "Qwen-Image"
    }

    fn validate(&self) -> std::result::Result<(), String> {
        QwenConfig::validate(self)
    }

    fn block_kinds(&self) -> Vec<(&'static str, usize)> {
        vec![(BLOCK, self.depth)]
    }

    fn tp_refusal(&self, degree: usize) -> Option<String> {
        let (heads, mlp) = (self.heads, self.mlp_hidden);
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

    fn sp_refusal(&self, tp: usize, sp: usize) -> Option<String> {
        let heads = self.heads / tp.max(1);
        (sp > heads).then(|| {
            format!(
                "sequence parallel over {sp} ranks needs at least {sp} attention heads per tensor-parallel rank, and there are {heads}: use sp ≤ {heads}"
            )
        })
    }

    fn tensor_specs(&self) -> Vec<TensorSpec> {
        QwenConfig::tensor_specs(self)
    }

    fn check_inputs(&self, x: &QwenInputs) -> Result<()> {
        inputs::check(self, x)
    }

    fn load_stem(&self, src: &dyn WeightSource) -> Result<Stem> {
        Stem::load(src, self)
    }

    fn load_final(&self, src: &dyn WeightSource) -> Result<FinalLayer> {
        FinalLayer::load(src)
    }

    fn load_block(&self, src: &dyn WeightSource, b: BlockRef, shard: Shard) -> Result<Block> {
        if b.kind != BLOCK {
            return Err(ExecError::Plan(format!(
                "Qwen-Image has no `{}` blocks (it has `{BLOCK}`)",
                b.kind
            )));
        }
        Block::load(src, self, b.index, shard)
    }

    fn stem(
        &self,
        stem: &Stem,
        x: &QwenInputs,
        dtype: DType,
        dev: &Device,
        ctx: &Ctx,
    ) -> CResult<QwenActs> {
        let mv = |t: &Tensor| t.to_device(dev)?.to_dtype(dtype);
        let ts = x.timesteps.to_device(dev)?.to_dtype(DType::F32)?;
        let s = stem.forward(&mv(&x.img)?, &mv(&x.txt)?, &ts, x.grid)?;
        ctx.mark("stem", &s.img);
        Ok(QwenActs {
            img: s.img,
            txt: s.txt,
            temb: s.temb,
            pe: s.pe,
            seq: None,
            split: None,
        })
    }

    fn scatter_sequence(&self, acts: QwenActs, ctx: &Ctx) -> CResult<QwenActs> {
        let (rank, world) = (ctx.sp.rank(), ctx.sp.world_size());
        if world == 1 {
            return Ok(acts);
        }
        if acts.seq.is_some() || acts.split.is_some() {
            candle_core::bail!("scatter of activations already sliced");
        }
        let (txt, img) = (acts.txt.dim(1)?, acts.img.dim(1)?);
        if txt < world || img < world {
            candle_core::bail!(
                "sequence parallel over {world} ranks needs at least {world} text and {world} image tokens (got {txt} and {img})"
            );
        }
        let t = sequence::split(txt, rank, world);
        let i = sequence::split(img, rank, world);
        let pe = Tensor::cat(
            &[
                acts.pe.narrow(1, t.start, t.len())?,
                acts.pe.narrow(1, txt + i.start, i.len())?,
            ],
            1,
        )?
        .contiguous()?;
        Ok(QwenActs {
            img: acts.img.narrow(1, i.start, i.len())?.contiguous()?,
            txt: acts.txt.narrow(1, t.start, t.len())?.contiguous()?,
            temb: acts.temb,
            pe,
            seq: Some(SeqSlice {
                rank,
                world,
                txt,
                img,
                pe: acts.pe,
            }),
            split: None,
        })
    }

    fn gather_sequence(&self, acts: QwenActs, ctx: &Ctx) -> CResult<QwenActs> {
        // First the tensor-parallel rank's token shares back to its group's whole (this
        // sequence-parallel rank's slice, or the whole sequence).
        let acts = match acts.split {
            Some(sp) => {
                sp.check(ctx)?;
                QwenActs {
                    img: sp.gather_stream(&acts.img, sp.img, ctx)?,
                    txt: sp.gather_stream(&acts.txt, sp.txt, ctx)?,
                    split: None,
                    ..acts
                }
            }
            None => acts,
        };
        let Some(s) = acts.seq else {
            return Ok(acts);
        };
        // Every rank's [text slice, image slice] to every rank in one all-to-all; then
        // the text slices in rank order, then the image slices.
        let local = Tensor::cat(&[&acts.txt, &acts.img], 1)?;
        let (b, _, h) = local.dims3()?;
        let n = s.world;
        let shapes: Vec<candle_core::Shape> =
            s.lens().into_iter().map(|l| (b, l, h).into()).collect();
        let got = ctx.sp.all_to_all(&vec![local; n], &shapes)?;
        let mut txt = Vec::with_capacity(n);
        let mut img = Vec::with_capacity(n);
        for (j, g) in got.iter().enumerate() {
            let t = sequence::split(s.txt, j, n).len();
            txt.push(g.narrow(1, 0, t)?);
            img.push(g.narrow(1, t, g.dim(1)? - t)?);
        }
        Ok(QwenActs {
            txt: Tensor::cat(&txt, 1)?,
            img: Tensor::cat(&img, 1)?,
            temb: acts.temb,
            pe: s.pe,
            seq: None,
            split: None,
        })
    }

    fn block(&self, b: &Block, acts: QwenActs, ctx: &Ctx) -> CResult<QwenActs> {
        let QwenActs {
            img,
            txt,
            temb,
            pe,
            seq,
            split,
        } = acts;
        // The first block of a part splits the tokens where asked (token-split tensor
        // parallelism); the part's end gathers them ([`Transformer::gather_sequence`]).
        let (txt, img, split) = TokenSplit::streams(split, txt, img, &pe, ctx)?;
        let lens = match (&seq, &split) {
            (Some(s), _) => s.lens(),
            (None, Some(s)) => vec![s.txt + s.img],
            (None, None) => vec![img.dim(1)? + txt.dim(1)?],
        };
        let (img, txt) = b.forward(img, txt, &temb, &pe, &lens, split.as_ref(), ctx)?;
        ctx.meter.see(&img);
        Ok(QwenActs {
            img,
            txt,
            temb,
            pe,
            seq,
            split,
        })
    }

    fn final_layer(&self, f: &FinalLayer, acts: QwenActs, ctx: &Ctx) -> CResult<Tensor> {
        acts.whole_sequence_only()?;
        ctx.mark_start(&acts.img);
        let out = f.forward(&acts.img, &acts.temb)?;
        ctx.mark("final layer", &out);
        ctx.meter.see(&out);
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A rank's slice of the sequence never leaves its part; the whole sequence does,
    /// and comes back from the wire as it went.
    #[test]
    fn only_the_whole_sequence_leaves_a_part() {
        let t = |n: usize| Tensor::zeros((1, n, 4), DType::F32, &Device::Cpu).unwrap();
        let whole = QwenActs {
            img: t(4),
            txt: t(2),
            temb: t(1),
            pe: t(6),
            seq: None,
            split: None,
        };
        let (tag, wire) = whole.to_wire().unwrap();
        let back = QwenActs::from_wire(tag, wire).unwrap();
        assert_eq!(
            (back.img.dims(), back.txt.dims()),
            (whole.img.dims(), whole.txt.dims())
        );
        assert!(QwenActs::from_wire(1, vec![t(1)]).is_err());
        let sliced = QwenActs {
            seq: Some(SeqSlice {
                rank: 0,
                world: 2,
                txt: 2,
                img: 4,
                pe: t(6),
            }),
            ..whole.clone()
        };
        let shared = QwenActs {
            img: t(2),
            txt: t(1),
            split: Some(TokenSplit {
                rank: 0,
                world: 2,
                txt: 2,
                img: 4,
                pe: t(6),
            }),
            ..whole
        };
        for e in [
            sliced.to_wire().map(|_| ()).unwrap_err(),
            sliced.map(&mut |x| Ok(x.clone())).map(|_| ()).unwrap_err(),
            shared.to_wire().map(|_| ()).unwrap_err(),
            shared.map(&mut |x| Ok(x.clone())).map(|_| ()).unwrap_err(),
        ] {
            assert!(e.to_string().contains("gather it first"), "{e}");
        }
    }
}
