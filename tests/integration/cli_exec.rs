//! `mold testdata` → `mold plan` → `mold exec` on emulated devices, and exec's refusals.

use crate::util::*;

/// The command's stdout; it must succeed.
fn ok(args: &[&str]) -> String {
    mold_ok(args).0
}

/// Random flux-tiny weights in `d/w` and a tensor-parallel ×2 plan on the emulated
/// 4-device profile in `d/tp2.yaml`: (weights, plan).
fn tiny_tp2(d: &std::path::Path) -> (String, String) {
    let w = d.join("w").to_str().unwrap().to_string();
    let p = d.join("tp2.yaml").to_str().unwrap().to_string();
    ok(&["testdata", "flux-tiny", &w]);
    ok(&[
        "plan",
        "--model",
        "flux-tiny",
        "--machine",
        "sim/machines/cpu-emu-4.yaml",
        "--tp",
        "2",
        "-o",
        &p,
    ]);
    (w, p)
}

#[test]
fn testdata_plan_exec_verify() {
    let d = tempdir("exec-e2e");
    let w = d.join("w");
    let w = w.to_str().unwrap();
    ok(&["testdata", "flux-tiny", w]);
    for (name, extra) in [
        ("tp2", vec!["--tp", "2"]),
        ("tp4", vec!["--tp", "4"]),
        ("sp2", vec!["--sp", "2"]),
        ("sp2tp2", vec!["--sp", "2", "--tp", "2"]),
        ("one", vec!["--tp", "off"]),
    ] {
        let p = d.join(format!("{name}.yaml"));
        let p = p.to_str().unwrap();
        let mut args = vec![
            "plan",
            "--model",
            "flux-tiny",
            "--machine",
            "sim/machines/cpu-emu-4.yaml",
            "-o",
            p,
        ];
        args.extend(extra);
        ok(&args);
        let s = ok(&["exec", p, "--weights", w, "--steps", "4"]);
        assert!(s.matches("step ").count() >= 4, "{s}");
        assert!(s.contains("plan predicted"), "{s}");
        assert!(s.contains("emu:0"), "{s}");
        let s = ok(&["exec", p, "--weights", w, "--steps", "2", "--verify"]);
        assert!(s.contains("max relative error"), "{s}");
    }
    // A tensor-parallel plan really spreads over its devices.
    let s = ok(&[
        "exec",
        d.join("tp4.yaml").to_str().unwrap(),
        "--weights",
        w,
        "--steps",
        "1",
    ]);
    for dev in ["emu:1", "emu:2", "emu:3"] {
        assert!(s.contains(dev), "{dev}: {s}");
    }
    // The load's phases, in the `loaded` event: the second rank of a sequence-parallel
    // group copies the first rank's blocks; one device reads them all.
    let phases = |plan: &str| -> Vec<(String, f64)> {
        let s = ok(&[
            "exec",
            d.join(plan).to_str().unwrap(),
            "--weights",
            w,
            "--steps",
            "1",
            "--json",
        ]);
        let loaded: serde_json::Value = s
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .find(|v| v["event"] == "loaded")
            .unwrap_or_else(|| panic!("no loaded event: {s}"));
        loaded["phases"]
            .as_array()
            .unwrap_or_else(|| panic!("no phases: {loaded}"))
            .iter()
            .map(|p| {
                (
                    p["phase"].as_str().unwrap().to_string(),
                    p["seconds"].as_f64().unwrap(),
                )
            })
            .collect()
    };
    let copied = |ph: &[(String, f64)]| {
        ph.iter()
            .find(|(n, _)| n == "blocks copied between GPUs")
            .map(|p| p.1)
    };
    let (one, sp2) = (phases("one.yaml"), phases("sp2.yaml"));
    assert_eq!(copied(&one), Some(0.0), "{one:?}");
    assert!(copied(&sp2).is_some_and(|s| s > 0.0), "{sp2:?}");
    for ph in [&one, &sp2] {
        assert!(ph.iter().all(|(_, s)| *s >= 0.0), "{ph:?}");
        assert!(
            ph.iter()
                .any(|(n, s)| n == "blocks read and uploaded" && *s > 0.0),
            "{ph:?}"
        );
    }
    // `--sp 2` (and `--sp 2 --tp 2`) plans are sequence parallel, and exec runs them.
    let sp = read(&d.join("sp2.yaml"));
    assert!(sp.contains("sp: 2"), "{sp}");
    let hybrid = read(&d.join("sp2tp2.yaml"));
    assert!(
        hybrid.contains("sp: 2") && hybrid.contains("tp: 2"),
        "{hybrid}"
    );
}

