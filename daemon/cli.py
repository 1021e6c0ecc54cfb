"""The `llmd` command line. Every command is thin: it parses its flags, then calls one function elsewhere."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from .errors import LlmdError

app = typer.Typer(
    name="llmd",
    help="llmd: a local LLM serving daemon for one GPU (or the CPU).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _print_version(value: bool) -> None:
    if value:
        from . import __version__

        typer.echo(f"llmd {__version__}")
        raise typer.Exit()


@app.callback()
def root(version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                      help="Print llmd's version and exit.")) -> None:
    """llmd: a local LLM serving daemon for one GPU (or the CPU)."""


def fail(message: str) -> None:
    """Print one clear line on stderr and exit 1."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(1)


# --- commands (each engineer inserts theirs below this line) ---


# The terminal UI (llmd.tui): HTTP clients of the daemon; torch is never imported on this path.


@app.command()
def chat(
    model: str = typer.Option(None, "--model", "-m", help="Model for new chats (default: the daemon's)."),
    start: bool = typer.Option(False, "--start", help="Start a daemon in the background if none answers."),
    url: str = typer.Option(None, "--url", help="Daemon base URL (default: its Unix socket, then 127.0.0.1:8471)."),
) -> None:
    """Chat in the terminal: streamed Markdown answers, saved conversations, live timings."""
    from .tui.launcher import run_chat

    run_chat(model=model, start=start, url=url)


@app.command()
def top(
    url: str = typer.Option(None, "--url", help="Daemon base URL (default: its Unix socket, then 127.0.0.1:8471)."),
) -> None:
    """Live engine dashboard: requests, KV cache, prefix hits, tokens/s and the queue/prefill/decode split."""
    from .tui.launcher import run_top

    run_top(url=url)


# The daemon and the verbs around it (llmd.server.daemon, llmd.server.control, llmd.service).


@app.command()
def serve(
    ctx: typer.Context,
    model: list[str] = typer.Option(None, "--model", "-m", help="Model to load at start and keep loaded (pinned); "
                                    "repeat for more. The first one answers requests that name no model (default: "
                                    "the bundled SmolLM2). Any other model a request names is loaded on demand."),
    keep_alive: str = typer.Option(None, "--keep-alive", help="How long an idle model stays loaded: 30s, 5m, 1h, -1 "
                                   "(forever), 0 (default 5m; a request's keep_alive overrides it)."),
    max_loaded_models: int = typer.Option(None, "--max-loaded-models", help="Models loaded at once (default 3)."),
    memory_budget: int = typer.Option(None, "--memory-budget", help="Bytes for all loaded models' weights and KV "
                                      "caches (default: 90% of the GPU's memory, or 75% of RAM)."),
    host: str = typer.Option(None, "--host", help="TCP address (default 127.0.0.1; anything else needs an API key)."),
    port: int = typer.Option(None, "--port", "-p", help="TCP port (default 8471)."),
    socket_path: str = typer.Option(None, "--socket", help="Unix socket path (default $XDG_RUNTIME_DIR/llmd.sock; 'off')."),
    ollama_port: int = typer.Option(None, "--ollama-port", help="Also listen here for Ollama clients (e.g. 11434)."),
    max_queue: int = typer.Option(None, "--max-queue", help="Waiting requests before 429 (default 64)."),
    write_timeout: float = typer.Option(None, "--write-timeout", help="Seconds a client may stall a stream (default 30)."),
    shutdown_grace: float = typer.Option(None, "--shutdown-grace", help="Seconds streams get to finish on SIGTERM (default 10)."),
    api_key_file: str = typer.Option(None, "--api-key-file", help="File holding the bearer token (mode 0600)."),
    device: str = typer.Option(None, "--device", help="cpu, cuda or cuda:N (default: CUDA when available)."),
    threads: int = typer.Option(None, "--threads", help="CPU threads each model computes with (default: every core the process may use; fewer when the cores are busy with other work)."),
    dtype: str = typer.Option(None, "--dtype", help="float32, bfloat16 or float16."),
    quant: str = typer.Option(None, "--quant", help="Weight format: none, gguf (keep a GGUF's packing), int8, int4[-g32|-g64|-g128], bnb-int8, bnb-nf4 (default: auto)."),
    max_num_seqs: int = typer.Option(None, "--max-num-seqs", help="Sequences in one batch."),
    kv_cache_bytes: int = typer.Option(None, "--kv-cache-bytes", help="KV-cache pool size in bytes."),
    kv_cache_dtype: str = typer.Option(None, "--kv-cache-dtype", help="auto (the model's dtype), fp32, fp16, bf16, or int8 (per-token scales: ~2x the context of fp16 in the same memory, small quality cost)."),
    max_model_len: int = typer.Option(None, "--max-model-len", help="Context length cap."),
    cuda_graphs: bool = typer.Option(None, "--cuda-graphs/--no-cuda-graphs", help="Replay decode steps from CUDA graphs (default on; CUDA only)."),
    draft: str = typer.Option(None, "--draft", help="Draft model for speculative decoding (same tokenizer; 'self:N' = the target's first N layers; 'mtp' = the model's own multi-token-prediction head, Qwen3.5)."),
    num_speculative_tokens: int = typer.Option(None, "--num-speculative-tokens", help="Tokens proposed per step (default 4)."),
    spec_mode: str = typer.Option(None, "--spec-mode", help="off, ngram (prompt lookup), draft or auto (adaptive; default with --draft). draft/auto with no --draft use the model's MTP head if it has one."),
) -> None:
    """Run the daemon: OpenAI, Ollama and llama.cpp HTTP APIs on loopback and a Unix socket."""
    from .config import load_settings
    from .server.daemon import serve as run_daemon

    flags = dict(ctx.params)  # every flag is a setting of the same name, but these
    models = flags.pop("model") or []
    flags.update(model=models[0] if models else None, preload=models[1:] or None, draft_model=flags.pop("draft"))
    raise typer.Exit(run_daemon(load_settings(**flags)))


