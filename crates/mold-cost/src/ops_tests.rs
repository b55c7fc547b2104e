//! The operation breakdown, interpolation, and the cost model with operation tables.

use super::*;
use crate::{evaluate, Ctx, Group};
use mold_machine::{AttentionPoint, CollectivePoint, GemmPoint, Machine};
use mold_plan::DType;

const TWO: &str = r#"
name: unit
calibration: {source: measured}
host: {memory: 64GiB, pinned_limit: 1GiB, tflops: 1.0, mem_bandwidth_gbps: 50}
devices:
- {id: cuda:0, name: G, memory: 80GiB, budget: 80GiB, headroom: 1GiB, bf16_tflops: 500, mem_bandwidth_gbps: 3000}
- {id: cuda:1, name: G, memory: 80GiB, budget: 80GiB, headroom: 1GiB, bf16_tflops: 500, mem_bandwidth_gbps: 3000}
links:
  host_pinned_gbps: 50
  host_pageable_gbps: 10
  peer:
  - {devices: [cuda:0, cuda:1], kind: nvlink, gbps: 300, allreduce: {latency_us: 10, gbps: 200}}
"#;

fn two() -> Machine {
    Machine::from_yaml(TWO, "unit").unwrap()
}

/// Synthetic times: a product at 400 TFLOP/s times `gemm_scale`, attention at 300
/// TFLOP/s, collectives 10 µs + bytes at 100 GB/s.
fn tables_for(model: &ModelSpec, dtype: DType, machine: &Machine, gemm_scale: f64) -> OpTables {
    let req = ShapeRequest::default_for(model, 2, vec![2]);
    let shapes = calibration_shapes(model, dtype, &req);
    let mut t = OpTables {
        model: model.id.clone(),
        dtype,
        device: machine.devices[0].name.clone(),
        gemm: shapes
            .gemm
            .iter()
            .map(|g| GemmPoint {
                m: g.m,
                n: g.n,
                k: g.k,
                seconds: gemm_scale * 2.0 * (g.m * g.n * g.k) as f64 / 400e12,
            })
            .collect(),
        attention: shapes
            .attention
            .iter()
            .map(|a| AttentionPoint {
                heads: a.heads,
                seq: a.seq,
                head_dim: a.head_dim,
                seconds: 4.0 * (a.heads * a.head_dim * a.seq * a.seq) as f64 / 300e12,
            })
            .collect(),
        fp8_attention: Vec::new(),
        elementwise_gbps: 1500.0,
        layout_copy_gbps: None,
        htod_busy_ratio: None,
        estimated: None,
        library_bytes: None,
        collectives: Default::default(),
        components: Vec::new(),
    };
    for &(op, n, bytes) in &shapes.collectives {
        let p = CollectivePoint {
            devices: n,
            bytes,
            seconds: 10e-6 + bytes as f64 / 100e9,
        };
        match op {
            CollectiveOp::AllReduce => t.collectives.all_reduce.push(p),
            CollectiveOp::AllGather => t.collectives.all_gather.push(p),
            CollectiveOp::AllToAll => t.collectives.all_to_all.push(p),
        }
    }
    t.sort();
    t.validate("ops[0]").unwrap();
    t
}

fn with_tables(gemm_scale: f64) -> (ModelSpec, Machine) {
    let model = mold_models::find("flux-dev").unwrap();
    let mut m = two();
    let t = tables_for(&model, DType::Bf16, &m, gemm_scale);
    m.set_op_tables(t);
    m.validate("unit").unwrap();
    (model, m)
}

#[test]
fn interpolation_is_exact_at_points_and_log_log_between() {
    let pts = [(100.0, 1.0), (400.0, 2.0), (1600.0, 8.0)];
    for &(x, y) in &pts {
        assert_eq!(loglog(&pts, x, false), Some((y, false)));
    }
    // Halfway in log size between 100 and 400 (200): halfway in log time, √2.
    let (t, out) = loglog(&pts, 200.0, false).unwrap();
    assert!(!out && (t - 2f64.sqrt()).abs() < 1e-12, "{t}");
    // Outside: the nearest point's rate; below with `floor`, its time.
    assert_eq!(loglog(&pts, 3200.0, false), Some((16.0, true)));
    assert_eq!(loglog(&pts, 50.0, false), Some((0.5, true)));
    assert_eq!(loglog(&pts, 50.0, true), Some((1.0, true)));
    assert_eq!(loglog(&[], 5.0, false), None);
    assert_eq!(loglog(&pts, 0.0, false), Some((0.0, false)));
}

