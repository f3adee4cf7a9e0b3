//! RULER's synthetic long-context tasks (Hsieh et al., 2024, "RULER: What's
//! the Real Context Size of Your Long-Context Language Models?"), generated
//! in process for any context length and tokenizer, and scored as RULER
//! scores them. Results are compared with RULER's own and with kvpress's
//! RULER runs, so what the model reads and how it is graded follow RULER's
//! reference scripts to the character: the templates and answer prefixes
//! (`scripts/data/synthetic/constants.py`), the needle and noise sentences,
//! the settings of each task (`scripts/synthetic.yaml`), the in-context
//! examples of vt and cwe, and the string matching of
//! `scripts/eval/synthetic/constants.py`.
//!
//! A prompt is the task's template followed by its answer prefix, as RULER
//! builds it (its `prepare.py` appends the answer prefix for every model;
//! this is its `base` model template): the model continues the prefix, which
//! works for base and instruction-tuned models alike and keeps the answer
//! short and in a known form. vt and cwe start with RULER's in-context
//! example (a smaller instance of the task, with its answers) as RULER's
//! prompts do.
//!
//! [`generate`] takes any token counter (a closure), so that tests need no
//! model; [`generate_with_tokenizer`] counts with the model's tokenizer.
//! [`score`] grades a prediction ([`postprocess`] first, as RULER does).
//!
//! Where this differs from RULER, and why:
//! - `qa_1` and `qa_2` are not generated: they need SQuAD and HotpotQA,
//!   which sieve does not have.
//! - The essay haystack (niah_single_2 and _3, niah_multikey_1,
//!   niah_multivalue, niah_multiquery) is the prose the caller passes (for
//!   instance the body of one of the public-domain novels under
//!   `data/prose/`), not Paul Graham's essays. As in RULER its size is
//!   counted in words and the needles go between sentences; a sentence ends
//!   at a word ending in `.`, `!` or `?` (closing quotes or brackets
//!   aside), which is simpler than NLTK's punkt (no abbreviation handling).
//!   When the prose is shorter than the context it starts again from its
//!   beginning, where RULER stops at the end of its essays.
//! - Words: RULER draws niah's keys (adjective-noun pairs) and cwe's words
//!   from the `wonderwords` package's lists. Here both come from
//!   [`word_list`]: the distinct all-lowercase ASCII words of 4 to 10
//!   letters of the prose, sorted, and a key is two of them joined by `-`.
//!   A novel gives several thousand, which cwe needs at long contexts (its
//!   rare words appear only a few times each).
//! - Randomness: a SplitMix64 seeded from (task, context length, sample
//!   index, seed) instead of Python's and NumPy's generators, so that any
//!   sample can be made alone, again, and without RULER's files; no seed
//!   gives RULER's own samples. vt's in-context example depends on the task
//!   and seed only, as RULER makes one per data set. Values have RULER's
//!   shapes: 7-digit numbers, version-4 UUIDs, 5-digit vt values.
//! - Length: RULER grows the haystack in steps (500 essay words, 25
//!   sentences or needles, 10 noises or words) for its first sample and
//!   reuses that size, shrinking it where a sample overflows; here each
//!   sample gets the largest haystack whose prompt fits, searched with the
//!   caller's token counter, so prompts are up to one RULER step longer.
//!   Every task leaves `max_new_tokens` of the context free; RULER fits
//!   fwe's prompt to the whole context, leaving no room for its answer.
//! - cwe's list holds each word of [`word_list`] at most once; where all of
//!   them fit, the prompt is shorter than the context (RULER's list stops
//!   the same way), so long contexts want a long novel.
//! - Small guards RULER leaves to chance: fwe takes at least 100 coded words
//!   so that its three answers are strictly the most frequent; the keys of
//!   a niah sample are distinct and distractor needles never reuse one; vt's
//!   variable names are always distinct.

use std::collections::{BTreeSet, HashMap, HashSet};

use anyhow::{bail, Result};

use crate::tokenizer::Tokenizer;

/// The tasks generated here, named and ordered as in RULER's
/// `synthetic.yaml`.
pub const TASKS: [&str; 11] = [
    "niah_single_1",
    "niah_single_2",
    "niah_single_3",
    "niah_multikey_1",
    "niah_multikey_2",
    "niah_multikey_3",
    "niah_multivalue",
    "niah_multiquery",
    "vt",
    "cwe",
    "fwe",
];

/// How a prediction is graded against a sample's answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Metric {
    /// RULER's `string_match_all`: the share of the answers found in the
    /// prediction (every synthetic task).
    All,
    /// RULER's `string_match_part`: whether any answer is found (RULER's qa
    /// tasks).
    Part,
}

/// One generated sample.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RulerSample {
    pub task: String,
    pub index: usize,
    /// The template filled in, followed by the answer prefix for the model
    /// to continue.
    pub prompt: String,
    pub answers: Vec<String>,
    /// RULER's `tokens_to_generate` for the task, kept free of the context.
    pub max_new_tokens: usize,
    pub metric: Metric,
}

const NIAH_TEMPLATE: &str = "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic {type_needle_v} for {query} mentioned in the provided text?";
const NIAH_ANSWER_PREFIX: &str =
    " The special magic {type_needle_v} for {query} mentioned in the provided text are";
const NIAH_NEEDLE: &str = "One of the special magic {type_needle_v} for {key} is: {value}.";
/// RULER's filler for the `repeat` haystack and vt's noise.
const NOISE: &str =
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.";
const VT_TEMPLATE: &str = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\nQuestion: Find all variables that are assigned the value {query} in the text above.";
// "assgined" is RULER's spelling; the prompts must match its own.
const VT_ANSWER_PREFIX: &str = " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are assgined the value {query}, they are: ";
const CWE_TEMPLATE: &str = "Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list?";
const CWE_ANSWER_PREFIX: &str = " Answer: The top 10 words that appear most often in the list are:";
const FWE_TEMPLATE: &str = "Read the following coded text and track the frequency of each coded word. Find the three most frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore the dots '....'. What are the three most frequently appeared words in the above coded text?";
const FWE_ANSWER_PREFIX: &str =
    " Answer: According to the coded text above, the three most frequently appeared words are:";

