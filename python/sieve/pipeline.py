"""kvpress's question-answering pipeline on sieve.

kvpress:  ``pipe = pipeline("kv-press-text-generation", model=..., device=...)``
          ``pipe(context, question=..., press=SnapKVPress(0.5))["answer"]``
sieve:    the same lines with ``from sieve import pipeline`` and the presses
          from ``sieve.presses``; ``model`` is a local folder or GGUF file.

As kvpress does: the context goes in the user turn of the chat template
(or after the BOS token without one), is read whole and compressed once by
the press; then each question (its suffix of the template and the answer
prefix after it) is answered greedily, with no compression while
answering, stopping at the end of sequence or ``max_new_tokens``.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence, Union

from .presses import Press

__all__ = ["pipeline", "Pipeline"]

TASK = "kv-press-text-generation"


class Pipeline:
    """``pipe(context, question=..., press=..., max_new_tokens=...)``: a dict
    with "answer" (one question) or "answers" (``questions=[...]``)."""

    def __init__(self, llm):
        self.llm = llm

    def __call__(
        self,
        context: str,
        question: Optional[str] = None,
        questions: Optional[Sequence[str]] = None,
        answer_prefix: str = "",
        press: Optional[Press] = None,
        max_new_tokens: int = 50,
        max_context_length: Optional[int] = None,
        cache=None,
    ) -> dict:
        from . import InvalidOptions, _cache

        if cache is not None:
            raise InvalidOptions("cache: sieve keeps the cache itself; pass a press instead")
        if question is not None and questions is not None:
            raise InvalidOptions("give question or questions, not both")
        single = questions is None
        asked = [question or ""] if single else list(questions)
        llm = self.llm
        if llm._llm.has_chat_template:
            separator = "#" * (len(context) + 10)
            text = llm.apply_chat_template([{"role": "user", "content": context + separator}])
            context_text, suffix = text.split(separator)
            context_ids = llm.tokenize(context_text, add_special_tokens=False)
        else:
            suffix = "\n"
            context_ids = llm.tokenize(context)
        if max_context_length is not None:
            context_ids = context_ids[:max_context_length]
        answers = []
        for q in asked:
            q_ids = llm.tokenize(q + suffix + answer_prefix, add_special_tokens=False)
            opts = {"max_tokens": max_new_tokens}
            g = llm._llm.generate(context_ids + q_ids, len(context_ids), opts, _cache(press))
            answers.append(g.text)
        return {"answer": answers[0]} if single else {"answers": answers}


def pipeline(
    task: str = TASK,
    model: Union[str, os.PathLike, "object", None] = None,
    device: Optional[str] = None,
    torch_dtype=None,
    model_kwargs: Optional[dict] = None,
    **load_options,
) -> Pipeline:
    """A kvpress-style pipeline on ``model`` (a path, or a ``sieve.Llm``).

    ``device``: None, "auto", "cuda" or "cuda:0" (sieve takes the first
    adapter wgpu finds, or ``adapter=``); ``torch_dtype``: None, "auto",
    float16 or float32 (weights stored so on the GPU); ``model_kwargs``:
    only ``attn_implementation``, which sieve's one flash-style attention
    stands for. Other values are refused, not ignored.
    """
    from . import InvalidOptions, Llm

    if task != TASK:
        raise InvalidOptions(f"task {task!r}: sieve's pipeline is {TASK!r}")
    if model is None:
        raise InvalidOptions("model: give a model folder, a GGUF file or a sieve.Llm")
    if device not in (None, "auto", "cuda", "cuda:0"):
        raise InvalidOptions(f"device {device!r}: sieve runs on one wgpu adapter; choose it with adapter=")
    for key, value in (model_kwargs or {}).items():
        if key != "attn_implementation":
            raise InvalidOptions(f"model_kwargs: {key!r} is not supported")
        if value not in ("flash_attention_2", "sdpa", "eager"):
            raise InvalidOptions(f"model_kwargs: attn_implementation {value!r} is not one sieve stands for")
    dtype = str(torch_dtype).replace("torch.", "") if torch_dtype is not None else None
    if dtype not in (None, "auto", "float16", "float32"):
        raise InvalidOptions(f"torch_dtype {torch_dtype!r}: sieve stores weights as float16 or float32")
    if isinstance(model, Llm):
        if dtype not in (None, "auto") or load_options:
            raise InvalidOptions("torch_dtype and load options apply when the pipeline loads the model")
        return Pipeline(model)
    if dtype in ("float16", "float32"):
        load_options["dtype"] = {"float16": "f16", "float32": "f32"}[dtype]
    return Pipeline(Llm(model, **load_options))
