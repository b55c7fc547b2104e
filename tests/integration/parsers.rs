//! Every parser of a file a user hands mold, fuzzed: the plan, machine and constraints
//! YAML, `config.toml`, a safetensors header, a tokenizer and the encoder configs.
//!
//! - Arbitrary bytes, and mutations of the shipped valid files (`plans/`, `sim/machines/`,
//!   a constraints and a config example, a real checkpoint header and the tiny pipeline's
//!   tokenizers and configs, made in-test), never panic, and every refusal is one line
//!   naming the file. Each proptest is bounded (256 cases) and persists its failures
//!   under `tests/proptest-regressions/`.
//! - Hand-written malformed values (every leaf of the valid YAML files set to values its
//!   field cannot hold, and named cases for the others) are refused — never accepted
//!   silently — with a message naming the field.

use crate::util::*;
use proptest::prelude::*;
use serde_yaml_ng::Value;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

const SRC: &str = "fuzz.yaml";

fn valid_plan() -> &'static str {
    static P: OnceLock<String> = OnceLock::new();
    P.get_or_init(|| read(&root().join("plans/flux-dev@2x-l40s.yaml")))
}
fn valid_machine() -> &'static str {
    static M: OnceLock<String> = OnceLock::new();
    M.get_or_init(|| read(&root().join("sim/machines/2x-l40s.yaml")))
}
const CONSTRAINTS: &str = "devices: [cuda:0, cuda:1]\nmax_vram: {cuda:0: 20GiB}\npin: {t5: cuda:1, transformer: [cuda:0, cuda:1]}\ntp: 2\nstream: true\nhost_components: false\nstream_buffers: 3\nobjective: latency\n";
const CONFIG: &str = "gpus = [1, 2]\nheadroom = \"2GiB\"\nmachine = \"machines/box.yaml\"\nobjective = \"latency\"\nweights_dirs = [\"w\", \"/abs/w\"]\n\n[max_vram]\n\"cuda:0\" = \"20GiB\"\n\"cuda:1\" = 1073741824\n";

/// A refusal is one line that names the file it came from.
pub(crate) fn refusal_ok(e: &str, source: &str) -> Result<(), TestCaseError> {
    prop_assert!(
        !e.contains('\n') && e.contains(source) && e.len() > source.len() + 4,
        "not one line naming {source}: {e:?}"
    );
    Ok(())
}

fn plan_err(text: &str) -> Option<String> {
    mold_plan::Plan::from_yaml(text, SRC)
        .err()
        .map(|e| e.to_string())
}
fn machine_err(text: &str) -> Option<String> {
    mold_machine::Machine::from_yaml(text, SRC)
        .err()
        .map(|e| e.to_string())
}
fn constraints_err(text: &str) -> Option<String> {
    mold_planner::ConstraintsFile::from_yaml(text, SRC)
        .err()
        .map(|e| e.to_string())
}
fn config_err(text: &str) -> Option<String> {
    mold_config::Layer::from_toml(text, Path::new("/etc/mold/fuzz.toml"))
        .err()
        .map(|e| e.to_string())
}

/// Byte-level mutations: (position, operation, byte). Operations: overwrite, insert,
/// delete, or splice in a token parsers find hard.
pub(crate) fn mutations() -> impl Strategy<Value = Vec<(usize, u8, u8)>> {
    prop::collection::vec((any::<usize>(), 0u8..4, any::<u8>()), 1..8)
}

const TOKENS: &[&str] = &[
    "-1",
    ".nan",
    "1e999",
    "~",
    "[",
    "{",
    "}",
    ":",
    "\n",
    "\"",
    "18446744073709551616",
    "\\u0000",
    "[[[[",
    "!!binary aGk=",
    "&a *a",
    "0",
    "null",
];

