//! Tests of the FLUX blocks: sharded = unsharded, against the reference composition.
use super::*;
use crate::checkpoint::Checkpoint;
use crate::comm::{Comm, LocalComm, ThreadComm};
use crate::model::flux::testdata::write_testdata;
use crate::model::modulation::gather_modulation;
use crate::model::ops::Kernels;
use crate::model::ActivationMeter;
use crate::runtime::{CheckpointSource, ShapeSource};

/// A tiny f32 checkpoint in a fresh temp directory (one per call: tests run in
/// parallel), removed when dropped.
struct TinyCheckpoint {
    ckpt: Checkpoint,
    dir: std::path::PathBuf,
}

impl Drop for TinyCheckpoint {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn tiny_checkpoint(name: &str, seed: u64) -> TinyCheckpoint {
    static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!(
        "mold-exec-flux-{name}-{}-{seed}-{n}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    let path = write_testdata(&FluxConfig::flux_tiny(), &dir, seed, DType::F32).unwrap();
    TinyCheckpoint {
        ckpt: Checkpoint::open(&path).unwrap(),
        dir,
    }
}

fn ctx<'a>(comm: &'a dyn Comm, meter: &'a ActivationMeter) -> Ctx<'a> {
    Ctx {
        comm,
        sp: &crate::comm::LocalComm,
        meter,
        kernels: Kernels::Candle,
        token_split: false,
        profile: None,
        ahead: None,
        slot: 0,
        fp8_attention: false,
    }
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .iter()
        .map(|x| x.to_bits())
        .collect()
}

/// Every rank of a TP group, sharded modulation + all-gather, against the replicated
/// linear: the same bits, for a double block's two streams (one gather) and a single
/// block's modulation.
///
/// Bit-identical needs the CPU matmul to reduce each output the same way whatever the
/// number of outputs: gemm does, except for products of at most 16 × 16 outputs
/// (`batch · out / world ≤ 256`), which it computes with horizontal dot-product
/// kernels. FLUX-sized modulations (≥ 1152 outputs per rank) never get there; the
/// tiny model at TP4 would (48 outputs per rank), hence batch 6 here. Smaller
/// products agree to rounding ([`small_products_agree_to_rounding`]).
#[test]
fn sharded_modulation_equals_replicated_bit_for_bit() {
    check_sharded_modulation(6, true);
}

#[test]
fn small_products_agree_to_rounding() {
    check_sharded_modulation(2, false);
}

fn check_sharded_modulation(batch: usize, exact: bool) {
    let cfg = FluxConfig::flux_tiny();
    let h = cfg.hidden;
    let ckpt = tiny_checkpoint("modulation", 5);
    let cases = [
        (
            vec!["double_blocks.1.img_mod.lin", "double_blocks.1.txt_mod.lin"],
            6 * h,
        ),
        (vec!["single_blocks.2.modulation.lin"], 3 * h),
    ];
    for dtype in [DType::F32, DType::BF16] {
        let src = CheckpointSource {
            ckpt: &ckpt.ckpt,
            dtype,
            fp8: false,
        };
        let vec = Tensor::randn(0f32, 1.0, (batch, h), &Device::Cpu)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        let silu = vec.silu().unwrap();
        for (prefixes, out) in &cases {
            let want: Vec<Tensor> = prefixes
                .iter()
                .map(|p| Linear::load(&src, p).unwrap().forward(&silu).unwrap())
                .collect();
            for world in [1usize, 2, 4] {
                let comms = ThreadComm::group(world);
                let got: Vec<Vec<Tensor>> = std::thread::scope(|s| {
                    let hs: Vec<_> = comms
                        .iter()
                        .map(|c| {
                            let src = &src;
                            let silu = &silu;
                            s.spawn(move || {
                                let shard = Shard {
                                    rank: c.rank(),
                                    world,
                                };
                                let local: Vec<Tensor> = prefixes
                                    .iter()
                                    .map(|p| {
                                        let m = Modulation::load(src, p, *out, shard).unwrap();
                                        let t = m.partial(silu, crate::Kernels::Auto).unwrap();
                                        assert_eq!(t.dims(), &[batch, out / world]);
                                        t
                                    })
                                    .collect();
                                let meter = ActivationMeter::default();
                                let full = gather_modulation(&local, &ctx(c, &meter)).unwrap();
                                for t in &full {
                                    assert_eq!(t.dims(), &[batch, *out]);
                                }
                                full
                            })
                        })
                        .collect();
                    hs.into_iter().map(|h| h.join().unwrap()).collect()
                });
                for (rank, g) in got.iter().enumerate() {
                    let what = format!("{prefixes:?} {dtype:?} world {world} rank {rank}");
                    for (g, w) in g.iter().zip(&want) {
                        if exact {
                            assert_eq!(bits(g), bits(w), "{what}");
                        } else {
                            let err = crate::max_relative_error(g, w).unwrap();
                            let tol = if dtype == DType::F32 { 1e-5 } else { 2e-2 };
                            assert!(err < tol, "{what}: {err}");
                        }
                    }
                }
            }
        }
    }
}

/// A group of one gathers nothing: the slice is the output, as is.
#[test]
fn world_of_one_skips_the_gather() {
    let t = Tensor::arange(0f32, 6.0, &Device::Cpu)
        .unwrap()
        .reshape((2, 3))
        .unwrap();
    let meter = ActivationMeter::default();
    let out = gather_modulation(std::slice::from_ref(&t), &ctx(&LocalComm, &meter)).unwrap();
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].id(), t.id(), "the same tensor, no copy");
}

