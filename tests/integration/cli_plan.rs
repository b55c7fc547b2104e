use crate::util::*;

fn plan_ok(args: &[&str], out: &std::path::Path) -> String {
    let mut a = vec!["plan"];
    a.extend_from_slice(args);
    a.extend_from_slice(&["-o", out.to_str().unwrap()]);
    let o = mold(&a);
    assert!(o.status.success(), "mold {a:?}: {}", stderr(&o));
    stdout(&o)
}

fn plan_err(args: &[&str]) -> String {
    let mut a = vec!["plan"];
    a.extend_from_slice(args);
    a.extend_from_slice(&["-o", "/nonexistent-dir/never-written.yaml"]);
    let o = mold(&a);
    assert!(!o.status.success(), "mold {a:?} should fail");
    stderr(&o)
}

#[test]
fn summary_two_l40s() {
    let d = tempdir("l40s");
    let s = plan_ok(
        &[
            "--model",
            "flux-dev",
            "--machine",
            "sim/machines/2x-l40s.yaml",
            "--size",
            "1024x1024",
        ],
        &d.join("p.yaml"),
    );
    insta::assert_snapshot!(stable(&s.replace(d.to_str().unwrap(), "TMP")));
    // The plan written is the plan summarised, and round-trips.
    let p = mold_plan::Plan::load(&d.join("p.yaml")).unwrap();
    assert_eq!(
        mold_plan::Plan::from_yaml(&p.to_yaml(), "again").unwrap(),
        p
    );
    insta::assert_snapshot!(
        "plan_yaml_flux_dev_2x_l40s",
        stable(&read(&d.join("p.yaml")))
    );
}

#[test]
fn summary_streaming_and_host_staged_tp() {
    let d = tempdir("4090");
    let s = plan_ok(
        &[
            "--model",
            "flux-dev",
            "--machine",
            "sim/machines/1x-rtx4090.yaml",
        ],
        &d.join("p.yaml"),
    );
    assert!(s.contains("blocks stream from host memory"), "{s}");
    insta::assert_snapshot!(
        "summary_1x_rtx4090",
        stable(&s.replace(d.to_str().unwrap(), "TMP"))
    );
    let s = plan_ok(
        &[
            "--model",
            "flux-dev",
            "--machine",
            "sim/machines/2x-rtx4090.yaml",
        ],
        &d.join("q.yaml"),
    );
    assert!(s.contains("staged through host"), "{s}");
}

#[test]
fn json_output_is_the_same_outcome() {
    let d = tempdir("json");
    let s = plan_ok(
        &[
            "--model",
            "qwen-image",
            "--machine",
            "sim/machines/8x-h100.yaml",
            "--objective",
            "latency",
            "--json",
        ],
        &d.join("p.yaml"),
    );
    let v: serde_json::Value = serde_json::from_str(&s).unwrap();
    assert_eq!(v["outcome"]["plan"]["model"]["id"], "qwen-image");
    assert_eq!(v["outcome"]["families"].as_array().unwrap().len(), 6);
    let yaml = mold_plan::Plan::load(&d.join("p.yaml")).unwrap();
    assert_eq!(
        v["outcome"]["plan"]["predicted"]["step_time_s"]
            .as_f64()
            .unwrap(),
        yaml.predicted.step_time_s
    );
}

#[test]
fn infeasible_names_what_and_the_relaxation() {
    let e = plan_err(&[
        "--model",
        "flux-dev",
        "--machine",
        "sim/machines/1x-rtx4090.yaml",
        "--no-stream",
    ]);
    assert!(
        e.contains("transformer needs 24.1 GB resident (23.8 GB bf16 weights"),
        "{e}"
    );
    assert!(e.contains("largest budget"), "{e}");
    assert!(e.contains("allow streaming (drop --no-stream)"), "{e}");
    insta::assert_snapshot!("infeasible_no_stream", e);
}

