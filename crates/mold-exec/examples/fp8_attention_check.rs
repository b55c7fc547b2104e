//! FP8 attention on the first CUDA GPU ([`mold_exec::model::attention::fp8_attention`]:
//! q, k, v quantized on the GPU, cuDNN's FP8 flash attention, its e4m3 output widened here)
//! against exact attention in f32 and against its own emulation
//! ([`fp8_attention_reference`]), on bf16 inputs at head size 128, for each sequence length
//! given, with mild scores (q and k in [-1, 1), v in [-4, 4)) and peaked ones (q and k in
//! [-3, 3): the largest probabilities near 1, v in [-12, 12)). Exits 1 unless cuDNN's FP8
//! attention ran and its error against exact attention is within `--tol` times the
//! emulation's (and under 0.25, not the O(1) of a wrong computation): the GPU's FP8 attention
//! rounds no worse than the arithmetic it stands for. On an H200 (cuDNN 9.19), 8 heads, L 1000 /
//! 4608: mild 7.09e-2 / 6.58e-2 against the emulation's 6.61e-2 / 6.45e-2; peaked 1.40e-1 /
//! 1.69e-1 against 1.55e-1 / 1.83e-1.
//!
//! Then, at each length, q, k and v written by the fused q/k/v preparation with their largest
//! magnitudes taken in the same pass ([`mold_exec::model::ops::qkv_prep_fused_amax`]): the
//! maxima must equal the written tensors' own, and FP8 attention given them must give the same
//! bits as FP8 attention taking them in a pass of its own. And q, k and v as sequence
//! parallelism hands them over, strided views of the all-to-all's `(L, 3, b, h, d)` buffer
//! (read in place by the quantizing pass), must give the bits of the same values contiguous,
//! and the GPU's widening of FP8 attention's e4m3 output those of the host's. Last, the same
//! q, k and v over a sequence-parallel group of two ranks on this one GPU (threads, the
//! exchange staged through the host: [`mold_exec::comm::ThreadComm`]), q, k and v sent in
//! e4m3 with the scales the group agrees on (`mold_exec::model::sequence::exchange_e4m3`),
//! read in place by cuDNN from the receive buffer, the output sent back in e4m3: each rank's
//! rows and scales must be those of FP8 attention on one rank for its tokens, bit for bit;
//! where the machine has two GPUs, again with a rank on each, over the group `mold exec` makes
//! ([`mold_exec::comm::make_group`]: the copy engines' all-to-alls, NCCL for the rest).
//!
//!   fp8_attention_check [--lengths 1000,4608] [--heads 8] [--tol 2]
use candle_core::IndexOp;
use candle_core::{DType, Device, Tensor};
use mold_exec::model::attention::{fp8_attention, fp8_attention_reference, unfused_attention};
use mold_exec::model::mat::Input;
use mold_exec::model::ops::{qkv_prep_fused_amax, QkvSegment};
use mold_exec::model::ActivationMeter;
use mold_exec::verify::max_relative_error;
use mold_exec::Kernels;

fn main() {
    match run() {
        Ok(true) => {}
        Ok(false) => std::process::exit(1),
        Err(e) => {
            eprintln!("fp8_attention_check: {e}");
            std::process::exit(2);
        }
    }
}

/// `(b, h, L, d)` values from [`values`] times `scale`, in bf16 on `gpu`.
fn bf16_on(
    gpu: &Device,
    shape: (usize, usize, usize, usize),
    seed: u64,
    scale: f64,
) -> Result<Tensor, String> {
    let e = |e: candle_core::Error| e.to_string();
    let (b, h, l, d) = shape;
    (Tensor::from_vec(values(b * h * l * d, seed), shape, &Device::Cpu).map_err(e)? * scale)
        .map_err(e)?
        .to_dtype(DType::BF16)
        .map_err(e)?
        .to_device(gpu)
        .map_err(e)
}