/// Under TP `w` a rank holds `1/w` of every linear weight (modulation included) and
/// a full copy of only the QK-norm scales and the row-parallel biases; the shapes-only
/// source accounts the same bytes as the real one.
#[test]
fn tp_ranks_hold_a_share_of_everything_but_norms_and_row_biases() {
    let cfg = FluxConfig::flux_tiny();
    let (h, d) = (cfg.hidden as u64, cfg.head_dim as u64);
    let ckpt = tiny_checkpoint("bytes", 6);
    let size = 4u64;
    let src = CheckpointSource {
        ckpt: &ckpt.ckpt,
        dtype: DType::F32,
        fp8: false,
    };
    let shapes = ShapeSource {
        ckpt: &ckpt.ckpt,
        dtype: DType::F32,
        fp8: false,
    };
    let double_full = DoubleBlock::load(&src, &cfg, 0, Shard::FULL)
        .unwrap()
        .bytes();
    let single_full = SingleBlock::load(&src, &cfg, 0, Shard::FULL)
        .unwrap()
        .bytes();
    let spec_bytes = |prefix: &str| -> u64 {
        cfg.tensor_specs()
            .iter()
            .filter(|s| s.name.starts_with(prefix))
            .map(|s| s.shape.iter().product::<usize>() as u64 * size)
            .sum()
    };
    assert_eq!(double_full, spec_bytes("double_blocks.0."));
    assert_eq!(single_full, spec_bytes("single_blocks.0."));
    // Per stream: q and k norm scales, proj and mlp.2 biases.
    let double_rep = 2 * (2 * d + 2 * h) * size;
    // q and k norm scales, linear2's bias.
    let single_rep = (2 * d + h) * size;
    for world in [2usize, 4] {
        let w = world as u64;
        for rank in 0..world {
            let shard = Shard { rank, world };
            let db = DoubleBlock::load(&src, &cfg, 0, shard).unwrap().bytes();
            let sb = SingleBlock::load(&src, &cfg, 0, shard).unwrap().bytes();
            assert_eq!(db, (double_full - double_rep) / w + double_rep, "TP{world}");
            assert_eq!(sb, (single_full - single_rep) / w + single_rep, "TP{world}");
            assert_eq!(
                DoubleBlock::load(&shapes, &cfg, 0, shard).unwrap().bytes(),
                db
            );
            assert_eq!(
                SingleBlock::load(&shapes, &cfg, 0, shard).unwrap().bytes(),
                sb
            );
        }
    }
}

