"""Runs benchmark suites (bench/suites.py) and writes one result file per row.

    python bench/run.py --list [SUITE ...]                  # the rows and the command each runs (CPU)
    python bench/run.py flux --budget-s 540                 # on the GPU machine (bash bench/device.sh flux)
    python bench/run.py memory --only 'memory.flux-*' --missing
    python bench/run.py --take <files_at>                   # here: the call's results into bench/results

Rows run in their suite's order, those of one call together (a family's bench items share one build;
a family's memory budgets at one px one call, so equal plans are measured once). Results go to
<results>/<suite>/<row key>.json (default bench/results, or $OUT/results on the GPU machine), and a
newer run of a row overwrites its file; a row the budget left unstarted writes nothing, and a failure
never overwrites a measurement (it goes to <key>.failed.json beside it). `--missing` runs only the rows
that bench/results/<suite>/ holds no measurement of, which is how a suite longer than one device call
goes on in the next.

On a machine of several GPUs (`--gpus`, default every GPU it has), the bench and memory calls of different
families run side by side, one family to a GPU (CUDA_VISIBLE_DEVICES) with a work folder of its own, each GPU
taking the next family when its last is done; each call measures one process on its own GPU, and the calls
share the host's cores and memory. A peers or script call runs the whole selection one call at a time (a peer
is timed beside the product, and a script may take every GPU).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from itertools import groupby
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.suites import SUITES, Bench, Memory, Peers, Row, Script, bench_key, memory_key  # noqa: E402

RECORD = ROOT / "bench" / "results"
SHM_MODELS = Path("/dev/shm/lorapipe-bench")  # bench.py's models; the families of the running calls kept there
WORK = {Bench: "/tmp/lorapipe-bench", Memory: "/tmp/lorapipe-memory"}  # bench.py's and memory.py's --work defaults


def call_of(row: Row) -> tuple:
    """Rows with the same value run in one call."""
    if isinstance(row, Bench):
        return ("bench", row.family)
    if isinstance(row, Memory):
        return ("memory", row.family, row.px, row.sets, row.captions)
    return (type(row).__name__, row.key)


def command(rows: list[Row], out: Path, budget_s: float, gpu: int | None = None) -> tuple[list[str], dict[str, str]]:
    """The command line (and environment) of one call over `rows`, writing its result JSON to `out`; with `gpu`,
    on that GPU alone and, for a bench or memory call, in a work folder of that GPU's."""
    first, py = rows[0], sys.executable
    env = {} if gpu is None else {"CUDA_VISIBLE_DEVICES": str(gpu)}
    work = [] if gpu is None or type(first) not in WORK else ["--work", f"{WORK[type(first)]}-gpu{gpu}"]
    if isinstance(first, Bench):
        only = [a for r in rows for a in ("--only", f"{r.family}/{r.item}")]
        return [py, "bench/bench.py", "run", "--families", first.family, "--keep", "--budget-s", f"{budget_s:.0f}",
                "--out", str(out), *work, *only], env
    if isinstance(first, Memory):
        sets = [a for s in first.sets for a in ("--set", s)] + (["--captions", first.captions] if first.captions != "equal" else [])
        return [py, "bench/memory.py", "run", "--families", first.family, "--res", str(first.px), "--budgets",
                ",".join(r.budget for r in rows), "--keep", "--budget-s", f"{budget_s:.0f}", "--out", str(out), *work,
                *sets], env
    if isinstance(first, Peers):  # peers.sh writes $OUT/peers-<which>-<px>-b<batch>-<tag>.json
        env = {"OUT": str(out.parent), "PEERS_PRODUCT": first.product, "PEERS_TAG": "row",
               "PEERS_BUDGET_S": f"{budget_s:.0f}"}
        return ["bash", "bench/peers.sh", first.which, str(first.px), str(first.batch), str(first.steps)], env
    assert isinstance(first, Script)
    return [py, *(str(out) if a == "{out}" else a for a in first.args)], {}


def peers_file(row: Peers, folder: Path) -> Path:
    return folder / f"peers-{row.which}-{row.px}-b{row.batch}-row.json"