/// The breakdown runs the weights the catalogue counts (biases aside) and its FLOPs.
#[test]
fn the_breakdown_covers_the_catalogue_s_weights_and_flops() {
    for id in ["flux-dev", "flux-tiny"] {
        let model = mold_models::find(id).unwrap();
        let t = model.tokens(&model.default_workload);
        for kind in &model.transformer.kinds {
            let ops = block_ops(kind, t, 1, 1, 1, 2).expect(&kind.name);
            let weights: u64 = ops.gemms.iter().map(|g| g.n * g.k).sum();
            // Biases: one per output feature of every product.
            // (the single block's output linear is two partial products with one bias).
            let shared = if kind.streams == 1 { kind.hidden } else { 0 };
            let biases: u64 = ops.gemms.iter().map(|g| g.n).sum::<u64>() - shared;
            // Partial products are row-parallel: the bias after the all-reduce.
            let partial: u64 = ops
                .gemms
                .iter()
                .filter(|g| g.run == Run::Partial)
                .map(|g| g.n)
                .sum();
            assert_eq!(
                partial - shared,
                kind.hidden * kind.allreduces as u64 * kind.streams as u64
            );
            assert_eq!(
                weights + biases,
                kind.sharded_params(),
                "{id} {}",
                kind.name
            );
            // The catalogue counts a bias as a weight (2 FLOPs per token each).
            let flops: f64 = ops
                .gemms
                .iter()
                .map(|g| 2.0 * (g.m * (g.n * g.k + g.n)) as f64)
                .sum::<f64>()
                - 2.0 * (shared * (t.img + t.txt)) as f64;
            let f = kind.flop_parts(t);
            let want = f.token_linear + f.per_sample;
            assert!(
                (flops - want).abs() / want < 1e-12,
                "{id} {}: {flops} vs {want}",
                kind.name
            );
            assert_eq!(ops.attention.heads, kind.heads as u64);
            // Two ways of eight: a quarter of the heads and of the columns, half the rows.
            let q = block_ops(kind, t, 1, 2, 2, 2).unwrap();
            assert_eq!(q.attention.heads, (kind.heads as u64).div_ceil(4));
            assert_eq!(q.attention.seq, t.img + t.txt);
            let wq: u64 = q.gemms.iter().map(|g| g.n * g.k).sum();
            assert!(
                wq * 2 >= weights && wq * 2 < weights + weights / 100,
                "{wq}"
            );
        }
    }
    // Other layouts have no breakdown.
    let ltx = mold_models::find("ltx-video-13b").unwrap();
    let t = ltx.tokens(&ltx.default_workload);
    assert!(block_ops(&ltx.transformer.kinds[0], t, 1, 1, 1, 2).is_none());
}

/// With tables holding every shape, a block costs the sum of its operations exactly.
#[test]
fn a_block_is_the_sum_of_its_measured_operations() {
    let (model, m) = with_tables(1.0);
    let w = model.default_workload.clone();
    let ctx = Ctx::new(&model, &m, &w);
    let t = m.op_tables("flux-dev", DType::Bf16, "G").unwrap();
    for group in [
        Group::single(DeviceId::Cuda(0)),
        Group::tensor(vec![DeviceId::Cuda(0), DeviceId::Cuda(1)]),
        Group::sequence(vec![DeviceId::Cuda(0), DeviceId::Cuda(1)]),
    ] {
        for kind in &model.transformer.kinds {
            let ops = block_ops(kind, ctx.tokens, 1, group.tp, group.sp, 2).unwrap();
            let mut want = ops.elementwise_bytes as f64 / 1500e9;
            for g in &ops.gemms {
                want += 2.0 * (g.m * g.n * g.k) as f64 / 400e12;
            }
            let a = ops.attention;
            want += 4.0 * (a.heads * a.head_dim * a.seq * a.seq) as f64 / 300e12;
            let got = ctx.block_from_tables(kind, &group, DType::Bf16, &DeviceId::Cuda(0));
            let got = got.unwrap();
            assert!(got.extrapolated.is_empty(), "{:?}", got.extrapolated);
            let bc = ctx.block(kind, &group, DType::Bf16);
            assert!(
                (bc.compute_s - want).abs() < 1e-12 * want.max(1.0),
                "{group} {}: {} vs {want}",
                kind.name,
                bc.compute_s
            );
            // Collectives from the tables: 10 µs + bytes at 100 GB/s.
            if group.tp == 2 {
                let hidden = (ctx.tokens.img + ctx.tokens.txt) * kind.hidden * 2;
                // The modulation's all-gather once a window of steps, over its rows
                // (FLUX computes the modulation ahead: 16 + 12 steps of 28).
                let windows = mold_models::modulation_windows(w.steps);
                assert_eq!(windows, [16, 12]);
                let gathers: f64 = windows
                    .iter()
                    .map(|r| 10e-6 + kind.per_sample_bytes(*r, 2) as f64 / 100e9)
                    .sum::<f64>()
                    / w.steps as f64;
                let want = kind.allreduces as f64 * (10e-6 + hidden as f64 / 100e9) + gathers;
                assert!((bc.allreduce_s - want).abs() < 1e-12, "{}", bc.allreduce_s);
            }
            if group.sp == 2 {
                let local = (ctx.tokens.img + ctx.tokens.txt).div_ceil(2);
                let shard = (local * kind.hidden * 2) as f64;
                // The stacked q/k/v (3 shards) and the output (1) from the tables, the
                // copy (2 shards, a batch of one) at the measured element-wise rate.
                // The single block's MLP products (from the tables) hide them where they
                // can (the copy engines take no SM from them).
                let [b0, b1] = crate::ops::beside_all_to_alls(kind, ctx.tokens, 1, group.tp, 2)
                    .map(|g| g.map(|g| 2.0 * (g.m * g.n * g.k) as f64 / 400e12))
                    .unwrap_or([0.0, 0.0]);
                let want = (10e-6 + 3.0 * shard / 100e9 - b0).max(0.0)
                    + (10e-6 + shard / 100e9 - b1).max(0.0)
                    + 2.0 * shard / 1500e9;
                assert!((bc.alltoall_s - want).abs() < 1e-12, "{}", bc.alltoall_s);
            }
        }
    }
    assert!(t.gemm.len() > 20, "{}", t.gemm.len());
}