/// vt's in-context example is fitted to this many tokens, with vt's answer
/// budget, as RULER makes it.
const VT_ICL_CONTEXT: usize = 500;
/// Fewest distinct prose words for the tasks that draw words: enough for
/// cwe's 40-word example and for keys that rarely repeat.
const MIN_WORDS: usize = 50;
/// Fewest coded words in fwe: from 100 on, the counts of the Zipf ranks 2 to
/// 5 differ by at least one, so the three answers are strictly the most
/// frequent words after the dots.
const FWE_MIN_WORDS: usize = 100;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Haystack {
    /// Prose, needles between its sentences.
    Essay,
    /// RULER's noise sentence, one a line.
    Repeat,
    /// Distractor needles with other keys, one a line.
    Needle,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Numbers,
    Words,
    Uuids,
}

impl Kind {
    /// RULER's `type_needle_k` / `type_needle_v` name, as the prompt says it.
    fn plural(self) -> &'static str {
        match self {
            Kind::Numbers => "numbers",
            Kind::Words => "words",
            Kind::Uuids => "uuids",
        }
    }
}

/// A niah task's settings; `keys` is already RULER's
/// `max(num_needle_k, num_needle_q)`.
#[derive(Clone, Copy, Debug)]
struct Niah {
    haystack: Haystack,
    key: Kind,
    value: Kind,
    keys: usize,
    values: usize,
    queries: usize,
}

#[derive(Clone, Copy, Debug)]
enum Task {
    Niah(Niah),
    Vt {
        chains: usize,
        hops: usize,
    },
    Cwe {
        freq_cw: usize,
        freq_ucw: usize,
        num_cw: usize,
    },
    Fwe {
        alpha: f64,
    },
}

fn niah(
    haystack: Haystack,
    key: Kind,
    value: Kind,
    keys: usize,
    values: usize,
    queries: usize,
) -> Task {
    Task::Niah(Niah {
        haystack,
        key,
        value,
        keys: keys.max(queries),
        values,
        queries,
    })
}

impl Task {
    /// The settings of `synthetic.yaml`.
    fn named(name: &str) -> Option<Task> {
        use Haystack::{Essay, Needle, Repeat};
        use Kind::{Numbers, Uuids, Words};
        Some(match name {
            "niah_single_1" => niah(Repeat, Words, Numbers, 1, 1, 1),
            "niah_single_2" => niah(Essay, Words, Numbers, 1, 1, 1),
            "niah_single_3" => niah(Essay, Words, Uuids, 1, 1, 1),
            "niah_multikey_1" => niah(Essay, Words, Numbers, 4, 1, 1),
            "niah_multikey_2" => niah(Needle, Words, Numbers, 1, 1, 1),
            "niah_multikey_3" => niah(Needle, Uuids, Uuids, 1, 1, 1),
            "niah_multivalue" => niah(Essay, Words, Numbers, 1, 4, 1),
            "niah_multiquery" => niah(Essay, Words, Numbers, 1, 1, 4),
            "vt" => Task::Vt { chains: 1, hops: 4 },
            "cwe" => Task::Cwe {
                freq_cw: 30,
                freq_ucw: 3,
                num_cw: 10,
            },
            "fwe" => Task::Fwe { alpha: 2.0 },
            _ => return None,
        })
    }

    /// RULER's `tokens_to_generate`.
    fn max_new_tokens(&self) -> usize {
        match self {
            Task::Niah(_) => 128,
            Task::Vt { .. } => 30,
            Task::Cwe { .. } => 120,
            Task::Fwe { .. } => 50,
        }
    }
}

const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// SplitMix64's output function.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// SplitMix64: small, fast and good enough to shuffle and sample; written
/// here so that samples do not depend on a crate's version.
struct Rng(u64);

impl Rng {
    /// The generator of one sample: each of its inputs changes every draw.
    fn for_sample(task: &str, context: u64, index: u64, seed: u64, stream: u64) -> Rng {
        // FNV-1a of the name, so that tasks with the same seed differ.
        let name = task.bytes().fold(0xCBF2_9CE4_8422_2325u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01B3)
        });
        let mut state = seed;
        for part in [name, context, index, stream] {
            state = mix(state.wrapping_add(GOLDEN) ^ part);
        }
        Rng(state)
    }

    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(GOLDEN);
        mix(self.0)
    }

    /// Uniform in `0..n` (0 when `n` is 0).
    fn below(&mut self, n: usize) -> usize {
        ((u128::from(self.next_u64()) * n as u128) >> 64) as usize
    }

    /// Uniform in `lo..=hi`, as Python's `random.randint`.
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + ((u128::from(self.next_u64()) * u128::from(hi - lo + 1)) >> 64) as u64
    }

    fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = self.below(i + 1);
            items.swap(i, j);
        }
    }

    /// `k` distinct indices of `0..n` in random order, as Python's
    /// `random.sample(range(n), k)`: a partial Fisher-Yates shuffle that
    /// keeps only the displaced entries, so that a few draws from a long
    /// haystack cost little.
    fn sample(&mut self, n: usize, k: usize) -> Vec<usize> {
        assert!(k <= n, "sampling {k} of {n}");
        let mut moved: HashMap<usize, usize> = HashMap::new();
        let mut picked = Vec::with_capacity(k);
        for i in 0..k {
            let j = i + self.below(n - i);
            let at_j = moved.get(&j).copied().unwrap_or(j);
            let at_i = moved.get(&i).copied().unwrap_or(i);
            moved.insert(j, at_i);
            picked.push(at_j);
        }
        picked
    }

    /// A random version-4 UUID, as Python's
    /// `uuid.UUID(int=random.getrandbits(128), version=4)`.
    fn uuid(&mut self) -> String {
        let hi = (self.next_u64() & !0xF000_u64) | 0x4000;
        let lo = (self.next_u64() & !0xC000_0000_0000_0000_u64) | 0x8000_0000_0000_0000;
        format!(
            "{:08x}-{:04x}-{:04x}-{:04x}-{:012x}",
            hi >> 32,
            (hi >> 16) & 0xFFFF,
            hi & 0xFFFF,
            lo >> 48,
            lo & 0xFFFF_FFFF_FFFF
        )
    }
}

/// A prompt and its answers, for one haystack size.
struct Built {
    prompt: String,
    answers: Vec<String>,
}

/// The words that stand in for RULER's `wonderwords` lists (see the module
/// notes): the distinct all-lowercase ASCII words of 4 to 10 letters of
/// `prose`, sorted. Capitalized words are left out so that names do not
/// become keys, and words with other letters so that no fragment of one does.
pub fn word_list(prose: &str) -> Vec<String> {
    let words: BTreeSet<&str> = prose
        .split(|c: char| !c.is_alphabetic())
        .filter(|w| (4..=10).contains(&w.len()) && w.bytes().all(|b| b.is_ascii_lowercase()))
        .collect();
    words.into_iter().map(str::to_string).collect()
}

