"""The command line of the staged LoRA trainer. Each stage runs in its own process.

    lorapipe run --config configs/flux-dev.toml        # all stages, up-to-date ones skipped
    lorapipe encode-captions --config configs/flux-dev.toml
    lorapipe status my-lora                            # a run by name: its saved config.json

(`lorapipe` is installed in the venv; `.venv/bin/python pipeline.py ...` is the same.) Every command
that names a run takes it the same way: a run name, or `--config`, plus `--artifacts` (see
`stages.core.runspec`). Importing this file does not import torch: `--help` is instant, and stage
modules are imported only inside the command that runs them.
"""

from __future__ import annotations

import functools
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Callable

import click

from stages import registry
from stages.core.runspec import RunSpec, forget, invoke
from stages.families import FAMILIES

ROOT = Path(__file__).resolve().parent
def _settled(spec: RunSpec, write: bool = True) -> Any:
    """The command's Config, once the run's settings are settled (stages/run_settings.py): a preset
    given with --config becomes them (saved when `write`), its changes shown; by name, an edit of the
    run's preset since is named. The lines go to stderr."""
    from stages import run_settings

    cfg = spec.load()  # every key of the command line checked before anything is saved
    for line in run_settings.settle(spec, write):
        click.secho(line, fg="yellow", err=True)
    return cfg


def _fail(e: BaseException) -> None:
    """A user's mistake or an OS refusal (permissions, a read-only disk, a name too long) is one red
    line and exit 2; anything else is a bug and keeps its traceback."""
    from stages.core.errors import UserError
    from stages.core.fsaccess import os_error_message

    if os.environ.get("LORAPIPE_DEBUG"):
        raise e
    if isinstance(e, BrokenPipeError):  # `lorapipe status x | head -1`: the reader left; nothing to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
    if isinstance(e, UserError) or isinstance(e, FileNotFoundError) and not e.filename:
        message = str(e)  # ours: it already names the file and what to do
    elif isinstance(e, OSError):
        message = os_error_message(e)
    else:
        raise e
    click.secho(f"error: {message}", fg="red", err=True)
    sys.exit(2)


