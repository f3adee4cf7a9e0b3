//! Aggregation of eval records into tables, CSV, JSON and SVG plots.
//!
//! Every record is one unit (a document or a prompt under one policy and
//! budget). A metric's mean and 95% interval are taken over the units of a
//! group, so for fidelity the interval is across documents, as SPEC asks.

use anyhow::{anyhow, Result};
use serde::Serialize;
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path;

use super::metrics::{mean_ci, sign_test_p, MeanCi};
use super::store::write_atomic;
use crate::eviction::Policy;

/// One metric of a record kind: its column name and how to read it from a record.
pub struct Metric {
    pub name: &'static str,
    pub field: &'static str,
}

/// The metrics reported for each kind of record.
pub fn metrics_of(kind: &str) -> &'static [Metric] {
    const FIDELITY: &[Metric] = &[
        Metric {
            name: "mean KL(full ‖ policy)",
            field: "mean_kl",
        },
        Metric {
            name: "top-1 agreement",
            field: "top1",
        },
        Metric {
            name: "NLL increase",
            field: "nll_increase",
        },
    ];
    const GENERATE: &[Metric] = &[
        Metric {
            name: "common prefix (tokens)",
            field: "common_prefix",
        },
        Metric {
            name: "answer agreement",
            field: "answer_agree",
        },
    ];
    const NEEDLE: &[Metric] = &[Metric {
        name: "retrieval accuracy",
        field: "found",
    }];
    const RULER: &[Metric] = &[Metric {
        name: "string match (%)",
        field: "string_match",
    }];
    const TASK: &[Metric] = &[
        Metric {
            name: "accuracy",
            field: "correct",
        },
        Metric {
            name: "no answer (pred=None)",
            field: "no_answer",
        },
        Metric {
            name: "tokens generated",
            field: "tokens",
        },
        Metric {
            name: "seconds",
            field: "seconds",
        },
    ];
    match kind {
        "fidelity" => FIDELITY,
        "generate" => GENERATE,
        "needle" => NEEDLE,
        "ruler" => RULER,
        "task" => TASK,
        _ => &[],
    }
}

/// One row of a report: a policy at a budget (None: the full cache), within
/// an optional subgroup (the needle's depth).
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    pub kind: String,
    pub policy: String,
    pub budget: Option<u64>,
    pub group: Option<String>,
    pub n: usize,
    pub metrics: BTreeMap<String, MeanCi>,
}

fn number(v: &Value) -> Option<f64> {
    match v {
        Value::Bool(b) => Some(*b as u8 as f64),
        v => v.as_f64(),
    }
}

/// Rows of every (kind, policy, budget[, group]) in the records, in the order
/// policies first appear, then budget, then group. `group_field` names a field
/// that splits rows further (and a row over all its values is added).
pub fn aggregate(records: &[Value], kind: &str, group_field: Option<&str>) -> Vec<Row> {
    let mut policy_order: Vec<String> = vec![];
    // (index of the policy in first-seen order, budget, subgroup)
    type GroupKey = (usize, Option<u64>, Option<String>);
    let mut groups: BTreeMap<GroupKey, Vec<&Value>> = BTreeMap::new();
    // Units marked "skipped" (a document too short for the budget) have no metrics.
    for r in records
        .iter()
        .filter(|r| r["kind"] == kind && r["skipped"] != true)
    {
        let policy = r["policy"].as_str().unwrap_or("?").to_string();
        let pi = match policy_order.iter().position(|p| *p == policy) {
            Some(i) => i,
            None => {
                policy_order.push(policy);
                policy_order.len() - 1
            }
        };
        let budget = r["budget"].as_u64();
        if let Some(g) = group_field {
            let label = match &r[g] {
                Value::String(s) => s.clone(),
                v => v.to_string(),
            };
            groups.entry((pi, budget, Some(label))).or_default().push(r);
        }
        groups.entry((pi, budget, None)).or_default().push(r);
    }
    groups
        .into_iter()
        .map(|((pi, budget, group), rs)| {
            let metrics = metrics_of(kind)
                .iter()
                .filter_map(|m| {
                    let v: Vec<f64> = rs.iter().filter_map(|r| number(&r[m.field])).collect();
                    (!v.is_empty()).then(|| (m.name.to_string(), mean_ci(&v)))
                })
                .collect();
            Row {
                kind: kind.to_string(),
                policy: policy_order[pi].clone(),
                budget,
                group,
                n: rs.len(),
                metrics,
            }
        })
        .collect()
}

