//! The launch variables: each convention alone, their precedence, and every
//! inconsistency named.

use super::*;

fn launch(vars: &[(&str, &str)]) -> Result<Option<Launch>> {
    Launch::from_vars(|k| {
        vars.iter()
            .find(|(n, _)| *n == k)
            .map(|(_, v)| v.to_string())
    })
}

fn some(vars: &[(&str, &str)]) -> Launch {
    launch(vars).unwrap().expect("a multi-process launch")
}

fn err(vars: &[(&str, &str)]) -> String {
    let e = launch(vars).unwrap_err().to_string();
    assert_eq!(e.lines().count(), 1, "{e}");
    e
}

#[test]
fn mold_variables() {
    assert_eq!(launch(&[]).unwrap(), None);
    assert_eq!(launch(&[("MOLD_WORLD_SIZE", "1")]).unwrap(), None);
    assert_eq!(
        some(&[
            ("MOLD_RANK", "1"),
            ("MOLD_WORLD_SIZE", "2"),
            ("MOLD_MASTER_ADDR", "node0")
        ]),
        Launch {
            rank: 1,
            world: 2,
            master: format!("node0:{DEFAULT_PORT}"),
            local_rank: None,
            launcher: Launcher::Mold,
        }
    );
    let l = some(&[
        ("MOLD_RANK", "0"),
        ("MOLD_WORLD_SIZE", "2"),
        ("MOLD_MASTER_ADDR", "10.0.0.1:4000"),
    ]);
    assert_eq!(l.master, "10.0.0.1:4000");
    assert_eq!(l.world_var(), "MOLD_WORLD_SIZE");
    // Blank values are unset.
    assert_eq!(launch(&[("MOLD_RANK", " ")]).unwrap(), None);
}

#[test]
fn mold_mistakes_name_the_variable() {
    let w2 = |r: &'static str| {
        [
            ("MOLD_RANK", r),
            ("MOLD_WORLD_SIZE", "2"),
            ("MOLD_MASTER_ADDR", "h"),
        ]
    };
    assert!(err(&[("MOLD_RANK", "0"), ("MOLD_MASTER_ADDR", "h")])
        .contains("MOLD_WORLD_SIZE is not set"));
    assert!(err(&[("MOLD_WORLD_SIZE", "2"), ("MOLD_MASTER_ADDR", "h")])
        .contains("MOLD_RANK is not set"));
    assert!(err(&w2("2")).contains("MOLD_RANK=2 with MOLD_WORLD_SIZE=2"));
    assert!(err(&w2("-1")).contains("MOLD_RANK=\"-1\""));
    assert!(err(&[("MOLD_RANK", "0"), ("MOLD_WORLD_SIZE", "2")])
        .contains("MOLD_MASTER_ADDR is not set"));
    assert!(err(&[("MOLD_RANK", "0"), ("MOLD_WORLD_SIZE", "x")]).contains("MOLD_WORLD_SIZE=\"x\""));
    assert!(err(&[("MOLD_WORLD_SIZE", "0")]).contains("MOLD_WORLD_SIZE=0"));
    assert!(err(&[
        ("MOLD_RANK", "0"),
        ("MOLD_WORLD_SIZE", "2"),
        ("MOLD_MASTER_ADDR", "h:port")
    ])
    .contains("not a number"));
}

#[test]
fn torchrun_variables() {
    let l = some(&[
        ("RANK", "3"),
        ("WORLD_SIZE", "4"),
        ("LOCAL_RANK", "1"),
        ("MASTER_ADDR", "node0"),
        ("MASTER_PORT", "29500"),
    ]);
    assert_eq!(
        l,
        Launch {
            rank: 3,
            world: 4,
            master: "node0:29500".into(),
            local_rank: Some(1),
            launcher: Launcher::Torchrun,
        }
    );
    assert_eq!(l.world_var(), "WORLD_SIZE");
    // torchrun's own store holds MASTER_PORT: mold listens at the next port.
    let l = some(&[
        ("RANK", "0"),
        ("WORLD_SIZE", "2"),
        ("MASTER_ADDR", "node0"),
        ("MASTER_PORT", "29500"),
        ("TORCHELASTIC_USE_AGENT_STORE", "True"),
    ]);
    assert_eq!(l.master, "node0:29501");
    let l = some(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "::1")]);
    assert_eq!(l.master, format!("[::1]:{DEFAULT_PORT}"));
    // One process: nothing to launch.
    assert_eq!(
        launch(&[("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")]).unwrap(),
        None
    );
}