def _guarded(f: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        try:
            f(*args, **kwargs)
        except KeyboardInterrupt:  # Ctrl-C, or SIGTERM to a stage (stages.core.stage): one line, no "Aborted!"
            from stages.core.runspec import command_for

            name = click.get_current_context().info_name
            click.secho(f"{name}: stopped; what it wrote is kept, and `{command_for(None, name)}` continues",
                        fg="yellow", err=True)
            sys.exit(130)
        except Exception as e:  # noqa: BLE001 - _fail re-raises what is not the user's
            _fail(e)
        finally:
            from stages.core.image_index import request_rehash

            forget()
            request_rehash(False)
            _SHOWN.clear()
    return wrapper


def _verbose(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if value:
        os.environ["LORAPIPE_VERBOSE"] = "1"  # read by each stage when it quiets library logs; children inherit it


verbose_option = click.option("--verbose", is_flag=True, expose_value=False, callback=_verbose,
                              help="Show the libraries' own warnings and loading bars (also LORAPIPE_DEBUG=1).")


def _quiet(f: Callable[..., None]) -> Callable[..., None]:
    """A command that loads the libraries outside a stage (the `lora` tools): their known notices are
    quieted first, as each stage does (stages.core.runtime.quiet_libraries), unless --verbose."""
    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        from stages.core.runtime import quiet_libraries
        from stages.families import library_notices

        quiet_libraries(notices=library_notices())
        f(*args, **kwargs)
    return wrapper


def run_options(f: Callable[..., None]) -> Callable[..., None]:
    """RUN / --config / --artifacts / --model / --set / --verbose, handed to the command as `spec`."""
    @functools.wraps(f)
    def wrapper(run_name: str | None, run: str | None, config: str | None, artifacts: str | None, model: str | None,
                sets: tuple[str, ...], once: tuple[str, ...], **kwargs: Any) -> None:
        if run_name and run and run_name != run:
            raise click.UsageError(f"run named twice: '{run_name}' and --run '{run}'")
        f(spec=invoke(RunSpec(run_name or run, config, artifacts, model, sets, once).from_path()), **kwargs)

    wrapper = verbose_option(wrapper)
    wrapper = click.option("--once", multiple=True, hidden=True)(wrapper)  # a parent's command flags (RunSpec.flags)
    wrapper = click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
                           help="Set a config key, e.g. --set train.steps=200 (repeatable): for this command, or with "
                                "--config part of the run's settings; `lorapipe config RUN --set` changes the run's.")(wrapper)
    wrapper = click.option("--model", help="Set 'model' (a pipeline folder or hub id), as --set does.")(wrapper)
    wrapper = click.option("--artifacts", metavar="DIR",
                           help="Root folder of the runs [default: the config's 'artifacts', else ./artifacts].")(wrapper)
    wrapper = click.option("--run", help="Same as RUN (renames the run when given with --config).")(wrapper)
    wrapper = click.option("--config", "-c", type=click.Path(dir_okay=False), help="TOML preset (see configs/).")(wrapper)
    return click.argument("run_name", metavar="[RUN]", required=False)(wrapper)


def vram_option(f: Callable[..., None]) -> Callable[..., None]:
    """--vram GB on the commands that load models: sets gpu.vram_budget_gb (see `lorapipe plan`)."""
    @functools.wraps(f)
    def wrapper(spec: RunSpec, vram: str | None, **kwargs: Any) -> None:
        f(spec=invoke(spec.with_flags(*((f"gpu.vram_budget_gb={vram}",) if vram else ()))), **kwargs)

    return click.option("--vram", metavar="GB|auto",
                        help="GPU memory the stage may use (gpu.vram_budget_gb), for this command only.")(wrapper)


def _rehash(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if value:
        from stages.core.image_index import request_rehash

        request_rehash()


def rehash_option(f: Callable[..., None]) -> Callable[..., None]:
    """--rehash on the commands that scan the dataset: read every image again instead of trusting the
    index of unchanged file stats (stages/core/image_index.py)."""
    return click.option("--rehash", is_flag=True, expose_value=False, callback=_rehash,
                        help="Read and hash every image again, even those whose size and times did not change "
                             "(for file systems whose times cannot be trusted).")(f)


def examples(*lines: str) -> str:
    """A command's --help epilog: example invocations, kept on their own lines."""
    return "\b\nExamples:\n" + "\n".join(f"  lorapipe {line}" for line in lines) + "\n"


_SHOWN: set[str] = set()  # the product's warnings this command printed (`_guarded` forgets them when it ends)


def _show_warning(message: Any, category: type[Warning], filename: str, lineno: int, file: Any = None,
                  line: str | None = None) -> None:
    """The product's own warnings (a damaged manifest or image index) as one `warning: ...` line, without the
    file name and source line Python adds, once per command however many checks read that file; the
    libraries' warnings as Python shows them."""
    if category.__module__.startswith("stages."):
        if str(message) not in _SHOWN:
            _SHOWN.add(str(message))
            click.secho(f"warning: {message}", fg="yellow", err=True)
    else:
        _python_show_warning(message, category, filename, lineno, file, line)


_python_show_warning, warnings.showwarning = warnings.showwarning, _show_warning


@click.group(context_settings={"help_option_names": ["-h", "--help"]}, epilog=examples(
    "run --config configs/flux-dev.toml", "status my-lora", "train my-lora --resume"))
@click.version_option(package_name="lorapipe", prog_name="lorapipe", message="%(prog)s %(version)s")
def cli() -> None:
    """Staged LoRA training for diffusion models: encode-captions, cache-latents, train, export-lora.

    Every command that names a run takes RUN (read from <artifacts>/RUN/config.json; a run folder's
    path works too, e.g. artifacts/my-lora) or --config
    PRESET, plus --artifacts DIR."""
    from stages.core.proc import die_with_parent_if_asked

    die_with_parent_if_asked()


def _run_stage(name: str, cfg: Any, force: bool = False, **kwargs: Any) -> None:
    from stages.core.caches import lora_final_dir
    from stages.core.config import command
    from stages.core.fsaccess import ensure_writable
    from stages.families import check_model_family
    from stages.core.runtime import pick_device  # noqa: F401  (imports torch once, early)

    stage = registry.get(name)
    # Under torchrun only rank 0 writes here.
    main = _launcher_rank() == 0
    if main:
        ensure_writable(cfg.run_dir)
        check_model_family(cfg)  # before the stage starts: one line
    if force and stage.takes_force:
        kwargs["force"] = True  # a cache stage deletes its cache once it has checked the config, under its lock
    manifest = stage.run(cfg, **kwargs)
    if not main:
        return
    if manifest.get("up_to_date") and name == "train":
        click.echo(f"train: up to date (step {manifest.get('step')} of {cfg.train.steps}, made with these settings), "
                   f"nothing to train; `{command(cfg, 'train', '--restart')}` trains again from step 0")
    if manifest.get("stopped"):
        where = lora_final_dir(cfg, manifest.get("expert")).relative_to(cfg.run_dir).as_posix()
        saved = f"checkpoint and {where} (complete=false) written" if manifest.get("saved") else "nothing new written"
        whose = f" of the {manifest['expert']} expert" if manifest.get("expert") else ""
        click.echo(f"{name}: stopped at step {manifest.get('step')}{whose}, {saved}; continue with "
                   f"`{command(cfg, 'train', '--resume')}`")
        return


def _launcher_rank() -> int:
    """This process's global rank when torchrun or `accelerate launch` started it (else 0)."""
    return int(os.environ.get("RANK", "0"))


@cli.command("encode-captions", epilog=examples("encode-captions --config configs/flux-dev.toml",
                                                "encode-captions my-lora --force"))
@run_options
@vram_option
@click.option("--force", is_flag=True, help="Re-encode every caption.")
@rehash_option
@_guarded
def encode_captions_cmd(spec: RunSpec, force: bool) -> None:
    """Encode captions with the text encoders only -> captions.zarr."""
    _run_stage("encode-captions", _settled(spec), force)


@cli.command("cache-latents", epilog=examples("cache-latents --config configs/flux-dev.toml",
                                              "cache-latents my-lora --set data.resolution=768"))
@run_options
@vram_option
@click.option("--force", is_flag=True, help="Re-encode every image.")
@rehash_option
@_guarded
def cache_latents_cmd(spec: RunSpec, force: bool) -> None:
    """Encode crop/flip variants with the VAE only -> latents.zarr (posterior mean and logvar)."""
    _run_stage("cache-latents", _settled(spec), force)


@cli.command("train", epilog=examples("train --config configs/flux-dev.toml", "train my-lora --resume",
                                      "train my-lora --force        # start over; old checkpoints set aside"))
@run_options
@vram_option
@click.option("--resume", is_flag=True, help="Continue from the newest complete checkpoint.")
@click.option("--force", "--restart", "restart", is_flag=True,
              help="Start over from step 0; the old checkpoints are set aside, not deleted.")
@rehash_option
@_guarded
def train_cmd(spec: RunSpec, resume: bool, restart: bool) -> None:
    """Train a LoRA on the caches, loading only the denoiser -> lora/."""
    if resume and restart:
        raise click.UsageError("--resume and --force/--restart exclude each other")
    _run_stage("train", _settled(spec), resume=resume, **({"restart": True} if restart else {}))


@cli.command("export-lora", epilog=examples("export-lora my-lora --format kohya --verify",
                                            "export-lora my-lora --checkpoint 400"))
@run_options
@click.option("--format", "fmt", type=click.Choice(["diffusers", "kohya"]), help="Also write a kohya/ComfyUI copy.")
@click.option("--verify", is_flag=True, default=None, help="Load the file into the family's pipeline and check every key.")
@click.option("--checkpoint", type=int, help="Export lora/checkpoint-N instead of lora/final.")
@click.option("--ema", is_flag=True, default=None, help="Export the EMA of the weights (train.ema_decay > 0).")
@click.option("--force", is_flag=True, help="Rewrite the export even when it is up to date.")
@_guarded
def export_cmd(spec: RunSpec, fmt: str | None, verify: bool | None, checkpoint: int | None, ema: bool | None,
               force: bool) -> None:
    """Write the adapter as a diffusers LoRA file (no base weights loaded) -> export/."""
    flags = ((f"export.format={fmt}",) if fmt else ()) + (("export.verify=true",) if verify else ()) + (
        ("export.ema=true",) if ema else ())
    spec = invoke(spec.with_flags(*flags))  # this export only: the run's settings keep theirs
    _run_stage("export-lora", _settled(spec), force, checkpoint=checkpoint)


@cli.command("sample", epilog=examples("sample my-lora", "sample --config configs/flux-dev.toml"))
@run_options
@vram_option
@click.option("--force", is_flag=True, help="Render again even when the samples are up to date.")
@rehash_option
@_guarded
def sample_cmd(spec: RunSpec, force: bool) -> None:
    """Render [sample] prompts with the base model and the LoRA (several seeds) -> samples/grid.png."""
    _run_stage("sample", _settled(spec), force)


def stage_command(name: str, args: list[str], gpus: int) -> list[str]:
    """The child command of one stage: plain, or through torchrun with one process per GPU.
    A stage declared `one_process` (export-lora, sample) always runs as one process.
    `args` come after the script path, where torchrun passes them on (RunSpec.child_args)."""
    script = [str(ROOT / "pipeline.py"), name, *args]
    if gpus <= 1 or registry.get(name).one_process:
        return [sys.executable, *script]
    # --standalone: a local rendezvous on a free port, so two runs on one host never collide.
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}", *script]


@cli.command("run", epilog=examples("run --config configs/flux-dev.toml", "run my-lora --only train --gpus 2"))
@run_options
@vram_option
@click.option("--force", is_flag=True, help="Run every stage even if up to date (train starts over).")
@click.option("--only", multiple=True, type=click.Choice(registry.NAMES), help="Run only these stages.")
@click.option("--gpus", type=click.IntRange(min=1), default=1, show_default=True,
              help="Processes per stage, one per GPU, launched through torchrun (on CPU: gloo processes).")
@click.option("--dry-run", is_flag=True, help="Print each stage's memory plan (as `plan` does) and run nothing.")
@rehash_option
@_guarded
def run_cmd(spec: RunSpec, force: bool, only: tuple[str, ...], gpus: int, dry_run: bool) -> None:
    """Run all stages in order, each as a child process; stages whose manifest matches are skipped.
    A child stage dies with this process (SIGTERM when it is killed)."""
    from stages.core.dataset import one_walk
    from stages.core.fsaccess import ensure_writable

    cfg = _settled(spec, write=not dry_run)
    if dry_run:
        from stages import plan

        plan.run(cfg, None, as_json=False)
        return
    ensure_writable(cfg.run_dir)
    _rehash_once(cfg)
    with one_walk() as walks:  # the checks of the stages skipped in a row read one walk of the dataset
        _run_stages(spec, cfg, only, force, gpus, walks)


def _run_stages(spec: RunSpec, cfg: Any, only: tuple[str, ...], force: bool, gpus: int, walks: dict) -> None:
    from stages.core.events import EventLog
    from stages.core.proc import call_child
    from stages.core.stage import staleness

    for name in only or registry.run_stages(cfg):
        stage = registry.get(name)
        ok, reasons = staleness(stage, cfg)
        if ok and not force:
            EventLog(cfg.run_dir, cfg.run, name).emit("up_to_date")
            click.echo(f"{name}: up to date, skipped")
            continue
        click.echo(f"{name}: running ({clip(reasons, 200) or 'forced'})")
        extra = ["--force"] if force and stage.takes_force else []  # a stage without the flag reruns anyway
        for call in _train_calls(cfg, force) if name == "train" else [extra]:
            walks.clear()  # the next checks walk the dataset again, after this stage ran
            code = call_child(stage_command(name, [*spec.child_args(), *call], gpus))
            if code != 0:
                click.secho(f"{name} failed (exit {code}); later stages not run", fg="red", err=True)
                sys.exit(code)
        if name == "train" and not staleness(stage, cfg)[0]:
            click.echo("train was stopped before its last step; later stages not run (run again to continue)")
            return


def _rehash_once(cfg: Any) -> None:
    """`run --rehash`: read every image here, once, into the index; the stages then trust it."""
    from stages.core.image_index import rehash_requested

    if rehash_requested():
        from stages.core.caches import scan_items
        from stages.families import get_family

        scan_items(cfg, get_family(cfg.family))


def clip(reasons: list[str], n: int) -> str:
    """Reasons joined and cut to about `n` characters of prose each; a command in backticks is kept whole
    (it must paste and work)."""
    def one(reason: str) -> str:
        prose, tick, rest = reason.partition("`")
        return reason if len(reason) <= n else (prose[:n] + ("… `" + rest if tick else "…"))
    return "; ".join(one(r) for r in reasons)


def _train_calls(cfg: Any, force: bool) -> list[list[str]]:
    """The train children `run` starts, by their extra arguments: one, with `_train_start`'s flag. Where the
    config trains several experts (train.expert = "both") and one of the stale ones must start over while
    another is up to date or continues, one child per stale expert (`--once train.expert=<expert>`, the
    same adapter as in a both-run), so a restart never retrains an expert that is up to date."""
    from stages.core.stage import staleness

    train = registry.get("train")
    units = train.units(cfg)
    stale = [u for u in units if not staleness(train, u)[0]]
    starts = [_train_start(u, force) for u in stale]
    if len(units) == 1 or force or "--restart" not in starts or starts == ["--restart"] * len(units):
        return [[_train_start(cfg, force)]]  # every stale expert continues, or every expert starts over
    return [["--once", f"train.expert={u.train.expert}", start] for u, start in zip(stale, starts)]


def _train_start(cfg: Any, force: bool) -> str:
    """How `run` starts a stale train: a stopped or killed one continues from its newest checkpoint made
    with these settings (and ends bit-identical to an uninterrupted run); one trained with other
    settings starts over (`run` reruns what is stale; the old checkpoints are set aside, not deleted)."""
    if force or registry.get("train").other_settings(cfg):
        return "--restart"
    return "--resume"


@cli.command("status", epilog=examples("status my-lora", "status --config configs/flux-dev.toml --artifacts /data/runs"))
@run_options
@rehash_option
@_guarded
def status_cmd(spec: RunSpec) -> None:
    """Show each stage of a run as up to date or stale, and why (read-only: works on a read-only folder)."""
    from stages.core.dataset import one_walk

    from stages.core.caches import lora_dir

    cfg = _settled(spec, write=False)
    with one_walk():  # every stage's check reads one walk of the dataset
        _status_lines(cfg)
    _status_validation(cfg.run_dir)
    _status_set_aside([lora_dir(unit) for unit in registry.get("train").units(cfg)])


def _status_lines(cfg: Any) -> None:
    """One line per stage (up to date, stale or blocked, and why: registry.states; running now), and
    train's realised batch sizes."""
    from stages.core.artifacts import lock_holder_pid, read_manifest

    for name, rows in registry.states(cfg).items():
        pid = lock_holder_pid(cfg.run_dir, name)
        running = f"  [running now, pid {pid}; `lorapipe stop {cfg.run} --artifacts {cfg.artifacts}`]" if pid else ""
        whole = next((r for r in rows if r.blocked), None) or next((r for r in rows if not r.up_to_date), rows[0])
        reasons = list(rows[0].reasons) if len(rows) == 1 else []  # several: a line for each expert
        click.echo(f"{name:16s} {_mark(whole.state)}" + (f"  ({clip(reasons, 300)})" if reasons else "") + running)
        for row in rows if len(rows) > 1 else ():
            click.echo(f"{'':16s} {row.expert + ':':6s} {_mark(row.state)}"
                       + (f"  ({clip(list(row.reasons), 300)})" if row.reasons else ""))
    for unit in registry.get("train").units(cfg):
        sizes = (read_manifest(registry.get("train").artifact_dir(unit)) or {}).get("batch_sizes")
        if sizes:
            steps = ", ".join(f"{n} steps at batch {size}" for size, n in sorted(sizes.items(), key=lambda kv: -int(kv[0])))
            whose = f" of the {unit.train.expert} expert" if unit.train.expert else ""
            click.echo(f"{'':16s} realised batch sizes{whose} (train.batch_size = {cfg.train.batch_size}): {steps}")


def _mark(state: str) -> str:
    return click.style(state, fg={"up to date": "green", "stale": "yellow"}.get(state, "red"))


def _status_set_aside(folders: list[Path]) -> None:
    """The trainings a restart set aside (lora/.restarted-*, lora/<expert>/.restarted-*), kept until the user
    removes them."""
    import shlex

    from stages.core.artifacts import dir_bytes

    aside = sorted(p for folder in folders for p in folder.glob(".restarted-*"))
    if aside:
        size = sum(dir_bytes(p) for p in aside) / 2**20
        click.echo(f"{'':16s} {len(aside)} earlier training(s) set aside by restarts ({size:.1f} MiB), kept until you "
                   f"remove them: `{shlex.join(['rm', '-r', '--', *map(str, aside)])}`")


def _status_validation(run_dir: Path) -> None:
    from stages.core.events import read_events
    from stages.report import last_validation

    last = last_validation(read_events(run_dir))
    if last is not None:
        click.echo(f"{'':16s} validation loss {last['loss']:.4g} at step {last['step']} ({last['items']} held-out items)")


@cli.command("stop", epilog=examples("stop my-lora", "stop my-lora --no-save --artifacts /data/runs"))
@run_options
@click.option("--no-save", is_flag=True, help="train: cancel without writing a checkpoint or adapter.")
@_guarded
def stop_cmd(spec: RunSpec, no_save: bool) -> None:
    """Stop whatever stage of the run is running. train stops after its current step and saves a
    resumable checkpoint (unless --no-save); any other stage gets SIGTERM: a cache keeps the rows it
    wrote and its rerun continues from there."""
    from stages.core.artifacts import lock_holder_pid
    from stages.core.proc import signal_group

    run_dir = spec.run_dir()
    stopped = []
    for stage in registry.ALL:
        name = stage.name
        pid = lock_holder_pid(run_dir, name)
        if pid is None:
            continue
        if stage.request_stop is not None:  # train: stops between steps, and saves unless told not to
            stage.request_stop(run_dir, not no_save)
            stopped.append(f"asked {name} (pid {pid}) to stop after its step{' without saving' if no_save else ''}")
        else:
            signal_group(pid)
            stopped.append(f"sent SIGTERM to {name} (pid {pid}); its written rows are kept, a rerun continues")
    if not stopped:
        click.secho(f"no train stage is running for run '{run_dir.name}', nor any other stage (looked in '{run_dir}')",
                    fg="yellow", err=True)
        sys.exit(1)
    click.echo("\n".join(stopped))


@cli.command("inspect", epilog=examples("inspect my-lora --json", "inspect my-lora --decode cat.png --variant 1",
                                       "inspect my-video --decode walk.mp4 --out walk.webp",
                                       "inspect my-edit --decode cat.png --control 0"))
@run_options
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--rows", type=click.IntRange(min=1), default=64, show_default=True,
              help="Rows read per store for statistics and NaN/Inf counts (evenly spaced).")
