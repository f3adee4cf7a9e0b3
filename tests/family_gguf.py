"""Writes a tiny golden model (../shared/golden/tiny-*) as a GGUF file the way
llama.cpp's converter lays it out, with llama.cpp's own Python package
(`gguf`, gguf-py): its tensor-name map turns the Hugging Face names into GGUF
names, its writer writes the file, and the metadata keys are its constants.
The q/k rows of the Llama layouts are permuted as the converter's
`LlamaModel.permute` does. The weights stay float32, so sieve's logits from
the file must match the golden ones as they do from safetensors.

The vocabulary is a stand-in (a GPT-2 BPE model of 512 made-up tokens and
one merge): the tiny models take token ids, not text.

Usage: python3 tests/family_gguf.py GOLDEN_DIR NAME OUT.gguf
(scripts/family-ggufs.sh installs gguf and numpy and runs it for each family).
"""

import json
import math
import struct
import sys

import numpy as np
import gguf

# The golden folder's name -> (llama.cpp architecture, q/k rows permuted).
FAMILIES = {
    "tiny-qwen3": (gguf.MODEL_ARCH.QWEN3, False),
    "tiny-smollm3": (gguf.MODEL_ARCH.SMOLLM3, True),
    "tiny-phi3": (gguf.MODEL_ARCH.PHI3, False),
}


def read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        assert t["dtype"] == "F32", (name, t["dtype"])
        a, b = t["data_offsets"]
        out[name] = np.frombuffer(data[a:b], dtype=np.float32).reshape(t["shape"])
    return out


def permute(w, n_head, n_head_kv):
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.permute."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2)
            .reshape(w.shape))


def main():
    golden, name, out = sys.argv[1:4]
    arch, permutes = FAMILIES[name]
    cfg = json.load(open(f"{golden}/{name}/config.json"))
    tensors = read_safetensors(f"{golden}/{name}/model.safetensors")
    n_layers = cfg["num_hidden_layers"]
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hidden = cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or hidden // n_head

    w = gguf.GGUFWriter(out, gguf.MODEL_ARCH_NAMES[arch])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_block_count(n_layers)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    if head_dim != hidden // n_head:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch == gguf.MODEL_ARCH.PHI3:
        # As Phi3MiniModel.set_gguf_parameters and generate_extra_tensors.
        rot = int(cfg.get("partial_rotary_factor", 1.0) * hidden) // n_head
        orig = cfg["original_max_position_embeddings"]
        scale = cfg["max_position_embeddings"] / orig
        w.add_rope_dimension_count(rot)
        w.add_rope_scaling_orig_ctx_len(orig)
        w.add_sliding_window(cfg.get("sliding_window") or 0)
        w.add_rope_scaling_attn_factors(
            math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1.0 else 1.0)
        rs = cfg["rope_scaling"]
        w.add_tensor(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FACTORS_LONG] + ".weight",
                     np.array(rs["long_factor"], dtype=np.float32))
        w.add_tensor(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FACTORS_SHORT] + ".weight",
                     np.array(rs["short_factor"], dtype=np.float32))

    # Digits, "t", then "t0", "t1", ...: unique tokens and one merge
    # (llama.cpp requires merges in a GPT-2 vocabulary).
    vocab = cfg["vocab_size"]
    tokens = [str(d) for d in range(10)] + ["t"]
    tokens += [f"t{i}" for i in range(vocab - len(tokens))]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.NORMAL] * vocab)
    w.add_token_merges(["t 0"])
    for key, add in (("bos_token_id", w.add_bos_token_id), ("eos_token_id", w.add_eos_token_id)):
        if cfg.get(key) is not None:
            add(cfg[key])

    names = gguf.get_tensor_name_map(arch, n_layers)
    for hf, data in tensors.items():
        mapped = names.get_name(hf, try_suffixes=(".weight", ".bias"))
        assert mapped is not None, f"gguf-py maps no name to {hf}"
        if permutes and hf.endswith("q_proj.weight"):
            data = permute(data, n_head, n_head)
        if permutes and hf.endswith("k_proj.weight"):
            data = permute(data, n_head, n_kv)
        w.add_tensor(mapped, np.ascontiguousarray(data))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()
