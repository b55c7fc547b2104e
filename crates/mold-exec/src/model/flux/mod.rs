//! FLUX (BFL `flux.model.Flux`; FLUX.1 dev and schnell, and a tiny test model of the
//! same structure) behind the [`Transformer`] interface: double-stream blocks, then
//! single-stream blocks over the concatenated text and image tokens.
//!
//! - [`config`]: hyper-parameters and the checkpoint tensors they imply;
//! - [`blocks`]: the stem, the two block kinds and the final layer, built from
//!   replicated, column- and row-parallel layers;
//! - [`inputs`]: one call's inputs and deterministic random ones for benchmarks;
//! - [`testdata`]: random-weight checkpoints with the real tensor names (single-file or
//!   sharded).

pub mod blocks;
pub mod config;
pub mod inputs;
pub mod testdata;

pub use crate::model::token_split::TokenSplit;
pub use blocks::{DoubleBlock, FinalLayer, SingleBlock, Stem};
pub use config::{FluxConfig, TIME_EMBED_DIM};
pub use inputs::{random_inputs, FluxInputs, Schedule};

use super::layers::TensorMap;
use super::modulation::{self, Ahead, AheadKey, Conditioning};
use super::transformer::{Activations, BlockRef, Packable, TensorSpec, Transformer, Weights};
use super::{sequence, Ctx, Shard, WeightSource};
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
/// concatenated stream (text first) after. Under sequence parallelism each rank holds a
/// slice of the text and a slice of the image tokens (`seq`), with their positions in
/// `pe`; between parts and before the final layer the whole sequence.
#[derive(Clone, Debug)]
pub enum FluxActs {
    Double {
        img: Tensor,
        txt: Tensor,
        /// The conditioning vector, with its window's when computed ahead.
        vec: Conditioning,
        pe: Tensor,
        seq: Option<SeqSlice>,
        /// Token-split tensor parallelism: `img` and `txt` are this rank's shares.
        split: Option<TokenSplit>,
    },
    Single {
        x: Tensor,
        vec: Conditioning,
        pe: Tensor,
        /// Text tokens at the front of `x` (this rank's, under sequence parallelism).
        txt_len: usize,
        seq: Option<SeqSlice>,
        /// Token-split tensor parallelism: `x` is this tensor-parallel rank's text share
        /// then its image share, and `pe` the table of [`TokenSplit::shared_pe`].
        split: Option<TokenSplit>,
    },
}

/// Which slice of the sequence a sequence-parallel rank holds: text tokens
/// `sequence::split(txt, rank, world)` and image tokens `sequence::split(img, rank,
/// world)`; `pe` is the whole sequence's rotation table (restored on gathering).
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

/// The rotation table of a token split's tokens laid out rank by rank (each rank's text
/// tokens, then its image tokens): the order in which single-stream blocks gather them
/// ([`TokenSplit::gather_single`]).
fn shared_pe(s: &TokenSplit) -> CResult<Tensor> {
    let parts = (0..s.world)
        .map(|r| {
            let (t, i) = s.ranges(r);
            pe_slice(&s.pe, s.txt, &t, &i)
        })
        .collect::<CResult<Vec<_>>>()?;
    Tensor::cat(&parts, 2)
}

/// Every rank's token count: the whole sequence on one rank without `seq`.
fn lens(seq: &Option<SeqSlice>, local: usize) -> Vec<usize> {
    seq.as_ref()
        .map(SeqSlice::lens)
        .unwrap_or_else(|| vec![local])
}

/// The rotation table of this rank's tokens: its text slice, then its image slice.
fn pe_slice(
    pe: &Tensor,
    txt: usize,
    t: &std::ops::Range<usize>,
    i: &std::ops::Range<usize>,
) -> CResult<Tensor> {
    Tensor::cat(
        &[
            pe.narrow(2, t.start, t.len())?,
            pe.narrow(2, txt + i.start, i.len())?,
        ],
        2,
    )?
    .contiguous()
}

impl FluxActs {
    /// Fails on a rank's slice of the sequence: only the whole sequence leaves a part
    /// (moved, sent or fed to the final layer).
    fn whole_sequence_only(&self) -> CResult<()> {
        let (FluxActs::Double { seq, split, .. } | FluxActs::Single { seq, split, .. }) = self;
        if seq.is_some() || split.is_some() {
            candle_core::bail!("a sequence slice cannot leave its part: gather it first");
        }
        Ok(())
    }
}