@click.option("--decode", "item", metavar="ITEM", help="Decode a cached variant of ITEM (dataset key or image id).")
@click.option("--variant", type=int, default=0, show_default=True, help="Which cached crop/flip variant to decode.")
@click.option("--control", type=click.IntRange(min=0), default=None, metavar="K",
              help="Decode the item's K-th control image (edit families, references) as cached for that variant.")
@click.option("--sample", "draw", is_flag=True, help="Decode a posterior sample instead of the mean.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the --sample draw.")
@click.option("--out", type=click.Path(dir_okay=False),
              help="PNG to write (default artifacts/<run>/inspect/...); a clip's frames side by side, or animated "
                   "with .webp / .gif, or .mp4.")
@_guarded
def inspect_cmd(spec: RunSpec, as_json: bool, rows: int, item: str | None, variant: int, control: int | None,
                draw: bool, seed: int, out: str | None) -> None:
    """Report every artifact of the run offline; or --decode one cached latent with the VAE alone.
    Uses the run's config.json unless --config names a preset."""
    from stages import inspect as inspect_stage

    run_dir = spec.run_dir()
    cfg = _settled(spec, write=False) if spec.config else None
    if item is None:
        report = inspect_stage.inspect_run(run_dir, cfg, rows)
        if as_json:
            click.echo(inspect_stage.to_json(report))
        else:
            from stages.core.events import table_console

            inspect_stage.render(report, table_console())
        return
    cfg = inspect_stage.run_config(run_dir, cfg)
    if cfg is None:
        raise FileNotFoundError(f"run '{run_dir.name}' has no config.json beside its artifacts; pass --config")
    from stages.core.fsaccess import short_name

    which = "" if control is None else f"-control{control}"
    name = short_name(f"{Path(item).stem or item}{which}-v{variant}", f"-{'sample' if draw else 'mean'}.png")
    target = Path(out) if out else run_dir / "inspect" / name
    path, info = inspect_stage.decode(cfg, item, variant, target, sample=draw, seed=seed, control=control)
    what = item if control is None else f"{item}'s control {control}"
    click.echo(inspect_stage.to_json(info) if as_json else f"decoded {what} variant {variant} -> {path}: {describe_decoded(info)}")


