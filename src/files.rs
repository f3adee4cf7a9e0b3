//! Output files are written whole or not at all.

use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// Paths being written right now (temporary files, partial folders): what an
/// interrupted process must remove so that nothing half-written stays behind.
static UNFINISHED: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// A temporary file or folder that is removed unless [`Unfinished::finish`]
/// is called: on an error or a panic (drop), and on SIGINT/SIGTERM when the
/// program calls [`remove_unfinished`] from its signal handler (the `sieve`
/// binary does; a library user decides for their own process).
pub struct Unfinished(Option<PathBuf>);

impl Unfinished {
    pub fn new(path: PathBuf) -> Self {
        lock_unfinished().push(path.clone());
        Unfinished(Some(path))
    }

    /// The path is complete (renamed into place): keep it.
    pub fn finish(mut self) {
        if let Some(p) = self.0.take() {
            lock_unfinished().retain(|q| *q != p);
        }
    }
}

impl Drop for Unfinished {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            lock_unfinished().retain(|q| *q != p);
            // Best effort: the original error matters more than a cleanup failure.
            remove_path(&p);
        }
    }
}

fn lock_unfinished() -> std::sync::MutexGuard<'static, Vec<PathBuf>> {
    // A panic while holding the lock leaves a list that is still valid.
    UNFINISHED.lock().unwrap_or_else(|e| e.into_inner())
}

fn remove_path(p: &Path) {
    if std::fs::symlink_metadata(p).is_ok_and(|m| m.is_dir()) {
        let _ = std::fs::remove_dir_all(p);
    } else {
        let _ = std::fs::remove_file(p);
    }
}

/// Removes every unfinished output (call from a SIGINT/SIGTERM handler,
/// then exit).
pub fn remove_unfinished() {
    for p in lock_unfinished().drain(..) {
        remove_path(&p);
    }
}

/// Writes `bytes` to `path` atomically (a temporary file beside it, flushed
/// to disk, then renamed into place), so that no half-written output is ever
/// left behind and a failure leaves the old file as it was.
///
/// What `path` may be: a new name, or an existing regular file (replaced), or
/// a symbolic link to a regular file (the file it points to is replaced, the
/// link stays). Anything else (a directory, a device such as /dev/full, a
/// FIFO, a dangling link) is refused with an error naming it. On a write
/// error (a full disk, say) the temporary file is removed.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let target = output_target(path)?;
    let name = target
        .file_name()
        .with_context(|| format!("{} names no file", path.display()))?;
    let mut tmp_name = name.to_os_string();
    tmp_name.push(format!(".partial-{}", std::process::id()));
    let tmp = target.with_file_name(tmp_name);
    let mut f =
        std::fs::File::create(&tmp).with_context(|| format!("writing {}", path.display()))?;
    // Registered once it is ours: on an error it goes with `unfinished`.
    let unfinished = Unfinished::new(tmp.clone());
    let written = (|| -> std::io::Result<()> {
        use std::io::Write;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, &target)
    })();
    written.map_err(|e| {
        crate::error::tagged(
            crate::error::ErrorKind::Io,
            format!("writing {}: {e}", path.display()),
        )
    })?;
    unfinished.finish();
    Ok(())
}

/// Checks, before any work, that [`write_atomic`] could write `path` (a new
/// name, a regular file, or a link to one), naming `what` it is for.
pub fn check_output(path: &Path, what: &str) -> Result<()> {
    output_target(path)
        .map(|_| ())
        .with_context(|| what.to_string())
}

/// The file an output written to `path` replaces (see [`write_atomic`]).
fn output_target(path: &Path) -> Result<PathBuf> {
    let meta = match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(path.to_path_buf()),
        Err(e) => return Err(e).with_context(|| format!("cannot inspect {}", path.display())),
        Ok(m) => m,
    };
    if meta.file_type().is_symlink() {
        let real = std::fs::canonicalize(path).with_context(|| {
            format!(
                "{} is a symbolic link to nothing; refusing to write through it",
                path.display()
            )
        })?;
        if std::fs::metadata(&real).is_ok_and(|m| m.is_file()) {
            return Ok(real);
        }
        bail!(
            "{} is a symbolic link to {}, which is not a regular file; refusing to write there",
            path.display(),
            real.display()
        );
    }
    if !meta.is_file() {
        bail!(
            "{} exists and is not a regular file (a directory, device or FIFO); refusing to replace it",
            path.display()
        );
    }
    Ok(path.to_path_buf())
}