/// A measured layout-copy rate prices the copies around the sequence-parallel
/// all-to-alls (2 shards at a batch of one), and nothing else: a tensor-parallel or
/// single-device block costs the same.
#[test]
fn the_layout_copy_rate_prices_the_all_to_all_s_copies() {
    let (model, plain) = with_tables(1.0);
    let mut copies = plain.clone();
    let mut t = copies
        .op_tables("flux-dev", DType::Bf16, "G")
        .unwrap()
        .clone();
    t.layout_copy_gbps = Some(500.0);
    copies.set_op_tables(t);
    copies.validate("unit").unwrap();
    let w = model.default_workload.clone();
    let (a, b) = (Ctx::new(&model, &plain, &w), Ctx::new(&model, &copies, &w));
    for kind in &model.transformer.kinds {
        for group in [
            Group::single(DeviceId::Cuda(0)),
            Group::tensor(vec![DeviceId::Cuda(0), DeviceId::Cuda(1)]),
        ] {
            let (x, y) = (
                a.block(kind, &group, DType::Bf16),
                b.block(kind, &group, DType::Bf16),
            );
            assert_eq!(x.resident_s(), y.resident_s(), "{group} {}", kind.name);
        }
        let sp = Group::sequence(vec![DeviceId::Cuda(0), DeviceId::Cuda(1)]);
        let (x, y) = (
            a.block(kind, &sp, DType::Bf16),
            b.block(kind, &sp, DType::Bf16),
        );
        let local = (a.tokens.img + a.tokens.txt).div_ceil(2);
        // The output's pieces joined (1 read, 1 written); the q/k/v messages and the own
        // piece are written in place.
        let copy = 2.0 * (local * kind.hidden * 2) as f64;
        let want = copy / 500e9 - copy / 1500e9;
        assert!(
            (y.alltoall_s - x.alltoall_s - want).abs() < 1e-12,
            "{}: {} vs {want}",
            kind.name,
            y.alltoall_s - x.alltoall_s
        );
        assert_eq!(x.compute_s, y.compute_s);
    }
}

#[test]
fn twice_as_slow_products_take_about_twice_as_long() {
    let (model, fast) = with_tables(1.0);
    let (_, slow) = with_tables(2.0);
    let w = model.default_workload.clone();
    let one = Group::single(DeviceId::Cuda(0));
    for kind in &model.transformer.kinds {
        let a = Ctx::new(&model, &fast, &w)
            .block_from_tables(kind, &one, DType::Bf16, &DeviceId::Cuda(0))
            .unwrap();
        let b = Ctx::new(&model, &slow, &w)
            .block_from_tables(kind, &one, DType::Bf16, &DeviceId::Cuda(0))
            .unwrap();
        assert!((b.gemm_s / a.gemm_s - 2.0).abs() < 1e-9);
        assert_eq!(b.attention_s, a.attention_s);
        assert_eq!(b.elementwise_s, a.elementwise_s);
        // The products are most of a FLUX block.
        let ratio = b.total_s() / a.total_s();
        assert!(ratio > 1.5 && ratio < 2.0, "{ratio}");
    }
}

/// Tables for another model, dtype or device name leave the peak-rate model as it was;
/// a size beyond the tables is priced at the nearest point's rate and reported.
#[test]
fn without_matching_tables_nothing_changes_and_outside_is_reported() {
    let (model, with) = with_tables(1.0);
    let plain = two();
    let w = model.default_workload.clone();
    let one = Group::single(DeviceId::Cuda(0));
    let kind = &model.transformer.kinds[0];
    let base = Ctx::new(&model, &plain, &w).block(kind, &one, DType::Bf16);
    for change in [
        |m: &mut Machine| m.ops[0].model = "flux-schnell".into(),
        |m: &mut Machine| m.ops[0].dtype = DType::F32,
        |m: &mut Machine| m.ops[0].device = "H".into(),
    ] {
        let mut m = with.clone();
        change(&mut m);
        assert_eq!(
            Ctx::new(&model, &m, &w).block(kind, &one, DType::Bf16),
            base
        );
    }
    assert_ne!(
        Ctx::new(&model, &with, &w).block(kind, &one, DType::Bf16),
        base
    );
    // Twice the largest measured side: outside the range.
    let mut big = w.clone();
    big.width *= 4;
    big.height *= 4;
    let ctx = Ctx::new(&model, &with, &big);
    let t = ctx
        .block_from_tables(kind, &one, DType::Bf16, &DeviceId::Cuda(0))
        .unwrap();
    assert!(!t.extrapolated.is_empty());
    assert!(t.extrapolated[0]
        .to_string()
        .contains("outside the measured"));
    // A missing product shape: not covered, the peak-rate model prices it.
    let mut gap = with.clone();
    let n = block_ops(kind, ctx.tokens, 1, 1, 1, 2).unwrap().gemms[0].n;
    gap.ops[0].gemm.retain(|p| p.n != n);
    let got =
        Ctx::new(&model, &gap, &w).block_from_tables(kind, &one, DType::Bf16, &DeviceId::Cuda(0));
    assert!(matches!(got, Err(NotCovered::Gemm { .. })), "{got:?}");
}

