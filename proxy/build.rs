//! Records the commit the binary is built from, for `kvmesh-proxy --version`.

use std::path::Path;
use std::process::Command;

fn main() {
    // An image build has no .git: it passes the hash in (Dockerfile `GIT_HASH`).
    println!("cargo:rerun-if-env-changed=KVMESH_GIT_HASH");
    let from_env = std::env::var("KVMESH_GIT_HASH")
        .ok()
        .filter(|s| !s.trim().is_empty());
    let hash = from_env
        .or_else(|| {
            Command::new("git")
                .args(["rev-parse", "--short=12", "HEAD"])
                .output()
                .ok()
                .filter(|o| o.status.success())
                .and_then(|o| String::from_utf8(o.stdout).ok())
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty())
        })
        .unwrap_or_else(|| "unknown commit".to_string());
    println!("cargo:rustc-env=KVMESH_GIT_HASH={hash}");
    // Rebuilt when HEAD moves: a checkout changes HEAD, a commit changes the branch it names.
    let git = Path::new("../.git");
    println!("cargo:rerun-if-changed=../.git/HEAD");
    if let Ok(head) = std::fs::read_to_string(git.join("HEAD")) {
        if let Some(r) = head.trim().strip_prefix("ref: ") {
            // (A path that does not exist would make every build rerun this script.)
            for path in [r, "packed-refs"] {
                if git.join(path).exists() {
                    println!("cargo:rerun-if-changed=../.git/{path}");
                }
            }
        }
    }
}
