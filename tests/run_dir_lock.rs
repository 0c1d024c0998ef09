//! One process per run directory: a second `qarl train` / `qarl sft` / `qarl experiment` on a directory in use
//! exits with an error naming the holder's pid and changes nothing; a lock left by a dead process is taken over.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::tiny_train_toml;
use qarl::train::lock::{self, RunLock};

/// Every file under `dir` with its bytes.
fn snapshot(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.insert(p.clone(), std::fs::read(&p).unwrap());
            }
        }
    }
    out
}

fn qarl(dir: &Path, args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_qarl"))
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap()
}

#[test]
fn a_second_process_on_a_locked_run_directory_exits_and_changes_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    std::fs::write(
        tmp.path().join("run.toml"),
        tiny_train_toml(tmp.path(), "aligned", 1),
    )
    .unwrap();
    std::fs::create_dir_all(&run).unwrap();
    std::fs::write(run.join("metrics.jsonl"), "{\"phase\":\"rl\",\"step\":0}\n").unwrap();
    std::fs::write(
        tmp.path().join("exp.toml"),
        "name = \"x\"\nbase = \"run.toml\"\nseeds = [1]\nresults_dir = \"run\"\n\
         [[variant]]\nname = \"a\"\n",
    )
    .unwrap();
    let held = RunLock::acquire(&run).unwrap();
    let me = std::process::id();
    let before = snapshot(tmp.path());
    for args in [
        &["train", "--quiet", "--config", "run.toml"][..],
        &["train", "--quiet", "--resume", "--config", "run.toml"],
        &["sft", "--quiet", "--config", "run.toml"],
        &["experiment", "--quiet", "exp.toml"],
    ] {
        let out = qarl(tmp.path(), args);
        let err = String::from_utf8_lossy(&out.stderr);
        println!("qarl {}: {err}", args.join(" "));
        assert!(
            !out.status.success(),
            "qarl {args:?} ran in a locked directory"
        );
        assert!(
            err.contains(&format!("pid {me}")) && err.contains("in use"),
            "qarl {args:?}: {err}"
        );
        assert_eq!(snapshot(tmp.path()), before, "qarl {args:?} changed files");
    }
    assert!(!tmp.path().join("model").exists());
    // In-process as well (the same pid counts as a holder).
    let err = format!("{:#}", RunLock::acquire(&run).unwrap_err());
    assert!(err.contains(&format!("pid {me}")), "{err}");
    drop(held);
    assert!(!run.join(lock::LOCK_FILE).exists(), "the lock file stayed");
    let again = RunLock::acquire(&run).unwrap();
    assert_eq!(lock::read_pid(again.path()), Some(me));
}

#[test]
fn a_lock_left_by_a_dead_process_is_taken_over() {
    let tmp = tempfile::tempdir().unwrap();
    let mut child = Command::new("true").spawn().unwrap();
    let dead = child.id();
    child.wait().unwrap();
    assert!(!lock::is_alive(dead), "pid {dead} still exists");
    std::fs::write(tmp.path().join(lock::LOCK_FILE), format!("{dead}\n")).unwrap();
    let l = RunLock::acquire(tmp.path()).unwrap();
    assert_eq!(lock::read_pid(l.path()), Some(std::process::id()));
    drop(l);
    // A lock with this process's own pid that this process does not hold: left by an earlier process
    // with the same pid (pids start over when a container restarts).
    let me = std::process::id();
    std::fs::write(tmp.path().join(lock::LOCK_FILE), format!("{me}\n")).unwrap();
    let l = RunLock::acquire(tmp.path()).unwrap();
    assert_eq!(lock::read_pid(l.path()), Some(me));
    drop(l);
    // An unreadable lock file (not a pid) is taken over too.
    std::fs::write(tmp.path().join(lock::LOCK_FILE), "").unwrap();
    let l = RunLock::acquire(tmp.path()).unwrap();
    assert_eq!(lock::read_pid(l.path()), Some(std::process::id()));
    // Nothing but the lock is left in the directory (no temporary files).
    let names: Vec<String> = std::fs::read_dir(tmp.path())
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().to_string())
        .collect();
    assert_eq!(names, vec![lock::LOCK_FILE.to_string()]);
    drop(l);
    #[cfg(target_os = "linux")]
    refuses_only_a_running_qarl(tmp.path());
}

