//! Atomic writes: a temporary file beside the destination, written, flushed to disk and
//! renamed over it. A rename replaces the destination's directory entry, so a symlink
//! there is replaced by the new file and its target is never written; a run interrupted
//! at any point leaves the old file or the new one, never part of one (the temporary
//! file is removed on every error; only a killed process can leave one behind, under a
//! hidden name beside the destination). A destination that is no regular file once links
//! are followed (`/dev/stdout`, a FIFO) is written in place: it holds nothing to lose,
//! and replacing it would be wrong.

#[cfg(unix)]
use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::Path;

/// Writes `path` with what `write` puts into its writer: through a temporary file in the
/// same directory (`.NAME.XXXXXX.tmp`), flushed to disk, then renamed over `path`. An
/// error from `write` (or from the disk) leaves `path` as it was and no temporary file.
/// The new file keeps the permissions of a regular file it replaces; otherwise it gets
/// the process's default (0666 less the umask).
pub fn write_with(
    path: &Path,
    write: impl FnOnce(&mut dyn Write) -> io::Result<()>,
) -> io::Result<()> {
    if is_special(path) {
        let f = std::fs::OpenOptions::new().write(true).open(path)?;
        let mut w = BufWriter::new(f);
        write(&mut w)?;
        return w.flush();
    }
    let name = path.file_name().ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            "not a file name (it ends in `..` or `/`)",
        )
    })?;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let mut builder = tempfile::Builder::new();
    let prefix = format!(".{}.", name.to_string_lossy());
    builder.prefix(&prefix).suffix(".tmp");
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        // tempfile's own default is 0600: a file mold writes is as readable as any other.
        builder.permissions(std::fs::Permissions::from_mode(0o666));
    }
    let tmp = builder.tempfile_in(dir)?;
    // A regular file replaced keeps its mode (a symlink's target is not looked at).
    if let Ok(m) = std::fs::symlink_metadata(path) {
        if m.is_file() {
            tmp.as_file().set_permissions(m.permissions())?;
        }
    }
    let mut w = BufWriter::with_capacity(1 << 20, tmp);
    write(&mut w)?;
    let tmp = w.into_inner().map_err(|e| e.into_error())?;
    tmp.as_file().sync_all()?;
    tmp.persist(path).map_err(|e| e.error)?;
    sync_dir(dir);
    Ok(())
}

/// A destination that exists and is neither a regular file nor a directory once links
/// are followed (`/dev/stdout`, `/dev/null`, a FIFO).
pub(crate) fn is_special(path: &Path) -> bool {
    std::fs::metadata(path).is_ok_and(|m| !m.is_file() && !m.is_dir())
}

/// [`write_with`] for bytes already in memory.
pub fn write_bytes(path: &Path, bytes: &[u8]) -> io::Result<()> {
    write_with(path, |w| w.write_all(bytes))
}

/// Flushes the directory entry of a rename to disk (best effort: not every filesystem
/// lets a directory be opened or synced, and the rename itself has happened).
fn sync_dir(dir: &Path) {
    #[cfg(unix)]
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
    #[cfg(not(unix))]
    let _ = dir;
}