/// `n` values in [-1, 1) from a 64-bit LCG seeded by `seed` (the same on every machine).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn run() -> Result<bool, String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let flag = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let lengths: Vec<usize> = flag("--lengths")
        .unwrap_or_else(|| "1000,4608".into())
        .split(',')
        .map(|v| {
            v.trim()
                .parse()
                .map_err(|_| format!("--lengths: {v} is not a number"))
        })
        .collect::<Result<_, _>>()?;
    let heads: usize = flag("--heads")
        .unwrap_or_else(|| "8".into())
        .parse()
        .map_err(|_| "--heads: not a number")?;
    let tol: f64 = flag("--tol")
        .unwrap_or_else(|| "2".into())
        .parse()
        .map_err(|_| "--tol: not a number")?;
    let e = |e: candle_core::Error| e.to_string();
    let gpu = Device::new_cuda(0).map_err(e)?;
    let meter = ActivationMeter::default();
    let d = 128;
    let mut ok = true;
    let cases = lengths
        .iter()
        .flat_map(|&l| [(l, 1.0, "mild"), (l, 3.0, "peaked")])
        .enumerate();
    for (i, (l, qk, how)) in cases {
        // bf16 inputs; the references read the same bf16 values in f32. v is 4× wider than
        // q and k.
        let make = |which: u64, scale: f64| -> Result<Tensor, String> {
            let v = values(heads * l * d, 1000 * i as u64 + which);
            (Tensor::from_vec(v, (1, heads, l, d), &Device::Cpu).map_err(e)? * scale)
                .map_err(e)?
                .to_dtype(DType::BF16)
                .map_err(e)
        };
        let (q, k, v) = (make(1, qk)?, make(2, qk)?, make(3, 4.0 * qk)?);
        let f32s = |t: &Tensor| t.to_dtype(DType::F32).map_err(e);
        let exact = unfused_attention(&f32s(&q)?, &f32s(&k)?, &f32s(&v)?, &meter).map_err(e)?;
        let emulated = fp8_attention_reference(&q, &k, &v, &meter).map_err(e)?;
        let on_gpu = |t: &Tensor| t.to_device(&gpu).map_err(e);
        let before = mold_exec::attention_report();
        let got = fp8_attention(
            Kernels::Auto,
            &on_gpu(&q)?,
            &on_gpu(&k)?,
            &on_gpu(&v)?,
            None,
            &meter,
        )
        .map_err(e)?
        .widen()
        .map_err(e)?
        .to_device(&Device::Cpu)
        .map_err(e)?;
        let after = mold_exec::attention_report();
        let fp8_calls = |r: &mold_exec::model::attention::AttentionReport| {
            r.calls
                .iter()
                .filter(|(k, _)| k.contains("FP8 SDPA"))
                .map(|(_, n)| *n)
                .sum::<u64>()
        };
        let ran = fp8_calls(&after) > fp8_calls(&before);
        let err = |a: &Tensor, b: &Tensor| max_relative_error(a, b).map_err(|x| x.to_string());
        let (e_gpu, e_emu, e_between) = (
            err(&got, &exact)?,
            err(&emulated, &exact)?,
            err(&got, &emulated)?,
        );
        let pass = ran && e_gpu <= tol * e_emu.max(1e-3) && e_gpu < 0.25;
        ok &= pass;
        println!(
            "L {l}, {heads} heads, {how}: cuDNN FP8 {} | against exact f32: GPU {e_gpu:.3e}, emulation {e_emu:.3e} | GPU against emulation {e_between:.3e} | {}",
            if ran { "ran" } else { "did not run" },
            if pass { "ok" } else { "FAIL" }
        );
        if !ran {
            println!("  cuDNN not used: {:?}", after.cudnn_refusals);
        }
    }
    for &l in &lengths {
        ok &= maxima_in_preparation(&gpu, l, heads, &meter)?;
    }
    for (i, &l) in lengths.iter().enumerate() {
        ok &= views_of_the_exchange(&gpu, l, heads, 1 + usize::from(i == 0), &meter)?;
    }
    let two = Device::new_cuda(1).ok();
    for &l in &lengths {
        ok &= over_a_group(&[gpu.clone(), gpu.clone()], false, l, heads)?;
        if let Some(g1) = &two {
            ok &= over_a_group(&[gpu.clone(), g1.clone()], true, l, heads)?;
        }
    }
    Ok(ok)
}