fn enough_words(task: &str, words: &[String]) -> Result<()> {
    if words.len() < MIN_WORDS {
        bail!(
            "RULER task {task} draws its words from the prose, which has only {} distinct \
             lowercase words of 4 to 10 letters; it needs at least {MIN_WORDS}",
            words.len()
        );
    }
    Ok(())
}

/// One sample of `task` (one of [`TASKS`]) whose prompt takes at most
/// `context - max_new_tokens` tokens as `count_tokens` counts them, with as
/// large a haystack as fits. `prose` is the essay haystack and the source of
/// words (see [`word_list`]); vt and fwe do not use it. The same arguments
/// always give the same sample.
pub fn generate(
    task: &str,
    count_tokens: &dyn Fn(&str) -> Result<usize>,
    prose: &str,
    context: usize,
    index: usize,
    seed: u64,
) -> Result<RulerSample> {
    let Some(config) = Task::named(task) else {
        bail!(
            "unknown RULER task {task:?}; the tasks are {}",
            TASKS.join(", ")
        );
    };
    let max_new = config.max_new_tokens();
    let rng = || Rng::for_sample(task, context as u64, index as u64, seed, 0);
    let built = match config {
        Task::Niah(cfg) => {
            let words = if cfg.key == Kind::Words || cfg.value == Kind::Words {
                let words = word_list(prose);
                enough_words(task, &words)?;
                words
            } else {
                Vec::new()
            };
            let prose_words: Vec<&str> = prose.split_whitespace().collect();
            let min = if cfg.haystack == Haystack::Essay {
                if prose_words.is_empty() {
                    bail!("RULER task {task} hides its needles in prose, and the prose is empty");
                }
                1
            } else {
                cfg.keys * cfg.values
            };
            fit(
                task,
                context,
                max_new,
                min,
                2 * context + min,
                count_tokens,
                &|n: usize| -> Result<Built> {
                    Ok(niah_prompt(&cfg, n, &words, &prose_words, &mut rng()))
                },
            )?
        }
        Task::Vt { chains, hops } => {
            let links = hops + 1;
            // One noise splits into six pieces, which must outnumber a chain's
            // links (RULER would otherwise cut the chains).
            let min = 1 + links / 6;
            let icl_template = vt_icl_template();
            let icl = fit(
                &format!("{task} (its in-context example)"),
                VT_ICL_CONTEXT,
                max_new,
                min,
                2 * VT_ICL_CONTEXT + min,
                count_tokens,
                &|n: usize| -> Result<Built> {
                    let mut r = Rng::for_sample(task, 0, 0, seed, 1);
                    let (text, vars, value) = vt_text(chains, hops.min(10), 3, n, &mut r);
                    Ok(Built {
                        prompt: vt_prompt(&icl_template, &text, &value, links),
                        answers: vars,
                    })
                },
            )?;
            // RULER puts the example, its answers and a blank line before the
            // task's own prompt.
            let example = format!(" {} {}\n\n\n\n", icl.prompt, icl.answers.join(" "));
            let template = [VT_TEMPLATE, VT_ANSWER_PREFIX].concat();
            fit(
                task,
                context,
                max_new,
                min,
                2 * context + min,
                count_tokens,
                &|n: usize| -> Result<Built> {
                    let (text, vars, value) = vt_text(chains, hops, 5, n, &mut rng());
                    Ok(Built {
                        prompt: format!("{example}{}", vt_prompt(&template, &text, &value, links)),
                        answers: vars,
                    })
                },
            )?
        }
        Task::Cwe {
            freq_cw,
            freq_ucw,
            num_cw,
        } => {
            let words = word_list(prose);
            enough_words(task, &words)?;
            // Below 4096 tokens RULER repeats words less and shows a smaller
            // example: (words, common repeats, rare repeats).
            let (example, common, rare) = if context < 4096 {
                ((20, 3, 1), 6, 1)
            } else {
                ((40, 10, 3), freq_cw, freq_ucw)
            };
            let template = [CWE_TEMPLATE, CWE_ANSWER_PREFIX].concat();
            fit(
                task,
                context,
                max_new,
                num_cw,
                words.len(),
                count_tokens,
                &|n: usize| -> Result<Built> {
                    let mut r = rng();
                    let (ex_list, ex_answers) =
                        cwe_list(&words, example.0, example.1, example.2, num_cw, &mut r);
                    let (list, answers) = cwe_list(&words, n, common, rare, num_cw, &mut r);
                    // The example's answers follow its answer prefix with no
                    // space, as in RULER.
                    let prompt = format!(
                        "{}{}\n{}",
                        template.replace("{context}", &ex_list),
                        numbered(&ex_answers),
                        template.replace("{context}", &list)
                    );
                    Ok(Built { prompt, answers })
                },
            )?
        }
        Task::Fwe { alpha } => {
            // RULER's vocabulary size; the floor keeps three answers after the
            // dots at any context.
            let vocab_size = (context / 50).max(5);
            let template = [FWE_TEMPLATE, FWE_ANSWER_PREFIX].concat();
            let zeta = zeta(alpha);
            fit(
                task,
                context,
                max_new,
                FWE_MIN_WORDS,
                2 * context + FWE_MIN_WORDS,
                count_tokens,
                &|n: usize| -> Result<Built> {
                    let mut r = rng();
                    let vocab = coded_vocab(vocab_size, &mut r);
                    let mut text: Vec<&str> = Vec::new();
                    for (k, word) in vocab.iter().enumerate() {
                        // Zipf's law: rank k appears n * k^-alpha / zeta(alpha) times.
                        let count = (n as f64 * ((k + 1) as f64).powf(-alpha) / zeta) as usize;
                        text.extend(std::iter::repeat_n(word.as_str(), count));
                    }
                    r.shuffle(&mut text);
                    Ok(Built {
                        prompt: template.replace("{context}", &text.join(" ")),
                        answers: vocab[1..4].to_vec(),
                    })
                },
            )?
        }
    };
    Ok(RulerSample {
        task: task.to_string(),
        index,
        prompt: built.prompt,
        answers: built.answers,
        max_new_tokens: max_new,
        metric: Metric::All,
    })
}

