"""Gemma 3 4B's image encoder on the CPU: llmd against llama.cpp's mtmd on the same mmproj GGUF, threads and image.

    python tests/benchmarks/bench_vision_encode.py [--threads 2] [--rounds 3] [--ttft 2]

The files (made once, cached in $XDG_CACHE_HOME/llmd/bench-gguf/gemma3-4b-vision/):
- an mmproj GGUF of Gemma 3 4B's shape (SigLIP: 27 layers of width 1152, FFN 4304, 16 heads, 896 x 896 pixels in
  patches of 14 = 4096 patches, average-pooled to 256 tokens; the soft-emb norm and the input projection to 2560),
  written as llama.cpp's converter writes one (tests/tiny_models.py's keys and names; the embeddings F32, the
  other matrices F16, vectors F32); the tensor list is transformers' Gemma3ForConditionalGeneration built on the meta
  device; the weights N(0, 0.02) noise, the norms' weights 1: speed, not sense, is what it is for;
- a text GGUF that both take with it: a 2-layer llama of hidden 2560 (the projector's width; 20 heads of 128, FFN
  1024), F16, with a small trained vocabulary holding Gemma 3's image tokens and Gemma 3's chat template;
- an 896 x 896 PNG (a gradient with noise), and others like it for the TTFT requests.

Measured, in --rounds rounds that alternate the two (a neighbour's load on a shared machine falls on both; each
round's line gives the load average):
- llama.cpp: one `llama-mtmd-cli` run (`make bench-anchor-mtmd`) on the files and the PNG, -t/-tb --threads, -n 1:
  the encode time it logs (tower and projector; its image preprocessing is not in it; its log is kept beside the
  files as mtmd-cli.log);
- llmd: the PNG's bytes decoded, preprocessed and encoded by the tower and projector as the daemon's
  server/vision.py does it (fp32, torch on --threads threads; the mmproj loaded once before the rounds); the
  encode alone too;
- TTFT of an image question through `llmd serve --threads` (the official openai client, streamed, max_tokens 1):
  a new image each request, so neither the encoding cache nor the prefix cache hits. llama.cpp's side is not
  measured: the bench-anchor's server (llama-cpp-python built without mtmd) cannot take images.
The ratio is llama.cpp's time over llmd's (> 1: llmd faster), on the best round of each.
"""

from __future__ import annotations

import argparse
import base64
import io
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path[:0] = [str(HERE), str(HERE.parent)]

from kquant_files import cache_dir  # noqa: E402
from llmd_daemon_proc import start_daemon  # noqa: E402

MTMD_CLI = REPO / ".anchor" / "mtmd" / "build" / "bin" / "llama-mtmd-cli"  # make bench-anchor-mtmd
VISION = dict(image_size=896, patch_size=14, hidden_size=1152, intermediate_size=4304, num_hidden_layers=27,
              num_attention_heads=16, layer_norm_eps=1e-6, vision_use_head=False)
TEXT_HIDDEN, IMAGE_TOKENS = 2560, 256
QUESTION = "What is in this picture?"


def files() -> tuple[Path, Path]:
    """(text GGUF, mmproj GGUF), side by side as llama.cpp users keep them (llmd finds the mmproj beside)."""
    folder = cache_dir() / "gemma3-4b-vision"
    text, mmproj = folder / "gemma3-4b-vision-text-F16.gguf", folder / "mmproj-gemma3-4b-vision-F16.gguf"
    folder.mkdir(parents=True, exist_ok=True)
    for path, write in ((mmproj, write_mmproj), (text, write_text)):
        if not path.exists():
            print(f"writing {path} ...", file=sys.stderr, flush=True)
            part = path.with_suffix(".part")
            write(part)
            part.replace(path)
    return text, mmproj