#[test]
fn flag_errors_name_the_flag() {
    let m = "sim/machines/2x-l40s.yaml";
    for (args, want) in [
        (
            vec!["--model", "flux-pro", "--machine", m],
            "unknown model `flux-pro`",
        ),
        (
            vec!["--model", "flux-dev", "--machine", "2x-l40s"],
            "did you mean sim/machines/2x-l40s.yaml",
        ),
        (
            vec!["--model", "flux-dev", "--machine", m, "--size", "1000x1000"],
            "992 or 1008",
        ),
        (
            vec!["--model", "flux-dev", "--machine", m, "--size", "big"],
            "WIDTHxHEIGHT",
        ),
        (
            vec!["--model", "flux-dev", "--machine", m, "--tp", "5"],
            "--tp 5",
        ),
        (
            vec!["--model", "flux-dev", "--machine", m, "--tp", "many"],
            "--tp: `many` is not a parallel degree",
        ),
        (
            vec!["--model", "flux-dev", "--machine", m, "--sp", "5"],
            "--sp 5: flux-dev has 24 attention heads, which 5 does not divide",
        ),
        (
            vec!["--model", "flux-dev", "--machine", m, "--sp", "0"],
            "--sp: `0` is not a parallel degree",
        ),
        (
            vec!["--model", "flux-dev", "--machine", m, "--sp", "4"],
            "--sp 4: machine `2x-l40s` has only 2 devices",
        ),
        (
            vec![
                "--model",
                "flux-dev",
                "--machine",
                m,
                "--tp",
                "2",
                "--sp",
                "2",
            ],
            "--tp 2 --sp 2: a group of tp × sp = 4 devices, but machine `2x-l40s` has only 2",
        ),
        (
            vec!["--model", "flux-dev", "--machine", m, "--pin", "t6=cuda:0"],
            "no component `t6`",
        ),
        (
            vec!["--model", "flux-dev", "--machine", m, "--pin", "t5=cuda:7"],
            "cuda:7 is not a device",
        ),
        (
            vec![
                "--model",
                "flux-dev",
                "--machine",
                m,
                "--devices",
                "cuda:0,cuda:4",
            ],
            "--devices: cuda:4",
        ),
        (
            vec![
                "--model",
                "flux-dev",
                "--machine",
                m,
                "--max-vram",
                "cuda:0=lots",
            ],
            "not a size",
        ),
        (
            vec!["--model", "flux-dev", "--machine", m, "--encoder-gpu", "3"],
            "--encoder-gpu 3",
        ),
        (
            vec![
                "--model",
                "flux-dev",
                "--machine",
                m,
                "--dtype",
                "transformer=int3",
            ],
            "unknown dtype",
        ),
        (
            vec![
                "--model",
                "flux-dev",
                "--machine",
                m,
                "--objective",
                "cheap",
            ],
            "unknown objective",
        ),
    ] {
        let e = plan_err(&args);
        assert!(e.contains(want), "{args:?}: {e}");
    }
}

#[test]
fn constraints_file_equals_flags() {
    let d = tempdir("constraints");
    let m = "sim/machines/2x-l40s.yaml";
    plan_ok(
        &[
            "--model",
            "flux-dev",
            "--machine",
            m,
            "--pin",
            "t5=cuda:1",
            "--max-vram",
            "cuda:0=20GiB",
            "--tp",
            "off",
            "--no-stream",
        ],
        &d.join("flags.yaml"),
    );
    let c = d.join("c.yaml");
    std::fs::write(
        &c,
        "pin: {t5: cuda:1}\nmax_vram: {cuda:0: 20GiB}\ntp: off\nstream: false\n",
    )
    .unwrap();
    plan_ok(
        &[
            "--model",
            "flux-dev",
            "--machine",
            m,
            "--constraints",
            c.to_str().unwrap(),
        ],
        &d.join("file.yaml"),
    );
    let (a, b) = (
        stable(&read(&d.join("flags.yaml"))),
        stable(&read(&d.join("file.yaml"))),
    );
    assert_eq!(a, b);
    let p = mold_plan::Plan::load(&d.join("file.yaml")).unwrap();
    assert!(p.predicted.devices[0].budget.0 <= 20 << 30);
    assert!(p
        .transformer()
        .unwrap()
        .parts
        .iter()
        .all(|x| x.devices.len() == 1));
    // Unknown keys in the file are refused by name.
    std::fs::write(&c, "pins: {t5: cuda:1}\n").unwrap();
    let e = plan_err(&[
        "--model",
        "flux-dev",
        "--machine",
        m,
        "--constraints",
        c.to_str().unwrap(),
    ]);
    assert!(e.contains("unknown field `pins`"), "{e}");
}