pub(crate) fn mutate(base: &[u8], ops: &[(usize, u8, u8)]) -> Vec<u8> {
    let mut v = base.to_vec();
    for &(pos, op, b) in ops {
        let i = pos % (v.len() + 1);
        match op {
            0 if i < v.len() => v[i] = b,
            1 => v.insert(i, b),
            2 if i < v.len() => {
                v.remove(i);
            }
            _ => {
                let t = TOKENS[b as usize % TOKENS.len()].as_bytes();
                v.splice(i..i, t.iter().copied());
            }
        }
    }
    v
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

// ---------------------------------------------------------------------------------------
// Files the binary-level parsers read: a real checkpoint header and the tiny pipeline's
// tokenizers and encoder configs, written once.

struct Tiny {
    /// The transformer checkpoint's header (the JSON after the 8-byte length) and the
    /// length of its tensor data.
    header: Vec<u8>,
    data_len: u64,
    t5_tokenizer: Vec<u8>,
    clip_tokenizer: Vec<u8>,
    t5_config: Vec<u8>,
    clip_config: Vec<u8>,
}

fn tiny() -> &'static Tiny {
    static T: OnceLock<Tiny> = OnceLock::new();
    T.get_or_init(|| {
        let d = tempdir("parsers-tiny");
        let written = mold_pipeline::flux::testdata::write_tiny_pipeline(&d, 7).unwrap();
        let transformer = written
            .iter()
            .find(|p| {
                p.file_name()
                    .is_some_and(|n| n == "flux-transformer.safetensors")
            })
            .unwrap_or_else(|| panic!("no transformer among {written:?}"));
        let bytes = std::fs::read(transformer).unwrap();
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let r = |p: &str| std::fs::read(d.join(p)).unwrap();
        Tiny {
            header: bytes[8..8 + n].to_vec(),
            data_len: (bytes.len() - 8 - n) as u64,
            t5_tokenizer: r("t5/tokenizer.json"),
            clip_tokenizer: r("clip/tokenizer.json"),
            t5_config: r("t5/config.json"),
            clip_config: r("clip/config.json"),
        }
    })
}

/// A scratch file for one test (tests run on several threads).
pub(crate) fn scratch(name: &str) -> PathBuf {
    static D: OnceLock<PathBuf> = OnceLock::new();
    D.get_or_init(|| tempdir("parsers-scratch")).join(name)
}

/// Writes a safetensors file: `len_prefix` (the header length as written), the header,
/// and `data_len` bytes of tensor data (sparse).
fn write_checkpoint(path: &Path, len_prefix: u64, header: &[u8], data_len: u64) {
    let mut out = len_prefix.to_le_bytes().to_vec();
    out.extend_from_slice(header);
    std::fs::write(path, &out).unwrap();
    let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    f.set_len(out.len() as u64 + data_len).unwrap();
}

/// Reads, identifies and refines a checkpoint; every refusal one line naming the file.
fn checkpoint_ok(path: &Path) -> Result<(), TestCaseError> {
    let name = path.display().to_string();
    match mold_models::checkpoint::read_header(path) {
        Ok(h) => {
            let _ = mold_models::checkpoint::identify(&h);
        }
        Err(e) => refusal_ok(&e.to_string(), &name)?,
    }
    for hint in [None, Some("flux-tiny"), Some("qwen-image")] {
        if let Err(e) = mold_models::checkpoint::refine(path, hint) {
            refusal_ok(&e.to_string(), &name)?;
        }
    }
    Ok(())
}

/// Loads a tokenizer as T5 and as CLIP would; every refusal one line naming the file.
fn tokenizer_ok(path: &Path) -> Result<(), TestCaseError> {
    let name = path.display().to_string();
    for (len, pads) in [(8, &["<pad>"][..]), (77, &["<|endoftext|>", "<pad>"][..])] {
        match mold_pipeline::flux::text::load_tokenizer(path, len, pads) {
            Ok(tok) => {
                let _ = mold_pipeline::text::tokenize(&tok, path, "a red fox in snow");
            }
            Err(e) => refusal_ok(&e.to_string(), &name)?,
        }
    }
    Ok(())
}