#[test]
fn measured_encoders_and_decoder_price_their_phases() {
    let model = mold_models::find("flux-dev").unwrap();
    let plain = two();
    let w = model.default_workload.clone();
    let on = DeviceId::Cuda(0);
    let px = (w.width * w.height) as u64;
    let mut m = plain.clone();
    let mut t = tables_for(&model, DType::Bf16, &m, 1.0);
    let point = |c: &str, dtype: DType, size: u64, seconds: f64| mold_machine::ComponentPoint {
        component: c.into(),
        dtype,
        size,
        seconds,
        first_use_seconds: None,
    };
    let t5 = model.component("t5").unwrap();
    let vae = model.component("vae").unwrap();
    t.components = vec![
        point("t5", t5.default_dtype, model.text_tokens as u64, 0.25),
        point("vae", vae.default_dtype, px / 4, 0.2),
        point("vae", vae.default_dtype, px, 0.6),
    ];
    t.sort();
    t.validate("ops[0]").unwrap();
    m.set_op_tables(t);
    let ctx = Ctx::new(&model, &m, &w);
    // At a measured size: the measurement (an encoder once per prompt).
    let prompts = w.effective_batch() as f64;
    assert_eq!(ctx.component_s(t5, &on, t5.default_dtype), 0.25 * prompts);
    assert_eq!(ctx.component_s(vae, &on, vae.default_dtype), 0.6);
    // Between two sizes: between their times; beyond: scaled by pixels.
    let mut half = w.clone();
    half.width /= 2;
    half.height = half.height * 3 / 4;
    let between = Ctx::new(&model, &m, &half).component_s(vae, &on, vae.default_dtype);
    assert!(between > 0.2 && between < 0.6, "{between}");
    let mut big = w.clone();
    big.width *= 2;
    let s = Ctx::new(&model, &m, &big).component_s(vae, &on, vae.default_dtype);
    assert!((s - 1.2).abs() < 1e-9, "{s}");
    // Another dtype, another kind of device, or no point: the FLOPs model, unchanged.
    let base = Ctx::new(&model, &plain, &w);
    assert_eq!(
        ctx.component_s(vae, &on, DType::F32),
        base.component_s(vae, &on, DType::F32)
    );
    let clip = model.component("clip").unwrap();
    assert_eq!(
        ctx.component_s(clip, &on, clip.default_dtype),
        base.component_s(clip, &on, clip.default_dtype)
    );
    // Calibrated again with another transformer dtype: the newest table's runs count.
    let mut again = m.clone();
    let mut t32 = tables_for(&model, DType::F32, &again, 1.0);
    t32.components = vec![point("vae", vae.default_dtype, px, 0.3)];
    again.set_op_tables(t32);
    assert_eq!(
        Ctx::new(&model, &again, &w).component_s(vae, &on, vae.default_dtype),
        0.3
    );
    let mut other = m.clone();
    other.ops[0].device = "H".into();
    assert_eq!(
        Ctx::new(&model, &other, &w).component_s(vae, &on, vae.default_dtype),
        base.component_s(vae, &on, vae.default_dtype)
    );
}

