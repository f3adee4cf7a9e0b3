"""sieve's Python module on the default model, against sieve's own
command line (logits bit for bit, greedy text), and its contract: streams
that stop, presses that keep their budget, exceptions, threads, a
kvpress-style script, the README's example.

    SIEVE_ROOT=. python -m pytest python/tests   (scripts/python-api.sh)
"""

import json
import os
import pathlib
import re
import subprocess
import threading

import numpy as np
import pytest

import sieve
from sieve.presses import ExpectedAttentionPress, SnapKVPress, TOVAPress, WindowPress

ROOT = pathlib.Path(os.environ.get("SIEVE_ROOT", pathlib.Path(__file__).resolve().parents[2]))
MODEL = str(ROOT / "models" / "smollm2-135m-instruct")
CLI = str(ROOT / "target" / "release" / "sieve")
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def llm():
    return sieve.Llm(MODEL)


def prose(words: int) -> str:
    text = (ROOT / "data" / "prose" / "moby_dick.txt").read_text()
    return " ".join(text.split()[2000 : 2000 + words])


def cli_logits(tmp_path, ids, *flags):
    out = tmp_path / "logits.npy"
    subprocess.run(
        [CLI, "logits", "--model", MODEL, "--ids", ",".join(map(str, ids)), "--out", str(out), *flags],
        check=True,
        capture_output=True,
    )
    return np.load(out)


def test_logits_equal_the_command_lines_bit_for_bit(llm, tmp_path):
    ids = llm.tokenize(prose(60))
    ours = llm.logits(ids)
    assert ours.dtype == np.float32 and ours.shape == (llm.vocab_size,)
    assert np.array_equal(ours.view(np.uint32), cli_logits(tmp_path, ids).view(np.uint32))
    # Through a bounded cache that refreshes on the way.
    bounded = llm.logits(ids, cache=TOVAPress(budget=16, chunk=8, recent=8))
    cli = cli_logits(tmp_path, ids, "--policy", "tova", "--budget", "16", "--chunk", "8", "--recent", "8")
    assert np.array_equal(bounded.view(np.uint32), cli.view(np.uint32))
    assert not np.array_equal(bounded, ours)


def test_greedy_text_equals_sieve_run(llm):
    run = subprocess.run([CLI, "run", "--model", MODEL, "--prompt", QUESTION], check=True, capture_output=True, text=True)
    g = llm.chat([{"role": "user", "content": QUESTION}])
    assert g.text == run.stdout.rstrip("\n")
    assert "Paris" in g.text and g.stop_reason == "eos"
    raw = subprocess.run(
        [CLI, "run", "--model", MODEL, "--raw", "--max-tokens", "12", "--prompt", "The capital of France is"],
        check=True,
        capture_output=True,
        text=True,
    )
    assert llm.generate("The capital of France is", max_tokens=12).text == raw.stdout.rstrip("\n")


def test_a_stream_stopped_after_three_pieces_stops_the_generation(llm):
    stream = llm.stream("Once upon a time", max_tokens=500, ignore_eos=True)
    pieces = []
    for piece in stream:
        pieces.append(piece)
        if len(pieces) == 3:
            break
    g = stream.close()
    assert g.stop_reason == "cancelled"
    # The worker waits for each piece to be taken: at most one more token.
    assert g.generated_tokens <= 4
    assert g.text.startswith("".join(pieces))


def test_a_cancel_from_another_thread_stops_a_stream(llm):
    stream = llm.stream("Once upon a time", max_tokens=100000, ignore_eos=True)
    threading.Timer(0.5, stream.cancel).start()
    n = sum(1 for _ in stream)
    assert stream.result.stop_reason == "cancelled"
    assert n < 100000