/// Reads an encoder config as T5's and as CLIP's; every refusal one line naming the file.
fn encoder_config_ok(path: &Path) -> Result<(), TestCaseError> {
    let name = path.display().to_string();
    let files = mold_pipeline::layout::EncoderFiles {
        config: path.to_path_buf(),
        weights: vec![],
        tokenizer: path.to_path_buf(),
    };
    if let Err(e) = mold_pipeline::flux::text::t5_config(&files) {
        refusal_ok(&e.to_string(), &name)?;
    }
    if let Err(e) = mold_pipeline::flux::text::clip_config(&files) {
        refusal_ok(&e.to_string(), &name)?;
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_yaml_never_panics(s in "[a-z_:{}\\[\\], \n0-9.\\-#!&*'\"|>\\\\]{0,300}") {
        for (e, src) in [plan_err(&s), machine_err(&s), constraints_err(&s)].into_iter().zip([SRC; 3]) {
            if let Some(e) = e {
                refusal_ok(&e, src)?;
            }
        }
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..400)) {
        let s = text(&bytes);
        for e in [plan_err(&s), machine_err(&s), constraints_err(&s)].into_iter().flatten() {
            refusal_ok(&e, SRC)?;
        }
        if let Some(e) = config_err(&s) {
            refusal_ok(&e, "fuzz.toml")?;
        }
        let p = scratch("bytes.safetensors");
        std::fs::write(&p, &bytes).unwrap();
        checkpoint_ok(&p)?;
        let p = scratch("bytes.json");
        std::fs::write(&p, &bytes).unwrap();
        tokenizer_ok(&p)?;
        encoder_config_ok(&p)?;
    }

    #[test]
    fn mutated_plan_never_panics(ops in mutations()) {
        if let Some(e) = plan_err(&text(&mutate(valid_plan().as_bytes(), &ops))) {
            refusal_ok(&e, SRC)?;
        }
    }

    #[test]
    fn mutated_machine_never_panics(ops in mutations()) {
        if let Some(e) = machine_err(&text(&mutate(valid_machine().as_bytes(), &ops))) {
            refusal_ok(&e, SRC)?;
        }
    }

    #[test]
    fn mutated_constraints_never_panic(ops in mutations()) {
        if let Some(e) = constraints_err(&text(&mutate(CONSTRAINTS.as_bytes(), &ops))) {
            refusal_ok(&e, SRC)?;
        }
    }

    #[test]
    fn mutated_config_never_panics(ops in mutations()) {
        if let Some(e) = config_err(&text(&mutate(CONFIG.as_bytes(), &ops))) {
            refusal_ok(&e, "fuzz.toml")?;
        }
    }

    /// A real checkpoint header (the tiny pipeline's transformer) mutated, with its
    /// length prefix and the file's data length sometimes wrong too.
    #[test]
    fn mutated_checkpoint_header_never_panics(
        ops in mutations(),
        prefix in prop_oneof![Just(None), any::<u64>().prop_map(Some)],
        data in prop_oneof![Just(None), (0u64..1 << 20).prop_map(Some)],
    ) {
        let t = tiny();
        let header = mutate(&t.header, &ops);
        let p = scratch("mutated.safetensors");
        write_checkpoint(&p, prefix.unwrap_or(header.len() as u64), &header, data.unwrap_or(t.data_len));
        checkpoint_ok(&p)?;
    }

    #[test]
    fn mutated_tokenizer_never_panics(ops in mutations(), clip in any::<bool>()) {
        let t = tiny();
        let base = if clip { &t.clip_tokenizer } else { &t.t5_tokenizer };
        let p = scratch(if clip { "clip-tokenizer.json" } else { "t5-tokenizer.json" });
        std::fs::write(&p, mutate(base, &ops)).unwrap();
        tokenizer_ok(&p)?;
    }

    #[test]
    fn mutated_encoder_config_never_panics(ops in mutations(), clip in any::<bool>()) {
        let t = tiny();
        let base = if clip { &t.clip_config } else { &t.t5_config };
        let p = scratch(if clip { "clip-config.json" } else { "t5-config.json" });
        std::fs::write(&p, mutate(base, &ops)).unwrap();
        encoder_config_ok(&p)?;
    }
}

// ---------------------------------------------------------------------------------------
// Malformed values are refused, naming the field.

/// Every scalar leaf of `v` with its path (`components[1].parts[0].devices[0]`) and the
/// key that holds it (`devices`).
fn leaves(v: &Value, path: String, key: &str, out: &mut Vec<(String, String, Value)>) {
    match v {
        Value::Mapping(m) => {
            for (k, x) in m {
                let k = k.as_str().unwrap_or("?").to_string();
                let p = if path.is_empty() {
                    k.clone()
                } else {
                    format!("{path}.{k}")
                };
                leaves(x, p, &k, out);
            }
        }
        Value::Sequence(s) => {
            for (i, x) in s.iter().enumerate() {
                leaves(x, format!("{path}[{i}]"), key, out);
            }
        }
        _ => out.push((path, key.to_string(), v.clone())),
    }
}

/// Sets the leaf at `path` of `v` to `to`.
fn set(v: &mut Value, path: &str, to: Value) {
    let mut cur = v;
    for part in path.split('.') {
        let (name, idx) = match part.split_once('[') {
            Some((n, rest)) => (n, Some(rest)),
            None => (part, None),
        };
        cur = cur.get_mut(name).expect(part);
        if let Some(rest) = idx {
            for i in rest.split('[') {
                let i: usize = i.trim_end_matches(']').parse().unwrap();
                cur = cur.get_mut(i).expect(part);
            }
        }
    }
    *cur = to;
}

