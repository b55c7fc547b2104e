//! The request bodies' parser and checks (`api::parse`, `check_generate`,
//! `check_images`), fuzzed like the file parsers (tests/integration/parsers.rs):
//! arbitrary bytes, JSON-like text, and mutations of valid requests up to several KiB
//! never panic, and every refusal is one line, a 4xx, naming the field or the body.
//! What is accepted stays within the server's limits and the plan's size. Each proptest
//! is bounded (256 cases).

use mold_plan::{DeviceId, Plan};
use mold_serve::api::{self, GenerateRequest, ImagesRequest, Refusal};
use mold_serve::ServeOptions;
use proptest::prelude::*;
use std::sync::OnceLock;

/// flux-tiny planned on two emulated devices (its default size: 64x64).
fn plan() -> &'static Plan {
    static P: OnceLock<Plan> = OnceLock::new();
    P.get_or_init(|| {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let machine =
            mold_machine::Machine::load(&root.join("sim/machines/cpu-emu-4.yaml")).unwrap();
        let model = mold_models::find("flux-tiny").unwrap();
        let m = machine
            .select(&[DeviceId::Emu(0), DeviceId::Emu(1)])
            .unwrap();
        let req = mold_planner::Request::new(model.clone(), m, model.default_workload.clone());
        mold_planner::plan(&req).unwrap().plan
    })
}

fn model() -> &'static mold_models::ModelSpec {
    static M: OnceLock<mold_models::ModelSpec> = OnceLock::new();
    M.get_or_init(|| mold_models::find("flux-tiny").unwrap())
}

fn opts() -> ServeOptions {
    ServeOptions {
        queue: 4,
        ..ServeOptions::default()
    }
}

/// A refusal: a 4xx and one line that says what is wrong (`FIELD: …` or `body: …`).
fn refusal_ok(r: &Refusal) -> Result<(), TestCaseError> {
    prop_assert!((400..500).contains(&r.status), "{r:?}");
    prop_assert!(!r.message.contains('\n'), "not one line: {:?}", r.message);
    let (head, rest) = r
        .message
        .split_once(": ")
        .ok_or_else(|| TestCaseError::fail(format!("names no field: {:?}", r.message)))?;
    prop_assert!(!head.is_empty() && !rest.is_empty(), "{:?}", r.message);
    Ok(())
}

/// What a body becomes on both endpoints: refused in one line, or requests within the
/// limits.
fn body_ok(bytes: &[u8]) -> Result<(), TestCaseError> {
    let (o, plan, model) = (opts(), plan(), model());
    let checked = [
        api::parse::<GenerateRequest>(bytes).and_then(|r| api::check_generate(&r, &o, model, plan)),
        api::parse::<ImagesRequest>(bytes).and_then(|r| api::check_images(&r, &o, model, plan)),
    ];
    for c in checked {
        match c {
            Err(r) => refusal_ok(&r)?,
            Ok(c) => {
                prop_assert!(!c.requests.is_empty() && c.requests.len() <= o.queue);
                for r in &c.requests {
                    prop_assert!(
                        r.width <= plan.workload.width && r.height <= plan.workload.height
                    );
                    prop_assert!(r.steps >= 1 && r.steps <= o.max_steps);
                    prop_assert!(!r.prompt.trim().is_empty());
                    prop_assert!(r.prompt.chars().count() <= o.max_prompt_chars);
                    prop_assert!(r.guidance.is_none_or(|g| g.is_finite() && g >= 0.0));
                }
            }
        }
    }
    Ok(())
}

const VALID: &[&str] = &[
    r#"{"prompt":"a red fox in snow","seed":42,"steps":3,"guidance":3.5,"width":64,"height":48}"#,
    r#"{"prompt":"a red fox in snow","n":2,"size":"64x64","response_format":"b64_json","model":"flux-tiny","user":"u","seed":7,"steps":2}"#,
    r#"{"prompt":"x"}"#,
];

/// Tokens JSON parsers find hard.
const TOKENS: &[&str] = &[
    "-1",
    "1e999",
    "-0",
    "18446744073709551616",
    "4294967296",
    "null",
    "true",
    "\"",
    "\\u0000",
    "\\ud800",
    "{",
    "}",
    "[",
    "]",
    ",",
    ":",
    "0x10",
    "NaN",
    "2048",
    "\"2048x2048\"",
    "\"prompt\"",
    "\"n\"",
    "\"size\"",
    "\"width\"",
    "\"steps\"",
    "\"guidance\"",
    "\u{feff}",
    "\u{1F98A}",
];

