use super::layer::config_path;
use super::parse::parse_caps;
use super::*;
use std::collections::HashMap;
use std::path::Path;

fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let m: HashMap<String, String> = pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    move |k: &str| m.get(k).cloned()
}

const FILE: &str = r#"
gpus = [1, 2]
headroom = "3GiB"
machine = "machines/box.yaml"
objective = "memory"
weights_dirs = ["w", "/abs/w"]

[max_vram]
"cuda:0" = "20GiB"
"cuda:1" = 1073741824
"#;

fn file() -> Layer {
    Layer::from_toml(FILE, Path::new("/etc/mold/config.toml")).unwrap()
}

#[test]
fn parses_every_key() {
    let l = file();
    assert_eq!(l.gpus.unwrap().value, vec![1, 2]);
    assert_eq!(l.headroom.unwrap().value, ByteSize(3 << 30));
    assert_eq!(l.machine.unwrap().value, "/etc/mold/machines/box.yaml");
    assert_eq!(l.objective.unwrap().value, Objective::Memory);
    assert_eq!(
        l.weights_dirs.unwrap().value,
        vec![PathBuf::from("/etc/mold/w"), PathBuf::from("/abs/w")]
    );
    assert_eq!(l.max_vram[&DeviceId::Cuda(0)].value, ByteSize(20 << 30));
    assert_eq!(l.max_vram[&DeviceId::Cuda(1)].value, ByteSize(1 << 30));
    let local = Layer::from_toml("machine = \"local\"", Path::new("/x/c.toml")).unwrap();
    assert_eq!(local.machine.unwrap().value, "local");
}

#[test]
fn unknown_key_is_named() {
    let e = Layer::from_toml("gpus = [0]\ngpu_list = [1]\n", Path::new("c.toml")).unwrap_err();
    assert!(matches!(&e, ConfigError::UnknownKey { key, .. } if key == "gpu_list"));
    let s = e.to_string();
    assert!(
        s.contains("c.toml") && s.contains("`gpu_list`") && s.contains("max_vram"),
        "{s}"
    );
}

/// The seed's spelling: `gpu = 1` selects one GPU, beside `gpus`; both together are
/// refused naming both keys.
#[test]
fn gpu_names_one_gpu() {
    let c = Path::new("c.toml");
    let l = Layer::from_toml("gpu = 1\n", c).unwrap();
    let g = l.gpus.unwrap();
    assert_eq!((g.value, g.key.as_str()), (vec![1], "gpu"));
    let l = Layer::from_toml("gpu = \"cuda:3\"\n", c).unwrap();
    assert_eq!(l.gpus.unwrap().value, vec![3]);
    for (text, want) in [
        (
            "gpu = 1\ngpus = [2]\n",
            "c.toml: gpu and gpus: both are set",
        ),
        (
            "gpus = [2]\ngpu = 1\n",
            "c.toml: gpu and gpus: both are set",
        ),
        ("gpu = [1, 2]", "c.toml: gpu: names one GPU"),
        (
            "gpu = -1",
            "c.toml: gpu: -1 is not a GPU ordinal: write e.g. gpu = 1",
        ),
        (
            "gpu = \"1,2\"",
            "c.toml: gpu: \"1,2\": write one GPU per item",
        ),
        ("gpu = 1.5", "c.toml: gpu: 1.5 is not a GPU ordinal"),
        ("gpu = \"one\"", "c.toml: gpu: `one` is not a GPU"),
    ] {
        let e = Layer::from_toml(text, c).unwrap_err().to_string();
        assert!(e.starts_with(want), "{text}: {e}");
    }
    // In effect, it is shown with its key.
    let s = resolve(
        Layer::default(),
        Layer::default(),
        Some((
            PathBuf::from("/c.toml"),
            Layer::from_toml("gpu = 2", c).unwrap(),
        )),
    );
    assert_eq!(s.gpus.as_ref().unwrap().source(), "config /c.toml: gpu");
    // The environment's MOLD_GPU still wins over the file's `gpu`.
    let env = Layer::from_env(env(&[(ENV_GPU, "0")])).unwrap();
    let s = resolve(
        Layer::default(),
        env,
        Some((
            PathBuf::from("/c.toml"),
            Layer::from_toml("gpu = 2", c).unwrap(),
        )),
    );
    assert_eq!(s.gpus.unwrap().value, vec![0]);
}

