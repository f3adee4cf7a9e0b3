"""sieve: run open LLMs on any GPU that wgpu reaches, with a bounded KV cache.

    >>> import sieve
    >>> llm = sieve.Llm("models/smollm2-135m-instruct")
    >>> llm.chat([{"role": "user", "content": "What is the capital of France?"}]).text
    'The capital of France is Paris.'

``Llm`` loads a model (a Hugging Face folder or a GGUF file); ``generate``,
``stream``, ``chat``, ``session`` and ``batch`` run it; ``logits`` returns numpy
arrays; ``sieve.presses`` bound the KV cache as kvpress's presses do, and
``sieve.pipeline`` answers questions about a context as kvpress's pipeline
does. Errors are ``sieve.SieveError`` subclasses. The GIL is released
while the GPU works.
"""

from __future__ import annotations

import os
from typing import Callable, Iterable, Iterator, Mapping, Optional, Sequence, Union

from . import _sieve, presses
from ._sieve import (
    BadModel,
    Generation,
    GpuError,
    GpuOutOfMemory,
    InvalidOptions,
    NeedsReset,
    NonFiniteLogits,
    PromptTooLong,
    SieveError,
    TemplateError,
)
from .pipeline import Pipeline, pipeline
from .presses import Press

__version__ = _sieve.__version__

__all__ = [
    "Llm",
    "Session",
    "Stream",
    "Generation",
    "Press",
    "presses",
    "pipeline",
    "Pipeline",
    "SieveError",
    "BadModel",
    "InvalidOptions",
    "PromptTooLong",
    "GpuOutOfMemory",
    "GpuError",
    "TemplateError",
    "NonFiniteLogits",
    "NeedsReset",
]

Message = Union[Mapping[str, str], Sequence[str]]


def _options(
    max_tokens: int,
    temperature: float,
    top_k: int,
    top_p: float,
    seed: int,
    stop: Union[str, Sequence[str], None],
    ignore_eos: bool,
) -> dict:
    if isinstance(stop, str):
        stop = [stop]
    return {
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_k": top_k,
        "top_p": top_p,
        "seed": seed,
        "stop": list(stop) if stop is not None else None,
        "ignore_eos": ignore_eos,
    }


def _cache(cache: Optional[Press]) -> Optional[dict]:
    if cache is None:
        return None
    if not isinstance(cache, Press):
        raise TypeError(f"cache must be a sieve.presses press, not {type(cache).__name__}")
    return cache._cache()


def _pairs(messages: Iterable[Message]) -> list:
    pairs = []
    for i, m in enumerate(messages):
        if isinstance(m, Mapping):
            try:
                pairs.append((str(m["role"]), str(m["content"])))
            except KeyError as e:
                raise InvalidOptions(f"messages[{i}] has no {e.args[0]!r}") from None
        else:
            role, content = m
            pairs.append((str(role), str(content)))
    return pairs


class Stream:
    """Text pieces of a running generation, as they are decoded.

    Iterate it (``for piece in stream``); ``break`` and drop it, call
    ``cancel()`` (from any thread) or ``close()`` to stop the generation on
    the GPU. ``result`` is the finished ``Generation`` once the iteration
    ended (``close()`` returns it too). Also a context manager that closes
    on exit.
    """

    def __init__(self, inner: _sieve.Stream):
        self._inner = inner

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        return next(self._inner)

    def cancel(self) -> None:
        """Stops the generation at its next token; safe from any thread."""
        self._inner.cancel()

    def close(self) -> Optional[Generation]:
        """Stops the generation, waits for it, and returns its Generation."""
        return self._inner.close()

    @property
    def result(self) -> Optional[Generation]:
        """The finished Generation (None while it runs)."""
        return self._inner.result

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Session:
    """A conversation: its history and its own KV cache, kept across turns.

    Made by ``Llm.session``. Calls on one session run one at a time;
    ``cancel()`` stops the running one from another thread.
    """

    def __init__(self, inner: _sieve.Session):
        self._inner = inner

    def chat(
        self,
        message: str,
        *,
        max_tokens: int = 256,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        stop: Union[str, Sequence[str], None] = None,
        ignore_eos: bool = False,
    ) -> Generation:
        """One turn: ``message`` as the user's, answered after the history."""
        opts = _options(max_tokens, temperature, top_k, top_p, seed, stop, ignore_eos)
        return self._inner.chat(message, opts)

    def stream(
        self,
        message: str,
        *,
        max_tokens: int = 256,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        stop: Union[str, Sequence[str], None] = None,
        ignore_eos: bool = False,
    ) -> Stream:
        """As ``chat``, the answer streamed piece by piece."""
        opts = _options(max_tokens, temperature, top_k, top_p, seed, stop, ignore_eos)
        return Stream(self._inner.stream_chat(message, opts))

    def cancel(self) -> None:
        """Stops the running generation (from any thread)."""
        self._inner.cancel()

    def reset(self) -> None:
        """Forgets the conversation (history and cache)."""
        self._inner.reset()

    @property
    def messages(self) -> list:
        """The conversation as (role, content) pairs."""
        return self._inner.messages

    @property
    def tokens(self) -> list:
        """Every token id the cache has read, in order."""
        return self._inner.tokens