#[test]
fn torchrun_mistakes_name_the_variables() {
    assert!(
        err(&[("RANK", "3"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h")])
            .contains("RANK=3 with WORLD_SIZE=2")
    );
    assert!(err(&[("RANK", "0"), ("MASTER_ADDR", "h")]).contains("WORLD_SIZE is not set (RANK is)"));
    assert!(err(&[("WORLD_SIZE", "2"), ("MASTER_ADDR", "h")]).contains("RANK is not set"));
    assert!(err(&[("RANK", "0"), ("WORLD_SIZE", "2")]).contains("MASTER_ADDR is not set"));
    assert!(err(&[
        ("RANK", "0"),
        ("WORLD_SIZE", "2"),
        ("MASTER_ADDR", "h"),
        ("MASTER_PORT", "0")
    ])
    .contains("MASTER_PORT=\"0\""));
    assert!(err(&[
        ("RANK", "0"),
        ("WORLD_SIZE", "2"),
        ("MASTER_ADDR", "h"),
        ("MASTER_PORT", "65535"),
        ("TORCHELASTIC_USE_AGENT_STORE", "True"),
    ])
    .contains("MASTER_PORT=65535"));
    assert!(err(&[
        ("RANK", "1"),
        ("WORLD_SIZE", "4"),
        ("LOCAL_RANK", "2"),
        ("MASTER_ADDR", "h")
    ])
    .contains("LOCAL_RANK=2 with RANK=1"));
    assert!(err(&[
        ("RANK", "1"),
        ("WORLD_SIZE", "4"),
        ("LOCAL_RANK", "x"),
        ("MASTER_ADDR", "h")
    ])
    .contains("LOCAL_RANK=\"x\""));
}

#[test]
fn slurm_variables() {
    let l = some(&[
        ("SLURM_PROCID", "2"),
        ("SLURM_NTASKS", "3"),
        ("SLURM_LOCALID", "0"),
        ("SLURM_JOB_NODELIST", "gpu[07-09]"),
    ]);
    assert_eq!(
        l,
        Launch {
            rank: 2,
            world: 3,
            master: format!("gpu07:{DEFAULT_PORT}"),
            local_rank: Some(0),
            launcher: Launcher::Slurm,
        }
    );
    assert_eq!(l.world_var(), "SLURM_NTASKS");
    // The job's number moves the port, so that two jobs on one node do not collide.
    let l = some(&[
        ("SLURM_PROCID", "0"),
        ("SLURM_NTASKS", "2"),
        ("SLURM_JOB_NODELIST", "a1,b2"),
        ("SLURM_JOB_ID", "123456"),
    ]);
    assert_eq!(l.master, format!("a1:{}", DEFAULT_PORT + 456));
    assert_eq!(
        launch(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "1")]).unwrap(),
        None
    );
}

#[test]
fn slurm_mistakes_name_the_variables() {
    assert!(err(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "2")])
        .contains("SLURM_JOB_NODELIST is not set"));
    assert!(err(&[
        ("SLURM_PROCID", "0"),
        ("SLURM_NTASKS", "2"),
        ("SLURM_JOB_NODELIST", "n[1-")
    ])
    .contains("SLURM_JOB_NODELIST=\"n[1-\""));
    assert!(err(&[
        ("SLURM_PROCID", "5"),
        ("SLURM_NTASKS", "2"),
        ("SLURM_JOB_NODELIST", "n1")
    ])
    .contains("SLURM_PROCID=5 with SLURM_NTASKS=2"));
    assert!(err(&[("SLURM_PROCID", "0"), ("SLURM_JOB_NODELIST", "n1")])
        .contains("SLURM_NTASKS is not set (SLURM_PROCID is)"));
    assert!(err(&[
        ("SLURM_PROCID", "0"),
        ("SLURM_NTASKS", "2"),
        ("SLURM_JOB_NODELIST", "n1"),
        ("SLURM_JOB_ID", "abc")
    ])
    .contains("SLURM_JOB_ID=\"abc\""));
}

#[test]
fn precedence_mold_then_torchrun_then_slurm() {
    // torchrun under srun: torchrun's variables describe the process, Slurm's the task.
    let l = some(&[
        ("RANK", "5"),
        ("WORLD_SIZE", "8"),
        ("LOCAL_RANK", "1"),
        ("MASTER_ADDR", "node0"),
        ("MASTER_PORT", "29500"),
        ("SLURM_PROCID", "1"),
        ("SLURM_NTASKS", "2"),
        ("SLURM_LOCALID", "0"),
        ("SLURM_JOB_NODELIST", "node[0-1]"),
    ]);
    assert_eq!(
        (l.rank, l.world, l.local_rank, l.launcher),
        (5, 8, Some(1), Launcher::Torchrun)
    );
    assert_eq!(l.master, "node0:29500");
    // MOLD_* that agree with the launcher are fine; MOLD_MASTER_ADDR chooses the address.
    let l = some(&[
        ("MOLD_RANK", "1"),
        ("MOLD_WORLD_SIZE", "2"),
        ("MOLD_MASTER_ADDR", "10.1.0.1:7000"),
        ("SLURM_PROCID", "1"),
        ("SLURM_NTASKS", "2"),
        ("SLURM_JOB_NODELIST", "n[1-2]"),
    ]);
    assert_eq!((l.rank, l.world, l.launcher), (1, 2, Launcher::Slurm));
    assert_eq!(l.master, "10.1.0.1:7000");
    // A launcher may give what MOLD_* leaves out.
    let l = some(&[
        ("MOLD_MASTER_ADDR", "h:1"),
        ("RANK", "1"),
        ("WORLD_SIZE", "2"),
    ]);
    assert_eq!((l.rank, l.world, l.master.as_str()), (1, 2, "h:1"));
}