/// `map_tensors` visits every weight once, in a fixed order (the streaming layout
/// relies on it): linear2 as its attention and MLP columns, then its bias.
#[test]
fn single_block_tensor_order() {
    let cfg = FluxConfig::flux_tiny();
    let (h, m, d) = (cfg.hidden, cfg.mlp_hidden(), cfg.head_dim);
    let ckpt = tiny_checkpoint("order", 7);
    let src = ShapeSource {
        ckpt: &ckpt.ckpt,
        dtype: DType::F32,
        fp8: false,
    };
    let shard = Shard { rank: 1, world: 2 };
    let b = SingleBlock::load(&src, &cfg, 0, shard).unwrap();
    let mut shapes = Vec::new();
    b.map_tensors(&mut |t| {
        shapes.push(t.dims().to_vec());
        Ok(t.clone())
    })
    .unwrap();
    let want: Vec<Vec<usize>> = vec![
        vec![(3 * h + m) / 2, h], // linear1
        vec![(3 * h + m) / 2],
        vec![h, h / 2], // linear2, attention columns
        vec![h, m / 2], // linear2, MLP columns
        vec![h],
        vec![d], // q/k norms
        vec![d],
        vec![3 * h / 2, h], // modulation rows
        vec![3 * h / 2],
    ];
    assert_eq!(shapes, want);
    let total: usize = shapes.iter().map(|s| s.iter().product::<usize>()).sum();
    assert_eq!(b.bytes(), total as u64 * 4);
}

/// linear2 over `[attn, mlp]` without the concatenation: two products summed equal
/// the product of the concatenated input (to rounding), on every rank's columns.
#[test]
fn split_linear2_matches_the_concatenated_product() {
    let cfg = FluxConfig::flux_tiny();
    let (h, m) = (cfg.hidden, cfg.mlp_hidden());
    let ckpt = tiny_checkpoint("linear2", 8);
    let src = CheckpointSource {
        ckpt: &ckpt.ckpt,
        dtype: DType::F32,
        fp8: false,
    };
    let attn = Tensor::randn(0f32, 1.0, (2, 5, h), &Device::Cpu).unwrap();
    let mlp = Tensor::randn(0f32, 1.0, (2, 5, m), &Device::Cpu).unwrap();
    let full = Linear::load(&src, "single_blocks.1.linear2").unwrap();
    let want = full
        .forward(&Tensor::cat(&[&attn, &mlp], 2).unwrap())
        .unwrap();
    for world in [1usize, 2, 4] {
        let mut sum: Option<Tensor> = None;
        for rank in 0..world {
            let shard = Shard { rank, world };
            let cols = [shard.segment(0, h), shard.segment(h, m)];
            let l2 = RowParallel::load(&src, "single_blocks.1.linear2", &cols).unwrap();
            let a = attn.narrow(2, cols[0].start, cols[0].len()).unwrap();
            let x = mlp.narrow(2, cols[1].start - h, cols[1].len()).unwrap();
            let p = l2.partial(&[&a, &x], crate::Kernels::Auto).unwrap();
            sum = Some(match sum {
                None => p,
                Some(s) => (s + p).unwrap(),
            });
            if rank == world - 1 {
                let got = l2.add_bias(sum.as_ref().unwrap(), Kernels::Candle).unwrap();
                let err = crate::max_relative_error(&got, &want).unwrap();
                assert!(err < 1e-5, "world {world}: {err}");
            }
        }
    }
}

/// The rotation table is made once for the position tensors of a request (every step's
/// call passes the same ones) and its values are what a fresh stem makes; new position
/// tensors (another request) make a new table.
#[test]
fn the_rotation_table_is_made_once_per_request() {
    let cfg = FluxConfig::flux_tiny();
    let t = tiny_checkpoint("pe-cache", 3);
    let src = CheckpointSource {
        ckpt: &t.ckpt,
        dtype: DType::F32,
        fp8: false,
    };
    let stem = Stem::load(&src, &cfg).unwrap();
    let x = crate::model::flux::inputs::random_inputs(&cfg, 64, 32, 5, 1, 1).unwrap();
    let run = |stem: &Stem, x: &crate::model::flux::FluxInputs, t: f32| {
        stem.forward(
            &x.img,
            &x.img_ids,
            &x.txt,
            &x.txt_ids,
            &Tensor::new(&[t], &Device::Cpu).unwrap(),
            &x.y,
            x.guidance.as_ref(),
        )
        .unwrap()
        .pe
    };
    let first = run(&stem, &x, 0.9);
    let again = run(&stem, &x, 0.5);
    assert_eq!(first.id(), again.id(), "a later step made the table again");
    let fresh = run(&Stem::load(&src, &cfg).unwrap(), &x, 0.5);
    assert_ne!(fresh.id(), first.id());
    assert_eq!(bits(&fresh), bits(&first));
    // Another request's positions (equal values, other tensors): made again.
    let y = crate::model::flux::FluxInputs {
        img_ids: x.img_ids.copy().unwrap(),
        ..x.clone()
    };
    assert_ne!(run(&stem, &y, 0.5).id(), first.id());
}
