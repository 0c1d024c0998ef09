//! `qarl config show`: the resolved training config (file or default, plus `--set` overrides), validated.

use std::path::PathBuf;

use crate::train;

#[derive(Debug, clap::Args)]
pub struct ConfigArgs {
    #[command(subcommand)]
    pub command: ConfigCommand,
}

#[derive(Debug, clap::Subcommand)]
pub enum ConfigCommand {
    /// Print the resolved config as TOML (every default filled in; a comment names the options left off),
    /// after validation.
    Show(ShowArgs),
}

#[derive(Debug, clap::Args)]
pub struct ShowArgs {
    /// `default` (the embedded configs/default.toml) or the path of a TOML config.
    pub name: Option<String>,
    /// The path of a TOML config (same as giving it as NAME).
    #[arg(long, conflicts_with = "name")]
    pub config: Option<PathBuf>,
    /// Override one value, e.g. `--set rollout.precision=int4-g128` (validated like the file).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
}

pub fn run(args: ConfigArgs) -> anyhow::Result<()> {
    match args.command {
        ConfigCommand::Show(a) => show(a),
    }
}

fn show(a: ShowArgs) -> anyhow::Result<()> {
    let path = match (a.config, a.name.as_deref()) {
        (Some(p), _) => Some(p),
        (None, None | Some("default")) => None,
        (None, Some(name)) => {
            let p = PathBuf::from(name);
            if p.is_dir() {
                anyhow::bail!(
                    "{name}: is a folder; NAME is `default` or the path of a TOML config file"
                );
            }
            if !p.is_file() {
                anyhow::bail!(
                    "{name}: no such config file (NAME is `default` or the path of a TOML config)"
                );
            }
            Some(p)
        }
    };
    let cfg = train::load_config(path.as_deref(), &a.set)?;
    let origin = path.as_ref().map_or("the default config".to_string(), |p| {
        p.display().to_string()
    });
    println!("# resolved from {origin}");
    for s in &a.set {
        println!("# --set {s}");
    }
    let unset = cfg.unset_options();
    if !unset.is_empty() {
        println!("# off, so not printed: {}", unset.join(", "));
    }
    print!("{}", toml::to_string_pretty(&cfg.with_defaults())?);
    Ok(())
}
