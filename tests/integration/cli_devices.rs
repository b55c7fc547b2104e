//! `mold devices`, `mold info`, and the configuration (`config.toml`, `MOLD_*`, flags) as
//! `mold plan` applies it: command line > environment > config file > defaults.

use crate::util::{root, stderr, stdout, tempdir};
use mold_machine::inventory::{
    apply_measurements, DeviceMeasurement, GpuInfo, Inventory, Measurements, PeerCopy, PeerInfo,
    ProfileOptions,
};
use mold_machine::Machine;
use mold_plan::{ByteSize, DeviceId, Plan, GIB};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const VARS: [&str; 9] = [
    "MOLD_CONFIG",
    "MOLD_GPUS",
    "MOLD_GPU",
    "MOLD_MAX_VRAM",
    "MOLD_HEADROOM",
    "MOLD_MACHINE",
    "MOLD_OBJECTIVE",
    "MOLD_WEIGHTS_DIRS",
    "XDG_CONFIG_HOME",
];

/// Runs mold with only the given configuration: `config` (written to a file named by
/// MOLD_CONFIG) and `env`; no other MOLD_* variable, no user config file.
fn mold_with(dir: &Path, config: Option<&str>, env: &[(&str, &str)], args: &[&str]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_mold"));
    c.args(args).current_dir(root());
    for v in VARS {
        c.env_remove(v);
    }
    // An empty config home: the user's own config file is never read.
    let home = dir.join("xdg");
    std::fs::create_dir_all(&home).unwrap();
    c.env("XDG_CONFIG_HOME", &home);
    if let Some(text) = config {
        let p = dir.join("config.toml");
        std::fs::write(&p, text).unwrap();
        c.env("MOLD_CONFIG", &p);
    }
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().expect("run mold")
}

fn machine(name: &str) -> String {
    root()
        .join("sim/machines")
        .join(format!("{name}.yaml"))
        .display()
        .to_string()
}

/// `mold plan --model flux-dev` plus `args`; the summary and the plan written.
fn plan(dir: &Path, config: Option<&str>, env: &[(&str, &str)], args: &[&str]) -> (String, Plan) {
    let out = dir.join("p.yaml");
    let mut a = vec!["plan", "--model", "flux-dev", "-o", out.to_str().unwrap()];
    a.extend_from_slice(args);
    let o = mold_with(dir, config, env, &a);
    assert!(
        o.status.success(),
        "mold {a:?} {env:?} config {config:?}: {}",
        stderr(&o)
    );
    (stdout(&o), Plan::load(&out).unwrap())
}

fn plan_err(dir: &Path, config: Option<&str>, env: &[(&str, &str)], args: &[&str]) -> String {
    let mut a = vec![
        "plan",
        "--model",
        "flux-dev",
        "-o",
        "/nonexistent-dir/never.yaml",
    ];
    a.extend_from_slice(args);
    let o = mold_with(dir, config, env, &a);
    assert_eq!(
        o.status.code(),
        Some(1),
        "mold {a:?} should fail: {}",
        stdout(&o)
    );
    stderr(&o)
}

fn ids(p: &Plan) -> Vec<String> {
    p.machine.devices.iter().map(|d| d.id.to_string()).collect()
}

/// The summary's memory line of `dev`: "cuda:0  19.39 GiB + 1.00 GiB /  78.65 GiB  26%".
fn memory_line(summary: &str, dev: &str) -> String {
    summary
        .lines()
        .find(|l| l.trim_start().starts_with(dev) && l.contains(" / "))
        .unwrap_or_else(|| panic!("no memory line for {dev}: {summary}"))
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
}

#[test]
#[cfg(not(feature = "cuda"))]
fn devices_without_cuda_says_how_to_get_it() {
    let d = tempdir("devices-nocuda");
    for args in [
        &["devices"][..],
        &["devices", "--json"],
        &["devices", "--save", "x.yaml"],
        &["info", "--gpus"],
    ] {
        let o = mold_with(&d, None, &[], args);
        assert_eq!(o.status.code(), Some(2), "mold {args:?}: {}", stderr(&o));
        let e = stderr(&o);
        assert!(
            e.contains("no CUDA") && e.contains("scripts/build-cuda"),
            "mold {args:?}: {e}"
        );
        assert!(stdout(&o).is_empty(), "{}", stdout(&o));
    }
    assert!(!root().join("x.yaml").exists());
    let e = plan_err(&d, None, &[], &["--machine", "local"]);
    assert!(
        e.contains("--machine local") && e.contains("scripts/build-cuda"),
        "{e}"
    );
    // `local` from the environment says where it came from.
    let e = plan_err(&d, None, &[("MOLD_MACHINE", "local")], &[]);
    assert!(e.contains("MOLD_MACHINE") && e.contains("no CUDA"), "{e}");
}

