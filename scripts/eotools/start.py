# SPDX-License-Identifier: Apache-2.0
"""The image's start program (scripts/start; scripts/entrypoint.sh execs it).

One pass from the container's arguments to `vllm serve`:

1. read the `vllm serve` arguments once (eotools/serve_args.py) and every setting of
   eotools/settings.py, refusing what vLLM would misread;
2. check the settings against the model (layer lists, pipeline split) and the API key;
3. decide the placement: the cold file VLLM_EXPERT_COLD_FILE names, a budget-only start
   (EO_HOST_BUDGET_GIB: budget-start writes the cold file, in this process), or none;
4. run the preflight in this process with what was read;
5. exec `vllm serve` with the arguments unchanged.

Every refusal is a message naming the setting or argument, the problem and the fix, with an
exit code of its own (HELP lists them). SIGTERM or SIGINT before the exec stops the start with
one line (exit 143 or 130), also while budget-start or the preflight runs.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import signal
import stat
import struct
import subprocess
import sys
import threading
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any, NoReturn

from . import cuda_probe, serve_args, settings, state_dir
from .cold_contract import ContractError, read_text

PROG = "start"

EXIT_BUDGET = 1  # budget-start cannot place the budget for this model
EXIT_USAGE = 2  # a serve argument or the model's config.json cannot be read
EXIT_COLD_FILE = 6  # the cold file asked for is not there (the preflight's cold-file code)
EXIT_SETTING = 8
EXIT_API_KEY = 9
EXIT_STATE = 10  # the state folder is held by another server, or cannot be used
EXIT_NO_VLLM = 127
STOP_GRACE_S = 2.0  # after a signal, the longest the start may take to stop on its own
MAX_CONFIG_BYTES = 16 << 20
MAX_KEY_BYTES = 4096

HELP = f"""\
usage: entrypoint.sh [VLLM_SERVE_ARGS...]     (scripts/start in a checkout)

The image's start program: reads the `vllm serve` arguments and the settings below, makes a
budget-only start's cold file, runs the preflight (scripts/preflight --help), then runs
`vllm serve VLLM_SERVE_ARGS...`. Each problem is one message naming the setting, the problem
and the fix. An empty setting counts as unset. `--help` prints this, then `vllm serve --help`.

settings (docs/configuration.md has the same table):
{settings.text_table()}

The API needs a key: VLLM_API_KEY, or the file VLLM_API_KEY_FILE names (a Docker secret),
or --api-key among the serve arguments; EO_ALLOW_NO_API_KEY=1 serves without one.

exit codes (before vLLM starts; after it, vLLM's own):
  {EXIT_BUDGET}    budget-start cannot place EO_HOST_BUDGET_GIB for this model
  {EXIT_USAGE}    a serve argument or the model's config.json cannot be read
  3-7  the preflight's checks (gpus 3, host-memory 4, host-mapping 5, cold-file 6, vllm 7);
       6 also: the cold file VLLM_EXPERT_COLD_FILE names is not there
  {EXIT_SETTING}    a setting is refused
  {EXIT_API_KEY}    no API key, or its file cannot be read
  {EXIT_STATE}   EO_STATE_DIR is held by another server, or cannot be used
  {EXIT_NO_VLLM}  no `vllm` command on PATH
  130  stopped by SIGINT, 143 stopped by SIGTERM
"""


class StartError(Exception):
    """A reason not to start vLLM: the problem, the fix, the exit code."""

    def __init__(self, code: int, problem: str, fix: str = "", notes: Sequence[str] = ()):
        super().__init__(problem)
        self.code, self.problem, self.fix, self.notes = code, problem, fix, list(notes)


class Stopped(BaseException):
    """SIGTERM or SIGINT before the exec. A BaseException, so that no `except Exception`
    on the way swallows it, and `finally` blocks and subprocess.run's clean-up still run."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def say(line: str) -> None:
    print(f"{PROG}: {line}", file=sys.stderr, flush=True)


# --- signals ------------------------------------------------------------------------------

_stop_line = threading.Lock()


def _stopped_line(signum: int) -> int:
    """Print the one line a stop gets (once, whoever gets here first) and its exit code."""
    if _stop_line.acquire(blocking=False):
        name = signal.Signals(signum).name
        say(f"stopped by {name} before vLLM started; nothing was started")
    return 128 + signum


def _raise_stopped(signum: int, frame: Any) -> NoReturn:
    raise Stopped(signum)


def install_stop_handlers() -> None:
    """SIGTERM and SIGINT raise Stopped in the main thread. Python runs that handler only
    between bytecodes; a watchdog thread, woken by the signal itself through the wakeup fd,
    ends the process after STOP_GRACE_S should the main thread be stuck in native code."""
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _raise_stopped)

    def watchdog() -> None:
        while True:
            data = os.read(read_fd, 1)
            if not data:
                return
            signum = data[0]
            if signum not in (signal.SIGTERM, signal.SIGINT):
                continue
            threading.Event().wait(STOP_GRACE_S)
            os._exit(_stopped_line(signum))

    threading.Thread(target=watchdog, name="stop-watchdog", daemon=True).start()