/// [`generate`] counting tokens as `tok` encodes the prompt for the model
/// (a BOS token included where the model adds one; RULER counts without
/// special tokens).
pub fn generate_with_tokenizer(
    task: &str,
    tok: &Tokenizer,
    prose: &str,
    context: usize,
    index: usize,
    seed: u64,
) -> Result<RulerSample> {
    let count = |text: &str| -> Result<usize> { Ok(tok.encode(text)?.len()) };
    generate(task, &count, prose, context, index, seed)
}

/// The largest haystack size in `min..=max` whose prompt fits
/// `context - max_new` tokens. Token counts grow about linearly with the
/// size, so the search extrapolates to overshoot the answer a little, then
/// narrows it alternating interpolation (fast near a straight line) and
/// bisection (sure when the counts wobble): a few tokenizations of the long
/// prompt rather than RULER's dozens of fixed steps. Only sizes seen to fit
/// are kept, so the result fits even where the counts are not monotonic.
fn fit(
    label: &str,
    context: usize,
    max_new: usize,
    min: usize,
    max: usize,
    count_tokens: &dyn Fn(&str) -> Result<usize>,
    build: &dyn Fn(usize) -> Result<Built>,
) -> Result<Built> {
    let budget = context.saturating_sub(max_new);
    let max = max.max(min);
    let smallest = build(min)?;
    let first = count_tokens(&smallest.prompt)?;
    if first > budget {
        bail!(
            "RULER task {label} does not fit a context of {context} tokens: its smallest \
             haystack already makes a prompt of {first} tokens, and {max_new} tokens must stay \
             free for the answer"
        );
    }
    // `lo` fits, in `lo_used` tokens; `hi`, once found, does not.
    let (mut lo, mut lo_used, mut best) = (min, first, smallest);
    let mut hi: Option<(usize, usize)> = None;
    let mut interpolate = true;
    loop {
        let next = match hi {
            None if lo >= max => break,
            None => {
                let grown = lo - min;
                let guess = if lo_used > first {
                    let per_unit = (lo_used - first) as f64 / grown as f64;
                    min + ((budget - first) as f64 / per_unit * 1.05) as usize + 1
                } else {
                    lo + grown + 16
                };
                guess.max(lo + grown / 4 + 1).min(max)
            }
            Some((h, _)) if h - lo <= 1 => break,
            Some((h, h_used)) => {
                let guess = if interpolate {
                    let share = (budget - lo_used) as f64 / (h_used - lo_used) as f64;
                    lo + (share * (h - lo) as f64) as usize
                } else {
                    lo + (h - lo) / 2
                };
                interpolate = !interpolate;
                guess.clamp(lo + 1, h - 1)
            }
        };
        let candidate = build(next)?;
        let used = count_tokens(&candidate.prompt)?;
        if used <= budget {
            lo = next;
            lo_used = used;
            best = candidate;
        } else {
            hi = Some((next, used));
        }
    }
    Ok(best)
}

/// A needle sentence; the type is always plural here, as in RULER.
fn needle(kind: Kind, key: &str, value: &str) -> String {
    NIAH_NEEDLE
        .replace("{type_needle_v}", kind.plural())
        .replace("{key}", key)
        .replace("{value}", value)
}

/// A random key or value of RULER's kinds.
fn random_item(kind: Kind, words: &[String], rng: &mut Rng) -> String {
    match kind {
        Kind::Numbers => rng.range(1_000_000, 9_999_999).to_string(),
        Kind::Words => {
            let first = rng.below(words.len());
            let second = rng.below(words.len());
            format!("{}-{}", words[first], words[second])
        }
        Kind::Uuids => rng.uuid(),
    }
}

/// A key of `kind` not in `taken`.
fn fresh_key(kind: Kind, words: &[String], taken: &[String], rng: &mut Rng) -> String {
    loop {
        let key = random_item(kind, words, rng);
        if !taken.contains(&key) {
            return key;
        }
    }
}

/// RULER's needle depths in percent, `np.round(np.linspace(0, 100, 40))`;
/// `i` in `0..40` (no value falls on a half, so rounding modes agree).
fn depth(i: usize) -> usize {
    (100.0 * i as f64 / 39.0).round() as usize
}

/// Whether a prose word ends a sentence.
fn ends_sentence(word: &str) -> bool {
    word.trim_end_matches(['"', '\'', ')', ']', '\u{201D}', '\u{2019}'])
        .ends_with(['.', '!', '?'])
}

/// The first `size` words of the prose (started again when it runs out),
/// cut into sentences.
fn sentences(prose: &[&str], size: usize) -> Vec<String> {
    let mut out = Vec::new();
    let mut current = String::new();
    for &word in prose.iter().cycle().take(size) {
        if !current.is_empty() {
            current.push(' ');
        }
        current.push_str(word);
        if ends_sentence(word) {
            out.push(std::mem::take(&mut current));
        }
    }
    if !current.is_empty() {
        out.push(current);
    }
    out
}

