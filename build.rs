//! Records the commit the binary is built from (`QARL_BUILD_COMMIT`): checkpoints keep it, so that a resume
//! under other code (which may sum or sample otherwise) is said, and `qarl --version` prints it. Read from
//! `.git` itself, so that a build without the git program (a container) still knows it; "unknown" where the
//! sources are not a git checkout (a packaged copy). `-dirty` follows it where the sources that make the
//! binary differ from that commit (asked of the git program where there is one): such a build holds code
//! no commit names.

use std::path::Path;

/// What the binary is built from: a change to any of them may change the code, or its commit.
const SOURCES: [&str; 5] = [
    "src",
    "cube_kernels/src",
    "build.rs",
    "Cargo.toml",
    "Cargo.lock",
];

fn main() {
    for watched in [
        ".git/HEAD",
        ".git/refs/heads",
        ".git/packed-refs",
        ".git/index",
    ] {
        println!("cargo:rerun-if-changed={watched}");
    }
    for source in SOURCES {
        println!("cargo:rerun-if-changed={source}");
    }
    let commit = head_commit(Path::new(".git")).unwrap_or_else(|| "unknown".into());
    let dirty = if commit != "unknown" && sources_differ_from_head() {
        "-dirty"
    } else {
        ""
    };
    println!("cargo:rustc-env=QARL_BUILD_COMMIT={commit}{dirty}");
}

/// Whether the tracked sources differ from `HEAD` (`git diff --quiet` exits 1); false where git cannot say.
fn sources_differ_from_head() -> bool {
    std::process::Command::new("git")
        .args(["diff", "--quiet", "HEAD", "--"])
        .args(SOURCES)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.code() == Some(1))
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