def describe_decoded(info: dict[str, Any]) -> str:
    """Every image size as W×H, whatever order the stored arrays use (original_size is H, W)."""
    (top, left), (height, width) = info["crop_top_left"], info["original_size"]
    return (f"{info['size'][0]}×{info['size'][1]} px (W×H), bucket {info['bucket'].replace('x', '×')}, "
            f"original {width}×{height}, crop at x={left} y={top}{', flipped' if info['flip'] else ''}, "
            f"latent {'×'.join(map(str, info['latent_shape']))}, {'posterior sample' if info['sampled'] else 'posterior mean'}"
            + (f", {info['frames']} frames from frame {info.get('start_frame') or 0} of the clip, at {info['fps']:g} fps"
               if info.get("frames", 1) > 1 else ""))


@cli.command("report", epilog=examples("report my-lora", "report my-lora --out loss.png --json"))
@run_options
@click.option("--out", type=click.Path(dir_okay=False), help="PNG to write (default artifacts/<run>/report.png).")
@click.option("--smooth", type=float, default=0.9, show_default=True, help="EMA weight of the smoothed loss, in [0, 1).")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@_guarded
def report_cmd(spec: RunSpec, out: str | None, smooth: float, as_json: bool) -> None:
    """Plot loss (raw + smoothed), LR and samples/s over steps from events.jsonl; print a summary.
    On a read-only run folder the plot goes to the temp folder (or --out)."""
    import json

    from stages import report
    from stages.core.fsaccess import writable_or_temp

    from stages.core.events import read_events

    run_dir = spec.run_dir()
    target = Path(out) if out else writable_or_temp(run_dir, "report.png")
    experts = report.experts_in(read_events(run_dir))
    done = {}
    for expert in experts:  # a two-expert run: one plot per expert, report-<expert>.png
        png = target.with_name(f"{target.stem}-{expert}{target.suffix}") if len(experts) > 1 else target
        done[expert] = report.run(run_dir, png, smooth, expert)
    if as_json:
        found = {e: {"png": str(png), **summary} for e, (png, summary) in done.items()}
        click.echo(json.dumps(next(iter(found.values())) if len(found) == 1 else {"experts": found}, indent=2))
        return
    for expert, (png, summary) in done.items():
        head = [f"{expert} expert:"] if expert else []
        click.echo("\n".join(head + report.format_summary(summary)) + f"\nplot: {png}")


