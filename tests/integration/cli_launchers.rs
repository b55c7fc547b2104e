//! `mold exec` as several processes started the way torchrun and Slurm start them (their
//! variables, no `MOLD_*`), on emulated devices: the same output as one process; and a
//! launch whose variables disagree is refused before anything loads.

use crate::cli_multiprocess::{digest, free_port, setup, two_node_profile, TP2_PER_NODE};
use crate::util::*;
use std::net::TcpListener;
use std::process::{Output, Stdio};

/// Three parts, one device each: a block split that three or two processes can share.
const SPLIT3: &str = "  - blocks:\n    - double 0..2\n    devices:\n    - emu:0\n    residency: resident\n  - blocks:\n    - single 0..1\n    devices:\n    - emu:1\n    residency: resident\n  - blocks:\n    - single 1..3\n    devices:\n    - emu:2\n    residency: resident\n";

/// Runs `world` processes of `mold exec ARGS`, process p with the variables `env(p)`;
/// their outputs in rank order.
fn run_with(
    world: usize,
    args: &[&str],
    env: impl Fn(usize) -> Vec<(&'static str, String)>,
) -> Vec<Output> {
    let children: Vec<_> = (0..world)
        .map(|p| {
            let mut e = env(p);
            e.push(("MOLD_DIST_TIMEOUT_S", "60".into()));
            let e: Vec<(&str, &str)> = e.iter().map(|(k, v)| (*k, v.as_str())).collect();
            mold_command(args, &e)
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

/// Every process succeeded, says which it is and where its place came from, and
/// computed the one-process output.
fn check(outs: &[Output], launcher: &str, want: &str) {
    let world = outs.len();
    for (r, o) in outs.iter().enumerate() {
        let s = stdout(o);
        assert!(
            o.status.success(),
            "{launcher}: process {r} failed:\n{s}\n{}",
            stderr(o)
        );
        assert!(s.contains(&format!("process {r} of {world}: runs")), "{s}");
        assert!(s.contains(&format!("from {launcher}'s variables")), "{s}");
        assert_eq!(digest(&s), want, "{launcher}: process {r}:\n{s}");
    }
}

/// A port whose next port is free too: (a listener holding it, the port).
fn port_and_next() -> (TcpListener, u16) {
    loop {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let p = l.local_addr().unwrap().port();
        if p < u16::MAX && TcpListener::bind(("127.0.0.1", p + 1)).is_ok() {
            return (l, p);
        }
    }
}

/// A Slurm job number whose port (29517 + job mod 1000) is free now.
fn free_slurm_job() -> u32 {
    let start = std::process::id() % 1000;
    (0..1000)
        .map(|i| (start + i) % 1000)
        .find(|j| TcpListener::bind(("127.0.0.1", 29517 + *j as u16)).is_ok())
        .expect("a free port in 29517..30517")
        + 7000
}

#[test]
fn torchrun_and_slurm_variables_run_what_one_process_does() {
    let d = tempdir("launchers");
    let (w, p) = setup(&d, SPLIT3);
    let args = ["exec", &p, "--weights", &w, "--steps", "2", "--force"];
    let one = digest(&mold_ok(&args).0);

    // torchrun: its agent's store listens at MASTER_PORT (held here), mold at the next.
    let (store, port) = port_and_next();
    let outs = run_with(3, &args, |r| {
        vec![
            ("RANK", r.to_string()),
            ("WORLD_SIZE", "3".into()),
            ("LOCAL_RANK", r.to_string()),
            ("MASTER_ADDR", "127.0.0.1".into()),
            ("MASTER_PORT", port.to_string()),
            ("TORCHELASTIC_USE_AGENT_STORE", "True".into()),
        ]
    });
    drop(store);
    check(&outs, "torchrun", &one);
    assert!(
        stdout(&outs[0]).contains(&format!("master 127.0.0.1:{}", port + 1)),
        "{}",
        stdout(&outs[0])
    );

    // Slurm: the first host of the bracketed node list; the job number picks the port.
    let job = free_slurm_job();
    let outs = run_with(2, &args, |r| {
        vec![
            ("SLURM_PROCID", r.to_string()),
            ("SLURM_NTASKS", "2".into()),
            // Both on the plan's one node.
            ("SLURM_LOCALID", r.to_string()),
            ("SLURM_JOB_NODELIST", "127.0.0.[1-2],other[01-04]".into()),
            ("SLURM_JOB_ID", job.to_string()),
        ]
    });
    check(&outs, "Slurm", &one);
    assert!(
        stdout(&outs[1]).contains(&format!("master 127.0.0.1:{}", 29517 + job % 1000)),
        "{}",
        stdout(&outs[1])
    );
}

#[test]
fn launch_variables_that_disagree_are_refused_before_loading() {
    let d = tempdir("launchers-refuse");
    let (w, p) = setup(&d, SPLIT3);
    let args = ["exec", &p, "--weights", &w, "--steps", "1", "--force"];
    let master = format!("127.0.0.1:{}", free_port());
    for (env, want) in [
        (
            vec![
                ("MOLD_RANK", "0"),
                ("RANK", "1"),
                ("WORLD_SIZE", "2"),
                ("MASTER_ADDR", "127.0.0.1"),
            ],
            "MOLD_RANK=0 but RANK=1 (torchrun)",
        ),
        (
            vec![
                ("RANK", "3"),
                ("WORLD_SIZE", "2"),
                ("MASTER_ADDR", "127.0.0.1"),
            ],
            "RANK=3 with WORLD_SIZE=2",
        ),
        (
            vec![
                ("MOLD_WORLD_SIZE", "3"),
                ("MOLD_MASTER_ADDR", master.as_str()),
                ("SLURM_PROCID", "0"),
                ("SLURM_NTASKS", "2"),
                ("SLURM_JOB_NODELIST", "n1"),
            ],
            "MOLD_WORLD_SIZE=3 but SLURM_NTASKS=2 (Slurm)",
        ),
        (
            vec![
                ("SLURM_PROCID", "0"),
                ("SLURM_NTASKS", "2"),
                ("SLURM_JOB_NODELIST", "node[01-"),
            ],
            "SLURM_JOB_NODELIST=\"node[01-\"",
        ),
        // A launch that reaches other hosts needs the shared secret (before anything
        // connects, anything loads).
        (
            vec![
                ("RANK", "1"),
                ("WORLD_SIZE", "3"),
                ("LOCAL_RANK", "1"),
                ("MASTER_ADDR", "10.1.2.3"),
            ],
            "the master address \"10.1.2.3:29517\" is not a loopback address, and MOLD_DIST_SECRET is not set",
        ),
    ] {
        let o = mold_env(&args, &env);
        let e = stderr(&o);
        assert!(!o.status.success(), "{env:?}: {}", stdout(&o));
        assert!(e.contains(want), "{env:?}: {e}");
        assert_eq!(e.lines().count(), 1, "{e}");
        assert!(!stdout(&o).contains("loaded"), "{}", stdout(&o));
    }
}

#[test]
fn launchers_place_processes_on_a_two_node_plans_nodes() {
    let d = tempdir("launchers-nodes");
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
    let one = digest(&mold_ok(&args).0);

    // torchrun --nnodes 2 --nproc-per-node 2: local rank 1 of node 1 runs node 1's second
    // device, opened as the node's second (LOCAL_RANK offset), and the tensor-parallel
    // groups span processes.
    let (store, port) = port_and_next();
    let outs = run_with(4, &args, |r| {
        vec![
            ("RANK", r.to_string()),
            ("WORLD_SIZE", "4".into()),
            ("LOCAL_RANK", (r % 2).to_string()),
            ("MASTER_ADDR", "127.0.0.1".into()),
            ("MASTER_PORT", port.to_string()),
            ("TORCHELASTIC_USE_AGENT_STORE", "True".into()),
        ]
    });
    drop(store);
    check(&outs, "torchrun", &one);
    let s3 = stdout(&outs[3]);
    assert!(
        s3.contains("process 3 of 4: runs emu:3 as emu:1 (node 1, process 1 of 2 there"),
        "{s3}"
    );

    // srun -N 2 --ntasks-per-node 1: one task per node, each SLURM_LOCALID 0.
    let job = free_slurm_job();
    let outs = run_with(2, &args, |r| {
        vec![
            ("SLURM_PROCID", r.to_string()),
            ("SLURM_NTASKS", "2".into()),
            ("SLURM_LOCALID", "0".into()),
            ("SLURM_JOB_NODELIST", "127.0.0.1,other".into()),
            ("SLURM_JOB_ID", job.to_string()),
        ]
    });
    check(&outs, "Slurm", &one);

    // A local rank the node-by-node numbering contradicts (cyclic task distribution).
    let o = mold_env(
        &args,
        &[
            ("SLURM_PROCID", "1"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_JOB_NODELIST", "n[1-2]"),
        ],
    );
    let e = stderr(&o);
    assert!(!o.status.success());
    assert!(
        e.contains("SLURM_LOCALID=0, but process 1 of 4 is process 1 of its node"),
        "{e}"
    );
    assert_eq!(e.lines().count(), 1, "{e}");
}