/// `--no-peer` (as on a box without peer access: hand-offs through host memory, NCCL off
/// the GPU-to-GPU path) runs a tensor-parallel plan to the same output.
#[test]
fn no_peer_runs_the_same() {
    let d = tempdir("exec-no-peer");
    let (w, p) = tiny_tp2(&d);
    let digest = |s: &str| {
        s.lines()
            .find_map(|l| l.strip_prefix("output digest: "))
            .map(str::to_string)
            .unwrap_or_else(|| panic!("no output digest: {s}"))
    };
    let with = ok(&["exec", &p, "--weights", &w, "--steps", "2"]);
    let without = ok(&["exec", &p, "--weights", &w, "--steps", "2", "--no-peer"]);
    assert_eq!(digest(&with), digest(&without));
}

/// A bf16 checkpoint and plan: the model output is bf16 while the latents are f32.
#[test]
fn bf16_plan_runs_and_verifies() {
    let d = tempdir("exec-bf16");
    let w = d.join("w");
    let w = w.to_str().unwrap();
    ok(&["testdata", "flux-tiny", w, "--dtype", "bf16"]);
    let p = d.join("p.yaml");
    let p = p.to_str().unwrap();
    ok(&[
        "plan",
        "--model",
        "flux-tiny",
        "--machine",
        "sim/machines/cpu-emu-4.yaml",
        "--tp",
        "2",
        "--dtype",
        "transformer=bf16",
        "-o",
        p,
    ]);
    let s = ok(&["exec", p, "--weights", w, "--steps", "2", "--verify"]);
    assert!(s.contains("max relative error"), "{s}");
}

/// An FP8 plan runs tensor parallel on emulated devices, says how its products ran
/// (emulated on the CPU: FP8's arithmetic, not its speed) and verifies against the dense
/// model within FP8's tolerance.
#[test]
fn fp8_plan_runs_reports_its_products_and_verifies() {
    let d = tempdir("exec-fp8");
    let w = d.join("w");
    let w = w.to_str().unwrap();
    ok(&["testdata", "flux-tiny", w]);
    let p = d.join("p.yaml");
    let p = p.to_str().unwrap();
    ok(&[
        "plan",
        "--model",
        "flux-tiny",
        "--machine",
        "sim/machines/cpu-emu-4.yaml",
        "--tp",
        "2",
        "--dtype",
        "transformer=fp8",
        "-o",
        p,
    ]);
    let s = ok(&["exec", p, "--weights", w, "--steps", "2", "--verify"]);
    assert!(
        s.contains("FP8 products: 0 FP8 matmuls (cuBLASLt, per-row scales), 0 weight-only, ")
            && s.contains(" emulated"),
        "{s}"
    );
    assert!(s.contains("(tolerance 1e-1)"), "{s}");
}

#[test]
fn exec_refusals_name_the_problem() {
    let d = tempdir("exec-refuse");
    let w = d.join("w");
    let ws = w.to_str().unwrap();
    ok(&["testdata", "flux-tiny", ws]);
    let p = d.join("p.yaml");
    let ps = p.to_str().unwrap();
    ok(&[
        "plan",
        "--model",
        "flux-tiny",
        "--machine",
        "sim/machines/cpu-emu-4.yaml",
        "--tp",
        "2",
        "-o",
        ps,
    ]);

    // Another machine: refused unless --force.
    let e = mold_fails(&[
        "exec",
        ps,
        "--weights",
        ws,
        "--machine",
        "sim/machines/2x-l40s.yaml",
    ]);
    assert!(
        e.contains("made for machine `cpu-emu-4`") && e.contains("--force"),
        "{e}"
    );

    // The same box with budgets too small: the simulator refuses before any weight is
    // read (the weights path does not even exist).
    let small = d.join("cpu-emu-4.yaml");
    let profile =
        read(&root().join("sim/machines/cpu-emu-4.yaml")).replace("budget: 4GiB", "budget: 65MiB");
    assert!(profile.contains("65MiB"));
    std::fs::write(&small, profile).unwrap();
    let e = mold_fails(&[
        "exec",
        ps,
        "--weights",
        "/nonexistent/weights",
        "--machine",
        small.to_str().unwrap(),
    ]);
    assert!(e.contains("cannot fit") && e.contains("emu:0"), "{e}");

    // A checkpoint of another shape: the tensor and both shapes are named.
    let mut cfg = mold_exec::FluxConfig::flux_tiny();
    cfg.mlp_ratio = 2.0;
    let other = d.join("other");
    std::fs::create_dir_all(&other).unwrap();
    mold_exec::write_testdata(&cfg, &other, 1, mold_exec::DType::F32).unwrap();
    let e = mold_fails(&["exec", ps, "--weights", other.to_str().unwrap()]);
    assert!(
        e.contains("img_mlp.0.weight") && e.contains("256") && e.contains("128"),
        "{e}"
    );

    // A model mold cannot execute yet is named.
    let q = d.join("q.yaml");
    ok(&[
        "plan",
        "--model",
        "sd3.5-large",
        "--machine",
        "sim/machines/8x-h100.yaml",
        "-o",
        q.to_str().unwrap(),
    ]);
    let e = mold_fails(&["exec", q.to_str().unwrap(), "--weights", ws]);
    assert!(
        e.contains("sd3.5-large") && e.contains("not executed yet"),
        "{e}"
    );
}

