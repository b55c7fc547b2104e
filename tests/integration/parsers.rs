//! The plan, machine and constraints parsers never panic, and a mutated field is named.

use crate::util::*;
use proptest::prelude::*;

fn valid_plan() -> String {
    read(&root().join("plans/flux-dev@2x-l40s.yaml"))
}
fn valid_machine() -> String {
    read(&root().join("sim/machines/2x-l40s.yaml"))
}
const CONSTRAINTS: &str = "devices: [cuda:0, cuda:1]\nmax_vram: {cuda:0: 20GiB}\npin: {t5: cuda:1}\ntp: 2\nstream: true\nobjective: latency\n";

const BAD_VALUES: &[&str] = &[
    "-1",
    "abc",
    "[]",
    "{}",
    "1e999",
    "cuda:99x",
    "double 5..",
    "~",
    "''",
    "[1, [2]]",
    "18446744073709551616",
    "!!binary aGk=",
];

/// Whether an error points at the mutated field: by name, or by line for YAML syntax
/// errors (which have no field yet).
fn names(e: &str, key: &str) -> bool {
    e.contains(key) || (e.contains("not valid YAML") && e.contains("line "))
}

/// Replaces the value of the `line`-th `key: value` line; returns the key.
fn mutate(text: &str, line: usize, value: &str) -> Option<(String, String)> {
    let lines: Vec<&str> = text.lines().collect();
    let kv: Vec<usize> = (0..lines.len())
        .filter(|&i| {
            let l = lines[i].trim_start().trim_start_matches("- ");
            !l.starts_with('#')
                && l.split_once(": ")
                    .is_some_and(|(_, v)| !v.trim().is_empty())
        })
        .collect();
    if kv.is_empty() {
        return None;
    }
    let i = kv[line % kv.len()];
    let (head, _) = lines[i].split_once(": ").unwrap();
    let key = head.trim_start().trim_start_matches("- ").to_string();
    let mut out: Vec<String> = lines.iter().map(|s| s.to_string()).collect();
    out[i] = format!("{head}: {value}");
    Some((out.join("\n"), key))
}

fn parse_all(text: &str) -> [Option<String>; 3] {
    [
        mold_plan::Plan::from_yaml(text, "fuzz.yaml")
            .err()
            .map(|e| e.to_string()),
        mold_machine::Machine::from_yaml(text, "fuzz.yaml")
            .err()
            .map(|e| e.to_string()),
        mold_planner::ConstraintsFile::from_yaml(text, "fuzz.yaml")
            .err()
            .map(|e| e.to_string()),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, .. ProptestConfig::default() })]

    #[test]
    fn arbitrary_yaml_never_panics(s in "[a-z_:{}\\[\\], \n0-9.\\-#!&*'\"]{0,300}") {
        for e in parse_all(&s).into_iter().flatten() {
            prop_assert!(e.contains("fuzz.yaml") && e.len() > 12, "{e}");
        }
    }

    #[test]
    fn mutated_plan_names_the_field(line in 0usize..200, v in prop::sample::select(BAD_VALUES)) {
        let (text, key) = mutate(&valid_plan(), line, v).unwrap();
        if let Err(e) = mold_plan::Plan::from_yaml(&text, "fuzz.yaml") {
            let e = e.to_string();
            prop_assert!(names(&e, &key) || e.contains("version"), "mutating `{key}` to `{v}`: {e}");
        }
    }

    #[test]
    fn mutated_machine_names_the_field(line in 0usize..200, v in prop::sample::select(BAD_VALUES)) {
        let (text, key) = mutate(&valid_machine(), line, v).unwrap();
        if let Err(e) = mold_machine::Machine::from_yaml(&text, "fuzz.yaml") {
            let e = e.to_string();
            prop_assert!(names(&e, &key), "mutating `{key}` to `{v}`: {e}");
        }
    }

    #[test]
    fn mutated_constraints_name_the_field(line in 0usize..20, v in prop::sample::select(BAD_VALUES)) {
        let (text, key) = mutate(CONSTRAINTS, line, v).unwrap();
        if let Err(e) = mold_planner::ConstraintsFile::from_yaml(&text, "fuzz.yaml") {
            let e = e.to_string();
            prop_assert!(names(&e, &key), "mutating `{key}` to `{v}`: {e}");
        }
    }
}