def split(rows: list[Row], data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A call's result JSON as {row key: that row's result}: a bench or memory call's items go to the
    file of their row (a cache item rebuilt for a row of this call keys as that cache's row), each with
    the call's meta and builds; a peers or script call's JSON is its one row's."""
    first = rows[0]
    if not isinstance(first, (Bench, Memory)):
        return {first.key: data}

    def key(item: dict[str, Any]) -> str:
        if isinstance(first, Bench):
            return bench_key(item["id"])
        return memory_key(item["family"], item.get("resolution", first.px), item["budget"], first.sets, first.captions)

    out: dict[str, dict[str, Any]] = {}
    for item in data.get("items", []):
        out.setdefault(key(item), {**{k: v for k, v in data.items() if k != "items"}, "items": []})["items"].append(item)
    return out


def measured(result: dict[str, Any]) -> bool:
    """A result holds a measurement: an ok item, an ok/same-plan memory row, or a file of another layout."""
    if result.get("status") == "failed":
        return False
    items = result.get("items")
    if items is None:
        rows = result.get("rows")
        return bool(rows) and any(r.get("status") == "ok" for r in rows) if rows is not None else True
    return any(str(r.get("status", "")).startswith(("ok", "same plan")) for r in items)


def complete(result: dict[str, Any]) -> bool:
    """A measurement with no part the budget left unstarted (a memory row's stage "skipped"): `--missing`
    runs a row again until it is complete."""
    return measured(result) and not any(r.get("status") == "skipped" for r in result.get("items") or [])


def _part(item: dict[str, Any]) -> str:
    """What an item of a row measures: a memory row's stage, a bench item's id."""
    return str(item.get("stage") or item.get("id"))


def write(folder: Path, key: str, result: dict[str, Any]) -> Path | None:
    """Writes a row's result: a measurement replaces the row's file, keeping the older file's measurement of
    each part the new one's budget left unstarted (and saying when that was measured); a failure goes beside a
    measurement (<key>.failed.json), never over it; an item the budget left unstarted writes nothing."""
    items = result.get("items") or []
    if items and all(r.get("status") == "skipped" for r in items):
        return None
    path = folder / f"{key}.json"
    older = json.loads(path.read_text()) if path.exists() else None
    if not measured(result) and older is not None and measured(older):
        path = folder / f"{key}.failed.json"
    elif older is not None and any(r.get("status") == "skipped" for r in items):
        kept = {_part(r): r for r in older.get("items") or [] if r.get("status") != "skipped"}
        when = (older.get("meta") or {}).get("date_utc")
        result = {**result, "items": [{**kept[_part(r)], "measured_utc": when} if r.get("status") == "skipped"
                                      and _part(r) in kept else r for r in items]}
    folder.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1, default=str))
    tmp.replace(path)
    if path.name == f"{key}.json":
        path.with_name(f"{key}.failed.json").unlink(missing_ok=True)
    return path


def done(suite: str, key: str, results: Path) -> bool:
    """The row's latest result is a complete measurement, in the committed record or this machine's results."""
    for folder in (RECORD / suite, results / suite):
        path = folder / f"{key}.json"
        if path.exists() and complete(json.loads(path.read_text())):
            return True
    return False


def keep_only(families: set[str]) -> None:
    """/dev/shm keeps the families the running calls work on, no other (FLUX.2 dev's 64 GB transformer needs
    the room)."""
    for d in SHM_MODELS.glob("*"):
        if d.name not in families:
            shutil.rmtree(d, ignore_errors=True)


IN_USE: set[str] = set()  # the families of the calls running now (side by side on a machine of several GPUs)
IN_USE_LOCK = threading.Lock()


def gpu_count() -> int:
    try:
        return len(subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.splitlines())
    except OSError:
        return 0


def run_call(suite: str, rows: list[Row], results: Path, logs: Path, left: float, failed_logs: Path | None,
             gpu: int | None = None) -> None:
    """Runs one call of `rows` (on GPU `gpu` alone, where given) and writes their results; its log stays in
    `logs`, and is copied to `failed_logs` (the files that come back from the GPU machine, which are few) where a
    row failed or wrote nothing."""
    need = rows[0].gpus if isinstance(rows[0], Script) else 1
    if need > 1 and gpu_count() < need:
        print(f"[run] {suite}/{rows[0].key}: needs {need} GPUs (the nvidia-h200-x{need} machine); not run", flush=True)
        return
    stage = logs / "staging"
    stage.mkdir(parents=True, exist_ok=True)
    out = stage / f"{rows[0].key}.json"
    out.unlink(missing_ok=True)
    if isinstance(rows[0], Peers):  # rows of one shape share peers.sh's file name: never read an earlier row's
        peers_file(rows[0], stage).unlink(missing_ok=True)
    cmd, env = command(rows, out, left - 10, gpu)
    if isinstance(rows[0], (Bench, Memory)):
        with IN_USE_LOCK:
            keep_only(IN_USE | {rows[0].family})
    log = logs / f"{suite}.{rows[0].key}.log"
    on = "" if gpu is None else f" (GPU {gpu})"
    print(f"[run] {suite}{on}: {' '.join(cmd[1:] if cmd[0] == sys.executable else cmd)}", flush=True)
    t = time.time()
    with log.open("w") as fh:
        # its own process group: a call cut off at the budget takes its stage children with it, so no
        # orphaned stage keeps the GPU or the run's lock from the next call
        proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **env}, stdout=fh, stderr=subprocess.STDOUT,
                                process_group=0)
        try:
            rc = proc.wait(timeout=max(30.0, left))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = -9
    if isinstance(rows[0], Peers):
        out = peers_file(rows[0], stage)
    if not out.exists():
        tail = log.read_text()[-1500:]
        wrote = isinstance(rows[0], Script) and "{out}" in rows[0].args  # a script that should have written it
        data = {"command": " ".join(cmd[1:]), "rc": rc, "status": "ok" if rc == 0 and not wrote else "failed",
                "log_tail": tail} if isinstance(rows[0], Script) else None
        if data is None:
            print(f"[run] {suite}: no result (rc {rc}); log {log}\n{tail}", flush=True)
            keep_log(log, failed_logs)
            return
    else:
        data = json.loads(out.read_text())
    for key, result in split(rows, data).items():
        if gpu is not None and isinstance(result.get("meta"), dict):  # beside other families' calls, on this GPU
            result["meta"]["side_by_side_on_gpu"] = gpu
        path = write(results / suite, key, result)
        print(f"[run] {suite}/{key}: {'written ' + path.name if path else 'not started (budget)'}", flush=True)
        if path is not None and not measured(result):
            keep_log(log, failed_logs)
    print(f"[run] {suite}: rc {rc} after {time.time() - t:.0f} s", flush=True)