/// A rank that fails (error or panic) in the middle of a tensor-parallel step brings the
/// whole group down: the command exits non-zero, promptly, naming the failed device.
#[test]
fn failing_rank_stops_the_group_and_is_named() {
    let d = tempdir("exec-fault");
    let (w, p) = tiny_tp2(&d);
    let (w, p) = (w.as_str(), p.as_str());
    for kind in ["error", "panic"] {
        let fault = format!("emu:1@single 1:{kind}");
        let t0 = std::time::Instant::now();
        let o = mold_env(
            &["exec", p, "--weights", w, "--steps", "2"],
            &[("MOLD_FAULT", fault.as_str())],
        );
        let err = stderr(&o);
        assert!(!o.status.success(), "{kind}: should fail: {}", stdout(&o));
        assert!(err.contains("emu:1"), "{kind}: {err}");
        assert!(err.contains("injected"), "{kind}: {err}");
        assert!(
            t0.elapsed().as_secs() < 60,
            "{kind}: took {:?}",
            t0.elapsed()
        );
    }
    // A malformed MOLD_FAULT is refused, naming the variable, not silently ignored.
    for bad in ["emu:1@triple 1", "emu:1@single 9", "emu:1"] {
        let o = mold_env(
            &["exec", p, "--weights", w, "--steps", "1"],
            &[("MOLD_FAULT", bad)],
        );
        assert!(!o.status.success(), "{bad}");
        assert!(stderr(&o).contains("MOLD_FAULT"), "{bad}: {}", stderr(&o));
    }
    // `hang` has no watchdog to end it off NCCL: refused there, naming the way out.
    let o = mold_env(
        &["exec", p, "--weights", w, "--steps", "1"],
        &[("MOLD_FAULT", "emu:1@single 1:hang")],
    );
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("use `error` or `panic`"),
        "{}",
        stderr(&o)
    );
}

/// `MOLD_PROFILE=1` prints per-phase times for every rank; without it, nothing.
#[test]
fn profile_reports_phases_per_device() {
    let d = tempdir("exec-profile");
    let (w, p) = tiny_tp2(&d);
    let args = ["exec", p.as_str(), "--weights", w.as_str(), "--steps", "2"];
    let s = stdout(&mold_env(&args, &[("MOLD_PROFILE", "1")]));
    assert!(s.contains("profile (MOLD_PROFILE"), "{s}");
    for want in [
        "emu:0:",
        "emu:1:",
        "attention",
        "all-reduce",
        "qk norm + layout",
    ] {
        assert!(s.contains(want), "{want}: {s}");
    }
    assert!(!ok(&args).contains("profile (MOLD_PROFILE"));
}

