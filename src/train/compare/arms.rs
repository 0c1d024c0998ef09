//! Two arms' evaluations compared by problem, with the statistics of an experiment's report.

use std::fmt::Write as _;

use anyhow::{bail, Context};

use super::checks::{check_same_problems, first_disagreement};
use super::Evaluation;
use crate::train::paired::{ArmComparison, ClusteredMean};

/// One arm: a name and one evaluation per seed.
pub struct Arm<'a> {
    pub name: &'a str,
    pub seeds: &'a [Evaluation],
}

impl Arm<'_> {
    fn outcomes(&self) -> Vec<Vec<bool>> {
        self.seeds.iter().map(|e| e.correct.clone()).collect()
    }

    /// `name (n seeds, int4-g32): per seed 0.560 0.415; 0.488 ± 0.031 over 193 problems`.
    fn summary(&self) -> String {
        let per_seed: Vec<String> = self
            .seeds
            .iter()
            .map(|e| format!("{:.3}", e.accuracy()))
            .collect();
        let c = ClusteredMean::new(&self.outcomes());
        let clustered = c.map_or_else(String::new, |c| {
            format!(
                "; {:.3} ± {} over {} problems",
                c.mean,
                crate::train::paired::se_text(c.se),
                c.problems
            )
        });
        let mut precisions: Vec<String> = self
            .seeds
            .iter()
            .map(|e| {
                let precision = e.precision.as_deref().unwrap_or("precision not recorded");
                match e.activations.as_deref() {
                    Some(a) if a != "f32" => format!("{precision} with {a} activations"),
                    _ => precision.to_string(),
                }
            })
            .collect();
        // Each precision once, in the order of the seeds (`dedup` alone keeps `a / b / a`).
        let mut seen = std::collections::BTreeSet::new();
        precisions.retain(|p| seen.insert(p.clone()));
        format!(
            "{} ({} seed{}, {}): per seed {}{clustered}",
            self.name,
            self.seeds.len(),
            if self.seeds.len() == 1 { "" } else { "s" },
            precisions.join(" / "),
            per_seed.join(" ")
        )
    }
}

/// Both arms' accuracies and their difference paired by problem (`report.md`'s statistics), as text; fails
/// when the evaluations are not over the same problems. `fixed_b`: B is one fixed model (the warm start),
/// not a training seed, so only A's seeds add to the error ([`ArmComparison::against_fixed`]).
pub fn compare_arms(a: &Arm, b: &Arm, fixed_b: bool) -> anyhow::Result<String> {
    let all: Vec<&Evaluation> = a.seeds.iter().chain(b.seeds).collect();
    if a.seeds.is_empty() || b.seeds.is_empty() {
        bail!("each arm needs at least one evaluation");
    }
    check_same_problems(&all)?;
    if fixed_b && b.seeds.len() != 1 {
        bail!(
            "B is one fixed model, but it has {} evaluations",
            b.seeds.len()
        );
    }
    for arm in [a, b] {
        let seeds: Vec<&Evaluation> = arm.seeds.iter().collect();
        if let Some(((first, x), (e, y))) = first_disagreement(&seeds, |e| e.prompt.as_ref()) {
            bail!(
                "{} and {}, seeds of {}, were prompted differently ({x} and {y}): one arm's seeds answer \
                 the same prompts",
                first.source,
                e.source,
                arm.name
            );
        }
    }
    let (oa, ob) = (a.outcomes(), b.outcomes());
    let c = if fixed_b {
        ArmComparison::against_fixed(&oa, &ob)
    } else {
        ArmComparison::new(&oa, &ob)
    }
    .context("the evaluations cover different numbers of problems")?;
    let mut out = String::new();
    writeln!(out, "{}", a.summary())?;
    writeln!(out, "{}", b.summary())?;
    let prompt = |arm: &Arm| arm.seeds.iter().find_map(|e| e.prompt.clone());
    if let (Some(x), Some(y)) = (prompt(a), prompt(b)) {
        if x != y {
            // A comparison of prompts, or a mistake: either way the reader must see it.
            writeln!(
                out,
                "prompted differently: {} with {x}; {} with {y}",
                a.name, b.name
            )?;
        }
    }
    write!(
        out,
        "{} − {}: {} over problems",
        a.name,
        b.name,
        c.problems_text()
    )?;
    if let Some(both) = c.problems_and_seeds_text() {
        write!(out, "; with seeds {both}")?;
    }
    Ok(out)
}