/// FP8 attention over a sequence-parallel group of two ranks on one GPU (q, k and v sent in
/// e4m3) against FP8 attention on one rank: each rank's rows and scales, bit for bit.
/// FP8 attention's e4m3 output as bytes and its per-token scales.
type Rows = (Vec<u8>, Vec<f32>);

/// Rank r runs on `gpus[r]`; `real`: over the group `mold exec` makes for them, else over
/// threads staged through the host.
fn over_a_group(gpus: &[Device], real: bool, l: usize, heads: usize) -> Result<bool, String> {
    use mold_exec::comm::{make_group, Comm, CommOptions, LocalComm, ThreadComm};
    use mold_exec::model::sequence::{attention, split, Qkv};
    use mold_exec::model::Ctx;
    let e = |e: candle_core::Error| e.to_string();
    let (b, d, world) = (1usize, 128usize, gpus.len());
    let gpu = &gpus[0];
    let make = |seed: u64, scale: f64| bf16_on(gpu, (b, heads, l, d), seed, scale);
    let (q, k, v) = (make(31, 2.0)?, make(32, 1.5)?, make(33, 6.0)?);
    let rows_of = |i: Input| -> Result<Rows, String> {
        let Input::Fp8(r) = i else {
            return Err("FP8 attention did not return e4m3 rows".into());
        };
        let vals = r
            .rows()
            .values()
            .flatten_all()
            .and_then(|t| t.to_device(&Device::Cpu))
            .and_then(|t| t.to_vec1::<float8::F8E4M3>())
            .map_err(e)?
            .iter()
            .map(|x| x.to_bits())
            .collect();
        let sc = r
            .rows()
            .scales()
            .to_device(&Device::Cpu)
            .and_then(|t| t.to_vec1::<f32>())
            .map_err(e)?;
        Ok((vals, sc))
    };
    let meter = ActivationMeter::default();
    let one = rows_of(fp8_attention(Kernels::Auto, &q, &k, &v, None, &meter).map_err(e)?)?;
    let comms: Vec<Box<dyn Comm>> = if real {
        let ids: Vec<mold_plan::DeviceId> = (0..world)
            .map(|i| mold_plan::DeviceId::Cuda(i as u32))
            .collect();
        make_group(&ids, &CommOptions::default(), None)
    } else {
        ThreadComm::group(world)
            .into_iter()
            .map(|c| Box::new(c) as Box<dyn Comm>)
            .collect()
    };
    let lens: Vec<usize> = (0..world).map(|r| split(l, r, world).len()).collect();
    let got: Vec<Result<Rows, String>> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .iter()
            .map(|c| {
                let (q, k, v, lens) = (&q, &k, &v, &lens);
                let dev = gpus[c.rank()].clone();
                s.spawn(move || -> Result<Rows, String> {
                    let meter = ActivationMeter::default();
                    let ctx = Ctx {
                        comm: &LocalComm,
                        sp: c.as_ref(),
                        meter: &meter,
                        kernels: Kernels::Auto,
                        token_split: false,
                        profile: None,
                        ahead: None,
                        slot: 0,
                        fp8_attention: true,
                    };
                    let mine = split(l, c.rank(), world);
                    let pick = |t: &Tensor| {
                        t.narrow(2, mine.start, mine.len())
                            .and_then(|t| t.to_device(&dev))
                    };
                    let qkv = Qkv::new(
                        pick(q).map_err(e)?,
                        pick(k).map_err(e)?,
                        pick(v).map_err(e)?,
                        world,
                    )
                    .map_err(e)?;
                    rows_of(attention(qkv, lens, true, &ctx).map_err(e)?)
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err("a rank panicked".into())))
            .collect()
    });
    let mut vals = Vec::new();
    let mut sc = Vec::new();
    for g in got {
        let (v, s) = g?;
        vals.extend(v);
        sc.extend(s);
    }
    let same_vals = vals == one.0;
    let same_scales = sc == one.1;
    let differ = vals.iter().zip(&one.0).filter(|(a, b)| a != b).count();
    let pass = same_vals && same_scales;
    println!(
        "L {l}, {heads} heads over {world} ranks ({}), q, k, v and output sent in e4m3: rows {} ({differ} of {} values differ), scales {} | {}",
        if real { "one a GPU, mold exec's group" } else { "threads on one GPU" },
        if same_vals { "= one rank's, bit for bit" } else { "differ from one rank's" },
        one.0.len(),
        if same_scales { "= one rank's" } else { "differ" },
        if pass { "ok" } else { "FAIL" }
    );
    Ok(pass)
}