impl Activations for FluxActs {
    fn map(&self, f: &mut dyn FnMut(&Tensor) -> CResult<Tensor>) -> CResult<Self> {
        self.whole_sequence_only()?;
        Ok(match self {
            FluxActs::Double {
                img, txt, vec, pe, ..
            } => FluxActs::Double {
                img: f(img)?,
                txt: f(txt)?,
                vec: vec.map(f)?,
                pe: f(pe)?,
                seq: None,
                split: None,
            },
            FluxActs::Single {
                x,
                vec,
                pe,
                txt_len,
                ..
            } => FluxActs::Single {
                x: f(x)?,
                vec: vec.map(f)?,
                pe: f(pe)?,
                txt_len: *txt_len,
                seq: None,
                split: None,
            },
        })
    }

    /// Tensors in order: the stream(s), `pe` (and the text length for single blocks),
    /// then the conditioning ([`Conditioning::to_wire`]: one or three tensors).
    fn to_wire(&self) -> CResult<(u8, Vec<Tensor>)> {
        self.whole_sequence_only()?;
        Ok(match self {
            FluxActs::Double {
                img, txt, vec, pe, ..
            } => {
                let mut v = vec![img.clone(), txt.clone(), pe.clone()];
                v.extend(vec.to_wire()?);
                (0, v)
            }
            FluxActs::Single {
                x,
                vec,
                pe,
                txt_len,
                ..
            } => {
                let len = u32::try_from(*txt_len)
                    .map_err(|_| candle_core::Error::Msg(format!("txt_len {txt_len}")))?;
                let tl = Tensor::new(&[len], &Device::Cpu)?;
                let mut v = vec![x.clone(), pe.clone(), tl];
                v.extend(vec.to_wire()?);
                (1, v)
            }
        })
    }