fn mutate(base: &[u8], ops: &[(usize, u8, u8)]) -> Vec<u8> {
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

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..6000)) {
        body_ok(&bytes)?;
    }

    #[test]
    fn json_like_text_never_panics(s in "[{}\\[\\]\":, a-z0-9.eE+\\-x\\\\]{0,3000}") {
        body_ok(s.as_bytes())?;
    }

    #[test]
    fn mutated_valid_requests_never_panic(
        which in 0..VALID.len(),
        ops in prop::collection::vec((any::<usize>(), 0u8..4, any::<u8>()), 1..12),
    ) {
        body_ok(&mutate(VALID[which].as_bytes(), &ops))?;
    }

    #[test]
    fn any_field_values_are_checked(
        prompt in prop::option::of(".{0,4200}"),
        width in prop::option::of(any::<u32>()),
        height in prop::option::of(prop_oneof![Just(64u32), Just(48), Just(0), Just(80), any::<u32>()]),
        n in prop::option::of(prop_oneof![0u32..10, any::<u32>()]),
        size in prop::option::of("[0-9]{0,5}[xX]?[0-9]{0,5}"),
        steps in prop::option::of(prop_oneof![0u32..300, any::<u32>()]),
        guidance in prop::option::of(prop_oneof![-10.0f64..10.0, Just(0.0), Just(-0.0), Just(1e308)]),
        seed in prop::option::of(any::<u64>()),
    ) {
        let mut g = serde_json::Map::new();
        let mut i = serde_json::Map::new();
        if let Some(p) = prompt {
            g.insert("prompt".into(), p.clone().into());
            i.insert("prompt".into(), p.into());
        }
        for (k, v) in [("width", width), ("height", height), ("steps", steps)] {
            if let Some(v) = v {
                g.insert(k.into(), v.into());
            }
        }
        if let Some(v) = steps {
            i.insert("steps".into(), v.into());
        }
        if let Some(v) = guidance {
            g.insert("guidance".into(), v.into());
        }
        if let Some(v) = seed {
            g.insert("seed".into(), v.into());
            i.insert("seed".into(), v.into());
        }
        if let Some(v) = n {
            i.insert("n".into(), v.into());
        }
        if let Some(v) = size {
            i.insert("size".into(), v.into());
        }
        body_ok(&serde_json::to_vec(&g).unwrap())?;
        body_ok(&serde_json::to_vec(&i).unwrap())?;
    }
}

fn refused_with(body: &str, images: bool) -> Refusal {
    let (o, plan, model) = (opts(), plan(), model());
    let r = if images {
        api::parse::<ImagesRequest>(body.as_bytes())
            .and_then(|r| api::check_images(&r, &o, model, plan))
    } else {
        api::parse::<GenerateRequest>(body.as_bytes())
            .and_then(|r| api::check_generate(&r, &o, model, plan))
    };
    r.expect_err(body)
}

#[test]
fn requests_beyond_the_plan_or_the_queue_are_refused_naming_the_limit() {
    for (body, images, want) in [
        (
            r#"{"prompt":"x","width":2048,"height":2048}"#,
            false,
            "width: 2048 is more than the 64 this server's plan was sized for (64x64); ask for at most 64x64, or serve a plan made with `mold plan --size 2048x2048`",
        ),
        (
            r#"{"prompt":"x","height":80}"#,
            false,
            "height: 80 is more than the 64 this server's plan was sized for (64x64)",
        ),
        (
            r#"{"prompt":"x","size":"2048x2048"}"#,
            true,
            "size: width 2048 is more than the 64 this server's plan was sized for",
        ),
        (
            r#"{"prompt":"x","n":5}"#,
            true,
            "n: 5 images, more than this server's queue holds (4); ask for at most 4 per request",
        ),
        (
            r#"{"prompt":"x","guidance":-1}"#,
            false,
            "guidance: -1; give a finite number >= 0",
        ),
    ] {
        let r = refused_with(body, images);
        assert_eq!(r.status, 400, "{r:?}");
        assert!(r.message.starts_with(want), "{want}\n{}", r.message);
    }
    // Smaller than the plan, in its multiples: fine.
    let (o, plan, model) = (opts(), plan(), model());
    let r: GenerateRequest = api::parse(br#"{"prompt":"x","width":32,"height":48}"#).unwrap();
    let c = api::check_generate(&r, &o, model, plan).unwrap();
    assert_eq!((c.requests[0].width, c.requests[0].height), (32, 48));
}

/// A plain request's answer shows no digest, so it takes none (each costs the host about
/// a millisecond per megabyte hashed, between the steps); the progress stream turns them
/// back on (tests/serve.rs).
#[test]
fn the_server_s_requests_take_no_digests() {
    let (o, plan, model) = (opts(), plan(), model());
    let g: GenerateRequest = api::parse(br#"{"prompt":"x"}"#).unwrap();
    let c = api::check_generate(&g, &o, model, plan).unwrap();
    assert!(c.requests.iter().all(|r| r.no_digests));
    let i: ImagesRequest = api::parse(br#"{"prompt":"x","n":2}"#).unwrap();
    let c = api::check_images(&i, &o, model, plan).unwrap();
    assert_eq!(c.requests.len(), 2);
    assert!(c.requests.iter().all(|r| r.no_digests));
}
