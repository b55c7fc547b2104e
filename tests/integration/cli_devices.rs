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
pub(crate) fn mold_with(
    dir: &Path,
    config: Option<&str>,
    env: &[(&str, &str)],
    args: &[&str],
) -> Output {
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

pub(crate) fn machine(name: &str) -> String {
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
        host_read_gbps: Some(23.46),
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
    // The host's read rate prices loading.
    assert_eq!(m.host.read_gbps, Some(23.5));
    assert!(
        m.calibration.notes.contains("host read rate"),
        "{}",
        m.calibration.notes
    );

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
    // Loading is priced at the measured read rate.
    assert!(
        stdout(&o).contains("before a one-shot request (")
            && stdout(&o).contains("host read 23.5 GB/s, measured"),
        "{}",
        stdout(&o)
    );
}
