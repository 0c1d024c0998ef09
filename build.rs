//! Records the commit the binary is built from (`QARL_BUILD_COMMIT`): checkpoints keep it, so that a resume
//! under other code (which may sum or sample otherwise) is said, and `qarl --version` prints it. "unknown"
//! where the sources are not a git checkout (a packaged copy).

fn main() {
    println!("cargo:rerun-if-changed=.git/HEAD");
    println!("cargo:rerun-if-changed=.git/refs/heads");
    println!("cargo:rerun-if-changed=.git/packed-refs");
    let commit = std::process::Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .filter(|c| !c.is_empty())
        .unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=QARL_BUILD_COMMIT={commit}");
}
