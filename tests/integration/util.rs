use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Runs the built `mold` binary from the repository root.
pub fn mold(args: &[&str]) -> Output {
    mold_env(args, &[])
}

/// Runs mold with extra environment variables (set after the developer's `MOLD_*` ones
/// are removed).
pub fn mold_env(args: &[&str], env: &[(&str, &str)]) -> Output {
    mold_command(args, env).output().expect("run mold")
}

/// The `mold` command of [`mold_env`], not yet run.
pub fn mold_command(args: &[&str], env: &[(&str, &str)]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_mold"));
    // The tests must not see the developer's own configuration, nor a launcher's
    // variables (a test run under torchrun or srun).
    for (k, _) in std::env::vars() {
        if k.starts_with("MOLD_") || mold_exec::dist::LAUNCH_VARS.contains(&k.as_str()) {
            c.env_remove(k);
        }
    }
    c.env("XDG_CONFIG_HOME", root().join("target/no-such-config-dir"))
        .env("HOME", root().join("target/no-such-home"))
        .envs(env.iter().copied())
        .args(args)
        .current_dir(root());
    c
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A fresh temporary directory for one test.
pub fn tempdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("mold-it-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Replaces timings that change from run to run, and drops the stamp line mold writes
/// first in a plan (`# written by mold … mold-sha256:…`, a digest of the rest, which holds
/// the solve time).
pub fn stable(s: &str) -> String {
    let mut out = String::new();
    for line in s.lines() {
        if line.starts_with("# written by mold") && line.contains(mold_files::MARK) {
            continue;
        }
        let mut l = line.to_string();
        if let Some(i) = l.find("solve_time_ms:") {
            l.truncate(i);
            l.push_str("solve_time_ms: [redacted]");
        }
        // "(0.4 ms)" and "1.2 ms for 4 strategy families" in summaries.
        let mut res = String::new();
        let mut rest = l.as_str();
        while let Some(i) = rest.find(" ms") {
            let head = &rest[..i];
            let start = head
                .rfind(|c: char| !(c.is_ascii_digit() || c == '.'))
                .map(|j| j + 1)
                .unwrap_or(0);
            let is_solver = rest[i..].starts_with(" ms)") || rest[i..].starts_with(" ms for");
            if is_solver && start < head.len() {
                res.push_str(&head[..start]);
                res.push_str("[t]");
            } else {
                res.push_str(head);
            }
            res.push_str(" ms");
            rest = &rest[i + 3..];
        }
        res.push_str(rest);
        out.push_str(&res);
        out.push('\n');
    }
    out
}

pub fn read(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// Runs mold and insists it succeeds: (stdout, stderr).
pub fn mold_ok(args: &[&str]) -> (String, String) {
    let o = mold(args);
    assert!(
        o.status.success(),
        "mold {args:?}: {}{}",
        stdout(&o),
        stderr(&o)
    );
    (stdout(&o), stderr(&o))
}

/// Runs mold and insists it fails: its stderr.
pub fn mold_fails(args: &[&str]) -> String {
    let o = mold(args);
    assert!(
        !o.status.success(),
        "mold {args:?} should fail: {}",
        stdout(&o)
    );
    stderr(&o)
}

/// Rewrites a plan's transformer as one tensor-parallel part over `emu:0` and `emu:1`.
/// The planner prices Qwen-Image's CFG passes at batch 1, and on cpu-emu-4 `--tp 2` then
/// keeps qwen-image-tiny on one device (the collectives cost more than they save); the
/// executor's tensor-parallel path must still be exercised, so the tests write that plan
/// themselves (from a `--cfg serial` plan: no replicas to remap).
pub fn tensor_parallel_on_two(path: &Path) {
    let mut plan = mold_plan::Plan::load(path).unwrap();
    assert!(plan.replicas.is_none(), "{}", path.display());
    let t = plan
        .components
        .iter_mut()
        .find(|c| c.role == mold_plan::ComponentRole::Transformer)
        .unwrap();
    let mut part = t.parts[0].clone();
    part.blocks = t.parts.iter().flat_map(|p| p.blocks.clone()).collect();
    part.devices = vec![mold_plan::DeviceId::Emu(0), mold_plan::DeviceId::Emu(1)];
    part.tp = 2;
    part.sp = 1;
    t.parts = vec![part];
    std::fs::write(path, plan.to_yaml()).unwrap();
}
