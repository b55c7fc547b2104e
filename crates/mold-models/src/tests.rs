use super::*;

fn gb(b: u64) -> f64 {
    b as f64 / 1e9
}

fn close(got: f64, want: f64, tol: f64, what: &str) {
    assert!(
        (got - want).abs() / want <= tol,
        "{what}: got {got:.3}, published {want:.3}"
    );
}

#[test]
fn sizes_match_published_checkpoints() {
    let flux = find("flux-dev").unwrap();
    close(
        gb(flux.transformer.weight_bytes(DType::Bf16)),
        23.80,
        0.01,
        "flux-dev bf16",
    );
    close(
        gb(flux.transformer.weight_bytes(DType::Q8)),
        12.71,
        0.02,
        "flux-dev q8",
    );
    close(
        gb(flux.component("t5").unwrap().weight_bytes(DType::Fp16)),
        9.79,
        0.03,
        "t5 fp16",
    );
    close(
        gb(flux.component("clip").unwrap().weight_bytes(DType::Bf16)),
        0.246,
        0.03,
        "clip",
    );
    close(
        gb(flux.component("vae").unwrap().weight_bytes(DType::F32)),
        0.335,
        0.01,
        "ae f32",
    );
    let q = find("qwen-image").unwrap();
    close(
        gb(q.transformer.weight_bytes(DType::Bf16)),
        40.9,
        0.02,
        "qwen-image bf16",
    );
    close(
        gb(q.transformer.weight_bytes(DType::Fp8)),
        20.4,
        0.02,
        "qwen-image fp8",
    );
    close(
        gb(q.component("qwen2.5-vl").unwrap().weight_bytes(DType::Bf16)),
        16.6,
        0.03,
        "qwen2.5-vl",
    );
    let sd = find("sd3.5-large").unwrap();
    close(
        sd.transformer.params() as f64 / 1e9,
        8.1,
        0.03,
        "sd3.5 params",
    );
    close(
        gb(sd.component("clip_g").unwrap().weight_bytes(DType::Fp16)),
        1.39,
        0.03,
        "clip-g",
    );
    let z = find("z-image-turbo").unwrap();
    close(
        gb(z.transformer.weight_bytes(DType::Q8)),
        6.58,
        0.03,
        "z-image q8",
    );
    close(
        gb(z.component("qwen3").unwrap().weight_bytes(DType::Bf16)),
        8.05,
        0.03,
        "qwen3-4b",
    );
    close(
        find("ltx-video-2b").unwrap().transformer.params() as f64 / 1e9,
        1.9,
        0.05,
        "ltx 2b",
    );
    close(
        find("ltx-video-13b").unwrap().transformer.params() as f64 / 1e9,
        13.0,
        0.05,
        "ltx 13b",
    );
}

#[test]
fn flux_block_shapes() {
    let f = find("flux-dev").unwrap();
    let (_, d) = f.transformer.kind("double").unwrap();
    let (_, s) = f.transformer.kind("single").unwrap();
    assert_eq!((d.count, s.count), (19, 38));
    // 2 × (qkv + proj + mlp) + 2 × modulation, by hand for h = 3072.
    let h = 3072u64;
    assert_eq!(
        d.params(),
        2 * (12 * h * h + 9 * h) + 2 * (6 * h * h + 6 * h) + 4 * 128
    );
    assert_eq!(s.params(), 12 * h * h + 8 * h + 3 * h * h + 3 * h + 2 * 128);
    assert!(f.transformer.tp_divides(4) && !f.transformer.tp_divides(5));
    // The modulation linears are per-sample weights, `hidden → 6h` per stream (double)
    // and `hidden → 3h` (single); only the q/k norm scales are replicated.
    assert_eq!(d.per_sample_params, 2 * (6 * h * h + 6 * h));
    assert_eq!(d.per_sample_outputs(), 12 * h);
    assert_eq!(d.replicated_params, 4 * 128);
    assert_eq!(s.per_sample_params, 3 * h * h + 3 * h);
    assert_eq!(s.per_sample_outputs(), 3 * h);
    assert_eq!(s.replicated_params, 2 * 128);
    assert_eq!((d.allgathers(), s.allgathers()), (1, 1));
    // One gather of every sample's full outputs: 12h bf16 values per sample.
    assert_eq!(d.per_sample_bytes(2, 2), 2 * 12 * h * 2);
    for m in builtin() {
        for k in &m.transformer.kinds {
            assert_eq!(
                k.per_sample_outputs() * (k.hidden + 1),
                k.per_sample_params,
                "{} {}",
                m.id,
                k.name
            );
            if k.per_sample_params == 0 {
                assert_eq!(k.allgathers(), 0);
            }
        }
    }
}

