//! Final-answer extraction and normalisation for MATH-500, GSM8K and AIME.
//!
//! MATH: the content of the last `\boxed{...}` (or `\fbox{...}`). GSM8K: the
//! number after `####` if the text has one, else the last number in the text.
//! AIME: the last `\boxed{}` if there is one, else the last number (SPEC.md
//! names the final number; models trained on MATH-style data box it).
//! Normalisation follows the usual MATH grading (Hendrycks et al.'s
//! `strip_string`) plus a canonical form for plain numbers, so that
//! `\dfrac{3}{56}` = `\frac{3}{56}`, `90^\circ` = `90`, `\text{Evelyn}` =
//! `Evelyn`, `p - q` = `p-q`, `.5` = `0.5` = `0.50`, `1,000` = `1000`.

/// The kind of answer a dataset has.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AnswerKind {
    /// `\boxed{}` (MATH-500).
    Boxed,
    /// The final number (GSM8K).
    Number,
    /// `\boxed{}` if present, else the final number (AIME).
    BoxedOrNumber,
}

/// Extracts the answer of `text`, or None (a run with no answer: pred=None).
pub fn extract(text: &str, kind: AnswerKind) -> Option<String> {
    match kind {
        AnswerKind::Boxed => last_boxed(text),
        AnswerKind::Number => after_hashes(text).or_else(|| last_number(text)),
        AnswerKind::BoxedOrNumber => last_boxed(text).or_else(|| last_number(text)),
    }
}

/// Whether a predicted answer matches the reference after normalisation.
pub fn answers_match(predicted: &str, reference: &str) -> bool {
    normalize(predicted) == normalize(reference)
}

/// The content of the last `\boxed{...}` / `\fbox{...}` (balanced braces), or
/// of `\boxed 5` (the form without braces).
pub fn last_boxed(text: &str) -> Option<String> {
    let start = ["\\boxed", "\\fbox"]
        .iter()
        .filter_map(|m| text.rfind(m).map(|i| (i, m.len())))
        .max_by_key(|&(i, _)| i)?;
    let rest = &text[start.0 + start.1..];
    if let Some(inner) = rest.strip_prefix('{') {
        let mut depth = 1;
        for (i, c) in inner.char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        return Some(inner[..i].trim().to_string());
                    }
                }
                _ => {}
            }
        }
        None // unbalanced: the answer was cut off
    } else if rest.starts_with(' ') {
        let word: String = rest
            .trim_start()
            .chars()
            .take_while(|c| !c.is_whitespace() && *c != '$')
            .collect();
        (!word.is_empty()).then_some(word)
    } else {
        None
    }
}

/// GSM8K's reference format: the number after the last `####`.
fn after_hashes(text: &str) -> Option<String> {
    let i = text.rfind("####")?;
    last_number(text[i + 4..].lines().next().unwrap_or("")).or_else(|| first_number(&text[i + 4..]))
}

fn numbers(text: &str) -> Vec<String> {
    let b = text.as_bytes();
    let mut out = vec![];
    let mut i = 0;
    while i < b.len() {
        let starts_number =
            b[i].is_ascii_digit() || (b[i] == b'.' && i + 1 < b.len() && b[i + 1].is_ascii_digit());
        if !starts_number {
            i += 1;
            continue;
        }
        let negative = i > 0 && b[i - 1] == b'-' && (i < 2 || !b[i - 2].is_ascii_alphanumeric());
        let mut j = i;
        while j < b.len() {
            let c = b[j];
            let digit_follows = j + 1 < b.len() && b[j + 1].is_ascii_digit();
            if c.is_ascii_digit() || ((c == b',' || c == b'.') && digit_follows) {
                j += 1;
            } else {
                break;
            }
        }
        let s = text[i..j].replace(',', "");
        out.push(if negative { format!("-{s}") } else { s });
        i = j;
    }
    out
}

/// The last number in `text` (commas removed, sign kept).
pub fn last_number(text: &str) -> Option<String> {
    numbers(text).pop()
}