def write_mmproj(path: Path) -> None:
    import gguf
    import transformers as tf
    from tiny_models import gemma3_mmproj_name, gemma3_mmproj_writer

    text_config = dict(hidden_size=TEXT_HIDDEN, vocab_size=64, num_hidden_layers=1, intermediate_size=64,
                       num_attention_heads=1, num_key_value_heads=1, head_dim=64)
    config = tf.Gemma3Config(text_config=text_config, vision_config=VISION, mm_tokens_per_image=IMAGE_TOKENS)
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in tf.Gemma3ForConditionalGeneration(config).state_dict().items()}
    cfg = {"vision_config": VISION, "text_config": text_config, "mm_tokens_per_image": IMAGE_TOKENS}
    w = gemma3_mmproj_writer(path, cfg, {"image_mean": [0.5] * 3, "image_std": [0.5] * 3})
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, VISION["num_hidden_layers"])
    rng = np.random.default_rng(0)
    for hf_name, shape in shapes.items():
        name = gemma3_mmproj_name(names, hf_name)
        if name is None:
            continue
        if "norm" in hf_name and hf_name.endswith("weight"):  # LayerNorms', and the soft-emb norm's 1 + 0
            data = np.ones(shape, np.float32)
        else:
            data = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)
        # the converter's types (Gemma3VisionModel.tensor_force_quant, --outtype f16): the embeddings F32, the
        # input projection and the other matrices F16, vectors F32
        half = len(shape) >= 2 and ".embeddings." not in hf_name
        w.add_tensor(name, data.astype(np.float16) if half else data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_text(path: Path) -> None:
    import transformers as tf
    from tiny_models import GEMMA3_TEMPLATE_FILE, GEMMA3_VISION_SPECIALS, MODEL_VOCAB, train_tokenizer
    from tiny_models import write_tiny_gguf

    tok = train_tokenizer(GEMMA3_VISION_SPECIALS, add_bos="<bos>")
    ids = {t: tok.token_to_id(t) for t in GEMMA3_VISION_SPECIALS}
    config = tf.LlamaConfig(vocab_size=MODEL_VOCAB, hidden_size=TEXT_HIDDEN, intermediate_size=1024,
                            num_hidden_layers=2, num_attention_heads=20, num_key_value_heads=4,
                            max_position_embeddings=4096, bos_token_id=ids["<bos>"], eos_token_id=ids["<eos>"],
                            pad_token_id=ids["<pad>"], tie_word_embeddings=False)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        tf.LlamaForCausalLM(config).save_pretrained(folder)
        tok.save(str(folder / "tokenizer.json"))
        write_tiny_gguf(folder, path, "F16", chat_template=GEMMA3_TEMPLATE_FILE.read_text(encoding="utf-8"))


def picture(seed: int, size: int = VISION["image_size"]) -> bytes:
    """A PNG of size x size: a colour gradient with noise (a photo's entropy, not a flat fill)."""
    rng = np.random.default_rng(seed)
    ramp = np.linspace(0, 255, size, dtype=np.float32)
    rgb = np.stack([ramp[None, :].repeat(size, 0), ramp[:, None].repeat(size, 1),
                    np.full((size, size), 40.0 * (seed % 6), np.float32)], axis=-1)
    rgb = np.clip(rgb + rng.normal(0, 24, rgb.shape), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb, "RGB").save(buf, format="PNG")
    return buf.getvalue()


def load_llmd(mmproj: Path, threads: int) -> tuple[object, float]:
    from llmd.model.vision.gemma3 import load_gemma3_mmproj

    torch.set_num_threads(threads)
    start = time.perf_counter()
    vision = load_gemma3_mmproj(mmproj, torch.float32, "cpu")
    return vision, time.perf_counter() - start


def time_llmd(vision, png: bytes) -> tuple[float, float]:
    """The daemon's steps (server/vision.py `_encode`): decode_image, preprocess, encode; fp32 on the CPU.
    Returns (all of them, the encode alone) in seconds."""
    from llmd.model.vision.images import decode_image

    t0 = time.perf_counter()
    pixels = vision.preprocess(decode_image(png).image)
    t1 = time.perf_counter()
    out = vision.encode(pixels)
    t2 = time.perf_counter()
    assert tuple(out.shape) == (IMAGE_TOKENS, TEXT_HIDDEN) and bool(torch.isfinite(out).all())
    return t2 - t0, t2 - t1


def time_mtmd(text: Path, mmproj: Path, png_path: Path, threads: int, log_path: Path) -> float | None:
    """One llama-mtmd-cli run on the image: the seconds of its encode (tower and projector), from its log."""
    cli = Path(os.environ.get("LLMD_BENCH_MTMD_CLI") or MTMD_CLI)
    if not cli.is_file():
        return None
    cmd = [str(cli), "-m", str(text), "--mmproj", str(mmproj), "--image", str(png_path), "-p", QUESTION, "-n", "1",
           "-t", str(threads), "-tb", str(threads), "-c", "2048", "--temp", "0"]
    run = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=3600)
    log = run.stdout + run.stderr
    log_path.write_text(log, encoding="utf-8")
    # this version logs "mtmd batch encoding done" (each image its own batch); older ones "image slice encoded"
    found = re.findall(r"(?:mtmd batch encoding done|image slice encoded) in (\d+) ms", log)
    if run.returncode != 0 or len(found) != 1:
        raise RuntimeError(f"llama-mtmd-cli failed (rc {run.returncode}), its log: {log_path}")
    return int(found[0]) / 1000


