//! The library's error type: a kind an application can match ("prompt too
//! long" is not "GPU out of memory" is not "bad model"), and the message
//! chain, phrased for the library (the command line adds its flag names).
//!
//! Inside the crate errors are `anyhow` chains; the few places that know
//! what went wrong tag theirs (`tagged`); the API boundary ([`crate::session`])
//! turns a chain into an [`Error`], taking the tag if there is one and the
//! operation's default kind otherwise.

use std::fmt;

/// What went wrong.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The model folder: missing, malformed, unsupported or inconsistent
    /// files (config, weights, tokenizer).
    ModelLoading,
    /// Options out of range or inconsistent (cache, sampling, sizes).
    InvalidOptions,
    /// The prompt does not fit the context that is left.
    PromptTooLong,
    /// The device cannot hold the buffers (out of memory, or larger than it
    /// allows).
    GpuOutOfMemory,
    /// No usable adapter, or the device failed or was lost.
    Gpu,
    /// The chat template is missing, does not parse or does not render.
    Template,
    /// Reading or writing a file.
    Io,
    /// The model produced NaN or infinite logits. The step that did is in
    /// the cache (its keys and values are likely non-finite too), but not
    /// in `Session::tokens`: the session needs a reset (`Session::chat`
    /// starts the conversation over by itself).
    NonFiniteLogits,
    /// An earlier error left the session's cache out of step with its
    /// tokens (a step ran but could not be recorded): `Session::generate`
    /// refuses until `Session::reset`.
    NeedsReset,
    /// A constraint (JSON schema, regular expression, grammar) that does not
    /// compile, that the tokenizer cannot take, or that failed while
    /// generating.
    InvalidConstraint,
}

/// An error of the library API: its [`ErrorKind`] and the full message.
pub struct Error {
    kind: ErrorKind,
    inner: anyhow::Error,
}

impl Error {
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// The error of an API operation: the kind a raise site tagged
    /// ([`tagged`]), else `default`.
    pub(crate) fn classify(inner: anyhow::Error, default: ErrorKind) -> Self {
        let kind = inner
            .chain()
            .find_map(|e| e.downcast_ref::<Tagged>())
            .map_or(default, |t| t.kind);
        Error { kind, inner }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#}", self.inner)
    }
}

impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}: {:#}", self.kind, self.inner)
    }
}

impl std::error::Error for Error {}

/// The result of a library API operation.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// An error message tagged with its kind, raised where the kind is known.
#[derive(Debug)]
pub(crate) struct Tagged {
    kind: ErrorKind,
    message: String,
}

impl fmt::Display for Tagged {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Tagged {}

/// An `anyhow` error carrying `kind`, for `return Err(tagged(..))` or
/// `.map_err(|e| tagged(kind, format!("...: {e}")))`.
pub(crate) fn tagged(kind: ErrorKind, message: impl fmt::Display) -> anyhow::Error {
    anyhow::Error::new(Tagged {
        kind,
        message: message.to_string(),
    })
}

/// `bail!` with a kind: `bail_kind!(ErrorKind::InvalidOptions, "...", args)`.
macro_rules! bail_kind {
    ($kind:expr, $($arg:tt)*) => {
        return Err($crate::error::tagged($kind, format!($($arg)*)))
    };
}
pub(crate) use bail_kind;

/// Tags the error of `result` with `kind`, keeping its message chain.
pub(crate) trait TagKind<T> {
    fn tag(self, kind: ErrorKind) -> anyhow::Result<T>;
}

impl<T> TagKind<T> for anyhow::Result<T> {
    fn tag(self, kind: ErrorKind) -> anyhow::Result<T> {
        self.map_err(|e| tagged(kind, format!("{e:#}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use anyhow::Context;

    #[test]
    fn the_tag_survives_context_and_the_default_applies_otherwise() {
        let inner: anyhow::Result<()> = Err(tagged(ErrorKind::PromptTooLong, "300 > 256"));
        let e = Error::classify(inner.context("generating").unwrap_err(), ErrorKind::Gpu);
        assert_eq!(e.kind(), ErrorKind::PromptTooLong);
        assert_eq!(e.to_string(), "generating: 300 > 256");
        let plain = Error::classify(anyhow::anyhow!("lost"), ErrorKind::Gpu);
        assert_eq!(plain.kind(), ErrorKind::Gpu);
        let retagged: anyhow::Result<()> = Err(anyhow::anyhow!("no template"));
        let e = Error::classify(
            retagged.tag(ErrorKind::Template).unwrap_err(),
            ErrorKind::Gpu,
        );
        assert_eq!(
            (e.kind(), e.to_string().as_str()),
            (ErrorKind::Template, "no template")
        );
    }
}
