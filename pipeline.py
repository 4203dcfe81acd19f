"""The command line of the staged LoRA trainer. Each stage runs in its own process.

    python pipeline.py run --config configs/flux-dev.toml       # all stages, up-to-date ones skipped
    python pipeline.py encode-captions --config configs/flux-dev.toml
    python pipeline.py status demo

Importing this file does not import torch: `--help` is instant, and stage modules are imported
only inside the command that runs them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import click

ROOT = Path(__file__).resolve().parent
STAGES = ("encode-captions", "cache-latents", "train", "export-lora")
OPTIONAL_STAGES = ("sample",)  # `run` adds it when sample.after_train is set


def _stage_module(name: str) -> Any:
    import importlib

    return importlib.import_module(f"stages.{name.replace('-', '_')}")


def _load(config: str | None, run: str | None, model: str | None, sets: tuple[str, ...]) -> Any:
    from stages.core.config import load_config, parse_override

    overrides = dict(parse_override(s) for s in sets)
    if run:
        overrides["run"] = run
    if model:
        overrides["model"] = model
    return load_config(config, overrides)


def _remember_config(cfg: Any) -> None:
    """Keep the config of the last stage that ran beside the artifacts, so `status <run>` needs no
    --config."""
    from stages.core.artifacts import atomic_write_json

    atomic_write_json(cfg.run_dir / "config.json", cfg.to_dict())


def _fail(e: BaseException) -> None:
    from stages.core.errors import UserError

    user_error = isinstance(e, (UserError, FileNotFoundError))
    if user_error and not os.environ.get("LORAPIPE_DEBUG"):
        click.secho(f"error: {e}", fg="red", err=True)
        sys.exit(2)
    raise e


def config_options(f: Any) -> Any:
    f = click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
                     help="Override a config key, e.g. --set train.steps=200 (repeatable).")(f)
    f = click.option("--model", help="Override 'model': a pipeline folder or hub id.")(f)
    f = click.option("--run", help="Override the run name (artifact folder).")(f)
    f = click.option("--config", "-c", type=click.Path(dir_okay=False), help="TOML preset (see configs/).")(f)
    return f


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """Staged LoRA training for diffusion models: encode-captions, cache-latents, train, export-lora."""


def _run_stage(name: str, cfg: Any, force: bool = False, **kwargs: Any) -> None:
    from stages.core.runtime import pick_device  # noqa: F401  (imports torch once, early)

    module = _stage_module(name)
    # Under torchrun only rank 0 writes here.
    main = _launcher_rank() == 0
    if force and name in ("encode-captions", "cache-latents"):
        kwargs["force"] = True  # the stage deletes its cache once it has checked the config, under its lock
    manifest = module.run(cfg, **kwargs)
    if not main:
        return
    _remember_config(cfg)  # after the stage ran: a failed attempt must not change what `status <run>` compares
    summary = {k: manifest.get(k) for k in ("encoded_this_run", "step", "loss_first", "loss_last", "files", "seconds")
               if manifest.get(k) is not None}
    if manifest.get("stopped"):
        saved = "checkpoint and lora/final (complete=false) written" if manifest.get("saved") else "nothing new written"
        click.echo(f"{name}: stopped at step {manifest.get('step')}, {saved}; continue with `train --resume`")
        return
    click.echo(f"{name}: done {summary}")


@cli.command("encode-captions")
@config_options
@click.option("--force", is_flag=True, help="Re-encode every caption.")
def encode_captions_cmd(config: str | None, run: str | None, model: str | None, sets: tuple[str, ...], force: bool) -> None:
    """Encode captions with the text encoders only -> captions.zarr."""
    try:
        _run_stage("encode-captions", _load(config, run, model, sets), force)
    except Exception as e:  # noqa: BLE001
        _fail(e)


@cli.command("cache-latents")
@config_options
@click.option("--force", is_flag=True, help="Re-encode every image.")
def cache_latents_cmd(config: str | None, run: str | None, model: str | None, sets: tuple[str, ...], force: bool) -> None:
    """Encode crop/flip variants with the VAE only -> latents.zarr (posterior mean and logvar)."""
    try:
        _run_stage("cache-latents", _load(config, run, model, sets), force)
    except Exception as e:  # noqa: BLE001
        _fail(e)


@cli.command("train")
@config_options
@click.option("--resume", is_flag=True, help="Continue from the newest complete checkpoint.")
def train_cmd(config: str | None, run: str | None, model: str | None, sets: tuple[str, ...], resume: bool) -> None:
    """Train a LoRA on the caches, loading only the denoiser -> lora/."""
    try:
        _run_stage("train", _load(config, run, model, sets), resume=resume)
    except Exception as e:  # noqa: BLE001
        _fail(e)


@cli.command("export-lora")
@config_options
@click.option("--format", "fmt", type=click.Choice(["diffusers", "kohya"]), help="Also write a kohya/ComfyUI copy.")
@click.option("--verify", is_flag=True, default=None, help="Load the file into the family's pipeline and check every key.")
@click.option("--checkpoint", type=int, help="Export lora/checkpoint-N instead of lora/final.")
def export_cmd(config: str | None, run: str | None, model: str | None, sets: tuple[str, ...], fmt: str | None,
               verify: bool | None, checkpoint: int | None) -> None:
    """Write the adapter as a diffusers LoRA file (no base weights loaded) -> export/."""
    sets = sets + ((f"export.format={fmt}",) if fmt else ()) + (("export.verify=true",) if verify else ())
    try:
        _run_stage("export-lora", _load(config, run, model, sets), checkpoint=checkpoint)
    except Exception as e:  # noqa: BLE001
        _fail(e)


def _launcher_rank() -> int:
    """This process's global rank when torchrun or `accelerate launch` started it (else 0)."""
    return int(os.environ.get("RANK", "0"))


