//! `mold devices --calibrate` (with `--model`: a model's operations, its components'
//! first use, the CUDA libraries' footprint) and what `mold plan` and `mold sim` make of
//! the tables it saves.

use crate::cli_devices::{machine, mold_with};
use crate::util::{stderr, stdout, tempdir};
use mold_machine::Machine;
use mold_plan::{DeviceId, Plan};
use std::path::Path;
use std::process::Output;

/// `mold devices --calibrate --model flux-tiny --machine MACHINE --save SAVE` in `d`,
/// asserted to succeed; what it printed on stderr.
fn calibrate_flux_tiny(d: &Path, machine: &str, save: &str) -> String {
    calibrate_flux_tiny_with(d, machine, save, &[])
}

/// [`calibrate_flux_tiny`] with `extra` arguments (`--no-peer`, `--size 256x256`).
fn calibrate_flux_tiny_with(d: &Path, machine: &str, save: &str, extra: &[&str]) -> String {
    let mut args = vec![
        "devices",
        "--calibrate",
        "--model",
        "flux-tiny",
        "--machine",
        machine,
        "--save",
        save,
    ];
    args.extend_from_slice(extra);
    let o = mold_with(d, None, &[], &args);
    assert!(o.status.success(), "{args:?}: {}", stderr(&o));
    stderr(&o)
}

/// A flux-tiny plan made on `profile` with everything on its first device (`--tp off`,
/// the encoders, the VAE and the transformer on GPU 0), written to `out`; `extra` more
/// `mold plan` arguments (`--size 256x256`).
fn plan_all_on_device_0(d: &Path, profile: &str, out: &Path, extra: &[&str]) -> Plan {
    let mut a = vec![
        "plan",
        "--model",
        "flux-tiny",
        "--machine",
        profile,
        "--tp",
        "off",
        "--encoder-gpu",
        "0",
        "--vae-gpu",
        "0",
        "--transformer-gpu",
        "0",
        "-o",
        out.to_str().unwrap(),
    ];
    a.extend_from_slice(extra);
    let o = mold_with(d, None, &[], &a);
    assert!(o.status.success(), "{a:?}: {}", stderr(&o));
    Plan::load(out).unwrap()
}

