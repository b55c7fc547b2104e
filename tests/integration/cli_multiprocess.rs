//! `mold exec` as several processes (`MOLD_WORLD_SIZE`/`MOLD_RANK`/`MOLD_MASTER_ADDR`) on
//! emulated devices: the same output as one process, bit for bit, and failures that end
//! every process naming the one at fault.

use crate::util::*;
use std::path::Path;
use std::process::{Output, Stdio};
use std::time::{Duration, Instant};

/// A port nobody listens on right now.
pub(crate) fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Runs `world` processes of `mold exec ARGS` (process p gets `extra(p)` appended and
/// `env`), each with its MOLD_RANK; returns their outputs in rank order.
fn run_world(
    world: usize,
    args: &[&str],
    extra: impl Fn(usize) -> Vec<String>,
    env: &[(&str, &str)],
) -> Vec<Output> {
    let master = format!("127.0.0.1:{}", free_port());
    let children: Vec<_> = (0..world)
        .map(|p| {
            let mut a: Vec<String> = args.iter().map(|s| s.to_string()).collect();
            a.extend(extra(p));
            let a: Vec<&str> = a.iter().map(String::as_str).collect();
            let mut e: Vec<(&str, String)> = vec![
                ("MOLD_WORLD_SIZE", world.to_string()),
                ("MOLD_RANK", p.to_string()),
                ("MOLD_MASTER_ADDR", master.clone()),
                ("MOLD_DIST_TIMEOUT_S", "60".to_string()),
            ];
            e.extend(env.iter().map(|(k, v)| (*k, v.to_string())));
            let e: Vec<(&str, &str)> = e.iter().map(|(k, v)| (*k, v.as_str())).collect();
            mold_command(&a, &e)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("run mold")
        })
        .collect();
    children
        .into_iter()
        .map(|c| c.wait_with_output().unwrap())
        .collect()
}

pub(crate) fn digest(s: &str) -> String {
    s.lines()
        .find_map(|l| l.strip_prefix("output digest: "))
        .unwrap_or_else(|| panic!("no output digest in:\n{s}"))
        .to_string()
}

/// flux-tiny weights in `d/w` and a plan whose transformer parts are `parts` (YAML lines
/// of the `parts:` list): (weights, plan).
pub(crate) fn setup(d: &Path, parts: &str) -> (String, String) {
    let w = d.join("w").to_str().unwrap().to_string();
    let p = d.join("plan.yaml").to_str().unwrap().to_string();
    mold_ok(&["testdata", "flux-tiny", &w]);
    mold_ok(&[
        "plan",
        "--model",
        "flux-tiny",
        "--machine",
        "sim/machines/cpu-emu-4.yaml",
        "--tp",
        "off",
        "-o",
        &p,
    ]);
    // Replace the transformer's parts with the placement under test.
    let text = std::fs::read_to_string(&p).unwrap();
    let t = text.find("- name: transformer").unwrap();
    let start = t + text[t..].find("  parts:\n").unwrap() + "  parts:\n".len();
    let end = start
        + text[start..]
            .find("\n- name:")
            .map(|i| i + 1)
            .unwrap_or(text.len() - start);
    let new = format!("{}{}{}", &text[..start], parts, &text[end..]);
    std::fs::write(&p, new).unwrap();
    (w, p)
}

/// cpu-emu-4 as two nodes of two emulated devices (emu:0-1 on node 0, emu:2-3 on node
/// 1): writes it to `d` and returns its path.
pub(crate) fn two_node_profile(d: &Path) -> String {
    let text = std::fs::read_to_string(root().join("sim/machines/cpu-emu-4.yaml")).unwrap();
    let text = text
        .replace("name: cpu-emu-4", "name: cpu-emu-2x2")
        .replace(
            "  - id: emu:2\n",
            "  - id: emu:2\n    node: 1\n",
        )
        .replace(
            "  - id: emu:3\n",
            "  - id: emu:3\n    node: 1\n",
        )
        .replace(
            "    - devices: [emu:0, emu:1, emu:2, emu:3]\n      kind: pcie                            # in-process copies\n      gbps: 10\n      allreduce: {latency_us: 10, gbps: 5}\n",
            "    - devices: [emu:0, emu:1]\n      kind: pcie\n      gbps: 10\n      allreduce: {latency_us: 10, gbps: 5}\n    - devices: [emu:2, emu:3]\n      kind: pcie\n      gbps: 10\n      allreduce: {latency_us: 10, gbps: 5}\n",
        );
    let text = format!("{text}  inter_node: {{kind: ethernet, gbps: 1, latency_us: 50}}\n");
    assert_eq!(text.matches("node: 1").count(), 2, "{text}");
    assert!(text.contains("[emu:2, emu:3]"), "{text}");
    let p = d.join("cpu-emu-2x2.yaml");
    std::fs::write(&p, text).unwrap();
    p.to_str().unwrap().to_string()
}

/// Part 0 tensor parallel over node 0 (emu:0, emu:1), part 1 over node 1 (emu:2, emu:3).
pub(crate) const TP2_PER_NODE: &str = "  - blocks:\n    - double 0..2\n    - single 0..1\n    devices:\n    - emu:0\n    - emu:1\n    tp: 2\n    residency: resident\n  - blocks:\n    - single 1..3\n    devices:\n    - emu:2\n    - emu:3\n    tp: 2\n    residency: resident\n";

const TP4: &str = "  - blocks:\n    - double 0..2\n    - single 0..3\n    devices:\n    - emu:0\n    - emu:1\n    - emu:2\n    - emu:3\n    tp: 4\n    residency: resident\n";

/// Part 0 tensor parallel over emu:0, emu:1; part 1 on emu:2.
const TP2_THEN_ONE: &str = "  - blocks:\n    - double 0..2\n    - single 0..1\n    devices:\n    - emu:0\n    - emu:1\n    tp: 2\n    residency: resident\n  - blocks:\n    - single 1..3\n    devices:\n    - emu:2\n    residency: resident\n";

#[test]
fn several_processes_compute_what_one_does_bit_for_bit() {
    for (name, parts, world) in [("tp4", TP4, 2), ("tp2-then-one", TP2_THEN_ONE, 3)] {
        let d = tempdir(&format!("mp-{name}"));
        let (w, p) = setup(&d, parts);
        let args = ["exec", &p, "--weights", &w, "--steps", "2", "--force"];
        let one = mold_ok(&args).0;
        let outs = run_world(world, &args, |_| vec![], &[]);
        for (r, o) in outs.iter().enumerate() {
            assert!(
                o.status.success(),
                "{name}: process {r} failed:\n{}\n{}",
                stdout(o),
                stderr(o)
            );
            let s = stdout(o);
            assert!(s.contains(&format!("process {r} of {world}: runs")), "{s}");
            assert_eq!(digest(&s), digest(&one), "{name}: process {r}:\n{s}");
        }
        // Each process loads only its own devices' weights.
        let s0 = stdout(&outs[0]);
        assert!(s0.contains("emu:0 ") && !s0.contains("emu:2 "), "{s0}");
    }
    // --verify runs once, in the process that runs the first device.
    let d = tempdir("mp-verify");
    let (w, p) = setup(&d, TP4);
    let args = [
        "exec",
        &p,
        "--weights",
        &w,
        "--steps",
        "1",
        "--force",
        "--verify",
    ];
    let outs = run_world(2, &args, |_| vec![], &[]);
    assert!(
        stdout(&outs[0]).contains("max relative error"),
        "{}",
        stdout(&outs[0])
    );
    assert!(stdout(&outs[1]).contains("verify: done by the process that runs emu:0"));
}

#[test]
fn a_failing_or_dying_process_ends_every_process_naming_it() {
    let d = tempdir("mp-fault");
    let (w, p) = setup(&d, TP4);
    let args = ["exec", &p, "--weights", &w, "--steps", "2", "--force"];
    for (kind, want0) in [
        ("error", "process 1 failed: device emu:3"),
        ("panic", "process 1"),
        // Process 0 meets the exit reading (`closed its connection`) or writing
        // (`cannot be reached`), whichever comes first: both name it and say it exited.
        ("exit", "exited or crashed"),
    ] {
        let fault = format!("emu:3@single 1:{kind}");
        let t0 = Instant::now();
        let outs = run_world(2, &args, |_| vec![], &[("MOLD_FAULT", fault.as_str())]);
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "{kind}: {:?}",
            t0.elapsed()
        );
        for (r, o) in outs.iter().enumerate() {
            assert!(
                !o.status.success(),
                "{kind}: process {r} should fail:\n{}",
                stdout(o)
            );
        }
        let e0 = stderr(&outs[0]);
        assert!(e0.contains(want0), "{kind}: process 0 says:\n{e0}");
        assert!(e0.contains("process 1"), "{kind}: process 0 says:\n{e0}");
        if kind == "exit" {
            assert_eq!(outs[1].status.code(), Some(3), "{}", stderr(&outs[1]));
        } else {
            let e1 = stderr(&outs[1]);
            assert!(
                e1.contains("emu:3") && e1.contains("injected"),
                "{kind}: {e1}"
            );
        }
    }
}

