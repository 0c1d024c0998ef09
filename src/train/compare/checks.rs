//! The checks that evaluations measure one thing: the same problems in the same order, the same golds,
//! verifier, stop strings and token limit, where each records them.

use anyhow::bail;

use super::Evaluation;

/// Fails unless every evaluation lists the first one's questions in its order; names the first evaluation
/// that differs and the first problem where they part.
pub fn check_same_problems(evals: &[&Evaluation]) -> anyhow::Result<()> {
    let Some(first) = evals.first() else {
        return Ok(());
    };
    for e in &evals[1..] {
        let shared = e.questions.len().min(first.questions.len());
        if let Some(i) = (0..shared).find(|&i| e.questions[i] != first.questions[i]) {
            bail!(
                "{} and {} list different problems: problem {} is {:?} in the first and {:?} in the second",
                first.source,
                e.source,
                i + 1,
                first.questions[i],
                e.questions[i]
            );
        }
        if e.questions.len() != first.questions.len() {
            bail!(
                "{} has {} problems, {} has {} (the first {shared} agree): not the same problems",
                first.source,
                first.questions.len(),
                e.source,
                e.questions.len()
            );
        }
    }
    check_same_golds(evals)?;
    check_same_verifier(evals)?;
    check_same_stops(evals)?;
    check_same_token_limit(evals)
}

/// Fails where two evaluations that record their responses' token limit had different ones.
fn check_same_token_limit(evals: &[&Evaluation]) -> anyhow::Result<()> {
    if let Some(((first, a), (e, b))) = first_disagreement(evals, |e| e.max_new_tokens.as_ref()) {
        bail!(
            "{} let its responses run to {a} tokens and {} to {b}: an answer the shorter limit cut off is \
             no answer there (`qarl eval --max-new-tokens`, a run's `eval.max_new_tokens`)",
            first.source,
            e.source
        );
    }
    Ok(())
}

/// Fails where two evaluations that record where their responses stopped stopped them at other strings.
fn check_same_stops(evals: &[&Evaluation]) -> anyhow::Result<()> {
    if let Some(((first, a), (e, b))) = first_disagreement(evals, |e| e.stop_strings.as_ref()) {
        bail!(
            "{} stopped its responses at {a:?} and {} at {b:?} besides the end tokens: a response that runs \
             on past its answer is scored on other text (`qarl eval --stop`, a run's `rollout.stop`)",
            first.source,
            e.source
        );
    }
    Ok(())
}

/// Fails where two evaluations that record how they judged answers judged them differently.
fn check_same_verifier(evals: &[&Evaluation]) -> anyhow::Result<()> {
    if let Some(((first, v), (e, w))) = first_disagreement(evals, |e| e.verify.as_ref()) {
        bail!(
            "{} and {} judged answers under different rules ({v} and {w}): outcomes of two verifiers",
            first.source,
            e.source
        );
    }
    Ok(())
}

/// Two evaluations with the values they record ([`first_disagreement`]).
type Disagreement<'e, T> = ((&'e Evaluation, &'e T), (&'e Evaluation, &'e T));

/// The first evaluation that records `what` and the first one after it that records another value, each
/// with its value; evaluations that record nothing are passed over.
pub(super) fn first_disagreement<'e, T: PartialEq>(
    evals: &[&'e Evaluation],
    what: impl Fn(&'e Evaluation) -> Option<&'e T>,
) -> Option<Disagreement<'e, T>> {
    let mut recorded = evals.iter().filter_map(|&e| what(e).map(|v| (e, v)));
    let first = recorded.next()?;
    recorded
        .find(|(_, v)| *v != first.1)
        .map(|other| (first, other))
}

/// Fails where two evaluations that record gold answers give one problem different golds.
fn check_same_golds(evals: &[&Evaluation]) -> anyhow::Result<()> {
    let with_golds: Vec<(&Evaluation, &Vec<String>)> = evals
        .iter()
        .filter_map(|e| e.golds.as_ref().map(|g| (*e, g)))
        .collect();
    let Some((first, golds)) = with_golds.first() else {
        return Ok(());
    };
    for (e, other) in &with_golds[1..] {
        if let Some(i) = (0..golds.len().min(other.len())).find(|&i| golds[i] != other[i]) {
            bail!(
                "{} and {} grade problem {} ({:?}) against different gold answers ({:?} and {:?}): \
                 evaluations of two data sets",
                first.source,
                e.source,
                i + 1,
                first.questions[i],
                golds[i],
                other[i]
            );
        }
    }
    Ok(())
}

/// Fails unless every evaluation has the first one's outcome on every problem: two runs of one protocol
/// (e.g. a command that should reproduce a run's own evaluation) agree problem by problem.
pub fn check_identical(evals: &[&Evaluation]) -> anyhow::Result<()> {
    check_same_problems(evals)?;
    let Some(first) = evals.first() else {
        return Ok(());
    };
    for e in &evals[1..] {
        let differ: Vec<usize> = (0..e.correct.len())
            .filter(|&i| e.correct[i] != first.correct[i])
            .map(|i| i + 1)
            .collect();
        if !differ.is_empty() {
            bail!(
                "{} and {} differ on {} problem(s) (first: problem {}): not the same protocol",
                first.source,
                e.source,
                differ.len(),
                differ[0]
            );
        }
    }
    Ok(())
}