def stage_command(name: str, args: list[str], gpus: int) -> list[str]:
    """The child command of one stage: plain, or through torchrun with one process per GPU.
    export-lora reads one small adapter and needs no GPU: it always runs as one process."""
    script = [str(ROOT / "pipeline.py"), name, *args]
    if gpus <= 1 or name == "export-lora":
        return [sys.executable, *script]
    # --standalone: a local rendezvous on a free port, so two runs on one host never collide.
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}", *script]


def _child_args(config: str | None, run: str | None, model: str | None, sets: tuple[str, ...]) -> list[str]:
    args = (["--config", config] if config else []) + (["--run", run] if run else [])
    args += (["--model", model] if model else [])
    for s in sets:
        args += ["--set", s]
    return args


@cli.command("run")
@config_options
@click.option("--force", is_flag=True, help="Run every stage even if up to date.")
@click.option("--only", multiple=True, type=click.Choice(STAGES + OPTIONAL_STAGES), help="Run only these stages.")
@click.option("--gpus", type=click.IntRange(min=1), default=1, show_default=True,
              help="Processes per stage, one per GPU, launched through torchrun (on CPU: gloo processes).")
def run_cmd(config: str | None, run: str | None, model: str | None, sets: tuple[str, ...], force: bool,
            only: tuple[str, ...], gpus: int) -> None:
    """Run all stages in order, each as a child process; stages whose manifest matches are skipped."""
    try:
        cfg = _load(config, run, model, sets)
        from stages.core.events import EventLog
        from stages.core.stage import staleness
    except Exception as e:  # noqa: BLE001
        _fail(e)
    for name in only or STAGES + (("sample",) if cfg.sample.after_train else ()):
        try:
            ok, reasons = staleness(_stage_module(name), cfg)
        except Exception as e:  # noqa: BLE001
            _fail(e)
        if ok and not force:
            EventLog(cfg.run_dir, cfg.run, name).emit("up_to_date")
            click.echo(f"{name}: up to date, skipped")
            continue
        click.echo(f"{name}: running ({'; '.join(reasons)[:200] or 'forced'})")
        extra = ["--force"] if force and name in ("encode-captions", "cache-latents") else []
        # A stopped or killed train continues from its newest checkpoint made with this same config
        # (and ends bit-identical to an uninterrupted run); after a config change none matches.
        extra += ["--resume"] if name == "train" and not force else []
        code = _call_child(stage_command(name, [*_child_args(config, run, model, sets), *extra],
                                         1 if name in OPTIONAL_STAGES else gpus))
        if code != 0:
            click.secho(f"{name} failed (exit {code}); later stages not run", fg="red", err=True)
            sys.exit(code)
        if name == "train" and not staleness(_stage_module(name), cfg)[0]:
            click.echo("train was stopped before its last step; later stages not run (run again to continue)")
            return