/// A point's `first_use_seconds` comes out beside the warm time, never in it: the
/// encoder's point at the prompt length, the decoder's nearest measured size, once (not
/// per prompt); without it, `None` and the same warm times.
#[test]
fn first_use_is_the_nearest_points_and_apart_from_the_warm_time() {
    let model = mold_models::find("flux-dev").unwrap();
    let w = model.default_workload.clone();
    let on = DeviceId::Cuda(0);
    let px = (w.width * w.height) as u64;
    let t5 = model.component("t5").unwrap();
    let vae = model.component("vae").unwrap();
    let profile = |first: [Option<f64>; 3]| {
        let mut m = two();
        let mut t = tables_for(&model, DType::Bf16, &m, 1.0);
        let point =
            |c: &str, dtype, size, seconds, first_use_seconds| mold_machine::ComponentPoint {
                component: String::from(c),
                dtype,
                size,
                seconds,
                first_use_seconds,
            };
        t.components = vec![
            point(
                "t5",
                t5.default_dtype,
                model.text_tokens as u64,
                0.25,
                first[0],
            ),
            point("vae", vae.default_dtype, px / 4, 0.2, first[1]),
            point("vae", vae.default_dtype, px, 0.6, first[2]),
        ];
        t.sort();
        t.validate("ops[0]").unwrap();
        m.set_op_tables(t);
        m
    };
    let with = profile([Some(0.1), Some(0.05), Some(0.04)]);
    let without = profile([None, None, None]);
    let est = |m: &Machine, w: &mold_plan::Workload, c| {
        Ctx::new(&model, m, w)
            .component_estimate(c, &on, c.default_dtype)
            .unwrap()
    };
    let prompts = w.effective_batch() as f64;
    let e = est(&with, &w, t5);
    assert_eq!((e.seconds, e.first_use_s), (0.25 * prompts, Some(0.1)));
    let e = est(&with, &w, vae);
    assert_eq!((e.seconds, e.first_use_s), (0.6, Some(0.04)));
    // A quarter of the pixels and a little more: the nearer point, the smaller size.
    let mut small = w.clone();
    small.width /= 2;
    small.height = small.height * 9 / 16;
    assert_eq!(est(&with, &small, vae).first_use_s, Some(0.05));
    // Twice the frames and samples: the warm time scales, the first use does not.
    let mut two_images = w.clone();
    two_images.batch = 2;
    let e = est(&with, &two_images, vae);
    assert_eq!((e.seconds, e.first_use_s), (1.2, Some(0.04)));
    // Without the field: no first use, and every warm time as before.
    for c in [t5, vae] {
        let (a, b) = (est(&with, &w, c), est(&without, &w, c));
        assert_eq!(b.first_use_s, None);
        assert_eq!(a.seconds, b.seconds);
        assert_eq!(
            Ctx::new(&model, &with, &w).component_s(c, &on, c.default_dtype),
            Ctx::new(&model, &without, &w).component_s(c, &on, c.default_dtype)
        );
    }
}

proptest::proptest! {
    /// Random tables (any sizes, any positive times, a few points or many) never make a
    /// block's time panic, go non-finite or negative; interpolation stays between the
    /// neighbouring points.
    #[test]
    fn random_tables_give_finite_times(
        seed in proptest::collection::vec((1u64..20_000, 1e-7f64..1.0), 1..12),
        scale in 1e-3f64..1e3,
        side in 1u32..=4,
    ) {
        let (model, mut m) = with_tables(1.0);
        let mut rng = seed.iter().cycle();
        for p in m.ops[0].gemm.iter_mut() {
            p.seconds = rng.next().unwrap().1 * scale;
        }
        for p in m.ops[0].attention.iter_mut() {
            p.seconds = rng.next().unwrap().1;
        }
        // Random points for one product, replacing its measured ones.
        let (n, k) = (m.ops[0].gemm[0].n, m.ops[0].gemm[0].k);
        m.ops[0].gemm.retain(|p| (p.n, p.k) != (n, k));
        for &(mm, s) in &seed {
            m.ops[0].gemm.push(GemmPoint { m: mm, n, k, seconds: s });
        }
        m.ops[0].gemm.sort_by_key(|p| (p.n, p.k, p.m));
        m.ops[0].gemm.dedup_by_key(|p| (p.n, p.k, p.m));
        m.validate("p").unwrap();
        let curve = m.ops[0].gemm_curve(n, k);
        for pair in curve.windows(2) {
            let mid = ((pair[0].0.ln() + pair[1].0.ln()) / 2.0).exp();
            let (t, out) = loglog(&curve, mid, false).unwrap();
            proptest::prop_assert!(!out);
            proptest::prop_assert!(t >= pair[0].1.min(pair[1].1) && t <= pair[0].1.max(pair[1].1));
        }
        let mut w = model.default_workload.clone();
        w.width = 256 * side;
        w.height = 256 * side;
        let ctx = Ctx::new(&model, &m, &w);
        for g in [
            Group::single(DeviceId::Cuda(0)),
            Group::tensor(vec![DeviceId::Cuda(0), DeviceId::Cuda(1)]),
            Group::sequence(vec![DeviceId::Cuda(0), DeviceId::Cuda(1)]),
        ] {
            for kind in &model.transformer.kinds {
                let bc = ctx.block(kind, &g, DType::Bf16);
                for v in [bc.compute_s, bc.allreduce_s, bc.alltoall_s] {
                    proptest::prop_assert!(v.is_finite() && v >= 0.0, "{v}");
                }
                proptest::prop_assert!(bc.compute_s > 0.0);
            }
        }
        let _ = evaluate;
    }
}