#[test]
fn disagreements_name_both_variables() {
    let e = err(&[
        ("MOLD_RANK", "0"),
        ("MOLD_WORLD_SIZE", "2"),
        ("RANK", "1"),
        ("WORLD_SIZE", "2"),
        ("MASTER_ADDR", "h"),
    ]);
    assert!(e.contains("MOLD_RANK=0 but RANK=1 (torchrun)"), "{e}");
    let e = err(&[
        ("MOLD_WORLD_SIZE", "2"),
        ("SLURM_PROCID", "0"),
        ("SLURM_NTASKS", "4"),
        ("SLURM_JOB_NODELIST", "n1"),
    ]);
    assert!(
        e.contains("MOLD_WORLD_SIZE=2 but SLURM_NTASKS=4 (Slurm)"),
        "{e}"
    );
    // A rank from MOLD_RANK must fit the launcher's world size too.
    let e = err(&[
        ("MOLD_RANK", "3"),
        ("WORLD_SIZE", "2"),
        ("RANK", "3"),
        ("MASTER_ADDR", "h"),
    ]);
    assert!(e.contains("MOLD_RANK=3 with WORLD_SIZE=2"), "{e}");
}

#[test]
fn every_variable_read_is_listed() {
    let read = std::cell::RefCell::new(Vec::new());
    let _ = Launch::from_vars(|k| {
        read.borrow_mut().push(k.to_string());
        Some(match k {
            "SLURM_JOB_NODELIST" => "n1".into(),
            "MOLD_MASTER_ADDR" => "h".into(),
            "MASTER_ADDR" => "h".into(),
            _ => "1".into(),
        })
    });
    let _ = Launch::from_vars(|k| {
        read.borrow_mut().push(k.to_string());
        match k {
            "SLURM_PROCID" => Some("0".into()),
            "SLURM_NTASKS" => Some("2".into()),
            "SLURM_JOB_NODELIST" => Some("n1".into()),
            _ => None,
        }
    });
    for k in read.into_inner() {
        assert!(
            LAUNCH_VARS.contains(&k.as_str()),
            "{k} is read but not in LAUNCH_VARS"
        );
    }
}

#[test]
fn master_addresses_are_host_and_port_or_refused() {
    let master = |m: &str| -> Result<Option<Launch>> {
        launch(&[
            ("MOLD_RANK", "0"),
            ("MOLD_WORLD_SIZE", "2"),
            ("MOLD_MASTER_ADDR", m),
        ])
    };
    for (given, want) in [
        ("h", format!("h:{DEFAULT_PORT}")),
        ("h:5", "h:5".to_string()),
        // A bare IPv6 address is a host (its last group is no port), put in brackets.
        ("::1", format!("[::1]:{DEFAULT_PORT}")),
        ("fe80::1", format!("[fe80::1]:{DEFAULT_PORT}")),
        ("[::1]", format!("[::1]:{DEFAULT_PORT}")),
        ("[::1]:7", "[::1]:7".to_string()),
    ] {
        assert_eq!(master(given).unwrap().unwrap().master, want, "{given}");
    }
    for (given, why) in [
        ("h:0", "the port `0` is not a number 1..65535"),
        ("h:", "the port `` is not a number"),
        (":5", "`` is not a host name"),
        ("a b:5", "`a b` is not a host name"),
        ("a\nb", "`a\\nb` is not a host name"),
        ("fe80::1::5", "an IPv6 address goes in brackets"),
        ("[nope]:5", "an IPv6 address goes in brackets"),
    ] {
        let e = master(given).unwrap_err().to_string();
        assert!(
            e.contains(why) && e.contains("MOLD_MASTER_ADDR="),
            "{given}: {e}"
        );
        assert_eq!(e.lines().count(), 1, "{e}");
    }
    // torchrun's and Slurm's hosts are checked alike.
    let e = err(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "no de")]);
    assert!(e.contains("MASTER_ADDR=\"no de\""), "{e}");
    let e = err(&[
        ("SLURM_PROCID", "0"),
        ("SLURM_NTASKS", "2"),
        ("SLURM_JOB_NODELIST", "a\tb,c"),
    ]);
    assert!(e.contains("SLURM_JOB_NODELIST=\"a\\tb,c\""), "{e}");
}
