use std::io::IsTerminal;

use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::Layer;

fn main() {
    // Output into a pipe that closed (`qarl runs | head -1`) ends the process as it ends `cat` or `ls`,
    // instead of a panic with a backtrace and exit 101: Rust ignores SIGPIPE, so every print then fails.
    #[cfg(unix)]
    // SAFETY: called first, before any thread exists; SIG_DFL is a valid disposition for SIGPIPE.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    // Colour codes only on a terminal: logs redirected to a file or a pipe stay plain text. wgpu's GLES
    // backend logs an error on every machine without a GL driver, also where Vulkan is what runs; RUST_LOG
    // overrides the default filter.
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| "warn,wgpu_hal::gles=off".into());
    let log = tracing_subscriber::fmt::layer()
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr)
        .with_filter(filter);
    // Beside the log, unfiltered: the device failures CubeCL only logs (no result is written after one).
    tracing_subscriber::registry()
        .with(log)
        .with(qarl::device_failures::DeviceFailureLayer::default())
        .init();
    if let Err(e) = qarl::cli::run().and_then(|()| qarl::device_failures::check()) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