/// A copy rate measured beside the model's own blocks prices that model's streamed
/// copies, in preference to the profile's GEMM-only rate; other models keep the profile's.
#[test]
fn the_copy_rate_beside_the_model_s_blocks_is_preferred() {
    let (model, mut m) = with_tables(1.0);
    let w = model.default_workload.clone();
    let kind = &model.transformer.kinds[0];
    let one = Group::single(DeviceId::Cuda(0));
    let pair = Group::tensor(vec![DeviceId::Cuda(0), DeviceId::Cuda(1)]);
    let contention = |m: &Machine, g: &Group| Ctx::new(&model, m, &w).block(kind, g, DType::Bf16);
    // Neither rate: copies beside compute run at the idle rate.
    assert_eq!(contention(&m, &one).copy_contention, 0.0);
    // The profile's GEMM-only rate alone.
    m.links.host_pinned_busy_gbps = Some(45.0);
    assert!((contention(&m, &one).copy_contention - 0.1).abs() < 1e-12);
    // The table's ratio wins, for this model and dtype.
    m.ops[0].htod_busy_ratio = Some(0.75);
    let b = contention(&m, &one);
    assert!((b.copy_contention - 0.25).abs() < 1e-12, "{b:?}");
    assert!(
        (b.streamed_s() - (b.copy_s + 0.25 * b.resident_s()).max(b.resident_s())).abs() < 1e-15
    );
    assert!((contention(&m, &pair).copy_contention - 0.25).abs() < 1e-12);
    // Not for another dtype's blocks (no table): the profile's rate.
    let other = Ctx::new(&model, &m, &w).block(kind, &one, DType::Fp16);
    assert!((other.copy_contention - 0.1).abs() < 1e-12, "{other:?}");
    // A measured ratio above 1 is noise: no faster than idle.
    m.ops[0].htod_busy_ratio = Some(1.2);
    assert_eq!(contention(&m, &one).copy_contention, 0.0);
}

/// The mixes a mixed calibration times hold every product and attention shape the
/// tables are asked for, each block once, and the default workload's one-rank blocks
/// among them (so what is priced was timed inside its own block).
#[test]
fn the_calibration_s_mixes_cover_every_shape_once() {
    for id in ["flux-dev", "flux-tiny", "qwen-image"] {
        let model = mold_models::find(id).unwrap();
        let req = ShapeRequest::default_for(&model, 4, vec![2, 4]);
        let shapes = calibration_shapes(&model, DType::Bf16, &req);
        assert!(!shapes.mixes.is_empty(), "{id}");
        for g in &shapes.gemm {
            assert!(
                shapes.mixes.iter().any(|b| b.gemms.contains(g)),
                "{id}: {g:?} in no mix"
            );
        }
        for a in &shapes.attention {
            assert!(
                shapes.mixes.iter().any(|b| b.attention == *a),
                "{id}: {a:?} in no mix"
            );
        }
        for (i, b) in shapes.mixes.iter().enumerate() {
            assert!(!shapes.mixes[..i].contains(b), "{id}: mix {i} twice");
        }
        for b in &shapes.blocks {
            assert!(shapes.mixes.contains(b), "{id}: a default block not timed");
        }
    }
}

/// Tables scaled from another GPU say so wherever the block times are explained.
#[test]
fn estimated_tables_are_named_as_an_estimate() {
    let (model, mut m) = with_tables(1.0);
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let plan = mold_plan::Plan::load(&root.join("plans/flux-dev@2x-h200.yaml")).unwrap();
    let measured = describe(&plan, &model, &m).join("\n");
    assert!(measured.contains("calibrated by operation"), "{measured}");
    m.ops[0].estimated = Some("scaled by spec sheet from X (p, 2026-11-27)".into());
    let estimated = describe(&plan, &model, &m).join("\n");
    assert!(
        estimated.contains("an estimate") && estimated.contains("scaled by spec sheet from X"),
        "{estimated}"
    );
    assert!(
        !estimated.contains("calibrated by operation"),
        "{estimated}"
    );
}