@app.command()
def ps() -> None:
    """Show what the daemon has loaded, its memory and its running/waiting requests."""
    from .config import load_settings
    from .server.control import ps as daemon_ps

    typer.echo(daemon_ps(load_settings()))


@app.command()
def stop() -> None:
    """Stop the daemon gracefully (running streams get the grace period)."""
    from .config import load_settings
    from .server.control import stop as daemon_stop

    typer.echo(daemon_stop(load_settings()))


@app.command()
def run(
    model: str = typer.Argument(None, help="Model name (the daemon is started with it if none runs)."),
    prompt: str = typer.Argument(None, help="Prompt; without it, read stdin or open a simple prompt loop."),
    temperature: float = typer.Option(None, "--temperature", "-t", help="0 for greedy (default: the server's)."),
    max_tokens: int = typer.Option(None, "--max-tokens", "-n", help="Cap on generated tokens."),
    image: list[Path] = typer.Option(None, "--image", "-i", help="An image to ask about (repeatable)."),
) -> None:
    """One-shot generation through the daemon, starting it if none runs."""
    from .config import load_settings
    from .server.control import run as daemon_run

    daemon_run(load_settings(), model, prompt, images=image or [], temperature=temperature, max_tokens=max_tokens)


service_app = typer.Typer(help="Install the daemon as a systemd user service.", no_args_is_help=True)
app.add_typer(service_app, name="service")


@service_app.command("install")
def service_install(enable: bool = typer.Option(True, "--enable/--no-enable", help="Also enable and start it.")) -> None:
    """Write ~/.config/systemd/user/llmd.service (Restart=on-failure, logs to journald)."""
    from .service import install

    typer.echo(install(enable=enable))


@service_app.command("uninstall")
def service_uninstall() -> None:
    """Stop, disable and remove the user unit."""
    from .service import uninstall

    typer.echo(uninstall())


@service_app.command("status")
def service_status() -> None:
    """Whether the unit is installed, and systemd's view of it."""
    from .service import status

    typer.echo(status())