fn fmt_mean_ci(m: &MeanCi) -> String {
    match m.ci95 {
        Some(ci) => format!("{:.4} ± {:.4}", m.mean, ci),
        None => format!("{:.4}", m.mean),
    }
}

/// A markdown table of `rows` (one column per metric).
pub fn markdown_table(rows: &[Row], group_name: Option<&str>) -> String {
    let Some(first) = rows.first() else {
        return "(no results)\n".into();
    };
    let names: Vec<&str> = metrics_of(&first.kind).iter().map(|m| m.name).collect();
    let mut s = String::from("| policy | budget |");
    if let Some(g) = group_name {
        s.push_str(&format!(" {g} |"));
    }
    s.push_str(" n |");
    for n in &names {
        s.push_str(&format!(" {n} |"));
    }
    s.push('\n');
    s.push_str(&"|---".repeat(names.len() + 3 + group_name.is_some() as usize));
    s.push_str("|\n");
    for r in rows {
        // No budget: the full cache, or a bound the policy's name states
        // (`sieve eval ruler`'s compression ratios).
        let none = if r.policy == "full" { "full" } else { "-" };
        let budget = r.budget.map_or(none.to_string(), |b| b.to_string());
        s.push_str(&format!("| {} | {budget} |", r.policy));
        if group_name.is_some() {
            s.push_str(&format!(" {} |", r.group.as_deref().unwrap_or("all")));
        }
        s.push_str(&format!(" {} |", r.n));
        for n in &names {
            let cell = r.metrics.get(*n).map_or("-".to_string(), fmt_mean_ci);
            s.push_str(&format!(" {cell} |"));
        }
        s.push('\n');
    }
    s
}

/// CSV, one line per row and metric.
pub fn csv(rows: &[Row]) -> String {
    let mut s = String::from("kind,policy,budget,group,metric,mean,ci95,n\n");
    for r in rows {
        for (name, m) in &r.metrics {
            s.push_str(&format!(
                "{},{},{},{},\"{}\",{},{},{}\n",
                r.kind,
                r.policy,
                r.budget.map_or(String::new(), |b| b.to_string()),
                r.group.as_deref().unwrap_or(""),
                name.replace('"', "'"),
                m.mean,
                m.ci95.map_or(String::new(), |c| c.to_string()),
                m.n
            ));
        }
    }
    s
}