# --- what vLLM will serve -------------------------------------------------------------------


def read_model(model: str | None):
    """The local checkpoint's shape (coldcheck.ModelConfig), or None where `model` is not a
    local folder with a config.json (a hub id: vLLM downloads it and checks it itself)."""
    from .coldcheck import read_model_config

    if not model:
        return None
    cfg = pathlib.Path(model) / "config.json"
    try:
        st = cfg.stat()
    except FileNotFoundError:
        return None  # a hub id, or a folder without a config.json: vLLM says which
    except OSError as e:  # EACCES: a host folder the image's user cannot enter
        raise StartError(
            EXIT_USAGE,
            f"{cfg}: cannot be read as uid {os.getuid()} ({e.strerror})",
            "make the model folder readable to that user on the host (compose: MODEL_DIR, "
            "mounted at /models; the image runs as uid 2000)",
        ) from None
    fix = (
        "point the serve arguments at a checkpoint folder with the config.json of a "
        "Hugging Face model"
    )
    if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_CONFIG_BYTES:
        raise StartError(
            EXIT_USAGE, f"{cfg}: not a regular file of at most {MAX_CONFIG_BYTES >> 20} MiB", fix
        )
    try:
        found = read_model_config(model)
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        raise StartError(
            EXIT_USAGE, f"{cfg} cannot be read as a model config ({e!r})", fix
        ) from None
    if found is not None and not 1 <= found.num_layers <= settings.MAX_LAYER + 1:
        raise StartError(EXIT_USAGE, f"{cfg}: num_hidden_layers {found.num_layers}", fix)
    return found


def check_against_model(
    values: Mapping[str, Any], environ: Mapping[str, str], serve: serve_args.ServeArgs, model
) -> None:
    """Settings that must fit the model and the serve arguments, as vLLM will check them
    only after minutes of loading (or not at all)."""
    host = values["VLLM_EXPERT_HOST_LAYERS"] or frozenset()
    if model is not None and host and max(host) >= model.num_layers:
        raise settings.SettingError(
            "VLLM_EXPERT_HOST_LAYERS",
            environ["VLLM_EXPERT_HOST_LAYERS"],
            f"layer {max(host)} is beyond the model's {model.num_layers} layers "
            f"(0-{model.num_layers - 1})",
            "list only layers the model has, or unset it",
        )
    parts = values["VLLM_PP_LAYER_PARTITION"]
    if parts is None:
        return
    text = environ["VLLM_PP_LAYER_PARTITION"]
    if len(parts) != serve.pp:
        raise settings.SettingError(
            "VLLM_PP_LAYER_PARTITION",
            text,
            f"{len(parts)} stage(s), but the serve arguments ask for pipeline parallel "
            f"size {serve.pp}",
            f"give {serve.pp} layer count(s), one per stage, or change --pipeline-parallel-size",
        )
    if model is not None and sum(parts) != model.num_layers:
        raise settings.SettingError(
            "VLLM_PP_LAYER_PARTITION",
            text,
            f"the counts add up to {sum(parts)} layers, the model has {model.num_layers}",
            f"give counts that add up to {model.num_layers}, or unset it for vLLM's split",
        )