/// Keys whose values are free text: any string is valid there (others are numbers,
/// sizes, devices, names from a fixed set, …).
const FREE_TEXT: &[&str] = &[
    "name",
    "id", // the model id; device ids are told apart below
    "fingerprint",
    "solver",
    "status",
    "objective",
    "strategy",
    "description",
    "source",
    "date",
    "mold_version",
    "notes",
    "path",
    "header_sha256",
    "uuid",
    "pci_bus",
    "compute_capability",
];

/// Values the leaf `(key, original)` cannot hold: each must be refused.
fn bad_values(key: &str, original: &Value) -> Vec<Value> {
    let y = |s: &str| serde_yaml_ng::from_str::<Value>(s).unwrap();
    let mut v = vec![y("[1, [2]]"), y("{a: 1}")];
    let device = original
        .as_str()
        .is_some_and(|s| s.parse::<mold_plan::DeviceId>().is_ok());
    let free = FREE_TEXT.contains(&key) && !device && original.is_string();
    if !free {
        v.push(y("not-a-valid-value"));
        v.push(y("-1"));
    }
    if original.is_number() {
        // Numbers: none of mold's figures may be NaN, infinite or negative.
        v.extend([y(".nan"), y(".inf"), y("-.inf"), y("-2.5")]);
    }
    v
}