@cli.command("plan", epilog=examples("plan --config configs/flux-dev.toml --vram 8", "plan my-lora --vram 12 --json"))
@run_options
@click.option("--vram", metavar="GB|auto", help="Plan for this much GPU memory [default: gpu.vram_budget_gb].")
@click.option("--json", "as_json", is_flag=True, help="Print the plans as JSON.")
@_guarded
def plan_cmd(spec: RunSpec, vram: str | None, as_json: bool) -> None:
    """Show each GPU stage's memory plan (precision, batch, tiling, offload, block swap) without loading weights.
    Exits 2 when a stage that `lorapipe run` runs cannot fit the budget (the JSON's `fits`; each stage's `fits`
    and `in_run` say which), 0 when they all fit. sample runs in `run` only with sample.after_train = true."""
    from stages import plan

    result = plan.run(_settled(spec, write=False), vram, as_json, record=True)
    unfit = [s["stage"] for s in result["stages"] if not s["fits"] and s["in_run"]]
    apart = [s["stage"] for s in result["stages"] if not s["fits"] and not s["in_run"]]
    if apart:
        click.echo(f"plan: {', '.join(apart)} cannot fit {result['budget_gb']:.2f} GB; a plain `lorapipe run` leaves it "
                   f"out (sample.after_train = false), and `lorapipe sample` would need the --vram its note names", err=True)
    if unfit:
        click.echo(f"plan: {', '.join(unfit)} cannot fit {result['budget_gb']:.2f} GB (notes above)", err=True)
        raise SystemExit(2)