def api_key(
    values: Mapping[str, Any], environ: Mapping[str, str], serve: serve_args.ServeArgs
) -> str | None:
    """The key to put into VLLM_API_KEY (read from its file), or None where the key is
    already there (the environment, --api-key) or the user chose to serve without one."""
    if serve.api_keys is not None:
        if not all(serve.api_keys):
            raise StartError(
                EXIT_API_KEY,
                "--api-key is among the serve arguments without a key (or with an empty "
                "one): vLLM would then serve without a key, ignoring VLLM_API_KEY",
                "give the key after --api-key, or drop --api-key and set VLLM_API_KEY",
            )
        return None
    if values["VLLM_API_KEY"]:
        return None
    path = values["VLLM_API_KEY_FILE"]
    named = bool(environ.get("VLLM_API_KEY_FILE"))
    how = (
        "put the key (one line) in a Docker secret mounted at "
        f"{settings.DEFAULT_API_KEY_FILE} (compose: secrets), or the file VLLM_API_KEY_FILE "
        "names, or set VLLM_API_KEY in an env file (compose: env_file)"
    )
    if named or os.path.lexists(path):
        try:
            key = read_text(path, MAX_KEY_BYTES).strip()
        except ContractError as e:
            raise StartError(EXIT_API_KEY, f"VLLM_API_KEY_FILE={path}: {e}", how) from None
        if not key:
            raise StartError(EXIT_API_KEY, f"VLLM_API_KEY_FILE={path}: the file is empty", how)
        try:
            settings.BY_NAME["VLLM_API_KEY"].kind.parse(key)
        except settings.Invalid as e:
            raise StartError(EXIT_API_KEY, f"VLLM_API_KEY_FILE={path}: the key {e}", how) from None
        return key
    if values["EO_ALLOW_NO_API_KEY"]:
        say(
            "warning: no API key (EO_ALLOW_NO_API_KEY=1): anyone who reaches the port can "
            "use the model"
        )
        return None
    raise StartError(
        EXIT_API_KEY,
        "no API key: VLLM_API_KEY is unset, no --api-key is among the serve arguments and "
        f"{path} does not exist; the server would answer anyone who reaches its port",
        f"{how}; or, to serve without a key, set EO_ALLOW_NO_API_KEY=1",
    )


def missing_cold_file(cold: str, budget: float | None) -> StartError | None:
    """A cold file that was asked for and is not there is a mistake (a typo, a host path),
    not a reason to start with another placement."""
    p = pathlib.Path(cold)
    try:
        mode: int | None = p.stat().st_mode
    except FileNotFoundError:
        mode = None
    except OSError as e:  # EACCES: a host folder (COLD_DIR) the image's user cannot enter
        return StartError(
            EXIT_COLD_FILE,
            f"VLLM_EXPERT_COLD_FILE={cold}: cannot be read as uid {os.getuid()} ({e.strerror})",
            "make the cold folder and file readable to that user on the host (compose: "
            "COLD_DIR, mounted at /cold; the image runs as uid 2000)",
        )
    if mode is not None and stat.S_ISREG(mode):
        return None
    what = "no such file in the container"
    if mode is not None:
        what = "a directory, not a cold file" if stat.S_ISDIR(mode) else "not a regular file"
    notes = []
    if not cold.startswith(("/cold/", "/models/", "/state/")):
        notes.append(f"{cold} looks like a path on the host, not in the container")
    with contextlib.suppress(OSError):
        found = sorted(x.name for x in p.parent.glob("*.json"))[:20]
        if found:
            notes.append(f"{p.parent} has: {' '.join(found)}")
    if budget is not None:
        notes.append(
            f"for a budget-only start ({budget:g} GiB per card) leave COLD_FILE unset "
            "instead (VLLM_EXPERT_COLD_FILE empty)"
        )
    return StartError(
        EXIT_COLD_FILE,
        f"VLLM_EXPERT_COLD_FILE={cold}: {what}",
        "the path is read inside the container: put the file in the host folder mounted "
        "at /cold (compose: COLD_DIR, default ../cold) and set COLD_FILE=/cold/<its name>",
        notes,
    )