/// Under sequence parallelism FLUX's single block queues its MLP products beside its two
/// all-to-alls (the copy engines take no SM from them), so on two GPUs of one peer domain each
/// all-to-all costs only what its product does not hide; staged through the host (no peer
/// domain, no copy engines between the GPUs) it costs in full, and the double block, with
/// nothing beside its all-to-alls, costs in full either way.
#[test]
fn the_single_block_s_all_to_alls_hide_behind_its_mlp_products_over_a_peer_domain() {
    let model = mold_models::find("flux-dev").unwrap();
    let peer = two();
    let staged = Machine::from_yaml(
        &TWO.replace(
            "  peer:\n  - {devices: [cuda:0, cuda:1], kind: nvlink, gbps: 300, allreduce: {latency_us: 10, gbps: 200}}\n",
            "",
        ),
        "unit",
    )
    .unwrap();
    assert!(staged.links.peer.is_empty());
    let w = model.default_workload.clone();
    let sp = Group::sequence(vec![DeviceId::Cuda(0), DeviceId::Cuda(1)]);
    let ids = [DeviceId::Cuda(0), DeviceId::Cuda(1)];
    let mut singles = 0;
    for kind in &model.transformer.kinds {
        for m in [&peer, &staged] {
            let ctx = Ctx::new(&model, m, &w);
            let bc = ctx.block(kind, &sp, DType::Bf16);
            let local = (ctx.tokens.img + ctx.tokens.txt).div_ceil(2);
            let shard = (local * kind.hidden * 2) as f64;
            let c = m.group_link(&ids).collective;
            let t = [
                crate::alltoall_s(&c, 3.0 * shard / 2.0, 2),
                crate::alltoall_s(&c, shard / 2.0, 2),
            ];
            let copy = 2.0 * shard / 3000e9;
            let beside = beside_all_to_alls(kind, ctx.tokens, 1, 1, 2);
            let want = match (beside, m.links.peer.is_empty()) {
                (Some(g), false) => {
                    singles += 1;
                    // At the device's rate: its FLOPs, or reading its weights.
                    let b = g.map(|g| {
                        (2.0 * (g.m * g.n * g.k) as f64 / 500e12)
                            .max((g.n * g.k * 2) as f64 / 3000e9)
                    });
                    assert!(b[0] > 0.0 && b[1] > 0.0);
                    (t[0] - b[0]).max(0.0) + (t[1] - b[1]).max(0.0) + copy
                }
                _ => t[0] + t[1] + copy,
            };
            assert!(
                (bc.alltoall_s - want).abs() < 1e-12,
                "{} peer {}: {} vs {want}",
                kind.name,
                !m.links.peer.is_empty(),
                bc.alltoall_s
            );
        }
    }
    assert_eq!(singles, 1, "one single-stream kind in FLUX");
    // What runs beside them: the MLP in (bias + GELU) and the MLP out (partial), over the
    // rank's tokens; nothing for the double block, nor on one rank.
    let single = model
        .transformer
        .kinds
        .iter()
        .find(|k| k.name == "single")
        .unwrap();
    let double = model
        .transformer
        .kinds
        .iter()
        .find(|k| k.name == "double")
        .unwrap();
    let tokens = model.tokens(&w);
    let [a, b] = beside_all_to_alls(single, tokens, 1, 2, 2).unwrap();
    let m = (tokens.txt + tokens.img).div_ceil(2);
    assert_eq!(
        (a.m, a.n, a.k, a.run),
        (m, single.mlp_hidden / 2, single.hidden, Run::BiasGelu)
    );
    assert_eq!(
        (b.m, b.n, b.k, b.run),
        (m, single.hidden, single.mlp_hidden / 2, Run::Partial)
    );
    assert!(beside_all_to_alls(double, tokens, 1, 1, 2).is_none());
    assert!(beside_all_to_alls(single, tokens, 1, 1, 1).is_none());
    // Four GPUs of one peer domain keep NCCL's all-to-all (the copy engines carry groups of
    // two): the single block pays its all-to-alls in full.
    let four = Machine::from_yaml(
        &TWO.replace(
            "- {id: cuda:1,",
            "- {id: cuda:2, name: G, memory: 80GiB, budget: 80GiB, headroom: 1GiB, bf16_tflops: 500, mem_bandwidth_gbps: 3000}\n\
             - {id: cuda:3, name: G, memory: 80GiB, budget: 80GiB, headroom: 1GiB, bf16_tflops: 500, mem_bandwidth_gbps: 3000}\n\
             - {id: cuda:1,",
        )
        .replace("devices: [cuda:0, cuda:1]", "devices: [cuda:0, cuda:1, cuda:2, cuda:3]"),
        "unit",
    )
    .unwrap();
    let ids4: Vec<DeviceId> = (0..4).map(DeviceId::Cuda).collect();
    let ctx = Ctx::new(&model, &four, &w);
    let bc = ctx.block(single, &Group::sequence(ids4.clone()), DType::Bf16);
    assert!(!crate::copies_beside(&four, &ids4));
    assert!(crate::copies_beside(&peer, &ids));
    let shard = ((ctx.tokens.img + ctx.tokens.txt).div_ceil(4) * single.hidden * 2) as f64;
    let c = four.group_link(&ids4).collective;
    let want = crate::alltoall_s(&c, 3.0 * shard * 3.0 / 4.0, 4)
        + crate::alltoall_s(&c, shard * 3.0 / 4.0, 4)
        + 2.0 * shard / 3000e9;
    assert!(
        (bc.alltoall_s - want).abs() < 1e-12,
        "{} vs {want}",
        bc.alltoall_s
    );
}