@cli.command("config", epilog=examples("config my-lora", "config my-lora --set train.steps=2000 --dry-run",
                                       "config my-lora --config configs/my-lora.toml"))
@run_options
@click.option("--dry-run", is_flag=True, help="Show what would change; save nothing.")
@_guarded
def config_cmd(spec: RunSpec, dry_run: bool) -> None:
    """Show or change a run's settings (its config.json): --set/--model change keys, --config takes a
    preset. Shows the change as a diff, and the stages it makes stale."""
    from stages import run_settings

    click.echo("\n".join(run_settings.configure(spec, dry_run)))


@cli.command("keys", epilog=examples("keys", "keys | grep train."))
def keys_cmd() -> None:
    """List every config key with its default, its meaning and its valid choices or range."""
    from stages.core.config import describe_keys

    for key, default, choices, meaning in describe_keys({"family": sorted(FAMILIES)}):
        click.echo(f"{key:34s} {default:18s} {meaning}" + (f" [{choices}]" if choices else ""))


@cli.group("lora", epilog=examples("lora merge a.safetensors b.safetensors --weights 0.7,0.3 --rank 32 -o ab.safetensors",
                                   "lora resize my-lora_comfyui.safetensors --energy 0.99 -o small_comfyui.safetensors",
                                   "lora posthoc-ema my-lora --sigma-rel 0.05"))