/// A niah prompt with a haystack of `size` units (essay words, noise lines
/// or distractor needles), following RULER's `niah.py`.
fn niah_prompt(cfg: &Niah, size: usize, words: &[String], prose: &[&str], rng: &mut Rng) -> Built {
    let mut keys: Vec<String> = Vec::with_capacity(cfg.keys);
    let mut values: Vec<Vec<String>> = Vec::with_capacity(cfg.keys);
    let mut needles = Vec::with_capacity(cfg.keys * cfg.values);
    for _ in 0..cfg.keys {
        let key = fresh_key(cfg.key, words, &keys, rng);
        let vs: Vec<String> = (0..cfg.values)
            .map(|_| random_item(cfg.value, words, rng))
            .collect();
        for v in &vs {
            needles.push(needle(cfg.value, &key, v));
        }
        keys.push(key);
        values.push(vs);
    }
    rng.shuffle(&mut needles);
    // Drawn before the haystack so that the question and answers are the
    // same at every haystack size.
    let queried = rng.sample(cfg.keys, cfg.queries);
    let answers: Vec<String> = queried
        .iter()
        .flat_map(|&i| values[i].iter().cloned())
        .collect();
    let query_keys: Vec<&str> = queried.iter().map(|&i| keys[i].as_str()).collect();
    let query = match query_keys.split_last() {
        Some((last, rest)) if !rest.is_empty() => format!("{}, and {last}", rest.join(", ")),
        _ => query_keys.concat(),
    };

    let context = match cfg.haystack {
        Haystack::Essay => {
            let sentences = sentences(prose, size);
            let mut cuts: Vec<usize> = rng
                .sample(40, needles.len())
                .into_iter()
                .map(|i| (sentences.len() as f64 * (depth(i) as f64 / 100.0)) as usize)
                .collect();
            cuts.sort_unstable();
            let mut parts = Vec::with_capacity(2 * needles.len() + 1);
            let mut from = 0;
            for (&cut, needle) in cuts.iter().zip(&needles) {
                parts.push(sentences[from..cut].join(" "));
                parts.push(needle.clone());
                from = cut;
            }
            parts.push(sentences[from..].join(" "));
            parts.join(" ")
        }
        Haystack::Repeat | Haystack::Needle => {
            let mut lines: Vec<String> = Vec::with_capacity(size + needles.len());
            for _ in 0..size {
                lines.push(if cfg.haystack == Haystack::Repeat {
                    NOISE.to_string()
                } else {
                    let key = fresh_key(cfg.key, words, &keys, rng);
                    let value = random_item(cfg.value, words, rng);
                    needle(cfg.value, &key, &value)
                });
            }
            // From the last position back, so that earlier ones stay put.
            let mut at = rng.sample(size, needles.len());
            at.sort_unstable();
            for (&i, needle) in at.iter().rev().zip(&needles) {
                lines.insert(i, needle.clone());
            }
            lines.join("\n")
        }
    };

    let mut template = [NIAH_TEMPLATE, NIAH_ANSWER_PREFIX].concat();
    let mut kind = cfg.value.plural().to_string();
    // One answer: RULER words the question in the singular.
    if cfg.queries * cfg.values == 1 {
        template = template
            .replace("Some", "A")
            .replace("are all", "is")
            .replace("are", "is")
            .replace("answers", "answer");
        kind.pop();
    }
    let prompt = template
        .replace("{type_needle_v}", &kind)
        .replace("{query}", &query)
        .replace("{context}", &context);
    Built { prompt, answers }
}

/// The template of vt's in-context example, derived as RULER derives it
/// from the base prompt: the text before the answer prefix with its
/// whitespace collapsed and its last word dropped (RULER means to drop a
/// chat template's closing tag; with the base template that is "above."),
/// then the answer prefix.
fn vt_icl_template() -> String {
    let words: Vec<&str> = VT_TEMPLATE.split_whitespace().collect();
    format!("{}{VT_ANSWER_PREFIX}", words[..words.len() - 1].join(" "))
}

fn vt_prompt(template: &str, text: &str, value: &str, links: usize) -> String {
    template
        .replace("{num_v}", &links.to_string())
        .replace("{query}", value)
        .replace("{context}", text)
}

/// vt's context with `noises` noise paragraphs: the text, the variables of
/// the first chain (the answers) and its value, following RULER's
/// `variable_tracking.py`.
fn vt_text(
    chains: usize,
    hops: usize,
    name_len: usize,
    noises: usize,
    rng: &mut Rng,
) -> (String, Vec<String>, String) {
    let links = hops + 1;
    let mut seen = HashSet::new();
    let mut vars: Vec<String> = Vec::with_capacity(chains * links);
    while vars.len() < chains * links {
        let name: String = (0..name_len)
            .map(|_| (b'A' + rng.below(26) as u8) as char)
            .collect();
        if seen.insert(name.clone()) {
            vars.push(name);
        }
    }
    let mut first_value = None;
    let mut assignments: Vec<Vec<String>> = Vec::with_capacity(chains);
    for chain in vars.chunks(links) {
        // NumPy's randint(10000, 99999) excludes its upper end.
        let value = rng.range(10_000, 99_998).to_string();
        let mut lines = vec![format!("VAR {} = {value}", chain[0])];
        for pair in chain.windows(2) {
            // The trailing space is RULER's.
            lines.push(format!("VAR {} = VAR {} ", pair[1], pair[0]));
        }
        if first_value.is_none() {
            first_value = Some(value);
        }
        assignments.push(lines);
    }

    let noise = format!("{NOISE}\n");
    let mut sentences: Vec<String> = vec![noise; noises];
    if sentences.len() <= links {
        // Too few noises for the chain: RULER splits them into sentences.
        sentences = sentences
            .iter()
            .flat_map(|s| s.split('.'))
            .map(|p| {
                if p.trim().is_empty() {
                    p.to_string()
                } else {
                    format!("{p}.")
                }
            })
            .collect();
    }
    for lines in &assignments {
        let mut at = rng.sample(sentences.len(), lines.len());
        at.sort_unstable();
        for (j, (&i, line)) in at.iter().zip(lines).enumerate() {
            sentences.insert(i + j, line.clone());
        }
    }
    let text = sentences.join(" ").replace(". \n", ".\n");
    (
        text,
        vars[..links].to_vec(),
        first_value.unwrap_or_default(),
    )
}

/// cwe's numbered list of `count` distinct words, the first `num_common`
/// repeated `common` times and the others `rare` times, shuffled; and the
/// common words (the answers).
fn cwe_list(
    words: &[String],
    count: usize,
    common: usize,
    rare: usize,
    num_common: usize,
    rng: &mut Rng,
) -> (String, Vec<String>) {
    let chosen: Vec<&str> = rng
        .sample(words.len(), count)
        .into_iter()
        .map(|i| words[i].as_str())
        .collect();
    let (frequent, others) = chosen.split_at(num_common.min(chosen.len()));
    let mut list: Vec<&str> = Vec::with_capacity(frequent.len() * common + others.len() * rare);
    for _ in 0..common {
        list.extend_from_slice(frequent);
    }
    for _ in 0..rare {
        list.extend_from_slice(others);
    }
    rng.shuffle(&mut list);
    let answers = frequent.iter().map(|w| w.to_string()).collect();
    (numbered(&list), answers)
}

/// "1. first 2. second ...", as RULER numbers its lists.
fn numbered<S: AsRef<str>>(words: &[S]) -> String {
    words
        .iter()
        .enumerate()
        .map(|(i, w)| format!("{}. {}", i + 1, w.as_ref()))
        .collect::<Vec<_>>()
        .join(" ")
}