/// FP8 attention: an FP8 block of a plan with `attention: fp8` prices its attention from
/// the FP8 table's `fp8_attention` points, less the projection's quantizing pass it makes
/// unneeded; without those points, as the table's attention (nothing less), said as a note;
/// a dense block, or a plan without it, never.
#[test]
fn fp8_attention_is_priced_from_its_own_points() {
    let model = mold_models::find("flux-dev").unwrap();
    let mut m = two();
    let mut t = tables_for(&model, DType::Fp8, &m, 1.0);
    let dense = t.clone();
    t.fp8_attention = t
        .attention
        .iter()
        .map(|a| AttentionPoint {
            seconds: a.seconds * 0.7,
            ..*a
        })
        .collect();
    t.validate("ops[0]").unwrap();
    m.set_op_tables(t.clone());
    m.set_op_tables(tables_for(&model, DType::Bf16, &m, 1.0));
    let w = model.default_workload.clone();
    let one = Group::single(DeviceId::Cuda(0));
    let cuda0 = DeviceId::Cuda(0);
    let plain = Ctx::new(&model, &m, &w);
    let fp8 = Ctx {
        fp8_attention: true,
        ..Ctx::new(&model, &m, &w)
    };
    // The attention projection's own quantizing pass at the element-wise rate, over `sp`
    // ranks: the products whose input is every head of the rank's shard (`sp` times the
    // heads its attention covers), the e4m3 values and a scale a row written.
    let projection_pass = |kind: &mold_models::BlockKind, sp: u64| -> f64 {
        let ops = block_ops(kind, plain.tokens, 1, 1, sp as u32, 2).unwrap();
        let width = sp * ops.attention.heads * ops.attention.head_dim;
        let projections: Vec<_> = ops
            .gemms
            .iter()
            .filter(|g| g.run == Run::Partial && g.k == width)
            .collect();
        assert!(!projections.is_empty(), "{} sp {sp}", kind.name);
        projections
            .iter()
            .map(|g| g.m as f64 * (3.0 * g.k as f64 + 4.0) / (t.elementwise_gbps * 1e9))
            .sum()
    };
    for kind in &model.transformer.kinds {
        let a = plain
            .block_from_tables(kind, &one, DType::Fp8, &cuda0)
            .unwrap();
        let b = fp8
            .block_from_tables(kind, &one, DType::Fp8, &cuda0)
            .unwrap();
        assert!(
            (b.attention_s / a.attention_s - 0.7).abs() < 1e-9,
            "{}",
            kind.name
        );
        // The attention projection's own quantizing pass is not run: its bytes at the
        // element-wise rate come off the products.
        let saved = projection_pass(kind, 1);
        assert!((a.gemm_s - b.gemm_s - saved).abs() < 1e-12, "{}", kind.name);
        assert_eq!(b.elementwise_s, a.elementwise_s);
        assert!(b.extrapolated.is_empty());
        assert_eq!(
            (a.attention, b.attention),
            (AttentionPrice::Dense, AttentionPrice::Fp8)
        );
        // The whole block, as the planner and simulator see it.
        assert!(
            fp8.block(kind, &one, DType::Fp8).compute_s
                < plain.block(kind, &one, DType::Fp8).compute_s
        );
        // A dense block keeps its attention.
        assert_eq!(
            fp8.block_from_tables(kind, &one, DType::Bf16, &cuda0),
            plain.block_from_tables(kind, &one, DType::Bf16, &cuda0)
        );
    }
    // Under sequence parallelism: the points, and the projection's quantizing pass saved as
    // on one rank (q, k and v are quantized before they are sent, the e4m3 output comes
    // back as it is, the projection takes it: every head of the rank's shard, `sp` times the
    // heads its attention covers); the all-to-alls carry e4m3, half the bytes, after the
    // maxima's exchange.
    let sp2 = Group::sequence(vec![DeviceId::Cuda(0), DeviceId::Cuda(1)]);
    let mut cheaper = 0;
    for kind in &model.transformer.kinds {
        let a = plain
            .block_from_tables(kind, &sp2, DType::Fp8, &cuda0)
            .unwrap();
        let b = fp8
            .block_from_tables(kind, &sp2, DType::Fp8, &cuda0)
            .unwrap();
        assert!(
            (b.attention_s - 0.7 * a.attention_s).abs() < 1e-12,
            "{}",
            kind.name
        );
        let saved = projection_pass(kind, 2);
        assert!((a.gemm_s - b.gemm_s - saved).abs() < 1e-12, "{}", kind.name);
        let (wide, e4m3) = (
            plain.block(kind, &sp2, DType::Fp8).alltoall_s,
            fp8.block(kind, &sp2, DType::Fp8).alltoall_s,
        );
        // Where nothing runs beside them (the double block) they cost less; where the
        // single block's MLP hides the transfer, the maxima's latency may cost more.
        assert!(e4m3 != wide, "{}", kind.name);
        cheaper += usize::from(e4m3 < wide);
    }
    assert!(cheaper > 0, "no block's all-to-alls got cheaper in e4m3");
    // No FP8 attention measured: attention's price, and a note saying so.
    let mut unmeasured = m.clone();
    unmeasured.set_op_tables(dense);
    let kind = &model.transformer.kinds[0];
    let ctx = Ctx {
        fp8_attention: true,
        ..Ctx::new(&model, &unmeasured, &w)
    };
    let got = ctx
        .block_from_tables(kind, &one, DType::Fp8, &cuda0)
        .unwrap();
    let base = plain
        .block_from_tables(kind, &one, DType::Fp8, &cuda0)
        .unwrap();
    assert_eq!(got.attention_s, base.attention_s);
    assert_eq!(got.attention, AttentionPrice::Fp8Unmeasured);
    // A table in another dtype holding FP8 attention is refused.
    let mut wrong = tables_for(&model, DType::Bf16, &m, 1.0);
    wrong.fp8_attention = t.fp8_attention.clone();
    let e = wrong.validate("ops[0]").unwrap_err();
    assert_eq!(e.0, "ops[0].fp8_attention");
}