/// Every refusal is one line, whatever the file holds (keys and values with line
/// breaks, syntax errors toml reports over several lines).
#[test]
fn refusals_are_one_line() {
    for text in [
        "\"a\\nb\" = 1",
        "gpus = [\"x\\ny\"]",
        "headroom = \"1\\nparsec\"",
        "[max_vram]\n\"cu\\nda:0\" = \"1GiB\"",
        "gpus = [1",
        "gpus = [1,,2]",
        "= 3",
        "machine = 3\nmachine = 4",
    ] {
        let e = Layer::from_toml(text, Path::new("c.toml"))
            .unwrap_err()
            .to_string();
        assert!(
            !e.contains('\n') && e.starts_with("c.toml: "),
            "{text}: {e}"
        );
    }
    let e = Layer::from_toml("x = 1\ngpus = [1", Path::new("c.toml"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("line 2"), "{e}");
}

#[test]
fn bad_values_name_file_and_key() {
    for (text, want) in [
        (
            "headroom = \"lots\"",
            "c.toml: headroom: `lots` is not a size",
        ),
        (
            "objective = \"speed\"",
            "c.toml: objective: unknown objective",
        ),
        ("gpus = [1, 1]", "c.toml: gpus: GPU 1 is named twice"),
        ("gpus = [-1]", "c.toml: gpus: -1 is not a GPU"),
        (
            "[max_vram]\n\"gpu0\" = \"1GiB\"",
            "c.toml: max_vram.\"gpu0\"",
        ),
        ("max_vram = 3", "c.toml: max_vram: write a table"),
    ] {
        let e = Layer::from_toml(text, Path::new("c.toml"))
            .unwrap_err()
            .to_string();
        assert!(e.contains(want), "{text}: {e}");
    }
    let e = Layer::from_toml("gpus = [1", Path::new("c.toml")).unwrap_err();
    assert!(matches!(e, ConfigError::Syntax { .. }), "{e}");
}

#[test]
fn env_level() {
    let l = Layer::from_env(env(&[
        (ENV_GPUS, "cuda:3,1"),
        (ENV_MAX_VRAM, "cuda:0=20GiB, cuda:1=30GiB"),
        (ENV_HEADROOM, "512MiB"),
        (ENV_OBJECTIVE, "memory"),
        (ENV_MACHINE, "local"),
    ]))
    .unwrap();
    assert_eq!(l.gpus.as_ref().unwrap().value, vec![3, 1]);
    assert_eq!(l.gpus.unwrap().key, "MOLD_GPUS=cuda:3,1");
    assert_eq!(l.max_vram[&DeviceId::Cuda(1)].value, ByteSize(30 << 30));
    assert_eq!(l.headroom.unwrap().value, ByteSize(512 << 20));
    assert_eq!(l.objective.unwrap().value, Objective::Memory);
    assert_eq!(l.machine.unwrap().value, "local");

    let one = Layer::from_env(env(&[(ENV_GPU, "2")])).unwrap();
    assert_eq!(one.gpus.unwrap().value, vec![2]);
    assert!(Layer::from_env(env(&[(ENV_GPU, "2,3")])).is_err());
    let both = Layer::from_env(env(&[(ENV_GPU, "2"), (ENV_GPUS, "1")])).unwrap_err();
    assert!(
        both.to_string().contains("MOLD_GPUS and MOLD_GPU"),
        "{both}"
    );
    let e = Layer::from_env(env(&[(ENV_MAX_VRAM, "cuda:0:20GiB")])).unwrap_err();
    assert!(e.to_string().starts_with("MOLD_MAX_VRAM: "), "{e}");
    // Empty variables count as unset.
    assert_eq!(
        Layer::from_env(env(&[(ENV_GPUS, "")])).unwrap(),
        Layer::default()
    );
}

#[test]
fn precedence_flag_env_file_default() {
    let flags = Layer {
        gpus: Some(Val::new(vec![0], "--gpus")),
        max_vram: [(DeviceId::Cuda(1), Val::new(ByteSize(5 << 30), "--max-vram"))].into(),
        ..Layer::default()
    };
    let envl = Layer::from_env(env(&[
        (ENV_GPUS, "4"),
        (ENV_HEADROOM, "2GiB"),
        (ENV_MAX_VRAM, "cuda:1=6GiB,cuda:2=7GiB"),
    ]))
    .unwrap();
    let path = PathBuf::from("/etc/mold/config.toml");
    let s = resolve(flags.clone(), envl.clone(), Some((path.clone(), file())));
    // flag over env over file
    assert_eq!(s.gpus.as_ref().unwrap().value, vec![0]);
    assert_eq!(s.gpus.as_ref().unwrap().source(), "--gpus");
    // env over file
    assert_eq!(s.headroom.as_ref().unwrap().value, ByteSize(2 << 30));
    assert_eq!(s.headroom.as_ref().unwrap().source(), "MOLD_HEADROOM");
    // file over default
    assert_eq!(s.objective.value, Objective::Memory);
    assert_eq!(
        s.objective.source(),
        "config /etc/mold/config.toml: objective"
    );
    // max_vram merges per device
    let cap = |n| s.max_vram[&DeviceId::Cuda(n)].clone();
    assert_eq!(
        (cap(0).value, cap(0).origin),
        (ByteSize(20 << 30), Origin::File(path.clone()))
    );
    assert_eq!(
        (cap(1).value, cap(1).origin),
        (ByteSize(5 << 30), Origin::Flag)
    );
    assert_eq!(
        (cap(2).value, cap(2).origin),
        (ByteSize(7 << 30), Origin::Env)
    );
    // env over file for gpus once the flag is gone
    let s = resolve(Layer::default(), envl, Some((path.clone(), file())));
    assert_eq!(s.gpus.unwrap().value, vec![4]);
    // file when neither
    let s = resolve(Layer::default(), Layer::default(), Some((path, file())));
    assert_eq!(s.gpus.unwrap().value, vec![1, 2]);
    // defaults
    let s = resolve(Layer::default(), Layer::default(), None);
    assert_eq!(s.gpus, None);
    assert_eq!(s.objective.value, Objective::Latency);
    assert_eq!(s.objective.source(), "default");
    assert!(s.weights_dirs.value.is_empty());
    assert!(s.to_string().contains("config file   (none)"));
}

#[test]
fn cache_dir_order() {
    let p = |pairs: &[(&str, &str)]| super::cache_dir(env(pairs));
    assert_eq!(
        p(&[
            ("MOLD_CACHE_DIR", "/m"),
            ("XDG_CACHE_HOME", "/x"),
            ("HOME", "/h")
        ]),
        Some(PathBuf::from("/m"))
    );
    assert_eq!(
        p(&[("XDG_CACHE_HOME", "/x"), ("HOME", "/h")]),
        Some(PathBuf::from("/x/mold"))
    );
    assert_eq!(
        p(&[("MOLD_CACHE_DIR", ""), ("HOME", "/h")]),
        Some(PathBuf::from("/h/.cache/mold"))
    );
    assert_eq!(p(&[]), None);
}

#[test]
fn config_path_order() {
    let p = |pairs: &[(&str, &str)]| config_path(env(pairs));
    assert_eq!(
        p(&[
            (ENV_CONFIG, "/a/c.toml"),
            ("XDG_CONFIG_HOME", "/x"),
            ("HOME", "/h")
        ]),
        Some((PathBuf::from("/a/c.toml"), true))
    );
    if !cfg!(windows) {
        assert_eq!(
            p(&[("XDG_CONFIG_HOME", "/x"), ("HOME", "/h")]),
            Some((PathBuf::from("/x/mold/config.toml"), false))
        );
        assert_eq!(
            p(&[("HOME", "/h")]),
            Some((PathBuf::from("/h/.config/mold/config.toml"), false))
        );
    }
    assert_eq!(p(&[]), None);
}

#[test]
fn missing_files() {
    let dir = std::env::temp_dir().join(format!("mold-config-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let d = dir.display().to_string();
    // A missing default file is no error; a missing $MOLD_CONFIG is.
    assert!(load_file(env(&[("XDG_CONFIG_HOME", &d)]))
        .unwrap()
        .is_none());
    let want = format!("{d}/nope.toml");
    let e = load_file(env(&[(ENV_CONFIG, &want)]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("nope.toml") && e.contains("MOLD_CONFIG"), "{e}");
    std::fs::create_dir_all(dir.join("mold")).unwrap();
    std::fs::write(dir.join("mold/config.toml"), "gpus = [3]\n").unwrap();
    let (path, l) = load_file(env(&[("XDG_CONFIG_HOME", &d)])).unwrap().unwrap();
    assert_eq!(path, dir.join("mold/config.toml"));
    assert_eq!(l.gpus.unwrap().value, vec![3]);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn gpu_lists_and_caps() {
    assert_eq!(parse_gpu_list("1, 2", "--gpus").unwrap(), vec![1, 2]);
    assert_eq!(parse_gpu_list("cuda:2", "--gpus").unwrap(), vec![2]);
    let e = parse_gpu_list("one", "--gpus").unwrap_err().to_string();
    assert!(e.starts_with("--gpus: `one` is not a GPU"), "{e}");
    assert!(parse_gpu_list("", "--gpus").is_err());
    let caps = parse_caps("cuda:0=20GiB,cuda:1=30GiB", "MOLD_MAX_VRAM").unwrap();
    assert_eq!(caps.len(), 2);
    assert!(parse_caps("cuda:0=1GiB,cuda:0=2GiB", "x").is_err());
}
