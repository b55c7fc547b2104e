//! mold's Qwen-Image transformer against an independent transcription of diffusers'
//! `QwenImageTransformer2DModel.forward` in plain candle ops (separate q/k/v
//! projections, RoPE as a complex product over the reference's `pos_freqs` /
//! `neg_freqs` tables sliced as `QwenEmbedRope` slices them, explicit softmax,
//! LayerNorm / RMSNorm / tanh-GELU written out), on the tiny model in f32. The GPU
//! parity against diffusers itself is benches/parity/qwen_diffusers.py.

mod common;

use candle_core::{DType, Device, Tensor, D};
use common::*;
use mold_exec::model::qwen::{random_inputs, testdata};
use mold_exec::*;

const EPS: f64 = 1e-6;

struct Ref<'a> {
    ck: &'a Checkpoint,
}

impl Ref<'_> {
    fn w(&self, n: &str) -> Tensor {
        self.ck.read_slice(n, None, None, DType::F32).unwrap()
    }
    fn linear(&self, p: &str, x: &Tensor) -> Tensor {
        let w = self.w(&format!("{p}.weight"));
        let b = self.w(&format!("{p}.bias"));
        x.broadcast_matmul(&w.t().unwrap())
            .unwrap()
            .broadcast_add(&b)
            .unwrap()
    }
}

fn layer_norm(x: &Tensor) -> Tensor {
    let mean = x.mean_keepdim(D::Minus1).unwrap();
    let xc = x.broadcast_sub(&mean).unwrap();
    let var = xc.sqr().unwrap().mean_keepdim(D::Minus1).unwrap();
    xc.broadcast_div(&(var + EPS).unwrap().sqrt().unwrap())
        .unwrap()
}

fn rms_norm(x: &Tensor, w: &Tensor) -> Tensor {
    let ms = x.sqr().unwrap().mean_keepdim(D::Minus1).unwrap();
    x.broadcast_div(&(ms + EPS).unwrap().sqrt().unwrap())
        .unwrap()
        .broadcast_mul(w)
        .unwrap()
}

fn gelu_tanh(x: &Tensor) -> Tensor {
    let c = (2.0 / std::f64::consts::PI).sqrt();
    let inner = ((x + (x.powf(3.0).unwrap() * 0.044715).unwrap()).unwrap() * c).unwrap();
    ((x * 0.5).unwrap() * (inner.tanh().unwrap() + 1.0).unwrap()).unwrap()
}

/// `x * (1 + scale) + shift` with `(b, d)` vectors.
fn modulate(x: &Tensor, shift: &Tensor, scale: &Tensor) -> Tensor {
    x.broadcast_mul(&(scale.unsqueeze(1).unwrap() + 1.0).unwrap())
        .unwrap()
        .broadcast_add(&shift.unsqueeze(1).unwrap())
        .unwrap()
}

/// `QwenEmbedRope.rope_params` for indices `idx`: angles `(len(idx), dim/2)`.
fn rope_params(idx: &[i64], dim: usize) -> Vec<Vec<f32>> {
    idx.iter()
        .map(|&i| {
            (0..dim)
                .step_by(2)
                .map(|k| i as f32 * (1.0 / 10_000f32.powf(k as f32 / dim as f32)))
                .collect()
        })
        .collect()
}

/// `QwenEmbedRope.forward` for one `(1, h, w)` image and `txt` text tokens: the image's
/// and the text's angles, `(h·w, d/2)` and `(txt, d/2)`.
fn qwen_rope(axes: [usize; 3], h: usize, w: usize, txt: usize) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let n = 64i64;
    let pos_index: Vec<i64> = (0..n).collect();
    let neg_index: Vec<i64> = (0..n).rev().map(|i| -i - 1).collect();
    let pos: Vec<Vec<Vec<f32>>> = axes.iter().map(|&d| rope_params(&pos_index, d)).collect();
    let neg: Vec<Vec<Vec<f32>>> = axes.iter().map(|&d| rope_params(&neg_index, d)).collect();
    let nn = n as usize;
    // scale_rope: the last (h - h/2) negative positions, then the first h/2 positive.
    let heights: Vec<&Vec<f32>> = neg[1][nn - (h - h / 2)..]
        .iter()
        .chain(pos[1][..h / 2].iter())
        .collect();
    let widths: Vec<&Vec<f32>> = neg[2][nn - (w - w / 2)..]
        .iter()
        .chain(pos[2][..w / 2].iter())
        .collect();
    let mut img = Vec::new();
    for hr in &heights {
        for wc in &widths {
            let mut v = pos[0][0].clone();
            v.extend(*hr);
            v.extend(*wc);
            img.push(v);
        }
    }
    let max_vid = (h / 2).max(w / 2);
    let txt_f = (max_vid..max_vid + txt)
        .map(|i| {
            let mut v = pos[0][i].clone();
            v.extend(&pos[1][i]);
            v.extend(&pos[2][i]);
            v
        })
        .collect();
    (img, txt_f)
}

