//! One process per run directory. Two trainers in one directory would interleave their metrics rows and
//! overwrite each other's checkpoints, so the directory holds a lock file with the holder's pid while a run
//! uses it: a second process gets an error naming that pid and changes nothing, and a lock left by a process
//! that no longer exists (killed with SIGKILL, a crashed machine) is taken over.
//!
//! The lock file appears with its content in one step (written to a temporary file, then hard-linked under
//! the lock's name, which fails when the name exists), so a reader never sees an empty lock.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::Context;

/// The lock file inside a locked directory.
pub const LOCK_FILE: &str = ".qarl.lock";

/// Held while a run uses its directory; the lock file is removed on drop.
#[derive(Debug)]
pub struct RunLock {
    path: PathBuf,
    pid: u32,
}

impl RunLock {
    /// Locks `dir` (created when absent) for this process, or says which process holds it.
    pub fn acquire(dir: &Path) -> anyhow::Result<Self> {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("{}: cannot create the directory", dir.display()))?;
        let path = dir.join(LOCK_FILE);
        let me = std::process::id();
        // A few tries: each failed one removed a stale lock or waited for one being written.
        for _ in 0..16 {
            if try_create(dir, &path, me)? {
                held_here().push(path.clone());
                return Ok(Self { path, pid: me });
            }
            match read_pid(&path) {
                // Our own pid on a lock this process does not hold: a lock left by an earlier process
                // that had the same pid (a container restarted: pids start over).
                Some(pid) if pid == me && !held_here().contains(&path) => {
                    tracing::warn!(lock = %path.display(), pid, "taking over a lock left by an earlier process with this process's pid");
                    remove_stale(&path)?;
                }
                Some(pid) if is_alive(pid) => anyhow::bail!(
                    "{}: in use by another qarl process (pid {pid}, lock file {}); wait for it to finish or stop \
                     it (if no process {pid} is running, delete the lock file)",
                    dir.display(),
                    path.display()
                ),
                Some(pid) => {
                    tracing::warn!(lock = %path.display(), pid, "taking over the lock of a process that no longer runs");
                    remove_stale(&path)?;
                }
                None if is_young(&path) => {
                    // Perhaps being written right now (a file system without hard links): look again.
                    std::thread::sleep(std::time::Duration::from_millis(200));
                }
                None if path.exists() => {
                    tracing::warn!(lock = %path.display(), "taking over an unreadable lock file");
                    remove_stale(&path)?;
                }
                None => {} // released between our two looks: try again
            }
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

/// The lock files this process holds: what tells our own live lock from a stale one with our pid.
fn held_here() -> std::sync::MutexGuard<'static, Vec<PathBuf>> {
    static HELD: std::sync::Mutex<Vec<PathBuf>> = std::sync::Mutex::new(Vec::new());
    HELD.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Drop for RunLock {
    fn drop(&mut self) {
        held_here().retain(|p| p != &self.path);
        // Only our own lock: never one another process took over in the meantime.
        if read_pid(&self.path) == Some(self.pid) {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Creates the lock file holding `pid`; false when it already exists.
fn try_create(dir: &Path, path: &Path, pid: u32) -> anyhow::Result<bool> {
    let mut tmp = tempfile::Builder::new()
        .prefix(".qarl.lock-")
        .tempfile_in(dir)
        .with_context(|| format!("{}: cannot create the lock file", dir.display()))?;
    writeln!(tmp, "{pid}")
        .and_then(|()| tmp.as_file().sync_all())
        .with_context(|| format!("{}: cannot write the lock file", dir.display()))?;
    match std::fs::hard_link(tmp.path(), path) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(false),
        // A file system without hard links: create the lock in place (a reader may then, for an instant,
        // see it empty; an empty lock is taken over only once it is a second old, see `is_young`).
        Err(_) => create_in_place(path, pid),
    }
}

fn create_in_place(path: &Path, pid: u32) -> anyhow::Result<bool> {
    match std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(path)
    {
        Ok(mut f) => {
            writeln!(f, "{pid}")
                .and_then(|()| f.sync_all())
                .map_err(crate::io::failed(path, "cannot write the lock file"))?;
            Ok(true)
        }
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(false),
        Err(e) => Err(crate::io::failed(path, "cannot create the lock file")(e)),
    }
}

fn remove_stale(path: &Path) -> anyhow::Result<()> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(crate::io::failed(path, "cannot remove the stale lock file")(e)),
    }
}

/// Whether a lock file was modified less than a second ago.
fn is_young(path: &Path) -> bool {
    std::fs::metadata(path)
        .and_then(|m| m.modified())
        .ok()
        .and_then(|t| t.elapsed().ok())
        .is_some_and(|age| age < std::time::Duration::from_secs(1))
}

/// The pid in a lock file (`None` when absent or not a pid).
pub fn read_pid(path: &Path) -> Option<u32> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// Whether process `pid` exists. On Linux through `/proc`; elsewhere every pid counts as alive (a stale lock
/// is then deleted by hand, as the error says).
pub fn is_alive(pid: u32) -> bool {
    if pid == std::process::id() {
        return true;
    }
    let proc = Path::new("/proc");
    if cfg!(target_os = "linux") && proc.join("self").exists() {
        return proc.join(pid.to_string()).exists();
    }
    true
}
