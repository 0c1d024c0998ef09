use std::io::IsTerminal;

fn main() {
    // Colour codes only on a terminal: logs redirected to a file or a pipe stay plain text.
    tracing_subscriber::fmt()
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    if let Err(e) = qarl::cli::run() {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