/// An SVG with one panel per metric: the metric against the budget, one line
/// per policy (with its 95% interval as whiskers); the full cache, which has
/// no budget, as a dashed horizontal line.
pub fn plot_svg(rows: &[Row], title: &str, metrics: &[&str]) -> Result<String> {
    use plotters::prelude::*;
    let rows: Vec<&Row> = rows.iter().filter(|r| r.group.is_none()).collect();
    let budgets: Vec<f64> = rows
        .iter()
        .filter_map(|r| r.budget.map(|b| b as f64))
        .collect();
    let (x0, x1) = budgets
        .iter()
        .fold((f64::MAX, f64::MIN), |(a, b), &x| (a.min(x), b.max(x)));
    let (x0, x1) = if x0 > x1 { (0.0, 1.0) } else { (x0, x1) };
    let pad = ((x1 - x0) * 0.08).max(1.0);
    let mut svg = String::new();
    {
        let width = 440 * metrics.len().max(1) as u32;
        let root = SVGBackend::with_string(&mut svg, (width, 400)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| anyhow!("{e}"))?;
        let root = root
            .titled(title, ("sans-serif", 20))
            .map_err(|e| anyhow!("{e}"))?;
        let panels = root.split_evenly((1, metrics.len().max(1)));
        let mut policies: Vec<&str> = vec![];
        for r in &rows {
            if !policies.contains(&r.policy.as_str()) {
                policies.push(&r.policy);
            }
        }
        for (panel, metric) in panels.iter().zip(metrics) {
            let values: Vec<(f64, f64)> = rows
                .iter()
                .filter_map(|r| r.metrics.get(*metric))
                .map(|m| {
                    (
                        m.mean - m.ci95.unwrap_or(0.0),
                        m.mean + m.ci95.unwrap_or(0.0),
                    )
                })
                .collect();
            let (y0, y1) = values
                .iter()
                .fold((f64::MAX, f64::MIN), |(a, b), &(l, h)| (a.min(l), b.max(h)));
            let (y0, y1) = if y0 > y1 { (0.0, 1.0) } else { (y0, y1) };
            let ypad = ((y1 - y0) * 0.08).max(1e-6);
            let mut chart = ChartBuilder::on(panel)
                .margin(12)
                .x_label_area_size(36)
                .y_label_area_size(56)
                .build_cartesian_2d((x0 - pad)..(x1 + pad), (y0 - ypad)..(y1 + ypad))
                .map_err(|e| anyhow!("{e}"))?;
            chart
                .configure_mesh()
                .x_desc("KV budget J (entries)")
                .x_label_formatter(&|x| format!("{x:.0}"))
                .y_desc(*metric)
                .draw()
                .map_err(|e| anyhow!("{e}"))?;
            for (i, policy) in policies.iter().enumerate() {
                let color = Palette99::pick(i).to_rgba();
                let mut pts: Vec<(f64, f64, f64)> = rows
                    .iter()
                    .filter(|r| r.policy == *policy)
                    .filter_map(|r| {
                        let m = r.metrics.get(*metric)?;
                        Some((r.budget? as f64, m.mean, m.ci95.unwrap_or(0.0)))
                    })
                    .collect();
                pts.sort_by(|a, b| a.0.total_cmp(&b.0));
                let full = rows
                    .iter()
                    .find(|r| r.policy == *policy && r.budget.is_none())
                    .and_then(|r| r.metrics.get(*metric));
                let series = if let Some(m) = full {
                    let dashes: Vec<Vec<(f64, f64)>> = (0..20)
                        .map(|k| {
                            let a = x0 - pad + (x1 - x0 + 2.0 * pad) * k as f64 / 20.0;
                            vec![(a, m.mean), (a + (x1 - x0 + 2.0 * pad) / 40.0, m.mean)]
                        })
                        .collect();
                    chart
                        .draw_series(
                            dashes
                                .into_iter()
                                .map(|d| PathElement::new(d, color.stroke_width(2))),
                        )
                        .map_err(|e| anyhow!("{e}"))?
                } else {
                    chart
                        .draw_series(pts.iter().map(|&(x, y, ci)| {
                            PathElement::new(vec![(x, y - ci), (x, y + ci)], color.stroke_width(1))
                        }))
                        .map_err(|e| anyhow!("{e}"))?;
                    chart
                        .draw_series(
                            pts.iter()
                                .map(|&(x, y, _)| Circle::new((x, y), 3, color.filled())),
                        )
                        .map_err(|e| anyhow!("{e}"))?;
                    chart
                        .draw_series(LineSeries::new(
                            pts.iter().map(|&(x, y, _)| (x, y)),
                            color.stroke_width(2),
                        ))
                        .map_err(|e| anyhow!("{e}"))?
                };
                series.label(*policy).legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
                });
            }
            chart
                .configure_series_labels()
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK)
                .position(SeriesLabelPosition::UpperRight)
                .draw()
                .map_err(|e| anyhow!("{e}"))?;
        }
        root.present().map_err(|e| anyhow!("{e}"))?;
    }
    Ok(svg)
}

/// One policy at one budget against another policy at the same budget, on
/// the documents both have: the mean of the per-document differences of a
/// metric (policy - other) with its 95% interval (so the interval is about
/// the difference, not the level), on how many documents it was lower, and
/// the sign test of that count.
#[derive(Clone, Debug, Serialize)]
pub struct Paired {
    pub policy: String,
    pub budget: u64,
    pub against: String,
    pub difference: MeanCi,
    pub lower: usize,
    /// Documents where the two were equal (a variant that changed nothing
    /// there); the sign test leaves them out.
    pub tied: usize,
    /// Two-sided sign test of lower against higher (ties left out).
    pub sign_test_p: f64,
}