_held_fds: list[int] = []


def budget_only_start(
    values: Mapping[str, Any], environ: Mapping[str, str], serve: serve_args.ServeArgs, model
) -> dict[str, str]:
    """budget-start in this process: the cold file it wrote and the count file, as the
    environment vLLM gets."""
    from . import budget_start

    budget = values["EO_HOST_BUDGET_GIB"]
    if model is None:
        raise StartError(
            EXIT_BUDGET,
            f"EO_HOST_BUDGET_GIB={budget:g}: a budget-only start needs the model as a local "
            f"checkpoint folder with a config.json; the serve arguments name {serve.model!r}",
            "serve a folder mounted in the container (compose: MODEL_DIR at /models), or set "
            "COLD_FILE to a cold file made for the model",
        )
    state = pathlib.Path(values["EO_STATE_DIR"])
    partition = values["VLLM_PP_LAYER_PARTITION"]
    host = values["VLLM_EXPERT_HOST_LAYERS"] or frozenset()

    def log(line: str) -> None:  # budget-start's lines name it already
        print(line, file=sys.stderr, flush=True)

    try:
        start = budget_start.plan(model.path, budget, serve.pp, state, partition, log, host)
    except state_dir.StateDirError as e:  # "<problem>: fix: <fix>" or "<problem>; fix: <fix>"
        problem, _, fix = str(e).partition(" fix: ")
        raise StartError(EXIT_STATE, problem.rstrip(":; "), fix or "check EO_STATE_DIR") from None
    except (OSError, KeyError, ValueError, struct.error, OverflowError) as e:
        # SelectionError and CountsError are ValueErrors; struct.error: a cut safetensors file
        raise StartError(
            EXIT_BUDGET,
            f"budget-only start with EO_HOST_BUDGET_GIB={budget:g} in {state}: {e}",
            "change what the message names: the budget (EO_HOST_BUDGET_GIB, at most the "
            "routed experts of one pipeline stage), the checkpoint, the state folder "
            "(EO_STATE_DIR), or start from a cold file (COLD_FILE)",
        ) from None
    # the folder's lock stays held through the exec: vLLM inherits the descriptor, so a
    # second server on this folder is refused until this one exits, however it exits
    _held_fds.append(start.lock_fd)
    count = environ.get("VLLM_EXPERT_COUNT_FILE")
    if count and count != str(start.count_file):
        say(
            f"warning: VLLM_EXPERT_COUNT_FILE={count} is replaced by {start.count_file}: a "
            "budget-only start learns from the counts it keeps in EO_STATE_DIR"
        )
    return {
        "VLLM_EXPERT_COLD_FILE": str(start.cold_file),
        "VLLM_EXPERT_COUNT_FILE": str(start.count_file),
    }


def run_preflight(
    values: Mapping[str, Any],
    environ: Mapping[str, str],
    serve: serve_args.ServeArgs,
    cold_file: str | None,
) -> int:
    from . import preflight
    from .topologies import get_topology

    setup = preflight.Setup(
        model=serve.model,
        pp=serve.pp,
        tp=serve.tp,
        topology=get_topology(values["EO_TOPOLOGY"]),
        cold_file=cold_file,
        host_layers=environ.get("VLLM_EXPERT_HOST_LAYERS", ""),
        pp_partition=environ.get("VLLM_PP_LAYER_PARTITION", ""),
        ple_table=values["VLLM_PLE_TABLE"],
        one_table=values["VLLM_EXPERT_ONE_TABLE"],
        prefill_staging=values["VLLM_EXPERT_PREFILL_STAGING"],
        vmm_fail_at=set(values["VLLM_EXPERT_VMM_FAIL_AT"] or ()),
        # from a child process: no CUDA state of this process may reach the exec'd vLLM
        query_gpus=cuda_probe.query_gpus_in_child,
        probes=cuda_probe.probes_in_child,
    )
    code = preflight.run(setup, sorted(values["EO_PREFLIGHT_SKIP"] or ()))
    if not code and isinstance(environ, MutableMapping):
        # VLLM_PLE_TABLE=auto: vLLM takes the preflight's decision
        # (VLLM_PLE_TABLE_RESOLVED) instead of deciding again by its own figures
        environ.update(setup.exports)
    return code


