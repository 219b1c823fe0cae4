"""A small Llama-architecture model with random weights, written as GGUF for llama.cpp.

    python3 examples/python/llama_random_gguf.py OUT.gguf [--seed 0] [--layers 4] [--embd 512]
        [--heads 8] [--kv-heads 4] [--ff 1536] [--ctx 4096] [--f32]

What scripts/gpu.sh's `llama` section runs llama.cpp on (no network there, so no real model):
the weights are drawn from numpy's generator seeded with --seed, so that one seed gives the
same file, byte for byte, on every machine. The tokenizer is SentencePiece's ("llama" in GGUF):
<unk>, <s>, </s>, the 256 byte tokens <0x00>..<0xFF> (the fallback for any text), then single
characters and every prefix of a few English words (SentencePiece merges two pieces only into a
piece of the vocabulary, so a word is one token only when each of its prefixes is one), 512
tokens in all by default. The matrices are float16 (float32 with --f32), the norms float32, as
llama.cpp's converters write them.

With the defaults (4 layers, n_embd 512, 8 heads, 4 of them for K and V, n_ff 1536, context
4096) the weights are 25 MiB; at a context of 4096 the KV cache is 16 MiB in float16 and the
compute buffer for a batch of 512 tokens tens of MiB, so the allocator sees segments of every
size class. The logits are scaled to a spread of several units, so that greedy decoding does
not hang on near ties (a different kernel's rounding would then change the tokens).

Needs numpy and the `gguf` package (pure Python; its wheel on PYTHONPATH works). gguf imports
`yaml` for model cards only; where PyYAML is missing a stand-in module is put in its place.
"""

import argparse
import sys
import types

import numpy as np

try:
    import yaml  # noqa: F401
except ImportError:  # gguf.metadata imports it at the top, for model cards this script has none of
    sys.modules["yaml"] = types.ModuleType("yaml")

import gguf  # noqa: E402

WORDS = (
    "the of and to in is that it was for on are as with his they at be this from have or by one had not but what all "
    "were when we there can an your which their said if do will each about how up out them then she many some so "
    "these would other into has more her two like him see time could no make than first been its who now people my "
    "made over did down only way find use may water long little very after words called just where most know hello "
    "world model memory device cache block segment pool stream llama token"
).split()


def vocabulary(n_vocab):
    """SentencePiece pieces, scores and types: the specials, the bytes, then characters and
    word prefixes (scores falling with the position, as SentencePiece's do) up to n_vocab."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types_ = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + [gguf.TokenType.BYTE] * 256
    pieces = ["\u2581"] + list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'-")
    for w in WORDS:
        for i in range(2, len(w) + 2):
            p = "\u2581" + w[: i - 1]
            if p not in pieces:
                pieces.append(p)
    room = n_vocab - len(tokens)
    if room < 1:
        raise SystemExit(f"--vocab {n_vocab}: at least {len(tokens) + 1} (the specials and the 256 bytes)")
    pieces = pieces[:room]
    while len(pieces) < room:  # filler pieces that no text reaches, so that n_vocab is exact
        pieces.append(f"<extra_{len(pieces)}>")
    tokens += pieces
    types_ += [gguf.TokenType.NORMAL] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    return tokens, scores, types_


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--embd", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--ff", type=int, default=1536)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--ctx", type=int, default=4096, help="the model's training context (llama.context_length)")
    ap.add_argument("--f32", action="store_true", help="float32 matrices instead of float16")
    a = ap.parse_args()
    if a.embd % a.heads or a.heads % a.kv_heads:
        raise SystemExit("--embd must be a multiple of --heads, and --heads of --kv-heads")
    rng = np.random.default_rng(a.seed)
    head = a.embd // a.heads
    kv = head * a.kv_heads
    wtype = np.float32 if a.f32 else np.float16

    def mat(rows, cols, scale=1.0):
        # numpy's (rows, cols) is ggml's ne = {cols, rows}: a matrix that maps cols to rows.
        return (rng.standard_normal((rows, cols), dtype=np.float32) * (scale / np.sqrt(cols))).astype(wtype)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n, dtype=np.float32)).astype(np.float32)

    w = gguf.GGUFWriter(a.out, "llama")
    w.add_name(f"random llama {a.layers}x{a.embd} seed {a.seed}")
    w.add_context_length(a.ctx)
    w.add_embedding_length(a.embd)
    w.add_block_count(a.layers)
    w.add_feed_forward_length(a.ff)
    w.add_head_count(a.heads)
    w.add_head_count_kv(a.kv_heads)
    w.add_rope_dimension_count(head)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(a.vocab)
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if a.f32 else gguf.LlamaFileType.MOSTLY_F16)
    tokens, scores, types_ = vocabulary(a.vocab)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types_)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)

    # Embeddings of unit spread, and an output matrix that spreads the logits over several units.
    w.add_tensor("token_embd.weight", mat(a.vocab, a.embd, np.sqrt(a.embd)))
    for i in range(a.layers):
        b = f"blk.{i}"
        w.add_tensor(f"{b}.attn_norm.weight", norm(a.embd))
        w.add_tensor(f"{b}.attn_q.weight", mat(a.embd, a.embd))
        w.add_tensor(f"{b}.attn_k.weight", mat(kv, a.embd))
        w.add_tensor(f"{b}.attn_v.weight", mat(kv, a.embd))
        w.add_tensor(f"{b}.attn_output.weight", mat(a.embd, a.embd, 0.5))
        w.add_tensor(f"{b}.ffn_norm.weight", norm(a.embd))
        w.add_tensor(f"{b}.ffn_gate.weight", mat(a.ff, a.embd))
        w.add_tensor(f"{b}.ffn_up.weight", mat(a.ff, a.embd))
        w.add_tensor(f"{b}.ffn_down.weight", mat(a.embd, a.ff, 0.5))
    w.add_tensor("output_norm.weight", norm(a.embd))
    w.add_tensor("output.weight", mat(a.vocab, a.embd, 4.0))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"{a.out}: llama, {a.layers} layers, n_embd {a.embd}, {a.heads} heads ({a.kv_heads} for K/V), "
          f"n_ff {a.ff}, vocab {a.vocab}, {'f32' if a.f32 else 'f16'}, seed {a.seed}")


if __name__ == "__main__":
    main()
