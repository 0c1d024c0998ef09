//! What the kernel test binaries share: the wgpu kernels (lavapipe in CI), or a skip.

use cube_kernels::Kernels;
use std::sync::OnceLock;

/// The kernels on the wgpu runtime, made once per test binary, every fresh output filled with NaN
/// ([`Kernels::with_poisoned_outputs`]). Without a Vulkan driver the tests skip with
/// a message, unless `QARL_REQUIRE_WGPU=1` (CI sets it after installing lavapipe), where a missing
/// adapter fails them.
pub fn kernels() -> Option<&'static Kernels> {
    static K: OnceLock<Option<Kernels>> = OnceLock::new();
    K.get_or_init(|| {
        // Outputs start as NaN, so a value a kernel fails to write cannot pass as a freed buffer's bits.
        let made =
            std::panic::catch_unwind(|| Kernels::wgpu().map(|k| k.with_poisoned_outputs(true)));
        match made {
            Ok(Ok(k)) => {
                eprintln!("wgpu adapter: {}", k.device_name());
                Some(k)
            }
            other => {
                let why = match other {
                    Ok(Err(e)) => e.to_string(),
                    _ => "the wgpu runtime panicked while starting".to_owned(),
                };
                if std::env::var("QARL_REQUIRE_WGPU").is_ok_and(|v| v == "1") {
                    panic!("QARL_REQUIRE_WGPU=1 but no wgpu device: {why}");
                }
                eprintln!(
                    "SKIPPED: no wgpu device ({why}); install mesa-vulkan-drivers for lavapipe"
                );
                None
            }
        }
    })
    .as_ref()
}