/// Under tensor parallel a rank holds 1/tp of every linear, the modulation included;
/// only the norm scales are held in full.
#[test]
fn tensor_parallel_divides_the_modulation() {
    let f = find("flux-dev").unwrap();
    let h = 3072u64;
    for (name, modulation) in [
        ("double", 2 * (6 * h * h + 6 * h)),
        ("single", 3 * h * h + 3 * h),
    ] {
        let (_, k) = f.transformer.kind(name).unwrap();
        let dt = DType::Bf16;
        let rep = dt.weight_bytes(k.replicated_params);
        let one = k.weight_bytes(dt, 1);
        assert_eq!(one, dt.weight_bytes(k.params()));
        for tp in [2u32, 4] {
            let t = tp as u64;
            let per_rank = k.weight_bytes(dt, tp);
            assert_eq!(per_rank, (one - rep) / t + rep, "{name} TP{tp}");
            // With the modulation replicated a rank would hold this much more.
            let replicated_modulation = dt.weight_bytes(
                (k.sharded_params() - modulation) / t + modulation + k.replicated_params,
            );
            assert_eq!(
                replicated_modulation - per_rank,
                dt.weight_bytes(modulation) - dt.weight_bytes(modulation / t),
                "{name} TP{tp}"
            );
        }
        // A checkpoint's exact total is split the same way: all but the norm scales
        // divide by tp.
        let mut exact = k.clone();
        exact.checkpoint_bytes = Some(one);
        for tp in [1u32, 2, 4] {
            let got = exact.weight_bytes(dt, tp);
            let want = k.weight_bytes(dt, tp);
            assert!(got.abs_diff(want) <= 1, "{name} TP{tp}: {got} vs {want}");
        }
    }
}

#[test]
fn tokens_and_flops() {
    let f = find("flux-dev").unwrap();
    let t = f.tokens(&f.default_workload);
    assert_eq!(
        t,
        Tokens {
            img: 4096,
            txt: 512
        }
    );
    let (_, s) = f.transformer.kind("single").unwrap();
    let tt = 4608f64;
    let want = 2.0 * s.joint_params as f64 * tt
        + 4.0 * 3072.0 * tt * tt
        + 2.0 * s.per_sample_params as f64
        + 2.0 * s.replicated_params as f64;
    assert_eq!(s.flops(t, 1, 1), want);
    // Tensor parallel divides everything (the modulation included) but the replicated
    // norm scales.
    let rep = 2.0 * s.replicated_params as f64;
    let tp2 = s.flops(t, 1, 2);
    assert!((tp2 - (want - rep) / 2.0 - rep).abs() < 1.0);
    let modulation = 2.0 * (3.0 * 3072.0 * 3072.0 + 3.0 * 3072.0);
    assert!(s.flops(t, 1, 1) - tp2 > modulation / 2.0);
    let ltx = find("ltx-video-13b").unwrap();
    assert_eq!(ltx.tokens(&ltx.default_workload).img, 16 * 16 * 24);
}

#[test]
fn workload_errors_suggest_sizes() {
    let f = find("flux-dev").unwrap();
    let mut w = f.default_workload.clone();
    w.width = 1000;
    let e = f.check_workload(&w).unwrap_err().to_string();
    assert!(
        e.contains("workload.width") && e.contains("992 or 1008"),
        "{e}"
    );
    let l = find("ltx-video-2b").unwrap();
    let mut w = l.default_workload.clone();
    w.frames = 100;
    let e = l.check_workload(&w).unwrap_err().to_string();
    assert!(e.contains("97 or 105"), "{e}");
    let e = find("flux-pro").unwrap_err().to_string();
    assert!(e.contains("flux-dev") && e.contains("unknown model"), "{e}");
}

fn write_safetensors(path: &std::path::Path, tensors: &[(&str, &str, Vec<u64>, u64)]) {
    let mut off = 0u64;
    let mut map = serde_json::Map::new();
    for (name, dt, shape, bytes) in tensors {
        map.insert(
            name.to_string(),
            serde_json::json!({"dtype": dt, "shape": shape, "data_offsets": [off, off + bytes]}),
        );
        off += bytes;
    }
    let header = serde_json::to_vec(&map).unwrap();
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&header);
    out.resize(out.len() + off as usize, 0);
    std::fs::write(path, out).unwrap();
}

#[test]
fn refines_from_checkpoint_header() {
    let dir = std::env::temp_dir().join(format!("mold-models-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join("tiny.safetensors");
    let mut ts: Vec<(String, u64)> = vec![
        ("img_in.weight".into(), 100),
        ("guidance_in.in_layer.weight".into(), 10),
    ];
    for i in 0..2 {
        ts.push((format!("double_blocks.{i}.img_attn.qkv.weight"), 1000 + i));
    }
    for i in 0..3 {
        ts.push((format!("single_blocks.{i}.linear1.weight"), 500));
    }
    let owned: Vec<(&str, &str, Vec<u64>, u64)> = ts
        .iter()
        .map(|(n, b)| (n.as_str(), "F32", vec![64, b / 4], *b))
        .collect();
    write_safetensors(&p, &owned);
    let r = checkpoint::refine(&p, None).unwrap();
    assert_eq!(r.model.id, "flux-tiny");
    assert_eq!(r.dtype, DType::F32);
    assert_eq!(r.model.transformer.kinds[0].checkpoint_bytes, Some(1001));
    assert_eq!(r.model.transformer.stem_checkpoint_bytes, Some(110));
    assert_eq!(r.header_sha256.len(), 64);
    // A missing block is named.
    let owned2: Vec<_> = owned
        .iter()
        .filter(|t| !t.0.starts_with("single_blocks.2"))
        .cloned()
        .collect();
    write_safetensors(&p, &owned2);
    let e = checkpoint::refine(&p, None).unwrap_err().to_string();
    assert!(e.contains("single_blocks.2"), "{e}");
    std::fs::write(&p, b"garbage!garbage").unwrap();
    let e = checkpoint::refine(&p, None).unwrap_err().to_string();
    assert!(e.contains("not a safetensors file"), "{e}");
}