def lora_group() -> None:
    """Tools for finished LoRA files, on the CPU without base weights: merge, resize, extract, posthoc-ema.
    Each writes the input's format (diffusers, comfyui or kohya) unless --format says otherwise, checks the
    file as `export-lora --verify` does and reports the relative error of the low-rank result."""


def _weights(ctx: click.Context, param: click.Parameter, value: str | None) -> list[float] | None:
    if value is None:
        return None
    try:
        return [float(v) for v in value.split(",")]
    except ValueError:
        raise click.BadParameter(f"'{value}' is not a comma-separated list of numbers, e.g. 0.7,0.3") from None


def lora_file_options(f: Callable[..., None]) -> Callable[..., None]:
    """-o, --rank, --energy, --format, --family, --model, --verbose: the options merge and resize share."""
    for option in reversed((
            click.option("-o", "--out", required=True, type=click.Path(dir_okay=False),
                         help="The .safetensors file to write (replaced only once written and checked)."),
            click.option("--rank", type=click.IntRange(min=1), help="Rank of every module [default: lossless]."),
            click.option("--energy", type=click.FloatRange(0, 1, min_open=True),
                         help="Per module, the smallest rank keeping this fraction of the squared singular values."),
            click.option("--format", "fmt", type=click.Choice(["diffusers", "comfyui", "kohya"]),
                         help="Output format [default: the input's]; from a diffusers input any, else the input's."),
            click.option("--family", type=click.Choice(sorted(FAMILIES)),
                         help="The model family, for files whose header does not name it."),
            click.option("--model", help="The base model (folder, hub id or file): check the output against its "
                                         "layers [default: the family's released config]."), verbose_option), ):
        f = option(f)
    return f


def _print_lora(report: dict[str, Any]) -> None:
    from stages.tools.lora_tools import describe

    click.echo(describe(report))


@lora_group.command("merge", epilog=examples(
    "lora merge a.safetensors b.safetensors --weights 0.7,0.3 --rank 32 -o ab.safetensors",
    "lora merge a_comfyui.safetensors b_comfyui.safetensors -o ab_comfyui.safetensors   # lossless sum"))
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("--weights", callback=_weights, metavar="W1,W2,...", help="One weight per file [default: 1 each].")
@lora_file_options
@_guarded
@_quiet
def lora_merge_cmd(files: tuple[str, ...], weights: list[float] | None, out: str, rank: int | None,
                   energy: float | None, fmt: str | None, family: str | None, model: str | None) -> None:
    """Sum the weighted deltas of LoRA files per module and factor the sum to --rank (SVD)."""
    from stages.tools.lora_tools import merge

    _print_lora(merge(list(files), weights, rank, energy, out, fmt, family, model))


