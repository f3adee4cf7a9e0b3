"""The tiny random models of ../shared/golden from Python, against Hugging
Face transformers' float32 outputs (the references tests/golden_tiny.rs
checks the engine against): ``llm.logits`` at every checked position
within 1e-3 with the same argmax, and ``llm.generate``'s 32-token greedy
continuation identical (the folders' README tolerances).

The golden folders have no tokenizer, which ``sieve.Llm`` loads with every
model: each test gives its model a stand-in tokenizer.json (a word-level
vocabulary of the model's size) beside links to its config and weights,
and feeds token ids.
"""

import json
import os
import pathlib

import numpy as np
import pytest

import sieve

ROOT = pathlib.Path(os.environ.get("SIEVE_ROOT", pathlib.Path(__file__).resolve().parents[2]))
GOLDEN = pathlib.Path(os.environ.get("SIEVE_GOLDEN_DIR") or ROOT / ".." / "shared" / "golden")
TINY = ["tiny-llama-gqa", "tiny-qwen2", "tiny-qwen3", "tiny-smollm3", "tiny-phi3", "tiny-gemma3"]


def with_tokenizer(name: str, tmp: pathlib.Path) -> pathlib.Path:
    src = GOLDEN / name
    config = json.loads((src / "config.json").read_text())
    folder = tmp / name
    folder.mkdir()
    for f in src.iterdir():
        if f.suffix in (".json", ".safetensors") and f.name not in ("inputs.json", "diagnostics.json"):
            (folder / f.name).symlink_to(f.resolve())
    vocab = {f"t{i}": i for i in range(config["vocab_size"])}
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "t0"},
    }
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    return folder


def pad_token_id(config: dict):
    """The pad id transformers' generate dropped from the greedy run's
    prompt (tests/golden_tiny.rs's pad_token_id)."""
    pad = config.get("pad_token_id")
    eos = config.get("eos_token_id")
    eos = eos if isinstance(eos, list) else [eos]
    return pad if pad is not None and pad not in eos else None


@pytest.mark.parametrize("name", TINY)
def test_tiny_models_match_transformers(name, tmp_path):
    if not (GOLDEN / name).exists():
        pytest.fail(f"{GOLDEN / name} is missing (set SIEVE_GOLDEN_DIR)")
    llm = sieve.Llm(with_tokenizer(name, tmp_path), dtype="f32")
    pad = pad_token_id(json.loads((GOLDEN / name / "config.json").read_text()))
    files = sorted((GOLDEN / name).glob("golden_len*.npz"))
    assert files, f"no golden_len*.npz in {GOLDEN / name}"
    for f in files:
        case = np.load(f)
        ids = case["input_ids"].tolist()
        want = case["logits"]
        for row, p in enumerate(case["logits_positions"].tolist()):
            got = llm.logits(ids[: p + 1])
            d = float(np.max(np.abs(got - want[row])))
            assert d <= 1e-3, f"{name} {f.name} pos {p}: logits max |d| {d}"
            assert got.argmax() == want[row].argmax(), f"{name} {f.name} pos {p}: argmax"
        prompt = [t for t in ids if t != pad]
        greedy = case["greedy_ids"].tolist()
        g = llm.generate(prompt, max_tokens=len(greedy), ignore_eos=True)
        assert g.ids == greedy, f"{name} {f.name}: greedy continuation"