def time_ttft(text: Path, threads: int, requests: int) -> list[float]:
    import openai

    out = []
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        (base / "config" / "llmd").mkdir(parents=True)
        (base / "config" / "llmd" / "config.toml").write_text(f'[models.bench]\npath = "{text}"\n')
        d = start_daemon(base, "--model", "bench", "--threads", str(threads), "--max-model-len", "2048")
        try:
            client = openai.OpenAI(base_url=d.url + "/v1", api_key="x", max_retries=0, timeout=3600)
            for i in range(requests):
                url = "data:image/png;base64," + base64.b64encode(picture(100 + i)).decode()
                messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                         {"type": "text", "text": QUESTION}]}]
                sent = time.perf_counter()
                for chunk in client.chat.completions.create(model="bench", messages=messages, max_tokens=1,
                                                            temperature=0, stream=True):
                    if chunk.choices and (chunk.choices[0].delta.content or chunk.choices[0].finish_reason):
                        out.append(time.perf_counter() - sent)
                        break
                else:
                    raise RuntimeError("llmd: no token")
        finally:
            if d.stop() != 0:
                print(d.log()[-3000:], file=sys.stderr)
    return out


def seconds(values: list[float]) -> str:
    return ", ".join(f"{v:.2f}" for v in values) + " s"


def load() -> str:
    return "load %.1f" % os.getloadavg()[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--rounds", type=int, default=3, help="encodes of the image on each side, alternating")
    ap.add_argument("--ttft", type=int, default=2, help="image questions through llmd serve (0: none)")
    args = ap.parse_args()

    text, mmproj = files()
    png = picture(0)
    vision, load_s = load_llmd(mmproj, args.threads)
    llmd: list[tuple[float, float]] = []
    mtmd: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        png_path = Path(tmp) / "image.png"
        png_path.write_bytes(png)
        for r in range(args.rounds):  # alternating, so that a neighbour's load on the machine falls on both
            before = load()
            m = time_mtmd(text, mmproj, png_path, args.threads, mmproj.parent / "mtmd-cli.log")
            middle = load()
            llmd.append(time_llmd(vision, png))
            if m is not None:
                mtmd.append(m)
            print(f"round {r + 1}: llama.cpp {m if m is None else f'{m:.2f} s'} ({before}), llmd "
                  f"{llmd[-1][0]:.2f} s ({middle}, now {load()})", file=sys.stderr, flush=True)
    del vision
    ttft = time_ttft(text, args.threads, args.ttft) if args.ttft else []

    size = VISION["image_size"]
    total, encode = [t for t, _ in llmd], [e for _, e in llmd]
    print(f"\nGemma 3 4B-shape image encoder (random weights, mmproj F16), one {size}x{size} PNG, "
          f"{args.threads} threads, {args.rounds} rounds")
    print(f"  llmd  decode + preprocess + tower + projector (fp32): {seconds(total)} (mmproj load {load_s:.1f} s)")
    print(f"  llmd  tower + projector:                              {seconds(encode)}")
    if not mtmd:
        print(f"  llama.cpp: {MTMD_CLI.relative_to(REPO)} missing (make bench-anchor-mtmd): llmd alone")
    else:
        print(f"  llama.cpp mtmd tower + projector (its encode log):    {seconds(mtmd)}")
        print(f"  ratio llama.cpp / llmd, best of each: {min(mtmd) / min(total):.2f}x with llmd's decode and "
              f"preprocessing, {min(mtmd) / min(encode):.2f}x encode to encode (> 1: llmd faster)")
    if ttft:
        print(f"  llmd serve TTFT of an image question (a new image each): {seconds(ttft)} "
              f"(median {statistics.median(ttft):.2f} s)")


if __name__ == "__main__":
    main()