/// A folder given explicitly, else named by the environment variable `env`,
/// else `rel` in the working directory or in the sieve repository, if it holds
/// `marker` (how the default model and the evaluation data are found).
pub fn locate(explicit: Option<&Path>, env: &str, rel: &str, marker: &str) -> Option<PathBuf> {
    if let Some(p) = explicit {
        return Some(p.to_path_buf());
    }
    if let Ok(p) = std::env::var(env) {
        return Some(PathBuf::from(p));
    }
    [
        PathBuf::from("."),
        PathBuf::from(env!("CARGO_MANIFEST_DIR")),
    ]
    .into_iter()
    .map(|base| base.join(rel))
    .find(|p| p.join(marker).exists())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("sieve-files-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn leftovers(dir: &Path) -> Vec<String> {
        std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
            .filter(|n| n.contains(".partial-"))
            .collect()
    }

    #[test]
    fn writes_new_and_replaces_regular_files() {
        let d = scratch("regular");
        let f = d.join("out.npy");
        write_atomic(&f, b"one").unwrap();
        write_atomic(&f, b"two").unwrap();
        assert_eq!(std::fs::read(&f).unwrap(), b"two");
        assert!(leftovers(&d).is_empty());
    }

    #[test]
    fn refuses_directories_devices_and_dangling_links() {
        let d = scratch("refuse");
        let e = write_atomic(&d, b"x").unwrap_err().to_string();
        assert!(e.contains("not a regular file"), "{e}");
        #[cfg(unix)]
        {
            let full = Path::new("/dev/full");
            if full.exists() {
                let e = write_atomic(full, b"x").unwrap_err().to_string();
                assert!(
                    e.contains("/dev/full") && e.contains("not a regular file"),
                    "{e}"
                );
                assert!(full.exists());
            }
            let link = d.join("dangling");
            std::os::unix::fs::symlink(d.join("nowhere"), &link).unwrap();
            let e = write_atomic(&link, b"x").unwrap_err().to_string();
            assert!(e.contains("symbolic link"), "{e}");
            let to_dev = d.join("to-null");
            std::os::unix::fs::symlink("/dev/null", &to_dev).unwrap();
            let e = write_atomic(&to_dev, b"x").unwrap_err().to_string();
            assert!(e.contains("not a regular file"), "{e}");
            assert!(std::fs::symlink_metadata(&to_dev)
                .unwrap()
                .file_type()
                .is_symlink());
        }
        assert!(leftovers(&d).is_empty());
    }

    /// A FIFO is refused (writing would block on it, or feed a reader half
    /// a file), and stays a FIFO.
    #[cfg(unix)]
    #[test]
    fn refuses_fifos() {
        use std::os::unix::fs::FileTypeExt;
        let d = scratch("fifo");
        let fifo = d.join("pipe");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status();
        if !made.is_ok_and(|s| s.success()) {
            eprintln!("note: no mkfifo here; skipped");
            return;
        }
        let e = write_atomic(&fifo, b"x").unwrap_err().to_string();
        assert!(e.contains("not a regular file"), "{e}");
        assert!(check_output(&fifo, "--out").is_err());
        assert!(std::fs::symlink_metadata(&fifo)
            .unwrap()
            .file_type()
            .is_fifo());
        assert!(leftovers(&d).is_empty());
    }

    /// A link to a regular file: the file gets the new bytes, the link stays.
    #[cfg(unix)]
    #[test]
    fn follows_links_to_regular_files() {
        let d = scratch("link");
        let real = d.join("real.json");
        std::fs::write(&real, b"old").unwrap();
        let link = d.join("link.json");
        std::os::unix::fs::symlink(&real, &link).unwrap();
        write_atomic(&link, b"new").unwrap();
        assert_eq!(std::fs::read(&real).unwrap(), b"new");
        assert!(std::fs::symlink_metadata(&link)
            .unwrap()
            .file_type()
            .is_symlink());
        assert!(leftovers(&d).is_empty());
    }

    /// A failed write keeps the old file and leaves no temporary file.
    #[test]
    fn a_failed_write_keeps_the_old_file() {
        let d = scratch("fail");
        let f = d.join("keep.txt");
        std::fs::write(&f, b"old").unwrap();
        // The temporary file cannot be created: its name is taken by a folder.
        let tmp = d.join(format!("keep.txt.partial-{}", std::process::id()));
        std::fs::create_dir(&tmp).unwrap();
        assert!(write_atomic(&f, b"new").is_err());
        assert_eq!(std::fs::read(&f).unwrap(), b"old");
        std::fs::remove_dir(&tmp).unwrap();
    }
}