def _call_child(command: list[str]) -> int:
    """Run one stage as a child and wait. SIGINT/SIGTERM sent to this parent are passed on to the
    child, which stops cleanly (train saves a checkpoint first); subprocess.call would SIGKILL it."""
    import signal

    child = subprocess.Popen(command)
    forward = lambda signum, frame: child.send_signal(signum)  # noqa: E731
    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@cli.command("status")
@click.argument("run_name", required=False)
@config_options
def status_cmd(run_name: str | None, config: str | None, run: str | None, model: str | None, sets: tuple[str, ...]) -> None:
    """Show each stage of a run as up to date or stale, and why."""
    try:
        cfg = _status_config(run_name, config, run, model, sets)
        from stages.core.artifacts import lock_holder_pid
        from stages.core.stage import staleness

        for name in STAGES:
            ok, reasons = staleness(_stage_module(name), cfg)
            mark = click.style("up to date", fg="green") if ok else click.style("stale", fg="yellow")
            pid = lock_holder_pid(cfg.run_dir, name)
            running = f"  [running now, pid {pid}]" if pid else ""
            click.echo(f"{name:16s} {mark}" + ("" if ok else f"  ({'; '.join(reasons)[:300]})") + running)
    except Exception as e:  # noqa: BLE001
        _fail(e)


def _status_config(run_name: str | None, config: str | None, run: str | None, model: str | None, sets: tuple[str, ...]) -> Any:
    if config or not run_name:
        return _load(config, run or run_name, model, sets)
    import json

    from stages.core.config import build_config

    saved = Path("artifacts") / run_name / "config.json"
    if not saved.is_file():
        raise FileNotFoundError(f"run '{run_name}' has no {saved}; pass --config <the run's preset>")
    return build_config(json.loads(saved.read_text()), str(saved))


@cli.command("stop")
@click.argument("run_name")
@click.option("--no-save", is_flag=True, help="Cancel without writing a checkpoint or adapter.")
@click.option("--artifacts", default="artifacts", show_default=True, help="Artifact root.")
def stop_cmd(run_name: str, no_save: bool, artifacts: str) -> None:
    """Ask a running `train` of RUN_NAME to stop after its current step (saving unless --no-save)."""
    from stages.train import request_stop

    pid = request_stop(Path(artifacts) / run_name, save=not no_save)
    if pid is None:
        click.secho(f"no train stage is running for run '{run_name}'", fg="yellow", err=True)
        sys.exit(1)
    click.echo(f"asked train (pid {pid}) of run '{run_name}' to stop{' without saving' if no_save else ''}")


@cli.command("sample")
@config_options
def sample_cmd(config: str | None, run: str | None, model: str | None, sets: tuple[str, ...]) -> None:
    """Render [sample] prompts with the base model and the LoRA (several seeds) -> samples/grid.png."""
    try:
        _run_stage("sample", _load(config, run, model, sets))
    except Exception as e:  # noqa: BLE001
        _fail(e)


@cli.command("inspect")
@click.argument("run_name")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--rows", type=click.IntRange(min=1), default=64, show_default=True,
              help="Rows read per store for statistics and NaN/Inf counts (evenly spaced).")
