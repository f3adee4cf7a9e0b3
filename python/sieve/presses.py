"""KV cache presses, named and parameterized as kvpress names them.

A press bounds the KV cache of a generation, a session or a pipeline call:

* ``compression_ratio=r`` (kvpress's way): the context is read whole, then
  cut once to (1 - r) of its tokens before the question or answer; nothing
  is evicted while answering. Only for a single context (``generate``,
  ``stream``, ``chat``, ``pipeline``), not a session.
* ``budget=J`` (sieve's way): the cache keeps J entries and refreshes every
  ``chunk`` tokens (default 64) from the start, so a conversation or a long
  answer of any length runs in J + chunk entries.

Every press keeps the first ``n_sink`` positions (default 4) and the newest
``recent`` entries (default 64) as sieve's cache does; kvpress protects
none. ``granularity`` chooses one kept set for the cache ("token"), one per
layer, or one per (layer, KV head) as kvpress keeps them ("head").
docs/POLICIES.md defines each policy.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar, Optional

__all__ = [
    "Press",
    "WindowPress",
    "StreamingLLMPress",
    "RandomPress",
    "H2OPress",
    "ObservedAttentionPress",
    "TOVAPress",
    "EpiKVPress",
    "CCSPress",
    "KnormPress",
    "KeyDiffPress",
    "LagKVPress",
    "SnapKVPress",
    "ExpectedAttentionPress",
]


@dataclass
class Press:
    """Base of the presses: a policy with a budget or a compression ratio."""

    compression_ratio: Optional[float] = None
    budget: Optional[int] = None
    chunk: Optional[int] = None
    n_sink: int = 4
    recent: int = 64
    granularity: str = "token"

    policy: ClassVar[str] = ""

    def _params(self) -> dict:
        """The policy's own parameters, as sieve's cache names them."""
        return {}

    def _cache(self) -> dict:
        if (self.compression_ratio is None) == (self.budget is None):
            from ._sieve import InvalidOptions

            raise InvalidOptions(f"{type(self).__name__}: give compression_ratio or budget (one of them)")
        spec = {
            "policy": self.policy,
            "compression_ratio": self.compression_ratio,
            "budget": self.budget,
            "chunk": self.chunk,
            "sinks": self.n_sink,
            "recent": self.recent,
            "granularity": self.granularity,
        }
        spec.update(self._params())
        return spec

    def __repr__(self) -> str:
        set_ = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self) if getattr(self, f.name) is not None)
        return f"{type(self).__name__}({set_})"


def _refuse(press: Press, name: str, value, allowed) -> None:
    if value != allowed:
        from ._sieve import InvalidOptions

        raise InvalidOptions(f"{type(press).__name__}: {name}={value!r} is not supported (sieve computes {name}={allowed!r})")


@dataclass(repr=False)
class WindowPress(Press):
    """StreamingLLM: the sinks and the newest entries."""

    policy: ClassVar[str] = "window"


StreamingLLMPress = WindowPress


@dataclass(repr=False)
class RandomPress(Press):
    """Evicts at random (``seed``)."""

    seed: int = 0
    policy: ClassVar[str] = "random"

    def _params(self) -> dict:
        return {"seed": self.seed}


@dataclass(repr=False)
class H2OPress(Press):
    """H2O: the entries with the most accumulated attention."""

    policy: ClassVar[str] = "h2o"


ObservedAttentionPress = H2OPress


@dataclass(repr=False)
class TOVAPress(Press):
    """TOVA: the entries the newest query attends to most."""

    policy: ClassVar[str] = "tova"


@dataclass(repr=False)
class EpiKVPress(Press):
    """EpiKV's epiphany score: attention-free, from the hidden states."""

    window: int = 128
    policy: ClassVar[str] = "epikv"

    def _params(self) -> dict:
        return {"epikv_window": self.window}


@dataclass(repr=False)
class CCSPress(Press):
    """Counter-causal surprise (one layer)."""

    policy: ClassVar[str] = "ccs"


@dataclass(repr=False)
class KnormPress(Press):
    """K-norm: keeps the keys of smallest norm."""

    policy: ClassVar[str] = "knorm"


@dataclass(repr=False)
class KeyDiffPress(Press):
    """KeyDiff: keeps the keys least similar to the mean key."""

    policy: ClassVar[str] = "keydiff"


@dataclass(repr=False)
class LagKVPress(Press):
    """LagKV: each partition of ``lag_size`` scored against the next."""

    lag_size: int = 128
    policy: ClassVar[str] = "lagkv"

    def _params(self) -> dict:
        return {"lag_size": self.lag_size}


@dataclass(repr=False)
class SnapKVPress(Press):
    """SnapKV: the attention of the last ``window_size`` queries, pooled."""

    window_size: int = 64
    kernel_size: int = 5
    policy: ClassVar[str] = "snapkv"

    def _params(self) -> dict:
        _refuse(self, "kernel_size", self.kernel_size, 5)
        return {"window_size": self.window_size}


@dataclass(repr=False)
class ExpectedAttentionPress(Press):
    """Expected Attention: the attention the next ``n_future_positions``
    queries are expected to pay, from the newest queries' statistics."""

    n_future_positions: int = 512
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 0.0
    policy: ClassVar[str] = "expected-attention"

    def _params(self) -> dict:
        _refuse(self, "use_covariance", self.use_covariance, True)
        _refuse(self, "use_vnorm", self.use_vnorm, True)
        _refuse(self, "epsilon", self.epsilon, 0.0)
        return {"n_future_positions": self.n_future_positions}