# Model store and one-shot generation (llmd.store, llmd.generate).


@app.command()
def pull(name: str = typer.Argument(..., help="An alias (qwen2.5:0.5b), a repo id (Qwen/Qwen2.5-0.5B-Instruct), or OWNER/NAME:FILE.gguf.")):
    """Download a model into the Hugging Face cache (safetensors and tokenizer files only)."""
    from .store import pull as store_pull

    files = store_pull(name)
    typer.echo(f"pulled {files.name}: {files.path}")


@app.command("list")
def list_cmd():
    """List the models that can be served: bundled, in the Hugging Face cache, in Ollama's store, in the config."""
    from .config import load_settings
    from .store import human_size, list_models

    rows = [("NAME", "ARCHITECTURE", "SIZE", "QUANTIZATION", "SOURCE")]
    for m in list_models():
        if m.info is None:
            rows.append((m.name, f"unreadable: {m.problem}", human_size(m.size_bytes), "?", m.source))
            continue
        quant = m.info.quantization or f"none ({(m.info.dtype or '?').split(' ')[0]})"
        rows.append((m.name, m.info.architecture or "?", human_size(m.size_bytes), quant, m.source))
    for name, table in load_settings().models.items():  # [models.NAME] of the config
        rows.append((name, "?", "?", "?", f"remote {table['url']}" if "url" in table else f"config {table['path']}"))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        typer.echo("  ".join(c.ljust(w) for c, w in zip(r[:4], widths, strict=True)) + "  " + r[4])


@app.command()
def show(name: str = typer.Argument(None, help="A model name, folder or .gguf file (default: the bundled model).")):
    """Show a model's architecture, parameter count, dtype/quantization, context length, chat template and files."""
    from .store import describe, human_count, human_size, resolve

    info = describe(resolve(name))
    f = info.files
    typer.echo(f"name:            {f.name}")
    typer.echo(f"source:          {f.repo_id or f.path} ({'GGUF' if f.kind == 'gguf' else 'Hugging Face folder'})")
    typer.echo(f"path:            {f.path}")
    typer.echo(f"architecture:    {info.architecture or '?'}")
    params = f"{human_count(info.parameters)} ({info.parameters:,})" if info.parameters else "?"
    typer.echo(f"parameters:      {params}")
    typer.echo(f"dtype:           {info.dtype or '?'}")
    typer.echo(f"quantization:    {info.quantization or 'none'}")
    typer.echo(f"context length:  {info.context_length or '?'}")
    typer.echo(f"chat template:   {'yes' if info.chat_template else 'no'}")
    typer.echo(f"files:           {len(info.file_sizes)} ({human_size(info.size_bytes)})")
    for rel, size in info.file_sizes:
        typer.echo(f"  {rel}  {human_size(size)}")


@app.command()
def rm(name: str = typer.Argument(..., help="A pulled model: an alias or a repo id.")):
    """Remove a pulled model from the Hugging Face cache."""
    from .store import human_size, remove_model

    repo_id, freed = remove_model(name)
    typer.echo(f"removed {repo_id} ({human_size(freed)} freed)")


from . import generate as _gen  # noqa: E402  (light: the defaults below; torch is imported only when generating)


