//! `sieve eval explain`: a self-contained HTML page of a text in which every
//! token is shaded by its fate under a policy: kept to the end, or evicted at
//! which refresh, with its last score in a tooltip; and the diagnosis of the
//! policy's refreshes against the oracles (docs/POLICIES.md): how many of its
//! kept entries the oracle would keep too, and how much of the full run's
//! future attention the entries it evicted would have received.
//!
//! At layer or head granularity (a keep list per layer or per (layer, KV
//! head), whose kept positions the trace records in `kept_lists`) each
//! list is diagnosed as a token cache would be ([`per_list`]) and the
//! diagnoses averaged over the lists; a token is evicted once no list
//! holds it, and the page shows how many lists still hold the others.

use anyhow::Result;
use serde::Serialize;
use std::collections::BTreeMap;

use crate::cache::RefreshRecord;
use crate::eviction::oracle::FutureAttention;

/// What happened to one position.
#[derive(Clone, Debug, PartialEq)]
pub struct Fate {
    /// Index of the refresh that evicted it (None: still cached at the end).
    pub evicted_at: Option<usize>,
    /// The last score it received (None: never ranked, e.g. protected).
    pub score: Option<f64>,
    /// Whether it was protected (sink or recent) at its last refresh.
    pub protected: bool,
    /// Evicted ones: the attention it would have received from every later
    /// query of the full-cache run (None: not known or not evicted).
    pub lost_attention: Option<f64>,
    /// At layer or head granularity: (lists holding it at the end, lists).
    pub held: Option<(usize, usize)>,
}

/// Each keep list's refreshes as the records of a token cache: the list's
/// present entries, its unprotected ones and what it kept. The entries fed
/// since the last refresh joined every list; the protected ones are the
/// same in each. Scores are list 0's (left empty for the others). A trace
/// without `kept_lists` is one list, itself.
pub fn per_list(trace: &[RefreshRecord]) -> Vec<Vec<RefreshRecord>> {
    let n_lists = match trace.first().and_then(|r| r.kept_lists.as_ref()) {
        None => return vec![trace.to_vec()],
        Some(k) => k.len(),
    };
    (0..n_lists)
        .map(|g| {
            let mut before: Option<(&[u32], &[u32])> = None;
            trace
                .iter()
                .map(|r| {
                    let kept = (r.kept_lists.as_ref()).map_or(&r.kept, |k| &k[g]).clone();
                    let present: Vec<u32> = match before {
                        None => r.present.clone(),
                        Some((kept_g, kept_0)) => {
                            let new = r
                                .present
                                .iter()
                                .filter(|p| kept_0.binary_search(p).is_err());
                            kept_g.iter().chain(new).copied().collect()
                        }
                    };
                    let unprotected: Vec<u32> = (present.iter())
                        .filter(|p| r.protected.binary_search(p).is_err())
                        .copied()
                        .collect();
                    let own = r.kept_lists.as_ref().map_or(&r.kept[..], |k| &k[g]);
                    before = Some((own, &r.kept));
                    RefreshRecord {
                        present,
                        unprotected,
                        scores: if g == 0 { r.scores.clone() } else { vec![] },
                        kept,
                        kept_lists: None,
                        ..r.clone()
                    }
                })
                .collect()
        })
        .collect()
}

/// The fate of each of `n` positions from the refresh records of a run: at
/// layer or head granularity, evicted at the refresh that took it from the
/// last list holding it.
pub fn fates(n: usize, trace: &[RefreshRecord]) -> Vec<Fate> {
    let lists = per_list(trace);
    let each: Vec<Vec<Fate>> = lists.iter().map(|t| fates_of_list(n, t)).collect();
    if each.len() == 1 {
        return each.into_iter().next().unwrap();
    }
    let mut out = each[0].clone();
    for (p, f) in out.iter_mut().enumerate() {
        let holding = each.iter().filter(|l| l[p].evicted_at.is_none()).count();
        f.held = Some((holding, each.len()));
        f.evicted_at = match holding {
            0 => each.iter().filter_map(|l| l[p].evicted_at).max(),
            _ => None,
        };
    }
    out
}

