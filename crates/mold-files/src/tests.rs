use super::*;

/// A fresh directory for one test.
fn tempdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("mold-files-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn entries(d: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(d)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

fn dest(path: &Path, force: bool) -> Dest<'_> {
    Dest {
        path,
        flag: "-o",
        what: "plan",
        force_flag: "--force",
        force,
    }
}

#[test]
fn a_write_that_fails_midway_leaves_the_old_file_and_no_temporary_file() {
    let d = tempdir("interrupted");
    let p = d.join("plan.yaml");
    std::fs::write(&p, "old\n").unwrap();
    let e = write_with(&p, |w| {
        w.write_all(&[b'x'; 3 << 20])?;
        Err(io::Error::other("interrupted"))
    })
    .unwrap_err();
    assert_eq!(e.to_string(), "interrupted");
    assert_eq!(std::fs::read_to_string(&p).unwrap(), "old\n");
    assert_eq!(entries(&d), ["plan.yaml"]);
    // And a write that completes replaces it whole.
    write_bytes(&p, b"new\n").unwrap();
    assert_eq!(std::fs::read_to_string(&p).unwrap(), "new\n");
    assert_eq!(entries(&d), ["plan.yaml"]);
}

#[cfg(unix)]
#[test]
fn a_symlink_is_replaced_and_its_target_left_untouched() {
    let d = tempdir("symlink");
    let blob = d.join("blob");
    std::fs::write(&blob, "the user's weights").unwrap();
    let link = d.join("ae.safetensors");
    std::os::unix::fs::symlink(&blob, &link).unwrap();
    write_bytes(&link, b"random weights").unwrap();
    assert_eq!(
        std::fs::read_to_string(&blob).unwrap(),
        "the user's weights"
    );
    assert!(!std::fs::symlink_metadata(&link)
        .unwrap()
        .file_type()
        .is_symlink());
    assert_eq!(std::fs::read_to_string(&link).unwrap(), "random weights");
}

#[cfg(unix)]
#[test]
fn a_replaced_file_keeps_its_mode_and_a_new_one_is_not_private() {
    use std::os::unix::fs::PermissionsExt;
    let d = tempdir("mode");
    let p = d.join("run.sh");
    std::fs::write(&p, "old").unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o751)).unwrap();
    write_bytes(&p, b"new").unwrap();
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&p), 0o751);
    let q = d.join("new.yaml");
    write_bytes(&q, b"x").unwrap();
    // 0666 less the umask: readable by others under any usual umask (not tempfile's 0600).
    assert_ne!(mode(&q) & 0o044, 0, "{:o}", mode(&q));
}

#[test]
fn only_an_unchanged_stamped_file_is_replaced_unforced() {
    let d = tempdir("check");
    let p = d.join("plan.yaml");
    // Nothing there: fine.
    dest(&p, false)
        .check(Mine::Stamped(Stamp::HashComment))
        .unwrap();
    dest(&p, false)
        .write_stamped(Stamp::HashComment, b"steps: 28\n")
        .unwrap();
    let first = std::fs::read_to_string(&p).unwrap();
    assert!(first.starts_with("# written by mold"), "{first}");
    assert!(first.ends_with("steps: 28\n"), "{first}");
    // mold's own, unchanged: replaced.
    dest(&p, false)
        .write_stamped(Stamp::HashComment, b"steps: 4\n")
        .unwrap();
    assert!(std::fs::read_to_string(&p).unwrap().ends_with("steps: 4\n"));
    // Edited by hand: refused, one line naming the path and the way out; left as it was.
    let edited = std::fs::read_to_string(&p).unwrap().replace('4', "20");
    std::fs::write(&p, &edited).unwrap();
    let e = dest(&p, false)
        .write_stamped(Stamp::HashComment, b"steps: 1\n")
        .unwrap_err()
        .to_string();
    assert_eq!(
        e,
        format!(
            "-o {}: the file exists and is not a plan mold wrote, or was edited since: pass --force to replace it, or -o another path",
            p.display()
        )
    );
    assert_eq!(std::fs::read_to_string(&p).unwrap(), edited);
    // Forced: replaced.
    dest(&p, true)
        .write_stamped(Stamp::HashComment, b"steps: 1\n")
        .unwrap();
    assert!(std::fs::read_to_string(&p).unwrap().ends_with("steps: 1\n"));
    // A foreign file without a stamp: refused.
    let q = d.join("notes.yaml");
    std::fs::write(&q, "mine: true\n").unwrap();
    assert!(matches!(
        dest(&q, false).check(Mine::Stamped(Stamp::HashComment)),
        Err(FileError::Exists { .. })
    ));
    // A directory: refused even forced.
    assert!(matches!(
        dest(&d, true).check(Mine::Stamped(Stamp::HashComment)),
        Err(FileError::IsDir { .. })
    ));
}