/// A plan the planner made partially resident (a tight budget): every streaming mode
/// runs it and matches the 1-device reference; the output names the mode, the buffers
/// and the host memory; host memory too small is refused before loading, with numbers.
#[test]
fn streamed_plan_runs_in_every_mode_and_host_memory_is_checked() {
    let d = tempdir("exec-stream");
    let w = d.join("w").to_str().unwrap().to_string();
    let p = d.join("stream.yaml").to_str().unwrap().to_string();
    ok(&["testdata", "flux-tiny", &w]);
    // The emulated box with small device budgets.
    let m = d.join("cpu-emu-4.yaml");
    let profile =
        read(&root().join("sim/machines/cpu-emu-4.yaml")).replace("budget: 4GiB", "budget: 66MiB");
    std::fs::write(&m, profile).unwrap();
    let m = m.to_str().unwrap().to_string();
    ok(&[
        "plan",
        "--model",
        "flux-tiny",
        "--machine",
        &m,
        "--devices",
        "emu:0",
        "-o",
        &p,
    ]);
    let plan = read(std::path::Path::new(&p));
    assert!(
        plan.contains("residency: streamed") && plan.contains("residency: resident"),
        "the budget should make the plan partially resident: {plan}"
    );
    for mode in ["pinned", "pageable", "sync"] {
        let s = ok(&[
            "exec",
            &p,
            "--machine",
            &m,
            "--weights",
            &w,
            "--steps",
            "3",
            "--verify",
            "--streaming",
            mode,
        ]);
        assert!(s.contains("max relative error"), "{mode}: {s}");
        assert!(s.contains(&format!("streams ({mode})")), "{mode}: {s}");
        if mode == "sync" {
            assert!(s.contains("1 stream buffer(s)"), "{s}");
        } else {
            // Emulated devices have no page-locked memory; one fill, then one copy
            // per streamed block and step.
            assert!(
                s.contains("in pageable host memory, 2 stream buffer(s)"),
                "{s}"
            );
            assert!(s.contains("1 ring fill(s)"), "{s}");
        }
    }
    // The environment picks the mode when the flag does not; bad values are named.
    let o = mold_env(
        &["exec", &p, "--machine", &m, "--weights", &w, "--steps", "1"],
        &[("MOLD_STREAMING", "sync")],
    );
    assert!(stdout(&o).contains("streams (sync)"), "{}", stdout(&o));
    let o = mold_env(
        &["exec", &p, "--machine", &m, "--weights", &w, "--steps", "1"],
        &[("MOLD_STREAMING", "turbo")],
    );
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("MOLD_STREAMING: `turbo`"),
        "{}",
        stderr(&o)
    );
    let e = mold_fails(&[
        "exec",
        &p,
        "--machine",
        &m,
        "--weights",
        &w,
        "--streaming",
        "fast",
    ]);
    assert!(e.contains("`fast` is not a streaming mode"), "{e}");
    // Too little host memory for the streamed weights: refused with the figures, the
    // need sized exactly as the loaded run accounts it.
    let s = ok(&["exec", &p, "--machine", &m, "--weights", &w, "--steps", "1"]);
    let host = s
        .split("streams (pinned): ")
        .nth(1)
        .and_then(|r| r.split(" in pageable").next())
        .unwrap_or_else(|| panic!("no host figure: {s}"))
        .to_string();
    let o = mold_env(
        &["exec", &p, "--machine", &m, "--weights", &w, "--steps", "1"],
        &[("MOLD_HOST_MEMORY", "4KiB")],
    );
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(
        e.contains(&format!("take {host} of host memory")),
        "{host}: {e}"
    );
    assert!(e.contains("is available (MOLD_HOST_MEMORY)"), "{e}");
    assert!(e.contains("nothing was loaded"), "{e}");
    assert!(!stdout(&o).contains("loaded"), "{}", stdout(&o));
}

/// Checks that could pass vacuously are refused: `--steps 0` (runs nothing), a NaN or
/// negative `--tolerance` (turns `--verify` off), a missing `--weights` (named once).
#[test]
fn vacuous_checks_and_missing_weights_are_refused() {
    let d = tempdir("exec-vacuous");
    let (w, p) = tiny_tp2(&d);
    let e = mold_fails(&["exec", &p, "--weights", &w, "--steps", "0", "--verify"]);
    assert!(e.contains("--steps 0"), "{e}");
    for t in ["NaN", "inf", "-1e-3"] {
        let t = format!("--tolerance={t}");
        let e = mold_fails(&["exec", &p, "--weights", &w, "--verify", &t]);
        assert!(
            e.contains("--tolerance") && e.contains("finite number >= 0"),
            "{t}: {e}"
        );
    }
    let e = mold_fails(&["exec", &p, "--weights", "/nonexistent/weights"]);
    assert!(e.contains("--weights /nonexistent/weights"), "{e}");
    assert_eq!(
        e.matches("/nonexistent/weights").count(),
        1,
        "named once: {e}"
    );
    assert!(!e.contains("os error"), "{e}");
}

#[test]
fn a_bad_cudnn_plans_setting_is_refused_in_one_line_before_any_command() {
    let o = mold_env(&["models"], &[("MOLD_CUDNN_PLANS", "maybe")]);
    assert_eq!(o.status.code(), Some(2));
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(
        e.contains("MOLD_CUDNN_PLANS: `maybe`") && e.contains("`off`"),
        "{e}"
    );
    assert_eq!(e.trim().lines().count(), 1, "{e}");
    for fine in ["on", "off", ""] {
        let o = mold_env(&["models"], &[("MOLD_CUDNN_PLANS", fine)]);
        assert!(
            o.status.success(),
            "{fine}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
}
