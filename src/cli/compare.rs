//! `qarl compare`: two arms' greedy evaluations on the same problems, compared by problem
//! (`train::compare`).

use crate::train::compare::{check_identical, compare_arms, Arm, Evaluation};

#[derive(Debug, clap::Args)]
pub struct CompareArgs {
    /// Arm A's evaluations, one per seed: `qarl eval --output` files or run directories (a run's held-out
    /// evaluation at its end, step `train.steps`: a run not finished is refused; `DIR@last` for its last
    /// whatever the step, `DIR@first` for the one before RL, `DIR@STEP` for the one at a step).
    #[arg(long = "a", required = true, num_args = 1..)]
    pub a: Vec<String>,
    /// Arm B's evaluations, as for `--a`.
    #[arg(long = "b", required = true, num_args = 1..)]
    pub b: Vec<String>,
    /// Arm A's name in the output.
    #[arg(long, default_value = "A")]
    pub name_a: String,
    /// Arm B's name in the output.
    #[arg(long, default_value = "B")]
    pub name_b: String,
    /// The precision of a run's evaluation to read (`int4-g32`, `f32`, ...; default: each run's rollout
    /// precision). `qarl eval` files hold one precision each: one that records another is refused.
    #[arg(long, value_parser = precision_name)]
    pub precision: Option<String>,
    /// Fail unless every evaluation has the same outcome on every problem: checks that an evaluation
    /// reproduces another (one protocol), before comparing evaluations made by different commands.
    #[arg(long)]
    pub require_identical: bool,
    /// B is one fixed model, not a sample of training seeds (the warm start every arm starts from): only
    /// A's seeds add to the seed part of the error.
    #[arg(long)]
    pub fixed_b: bool,
}

/// A `--precision` that names a scheme (`f32`, `int4-g32`, ...): a typo read no evaluation and was reported
/// as each run lacking that precision.
fn precision_name(text: &str) -> Result<String, String> {
    text.parse::<crate::quant::Precision>()
        .map(|p| p.to_string())
        .map_err(|e| e.to_string())
}

pub fn run(args: CompareArgs) -> anyhow::Result<()> {
    let load = |specs: &[String]| -> anyhow::Result<Vec<Evaluation>> {
        specs
            .iter()
            .map(|s| Evaluation::load(s, args.precision.as_deref()))
            .collect()
    };
    let (a, b) = (load(&args.a)?, load(&args.b)?);
    // Each evaluation as read (a run's with the step it was taken at): `@last` of a run still going, or
    // stopped early, is its newest evaluation, which may be the one before RL.
    for (name, arm) in [(&args.name_a, &a), (&args.name_b, &b)] {
        for (i, e) in arm.iter().enumerate() {
            if let Some(twin) = arm[..i].iter().find(|o| o.identity == e.identity) {
                anyhow::bail!(
                    "{name}: {} and {} are the same evaluation; an arm's evaluations are its seeds, each \
                     counted once",
                    twin.source,
                    e.source
                );
            }
            // Two seeds' evaluations differ in their responses (and timings): the same bytes are a copy.
            if let Some(copy) = arm[..i].iter().find(|o| o.content == e.content) {
                tracing::warn!(
                    "{name}: {} and {} hold the same evaluation, byte for byte: a copy counts as a \
                     second seed (pass each seed's own evaluation once)",
                    copy.source,
                    e.source
                );
            }
            println!("{name}: {}", e.source);
        }
    }
    // One evaluation in both arms compares a model with itself: the difference is 0 by construction.
    if let Some(e) = b
        .iter()
        .find(|e| a.iter().any(|o| o.identity == e.identity))
    {
        anyhow::bail!(
            "{} is in both arms ({} and {}): an arm compared with itself differs by 0 by construction",
            e.source,
            args.name_a,
            args.name_b
        );
    }
    if args.require_identical {
        check_identical(&a.iter().chain(&b).collect::<Vec<_>>())?;
    }
    let text = compare_arms(
        &Arm {
            name: &args.name_a,
            seeds: &a,
        },
        &Arm {
            name: &args.name_b,
            seeds: &b,
        },
        args.fixed_b,
    )?;
    println!("{text}");
    Ok(())
}
