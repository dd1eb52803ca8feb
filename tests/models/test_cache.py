"""The model cache of `model.packaged`: one location for every run directory and working directory (model.cache_dir,
else $GSPO_RAY_CACHE, else ~/.cache/gspo-ray), and an import that runs once when two jobs start together. Two real
processes in two working directories import through the cache with a cheap stand-in importer (the real SmolLM2
import, ~25 s, goes through the same path once in test_smollm2.py)."""
import multiprocessing as mp
import os
import time
from pathlib import Path

from gspo_ray.config import load_config
from gspo_ray.models.cache import CACHE_ENV, atomic_import, cache_root, packaged_model_dir


def _import(tmp: Path) -> None:
    """A stand-in import: slow enough that the two jobs overlap; records each run in the cache's log."""
    log = tmp.parent / "imports.log"
    with open(log, "a") as f:
        f.write(f"{os.getpid()}\n")
    time.sleep(1.0)
    tmp.mkdir(parents=True)
    (tmp / "model.safetensors").write_text("weights")


def _done(out: Path) -> bool:
    return (out / "model.safetensors").is_file()


def _job(workdir: str, cache: str, results) -> None:
    os.chdir(workdir)  # a run directory of its own, relative to its own working directory
    cfg = load_config(None, ["model.tiny=null", "model.packaged=smollm2-135m-instruct", f"model.cache_dir={cache}"])
    out = atomic_import(packaged_model_dir(cfg.model.packaged, cfg.model.cache_dir), _import, _done)
    results.put((str(cfg.run_dir.absolute()), str(out)))


def test_two_jobs_in_two_working_directories_import_once(tmp_path):
    cache = tmp_path / "cache"
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        procs.append(ctx.Process(target=_job, args=(str(tmp_path / name), str(cache), results)))
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    got = sorted(results.get(timeout=5) for _ in procs)
    run_dirs, outs = [r for r, _ in got], {o for _, o in got}
    assert run_dirs[0] != run_dirs[1]  # two run directories
    assert outs == {str(cache / "models" / "smollm2-135m-instruct")}  # one model directory
    assert len((cache / "models" / "imports.log").read_text().split()) == 1  # imported once
    assert sorted(p.name for p in (cache / "models").iterdir()) == [".smollm2-135m-instruct.lock", "imports.log",
                                                                    "smollm2-135m-instruct"]  # no temp dir left


def test_a_failed_import_leaves_nothing_a_later_job_would_take(tmp_path):
    def broken(tmp):
        tmp.mkdir()
        (tmp / "config.json").write_text("{}")
        raise RuntimeError("killed mid-import")

    out = tmp_path / "models" / "m"
    try:
        atomic_import(out, broken, _done)
    except RuntimeError:
        pass
    assert not out.exists() and [p.name for p in out.parent.iterdir()] == [".m.lock"]


def test_the_cache_location(tmp_path, monkeypatch):
    monkeypatch.delenv(CACHE_ENV, raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert cache_root() == Path.home() / ".cache" / "gspo-ray"
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "env"))
    assert packaged_model_dir("m") == tmp_path / "env" / "models" / "m"
    assert packaged_model_dir("m", tmp_path / "cfg") == tmp_path / "cfg" / "models" / "m"  # model.cache_dir wins