fn first_number(text: &str) -> Option<String> {
    numbers(text).into_iter().next()
}

/// Canonical form of an answer for exact-match comparison.
pub fn normalize(answer: &str) -> String {
    let mut s = answer.trim().replace(['\n', '\r'], "");
    for (from, to) in [
        ("\\!", ""),
        ("\\\\", "\\"),
        ("\\dfrac", "\\frac"),
        ("\\tfrac", "\\frac"),
        ("\\left", ""),
        ("\\right", ""),
        ("\\displaystyle", ""),
        ("^{\\circ}", ""),
        ("^\\circ", ""),
        ("\\$", ""),
        ("$", ""),
        ("\\%", ""),
        ("%", ""),
        ("\\,", ""),
        ("\\;", ""),
    ] {
        s = s.replace(from, to);
    }
    s = unwrap_text(&s);
    // "x = 5" -> "5" when the left side is a short variable name.
    if let Some((lhs, rhs)) = s.split_once('=') {
        if lhs.trim().len() <= 2 && !rhs.contains('=') {
            s = rhs.to_string();
        }
    }
    s.retain(|c| !c.is_whitespace());
    s = fix_fracs(&s);
    if let Some(n) = canonical_number(&s) {
        return n;
    }
    // "a/b" of two integers is \frac{a}{b}.
    if let Some((a, b)) = s.split_once('/') {
        if is_integer(a) && is_integer(b) {
            return format!("\\frac{{{a}}}{{{b}}}");
        }
    }
    s
}

/// `\text{abc}` / `\textbf{abc}` / `\mbox{abc}` -> `abc`.
fn unwrap_text(s: &str) -> String {
    let mut s = s.to_string();
    for tag in ["\\text{", "\\textbf{", "\\mbox{", "\\mathrm{"] {
        while let Some(i) = s.find(tag) {
            let inner_start = i + tag.len();
            let mut depth = 1;
            let mut end = None;
            for (j, c) in s[inner_start..].char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' => {
                        depth -= 1;
                        if depth == 0 {
                            end = Some(inner_start + j);
                            break;
                        }
                    }
                    _ => {}
                }
            }
            let Some(end) = end else { break };
            s = format!("{}{}{}", &s[..i], &s[inner_start..end], &s[end + 1..]);
        }
    }
    s
}

/// `\frac12` -> `\frac{1}{2}`, `\frac1{b}` -> `\frac{1}{b}` (single-character arguments).
fn fix_fracs(s: &str) -> String {
    let parts: Vec<&str> = s.split("\\frac").collect();
    let mut out = parts[0].to_string();
    for part in &parts[1..] {
        out.push_str("\\frac");
        let mut chars = part.chars();
        match chars.next() {
            Some('{') | None => out.push_str(part),
            Some(a) => {
                let rest: String = chars.collect();
                match rest.chars().next() {
                    Some('{') => out.push_str(&format!("{{{a}}}{rest}")),
                    Some(b) => out.push_str(&format!("{{{a}}}{{{b}}}{}", &rest[b.len_utf8()..])),
                    None => out.push_str(&format!("{{{a}}}")),
                }
            }
        }
    }
    out
}

fn is_integer(s: &str) -> bool {
    let d = s.strip_prefix('-').unwrap_or(s);
    !d.is_empty() && d.bytes().all(|c| c.is_ascii_digit())
}

