//! The parsers of the environment, fuzzed like those of files (`parsers.rs`): the launch
//! variables (mold's, torchrun's, Slurm's: `Launch::from_vars`, Slurm node lists,
//! `CUDA_VISIBLE_DEVICES`), the communication settings (`MOLD_*_TIMEOUT_S`,
//! `MOLD_DIST_SECRET`) and byte sizes (`20GiB`, as `MOLD_HOST_MEMORY` and the YAML files
//! write them).
//!
//! Values are arbitrary text up to 4 KiB, mutations of valid values, and splices of
//! tokens parsers find hard. Nothing panics; every refusal is one line naming a variable
//! that was set; what is accepted is within range. Each proptest is bounded (256 cases).

use mold_exec::comm::{CommOptions, MAX_TIMEOUT_S};
use mold_exec::dist::{expand_nodelist, Launch, Visible, LAUNCH_VARS};
use mold_plan::ByteSize;
use proptest::prelude::*;
use std::collections::BTreeMap;
use std::time::Duration;

/// Values parsers find hard.
const TOKENS: &[&str] = &[
    "",
    " ",
    "0",
    "1",
    "2",
    "-1",
    "+1",
    "3",
    "65535",
    "65536",
    "18446744073709551615",
    "18446744073709551616",
    "1e20",
    "1e308",
    "1e-400",
    "nan",
    "NaN",
    "inf",
    "-inf",
    "0x10",
    "1.5",
    ".",
    "1..2",
    "\n",
    "\t",
    "\0",
    "\u{202e}",
    "é",
    ":",
    "::",
    "[",
    "]",
    "[::1]",
    "::1",
    "fe80::1",
    "[::1]:5",
    "127.0.0.1",
    "127.0.0.1:0",
    "localhost",
    "h:",
    ":5",
    "h:port",
    "node[01-04]",
    "n[0-18446744073709551615]",
    "n[[1]]",
    "n[4-1]",
    "a,,b",
    "n[1\n]",
    "true",
    "True",
    "yes",
    "GiB",
    "20GiB",
    "1.5 TB",
    "kib",
    "0.5b",
    ",",
];

/// A value: arbitrary text up to 4 KiB, a token, a number, or tokens spliced into text.
fn value() -> impl Strategy<Value = String> {
    prop_oneof![
        ".{0,4096}",
        prop::sample::select(TOKENS).prop_map(str::to_string),
        any::<u64>().prop_map(|n| n.to_string()),
        (0u32..5).prop_map(|n| n.to_string()),
        prop::collection::vec(
            prop_oneof![
                prop::sample::select(TOKENS).prop_map(str::to_string),
                "[a-z0-9\\[\\],:.\\-]{0,12}",
            ],
            1..12
        )
        .prop_map(|v| v.concat()),
    ]
}

/// Some of `names`, each with a value.
fn vars(names: &'static [&'static str]) -> impl Strategy<Value = BTreeMap<String, String>> {
    prop::collection::btree_map(
        prop::sample::select(names).prop_map(str::to_string),
        value(),
        0..names.len(),
    )
}

/// The variables the launch reads, and the communication settings.
const ENV_VARS: &[&str] = &[
    "MOLD_RANK",
    "MOLD_WORLD_SIZE",
    "MOLD_MASTER_ADDR",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_USE_AGENT_STORE",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    "SLURM_JOB_NODELIST",
    "SLURM_JOB_ID",
    "MOLD_NCCL_TIMEOUT_S",
    "MOLD_DIST_TIMEOUT_S",
    "MOLD_DIST_SECRET",
    "MOLD_OVERLAP_CHUNKS",
    "MOLD_TP_TOKEN_SPLIT",
    "MOLD_COMM_WARM",
    "CUDA_VISIBLE_DEVICES",
];

/// A refusal is one line naming a variable: one that was set, or the one missing.
fn refusal_ok(e: &str, env: &BTreeMap<String, String>) -> Result<(), TestCaseError> {
    prop_assert!(
        !e.contains('\n') && !e.contains('\r'),
        "not one line: {e:?}"
    );
    prop_assert!(
        ENV_VARS.iter().any(|k| e.contains(k)),
        "names no variable (set: {:?}): {e:?}",
        env.keys().collect::<Vec<_>>()
    );
    Ok(())
}

/// A master address as accepted: `host:port`, a port 1..65535, a host without blanks or
/// control characters (an IPv6 one in brackets).
fn master_ok(m: &str) -> Result<(), TestCaseError> {
    let (host, port) = m.rsplit_once(':').unwrap_or(("", ""));
    prop_assert!(
        matches!(port.parse::<u16>(), Ok(1..)),
        "master {m:?}: port {port:?}"
    );
    prop_assert!(!host.is_empty(), "master {m:?}: no host");
    prop_assert!(
        !host.chars().any(|c| c.is_whitespace() || c.is_control()),
        "master {m:?}"
    );
    prop_assert!(
        !host.contains(':') || (host.starts_with('[') && host.ends_with(']')),
        "master {m:?}: an IPv6 host out of brackets"
    );
    Ok(())
}