@app.command()
def generate(
    prompt: str = typer.Argument(..., help="The prompt. Instruct models get it as a user turn in their chat template."),
    model: str = typer.Option(None, "--model", "-m", help="Model name, folder or .gguf file (default: LLMD_MODEL, config.toml, else the bundled SmolLM2-135M-Instruct)."),
    max_tokens: int = typer.Option(_gen.DEFAULT_MAX_TOKENS, "--max-tokens", "-n", min=1, max=1_000_000, help="Most tokens to generate."),
    temperature: float = typer.Option(_gen.DEFAULT_TEMPERATURE, "--temperature", "-t", min=0.0, max=100.0, help="0 (the default) is greedy: one-shot answers are reproducible. 0.8 samples like Ollama and llama.cpp."),
    top_k: int = typer.Option(_gen.DEFAULT_TOP_K, "--top-k", min=0, help="Sample from the k most likely tokens (0: off)."),
    top_p: float = typer.Option(_gen.DEFAULT_TOP_P, "--top-p", min=0.0, max=1.0, help="Nucleus sampling threshold."),
    min_p: float = typer.Option(_gen.DEFAULT_MIN_P, "--min-p", min=0.0, max=1.0, help="Drop tokens below min_p x the top token's probability."),
    seed: int = typer.Option(None, "--seed", "-s", help="Seed for reproducible sampling."),
    raw: bool = typer.Option(False, "--raw", help="Send the prompt as is, without the chat template."),
    dtype: str = typer.Option(None, "--dtype", help="float32, bfloat16 or float16 (default: float32 on CPU, bfloat16 on CUDA)."),
    device: str = typer.Option(None, "--device", help="cpu or cuda (default: cuda when available)."),
    threads: int = typer.Option(None, "--threads", help="CPU threads for the model (default: every core the process may use; fewer when the cores are busy)."),
    quant: str = typer.Option(None, "--quant", help="Weight format: none (dequantize), gguf (keep a GGUF's own packing), int8, int4 (default: auto)."),
):
    """Generate text from PROMPT and stream it to stdout (load time and speed go to stderr)."""
    from .config import load_settings, usable_cores
    from .store import resolve

    # Settings and the model name are checked before torch is imported, so those mistakes fail fast.
    settings = load_settings(model=model, dtype=dtype, device=device, threads=threads)
    files = resolve(settings.model)

    from .engine.types import SamplingParams
    from .generate import GenerationStats, check_device, generate_stream, prompt_token_ids, set_threads, torch_dtype
    from .model.loader import load_model
    from .model.quant import parse_quant

    try:
        parse_quant(quant, files.kind)
    except ValueError as exc:
        fail(f"--quant: {exc}")
    check_device(settings.device)
    set_threads(settings.threads or usable_cores())
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                            min_p=min_p, seed=seed).validate()
    loaded = load_model(files, dtype=torch_dtype(settings.dtype), device=settings.device, quant=quant)
    r, mib = loaded.report, 1024 * 1024
    memory = f"; weights {r.weight_bytes / mib:.0f} MiB, peak RSS {r.peak_rss_bytes / mib:.0f} MiB" if r else ""
    import torch

    threads = f", {torch.get_num_threads()} CPU threads" if loaded.device.type == "cpu" else ""
    typer.echo(f"loaded {loaded.name} in {loaded.load_seconds:.2f} s ({loaded.device}, "
               f"{str(loaded.dtype).removeprefix('torch.')}{threads}){memory}", err=True)
    ids = prompt_token_ids(loaded.tokenizer, prompt, raw)
    stats = GenerationStats()
    for delta in generate_stream(loaded, ids, params, stats, kv_cache_dtype=settings.kv_cache_dtype):
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    speed = f", {stats.tokens_per_second:.1f} tok/s" if stats.tokens_per_second else ""
    ttft = f", first token {stats.ttft_s:.2f} s" if stats.ttft_s is not None else ""
    typer.echo(f"{stats.prompt_tokens} prompt + {stats.generated_tokens} generated tokens in {stats.total_s:.2f} s{ttft}{speed}", err=True)