def test_a_session_keeps_the_conversation(llm):
    s = llm.session(cache=TOVAPress(budget=128))
    first = s.chat(QUESTION, max_tokens=32)
    assert "Paris" in first.text
    s.chat("And of Italy?", max_tokens=32)
    assert [role for role, _ in s.messages] == ["user", "assistant", "user", "assistant"]
    pieces = list(s.stream("And of Spain?", max_tokens=32))
    assert "".join(pieces) == s.messages[-1][1]
    # A stream dropped after it ended does not cancel the next turn.
    st = s.stream("And of Germany?", max_tokens=8)
    list(st)
    st = s.stream("And of Portugal?", max_tokens=8)
    assert len(list(st)) > 0 and st.result.stop_reason != "cancelled"
    s.reset()
    assert s.messages == [] and s.tokens == []


def test_a_press_keeps_the_budget_it_should(llm):
    prompt = prose(240)
    n = len(llm.tokenize(prompt))
    g = llm.generate(prompt, max_tokens=8, ignore_eos=True, cache=WindowPress(compression_ratio=0.75))
    assert g.cache_budget == n // 4
    # The context was cut once to the budget, then the answer was added.
    assert g.cache_budget < g.cache_entries <= g.cache_budget + 8
    g = llm.generate(prompt, max_tokens=8, cache=ExpectedAttentionPress(budget=100, chunk=16))
    assert g.cache_budget == 100 and g.cache_entries <= 116
    full = llm.generate(prompt, max_tokens=8, ignore_eos=True)
    assert full.cache_budget is None and full.cache_entries >= n


def test_a_batch_answers_as_each_prompt_alone(llm):
    prompts = ["The capital of France is", "Once upon a time", [1, 2, 3, 4, 5]]
    press = WindowPress(budget=8, chunk=4, n_sink=2, recent=2)
    # Two at a time: the third joins when one of the first two finishes.
    got = llm.batch(prompts, max_tokens=10, ignore_eos=True, cache=press, max_sequences=2)
    assert [g.text for g in got] == [llm.generate(p, max_tokens=10, ignore_eos=True, cache=press).text for p in prompts]
    assert [g.generated_tokens for g in got] == [10, 10, 10]
    assert all(g.cache_budget == 8 and g.cache_entries is None for g in got)
    full = llm.batch(prompts[:2], max_tokens=6)
    assert [g.text for g in full] == [llm.generate(p, max_tokens=6).text for p in prompts[:2]]
    assert llm.batch([]) == []
    with pytest.raises(sieve.InvalidOptions, match="max_sequences"):
        llm.batch(prompts, max_sequences=0)
    with pytest.raises(sieve.InvalidOptions, match="vocabulary"):
        llm.batch(["fine", [llm.vocab_size]])


def test_a_trace_holds_the_refreshes_sieve_run_writes(llm, tmp_path):
    prompt = "The capital of France is"
    press = TOVAPress(budget=16, chunk=8, recent=8)
    g = llm.generate(prompt, max_tokens=60, ignore_eos=True, cache=press, trace=True)
    path = tmp_path / "trace.json"
    subprocess.run(
        [CLI, "run", "--model", MODEL, "--raw", "--ignore-eos", "--max-tokens", "60", "--policy", "tova",
         "--budget", "16", "--chunk", "8", "--recent", "8", "--trace", str(path), "--prompt", prompt],
        check=True,
        capture_output=True,
    )
    want = json.loads(path.read_text())
    assert len(g.trace) == len(want) >= 4
    for got, w in zip(g.trace, want):
        assert got["refresh"] == w["refresh"] and got["before_position"] == w["before_position"]
        for key in ("present", "protected", "unprotected", "kept"):
            assert got[key].dtype == np.uint32 and got[key].tolist() == w[key], key
        assert got["scores"].dtype == np.float64 and np.allclose(got["scores"], w["scores"], rtol=1e-6)
        assert got["kept_lists"] is None
    assert llm.generate(prompt, max_tokens=4, cache=press).trace is None
    with pytest.raises(sieve.InvalidOptions, match="trace"):
        llm.generate(prompt, trace=True)


