"""The bytecode cache (bytecode.py): where the environment keeps no bytecode, a component
process keeps it in the compile cache, reads it on its next start, shares it safely with
another run, and imports without it (reported) when an entry is damaged."""

from __future__ import annotations

import compileall
import gc
import json
import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rlinf_twoworker.bytecode import BytecodeCache, bulk_imports, cache_dir, without_bytecode

MODULES = 40
SCRIPT = r"""
import json, sys
from pathlib import Path
from rlinf_twoworker.bytecode import BytecodeCache

root = Path(sys.argv[1])
cache = BytecodeCache()
cache.use(root, "rollout:0", samples={"fakepkg": ("__init__.py", "m0.py")})
def load():
    import importlib
    return [importlib.import_module(f"fakepkg.m{i}").VALUE for i in range(int(sys.argv[2]))]
values = cache.guarded(load, "rollout:0")
import fakepkg.m0
print(json.dumps({**cache.take(), "values": values, "cached": fakepkg.m0.__cached__,
                  "prefix": sys.pycache_prefix}))
"""


def make_package(where: Path, modules: int = MODULES) -> Path:
    pkg = where / "fakepkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    for i in range(modules):
        body = "\n".join(f"def f{j}(x):\n    return x + {j}\n" for j in range(50))
        (pkg / f"m{i}.py").write_text(f"{body}\nVALUE = {i}\n")
    return pkg


def run(site: Path, root: Path, modules: int = MODULES) -> dict:
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(root), str(modules)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def pyc_times(root: Path) -> dict[str, int]:
    return {str(p): p.stat().st_mtime_ns for p in root.rglob("*.pyc")}


def test_bytecode_is_kept_in_the_cache_only_where_the_environment_keeps_none(tmp_path):
    pkg = make_package(tmp_path / "site")
    root = tmp_path / "cache"
    first = run(tmp_path / "site", root)
    assert first["values"] == list(range(MODULES))
    assert first["prefix"] == str(cache_dir(root))
    assert first["lines"][0].startswith(f"rollout:0 cold {cache_dir(root)}")
    assert Path(first["cached"]).is_file() and first["cached"].startswith(first["prefix"])
    assert not (pkg / "__pycache__").exists()  # the sources' directories stay untouched
    written = pyc_times(root)
    assert len(written) == MODULES + 1

    second = run(tmp_path / "site", root)  # the next start reads what the first wrote
    assert second["lines"][0].startswith("rollout:0 warm") and second["warnings"] == []
    assert pyc_times(root) == written  # read, not compiled and written again

    compileall.compile_dir(str(pkg), quiet=1)  # an environment with its bytecode: unchanged
    third = run(tmp_path / "site", tmp_path / "other-cache")
    assert third["prefix"] is None and third["lines"] == []
    assert not (tmp_path / "other-cache").exists()


def test_a_damaged_entry_falls_back_to_importing_without_the_cache_and_is_reported(tmp_path):
    make_package(tmp_path / "site")
    root = tmp_path / "cache"
    first = run(tmp_path / "site", root)
    damaged = Path(first["cached"])
    data = damaged.read_bytes()
    damaged.write_bytes(data[:16] + b"\xff" * (len(data) - 16))  # header valid, code not
    again = run(tmp_path / "site", root)
    assert again["values"] == list(range(MODULES))  # imported all the same
    assert again["prefix"] is None  # the process went on without the cache
    (warning,) = again["warnings"]
    assert warning.startswith(f"rollout:0 unreadable entry in {cache_dir(root)}")
    assert "imported without the cache" in warning


def test_two_runs_sharing_one_cache_both_import_and_a_third_reads_it(tmp_path):
    make_package(tmp_path / "site", 200)
    root = tmp_path / "cache"
    with ThreadPoolExecutor(2) as pool:  # two processes writing the same entries at once
        both = list(pool.map(lambda _: run(tmp_path / "site", root, 200), range(2)))
    assert all(b["values"] == list(range(200)) and b["warnings"] == [] for b in both)
    written = pyc_times(root)
    assert len(written) == 201
    third = run(tmp_path / "site", root, 200)
    assert third["lines"][0].startswith("rollout:0 warm") and third["warnings"] == []
    assert pyc_times(root) == written  # every entry was whole: read, none rewritten