@lora_group.command("resize", epilog=examples("lora resize my-lora.safetensors --rank 8 -o my-lora-r8.safetensors",
                                              "lora resize my-lora_comfyui.safetensors --energy 0.99 -o small_comfyui.safetensors"))
@click.argument("file", type=click.Path(dir_okay=False))
@lora_file_options
@_guarded
@_quiet
def lora_resize_cmd(file: str, out: str, rank: int | None, energy: float | None, fmt: str | None,
                    family: str | None, model: str | None) -> None:
    """Factor a LoRA file again at a lower rank (--rank R, or --energy E per module)."""
    from stages.tools.lora_tools import resize

    _print_lora(resize(file, rank, energy, out, fmt, family, model))


@lora_group.command("extract", epilog=examples(
    "lora extract --base black-forest-labs/FLUX.1-dev --tuned ./my-flux-finetune --family flux --rank 32 -o diff.safetensors",
    "lora extract --base base/transformer/diffusion_pytorch_model.safetensors --tuned tuned.safetensors --family "
    "z-image --rank 16 -o diff.safetensors"))
@click.option("--base", required=True, help="The base model: a diffusers pipeline folder or a denoiser .safetensors file.")
@click.option("--tuned", required=True, help="The fine-tuned model, in the same form.")
@click.option("--family", required=True, type=click.Choice(sorted(FAMILIES)), help="The models' family.")
@click.option("--min-change", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="Skip layers whose relative change ||W_tuned - W_base|| / ||W_base|| is at most this.")
@click.option("-o", "--out", required=True, type=click.Path(dir_okay=False), help="The .safetensors file to write.")
@click.option("--rank", type=click.IntRange(min=1), help="Rank of every module.")
@click.option("--energy", type=click.FloatRange(0, 1, min_open=True),
              help="Per module, the smallest rank keeping this fraction of the squared singular values (full SVD).")
@click.option("--format", "fmt", type=click.Choice(["diffusers", "comfyui", "kohya"]), default="diffusers",
              show_default=True, help="Output format.")
@verbose_option
@_guarded
@_quiet
def lora_extract_cmd(base: str, tuned: str, family: str, min_change: float, out: str, rank: int | None,
                     energy: float | None, fmt: str) -> None:
    """A LoRA of the difference between two models' denoiser linear weights (SVD per changed layer),
    reading the weights one layer at a time."""
    from stages.tools.lora_tools import describe, extract

    report = extract(base, tuned, family, rank, energy, out, fmt, min_change)
    click.echo(describe(report) + f"\n{report['unchanged']} linear layers unchanged (left out)")


@lora_group.command("posthoc-ema", epilog=examples("lora posthoc-ema my-lora --sigma-rel 0.05",
                                                   "lora posthoc-ema my-lora --sigma-rel 0.15 -o ema-long"))
@run_options
@click.option("--sigma-rel", type=float, required=True,
              help="EMA width relative to the training length (Karras et al.): 0.05 short, 0.15-0.2 long.")
@click.option("-o", "--out", type=click.Path(file_okay=False),
              help="Folder to write [default: artifacts/<run>/posthoc-ema/sigma-<sigma-rel>/].")
@_guarded
@_quiet
def lora_posthoc_ema_cmd(spec: RunSpec, sigma_rel: float, out: str | None) -> None:
    """A power-function EMA of the run's saved checkpoints (lora/checkpoint-*), written as an export
    (diffusers and ComfyUI files, checked as `export-lora --verify` does). See docs/exporting.md."""
    from stages.tools import posthoc_ema

    done = posthoc_ema.run(_settled(spec, write=False), sigma_rel, Path(out) if out else None)
    for result in done.get("experts", [done]):
        pairs = ", ".join(f"{s}: {w:.3f}" for s, w in zip(result["steps"], result["weights"]))
        click.echo(f"post-hoc EMA (sigma_rel {sigma_rel:g}, gamma {result['gamma']:.2f}) of steps {pairs}\n"
                   + "\n".join([f"wrote {f}" for f in result["files"]] + result["notes"]))


@cli.command("demo", epilog=examples("demo", "demo --family sdxl --steps 20"))
@click.option("--family", type=click.Choice(sorted(FAMILIES)), default="flux", show_default=True,
              help="Which tiny family to demo.")
@click.option("--steps", type=int, help="Override train.steps.")
@_guarded
def demo_cmd(family: str, steps: int | None) -> None:
    """Build a tiny random-weight model and dataset, run every stage on CPU, render before/after."""
    from stages.demo import run_demo

    run_demo(family, steps)


if __name__ == "__main__":
    cli(prog_name="lorapipe")  # usage and error lines name the installed command, as every printed command does