/// The fates of one list's records.
fn fates_of_list(n: usize, trace: &[RefreshRecord]) -> Vec<Fate> {
    let mut out = vec![
        Fate {
            evicted_at: None,
            score: None,
            protected: false,
            lost_attention: None,
            held: None,
        };
        n
    ];
    for r in trace {
        for (p, s) in r.unprotected.iter().zip(&r.scores) {
            if let Some(f) = out.get_mut(*p as usize) {
                f.score = Some(*s);
                f.protected = false;
            }
        }
        for p in &r.protected {
            if let Some(f) = out.get_mut(*p as usize) {
                f.protected = true;
            }
        }
        for p in &r.present {
            if r.kept.binary_search(p).is_err() {
                if let Some(f) = out.get_mut(*p as usize) {
                    f.evicted_at = Some(r.refresh);
                }
            }
        }
    }
    out
}

/// Sets each evicted position's `lost_attention`: what it would have received
/// from every query after the refresh that evicted it (from its last list).
pub fn add_lost_attention(
    fates: &mut [Fate],
    trace: &[RefreshRecord],
    future: &FutureAttention,
) -> Result<()> {
    for r in trace {
        let evicted: Vec<u32> = (0..fates.len() as u32)
            .filter(|&p| fates[p as usize].evicted_at == Some(r.refresh))
            .collect();
        let mass = future.received(&evicted, r.before_position as usize, future.len)?;
        for (p, m) in evicted.iter().zip(mass) {
            fates[*p as usize].lost_attention = Some(m);
        }
    }
    Ok(())
}

/// One refresh against the oracles: among the entries the policy ranked,
/// the share of the ones it kept that the oracle (the same number of the
/// highest future attention) would keep too, and the future attention
/// (full-cache run, summed over queries, averaged over layers and heads)
/// of the ones it evicted, next to the least any choice could evict.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct RefreshDiagnosis {
    pub refresh: usize,
    pub before_position: u32,
    pub ranked: usize,
    pub evicted: usize,
    /// Horizon: the next h queries.
    pub overlap_next: f64,
    pub lost_next: f64,
    pub oracle_lost_next: f64,
    /// Horizon: every remaining query of the document.
    pub overlap_rest: f64,
    pub lost_rest: f64,
    pub oracle_lost_rest: f64,
}

/// The `keep` highest of `mass` (ties: the later entry, as the cache ranks).
fn oracle_keeps(mass: &[f64], keep: usize) -> Vec<bool> {
    let mut order: Vec<usize> = (0..mass.len()).collect();
    order.sort_by(|&a, &b| mass[b].total_cmp(&mass[a]).then(b.cmp(&a)));
    let mut kept = vec![false; mass.len()];
    for &i in order.iter().take(keep) {
        kept[i] = true;
    }
    kept
}

/// Overlap with the oracle's choice and the evicted mass of the policy and
/// of the oracle, for one horizon.
fn against_oracle(mass: &[f64], kept: &[bool]) -> (f64, f64, f64) {
    let keep = kept.iter().filter(|k| **k).count();
    let oracle = oracle_keeps(mass, keep);
    let both = kept.iter().zip(&oracle).filter(|(a, b)| **a && **b).count();
    let lost = |k: &[bool]| -> f64 {
        mass.iter()
            .zip(k)
            .filter(|(_, k)| !**k)
            .map(|(m, _)| m)
            .sum()
    };
    let overlap = if keep == 0 {
        1.0
    } else {
        both as f64 / keep as f64
    };
    (overlap, lost(kept), lost(&oracle))
}

/// The diagnosis of every refresh of `trace` (chunk `h`) against `future`:
/// at layer or head granularity, the mean over the keep lists.
pub fn diagnose(
    trace: &[RefreshRecord],
    future: &FutureAttention,
    h: usize,
) -> Result<Vec<RefreshDiagnosis>> {
    let lists = per_list(trace);
    let each = (lists.iter())
        .map(|t| diagnose_list(t, future, h))
        .collect::<Result<Vec<_>>>()?;
    let k = each.len() as f64;
    let mut out = each[0].clone();
    for (i, d) in out.iter_mut().enumerate() {
        let mean = |f: fn(&RefreshDiagnosis) -> f64| each.iter().map(|l| f(&l[i])).sum::<f64>() / k;
        d.overlap_next = mean(|d| d.overlap_next);
        d.lost_next = mean(|d| d.lost_next);
        d.oracle_lost_next = mean(|d| d.oracle_lost_next);
        d.overlap_rest = mean(|d| d.overlap_rest);
        d.lost_rest = mean(|d| d.lost_rest);
        d.oracle_lost_rest = mean(|d| d.oracle_lost_rest);
    }
    Ok(out)
}