def test_sampled_modules_without_bytecode_are_found(tmp_path, monkeypatch):
    pkg = make_package(tmp_path / "site", 2)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    samples = {"fakepkg": ("__init__.py", "m1.py", "absent.py"), "no_such_pkg_here": ("x.py",)}
    assert without_bytecode(samples) == [str(pkg / "__init__.py"), str(pkg / "m1.py")]
    monkeypatch.setattr(sys, "dont_write_bytecode", False)  # Python writes them itself
    assert without_bytecode(samples) == []
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    compileall.compile_dir(str(pkg), quiet=1)
    assert without_bytecode(samples) == []
    cache = BytecodeCache()
    cache.use(None, "rollout:0", samples)  # the compile cache off: nothing to keep it in
    assert cache.directory is None and cache.take() == {"lines": [], "warnings": []}


def test_the_preflights_import_check_uses_the_cache_and_retries_a_damaged_entry_without_it(
    tmp_path, monkeypatch
):
    """The probe's imports run in processes of their own: they keep bytecode where the probe
    does, and an import that fails there is tried once more without the cache."""
    from rlinf_twoworker.cluster import probe

    make_package(tmp_path / "site", 2)
    root = tmp_path / "cache"
    run(tmp_path / "site", root, 2)  # the cache holds both modules now
    (m0,) = root.rglob("m0.*.pyc")
    m0.write_bytes(m0.read_bytes()[:16] + b"\xff" * 64)  # damaged
    (m1,) = root.rglob("m1.*.pyc")
    m1.unlink()  # absent: the check's process writes it
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setattr(probe, "_CORES_PER_IMPORT_PROCESS", 1)  # processes even on 2 cores
    monkeypatch.setattr(sys, "pycache_prefix", str(cache_dir(root)))
    versions, failed = probe.import_in_subprocesses(["fakepkg.m0", "fakepkg.m1"])
    assert failed == [] and set(versions) == {"fakepkg.m0", "fakepkg.m1"}
    assert list(root.rglob("m1.*.pyc"))  # written by the check, into the probe's cache


def test_the_caches_lines_go_to_main_log_and_its_warnings_to_the_driver_log_too(tmp_path):
    from rlinf_twoworker.run.lifecycle import log_bytecode_cache
    from rlinf_twoworker.storage.rundir import DRIVER_LOG, MAIN_LOG, RunLog

    (tmp_path / MAIN_LOG).parent.mkdir(parents=True)
    log = RunLog(tmp_path)
    log_bytecode_cache(log, {"lines": ["rollout:0 warm /c"], "warnings": ["actor:0 not used"]})
    log_bytecode_cache(log, None)  # a process that reported nothing (an older worker)
    main = (tmp_path / MAIN_LOG).read_text()
    assert "BYTECODE_CACHE rollout:0 warm /c" in main and "BYTECODE_CACHE actor:0 not used" in main
    driver = (tmp_path / DRIVER_LOG).read_text()
    assert driver == "BYTECODE_CACHE actor:0 not used\n"


def test_a_cache_others_can_write_is_not_used_and_said_once(tmp_path):
    make_package(tmp_path / "site", modules=3)
    root = tmp_path / "cache"
    root.mkdir()
    os.chmod(root, 0o777)  # anyone could plant bytecode there: Python would run it
    done = run(tmp_path / "site", root, modules=3)
    assert done["values"] == [0, 1, 2] and done["prefix"] is None and done["lines"] == []
    assert len(done["warnings"]) == 1 and "writable by others" in done["warnings"][0]
    assert not list(root.rglob("*.pyc"))


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_bulk_imports_pause_the_collector_and_freeze_what_they_made():
    try:
        with bulk_imports():
            assert not gc.isenabled()
            made = _Cycle()  # what an import leaves: alive, and held by a cycle
        assert gc.isenabled()
        assert gc.get_freeze_count() > 0
        assert not any(obj is made for obj in gc.get_objects())  # out of the collector's view
        with bulk_imports():
            pass
        gc.disable()  # a caller that had the collector off keeps it off
        with bulk_imports():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
        gc.unfreeze()


def test_overlapping_bulk_imports_in_threads_turn_the_collector_on_when_the_last_ends():
    inside, leave = threading.Event(), threading.Event()

    def importer() -> None:
        with bulk_imports():
            inside.set()
            leave.wait(30)

    thread = threading.Thread(target=importer)
    try:
        thread.start()
        assert inside.wait(30)
        with bulk_imports():
            pass
        assert not gc.isenabled()  # the thread's block still runs
        leave.set()
        thread.join(30)
        assert gc.isenabled()
    finally:
        leave.set()
        gc.enable()
        gc.unfreeze()