/// fwe's coded vocabulary: `size` distinct random six-letter words, sorted
/// then shuffled (the order is the Zipf rank), the first replaced by the
/// dots RULER uses as noise.
fn coded_vocab(size: usize, rng: &mut Rng) -> Vec<String> {
    let mut seen = HashSet::new();
    while seen.len() < size {
        let word: String = (0..6)
            .map(|_| (b'a' + rng.below(26) as u8) as char)
            .collect();
        seen.insert(word);
    }
    let mut vocab: Vec<String> = seen.into_iter().collect();
    vocab.sort_unstable();
    rng.shuffle(&mut vocab);
    vocab[0] = "...".to_string();
    vocab
}

/// The Riemann zeta function at `s > 1` (SciPy's `zeta(s)`, which RULER
/// normalizes fwe's counts with), by Euler-Maclaurin: the first terms, then
/// the tail's integral and end corrections.
fn zeta(s: f64) -> f64 {
    const TERMS: usize = 1000;
    let n = TERMS as f64;
    let head: f64 = (1..TERMS).map(|k| (k as f64).powf(-s)).sum();
    head + n.powf(1.0 - s) / (s - 1.0) + 0.5 * n.powf(-s) + s / 12.0 * n.powf(-s - 1.0)
}

/// RULER's grade of one prediction, as a fraction (RULER reports the mean
/// over samples times 100): with [`Metric::All`] the share of `answers`
/// found in the prediction, with [`Metric::Part`] 1 if any is; both ignore
/// case. No answers grade 0.
pub fn score(metric: Metric, prediction: &str, answers: &[String]) -> f64 {
    if answers.is_empty() {
        return 0.0;
    }
    let prediction = prediction.to_lowercase();
    let found = answers
        .iter()
        .filter(|a| prediction.contains(a.to_lowercase().as_str()))
        .count();
    match metric {
        Metric::All => found as f64 / answers.len() as f64,
        Metric::Part => {
            if found > 0 {
                1.0
            } else {
                0.0
            }
        }
    }
}

