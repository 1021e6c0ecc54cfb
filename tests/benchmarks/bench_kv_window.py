"""KV cache bytes per token with and without the sliding-window saving, for a Gemma 3 270M-shaped config (18 layers,
1 KV head of 256, window 512 on 5 of every 6 layers: global layers 5, 11, 17) at 8k and 32k tokens of context.
Prints figures; not a timed test. (The shape is all KV bytes depend on: no weights are needed.)

Two columns per context:
- "formula": llmd.engine.runner.kv_bytes_per_sequence, the rule the KV pools are sized by (a window layer holds the
  blocks its window and one prefill chunk span; a global layer the whole context);
- "allocator": the engine's own Scheduler and BlockManagers (the two KV groups of a mixed model) driven through a
  chunked prefill of the context and 16 decode steps without a model, the most blocks the sequence held at once in
  each group, times each group's bytes per block; and what it holds while decoding (the window without a chunk).

    python tests/benchmarks/bench_kv_window.py [--contexts 8192,32768] [--chunk 512] [--kv-bytes 2]
"""

from __future__ import annotations

import argparse

import torch

from llmd.engine.block_manager import BlockManager
from llmd.engine.runner import kv_bytes_per_block, kv_bytes_per_sequence
from llmd.engine.scheduler import Scheduler
from llmd.engine.sequence import Sequence
from llmd.engine.types import Priority, RequestTimings, SamplingParams
from llmd.model.config import ModelConfig

BLOCK = 16


def gemma3_270m_shape() -> ModelConfig:
    layers = 18
    return ModelConfig(architecture="MistralForCausalLM", vocab_size=262144, hidden_size=640, intermediate_size=2048,
                       num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                       max_position_embeddings=32768, sliding_window=512,
                       layer_types=["full_attention" if i % 6 == 5 else "sliding_attention" for i in range(layers)])


def allocator_peak(config: ModelConfig, tokens: int, chunk: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The most blocks one sequence held at once in the global and in the window group, and what it held at its
    last decode step."""
    window = max(w for w in config.layer_windows if w is not None)
    blocks = -(-(tokens + 16) // BLOCK) + 4
    bm = BlockManager(blocks, BLOCK)
    wbm = BlockManager(blocks, BLOCK, window=window)
    sched = Scheduler(bm, max_num_seqs=1, max_num_batched_tokens=chunk, window_bm=wbm)
    seq = Sequence("s", list(range(tokens)), SamplingParams(max_tokens=16), Priority.INTERACTIVE, RequestTimings(0.0))
    sched.add(seq)
    peak = last = (0, 0)
    while seq.num_output_tokens < 16:
        for s in sched.schedule().scheduled:
            last = (len(seq.block_ids), len(seq.window_blocks.held))
            peak = (max(peak[0], last[0]), max(peak[1], last[1]))
            seq.num_computed_tokens += s.num_new_tokens
            if s.completes:
                seq.token_ids.append(0)
            bm.register_full_blocks(seq.block_ids, seq.block_hashes, seq.token_ids, seq.num_computed_tokens)
            wbm.register_full_blocks(seq.window_blocks.ids, seq.window_blocks.hashes, seq.token_ids,
                                     seq.num_computed_tokens)
            sched.drop_out_of_window(seq)
    sched.remove(seq)
    bm.check_idle()
    wbm.check_idle()
    return peak, last


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="8192,32768")
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk (max_num_batched_tokens; CPU default)")
    ap.add_argument("--kv-bytes", type=int, default=2, choices=(1, 2, 4), help="bytes per K/V element")
    args = ap.parse_args()
    c = gemma3_270m_shape()
    dtype = {1: torch.int8, 2: torch.float16, 4: torch.float32}[args.kv_bytes]
    kind = {1: "int8", 2: "fp16", 4: "fp32"}[args.kv_bytes]
    n_window = sum(w is not None for w in c.layer_windows)
    n_global = c.num_hidden_layers - n_window
    print(f"Gemma 3 270M shape: {c.num_hidden_layers} layers ({n_global} global, {n_window} window "
          f"{c.sliding_window}), {c.num_key_value_heads} KV head x {c.head_dim}, KV {kind}, blocks of {BLOCK}, "
          f"prefill chunk {args.chunk}")
    per_global = kv_bytes_per_block(c, BLOCK, dtype, kind, n_global)
    per_window = kv_bytes_per_block(c, BLOCK, dtype, kind, n_window)
    print(f"{'context':>8} {'no window saving':>22} {'window saving (formula)':>26} {'(allocator)':>12} "
          f"{'ratio':>6} {'decoding (allocator)':>22}")
    for tokens in (int(t) for t in args.contexts.split(",")):
        without = kv_bytes_per_sequence(c, tokens, BLOCK, dtype, kind, chunk=None)
        with_saving = kv_bytes_per_sequence(c, tokens, BLOCK, dtype, kind, chunk=args.chunk)
        (g, w), (dg, dw) = allocator_peak(c, tokens, args.chunk)
        measured = g * per_global + w * per_window
        decoding = dg * per_global + dw * per_window
        print(f"{tokens:>8} {without / tokens:>9.0f} B/token {without / 2**20:>6.1f} MiB "
              f"{with_saving / tokens:>9.0f} B/token {with_saving / 2**20:>6.1f} MiB "
              f"{measured / 2**20:>8.1f} MiB {without / with_saving:>5.2f}x "
              f"{decoding / (tokens + 16):>6.0f} B/token {decoding / 2**20:>6.1f} MiB")


if __name__ == "__main__":
    main()