/// The paired comparison of every policy with `against`, on fidelity's
/// `field` (in the order policies first appear, then budget).
pub fn paired(records: &[Value], field: &str, against: &str) -> Vec<Paired> {
    paired_with(records, field, |p| {
        (p != against).then(|| against.to_string())
    })
}

/// Each variant paired with what it builds on (`Policy::builds_on`).
pub fn paired_variants(records: &[Value], field: &str) -> Vec<Paired> {
    paired_with(records, field, |p| {
        let base = Policy::parse(p).ok()?.builds_on()?;
        Some(base.name().to_string())
    })
}

/// The paired comparison of every policy that `against` names a policy for
/// with that policy, on fidelity's `field` (in the order policies first
/// appear, then budget).
fn paired_with(
    records: &[Value],
    field: &str,
    against: impl Fn(&str) -> Option<String>,
) -> Vec<Paired> {
    let mut order: Vec<String> = vec![];
    // (policy, budget) -> document -> value
    let mut values: BTreeMap<(String, u64), BTreeMap<String, f64>> = BTreeMap::new();
    for r in records
        .iter()
        .filter(|r| r["kind"] == "fidelity" && r["skipped"] != true)
    {
        let (Some(policy), Some(budget), Some(doc), Some(v)) = (
            r["policy"].as_str(),
            r["budget"].as_u64(),
            r["doc"].as_str(),
            number(&r[field]),
        ) else {
            continue;
        };
        if !order.iter().any(|p| p == policy) {
            order.push(policy.to_string());
        }
        values
            .entry((policy.to_string(), budget))
            .or_default()
            .insert(doc.to_string(), v);
    }
    let mut out = vec![];
    for policy in &order {
        let Some(against) = against(policy) else {
            continue;
        };
        for ((p, budget), docs) in values.range((policy.clone(), 0)..=(policy.clone(), u64::MAX)) {
            let Some(base) = values.get(&(against.clone(), *budget)) else {
                continue;
            };
            let diffs: Vec<f64> = docs
                .iter()
                .filter_map(|(d, v)| base.get(d).map(|b| v - b))
                .collect();
            if diffs.is_empty() {
                continue;
            }
            let lower = diffs.iter().filter(|d| **d < 0.0).count();
            let higher = diffs.iter().filter(|d| **d > 0.0).count();
            out.push(Paired {
                policy: p.clone(),
                budget: *budget,
                against: against.clone(),
                difference: mean_ci(&diffs),
                lower,
                tied: diffs.len() - lower - higher,
                sign_test_p: sign_test_p(lower, higher),
            });
        }
    }
    out
}

/// A p-value with three decimals, or in scientific notation below 0.001.
fn fmt_p(p: f64) -> String {
    if p >= 0.001 {
        format!("{p:.3}")
    } else {
        format!("{p:.1e}")
    }
}

/// A markdown table of paired comparisons with one policy.
pub fn paired_table(rows: &[Paired], metric: &str) -> String {
    let Some(first) = rows.first() else {
        return "(no results)\n".into();
    };
    // One baseline for every row, or each row's own (the variants).
    let one = rows.iter().all(|r| r.against == first.against);
    let (a, base_column) = if one {
        (first.against.as_str(), "")
    } else {
        ("base", " base |")
    };
    let mut s = format!(
        "| policy |{base_column} budget | n | {metric}: policy - {a} (95% interval) | documents where lower than {a} | sign test p |\n|---|{}---|---|---|---|---|\n",
        if one { "" } else { "---|" }
    );
    for r in rows {
        let d = &r.difference;
        let cell = match d.ci95 {
            Some(ci) => format!("{:+.4} ± {:.4}", d.mean, ci),
            None => format!("{:+.4}", d.mean),
        };
        let base = if one {
            String::new()
        } else {
            format!(" {} |", r.against)
        };
        let tied = if r.tied > 0 {
            format!(", {} tied", r.tied)
        } else {
            String::new()
        };
        s.push_str(&format!(
            "| {} |{base} {} | {} | {cell} | {} of {}{tied} | {} |\n",
            r.policy,
            r.budget,
            d.n,
            r.lower,
            d.n,
            fmt_p(r.sign_test_p)
        ));
    }
    s
}