@click.option("--decode", "item", metavar="ITEM", help="Decode a cached variant of ITEM (dataset key or image id).")
@click.option("--variant", type=int, default=0, show_default=True, help="Which cached crop/flip variant to decode.")
@click.option("--sample", "draw", is_flag=True, help="Decode a posterior sample instead of the mean.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the --sample draw.")
@click.option("--out", type=click.Path(dir_okay=False), help="PNG to write (default artifacts/<run>/inspect/...).")
@click.option("--artifacts", default="artifacts", show_default=True, help="Artifact root.")
@click.option("--config", "-c", type=click.Path(dir_okay=False), help="Use this preset instead of the run's config.json.")
def inspect_cmd(run_name: str, as_json: bool, rows: int, item: str | None, variant: int, draw: bool, seed: int,
                out: str | None, artifacts: str, config: str | None) -> None:
    """Report every artifact of RUN_NAME offline; or --decode one cached latent with the VAE alone."""
    try:
        from stages import inspect as inspect_stage

        run_dir = Path(artifacts) / run_name
        cfg = _load(config, run_name, None, (f"artifacts={artifacts}",)) if config else None
        if item is None:
            report = inspect_stage.inspect_run(run_dir, cfg, rows)
            if as_json:
                click.echo(inspect_stage.to_json(report))
            else:
                from rich.console import Console

                inspect_stage.render(report, Console(width=None if sys.stdout.isatty() else 160))
            return
        cfg = inspect_stage.run_config(run_dir, cfg)
        if cfg is None:
            raise FileNotFoundError(f"run '{run_name}' has no config.json beside its artifacts; pass --config")
        stem = Path(item).stem or item
        target = Path(out) if out else run_dir / "inspect" / f"{stem}-v{variant}-{'sample' if draw else 'mean'}.png"
        path, info = inspect_stage.decode(cfg, item, variant, target, sample=draw, seed=seed)
        click.echo(inspect_stage.to_json(info) if as_json else f"decoded {item} variant {variant} -> {path} {info}")
    except Exception as e:  # noqa: BLE001
        _fail(e)


@cli.command("report")
@click.argument("run_name")
@click.option("--out", type=click.Path(dir_okay=False), help="PNG to write (default artifacts/<run>/report.png).")
@click.option("--smooth", type=float, default=0.9, show_default=True, help="EMA weight of the smoothed loss, in [0, 1).")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@click.option("--artifacts", default="artifacts", show_default=True, help="Artifact root.")
def report_cmd(run_name: str, out: str | None, smooth: float, as_json: bool, artifacts: str) -> None:
    """Plot loss (raw + smoothed), LR and samples/s over steps from events.jsonl; print a summary."""
    try:
        import json

        from stages import report

        png, summary = report.run(Path(artifacts) / run_name, Path(out) if out else None, smooth)
        if as_json:
            click.echo(json.dumps({"png": str(png), **summary}, indent=2))
        else:
            click.echo("\n".join(report.format_summary(summary)) + f"\nplot: {png}")
    except Exception as e:  # noqa: BLE001
        _fail(e)


@cli.command("keys")
def keys_cmd() -> None:
    """List every config key with its default and meaning."""
    from stages.core.config import describe_keys

    for key, default, doc in describe_keys():
        click.echo(f"{key:34s} {default:18s} {doc}")


@cli.command("demo")
@click.option("--family", default="flux", show_default=True, help="Which tiny family to demo.")
@click.option("--steps", type=int, help="Override train.steps.")
def demo_cmd(family: str, steps: int | None) -> None:
    """Build a tiny random-weight model and dataset, run every stage on CPU, render before/after."""
    from stages.demo import run_demo

    try:
        run_demo(family, steps)
    except Exception as e:  # noqa: BLE001
        _fail(e)


if __name__ == "__main__":
    cli()
