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

/// Replaces timings that change from run to run.
pub fn stable(s: &str) -> String {
    let mut out = String::new();
    for line in s.lines() {
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