/// Spawns a program this test has just copied: while the copy was open for writing, a child that
/// another test thread forked may have inherited the descriptor, and until that child execs, running the
/// copy fails with "Text file busy" (ETXTBSY; CI met it once). Retried for up to 5 s.
#[cfg(target_os = "linux")]
fn spawn_copied(cmd: &mut Command) -> std::process::Child {
    for _ in 0..100 {
        match cmd.spawn() {
            Err(e) if e.kind() == std::io::ErrorKind::ExecutableFileBusy => {
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
            other => return other.unwrap(),
        }
    }
    cmd.spawn().unwrap()
}

/// A lock file naming a running qarl that holds no file lock (one from before file locks) is refused, not
/// taken over, and left as it was; another program under that pid (reused after a crash) is no holder.
/// Linux only: the program's name comes from `/proc`.
#[cfg(target_os = "linux")]
fn refuses_only_a_running_qarl(dir: &Path) {
    let bin = tempfile::tempdir().unwrap();
    let old_qarl = bin.path().join("qarl-old");
    std::fs::copy(which_sleep(), &old_qarl).unwrap();
    for (program, refused) in [(old_qarl, true), (which_sleep(), false)] {
        let mut holder = spawn_copied(Command::new(&program).arg("30"));
        // Until the child runs its program (a holder in earnest has run for a while).
        let name = program.file_name().unwrap().to_str().unwrap();
        let comm = format!("/proc/{}/comm", holder.id());
        for _ in 0..100 {
            if std::fs::read_to_string(&comm).is_ok_and(|c| c.trim_end() == name) {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let text = format!("{}\n", holder.id());
        std::fs::write(dir.join(lock::LOCK_FILE), &text).unwrap();
        let got = RunLock::acquire(dir);
        holder.kill().unwrap();
        holder.wait().unwrap();
        match got {
            Err(e) => {
                let err = format!("{e:#}");
                assert!(refused, "{program:?}: {err}");
                assert!(
                    err.contains(&format!(
                        "names process {}, a qarl that is running",
                        holder.id()
                    )),
                    "{err}"
                );
                let left = std::fs::read_to_string(dir.join(lock::LOCK_FILE)).unwrap();
                assert_eq!(left, text);
            }
            Ok(l) => {
                assert!(!refused, "{program:?} was taken over");
                assert_eq!(lock::read_pid(l.path()), Some(std::process::id()));
            }
        }
    }
    // A lock file written under a file lock names a qarl that ended: a running qarl that got its pid
    // since (another run) holds nothing here, and the lock is taken over.
    let qarl = bin.path().join("qarl-other-run");
    std::fs::copy(which_sleep(), &qarl).unwrap();
    let mut other = spawn_copied(Command::new(&qarl).arg("30"));
    let comm = format!("/proc/{}/comm", other.id());
    for _ in 0..100 {
        if std::fs::read_to_string(&comm).is_ok_and(|c| c.trim_end() == "qarl-other-run") {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    std::fs::write(dir.join(lock::LOCK_FILE), format!("{} flock\n", other.id())).unwrap();
    let got = RunLock::acquire(dir);
    other.kill().unwrap();
    other.wait().unwrap();
    let l = got.unwrap();
    assert_eq!(lock::read_pid(l.path()), Some(std::process::id()));
    assert!(std::fs::read_to_string(l.path()).unwrap().contains("flock"));
}

/// The `sleep` program's path.
#[cfg(target_os = "linux")]
fn which_sleep() -> PathBuf {
    ["/usr/bin/sleep", "/bin/sleep"]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())
        .expect("a sleep program")
}

/// Runs starting at once in a directory whose lock a killed run left behind: exactly one of them takes it
/// (a check-then-remove takeover let a second one remove the first one's fresh lock and run beside it).
#[test]
fn runs_starting_at_once_take_a_stale_lock_one_at_a_time() {
    let tmp = tempfile::tempdir().unwrap();
    for round in 0..20 {
        std::fs::write(tmp.path().join(lock::LOCK_FILE), "4194303\n").unwrap();
        let start = std::sync::Barrier::new(8);
        let held = std::sync::atomic::AtomicUsize::new(0);
        let most = std::sync::atomic::AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..8 {
                s.spawn(|| {
                    start.wait();
                    if let Ok(l) = RunLock::acquire(tmp.path()) {
                        let now = held.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
                        most.fetch_max(now, std::sync::atomic::Ordering::SeqCst);
                        std::thread::sleep(std::time::Duration::from_millis(20));
                        held.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
                        drop(l);
                    }
                });
            }
        });
        assert_eq!(
            most.load(std::sync::atomic::Ordering::SeqCst),
            1,
            "round {round}: two holders at once"
        );
        assert!(!tmp.path().join(lock::LOCK_FILE).exists(), "round {round}");
    }
}

/// A directory the lock created goes with the lock where nothing else was written in it (a run refused
/// before it wrote anything leaves no empty run directory); one that held something, or existed before,
/// stays.
#[test]
fn a_run_directory_the_lock_made_goes_with_it_when_empty() {
    let tmp = tempfile::tempdir().unwrap();
    let new = tmp.path().join("runs/new");
    drop(RunLock::acquire(&new).unwrap());
    assert!(!new.exists());
    assert!(tmp.path().join("runs").is_dir());
    let used = tmp.path().join("runs/used");
    let l = RunLock::acquire(&used).unwrap();
    std::fs::write(used.join("config.json"), "{}").unwrap();
    drop(l);
    assert!(used.join("config.json").is_file());
    let existing = tmp.path().join("runs/existing");
    std::fs::create_dir_all(&existing).unwrap();
    drop(RunLock::acquire(&existing).unwrap());
    assert!(existing.is_dir());
}