/// Writes `<dir>/report.json` (`rows`: every row; `paired`: fidelity's
/// paired comparisons), `report.csv`, one `<kind>.svg` per kind present and
/// `report.md`; returns the markdown (also printed by the CLI).
pub fn write_report(dir: &Path, records: &[Value]) -> Result<String> {
    let mut all_rows = vec![];
    let mut md = String::new();
    for (kind, group) in [
        ("fidelity", None),
        ("generate", None),
        ("needle", Some("depth")),
        ("ruler", Some("task")),
        ("task", Some("dataset")),
    ] {
        let rows = aggregate(records, kind, group);
        if rows.is_empty() {
            continue;
        }
        md.push_str(&format!("### {kind}\n\n{}\n", markdown_table(&rows, group)));
        let metrics: Vec<&str> = metrics_of(kind).iter().take(3).map(|m| m.name).collect();
        let svg = plot_svg(&rows, &format!("sieve eval {kind}"), &metrics)?;
        write_atomic(&dir.join(format!("{kind}.svg")), svg.as_bytes())?;
        all_rows.extend(rows);
    }
    // Fidelity, paired per document: against the window (the baseline to
    // beat) and against the oracle (how far each policy is from it).
    let mut all_paired = vec![];
    for against in ["window", "oracle"] {
        let rows = paired(records, "mean_kl", against);
        if rows.is_empty() {
            continue;
        }
        md.push_str(&format!(
            "### fidelity, paired with {against}\n\n{}\n",
            paired_table(&rows, "mean KL")
        ));
        all_paired.extend(rows);
    }
    let rows = paired_variants(records, "mean_kl");
    if !rows.is_empty() {
        md.push_str(&format!(
            "### fidelity, each variant paired with what it builds on\n\n{}\n",
            paired_table(&rows, "mean KL")
        ));
        all_paired.extend(rows);
    }
    let json = serde_json::json!({"rows": all_rows, "paired": all_paired});
    write_atomic(
        &dir.join("report.json"),
        serde_json::to_string_pretty(&json)?.as_bytes(),
    )?;
    write_atomic(&dir.join("report.csv"), csv(&all_rows).as_bytes())?;
    write_atomic(&dir.join("report.md"), md.as_bytes())?;
    Ok(md)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn aggregates_tables_and_plots() {
        let recs = vec![
            json!({"kind": "fidelity", "policy": "window", "budget": 128, "mean_kl": 1.0, "top1": 0.5, "nll_increase": 0.1}),
            json!({"kind": "fidelity", "policy": "window", "budget": 128, "mean_kl": 3.0, "top1": 0.7, "nll_increase": 0.3}),
            json!({"kind": "fidelity", "policy": "epikv", "budget": 256, "mean_kl": 0.5, "top1": 0.9, "nll_increase": 0.0}),
            json!({"kind": "needle", "policy": "full", "budget": null, "depth": 0.5, "found": true}),
            json!({"kind": "needle", "policy": "full", "budget": null, "depth": 0.1, "found": false}),
        ];
        let rows = aggregate(&recs, "fidelity", None);
        assert_eq!(rows.len(), 2);
        let w = &rows[0];
        assert_eq!((w.policy.as_str(), w.budget, w.n), ("window", Some(128), 2));
        assert_eq!(w.metrics["mean KL(full ‖ policy)"].mean, 2.0);
        let table = markdown_table(&rows, None);
        assert!(table.contains("| window | 128 | 2 | 2.0000 ± "), "{table}");
        let needle = aggregate(&recs, "needle", Some("depth"));
        // depth 0.1, depth 0.5 and the row over all depths
        assert_eq!(needle.len(), 3);
        let all = needle.iter().find(|r| r.group.is_none()).unwrap();
        assert_eq!(all.metrics["retrieval accuracy"].mean, 0.5);
        let svg = plot_svg(&rows, "t", &["mean KL(full ‖ policy)", "top-1 agreement"]).unwrap();
        assert!(svg.starts_with("<svg") && svg.contains("epikv") && svg.contains("<circle"));
        assert!(csv(&rows).lines().count() == 1 + 6);
    }

    #[test]
    fn paired_differences_by_document() {
        let rec = |doc: &str, policy: &str, budget: u64, kl: f64| json!({"kind": "fidelity", "doc": doc, "policy": policy, "budget": budget, "mean_kl": kl});
        let recs = vec![
            rec("a", "window", 128, 1.0),
            rec("b", "window", 128, 2.0),
            rec("c", "window", 128, 3.0),
            rec("a", "epikv", 128, 1.5),
            rec("b", "epikv", 128, 1.5),
            rec("c", "epikv", 128, 4.0),
            // No window at 256, no window for document d: left out.
            rec("a", "epikv", 256, 9.0),
            rec("d", "epikv", 128, 0.0),
            json!({"kind": "fidelity", "doc": "e", "policy": "window", "budget": 128, "skipped": true}),
        ];
        let p = paired(&recs, "mean_kl", "window");
        assert_eq!(p.len(), 1);
        // differences +0.5, -0.5, +1.0: mean 1/3, sd 0.7638, t(2) = 4.303
        let d = &p[0].difference;
        assert_eq!(
            (p[0].policy.as_str(), p[0].budget, d.n, p[0].lower),
            ("epikv", 128, 3, 1)
        );
        assert!((d.mean - 1.0 / 3.0).abs() < 1e-12);
        let sd = ((1.0f64 / 36.0 + 25.0 / 36.0 + 4.0 / 9.0) / 2.0).sqrt();
        assert!((d.ci95.unwrap() - 4.303 * sd / 3f64.sqrt()).abs() < 1e-9);
        let table = paired_table(&p, "mean KL");
        assert!(table.contains("| epikv | 128 | 3 | +0.3333 ± "), "{table}");
        // 1 lower, 2 higher: the split at least as uneven either way is
        // every split but none, so p = 2 (3 + 1) / 8 = 1.
        assert_eq!(p[0].sign_test_p, 1.0);
        assert!(table.contains("| 1 of 3 | 1.000 |"), "{table}");

        // A tie is counted apart and left out of the sign test: 3 lower,
        // 1 tied gives p = 2 / 8, where 3 of 4 with the tie as higher
        // would give 10 / 16.
        let mut recs: Vec<Value> = ["a", "b", "c", "d"]
            .iter()
            .map(|d| rec(d, "window", 128, 1.0))
            .collect();
        recs.extend([
            rec("a", "tova", 128, 0.5),
            rec("b", "tova", 128, 0.25),
            rec("c", "tova", 128, 0.75),
            rec("d", "tova", 128, 1.0),
        ]);
        let p = paired(&recs, "mean_kl", "window");
        assert_eq!((p[0].lower, p[0].tied), (3, 1));
        assert!((p[0].sign_test_p - 0.25).abs() < 1e-12);
        let table = paired_table(&p, "mean KL");
        assert!(table.contains("| 3 of 4, 1 tied | 0.250 |"), "{table}");
    }

    #[test]
    fn variants_pair_with_what_they_build_on() {
        let rec = |doc: &str, policy: &str, kl: f64| json!({"kind": "fidelity", "doc": doc, "policy": policy, "budget": 128, "mean_kl": kl});
        let recs = vec![
            rec("a", "window", 1.0),
            rec("a", "tova", 0.5),
            rec("a", "epikv", 2.0),
            rec("a", "epikv-robust", 1.5),
            rec("a", "epikv-tova", 0.25),
            rec("b", "tova", 0.5),
            rec("b", "epikv-tova", 1.0),
            // Its base (ccs) did not run: left out.
            rec("a", "ccs-context", 1.0),
        ];
        let p = paired_variants(&recs, "mean_kl");
        let got: Vec<(&str, &str, usize, f64)> = p
            .iter()
            .map(|r| {
                (
                    r.policy.as_str(),
                    r.against.as_str(),
                    r.difference.n,
                    r.difference.mean,
                )
            })
            .collect();
        assert_eq!(
            got,
            [
                ("epikv-robust", "epikv", 1, -0.5),
                ("epikv-tova", "tova", 2, 0.125)
            ]
        );
        let table = paired_table(&p, "mean KL");
        assert!(table.contains("| policy | base | budget |"), "{table}");
        assert!(
            table.contains("| epikv-tova | tova | 128 | 2 | +0.1250 ± "),
            "{table}"
        );
    }
}