class Llm:
    """A model on the GPU: a Hugging Face folder or a GGUF file.

    Args:
        path: the model folder (config.json, safetensors weights,
            tokenizer.json) or a .gguf file.
        dtype: weight storage on the GPU: "auto" (a GGUF's own types where
            sieve has a layout for them, else f16), "f16", "f32", "q8_0",
            "q4_0", ... as ``sieve run --dtype``.
        kv_dtype: KV cache storage, "f32" (default) or "f16".
        kernels: "auto", "cpu", "gpu" or "tuned".
        backend: "vulkan", "metal", "dx12" or "gl" (default: any).
        adapter: use the adapter whose name contains this text.
        progress: called as ``progress(done, total)`` while weights upload.

    Raises:
        BadModel: the path is missing or not a model sieve runs.
        InvalidOptions: an option value sieve does not know.
        GpuError, GpuOutOfMemory: the device.
    """

    def __init__(
        self,
        path: Union[str, os.PathLike],
        *,
        dtype: Optional[str] = None,
        kv_dtype: Optional[str] = None,
        kernels: Optional[str] = None,
        backend: Optional[str] = None,
        adapter: Optional[str] = None,
        progress: Optional[Callable[[int, int], None]] = None,
    ):
        self._llm = _sieve.Llm(os.fspath(path), dtype, kv_dtype, kernels, backend, adapter, progress)

    @property
    def vocab_size(self) -> int:
        """Length of a logits vector."""
        return self._llm.vocab_size

    @property
    def max_context(self) -> int:
        """The model's longest context (max_position_embeddings)."""
        return self._llm.max_context

    def tokenize(self, text: str, *, add_special_tokens: bool = True) -> list:
        """Token ids of ``text`` (a BOS token where the tokenizer asks for one)."""
        return self._llm.tokenize(text, add_special_tokens)

    def detokenize(self, ids: Sequence[int]) -> str:
        """Text of token ids."""
        return self._llm.detokenize(list(ids))

    def apply_chat_template(self, messages: Iterable[Message], *, add_generation_prompt: bool = True) -> str:
        """The model's chat template rendered for ``messages`` (dicts with
        "role" and "content", or (role, content) pairs)."""
        return self._llm.apply_chat_template(_pairs(messages), add_generation_prompt)

    def logits(self, ids: Sequence[int], *, cache: Optional[Press] = None):
        """Float32 logits of the last of ``ids`` (a numpy array of
        ``vocab_size``), read from position 0 through a fresh cache: the
        full one, or the press's. The values ``sieve logits`` writes."""
        return self._llm.logits(list(ids), _cache(cache))

    def generate(
        self,
        prompt: Union[str, Sequence[int]],
        *,
        max_tokens: int = 256,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        stop: Union[str, Sequence[str], None] = None,
        ignore_eos: bool = False,
        cache: Optional[Press] = None,
        trace: bool = False,
    ) -> Generation:
        """Continues ``prompt`` (text as it is, no chat template; or token
        ids) on a fresh cache, the full one or the press's. A press with a
        compression_ratio compresses the prompt once, before the answer.
        With ``trace`` (a press only) the Generation's ``trace`` holds each
        refresh's kept and evicted positions and scores as numpy arrays."""
        ids = self._ids(prompt)
        opts = _options(max_tokens, temperature, top_k, top_p, seed, stop, ignore_eos)
        return self._llm.generate(ids, len(ids), opts, _cache(cache), trace)

    def stream(
        self,
        prompt: Union[str, Sequence[int]],
        *,
        max_tokens: int = 256,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        stop: Union[str, Sequence[str], None] = None,
        ignore_eos: bool = False,
        cache: Optional[Press] = None,
        trace: bool = False,
    ) -> Stream:
        """As ``generate``, streamed: ``for piece in llm.stream(...)``."""
        ids = self._ids(prompt)
        opts = _options(max_tokens, temperature, top_k, top_p, seed, stop, ignore_eos)
        return Stream(self._llm.stream(ids, len(ids), opts, _cache(cache), trace))

    def batch(
        self,
        prompts: Sequence[Union[str, Sequence[int]]],
        *,
        max_tokens: int = 256,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        stop: Union[str, Sequence[str], None] = None,
        ignore_eos: bool = False,
        cache: Optional[Press] = None,
        max_sequences: Optional[int] = None,
    ) -> list:
        """``generate`` for every prompt, stepped together on sieve's
        scheduler (the weights read once per step for all of them): up to
        ``max_sequences`` at a time (None: as many as the device's memory
        allows, at most 32), each on a fresh cache (the full one or its own
        of the press). The Generations, in the order of ``prompts``; their
        ``cache_entries`` is None."""
        if isinstance(prompts, str):
            raise TypeError("batch takes a list of prompts, not one string")
        ids = [self._ids(p) for p in prompts]
        opts = _options(max_tokens, temperature, top_k, top_p, seed, stop, ignore_eos)
        return self._llm.batch(ids, [len(i) for i in ids], opts, _cache(cache), max_sequences)

    def chat(
        self,
        messages: Iterable[Message],
        *,
        max_tokens: int = 256,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        stop: Union[str, Sequence[str], None] = None,
        ignore_eos: bool = False,
        cache: Optional[Press] = None,
        trace: bool = False,
    ) -> Generation:
        """The assistant's answer to ``messages`` on the model's chat template."""
        return self.generate(
            self.tokenize(self.apply_chat_template(messages)),
            max_tokens=max_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            stop=stop,
            ignore_eos=ignore_eos,
            cache=cache,
            trace=trace,
        )

    def session(self, *, cache: Optional[Press] = None, max_context: int = 0) -> Session:
        """A conversation with its own KV cache: the full one (of
        ``max_context`` entries; 0 = the model's, at most 8192) or bounded by
        a press with a budget."""
        return Session(self._llm.session(max_context, _cache(cache)))

    def _ids(self, prompt: Union[str, Sequence[int]]) -> list:
        if isinstance(prompt, str):
            return self.tokenize(prompt)
        return list(prompt)