@app.command()
def bench(
    url: str = typer.Option(None, "--url", help="Server root or OpenAI base URL (default: the local llmd daemon)."),
    model: str = typer.Option(None, "--model", help="Model name to request (default: the first in /v1/models)."),
    api: str = typer.Option("chat", "--api", help="chat (/v1/chat/completions) or completions (/v1/completions)."),
    api_key: str = typer.Option(None, "--api-key", envvar="LLMD_API_KEY", help="Bearer token, if the server needs one."),
    workload: str = typer.Option("chat", "--workload", "-w", help="chat, shared-prefix, long-prompt or code-edit."),
    prompts: str = typer.Option(None, "--prompts", help="JSONL file of your own prompts (overrides --workload)."),
    requests: int = typer.Option(None, "--requests", "-n", help="Requests per load level (default 32; 16 in a sweep)."),
    duration: float = typer.Option(None, "--duration", help="Seconds per load level (no new request after it)."),
    concurrency: int = typer.Option(1, "--concurrency", "-c", help="Closed loop: clients sending back to back."),
    rate: float = typer.Option(None, "--rate", "-r", help="Open loop: Poisson arrivals per second."),
    sweep: str = typer.Option(None, "--sweep", help="Load levels: 1,2,4,8 or 1..16 (concurrency, or rates with --rate)."),
    max_tokens: int = typer.Option(64, "--max-tokens", help="Output tokens per request (cap)."),
    prompt_words: int = typer.Option(None, "--prompt-words", help="Length of long prompts / the shared prefix."),
    seed: int = typer.Option(0, "--seed", help="Seed of the generated workload and arrivals."),
    slo_ttft: float = typer.Option(500.0, "--slo-ttft-ms", help="Goodput SLO on time to first token (0: none)."),
    slo_tpot: float = typer.Option(50.0, "--slo-tpot-ms", help="Goodput SLO on time per output token (0: none)."),
    slo_e2e: float = typer.Option(0.0, "--slo-e2e-ms", help="Goodput SLO on end-to-end time (0: none)."),
    json_out: str = typer.Option(None, "--json", help="Write the report as JSON to this file ('-': stdout)."),
    plot: str = typer.Option(None, "--plot", help="Write PNG plots into this folder (needs matplotlib)."),
    compare: tuple[str, str] = typer.Option(None, "--compare", help="Two URLs: the same workload on both, alternating."),
    timeout: float = typer.Option(300.0, "--timeout", help="Seconds before one request is given up."),
    progress: bool = typer.Option(None, "--progress/--no-progress", help="Progress bar (default: on a terminal)."),
) -> None:
    """Load-test an OpenAI-compatible server: per-stage latency, throughput, goodput and a diagnosis."""
    from .bench.command import BenchOptions, run_bench
    from .bench.report import Slo

    opts = BenchOptions(
        url=url, model=model, api=api, api_key=api_key, workload=workload, prompts_file=prompts, requests=requests,
        duration_s=duration, concurrency=concurrency, rate=rate, sweep=sweep, max_tokens=max_tokens,
        prompt_words=prompt_words, seed=seed, json_path=json_out, plot_dir=plot, compare=compare,
        timeout_s=timeout, progress=progress,
        slo=Slo(ttft_ms=slo_ttft or None, tpot_ms=slo_tpot or None, e2e_ms=slo_e2e or None),
    )
    code = run_bench(opts)
    if code:
        raise typer.Exit(code)


def main() -> None:
    """Run the CLI. User errors (LlmdError, bad flags) print one line on stderr and exit 1, never a traceback."""
    try:  # recent typer vendors click; older ones use click itself
        from typer._click import exceptions as click_errors
    except ImportError:  # pragma: no cover
        from click import exceptions as click_errors

    try:
        code = app(standalone_mode=False, prog_name="llmd")
    except click_errors.NoArgsIsHelpError as exc:  # `llmd` or a group with no command: show its help
        typer.echo(exc.ctx.get_help() if exc.ctx else str(exc))
        code = 0
    except click_errors.UsageError as exc:  # bad flag value, unknown option, missing argument
        hint = f" (see: {exc.ctx.command_path} --help)" if exc.ctx else ""
        typer.echo(f"error: {' '.join(exc.format_message().split())}{hint}", err=True)
        code = 1
    except click_errors.ClickException as exc:
        typer.echo(f"error: {' '.join(exc.format_message().split())}", err=True)
        code = 1
    except LlmdError as exc:
        typer.echo(f"error: {' '.join(str(exc).split())}", err=True)
        code = 1
    except (KeyboardInterrupt, typer.Abort):
        typer.echo("", err=True)
        code = 130
    except BrokenPipeError:  # `llmd generate ... | head`: the reader left
        sys.stderr.close()
        code = 1
    sys.exit(code if isinstance(code, int) else 0)