#[test]
fn machine_precedence() {
    let d = tempdir("cfg-machine");
    let cfg = format!("machine = \"{}\"\n", machine("2x-l40s"));
    let env = [("MOLD_MACHINE", "sim/machines/1x-rtx4090.yaml")];
    // default: none (CPU builds), or this box (CUDA builds)
    if !cfg!(feature = "cuda") {
        let e = plan_err(&d, None, &[], &[]);
        assert!(
            e.contains("name a machine") && e.contains("--machine"),
            "{e}"
        );
    }
    // config
    let (s, p) = plan(&d, Some(&cfg), &[], &[]);
    assert_eq!(p.machine.name, "2x-l40s");
    assert!(
        s.contains("machine profile: ") && s.contains("[from config ") && s.contains(": machine]"),
        "{s}"
    );
    // environment over config
    let (s, p) = plan(&d, Some(&cfg), &env, &[]);
    assert_eq!(p.machine.name, "1x-rtx4090");
    assert!(s.contains("[from MOLD_MACHINE]"), "{s}");
    // flag over both; the line is as it always was
    let (s, p) = plan(
        &d,
        Some(&cfg),
        &env,
        &["--machine", "sim/machines/2x-h200.yaml"],
    );
    assert_eq!(p.machine.name, "2x-h200");
    assert!(
        s.starts_with("machine profile: sim/machines/2x-h200.yaml (figures.md, 2026-11-20)\n"),
        "{s}"
    );
    // A relative path in the config file is relative to the file.
    let rel = d.join("machines");
    std::fs::create_dir_all(&rel).unwrap();
    std::fs::copy(machine("2x-rtx4090"), rel.join("box.yaml")).unwrap();
    let (_, p) = plan(&d, Some("machine = \"machines/box.yaml\""), &[], &[]);
    assert_eq!(p.machine.name, "2x-rtx4090");
}

#[test]
fn gpus_precedence() {
    let d = tempdir("cfg-gpus");
    let m = ["--machine", "sim/machines/4x-h100.yaml"];
    let with = |extra: &[&'static str]| -> Vec<&str> {
        let mut v = m.to_vec();
        v.extend_from_slice(extra);
        v
    };
    let cfg = Some("gpus = [1]\n");
    // default: every device
    let (_, p) = plan(&d, None, &[], &m);
    assert_eq!(ids(&p), ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]);
    // config
    let (_, p) = plan(&d, cfg, &[], &m);
    assert_eq!(ids(&p), ["cuda:1"]);
    // environment over config
    let (_, p) = plan(&d, cfg, &[("MOLD_GPUS", "0,3")], &m);
    assert_eq!(ids(&p), ["cuda:0", "cuda:3"]);
    let (_, p) = plan(&d, cfg, &[("MOLD_GPU", "2")], &m);
    assert_eq!(ids(&p), ["cuda:2"]);
    // flags over both
    let (_, p) = plan(&d, cfg, &[("MOLD_GPUS", "0,3")], &with(&["--gpus", "2,3"]));
    assert_eq!(ids(&p), ["cuda:2", "cuda:3"]);
    let (_, p) = plan(&d, cfg, &[("MOLD_GPUS", "0,3")], &with(&["--gpu", "0"]));
    assert_eq!(ids(&p), ["cuda:0"]);
    let (_, p) = plan(
        &d,
        cfg,
        &[("MOLD_GPUS", "0,3")],
        &with(&["--devices", "cuda:1,cuda:2"]),
    );
    assert_eq!(ids(&p), ["cuda:1", "cuda:2"]);
}