/// q, k and v as sequence parallelism hands them to attention, strided views of the q/k/v
/// all-to-all's `(L, 3, b, h, d)` buffer read in place, against the same values contiguous:
/// the same bits.
fn views_of_the_exchange(
    gpu: &Device,
    l: usize,
    heads: usize,
    b: usize,
    meter: &ActivationMeter,
) -> Result<bool, String> {
    let e = |e: candle_core::Error| e.to_string();
    let d = 128;
    let make = |seed: u64, scale: f64| bf16_on(gpu, (b, heads, l, d), seed, scale);
    let (q, k, v) = (make(21, 2.0)?, make(22, 1.0)?, make(23, 5.0)?);
    // (3, b, h, L, d) -> (L, 3, b, h, d), the buffer's layout.
    let buf = Tensor::stack(&[&q, &k, &v], 0)
        .and_then(|t| t.permute((3, 0, 1, 2, 4)))
        .and_then(|t| t.contiguous())
        .map_err(e)?;
    let part = |i: usize| buf.i((.., i)).and_then(|t| t.permute((1, 2, 0, 3)));
    let (vq, vk, vv) = (
        part(0).map_err(e)?,
        part(1).map_err(e)?,
        part(2).map_err(e)?,
    );
    let run = |q: &Tensor, k: &Tensor, v: &Tensor| -> Result<Vec<u16>, String> {
        Ok(fp8_attention(Kernels::Auto, q, k, v, None, meter)
            .and_then(|o| o.widen())
            .and_then(|o| o.flatten_all())
            .and_then(|o| o.to_device(&Device::Cpu))
            .and_then(|o| o.to_vec1::<half::bf16>())
            .map_err(e)?
            .iter()
            .map(|x| x.to_bits())
            .collect())
    };
    let on_views = run(&vq, &vk, &vv)?;
    let equal = on_views == run(&q, &k, &v)?;
    // The GPU's widening (8 values a thread) against the same e4m3 rows widened on the host.
    let rows = match fp8_attention(Kernels::Auto, &vq, &vk, &vv, None, meter).map_err(e)? {
        Input::Fp8(r) => r,
        Input::Dense(_) => return Err("FP8 attention did not run on the GPU".into()),
    };
    let host: Vec<u16> = rows
        .rows()
        .map(&mut |t| t.to_device(&Device::Cpu))
        .and_then(|w| w.dequantize(DType::BF16))
        .and_then(|t| t.flatten_all())
        .and_then(|t| t.to_vec1::<half::bf16>())
        .map_err(e)?
        .iter()
        .map(|x| x.to_bits())
        .collect();
    let widened = host == on_views;
    let pass = equal && widened;
    println!(
        "L {l}, {heads} heads, batch {b}: FP8 attention on the all-to-all buffer's views {}; its output widened on the GPU {} | {}",
        if equal { "= on contiguous q, k, v, bit for bit" } else { "differs from contiguous" },
        if widened { "= on the host" } else { "differs from the host's" },
        if pass { "ok" } else { "FAIL" }
    );
    Ok(pass)
}

