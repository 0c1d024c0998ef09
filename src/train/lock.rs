//! One process per run directory. Two trainers in one directory would interleave their metrics rows and
//! overwrite each other's checkpoints, so the directory holds a lock file while a run uses it: a second
//! process gets an error naming the holder's pid and changes nothing.
//!
//! The exclusion is the operating system's file lock on that file (`flock`), not the file's existence: the
//! kernel releases it when its holder exits however it ends (SIGKILL, a crash), so a lock left behind is
//! taken over by the next run without a check-then-remove step two starting processes could both pass
//! (each removing the other's fresh lock). The pid in the file only names the holder in messages.

use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};

use anyhow::Context;

/// The lock file inside a locked directory.
pub const LOCK_FILE: &str = ".qarl.lock";

/// Held while a run uses its directory; the lock file is removed and the lock released on drop.
#[derive(Debug)]
pub struct RunLock {
    path: PathBuf,
    file: File,
    /// The directory, where this lock created it: removed on drop if nothing else was written there (a
    /// run refused before it wrote anything leaves no empty run directory behind).
    created: Option<PathBuf>,
}

impl RunLock {
    /// Locks `dir` (created when absent) for this process, or says which process holds it. A second
    /// lock of one directory in this process is refused too (each open file is its own holder).
    pub fn acquire(dir: &Path) -> anyhow::Result<Self> {
        let path = dir.join(LOCK_FILE);
        let created = (!dir.exists()).then(|| dir.to_path_buf());
        // A few tries: each failed one found the file (or a lock's own folder, which its holder removes
        // when done: `model_dir`'s staging guard) removed by a holder that was finishing.
        for _ in 0..16 {
            std::fs::create_dir_all(dir)
                .with_context(|| format!("{}: cannot create the directory", dir.display()))?;
            let mut file = match OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(&path)
            {
                Ok(f) => f,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(crate::io::failed(&path, "cannot open the lock file")(e)),
            };
            match file.try_lock() {
                Ok(()) => {}
                Err(TryLockError::WouldBlock) => return Err(in_use(dir, &path)),
                Err(TryLockError::Error(e)) => {
                    return Err(crate::io::failed(
                        &path,
                        "cannot lock the lock file (does this file system support file locks?)",
                    )(e))
                }
            }
            // The holder before us removes the file before it unlocks: a lock on a file no longer under
            // the lock's name locks nothing anyone else sees.
            if !still_named(&file, &path) {
                continue;
            }
            let earlier = read_text(&mut file);
            if let Some(pid) = pid_of(&earlier) {
                // qarl before 2026-12-06 held its lock by the file alone, without a file lock, and wrote a
                // bare pid. Another program under the pid (reused after a crash or a container restart)
                // holds nothing, and neither does a qarl under the pid of a file that says it was
                // file-locked ([`FLOCK_MARK`]): that holder ended, and its pid went to another run.
                if pid != std::process::id() && !earlier.contains(FLOCK_MARK) && is_qarl(pid) {
                    anyhow::bail!(
                        "{}: its lock file {} names process {pid}, a qarl that is running but holds no file \
                         lock: a qarl from before 2026-12-06 at work there (if it is not, delete the lock \
                         file)",
                        dir.display(),
                        path.display()
                    );
                }
                tracing::warn!(lock = %path.display(), pid, "taking over the lock left by a process that ended without releasing its directory");
            }
            write_pid(&mut file, &path)?;
            return Ok(Self {
                path,
                file,
                created,
            });
        }
        anyhow::bail!(
            "{}: cannot lock the directory (its lock file {} keeps changing); is another qarl process starting there?",
            dir.display(),
            path.display()
        )
    }

    /// The lock file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for RunLock {
    fn drop(&mut self) {
        // Removed while still locked, so no process can lock the file between its unlock and its removal
        // and then hold a lock on a name that no longer exists (see `still_named`).
        let _ = std::fs::remove_file(&self.path);
        let _ = self.file.unlock();
        // Only an empty directory goes (`remove_dir`); one a starting holder has just put its lock file
        // in stays, and a holder that finds it gone tries again.
        if let Some(dir) = &self.created {
            let _ = std::fs::remove_dir(dir);
        }
    }
}