/// Sets every leaf of `valid` to each of its bad values: `parse` must refuse every one,
/// in one line naming the leaf's key (or its full path).
fn refuses_every_bad_leaf(valid: &str, parse: impl Fn(&str) -> Option<String>) -> usize {
    let base: Value = serde_yaml_ng::from_str(valid).unwrap();
    assert!(parse(valid).is_none(), "the valid file must parse");
    let mut ls = Vec::new();
    leaves(&base, String::new(), "", &mut ls);
    let mut checked = 0;
    let mut failures = Vec::new();
    for (path, key, original) in &ls {
        for bad in bad_values(key, original) {
            let mut v = base.clone();
            set(&mut v, path, bad.clone());
            let text = serde_yaml_ng::to_string(&v).unwrap();
            let shown = serde_yaml_ng::to_string(&bad).unwrap();
            let shown = shown.trim();
            match parse(&text) {
                None => failures.push(format!("{path}: `{shown}` was accepted")),
                Some(e)
                    if e.contains('\n')
                        || !(e.contains(key.as_str()) || e.contains(path.as_str())) =>
                {
                    failures.push(format!(
                        "{path}: `{shown}`: the message does not name `{key}` in one line: {e}"
                    ))
                }
                Some(_) => {}
            }
            checked += 1;
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {checked}:\n{}",
        failures.len(),
        failures.join("\n")
    );
    checked
}

#[test]
fn every_bad_plan_leaf_is_refused_naming_it() {
    let n = refuses_every_bad_leaf(valid_plan(), plan_err);
    assert!(n > 250, "{n}");
}

#[test]
fn every_bad_machine_leaf_is_refused_naming_it() {
    let n = refuses_every_bad_leaf(valid_machine(), machine_err);
    assert!(n > 100, "{n}");
}

#[test]
fn every_bad_constraints_leaf_is_refused_naming_it() {
    let n = refuses_every_bad_leaf(CONSTRAINTS, constraints_err);
    assert!(n > 40, "{n}");
}

/// Values of the right type that make no sense, written by hand: each is refused with
/// a message naming the field.
/// A hand-written case: (valid file, its parser, line to replace, replacement, field the
/// refusal must name).
type NonsenseCase = (
    &'static str,
    fn(&str) -> Option<String>,
    &'static str,
    &'static str,
    &'static str,
);

#[test]
fn nonsense_of_the_right_type_is_refused_naming_the_field() {
    let cases: &[NonsenseCase] = &[
        (
            valid_plan(),
            plan_err,
            "  width: 1024",
            "  width: 0",
            "workload.width",
        ),
        (
            valid_plan(),
            plan_err,
            "  steps: 28",
            "  steps: 0",
            "workload.steps",
        ),
        (
            valid_plan(),
            plan_err,
            "  batch: 1",
            "  batch: 0",
            "workload.batch",
        ),
        (
            valid_plan(),
            plan_err,
            "  guidance: 3.5",
            "  guidance: .nan",
            "workload.guidance",
        ),
        (
            valid_plan(),
            plan_err,
            "    residency: resident",
            "    residency: resident\n    stream_buffers: 3",
            "components[0].parts[0].stream_buffers",
        ),
        (
            valid_plan(),
            plan_err,
            "    - cuda:0\n    residency",
            "    - cuda:0\n    - cuda:0\n    residency",
            "components[0].parts[0].devices",
        ),
        (
            valid_plan(),
            plan_err,
            "version: 5",
            "version: 6",
            "version",
        ),
        (
            valid_machine(),
            machine_err,
            "budget: ",
            "budget: 1000GiB #",
            "devices[0].budget",
        ),
        (
            valid_machine(),
            machine_err,
            "headroom: ",
            "headroom: 100GiB #",
            "devices[0].headroom",
        ),
        (
            valid_machine(),
            machine_err,
            "- id: cuda:1",
            "- id: cuda:0",
            "devices[1].id",
        ),
        (
            valid_machine(),
            machine_err,
            "- id: cuda:1",
            "- id: host",
            "devices[1].id",
        ),
        (
            valid_machine(),
            machine_err,
            "pinned_limit: ",
            "pinned_limit: 100TiB #",
            "host.pinned_limit",
        ),
        (
            valid_machine(),
            machine_err,
            "bf16_tflops: 300 ",
            "bf16_tflops: 300\n    model_efficiency: 2 ",
            "devices[0].model_efficiency",
        ),
        (
            valid_machine(),
            machine_err,
            "{latency_us: 30,",
            "{latency_us: .nan,",
            "links.peer[0].allreduce.latency_us",
        ),
        (
            valid_machine(),
            machine_err,
            "{latency_us: 80,",
            "{latency_us: -1,",
            "links.host_staged_allreduce.latency_us",
        ),
        (
            CONSTRAINTS,
            constraints_err,
            "stream_buffers: 3",
            "stream_buffers: 1",
            "stream_buffers",
        ),
        (CONSTRAINTS, constraints_err, "tp: 2", "tp: 1.5", "tp"),
        (
            CONSTRAINTS,
            constraints_err,
            "objective: latency",
            "objective: speed",
            "objective",
        ),
        (
            CONSTRAINTS,
            constraints_err,
            "devices: [cuda:0, cuda:1]",
            "devices: []",
            "fuzz.yaml: devices: empty",
        ),
        (
            CONSTRAINTS,
            constraints_err,
            "devices: [cuda:0, cuda:1]",
            "devices: [cuda:1, cuda:1]",
            "fuzz.yaml: devices: cuda:1 is listed twice",
        ),
        (
            CONSTRAINTS,
            constraints_err,
            "t5: cuda:1",
            "t5: []",
            "fuzz.yaml: pin.t5: empty",
        ),
    ];
    for (valid, parse, from, to, field) in cases {
        assert!(parse(valid).is_none());
        let bad = valid.replacen(from, to, 1);
        assert_ne!(&bad, valid, "`{from}` is not in the file");
        let e = parse(&bad).unwrap_or_else(|| panic!("`{to}` was accepted"));
        assert!(e.contains(field) && !e.contains('\n'), "`{to}`: {e}");
    }
}

#[test]
fn malformed_config_names_the_key() {
    for (text, want) in [
        ("gpus = [1, -2]", "fuzz.toml: gpus: -2 is not a GPU ordinal"),
        ("gpus = []", "fuzz.toml: gpus: names no GPU"),
        (
            "gpu = 1\ngpus = [1]",
            "fuzz.toml: gpu and gpus: both are set",
        ),
        ("gpu = \"x\"", "fuzz.toml: gpu: `x` is not a GPU"),
        ("headroom = -3", "fuzz.toml: headroom: -3 is not a size"),
        (
            "headroom = \"3 parsecs\"",
            "fuzz.toml: headroom: `3 parsecs` is not a size",
        ),
        ("machine = 3", "fuzz.toml: machine: write a profile path"),
        (
            "objective = \"speed\"",
            "fuzz.toml: objective: unknown objective",
        ),
        (
            "weights_dirs = [3]",
            "fuzz.toml: weights_dirs: 3 is not a directory path",
        ),
        ("weights_dirs = \"w\"", "fuzz.toml: weights_dirs"),
        (
            "[max_vram]\n\"cuda:x\" = \"1GiB\"",
            "fuzz.toml: max_vram.\"cuda:x\"",
        ),
        (
            "[max_vram]\n\"cuda:0\" = true",
            "fuzz.toml: max_vram.\"cuda:0\": true is not a size",
        ),
        ("max_vrams = 1", "fuzz.toml: unknown key `max_vrams`"),
        ("gpus = [1", "fuzz.toml: not valid TOML: line 1"),
    ] {
        let e = config_err(text).unwrap_or_else(|| panic!("`{text}` was accepted"));
        assert!(e.contains(want) && !e.contains('\n'), "{text}: {e}");
    }
    assert!(config_err(CONFIG).is_none());
}

#[test]
fn malformed_checkpoint_names_the_tensor_and_field() {
    let t = tiny();
    let p = scratch("hand.safetensors");
    let name = p.display().to_string();
    let h: serde_json::Value = serde_json::from_slice(&t.header).unwrap();
    let first = h
        .as_object()
        .unwrap()
        .keys()
        .find(|k| *k != "__metadata__")
        .unwrap()
        .clone();
    let with = |field: &str, v: serde_json::Value| {
        let mut h = h.clone();
        h[&first][field] = v;
        serde_json::to_vec(&h).unwrap()
    };
    for (header, want) in [
        (
            with("data_offsets", serde_json::json!([0, t.data_len + 1])),
            "data_offsets: [0, ",
        ),
        (
            with("data_offsets", serde_json::json!([4, 2])),
            "data_offsets: [4, 2] is not a byte range",
        ),
        (with("shape", serde_json::json!([])), "data_offsets: "),
        (
            with("shape", serde_json::json!(["a"])),
            "shape: \"a\" is not a dimension",
        ),
        (
            with("dtype", serde_json::json!(7)),
            "dtype: missing, or not a string",
        ),
    ] {
        write_checkpoint(&p, header.len() as u64, &header, t.data_len);
        let e = mold_models::checkpoint::read_header(&p)
            .err()
            .unwrap_or_else(|| panic!("accepted: {}", String::from_utf8_lossy(&header)))
            .to_string();
        assert!(
            e.contains(&name)
                && e.contains(&format!("tensor {first:?}"))
                && e.contains(want)
                && !e.contains('\n'),
            "{want}: {e}"
        );
    }
    // The length prefix and the data length.
    write_checkpoint(&p, u64::MAX, &t.header, t.data_len);
    let e = mold_models::checkpoint::read_header(&p)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("header length") && e.contains("not a safetensors file"),
        "{e}"
    );
    write_checkpoint(&p, t.header.len() as u64, &t.header, 0);
    let e = mold_models::checkpoint::read_header(&p)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("runs past the file's 0 bytes of tensor data"),
        "{e}"
    );
}