#[test]
fn a_recognised_file_is_replaced_and_another_refused() {
    let d = tempdir("recognised");
    let p = d.join("run.json");
    let is_report = |b: &[u8]| b.starts_with(b"{\"version\"");
    let dest = Dest {
        path: &p,
        flag: "--report",
        what: "run report",
        force_flag: "--overwrite",
        force: false,
    };
    std::fs::write(&p, "{\"version\": 1}").unwrap();
    dest.write(Mine::Recognised(&is_report), b"{\"version\": 2}")
        .unwrap();
    std::fs::write(&p, "[1, 2, 3]").unwrap();
    let e = dest
        .write(Mine::Recognised(&is_report), b"{\"version\": 2}")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("is not a run report mold wrote: pass --overwrite"),
        "{e}"
    );
    assert_eq!(std::fs::read_to_string(&p).unwrap(), "[1, 2, 3]");
}

#[cfg(unix)]
#[test]
fn a_device_is_written_in_place() {
    use std::os::unix::fs::FileTypeExt;
    let null = Path::new("/dev/null");
    dest(null, false)
        .write_stamped(Stamp::HashComment, b"x: 1\n")
        .unwrap();
    assert!(std::fs::metadata(null)
        .unwrap()
        .file_type()
        .is_char_device());
}

#[test]
fn a_directory_with_anything_in_it_is_refused_unless_forced() {
    let d = tempdir("dir");
    let new = d.join("new");
    assert!(check_dir(&new, "--force", false).unwrap().is_empty());
    std::fs::create_dir(&new).unwrap();
    assert!(check_dir(&new, "--force", false).unwrap().is_empty());
    for n in ["a", "b", "c", "d"] {
        std::fs::write(new.join(n), "").unwrap();
    }
    let e = check_dir(&new, "--force", false).unwrap_err().to_string();
    assert_eq!(
        e,
        format!(
            "{}: the directory is not empty (it holds `a`, `b`, `c` and 1 more): pass --force to write into it (files of the same names are replaced; a symlink is replaced by a file, its target left untouched), or name a new or empty directory",
            new.display()
        )
    );
    assert!(check_dir(&new, "--force", true).unwrap().is_empty());
    let f = d.join("file");
    std::fs::write(&f, "").unwrap();
    assert!(matches!(
        check_dir(&f, "--force", true),
        Err(FileError::NotADir { .. })
    ));
}

#[cfg(unix)]
#[test]
fn forced_a_directory_s_symlinks_are_listed_and_a_symlinked_directory_refused() {
    let d = tempdir("links");
    let snap = d.join("snapshot");
    std::fs::create_dir_all(snap.join("vae")).unwrap();
    std::fs::write(d.join("blob"), "weights").unwrap();
    std::os::unix::fs::symlink(d.join("blob"), snap.join("ae.safetensors")).unwrap();
    std::os::unix::fs::symlink(d.join("blob"), snap.join("vae/x.safetensors")).unwrap();
    let links = check_dir(&snap, "--force", true).unwrap();
    assert_eq!(
        links,
        [
            (snap.join("ae.safetensors"), d.join("blob")),
            (snap.join("vae/x.safetensors"), d.join("blob")),
        ]
    );
    std::os::unix::fs::symlink(d.join("elsewhere"), snap.join("t5")).unwrap();
    std::fs::create_dir(d.join("elsewhere")).unwrap();
    let e = check_dir(&snap, "--force", true).unwrap_err().to_string();
    assert!(
        e.starts_with(&format!(
            "{}: a symlink to a directory",
            snap.join("t5").display()
        )),
        "{e}"
    );
}