/// The error for a directory another holder has locked, naming its pid where the file says it (it is
/// written just after the lock is taken, so for an instant it may not).
fn in_use(dir: &Path, path: &Path) -> anyhow::Error {
    let pid = read_pid(path);
    let holder = pid.map_or("another qarl process".to_string(), |p| {
        format!("another qarl process (pid {p})")
    });
    anyhow::Error::new(InUse).context(format!(
        "{}: in use by {holder}, lock file {}; wait for it to finish or stop it",
        dir.display(),
        path.display()
    ))
}

/// The cause of an error of [`RunLock::acquire`] where another process holds the lock (not a lock file
/// that cannot be made or opened): `err.root_cause().is::<InUse>()`.
#[derive(Debug, thiserror::Error)]
#[error("held by another process")]
pub struct InUse;

/// Whether `path` still names the file `file` has open (the same inode).
fn still_named(file: &File, path: &Path) -> bool {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        match (file.metadata(), std::fs::metadata(path)) {
            (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
            _ => false,
        }
    }
    #[cfg(not(unix))]
    {
        let _ = file;
        path.exists()
    }
}

fn read_text(file: &mut File) -> String {
    let mut text = String::new();
    let _ = file.read_to_string(&mut text);
    text
}

/// What a lock file says after its pid since file locks hold it (2026-12-07): a pid without it was written
/// by a qarl that held its lock by the file alone.
const FLOCK_MARK: &str = "flock";

/// Replaces the file's content with this process's pid and [`FLOCK_MARK`].
fn write_pid(file: &mut File, path: &Path) -> anyhow::Result<()> {
    file.set_len(0)
        .and_then(|()| file.rewind())
        .and_then(|()| writeln!(file, "{} {FLOCK_MARK}", std::process::id()))
        .and_then(|()| file.sync_all())
        .map_err(crate::io::failed(path, "cannot write the lock file"))
}

/// The pid in a lock file (`None` when absent or not a pid).
pub fn read_pid(path: &Path) -> Option<u32> {
    pid_of(&std::fs::read_to_string(path).ok()?)
}

/// The pid a lock file's text starts with: `123` (before file locks) or `123 flock`.
fn pid_of(text: &str) -> Option<u32> {
    text.split_whitespace().next()?.parse().ok()
}

/// Whether process `pid` exists, through `/proc` on Linux; elsewhere no pid counts as alive (the file lock
/// alone then decides).
pub fn is_alive(pid: u32) -> bool {
    let proc = Path::new("/proc");
    cfg!(target_os = "linux") && proc.join("self").exists() && proc.join(pid.to_string()).exists()
}

/// Whether process `pid` is running a program named `qarl...` (its `/proc/PID/comm`, Linux only).
fn is_qarl(pid: u32) -> bool {
    is_alive(pid)
        && std::fs::read_to_string(Path::new("/proc").join(pid.to_string()).join("comm"))
            .is_ok_and(|name| name.trim_end().starts_with("qarl"))
}

#[cfg(test)]
mod tests {
    /// A lock another holder has is told apart from one that cannot be taken at all (callers name the
    /// cause: another warm start, or a folder that cannot be written).
    #[test]
    fn a_held_lock_is_in_use_and_a_lock_that_cannot_be_made_is_not() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("run");
        let held = super::RunLock::acquire(&dir).unwrap();
        let e = super::RunLock::acquire(&dir).unwrap_err();
        assert!(e.root_cause().is::<super::InUse>(), "{e:#}");
        assert!(e.to_string().contains("in use by"), "{e}");
        drop(held);
        // A "directory" under a regular file cannot hold a lock file.
        std::fs::write(tmp.path().join("file"), "x").unwrap();
        let e = super::RunLock::acquire(&tmp.path().join("file/run")).unwrap_err();
        assert!(!e.root_cause().is::<super::InUse>(), "{e:#}");
    }
}