/// Plain decimal numbers in one form: no commas, no leading `+`, no trailing
/// zeros after the point, `.5` -> `0.5`, `-0` -> `0`.
fn canonical_number(s: &str) -> Option<String> {
    let t = s.replace(',', "");
    let t = t.strip_prefix('+').unwrap_or(&t);
    let (neg, digits) = match t.strip_prefix('-') {
        Some(d) => (true, d),
        None => (false, t),
    };
    let (int, frac) = digits.split_once('.').unwrap_or((digits, ""));
    let valid = !(int.is_empty() && frac.is_empty())
        && int.bytes().all(|c| c.is_ascii_digit())
        && frac.bytes().all(|c| c.is_ascii_digit())
        && !digits.ends_with('.');
    if !valid {
        return None;
    }
    let int = int.trim_start_matches('0');
    let frac = frac.trim_end_matches('0');
    let int = if int.is_empty() { "0" } else { int };
    let body = if frac.is_empty() {
        int.to_string()
    } else {
        format!("{int}.{frac}")
    };
    Some(if neg && body != "0" {
        format!("-{body}")
    } else {
        body
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn boxed_extraction() {
        let cases: &[(&str, Option<&str>)] = &[
            (
                "so the answer is $\\boxed{\\frac{3}{56}}$.",
                Some("\\frac{3}{56}"),
            ),
            (
                "\\boxed{1} then \\boxed{(3, \\frac{\\pi}{2})}",
                Some("(3, \\frac{\\pi}{2})"),
            ),
            ("Final: \\boxed 5$", Some("5")),
            ("\\fbox{42}", Some("42")),
            ("\\boxed{\\text{Evelyn}}", Some("\\text{Evelyn}")),
            ("no answer here", None),
            ("cut off \\boxed{\\frac{1}{", None),
        ];
        for (text, want) in cases {
            assert_eq!(last_boxed(text).as_deref(), *want, "{text}");
        }
    }

    #[test]
    fn number_extraction() {
        let gsm = "She makes 9 * 2 = $<<9*2=18>>18 every day.\n#### 18";
        assert_eq!(extract(gsm, AnswerKind::Number).as_deref(), Some("18"));
        let cases: &[(&str, Option<&str>)] = &[
            ("The total is 1,234 dollars.", Some("1234")),
            ("It drops to -5 degrees", Some("-5")),
            ("x-5 is not negative five", Some("5")),
            ("So she pays $3.50.", Some("3.50")),
            ("about .35625 of it", Some(".35625")),
            ("none", None),
        ];
        for (text, want) in cases {
            assert_eq!(
                extract(text, AnswerKind::Number).as_deref(),
                *want,
                "{text}"
            );
        }
        // AIME: the box wins, the last number is the fallback.
        let aime = "We get 25 and 73, so \\boxed{073}. Check: 3";
        assert_eq!(
            extract(aime, AnswerKind::BoxedOrNumber).as_deref(),
            Some("073")
        );
        assert_eq!(
            extract("hence 204", AnswerKind::BoxedOrNumber).as_deref(),
            Some("204")
        );
    }

    /// Pairs from ../shared/datasets (reference answer, a model's answer) that
    /// are the same answer, and pairs that are not.
    #[test]
    fn normalisation_on_real_formats() {
        let same = [
            ("\\frac{3}{56}", "\\dfrac{3}{56}"),
            ("\\frac{14}{3}", "\\tfrac{14}{3}"),
            ("90^\\circ", "90"),
            ("\\text{Evelyn}", "Evelyn"),
            (
                "\\left( 3, \\frac{\\pi}{2} \\right)",
                "(3, \\dfrac{\\pi}{2})",
            ),
            ("p - q", "p-q"),
            (".35625", "0.35625"),
            ("2.50", "2.5"),
            ("1,000", "1000"),
            ("073", "73"),
            ("\\$18", "18"),
            ("x = 5", "5"),
            ("\\frac12", "\\frac{1}{2}"),
            ("1/2", "\\frac{1}{2}"),
            ("10\\%", "10"),
            ("6 - 5i", "6-5i"),
            ("-0", "0"),
        ];
        for (a, b) in same {
            assert!(
                answers_match(a, b),
                "{a} vs {b}: {} / {}",
                normalize(a),
                normalize(b)
            );
        }
        let different = [
            ("\\frac{3}{56}", "\\frac{721}{9}"),
            ("\\text{Evelyn}", "0.21"),
            ("\\sqrt{51}", "51"),
            ("-50", "50"),
            ("(6,31,-1)", "(6,31,1)"),
            ("12", "1.2"),
        ];
        for (a, b) in different {
            assert!(!answers_match(a, b), "{a} vs {b}");
        }
    }
}