/// The seed's spelling: `gpu = 1` in the config file selects one GPU, as `gpus = [1]`
/// does; `MOLD_GPU` and flags still win; `gpu` and `gpus` together are refused naming
/// both keys.
#[test]
fn config_gpu_selects_one_gpu() {
    let d = tempdir("cfg-gpu");
    let m = ["--machine", "sim/machines/4x-h100.yaml"];
    let (_, p) = plan(&d, Some("gpu = 1\n"), &[], &m);
    assert_eq!(ids(&p), ["cuda:1"]);
    let (_, p) = plan(&d, Some("gpu = \"cuda:2\"\n"), &[], &m);
    assert_eq!(ids(&p), ["cuda:2"]);
    let (_, p) = plan(&d, Some("gpu = 1\n"), &[("MOLD_GPU", "3")], &m);
    assert_eq!(ids(&p), ["cuda:3"]);
    let mut a = m.to_vec();
    a.extend_from_slice(&["--gpus", "0,2"]);
    let (_, p) = plan(&d, Some("gpu = 1\n"), &[], &a);
    assert_eq!(ids(&p), ["cuda:0", "cuda:2"]);
    let e = plan_err(&d, Some("gpu = 1\ngpus = [2]\n"), &[], &m);
    assert!(
        e.contains("config.toml: gpu and gpus: both are set") && e.lines().count() == 1,
        "{e}"
    );
    let e = plan_err(&d, Some("gpu = 9\n"), &[], &m);
    assert!(
        e.contains("config.toml: gpu") && e.contains("cuda:9"),
        "{e}"
    );
    let o = mold_with(&d, Some("gpu = 2\n"), &[], &["info"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("config.toml: gpu]"), "{}", stdout(&o));
}

#[test]
fn missing_gpu_is_a_clear_error() {
    let d = tempdir("cfg-missing");
    let m = ["--machine", "sim/machines/2x-l40s.yaml"];
    let mut a = m.to_vec();
    a.extend_from_slice(&["--gpus", "1,5"]);
    let e = plan_err(&d, None, &[], &a);
    assert!(
        e.contains("--gpus 1,5") && e.contains("cuda:5") && e.contains("it has cuda:0, cuda:1"),
        "{e}"
    );
    let mut a = m.to_vec();
    a.extend_from_slice(&["--gpu", "2"]);
    let e = plan_err(&d, None, &[], &a);
    assert!(
        e.contains("--gpu 2") && e.contains("cuda:2") && e.contains("cuda:0, cuda:1"),
        "{e}"
    );
    let e = plan_err(&d, None, &[("MOLD_GPUS", "7")], &m);
    assert!(e.contains("MOLD_GPUS=7") && e.contains("cuda:7"), "{e}");
    let e = plan_err(&d, Some("gpus = [0, 9]"), &[], &m);
    assert!(
        e.contains("config.toml: gpus") && e.contains("cuda:9"),
        "{e}"
    );
    let e = plan_err(&d, None, &[("MOLD_GPUS", "one")], &m);
    assert!(
        e.contains("MOLD_GPUS=one") && e.contains("not a GPU"),
        "{e}"
    );
}

#[test]
fn headroom_precedence() {
    let d = tempdir("cfg-headroom");
    let m = ["--machine", "sim/machines/4x-h100.yaml"];
    let cfg = Some("headroom = \"3GiB\"\n");
    let env = [("MOLD_HEADROOM", "2GiB")];
    let h = |s: &str| memory_line(s, "cuda:0");
    // default: the profile's
    assert!(h(&plan(&d, None, &[], &m).0).contains("+ 1.00 GiB /"));
    assert!(h(&plan(&d, cfg, &[], &m).0).contains("+ 3.00 GiB /"));
    assert!(h(&plan(&d, cfg, &env, &m).0).contains("+ 2.00 GiB /"));
    let mut a = m.to_vec();
    a.extend_from_slice(&["--headroom", "4GiB"]);
    assert!(h(&plan(&d, cfg, &env, &a).0).contains("+ 4.00 GiB /"));
    let mut a = m.to_vec();
    a.extend_from_slice(&["--headroom", "90GiB"]);
    let e = plan_err(&d, None, &[], &a);
    assert!(e.contains("--headroom") && e.contains("cuda:0"), "{e}");
}

#[test]
fn max_vram_precedence() {
    let d = tempdir("cfg-vram");
    let m = ["--machine", "sim/machines/4x-h100.yaml"];
    let cfg = Some("[max_vram]\n\"cuda:0\" = \"20GiB\"\n\"cuda:2\" = \"25GiB\"\n");
    let env = [("MOLD_MAX_VRAM", "cuda:0=30GiB,cuda:1=35GiB")];
    let b = |s: &str, dev: &str| memory_line(s, dev);
    let (s, _) = plan(&d, None, &[], &m);
    assert!(b(&s, "cuda:0").contains("/ 78.65 GiB"), "{s}");
    let (s, _) = plan(&d, cfg, &[], &m);
    assert!(b(&s, "cuda:0").contains("/ 20.00 GiB"), "{s}");
    assert!(b(&s, "cuda:2").contains("/ 25.00 GiB"), "{s}");
    // environment over config, per device
    let (s, _) = plan(&d, cfg, &env, &m);
    assert!(b(&s, "cuda:0").contains("/ 30.00 GiB"), "{s}");
    assert!(b(&s, "cuda:1").contains("/ 35.00 GiB"), "{s}");
    assert!(b(&s, "cuda:2").contains("/ 25.00 GiB"), "{s}");
    // flag over both, for the device it names
    let mut a = m.to_vec();
    a.extend_from_slice(&["--max-vram", "cuda:0=40GiB"]);
    let (s, _) = plan(&d, cfg, &env, &a);
    assert!(b(&s, "cuda:0").contains("/ 40.00 GiB"), "{s}");
    assert!(b(&s, "cuda:1").contains("/ 35.00 GiB"), "{s}");
    // A cap on a device this machine lacks names where it was set.
    let e = plan_err(&d, None, &[("MOLD_MAX_VRAM", "cuda:9=1GiB")], &m);
    assert!(e.contains("MOLD_MAX_VRAM") && e.contains("cuda:9"), "{e}");
    // A cap on a device not selected is fine.
    let mut a = m.to_vec();
    a.extend_from_slice(&["--gpus", "1"]);
    let (s, _) = plan(&d, cfg, &[], &a);
    assert!(b(&s, "cuda:1").contains("/ 78.65 GiB"), "{s}");
}

#[test]
fn objective_precedence() {
    let d = tempdir("cfg-objective");
    let m = ["--machine", "sim/machines/4x-h100.yaml"];
    let cfg = Some("objective = \"memory\"\n");
    let env = [("MOLD_OBJECTIVE", "latency")];
    let o = |s: &str| {
        s.lines()
            .find(|l| l.starts_with("solver:"))
            .unwrap()
            .to_string()
    };
    assert!(o(&plan(&d, None, &[], &m).0).contains("objective latency"));
    assert!(o(&plan(&d, cfg, &[], &m).0).contains("objective memory"));
    assert!(o(&plan(&d, cfg, &env, &m).0).contains("objective latency"));
    let mut a = m.to_vec();
    a.extend_from_slice(&["--objective", "memory"]);
    assert!(o(&plan(&d, cfg, &env, &a).0).contains("objective memory"));
}

#[test]
fn unknown_config_key_is_named() {
    let d = tempdir("cfg-unknown");
    let cfg = Some("gpus = [0]\nmax_vrams = 3\n");
    let e = plan_err(&d, cfg, &[], &["--machine", "sim/machines/2x-l40s.yaml"]);
    assert!(
        e.contains("unknown key `max_vrams`") && e.contains("config.toml"),
        "{e}"
    );
    let o = mold_with(&d, cfg, &[], &["info"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("`max_vrams`"), "{}", stderr(&o));
    // A missing file named by MOLD_CONFIG is an error too.
    let o = mold_with(
        &d,
        None,
        &[("MOLD_CONFIG", "/nonexistent/mold.toml")],
        &["info"],
    );
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("/nonexistent/mold.toml"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn info_shows_the_configuration_and_its_sources() {
    let d = tempdir("cfg-info");
    let o = mold_with(
        &d,
        Some("gpus = [1, 2]\nheadroom = \"2GiB\"\n"),
        &[("MOLD_HEADROOM", "3GiB")],
        &["info"],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let s = stdout(&o);
    assert!(s.contains("config.toml"), "{s}");
    assert!(
        s.contains("1,2  [config ") && s.contains("config.toml: gpus]"),
        "{s}"
    );
    assert!(s.contains("3GiB  [MOLD_HEADROOM]"), "{s}");
    assert!(s.contains("latency  [default]"), "{s}");
    // exec's options too, each with where it comes from.
    let o = mold_with(&d, None, &[("MOLD_STREAMING", "sync")], &["info"]);
    let s = stdout(&o);
    assert!(
        s.contains("streaming     sync (from MOLD_STREAMING)"),
        "{s}"
    );
    assert!(s.contains("kernels       auto (from default)"), "{s}");
}

fn gpu(ordinal: u32, free_gib: u64) -> GpuInfo {
    GpuInfo {
        ordinal,
        name: "NVIDIA H100 80GB HBM3".into(),
        uuid: format!("GPU-0000000{ordinal}-0000-0000-0000-000000000000"),
        total: ByteSize(81_559 * (1 << 20)),
        free: ByteSize(free_gib * GIB),
        compute_capability: "9.0".into(),
        pci_bus: format!("0000:{:02x}:00.0", 0x18 + ordinal),
        multiprocessors: 132,
        clock_mhz: Some(1980),
        memory_clock_mhz: Some(2619),
        memory_bus_bits: Some(5120),
    }
}

/// What `mold devices --save … --calibrate` writes on a two-H100 NVLink box, built from a
/// recorded inventory and measurements.
fn saved_profile(name: &str) -> Machine {
    let peer = |from, to| PeerInfo {
        from,
        to,
        access: true,
        performance_rank: Some(0),
        native_atomics: true,
    };
    let inv = Inventory {
        driver_version: Some("13.0".into()),
        // cuda:1 busy with another process
        devices: vec![gpu(0, 79), gpu(1, 40)],
        peers: vec![peer(0, 1), peer(1, 0)],
        host_memory: Some(ByteSize(256 * GIB)),
        host_cpus: Some(32),
    };
    let mut m = inv
        .to_machine(&ProfileOptions {
            name: name.into(),
            headroom: ByteSize(GIB),
            caps: Default::default(),
            date: "2026-05-01".into(),
            mold_version: env!("CARGO_PKG_VERSION").into(),
        })
        .unwrap();
    let dm = |ordinal| DeviceMeasurement {
        ordinal,
        bf16_tflops: 712.4,
        matmul_n: 8192,
        mem_bandwidth_gbps: 2950.0,
        host_pinned_gbps: 26.1,
        host_pinned_busy_gbps: Some(22.9),
        host_pageable_gbps: 9.3,
        copy_bytes: GIB,
    };
    let r = Measurements {
        devices: vec![dm(0), dm(1)],
        peer_copies: vec![
            PeerCopy {
                from: 0,
                to: 1,
                gbps: 365.0,
            },
            PeerCopy {
                from: 1,
                to: 0,
                gbps: 362.0,
            },
        ],
        allreduce: None,
        not_measured: vec![],
    };
    apply_measurements(&mut m, &r, "2026-05-01", env!("CARGO_PKG_VERSION"));
    m
}

#[test]
fn saved_profile_plans_and_simulates_anywhere() {
    let d = tempdir("saved-profile");
    let machines: PathBuf = d.join("machines");
    std::fs::create_dir_all(&machines).unwrap();
    let m = saved_profile("my-box");
    let path = machines.join("my-box.yaml");
    std::fs::write(&path, m.to_yaml()).unwrap();
    // round trip
    let back = Machine::load(&path).unwrap();
    assert_eq!(back, m);
    assert_eq!(Machine::from_yaml(&back.to_yaml(), "again").unwrap(), m);
    assert_eq!(m.calibration.source, "measured");
    assert_eq!(m.calibration.date.as_deref(), Some("2026-05-01"));
    assert_eq!(
        m.calibration.mold_version.as_deref(),
        Some(env!("CARGO_PKG_VERSION"))
    );
    assert!(m.calibration.notes.contains("all-reduce: not measured"));
    // The busy device's budget is its own free memory.
    assert_eq!(
        m.device(&DeviceId::Cuda(1)).unwrap().budget,
        ByteSize(40 * GIB)
    );
    assert_eq!(m.device(&DeviceId::Cuda(0)).unwrap().bf16_tflops, 712.4);
    assert_eq!(m.links.peer.len(), 1);
    assert_eq!(m.links.peer[0].gbps, 362.0);

    // plan and sim on this (GPU-less) box
    let (s, p) = plan(&d, None, &[], &["--machine", path.to_str().unwrap()]);
    assert!(
        s.contains("machine profile: ") && s.contains("(measured, 2026-05-01)"),
        "{s}"
    );
    assert_eq!(p.machine.name, "my-box");
    let o = mold_with(
        &d,
        None,
        &[],
        &[
            "sim",
            d.join("p.yaml").to_str().unwrap(),
            "--machines",
            machines.to_str().unwrap(),
        ],
    );
    assert!(o.status.success(), "{}{}", stdout(&o), stderr(&o));
    assert!(stdout(&o).contains("fits"), "{}", stdout(&o));
}

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