/// RULER's `postprocess_pred` (`scripts/eval/evaluate.py`), applied to a
/// prediction before it is stored and graded: trimmed, every control
/// character (U+0000 to U+001F) made a newline, trimmed again. Grading does
/// not depend on it (answers hold no control characters), but the stored
/// predictions then read as RULER's.
pub fn postprocess(prediction: &str) -> String {
    let replaced: String = prediction
        .trim()
        .chars()
        .map(|c| if u32::from(c) < 0x20 { '\n' } else { c })
        .collect();
    replaced.trim().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stand-in tokenizer: one token per whitespace-separated word.
    fn word_count(text: &str) -> Result<usize> {
        Ok(text.split_whitespace().count())
    }

    /// Prose of 1000 eight-word sentences over 2003 made-up six-letter
    /// words: no file needed, and none of its words can pass for a needle,
    /// a variable or a coded word.
    fn prose() -> String {
        const CONSONANTS: &[u8] = b"bdfgklmnprstvz";
        const VOWELS: &[u8] = b"aeiou";
        let syllable = |i: usize| {
            let i = i % (CONSONANTS.len() * VOWELS.len());
            let c = CONSONANTS[i % CONSONANTS.len()] as char;
            let v = VOWELS[i / CONSONANTS.len()] as char;
            format!("{c}{v}")
        };
        let word = |i: usize| format!("{}{}{}", syllable(i), syllable(i / 70), syllable(i / 4900));
        (0..1000)
            .map(|s| {
                let words: Vec<String> = (0..8).map(|w| word((s * 8 + w) * 7 % 2003)).collect();
                format!("{}.", words.join(" "))
            })
            .collect::<Vec<_>>()
            .join(" ")
    }

    fn is_number(s: &str) -> bool {
        s.len() == 7 && s.bytes().all(|b| b.is_ascii_digit()) && !s.starts_with('0')
    }

    fn is_uuid(s: &str) -> bool {
        let parts: Vec<&str> = s.split('-').collect();
        parts.iter().map(|p| p.len()).eq([8, 4, 4, 4, 12])
            && s.chars().all(|c| matches!(c, '-' | '0'..='9' | 'a'..='f'))
            && parts[2].starts_with('4')
            && parts[3].starts_with(|c: char| "89ab".contains(c))
    }

    /// The text between the last `start` and the first `end` after it.
    fn between<'a>(text: &'a str, start: &str, end: &str) -> &'a str {
        let from = text
            .rfind(start)
            .unwrap_or_else(|| panic!("no {start:?} in {text:?}"))
            + start.len();
        let to = from
            + text[from..]
                .find(end)
                .unwrap_or_else(|| panic!("no {end:?} after {start:?}"));
        &text[from..to]
    }

    /// Every (key, value) of a needle sentence in the prompt.
    fn needles(prompt: &str) -> Vec<(&str, &str)> {
        prompt
            .split("One of the special magic ")
            .skip(1)
            .map(|part| {
                let (_, rest) = part.split_once(" for ").expect("a key");
                let (key, rest) = rest.split_once(" is: ").expect("a value");
                let (value, _) = rest.split_once('.').expect("a full stop");
                (key, value)
            })
            .collect()
    }

    /// The needles of the queried keys, counted in the prompt, hold exactly
    /// the answers.
    fn check_niah(s: &RulerSample) {
        let task = s.task.as_str();
        let query = between(&s.prompt, " for ", " mentioned in the provided text");
        let keys: Vec<&str> = query
            .split(", ")
            .map(|k| k.trim_start_matches("and "))
            .collect();
        let all = needles(&s.prompt);
        let mut found: Vec<&str> = all
            .iter()
            .filter(|(k, _)| keys.contains(k))
            .map(|&(_, v)| v)
            .collect();
        let mut expected: Vec<&str> = s.answers.iter().map(String::as_str).collect();
        found.sort_unstable();
        expected.sort_unstable();
        assert_eq!(found, expected, "{task}: the queried keys' needles");
        let (queries, values, hidden) = match task {
            "niah_single_1" | "niah_single_2" | "niah_single_3" => (1, 1, 1),
            "niah_multikey_1" => (1, 1, 4),
            "niah_multivalue" => (1, 4, 4),
            "niah_multiquery" => (4, 1, 4),
            _ => (1, 1, 0),
        };
        assert_eq!(keys.len(), queries, "{task}: {query}");
        assert_eq!(s.answers.len(), queries * values, "{task}");
        if hidden > 0 {
            assert_eq!(all.len(), hidden, "{task}: needles in the haystack");
        } else {
            assert!(all.len() > 10, "{task}: a haystack of needles");
        }
        for a in &s.answers {
            if task == "niah_single_3" || task == "niah_multikey_3" {
                assert!(is_uuid(a), "{task}: {a}");
            } else {
                assert!(is_number(a), "{task}: {a}");
            }
        }
    }

    fn resolve<'a>(from: &HashMap<&'a str, &'a str>, mut v: &'a str) -> &'a str {
        while let Some(&next) = from.get(v) {
            v = next;
        }
        v
    }

    /// The variables whose chain, parsed from the task's own text, ends in
    /// the queried value are exactly the answers; the example comes first.
    fn check_vt(s: &RulerSample) {
        assert!(s.prompt.starts_with(
            " Memorize and track the chain(s) of variable assignment hidden in the following \
             text. "
        ));
        let example_answers = between(&s.prompt, "they are:  ", "\n\n\n\nMemorize");
        let names: Vec<&str> = example_answers.split(' ').collect();
        assert_eq!(names.len(), 5, "{example_answers:?}");
        assert!(names
            .iter()
            .all(|n| n.len() == 3 && n.bytes().all(|b| b.is_ascii_uppercase())));
        let head =
            "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n";
        let text = between(&s.prompt, head, "\nQuestion: ");
        let value = between(&s.prompt, "assigned the value ", " in the text above.");
        let t: Vec<&str> = text.split_whitespace().collect();
        let mut from: HashMap<&str, &str> = HashMap::new();
        let mut i = 0;
        while i + 3 < t.len() {
            if t[i] == "VAR" && t[i + 2] == "=" {
                if t[i + 3] == "VAR" {
                    from.insert(t[i + 1], t[i + 4]);
                    i += 5;
                } else {
                    from.insert(t[i + 1], t[i + 3]);
                    i += 4;
                }
            } else {
                i += 1;
            }
        }
        let mut found: Vec<&str> = from
            .keys()
            .copied()
            .filter(|&v| resolve(&from, v) == value)
            .collect();
        let mut expected: Vec<&str> = s.answers.iter().map(String::as_str).collect();
        found.sort_unstable();
        expected.sort_unstable();
        assert_eq!(found, expected);
        assert_eq!(expected.len(), 5);
        assert_eq!(value.len(), 5);
        assert!(s.prompt.ends_with(&format!(
            "5 variables are assgined the value {value}, they are: "
        )));
    }

    /// The answers are the ten words most frequent in the task's own list,
    /// counted from it; the example's answers follow their prefix.
    fn check_cwe(s: &RulerSample) {
        assert!(s
            .prompt
            .contains(" Answer: The top 10 words that appear most often in the list are:1. "));
        let text = between(
            &s.prompt,
            "Memorize the ones that appear most often.\n",
            "\nQuestion: ",
        );
        let mut counts: HashMap<&str, usize> = HashMap::new();
        let mut next_number = 1;
        for item in text.split_whitespace() {
            match item.strip_suffix('.') {
                Some(n) if n.bytes().all(|b| b.is_ascii_digit()) => {
                    assert_eq!(n, next_number.to_string());
                    next_number += 1;
                }
                _ => *counts.entry(item).or_default() += 1,
            }
        }
        assert_eq!(s.answers.len(), 10);
        let least_answer = s
            .answers
            .iter()
            .map(|a| counts.get(a.as_str()).copied().unwrap_or(0))
            .min()
            .unwrap();
        let most_other = counts
            .iter()
            .filter(|&(w, _)| !s.answers.iter().any(|a| a.as_str() == *w))
            .map(|(_, &c)| c)
            .max()
            .unwrap_or(0);
        assert!(least_answer > most_other, "{least_answer} vs {most_other}");
        assert!(counts.len() > 100, "{} distinct words", counts.len());
    }

    /// The answers are the three most frequent coded words after the dots,
    /// in order, counted from the text.
    fn check_fwe(s: &RulerSample) {
        let text = between(
            &s.prompt,
            "Find the three most frequently appeared coded words. ",
            "\nQuestion: ",
        );
        let mut counts: HashMap<&str, usize> = HashMap::new();
        for w in text.split_whitespace() {
            *counts.entry(w).or_default() += 1;
        }
        let dots = counts.remove("...").unwrap_or(0);
        let mut ranked: Vec<(&str, usize)> = counts.into_iter().collect();
        ranked.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
        let top: Vec<&str> = ranked[..3].iter().map(|r| r.0).collect();
        assert_eq!(top, s.answers);
        assert!(ranked[2].1 > ranked[3].1, "{ranked:?}");
        assert!(dots > ranked[0].1);
        assert!(ranked.iter().all(|(w, _)| w.len() == 6));
    }

    #[test]
    fn samples_are_deterministic_and_vary_with_index_and_seed() {
        let prose = prose();
        for task in TASKS {
            let a = generate(task, &word_count, &prose, 1024, 3, 11).unwrap();
            let again = generate(task, &word_count, &prose, 1024, 3, 11).unwrap();
            assert_eq!(a, again, "{task}");
            assert_eq!((a.task.as_str(), a.index), (task, 3));
            let other_index = generate(task, &word_count, &prose, 1024, 4, 11).unwrap();
            let other_seed = generate(task, &word_count, &prose, 1024, 3, 12).unwrap();
            assert_ne!(a.prompt, other_index.prompt, "{task}");
            assert_ne!(a.prompt, other_seed.prompt, "{task}");
        }
    }

    #[test]
    fn every_task_fills_its_context_and_hides_its_answers() {
        let prose = prose();
        for task in TASKS {
            let s = generate(task, &word_count, &prose, 1024, 0, 42).unwrap();
            let max_new = match task {
                "vt" => 30,
                "cwe" => 120,
                "fwe" => 50,
                _ => 128,
            };
            assert_eq!(s.max_new_tokens, max_new, "{task}");
            assert_eq!(s.metric, Metric::All);
            let budget = 1024 - max_new;
            let used = word_count(&s.prompt).unwrap();
            assert!(used <= budget, "{task}: {used} words for {budget}");
            assert!(used * 10 > budget * 8, "{task}: {used} words for {budget}");
            match task {
                "vt" => check_vt(&s),
                "cwe" => check_cwe(&s),
                "fwe" => check_fwe(&s),
                _ => check_niah(&s),
            }
        }
    }

    #[test]
    fn niah_single_1_reads_as_rulers() {
        let prose = prose();
        let s = generate("niah_single_1", &word_count, &prose, 248, 0, 42).unwrap();
        assert_eq!(s.answers.len(), 1);
        let value = &s.answers[0];
        assert!(is_number(value), "{value}");
        // 48 words of template and question, a 10-word needle and 19 words a
        // noise line: three lines fit the 120 words left of 248.
        assert_eq!(word_count(&s.prompt).unwrap(), 115);
        let lines: Vec<&str> = s.prompt.split('\n').collect();
        assert_eq!(lines.len(), 6, "{}", s.prompt);
        assert_eq!(
            lines[0],
            "A special magic number is hidden within the following text. Make sure to memorize \
             it. I will quiz you about the number afterwards."
        );
        let noise =
            "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.";
        let hidden: Vec<&str> = lines[1..5]
            .iter()
            .copied()
            .filter(|l| *l != noise)
            .collect();
        assert_eq!(hidden.len(), 1, "{}", s.prompt);
        let key = hidden[0]
            .strip_prefix("One of the special magic numbers for ")
            .and_then(|rest| rest.strip_suffix(&format!(" is: {value}.")))
            .unwrap_or_else(|| panic!("needle {:?}", hidden[0]));
        let (first, second) = key.split_once('-').unwrap();
        let words = word_list(&prose);
        assert!(words.iter().any(|w| w == first) && words.iter().any(|w| w == second));
        assert_eq!(
            lines[5],
            format!(
                "What is the special magic number for {key} mentioned in the provided text? The \
                 special magic number for {key} mentioned in the provided text is"
            )
        );
    }

    #[test]
    fn plural_niah_questions_keep_rulers_wording() {
        let prose = prose();
        let s = generate("niah_multivalue", &word_count, &prose, 1024, 0, 1).unwrap();
        assert!(s.prompt.starts_with(
            "Some special magic numbers are hidden within the following text. Make sure to \
             memorize it. I will quiz you about the numbers afterwards.\n"
        ));
        let key = between(&s.prompt, " for ", " mentioned in the provided text");
        assert!(s.prompt.ends_with(&format!(
            "\nWhat are all the special magic numbers for {key} mentioned in the provided text? \
             The special magic numbers for {key} mentioned in the provided text are"
        )));
        let s = generate("niah_multiquery", &word_count, &prose, 1024, 0, 1).unwrap();
        let query = between(&s.prompt, " for ", " mentioned in the provided text");
        assert_eq!(query.matches(", ").count(), 3, "{query}");
        assert!(query.contains(", and "), "{query}");
        let s = generate("niah_single_3", &word_count, &prose, 1024, 0, 1).unwrap();
        assert!(s.prompt.starts_with("A special magic uuid is hidden"));
    }

    #[test]
    fn too_short_a_context_names_the_task() {
        let prose = prose();
        for task in TASKS {
            let err = generate(task, &word_count, &prose, 150, 0, 0).unwrap_err();
            let message = format!("{err:#}");
            assert!(message.contains(task), "{message}");
            assert!(message.contains("150"), "{message}");
        }
    }

    #[test]
    fn unknown_tasks_and_thin_prose_are_errors() {
        let prose = prose();
        let message = generate("qa_1", &word_count, &prose, 4096, 0, 0)
            .unwrap_err()
            .to_string();
        assert!(message.contains("qa_1") && message.contains("niah_single_1"));
        assert!(message.contains("fwe"), "{message}");
        let message = generate("cwe", &word_count, "too few words here", 4096, 0, 0)
            .unwrap_err()
            .to_string();
        assert!(message.contains("cwe"), "{message}");
        let uuids_only = generate("niah_multikey_3", &word_count, "", 1024, 0, 0);
        assert!(uuids_only.is_ok(), "uuid keys need no prose");
    }

    #[test]
    fn scoring_matches_rulers_string_match() {
        let answers = ["1234567".to_string(), "7654321".to_string()];
        let both = "The numbers are 1234567 and 7654321.";
        let one = "The numbers are 1234567 and 7654322.";
        assert_eq!(score(Metric::All, both, &answers), 1.0);
        assert_eq!(score(Metric::All, one, &answers), 0.5);
        assert_eq!(score(Metric::All, "none", &answers), 0.0);
        assert_eq!(score(Metric::Part, one, &answers), 1.0);
        assert_eq!(score(Metric::Part, "none", &answers), 0.0);
        let words = ["Quiet-Harbor".to_string(), "lantern".to_string()];
        assert_eq!(
            score(Metric::All, "QUIET-harbor, then LANTERN", &words),
            1.0
        );
        assert_eq!(score(Metric::All, "anything", &[]), 0.0);
    }

    #[test]
    fn postprocess_is_rulers() {
        assert_eq!(
            postprocess("  1234567 and 7654321\n\n"),
            "1234567 and 7654321"
        );
        assert_eq!(postprocess(" a\tb\u{1}c\r\nd "), "a\nb\nc\n\nd");
        assert_eq!(postprocess("\u{0}\u{1f}"), "");
        assert_eq!(postprocess("über \u{7f}"), "über \u{7f}");
    }

    #[test]
    fn draws_and_helpers_have_rulers_shapes() {
        let mut rng = Rng(5);
        for _ in 0..100 {
            let u = rng.uuid();
            assert!(is_uuid(&u), "{u}");
            let n = random_item(Kind::Numbers, &[], &mut rng);
            assert!(is_number(&n), "{n}");
        }
        let mut all = rng.sample(10, 10);
        all.sort_unstable();
        assert_eq!(all, (0..10).collect::<Vec<_>>());
        let few: HashSet<usize> = rng.sample(1_000_000, 5).into_iter().collect();
        assert!(few.len() == 5 && few.iter().all(|&i| i < 1_000_000));
        assert!((zeta(2.0) - std::f64::consts::PI.powi(2) / 6.0).abs() < 1e-12);
        assert_eq!(
            [depth(0), depth(1), depth(2), depth(3), depth(39)],
            [0, 3, 5, 8, 100]
        );
        assert_eq!(
            vt_icl_template(),
            "Memorize and track the chain(s) of variable assignment hidden in the following text. \
             {context} Question: Find all variables that are assigned the value {query} in the \
             text Answer: According to the chain(s) of variable assignment in the text above, \
             {num_v} variables are assgined the value {query}, they are: "
        );
        assert_eq!(
            word_list("The whale, the Whale! naïve sea-captain ahab's harpoons and harpoons"),
            ["ahab", "captain", "harpoons", "whale"]
        );
        assert!(ends_sentence("again.\u{201D}") && ends_sentence("Why?") && !ends_sentence("Mr"));
    }
}