/// [`diagnose`] of one list's records.
fn diagnose_list(
    trace: &[RefreshRecord],
    future: &FutureAttention,
    h: usize,
) -> Result<Vec<RefreshDiagnosis>> {
    trace
        .iter()
        .map(|r| {
            let p = r.before_position as usize;
            let kept: Vec<bool> = r
                .unprotected
                .iter()
                .map(|x| r.kept.binary_search(x).is_ok())
                .collect();
            let next = future.received(&r.unprotected, p, p + h)?;
            let rest = future.received(&r.unprotected, p, future.len)?;
            let (overlap_next, lost_next, oracle_lost_next) = against_oracle(&next, &kept);
            let (overlap_rest, lost_rest, oracle_lost_rest) = against_oracle(&rest, &kept);
            Ok(RefreshDiagnosis {
                refresh: r.refresh,
                before_position: r.before_position,
                ranked: kept.len(),
                evicted: kept.iter().filter(|k| !**k).count(),
                overlap_next,
                lost_next,
                oracle_lost_next,
                overlap_rest,
                lost_rest,
                oracle_lost_rest,
            })
        })
        .collect()
}

/// What kind of text a token is, for the breakdown of lost attention.
pub fn token_class(piece: &str) -> &'static str {
    let t = piece.trim();
    if t.is_empty() {
        "space or newline"
    } else if t.chars().any(|c| c.is_ascii_digit()) {
        "number"
    } else if t.chars().all(|c| !c.is_alphanumeric()) {
        "punctuation or symbol"
    } else {
        "word"
    }
}

/// Evictions of one category: how many, and their future attention (every
/// remaining query), for the policy and for the oracle at the same refreshes.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct CategoryLoss {
    pub evicted: usize,
    pub lost_rest: f64,
    pub oracle_evicted: usize,
    pub oracle_lost_rest: f64,
}