/// `apply_rotary_emb_qwen(use_real=False)`: `x` `(b, L, H, D)` as D/2 complex numbers
/// times `exp(i·angle)`.
fn apply_rope(x: &Tensor, angles: &[Vec<f32>]) -> Tensor {
    let (b, l, hh, d) = x.dims4().unwrap();
    let flat: Vec<f32> = angles.iter().flatten().copied().collect();
    let a = Tensor::from_vec(flat, (1, l, 1, d / 2), &Device::Cpu).unwrap();
    let (cos, sin) = (a.cos().unwrap(), a.sin().unwrap());
    let x = x.reshape((b, l, hh, d / 2, 2)).unwrap();
    let re = x.narrow(4, 0, 1).unwrap().squeeze(4).unwrap();
    let im = x.narrow(4, 1, 1).unwrap().squeeze(4).unwrap();
    let out_re = (re.broadcast_mul(&cos).unwrap() - im.broadcast_mul(&sin).unwrap()).unwrap();
    let out_im = (re.broadcast_mul(&sin).unwrap() + im.broadcast_mul(&cos).unwrap()).unwrap();
    Tensor::stack(&[out_re, out_im], 4)
        .unwrap()
        .reshape((b, l, hh, d))
        .unwrap()
}

fn forward(r: &Ref, cfg: &QwenConfig, x: &QwenInputs) -> Tensor {
    let (hd, heads) = (cfg.head_dim, cfg.heads);
    let mut img = r.linear("img_in", &x.img);
    let txt = rms_norm(&x.txt, &r.w("txt_norm.weight"));
    let mut txt = r.linear("txt_in", &txt);
    // Timesteps(256, flip_sin_to_cos=True, downscale_freq_shift=0, scale=1000).
    let half = 128usize;
    let freqs: Vec<f32> = (0..half)
        .map(|i| (-(10_000f32.ln()) * i as f32 / half as f32).exp())
        .collect();
    let freqs = Tensor::from_vec(freqs, (1, half), &Device::Cpu).unwrap();
    let args = (x
        .timesteps
        .unsqueeze(1)
        .unwrap()
        .broadcast_mul(&freqs)
        .unwrap()
        * 1000.0)
        .unwrap();
    let tproj = Tensor::cat(&[args.cos().unwrap(), args.sin().unwrap()], 1).unwrap();
    let t = "time_text_embed.timestep_embedder";
    let temb = r.linear(
        &format!("{t}.linear_2"),
        &r.linear(&format!("{t}.linear_1"), &tproj).silu().unwrap(),
    );
    let (img_f, txt_f) = qwen_rope(cfg.axes_dim, x.grid.0, x.grid.1, txt.dim(1).unwrap());
    for i in 0..cfg.depth {
        let p = format!("transformer_blocks.{i}");
        let im = r.linear(&format!("{p}.img_mod.1"), &temb.silu().unwrap());
        let tm = r.linear(&format!("{p}.txt_mod.1"), &temb.silu().unwrap());
        let im = im.chunk(6, 1).unwrap();
        let tm = tm.chunk(6, 1).unwrap();
        let img_m = modulate(&layer_norm(&img), &im[0], &im[1]);
        let txt_m = modulate(&layer_norm(&txt), &tm[0], &tm[1]);
        let a = format!("{p}.attn");
        let heads_of = |t: Tensor| {
            let (b, l, _) = t.dims3().unwrap();
            t.reshape((b, l, heads, hd)).unwrap()
        };
        let proj = |n: &str, x: &Tensor| heads_of(r.linear(&format!("{a}.{n}"), x));
        let norm = |n: &str, x: &Tensor| rms_norm(x, &r.w(&format!("{a}.{n}.weight")));
        let iq = apply_rope(&norm("norm_q", &proj("to_q", &img_m)), &img_f);
        let ik = apply_rope(&norm("norm_k", &proj("to_k", &img_m)), &img_f);
        let iv = proj("to_v", &img_m);
        let tq = apply_rope(&norm("norm_added_q", &proj("add_q_proj", &txt_m)), &txt_f);
        let tk = apply_rope(&norm("norm_added_k", &proj("add_k_proj", &txt_m)), &txt_f);
        let tv = proj("add_v_proj", &txt_m);
        // Joint attention over [text, image], (b, H, L, D).
        let joint = |t: Tensor, i: Tensor| {
            Tensor::cat(&[t, i], 1)
                .unwrap()
                .transpose(1, 2)
                .unwrap()
                .contiguous()
                .unwrap()
        };
        let (q, k, v) = (joint(tq, iq), joint(tk, ik), joint(tv, iv));
        let s = (q.matmul(&k.t().unwrap()).unwrap() / (hd as f64).sqrt()).unwrap();
        let s = s
            .broadcast_sub(&s.max_keepdim(D::Minus1).unwrap())
            .unwrap()
            .exp()
            .unwrap();
        let s = s.broadcast_div(&s.sum_keepdim(D::Minus1).unwrap()).unwrap();
        let o = s.matmul(&v).unwrap().transpose(1, 2).unwrap();
        let (b, l, _, _) = o.dims4().unwrap();
        let o = o.reshape((b, l, heads * hd)).unwrap();
        let tl = txt.dim(1).unwrap();
        let img_a = r.linear(&format!("{a}.to_out.0"), &o.narrow(1, tl, l - tl).unwrap());
        let txt_a = r.linear(&format!("{a}.to_add_out"), &o.narrow(1, 0, tl).unwrap());
        let gated = |res: &Tensor, g: &Tensor, y: &Tensor| {
            (res + g.unsqueeze(1).unwrap().broadcast_mul(y).unwrap()).unwrap()
        };
        img = gated(&img, &im[2], &img_a);
        txt = gated(&txt, &tm[2], &txt_a);
        let mlp = |s: &str, x: &Tensor| {
            let h = gelu_tanh(&r.linear(&format!("{p}.{s}.net.0.proj"), x));
            r.linear(&format!("{p}.{s}.net.2"), &h)
        };
        let img_h = mlp("img_mlp", &modulate(&layer_norm(&img), &im[3], &im[4]));
        img = gated(&img, &im[5], &img_h);
        let txt_h = mlp("txt_mlp", &modulate(&layer_norm(&txt), &tm[3], &tm[4]));
        txt = gated(&txt, &tm[5], &txt_h);
    }
    // AdaLayerNormContinuous: scale first, then shift.
    let e = r.linear("norm_out.linear", &temb.silu().unwrap());
    let e = e.chunk(2, 1).unwrap();
    let out = modulate(&layer_norm(&img), &e[1], &e[0]);
    r.linear("proj_out", &out)
}

#[test]
fn matches_an_independent_transcription_of_the_reference() {
    let cfg = QwenConfig::qwen_image_tiny();
    let dir = tmpdir("qwen-reference");
    testdata::write_testdata(&cfg, &dir, 11, DType::F32, 1 << 30).unwrap();
    let ck = Checkpoint::open(&dir).unwrap();
    // An odd number of rows and of columns (5 × 3): both centrings are exercised.
    let x = random_inputs(&cfg, 48, 80, 6, 2, 11).unwrap();
    let want = forward(&Ref { ck: &ck }, &cfg, &x);
    let got = Executor::reference(&cfg, &ck, &mold_plan::DeviceId::Host, DType::F32)
        .unwrap()
        .forward(&x)
        .unwrap();
    assert_eq!(got.dims(), &[2, 15, 64]);
    let err = max_relative_error(&got, &want).unwrap();
    assert!(err <= 1e-5, "max relative error {err:e}");
}