def notes(values: Mapping[str, Any]) -> None:
    """One line for each odd value that is accepted."""
    if values["VLLM_EXPERT_SWAP_MARGIN"] < 0:
        say(
            f"warning: VLLM_EXPERT_SWAP_MARGIN={values['VLLM_EXPERT_SWAP_MARGIN']:g} is "
            "negative: every layer swaps at every decision (a stress test, not for serving)"
        )
    if values["VLLM_EXPERT_VMM_FAIL_AT"]:
        say("warning: VLLM_EXPERT_VMM_FAIL_AT makes driver calls fail on purpose (tests only)")
    if values["EO_SKIP_PREFLIGHT"]:
        say("EO_SKIP_PREFLIGHT=1: the preflight is skipped")


def prepare(argv: Sequence[str], environ: MutableMapping[str, str]) -> None:
    """Everything before the exec; leaves in `environ` what vLLM is to get."""
    serve = serve_args.parse(argv)
    if serve.model is None:  # vLLM would serve its default model, or the model named later
        raise serve_args.ServeArgsError(
            "no model: put the model first (`vllm serve MODEL [options]`, as the compose files "
            "do) or give --model MODEL"
        )
    values = settings.read(environ)
    model = read_model(serve.model)
    check_against_model(values, environ, serve, model)
    key = api_key(values, environ, serve)
    notes(values)
    for name in settings.empty_settings(environ):
        del environ[name]  # empty means unset, for vLLM too
    if key is not None:
        environ["VLLM_API_KEY"] = key
    cold = values["VLLM_EXPERT_COLD_FILE"]
    budget = values["EO_HOST_BUDGET_GIB"]
    if cold:
        missing = missing_cold_file(cold, budget)
        if missing is not None:
            raise missing
        if budget is not None:
            say(f"EO_HOST_BUDGET_GIB={budget:g} is not used: VLLM_EXPERT_COLD_FILE={cold} is")
    elif budget is not None:
        environ.update(budget_only_start(values, environ, serve, model))
        cold = environ["VLLM_EXPERT_COLD_FILE"]
    if not values["EO_SKIP_PREFLIGHT"]:
        code = run_preflight(values, environ, serve, cold)
        if code:
            raise StartError(code, "")  # the preflight has printed what failed and why


def print_help(argv: Sequence[str]) -> int:
    print(HELP)
    if shutil.which("vllm") is None:
        return 0
    # vLLM's help needs a platform it can use: where it has none (a CPU-only test
    # environment), say so instead of passing its traceback on
    r = subprocess.run(["vllm", "serve", *argv], capture_output=True, text=True)
    if r.returncode == 0:
        print(r.stdout, end="")
    else:
        print("(vllm serve --help did not run here: vLLM found no platform it can serve on;")
        print(" run it where vLLM serves, e.g. inside the image)")
    return 0


def wants_help(argv: Sequence[str]) -> bool:
    return any(a in ("-h", "--help") or a.startswith("--help=") for a in argv)


def main(argv: Sequence[str] | None = None) -> int:
    install_stop_handlers()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if wants_help(argv):
            return print_help(argv)
        prepare(argv, os.environ)
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            os.execvp("vllm", ["vllm", "serve", *argv])
        except OSError as e:
            raise StartError(
                EXIT_NO_VLLM,
                f"cannot run vllm: {e.strerror}",
                "run the image built from this repository, or put vLLM's `vllm` on PATH",
            ) from None
    except Stopped as s:
        return _stopped_line(s.signum)
    except serve_args.ServeArgsError as e:
        say(f"error: {e}")
        say("  fix: correct the `vllm serve` arguments (the container's command)")
        return EXIT_USAGE
    except settings.SettingError as e:
        say(f"error: {e}")
        say(f"  fix: {e.fix}")
        return EXIT_SETTING
    except StartError as e:
        if e.problem:
            say(f"error: {e.problem}")
            say(f"  fix: {e.fix}")
            for n in e.notes:
                say(f"  {n}")
        return e.code
    return 0  # not reached: the exec replaced this process
