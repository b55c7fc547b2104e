use super::*;
use crate::checkpoint::Checkpoint;
use crate::model::flux::testdata::write_testdata;
use crate::model::flux::FluxConfig;
use crate::model::layers::{ColumnParallel, RowParallel};
use crate::model::mat::Mat;
use crate::model::{Shard, WeightSource};
use crate::runtime::{CheckpointSource, ShapeSource};
use proptest::prelude::*;

fn bits(t: &Tensor) -> Vec<u8> {
    t.flatten_all()
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .iter()
        .flat_map(|v| v.to_bits().to_le_bytes())
        .collect()
}

fn q_bits(w: &Fp8Weight) -> Vec<u8> {
    w.values()
        .flatten_all()
        .unwrap()
        .to_vec1::<F8E4M3>()
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

#[test]
fn rounding_saturates_and_keeps_the_grid() {
    assert_eq!(round_e4m3(448.0).to_f32(), 448.0);
    assert_eq!(round_e4m3(1e6).to_f32(), 448.0);
    assert_eq!(round_e4m3(-1e6).to_f32(), -448.0);
    assert_eq!(round_e4m3(0.0).to_f32(), 0.0);
    // 3 mantissa bits: 1.0625 lies halfway between 1 and 1.125 and rounds to even (1.0).
    assert_eq!(round_e4m3(1.0625).to_f32(), 1.0);
    assert_eq!(round_e4m3(1.07).to_f32(), 1.125);
    assert_eq!(row_scale(0.0), (1.0, 1.0));
    assert_eq!(row_scale(f32::NAN), (1.0, 1.0));
    assert_eq!(row_scale(448.0), (1.0, 1.0));
}

/// The conversion is float8's (a port of CUDA's `__nv_cvt_float_to_fp8`, saturating),
/// bit for bit: every e4m3 value, the midpoints between neighbours and either side of them,
/// subnormals, zeros, the saturation edge and NaN.
#[test]
fn rounding_is_floats_conversion_bit_for_bit() {
    let reference = |v: f32| F8E4M3::from_f32(v.clamp(-E4M3_MAX, E4M3_MAX)).to_bits();
    let mut values = vec![
        0.0f32,
        -0.0,
        448.0,
        -448.0,
        447.9,
        449.0,
        464.0,
        1e9,
        -1e9,
        f32::MIN_POSITIVE,
    ];
    let grid: Vec<f32> = (0u8..=0x7e)
        .map(|b| F8E4M3::from_bits(b).to_f32())
        .collect();
    for w in grid.windows(2) {
        let mid = (w[0] + w[1]) / 2.0;
        for v in [w[0], mid, mid.next_up(), mid.next_down(), w[1]] {
            values.push(v);
            values.push(-v);
        }
    }
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    for _ in 0..200_000 {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let v = f32::from_bits((state >> 32) as u32);
        if v.is_finite() {
            values.push(v);
            values.push(v * 1e-30);
            values.push((v % 500.0).abs().min(448.0));
        }
    }
    for v in values {
        assert_eq!(round_e4m3(v).to_bits(), reference(v), "{v:e}");
    }
    assert!(round_e4m3(f32::NAN).to_f32().is_nan());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    /// Every row's largest magnitude maps to ±448 (the scale uses the whole range) and each
    /// value comes back within half an e4m3 step of itself: |w - q·s| ≤ |w|/16 in the
    /// normal range, ≤ s·2⁻¹⁰ below it.
    #[test]
    fn quantized_rows_come_back_within_half_a_step(
        rows in 1usize..6,
        cols in 1usize..40,
        seed in any::<u64>(),
        mag in -20i32..20,
    ) {
        let mut state = seed | 1;
        let data: Vec<f32> = (0..rows * cols)
            .map(|_| {
                state ^= state << 13; state ^= state >> 7; state ^= state << 17;
                ((state >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) as f32 * 2f32.powi(mag)
            })
            .collect();
        let w = Tensor::from_vec(data.clone(), (rows, cols), &Device::Cpu).unwrap();
        let q = Fp8Weight::quantize(&w).unwrap();
        let back = q.dequantize(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let scales = q.scales().to_vec1::<f32>().unwrap();
        let vals = q.values().flatten_all().unwrap().to_vec1::<F8E4M3>().unwrap();
        for r in 0..rows {
            let row = &data[r * cols..(r + 1) * cols];
            let amax = row.iter().fold(0f32, |m, v| m.max(v.abs()));
            if amax > 0.0 {
                let top = vals[r * cols..(r + 1) * cols].iter().fold(0f32, |m, v| m.max(v.to_f32().abs()));
                prop_assert_eq!(top, 448.0);
            }
            for c in 0..cols {
                let (w, b) = (row[c], back[r * cols + c]);
                let bound = w.abs() / 16.0 + scales[r] * 2f32.powi(-10) + 1e-30;
                prop_assert!((w - b).abs() <= bound * 1.0001, "row {} col {}: {} came back {}", r, c, w, b);
            }
        }
    }
}

/// The emulated product equals an f32 product of the dequantized operands (its definition,
/// written out by hand here), bias and GELU included.
#[test]
fn the_emulated_product_is_the_product_of_the_dequantized_operands() {
    let x = Tensor::randn(0f32, 1.0, (2, 3, 32), &Device::Cpu).unwrap();
    let w = Tensor::randn(0f32, 0.2, (16, 32), &Device::Cpu).unwrap();
    let b = Tensor::randn(0f32, 0.1, 16, &Device::Cpu).unwrap();
    let q = Fp8Weight::quantize(&w).unwrap();
    let got = linear(&x, &q, Some(&b), true, Kernels::Auto).unwrap();
    let xq = fake_quantize_rows(&x).unwrap().reshape((6, 32)).unwrap();
    let wd = q.dequantize(DType::F32).unwrap();
    let want = xq
        .matmul(&wd.t().unwrap())
        .unwrap()
        .broadcast_add(&b)
        .unwrap()
        .gelu()
        .unwrap()
        .reshape((2, 3, 16))
        .unwrap();
    assert_eq!(bits(&got), bits(&want));
    // And it is an FP8 approximation of the dense product, not something else.
    let dense = x
        .reshape((6, 32))
        .unwrap()
        .matmul(&w.t().unwrap())
        .unwrap()
        .broadcast_add(&b)
        .unwrap()
        .gelu()
        .unwrap()
        .reshape((2, 3, 16))
        .unwrap();
    let err = crate::max_relative_error(&got, &dense).unwrap();
    assert!(err > 0.0 && err < 0.1, "{err}");
}

/// An input quantized ahead (`Fp8Rows`, as the norm's kernel writes it on a GPU) is the
/// product of its quantized values: here, where no FP8 matmul runs, widened back and taken
/// through the emulated product — the same product as of the activation it came from.
#[test]
fn an_input_quantized_ahead_is_the_same_product() {
    let x = Tensor::randn(0f32, 1.0, (2, 3, 32), &Device::Cpu).unwrap();
    let w = Tensor::randn(0f32, 0.2, (16, 32), &Device::Cpu).unwrap();
    let b = Tensor::randn(0f32, 0.1, 16, &Device::Cpu).unwrap();
    let q = Fp8Weight::quantize(&w).unwrap();
    let xr = Fp8Weight::quantize(&x.reshape((6, 32)).unwrap()).unwrap();
    let rows = Fp8Rows::new(
        xr.values().clone(),
        xr.scales().clone(),
        &[2, 3, 32],
        DType::F32,
    )
    .unwrap();
    assert_eq!(rows.dims(), &[2, 3, 32]);
    assert_eq!(
        bits(&rows.dequantize().unwrap()),
        bits(&fake_quantize_rows(&x).unwrap())
    );
    let got = linear_rows(&rows, &q, Some(&b), true, Kernels::Auto).unwrap();
    let want = linear(&x, &q, Some(&b), true, Kernels::Auto).unwrap();
    assert_eq!(got.dims(), &[2, 3, 16]);
    let err = crate::max_relative_error(&got, &want).unwrap();
    assert!(err < 1e-6, "{err}");
    // Rows that are not the activation's are refused.
    let bad = Fp8Rows::new(
        xr.values().clone(),
        xr.scales().clone(),
        &[2, 2, 32],
        DType::F32,
    );
    assert!(bad.is_err());
    // No GPU here: the norm keeps its output in the compute dtype.
    let (sc, sh) = (
        Tensor::zeros((2, 1, 32), DType::F32, &Device::Cpu).unwrap(),
        Tensor::zeros((2, 1, 32), DType::F32, &Device::Cpu).unwrap(),
    );
    let fused = crate::model::ops::ln_modulate_fp8(&x, &sc, &sh, 1e-6, Kernels::Auto).unwrap();
    assert!(fused.is_none());
}

/// Rows quantized with a scale that is not their own largest magnitude (FP8 attention's
/// output: every token with v's scale) go into the product as they are: its result is the
/// product of the widened rows, not of the rows quantized a second time per token; and
/// tokens narrowed out of them are the same rows.
#[test]
fn rows_with_another_scale_are_multiplied_as_they_are() {
    let x = Tensor::randn(0f32, 1.0, (1, 6, 32), &Device::Cpu).unwrap();
    let w = Tensor::randn(0f32, 0.2, (16, 32), &Device::Cpu).unwrap();
    let q = Fp8Weight::quantize(&w).unwrap();
    // One scale for the whole tensor, as fake_quantize_tensor rounds it.
    let flat: Vec<f32> = x.flatten_all().unwrap().to_vec1().unwrap();
    let amax = flat.iter().fold(0f32, |m, v| m.max(v.abs()));
    let (inv, s) = row_scale(amax);
    let vals: Vec<F8E4M3> = flat.iter().map(|v| round_e4m3(v * inv)).collect();
    let rows = Fp8Rows::new(
        Tensor::from_vec(vals, (6, 32), &Device::Cpu).unwrap(),
        Tensor::from_vec(vec![s; 6], 6, &Device::Cpu).unwrap(),
        &[1, 6, 32],
        DType::F32,
    )
    .unwrap();
    let widened = rows.dequantize().unwrap();
    assert_eq!(bits(&widened), bits(&fake_quantize_tensor(&x).unwrap()));
    let got = linear_rows(&rows, &q, None, false, Kernels::Auto).unwrap();
    let exact = widened
        .broadcast_matmul(&q.dequantize(DType::F32).unwrap().t().unwrap())
        .unwrap();
    let err = crate::max_relative_error(&got, &exact).unwrap();
    assert!(err < 1e-6, "the rows' product: {err}");
    // Quantized again per token (what widening first would give): another result.
    let twice = linear(&widened, &q, None, false, Kernels::Auto).unwrap();
    assert!(crate::max_relative_error(&twice, &exact).unwrap() > 1e-4);
    // Tokens 2..5 of one sample: the same rows and scales.
    let part = rows.narrow_tokens(2, 3).unwrap().unwrap();
    assert_eq!(part.dims(), &[1, 3, 32]);
    assert_eq!(
        bits(&part.dequantize().unwrap()),
        bits(&widened.narrow(1, 2, 3).unwrap())
    );
    // Of two samples, a part of the tokens is not rows side by side.
    let two = Fp8Rows::new(
        rows.rows().values().clone(),
        rows.rows().scales().clone(),
        &[2, 3, 32],
        DType::F32,
    )
    .unwrap();
    assert!(two.narrow_tokens(1, 2).unwrap().is_none());
    assert!(two.narrow_tokens(0, 3).unwrap().is_some());
    assert!(rows.narrow_tokens(5, 2).is_err());
}

/// A conditioning vector's product (the modulation: `Mat::linear_vec`) widens the FP8 weight
/// and keeps its input as given: an f32 product of the input and the dequantized weight,
/// not the product of the input quantized per token that every other FP8 product is.
#[test]
fn the_modulation_keeps_its_input_unquantized() {
    let x = Tensor::randn(0f32, 1.0, (4, 64), &Device::Cpu).unwrap();
    let w = Tensor::randn(0f32, 0.2, (48, 64), &Device::Cpu).unwrap();
    let b = Tensor::randn(0f32, 0.1, 48, &Device::Cpu).unwrap();
    let mat = Mat::Fp8(Fp8Weight::quantize(&w).unwrap());
    let got = mat.linear_vec(&x, &b, Kernels::Auto).unwrap();
    let wd = Fp8Weight::quantize(&w)
        .unwrap()
        .dequantize(DType::F32)
        .unwrap();
    let want = x
        .matmul(&wd.t().unwrap())
        .unwrap()
        .broadcast_add(&b)
        .unwrap();
    assert_eq!(bits(&got), bits(&want));
    let quantized = mat.linear(&x, &b, false, Kernels::Auto).unwrap();
    assert_ne!(bits(&got), bits(&quantized));
    // A dense weight's conditioning product is its plain product.
    let dense = Mat::Dense(w.clone())
        .linear_vec(&x, &b, Kernels::Auto)
        .unwrap();
    let plain = x
        .matmul(&w.t().unwrap())
        .unwrap()
        .broadcast_add(&b)
        .unwrap();
    assert!(crate::max_relative_error(&dense, &plain).unwrap() < 1e-6);
}

struct Tiny {
    ckpt: Checkpoint,
    _dir: tempdir::Dir,
}

mod tempdir {
    pub struct Dir(pub std::path::PathBuf);
    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

fn tiny(seed: u64) -> Tiny {
    let dir = std::env::temp_dir().join(format!("mold-fp8-{}-{seed}", std::process::id()));
    let path = write_testdata(&FluxConfig::flux_tiny(), &dir, seed, DType::F32).unwrap();
    Tiny {
        ckpt: Checkpoint::open(&path).unwrap(),
        _dir: tempdir::Dir(dir),
    }
}

/// A row-parallel shard's FP8 weight is the whole weight's columns: the same e4m3 values
/// and the same per-row scales, whatever the group's size (rows are quantized whole before
/// the columns are taken).
#[test]
fn a_shard_holds_the_whole_weights_values_and_scales() {
    let t = tiny(11);
    let src = CheckpointSource {
        ckpt: &t.ckpt,
        dtype: DType::F32,
        fp8: true,
    };
    let name = "double_blocks.0.img_mlp.2.weight";
    let Mat::Fp8(full) = src.load_product(name, None, None).unwrap() else {
        panic!("an FP8 source gave a dense weight");
    };
    let (n, k) = full.dims2().unwrap();
    for world in [2usize, 4] {
        for rank in 0..world {
            let c = Shard { rank, world }.range(k);
            let Mat::Fp8(part) = src
                .load_product(name, None, Some(std::slice::from_ref(&c)))
                .unwrap()
            else {
                panic!("dense shard");
            };
            assert_eq!(part.dims2().unwrap(), (n, c.len()));
            assert_eq!(
                bits(part.scales()),
                bits(full.scales()),
                "world {world} rank {rank}"
            );
            assert_eq!(
                q_bits(&part),
                q_bits(&full.narrow_cols(c.start, c.len()).unwrap())
            );
        }
    }
    // The shape-only source sizes it as loaded: a byte a value and four a row's scale.
    let shapes = ShapeSource {
        ckpt: &t.ckpt,
        dtype: DType::F32,
        fp8: true,
    };
    let m = shapes.load_product(name, None, None).unwrap();
    assert_eq!(m.bytes(), (n * k + 4 * n) as u64);
    assert_eq!(m.bytes(), Mat::Fp8(full).bytes());
}

/// Column-parallel FP8 products see whole tokens: the ranks' outputs side by side are the
/// unsharded output, bit for bit. Row-parallel ranks scale their own slice of each token:
/// the summed partials are within FP8's rounding of the unsharded product.
#[test]
fn sharded_fp8_products_match_the_unsharded_one() {
    let cfg = FluxConfig::flux_tiny();
    let t = tiny(12);
    let src = CheckpointSource {
        ckpt: &t.ckpt,
        dtype: DType::F32,
        fp8: true,
    };
    let h = cfg.hidden;
    let m = cfg.mlp_hidden();
    let x = Tensor::randn(0f32, 1.0, (2, 5, h), &Device::Cpu).unwrap();
    let p = "double_blocks.1.img_mlp.0";
    let full = ColumnParallel::load(&src, p, std::slice::from_ref(&(0..m))).unwrap();
    let want = full.forward_gelu(&x, Kernels::Auto).unwrap();
    for world in [2usize, 4] {
        let outs: Vec<Tensor> = (0..world)
            .map(|rank| {
                let r = Shard { rank, world }.range(m);
                ColumnParallel::load(&src, p, &[r])
                    .unwrap()
                    .forward_gelu(&x, Kernels::Auto)
                    .unwrap()
            })
            .collect();
        let got = Tensor::cat(&outs, 2).unwrap();
        assert_eq!(bits(&got), bits(&want), "column-parallel over {world}");
    }
    let u = want;
    let p2 = "double_blocks.1.img_mlp.2";
    let whole = RowParallel::load(&src, p2, std::slice::from_ref(&(0..m))).unwrap();
    let want2 = whole
        .add_bias(
            &whole.partial(&[&u], Kernels::Auto).unwrap(),
            Kernels::Candle,
        )
        .unwrap();
    for world in [2usize, 4] {
        let mut sum: Option<Tensor> = None;
        for rank in 0..world {
            let c = Shard { rank, world }.range(m);
            let l = RowParallel::load(&src, p2, std::slice::from_ref(&c)).unwrap();
            let part = l
                .partial(&[&u.narrow(2, c.start, c.len()).unwrap()], Kernels::Auto)
                .unwrap();
            sum = Some(match sum {
                None => part,
                Some(s) => (s + part).unwrap(),
            });
        }
        let got = whole.add_bias(&sum.unwrap(), Kernels::Candle).unwrap();
        let err = crate::max_relative_error(&got, &want2).unwrap();
        assert!(err > 0.0 && err < 5e-2, "row-parallel over {world}: {err}");
    }
}

/// An FP8 checkpoint quantized per row (ComfyUI's and torchao's per-channel files: each
/// row's largest value at ±448 with its scale beside) keeps its e4m3 values bit for bit in
/// an FP8 plan, and its scales to the float's rounding.
#[test]
fn an_fp8_checkpoint_keeps_its_values_in_an_fp8_plan() {
    let t = tiny(13);
    let name = "double_blocks.0.img_attn.qkv.weight";
    let src32 = CheckpointSource {
        ckpt: &t.ckpt,
        dtype: DType::F32,
        fp8: false,
    };
    let w = src32.load(name, None, None).unwrap();
    let file = Fp8Weight::quantize(&w).unwrap();
    let dir = t._dir.0.join("fp8-file");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("w.safetensors");
    let stem = name.strip_suffix(".weight").unwrap();
    let tensors: std::collections::HashMap<String, Tensor> = [
        (name.to_string(), file.values().clone()),
        (format!("{stem}.scale_weight"), file.scales().clone()),
    ]
    .into();
    candle_core::safetensors::save(&tensors, &path).unwrap();
    let ckpt = Checkpoint::open(&path).unwrap();
    let src = CheckpointSource {
        ckpt: &ckpt,
        dtype: DType::BF16,
        fp8: true,
    };
    let Mat::Fp8(got) = src.load_product(name, None, None).unwrap() else {
        panic!("dense");
    };
    assert_eq!(q_bits(&got), q_bits(&file));
    let (a, b) = (
        got.scales().to_vec1::<f32>().unwrap(),
        file.scales().to_vec1::<f32>().unwrap(),
    );
    for (x, y) in a.iter().zip(&b) {
        assert!((x - y).abs() <= y.abs() * 1e-6, "{x} against {y}");
    }
}

/// The GPU's q/k/v quantizing pass reads in place the views sequence parallelism hands
/// attention (of the all-to-all's `(L, 3, b, h, d)` buffer) and contiguous tensors from a
/// 16-byte boundary, and not tensors of other strides, rows not contiguous or pieces not
/// 16-byte aligned (it copies those first).
#[test]
fn qkv_views_read_in_place_only_where_rows_line_up() {
    use candle_core::IndexOp;
    let dev = candle_core::Device::Cpu;
    let (l, b, h, d) = (6usize, 2usize, 3usize, 16usize);
    let buf = Tensor::zeros((l, 3, b, h, d), DType::BF16, &dev).unwrap();
    let part = |i: usize| buf.i((.., i)).unwrap().permute((1, 2, 0, 3)).unwrap();
    let (q, k, v) = (part(0), part(1), part(2));
    assert!(!q.is_contiguous());
    assert!(views_in_place([q.layout(), k.layout(), v.layout()]));
    let c = Tensor::zeros((b, h, l, d), DType::BF16, &dev).unwrap();
    assert!(views_in_place([c.layout(), c.layout(), c.layout()]));
    // One tensor of other strides.
    assert!(!views_in_place([q.layout(), c.layout(), v.layout()]));
    // Rows not contiguous: d is not the innermost dimension.
    let t = c.transpose(2, 3).unwrap();
    assert!(!views_in_place([t.layout(), t.layout(), t.layout()]));
    // Pieces not 16-byte aligned: a view of rows of 12 values, and one starting 4 values
    // in; contiguous tensors need no whole pieces a row, only a 16-byte start.
    let odd = Tensor::zeros((l, 3, b, h, 12), DType::BF16, &dev).unwrap();
    let odd = odd.i((.., 0)).unwrap().permute((1, 2, 0, 3)).unwrap();
    assert!(!views_in_place([odd.layout(), odd.layout(), odd.layout()]));
    let twelve = Tensor::zeros((b, h, l, 12), DType::BF16, &dev).unwrap();
    assert!(views_in_place([
        twelve.layout(),
        twelve.layout(),
        twelve.layout()
    ]));
    let late = candle_core::Layout::contiguous_with_offset((b, h, l, d), 4);
    assert!(!views_in_place([&late, &late, &late]));
    let off = buf
        .narrow(4, 4, 8)
        .unwrap()
        .i((.., 0))
        .unwrap()
        .permute((1, 2, 0, 3))
        .unwrap();
    assert!(!views_in_place([off.layout(), off.layout(), off.layout()]));
    // A dimension of one value keeps any stride (candle calls such a tensor contiguous).
    let one = candle_core::Layout::new((1, h, l, d).into(), vec![3, l * d, d, 1], 0);
    assert!(one.is_contiguous());
    assert!(views_in_place([&one, &one, &one]));
    let other = candle_core::Layout::new((1, h, l, d).into(), vec![5, l * d, d, 1], 8);
    assert!(views_in_place([&one, &other, &one]));
    // Different shapes with the same strides are not one view.
    let short = candle_core::Layout::new((1, h, l - 1, d).into(), vec![3, l * d, d, 1], 0);
    assert!(!views_in_place([&one, &short, &one]));
}

/// `MOLD_FP8_SM_CARVEOUT`: the products target the GPU's SMs less the carveout, at least one;
/// cuBLASLt's own choice where none is left out or the GPU's count is unknown.
#[test]
fn products_target_the_sms_left() {
    assert_eq!(sm_target(132, 0), None);
    assert_eq!(sm_target(132, 16), Some(116));
    assert_eq!(sm_target(132, 1024), Some(1));
    assert_eq!(sm_target(0, 16), None);
}
