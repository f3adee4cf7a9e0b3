#!/usr/bin/env python3
"""Reference data from NVIDIA's kvpress for sieve's KV-cache eviction presses.

What it does
------------
Loads the tiny golden models `tiny-llama-gqa` and `tiny-qwen2` (config.json +
model.safetensors from the golden folder) with Hugging Face transformers,
float32, CPU, `attn_implementation="eager"`, and prefills the fixed
300-token golden input (the `n_tokens == 300` entry of each model's
inputs.json, i.e. the ids of golden_len300.npz) once per press and
compression ratio (0.25, 0.5, 0.75) under these kvpress presses, each with
kvpress's default parameters:

    KnormPress, KeyDiffPress, LagKVPress, ExpectedAttentionPress, SnapKVPress

For every layer and every KV head it records the press's raw scores per
position (the tensor its `score(...)` method returns, before selection) and
the kept positions (sorted ascending) as read back from what
`ScorerPress.compress` actually leaves in the cache (each kept key row is
matched bit-exactly to its position in the uncompressed keys; the values are
checked the same way). It also checks that those kept sets equal
`scores.topk(n_kept)` and records, per (layer, KV head), the gap between the
lowest kept and the highest evicted score (0 means the cut falls inside a
tie, where the choice is torch's topk tie-breaking).

Writes tests/data/kvpress/<model>.json (one per model); the definitions of
the scores are in tests/data/kvpress/README.md. A press that fails on a model
is recorded in the file with its error instead of stopping the run.

How to run (from anywhere; paths are relative to the repository root)
---------------------------------------------------------------------
    python3 scripts/kvpress-reference.py [--golden ../shared/golden] [--out tests/data/kvpress]

The first run installs the pinned packages below (with their dependencies,
about 6 GB because the default torch wheel bundles CUDA libraries; only the
CPU is used) into target/kvpress-deps (git-ignored) with
`python3 -m pip install --target`, from the default package index; later runs
reuse them. The run itself takes under a minute on 2 cores.

CI does not run this script: its output is committed under tests/data/kvpress
and sieve's tests read that.

Pinned versions
---------------
    kvpress 0.5.5, torch 2.15.0, transformers 5.2.0 (kvpress 0.5.5 requires
    transformers >= 4.56, < 5.3), Python 3.11.
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
DEPS = ROOT / "target" / "kvpress-deps"
PINS = {"kvpress": "0.5.5", "torch": "2.15.0", "transformers": "5.2.0"}
MODELS = ["tiny-llama-gqa", "tiny-qwen2"]
RATIOS = [0.25, 0.5, 0.75]
PRESSES = ["KnormPress", "KeyDiffPress", "LagKVPress", "ExpectedAttentionPress", "SnapKVPress"]
SEQ_LEN = 300
RANDOM_SEED = 1234  # only used if a model has no 300-token golden input
MAX_BYTES = 2_000_000


def deps_ok():
    """True when target/kvpress-deps holds the pinned versions."""
    check = (
        "import torch, transformers, kvpress, importlib.metadata as m; "
        "print(m.version('kvpress'), torch.__version__.split('+')[0], transformers.__version__)"
    )
    env = dict(os.environ, PYTHONPATH=str(DEPS))
    try:
        out = subprocess.run(
            [sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=600
        )
    except subprocess.TimeoutExpired:
        return False
    want = f"{PINS['kvpress']} {PINS['torch']} {PINS['transformers']}"
    return out.returncode == 0 and out.stdout.strip().endswith(want)


def ensure_deps():
    if not deps_ok():
        print(f"installing {PINS} into {DEPS.relative_to(ROOT)} (a few minutes)", file=sys.stderr)
        subprocess.run(
            [
                sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                "--root-user-action=ignore", "--upgrade", "--target", str(DEPS),
            ]
            + [f"{name}=={version}" for name, version in PINS.items()],
            check=True,
        )
        if not deps_ok():
            sys.exit("kvpress-reference: the pinned packages do not import after installing them")
    sys.path.insert(0, str(DEPS))


def sig6(x):
    """A float rounded to 6 significant digits (JSON-safe)."""
    x = float(x)
    if x != x or x in (float("inf"), float("-inf")):
        return str(x)
    return float(f"{x:.6g}")


def nested(tensor, fn=lambda v: v):
    """[layer-less] tensor -> nested lists with fn applied to the leaves."""
    if tensor.dim() == 0:
        return fn(tensor.item())
    return [nested(t, fn) for t in tensor]


def protected_positions(name, press, seq_len):
    """Positions whose score is a constant placed above every computed score
    (or, for LagKV, the constant 1.0 that no rank score reaches)."""
    if name == "ExpectedAttentionPress":
        return {
            "positions": list(range(press.n_sink)),
            "score": "max over the whole layer's score tensor (all KV heads, positions >= n_sink) + 1",
        }
    if name == "SnapKVPress":
        return {
            "positions": list(range(seq_len - press.window_size, seq_len)),
            "score": "max over the whole layer's score tensor (all KV heads, positions < seq_len - window_size) + 1",
        }
    if name == "LagKVPress":
        if seq_len < press.n_sink + 2 * press.lag_size:
            return {"positions": list(range(press.n_sink)), "score": "1.0 (short sequence: ramp on the rest)"}
        end_idx = press.n_sink + ((seq_len - press.n_sink) // press.lag_size) * press.lag_size
        tail_start = end_idx - press.lag_size
        return {
            "positions": list(range(press.n_sink)) + list(range(tail_start, seq_len)),
            "score": "1.0 (sinks and the tail: last full partition plus the remainder); rank scores are "
            "k/lag_size <= (lag_size-1)/lag_size < 1, so these tie with each other and win over all others; "
            "when n_kept < len(positions), torch.topk chooses among the tied positions (see cut_ties): "
            "sinks are then not guaranteed",
            "sinks": [0, press.n_sink],
            "scored_range": [press.n_sink, tail_start],
            "tail": [tail_start, seq_len],
        }
    return None


def run_press(torch, model, input_ids, name, ratio, press_cls):
    """One prefill under press `name` at `ratio`; per-layer scores and kept sets."""
    from transformers import DynamicCache

    press = press_cls(compression_ratio=ratio)
    record = {}
    original_score = press.score
    original_compress = press.compress

    def score(module, hidden_states, keys, values, attentions, kwargs):
        scores = original_score(module, hidden_states, keys, values, attentions, kwargs)
        record.setdefault(module.layer_idx, {})["scores"] = scores.detach().clone()
        record[module.layer_idx]["attentions_passed"] = attentions is not None
        return scores

    def compress(module, hidden_states, keys, values, attentions, kwargs):
        new_keys, new_values = original_compress(module, hidden_states, keys, values, attentions, kwargs)
        kept = []
        for head in range(keys.shape[1]):
            match = (new_keys[0, head][:, None, :] == keys[0, head][None, :, :]).all(-1)
            if not bool((match.sum(-1) == 1).all()):
                raise RuntimeError(f"layer {module.layer_idx} head {head}: a kept key matches no single position")
            idx = match.float().argmax(-1)
            if not torch.equal(new_values[0, head], values[0, head][idx]):
                raise RuntimeError(f"layer {module.layer_idx} head {head}: kept values do not match the keys")
            kept.append(sorted(idx.tolist()))
        record.setdefault(module.layer_idx, {})["kept"] = kept
        record[module.layer_idx]["k_len"] = keys.shape[2]
        return new_keys, new_values

    press.score = score
    press.compress = compress
    if hasattr(press, "_get_states_score"):  # LagKV: keep the per-partition scores before ranking
        original_states_score = press._get_states_score
        calls = []

        def states_score(target):
            result = original_states_score(target)
            calls.append(result.detach().clone())
            return result

        press._get_states_score = states_score
    cache = DynamicCache()
    with torch.no_grad(), press(model):
        model(input_ids=input_ids, past_key_values=cache, use_cache=True)
    if hasattr(press, "_get_states_score"):
        # two calls per layer, in layer order: keys, then values
        if len(calls) != 2 * len(record):
            raise RuntimeError(f"_get_states_score ran {len(calls)} times for {len(record)} layers")
        for layer in sorted(record):
            key_score, value_score = calls[2 * layer], calls[2 * layer + 1]
            bsz, heads = key_score.shape[:2]
            record[layer]["pre_rank"] = ((key_score + value_score) / 2).reshape(bsz, heads, -1)
    skip = ("score", "compress", "_get_states_score", "compression_ratio")
    params = {k: v for k, v in vars(press).items() if k not in skip}
    return press, params, record


def reference_for_model(torch, folder, name):
    import numpy as np
    import kvpress
    from transformers import AutoModelForCausalLM

    from kvpress.utils import compute_n_kept

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    cfg = model.config

    inputs = json.loads((folder / "inputs.json").read_text())
    entry = next((e for e in inputs if e.get("n_tokens") == SEQ_LEN), None)
    if entry is not None:
        ids = entry["input_ids"]
        source = f"inputs.json entry with n_tokens={SEQ_LEN} (the ids of {entry.get('file')})"
    else:
        gen = torch.Generator().manual_seed(RANDOM_SEED)
        ids = torch.randint(0, cfg.vocab_size, (SEQ_LEN,), generator=gen).tolist()
        source = f"torch.randint(0, vocab_size, ({SEQ_LEN},), generator=torch.Generator().manual_seed({RANDOM_SEED}))"
    input_ids = torch.tensor([ids], dtype=torch.long)

    # Sanity: transformers reproduces the golden logits (same config reading).
    sanity = None
    npz = folder / "golden_len300.npz"
    if entry is not None and npz.exists():
        golden = np.load(npz)
        with torch.no_grad():
            logits = model(input_ids=input_ids).logits[0]
        pos = torch.tensor(golden["logits_positions"].astype("int64"))
        diff = (logits[pos] - torch.tensor(golden["logits"])).abs().max().item()
        sanity = {"golden_len300_logits_max_abs_diff": sig6(diff)}
        if diff > 1e-3:
            raise RuntimeError(f"{name}: logits differ from golden_len300.npz by {diff}")

    out = {
        "generator": "scripts/kvpress-reference.py",
        "versions": {
            "kvpress": PINS["kvpress"],
            "torch": torch.__version__,
            "transformers": __import__("transformers").__version__,
            "numpy": np.__version__,
            "python": sys.version.split()[0],
        },
        "model": name,
        "model_config": {
            "architecture": cfg.architectures[0],
            "num_hidden_layers": cfg.num_hidden_layers,
            "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_key_value_heads,
            "head_dim": model.model.layers[0].self_attn.head_dim,
            "rope_theta": cfg.rope_parameters["rope_theta"],
        },
        "compute": "float32, CPU, attn_implementation=eager, batch 1, positions 0..seq_len-1, one prefill "
        "model(input_ids, past_key_values=DynamicCache()) inside `with press(model)`",
        "input": {"source": source, "input_ids": ids},
        "seq_len": SEQ_LEN,
        "sanity": sanity,
        "layout": {
            "scores": "[layer][kv_head][position], the tensor returned by press.score(...) for batch 0, "
            "rounded to 6 significant digits; higher = keep",
            "kept": "[layer][kv_head][...] positions left in the cache after compress, sorted ascending",
            "boundary_gap": "[layer][kv_head] min kept score - max evicted score (unrounded float32 "
            "scores, 6 significant digits); 0 = the cut falls inside a tie",
            "n_kept": "kvpress.utils.compute_n_kept(seq_len, ratio) = max(1, int(seq_len * (1 - ratio)))",
            "cut_ties": "one entry per (layer, kv_head) whose boundary_gap is exactly 0: the positions whose "
            "unrounded score equals the lowest kept score, and which of them torch.topk kept (an "
            "implementation detail of torch, not a rule of the press)",
            "params": "the press's dataclass fields other than compression_ratio (kvpress defaults)",
            "protected": "positions the press scores with a constant above every computed score",
        },
        "presses": {},
        "failures": [],
    }

    for pname in PRESSES:
        cls = getattr(kvpress, pname)
        entry_out = {"status": "ok"}
        try:
            per_ratio = {}
            first_scores = None
            scores_same = True
            for ratio in RATIOS:
                press, params, record = run_press(torch, model, input_ids, pname, ratio, cls)
                layers = sorted(record)
                if layers != list(range(cfg.num_hidden_layers)):
                    raise RuntimeError(f"press ran on layers {layers}")
                scores = torch.stack([record[l]["scores"][0] for l in layers])  # [L, H, S]
                n_kept = compute_n_kept(SEQ_LEN, ratio)
                kept = [record[l]["kept"] for l in layers]
                gaps = []
                ties = []
                for l in layers:
                    row = []
                    for h in range(scores.shape[1]):
                        s = scores[l, h]
                        topk = sorted(s.topk(n_kept).indices.tolist())
                        if topk != kept[l][h]:
                            raise RuntimeError(f"layer {l} head {h}: kept set != scores.topk(n_kept)")
                        mask = torch.zeros_like(s, dtype=torch.bool)
                        mask[kept[l][h]] = True
                        gap = (s[mask].min() - s[~mask].max()).item() if (~mask).any() else None
                        row.append(None if gap is None else sig6(gap))
                        if gap == 0.0:
                            cut = s[mask].min()
                            tied = (s == cut).nonzero().flatten().tolist()
                            ties.append({
                                "layer": l,
                                "kv_head": h,
                                "score": sig6(cut),
                                "tied_positions": tied,
                                "kept": [i for i in tied if bool(mask[i])],
                            })
                    gaps.append(row)
                if first_scores is None:
                    first_scores = scores
                    entry_out["params"] = params
                    entry_out["attentions_passed_to_score"] = record[0]["attentions_passed"]
                    entry_out["protected"] = protected_positions(pname, press, SEQ_LEN)
                    if "pre_rank" in record[0]:
                        pre = torch.stack([record[l]["pre_rank"][0] for l in layers])
                        entry_out["pre_rank_scores"] = {
                            "positions": [press.n_sink, press.n_sink + pre.shape[-1]],
                            "what": "(key_score + value_score) / 2 before the double argsort, "
                            "[layer][kv_head][position - n_sink] for positions in [positions[0], positions[1])",
                            "scores": nested(pre, sig6),
                        }
                elif not torch.equal(first_scores, scores):
                    scores_same = False
                per_ratio[str(ratio)] = {"n_kept": n_kept, "kept": kept, "boundary_gap": gaps, "cut_ties": ties}
                if not scores_same:
                    per_ratio[str(ratio)]["scores"] = nested(scores, sig6)
            entry_out["scores_identical_across_ratios"] = scores_same
            if scores_same:
                entry_out["scores"] = nested(first_scores, sig6)
            entry_out["ratios"] = per_ratio
        except Exception as error:  # recorded, not fatal
            entry_out = {"status": "failed", "error": f"{type(error).__name__}: {error}"}
            out["failures"].append({"press": pname, "error": entry_out["error"]})
        out["presses"][pname] = entry_out
        print(f"{name} {pname}: {entry_out['status']}", file=sys.stderr)

    text = json.dumps(out, separators=(",", ":"))
    if len(text) > MAX_BYTES:
        last = cfg.num_hidden_layers - 1
        for entry_out in out["presses"].values():
            if "scores" in entry_out:
                entry_out["scores"] = {"0": entry_out["scores"][0], str(last): entry_out["scores"][last]}
        out["note"] = f"scores stored for layers 0 and {last} only (file size limit)"
        text = json.dumps(out, separators=(",", ":"))
    return text


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--golden", default="../shared/golden", help="golden folder, relative to the repo root")
    parser.add_argument("--out", default="tests/data/kvpress", help="output folder, relative to the repo root")
    parser.add_argument("--models", nargs="*", default=MODELS)
    args = parser.parse_args()

    ensure_deps()
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()

    torch.manual_seed(0)
    golden = (ROOT / args.golden).resolve()
    out_dir = ROOT / args.out
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in args.models:
        text = reference_for_model(torch, golden / name, name)
        path = out_dir / f"{name}.json"
        path.write_text(text + "\n")
        print(f"wrote {path.relative_to(ROOT)} ({len(text)} bytes)", file=sys.stderr)


if __name__ == "__main__":
    main()
