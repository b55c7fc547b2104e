//! How mold writes a file a user names (`mold plan -o`, `mold exec --out/--save-io/--report`,
//! `mold devices --save`, `mold sim --timeline`, `mold testdata DIR`):
//!
//! - atomically ([`write_with`], [`write_bytes`]): a temporary file beside the
//!   destination, flushed to disk and renamed over it, so an interrupted run leaves the
//!   old file or the new one and a symlink at the destination is replaced, never written
//!   through;
//! - never over a file mold may not replace ([`Dest::check`]): only a file mold wrote
//!   and nobody changed since (its [`Stamp`] matches its bytes), or one its format
//!   recognises as mold's where the format has no room for a stamp, unless the command's
//!   force flag is given;
//! - never into a directory that holds anything ([`check_dir`]) unless forced, and then
//!   never through a symlinked directory.
//!
//! A destination that is no regular file (`/dev/stdout`, a FIFO) is written in place: it
//! holds nothing to lose.

mod atomic;
mod stamp;

pub use atomic::{write_bytes, write_with};
pub use stamp::{is_unchanged, stamp, Stamp, MARK, PLACEHOLDER};

use std::io;
use std::path::{Path, PathBuf};

/// A file larger than this is never read to see whether mold wrote it (mold's own files
/// are far smaller): it is refused unless forced.
const MAX_CHECKED: u64 = 2 << 30;

/// Why mold did not write a file.
#[derive(Debug, thiserror::Error)]
pub enum FileError {
    /// The destination holds a file mold may not replace.
    #[error("{flag} {path}: the file exists and {why}: pass {force} to replace it, or {flag} another path")]
    Exists {
        flag: String,
        path: String,
        why: String,
        force: String,
    },
    /// The destination is a directory.
    #[error("{flag} {path}: a directory; name the file to write in it")]
    IsDir { flag: String, path: String },
    /// A directory to write into holds something already.
    #[error("{dir}: the directory is not empty (it holds {entries}): pass {force} to write into it (files of the same names are replaced; a symlink is replaced by a file, its target left untouched), or name a new or empty directory")]
    NotEmpty {
        dir: String,
        entries: String,
        force: String,
    },
    /// A directory to write into is not a directory.
    #[error("{path}: not a directory; name a new or empty directory")]
    NotADir { path: String },
    /// A symlink to a directory inside a directory to write into.
    #[error("{path}: a symlink to a directory; mold never writes through a symlink: remove it, or name a new or empty directory")]
    SymlinkedDir { path: String },
    /// Content a mold writer made without its stamp's placeholder (mold's mistake).
    #[error("{path}: mold's {what} has no stamp placeholder (a bug in mold: please report it)")]
    NoPlaceholder { path: String, what: String },
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: io::Error,
    },
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> FileError + '_ {
    move |source| FileError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// How mold knows an existing file at a destination as one it may replace unforced.
#[derive(Clone, Copy)]
pub enum Mine<'a> {
    /// Its stamp matches its bytes: mold wrote it and nobody changed it since.
    Stamped(Stamp),
    /// This test accepts its bytes (for a format with no room for a stamp, such as the
    /// run report's JSON, whose schema refuses unknown fields: a file that reads as one).
    Recognised(&'a dyn Fn(&[u8]) -> bool),
}

/// A file a command writes where a user said.
#[derive(Clone, Copy, Debug)]
pub struct Dest<'a> {
    pub path: &'a Path,
    /// The flag that named it, for messages: `-o`, `--report`.
    pub flag: &'a str,
    /// What mold writes there, for messages: `plan`, `run report`.
    pub what: &'a str,
    /// The command's flag that replaces any file: `--force`, `--overwrite`.
    pub force_flag: &'a str,
    /// That flag was given.
    pub force: bool,
}