def keep_log(log: Path, folder: Path | None) -> None:
    if folder is not None and log.exists():
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copy(log, folder / log.name)


def selected(suite: str, rows: list[Row], only: list[str], missing: bool, results: Path) -> list[Row]:
    rows = [r for r in rows if not only or any(fnmatch.fnmatch(r.key, p) for p in only)]
    return [r for r in rows if not (missing and done(suite, r.key, results))]


def listing(names: list[str], only: list[str] = [], missing: bool = False, results: Path = RECORD) -> str:
    """The rows and commands that a run of `names` with the same --only and --missing would start."""
    lines = []
    for name in names:
        rows = selected(name, SUITES[name], only, missing, results)
        if not rows:
            continue
        lines.append(f"{name}:")
        for _, group in groupby(rows, key=call_of):
            group = list(group)
            cmd, env = command(group, Path("$OUT/row.json"), 540)
            shown = " ".join(f"{k}={v}" for k, v in env.items() if k != "OUT")
            lines.append(f"  {' '.join(r.key for r in group)}\n    {shown + ' ' if shown else ''}"
                         f"{' '.join(['python3', *cmd[1:]] if cmd[0] == sys.executable else cmd)}")
    return "\n".join(lines)


PACKED = "results.tgz"


def pack(folder: Path) -> Path:
    """`folder`'s results/ and logs/ as folder/results.tgz (then removed): a device call brings back at most 8
    files, and a family's call writes more."""
    import tarfile

    out = folder / PACKED
    with tarfile.open(out, "w:gz") as tar:
        for name in ("results", "logs"):
            if (folder / name).is_dir():
                tar.add(folder / name, arcname=name)
    for name in ("results", "logs"):
        shutil.rmtree(folder / name, ignore_errors=True)
    return out