def test_errors_are_their_exceptions(llm):
    with pytest.raises(sieve.BadModel, match="no/such/model"):
        sieve.Llm("no/such/model")
    with pytest.raises(sieve.InvalidOptions, match="dtype"):
        sieve.Llm(MODEL, dtype="q9_9")
    with pytest.raises(sieve.InvalidOptions, match="kernels"):
        sieve.Llm(MODEL, kernels="fast")
    with pytest.raises(sieve.InvalidOptions, match="kernel_size"):
        llm.generate("Hi", cache=SnapKVPress(compression_ratio=0.5, kernel_size=7))
    with pytest.raises(sieve.InvalidOptions, match="compression_ratio or budget"):
        llm.generate("Hi", cache=WindowPress())
    with pytest.raises(sieve.InvalidOptions, match="between 0 and 1"):
        llm.generate(prose(200), cache=WindowPress(compression_ratio=1.5))
    with pytest.raises(sieve.InvalidOptions, match="temperature"):
        llm.generate("Hi", temperature=-1.0)
    with pytest.raises(sieve.InvalidOptions, match="vocabulary"):
        llm.logits([llm.vocab_size])
    with pytest.raises(sieve.InvalidOptions, match="never cuts"):
        llm.logits([1, 2, 3], cache=WindowPress(compression_ratio=0.5))
    with pytest.raises(sieve.InvalidOptions, match="chunk"):
        llm.generate(prose(200), cache=WindowPress(compression_ratio=0.5, chunk=8))
    with pytest.raises(sieve.InvalidOptions, match="max_context"):
        llm.session(max_context=512, cache=WindowPress(budget=128))
    with pytest.raises(sieve.InvalidOptions, match="backend"):
        sieve.Llm(MODEL, backend="glide")
    with pytest.raises(sieve.InvalidOptions, match="budget, not a compression_ratio"):
        llm.session(cache=WindowPress(compression_ratio=0.5))
    with pytest.raises(sieve.PromptTooLong):
        llm.session(max_context=16).chat(prose(50))
    with pytest.raises(TypeError):
        llm.generate("Hi", cache="window")
    with pytest.raises(sieve.InvalidOptions, match="device"):
        sieve.pipeline("kv-press-text-generation", model=MODEL, device="cuda:3")
    assert issubclass(sieve.PromptTooLong, sieve.SieveError)


def test_two_threads_generate_on_two_sessions_of_one_model(llm):
    questions = [QUESTION, "What is the capital of Italy?"]
    expected = [llm.session().chat(q, max_tokens=24).text for q in questions]
    got = [None, None]

    def answer(i):
        got[i] = llm.session().chat(questions[i], max_tokens=24).text

    threads = [threading.Thread(target=answer, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == expected


def test_a_kvpress_script_runs_with_its_imports_changed():
    # kvpress's README example; only the imports differ, and the model and
    # context it leaves to the reader are filled in.
    script = f'''
from sieve import pipeline  # kvpress: from transformers import pipeline
from sieve.presses import ExpectedAttentionPress  # kvpress: from kvpress import ExpectedAttentionPress

device = "cuda:0"
model = {MODEL!r}
model_kwargs = {{"attn_implementation": "flash_attention_2"}}
pipe = pipeline("kv-press-text-generation", model=model, device=device, model_kwargs=model_kwargs)

context = {("The password of the blue door is 7319. " + prose(300))!r}
question = "\\nWhat is the password of the blue door?"  # optional

press = ExpectedAttentionPress(compression_ratio=0.5)
answer = pipe(context, question=question, press=press)["answer"]
'''
    scope = {}
    exec(compile(script, "kvpress_example", "exec"), scope)
    assert isinstance(scope["answer"], str) and scope["answer"]
    full = scope["pipe"](scope["context"], question=scope["question"])["answer"]
    assert "7319" in full


def test_the_readmes_python_example_runs():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    assert len(blocks) == 1
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        exec(compile(blocks[0], "README.md", "exec"), {})
    finally:
        os.chdir(cwd)