#[test]
fn gpu_shorthands_are_pins() {
    let d = tempdir("shorthand");
    let m = "sim/machines/2x-l40s.yaml";
    plan_ok(
        &[
            "--model",
            "flux-dev",
            "--machine",
            m,
            "--encoder-gpu",
            "0",
            "--transformer-gpu",
            "1",
            "--vae-gpu",
            "1",
        ],
        &d.join("a.yaml"),
    );
    plan_ok(
        &[
            "--model",
            "flux-dev",
            "--machine",
            m,
            "--pin",
            "t5=cuda:0",
            "--pin",
            "clip=cuda:0",
            "--pin",
            "transformer=cuda:1",
            "--pin",
            "vae=cuda:1",
        ],
        &d.join("b.yaml"),
    );
    assert_eq!(
        stable(&read(&d.join("a.yaml"))),
        stable(&read(&d.join("b.yaml")))
    );
    let p = mold_plan::Plan::load(&d.join("a.yaml")).unwrap();
    for c in &p.components {
        let want = if c.role == mold_plan::ComponentRole::Encoder {
            "cuda:0"
        } else {
            "cuda:1"
        };
        assert!(
            c.parts
                .iter()
                .all(|x| x.devices.iter().all(|d| d.to_string() == want)),
            "{}",
            c.name
        );
    }
}