def take(source: Path, results: Path) -> list[Path]:
    """Copy the result files a device call brought back (`source`: its folder, holding results/<suite>/*.json or
    a results.tgz, or the .tgz itself) into `results`/<suite>/, replacing a row's older file. -> the paths written.
    The archive is read member by member: only regular files under results/<suite>/ named *.json are taken."""
    import tarfile

    written: list[Path] = []

    def put(suite: str, name: str, data: bytes) -> None:
        if not (suite and name.endswith(".json") and not suite.startswith(".")):  # one folder down, by the callers
            return
        json.loads(data)  # a damaged file is refused here, not copied
        dest = results / suite / name
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_suffix(".json.tmp")
        tmp.write_bytes(data)
        tmp.replace(dest)
        written.append(dest)

    archive = source if source.is_file() else source / PACKED
    if archive.is_file():
        with tarfile.open(archive, "r:gz") as tar:
            for member in tar.getmembers():
                parts = member.name.split("/")
                if member.isfile() and len(parts) == 3 and parts[0] == "results":
                    put(parts[1], parts[2], tar.extractfile(member).read())
    for f in sorted((source / "results").glob("*/*.json")) if source.is_dir() else []:
        put(f.parent.name, f.name, f.read_bytes())
    if not written:
        raise SystemExit(f"{source}: no results/<suite>/<row>.json in it, nor in a {PACKED}")
    return written


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("suites", nargs="*", help=f"of: {', '.join(SUITES)}")
    ap.add_argument("--list", action="store_true", help="print the rows and commands the call would run (after --only and --missing); run nothing")
    ap.add_argument("--only", action="append", default=[], help="row keys matching this glob only (repeatable)")
    ap.add_argument("--missing", action="store_true", help="only rows with no measurement in bench/results")
    ap.add_argument("--budget-s", type=float, default=540.0, help="start no call after this many seconds")
    ap.add_argument("--results", default="", help="default $OUT/results where $OUT is set, else bench/results")
    ap.add_argument("--take", default="", metavar="PATH",
                    help="copy the results a device call brought back (its files_at folder, or the results.tgz in it) "
                         "into --results (default bench/results), a newer file of a row replacing the older; run nothing")
    ap.add_argument("--pack", default="", metavar="DIR",
                    help="pack DIR's results/ and logs/ into DIR/results.tgz, one file (a device call returns at most "
                         "8); run nothing")
    ap.add_argument("--gpus", type=int, default=None,
                    help="GPUs to run the families' bench and memory calls side by side on, one family to a GPU "
                         "(default: every GPU the machine has; 1: one call at a time)")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if args.pack:
        print(f"[run] packed {pack(Path(args.pack))}")
        return
    if args.take:
        for path in take(Path(args.take), Path(args.results) if args.results else RECORD):
            print(f"[run] took {path}")
        return
    unknown = [s for s in args.suites if s not in SUITES]
    if unknown:
        raise SystemExit(f"unknown suite(s) {unknown}; known: {', '.join(SUITES)}")
    out = os.environ.get("OUT")
    results = Path(args.results) if args.results else Path(out) / "results" if out else RECORD
    if args.list or not args.suites:
        print(listing(args.suites or list(SUITES), args.only, args.missing, results) or "no row matches")
        return
    logs = Path("/tmp/lorapipe-run/logs")
    logs.mkdir(parents=True, exist_ok=True)
    failed_logs = Path(out) / "logs" if out else None
    deadline = time.time() + args.budget_s
    calls = [(suite, list(group)) for suite in args.suites
             for _, group in groupby(selected(suite, SUITES[suite], args.only, args.missing, results), key=call_of)]
    gpus = gpu_count() if args.gpus is None else args.gpus
    queues = lanes(calls, gpus)
    if len(queues) > 1:
        print(f"[run] families side by side, one to a GPU of {gpus}: {', '.join(q[0][1][0].family for q in queues)}",
              flush=True)
    side_by_side(queues, gpus, lambda queue, gpu: run_calls(queue, results, logs, deadline, failed_logs, gpu))


def side_by_side(queues: list[list[tuple[str, list[Row]]]], gpus: int, run: Any) -> None:
    """`run(queue, gpu)` for every queue: one queue alone on the whole machine (gpu None); several on GPUs
    0..gpus-1, each GPU taking the next queue when its last is done. /dev/shm keeps the families running."""
    if len(queues) == 1:
        run(queues[0], None)
        return
    pending, taking = list(queues), threading.Lock()

    def take() -> list[tuple[str, list[Row]]] | None:  # the next queue, its family marked running at once
        with taking:
            if not pending:
                return None
            queue = pending.pop(0)
        with IN_USE_LOCK:
            IN_USE.add(queue[0][1][0].family)
        return queue

    def worker(gpu: int, queue: list[tuple[str, list[Row]]] | None) -> None:
        while queue is not None:
            try:
                run(queue, gpu)
            finally:
                with IN_USE_LOCK:
                    IN_USE.discard(queue[0][1][0].family)
            queue = take()

    # every GPU's first queue is taken before any runs: no call's keep_only removes a family about to start
    threads = [threading.Thread(target=worker, args=(g, take())) for g in range(min(gpus, len(queues)))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()


def lanes(calls: list[tuple[str, list[Row]]], gpus: int) -> list[list[tuple[str, list[Row]]]]:
    """The calls as queues that may run side by side, each on a GPU of its own: one queue per family (its calls
    in order: they share its built pipeline) where the machine has several GPUs and every call is a bench or
    memory call of one family; else one queue of every call, in order."""
    if gpus < 2 or not calls or not all(isinstance(rows[0], (Bench, Memory)) for _, rows in calls):
        return [calls]
    by_family: dict[str, list[tuple[str, list[Row]]]] = {}
    for suite, rows in calls:
        by_family.setdefault(rows[0].family, []).append((suite, rows))
    return list(by_family.values()) if len(by_family) > 1 else [calls]


def run_calls(calls: list[tuple[str, list[Row]]], results: Path, logs: Path, deadline: float,
              failed_logs: Path | None, gpu: int | None) -> None:
    for suite, group in calls:
        left = deadline - time.time()
        if left < 60:
            print(f"[run] {suite}: budget spent; not started: {', '.join(r.key for r in group)}", flush=True)
            continue
        run_call(suite, group, results, logs, left, failed_logs, gpu)


if __name__ == "__main__":
    main()
