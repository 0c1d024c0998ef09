//! Records the commit the binary is built from (`QARL_BUILD_COMMIT`): checkpoints keep it, so that a resume
//! under other code (which may sum or sample otherwise) is said, and `qarl --version` prints it. Read from
//! `.git` itself, so that a build without the git program (a container) still knows it; "unknown" where the
//! sources are not a git checkout (a packaged copy).

use std::path::Path;

fn main() {
    for watched in [".git/HEAD", ".git/refs/heads", ".git/packed-refs"] {
        println!("cargo:rerun-if-changed={watched}");
    }
    let commit = head_commit(Path::new(".git")).unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=QARL_BUILD_COMMIT={commit}");
}

/// The commit `HEAD` names: a detached hash, or the hash of the branch it points at (a loose ref file or a
/// line of `packed-refs`), shortened to 12 hex digits.
fn head_commit(git: &Path) -> Option<String> {
    let head = std::fs::read_to_string(git.join("HEAD")).ok()?;
    let head = head.trim();
    let hash = match head.strip_prefix("ref: ") {
        None => head.to_string(),
        Some(name) => match std::fs::read_to_string(git.join(name)) {
            Ok(hash) => hash.trim().to_string(),
            Err(_) => std::fs::read_to_string(git.join("packed-refs"))
                .ok()?
                .lines()
                .find_map(|l| l.strip_suffix(name)?.strip_suffix(' ').map(str::to_string))?,
        },
    };
    let valid = hash.len() >= 12 && hash.bytes().all(|b| b.is_ascii_hexdigit());
    valid.then(|| hash[..12].to_string())
}