#[test]
fn launch_mistakes_are_refused_before_loading() {
    let d = tempdir("mp-refuse");
    let (w, p) = setup(&d, TP4);
    let args = ["exec", &p, "--weights", &w, "--steps", "1", "--force"];
    // Processes that disagree on what to run.
    let outs = run_world(2, &args, |r| vec!["--seed".into(), r.to_string()], &[]);
    let e0 = stderr(&outs[0]);
    assert!(!outs[0].status.success() && !outs[1].status.success());
    assert!(
        e0.contains("seed is 1 in process 1 but 0 in process 0"),
        "{e0}"
    );
    assert!(stderr(&outs[1]).contains("refused"), "{}", stderr(&outs[1]));
    // A process that never comes.
    let o = mold_env(
        &args,
        &[
            ("MOLD_WORLD_SIZE", "2"),
            ("MOLD_RANK", "0"),
            ("MOLD_MASTER_ADDR", &format!("127.0.0.1:{}", free_port())),
            ("MOLD_DIST_TIMEOUT_S", "1"),
        ],
    );
    assert!(!o.status.success());
    assert!(stderr(&o).contains("for process(es) 1"), "{}", stderr(&o));
    assert!(!stdout(&o).contains("loaded"), "{}", stdout(&o));
    // A master other hosts can reach needs MOLD_DIST_SECRET.
    let o = mold_env(
        &args,
        &[
            ("MOLD_WORLD_SIZE", "2"),
            ("MOLD_RANK", "1"),
            ("MOLD_MASTER_ADDR", "192.0.2.1:29517"),
        ],
    );
    let e = stderr(&o);
    assert!(!o.status.success());
    assert!(
        e.contains("not a loopback address, and MOLD_DIST_SECRET is not set"),
        "{e}"
    );
    assert_eq!(e.lines().count(), 1, "{e}");
    assert!(!stdout(&o).contains("loaded"), "{}", stdout(&o));
    // Timeouts a `Duration` cannot hold, or that are no time at all: one line naming the
    // variable, no panic.
    for var in ["MOLD_NCCL_TIMEOUT_S", "MOLD_DIST_TIMEOUT_S"] {
        for v in ["1e20", "inf", "nan", "-1"] {
            let o = mold_env(&args, &[(var, v)]);
            let e = stderr(&o);
            assert_eq!(o.status.code(), Some(1), "{var}={v}: {e}");
            assert!(e.contains(&format!("{var}=\"{v}\": give seconds")), "{e}");
            assert_eq!(e.lines().count(), 1, "{e}");
        }
    }
    // Incomplete variables name the missing one.
    let o = mold_env(&args, &[("MOLD_RANK", "1")]);
    assert!(
        stderr(&o).contains("MOLD_WORLD_SIZE is not set"),
        "{}",
        stderr(&o)
    );
    let o = mold_env(
        &args,
        &[
            ("MOLD_RANK", "0"),
            ("MOLD_WORLD_SIZE", "8"),
            ("MOLD_MASTER_ADDR", "h"),
        ],
    );
    assert!(
        stderr(&o).contains("start at most one process per device"),
        "{}",
        stderr(&o)
    );
    // Text to image stays one process.
    let o = mold_env(
        &["exec", &p, "--weights", &w, "--prompt", "x"],
        &[
            ("MOLD_RANK", "0"),
            ("MOLD_WORLD_SIZE", "2"),
            ("MOLD_MASTER_ADDR", "h"),
        ],
    );
    assert!(
        stderr(&o).contains("text to image (--prompt) runs in one process"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn a_two_node_plan_runs_one_process_per_node_as_one_process_does() {
    let d = tempdir("mp-nodes");
    let (w, p) = setup(&d, TP2_PER_NODE);
    let m = two_node_profile(&d);
    let args = [
        "exec",
        &p,
        "--weights",
        &w,
        "--machine",
        &m,
        "--steps",
        "2",
        "--force",
    ];
    let one = mold_ok(&args).0;
    // With the shared secret: every connection proves it, both ways.
    let outs = run_world(2, &args, |_| vec![], &[("MOLD_DIST_SECRET", "t0p-s3cret")]);
    for (r, o) in outs.iter().enumerate() {
        assert!(
            o.status.success(),
            "process {r}:\n{}\n{}",
            stdout(o),
            stderr(o)
        );
        assert_eq!(digest(&stdout(o)), digest(&one), "process {r}");
    }
    // Node 1's devices are its process's first ones.
    let s1 = stdout(&outs[1]);
    assert!(
        s1.contains(
            "process 1 of 2: runs emu:2 as emu:0, emu:3 as emu:1 (node 1, process 0 of 1 there"
        ),
        "{s1}"
    );
    // The hand-off's path is printed at both ends (emulated devices: TCP).
    for o in &outs {
        assert!(
            stdout(o).contains("hand-off after part 0: process 0 -> process 1 over TCP"),
            "{}",
            stdout(o)
        );
    }
    // A process that would own devices of both nodes is refused before loading.
    let o = mold_env(
        &args,
        &[
            ("MOLD_WORLD_SIZE", "3"),
            ("MOLD_RANK", "0"),
            ("MOLD_MASTER_ADDR", "h"),
        ],
    );
    let e = stderr(&o);
    assert!(!o.status.success());
    assert!(
        e.contains("MOLD_WORLD_SIZE=3, but the plan's transformer runs on 2 nodes (node 0: emu:0, emu:1; node 1: emu:2, emu:3)"),
        "{e}"
    );
    assert_eq!(e.lines().count(), 1, "{e}");
    assert!(!stdout(&o).contains("loaded"), "{}", stdout(&o));
}