impl Dest<'_> {
    /// Refuses a destination mold may not write: a directory; an existing regular file
    /// (or symlink) that is not `mine`, unless forced. Reads the existing file (through a
    /// symlink: reading is harmless); writes nothing.
    pub fn check(&self, mine: Mine) -> Result<(), FileError> {
        let path = self.path;
        let meta = match std::fs::symlink_metadata(path) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(io_err(path)(e)),
            Ok(m) => m,
        };
        if meta.is_dir() {
            return Err(FileError::IsDir {
                flag: self.flag.into(),
                path: path.display().to_string(),
            });
        }
        if self.force || atomic::is_special(path) {
            return Ok(());
        }
        let ours = std::fs::metadata(path).is_ok_and(|m| m.len() <= MAX_CHECKED)
            && match (std::fs::read(path), mine) {
                (Ok(b), Mine::Stamped(kind)) => is_unchanged(kind, &b),
                (Ok(b), Mine::Recognised(test)) => test(&b),
                (Err(_), _) => false,
            };
        if ours {
            return Ok(());
        }
        let a = if self
            .what
            .starts_with(['a', 'e', 'i', 'o', 'u', 'A', 'E', 'I', 'O', 'U'])
        {
            "an"
        } else {
            "a"
        };
        let why = match mine {
            Mine::Stamped(_) => format!("is not {a} {} mold wrote, or was edited since", self.what),
            Mine::Recognised(_) => format!("is not {a} {} mold wrote", self.what),
        };
        Err(FileError::Exists {
            flag: self.flag.into(),
            path: path.display().to_string(),
            why,
            force: self.force_flag.into(),
        })
    }

    /// [`Dest::check`]s the destination, then writes `content` there with its stamp,
    /// atomically.
    pub fn write_stamped(&self, kind: Stamp, content: &[u8]) -> Result<(), FileError> {
        self.check(Mine::Stamped(kind))?;
        let bytes = stamp(kind, content).ok_or_else(|| FileError::NoPlaceholder {
            path: self.path.display().to_string(),
            what: self.what.into(),
        })?;
        self.write_unchecked(&bytes)
    }

    /// [`Dest::check`]s the destination against `mine`, then writes `content` there,
    /// atomically.
    pub fn write(&self, mine: Mine, content: &[u8]) -> Result<(), FileError> {
        self.check(mine)?;
        self.write_unchecked(content)
    }

    fn write_unchecked(&self, bytes: &[u8]) -> Result<(), FileError> {
        write_bytes(self.path, bytes).map_err(io_err(self.path))
    }
}

/// Checks a directory mold is about to write files into (`mold testdata DIR`): a new or
/// empty one is fine; one that holds anything is refused unless `force`; forced, a
/// symlink to a directory anywhere inside it is refused (mold would write through it).
/// Returns the symlinks to files inside it, each with its target: writing over one
/// replaces the link, never its target, and the caller says so.
pub fn check_dir(
    dir: &Path,
    force_flag: &str,
    force: bool,
) -> Result<Vec<(PathBuf, PathBuf)>, FileError> {
    let meta = match std::fs::metadata(dir) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io_err(dir)(e)),
        Ok(m) => m,
    };
    if !meta.is_dir() {
        return Err(FileError::NotADir {
            path: dir.display().to_string(),
        });
    }
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map_err(io_err(dir))?
        .map(|e| e.map(|e| e.file_name().to_string_lossy().into_owned()))
        .collect::<io::Result<_>>()
        .map_err(io_err(dir))?;
    if names.is_empty() {
        return Ok(Vec::new());
    }
    if !force {
        names.sort();
        let n = names.len();
        let mut entries = names
            .iter()
            .take(3)
            .map(|s| format!("`{s}`"))
            .collect::<Vec<_>>()
            .join(", ");
        if n > 3 {
            entries.push_str(&format!(" and {} more", n - 3));
        }
        return Err(FileError::NotEmpty {
            dir: dir.display().to_string(),
            entries,
            force: force_flag.into(),
        });
    }
    let mut links = Vec::new();
    walk(dir, 0, &mut links)?;
    links.sort();
    Ok(links)
}

/// The symlinks under `dir` (not followed), refusing one to a directory.
fn walk(dir: &Path, depth: usize, links: &mut Vec<(PathBuf, PathBuf)>) -> Result<(), FileError> {
    // mold writes at most two levels down; deeper trees are not its own.
    if depth > 4 {
        return Ok(());
    }
    for e in std::fs::read_dir(dir).map_err(io_err(dir))? {
        let p = e.map_err(io_err(dir))?.path();
        let m = std::fs::symlink_metadata(&p).map_err(io_err(&p))?;
        if m.file_type().is_symlink() {
            if std::fs::metadata(&p).is_ok_and(|t| t.is_dir()) {
                return Err(FileError::SymlinkedDir {
                    path: p.display().to_string(),
                });
            }
            let target = std::fs::read_link(&p).map_err(io_err(&p))?;
            links.push((p, target));
        } else if m.is_dir() {
            walk(&p, depth + 1, links)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
