//! `sieve eval explain`: a self-contained HTML page of a text in which every
//! token is shaded by its fate under a policy: kept to the end, or evicted at
//! which refresh, with its last score in a tooltip.

use crate::cache::RefreshRecord;

/// What happened to one position.
#[derive(Clone, Debug, PartialEq)]
pub struct Fate {
    /// Index of the refresh that evicted it (None: still cached at the end).
    pub evicted_at: Option<usize>,
    /// The last score it received (None: never ranked, e.g. protected).
    pub score: Option<f64>,
    /// Whether it was protected (sink or recent) at its last refresh.
    pub protected: bool,
}

/// The fate of each of `n` positions from the refresh records of a run.
pub fn fates(n: usize, trace: &[RefreshRecord]) -> Vec<Fate> {
    let mut out = vec![
        Fate {
            evicted_at: None,
            score: None,
            protected: false,
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
        let (class, style, what) = match f.evicted_at {
            None => ("kept", String::new(), "kept to the end".to_string()),
            Some(k) => {
                // Early evictions dark red, late ones light.
                let frac = (k + 1) as f64 / refreshes.max(1) as f64;
                let light = 45.0 + 45.0 * frac;
                (
                    "evicted",
                    format!(" style=\"background:hsl(0,75%,{light:.0}%)\""),
                    format!("evicted at refresh {k}"),
                )
            }
        };
        let score = f
            .score
            .map_or("no score (protected or never ranked)".into(), |s| {
                format!("score {s:.4}")
            });
        let prot = if f.protected { ", protected" } else { "" };
        body.push_str(&format!(
            "<span class=\"{class}\"{style} title=\"position {i}: {what}; {score}{prot}\">{}</span>",
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
            },
            RefreshRecord {
                refresh: 1,
                before_position: 6,
                present: vec![0, 2, 3, 4, 5],
                protected: vec![0, 5],
                unprotected: vec![2, 3, 4],
                scores: vec![0.2, 0.8, 0.7],
                kept: vec![0, 3, 4, 5],
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
                protected: false
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
}
