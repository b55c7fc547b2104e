//! A component's `attention` (version 5): FP8 attention in the transformer's FP8 blocks.

use super::SAMPLE;
use crate::*;

/// SAMPLE's transformer in FP8, every part resident (FP8 weights are held resident).
fn fp8_sample() -> String {
    SAMPLE
        .replace(
            "- name: transformer\n  role: transformer\n  dtype: bf16\n",
            "- name: transformer\n  role: transformer\n  dtype: fp8\n",
        )
        .replace(
            "    residency: streamed\n    stream_buffers: 2\n",
            "    residency: resident\n",
        )
}

/// `yaml` with `attention: value` on `component`, after its `dtype` line.
fn with_attention(yaml: &str, component: &str, value: &str) -> String {
    let at = format!("- name: {component}\n");
    let i = yaml.find(&at).expect("the component") + at.len();
    let d = i + yaml[i..].find("  dtype: ").expect("its dtype");
    let end = d + yaml[d..].find('\n').expect("a line") + 1;
    format!("{}  attention: {value}\n{}", &yaml[..end], &yaml[end..])
}

#[test]
fn fp8_attention_round_trips_and_is_written_only_when_set() {
    let plain = Plan::from_yaml(&fp8_sample(), "p.yaml").unwrap();
    assert!(!plain.transformer().unwrap().fp8_attention());
    assert!(!plain.to_yaml().contains("attention"));
    let yaml = with_attention(&fp8_sample(), "transformer", "fp8");
    let p = Plan::from_yaml(&yaml, "p.yaml").unwrap();
    let t = p.transformer().unwrap();
    assert!(t.fp8_attention());
    assert_eq!(t.attention, Some(DType::Fp8));
    let back = Plan::from_yaml(&p.to_yaml(), "again.yaml").unwrap();
    assert_eq!(p, back);
    assert!(p.to_yaml().contains("  attention: fp8\n"));
}

#[test]
fn a_version_4_plan_is_read_as_attention_in_its_dtype() {
    let v4 = fp8_sample().replace("version: 5", "version: 4");
    let p = Plan::from_yaml(&v4, "v4.yaml").unwrap();
    assert_eq!(p.version, PLAN_VERSION);
    assert_eq!(p, Plan::from_yaml(&fp8_sample(), "v5.yaml").unwrap());
    // The field is version 5's: a plan saying 4 with it is refused, naming it.
    let bad = with_attention(&v4, "transformer", "fp8");
    let e = Plan::from_yaml(&bad, "v4.yaml").unwrap_err().to_string();
    assert!(
        e.contains("components[1].attention") && e.contains("version 5") && !e.contains('\n'),
        "{e}"
    );
}

#[test]
fn fp8_attention_is_refused_where_it_cannot_run() {
    let cases = [
        // Dense products: FP8 attention runs in FP8 blocks.
        (
            with_attention(SAMPLE, "transformer", "fp8"),
            "components[1].attention",
            "dtype: fp8",
        ),
        // Not the transformer.
        (
            with_attention(&fp8_sample(), "t5", "fp8"),
            "components[0].attention",
            "transformer's",
        ),
        // Only fp8 is written.
        (
            with_attention(&fp8_sample(), "transformer", "bf16"),
            "components[1].attention",
            "only `fp8`",
        ),
    ];
    for (yaml, field, fix) in cases {
        let e = Plan::from_yaml(&yaml, "p.yaml").unwrap_err().to_string();
        assert!(
            e.contains(field) && e.contains(fix) && !e.contains('\n'),
            "{field}: {e}"
        );
    }
    // A value that is no dtype names the field too.
    let e = Plan::from_yaml(
        &with_attention(&fp8_sample(), "transformer", "fp4"),
        "p.yaml",
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("attention"), "{e}");
}