/// `Launch::from_vars` on `env`: no panic, a launch in range, or a refusal naming a
/// variable.
fn launch_ok(env: &BTreeMap<String, String>) -> Result<(), TestCaseError> {
    let get = |k: &str| env.get(k).cloned();
    match Launch::from_vars(get) {
        Ok(None) => {}
        Ok(Some(l)) => {
            prop_assert!(l.world >= 2 && l.rank < l.world, "{l:?}");
            if let Some(lr) = l.local_rank {
                prop_assert!(lr <= l.rank, "{l:?}");
            }
            master_ok(&l.master)?;
        }
        Err(e) => refusal_ok(&e.to_string(), env)?,
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn launch_variables_never_panic(env in vars(ENV_VARS)) {
        launch_ok(&env)?;
        let get = |k: &str| env.get(k).cloned();
        match CommOptions::from_vars(get) {
            Ok(o) => {
                let week = Duration::from_secs_f64(MAX_TIMEOUT_S);
                prop_assert!(o.dist_timeout > Duration::ZERO && o.dist_timeout <= week);
                prop_assert!(o.nccl_timeout.is_none_or(|t| t > Duration::ZERO && t <= week));
                // The secret never shows: the options print it redacted, whatever it is
                // (a secret such as "true" may well appear elsewhere in them).
                if let Some(s) = env.get("MOLD_DIST_SECRET").filter(|s| s.len() > 3) {
                    let shown = format!("{o:?}");
                    prop_assert!(shown.contains("secret: Some(<redacted>)"), "{}", shown);
                    let secret = format!("{:?}", o.secret);
                    prop_assert!(!secret.contains(s.as_str()), "{}", secret);
                }
            }
            Err(e) => refusal_ok(&e.to_string(), &env)?,
        }
        if let Some(v) = Visible::from_vars(get) {
            prop_assert!(v.count <= env["CUDA_VISIBLE_DEVICES"].split(',').count());
        }
    }

    /// Valid launches of each convention with one variable replaced by a hard value.
    #[test]
    fn a_valid_launch_with_one_bad_value_is_refused_or_in_range(
        which in 0usize..3,
        var in 0usize..6,
        v in value(),
    ) {
        let valid: &[(&str, &str)] = match which {
            0 => &[("MOLD_RANK", "1"), ("MOLD_WORLD_SIZE", "4"), ("MOLD_MASTER_ADDR", "node0:7000")],
            1 => &[("RANK", "1"), ("WORLD_SIZE", "4"), ("LOCAL_RANK", "1"), ("MASTER_ADDR", "node0"),
                   ("MASTER_PORT", "29500"), ("TORCHELASTIC_USE_AGENT_STORE", "True")],
            _ => &[("SLURM_PROCID", "1"), ("SLURM_NTASKS", "4"), ("SLURM_LOCALID", "1"),
                   ("SLURM_JOB_NODELIST", "gpu[01-02]"), ("SLURM_JOB_ID", "4242")],
        };
        let mut env: BTreeMap<String, String> =
            valid.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let k = valid[var % valid.len()].0;
        env.insert(k.to_string(), v);
        launch_ok(&env)?;
    }

    /// Slurm node lists: arbitrary bracket-heavy text up to 4 KiB.
    #[test]
    fn node_lists_never_panic(
        list in prop_oneof!["[a-z0-9,\\[\\]\\-]{0,4096}", ".{0,4096}", value()],
        limit in 1usize..64,
    ) {
        match expand_nodelist(&list, limit) {
            Ok(hosts) => prop_assert!(hosts.len() <= limit),
            Err(why) => prop_assert!(!why.contains('\n') && !why.is_empty(), "{why:?}"),
        }
    }

    /// Byte sizes: arbitrary text up to 4 KiB, and numbers with every unit.
    #[test]
    fn byte_sizes_never_panic(
        s in prop_oneof![
            ".{0,4096}",
            value(),
            ("[0-9]{0,30}", prop::option::of("\\.[0-9]{0,30}"), "[ \t]{0,2}",
             prop::sample::select(&["", "b", "B", "k", "kB", "KiB", "m", "MB", "MiB", "g", "GB",
                                    "gib", "GiB", "t", "TB", "TiB", "PiB", "iB"][..]))
                .prop_map(|(n, f, sp, u)| format!("{n}{}{sp}{u}", f.unwrap_or_default())),
        ],
    ) {
        match s.parse::<ByteSize>() {
            Ok(b) => {
                // What it prints reads back as the same size.
                let again: ByteSize = b.to_string().parse().map_err(|e| {
                    TestCaseError::fail(format!("{b:?} prints as {b} which does not parse: {e}"))
                })?;
                prop_assert_eq!(again, b);
            }
            Err(e) => {
                let e = e.to_string();
                prop_assert!(!e.contains('\n') && !e.contains('\r'), "not one line: {e:?}");
                prop_assert!(e.contains("is not a size"), "{e}");
            }
        }
    }
}

#[test]
fn whole_numbers_of_every_unit_parse_exactly() {
    for (unit, mult) in [
        ("", 1u64),
        ("B", 1),
        ("kB", 1_000),
        ("KiB", 1 << 10),
        ("MB", 1_000_000),
        ("MiB", 1 << 20),
        ("GB", 1_000_000_000),
        ("GiB", 1 << 30),
        ("TB", 1_000_000_000_000),
        ("TiB", 1 << 40),
    ] {
        for n in [0u64, 1, 20, 1023, u64::MAX / mult] {
            let s = format!("{n}{unit}");
            assert_eq!(s.parse::<ByteSize>().unwrap().0, n * mult, "{s}");
        }
        if mult > 1 {
            let over = format!("{}{unit}", u64::MAX / mult + 1);
            assert!(over.parse::<ByteSize>().is_err(), "{over}");
        }
    }
}

#[test]
fn every_launch_variable_is_fuzzed() {
    for v in LAUNCH_VARS {
        assert!(ENV_VARS.contains(v), "{v} is read but not fuzzed");
    }
}