/// q, k, v of `l` tokens from the fused preparation with their maxima taken as written: the
/// maxima against the tensors', FP8 attention given them against FP8 attention alone.
fn maxima_in_preparation(
    gpu: &Device,
    l: usize,
    heads: usize,
    meter: &ActivationMeter,
) -> Result<bool, String> {
    let e = |e: candle_core::Error| e.to_string();
    let d = 128;
    let on = |v: Vec<f32>, shape: &[usize], scale: f32| -> Result<Tensor, String> {
        (Tensor::from_vec(v, shape, &Device::Cpu).map_err(e)? * scale as f64)
            .map_err(e)?
            .to_dtype(DType::BF16)
            .map_err(e)?
            .to_device(gpu)
            .map_err(e)
    };
    // v's columns scaled up so that the three maxima differ.
    let qkv = on(values(l * 3 * heads * d, 11), &[1, l, 3 * heads * d], 3.0)?;
    let qs = on(values(d, 12), &[d], 1.5)?;
    let ks = on(values(d, 13), &[d], 0.7)?;
    let ang: Vec<f32> = values(l * d / 2, 14).iter().map(|a| a * 3.1).collect();
    let cos = on(ang.iter().map(|a| a.cos()).collect(), &[1, l, d / 2], 1.0)?;
    let sin = on(ang.iter().map(|a| a.sin()).collect(), &[1, l, d / 2], 1.0)?;
    let seg = [QkvSegment {
        qkv: &qkv,
        q_scale: &qs,
        k_scale: &ks,
    }];
    let (t, amax) = qkv_prep_fused_amax(&seg, heads, &cos, &sin, 1e-6).map_err(e)?;
    let got: Vec<f32> = amax
        .flatten_from(1)
        .map_err(e)?
        .max(1)
        .map_err(e)?
        .to_device(&Device::Cpu)
        .map_err(e)?
        .to_vec1()
        .map_err(e)?;
    let mut same = true;
    for (i, g) in got.iter().enumerate() {
        let want = t
            .i(i)
            .map_err(e)?
            .to_dtype(DType::F32)
            .map_err(e)?
            .abs()
            .map_err(e)?
            .max_all()
            .map_err(e)?
            .to_scalar::<f32>()
            .map_err(e)?;
        same &= *g == want;
        if *g != want {
            println!("  tensor {i}: maxima from the preparation {g}, the tensor's {want}");
        }
    }
    let (q, k, v) = (t.i(0).map_err(e)?, t.i(1).map_err(e)?, t.i(2).map_err(e)?);
    let alone = fp8_attention(Kernels::Auto, &q, &k, &v, None, meter)
        .and_then(|o| o.widen())
        .map_err(e)?;
    let given = fp8_attention(Kernels::Auto, &q, &k, &v, Some(&amax), meter)
        .and_then(|o| o.widen())
        .map_err(e)?;
    let bits = |t: &Tensor| -> Result<Vec<u16>, String> {
        Ok(t.flatten_all()
            .map_err(e)?
            .to_device(&Device::Cpu)
            .map_err(e)?
            .to_vec1::<half::bf16>()
            .map_err(e)?
            .iter()
            .map(|x| x.to_bits())
            .collect())
    };
    let equal = bits(&alone)? == bits(&given)?;
    let pass = same && equal;
    println!(
        "L {l}, {heads} heads: maxima taken by the q/k/v preparation {:?} {} the tensors'; FP8 attention given them {} | {}",
        got,
        if same { "=" } else { "!=" },
        if equal { "= alone, bit for bit" } else { "differs from alone" },
        if pass { "ok" } else { "FAIL" }
    );
    Ok(pass)
}