#[test]
fn malformed_tokenizer_names_the_field() {
    let t = tiny();
    let base: serde_json::Value = serde_json::from_slice(&t.t5_tokenizer).unwrap();
    let p = scratch("hand-tokenizer.json");
    for (field, v, want) in [
        ("model", serde_json::json!(3), "model: "),
        (
            "model",
            serde_json::json!({"type": "NoSuchModel"}),
            "model: ",
        ),
        (
            "pre_tokenizer",
            serde_json::json!({"type": "Nope"}),
            "pre_tokenizer: ",
        ),
        ("normalizer", serde_json::json!([1]), "normalizer: "),
        ("post_processor", serde_json::json!("x"), "post_processor: "),
        ("decoder", serde_json::json!(1.5), "decoder: "),
        ("padding", serde_json::json!(true), "padding: "),
        (
            "truncation",
            serde_json::json!({"max_length": -1}),
            "truncation: ",
        ),
        ("added_tokens", serde_json::json!(5), "added_tokens: "),
        ("version", serde_json::json!("9.9"), "version: "),
    ] {
        let mut bad = base.clone();
        bad[field] = v;
        std::fs::write(&p, serde_json::to_vec(&bad).unwrap()).unwrap();
        let e = mold_pipeline::flux::text::load_tokenizer(&p, 8, &["<pad>"])
            .err()
            .unwrap_or_else(|| panic!("{field}: accepted"))
            .to_string();
        assert!(
            e.contains(&p.display().to_string()) && e.contains(want) && !e.contains('\n'),
            "{field}: {e}"
        );
    }
    let mut bad = base.clone();
    bad.as_object_mut().unwrap().remove("model");
    std::fs::write(&p, serde_json::to_vec(&bad).unwrap()).unwrap();
    let e = mold_pipeline::flux::text::load_tokenizer(&p, 8, &["<pad>"])
        .unwrap_err()
        .to_string();
    assert!(e.contains("model: missing"), "{e}");
}