/// `mold sim PLAN --machine PROFILE` in `d`, asserted to succeed; what it printed.
fn sim_text(d: &Path, plan: &Path, profile: &str) -> String {
    let o = mold_with(
        d,
        None,
        &[],
        &["sim", plan.to_str().unwrap(), "--machine", profile],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    stdout(&o)
}

/// `mold devices --no-peer` profiles the box as one without peer access: no peer domains
/// (every group's collectives and hand-offs priced through host memory), said in its
/// description; the operation tables are measured as usual.
#[test]
fn a_profile_without_peer_access_has_no_peer_domains() {
    let d = tempdir("devices-no-peer");
    let base = machine("cpu-emu-4");
    assert!(!Machine::load(Path::new(&base))
        .unwrap()
        .links
        .peer
        .is_empty());
    let prof = d.join("no-peer.yaml");
    calibrate_flux_tiny_with(&d, &base, prof.to_str().unwrap(), &["--no-peer"]);
    let m = Machine::load(&prof).unwrap();
    assert!(m.links.peer.is_empty(), "{:?}", m.links.peer);
    assert!(m.description.contains("--no-peer"), "{}", m.description);
    assert!(!m.ops.is_empty());
    let ids: Vec<DeviceId> = m.devices.iter().map(|d| d.id.clone()).collect();
    assert!(m.group_link(&ids[..2]).staged);
}

/// `mold devices --calibrate --model flux-tiny` on emulated devices measures flux-tiny's
/// operations into the profile; `mold plan` and `mold sim` then price blocks from the
/// tables ("calibrated by operation") and agree on the step.
#[test]
fn calibrating_a_model_on_emulated_devices_feeds_plan_and_sim() {
    let d = tempdir("devices-ops");
    let base = machine("cpu-emu-4");
    let prof = d.join("emu-ops.yaml");
    let prof_s = prof.to_str().unwrap();
    let err = calibrate_flux_tiny(&d, &base, prof_s);
    assert!(err.contains("operation tables: flux-tiny f32"), "{err}");
    let m = Machine::load(&prof).unwrap();
    let orig = Machine::load(Path::new(&base)).unwrap();
    // The profile's figures and identity are kept; one table is added.
    assert_eq!(m.devices, orig.devices);
    assert_eq!(m.links, orig.links);
    assert_eq!(m.fingerprint(), orig.fingerprint());
    assert_eq!(m.ops.len(), 1);
    let t = &m.ops[0];
    assert_eq!(
        (t.model.as_str(), t.dtype, t.device.as_str()),
        ("flux-tiny", mold_plan::DType::F32, "emulated device (CPU)")
    );
    assert!(!t.gemm.is_empty() && !t.attention.is_empty());
    assert!(!t.collectives.all_reduce.is_empty() && !t.collectives.all_to_all.is_empty());
    // The text encoders once each, the VAE at half, the same and twice the default side.
    let runs: Vec<(&str, u64)> = t
        .components
        .iter()
        .map(|p| (p.component.as_str(), p.size))
        .collect();
    assert_eq!(
        runs,
        [
            ("clip", 77),
            ("t5", 8),
            ("vae", 32 * 32),
            ("vae", 64 * 64),
            ("vae", 128 * 128)
        ],
        "{runs:?}"
    );
    assert!(m
        .calibration
        .notes
        .contains("Operation tables for flux-tiny f32"));
    // Emulated devices time each run alone by default (GPUs back to back).
    assert!(
        m.calibration
            .notes
            .contains("operations timed alone, the median of timed runs"),
        "{}",
        m.calibration.notes
    );
    assert!(err.contains("median of 10)"), "{err}");
    // Calibrating again replaces the table rather than adding a second.
    calibrate_flux_tiny(&d, prof_s, prof_s);
    assert_eq!(Machine::load(&prof).unwrap().ops.len(), 1);

    // Plans on the calibrated and the plain profile: the tables change the prediction.
    let plan_on = |profile: &str, out: &str| {
        let out = d.join(out);
        let a = [
            "plan",
            "--model",
            "flux-tiny",
            "--machine",
            profile,
            "--tp",
            "2",
            "-o",
            out.to_str().unwrap(),
        ];
        let o = mold_with(&d, None, &[], &a);
        assert!(o.status.success(), "{a:?}: {}", stderr(&o));
        (out.clone(), Plan::load(&out).unwrap())
    };
    let (with_path, with) = plan_on(prof_s, "with.yaml");
    let (plain_path, plain) = plan_on(&base, "plain.yaml");
    assert_ne!(with.predicted.step_time_s, plain.predicted.step_time_s);
    // Encoders and the VAE on an emulated device: encode and decode are the measured runs.
    let on_emu =
        |profile: &str| plan_all_on_device_0(&d, profile, &d.join("emu0.yaml"), &[]).predicted;
    // The profile as the second calibration left it.
    let now = Machine::load(&prof).unwrap().ops[0].clone();
    let measured = |c: &str, size: u64| {
        now.components
            .iter()
            .find(|p| p.component == c && p.size == size)
            .unwrap()
            .seconds
    };
    let p = on_emu(prof_s);
    let close = |a: f64, b: f64| (a - b).abs() <= 2e-6 + 1e-3 * b;
    assert!(
        close(p.encode_time_s, measured("t5", 8) + measured("clip", 77)),
        "{p:?} {:?}",
        now.components
    );
    assert!(close(p.decode_time_s, measured("vae", 64 * 64)), "{p:?}");
    let o = mold_with(
        &d,
        None,
        &[],
        &[
            "sim",
            d.join("emu0.yaml").to_str().unwrap(),
            "--machine",
            prof_s,
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stdout(&o).contains(
            "encode and decode: measured runs for t5 on emu:0, clip on emu:0, vae on emu:0"
        ),
        "{}",
        stdout(&o)
    );
    assert_ne!(on_emu(&base).decode_time_s, p.decode_time_s);
    let sim = |plan: &Path, profile: &str| sim_text(&d, plan, profile);
    let s = sim(&with_path, prof_s);
    assert!(
        s.contains(
            "block times: calibrated by operation (tables flux-tiny f32 on emulated device (CPU))"
        ),
        "{s}"
    );
    assert!(!s.contains("extrapolated"), "{s}");
    // The planner's figure and the simulator's agree with tables.
    assert!(s.contains("(-0.00%)") || s.contains("(+0.00%)"), "{s}");
    let s = sim(&plain_path, &base);
    assert!(!s.contains("calibrated by operation"), "{s}");
    // Twice the largest calibrated side: priced beyond the tables, and said so.
    let big = d.join("big.yaml");
    let a = [
        "plan",
        "--model",
        "flux-tiny",
        "--machine",
        prof_s,
        "--size",
        "256x256",
        "-o",
        big.to_str().unwrap(),
    ];
    let o = mold_with(&d, None, &[], &a);
    assert!(o.status.success(), "{}", stderr(&o));
    let s = sim(&big, prof_s);
    assert!(
        s.contains("extrapolated at the nearest point's rate"),
        "{s}"
    );
    // The decoder too, on the emulated device: its largest measured run is 128x128.
    let big0 = d.join("big-emu0.yaml");
    plan_all_on_device_0(&d, prof_s, &big0, &["--size", "256x256"]);
    let s = sim(&big0, prof_s);
    assert!(
        s.contains("encode and decode, beyond the measured runs: vae at 256x256 (0.07 MP), outside the measured"),
        "{s}"
    );
    // Within the measured sizes nothing is said.
    let s = sim(&d.join("emu0.yaml"), prof_s);
    assert!(!s.contains("beyond the measured runs"), "{s}");
}

/// `mold devices --calibrate --model flux-tiny` on emulated devices also times each
/// component's first run in fresh processes (the hidden `mold calibrate-first-use`, this
/// binary, one per decoder size, on the same --machine): t5, clip and every vae point
/// get a finite `first_use_seconds` >= 0. `mold sim` shows it, the plan's encode and
/// decode stay warm, and a one-shot `mold exec --report` predicts warm + first use.
#[test]
fn calibrating_a_model_measures_first_use_in_fresh_processes() {
    let d = tempdir("devices-first-use");
    let base = machine("cpu-emu-4");
    let prof = d.join("emu-first.yaml");
    let prof_s = prof.to_str().unwrap();
    let err = calibrate_flux_tiny(&d, &base, prof_s);
    for size in ["32x32", "64x64", "128x128"] {
        assert!(
            err.contains(&format!(
                "first use of the encoders and the vae decoding {size} in a fresh process on emu:0"
            )),
            "{err}"
        );
    }
    assert!(!err.contains("not measured"), "{err}");
    assert!(err.contains("; first use in a fresh process: "), "{err}");
    let t = Machine::load(&prof).unwrap().ops[0].clone();
    let mut names: Vec<&str> = Vec::new();
    for p in &t.components {
        let f = p
            .first_use_seconds
            .unwrap_or_else(|| panic!("{} {}: no first use", p.component, p.size));
        assert!(f.is_finite() && f >= 0.0, "{p:?}");
        if !names.contains(&p.component.as_str()) {
            names.push(&p.component);
        }
    }
    assert_eq!(names, ["clip", "t5", "vae"]);
    assert_eq!(t.components.len(), 5, "{:?}", t.components);
    // Emulated devices have no allocator to read: no libraries' memory, no child for it.
    assert_eq!(t.library_bytes, None);
    assert!(!err.contains("CUDA libraries"), "{err}");

    // The child itself: its runs as JSON on stdout in `mold exec`'s order; a device the
    // profile lacks refused in one line; not listed in --help.
    let child = |device: &str| {
        mold_with(
            &d,
            None,
            &[],
            &[
                "calibrate-first-use",
                "--model",
                "flux-tiny",
                "--device",
                device,
                "--width",
                "32",
                "--height",
                "32",
                "--machine",
                &base,
            ],
        )
    };
    let o = child("emu:1");
    assert!(o.status.success(), "{}", stderr(&o));
    let runs: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    let order: Vec<(&str, u64)> = runs
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["component"].as_str().unwrap(),
                r["size"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(order, [("t5", 8), ("clip", 77), ("vae", 32 * 32)]);
    let o = child("emu:9");
    assert_eq!(o.status.code(), Some(1));
    let e = stderr(&o);
    assert!(
        e.contains("--device emu:9: not a device of the machine profile") && e.lines().count() == 1,
        "{e}"
    );
    let help = stdout(&mold_with(&d, None, &[], &["--help"]));
    assert!(
        help.contains("devices") && !help.contains("calibrate-first-use"),
        "{help}"
    );

    // A plan with everything on emu:0: `mold sim` names the first use, the plan's
    // encode is the warm runs, and a one-shot run's report adds the first use.
    let plan = d.join("emu0.yaml");
    let plan_s = plan.to_str().unwrap();
    let predicted = plan_all_on_device_0(&d, prof_s, &plan, &[]).predicted;
    let point = |c: &str| t.components.iter().find(|p| p.component == c).unwrap();
    let (t5, clip) = (point("t5"), point("clip"));
    let close = |a: f64, b: f64| (a - b).abs() <= 2e-6 + 1e-3 * b;
    assert!(
        close(predicted.encode_time_s, t5.seconds + clip.seconds),
        "{predicted:?}"
    );
    let o = mold_with(&d, None, &[], &["sim", plan_s, "--machine", prof_s]);
    assert!(o.status.success(), "{}", stderr(&o));
    let s = stdout(&o);
    assert!(
        s.contains("first use in a fresh process (measured; a one-shot `mold exec` pays it once")
            && s.contains("t5 on emu:0 +"),
        "{s}"
    );
    let weights = d.join("w");
    let o = mold_with(
        &d,
        None,
        &[],
        &["testdata", "flux-tiny-pipeline", weights.to_str().unwrap()],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let run = d.join("run.json");
    let o = mold_with(
        &d,
        None,
        &[],
        &[
            "exec",
            plan_s,
            "--machine",
            prof_s,
            "--weights",
            weights.to_str().unwrap(),
            "--prompt",
            "a red fox in snow",
            "--steps",
            "2",
            "--out",
            d.join("fox.png").to_str().unwrap(),
            "--report",
            run.to_str().unwrap(),
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&run).unwrap()).unwrap();
    let row = |phase: &str| {
        v["phases"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["phase"] == phase)
            .unwrap_or_else(|| panic!("no row {phase}: {v:#}"))
            .clone()
    };
    let t5_row = row("encode: t5");
    let want = t5.seconds + t5.first_use_seconds.unwrap();
    assert!(
        close(t5_row["predicted_s"].as_f64().unwrap(), want),
        "{t5_row:#} vs {want}"
    );
    assert!(
        t5_row["note"]
            .as_str()
            .unwrap()
            .contains("first use in a fresh process (t5;"),
        "{t5_row:#}"
    );
    assert!(
        row("decode")["note"]
            .as_str()
            .unwrap()
            .contains("first use in a fresh process (vae;"),
        "{v:#}"
    );
}

/// `mold calibrate-footprint` (hidden; what `mold devices --calibrate --model` spawns on
/// a GPU) reads a GPU's allocator: an emulated device or the host is refused in one line,
/// as are a device the profile lacks, an unknown model and (on a build without CUDA) a
/// GPU; nothing on stdout, no panic; not listed in --help.
#[test]
fn calibrate_footprint_refuses_what_it_cannot_measure_in_one_line() {
    let d = tempdir("footprint");
    let emu = machine("cpu-emu-4");
    let run = |args: &[&str]| {
        let mut a = vec!["calibrate-footprint", "--model"];
        a.extend_from_slice(args);
        mold_with(&d, None, &[], &a)
    };
    let refused = |o: &Output, want: &str| {
        let e = stderr(o);
        assert_eq!(o.status.code(), Some(1), "{e}");
        assert!(e.contains(want), "{want}: {e}");
        assert_eq!(e.lines().count(), 1, "{e}");
        assert!(!e.contains("panicked"), "{e}");
        assert!(stdout(o).is_empty(), "{}", stdout(o));
    };
    refused(
        &run(&["flux-tiny", "--device", "emu:0", "--machine", &emu]),
        "--device emu:0: no allocator to read on emulated devices or the host",
    );
    refused(
        &run(&["flux-tiny", "--device", "host"]),
        "no allocator to read",
    );
    refused(&run(&["flux-tiny", "--device", "gpu0"]), "--device gpu0:");
    refused(
        &run(&["flux-tiny", "--device", "cuda:9", "--machine", &emu]),
        "--device cuda:9: not a device of the machine profile",
    );
    refused(&run(&["no-such-model", "--device", "cuda:0"]), "--model");
    refused(
        &run(&["flux-tiny", "--device", "cuda:0", "--dtype", "fp4"]),
        "--dtype",
    );
    if !cfg!(feature = "cuda") {
        refused(
            &run(&["flux-tiny", "--device", "cuda:0"]),
            "--device cuda:0: this build has no CUDA, so there is no allocator to read",
        );
    }
    let help = stdout(&mold_with(&d, None, &[], &["--help"]));
    assert!(!help.contains("calibrate-footprint"), "{help}");
}

/// A box of two kinds of device gets a table for each kind, each measured on that kind
/// (collectives over that kind's devices), and the planner prices both from them.
#[test]
fn calibrating_a_mixed_box_measures_every_kind() {
    let d = tempdir("devices-ops-mixed");
    let base = std::fs::read_to_string(machine("cpu-emu-4")).unwrap();
    // emu:2 and emu:3 become a second kind.
    let mut text = String::new();
    for (i, chunk) in base.split("  - id: ").enumerate() {
        if i > 0 {
            text.push_str("  - id: ");
        }
        if chunk.starts_with("emu:2") || chunk.starts_with("emu:3") {
            text.push_str(&chunk.replace(
                "name: emulated device (CPU)",
                "name: emulated device (CPU, second kind)",
            ));
        } else {
            text.push_str(chunk);
        }
    }
    let mixed = d.join("mixed.yaml");
    std::fs::write(
        &mixed,
        text.replace("name: cpu-emu-4", "name: cpu-emu-mixed"),
    )
    .unwrap();
    let prof = d.join("mixed-ops.yaml");
    let err = calibrate_flux_tiny(&d, mixed.to_str().unwrap(), prof.to_str().unwrap());
    assert!(
        err.contains(
            "calibrating emulated device (CPU, second kind) (2 of this kind: emu:2, emu:3)"
        ),
        "{err}"
    );
    let m = Machine::load(&prof).unwrap();
    let kinds: Vec<&str> = m.ops.iter().map(|t| t.device.as_str()).collect();
    assert_eq!(
        kinds,
        [
            "emulated device (CPU)",
            "emulated device (CPU, second kind)"
        ]
    );
    for t in &m.ops {
        assert!(
            !t.gemm.is_empty() && !t.attention.is_empty(),
            "{}",
            t.device
        );
        // Two devices of each kind: all-reduces over two of them.
        assert!(
            !t.collectives.all_reduce.is_empty()
                && t.collectives.all_reduce.iter().all(|p| p.devices == 2),
            "{}",
            t.device
        );
        assert!(!t.components.is_empty(), "{}", t.device);
    }
    // A plan on the second kind alone is priced from that kind's table.
    let ok = |args: &[&str]| {
        let o = mold_with(&d, None, &[], args);
        assert!(o.status.success(), "{args:?}: {}", stderr(&o));
        stdout(&o)
    };
    let plan = d.join("p.yaml");
    let (plan_s, prof_s) = (plan.to_str().unwrap(), prof.to_str().unwrap());
    ok(&[
        "plan",
        "--model",
        "flux-tiny",
        "--machine",
        prof_s,
        "--devices",
        "emu:2,emu:3",
        "-o",
        plan_s,
    ]);
    let s = ok(&["sim", plan_s, "--machine", prof_s]);
    assert!(
        s.contains(
            "block times: calibrated by operation (tables flux-tiny f32 on emulated device (CPU, second kind))"
        ),
        "{s}"
    );
    // Each kind's price by operation, on each device that runs it.
    for kind in ["double", "single"] {
        assert!(
            s.lines().any(
                |l| l.starts_with(&format!("per block: {kind} block on emu:"))
                    && l.contains("products")
                    && l.contains("attention")
                    && l.contains("element-wise")
            ),
            "{s}"
        );
    }
}

/// Bad requests are refused in one line naming the flag, before anything is measured.
#[test]
fn calibrating_a_model_refuses_bad_requests() {
    let d = tempdir("devices-ops-bad");
    let base = machine("cpu-emu-4");
    // (model, machine, further flags), what the one line must say.
    let cases: [(&str, &str, &[&str], &str); 6] = [
        ("ltx-video-13b", &base, &[], "--model ltx-video-13b: its"),
        ("no-such-model", &base, &[], "--model:"),
        (
            "flux-tiny",
            "/nonexistent.yaml",
            &[],
            "--machine /nonexistent.yaml: no such file",
        ),
        ("flux-tiny", &base, &["--dtype", "q4"], "--dtype q4"),
        (
            "flux-tiny",
            &base,
            &["--size", "256x"],
            "--size 256x: height `` is not a number",
        ),
        (
            "flux-tiny",
            &base,
            &["--size", "250x256"],
            "--size 250x256: workload.width",
        ),
    ];
    for (model, on, extra, want) in cases {
        let mut args = vec!["devices", "--calibrate", "--model", model, "--machine", on];
        args.extend_from_slice(extra);
        let o = mold_with(&d, None, &[], &args);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {}", stdout(&o));
        let e = stderr(&o);
        assert!(e.contains(want), "{args:?}: {e}");
        assert!(!e.contains("calibrating:"), "measured before refusing: {e}");
        assert_eq!(e.trim().lines().count(), 1, "{e}");
    }
    // --machine without --model, --model without --calibrate, --size without --model:
    // clap refuses.
    let o = mold_with(
        &d,
        None,
        &[],
        &["devices", "--calibrate", "--size", "64x64"],
    );
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let o = mold_with(&d, None, &[], &["devices", "--machine", &base]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let o = mold_with(&d, None, &[], &["devices", "--model", "flux-tiny"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
}

/// `mold devices --calibrate --model flux-tiny --size 256x256` measures the products,
/// attention and decoder at that size too: a plan at it is priced from measured points,
/// where without the size it was extrapolated (`calibrating_a_model_on_emulated_devices_
/// feeds_plan_and_sim`).
#[test]
fn calibrating_at_a_size_measures_its_sequence() {
    let d = tempdir("devices-ops-size");
    let base = machine("cpu-emu-4");
    let prof = d.join("cal.yaml");
    calibrate_flux_tiny_with(&d, &base, prof.to_str().unwrap(), &["--size", "256x256"]);
    let m = Machine::load(&prof).unwrap();
    let spec = mold_models::find("flux-tiny").unwrap();
    let w = mold_plan::Workload {
        width: 256,
        height: 256,
        ..spec.default_workload.clone()
    };
    let t = spec.tokens(&w);
    let table = &m.ops[0];
    assert!(
        table.attention.iter().any(|a| a.seq == t.img + t.txt),
        "{:?}",
        table.attention
    );
    assert!(
        table.gemm.iter().any(|g| g.m == t.img),
        "no product over the {} image tokens",
        t.img
    );
    assert!(
        table
            .components
            .iter()
            .any(|c| c.component == "vae" && c.size == 256 * 256),
        "{:?}",
        table.components
    );
    // No copy engine on emulated devices: no copy rate measured.
    assert_eq!(table.htod_busy_ratio, None);
    let big = d.join("big.yaml");
    let prof_s = prof.to_str().unwrap();
    plan_all_on_device_0(&d, prof_s, &big, &["--size", "256x256"]);
    let s = sim_text(&d, &big, prof_s);
    assert!(s.contains("calibrated by operation"), "{s}");
    assert!(!s.contains("extrapolated"), "{s}");
    assert!(!s.contains("beyond the measured runs"), "{s}");
}

/// `--timing sustained` times each operation back to back for 250 ms, on emulated
/// devices too, and says so; a timing that does not exist is refused in one line.
#[test]
fn devices_calibrate_sustained_timing() {
    let d = tempdir("devices-ops-sustained");
    let base = machine("cpu-emu-4");
    let prof = d.join("emu-ops.yaml");
    let args = [
        "devices",
        "--calibrate",
        "--model",
        "flux-tiny",
        "--machine",
        base.as_str(),
        "--timing",
        "sustained",
        "--save",
        prof.to_str().unwrap(),
    ];
    let o = mold_with(&d, None, &[], &args);
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("back to back for 250 ms, median per-run time of rounds of 20 ms"),
        "{err}"
    );
    let m = Machine::load(&prof).unwrap();
    assert!(m
        .calibration
        .notes
        .contains("operations timed back to back"));
    m.ops[0].validate("ops[0]").unwrap();

    let mut bad = args;
    bad[7] = "fast";
    let o = mold_with(&d, None, &[], &bad);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("--timing"), "{}", stderr(&o));
}

/// `--dtype fp8` measures the products as FP8 plans run them (FP8 weights; emulated on the
/// CPU) into an `fp8` table, and an FP8 plan on that profile is priced from it.
#[test]
fn calibrating_in_fp8_measures_an_fp8_table_that_fp8_plans_use() {
    let d = tempdir("devices-ops-fp8");
    let base = machine("cpu-emu-4");
    let prof = d.join("emu-fp8.yaml");
    let prof_s = prof.to_str().unwrap();
    let err = calibrate_flux_tiny_with(&d, &base, prof_s, &["--dtype", "fp8"]);
    assert!(err.contains("operation tables: flux-tiny fp8"), "{err}");
    let m = Machine::load(&prof).unwrap();
    assert_eq!(m.ops.len(), 1);
    assert_eq!(m.ops[0].dtype, mold_plan::DType::Fp8);
    assert!(!m.ops[0].gemm.is_empty());
    let out = d.join("fp8.yaml");
    let p = plan_all_on_device_0(&d, prof_s, &out, &["--dtype", "transformer=fp8"]);
    assert_eq!(p.transformer().unwrap().dtype, mold_plan::DType::Fp8);
    let s = sim_text(&d, &out, prof_s);
    assert!(
        s.contains(
            "block times: calibrated by operation (tables flux-tiny fp8 on emulated device (CPU))"
        ),
        "{s}"
    );
}