    fn from_wire(tag: u8, mut tensors: Vec<Tensor>) -> CResult<Self> {
        let n = tensors.len();
        let bad = || {
            candle_core::Error::Msg(format!(
                "malformed FLUX activations: tag {tag}, {n} tensors"
            ))
        };
        let head = match tag {
            0 | 1 if n == 4 || n == 6 => 3,
            _ => return Err(bad()),
        };
        let vec = Conditioning::from_wire(tensors.split_off(head))?;
        match (tag, <[Tensor; 3]>::try_from(tensors)) {
            (0, Ok([img, txt, pe])) => Ok(FluxActs::Double {
                img,
                txt,
                vec,
                pe,
                seq: None,
                split: None,
            }),
            (1, Ok([x, pe, tl])) => {
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
                    seq: None,
                    split: None,
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

    fn sp_refusal(&self, tp: usize, sp: usize) -> Option<String> {
        // Heads may split unevenly over the sequence-parallel ranks, but each needs one.
        let heads = self.heads / tp.max(1);
        (sp > heads).then(|| {
            format!(
                "sequence parallel over {sp} ranks needs at least {sp} attention heads per tensor-parallel rank, and there are {heads}: use sp ≤ {heads}"
            )
        })
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
        let guidance = x.guidance.as_ref().map(f32).transpose()?;
        // The window's vectors only where the rank keeps the blocks' outputs.
        let ahead = x.schedule.as_ref().filter(|_| ctx.ahead.is_some());
        let vec = match ahead.and_then(|s| Some((s, s.step?))) {
            Some((s, step)) => {
                // The vectors of this step's window, step-major (`b` rows a step), from
                // the window's times and the fixed pooled text and guidance.
                let b = x.y.dim(0)?;
                let (window, row) = modulation::window_of(step);
                let first = window as usize * modulation::AHEAD_STEPS;
                let last = (first + modulation::AHEAD_STEPS).min(s.times.len());
                let n = last - first;
                let ts: Vec<f32> = s.times[first..last]
                    .iter()
                    .flat_map(|t| std::iter::repeat_n(*t as f32, b))
                    .collect();
                let ts = Tensor::from_vec(ts, n * b, dev)?;
                let y = mv(&x.y)?.repeat((n, 1))?;
                let g = guidance.as_ref().map(|g| g.repeat(n)).transpose()?;
                let rows = stem.vector(&ts, &y, g.as_ref(), dtype)?;
                Conditioning {
                    now: rows.narrow(0, row * b, b)?,
                    ahead: Some(Ahead {
                        rows,
                        row,
                        key: AheadKey {
                            request: s.request,
                            window,
                        },
                    }),
                }
            }
            None => Conditioning::now(stem.vector(
                &f32(&x.timesteps)?,
                &mv(&x.y)?,
                guidance.as_ref(),
                dtype,
            )?),
        };
        let s = stem.tokens(
            &mv(&x.img)?,
            &f32(&x.img_ids)?,
            &mv(&x.txt)?,
            &f32(&x.txt_ids)?,
            vec.now.clone(),
        )?;
        ctx.mark("stem", &s.img);
        Ok(FluxActs::Double {
            img: s.img,
            txt: s.txt,
            vec,
            pe: s.pe,
            seq: None,
            split: None,
        })
    }

    fn scatter_sequence(&self, acts: FluxActs, ctx: &Ctx) -> CResult<FluxActs> {
        let (rank, world) = (ctx.sp.rank(), ctx.sp.world_size());
        if world == 1 {
            return Ok(acts);
        }
        let slice = |txt: usize, img: usize, pe: &Tensor| -> CResult<_> {
            if txt < world || img < world {
                candle_core::bail!(
                    "sequence parallel over {world} ranks needs at least {world} text and {world} image tokens (got {txt} and {img})"
                );
            }
            let t = sequence::split(txt, rank, world);
            let i = sequence::split(img, rank, world);
            let seq = SeqSlice {
                rank,
                world,
                txt,
                img,
                pe: pe.clone(),
            };
            Ok((pe_slice(pe, txt, &t, &i)?, t, i, seq))
        };
        Ok(match acts {
            FluxActs::Double {
                img,
                txt,
                vec,
                pe,
                seq: None,
                split: None,
            } => {
                let (pe_r, t, i, seq) = slice(txt.dim(1)?, img.dim(1)?, &pe)?;
                FluxActs::Double {
                    img: img.narrow(1, i.start, i.len())?.contiguous()?,
                    txt: txt.narrow(1, t.start, t.len())?.contiguous()?,
                    vec,
                    pe: pe_r,
                    seq: Some(seq),
                    split: None,
                }
            }
            FluxActs::Single {
                x,
                vec,
                pe,
                txt_len,
                seq: None,
                split: None,
            } => {
                let (pe_r, t, i, seq) = slice(txt_len, x.dim(1)? - txt_len, &pe)?;
                let x = Tensor::cat(
                    &[
                        x.narrow(1, t.start, t.len())?,
                        x.narrow(1, txt_len + i.start, i.len())?,
                    ],
                    1,
                )?;
                FluxActs::Single {
                    x,
                    vec,
                    pe: pe_r,
                    txt_len: t.len(),
                    seq: Some(seq),
                    split: None,
                }
            }
            _ => candle_core::bail!("scatter of activations already sliced"),
        })
    }

    fn gather_sequence(&self, acts: FluxActs, ctx: &Ctx) -> CResult<FluxActs> {
        // First the tensor-parallel rank's token shares back to its group's whole (this
        // sequence-parallel rank's slice, or the whole sequence).
        let acts = match acts {
            FluxActs::Double {
                img,
                txt,
                vec,
                pe,
                seq,
                split: Some(sp),
            } => {
                sp.check(ctx)?;
                FluxActs::Double {
                    img: sp.gather_stream(&img, sp.img, ctx)?,
                    txt: sp.gather_stream(&txt, sp.txt, ctx)?,
                    vec,
                    pe,
                    seq,
                    split: None,
                }
            }
            FluxActs::Single {
                x,
                vec,
                txt_len,
                seq,
                split: Some(sp),
                ..
            } => {
                sp.check(ctx)?;
                let x = sp.unshare(&sp.gather_single(&x, ctx)?)?;
                FluxActs::Single {
                    x,
                    vec,
                    pe: sp.pe,
                    txt_len,
                    seq,
                    split: None,
                }
            }
            acts => acts,
        };
        // Every rank's [text slice, image slice] to every rank, in one all-to-all; then
        // the text slices in rank order, then the image slices.
        let gather = |local: Tensor, s: &SeqSlice| -> CResult<(Tensor, usize)> {
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
            txt.extend(img);
            Ok((Tensor::cat(&txt, 1)?, s.txt))
        };
        Ok(match acts {
            FluxActs::Double {
                img,
                txt,
                vec,
                seq: Some(s),
                ..
            } => {
                let (x, t) = gather(Tensor::cat(&[&txt, &img], 1)?, &s)?;
                FluxActs::Double {
                    txt: x.narrow(1, 0, t)?.contiguous()?,
                    img: x.narrow(1, t, x.dim(1)? - t)?.contiguous()?,
                    vec,
                    pe: s.pe.clone(),
                    seq: None,
                    split: None,
                }
            }
            FluxActs::Single {
                x,
                vec,
                seq: Some(s),
                ..
            } => {
                let (x, t) = gather(x, &s)?;
                FluxActs::Single {
                    x,
                    vec,
                    pe: s.pe.clone(),
                    txt_len: t,
                    seq: None,
                    split: None,
                }
            }
            whole => whole,
        })
    }

    fn block(&self, b: &FluxBlock, acts: FluxActs, ctx: &Ctx) -> CResult<FluxActs> {
        // The first block of a part splits the tokens where asked (token-split tensor
        // parallelism); the part's end gathers them ([`Transformer::gather_sequence`]).
        Ok(match (b, acts) {
            (
                FluxBlock::Double(b),
                FluxActs::Double {
                    img,
                    txt,
                    vec,
                    pe,
                    seq,
                    split,
                },
            ) => {
                let (txt, img, split) = TokenSplit::streams(split, txt, img, &pe, ctx)?;
                let whole = match &split {
                    Some(s) => s.txt + s.img,
                    None => img.dim(1)? + txt.dim(1)?,
                };
                let lens = lens(&seq, whole);
                let (img, txt) = b.forward(img, txt, &vec, &pe, &lens, split.as_ref(), ctx)?;
                ctx.meter.see(&img);
                FluxActs::Double {
                    img,
                    txt,
                    vec,
                    pe,
                    seq,
                    split,
                }
            }
            (FluxBlock::Single(b), a) => {
                // Single-stream activations: x, its table, its text length, and the split
                // (under which x holds this rank's text and image shares side by side, and
                // the table lists the group's tokens rank by rank).
                let side_by_side = |txt: Tensor, img: Tensor, s: &TokenSplit| -> CResult<_> {
                    Ok((Tensor::cat(&[&txt, &img], 1)?, shared_pe(s)?))
                };
                let (x, vec, pe, txt_len, seq, split) = match a {
                    FluxActs::Double {
                        img,
                        txt,
                        vec,
                        pe,
                        seq,
                        split,
                    } => {
                        let txt_len = split.as_ref().map_or(txt.dim(1)?, |s| s.txt);
                        match TokenSplit::streams(split, txt, img, &pe, ctx)? {
                            (txt, img, Some(s)) => {
                                let (x, pe) = side_by_side(txt, img, &s)?;
                                (x, vec, pe, txt_len, seq, Some(s))
                            }
                            (txt, img, None) => {
                                let x = Tensor::cat(&[&txt, &img], 1)?;
                                (x, vec, pe, txt_len, seq, None)
                            }
                        }
                    }
                    FluxActs::Single {
                        x,
                        vec,
                        pe,
                        txt_len,
                        seq,
                        split: None,
                    } => {
                        let img_len = x.dim(1)? - txt_len;
                        let (t, i) = (x.narrow(1, 0, txt_len)?, x.narrow(1, txt_len, img_len)?);
                        match TokenSplit::streams(None, t, i, &pe, ctx)? {
                            (t, i, Some(s)) => {
                                let (x, pe) = side_by_side(t, i, &s)?;
                                (x, vec, pe, txt_len, seq, Some(s))
                            }
                            (_, _, None) => (x, vec, pe, txt_len, seq, None),
                        }
                    }
                    FluxActs::Single {
                        x,
                        vec,
                        pe,
                        txt_len,
                        seq,
                        split,
                    } => (x, vec, pe, txt_len, seq, split),
                };
                let whole = match &split {
                    Some(s) => s.txt + s.img,
                    None => x.dim(1)?,
                };
                let lens = lens(&seq, whole);
                let x = b.forward(x, &vec, &pe, &lens, split.as_ref(), ctx)?;
                ctx.meter.see(&x);
                FluxActs::Single {
                    x,
                    vec,
                    pe,
                    txt_len,
                    seq,
                    split,
                }
            }
            (FluxBlock::Double(_), FluxActs::Single { .. }) => {
                candle_core::bail!("a double block after single blocks")
            }
        })
    }

    fn final_layer(&self, f: &FinalLayer, acts: FluxActs, ctx: &Ctx) -> CResult<Tensor> {
        acts.whole_sequence_only()?;
        let (img, vec) = match acts {
            FluxActs::Double { img, vec, .. } => (img, vec),
            FluxActs::Single {
                x, vec, txt_len, ..
            } => (x.i((.., txt_len..))?, vec),
        };
        ctx.mark_start(&img);
        let out = f.forward(&img, &vec.now)?;
        ctx.mark("final layer", &out);
        ctx.meter.see(&out);
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Activations cross a process boundary with their conditioning's window (six
    /// tensors) or without it (four), in either block kind.
    #[test]
    fn activations_cross_the_wire_with_their_window() {
        let t = |n: usize| Tensor::ones((1, n, 4), DType::F32, &Device::Cpu).unwrap();
        let v = |n: usize| Tensor::ones((n, 4), DType::F32, &Device::Cpu).unwrap();
        let ahead = Conditioning {
            now: v(1),
            ahead: Some(Ahead {
                rows: v(3),
                row: 1,
                key: AheadKey {
                    request: 9,
                    window: 2,
                },
            }),
        };
        for vec in [ahead, Conditioning::now(v(1))] {
            let with = vec.ahead.is_some();
            let acts = [
                FluxActs::Double {
                    img: t(4),
                    txt: t(2),
                    vec: vec.clone(),
                    pe: t(6),
                    seq: None,
                    split: None,
                },
                FluxActs::Single {
                    x: t(6),
                    vec,
                    pe: t(6),
                    txt_len: 2,
                    seq: None,
                    split: None,
                },
            ];
            for a in acts {
                let (tag, wire) = a.to_wire().unwrap();
                assert_eq!(wire.len(), if with { 6 } else { 4 });
                let back = FluxActs::from_wire(tag, wire).unwrap();
                let (FluxActs::Double { vec, .. } | FluxActs::Single { vec, .. }) = back;
                match vec.ahead {
                    Some(a) => {
                        assert!(with);
                        assert_eq!((a.row, a.key.request, a.key.window), (1, 9, 2));
                        assert_eq!(a.rows.dims(), [3, 4]);
                    }
                    None => assert!(!with),
                }
            }
        }
        assert!(FluxActs::from_wire(0, vec![t(1); 5]).is_err());
    }

    /// A rank's slice of the sequence never leaves its part: moving, sending or feeding it
    /// to the final layer is refused; the whole sequence passes.
    #[test]
    fn only_the_whole_sequence_leaves_a_part() {
        let t = |n: usize| Tensor::zeros((1, n, 4), DType::F32, &Device::Cpu).unwrap();
        let seq = SeqSlice {
            rank: 0,
            world: 2,
            txt: 2,
            img: 4,
            pe: t(6),
        };
        let whole = FluxActs::Single {
            x: t(6),
            vec: Conditioning::now(t(1)),
            pe: t(6),
            txt_len: 2,
            seq: None,
            split: None,
        };
        let shared = FluxActs::Single {
            x: t(3),
            vec: Conditioning::now(t(1)),
            pe: t(6),
            txt_len: 2,
            seq: None,
            split: Some(TokenSplit {
                rank: 0,
                world: 2,
                txt: 2,
                img: 4,
                pe: t(6),
            }),
        };
        let sliced = FluxActs::Double {
            img: t(2),
            txt: t(1),
            vec: Conditioning::now(t(1)),
            pe: t(3),
            seq: Some(seq),
            split: None,
        };
        assert!(whole.to_wire().is_ok() && whole.map(&mut |x| Ok(x.clone())).is_ok());
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