/// Where the evicted attention goes, by category (summed over the keep
/// lists at layer or head granularity): the token's class
/// ([`token_class`]), whether its position is inside the first `window`
/// positions (EpiKV's first rolling window, whose statistics the sinks
/// dominate), and its age at the refresh (under `window` positions, or older).
pub fn loss_by_category(
    trace: &[RefreshRecord],
    future: &FutureAttention,
    pieces: &[String],
    window: u32,
) -> Result<BTreeMap<String, CategoryLoss>> {
    let lists = per_list(trace);
    let mut out: BTreeMap<String, CategoryLoss> = BTreeMap::new();
    for r in lists.iter().flatten() {
        let p = r.before_position;
        let kept: Vec<bool> = r
            .unprotected
            .iter()
            .map(|x| r.kept.binary_search(x).is_ok())
            .collect();
        let rest = future.received(&r.unprotected, p as usize, future.len)?;
        let oracle = oracle_keeps(&rest, kept.iter().filter(|k| **k).count());
        for (k, &pos) in r.unprotected.iter().enumerate() {
            let class = pieces.get(pos as usize).map_or("?", |s| token_class(s));
            let place = if pos < window {
                format!("early (< {window})")
            } else {
                format!("later (>= {window})")
            };
            let age = if p - pos < window {
                format!("young (< {window})")
            } else {
                format!("old (>= {window})")
            };
            for key in [
                format!("class: {class}"),
                format!("position: {place}"),
                format!("age: {age}"),
            ] {
                let e = out.entry(key).or_default();
                if !kept[k] {
                    e.evicted += 1;
                    e.lost_rest += rest[k];
                }
                if !oracle[k] {
                    e.oracle_evicted += 1;
                    e.oracle_lost_rest += rest[k];
                }
            }
        }
    }
    Ok(out)
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// The page: `pieces[i]` is the text of token i; `title` heads the page.
pub fn html(title: &str, pieces: &[String], fates: &[Fate], refreshes: usize) -> String {
    let mut body = String::new();
    for (i, (piece, f)) in pieces.iter().zip(fates).enumerate() {
        let (class, style, what) = match (f.evicted_at, f.held) {
            (None, Some((holding, lists))) if holding < lists => {
                // Held by some lists only: lighter the fewer.
                let light = 90.0 - 25.0 * holding as f64 / lists as f64;
                (
                    "kept",
                    format!(" style=\"background:hsl(120,55%,{light:.0}%)\""),
                    format!("kept to the end by {holding} of {lists} keep lists"),
                )
            }
            (None, _) => ("kept", String::new(), "kept to the end".to_string()),
            (Some(k), _) => {
                // Early evictions dark red, late ones light.
                let frac = (k + 1) as f64 / refreshes.max(1) as f64;
                let light = 45.0 + 45.0 * frac;
                (
                    "evicted",
                    format!(" style=\"background:hsl(0,75%,{light:.0}%)\""),
                    match f.held {
                        Some(_) => format!("evicted from the last keep list at refresh {k}"),
                        None => format!("evicted at refresh {k}"),
                    },
                )
            }
        };
        let score = f
            .score
            .map_or("no score (protected or never ranked)".into(), |s| {
                if s == f64::MAX {
                    // The sink guards' score for a detected sink.
                    "score: kept as a detected sink".into()
                } else {
                    format!("score {s:.4}")
                }
            });
        let prot = if f.protected { ", protected" } else { "" };
        let lost = f.lost_attention.map_or(String::new(), |m| {
            format!("; would have received {m:.3} attention later")
        });
        body.push_str(&format!(
            "<span class=\"{class}\"{style} title=\"position {i}: {what}; {score}{prot}{lost}\">{}</span>",
            escape(piece).replace('\n', "<br>\n")
        ));
    }
    let kept = fates.iter().filter(|f| f.evicted_at.is_none()).count();
    format!(
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{t}</title>\n<style>\n\
body{{font-family:Georgia,serif;max-width:60em;margin:2em auto;line-height:1.6;color:#111}}\n\
.kept{{background:#c8f0c8}}\n.evicted{{color:#222}}\n\
.legend span{{padding:0 .4em;margin-right:1em}}\n#text span:hover{{outline:1px solid #000}}\n\
</style></head><body>\n<h1>{t}</h1>\n<p class=\"legend\"><span class=\"kept\">kept to the end</span>\
<span style=\"background:hsl(0,75%,50%)\">evicted early</span><span style=\"background:hsl(0,75%,88%)\">evicted late</span>\
 Hover a token for its position, fate and score. {kept} of {n} tokens kept; {refreshes} refreshes.</p>\n\
<div id=\"text\">{body}</div>\n</body></html>\n",
        t = escape(title),
        n = fates.len(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fates_from_a_trace() {
        // Positions 0..6; refresh 0 keeps {0, 2, 3, 4}; refresh 1 keeps {0, 3, 4, 5}.
        let trace = vec![
            RefreshRecord {
                refresh: 0,
                before_position: 5,
                present: vec![0, 1, 2, 3, 4],
                protected: vec![0, 4],
                unprotected: vec![1, 2, 3],
                scores: vec![0.1, 0.9, 0.5],
                kept: vec![0, 2, 3, 4],
                kept_lists: None,
            },
            RefreshRecord {
                refresh: 1,
                before_position: 6,
                present: vec![0, 2, 3, 4, 5],
                protected: vec![0, 5],
                unprotected: vec![2, 3, 4],
                scores: vec![0.2, 0.8, 0.7],
                kept: vec![0, 3, 4, 5],
                kept_lists: None,
            },
        ];
        let f = fates(7, &trace);
        assert_eq!(f[1].evicted_at, Some(0));
        assert_eq!(f[1].score, Some(0.1));
        assert_eq!(f[2].evicted_at, Some(1));
        assert_eq!(f[2].score, Some(0.2));
        assert_eq!(f[3].evicted_at, None);
        assert!(f[0].protected && f[0].score.is_none());
        assert_eq!(
            f[6],
            Fate {
                evicted_at: None,
                score: None,
                protected: false,
                lost_attention: None,
                held: None,
            }
        );
        let page = html(
            "a <test>",
            &[
                "a".into(),
                "<b>".into(),
                "c".into(),
                "d".into(),
                "e".into(),
                "f".into(),
                "g\n".into(),
            ],
            &f,
            2,
        );
        assert!(page.contains("&lt;b&gt;") && page.contains("a &lt;test&gt;"));
        assert!(page.contains("position 2: evicted at refresh 1; score 0.2000"));
        assert_eq!(page.matches("class=\"kept\"").count(), 1 + 5); // legend + 0, 3, 4, 5, 6
    }

    /// Two keep lists: list 0 as in `fates_from_a_trace`, list 1 keeping
    /// {0, 1, 3, 4} then {0, 1, 4, 5}. A token is evicted once neither
    /// list holds it, and list 1's records are rebuilt from what it kept
    /// and what was fed since.
    #[test]
    fn fates_and_records_of_each_keep_list() {
        let record =
            |refresh, before, present: &[u32], protected: &[u32], kept: &[u32]| RefreshRecord {
                refresh,
                before_position: before,
                present: present.to_vec(),
                protected: protected.to_vec(),
                unprotected: vec![],
                scores: vec![],
                kept: kept.to_vec(),
                kept_lists: None,
            };
        let mut trace = vec![
            record(0, 5, &[0, 1, 2, 3, 4], &[0, 4], &[0, 2, 3, 4]),
            record(1, 6, &[0, 2, 3, 4, 5], &[0, 5], &[0, 3, 4, 5]),
        ];
        trace[0].kept_lists = Some(vec![vec![0, 2, 3, 4], vec![0, 1, 3, 4]]);
        trace[1].kept_lists = Some(vec![vec![0, 3, 4, 5], vec![0, 1, 4, 5]]);
        let lists = per_list(&trace);
        assert_eq!(lists.len(), 2);
        assert_eq!(lists[1][1].present, [0, 1, 3, 4, 5]);
        assert_eq!(lists[1][1].unprotected, [1, 3, 4]);
        assert_eq!(lists[0][1].present, trace[1].present);
        let f = fates(7, &trace);
        let fate = |p: usize| (f[p].evicted_at, f[p].held);
        assert_eq!(fate(1), (None, Some((1, 2))));
        assert_eq!(fate(2), (Some(1), Some((0, 2))));
        assert_eq!(fate(3), (None, Some((1, 2))));
        assert_eq!(fate(4), (None, Some((2, 2))));
        let page = html("t", &vec!["x".to_string(); 7], &f, 2);
        assert!(page.contains("position 1: kept to the end by 1 of 2 keep lists"));
        assert!(page.contains("position 2: evicted from the last keep list at refresh 1"));
    }

    #[test]
    fn diagnosis_against_the_oracle_by_hand() {
        // 8 positions, rows every 2 queries. One refresh before position 6
        // (h = 2): 1..=4 ranked, the policy keeps 2 and 4.
        let mut cumulative = vec![vec![0f32; 8]; 5];
        cumulative[4] = vec![9.0, 0.4, 0.1, 0.3, 0.2, 1.0, 0.5, 0.0];
        let future = FutureAttention {
            step: 2,
            len: 8,
            cumulative,
        };
        let trace = vec![RefreshRecord {
            refresh: 0,
            before_position: 6,
            present: vec![0, 1, 2, 3, 4, 5],
            protected: vec![0, 5],
            unprotected: vec![1, 2, 3, 4],
            scores: vec![0.0, 1.0, 0.0, 1.0],
            kept: vec![0, 2, 4, 5],
            kept_lists: None,
        }];
        let d = diagnose(&trace, &future, 2).unwrap();
        // The oracle keeps 1 (0.4) and 3 (0.3): no overlap; the policy evicts
        // 0.4 + 0.3, the oracle 0.1 + 0.2.
        let close = |a: f64, b: f64| assert!((a - b).abs() < 1e-6, "{a} vs {b}");
        assert_eq!((d[0].ranked, d[0].evicted), (4, 2));
        close(d[0].overlap_next, 0.0);
        close(d[0].lost_next, 0.7);
        close(d[0].oracle_lost_next, 0.3);
        close(d[0].lost_rest, 0.7);
        let pieces: Vec<String> = ["a", ",", "12", " \n", "x", "b", "c", "d"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let c = loss_by_category(&trace, &future, &pieces, 4).unwrap();
        let punct = &c["class: punctuation or symbol"];
        assert_eq!((punct.evicted, punct.oracle_evicted), (1, 0));
        close(punct.lost_rest, 0.4);
        let number = &c["class: number"];
        assert_eq!((number.evicted, number.oracle_evicted), (0, 1));
        close(number.oracle_lost_rest, 0.1);
        assert_eq!(c["class: space or newline"].evicted, 1);
        assert_eq!(c["class: word"].oracle_evicted, 1);
        // Positions 1..3 are inside the first window of 4; at the refresh
        // (position 6) 1 and 2 are 4 or more positions old.
        let early = &c["position: early (< 4)"];
        assert_eq!((early.evicted, early.oracle_evicted), (2, 1));
        let old = &c["age: old (>= 4)"];
        assert_eq!((old.evicted, old.oracle_evicted), (1, 1));
        close(old.lost_rest, 0.4);
        let mut f = fates(8, &trace);
        add_lost_attention(&mut f, &trace, &future).unwrap();
        assert_eq!(f[1].lost_attention.map(|m| (m * 10.0).round()), Some(4.0));
        assert_eq!(f[2].lost_attention, None);
        let page = html("t", &pieces, &f, 1);
        assert!(page.contains("would have received 0.300 attention later"));
    }
}