#[test]
fn checkpoint_sizes_come_from_the_header() {
    let d = tempdir("ckpt");
    // A flux-tiny checkpoint written by `mold testdata`, then planned from its header.
    let o = mold(&["testdata", "flux-tiny", d.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let ck = std::fs::read_dir(&d)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| {
            p.extension().is_some_and(|x| x == "safetensors")
                && p.to_string_lossy().contains("transformer")
        })
        .expect("a transformer checkpoint");
    plan_ok(
        &[
            "--model",
            ck.to_str().unwrap(),
            "--machine",
            "sim/machines/cpu-emu-4.yaml",
        ],
        &d.join("p.yaml"),
    );
    let p = mold_plan::Plan::load(&d.join("p.yaml")).unwrap();
    assert_eq!(p.model.id, "flux-tiny");
    let c = p.model.checkpoint.unwrap();
    assert_eq!(c.header_sha256.len(), 64);
}

#[test]
fn models_lists_the_catalogue() {
    let o = mold(&["models"]);
    let s = stdout(&o);
    for m in [
        "flux-dev",
        "flux-schnell",
        "qwen-image",
        "sd3.5-large",
        "z-image-turbo",
        "ltx-video-2b",
        "ltx-video-13b",
        "flux-tiny",
    ] {
        assert!(s.contains(m), "{m}");
    }
    // Sizes in units that suit them: the tiny model's transformer is not "0.0 GB".
    let tiny = s.lines().find(|l| l.starts_with("flux-tiny")).unwrap();
    assert!(!tiny.contains("0.0 GB") && tiny.contains(" MB"), "{tiny}");
}

/// `mold plan --sp 2` on the emulated machine writes a version 2 plan whose parallel
/// parts are sequence parallel at degree 2, which `mold sim` accepts. (The lead's
/// `mold exec --verify` half runs it once the executor runs SP.)
#[test]
fn sp_flag_writes_a_v2_sequence_parallel_plan() {
    let d = tempdir("sp2");
    let p = d.join("p.yaml");
    let s = plan_ok(
        &[
            "--model",
            "flux-tiny",
            "--machine",
            "sim/machines/cpu-emu-4.yaml",
            "--sp",
            "2",
        ],
        &p,
    );
    let text = read(&p);
    assert!(
        text.contains("version: 5") && text.contains("sp: 2"),
        "{text}"
    );
    assert!(s.contains("sequence parallel ×2"), "{s}");
    assert!(s.contains("excluded by --sp 2"), "{s}");
    let plan = mold_plan::Plan::load(&p).unwrap();
    assert_eq!(plan.version, mold_plan::PLAN_VERSION);
    let parts = &plan.transformer().unwrap().parts;
    assert!(parts.iter().any(|x| x.sp == 2));
    assert!(parts
        .iter()
        .all(|x| x.devices.len() == 1 || (x.sp == 2 && x.degree() == x.devices.len() as u64)));
    let o = mold(&["sim", p.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
}

/// `--sp` defaults: auto where the machine has peer links (the planner may choose it),
/// off when `--tp` is given (tensor parallel only, as before) or without peer links.
#[test]
fn sp_defaults() {
    let d = tempdir("sp-default");
    let transformer = |f: &str| {
        mold_plan::Plan::load(&d.join(f))
            .unwrap()
            .transformer()
            .unwrap()
            .parts
            .clone()
    };
    // 2 × H200 over NVLink: sequence parallel wins by the cost model.
    plan_ok(
        &[
            "--model",
            "flux-dev",
            "--machine",
            "sim/machines/2x-h200.yaml",
        ],
        &d.join("auto.yaml"),
    );
    assert!(transformer("auto.yaml").iter().all(|p| p.sp == 2));
    // --tp 2 alone: tensor parallel, no sequence parallel.
    plan_ok(
        &[
            "--model",
            "flux-dev",
            "--machine",
            "sim/machines/2x-h200.yaml",
            "--tp",
            "2",
        ],
        &d.join("tp.yaml"),
    );
    let tp = transformer("tp.yaml");
    assert!(tp.iter().all(|p| p.sp == 1) && tp.iter().any(|p| p.tp == 2));
    // No peer links (2 × RTX 4090): off.
    plan_ok(
        &[
            "--model",
            "flux-dev",
            "--machine",
            "sim/machines/2x-rtx4090.yaml",
        ],
        &d.join("pcie.yaml"),
    );
    assert!(transformer("pcie.yaml").iter().all(|p| p.sp == 1));
    // The constraints file says the same as the flag.
    let c = d.join("c.yaml");
    std::fs::write(&c, "sp: 2\n").unwrap();
    plan_ok(
        &[
            "--model",
            "flux-tiny",
            "--machine",
            "sim/machines/cpu-emu-4.yaml",
            "--constraints",
            c.to_str().unwrap(),
        ],
        &d.join("file.yaml"),
    );
    plan_ok(
        &[
            "--model",
            "flux-tiny",
            "--machine",
            "sim/machines/cpu-emu-4.yaml",
            "--sp",
            "2",
        ],
        &d.join("flag.yaml"),
    );
    assert_eq!(
        stable(&read(&d.join("file.yaml"))),
        stable(&read(&d.join("flag.yaml")))
    );
}

/// Two nodes of 8 × H100 on InfiniBand: every parallel group of the plan lies inside one
/// node (the network is slower than NVLink); the plan records the nodes only through
/// the machine's identity (its fingerprint), and the simulator accepts it.
#[test]
fn two_nodes_keep_parallel_groups_inside_a_node() {
    let dir = tempdir("two-nodes");
    let out = dir.join("plan.yaml");
    let machine = "sim/machines/2x8-h100-ib.yaml";
    plan_ok(&["--model", "qwen-image", "--machine", machine], &out);
    let plan = mold_plan::Plan::load(&out).unwrap();
    let m = mold_machine::Machine::load(&root().join(machine)).unwrap();
    assert_eq!(plan.machine.fingerprint, m.fingerprint());
    let t = plan.transformer().unwrap();
    assert!(t.parts.iter().any(|p| p.devices.len() > 1), "{t:?}");
    for p in &t.parts {
        let nodes: std::collections::BTreeSet<u32> =
            p.devices.iter().map(|d| m.node_of(d)).collect();
        assert_eq!(nodes.len(), 1, "{:?} spans nodes {nodes:?}", p.devices);
    }
    let o = mold(&["sim", out.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
}

/// `--objective throughput`: two replicas of a one-GPU placement for 8 clients on two
/// H200s; with a bound between the two request times, the faster group over both.
#[test]
fn throughput_objective_weighs_replicas_against_one_group() {
    let d = tempdir("plan-throughput");
    let p = d.join("plan.yaml");
    let base = [
        "--model",
        "flux-dev",
        "--machine",
        "sim/machines/2x-h200.yaml",
        "--objective",
        "throughput",
    ];
    let s = plan_ok(&[&base[..], &["--clients", "8"]].concat(), &p);
    assert!(s.contains("throughput with 8 requests in flight"), "{s}");
    assert!(s.contains("* 2 × cuda:0 | cuda:1"), "{s}");
    assert!(
        s.contains("replicas: 2, the placement above on cuda:0 | cuda:1"),
        "{s}"
    );
    let plan = mold_plan::Plan::load(&p).unwrap();
    assert_eq!(plan.solver.objective, "throughput");
    assert_eq!(plan.replica_count(), 2);
    // The JSON outcome lists the candidates with the same figures.
    let o = mold(&[
        "plan",
        "--model",
        "flux-dev",
        "--machine",
        "sim/machines/2x-h200.yaml",
        "--objective",
        "throughput",
        "--clients",
        "8",
        "--json",
        "-o",
        d.join("j.yaml").to_str().unwrap(),
    ]);
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    let t = &v["outcome"]["throughput"];
    let cands = t["candidates"].as_array().unwrap();
    let time = |replicas: u64| {
        cands.iter().find(|c| c["replicas"] == replicas).unwrap()["request_time_s"]
            .as_f64()
            .unwrap()
    };
    let (group, replica) = (time(1), time(2));
    assert!(group < replica, "{group} {replica}");
    let bound = format!("{}", (group + replica) / 2.0);
    let s = plan_ok(
        &[&base[..], &["--clients", "8", "--max-latency", &bound]].concat(),
        &p,
    );
    assert!(s.contains("* 1 × cuda:0+cuda:1"), "{s}");
    assert!(s.contains("request over the bound"), "{s}");
    assert_eq!(mold_plan::Plan::load(&p).unwrap().replica_count(), 1);
    // Throughput flags name themselves.
    let e = plan_err(&[&base[..], &["--max-latency", "0.1"]].concat());
    assert!(
        e.contains("--max-latency 0.1: the fastest request takes") && e.contains("raise the bound"),
        "{e}"
    );
    let e = plan_err(&[&base[..], &["--clients", "0"]].concat());
    assert!(e.contains("--clients 0:"), "{e}");
    let e = plan_err(&[
        "--model",
        "flux-dev",
        "--machine",
        "sim/machines/2x-h200.yaml",
        "--clients",
        "8",
    ]);
    assert!(
        e.contains("--clients 8: only --objective throughput weighs requests in flight"),
        "{e}"
    );
}

/// A copy of safetensors file `src` with every 2-D `*.weight` stored as F8_E4M3 (zero
/// bytes: planning reads only the header), the rest as they are.
fn fp8_copy(src: &std::path::Path, dst: &std::path::Path) {
    let bytes = std::fs::read(src).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let mut out = serde_json::Map::new();
    let mut data: Vec<u8> = Vec::new();
    let mut names: Vec<&String> = header.keys().filter(|k| *k != "__metadata__").collect();
    names.sort();
    for name in names {
        let h = &header[name];
        let shape: Vec<u64> = serde_json::from_value(h["shape"].clone()).unwrap();
        let fp8 = shape.len() == 2 && name.ends_with(".weight");
        let (dtype, size) = if fp8 { ("F8_E4M3", 1) } else { ("F32", 4) };
        let len = shape.iter().product::<u64>() as usize * size;
        out.insert(
            name.clone(),
            serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [data.len(), data.len() + len]}),
        );
        data.resize(data.len() + len, 0);
    }
    let h = serde_json::to_vec(&out).unwrap();
    let mut f = (h.len() as u64).to_le_bytes().to_vec();
    f.extend_from_slice(&h);
    f.extend_from_slice(&data);
    std::fs::write(dst, f).unwrap();
}

/// An FP8 checkpoint is planned in FP8 (said on stderr), a byte a weight;
/// `--dtype transformer=bf16` widens it instead.
#[test]
fn an_fp8_checkpoint_is_planned_in_fp8() {
    let d = tempdir("ckpt-fp8");
    let o = mold(&["testdata", "flux-tiny", d.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let ck = std::fs::read_dir(&d)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| {
            p.extension().is_some_and(|x| x == "safetensors")
                && p.to_string_lossy().contains("transformer")
        })
        .expect("a transformer checkpoint");
    let f8 = d.join("fp8.safetensors");
    fp8_copy(&ck, &f8);
    let run = |extra: &[&str], out: &str| {
        let mut a = vec![
            "plan",
            "--model",
            f8.to_str().unwrap(),
            "--machine",
            "sim/machines/cpu-emu-4.yaml",
            "-o",
        ];
        let path = d.join(out);
        a.push(path.to_str().unwrap());
        a.extend_from_slice(extra);
        let o = mold(&a);
        assert!(o.status.success(), "{}", stderr(&o));
        (stderr(&o), mold_plan::Plan::load(&path).unwrap())
    };
    let (err, p) = run(&[], "p8.yaml");
    assert!(
        err.contains("stores the transformer in FP8 (e4m3): planned in FP8"),
        "{err}"
    );
    assert_eq!(p.transformer().unwrap().dtype, mold_plan::DType::Fp8);
    let (_, p) = run(&["--dtype", "transformer=bf16"], "p16.yaml");
    assert_eq!(p.transformer().unwrap().dtype, mold_plan::DType::Bf16);
}

/// `--allow-fp8` plans the transformer both ways and keeps the better: on a 16 GiB card
/// FLUX.1-dev in bf16 streams, in FP8 it is resident.
#[test]
fn allow_fp8_keeps_the_better_plan_and_says_so() {
    let d = tempdir("allow-fp8");
    let out = d.join("p.yaml");
    let o = mold(&[
        "plan",
        "--model",
        "flux-dev",
        "--machine",
        "sim/machines/1x-rtx4090.yaml",
        "--max-vram",
        "cuda:0=16GiB",
        "--allow-fp8",
        "-o",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(err.contains("--allow-fp8: the transformer in FP8"), "{err}");
    let p = mold_plan::Plan::load(&out).unwrap();
    let t = p.transformer().unwrap();
    assert_eq!(t.dtype, mold_plan::DType::Fp8);
    assert!(t
        .parts
        .iter()
        .all(|x| x.residency == mold_plan::Residency::Resident));
    // Without the flag the same request stays in bf16.
    let o = mold(&[
        "plan",
        "--model",
        "flux-dev",
        "--machine",
        "sim/machines/1x-rtx4090.yaml",
        "--max-vram",
        "cuda:0=16GiB",
        "-o",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let p = mold_plan::Plan::load(&out).unwrap();
    assert_eq!(p.transformer().unwrap().dtype, mold_plan::DType::Bf16);
}

/// FP8 blocks are held resident only: an FP8 request too big for the card is refused in
/// one line naming the way out (bf16, which can stream), never planned streamed.
#[test]
fn an_fp8_transformer_never_streams() {
    let e = plan_err(&[
        "--model",
        "flux-dev",
        "--machine",
        "sim/machines/1x-rtx4090.yaml",
        "--dtype",
        "transformer=fp8",
        "--max-vram",
        "cuda:0=8GiB",
    ]);
    assert!(
        e.contains("--dtype transformer=bf16") && e.contains("FP8 blocks stay resident"),
        "{e}"
    );
    assert_eq!(e.trim().lines().count(), 1, "{e}");
}

/// `--allow-fp8` compares the two only where both are priced alike: with measured bf16
/// tables and no FP8 table the transformer stays bf16, and the message says how to
/// measure FP8 too.
#[test]
fn allow_fp8_does_not_compare_a_measured_price_with_an_estimate() {
    let d = tempdir("allow-fp8-unlike");
    let mut m =
        mold_machine::Machine::load(std::path::Path::new("sim/machines/4x-h100-measured.yaml"))
            .unwrap();
    m.ops.retain(|t| t.dtype != mold_plan::DType::Fp8);
    m.name = "bf16-only".into();
    let prof = d.join("bf16-only.yaml");
    std::fs::write(&prof, m.to_yaml()).unwrap();
    let out = d.join("p.yaml");
    let o = mold(&[
        "plan",
        "--model",
        "flux-dev",
        "--machine",
        prof.to_str().unwrap(),
        "--allow-fp8",
        "-o",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(
        err.contains("--allow-fp8: the transformer stays in")
            && err.contains("not priced alike")
            && err.contains("--dtype fp8"),
        "{err}"
    );
    let p = mold_plan::Plan::load(&out).unwrap();
    assert_eq!(p.transformer().unwrap().dtype, mold_plan::DType::Bf16);
}

/// `--fp8-attention`: the FP8 transformer's attention in FP8 (`attention: fp8`), priced from
/// the profile's measured FP8 attention (the H200 profile has it: a shorter step than the
/// same plan without), `mold sim` saying so; kept as asked where it is priced slower, with a
/// word; refused in one line for a dense transformer.
#[test]
fn fp8_attention_is_planned_priced_and_refused_where_it_cannot_run() {
    let d = tempdir("fp8-attention");
    let m = "sim/machines/2x-h200-measured.yaml";
    let one = |extra: &[&str], out: &std::path::Path| {
        let mut args = vec![
            "plan",
            "--model",
            "flux-dev",
            "--machine",
            m,
            "--devices",
            "cuda:0",
            "--dtype",
            "transformer=fp8",
        ];
        args.extend_from_slice(extra);
        args.extend_from_slice(&["-o", out.to_str().unwrap()]);
        let o = mold(&args);
        assert!(o.status.success(), "{}", stderr(&o));
        String::from_utf8_lossy(&o.stdout).to_string()
    };
    let (with, without) = (d.join("attn.yaml"), d.join("plain.yaml"));
    let s = one(&["--fp8-attention"], &with);
    one(&[], &without);
    assert!(s.contains("fp8 (attention fp8)"), "{s}");
    let (a, b) = (
        mold_plan::Plan::load(&with).unwrap(),
        mold_plan::Plan::load(&without).unwrap(),
    );
    assert!(a.transformer().unwrap().fp8_attention());
    assert!(!b.transformer().unwrap().fp8_attention());
    assert!(std::fs::read_to_string(&with)
        .unwrap()
        .contains("  attention: fp8\n"));
    assert!(!std::fs::read_to_string(&without)
        .unwrap()
        .contains("attention"));
    assert!(
        a.predicted.step_time_s < b.predicted.step_time_s,
        "{} against {}",
        a.predicted.step_time_s,
        b.predicted.step_time_s
    );
    let o = mold(&["sim", with.to_str().unwrap(), "--machine", m]);
    let sim = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(o.status.success() && sim.contains("(FP8)"), "{sim}");
    // Sequence parallel over four H200s at 512² (6 heads a rank over 1536 tokens): the
    // tables price FP8 attention slower than bf16 attention there (its quantizing pass
    // outweighs the faster kernel); the plan keeps it as asked and says so.
    let small = d.join("small.yaml");
    let o = mold(&[
        "plan",
        "--model",
        "flux-dev",
        "--machine",
        "sim/machines/4x-h200-measured.yaml",
        "--sp",
        "4",
        "--tp",
        "off",
        "--dtype",
        "transformer=fp8",
        "--fp8-attention",
        "--size",
        "512x512",
        "-o",
        small.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("--fp8-attention: FP8 attention is priced no faster here")
            && stderr(&o).contains("kept as asked"),
        "{}",
        stderr(&o)
    );
    assert!(mold_plan::Plan::load(&small)
        .unwrap()
        .transformer()
        .unwrap()
        .fp8_attention());
    // At 1024² on one GPU it is priced faster: no word.
    let o = mold(&[
        "plan",
        "--model",
        "flux-dev",
        "--machine",
        m,
        "--devices",
        "cuda:0",
        "--dtype",
        "transformer=fp8",
        "--fp8-attention",
        "-o",
        small.to_str().unwrap(),
        "--force",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!stderr(&o).contains("priced no faster"), "{}", stderr(&o));
    // A dense transformer: refused before planning, naming the flag and the fix.
    let e = plan_err(&["--model", "flux-dev", "--machine", m, "--fp8-attention"]);
    assert!(
        e.contains("--fp8-attention")
            && e.contains("--dtype transformer=fp8")
            && !e.trim().contains('\n'),
        "{e}"
    );
    // Nor with --allow-fp8 when the transformer's dtype is given dense.
    let e = plan_err(&[
        "--model",
        "flux-dev",
        "--machine",
        m,
        "--allow-fp8",
        "--dtype",
        "transformer=bf16",
        "--fp8-attention",
    ]);
    assert!(e.contains("--fp8-attention"), "{e}");
}
